// The `jbg_dequantize_mxfp8` XLA FFI handler: MXFP8 E4M3 codes times their E8M0 block scales as bfloat16, by a
// CuTeDSL kernel (kernels/dequantize.py), for one operand or two in one launch. The MXFP8 proj_rope path runs it on
// w and x together before the bf16 kernel.
//
// INSTANTIATE loads the kernel object per device (kernel_objects.h);
// EXECUTE checks the buffers against what the kernel reads and writes and launches on XLA's stream.
#ifndef JBG_FFI_DEQUANTIZE_H_
#define JBG_FFI_DEQUANTIZE_H_

#include <cstdint>
#include <string>

#include "kernel_objects.h"

namespace jbg {

inline constexpr const char kDequantizeTarget[] = "jbg_dequantize_mxfp8";
inline constexpr int64_t kMxBlock = 32;  // codes per E8M0 scale

struct DequantizeDims {
  int32_t rows = 0, cols = 0;  // the codes as a (rows, cols) matrix: leading dims folded into rows
};

// Checks the buffers of one call in FFI order, `inputs` then `outputs`: codes, scales[, codes1, scales1], out[,
// out1]. Operand 0: codes (..., R, C) float8_e4m3fn (C a multiple of 32; R too for scale_axis -2), scales uint8
// (..., R, C/32) for scale_axis -1 or (..., R/32, C) for -2, out bfloat16 (..., R, C). Operand 1, when present,
// the same with its scales along the last axis. Fills `dims` (operand 1's stay 0 without it). Returns "" when they
// fit, else a message naming the buffer.
std::string CheckDequantizeBuffers(const BufferDesc* buffers, size_t inputs, size_t outputs, int64_t scale_axis,
                                   DequantizeDims (&dims)[2]);

}  // namespace jbg

extern "C" XLA_FFI_Error* JbgDequantizeInstantiate(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JbgDequantizeExecute(XLA_FFI_CallFrame* call_frame);

#endif  // JBG_FFI_DEQUANTIZE_H_
