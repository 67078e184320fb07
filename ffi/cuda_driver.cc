#include "cuda_driver.h"

#include <dlfcn.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace jbg {

static_assert(sizeof(LaunchAttribute) == 72, "cuda.h's CUlaunchAttribute");
static_assert(offsetof(LaunchConfig, stream) == 32 && offsetof(LaunchConfig, attrs) == 40 &&
                  offsetof(LaunchConfig, num_attrs) == 48 && sizeof(LaunchConfig) == 56,
              "cuda.h's CUlaunchConfig");

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
      !Resolve(lib, "cuMemAlloc_v2", &d.cuMemAlloc, &out.error) ||
      !Resolve(lib, "cuMemsetD32_v2", &d.cuMemsetD32, &out.error) ||
      !Resolve(lib, "cuMemFree_v2", &d.cuMemFree, &out.error) ||
      !Resolve(lib, "cuGetErrorName", &d.cuGetErrorName, &out.error) ||
      !Resolve(lib, "cuStreamGetCtx", &d.cuStreamGetCtx, &out.error) ||
      !Resolve(lib, "cuCtxGetCurrent", &d.cuCtxGetCurrent, &out.error) ||
      !Resolve(lib, "cuCtxPushCurrent_v2", &d.cuCtxPushCurrent, &out.error) ||
      !Resolve(lib, "cuCtxPopCurrent_v2", &d.cuCtxPopCurrent, &out.error)) {
    return out;
  }
  auto optional = [lib](const char* symbol, auto* fn) {
    *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(lib, symbol));
  };
  optional("cuDevicePrimaryCtxGetState", &d.cuDevicePrimaryCtxGetState);
  optional("cuDevicePrimaryCtxRetain", &d.cuDevicePrimaryCtxRetain);
  optional("cuDevicePrimaryCtxRelease_v2", &d.cuDevicePrimaryCtxRelease);
  optional("cuModuleLoadData", &d.cuModuleLoadData);
  optional("cuModuleUnload", &d.cuModuleUnload);
  optional("cuModuleGetFunction", &d.cuModuleGetFunction);
  optional("cuFuncSetAttribute", &d.cuFuncSetAttribute);
  optional("cuOccupancyMaxActiveClusters", &d.cuOccupancyMaxActiveClusters);
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

namespace {

// An empty kernel in PTX, which the driver compiles for whatever GPU it loads on (sm_90 and later run clusters).
constexpr const char kProbePtx[] =
    ".version 7.8\n.target sm_90\n.address_size 64\n.visible .entry jbg_cluster_probe()\n{\n  ret;\n}\n";

int QueryMaxActiveClusters(const CudaDriver& d, int ordinal, int cluster_ctas, std::string* error) {
  if (!d.cuDevicePrimaryCtxGetState || !d.cuDevicePrimaryCtxRetain || !d.cuDevicePrimaryCtxRelease ||
      !d.cuModuleLoadData || !d.cuModuleUnload || !d.cuModuleGetFunction || !d.cuFuncSetAttribute ||
      !d.cuOccupancyMaxActiveClusters) {
    *error = "the CUDA driver lacks an entry point of the occupancy query";
    return 0;
  }
  CUdevice device = 0;
  unsigned int flags = 0;
  int active = 0, smem = 0;
  CUresult r = d.cuDeviceGet(&device, ordinal);
  if (r == kCudaSuccess) r = d.cuDevicePrimaryCtxGetState(device, &flags, &active);
  if (r == kCudaSuccess) r = d.cuDeviceGetAttribute(&smem, kAttrMaxSharedPerBlockOptin, device);
  if (r != kCudaSuccess) {
    *error = "reading device " + std::to_string(ordinal) + " failed: " + d.ErrorName(r);
    return 0;
  }
  if (!active) {  // retaining it would create a context (and take device memory) on a GPU the process leaves alone
    *error = "device " + std::to_string(ordinal) + " has no active primary context";
    return 0;
  }
  CUcontext context = nullptr;
  if ((r = d.cuDevicePrimaryCtxRetain(&context, device)) != kCudaSuccess) {
    *error = "cuDevicePrimaryCtxRetain failed: " + d.ErrorName(r);
    return 0;
  }
  int clusters = 0;
  const char* step = "cuCtxPushCurrent";
  if ((r = d.cuCtxPushCurrent(context)) == kCudaSuccess) {
    CUmodule module = nullptr;
    CUfunction function = nullptr;
    step = "cuModuleLoadData";
    if ((r = d.cuModuleLoadData(&module, kProbePtx)) == kCudaSuccess) {
      step = "cuModuleGetFunction";
      r = d.cuModuleGetFunction(&function, module, "jbg_cluster_probe");
      // All of shared memory: one CTA per SM, as the persistent kernels run.
      if (r == kCudaSuccess) {
        step = "cuFuncSetAttribute";
        r = d.cuFuncSetAttribute(function, kFuncAttrMaxDynamicShared, smem);
      }
      if (r == kCudaSuccess) r = d.cuFuncSetAttribute(function, kFuncAttrNonPortableCluster, 1);
      if (r == kCudaSuccess) {
        LaunchAttribute cluster{};
        cluster.id = kLaunchAttrClusterDimension;
        cluster.value.cluster_dim.x = static_cast<unsigned int>(cluster_ctas);
        cluster.value.cluster_dim.y = cluster.value.cluster_dim.z = 1;
        LaunchConfig config{};
        config.grid_x = static_cast<unsigned int>(cluster_ctas);
        config.grid_y = config.grid_z = 1;
        config.block_x = 128;
        config.block_y = config.block_z = 1;
        config.shared_mem_bytes = static_cast<unsigned int>(smem);
        config.attrs = &cluster;
        config.num_attrs = 1;
        step = "cuOccupancyMaxActiveClusters";
        r = d.cuOccupancyMaxActiveClusters(&clusters, function, &config);
      }
      d.cuModuleUnload(module);
    }
    CUcontext popped = nullptr;
    d.cuCtxPopCurrent(&popped);
  }
  d.cuDevicePrimaryCtxRelease(device);
  if (r != kCudaSuccess || clusters < 1) {
    *error = std::string(step) + " failed: " + (r != kCudaSuccess ? d.ErrorName(r) : std::string("no cluster fits"));
    return 0;
  }
  return clusters;
}

}  // namespace

int MaxActiveClusters(const CudaDriver& driver, int ordinal, int cluster_ctas, std::string* error) {
  static auto* mu = new std::mutex;
  static auto* answers = new std::map<std::pair<int, int>, int>;  // answers only: a failure is asked again later
  std::lock_guard<std::mutex> lock(*mu);
  const auto key = std::make_pair(ordinal, cluster_ctas);
  if (auto it = answers->find(key); it != answers->end()) return it->second;
  const int clusters = QueryMaxActiveClusters(driver, ordinal, cluster_ctas, error);
  if (clusters > 0) answers->emplace(key, clusters);
  return clusters;
}

}  // namespace jbg
