#include "gemm_amax.h"

#include <cstdlib>
#include <memory>
#include <utility>

#include "cuda_driver.h"

namespace jbg {
namespace ffi = xla::ffi;

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

namespace {

using StateOr = ffi::ErrorOr<std::unique_ptr<KernelObjects>>;

StateOr Fail(ffi::Error error) { return ffi::Unexpected<ffi::Error>(std::move(error)); }

}  // namespace

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
