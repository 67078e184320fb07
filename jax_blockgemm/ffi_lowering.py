"""MLIR lowering of the operations to their XLA FFI custom calls (`jbg_gemm_amax`, `jbg_gemm_proj_rope_mxfp8`,
`jbg_dequantize_mxfp8`, the input pass of the MXFP8 proj_rope path and of the swap_ab ragged kernel's tokens,
`jbg_weight_stream`, the decode kernel, `jbg_ragged_gemm_amax`, the mixture-of-experts kernel,
`jbg_grouped_contraction`, its weight gradient, and `jbg_quantize_pair`, its weights quantized both ways in one pass;
typed FFI, api_version 4).

The custom call carries one kernel object per architecture, so a program lowered or `jax.export`-ed on any
machine (no GPU needed) runs on every GPU the objects cover; the handler picks by compute capability when XLA
instantiates the program. Attributes:

- `archs`: comma-separated targets, e.g. "sm_90a,sm_100a";
- `function_prefixes`: comma-separated exported function names, one per arch;
- `objects`: the objects concatenated (uint8 array); `offsets`: int64 array, object i is objects[offsets[i]:
  offsets[i + 1]];
- `ab_dtype`, `c_dtype`: the operand and C dtypes the objects were compiled for ("float8_e4m3fn", "float32";
  "float4_e2m1fn" for packed FP4 operands or C, which travel as uint8 pairs); the handler refuses buffers of other
  dtypes (a float32 kernel would write past the end of a bfloat16 C);
- `sf_dtype`, `sf_vec_size`: the scales the objects read ("float8_e8m0fnu" per 32, or NVFP4's "float8_e4m3fn" per
  16). NVFP4 objects also take alpha ((L,) float32) as a fifth operand; a call without one passes ones;
- `a_major`, `b_major`: "k" (a (L, M, K), b (L, N, K)), or "m" / "n" for an MN-major a (L, K, M) / b (L, K, N);
- `cluster_ctas`: int64 array, one entry per object: 0 where its function takes no grid size (sm_90a), else the CTAs
  of one of its clusters (sm_100a, whose function takes max_ctas: the handler sizes the persistent grid per device
  from the SM count and the clusters that fit at once).

`jbg_weight_stream` (x, w, sw, alpha -> c, amax) carries the object table and `w_dtype`, `c_dtype`, `sf_dtype`,
`sf_vec_size` (what its objects were compiled for, named as above), `max_m` (int64: the most rows of x every
object takes) and `amax_batches` (int64: L, for which the handler keeps amax's zeroed tally per device; 0 when the
caller drops amax, which the kernel then leaves unwritten); sw's rank tells the handler its form (3: compact scales,
6: the 128x4 atom).

`jbg_ragged_gemm_amax` (a, b, sfa, sfb, items, alpha -> c, amax) carries the object table and `ab_dtype`, `c_dtype`,
`sf_dtype`, `sf_vec_size`, `b_major` as `jbg_gemm_amax` names them: b holds one weight per batch and group, (L, G, N,
K), its scales the atoms of L·G batches; items, int32 (L, max_items, 4), is the work-item table the program computes.
The bf16 objects (ab_dtype "bfloat16", sf_dtype "none" (NO_SCALES), sf_vec_size 0, C float32 or bfloat16) take
bfloat16 a (L, T, K) and b (L, G, N, K) for b_major "k" or (L, G, K, N) for "n", and read neither sfa nor sfb
(uint8 of zero elements, any rank) nor alpha (passed: ones); every other format takes b_major "k". The call also
carries `a_dtype`, ab_dtype's but for the swap_ab objects (MXFP8 E4M3, MXFP4 or NVFP4 weights): "bfloat16", whose a
is the tokens dequantized to bf16, (L, T, K rounded up to 256), as `swap_ab_layout.kernel_tokens` gives them for the
objects' tile (permuted, but as they are for the 16-token tile, which orders them itself), whose sfa is empty and
whose sfb is compact, (L·G, N, ceil(K/v)).

`jbg_grouped_contraction` (x, y, bounds -> c, amax) carries the object table and `ab_dtype` ("bfloat16") and
`c_dtype` ("float32" or "bfloat16"): x (L, T, K) and y (L, T, N) bfloat16, tokens sorted by group, bounds int32 (L,
G, 2) the rows [start, end) of each group; c (L, G, K, N), c[l, g] = x[l, rows of g]ᵀ · y[l, rows of g].

`jbg_quantize_pair` (w[, row_map] -> values, codes, scales) carries the object table and `schedule` (the objects'
index in QUANTIZE_PAIR_SCHEDULES): w (..., R, C) bfloat16, values its bf16 code·scale with blocks along R in the
objects' ab_dtype format, codes (c_dtype) and uint8 scales (..., R, C/32) with blocks along C; the gather schedules
take a row map (..., R') int32 whose rows the values are ((..., R', C)), and GATHER_VALUES writes the column blocks
as bfloat16 values.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from jax_blockgemm import _native, formats, kernel_cache
from jax_blockgemm.swap_ab_layout import SWAP_AB_K_PAD, kernel_tokens

GEMM_AMAX_TARGET = _native.GEMM_AMAX_TARGET
PROJ_ROPE_TARGET = _native.PROJ_ROPE_TARGET
DEQUANTIZE_TARGET = _native.DEQUANTIZE_TARGET
WEIGHT_STREAM_TARGET = _native.WEIGHT_STREAM_TARGET
RAGGED_TARGET = _native.RAGGED_TARGET
CONTRACTION_TARGET = _native.CONTRACTION_TARGET
QUANTIZE_PAIR_TARGET = _native.QUANTIZE_PAIR_TARGET


def object_table_attributes(variants: Sequence[Any], objects: Sequence[bytes]) -> dict[str, Any]:
    """The attributes every target's instantiate stage reads: archs, function_prefixes, objects, offsets."""
    if len(variants) != len(objects) or not variants:
        raise ValueError(f"expected one object per variant and at least one variant, got {len(variants)} variants "
                         f"and {len(objects)} objects")
    archs = [v.arch for v in variants]
    if len(set(archs)) != len(archs):
        raise ValueError(f"variants: one kernel per architecture is allowed, got archs {archs}")
    for v in variants:
        if "," in v.arch or "," in v.function_prefix:
            raise ValueError(f"variant {v.key!r}: arch and function_prefix may not contain ','")
    offsets = np.zeros(len(objects) + 1, np.int64)
    offsets[1:] = np.cumsum([len(o) for o in objects])
    return dict(archs=",".join(archs), function_prefixes=",".join(v.function_prefix for v in variants),
                objects=np.frombuffer(b"".join(objects), np.uint8), offsets=offsets)


E8M0 = "float8_e8m0fnu"
NO_SCALES = "none"  # catalog.NO_SCALES: the sf_dtype (with sf_vec_size 0) of objects whose operands carry no scales
SWAP_AB = "swap_ab"  # catalog.SWAP_AB: the ragged objects that take bfloat16 tokens and convert only the weights
# the quantize_pair schedules (catalog's "", GATHER, GATHER_VALUES), each one's index its handler's `schedule`
QUANTIZE_PAIR_SCHEDULES = ("", "gather", "gather_values")


def takes_group_items(variant: Any) -> bool:
    """Whether ragged `variant` reads a group-local item table (`ragged.group_items`: the sm_90a bf16 and swap_ab
    kernels, whose tokens carry no scale atoms) rather than the 128-row grid's (`ragged.kernel_items`)."""
    return variant.op == "ragged" and variant.arch == "sm_90a" and (
        variant.schedule == SWAP_AB or variant.sf_dtype == NO_SCALES)


def logical_dtype(dtype: Any) -> str:
    """The dtype name the kernels and the handler use: uint8 operands and C are packed FP4 ("float4_e2m1fn")."""
    name = str(np.dtype(dtype))
    return "float4_e2m1fn" if name == "uint8" else name


def gemm_amax_attributes(variants: Sequence[Any], objects: Sequence[bytes], *, ab_dtype: Any, c_dtype: Any,
                         sf_dtype: str = E8M0, sf_vec_size: int = 32, a_major: str = "k",
                         b_major: str = "k") -> dict[str, Any]:
    """The gemm_amax call's attributes for `variants` (one per arch, all compiled for ab_dtype / c_dtype, the
    scales sf_dtype per sf_vec_size and the operand majors; uint8 ab_dtype / c_dtype mean packed FP4)."""
    ab_dtype, c_dtype = logical_dtype(ab_dtype), logical_dtype(c_dtype)
    call = (ab_dtype, c_dtype, sf_dtype, int(sf_vec_size), a_major, b_major)
    for v in variants:
        compiled_for = (getattr(v, "ab_dtype", ab_dtype), getattr(v, "c_dtype", c_dtype),
                        getattr(v, "sf_dtype", sf_dtype), getattr(v, "sf_vec_size", sf_vec_size),
                        getattr(v, "a_major", a_major), getattr(v, "b_major", b_major))
        if compiled_for != call:
            raise ValueError(f"variant {v.key!r} is compiled for {compiled_for} (operands, C, scales, block, "
                             f"majors), not the call's {call}")
    return dict(object_table_attributes(variants, objects), ab_dtype=ab_dtype, c_dtype=c_dtype, sf_dtype=sf_dtype,
                sf_vec_size=int(sf_vec_size), a_major=a_major, b_major=b_major,
                cluster_ctas=np.array([_grid_cluster_ctas(v) for v in variants], np.int64))


def _grid_cluster_ctas(variant: Any) -> int:
    """The catalog's `grid_cluster_ctas` for a catalog variant; 0 (no grid size) for anything else."""
    from jax_blockgemm.kernels import catalog

    return catalog.grid_cluster_ctas(variant) if isinstance(variant, catalog.KernelVariant) else 0


def _check_avals(ctx: Any, a_major: str = "k", b_major: str = "k") -> None:
    """Operand/result avals must match the handler's contract; a mismatch is a bug in the caller's lowering."""
    a, b, sfa, sfb = ctx.avals_in[:4]
    c, amax = ctx.avals_out
    if len(ctx.avals_in) not in (4, 5) or a.ndim != 3 or b.ndim != 3:
        raise ValueError(f"emit_gemm_amax expects operands a (L, M, K) or (L, K, M), b (L, N, K) or (L, K, N), sfa, "
                         f"sfb[, alpha (L,)]; got {[str(x) for x in ctx.avals_in]}")
    l, m = a.shape[0], a.shape[2 if a_major == "m" else 1]
    n = b.shape[2 if b_major == "n" else 1]
    c_shape = (l, m, n // 2) if np.dtype(c.dtype) == np.uint8 else (l, m, n)  # packed FP4 C: N/2 bytes per row
    if c.shape != c_shape or amax.shape != (l,) or np.dtype(amax.dtype) != np.float32:
        raise ValueError(f"emit_gemm_amax expects results c {c_shape} and amax ({l},) float32; got c {c} and "
                         f"amax {amax}")
    if len(ctx.avals_in) == 5 and (ctx.avals_in[4].shape != (l,) or np.dtype(ctx.avals_in[4].dtype) != np.float32):
        raise ValueError(f"emit_gemm_amax expects alpha ({l},) float32; got {ctx.avals_in[4]}")


def _objects(variants: Sequence[Any]) -> tuple[list, list[bytes]]:
    """The variants sorted by arch and their objects (compiled on first use, then cached on disk)."""
    variants = sorted(variants, key=lambda v: v.arch)
    return variants, [kernel_cache.get_object(v) for v in variants]


def _emit(target: str, ctx: Any, operands: Sequence[Any], attributes: dict[str, Any]) -> list:
    """Emits custom call `target` with `attributes`."""
    try:  # a program compiled in this process needs the handler; lowering alone (export) does not
        _native.register_ffi_targets()
    except ImportError:
        pass
    return list(jax.ffi.ffi_lowering(target)(ctx, *operands, **attributes))


def emit_gemm_amax(ctx: Any, a: Any, b: Any, sfa: Any, sfb: Any, *alpha: Any, variants: Sequence[Any],
                   sf_vec_size: int = 32) -> list:
    """Emits the `jbg_gemm_amax` custom call for the lowering context `ctx`; returns [c, amax].

    `variants`: catalog entries, one per architecture. Result types come from `ctx.avals_out`: c (L, M, N) (packed
    FP4: (L, M, N/2) uint8), amax (L,) float32. `alpha` ((L,) float32, NVFP4 only) is optional: objects compiled
    for E4M3 scales always take one, so a call without it passes ones (a constant in the program).
    """
    a_major, b_major = getattr(variants[0], "a_major", "k"), getattr(variants[0], "b_major", "k")
    _check_avals(ctx, a_major, b_major)
    variants, objects = _objects(variants)
    sf_dtype = E8M0 if np.dtype(ctx.avals_in[2].dtype) == np.uint8 else str(np.dtype(ctx.avals_in[2].dtype))
    attributes = gemm_amax_attributes(variants, objects, ab_dtype=ctx.avals_in[0].dtype,
                                      c_dtype=ctx.avals_out[0].dtype, sf_dtype=sf_dtype, sf_vec_size=sf_vec_size,
                                      a_major=a_major, b_major=b_major)
    operands = [a, b, sfa, sfb, *alpha]
    if sf_dtype != E8M0 and not alpha:
        l = ctx.avals_in[0].shape[0]
        operands.append(mlir.ir_constant(np.ones((l,), np.float32)))
        ctx = ctx.replace(avals_in=[*ctx.avals_in, jax.core.ShapedArray((l,), np.float32)])
    elif sf_dtype == E8M0 and alpha:
        raise ValueError("emit_gemm_amax: alpha belongs to NVFP4 (E4M3 scales); these scales are E8M0")
    return _emit(GEMM_AMAX_TARGET, ctx, operands, attributes)


def emit_proj_rope(ctx: Any, x: Any, w: Any, cos: Any, sin: Any, *, variants: Sequence[Any], w_out_in: bool) -> list:
    """Emits the `jbg_gemm_proj_rope_mxfp8` custom call (bf16 x and w, one group); returns the four outputs."""
    x_aval = ctx.avals_in[0]
    if len(ctx.avals_in) != 4 or x_aval.ndim != 3 or x_aval.shape[0] != 1:
        raise ValueError(f"emit_proj_rope expects x (1, T, K), w, cos, sin; got {[str(a) for a in ctx.avals_in]}")
    attributes = dict(object_table_attributes(*_objects(variants)), w_out_in=bool(w_out_in))
    return _emit(PROJ_ROPE_TARGET, ctx, (x, w, cos, sin), attributes)


def emit_dequantize(ctx: Any, operands: Sequence[tuple[Any, Any]], *, avals: Sequence[tuple[Any, Any]],
                    variants: Sequence[Any], scale_axis: int) -> list:
    """Emits one `jbg_dequantize_mxfp8` custom call inside the lowering `ctx` for one or two (codes, scales) operands
    (one launch): E4M3 codes (..., R, C) times E8M0 scales as bfloat16 (..., R, C). Operand 0 has one scale per 32
    along `scale_axis` (-1: along C, scales (..., R, C/32); -2: along R, scales (..., R/32, C)); operand 1 along its
    C. `avals`: (codes, scales) avals per operand. Returns the bf16 values."""
    if scale_axis not in (-1, -2):
        raise ValueError(f"emit_dequantize: scale_axis must be -1 or -2, got {scale_axis}")
    if len(operands) not in (1, 2) or len(avals) != len(operands):
        raise ValueError(f"emit_dequantize takes one or two (codes, scales) operands with their avals; got "
                         f"{len(operands)} operands and {len(avals)} aval pairs")
    for codes_aval, scales_aval in avals:
        if np.dtype(codes_aval.dtype) != np.dtype("float8_e4m3fn") or np.dtype(scales_aval.dtype) != np.uint8:
            raise ValueError(f"emit_dequantize expects float8_e4m3fn codes and uint8 scales; got {codes_aval}, "
                             f"{scales_aval}")
    outs = [jax.core.ShapedArray(codes_aval.shape, np.dtype("bfloat16")) for codes_aval, _ in avals]
    sub = ctx.replace(avals_in=[a for pair in avals for a in pair], avals_out=outs)
    attributes = dict(object_table_attributes(*_objects(variants)), scale_axis=np.int64(scale_axis))
    return _emit(DEQUANTIZE_TARGET, sub, [x for pair in operands for x in pair], attributes)


def weight_stream_attributes(variants: Sequence[Any], objects: Sequence[bytes], *, w_dtype: Any, c_dtype: Any,
                             sf_dtype: str, amax_batches: int) -> dict[str, Any]:
    """The jbg_weight_stream call's attributes for `variants` (one per arch, all compiled for the weight codes
    `w_dtype` (uint8: packed FP4), C dtype `c_dtype` and scales `sf_dtype`); max_m is the smallest row capacity among
    them (tile_mn[1]); amax_batches is the call's L, for which the handler keeps amax's tally, or 0 where the caller
    drops amax (no tally: the kernel skips amax)."""
    w_dtype, c_dtype = logical_dtype(w_dtype), str(np.dtype(c_dtype))
    for v in variants:
        if (v.ab_dtype, v.c_dtype, v.sf_dtype) != (w_dtype, c_dtype, sf_dtype):
            raise ValueError(f"variant {v.key!r} is compiled for {(v.ab_dtype, v.c_dtype, v.sf_dtype)} (weight codes, "
                             f"C, scales), not the call's {(w_dtype, c_dtype, sf_dtype)}")
    block_sizes = {v.sf_vec_size for v in variants}
    if len(block_sizes) != 1:
        raise ValueError(f"variants disagree on the scale block: {sorted(block_sizes)}")
    return dict(object_table_attributes(variants, objects), w_dtype=w_dtype, c_dtype=c_dtype, sf_dtype=sf_dtype,
                sf_vec_size=np.int64(block_sizes.pop()), max_m=np.int64(min(v.tile_mn[1] for v in variants)),
                amax_batches=np.int64(amax_batches))


def emit_weight_stream(ctx: Any, x: Any, w: Any, sw: Any, alpha: Any, *, variants: Sequence[Any],
                       amax_used: bool = True) -> list:
    """Emits the `jbg_weight_stream` custom call (the decode GEMM) for the lowering context `ctx`; returns [c, amax].

    x (L, M, K) bf16; w (L, N, K) codes or packed FP4 (L, N, K/2) uint8; sw the weight's scales, compact (L, N,
    ceil(K/v)) or the 128x4 atom (L, ceil(N/128), ceil(ceil(K/v)/4), 32, 4, 4), uint8 E8M0 bytes or float8_e4m3fn
    (NVFP4); alpha (L,) float32. Results from `ctx.avals_out`: c (L, M, N) in the variants' C dtype, amax (L,)
    float32. `variants`: catalog entries, one per architecture, each taking at least M rows. The call is one
    kernel on XLA's stream: nothing zeroes amax before it (the handler keeps a tally, kernels/weight_stream.py);
    amax_used=False (the caller drops amax) spares the kernel amax altogether and leaves it unwritten.
    """
    x_aval, w_aval, sw_aval, alpha_aval = ctx.avals_in
    c_aval, amax_aval = ctx.avals_out
    if x_aval.ndim != 3 or np.dtype(x_aval.dtype) != np.dtype(jnp.bfloat16):
        raise ValueError(f"emit_weight_stream expects x (L, M, K) bfloat16; got {x_aval}")
    l, m, k = x_aval.shape
    packed = np.dtype(w_aval.dtype) == np.uint8
    n = w_aval.shape[1] if w_aval.ndim == 3 else -1
    if w_aval.shape != (l, n, k // 2 if packed else k) or n < 1 or sw_aval.ndim not in (3, 6):
        raise ValueError(f"emit_weight_stream expects w (L, N, K) (packed FP4: (L, N, K/2)) and sw of rank 3 or 6 for "
                         f"x {x_aval}; got w {w_aval}, sw {sw_aval}")
    if alpha_aval.shape != (l,) or np.dtype(alpha_aval.dtype) != np.float32:
        raise ValueError(f"emit_weight_stream expects alpha ({l},) float32; got {alpha_aval}")
    if c_aval.shape != (l, m, n) or amax_aval.shape != (l,) or np.dtype(amax_aval.dtype) != np.float32:
        raise ValueError(f"emit_weight_stream expects results c {(l, m, n)} and amax ({l},) float32; got c {c_aval} "
                         f"and amax {amax_aval}")
    if any(v.tile_mn[1] < m for v in variants):
        raise ValueError(f"emit_weight_stream: M = {m} rows; variants take at most "
                         f"{[(v.key, v.tile_mn[1]) for v in variants]}")
    variants, objects = _objects(variants)
    sf_dtype = E8M0 if np.dtype(sw_aval.dtype) == np.uint8 else str(np.dtype(sw_aval.dtype))
    attributes = weight_stream_attributes(variants, objects, w_dtype=w_aval.dtype, c_dtype=c_aval.dtype,
                                          sf_dtype=sf_dtype, amax_batches=l if amax_used else 0)
    return _emit(WEIGHT_STREAM_TARGET, ctx, (x, w, sw, alpha), attributes)


def ragged_attributes(variants: Sequence[Any], objects: Sequence[bytes], *, ab_dtype: Any, c_dtype: Any,
                      sf_dtype: str, sf_vec_size: int, b_major: str = "k", schedule: str = "",
                      amax_batches: int) -> dict[str, Any]:
    """The jbg_ragged_gemm_amax call's attributes for `variants` (one per arch, all ragged kernels compiled for the
    codes ab_dtype and C dtype c_dtype (uint8: packed FP4) with sf_dtype scales per sf_vec_size ("none" and 0 for
    bfloat16 operands), b_major and schedule (SWAP_AB: bfloat16 tokens, `a_dtype`)); amax_batches: L where the caller
    reads amax, 0 where it drops it (then nothing zeroes or folds it: its value is unspecified)."""
    call = (logical_dtype(ab_dtype), logical_dtype(c_dtype), sf_dtype, int(sf_vec_size), b_major, schedule)
    for v in variants:
        if v.op != "ragged" or (v.ab_dtype, v.c_dtype, v.sf_dtype, v.sf_vec_size, getattr(v, "b_major", "k"),
                                getattr(v, "schedule", "")) != call:
            raise ValueError(f"variant {v.key!r} is not a ragged kernel compiled for the call's {call} (codes, C, "
                             f"scales, block, b major, schedule)")
    return dict(object_table_attributes(variants, objects), ab_dtype=call[0],
                a_dtype="bfloat16" if schedule == SWAP_AB else call[0], c_dtype=call[1], sf_dtype=sf_dtype,
                sf_vec_size=np.int64(sf_vec_size), b_major=b_major, amax_batches=np.int64(amax_batches))


def emit_ragged(ctx: Any, a: Any, b: Any, sfa: Any, sfb: Any, items: Any, alpha: Any, *,
                variants: Sequence[Any], amax_used: bool = True) -> list:
    """Emits the `jbg_ragged_gemm_amax` custom call (the grouped GEMM) for the lowering context `ctx`; returns
    [c, amax].

    a (L, T, K) codes or packed FP4 (L, T, K/2) uint8; b (L, G, N, K) likewise, one weight per group; sfa and sfb
    their scales in the 128x4 atom of (L, T, K) and (L·G, N, K) (rank 6), uint8 E8M0 bytes or float8_e4m3fn
    (NVFP4); items int32 (L, max_items, 4); alpha (L,) float32. Results from `ctx.avals_out`: c (L, T, N) (packed
    FP4: (L, T, N/2) uint8) in the variants' C dtype, amax (L,) float32. `variants`: catalog entries of op "ragged",
    one per architecture, all of one b_major. The swap_ab variants take a as bf16 tokens (`swap_ab_layout`), sfa
    empty, sfb compact (L·G, N, ceil(K/block)) or in the atom form (the kernel reads either in place) and alpha
    (L·G,), one per weight, and fold amax through a tally the handler keeps (nothing zeroes it per call).
    amax_used=False, for a caller that drops amax: neither a zeroing nor a tally (its value is then unspecified).

    bf16 variants (ab_dtype "bfloat16", sf_dtype NO_SCALES): a (L, T, K) and b bfloat16, b (L, G, N, K) for the
    variants' b_major "k" or (L, G, K, N) for "n"; sfa and sfb uint8 of zero elements (any rank), which the kernel
    does not read, nor alpha; c float32 or bfloat16.
    """
    if not variants:
        raise ValueError("emit_ragged needs at least one variant")
    if len(ctx.avals_in) != 6 or len(ctx.avals_out) != 2:
        raise ValueError(f"emit_ragged expects operands a, b, sfa, sfb, items, alpha and results c, amax; got "
                         f"{[str(x) for x in ctx.avals_in]} -> {[str(x) for x in ctx.avals_out]}")
    a_aval, b_aval, sfa_aval, sfb_aval, items_aval, alpha_aval = ctx.avals_in
    c_aval, amax_aval = ctx.avals_out
    bf16 = variants[0].ab_dtype == "bfloat16"
    b_major, schedule = getattr(variants[0], "b_major", "k"), getattr(variants[0], "schedule", "")
    swap = schedule == SWAP_AB
    if a_aval.ndim != 3:
        raise ValueError(f"emit_ragged expects a (L, T, K) (packed FP4: (L, T, K/2)); got {a_aval}")
    l, t, row = a_aval.shape
    g = b_aval.shape[1] if b_aval.ndim == 4 else -1
    n = b_aval.shape[3 if b_major == "n" else 2] if b_aval.ndim == 4 else -1
    if swap:  # bf16 tokens (L, T, K rounded up to SWAP_AB_K_PAD), E4M3 codes (L, G, N, K) or packed FP4 (.., K/2)
        fp4 = variants[0].ab_dtype == "float4_e2m1fn"
        code_dtype = np.uint8 if fp4 else jnp.float8_e4m3fn
        k = (b_aval.shape[3] * (2 if fp4 else 1)) if b_aval.ndim == 4 else -1
        if (np.dtype(a_aval.dtype) != np.dtype(jnp.bfloat16) or b_aval.ndim != 4
                or b_aval.shape != (l, g, n, b_aval.shape[3]) or min(g, n, k) < 1
                or row != -(-k // SWAP_AB_K_PAD) * SWAP_AB_K_PAD or np.dtype(b_aval.dtype) != np.dtype(code_dtype)):
            raise ValueError(f"emit_ragged expects, for swap_ab variants, a bfloat16 (L, T, K rounded up to 256) and "
                             f"b {np.dtype(code_dtype)} (L, G, N, {'K/2' if fp4 else 'K'}); got a {a_aval}, b "
                             f"{b_aval}")
        kb = -(-k // variants[0].sf_vec_size)
        forms = ((l * g, n, kb), formats.atom_shape(l * g, n, kb))
        if sfa_aval.size or np.dtype(sfa_aval.dtype) != np.uint8 or sfb_aval.shape not in forms:
            raise ValueError(f"emit_ragged expects, for swap_ab variants, sfa uint8 of zero elements and sfb compact "
                             f"(L*G, N, ceil(K/{variants[0].sf_vec_size})) = {forms[0]} or in the atom form "
                             f"{forms[1]}; got sfa {sfa_aval}, sfb {sfb_aval}")
    else:
        b_shape = (l, g, row, n) if b_major == "n" else (l, g, n, row)
        if b_aval.shape != b_shape or np.dtype(b_aval.dtype) != np.dtype(a_aval.dtype) or min(g, n) < 1:
            raise ValueError(f"emit_ragged expects b (L, G, N, K) (packed FP4: (L, G, N, K/2); b_major 'n': (L, G, K, "
                             f"N)) of a's dtype for a {a_aval} and b_major {b_major!r}; got b {b_aval}")
    if bf16:
        if any(x.size or np.dtype(x.dtype) != np.uint8 for x in (sfa_aval, sfb_aval)):
            raise ValueError(f"emit_ragged expects sfa and sfb uint8 of zero elements for bfloat16 variants (no "
                             f"scales); got sfa {sfa_aval}, sfb {sfb_aval}")
    elif not swap and (sfa_aval.ndim != 6 or sfb_aval.ndim != 6
                       or np.dtype(sfa_aval.dtype) != np.dtype(sfb_aval.dtype)):
        raise ValueError(f"emit_ragged expects sfa and sfb in the 128x4 atom form (rank 6), of one dtype; got sfa "
                         f"{sfa_aval}, sfb {sfb_aval}")
    max_items = items_aval.shape[1] if items_aval.ndim == 3 else -1
    if items_aval.shape != (l, max_items, 4) or max_items < 1 or np.dtype(items_aval.dtype) != np.int32:
        raise ValueError(f"emit_ragged expects items ({l}, max_items >= 1, 4) int32; got {items_aval}")
    alphas = l * g if swap else l  # the swap_ab objects take one alpha per weight
    if alpha_aval.shape != (alphas,) or np.dtype(alpha_aval.dtype) != np.float32:
        raise ValueError(f"emit_ragged expects alpha ({alphas},) float32 ({'L*G' if swap else 'L'}); got {alpha_aval}")
    packed_c = np.dtype(c_aval.dtype) == np.uint8
    if packed_c and n % 2:
        raise ValueError(f"emit_ragged: N = {n} is odd; a packed FP4 C holds two codes per byte")
    c_shape = (l, t, n // 2) if packed_c else (l, t, n)
    if c_aval.shape != c_shape or amax_aval.shape != (l,) or np.dtype(amax_aval.dtype) != np.float32:
        raise ValueError(f"emit_ragged expects results c {c_shape} and amax ({l},) float32; got c {c_aval} and "
                         f"amax {amax_aval}")
    variants, objects = _objects(variants)
    if bf16:
        sf_dtype = NO_SCALES
    else:
        sf_dtype = E8M0 if np.dtype(sfb_aval.dtype) == np.uint8 else str(np.dtype(sfb_aval.dtype))
    attributes = ragged_attributes(variants, objects, ab_dtype=b_aval.dtype, c_dtype=c_aval.dtype, sf_dtype=sf_dtype,
                                   sf_vec_size=variants[0].sf_vec_size, b_major=b_major, schedule=schedule,
                                   amax_batches=l if amax_used else 0)
    return _emit(RAGGED_TARGET, ctx, (a, b, sfa, sfb, items, alpha), attributes)


def emit_decode_swap_ab(ctx: Any, x: Any, b: Any, sfb: Any, alpha: Any, *, variants: Sequence[Any],
                        amax_used: bool = True) -> list:
    """A decode-sized GEMM through the swap_ab ragged kernel's decode tiles (catalog.SWAP_AB_DECODE_TILES; dispatch
    picks it at arch.TABLE's decode_swap_ab_m): x (L, M, K) bf16 as one group of M tokens, as the tile takes them
    (`swap_ab_layout.kernel_tokens`: padded; permuted but for the 16-token tile, which orders them itself), against
    b (L, N, K) E4M3 codes or packed FP4 (L, N, K/2), one weight per batch, with sfb compact (L, N, KB) or in the
    atom form (the kernel reads either), and alpha (L,); `ctx.avals_out` are c (L, M, N) in the variants' C dtype and
    amax (L,). One work item per batch, all M rows (the tile holds them). amax_used=False: amax is dropped
    (`emit_ragged`). Returns [c, amax]."""
    x_aval, b_aval, sfb_aval, alpha_aval = ctx.avals_in
    l, m, k = x_aval.shape
    n, row = b_aval.shape[1:]
    fp4 = variants[0].ab_dtype == "float4_e2m1fn"

    def prepare(x, b, sfb):
        items = jnp.broadcast_to(jnp.array([[0, 0, 0, m]], jnp.int32), (l, 1, 4))  # (row tile, group, rows)
        tokens = kernel_tokens(x, fp4=fp4, tile_tokens=variants[0].tile_mn[0])
        return [tokens, b.reshape(l, 1, n, row), jnp.zeros((l, 0), jnp.uint8), sfb, items]

    in_avals = [x_aval, b_aval, sfb_aval]
    out_avals = [jax.core.ShapedArray(o.shape, o.dtype) for o in jax.eval_shape(prepare, *in_avals)]
    prepared = mlir.lower_fun(prepare, multiple_results=True)(ctx.replace(avals_in=in_avals, avals_out=out_avals),
                                                              x, b, sfb)
    return emit_ragged(ctx.replace(avals_in=[*out_avals, alpha_aval]), *prepared, alpha, variants=variants,
                       amax_used=amax_used)


def emit_decode(ctx: Any, x: Any, w: Any, sw: Any, alpha: Any, *, variants: Sequence[Any],
                amax_used: bool = True) -> list:
    """A decode-sized GEMM through the variants dispatch chose (`dispatch.decode_kernels` / `weight_only_kernels`):
    the swap_ab ragged kernel's decode tile where they are ragged ones (`emit_decode_swap_ab`), else the
    weight_stream kernel (`emit_weight_stream`). Operands, results and amax_used as there; returns [c, amax]."""
    if variants[0].op == "ragged":
        return emit_decode_swap_ab(ctx, x, w, sw, alpha, variants=variants, amax_used=amax_used)
    return emit_weight_stream(ctx, x, w, sw, alpha, variants=variants, amax_used=amax_used)


_CONTRACTION_C_DTYPES = ("float32", "bfloat16")  # what the jbg_grouped_contraction handler takes for c_dtype


def contraction_attributes(variants: Sequence[Any], objects: Sequence[bytes], *, c_dtype: Any) -> dict[str, Any]:
    """The jbg_grouped_contraction call's attributes for `variants` (one per arch, all contraction kernels compiled
    for bfloat16 operands and C dtype c_dtype, float32 or bfloat16)."""
    c_dtype = str(np.dtype(c_dtype))
    if c_dtype not in _CONTRACTION_C_DTYPES:
        raise ValueError(f"contraction: c_dtype {c_dtype} is not supported; expected float32 or bfloat16")
    call = ("bfloat16", c_dtype)
    for v in variants:
        if v.op != "contraction" or (v.ab_dtype, v.c_dtype) != call:
            raise ValueError(f"variant {v.key!r} is not a contraction kernel compiled for the call's {call} "
                             f"(operands, C)")
    return dict(object_table_attributes(variants, objects), ab_dtype=call[0], c_dtype=c_dtype)


def emit_contraction(ctx: Any, x: Any, y: Any, bounds: Any, *, variants: Sequence[Any]) -> list:
    """Emits the `jbg_grouped_contraction` custom call (the per-group contraction over tokens, the weight gradient
    of a ragged product) for the lowering context `ctx`; returns [c, amax].

    x (L, T, K) and y (L, T, N) bfloat16, tokens sorted by group, K and N multiples of 8 (16-byte rows); bounds
    int32 (L, G, 2), the rows [start, end) of each group. Results from `ctx.avals_out`: c (L, G, K, N) in the
    variants' C dtype (float32 or bfloat16), amax (L,) float32. `variants`: catalog entries of op "contraction", one
    per architecture.
    """
    if not variants:
        raise ValueError("emit_contraction needs at least one variant")
    if len(ctx.avals_in) != 3 or len(ctx.avals_out) != 2:
        raise ValueError(f"emit_contraction expects operands x, y, bounds and results c, amax; got "
                         f"{[str(a) for a in ctx.avals_in]} -> {[str(a) for a in ctx.avals_out]}")
    x_aval, y_aval, bounds_aval = ctx.avals_in
    c_aval, amax_aval = ctx.avals_out
    bf16 = np.dtype(jnp.bfloat16)
    if x_aval.ndim != 3 or np.dtype(x_aval.dtype) != bf16 or min(x_aval.shape) < 1:
        raise ValueError(f"emit_contraction expects x (L, T, K) bfloat16, every dimension >= 1; got {x_aval}")
    l, t, k = x_aval.shape
    n = y_aval.shape[2] if y_aval.ndim == 3 else -1
    if y_aval.shape != (l, t, n) or np.dtype(y_aval.dtype) != bf16 or n < 1:
        raise ValueError(f"emit_contraction expects y (L, T, N) bfloat16 for x {x_aval}; got y {y_aval}")
    if k % 8 or n % 8:
        raise ValueError(f"emit_contraction: K = {k} and N = {n} must be multiples of 8 (16-byte rows of bfloat16)")
    g = bounds_aval.shape[1] if bounds_aval.ndim == 3 else -1
    if bounds_aval.shape != (l, g, 2) or g < 1 or np.dtype(bounds_aval.dtype) != np.int32:
        raise ValueError(f"emit_contraction expects bounds ({l}, G >= 1, 2) int32; got {bounds_aval}")
    if str(np.dtype(c_aval.dtype)) not in _CONTRACTION_C_DTYPES:
        raise ValueError(f"emit_contraction expects c float32 or bfloat16; got {c_aval}")
    if c_aval.shape != (l, g, k, n) or amax_aval.shape != (l,) or np.dtype(amax_aval.dtype) != np.float32:
        raise ValueError(f"emit_contraction expects results c {(l, g, k, n)} and amax ({l},) float32; got c {c_aval} "
                         f"and amax {amax_aval}")
    variants, objects = _objects(variants)
    attributes = contraction_attributes(variants, objects, c_dtype=c_aval.dtype)
    return _emit(CONTRACTION_TARGET, ctx, (x, y, bounds), attributes)


def emit_quantize_pair(ctx: Any, w: Any, *row_map: Any, variants: Sequence[Any]) -> list:
    """Emits the `jbg_quantize_pair` custom call (both MX quantizations of a bf16 matrix in one pass) for the lowering
    context `ctx`; returns [values, codes, scales].

    w (..., R, C) bfloat16, C a multiple of 32, and R too without a row map. Results from `ctx.avals_out`: values
    bfloat16 (w quantized along the rows in the variants' ab_dtype format, as code·scale; (..., R, C), or with a
    row map (..., R') int32 the rows it names: (..., R', C)), codes (..., R, C) in their c_dtype (bfloat16 values for
    the GATHER_VALUES schedule) and scales (..., R, C/32) uint8 (w quantized along C). `variants`: catalog entries of
    op "quantize_pair", one per architecture, all of one schedule (the gather ones take the row map) compiled for the
    results' formats.
    """
    w_aval, (values_aval, codes_aval, scales_aval) = ctx.avals_in[0], ctx.avals_out
    schedule = variants[0].schedule if variants else ""
    if schedule not in QUANTIZE_PAIR_SCHEDULES or any(v.schedule != schedule for v in variants):
        raise ValueError(f"emit_quantize_pair: the variants must share one schedule of {QUANTIZE_PAIR_SCHEDULES}; "
                         f"got {[v.key for v in variants]}")
    gather = schedule != ""
    shape = tuple(w_aval.shape)
    if (len(shape) < 2 or np.dtype(w_aval.dtype) != np.dtype("bfloat16") or shape[-1] % 32
            or (not gather and shape[-2] % 32)):
        raise ValueError(f"emit_quantize_pair expects w (..., R, C) bfloat16 with C a multiple of 32 (R too without "
                         f"a row map); got {w_aval}")
    if len(row_map) != int(gather):
        raise ValueError(f"emit_quantize_pair: schedule {schedule!r} takes {int(gather)} row map(s); got "
                         f"{len(row_map)}")
    values_shape = shape
    if gather:
        map_aval = ctx.avals_in[1]
        if np.dtype(map_aval.dtype) != np.int32 or not map_aval.shape or map_aval.shape[-1] % 32:
            raise ValueError(f"emit_quantize_pair expects row_map (..., R') int32 with R' a multiple of 32; got "
                             f"{map_aval}")
        values_shape = (*map_aval.shape, shape[-1])
    col_dtype = "bfloat16" if schedule == "gather_values" else None
    if (tuple(values_aval.shape) != values_shape or np.dtype(values_aval.dtype) != np.dtype("bfloat16")
            or tuple(codes_aval.shape) != shape or tuple(scales_aval.shape) != (*shape[:-1], shape[-1] // 32)
            or np.dtype(scales_aval.dtype) != np.uint8
            or (col_dtype is not None and str(np.dtype(codes_aval.dtype)) != col_dtype)):
        raise ValueError(f"emit_quantize_pair expects results values bfloat16 {values_shape}, codes {shape} and "
                         f"scales uint8 {(*shape[:-1], shape[-1] // 32)}; got {values_aval}, {codes_aval}, "
                         f"{scales_aval}")
    for v in variants:
        if v.op != "quantize_pair" or (col_dtype is None and v.c_dtype != str(np.dtype(codes_aval.dtype))):
            raise ValueError(f"variant {v.key!r} is not a quantize_pair kernel writing {codes_aval.dtype} codes")
    attributes = dict(object_table_attributes(*_objects(variants)),
                      schedule=np.int64(QUANTIZE_PAIR_SCHEDULES.index(schedule)))
    return _emit(QUANTIZE_PAIR_TARGET, ctx, (w, *row_map), attributes)


def export_disabled_checks() -> list:
    """What `jax.export.export(..., disabled_checks=...)` needs to export a program holding our custom calls."""
    return [jax.export.DisabledSafetyCheck.custom_call(t)
            for t in (GEMM_AMAX_TARGET, PROJ_ROPE_TARGET, DEQUANTIZE_TARGET, WEIGHT_STREAM_TARGET, RAGGED_TARGET,
                      CONTRACTION_TARGET, QUANTIZE_PAIR_TARGET)]
