#include "dsl_runtime.h"

#include <dlfcn.h>

#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace jbg {
namespace {

// Hand-written declarations of the runtime's C API (see dsl_runtime.h for why).
using RtError = int;  // CuteDSLRT_Error_t; 0 is success
struct RtModule;      // CuteDSLRT_Module_t
using CreateFromBytesFn = RtError (*)(RtModule** module, const unsigned char* bytes, size_t size,
                                      const char** shared_libs, size_t num_shared_libs);
using GetFunctionFn = RtError (*)(DslFunction** fn, RtModule* module, const char* function_prefix);
using RunFn = RtError (*)(void* fn, void** args, size_t num_args);
using ErrorNameFn = const char* (*)(RtError error);

struct Runtime {
  std::string path;
  CreateFromBytesFn create_from_bytes = nullptr;
  GetFunctionFn get_function = nullptr;
  RunFn run = nullptr;
  ErrorNameFn error_name = nullptr;
};

std::mutex& RuntimeMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}

// Set once under RuntimeMutex, then read without locking (the pointer is published by the mutex release and the
// object is immutable afterwards).
Runtime* g_runtime = nullptr;

std::string RtErrorName(const Runtime& rt, RtError code) {
  const char* name = rt.error_name ? rt.error_name(code) : nullptr;
  return std::string(name ? name : "CuteDSLRT error") + " (" + std::to_string(code) + ")";
}

Runtime* GetRuntime(std::string* error) {
  std::lock_guard<std::mutex> lock(RuntimeMutex());
  if (g_runtime == nullptr) {
    *error = "the CuTeDSL runtime library is not loaded; jax_blockgemm._native.register_ffi_targets() loads it "
             "(it lives in nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so)";
  }
  return g_runtime;
}

}  // namespace

bool LoadDslRuntime(const std::string& path, std::string* error) {
  std::lock_guard<std::mutex> lock(RuntimeMutex());
  if (g_runtime != nullptr) return true;
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    *error = "cannot load the CuTeDSL runtime " + path + ": " + (why ? why : "unknown dlopen error");
    return false;
  }
  auto rt = std::make_unique<Runtime>();
  rt->path = path;
  auto resolve = [&](const char* symbol, auto* out) {
    *out = reinterpret_cast<std::remove_pointer_t<decltype(out)>>(dlsym(lib, symbol));
    if (*out == nullptr) *error = path + " has no symbol " + symbol;
    return *out != nullptr;
  };
  if (!resolve("CuteDSLRT_Module_Create_From_Bytes", &rt->create_from_bytes) ||
      !resolve("CuteDSLRT_Module_Get_Function", &rt->get_function) ||
      !resolve("CuteDSLRT_Function_Run", &rt->run) || !resolve("CuteDSLRT_GetErrorName", &rt->error_name)) {
    dlclose(lib);
    return false;
  }
  g_runtime = rt.release();
  return true;
}

std::string DslRuntimePath() {
  std::lock_guard<std::mutex> lock(RuntimeMutex());
  return g_runtime ? g_runtime->path : std::string();
}

DslFunction* LoadDslFunction(std::string_view object, const std::string& function_prefix, std::string* error) {
  Runtime* rt = GetRuntime(error);
  if (rt == nullptr) return nullptr;
  if (object.empty()) {
    *error = "empty kernel object for function " + function_prefix;
    return nullptr;
  }
  static auto* mu = new std::mutex;
  static auto* cache = new std::map<std::pair<std::string, std::string>, DslFunction*>;
  std::lock_guard<std::mutex> lock(*mu);
  auto key = std::make_pair(std::string(object), function_prefix);
  if (auto it = cache->find(key); it != cache->end()) return it->second;

  RtModule* module = nullptr;
  RtError rc = rt->create_from_bytes(&module, reinterpret_cast<const unsigned char*>(object.data()), object.size(),
                                     nullptr, 0);
  if (rc != 0 || module == nullptr) {
    *error = "CuteDSLRT_Module_Create_From_Bytes failed for " + function_prefix + " (" +
             std::to_string(object.size()) + " bytes): " + RtErrorName(*rt, rc);
    return nullptr;
  }
  DslFunction* fn = nullptr;
  rc = rt->get_function(&fn, module, function_prefix.c_str());
  if (rc != 0 || fn == nullptr) {
    *error = "CuteDSLRT_Module_Get_Function(\"" + function_prefix + "\") failed: " + RtErrorName(*rt, rc);
    return nullptr;  // the module stays loaded (unreferenced); destroying it mid-process is not worth the risk
  }
  cache->emplace(std::move(key), fn);
  return fn;
}

int RunDslFunction(DslFunction* fn, void** args, size_t num_args, std::string* error) {
  Runtime* rt = g_runtime;  // a function exists only if the runtime was loaded
  RtError rc = rt->run(fn, args, num_args);
  if (rc != 0) *error = RtErrorName(*rt, rc);
  return rc;
}

}  // namespace jbg
