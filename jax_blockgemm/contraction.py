"""The per-group contraction over tokens, the weight gradient of a ragged (mixture-of-experts) product:
c[g] = x[rows of g]ᵀ · y[rows of g] for tokens sorted by group, in bf16 with float32 accumulation.

`contract_groups` binds `contraction_p` (batching, and a lowering through the partitioning rules of `sharding.py`);
`contraction_local_p` is what one device runs. On CUDA it lowers to the grouped contraction kernel where
`dispatch.contraction_kernels` names one (kernels/sm90/contraction.py, through the jbg_grouped_contraction handler),
else, and on every other platform, to the reference's chunked tile loop (`ragged.grouped_contraction`).

Canonical operands: x (L, T, K) and y (L, T, N) bf16, starts and ends (L, G) int32 (`ragged.group_bounds`). Params:
c_dtype (np.dtype: float32 or bfloat16), implementation. Results: c (L, G, K, N) and amax (L,) float32, the max of
|c| before its conversion (NaN when a group's rows hold one).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import mlir

from jax_blockgemm import formats, primitives, ragged, reference, sharding, support

__all__ = ["contraction_p", "contraction_local_p", "contract_groups", "C_DTYPES"]

contraction_p = jex_core.Primitive("jbg_grouped_contraction")
contraction_local_p = jex_core.Primitive("jbg_grouped_contraction_local")
C_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))


def contract_groups(x: jax.Array, y: jax.Array, group_sizes: jax.Array, *, c_dtype: Any = jnp.float32,
                    implementation: Any = None) -> tuple[jax.Array, jax.Array]:
    """(c, amax): c[g] = x[rows of g]ᵀ · y[rows of g] (G, K, N) in c_dtype (float32 or bfloat16), 0 for an empty
    group, and max|c| as float32. x (T, K) and y (T, N) are taken as bf16 (float32 accumulation); group g holds
    group_sizes[g] consecutive rows from row 0 (int32 (G,), checked by the caller; traced sizes as
    `ragged.group_bounds` defines them). implementation: None (the kernel where one applies), "cutedsl" (the
    kernel or an error), "xla" (the reference)."""
    support.check_implementation(implementation)
    if np.dtype(c_dtype) not in C_DTYPES:
        raise TypeError(f"c_dtype {np.dtype(c_dtype)} is not supported; allowed: float32, bfloat16.")
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x (T, K) and y (T, N) must be 2-D with one T; got x {tuple(x.shape)}, y {tuple(y.shape)}.")
    starts, ends = ragged.group_bounds(group_sizes, x.shape[0])
    c, amax = contraction_p.bind(x.astype(jnp.bfloat16)[None], y.astype(jnp.bfloat16)[None], starts[None],
                                 ends[None], c_dtype=np.dtype(c_dtype), implementation=implementation)
    return c[0], amax[0]


def _reference(x, y, starts, ends, *, c_dtype: Any, **_: Any) -> tuple[jax.Array, jax.Array]:
    """The canonical call through the reference's chunked loop, float32 sums, then amax and the conversion."""

    def one(x, y, starts, ends):
        acc = ragged.grouped_contraction(x, y, starts, ends)
        return reference.convert_c(acc, c_dtype), formats.magnitude_max(acc, axis=None)

    return jax.vmap(one)(x, y, starts, ends)


def _abstract_eval(x, y, starts, ends, *, c_dtype, **_):
    l, _, k = x.shape
    return (jax.core.ShapedArray((l, starts.shape[1], k, y.shape[2]), np.dtype(c_dtype)),
            jax.core.ShapedArray((l,), np.float32))


def _reference_lowering(ctx, *args, **params):
    primitives.no_kernel_off_cuda(ctx, "the grouped contraction", params["implementation"])
    return mlir.lower_fun(functools.partial(_reference, **params), multiple_results=True)(ctx, *args)


def _kernel_lowering(ctx, x, y, starts, ends, *, variants, **_):
    """The call through the kernel `variants` (jbg_grouped_contraction): the bounds as one (L, G, 2) table."""
    from jax_blockgemm import ffi_lowering

    x_aval, y_aval, starts_aval, _ = ctx.avals_in
    bounds_aval = jax.core.ShapedArray((*starts_aval.shape, 2), np.dtype(np.int32))
    stack = lambda s, e: jnp.stack([s, e], axis=-1).astype(jnp.int32)
    (bounds,) = mlir.lower_fun(lambda s, e: [stack(s, e)], multiple_results=True)(
        ctx.replace(avals_in=list(ctx.avals_in[2:]), avals_out=[bounds_aval]), starts, ends)
    return ffi_lowering.emit_contraction(ctx.replace(avals_in=[x_aval, y_aval, bounds_aval]), x, y, bounds,
                                         variants=variants)


primitives.register(contraction_p, contraction_local_p, abstract_eval=_abstract_eval,
                    reference_lowering=_reference_lowering,
                    cuda_lowering=primitives.kernel_or_reference("grouped contraction", "contraction_kernels",
                                                                 _kernel_lowering, _reference_lowering),
                    batch_rule=primitives.fold_into_l_batch_rule(contraction_p),
                    partitioned=sharding.CONTRACTION.partitioned)
