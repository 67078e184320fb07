#include "proj_rope.h"

#include <initializer_list>

#include "cuda_driver.h"

namespace jbg {
namespace ffi = xla::ffi;

namespace {

constexpr const char* kNames[8] = {"x", "w", "cos", "sin", "out_fp8_row", "out_scales_row", "out_fp8_col",
                                   "out_scales_col"};
std::string Problem(int index, const BufferDesc& b, const std::string& expected) {
  return std::string(kProjRopeTarget) + ": " + kNames[index] + " has shape " + ShapeString(b.dims, b.rank) +
         " and dtype " + DtypeName(b.dtype) + "; expected " + expected;
}

bool Is(const BufferDesc& b, int dtype, std::initializer_list<int64_t> dims) {
  return b.dtype == dtype && HasShape(b, dims);
}

}  // namespace

std::string CheckProjRopeBuffers(const BufferDesc (&buf)[8], bool w_out_in, ProjRopeDims* dims) {
  const BufferDesc &x = buf[0], &w = buf[1];
  if (x.dtype != XLA_FFI_DataType_BF16 || x.rank != 3 || x.dims[0] != 1) {
    return Problem(0, x, "bfloat16 (1, T, K)");
  }
  const int64_t t = x.dims[1], k = x.dims[2];
  if (t < 32 || t % 32 != 0) return Problem(0, x, "T a positive multiple of 32 (the columnwise blocks)");
  if (k < 8 || k % 8 != 0) return Problem(0, x, "K a positive multiple of 8 (16-byte rows)");
  if (w.dtype != XLA_FFI_DataType_BF16 || w.rank != 3 || w.dims[0] != 1 || w.dims[w_out_in ? 2 : 1] != k) {
    return Problem(1, w, std::string("bfloat16 ") + (w_out_in ? "(1, H*192, K)" : "(1, K, H*192)") +
                             " with K = " + std::to_string(k));
  }
  const int64_t n = w.dims[w_out_in ? 1 : 2];
  if (n < kHeadDim || n % kHeadDim != 0) return Problem(1, w, "H*192 output features, H >= 1");
  const int64_t h = n / kHeadDim;
  for (int i : {2, 3}) {
    if (!Is(buf[i], XLA_FFI_DataType_BF16, {1, t, kRopeDim})) {
      return Problem(i, buf[i], "bfloat16 " + ShapeString({1, t, kRopeDim}));
    }
  }
  const int64_t blocks = kHeadDim / 32;
  if (!Is(buf[4], XLA_FFI_DataType_F8E4M3FN, {1, t, h, kHeadDim})) {
    return Problem(4, buf[4], "float8_e4m3fn " + ShapeString({1, t, h, kHeadDim}));
  }
  if (!Is(buf[5], XLA_FFI_DataType_U8, {1, t, h, blocks})) {
    return Problem(5, buf[5], "uint8 " + ShapeString({1, t, h, blocks}));
  }
  if (!Is(buf[6], XLA_FFI_DataType_F8E4M3FN, {1, t, h, kHeadDim})) {
    return Problem(6, buf[6], "float8_e4m3fn " + ShapeString({1, t, h, kHeadDim}));
  }
  if (!Is(buf[7], XLA_FFI_DataType_U8, {1, t / 32, h, kHeadDim})) {
    return Problem(7, buf[7], "uint8 " + ShapeString({1, t / 32, h, kHeadDim}));
  }
  for (int i = 0; i < 8; ++i) {
    if (ElementCount(buf[i]) >= kMaxBufferElements) return Problem(i, buf[i], "fewer than 2**31 elements");
    const auto address = reinterpret_cast<uintptr_t>(buf[i].data);
    if (address == 0 || address % kAlignment != 0) return Problem(i, buf[i], "a 16-byte aligned buffer");
  }
  *dims = ProjRopeDims{static_cast<int32_t>(t), static_cast<int32_t>(k), static_cast<int32_t>(h)};
  return "";
}

namespace {

ffi::Error Execute(CUstream stream, int32_t device, KernelObjects* state, ffi::AnyBuffer x, ffi::AnyBuffer w,
                   ffi::AnyBuffer cos, ffi::AnyBuffer sin, ffi::Result<ffi::AnyBuffer> row_codes,
                   ffi::Result<ffi::AnyBuffer> row_scales, ffi::Result<ffi::AnyBuffer> col_codes,
                   ffi::Result<ffi::AnyBuffer> col_scales, std::string_view, std::string_view,
                   ffi::Span<const uint8_t>, ffi::Span<const int64_t>, bool w_out_in) {
  const std::string target = kProjRopeTarget;
  DslFunction* fn = nullptr;
  if (ffi::Error e = DeviceFunction(*state, device, kProjRopeTarget, &fn); e.failure()) return e;
  const BufferDesc buffers[8] = {ToBufferDesc(x),          ToBufferDesc(w),          ToBufferDesc(cos),
                                 ToBufferDesc(sin),        ToBufferDesc(*row_codes), ToBufferDesc(*row_scales),
                                 ToBufferDesc(*col_codes), ToBufferDesc(*col_scales)};
  ProjRopeDims dims;
  if (std::string message = CheckProjRopeBuffers(buffers, w_out_in, &dims); !message.empty()) {
    return ffi::Error::InvalidArgument(message);
  }
  std::string error;
  const CudaDriver* driver = GetCudaDriver(&error);
  if (driver == nullptr) return ffi::Error::Internal(target + ": " + error);
  ScopedStreamContext context(*driver, stream);
  if (state->poison_outputs) {  // test aid: codes 0xFF (E4M3 NaN), scales 0xFE; unwritten elements fail checks
    for (int i = 4; i < 8; ++i) {
      if (ffi::Error e = PoisonBytes(target, kNames[i], *driver, stream, buffers[i].data,
                                     static_cast<size_t>(ElementCount(buffers[i])), i % 2 == 0 ? 0xFF : 0xFE);
          e.failure()) {
        return e;
      }
    }
  }
  KernelTensor tensors[10];
  auto tensor = [&](int i) { return KernelTensor{const_cast<void*>(buffers[i].data), ElementCount(buffers[i])}; };
  for (int i = 0; i < 4; ++i) tensors[i] = tensor(i);
  tensors[4] = tensors[5] = KernelTensor{const_cast<void*>(buffers[0].data), 0};  // x_scale, w_scale: bf16 path
  for (int i = 4; i < 8; ++i) tensors[i + 2] = tensor(i);
  // the device's SM count bounds the persistent kernels' grid (one CTA per SM: no second wave on smaller GPUs)
  int32_t t = dims.t, k = dims.k, h = dims.h, sms = state->multiprocessors[device], ret = 0;
  void* args[16] = {&tensors[0], &tensors[1], &tensors[2], &tensors[3], &tensors[4], &tensors[5],
                    &tensors[6], &tensors[7], &tensors[8], &tensors[9], &t,          &k,
                    &h,          &sms,        &stream,     &ret};
  return RunKernel(*state, device, kProjRopeTarget, *driver, fn, args, 16, &ret);
}

// The call site's attributes: the object table (read at instantiation) and the weight layout.
ffi::ErrorOr<std::unique_ptr<KernelObjects>> Instantiate(std::string_view archs, std::string_view prefixes,
                                                        ffi::Span<const uint8_t> objects,
                                                        ffi::Span<const int64_t> offsets, bool) {
  return InstantiateKernelObjects(kProjRopeTarget, archs, prefixes, objects, offsets);
}

}  // namespace
}  // namespace jbg

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbgProjRopeInstantiate, jbg::Instantiate,
                              jbg::BindObjectTable(xla::ffi::Ffi::BindInstantiate())
                                  .Attr<bool>("w_out_in"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbgProjRopeExecute, jbg::Execute,
                              jbg::BindObjectTable(xla::ffi::Ffi::BindExecute()
                                  .Ctx<xla::ffi::PlatformStream<jbg::CUstream>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<xla::ffi::State<jbg::KernelObjects>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>())
                                  .Attr<bool>("w_out_in"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
