// What every FFI target of the bridge shares: the kernel objects a call site carries, loaded per device at
// INSTANTIATE and looked up and run at EXECUTE, and the buffer helpers the handlers' checks use.
//
// A call site's attributes `archs`, `function_prefixes` (comma-separated), `objects` (the kernel objects
// concatenated, uint8) and `offsets` (int64, one more than objects) form the object table: the object for each
// visible device's compute capability is checked (object_check.h), loaded through the DSL runtime and kept in the
// call site's state, so that EXECUTE neither loads nor allocates nor synchronizes.
#ifndef JBG_FFI_KERNEL_OBJECTS_H_
#define JBG_FFI_KERNEL_OBJECTS_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"
#include "cuda_driver.h"
#include "dsl_runtime.h"

namespace jbg {

inline constexpr const char kKernelObjectsType[] = "jbg_kernel_objects";
inline constexpr uintptr_t kAlignment = 16;
inline constexpr int64_t kMaxBufferElements = int64_t{1} << 31;  // sizes travel to the kernels as int32
inline constexpr int64_t kMaxClusterCtas = 16;  // the largest cluster a kernel launches (4 x 4, non-portable)
inline constexpr int64_t kAtomRows = 128;   // SPEC §3's scale atom: 128 rows (of M or N) ...
inline constexpr int64_t kAtomBlocks = 4;   // ... by 4 scale blocks, stored as (32, 4, 4) bytes

// What the handler sees of one buffer; dtype is an XLA_FFI_DataType value.
struct BufferDesc {
  int dtype;
  const int64_t* dims;
  size_t rank;
  const void* data;
};

// Helpers every handler's buffer checks share.
// Product of the dims, saturated at kMaxBufferElements (no step overflows, whatever the dims); 0 if a dim is <= 0.
int64_t ElementCount(const BufferDesc& b);
// "float8_e4m3fn", "bfloat16", ... for the dtypes the handlers take; "another dtype" otherwise.
const char* DtypeName(int dtype);
// Bytes per element of a C dtype the kernels write: 4 (float32), 2 (bfloat16, float16), else 1 (FP8 codes, packed
// FP4 pairs).
size_t ElementBytes(int dtype);
// "(2, 200, 96)".
std::string ShapeString(const int64_t* dims, size_t rank);
std::string ShapeString(std::initializer_list<int64_t> dims);
// Whether `b` has exactly the dims `want` (its rank included).
bool HasShape(const BufferDesc& b, std::initializer_list<int64_t> want);
bool HasShape(const BufferDesc& b, const std::vector<int64_t>& want);
// ceil(x / y) for x >= 0, y > 0, without the overflow of (x + y - 1) / y near INT64_MAX.
inline int64_t CeilDiv(int64_t x, int64_t y) { return x / y + (x % y != 0); }
// What a handler's checks see of an XLA buffer.
BufferDesc ToBufferDesc(const xla::ffi::AnyBuffer& buffer);

// The C struct the exported kernels take for each 1-D tensor argument: the data pointer, then the element count.
// Kernels exported with 32-bit symbolic sizes read the low half of `count` (little-endian), which is the same number
// because every handler keeps counts below kMaxBufferElements (all but ragged's b, contraction's c and quantize_pair's
// w, values and codes, whose kernels take 64-bit sizes).
struct KernelTensor {
  void* data;
  int64_t count;
};
static_assert(sizeof(KernelTensor) == 16, "the DSL's tensor struct is a pointer and one 8-byte slot");

// The dtypes a call site's kernel objects were compiled for (XLA_FFI_DataType values of the buffers) and how the
// buffers hold them.
struct KernelDtypes {
  int ab;                    // float8_e4m3fn, float8_e5m2, uint8 (packed FP4 pairs), or bfloat16 (ragged's bf16
                             // objects): the dtype of a and b
  int c;                     // float32, bfloat16, float16, float8_e4m3fn, float8_e5m2, or uint8 (packed FP4 C)
  int sf = XLA_FFI_DataType_U8;  // uint8 (E8M0 bytes; empty buffers for bf16 operands) or float8_e4m3fn (NVFP4)
  int sf_vec_size = 32;      // elements per scale along K: 32 (MX formats), 16 (NVFP4), or 0 (bf16: no scales)
  bool ab_fp4 = false;       // a and b hold two E2M1 codes per byte: K = 2 x their last dimension
  bool ab_bf16 = false;      // a and b are bfloat16 with no block scales (sf_dtype "none", sf_vec_size 0): sfa and
                             // sfb are empty uint8 buffers the kernel does not read
  bool a_bf16 = false;       // ragged swap_ab objects: a is the tokens in bfloat16, (L, T, K rounded up to 256) with
                             // each 128 columns permuted (swap_ab_layout.swap_ab_tokens); b alone holds codes; sfa
                             // is empty
  bool c_fp4 = false;        // c holds two E2M1 codes per byte: its last dimension is N / 2
  bool alpha = false;        // the kernels take NVFP4's alpha, (L,) float32, after amax (E4M3 scales)
  bool a_mn = false;         // a is M-major: (L, K, M)
  bool b_mn = false;         // b is N-major: (L, K, N)
};

// Sets k->ab (and k->ab_fp4) from the name of a GEMM operand's codes: "float8_e4m3fn", "float8_e5m2", or
// "float4_e2m1fn" (carried as uint8 pairs); false for any other name.
bool ParseCodeDtype(std::string_view name, KernelDtypes* k);
// Sets k->c (and k->c_fp4) from the name of a C dtype: "float32", "bfloat16", "float16", "float8_e4m3fn",
// "float8_e5m2", or "float4_e2m1fn" (written as uint8 pairs); false for any other name.
bool ParseCDtype(std::string_view name, KernelDtypes* k);
// Sets k->sf and k->sf_vec_size from a block-scale format the kernels take for k's codes (ParseCodeDtype first):
// E8M0 bytes per 32 (MXFP8, MXFP4) or, for FP4 codes only, float8_e4m3fn per 16 (NVFP4); false for any other.
bool ParseBlockScales(std::string_view sf_dtype, int64_t sf_vec_size, KernelDtypes* k);
// "float8_e4m3fn codes", "float4_e2m1fn codes (uint8 pairs)" or "bfloat16 operands": what a and b hold for objects
// compiled for `k`.
std::string CodeName(const KernelDtypes& k);

// Parses "sm_90a" / "sm_100a" (any "sm_<major><minor>[suffix]") into a compute capability.
bool ParseArch(std::string_view arch, int* major, int* minor);

// One kernel object of the `objects` attribute.
struct ObjectEntry {
  std::string arch;
  std::string function_prefix;
  int cc_major = 0, cc_minor = 0;
  size_t begin = 0, end = 0;  // byte range inside `objects`
};

// Splits and cross-checks the four attributes; returns false with `*error` set when they disagree.
// `target` names the custom call in the error.
bool ParseObjectTable(std::string_view target, std::string_view archs, std::string_view function_prefixes,
                      size_t objects_size, const int64_t* offsets, size_t num_offsets,
                      std::vector<ObjectEntry>* out, std::string* error);

// Zeroed device memory a call site keeps on one device for the life of its state: the amax tally of the decode and
// swap_ab kernels (kernels/weight_stream.py, kernels/sm90/ragged_swap_ab.py), which every launch leaves zero again,
// so nothing writes it between launches.
struct DeviceTally {
  CUdeviceptr words = 0;        // 0 where the device has none
  CUcontext context = nullptr;  // the device's primary context, retained while the words live
  CUdevice device = 0;
};

// State kept per call site between INSTANTIATE and EXECUTE, for every target: the kernel object loaded for each
// device. Owned by XLA (destroyed with the executable).
struct KernelObjects {
  KernelObjects() = default;
  KernelObjects(const KernelObjects&) = delete;
  KernelObjects& operator=(const KernelObjects&) = delete;
  ~KernelObjects();  // frees the tallies

  static xla::ffi::TypeId id;
  std::string archs;                           // as given, for error messages
  KernelDtypes dtypes{};                       // gemm_amax: what the objects were compiled for (checked per call)
  std::vector<DslFunction*> functions;         // by CUDA device ordinal; nullptr where no object fits
  std::vector<std::string> function_prefixes;  // by CUDA device ordinal, for error messages
  std::vector<std::string> capabilities;       // "9.0", by CUDA device ordinal
  std::vector<int32_t> multiprocessors;        // SM count, by CUDA device ordinal (proj_rope's persistent grid;
                                               // JAX_BLOCKGEMM_SM_LIMIT caps it, a test aid)
  std::vector<int32_t> grid_ctas;              // by CUDA device ordinal: 0 when the device's object takes no grid
                                               // size, else max_ctas, the CTAs of its persistent grid (GridCtas)
  bool poison_outputs = false;                 // JAX_BLOCKGEMM_POISON_OUTPUTS: fill C with NaN before each launch
  int64_t amax_batches = 0;                    // ragged: L where the caller reads amax, 0 where it drops it
  std::vector<DeviceTally> tallies;            // by CUDA device ordinal; empty for targets that keep none
  size_t tally_bytes = 0;                      // the size of each
};

XLA_FFI_TypeInfo* KernelObjectsTypeInfo();

// The execute-stage steps every target shares; `target` names the custom call in error messages.
// The function loaded for `device`, or an error naming the device, its compute capability and the archs carried.
xla::ffi::Error DeviceFunction(const KernelObjects& state, int32_t device, std::string_view target, DslFunction** fn);
// Test aid (JAX_BLOCKGEMM_POISON_OUTPUTS): fills `bytes` of an output buffer with `value` on `stream` (0xFF: NaN in
// float32, bfloat16, float16 and FP8), so that an element the kernel leaves unwritten fails the check; the error names
// the buffer `name`.
xla::ffi::Error PoisonBytes(std::string_view target, std::string_view name, const CudaDriver& driver, CUstream stream,
                            const void* data, size_t bytes, unsigned char value = 0xFF);
// How a launch produces amax: an integer atomic max over the bits of |C| from +0.0 (amax zeroed on the stream first),
// through the call site's tally (the kernel writes amax whole: the decode kernel's last CTA per batch stores it, the
// swap_ab kernel's first zeroes it; nothing to zero on the stream), or not at all (the caller drops amax).
enum class AmaxBy { kAtomicMax, kTally, kNothing };
// EXECUTE, with the stream's context current, before a launch that writes C (`c_bytes`) and amax (`batches` float32
// values) as `amax_by` says: zeroes amax for kAtomicMax; for kTally sets `*tally` to the device's tally (else leaves
// it null) after checking it holds the batches' words; with `state.poison_outputs` fills C, and amax where the kernel
// writes it whole, with 0xFF.
xla::ffi::Error PrepareOutputs(const KernelObjects& state, int32_t device, std::string_view target,
                               const CudaDriver& driver, CUstream stream, AmaxBy amax_by, void* c, size_t c_bytes,
                               void* amax, size_t batches, void** tally = nullptr);
// INSTANTIATE: `bytes` of zeroed device memory for each device that has a loaded object and an active primary
// context (the devices the process runs on; none is created for the others), allocated and zeroed synchronously here
// so that EXECUTE neither allocates nor writes them.
xla::ffi::Error AllocateTallies(KernelObjects* state, std::string_view target, size_t bytes);
// Runs `fn` on `args` (pointers to each argument; the last one is `ret`, the kernel's CUDA status slot).
xla::ffi::Error RunKernel(const KernelObjects& state, int32_t device, std::string_view target,
                          const CudaDriver& driver, DslFunction* fn, void** args, size_t num_args,
                          const int32_t* ret);

// Checks a call site's `cluster_ctas` attribute: one entry per object, 0 where the object's function takes no grid
// size, else the CTAs of one of its clusters (1 to 16). Returns "" or what is wrong; `target` names the custom call.
std::string CheckClusterCtas(std::string_view target, const int64_t* cluster_ctas, size_t count, size_t num_objects);

// The persistent grid (max_ctas) of a kernel with `cluster_ctas`-CTA clusters on a GPU of `sms` SMs (after
// JAX_BLOCKGEMM_SM_LIMIT) that runs `max_active_clusters` of them at once (0: unknown): whole clusters, no more
// than fit at once or than the SMs hold, and at least one.
int32_t GridCtas(int32_t sms, int32_t cluster_ctas, int32_t max_active_clusters);

// Checks the attribute amax_batches of the targets that write amax: L, the call's batch count, where the caller reads
// amax, 0 where it drops it. Returns "" or what is wrong; `target` names the custom call.
std::string CheckAmaxBatches(std::string_view target, int64_t amax_batches);

// The value of JAX_BLOCKGEMM_SM_LIMIT (`text`, null where unset): 0 (no limit) where unset or empty, else the
// positive decimal count of SMs it names, into `*limit`. Returns "" or what is wrong (anything else: a test that set
// it would otherwise run on every SM believing it ran on fewer).
std::string ParseSmLimit(const char* text, int32_t* limit);

// The INSTANTIATE stage every target shares (it depends on the object table only): parses the attributes, checks
// and loads each visible device's kernel object. `target` names the custom call in error messages. `cluster_ctas`
// (CheckClusterCtas; empty: no object takes a grid size) gives each device whose object takes one its max_ctas.
xla::ffi::ErrorOr<std::unique_ptr<KernelObjects>> InstantiateKernelObjects(
    std::string_view target, std::string_view archs, std::string_view function_prefixes,
    xla::ffi::Span<const uint8_t> objects, xla::ffi::Span<const int64_t> offsets,
    const std::vector<int64_t>& cluster_ctas = {});

// Appends the object table's four attributes to an FFI binding (both stages of every target take them first, in
// this order, before their own).
template <typename Binding>
auto BindObjectTable(Binding binding) {
  return std::move(binding)
      .template Attr<std::string_view>("archs")
      .template Attr<std::string_view>("function_prefixes")
      .template Attr<xla::ffi::Span<const uint8_t>>("objects")
      .template Attr<xla::ffi::Span<const int64_t>>("offsets");
}

}  // namespace jbg

#endif  // JBG_FFI_KERNEL_OBJECTS_H_
