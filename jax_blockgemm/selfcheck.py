"""The first-use self-check itself: run one kernel on small problems and compare it with the reference.

    python -m jax_blockgemm.selfcheck [--arch sm_100a] [--variant KEY ...] [--force]

The Blackwell (sm_100a) kernels were compiled and checked on machines without a Blackwell GPU; nobody here has run
them. Before a process uses one on a local GPU, `gate` runs this module in a child process (`--child KEY`), which
runs the kernel on problems chosen to reach the paths most likely to break (`problems`), with the outputs poisoned
beforehand, and compares its outputs with the XLA reference on the same GPU (SPEC §7 bounds). The CLI checks the
selected kernels through the same gate (one child each, verdicts stored) and prints one row per kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import pathlib
import sys
from typing import Any, Callable, Sequence

import numpy as np

from jax_blockgemm import arch, gate
from jax_blockgemm.kernels import sm100
# (L, M, N, K): M and N not multiples of the tile (N stays a multiple of 8: 16-byte C rows), K not a multiple
# of the 128-wide k-tile, L = 2, several tiles.
PROBLEMS = ((1, 200, 136, 96), (2, 129, 264, 160), (1, 384, 256, 512))
# The same for kernels with MN-major operands, whose M (N) must be a multiple of 16 (16-byte rows).
MN_PROBLEMS = ((1, 208, 144, 96), (2, 144, 272, 160), (1, 384, 256, 512))
# The same for 8-bit and packed 4-bit C, whose N must be a multiple of 16 (32) for 16-byte rows.
NARROW_C_PROBLEMS = ((1, 200, 160, 96), (2, 129, 288, 160), (1, 384, 256, 512))
C_REL_TOLERANCE = 1e-4  # SPEC §7, fp32 C: ‖c − ref‖/‖ref‖ (the "tensor-core FP8" class)
AMAX_REL_TOLERANCE = 1e-4
BF16_HALF_ULP = 2.0**-8  # |x − bf16(x)| ≤ 2^-8·|x| for normal x (round to nearest)
# Per C dtype, what rounding the fp32 result into it may cost (round to nearest): half the code spacing of a binade
# relative to the binade's lower end (2^-(mantissa bits + 1)), half the subnormal spacing (near zero), and the
# largest finite value for the dtypes whose conversion saturates (None: not saturating).
C_ROUNDING = {
    "float32": (0.0, 0.0, None),
    "bfloat16": (BF16_HALF_ULP, 2.0**-134, None),
    "float16": (2.0**-11, 2.0**-25, None),
    "float8_e4m3fn": (2.0**-4, 2.0**-10, 448.0),
    "float8_e5m2": (2.0**-3, 2.0**-17, 57344.0),
    "float4_e2m1fn": (2.0**-2, 0.25, 6.0),
}
BYTE_C = ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn")  # C dtypes of 8 or 4 bits: NARROW_C_PROBLEMS
NARROW_C = ("float16", *BYTE_C)  # small scales keep C in range
POISON_ENV = "JAX_BLOCKGEMM_POISON_OUTPUTS"  # read by the FFI handler: NaN-fill C before each launch
# proj_rope (T, H, K): a token tail (96 of a 128-token tile), two heads, K not a multiple of the 64-wide k-tile; a
# single head; 20 x 8 = 160 tiles, more than a B200's 148 CTAs, so some CTAs walk two tiles (both accumulator stages).
PROJ_ROPE_PROBLEMS = ((96, 2, 72), (160, 1, 200), (2560, 8, 64))
GRID_ENV = "JAX_BLOCKGEMM_SM_LIMIT"  # read by the FFI handler: the persistent grid as on a GPU of this many SMs
NVFP4_ALPHA = 1.375  # NVFP4's per-tensor scale in the check: not 1, not a power of two, its square not itself
# The paths a persistent kernel takes only on large problems, run small: the grid capped to one cluster (GRID_ENV),
# so each CTA walks every tile of its cluster position, and K long enough that every k-loop wraps its stage ring
# twice whatever the stage count (at most MAX_AB_STAGES), with a tail k-tile.
K_TAIL = 96  # a partial k-tile and a partial scale atom; a multiple of 32 (packed FP4 rows of 16 bytes)
# proj_rope's ((T, H, K), grid CTAs): one CTA walks 2 token tiles (the second a tail) x 2 heads, its bf16 k-tiles of
# 64 wrapping the stage ring twice before a tail.
PROJ_ROPE_GRID_PROBLEMS = (((224, 2, 2 * sm100.MAX_AB_STAGES * 64 + 8), 1),)
CODE_MATCH_FRACTION = 0.99  # SPEC §7: at least 99% of the codes identical
SCALE_MISMATCH_FRACTION = 0.01  # scale bytes one apart (block amax at a power-of-two boundary), at most this share


def _operands(variant: Any, problem: tuple[int, int, int, int], seed: int) -> tuple[np.ndarray, ...]:
    """Random codes (FP8, or packed FP4 pairs: every nibble) and random scales (compact form: E8M0 bytes, or
    NVFP4's positive E4M3 values) for `problem` = (L, M, N, K); NVFP4 adds its alpha (NVFP4_ALPHA). bf16 operands
    (sf_vec_size 0) come with empty scales."""
    import jax.numpy as jnp

    l, m, n, k = problem
    rng = np.random.default_rng(seed)
    if variant.sf_vec_size == 0:
        a, b = ((rng.standard_normal((l, rows, k)) * 4).astype(jnp.bfloat16) for rows in (m, n))
        return a, b, np.zeros((l, m, 0), np.uint8), np.zeros((l, n, 0), np.uint8)
    if variant.ab_dtype == "float4_e2m1fn":
        a = rng.integers(0, 256, (l, m, k // 2), dtype=np.uint8)
        b = rng.integers(0, 256, (l, n, k // 2), dtype=np.uint8)
    else:
        ab = jnp.dtype(variant.ab_dtype)
        a = (rng.standard_normal((l, m, k)) * 4).astype(ab)
        b = (rng.standard_normal((l, n, k)) * 4).astype(ab)
    kb = -(-k // variant.sf_vec_size)
    narrow = variant.c_dtype in NARROW_C  # |C| mostly within a few decades below the C dtype's largest value
    if variant.sf_dtype == "float8_e4m3fn":
        lo, hi = (-5, -1) if narrow else (-4, 4)
        sfa, sfb = (np.exp2(rng.uniform(lo, hi, (l, mn, kb))).astype(jnp.float8_e4m3fn) for mn in (m, n))
    else:
        lo, hi = (121, 126) if narrow else (120, 135)  # 2^-6 .. 2^-2, else 2^-7 .. 2^7: non-trivial, no overflow
        sfa = rng.integers(lo, hi, (l, m, kb), dtype=np.uint8)
        sfb = rng.integers(lo, hi, (l, n, kb), dtype=np.uint8)
    if variant.sf_dtype == "float8_e4m3fn":
        return a, b, sfa, sfb, np.float32(NVFP4_ALPHA)
    return a, b, sfa, sfb


def decode_problems(variant: Any) -> tuple[tuple[int, int, int, int], ...]:
    """The (L, M, N, K) problems of a weight_stream (decode) `variant`, run through gemm_amax with a small M: one
    token; the variant's full token capacity with L = 3 and a K whose chunks wrap every warp's shared-memory ring twice
    before a tail; a partial token tile. N is never a multiple of the CTA's rows, always one of 8 (16-byte C rows)."""
    from jax_blockgemm.kernels import weight_stream

    tokens = variant.tile_mn[1]
    kernel = weight_stream.WeightStreamGemm(w_dtype=variant.ab_dtype, sf_vec_size=variant.sf_vec_size,
                                            sf_dtype=variant.sf_dtype, tile=variant.tile_mn)
    k_wrap = 2 * kernel.stages * weight_stream.WARPS * kernel.chunk + K_TAIL  # chunk: codes of a row per K-chunk
    return (1, 1, 200, K_TAIL), (3, tokens, 136, k_wrap), (2, max(1, tokens - 3), 72, 544)


def problems(variant: Any) -> tuple[tuple[int, int, int, int], ...]:
    """The (L, M, N, K) problems a gemm_amax `variant` is checked on: tails everywhere its layouts allow."""
    if getattr(variant, "op", "gemm_amax") == "weight_stream":
        return decode_problems(variant)
    if (getattr(variant, "a_major", "k"), getattr(variant, "b_major", "k")) != ("k", "k"):
        return MN_PROBLEMS
    return NARROW_C_PROBLEMS if variant.c_dtype in BYTE_C else PROBLEMS


def grid_problems(variant: Any) -> tuple[tuple[tuple[int, int, int, int], int], ...]:
    """((L, M, N, K), grid CTAs) problems for a kernel that takes its grid size (sm_100a), else none: L = 3 and two
    cluster rows of tiles, so that with the grid capped to one cluster each CTA walks 6 tiles (both accumulator
    buffers, three times each); every CTA of the cluster gets rows and columns in bounds (tails of 48 in M and N,
    multiples of 16 for MN-major operands and 16-byte C rows); K wraps the stage ring twice, with a tail."""
    from jax_blockgemm.kernels import catalog

    cluster_ctas = catalog.grid_cluster_ctas(variant) if isinstance(variant, catalog.KernelVariant) else 0
    if not cluster_ctas:
        return ()
    (tile_m, tile_n), (cluster_m, cluster_n) = variant.tile_mn, variant.cluster_mn
    k = 2 * sm100.MAX_AB_STAGES * sm100.TILE_K[variant.ab_dtype] + K_TAIL
    return ((3, 2 * cluster_m * tile_m - 48, cluster_n * tile_n - 48, k), cluster_ctas),


@contextlib.contextmanager
def _grid_capped(ctas: int | None):
    """Programs instantiated in this block launch the persistent kernels on a grid of at most `ctas` CTAs."""
    if ctas is None:
        yield
        return
    saved = os.environ.get(GRID_ENV)
    os.environ[GRID_ENV] = str(ctas)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(GRID_ENV, None)
        else:
            os.environ[GRID_ENV] = saved


def _sf_vec_size(args: Sequence[Any]) -> int:
    """The scale block of compact-form operands (a, b, sfa, sfb): K over the scale columns (packed FP4 counts 2)."""
    k = args[0].shape[-1] * (2 if np.dtype(args[0].dtype) == np.uint8 else 1)
    return k // args[2].shape[-1]


def _magnitudes(codes: np.ndarray) -> np.ndarray:
    """|codes|: packed FP4 pairs lose both sign bits (bit 3 of each nibble)."""
    return codes & np.uint8(0x77) if np.dtype(codes.dtype) == np.uint8 else np.abs(codes)


def compare(c: np.ndarray, amax: np.ndarray, ref_c: np.ndarray, ref_amax: np.ndarray, ref_abs: np.ndarray,
            c_dtype: str) -> str:
    """'' when the kernel's (c, amax) match the fp32 reference within SPEC §7, else what is wrong.

    `ref_abs` is the reference on |A|, |B| (Σ|products| per element): each element may be off by
    C_REL_TOLERANCE of it (what FP8 tensor cores may lose in one dot product), plus the rounding into `c_dtype`
    (C_ROUNDING: half an ulp, relative or near zero absolute), against the fp32 reference clipped to the largest
    value of a saturating C dtype. `c` is in float (packed FP4 C unpacked). Elementwise, so one wrong element fails
    even where a few huge elements dominate the norm.
    """
    c, amax = np.asarray(c, np.float64), np.asarray(amax, np.float64).reshape(-1)
    ref_c, ref_amax = np.asarray(ref_c, np.float64), np.asarray(ref_amax, np.float64).reshape(-1)
    ref_abs = np.asarray(ref_abs, np.float64)
    if c.shape != ref_c.shape or amax.shape != ref_amax.shape:
        return f"shapes c {c.shape}, amax {amax.shape}; expected {ref_c.shape}, {ref_amax.shape}"
    if not np.isfinite(c).all() or not np.isfinite(amax).all():
        return f"{int((~np.isfinite(c)).sum())} non-finite C elements (unwritten or NaN), amax {amax.tolist()}"
    half_ulp, half_subnormal, saturate = C_ROUNDING[c_dtype]
    bound = C_REL_TOLERANCE * ref_abs + 1e-30
    if half_ulp:  # half the code spacing of the binade the kernel's fp32 value may be in, at least near zero's
        top = np.abs(ref_c) + bound
        binade = np.exp2(np.floor(np.log2(np.maximum(top, 1e-38))))
        bound = bound + (1 + 1e-3) * np.maximum(half_ulp * binade, half_subnormal)
    if saturate is not None:
        ref_c = np.clip(ref_c, -saturate, saturate)
    err = np.abs(c - ref_c)
    bad = err > bound
    if bad.any():
        worst = np.unravel_index(np.argmax(err / bound), c.shape)
        return (f"{int(bad.sum())} of {c.size} C elements off, worst at {tuple(int(i) for i in worst)}: "
                f"{c[worst]:.6g} against {ref_c[worst]:.6g}")
    rel = float(np.linalg.norm(c - ref_c) / max(np.linalg.norm(ref_c), 1e-300))
    if c_dtype == "float32" and not rel <= C_REL_TOLERANCE:
        return f"C relative error {rel:.3g} > {C_REL_TOLERANCE:g}"
    amax_err = np.abs(amax - ref_amax) / np.maximum(ref_amax, 1e-300)
    if not (amax_err <= AMAX_REL_TOLERANCE).all():
        return f"amax {amax.tolist()} against reference {ref_amax.tolist()}"
    return ""


@contextlib.contextmanager
def _forced_and_poisoned(variant: Any):
    """Lowerings in this block use `variant` itself, and their FFI calls poison the outputs before each launch."""
    from jax_blockgemm import dispatch

    saved = os.environ.get(POISON_ENV)
    os.environ[POISON_ENV] = "1"  # read when XLA instantiates the call: unwritten elements come back poisoned
    try:
        with dispatch.forced_variants((variant,)):
            yield
    finally:
        if saved is None:
            os.environ.pop(POISON_ENV, None)
        else:
            os.environ[POISON_ENV] = saved


def api_call(variant: Any, args: Sequence[Any], *, implementation: str = "cutedsl"
             ) -> tuple[Callable[..., Any], list]:
    """(gemm_amax with `variant`'s C dtype, scale block, majors and NVFP4 alpha bound; the operands a, b, sfa, sfb as
    that call takes them) for `_operands(variant, ...)`: how the self-check calls the public API."""
    from jax_blockgemm import api

    a_major, b_major = getattr(variant, "a_major", "k"), getattr(variant, "b_major", "k")
    args, alpha = list(args[:4]), args[4] if len(args) > 4 else None
    if a_major == "m":  # K-major (L, MN, K); an MN-major kernel reads its operand as (L, K, MN)
        args[0] = np.swapaxes(args[0], 1, 2)
    if b_major == "n":
        args[1] = np.swapaxes(args[1], 1, 2)
    fn = functools.partial(api.gemm_amax, c_dtype=variant.c_dtype, sf_vec_size=variant.sf_vec_size,
                           a_major=a_major, b_major=b_major, alpha=alpha, implementation=implementation)
    return fn, args


def _run_kernel(variant: Any, args: Sequence[Any], device: Any) -> tuple[np.ndarray, np.ndarray]:
    """(c, amax) of `variant` itself (forced through dispatch) on `device`, outputs poisoned before the launch."""
    import jax

    call, args = api_call(variant, args)
    args = [jax.device_put(x, device) for x in args]
    fn = jax.jit(call)
    with _forced_and_poisoned(variant):
        c, amax = fn(*args)
        if variant.c_dtype == "float4_e2m1fn":  # packed pairs -> one E2M1 value per element
            from jax_blockgemm import formats

            c = formats.unpack_fp4(c)
        c, amax = np.asarray(c), np.asarray(amax)
    return c, amax


@functools.lru_cache(maxsize=None)
def _reference_program(sf_vec_size: int) -> Callable[..., Any]:
    """The XLA reference gemm_amax with fp32 C, jitted once per scale block: a problem's call on the operands and on
    their magnitudes (same shapes), and problems of equal shapes, share a compile. Takes a, b, sfa, sfb, alpha."""
    import jax

    from jax_blockgemm import api

    return jax.jit(lambda a, b, sfa, sfb, alpha: api.gemm_amax(a, b, sfa, sfb, c_dtype=np.float32,
                                                               sf_vec_size=sf_vec_size, alpha=alpha,
                                                               implementation="xla"))


def _run_reference(args: Sequence[Any], device: Any) -> tuple[np.ndarray, np.ndarray]:
    """(c, amax) of the XLA reference with fp32 C on `device` (args: a, b, sfa, sfb[, NVFP4's alpha])."""
    import jax

    alpha = args[4] if len(args) > 4 else None
    operands = [jax.device_put(x, device) for x in args[:4]]
    c, amax = _reference_program(_sf_vec_size(operands))(*operands, alpha)
    return np.asarray(c), np.asarray(amax)


def _run_nvidia(variant: Any, args: Sequence[Any], device: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """(c, amax) of NVIDIA's own kernel (nvidia-cudnn-frontend's `gemm_amax_jax_sm100`) on the same operands, the
    second oracle; None where it does not apply: not an sm_100a MXFP8 K-major variant with f32/bf16 C, L != 1, or
    the wheel not importable or its kernel failing (that is NVIDIA's problem, not a verdict on ours)."""
    if (variant.arch, variant.a_major, variant.b_major) != ("sm_100a", "k", "k") or variant.sf_vec_size != 32 \
            or variant.ab_dtype not in ("float8_e4m3fn", "float8_e5m2") or variant.c_dtype not in ("float32",
                                                                                                  "bfloat16"):
        return None
    if args[0].shape[0] != 1:
        return None
    try:
        import jax
        import jax.numpy as jnp
        from cudnn.gemm.cutedsl.dense.amax.jax_api import gemm_amax_jax_sm100

        from jax_blockgemm import formats

        a, b, sfa, sfb = (jax.device_put(x, device) for x in args)
        seed = lambda x: jnp.moveaxis(x, 0, 2)  # (L, MN, K) -> the seed's (MN, K, L)
        c, amax = gemm_amax_jax_sm100(seed(a), seed(b), formats.to_scale_atom(sfa), formats.to_scale_atom(sfb),
                                      c_dtype=jnp.dtype(variant.c_dtype), mma_tiler_mn=tuple(variant.tile_mn),
                                      cluster_shape_mn=tuple(variant.cluster_mn), sf_vec_size=32)
        return np.asarray(jnp.moveaxis(c, 2, 0)), np.asarray(amax).reshape(1)
    except Exception:  # noqa: BLE001 -- no second oracle here; the reference remains the judge
        return None


def run_problems(variant: Any, device: Any, *, run_kernel: Callable = _run_kernel,
                 run_reference: Callable = _run_reference, run_second_oracle: Callable = _run_nvidia) -> str:
    """'' when `variant` matches the reference on every problem of `problems(variant)` and `grid_problems(variant)`
    (their grids capped) on `device`, and NVIDIA's own kernel where it applies (`_run_nvidia`), else the first
    failure."""
    checks = [(problem, None) for problem in problems(variant)] + list(grid_problems(variant))
    for i, (problem, grid_ctas) in enumerate(checks):
        args = _operands(variant, problem, seed=i)
        where = f"(L, M, N, K) = {problem}" + (f" on {grid_ctas} CTAs" if grid_ctas else "")
        try:
            with _grid_capped(grid_ctas):
                c, amax = run_kernel(variant, args, device)
        except Exception as e:  # a kernel that cannot even launch is a failed check, not a crash of the caller
            return f"{where}: raised {type(e).__name__}: {e}"
        ref_c, ref_amax = run_reference(args, device)
        ref_abs, _ = run_reference((_magnitudes(args[0]), _magnitudes(args[1]), *args[2:]), device)
        why = compare(c, amax, ref_c, ref_amax, ref_abs, variant.c_dtype)
        if why:
            return f"{where}: {why}"
        second = run_second_oracle(variant, args, device) if grid_ctas is None else None
        if second is not None:
            why = compare(c, amax, *second, ref_abs, variant.c_dtype)
            if why:
                return f"{where}: against NVIDIA's gemm_amax_jax_sm100: {why}"
    return ""


# --- ragged (grouped) gemm_amax -------------------------------------------------------------------------
# (T, N, K, group sizes): a row tile shared by three groups, an empty group, a one-token group and rows of no group;
# one group holding every token (T not a multiple of the tile); groups of 129, 127, 90 and 38 rows straddling tiles
# (with the others, group-local items in each of the swap_ab MoE tile's wgmma widths: 32, 64, 96, 128), L = 1.
# N and K tails as in NARROW_C_PROBLEMS (N a multiple of 32: 16-byte C rows of every C dtype).
RAGGED_PROBLEMS = ((200, 160, 96, (40, 0, 1, 30, 100)), (300, 288, 160, (0, 300, 0)),
                   (384, 224, 512, (129, 127, 90, 38)))
# ... and for the swap_ab kernel's decode tiles (16, 32 or 64 tokens: decode-sized calls as one group), those within
# the tile: full tiles, rows of no group past a group, one token; N off the 64-row tile, K off the 256-column padding;
# K's 256-column groups against the tiles' K parts (three at 16 and 32 tokens, two at 64): 1 to 6 groups.
RAGGED_DECODE_PROBLEMS = ((32, 160, 96, (32,)), (29, 288, 512, (20,)), (1, 224, 160, (1,)), (64, 136, 544, (64,)),
                          (37, 200, 1024, (30,)), (16, 136, 1312, (16,)), (11, 200, 800, (9,)),
                          (13, 96, 448, (13,)), (7, 80, 1088, (7,)),
                          # MoE decode: a few tokens over several experts (empty and one-token groups, rows of none)
                          (32, 96, 256, (5, 0, 20, 7)), (29, 72, 512, (3, 1, 0, 12, 9)), (61, 160, 288, (30, 0, 1, 25)),
                          (16, 72, 544, (5, 0, 1, 10)))


def ragged_api_call(variant: Any, args: Sequence[Any], *, implementation: str = "cutedsl"
                    ) -> tuple[Callable[..., Any], list]:
    """(ragged_gemm_amax with `variant`'s C dtype, scale block and NVFP4 alpha bound; its operands a, b, sfa, sfb,
    group_sizes) for `_operands(variant, (1, T, G·N, K))` and the sizes (args[-1]). bf16 variants: `ragged.grouped_dot`
    with the weights as the variant's b_major reads them; its operands a, b, group_sizes."""
    from jax_blockgemm import api, ragged

    *args, sizes = args
    alpha = args[4] if len(args) > 4 else None
    a, b, sfa, sfb = (x[0] for x in args[:4])
    g = len(sizes)
    b = b.reshape(g, -1, b.shape[-1])
    if variant.sf_vec_size == 0:
        b = b if variant.b_major == "k" else np.ascontiguousarray(np.swapaxes(b, 1, 2))
        fn = functools.partial(ragged.grouped_dot, w_major=variant.b_major, implementation=implementation)
        return fn, [a, b, np.asarray(sizes, np.int32)]
    sfb = sfb.reshape(g, -1, sfb.shape[-1])
    fn = functools.partial(api.ragged_gemm_amax, c_dtype=variant.c_dtype, sf_vec_size=variant.sf_vec_size,
                           alpha=alpha, implementation=implementation)
    return fn, [a, b, sfa, sfb, np.asarray(sizes, np.int32)]


def _run_ragged(variant: Any, args: Sequence[Any], device: Any, implementation: str = "cutedsl"
                ) -> tuple[np.ndarray, np.ndarray]:
    """(c, amax) of ragged_gemm_amax on `device` with the variant's C (packed FP4 C unpacked): `variant` itself
    (forced, outputs poisoned before the launch) with "cutedsl", the reference with "xla"."""
    import jax

    from jax_blockgemm import formats

    call, operands = ragged_api_call(variant, args, implementation=implementation)
    fn = jax.jit(functools.partial(call, c_dtype=variant.c_dtype))
    operands = [jax.device_put(x, device) for x in operands]
    with _forced_and_poisoned(variant) if implementation == "cutedsl" else contextlib.nullcontext():
        c, amax = fn(*operands)
        c = formats.unpack_fp4(c) if variant.c_dtype == "float4_e2m1fn" else c
        return np.asarray(c), np.asarray(amax)


def _ragged_references(variant: Any, args: Sequence[Any], device: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(c, amax, |c| bound) of the XLA reference with fp32 C on `device`: on `args`, and on their codes' magnitudes
    (`_magnitudes`: the sum of |a·b| that bounds each element's rounding), through one compiled program (same
    shapes, so the second call reuses the first's compile)."""
    import jax

    call, operands = ragged_api_call(variant, args, implementation="xla")
    magnitudes = (_magnitudes(args[0]), _magnitudes(args[1]), *args[2:])
    _, magnitude_operands = ragged_api_call(variant, magnitudes, implementation="xla")
    fn = jax.jit(functools.partial(call, c_dtype="float32"))
    c, amax = fn(*(jax.device_put(x, device) for x in operands))
    c_abs, _ = fn(*(jax.device_put(x, device) for x in magnitude_operands))
    return np.asarray(c), np.asarray(amax), np.asarray(c_abs)


def run_ragged_problems(variant: Any, device: Any, *, run_kernel: Callable = _run_ragged) -> str:
    """'' when the grouped kernel `variant` (`run_kernel`) matches the reference (fp32 C, on `device`) on every
    RAGGED_PROBLEMS (RAGGED_DECODE_PROBLEMS for the swap_ab decode tile) within SPEC §7; else the first failure."""
    problems = RAGGED_PROBLEMS
    if variant.tile_mn[0] < 128:  # a tile of fewer tokens than a work item serves only calls that fit in it
        problems = tuple(p for p in RAGGED_DECODE_PROBLEMS if p[0] <= variant.tile_mn[0])
    for i, (t, n, k, sizes) in enumerate(problems):
        args = (*_operands(variant, (1, t, len(sizes) * n, k), seed=i), sizes)
        where = f"(T, N, K) = {(t, n, k)}, group sizes {sizes}"
        try:
            c, amax = run_kernel(variant, args, device)
        except Exception as e:  # a kernel that cannot even launch is a failed check, not a crash of the caller
            return f"{where}: raised {type(e).__name__}: {e}"
        why = compare(c, amax, *_ragged_references(variant, args, device), variant.c_dtype)
        if why:
            return f"{where}: {why}"
    return ""


# --- the grouped contraction (the ragged product's weight gradient) ------------------------------------------
# (T, K, N, group sizes): an empty group, a one-token group, groups ending inside a 64-token k-tile (in its first,
# second, third and fourth 16-token k-step) and one spanning several, rows of no group (which must not count); one
# group holding every token; K and N tails of the 128 tile.
CONTRACTION_PROBLEMS = ((200, 136, 96, (24, 0, 1, 70, 60)), (300, 64, 200, (0, 300, 0)))


def _run_contraction(variant: Any, args: Sequence[Any], device: Any, implementation: str = "cutedsl",
                     c_dtype: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(c, amax) of `contraction.contract_groups` on `device`: `variant` itself (forced, outputs poisoned) with
    "cutedsl", the reference with "xla"; C in `c_dtype` (default the variant's)."""
    import jax

    from jax_blockgemm import contraction

    fn = jax.jit(functools.partial(contraction.contract_groups, c_dtype=np.dtype(c_dtype or variant.c_dtype),
                                   implementation=implementation))
    args = [jax.device_put(x, device) for x in args]
    with _forced_and_poisoned(variant) if implementation == "cutedsl" else contextlib.nullcontext():
        c, amax = fn(*args)
        return np.asarray(c), np.asarray(amax)


def run_contraction_problems(variant: Any, device: Any, *, run_kernel: Callable = _run_contraction) -> str:
    """'' when the grouped contraction `variant` (`run_kernel`) matches the reference (fp32 C, on `device`) on every
    CONTRACTION_PROBLEMS within SPEC §7, with a NaN in a row of no group left out; else the first failure."""
    import jax.numpy as jnp

    for i, (t, k, n, sizes) in enumerate(CONTRACTION_PROBLEMS):
        rng = np.random.default_rng(i)
        x, y = ((rng.standard_normal((t, f)) * 4).astype(jnp.bfloat16) for f in (k, n))
        if sum(sizes) < t:
            x[-1, 0] = np.nan  # a row of no group: never part of a sum
        args = (x, y, np.asarray(sizes, np.int32))
        where = f"(T, K, N) = {(t, k, n)}, group sizes {sizes}"
        try:
            c, amax = run_kernel(variant, args, device)
        except Exception as e:  # a kernel that cannot even launch is a failed check, not a crash of the caller
            return f"{where}: raised {type(e).__name__}: {e}"
        ref_c, ref_amax = _run_contraction(variant, args, device, "xla", "float32")
        ref_abs, _ = _run_contraction(variant, (np.abs(x), np.abs(y), args[2]), device, "xla", "float32")
        why = compare(c.reshape(-1, n), amax, ref_c.reshape(-1, n), ref_amax, ref_abs.reshape(-1, n),
                      variant.c_dtype)
        if why:
            return f"{where}: {why}"
    return ""


# --- the pair quantization of a weight (both MX quantizations in one pass) ------------------------------------
# (B, R, C): one tile, column tails off the 256-column tile, several batches; the first problem carries a NaN, an inf
# and an all-zero block.
QUANTIZE_PAIR_PROBLEMS = ((1, 32, 256), (3, 64, 160), (2, 96, 544))
# The gather schedules' problems: (rows of w, rows of the map, columns); w's rows no multiple of 32
QUANTIZE_PAIR_GATHER_PROBLEMS = ((70, 128, 96), (33, 96, 544), (300, 416, 288))


def random_row_map(rng: np.random.Generator, rows: int, entries: int) -> np.ndarray:
    """A row map of `entries` int32 entries naming each of w's `rows` rows once, in a random order, with empty rows
    between them: -1, and (half of them) entries just past w's rows, which read zeros too."""
    row_map = np.full(entries, -1, np.int32)
    row_map[np.sort(rng.choice(entries, rows, replace=False))] = rng.permutation(rows)
    empty = np.flatnonzero(row_map < 0)
    row_map[empty[: len(empty) // 2]] = rows + rng.integers(0, 5, len(empty) // 2)
    return row_map


def _run_quantize_pair(variant: Any, w: np.ndarray, row_map: np.ndarray | None, device: Any,
                       implementation: str = "cutedsl") -> list:
    """(values, codes, scales) of `quantize_pair` on `device` in the variant's formats and schedule (a row map for
    the gather ones): `variant` itself (forced, outputs poisoned) with "cutedsl", the reference with "xla"; each as
    its raw bits."""
    import jax

    from jax_blockgemm import dispatch, quantize_pair
    from jax_blockgemm.kernels import catalog

    row, col = (dispatch.format_key(dtype, variant.sf_dtype, variant.sf_vec_size)
                for dtype in (variant.ab_dtype, variant.c_dtype))
    fn = jax.jit(functools.partial(quantize_pair.quantize_pair, row_format=row, col_format=col,
                                   col_values=variant.schedule == catalog.GATHER_VALUES,
                                   implementation=implementation))
    with _forced_and_poisoned(variant) if implementation == "cutedsl" else contextlib.nullcontext():
        out = fn(jax.device_put(w, device)) if row_map is None else fn(jax.device_put(w, device), row_map=row_map)
        return [np.asarray(x).view(np.uint16 if x.dtype.itemsize == 2 else np.uint8) for x in out]


def _quantize_pair_inputs(variant: Any, i: int) -> tuple[np.ndarray, np.ndarray | None, str]:
    """Problem i of the variant's schedule: bf16 w spread over 2**-20 .. 2**20 per row and column (the first with a
    NaN, an inf and a zero block), for the gather schedules a row map naming each of w's rows once in a random order
    among empty and out-of-range entries; and where it is, for messages."""
    import jax.numpy as jnp

    gather = variant.schedule != ""
    shape = QUANTIZE_PAIR_GATHER_PROBLEMS[i] if gather else QUANTIZE_PAIR_PROBLEMS[i]
    rng = np.random.default_rng(i)
    w_shape = (shape[0], shape[2]) if gather else shape
    w = rng.standard_normal(w_shape) * np.exp2(rng.integers(-20, 21, (*w_shape[:-1], 1))) \
        * np.exp2(rng.integers(-20, 21, w_shape[-1]))
    if i == 0:
        rows = w.reshape(-1, w_shape[-1])  # a view: the batches' rows one after another
        rows[3, 5], rows[7, 20], rows[:32, 32:64] = np.nan, np.inf, 0.0
    if not gather:
        return w.astype(jnp.bfloat16), None, f"(B, R, C) = {shape}"
    return w.astype(jnp.bfloat16), random_row_map(rng, shape[0], shape[1]), f"(R, R', C) = {shape}"


def run_quantize_pair_problems(variant: Any, device: Any) -> str:
    """'' when the pair-quantization `variant` gives the reference's values, codes and scale bytes bit for bit on
    every problem of its schedule (`_quantize_pair_inputs`); else the first failure."""
    count = len(QUANTIZE_PAIR_GATHER_PROBLEMS if variant.schedule else QUANTIZE_PAIR_PROBLEMS)
    for i in range(count):
        w, row_map, where = _quantize_pair_inputs(variant, i)
        try:
            got = _run_quantize_pair(variant, w, row_map, device)
        except Exception as e:  # a kernel that cannot even launch is a failed check, not a crash of the caller
            return f"{where}: raised {type(e).__name__}: {e}"
        want = _run_quantize_pair(variant, w, row_map, device, "xla")
        for name, g, r in zip(("values", "codes", "scales"), got, want):
            differ = np.argwhere(g != r)
            if differ.size:
                return f"{where}: {name} differ at {len(differ)} places, first at {tuple(differ[0])}"
    return ""


# --- proj_rope ------------------------------------------------------------------------------------------
def _proj_rope_operands(variant: Any, problem: tuple[int, int, int], seed: int) -> tuple[np.ndarray, ...]:
    """Random bf16 x and w (laid out as `variant.b_major` reads it) and rotary tables for (T, H, K)."""
    import jax.numpy as jnp

    t, h, k = problem
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t, k)) * 2).astype(jnp.bfloat16)
    w = (rng.standard_normal((h * 192, k)) / np.sqrt(k)).astype(jnp.bfloat16)
    w = w if variant.b_major == "k" else np.ascontiguousarray(w.T)
    angles = rng.uniform(0, 2 * np.pi, (t, 64))
    return x, w, np.cos(angles).astype(jnp.bfloat16), np.sin(angles).astype(jnp.bfloat16)


def _run_proj_rope_kernel(variant: Any, args: Sequence[Any], device: Any) -> tuple[np.ndarray, ...]:
    """The four outputs of `variant` itself (forced through dispatch) on `device`, poisoned before the launch."""
    import jax

    from jax_blockgemm import api

    args = [jax.device_put(x, device) for x in args]
    fn = jax.jit(functools.partial(api.gemm_proj_rope_mxfp8, w_out_in=variant.b_major == "k",
                                   implementation="cutedsl"))
    with _forced_and_poisoned(variant):
        return tuple(np.asarray(o) for o in fn(*args))


def _run_proj_rope_reference(variant: Any, args: Sequence[Any], device: Any) -> tuple[np.ndarray, ...]:
    """The four outputs of the XLA reference on `device`."""
    import jax

    from jax_blockgemm import api

    args = [jax.device_put(x, device) for x in args]
    fn = jax.jit(functools.partial(api.gemm_proj_rope_mxfp8, w_out_in=variant.b_major == "k", implementation="xla"))
    return tuple(np.asarray(o) for o in fn(*args))


def _e4m3_step(scaled: np.ndarray) -> np.ndarray:
    """The spacing of E4M3 values at |scaled| (3 fraction bits; 2^-9 below the smallest normal 2^-6)."""
    mag = np.abs(scaled)
    exp = np.floor(np.log2(np.where(mag >= 2.0**-6, mag, 1.0)))
    return np.where(mag >= 2.0**-6, 2.0 ** (exp - 3), 2.0**-9)


def compare_proj_rope(outs: Sequence[np.ndarray], ref: Sequence[np.ndarray]) -> str:
    """'' when the kernel's proj_rope outputs match the reference's within SPEC §7, else what is wrong.

    Per direction: scale bytes equal, or one apart on at most SCALE_MISMATCH_FRACTION of the blocks (a block amax at
    a power-of-two boundary, where fp32 summation order decides); every dequantized element within one E4M3 step of
    the reference's (at the coarser of the two scales); at least CODE_MATCH_FRACTION of the codes identical. A
    poisoned (unwritten) code is NaN and a poisoned scale byte 0xFE, so both fail.
    """
    names = ("out_fp8_row", "out_scales_row", "out_fp8_col", "out_scales_col")
    for name, got, want in zip(names, outs, ref):
        if np.shape(got) != np.shape(want):
            return f"{name} has shape {np.shape(got)}; expected {np.shape(want)}"
    for direction, codes_at, axis in (("rowwise", 0, -1), ("columnwise", 2, 0)):
        codes, scales = np.asarray(outs[codes_at]), np.asarray(outs[codes_at + 1])
        ref_codes, ref_scales = np.asarray(ref[codes_at]), np.asarray(ref[codes_at + 1])
        apart = np.abs(scales.astype(np.int32) - ref_scales.astype(np.int32))
        if (apart > 1).any() or (apart == 1).mean() > SCALE_MISMATCH_FRACTION:
            where = tuple(int(i) for i in np.unravel_index(np.argmax(apart), apart.shape))
            return (f"{direction} scales: {int((apart > 0).sum())} of {apart.size} bytes differ, worst at {where}: "
                    f"{int(scales[where])} against {int(ref_scales[where])}")

        def dequantized(c, s):
            factor = np.repeat(np.exp2(s.astype(np.float64) - 127), 32, axis=axis)
            values = c.astype(np.float64)
            return values * factor, values, factor

        got, got_codes, got_factor = dequantized(codes, scales)
        want, want_codes, want_factor = dequantized(ref_codes, ref_scales)
        if not np.isfinite(got).all():
            return f"{direction}: {int((~np.isfinite(got)).sum())} non-finite codes (unwritten, or NaN)"
        bound = np.maximum(_e4m3_step(got_codes) * got_factor, _e4m3_step(want_codes) * want_factor)
        off = np.abs(got - want) > bound * (1 + 1e-9)
        if off.any():
            where = tuple(int(i) for i in np.argwhere(off)[0])
            return (f"{direction}: {int(off.sum())} of {off.size} elements off by more than one E4M3 step, first at "
                    f"{where}: {got[where]:.6g} against {want[where]:.6g}")
        same = (codes.view(np.uint8) == ref_codes.view(np.uint8)).mean()
        if same < CODE_MATCH_FRACTION:
            return (f"{direction}: only {same:.2%} of the codes equal the reference's "
                    f"(at least {CODE_MATCH_FRACTION:.0%})")
    return ""


def run_proj_rope_problems(variant: Any, device: Any, *, run_kernel: Callable = _run_proj_rope_kernel,
                           run_reference: Callable = _run_proj_rope_reference) -> str:
    """'' when proj_rope `variant` matches the reference on every PROJ_ROPE_PROBLEMS and PROJ_ROPE_GRID_PROBLEMS
    (their grids capped) on `device`, else the first failure."""
    checks = [(problem, None) for problem in PROJ_ROPE_PROBLEMS] + list(PROJ_ROPE_GRID_PROBLEMS)
    for i, (problem, grid_ctas) in enumerate(checks):
        args = _proj_rope_operands(variant, problem, seed=i)
        where = f"(T, H, K) = {problem}" + (f" on {grid_ctas} CTAs" if grid_ctas else "")
        try:
            with _grid_capped(grid_ctas):
                outs = run_kernel(variant, args, device)
        except Exception as e:  # a kernel that cannot even launch is a failed check, not a crash of the caller
            return f"{where}: raised {type(e).__name__}: {e}"
        why = compare_proj_rope(outs, run_reference(variant, args, device))
        if why:
            return f"{where}: {why}"
    return ""


# --- dequantize (MXFP8 -> bf16: the MXFP8 proj_rope path's first launch, the swap_ab ragged kernel's tokens) ---
# (rows, cols, scale axis of operand 0, paired second operand (rows, cols) or None): scales along rows and along
# columns, a lone operand and a pair in one launch, sizes that leave partial CTAs.
DEQUANTIZE_PROBLEMS = ((96, 224, -1, (64, 160)), (160, 96, -2, (32, 96)), (1000, 64, -1, None))
# The swap_ab order's object (the swap_ab ragged kernel's tokens) takes columns in whole 128-column tiles: a pair with
# partial CTAs, and one tile alone.
SWAP_AB_DEQUANTIZE_PROBLEMS = ((200, 512, -1, (40, 384)), (3, 128, -1, None))


def _dequantize_p():
    """A one-off primitive whose CUDA lowering is one forced dequantize launch (the self-check's handle on it)."""
    import jax
    from jax.extend import core as jex_core
    from jax.interpreters import mlir

    from jax_blockgemm import ffi_lowering

    p = jex_core.Primitive("jbg_selfcheck_dequantize")
    p.multiple_results = True
    p.def_abstract_eval(lambda *ops, variant, scale_axis: [jax.core.ShapedArray(c.shape, np.dtype("bfloat16"))
                                                          for c in ops[::2]])

    def lowering(ctx, *ops, variant, scale_axis):
        pairs = [tuple(ops[i:i + 2]) for i in range(0, len(ops), 2)]
        avals = [tuple(ctx.avals_in[i:i + 2]) for i in range(0, len(ops), 2)]
        return ffi_lowering.emit_dequantize(ctx, pairs, avals=avals, variants=(variant,), scale_axis=scale_axis)

    mlir.register_lowering(p, lowering, platform="cuda")
    return p


_DEQUANTIZE_P = None


def _dequantize_operands(rows: int, cols: int, scale_axis: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    import ml_dtypes

    codes = np.clip(rng.standard_normal((rows, cols)) * 64, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    shape = (rows, cols // 32) if scale_axis == -1 else (rows // 32, cols)
    return codes, rng.integers(100, 155, shape, dtype=np.uint8)  # 2^-27 .. 2^27, exact in bf16


def _dequantize_expected(codes: np.ndarray, scales: np.ndarray, scale_axis: int, swap_ab: bool) -> np.ndarray:
    """code x 2^(byte - 127), exact in float64, rounded once to bf16 (exact here: the scales keep it normal); with
    `swap_ab`, the columns in the swap_ab ragged kernel's order (`swap_ab_layout.swap_ab_columns`)."""
    import ml_dtypes

    factor = np.repeat(np.exp2(scales.astype(np.float64) - 127), 32, axis=scale_axis)
    values = (codes.astype(np.float64) * factor).astype(ml_dtypes.bfloat16)
    if not swap_ab:
        return values
    from jax_blockgemm import swap_ab_layout

    return values[:, swap_ab_layout.swap_ab_columns(values.shape[-1])]


def run_dequantize_problems(variant: Any, device: Any) -> str:
    """'' when dequantize `variant` gives the exact bf16 values on every DEQUANTIZE_PROBLEMS, else the first failure.
    Outputs are poisoned (NaN) before each launch."""
    import jax

    from jax_blockgemm.kernels import catalog

    global _DEQUANTIZE_P
    _DEQUANTIZE_P = _DEQUANTIZE_P or _dequantize_p()
    scale_axis = -1 if variant.a_major == "k" else -2
    swap_ab = variant.schedule == catalog.SWAP_AB  # both operands written in the swap_ab order
    for i, (rows, cols, _, paired) in enumerate(SWAP_AB_DEQUANTIZE_PROBLEMS if swap_ab else DEQUANTIZE_PROBLEMS):
        problem = (rows, cols, scale_axis, paired)
        if scale_axis == -2 and rows % 32:
            continue  # scales along rows need whole 32-row blocks
        rng = np.random.default_rng(i)
        operands = [_dequantize_operands(rows, cols, scale_axis, rng)]
        if paired is not None:
            operands.append(_dequantize_operands(*paired, -1, rng))
        args = [jax.device_put(x, device) for pair in operands for x in pair]
        fn = jax.jit(functools.partial(_DEQUANTIZE_P.bind, variant=variant, scale_axis=scale_axis))
        try:
            with _forced_and_poisoned(variant):
                outs = [np.asarray(o) for o in fn(*args)]
        except Exception as e:  # noqa: BLE001 -- a kernel that cannot launch is a failed check
            return f"(rows, cols, axis, paired) = {problem}: raised {type(e).__name__}: {e}"
        for j, ((codes, scales), got) in enumerate(zip(operands, outs)):
            want = _dequantize_expected(codes, scales, scale_axis if j == 0 else -1, swap_ab)
            bad = got.view(np.uint16) != want.view(np.uint16)
            if bad.any():
                where = tuple(int(x) for x in np.argwhere(bad)[0])
                return (f"(rows, cols, axis, paired) = {problem}, operand {j}: {int(bad.sum())} of {bad.size} "
                        f"values differ, first at {where}: {float(got[where])} against {float(want[where])}")
    return ""


def run_check(variant: Any, device: Any) -> str:
    """'' when `variant` passes every problem of its operation on `device`, else the first failure."""
    runners = {"gemm_amax": run_problems, "weight_stream": run_problems, "proj_rope": run_proj_rope_problems,
               "dequantize": run_dequantize_problems, "ragged": run_ragged_problems,
               "contraction": run_contraction_problems, "quantize_pair": run_quantize_pair_problems}
    return runners[variant.op](variant, device)


def format_table(verdicts: Sequence[gate.Verdict], expect_fail: Sequence[str] = ()) -> str:
    """A plain-text table of verdicts: kernel, GPU, verdict, where it came from, detail.

    Keys in `expect_fail` (deliberately wrong test kernels) are marked as such, so that their FAIL reads right.
    """
    rows = [("kernel", "device", "verdict", "source", "detail")]
    rows += [(v.key, v.device, ("PASS" if v.ok else "FAIL") + (" (must FAIL)" if v.key in expect_fail else ""),
              v.source, v.detail) for v in verdicts]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows)


def known_variants() -> tuple:
    """The catalog's variants, and any registered by the module that $JAX_BLOCKGEMM_EXTRA_VARIANTS_MODULE names
    (tests register deliberately broken kernels that way; they must FAIL)."""
    from jax_blockgemm.kernels import catalog

    extra = os.environ.get(gate.EXTRA_VARIANTS_ENV)
    if extra:
        importlib.import_module(extra)
    return catalog.CATALOG + catalog.extra_variants()


def _child(key: str, result: pathlib.Path) -> int:
    """Check kernel `key` on this process's first GPU of its arch; write {"ok", "detail"} to `result`."""
    gate.die_with_parent()
    by_key = {v.key: v for v in known_variants()}
    if key not in by_key:
        raise SystemExit(f"--child {key!r}: no such kernel")
    variant = by_key[key]
    device = gate.local_device(variant.arch)
    if device is None:
        detail = f"no GPU of {variant.arch} visible to the check"
    else:
        try:
            detail = run_check(variant, device)
        except Exception as e:  # noqa: BLE001 -- whatever the kernel did, it is this check's outcome
            detail = f"raised {type(e).__name__}: {e}"
    result.write_text(json.dumps({"ok": not detail, "detail": detail or "ok"}))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jax_blockgemm.selfcheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", action="append", default=[], choices=arch.targets(),
                   help="only kernels of this target (repeatable)")
    p.add_argument("--variant", action="append", default=[], metavar="KEY", help="only this key (repeatable)")
    p.add_argument("--force", action="store_true", help="run again even where a verdict is stored")
    p.add_argument("--child", metavar="KEY", help=argparse.SUPPRESS)  # the gate's child process
    p.add_argument("--result", type=pathlib.Path, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Check the selected kernels on the local GPUs through the gate; print one row per kernel.

    Exit status 0 when every real kernel passed and every deliberately broken one failed, 1 otherwise, 2 when
    nothing ran.
    """
    args = _parser().parse_args(argv)
    if args.child:
        return _child(args.child, args.result)
    # This process only enumerates GPUs and compiles objects; its children run the kernels and need the memory.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    candidates = known_variants()
    unknown = sorted(set(args.variant) - {v.key for v in candidates})
    if unknown:
        print(f"unknown kernel key(s): {', '.join(unknown)}; `python -m jax_blockgemm.precompile --list` lists them",
              file=sys.stderr)
        return 2
    chosen = [v for v in candidates if (not args.arch or v.arch in args.arch)
              and (not args.variant or v.key in args.variant)]
    runnable = [v for v in chosen if gate.local_device(v.arch) is not None]
    if not runnable:
        print(f"nothing to check: no local GPU runs any of the {len(chosen)} selected kernels "
              f"(archs {sorted({v.arch for v in chosen})})")
        return 2
    verdicts = [gate.check(v, force=args.force) for v in runnable]
    broken = {v.key for v in runnable if v.flavor}
    print(format_table(verdicts, expect_fail=sorted(broken)))
    return 0 if all(v.ok != (v.key in broken) for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
