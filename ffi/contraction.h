// The `jbg_grouped_contraction` XLA FFI handler: the per-group contraction over tokens, the weight gradient of a
// mixture-of-experts GEMM, tokens sorted by group: c[l, g] = x[l, rows of g]^T · y[l, rows of g] and amax = max|c|
// per batch, in one launch (kernels/sm90/contraction.py, op "contraction").
//
// INSTANTIATE parses `ab_dtype` and `c_dtype` (what the objects were compiled for) and loads the object table
// (kernel_objects.h). EXECUTE checks every buffer, zeroes amax on XLA's stream, poisons C when asked
// (JAX_BLOCKGEMM_POISON_OUTPUTS) and runs the function. The bounds' values need no check: the kernel clamps each one
// into [0, T].
//
// The objects (ab_dtype "bfloat16"; C float32 or bfloat16) take bfloat16 x (L, T, K) and y (L, T, N), int32 bounds
// (L, G, 2) (the rows [start, end) of each group) and write c (L, G, K, N) and amax (L,) float32.
#ifndef JBG_FFI_CONTRACTION_H_
#define JBG_FFI_CONTRACTION_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "kernel_objects.h"

namespace jbg {

inline constexpr const char kContractionTarget[] = "jbg_grouped_contraction";
inline constexpr int64_t kBoundFields = 2;  // (start, end) per group

// The launch's sizes: t tokens (rows of x and y), k and n (the columns of x and y: c's (K, N) slices), l batches
// and g groups per batch.
struct ContractionDims {
  int32_t t = 0, k = 0, n = 0, l = 0, g = 0;
};

// Parses the instantiate attributes into `*out`: bfloat16 operands (out->ab_bf16, no scales) and a float32 or
// bfloat16 C. Returns "" or what is wrong.
std::string ParseContractionAttributes(std::string_view ab_dtype, std::string_view c_dtype, KernelDtypes* out);

// Checks x, y, bounds, c, amax (the ABI order) against what the kernel reads and writes, for objects compiled for
// `kernel`; fills `*dims`. Every buffer but c holds fewer than 2**31 elements; c may hold more (the kernel addresses
// it in 64 bits) when one (K, N) slice and L·G fit. Returns "" when they fit, else a message naming the buffer, what
// it is and what is allowed.
std::string CheckContractionBuffers(const BufferDesc (&buffers)[5], const KernelDtypes& kernel,
                                    ContractionDims* dims);

}  // namespace jbg

extern "C" XLA_FFI_Error* JbgContractionInstantiate(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JbgContractionExecute(XLA_FFI_CallFrame* call_frame);

#endif  // JBG_FFI_CONTRACTION_H_
