"""Float64 NumPy oracles of the two operations (SPEC §4-§5), their SPEC §7 closeness checks and input makers.

Built on tests/oracle.py (format-level float64 oracles) and written from the SPEC, independent of the library:
the GPU tests use the same checks against the kernels, so every failure message says how big the error is,
where the worst element is and how many elements fail.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import ml_dtypes
import numpy as np

import oracle

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
_PACKED_FP4 = (E2M1, np.dtype(np.uint8))

HEAD_DIM, QK_NOPE, QK_ROPE, MX_BLOCK = 192, 128, 64, 32
GEMM_RTOL = 1e-5  # SPEC §7: fp32 C relative Frobenius error and amax relative error ("exact" class kernels)
GEMM_RTOL_TC_FP8 = 1e-4  # SPEC §7's bound itself: the "tensor-core FP8" class (XLA's block-scaled dot route)
FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4")


# ------------------------------------------------------------------------------------------------------------------
# gemm_amax


def _batched(x: np.ndarray, rank: int) -> np.ndarray:
    x = np.asarray(x)
    return x[None] if x.ndim == rank - 1 else x


def _compact_scales(s: np.ndarray, *, mn: int, kb: int) -> np.ndarray:
    """Compact (L, MN, KB) scales from the compact form ((L,) MN, KB) or the physical atom ((L,) MN', K', 32, 4, 4)."""
    s = np.asarray(s)
    if s.ndim in (5, 6):
        return oracle.atom_to_compact_np(_batched(s, 6), mn, kb)
    return _batched(s, 3)


def gemm_amax_oracle(a, b, sfa_compact, sfb_compact, *, k: int, sf_vec_size: int, a_major: str = "k",
                     b_major: str = "k", alpha: Optional[float] = None) -> tuple[np.ndarray, np.ndarray]:
    """C = Â·B̂ᵀ (× alpha) in float64 and amax[l] = max |C[l]| (NaN if C[l] holds one): (c (L, M, N), amax (L,)).

    a: ((L,) M, K) codes, ((L,) K, M) for a_major="m"; FP4 as float4_e2m1fn or uint8 packed pairs (K-major).
    b likewise with b_major "k"/"n". Scales: compact ((L,) MN, ceil(K/sf_vec_size)) (the atom is accepted too).
    """
    a, b = _batched(a, 3), _batched(b, 3)
    if a_major == "m":
        a = np.swapaxes(a, 1, 2)
    if b_major == "n":
        b = np.swapaxes(b, 1, 2)
    kb = math.ceil(k / sf_vec_size)
    for name, x in (("a", a), ("b", b)):
        logical_k = x.shape[2] * (2 if x.dtype == np.uint8 else 1)
        if logical_k != k:
            raise ValueError(f"gemm_amax_oracle: {name} holds K={logical_k} (shape {x.shape}), but k={k}.")
    a_hat = oracle.dequantize_f64(a, _compact_scales(sfa_compact, mn=a.shape[1], kb=kb), block=sf_vec_size)
    b_hat = oracle.dequantize_f64(b, _compact_scales(sfb_compact, mn=b.shape[1], kb=kb), block=sf_vec_size)
    with np.errstate(invalid="ignore", over="ignore"):
        c = np.einsum("lmk,lnk->lmn", a_hat, b_hat)
        if alpha is not None:
            c = c * np.asarray(alpha, np.float64).reshape(-1, 1, 1)
    return c, np.max(np.abs(c), axis=(1, 2))


def _finite_grid(dtype: np.dtype) -> np.ndarray:
    """Every finite value of a float dtype of at most 16 bits, ascending, -0 merged into +0 (float64)."""
    if dtype == E2M1:
        positive = np.arange(8, dtype=np.uint8).view(E2M1).astype(np.float64)
    else:
        uint = np.dtype(f"uint{8 * dtype.itemsize}")
        with np.errstate(invalid="ignore"):
            positive = np.arange(1 << (8 * dtype.itemsize - 1), dtype=uint).view(dtype).astype(np.float64)
        positive = positive[np.isfinite(positive)]
    return np.concatenate([-positive[:0:-1], positive])


def _step_distance(got: np.ndarray, ref: np.ndarray, dtype: np.dtype, *, saturate: bool) -> np.ndarray:
    """How many representable steps of `dtype` separate `got` from float64 `ref` rounded to `dtype` (RNE).

    A tie between two neighbours counts the nearer of the two. Saturating dtypes clamp ref to the finite range;
    the others put +-inf one step beyond the largest finite value. NaN in either gives a huge distance.
    """
    grid = _finite_grid(dtype)
    if saturate:
        ref = np.clip(ref, grid[0], grid[-1])
    else:
        grid = np.concatenate([[-np.inf], grid, [np.inf]])
    got_idx = np.searchsorted(grid, np.where(got == 0, 0.0, got)).astype(np.int64)
    hi = np.clip(np.searchsorted(grid, ref, side="left"), 1, len(grid) - 1)
    lo = hi - 1
    with np.errstate(invalid="ignore"):
        d_lo, d_hi = ref - grid[lo], grid[hi] - ref
    candidates = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, -1))  # -1: a tie, either is fine
    tie = candidates == -1
    dist = np.where(tie, np.minimum(np.abs(got_idx - lo), np.abs(got_idx - hi)), np.abs(got_idx - candidates))
    bad = np.isnan(got) | np.isnan(ref)
    return np.where(bad, np.iinfo(np.int64).max, dist)


def _ulp(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Spacing of `dtype`'s grid just above |values| (the larger neighbour gap), as float64; inf for inf / NaN."""
    grid = _finite_grid(dtype)
    positive = grid[grid >= 0]
    gaps = np.diff(positive)
    gaps = np.append(gaps, gaps[-1])  # the top binade's spacing also above the largest finite value
    idx = np.clip(np.searchsorted(positive, np.abs(values), side="right") - 1, 0, len(gaps) - 1)
    return np.where(np.isfinite(values), gaps[idx], np.inf)


def _where(mask: np.ndarray) -> str:
    idx = np.argwhere(mask)
    return ", ".join(str(tuple(int(i) for i in row)) for row in idx[:5]) + (" ..." if len(idx) > 5 else "")


def _canonical_c(c: Any, ref_shape: Sequence[int], *, c_dtype: Any, c_major: str) -> tuple[np.ndarray, np.dtype]:
    """The operation's C as float64 in the oracle's (L, M, N) layout, and the dtype it was produced in."""
    dtype = np.dtype(c_dtype)
    c = np.asarray(c)
    if dtype in _PACKED_FP4:
        dtype = E2M1
        values = oracle.codes_to_f64(c)
    else:
        if c.dtype != dtype:
            raise AssertionError(f"C has dtype {c.dtype}, expected {dtype}.")
        values = c.astype(np.float64)
    if c_major == "m":
        values = np.swapaxes(values, -1, -2)
    if values.size != int(np.prod(ref_shape)):
        raise AssertionError(f"C has shape {c.shape} (c_major={c_major!r}, {dtype}), which does not match the "
                             f"oracle's (L, M, N) = {tuple(ref_shape)}.")
    return values.reshape(ref_shape), dtype


def assert_gemm_close(test, c, c_ref_f64, *, c_dtype, c_major: str = "n", rtol: Optional[float] = None,
                      magnitude: Optional[np.ndarray] = None) -> None:
    """SPEC §7 for gemm_amax's C against the float64 oracle (L, M, N) (an unbatched (M, N) C is fine too).

    float32: relative Frobenius error <= 1e-5. float16 / bfloat16: every element within one ulp of ref rounded to
    that dtype. FP8 / FP4 (C packed or not): within one code step of ref rounded with saturation. For those three,
    an element whose exact value cancels far below its summands may also be off by the fp32 accumulation error
    the float32 criterion allows (1e-5 x rms(ref)) plus one step. Where the oracle is NaN (a NaN scale) C must be
    NaN too (FP4 C, which has no NaN, is not compared there); NaN elsewhere fails. `rtol` replaces 1e-5
    (GEMM_RTOL) for an implementation of the "tensor-core FP8" class (GEMM_RTOL_TC_FP8). `magnitude`, the oracle of
    |A|·|B|ᵀ: float32's error is measured against its norm instead of ref's, which fp32 sums can miss by far more
    than 1e-5 where a few elements cancel far below their summands (a one-element C).
    """
    rtol = GEMM_RTOL if rtol is None else rtol
    ref = np.asarray(c_ref_f64, np.float64)
    got, dtype = _canonical_c(c, ref.shape, c_dtype=c_dtype, c_major=c_major)
    ref_nan = np.isnan(ref)
    if dtype != E2M1 and not np.array_equal(np.isnan(got), ref_nan):
        wrong = np.isnan(got) != ref_nan
        test.fail(f"C ({dtype}): NaN pattern differs from the oracle at {int(wrong.sum())} of {got.size} elements "
                  f"(first: {_where(wrong)}; C NaN count {int(np.isnan(got).sum())}, oracle NaN count "
                  f"{int(ref_nan.sum())}).")
    keep = ~ref_nan
    if dtype == F32:
        with np.errstate(invalid="ignore", over="ignore"):
            err = np.where(keep, got - ref, 0.0)
            norm = np.linalg.norm(np.where(keep, ref if magnitude is None else magnitude, 0.0))
            rel = np.linalg.norm(err) / max(norm, np.finfo(np.float64).tiny)
        if not rel <= rtol:
            worst = np.unravel_index(np.nanargmax(np.abs(err)), err.shape)
            scale = np.max(np.abs(np.where(keep, ref, 0.0)))
            n_bad = int(np.sum(~(np.abs(err) <= rtol * scale)))
            against = "" if magnitude is None else " (against |A|·|B|ᵀ)"
            test.fail(f"C (float32): relative Frobenius error{against} {rel:.3e} > {rtol:g}; max |error| "
                      f"{np.abs(err)[worst]:.4g} at {tuple(int(i) for i in worst)} (got {got[worst]!r}, oracle "
                      f"{ref[worst]!r}); {n_bad} of {keep.sum()} elements off by more than {rtol:g}·max|ref| "
                      f"= {rtol * scale:.3g}.")
        return
    if dtype not in (F16, BF16, E4M3, E5M2, E2M1):
        raise ValueError(f"assert_gemm_close: unsupported c_dtype {dtype}.")
    saturate = dtype in (E4M3, E5M2, E2M1)
    ref0 = np.where(keep, ref, 0.0)
    dist = _step_distance(got, ref0, dtype, saturate=saturate)
    # An element whose exact value cancels far below its summands carries the fp32 accumulation error of SPEC §7's
    # float32 criterion; it passes if within that error (rtol x rms(ref)) plus one step of the C dtype.
    accumulation_tol = rtol * np.sqrt(np.mean(np.square(ref0)))
    ref_c = np.clip(ref0, *_finite_grid(dtype)[[0, -1]]) if saturate else ref0
    with np.errstate(invalid="ignore", over="ignore"):
        within = np.isfinite(got) & (np.abs(got - ref_c) <= _ulp(got, dtype) + accumulation_tol)
    bad = keep & (dist > 1) & ~within
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(keep, dist, -1)), dist.shape)
        test.fail(f"C ({dtype}): {int(bad.sum())} of {int(keep.sum())} elements are more than one "
                  f"{'code step' if saturate else 'ulp'} from the oracle rounded to {dtype} (first: {_where(bad)}); "
                  f"worst at {tuple(int(i) for i in worst)}: got {got[worst]!r}, oracle {ref[worst]!r}, "
                  f"{int(dist[worst]) if dist[worst] < 2**62 else 'NaN'} steps.")


def assert_amax_close(test, amax, amax_ref, *, rtol: Optional[float] = None) -> None:
    """SPEC §7: |amax - ref| <= 1e-5 · ref, elementwise over (L,) (a scalar amax is checked against max(ref)).

    `rtol` as in assert_gemm_close. NaN passes only where the oracle is NaN too (a NaN in C must poison amax);
    inf must match exactly.
    """
    rtol = GEMM_RTOL if rtol is None else rtol
    got = np.asarray(amax, np.float64)
    ref = np.asarray(amax_ref, np.float64)
    if got.size == 1 and ref.size > 1:
        ref = np.max(ref)  # NaN-propagating, like the operation's reduction
    got, ref = got.reshape(-1), ref.reshape(-1)
    if got.shape != ref.shape:
        test.fail(f"amax has {got.size} values, the oracle {ref.size}.")
    with np.errstate(invalid="ignore"):
        same_special = (np.isnan(got) & np.isnan(ref)) | (np.isinf(ref) & (got == ref))
        close = np.abs(got - ref) <= rtol * np.abs(ref)
    ok = same_special | (np.isfinite(ref) & close)
    if not ok.all():
        i = int(np.argmin(ok))
        test.fail(f"amax differs from the oracle at {int((~ok).sum())} of {ok.size} batch entries; first at {i}: "
                  f"got {got[i]!r}, oracle {ref[i]!r} (relative error "
                  f"{abs(got[i] - ref[i]) / max(abs(ref[i]), 1e-300):.3e}, allowed {rtol:g}).")


def random_gemm_inputs(rng: np.random.Generator, *, l: int, m: int, n: int, k: int, fmt: str, a_major: str = "k",
                       b_major: str = "k", scale_log2: Optional[tuple[float, float]] = None) -> dict:
    """Random codes over the format's whole range and random non-trivial scales for one gemm_amax call.

    scale_log2: the range of log2 of the block scales (default (-9, 9) for E8M0, (-4, 4) for NVFP4's E4M3); pick
    a narrow one to keep C inside a low-precision C dtype's range. Returns a dict with a, b (NumPy arrays in the
    requested majors; FP4 as packed uint8 (L, MN, K//2)), sfa, sfb (compact (L, MN, KB)), sfa_atom, sfb_atom
    (physical atoms built by the SPEC's byte-offset formula), k, sf_vec_size, scale_dtype and alpha (a random
    float32 scalar; meaningful for NVFP4 only).
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}; got {fmt!r}.")
    fp4 = fmt in ("mxfp4", "nvfp4")
    v = 16 if fmt == "nvfp4" else 32
    kb = math.ceil(k / v)

    def codes(mn: int) -> np.ndarray:
        if fp4:
            if k % 2:
                raise ValueError(f"FP4 operands need an even K; got k={k}.")
            return rng.integers(0, 256, size=(l, mn, k // 2), dtype=np.uint8)  # every nibble, both signs
        dtype, limit, spread = (E4M3, 448.0, 6.0) if fmt == "mxfp8_e4m3" else (E5M2, 57344.0, 10.0)
        mag = np.exp2(rng.uniform(-spread, spread, size=(l, mn, k)))
        vals = np.clip(mag * rng.choice([-1.0, 1.0], size=mag.shape), -limit, limit)
        return vals.astype(np.float32).astype(dtype)

    lo, hi = scale_log2 if scale_log2 is not None else ((-4.0, 4.0) if fmt == "nvfp4" else (-9.0, 9.0))

    def scales(mn: int) -> np.ndarray:
        if fmt == "nvfp4":  # random mantissas too
            return np.minimum(np.exp2(rng.uniform(lo, hi, size=(l, mn, kb))), 448.0).astype(E4M3)
        return oracle.random_scale_bytes(rng, (l, mn, kb), lo=127 + math.ceil(lo), hi=127 + math.floor(hi))

    a, b = codes(m), codes(n)
    sfa, sfb = scales(m), scales(n)
    if a_major == "m":
        a = np.ascontiguousarray(np.swapaxes(a, 1, 2))
    if b_major == "n":
        b = np.ascontiguousarray(np.swapaxes(b, 1, 2))
    return dict(a=a, b=b, sfa=sfa, sfb=sfb, sfa_atom=oracle.compact_to_atom_np(sfa),
                sfb_atom=oracle.compact_to_atom_np(sfb), k=k, sf_vec_size=v, scale_dtype=sfa.dtype,
                alpha=np.float32(np.exp2(rng.uniform(-1.0, 1.0))))


# ------------------------------------------------------------------------------------------------------------------
# gemm_proj_rope_mxfp8


def rope_f64(y: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """SPEC §5 step 2 in float64 on (T, H, 192), written out one pair index j at a time."""
    cos = np.asarray(cos).astype(np.float64)
    sin = np.asarray(sin).astype(np.float64)
    out = y.copy()
    for j in range(QK_ROPE // 2):
        p_even, p_odd = y[:, :, QK_NOPE + 2 * j], y[:, :, QK_NOPE + 2 * j + 1]
        out[:, :, QK_NOPE + j] = p_even * cos[:, None, j] - p_odd * sin[:, None, j]
        out[:, :, QK_NOPE + 32 + j] = p_odd * cos[:, None, 32 + j] + p_even * sin[:, None, 32 + j]
    return out


def rope_transpose_f64(d_out: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """The transpose of rope_f64 (RoPE is linear in y): the cotangent of Y before RoPE, one pair index at a time."""
    cos = np.asarray(cos).astype(np.float64)
    sin = np.asarray(sin).astype(np.float64)
    d_y = d_out.copy()
    for j in range(QK_ROPE // 2):
        d_first, d_second = d_out[:, :, QK_NOPE + j], d_out[:, :, QK_NOPE + 32 + j]
        d_y[:, :, QK_NOPE + 2 * j] = d_first * cos[:, None, j] + d_second * sin[:, None, 32 + j]
        d_y[:, :, QK_NOPE + 2 * j + 1] = -d_first * sin[:, None, j] + d_second * cos[:, None, 32 + j]
    return d_y


def proj_rope_oracle(x, w, cos, sin, *, x_scale=None, w_scale=None, w_out_in: bool = True,
                     heads=None) -> np.ndarray:
    """Y after RoPE, before quantization, in float64: (T, H, 192). MXFP8 path when x_scale / w_scale are given.

    `heads` (a list of head indices) computes only those heads, (T, len(heads), 192): for large shapes.
    """
    x, w = np.asarray(x), np.asarray(w)
    if heads is not None:
        rows = np.concatenate([np.arange(h * HEAD_DIM, (h + 1) * HEAD_DIM) for h in heads])
        w = w[rows] if w_out_in else w[:, rows]
        if w_scale is not None:
            w_scale = np.asarray(w_scale)[rows] if w_out_in else np.asarray(w_scale)[:, rows]
    if x_scale is not None:
        x_hat = oracle.dequantize_f64(x, np.asarray(x_scale), block=MX_BLOCK, axis=-1)
        w_hat = oracle.dequantize_f64(w, np.asarray(w_scale), block=MX_BLOCK, axis=-1 if w_out_in else 0)
    else:
        x_hat, w_hat = x.astype(np.float64), w.astype(np.float64)
    if not w_out_in:
        w_hat = w_hat.T
    y = x_hat @ w_hat.T
    t, n = y.shape
    return rope_f64(y.reshape(t, n // HEAD_DIM, HEAD_DIM), cos, sin)


def _e4m3_step(code_values: np.ndarray) -> np.ndarray:
    """Spacing of E4M3 codes at each magnitude (the larger one at a power of two): 2**(e-3), 2**-9 subnormal."""
    a = np.abs(code_values)
    e = np.floor(np.log2(np.maximum(a, 2.0 ** -6)))
    return np.exp2(e - 3)


def _near_power_of_two_boundary(amax: np.ndarray, emax: float, rtol: float) -> np.ndarray:
    """Whether amax / emax lies within rtol of a power of two, where the ceil rule's exponent jumps."""
    with np.errstate(divide="ignore"):
        ratio = amax / emax
        nearest = np.exp2(np.round(np.log2(np.where(ratio > 0, ratio, 1.0))))
    return (amax > 0) & (np.abs(ratio / nearest - 1.0) <= rtol)


PROJ_ROPE_BOUNDARY_RTOL = 1e-4  # "within fp32 rounding" of a scale boundary, for fp32 GEMMs with K in the thousands
PROJ_ROPE_MIN_IDENTICAL = 0.99


def assert_quantized_close(test, what: str, codes, scale_bytes, y_ref: np.ndarray, axis: int) -> None:
    codes, scale_bytes = np.asarray(codes), np.asarray(scale_bytes)
    ref_codes, ref_bytes = oracle.quantize_mx_f64(y_ref, block=MX_BLOCK, emax=448.0, code_dtype=E4M3, axis=axis)
    if codes.dtype != E4M3 or codes.shape != ref_codes.shape:
        test.fail(f"{what}: codes are {codes.dtype}{codes.shape}, expected float8_e4m3fn{ref_codes.shape}.")
    if scale_bytes.dtype != np.uint8 or scale_bytes.shape != ref_bytes.shape:
        test.fail(f"{what}: scales are {scale_bytes.dtype}{scale_bytes.shape}, expected uint8{ref_bytes.shape}.")
    got_codes = codes.astype(np.float64)
    n_nan, n_nan_scale = int(np.isnan(got_codes).sum()), int((scale_bytes == 0xFF).sum())
    if n_nan or n_nan_scale:
        test.fail(f"{what}: {n_nan} NaN codes (first: {_where(np.isnan(got_codes))}) and {n_nan_scale} NaN scale "
                  f"bytes (first: {_where(scale_bytes == 0xFF)}) for a finite oracle.")
    # scale bytes: equal, or one apart where the oracle's block amax sits on a power-of-two boundary
    blocks = np.moveaxis(y_ref, axis, -1)
    block_amax = np.max(np.abs(blocks.reshape(*blocks.shape[:-1], -1, MX_BLOCK)), axis=-1)
    block_amax = np.moveaxis(block_amax, -1, axis)
    diff = scale_bytes.astype(np.int64) - ref_bytes.astype(np.int64)
    excused = _near_power_of_two_boundary(block_amax, 448.0, PROJ_ROPE_BOUNDARY_RTOL) & (np.abs(diff) == 1)
    wrong = (diff != 0) & ~excused
    if wrong.any():
        i = tuple(int(v) for v in np.argwhere(wrong)[0])
        test.fail(f"{what}: {int(wrong.sum())} of {wrong.size} scale bytes differ from the oracle away from a "
                  f"power-of-two boundary (first: {_where(wrong)}); at {i}: got {scale_bytes[i]}, oracle "
                  f"{ref_bytes[i]}, block amax {block_amax[i]!r}.")
    # every dequantized element within one E4M3 step (of its block scale) of the oracle's
    got_scale = np.repeat(oracle.scales_to_f64(scale_bytes), MX_BLOCK, axis=axis)
    ref_scale = np.repeat(oracle.scales_to_f64(ref_bytes), MX_BLOCK, axis=axis)
    ref_vals = ref_codes.astype(np.float64)
    got_deq, ref_deq = got_codes * got_scale, ref_vals * ref_scale
    step = np.maximum(_e4m3_step(got_codes) * got_scale, _e4m3_step(ref_vals) * ref_scale)
    err = np.abs(got_deq - ref_deq)
    far = err > step
    if far.any():
        worst = np.unravel_index(np.argmax(err / step), err.shape)
        test.fail(f"{what}: {int(far.sum())} of {far.size} dequantized elements are more than one E4M3 step from "
                  f"the oracle (first: {_where(far)}); worst at {tuple(int(i) for i in worst)}: got "
                  f"{got_deq[worst]!r}, oracle {ref_deq[worst]!r}, step {step[worst]!r}, unquantized "
                  f"{y_ref[worst]!r}.")
    identical = float(np.mean(got_codes == ref_vals))
    if identical < PROJ_ROPE_MIN_IDENTICAL:
        test.fail(f"{what}: only {identical:.2%} of codes equal the oracle's (need "
                  f"{PROJ_ROPE_MIN_IDENTICAL:.0%}); first differing: {_where(got_codes != ref_vals)}.")


def assert_proj_rope_close(test, outputs, y_ref_f64) -> None:
    """SPEC §7 for (out_fp8_row, out_scales_row, out_fp8_col, out_scales_col) against the float64 Y after RoPE.

    The oracle quantizes y_ref by SPEC §2 both ways; every dequantized element must be within one E4M3 step of
    its block scale, scale bytes equal except (by one) where the block amax is within 1e-4 of a power-of-two
    boundary, at least 99% of codes identical, no NaN codes or scale bytes.
    """
    row_codes, row_scales, col_codes, col_scales = outputs
    y_ref = np.asarray(y_ref_f64, np.float64)
    if np.isnan(y_ref).any():
        raise ValueError("assert_proj_rope_close: the oracle holds NaN; these checks are for finite inputs.")
    assert_quantized_close(test, "rowwise", row_codes, row_scales, y_ref, axis=2)
    assert_quantized_close(test, "columnwise", col_codes, col_scales, y_ref, axis=0)


def rotary_tables(t: int, *, base: float = 10000.0, scale: float = 40.0) -> tuple[np.ndarray, np.ndarray]:
    """Real bf16 cos/sin tables (T, 64) in the DeepSeek-V3 layout: 32 frequencies, repeated for the two halves.

    YaRN-style: positions divided by `scale` on the low frequencies (long context), unchanged on the high ones.
    """
    inv_freq = 1.0 / (base ** (np.arange(0, QK_ROPE, 2) / QK_ROPE))
    ramp = np.clip((np.arange(QK_ROPE // 2) - 8) / 16, 0.0, 1.0)  # 0: keep high frequencies, 1: interpolate
    inv_freq = inv_freq * (1 - ramp) + inv_freq / scale * ramp
    angles = np.outer(np.arange(t), inv_freq)
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles).astype(BF16), np.sin(angles).astype(BF16)


def random_proj_rope_inputs(rng: np.random.Generator, *, t: int, h: int, k: int, mxfp8: bool,
                            w_out_in: bool = True) -> dict:
    """Random x, w, cos, sin (and x_scale, w_scale on the MXFP8 path, random E8M0 bytes) as NumPy arrays.

    w is (H*192, K) for w_out_in, else (K, H*192); w_scale is laid out like w. cos/sin come from random angles.
    """
    n = h * HEAD_DIM
    angles = rng.uniform(-np.pi, np.pi, size=(t, QK_ROPE))
    out = dict(cos=np.cos(angles).astype(BF16), sin=np.sin(angles).astype(BF16), x_scale=None, w_scale=None)
    if mxfp8:
        kb = k // MX_BLOCK
        x = np.clip(rng.standard_normal((t, k)) * 32.0, -448, 448).astype(np.float32).astype(E4M3)
        w = np.clip(rng.standard_normal((n, k)) * 32.0, -448, 448).astype(np.float32).astype(E4M3)
        x_scale = oracle.random_scale_bytes(rng, (t, kb), lo=119, hi=127)
        w_scale = oracle.random_scale_bytes(rng, (n, kb), lo=119, hi=127)
        if not w_out_in:
            w, w_scale = np.ascontiguousarray(w.T), np.ascontiguousarray(w_scale.T)
        out.update(x=x, w=w, x_scale=x_scale, w_scale=w_scale)
    else:
        x = (rng.standard_normal((t, k)) * 2.0).astype(BF16)
        w = (rng.standard_normal((n, k)) / math.sqrt(k)).astype(BF16)
        out.update(x=x, w=w if w_out_in else np.ascontiguousarray(w.T))
    return out


# ------------------------------------------------------------------------------------------------------------------
# mx_dot_general: the straight-through rule of jax_blockgemm.autodiff in float64


MX_DOT_K_MULTIPLE = 32  # a GEMM whose contraction length is not a multiple of this runs as a bf16 dot
_NVFP4_TENSOR_MAX = np.float32(6.0 * 448.0)


def nvfp4_tensor_factors(x: np.ndarray) -> tuple[np.float32, np.float32]:
    """NVFP4's per-tensor float32 (encode, alpha): encode = 6 * 448 / max|x| rounded to float32 (1 if max|x| is 0
    or not finite), alpha = 1 / encode rounded to float32. x is quantized as the float32 product x * encode."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        encode = _NVFP4_TENSOR_MAX / np.float32(np.max(np.abs(np.asarray(x).astype(np.float32))))
    encode = encode if np.isfinite(encode) and encode > 0 else np.float32(1.0)
    return np.float32(encode), np.float32(1.0) / np.float32(encode)


def fake_quant_f64(x: np.ndarray, fmt: str, axis: int) -> np.ndarray:
    """float64 dequantized values of x block-quantized along `axis` in `fmt` (SPEC §2), or rounded to bf16.

    NVFP4 first multiplies by the per-tensor float32 factor encode = 6 * 448 / max|x| (1 if max|x| is 0), in
    float32 as the library does (`nvfp4_tensor_factors`), and the values come back times 1 / encode.
    """
    x = np.asarray(x)
    if fmt == "bf16":
        return x.astype(BF16).astype(np.float64)
    if fmt == "nvfp4":
        encode, alpha = nvfp4_tensor_factors(x)
        codes, scales = oracle.quantize_nvfp4_f64(x.astype(np.float32) * encode, axis=axis)
        return oracle.dequantize_f64(codes, scales, block=16, axis=axis) * np.float64(alpha)
    code_dtype, emax, block = {"mxfp8_e4m3": (E4M3, 448.0, 32), "mxfp8_e5m2": (E5M2, 57344.0, 32),
                               "mxfp4": (E2M1, 6.0, 32)}[fmt]
    codes, scales = oracle.quantize_mx_f64(x, block=block, emax=emax, code_dtype=code_dtype, axis=axis)
    return oracle.dequantize_f64(codes, scales, block=block, axis=axis)


# Per format: (u, eps) with |dequantized - v| <= u |v| + eps * (amax of v's block) for every element v.
# u = 2**-(mantissa bits + 1) is round-to-nearest's relative error on normal codes; below the smallest normal code
# N_min the error is at most u * N_min * scale, and the ceil rule keeps scale < 2 * block amax / Emax, so
# eps = 2 u N_min / Emax: 2**-4 * 2**-6 * 2/448 (E4M3), ~0 (E5M2), 1/12 (E2M1; NVFP4's E4M3 block scale, rounded up
# at most twice by 2**-3, is below 2 * amax / 6 too). bf16 (the fallback, 7 mantissa bits) rounds within 2**-8 in
# its normal range.
QUANT_ERROR = {"mxfp8_e4m3": (2.0 ** -4, 2.0 ** -9 / 448.0), "mxfp8_e5m2": (2.0 ** -3, 2.0 ** -16 / 57344.0),
               "mxfp4": (0.25, 1.0 / 12.0), "nvfp4": (0.25, 1.0 / 12.0), "bf16": (2.0 ** -8, 0.0)}
ACCUMULATION_SLACK = 1e-6  # float32 accumulation over K <= a few thousand, relative to sum |a| |b|


def _block_amax(x: np.ndarray, axis: int, block: int) -> np.ndarray:
    """max |x| over each element's block along `axis`, broadcast back to x's shape."""
    xb, n = oracle._blocks(np.abs(x), axis, block)
    amax = np.broadcast_to(np.max(xb, axis=-1, keepdims=True), xb.shape)
    return oracle._unblocks(amax, n, axis)


def _gemm_f64(a: np.ndarray, a_axis: int, b: np.ndarray, b_axis: int, fmt: str
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One GEMM on 3-D operands contracted over a_axis / b_axis: (rule value, exact value, error bound), each
    (B, rows of a, rows of b). A contraction length off the multiple of 32 takes the bf16 rule."""
    if a.shape[a_axis] % MX_DOT_K_MULTIPLE:
        fmt = "bf16"
    u, eps = QUANT_ERROR[fmt]
    block = 16 if fmt == "nvfp4" else 32
    dot = lambda p, q: np.einsum("bmk,bnk->bmn", np.moveaxis(p, a_axis, 2), np.moveaxis(q, b_axis, 2))
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err_a = u * np.abs(a) + eps * _block_amax(a, a_axis, block)
    err_b = u * np.abs(b) + eps * _block_amax(b, b_axis, block)
    bound = dot(err_a, np.abs(b)) + dot(np.abs(a), err_b) + dot(err_a, err_b) + \
        ACCUMULATION_SLACK * dot(np.abs(a), np.abs(b))
    return dot(fake_quant_f64(a, fmt, a_axis), fake_quant_f64(b, fmt, b_axis)), dot(a, b), bound


def _to_bfk(x: np.ndarray, batch, contract) -> tuple[np.ndarray, tuple[int, ...], tuple[int, ...]]:
    """x transposed to (batch, free, contract) and reshaped to (B, F, K); also the permutation and that shape."""
    free = [d for d in range(x.ndim) if d not in batch and d not in contract]
    perm = (*batch, *free, *contract)
    xt = np.transpose(x, perm)
    size = lambda dims: int(np.prod([x.shape[d] for d in dims], dtype=np.int64))
    return xt.reshape(size(batch), size(free), size(contract)), perm, xt.shape


def mx_dot_general_oracle(lhs, rhs, dimension_numbers, g, *, fwd: str, dgrad: str, wgrad: str) -> dict:
    """mx_dot_general's straight-through rule in float64, for the cotangent g.

    out = Q_K(lhs)·Q_K(rhs); d_lhs = Q_N(g)·Q_N(rhs); d_rhs = Q_M(g)ᵀ·Q_M(lhs), each operand block-quantized along
    the contraction of its own GEMM (a GEMM with a contraction length off the multiple of 32 rounds to bf16
    instead). Returns {"out" | "d_lhs" | "d_rhs": (rule value, exact unquantized value, elementwise bound on
    |rule - exact|), "amaxes": max|.| of the three rule values}.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    x, x_perm, x_shape = _to_bfk(lhs, lb, lc)
    w, w_perm, w_shape = _to_bfk(rhs, rb, rc)
    y = _gemm_f64(x, 2, w, 2, fwd)
    g3 = np.asarray(g, np.float64).reshape(y[0].shape)
    dx = _gemm_f64(g3, 2, w, 1, dgrad)
    dw = _gemm_f64(g3, 1, x, 1, wgrad)
    out_shape = (*[lhs.shape[d] for d in lb], *x_shape[len(lb):len(x_shape) - len(lc)],
                 *w_shape[len(rb):len(w_shape) - len(rc)])
    back = lambda v, shape, perm: np.transpose(v.reshape(shape), np.argsort(perm))
    return {"out": tuple(v.reshape(out_shape) for v in y),
            "d_lhs": tuple(back(v, x_shape, x_perm) for v in dx),
            "d_rhs": tuple(back(v, w_shape, w_perm) for v in dw),
            "amaxes": np.array([np.max(np.abs(v[0])) for v in (y, dx, dw)])}


def assert_within_bound(test, what: str, got, exact, bound) -> None:
    """|got - exact| <= bound elementwise (float64), no NaN."""
    got = np.asarray(got, np.float64)
    test.assertEqual(got.shape, exact.shape, f"{what}: shape")
    err = np.abs(got - exact)
    bad = ~(err <= bound)  # NaN fails
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err / np.maximum(bound, 1e-300), 0)), err.shape)
        test.fail(f"{what}: {int(bad.sum())} of {bad.size} elements exceed the quantization error bound; worst at "
                  f"{tuple(int(v) for v in i)}: |got - exact| = {err[i]!r} > bound {bound[i]!r}.")


def assert_rel_close(test, what: str, got, ref, rtol: float) -> float:
    """‖got − ref‖ / ‖ref‖ ≤ rtol (Frobenius), shapes equal, no NaN anywhere; returns the relative error."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    test.assertEqual(got.shape, ref.shape, f"{what}: shape")
    if np.isnan(got).any() or np.isnan(ref).any():
        test.fail(f"{what}: NaN in the result ({int(np.isnan(got).sum())}) or the oracle ({int(np.isnan(ref).sum())}).")
    err = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300))
    test.assertLessEqual(err, rtol, f"{what}: relative error {err:.3g} > {rtol:.3g}")
    return err
