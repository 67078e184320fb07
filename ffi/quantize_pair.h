// The `jbg_quantize_pair` XLA FFI handler: both MX quantizations of a bf16 matrix in one pass, by a CuTeDSL kernel
// (kernels/quantize_pair.py): its bf16 values with blocks of 32 along the rows, and its FP8 codes and E8M0 scales
// with blocks of 32 along the columns. mx_ragged_dot's MX recipes run it on the weights of a training step, and
// (the gather schedules: the rows through a row map, the column blocks as codes or bf16 values) on its tokens.
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

// What a kernel object does (its catalog schedule, the `schedule` attribute): both quantizations of w (kPlain), or
// the row blocks' rows through a row map with the column blocks as codes (kGather) or as bf16 values
// (kGatherValues).
enum class QuantizePairSchedule : int64_t { kPlain = 0, kGather = 1, kGatherValues = 2 };

struct QuantizePairDims {
  // the row-blocked matrix (rows, cols): w's leading dims folded into rows, or the map's length; src_rows: w's rows
  int32_t rows = 0, cols = 0, src_rows = 0;
};

// Checks the buffers of one call in FFI order: w, the row map (the gather schedules only), then values, codes,
// scales. w (..., R, C) bfloat16 with C a positive multiple of 32, R too for kPlain; the map int32 (..., R') with R'
// a positive multiple of 32; values bfloat16 of w's shape (kPlain) or of the map's shape and C; codes of w's shape,
// float8_e4m3fn or float8_e5m2 (bfloat16 for kGatherValues); scales uint8 (..., R, C/32). rows, src_rows (the
// product of w's leading dims and R) and cols below 2**31 each, and the scales (and the kernel's tiles of 32 x 256)
// fewer than 2**31; w, values and codes may hold more elements (the kernel addresses them in 64 bits). Every buffer
// 16-byte aligned. Fills `dims`; returns "" when they fit, else a message naming the buffer.
std::string CheckQuantizePairBuffers(const BufferDesc* buffers, QuantizePairSchedule schedule,
                                     QuantizePairDims* dims);

}  // namespace jbg

extern "C" XLA_FFI_Error* JbgQuantizePairInstantiate(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JbgQuantizePairExecute(XLA_FFI_CallFrame* call_frame);

#endif  // JBG_FFI_QUANTIZE_PAIR_H_
