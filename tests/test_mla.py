"""mla_q_projection: the fused forward's views, and straight-through gradients against float64 oracles.

The forward must be the fused op itself (bit-identical outputs) and, through the views, within SPEC §7 of the
float64 projection. Gradients for random cotangents of both views are checked (1) tightly (1e-5 relative) against
the float64 rule: dY = RoPEᵀ(d_row + d_col), dX = Q_N(dY)·Q_N(W), dW = Q_T(dY)ᵀ·Q_T(X); and (2) elementwise within
MX quantization error (oracle_ops.QUANT_ERROR) of the exact gradient of the unquantized projection, which under the
straight-through rule differs from (1) only by the backward GEMMs' quantization.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg

import oracle_ops


def _inputs(rng, t, h, k, w_out_in):
    x = (rng.standard_normal((t, k)) * np.exp2(rng.integers(-3, 4, (t, 1)))).astype(np.float32)
    w = (rng.standard_normal((h * 192, k)) / np.sqrt(k)).astype(np.float32)
    angles = rng.uniform(-np.pi, np.pi, (t, 64))
    cos, sin = np.cos(angles).astype(oracle_ops.BF16), np.sin(angles).astype(oracle_ops.BF16)
    g_row, g_col = rng.standard_normal((2, t, h, 192)).astype(np.float32)
    return x, (w if w_out_in else np.ascontiguousarray(w.T)), cos, sin, g_row, g_col


def _views_and_grads(x, w, cos, sin, g_row, g_col, w_out_in, recipe):
    def f(x, w):
        views = jbg.mla_q_projection(x, w, cos, sin, w_out_in=w_out_in, recipe=recipe)
        return views.dequantize(), views

    (row, col), vjp, views = jax.vjp(f, x, w, has_aux=True)
    dx, dw = vjp((jnp.asarray(g_row), jnp.asarray(g_col)))
    return views, row, col, dx, dw


class MLAQProjectionTest(parameterized.TestCase):

    @parameterized.parameters(
        dict(t=64, h=2, k=96, w_out_in=True, recipe="mxfp8"),
        dict(t=96, h=1, k=64, w_out_in=False, recipe="mxfp8"),
        dict(t=32, h=3, k=40, w_out_in=True, recipe="bf16_in"),  # K=40: the bf16 path, dgrad/wgrad still MXFP8
    )
    def test_forward_and_gradients(self, t, h, k, w_out_in, recipe):
        recipe = jbg.Recipe(fwd="bf16") if recipe == "bf16_in" else jbg.RECIPES[recipe]
        x, w, cos, sin, g_row, g_col = _inputs(np.random.default_rng(t * k + h), t, h, k, w_out_in)
        views, row, col, dx, dw = _views_and_grads(x, w, cos, sin, g_row, g_col, w_out_in, recipe)
        # forward: exactly the fused op, and within SPEC §7 of the float64 projection
        if recipe.fwd == "mxfp8_e4m3":
            xq, xs = jbg.formats.quantize_mxfp8(x)
            wq, ws = jbg.formats.quantize_mxfp8(w, axis=-1 if w_out_in else 0)
            fused = jbg.gemm_proj_rope_mxfp8(xq, wq, jnp.asarray(cos), jnp.asarray(sin), x_scale=xs, w_scale=ws,
                                             w_out_in=w_out_in)
            y_ref = oracle_ops.proj_rope_oracle(np.asarray(xq), np.asarray(wq), cos, sin, x_scale=np.asarray(xs),
                                                w_scale=np.asarray(ws), w_out_in=w_out_in)
        else:
            x16, w16 = x.astype(oracle_ops.BF16), w.astype(oracle_ops.BF16)
            fused = jbg.gemm_proj_rope_mxfp8(jnp.asarray(x16), jnp.asarray(w16), jnp.asarray(cos), jnp.asarray(sin),
                                             w_out_in=w_out_in)
            y_ref = oracle_ops.proj_rope_oracle(x16, w16, cos, sin, w_out_in=w_out_in)
        views_out = (views.row_codes, views.row_scales, views.col_codes, views.col_scales)
        for got, want in zip(views_out, fused):
            np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
        oracle_ops.assert_proj_rope_close(self, views_out, y_ref)
        np.testing.assert_array_equal(row, jbg.formats.dequantize(views.row_codes, views.row_scales, block=32))
        np.testing.assert_array_equal(col, jbg.formats.dequantize(views.col_codes, views.col_scales, block=32,
                                                                  axis=0))
        # gradients: the float64 straight-through rule (tight) and the exact gradient (within MX error)
        d_y = oracle_ops.rope_transpose_f64(g_row.astype(np.float64) + g_col, cos, sin).reshape(1, t, -1)
        w_nk = (w if w_out_in else w.T)[None].astype(np.float64)  # (1, N, K)
        dx_rule, dx_exact, dx_bound = oracle_ops._gemm_f64(d_y, 2, w_nk, 1, recipe.dgrad)
        dw_rule, dw_exact, dw_bound = oracle_ops._gemm_f64(d_y, 1, x[None].astype(np.float64), 1, recipe.wgrad)
        orient = (lambda v: v[0]) if w_out_in else (lambda v: v[0].T)
        oracle_ops.assert_rel_close(self, "dx", dx, dx_rule[0], 1e-5)
        oracle_ops.assert_rel_close(self, "dw", dw, orient(dw_rule), 1e-5)
        oracle_ops.assert_within_bound(self, "dx vs exact", dx, dx_exact[0], dx_bound[0])
        oracle_ops.assert_within_bound(self, "dw vs exact", dw, orient(dw_exact), orient(dw_bound))
        # the exact gradient really is the gradient of the unquantized projection (JAX autodiff, float32; HIGHEST:
        # a GPU's default float32 dot runs on TF32 tensor cores, ~3e-4 off)
        def exact(x, w):
            y = jnp.matmul(x, w.T if w_out_in else w, precision=jax.lax.Precision.HIGHEST)
            return jbg.reference.apply_rope(y.reshape(t, h, 192), jnp.asarray(cos), jnp.asarray(sin))
        _, exact_vjp = jax.vjp(exact, x, w)
        ex_dx, ex_dw = exact_vjp(jnp.asarray(g_row + g_col))
        oracle_ops.assert_rel_close(self, "autodiff dx", ex_dx, dx_exact[0], 1e-5)
        oracle_ops.assert_rel_close(self, "autodiff dw", ex_dw, orient(dw_exact), 1e-5)

    def test_jit_traces_once_and_vmap(self):
        traces = []

        @jax.jit
        def grads(x, w, cos, sin):
            traces.append(1)
            loss = lambda x, w: sum(jnp.sum(v ** 2) for v in jbg.mla_q_projection(x, w, cos, sin).dequantize())
            return jax.grad(loss, argnums=(0, 1))(x, w)

        rng = np.random.default_rng(11)
        for _ in range(2):
            x, w, cos, sin, _, _ = _inputs(rng, 32, 1, 64, True)
            dx, dw = grads(x, w, cos, sin)
        self.assertLen(traces, 1)
        xs = np.stack([x, 2 * x])
        dxs, dws = jax.vmap(grads, in_axes=(0, None, None, None))(xs, w, cos, sin)
        oracle_ops.assert_rel_close(self, "vmap dx", dxs[0], dx, 1e-6)
        oracle_ops.assert_rel_close(self, "vmap dw", dws[0], dw, 1e-6)

    def test_errors(self):
        x, w, cos, sin, _, _ = _inputs(np.random.default_rng(12), 32, 1, 64, True)
        with self.assertRaisesRegex(ValueError, r"recipe.fwd \(the fused op's input path\)='nvfp4'"):
            jbg.mla_q_projection(x, w, cos, sin, recipe=jbg.Recipe(fwd="nvfp4"))
        with self.assertRaisesRegex(ValueError, "multiple of 32"):
            jbg.mla_q_projection(x[:16], w, cos[:16], sin[:16])
        with self.assertRaisesRegex(TypeError, "x has dtype int32"):
            jbg.mla_q_projection(x.astype(np.int32), w, cos, sin)
        with self.assertRaisesRegex(TypeError, "recipe must be a jax_blockgemm.Recipe"):
            jbg.mla_q_projection(x, w, cos, sin, recipe="mxfp8")
        with self.assertRaisesRegex(TypeError, "mla_q_projection: cos must be an array .*; got NoneType"):
            jbg.mla_q_projection(x, w, None, sin)


if __name__ == "__main__":
    absltest.main()
