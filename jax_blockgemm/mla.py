"""Differentiable DeepSeek-V3 MLA Q projection: the fused `gemm_proj_rope_mxfp8` forward, straight-through backward.

`mla_q_projection` runs the fused op (GEMM, per-head RoPE, MXFP8 rowwise and columnwise quantization) and returns
its two MXFP8 views as `MXFP8Views`, a small pytree. `views.dequantize()` gives both views as float32 (T, H, 192)
and is differentiable with respect to x and w: quantization is straight-through, so the cotangent of either view
is taken as the cotangent of Y after RoPE. The backward applies RoPE's transpose (its inverse for unit-norm
cos/sin tables) to get the cotangent of the GEMM's output, then runs dgrad and wgrad as block-scaled GEMMs
(`autodiff.block_gemm`) in the recipe's formats, each operand quantized along its own contraction axis.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_blockgemm import api, autodiff, formats, reference, support

__all__ = ["MXFP8Views", "mla_q_projection"]

_INPUT_FORMATS = ("bf16", "mxfp8_e4m3")  # the fused op's two input paths


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _straight_through(x, w, cos, sin, row, col, w_out_in: bool, recipe: autodiff.Recipe):
    """Identity on the dequantized views (row, col); the backward sends their cotangents to x and w."""
    return row, col


def _straight_through_fwd(x, w, cos, sin, row, col, w_out_in, recipe):
    return (row, col), (x, w, cos, sin)


def _straight_through_bwd(w_out_in, recipe, residuals, cotangents):
    """dY (T, H*192) = RoPEᵀ(d_row + d_col); dX = dY·W over H*192, dW = dYᵀ·X over T, both block-scaled."""
    x, w, cos, sin = residuals
    d_views = cotangents[0] + cotangents[1]
    _, rope_vjp = jax.vjp(lambda y: reference.apply_rope(y, cos, sin), jnp.zeros_like(d_views))
    dy = rope_vjp(d_views)[0].reshape(1, d_views.shape[0], -1)  # (1, T, N)
    w3 = w[None]  # (1, N, K) for w_out_in, (1, K, N) otherwise
    dx, _ = autodiff.block_gemm(dy, 2, w3, 1 if w_out_in else 2, recipe.dgrad, x.dtype,
                                implementation=recipe.implementation)
    dw, _ = autodiff.block_gemm(dy, 1, x[None], 1, recipe.wgrad, w.dtype, c_transposed=not w_out_in,
                                implementation=recipe.implementation)
    zero = lambda v: jnp.zeros_like(v)
    # cos and sin are treated as constants (position tables): zero cotangent
    return dx[0], dw[0], zero(cos), zero(sin), zero(cotangents[0]), zero(cotangents[1])


_straight_through.defvjp(_straight_through_fwd, _straight_through_bwd)


@dataclasses.dataclass(frozen=True)
class MXFP8Views:
    """The fused op's outputs, E4M3 codes and E8M0 scale bytes: rowwise (blocks of 32 features inside a head) and
    columnwise (blocks of 32 tokens), plus the inputs the straight-through backward needs. A pytree."""

    row_codes: jax.Array  # (T, H, 192) float8_e4m3fn
    row_scales: jax.Array  # (T, H, 6) uint8
    col_codes: jax.Array  # (T, H, 192) float8_e4m3fn
    col_scales: jax.Array  # (T/32, H, 192) uint8
    x: jax.Array
    w: jax.Array
    cos: jax.Array
    sin: jax.Array
    w_out_in: bool = True
    recipe: autodiff.Recipe = autodiff.RECIPES["mxfp8"]

    def dequantize(self) -> tuple[jax.Array, jax.Array]:
        """(rowwise, columnwise) float32 (T, H, 192) values; differentiable w.r.t. x and w (straight-through)."""
        row = formats.dequantize(self.row_codes, self.row_scales, block=support.MX_BLOCK, axis=-1)
        col = formats.dequantize(self.col_codes, self.col_scales, block=support.MX_BLOCK, axis=0)
        return _straight_through(self.x, self.w, self.cos, self.sin, row, col, self.w_out_in, self.recipe)


jax.tree_util.register_dataclass(
    MXFP8Views, data_fields=["row_codes", "row_scales", "col_codes", "col_scales", "x", "w", "cos", "sin"],
    meta_fields=["w_out_in", "recipe"])


def mla_q_projection(x: jax.Array, w: jax.Array, cos: jax.Array, sin: jax.Array, *, w_out_in: bool = True,
                     recipe: autodiff.Recipe = autodiff.RECIPES["mxfp8"]) -> MXFP8Views:
    """MLA Q up-projection through the fused `gemm_proj_rope_mxfp8`, differentiable through `.dequantize()`.

    x: (T, K) floating; w: (H*192, K) for w_out_in (else (K, H*192)), floating; cos, sin: (T, 64) (cast to
    bfloat16, as the op takes them; they get no gradient). recipe.fwd picks the op's input path: "mxfp8_e4m3"
    quantizes x and w along K first (MXFP8 in), "bf16" feeds them as bfloat16; recipe.dgrad / recipe.wgrad are the
    backward GEMMs' formats (bf16 fallback where a contraction length is not a multiple of 32). T must be a
    multiple of 32 and K of 32 (MXFP8 in) or 8 (bf16 in); the op raises otherwise.
    """
    if not isinstance(recipe, autodiff.Recipe):
        raise TypeError(f"recipe must be a jax_blockgemm.Recipe; got {recipe!r}.")
    support.check_choice("recipe.fwd (the fused op's input path)", recipe.fwd, _INPUT_FORMATS)
    x, w = support.as_array("x", x, "mla_q_projection"), support.as_array("w", w, "mla_q_projection")
    for name, v in (("x", x), ("w", w)):
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"mla_q_projection: {name} has dtype {support.dtype_name(v)}; allowed: a floating dtype.")
    cos16, sin16 = (support.as_array(name, v, "mla_q_projection").astype(jnp.bfloat16)
                    for name, v in (("cos", cos), ("sin", sin)))
    # the op has no differentiation rule: its gradient is the straight-through one attached in dequantize()
    x_in, w_in = jax.lax.stop_gradient(x), jax.lax.stop_gradient(w)
    cos_in, sin_in = jax.lax.stop_gradient(cos16), jax.lax.stop_gradient(sin16)
    if recipe.fwd == "mxfp8_e4m3":
        xq, xs = formats.quantize_mxfp8(x_in, axis=-1)
        wq, ws = formats.quantize_mxfp8(w_in, axis=-1 if w_out_in else 0)
        outs = api.gemm_proj_rope_mxfp8(xq, wq, cos_in, sin_in, x_scale=xs, w_scale=ws, w_out_in=w_out_in,
                                        implementation=recipe.implementation)
    else:
        outs = api.gemm_proj_rope_mxfp8(x_in.astype(jnp.bfloat16), w_in.astype(jnp.bfloat16), cos_in, sin_in,
                                        w_out_in=w_out_in, implementation=recipe.implementation)
    return MXFP8Views(*outs, x, w, cos16, sin16, bool(w_out_in), recipe)
