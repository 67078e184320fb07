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

inline constexpr CUresult kCudaSuccess = 0;
inline constexpr int kAttrComputeCapabilityMajor = 75;  // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
inline constexpr int kAttrComputeCapabilityMinor = 76;  // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
inline constexpr int kAttrMultiprocessorCount = 16;     // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT

struct CudaDriver {
  CUresult (*cuInit)(unsigned int flags);
  CUresult (*cuDeviceGetCount)(int* count);
  CUresult (*cuDeviceGet)(CUdevice* device, int ordinal);
  CUresult (*cuDeviceGetAttribute)(int* value, int attribute, CUdevice device);
  CUresult (*cuMemsetD32Async)(CUdeviceptr dst, unsigned int value, size_t count, CUstream stream);
  CUresult (*cuMemsetD8Async)(CUdeviceptr dst, unsigned char value, size_t count, CUstream stream);
  CUresult (*cuGetErrorName)(CUresult error, const char** name);
  CUresult (*cuStreamGetCtx)(CUstream stream, CUcontext* context);
  CUresult (*cuCtxGetCurrent)(CUcontext* context);
  CUresult (*cuCtxPushCurrent)(CUcontext context);
  CUresult (*cuCtxPopCurrent)(CUcontext* context);

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

}  // namespace jbg

#endif  // JBG_FFI_CUDA_DRIVER_H_
