"""Lowering gemm_amax to the jbg_gemm_amax custom call for CUDA, on a machine without a GPU."""

import dataclasses
import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from jax.extend import core as jex_core
from jax.interpreters import mlir

from jax_blockgemm import arch as jbg_arch
from jax_blockgemm import dispatch, ffi_lowering, formats, kernel_cache

import decode_standin
import lowered_calls
from lowered_calls import calls as _calls, ir_str


@dataclasses.dataclass(frozen=True)
class StandInVariant:
    arch: str
    key: str
    function_prefix: str


VARIANTS = (StandInVariant("sm_90a", "standin.sm_90a", "jbg_standin_sm_90a"),
            StandInVariant("sm_100a", "standin.sm_100a", "jbg_standin_sm_100a"))
_rng = np.random.default_rng(7)
OBJECTS = {v.key: _rng.integers(0, 256, size, dtype=np.uint8).tobytes() for v, size in zip(VARIANTS, (1003, 517))}

# A tiny primitive whose CUDA lowering is emit_gemm_amax, so the test does not depend on the public API.
_test_p = jex_core.Primitive("jbg_test_gemm_amax")
_test_p.multiple_results = True


@_test_p.def_abstract_eval
def _abstract_eval(a, b, sfa, sfb, *, variants):
    l, m, _ = a.shape
    return jax.core.ShapedArray((l, m, b.shape[1]), jnp.float32), jax.core.ShapedArray((l,), jnp.float32)


def _cuda_lowering(ctx, a, b, sfa, sfb, *, variants):
    return ffi_lowering.emit_gemm_amax(ctx, a, b, sfa, sfb, variants=variants)


mlir.register_lowering(_test_p, _cuda_lowering, platform="cuda")


def _operands(l, m, n, k):
    kp = -(-(-(-k // 32)) // 4)
    return (jax.ShapeDtypeStruct((l, m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((l, n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((l, -(-m // 128), kp, 32, 4, 4), jnp.uint8),
            jax.ShapeDtypeStruct((l, -(-n // 128), kp, 32, 4, 4), jnp.uint8))


def _custom_call(lowered, target="jbg_gemm_amax",
                 names=("archs", "function_prefixes", "objects", "offsets", "ab_dtype", "c_dtype")):
    """(attributes dict, operand types, result types) of the one `target` custom call in `lowered`."""
    return lowered_calls.custom_call(lowered, target, names)


def _hlo_api_version(lowered):
    return re.findall(r'custom_call_target="jbg_gemm_amax".*?api_version=(\w+)', lowered.as_text(dialect="hlo"))


class EmitGemmAmaxTest(absltest.TestCase):

    def _lower(self, l, m, n, k, variants=VARIANTS):
        with mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: OBJECTS[v.key]) as get_object:
            f = jax.jit(lambda *x: _test_p.bind(*x, variants=variants))
            lowered = f.trace(*_operands(l, m, n, k)).lower(lowering_platforms=("cuda",))
        return lowered, get_object

    def test_custom_call_carries_every_arch(self):
        lowered, get_object = self._lower(3, 200, 72, 160)
        self.assertEqual(get_object.call_count, 2)
        attrs, operands, results = _custom_call(lowered)
        self.assertEqual(_hlo_api_version(lowered), ["API_VERSION_TYPED_FFI"])
        # Sorted by arch name: sm_100a's object first.
        self.assertEqual(attrs["archs"], "sm_100a,sm_90a")
        self.assertEqual(attrs["function_prefixes"], "jbg_standin_sm_100a,jbg_standin_sm_90a")
        self.assertEqual(attrs["objects"].dtype, np.uint8)
        self.assertEqual(attrs["objects"].tobytes(), OBJECTS["standin.sm_100a"] + OBJECTS["standin.sm_90a"])
        self.assertEqual(attrs["offsets"].dtype, np.int64)
        np.testing.assert_array_equal(attrs["offsets"], [0, 517, 1520])
        self.assertEqual(operands, ["tensor<3x200x160xf8E4M3FN>", "tensor<3x72x160xf8E4M3FN>",
                                    "tensor<3x2x2x32x4x4xui8>", "tensor<3x1x2x32x4x4xui8>"])
        self.assertEqual(results, ["tensor<3x200x72xf32>", "tensor<3xf32>"])
        self.assertEqual((attrs["ab_dtype"], attrs["c_dtype"]), ("float8_e4m3fn", "float32"))

    def test_one_arch(self):
        lowered, _ = self._lower(1, 128, 128, 128, variants=VARIANTS[:1])
        attrs, _, results = _custom_call(lowered)
        self.assertEqual(attrs["archs"], "sm_90a")
        self.assertEqual(attrs["objects"].tobytes(), OBJECTS["standin.sm_90a"])
        np.testing.assert_array_equal(attrs["offsets"], [0, 1003])
        self.assertEqual(results, ["tensor<1x128x128xf32>", "tensor<1xf32>"])

    def test_export_for_cuda_without_gpu(self):
        with mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: OBJECTS[v.key]):
            export = jax.export.export(jax.jit(lambda *x: _test_p.bind(*x, variants=VARIANTS)), platforms=("cuda",),
                                       disabled_checks=ffi_lowering.export_disabled_checks())
            exported = export(*_operands(2, 64, 32, 64))
        self.assertEqual(exported.platforms, ("cuda",))
        self.assertIn("stablehlo.custom_call @jbg_gemm_amax", exported.mlir_module())
        self.assertEqual([a.shape for a in exported.out_avals], [(2, 64, 32), (2,)])

    def test_export_without_the_safety_override_is_refused(self):
        with mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: OBJECTS[v.key]):
            with self.assertRaisesRegex(ValueError, "jbg_gemm_amax"):
                jax.export.export(jax.jit(lambda *x: _test_p.bind(*x, variants=VARIANTS)),
                                  platforms=("cuda",))(*_operands(1, 64, 32, 64))


_DTYPES = dict(ab_dtype=jnp.float8_e4m3fn, c_dtype=jnp.float32)


class AttributesTest(absltest.TestCase):

    def test_offsets_and_blob(self):
        attrs = ffi_lowering.gemm_amax_attributes(VARIANTS, [b"abc", b"defgh"], **_DTYPES)
        self.assertEqual(attrs["archs"], "sm_90a,sm_100a")
        self.assertEqual(attrs["objects"].tobytes(), b"abcdefgh")
        self.assertEqual(attrs["objects"].dtype, np.uint8)
        np.testing.assert_array_equal(attrs["offsets"], [0, 3, 8])
        self.assertEqual(attrs["offsets"].dtype, np.int64)

    def test_rejects_duplicate_archs_and_mismatched_counts(self):
        with self.assertRaisesRegex(ValueError, "one kernel per architecture"):
            ffi_lowering.gemm_amax_attributes([VARIANTS[0], VARIANTS[0]], [b"a", b"b"], **_DTYPES)
        with self.assertRaisesRegex(ValueError, "one object per variant"):
            ffi_lowering.gemm_amax_attributes(VARIANTS, [b"a"], **_DTYPES)
        with self.assertRaisesRegex(ValueError, "may not contain ','"):
            ffi_lowering.gemm_amax_attributes([StandInVariant("sm_90a", "k", "a,b")], [b"a"], **_DTYPES)

    def test_carries_the_kernel_dtypes_and_refuses_a_variant_compiled_for_others(self):
        attrs = ffi_lowering.gemm_amax_attributes(VARIANTS, [b"a", b"b"], ab_dtype=jnp.float8_e5m2,
                                                  c_dtype=jnp.bfloat16)
        self.assertEqual((attrs["ab_dtype"], attrs["c_dtype"]), ("float8_e5m2", "bfloat16"))
        f32_kernel = dataclasses.make_dataclass("V", ["arch", "key", "function_prefix", "ab_dtype", "c_dtype"])(
            "sm_90a", "v", "p", "float8_e4m3fn", "float32")
        with self.assertRaisesRegex(ValueError, r"compiled for \('float8_e4m3fn', 'float32', .*'bfloat16'"):
            ffi_lowering.gemm_amax_attributes([f32_kernel], [b"a"], ab_dtype=jnp.float8_e4m3fn, c_dtype=jnp.bfloat16)


class RealPrimitiveTest(absltest.TestCase):
    """The public gemm_amax lowered for CUDA goes through emit_gemm_amax with the catalog's real objects."""

    def test_public_api_lowers_to_the_custom_call(self):
        try:
            from jax_blockgemm.kernels import catalog
        except ImportError as e:
            self.skipTest(f"CuTeDSL is not importable: {e}")
        import jax_blockgemm as jbg

        variants = [catalog.select_variant(arch=arch, ab_dtype="float8_e4m3fn", c_dtype="bfloat16", sf_vec_size=32,
                                           tile_mn=(128, 128), cluster_mn=(1, 1)) for arch in ("sm_100a", "sm_90a")]
        fake_object = b"\x7fELF stand-in object bytes"
        with mock.patch.object(kernel_cache, "get_object", return_value=fake_object) as get_object:
            f = jax.jit(functools.partial(jbg.gemm_amax, c_dtype=jnp.bfloat16, implementation="cutedsl"))
            lowered = f.trace(*_operands(2, 200, 72, 160)).lower(lowering_platforms=("cuda",))
        for variant in variants:  # one object per architecture, sorted by arch name
            self.assertIn(variant, [call.args[0] for call in get_object.call_args_list])
        attrs, _, results = _custom_call(lowered)
        self.assertEqual(attrs["function_prefixes"], ",".join(v.function_prefix for v in variants))
        self.assertEqual(attrs["objects"].tobytes(), fake_object * 2)
        self.assertEqual(results, ["tensor<2x200x72xbf16>", "tensor<2xf32>"])
        self.assertEqual((attrs["ab_dtype"], attrs["c_dtype"]), ("float8_e4m3fn", "bfloat16"))

    def test_compact_scales_reach_the_kernel_as_atoms(self):
        """gemm_amax on compact scales (as the quantizers return them) keeps them compact up to the local op; the
        block-scaled kernel's call gets them as SPEC §3's atoms, made in the lowering."""
        try:
            from jax_blockgemm.kernels import catalog  # noqa: F401
        except ImportError as e:
            self.skipTest(f"CuTeDSL is not importable: {e}")
        import jax_blockgemm as jbg

        a, b, _, _ = _operands(2, 200, 72, 160)
        compact = (jax.ShapeDtypeStruct((2, 200, 5), jnp.uint8), jax.ShapeDtypeStruct((2, 72, 5), jnp.uint8))
        with mock.patch.object(kernel_cache, "get_object", return_value=b"stand-in object"):
            f = jax.jit(functools.partial(jbg.gemm_amax, c_dtype=jnp.bfloat16, implementation="cutedsl"))
            lowered = f.trace(a, b, *compact).lower(lowering_platforms=("cuda",))
        _, operands, _ = _custom_call(lowered)
        self.assertEqual(operands[2:4], ["tensor<2x2x2x32x4x4xui8>", "tensor<2x1x2x32x4x4xui8>"])

    def test_public_proj_rope_lowers_with_the_hopper_and_blackwell_objects(self):
        """gemm_proj_rope_mxfp8 for CUDA carries the sm_100a object beside the sm_90a one (the handler picks by
        compute capability), for both weight layouts."""
        try:
            from jax_blockgemm.kernels import catalog
        except ImportError as e:
            self.skipTest(f"CuTeDSL is not importable: {e}")
        import jax_blockgemm as jbg

        t, h, k = 96, 2, 72
        x = jax.ShapeDtypeStruct((t, k), jnp.bfloat16)
        cs = jax.ShapeDtypeStruct((t, 64), jnp.bfloat16)
        for w_out_in in (True, False):
            b_major = "k" if w_out_in else "n"
            variants = [catalog.select_variant(op="proj_rope", arch=arch, ab_dtype="bfloat16",
                                               c_dtype="float8_e4m3fn", sf_vec_size=32,
                                               tile_mn=jbg_arch.policy(arch).proj_rope_tile, cluster_mn=(1, 1),
                                               schedule=jbg_arch.policy(arch).proj_rope_schedule, b_major=b_major)
                        for arch in ("sm_100a", "sm_90a")]
            w = jax.ShapeDtypeStruct((h * 192, k) if w_out_in else (k, h * 192), jnp.bfloat16)
            with mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: v.key.encode()) as get_object:
                f = jax.jit(functools.partial(jbg.gemm_proj_rope_mxfp8, w_out_in=w_out_in, implementation="cutedsl"))
                lowered = f.trace(x, w, cs, cs).lower(lowering_platforms=("cuda",))
            self.assertEqual([call.args[0] for call in get_object.call_args_list], variants)
            attrs, operands, results = _custom_call(lowered, "jbg_gemm_proj_rope_mxfp8",
                                                    ("archs", "function_prefixes", "objects", "offsets"))
            self.assertEqual(attrs["archs"], "sm_100a,sm_90a")
            self.assertEqual(attrs["function_prefixes"], ",".join(v.function_prefix for v in variants))
            self.assertEqual(attrs["objects"].tobytes(), b"".join(v.key.encode() for v in variants))
            self.assertEqual(results, [f"tensor<1x{t}x{h}x192xf8E4M3FN>", f"tensor<1x{t}x{h}x6xui8>",
                                       f"tensor<1x{t}x{h}x192xf8E4M3FN>", f"tensor<1x{t // 32}x{h}x192xui8>"])

    def test_mxfp8_proj_rope_dequantizes_by_kernel_then_runs_the_bf16_kernel(self):
        """MXFP8 inputs lower to one jbg_dequantize_mxfp8 call for w (operand 0: scales along K, which is its rows
        for w_out_in=False) and x (operand 1: scales along K) whose bf16 results are the proj_rope call's w and x; it
        carries one dequantize object per arch of the proj_rope kernels. Without dequantize kernels XLA dequantizes
        (no such call)."""
        try:
            from jax_blockgemm.kernels import catalog
        except ImportError as e:
            self.skipTest(f"CuTeDSL is not importable: {e}")
        import jax_blockgemm as jbg

        t, h, k = 96, 2, 64
        cs = jax.ShapeDtypeStruct((t, 64), jnp.bfloat16)
        x = jax.ShapeDtypeStruct((t, k), jnp.float8_e4m3fn)
        xs = jax.ShapeDtypeStruct((t, k // 32), jnp.uint8)
        for w_out_in in (True, False):
            n = h * 192
            w = jax.ShapeDtypeStruct((n, k) if w_out_in else (k, n), jnp.float8_e4m3fn)
            ws = jax.ShapeDtypeStruct((n, k // 32) if w_out_in else (k // 32, n), jnp.uint8)
            f = jax.jit(functools.partial(jbg.gemm_proj_rope_mxfp8, w_out_in=w_out_in, implementation="cutedsl"))
            with mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: v.key.encode()):
                lowered = f.trace(x, w, cs, cs, x_scale=xs, w_scale=ws).lower(lowering_platforms=("cuda",))
            calls = _calls(lowered, "jbg_dequantize_mxfp8")
            self.assertLen(calls, 1)
            call = calls[0]
            w_shape, ws_shape = ("x".join(map(str, (1, *a.shape))) for a in (w, ws))
            self.assertEqual([str(o.type) for o in call.operands],
                             [f"tensor<{w_shape}xf8E4M3FN>", f"tensor<{ws_shape}xui8>",
                              f"tensor<1x{t}x{k}xf8E4M3FN>", f"tensor<1x{t}x{k // 32}xui8>"])
            self.assertEqual([str(r.type) for r in call.results],
                             [f"tensor<{w_shape}xbf16>", f"tensor<1x{t}x{k}xbf16>"])
            axis = int(str(call.attributes["mhlo.backend_config"]["scale_axis"]).split(":")[0])
            self.assertEqual(axis, -1 if w_out_in else -2)
            keys = [catalog.select_variant(op="dequantize", arch=arch, ab_dtype="float8_e4m3fn",
                                           c_dtype="bfloat16", sf_vec_size=32, tile_mn=catalog.DEQUANTIZE_TILE,
                                           cluster_mn=(1, 1), a_major="k" if w_out_in else "m").key
                    for arch in ("sm_100a", "sm_90a")]
            objects = np.array(call.attributes["mhlo.backend_config"]["objects"]).tobytes()
            self.assertEqual(objects, "".join(keys).encode())
            proj = _calls(lowered, "jbg_gemm_proj_rope_mxfp8")
            self.assertLen(proj, 1)
            self.assertEqual(proj[0].operands[0], call.results[1])  # x
            self.assertEqual(proj[0].operands[1], call.results[0])  # w
            with mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: v.key.encode()), \
                    mock.patch.object(dispatch, "dequantize_variants", return_value=()):
                f = jax.jit(functools.partial(jbg.gemm_proj_rope_mxfp8, w_out_in=w_out_in, implementation="cutedsl"))
                text = f.trace(x, w, cs, cs, x_scale=xs, w_scale=ws).lower(lowering_platforms=("cuda",)).as_text()
            self.assertNotIn("jbg_dequantize_mxfp8", text)
            self.assertIn("jbg_gemm_proj_rope_mxfp8", text)


# --------------------------------------------------------------------------------------------------------------
# The decode kernel: jbg_weight_stream


@dataclasses.dataclass(frozen=True)
class StandInDecodeVariant:
    arch: str
    ab_dtype: str = "float8_e4m3fn"
    c_dtype: str = "bfloat16"
    sf_dtype: str = "float8_e8m0fnu"
    sf_vec_size: int = 32
    tile_mn: tuple = (32, 64)

    @property
    def key(self):
        return f"standin.{self.arch}.{self.tile_mn[1]}"

    @property
    def function_prefix(self):
        return f"jbg_standin_{self.arch}_{self.tile_mn[1]}"


_ws_test_p = jex_core.Primitive("jbg_test_weight_stream")
_ws_test_p.multiple_results = True


@_ws_test_p.def_abstract_eval
def _ws_abstract_eval(x, w, sw, alpha, *, variants, c_dtype):
    l, m, _ = x.shape
    return jax.core.ShapedArray((l, m, w.shape[1]), c_dtype), jax.core.ShapedArray((l,), jnp.float32)


mlir.register_lowering(_ws_test_p, lambda ctx, *ops, variants, c_dtype: ffi_lowering.emit_weight_stream(
    ctx, *ops, variants=variants), platform="cuda")

_WS_NAMES = ("archs", "function_prefixes", "objects", "offsets", "w_dtype", "c_dtype", "sf_dtype", "sf_vec_size",
             "max_m", "amax_batches")


def _ws_operands(l=2, m=5, n=40, k=96, *, w=jnp.float8_e4m3fn, sf=jnp.uint8, v=32, atom=False):
    sd = jax.ShapeDtypeStruct
    kb = -(-k // v)
    sw = (l, -(-n // 128), -(-kb // 4), 32, 4, 4) if atom else (l, n, kb)
    return (sd((l, m, k), jnp.bfloat16), sd((l, n, k // 2 if w == jnp.uint8 else k), w), sd(sw, sf),
            sd((l,), jnp.float32))


def _ws_lower(operands, variants, c_dtype=jnp.bfloat16):
    with mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: v.key.encode()):
        f = jax.jit(lambda *x: _ws_test_p.bind(*x, variants=tuple(variants), c_dtype=np.dtype(c_dtype)))
        return f.trace(*operands).lower(lowering_platforms=("cuda",))


def _int_attr(attr):
    return int(str(attr).split(":")[0])


class EmitWeightStreamTest(absltest.TestCase):
    """emit_weight_stream: the custom call, its attributes and the contract it refuses to break."""

    def test_custom_call_carries_the_objects_and_what_they_were_compiled_for(self):
        variants = (StandInDecodeVariant("sm_90a"), StandInDecodeVariant("sm_100a", tile_mn=(32, 16)))
        lowered = _ws_lower(_ws_operands(m=5), variants)
        attrs, operands, results = _custom_call(lowered, "jbg_weight_stream", _WS_NAMES)
        self.assertEqual(attrs["archs"], "sm_100a,sm_90a")
        self.assertEqual(attrs["function_prefixes"], "jbg_standin_sm_100a_16,jbg_standin_sm_90a_64")
        self.assertEqual(attrs["objects"].tobytes(), b"standin.sm_100a.16standin.sm_90a.64")
        np.testing.assert_array_equal(attrs["offsets"], [0, 18, 35])
        self.assertEqual((attrs["w_dtype"], attrs["c_dtype"], attrs["sf_dtype"]),
                         ("float8_e4m3fn", "bfloat16", "float8_e8m0fnu"))
        self.assertEqual((_int_attr(attrs["sf_vec_size"]), _int_attr(attrs["max_m"])), (32, 16))  # the least room
        self.assertEqual(_int_attr(attrs["amax_batches"]), 2)  # L: the handler keeps a tally of that many batches
        self.assertEqual(operands, ["tensor<2x5x96xbf16>", "tensor<2x40x96xf8E4M3FN>", "tensor<2x40x3xui8>",
                                    "tensor<2xf32>"])
        self.assertEqual(results, ["tensor<2x5x40xbf16>", "tensor<2xf32>"])

    def test_packed_fp4_nvfp4_scales_in_the_atom_form(self):
        variant = StandInDecodeVariant("sm_90a", ab_dtype="float4_e2m1fn", c_dtype="float16",
                                       sf_dtype="float8_e4m3fn", sf_vec_size=16)
        lowered = _ws_lower(_ws_operands(n=200, k=128, w=jnp.uint8, sf=jnp.float8_e4m3fn, v=16, atom=True),
                            [variant], c_dtype=jnp.float16)
        attrs, operands, results = _custom_call(lowered, "jbg_weight_stream", _WS_NAMES)
        self.assertEqual((attrs["w_dtype"], attrs["c_dtype"], attrs["sf_dtype"], _int_attr(attrs["sf_vec_size"])),
                         ("float4_e2m1fn", "float16", "float8_e4m3fn", 16))
        self.assertEqual(operands[1:3], ["tensor<2x200x64xui8>", "tensor<2x2x2x32x4x4xf8E4M3FN>"])
        self.assertEqual(results[0], "tensor<2x5x200xf16>")

    def test_refuses_what_the_handler_would(self):
        ok = StandInDecodeVariant("sm_90a")
        cases = [
            (_ws_operands(m=65), [ok], "M = 65 rows; variants take at most"),
            (_ws_operands(m=17), [ok, StandInDecodeVariant("sm_100a", tile_mn=(32, 16))], "M = 17 rows"),
            (_ws_operands()[:3] + (jax.ShapeDtypeStruct((1,), jnp.float32),), [ok], r"alpha \(2,\) float32"),
            (_ws_operands()[:2] + (jax.ShapeDtypeStruct((2, 40, 3, 1), jnp.uint8),) + _ws_operands()[3:], [ok],
             "sw of rank 3 or 6"),
            ((jax.ShapeDtypeStruct((2, 5, 96), jnp.float32),) + _ws_operands()[1:], [ok], "x .L, M, K. bfloat16"),
            (_ws_operands(), [StandInDecodeVariant("sm_90a", c_dtype="float32")], "compiled for .*'float32'"),
        ]
        for operands, variants, message in cases:
            with self.subTest(message=message), self.assertRaisesRegex(ValueError, message):
                _ws_lower(operands, variants)

    def test_export_names_the_target(self):
        self.assertIn(jax.export.DisabledSafetyCheck.custom_call("jbg_weight_stream"),
                      ffi_lowering.export_disabled_checks())
        self.assertEqual(ffi_lowering.WEIGHT_STREAM_TARGET, "jbg_weight_stream")
        with mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: v.key.encode()):
            f = jax.jit(lambda *x: _ws_test_p.bind(*x, variants=(StandInDecodeVariant("sm_90a"),),
                                                   c_dtype=np.dtype(jnp.bfloat16)))
            exported = jax.export.export(f, platforms=("cuda",),
                                         disabled_checks=ffi_lowering.export_disabled_checks())(*_ws_operands())
        self.assertIn("stablehlo.custom_call @jbg_weight_stream", exported.mlir_module())


class PublicDecodeLoweringTest(absltest.TestCase):
    """The public operations lowered for CUDA (no GPU) reach jbg_weight_stream for decode-sized calls: a stand-in
    kernel class answers can_implement, object bytes are stand-ins."""

    def setUp(self):
        super().setUp()
        try:
            from jax_blockgemm.kernels import catalog  # noqa: F401
        except ImportError as e:
            self.skipTest(f"CuTeDSL is not importable: {e}")
        self.enterContext(decode_standin.stand_in_kernels())
        self.get_object = self.enterContext(mock.patch.object(kernel_cache, "get_object",
                                                              side_effect=lambda v: v.key.encode()))

    def _weight_only(self, fmt, x_dtype=jnp.bfloat16, m=3, n=48, k=64, **kwargs):
        import jax_blockgemm as jbg

        w = jbg.quantize_weight(jnp.ones((n, k)), fmt)
        x = jax.ShapeDtypeStruct((m, k), x_dtype)
        f = jax.jit(functools.partial(jbg.weight_only_matmul, **kwargs))
        return f.trace(x, w).lower(lowering_platforms=("cuda",))

    def test_weight_only_with_bf16_x(self):
        """x, the codes (packed FP4), the compact scales (sf_atom 0) and alpha go to the kernel as they are; None
        takes it on sm_90a only (sm_100a's threshold is 0) and only for formats whose sm_90a threshold covers the 3
        rows (E5M2's is 0: it keeps the reference), 'cutedsl' carries both archs."""
        for fmt, codes, scales in (("mxfp4", "tensor<1x48x32xui8>", "tensor<1x48x2xui8>"),
                                   ("nvfp4", "tensor<1x48x32xui8>", "tensor<1x48x4xf8E4M3FN>"),
                                   ("mxfp8_e5m2", "tensor<1x48x64xf8E5M2>", "tensor<1x48x2xui8>")):
            for implementation, archs in ((None, "sm_90a"), ("cutedsl", "sm_100a,sm_90a")):
                with self.subTest(fmt=fmt, implementation=implementation):
                    lowered = self._weight_only(fmt, implementation=implementation, out_dtype=jnp.float32)
                    if implementation is None and jbg_arch.policy("sm_90a").decode_max_m[fmt] < 3:
                        self.assertEqual(_calls(lowered, "jbg_weight_stream"), [])
                        self.assertIn("dot_general", lowered.as_text())
                        continue
                    (call,) = _calls(lowered, "jbg_weight_stream")
                    self.assertEqual([str(o.type) for o in call.operands],
                                     ["tensor<1x3x64xbf16>", codes, scales, "tensor<1xf32>"])
                    self.assertEqual([str(r.type) for r in call.results], ["tensor<1x3x48xf32>", "tensor<1xf32>"])
                    config = call.attributes["mhlo.backend_config"]
                    self.assertEqual(ir_str(config["archs"]), archs)
                    self.assertEqual(_int_attr(config["max_m"]), 16)  # 3 rows: the 16-row variants
                    self.assertEqual(_int_attr(config["amax_batches"]), 0)  # amax is dropped: no tally, not computed
                    self.assertNotIn("dot_general", lowered.as_text())

    def test_weight_only_with_float32_x_keeps_the_reference(self):
        lowered = self._weight_only("mxfp8_e4m3", x_dtype=jnp.float32)
        self.assertEqual(_calls(lowered, "jbg_weight_stream"), [])
        self.assertIn("stablehlo.dot_general", lowered.as_text())
        with self.assertRaisesRegex(ValueError, "implementation='cutedsl': .*x is float32: the decode kernel takes "
                                                "bfloat16 activations"):
            self._weight_only("mxfp8_e4m3", x_dtype=jnp.float32, implementation="cutedsl")

    def test_weight_only_with_more_rows_than_the_kernel_takes(self):
        lowered = self._weight_only("mxfp4", m=65)
        self.assertEqual(_calls(lowered, "jbg_weight_stream"), [])
        with self.assertRaisesRegex(ValueError, "M = 65 rows is more than the decode kernel takes .64."):
            self._weight_only("mxfp4", m=65, implementation="cutedsl")

    def _gemm(self, m, *, fmt="mxfp8", c_dtype=jnp.bfloat16, alpha=None, n=144, atoms=False, **kwargs):
        """gemm_amax (L = 2, K = 96) lowered for CUDA; scales compact, or as atoms with `atoms`."""
        import jax_blockgemm as jbg

        sd = jax.ShapeDtypeStruct
        l, k = 2, 96
        fp4 = fmt in ("mxfp4", "nvfp4")
        v = 16 if fmt == "nvfp4" else 32
        codes, row = (jnp.uint8, k // 2) if fp4 else (jnp.float8_e4m3fn, k)
        sf = jnp.float8_e4m3fn if fmt == "nvfp4" else jnp.uint8
        a_shape = (l, row, m) if kwargs.get("a_major") == "m" else (l, m, row)
        b_shape = (l, row, n) if kwargs.get("b_major") == "n" else (l, n, row)
        scales = [formats.atom_shape(l, mn, k // v) if atoms else (l, mn, k // v) for mn in (m, n)]
        operands = (sd(a_shape, codes), sd(b_shape, codes), *(sd(shape, sf) for shape in scales))
        extra = {} if alpha is None else dict(alpha=alpha)
        f = jax.jit(lambda *x: jbg.gemm_amax(*x, c_dtype=c_dtype, sf_vec_size=v, **extra, **kwargs))
        return f.trace(*operands).lower(lowering_platforms=("cuda",))

    def test_mxfp8_e4m3_decode_rows_take_the_swap_ab_decode_tiles(self):
        """On an sm_90a GPU, decode-sized calls with MXFP8 E4M3 weights of arch.TABLE's decode_swap_ab_m rows go to
        the swap_ab ragged kernel's decode tiles as one group: x (bf16, or A dequantized) padded to a K of 256 (and
        permuted for the 32- and 64-token tiles), the weight as (L, 1, N, K) with its scales in the form given
        (weight-only: compact; gemm_amax: atoms), empty token scales, one item table per batch.
        Rows below a range that starts later, few rows against a small weight (decode_swap_ab_small, which these
        48 x 96 weights are but for that rule switched off), a float16 C and formats the table does not name keep
        jbg_weight_stream, as does a lowering with no GPU present."""
        first, last = jbg_arch.policy("sm_90a").decode_swap_ab_m["mxfp8_e4m3"]
        small_m = jbg_arch.policy("sm_90a").decode_swap_ab_small[0]
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)), \
                mock.patch.object(dispatch, "_failed_self_checks", return_value=""):  # the tile's self-check passed
            for implementation in (None, "cutedsl"):  # the shipped rule: small weights keep the decode kernel
                few = self._weight_only("mxfp8_e4m3", m=small_m, k=96, implementation=implementation)
                more = self._weight_only("mxfp8_e4m3", m=small_m + 1, k=96, implementation=implementation)
                self.assertLen(_calls(few, "jbg_weight_stream"), 1)
                self.assertLen(_calls(more, "jbg_ragged_gemm_amax"), 1)
            self.enterContext(jbg_arch.overridden("9.0", decode_swap_ab_small=(0, 0, 0)))
            for implementation in (None, "cutedsl"):
                for m in (first, 16, 17, 32, 33, last):
                    with self.subTest(implementation=implementation, m=m):
                        lowered = self._weight_only("mxfp8_e4m3", m=m, k=96, implementation=implementation,
                                                    out_dtype=jnp.float32)
                        self.assertEqual(_calls(lowered, "jbg_weight_stream"), [])
                        (call,) = _calls(lowered, "jbg_ragged_gemm_amax")
                        types = [str(o.type) for o in call.operands]
                        self.assertEqual(types[:3], [f"tensor<1x{m}x256xbf16>", "tensor<1x1x48x96xf8E4M3FN>",
                                                     "tensor<1x0xui8>"])
                        self.assertEqual(types[3], "tensor<1x48x3xui8>")  # the scales compact, as given
                        self.assertRegex(types[4], r"tensor<1x\d+x4xi32>")
                        self.assertEqual(str(call.results[0].type), f"tensor<1x{m}x48xf32>")
                        tile = "t16x64" if m <= 16 else "t32x64" if m <= 32 else "t64x64"  # the smallest that holds M
                        self.assertIn(tile, lowered.as_text())  # its object (stand-in bytes)
                        # weight-only drops amax: no tally, nothing zeroed
                        self.assertEqual(_int_attr(call.attributes["mhlo.backend_config"]["amax_batches"]), 0)
            gemm = self._gemm(40)
            (call,) = _calls(gemm, "jbg_ragged_gemm_amax")
            self.assertEqual(_int_attr(call.attributes["mhlo.backend_config"]["amax_batches"]), 2)  # L: the tally
            self.assertEqual(str(call.operands[0].type), "tensor<2x40x256xbf16>")
            self.assertEqual(str(call.operands[1].type), "tensor<2x1x144x96xf8E4M3FN>")
            self.assertEqual(str(call.operands[3].type), "tensor<2x144x3xui8>")  # compact scales as they are
            gemm_on_atoms = self._gemm(40, atoms=True)  # held: the call's operands live in its module
            (call,) = _calls(gemm_on_atoms, "jbg_ragged_gemm_amax")
            # and atoms as they are: (L, ceil(144/128), ceil(3/4), 32, 4, 4), read in place by the tile
            self.assertEqual(str(call.operands[3].type), "tensor<2x2x1x32x4x4xui8>")
            with jbg_arch.overridden("9.0", decode_swap_ab_m={"mxfp8_e4m3": (17, 64)}):  # a range from 17 rows
                self.assertLen(_calls(self._weight_only("mxfp8_e4m3", m=16, k=96), "jbg_weight_stream"), 1)
            self.assertLen(_calls(self._gemm(40, c_dtype=jnp.float16, implementation="cutedsl"), "jbg_weight_stream"),
                           1)  # the tile writes f32 or bf16 C
            self.assertLen(_calls(self._weight_only("mxfp8_e5m2", m=40, k=96, implementation="cutedsl"),
                                  "jbg_weight_stream"), 1)
        self.assertLen(_calls(self._weight_only("mxfp8_e4m3", m=40, k=96, implementation="cutedsl"),
                              "jbg_weight_stream"), 1)  # no local GPU: the decode kernel, which covers every arch

    def test_the_16_token_tile_takes_x_as_it_is(self):
        """Weight-only calls of at most 16 rows with K a multiple of 256: the custom call's tokens are x itself, with
        no gather (the 16-token tile puts the columns in its fragments' order in shared memory) and no padding, in
        every format; K off 256 is padded with zeros, still not gathered. 40 rows (the 64-token tile): gathered."""
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)), \
                mock.patch.object(dispatch, "_failed_self_checks", return_value=""), \
                jbg_arch.overridden("9.0", decode_swap_ab_small=(0, 0, 0)):
            for fmt, m, k in (("mxfp8_e4m3", 1, 512), ("mxfp4", 16, 256), ("nvfp4", 9, 512), ("mxfp4", 7, 96),
                              ("nvfp4", 40, 512)):
                with self.subTest(fmt=fmt, m=m, k=k):
                    lowered = self._weight_only(fmt, m=m, k=k)
                    (call,) = _calls(lowered, "jbg_ragged_gemm_amax")
                    self.assertEqual(str(call.operands[0].type), f"tensor<1x{m}x{-(-k // 256) * 256}xbf16>")
                    text = lowered.as_text()
                    self.assertEqual("stablehlo.gather" in text, m > 16)
                    if m <= 16:
                        self.assertEqual("stablehlo.pad" in text, k % 256 != 0)

    def test_small_m_gemm_amax_with_none_on_an_h200(self):
        """On a (faked) compute capability 9.0 GPU, None takes the decode kernel for M <= 64: A dequantized to bf16
        in XLA is x, B and its atom scales (sf_atom 1) are w and sw, alpha is ones; amax is the kernel's (the H200 row
        without its swap_ab decode tiles, which take MXFP8 E4M3 there)."""
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)), \
                jbg_arch.overridden("9.0", decode_swap_ab_m={}):
            lowered = self._gemm(7, atoms=True)
        (call,) = _calls(lowered, "jbg_weight_stream")
        self.assertEqual([str(o.type) for o in call.operands],
                         ["tensor<2x7x96xbf16>", "tensor<2x144x96xf8E4M3FN>", "tensor<2x2x1x32x4x4xui8>",
                          "tensor<2xf32>"])
        self.assertEqual([str(r.type) for r in call.results], ["tensor<2x7x144xbf16>", "tensor<2xf32>"])
        config = call.attributes["mhlo.backend_config"]
        self.assertEqual(ir_str(config["archs"]), "sm_90a")
        self.assertEqual(ir_str(config["function_prefixes"]), "jbg_weight_stream_sm_90a_e4m3_bf16_sf32_t32x16_c1x1")
        text = lowered.as_text()
        self.assertNotIn("jbg_gemm_amax", text)
        self.assertNotIn("dot_general", text)
        self.assertRegex(text, r"stablehlo.constant dense<1.000000e\+00> : tensor<2xf32>")  # alpha = ones

    def test_nvfp4_gemm_amax_passes_its_alpha(self):
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)):
            lowered = self._gemm(16, fmt="nvfp4", c_dtype=jnp.float16, alpha=jnp.float32(0.5))
        (call,) = _calls(lowered, "jbg_weight_stream")
        types = [str(o.type) for o in call.operands]
        self.assertEqual(types[1:3], ["tensor<2x144x48xui8>", "tensor<2x144x6xf8E4M3FN>"])  # compact scales as given
        self.assertEqual(_int_attr(call.attributes["mhlo.backend_config"]["max_m"]), 16)
        self.assertNotIn("dense<1.000000e+00> : tensor<2xf32>", lowered.as_text())  # the call's alpha, not ones

    def test_larger_m_and_an_n_major_weight_keep_the_gemm_amax_path(self):
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)):
            self.assertEqual(_calls(self._gemm(65), "jbg_weight_stream"), [])  # None: the reference
            self.assertLen(_calls(self._gemm(65, implementation="cutedsl"), "jbg_gemm_amax"), 1)
            lowered = self._gemm(8, implementation="cutedsl", b_major="n")
            self.assertEqual(_calls(lowered, "jbg_weight_stream"), [])
            self.assertLen(_calls(lowered, "jbg_gemm_amax"), 1)

    def test_fp8_fp4_and_m_major_c_leave_the_kernel_as_float32_or_their_dtype(self):
        """C dtypes the decode kernel does not write come out of it as float32 (N-major, (L, M, N)) and XLA
        converts them; an M-major C is the kernel's N-major one transposed."""
        cases = ((dict(fmt="mxfp4", c_dtype=jnp.float8_e4m3fn), "tensor<2x8x144xf32>", "tensor<2x8x144xf8E4M3FN>"),
                 (dict(fmt="nvfp4", c_dtype=jnp.float4_e2m1fn, alpha=jnp.float32(2.0), n=160), "tensor<2x8x160xf32>",
                  "tensor<2x8x80xui8>"),
                 (dict(c_major="m"), "tensor<2x8x144xbf16>", "tensor<2x144x8xbf16>"),
                 (dict(m=16, a_major="m", c_major="m", c_dtype=jnp.float32), "tensor<2x16x144xf32>",
                  "tensor<2x144x16xf32>"))  # an M-major A: M a multiple of 16 (16-byte rows of codes)
        for kwargs, kernel_c, c in cases:
            with self.subTest(**{k: str(v) for k, v in kwargs.items()}):
                kwargs = dict(kwargs)
                lowered = self._gemm(kwargs.pop("m", 8), implementation="cutedsl", **kwargs)
                (call,) = _calls(lowered, "jbg_weight_stream")
                self.assertEqual(str(call.results[0].type), kernel_c)
                self.assertEqual(_calls(lowered, "jbg_gemm_amax"), [])
                self.assertRegex(lowered.as_text(), rf"-> \({c} {{jax.result_info")  # what gemm_amax returns

    def test_cutedsl_small_m_gemm_amax_is_the_decode_kernel(self):
        lowered = self._gemm(16, implementation="cutedsl")
        (call,) = _calls(lowered, "jbg_weight_stream")
        self.assertEqual(ir_str(call.attributes["mhlo.backend_config"]["archs"]), "sm_100a,sm_90a")
        self.assertEqual(_int_attr(call.attributes["mhlo.backend_config"]["amax_batches"]), 2)  # L: amax's tally
        self.assertEqual(_calls(lowered, "jbg_gemm_amax"), [])


class RealDecodeKernelLoweringTest(absltest.TestCase):
    """The same lowering with the real kernels/weight_stream.py class answering can_implement (no stand-in)."""

    def test_weight_only_and_gemm_amax_reach_the_real_class(self):
        if decode_standin.real_class() is None:
            self.skipTest(decode_standin.MISSING)
        import jax_blockgemm as jbg

        w = jbg.quantize_weight(jnp.ones((48, 64)), "mxfp4")
        with mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: v.key.encode()):
            f = jax.jit(functools.partial(jbg.weight_only_matmul, implementation="cutedsl"))
            lowered = f.trace(jax.ShapeDtypeStruct((4, 64), jnp.bfloat16), w).lower(lowering_platforms=("cuda",))
            self.assertLen(_calls(lowered, "jbg_weight_stream"), 1)
            g = jax.jit(lambda *x: jbg.gemm_amax(*x, c_dtype=jnp.float32, implementation="cutedsl"))
            sd = jax.ShapeDtypeStruct
            lowered = g.trace(sd((4, 64), jnp.float8_e4m3fn), sd((48, 64), jnp.float8_e4m3fn),
                              sd((4, 2), jnp.uint8), sd((48, 2), jnp.uint8)).lower(lowering_platforms=("cuda",))
            self.assertLen(_calls(lowered, "jbg_weight_stream"), 1)


if __name__ == "__main__":
    absltest.main()
