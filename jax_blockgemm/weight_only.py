"""Weight-only quantized matmul (SPEC §5b): y = x · Ŵᵀ with x in bf16 or float32 as given and Ŵ an MX-quantized
weight, the serving case (e.g. MXFP4 weights and bf16 activations).

`QuantizedWeight` is the weight as one pytree value (codes, scales, alpha, with the format as static metadata), made
once by `quantize_weight` and stored like any other array tree. The operation is two primitives, like the others in
`primitives.py`: `weight_only_p` (what the API binds: batching, and a lowering through the partitioning rules of
`sharding.py`) and `weight_only_local_p` (what one device runs). The local one lowers to the pure-JAX reference on
every platform: Ŵ dequantized to bf16 (exact, SPEC §6) and one dot with x in its own dtype, fp32 accumulation. On
CUDA it first asks `dispatch.weight_only_kernels` for the decode kernel (`jbg_weight_stream`, which streams the
codes and compact scales once per call) and emits it where one applies: bf16 x with few rows (`arch.TABLE`'s
`decode_max_m` says how many under implementation=None); float32 x always keeps the reference, whose dot runs in
float32. `matmul` adds the derivative with respect to x (dx = dy · Ŵ, times alpha); the weight is a constant.

Canonical operands (what the API binds): x (L, M, K) bf16 or float32; codes (L, N, K) float8 or packed FP4 uint8
(L, N, K/2); scales (L, N, ceil(K / block)) uint8 E8M0 bytes or float8_e4m3fn (NVFP4); alpha (L,) float32.
Params: fmt (a `formats.FORMATS` name), out_dtype (np.dtype), implementation. Result: y (L, M, N) in out_dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.extend import core as jex_core
from jax.interpreters import mlir

from jax_blockgemm import formats, primitives, reference, sharding, support

__all__ = ["QuantizedWeight", "quantize_weight", "matmul", "check_call", "weight_only_reference", "WEIGHT_FORMATS",
           "X_DTYPES", "OUT_DTYPES", "weight_only_p", "weight_only_local_p"]

WEIGHT_FORMATS = tuple(formats.FORMATS)  # "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4"
X_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float32))
OUT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float32))

weight_only_p = jex_core.Primitive("jbg_weight_only_matmul")
weight_only_local_p = jex_core.Primitive("jbg_weight_only_matmul_local")


def _check_format(name: str, fmt: Any) -> formats.BlockFormat:
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"{name}={fmt!r} is not supported; allowed: {', '.join(map(repr, WEIGHT_FORMATS))}.")
    return formats.FORMATS[fmt]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["codes", "scales", "alpha"],
                   meta_fields=["format"])
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """An MX-quantized (N, K) weight matrix, blocks along K: one pytree value, quantized once and then stored.

    codes: (N, K) float8_e4m3fn / float8_e5m2 (MXFP8), or uint8 (N, K/2) holding two E2M1 codes per byte, low nibble
      first (MXFP4, NVFP4); float4_e2m1fn (N, K) codes are accepted too and packed when used.
    scales: (N, ceil(K / block)) block scales: uint8 (or float8_e8m0fnu) E8M0 bytes per 32 (MX formats), or
      float8_e4m3fn per 16 (NVFP4).
    alpha: float32 scalar multiplying every product: NVFP4's per-tensor scale, 1 for the MX formats.
    format: "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4" or "nvfp4"; static pytree metadata, so jit specializes on it.

    Its leaves are plain arrays: jax.tree_util.tree_flatten / tree_unflatten round-trip it, `to_numpy` / `from_numpy`
    store it with np.savez / np.load (FP8 leaves as their bytes), and a leading axis added by jax.vmap or stacked for
    jax.lax.scan stacks whole weights.
    """

    codes: Any
    scales: Any
    alpha: Any
    format: str

    def __post_init__(self) -> None:
        _check_format("QuantizedWeight.format", self.format)

    @property
    def block_format(self) -> formats.BlockFormat:
        """The format's element codes, scale kind and block length (`formats.FORMATS[format]`)."""
        return formats.FORMATS[self.format]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (..., N, K) shape of the weight (K counts codes, not packed bytes)."""
        packed = np.dtype(self.codes.dtype) == np.dtype(jnp.uint8)
        return (*self.codes.shape[:-1], self.codes.shape[-1] * (2 if packed else 1))

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads for the weight: codes plus scales (what bounds a decode step)."""
        return int(self.codes.size * np.dtype(self.codes.dtype).itemsize
                   + self.scales.size * np.dtype(self.scales.dtype).itemsize)

    def to_numpy(self) -> dict[str, np.ndarray]:
        """The weight as NumPy arrays np.savez can store without pickling: codes and scales as their bytes (uint8;
        FP4 codes packed), alpha as float32, the format as a string. `from_numpy` reads it back."""
        codes = formats.pack_fp4(self.codes) if np.dtype(self.codes.dtype) == np.dtype(formats.E2M1) else self.codes
        as_bytes = lambda a: np.asarray(a).view(np.uint8)
        return {"codes": as_bytes(codes), "scales": as_bytes(self.scales),
                "alpha": np.asarray(self.alpha, np.float32), "format": np.asarray(self.format)}

    @classmethod
    def from_numpy(cls, arrays: Any) -> "QuantizedWeight":
        """The QuantizedWeight of a `to_numpy` dict (or the NpzFile np.load returns for it), as JAX arrays."""
        fmt = str(arrays["format"])
        block_format = _check_format("format", fmt)
        code_dtype = np.uint8 if block_format.is_fp4 else block_format.code_dtype
        codes = np.asarray(arrays["codes"]).view(code_dtype)
        scales = np.asarray(arrays["scales"]).view(block_format.scale_dtype)
        return cls(jnp.asarray(codes), jnp.asarray(scales), jnp.asarray(arrays["alpha"], jnp.float32), fmt)

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        """The weight's values Ŵ = code × block scale × alpha, (N, K) in `dtype` (for checks and comparisons)."""
        codes = formats.unpacked_codes(self.codes, self.shape[-1])
        w = formats.dequantize(codes, self.scales, block=self.block_format.block, axis=-1)
        return (w * jnp.asarray(self.alpha, jnp.float32)[..., None, None]).astype(dtype)


def quantize_weight(w: jax.Array, format: str = "mxfp8_e4m3") -> QuantizedWeight:
    """Quantizes an (N, K) weight (rows = output features, K the contraction) along K by SPEC §2's rule.

    MXFP8 / MXFP4: E8M0 scales per 32, alpha = 1. NVFP4: the weight is first multiplied by its per-tensor factor
    encode = 6 · 448 / amax, so that the E4M3 block scales (per 16) cover it, and alpha = 1 / encode is kept
    (`formats.nvfp4_tensor_scales`; both 1 where amax is 0 or not finite). FP4 codes come back packed (uint8
    (N, K/2)), so K must be even there. A block holding a NaN or an inf gets a NaN scale (SPEC §2). Traceable: jit
    it, or vmap it over stacked weights.
    """
    block_format = _check_format("format", format)
    w = jnp.asarray(w)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"quantize_weight: w has dtype {support.dtype_name(w)}; allowed: a floating dtype.")
    if w.ndim != 2 or min(w.shape) < 1:
        raise ValueError(f"quantize_weight: w must be an (N, K) matrix (rows = output features); got shape "
                         f"{tuple(w.shape)}. Use jax.vmap to quantize stacked weights.")
    if block_format.is_fp4 and w.shape[1] % 2:
        raise ValueError(f"quantize_weight: format={format!r} packs two E2M1 codes per byte along K, which must be "
                         f"even; got K={w.shape[1]}.")
    alpha = jnp.ones((), jnp.float32)
    if format == "nvfp4":
        encode, alpha = formats.nvfp4_tensor_scales(w)
        codes, scales = formats.quantize_nvfp4(w.astype(jnp.float32) * encode, axis=-1)
    elif format == "mxfp4":
        codes, scales = formats.quantize_mxfp4(w, axis=-1)
    else:
        codes, scales = formats.quantize_mxfp8(w, axis=-1, dtype=block_format.code_dtype)
    return QuantizedWeight(codes, scales, alpha, format)


# --------------------------------------------------------------------------------------------------------------
# Validation (trace time) and the canonical form
# --------------------------------------------------------------------------------------------------------------


def check_weight(w: Any, *, experts: bool = False) -> tuple[int, ...]:
    """Checks a QuantizedWeight's leaves against its format; returns its (N, K), or with `experts` the (G, N, K) of a
    stack of G expert weights (codes (G, N, K), scales (G, N, KB), alpha a scalar or one per expert)."""
    if not isinstance(w, QuantizedWeight):
        raise TypeError(f"w must be a jax_blockgemm.QuantizedWeight (from jbg.quantize_weight); got "
                        f"{type(w).__name__}.")
    fmt = w.block_format
    codes, scales, alpha = w.codes, w.scales, w.alpha
    support.check_array("w.codes", codes)
    support.check_array("w.scales", scales)
    allowed_codes = (np.dtype(jnp.uint8), np.dtype(formats.E2M1)) if fmt.is_fp4 else (fmt.code_dtype,)
    if np.dtype(codes.dtype) not in allowed_codes:
        raise TypeError(f"w.codes has dtype {support.dtype_name(codes)}; format {w.format!r} takes "
                        f"{' or '.join(map(str, allowed_codes))}.")
    packed = ' (K/2 packed bytes)' if fmt.is_fp4 else ''
    if experts and codes.ndim != 3:
        raise ValueError(f"w.codes must be a (G, N, K){packed} stack of expert weights; got shape "
                         f"{tuple(codes.shape)}. Quantize each expert with jax.vmap(jbg.quantize_weight).")
    if not experts and codes.ndim != 2:
        raise ValueError(f"w.codes must be an (N, K) matrix{packed}; got shape {tuple(codes.shape)}. Use jax.vmap "
                         f"(or jax.lax.scan) over stacked weights.")
    *lead, n, k = w.shape
    if min(w.shape) < 1:
        raise ValueError(f"w must be non-empty: {'G, N and K' if experts else 'N and K'} must be at least 1; got "
                         f"{'(G, N, K)' if experts else '(N, K)'} = {tuple(w.shape)}.")
    allowed_scales = (np.dtype(jnp.uint8), np.dtype(formats.E8M0)) if fmt.scale_kind == "e8m0" else (
        np.dtype(formats.E4M3),)
    if np.dtype(scales.dtype) not in allowed_scales:
        raise TypeError(f"w.scales has dtype {support.dtype_name(scales)}; format {w.format!r} takes "
                        f"{' or '.join(map(str, allowed_scales))}.")
    want = (*lead, n, support.ceil_div(k, fmt.block))
    if tuple(scales.shape) != want:
        raise ValueError(f"w.scales has shape {tuple(scales.shape)}; for an {'(G, N, K)' if experts else '(N, K)'} = "
                         f"{tuple(w.shape)} weight in format {w.format!r} (blocks of {fmt.block} along K) it must be "
                         f"{want}.")
    alphas = ((), tuple(lead)) if experts else ((),)
    if tuple(jnp.shape(alpha)) not in alphas or np.dtype(jnp.result_type(alpha)) != np.dtype(jnp.float32):
        raise ValueError(f"w.alpha must be a float32 scalar{f' or one per expert, {tuple(lead)}' if experts else ''}"
                         f"; got {support.dtype_name(jnp.asarray(alpha))}{tuple(jnp.shape(alpha))}.")
    return (*lead, n, k)


def check_dtypes(x: Any, out_dtype: Any) -> None:
    """x in bfloat16 or float32 (used as given) and out_dtype bfloat16 or float32, else TypeError."""
    if np.dtype(x.dtype) not in X_DTYPES:
        raise TypeError(f"x has dtype {support.dtype_name(x)}; allowed: bfloat16, float32 (x is used as given, "
                        "not quantized).")
    try:
        out = np.dtype(out_dtype)
    except TypeError:
        out = None
    if out not in OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype!r} is not supported; allowed: bfloat16, float32.")


def check_call(x: Any, w: Any, out_dtype: Any, implementation: Any) -> tuple[int, int]:
    """Trace-time checks of a weight_only_matmul call (SPEC §5b); returns the weight's (N, K)."""
    support.check_implementation(implementation)
    n, k = check_weight(w)
    check_dtypes(x, out_dtype)
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x must have shape (..., K) with K={k}, the weight's (N, K) = {(n, k)}; got x of shape "
                         f"{tuple(x.shape)}.")
    return n, k


def canonical_weight(w: QuantizedWeight) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(codes (1, ..., N, K or K/2), scales (1, ..., N, KB) as bytes or E4M3, alpha (1, ...)): a checked weight (or
    stack of expert weights) with a batch axis of one in front, FP4 packed, E8M0 as uint8."""
    codes, scales = w.codes, w.scales
    if np.dtype(codes.dtype) == np.dtype(formats.E2M1):
        codes = formats.pack_fp4(codes)
    if np.dtype(scales.dtype) == np.dtype(formats.E8M0):
        scales = jax.lax.bitcast_convert_type(scales, jnp.uint8)
    return codes[None], scales[None], jnp.asarray(w.alpha, jnp.float32)[None]


# --------------------------------------------------------------------------------------------------------------
# The reference and the differentiable entry point
# --------------------------------------------------------------------------------------------------------------


def _product(x: jax.Array, w_hat: jax.Array, alpha: jax.Array, out_dtype: Any, batched: bool) -> jax.Array:
    """alpha · (x · ŵᵀ) in out_dtype: x in its own dtype (ŵ is exact in it), fp32 accumulation, never TF32.

    batched: x (L, M, K), ŵ (L, N, K), alpha (L,); else x (..., K), ŵ (N, K), alpha a scalar.
    """
    f32 = np.dtype(x.dtype) == np.dtype(jnp.float32)
    contract = (((x.ndim - 1,), (w_hat.ndim - 1,)), ((0,), (0,)) if batched else ((), ()))
    acc = jax.lax.dot_general(x, w_hat.astype(x.dtype), contract, preferred_element_type=jnp.float32,
                              precision=jax.lax.Precision.HIGHEST if f32 else None)
    alpha = alpha[:, None, None] if batched else alpha
    return (acc * alpha).astype(out_dtype)


def weight_only_reference(x: jax.Array, codes: jax.Array, scales: jax.Array, alpha: jax.Array, *, fmt: str,
                          out_dtype: Any) -> jax.Array:
    """SPEC §5b on canonical operands: y (L, M, N) = alpha · x · Ŵᵀ with Ŵ dequantized to bf16 (exact in the normal
    range, SPEC §6) and one dot in x's dtype with fp32 accumulation."""
    w_hat = reference.dequantize_bf16(formats.unpacked_codes(codes, x.shape[-1]), scales,
                                      block=formats.FORMATS[fmt].block, axis=-1)
    return _product(x, w_hat, alpha, out_dtype, batched=True)


def constant_weight_error(op: str) -> ValueError:
    """What differentiating a weight-only product with respect to its quantized weight raises (at trace time)."""
    return ValueError(f"{op} is differentiable with respect to x only: the quantized weight is a constant (its codes "
                      "and scales have no gradient). Differentiate with respect to x, or train the float weight "
                      "(e.g. with mx_dot_general) and quantize it afterwards.")


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def matmul(x: jax.Array, w: QuantizedWeight, out_dtype: np.dtype, implementation: Optional[str]) -> jax.Array:
    """y (..., N) = x (..., K) · Ŵᵀ on checked inputs (`check_call`): x's leading axes become M, one bind."""
    n = w.shape[0]
    codes, scales, alpha = canonical_weight(w)
    x3 = x.reshape(1, -1, x.shape[-1])
    (y,) = weight_only_p.bind(x3, codes, scales, alpha, fmt=w.format, out_dtype=np.dtype(out_dtype),
                              implementation=implementation)
    return y[0].reshape(*x.shape[:-1], n)


def _matmul_jvp(out_dtype, implementation, primals, tangents):
    """d/dx only: dy = alpha · dx · Ŵᵀ (JAX transposes it into dx = alpha · dy · Ŵ); the weight is a constant."""
    x, w = primals
    x_dot, w_dot = tangents
    if any(not isinstance(t, SymbolicZero) for t in jax.tree.leaves(w_dot)):
        raise constant_weight_error("weight_only_matmul")
    y = matmul(x, w, out_dtype, implementation)
    if isinstance(x_dot, SymbolicZero):
        return y, jnp.zeros_like(y)
    n, k = w.shape
    codes, scales, _ = canonical_weight(w)
    w_hat = reference.dequantize_bf16(formats.unpacked_codes(codes[0], k), scales[0], block=w.block_format.block,
                                      axis=-1)
    return y, _product(x_dot, w_hat, jnp.asarray(w.alpha, jnp.float32), out_dtype, batched=False)


matmul.defjvp(_matmul_jvp, symbolic_zeros=True)


# --------------------------------------------------------------------------------------------------------------
# Primitive rules
# --------------------------------------------------------------------------------------------------------------


def _abstract_eval(x, codes, scales, alpha, *, out_dtype, **_):
    return (jax.core.ShapedArray((x.shape[0], x.shape[1], codes.shape[1]), out_dtype),)


def _reference_call(x, codes, scales, alpha, *, fmt, out_dtype, **_):
    return [weight_only_reference(x, codes, scales, alpha, fmt=fmt, out_dtype=out_dtype)]


def _reference_lowering(ctx, *args, **params):
    primitives.no_kernel_off_cuda(ctx, "weight_only_matmul", params["implementation"])
    return mlir.lower_fun(functools.partial(_reference_call, **params), multiple_results=True)(ctx, *args)


def _kernel_lowering(ctx, *args, variants, **_):
    """The decode kernel dispatch names for this call (x, the codes, the compact scales as sw, alpha; its amax
    result is dropped, so never zeroed) or the swap_ab kernel's decode tile."""
    from jax_blockgemm import ffi_lowering  # lazy, as in primitives.py

    amax = jax.core.ShapedArray((ctx.avals_in[0].shape[0],), np.dtype(np.float32))
    y, _ = ffi_lowering.emit_decode(ctx.replace(avals_out=[*ctx.avals_out, amax]), *args, variants=variants,
                                    amax_used=False)
    return [y]


def _batch(args, dims, **params):
    """vmap over x alone folds into the rows M (one weight read serves every example); over a weight, into L."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not primitives._NOT_MAPPED)
    x, *weight = args
    if all(d is primitives._NOT_MAPPED for d in dims[1:]):
        x = jnp.moveaxis(x, dims[0], 1)  # (L, B, M, K)
        l, _, m, k = x.shape
        (y,) = weight_only_p.bind(x.reshape(l, size * m, k), *weight, **params)
        return [y.reshape(l, size, m, y.shape[-1])], [1]
    (y,) = weight_only_p.bind(*primitives._fold_into_leading(args, dims, size), **params)
    return [y.reshape(size, -1, *y.shape[1:])], [0]


primitives.register(weight_only_p, weight_only_local_p, abstract_eval=_abstract_eval,
                    reference_lowering=_reference_lowering, batch_rule=_batch,
                    cuda_lowering=primitives.kernel_or_reference("weight_only_matmul", "weight_only_kernels",
                                                                 _kernel_lowering, _reference_lowering),
                    partitioned=sharding.WEIGHT_ONLY.partitioned)
