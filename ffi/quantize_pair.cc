#include "quantize_pair.h"

#include <optional>
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

std::string CheckQuantizePairBuffers(const BufferDesc* buffers, QuantizePairSchedule schedule,
                                     QuantizePairDims* dims) {
  const bool gather = schedule != QuantizePairSchedule::kPlain;
  const BufferDesc& w = buffers[0];
  const BufferDesc* map = gather ? &buffers[1] : nullptr;
  const BufferDesc &values = buffers[gather ? 2 : 1], &codes = buffers[gather ? 3 : 2],
                   &scales = buffers[gather ? 4 : 3];
  *dims = QuantizePairDims{};
  if (w.dtype != XLA_FFI_DataType_BF16 || w.rank < 2) return Problem("w", w, "bfloat16 of rank >= 2");
  std::vector<int64_t> shape(w.dims, w.dims + w.rank);
  const int64_t r = shape[w.rank - 2], c = shape[w.rank - 1];
  int64_t src_rows = 1;  // saturated: a product past 2**31 fails below, whatever the dims
  for (size_t i = 0; i + 1 < w.rank; ++i) {
    if (shape[i] < 1) return Problem("w", w, "every dimension >= 1");
    src_rows = src_rows > kMaxBufferElements / shape[i] ? kMaxBufferElements : src_rows * shape[i];
  }
  if (c < 1 || c % kBlock != 0 || (!gather && r % kBlock != 0)) {
    return Problem("w", w, gather ? "its last dimension a positive multiple of 32"
                                  : "its last two dimensions positive multiples of 32");
  }
  std::vector<int64_t> values_shape = shape;
  int64_t rows = src_rows;
  if (gather) {
    if (map->dtype != XLA_FFI_DataType_S32 || map->rank < 1) return Problem("row_map", *map, "int32 of rank >= 1");
    rows = ElementCount(*map);
    if (rows < 1 || rows % kBlock != 0) return Problem("row_map", *map, "a positive multiple of 32 entries");
    values_shape.assign(map->dims, map->dims + map->rank);
    values_shape.push_back(c);
  }
  const int64_t most_rows = rows > src_rows ? rows : src_rows;
  if (most_rows >= kMaxBufferElements || c >= kMaxBufferElements ||
      most_rows > (kMaxBufferElements - 1) / (c / kBlock) ||
      (rows / kBlock) > (kMaxBufferElements - 1) / CeilDiv(c, kTileCols)) {
    return Problem(gather ? "row_map" : "w", gather ? *map : w,
                   "rows (w's leading dimensions' product, and the map's entries) and columns below 2**31, and "
                   "fewer than 2**31 scales");
  }
  if (values.dtype != XLA_FFI_DataType_BF16 || !HasShape(values, values_shape)) {
    return Problem("values", values, "bfloat16 " + ShapeString(values_shape.data(), values_shape.size()));
  }
  if (schedule == QuantizePairSchedule::kGatherValues) {
    if (codes.dtype != XLA_FFI_DataType_BF16 || !HasShape(codes, shape)) {
      return Problem("codes", codes, "bfloat16 " + ShapeString(shape.data(), shape.size()));
    }
  } else if ((codes.dtype != XLA_FFI_DataType_F8E4M3FN && codes.dtype != XLA_FFI_DataType_F8E5M2) ||
             !HasShape(codes, shape)) {
    return Problem("codes", codes, "float8_e4m3fn or float8_e5m2 " + ShapeString(shape.data(), shape.size()));
  }
  std::vector<int64_t> scale_shape = shape;
  scale_shape.back() /= kBlock;
  if (scales.dtype != XLA_FFI_DataType_U8 || !HasShape(scales, scale_shape)) {
    return Problem("scales", scales, "uint8 " + ShapeString(scale_shape.data(), scale_shape.size()));
  }
  const char* names[5] = {"w", "row_map", "values", "codes", "scales"};
  for (int i = 0; i < (gather ? 5 : 4); ++i) {
    const auto address = reinterpret_cast<uintptr_t>(buffers[i].data);
    const char* name = names[gather || i == 0 ? i : i + 1];
    if (address == 0 || address % kAlignment != 0) return Problem(name, buffers[i], "a 16-byte aligned buffer");
  }
  *dims = QuantizePairDims{static_cast<int32_t>(rows), static_cast<int32_t>(c), static_cast<int32_t>(src_rows)};
  return "";
}

namespace {

ffi::Error Execute(CUstream stream, int32_t device, KernelObjects* state, ffi::AnyBuffer w,
                   std::optional<ffi::AnyBuffer> row_map, ffi::Result<ffi::AnyBuffer> values,
                   ffi::Result<ffi::AnyBuffer> codes, ffi::Result<ffi::AnyBuffer> scales, std::string_view,
                   std::string_view, ffi::Span<const uint8_t>, ffi::Span<const int64_t>, int64_t schedule_attr) {
  const std::string target = kQuantizePairTarget;
  DslFunction* fn = nullptr;
  if (ffi::Error e = DeviceFunction(*state, device, kQuantizePairTarget, &fn); e.failure()) return e;
  if (schedule_attr < 0 || schedule_attr > 2) {
    return ffi::Error::InvalidArgument(target + ": schedule must be 0 (plain), 1 (gather) or 2 (gather_values)");
  }
  const auto schedule = static_cast<QuantizePairSchedule>(schedule_attr);
  const bool gather = schedule != QuantizePairSchedule::kPlain;
  if (gather != row_map.has_value()) {
    return ffi::Error::InvalidArgument(target + (gather ? ": the gather schedules need a row map"
                                                        : ": the plain schedule takes no row map"));
  }
  BufferDesc buffers[5];
  size_t n = 0;
  buffers[n++] = ToBufferDesc(w);
  if (gather) buffers[n++] = ToBufferDesc(*row_map);
  buffers[n++] = ToBufferDesc(*values);
  buffers[n++] = ToBufferDesc(*codes);
  buffers[n++] = ToBufferDesc(*scales);
  QuantizePairDims dims;
  if (std::string message = CheckQuantizePairBuffers(buffers, schedule, &dims); !message.empty()) {
    return ffi::Error::InvalidArgument(message);
  }
  std::string error;
  const CudaDriver* driver = GetCudaDriver(&error);
  if (driver == nullptr) return ffi::Error::Internal(target + ": " + error);
  ScopedStreamContext context(*driver, stream);
  // the counts exactly (ElementCount saturates at 2**31): w, codes and the scales have src_rows rows, values and the
  // map rows
  const int64_t src = int64_t{dims.src_rows} * dims.cols, padded = int64_t{dims.rows} * dims.cols;
  const BufferDesc* out = buffers + (gather ? 2 : 1);
  const int64_t out_counts[3] = {padded, src, src / kBlock};
  if (state->poison_outputs) {  // test aid: 0xFF bytes are NaN in bf16 values and FP8 codes, so a missed one fails
    const char* names[3] = {"values", "codes", "scales"};
    for (int i = 0; i < 3; ++i) {
      const size_t bytes = static_cast<size_t>(out_counts[i]) * ElementBytes(out[i].dtype);
      if (ffi::Error e = PoisonBytes(target, names[i], *driver, stream, out[i].data, bytes); e.failure()) return e;
    }
  }
  // kernel order: w, row_map (w again for the plain schedule, which reads none), values, codes, scales
  KernelTensor tensors[5] = {
      KernelTensor{const_cast<void*>(buffers[0].data), src},
      gather ? KernelTensor{const_cast<void*>(buffers[1].data), int64_t{dims.rows}}
             : KernelTensor{const_cast<void*>(buffers[0].data), 0},
      KernelTensor{const_cast<void*>(out[0].data), out_counts[0]},
      KernelTensor{const_cast<void*>(out[1].data), out_counts[1]},
      KernelTensor{const_cast<void*>(out[2].data), out_counts[2]}};
  int32_t rows = dims.rows, cols = dims.cols, src_rows = dims.src_rows, ret = 0;
  void* args[10] = {&tensors[0], &tensors[1], &tensors[2], &tensors[3], &tensors[4],
                    &rows,       &cols,       &src_rows,   &stream,     &ret};
  return RunKernel(*state, device, kQuantizePairTarget, *driver, fn, args, 10, &ret);
}

ffi::ErrorOr<std::unique_ptr<KernelObjects>> Instantiate(std::string_view archs, std::string_view prefixes,
                                                        ffi::Span<const uint8_t> objects,
                                                        ffi::Span<const int64_t> offsets, int64_t) {
  return InstantiateKernelObjects(kQuantizePairTarget, archs, prefixes, objects, offsets);
}

}  // namespace
}  // namespace jbg

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbgQuantizePairInstantiate, jbg::Instantiate,
                              jbg::BindObjectTable(xla::ffi::Ffi::BindInstantiate())
                                  .Attr<int64_t>("schedule"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbgQuantizePairExecute, jbg::Execute,
                              jbg::BindObjectTable(xla::ffi::Ffi::BindExecute()
                                  .Ctx<xla::ffi::PlatformStream<jbg::CUstream>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<xla::ffi::State<jbg::KernelObjects>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // w
                                  .OptionalArg<xla::ffi::AnyBuffer>()  // row_map (the gather schedules)
                                  .Ret<xla::ffi::AnyBuffer>()  // values
                                  .Ret<xla::ffi::AnyBuffer>()  // codes
                                  .Ret<xla::ffi::AnyBuffer>())  // scales
                                  .Attr<int64_t>("schedule"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
