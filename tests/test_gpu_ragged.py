"""GPU: the grouped (ragged) kernel through the public API, against the float64 oracle (runs where a kernel exists).

`ragged_gemm_amax` with implementation="cutedsl" in every operand format, on fresh random codes and scales: empty,
one-token and all-token groups, tiles shared by several groups, rows of no group, N and K tails, vmap (L = 2), every C
dtype, NaN per group, traced group sizes, a weight stack past 2**31 elements (MXFP8 E4M3, MXFP4 and NVFP4 with f32 or
bf16 C through the swap_ab kernel, with its own cases for NaN codes and scales, large scales and K past a whole
promotion group); `weight_only_ragged_matmul` (bf16 tokens as given, one alpha per expert) on the swap_ab kernel;
`mx_ragged_dot` with kernels under its forward and dgrad (on sm_90a the bf16 grouped kernel on the quantized values),
against the straight-through oracle; the bf16 kernel (`ragged.grouped_dot`, both weight layouts, f32 and bf16 C) and the
grouped contraction kernel (`contraction.contract_groups`, the weight gradient) likewise. Outputs are poisoned before
every launch (an unwritten element reads NaN and fails). Skipped without a CUDA GPU that has kernels (CI has none); on
the H200: `python -m pytest tests/test_gpu_ragged.py`.
"""

import os
import re

os.environ["JAX_BLOCKGEMM_POISON_OUTPUTS"] = "1"

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg
from jax_blockgemm import arch, contraction, dispatch, ragged

import oracle
import oracle_ops
import oracle_weight_only
import test_weight_only_ragged as wor
from oracle_ragged import (grouped_dot_oracle, mx_ragged_dot_oracle, random_bf16_grouped, random_group_sizes,
                           random_ragged_inputs, ragged_oracle_of)

FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4")
RTOL = 1e-5  # the straight-through oracle's float32 class, as tests/test_ragged_autodiff.py


def _has_kernel_gpu() -> bool:
    caps = dispatch.local_cuda_capabilities()
    return bool(caps) and all(arch.target_of(cc) == "sm_90a" for cc in caps)


def _call(d, gs, **kw):
    alpha = d["alpha"] if d["sfa"].dtype == oracle.E4M3 else None
    return jbg.ragged_gemm_amax(d["a"], d["b"], d["sfa"], d["sfb"], gs, alpha=alpha, sf_vec_size=d["sf_vec_size"],
                                **kw)


def _sizes(rng, t, g):
    """Group sizes reaching the kernel's item table: empty, one-token, a tile shared by 3 groups, rows of no group;
    random ones; one group holding every token."""
    shared = np.zeros(g, np.int32)
    shared[:4] = (0, 1, 50, 30)
    shared[-1] = t - 140
    return (shared, random_group_sizes(rng, t, g, fill=False), np.eye(g, dtype=np.int32)[g // 2] * t)


@absltest.skipUnless(_has_kernel_gpu(), "needs a CUDA GPU with the sm_90a ragged kernel")
class GpuRaggedTest(parameterized.TestCase):

    def _check(self, d, gs, c, amax, c_dtype=jnp.float32):
        ref, ref_amax = ragged_oracle_of(d, gs)
        oracle_ops.assert_gemm_close(self, c, ref, c_dtype=c_dtype)
        oracle_ops.assert_amax_close(self, amax, ref_amax)
        self.assertTrue(np.all(np.asarray(c, np.float32)[int(np.sum(gs)):] == 0), "rows past the groups")

    @parameterized.product(fmt=FORMATS, c_dtype=("float32", "bfloat16"))
    def test_matches_oracle(self, fmt, c_dtype):
        rng = np.random.default_rng(hash((fmt, c_dtype)) % 2**32)
        for t, g, n, k in ((300, 6, 200, 160 if fmt.startswith("mxfp8") else 192), (517, 9, 264, 1024)):
            d = random_ragged_inputs(rng, t=t, g=g, n=n, k=k, fmt=fmt)
            for gs in _sizes(rng, t, g):
                with self.subTest(t=t, g=g, n=n, k=k, sizes=gs.tolist()):
                    c, amax = jax.jit(lambda gs: _call(d, gs, c_dtype=c_dtype, implementation="cutedsl"))(gs)
                    self._check(d, gs, c, amax, c_dtype=c_dtype)

    @parameterized.parameters("float32", "bfloat16")
    def test_swap_ab_kernel(self, c_dtype):
        """MXFP8 E4M3 with f32 or bf16 C runs the swap_ab kernel (bf16 tokens, the weights converted in registers):
        K past the last whole promotion group (272: a k-tile of zeros and a clamped scale block), N off the 128-row
        tile, NaN codes (0x7F, 0xFF) in two weights (their columns of their groups' rows), scale bytes above 134 (the
        two-multiply path) in another group, rows of no group."""
        rng = np.random.default_rng(15)
        t, g, n, k = 333, 4, 200, 272
        d = random_ragged_inputs(rng, t=t, g=g, n=n, k=k, fmt="mxfp8_e4m3")
        d["b"] = np.asarray(d["b"]).copy()
        d["b"][2, 7, 100] = np.nan  # code 0x7F
        d["b"].view(np.uint8)[3, 11, 36:38] = (0xFF, 0x7E)  # a negative NaN code, then 448 (a carry's neighbour)
        d["sfb"] = np.asarray(d["sfb"]).copy()
        d["sfb"][1, :, 3] = 140  # 2^13: beyond one multiply per pair
        gs = np.array([90, 0, 150, 60], np.int32)
        f = jax.jit(lambda gs: _call(d, gs, c_dtype=c_dtype, implementation="cutedsl"))
        self.assertIn('a_dtype = "bfloat16"', f.lower(gs).as_text())
        c, amax = f(gs)
        self._check(d, gs, c, amax, c_dtype=c_dtype)
        self.assertTrue(np.isnan(np.asarray(c, np.float32)[90:240, 7]).all())
        self.assertTrue(np.isnan(np.asarray(c, np.float32)[240:300, 11]).all())

    @parameterized.product(fmt=("mxfp4", "nvfp4"), c_dtype=("float32", "bfloat16"))
    def test_swap_ab_fp4_kernel(self, fmt, c_dtype):
        """MXFP4 and NVFP4 weights with f32 or bf16 C run the swap_ab kernel too (the tokens unpacked, dequantized
        and permuted in the FP4 order by XLA): K past the last whole promotion group (288), N off the 128-row tile,
        a NaN block scale in one weight row (its column of that group's rows), for MXFP4 scale bytes above 128 (the
        two-multiply path) in another group, NVFP4's alpha, rows of no group. (arch.TABLE gives these formats the
        swap_ab kernel once measured; here it is given them.)"""
        self.enterContext(arch.overridden("9.0", ragged_swap_ab_formats=("mxfp8_e4m3", "mxfp4", "nvfp4")))
        rng = np.random.default_rng(16)
        t, g, n, k = 333, 4, 200, 288
        d = random_ragged_inputs(rng, t=t, g=g, n=n, k=k, fmt=fmt)
        d["sfb"] = np.asarray(d["sfb"]).copy()
        d["sfb"].view(np.uint8)[2, 7, 3] = 0xFF if fmt == "mxfp4" else 0x7F  # NaN scale: column 7 of group 2
        if fmt == "mxfp4":
            d["sfb"][1, :, 2] = 140  # 2^13: beyond one multiply per pair
        gs = np.array([90, 0, 150, 60], np.int32)
        f = jax.jit(lambda gs: _call(d, gs, c_dtype=c_dtype, implementation="cutedsl"))
        text = f.lower(gs).as_text()
        self.assertIn('a_dtype = "bfloat16"', text)
        self.assertIn("swap_ab", text)
        c, amax = f(gs)
        self._check(d, gs, c, amax, c_dtype=c_dtype)
        self.assertTrue(np.isnan(np.asarray(c, np.float32)[90:240, 7]).all())

    @parameterized.product(fmt=("mxfp8_e4m3", "mxfp4", "nvfp4"), out_dtype=("float32", "bfloat16"))
    def test_weight_only_ragged_matmul(self, fmt, out_dtype):
        """`weight_only_ragged_matmul`: bf16 tokens as given times stacked quantized experts on the swap_ab kernel
        (one alpha per expert: NVFP4's differ), against the float64 oracle: empty, one-token and large groups, rows
        of no group, N off the 128-row tile, K past a whole promotion group; and dx through the bf16 grouped GEMM."""
        rng = np.random.default_rng(hash((fmt, out_dtype, "weight-only")) % 2**32)
        t, g, n, k = 333, 5, 200, 288
        w = wor.random_experts(rng, g, n, k, fmt)
        x = oracle_weight_only.random_x(rng, (t, k), jnp.bfloat16)
        sizes = np.array([1, 0, 150, 120, 40], np.int32)
        f = jax.jit(lambda x, s: jbg.weight_only_ragged_matmul(x, w, s, out_dtype=jnp.dtype(out_dtype),
                                                               implementation="cutedsl"))
        text = f.lower(x, sizes).as_text()
        self.assertIn('a_dtype = "bfloat16"', text)
        self.assertIn("swap_ab", text)
        y = f(x, sizes)
        oracle_ops.assert_gemm_close(self, np.asarray(y), wor.oracle(x, w, sizes), c_dtype=jnp.dtype(out_dtype))
        self.assertFalse(np.asarray(y, np.float32)[311:].any(), "rows past the groups")
        dy = rng.standard_normal((t, n)).astype(np.float32)
        dx = jax.grad(lambda x: jnp.sum(jbg.weight_only_ragged_matmul(x, w, sizes, out_dtype=jnp.float32) * dy))(x)
        want = np.zeros((t, k))
        start = 0
        for e, size in enumerate(sizes):
            want[start:start + size] = dy[start:start + size] @ oracle_weight_only.dequantized_f64(wor.expert(w, e))
            start += size
        np.testing.assert_allclose(np.asarray(dx, np.float64), want, rtol=2**-8, atol=2**-8 * np.abs(want).max())

    def test_swap_ab_amax_is_each_calls_own(self):
        """The swap_ab kernel folds amax through the call site's tally (every CTA arrives, those of empty items too,
        and the last empties it into amax): one compiled call site run on large values, then small ones with other
        group sizes (other empty items), then small again, gives each call's own amax; on the MoE tile (300 tokens)
        and on the 16-token decode tile (12 tokens over 6 experts)."""
        rng = np.random.default_rng(31)
        g, n, k = 6, 200, 512
        for t, tile in ((300, "t128x128"), (12, "t16x64")):
            f = jax.jit(lambda a, b, sfa, sfb, gs: jbg.ragged_gemm_amax(a, b, sfa, sfb, gs, implementation="cutedsl"))
            for scale_log2, fill in (((8.0, 12.0), True), ((-12.0, -8.0), False), ((-12.0, -8.0), True)):
                a = oracle_ops.random_gemm_inputs(rng, l=1, m=t, n=1, k=k, fmt="mxfp8_e4m3", scale_log2=scale_log2)
                b = oracle_ops.random_gemm_inputs(rng, l=g, m=1, n=n, k=k, fmt="mxfp8_e4m3", scale_log2=scale_log2)
                d = dict(a=a["a"][0], sfa=a["sfa"][0], b=b["b"], sfb=b["sfb"], sf_vec_size=32, k=k, alpha=a["alpha"])
                gs = random_group_sizes(rng, t, g, fill=fill)
                args = (d["a"], d["b"], d["sfa"], d["sfb"], gs)
                self.assertIn(f"_{tile}_c1x1_swap_ab", f.lower(*args).as_text())
                with self.subTest(t=t, scale_log2=scale_log2, sizes=gs.tolist()):
                    c, amax = f(*args)
                    self._check(d, gs, c, amax)
                    self.assertEqual(float(amax), float(np.abs(np.asarray(c)).max()))

    @parameterized.product(fmt=("mxfp8_e4m3", "mxfp4", "nvfp4"), c_dtype=("float32", "bfloat16"))
    def test_few_tokens_on_the_decode_tiles(self, fmt, c_dtype):
        """MoE decode: at most 64 tokens in all, over 16 experts, run the swap_ab kernel's decode tiles (16 and 32
        tokens with K in three parts, 64 in two; 64 weight rows): empty and one-token groups, rows of no group, N off
        the 64-row tile, K past a promotion group, a NaN block scale in one expert's weight row (that column of its
        group's rows only); and weight-only on the same tiles. K = 512 (no padding) gives MXFP8 E4M3 tokens to the
        dequantize kernel, whose plain object feeds the 16-token tile (which orders them itself) and whose swap_ab
        object feeds the 64-token tile."""
        self.enterContext(arch.overridden("9.0", ragged_swap_ab_formats=("mxfp8_e4m3", "mxfp4", "nvfp4")))
        rng = np.random.default_rng(hash((fmt, c_dtype, "decode tiles")) % 2**32)
        g, n = 16, 200
        for t, tile, k in ((7, "t16x64_c1x1_swap_ab_k3", 288), (16, "t16x64_c1x1_swap_ab_k3", 288),
                           (9, "t16x64_c1x1_swap_ab_k3", 512), (32, "t32x64_c1x1_swap_ab_k3", 288),
                           (50, "t64x64_c1x1_swap_ab_k2", 288), (40, "t64x64_c1x1_swap_ab_k2", 512)):
            d = random_ragged_inputs(rng, t=t, g=g, n=n, k=k, fmt=fmt)
            gs = np.zeros(g, np.int32)
            gs[[1, 4, 9, 15]] = (1, t // 2, 0, t - t // 2 - 2)  # 2 rows of no group
            bad = 4  # the expert of the t // 2 group
            d["sfb"] = np.asarray(d["sfb"]).copy()
            d["sfb"].view(np.uint8)[bad, 70, 2] = 0x7F if fmt == "nvfp4" else 0xFF
            with self.subTest(t=t, k=k):
                f = jax.jit(lambda gs: _call(d, gs, c_dtype=c_dtype, implementation="cutedsl"))
                self.assertIn(f"_{tile}\"", f.lower(gs).as_text())  # the object's function name ends there
                c, amax = f(gs)
                self._check(d, gs, c, amax, c_dtype=c_dtype)
                self.assertTrue(np.isnan(np.asarray(c, np.float32)[1:1 + t // 2, 70]).all())
                self.assertEqual(np.isnan(np.asarray(c, np.float32)).sum(), t // 2)
            w = wor.random_experts(rng, g, n, k, fmt)
            x = oracle_weight_only.random_x(rng, (t, k), jnp.bfloat16)
            y = jax.jit(lambda x: jbg.weight_only_ragged_matmul(x, w, gs, out_dtype=jnp.dtype(c_dtype),
                                                                implementation="cutedsl"))(x)
            oracle_ops.assert_gemm_close(self, np.asarray(y), wor.oracle(x, w, gs), c_dtype=jnp.dtype(c_dtype))

    def test_weight_only_ragged_nan_alpha_stays_in_its_expert(self):
        """The kernel multiplies each item's sums by its own expert's alpha, and rows of no group stay zero even
        when expert 0's alpha (the one their items read) is NaN."""
        rng = np.random.default_rng(24)
        w = wor.random_experts(rng, 3, 200, 288, "nvfp4")
        w = jbg.QuantizedWeight(w.codes, w.scales, w.alpha.at[0].set(jnp.nan), w.format)
        x = oracle_weight_only.random_x(rng, (300, 288), jnp.bfloat16)
        sizes = np.array([100, 120, 60], np.int32)
        y = np.asarray(jax.jit(lambda x: jbg.weight_only_ragged_matmul(x, w, sizes, out_dtype=jnp.float32,
                                                                        implementation="cutedsl"))(x))
        self.assertTrue(np.isnan(y[:100]).all())
        self.assertFalse(np.isnan(y[100:]).any())
        self.assertFalse(y[280:].any())
        ok = wor.oracle(x, jbg.QuantizedWeight(w.codes, w.scales, w.alpha.at[0].set(1.0), w.format), sizes)
        oracle_ops.assert_gemm_close(self, y[100:], ok[100:], c_dtype=jnp.dtype(jnp.float32))

    @parameterized.parameters("float32", "bfloat16")
    def test_swap_ab_tokens_by_the_dequantize_kernel(self, c_dtype):
        """K a multiple of 256: the tokens reach the swap_ab kernel through the dequantize kernel (its swap_ab column
        order), not XLA's gather. A NaN token code (its row NaN in every column), a token block with scale byte 0
        (2^-127: products far below the others, kept), rows of no group; against the float64 oracle."""
        rng = np.random.default_rng(18)
        t, g, n, k = 333, 4, 200, 512
        d = random_ragged_inputs(rng, t=t, g=g, n=n, k=k, fmt="mxfp8_e4m3")
        d["a"] = np.asarray(d["a"]).copy()
        d["a"][100, 300] = np.nan
        d["sfa"] = np.asarray(d["sfa"]).copy()
        d["sfa"][7, 2] = 0
        gs = np.array([120, 0, 151, 40], np.int32)
        f = jax.jit(lambda gs: _call(d, gs, c_dtype=c_dtype, implementation="cutedsl"))
        self.assertEqual(f.lower(gs).as_text().count("custom_call @jbg_dequantize_mxfp8("), 1)
        c, amax = f(gs)
        c32 = np.asarray(c, np.float32)
        self.assertTrue(np.isnan(c32[100]).all())
        self.assertTrue(np.isnan(float(amax)))
        rows = np.r_[0:100, 101:t]  # the oracle's check on every other row (amax is NaN)
        ref, _ = ragged_oracle_of(d, gs)
        oracle_ops.assert_gemm_close(self, np.asarray(c)[rows], np.asarray(ref)[rows], c_dtype=c_dtype)
        self.assertTrue(np.all(c32[int(np.sum(gs)):] == 0), "rows past the groups")

    @parameterized.parameters("float16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn")
    def test_narrow_c(self, c_dtype):
        rng = np.random.default_rng(11)
        d = random_ragged_inputs(rng, t=260, g=4, n=96, k=256, fmt="mxfp4")
        gs = np.array([100, 0, 1, 120], np.int32)
        c, amax = _call(d, gs, c_dtype=c_dtype, implementation="cutedsl")
        self._check(d, gs, c, amax, c_dtype=c_dtype)

    def test_vmap_and_traced_sizes(self):
        rng = np.random.default_rng(12)
        d = random_ragged_inputs(rng, t=200, g=5, n=136, k=96, fmt="mxfp8_e4m3")
        a2, sfa2 = np.stack([d["a"], d["a"][::-1]]), np.stack([d["sfa"], d["sfa"][::-1]])
        gs2 = np.array([[10, 0, 90, 1, 99], [0, 200, 0, 0, 0]], np.int32)
        f = jax.jit(jax.vmap(lambda a, s, gs: jbg.ragged_gemm_amax(a, d["b"], s, d["sfb"], gs,
                                                                  implementation="cutedsl")))
        c, amax = f(a2, sfa2, gs2)
        for i in range(2):
            self._check(dict(d, a=a2[i], sfa=sfa2[i]), gs2[i], c[i], amax[i])
        # traced sizes outside the contract: negative counts as 0, rows past T are cut off
        c, amax = jax.jit(lambda gs: _call(d, gs, implementation="cutedsl"))(jnp.array([50, -3, 100, 80, 9]))
        self._check(d, np.array([50, 0, 100, 50, 0]), c, amax)

    def test_nan_stays_in_its_group(self):
        rng = np.random.default_rng(13)
        d = random_ragged_inputs(rng, t=300, g=3, n=72, k=64, fmt="mxfp8_e4m3")
        gs = np.array([100, 60, 120], np.int32)  # group 1 shares row tiles with groups 0 and 2
        d["sfb"] = d["sfb"].copy()
        d["sfb"][1, 5, 0] = 0xFF  # NaN scale: column 5 of group 1's rows
        d["sfa"] = d["sfa"].copy()
        d["sfa"][290, 1] = 0xFF  # NaN in a row of no group: never read
        d["sfa"][99, 0] = 0xFF  # NaN in group 0's last row, in the tile group 1 also computes
        c, amax = _call(d, gs, implementation="cutedsl")
        c = np.asarray(c)
        self.assertTrue(np.isnan(c[100:160, 5]).all() and np.isnan(c[99]).all())
        self.assertEqual(int(np.isnan(c).sum()), 60 + 72)  # row 99 is group 0's: no overlap
        self.assertTrue((c[280:] == 0).all())
        self.assertTrue(np.isnan(float(amax)))
        self._check(d, gs, c, amax)

    def test_weights_past_int32_elements(self):
        """b (G, N, K) of 2**31 elements or more still runs the kernel (TMA addresses it per group)."""
        t, g, n, k = 512, 160, 2048, 7168  # b: 2.35e9 codes
        rng = np.random.default_rng(14)
        a = jnp.asarray(rng.standard_normal((t, k)), jnp.float32).astype(jnp.float8_e4m3fn)
        b = jax.random.normal(jax.random.key(0), (g, n, k), jnp.float32).astype(jnp.float8_e4m3fn)
        sfa = jnp.asarray(rng.integers(120, 134, (t, k // 32)), jnp.uint8)
        sfb = jnp.asarray(rng.integers(120, 134, (g, n, k // 32)), jnp.uint8)
        gs = np.zeros(g, np.int32)
        gs[[0, 77, g - 1]] = (100, 200, 212)
        f = jax.jit(lambda *x: jbg.ragged_gemm_amax(*x, implementation="cutedsl"))
        self.assertIn("jbg_ragged_gemm_amax", f.lower(a, b, sfa, sfb, gs).as_text())
        c, amax = f(a, b, sfa, sfb, gs)
        c = np.asarray(c)
        a_hat = oracle.dequantize_f64(np.asarray(a), np.asarray(sfa), block=32)
        for grp, (s, e) in ((0, (0, 100)), (77, (100, 300)), (g - 1, (300, 512))):
            b_hat = oracle.dequantize_f64(np.asarray(b[grp]), np.asarray(sfb[grp]), block=32)
            ref = a_hat[s:e] @ b_hat.T
            self.assertLess(np.linalg.norm(c[s:e] - ref) / np.linalg.norm(ref), 1e-5, f"group {grp}")
        self.assertTrue(np.isfinite(float(amax)))

    @parameterized.parameters("mxfp8", "nvfp4", "bf16")
    def test_mx_ragged_dot_forward_and_grads(self, recipe):
        """The forward and dgrad run the kernel (implementation None takes it on sm_90a); all three against the
        straight-through oracle. Group sizes off the 32-token blocks, an empty group."""
        rng = np.random.default_rng(15)
        t, g, k, n = 300, 4, 128, 96
        x, dy = rng.standard_normal((t, k)).astype(np.float32), rng.standard_normal((t, n)).astype(np.float32)
        w = (rng.standard_normal((g, k, n)) / np.sqrt(k)).astype(np.float32)
        gs = np.array([61, 0, 130, 90], np.int32)
        r = jbg.RECIPES[recipe] if recipe != "bf16" else jbg.Recipe("bf16", "bf16", "bf16")
        f = jax.jit(lambda x, w: jbg.mx_ragged_dot(x, w, jnp.asarray(gs), recipe=r))
        self.assertIn("jbg_ragged_gemm_amax", f.lower(x, w).as_text())
        out, vjp = jax.vjp(f, x, w)
        dx, dw = vjp(jnp.asarray(dy))
        ref = mx_ragged_dot_oracle(x, w, gs, dy, fwd=r.fwd, dgrad=r.dgrad, wgrad=r.wgrad)
        for name, got in (("out", out), ("dx", dx), ("dw", dw)):
            oracle_ops.assert_rel_close(self, name, got, ref[name], RTOL)

    @parameterized.parameters("mxfp8", "mxfp8_hybrid")
    def test_mx_ragged_dot_step_on_bf16_weights(self, recipe):
        """A training step on bf16 operands, as a model runs it: the weights quantized once by the pair kernel (the
        forward's values along K, dgrad's codes along N), x and dY by its gather kernels through the group-padding
        map (x: the forward's values along K and wgrad's along the padded groups' rows; dY: dgrad's codes along N and
        wgrad's values), three jbg_quantize_pair calls; the forward and wgrad on the bf16 grouped kernels, dgrad on
        the swap_ab kernel; against the straight-through oracle to bf16's rounding of the results."""
        rng = np.random.default_rng(16)
        t, g, k, n = 600, 5, 256, 192
        x, dy = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((t, k), (t, n)))
        w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
        gs = np.array([97, 0, 1, 300, 170], np.int32)  # 32 rows of no group
        r = jbg.RECIPES[recipe]

        def step(x, w, dy):
            out, vjp = jax.vjp(lambda x, w: jbg.mx_ragged_dot(x, w, jnp.asarray(gs), recipe=r), x, w)
            return (out, *vjp(dy))

        f = jax.jit(step)
        text = f.lower(x, w, dy).as_text()
        self.assertEqual(text.count("custom_call @jbg_quantize_pair("), 3)
        pair_calls = "\n".join(line for line in text.splitlines() if "custom_call @jbg_quantize_pair(" in line)
        self.assertEqual(sorted(re.findall(r"schedule = (\d) : i64", pair_calls)), ["0", "1", "2"])
        self.assertEqual(text.count("custom_call @jbg_ragged_gemm_amax("), 2)  # forward (bf16) and dgrad (swap_ab)
        ref = mx_ragged_dot_oracle(*(np.asarray(v, np.float32) for v in (x, w)), gs, np.asarray(dy, np.float32),
                                   fwd=r.fwd, dgrad=r.dgrad, wgrad=r.wgrad)
        for name, got in zip(("out", "dx", "dw"), f(x, w, dy)):
            self.assertEqual(got.dtype, jnp.bfloat16, name)
            oracle_ops.assert_rel_close(self, name, got, ref[name], 4e-3)  # bf16 rounding: 1.7e-3; unquantized: 4e-2

    @parameterized.product(w_major=("k", "n"), c_dtype=("float32", "bfloat16"))
    def test_bf16_operands(self, w_major, c_dtype):
        """The bf16 kernel: K tails (168: 64 x 2 + 40), N tails, T tails, shared tiles, rows of no group."""
        rng = np.random.default_rng(hash((w_major, c_dtype)) % 2**32)
        for t, g, n, k in ((300, 6, 200, 168), (517, 9, 264, 1024)):
            x, w = random_bf16_grouped(rng, t=t, g=g, n=n, k=k)
            wl = w if w_major == "n" else np.ascontiguousarray(np.swapaxes(w, 1, 2))
            f = jax.jit(lambda x, w, gs: ragged.grouped_dot(x, w, gs, w_major=w_major, c_dtype=jnp.dtype(c_dtype),
                                                             implementation="cutedsl"))
            self.assertEqual(f.lower(x, wl, np.zeros(g, np.int32)).as_text().count("jbg_ragged_gemm_amax"), 1)
            for gs in _sizes(rng, t, g):
                with self.subTest(t=t, g=g, n=n, k=k, sizes=gs.tolist()):
                    out, amax = f(x, wl, gs)
                    ref, ref_amax = grouped_dot_oracle(x, w, gs)
                    oracle_ops.assert_gemm_close(self, out, ref, c_dtype=jnp.dtype(c_dtype))
                    oracle_ops.assert_amax_close(self, amax, ref_amax)
                    self.assertTrue(np.all(np.asarray(out, np.float32)[int(np.sum(gs)):] == 0))

    def test_bf16_nan_stays_in_its_group(self):
        x, w = random_bf16_grouped(np.random.default_rng(16), t=300, g=3, n=72, k=64)
        gs = np.array([100, 60, 120], np.int32)  # group boundaries inside tiles of the 128-row grid
        x[99, 3] = np.nan  # group 0's last row (its item also computes rows of group 1, and stores none of them)
        x[290, 1] = np.nan  # a row of no group: never read
        w[1, :, 5] = np.nan  # column 5 of group 1's rows
        out, amax = ragged.grouped_dot(x, w, gs, w_major="n", implementation="cutedsl")
        out = np.asarray(out)
        self.assertTrue(np.isnan(out[100:160, 5]).all() and np.isnan(out[99]).all())
        self.assertEqual(int(np.isnan(out).sum()), 60 + 72)
        self.assertTrue((out[280:] == 0).all())
        self.assertTrue(np.isnan(float(amax)))

    def test_bf16_amax_of_stored_rows_only(self):
        """A group's short last tile computes the next group's first rows with its own weight and stores none of
        them; amax must not see them either: here they would be 2**12 times the largest stored value."""
        x, w = random_bf16_grouped(np.random.default_rng(17), t=300, g=3, n=72, k=64)
        gs = np.array([100, 60, 120], np.int32)
        x[100:160] *= 4096  # group 1's rows, which group 0's item also computes (rows 100-127)
        w[1] = 0  # group 1 stores zeros
        out, amax = ragged.grouped_dot(x, w, gs, w_major="n", implementation="cutedsl")
        ref, ref_amax = grouped_dot_oracle(x, w, gs)
        oracle_ops.assert_gemm_close(self, out, ref, c_dtype=jnp.dtype(jnp.float32))
        oracle_ops.assert_amax_close(self, amax, ref_amax)
        self.assertTrue((np.asarray(out)[100:160] == 0).all())


def _contraction_oracle(x, y, gs):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    c = np.zeros((len(gs), x.shape[1], y.shape[1]))
    with np.errstate(invalid="ignore", over="ignore"):
        for g, (s, e) in enumerate(zip(np.cumsum(gs) - gs, np.cumsum(gs))):
            c[g] = x[s:e].T @ y[s:e]
    return c, float(np.max(np.abs(c)))


@absltest.skipUnless(_has_kernel_gpu(), "needs a CUDA GPU with the sm_90a contraction kernel")
class GpuContractionTest(parameterized.TestCase):

    @parameterized.parameters("float32", "bfloat16")
    def test_matches_oracle(self, c_dtype):
        """Groups ending inside a 64-token k-tile (in each of its four 16-token k-steps, and on their edges),
        one-token and empty groups, rows of no group holding NaN, K and N tails of the 128 tile; the forced kernel."""
        rng = np.random.default_rng(hash(c_dtype) % 2**32)
        for t, g, k, n in ((300, 6, 200, 136), (1000, 5, 264, 512)):
            x, _ = random_bf16_grouped(rng, t=t, g=1, n=1, k=k)
            y, _ = random_bf16_grouped(rng, t=t, g=1, n=1, k=n)
            x[-1, 0] = np.nan  # a row of no group in the first size pattern; must not reach any sum
            f = jax.jit(lambda x, y, gs: contraction.contract_groups(x, y, gs, c_dtype=jnp.dtype(c_dtype),
                                                                     implementation="cutedsl"))
            self.assertEqual(f.lower(x, y, np.zeros(g, np.int32)).as_text().count("jbg_grouped_contraction"), 1)
            sizes = np.zeros(g, np.int32)
            sizes[:4] = (1, 0, 65, 130)
            steps = np.zeros(g, np.int32)
            steps[:5] = (16, 17, 47, 64, 96)  # last k-tiles of 1, 2, 3, 4 and 2 k-steps
            for gs in (sizes, steps, random_group_sizes(rng, t - 1, g, fill=True)):
                with self.subTest(t=t, g=g, k=k, n=n, sizes=gs.tolist()):
                    c, amax = f(x, y, gs)
                    ref, ref_amax = _contraction_oracle(x, y, gs)
                    oracle_ops.assert_gemm_close(self, c, ref, c_dtype=jnp.dtype(c_dtype))
                    oracle_ops.assert_amax_close(self, amax, ref_amax)

    def test_nan_stays_in_its_group(self):
        rng = np.random.default_rng(17)
        x, _ = random_bf16_grouped(rng, t=200, g=1, n=1, k=64)
        y, _ = random_bf16_grouped(rng, t=200, g=1, n=1, k=72)
        x[70, 5] = np.nan  # group 1's rows are 60 .. 129: row 5 of its dW
        c, amax = contraction.contract_groups(x, y, np.array([60, 70, 70], np.int32), implementation="cutedsl")
        c = np.asarray(c)
        self.assertTrue(np.isnan(c[1, 5]).all())
        self.assertEqual(int(np.isnan(c).sum()), 72)
        self.assertTrue(np.isnan(float(amax)))

    def test_result_past_int32_elements(self):
        """256 groups of (7168, 2048): c holds 3.76e9 elements (7.5 GB in bf16), addressed in 64 bits."""
        t, g, k, n = 1024, 256, 7168, 2048
        rng = np.random.default_rng(18)
        x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
        y = jnp.asarray(rng.standard_normal((t, n)), jnp.bfloat16)
        gs = np.full(g, t // g, np.int32)
        c, amax = jax.jit(lambda x, y: contraction.contract_groups(x, y, gs, c_dtype=jnp.bfloat16,
                                                                   implementation="cutedsl"))(x, y)
        xs, ys = np.asarray(x, np.float64), np.asarray(y, np.float64)
        for grp in (0, 131, g - 1):
            rows = slice(grp * 4, grp * 4 + 4)
            ref = xs[rows].T @ ys[rows]
            got = np.asarray(c[grp], np.float64)
            self.assertLess(np.linalg.norm(got - ref) / np.linalg.norm(ref), 1e-2, f"group {grp}")
        self.assertTrue(np.isfinite(float(amax)))


if __name__ == "__main__":
    absltest.main()
