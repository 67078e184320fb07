"""Differentiable mixture-of-experts matmul: `mx_ragged_dot`, a drop-in for `jax.lax.ragged_dot` that trains in MX.

lhs (T, K) tokens sorted by expert, rhs (G, K, N) one weight per expert, group_sizes (G,). Both operands are
block-quantized by a `Recipe` (as in `mx_dot_general`). The custom VJP is straight-through, each operand quantized
along its own contraction axis:

  forward  Y = X · W_g over K;
  dgrad    dX = dY · W_gᵀ over N: the weights read with N as the contraction (rhs is already (G, K, N), N-last);
  wgrad    dW_g = X_gᵀ · dY_g over the group's tokens. Blocks of 32 tokens would straddle group boundaries that are
           not multiples of 32, so each group is zero-padded to a multiple of 32 rows first (at most 31·G extra rows);
           every block then lies inside one group, X and dY are quantized along the tokens, and the per-group
           contraction (`contraction.contract_groups`, its kernel where one applies) runs on the dequantized values
           (exact in bf16) with float32 accumulation.

Forward and dgrad take one of two forms, per architecture (`arch.TABLE`'s `mx_ragged_operands`): "bf16" quantizes
each operand and dequantizes it in place (`formats.quantize_dequantize`: the blocks split where they lie, so the
K-blocked weights need no transposed copy) and multiplies the values, exact in bf16, on the bf16 grouped GEMM
(`ragged.grouped_dot`); "codes" hands the codes and scales to `ragged_gemm_amax` (the weights quantized K-major, a
transposed copy for the forward). Both give the same values up to float32 summation order. Where MX GEMMs run at the
bf16 tensor rate (sm_90a) the codes buy nothing and the transposed copy costs three times the GEMM
(docs/design/moe.md). Under differentiation the "bf16" form quantizes the weights once for both GEMMs
(`quantize_pair`: one pass, its kernel where one applies): the forward takes their values along K, and dgrad their
codes along N, kept from the forward (half the weights' bf16 bytes) and read by `ragged_gemm_amax` as they lie. The
tokens then take one pass each too, through the group-padding map (`_group_padding_map`): x's values along K for the
forward and along the padded groups' rows for wgrad (kept instead of x), dY's codes along N for dgrad and its values
along the rows for wgrad.

A GEMM whose contraction is not a multiple of 32 (K for the forward, N for dgrad) runs in bf16 instead, as in
mx_dot_general; wgrad's padding makes the token contraction always fit. The bf16 recipe runs the bf16 grouped GEMM,
reading the (G, K, N) weights in place both ways.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_blockgemm import api, autodiff, contraction, dispatch, formats, quantize_pair, ragged, support

__all__ = ["mx_ragged_dot"]

_BLOCK_ROWS = 32  # wgrad pads each group to a multiple of this many tokens (the MX block; two NVFP4 blocks)


def _quantize(x: jax.Array, fmt: str, axis: int) -> tuple[jax.Array, jax.Array, Optional[jax.Array]]:
    """(codes, scales, NVFP4 tensor scale or None) of x quantized along `axis`; FP4 codes unpacked (float4_e2m1fn)."""
    if fmt == "nvfp4":
        encode, tensor_scale = formats.nvfp4_tensor_scales(x)
        codes, scales = formats.quantize_nvfp4(x.astype(jnp.float32) * encode, axis=axis, packed=False)
        return codes, scales, tensor_scale
    if fmt == "mxfp4":
        return (*formats.quantize_mxfp4(x, axis=axis, packed=False), None)
    return (*formats.quantize_mxfp8(x, axis=axis, dtype=formats.FORMATS[fmt].code_dtype), None)


def _ragged_gemm(a: jax.Array, w: jax.Array, group_sizes: jax.Array, fmt: str, implementation: Any, *,
                 w_major: str, out_dtype: np.dtype) -> jax.Array:
    """(T, F) out_dtype: a (T, C) times each group's weight, contracted over C: w (G, F, C) for w_major "k",
    (G, C, F) for "n"; both quantized along C in `fmt` and multiplied as their bf16 values or as codes (the module's
    two forms), or bf16 (then the N-major w is read as it is)."""
    c = a.shape[1]
    if fmt == "bf16" or c % autodiff.K_MULTIPLE:
        out, _ = ragged.grouped_dot(a, w, group_sizes, w_major=w_major, c_dtype=_c_dtype(out_dtype),
                                    implementation=implementation if fmt == "bf16" else None)
        return out.astype(out_dtype)
    if dispatch.mx_ragged_operands() == "bf16":
        w16, tw = _fake_quantized(w, fmt, 2 if w_major == "k" else 1)
        return _values_gemm(*_fake_quantized(a, fmt, 1), w16, tw, group_sizes, implementation, w_major=w_major,
                            out_dtype=out_dtype)
    b = w if w_major == "k" else jnp.swapaxes(w, 1, 2)
    qb, sb, tb = _quantize(autodiff._pad_axis(b, 1, 16), fmt, 2)  # C's rows: 16 bytes of any C dtype
    return _codes_gemm(*_quantize(a, fmt, 1), qb, sb, tb, group_sizes, fmt, implementation,
                       out_dtype=out_dtype)[:, :b.shape[1]]


def _c_dtype(out_dtype: np.dtype) -> Any:
    """The kernels write bf16 C when that is the result's dtype, else float32 (converted after)."""
    return jnp.bfloat16 if out_dtype == jnp.bfloat16 else jnp.float32


def _values_gemm(a16: jax.Array, ta: Optional[jax.Array], w16: jax.Array, tw: Optional[jax.Array],
                 group_sizes: jax.Array, implementation: Any, *, w_major: str, out_dtype: np.dtype) -> jax.Array:
    """a's quantized bf16 values a16 (blocks along C; ta: their NVFP4 tensor scale or None) times the weights' w16
    (laid out as `_ragged_gemm` says; tw likewise) on the bf16 grouped GEMM."""
    out, _ = ragged.grouped_dot(a16, w16, group_sizes, w_major=w_major,
                                c_dtype=_c_dtype(out_dtype) if ta is None else jnp.float32,
                                implementation=implementation)
    return (out if ta is None else out * (ta * tw)).astype(out_dtype)


def _codes_gemm(qa: jax.Array, sa: jax.Array, ta: Optional[jax.Array], qb: jax.Array, sb: jax.Array,
                tb: Optional[jax.Array], group_sizes: jax.Array, fmt: str, implementation: Any, *,
                out_dtype: np.dtype) -> jax.Array:
    """a's codes qa quantized along C in `fmt` with their scales sa (ta: the NVFP4 tensor scale or None), times the
    weights' codes qb (G, F, C), F a multiple of 16, with theirs (sb, tb) through `ragged_gemm_amax`: (T, F)
    out_dtype."""
    alpha = None if ta is None else ta * tb
    out, _ = api.ragged_gemm_amax(qa, qb, sa, sb, group_sizes, alpha=alpha, c_dtype=_c_dtype(out_dtype),
                                  sf_vec_size=formats.FORMATS[fmt].block, implementation=implementation)
    return out.astype(out_dtype)


def _quantizer_implementation(implementation: Any) -> Any:
    """What `quantize_pair` runs under a recipe's `implementation`: the reference under "xla", else its kernel where
    one applies (it is not one of the recipe's GEMMs, which "cutedsl" governs)."""
    return "xla" if implementation == "xla" else None


def _weight_pair(w: jax.Array, recipe: autodiff.Recipe) -> Optional[tuple[jax.Array, jax.Array, jax.Array]]:
    """The forward's bf16 values of w (blocks along K) and dgrad's codes and scales of it (blocks along N), from one
    pass over w (`quantize_pair`), where the recipe quantizes both GEMMs in MXFP8, the forward takes bf16 values and
    both contractions are whole blocks; else None (each GEMM quantizes w itself)."""
    if (dispatch.mx_ragged_operands() != "bf16" or recipe.fwd not in quantize_pair.FORMATS
            or recipe.dgrad not in quantize_pair.FORMATS or w.shape[1] % autodiff.K_MULTIPLE
            or w.shape[2] % autodiff.K_MULTIPLE):
        return None
    return quantize_pair.quantize_pair(w, row_format=recipe.fwd, col_format=recipe.dgrad,
                                       implementation=_quantizer_implementation(recipe.implementation))


def _padded_sizes(starts: jax.Array, ends: jax.Array) -> jax.Array:
    """Each group's size rounded up to a multiple of 32 rows."""
    return -(-(ends - starts) // _BLOCK_ROWS) * _BLOCK_ROWS


def _padded_rows(tokens: int, groups: int) -> int:
    """Rows of the group-padded layout: every group rounded up to whole blocks, and the rows of no group, fit."""
    return -(-(tokens + (_BLOCK_ROWS - 1) * groups) // _BLOCK_ROWS) * _BLOCK_ROWS


def _group_padding_map(starts: jax.Array, ends: jax.Array, tokens: int) -> jax.Array:
    """The group-padded layout as a row map ((`_padded_rows`,) int32, -1 for a padding row): each group's rows, from
    row 0, padded to `_padded_sizes`, then the rows of no group (past the last group). Every token row is named once,
    so `quantize_pair` through it writes every row's column blocks."""
    g = starts.shape[0]
    sizes, padded_sizes = ends - starts, _padded_sizes(starts, ends)
    p_ends = jnp.cumsum(padded_sizes)
    p_starts = p_ends - padded_sizes
    position = jnp.arange(_padded_rows(tokens, g), dtype=jnp.int32)
    group = jnp.searchsorted(p_ends, position, side="right")  # g: past the padded groups
    inside = jnp.minimum(group, g - 1)
    offset = position - p_starts[inside]
    of_group = jnp.where(offset < sizes[inside], starts[inside] + offset, -1)
    no_group = ends[-1] + position - p_ends[-1]  # the rows of no group, in order after the padded groups
    return jnp.where(group < g, of_group, jnp.where(no_group < tokens, no_group, -1)).astype(jnp.int32)


def _group_padded(x: jax.Array, starts: jax.Array, ends: jax.Array) -> jax.Array:
    """x's rows in the group-padded layout (`_group_padding_map`), zeros in the padding rows."""
    row_map = _group_padding_map(starts, ends, x.shape[0])
    return jnp.where((row_map >= 0)[:, None], x[jnp.maximum(row_map, 0)], 0)


def _fake_quantized(x: jax.Array, fmt: str, axis: int) -> tuple[jax.Array, Optional[jax.Array]]:
    """x quantized along `axis` in `fmt` and dequantized in place (no transposed copy), as exact bf16 values, and
    its NVFP4 tensor scale (which the values still need as a factor) or None."""
    if fmt == "nvfp4":
        encode, tensor_scale = formats.nvfp4_tensor_scales(x)
        values = formats.quantize_dequantize(x.astype(jnp.float32) * encode, fmt, axis=axis)
        return values.astype(jnp.bfloat16), tensor_scale
    return formats.quantize_dequantize(x, fmt, axis=axis).astype(jnp.bfloat16), None


def _token_values(x: jax.Array, fmt: str, implementation: Any) -> tuple[jax.Array, Optional[jax.Array]]:
    """x (rows, F) quantized along its rows (the tokens, in blocks of 32) in `fmt` and dequantized, as exact bf16
    values, and the NVFP4 tensor scale or None. MXFP8 goes through `quantize_pair`, whose kernel reads x once and
    writes the values 3-4x faster than XLA's pass (docs/design/moe.md); the codes along F it also writes are not
    used here."""
    if fmt not in quantize_pair.FORMATS:
        return _fake_quantized(x, fmt, 0)
    values, _, _ = quantize_pair.quantize_pair(x, row_format=fmt, col_format=fmt,
                                               implementation=_quantizer_implementation(implementation))
    return values, None


def _contract(xq: jax.Array, dyq: jax.Array, sizes: jax.Array, implementation: Any, dw_dtype: np.dtype,
              tensor_scale: Optional[jax.Array] = None) -> jax.Array:
    """dW (G, K, N) = per group xqᵀ · dyq over its rows (`sizes` of them, from row 0), through the grouped contraction
    (`contraction.contract_groups`: its kernel where one applies); in dw_dtype where that is bfloat16 and no tensor
    scale follows, else float32."""
    c_dtype = jnp.bfloat16 if dw_dtype == jnp.bfloat16 and tensor_scale is None else jnp.float32
    dw = contraction.contract_groups(xq, dyq, sizes, c_dtype=c_dtype, implementation=implementation)[0]
    return dw if tensor_scale is None else dw * tensor_scale


def _wgrad(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, fmt: str, implementation: Any,
           dw_dtype: np.dtype) -> jax.Array:
    """dW (G, K, N): per group x_gᵀ · dy_g, both quantized along the group's tokens (see the module)."""
    if fmt == "bf16":
        return _contract(x, dy, group_sizes, implementation, dw_dtype)
    starts, ends = ragged.group_bounds(group_sizes, x.shape[0])
    xq, tx = _token_values(_group_padded(x, starts, ends), fmt, implementation)
    dyq, td = _token_values(_group_padded(dy, starts, ends), fmt, implementation)
    return _contract(xq, dyq, _padded_sizes(starts, ends), implementation, dw_dtype,
                     None if tx is None else tx * td)


def _forward(x: jax.Array, w: jax.Array, group_sizes: jax.Array, out_dtype: np.dtype, recipe: autodiff.Recipe,
             pair: Optional[tuple[jax.Array, jax.Array, jax.Array]]
             ) -> tuple[jax.Array, Optional[tuple[jax.Array, jax.Array]]]:
    """out (T, N) = x (T, K) · w_g (K, N) for each group's rows in the recipe's forward format, and dgrad's codes and
    scales of w from `pair` (`_weight_pair`'s, else None). The pair serves the forward alone too: one pass of its
    kernel takes less time than XLA's quantization along K by itself (docs/design/moe.md)."""
    if pair is None:
        return _ragged_gemm(x, w, group_sizes, recipe.fwd, recipe.implementation, w_major="n",
                            out_dtype=out_dtype), None
    values, codes, scales = pair
    out = _values_gemm(*_fake_quantized(x, recipe.fwd, 1), values, None, group_sizes, recipe.implementation,
                       w_major="n", out_dtype=out_dtype)
    return out, (codes, scales)


def _tokens_in_one_pass(recipe: autodiff.Recipe, pair: Optional[tuple]) -> bool:
    """Whether a training step quantizes the tokens (x in the forward, dY in the backward) by one `quantize_pair`
    pass each through the group-padding map: where the weights took theirs (`pair`, `_weight_pair`'s: every
    contraction is whole blocks and the forward and dgrad formats are MXFP8) and wgrad's format is MXFP8 too."""
    return pair is not None and recipe.wgrad in quantize_pair.FORMATS


def _padding_map(group_sizes: jax.Array, tokens: int) -> tuple[jax.Array, jax.Array]:
    """The group-padding row map of the tokens and the padded groups' sizes (wgrad's contraction)."""
    starts, ends = ragged.group_bounds(group_sizes, tokens)
    return _group_padding_map(starts, ends, tokens), _padded_sizes(starts, ends)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ragged_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, out_dtype: np.dtype,
                   recipe: autodiff.Recipe) -> jax.Array:
    """out (T, N) = x (T, K) · w_g (K, N) for each group's rows, in the recipe's forward format."""
    return _forward(x, w, group_sizes, out_dtype, recipe, _weight_pair(w, recipe))[0]


def _ragged_matmul_fwd(x, w, group_sizes, out_dtype, recipe):
    """The forward, keeping for the backward x (or, where the tokens take one pass, wgrad's values of x along the
    padded groups' rows, from the same pass that gives the forward its values along K) and dgrad's codes of w."""
    pair = _weight_pair(w, recipe)
    if not _tokens_in_one_pass(recipe, pair):
        out, dgrad_codes = _forward(x, w, group_sizes, out_dtype, recipe, pair)
        return out, (x, None, w, group_sizes, dgrad_codes)
    values, codes, scales = pair
    row_map, _ = _padding_map(group_sizes, x.shape[0])
    x_rows, x16, _ = quantize_pair.quantize_pair(x, row_format=recipe.wgrad, col_format=recipe.fwd, row_map=row_map,
                                                 col_values=True,
                                                 implementation=_quantizer_implementation(recipe.implementation))
    out = _values_gemm(x16, None, values, None, group_sizes, recipe.implementation, w_major="n", out_dtype=out_dtype)
    x_like = jnp.zeros((0,), x.dtype)  # what dX's dtype is, without keeping x
    return out, (x_like, x_rows, w, group_sizes, (codes, scales))


def _ragged_matmul_bwd(out_dtype, recipe, residuals, dy):
    x, x_rows, w, group_sizes, dgrad_codes = residuals  # x: empty (its dtype only) where x_rows is kept
    x_dtype = np.dtype(x.dtype)
    if x_rows is not None:  # the tokens in one pass each: dY's codes along N for dgrad, its values along the rows
        row_map, padded_sizes = _padding_map(group_sizes, dy.shape[0])
        dy_rows, dy_codes, dy_scales = quantize_pair.quantize_pair(
            dy, row_format=recipe.wgrad, col_format=recipe.dgrad, row_map=row_map,
            implementation=_quantizer_implementation(recipe.implementation))
        dx = _codes_gemm(dy_codes, dy_scales, None, *dgrad_codes, None, group_sizes, recipe.dgrad,
                         recipe.implementation, out_dtype=x_dtype)
        dw = _contract(x_rows, dy_rows, padded_sizes, recipe.implementation, np.dtype(w.dtype))
        return dx.astype(x_dtype), dw.astype(w.dtype), np.zeros(group_sizes.shape, jax.dtypes.float0)
    if dgrad_codes is not None:  # w's codes along N from the forward's pass over it: (G, K, N) as dgrad reads them
        dx = _codes_gemm(*_quantize(dy, recipe.dgrad, 1), *dgrad_codes, None, group_sizes, recipe.dgrad,
                         recipe.implementation, out_dtype=x_dtype)
    else:
        # dgrad's w as a value of its own, so that XLA cannot fuse the forward's in-place quantization of w (blocks
        # along K) with dgrad's (blocks along N) into one kernel: at G = 256 on the H200 that kernel took 106 ms,
        # where both quantizations apart should take about 19 (docs/design/moe.md)
        w, dy = jax.lax.optimization_barrier((w, dy))
        dx = _ragged_gemm(dy, w, group_sizes, recipe.dgrad, recipe.implementation, w_major="k", out_dtype=x_dtype)
    dw = _wgrad(x, dy, group_sizes, recipe.wgrad, recipe.implementation, np.dtype(w.dtype))
    return dx.astype(x_dtype), dw.astype(w.dtype), np.zeros(group_sizes.shape, jax.dtypes.float0)


_ragged_matmul.defvjp(_ragged_matmul_fwd, _ragged_matmul_bwd)


def mx_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, precision: Any = None,
                  preferred_element_type: Any = None, *, recipe: autodiff.Recipe | str = "mxfp8") -> jax.Array:
    """Drop-in for `jax.lax.ragged_dot(lhs, rhs, group_sizes)` (lhs (T, K), rhs (G, K, N)) in block formats.

    Rows of group g (group g holds group_sizes[g] consecutive rows, from row 0) are multiplied by rhs[g]; rows past
    sum(group_sizes) come back zero. Operands are quantized by `recipe` (a Recipe or a name in RECIPES) and the
    forward runs through `ragged_gemm_amax`; differentiable with respect to lhs and rhs (see the module docstring
    for dgrad and wgrad). group_sizes follow ragged_gemm_amax's rules (concrete bad sizes raise). precision is
    accepted and ignored, as in mx_dot_general; the result has dtype preferred_element_type, else the operands'.
    """
    recipe = autodiff.as_recipe(recipe)
    lhs, rhs = support.as_array("lhs", lhs, "mx_ragged_dot"), support.as_array("rhs", rhs, "mx_ragged_dot")
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"mx_ragged_dot: {name} has dtype {support.dtype_name(x)}; allowed: a floating dtype.")
    support.check_rank("lhs", lhs, (2,), "(T, K) tokens sorted by group")
    support.check_rank("rhs", rhs, (3,), "(G, K, N): one weight per group")
    if lhs.shape[1] != rhs.shape[1] or min(*lhs.shape, *rhs.shape) < 1:
        raise ValueError(f"mx_ragged_dot: lhs (T, K) and rhs (G, K, N) must agree on K and be non-empty; got lhs "
                         f"{tuple(lhs.shape)}, rhs {tuple(rhs.shape)}.")
    group_sizes = ragged.check_group_sizes(group_sizes, groups=rhs.shape[0], tokens=lhs.shape[0])
    out_dtype = autodiff._out_dtype(lhs, rhs, preferred_element_type, "mx_ragged_dot")
    return _ragged_matmul(lhs, rhs, group_sizes, out_dtype, recipe)
