"""The support surface of both operations: every documented constraint, checked at trace time.

Each check raises a TypeError (wrong dtype) or ValueError (wrong shape or value) whose message names the
argument, the value given and what is allowed. The public API calls these before binding a primitive, so the
reference and the kernels only ever see inputs inside the contract (SPEC §4–§5).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_blockgemm.formats import E2M1, E4M3, E5M2, E8M0

FP8_DTYPES = (np.dtype(E4M3), np.dtype(E5M2))
FP4_DTYPES = (np.dtype(E2M1), np.dtype(jnp.uint8))  # uint8 = two E2M1 codes, low nibble first
E8M0_DTYPES = (np.dtype(jnp.uint8), np.dtype(E8M0), np.dtype(jnp.int8))
C_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16), *FP8_DTYPES, *FP4_DTYPES)
SF_VEC_SIZES = (16, 32)
TILE_M_VALUES = (128,)
TILE_N_VALUES = (128, 256)
CLUSTER_VALUES = (1, 2, 4)
IMPLEMENTATIONS = (None, "cutedsl", "xla")

HEAD_DIM = 192
QK_NOPE = 128
QK_ROPE = 64
MX_BLOCK = 32


def _names(values: Sequence[Any]) -> str:
    return ", ".join(repr(v) if v is None or isinstance(v, (str, int)) else str(np.dtype(v)) for v in values)


def dtype_name(x: Any) -> str:
    """The NumPy name of an array's dtype, or of a dtype given as such (np.dtype, a scalar type such as np.int32)."""
    # a scalar type's `dtype` is a descriptor of the class, not a dtype: np.dtype takes the type itself
    return str(np.dtype(x.dtype if hasattr(x, "dtype") and not isinstance(x, type) else x))


def as_dtype(name: str, value: Any, allowed: str) -> np.dtype:
    """np.dtype(value), or a TypeError naming `name` and what is allowed where value is no dtype (None included:
    np.dtype(None) would be float64)."""
    try:
        if value is None:
            raise TypeError
        return np.dtype(value)
    except TypeError:
        raise TypeError(f"{name}={value!r} is not supported; allowed: {allowed}.") from None


def is_fp4(dtype: Any) -> bool:
    return np.dtype(dtype) in FP4_DTYPES


def tokens_are_values(a_dtype: Any, sf_vec_size: int) -> bool:
    """Whether a ragged call's tokens of `a_dtype` are values used as given (bf16 or float32 against block-scaled
    weights, sf_vec_size > 0: the weight-only ragged matmul) rather than codes or bf16 operands of bf16 weights."""
    return sf_vec_size > 0 and np.dtype(a_dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float32))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def is_int(value: Any) -> bool:
    """Whether value is an integer: a Python int or a NumPy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_sizes(owner: str, **sizes: Any) -> None:
    """Sizes such as a layer's features: TypeError unless each is an int, ValueError unless each is at least 1."""
    for name, value in sizes.items():
        if not is_int(value):
            raise TypeError(f"{owner}: {name} must be an int; got {value!r}.")
    if min(sizes.values()) < 1:
        names = list(sizes)
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        raise ValueError(f"{owner}: {listed} must be at least 1; got {', '.join(map(str, sizes.values()))}.")


def check_choice(name: str, value: Any, allowed: Sequence[Any]) -> None:
    """ValueError naming `name` unless value is one of `allowed`; TypeError where it only equals an integer choice
    (32.0 or True compare equal to 32 and 1 but are no int)."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed: {_names(allowed)}.")
    if not is_int(value) and any(is_int(v) and v == value for v in allowed):
        raise TypeError(f"{name}={value!r} is not supported: it must be an int; allowed: {_names(allowed)}.")


def count_arg(minimum: int = 1) -> Callable[[str], int]:
    """An argparse type for the command-line tools: an integer >= `minimum` (a size, a count of calls or steps)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}; got {text!r}.")
        return value
    return parse


def check_implementation(implementation: Any) -> None:
    check_choice("implementation", implementation, IMPLEMENTATIONS)


def check_array(name: str, x: Any) -> None:
    """TypeError naming `name` unless x is an array: a jax.Array (a tracer too) or a numpy.ndarray."""
    if not isinstance(x, (jax.Array, np.ndarray)) and not hasattr(x, "__jax_array__"):
        raise TypeError(f"{name} must be an array (jax.Array or numpy.ndarray); got {type(x).__name__}.")


def as_array(name: str, x: Any, owner: str) -> jax.Array:
    """jnp.asarray(x), or a TypeError naming `owner`'s argument `name` where x is no array (None, a string, ...)."""
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError):
        raise TypeError(f"{owner}: {name} must be an array (or a nested list of numbers); got "
                        f"{type(x).__name__}.") from None


def check_alpha(alpha: Any) -> jax.Array:
    """alpha (NVFP4's per-tensor scale) as a float32 scalar array, else an error naming alpha."""
    try:
        alpha = jnp.asarray(alpha)
    except (TypeError, ValueError):
        raise TypeError(f"alpha must be a float32 scalar; got {alpha!r}.") from None
    if alpha.shape != () or alpha.dtype != jnp.float32:
        raise ValueError(f"alpha must be a float32 scalar; got {dtype_name(alpha)}{tuple(alpha.shape)}.")
    return alpha


def check_rank(name: str, x: Any, ranks: Sequence[int], meaning: str) -> None:
    if x.ndim not in ranks:
        raise ValueError(f"{name} must have rank {' or '.join(map(str, ranks))} ({meaning}); "
                         f"got shape {tuple(x.shape)}.")


def check_gemm_operands(a: Any, b: Any, *, a_major: str, b_major: str, names: tuple[str, str] = ("a", "b"),
                        shapes: Optional[tuple[Sequence[int], Sequence[int]]] = None) -> tuple[int, int, int, int]:
    """Checks dtypes, ranks and majors of A and B; returns (L, M, N, K) with K the logical contraction size.

    Where a and b are views of the caller's arrays (moved axes, a batch axis added), `names` and `shapes` are the
    caller's argument names and shapes, which the messages show instead.
    """
    na, nb = names
    for name, x in ((na, a), (nb, b)):
        check_array(name, x)
        if np.dtype(x.dtype) not in FP8_DTYPES + FP4_DTYPES:
            raise TypeError(
                f"{name} has dtype {dtype_name(x)}; allowed: float8_e4m3fn, float8_e5m2 (MXFP8), float4_e2m1fn or "
                "uint8 (packed E2M1 pairs, MXFP4/NVFP4).")
        check_rank(name, x, (2, 3), "(MN, K) or (L, MN, K); the transpose for an MN-major operand")
    sa, sb = (tuple(a.shape), tuple(b.shape)) if shapes is None else (tuple(shapes[0]), tuple(shapes[1]))
    if is_fp4(a.dtype) != is_fp4(b.dtype) or (not is_fp4(a.dtype) and a.dtype != b.dtype):
        raise TypeError(f"{na} and {nb} must have the same dtype; got {na}: {dtype_name(a)}, {nb}: {dtype_name(b)}.")
    if a.dtype != b.dtype:
        raise ValueError(f"{na} and {nb} must use the same FP4 container, both float4_e2m1fn or both uint8 (packed "
                         f"E2M1 pairs); got {na}: {dtype_name(a)}, {nb}: {dtype_name(b)}.")
    if a.ndim != b.ndim:
        raise ValueError(f"{na} and {nb} must have the same rank; got {na}: {sa}, {nb}: {sb}.")
    check_choice("a_major", a_major, ("k", "m"))
    check_choice("b_major", b_major, ("k", "n"))
    fp4 = is_fp4(a.dtype)
    if fp4 and (a_major != "k" or b_major != "k"):
        raise ValueError(f"FP4 operands must be K-major; got a_major={a_major!r}, b_major={b_major!r}.")
    a3 = a.shape if a.ndim == 3 else (1, *a.shape)
    b3 = b.shape if b.ndim == 3 else (1, *b.shape)
    if a3[0] != b3[0]:
        raise ValueError(f"{na} and {nb} must have the same batch size L; got {na}: {sa}, {nb}: {sb}.")
    m, ka = (a3[1], a3[2]) if a_major == "k" else (a3[2], a3[1])
    n, kb = (b3[1], b3[2]) if b_major == "k" else (b3[2], b3[1])
    packed = np.dtype(a.dtype) == np.dtype(jnp.uint8)
    if packed:
        ka, kb = 2 * ka, 2 * kb
    if ka != kb:
        raise ValueError(f"{na} and {nb} disagree on K: {na} gives K={ka} (shape {sa}), {nb} gives K={kb} "
                         f"(shape {sb}).")
    for dim, value in (("L", a3[0]), ("M", m), ("N", n), ("K", ka)):
        if value < 1:
            raise ValueError(f"{dim} must be at least 1; got shapes {na}: {sa}, {nb}: {sb}.")
    return a3[0], m, n, ka


def element_bits(dtype: Any) -> int:
    """Bits of one element of an operand or C of `dtype` (FP4, packed or not: 4)."""
    return 4 if is_fp4(dtype) else 8 * np.dtype(dtype).itemsize


def check_alignment(*, ab_dtype: Any, c_dtype: Any, m: int, n: int, k: int, a_major: str, b_major: str,
                    c_major: str) -> None:
    """16-byte alignment of each operand's contiguous dimension (the seeds' TMA requirement)."""
    ab_bits, c_bits = element_bits(ab_dtype), element_bits(c_dtype)
    checks = (
        ("a", "K" if a_major == "k" else "M", k if a_major == "k" else m, ab_bits),
        ("b", "K" if b_major == "k" else "N", k if b_major == "k" else n, ab_bits),
        ("c", "N" if c_major == "n" else "M", n if c_major == "n" else m, c_bits),
    )
    for name, dim, size, bits in checks:
        per_16_bytes = 128 // bits
        if size % per_16_bytes:
            # C is no argument: say which arguments set its size and element width.
            source = "b" if dim == "N" else "a"
            whose = f" (the result, from {source} and c_dtype={dtype_name(c_dtype)})" if name == "c" else ""
            raise ValueError(
                f"{name}'s contiguous dimension {dim}={size}{whose} must be a multiple of {per_16_bytes} "
                f"({bits}-bit elements, 16-byte aligned rows).")


def _int_pair(name: str, value: Any, allowed: str) -> tuple[int, int]:
    """value as a tuple of two ints, else a TypeError (not a sequence; 128.0 or True for an int) or ValueError (not
    two values) naming `name`."""
    try:
        pair = tuple(value)
    except TypeError:
        raise TypeError(f"{name}={value!r} is not supported; allowed: {allowed}.") from None
    if len(pair) != 2:
        raise ValueError(f"{name}={pair} is not supported; allowed: {allowed}.")
    if not all(is_int(v) for v in pair):
        raise TypeError(f"{name}={pair} is not supported: its values must be ints; allowed: {allowed}.")
    return pair


def check_gemm_config(*, ab_dtype: Any, scale_dtype: Any, c_dtype: Any, c_major: str, acc_dtype: Any,
                      mma_tiler_mn: Sequence[int], cluster_shape_mn: Sequence[int], sf_vec_size: int,
                      k: int, has_alpha: bool) -> str:
    """The dtype couplings and tiling rules of the seed; returns the scale kind ("e8m0" or "e4m3")."""
    check_choice("sf_vec_size", sf_vec_size, SF_VEC_SIZES)
    if as_dtype("acc_dtype", acc_dtype, "float32") != np.dtype(jnp.float32):
        raise ValueError(f"acc_dtype={dtype_name(acc_dtype)} is not supported; allowed: float32.")
    if as_dtype("c_dtype", c_dtype, _names(C_DTYPES)) not in C_DTYPES:
        raise TypeError(f"c_dtype={dtype_name(c_dtype)} is not supported; allowed: {_names(C_DTYPES)}.")
    check_choice("c_major", c_major, ("n", "m"))
    tiler = _int_pair("mma_tiler_mn", mma_tiler_mn, "(128, 128) or (128, 256)")
    cluster = _int_pair("cluster_shape_mn", cluster_shape_mn, "a pair of ints, each one of 1, 2, 4")
    if tiler[0] not in TILE_M_VALUES or tiler[1] not in TILE_N_VALUES:
        raise ValueError(f"mma_tiler_mn={tiler} is not supported; allowed: (128, 128) or (128, 256).")
    if any(c not in CLUSTER_VALUES for c in cluster):
        raise ValueError(f"cluster_shape_mn={cluster} is not supported; each value must be one of 1, 2, 4.")
    fp4_ab = is_fp4(ab_dtype)
    if np.dtype(scale_dtype) in E8M0_DTYPES:
        scale_kind = "e8m0"
    elif np.dtype(scale_dtype) == np.dtype(E4M3):
        scale_kind = "e4m3"
    else:
        raise TypeError(f"sfa/sfb have dtype {dtype_name(scale_dtype)}; allowed: float8_e8m0fnu, uint8 or int8 "
                        "(E8M0 bytes), float8_e4m3fn (NVFP4).")
    if scale_kind == "e4m3" and sf_vec_size != 16:
        raise ValueError(f"E4M3 scales (NVFP4) need sf_vec_size=16; got sf_vec_size={sf_vec_size}.")
    if scale_kind == "e4m3" and not fp4_ab:
        raise ValueError("E4M3 scales (NVFP4) need FP4 operands; got "
                         f"{dtype_name(ab_dtype)} operands. Use E8M0 scales for MXFP8.")
    if not fp4_ab and sf_vec_size != 32:
        raise ValueError(f"FP8 operands (MXFP8) need sf_vec_size=32; got sf_vec_size={sf_vec_size}.")
    c_fp8 = np.dtype(c_dtype) in FP8_DTYPES
    if is_fp4(c_dtype) and not fp4_ab:
        raise ValueError(f"c_dtype={dtype_name(c_dtype)} (packed FP4 C) needs FP4 operands; "
                         f"got {dtype_name(ab_dtype)}.")
    if is_fp4(c_dtype) and c_major != "n":
        raise ValueError(f"FP4 C must be N-major; got c_major={c_major!r}.")
    if c_fp8 and not fp4_ab:
        raise ValueError(f"c_dtype={dtype_name(c_dtype)} with FP8 operands is not supported (the seed disables FP8 "
                         "in and FP8 out together); use float32, float16 or bfloat16.")
    if tiler == (128, 256) and sf_vec_size == 16 and np.dtype(c_dtype) in C_DTYPES[:3]:
        raise ValueError("mma_tiler_mn=(128, 256) with sf_vec_size=16 and a float32/float16/bfloat16 C is not "
                         "supported; use mma_tiler_mn=(128, 128).")
    if fp4_ab and tiler[1] == 256 and k <= 128:
        raise ValueError(f"mma_tiler_mn=(128, 256) with FP4 operands needs K > 128; got K={k}.")
    if has_alpha and scale_kind != "e4m3":
        raise ValueError("alpha (the per-tensor fp32 scale) belongs to NVFP4 (FP4 operands with E4M3 scales); got "
                         f"{scale_kind.upper()} scales.")
    return scale_kind


def scale_form(name: str, s: Any, *, l: int, mn: int, kb: int, batched: bool) -> str:
    """Which of the three accepted scale forms `s` is: "atom", "seed" or "compact"; raises if none fits."""
    mn_t, k_t = ceil_div(mn, 128), ceil_div(kb, 4)
    atom = (l, mn_t, k_t, 32, 4, 4)
    seed = (32, 4, mn_t, 4, k_t, l)
    compact = (l, mn, kb) if batched else (mn, kb)
    shape = tuple(s.shape)
    if shape == atom or (not batched and shape == atom[1:]):
        return "atom"
    if shape == seed:
        return "seed"
    if shape == compact:
        return "compact"
    raise ValueError(
        f"{name} has shape {shape}; for MN={mn}, {kb} scale blocks along K and L={l} it must be the physical atom "
        f"{atom}, the seed's logical view {seed}, or the compact form {compact}.")


def check_proj_rope(x: Any, w: Any, cos: Any, sin: Any, x_scale: Any, w_scale: Any, *, w_out_in: bool
                    ) -> tuple[int, int, int, bool]:
    """Validates gemm_proj_rope_mxfp8's inputs; returns (T, K, H, mxfp8)."""
    if not isinstance(w_out_in, (bool, np.bool_)):
        raise TypeError(f"w_out_in must be a bool; got {w_out_in!r}.")
    allowed = (np.dtype(jnp.bfloat16), np.dtype(E4M3))
    for name, arr in (("x", x), ("w", w), ("cos", cos), ("sin", sin)):
        check_array(name, arr)
    for name, arr in (("x", x), ("w", w)):
        if np.dtype(arr.dtype) not in allowed:
            raise TypeError(f"{name} has dtype {dtype_name(arr)}; allowed: bfloat16 (bf16 path) or float8_e4m3fn "
                            "(MXFP8 path).")
        check_rank(name, arr, (2,), "a matrix")
    if x.dtype != w.dtype:
        raise TypeError(f"x and w must have the same dtype; got x: {dtype_name(x)}, w: {dtype_name(w)}.")
    mxfp8 = np.dtype(x.dtype) == np.dtype(E4M3)
    t, k = x.shape
    n, kw = w.shape if w_out_in else w.shape[::-1]
    layout = "(H*192, K) for w_out_in=True" if w_out_in else "(K, H*192) for w_out_in=False"
    if kw != k:
        raise ValueError(f"w has shape {tuple(w.shape)}, which does not match x's K={k}; expected {layout}.")
    if n % HEAD_DIM or n == 0:
        raise ValueError(f"w has shape {tuple(w.shape)}: its output dimension {n} must be a positive multiple of "
                         f"HEAD_DIM={HEAD_DIM} (H heads of 128 + 64 features); expected {layout}.")
    if t % MX_BLOCK or t == 0:
        raise ValueError(f"x has {t} tokens; the token count must be a positive multiple of {MX_BLOCK} "
                         "(the columnwise MXFP8 blocks).")
    k_multiple = MX_BLOCK if mxfp8 else 8
    if k % k_multiple or k == 0:
        raise ValueError(f"x has K={k}; K must be a positive multiple of {k_multiple} on the "
                         f"{'MXFP8' if mxfp8 else 'bf16'} path.")
    for name, arr in (("cos", cos), ("sin", sin)):
        if np.dtype(arr.dtype) != np.dtype(jnp.bfloat16):
            raise TypeError(f"{name} has dtype {dtype_name(arr)}; allowed: bfloat16.")
        if tuple(arr.shape) != (t, QK_ROPE):
            raise ValueError(f"{name} has shape {tuple(arr.shape)}; expected (T, 64) = {(t, QK_ROPE)}.")
    if mxfp8:
        if x_scale is None or w_scale is None:
            raise ValueError("x_scale and w_scale are required on the MXFP8 path (float8_e4m3fn x and w).")
        kb = k // MX_BLOCK
        expected = {"x_scale": (t, kb), "w_scale": (n, kb) if w_out_in else (kb, n)}
        for name, arr in (("x_scale", x_scale), ("w_scale", w_scale)):
            check_array(name, arr)
            if np.dtype(arr.dtype) not in E8M0_DTYPES[:2]:
                raise TypeError(f"{name} has dtype {dtype_name(arr)}; allowed: uint8 or float8_e8m0fnu (E8M0 bytes).")
            if tuple(arr.shape) != expected[name]:
                raise ValueError(f"{name} has shape {tuple(arr.shape)}; expected {expected[name]}.")
    elif x_scale is not None or w_scale is not None:
        raise ValueError("x_scale and w_scale must be None on the bf16 path (bfloat16 x and w).")
    return t, k, n // HEAD_DIM, mxfp8
