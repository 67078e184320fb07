"""Both MX quantizations of a weight in one pass, as a training step needs them: `quantize_pair(w)` gives w's values
quantized with its blocks along R (the forward's contraction) and its codes and scales quantized along C (dgrad's).

mx_ragged_dot's MX recipes call it on the (G, K, N) expert weights where their GEMMs take bf16 values (sm_90a,
`arch.TABLE`'s `mx_ragged_operands`): apart, XLA's two quantizations read the weights four times and take twice
the time of one pass (docs/design/moe.md). With a row map it serves the tokens too: wgrad quantizes them along
each group's rows, padded to whole blocks of 32 (the map's rows), and the forward and dgrad along their features
(the column blocks, of the tokens' own rows), all from one read of them.

`quantize_pair_p` binds it (batching, and a lowering through the partitioning rules of `sharding.py`);
`quantize_pair_local_p` is what one device runs: on CUDA the kernel (kernels/quantize_pair.py, through the
jbg_quantize_pair handler) where `dispatch.quantize_pair_kernels` names one, else, and on every other platform, the
reference: `formats.quantize_dequantize` and `formats.quantize_mxfp8`, which the kernel matches bit for bit.

Canonical operands: w (B, R, C) bfloat16 or float32, and with a row map w (1, R, C) and row_map (1, R') int32.
Params: row_format and col_format (FORMATS: the MXFP8 formats of the two quantizations, E8M0 scales per 32),
col_values, implementation. Results: values (B, R, C) bfloat16 (with a map (1, R', C)), codes (B, R, C) in
col_format's code dtype (bfloat16 values with col_values), scales (B, R, ceil(C/32)) uint8.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import mlir

from jax_blockgemm import formats, primitives, sharding, support
from jax_blockgemm.support import MX_BLOCK

__all__ = ["quantize_pair", "quantize_pair_p", "quantize_pair_local_p", "FORMATS"]

quantize_pair_p = jex_core.Primitive("jbg_quantize_pair")
quantize_pair_local_p = jex_core.Primitive("jbg_quantize_pair_local")
FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2")  # the formats either quantization may take
_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float32))


def quantize_pair(w: jax.Array, *, row_format: str = "mxfp8_e4m3", col_format: str = "mxfp8_e4m3",
                  row_map: jax.Array | None = None, col_values: bool = False,
                  implementation: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(values, codes, scales) of w (..., R, C), bfloat16 or float32.

    values: bfloat16 code·scale of w quantized in `row_format` with its blocks along R (axis -2), exact
    (`formats.quantize_dequantize`); codes and scales: w quantized in `col_format` along C (axis -1), as
    `formats.quantize_mxfp8` gives them ((..., R, C) codes, (..., R, ceil(C/32)) uint8 E8M0 bytes). Both formats are
    MXFP8 (FORMATS). col_values: the codes come back as their bfloat16 values code·scale instead (the scales too).

    row_map (..., R') int32: the values are those of the matrix whose row i is w's row row_map[i] (zeros where the
    entry is negative or not below R): (..., R', C), blocks of 32 along its rows, e.g. groups of rows each padded to
    whole blocks. The column blocks stay w's own, and the kernel writes them through the map: it must name each of
    w's rows (once, or more often with the same result); a row it does not name is left as the kernel found it
    (the reference computes every row).

    implementation: None (the kernel where one applies: bf16 w, C and R (with a map R') multiples of 32, the "ceil"
    scale rule; col_values only with a map), "cutedsl" (the kernel or an error), "xla" (the reference).
    """
    support.check_implementation(implementation)
    support.check_choice("row_format", row_format, FORMATS)
    support.check_choice("col_format", col_format, FORMATS)
    w = jnp.asarray(w)
    if np.dtype(w.dtype) not in _DTYPES:
        raise TypeError(f"quantize_pair: w has dtype {support.dtype_name(w)}; allowed: bfloat16, float32.")
    if w.ndim < 2 or min(w.shape) < 1:
        raise ValueError(f"quantize_pair: w must be (..., R, C) with every dimension >= 1; got {tuple(w.shape)}.")
    params = dict(row_format=row_format, col_format=col_format, col_values=bool(col_values),
                  implementation=implementation)
    lead, (r, c) = w.shape[:-2], w.shape[-2:]
    if row_map is None:
        outs = quantize_pair_p.bind(w.reshape(math.prod(lead), r, c), **params)
        return tuple(x.reshape(*lead, *x.shape[1:]) for x in outs)
    if np.dtype(row_map.dtype if hasattr(row_map, "dtype") else np.asarray(row_map).dtype) != np.int32:
        raise TypeError(f"quantize_pair: row_map has dtype {support.dtype_name(row_map)}; allowed: int32.")
    row_map = jnp.asarray(row_map)
    if row_map.shape[:-1] != lead or row_map.ndim < 1 or row_map.shape[-1] < 1:
        raise ValueError(f"quantize_pair: row_map must be (..., R') with w's leading dimensions {lead} and R' >= 1; "
                         f"got {tuple(row_map.shape)} for w {tuple(w.shape)}.")
    values, codes, scales = _bind_mapped(w.reshape(-1, r, c), row_map.reshape(-1, row_map.shape[-1]), **params)
    return (values.reshape(*lead, *values.shape[1:]), codes.reshape(*lead, r, c),
            scales.reshape(*lead, *scales.shape[1:]))


def _bind_mapped(w: jax.Array, row_map: jax.Array, **params) -> tuple[jax.Array, jax.Array, jax.Array]:
    """quantize_pair of w (B, R, C) through row_map (B, R'), each batch's entries naming its own rows, as one
    canonical (1, B·R, C) call: results (B, R', C), (B, R, C), (B, R, C/32)."""
    b, r, c = w.shape
    inside = (row_map >= 0) & (row_map < r)
    flat_map = jnp.where(inside, row_map + r * jnp.arange(b, dtype=jnp.int32)[:, None], -1)
    values, codes, scales = quantize_pair_p.bind(w.reshape(1, b * r, c), flat_map.reshape(1, -1), **params)
    return values.reshape(b, -1, c), codes.reshape(b, r, c), scales.reshape(b, r, -1)


def _gathered(w: jax.Array, row_map: jax.Array) -> jax.Array:
    """The rows row_map names of w (R, C), zeros where it names none: (R', C)."""
    inside = (row_map >= 0) & (row_map < w.shape[0])
    return jnp.where(inside[:, None], w[jnp.clip(row_map, 0, w.shape[0] - 1)], 0).astype(w.dtype)


def _reference(w, *row_map, row_format: str, col_format: str, col_values: bool, **_: Any) -> list:
    """The two quantizations as formats.py defines them (blocks split in place: no transposed copy of w)."""
    rows = w if not row_map else _gathered(w[0], row_map[0][0])[None]
    values = formats.quantize_dequantize(rows, row_format, axis=1).astype(jnp.bfloat16)
    # the second quantization reads w through a barrier: XLA fused the two into one kernel that took 106 ms on the
    # H200 at (256, 7168, 2048), where apart they take about 19 (docs/design/moe.md)
    w = jax.lax.optimization_barrier(w)
    codes, scales = formats.quantize_mxfp8(w, axis=2, dtype=formats.FORMATS[col_format].code_dtype)
    if col_values:
        codes = formats.quantize_dequantize(w, col_format, axis=2).astype(jnp.bfloat16)
    return [values, codes, scales]


def _abstract_eval(w, *row_map, col_format: str, col_values: bool, **_):
    b, r, c = w.shape
    if row_map and (w.shape[0] != 1 or row_map[0].shape[0] != 1 or row_map[0].ndim != 2):
        raise ValueError(f"quantize_pair_p with a row map takes w (1, R, C) and row_map (1, R'); got {w.shape} and "
                         f"{row_map[0].shape}")
    rows = row_map[0].shape[1] if row_map else r
    col_dtype = jnp.bfloat16 if col_values else formats.FORMATS[col_format].code_dtype
    return (jax.core.ShapedArray((b, rows, c), np.dtype(jnp.bfloat16)),
            jax.core.ShapedArray((b, r, c), np.dtype(col_dtype)),
            jax.core.ShapedArray((b, r, formats.num_blocks(c, MX_BLOCK)), np.dtype(np.uint8)))


def _reference_lowering(ctx, *args, **params):
    primitives.no_kernel_off_cuda(ctx, "quantize_pair", params["implementation"])
    return mlir.lower_fun(functools.partial(_reference, **params), multiple_results=True)(ctx, *args)


def _kernel_lowering(ctx, *args, variants, **_):
    """The pair kernel dispatch names for this call."""
    from jax_blockgemm import ffi_lowering  # lazy, as in primitives.py

    return ffi_lowering.emit_quantize_pair(ctx, *args, variants=variants)


def _batch_rule(args, dims, **params):
    """vmap folds the mapped axis into B (with a row map: into the rows, the map's entries offset per batch)."""
    if len(args) == 1:
        (w,), (d,) = args, dims
        w = jnp.moveaxis(w, d, 0)
        outs = quantize_pair_p.bind(w.reshape(-1, *w.shape[2:]), **params)
        return tuple(x.reshape(w.shape[0], -1, *x.shape[1:]) for x in outs), (0, 0, 0)
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    w, row_map = (primitives.move_to_front(x, d, size)[:, 0] for x, d in zip(args, dims))  # the canonical B is 1
    outs = _bind_mapped(w, row_map, **params)
    return tuple(x[:, None] for x in outs), (0, 0, 0)


primitives.register(quantize_pair_p, quantize_pair_local_p, abstract_eval=_abstract_eval,
                    reference_lowering=_reference_lowering, batch_rule=_batch_rule,
                    cuda_lowering=primitives.kernel_or_reference("quantize_pair", "quantize_pair_kernels",
                                                                 _kernel_lowering, _reference_lowering),
                    partitioned=sharding.QUANTIZE_PAIR.partitioned)
