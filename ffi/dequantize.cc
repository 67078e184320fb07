#include "dequantize.h"

#include <vector>

#include "cuda_driver.h"

namespace jbg {
namespace ffi = xla::ffi;

namespace {

constexpr const char* kNames[3] = {"codes", "scales", "out"};

std::string Problem(int index, const BufferDesc& b, const std::string& expected) {
  return std::string(kDequantizeTarget) + ": " + kNames[index] + " has shape " + ShapeString(b.dims, b.rank) +
         " and dtype " + DtypeName(b.dtype) + "; expected " + expected;
}

bool SameShape(const BufferDesc& b, const std::vector<int64_t>& dims) {
  if (b.rank != dims.size()) return false;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (b.dims[i] != dims[i]) return false;
  }
  return true;
}

}  // namespace

std::string CheckDequantizeBuffers(const BufferDesc (&buf)[3], int64_t scale_axis, DequantizeDims* dims) {
  const BufferDesc &codes = buf[0], &scales = buf[1], &out = buf[2];
  if (scale_axis != -1 && scale_axis != -2) {
    return std::string(kDequantizeTarget) + ": scale_axis must be -1 or -2, got " + std::to_string(scale_axis);
  }
  if (codes.dtype != XLA_FFI_DataType_F8E4M3FN || codes.rank < 2) {
    return Problem(0, codes, "float8_e4m3fn of rank >= 2");
  }
  const int64_t r = codes.dims[codes.rank - 2], c = codes.dims[codes.rank - 1];
  const bool along_rows = scale_axis == -1;  // one scale per 32 codes of a row
  if (r < 1 || c < 1 || c % kRunMultiple != 0 || (!along_rows && r % kMxBlock != 0)) {
    return Problem(0, codes, along_rows ? "the last dimension a positive multiple of 32"
                                        : "both last dimensions positive multiples of 32");
  }
  std::vector<int64_t> shape(codes.dims, codes.dims + codes.rank);
  std::vector<int64_t> scale_shape = shape;
  scale_shape[codes.rank + scale_axis] /= kMxBlock;
  if (scales.dtype != XLA_FFI_DataType_U8 || !SameShape(scales, scale_shape)) {
    return Problem(1, scales, "uint8 " + ShapeString(scale_shape.data(), scale_shape.size()));
  }
  if (out.dtype != XLA_FFI_DataType_BF16 || !SameShape(out, shape)) {
    return Problem(2, out, "bfloat16 " + ShapeString(shape.data(), shape.size()));
  }
  for (int i = 0; i < 3; ++i) {
    if (ElementCount(buf[i]) >= kMaxBufferElements) return Problem(i, buf[i], "fewer than 2**31 elements");
    const auto address = reinterpret_cast<uintptr_t>(buf[i].data);
    if (address == 0 || address % kAlignment != 0) return Problem(i, buf[i], "a 16-byte aligned buffer");
  }
  *dims = DequantizeDims{static_cast<int32_t>(ElementCount(codes) / c), static_cast<int32_t>(c)};
  return "";
}

namespace {

ffi::Error Execute(CUstream stream, int32_t device, KernelObjects* state, ffi::AnyBuffer codes,
                   ffi::AnyBuffer scales, ffi::Result<ffi::AnyBuffer> out, std::string_view, std::string_view,
                   ffi::Span<const uint8_t>, ffi::Span<const int64_t>, int64_t scale_axis) {
  const std::string target = kDequantizeTarget;
  DslFunction* fn = nullptr;
  if (ffi::Error e = DeviceFunction(*state, device, kDequantizeTarget, &fn); e.failure()) return e;
  const BufferDesc buffers[3] = {ToBufferDesc(codes), ToBufferDesc(scales), ToBufferDesc(*out)};
  DequantizeDims dims;
  if (std::string message = CheckDequantizeBuffers(buffers, scale_axis, &dims); !message.empty()) {
    return ffi::Error::InvalidArgument(message);
  }
  std::string error;
  const CudaDriver* driver = GetCudaDriver(&error);
  if (driver == nullptr) return ffi::Error::Internal(target + ": " + error);
  ScopedStreamContext context(*driver, stream);
  if (state->poison_outputs) {  // test aid: 0xFFFF is a bf16 NaN, so an element the kernel misses fails checks
    if (CUresult r = driver->cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(buffers[2].data), 0xFF,
                                             static_cast<size_t>(ElementCount(buffers[2])) * 2, stream);
        r != kCudaSuccess) {
      return ffi::Error::Internal(target + ": poisoning out failed: " + driver->ErrorName(r));
    }
  }
  KernelTensor tensors[3];
  for (int i = 0; i < 3; ++i) tensors[i] = KernelTensor{const_cast<void*>(buffers[i].data), ElementCount(buffers[i])};
  int32_t rows = dims.rows, cols = dims.cols, ret = 0;
  void* args[7] = {&tensors[0], &tensors[1], &tensors[2], &rows, &cols, &stream, &ret};
  return RunKernel(*state, device, kDequantizeTarget, *driver, fn, args, 7, &ret);
}

ffi::ErrorOr<std::unique_ptr<KernelObjects>> Instantiate(std::string_view archs, std::string_view prefixes,
                                                        ffi::Span<const uint8_t> objects,
                                                        ffi::Span<const int64_t> offsets, int64_t) {
  return InstantiateKernelObjects(kDequantizeTarget, archs, prefixes, objects, offsets);
}

}  // namespace
}  // namespace jbg

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbgDequantizeInstantiate, jbg::Instantiate,
                              jbg::BindObjectTable(xla::ffi::Ffi::BindInstantiate())
                                  .Attr<int64_t>("scale_axis"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbgDequantizeExecute, jbg::Execute,
                              jbg::BindObjectTable(xla::ffi::Ffi::BindExecute()
                                  .Ctx<xla::ffi::PlatformStream<jbg::CUstream>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<xla::ffi::State<jbg::KernelObjects>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>())
                                  .Attr<int64_t>("scale_axis"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
