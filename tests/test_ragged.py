"""ragged_gemm_amax (the mixture-of-experts GEMM) against its float64 oracle: MXFP8, MXFP4 and NVFP4, random group
sizes with empty, one-token and all-token groups, tails in N and K, every scale form, NaN per group, rows past the
groups zero, bad group sizes (static and traced), jit / vmap, "cutedsl" off CUDA, no per-group mask in the program, and
the partitioning rules on 8 host devices (tokens, experts, N).
"""

import os
import re
from unittest import mock

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax, when run directly

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_blockgemm as jbg

import oracle
import oracle_ops
import partitioners
from jax_blockgemm import ragged
from oracle_ragged import (grouped_dot_oracle, random_bf16_grouped, random_group_sizes, random_ragged_inputs,
                           ragged_oracle_of)


def _call(d, gs, **kw):
    alpha = d["alpha"] if d["sfa"].dtype == oracle.E4M3 else None
    return jbg.ragged_gemm_amax(d["a"], d["b"], d["sfa"], d["sfb"], gs, alpha=alpha, sf_vec_size=d["sf_vec_size"],
                                **kw)


class RaggedTest(parameterized.TestCase):

    def _check(self, d, gs, c, amax, c_dtype=jnp.float32):
        ref, ref_amax = ragged_oracle_of(d, gs)
        oracle_ops.assert_gemm_close(self, c, ref, c_dtype=c_dtype)
        oracle_ops.assert_amax_close(self, amax, ref_amax)
        past = int(np.sum(gs))
        self.assertTrue(np.all(np.asarray(c, np.float32)[past:] == 0), "rows past sum(group_sizes) must be zero")

    # MXFP8 with a partial K block (48 = 32 + 16) and N = 40; MXFP4 and NVFP4 with K = 96, N = 72
    @parameterized.parameters(("mxfp8_e4m3", 48, 40), ("mxfp8_e5m2", 64, 24), ("mxfp4", 96, 72), ("nvfp4", 96, 72))
    def test_matches_oracle(self, fmt, k, n):
        rng = np.random.default_rng(1)
        d = random_ragged_inputs(rng, t=120, g=6, n=n, k=k, fmt=fmt)
        sizes = (np.array([0, 17, 1, 0, 60, 30], np.int32),  # empty, one-token; 12 rows past the groups
                 random_group_sizes(rng, 120, 6, fill=False),
                 np.array([0, 0, 120, 0, 0, 0], np.int32))  # one group holds every token
        for gs in sizes:
            c, amax = _call(d, gs)
            self.assertEqual((c.shape, c.dtype, amax.shape), ((120, n), jnp.float32, ()))
            self._check(d, gs, c, amax)

    def test_low_precision_c(self):
        rng = np.random.default_rng(2)
        d = random_ragged_inputs(rng, t=64, g=3, n=32, k=64, fmt="mxfp8_e4m3")
        gs = np.array([20, 0, 30], np.int32)
        c, amax = _call(d, gs, c_dtype=jnp.bfloat16)
        self.assertEqual(c.dtype, jnp.bfloat16)
        self._check(d, gs, c, amax, c_dtype=jnp.bfloat16)

    def test_scale_forms(self):
        """The 128x4 atom (sfa with L = 1, sfb with L = G) gives the compact form's result bit for bit."""
        rng = np.random.default_rng(3)
        d = random_ragged_inputs(rng, t=40, g=3, n=16, k=64, fmt="mxfp8_e4m3")
        gs = np.array([10, 5, 20], np.int32)
        c, amax = _call(d, gs)
        atoms = dict(d, sfa=oracle.compact_to_atom_np(d["sfa"]), sfb=oracle.compact_to_atom_np(d["sfb"]))
        c2, amax2 = _call(atoms, gs)
        np.testing.assert_array_equal(np.asarray(c), np.asarray(c2))
        self.assertEqual(float(amax), float(amax2))

    def test_nan_stays_in_its_group(self):
        rng = np.random.default_rng(4)
        d = random_ragged_inputs(rng, t=48, g=3, n=16, k=64, fmt="mxfp8_e4m3")
        gs = np.array([10, 12, 20], np.int32)  # rows 42.. belong to no group
        d["sfb"] = d["sfb"].copy()
        d["sfb"][1, 5, 0] = 0xFF  # NaN scale: column 5 of group 1's rows
        d["sfa"] = d["sfa"].copy()
        d["sfa"][45, 1] = 0xFF  # NaN in a row of no group: never read
        c, amax = _call(d, gs)
        c = np.asarray(c)
        self.assertTrue(np.isnan(c[10:22, 5]).all())
        self.assertEqual(int(np.isnan(c).sum()), 12)
        self.assertTrue((c[42:] == 0).all())
        self.assertTrue(np.isnan(float(amax)))
        self._check(d, gs, c, amax)
        gs_clean = np.array([10, 0, 32], np.int32)  # group 1 empty: its NaN weight is never used
        c, amax = _call(d, gs_clean)
        self.assertTrue(np.isfinite(np.asarray(c)).all() and np.isfinite(float(amax)))

    def test_bad_group_sizes(self):
        d = random_ragged_inputs(np.random.default_rng(5), t=32, g=3, n=16, k=32, fmt="mxfp8_e4m3")
        for gs, pattern in (([4, -1, 3], "non-negative"), ([10, 10, 13], "sums to 33"),
                            ([4, 4], r"shape \(G,\)"), (np.ones(3, np.float32), "integer")):
            with self.assertRaisesRegex((ValueError, TypeError), pattern):
                _call(d, np.asarray(gs))

    def test_non_array_operands(self):
        d = random_ragged_inputs(np.random.default_rng(5), t=32, g=3, n=16, k=32, fmt="mxfp8_e4m3")
        gs = np.array([4, 4, 4], np.int32)
        with self.assertRaisesRegex(TypeError, "a must be an array .*; got list"):
            jbg.ragged_gemm_amax(d["a"].tolist(), d["b"], d["sfa"], d["sfb"], gs)
        with self.assertRaisesRegex(TypeError, "sfb must be an array .*; got NoneType"):
            jbg.ragged_gemm_amax(d["a"], d["b"], d["sfa"], None, gs)

    def test_mixed_fp4_containers(self):
        d = random_ragged_inputs(np.random.default_rng(5), t=32, g=3, n=16, k=64, fmt="mxfp4")
        self.assertEqual(d["a"].dtype, np.uint8)
        b = jbg.formats.unpack_fp4(d["b"])
        with self.assertRaisesRegex(ValueError, "a and b must use the same FP4 container.*a: uint8, b: float4_e2m1fn"):
            jbg.ragged_gemm_amax(d["a"], b, d["sfa"], d["sfb"], np.array([4, 4, 4], np.int32))

    def test_group_sizes_checked_before_any_cast(self):
        """int64 sizes past int32 raise instead of wrapping (2**32 + 16 would become 16); None is no group sizes."""
        d = random_ragged_inputs(np.random.default_rng(5), t=64, g=4, n=16, k=32, fmt="mxfp8_e4m3")
        for gs, error, pattern in ((np.array([2**32 + 16, 16, 16, 16], np.int64), ValueError,
                                    "group_sizes sums to 4294967360, more than the 64 tokens"),
                                   (np.array([-2**32 + 16, 16, 16, 16], np.int64), ValueError,
                                    "group_sizes must be non-negative"),
                                   (np.array([2**62, 2**62, 0, 0], np.int64), ValueError, "group_sizes sums to"),
                                   (np.array([16, 16, 16, 16], np.float64), TypeError,
                                    "group_sizes has dtype float64; allowed: an integer dtype"),
                                   (None, TypeError, "group_sizes must be an integer array .*; got NoneType")):
            with self.subTest(gs=gs), self.assertRaisesRegex(error, pattern):
                _call(d, gs)
        c, _ = _call(d, [16, 16, 16, 0])  # a list of ints is fine
        self._check(d, np.array([16, 16, 16, 0]), c, _)

    def test_messages_show_the_callers_shapes(self):
        """G = 0, T = 0 and a K mismatch are reported on the caller's (T, K) and (G, N, K), not internal views."""
        d = random_ragged_inputs(np.random.default_rng(5), t=64, g=4, n=32, k=32, fmt="mxfp8_e4m3")
        gs = np.array([16, 16, 16, 16], np.int32)
        with self.assertRaisesRegex(ValueError, r"b has shape \(0, 32, 32\): G, the group .expert. count, must be "
                                                "at least 1"):
            jbg.ragged_gemm_amax(d["a"], d["b"][:0], d["sfa"], d["sfb"][:0], gs[:0])
        with self.assertRaisesRegex(ValueError, r"a has shape \(0, 32\): T, the token count, must be at least 1"):
            jbg.ragged_gemm_amax(d["a"][:0], d["b"], d["sfa"][:0], d["sfb"], gs * 0)
        with self.assertRaisesRegex(ValueError, r"a and b disagree on K: a gives K=32 \(shape \(64, 32\)\), b gives "
                                                r"K=64 \(shape \(4, 32, 64\)\)"):
            jbg.ragged_gemm_amax(d["a"], np.ones((4, 32, 64), d["b"].dtype), d["sfa"], d["sfb"], gs)
        with self.assertRaisesRegex(ValueError, r"N must be at least 1; got shapes a: \(64, 32\), b: \(4, 0, 32\)"):
            jbg.ragged_gemm_amax(d["a"], d["b"][:, :0], d["sfa"], d["sfb"][:, :0], gs)


        """Traced sizes outside the contract: negative counts as 0, rows past T are cut off."""
        d = random_ragged_inputs(np.random.default_rng(6), t=32, g=4, n=16, k=32, fmt="mxfp8_e4m3")
        c, amax = jax.jit(lambda gs: _call(d, gs))(jnp.array([5, -7, 20, 40], jnp.int32))
        self._check(d, np.array([5, 0, 20, 7]), c, amax)

    def test_jit_and_vmap(self):
        rng = np.random.default_rng(7)
        d = random_ragged_inputs(rng, t=32, g=3, n=16, k=64, fmt="mxfp4")
        a2 = np.stack([d["a"], d["a"][::-1]])
        sfa2 = np.stack([d["sfa"], d["sfa"][::-1]])
        gs2 = np.array([[10, 0, 22], [1, 30, 0]], np.int32)
        f = jax.jit(jax.vmap(lambda a, s, gs: jbg.ragged_gemm_amax(a, d["b"], s, d["sfb"], gs)))
        c, amax = f(a2, sfa2, gs2)
        for i in range(2):
            self._check(dict(d, a=a2[i], sfa=sfa2[i]), gs2[i], c[i], amax[i])

    def test_matches_jax_ragged_dot(self):
        """Same products as jax.lax.ragged_dot on the bf16-dequantized operands (float32 accumulation)."""
        rng = np.random.default_rng(8)
        d = random_ragged_inputs(rng, t=64, g=4, n=32, k=64, fmt="mxfp8_e4m3")
        gs = np.array([10, 0, 40, 14], np.int32)
        c, _ = _call(d, gs)
        a = jnp.asarray(oracle.dequantize_f64(d["a"], d["sfa"], block=32), jnp.bfloat16)
        b = jnp.asarray(oracle.dequantize_f64(d["b"], d["sfb"], block=32), jnp.bfloat16)
        ref = jax.lax.ragged_dot(a, jnp.swapaxes(b, 1, 2), jnp.asarray(gs), preferred_element_type=jnp.float32)
        np.testing.assert_allclose(np.asarray(c), np.asarray(ref), rtol=1e-6, atol=1e-6 * float(jnp.abs(ref).max()))

    def test_no_per_group_mask(self):
        """The program holds no (G, T, K) or (G, T, N) array (jax.lax.ragged_dot's CPU lowering does)."""
        t, g, n, k = 256, 8, 96, 128
        d = random_ragged_inputs(np.random.default_rng(9), t=t, g=g, n=n, k=k, fmt="mxfp8_e4m3")
        text = jax.jit(lambda gs: _call(d, gs)).lower(jnp.zeros(g, jnp.int32)).as_text()
        for shape in (f"{g}x{t}x{k}", f"{g}x{t}x{n}"):
            self.assertNotIn(shape, text)
        self.assertIn("while", text)

    @parameterized.parameters("mxfp8_e4m3", "mxfp4", "nvfp4")
    def test_decode_dequantizes_only_the_experts_used(self, fmt):
        """A few tokens over many experts (decode): the reference dequantizes the weights per chunk of work items, so
        the program holds no (G, N, K) array of bf16 weights, and the result matches the oracle and, bit for bit, the
        result of dequantizing every expert first (which does hold one)."""
        t, g, n, k = 5, 40, 48, 64
        self.assertTrue(ragged.weights_per_item(t, g))
        self.assertFalse(ragged.weights_per_item(16384, 32))  # training sizes: every expert once
        d = random_ragged_inputs(np.random.default_rng(11), t=t, g=g, n=n, k=k, fmt=fmt)
        gs = np.zeros(g, np.int32)
        gs[[0, 17, 39]] = [2, 1, 1]  # empty groups between, one row of no group at the end
        per_item = jax.jit(lambda gs: _call(d, gs))
        self.assertNotIn(f"{g}x{n}x{k}xbf16", per_item.lower(jnp.asarray(gs)).as_text())
        c, amax = per_item(jnp.asarray(gs))
        self._check(d, gs, c, amax)
        with mock.patch.object(ragged, "weights_per_item", return_value=False):
            every_expert = jax.jit(lambda gs: _call(d, gs))
            self.assertIn(f"{g}x{n}x{k}xbf16", every_expert.lower(jnp.asarray(gs)).as_text())
            c_all, amax_all = every_expert(jnp.asarray(gs))
        np.testing.assert_array_equal(np.asarray(c), np.asarray(c_all))
        self.assertEqual(float(amax), float(amax_all))

    def test_cutedsl_raises_off_cuda(self):
        d = random_ragged_inputs(np.random.default_rng(10), t=32, g=2, n=16, k=32, fmt="mxfp8_e4m3")
        with self.assertRaisesRegex(ValueError, "cutedsl"):
            _call(d, np.array([16, 16], np.int32), implementation="cutedsl")


class RaggedShardingTest(parameterized.TestCase):

    @parameterized.parameters((P("t", None), P("e", None, None), "shardy"),  # tokens on one axis, experts on the other
                              (P(None, None), P("e", "t", None), "shardy"),  # experts and the weights' rows N
                              (P("t", None), P("e", None, None), "gspmd"))
    def test_sharded_equals_unsharded(self, a_spec, b_spec, partitioner):
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("t", "e"))
        rng = np.random.default_rng(11)
        d = random_ragged_inputs(rng, t=64, g=8, n=32, k=64, fmt="mxfp8_e4m3")
        gs = jnp.asarray(np.array([5, 0, 20, 1, 0, 13, 9, 3], np.int32))
        want_c, want_amax = _call(d, gs)
        put = lambda x, spec: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
        sfb_spec = P(*b_spec[:2], None)
        a, sfa = put(d["a"], a_spec), put(d["sfa"], a_spec)
        b, sfb = put(d["b"], b_spec), put(d["sfb"], sfb_spec)
        f = jax.jit(lambda a, b, sfa, sfb, gs: jbg.ragged_gemm_amax(a, b, sfa, sfb, gs))
        with partitioners.partitioner(partitioner):
            c, amax = f(a, b, sfa, sfb, gs)
            hlo = f.lower(a, b, sfa, sfb, gs).compile().as_text()
        np.testing.assert_array_equal(np.asarray(c), np.asarray(want_c))
        self.assertEqual(float(amax), float(want_amax))
        if b_spec[0] is not None:  # experts sharded: the weights are never gathered
            self.assertNotRegex(hlo, r"all-gather[^\n]*f8e4m3fn\[8,32,64\]")


def _weights(w_gkn: np.ndarray, w_major: str) -> np.ndarray:
    """(G, K, N) weights as `grouped_dot` reads them for w_major: (G, N, K) for "k", as they are for "n"."""
    return np.ascontiguousarray(np.swapaxes(w_gkn, 1, 2)) if w_major == "k" else w_gkn


class GroupedDotTest(parameterized.TestCase):
    """The bf16 grouped product (`ragged.grouped_dot`, mx_ragged_dot's bf16 recipe) against the float64 oracle:
    both weight layouts, f32 and bf16 out, odd sizes, empty and one-token groups, rows of no group, NaN per group,
    vmap and the partitioning rules with an N-major weight."""

    def _check(self, out, amax, ref, ref_amax, gs, c_dtype):
        oracle_ops.assert_gemm_close(self, out, ref, c_dtype=c_dtype)
        oracle_ops.assert_amax_close(self, amax, ref_amax)
        self.assertTrue(np.all(np.asarray(out, np.float32)[int(np.sum(gs)):] == 0), "rows past the groups")

    @parameterized.product(w_major=("k", "n"), c_dtype=(jnp.float32, jnp.bfloat16))
    def test_matches_oracle(self, w_major, c_dtype):
        rng = np.random.default_rng(hash((w_major, str(c_dtype))) % 2**32)
        x, w = random_bf16_grouped(rng, t=70, g=5, n=24, k=40)
        f = jax.jit(lambda x, w, gs: ragged.grouped_dot(x, w, gs, w_major=w_major, c_dtype=c_dtype))
        for gs in (np.array([9, 0, 1, 33, 20], np.int32), random_group_sizes(rng, 70, 5, fill=False)):
            out, amax = f(x, _weights(w, w_major), gs)
            self.assertEqual(out.dtype, c_dtype)
            self._check(out, amax, *grouped_dot_oracle(x, w, gs), gs, c_dtype)

    def test_nan_stays_in_its_group(self):
        x, w = random_bf16_grouped(np.random.default_rng(3), t=40, g=3, n=16, k=24)
        x[12, 5] = np.nan  # group 1's row 12
        x[39, 0] = np.nan  # a row of no group: never read
        gs = np.array([10, 5, 20], np.int32)
        out, amax = ragged.grouped_dot(x, w, gs, w_major="n")
        out = np.asarray(out)
        self.assertTrue(np.isnan(out[12]).all())
        self.assertEqual(int(np.isnan(out).sum()), 16)
        self.assertTrue(np.isnan(float(amax)))
        self.assertTrue((out[35:] == 0).all())

    def test_vmap(self):
        x, w = random_bf16_grouped(np.random.default_rng(4), t=48, g=3, n=16, k=32)
        x2 = np.stack([x, x[::-1]])
        gs2 = np.array([[10, 0, 38], [48, 0, 0]], np.int32)
        out, amax = jax.vmap(lambda x, gs: ragged.grouped_dot(x, w, gs, w_major="n"))(x2, gs2)
        for i in range(2):
            ref, ref_amax = grouped_dot_oracle(x2[i], w, gs2[i])
            self._check(out[i], amax[i], ref, ref_amax, gs2[i], jnp.float32)

    @parameterized.parameters((P("t", None), P("e", None, None)),  # tokens on one axis, experts on the other
                              (P(None, None), P("e", None, "t")))  # experts and the weights' columns N
    def test_sharded_n_major_weights(self, x_spec, w_spec):
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("t", "e"))
        x, w = random_bf16_grouped(np.random.default_rng(5), t=64, g=8, n=32, k=64)
        gs = jnp.asarray(np.array([5, 0, 20, 1, 0, 13, 9, 3], np.int32))
        f = jax.jit(lambda x, w, gs: ragged.grouped_dot(x, w, gs, w_major="n"))
        want_out, want_amax = f(x, w, gs)
        put = lambda v, spec: jax.device_put(jnp.asarray(v), NamedSharding(mesh, spec))
        out, amax = f(put(x, x_spec), put(w, w_spec), gs)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
        self.assertEqual(float(amax), float(want_amax))
        self.assertIn("CustomSPMDPartitioning", f.lower(put(x, x_spec), put(w, w_spec), gs).as_text())


if __name__ == "__main__":
    absltest.main()
