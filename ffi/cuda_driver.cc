#include "cuda_driver.h"

#include <dlfcn.h>

#include <mutex>
#include <vector>

namespace jbg {

std::string CudaDriver::ErrorName(CUresult result) const {
  const char* name = nullptr;
  if (cuGetErrorName == nullptr || cuGetErrorName(result, &name) != kCudaSuccess || name == nullptr) {
    name = "unknown CUDA error";
  }
  return std::string(name) + " (" + std::to_string(result) + ")";
}

namespace {

template <typename Fn>
bool Resolve(void* lib, const char* symbol, Fn* out, std::string* error) {
  *out = reinterpret_cast<Fn>(dlsym(lib, symbol));
  if (*out == nullptr) {
    *error = std::string("libcuda.so.1 has no symbol ") + symbol;
    return false;
  }
  return true;
}

struct LoadedDriver {
  CudaDriver table{};
  std::string error;
  bool ok = false;
};

LoadedDriver LoadDriver() {
  LoadedDriver out;
  // RTLD_NOLOAD first: inside a JAX GPU process the driver is already mapped; reuse that exact copy.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    out.error = std::string("cannot load the CUDA driver libcuda.so.1: ") + (why ? why : "unknown dlopen error");
    return out;
  }
  CudaDriver& d = out.table;
  if (!Resolve(lib, "cuInit", &d.cuInit, &out.error) ||
      !Resolve(lib, "cuDeviceGetCount", &d.cuDeviceGetCount, &out.error) ||
      !Resolve(lib, "cuDeviceGet", &d.cuDeviceGet, &out.error) ||
      !Resolve(lib, "cuDeviceGetAttribute", &d.cuDeviceGetAttribute, &out.error) ||
      !Resolve(lib, "cuMemsetD32Async", &d.cuMemsetD32Async, &out.error) ||
      !Resolve(lib, "cuMemsetD8Async", &d.cuMemsetD8Async, &out.error) ||
      !Resolve(lib, "cuGetErrorName", &d.cuGetErrorName, &out.error) ||
      !Resolve(lib, "cuStreamGetCtx", &d.cuStreamGetCtx, &out.error) ||
      !Resolve(lib, "cuCtxGetCurrent", &d.cuCtxGetCurrent, &out.error) ||
      !Resolve(lib, "cuCtxPushCurrent_v2", &d.cuCtxPushCurrent, &out.error) ||
      !Resolve(lib, "cuCtxPopCurrent_v2", &d.cuCtxPopCurrent, &out.error)) {
    return out;
  }
  if (CUresult r = d.cuInit(0); r != kCudaSuccess) {
    out.error = "cuInit failed: " + d.ErrorName(r);
    return out;
  }
  out.ok = true;
  return out;
}

}  // namespace

const CudaDriver* GetCudaDriver(std::string* error) {
  static const LoadedDriver* loaded = new LoadedDriver(LoadDriver());  // leaked on purpose: lives for the process
  if (!loaded->ok) {
    *error = loaded->error;
    return nullptr;
  }
  return &loaded->table;
}

ScopedStreamContext::ScopedStreamContext(const CudaDriver& driver, CUstream stream) : driver_(driver) {
  CUcontext wanted = nullptr, current = nullptr;
  if (driver.cuStreamGetCtx(stream, &wanted) != kCudaSuccess || wanted == nullptr) return;
  if (driver.cuCtxGetCurrent(&current) == kCudaSuccess && current == wanted) return;
  pushed_ = driver.cuCtxPushCurrent(wanted) == kCudaSuccess;
}

ScopedStreamContext::~ScopedStreamContext() {
  if (pushed_) {
    CUcontext popped = nullptr;
    driver_.cuCtxPopCurrent(&popped);
  }
}

bool VisibleDevices(const CudaDriver& driver, std::vector<DeviceFacts>* out, std::string* error) {
  int count = 0;
  if (CUresult r = driver.cuDeviceGetCount(&count); r != kCudaSuccess) {
    *error = "cuDeviceGetCount failed: " + driver.ErrorName(r);
    return false;
  }
  out->assign(static_cast<size_t>(count), DeviceFacts{});
  for (int i = 0; i < count; ++i) {
    CUdevice dev = 0;
    CUresult r = driver.cuDeviceGet(&dev, i);
    if (r == kCudaSuccess) r = driver.cuDeviceGetAttribute(&(*out)[i].major, kAttrComputeCapabilityMajor, dev);
    if (r == kCudaSuccess) r = driver.cuDeviceGetAttribute(&(*out)[i].minor, kAttrComputeCapabilityMinor, dev);
    if (r == kCudaSuccess) r = driver.cuDeviceGetAttribute(&(*out)[i].multiprocessors, kAttrMultiprocessorCount, dev);
    if (r != kCudaSuccess) {
      *error = "cannot read the compute capability and SM count of CUDA device " + std::to_string(i) + ": " +
               driver.ErrorName(r);
      return false;
    }
  }
  return true;
}

}  // namespace jbg
