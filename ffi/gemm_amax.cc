#include "gemm_amax.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <optional>
#include <utility>

#include "cuda_driver.h"

namespace jbg {
namespace ffi = xla::ffi;

namespace {

constexpr const char* kBufferNames[7] = {"a", "b", "sfa", "sfb", "c", "amax", "alpha"};
constexpr int64_t kMaxElements = kMaxBufferElements;

std::string Describe(const BufferDesc& b, int index) {
  return std::string("jbg_gemm_amax: ") + kBufferNames[index] + " is " + DtypeName(b.dtype) + " " +
         ShapeString(b.dims, b.rank);
}

// Checks that buffer `index` has exactly `want` dims ("" when it does).
std::string ExpectShape(const BufferDesc& b, int index, std::initializer_list<int64_t> want, const char* what) {
  if (HasShape(b, want)) return "";
  return Describe(b, index) + "; expected " + ShapeString(want) + " " + what;
}

}  // namespace

std::string ParseKernelDtypes(std::string_view ab_dtype, std::string_view c_dtype, std::string_view sf_dtype,
                              int64_t sf_vec_size, std::string_view a_major, std::string_view b_major,
                              KernelDtypes* out) {
  const std::string where = "jbg_gemm_amax attributes: ";
  const std::string ab(ab_dtype), c(c_dtype), sf(sf_dtype);
  KernelDtypes k{};
  if (a_major != "k" && a_major != "m") {
    return where + "a_major \"" + std::string(a_major) + "\" is not supported; expected k or m";
  }
  if (b_major != "k" && b_major != "n") {
    return where + "b_major \"" + std::string(b_major) + "\" is not supported; expected k or n";
  }
  k.a_mn = a_major == "m";
  k.b_mn = b_major == "n";
  if (!ParseCodeDtype(ab, &k)) {
    return where + "ab_dtype \"" + ab + "\" is not supported; expected float8_e4m3fn, float8_e5m2 or float4_e2m1fn";
  }
  if (!ParseCDtype(c, &k)) {
    return where + "c_dtype \"" + c + "\" is not supported; expected float32, bfloat16, float16, float8_e4m3fn, "
           "float8_e5m2 or float4_e2m1fn";
  }
  if (sf == "float8_e8m0fnu") {
    k.sf = XLA_FFI_DataType_U8;
  } else if (sf == "float8_e4m3fn") {
    k.sf = XLA_FFI_DataType_F8E4M3FN;
    k.alpha = true;  // NVFP4: the kernels take the per-tensor alpha
  } else {
    return where + "sf_dtype \"" + sf + "\" is not supported; expected float8_e8m0fnu or float8_e4m3fn";
  }
  if (sf_vec_size != 16 && sf_vec_size != 32) {
    return where + "sf_vec_size " + std::to_string(sf_vec_size) + " is not supported; expected 16 or 32";
  }
  k.sf_vec_size = static_cast<int>(sf_vec_size);
  // The seed's couplings: FP8 codes take E8M0 per 32; E4M3 scales take FP4 codes per 16.
  if (!k.ab_fp4 && (k.sf != XLA_FFI_DataType_U8 || sf_vec_size != 32)) {
    return where + "ab_dtype " + ab + " takes sf_dtype float8_e8m0fnu with sf_vec_size 32; got " + sf + " with " +
           std::to_string(sf_vec_size);
  }
  if (k.ab_fp4 && (k.a_mn || k.b_mn)) {
    return where + "ab_dtype float4_e2m1fn takes K-major operands (a_major k, b_major k); got a_major " +
           std::string(a_major) + ", b_major " + std::string(b_major);
  }
  if (k.alpha && (!k.ab_fp4 || sf_vec_size != 16)) {
    return where + "sf_dtype float8_e4m3fn (NVFP4) takes ab_dtype float4_e2m1fn with sf_vec_size 16; got " + ab +
           " with " + std::to_string(sf_vec_size);
  }
  *out = k;
  return "";
}

std::string CheckGemmAmaxBuffers(const BufferDesc* buf, size_t count, KernelDtypes kernel, GemmDims* dims,
                                 bool c_rows_16_bytes) {
  if (count != 6 && count != 7) {
    return "jbg_gemm_amax: " + std::to_string(count) + " buffers; expected a, b, sfa, sfb, c, amax and, for NVFP4 "
           "kernels, alpha";
  }
  const BufferDesc &a = buf[0], &b = buf[1], &c = buf[4], &amax = buf[5];
  const char* codes = kernel.ab_fp4 ? "float4_e2m1fn operands (uint8 pairs)" : "operands";
  if (a.dtype != XLA_FFI_DataType_F8E4M3FN && a.dtype != XLA_FFI_DataType_F8E5M2 && a.dtype != XLA_FFI_DataType_U8) {
    return Describe(a, 0) + "; expected float8_e4m3fn or float8_e5m2 codes, or uint8 (packed FP4 pairs)";
  }
  if (a.dtype != kernel.ab) {
    return Describe(a, 0) + "; the kernel objects were compiled for " +
           (kernel.ab_fp4 ? std::string("float4_e2m1fn operands (uint8 pairs)")
                          : std::string(DtypeName(kernel.ab)) + " " + codes);
  }
  if (b.dtype != a.dtype) return Describe(b, 1) + "; expected the dtype of a (" + DtypeName(a.dtype) + ")";
  for (int i : {2, 3}) {
    if (buf[i].dtype != kernel.sf) {
      return Describe(buf[i], i) + (kernel.sf == XLA_FFI_DataType_U8 ? "; expected uint8 E8M0 scale bytes"
                                                                      : "; expected float8_e4m3fn scales (NVFP4)");
    }
  }
  if (c.dtype != XLA_FFI_DataType_F32 && c.dtype != XLA_FFI_DataType_BF16 && c.dtype != XLA_FFI_DataType_F16 &&
      c.dtype != XLA_FFI_DataType_F8E4M3FN && c.dtype != XLA_FFI_DataType_F8E5M2 && c.dtype != XLA_FFI_DataType_U8) {
    return Describe(c, 4) + "; expected float32, bfloat16, float16, float8_e4m3fn, float8_e5m2 or uint8 (packed FP4)";
  }
  if (c.dtype != kernel.c) {  // a float32 kernel writing a bfloat16 C would run past the end of the buffer
    return Describe(c, 4) + "; the kernel objects were compiled for a " +
           (kernel.c_fp4 ? std::string("float4_e2m1fn C (uint8 pairs)") : std::string(DtypeName(kernel.c)) + " C");
  }
  if (amax.dtype != XLA_FFI_DataType_F32) return Describe(amax, 5) + "; expected float32";
  if (a.rank != 3) return Describe(a, 0) + "; expected rank 3 (L, M, K)";
  const int64_t per_byte = kernel.ab_fp4 ? 2 : 1;  // codes per element of a and b
  // K-major: a (L, M, K) (packed FP4: K/2 bytes per row); M-major (a_major "m"): a (L, K, M), M a multiple of 16.
  const int64_t l = a.dims[0], m = a.dims[kernel.a_mn ? 2 : 1], row = a.dims[kernel.a_mn ? 1 : 2];
  if (l < 1 || m < 1 || row < 1) return Describe(a, 0) + "; expected every dimension >= 1";
  if (row % 16 != 0) {
    return Describe(a, 0) + (kernel.ab_fp4 ? "; expected (L, M, K/2) with K/2 a multiple of 16 (16-byte rows)"
                                           : "; expected K a multiple of 16 (16-byte rows)");
  }
  if (kernel.a_mn && m % 16 != 0) {
    return Describe(a, 0) + "; expected (L, K, M) with M a multiple of 16 (16-byte rows of an M-major A)";
  }
  const int64_t k = row * per_byte;
  const int64_t n = b.rank == 3 ? b.dims[kernel.b_mn ? 2 : 1] : 0;
  const int64_t b_row = b.rank == 3 ? b.dims[kernel.b_mn ? 1 : 2] : 0;
  if (b.rank != 3 || b.dims[0] != l || b_row != row || n < 1 || (kernel.b_mn && n % 16 != 0)) {
    if (kernel.b_mn) {
      return Describe(b, 1) + "; expected (L, K, N) = (" + std::to_string(l) + ", " + std::to_string(row) +
             ", N >= 1) with N a multiple of 16 (16-byte rows of an N-major B)";
    }
    return Describe(b, 1) + "; expected (L, N, " + (kernel.ab_fp4 ? "K/2" : "K") + ") = (" + std::to_string(l) +
           ", N >= 1, " + std::to_string(row) + ")";
  }
  const int64_t k_atoms = CeilDiv(CeilDiv(k, kernel.sf_vec_size), kAtomBlocks);
  const std::string atom = "(L, ceil(MN/128), ceil(ceil(K/" + std::to_string(kernel.sf_vec_size) +
                           ")/4), 32, 4, 4): the 128x4 scale atom";
  std::string e;
  if (!(e = ExpectShape(buf[2], 2, {l, CeilDiv(m, kAtomRows), k_atoms, 32, 4, 4}, atom.c_str())).empty()) return e;
  if (!(e = ExpectShape(buf[3], 3, {l, CeilDiv(n, kAtomRows), k_atoms, 32, 4, 4}, atom.c_str())).empty()) return e;
  if (kernel.c_fp4) {
    if (n % 2 != 0) return Describe(b, 1) + "; expected N even for a packed FP4 C (two codes per byte)";
    if (!(e = ExpectShape(c, 4, {l, m, n / 2}, "(L, M, N/2): packed FP4 pairs")).empty()) return e;
  } else if (!(e = ExpectShape(c, 4, {l, m, n}, "(L, M, N)")).empty()) {
    return e;
  }
  // c has rank 3 here; its last dimension counts bytes of pairs for a packed FP4 C.
  const int64_t c_bytes = static_cast<int64_t>(ElementBytes(c.dtype));
  if (c_rows_16_bytes && c.dims[2] * c_bytes % 16 != 0) {
    return Describe(c, 4) + "; expected rows of a multiple of 16 bytes (N a multiple of " +
           std::to_string(16 / c_bytes * (kernel.c_fp4 ? 2 : 1)) + "): this GPU's kernel stores C by TMA";
  }
  if (!(e = ExpectShape(amax, 5, {l}, "(L,)")).empty()) return e;
  if (kernel.alpha && count != 7) {
    return "jbg_gemm_amax: alpha is missing; the kernel objects (NVFP4, E4M3 scales) take alpha, (L,) float32, "
           "after sfb";
  }
  if (!kernel.alpha && count == 7) {
    return Describe(buf[6], 6) + "; the kernel objects take no alpha (only NVFP4's, with E4M3 scales, do)";
  }
  if (count == 7) {
    if (buf[6].dtype != XLA_FFI_DataType_F32) return Describe(buf[6], 6) + "; expected float32";
    if (!(e = ExpectShape(buf[6], 6, {l}, "(L,)")).empty()) return e;
  }
  for (size_t i = 0; i < count; ++i) {
    const int index = static_cast<int>(i);
    if (ElementCount(buf[i]) >= kMaxElements) return Describe(buf[i], index) + "; expected fewer than 2**31 elements";
    // The kernels index C in elements of the logical (L, M, N) even when it is packed.
    if (i == 4 && kernel.c_fp4 && l * m >= kMaxElements / std::max<int64_t>(n, 1)) {
      return Describe(buf[i], index) + "; expected fewer than 2**31 elements in (L, M, N)";
    }
    const auto address = reinterpret_cast<uintptr_t>(buf[i].data);
    if (address == 0 || address % kAlignment != 0) {
      return Describe(buf[i], index) + " at address " + std::to_string(address) +
             "; expected a 16-byte aligned pointer";
    }
  }
  if (k >= kMaxElements) return Describe(a, 0) + "; expected K below 2**31";
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
                    ffi::Span<const int64_t> offsets, std::string_view ab_dtype, std::string_view c_dtype,
                    std::string_view sf_dtype, int64_t sf_vec_size, std::string_view a_major,
                    std::string_view b_major, ffi::Span<const int64_t> cluster_ctas) {
  KernelDtypes dtypes{};
  if (std::string why = ParseKernelDtypes(ab_dtype, c_dtype, sf_dtype, sf_vec_size, a_major, b_major, &dtypes);
      !why.empty()) {
    return Fail(ffi::Error::InvalidArgument(why));
  }
  StateOr state = InstantiateKernelObjects(kGemmAmaxTarget, archs, prefixes, objects, offsets,
                                           std::vector<int64_t>(cluster_ctas.begin(), cluster_ctas.end()));
  if (state.has_value()) (*state)->dtypes = dtypes;
  return state;
}

ffi::Error Execute(CUstream stream, int32_t device, KernelObjects* state, ffi::AnyBuffer a, ffi::AnyBuffer b,
                   ffi::AnyBuffer sfa, ffi::AnyBuffer sfb, std::optional<ffi::AnyBuffer> alpha,
                   ffi::Result<ffi::AnyBuffer> c, ffi::Result<ffi::AnyBuffer> amax) {
  DslFunction* fn = nullptr;
  if (ffi::Error e = DeviceFunction(*state, device, kGemmAmaxTarget, &fn); e.failure()) return e;
  BufferDesc buffers[7] = {ToBufferDesc(a),  ToBufferDesc(b),     ToBufferDesc(sfa), ToBufferDesc(sfb),
                           ToBufferDesc(*c), ToBufferDesc(*amax), {}};
  const size_t count = alpha.has_value() ? 7 : 6;
  if (alpha.has_value()) buffers[6] = ToBufferDesc(*alpha);
  GemmDims dims;
  // A kernel that takes its grid size (sm_100a) stores C by TMA: C's rows must start 16-byte aligned.
  const int32_t grid_ctas = state->grid_ctas[device];
  if (std::string message = CheckGemmAmaxBuffers(buffers, count, state->dtypes, &dims, grid_ctas > 0);
      !message.empty()) {
    return ffi::Error::InvalidArgument(message);
  }
  std::string error;
  const CudaDriver* driver = GetCudaDriver(&error);  // loaded at instantiation; a pointer read here
  if (driver == nullptr) return ffi::Error::Internal("jbg_gemm_amax: " + error);
  ScopedStreamContext context(*driver, stream);
  // amax is an atomic max over |C| bit patterns: it starts from +0.0, on XLA's stream, before the kernel. With the
  // poison test aid, C's whole bytes as the buffer holds them (packed FP4: N/2 per row) are filled first.
  const size_t c_bytes = static_cast<size_t>(ElementCount(buffers[4])) * ElementBytes(buffers[4].dtype);
  if (ffi::Error e = PrepareOutputs(*state, device, kGemmAmaxTarget, *driver, stream, AmaxBy::kAtomicMax,
                                    c->untyped_data(), c_bytes, amax->untyped_data(), static_cast<size_t>(dims.l));
      e.failure()) {
    return e;
  }
  KernelTensor tensors[7];
  for (size_t i = 0; i < count; ++i) {
    tensors[i] = KernelTensor{const_cast<void*>(buffers[i].data), ElementCount(buffers[i])};
  }
  int32_t m = dims.m, n = dims.n, k = dims.k, l = dims.l, max_ctas = grid_ctas, ret = 0;
  // fn(a, b, sfa, sfb, c, amax[, alpha], m, n, k, l[, max_ctas], stream) and the kernel's status slot.
  void* args[14] = {&tensors[0], &tensors[1], &tensors[2], &tensors[3], &tensors[4], &tensors[5]};
  size_t num_args = 6;
  if (count == 7) args[num_args++] = &tensors[6];
  for (void* scalar : {static_cast<void*>(&m), static_cast<void*>(&n), static_cast<void*>(&k),
                       static_cast<void*>(&l)}) {
    args[num_args++] = scalar;
  }
  if (grid_ctas > 0) args[num_args++] = &max_ctas;
  args[num_args++] = &stream;
  args[num_args++] = &ret;
  return RunKernel(*state, device, kGemmAmaxTarget, *driver, fn, args, num_args, &ret);
}

}  // namespace


}  // namespace jbg

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbgGemmAmaxInstantiate, jbg::Instantiate,
                              jbg::BindObjectTable(xla::ffi::Ffi::BindInstantiate())
                                  .Attr<std::string_view>("ab_dtype")
                                  .Attr<std::string_view>("c_dtype")
                                  .Attr<std::string_view>("sf_dtype")
                                  .Attr<int64_t>("sf_vec_size")
                                  .Attr<std::string_view>("a_major")
                                  .Attr<std::string_view>("b_major")
                                  .Attr<xla::ffi::Span<const int64_t>>("cluster_ctas"),
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
                                  .OptionalArg<xla::ffi::AnyBuffer>()  // alpha (NVFP4 kernels)
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
