#include "quantize_pair.h"

#include <vector>

#include "cuda_driver.h"

namespace jbg {
namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;        // elements per E8M0 scale, along either axis
constexpr int64_t kTileCols = 256;    // columns of one kernel tile (32 rows each)

std::string Problem(const char* name, const BufferDesc& b, const std::string& expected) {
  return std::string(kQuantizePairTarget) + ": " + name + " has shape " + ShapeString(b.dims, b.rank) +
         " and dtype " + DtypeName(b.dtype) + "; expected " + expected;
}

}  // namespace

std::string CheckQuantizePairBuffers(const BufferDesc* buffers, QuantizePairDims* dims) {
  const BufferDesc &w = buffers[0], &values = buffers[1], &codes = buffers[2], &scales = buffers[3];
  *dims = QuantizePairDims{};
  if (w.dtype != XLA_FFI_DataType_BF16 || w.rank < 2) return Problem("w", w, "bfloat16 of rank >= 2");
  std::vector<int64_t> shape(w.dims, w.dims + w.rank);
  const int64_t r = shape[w.rank - 2], c = shape[w.rank - 1];
  int64_t rows = 1;  // saturated: a product past 2**31 fails below, whatever the dims
  for (size_t i = 0; i + 1 < w.rank; ++i) {
    if (shape[i] < 1) return Problem("w", w, "every dimension >= 1");
    rows = rows > kMaxBufferElements / shape[i] ? kMaxBufferElements : rows * shape[i];
  }
  if (c < 1 || r % kBlock != 0 || c % kBlock != 0) {
    return Problem("w", w, "its last two dimensions positive multiples of 32");
  }
  if (rows >= kMaxBufferElements || c >= kMaxBufferElements || rows > (kMaxBufferElements - 1) / (c / kBlock) ||
      (rows / kBlock) > (kMaxBufferElements - 1) / CeilDiv(c, kTileCols)) {
    return Problem("w", w, "rows (its leading dimensions' product) and columns below 2**31, and fewer than 2**31 "
                           "scales");
  }
  if (values.dtype != XLA_FFI_DataType_BF16 || !HasShape(values, shape)) {
    return Problem("values", values, "bfloat16 " + ShapeString(shape.data(), shape.size()));
  }
  if ((codes.dtype != XLA_FFI_DataType_F8E4M3FN && codes.dtype != XLA_FFI_DataType_F8E5M2) ||
      !HasShape(codes, shape)) {
    return Problem("codes", codes, "float8_e4m3fn or float8_e5m2 " + ShapeString(shape.data(), shape.size()));
  }
  std::vector<int64_t> scale_shape = shape;
  scale_shape.back() /= kBlock;
  if (scales.dtype != XLA_FFI_DataType_U8 || !HasShape(scales, scale_shape)) {
    return Problem("scales", scales, "uint8 " + ShapeString(scale_shape.data(), scale_shape.size()));
  }
  const char* names[4] = {"w", "values", "codes", "scales"};
  for (int i = 0; i < 4; ++i) {
    const auto address = reinterpret_cast<uintptr_t>(buffers[i].data);
    if (address == 0 || address % kAlignment != 0) return Problem(names[i], buffers[i], "a 16-byte aligned buffer");
  }
  *dims = QuantizePairDims{static_cast<int32_t>(rows), static_cast<int32_t>(c)};
  return "";
}

namespace {

ffi::Error Execute(CUstream stream, int32_t device, KernelObjects* state, ffi::AnyBuffer w,
                   ffi::Result<ffi::AnyBuffer> values, ffi::Result<ffi::AnyBuffer> codes,
                   ffi::Result<ffi::AnyBuffer> scales, std::string_view, std::string_view, ffi::Span<const uint8_t>,
                   ffi::Span<const int64_t>) {
  const std::string target = kQuantizePairTarget;
  DslFunction* fn = nullptr;
  if (ffi::Error e = DeviceFunction(*state, device, kQuantizePairTarget, &fn); e.failure()) return e;
  BufferDesc buffers[4] = {ToBufferDesc(w), ToBufferDesc(*values), ToBufferDesc(*codes), ToBufferDesc(*scales)};
  QuantizePairDims dims;
  if (std::string message = CheckQuantizePairBuffers(buffers, &dims); !message.empty()) {
    return ffi::Error::InvalidArgument(message);
  }
  std::string error;
  const CudaDriver* driver = GetCudaDriver(&error);
  if (driver == nullptr) return ffi::Error::Internal(target + ": " + error);
  ScopedStreamContext context(*driver, stream);
  // the counts exactly (ElementCount saturates at 2**31): w, values and codes hold rows·cols elements, the scales a
  // 32nd of them
  const int64_t elements = int64_t{dims.rows} * dims.cols;
  const int64_t counts[4] = {elements, elements, elements, elements / kBlock};
  if (state->poison_outputs) {  // test aid: 0xFF bytes are NaN in bf16 values and FP8 codes, so a missed one fails
    const char* names[3] = {"values", "codes", "scales"};
    for (int i = 1; i < 4; ++i) {
      const size_t bytes = static_cast<size_t>(counts[i]) * ElementBytes(buffers[i].dtype);
      if (CUresult r = driver->cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(buffers[i].data), 0xFF, bytes, stream);
          r != kCudaSuccess) {
        return ffi::Error::Internal(target + ": poisoning " + names[i - 1] + " failed: " + driver->ErrorName(r));
      }
    }
  }
  KernelTensor tensors[4];
  for (int i = 0; i < 4; ++i) tensors[i] = KernelTensor{const_cast<void*>(buffers[i].data), counts[i]};
  int32_t rows = dims.rows, cols = dims.cols, ret = 0;
  void* args[8] = {&tensors[0], &tensors[1], &tensors[2], &tensors[3], &rows, &cols, &stream, &ret};
  return RunKernel(*state, device, kQuantizePairTarget, *driver, fn, args, 8, &ret);
}

ffi::ErrorOr<std::unique_ptr<KernelObjects>> Instantiate(std::string_view archs, std::string_view prefixes,
                                                        ffi::Span<const uint8_t> objects,
                                                        ffi::Span<const int64_t> offsets) {
  return InstantiateKernelObjects(kQuantizePairTarget, archs, prefixes, objects, offsets);
}

}  // namespace
}  // namespace jbg

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbgQuantizePairInstantiate, jbg::Instantiate,
                              jbg::BindObjectTable(xla::ffi::Ffi::BindInstantiate()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbgQuantizePairExecute, jbg::Execute,
                              jbg::BindObjectTable(xla::ffi::Ffi::BindExecute()
                                  .Ctx<xla::ffi::PlatformStream<jbg::CUstream>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<xla::ffi::State<jbg::KernelObjects>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // w
                                  .Ret<xla::ffi::AnyBuffer>()  // values
                                  .Ret<xla::ffi::AnyBuffer>()  // codes
                                  .Ret<xla::ffi::AnyBuffer>()),  // scales
                              {xla::ffi::Traits::kCmdBufferCompatible});
