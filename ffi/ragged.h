// The `jbg_ragged_gemm_amax` XLA FFI handler: the mixture-of-experts GEMM, tokens sorted by group, C[rows of group
// g] = alpha·(A·sfa)(B[g]·sfb)^T and amax = max|C| per batch, in one launch driven by a table of work items that the
// program computes on the device (kernels/sm90/ragged.py, op "ragged").
//
// INSTANTIATE parses `ab_dtype`, `c_dtype`, `sf_dtype`, `sf_vec_size` and `b_major` (what the objects were compiled
// for) and loads the object table (kernel_objects.h). EXECUTE checks every buffer, zeroes amax on XLA's stream,
// poisons C when asked (JAX_BLOCKGEMM_POISON_OUTPUTS) and runs the function. The items' values need no check: the
// kernel clamps each one into range (into its row tile, or for group-local items to at most one tile from its first
// row; below T and below G).
//
// The bf16 objects (ab_dtype "bfloat16", sf_dtype "none", sf_vec_size 0; C float32 or bfloat16) take bfloat16 a
// (L, T, K) and b (L, G, N, K) for b_major "k" or (L, G, K, N) for "n", and read neither sfa nor sfb (uint8 buffers
// of zero elements, whose addresses go unchecked) nor alpha (passed all the same: ones). Every other format takes
// b_major "k".
//
// The swap_ab objects (a_dtype "bfloat16" with ab_dtype "float8_e4m3fn" and E8M0 scales per 32, or "float4_e2m1fn"
// with E8M0 per 32 or float8_e4m3fn per 16; b_major "k", C float32 or bfloat16) take the tokens already dequantized:
// a bfloat16 (L, T, K256), K256 = K rounded up to 256, each 128 columns permuted (swap_ab_layout.swap_ab_tokens); b the
// codes (L, G, N, K) (packed FP4: K/2) with sfb their scales compact, (L*G, N, ceil(K/block)); sfa an empty uint8
// buffer; alpha one float32 per weight, (L*G,).
#ifndef JBG_FFI_RAGGED_H_
#define JBG_FFI_RAGGED_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "kernel_objects.h"

namespace jbg {

inline constexpr const char kRaggedTarget[] = "jbg_ragged_gemm_amax";
inline constexpr int64_t kItemFields = 4;  // (row tile or 0, group or -1, first row, end row) per work item
inline constexpr int64_t kSwapAbKPad = 256;  // the swap_ab objects' tokens: K rounded up to a multiple of this

// The launch's sizes: t tokens (rows of A and C), n, the logical k (twice the bytes of a packed FP4 row), l
// batches, g groups (weights per batch) and max_items work items per batch (the launch's grid rows); and, for the
// swap_ab objects, sfb's form (sf_atom: 1 for SPEC §3's atoms, 0 compact).
struct RaggedDims {
  int32_t t = 0, n = 0, k = 0, l = 0, g = 0, max_items = 0, sf_atom = 0;
};

// Parses the instantiate attributes into `*out` (alpha is always true: every object takes alpha). The formats are
// the sm_90a kernel's: FP8 or FP4 codes with E8M0 scales per 32, or FP4 codes with float8_e4m3fn scales per 16,
// all with b_major "k"; or bfloat16 operands with no scales ("none", 0), a float32 or bfloat16 C and b_major "k" or
// "n" (out->ab_bf16, out->b_mn). a_dtype is ab_dtype's but for the swap_ab objects (out->a_bf16, above: MXFP8 E4M3,
// MXFP4 or NVFP4 codes, bfloat16 tokens). Returns "" or what is wrong.
std::string ParseRaggedAttributes(std::string_view ab_dtype, std::string_view a_dtype, std::string_view c_dtype,
                                  std::string_view sf_dtype, int64_t sf_vec_size, std::string_view b_major,
                                  KernelDtypes* out);

// Checks a, b, sfa, sfb, items, c, amax, alpha (the ABI order) against what the kernel reads and writes, for
// objects compiled for `kernel`; fills `*dims` (n and k logical, whatever b's major). Every buffer but b holds fewer
// than 2**31 elements; b may hold more (TMA addresses it by weight) when one weight (N, K) and L·G fit. Returns ""
// when they fit, else a message naming the buffer, what it is and what is allowed.
std::string CheckRaggedBuffers(const BufferDesc (&buffers)[8], const KernelDtypes& kernel, RaggedDims* dims);

}  // namespace jbg

extern "C" XLA_FFI_Error* JbgRaggedInstantiate(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JbgRaggedExecute(XLA_FFI_CallFrame* call_frame);

#endif  // JBG_FFI_RAGGED_H_
