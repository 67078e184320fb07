"""Both operations under sharding on 8 host devices: jit with sharded inputs and inside shard_map."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_blockgemm as jbg

import oracle


def _mesh():
    devices = jax.devices()
    if len(devices) < 8:
        raise absltest.SkipTest("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return Mesh(np.array(devices[:8]).reshape(4, 2), ("data", "model"))


def _inputs(rng, l, m, n, k):
    a = jnp.asarray(rng.standard_normal((l, m, k)) * 4, jnp.float32).astype(jnp.float8_e4m3fn)
    b = jnp.asarray(rng.standard_normal((l, n, k)) * 4, jnp.float32).astype(jnp.float8_e4m3fn)
    sfa = jnp.asarray(oracle.random_scale_bytes(rng, (l, m, k // 32)))
    sfb = jnp.asarray(oracle.random_scale_bytes(rng, (l, n, k // 32)))
    return a, b, sfa, sfb


def _assert_same_result(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


class ShardingTest(absltest.TestCase):

    def test_gemm_amax_batch_sharded_jit(self):
        mesh = _mesh()
        a, b, sfa, sfb = _inputs(np.random.default_rng(0), 4, 128, 64, 64)
        want_c, want_amax = jbg.gemm_amax(a, b, sfa, sfb)
        spec = NamedSharding(mesh, P("data"))
        sharded = [jax.device_put(x, spec) for x in (a, b, sfa, sfb)]
        c, amax = jax.jit(jbg.gemm_amax)(*sharded)
        _assert_same_result((c, amax), (want_c, want_amax))

    def test_gemm_amax_rows_sharded_jit(self):
        mesh = _mesh()
        a, b, sfa, sfb = [x[0] for x in _inputs(np.random.default_rng(1), 1, 256, 128, 96)]
        want_c, want_amax = jbg.gemm_amax(a, b, sfa, sfb)
        a_s = jax.device_put(a, NamedSharding(mesh, P("data", None)))
        b_s = jax.device_put(b, NamedSharding(mesh, P("model", None)))
        c, amax = jax.jit(jbg.gemm_amax)(a_s, b_s, sfa, sfb)
        _assert_same_result((c, amax), (want_c, want_amax))

    def test_gemm_amax_in_shard_map(self):
        """Each shard computes its rows; the global amax is the pmax of the per-shard amaxes."""
        mesh = _mesh()
        a, b, sfa, sfb = [x[0] for x in _inputs(np.random.default_rng(2), 1, 512, 128, 64)]
        want_c, want_amax = jbg.gemm_amax(a, b, sfa, sfb)

        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P(), P("data"), P()),
                           out_specs=(P("data"), P()), check_vma=False)
        def per_shard(a, b, sfa, sfb):
            c, amax = jbg.gemm_amax(a, b, sfa, sfb)
            return c, jax.lax.pmax(amax, "data")

        c, amax = jax.jit(per_shard)(a, b, sfa, sfb)
        _assert_same_result((c, amax), (want_c, want_amax))

    def test_proj_rope_token_sharded(self):
        mesh = _mesh()
        rng = np.random.default_rng(3)
        t, h, k = 256, 2, 64
        x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((h * 192, k)) / 8, jnp.bfloat16)
        ang = rng.uniform(0, 6.3, (t, 64))
        cos, sin = jnp.asarray(np.cos(ang), jnp.bfloat16), jnp.asarray(np.sin(ang), jnp.bfloat16)
        want = jbg.gemm_proj_rope_mxfp8(x, w, cos, sin)
        tok = NamedSharding(mesh, P("data", None))
        got = jax.jit(jbg.gemm_proj_rope_mxfp8)(jax.device_put(x, tok), w, jax.device_put(cos, tok),
                                                jax.device_put(sin, tok))
        for g, r in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(r).view(np.uint8))


if __name__ == "__main__":
    absltest.main()
