#include "ragged.h"

#include <initializer_list>
#include <memory>

#include "cuda_driver.h"

namespace jbg {
namespace ffi = xla::ffi;

namespace {

constexpr const char* kNames[8] = {"a", "b", "sfa", "sfb", "items", "c", "amax", "alpha"};

std::string Describe(const BufferDesc& b, int index) {
  return std::string(kRaggedTarget) + ": " + kNames[index] + " is " + DtypeName(b.dtype) + " " +
         ShapeString(b.dims, b.rank);
}

// "" when buffer `index` holds fewer than 2**31 elements, else the message saying so.
std::string CheckCount(const BufferDesc& b, int index) {
  return ElementCount(b) < kMaxBufferElements ? "" : Describe(b, index) + "; expected fewer than 2**31 elements";
}

// "" when the scales fit the operands, for K along the scale blocks of `kernel` (one with scales: sf_vec_size > 0):
// sfa and sfb in SPEC §3's atom over A's L batches of T rows and over B's L·G batches (batch l·G + g) of N rows; for
// the swap_ab objects (bfloat16 tokens) no sfa and sfb compact, (L·G, N, ceil(K/block)), or in that atom, which
// `*sfb_atom` then says. Else the message saying so.
std::string CheckScales(const BufferDesc (&buf)[8], const KernelDtypes& kernel, int64_t l, int64_t t, int64_t n,
                        int64_t k, int64_t g, bool* sfb_atom) {
  const int64_t k_blocks = CeilDiv(k, kernel.sf_vec_size);
  const int64_t k_atoms = CeilDiv(k_blocks, kAtomBlocks);
  const std::string blocks = "ceil(ceil(K/" + std::to_string(kernel.sf_vec_size) + ")/4), 32, 4, 4)";
  const int64_t sfb_dims[6] = {l * g, CeilDiv(n, kAtomRows), k_atoms, 32, 4, 4};
  const bool atom = HasShape(buf[3], {sfb_dims[0], sfb_dims[1], k_atoms, 32, 4, 4});
  *sfb_atom = atom;
  if (kernel.a_bf16) {
    if (!atom && !HasShape(buf[3], {l * g, n, k_blocks})) {
      return Describe(buf[3], 3) + "; expected " + ShapeString({l * g, n, k_blocks}) + " (L*G, N, ceil(K/" +
             std::to_string(kernel.sf_vec_size) + ")), b's L*G weights' scales compact, or " +
             ShapeString(sfb_dims, 6) + " (L*G, ceil(N/128), " + blocks + ", their 128x4 scale atom";
    }
    return "";
  }
  const int64_t sfa_dims[6] = {l, CeilDiv(t, kAtomRows), k_atoms, 32, 4, 4};
  if (!HasShape(buf[2], {sfa_dims[0], sfa_dims[1], k_atoms, 32, 4, 4})) {
    return Describe(buf[2], 2) + "; expected " + ShapeString(sfa_dims, 6) + " (L, ceil(T/128), " + blocks +
           ": the 128x4 scale atom of a";
  }
  if (!atom) {
    return Describe(buf[3], 3) + "; expected " + ShapeString(sfb_dims, 6) + " (L*G, ceil(N/128), " + blocks +
           ": the 128x4 scale atom of b's L*G weights";
  }
  return "";
}

}  // namespace

std::string ParseRaggedAttributes(std::string_view ab_dtype, std::string_view a_dtype, std::string_view c_dtype,
                                  std::string_view sf_dtype, int64_t sf_vec_size, std::string_view b_major,
                                  KernelDtypes* out) {
  const std::string where = std::string(kRaggedTarget) + " attributes: ";
  KernelDtypes k{};
  k.alpha = true;
  if (ab_dtype == "bfloat16") {
    k.ab = XLA_FFI_DataType_BF16;
    k.ab_bf16 = true;
  } else if (!ParseCodeDtype(ab_dtype, &k)) {
    return where + "ab_dtype \"" + std::string(ab_dtype) +
           "\" is not supported; expected float8_e4m3fn, float8_e5m2, float4_e2m1fn or bfloat16";
  }
  if (k.ab_bf16 && c_dtype != "float32" && c_dtype != "bfloat16") {
    return where + "c_dtype \"" + std::string(c_dtype) +
           "\" is not supported for ab_dtype bfloat16; expected float32 or bfloat16";
  }
  if (!ParseCDtype(c_dtype, &k)) {
    return where + "c_dtype \"" + std::string(c_dtype) + "\" is not supported; expected float32, bfloat16, float16, "
           "float8_e4m3fn, float8_e5m2 or float4_e2m1fn";
  }
  if (k.ab_bf16) {
    if (sf_dtype != "none" || sf_vec_size != 0) {
      return where + "sf_dtype \"" + std::string(sf_dtype) + "\" with sf_vec_size " + std::to_string(sf_vec_size) +
             " is not supported for ab_dtype bfloat16; expected none with 0 (bfloat16 operands carry no scales)";
    }
    k.sf = XLA_FFI_DataType_U8;  // sfa and sfb: empty uint8 buffers
    k.sf_vec_size = 0;
  } else if (!ParseBlockScales(sf_dtype, sf_vec_size, &k)) {
    return where + "sf_dtype \"" + std::string(sf_dtype) + "\" with sf_vec_size " + std::to_string(sf_vec_size) +
           " is not supported for ab_dtype " + std::string(ab_dtype) +
           "; expected float8_e8m0fnu with 32, or (float4_e2m1fn codes only) float8_e4m3fn with 16" +
           (sf_dtype == "none" ? " (none with 0 is for bfloat16 operands only)" : "");
  }
  if (b_major != "k" && b_major != "n") {
    return where + "b_major \"" + std::string(b_major) + "\" is not supported; expected k or n";
  }
  if (b_major == "n" && !k.ab_bf16) {
    return where + "b_major \"n\" is not supported for ab_dtype " + std::string(ab_dtype) +
           "; expected k (only bfloat16 operands take an N-major b)";
  }
  k.b_mn = b_major == "n";
  if (a_dtype != ab_dtype) {
    // The swap_ab objects: MXFP8 E4M3, MXFP4 or NVFP4 weights (ParseBlockScales has paired the scales with the
    // codes), bfloat16 tokens, a float32 or bfloat16 C.
    const bool weights = ab_dtype == "float8_e4m3fn" || ab_dtype == "float4_e2m1fn";
    const bool scales = (k.sf_vec_size == 32) == (k.sf == XLA_FFI_DataType_U8);  // E8M0 per 32 or E4M3 per 16
    k.a_bf16 = a_dtype == "bfloat16" && weights && scales && !k.b_mn &&
               (c_dtype == "float32" || c_dtype == "bfloat16");
    if (!k.a_bf16) {
      return where + "a_dtype \"" + std::string(a_dtype) + "\" is not supported with ab_dtype \"" +
             std::string(ab_dtype) + "\", sf_dtype \"" + std::string(sf_dtype) + "\" and c_dtype \"" +
             std::string(c_dtype) + "\"; expected ab_dtype's, or bfloat16 tokens for float8_e4m3fn or float4_e2m1fn "
             "codes with float8_e8m0fnu scales per 32 (float4_e2m1fn also float8_e4m3fn per 16) and a float32 or "
             "bfloat16 C";
    }
  }
  *out = k;
  return "";
}

namespace {

// "" when the swap_ab objects' tokens a (checked as bfloat16 of rank 3) and sfa fit the codes' logical K: K >= 1 a
// multiple of 16 (16-byte rows of codes; packed FP4 (`fp4`) 32), a's rows K rounded up to kSwapAbKPad, sfa empty;
// else the message saying so.
std::string CheckSwapAbTokens(const BufferDesc (&buf)[8], int64_t k, bool fp4) {
  const int64_t row_codes = fp4 ? 32 : 16;
  if (k < 1 || k % row_codes != 0) {
    return Describe(buf[1], 1) + "; expected K >= 1, a multiple of " + std::to_string(row_codes) +
           (fp4 ? " (16-byte rows of packed FP4 codes)" : " (16-byte rows of codes)");
  }
  const int64_t padded = CeilDiv(k, kSwapAbKPad) * kSwapAbKPad;
  if (buf[0].dims[2] != padded) {
    return Describe(buf[0], 0) + "; expected K = " + std::to_string(padded) + ": b's K rounded up to " +
           std::to_string(kSwapAbKPad) + " (ragged.swap_ab_tokens)";
  }
  if (ElementCount(buf[2]) != 0 || buf[2].dtype != XLA_FFI_DataType_U8) {
    return Describe(buf[2], 2) + "; expected uint8 of zero elements (the swap_ab objects read no token scales)";
  }
  return "";
}

}  // namespace

std::string CheckRaggedBuffers(const BufferDesc (&buf)[8], const KernelDtypes& kernel, RaggedDims* dims) {
  const BufferDesc &a = buf[0], &b = buf[1], &items = buf[4], &c = buf[5];
  const char* k_name = kernel.ab_fp4 ? "K/2" : "K";  // the last dimension of a (and of a K-major b)
  std::string e;
  if (kernel.a_bf16 && a.dtype != XLA_FFI_DataType_BF16) {
    return Describe(a, 0) + "; the swap_ab objects take bfloat16 tokens";
  }
  if (!kernel.a_bf16 && a.dtype != kernel.ab) {
    return Describe(a, 0) + "; the kernel objects were compiled for " + CodeName(kernel);
  }
  if (a.rank != 3) {
    return Describe(a, 0) + "; expected rank 3 (L, T, " +
           (kernel.a_bf16 ? "K rounded up to " + std::to_string(kSwapAbKPad) : std::string(k_name)) + ")";
  }
  const int64_t l = a.dims[0], t = a.dims[1], row = a.dims[2];
  if (l < 1 || t < 1 || row < 1) return Describe(a, 0) + "; expected every dimension >= 1";
  if (!(e = CheckCount(a, 0)).empty()) return e;  // bounds L and K, which the products below take
  if (kernel.ab_bf16 && row % 8 != 0) return Describe(a, 0) + "; expected K a multiple of 8 (16-byte rows of bfloat16)";
  if (!kernel.ab_bf16 && !kernel.a_bf16 && row % 16 != 0) {
    return Describe(a, 0) + (kernel.ab_fp4 ? "; expected K a multiple of 32 (16-byte rows of packed FP4 codes)"
                                           : "; expected K a multiple of 16 (16-byte rows of FP8 codes)");
  }
  // The length of b's rows (K-major b): a's, but for the swap_ab objects, whose tokens' rows are b's K rounded up.
  const int64_t b_row = kernel.a_bf16 ? (b.rank == 4 ? b.dims[3] : 0) : row;
  const int64_t k = kernel.ab_fp4 ? 2 * b_row : b_row;
  if (b.dtype != kernel.ab) return Describe(b, 1) + "; the kernel objects were compiled for " + CodeName(kernel);
  // b is (L, G, N, K) or, N-major (bfloat16 only), (L, G, K, N): one weight per group and batch either way.
  const int n_axis = kernel.b_mn ? 3 : 2, k_axis = kernel.b_mn ? 2 : 3;
  const int64_t g = b.rank == 4 ? b.dims[1] : 0, n = b.rank == 4 ? b.dims[n_axis] : 0;
  if (b.rank != 4 || b.dims[0] != l || b.dims[k_axis] != b_row || g < 1 || n < 1) {
    const std::string l_s = std::to_string(l), row_s = kernel.a_bf16 ? k_name : std::to_string(b_row);
    const std::string want = kernel.b_mn ? "(L, G, K, N) = (" + l_s + ", G >= 1, " + row_s + ", N >= 1)"
                                         : "(L, G, N, " + std::string(k_name) + ") = (" + l_s + ", G >= 1, N >= 1, " +
                                               row_s + ")";
    const char* major = !kernel.ab_bf16 ? "" : kernel.b_mn ? ", N-major (b_major n)" : ", K-major (b_major k)";
    return Describe(b, 1) + "; expected " + want + " for a's L and K: one weight per group and batch" + major;
  }
  if (kernel.a_bf16 && !(e = CheckSwapAbTokens(buf, k, kernel.ab_fp4)).empty()) return e;
  if (kernel.b_mn && n % 8 != 0) {
    return Describe(b, 1) + "; expected N a multiple of 8 (16-byte rows of an N-major bfloat16 b)";
  }
  // TMA addresses b by weight, so only one weight (N, K) and the L·G batches need fit 32 bits, not b as a whole.
  if (n > (kMaxBufferElements - 1) / k) {
    return Describe(b, 1) + "; expected one weight (N, K) of fewer than 2**31 elements";
  }
  if (g > (kMaxBufferElements - 1) / l) return Describe(b, 1) + "; expected L*G below 2**31";
  for (int i : {2, 3}) {
    if (kernel.a_bf16 && i == 2) continue;  // the swap_ab objects' empty sfa: checked with their tokens
    if (kernel.ab_bf16 && (buf[i].dtype != XLA_FFI_DataType_U8 || ElementCount(buf[i]) != 0)) {
      return Describe(buf[i], i) + "; expected uint8 of zero elements (bfloat16 objects read no scales)";
    }
    if (buf[i].dtype != kernel.sf) {
      return Describe(buf[i], i) + (kernel.sf == XLA_FFI_DataType_U8 ? "; expected uint8 E8M0 scale bytes"
                                                                      : "; expected float8_e4m3fn scales (NVFP4)");
    }
  }
  bool sfb_atom = false;
  if (!kernel.ab_bf16 && !(e = CheckScales(buf, kernel, l, t, n, k, g, &sfb_atom)).empty()) return e;
  if (items.dtype != XLA_FFI_DataType_S32) return Describe(items, 4) + "; expected int32 work items";
  const int64_t max_items = items.rank == 3 ? items.dims[1] : 0;
  if (items.rank != 3 || items.dims[0] != l || max_items < 1 || items.dims[2] != kItemFields) {
    return Describe(items, 4) + "; expected (L, max_items, 4) = (" + std::to_string(l) +
           ", max_items >= 1, 4): (row tile or 0, group, first row, end row) per work item";
  }
  if (c.dtype != kernel.c) {
    return Describe(c, 5) + "; the kernel objects were compiled for a " +
           (kernel.c_fp4 ? std::string("float4_e2m1fn C (uint8 pairs)") : std::string(DtypeName(kernel.c)) + " C");
  }
  if (kernel.c_fp4) {
    if (n % 2 != 0) return Describe(b, 1) + "; expected N even for a packed FP4 C (two codes per byte)";
    if (!HasShape(c, {l, t, n / 2})) {
      return Describe(c, 5) + "; expected " + ShapeString({l, t, n / 2}) + " (L, T, N/2): packed FP4 pairs";
    }
  } else if (!HasShape(c, {l, t, n})) {
    return Describe(c, 5) + "; expected " + ShapeString({l, t, n}) + " (L, T, N)";
  }
  if (buf[6].dtype != XLA_FFI_DataType_F32 || !HasShape(buf[6], {l})) {
    return Describe(buf[6], 6) + "; expected float32 " + ShapeString({l}) + " (L,)";
  }
  // alpha: one per batch, but one per weight (L*G) for the swap_ab objects (a per-expert factor)
  const int64_t alphas = kernel.a_bf16 ? l * g : l;
  if (buf[7].dtype != XLA_FFI_DataType_F32 || !HasShape(buf[7], {alphas})) {
    return Describe(buf[7], 7) + "; expected float32 " + ShapeString({alphas}) +
           (kernel.a_bf16 ? " (L*G,): one per weight" : " (L,)");
  }
  for (int i = 0; i < 8; ++i) {
    if (i != 1 && !(e = CheckCount(buf[i], i)).empty()) return e;
    // Scales the objects do not read (bf16 operands: sfa and sfb; the swap_ab objects: sfa) are empty, and their
    // pointers may be null.
    if ((kernel.ab_bf16 && (i == 2 || i == 3)) || (kernel.a_bf16 && i == 2)) continue;
    const auto address = reinterpret_cast<uintptr_t>(buf[i].data);
    if (address == 0 || address % kAlignment != 0) {
      return Describe(buf[i], i) + " at address " + std::to_string(address) + "; expected a 16-byte aligned pointer";
    }
  }
  // The kernel indexes C in elements of the logical (L, T, N) even when it is packed.
  if (kernel.c_fp4 && l * t >= kMaxBufferElements / n) {
    return Describe(c, 5) + "; expected fewer than 2**31 elements in (L, T, N)";
  }
  *dims = RaggedDims{static_cast<int32_t>(t), static_cast<int32_t>(n), static_cast<int32_t>(k),
                     static_cast<int32_t>(l), static_cast<int32_t>(g), static_cast<int32_t>(max_items),
                     kernel.a_bf16 && sfb_atom ? 1 : 0};
  return "";
}

namespace {

using StateOr = ffi::ErrorOr<std::unique_ptr<KernelObjects>>;

StateOr Instantiate(std::string_view archs, std::string_view prefixes, ffi::Span<const uint8_t> objects,
                    ffi::Span<const int64_t> offsets, std::string_view ab_dtype, std::string_view a_dtype,
                    std::string_view c_dtype, std::string_view sf_dtype, int64_t sf_vec_size,
                    std::string_view b_major, int64_t amax_batches) {
  KernelDtypes dtypes{};
  std::string why = ParseRaggedAttributes(ab_dtype, a_dtype, c_dtype, sf_dtype, sf_vec_size, b_major, &dtypes);
  if (why.empty()) why = CheckAmaxBatches(kRaggedTarget, amax_batches);
  if (!why.empty()) return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(why));
  StateOr state = InstantiateKernelObjects(kRaggedTarget, archs, prefixes, objects, offsets);
  if (!state.has_value()) return state;
  (*state)->dtypes = dtypes;
  (*state)->amax_batches = amax_batches;
  if (dtypes.a_bf16 && amax_batches > 0) {  // the swap_ab objects' tally
    if (ffi::Error e = AllocateTallies(state->get(), kRaggedTarget, static_cast<size_t>(amax_batches) * 8);
        e.failure()) {
      return ffi::Unexpected<ffi::Error>(std::move(e));
    }
  }
  return state;
}

// Everything the execute stage needs from the attributes is in the state, which instantiation filled.
ffi::Error Execute(CUstream stream, int32_t device, KernelObjects* state, ffi::AnyBuffer a, ffi::AnyBuffer b,
                   ffi::AnyBuffer sfa, ffi::AnyBuffer sfb, ffi::AnyBuffer items, ffi::AnyBuffer alpha,
                   ffi::Result<ffi::AnyBuffer> c, ffi::Result<ffi::AnyBuffer> amax) {
  DslFunction* fn = nullptr;
  if (ffi::Error e = DeviceFunction(*state, device, kRaggedTarget, &fn); e.failure()) return e;
  const BufferDesc buffers[8] = {ToBufferDesc(a),     ToBufferDesc(b),  ToBufferDesc(sfa),   ToBufferDesc(sfb),
                                 ToBufferDesc(items), ToBufferDesc(*c), ToBufferDesc(*amax), ToBufferDesc(alpha)};
  RaggedDims dims;
  if (std::string message = CheckRaggedBuffers(buffers, state->dtypes, &dims); !message.empty()) {
    return ffi::Error::InvalidArgument(message);
  }
  std::string error;
  const CudaDriver* driver = GetCudaDriver(&error);  // loaded at instantiation; a pointer read here
  if (driver == nullptr) return ffi::Error::Internal(std::string(kRaggedTarget) + ": " + error);
  if (state->amax_batches != 0 && state->amax_batches != dims.l) {
    return ffi::Error::InvalidArgument(std::string(kRaggedTarget) + ": amax_batches " +
                                       std::to_string(state->amax_batches) + " does not match the call's L = " +
                                       std::to_string(dims.l) + "; expected L or 0");
  }
  // The swap_ab objects fold amax through the call site's tally (zero at every launch and left so; the batch's first
  // CTA zeroes amax before any CTA folds its max in), or skip amax without one: nothing to zero on the stream. The
  // others' integer atomic max over the bits of |C| starts from +0.0, zeroed on XLA's stream before the kernel where
  // the caller reads amax.
  const bool swap_ab = state->dtypes.a_bf16;
  const AmaxBy amax_by = state->amax_batches == 0 ? AmaxBy::kNothing
                         : swap_ab                ? AmaxBy::kTally
                                                  : AmaxBy::kAtomicMax;
  ScopedStreamContext context(*driver, stream);
  void* tally = nullptr;
  const size_t c_bytes = static_cast<size_t>(ElementCount(buffers[5])) * ElementBytes(buffers[5].dtype);
  if (ffi::Error e = PrepareOutputs(*state, device, kRaggedTarget, *driver, stream, amax_by, c->untyped_data(), c_bytes,
                                    amax->untyped_data(), static_cast<size_t>(dims.l), &tally);
      e.failure()) {
    return e;
  }
  KernelTensor tensors[9];
  for (int i = 0; i < 8; ++i) tensors[i] = KernelTensor{const_cast<void*>(buffers[i].data), ElementCount(buffers[i])};
  // b's count exactly (ElementCount saturates at 2**31): L·G weights, each below 2**31 elements, of N rows of K
  // (L, G, N, K) or K rows of N (L, G, K, N): the product of b's last two dimensions either way.
  tensors[1].count = int64_t{dims.l} * dims.g * (buffers[1].dims[2] * buffers[1].dims[3]);
  tensors[8] = KernelTensor{tally, tally == nullptr ? 0 : int64_t{dims.l}};
  int32_t t = dims.t, n = dims.n, k = dims.k, l = dims.l, g = dims.g, max_items = dims.max_items;
  int32_t sf_atom = dims.sf_atom, ret = 0;
  // fn(a, b, sfa, sfb, items, c, amax, alpha, [tally: the swap_ab objects,] t, n, k, l, g, max_items, [sf_atom: the
  // swap_ab objects,] stream) and the kernel's status slot.
  void* args[18];
  size_t count = 0;
  for (int i = 0; i < (swap_ab ? 9 : 8); ++i) args[count++] = &tensors[i];
  for (int32_t* size : {&t, &n, &k, &l, &g, &max_items}) args[count++] = size;
  if (swap_ab) args[count++] = &sf_atom;
  args[count++] = &stream;
  args[count++] = &ret;
  return RunKernel(*state, device, kRaggedTarget, *driver, fn, args, count, &ret);
}

}  // namespace
}  // namespace jbg

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbgRaggedInstantiate, jbg::Instantiate,
                              jbg::BindObjectTable(xla::ffi::Ffi::BindInstantiate())
                                  .Attr<std::string_view>("ab_dtype")
                                  .Attr<std::string_view>("a_dtype")
                                  .Attr<std::string_view>("c_dtype")
                                  .Attr<std::string_view>("sf_dtype")
                                  .Attr<int64_t>("sf_vec_size")
                                  .Attr<std::string_view>("b_major")
                                  .Attr<int64_t>("amax_batches"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbgRaggedExecute, jbg::Execute,
                              xla::ffi::Ffi::BindExecute()
                                  .Ctx<xla::ffi::PlatformStream<jbg::CUstream>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<xla::ffi::State<jbg::KernelObjects>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // a
                                  .Arg<xla::ffi::AnyBuffer>()   // b
                                  .Arg<xla::ffi::AnyBuffer>()   // sfa
                                  .Arg<xla::ffi::AnyBuffer>()   // sfb
                                  .Arg<xla::ffi::AnyBuffer>()   // items
                                  .Arg<xla::ffi::AnyBuffer>()   // alpha
                                  .Ret<xla::ffi::AnyBuffer>()   // c
                                  .Ret<xla::ffi::AnyBuffer>(),  // amax
                              {xla::ffi::Traits::kCmdBufferCompatible});
