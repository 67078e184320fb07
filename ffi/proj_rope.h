// The `jbg_gemm_proj_rope_mxfp8` XLA FFI handler: the DeepSeek-V3 MLA Q up-projection by a CuTeDSL kernel
// (GEMM, per-head RoPE, rowwise and columnwise MXFP8 E4M3 quantization; SPEC §5).
//
// INSTANTIATE loads the kernel object per device (kernel_objects.h);
// EXECUTE checks every buffer against what the kernel reads and writes and launches on XLA's stream.
#ifndef JBG_FFI_PROJ_ROPE_H_
#define JBG_FFI_PROJ_ROPE_H_

#include <cstdint>
#include <string>

#include "kernel_objects.h"

namespace jbg {

inline constexpr const char kProjRopeTarget[] = "jbg_gemm_proj_rope_mxfp8";
inline constexpr int64_t kHeadDim = 192;  // SPEC §5: 128 pass-through + 64 rotary features per head
inline constexpr int64_t kRopeDim = 64;

struct ProjRopeDims {
  int32_t t = 0, k = 0, h = 0;
};

// Checks x, w, cos, sin, row codes, row scales, col codes, col scales (in that order; bf16 inputs, one group)
// against the kernel's contract; fills `*dims`. Returns "" when they fit, else a message naming the buffer.
std::string CheckProjRopeBuffers(const BufferDesc (&buffers)[8], bool w_out_in, ProjRopeDims* dims);

}  // namespace jbg

extern "C" XLA_FFI_Error* JbgProjRopeInstantiate(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JbgProjRopeExecute(XLA_FFI_CallFrame* call_frame);

#endif  // JBG_FFI_PROJ_ROPE_H_
