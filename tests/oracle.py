"""Float64 NumPy oracles of SPEC §1-§3 (formats, block quantization, the 128x4 scale atom).

Written straight from the SPEC and deliberately independent of `jax_blockgemm.formats`: rounding is done by
searching the dtype's grid of finite values (ties to the even code), never by a backend's float conversion, and
the atom is built from the SPEC's byte-offset formula rather than from reshapes.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)

_E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # SPEC §1, indexed by the 3 low bits


def _positive_grid(dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(values, bit patterns) of every finite non-negative code of a float8 / float4 dtype, ascending."""
    if dtype == E2M1:
        return _E2M1_MAGNITUDES.copy(), np.arange(8, dtype=np.uint8)
    bits = np.arange(0x80, dtype=np.uint8)
    values = bits.view(dtype).astype(np.float64)
    keep = np.isfinite(values)
    return values[keep], bits[keep]


def round_to_dtype_f64(y: np.ndarray, dtype) -> np.ndarray:
    """Round float64 values to `dtype`'s grid: nearest, ties to the even bit pattern, saturating at +-max finite.

    NaN inputs are not expected (callers zero non-finite blocks). Returns an array of `dtype`.
    """
    dtype = np.dtype(dtype)
    grid, bits = _positive_grid(dtype)
    y = np.asarray(y, np.float64)
    a = np.minimum(np.abs(y), grid[-1])
    hi = np.clip(np.searchsorted(grid, a, side="left"), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (bits[hi] % 2 == 0))
    idx = np.where(pick_hi, hi, lo)
    sign = np.signbit(y).astype(np.uint8) << (3 if dtype == E2M1 else 7)
    out = (bits[idx] | sign).astype(np.uint8)
    return out.view(dtype) if dtype != E2M1 else _nibbles_to_e2m1(out)


def _nibbles_to_e2m1(nibbles: np.ndarray) -> np.ndarray:
    return _nibble_values(nibbles).astype(E2M1)  # exact: every nibble value is on the E2M1 grid


def _nibble_values(nibbles: np.ndarray) -> np.ndarray:
    n = np.asarray(nibbles).astype(np.int64)
    return np.where(n & 8, -1.0, 1.0) * _E2M1_MAGNITUDES[n & 7]


def codes_to_f64(codes: np.ndarray) -> np.ndarray:
    """float64 values of float8 / float4_e2m1fn codes, or of uint8 packed FP4 (low nibble first; last axis x2)."""
    codes = np.asarray(codes)
    if codes.dtype == np.uint8:
        nib = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)
        return _nibble_values(nib)
    if codes.dtype in (E4M3, E5M2, E2M1):
        return codes.astype(np.float64)
    raise TypeError(f"codes_to_f64: unsupported dtype {codes.dtype}")


def scales_to_f64(scales: np.ndarray) -> np.ndarray:
    """float64 values of E8M0 scales (uint8 bytes or float8_e8m0fnu; 0xFF is NaN) or float8_e4m3fn scales."""
    scales = np.asarray(scales)
    if scales.dtype == E8M0:
        scales = scales.view(np.uint8)
    if scales.dtype == np.uint8:
        out = np.ldexp(1.0, scales.astype(np.int64) - 127)
        return np.where(scales == 0xFF, np.nan, out)
    if scales.dtype == E4M3:
        return scales.astype(np.float64)
    raise TypeError(f"scales_to_f64: unsupported dtype {scales.dtype}")


def dequantize_f64(codes, scales, *, block: int, axis: int = -1) -> np.ndarray:
    """code x scale in float64; each scale covers `block` consecutive elements along `axis` (last one partial)."""
    values = codes_to_f64(codes)
    s = np.repeat(scales_to_f64(scales), block, axis=axis)
    n = values.shape[axis]
    s = np.take(s, np.arange(n), axis=axis)
    return values * s


def _blocks(x: np.ndarray, axis: int, block: int) -> tuple[np.ndarray, int]:
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    n = x.shape[-1]
    nb = math.ceil(n / block)
    pad = np.zeros(x.shape[:-1] + (nb * block - n,))
    return np.concatenate([x, pad], axis=-1).reshape(*x.shape[:-1], nb, block), n


def _unblocks(xb: np.ndarray, n: int, axis: int) -> np.ndarray:
    return np.moveaxis(xb.reshape(*xb.shape[:-2], -1)[..., :n], -1, axis)


def _amax_and_bad(xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    finite = np.isfinite(xb)
    return np.max(np.where(finite, np.abs(xb), 0.0), axis=-1), ~finite.all(axis=-1)


def mx_exponent_f64(amax: np.ndarray, emax: float, rule: str = "ceil") -> np.ndarray:
    """SPEC §2 scale exponent (before the NaN / zero special cases), clamped to [-127, 127]."""
    amax = np.asarray(amax, np.float64)
    safe = np.where(amax > 0, amax, 1.0)
    if rule == "ceil":
        e = np.ceil(np.log2(safe / emax)).astype(np.int64)
        # make it exactly the smallest e with amax <= emax * 2**e (log2 may be off by one near boundaries)
        e = np.where(safe > np.ldexp(emax, e), e + 1, e)
        e = np.where(safe <= np.ldexp(emax, e - 1), e - 1, e)
    elif rule == "floor":
        e = (np.frexp(safe)[1] - 1) - (math.frexp(emax)[1] - 1)
    else:
        raise ValueError(rule)
    return np.clip(e, -127, 127)


def quantize_mx_f64(x, *, block: int = 32, emax: float = 448.0, code_dtype=ml_dtypes.float8_e4m3fn, axis: int = -1,
                    rule: str = "ceil") -> tuple[np.ndarray, np.ndarray]:
    """MX quantization per SPEC §2: (codes of code_dtype shaped like x, uint8 E8M0 bytes with ceil(n/block) on axis)."""
    xb, n = _blocks(x, axis, block)
    amax, bad = _amax_and_bad(xb)
    e = mx_exponent_f64(amax, emax, rule)
    e = np.where(amax == 0, -127, e)
    y = np.where(bad[..., None], 0.0, xb / np.ldexp(1.0, e)[..., None])
    codes = round_to_dtype_f64(np.clip(y, -emax, emax), code_dtype)
    byte = np.where(bad, 0xFF, e + 127).astype(np.uint8)
    return _unblocks(codes, n, axis), np.moveaxis(byte, -1, axis)


def quantize_nvfp4_f64(x, *, axis: int = -1, block: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """NVFP4 per SPEC §2: (float4_e2m1fn codes, float8_e4m3fn scales); zero block: scale 0; NaN/inf block: NaN."""
    xb, n = _blocks(x, axis, block)
    amax, bad = _amax_and_bad(xb)
    grid, _ = _positive_grid(E4M3)
    s = round_to_dtype_f64(amax / 6.0, E4M3).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        up = (amax > 0) & (amax / s > 6.0) & (s < grid[-1])
    s = np.where(up, grid[np.minimum(np.searchsorted(grid, s) + 1, len(grid) - 1)], s)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(bad[..., None] | (s[..., None] == 0), 0.0, xb / s[..., None])
    codes = round_to_dtype_f64(y, E2M1)
    scales = np.where(bad, np.nan, s).astype(E4M3)
    return _unblocks(codes, n, axis), np.moveaxis(scales, -1, axis)


def _atom_offsets(l: int, mn: int, kb: int) -> np.ndarray:
    """SPEC §3 byte offset of every logical scale [l, mn, kb], as an (L, MN, KB) int array."""
    mt, kt = math.ceil(mn / 128), math.ceil(kb / 4)
    li, mi, ki = np.meshgrid(np.arange(l), np.arange(mn), np.arange(kb), indexing="ij")
    return (((li * mt + mi // 128) * kt + ki // 4) * 512 + (mi % 32) * 16 + ((mi // 32) % 4) * 4 + ki % 4)


def compact_to_atom_np(scales: np.ndarray) -> np.ndarray:
    """(L, MN, KB) (or (MN, KB)) scales -> physical atom (L, MN', K', 32, 4, 4), same dtype, padding = byte 0."""
    scales = np.asarray(scales)
    if scales.ndim == 2:
        scales = scales[None]
    l, mn, kb = scales.shape
    mt, kt = math.ceil(mn / 128), math.ceil(kb / 4)
    buf = np.zeros(l * mt * kt * 512, np.uint8)
    buf[_atom_offsets(l, mn, kb).ravel()] = scales.view(np.uint8).ravel()
    return buf.view(scales.dtype).reshape(l, mt, kt, 32, 4, 4)


def atom_to_compact_np(atom: np.ndarray, mn: int, kb: int) -> np.ndarray:
    """Physical atom (L, MN', K', 32, 4, 4) -> compact (L, MN, KB), same dtype."""
    atom = np.asarray(atom)
    l = atom.shape[0]
    return atom.reshape(-1)[_atom_offsets(l, mn, kb)]


def random_scale_bytes(rng: np.random.Generator, shape, lo: int = 118, hi: int = 136) -> np.ndarray:
    """Random E8M0 scale bytes in [lo, hi] inclusive (default 2**-9 .. 2**9), uint8."""
    return rng.integers(lo, hi + 1, size=shape).astype(np.uint8)


def random_e4m3_scales(rng: np.random.Generator, shape) -> np.ndarray:
    """Random positive E4M3 scales with random mantissas, 2**-4 .. 2**4 (NVFP4 block scales)."""
    return np.exp2(rng.uniform(-4.0, 4.0, size=shape)).astype(E4M3)
