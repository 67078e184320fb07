#include "weight_stream.h"

#include <initializer_list>
#include <memory>
#include <utility>

#include "cuda_driver.h"

namespace jbg {
namespace ffi = xla::ffi;

namespace {

constexpr const char* kNames[6] = {"x", "w", "sw", "c", "amax", "alpha"};

std::string Describe(const BufferDesc& b, int index) {
  return std::string(kWeightStreamTarget) + ": " + kNames[index] + " is " + DtypeName(b.dtype) + " " +
         ShapeString(b.dims, b.rank);
}

}  // namespace

std::string ParseWeightStreamAttributes(std::string_view w_dtype, std::string_view c_dtype,
                                        std::string_view sf_dtype, int64_t sf_vec_size, int64_t max_m,
                                        int64_t amax_batches, KernelDtypes* out) {
  const std::string where = std::string(kWeightStreamTarget) + " attributes: ";
  KernelDtypes k{};
  k.alpha = true;
  if (!ParseCodeDtype(w_dtype, &k)) {
    return where + "w_dtype \"" + std::string(w_dtype) +
           "\" is not supported; expected float8_e4m3fn, float8_e5m2 or float4_e2m1fn";
  }
  if (c_dtype == "float32") {
    k.c = XLA_FFI_DataType_F32;
  } else if (c_dtype == "bfloat16") {
    k.c = XLA_FFI_DataType_BF16;
  } else if (c_dtype == "float16") {
    k.c = XLA_FFI_DataType_F16;
  } else {
    return where + "c_dtype \"" + std::string(c_dtype) + "\" is not supported; expected float32, bfloat16 or float16";
  }
  if (!ParseBlockScales(sf_dtype, sf_vec_size, &k)) {
    return where + "sf_dtype \"" + std::string(sf_dtype) + "\" with sf_vec_size " + std::to_string(sf_vec_size) +
           " is not supported for w_dtype " + std::string(w_dtype) +
           "; expected float8_e8m0fnu with 32, or (float4_e2m1fn weights only) float8_e4m3fn with 16";
  }
  if (max_m < 1 || max_m >= kMaxBufferElements) {
    return where + "max_m " + std::to_string(max_m) + " is not supported; expected the objects' row capacity, >= 1";
  }
  if (std::string why = CheckAmaxBatches(kWeightStreamTarget, amax_batches); !why.empty()) return why;
  *out = k;
  return "";
}

std::string CheckWeightStreamBuffers(const BufferDesc (&buf)[6], const KernelDtypes& kernel, int64_t max_m,
                                     WeightStreamDims* dims) {
  const BufferDesc &x = buf[0], &w = buf[1], &sw = buf[2], &c = buf[3];
  if (x.dtype != XLA_FFI_DataType_BF16) return Describe(x, 0) + "; expected bfloat16 activations";
  if (x.rank != 3) return Describe(x, 0) + "; expected rank 3 (L, M, K)";
  const int64_t l = x.dims[0], m = x.dims[1], k = x.dims[2];
  if (l < 1 || m < 1 || k < 1) return Describe(x, 0) + "; expected every dimension >= 1";
  if (m > max_m) {
    return Describe(x, 0) + "; expected M <= " + std::to_string(max_m) +
           ": these kernel objects take at most that many rows (the variant's capacity)";
  }
  if (kernel.ab_fp4 && k % 32 != 0) {
    return Describe(x, 0) + "; expected K a multiple of 32 (16-byte rows of packed FP4 weight codes)";
  }
  if (k % 16 != 0) return Describe(x, 0) + "; expected K a multiple of 16 (16-byte rows of FP8 weight codes)";
  if (w.dtype != kernel.ab) {
    return Describe(w, 1) + "; the kernel objects were compiled for " + CodeName(kernel);
  }
  const int64_t row = kernel.ab_fp4 ? k / 2 : k;
  const int64_t n = w.rank == 3 ? w.dims[1] : 0;
  if (w.rank != 3 || w.dims[0] != l || w.dims[2] != row || n < 1) {
    return Describe(w, 1) + "; expected (L, N, " + (kernel.ab_fp4 ? "K/2" : "K") + ") = (" + std::to_string(l) +
           ", N >= 1, " + std::to_string(row) + ") for x's L and K";
  }
  if (sw.dtype != kernel.sf) {
    return Describe(sw, 2) + (kernel.sf == XLA_FFI_DataType_U8 ? "; expected uint8 E8M0 scale bytes"
                                                                : "; expected float8_e4m3fn scales (NVFP4)");
  }
  const int64_t blocks = CeilDiv(k, kernel.sf_vec_size);
  const int64_t compact_dims[3] = {l, n, blocks};
  const int64_t atom_dims[6] = {l, CeilDiv(n, kAtomRows), CeilDiv(blocks, kAtomBlocks), 32, 4, 4};
  int32_t sf_atom = 0;
  if (sw.rank == 3) {
    if (!HasShape(sw, {l, n, blocks})) {
      return Describe(sw, 2) + "; expected the compact form " + ShapeString(compact_dims, 3) + " (L, N, ceil(K/" +
             std::to_string(kernel.sf_vec_size) + "))";
    }
  } else if (sw.rank == 6) {
    if (!HasShape(sw, {atom_dims[0], atom_dims[1], atom_dims[2], 32, 4, 4})) {
      return Describe(sw, 2) + "; expected the 128x4 atom form " + ShapeString(atom_dims, 6) +
             " (L, ceil(N/128), ceil(ceil(K/" + std::to_string(kernel.sf_vec_size) + ")/4), 32, 4, 4)";
    }
    sf_atom = 1;
  } else {
    return Describe(sw, 2) + "; expected rank 3, the compact form " + ShapeString(compact_dims, 3) +
           ", or rank 6, the 128x4 atom form " + ShapeString(atom_dims, 6);
  }
  if (c.dtype != kernel.c) {
    return Describe(c, 3) + "; the kernel objects were compiled for a " + DtypeName(kernel.c) + " C";
  }
  if (!HasShape(c, {l, m, n})) return Describe(c, 3) + "; expected " + ShapeString({l, m, n}) + " (L, M, N)";
  for (int i : {4, 5}) {
    if (buf[i].dtype != XLA_FFI_DataType_F32 || !HasShape(buf[i], {l})) {
      return Describe(buf[i], i) + "; expected float32 " + ShapeString({l}) + " (L,)";
    }
  }
  for (int i = 0; i < 6; ++i) {
    if (ElementCount(buf[i]) >= kMaxBufferElements) return Describe(buf[i], i) + "; expected fewer than 2**31 elements";
    const auto address = reinterpret_cast<uintptr_t>(buf[i].data);
    if (address == 0 || address % kAlignment != 0) {
      return Describe(buf[i], i) + " at address " + std::to_string(address) + "; expected a 16-byte aligned pointer";
    }
  }
  *dims = WeightStreamDims{static_cast<int32_t>(m), static_cast<int32_t>(n), static_cast<int32_t>(k),
                           static_cast<int32_t>(l), sf_atom};
  return "";
}

namespace {

using StateOr = ffi::ErrorOr<std::unique_ptr<KernelObjects>>;

// Bytes per element of the C dtypes the objects write.
StateOr Instantiate(std::string_view archs, std::string_view prefixes, ffi::Span<const uint8_t> objects,
                    ffi::Span<const int64_t> offsets, std::string_view w_dtype, std::string_view c_dtype,
                    std::string_view sf_dtype, int64_t sf_vec_size, int64_t max_m, int64_t amax_batches) {
  KernelDtypes dtypes{};
  if (std::string why =
          ParseWeightStreamAttributes(w_dtype, c_dtype, sf_dtype, sf_vec_size, max_m, amax_batches, &dtypes);
      !why.empty()) {
    return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(why));
  }
  StateOr state = InstantiateKernelObjects(kWeightStreamTarget, archs, prefixes, objects, offsets);
  if (!state.has_value()) return state;
  (*state)->dtypes = dtypes;
  // amax's tally: per batch two int32 words (the CTAs' running max and their count), zero between launches; none
  // where the caller drops amax
  if (amax_batches > 0) {
    if (ffi::Error e = AllocateTallies(state->get(), kWeightStreamTarget, static_cast<size_t>(amax_batches) * 8);
        e.failure()) {
      return ffi::Unexpected<ffi::Error>(std::move(e));
    }
  }
  return state;
}

// The state holds what instantiation parsed; max_m, which it checked, is read again from the call's attributes.
ffi::Error Execute(CUstream stream, int32_t device, KernelObjects* state, ffi::AnyBuffer x, ffi::AnyBuffer w,
                   ffi::AnyBuffer sw, ffi::AnyBuffer alpha, ffi::Result<ffi::AnyBuffer> c,
                   ffi::Result<ffi::AnyBuffer> amax, std::string_view, std::string_view, ffi::Span<const uint8_t>,
                   ffi::Span<const int64_t>, std::string_view, std::string_view, std::string_view, int64_t,
                   int64_t max_m, int64_t) {
  DslFunction* fn = nullptr;
  if (ffi::Error e = DeviceFunction(*state, device, kWeightStreamTarget, &fn); e.failure()) return e;
  const BufferDesc buffers[6] = {ToBufferDesc(x),  ToBufferDesc(w),     ToBufferDesc(sw),
                                 ToBufferDesc(*c), ToBufferDesc(*amax), ToBufferDesc(alpha)};
  WeightStreamDims dims;
  if (std::string message = CheckWeightStreamBuffers(buffers, state->dtypes, max_m, &dims); !message.empty()) {
    return ffi::Error::InvalidArgument(message);
  }
  std::string error;
  const CudaDriver* driver = GetCudaDriver(&error);  // loaded at instantiation; a pointer read here
  if (driver == nullptr) return ffi::Error::Internal(std::string(kWeightStreamTarget) + ": " + error);
  // amax needs no zeroing: the kernel folds |C| through the call site's tally (zero at every launch) and its
  // last CTA per batch writes amax whole, so one kernel is all a call puts on XLA's stream. Without a tally (the
  // caller drops amax) the kernel skips amax and leaves it unwritten.
  ScopedStreamContext context(*driver, stream);
  void* tally = nullptr;
  const size_t c_bytes = static_cast<size_t>(ElementCount(buffers[3])) * ElementBytes(buffers[3].dtype);
  if (ffi::Error e = PrepareOutputs(*state, device, kWeightStreamTarget, *driver, stream,
                                    state->tally_bytes > 0 ? AmaxBy::kTally : AmaxBy::kNothing, c->untyped_data(),
                                    c_bytes, amax->untyped_data(), static_cast<size_t>(dims.l), &tally);
      e.failure()) {
    return e;
  }
  KernelTensor tensors[7];
  for (int i = 0; i < 6; ++i) tensors[i] = KernelTensor{const_cast<void*>(buffers[i].data), ElementCount(buffers[i])};
  tensors[6] = KernelTensor{tally, tally == nullptr ? 0 : int64_t{dims.l}};
  int32_t m = dims.m, n = dims.n, k = dims.k, l = dims.l, sf_atom = dims.sf_atom, ret = 0;
  // fn(x, w, sw, c, amax, alpha, tally, m, n, k, l, sf_atom, stream) and the kernel's status slot.
  void* args[14] = {&tensors[0], &tensors[1], &tensors[2], &tensors[3], &tensors[4], &tensors[5], &tensors[6],
                    &m,          &n,          &k,          &l,          &sf_atom,    &stream,     &ret};
  return RunKernel(*state, device, kWeightStreamTarget, *driver, fn, args, 14, &ret);
}

}  // namespace
}  // namespace jbg

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbgWeightStreamInstantiate, jbg::Instantiate,
                              jbg::BindObjectTable(xla::ffi::Ffi::BindInstantiate())
                                  .Attr<std::string_view>("w_dtype")
                                  .Attr<std::string_view>("c_dtype")
                                  .Attr<std::string_view>("sf_dtype")
                                  .Attr<int64_t>("sf_vec_size")
                                  .Attr<int64_t>("max_m")
                                  .Attr<int64_t>("amax_batches"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbgWeightStreamExecute, jbg::Execute,
                              jbg::BindObjectTable(xla::ffi::Ffi::BindExecute()
                                  .Ctx<xla::ffi::PlatformStream<jbg::CUstream>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<xla::ffi::State<jbg::KernelObjects>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // x
                                  .Arg<xla::ffi::AnyBuffer>()   // w
                                  .Arg<xla::ffi::AnyBuffer>()   // sw
                                  .Arg<xla::ffi::AnyBuffer>()   // alpha
                                  .Ret<xla::ffi::AnyBuffer>()   // c
                                  .Ret<xla::ffi::AnyBuffer>())  // amax
                                  .Attr<std::string_view>("w_dtype")
                                  .Attr<std::string_view>("c_dtype")
                                  .Attr<std::string_view>("sf_dtype")
                                  .Attr<int64_t>("sf_vec_size")
                                  .Attr<int64_t>("max_m")
                                  .Attr<int64_t>("amax_batches"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
