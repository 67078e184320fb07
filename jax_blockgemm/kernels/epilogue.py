"""Epilogue math every architecture shares: RoPE on accumulator values, block amax across lanes, E8M0 scales and
E4M3 codes (SPEC §2, §5). Plain `@cute.jit` functions on fp32 registers, so a Hopper kernel (wgmma fragments) and a
Blackwell kernel (tensor-memory loads) call the same code and only their accumulator access differs.

Amaxes travel as the integer bits of |x| (`common.abs_bits`): non-negative floats order like integers and every
NaN beats +inf, so an integer max is a NaN-propagating float max.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_blockgemm import formats
from jax_blockgemm.kernels import common, ptx_ops

F32_INF_BITS = 0x7F800000  # |x| bits at or above this: inf or NaN
E8M0_NAN = 0xFF
# (exponent, mantissa field) of each FP8 code format's largest finite value: the E8M0 scale rule's constants
_EMAX_BITS = {"e4m3": formats.float32_exponent_mantissa(formats.emax(formats.E4M3)),
              "e5m2": formats.float32_exponent_mantissa(formats.emax(formats.E5M2))}


@cute.jit
def rope_pair(p_even: cutlass.Float32, p_odd: cutlass.Float32, cos_lo: cutlass.Float32, sin_lo: cutlass.Float32,
              cos_hi: cutlass.Float32, sin_hi: cutlass.Float32):
    """SPEC §5 RoPE of one interleaved pair (p[2j], p[2j+1]) -> (out[128+j], out[160+j]), all in fp32.

    cos_lo/sin_lo are cos[t, j]/sin[t, j]; cos_hi/sin_hi are cos[t, 32+j]/sin[t, 32+j].
    """
    return p_even * cos_lo - p_odd * sin_lo, p_odd * cos_hi + p_even * sin_hi


@cute.jit
def e8m0_scale(amax_bits: cutlass.Int32, fmt: cutlass.Constexpr = "e4m3"):
    """E8M0 byte of a block whose max |x| has bits `amax_bits` (SPEC §2, codes of `fmt`: "e4m3" or "e5m2"), and the
    factor to multiply by.

    Returns (byte, inv, bad): byte = ceil(log2(amax/emax)) + 127 clamped to [0, 254] (0 for zero and subnormal amax;
    the rule of `formats.scale_exponent`, computed on the bits, no log2), 0xFF when the block holds NaN or inf
    (`bad`, whose codes must be zero); inv = 2^-e as fp32 (2^127 for byte 0, never subnormal: a finite fp32 amax gives
    e <= 120).
    """
    emax_exp, emax_man = _EMAX_BITS[fmt]
    biased = amax_bits >> 23
    byte = biased - emax_exp + cutlass.Int32((amax_bits & 0x7FFFFF) > emax_man)
    byte = cutlass.min(cutlass.max(byte, 0), 254)
    bad = amax_bits >= F32_INF_BITS
    inv, _ = e8m0_inverse(byte)
    if bad:
        byte = cutlass.Int32(E8M0_NAN)
    return byte, inv, bad


@cute.jit
def e8m0_inverse(byte: cutlass.Int32):
    """(inv, bad) of an E8M0 byte made by `e8m0_scale`: inv = 2^-(byte-127) as fp32 (the factor `e8m0_scale`
    returns with it), bad = byte is 0xFF (a NaN/inf block, whose codes must be zero; inv is then meaningless).

    For a lane that received another lane's scale byte (one shuffle instead of three).
    """
    return common.f32_from_bits((254 - byte) << 23), byte == E8M0_NAN


@cute.jit
def warp_column_max(bits: cute.Tensor, lane: cutlass.Int32) -> cutlass.Int32:
    """Max over the 32 lanes of a warp of column `lane`, where bits[i] of lane l is row l, column i (32 columns).

    The transposing butterfly: at the step of offset o (16, 8, 4, 2, 1) a lane keeps the half of its remaining
    columns whose bit o matches its own lane bit o, sends the other half to lane ^ o, and takes the max with what
    it receives. 31 shuffles per 32 columns (a `lane_max` per column takes 160), and the result of column c lands
    in lane c. `bits` is overwritten.
    """
    for step in cutlass.range_constexpr(5):
        o = 16 >> step
        upper = (lane & o) != 0
        for i in cutlass.range_constexpr(o):
            keep = cutlass.Int32(cutlass.select_(upper, bits[i + o], bits[i]))
            send = cutlass.Int32(cutlass.select_(upper, bits[i], bits[i + o]))
            bits[i] = cutlass.max(keep, cute.arch.shuffle_sync_bfly(send, offset=o))
    return bits[0]


@dsl_user_op
def fp8x2(lo: cutlass.Float32, hi: cutlass.Float32, fmt: str, *, loc=None, ip=None) -> cutlass.Int32:
    """Two FP8 codes of `fmt` ("e4m3" or "e5m2") as hi << 8 | lo: round-to-nearest-even, saturated to the largest
    finite value (+-448 / +-57344, also for +-inf), NaN kept (SPEC §4's FP8 C conversion)."""
    if fmt not in ("e4m3", "e5m2"):
        raise ValueError(f"fmt={fmt!r} is not supported; expected 'e4m3' or 'e5m2'")
    return cutlass.Int32(ptx_ops.asm(
        T.i32(), [cutlass.Float32(hi), cutlass.Float32(lo)],
        f"{{ .reg .b16 t; cvt.rn.satfinite.{fmt}x2.f32 t, $1, $2; cvt.u32.u16 $0, t; }}", "=r,f,f", False, loc, ip))


@dsl_user_op
def bf16x2(lo: cutlass.Float32, hi: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Int32:
    """Two bf16 values, round-to-nearest-even, as hi << 16 | lo (NaN kept)."""
    return cutlass.Int32(ptx_ops.asm(T.i32(), [cutlass.Float32(hi), cutlass.Float32(lo)],
                                     "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", False, loc, ip))


@dsl_user_op
def e4m3x4(a: cutlass.Float32, b: cutlass.Float32, c: cutlass.Float32, d: cutlass.Float32, *, loc=None,
           ip=None) -> cutlass.Int32:
    """Four E4M3 codes (as `fp8x2`) packed as the bytes of one word, a lowest: two conversions and a move."""
    return cutlass.Int32(ptx_ops.asm(
        T.i32(), [cutlass.Float32(x) for x in (b, a, d, c)], "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, "
        "$1, $2; cvt.rn.satfinite.e4m3x2.f32 hi, $3, $4; mov.b32 $0, {lo, hi}; }", "=r,f,f,f,f", False, loc, ip))


@dsl_user_op
def nan_abs_max(a: cutlass.Float32, b: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Float32:
    """max(|a|, |b|), NaN if either is NaN (`max.NaN`; ptxas folds the two `abs` into the FMNMX operands). The
    fp32 bits of a block's fold of it are the amax bits `e8m0_scale` takes: finite, inf, or a NaN's (>= inf's)."""
    return cutlass.Float32(ptx_ops.asm(
        T.f32(), [cutlass.Float32(x) for x in (a, b)],
        "{ .reg .f32 x, y; abs.f32 x, $1; abs.f32 y, $2; max.NaN.f32 $0, x, y; }", "=f,f,f", False, loc, ip))


def amax_tree(vals: list, lanes: int = 4) -> cutlass.Float32:
    """max |v| over `vals` (fp32, NaN-propagating) with `nan_abs_max`: `lanes` interleaved running maxima, then
    their fold, so the chain is len/lanes + log2(lanes) deep while only `lanes` temporaries are live."""
    if len(vals) == 1:
        return nan_abs_max(vals[0], vals[0])
    lanes = min(lanes, len(vals) // 2)
    acc = [nan_abs_max(vals[j], vals[j + lanes]) for j in range(lanes)]
    for i in range(2 * lanes, len(vals)):
        acc[i % lanes] = nan_abs_max(acc[i % lanes], vals[i])
    while len(acc) > 1:
        acc = [nan_abs_max(acc[i], acc[i + 1]) if i + 1 < len(acc) else acc[i] for i in range(0, len(acc), 2)]
    return acc[0]


@cute.jit
def byte_mask(bits4: cutlass.Int32) -> cutlass.Int32:
    """0xFF in byte k of the result where bit k of `bits4` is set (k < 4; higher bits are ignored): the codes of a
    word that belong to NaN/inf blocks, from a warp ballot of the blocks' `bad` flags."""
    return (((bits4 & 0xF) * 0x00204081) & 0x01010101) * 0xFF


# E2M1 rounding thresholds on |x| (SPEC §1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6): the code is the number of
# thresholds |x| passes. Ties go to the even code: a midpoint below an odd code is passed only when strictly
# exceeded (0.25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4), one below an even code already when reached (0.75 -> 1,
# 1.75 -> 2, 3.5 -> 4). Everything above 5 gives 6: saturation, inf included.
E2M1_STRICT = (0.25, 1.25, 2.5, 5.0)
E2M1_INCLUSIVE = (0.75, 1.75, 3.5)


@cute.jit
def e2m1_nibble(x: cutlass.Float32) -> cutlass.Int32:
    """The E2M1 code of x (round-to-nearest-even, saturated to +-6) as a nibble (bit 3 = sign). NaN gives a
    signed zero; SPEC leaves FP4 of NaN open (the format has none). sm_90 has no FP4 conversion instruction."""
    bits = common.bits_from_f32(x)
    a = common.f32_from_bits(bits & common.F32_ABS_MASK)
    code = cutlass.Int32(0)
    for t in cutlass.range_constexpr(len(E2M1_STRICT)):
        code = code + cutlass.Int32(a > cutlass.Float32(E2M1_STRICT[t]))
    for t in cutlass.range_constexpr(len(E2M1_INCLUSIVE)):
        code = code + cutlass.Int32(a >= cutlass.Float32(E2M1_INCLUSIVE[t]))
    return code | ((bits >> 28) & 8)
