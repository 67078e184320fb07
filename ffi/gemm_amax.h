// The `jbg_gemm_amax` XLA FFI handler: C = (A·sfa)(B·sfb)^T and amax = max|C| per batch, by a CuTeDSL kernel.
//
// Two stages. INSTANTIATE (once per call site, when XLA builds the executable) parses `ab_dtype`, `c_dtype`,
// `sf_dtype`, `sf_vec_size`, `a_major` and `b_major` (what the objects were compiled for) and loads the object
// table (kernel_objects.h); `cluster_ctas` says, per object, whether its function takes max_ctas (the persistent
// grid, which instantiation works out per device) and its cluster size. EXECUTE checks the buffers,
// zeroes amax on XLA's stream and runs the function: no loading, no allocation, no host synchronization.
#ifndef JBG_FFI_GEMM_AMAX_H_
#define JBG_FFI_GEMM_AMAX_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "kernel_objects.h"

namespace jbg {

inline constexpr const char kGemmAmaxTarget[] = "jbg_gemm_amax";
inline constexpr int64_t kScaleBlock = 32;  // MXFP8 / MXFP4: one E8M0 scale per 32 elements along K (NVFP4: 16)

struct GemmDims {
  int32_t m = 0, n = 0, k = 0, l = 0;
};

// Checks a, b, sfa, sfb, c, amax and, when `count` is 7, alpha (in that order) against what the kernel reads and
// writes; fills `*dims` (k is the logical K: twice the bytes of a row of packed FP4 codes). `c_rows_16_bytes`: the
// kernel stores C by TMA, so each row of C must be a multiple of 16 bytes.
// Returns "" when they fit, else a message naming the buffer, what it is and what is allowed.
std::string CheckGemmAmaxBuffers(const BufferDesc* buffers, size_t count, KernelDtypes kernel, GemmDims* dims,
                                 bool c_rows_16_bytes = false);

// Parses the `ab_dtype` / `c_dtype` / `sf_dtype` / `sf_vec_size` / `a_major` / `b_major` attributes
// ("float8_e4m3fn", "float32", "float8_e8m0fnu", 32, "k", "k", ...; FP4 as "float4_e2m1fn"); returns "" or what is
// wrong.
std::string ParseKernelDtypes(std::string_view ab_dtype, std::string_view c_dtype, std::string_view sf_dtype,
                              int64_t sf_vec_size, std::string_view a_major, std::string_view b_major,
                              KernelDtypes* out);

}  // namespace jbg

// The bound handlers (C symbols so that a capsule or ctypes can reach them).
extern "C" XLA_FFI_Error* JbgGemmAmaxInstantiate(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JbgGemmAmaxExecute(XLA_FFI_CallFrame* call_frame);

#endif  // JBG_FFI_GEMM_AMAX_H_
