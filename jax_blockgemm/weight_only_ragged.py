"""Weight-only ragged matmul: the mixture-of-experts product for serving with quantized expert weights and bf16 (or
float32) activations, e.g. MXFP4 experts as gpt-oss ships them. y[t] = alpha[g]·x[t]·Ŵ[g]ᵀ for the rows t of group
g (tokens sorted by group), x used as given (never quantized), Ŵ[g] an MX-quantized expert weight.

It binds `ragged.ragged_p` with the tokens as values (`support.tokens_are_values`): the same primitive, batching,
partitioning rules and reference as ragged_gemm_amax. On an H200 bf16 tokens run the swap_ab kernel
(kernels/sm90/ragged_swap_ab.py), which converts only the weights' codes, in registers, and takes the tokens in bf16
as they come (permuted by XLA, `swap_ab_layout`): under "cutedsl", and under None for the formats arch.TABLE's
ragged_swap_ab_formats names; float32 tokens, every GPU without that kernel and the rest run the reference (each
expert dequantized to bf16, exact, then a grouped dot in x's dtype with float32 accumulation).

`matmul` adds the derivative with respect to x, dx[t] = alpha[g]·dy[t]·Ŵ[g], through the bf16 grouped GEMM
(`ragged.grouped_dot`, the experts dequantized to bf16 once); the quantized weights are constants (a gradient with
respect to them is refused at trace time).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal

from jax_blockgemm import formats, ragged, reference, support, weight_only

__all__ = ["check_call", "matmul"]


def check_call(x: Any, w: Any, group_sizes: Any, out_dtype: Any, implementation: Any) -> jax.Array:
    """Trace-time checks of a weight_only_ragged_matmul call; returns the group sizes as checked int32 (G,)."""
    support.check_implementation(implementation)
    g, n, k = weight_only.check_weight(w, experts=True)
    weight_only.check_dtypes(x, out_dtype)
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must be (T, K) tokens sorted by group with K={k}, the experts' (G, N, K) = {(g, n, k)}; "
                         f"got x of shape {tuple(x.shape)}. Use jax.vmap for a batch of token sets.")
    if x.shape[0] < 1:
        raise ValueError(f"x must hold at least one token (T >= 1); got x of shape {tuple(x.shape)}.")
    return ragged.check_group_sizes(group_sizes, groups=g, tokens=x.shape[0])


def _bind(x: jax.Array, w: weight_only.QuantizedWeight, group_sizes: jax.Array, out_dtype: np.dtype,
          implementation: Optional[str]) -> jax.Array:
    codes, scales, alpha = weight_only.canonical_weight(w)
    t, k = x.shape
    starts, ends = ragged.group_bounds(group_sizes, t)
    c, _ = ragged.ragged_p.bind(x[None], codes, jnp.zeros((1, t, 0), jnp.uint8), scales, starts[None], ends[None],
                                alpha, k=k, sf_vec_size=w.block_format.block, c_dtype=np.dtype(out_dtype),
                                implementation=implementation, b_major="k", amax_used=False)
    return c[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def matmul(x: jax.Array, w: weight_only.QuantizedWeight, group_sizes: jax.Array, out_dtype: np.dtype,
           implementation: Optional[str]) -> jax.Array:
    """y (T, N) on checked inputs (`check_call`): rows of no group (past sum(group_sizes)) are zero."""
    return _bind(x, w, group_sizes, out_dtype, implementation)


def _matmul_fwd(x, w, group_sizes, out_dtype, implementation):
    """Refuses a gradient with respect to the weight at trace time (its leaves arrive marked perturbed or not)."""
    is_primal = lambda leaf: isinstance(leaf, CustomVJPPrimal)
    if any(leaf.perturbed for leaf in jax.tree.leaves(w, is_leaf=is_primal)):
        raise weight_only.constant_weight_error("weight_only_ragged_matmul")
    x, w, group_sizes = jax.tree.map(lambda leaf: leaf.value, (x, w, group_sizes), is_leaf=is_primal)
    # x's dtype travels as an empty array of it (residuals are arrays)
    return _bind(x, w, group_sizes, out_dtype, implementation), (jnp.zeros((0,), x.dtype), w, group_sizes)


def _matmul_bwd(out_dtype, implementation, residuals, dy):
    """dx = alpha[g]·dy·Ŵ[g] per group (Ŵ without alpha, exact in bf16): the bf16 grouped GEMM for bf16 tokens,
    the float32 reference's grouped dot for float32 ones (never TF32); zero on rows of no group."""
    x_like, w, group_sizes = residuals
    x_dtype = x_like.dtype
    g, _, k = w.shape
    codes, scales, alpha = weight_only.canonical_weight(w)
    w_hat = reference.dequantize_bf16(formats.unpacked_codes(codes[0], k), scales[0], block=w.block_format.block,
                                      axis=2)
    t = dy.shape[0]
    starts, ends = ragged.group_bounds(group_sizes, t)
    if np.dtype(x_dtype) == np.dtype(jnp.bfloat16):
        dx, _ = ragged.grouped_dot(dy.astype(jnp.bfloat16), w_hat, group_sizes, w_major="n",
                                   implementation=implementation)
    else:  # (T, N) · (G, N, K): the reference's grouped dot of dy against each expert read as (K, N)
        dx = ragged.grouped_rows_dot(dy.astype(jnp.float32), jnp.swapaxes(w_hat, 1, 2).astype(jnp.float32),
                                     starts, ends)
    factors = ragged.row_factors(jnp.broadcast_to(alpha[0], (g,)), starts, ends, t)
    return (dx * factors[:, None]).astype(x_dtype), None, None


matmul.defvjp(_matmul_fwd, _matmul_bwd, symbolic_zeros=True)
