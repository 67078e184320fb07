"""CPU: `weight_only_ragged_matmul` (tokens sorted by group, as given, times stacked quantized expert weights) against
a float64 oracle written from the contract (y[t] = x[t]·Ŵ[g]ᵀ, Ŵ = code × block scale × alpha), its derivative with
respect to x, vmap, sharding over 8 host devices, its trace-time errors, and its custom call lowered for CUDA (the
swap_ab kernel's bf16 tokens, one alpha per expert). The kernel itself runs on the H200 in tests/test_gpu_ragged.py.
"""

import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_blockgemm as jbg
from jax_blockgemm import arch, dispatch, gate

import oracle_ops
import oracle_weight_only

SWAP_AB_FORMATS = ("mxfp8_e4m3", "mxfp4", "nvfp4")


def random_experts(rng, g: int, n: int, k: int, fmt: str, *, per_expert_alpha: bool = True) -> jbg.QuantizedWeight:
    """G experts of random codes over the format's range and random block scales (spread 2^-4 .. 2^4), stacked; NVFP4
    with one random alpha per expert (or the first expert's for all, `per_expert_alpha` False)."""
    experts = [oracle_weight_only.random_weight(rng, n, k, fmt) for _ in range(g)]
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *experts)
    return stacked if per_expert_alpha else jbg.QuantizedWeight(stacked.codes, stacked.scales, experts[0].alpha, fmt)


def expert(w: jbg.QuantizedWeight, g: int) -> jbg.QuantizedWeight:
    alpha = w.alpha if np.ndim(w.alpha) == 0 else w.alpha[g]
    return jbg.QuantizedWeight(w.codes[g], w.scales[g], alpha, w.format)


def oracle(x, w: jbg.QuantizedWeight, sizes) -> np.ndarray:
    """float64 y (T, N): each group's rows times its expert (`weight_only_oracle`), zeros past the groups."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    out = np.zeros((x.shape[0], w.codes.shape[1]))
    start = 0
    for g, size in enumerate(np.asarray(sizes)):
        out[start:start + size] = oracle_weight_only.weight_only_oracle(x[start:start + size], expert(w, g))
        start += size
    return out


def sizes_with_every_case(t: int, g: int) -> np.ndarray:
    """Empty groups, a one-token group, a large one, rows of no group at the end (sum < T); G >= 4."""
    sizes = np.zeros(g, np.int32)
    sizes[0], sizes[2], sizes[3] = 1, t // 2, t // 4
    return sizes


class WeightOnlyRaggedTest(parameterized.TestCase):

    @parameterized.product(fmt=oracle_weight_only.FORMATS, x_dtype=("bfloat16", "float32"),
                           out_dtype=("float32", "bfloat16"))
    def test_matches_oracle(self, fmt, x_dtype, out_dtype):
        rng = np.random.default_rng(hash((fmt, x_dtype, out_dtype)) % 2**32)
        for t, g, n, k in ((37, 5, 48, 96), (64, 4, 40, 70 if fmt.startswith("mxfp8") else 72)):
            w = random_experts(rng, g, n, k, fmt)
            x = oracle_weight_only.random_x(rng, (t, k), jnp.dtype(x_dtype))
            for sizes in (sizes_with_every_case(t, g), np.eye(g, dtype=np.int32)[g - 1] * t):
                with self.subTest(t=t, g=g, n=n, k=k, sizes=sizes.tolist()):
                    y = jax.jit(lambda x, w, s: jbg.weight_only_ragged_matmul(
                        x, w, s, out_dtype=jnp.dtype(out_dtype)))(x, w, jnp.asarray(sizes))
                    self.assertEqual((y.shape, y.dtype), ((t, n), jnp.dtype(out_dtype)))
                    oracle_ops.assert_gemm_close(self, np.asarray(y), oracle(x, w, sizes),
                                                 c_dtype=jnp.dtype(out_dtype))
                    np.testing.assert_array_equal(np.asarray(y, np.float32)[int(sizes.sum()):], 0)

    def test_shared_alpha(self):
        rng = np.random.default_rng(3)
        w = random_experts(rng, 4, 32, 64, "nvfp4", per_expert_alpha=False)
        x = oracle_weight_only.random_x(rng, (20, 64), jnp.bfloat16)
        sizes = np.array([5, 0, 9, 6], np.int32)
        y = jbg.weight_only_ragged_matmul(x, w, sizes, out_dtype=jnp.float32)
        oracle_ops.assert_gemm_close(self, np.asarray(y), oracle(x, w, sizes), c_dtype=jnp.dtype(jnp.float32))

    def test_nan_scale_stays_in_its_expert(self):
        rng = np.random.default_rng(4)
        w = random_experts(rng, 3, 24, 64, "mxfp4")
        scales = np.asarray(w.scales).copy()
        scales[1, 5, 0] = 0xFF  # NaN: column 5 of expert 1's rows
        w = jbg.QuantizedWeight(w.codes, jnp.asarray(scales), w.alpha, w.format)
        y = np.asarray(jbg.weight_only_ragged_matmul(oracle_weight_only.random_x(rng, (30, 64), jnp.bfloat16), w,
                                                     np.array([10, 12, 6], np.int32), out_dtype=jnp.float32))
        self.assertTrue(np.isnan(y[10:22, 5]).all())
        self.assertEqual(int(np.isnan(y).sum()), 12)

    def test_float32_tokens_never_run_tf32(self):
        """The reference's grouped dot on float32 tokens asks for full float32 precision (on a GPU, XLA would otherwise
        be free to use TF32); bf16 tokens need not."""
        w = random_experts(np.random.default_rng(12), 3, 16, 64, "mxfp4")
        sizes = np.array([4, 0, 8], np.int32)
        lowered = lambda dtype: jax.jit(lambda x: jbg.weight_only_ragged_matmul(x, w, sizes, out_dtype=jnp.float32)
                                        ).lower(jnp.zeros((12, 64), dtype)).as_text()
        self.assertIn("HIGHEST", lowered(jnp.float32))
        self.assertNotIn("HIGHEST", lowered(jnp.bfloat16))

    def test_nan_alpha_stays_in_its_expert(self):
        """An expert whose alpha is NaN gives NaN on its rows only: the other experts' rows and the rows of no group
        (zero) are untouched."""
        rng = np.random.default_rng(10)
        w = random_experts(rng, 3, 24, 64, "nvfp4")
        w = jbg.QuantizedWeight(w.codes, w.scales, w.alpha.at[0].set(jnp.nan), w.format)
        y = np.asarray(jbg.weight_only_ragged_matmul(oracle_weight_only.random_x(rng, (30, 64), jnp.bfloat16), w,
                                                     np.array([10, 12, 6], np.int32), out_dtype=jnp.float32))
        self.assertTrue(np.isnan(y[:10]).all())
        self.assertFalse(np.isnan(y[10:]).any())
        self.assertFalse(y[28:].any())

    @parameterized.parameters("bfloat16", "float32")
    def test_grad_with_respect_to_x(self, x_dtype):
        """dx[t] = dy[t]·Ŵ[g] on the rows of group g, zero elsewhere (float32 x: exact to float32; bf16 x: dx is
        rounded to bf16 once)."""
        rng = np.random.default_rng(5)
        t, g, n, k = 40, 4, 24, 64
        w = random_experts(rng, g, n, k, "nvfp4")
        x = oracle_weight_only.random_x(rng, (t, k), jnp.dtype(x_dtype))
        sizes = np.array([7, 0, 20, 9], np.int32)
        dy = rng.standard_normal((t, n))
        loss = lambda x, w: jnp.sum(jbg.weight_only_ragged_matmul(x, w, sizes, out_dtype=jnp.float32) * dy)
        dx = jax.grad(loss)(x, w)
        want = np.zeros((t, k))
        start = 0
        for e, size in enumerate(sizes):
            want[start:start + size] = dy[start:start + size] @ oracle_weight_only.dequantized_f64(expert(w, e))
            start += size
        self.assertEqual(dx.dtype, x.dtype)
        rtol = 1e-6 if x_dtype == "float32" else 2**-8
        np.testing.assert_allclose(np.asarray(dx, np.float64), want, rtol=rtol, atol=rtol * np.abs(want).max())
        self.assertFalse(np.asarray(dx, np.float32)[36:].any())

    def test_grad_with_respect_to_the_weight_is_refused(self):
        """The quantized weight is a constant: asking for its gradient raises at trace time, as for the dense op,
        rather than handing back a silent zero; a weight that is merely closed over leaves x's gradient alone."""
        rng = np.random.default_rng(15)
        w = random_experts(rng, 3, 16, 64, "nvfp4")
        x = oracle_weight_only.random_x(rng, (12, 64), jnp.float32)
        sizes = np.array([5, 0, 7], np.int32)
        loss = lambda x, w: jnp.sum(jbg.weight_only_ragged_matmul(x, w, sizes, out_dtype=jnp.float32))
        with self.assertRaisesRegex(ValueError, "weight_only_ragged_matmul is differentiable with respect to x only"):
            jax.grad(loss, argnums=(0, 1), allow_int=True)(x, w)
        with self.assertRaisesRegex(ValueError, "differentiable with respect to x only"):
            jax.grad(lambda alpha: loss(x, dataclasses.replace(w, alpha=alpha)))(w.alpha)
        self.assertEqual(jax.jit(jax.grad(loss))(x, w).shape, x.shape)

    def test_vmap_over_token_sets(self):
        rng = np.random.default_rng(6)
        w = random_experts(rng, 3, 16, 64, "mxfp8_e4m3")
        xs = oracle_weight_only.random_x(rng, (2, 12, 64), jnp.bfloat16)
        sizes = np.array([[4, 0, 8], [0, 12, 0]], np.int32)
        ys = jax.vmap(lambda x, s: jbg.weight_only_ragged_matmul(x, w, s, out_dtype=jnp.float32))(xs, sizes)
        for i in range(2):
            oracle_ops.assert_gemm_close(self, np.asarray(ys[i]), oracle(xs[i], w, sizes[i]),
                                         c_dtype=jnp.dtype(jnp.float32))

    def test_vmap_over_expert_stacks(self):
        """Two stacks of NVFP4 experts (each expert its own alpha) against one token set: one batched call."""
        rng = np.random.default_rng(11)
        stacks = [random_experts(rng, 3, 16, 64, "nvfp4") for _ in range(2)]
        w = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *stacks)
        x = oracle_weight_only.random_x(rng, (12, 64), jnp.bfloat16)
        sizes = np.array([4, 0, 8], np.int32)
        ys = jax.vmap(lambda w: jbg.weight_only_ragged_matmul(x, w, sizes, out_dtype=jnp.float32))(w)
        for i in range(2):
            oracle_ops.assert_gemm_close(self, np.asarray(ys[i]), oracle(x, stacks[i], sizes),
                                         c_dtype=jnp.dtype(jnp.float32))

    def test_bad_inputs_raise_at_trace_time(self):
        rng = np.random.default_rng(7)
        w = random_experts(rng, 3, 16, 64, "mxfp4")
        x = jnp.zeros((10, 64), jnp.bfloat16)
        sizes = np.array([3, 3, 4], np.int32)
        one = oracle_weight_only.random_weight(rng, 16, 64, "mxfp4")
        bad_alpha = jbg.QuantizedWeight(w.codes, w.scales, jnp.ones((2,), jnp.float32), w.format)
        cases = [((x.astype(jnp.float16), w, sizes), {}, TypeError, r"x has dtype float16; allowed: bfloat16, float32"),
                 ((x[None], w, sizes), {}, ValueError, r"x must be \(T, K\) tokens sorted by group with K=64"),
                 ((x[:, :32], w, sizes), {}, ValueError, r"K=64"),
                 ((x, one, sizes), {}, ValueError, r"w.codes must be a \(G, N, K\) \(K/2 packed bytes\) stack"),
                 ((x, bad_alpha, sizes), {}, ValueError, r"w.alpha must be a float32 scalar or one per expert, \(3,\)"),
                 ((x, w, np.array([3, 3], np.int32)), {}, ValueError, r"group_sizes"),
                 ((x, w, np.array([3, 3, 5], np.int32)), {}, ValueError, r"group_sizes"),
                 ((x, w, np.array([2**32 + 3, 3, 4], np.int64)), {}, ValueError, r"group_sizes sums to 4294967306"),
                 ((x, w, None), {}, TypeError, r"group_sizes must be an integer array"),
                 ((x[:0], w, np.zeros(3, np.int32)), {}, ValueError, r"x must hold at least one token \(T >= 1\)"),
                 ((x, jax.tree.map(lambda a: a[:0], w), np.zeros(0, np.int32)), {}, ValueError,
                  r"w must be non-empty: G, N and K must be at least 1; got \(G, N, K\) = \(0, 16, 64\)"),
                 ((x, w, sizes), dict(out_dtype=jnp.float16), TypeError, r"out_dtype=.*float16.* allowed: bfloat16"),
                 ((x, w, sizes), dict(implementation="triton"), ValueError, r"implementation")]
        for args, kwargs, error, pattern in cases:
            with self.subTest(pattern=pattern):
                with self.assertRaisesRegex(error, pattern):
                    jbg.weight_only_ragged_matmul(*args, **kwargs)


class WeightOnlyRaggedShardingTest(parameterized.TestCase):

    @parameterized.parameters((P("t", None), P("e", None, None)), (P(None, None), P("e", "t", None)))
    def test_sharded_equals_unsharded(self, x_spec, w_spec):
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("t", "e"))
        rng = np.random.default_rng(8)
        w = random_experts(rng, 8, 32, 64, "nvfp4")
        x = oracle_weight_only.random_x(rng, (64, 64), jnp.bfloat16)
        sizes = jnp.asarray(np.array([5, 0, 20, 1, 0, 13, 9, 3], np.int32))
        f = jax.jit(lambda x, w, s: jbg.weight_only_ragged_matmul(x, w, s, out_dtype=jnp.float32))
        want = f(x, w, sizes)
        put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
        sharded = jbg.QuantizedWeight(put(w.codes, w_spec), put(w.scales, w_spec), put(w.alpha, P(w_spec[0])),
                                      w.format)
        np.testing.assert_array_equal(np.asarray(f(put(x, x_spec), sharded, sizes)), np.asarray(want))


def _verdict(v, device=None):
    return gate.Verdict(key=v.key, device="NVIDIA H200", object_sha="0" * 64, ok=True, detail="")


class WeightOnlyRaggedLoweringTest(parameterized.TestCase):

    def _lowered(self, fmt, x_dtype=jnp.bfloat16, capabilities=("9.0",), implementation=None):
        rng = np.random.default_rng(9)
        w = random_experts(rng, 5, 72, 320, fmt)
        x = jnp.zeros((300, 320), x_dtype)
        sizes = jnp.array([90, 0, 150, 60, 0], jnp.int32)
        f = jax.jit(lambda x, w, s: jbg.weight_only_ragged_matmul(x, w, s, out_dtype=jnp.bfloat16,
                                                                  implementation=implementation))
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=capabilities), \
                mock.patch.object(gate, "ensure_verified", side_effect=_verdict):
            return f.trace(x, w, sizes).lower(lowering_platforms=("cuda",)).as_text()

    @parameterized.parameters(*SWAP_AB_FORMATS)
    def test_bf16_tokens_take_the_swap_ab_kernel(self, fmt):
        """An H200: the swap_ab object with bf16 tokens of K rounded up to 256 (the tokens permuted by XLA, never
        quantized), the codes as stored, one alpha per expert, an empty sfa: under "cutedsl" for every format, under
        None for those arch.TABLE's ragged_swap_ab_formats names (the reference for the others)."""
        for_none = fmt in arch.policy("sm_90a").ragged_swap_ab_formats
        self.assertEqual("jbg_ragged_gemm_amax" in self._lowered(fmt), for_none)
        text = self._lowered(fmt, implementation="cutedsl")
        call = next(line for line in text.splitlines() if "@jbg_ragged_gemm_amax" in line)
        self.assertIn('a_dtype = "bfloat16"', call)
        self.assertIn("swap_ab", call)
        self.assertIn("amax_batches = 0", call)  # the product drops amax: no tally, nothing zeroed
        codes = "5x72x160xui8" if fmt != "mxfp8_e4m3" else "5x72x320xf8E4M3FN"
        self.assertRegex(call, rf"\(tensor<1x300x512xbf16>, tensor<1x{codes}>, tensor<1x0xui8>, .*tensor<5xf32>\)")
        self.assertNotIn("jbg_dequantize_mxfp8", text)

    def test_float32_tokens_and_other_gpus_keep_the_reference(self):
        for kwargs in (dict(x_dtype=jnp.float32), dict(capabilities=("10.0",)), dict(capabilities=None)):
            with self.subTest(**{k: str(v) for k, v in kwargs.items()}):
                self.assertNotIn("jbg_ragged_gemm_amax", self._lowered("mxfp4", **kwargs))
        with self.assertRaisesRegex(ValueError, r"float32 tokens keep the reference"):
            self._lowered("mxfp4", x_dtype=jnp.float32, implementation="cutedsl")


if __name__ == "__main__":
    absltest.main()
