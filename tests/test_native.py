"""The native FFI bridge on a CPU machine: module surface, handler metadata, registration, and the handler's
attribute parsing and buffer checks (the same C++ the GPU runs; the kernel launch itself is tested on the GPU)."""

import os
import pathlib
import re
import shutil
import tempfile
import textwrap

from absl.testing import absltest, parameterized

from jax_blockgemm import _native

import xla_probe

ext = _native.extension()

U8, F32, BF16, E4M3, E5M2 = "uint8", "float32", "bfloat16", "float8_e4m3fn", "float8_e5m2"


def _cdiv(x, y):
    return -(-x // y)


def _buffers(l, m, n, k, *, ab=E4M3, c=F32, base=1 << 20):
    """Well-formed (dtype, dims, address) for a, b, sfa, sfb, c, amax; addresses 256-byte spaced and aligned."""
    kp = _cdiv(_cdiv(k, 32), 4)
    return [(ab, [l, m, k], base), (ab, [l, n, k], base + 256), (U8, [l, _cdiv(m, 128), kp, 32, 4, 4], base + 512),
            (U8, [l, _cdiv(n, 128), kp, 32, 4, 4], base + 768), (c, [l, m, n], base + 1024), (F32, [l], base + 1280)]


def _replace(buffers, index, *, dtype=None, dims=None, address=None):
    out = list(buffers)
    d, s, p = out[index]
    out[index] = (dtype or d, s if dims is None else dims, p if address is None else address)
    return out


class ProjRopeBufferCheckTest(parameterized.TestCase):
    """The proj_rope execute stage's buffer checks (ffi/proj_rope.cc), through the test hook."""

    @staticmethod
    def _buffers(t=64, k=128, h=2, w_out_in=True, **override):
        n = h * 192
        specs = {"x": ("bfloat16", [1, t, k]), "w": ("bfloat16", [1, n, k] if w_out_in else [1, k, n]),
                 "cos": ("bfloat16", [1, t, 64]), "sin": ("bfloat16", [1, t, 64]),
                 "row": ("float8_e4m3fn", [1, t, h, 192]), "row_scales": ("uint8", [1, t, h, 6]),
                 "col": ("float8_e4m3fn", [1, t, h, 192]), "col_scales": ("uint8", [1, t // 32, h, 192])}
        specs.update(override)
        return [(dtype, dims, 4096 * (i + 1)) for i, (dtype, dims) in enumerate(specs.values())]

    @parameterized.parameters(True, False)
    def test_well_formed(self, w_out_in):
        self.assertEqual(ext.check_proj_rope_buffers(self._buffers(w_out_in=w_out_in), w_out_in), ("", (64, 128, 2)))

    @parameterized.parameters(
        (dict(x=("float32", [1, 64, 128])), "x has shape .*expected bfloat16 .1, T, K."),
        (dict(x=("bfloat16", [1, 48, 128])), "x .*T a positive multiple of 32"),
        (dict(x=("bfloat16", [1, 64, 12])), "x .*K a positive multiple of 8"),
        (dict(w=("bfloat16", [1, 384, 64])), "w has shape .1, 384, 64.*with K = 128"),
        (dict(w=("bfloat16", [1, 200, 128])), "w .*H\\*192 output features"),
        (dict(cos=("bfloat16", [1, 64, 32])), "cos has shape .*expected bfloat16 .1, 64, 64."),
        (dict(row=("uint8", [1, 64, 2, 192])), "out_fp8_row .*float8_e4m3fn"),
        (dict(row_scales=("uint8", [1, 64, 2, 5])), "out_scales_row .*uint8 .1, 64, 2, 6."),
        (dict(col_scales=("uint8", [1, 64, 2, 192])), "out_scales_col .*uint8 .1, 2, 2, 192."),
    )
    def test_each_violation_is_named(self, override, message):
        why, _ = ext.check_proj_rope_buffers(self._buffers(**override), True)
        self.assertRegex(why, "^jbg_gemm_proj_rope_mxfp8: " + message)

    def test_misaligned_and_huge_buffers(self):
        specs = self._buffers()
        specs[1] = (specs[1][0], specs[1][1], 4096 + 8)
        self.assertRegex(ext.check_proj_rope_buffers(specs, True)[0], "w .*16-byte aligned")
        huge = self._buffers(t=65536, k=32768, h=1)
        self.assertRegex(ext.check_proj_rope_buffers(huge, True)[0], "x .*fewer than 2\\*\\*31 elements")


class DequantizeBufferCheckTest(parameterized.TestCase):
    """The dequantize execute stage's buffer checks (ffi/dequantize.cc), through the test hook."""

    @staticmethod
    def _buffers(shape=(1, 64, 1536), scale_axis=-1, **override):
        scale_shape = list(shape)
        scale_shape[scale_axis] //= 32
        specs = {"codes": ("float8_e4m3fn", list(shape)), "scales": ("uint8", scale_shape),
                 "out": ("bfloat16", list(shape))}
        specs.update(override)
        return [(dtype, dims, 4096 * (i + 1)) for i, (dtype, dims) in enumerate(specs.values())]

    @parameterized.parameters(((1, 64, 1536), -1, (64, 1536)), ((1, 1536, 384), -2, (1536, 384)),
                              ((96, 4128), -1, (96, 4128)), ((2, 32, 64), -2, (64, 64)))
    def test_well_formed(self, shape, axis, dims):
        """Leading dimensions fold into rows; scales are per 32 along the last (-1) or second-to-last (-2) axis."""
        self.assertEqual(ext.check_dequantize_buffers(self._buffers(shape, axis), axis), ("", (*dims, 0, 0)))

    def test_pair(self):
        """A second operand (codes1, scales1 after scales; out1 after out: FFI order) always has its scales along
        its last axis, whatever scale_axis says of operand 0; each of its buffers is checked and named, and the
        inputs and outputs must come as whole operands."""
        w = self._buffers((1, 1536, 384), -2)
        x = [(dtype, dims, address + 65536) for dtype, dims, address in self._buffers((1, 64, 1536), -1)]
        pair = lambda w, x: w[:2] + x[:2] + [w[2], x[2]]
        self.assertEqual(ext.check_dequantize_buffers(pair(w, x), -2, inputs=4), ("", (1536, 384, 64, 1536)))
        x_along_k = [(dtype, dims, address + 65536) for dtype, dims, address in self._buffers((1, 1536, 64), -2)]
        self.assertRegex(ext.check_dequantize_buffers(pair(w, x_along_k), -2, inputs=4)[0],
                         r"^jbg_dequantize_mxfp8: scales1 has shape \(1, 48, 64\).*expected uint8 \(1, 1536, 2\)")
        bad_out = x[:2] + [("bfloat16", [1, 32, 1536], x[2][2])]
        self.assertRegex(ext.check_dequantize_buffers(pair(w, bad_out), -2, inputs=4)[0],
                         r"out1 .*expected bfloat16 \(1, 64, 1536\)")
        odd = [(d, dims, a + 8 * (i == 0)) for i, (d, dims, a) in enumerate(x)]
        self.assertRegex(ext.check_dequantize_buffers(pair(w, odd), -2, inputs=4)[0], "codes1 .*16-byte aligned")
        for buffers, inputs in ((w[:2] + x[:2] + [w[2]], 4), (w[:2] + x[:1] + [w[2], x[2]], 3),
                                (w + [x[2]], 2)):
            self.assertRegex(ext.check_dequantize_buffers(buffers, -2, inputs=inputs)[0],
                             f"expected codes and scales with out, or also codes1 and scales1 with out1; got "
                             f"{inputs} inputs and {len(buffers) - inputs} outputs")

    @parameterized.parameters(
        (dict(codes=("bfloat16", [1, 64, 1536])), -1, "codes has shape .*expected float8_e4m3fn of rank >= 2"),
        (dict(codes=("float8_e4m3fn", [64])), -1, "codes .*rank >= 2"),
        (dict(codes=("float8_e4m3fn", [1, 64, 1520]), scales=("uint8", [1, 64, 47]),
              out=("bfloat16", [1, 64, 1520])), -1, "codes .*last dimension a positive multiple of 32"),
        (dict(codes=("float8_e4m3fn", [1, 48, 64]), scales=("uint8", [1, 1, 64]),
              out=("bfloat16", [1, 48, 64])), -2, "codes .*both last dimensions positive multiples of 32"),
        (dict(scales=("uint8", [1, 2, 1536])), -1, "scales has shape .1, 2, 1536.*expected uint8 .1, 64, 48."),
        (dict(scales=("float8_e4m3fn", [1, 64, 48])), -1, "scales .*expected uint8"),
        (dict(out=("float32", [1, 64, 1536])), -1, "out has shape .*expected bfloat16 .1, 64, 1536."),
        (dict(out=("bfloat16", [1, 32, 1536])), -1, "out .*expected bfloat16 .1, 64, 1536."),
    )
    def test_each_violation_is_named(self, override, axis, message):
        why, _ = ext.check_dequantize_buffers(self._buffers(scale_axis=axis, **override), axis)
        self.assertRegex(why, "^jbg_dequantize_mxfp8: " + message)

    def test_bad_axis_misaligned_and_huge_buffers(self):
        self.assertRegex(ext.check_dequantize_buffers(self._buffers(), 0)[0], "scale_axis must be -1 or -2, got 0")
        specs = self._buffers()
        specs[2] = (specs[2][0], specs[2][1], 4096 * 3 + 8)
        self.assertRegex(ext.check_dequantize_buffers(specs, -1)[0], "out .*16-byte aligned")
        huge = self._buffers(shape=(65536, 32768))
        self.assertRegex(ext.check_dequantize_buffers(huge, -1)[0], "codes .*fewer than 2\\*\\*31 elements")


F16 = "float16"
NVFP4 = dict(sf_dtype=E4M3, sf_vec_size=16)


def _ws_buffers(l, m, n, k, *, w=E4M3, c=BF16, sf=U8, v=32, atom=False, base=1 << 20):
    """Well-formed x, w, sw, c, amax, alpha for the weight_stream checks (packed FP4 rows when w is uint8);
    addresses 4096 apart."""
    kb = _cdiv(k, v)
    sw = [l, _cdiv(n, 128), _cdiv(kb, 4), 32, 4, 4] if atom else [l, n, kb]
    dims = [[l, m, k], [l, n, k // 2 if w == U8 else k], sw, [l, m, n], [l], [l]]
    dtypes = [BF16, w, sf, c, F32, F32]
    return [(d, s, base + 4096 * i) for i, (d, s) in enumerate(zip(dtypes, dims))]


class WeightStreamBufferCheckTest(parameterized.TestCase):
    """The jbg_weight_stream execute stage's buffer checks (ffi/weight_stream.cc), through the test hook."""

    @parameterized.parameters(
        (1, 1, 1, 16, E4M3, F32, False), (2, 16, 200, 96, E5M2, BF16, False), (3, 64, 7168, 7168, E4M3, F16, True),
        (1, 5, 129, 64, E5M2, F32, True))
    def test_well_formed_fp8(self, l, m, n, k, w, c, atom):
        """Compact scales give sf_atom 0, the 128x4 atom form 1; k is the logical K."""
        got = ext.check_weight_stream_buffers(_ws_buffers(l, m, n, k, w=w, c=c, atom=atom), w, c)
        self.assertEqual(got, ("", (m, n, k, l, int(atom))))

    @parameterized.parameters((False, False), (True, False), (False, True), (True, True))
    def test_well_formed_fp4(self, nvfp4, atom):
        """Packed FP4 codes (L, N, K/2) uint8: K counts codes; NVFP4 scales are float8_e4m3fn per 16."""
        l, m, n, k = 2, 3, 40, 96
        kwargs = dict(sf=E4M3, v=16) if nvfp4 else {}
        buffers = _ws_buffers(l, m, n, k, w=U8, atom=atom, **kwargs)
        got = ext.check_weight_stream_buffers(buffers, "float4_e2m1fn", BF16, **(NVFP4 if nvfp4 else {}))
        self.assertEqual(got, ("", (m, n, k, l, int(atom))))

    def test_each_violation_is_named(self):
        good = _ws_buffers(2, 16, 72, 160)
        fp4 = _ws_buffers(2, 16, 72, 160, w=U8)
        cases = [
            (good, _replace(good, 0, dtype=F32), r"x is float32 \(2, 16, 160\); expected bfloat16 activations"),
            (good, _replace(good, 0, dims=[16, 160]), r"x is .*expected rank 3 \(L, M, K\)"),
            (good, _replace(good, 0, dims=[2, 0, 160]), r"x is .*expected every dimension >= 1"),
            (good, _replace(good, 0, dims=[2, 65, 160]), r"x is bfloat16 \(2, 65, 160\); expected M <= 64"),
            (good, _replace(good, 0, dims=[2, 16, 152]), r"x is .*expected K a multiple of 16"),
            (fp4, _replace(fp4, 0, dims=[2, 16, 144]), r"x is .*expected K a multiple of 32 \(16-byte rows of packed"),
            (good, _replace(good, 1, dtype=E5M2), r"w is float8_e5m2 .*compiled for float8_e4m3fn codes"),
            (fp4, _replace(fp4, 1, dtype=E4M3), r"w is float8_e4m3fn .*compiled for float4_e2m1fn codes \(uint8"),
            (good, _replace(good, 1, dims=[2, 72, 80]), r"w is .*expected \(L, N, K\) = \(2, N >= 1, 160\)"),
            (fp4, _replace(fp4, 1, dims=[2, 72, 160]), r"w is uint8 .*expected \(L, N, K/2\) = \(2, N >= 1, 80\)"),
            (good, _replace(good, 1, dims=[1, 72, 160]), r"w is .*\(L, N, K\)"),
            (good, _replace(good, 2, dtype=E4M3), r"sw is float8_e4m3fn .*expected uint8 E8M0 scale bytes"),
            (good, _replace(good, 2, dims=[2, 72, 4]), r"sw is uint8 \(2, 72, 4\); expected the compact form "
                                                       r"\(2, 72, 5\) \(L, N, ceil\(K/32\)\)"),
            (good, _replace(good, 2, dims=[2, 1, 1, 32, 4, 4]), r"sw is .*expected the 128x4 atom form "
                                                               r"\(2, 1, 2, 32, 4, 4\)"),
            (good, _replace(good, 2, dims=[2, 72 * 5]), r"sw is .*expected rank 3, the compact form \(2, 72, 5\), or "
                                                       r"rank 6, the 128x4 atom form \(2, 1, 2, 32, 4, 4\)"),
            (good, _replace(good, 3, dtype=F32), r"c is float32 .*compiled for a bfloat16 C"),
            (good, _replace(good, 3, dims=[2, 72, 16]), r"c is .*expected \(2, 16, 72\) \(L, M, N\)"),
            (good, _replace(good, 4, dims=[1]), r"amax is float32 \(1,\); expected float32 \(2,\)"),
            (good, _replace(good, 4, dtype=BF16), r"amax is bfloat16 .*expected float32 \(2,\)"),
            (good, _replace(good, 5, dtype=U8), r"alpha is uint8 .*expected float32 \(2,\)"),
            (good, _replace(good, 5, address=(1 << 20) + 5 * 4096 + 4), r"alpha is .* at address .*; expected a "
                                                                       r"16-byte aligned pointer"),
            (good, _replace(good, 0, address=0), r"x is .* at address 0; expected a 16-byte aligned"),
        ]
        self.assertEqual(ext.check_weight_stream_buffers(good, E4M3, BF16)[0], "")
        self.assertEqual(ext.check_weight_stream_buffers(fp4, "float4_e2m1fn", BF16)[0], "")
        for base, buffers, message in cases:
            with self.subTest(message=message):
                w_dtype = "float4_e2m1fn" if base is fp4 else E4M3
                got, dims = ext.check_weight_stream_buffers(buffers, w_dtype, BF16)
                self.assertRegex(got, "^jbg_weight_stream: " + message)
                self.assertEqual(dims, (0, 0, 0, 0, 0))  # nothing to launch with

    def test_nvfp4_scales_must_be_e4m3(self):
        buffers = _ws_buffers(1, 2, 32, 64, w=U8, v=16)  # uint8 scales for an NVFP4 object
        self.assertRegex(ext.check_weight_stream_buffers(buffers, "float4_e2m1fn", BF16, **NVFP4)[0],
                         r"sw is uint8 .*expected float8_e4m3fn scales \(NVFP4\)")

    def test_capacity_is_the_attribute(self):
        """M is checked against the call site's max_m: 16 rows fit a capacity of 16, 17 do not."""
        self.assertEqual(ext.check_weight_stream_buffers(_ws_buffers(1, 16, 64, 64), E4M3, BF16, max_m=16)[0], "")
        self.assertRegex(ext.check_weight_stream_buffers(_ws_buffers(1, 17, 64, 64), E4M3, BF16, max_m=16)[0],
                         r"x is bfloat16 \(1, 17, 64\); expected M <= 16")

    def test_element_counts_fit_int32(self):
        """A weight of 2**31 codes is refused even though every dimension fits an int32."""
        message, _ = ext.check_weight_stream_buffers(_ws_buffers(1, 1, 1 << 16, 1 << 15), E4M3, BF16)
        self.assertRegex(message, r"^jbg_weight_stream: w is float8_e4m3fn \(1, 65536, 32768\); expected fewer than "
                                  r"2\*\*31 elements")

    @parameterized.parameters(
        (("float16", BF16, "float8_e8m0fnu", 32, 64), 'w_dtype "float16" is not supported'),
        ((E4M3, "float8_e4m3fn", "float8_e8m0fnu", 32, 64), 'c_dtype "float8_e4m3fn" is not supported; expected '
                                                            'float32, bfloat16 or float16'),
        ((E4M3, BF16, "float8_e4m3fn", 16, 64), 'sf_dtype "float8_e4m3fn" with sf_vec_size 16 is not supported for '
                                                'w_dtype float8_e4m3fn'),
        (("float4_e2m1fn", BF16, "float8_e8m0fnu", 16, 64), 'sf_dtype "float8_e8m0fnu" with sf_vec_size 16 is not '
                                                            'supported'),
        (("float4_e2m1fn", BF16, "float8_e4m3fn", 32, 64), 'sf_dtype "float8_e4m3fn" with sf_vec_size 32 is not '
                                                           'supported'),
        ((E4M3, BF16, "float8_e8m0fnu", 32, 0), "max_m 0 is not supported"),
        ((E4M3, BF16, "float8_e8m0fnu", 32, 16, -1), "amax_batches -1 is not supported; expected L"))
    def test_attributes_are_refused_by_name(self, args, message):
        with self.assertRaisesRegex(ValueError, "^jbg_weight_stream attributes: " + message):
            ext.parse_weight_stream_attributes(*args)

    def test_attributes_map_to_buffer_dtypes(self):
        """FP4 weights travel as uint8, E8M0 scales as uint8, NVFP4's as float8_e4m3fn (XLA FFI dtype codes)."""
        u8, f32, bf16, f16, e4m3 = 6, 11, 16, 10, 20
        self.assertEqual(ext.parse_weight_stream_attributes(E4M3, F32, "float8_e8m0fnu", 32, 16), (e4m3, f32, u8))
        self.assertEqual(ext.parse_weight_stream_attributes("float4_e2m1fn", F16, E4M3, 16, 64), (u8, f16, e4m3))
        self.assertEqual(ext.parse_weight_stream_attributes("float4_e2m1fn", BF16, "float8_e8m0fnu", 32, 64)[:2],
                         (u8, bf16))


class ModuleTest(absltest.TestCase):

    def test_surface(self):
        self.assertEqual(ext.ABI_VERSION, 2)  # 2: sm_100a gemm_amax objects take max_ctas
        self.assertEqual(ext.GEMM_AMAX_TARGET, "jbg_gemm_amax")
        self.assertEqual(ext.PROJ_ROPE_TARGET, "jbg_gemm_proj_rope_mxfp8")
        targets = ext.ffi_targets()
        self.assertEqual(ext.DEQUANTIZE_TARGET, "jbg_dequantize_mxfp8")
        self.assertEqual(ext.WEIGHT_STREAM_TARGET, "jbg_weight_stream")
        self.assertEqual(ext.RAGGED_TARGET, "jbg_ragged_gemm_amax")
        self.assertEqual(ext.CONTRACTION_TARGET, "jbg_grouped_contraction")
        self.assertEqual(ext.QUANTIZE_PAIR_TARGET, "jbg_quantize_pair")
        for name in ("GEMM_AMAX_TARGET", "PROJ_ROPE_TARGET", "DEQUANTIZE_TARGET", "WEIGHT_STREAM_TARGET",
                     "RAGGED_TARGET", "CONTRACTION_TARGET", "QUANTIZE_PAIR_TARGET"):
            self.assertEqual(getattr(_native, name), getattr(ext, name), name)  # the lowering names what C++ registers
        self.assertEqual(set(targets), {"jbg_gemm_amax", "jbg_gemm_proj_rope_mxfp8", "jbg_dequantize_mxfp8",
                                        "jbg_weight_stream", "jbg_ragged_gemm_amax", "jbg_grouped_contraction",
                                        "jbg_quantize_pair"})
        for stages in targets.values():
            self.assertEqual(set(stages), {"instantiate", "execute"})
        self.assertEqual(set(ext.ffi_types()["jbg_kernel_objects"]), {"type_id", "type_info"})

    def test_execute_handler_is_command_buffer_compatible(self):
        for target in ("jbg_gemm_proj_rope_mxfp8", "jbg_dequantize_mxfp8", "jbg_weight_stream",
                       "jbg_ragged_gemm_amax", "jbg_grouped_contraction", "jbg_quantize_pair"):
            _, _, traits = ext.handler_metadata(target, "execute")
            self.assertEqual(traits & ext.TRAIT_COMMAND_BUFFER_COMPATIBLE, ext.TRAIT_COMMAND_BUFFER_COMPATIBLE)
        major, minor, traits = ext.handler_metadata("jbg_gemm_amax", "execute")
        self.assertEqual(traits & ext.TRAIT_COMMAND_BUFFER_COMPATIBLE, ext.TRAIT_COMMAND_BUFFER_COMPATIBLE)
        self.assertEqual(ext.TRAIT_COMMAND_BUFFER_COMPATIBLE, 1)
        self.assertGreaterEqual(major * 1000 + minor, 1)  # a real FFI API version, not an untouched struct

    def test_unknown_target_or_stage(self):
        with self.assertRaisesRegex(ValueError, "unknown FFI target"):
            ext.handler_metadata("nope", "execute")
        with self.assertRaisesRegex(ValueError, "unknown stage"):
            ext.handler_metadata("jbg_gemm_amax", "prepare")

    def test_register_for_cuda_without_gpu_is_idempotent(self):
        _native.register_ffi_targets()
        _native.register_ffi_targets()
        self.assertIn("CUDA", _native._REGISTERED)

    def test_runtime_library_found_and_loadable(self):
        path = _native.runtime_library_path()
        if path is None:
            self.skipTest("nvidia-cutlass-dsl is not installed")
        self.assertEqual(path.name, "libcute_dsl_runtime.so")
        self.assertEqual(_native.load_runtime(), path)
        self.assertEqual(ext.runtime_path(), str(path))

    def test_runtime_env_override(self):
        old = os.environ.get(_native.RUNTIME_ENV)
        os.environ[_native.RUNTIME_ENV] = "/some/where/libcute_dsl_runtime.so"
        try:
            self.assertEqual(str(_native.runtime_library_path()), "/some/where/libcute_dsl_runtime.so")
        finally:
            if old is None:
                del os.environ[_native.RUNTIME_ENV]
            else:
                os.environ[_native.RUNTIME_ENV] = old


class ArchTest(parameterized.TestCase):

    @parameterized.parameters(("sm_90a", (9, 0)), ("sm_100a", (10, 0)), ("sm_120f", (12, 0)), ("sm_89", (8, 9)))
    def test_parse(self, arch, cc):
        self.assertEqual(ext.parse_arch(arch), cc)

    @parameterized.parameters("sm90a", "sm_9", "sm_90ab", "sm_90x", "compute_90a", "", "sm_1000a")
    def test_reject(self, arch):
        with self.assertRaises(ValueError):
            ext.parse_arch(arch)


class ObjectTableTest(absltest.TestCase):

    def test_two_archs(self):
        table = ext.parse_object_table("sm_90a,sm_100a", "p90,p100", 300, [0, 120, 300])
        self.assertEqual(table, [("sm_90a", "p90", 9, 0, 0, 120), ("sm_100a", "p100", 10, 0, 120, 300)])

    def test_mismatches_are_named(self):
        cases = [
            (("", "", 0, [0]), "archs is empty"),
            (("sm_90a,sm_100a", "p90", 10, [0, 5, 10]), "one prefix per arch"),
            (("sm_90a", "p90", 10, [0, 10, 10]), "offsets has 3 entries; expected 2"),
            (("sm_90a", "p90", 10, [0, 9]), r"end at the size of objects \(10\)"),
            (("sm_90a,sm_100a", "a,b", 10, [0, 0, 10]), "object for sm_90a is empty"),
            (("sm_90a,sm_100a", "a,b", 10, [0, 11, 10]), "object for sm_100a is empty"),
            (("sm90,sm_100a", "a,b", 10, [0, 5, 10]), 'arch "sm90" is not of the form'),
            (("sm_90a,sm_100a", "a,", 10, [0, 5, 10]), "function prefix for sm_100a is empty"),
        ]
        for args, message in cases:
            with self.subTest(args=args):
                with self.assertRaisesRegex(ValueError, message):
                    ext.parse_object_table(*args)


class BufferCheckTest(parameterized.TestCase):

    @parameterized.parameters((1, 128, 128, 128, E4M3, F32), (3, 200, 72, 160, E5M2, BF16), (2, 1, 1, 16, E4M3, BF16),
                              (1, 257, 129, 4112, E4M3, F32))
    def test_well_formed(self, l, m, n, k, ab, c):
        message, dims = ext.check_gemm_amax_buffers(_buffers(l, m, n, k, ab=ab, c=c))
        self.assertEqual(message, "")
        self.assertEqual(dims, (m, n, k, l))

    def test_each_violation_is_named(self):
        good = _buffers(2, 200, 72, 160)
        kp = 2  # ceil(ceil(160/32)/4)
        cases = [
            (_replace(good, 0, dtype=BF16), r"a is bfloat16 \(2, 200, 160\); expected float8_e4m3fn or float8_e5m2"),
            (_replace(good, 1, dtype=E5M2), r"b is float8_e5m2 .*expected the dtype of a \(float8_e4m3fn\)"),
            (_replace(good, 2, dtype="int32"), "sfa is .*expected uint8"),
            (_replace(good, 4, dtype="int32"), "c is .*expected float32, bfloat16, float16"),
            (_replace(good, 5, dtype=BF16), "amax is bfloat16 .*expected float32"),
            (_replace(good, 0, dims=[200, 160]), r"a is .*expected rank 3 \(L, M, K\)"),
            (_replace(good, 1, dims=[2, 72, 128]), r"b is .*expected \(L, N, K\) = \(2, N >= 1, 160\)"),
            (_replace(good, 1, dims=[1, 72, 160]), r"b is .*expected \(L, N, K\)"),
            (_replace(good, 2, dims=[2, 1, kp, 32, 4, 4]), r"sfa is uint8 \(2, 1, 2, 32, 4, 4\); expected "
                                                           r"\(2, 2, 2, 32, 4, 4\)"),
            (_replace(good, 3, dims=[2, 1, kp, 4, 32, 4]), r"sfb is .*expected \(2, 1, 2, 32, 4, 4\)"),
            (_replace(good, 4, dims=[2, 72, 200]), r"c is .*expected \(2, 200, 72\) \(L, M, N\)"),
            (_replace(good, 5, dims=[1]), r"amax is float32 \(1,\); expected \(2,\)"),
            (_replace(good, 4, address=(1 << 20) + 1032), "c is .* at address .*; expected a 16-byte aligned"),
            (_replace(good, 0, address=0), "a is .* at address 0; expected a 16-byte aligned"),
        ]
        for buffers, message in cases:
            with self.subTest(message=message):
                got, _ = ext.check_gemm_amax_buffers(buffers)
                self.assertRegex(got, "^jbg_gemm_amax: " + message)

    def test_k_must_be_a_multiple_of_16(self):
        message, _ = ext.check_gemm_amax_buffers(_buffers(1, 64, 64, 40))
        self.assertRegex(message, "a is .*K a multiple of 16")

    def test_element_counts_fit_int32(self):
        message, _ = ext.check_gemm_amax_buffers(_buffers(1, 1 << 16, 1 << 15, 16))
        self.assertRegex(message, r"c is float32 \(1, 65536, 32768\); expected fewer than 2\*\*31 elements")


    def test_a_kernel_storing_c_by_tma_takes_16_byte_rows_only(self):
        """N = 130 (520-byte f32 rows) passes the Hopper kernels' checks; a kernel that takes its grid size stores
        C by TMA and is refused it, while N = 132 (f32) and 136 (bf16) pass both."""
        odd = _buffers(1, 64, 130, 32)
        self.assertEqual(ext.check_gemm_amax_buffers(odd)[0], "")
        self.assertRegex(ext.check_gemm_amax_buffers(odd, c_rows_16_bytes=True)[0],
                         r"^jbg_gemm_amax: c is float32 \(1, 64, 130\); expected rows of a multiple of 16 bytes "
                         r"\(N a multiple of 4\)")
        self.assertRegex(ext.check_gemm_amax_buffers(_buffers(1, 64, 132, 32, c=BF16), c_rows_16_bytes=True)[0],
                         r"c is bfloat16 .*\(N a multiple of 8\)")
        for n, c in ((132, F32), (136, BF16)):
            self.assertEqual(ext.check_gemm_amax_buffers(_buffers(1, 64, n, 32, c=c), c_rows_16_bytes=True),
                             ("", (64, n, 32, 1)))


class GridTest(absltest.TestCase):
    """The persistent grid instantiation passes to the sm_100a gemm_amax kernels (max_ctas) and its attribute."""

    def test_whole_clusters_no_more_than_fit_at_least_one(self):
        self.assertEqual(ext.grid_ctas(148, 1, 0), 148)  # B200, no cluster: one CTA per SM
        self.assertEqual(ext.grid_ctas(148, 4, 0), 148)  # the SM bound when the driver cannot say: 37 clusters
        self.assertEqual(ext.grid_ctas(148, 16, 0), 144)  # 9 whole clusters of 16
        self.assertEqual(ext.grid_ctas(148, 4, 35), 140)  # GPCs that fit 35 clusters of 4: no waiting cluster
        self.assertEqual(ext.grid_ctas(148, 2, 80), 148)  # an answer above the SM bound changes nothing
        self.assertEqual(ext.grid_ctas(4, 4, 0), 4)  # JAX_BLOCKGEMM_SM_LIMIT=4: one cluster walks every tile
        self.assertEqual(ext.grid_ctas(1, 16, 0), 16)  # a limit below one cluster still launches one

    def test_sm_limit_is_a_positive_count_or_unset(self):
        """JAX_BLOCKGEMM_SM_LIMIT as instantiation reads it: unset or empty is no limit; anything but a positive
        integer is refused (a test that set it must not run on every SM believing it ran on fewer)."""
        for text, want in ((None, 0), ("", 0), ("4", 4), ("114", 114)):
            self.assertEqual(ext.parse_sm_limit(text), want, text)
        for text in ("0", "-3", "12x", " 8", "abc", "99999999999"):
            with self.assertRaisesRegex(ValueError, f'^JAX_BLOCKGEMM_SM_LIMIT="{re.escape(text)}" is not a count of '
                                                    "SMs; expected a positive integer"):
                ext.parse_sm_limit(text)

    def test_cluster_ctas_attribute(self):
        self.assertEqual(ext.check_cluster_ctas([0, 4], 2), "")
        self.assertEqual(ext.check_cluster_ctas([16], 1), "")
        self.assertRegex(ext.check_cluster_ctas([0, 4], 1), "cluster_ctas has 2 entries; expected one per object")
        self.assertRegex(ext.check_cluster_ctas([-1], 1), "entry 0 is -1; expected 0 .* 1 to 16")
        self.assertRegex(ext.check_cluster_ctas([0, 17], 2), "entry 1 is 17")


class KernelAbiTest(absltest.TestCase):
    """The catalog's exported kernel takes exactly the arguments the handler passes (see BUILD.md)."""

    def _exported(self, catalog, variant) -> tuple[str, list[str], str]:
        """The C header CuTeDSL exports for `variant`'s object: the header, the names of its tensor structs in
        order, and the wrapper function's parameter list."""
        directory = tempfile.mkdtemp(prefix="jbg_abi_")
        self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
        catalog.compile_function(variant).export_to_c(directory, "kernel", function_prefix=variant.function_prefix)
        header = (pathlib.Path(directory) / "kernel.h").read_text()
        prefix = variant.function_prefix
        structs = re.findall(r"typedef struct \{\s*void \*data;\s*int64_t dynamic_shapes\[1\];\s*\} "
                             + prefix + r"_Tensor_(\w+)_t;", header)
        wrapper = re.search(r"cute_dsl_" + prefix + r"_wrapper\((.*?)\)", header).group(1)
        return header, structs, wrapper

    def test_exported_signature_matches_the_handler(self):
        try:
            from jax_blockgemm.kernels import catalog
        except ImportError as e:
            self.skipTest(f"CuTeDSL is not importable: {e}")
        header, structs, wrapper = self._exported(catalog, catalog.CATALOG[0])
        self.assertEqual(structs, ["a", "b", "sfa", "sfb", "c", "amax"], header)
        params = [p.strip().split()[-1].lstrip("*") for p in wrapper.split(",")][1:]  # drop the module handle
        self.assertEqual(params, ["a", "b", "sfa", "sfb", "c", "amax", "m", "n", "k", "l", "stream"])
        self.assertRegex(wrapper, r"int32_t m, int32_t n, int32_t k, int32_t l, cudaStream_t stream$")
        self.assertRegex(header, r"void \*args\[12\] = \{\s*a, b, sfa, sfb, c, amax, &m, &n, &k, &l, &stream,\s*&ret")

    def test_weight_stream_exports_what_its_handler_passes(self):
        """The decode kernel's object takes x, w, sw, c, amax, alpha, tally, m, n, k, l, sf_atom, stream and the
        status slot: the 14 arguments ffi/weight_stream.cc fills (compiled here for sm_90a, NVFP4, the 64-row tile)."""
        try:
            from jax_blockgemm.kernels import catalog
        except ImportError as e:
            self.skipTest(f"CuTeDSL is not importable: {e}")
        import decode_standin

        if decode_standin.real_class() is None:
            self.skipTest(decode_standin.MISSING)
        variant = catalog.select_variant(op="weight_stream", arch="sm_90a", ab_dtype="float4_e2m1fn",
                                         c_dtype="bfloat16", sf_vec_size=16, sf_dtype="float8_e4m3fn",
                                         tile_mn=(32, 64), cluster_mn=(1, 1))
        header, structs, wrapper = self._exported(catalog, variant)
        self.assertEqual(structs, ["x", "w", "sw", "c", "amax", "alpha", "tally"], header)
        self.assertRegex(wrapper, r"int32_t m, int32_t n, int32_t k, int32_t l, int32_t sf_atom, cudaStream_t stream$")
        self.assertRegex(header, r"void \*args\[14\] = \{\s*x, w, sw, c, amax, alpha, tally, &m, &n, &k, &l, "
                                 r"&sf_atom, &stream,\s*&ret")


_XLA_PROBE = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax_blockgemm import _native
    jax.devices()  # start the CPU client so that the registrations below reach XLA now
    _native.register_ffi_targets(platform="cpu")
    ext = _native.extension()
    print("TYPE_ID", ext.state_type_id())
    print("INSTANTIATE_TRAITS", ext.handler_metadata("jbg_gemm_amax", "instantiate")[2])
    l, m, n, k = 1, 200, 72, 160
    ops = (jnp.zeros((l, m, k), jnp.float8_e4m3fn), jnp.zeros((l, n, k), jnp.float8_e4m3fn),
           jnp.zeros((l, 2, 2, 32, 4, 4), jnp.uint8), jnp.zeros((l, 1, 2, 32, 4, 4), jnp.uint8))
    out = (jax.ShapeDtypeStruct((l, m, n), jnp.float32), jax.ShapeDtypeStruct((l,), jnp.float32))
    blob = np.random.default_rng(0).integers(0, 256, 300_001, dtype=np.uint8)  # a large array attribute
    cases = (("GOOD", [0, 1000, 300_001], [0, 4]), ("BAD", [0, 1000, 7], [0, 4]),
             ("BADCLUSTERS", [0, 1000, 300_001], [0]), ("BIGCLUSTER", [0, 1000, 300_001], [0, 32]))
    for name, offsets, clusters in cases:
        call = jax.ffi.ffi_call("jbg_gemm_amax", out)
        f = jax.jit(lambda *x: call(*x, archs="sm_90a,sm_100a", function_prefixes="p90,p100", objects=blob,
                                    offsets=np.array(offsets, np.int64), ab_dtype="float8_e4m3fn",
                                    c_dtype="float32", sf_dtype="float8_e8m0fnu", sf_vec_size=32, a_major="k",
                                    b_major="k", cluster_ctas=np.array(clusters, np.int64)))
        try:
            f(*ops)
            print(name, "RAN")
        except Exception as e:
            print(name, " ".join(str(e).split())[:500])
    x, w = jnp.zeros((1, 4, 64), jnp.bfloat16), jnp.zeros((1, 32, 64), jnp.float8_e4m3fn)
    sw, alpha = jnp.zeros((1, 32, 2), jnp.uint8), jnp.ones((1,), jnp.float32)
    out = (jax.ShapeDtypeStruct((1, 4, 32), jnp.bfloat16), jax.ShapeDtypeStruct((1,), jnp.float32))
    for name, w_dtype, max_m, batches in (("WS_GOOD", "float8_e4m3fn", 16, 1), ("WS_BADW", "float16", 16, 1),
                                          ("WS_BADM", "float8_e4m3fn", 0, 1), ("WS_BADL", "float8_e4m3fn", 16, -1)):
        call = jax.ffi.ffi_call("jbg_weight_stream", out)
        f = jax.jit(lambda *x: call(*x, archs="sm_90a", function_prefixes="p90", objects=blob[:1000],
                                    offsets=np.array([0, 1000], np.int64), w_dtype=w_dtype, c_dtype="bfloat16",
                                    sf_dtype="float8_e8m0fnu", sf_vec_size=np.int64(32), max_m=np.int64(max_m),
                                    amax_batches=np.int64(batches)))
        try:
            f(x, w, sw, alpha)
            print(name, "RAN")
        except Exception as e:
            print(name, " ".join(str(e).split())[:500])
""")


class XlaRegistrationTest(absltest.TestCase):
    """Registers the real handlers with XLA:CPU (in a fresh process) so that XLA runs the instantiate stage."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.output, cls.lines = xla_probe.run(_XLA_PROBE)

    def test_state_type_registered_before_handler(self):
        self.assertGreater(int(self.lines["TYPE_ID"]), 0, self.output)
        self.assertEqual(int(self.lines["INSTANTIATE_TRAITS"]) & 1, 1, self.output)

    def test_instantiate_receives_attributes(self):
        # Well-formed attributes (a 300 kB uint8 array included) pass parsing and reach the device query, which
        # fails on a machine without a CUDA driver or GPU; malformed ones are rejected by the parser.
        good = self.lines.get("GOOD", self.output)
        self.assertNotIn("RAN", good)
        self.assertNotIn("attributes", good)
        self.assertRegex(good, r"jbg_gemm_amax: (cannot load the CUDA driver|cuInit failed|cuDeviceGetCount|no kernel)")
        self.assertRegex(self.lines.get("BAD", self.output),
                         r"INVALID_ARGUMENT: jbg_gemm_amax attributes: offsets must start at 0 and end at the size of "
                         r"objects \(300001\), got 0 \.\. 7")
        self.assertRegex(self.lines.get("BADCLUSTERS", self.output),
                         r"INVALID_ARGUMENT: jbg_gemm_amax attributes: cluster_ctas has 1 entries; expected one per "
                         r"object \(2\)")
        self.assertRegex(self.lines.get("BIGCLUSTER", self.output),
                         r"INVALID_ARGUMENT: jbg_gemm_amax attributes: cluster_ctas entry 1 is 32; expected 0 \(no "
                         r"grid size\) or the CTAs of a cluster, 1 to 16")

    def test_weight_stream_instantiate_parses_its_attributes(self):
        """jbg_weight_stream's instantiate stage reads its own attributes: well-formed ones reach the device query,
        a w_dtype, max_m or amax_batches it cannot take is an INVALID_ARGUMENT naming it."""
        good = self.lines.get("WS_GOOD", self.output)
        self.assertNotIn("RAN", good)
        self.assertRegex(good, r"jbg_weight_stream: (cannot load the CUDA driver|cuInit failed|cuDeviceGetCount|no "
                               r"kernel)")
        self.assertRegex(self.lines.get("WS_BADW", self.output),
                         r'INVALID_ARGUMENT: jbg_weight_stream attributes: w_dtype "float16" is not supported')
        self.assertRegex(self.lines.get("WS_BADM", self.output),
                         r"INVALID_ARGUMENT: jbg_weight_stream attributes: max_m 0 is not supported")
        self.assertRegex(self.lines.get("WS_BADL", self.output),
                         r"INVALID_ARGUMENT: jbg_weight_stream attributes: amax_batches -1 is not supported; "
                         r"expected L")


if __name__ == "__main__":
    absltest.main()
