// The few CUDA driver entry points the bridge needs, resolved from libcuda.so.1 at run time.
//
// Declared here rather than taken from cuda.h so that the extension builds on a machine with no CUDA toolkit.
// Only driver-API calls that neither allocate nor synchronize are used on the execute path.
#ifndef JBG_FFI_CUDA_DRIVER_H_
#define JBG_FFI_CUDA_DRIVER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jbg {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;  // NOLINT: matches cuda.h on 64-bit hosts
struct CUstream_st;
using CUstream = CUstream_st*;
struct CUctx_st;
using CUcontext = CUctx_st*;
struct CUmod_st;
using CUmodule = CUmod_st*;
struct CUfunc_st;
using CUfunction = CUfunc_st*;

inline constexpr CUresult kCudaSuccess = 0;
inline constexpr int kAttrComputeCapabilityMajor = 75;  // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
inline constexpr int kAttrComputeCapabilityMinor = 76;  // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
inline constexpr int kAttrMultiprocessorCount = 16;     // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
inline constexpr int kAttrMaxSharedPerBlockOptin = 97;  // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
inline constexpr int kFuncAttrMaxDynamicShared = 8;     // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
inline constexpr int kFuncAttrNonPortableCluster = 14;  // CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
inline constexpr int kLaunchAttrClusterDimension = 4;   // CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION

// cuda.h's CUlaunchAttribute and CUlaunchConfig, field for field (the offsets are asserted in cuda_driver.cc).
struct LaunchAttribute {
  int id;
  char pad[4];
  union {
    char bytes[64];
    struct {
      unsigned int x, y, z;
    } cluster_dim;
  } value;
};
struct LaunchConfig {
  unsigned int grid_x, grid_y, grid_z;
  unsigned int block_x, block_y, block_z;
  unsigned int shared_mem_bytes;
  CUstream stream;
  LaunchAttribute* attrs;
  unsigned int num_attrs;
};

struct CudaDriver {
  CUresult (*cuInit)(unsigned int flags);
  CUresult (*cuDeviceGetCount)(int* count);
  CUresult (*cuDeviceGet)(CUdevice* device, int ordinal);
  CUresult (*cuDeviceGetAttribute)(int* value, int attribute, CUdevice device);
  CUresult (*cuMemsetD32Async)(CUdeviceptr dst, unsigned int value, size_t count, CUstream stream);
  CUresult (*cuMemsetD8Async)(CUdeviceptr dst, unsigned char value, size_t count, CUstream stream);
  // Instantiation only (a call site's zeroed words, kernel_objects.h's DeviceTally): allocate, zero, free.
  CUresult (*cuMemAlloc)(CUdeviceptr* dst, size_t bytes);
  CUresult (*cuMemsetD32)(CUdeviceptr dst, unsigned int value, size_t count);
  CUresult (*cuMemFree)(CUdeviceptr ptr);
  CUresult (*cuGetErrorName)(CUresult error, const char** name);
  CUresult (*cuStreamGetCtx)(CUstream stream, CUcontext* context);
  CUresult (*cuCtxGetCurrent)(CUcontext* context);
  CUresult (*cuCtxPushCurrent)(CUcontext context);
  CUresult (*cuCtxPopCurrent)(CUcontext* context);
  // For the cluster occupancy query only; nullptr where the driver lacks them (the query then falls back).
  CUresult (*cuDevicePrimaryCtxGetState)(CUdevice device, unsigned int* flags, int* active);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext* context, CUdevice device);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice device);
  CUresult (*cuModuleLoadData)(CUmodule* module, const void* image);
  CUresult (*cuModuleUnload)(CUmodule module);
  CUresult (*cuModuleGetFunction)(CUfunction* function, CUmodule module, const char* name);
  CUresult (*cuFuncSetAttribute)(CUfunction function, int attribute, int value);
  CUresult (*cuOccupancyMaxActiveClusters)(int* clusters, CUfunction function, const LaunchConfig* config);

  // "CUDA_ERROR_X (code)" for a driver result.
  std::string ErrorName(CUresult result) const;
};

// Makes the context of `stream` current on this thread for its lifetime when it is not already (the DSL's host
// code launches through the CUDA runtime, which works on the current device). A failed query leaves things as
// they are: the launch then reports any mismatch itself.
class ScopedStreamContext {
 public:
  ScopedStreamContext(const CudaDriver& driver, CUstream stream);
  ~ScopedStreamContext();
  ScopedStreamContext(const ScopedStreamContext&) = delete;
  ScopedStreamContext& operator=(const ScopedStreamContext&) = delete;

 private:
  const CudaDriver& driver_;
  bool pushed_ = false;
};

// The process-wide driver table, loaded (and cuInit-ed) on first use; nullptr with `*error` set when libcuda is
// missing or cuInit fails. Thread-safe.
const CudaDriver* GetCudaDriver(std::string* error);

// Compute capability (major, minor) and SM count of every visible device, by CUDA ordinal; false with `*error` set
// on failure.
struct DeviceFacts {
  int major = 0;
  int minor = 0;
  int multiprocessors = 0;  // SMs: the persistent kernels' grid is at most this many CTAs
};
bool VisibleDevices(const CudaDriver& driver, std::vector<DeviceFacts>* out, std::string* error);

// How many clusters of `cluster_ctas` CTAs, one CTA per SM (all of its shared memory), CUDA device `ordinal` runs at
// once: cuOccupancyMaxActiveClusters on an empty kernel, as CUTLASS's HardwareInfo.get_max_active_clusters asks it
// (clusters must fit inside a GPC, so this can be less than SMs / cluster_ctas). Answered once per device and
// cluster size, in the device's primary context, only while that context is active (the process uses the device);
// 0 with `*error` set when it cannot be asked (then the caller bounds the grid by SMs / cluster_ctas).
int MaxActiveClusters(const CudaDriver& driver, int ordinal, int cluster_ctas, std::string* error);

}  // namespace jbg

#endif  // JBG_FFI_CUDA_DRIVER_H_
