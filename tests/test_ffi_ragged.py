"""The jbg_ragged_gemm_amax bridge on a CPU machine: the handler's attribute parsing and buffer checks (ffi/ragged.cc,
through the module's test hooks), its registration with XLA, and emit_ragged's custom call lowered for CUDA."""

import dataclasses
import textwrap
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.extend import core as jex_core
from jax.interpreters import mlir

from jax_blockgemm import _native, ffi_lowering, kernel_cache

import lowered_calls
import xla_probe

ext = _native.extension()

U8, I32, F32, BF16, F16, E4M3, E5M2 = "uint8", "int32", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"
FP4, E8M0, NONE = "float4_e2m1fn", "float8_e8m0fnu", "none"
NVFP4 = dict(sf_dtype=E4M3, sf_vec_size=16)
NO_SCALES = dict(sf_dtype=NONE, sf_vec_size=0)  # the bf16 objects' (catalog.NO_SCALES)
# XLA FFI dtype codes (xla/ffi/api/c_api.h).
CODE = {U8: 6, I32: 4, F32: 11, BF16: 16, F16: 10, E4M3: 20, E5M2: 19}


def _cdiv(x, y):
    return -(-x // y)


def _buffers(l, t, n, k, g, max_items, *, ab=E4M3, c=F32, sf=U8, v=32, base=1 << 20):
    """Well-formed (dtype, dims, address) for a, b, sfa, sfb, items, c, amax, alpha (packed FP4 rows when ab is
    uint8, a packed FP4 C when c is uint8); addresses 4096 apart."""
    row = k // 2 if ab == U8 else k
    k_atoms = _cdiv(_cdiv(k, v), 4)
    dims = [[l, t, row], [l, g, n, row], [l, _cdiv(t, 128), k_atoms, 32, 4, 4],
            [l * g, _cdiv(n, 128), k_atoms, 32, 4, 4], [l, max_items, 4], [l, t, n // 2 if c == U8 else n], [l], [l]]
    dtypes = [ab, ab, sf, sf, I32, c, F32, F32]
    return [(d, s, base + 4096 * i) for i, (d, s) in enumerate(zip(dtypes, dims))]


def _bf16_buffers(l, t, n, k, g, max_items, *, b_major="k", c=F32, base=1 << 20):
    """Well-formed buffers for the bf16 objects: bfloat16 a (L, T, K) and b (L, G, N, K) (b_major "k") or (L, G, K,
    N) ("n"); sfa and sfb empty uint8 at address 0 (sfa (0,), sfb (L*G, 0): any shape of zero elements)."""
    out = _buffers(l, t, n, k, g, max_items, ab=BF16, c=c, base=base)
    out = _replace(_replace(out, 2, dims=[0], address=0), 3, dims=[l * g, 0], address=0)
    return _replace(out, 1, dims=[l, g, k, n]) if b_major == "n" else out


def _replace(buffers, index, *, dtype=None, dims=None, address=None):
    out = list(buffers)
    d, s, p = out[index]
    out[index] = (dtype or d, s if dims is None else dims, p if address is None else address)
    return out


class RaggedAttributesTest(parameterized.TestCase):
    """The instantiate stage's attribute parsing: the sm_90a ragged kernel's formats, named by the catalog."""

    @parameterized.parameters(
        ((E4M3, F32, E8M0, 32), (CODE[E4M3], CODE[F32], CODE[U8], 32, False, False)),
        ((E5M2, BF16, E8M0, 32), (CODE[E5M2], CODE[BF16], CODE[U8], 32, False, False)),
        ((E4M3, E5M2, E8M0, 32), (CODE[E4M3], CODE[E5M2], CODE[U8], 32, False, False)),
        ((FP4, F16, E8M0, 32), (CODE[U8], CODE[F16], CODE[U8], 32, True, False)),
        ((FP4, FP4, E4M3, 16), (CODE[U8], CODE[U8], CODE[E4M3], 16, True, True)),
        ((E4M3, FP4, E8M0, 32), (CODE[E4M3], CODE[U8], CODE[U8], 32, False, True)))
    def test_attributes_map_to_buffer_dtypes(self, args, want):
        """FP4 codes and an FP4 C travel as uint8, E8M0 scales as uint8, NVFP4's as float8_e4m3fn; every object
        takes alpha; none of these is bfloat16 or N-major (b_major defaults to "k")."""
        self.assertEqual(ext.parse_ragged_attributes(*args), (*want, True, False, False, False))
        self.assertEqual(ext.parse_ragged_attributes(*args, b_major="k"), (*want, True, False, False, False))

    @parameterized.parameters((F32, "k"), (F32, "n"), (BF16, "k"), (BF16, "n"))
    def test_bf16_attributes(self, c, b_major):
        """bfloat16 operands with no scales ("none", 0): sfa and sfb are (empty) uint8; b K- or N-major; the objects
        take alpha all the same (passed, unused)."""
        self.assertEqual(ext.parse_ragged_attributes(BF16, c, NONE, 0, b_major),
                         (CODE[BF16], CODE[c], CODE[U8], 0, False, False, True, True, b_major == "n", False))

    @parameterized.parameters(
        (("float16", F32, E8M0, 32), 'ab_dtype "float16" is not supported; expected float8_e4m3fn, float8_e5m2, '
                                     'float4_e2m1fn or bfloat16'),
        (("uint8", F32, E8M0, 32), 'ab_dtype "uint8" is not supported'),
        ((E4M3, "int32", E8M0, 32), 'c_dtype "int32" is not supported; expected float32, bfloat16, float16, '
                                    'float8_e4m3fn, float8_e5m2 or float4_e2m1fn'),
        ((E4M3, F32, E4M3, 16), 'sf_dtype "float8_e4m3fn" with sf_vec_size 16 is not supported for ab_dtype '
                                'float8_e4m3fn; expected float8_e8m0fnu with 32, or \\(float4_e2m1fn codes only\\) '
                                'float8_e4m3fn with 16'),
        ((E4M3, F32, E8M0, 16), 'sf_dtype "float8_e8m0fnu" with sf_vec_size 16 is not supported'),
        ((FP4, F32, E8M0, 16), 'sf_dtype "float8_e8m0fnu" with sf_vec_size 16 is not supported for ab_dtype '
                               'float4_e2m1fn'),
        ((FP4, F32, E4M3, 32), 'sf_dtype "float8_e4m3fn" with sf_vec_size 32 is not supported'),
        ((FP4, F32, "bfloat16", 32), 'sf_dtype "bfloat16" with sf_vec_size 32 is not supported'),
        # bfloat16 operands take no scales, a float32 or bfloat16 C; "none" with 0 belongs to them only.
        ((BF16, F32, E8M0, 32), 'sf_dtype "float8_e8m0fnu" with sf_vec_size 32 is not supported for ab_dtype '
                                'bfloat16; expected none with 0 \\(bfloat16 operands carry no scales\\)'),
        ((BF16, F32, NONE, 32), 'sf_dtype "none" with sf_vec_size 32 is not supported for ab_dtype bfloat16'),
        ((BF16, F32, E4M3, 16, "n"), 'sf_dtype "float8_e4m3fn" with sf_vec_size 16 is not supported for ab_dtype '
                                     'bfloat16'),
        ((BF16, F16, NONE, 0), 'c_dtype "float16" is not supported for ab_dtype bfloat16; expected float32 or '
                               'bfloat16'),
        ((BF16, E4M3, NONE, 0), 'c_dtype "float8_e4m3fn" is not supported for ab_dtype bfloat16; expected float32 '
                                'or bfloat16'),
        ((BF16, FP4, NONE, 0, "n"), 'c_dtype "float4_e2m1fn" is not supported for ab_dtype bfloat16'),
        ((E4M3, F32, NONE, 0), 'sf_dtype "none" with sf_vec_size 0 is not supported for ab_dtype float8_e4m3fn; '
                               'expected float8_e8m0fnu with 32, or \\(float4_e2m1fn codes only\\) float8_e4m3fn '
                               'with 16 \\(none with 0 is for bfloat16 operands only\\)'),
        ((FP4, F32, NONE, 0), 'sf_dtype "none" with sf_vec_size 0 is not supported for ab_dtype float4_e2m1fn'),
        ((E4M3, F32, E8M0, 0), 'sf_dtype "float8_e8m0fnu" with sf_vec_size 0 is not supported'),
        # b_major: "k" or "n", and "n" for bfloat16 operands only.
        ((E4M3, F32, E8M0, 32, "n"), 'b_major "n" is not supported for ab_dtype float8_e4m3fn; expected k \\(only '
                                     'bfloat16 operands take an N-major b\\)'),
        ((FP4, FP4, E4M3, 16, "n"), 'b_major "n" is not supported for ab_dtype float4_e2m1fn; expected k'),
        ((BF16, F32, NONE, 0, "m"), 'b_major "m" is not supported; expected k or n'),
        ((E4M3, F32, E8M0, 32, ""), 'b_major "" is not supported; expected k or n'),
        ((BF16, F32, NONE, 0, "N"), 'b_major "N" is not supported; expected k or n'))
    def test_attributes_are_refused_by_name(self, args, message):
        with self.assertRaisesRegex(ValueError, "^jbg_ragged_gemm_amax attributes: " + message):
            ext.parse_ragged_attributes(*args)

    def test_amax_batches_is_a_count(self):
        for amax_batches in (0, 1, 7):
            ext.check_ragged_amax_batches(amax_batches)
        for amax_batches in (-1, 2**31):
            with self.assertRaisesRegex(ValueError, f"^jbg_ragged_gemm_amax attributes: amax_batches {amax_batches} "
                                                    "is not supported; expected L"):
                ext.check_ragged_amax_batches(amax_batches)


class RaggedBufferCheckTest(parameterized.TestCase):
    """The execute stage's buffer checks (ffi/ragged.cc), through the test hook."""

    @parameterized.parameters(
        (1, 1, 1, 16, 1, 1, E4M3, F32), (2, 200, 72, 160, 3, 5, E5M2, BF16), (3, 129, 300, 4096, 8, 10, E4M3, F16),
        (1, 64, 30, 96, 2, 3, E4M3, E4M3), (2, 256, 64, 128, 4, 6, E5M2, E5M2), (1, 7, 40, 64, 3, 4, E4M3, U8))
    def test_well_formed_fp8(self, l, t, n, k, g, max_items, ab, c):
        """The dims are (t, n, k, l, g, max_items, sf_atom): G from b, max_items from items; sf_atom 0 (only the
        swap_ab objects take a second form of sfb)."""
        c_dtype = FP4 if c == U8 else c
        got = ext.check_ragged_buffers(_buffers(l, t, n, k, g, max_items, ab=ab, c=c), ab, c_dtype)
        self.assertEqual(got, ("", (t, n, k, l, g, max_items, 0)))

    @parameterized.parameters((False, F32), (True, BF16), (False, U8), (True, U8))
    def test_well_formed_fp4(self, nvfp4, c):
        """Packed FP4 codes (L, T, K/2) and (L, G, N, K/2) uint8: k counts codes; NVFP4 scales are float8_e4m3fn
        per 16."""
        l, t, n, k, g = 2, 130, 48, 96, 3
        kwargs = dict(sf=E4M3, v=16) if nvfp4 else {}
        buffers = _buffers(l, t, n, k, g, 4, ab=U8, c=c, **kwargs)
        got = ext.check_ragged_buffers(buffers, FP4, FP4 if c == U8 else c, **(NVFP4 if nvfp4 else {}))
        self.assertEqual(got, ("", (t, n, k, l, g, 4, 0)))

    def test_each_violation_is_named(self):
        good = _buffers(2, 200, 72, 160, 3, 5)  # sfa (2, 2, 2, 32, 4, 4), sfb (6, 1, 2, 32, 4, 4)
        fp4 = _buffers(2, 200, 72, 160, 3, 5, ab=U8)
        fp4_c = _buffers(2, 200, 72, 160, 3, 5, c=U8)
        cases = [
            (good, _replace(good, 0, dtype=E5M2), r"a is float8_e5m2 \(2, 200, 160\); the kernel objects were "
                                                  r"compiled for float8_e4m3fn codes"),
            (good, _replace(good, 0, dtype=U8), r"a is uint8 .*compiled for float8_e4m3fn codes"),
            (fp4, _replace(fp4, 0, dtype=E4M3), r"a is float8_e4m3fn .*compiled for float4_e2m1fn codes \(uint8 "
                                                r"pairs\)"),
            (good, _replace(good, 0, dims=[200, 160]), r"a is .*expected rank 3 \(L, T, K\)"),
            (fp4, _replace(fp4, 0, dims=[200, 80]), r"a is .*expected rank 3 \(L, T, K/2\)"),
            (good, _replace(good, 0, dims=[2, 0, 160]), r"a is .*expected every dimension >= 1"),
            (good, _replace(good, 0, dims=[2, 200, 152]), r"a is float8_e4m3fn \(2, 200, 152\); expected K a "
                                                          r"multiple of 16"),
            (fp4, _replace(fp4, 0, dims=[2, 200, 72]), r"a is uint8 \(2, 200, 72\); expected K a multiple of 32 "
                                                       r"\(16-byte rows of packed FP4 codes\)"),
            (good, _replace(good, 1, dtype=E5M2), r"b is float8_e5m2 .*compiled for float8_e4m3fn codes"),
            (good, _replace(good, 1, dims=[6, 72, 160]), r"b is float8_e4m3fn \(6, 72, 160\); expected \(L, G, N, "
                                                         r"K\) = \(2, G >= 1, N >= 1, 160\)"),
            (good, _replace(good, 1, dims=[1, 3, 72, 160]), r"b is .*expected \(L, G, N, K\) = \(2, "),
            (good, _replace(good, 1, dims=[2, 3, 72, 128]), r"b is .*expected \(L, G, N, K\) = \(2, G >= 1, N >= 1, "
                                                            r"160\)"),
            (good, _replace(good, 1, dims=[2, 0, 72, 160]), r"b is .*expected \(L, G, N, K\)"),
            (fp4, _replace(fp4, 1, dims=[2, 3, 72, 160]), r"b is uint8 .*expected \(L, G, N, K/2\) = \(2, G >= 1, "
                                                          r"N >= 1, 80\)"),
            (good, _replace(good, 2, dtype=E4M3), r"sfa is float8_e4m3fn .*expected uint8 E8M0 scale bytes"),
            (good, _replace(good, 2, dims=[2, 1, 2, 32, 4, 4]), r"sfa is uint8 \(2, 1, 2, 32, 4, 4\); expected "
                                                                r"\(2, 2, 2, 32, 4, 4\) \(L, ceil\(T/128\), "
                                                                r"ceil\(ceil\(K/32\)/4\), 32, 4, 4\)"),
            (good, _replace(good, 2, dims=[2, 200, 5]), r"sfa is .*expected \(2, 2, 2, 32, 4, 4\)"),
            (good, _replace(good, 3, dtype=F32), r"sfb is float32 .*expected uint8 E8M0 scale bytes"),
            (good, _replace(good, 3, dims=[2, 1, 2, 32, 4, 4]), r"sfb is uint8 \(2, 1, 2, 32, 4, 4\); expected "
                                                                r"\(6, 1, 2, 32, 4, 4\) \(L\*G, ceil\(N/128\), "
                                                                r"ceil\(ceil\(K/32\)/4\), 32, 4, 4\): the 128x4 scale "
                                                                r"atom of b's L\*G weights"),
            (good, _replace(good, 3, dims=[6, 1, 1, 32, 4, 4]), r"sfb is .*expected \(6, 1, 2, 32, 4, 4\)"),
            (good, _replace(good, 4, dtype=F32), r"items is float32 \(2, 5, 4\); expected int32 work items"),
            (good, _replace(good, 4, dtype=U8), r"items is uint8 .*expected int32"),
            (good, _replace(good, 4, dims=[10, 4]), r"items is int32 \(10, 4\); expected \(L, max_items, 4\) = "
                                                    r"\(2, max_items >= 1, 4\)"),
            (good, _replace(good, 4, dims=[2, 5, 3]), r"items is int32 \(2, 5, 3\); expected \(L, max_items, 4\)"),
            (good, _replace(good, 4, dims=[1, 5, 4]), r"items is int32 \(1, 5, 4\); expected \(L, max_items, 4\)"),
            (good, _replace(good, 4, dims=[2, 0, 4]), r"items is int32 \(2, 0, 4\); expected \(L, max_items, 4\)"),
            (good, _replace(good, 5, dtype=BF16), r"c is bfloat16 .*compiled for a float32 C"),
            (good, _replace(good, 5, dims=[2, 72, 200]), r"c is float32 \(2, 72, 200\); expected \(2, 200, 72\) "
                                                         r"\(L, T, N\)"),
            (fp4_c, _replace(fp4_c, 5, dtype=F32), r"c is float32 .*compiled for a float4_e2m1fn C \(uint8 pairs\)"),
            (fp4_c, _replace(fp4_c, 5, dims=[2, 200, 72]), r"c is uint8 \(2, 200, 72\); expected \(2, 200, 36\) "
                                                           r"\(L, T, N/2\): packed FP4 pairs"),
            (good, _replace(good, 6, dims=[1]), r"amax is float32 \(1,\); expected float32 \(2,\) \(L,\)"),
            (good, _replace(good, 6, dtype=BF16), r"amax is bfloat16 .*expected float32 \(2,\)"),
            (good, _replace(good, 7, dtype=U8), r"alpha is uint8 .*expected float32 \(2,\)"),
            (good, _replace(good, 7, dims=[2, 1]), r"alpha is float32 \(2, 1\); expected float32 \(2,\)"),
            (good, _replace(good, 7, address=(1 << 20) + 7 * 4096 + 4), r"alpha is .* at address .*; expected a "
                                                                       r"16-byte aligned pointer"),
            (good, _replace(good, 4, address=(1 << 20) + 4 * 4096 + 8), r"items is .* at address .*16-byte aligned"),
            (good, _replace(good, 0, address=0), r"a is .* at address 0; expected a 16-byte aligned pointer"),
        ]
        self.assertEqual(ext.check_ragged_buffers(good, E4M3, F32)[0], "")
        self.assertEqual(ext.check_ragged_buffers(fp4, FP4, F32)[0], "")
        self.assertEqual(ext.check_ragged_buffers(fp4_c, E4M3, FP4)[0], "")
        for base, buffers, message in cases:
            with self.subTest(message=message):
                ab, c = (FP4 if base is fp4 else E4M3), (FP4 if base is fp4_c else F32)
                got, dims = ext.check_ragged_buffers(buffers, ab, c)
                self.assertRegex(got, "^jbg_ragged_gemm_amax: " + message)
                self.assertEqual(dims, (0,) * 7)  # nothing to launch with

    def test_odd_n_with_an_fp4_c_names_b(self):
        """N, b's dimension, must be even for a packed FP4 C: an (L, T, (N-1)/2) C does not make 71 columns fit."""
        buffers = _buffers(2, 200, 71, 160, 3, 5, c=U8)
        self.assertEqual(buffers[5][1], [2, 200, 35])
        self.assertRegex(ext.check_ragged_buffers(buffers, E4M3, FP4)[0],
                         r"^jbg_ragged_gemm_amax: b is float8_e4m3fn \(2, 3, 71, 160\); expected N even for a packed "
                         r"FP4 C \(two codes per byte\)")
        self.assertEqual(ext.check_ragged_buffers(_buffers(2, 200, 71, 160, 3, 5), E4M3, F32)[0], "")

    def test_nvfp4_scales_must_be_e4m3(self):
        buffers = _buffers(1, 64, 32, 64, 2, 3, ab=U8, v=16)  # uint8 scales for NVFP4 objects
        self.assertRegex(ext.check_ragged_buffers(buffers, FP4, F32, **NVFP4)[0],
                         r"^jbg_ragged_gemm_amax: sfa is uint8 .*expected float8_e4m3fn scales \(NVFP4\)")
        buffers = _replace(_buffers(1, 64, 32, 64, 2, 3, ab=U8, sf=E4M3, v=16), 3, dtype=U8)
        self.assertRegex(ext.check_ragged_buffers(buffers, FP4, F32, **NVFP4)[0],
                         r"^jbg_ragged_gemm_amax: sfb is uint8 .*expected float8_e4m3fn scales \(NVFP4\)")

    def test_scale_blocks_follow_the_objects(self):
        """K = 192: 6 E8M0 blocks of 32 (2 atoms of 4) but 12 NVFP4 blocks of 16 (3 atoms)."""
        mx = _buffers(1, 128, 128, 192, 2, 3, ab=U8)
        self.assertEqual(mx[2][1], [1, 1, 2, 32, 4, 4])
        self.assertEqual(ext.check_ragged_buffers(mx, FP4, F32)[0], "")
        nv = _replace(_replace(mx, 2, dtype=E4M3), 3, dtype=E4M3)
        self.assertRegex(ext.check_ragged_buffers(nv, FP4, F32, **NVFP4)[0],
                         r"sfa is float8_e4m3fn \(1, 1, 2, 32, 4, 4\); expected \(1, 1, 3, 32, 4, 4\) \(L, "
                         r"ceil\(T/128\), ceil\(ceil\(K/16\)/4\)")

    def test_element_counts_fit_int32(self):
        """Buffers of 2**31 elements are refused even though every dimension fits an int32: C, a packed FP4 C whose
        logical (L, T, N) is that large, one weight (N, K) of b, and L·G batches of weights."""
        big_c = _buffers(1, 1 << 16, 1 << 15, 16, 1, 1, c=BF16)
        self.assertRegex(ext.check_ragged_buffers(big_c, E4M3, BF16)[0],
                         r"^jbg_ragged_gemm_amax: c is bfloat16 \(1, 65536, 32768\); expected fewer than 2\*\*31")
        fp4_c = _buffers(1, 1 << 16, 1 << 15, 16, 1, 1, c=U8)
        self.assertRegex(ext.check_ragged_buffers(fp4_c, E4M3, FP4)[0],
                         r"^jbg_ragged_gemm_amax: c is uint8 \(1, 65536, 16384\); expected fewer than 2\*\*31 elements "
                         r"in \(L, T, N\)")
        self.assertEqual(ext.check_ragged_buffers(_buffers(1, 1 << 16, 1 << 14, 16, 1, 1, c=U8), E4M3, FP4)[0], "")
        big_weight = _buffers(1, 128, 1 << 16, 1 << 15, 1, 1)
        self.assertRegex(ext.check_ragged_buffers(big_weight, E4M3, F32)[0],
                         r"^jbg_ragged_gemm_amax: b is float8_e4m3fn \(1, 1, 65536, 32768\); expected one weight "
                         r"\(N, K\) of fewer than 2\*\*31 elements")
        fp4_weight = _buffers(1, 128, 1 << 16, 1 << 15, 1, 1, ab=U8)  # 2**30 bytes, but 2**31 codes
        self.assertRegex(ext.check_ragged_buffers(fp4_weight, FP4, F32)[0],
                         r"^jbg_ragged_gemm_amax: b is uint8 \(1, 1, 65536, 16384\); expected one weight")
        many = _buffers(2, 128, 1, 16, 1 << 30, 1)
        self.assertRegex(ext.check_ragged_buffers(many, E4M3, F32)[0],
                         r"^jbg_ragged_gemm_amax: b is float8_e4m3fn \(2, 1073741824, 1, 16\); expected L\*G below "
                         r"2\*\*31")

    def test_weights_past_int32_elements_are_taken(self):
        """b as a whole may hold 2**31 elements or more (TMA addresses it by weight): 160 weights of 2048 x 7168."""
        buffers = _buffers(1, 512, 2048, 7168, 160, 164)
        self.assertGreaterEqual(np.prod(buffers[1][1]), 2**31)
        self.assertEqual(ext.check_ragged_buffers(buffers, E4M3, F32),
                         ("", (512, 2048, 7168, 1, 160, 164, 0)))

    def test_hook_takes_eight_buffers(self):
        with self.assertRaisesRegex(ValueError, "expected 8 buffers"):
            ext.check_ragged_buffers(_buffers(1, 1, 1, 16, 1, 1)[:7], E4M3, F32)
        with self.assertRaisesRegex(ValueError, "jbg_ragged_gemm_amax attributes: c_dtype"):
            ext.check_ragged_buffers(_buffers(1, 1, 1, 16, 1, 1), E4M3, "int32")


class RaggedBf16BufferCheckTest(parameterized.TestCase):
    """The execute stage's buffer checks for the bf16 objects (ab_dtype bfloat16, no scales, b_major "k" or "n")."""

    @parameterized.product(dims=[(1, 1, 8, 8, 1, 1), (2, 200, 72, 160, 3, 5), (3, 129, 256, 4104, 8, 10)],
                           b_major=["k", "n"], c=[F32, BF16])
    def test_well_formed_bf16(self, dims, b_major, c):
        """The dims are the logical (t, n, k, l, g, max_items, 0) in either of b's layouts; sfa and sfb are empty and
        at address 0."""
        l, t, n, k, g, max_items = dims
        buffers = _bf16_buffers(l, t, n, k, g, max_items, b_major=b_major, c=c)
        self.assertEqual(buffers[1][1], [l, g, k, n] if b_major == "n" else [l, g, n, k])
        got = ext.check_ragged_buffers(buffers, BF16, c, **NO_SCALES, b_major=b_major)
        self.assertEqual(got, ("", (t, n, k, l, g, max_items, 0)))

    @parameterized.parameters("k", "n")
    def test_empty_scales_of_any_shape_and_address(self, b_major):
        """The kernel reads neither sfa nor sfb: any shape with a zero dimension, at any address (null, unaligned)."""
        good = _bf16_buffers(2, 200, 72, 160, 3, 5, b_major=b_major)
        for sfa, sfb in (([0], [0]), ([2, 0, 4], [6, 1, 0]), ([0, 0, 0, 0, 0, 0], [6, 1, 2, 32, 4, 0])):
            for address in (0, 3, (1 << 20) + 16):
                buffers = _replace(_replace(good, 2, dims=sfa, address=address), 3, dims=sfb, address=address)
                with self.subTest(sfa=sfa, sfb=sfb, address=address):
                    self.assertEqual(ext.check_ragged_buffers(buffers, BF16, F32, **NO_SCALES, b_major=b_major)[0], "")

    def test_each_bf16_violation_is_named(self):
        k_major = _bf16_buffers(2, 200, 72, 160, 3, 5)
        n_major = _bf16_buffers(2, 200, 72, 160, 3, 5, b_major="n")
        bf16_c = _bf16_buffers(2, 200, 72, 160, 3, 5, c=BF16)
        cases = [
            (k_major, _replace(k_major, 0, dtype=E4M3), r"a is float8_e4m3fn \(2, 200, 160\); the kernel objects "
                                                        r"were compiled for bfloat16 operands"),
            (n_major, _replace(n_major, 0, dtype=F16), r"a is float16 .*compiled for bfloat16 operands"),
            (k_major, _replace(k_major, 0, dims=[200, 160]), r"a is .*expected rank 3 \(L, T, K\)"),
            (k_major, _replace(k_major, 0, dims=[2, 200, 164]), r"a is bfloat16 \(2, 200, 164\); expected K a "
                                                                r"multiple of 8 \(16-byte rows of bfloat16\)"),
            (k_major, _replace(k_major, 1, dtype=E4M3), r"b is float8_e4m3fn .*compiled for bfloat16 operands"),
            (k_major, _replace(k_major, 1, dims=[2, 3, 160, 72]), r"b is bfloat16 \(2, 3, 160, 72\); expected \(L, "
                                                                  r"G, N, K\) = \(2, G >= 1, N >= 1, 160\) for a's "
                                                                  r"L and K: one weight per group and batch, K-major "
                                                                  r"\(b_major k\)"),
            (n_major, _replace(n_major, 1, dims=[2, 3, 72, 160]), r"b is bfloat16 \(2, 3, 72, 160\); expected \(L, "
                                                                  r"G, K, N\) = \(2, G >= 1, 160, N >= 1\) for a's "
                                                                  r"L and K: one weight per group and batch, N-major "
                                                                  r"\(b_major n\)"),
            (n_major, _replace(n_major, 1, dims=[6, 160, 72]), r"b is .*expected \(L, G, K, N\) = \(2, G >= 1, 160"),
            (n_major, _replace(n_major, 1, dims=[2, 0, 160, 72]), r"b is .*expected \(L, G, K, N\)"),
            (n_major, _replace(n_major, 1, dims=[2, 3, 160, 0]), r"b is .*expected \(L, G, K, N\)"),
            (n_major, _replace(n_major, 1, dims=[2, 3, 160, 36]), r"b is bfloat16 \(2, 3, 160, 36\); expected N a "
                                                                  r"multiple of 8 \(16-byte rows of an N-major "
                                                                  r"bfloat16 b\)"),
            (k_major, _replace(k_major, 2, dims=[2, 2, 2, 32, 4, 4]), r"sfa is uint8 \(2, 2, 2, 32, 4, 4\); expected "
                                                                      r"uint8 of zero elements \(bfloat16 objects "
                                                                      r"read no scales\)"),
            (n_major, _replace(n_major, 2, dims=[]), r"sfa is uint8 \(\); expected uint8 of zero elements"),
            (k_major, _replace(k_major, 2, dtype=E4M3), r"sfa is float8_e4m3fn \(0,\); expected uint8 of zero "
                                                        r"elements"),
            (n_major, _replace(n_major, 3, dims=[6, 1]), r"sfb is uint8 \(6, 1\); expected uint8 of zero elements"),
            (k_major, _replace(k_major, 3, dtype=BF16), r"sfb is bfloat16 \(6, 0\); expected uint8 of zero "
                                                        r"elements"),
            (k_major, _replace(k_major, 4, dims=[2, 5, 3]), r"items is int32 \(2, 5, 3\); expected \(L, max_items, "
                                                            r"4\)"),
            (k_major, _replace(k_major, 5, dtype=BF16), r"c is bfloat16 .*compiled for a float32 C"),
            (k_major, _replace(k_major, 5, dtype=F16), r"c is float16 .*compiled for a float32 C"),
            (bf16_c, _replace(bf16_c, 5, dtype=F32), r"c is float32 .*compiled for a bfloat16 C"),
            (n_major, _replace(n_major, 5, dims=[2, 200, 160]), r"c is float32 \(2, 200, 160\); expected \(2, 200, "
                                                                r"72\) \(L, T, N\)"),
            (n_major, _replace(n_major, 6, dims=[1]), r"amax is float32 \(1,\); expected float32 \(2,\) \(L,\)"),
            (k_major, _replace(k_major, 7, dtype=BF16), r"alpha is bfloat16 .*expected float32 \(2,\)"),
            (k_major, _replace(k_major, 0, address=0), r"a is .* at address 0; expected a 16-byte aligned pointer"),
            (n_major, _replace(n_major, 1, address=(1 << 20) + 4096 + 2), r"b is .* at address .*16-byte aligned"),
            (k_major, _replace(k_major, 7, address=0), r"alpha is .* at address 0; expected a 16-byte aligned"),
        ]
        attributes = {id(k_major): (F32, "k"), id(n_major): (F32, "n"), id(bf16_c): (BF16, "k")}  # (c, b_major)
        for base in (k_major, n_major, bf16_c):
            c, b_major = attributes[id(base)]
            self.assertEqual(ext.check_ragged_buffers(base, BF16, c, **NO_SCALES, b_major=b_major)[0], "")
        for base, buffers, message in cases:
            with self.subTest(message=message):
                c, b_major = attributes[id(base)]
                got, dims = ext.check_ragged_buffers(buffers, BF16, c, **NO_SCALES, b_major=b_major)
                self.assertRegex(got, "^jbg_ragged_gemm_amax: " + message)
                self.assertEqual(dims, (0,) * 7)

    def test_n_need_not_be_a_multiple_of_8_when_k_major(self):
        """16-byte rows along N bind an N-major b only; a K-major b's rows run along K."""
        self.assertEqual(ext.check_ragged_buffers(_bf16_buffers(2, 200, 36, 160, 3, 5), BF16, F32, **NO_SCALES)[0],
                         "")

    def test_fp8_buffers_are_not_bf16_ones(self):
        """FP8 buffers (scale atoms and all) for bf16 objects, and bf16 buffers for FP8 objects, are refused."""
        self.assertRegex(ext.check_ragged_buffers(_buffers(2, 200, 72, 160, 3, 5), BF16, F32, **NO_SCALES)[0],
                         r"^jbg_ragged_gemm_amax: a is float8_e4m3fn .*compiled for bfloat16 operands")
        self.assertRegex(ext.check_ragged_buffers(_bf16_buffers(2, 200, 72, 160, 3, 5), E4M3, F32)[0],
                         r"^jbg_ragged_gemm_amax: a is bfloat16 .*compiled for float8_e4m3fn codes")
        fp8_with_empty_scales = _replace(_replace(_buffers(2, 200, 72, 160, 3, 5), 2, dims=[0]), 3, dims=[0])
        self.assertRegex(ext.check_ragged_buffers(fp8_with_empty_scales, E4M3, F32)[0],
                         r"^jbg_ragged_gemm_amax: sfa is uint8 \(0,\); expected \(2, 2, 2, 32, 4, 4\)")

    @parameterized.parameters("k", "n")
    def test_bf16_element_counts(self, b_major):
        """One weight (N, K) below 2**31 elements in either layout; b as a whole may hold more, and the dims are the
        logical n and k (160 weights of 2048 x 7168)."""
        big = _bf16_buffers(1, 128, 1 << 16, 1 << 15, 1, 1, b_major=b_major)
        self.assertRegex(ext.check_ragged_buffers(big, BF16, F32, **NO_SCALES, b_major=b_major)[0],
                         r"^jbg_ragged_gemm_amax: b is bfloat16 \(1, 1, \d+, \d+\); expected one weight \(N, K\) of "
                         r"fewer than 2\*\*31 elements")
        many = _bf16_buffers(1, 512, 2048, 7168, 160, 164, b_major=b_major)
        self.assertGreaterEqual(np.prod(many[1][1]), 2**31)
        self.assertEqual(ext.check_ragged_buffers(many, BF16, F32, **NO_SCALES, b_major=b_major),
                         ("", (512, 2048, 7168, 1, 160, 164, 0)))

    def test_hook_parses_b_major(self):
        with self.assertRaisesRegex(ValueError, 'jbg_ragged_gemm_amax attributes: b_major "n" is not supported for '
                                                "ab_dtype float8_e4m3fn"):
            ext.check_ragged_buffers(_buffers(1, 1, 1, 16, 1, 1), E4M3, F32, b_major="n")


class RaggedModuleTest(absltest.TestCase):

    def test_target_is_registered_under_one_name(self):
        self.assertEqual(ext.RAGGED_TARGET, "jbg_ragged_gemm_amax")
        self.assertEqual(_native.RAGGED_TARGET, ext.RAGGED_TARGET)
        self.assertEqual(ffi_lowering.RAGGED_TARGET, ext.RAGGED_TARGET)
        self.assertEqual(set(ext.ffi_targets()["jbg_ragged_gemm_amax"]), {"instantiate", "execute"})
        self.assertIn(jax.export.DisabledSafetyCheck.custom_call("jbg_ragged_gemm_amax"),
                      ffi_lowering.export_disabled_checks())

    def test_execute_handler_is_command_buffer_compatible(self):
        _, _, traits = ext.handler_metadata("jbg_ragged_gemm_amax", "execute")
        self.assertEqual(traits & ext.TRAIT_COMMAND_BUFFER_COMPATIBLE, ext.TRAIT_COMMAND_BUFFER_COMPATIBLE)


# ----------------------------------------------------------------------------------------------------------------
# emit_ragged lowered for CUDA without a GPU


@dataclasses.dataclass(frozen=True)
class StandInRaggedVariant:
    """The fields of a catalog.KernelVariant that the lowering reads."""
    arch: str
    op: str = "ragged"
    ab_dtype: str = E4M3
    c_dtype: str = F32
    sf_vec_size: int = 32
    sf_dtype: str = E8M0
    b_major: str = "k"

    @property
    def key(self):
        return f"standin.{self.op}.{self.arch}"

    @property
    def function_prefix(self):
        return f"jbg_standin_{self.op}_{self.arch}"


# A tiny primitive whose CUDA lowering is emit_ragged; abstract eval gives c (L, T, N) (packed: N/2) and amax.
_ragged_test_p = jex_core.Primitive("jbg_test_ragged")
_ragged_test_p.multiple_results = True


@_ragged_test_p.def_abstract_eval
def _abstract_eval(a, b, sfa, sfb, items, alpha, *, variants, c_dtype, c_cols):
    l, t = a.shape[:2]  # whatever a's rank: emit_ragged is the one to refuse it
    return jax.core.ShapedArray((l, t, c_cols), c_dtype), jax.core.ShapedArray((l,), jnp.float32)


mlir.register_lowering(_ragged_test_p, lambda ctx, *ops, variants, c_dtype, c_cols: ffi_lowering.emit_ragged(
    ctx, *ops, variants=variants), platform="cuda")

_NAMES = ("archs", "function_prefixes", "objects", "offsets", "ab_dtype", "c_dtype", "sf_dtype", "sf_vec_size",
          "b_major")


def _operands(l=2, t=200, n=72, k=160, g=3, max_items=5, *, ab=jnp.float8_e4m3fn, sf=jnp.uint8, v=32):
    sd = jax.ShapeDtypeStruct
    row = k // 2 if ab == jnp.uint8 else k
    k_atoms = _cdiv(_cdiv(k, v), 4)
    return (sd((l, t, row), ab), sd((l, g, n, row), ab), sd((l, _cdiv(t, 128), k_atoms, 32, 4, 4), sf),
            sd((l * g, _cdiv(n, 128), k_atoms, 32, 4, 4), sf), sd((l, max_items, 4), jnp.int32), sd((l,), jnp.float32))


def _bf16_operands(l=2, t=200, n=72, k=160, g=3, max_items=5, *, b_major="k"):
    """bf16 a and b (b (L, G, N, K), or (L, G, K, N) for b_major "n"), empty uint8 sfa (0,) and sfb (L*G, 0)."""
    sd = jax.ShapeDtypeStruct
    b_shape = (l, g, k, n) if b_major == "n" else (l, g, n, k)
    return (sd((l, t, k), jnp.bfloat16), sd(b_shape, jnp.bfloat16), sd((0,), jnp.uint8), sd((l * g, 0), jnp.uint8),
            sd((l, max_items, 4), jnp.int32), sd((l,), jnp.float32))


def _function(variants, c_dtype, c_cols):
    return jax.jit(lambda *x: _ragged_test_p.bind(*x, variants=tuple(variants), c_dtype=np.dtype(c_dtype),
                                                  c_cols=c_cols))


def _lower(operands, variants, c_dtype=jnp.float32, c_cols=None):
    c_cols = operands[1].shape[2] if c_cols is None else c_cols
    with mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: v.key.encode()):
        return _function(variants, c_dtype, c_cols).trace(*operands).lower(lowering_platforms=("cuda",))


def _custom_call(lowered, target="jbg_ragged_gemm_amax"):
    """(attributes, operand types, result types) of the one `target` custom call in `lowered`."""
    return lowered_calls.custom_call(lowered, target, _NAMES)


class EmitRaggedTest(absltest.TestCase):
    """emit_ragged: the custom call, its attributes and the contract it refuses to break."""

    def test_custom_call_carries_the_objects_and_what_they_were_compiled_for(self):
        variants = (StandInRaggedVariant("sm_90a"), StandInRaggedVariant("sm_100a"))
        lowered = _lower(_operands(), variants)
        text = lowered.as_text(dialect="hlo")
        self.assertRegex(text, r'custom_call_target="jbg_ragged_gemm_amax".*api_version=API_VERSION_TYPED_FFI')
        attrs, operands, results = _custom_call(lowered)
        self.assertEqual(attrs["archs"], "sm_100a,sm_90a")  # sorted by arch
        self.assertEqual(attrs["function_prefixes"], "jbg_standin_ragged_sm_100a,jbg_standin_ragged_sm_90a")
        self.assertEqual(attrs["objects"].tobytes(), b"standin.ragged.sm_100astandin.ragged.sm_90a")
        np.testing.assert_array_equal(attrs["offsets"], [0, 22, 43])
        self.assertEqual((attrs["ab_dtype"], attrs["c_dtype"], attrs["sf_dtype"]), (E4M3, F32, E8M0))
        self.assertEqual(attrs["sf_vec_size"], "32 : i64")
        self.assertEqual(attrs["b_major"], "k")  # always passed
        self.assertEqual(operands, ["tensor<2x200x160xf8E4M3FN>", "tensor<2x3x72x160xf8E4M3FN>",
                                    "tensor<2x2x2x32x4x4xui8>", "tensor<6x1x2x32x4x4xui8>", "tensor<2x5x4xi32>",
                                    "tensor<2xf32>"])
        self.assertEqual(results, ["tensor<2x200x72xf32>", "tensor<2xf32>"])

    def test_packed_fp4_nvfp4_with_an_fp4_c(self):
        variant = StandInRaggedVariant("sm_90a", ab_dtype=FP4, c_dtype=FP4, sf_vec_size=16, sf_dtype=E4M3)
        operands = _operands(n=72, k=128, ab=jnp.uint8, sf=jnp.float8_e4m3fn, v=16)
        attrs, types, results = _custom_call(_lower(operands, [variant], c_dtype=jnp.uint8, c_cols=36))
        self.assertEqual((attrs["ab_dtype"], attrs["c_dtype"], attrs["sf_dtype"], attrs["sf_vec_size"]),
                         (FP4, FP4, E4M3, "16 : i64"))
        self.assertEqual(types[:4], ["tensor<2x200x64xui8>", "tensor<2x3x72x64xui8>", "tensor<2x2x2x32x4x4xf8E4M3FN>",
                                     "tensor<6x1x2x32x4x4xf8E4M3FN>"])
        self.assertEqual(results, ["tensor<2x200x36xui8>", "tensor<2xf32>"])

    def test_bf16_variants(self):
        """bf16 objects: ab_dtype "bfloat16", sf_dtype "none" per 0 (not sfa's uint8), the variants' b_major; b in
        that major, the empty scales passed as they are."""
        for b_major in ("k", "n"):
            for c_dtype, c_name, c_type in ((jnp.float32, F32, "f32"), (jnp.bfloat16, BF16, "bf16")):
                variants = [StandInRaggedVariant(arch, ab_dtype=BF16, c_dtype=c_name, sf_vec_size=0, sf_dtype=NONE,
                                                 b_major=b_major) for arch in ("sm_90a", "sm_100a")]
                with self.subTest(b_major=b_major, c=c_name):
                    attrs, types, results = _custom_call(_lower(_bf16_operands(b_major=b_major), variants,
                                                                c_dtype=c_dtype, c_cols=72))
                    self.assertEqual((attrs["ab_dtype"], attrs["c_dtype"], attrs["sf_dtype"], attrs["sf_vec_size"],
                                      attrs["b_major"]), (BF16, c_name, NONE, "0 : i64", b_major))
                    self.assertEqual(attrs["archs"], "sm_100a,sm_90a")
                    b_type = "tensor<2x3x160x72xbf16>" if b_major == "n" else "tensor<2x3x72x160xbf16>"
                    self.assertEqual(types, ["tensor<2x200x160xbf16>", b_type, "tensor<0xui8>", "tensor<6x0xui8>",
                                             "tensor<2x5x4xi32>", "tensor<2xf32>"])
                    self.assertEqual(results, [f"tensor<2x200x72x{c_type}>", "tensor<2xf32>"])

    def test_bf16_scales_of_any_rank(self):
        """Empty scales of any rank, the atom's included (a zero dimension); the handler skips them."""
        variant = StandInRaggedVariant("sm_90a", ab_dtype=BF16, sf_vec_size=0, sf_dtype=NONE, b_major="n")
        sd = jax.ShapeDtypeStruct
        for sfa, sfb in (((0, 0, 0), (0,)), ((2, 2, 0, 32, 4, 4), (6, 1, 0, 32, 4, 4))):
            operands = _bf16_operands(b_major="n")
            operands = operands[:2] + (sd(sfa, jnp.uint8), sd(sfb, jnp.uint8)) + operands[4:]
            with self.subTest(sfa=sfa, sfb=sfb):
                attrs, types, _ = _custom_call(_lower(operands, [variant], c_cols=72))
                self.assertEqual((attrs["sf_dtype"], attrs["b_major"]), (NONE, "n"))
                self.assertEqual(types[2], "tensor<" + "x".join(map(str, sfa)) + "xui8>")

    def test_bf16_refusals(self):
        """What the handler would refuse of bf16 operands, emit_ragged refuses first."""
        k_major = StandInRaggedVariant("sm_90a", ab_dtype=BF16, sf_vec_size=0, sf_dtype=NONE)
        n_major = dataclasses.replace(k_major, b_major="n")
        good_k, good_n = _bf16_operands(), _bf16_operands(b_major="n")
        sd = jax.ShapeDtypeStruct

        def swap(operands, i, aval):
            return operands[:i] + (aval,) + operands[i + 1:]

        cases = [
            (good_n, [k_major], r"b \(L, G, N, K\) .* and b_major 'k'; got b bfloat16\[2,3,160,72\]"),
            (good_k, [n_major], r"b \(L, G, N, K\) .*b_major 'n': \(L, G, K, N\)\) of a's dtype .* and b_major 'n'"),
            (swap(good_k, 1, sd((2, 3, 72, 160), jnp.float16)), [k_major], "of a's dtype"),
            (swap(good_k, 2, sd((2, 2, 2, 32, 4, 4), jnp.uint8)), [k_major], "sfa and sfb uint8 of zero elements for "
                                                                            r"bfloat16 variants \(no scales\)"),
            (swap(good_k, 3, sd((), jnp.uint8)), [k_major], "sfa and sfb uint8 of zero elements"),
            (swap(good_n, 3, sd((6, 0), jnp.float8_e4m3fn)), [n_major], "sfa and sfb uint8 of zero elements"),
            (good_k, [k_major, dataclasses.replace(n_major, arch="sm_100a")], r"variant 'standin.ragged.sm_100a' is "
                                                                              r"not a ragged kernel compiled for the "
                                                                              r"call's \('bfloat16', 'float32', "
                                                                              r"'none', 0, 'k', ''\)"),
            (good_k, [dataclasses.replace(k_major, c_dtype=BF16)], "not a ragged kernel compiled for the call's"),
            (_operands(), [k_major], "sfa and sfb uint8 of zero elements"),  # FP8 operands, bf16 objects
            (swap(swap(_operands(), 2, sd((0,), jnp.uint8)), 3, sd((0,), jnp.uint8)), [StandInRaggedVariant("sm_90a")],
             r"sfa and sfb in the 128x4 atom form \(rank 6\)"),  # FP8 objects keep the atom
        ]
        for operands, variants, message in cases:
            with self.subTest(message=message), self.assertRaisesRegex(ValueError, message):
                _lower(operands, variants, c_cols=72)

    def test_catalog_variant(self):
        """A real catalog entry of op "ragged" lowers the same way (its key names the object)."""
        try:
            from jax_blockgemm.kernels import catalog
        except ImportError as e:
            self.skipTest(f"CuTeDSL is not importable: {e}")
        variant = catalog.KernelVariant(op="ragged", arch="sm_90a", ab_dtype=E5M2, c_dtype=BF16, sf_vec_size=32,
                                        sf_dtype=E8M0)
        attrs, _, results = _custom_call(_lower(_operands(ab=jnp.float8_e5m2), [variant], c_dtype=jnp.bfloat16))
        self.assertEqual(attrs["function_prefixes"], variant.function_prefix)
        self.assertEqual(attrs["objects"].tobytes(), variant.key.encode())
        self.assertEqual((attrs["ab_dtype"], attrs["c_dtype"]), (E5M2, BF16))
        self.assertEqual(results[0], "tensor<2x200x72xbf16>")

    def test_catalog_bf16_variants(self):
        """The catalog's bf16 ragged entries lower with sf_dtype catalog.NO_SCALES and their b_major."""
        try:
            from jax_blockgemm.kernels import catalog
        except ImportError as e:
            self.skipTest(f"CuTeDSL is not importable: {e}")
        self.assertEqual(ffi_lowering.NO_SCALES, catalog.NO_SCALES)
        bf16 = [v for v in catalog.CATALOG if v.op == "ragged" and v.ab_dtype == BF16]
        self.assertEqual({(v.c_dtype, v.b_major) for v in bf16}, {(F32, "k"), (F32, "n"), (BF16, "k"), (BF16, "n")})
        for v in bf16:
            with self.subTest(key=v.key):
                attrs, _, results = _custom_call(_lower(_bf16_operands(b_major=v.b_major), [v],
                                                        c_dtype=jnp.dtype(v.c_dtype), c_cols=72))
                self.assertEqual(attrs["function_prefixes"], v.function_prefix)
                self.assertEqual((attrs["ab_dtype"], attrs["c_dtype"], attrs["sf_dtype"], attrs["sf_vec_size"],
                                  attrs["b_major"]), (BF16, v.c_dtype, catalog.NO_SCALES, "0 : i64", v.b_major))

    def test_refuses_what_the_handler_would(self):
        ok = StandInRaggedVariant("sm_90a")
        good = _operands()
        sd = jax.ShapeDtypeStruct

        def swap(i, aval):
            return good[:i] + (aval,) + good[i + 1:]

        cases = [
            (swap(0, sd((200, 160), jnp.float8_e4m3fn)), [ok], {}, r"a \(L, T, K\)"),
            (swap(1, sd((6, 72, 160), jnp.float8_e4m3fn)), [ok], {}, r"b \(L, G, N, K\)"),
            (swap(1, sd((2, 3, 72, 128), jnp.float8_e4m3fn)), [ok], {}, r"b \(L, G, N, K\)"),
            (swap(1, sd((2, 3, 72, 160), jnp.float8_e5m2)), [ok], {}, "of a's dtype"),
            (swap(2, sd((2, 2, 10), jnp.uint8)), [ok], {}, r"sfa and sfb in the 128x4 atom form \(rank 6\)"),
            (swap(3, sd((6, 1, 2, 32, 4, 4), jnp.float8_e4m3fn)), [ok], {}, "of one dtype"),
            (swap(4, sd((2, 5, 4), jnp.uint32)), [ok], {}, r"items \(2, max_items >= 1, 4\) int32"),
            (swap(4, sd((10, 4), jnp.int32)), [ok], {}, r"items \(2, max_items >= 1, 4\) int32"),
            (swap(4, sd((2, 5, 3), jnp.int32)), [ok], {}, r"items \(2, max_items >= 1, 4\) int32"),
            (swap(5, sd((1,), jnp.float32)), [ok], {}, r"alpha \(2,\) float32"),
            (swap(5, sd((2,), jnp.bfloat16)), [ok], {}, r"alpha \(2,\) float32"),
            (good, [ok], dict(c_cols=71), r"results c \(2, 200, 72\)"),
            (_operands(n=71), [StandInRaggedVariant("sm_90a", c_dtype=FP4)], dict(c_dtype=jnp.uint8, c_cols=35),
             "N = 71 is odd"),
            (good, [StandInRaggedVariant("sm_90a", c_dtype=BF16)], {}, r"not a ragged kernel compiled for the "
                                                                        r"call's \('float8_e4m3fn', 'float32'"),
            (good, [StandInRaggedVariant("sm_90a", op="gemm_amax")], {}, "not a ragged kernel"),
            (good, [ok, StandInRaggedVariant("sm_100a", sf_vec_size=16)], {}, r"variant 'standin.ragged.sm_90a' is "
                                                                             r"not a ragged kernel compiled for"),
            (good, [], {}, "at least one variant"),
        ]
        for operands, variants, kwargs, message in cases:
            with self.subTest(message=message), self.assertRaisesRegex(ValueError, message):
                _lower(operands, variants, **kwargs)

    def test_export_names_the_target(self):
        with mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: v.key.encode()):
            exported = jax.export.export(_function([StandInRaggedVariant("sm_90a")], jnp.float32, 72),
                                         platforms=("cuda",),
                                         disabled_checks=ffi_lowering.export_disabled_checks())(*_operands())
        self.assertIn("stablehlo.custom_call @jbg_ragged_gemm_amax", exported.mlir_module())
        self.assertEqual([a.shape for a in exported.out_avals], [(2, 200, 72), (2,)])


# The lowering's attributes, given to the real instantiate stage by XLA:CPU in a fresh process: well-formed ones
# reach the device query (no GPU here), malformed ones are refused by name.
_XLA_PROBE = textwrap.dedent("""
    import types
    import jax, jax.numpy as jnp, numpy as np
    from jax_blockgemm import _native, ffi_lowering
    jax.devices()  # start the CPU client so that the registrations below reach XLA now
    _native.register_ffi_targets(platform="cpu")
    l, t, n, k, g = 1, 200, 72, 160, 3
    ops = (jnp.zeros((l, t, k), jnp.float8_e4m3fn), jnp.zeros((l, g, n, k), jnp.float8_e4m3fn),
           jnp.zeros((l, 2, 2, 32, 4, 4), jnp.uint8), jnp.zeros((l * g, 1, 2, 32, 4, 4), jnp.uint8),
           jnp.zeros((l, 5, 4), jnp.int32), jnp.ones((l,), jnp.float32))
    out = (jax.ShapeDtypeStruct((l, t, n), jnp.float32), jax.ShapeDtypeStruct((l,), jnp.float32))
    # (name, ab_dtype, sf_dtype, sf_vec_size, b_major, amax_used); a variant without b_major is K-major
    for name, ab_dtype, sf_dtype, sf_vec_size, b_major, amax_used in (
            ("GOOD", "float8_e4m3fn", "float8_e8m0fnu", 32, None, True),
            ("BADAB", "float16", "float8_e8m0fnu", 32, None, True),
            ("BADSF", "float8_e4m3fn", "float8_e8m0fnu", 16, None, True), ("BF16", "bfloat16", "none", 0, "n", True),
            ("BADMAJOR", "float8_e4m3fn", "float8_e8m0fnu", 32, "n", True),
            ("NOAMAX", "float8_e4m3fn", "float8_e8m0fnu", 32, None, False),
            ("BADAMAX", "float8_e4m3fn", "float8_e8m0fnu", 32, None, 2)):
        variant = types.SimpleNamespace(op="ragged", arch="sm_90a", key="p90", function_prefix="p90",
                                        ab_dtype=ab_dtype, c_dtype="float32", sf_dtype=sf_dtype,
                                        sf_vec_size=sf_vec_size, **({"b_major": b_major} if b_major else {}))
        attributes = ffi_lowering.ragged_attributes([variant], [b"x" * 1000], ab_dtype=np.dtype(ab_dtype),
                                                    c_dtype=np.float32, sf_dtype=sf_dtype, sf_vec_size=sf_vec_size,
                                                    b_major=b_major or "k",
                                                    amax_batches=l if amax_used is True else 0)
        if amax_used == 2:  # what no lowering writes: the handler's own check
            attributes["amax_batches"] = np.int64(-1)
        call = jax.ffi.ffi_call("jbg_ragged_gemm_amax", out)
        try:
            jax.jit(lambda *x: call(*x, **attributes))(*ops)
            print(name, "RAN")
        except Exception as e:
            print(name, " ".join(str(e).split())[:500])
""")


class XlaInstantiateTest(absltest.TestCase):
    """Registers the real handlers with XLA:CPU (in a fresh process) so that XLA runs the instantiate stage on the
    attributes ragged_attributes makes: its names and types are the ones the handler binds."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.output, cls.lines = xla_probe.run(_XLA_PROBE)

    def test_well_formed_attributes_reach_the_device_query(self):
        for name in ("GOOD", "BF16", "NOAMAX"):  # b_major bound for all; bf16 with no scales and an N-major b
            got = self.lines.get(name, self.output)
            self.assertNotIn("RAN", got)
            self.assertNotIn("attributes", got)
            self.assertRegex(got, r"jbg_ragged_gemm_amax: (cannot load the CUDA driver|cuInit failed|cuDeviceGetCount|"
                                  r"no kernel)")

    def test_malformed_attributes_are_invalid_arguments(self):
        self.assertRegex(self.lines.get("BADAB", self.output),
                         r'INVALID_ARGUMENT: jbg_ragged_gemm_amax attributes: ab_dtype "float16" is not supported')
        self.assertRegex(self.lines.get("BADSF", self.output),
                         r'INVALID_ARGUMENT: jbg_ragged_gemm_amax attributes: sf_dtype "float8_e8m0fnu" with '
                         r"sf_vec_size 16 is not supported")
        self.assertRegex(self.lines.get("BADMAJOR", self.output),
                         r'INVALID_ARGUMENT: jbg_ragged_gemm_amax attributes: b_major "n" is not supported for '
                         r"ab_dtype float8_e4m3fn")
        self.assertRegex(self.lines.get("BADAMAX", self.output),
                         r"INVALID_ARGUMENT: jbg_ragged_gemm_amax attributes: amax_batches -1 is not supported")


if __name__ == "__main__":
    absltest.main()
