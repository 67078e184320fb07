"""The per-group contraction over tokens (`contraction.contract_groups`, the ragged product's weight gradient)
against its float64 oracle: empty, one-token and all-token groups, groups ending inside a k-tile, rows of no group,
NaN per group, f32 and bf16 C, vmap, the partitioning rules on 8 host devices (tokens summed over, experts, K and
N), and on the CUDA side without a GPU: dispatch, the lowering to the kernel call, the self-check catching a wrong
result.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax, when run directly

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_blockgemm import contraction, dispatch, selfcheck
from jax_blockgemm.kernels import catalog

import oracle_ops
import partitioners
from oracle_ragged import bounds, random_bf16_grouped, random_group_sizes


def contraction_oracle(x, y, group_sizes) -> tuple[np.ndarray, float]:
    """(c (G, K, N) float64, amax): each group's rows of x, transposed, times its rows of y."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    c = np.zeros((len(group_sizes), x.shape[1], y.shape[1]))
    with np.errstate(invalid="ignore", over="ignore"):
        for g, (s, e) in enumerate(bounds(group_sizes)):
            c[g] = x[s:e].T @ y[s:e]
    return c, float(np.max(np.abs(c))) if c.size else 0.0


def _inputs(rng, t, k, n):
    x, _ = random_bf16_grouped(rng, t=t, g=1, n=1, k=k)
    y, _ = random_bf16_grouped(rng, t=t, g=1, n=1, k=n)
    return x, y


class ContractionTest(parameterized.TestCase):

    def _check(self, c, amax, x, y, gs, c_dtype=jnp.float32):
        ref, ref_amax = contraction_oracle(x, y, gs)
        oracle_ops.assert_gemm_close(self, c, ref, c_dtype=c_dtype)
        oracle_ops.assert_amax_close(self, amax, ref_amax)

    @parameterized.parameters(jnp.float32, jnp.bfloat16)
    def test_matches_oracle(self, c_dtype):
        rng = np.random.default_rng(1)
        x, y = _inputs(rng, 150, 24, 40)
        f = jax.jit(lambda x, y, gs: contraction.contract_groups(x, y, gs, c_dtype=c_dtype))
        for gs in (np.array([0, 1, 70, 0, 66], np.int32), random_group_sizes(rng, 150, 5, fill=False),
                   np.array([0, 150, 0, 0, 0], np.int32)):
            c, amax = f(x, y, gs)
            self.assertEqual((c.shape, c.dtype), ((5, 24, 40), c_dtype))
            self._check(c, amax, x, y, gs, c_dtype)

    def test_nan_stays_in_its_group(self):
        x, y = _inputs(np.random.default_rng(2), 60, 8, 16)
        x[15, 3] = np.nan  # group 1's row: its row 3 of dW
        y[59, 0] = np.nan  # a row of no group
        gs = np.array([10, 20, 25], np.int32)
        c, amax = contraction.contract_groups(x, y, gs)
        c = np.asarray(c)
        self.assertTrue(np.isnan(c[1, 3]).all())
        self.assertEqual(int(np.isnan(c).sum()), 16)
        self.assertTrue(np.isnan(float(amax)))

    def test_vmap(self):
        x, y = _inputs(np.random.default_rng(3), 48, 16, 8)
        x2, gs2 = np.stack([x, x[::-1]]), np.array([[10, 0, 38], [48, 0, 0]], np.int32)
        c, amax = jax.vmap(lambda x, gs: contraction.contract_groups(x, y, gs))(x2, gs2)
        for i in range(2):
            self._check(c[i], amax[i], x2[i], y, gs2[i])

    def test_refuses_bad_calls(self):
        x, y = _inputs(np.random.default_rng(4), 16, 8, 8)
        gs = np.array([16], np.int32)
        with self.assertRaisesRegex(TypeError, "c_dtype float16 .* allowed: float32, bfloat16"):
            contraction.contract_groups(x, y, gs, c_dtype=jnp.float16)
        with self.assertRaisesRegex(ValueError, "one T"):
            contraction.contract_groups(x, y[:8], gs)

    @parameterized.named_parameters(
        ("tokens", P("t", None), P("t", None), P(None)),  # partial sums over the token shards
        ("experts", P(None, None), P(None, None), P("e")),
        ("k_and_n", P(None, "t"), P(None, "e"), P(None)),
        ("tokens_and_experts", P("t", None), P("t", None), P("e")),
        ("tokens_and_experts_gspmd", P("t", None), P("t", None), P("e"), "gspmd"))
    def test_sharded(self, x_spec, y_spec, gs_spec, partitioner="shardy"):
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("t", "e"))
        x, y = _inputs(np.random.default_rng(5), 64, 16, 32)
        gs = np.array([5, 0, 20, 1, 0, 13, 9, 3], np.int32)
        f = jax.jit(lambda x, y, gs: contraction.contract_groups(x, y, gs))
        put = lambda v, spec: jax.device_put(jnp.asarray(v), NamedSharding(mesh, spec))
        args = (put(x, x_spec), put(y, y_spec), put(gs, gs_spec))
        with partitioners.partitioner(partitioner):
            self.assertIn("CustomSPMDPartitioning", f.lower(*args).as_text())
            c, amax = f(*args)
        self._check(c, amax, x, y, gs)
        first = lambda spec: spec[0] if len(spec) else None
        self.assertEqual(first(c.sharding.spec), first(gs_spec))  # the experts stay on their devices


class ContractionCudaTest(parameterized.TestCase):
    """The CUDA side without a GPU: dispatch and lowering to the kernel call, the self-check's problems."""

    @parameterized.product(implementation=("cutedsl", None), c_dtype=(jnp.float32, jnp.bfloat16))
    def test_lowers_to_one_kernel_call(self, implementation, c_dtype):
        x, y, gs = jnp.zeros((256, 64), jnp.bfloat16), jnp.zeros((256, 96), jnp.bfloat16), jnp.full((4,), 64)
        f = jax.jit(lambda x, y, gs: contraction.contract_groups(x, y, gs, c_dtype=c_dtype,
                                                                 implementation=implementation))
        text = f.trace(x, y, gs).lower(lowering_platforms=("cuda",)).as_text()
        self.assertEqual(text.count("jbg_grouped_contraction"), 1)
        self.assertNotIn("while", text)

    def test_xla_keeps_the_reference(self):
        x, y, gs = jnp.zeros((64, 16), jnp.bfloat16), jnp.zeros((64, 16), jnp.bfloat16), jnp.full((2,), 32)
        f = jax.jit(lambda x, y, gs: contraction.contract_groups(x, y, gs, implementation="xla"))
        self.assertNotIn("jbg_grouped_contraction", f.trace(x, y, gs).lower(lowering_platforms=("cuda",)).as_text())

    def test_choice_by_size(self):
        sa = jax.core.ShapedArray

        def choice(t, k, n, g=4):
            avals = [sa((1, t, k), jnp.bfloat16), sa((1, t, n), jnp.bfloat16), sa((1, g), jnp.int32),
                     sa((1, g), jnp.int32)]
            return dispatch.contraction_kernels(avals, c_dtype=np.dtype(jnp.bfloat16), implementation=None)

        # 256 experts of 7168 x 2048: c holds 3.8e9 elements, each (K, N) 1.5e7: the kernel takes it
        self.assertEqual([v.key for v in choice(65536, 7168, 2048, 256).variants],
                         ["contraction.sm_90a.bf16.bf16.sf0none.t128x128.c1x1.am.bn"])
        self.assertRegex(choice(512, 100, 64).reason, "k must be a multiple of 8")
        self.assertRegex(choice(2**18, 8192, 64).reason, r"x \(1, 262144, 8192\) holds")

    def test_self_check_catches_wrong_results(self):
        variant = catalog.variants_for("sm_90a", "contraction")[0]
        device = jax.devices("cpu")[0]
        exact = lambda v, args, dev: selfcheck._run_contraction(v, args, dev, "xla")

        def off_by_one(v, args, dev):
            c, amax = exact(v, args, dev)
            c = c.astype(np.float32)
            c[0, 0, 0] += 1.0
            return c, amax

        self.assertEqual(selfcheck.run_contraction_problems(variant, device, run_kernel=exact), "")
        self.assertIn("1 of", selfcheck.run_contraction_problems(variant, device, run_kernel=off_by_one))


if __name__ == "__main__":
    absltest.main()
