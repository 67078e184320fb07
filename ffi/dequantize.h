// The `jbg_dequantize_mxfp8` XLA FFI handler: MXFP8 E4M3 codes times their E8M0 block scales as bfloat16, by a
// CuTeDSL kernel (kernels/dequantize.py). The MXFP8 proj_rope path runs it on x and w before the bf16 kernel.
//
// INSTANTIATE loads the kernel object per device (kernel_objects.h);
// EXECUTE checks the three buffers against what the kernel reads and writes and launches on XLA's stream.
#ifndef JBG_FFI_DEQUANTIZE_H_
#define JBG_FFI_DEQUANTIZE_H_

#include <cstdint>
#include <string>

#include "kernel_objects.h"

namespace jbg {

inline constexpr const char kDequantizeTarget[] = "jbg_dequantize_mxfp8";
inline constexpr int64_t kMxBlock = 32;  // codes per E8M0 scale
inline constexpr int64_t kRunMultiple = 32;  // each kernel thread converts a run of 16 or 32 codes of a row

struct DequantizeDims {
  int32_t rows = 0, cols = 0;  // the codes as a (rows, cols) matrix: leading dims folded into rows
};

// Checks codes (..., R, C) float8_e4m3fn (C a multiple of 32; R too for scale_axis -2), scales uint8
// (..., R, C/32) for scale_axis -1 or (..., R/32, C) for -2,
// out bfloat16 (..., R, C) against the kernel's contract; fills `*dims`. Returns "" when they fit, else a message
// naming the buffer.
std::string CheckDequantizeBuffers(const BufferDesc (&buffers)[3], int64_t scale_axis, DequantizeDims* dims);

}  // namespace jbg

extern "C" XLA_FFI_Error* JbgDequantizeInstantiate(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JbgDequantizeExecute(XLA_FFI_CallFrame* call_frame);

#endif  // JBG_FFI_DEQUANTIZE_H_
