// Run-time loading of CuTeDSL kernel objects through the C API of the DSL's libcute_dsl_runtime.so.
//
// The runtime's header is proprietary, so the handful of functions used here are declared by hand from its
// documented C signatures. The library is dlopen-ed from a path that Python hands in (it ships inside the
// nvidia-cutlass-dsl wheel); nothing here links against it, so the extension builds without the DSL.
#ifndef JBG_FFI_DSL_RUNTIME_H_
#define JBG_FFI_DSL_RUNTIME_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace jbg {

// Opaque handle of an exported function inside a loaded module (CuteDSLRT_Function_t*).
struct DslFunction;

// Loads the runtime from `path` once per process. A second call with another path keeps the first library.
// Returns false with `*error` set when the library or one of its symbols cannot be loaded.
bool LoadDslRuntime(const std::string& path, std::string* error);

// The path given to the successful LoadDslRuntime call, or "" when none succeeded yet.
std::string DslRuntimePath();

// Loads (or finds, when the same bytes with the same prefix were loaded before in this process) the module built
// from `object` and returns its function `function_prefix`. Modules are never unloaded: executables and call sites
// come and go, the loaded code is shared and small. A module created by the runtime covers every visible device
// (the DSL loads its CUDA library onto each device itself), so the cache is keyed by content alone.
// Thread-safe; returns nullptr with `*error` set on failure.
DslFunction* LoadDslFunction(std::string_view object, const std::string& function_prefix, std::string* error);

// Runs `fn` with `args` (pointers to each argument, then a pointer to the int32 return slot).
// Returns 0 on success, else the CuteDSLRT error code; `*error` then holds its name.
int RunDslFunction(DslFunction* fn, void** args, size_t num_args, std::string* error);

}  // namespace jbg

#endif  // JBG_FFI_DSL_RUNTIME_H_
