// The `jbg_gemm_amax` XLA FFI handler: C = (A·sfa)(B·sfb)^T and amax = max|C| per batch, by a CuTeDSL kernel.
//
// Two stages. INSTANTIATE (once per call site, when XLA builds the executable) reads the attributes — `archs`,
// `function_prefixes` (comma-separated), `objects` (the kernel objects concatenated, uint8), `offsets` (int64,
// one more than objects), `ab_dtype` and `c_dtype` (what the objects were compiled for) — picks the object for each
// visible device's compute capability, checks its bytes (object_check.h), loads it through the DSL runtime and
// keeps the functions in the call site's state. EXECUTE checks the buffers, zeroes amax on XLA's
// stream and runs the function: no loading, no allocation, no host synchronization.
#ifndef JBG_FFI_GEMM_AMAX_H_
#define JBG_FFI_GEMM_AMAX_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"
#include "cuda_driver.h"
#include "dsl_runtime.h"

namespace jbg {

inline constexpr const char kGemmAmaxTarget[] = "jbg_gemm_amax";
inline constexpr const char kGemmAmaxStateType[] = "jbg_gemm_amax_state";
inline constexpr int64_t kScaleBlock = 32;  // MXFP8: one E8M0 scale per 32 elements along K
inline constexpr int64_t kAtomRows = 128;   // scale atom: 128 rows (of M or N) ...
inline constexpr int64_t kAtomBlocks = 4;   // ... by 4 scale blocks, stored as (32, 4, 4) bytes
inline constexpr uintptr_t kAlignment = 16;

inline constexpr int64_t kMaxBufferElements = int64_t{1} << 31;  // sizes travel to the kernels as int32

// What the handler sees of one buffer; dtype is an XLA_FFI_DataType value.
struct BufferDesc {
  int dtype;
  const int64_t* dims;
  size_t rank;
  const void* data;
};

// Helpers every handler's buffer checks share.
// Product of the dims, saturated at kMaxBufferElements (no step overflows, whatever the dims); 0 if a dim is <= 0.
int64_t ElementCount(const BufferDesc& b);
// "float8_e4m3fn", "bfloat16", ... for the dtypes the handlers take; "another dtype" otherwise.
const char* DtypeName(int dtype);
// "(2, 200, 96)".
std::string ShapeString(const int64_t* dims, size_t rank);

struct GemmDims {
  int32_t m = 0, n = 0, k = 0, l = 0;
};

// The dtypes a call site's kernel objects were compiled for (XLA_FFI_DataType values).
struct KernelDtypes {
  int ab;  // float8_e4m3fn or float8_e5m2: the dtype of a and b
  int c;   // float32 or bfloat16
};

// Checks a, b, sfa, sfb, c, amax (in that order) against what the kernel reads and writes; fills `*dims`.
// Returns "" when they fit, else a message naming the buffer, what it is and what is allowed.
std::string CheckGemmAmaxBuffers(const BufferDesc (&buffers)[6], KernelDtypes kernel, GemmDims* dims);

// Parses the `ab_dtype` / `c_dtype` attributes ("float8_e4m3fn", "float32", ...); returns "" or what is wrong.
std::string ParseKernelDtypes(std::string_view ab_dtype, std::string_view c_dtype, KernelDtypes* out);

// Parses "sm_90a" / "sm_100a" (any "sm_<major><minor>[suffix]") into a compute capability.
bool ParseArch(std::string_view arch, int* major, int* minor);

// One kernel object of the `objects` attribute.
struct ObjectEntry {
  std::string arch;
  std::string function_prefix;
  int cc_major = 0, cc_minor = 0;
  size_t begin = 0, end = 0;  // byte range inside `objects`
};

// Splits and cross-checks the four attributes; returns false with `*error` set when they disagree.
bool ParseObjectTable(std::string_view archs, std::string_view function_prefixes, size_t objects_size,
                      const int64_t* offsets, size_t num_offsets, std::vector<ObjectEntry>* out,
                      std::string* error);

// State kept per call site between INSTANTIATE and EXECUTE; owned by XLA (destroyed with the executable).
struct GemmAmaxState {
  static xla::ffi::TypeId id;
  std::string archs;                           // as given, for error messages
  KernelDtypes dtypes{};                       // what the objects were compiled for (checked at every call)
  std::vector<DslFunction*> functions;         // by CUDA device ordinal; nullptr where no object fits
  std::vector<std::string> function_prefixes;  // by CUDA device ordinal, for error messages
  std::vector<std::string> capabilities;       // "9.0", by CUDA device ordinal
  bool poison_outputs = false;                 // JAX_BLOCKGEMM_POISON_OUTPUTS: fill C with NaN before each launch
};

XLA_FFI_TypeInfo* GemmAmaxStateTypeInfo();

// The INSTANTIATE stage, shared by every target (it depends on the object table only): parses the attributes,
// loads each visible device's kernel object. The state names the kernel objects, not the operation.
// The execute-stage steps every target shares; `target` names the custom call in error messages.
// The function loaded for `device`, or an error naming the device, its compute capability and the archs carried.
xla::ffi::Error DeviceFunction(const GemmAmaxState& state, int32_t device, std::string_view target, DslFunction** fn);
// Runs `fn` on `args` (pointers to each argument; the last one is `ret`, the kernel's CUDA status slot).
xla::ffi::Error RunKernel(const GemmAmaxState& state, int32_t device, std::string_view target,
                          const CudaDriver& driver, DslFunction* fn, void** args, size_t num_args,
                          const int32_t* ret);

// `target` names the custom call in error messages.
xla::ffi::ErrorOr<std::unique_ptr<GemmAmaxState>> InstantiateKernelObjects(
    std::string_view target, std::string_view archs, std::string_view function_prefixes,
    xla::ffi::Span<const uint8_t> objects, xla::ffi::Span<const int64_t> offsets);

}  // namespace jbg

// The bound handlers (C symbols so that a capsule or ctypes can reach them).
extern "C" XLA_FFI_Error* JbgGemmAmaxInstantiate(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JbgGemmAmaxExecute(XLA_FFI_CallFrame* call_frame);

#endif  // JBG_FFI_GEMM_AMAX_H_
