"""The pure-JAX reference of both operations (SPEC §4-§6): what every platform without a kernel runs.

The primitives lower to these functions on CPU and on GPUs without a kernel, and the GPU tests compare every
kernel against them, so they compute exactly the SPEC's function and never trade accuracy for speed:

  * operands are dequantized to bfloat16. A code times a power-of-two scale (MXFP8 / MXFP4), or an E2M1 code
    times an E4M3 scale (NVFP4), is exact in bfloat16 whenever its magnitude lies in [2**-126, 2**128), the
    float32 normal range. (Outside it -- e.g. an E4M3 code 448 under scale byte 254 -- the dequantized operand
    overflows to inf or flushes towards zero, where a kernel that applies scales inside the MMA might not.);
  * the dot runs with the explicit ``BF16_BF16_F32`` algorithm: bfloat16 products, float32 accumulation, never
    TF32 and never a bfloat16 accumulator, on every backend;
  * everything after the accumulator (alpha, amax, RoPE, quantization) stays in float32.

Inputs arrive canonical: the public API (`api.py`) has already validated and normalized them, so this module only
asserts the few invariants it relies on.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_blockgemm import formats
from jax_blockgemm.support import FP4_DTYPES, FP8_DTYPES, HEAD_DIM, MX_BLOCK, QK_NOPE, QK_ROPE

__all__ = ["gemm_amax_reference", "gemm_proj_rope_reference", "apply_rope", "convert_c", "dequantize_bf16"]

# bfloat16 x bfloat16 products, float32 accumulation: the SPEC §6 contract, stated to XLA rather than implied.
_DOT_ALGORITHM = jax.lax.DotAlgorithmPreset.BF16_BF16_F32

_WIDE_C_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))



def _bf16_dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers) -> jax.Array:
    """bfloat16 dot_general with float32 accumulation and a float32 result."""
    return jax.lax.dot_general(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), dimension_numbers,
                               precision=_DOT_ALGORITHM, preferred_element_type=jnp.float32)


def dequantize_bf16(codes: jax.Array, scales: jax.Array, *, block: int, axis: int) -> jax.Array:
    """code x block scale as bfloat16 (exact in the normal range); scales have ceil(n / block) entries on `axis`.

    The same values as `formats.dequantize`, with the scales expanded by broadcast and reshape instead of
    `jnp.repeat` (which lowers to a gather); on the H200 both ran the §8 GEMMs equally fast, but the broadcast
    form leaves nothing for XLA to get wrong.
    """
    axis = axis % codes.ndim
    n = codes.shape[axis]
    nb = formats.num_blocks(n, block)
    s = formats.scales_to_float32(scales)
    s = jnp.expand_dims(s, axis + 1)
    s = jnp.broadcast_to(s, (*s.shape[:axis + 1], block, *s.shape[axis + 2:]))
    s = s.reshape(*s.shape[:axis], nb * block, *s.shape[axis + 2:])
    s = jax.lax.slice_in_dim(s, 0, n, axis=axis)
    return (codes.astype(jnp.float32) * s).astype(jnp.bfloat16)


def _dequantize_operand(codes: jax.Array, atom: jax.Array, *, mn: int, k: int, sf_vec_size: int,
                        k_axis: int) -> jax.Array:
    """Codes (L, MN, K) / (L, K, MN) or packed FP4 (L, MN, K//2) times their block scales, as bfloat16.

    `atom` is the physical scale atom (L, MN', K', 32, 4, 4); its padding is dropped before use.
    """
    kb = formats.num_blocks(k, sf_vec_size)
    scales = formats.from_scale_atom(atom, mn, kb)  # (L, MN, KB)
    if codes.dtype == np.dtype(jnp.uint8):
        codes = formats.unpack_fp4(codes)[..., :k]
    if k_axis == 1:
        scales = jnp.swapaxes(scales, 1, 2)  # (L, KB, MN), laid out like the codes
    return dequantize_bf16(codes, scales, block=sf_vec_size, axis=k_axis)


def convert_c(c: jax.Array, c_dtype: Any) -> jax.Array:
    """float32 accumulator -> C's dtype with round-to-nearest-even.

    float32 / float16 / bfloat16 convert plainly (float16 overflows to inf); FP8 saturates to its largest finite
    value (NaN stays NaN); FP4 (float4_e2m1fn or uint8) saturates at +-6 and comes back packed two per byte along
    the last axis, low nibble first.
    """
    dtype = np.dtype(c_dtype)
    if dtype in _WIDE_C_DTYPES:
        return c.astype(dtype)
    if dtype in FP8_DTYPES:
        limit = float(jnp.finfo(dtype).max)
        return jnp.clip(c, -limit, limit).astype(dtype)
    if dtype in FP4_DTYPES:  # uint8: the packed FP4 container
        return formats.pack_fp4(formats.round_to_e2m1(c))
    raise ValueError(f"c_dtype must be one of float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, "
                     f"float4_e2m1fn (or uint8 for packed FP4); got {dtype.name}.")


def gemm_amax_reference(a: jax.Array, b: jax.Array, sfa: jax.Array, sfb: jax.Array, *, k: int,
                        sf_vec_size: int, c_dtype: Any, a_major: str = "k", b_major: str = "k",
                        c_major: str = "n", alpha: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
    """Block-scaled GEMM with amax (SPEC §4) on canonical operands; returns (c, amax) with amax of shape (L,).

    a: (L, M, K) codes for a_major="k", (L, K, M) for "m"; b: (L, N, K) for b_major="k", (L, K, N) for "n".
    FP8 codes are float8_e4m3fn / float8_e5m2; FP4 codes are uint8 containers (L, MN, K//2), k-major only, and `k`
    is the logical K. sfa / sfb: physical scale atoms (L, MN', K', 32, 4, 4) of E8M0 bytes (uint8) or
    float8_e4m3fn (NVFP4). alpha: optional float32 scalar or (L,) per-batch value multiplying the accumulator.

    c is (L, M, N) for c_major="n", (L, N, M) for "m", a packed uint8 (L, M, N//2) for FP4 C. amax[l] is max |C|
    of batch l taken on the float32 accumulator (after alpha, before the conversion); NaN anywhere makes it NaN.
    """
    if a_major not in ("k", "m") or b_major not in ("k", "n") or c_major not in ("n", "m"):
        raise ValueError(f"a_major must be 'k' or 'm', b_major 'k' or 'n', c_major 'n' or 'm'; got "
                         f"a_major={a_major!r}, b_major={b_major!r}, c_major={c_major!r}.")
    if a.ndim != 3 or b.ndim != 3:
        raise ValueError(f"a and b must be canonical 3-D (L, MN, K) arrays; got a: {a.shape}, b: {b.shape}.")
    a_k_axis = 2 if a_major == "k" else 1
    b_k_axis = 2 if b_major == "k" else 1
    m = a.shape[3 - a_k_axis]
    n = b.shape[3 - b_k_axis]
    a_hat = _dequantize_operand(a, sfa, mn=m, k=k, sf_vec_size=sf_vec_size, k_axis=a_k_axis)
    b_hat = _dequantize_operand(b, sfb, mn=n, k=k, sf_vec_size=sf_vec_size, k_axis=b_k_axis)
    if c_major == "n":  # dot_general orders the result (batch, lhs free, rhs free): no transpose needed
        acc = _bf16_dot(a_hat, b_hat, (((a_k_axis,), (b_k_axis,)), ((0,), (0,))))
    else:
        acc = _bf16_dot(b_hat, a_hat, (((b_k_axis,), (a_k_axis,)), ((0,), (0,))))
    if alpha is not None:
        alpha = jnp.asarray(alpha, jnp.float32)
        acc = acc * jnp.broadcast_to(alpha.reshape(-1), (acc.shape[0],))[:, None, None]
    # amax[l]: NaN if acc[l] holds a NaN, else inf if it holds an inf (formats.magnitude_max never drops NaN).
    return convert_c(acc, c_dtype), formats.magnitude_max(acc, axis=tuple(range(1, acc.ndim)))


def apply_rope(y: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """SPEC §5 step 2 on (T, H, 192) float32: interleaved pairs in, halves out, features 0..127 unchanged.

    out[128+j] = p[2j] cos[t, j] - p[2j+1] sin[t, j];  out[160+j] = p[2j+1] cos[t, 32+j] + p[2j] sin[t, 32+j],
    with p = y[t, h, 128:192] and cos, sin of shape (T, 64).
    """
    half = QK_ROPE // 2
    cos = cos.astype(jnp.float32)[:, None, :]
    sin = sin.astype(jnp.float32)[:, None, :]
    p = y[..., QK_NOPE:]
    even, odd = p[..., 0::2], p[..., 1::2]
    first = even * cos[..., :half] - odd * sin[..., :half]
    second = odd * cos[..., half:] + even * sin[..., half:]
    return jnp.concatenate([y[..., :QK_NOPE], first, second], axis=-1)


def gemm_proj_rope_reference(x: jax.Array, w: jax.Array, cos: jax.Array, sin: jax.Array, *,
                             x_scale: Optional[jax.Array] = None, w_scale: Optional[jax.Array] = None,
                             w_out_in: bool = True) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """DeepSeek-V3 MLA Q up-projection (SPEC §5): GEMM, per-head RoPE, MXFP8 E4M3 quantization both ways.

    x: (T, K) bfloat16, or float8_e4m3fn codes with x_scale (T, K/32) E8M0 bytes. w: (H*192, K) when w_out_in,
    else (K, H*192), same dtype as x, w_scale laid out like w. cos, sin: (T, 64) bfloat16.
    Returns (out_fp8_row (T, H, 192), out_scales_row (T, H, 6) uint8, out_fp8_col (T, H, 192),
    out_scales_col (T/32, H, 192) uint8); float32 from the accumulator through RoPE to quantization.
    """
    mxfp8 = x.dtype == np.dtype(jnp.float8_e4m3fn)
    if mxfp8:
        if x_scale is None or w_scale is None:
            raise ValueError("x_scale and w_scale are required when x and w are float8_e4m3fn codes.")
        x = dequantize_bf16(x, x_scale, block=MX_BLOCK, axis=1)
        w = dequantize_bf16(w, w_scale, block=MX_BLOCK, axis=1 if w_out_in else 0)
    w_k_axis = 1 if w_out_in else 0
    y = _bf16_dot(x, w, (((1,), (w_k_axis,)), ((), ())))  # (T, H*192)
    t, n = y.shape
    if t % MX_BLOCK:
        raise ValueError(f"x must have a multiple of {MX_BLOCK} tokens (the columnwise blocks); got T={t}.")
    y = apply_rope(y.reshape(t, n // HEAD_DIM, HEAD_DIM), cos, sin)
    # Materialize Y once (float32: no value changes). Left free, XLA:GPU fuses RoPE into the two quantizers in a
    # way that measured slower: 3.4 ms against 2.4 ms for the whole op at T=4096, H=128, K=1536 on the H200.
    y = jax.lax.optimization_barrier(y)
    row_codes, row_scales = formats.quantize_mxfp8(y, axis=-1, dtype=jnp.float8_e4m3fn, block=MX_BLOCK)
    col_codes, col_scales = formats.quantize_mxfp8(y, axis=0, dtype=jnp.float8_e4m3fn, block=MX_BLOCK)
    return row_codes, row_scales, col_codes, col_scales
