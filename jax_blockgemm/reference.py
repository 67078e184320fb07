"""The pure-JAX reference of both operations (SPEC §4-§6): what every platform without a kernel runs.

The primitives lower to these functions on CPU and on GPUs without a kernel, and the GPU tests compare every
kernel against them, so they compute exactly the SPEC's function and never trade accuracy for speed:

  * operands are dequantized to bfloat16. A code times a power-of-two scale (MXFP8 / MXFP4), or an E2M1 code
    times an E4M3 scale (NVFP4), is exact in bfloat16 whenever its magnitude lies in [2**-126, 2**128), the
    float32 normal range. (Outside it -- e.g. an E4M3 code 448 under scale byte 254 -- the dequantized operand
    overflows to inf or flushes towards zero, where a kernel that applies scales inside the MMA might not.);
  * the dot takes bfloat16 operands and returns float32 (`preferred_element_type`): bfloat16 products, float32
    accumulation, never TF32 (the operands are bfloat16) and never a bfloat16 accumulator. It is written without an
    explicit `DotAlgorithmPreset`: on the H200 the preset ``BF16_BF16_F32`` made XLA pick slower GEMM kernels
    (2-9% on the whole reference at the SPEC §8 shapes, bit-identical results; docs/design/reference.md);
  * everything after the accumulator (alpha, amax, RoPE, quantization) stays in float32.

One exception, per architecture: an MXFP8 gemm_amax may take its accumulator from XLA's block-scaled
`jax.lax.scaled_dot` (`scaled_dot=True`), which puts it in SPEC §7's "tensor-core FP8" class (<= 1e-4; ~1e-5 measured
on an H200) instead of "exact". `arch.TABLE` says where implementation=None does: on Blackwell, where XLA hands it to
cuDNN's block-scaled GEMM on the FP8 tensor cores; not on Hopper, where it was no faster than the bf16 route
(docs/design/reference.md). implementation="xla", which the GPU tests judge kernels by, never takes it.

Inputs arrive canonical: the public API (`api.py`) has already validated and normalized them, so this module only
asserts the few invariants it relies on.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_blockgemm import arch, formats
from jax_blockgemm.support import FP4_DTYPES, FP8_DTYPES, HEAD_DIM, MX_BLOCK, QK_NOPE, QK_ROPE

__all__ = ["gemm_amax_reference", "gemm_proj_rope_reference", "apply_rope", "convert_c", "dequantize_bf16",
           "has_scaled_dot", "scaled_dot_applies", "use_scaled_dot"]

_WIDE_C_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))

# Code dtypes the scaled_dot route takes (both operands). On the H200, SPEC §2's special values through
# jax.lax.scaled_dot: NaN codes and NaN (0xFF) scale bytes propagate like the oracle, but E5M2's -inf + inf came out
# non-NaN, so the route takes E4M3 x E4M3 only (docs/design/reference.md). Where None takes the route at all is
# `arch.TABLE`'s.
SCALED_DOT_CODES = (np.dtype(jnp.float8_e4m3fn),)  # code dtypes the route takes (both operands)


def _bf16_dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers) -> jax.Array:
    """bfloat16 dot_general with float32 accumulation and a float32 result (the SPEC §6 contract: bfloat16
    operands with a float32 result accumulate in float32 on every XLA backend)."""
    return jax.lax.dot_general(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), dimension_numbers,
                               preferred_element_type=jnp.float32)


def dequantize_bf16(codes: jax.Array, scales: jax.Array, *, block: int, axis: int) -> jax.Array:
    """code x block scale as bfloat16 (exact in the normal range); scales have ceil(n / block) entries on `axis`.

    The same values as `formats.dequantize`, with the scales expanded by broadcast and reshape instead of
    `jnp.repeat` (which lowers to a gather); on the H200 both ran the §8 GEMMs equally fast, but the broadcast
    form leaves nothing for XLA to get wrong.
    """
    axis = axis % codes.ndim
    n = codes.shape[axis]
    nb = formats.num_blocks(n, block)

    def expand(s: jax.Array) -> jax.Array:
        s = jnp.expand_dims(s, axis + 1)
        s = jnp.broadcast_to(s, (*s.shape[:axis + 1], block, *s.shape[axis + 2:]))
        s = s.reshape(*s.shape[:axis], nb * block, *s.shape[axis + 2:])
        return jax.lax.slice_in_dim(s, 0, n, axis=axis)

    return formats.times_block_scales(codes.astype(jnp.float32), scales, expand).astype(jnp.bfloat16)


def _as_compact(scales: jax.Array, mn: int, kb: int) -> jax.Array:
    """(L, MN, KB) scales from the compact form (as they are) or the physical atom (L, MN', K', 32, 4, 4), whose
    padding is dropped."""
    return scales if scales.ndim == 3 else formats.from_scale_atom(scales, mn, kb)


def _dequantize_operand(codes: jax.Array, scales: jax.Array, *, mn: int, k: int, sf_vec_size: int,
                        k_axis: int) -> jax.Array:
    """Codes (L, MN, K) / (L, K, MN) or packed FP4 (L, MN, K//2) times their block scales (compact or atom), as
    bfloat16."""
    scales = _as_compact(scales, mn, formats.num_blocks(k, sf_vec_size))  # (L, MN, KB)
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


def has_scaled_dot() -> bool:
    """Whether the installed jax has `jax.lax.scaled_dot` (XLA's block-scaled dot; jax 0.11 has it)."""
    return callable(getattr(jax.lax, "scaled_dot", None))


def scaled_dot_applies(a_dtype: Any, b_dtype: Any, *, sf_vec_size: int, k: int) -> bool:
    """Whether `jax.lax.scaled_dot` can compute this call's accumulator: MXFP8 codes (E4M3/E5M2) on both sides
    with E8M0 scales in whole 32-blocks along K, and an installed jax that has it."""
    return (has_scaled_dot() and np.dtype(a_dtype) in FP8_DTYPES and np.dtype(b_dtype) in FP8_DTYPES
            and sf_vec_size == MX_BLOCK and k % MX_BLOCK == 0)


def use_scaled_dot(device_kinds: Sequence[str], a_dtype: Any, b_dtype: Any, *, sf_vec_size: int, l: int, m: int,
                   n: int, k: int) -> bool:
    """Whether implementation=None takes the gemm_amax accumulator from `jax.lax.scaled_dot`: where it applies and
    `arch.TABLE` sends every device kind the program is lowered for ("cuda:<capability>", "cpu", ...) there at this
    size; the bfloat16-dequantization dot everywhere else, and always for implementation="xla"."""
    if not device_kinds or not scaled_dot_applies(a_dtype, b_dtype, sf_vec_size=sf_vec_size, k=k):
        return False
    if np.dtype(a_dtype) not in SCALED_DOT_CODES or np.dtype(b_dtype) not in SCALED_DOT_CODES:
        return False
    thresholds = [arch.scaled_dot_min_size(kind) for kind in device_kinds]
    return all(t is not None and l * m * n * k >= t for t in thresholds)


def _scaled_operand(codes: jax.Array, scales: jax.Array, *, mn: int, k: int, k_axis: int) -> tuple[jax.Array, ...]:
    """MXFP8 codes and their compact float8_e8m0fnu scales laid out like them, as `jax.lax.scaled_dot` takes them."""
    scales = _as_compact(scales, mn, k // MX_BLOCK)  # (L, MN, KB) bytes
    if k_axis == 1:
        scales = jnp.swapaxes(scales, 1, 2)
    return codes, jax.lax.bitcast_convert_type(scales, formats.E8M0)


def _scaled_dot(lhs: tuple[jax.Array, ...], rhs: tuple[jax.Array, ...], dimension_numbers) -> jax.Array:
    """float32 accumulator of two (codes, scales) pairs through XLA's block-scaled dot."""
    return jax.lax.scaled_dot(lhs[0], rhs[0], lhs_scale=lhs[1], rhs_scale=rhs[1],
                              dimension_numbers=dimension_numbers, preferred_element_type=jnp.float32)


def _k_major(codes: jax.Array, k_axis: int) -> jax.Array:
    """(L, K, MN) codes (k_axis=1) as (L, MN, K); K-major codes (k_axis=2) unchanged."""
    return codes if k_axis == 2 else jnp.swapaxes(codes, 1, 2)


def gemm_amax_reference(a: jax.Array, b: jax.Array, sfa: jax.Array, sfb: jax.Array, *, k: int,
                        sf_vec_size: int, c_dtype: Any, a_major: str = "k", b_major: str = "k",
                        c_major: str = "n", alpha: Optional[jax.Array] = None,
                        scaled_dot: bool = False) -> tuple[jax.Array, jax.Array]:
    """Block-scaled GEMM with amax (SPEC §4) on canonical operands; returns (c, amax) with amax of shape (L,).

    a: (L, M, K) codes for a_major="k", (L, K, M) for "m"; b: (L, N, K) for b_major="k", (L, K, N) for "n".
    FP8 codes are float8_e4m3fn / float8_e5m2; FP4 codes are uint8 containers (L, MN, K//2), k-major only, and `k`
    is the logical K. sfa / sfb: compact (L, MN, KB) scales or physical atoms (L, MN', K', 32, 4, 4), of E8M0
    bytes (uint8) or float8_e4m3fn (NVFP4). alpha: optional float32 scalar or (L,) per-batch value multiplying the
    accumulator.

    c is (L, M, N) for c_major="n", (L, N, M) for "m", a packed uint8 (L, M, N//2) for FP4 C. amax[l] is max |C|
    of batch l taken on the float32 accumulator (after alpha, before the conversion); NaN anywhere makes it NaN.
    scaled_dot=True computes the accumulator with `jax.lax.scaled_dot` instead of the bfloat16-dequantization
    dot (MXFP8 only, see `scaled_dot_applies`; `use_scaled_dot` decides when the primitives take it).
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
    if scaled_dot:
        if not scaled_dot_applies(a.dtype, b.dtype, sf_vec_size=sf_vec_size, k=k):
            raise ValueError(f"scaled_dot=True needs jax.lax.scaled_dot (installed: {has_scaled_dot()}), MXFP8 "
                             f"operands, sf_vec_size=32 and K a multiple of 32; got a {a.dtype}, b {b.dtype}, "
                             f"sf_vec_size={sf_vec_size}, K={k}.")
        a_op = _scaled_operand(a, sfa, mn=m, k=k, k_axis=a_k_axis)
        b_op = _scaled_operand(b, sfb, mn=n, k=k, k_axis=b_k_axis)
        dot = _scaled_dot
    else:
        # Every major runs one dot of two K-major operands: MN-major codes are transposed first (exact: codes only
        # move). An element's float32 sum must not depend on how many rows the call has, or a sharded call differs
        # from the unsharded one. XLA:CPU hands a dot to YNNPACK only when its left operand is K-major, and YNNPACK's
        # sums did not change with M or N in whole 128-row blocks (tests/test_reference.py); a dot with an MN-major
        # left operand goes to Eigen, whose edge tiles sum K in another order than its inner ones (seen on an AVX2
        # machine: rows 126-127 of a 128-row N shard). The scaled_dot route above takes any major as it is.
        a_op = _dequantize_operand(_k_major(a, a_k_axis), sfa, mn=m, k=k, sf_vec_size=sf_vec_size, k_axis=2)
        b_op = _dequantize_operand(_k_major(b, b_k_axis), sfb, mn=n, k=k, sf_vec_size=sf_vec_size, k_axis=2)
        a_k_axis = b_k_axis = 2
        dot = _bf16_dot
    if c_major == "n":  # dot_general orders the result (batch, lhs free, rhs free): no transpose needed
        acc = dot(a_op, b_op, (((a_k_axis,), (b_k_axis,)), ((0,), (0,))))
    else:
        acc = dot(b_op, a_op, (((b_k_axis,), (a_k_axis,)), ((0,), (0,))))
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


def _quantize_rows_and_columns(y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """SPEC §5 step 3 on (T, H, 192) float32, both ways, on views of Y's own layout (no transpose).

    Rowwise blocks are the last axis of (T, H, 6, 32); columnwise blocks the middle axis of (T/32, 32, H*192),
    a reduction XLA runs down the columns, so both code maps read Y in the same order. Bit-identical to
    `formats.quantize_mxfp8` along axis -1 and axis 0, which moves tokens last and back (two transposes).
    """
    t, h, _ = y.shape
    rows = y.reshape(t, h, HEAD_DIM // MX_BLOCK, MX_BLOCK)
    e_row = formats.mx_block_exponents(rows, axis=-1, code_dtype=formats.E4M3)
    cols = y.reshape(t // MX_BLOCK, MX_BLOCK, h * HEAD_DIM)
    e_col = formats.mx_block_exponents(cols, axis=1, code_dtype=formats.E4M3)
    row_codes = formats.mx_encode_blocks(rows, e_row, code_dtype=formats.E4M3).reshape(t, h, HEAD_DIM)
    col_codes = formats.mx_encode_blocks(cols, e_col, code_dtype=formats.E4M3).reshape(t, h, HEAD_DIM)
    row_scales = formats.exponent_to_e8m0(e_row[..., 0])
    col_scales = formats.exponent_to_e8m0(e_col[:, 0]).reshape(t // MX_BLOCK, h, HEAD_DIM)
    return row_codes, row_scales, col_codes, col_scales


def gemm_proj_rope_reference(x: jax.Array, w: jax.Array, cos: jax.Array, sin: jax.Array, *,
                             x_scale: Optional[jax.Array] = None, w_scale: Optional[jax.Array] = None,
                             w_out_in: bool = True, scaled_dot: bool = False
                             ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """DeepSeek-V3 MLA Q up-projection (SPEC §5): GEMM, per-head RoPE, MXFP8 E4M3 quantization both ways.

    x: (T, K) bfloat16, or float8_e4m3fn codes with x_scale (T, K/32) E8M0 bytes. w: (H*192, K) when w_out_in,
    else (K, H*192), same dtype as x, w_scale laid out like w. cos, sin: (T, 64) bfloat16.
    Returns (out_fp8_row (T, H, 192), out_scales_row (T, H, 6) uint8, out_fp8_col (T, H, 192),
    out_scales_col (T/32, H, 192) uint8); float32 from the accumulator through RoPE to quantization.

    Structure, chosen by measurement on the H200 (every candidate bit-identical; the figures are in
    docs/design/reference.md): one optimization_barrier, on the float32 Y after RoPE, so the rotated Y is written
    once and both quantizers read it (a barrier after the dot, or none, recomputes RoPE inside the quantizers and
    took up to 2.9x longer); both quantizations on reshaped views of Y's own layout (`_quantize_rows_and_columns`),
    never tokens moved last and back. tests/test_reference_formulation.py keeps the formulation before as the
    oracle of record. scaled_dot=True takes the MXFP8 GEMM from `jax.lax.scaled_dot` (see `use_scaled_dot`).
    """
    dimension_numbers = (((1,), (1 if w_out_in else 0,)), ((), ()))
    if x.dtype == np.dtype(jnp.float8_e4m3fn):
        if x_scale is None or w_scale is None:
            raise ValueError("x_scale and w_scale are required when x and w are float8_e4m3fn codes.")
    if scaled_dot:  # MXFP8 through XLA's block-scaled dot ("tensor-core FP8" class), RoPE and quantization as below
        if x.dtype != np.dtype(jnp.float8_e4m3fn) or not has_scaled_dot():
            raise ValueError(f"scaled_dot=True needs float8_e4m3fn x and w and jax.lax.scaled_dot (installed: "
                             f"{has_scaled_dot()}); got x {x.dtype}.")
        e8m0 = lambda s: jax.lax.bitcast_convert_type(s, formats.E8M0)
        y = _scaled_dot((x, e8m0(x_scale)), (w, e8m0(w_scale)), dimension_numbers)
    else:
        if x.dtype == np.dtype(jnp.float8_e4m3fn):
            x = dequantize_bf16(x, x_scale, block=MX_BLOCK, axis=1)
            w = dequantize_bf16(w, w_scale, block=MX_BLOCK, axis=1 if w_out_in else 0)
        y = _bf16_dot(x, w, dimension_numbers)  # (T, H*192)
    t, n = y.shape
    if t % MX_BLOCK:
        raise ValueError(f"x must have a multiple of {MX_BLOCK} tokens (the columnwise blocks); got T={t}.")
    y = apply_rope(y.reshape(t, n // HEAD_DIM, HEAD_DIM), cos, sin)
    y = jax.lax.optimization_barrier(y)  # float32: pins where Y is materialized, changes no value
    return _quantize_rows_and_columns(y)
