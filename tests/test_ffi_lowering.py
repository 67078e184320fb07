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
from jax_blockgemm import dispatch, ffi_lowering, kernel_cache


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


def _walk(op):
    for region in op.regions:
        for block in region:
            for child in block:
                yield child
                yield from _walk(child)


def _custom_call(lowered, target="jbg_gemm_amax",
                 names=("archs", "function_prefixes", "objects", "offsets", "ab_dtype", "c_dtype")):
    """(attributes dict, operand types, result types) of the one `target` custom call in `lowered`."""
    calls = [op for op in _walk(lowered.compiler_ir("stablehlo").operation)
             if op.name == "stablehlo.custom_call" and str(op.attributes["call_target_name"]) == f'"{target}"']
    assert len(calls) == 1, lowered.as_text()
    op = calls[0]
    config = op.attributes["mhlo.backend_config"]  # jax's encoding of typed-FFI attributes
    attrs = {name: config[name] for name in names}
    attrs = {k: (np.array(v) if k in ("objects", "offsets") else ir_str(v)) for k, v in attrs.items()}
    return attrs, [str(x.type) for x in op.operands], [str(r.type) for r in op.results]


def ir_str(attr):
    return str(attr).strip('"')


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
            exported = jax.export.export(jax.jit(lambda *x: _test_p.bind(*x, variants=VARIANTS)),
                                         platforms=("cuda",),
                                         disabled_checks=ffi_lowering.export_disabled_checks())(*_operands(2, 64, 32, 64))
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
            calls = [op for op in _walk(lowered.compiler_ir("stablehlo").operation)
                     if op.name == "stablehlo.custom_call"
                     and ir_str(op.attributes["call_target_name"]) == "jbg_dequantize_mxfp8"]
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
            proj = [op for op in _walk(lowered.compiler_ir("stablehlo").operation)
                    if op.name == "stablehlo.custom_call"
                    and ir_str(op.attributes["call_target_name"]) == "jbg_gemm_proj_rope_mxfp8"]
            self.assertLen(proj, 1)
            self.assertEqual(proj[0].operands[0], call.results[1])  # x
            self.assertEqual(proj[0].operands[1], call.results[0])  # w
            with mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: v.key.encode()), \
                    mock.patch.object(dispatch, "dequantize_variants", return_value=()):
                f = jax.jit(functools.partial(jbg.gemm_proj_rope_mxfp8, w_out_in=w_out_in, implementation="cutedsl"))
                text = f.trace(x, w, cs, cs, x_scale=xs, w_scale=ws).lower(lowering_platforms=("cuda",)).as_text()
            self.assertNotIn("jbg_dequantize_mxfp8", text)
            self.assertIn("jbg_gemm_proj_rope_mxfp8", text)


if __name__ == "__main__":
    absltest.main()
