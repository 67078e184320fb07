"""Both MX quantizations of a weight in one pass, as a training step needs them: `quantize_pair(w)` gives w's values
quantized with its blocks along R (the forward's contraction) and its codes and scales quantized along C (dgrad's).

mx_ragged_dot's MX recipes call it on the (G, K, N) expert weights where their GEMMs take bf16 values (sm_90a,
`arch.TABLE`'s `mx_ragged_operands`): apart, XLA's two quantizations read the weights four times and take twice
the time of one pass (docs/design/moe.md). `quantize_pair_p` binds it (batching, and a lowering through the
partitioning rules of `sharding.py`); `quantize_pair_local_p` is what one device runs: on CUDA the kernel
(kernels/quantize_pair.py, through the jbg_quantize_pair handler) where `dispatch.quantize_pair_kernels` names one,
else, and on every other platform, the reference: `formats.quantize_dequantize` and `formats.quantize_mxfp8`, which
the kernel matches bit for bit.

Canonical operand: w (B, R, C) bfloat16 or float32. Params: row_format and col_format (FORMATS: the MXFP8 formats of
the two quantizations, E8M0 scales per 32), implementation. Results: values (B, R, C) bfloat16, codes (B, R, C) in
col_format's code dtype, scales (B, R, ceil(C/32)) uint8.
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
                  implementation: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(values, codes, scales) of w (..., R, C), bfloat16 or float32.

    values: bfloat16 code·scale of w quantized in `row_format` with its blocks along R (axis -2), exact
    (`formats.quantize_dequantize`); codes and scales: w quantized in `col_format` along C (axis -1), as
    `formats.quantize_mxfp8` gives them ((..., R, C) codes, (..., R, ceil(C/32)) uint8 E8M0 bytes). Both formats are
    MXFP8 (FORMATS). implementation: None (the kernel where one applies: bf16 w, R and C multiples of 32, the "ceil"
    scale rule), "cutedsl" (the kernel or an error), "xla" (the reference).
    """
    support.check_implementation(implementation)
    support.check_choice("row_format", row_format, FORMATS)
    support.check_choice("col_format", col_format, FORMATS)
    w = jnp.asarray(w)
    if np.dtype(w.dtype) not in _DTYPES:
        raise TypeError(f"quantize_pair: w has dtype {support.dtype_name(w)}; allowed: bfloat16, float32.")
    if w.ndim < 2 or min(w.shape) < 1:
        raise ValueError(f"quantize_pair: w must be (..., R, C) with every dimension >= 1; got {tuple(w.shape)}.")
    lead = w.shape[:-2]
    values, codes, scales = quantize_pair_p.bind(w.reshape(math.prod(lead), *w.shape[-2:]), row_format=row_format,
                                                 col_format=col_format, implementation=implementation)
    return tuple(x.reshape(*lead, *x.shape[1:]) for x in (values, codes, scales))


def _reference(w, *, row_format: str, col_format: str, **_: Any) -> list:
    """The two quantizations as formats.py defines them (blocks split in place: no transposed copy of w)."""
    values = formats.quantize_dequantize(w, row_format, axis=1).astype(jnp.bfloat16)
    # the second quantization reads w through a barrier: XLA fused the two into one kernel that took 106 ms on the
    # H200 at (256, 7168, 2048), where apart they take about 19 (docs/design/moe.md)
    codes, scales = formats.quantize_mxfp8(jax.lax.optimization_barrier(w), axis=2,
                                           dtype=formats.FORMATS[col_format].code_dtype)
    return [values, codes, scales]


def _abstract_eval(w, *, col_format: str, **_):
    b, r, c = w.shape
    return (jax.core.ShapedArray((b, r, c), np.dtype(jnp.bfloat16)),
            jax.core.ShapedArray((b, r, c), np.dtype(formats.FORMATS[col_format].code_dtype)),
            jax.core.ShapedArray((b, r, formats.num_blocks(c, MX_BLOCK)), np.dtype(np.uint8)))


def _reference_lowering(ctx, *args, **params):
    primitives.no_kernel_off_cuda(ctx, "quantize_pair", params["implementation"])
    return mlir.lower_fun(functools.partial(_reference, **params), multiple_results=True)(ctx, *args)


def _cuda_lowering(ctx, w, **params):
    """The GPU hook: the kernel where one applies (`dispatch.quantize_pair_kernels`), else the reference."""
    from jax_blockgemm import dispatch, ffi_lowering  # lazy, as in primitives.py

    choice = dispatch.quantize_pair_kernels(ctx.avals_in, **params)
    if choice.variants:
        return ffi_lowering.emit_quantize_pair(ctx, w, variants=choice.variants)
    primitives.no_kernel_applies("quantize_pair", params["implementation"],
                                 f"{choice.reason}; use implementation=None or 'xla'.")
    return _reference_lowering(ctx, w, **params)


def _batch_rule(args, dims, **params):
    """vmap folds the mapped axis into B."""
    (w,), (d,) = args, dims
    w = jnp.moveaxis(w, d, 0)
    outs = quantize_pair_p.bind(w.reshape(-1, *w.shape[2:]), **params)
    return tuple(x.reshape(w.shape[0], -1, *x.shape[1:]) for x in outs), (0, 0, 0)


primitives.register(quantize_pair_p, quantize_pair_local_p, abstract_eval=_abstract_eval,
                    reference_lowering=_reference_lowering, cuda_lowering=_cuda_lowering, batch_rule=_batch_rule,
                    partitioned=sharding.quantize_pair_partitioned)
