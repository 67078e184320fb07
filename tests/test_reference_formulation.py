"""The reference's measured formulation computes the same bits as the old one; the scaled_dot route stays in SPEC §7.

proj_rope: `reference.gemm_proj_rope_reference` (restructured for speed, see its docstring) must be
bit-identical to the formulation it replaced (`legacy_proj_rope` below, the oracle of record) on random inputs
with zero, NaN and inf blocks, at odd shapes; its quantizer is also checked on crafted Y (E4M3 ties,
saturation, float32 subnormals, zero and non-finite blocks) against the old quantizer and the float64 oracle.
gemm_amax: the `jax.lax.scaled_dot` accumulator against the float64 oracle (skipped where jax lacks scaled_dot), and
the one place that decides when the primitives take it (`arch.TABLE`: Blackwell, not Hopper).
"""

import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg
from jax_blockgemm import formats, reference

import oracle
import oracle_ops

_NO_SCALED_DOT = "the installed jax has no jax.lax.scaled_dot"
E4M3 = jnp.float8_e4m3fn


# ----------------------------------------------------------------------------------------------------------------
# The formulation before the reference was restructured for speed, kept verbatim as the oracle of record.


def _legacy_round_to_e4m3_grid(y: jax.Array) -> jax.Array:
    """formats.round_to_grid(y, E4M3) as it was: a division by the grid step."""
    y = jnp.clip(y, -448.0, 448.0)
    biased = (jax.lax.bitcast_convert_type(y, jnp.int32) >> 23) & 0xFF
    ulp = formats._exp2(jnp.maximum(biased - 127, -6) - 3)
    return jnp.round(y / ulp) * ulp


def _legacy_quantize(y: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """formats.quantize_mxfp8 (E4M3, block 32, ceil rule) as it was: two reductions per block, tokens moved last."""
    xb = formats._to_blocks(y.astype(jnp.float32), axis, 32)
    finite = jnp.isfinite(xb)
    amax, bad = formats.magnitude_max(jnp.where(finite, xb, 0.0)), ~jnp.all(finite, axis=-1)
    e = jnp.where(bad, 128, formats.scale_exponent(amax, 448.0, rule="ceil"))
    v = formats._scale_by_exp2(xb, -jnp.clip(e, -127, 127)[..., None])
    v = jnp.where(bad[..., None], 0.0, jnp.clip(v, -448.0, 448.0))
    codes = formats._from_blocks(_legacy_round_to_e4m3_grid(v).astype(E4M3), axis, y.shape[axis])
    return codes, jnp.moveaxis(formats.exponent_to_e8m0(e), -1, axis)


def legacy_proj_rope(x, w, cos, sin, *, x_scale=None, w_scale=None, w_out_in=True):
    """reference.gemm_proj_rope_reference as it was: dot, concatenating RoPE, barrier, two moveaxis quantizations."""
    if x.dtype == np.dtype(E4M3):
        x = reference.dequantize_bf16(x, x_scale, block=32, axis=1)
        w = reference.dequantize_bf16(w, w_scale, block=32, axis=1 if w_out_in else 0)
    y = reference._bf16_dot(x, w, (((1,), (1 if w_out_in else 0,)), ((), ())))
    t, n = y.shape
    y = jax.lax.optimization_barrier(reference.apply_rope(y.reshape(t, n // 192, 192), cos, sin))
    return (*_legacy_quantize(y, -1), *_legacy_quantize(y, 0))


# ----------------------------------------------------------------------------------------------------------------


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def _assert_same_bits(test, got, want, what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = _bits(g), _bits(w)
        test.assertEqual(g.shape, w.shape, f"{what}: output {i} shape")
        differ = int(np.sum(g != w))
        test.assertEqual(differ, 0, f"{what}: output {i} differs in {differ} of {g.size} elements")


def _special_inputs(rng, *, t, h, k, mxfp8, w_out_in):
    """oracle_ops' random inputs with a zero token and a zero feature (zero row and column blocks), a NaN feature
    and an inf feature: a NaN and an inf weight (bf16 path), or a NaN scale byte and scale bytes that overflow
    the dequantized bfloat16 weights to inf (MXFP8 path)."""
    inp = oracle_ops.random_proj_rope_inputs(rng, t=t, h=h, k=k, mxfp8=mxfp8, w_out_in=w_out_in)
    n = h * 192
    f_nan, f_inf = n - 40, n // 2 + 3
    x, w = inp["x"].copy(), inp["w"].copy()
    wf = w if w_out_in else w.T  # (N, K) view of w
    x[1] = 0
    wf[5] = 0
    if mxfp8:
        ws = inp["w_scale"].copy()
        wsf = ws if w_out_in else ws.T
        wsf[f_nan, 0] = 0xFF
        wsf[f_inf, :] = 254
        inp["w_scale"] = ws
    else:
        wf[f_nan, 3] = np.nan
        wf[f_inf, k // 2] = np.inf
    inp.update(x=x, w=w)
    return inp


def _call(fn, inp):
    args = [jnp.asarray(inp[n]) for n in ("x", "w", "cos", "sin")]
    scales = {}
    if inp["x_scale"] is not None:
        scales = dict(x_scale=jnp.asarray(inp["x_scale"]), w_scale=jnp.asarray(inp["w_scale"]))
    return [np.asarray(o) for o in jax.jit(lambda *a: fn(*a, **scales))(*args)]


class ProjRopeReferenceTest(parameterized.TestCase):

    @parameterized.product(mxfp8=(False, True), w_out_in=(True, False), thk=((32, 1, 64), (96, 3, 160)))
    def test_bit_identical_to_legacy(self, mxfp8, w_out_in, thk):
        t, h, k = thk
        rng = np.random.default_rng(hash((mxfp8, w_out_in, thk)) % 2**32)
        inp = _special_inputs(rng, t=t, h=h, k=k, mxfp8=mxfp8, w_out_in=w_out_in)
        got = _call(functools.partial(reference.gemm_proj_rope_reference, w_out_in=w_out_in), inp)
        want = _call(functools.partial(legacy_proj_rope, w_out_in=w_out_in), inp)
        _assert_same_bits(self, got, want, "reference vs legacy")
        # the planted blocks are there: NaN scale bytes both ways, zero-byte blocks both ways
        self.assertTrue((got[1] == 0xFF).any() and (got[3] == 0xFF).any())
        self.assertTrue((got[1] == 0).any() and (got[3] == 0).any())

    def test_public_api_matches_oracle_after_the_change(self):
        """The reference through the public API still meets SPEC §7 against the float64 oracle (odd H)."""
        rng = np.random.default_rng(23)
        inp = oracle_ops.random_proj_rope_inputs(rng, t=64, h=3, k=96, mxfp8=True)
        outs = _call(functools.partial(jbg.gemm_proj_rope_mxfp8, implementation="xla"), inp)
        y_ref = oracle_ops.proj_rope_oracle(inp["x"], inp["w"], inp["cos"], inp["sin"], x_scale=inp["x_scale"],
                                            w_scale=inp["w_scale"])
        oracle_ops.assert_proj_rope_close(self, outs, y_ref)

    def test_token_count_must_fill_column_blocks(self):
        x = jnp.zeros((48, 32), jnp.bfloat16)
        with self.assertRaisesRegex(ValueError, "multiple of 32 tokens"):
            reference.gemm_proj_rope_reference(x, jnp.zeros((192, 32), jnp.bfloat16), jnp.zeros((48, 64)),
                                               jnp.zeros((48, 64)))


def _crafted_y(rng, t: int, h: int) -> np.ndarray:
    """float32 (T, H, 192) spanning many binades, with E4M3 ties, saturation, subnormals and non-finite blocks."""
    y = rng.standard_normal((t, h, 192)) * np.exp2(rng.integers(-30, 30, (t, h, 6, 1))).repeat(32, -1).reshape(
        t, h, 192)
    y = y.astype(np.float32)
    y[0, 0, :32] = 0.0                                               # an all-zero row block
    y[:32, h - 1, 170] = 0.0                                         # an all-zero column block
    y[1, 0, :32] = [448.0, 1.0625, 1.1875, -3.25, 0.0009765625] + [0.5] * 27  # ties to even under scale 2**0
    y[2, 0, 32:64] = 449.0                                           # just over a boundary: e = 1, codes 224.5->224
    y[3, 0, 64:96] = rng.standard_normal(32) * 1e-40                # float32 subnormals: scale byte 0
    y[4, 0, 96:128] = 3.0e38                                         # near the float32 maximum
    y[5, h - 1, 130] = np.nan
    y[6, 0, 7] = np.inf
    y[t - 1, h - 1, 191] = -np.inf
    return y


class QuantizerTest(parameterized.TestCase):

    @parameterized.parameters((32, 1), (96, 3))
    def test_matches_legacy_and_oracle(self, t, h):
        rng = np.random.default_rng(t * 10 + h)
        y = _crafted_y(rng, t, h)
        got = [np.asarray(o) for o in jax.jit(reference._quantize_rows_and_columns)(y)]
        legacy = [np.asarray(o) for o in jax.jit(lambda v: (*_legacy_quantize(v, -1), *_legacy_quantize(v, 0)))(y)]
        _assert_same_bits(self, got, legacy, "view quantization vs legacy")
        public = [np.asarray(o) for o in jax.jit(lambda v: (
            *formats.quantize_mxfp8(v, axis=-1, dtype=E4M3), *formats.quantize_mxfp8(v, axis=0, dtype=E4M3)))(y)]
        _assert_same_bits(self, public, legacy, "formats.quantize_mxfp8 vs legacy")
        y64 = y.astype(np.float64)
        for codes, scales, axis in ((got[0], got[1], 2), (got[2], got[3], 0)):
            ref_codes, ref_bytes = oracle.quantize_mx_f64(y64, axis=axis)
            np.testing.assert_array_equal(scales, ref_bytes)
            np.testing.assert_array_equal(_bits(codes), _bits(ref_codes))
        self.assertEqual(int(got[1][0, 0, 0]), 0)
        self.assertEqual(int(got[1][3, 0, 2]), 0)
        self.assertGreater(int(np.count_nonzero(got[0][3, 0, 64:96].astype(np.float32))), 0)  # subnormals kept
        self.assertEqual(int(got[1][6, 0, 0]), 0xFF)
        self.assertEqual(int(got[3][0, h - 1, 170]), 0)
        self.assertEqual(int(got[3][0, h - 1, 130]), 0xFF)


class ReferenceDotTest(absltest.TestCase):
    """The references' one GEMM: bfloat16 operands, a float32 result (SPEC §6), and no algorithm preset, which made
    XLA pick slower GEMM kernels on the H200 at bit-identical results (docs/design/reference.md)."""

    _DOT = re.compile(r"stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)")

    def _dots(self, fn, *args) -> list[str]:
        hlo = jax.jit(fn).lower(*args).as_text()
        return [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]

    def _check(self, dots: list[str]) -> None:
        self.assertLen(dots, 1, dots)
        self.assertNotIn("algorithm", dots[0])
        lhs, rhs, out = self._DOT.search(dots[0]).groups()
        self.assertTrue(lhs.endswith("xbf16>") and rhs.endswith("xbf16>") and out.endswith("xf32>"), dots[0])

    def test_gemm_amax(self):
        inp = oracle_ops.random_gemm_inputs(np.random.default_rng(3), l=1, m=64, n=32, k=64, fmt="mxfp8_e4m3")
        args = [jnp.asarray(inp[x][0]) for x in ("a", "b", "sfa", "sfb")]
        self._check(self._dots(lambda *x: jbg.gemm_amax(*x, implementation="xla"), *args))

    def test_proj_rope(self):
        x = jnp.ones((32, 64), jnp.bfloat16)
        w = jnp.ones((192, 64), jnp.bfloat16)
        table = jnp.ones((32, 64), jnp.bfloat16)
        self._check(self._dots(lambda *a: jbg.gemm_proj_rope_mxfp8(*a, implementation="xla"), x, w, table, table))


@absltest.skipUnless(reference.has_scaled_dot(), _NO_SCALED_DOT)
class ScaledDotRouteTest(parameterized.TestCase):
    """On CPU scaled_dot decomposes into bf16 dequantization + dot, so the "exact" bound (1e-5) applies; on a GPU
    it runs on FP8 tensor cores, judged by SPEC §7's 1e-4 for that class."""

    def setUp(self):
        super().setUp()
        if jax.default_backend() != "cpu":
            self.enter_context(mock.patch.object(oracle_ops, "GEMM_RTOL", 1e-4))

    def _check(self, *, l, m, n, k, fmt, c_dtype, a_major="k", b_major="k", c_major="n", seed=0):
        rng = np.random.default_rng(seed)
        inp = oracle_ops.random_gemm_inputs(rng, l=l, m=m, n=n, k=k, fmt=fmt, a_major=a_major, b_major=b_major,
                                            scale_log2=None if c_dtype == "float32" else (-4, 0))
        fn = jax.jit(functools.partial(reference.gemm_amax_reference, k=k, sf_vec_size=32,
                                       c_dtype=np.dtype(c_dtype), a_major=a_major, b_major=b_major,
                                       c_major=c_major, scaled_dot=True))
        c, amax = fn(*(jnp.asarray(inp[x]) for x in ("a", "b", "sfa_atom", "sfb_atom")))
        c_ref, amax_ref = oracle_ops.gemm_amax_oracle(inp["a"], inp["b"], inp["sfa"], inp["sfb"], k=k,
                                                      sf_vec_size=32, a_major=a_major, b_major=b_major)
        oracle_ops.assert_gemm_close(self, np.asarray(c), c_ref, c_dtype=c_dtype, c_major=c_major)
        oracle_ops.assert_amax_close(self, np.asarray(amax), amax_ref)

    @parameterized.product(fmt=("mxfp8_e4m3", "mxfp8_e5m2"), c_dtype=("float32", "bfloat16"),
                           shape=((1, 128, 128, 128), (3, 200, 72, 96)))
    def test_matches_oracle(self, fmt, c_dtype, shape):
        l, m, n, k = shape
        self._check(l=l, m=m, n=n, k=k, fmt=fmt, c_dtype=c_dtype, seed=hash((fmt, c_dtype, shape)) % 2**32)

    @parameterized.product(a_major=("k", "m"), b_major=("k", "n"), c_major=("n", "m"))
    def test_majors(self, a_major, b_major, c_major):
        self._check(l=2, m=136, n=48, k=96, fmt="mxfp8_e4m3", c_dtype="float32", a_major=a_major,
                    b_major=b_major, c_major=c_major, seed=3)

    def test_long_k(self):
        self._check(l=1, m=40, n=24, k=4096, fmt="mxfp8_e4m3", c_dtype="float32", seed=5)

    def test_nan_scale_poisons_its_row_and_amax(self):
        """One NaN (0xFF) scale byte in A: exactly that row of C is NaN, and amax is NaN."""
        k = 128
        inp = oracle_ops.random_gemm_inputs(np.random.default_rng(3), l=1, m=160, n=96, k=k, fmt="mxfp8_e4m3")
        sfa = inp["sfa"].copy()
        sfa[0, 37, 1] = 0xFF
        fn = jax.jit(functools.partial(reference.gemm_amax_reference, k=k, sf_vec_size=32, c_dtype=np.float32,
                                       scaled_dot=True))
        c, amax = fn(jnp.asarray(inp["a"]), jnp.asarray(inp["b"]), formats.to_scale_atom(jnp.asarray(sfa)),
                     formats.to_scale_atom(jnp.asarray(inp["sfb"])))
        c = np.asarray(c[0])
        self.assertEqual(np.flatnonzero(np.isnan(c).any(axis=1)).tolist(), [37])
        self.assertTrue(np.isnan(c[37]).all())
        self.assertTrue(np.isnan(np.asarray(amax)[0]))

    def _special(self, fmt: str, special_codes: dict) -> np.ndarray:
        """The route on codes with `special_codes` ({(row, k): byte} in A) and a NaN (0xFF) scale byte in B (column
        3): NaN and ±inf exactly where the float64 oracle has them, the finite elements within the route's bound, a
        NaN amax. Returns the oracle's C."""
        rng = np.random.default_rng(11)
        k = 128
        inp = oracle_ops.random_gemm_inputs(rng, l=1, m=64, n=48, k=k, fmt=fmt)
        a = inp["a"].copy()
        for (row, kk), byte in special_codes.items():
            a.view(np.uint8)[0, row, kk] = byte
        sfb = inp["sfb"].copy()
        sfb[0, 3, 1] = 0xFF
        fn = jax.jit(functools.partial(reference.gemm_amax_reference, k=k, sf_vec_size=32, c_dtype=np.float32,
                                       scaled_dot=True))
        c, amax = fn(jnp.asarray(a), jnp.asarray(inp["b"]), formats.to_scale_atom(jnp.asarray(inp["sfa"])),
                     formats.to_scale_atom(jnp.asarray(sfb)))
        c_ref, amax_ref = oracle_ops.gemm_amax_oracle(a, inp["b"], inp["sfa"], sfb, k=k, sf_vec_size=32)
        c, ref = np.asarray(c[0], np.float64), c_ref[0]
        np.testing.assert_array_equal(np.isnan(c), np.isnan(ref))
        np.testing.assert_array_equal(np.isposinf(c), np.isposinf(ref))
        np.testing.assert_array_equal(np.isneginf(c), np.isneginf(ref))
        self.assertGreater(np.isnan(ref).sum(), 64 + 10)  # the NaN column and more
        finite = np.isfinite(ref)
        err = np.linalg.norm(c[finite] - ref[finite]) / np.linalg.norm(ref[finite])
        self.assertLessEqual(err, oracle_ops.GEMM_RTOL)
        oracle_ops.assert_amax_close(self, np.asarray(amax), amax_ref)
        return ref

    def test_e4m3_nan_codes_and_nan_scales_propagate_like_the_oracle(self):
        """What the route takes on a GPU (E4M3 only): NaN codes (0x7F, 0xFF) poison their rows."""
        self._special("mxfp8_e4m3", {(5, 7): 0x7F, (9, 100): 0xFF})

    def test_e5m2_inf_codes_propagate_like_the_oracle(self):
        """E5M2 +inf and -inf in one row (inf - inf is NaN) and +inf in another (inf x 0 NaN, else ±inf). On the
        H200 -inf + inf came out non-NaN, so the route never takes E5M2 there (SCALED_DOT_CODES); this runs where
        scaled_dot decomposes exactly (the CPU)."""
        if jax.default_backend() != "cpu":
            self.skipTest("the route takes E4M3 codes only on a GPU (reference.SCALED_DOT_CODES)")
        ref = self._special("mxfp8_e5m2", {(5, 7): 0x7C, (9, 40): 0xFC, (9, 41): 0x7C})
        self.assertGreater(np.isinf(ref).sum(), 10)

    def test_refuses_what_it_cannot_compute(self):
        a = jnp.zeros((1, 128, 64), jnp.uint8)  # packed FP4
        atom = jnp.zeros(formats.atom_shape(1, 128, 4), jnp.uint8)
        with self.assertRaisesRegex(ValueError, "scaled_dot=True needs"):
            reference.gemm_amax_reference(a, a, atom, atom, k=128, sf_vec_size=32, c_dtype=jnp.float32,
                                          scaled_dot=True)


class ScaledDotDecisionTest(absltest.TestCase):

    def test_hopper_keeps_the_exact_route_blackwell_takes_xlas_block_scaled_dot(self):
        """Off on the H200, where it was no faster; on by default on compute capability 10.x (cuDNN's FP8 GEMM)."""
        e4 = jnp.float8_e4m3fn
        big = dict(sf_vec_size=32, l=1, m=8192, n=8192, k=8192)
        self.assertFalse(reference.use_scaled_dot(("cuda:9.0",), e4, e4, **big))
        self.assertFalse(reference.use_scaled_dot(("cpu",), e4, e4, **big))
        for kind in ("cuda:10.0", "cuda:10.3"):
            self.assertEqual(reference.use_scaled_dot((kind,), e4, e4, **big), reference.has_scaled_dot(), kind)
        self.assertFalse(reference.use_scaled_dot(("cuda:10.0", "cuda:9.0"), e4, e4, **big))  # a mixed machine

    def test_e4m3_only(self):
        """E5M2 never takes the route (its infinities did not follow SPEC §2 on the H200)."""
        e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
        big = dict(sf_vec_size=32, l=1, m=4096, n=24576, k=1536)
        self.assertEqual(reference.use_scaled_dot(("cuda:10.0",), e4, e4, **big), reference.has_scaled_dot())
        for a, b in ((e5, e5), (e4, e5), (e5, e4)):
            self.assertFalse(reference.use_scaled_dot(("cuda:10.0",), a, b, **big))

    def test_applies_only_to_mxfp8_in_whole_blocks(self):
        has = reference.has_scaled_dot()
        e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
        self.assertEqual(reference.scaled_dot_applies(e4, e5, sf_vec_size=32, k=96), has)
        self.assertFalse(reference.scaled_dot_applies(e4, e4, sf_vec_size=32, k=80))  # a partial last block
        self.assertFalse(reference.scaled_dot_applies(e4, e4, sf_vec_size=16, k=96))
        self.assertFalse(reference.scaled_dot_applies(jnp.uint8, jnp.uint8, sf_vec_size=32, k=96))

    def test_threshold_per_device_kind(self):
        args = dict(sf_vec_size=32, l=1, m=64, n=64, k=64)
        e4 = jnp.float8_e4m3fn
        with _scaled_dot_table({"cuda:9.0": 64 ** 3}):
            self.assertEqual(reference.use_scaled_dot(("cuda:9.0",), e4, e4, **args), reference.has_scaled_dot())
            self.assertFalse(reference.use_scaled_dot(("cuda:9.0",), e4, e4, **{**args, "m": 63}))
            self.assertFalse(reference.use_scaled_dot(("cuda:9.0", "cuda:8.0"), e4, e4, **args))  # an A100 too
            self.assertFalse(reference.use_scaled_dot(("cuda",), e4, e4, **args))  # no GPU seen at lowering
            self.assertFalse(reference.use_scaled_dot(("cuda:9.0", "cpu"), e4, e4, **args))
            self.assertFalse(reference.use_scaled_dot(("cpu",), e4, e4, **args))

    @absltest.skipUnless(reference.has_scaled_dot(), _NO_SCALED_DOT)
    def test_the_primitive_follows_the_decision(self):
        """With implementation=None the lowering emits XLA's scaled-dot composite exactly when the decision says so,
        with the same result; implementation="xla" (the exact reference) never does."""
        rng = np.random.default_rng(9)
        inp = oracle_ops.random_gemm_inputs(rng, l=1, m=64, n=96, k=128, fmt="mxfp8_e4m3")
        args = [jnp.asarray(inp[x][0]) for x in ("a", "b", "sfa", "sfb")]
        c_ref, amax_ref = oracle_ops.gemm_amax_oracle(inp["a"], inp["b"], inp["sfa"], inp["sfb"], k=128,
                                                      sf_vec_size=32)
        cpu = jax.devices("cpu")[0]  # on the CPU: on a GPU, None may take a kernel instead of the reference
        args = [jax.device_put(x, cpu) for x in args]
        cases = (({}, None, False), ({"cpu": 0}, None, True), ({"cpu": 0}, "xla", False))
        for table, implementation, expected in cases:
            with _scaled_dot_table(table):
                fn = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation=implementation))
                hlo = fn.trace(*args).lower(lowering_platforms=("cpu",)).as_text()
                self.assertEqual("xla.scaled_dot" in hlo, expected, (table, implementation))
                with jax.default_device(cpu):
                    c, amax = fn(*args)
            oracle_ops.assert_gemm_close(self, np.asarray(c), c_ref[0], c_dtype="float32")
            oracle_ops.assert_amax_close(self, np.asarray(amax), amax_ref)


class ProjRopeScaledDotRouteTest(parameterized.TestCase):
    """proj_rope's MXFP8 GEMM through jax.lax.scaled_dot (what None takes on Blackwell), on the CPU: within SPEC §7 of
    the float64 oracle, and taken exactly where the decision says so."""

    @absltest.skipUnless(reference.has_scaled_dot(), _NO_SCALED_DOT)
    @parameterized.parameters(True, False)
    def test_route_matches_the_oracle(self, w_out_in):
        rng = np.random.default_rng(21)
        inp = oracle_ops.random_proj_rope_inputs(rng, t=64, h=2, k=96, mxfp8=True, w_out_in=w_out_in)
        args = [jnp.asarray(inp[n]) for n in ("x", "w", "cos", "sin")]
        scales = dict(x_scale=jnp.asarray(inp["x_scale"]), w_scale=jnp.asarray(inp["w_scale"]))
        y_ref = oracle_ops.proj_rope_oracle(inp["x"], inp["w"], inp["cos"], inp["sin"], x_scale=inp["x_scale"],
                                            w_scale=inp["w_scale"], w_out_in=w_out_in)
        cases = (({"cpu": 0}, None, True), ({"cpu": 0}, "xla", False), ({}, None, False))
        for table, implementation, expected in cases:
            with _scaled_dot_table(table):
                fn = jax.jit(lambda *a, **kw: jbg.gemm_proj_rope_mxfp8(*a, **kw, w_out_in=w_out_in,
                                                                       implementation=implementation))
                hlo = fn.trace(*args, **scales).lower(lowering_platforms=("cpu",)).as_text()
                self.assertEqual("xla.scaled_dot" in hlo, expected, (table, implementation))
                outs = [np.asarray(o) for o in fn(*args, **scales)]
            oracle_ops.assert_proj_rope_close(self, outs, y_ref)

    def test_bf16_inputs_never_take_it(self):
        rng = np.random.default_rng(22)
        inp = oracle_ops.random_proj_rope_inputs(rng, t=32, h=1, k=64, mxfp8=False)
        with _scaled_dot_table({"cpu": 0}):
            fn = jax.jit(lambda *a: jbg.gemm_proj_rope_mxfp8(*a))
            hlo = fn.trace(*(jnp.asarray(inp[n]) for n in ("x", "w", "cos", "sin"))).lower(
                lowering_platforms=("cpu",)).as_text()
        self.assertNotIn("xla.scaled_dot", hlo)


def _scaled_dot_table(table: dict):
    """arch.scaled_dot_min_size answering from `table` (device kind -> smallest L*M*N*K), e.g. {"cpu": 0}."""
    from jax_blockgemm import arch

    return mock.patch.object(arch, "scaled_dot_min_size", side_effect=table.get)


if __name__ == "__main__":
    absltest.main()
