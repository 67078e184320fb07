"""GPU: the weight_stream decode kernel through the public API, against float64 oracles (runs where a kernel exists).

`weight_only_matmul` (bf16 x, compact scales) and small-M `gemm_amax` (A dequantized to bf16, the weight's atom
scales), both with implementation="cutedsl", on fresh random codes over each format's whole range with random
scales: one token, full and partial token tiles, N and K tails, L > 1, a K long enough to wrap every warp's
shared-memory ring twice, NaN codes and scales. Outputs are poisoned before every launch (an unwritten element reads
NaN and fails).
Skipped without a CUDA GPU that has kernels (CI has none); on the H200:
`python -m pytest tests/test_gpu_weight_stream.py`.
"""

import os

os.environ["JAX_BLOCKGEMM_POISON_OUTPUTS"] = "1"

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg
from jax_blockgemm import arch, dispatch, formats
from jax_blockgemm.kernels import weight_stream

import oracle_ops
import oracle_weight_only

FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4")
IMPLEMENTATION = "cutedsl"  # what the tests force (a dry run of their logic can set "xla")
# K wrapping every warp's shared-memory ring twice for the widest chunk (FP4's) and the deepest ring, with a tail
_FP4_CHUNK = weight_stream.WeightStreamGemm(w_dtype="float4_e2m1fn").chunk
K_WRAP = 2 * weight_stream.MAX_STAGES * weight_stream.WARPS * _FP4_CHUNK + 96
# (L, M, N, K): one token; a full 16-token tile; a partial 64-token tile; N and K tails; the ring wrapped twice
SHAPES = ((1, 1, 200, 96), (2, 16, 129, 544), (1, 37, 64, 4096), (3, 64, 333, 1024), (1, 5, 72, K_WRAP))
# gemm_amax's contract wants 16-byte rows of C: the same shapes with N rounded up to 8 (still not a multiple of 32)
GEMM_SHAPES = tuple((l, m, -(-n // 8) * 8, k) for l, m, n, k in SHAPES)


def _has_kernel_gpu() -> bool:
    caps = dispatch.local_cuda_capabilities()
    return bool(caps) and all(arch.target_of(cc) for cc in caps)


def _gemm_amax_against_oracle(test, seed, fmt, shape, c_dtype, *, a_major="k", c_major="n",
                              call="jbg_weight_stream", compact=False):
    """gemm_amax on fresh random inputs (scales narrowed where C's dtype needs it; in atoms, or `compact`), lowered
    to the decode kernel (custom call `call`), against the float64 oracle: C within SPEC §7 for its dtype, amax."""
    l, m, n, k = shape
    rng = np.random.default_rng(hash(seed) % 2**32)
    low_precision = c_dtype in ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn")
    narrow = (-3.0, 1.0) if c_dtype == "float16" else (-2.0, 0.0) if low_precision else None  # C in range
    d = oracle_ops.random_gemm_inputs(rng, l=l, m=m, n=n, k=k, fmt=fmt, a_major=a_major, scale_log2=narrow)
    alpha = jnp.float32(d["alpha"]) if fmt == "nvfp4" else None
    args = [jnp.asarray(d[name]) for name in ("a", "b", *(("sfa", "sfb") if compact else ("sfa_atom", "sfb_atom")))]
    f = jax.jit(lambda *a: jbg.gemm_amax(*a, alpha=alpha, c_dtype=jnp.dtype(c_dtype), a_major=a_major,
                                         c_major=c_major, sf_vec_size=d["sf_vec_size"],
                                         implementation=IMPLEMENTATION))
    if IMPLEMENTATION == "cutedsl":
        test.assertIn(call, f.lower(*args).as_text())
    c, amax = f(*args)
    c_ref, amax_ref = oracle_ops.gemm_amax_oracle(d["a"], d["b"], d["sfa"], d["sfb"], k=k,
                                                  sf_vec_size=d["sf_vec_size"], a_major=a_major,
                                                  alpha=d["alpha"] if fmt == "nvfp4" else None)
    oracle_ops.assert_gemm_close(test, np.asarray(c), c_ref, c_dtype=jnp.dtype(c_dtype), c_major=c_major)
    oracle_ops.assert_amax_close(test, np.asarray(amax), amax_ref.max())


def _check_amax_is_each_calls_own(test, m):
    """amax is each call's own: the CTAs fold their max into the call site's tally, which the last CTA of a batch
    empties into amax and leaves zero. One compiled call site of `m` rows run on large values, small ones, with a
    NaN scale, then small ones again gives each call's own max |C|, never a previous call's (a NaN does not stick
    either)."""
    rng = np.random.default_rng(5)
    l, n, k = 2, 336, 1024  # 11 CTAs of 32 weight rows per batch (6 of 64), the last one part full
    f = jax.jit(lambda *a: jbg.gemm_amax(*a, c_dtype=jnp.float32, implementation=IMPLEMENTATION))
    for scale_log2, nan in (((8.0, 12.0), False), ((-12.0, -8.0), False), ((-2.0, 2.0), True), ((-12.0, -8.0), False)):
        with test.subTest(m=m, scale_log2=scale_log2, nan=nan):
            d = oracle_ops.random_gemm_inputs(rng, l=l, m=m, n=n, k=k, fmt="mxfp8_e4m3", scale_log2=scale_log2)
            sfb = np.asarray(d["sfb_atom"]).copy()
            if nan:
                sfb.reshape(l, -1)[1, 0] = 0xFF  # a NaN scale byte in batch 1's first weight rows
            c, amax = f(*(jnp.asarray(d[x]) for x in ("a", "b", "sfa_atom")), jnp.asarray(sfb))
            c = np.asarray(c)
            test.assertEqual(np.isnan(c).any(), nan)
            if nan:
                test.assertTrue(np.isnan(float(amax)))
            else:
                test.assertEqual(float(amax), float(np.abs(c).max()))


def _check_amax_per_batch_and_call_site(test, m):
    """Under vmap each batch's amax is its own (batches of very different magnitudes share one launch and one tally,
    a word pair per batch), and two call sites in one program, each run twice, keep theirs apart (`m` rows)."""
    rng = np.random.default_rng(9)
    l, n, k = 3, 200, 512  # 7 CTAs of 32 weight rows per batch (4 of 64)

    def inputs(scale_log2):
        return oracle_ops.random_gemm_inputs(rng, l=l, m=m, n=n, k=k, fmt="mxfp8_e4m3", scale_log2=scale_log2)

    def one(a, b, sfa, sfb):
        return jbg.gemm_amax(a, b, sfa, sfb, c_dtype=jnp.float32, implementation=IMPLEMENTATION)

    batched = jax.vmap(lambda *x: one(*(y[None] for y in x)))
    f = jax.jit(lambda first, second: (batched(*first), batched(*second)))
    names = ("a", "b", "sfa_atom", "sfb_atom")
    for run in range(2):
        d1, d2 = inputs((6.0, 10.0)), inputs((-10.0, -6.0))
        for d in (d1, d2):  # batch 1 ten powers of two larger than its neighbours
            d["b"] = np.asarray(d["b"])
            sfb = np.asarray(d["sfb_atom"]).copy()
            sfb.reshape(l, -1)[1] = np.minimum(sfb.reshape(l, -1)[1].astype(int) + 10, 254).astype(np.uint8)
            d["sfb_atom"] = sfb
        out1, out2 = f([jnp.asarray(d1[x]) for x in names], [jnp.asarray(d2[x]) for x in names])
        for (c, amax), d in ((out1, d1), (out2, d2)):
            c, amax = np.asarray(c), np.asarray(amax)
            test.assertEqual(amax.shape, (l,))
            for i in range(l):
                with test.subTest(m=m, run=run, batch=i):
                    test.assertEqual(float(amax[i].reshape(())), float(np.abs(c[i]).max()))


def _scale_bytes_past_one_multiply(rng, m, fmt="mxfp8_e4m3"):
    """(bytes, x, w) per range of E8M0 scale bytes on both sides of the one-multiply limit (MXFP8 E4M3: 134, scales
    above 2^7 take two multiplies; MXFP4 in the swap_ab kernel: 128): a `fmt` weight (200, 1024) with those bytes and
    an x of `m` rows."""
    limit = 134 if fmt == "mxfp8_e4m3" else 128
    for low, high in ((limit - 34, limit), (limit - 14, limit + 16), (limit + 1, limit + 26)):
        w = oracle_weight_only.random_weight(rng, 200, 1024, fmt)
        scales = rng.integers(low, high + 1, size=np.shape(w.scales)).astype(np.uint8)
        w = jbg.QuantizedWeight(w.codes, jnp.asarray(scales), w.alpha, w.format)
        yield (low, high), oracle_weight_only.random_x(rng, (m, 1024), jnp.bfloat16), w


@absltest.skipUnless(_has_kernel_gpu(), "needs a CUDA GPU with a CuTeDSL kernel (sm_90a, or sm_100a after its "
                                        "first-use self-check)")
class GpuWeightStreamTest(parameterized.TestCase):
    """The weight_stream kernel itself: MXFP8 E4M3 calls of 17-64 rows, which arch.TABLE gives to the swap_ab
    kernel's decode tile, stay on it here (GpuDecodeSwapAbTest tests the tile)."""

    def setUp(self):
        super().setUp()
        self.enterContext(arch.overridden("9.0", decode_swap_ab_m={}))

    @parameterized.product(fmt=FORMATS, shape=SHAPES, out_dtype=("float32", "bfloat16"))
    def test_weight_only_matches_oracle(self, fmt, shape, out_dtype):
        l, m, n, k = shape
        rng = np.random.default_rng(hash((fmt, shape, out_dtype)) % 2**32)
        weights = [oracle_weight_only.random_weight(rng, n, k, fmt) for _ in range(l)]
        w = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *weights)  # L stacked weights: one batched call
        x = oracle_weight_only.random_x(rng, (l, m, k), jnp.bfloat16)
        y = jax.jit(jax.vmap(lambda x, w: jbg.weight_only_matmul(x, w, out_dtype=jnp.dtype(out_dtype),
                                                                  implementation="cutedsl")))(x, w)
        ref = np.stack([oracle_weight_only.weight_only_oracle(x[i], weights[i]) for i in range(l)])
        oracle_ops.assert_gemm_close(self, np.asarray(y), ref, c_dtype=jnp.dtype(out_dtype))

    @parameterized.product(fmt=FORMATS, shape=GEMM_SHAPES, c_dtype=("float32", "bfloat16", "float16"))
    def test_gemm_amax_small_m_matches_oracle(self, fmt, shape, c_dtype):
        _gemm_amax_against_oracle(self, (fmt, shape, c_dtype, "gemm"), fmt, shape, c_dtype)

    @parameterized.parameters(("mxfp4", "float8_e4m3fn", "k", "n"), ("nvfp4", "float8_e5m2", "k", "n"),
                              ("mxfp4", "float4_e2m1fn", "k", "n"), ("nvfp4", "float4_e2m1fn", "k", "n"),
                              ("mxfp8_e4m3", "bfloat16", "m", "n"), ("mxfp8_e4m3", "float32", "k", "m"),
                              ("mxfp8_e5m2", "float16", "m", "m"), ("nvfp4", "float32", "k", "m"))
    def test_gemm_amax_small_m_every_c_dtype_and_major(self, fmt, c_dtype, a_major, c_major):
        """The decode path for C dtypes the kernel does not write (it writes float32, XLA converts to FP8 or packed
        FP4) and for M-major A or C (XLA transposes)."""
        shape = (2, 16, 96, 544)  # M-major A: M a multiple of 16; packed FP4 C: N a multiple of 32
        _gemm_amax_against_oracle(self, (fmt, c_dtype, a_major, c_major), fmt, shape, c_dtype, a_major=a_major,
                                  c_major=c_major)

    def test_the_decode_kernel_is_what_runs(self):
        """A small-M call lowers to the weight_stream custom call, not the reference's dot."""
        w = oracle_weight_only.random_weight(np.random.default_rng(0), 64, 128, "mxfp4")
        x = jnp.ones((3, 128), jnp.bfloat16)
        text = jax.jit(lambda x, w: jbg.weight_only_matmul(x, w, implementation="cutedsl")).lower(x, w).as_text()
        self.assertIn("jbg_weight_stream", text)
        self.assertNotIn("dot_general", text)

    @parameterized.parameters("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4")
    def test_nan_scale_and_nan_code_poison_exactly_their_rows(self, fmt):
        rng = np.random.default_rng(7)
        w = oracle_weight_only.random_weight(rng, 100, 512, fmt)
        scales = np.asarray(w.scales).copy()
        scales.view(np.uint8)[3, 1] = 0x7F if fmt == "nvfp4" else 0xFF  # NaN scale byte in row 3
        codes = np.asarray(w.codes).copy()
        if fmt == "mxfp8_e4m3":
            codes.view(np.uint8)[11, 200] = 0x7F  # a NaN code in row 11 (finite scale)
            codes.view(np.uint8)[41, 300:302] = (0xFF, 0x7E)  # a negative NaN code, then 448 (a carry's neighbour)
        w = jbg.QuantizedWeight(jnp.asarray(codes), jnp.asarray(scales), w.alpha, fmt)
        x = oracle_weight_only.random_x(rng, (5, 512), jnp.bfloat16)
        y = np.asarray(jax.jit(lambda x, w: jbg.weight_only_matmul(x, w, out_dtype=jnp.float32,
                                                                    implementation="cutedsl"))(x, w))
        nan_rows = [3, 11, 41] if fmt == "mxfp8_e4m3" else [3]
        self.assertTrue(np.isnan(y[:, nan_rows]).all())
        self.assertFalse(np.isnan(np.delete(y, nan_rows, axis=1)).any())

    def test_large_e4m3_scales_take_the_two_multiply_path(self):
        """E8M0 bytes past 134 (scales above 2^7) do not fit the one-multiply form: warps whose chunk holds one
        multiply twice; bytes on both sides of the limit, mixed within chunks and within warps, match the oracle."""
        for scale_bytes, x, w in _scale_bytes_past_one_multiply(np.random.default_rng(11), 9):
            with self.subTest(bytes=scale_bytes):
                y = jax.jit(lambda x, w: jbg.weight_only_matmul(x, w, out_dtype=jnp.float32,
                                                                implementation="cutedsl"))(x, w)
                ref = oracle_weight_only.weight_only_oracle(x, w)
                oracle_ops.assert_gemm_close(self, np.asarray(y), ref, c_dtype=jnp.dtype(jnp.float32))

    def test_amax_is_each_calls_own(self):
        _check_amax_is_each_calls_own(self, m=3)

    def test_amax_per_batch_and_per_call_site(self):
        _check_amax_per_batch_and_call_site(self, m=5)

    def test_same_bits_on_every_run(self):
        """The split of K is reduced in a fixed order: repeated calls give identical bits."""
        rng = np.random.default_rng(3)
        w = oracle_weight_only.random_weight(rng, 4096, 7168, "mxfp8_e4m3")
        x = oracle_weight_only.random_x(rng, (16, 7168), jnp.bfloat16)
        f = jax.jit(lambda x, w: jbg.weight_only_matmul(x, w, out_dtype=jnp.float32, implementation="cutedsl"))
        first = np.asarray(f(x, w))
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(f(x, w)), first)



# (L, M, N, K) for the swap_ab decode tiles: each at its fewest and most rows, N off the 64-row tile, K off the
# 256-column padding (a multiple of 32: FP4's 16-byte rows) and long, L > 1. K's 256-column groups against the tiles'
# K parts (three at 16 and 32 tokens, two at 64): 1 and 2 groups (parts idle), 3 to 6, 9 and 16
SWAP_AB_SHAPES = ((1, 1, 200, 96), (2, 7, 136, 1312), (1, 12, 96, 1088), (1, 16, 72, 2080), (3, 16, 328, 800),
                  (1, 17, 200, 96), (2, 29, 72, 480), (2, 32, 72, 2080), (2, 40, 136, 544), (1, 64, 64, 4096),
                  (3, 64, 328, 1024))
SWAP_AB_FORMATS = ("mxfp8_e4m3", "mxfp4", "nvfp4")  # the weight formats the swap_ab kernel converts


@absltest.skipUnless(_has_kernel_gpu() and set(dispatch.local_cuda_capabilities() or ()) == {"9.0"},
                     "needs an sm_90a GPU (the swap_ab decode tile exists for sm_90a only)")
class GpuDecodeSwapAbTest(parameterized.TestCase):
    """Decode-sized calls of 1-64 rows against MXFP8 E4M3, MXFP4 and NVFP4 weights on the swap_ab ragged kernel's
    decode tiles (one group of M tokens), through the public API, against the float64 oracle, outputs poisoned. The
    tiles are tested over that whole range and at every weight size, whatever part of it arch.TABLE's
    decode_swap_ab_m and decode_swap_ab_small give them."""

    def setUp(self):
        super().setUp()
        self.enterContext(arch.overridden("9.0", decode_swap_ab_m={fmt: (1, 64) for fmt in SWAP_AB_FORMATS},
                                          decode_swap_ab_small=(0, 0, 0)))

    def _weight_only(self, x, w, out_dtype=jnp.float32):
        f = jax.jit(lambda x, w: jbg.weight_only_matmul(x, w, out_dtype=out_dtype, implementation=IMPLEMENTATION))
        if IMPLEMENTATION == "cutedsl":
            text = f.lower(x, w).as_text()
            self.assertIn("jbg_ragged_gemm_amax", text)
            self.assertNotIn("jbg_weight_stream", text)
        return np.asarray(f(x, w))

    @parameterized.product(fmt=SWAP_AB_FORMATS, shape=SWAP_AB_SHAPES, out_dtype=("float32", "bfloat16"))
    def test_weight_only_matches_oracle(self, fmt, shape, out_dtype):
        l, m, n, k = shape
        rng = np.random.default_rng(hash((fmt, shape, out_dtype, "swap_ab")) % 2**32)
        weights = [oracle_weight_only.random_weight(rng, n, k, fmt) for _ in range(l)]
        w = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *weights)
        x = oracle_weight_only.random_x(rng, (l, m, k), jnp.bfloat16)
        f = jax.jit(jax.vmap(lambda x, w: jbg.weight_only_matmul(x, w, out_dtype=jnp.dtype(out_dtype),
                                                                  implementation=IMPLEMENTATION)))
        if IMPLEMENTATION == "cutedsl":
            self.assertIn("jbg_ragged_gemm_amax", f.lower(x, w).as_text())
        y = f(x, w)
        ref = np.stack([oracle_weight_only.weight_only_oracle(x[i], weights[i]) for i in range(l)])
        oracle_ops.assert_gemm_close(self, np.asarray(y), ref, c_dtype=jnp.dtype(out_dtype))

    @parameterized.product(fmt=SWAP_AB_FORMATS, shape=SWAP_AB_SHAPES, c_dtype=("float32", "bfloat16"))
    def test_gemm_amax_matches_oracle(self, fmt, shape, c_dtype):
        _gemm_amax_against_oracle(self, (fmt, shape, c_dtype, "swap_ab"), fmt, shape, c_dtype,
                                  call="jbg_ragged_gemm_amax")

    @parameterized.product(shape=((2, 1, 200, 512), (1, 9, 136, 1792), (3, 16, 72, 256), (2, 17, 200, 512),
                                  (1, 64, 328, 768)), c_dtype=("float32", "bfloat16"))
    def test_gemm_amax_with_compact_scales(self, shape, c_dtype):
        """MXFP8 A and B with compact scales (as `formats.quantize_mxfp8` gives them) and K a multiple of 256: A
        dequantized by XLA as the tile takes it, the weight's scales read in place; C and amax against the oracle."""
        _gemm_amax_against_oracle(self, ("mxfp8_e4m3", shape, c_dtype, "compact"), "mxfp8_e4m3", shape, c_dtype,
                                  call="jbg_ragged_gemm_amax", compact=True)

    def test_chained_calls_read_what_the_kernels_before_them_wrote(self):
        """One program of eight decode GEMMs, each weight quantized in the program right before its call and each x
        the last call's output (quantized again for gemm_amax), against the same program on the reference: every
        step's kernel reads what the one before it wrote (the tiles in all three formats and gemm_amax's path)."""
        rng = np.random.default_rng(31)
        n = k = 512
        w16 = jnp.asarray(rng.standard_normal((8, n, k)), jnp.bfloat16)
        x0 = jnp.asarray(rng.standard_normal((4, k)), jnp.bfloat16)

        def chain(x, w16, implementation):
            outs = []
            for i in range(8):
                wi = w16[i] * (i + 1)
                if i % 2:
                    a, sfa = formats.quantize_mxfp8(x, axis=-1)
                    b, sfb = formats.quantize_mxfp8(wi, axis=-1)
                    x, _ = jbg.gemm_amax(a[None], b[None], sfa[None], sfb[None], c_dtype=jnp.bfloat16,
                                         implementation=implementation)
                    x = x[0]
                else:
                    w = jbg.quantize_weight(wi, SWAP_AB_FORMATS[i // 2 % 3])
                    x = jbg.weight_only_matmul(x, w, out_dtype=jnp.bfloat16, implementation=implementation)
                x = x / jnp.max(jnp.abs(x))
                outs.append(x)
            return jnp.stack(outs)

        ours = jax.jit(lambda x, w: chain(x, w, IMPLEMENTATION))
        if IMPLEMENTATION == "cutedsl":
            self.assertEqual(ours.lower(x0, w16).as_text().count("jbg_ragged_gemm_amax"), 8)
        got = np.asarray(ours(x0, w16), np.float32)
        want = np.asarray(jax.jit(lambda x, w: chain(x, w, "xla"))(x0, w16), np.float32)
        self.assertFalse(np.isnan(got).any())
        for i in range(8):  # each step within bf16 rounding of the reference's, which chains the same roundings
            np.testing.assert_allclose(got[i], want[i], atol=2e-2, err_msg=f"step {i}")

    def test_amax_is_each_calls_own(self):
        """The tiles fold amax through the call site's tally, as the decode kernel does (the 16-token tile with its
        three K parts, and the 64-token one with two)."""
        for m in (5, 40):
            _check_amax_is_each_calls_own(self, m=m)

    def test_amax_per_batch_and_per_call_site(self):
        for m in (5, 40):
            _check_amax_per_batch_and_call_site(self, m=m)

    @parameterized.parameters(("mxfp8_e4m3", "m", "n"), ("mxfp8_e4m3", "k", "m"), ("nvfp4", "k", "m"),
                              ("mxfp4", "k", "m"))
    def test_gemm_amax_either_major(self, fmt, a_major, c_major):
        for shape in ((2, 16, 96, 1312), (2, 48, 96, 544)):
            with self.subTest(shape=shape):
                _gemm_amax_against_oracle(self, (fmt, a_major, c_major, "swap_ab", shape), fmt, shape, "bfloat16",
                                          a_major=a_major, c_major=c_major, call="jbg_ragged_gemm_amax")

    def test_nan_scale_and_nan_code_poison_exactly_their_rows(self):
        rng = np.random.default_rng(17)
        w = oracle_weight_only.random_weight(rng, 100, 512, "mxfp8_e4m3")
        scales = np.asarray(w.scales).copy()
        scales.view(np.uint8)[3, 1] = 0xFF  # NaN scale byte in row 3
        codes = np.asarray(w.codes).copy()
        codes.view(np.uint8)[70, 200] = 0x7F  # a NaN code in row 70 (finite scale; the second 64-row tile)
        codes.view(np.uint8)[45, 300:302] = (0xFF, 0x7E)  # a negative NaN code, then 448 (a carry's neighbour)
        w = jbg.QuantizedWeight(jnp.asarray(codes), jnp.asarray(scales), w.alpha, "mxfp8_e4m3")
        for m in (5, 33):  # the 16-token tile (K in three parts) and the 64-token one
            y = self._weight_only(oracle_weight_only.random_x(rng, (m, 512), jnp.bfloat16), w)
            self.assertTrue(np.isnan(y[:, [3, 45, 70]]).all(), m)
            self.assertFalse(np.isnan(np.delete(y, [3, 45, 70], axis=1)).any(), m)

    @parameterized.parameters("mxfp8_e4m3", "mxfp4")
    def test_large_scales_take_the_two_multiply_path(self, fmt):
        for m, (scale_bytes, x, w) in ((m, case) for m in (13, 29)
                                       for case in _scale_bytes_past_one_multiply(np.random.default_rng(19), m, fmt)):
            with self.subTest(m=m, bytes=scale_bytes):
                oracle_ops.assert_gemm_close(self, self._weight_only(x, w), oracle_weight_only.weight_only_oracle(x, w),
                                             c_dtype=jnp.dtype(jnp.float32))

    @parameterized.parameters("mxfp4", "nvfp4")
    def test_fp4_nan_scale_poisons_exactly_its_row(self, fmt):
        """A NaN block scale (E8M0 byte 255; NVFP4's E4M3 0x7F) in weight row 3 and in row 70 (the second 64-row
        tile): NaN in exactly those columns of C (E2M1 has no NaN code)."""
        rng = np.random.default_rng(23)
        w = oracle_weight_only.random_weight(rng, 100, 512, fmt)
        scales = np.asarray(w.scales).copy()
        scales.view(np.uint8)[3, 1] = 0xFF if fmt == "mxfp4" else 0x7F
        scales.view(np.uint8)[70, 10] = 0xFF if fmt == "mxfp4" else 0x7F
        w = jbg.QuantizedWeight(w.codes, jnp.asarray(scales), w.alpha, fmt)
        for m in (5, 33):
            y = self._weight_only(oracle_weight_only.random_x(rng, (m, 512), jnp.bfloat16), w)
            self.assertTrue(np.isnan(y[:, [3, 70]]).all(), m)
            self.assertFalse(np.isnan(np.delete(y, [3, 70], axis=1)).any(), m)


if __name__ == "__main__":
    absltest.main()
