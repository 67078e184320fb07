#include "kernel_objects.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <utility>

#include "object_check.h"

namespace jbg {
namespace ffi = xla::ffi;

xla::ffi::TypeId KernelObjects::id = {};

XLA_FFI_TypeInfo* KernelObjectsTypeInfo() {
  static XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<KernelObjects>();
  return &info;
}

// Product of the dims, saturated at kMaxElements (no step can overflow, whatever the dims).
int64_t ElementCount(const BufferDesc& b) {
  constexpr int64_t kMaxElements = kMaxBufferElements;
  int64_t count = 1;
  for (size_t d = 0; d < b.rank; ++d) {
    if (b.dims[d] <= 0) return 0;
    if (b.dims[d] > kMaxElements / count) return kMaxElements;
    count *= b.dims[d];
  }
  return count;
}

const char* DtypeName(int dtype) {
  switch (dtype) {
    case XLA_FFI_DataType_U8: return "uint8";
    case XLA_FFI_DataType_F32: return "float32";
    case XLA_FFI_DataType_BF16: return "bfloat16";
    case XLA_FFI_DataType_F8E4M3FN: return "float8_e4m3fn";
    case XLA_FFI_DataType_F8E5M2: return "float8_e5m2";
    case XLA_FFI_DataType_F16: return "float16";
    case XLA_FFI_DataType_S32: return "int32";
    default: return "another dtype";
  }
}

std::string ShapeString(const int64_t* dims, size_t rank) {
  std::string s = "(";
  for (size_t i = 0; i < rank; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + (rank == 1 ? ",)" : ")");
}

size_t ElementBytes(int dtype) {
  switch (dtype) {
    case XLA_FFI_DataType_F32: return 4;
    case XLA_FFI_DataType_BF16:
    case XLA_FFI_DataType_F16: return 2;
    default: return 1;
  }
}

std::string ShapeString(std::initializer_list<int64_t> dims) { return ShapeString(dims.begin(), dims.size()); }

bool HasShape(const BufferDesc& b, std::initializer_list<int64_t> want) {
  if (b.rank != want.size()) return false;
  size_t i = 0;
  for (int64_t d : want) {
    if (b.dims[i++] != d) return false;
  }
  return true;
}

bool HasShape(const BufferDesc& b, const std::vector<int64_t>& want) {
  if (b.rank != want.size()) return false;
  for (size_t i = 0; i < want.size(); ++i) {
    if (b.dims[i] != want[i]) return false;
  }
  return true;
}

bool ParseCodeDtype(std::string_view name, KernelDtypes* k) {
  if (name == "float8_e4m3fn") {
    k->ab = XLA_FFI_DataType_F8E4M3FN;
  } else if (name == "float8_e5m2") {
    k->ab = XLA_FFI_DataType_F8E5M2;
  } else if (name == "float4_e2m1fn") {
    k->ab = XLA_FFI_DataType_U8;  // two codes per byte
    k->ab_fp4 = true;
  } else {
    return false;
  }
  return true;
}

bool ParseCDtype(std::string_view name, KernelDtypes* k) {
  if (name == "float32") {
    k->c = XLA_FFI_DataType_F32;
  } else if (name == "bfloat16") {
    k->c = XLA_FFI_DataType_BF16;
  } else if (name == "float16") {
    k->c = XLA_FFI_DataType_F16;
  } else if (name == "float8_e4m3fn") {
    k->c = XLA_FFI_DataType_F8E4M3FN;
  } else if (name == "float8_e5m2") {
    k->c = XLA_FFI_DataType_F8E5M2;
  } else if (name == "float4_e2m1fn") {
    k->c = XLA_FFI_DataType_U8;  // two codes per byte
    k->c_fp4 = true;
  } else {
    return false;
  }
  return true;
}

bool ParseBlockScales(std::string_view sf_dtype, int64_t sf_vec_size, KernelDtypes* k) {
  if (sf_dtype == "float8_e8m0fnu" && sf_vec_size == 32) {
    k->sf = XLA_FFI_DataType_U8;
  } else if (sf_dtype == "float8_e4m3fn" && sf_vec_size == 16 && k->ab_fp4) {
    k->sf = XLA_FFI_DataType_F8E4M3FN;
  } else {
    return false;
  }
  k->sf_vec_size = static_cast<int>(sf_vec_size);
  return true;
}

std::string CodeName(const KernelDtypes& k) {
  if (k.ab_bf16) return "bfloat16 operands";
  return k.ab_fp4 ? "float4_e2m1fn codes (uint8 pairs)" : std::string(DtypeName(k.ab)) + " codes";
}

BufferDesc ToBufferDesc(const xla::ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  return BufferDesc{static_cast<int>(buffer.element_type()), dims.begin(), dims.size(), buffer.untyped_data()};
}

bool ParseArch(std::string_view arch, int* major, int* minor) {
  if (arch.substr(0, 3) != "sm_") return false;
  std::string_view rest = arch.substr(3);
  size_t digits = 0;
  while (digits < rest.size() && rest[digits] >= '0' && rest[digits] <= '9') ++digits;
  if (digits < 2 || digits > 3 || rest.size() - digits > 1) return false;
  if (digits < rest.size() && rest[digits] != 'a' && rest[digits] != 'f') return false;
  int value = 0;
  for (size_t i = 0; i < digits; ++i) value = value * 10 + (rest[i] - '0');
  *major = value / 10;
  *minor = value % 10;
  return true;
}

namespace {

std::vector<std::string_view> SplitCommas(std::string_view s) {
  std::vector<std::string_view> out;
  if (s.empty()) return out;
  size_t start = 0;
  while (true) {
    size_t comma = s.find(',', start);
    out.push_back(s.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start));
    if (comma == std::string_view::npos) return out;
    start = comma + 1;
  }
}

}  // namespace

bool ParseObjectTable(std::string_view target, std::string_view archs, std::string_view function_prefixes,
                      size_t objects_size, const int64_t* offsets, size_t num_offsets,
                      std::vector<ObjectEntry>* out, std::string* error) {
  const std::vector<std::string_view> arch_list = SplitCommas(archs);
  const std::vector<std::string_view> prefix_list = SplitCommas(function_prefixes);
  const std::string where = std::string(target) + " attributes: ";
  if (arch_list.empty()) {
    *error = where + "archs is empty; expected a comma-separated list such as \"sm_90a,sm_100a\"";
    return false;
  }
  if (prefix_list.size() != arch_list.size()) {
    *error = where + "function_prefixes has " + std::to_string(prefix_list.size()) + " entries and archs has " +
             std::to_string(arch_list.size()) + "; expected one prefix per arch";
    return false;
  }
  if (num_offsets != arch_list.size() + 1) {
    *error = where + "offsets has " + std::to_string(num_offsets) + " entries; expected " +
             std::to_string(arch_list.size() + 1) + " (one more than archs)";
    return false;
  }
  if (offsets[0] != 0 || offsets[num_offsets - 1] != static_cast<int64_t>(objects_size)) {
    *error = where + "offsets must start at 0 and end at the size of objects (" + std::to_string(objects_size) +
             "), got " + std::to_string(offsets[0]) + " .. " + std::to_string(offsets[num_offsets - 1]);
    return false;
  }
  out->clear();
  for (size_t i = 0; i < arch_list.size(); ++i) {
    ObjectEntry entry;
    entry.arch = std::string(arch_list[i]);
    entry.function_prefix = std::string(prefix_list[i]);
    if (!ParseArch(entry.arch, &entry.cc_major, &entry.cc_minor)) {
      *error = where + "arch \"" + entry.arch + "\" is not of the form sm_<major><minor>[a|f], e.g. sm_90a";
      return false;
    }
    if (entry.function_prefix.empty()) {
      *error = where + "the function prefix for " + entry.arch + " is empty";
      return false;
    }
    if (!IsCIdentifier(entry.function_prefix)) {
      *error = where + "the function prefix \"" + entry.function_prefix + "\" for " + entry.arch +
               " is not a C identifier ([A-Za-z_][A-Za-z0-9_]*)";
      return false;
    }
    for (const ObjectEntry& seen : *out) {
      if (seen.arch == entry.arch) {
        *error = where + "arch " + entry.arch + " is listed twice; expected one object per arch";
        return false;
      }
    }
    if (offsets[i + 1] <= offsets[i]) {
      *error = where + "the object for " + entry.arch + " is empty (offsets must increase strictly)";
      return false;
    }
    entry.begin = static_cast<size_t>(offsets[i]);
    entry.end = static_cast<size_t>(offsets[i + 1]);
    out->push_back(std::move(entry));
  }
  return true;
}

namespace {

using StateOr = ffi::ErrorOr<std::unique_ptr<KernelObjects>>;

StateOr Fail(ffi::Error error) { return ffi::Unexpected<ffi::Error>(std::move(error)); }

// "target: ", the start of a per-call error message: built only on failure, the checks run on every call.
std::string ErrorPrefix(std::string_view target) { return std::string(target) + ": "; }

}  // namespace

// What a user whose GPU has no object in the program can do.
constexpr const char kWayOut[] =
    ". Lower (or export) the program on a machine with this GPU, which embeds its kernel where one exists, or call "
    "the operation with implementation='xla' (the reference runs everywhere)";

std::string CheckClusterCtas(std::string_view target, const int64_t* cluster_ctas, size_t count,
                             size_t num_objects) {
  const std::string where = std::string(target) + " attributes: cluster_ctas ";
  if (count != num_objects) {
    return where + "has " + std::to_string(count) + " entries; expected one per object (" +
           std::to_string(num_objects) + ")";
  }
  for (size_t i = 0; i < count; ++i) {
    if (cluster_ctas[i] < 0 || cluster_ctas[i] > kMaxClusterCtas) {
      return where + "entry " + std::to_string(i) + " is " + std::to_string(cluster_ctas[i]) +
             "; expected 0 (no grid size) or the CTAs of a cluster, 1 to " + std::to_string(kMaxClusterCtas);
    }
  }
  return "";
}

int32_t GridCtas(int32_t sms, int32_t cluster_ctas, int32_t max_active_clusters) {
  int32_t clusters = sms / cluster_ctas;
  if (max_active_clusters > 0) clusters = std::min(clusters, max_active_clusters);
  return std::max(clusters, int32_t{1}) * cluster_ctas;
}

std::string CheckAmaxBatches(std::string_view target, int64_t amax_batches) {
  if (amax_batches < 0 || amax_batches >= kMaxBufferElements) {
    return std::string(target) + " attributes: amax_batches " + std::to_string(amax_batches) +
           " is not supported; expected L, the call's batch count (0: the caller drops amax)";
  }
  return "";
}

std::string ParseSmLimit(const char* text, int32_t* limit) {
  *limit = 0;
  if (text == nullptr || text[0] == '\0') return "";
  int64_t value = 0;
  bool digits = true;
  for (const char* c = text; *c != '\0' && digits; ++c) {
    digits = *c >= '0' && *c <= '9' && value <= 1'000'000;  // past a million SMs: no GPU, and no int32 overflow
    value = value * 10 + (*c - '0');
  }
  if (!digits || value < 1) {
    return std::string("JAX_BLOCKGEMM_SM_LIMIT=\"") + text + "\" is not a count of SMs; expected a positive integer "
           "(or unset)";
  }
  *limit = static_cast<int32_t>(value);
  return "";
}

StateOr InstantiateKernelObjects(std::string_view target, std::string_view archs, std::string_view prefixes,
                                 ffi::Span<const uint8_t> objects, ffi::Span<const int64_t> offsets,
                                 const std::vector<int64_t>& cluster_ctas) {
  const std::string where = std::string(target) + ": ";
  std::string error;
  std::vector<ObjectEntry> entries;
  if (!ParseObjectTable(target, archs, prefixes, objects.size(), offsets.begin(), offsets.size(), &entries,
                        &error)) {
    return Fail(ffi::Error::InvalidArgument(error));
  }
  if (!cluster_ctas.empty()) {
    if (std::string why = CheckClusterCtas(target, cluster_ctas.data(), cluster_ctas.size(), entries.size());
        !why.empty()) {
      return Fail(ffi::Error::InvalidArgument(why));
    }
  }
  const CudaDriver* driver = GetCudaDriver(&error);
  if (driver == nullptr) return Fail(ffi::Error(ffi::ErrorCode::kFailedPrecondition, where + error));
  std::vector<DeviceFacts> devices;
  if (!VisibleDevices(*driver, &devices, &error)) return Fail(ffi::Error::Internal(where + error));

  auto state = std::make_unique<KernelObjects>();
  state->archs = std::string(archs);
  const char* poison = std::getenv("JAX_BLOCKGEMM_POISON_OUTPUTS");
  state->poison_outputs = poison != nullptr && poison[0] != '\0' && poison[0] != '0';
  // Test aid: JAX_BLOCKGEMM_SM_LIMIT=n launches the persistent kernels on at most n SMs, as a smaller GPU of the
  // same architecture would (an H100 PCIe has 114).
  int32_t limit = 0;
  if (std::string why = ParseSmLimit(std::getenv("JAX_BLOCKGEMM_SM_LIMIT"), &limit); !why.empty()) {
    return Fail(ffi::Error::InvalidArgument(where + why));
  }
  state->functions.assign(devices.size(), nullptr);
  state->function_prefixes.assign(devices.size(), "");
  state->grid_ctas.assign(devices.size(), 0);
  bool any = false;
  std::string seen;
  for (size_t dev = 0; dev < devices.size(); ++dev) {
    const std::string cc = std::to_string(devices[dev].major) + "." + std::to_string(devices[dev].minor);
    state->capabilities.push_back(cc);
    state->multiprocessors.push_back(limit > 0 ? std::min(devices[dev].multiprocessors, limit)
                                               : devices[dev].multiprocessors);
    if (seen.find(cc) == std::string::npos) seen += (seen.empty() ? "" : ", ") + cc;
    for (size_t e = 0; e < entries.size(); ++e) {
      const ObjectEntry& entry = entries[e];
      if (entry.cc_major != devices[dev].major || entry.cc_minor != devices[dev].minor) continue;
      std::string_view bytes(reinterpret_cast<const char*>(objects.begin()) + entry.begin, entry.end - entry.begin);
      // Only the object a device will run is checked (and loaded): a program may carry others for other GPUs.
      if (std::string why = CheckKernelObject(bytes, entry.function_prefix); !why.empty()) {
        return Fail(ffi::Error::InvalidArgument(where + why + "; arch " + entry.arch));
      }
      DslFunction* fn = LoadDslFunction(bytes, entry.function_prefix, &error);
      if (fn == nullptr) return Fail(ffi::Error::Internal(where + error));
      state->functions[dev] = fn;
      state->function_prefixes[dev] = entry.function_prefix;
      if (const int cluster = cluster_ctas.empty() ? 0 : static_cast<int>(cluster_ctas[e]); cluster > 0) {
        // Clusters must fit inside a GPC, so fewer may fit at once than SMs / cluster: ask the driver (a cluster of
        // one fits on every SM). If it cannot answer, the SM bound stands; a cluster it could not place would only
        // start once another finished (a slower tail, the same results).
        std::string why;
        const int fit = cluster > 1 ? MaxActiveClusters(*driver, static_cast<int>(dev), cluster, &why) : 0;
        state->grid_ctas[dev] = GridCtas(state->multiprocessors[dev], cluster, fit);
      }
      any = true;
      break;
    }
  }
  if (!any) {
    return Fail(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                           where + "no kernel object for compute capability " +
                               (seen.empty() ? std::string("(no visible CUDA device)") : seen) +
                               "; this program carries objects for " + std::string(archs) + kWayOut));
  }
  return state;
}

ffi::Error DeviceFunction(const KernelObjects& state, int32_t device, std::string_view target, DslFunction** fn) {
  if (device < 0 || static_cast<size_t>(device) >= state.functions.size()) {
    return ffi::Error::Internal(ErrorPrefix(target) + "device ordinal " + std::to_string(device) +
                                " is not among the " + std::to_string(state.functions.size()) +
                                " devices seen at instantiation");
  }
  *fn = state.functions[device];
  if (*fn == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      ErrorPrefix(target) + "no kernel object for compute capability " + state.capabilities[device] +
                          " (device " + std::to_string(device) + "); this program carries objects for " + state.archs +
                          kWayOut);
  }
  return ffi::Error::Success();
}

ffi::Error PoisonBytes(std::string_view target, std::string_view name, const CudaDriver& driver, CUstream stream,
                       const void* data, size_t bytes, unsigned char value) {
  if (CUresult r = driver.cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(data), value, bytes, stream);
      r != kCudaSuccess) {
    return ffi::Error::Internal(std::string(target) + ": poisoning " + std::string(name) + " failed: " +
                                driver.ErrorName(r));
  }
  return ffi::Error::Success();
}

KernelObjects::~KernelObjects() {
  std::string error;
  const CudaDriver* driver = tallies.empty() ? nullptr : GetCudaDriver(&error);
  if (driver == nullptr) return;
  for (const DeviceTally& tally : tallies) {  // errors are ignored: at process exit the driver may be gone
    if (tally.context == nullptr) continue;
    if (tally.words != 0 && driver->cuCtxPushCurrent(tally.context) == kCudaSuccess) {
      driver->cuMemFree(tally.words);
      CUcontext popped = nullptr;
      driver->cuCtxPopCurrent(&popped);
    }
    driver->cuDevicePrimaryCtxRelease(tally.device);
  }
}

ffi::Error AllocateTallies(KernelObjects* state, std::string_view target, size_t bytes) {
  const std::string where = std::string(target) + ": allocating the amax tally: ";
  std::string error;
  const CudaDriver* d = GetCudaDriver(&error);
  if (d == nullptr) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, where + error);
  if (!d->cuDevicePrimaryCtxGetState || !d->cuDevicePrimaryCtxRetain || !d->cuDevicePrimaryCtxRelease) {
    return ffi::Error::Internal(where + "the CUDA driver lacks the primary-context entry points");
  }
  state->tally_bytes = bytes;
  state->tallies.assign(state->functions.size(), DeviceTally{});
  for (size_t dev = 0; dev < state->functions.size(); ++dev) {
    if (state->functions[dev] == nullptr) continue;  // no object for this GPU: nothing launches there
    CUdevice device = 0;
    unsigned int flags = 0;
    int active = 0;
    CUresult r = d->cuDeviceGet(&device, static_cast<int>(dev));
    if (r == kCudaSuccess) r = d->cuDevicePrimaryCtxGetState(device, &flags, &active);
    if (r != kCudaSuccess) {
      return ffi::Error::Internal(where + "device " + std::to_string(dev) + ": " + d->ErrorName(r));
    }
    if (!active) continue;  // the process leaves this GPU alone: no context is created for it (EXECUTE says so)
    DeviceTally& tally = state->tallies[dev];
    if ((r = d->cuDevicePrimaryCtxRetain(&tally.context, device)) != kCudaSuccess) {
      tally.context = nullptr;
      return ffi::Error::Internal(where + "cuDevicePrimaryCtxRetain: " + d->ErrorName(r));
    }
    tally.device = device;
    if ((r = d->cuCtxPushCurrent(tally.context)) != kCudaSuccess) {
      return ffi::Error::Internal(where + "cuCtxPushCurrent: " + d->ErrorName(r));
    }
    r = d->cuMemAlloc(&tally.words, bytes);
    if (r == kCudaSuccess) r = d->cuMemsetD32(tally.words, 0u, bytes / 4);  // synchronous: zero before any launch
    CUcontext popped = nullptr;
    d->cuCtxPopCurrent(&popped);
    if (r != kCudaSuccess) return ffi::Error::Internal(where + std::to_string(bytes) + " bytes: " + d->ErrorName(r));
  }
  return ffi::Error::Success();
}

namespace {

// The tally of `device`, or an error when it has none or it is smaller than `bytes`.
ffi::Error DeviceTallyWords(const KernelObjects& state, int32_t device, std::string_view target, size_t bytes,
                            void** words) {
  if (device < 0 || static_cast<size_t>(device) >= state.tallies.size() || state.tallies[device].words == 0) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      ErrorPrefix(target) + "no amax tally on device " + std::to_string(device) +
                          ": its CUDA context was not active when the program was instantiated");
  }
  if (bytes > state.tally_bytes) {
    return ffi::Error::InvalidArgument(ErrorPrefix(target) + "the call needs " + std::to_string(bytes) +
                                       " bytes of amax tally; the call site was instantiated with " +
                                       std::to_string(state.tally_bytes));
  }
  *words = reinterpret_cast<void*>(state.tallies[device].words);
  return ffi::Error::Success();
}

}  // namespace

ffi::Error PrepareOutputs(const KernelObjects& state, int32_t device, std::string_view target,
                          const CudaDriver& driver, CUstream stream, AmaxBy amax_by, void* c, size_t c_bytes,
                          void* amax, size_t batches, void** tally) {
  if (amax_by == AmaxBy::kTally) {
    if (tally == nullptr) return ffi::Error::Internal(std::string(target) + ": no place for the amax tally's address");
    if (ffi::Error e = DeviceTallyWords(state, device, target, batches * 8, tally); e.failure()) return e;
  }
  if (amax_by == AmaxBy::kAtomicMax) {
    if (CUresult r = driver.cuMemsetD32Async(reinterpret_cast<CUdeviceptr>(amax), 0u, batches, stream);
        r != kCudaSuccess) {
      return ffi::Error::Internal(std::string(target) + ": zeroing amax failed: " + driver.ErrorName(r));
    }
  }
  if (!state.poison_outputs) return ffi::Error::Success();
  if (ffi::Error e = PoisonBytes(target, "C", driver, stream, c, c_bytes); e.failure()) return e;
  return amax_by == AmaxBy::kTally ? PoisonBytes(target, "amax", driver, stream, amax, batches * 4)
                                   : ffi::Error::Success();
}

ffi::Error RunKernel(const KernelObjects& state, int32_t device, std::string_view target, const CudaDriver& driver,
                     DslFunction* fn, void** args, size_t num_args, const int32_t* ret) {
  std::string error;
  if (RunDslFunction(fn, args, num_args, &error) != 0) {
    return ffi::Error::Internal(ErrorPrefix(target) + "CuteDSLRT_Function_Run(" + state.function_prefixes[device] +
                                ") failed: " + error);
  }
  if (*ret != 0) {
    return ffi::Error::Internal(ErrorPrefix(target) + "kernel " + state.function_prefixes[device] +
                                " returned CUDA error " + std::to_string(*ret) + " (as a driver code: " +
                                driver.ErrorName(*ret) + ")");
  }
  return ffi::Error::Success();
}


}  // namespace jbg
