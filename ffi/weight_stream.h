// The `jbg_weight_stream` XLA FFI handler: the decode GEMM C = x·(w·sw)^T · alpha and amax = max|C| per batch, for
// few rows of bf16 activations x against a block-scaled weight w that the kernel streams once (kernels/catalog.py,
// op "weight_stream").
//
// INSTANTIATE parses `w_dtype`, `c_dtype`, `sf_dtype`, `sf_vec_size` and `max_m` (what the objects were compiled for),
// loads the object table (kernel_objects.h) and allocates, per device, the call site's zeroed amax tally for
// `amax_batches` (L) batches, none when it is 0 (the caller drops amax). EXECUTE checks every buffer, poisons C (and
// amax where there is a tally) when asked (JAX_BLOCKGEMM_POISON_OUTPUTS) and runs the function, which writes amax whole
// where there is a tally (nothing zeroes it first: one launch per call on XLA's stream) and leaves it unwritten where
// there is none; it never launches on sizes the kernel cannot take.
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
// takes alpha) and checks `max_m`, the most rows of x the objects take, and `amax_batches`, the L the call site's
// amax tally is sized for (0: no tally, the caller drops amax). Returns "" or what is wrong.
std::string ParseWeightStreamAttributes(std::string_view w_dtype, std::string_view c_dtype,
                                        std::string_view sf_dtype, int64_t sf_vec_size, int64_t max_m,
                                        int64_t amax_batches, KernelDtypes* out);

// Checks x, w, sw, c, amax, alpha (the ABI order) against what the kernel reads and writes, for objects compiled
// for `kernel` that take at most `max_m` rows; fills `*dims`. Returns "" when they fit, else a message naming the
// buffer, what it is and what is allowed.
std::string CheckWeightStreamBuffers(const BufferDesc (&buffers)[6], const KernelDtypes& kernel, int64_t max_m,
                                     WeightStreamDims* dims);

}  // namespace jbg

extern "C" XLA_FFI_Error* JbgWeightStreamInstantiate(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JbgWeightStreamExecute(XLA_FFI_CallFrame* call_frame);

#endif  // JBG_FFI_WEIGHT_STREAM_H_
