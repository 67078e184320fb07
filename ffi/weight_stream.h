// The `jbg_weight_stream` XLA FFI handler: the decode GEMM C = x·(w·sw)^T · alpha and amax = max|C| per batch, for
// few rows of bf16 activations x against a block-scaled weight w that the kernel streams once (kernels/catalog.py,
// op "weight_stream").
//
// INSTANTIATE parses `w_dtype`, `c_dtype`, `sf_dtype`, `sf_vec_size` and `max_m` (what the objects were compiled
// for) and loads the object table (kernel_objects.h); `zero_amax` is read at execution. EXECUTE checks every buffer,
// zeroes amax on XLA's stream unless `zero_amax` is 0 (a caller that drops amax), poisons C when asked
// (JAX_BLOCKGEMM_POISON_OUTPUTS) and runs the function; it never launches on sizes the kernel cannot take.
#ifndef JBG_FFI_WEIGHT_STREAM_H_
#define JBG_FFI_WEIGHT_STREAM_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "kernel_objects.h"

namespace jbg {

inline constexpr const char kWeightStreamTarget[] = "jbg_weight_stream";

// The launch's sizes. k is the logical K (twice the bytes of a packed FP4 row); sf_atom is 0 for compact scales
// (L, N, ceil(K/v)) and 1 for the 128x4 atom form (L, ceil(N/128), ceil(ceil(K/v)/4), 32, 4, 4).
struct WeightStreamDims {
  int32_t m = 0, n = 0, k = 0, l = 0, sf_atom = 0;
};

// Parses the instantiate attributes into `*out` (ab: the dtype of w's buffer; alpha is always true: every object
// takes alpha) and checks `max_m`, the most rows of x the objects take. Returns "" or what is wrong.
std::string ParseWeightStreamAttributes(std::string_view w_dtype, std::string_view c_dtype,
                                        std::string_view sf_dtype, int64_t sf_vec_size, int64_t max_m,
                                        KernelDtypes* out);

// Checks x, w, sw, c, amax, alpha (the ABI order) against what the kernel reads and writes, for objects compiled
// for `kernel` that take at most `max_m` rows; fills `*dims`. Returns "" when they fit, else a message naming the
// buffer, what it is and what is allowed.
std::string CheckWeightStreamBuffers(const BufferDesc (&buffers)[6], const KernelDtypes& kernel, int64_t max_m,
                                     WeightStreamDims* dims);

}  // namespace jbg

extern "C" XLA_FFI_Error* JbgWeightStreamInstantiate(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JbgWeightStreamExecute(XLA_FFI_CallFrame* call_frame);

#endif  // JBG_FFI_WEIGHT_STREAM_H_
