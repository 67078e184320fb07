#include "gemm_amax.h"

#include <cstdlib>
#include <memory>
#include <utility>

#include "cuda_driver.h"
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

namespace {

constexpr const char* kBufferNames[6] = {"a", "b", "sfa", "sfb", "c", "amax"};
constexpr int64_t kMaxElements = kMaxBufferElements;

// ceil(x / y) for x >= 0, y > 0, without the overflow of (x + y - 1) / y near INT64_MAX.
int64_t CeilDiv(int64_t x, int64_t y) { return x / y + (x % y != 0); }

std::string Describe(const BufferDesc& b, int index) {
  return std::string("jbg_gemm_amax: ") + kBufferNames[index] + " is " + DtypeName(b.dtype) + " " +
         ShapeString(b.dims, b.rank);
}

// Checks that buffer `index` has exactly `want` dims ("" when it does).
std::string ExpectShape(const BufferDesc& b, int index, std::initializer_list<int64_t> want, const char* what) {
  bool same = b.rank == want.size();
  for (size_t i = 0; same && i < b.rank; ++i) same = b.dims[i] == want.begin()[i];
  if (same) return "";
  return Describe(b, index) + "; expected " + ShapeString(want.begin(), want.size()) + " " + what;
}

}  // namespace

std::string ParseKernelDtypes(std::string_view ab_dtype, std::string_view c_dtype, KernelDtypes* out) {
  const std::string where = "jbg_gemm_amax attributes: ";
  const std::string ab(ab_dtype), c(c_dtype);
  if (ab == "float8_e4m3fn") {
    out->ab = XLA_FFI_DataType_F8E4M3FN;
  } else if (ab == "float8_e5m2") {
    out->ab = XLA_FFI_DataType_F8E5M2;
  } else {
    return where + "ab_dtype \"" + ab + "\" is not supported; expected float8_e4m3fn or float8_e5m2";
  }
  if (c == "float32") {
    out->c = XLA_FFI_DataType_F32;
  } else if (c == "bfloat16") {
    out->c = XLA_FFI_DataType_BF16;
  } else {
    return where + "c_dtype \"" + c + "\" is not supported; expected float32 or bfloat16";
  }
  return "";
}

std::string CheckGemmAmaxBuffers(const BufferDesc (&buf)[6], KernelDtypes kernel, GemmDims* dims) {
  const BufferDesc &a = buf[0], &b = buf[1], &c = buf[4], &amax = buf[5];
  if (a.dtype != XLA_FFI_DataType_F8E4M3FN && a.dtype != XLA_FFI_DataType_F8E5M2) {
    return Describe(a, 0) + "; expected float8_e4m3fn or float8_e5m2 codes";
  }
  if (a.dtype != kernel.ab) {
    return Describe(a, 0) + "; the kernel objects were compiled for " + DtypeName(kernel.ab) + " operands";
  }
  if (b.dtype != a.dtype) return Describe(b, 1) + "; expected the dtype of a (" + DtypeName(a.dtype) + ")";
  for (int i : {2, 3}) {
    if (buf[i].dtype != XLA_FFI_DataType_U8) return Describe(buf[i], i) + "; expected uint8 E8M0 scale bytes";
  }
  if (c.dtype != XLA_FFI_DataType_F32 && c.dtype != XLA_FFI_DataType_BF16) {
    return Describe(c, 4) + "; expected float32 or bfloat16";
  }
  if (c.dtype != kernel.c) {  // a float32 kernel writing a bfloat16 C would run past the end of the buffer
    return Describe(c, 4) + "; the kernel objects were compiled for a " + DtypeName(kernel.c) + " C";
  }
  if (amax.dtype != XLA_FFI_DataType_F32) return Describe(amax, 5) + "; expected float32";
  if (a.rank != 3) return Describe(a, 0) + "; expected rank 3 (L, M, K)";
  const int64_t l = a.dims[0], m = a.dims[1], k = a.dims[2];
  if (l < 1 || m < 1 || k < 1) return Describe(a, 0) + "; expected every dimension >= 1";
  if (k % 16 != 0) return Describe(a, 0) + "; expected K a multiple of 16 (16-byte rows)";
  if (b.rank != 3 || b.dims[0] != l || b.dims[2] != k || b.dims[1] < 1) {
    return Describe(b, 1) + "; expected (L, N, K) = (" + std::to_string(l) + ", N >= 1, " + std::to_string(k) + ")";
  }
  const int64_t n = b.dims[1];
  const int64_t k_atoms = CeilDiv(CeilDiv(k, kScaleBlock), kAtomBlocks);
  std::string e;
  if (!(e = ExpectShape(buf[2], 2, {l, CeilDiv(m, kAtomRows), k_atoms, 32, 4, 4},
                        "(L, ceil(M/128), ceil(K/128), 32, 4, 4): the 128x4 scale atom")).empty()) {
    return e;
  }
  if (!(e = ExpectShape(buf[3], 3, {l, CeilDiv(n, kAtomRows), k_atoms, 32, 4, 4},
                        "(L, ceil(N/128), ceil(K/128), 32, 4, 4): the 128x4 scale atom")).empty()) {
    return e;
  }
  if (!(e = ExpectShape(c, 4, {l, m, n}, "(L, M, N)")).empty()) return e;
  if (!(e = ExpectShape(amax, 5, {l}, "(L,)")).empty()) return e;
  for (int i = 0; i < 6; ++i) {
    if (ElementCount(buf[i]) >= kMaxElements) return Describe(buf[i], i) + "; expected fewer than 2**31 elements";
    const auto address = reinterpret_cast<uintptr_t>(buf[i].data);
    if (address == 0 || address % kAlignment != 0) {
      return Describe(buf[i], i) + " at address " + std::to_string(address) + "; expected a 16-byte aligned pointer";
    }
  }
  *dims = GemmDims{static_cast<int32_t>(m), static_cast<int32_t>(n), static_cast<int32_t>(k),
                   static_cast<int32_t>(l)};
  return "";
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

bool ParseObjectTable(std::string_view archs, std::string_view function_prefixes, size_t objects_size,
                      const int64_t* offsets, size_t num_offsets, std::vector<ObjectEntry>* out,
                      std::string* error) {
  const std::vector<std::string_view> arch_list = SplitCommas(archs);
  const std::vector<std::string_view> prefix_list = SplitCommas(function_prefixes);
  const std::string where = "jbg_gemm_amax attributes: ";
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

// The C struct the exported kernel takes for each 1-D tensor argument: the data pointer, then the element count.
// Kernels exported with 32-bit symbolic sizes read the low half of `count` (little-endian), which is the same
// number because CheckGemmAmaxBuffers keeps every count below 2**31.
struct KernelTensor {
  void* data;
  int64_t count;
};
static_assert(sizeof(KernelTensor) == 16, "the DSL's tensor struct is a pointer and one 8-byte slot");

using StateOr = ffi::ErrorOr<std::unique_ptr<KernelObjects>>;

StateOr Fail(ffi::Error error) { return ffi::Unexpected<ffi::Error>(std::move(error)); }

}  // namespace

// What a user whose GPU has no object in the program can do.
constexpr const char kWayOut[] =
    ". Lower (or export) the program on a machine with this GPU, which embeds its kernel where one exists, or call "
    "the operation with implementation='xla' (the reference runs everywhere)";

StateOr InstantiateKernelObjects(std::string_view target, std::string_view archs, std::string_view prefixes,
                                 ffi::Span<const uint8_t> objects, ffi::Span<const int64_t> offsets) {
  const std::string where = std::string(target) + ": ";
  std::string error;
  std::vector<ObjectEntry> entries;
  if (!ParseObjectTable(archs, prefixes, objects.size(), offsets.begin(), offsets.size(), &entries, &error)) {
    return Fail(ffi::Error::InvalidArgument(error));
  }
  const CudaDriver* driver = GetCudaDriver(&error);
  if (driver == nullptr) return Fail(ffi::Error(ffi::ErrorCode::kFailedPrecondition, where + error));
  std::vector<ComputeCapability> caps;
  if (!VisibleCapabilities(*driver, &caps, &error)) return Fail(ffi::Error::Internal(where + error));

  auto state = std::make_unique<KernelObjects>();
  state->archs = std::string(archs);
  const char* poison = std::getenv("JAX_BLOCKGEMM_POISON_OUTPUTS");
  state->poison_outputs = poison != nullptr && poison[0] != '\0' && poison[0] != '0';
  state->functions.assign(caps.size(), nullptr);
  state->function_prefixes.assign(caps.size(), "");
  bool any = false;
  std::string seen;
  for (size_t dev = 0; dev < caps.size(); ++dev) {
    const std::string cc = std::to_string(caps[dev].major) + "." + std::to_string(caps[dev].minor);
    state->capabilities.push_back(cc);
    if (seen.find(cc) == std::string::npos) seen += (seen.empty() ? "" : ", ") + cc;
    for (const ObjectEntry& entry : entries) {
      if (entry.cc_major != caps[dev].major || entry.cc_minor != caps[dev].minor) continue;
      std::string_view bytes(reinterpret_cast<const char*>(objects.begin()) + entry.begin, entry.end - entry.begin);
      // Only the object a device will run is checked (and loaded): a program may carry others for other GPUs.
      if (std::string why = CheckKernelObject(bytes, entry.function_prefix); !why.empty()) {
        return Fail(ffi::Error::InvalidArgument(where + why + "; arch " + entry.arch));
      }
      DslFunction* fn = LoadDslFunction(bytes, entry.function_prefix, &error);
      if (fn == nullptr) return Fail(ffi::Error::Internal(where + error));
      state->functions[dev] = fn;
      state->function_prefixes[dev] = entry.function_prefix;
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
  const std::string where = std::string(target) + ": ";
  if (device < 0 || static_cast<size_t>(device) >= state.functions.size()) {
    return ffi::Error::Internal(where + "device ordinal " + std::to_string(device) + " is not among the " +
                                std::to_string(state.functions.size()) + " devices seen at instantiation");
  }
  *fn = state.functions[device];
  if (*fn == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      where + "no kernel object for compute capability " + state.capabilities[device] +
                          " (device " + std::to_string(device) + "); this program carries objects for " + state.archs +
                          kWayOut);
  }
  return ffi::Error::Success();
}

ffi::Error RunKernel(const KernelObjects& state, int32_t device, std::string_view target, const CudaDriver& driver,
                     DslFunction* fn, void** args, size_t num_args, const int32_t* ret) {
  const std::string where = std::string(target) + ": ";
  std::string error;
  if (RunDslFunction(fn, args, num_args, &error) != 0) {
    return ffi::Error::Internal(where + "CuteDSLRT_Function_Run(" + state.function_prefixes[device] + ") failed: " +
                                error);
  }
  if (*ret != 0) {
    return ffi::Error::Internal(where + "kernel " + state.function_prefixes[device] + " returned CUDA error " +
                                std::to_string(*ret) + " (as a driver code: " + driver.ErrorName(*ret) + ")");
  }
  return ffi::Error::Success();
}

namespace {

StateOr Instantiate(std::string_view archs, std::string_view prefixes, ffi::Span<const uint8_t> objects,
                    ffi::Span<const int64_t> offsets, std::string_view ab_dtype, std::string_view c_dtype) {
  KernelDtypes dtypes{};
  if (std::string why = ParseKernelDtypes(ab_dtype, c_dtype, &dtypes); !why.empty()) {
    return Fail(ffi::Error::InvalidArgument(why));
  }
  StateOr state = InstantiateKernelObjects(kGemmAmaxTarget, archs, prefixes, objects, offsets);
  if (state.has_value()) (*state)->dtypes = dtypes;
  return state;
}

BufferDesc Desc(const ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  return BufferDesc{static_cast<int>(buffer.element_type()), dims.begin(), dims.size(), buffer.untyped_data()};
}

ffi::Error Execute(CUstream stream, int32_t device, KernelObjects* state, ffi::AnyBuffer a, ffi::AnyBuffer b,
                   ffi::AnyBuffer sfa, ffi::AnyBuffer sfb, ffi::Result<ffi::AnyBuffer> c,
                   ffi::Result<ffi::AnyBuffer> amax) {
  DslFunction* fn = nullptr;
  if (ffi::Error e = DeviceFunction(*state, device, kGemmAmaxTarget, &fn); e.failure()) return e;
  const BufferDesc buffers[6] = {Desc(a), Desc(b), Desc(sfa), Desc(sfb), Desc(*c), Desc(*amax)};
  GemmDims dims;
  if (std::string message = CheckGemmAmaxBuffers(buffers, state->dtypes, &dims); !message.empty()) {
    return ffi::Error::InvalidArgument(message);
  }
  std::string error;
  const CudaDriver* driver = GetCudaDriver(&error);  // loaded at instantiation; a pointer read here
  if (driver == nullptr) return ffi::Error::Internal("jbg_gemm_amax: " + error);
  ScopedStreamContext context(*driver, stream);
  // amax is an atomic max over |C| bit patterns: start from +0.0 on XLA's stream, before the kernel.
  if (CUresult r = driver->cuMemsetD32Async(reinterpret_cast<CUdeviceptr>(amax->untyped_data()), 0u,
                                            static_cast<size_t>(dims.l), stream);
      r != kCudaSuccess) {
    return ffi::Error::Internal("jbg_gemm_amax: zeroing amax failed: " + driver->ErrorName(r));
  }
  // Test aid: all-ones bytes are NaN in float32 and bfloat16, so any element the kernel leaves unwritten fails
  // the caller's check. Read once at instantiation; costs one memset per launch when on.
  if (state->poison_outputs) {
    const size_t c_bytes = static_cast<size_t>(dims.l) * dims.m * dims.n * (c->element_type() == ffi::F32 ? 4 : 2);
    if (CUresult r = driver->cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(c->untyped_data()), 0xFF, c_bytes, stream);
        r != kCudaSuccess) {
      return ffi::Error::Internal("jbg_gemm_amax: poisoning C failed: " + driver->ErrorName(r));
    }
  }
  KernelTensor tensors[6];
  for (int i = 0; i < 6; ++i) tensors[i] = KernelTensor{const_cast<void*>(buffers[i].data), ElementCount(buffers[i])};
  int32_t m = dims.m, n = dims.n, k = dims.k, l = dims.l, ret = 0;
  void* args[12] = {&tensors[0], &tensors[1], &tensors[2], &tensors[3], &tensors[4], &tensors[5],
                    &m,          &n,          &k,          &l,          &stream,     &ret};
  return RunKernel(*state, device, kGemmAmaxTarget, *driver, fn, args, 12, &ret);
}

}  // namespace


}  // namespace jbg

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbgGemmAmaxInstantiate, jbg::Instantiate,
                              xla::ffi::Ffi::BindInstantiate()
                                  .Attr<std::string_view>("archs")
                                  .Attr<std::string_view>("function_prefixes")
                                  .Attr<xla::ffi::Span<const uint8_t>>("objects")
                                  .Attr<xla::ffi::Span<const int64_t>>("offsets")
                                  .Attr<std::string_view>("ab_dtype")
                                  .Attr<std::string_view>("c_dtype"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbgGemmAmaxExecute, jbg::Execute,
                              xla::ffi::Ffi::BindExecute()
                                  .Ctx<xla::ffi::PlatformStream<jbg::CUstream>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<xla::ffi::State<jbg::KernelObjects>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
