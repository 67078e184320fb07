"""Number formats, block quantizers and scale-factor layouts (SPEC §1-§3), in pure, jit-able JAX.

Every other part of the library (the XLA reference, the primitives, the kernels' host code, the public API) takes
its formats from here, so that the quantization rule and the 128x4 scale atom exist in exactly one place.

Conventions:
  * E8M0 scales travel as raw ``uint8`` bytes (byte b means 2**(b - 127); 0xFF is NaN). Functions that read
    scales also accept ``float8_e8m0fnu`` arrays, which are bit-cast.
  * FP4 codes are ``float4_e2m1fn`` arrays, or ``uint8`` containers with two codes per byte along the LAST axis,
    element 2i in the low nibble.
  * Blocks run along one axis (``axis``, default -1); a length that is not a multiple of the block gets a partial
    last block, and the scale array has ``ceil(n / block)`` entries along that axis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Iterator, Literal, Union

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "E4M3", "E5M2", "E2M1", "E8M0", "BlockFormat", "MXFP8_E4M3", "MXFP8_E5M2", "MXFP4", "NVFP4", "FORMATS",
    "emax", "SCALE_RULE", "set_scale_rule", "scale_rule", "get_scale_rule", "scale_exponent", "e8m0_to_float32",
    "exponent_to_e8m0", "mx_block_exponents", "mx_encode_blocks", "round_to_grid", "round_to_e2m1", "pack_fp4",
    "unpack_fp4", "unpacked_codes", "quantize_mxfp8", "quantize_mxfp4", "quantize_nvfp4", "nvfp4_tensor_scales",
    "NVFP4_TENSOR_MAX", "quantize_dequantize",
    "dequantize",
    "scales_to_float32", "num_blocks", "atom_shape", "to_scale_atom", "from_scale_atom", "atom_to_seed_view",
    "seed_view_to_atom",
]

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
E2M1 = jnp.float4_e2m1fn
E8M0 = jnp.float8_e8m0fnu

E8M0_NAN = 0xFF  # the E8M0 NaN byte: marks blocks that held a NaN or an inf
E8M0_BIAS = 127
_E4M3_NAN = 0x7F  # the positive E4M3 NaN (NVFP4's scale for a block holding a NaN or an inf)
_E_MIN, _E_MAX = -127, 127  # representable finite E8M0 exponents

_EMAX = {np.dtype(E4M3): 448.0, np.dtype(E5M2): 57344.0, np.dtype(E2M1): 6.0}
_MX_CODE_DTYPES = (np.dtype(E4M3), np.dtype(E5M2))
_SCALE_DTYPES = (np.dtype(jnp.uint8), np.dtype(E8M0), np.dtype(E4M3))

DTypeLike = Union[str, type, np.dtype]


def _dtype_name(dtype: DTypeLike) -> str:
    return np.dtype(dtype).name


# ----------------------------------------------------------------------------------------------------------------
# Formats


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: element codes, the kind of per-block scale and the block length (sf_vec_size)."""

    name: str
    code_dtype: np.dtype
    scale_kind: Literal["e8m0", "e4m3"]
    block: int
    emax: float

    @property
    def scale_dtype(self) -> np.dtype:
        """The dtype the quantizers return scales in: uint8 bytes for E8M0, float8_e4m3fn for NVFP4."""
        return np.dtype(jnp.uint8) if self.scale_kind == "e8m0" else np.dtype(E4M3)

    @property
    def is_fp4(self) -> bool:
        return self.code_dtype == np.dtype(E2M1)


MXFP8_E4M3 = BlockFormat("mxfp8_e4m3", np.dtype(E4M3), "e8m0", 32, 448.0)
MXFP8_E5M2 = BlockFormat("mxfp8_e5m2", np.dtype(E5M2), "e8m0", 32, 57344.0)
MXFP4 = BlockFormat("mxfp4", np.dtype(E2M1), "e8m0", 32, 6.0)
NVFP4 = BlockFormat("nvfp4", np.dtype(E2M1), "e4m3", 16, 6.0)
FORMATS = {f.name: f for f in (MXFP8_E4M3, MXFP8_E5M2, MXFP4, NVFP4)}


def emax(dtype: DTypeLike) -> float:
    """Largest finite magnitude of a code dtype: 448 (E4M3), 57344 (E5M2), 6 (E2M1)."""
    try:
        return _EMAX[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise ValueError(f"emax: dtype must be one of float8_e4m3fn, float8_e5m2, float4_e2m1fn; got {dtype!r}.")


# ----------------------------------------------------------------------------------------------------------------
# The scale-exponent rule (the one switchable place)

_RULES = ("ceil", "floor")
SCALE_RULE: str = "ceil"


def get_scale_rule() -> str:
    """The rule in force: "ceil" (SPEC §2, the default) or "floor" (OCP MX v1.0)."""
    return SCALE_RULE


def set_scale_rule(rule: str) -> None:
    """Switch the scale-exponent rule process-wide. It is read at trace time: jitted functions keep their rule."""
    global SCALE_RULE
    if rule not in _RULES:
        raise ValueError(f"rule must be one of {_RULES}; got {rule!r}.")
    SCALE_RULE = rule


@contextlib.contextmanager
def scale_rule(rule: str) -> Iterator[None]:
    """Use `rule` inside a ``with`` block and restore the previous one afterwards (also on error)."""
    previous = SCALE_RULE
    set_scale_rule(rule)
    try:
        yield
    finally:
        set_scale_rule(previous)


def _resolve_rule(rule: str | None) -> str:
    rule = SCALE_RULE if rule is None else rule
    if rule not in _RULES:
        raise ValueError(f"rule must be one of {_RULES} or None; got {rule!r}.")
    return rule


def float32_exponent_mantissa(emax_value: float) -> tuple[int, int]:
    """Unbiased exponent and 23-bit mantissa field of a positive normal float32 constant (checked exact)."""
    bits = int(np.array(emax_value, np.float32).view(np.uint32))
    if float(np.float32(emax_value)) != emax_value or not (bits >> 23) or emax_value <= 0:
        raise ValueError(f"emax must be a positive float32-exact normal number; got {emax_value!r}.")
    return (bits >> 23) - 127, bits & 0x7FFFFF


def scale_exponent(amax: jax.Array, emax: float, *, rule: str | None = None) -> jax.Array:
    """int32 scale exponent of each block amax, computed exactly on the float32 bits (no log2).

    "ceil" (SPEC §2): the smallest e with amax <= emax * 2**e. "floor" (OCP): floor(log2 amax) - floor(log2 emax).
    Both are clamped to [-127, 127]. amax == 0 (and float32 subnormals, which always clamp) give -127, i.e. byte 0;
    NaN or inf give 128, i.e. the NaN byte 0xFF once 127 is added. `rule=None` uses the process-wide SCALE_RULE.
    """
    rule = _resolve_rule(rule)
    emax_exp, emax_man = float32_exponent_mantissa(float(emax))
    bits = jax.lax.bitcast_convert_type(jnp.asarray(amax, jnp.float32), jnp.int32) & 0x7FFFFFFF  # |amax|, exactly
    biased = bits >> 23
    mantissa = bits & 0x7FFFFF
    e = biased - 127 - emax_exp
    if rule == "ceil":
        # amax = (1.m_a) 2**ea, emax = (1.m_e) 2**ee: amax/emax lies in (2**(ea-ee-1), 2**(ea-ee)] iff m_a <= m_e.
        e = e + (mantissa > emax_man).astype(jnp.int32)
    e = jnp.clip(e, _E_MIN, _E_MAX)
    e = jnp.where(biased == 0, _E_MIN, e)  # zero and subnormals
    return jnp.where(biased == 255, _E_MAX + 1, e).astype(jnp.int32)


def _exp2(e: jax.Array) -> jax.Array:
    """Exact float32 2**e for integer e in [-127, 127], built from bits (2**-127 is a float32 subnormal)."""
    e = e.astype(jnp.int32)
    normal = jax.lax.shift_left(e + 127, jnp.int32(23))
    bits = jnp.where(e == -127, jnp.int32(0x00400000), normal)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _scale_by_exp2(v: jax.Array, neg_e: jax.Array) -> jax.Array:
    """v * 2**neg_e for neg_e in [-127, 127], exact wherever the result is >= 2**-126 (smaller ones give +-0).

    Uses two normal power-of-two factors, and rebuilds float32 subnormal inputs from their integer mantissa, so
    the result does not depend on whether the backend flushes denormals (XLA:CPU does, XLA:GPU does not).
    """
    half = neg_e // 2
    normal = v * _exp2(half) * _exp2(neg_e - half)
    bits = jax.lax.bitcast_convert_type(v, jnp.int32)
    is_sub = (bits & 0x7F800000) == 0
    k = neg_e - 149  # a subnormal v is mantissa * 2**-149
    sub = (bits & 0x7FFFFF).astype(jnp.float32) * _exp2(jnp.clip(k, -126, 127))
    sub = jnp.copysign(jnp.where(k >= -126, sub, 0.0), v)
    return jnp.where(is_sub, sub, normal)


def magnitude_bits(x: jax.Array) -> jax.Array:
    """|x| as float32 bits in an int32, whose integer order is NaN > inf > every finite value (see magnitude_max)."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) & 0x7FFFFFFF


def magnitude_max(x: jax.Array, axis: int | tuple[int, ...] | None = -1, *, keepdims: bool = False) -> jax.Array:
    """max |x| along `axis` as float32, taken on the integer bits: NaN > inf > every finite value on every
    backend (XLA:CPU's vectorized float max can drop NaN), exact for subnormals (denormal-flush proof)."""
    return jax.lax.bitcast_convert_type(jnp.max(magnitude_bits(x), axis=axis, keepdims=keepdims), jnp.float32)


def e8m0_to_float32(scale: jax.Array) -> jax.Array:
    """Decode E8M0 scales (uint8 bytes or float8_e8m0fnu) to float32: 2**(b-127); 0xFF -> NaN; 0 -> 2**-127.

    2**-127 is a float32 subnormal: backends that flush denormals (XLA:CPU) treat it as 0 in later arithmetic
    (`times_block_scales` multiplies codes by scales exactly there too).
    """
    scale = jnp.asarray(scale)
    if scale.dtype == np.dtype(E8M0):
        scale = jax.lax.bitcast_convert_type(scale, jnp.uint8)
    elif scale.dtype != np.dtype(jnp.uint8):
        raise TypeError(f"e8m0_to_float32: scale must be uint8 or float8_e8m0fnu; got {_dtype_name(scale.dtype)}.")
    b = scale.astype(jnp.int32)
    bits = jnp.where(b == 0, jnp.int32(0x00400000), jax.lax.shift_left(b, jnp.int32(23)))
    bits = jnp.where(b == E8M0_NAN, jnp.int32(0x7FC00000), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def exponent_to_e8m0(e: jax.Array) -> jax.Array:
    """uint8 E8M0 byte of an int32 exponent from `scale_exponent` (128, its non-finite marker, becomes 0xFF)."""
    return (jnp.asarray(e, jnp.int32) + E8M0_BIAS).astype(jnp.uint8)


def times_block_scales(values: jax.Array, scales: jax.Array, expand: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """float32 values times their block scales, `expand` spreading a per-block float32 array over values' shape.

    Exact wherever the product is a float32 normal, on every backend: E8M0 byte 0 is 2^-127, a float32 subnormal,
    which XLA:CPU flushes to zero, so on the CPU every scale enters as two normal factors (2^-127 as 2^-126 · 0.5,
    any other as itself · 1); other backends keep subnormals and multiply once.
    """
    def once(v, s):
        return v * expand(scales_to_float32(s))

    def twice(v, s):
        s = jnp.asarray(s)
        if s.dtype not in (np.dtype(jnp.uint8), np.dtype(E8M0)):  # E4M3 scales are float32 normals
            return once(v, s)
        b = jax.lax.bitcast_convert_type(s, jnp.uint8) if s.dtype == np.dtype(E8M0) else s
        high = expand(e8m0_to_float32(jnp.maximum(b, jnp.uint8(1))))
        return v * high * expand(jnp.where(b == 0, jnp.float32(0.5), jnp.float32(1.0)))

    return jax.lax.platform_dependent(values, scales, cpu=twice, default=once)


def scales_to_float32(scales: jax.Array) -> jax.Array:
    """float32 value of block scales: E8M0 (uint8 / float8_e8m0fnu) or float8_e4m3fn (NVFP4)."""
    scales = jnp.asarray(scales)
    if scales.dtype in (np.dtype(jnp.uint8), np.dtype(E8M0)):
        return e8m0_to_float32(scales)
    if scales.dtype == np.dtype(E4M3):
        return scales.astype(jnp.float32)
    raise TypeError(f"scales must be uint8 or float8_e8m0fnu (E8M0) or float8_e4m3fn; got "
                    f"{_dtype_name(scales.dtype)}.")


# ----------------------------------------------------------------------------------------------------------------
# FP4 codes


# (mantissa bits, smallest normal exponent) of each code dtype: enough to round onto its grid in float32
_GRID = {np.dtype(E4M3): (3, -6), np.dtype(E5M2): (2, -14), np.dtype(E2M1): (1, 0)}


def round_to_grid(y: jax.Array, dtype: DTypeLike) -> jax.Array:
    """float32 -> float32 on `dtype`'s grid, round-to-nearest-even, saturating at +-emax(dtype).

    The rounding is done here in float32 (the spacing is 2**(max(exponent, emin) - mantissa_bits)) so that the
    later cast to `dtype` is exact. XLA may drop an f32 -> fp8 -> f32 convert pair (excess precision), and
    backends differ in how they lower sub-byte conversions; an exact cast is immune to both.
    """
    man_bits, emin = _GRID[np.dtype(dtype)]
    y = jnp.clip(jnp.asarray(y, jnp.float32), -emax(dtype), emax(dtype))
    biased = (jax.lax.bitcast_convert_type(y, jnp.int32) >> 23) & 0xFF
    ulp_exponent = jnp.maximum(biased - 127, emin) - man_bits
    # y / ulp as y * (1 / ulp): both powers of two, so the product is exact like the quotient (and cheaper on GPUs);
    # jnp.round breaks ties to even (an even mantissa)
    return jnp.round(y * _exp2(-ulp_exponent)) * _exp2(ulp_exponent)


def round_to_e2m1(y: jax.Array) -> jax.Array:
    """float32 -> float4_e2m1fn, round-to-nearest-even onto {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at +-6.

    NaN input gives an unspecified code, so callers zero non-finite blocks first.
    """
    return round_to_grid(y, E2M1).astype(E2M1)


def _require_even_last_axis(name: str, x: jax.Array) -> None:
    if x.ndim == 0 or x.shape[-1] % 2:
        raise ValueError(f"{name}: FP4 codes are packed two per byte along the last axis, which must be even; got "
                         f"shape {tuple(x.shape)}.")


_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of each 3-bit code, SPEC §1


def _e2m1_nibbles(codes: jax.Array) -> jax.Array:
    """uint8 4-bit encoding (bit 3 = sign) of float4_e2m1fn codes, computed from their values (no sub-byte bitcast)."""
    v = codes.astype(jnp.float32)
    a = jnp.abs(v)
    index = jnp.where(a < 2.0, 2.0 * a, jnp.where(a < 4.0, a + 2.0, 0.5 * a + 4.0))  # 0,.5,..,6 -> 0..7
    return index.astype(jnp.uint8) | (jnp.signbit(v).astype(jnp.uint8) << 3)


def _nibbles_to_e2m1(nibbles: jax.Array) -> jax.Array:
    """float4_e2m1fn codes of 4-bit encodings (the inverse of `_e2m1_nibbles`); the final cast is exact."""
    magnitude = jnp.asarray(_E2M1_VALUES, jnp.float32)[(nibbles & 7).astype(jnp.int32)]
    return jnp.where((nibbles & 8) != 0, -magnitude, magnitude).astype(E2M1)


def pack_fp4(codes: jax.Array) -> jax.Array:
    """float4_e2m1fn (..., K) -> uint8 (..., K//2); element 2i goes to the LOW nibble, 2i+1 to the high one."""
    codes = jnp.asarray(codes)
    if codes.dtype != np.dtype(E2M1):
        raise TypeError(f"pack_fp4: codes must be float4_e2m1fn; got {_dtype_name(codes.dtype)}.")
    _require_even_last_axis("pack_fp4", codes)
    nib = _e2m1_nibbles(codes).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return nib[..., 0] | (nib[..., 1] << 4)


def unpacked_codes(codes: jax.Array, k: int) -> jax.Array:
    """Codes with K elements on the last axis: packed FP4 (uint8, two per byte) unpacked to float4_e2m1fn and cut to
    K, any other codes as they are."""
    return unpack_fp4(codes)[..., :k] if np.dtype(codes.dtype) == np.dtype(jnp.uint8) else codes


def unpack_fp4(packed: jax.Array) -> jax.Array:
    """uint8 (..., K//2) -> float4_e2m1fn (..., K): the low nibble is element 2i, the high nibble 2i+1."""
    packed = jnp.asarray(packed)
    if packed.dtype != np.dtype(jnp.uint8) or packed.ndim == 0:
        raise TypeError(f"unpack_fp4: packed must be a uint8 array of rank >= 1; got "
                        f"{_dtype_name(packed.dtype)}{tuple(packed.shape)}.")
    # shifts broadcast along a new last axis, not a stack: XLA then fuses the unpacking into its consumer (a stack
    # lowers to a concatenate, one more kernel on the GPU)
    nib = (packed[..., None] >> jnp.array([0, 4], jnp.uint8)) & 0xF
    return _nibbles_to_e2m1(nib.reshape(*packed.shape[:-1], packed.shape[-1] * 2))


# ----------------------------------------------------------------------------------------------------------------
# Quantizers


def num_blocks(n: int, block: int) -> int:
    """Number of blocks (the last one possibly partial) covering an axis of length n."""
    return -(-n // block)


def _check_axis(name: str, x: jax.Array, axis: int) -> int:
    if not isinstance(axis, (int, np.integer)) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{name}: axis must be an int in [{-x.ndim}, {x.ndim}); got {axis!r} for shape "
                         f"{tuple(x.shape)}.")
    return int(axis) % x.ndim


def _check_block(name: str, block: int) -> int:
    if not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"{name}: block must be a positive int; got {block!r}.")
    return int(block)


def _split_blocks(x: jax.Array, axis: int, block: int) -> jax.Array:
    """Zero-pad non-negative `axis` to whole blocks and split it where it lies: (..., nb, block, ...)."""
    n = x.shape[axis]
    nb = num_blocks(n, block)
    x = jnp.pad(x, [(0, 0)] * axis + [(0, nb * block - n)] + [(0, 0)] * (x.ndim - axis - 1))
    return x.reshape(*x.shape[:axis], nb, block, *x.shape[axis + 1:])


def _to_blocks(x: jax.Array, axis: int, block: int) -> jax.Array:
    """Move `axis` last, zero-pad it to whole blocks and split it: (..., nb, block)."""
    return _split_blocks(jnp.moveaxis(x, axis, -1), x.ndim - 1, block)


def _from_blocks(xb: jax.Array, axis: int, n: int) -> jax.Array:
    """Inverse of `_to_blocks`: merge the blocks, drop the padding, move the axis back."""
    x = xb.reshape(*xb.shape[:-2], xb.shape[-2] * xb.shape[-1])[..., :n]  # no -1: another axis may be empty
    return jnp.moveaxis(x, -1, axis)


def mx_block_exponents(blocks: jax.Array, *, axis: int, code_dtype: DTypeLike,
                       rule: str | None = None) -> jax.Array:
    """int32 E8M0 scale exponent of every block of float32 `blocks` whose elements run along `axis` (kept, size 1).

    One integer max per block (`magnitude_max`) feeds `scale_exponent`: a block holding a NaN or an inf has a
    non-finite max and gets 128 (the NaN byte), an all-zero block -127 (byte 0). Lets a caller pick the block
    view (e.g. tokens along a middle axis) so that no transpose is needed. `rule=None` uses SCALE_RULE.
    """
    return scale_exponent(magnitude_max(blocks, axis=axis, keepdims=True), emax(code_dtype), rule=rule)


def mx_encode_blocks(blocks: jax.Array, e: jax.Array, *, code_dtype: DTypeLike) -> jax.Array:
    """Codes (SPEC §2) of float32 `blocks` under block exponents `e` from `mx_block_exponents` (broadcast).

    RNE(v / 2**e) saturated to +-emax, in float32 so that the final cast is exact; a block with e = 128 (NaN or
    inf inside) gets zero codes.
    """
    limit = emax(code_dtype)
    y = _scale_by_exp2(blocks, -jnp.clip(e, _E_MIN, _E_MAX))
    y = jnp.where(e > _E_MAX, 0.0, jnp.clip(y, -limit, limit))  # clip first: XLA casts overflow to NaN
    return round_to_grid(y, code_dtype).astype(code_dtype)  # an exact cast


@functools.partial(jax.jit, static_argnames=("axis", "block", "code_dtype", "rule", "packed"))
def _quantize_e8m0(x: jax.Array, *, axis: int, block: int, code_dtype: np.dtype, rule: str,
                   packed: bool) -> tuple[jax.Array, jax.Array]:
    """Shared MX path on validated arguments (jitted, so eager calls compile once per shape)."""
    xb = _to_blocks(x.astype(jnp.float32), axis, block)
    e = mx_block_exponents(xb, axis=-1, code_dtype=code_dtype, rule=rule)
    codes = _from_blocks(mx_encode_blocks(xb, e, code_dtype=code_dtype), axis, x.shape[axis])
    return (pack_fp4(codes) if packed else codes), jnp.moveaxis(exponent_to_e8m0(e[..., 0]), -1, axis)


def _validated(name: str, x: jax.Array, axis: int, block: int, packed: bool = False) -> tuple[jax.Array, int, int]:
    """Trace-time checks shared by the quantizers; returns (x, non-negative axis, block)."""
    try:
        x = jnp.asarray(x)
    except (TypeError, ValueError):  # None, a string, ...
        raise TypeError(f"{name}: x must be a floating-point array; got {type(x).__name__}.") from None
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name}: x must be a floating-point array; got {_dtype_name(x.dtype)}.")
    if x.ndim == 0:
        raise ValueError(f"{name}: x must have rank >= 1; got a scalar.")
    axis = _check_axis(name, x, axis)
    block = _check_block(name, block)
    # one block longer than the axis gives the same codes and scales as block = n, padded with zeros: bound the
    # padding (the axis rounded up to the MX block of 32 keeps every block a format uses on a short axis)
    limit = max(32, num_blocks(x.shape[axis], 32) * 32)
    if block > limit:
        raise ValueError(f"{name}: block={block} is longer than axis {axis} ({x.shape[axis]} elements) rounded up to a "
                         f"multiple of 32; allowed: at most {limit}.")
    if packed and x.shape[-1] % 2:
        raise ValueError(f"{name}: packed=True stores two FP4 codes per byte along the last axis, which must be "
                         f"even; got shape {tuple(x.shape)}. Pass packed=False for float4_e2m1fn codes.")
    return x, axis, block


def quantize_mxfp8(x: jax.Array, *, axis: int = -1, dtype: DTypeLike = E4M3, block: int = 32,
                   rule: str | None = None) -> tuple[jax.Array, jax.Array]:
    """MXFP8 (SPEC §2): E4M3 or E5M2 codes shaped like x, and uint8 E8M0 scale bytes.

    The scales have x's shape with ceil(n / block) entries along `axis`. `rule` overrides SCALE_RULE.
    """
    try:
        code_dtype = np.dtype(dtype)
    except TypeError:
        code_dtype = None
    if code_dtype not in _MX_CODE_DTYPES:
        raise ValueError(f"quantize_mxfp8: dtype must be float8_e4m3fn or float8_e5m2; got {dtype!r}.")
    x, axis, block = _validated("quantize_mxfp8", x, axis, block)
    return _quantize_e8m0(x, axis=axis, block=block, code_dtype=code_dtype, rule=_resolve_rule(rule),
                          packed=False)


def quantize_mxfp4(x: jax.Array, *, axis: int = -1, block: int = 32, packed: bool = True,
                   rule: str | None = None) -> tuple[jax.Array, jax.Array]:
    """MXFP4 (SPEC §2): E2M1 codes and uint8 E8M0 scale bytes (ceil(n / block) along `axis`).

    packed=True returns the codes as uint8, two per byte along the LAST axis (low nibble first; that axis must be
    even), whatever `axis` the blocks run along; packed=False returns float4_e2m1fn shaped like x.
    """
    x, axis, block = _validated("quantize_mxfp4", x, axis, block, packed)
    return _quantize_e8m0(x, axis=axis, block=block, code_dtype=np.dtype(E2M1), rule=_resolve_rule(rule),
                          packed=bool(packed))


def _nvfp4_scale(amax: jax.Array) -> jax.Array:
    """float32 block scale on the E4M3 grid: amax/6 rounded to nearest even, one step up if amax/scale exceeds 6.

    Saturates at 448 (the codes then saturate at +-6). A zero block gets scale 0. The value is exact in E4M3.
    """
    s = round_to_grid(amax / 6.0, E4M3)
    nonzero = jax.lax.bitcast_convert_type(amax, jnp.int32) != 0  # also true for a subnormal amax under DAZ
    # amax / s > 6, evaluated exactly (6 * s is exact); s == 0 with amax > 0 means amax / s = inf
    bump = ((amax > 6.0 * s) | (s == 0)) & nonzero & (s < 448.0)
    biased = (jax.lax.bitcast_convert_type(s, jnp.int32) >> 23) & 0xFF
    next_up = s + _exp2(jnp.maximum(biased - 127, -6) - 3)  # the next E4M3 value (2**-9 above 0)
    return jnp.where(bump, next_up, s)


def _nvfp4_encode_blocks(blocks: jax.Array, axis: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """E2M1 codes of float32 NVFP4 `blocks` whose elements run along `axis`, their float32 block scales and whether a
    block holds a NaN or an inf (both kept on `axis`, size 1). One reduction serves both: a block's max |x| is NaN or
    inf exactly when it holds one; such a block gets zero codes, as does one whose scale is 0."""
    amax = magnitude_max(blocks, axis=axis, keepdims=True)
    bad = ~jnp.isfinite(amax)
    sf = _nvfp4_scale(amax)
    # a correctly rounded division: it lands on the same side of every E2M1 midpoint as the exact quotient
    y = jnp.where(bad | (sf == 0), 0.0, blocks / jnp.where(sf == 0, 1.0, sf))
    return round_to_e2m1(y), sf, bad


@functools.partial(jax.jit, static_argnames=("axis", "block", "packed"))
def _quantize_nvfp4(x: jax.Array, *, axis: int, block: int, packed: bool) -> tuple[jax.Array, jax.Array]:
    codes, sf, bad = _nvfp4_encode_blocks(_to_blocks(x.astype(jnp.float32), axis, block), -1)
    codes = _from_blocks(codes, axis, x.shape[axis])
    scale_bits = jax.lax.bitcast_convert_type(sf[..., 0].astype(E4M3), jnp.uint8)  # an exact cast
    scale = jax.lax.bitcast_convert_type(jnp.where(bad[..., 0], jnp.uint8(_E4M3_NAN), scale_bits), E4M3)
    return (pack_fp4(codes) if packed else codes), jnp.moveaxis(scale, -1, axis)


def quantize_nvfp4(x: jax.Array, *, axis: int = -1, block: int = 16,
                   packed: bool = True) -> tuple[jax.Array, jax.Array]:
    """NVFP4 (SPEC §2): E2M1 codes and float8_e4m3fn block scales (ceil(n / block) along `axis`).

    Codes = RNE(v / scale) on the E2M1 grid, saturated at +-6. A zero block gets scale 0 and zero codes; a block
    holding a NaN or an inf gets a NaN scale and zero codes. Packing is as in `quantize_mxfp4`. A per-tensor fp32
    scale (alpha), if wanted, is applied by the caller before quantizing.
    """
    x, axis, block = _validated("quantize_nvfp4", x, axis, block, packed)
    return _quantize_nvfp4(x, axis=axis, block=block, packed=bool(packed))


NVFP4_TENSOR_MAX = 6.0 * 448.0  # the largest magnitude an E2M1 code times an E4M3 block scale reaches


def nvfp4_tensor_scales(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """NVFP4's per-tensor float32 factors (encode, alpha) of x: x · encode has its largest magnitude at 6 · 448, the
    most E2M1 codes times E4M3 block scales reach, and alpha = 1 / encode multiplies the GEMM's sums back; both 1
    where max|x| is 0 or not finite (a NaN or inf then reaches its block's NaN scale).

    Quantize the product x · encode, not a quotient x / alpha: XLA rewrites a division by a broadcast scalar into a
    product with its rounded reciprocal, so a quotient rounds differently under jit than eagerly and E2M1 ties flip.
    """
    encode = jnp.float32(NVFP4_TENSOR_MAX) / magnitude_max(x, axis=None)
    encode = jnp.where(jnp.isfinite(encode) & (encode > 0), encode, jnp.float32(1.0))
    return encode, jnp.float32(1.0) / encode


def quantize_dequantize(x: jax.Array, fmt: str, *, axis: int = -1) -> jax.Array:
    """float32 code x scale of x quantized in `fmt` (a FORMATS name) along `axis`: the values of
    `dequantize(*quantize_<fmt>(x, axis=axis))`, bit for bit, with the blocks split where `axis` lies, so that no
    transposed copy of x is made for any axis (for large operands XLA's transposes cost more than the quantization).
    The values are exact in bfloat16 (SPEC §6); NVFP4's per-tensor scale, if wanted, is the caller's."""
    if fmt not in FORMATS:
        raise ValueError(f"quantize_dequantize: fmt must be one of {', '.join(map(repr, FORMATS))}; got {fmt!r}.")
    x, axis, _ = _validated("quantize_dequantize", x, axis, FORMATS[fmt].block)
    return _quantize_dequantize(x, fmt=fmt, axis=axis)


@functools.partial(jax.jit, static_argnames=("fmt", "axis"))
def _quantize_dequantize(x: jax.Array, *, fmt: str, axis: int) -> jax.Array:
    f = FORMATS[fmt]
    blocks = _split_blocks(x.astype(jnp.float32), axis, f.block)
    if f.scale_kind == "e8m0":
        e = mx_block_exponents(blocks, axis=axis + 1, code_dtype=f.code_dtype)
        codes = mx_encode_blocks(blocks, e, code_dtype=f.code_dtype)
        values = times_block_scales(codes.astype(jnp.float32), exponent_to_e8m0(e), lambda s: s)
    else:
        codes, sf, bad = _nvfp4_encode_blocks(blocks, axis + 1)
        values = codes.astype(jnp.float32) * jnp.where(bad, jnp.nan, sf)
    padded = blocks.shape[axis] * blocks.shape[axis + 1]  # no -1: another axis may be empty
    values = values.reshape(*x.shape[:axis], padded, *x.shape[axis + 1:])
    return jax.lax.slice_in_dim(values, 0, x.shape[axis], axis=axis)


def dequantize(codes: jax.Array, scales: jax.Array, *, block: int, axis: int = -1) -> jax.Array:
    """float32 code x scale. codes: float8 / float4_e2m1fn, or uint8 packed FP4 (along the last axis).

    scales: uint8 or float8_e8m0fnu (E8M0) or float8_e4m3fn, shaped like the (unpacked) codes with
    ceil(n / block) along `axis` (a partial tail block is fine). A NaN scale makes its whole block NaN.
    """
    codes = jnp.asarray(codes)
    scales = jnp.asarray(scales)
    if codes.dtype == np.dtype(jnp.uint8) and codes.ndim:
        shape = (*codes.shape[:-1], 2 * codes.shape[-1])
    elif codes.dtype in (*_MX_CODE_DTYPES, np.dtype(E2M1)):
        shape = tuple(codes.shape)
    else:
        raise TypeError(f"dequantize: codes must be float8_e4m3fn, float8_e5m2, float4_e2m1fn or packed uint8 of "
                        f"rank >= 1; got {_dtype_name(codes.dtype)}{tuple(codes.shape)}.")
    if scales.dtype not in _SCALE_DTYPES:
        raise TypeError(f"dequantize: scales must be uint8 or float8_e8m0fnu (E8M0) or float8_e4m3fn; got "
                        f"{_dtype_name(scales.dtype)}.")
    axis = _check_axis("dequantize", codes, axis)
    block = _check_block("dequantize", block)
    want = shape[:axis] + (num_blocks(shape[axis], block),) + shape[axis + 1:]
    if tuple(scales.shape) != want:
        raise ValueError(f"dequantize: scales must have shape {want} for codes of shape {shape}, block={block}, "
                         f"axis={axis}; got {tuple(scales.shape)}.")
    return _dequantize(codes, scales, block=block, axis=axis)


@functools.partial(jax.jit, static_argnames=("block", "axis"))
def _dequantize(codes: jax.Array, scales: jax.Array, *, block: int, axis: int) -> jax.Array:
    if codes.dtype == np.dtype(jnp.uint8):
        codes = unpack_fp4(codes)
    n = codes.shape[axis]

    def expand(s: jax.Array) -> jax.Array:
        s = jnp.repeat(s, block, axis=axis, total_repeat_length=scales.shape[axis] * block)
        return jax.lax.slice_in_dim(s, 0, n, axis=axis)

    return times_block_scales(codes.astype(jnp.float32), scales, expand)


# ----------------------------------------------------------------------------------------------------------------
# The 128x4 scale atom (SPEC §3)

_ATOM_TAIL = (32, 4, 4)
_ATOM_TO_SEED = (3, 4, 1, 5, 2, 0)
_SEED_TO_ATOM = tuple(int(i) for i in np.argsort(_ATOM_TO_SEED))


def atom_shape(l: int, mn: int, kb: int) -> tuple[int, ...]:
    """Physical atom shape (L, ceil(MN/128), ceil(KB/4), 32, 4, 4) for L batches of MN x KB scales."""
    return (l, num_blocks(mn, 128), num_blocks(kb, 4), *_ATOM_TAIL)


def _as_bytes(s: jax.Array, name: str) -> jax.Array:
    if s.dtype not in _SCALE_DTYPES:
        raise TypeError(f"{name}: scales must be uint8, float8_e8m0fnu or float8_e4m3fn; got "
                        f"{_dtype_name(s.dtype)}.")
    return s if s.dtype == np.dtype(jnp.uint8) else jax.lax.bitcast_convert_type(s, jnp.uint8)


def to_scale_atom(scales: jax.Array) -> jax.Array:
    """Compact (MN, KB) or (L, MN, KB) scales -> physical atom (L, MN', K', 32, 4, 4), same dtype.

    Element [l, mn, kb] lands at [l, mn//128, kb//4, mn%32, (mn//32)%4, kb%4]; padding holds byte 0 (never NaN).
    """
    scales = jnp.asarray(scales)
    if scales.ndim not in (2, 3):
        raise ValueError(f"to_scale_atom: scales must be (MN, KB) or (L, MN, KB); got shape {tuple(scales.shape)}.")
    dtype = scales.dtype
    b = _as_bytes(scales, "to_scale_atom")
    if b.ndim == 2:
        b = b[None]
    atom = _compact_bytes_to_atom(b)
    return atom if dtype == np.dtype(jnp.uint8) else jax.lax.bitcast_convert_type(atom, dtype)


@jax.jit
def _compact_bytes_to_atom(b: jax.Array) -> jax.Array:
    """uint8 (L, MN, KB) -> (L, MN', K', 32, 4, 4): zero-pad to whole atoms, split mn = 128 rm + 32 a1 + a0."""
    l, mn, kb = b.shape
    _, mt, kt, *_ = atom_shape(l, mn, kb)
    b = jnp.pad(b, ((0, 0), (0, mt * 128 - mn), (0, kt * 4 - kb)))
    return b.reshape(l, mt, 4, 32, kt, 4).transpose(0, 1, 4, 3, 2, 5)


def from_scale_atom(atom: jax.Array, mn: int, kb: int) -> jax.Array:
    """Physical atom ((L,) MN', K', 32, 4, 4) -> compact (L, MN, KB) scales, same dtype (padding dropped)."""
    atom = jnp.asarray(atom)
    if atom.ndim == 5:
        atom = atom[None]
    if atom.ndim != 6 or tuple(atom.shape[1:]) != atom_shape(1, mn, kb)[1:]:
        raise ValueError(f"from_scale_atom: atom must have shape (L, *{atom_shape(1, mn, kb)[1:]}) for mn={mn}, "
                         f"kb={kb}; got {tuple(atom.shape)}.")
    _as_bytes(atom, "from_scale_atom")
    l, mt, kt = atom.shape[:3]
    compact = atom.transpose(0, 1, 4, 3, 2, 5).reshape(l, mt * 128, kt * 4)
    return compact[:, :mn, :kb]


def atom_to_seed_view(atom: jax.Array) -> jax.Array:
    """Physical atom (L, MN', K', 32, 4, 4) -> the seed's logical view (32, 4, MN', 4, K', L)."""
    atom = jnp.asarray(atom)
    if atom.ndim != 6 or tuple(atom.shape[3:]) != _ATOM_TAIL:
        raise ValueError(f"atom_to_seed_view: atom must be (L, MN', K', 32, 4, 4); got {tuple(atom.shape)}.")
    return atom.transpose(_ATOM_TO_SEED)


def seed_view_to_atom(view: jax.Array) -> jax.Array:
    """The seed's logical view (32, 4, MN', 4, K', L) -> physical atom (L, MN', K', 32, 4, 4)."""
    view = jnp.asarray(view)
    if view.ndim != 6 or (view.shape[0], view.shape[1], view.shape[3]) != _ATOM_TAIL:
        raise ValueError(f"seed_view_to_atom: view must be (32, 4, MN', 4, K', L); got {tuple(view.shape)}.")
    return view.transpose(_SEED_TO_ATOM)
