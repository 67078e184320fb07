// Python module `jax_blockgemm._jbg_ffi`: hands the FFI handlers and their state type to JAX as capsules, loads
// the CuTeDSL runtime, and exposes the pure checking helpers for CPU tests.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "contraction.h"
#include "dequantize.h"
#include "dsl_runtime.h"
#include "gemm_amax.h"
#include "object_check.h"
#include "proj_rope.h"
#include "quantize_pair.h"
#include "ragged.h"
#include "weight_stream.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace {

constexpr int kAbiVersion = 2;

nb::capsule Capsule(const void* ptr) { return nb::capsule(ptr); }

// Every FFI target: (name, instantiate stage, execute stage).
struct Target {
  const char* name;
  XLA_FFI_Handler* instantiate;
  XLA_FFI_Handler* execute;
};
const Target kTargets[] = {{jbg::kGemmAmaxTarget, JbgGemmAmaxInstantiate, JbgGemmAmaxExecute},
                           {jbg::kProjRopeTarget, JbgProjRopeInstantiate, JbgProjRopeExecute},
                           {jbg::kDequantizeTarget, JbgDequantizeInstantiate, JbgDequantizeExecute},
                           {jbg::kWeightStreamTarget, JbgWeightStreamInstantiate, JbgWeightStreamExecute},
                           {jbg::kRaggedTarget, JbgRaggedInstantiate, JbgRaggedExecute},
                           {jbg::kContractionTarget, JbgContractionInstantiate, JbgContractionExecute},
                           {jbg::kQuantizePairTarget, JbgQuantizePairInstantiate, JbgQuantizePairExecute}};

XLA_FFI_Handler* HandlerFor(const std::string& target, const std::string& stage) {
  const Target* found = nullptr;
  for (const Target& t : kTargets) {
    if (target == t.name) found = &t;
  }
  if (found == nullptr) throw nb::value_error(("unknown FFI target " + target).c_str());
  if (stage == "instantiate") return found->instantiate;
  if (stage == "execute") return found->execute;
  throw nb::value_error(("unknown stage " + stage + "; expected 'instantiate' or 'execute'").c_str());
}

// Asks a bound handler for its metadata (FFI API version and traits) the way XLA does at registration: a call
// frame whose first extension is the metadata extension. No XLA API table is needed for this query.
std::tuple<int, int, uint32_t> HandlerMetadata(const std::string& target, const std::string& stage) {
  XLA_FFI_Handler* handler = HandlerFor(target, stage);
  if (stage == "instantiate" && jbg::KernelObjects::id.type_id == 0) {
    // The instantiate handler reports its state type id, which exists only after registration with XLA.
    throw nb::value_error("the instantiate stage reports metadata only after its state type is registered");
  }
  XLA_FFI_Metadata metadata{};
  metadata.struct_size = XLA_FFI_Metadata_STRUCT_SIZE;
  XLA_FFI_Metadata_Extension extension{};
  extension.extension_base.struct_size = XLA_FFI_Metadata_Extension_STRUCT_SIZE;
  extension.extension_base.type = XLA_FFI_Extension_Metadata;
  extension.metadata = &metadata;
  XLA_FFI_CallFrame frame{};
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.extension_start = &extension.extension_base;
  if (handler(&frame) != nullptr) throw std::runtime_error("the handler rejected the metadata query");
  return {metadata.api_version.major_version, metadata.api_version.minor_version, metadata.traits};
}

int DtypeCode(const std::string& name) {
  if (name == "uint8") return XLA_FFI_DataType_U8;
  if (name == "float32") return XLA_FFI_DataType_F32;
  if (name == "bfloat16") return XLA_FFI_DataType_BF16;
  if (name == "float8_e4m3fn") return XLA_FFI_DataType_F8E4M3FN;
  if (name == "float8_e5m2") return XLA_FFI_DataType_F8E5M2;
  if (name == "int32") return XLA_FFI_DataType_S32;
  if (name == "int8") return XLA_FFI_DataType_S8;
  if (name == "float16") return XLA_FFI_DataType_F16;
  throw nb::value_error(("dtype " + name + " has no test mapping").c_str());
}

using BufferSpec = std::tuple<std::string, std::vector<int64_t>, uintptr_t>;

// The test hooks' buffers as the handlers' checks see them (dims point into `specs`, which must outlive `descs`).
void ToDescs(const std::vector<BufferSpec>& specs, jbg::BufferDesc* descs) {
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& [dtype, dims, address] = specs[i];
    descs[i] = jbg::BufferDesc{DtypeCode(dtype), dims.data(), dims.size(), reinterpret_cast<const void*>(address)};
  }
}

// Test hook for the execute-stage buffer checks: each buffer as (dtype name, dims, address) (6, or 7 with alpha),
// and the dtypes the call site's kernels were compiled for (ab_dtype and c_dtype both "" = the FP8 dtypes of a and
// c with E8M0 scales per 32: no mismatch). Returns (message, (m, n, k, l)); message is "" when the buffers fit.
std::tuple<std::string, std::tuple<int, int, int, int>> CheckBuffers(const std::vector<BufferSpec>& specs,
                                                                     const std::string& ab_dtype,
                                                                     const std::string& c_dtype,
                                                                     const std::string& sf_dtype,
                                                                     int64_t sf_vec_size,
                                                                     const std::string& a_major,
                                                                     const std::string& b_major,
                                                                     bool c_rows_16_bytes) {
  if (specs.size() != 6 && specs.size() != 7) {
    throw nb::value_error("expected 6 or 7 buffers: a, b, sfa, sfb, c, amax[, alpha]");
  }
  jbg::BufferDesc descs[7];
  ToDescs(specs, descs);
  jbg::KernelDtypes kernel{descs[0].dtype, descs[4].dtype};
  if (ab_dtype.empty() != c_dtype.empty()) throw nb::value_error("give both ab_dtype and c_dtype, or neither");
  if (!ab_dtype.empty()) {
    std::string why = jbg::ParseKernelDtypes(ab_dtype, c_dtype, sf_dtype, sf_vec_size, a_major, b_major, &kernel);
    if (!why.empty()) throw nb::value_error(why.c_str());
  }
  jbg::GemmDims dims;
  std::string message = jbg::CheckGemmAmaxBuffers(descs, specs.size(), kernel, &dims, c_rows_16_bytes);
  return {message, {dims.m, dims.n, dims.k, dims.l}};
}

// Test hook for the proj_rope execute-stage buffer checks: x, w, cos, sin, the four outputs as (dtype, dims,
// address). Returns (message, (t, k, h)).
std::tuple<std::string, std::tuple<int, int, int>> CheckProjRope(const std::vector<BufferSpec>& specs, bool w_out_in) {
  if (specs.size() != 8) throw nb::value_error("expected 8 buffers: x, w, cos, sin and the four outputs");
  jbg::BufferDesc descs[8];
  ToDescs(specs, descs);
  jbg::ProjRopeDims dims;
  std::string message = jbg::CheckProjRopeBuffers(descs, w_out_in, &dims);
  return {message, {dims.t, dims.k, dims.h}};
}

// Test hook for the dequantize execute stage's buffer checks on buffers in FFI order (`inputs` of them, then the
// outputs): returns (message, (rows, cols, rows1, cols1)).
std::tuple<std::string, std::tuple<int, int, int, int>> CheckDequantize(const std::vector<BufferSpec>& specs,
                                                                       int64_t scale_axis, size_t inputs) {
  if (specs.size() > 6 || inputs > specs.size()) throw nb::value_error("expected at most 6 buffers, inputs first");
  jbg::BufferDesc descs[6];
  ToDescs(specs, descs);
  jbg::DequantizeDims dims[2];
  std::string message = jbg::CheckDequantizeBuffers(descs, inputs, specs.size() - inputs, scale_axis, dims);
  return {message, {dims[0].rows, dims[0].cols, dims[1].rows, dims[1].cols}};
}

// Test hook for the quantize_pair execute stage's buffer checks: w, [row_map,] values, codes, scales as (dtype,
// dims, address), for objects of `schedule` (0 plain, 1 gather, 2 gather_values; the gather ones take the map).
// Returns (message, (rows, cols, src_rows)).
std::tuple<std::string, std::tuple<int, int, int>> CheckQuantizePair(const std::vector<BufferSpec>& specs,
                                                                     int64_t schedule) {
  if (schedule < 0 || schedule > 2) throw nb::value_error("schedule must be 0, 1 or 2");
  const size_t want = schedule == 0 ? 4 : 5;
  if (specs.size() != want) {
    throw nb::value_error(schedule == 0 ? "expected 4 buffers: w, values, codes, scales"
                                        : "expected 5 buffers: w, row_map, values, codes, scales");
  }
  jbg::BufferDesc descs[5];
  ToDescs(specs, descs);
  jbg::QuantizePairDims dims;
  std::string message =
      jbg::CheckQuantizePairBuffers(descs, static_cast<jbg::QuantizePairSchedule>(schedule), &dims);
  return {message, {dims.rows, dims.cols, dims.src_rows}};
}

// The weight_stream attributes parsed (ValueError naming what is wrong otherwise).
jbg::KernelDtypes WeightStreamDtypes(const std::string& w_dtype, const std::string& c_dtype,
                                     const std::string& sf_dtype, int64_t sf_vec_size, int64_t max_m,
                                     int64_t amax_batches = 1) {
  jbg::KernelDtypes kernel{};
  std::string why =
      jbg::ParseWeightStreamAttributes(w_dtype, c_dtype, sf_dtype, sf_vec_size, max_m, amax_batches, &kernel);
  if (!why.empty()) throw nb::value_error(why.c_str());
  return kernel;
}

// Test hook for the weight_stream execute stage's buffer checks: x, w, sw, c, amax, alpha as (dtype, dims,
// address), for objects compiled for the given attributes. Returns (message, (m, n, k, l, sf_atom)).
std::tuple<std::string, std::tuple<int, int, int, int, int>> CheckWeightStream(
    const std::vector<BufferSpec>& specs, const std::string& w_dtype, const std::string& c_dtype,
    const std::string& sf_dtype, int64_t sf_vec_size, int64_t max_m) {
  if (specs.size() != 6) throw nb::value_error("expected 6 buffers: x, w, sw, c, amax, alpha");
  const jbg::KernelDtypes kernel = WeightStreamDtypes(w_dtype, c_dtype, sf_dtype, sf_vec_size, max_m);
  jbg::BufferDesc descs[6];
  ToDescs(specs, descs);
  jbg::WeightStreamDims dims;
  std::string message = jbg::CheckWeightStreamBuffers(descs, kernel, max_m, &dims);
  return {message, {dims.m, dims.n, dims.k, dims.l, dims.sf_atom}};
}

// The ragged attributes parsed (ValueError naming what is wrong otherwise).
jbg::KernelDtypes RaggedDtypes(const std::string& ab_dtype, const std::string& c_dtype, const std::string& sf_dtype,
                               int64_t sf_vec_size, const std::string& b_major, const std::string& a_dtype) {
  jbg::KernelDtypes kernel{};
  std::string why = jbg::ParseRaggedAttributes(ab_dtype, a_dtype.empty() ? ab_dtype : a_dtype, c_dtype, sf_dtype,
                                               sf_vec_size, b_major, &kernel);
  if (!why.empty()) throw nb::value_error(why.c_str());
  return kernel;
}

// Test hook for the ragged execute stage's buffer checks: a, b, sfa, sfb, items, c, amax, alpha as (dtype, dims,
// address), for objects compiled for the given attributes. Returns (message, (t, n, k, l, g, max_items, sf_atom)).
std::tuple<std::string, std::tuple<int, int, int, int, int, int, int>> CheckRagged(
    const std::vector<BufferSpec>& specs, const std::string& ab_dtype, const std::string& c_dtype,
    const std::string& sf_dtype, int64_t sf_vec_size, const std::string& b_major, const std::string& a_dtype) {
  if (specs.size() != 8) throw nb::value_error("expected 8 buffers: a, b, sfa, sfb, items, c, amax, alpha");
  const jbg::KernelDtypes kernel = RaggedDtypes(ab_dtype, c_dtype, sf_dtype, sf_vec_size, b_major, a_dtype);
  jbg::BufferDesc descs[8];
  ToDescs(specs, descs);
  jbg::RaggedDims dims;
  std::string message = jbg::CheckRaggedBuffers(descs, kernel, &dims);
  return {message, {dims.t, dims.n, dims.k, dims.l, dims.g, dims.max_items, dims.sf_atom}};
}

// The contraction attributes parsed (ValueError naming what is wrong otherwise).
jbg::KernelDtypes ContractionDtypes(const std::string& ab_dtype, const std::string& c_dtype) {
  jbg::KernelDtypes kernel{};
  std::string why = jbg::ParseContractionAttributes(ab_dtype, c_dtype, &kernel);
  if (!why.empty()) throw nb::value_error(why.c_str());
  return kernel;
}

// Test hook for the contraction execute stage's buffer checks: x, y, bounds, c, amax as (dtype, dims, address), for
// objects compiled for the given attributes. Returns (message, (t, k, n, l, g)).
std::tuple<std::string, std::tuple<int, int, int, int, int>> CheckContraction(const std::vector<BufferSpec>& specs,
                                                                              const std::string& ab_dtype,
                                                                              const std::string& c_dtype) {
  if (specs.size() != 5) throw nb::value_error("expected 5 buffers: x, y, bounds, c, amax");
  const jbg::KernelDtypes kernel = ContractionDtypes(ab_dtype, c_dtype);
  jbg::BufferDesc descs[5];
  ToDescs(specs, descs);
  jbg::ContractionDims dims;
  std::string message = jbg::CheckContractionBuffers(descs, kernel, &dims);
  return {message, {dims.t, dims.k, dims.n, dims.l, dims.g}};
}

// Test hook for the instantiate-stage attribute parsing: returns [(arch, prefix, cc_major, cc_minor, begin, end)].
std::vector<std::tuple<std::string, std::string, int, int, size_t, size_t>> ParseObjects(
    const std::string& archs, const std::string& prefixes, size_t objects_size, const std::vector<int64_t>& offsets,
    const std::string& target) {
  std::vector<jbg::ObjectEntry> entries;
  std::string error;
  if (!jbg::ParseObjectTable(target, archs, prefixes, objects_size, offsets.data(), offsets.size(), &entries,
                             &error)) {
    throw nb::value_error(error.c_str());
  }
  std::vector<std::tuple<std::string, std::string, int, int, size_t, size_t>> out;
  for (const auto& e : entries) out.emplace_back(e.arch, e.function_prefix, e.cc_major, e.cc_minor, e.begin, e.end);
  return out;
}

}  // namespace

NB_MODULE(_jbg_ffi, m) {
  m.doc() = "XLA FFI bridge of jax_blockgemm: launches CuTeDSL kernel objects on XLA's stream.";
  m.attr("ABI_VERSION") = kAbiVersion;
  m.attr("GEMM_AMAX_TARGET") = jbg::kGemmAmaxTarget;
  m.attr("PROJ_ROPE_TARGET") = jbg::kProjRopeTarget;
  m.attr("DEQUANTIZE_TARGET") = jbg::kDequantizeTarget;
  m.attr("WEIGHT_STREAM_TARGET") = jbg::kWeightStreamTarget;
  m.attr("RAGGED_TARGET") = jbg::kRaggedTarget;
  m.attr("CONTRACTION_TARGET") = jbg::kContractionTarget;
  m.attr("QUANTIZE_PAIR_TARGET") = jbg::kQuantizePairTarget;
  m.attr("KERNEL_OBJECTS_TYPE") = jbg::kKernelObjectsType;
  m.attr("TRAIT_COMMAND_BUFFER_COMPATIBLE") = static_cast<uint32_t>(XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);

  m.def(
      "ffi_targets",
      [] {
        nb::dict out;
        for (const Target& t : kTargets) {
          nb::dict stages;
          stages["instantiate"] = Capsule(reinterpret_cast<void*>(t.instantiate));
          stages["execute"] = Capsule(reinterpret_cast<void*>(t.execute));
          out[t.name] = stages;
        }
        return out;
      },
      "{target name: {stage: handler capsule}} for jax.ffi.register_ffi_target.");
  m.def(
      "ffi_types",
      [] {
        nb::dict registration;
        registration["type_id"] = Capsule(&jbg::KernelObjects::id);
        registration["type_info"] = Capsule(jbg::KernelObjectsTypeInfo());
        nb::dict out;
        out[jbg::kKernelObjectsType] = registration;
        return out;
      },
      "{type name: {'type_id': capsule, 'type_info': capsule}} for jax.ffi.register_ffi_type.");
  m.def("state_type_id", [] { return jbg::KernelObjects::id.type_id; },
        "The id XLA assigned to the handler state type (0 until registered).");
  m.def("handler_metadata", &HandlerMetadata, nb::arg("target"), nb::arg("stage"),
        "(FFI API major, minor, traits bitmask) the bound handler reports to XLA.");
  m.def(
      "load_runtime",
      [](const std::string& path) {
        std::string error;
        if (!jbg::LoadDslRuntime(path, &error)) throw std::runtime_error(error);
      },
      nb::arg("path"), "dlopen libcute_dsl_runtime.so once per process (later calls keep the first library).");
  m.def("runtime_path", &jbg::DslRuntimePath, "Path of the loaded CuTeDSL runtime, or '' when none is loaded.");
  m.def("check_gemm_amax_buffers", &CheckBuffers, nb::arg("buffers"), nb::arg("ab_dtype") = "",
        nb::arg("c_dtype") = "", nb::arg("sf_dtype") = "float8_e8m0fnu", nb::arg("sf_vec_size") = 32,
        nb::arg("a_major") = "k", nb::arg("b_major") = "k", nb::arg("c_rows_16_bytes") = false,
        "Test hook: the execute stage's buffer checks on [(dtype, dims, address)] * 6 (7 with alpha), for kernels "
        "compiled for ab_dtype / c_dtype / sf_dtype / sf_vec_size ('' = whatever a / c are, E8M0 per 32); "
        "c_rows_16_bytes for a kernel that stores C by TMA (one that takes its grid size).");
  m.def(
      "check_cluster_ctas",
      [](const std::vector<int64_t>& cluster_ctas, size_t num_objects) {
        return jbg::CheckClusterCtas(jbg::kGemmAmaxTarget, cluster_ctas.data(), cluster_ctas.size(), num_objects);
      },
      nb::arg("cluster_ctas"), nb::arg("num_objects"),
      "Test hook: the instantiate stage's check of the cluster_ctas attribute ('' when it is well formed).");
  m.def(
      "parse_sm_limit",
      [](std::optional<std::string> text) {
        int32_t limit = 0;
        std::string why = jbg::ParseSmLimit(text ? text->c_str() : nullptr, &limit);
        if (!why.empty()) throw nb::value_error(why.c_str());
        return limit;
      },
      nb::arg("text").none(),
      "Test hook: the SM count JAX_BLOCKGEMM_SM_LIMIT=text caps the persistent grids at (0: none; None: unset).");
  m.def("grid_ctas", &jbg::GridCtas, nb::arg("sms"), nb::arg("cluster_ctas"), nb::arg("max_active_clusters"),
        "Test hook: max_ctas, the persistent grid instantiation passes to a kernel that takes its grid size.");
  m.def(
      "parse_kernel_dtypes",
      [](const std::string& ab_dtype, const std::string& c_dtype, const std::string& sf_dtype,
         int64_t sf_vec_size, const std::string& a_major, const std::string& b_major) {
        jbg::KernelDtypes out{};
        std::string why = jbg::ParseKernelDtypes(ab_dtype, c_dtype, sf_dtype, sf_vec_size, a_major, b_major, &out);
        if (!why.empty()) throw nb::value_error(why.c_str());
        return std::make_tuple(out.ab, out.c);
      },
      nb::arg("ab_dtype"), nb::arg("c_dtype"), nb::arg("sf_dtype") = "float8_e8m0fnu", nb::arg("sf_vec_size") = 32,
      nb::arg("a_major") = "k", nb::arg("b_major") = "k",
      "Test hook: the instantiate stage's ab_dtype / c_dtype / sf_dtype / sf_vec_size / a_major / b_major parsing.");
  m.def("check_proj_rope_buffers", &CheckProjRope, nb::arg("buffers"), nb::arg("w_out_in"),
        "Test hook: the proj_rope execute stage's buffer checks on [(dtype, dims, address)] * 8.");
  m.def("check_dequantize_buffers", &CheckDequantize, nb::arg("buffers"), nb::arg("scale_axis"),
        nb::arg("inputs") = 2,
        "Test hook: the dequantize execute stage's buffer checks on [(dtype, dims, address)] in FFI order: `inputs` "
        "inputs (codes, scales[, codes1, scales1]), then the outputs (out[, out1]).");
  m.def("check_weight_stream_buffers", &CheckWeightStream, nb::arg("buffers"), nb::arg("w_dtype"),
        nb::arg("c_dtype"), nb::arg("sf_dtype") = "float8_e8m0fnu", nb::arg("sf_vec_size") = 32,
        nb::arg("max_m") = 64,
        "Test hook: the weight_stream execute stage's buffer checks on [(dtype, dims, address)] * 6 (x, w, sw, c, "
        "amax, alpha) for objects compiled for w_dtype / c_dtype / sf_dtype / sf_vec_size taking max_m rows.");
  m.def(
      "parse_weight_stream_attributes",
      [](const std::string& w_dtype, const std::string& c_dtype, const std::string& sf_dtype, int64_t sf_vec_size,
         int64_t max_m, int64_t amax_batches) {
        const jbg::KernelDtypes k =
            WeightStreamDtypes(w_dtype, c_dtype, sf_dtype, sf_vec_size, max_m, amax_batches);
        return std::make_tuple(k.ab, k.c, k.sf);
      },
      nb::arg("w_dtype"), nb::arg("c_dtype"), nb::arg("sf_dtype"), nb::arg("sf_vec_size"), nb::arg("max_m"),
      nb::arg("amax_batches") = 1,
      "Test hook: the weight_stream instantiate stage's attribute parsing: (w, c, sf) as XLA FFI dtype codes.");
  m.def("check_ragged_buffers", &CheckRagged, nb::arg("buffers"), nb::arg("ab_dtype"), nb::arg("c_dtype"),
        nb::arg("sf_dtype") = "float8_e8m0fnu", nb::arg("sf_vec_size") = 32, nb::arg("b_major") = "k",
        nb::arg("a_dtype") = "",
        "Test hook: the ragged execute stage's buffer checks on [(dtype, dims, address)] * 8 (a, b, sfa, sfb, items, "
        "c, amax, alpha) for objects compiled for ab_dtype / c_dtype / sf_dtype / sf_vec_size / b_major / a_dtype "
        "(empty: ab_dtype's).");
  m.def(
      "parse_ragged_attributes",
      [](const std::string& ab_dtype, const std::string& c_dtype, const std::string& sf_dtype, int64_t sf_vec_size,
         const std::string& b_major, const std::string& a_dtype) {
        const jbg::KernelDtypes k = RaggedDtypes(ab_dtype, c_dtype, sf_dtype, sf_vec_size, b_major, a_dtype);
        return std::make_tuple(k.ab, k.c, k.sf, k.sf_vec_size, k.ab_fp4, k.c_fp4, k.alpha, k.ab_bf16, k.b_mn,
                               k.a_bf16);
      },
      nb::arg("ab_dtype"), nb::arg("c_dtype"), nb::arg("sf_dtype"), nb::arg("sf_vec_size"), nb::arg("b_major") = "k",
      nb::arg("a_dtype") = "",
      "Test hook: the ragged instantiate stage's attribute parsing: (ab, c, sf) as XLA FFI dtype codes, sf_vec_size, "
      "whether a and b, and C, are packed FP4, whether the objects take alpha, whether a and b are bfloat16 (no "
      "scales), whether b is N-major and whether a is bfloat16 tokens for the codes of b (a_dtype, empty: "
      "ab_dtype's).");
  m.def(
      "check_ragged_amax_batches",
      [](int64_t amax_batches) {
        std::string why = jbg::CheckAmaxBatches(jbg::kRaggedTarget, amax_batches);
        if (!why.empty()) throw nb::value_error(why.c_str());
      },
      nb::arg("amax_batches"),
      "Test hook: the ragged instantiate stage's check of amax_batches (ValueError unless 0 <= it < 2**31).");
  m.def("check_contraction_buffers", &CheckContraction, nb::arg("buffers"), nb::arg("ab_dtype"), nb::arg("c_dtype"),
        "Test hook: the contraction execute stage's buffer checks on [(dtype, dims, address)] * 5 (x, y, bounds, c, "
        "amax) for objects compiled for ab_dtype / c_dtype.");
  m.def(
      "parse_contraction_attributes",
      [](const std::string& ab_dtype, const std::string& c_dtype) {
        const jbg::KernelDtypes k = ContractionDtypes(ab_dtype, c_dtype);
        return std::make_tuple(k.ab, k.c);
      },
      nb::arg("ab_dtype"), nb::arg("c_dtype"),
      "Test hook: the contraction instantiate stage's attribute parsing: (ab, c) as XLA FFI dtype codes.");
  m.def("check_quantize_pair_buffers", &CheckQuantizePair, nb::arg("buffers"), nb::arg("schedule") = 0,
        "Test hook: the quantize_pair execute stage's buffer checks on [(dtype, dims, address)] (w, [row_map,] "
        "values, codes, scales) for objects of `schedule` (0 plain, 1 gather, 2 gather_values).");
  m.def("parse_object_table", &ParseObjects, nb::arg("archs"), nb::arg("function_prefixes"),
        nb::arg("objects_size"), nb::arg("offsets"), nb::arg("target") = jbg::kGemmAmaxTarget,
        "Test hook: the instantiate stage's attribute parsing (errors name `target`).");
  m.def(
      "check_kernel_object",
      [](nb::bytes object, const std::string& function_prefix) {
        return jbg::CheckKernelObject(std::string_view(object.c_str(), object.size()), function_prefix);
      },
      nb::arg("object"), nb::arg("function_prefix"),
      "Test hook: the instantiate stage's check of one object's bytes ('' when it may be loaded).");
  m.def(
      "parse_arch",
      [](const std::string& arch) {
        int major = 0, minor = 0;
        if (!jbg::ParseArch(arch, &major, &minor)) throw nb::value_error(("bad arch " + arch).c_str());
        return std::make_tuple(major, minor);
      },
      nb::arg("arch"), "Test hook: 'sm_90a' -> (9, 0).");
}
