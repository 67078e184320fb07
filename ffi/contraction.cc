#include "contraction.h"

#include <memory>

#include "cuda_driver.h"

namespace jbg {
namespace ffi = xla::ffi;

namespace {

constexpr const char* kNames[5] = {"x", "y", "bounds", "c", "amax"};

std::string Describe(const BufferDesc& b, int index) {
  return std::string(kContractionTarget) + ": " + kNames[index] + " is " + DtypeName(b.dtype) + " " +
         ShapeString(b.dims, b.rank);
}

// "" when buffer `index` holds fewer than 2**31 elements, else the message saying so.
std::string CheckCount(const BufferDesc& b, int index) {
  return ElementCount(b) < kMaxBufferElements ? "" : Describe(b, index) + "; expected fewer than 2**31 elements";
}

}  // namespace

std::string ParseContractionAttributes(std::string_view ab_dtype, std::string_view c_dtype, KernelDtypes* out) {
  const std::string where = std::string(kContractionTarget) + " attributes: ";
  KernelDtypes k{};
  if (ab_dtype != "bfloat16") {
    return where + "ab_dtype \"" + std::string(ab_dtype) + "\" is not supported; expected bfloat16";
  }
  k.ab = XLA_FFI_DataType_BF16;
  k.ab_bf16 = true;
  k.sf_vec_size = 0;  // bfloat16 operands carry no scales
  if (c_dtype != "float32" && c_dtype != "bfloat16") {
    return where + "c_dtype \"" + std::string(c_dtype) + "\" is not supported; expected float32 or bfloat16";
  }
  k.c = c_dtype == "float32" ? XLA_FFI_DataType_F32 : XLA_FFI_DataType_BF16;
  *out = k;
  return "";
}

std::string CheckContractionBuffers(const BufferDesc (&buf)[5], const KernelDtypes& kernel, ContractionDims* dims) {
  const BufferDesc &x = buf[0], &y = buf[1], &bounds = buf[2], &c = buf[3], &amax = buf[4];
  std::string e;
  if (x.dtype != kernel.ab) return Describe(x, 0) + "; the kernel objects were compiled for " + CodeName(kernel);
  if (x.rank != 3) return Describe(x, 0) + "; expected rank 3 (L, T, K)";
  const int64_t l = x.dims[0], t = x.dims[1], k = x.dims[2];
  if (l < 1 || t < 1 || k < 1) return Describe(x, 0) + "; expected every dimension >= 1";
  if (!(e = CheckCount(x, 0)).empty()) return e;  // bounds L, T and K, which the products below take
  if (k % 8 != 0) return Describe(x, 0) + "; expected K a multiple of 8 (16-byte rows of bfloat16)";
  if (y.dtype != kernel.ab) return Describe(y, 1) + "; the kernel objects were compiled for " + CodeName(kernel);
  const int64_t n = y.rank == 3 ? y.dims[2] : 0;
  if (y.rank != 3 || y.dims[0] != l || y.dims[1] != t || n < 1) {
    return Describe(y, 1) + "; expected (L, T, N) = (" + std::to_string(l) + ", " + std::to_string(t) +
           ", N >= 1) for x's L and T";
  }
  if (n % 8 != 0) return Describe(y, 1) + "; expected N a multiple of 8 (16-byte rows of bfloat16)";
  if (bounds.dtype != XLA_FFI_DataType_S32) return Describe(bounds, 2) + "; expected int32 group bounds";
  const int64_t g = bounds.rank == 3 ? bounds.dims[1] : 0;
  if (bounds.rank != 3 || bounds.dims[0] != l || g < 1 || bounds.dims[2] != kBoundFields) {
    return Describe(bounds, 2) + "; expected (L, G, 2) = (" + std::to_string(l) +
           ", G >= 1, 2): the rows [start, end) of each group";
  }
  if (c.dtype != kernel.c) {
    return Describe(c, 3) + "; the kernel objects were compiled for a " + DtypeName(kernel.c) + " C";
  }
  if (!HasShape(c, {l, g, k, n})) return Describe(c, 3) + "; expected " + ShapeString({l, g, k, n}) + " (L, G, K, N)";
  // The kernel addresses c in 64 bits, so only one (K, N) slice and the L·G slices need fit 32 bits, not c as a whole.
  if (n > (kMaxBufferElements - 1) / k) {
    return Describe(c, 3) + "; expected one (K, N) slice of fewer than 2**31 elements";
  }
  if (g > (kMaxBufferElements - 1) / l) return Describe(c, 3) + "; expected L*G below 2**31";
  if (amax.dtype != XLA_FFI_DataType_F32 || !HasShape(amax, {l})) {
    return Describe(amax, 4) + "; expected float32 " + ShapeString({l}) + " (L,)";
  }
  for (int i = 0; i < 5; ++i) {
    if (i != 3 && !(e = CheckCount(buf[i], i)).empty()) return e;
    const auto address = reinterpret_cast<uintptr_t>(buf[i].data);
    if (address == 0 || address % kAlignment != 0) {
      return Describe(buf[i], i) + " at address " + std::to_string(address) + "; expected a 16-byte aligned pointer";
    }
  }
  *dims = ContractionDims{static_cast<int32_t>(t), static_cast<int32_t>(k), static_cast<int32_t>(n),
                          static_cast<int32_t>(l), static_cast<int32_t>(g)};
  return "";
}

namespace {

using StateOr = ffi::ErrorOr<std::unique_ptr<KernelObjects>>;

StateOr Instantiate(std::string_view archs, std::string_view prefixes, ffi::Span<const uint8_t> objects,
                    ffi::Span<const int64_t> offsets, std::string_view ab_dtype, std::string_view c_dtype) {
  KernelDtypes dtypes{};
  if (std::string why = ParseContractionAttributes(ab_dtype, c_dtype, &dtypes); !why.empty()) {
    return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(why));
  }
  StateOr state = InstantiateKernelObjects(kContractionTarget, archs, prefixes, objects, offsets);
  if (state.has_value()) (*state)->dtypes = dtypes;
  return state;
}

// Everything the execute stage needs from the attributes is in the state, which instantiation filled.
ffi::Error Execute(CUstream stream, int32_t device, KernelObjects* state, ffi::AnyBuffer x, ffi::AnyBuffer y,
                   ffi::AnyBuffer bounds, ffi::Result<ffi::AnyBuffer> c, ffi::Result<ffi::AnyBuffer> amax) {
  DslFunction* fn = nullptr;
  if (ffi::Error e = DeviceFunction(*state, device, kContractionTarget, &fn); e.failure()) return e;
  const BufferDesc buffers[5] = {ToBufferDesc(x), ToBufferDesc(y), ToBufferDesc(bounds), ToBufferDesc(*c),
                                 ToBufferDesc(*amax)};
  ContractionDims dims;
  if (std::string message = CheckContractionBuffers(buffers, state->dtypes, &dims); !message.empty()) {
    return ffi::Error::InvalidArgument(message);
  }
  std::string error;
  const CudaDriver* driver = GetCudaDriver(&error);  // loaded at instantiation; a pointer read here
  if (driver == nullptr) return ffi::Error::Internal(std::string(kContractionTarget) + ": " + error);
  ScopedStreamContext context(*driver, stream);
  // c's count exactly (ElementCount saturates at 2**31): L·G slices (K, N), each below 2**31 elements.
  const int64_t c_count = int64_t{dims.l} * dims.g * (int64_t{dims.k} * dims.n);
  // amax is an integer atomic max over the bits of |C|: it starts from +0.0, on XLA's stream, before the kernel.
  const size_t c_bytes = static_cast<size_t>(c_count) * ElementBytes(buffers[3].dtype);
  if (ffi::Error e = PrepareOutputs(*state, device, kContractionTarget, *driver, stream, AmaxBy::kAtomicMax,
                                    c->untyped_data(), c_bytes, amax->untyped_data(), static_cast<size_t>(dims.l));
      e.failure()) {
    return e;
  }
  KernelTensor tensors[5];
  for (int i = 0; i < 5; ++i) tensors[i] = KernelTensor{const_cast<void*>(buffers[i].data), ElementCount(buffers[i])};
  tensors[3].count = c_count;
  int32_t t = dims.t, k = dims.k, n = dims.n, l = dims.l, g = dims.g, ret = 0;
  // fn(x, y, bounds, c, amax, t, k, n, l, g, stream) and the kernel's status slot.
  void* args[12] = {&tensors[0], &tensors[1], &tensors[2], &tensors[3], &tensors[4], &t,
                    &k,          &n,          &l,          &g,          &stream,     &ret};
  return RunKernel(*state, device, kContractionTarget, *driver, fn, args, 12, &ret);
}

}  // namespace
}  // namespace jbg

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbgContractionInstantiate, jbg::Instantiate,
                              jbg::BindObjectTable(xla::ffi::Ffi::BindInstantiate())
                                  .Attr<std::string_view>("ab_dtype")
                                  .Attr<std::string_view>("c_dtype"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbgContractionExecute, jbg::Execute,
                              xla::ffi::Ffi::BindExecute()
                                  .Ctx<xla::ffi::PlatformStream<jbg::CUstream>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<xla::ffi::State<jbg::KernelObjects>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // x
                                  .Arg<xla::ffi::AnyBuffer>()   // y
                                  .Arg<xla::ffi::AnyBuffer>()   // bounds
                                  .Ret<xla::ffi::AnyBuffer>()   // c
                                  .Ret<xla::ffi::AnyBuffer>(),  // amax
                              {xla::ffi::Traits::kCmdBufferCompatible});
