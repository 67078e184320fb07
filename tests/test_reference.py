"""The pure-JAX reference (jax_blockgemm.reference) against the float64 oracles of tests/oracle_ops.py.

Every case runs under jax.jit on fresh random codes with random non-trivial scales, at round shapes and at odd
ones (M, N tails inside the 128-row scale atom, K with padded scale columns).
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg
from jax_blockgemm import formats, reference

import oracle_ops

C_DTYPES_WIDE = ("float32", "float16", "bfloat16")

# log2 range of the random block scales per (A/B format, C dtype): keeps C inside a narrow C dtype's range (under
# 5% saturated) while still spanning several binades. float32 C uses the wide default.
_FP8_C, _FP4_C = ("float8_e4m3fn", "float8_e5m2"), ("float4_e2m1fn",)
_SCALE_LOG2 = {
    ("mxfp8_e4m3", "16bit"): (-4, 0), ("mxfp8_e5m2", "16bit"): (-6, -2),
    ("mxfp4", "16bit"): (-4, 4), ("nvfp4", "16bit"): (-4, 4),
    ("mxfp4", "fp8"): (-5, -1), ("nvfp4", "fp8"): (-5, -1),
    ("mxfp4", "fp4"): (-6, -2), ("nvfp4", "fp4"): (-6, -2),
}


def _scale_log2(fmt, c_dtype):
    if c_dtype == "float32":
        return None
    kind = "fp8" if c_dtype in _FP8_C else "fp4" if c_dtype in _FP4_C else "16bit"
    return _SCALE_LOG2[(fmt, kind)]


def _seed(*key) -> int:
    """A per-case seed that is stable across runs (str hashes are salted per process)."""
    return zlib.crc32(repr(key).encode())


def _run_gemm(inp, *, c_dtype, a_major="k", b_major="k", c_major="n", use_alpha=False):
    fn = jax.jit(functools.partial(reference.gemm_amax_reference, k=inp["k"], sf_vec_size=inp["sf_vec_size"],
                                   c_dtype=jnp.dtype(c_dtype), a_major=a_major, b_major=b_major, c_major=c_major))
    alpha = jnp.float32(inp["alpha"]) if use_alpha else None
    c, amax = fn(jnp.asarray(inp["a"]), jnp.asarray(inp["b"]), jnp.asarray(inp["sfa_atom"]),
                 jnp.asarray(inp["sfb_atom"]), alpha=alpha)
    return np.asarray(c), np.asarray(amax)


def _oracle(inp, *, a_major="k", b_major="k", use_alpha=False):
    return oracle_ops.gemm_amax_oracle(inp["a"], inp["b"], inp["sfa"], inp["sfb"], k=inp["k"],
                                       sf_vec_size=inp["sf_vec_size"], a_major=a_major, b_major=b_major,
                                       alpha=inp["alpha"] if use_alpha else None)


class GemmAmaxReferenceTest(parameterized.TestCase):

    def _check(self, *, l, m, n, k, fmt, c_dtype, a_major="k", b_major="k", c_major="n", use_alpha=False,
               seed=0):
        rng = np.random.default_rng(seed)
        inp = oracle_ops.random_gemm_inputs(rng, l=l, m=m, n=n, k=k, fmt=fmt, a_major=a_major, b_major=b_major,
                                            scale_log2=_scale_log2(fmt, c_dtype))
        c, amax = _run_gemm(inp, c_dtype=c_dtype, a_major=a_major, b_major=b_major, c_major=c_major,
                            use_alpha=use_alpha)
        c_ref, amax_ref = _oracle(inp, a_major=a_major, b_major=b_major, use_alpha=use_alpha)
        self.assertFalse(np.isnan(amax_ref).any())
        oracle_ops.assert_gemm_close(self, c, c_ref, c_dtype=c_dtype, c_major=c_major)
        self.assertEqual(amax.shape, (l,))
        oracle_ops.assert_amax_close(self, amax, amax_ref)

    @parameterized.parameters(*[dict(fmt=f, c_dtype=c, shape=s) for f in ("mxfp8_e4m3", "mxfp8_e5m2")
                                for c, s in zip(C_DTYPES_WIDE, ((1, 128, 128, 128), (3, 200, 72, 80),
                                                                (3, 200, 72, 80)))])
    def test_mxfp8(self, fmt, c_dtype, shape):
        l, m, n, k = shape
        self._check(l=l, m=m, n=n, k=k, fmt=fmt, c_dtype=c_dtype, seed=_seed(fmt, c_dtype, shape))

    @parameterized.product(a_major=("k", "m"), b_major=("k", "n"), c_major=("n", "m"))
    def test_mxfp8_majors(self, a_major, b_major, c_major):
        self._check(l=2, m=136, n=48, k=96, fmt="mxfp8_e4m3", c_dtype="bfloat16", a_major=a_major,
                    b_major=b_major, c_major=c_major, seed=ord(a_major) * 7 + ord(b_major) * 3 + ord(c_major))

    @parameterized.product(a_major=("k", "m"), b_major=("k", "n"), c_major=("n", "m"))
    def test_rows_do_not_depend_on_the_other_rows(self, a_major, b_major, c_major):
        """128 rows of M and of N (one scale atom each: the finest split the partitioning rules make) give the same
        bits as those rows of the whole product, in every major: what lets a sharded call equal the unsharded one.

        On XLA:CPU an MN-major operand used to reach the dot as is, which XLA:CPU runs through Eigen, whose edge
        tiles sum K in another order than its inner ones (rows 126-127 of a 128-row shard differed in low bits from
        the whole product's on an AVX2 machine); the reference now transposes MN-major codes to K-major first.
        """
        m, n, m0, n0 = 512, 256, 384, 128  # the last 128-row block of M and the second of N
        inp = oracle_ops.random_gemm_inputs(np.random.default_rng(_seed(a_major, b_major, c_major)), l=1, m=m, n=n,
                                            k=96, fmt="mxfp8_e4m3", a_major=a_major, b_major=b_major)
        majors = dict(c_dtype="float32", a_major=a_major, b_major=b_major, c_major=c_major)
        c, _ = _run_gemm(inp, **majors)
        rows = lambda x, major, r0: x[:, r0:r0 + 128] if major == "k" else x[:, :, r0:r0 + 128]
        atom = lambda x, r0: x[:, r0 // 128:r0 // 128 + 1]  # (L, MN', K', 32, 4, 4): one 128-row atom
        part = dict(inp, a=rows(inp["a"], a_major, m0), b=rows(inp["b"], b_major, n0),
                    sfa_atom=atom(inp["sfa_atom"], m0), sfb_atom=atom(inp["sfb_atom"], n0))
        c_part, _ = _run_gemm(part, **majors)
        want = c[:, m0:m0 + 128, n0:n0 + 128] if c_major == "n" else c[:, n0:n0 + 128, m0:m0 + 128]
        np.testing.assert_array_equal(c_part, want)

    @parameterized.product(
        fmt_alpha=(("mxfp4", False), ("nvfp4", False), ("nvfp4", True)),
        c_dtype=C_DTYPES_WIDE + ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"),
    )
    def test_fp4(self, fmt_alpha, c_dtype):
        fmt, use_alpha = fmt_alpha
        # K = 96: 3 MXFP4 blocks / 6 NVFP4 blocks, neither a multiple of 4: the atom's padded scale columns
        self._check(l=2, m=130, n=64, k=96, fmt=fmt, c_dtype=c_dtype, use_alpha=use_alpha,
                    seed=_seed(fmt, use_alpha, c_dtype))

    @parameterized.parameters("float32", "bfloat16", "float8_e4m3fn", "float4_e2m1fn")
    def test_fp4_round_and_c_major_m(self, c_dtype):
        c_major = "n" if c_dtype == "float4_e2m1fn" else "m"
        self._check(l=1, m=256, n=128, k=256, fmt="nvfp4", c_dtype=c_dtype, c_major=c_major, use_alpha=True,
                    seed=11)

    def test_long_k_stays_fp32(self):
        """K = 4096 with a large dynamic range: bf16 accumulation or TF32 would miss 1e-5 by orders of magnitude."""
        self._check(l=1, m=40, n=24, k=4096, fmt="mxfp8_e4m3", c_dtype="float32", seed=5)

    def test_alpha_per_batch(self):
        """alpha as the primitive passes it, one value per batch entry."""
        rng = np.random.default_rng(6)
        inp = oracle_ops.random_gemm_inputs(rng, l=3, m=64, n=32, k=64, fmt="nvfp4")
        alpha = np.array([0.25, 3.0, 0.7], np.float32)
        fn = jax.jit(functools.partial(reference.gemm_amax_reference, k=64, sf_vec_size=16, c_dtype=jnp.float32))
        c, amax = fn(*(jnp.asarray(inp[x]) for x in ("a", "b", "sfa_atom", "sfb_atom")), alpha=jnp.asarray(alpha))
        c_ref, _ = _oracle(inp)
        c_ref = c_ref * alpha[:, None, None].astype(np.float64)
        oracle_ops.assert_gemm_close(self, np.asarray(c), c_ref, c_dtype=jnp.float32)
        oracle_ops.assert_amax_close(self, np.asarray(amax), np.max(np.abs(c_ref), axis=(1, 2)))

    @parameterized.parameters(("mxfp8_e4m3", "float32"), ("mxfp8_e5m2", "bfloat16"), ("mxfp4", "float8_e4m3fn"),
                              ("nvfp4", "float16"))
    def test_nan_scale_poisons_c_and_amax(self, fmt, c_dtype):
        rng = np.random.default_rng(7)
        inp = oracle_ops.random_gemm_inputs(rng, l=2, m=160, n=64, k=64, fmt=fmt)
        nan_byte = np.uint8(0xFF) if inp["scale_dtype"] == np.uint8 else np.array(np.nan, inp["scale_dtype"])
        inp["sfa"][1, 137, 1] = nan_byte
        inp["sfa_atom"] = oracle_ops.oracle.compact_to_atom_np(inp["sfa"])
        c, amax = _run_gemm(inp, c_dtype=c_dtype)
        c_ref, amax_ref = _oracle(inp)
        self.assertTrue(np.isnan(amax[1]))
        self.assertFalse(np.isnan(amax[0]))
        c = c.astype(np.float32)
        self.assertTrue(np.isnan(c[1, 137]).all())
        self.assertEqual(int(np.isnan(c).sum()), c.shape[2])
        oracle_ops.assert_gemm_close(self, c.astype(np.dtype(c_dtype)), c_ref, c_dtype=c_dtype)
        oracle_ops.assert_amax_close(self, amax, amax_ref)

    def test_checks_catch_wrong_results(self):
        """The oracle checks are not vacuous: a one-element error, a flipped code or a stray NaN fails them."""
        rng = np.random.default_rng(8)
        inp = oracle_ops.random_gemm_inputs(rng, l=1, m=64, n=32, k=64, fmt="mxfp4", scale_log2=(-5, -1))
        c_ref, amax_ref = _oracle(inp)
        for c_dtype in ("float32", "bfloat16", "float8_e4m3fn"):
            c, _ = _run_gemm(inp, c_dtype=c_dtype)
            bad = c.astype(np.float32)
            bad[0, 3, 5] = bad[0, 3, 5] * 1.5 + 1.0
            with self.assertRaises(AssertionError):
                oracle_ops.assert_gemm_close(self, bad.astype(c.dtype), c_ref, c_dtype=c_dtype)
            bad[0, 3, 5] = np.nan
            with self.assertRaises(AssertionError):
                oracle_ops.assert_gemm_close(self, bad.astype(c.dtype), c_ref, c_dtype=c_dtype)
        with self.assertRaises(AssertionError):
            oracle_ops.assert_amax_close(self, np.float32(np.nan), amax_ref)
        with self.assertRaises(AssertionError):
            oracle_ops.assert_amax_close(self, amax_ref * (1 + 1e-4), amax_ref)


class DequantizeTest(parameterized.TestCase):

    @parameterized.parameters((0, "e8m0"), (1, "e8m0"), (2, "e8m0"), (1, "e4m3"))
    def test_matches_oracle_on_partial_blocks(self, axis, kind):
        """code x scale, exact, with a partial last block (n = 70, block 16/32) along any axis; NaN scale -> NaN."""
        rng = np.random.default_rng(_seed("dequantize", axis, kind))
        shape = [3, 5, 7]
        shape[axis] = 70
        block = 32 if kind == "e8m0" else 16
        codes = np.clip(rng.standard_normal(shape) * 50, -448, 448).astype(np.float32).astype(oracle_ops.E4M3)
        s_shape = list(shape)
        s_shape[axis] = -(-70 // block)
        if kind == "e8m0":
            scales = oracle_ops.oracle.random_scale_bytes(rng, s_shape)
            scales.reshape(-1)[4] = 0xFF
        else:
            scales = np.exp2(rng.uniform(-4, 4, s_shape)).astype(oracle_ops.E4M3)
        fn = jax.jit(functools.partial(reference.dequantize_bf16, block=block, axis=axis))
        got = np.asarray(fn(jnp.asarray(codes), jnp.asarray(scales))).astype(np.float64)
        want = oracle_ops.oracle.dequantize_f64(codes, scales, block=block, axis=axis)
        np.testing.assert_array_equal(got, want)  # NaN positions must agree too
        if kind == "e8m0":
            self.assertGreater(int(np.isnan(want).sum()), 0)


    def test_scale_byte_zero_is_two_to_the_minus_127(self):
        """E8M0 byte 0 means 2^-127 (SPEC §1), a float32 subnormal that XLA:CPU flushes: code·2^-127 is still exact
        wherever it is a normal number (codes of 2 and more), through dequantize, the reference GEMM and the
        weight-only matmul, eagerly and under jit; the product read as zero before."""
        rng = np.random.default_rng(_seed("byte zero"))
        codes = np.clip(rng.standard_normal((3, 64)) * 100, -448, 448).astype(np.float32).astype(oracle_ops.E4M3)
        codes[:, ::2] = np.asarray(448.0, oracle_ops.E4M3)
        scales = np.zeros((3, 2), np.uint8)
        scales[1, 1] = 120
        want = oracle_ops.oracle.dequantize_f64(codes, scales, block=32, axis=1)
        big = np.abs(want) >= 2.0 ** -126
        self.assertGreater(int(big.sum()), 90)
        for fn in (functools.partial(reference.dequantize_bf16, block=32, axis=1),
                   jax.jit(functools.partial(formats.dequantize, block=32, axis=1))):
            got = np.asarray(fn(jnp.asarray(codes), jnp.asarray(scales))).astype(np.float64)
            np.testing.assert_array_equal(got[big], want[big])
        b = np.full((4, 64), 2.0 ** 100, np.float32)  # E4M3 1.0 at byte 227: products of 448·2^-127·2^100
        b_codes, b_scales = np.ones((4, 64), oracle_ops.E4M3), np.full((4, 2), 227, np.uint8)
        c, amax = jax.jit(jbg.gemm_amax)(jnp.asarray(codes), jnp.asarray(b_codes), jnp.asarray(scales),
                                         jnp.asarray(b_scales))
        c_ref = want @ b.astype(np.float64).T
        np.testing.assert_allclose(np.asarray(c), c_ref, rtol=1e-6)
        self.assertGreater(float(np.min(np.abs(np.asarray(c)[0]))), 0.0)
        self.assertAlmostEqual(float(amax) / float(np.max(np.abs(c_ref))), 1.0, places=6)
        # blocks that quantize at byte 0 (amax below 2^-119 for E4M3, 2^-124 for E2M1) with values of 2^-126 and up
        e4m3 = np.arange(1, 33, dtype=np.float32) * np.float32(2.0 ** -124)
        e2m1 = np.tile(np.asarray([2, 3, 4, 6], np.float32), 8) * np.float32(2.0 ** -127)
        for fmt, quantize, x in (("mxfp8_e4m3", formats.quantize_mxfp8, e4m3), ("mxfp4", formats.quantize_mxfp4, e2m1)):
            x = x[None]
            self.assertEqual(np.asarray(quantize(jnp.asarray(x))[1]).tolist(), [[0]])
            want = oracle_ops.fake_quant_f64(x, fmt, axis=1)
            normal = np.abs(want) >= 2.0 ** -126
            self.assertGreater(int(normal.sum()), 20)
            got = np.asarray(jax.jit(formats.quantize_dequantize, static_argnums=1)(jnp.asarray(x), fmt))
            np.testing.assert_array_equal(got[normal], want[normal])


class ConvertCTest(parameterized.TestCase):
    """The accumulator -> C conversion is exactly round-to-nearest-even (saturating for FP8/FP4), ties included."""

    @parameterized.parameters("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn")
    def test_narrow_c_is_rne_and_saturates(self, c_dtype):
        dtype = np.dtype(c_dtype)
        grid = oracle_ops._finite_grid(dtype)
        rng = np.random.default_rng(_seed("convert", c_dtype))
        mids = (grid[1:] + grid[:-1]) / 2  # exact ties in float32 for these grids
        vals = np.concatenate([grid, mids, rng.uniform(-1.2, 1.2, 4000) * grid[-1],
                               [grid[-1] * 4, -grid[-1] * 4, 3e38, -3e38]])
        vals = vals.astype(np.float32)
        vals = vals[: len(vals) // 2 * 2].reshape(1, -1, 2)
        got = np.asarray(jax.jit(functools.partial(reference.convert_c, c_dtype=dtype))(jnp.asarray(vals)))
        got = oracle_ops.oracle.codes_to_f64(got) if dtype == oracle_ops.E2M1 else got.astype(np.float64)
        want = oracle_ops.oracle.round_to_dtype_f64(vals.astype(np.float64), dtype).astype(np.float64)
        np.testing.assert_array_equal(got, want)

    @parameterized.parameters("float16", "bfloat16")
    def test_16bit_c_is_rne(self, c_dtype):
        dtype = np.dtype(c_dtype)
        grid = oracle_ops._finite_grid(dtype)
        rng = np.random.default_rng(_seed("convert", c_dtype))
        pick = grid[rng.integers(0, len(grid) - 1, 3000)]
        above = grid[np.searchsorted(grid, pick) + 1]
        ties = (pick + above) / 2  # exact in float32
        inside = pick + (above - pick) * rng.uniform(0, 1, pick.shape)
        vals = np.concatenate([ties, inside]).astype(np.float32)
        got = np.asarray(jax.jit(functools.partial(reference.convert_c, c_dtype=dtype))(jnp.asarray(vals)))
        got = got.astype(np.float64)
        even = (pick.astype(dtype).view(np.uint16) & 1) == 0
        np.testing.assert_array_equal(got[: len(ties)], np.where(even, pick, above))
        dist = oracle_ops._step_distance(got, vals.astype(np.float64), dtype, saturate=False)
        self.assertEqual(int(dist.max()), 0)


def _run_proj_rope(inp, *, w_out_in):
    fn = jax.jit(functools.partial(reference.gemm_proj_rope_reference, w_out_in=w_out_in))
    scales = {}
    if inp["x_scale"] is not None:
        scales = dict(x_scale=jnp.asarray(inp["x_scale"]), w_scale=jnp.asarray(inp["w_scale"]))
    return [np.asarray(o) for o in fn(*(jnp.asarray(inp[n]) for n in ("x", "w", "cos", "sin")), **scales)]


class ProjRopeReferenceTest(parameterized.TestCase):

    @parameterized.product(mxfp8=(False, True), w_out_in=(True, False), th=((32, 1, 64), (96, 3, 160)))
    def test_matches_oracle(self, mxfp8, w_out_in, th):
        t, h, k = th
        rng = np.random.default_rng(_seed(mxfp8, w_out_in, th))
        inp = oracle_ops.random_proj_rope_inputs(rng, t=t, h=h, k=k, mxfp8=mxfp8, w_out_in=w_out_in)
        outs = _run_proj_rope(inp, w_out_in=w_out_in)
        shapes = [o.shape for o in outs]
        self.assertEqual(shapes, [(t, h, 192), (t, h, 6), (t, h, 192), (t // 32, h, 192)])
        y_ref = oracle_ops.proj_rope_oracle(inp["x"], inp["w"], inp["cos"], inp["sin"], x_scale=inp["x_scale"],
                                            w_scale=inp["w_scale"], w_out_in=w_out_in)
        oracle_ops.assert_proj_rope_close(self, outs, y_ref)

    def test_rope_moves_the_right_features(self):
        """RoPE alone (float32) against the float64 oracle's rope, to the last bit the fp32 products allow."""
        rng = np.random.default_rng(3)
        y = rng.standard_normal((32, 2, 192)).astype(np.float32)
        angles = rng.uniform(-3, 3, (32, 64))
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        got = np.asarray(jax.jit(reference.apply_rope)(y, cos, sin))
        want = oracle_ops.rope_f64(y.astype(np.float64), cos, sin)
        np.testing.assert_array_equal(got[..., :128], y[..., :128])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        self.assertGreater(np.abs(got[..., 128:] - y[..., 128:]).max(), 0.1)

    def test_checks_catch_wrong_results(self):
        rng = np.random.default_rng(4)
        inp = oracle_ops.random_proj_rope_inputs(rng, t=32, h=1, k=64, mxfp8=False)
        outs = _run_proj_rope(inp, w_out_in=True)
        y_ref = oracle_ops.proj_rope_oracle(inp["x"], inp["w"], inp["cos"], inp["sin"])
        # skipping RoPE must fail the check
        y_norope = oracle_ops.proj_rope_oracle(inp["x"], inp["w"], inp["cos"] * 0 + 1, inp["sin"] * 0)
        with self.assertRaises(AssertionError):
            oracle_ops.assert_proj_rope_close(self, outs, y_norope)
        for i, value in ((0, np.nan), (1, 0xFF), (2, 300.0)):
            bad = [o.copy() for o in outs]
            flat = bad[i].reshape(-1)
            flat[5] = np.array(value).astype(flat.dtype)
            with self.assertRaises(AssertionError):
                oracle_ops.assert_proj_rope_close(self, bad, y_ref)
        oracle_ops.assert_proj_rope_close(self, outs, y_ref)


if __name__ == "__main__":
    absltest.main()
