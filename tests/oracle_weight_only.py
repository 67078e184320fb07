"""Float64 oracle of the weight-only matmul (SPEC §5b) and random inputs for it, written from the contract.

Builds on tests/oracle.py (codes and scales to float64) and tests/oracle_ops.py (random codes over a format's whole
range with random non-trivial scales), independent of the library's quantizers and reference.
"""

from __future__ import annotations

import numpy as np

import jax.numpy as jnp

import jax_blockgemm as jbg
import oracle
import oracle_ops

FORMATS = oracle_ops.FORMATS  # "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4"
BLOCK = {"mxfp8_e4m3": 32, "mxfp8_e5m2": 32, "mxfp4": 32, "nvfp4": 16}


def dequantized_f64(w: jbg.QuantizedWeight) -> np.ndarray:
    """Ŵ = code × block scale × alpha in float64, (N, K) (FP4 codes packed or not)."""
    codes = np.asarray(w.codes)
    if codes.dtype == oracle.E2M1:
        values = codes.astype(np.float64)
    else:
        values = oracle.codes_to_f64(codes)
    scales = np.repeat(oracle.scales_to_f64(np.asarray(w.scales)), BLOCK[w.format], axis=-1)[..., :values.shape[-1]]
    with np.errstate(invalid="ignore", over="ignore"):
        return values * scales * np.float64(np.asarray(w.alpha))


def _products_summed(x64: np.ndarray, w64: np.ndarray) -> np.ndarray:
    """(..., K) · (N, K)ᵀ -> (..., N), summed in float64 (NaN / inf propagate as in exact arithmetic)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.einsum("...k,nk->...n", x64, w64)


def weight_only_oracle(x, w: jbg.QuantizedWeight) -> np.ndarray:
    """y (..., N) = x · Ŵᵀ summed in float64 (NaN / inf propagate as in exact arithmetic)."""
    return _products_summed(np.asarray(jnp.asarray(x, jnp.float32), np.float64), dequantized_f64(w))


def magnitude_oracle(x, w: jbg.QuantizedWeight) -> np.ndarray:
    """|x| · |Ŵ|ᵀ in float64: what an fp32 sum of the products can lose is a fraction of this, not of y."""
    return _products_summed(np.abs(np.asarray(jnp.asarray(x, jnp.float32), np.float64)), np.abs(dequantized_f64(w)))


def random_weight(rng: np.random.Generator, n: int, k: int, fmt: str,
                  scale_log2: tuple[float, float] = (-4.0, 4.0)) -> jbg.QuantizedWeight:
    """A QuantizedWeight of random codes over the format's whole range and random block scales (NVFP4: a random
    alpha too); FP4 codes packed (K even)."""
    d = oracle_ops.random_gemm_inputs(rng, l=1, m=1, n=n, k=k, fmt=fmt, scale_log2=scale_log2)
    alpha = np.float32(d["alpha"]) if fmt == "nvfp4" else np.float32(1.0)
    return jbg.QuantizedWeight(jnp.asarray(d["b"][0]), jnp.asarray(d["sfb"][0]), jnp.asarray(alpha), fmt)


def random_x(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> jnp.ndarray:
    """Normal activations whose rows differ in magnitude (2**-4 .. 2**4), in bfloat16 or float32."""
    rows = np.exp2(rng.integers(-4, 5, size=(*shape[:-1], 1)))
    return jnp.asarray(rng.standard_normal(shape) * rows, jnp.float32).astype(dtype)
