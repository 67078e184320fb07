// The `jbg_quantize_pair` XLA FFI handler: both MX quantizations of a bf16 matrix in one pass, by a CuTeDSL kernel
// (kernels/quantize_pair.py): its bf16 values with blocks of 32 along the rows, and its FP8 codes and E8M0 scales
// with blocks of 32 along the columns. mx_ragged_dot's MX recipes run it on the weights of a training step.
//
// INSTANTIATE loads the kernel object per device (kernel_objects.h);
// EXECUTE checks the buffers against what the kernel reads and writes and launches on XLA's stream.
#ifndef JBG_FFI_QUANTIZE_PAIR_H_
#define JBG_FFI_QUANTIZE_PAIR_H_

#include <cstdint>
#include <string>

#include "kernel_objects.h"

namespace jbg {

inline constexpr const char kQuantizePairTarget[] = "jbg_quantize_pair";

struct QuantizePairDims {
  int32_t rows = 0, cols = 0;  // w as a (rows, cols) matrix: leading dims folded into rows
};

// Checks the buffers of one call in FFI order: w, then values, codes, scales. w (..., R, C) bfloat16 with R and C
// positive multiples of 32; values bfloat16 and codes float8_e4m3fn or float8_e5m2 of w's shape; scales uint8
// (..., R, C/32). rows = the product of w's leading dims and R, cols = C, below 2**31 each, and the scales (and the
// kernel's tiles of 32 x 256) fewer than 2**31; w, values and codes may hold more elements (the kernel addresses
// them in 64 bits). Every buffer 16-byte aligned. Fills `dims`; returns "" when they fit, else a message naming the
// buffer.
std::string CheckQuantizePairBuffers(const BufferDesc* buffers, QuantizePairDims* dims);

}  // namespace jbg

extern "C" XLA_FFI_Error* JbgQuantizePairInstantiate(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JbgQuantizePairExecute(XLA_FFI_CallFrame* call_frame);

#endif  // JBG_FFI_QUANTIZE_PAIR_H_
