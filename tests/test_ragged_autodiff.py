"""mx_ragged_dot (the differentiable mixture-of-experts matmul) and the MXExperts layer against the float64 oracle's
straight-through rule: forward, dgrad and wgrad per recipe, group boundaries off the 32-token blocks (each group
quantized on its own blocks), empty groups, rows past the groups, contractions off the multiple of 32 (bf16), bad
group sizes, jit.
"""

import os
import re
from unittest import mock

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax, when run directly

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

import jax_blockgemm as jbg
from jax_blockgemm import api, dispatch, quantize_pair
from jax_blockgemm.layers.nnx import MXExperts

import oracle_ops
from oracle_ragged import mx_ragged_dot_oracle

RTOL = 1e-5  # the library and the oracle apply the same quantization; only float32 accumulation differs


def _inputs(seed, t, g, k, n):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(t, k)).astype(np.float32), rng.normal(size=(g, k, n)).astype(np.float32),
            rng.normal(size=(t, n)).astype(np.float32))


class GroupPaddingMapTest(parameterized.TestCase):

    @parameterized.parameters(([0, 37, 1, 0, 50], 100), ([32, 64, 0], 96), ([5, 27], 32), ([0, 0, 7], 200),
                              ([300], 300))
    def test_names_every_token_once_with_groups_on_whole_blocks(self, sizes, tokens):
        """The padded layout's map: group g's rows in order from the first row of its own block of 32 (after the
        groups before it, each rounded up), padding rows -1 between groups, then the rows of no group; every token
        row named exactly once, so the gather kernels write every row's column blocks."""
        from jax_blockgemm import moe, ragged

        starts, ends = ragged.group_bounds(jnp.asarray(sizes, jnp.int32), tokens)
        row_map = np.asarray(moe._group_padding_map(starts, ends, tokens))
        self.assertEqual(len(row_map) % 32, 0)
        np.testing.assert_array_equal(np.sort(row_map[row_map >= 0]), np.arange(tokens))
        first = 0
        for size, start in zip(sizes, np.asarray(starts)):
            np.testing.assert_array_equal(row_map[first:first + size], np.arange(start, start + size))
            self.assertTrue((row_map[first + size:first + -(-size // 32) * 32] == -1).all())
            first += -(-size // 32) * 32
        rest = row_map[first:]
        np.testing.assert_array_equal(rest[rest >= 0], np.arange(sum(sizes), tokens))


class MxRaggedDotTest(parameterized.TestCase):

    # group sizes off the 32-token blocks, an empty group, a one-token group, 12 rows past the groups; K = 40 makes the
    # forward fall back to bf16 (dgrad over N = 64 stays quantized). Both forms of the MX GEMMs (`arch.TABLE`'s
    # mx_ragged_operands): the values quantized and dequantized in place on the bf16 GEMM, or the codes. The last
    # element of a case: whether the bf16 form quantizes the weights once for both GEMMs (quantize_pair: MXFP8
    # forward and dgrad, K and N whole blocks), dgrad then taking their codes.
    @parameterized.product(case=(("nvfp4", 64, 48, False), ("mxfp8_hybrid", 40, 64, False),
                                 ("mxfp8_hybrid", 64, 96, True), ("mxfp8", 96, 32, True)),
                           form=("bf16", "codes"))
    def test_against_oracle(self, case, form):
        recipe, k, n, pairs = case
        pairs = pairs and form == "bf16"
        x, w, dy = _inputs(0, 100, 5, k, n)
        gs = np.array([0, 37, 1, 0, 50], np.int32)
        r = jbg.RECIPES[recipe]
        with mock.patch.object(dispatch, "mx_ragged_operands", return_value=form), \
                mock.patch.object(api, "ragged_gemm_amax", wraps=api.ragged_gemm_amax) as codes_gemm, \
                mock.patch.object(quantize_pair, "quantize_pair", wraps=quantize_pair.quantize_pair) as pair:
            out, vjp = jax.vjp(jax.jit(lambda x, w: jbg.mx_ragged_dot(x, w, jnp.asarray(gs), recipe=r)), x, w)
            dx, dw = vjp(jnp.asarray(dy))
        # each case quantizes its forward or its dgrad; the codes form hands codes to ragged_gemm_amax, and so does the
        # bf16 form's dgrad where the weights were quantized as a pair; wgrad's MXFP8 token quantization always takes
        # quantize_pair (2-D: the tokens, padded or through the padding map), the weights only where they pair (3-D)
        ranks = {call.args[0].ndim for call in pair.call_args_list}
        self.assertEqual(3 in ranks, pairs)
        self.assertEqual(2 in ranks, r.wgrad in quantize_pair.FORMATS)
        self.assertEqual(codes_gemm.called, form == "codes" or pairs)
        ref = mx_ragged_dot_oracle(x, w, gs, dy, fwd=r.fwd, dgrad=r.dgrad, wgrad=r.wgrad)
        oracle_ops.assert_rel_close(self, "out", out, ref["out"], RTOL)
        oracle_ops.assert_rel_close(self, "dx", dx, ref["dx"], RTOL)
        oracle_ops.assert_rel_close(self, "dw", dw, ref["dw"], RTOL)
        self.assertTrue((np.asarray(out)[88:] == 0).all() and (np.asarray(dx)[88:] == 0).all())
        self.assertTrue((np.asarray(dw)[[0, 3]] == 0).all(), "empty groups get a zero weight gradient")

    def test_mxfp8_step_lowers_to_the_sm90a_kernels(self):
        """What a training step on bf16 operands runs on sm_90a (lowered here for CUDA, as on an H200): the pair
        kernel on the weights (schedule 0: values along K, codes along N), on x (schedule 2, through the group
        padding map: values along the padded groups' rows for wgrad, along K for the forward) and on dY (schedule 1:
        values along the rows, codes along N for dgrad), the forward on the bf16 grouped kernel, dgrad on the swap_ab
        kernel (both operands' codes along N), wgrad on the grouped contraction."""
        t, g, k, n = 600, 5, 256, 192
        x, w, dy = (jnp.asarray(v, jnp.bfloat16) for v in _inputs(1, t, g, k, n))
        gs = jnp.asarray([97, 0, 1, 300, 170], jnp.int32)

        def step(x, w, dy):
            out, vjp = jax.vjp(lambda x, w: jbg.mx_ragged_dot(x, w, gs, recipe="mxfp8"), x, w)
            return (out, *vjp(dy))

        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)), \
                mock.patch.object(dispatch, "_failed_self_checks", return_value=""):  # self-checks passed
            text = jax.jit(step).trace(x, w, dy).lower(lowering_platforms=("cuda",)).as_text()
        calls = {name: text.count(f"custom_call @{name}(") for name in
                 ("jbg_quantize_pair", "jbg_ragged_gemm_amax", "jbg_grouped_contraction")}
        self.assertEqual(calls, {"jbg_quantize_pair": 3, "jbg_ragged_gemm_amax": 2, "jbg_grouped_contraction": 1})
        pair_calls = [line for line in text.splitlines() if "custom_call @jbg_quantize_pair(" in line]
        self.assertEqual(sorted(re.findall(r"schedule = (\d) : i64", "\n".join(pair_calls))), ["0", "1", "2"])
        ragged_ab = sorted(re.findall(r'custom_call @jbg_ragged_gemm_amax\(.*?ab_dtype = "(\w+)"', text))
        self.assertEqual(ragged_ab, ["bfloat16", "float8_e4m3fn"])  # the forward's values, dgrad's codes
        # the swap_ab objects: E4M3 weights, bf16 tokens
        self.assertTrue('a_dtype = "bfloat16", ab_dtype = "float8_e4m3fn"' in text, "dgrad is not on swap_ab")

    def test_wgrad_blocks_follow_groups(self):
        """A spike in group 0 must not set the block scale of group 1's tokens (one shared 32-token block would)."""
        x, w, dy = _inputs(1, 32, 2, 32, 32)
        x[3] *= 1e4
        gs = np.array([5, 27], np.int32)
        dw = jax.jit(jax.grad(lambda w: jnp.vdot(jbg.mx_ragged_dot(x, w, gs), dy)))(w)
        ref = mx_ragged_dot_oracle(x, w, gs, dy, fwd="mxfp8_e4m3", dgrad="mxfp8_e4m3", wgrad="mxfp8_e4m3")
        oracle_ops.assert_rel_close(self, "dw[1]", dw[1], ref["dw"][1], RTOL)
        exact = x[5:].astype(np.float64).T @ dy[5:]
        self.assertLess(np.linalg.norm(dw[1] - exact) / np.linalg.norm(exact), 0.05)

    def test_traced_group_sizes_and_errors(self):
        x, w, _ = _inputs(2, 32, 3, 32, 32)
        out = jax.jit(jbg.mx_ragged_dot)(x, w, jnp.array([10, 30, 5], jnp.int32))  # cut off at T
        ref = mx_ragged_dot_oracle(x, w, np.array([10, 22, 0]), np.zeros((32, 32)), fwd="mxfp8_e4m3",
                                   dgrad="mxfp8_e4m3", wgrad="mxfp8_e4m3")
        oracle_ops.assert_rel_close(self, "out", out, ref["out"], RTOL)
        with self.assertRaisesRegex(ValueError, "sums to 45"):
            jbg.mx_ragged_dot(x, w, np.array([10, 30, 5], np.int32))
        with self.assertRaisesRegex(ValueError, "group_sizes sums to 4294967341"):  # not wrapped to 45
            jbg.mx_ragged_dot(x, w, np.array([2**32 + 10, 30, 5], np.int64))
        with self.assertRaisesRegex(ValueError, "agree on K"):
            jbg.mx_ragged_dot(x, w[:, :16], np.array([1, 1, 1], np.int32))
        with self.assertRaisesRegex(TypeError, "preferred_element_type=int32 is not supported by mx_ragged_dot"):
            jbg.mx_ragged_dot(x, w, np.array([1, 1, 1], np.int32), preferred_element_type=jnp.int32)

    def test_experts_layer(self):
        layer = MXExperts(4, 32, 16, rngs=nnx.Rngs(0))
        self.assertEqual(layer.kernel[...].shape, (4, 32, 16))
        x = jnp.asarray(np.random.default_rng(3).normal(size=(40, 32)), jnp.float32)
        gs = jnp.array([10, 0, 25, 5], jnp.int32)
        loss, grads = nnx.jit(nnx.value_and_grad(lambda m: jnp.sum(m(x, gs))))(layer)
        ref = mx_ragged_dot_oracle(x, layer.kernel[...], gs, np.ones((40, 16)), fwd="mxfp8_e4m3", dgrad="mxfp8_e4m3",
                                   wgrad="mxfp8_e4m3")
        self.assertAlmostEqual(float(loss), float(ref["out"].sum()), delta=1e-4 * np.abs(ref["out"]).sum())
        oracle_ops.assert_rel_close(self, "d kernel", grads.kernel[...], ref["dw"], RTOL)
        self.assertEqual(grads.kernel[...].shape, (4, 32, 16))
        self.assertTrue((np.asarray(grads.kernel[...])[1] == 0).all())


if __name__ == "__main__":
    absltest.main()
