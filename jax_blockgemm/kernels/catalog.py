"""The kernel catalog: which CuTeDSL variants exist, and how to build each one's object without a GPU.

Every variant is compiled ahead of time into a relocatable object (`dump_to_object`) whose exported host function
follows its operation's ABI, loaded by our XLA FFI handlers. Each tensor is a `{void *data; int64_t
dynamic_shapes[1];}` struct over a flat buffer.

    gemm_amax: fn(a, b, sfa, sfb, c, amax[, alpha], m, n, k, l[, max_ctas], stream)
      a/b: FP8 codes (or packed FP4 pairs for the sm_100a FP4 variants), (L, M, K) / (L, N, K) K-major; sfa/sfb:
      scale bytes in the SPEC §3 atom layout; c: (L, M, N) row-major; amax: L float32 values the handler zeroes
      first; alpha: NVFP4's (L,) float32 (E4M3-scale variants only, `takes_alpha`); m/n/k/l int32; max_ctas int32,
      sm_100a only (`grid_cluster_ctas`): the CTAs of the persistent grid, a multiple of the cluster size, which the
      handler works out per device (the SM count, and how many clusters the driver says fit at once). The sm_100a
      kernels store C by TMA, so they take rows of C of a multiple of 16 bytes.
    proj_rope: fn(x, w, cos, sin, x_scale, w_scale, row_codes, row_scales, col_codes, col_scales, t, k, h, sms,
                  stream)
      x (T, K); w (H·192, K) for b_major "k", (K, H·192) for "n"; cos/sin (T, 64); x_scale/w_scale: E8M0 bytes laid
      out like x and w (MXFP8 inputs; empty for bf16); the four outputs of SPEC §5, row-major; t/k/h int32; sms
      int32, the device's SM count (the handler reads it from the driver): persistent kernels launch min(tiles, sms)
      CTAs.
    dequantize: fn(codes, scales, out, rows, cols, codes1, scales1, out1, rows1, cols1, stream)
      two operands in one launch: codes (rows, cols) E4M3; out (rows, cols) bf16; scales E8M0 bytes (rows, cols/32)
      for a_major "k" (blocks along the row), (rows/32, cols) for "m" (blocks along the column); operand 1 always
      has its blocks along the row, and rows1 = 0 when there is none; sizes int32 (kernels/dequantize.py). The
      SWAP_AB variant writes every 128 columns of out in the swap_ab ragged kernel's token order.
    weight_stream: fn(x, w, sw, c, amax, alpha, tally, m, n, k, l, sf_atom, stream)
      the decode GEMM (kernels/weight_stream.py): x bf16 (L, M, K) with M at most tile_mn[1]; w codes (L, N, K), or
      packed FP4 (L, N, K/2) uint8; sw the weight's scale bytes, compact (L, N, ceil(K/v)) for sf_atom = 0 or the
      SPEC §3 atom (L, ceil(N/128), ceil(ceil(K/v)/4), 32, 4, 4) for sf_atom = 1; c (L, M, N) row-major; amax L
      float32 values, written whole (nothing zeroes them first); alpha (L,) float32, always passed (ones for the MX
      formats); tally (L,) int64 of the handler's, zero at every launch and left zero by it (the last CTA of a batch
      writes amax from it), or a null pointer where the caller drops amax (then neither computed nor written);
      m/n/k/l and sf_atom int32, k the logical K. tile_mn is (rows of W per CTA, the most rows of x the variant
      takes).
    ragged: fn(a, b, sfa, sfb, items, c, amax, alpha, t, n, k, l, g, max_items, stream)
      the grouped GEMM (kernels/sm90/ragged.py, kernels/sm100/ragged.py): a (L, T, K) codes (packed FP4: (L, T, K/2)
      bytes), tokens sorted by group; b (L·G, N, K) likewise, one weight per group; sfa/sfb their scale bytes in the
      SPEC §3 atom layout of (L, T, K) and (L·G, N, K); items int32 (L, max_items, 4) work items (row tile, group or -1,
      first row, end row), from `ragged.kernel_items` (the bf16 and swap_ab variants: group-local items, from
      `ragged.group_items`, whose first field is 0); c (L, T, N); amax L float32 values the handler zeroes first;
      alpha (L,) float32, always passed (ones for the MX formats); t/n/k/l/g/max_items int32, k the logical K. The bf16
      variants (ab_dtype "bfloat16", sf_dtype "none", sf_vec_size 0) take bf16 a and b, b as (L·G, N, K) for b_major "k"
      or (L·G, K, N) for "n", and read neither sfa, sfb nor alpha (empty buffers). The swap_ab variants (schedule
      SWAP_AB; MXFP8 E4M3, MXFP4 or NVFP4 weights, f32 or bf16 C) take the tokens dequantized to bf16, a (L, T, K
      rounded up to 256), permuted (`swap_ab_layout.swap_ab_tokens`, fp4 for FP4 codes) but for the 16-token tile,
      which orders them itself (`swap_ab_layout.kernel_tokens`), the weights' codes b and
      their scales sfb compact, (L·G, N, ceil(K/v)), or in the SPEC §3 atom of (L·G, N, K); sfa is empty and alpha
      (L·G,) holds one factor per weight; amax's tally follows alpha, and sf_atom (int32: 1 for atoms, else 0)
      follows max_items.
    quantize_pair: fn(w, row_map, values, codes, scales, rows, cols, src_rows, stream)
      both MX quantizations of a bf16 matrix in one pass (kernels/quantize_pair.py): w (src_rows, cols) bf16; values
      (rows, cols) bf16, w quantized with its blocks along the rows in ab_dtype's format, as code·scale; codes
      (src_rows, cols) in c_dtype's FP8 format and scales uint8 (src_rows, cols / 32), w quantized with its blocks
      along the columns; rows and cols int32, multiples of 32. The plain schedule reads row_map not at all (src_rows
      = rows); GATHER reads row i of the row blocks from w's row row_map[i] (int32 (rows,); zeros where negative) and
      writes the column blocks of the rows it names; GATHER_VALUES likewise, with codes bf16 code·scale.
    contraction: fn(x, y, bounds, c, amax, t, k, n, l, g, stream)
      the per-group contraction over tokens, the weight gradient of a ragged product (kernels/sm90/contraction.py):
      x bf16 (L, T, K) and y bf16 (L, T, N), tokens sorted by group; bounds int32 (L, G, 2), the rows [start, end)
      of each group; c (L, G, K, N) row-major, c[l, g] = x[l, rows of g]ᵀ · y[l, rows of g] (0 for an empty group);
      amax L float32 values the handler zeroes first; t/k/n/l/g int32. c may hold 2**31 elements or more (it is
      addressed in 64 bits); one (K, N) slice and every other buffer may not.

The target architecture is a property of the DSL singleton (`CUTE_DSL_ARCH` is read once, when the singleton is
built, or detected from the GPU); `compile_variant` sets it for the duration of each compile, so one process can
build objects for several architectures.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
import re
import tempfile
import threading
from typing import Any, Callable

import cutlass  # noqa: F401  (an ImportError here tells the dispatcher that CuTeDSL is missing)

from jax_blockgemm import arch
from jax_blockgemm.kernels import sm100 as _sm100
from jax_blockgemm.kernels.sm90 import ragged_swap_ab as _ragged_swap_ab

_SHORT = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2", "float4_e2m1fn": "e2m1", "float32": "f32",
          "bfloat16": "bf16", "float16": "f16"}
E8M0 = "float8_e8m0fnu"
OPS = ("gemm_amax", "proj_rope", "dequantize", "weight_stream", "ragged", "contraction", "quantize_pair")
_COMPILE_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class KernelVariant:
    """One compiled kernel: operation, target architecture, dtypes and tiling."""

    op: str = "gemm_amax"
    arch: str = "sm_90a"
    ab_dtype: str = "float8_e4m3fn"
    c_dtype: str = "float32"
    sf_vec_size: int = 32
    tile_mn: tuple = (128, 128)
    cluster_mn: tuple = (1, 1)
    flavor: str = ""  # "" for real kernels; names a deliberately broken one (`register_extra_variant`)
    sf_dtype: str = E8M0  # the scale format: E8M0 (MX formats), or E4M3 (NVFP4)
    b_major: str = "k"  # "n": B (proj_rope's w, gemm_amax's b) is read MN-major
    a_major: str = "k"  # "m": gemm_amax's A is read MN-major
    # "" for every kernel but sm_90a proj_rope's, whose persistent kernel with an epilogue warpgroup is "staged",
    # the sm_90a ragged kernels that convert only the weights (SWAP_AB), and the dequantize kernel of their tokens
    schedule: str = ""
    k_split: int = 1  # SWAP_AB decode tiles: parts of K, each its own MMA warpgroups on the same weight rows

    @property
    def key(self) -> str:
        """Unique, filesystem-safe name, e.g. 'gemm_amax.sm_90a.e4m3.f32.sf32.t128x128.c1x1' (or '...sf16e4m3...',
        '.bn' for an N-major B, '.<schedule>' for a non-default schedule, '.k2' for K split in two parts (.k3 three),
        '.<flavor>' for a test variant)."""
        sf = "" if self.sf_dtype == E8M0 else _SHORT.get(self.sf_dtype, self.sf_dtype)
        return (f"{self.op}.{self.arch}.{_SHORT.get(self.ab_dtype, self.ab_dtype)}."
                f"{_SHORT.get(self.c_dtype, self.c_dtype)}.sf{self.sf_vec_size}{sf}."
                f"t{self.tile_mn[0]}x{self.tile_mn[1]}.c{self.cluster_mn[0]}x{self.cluster_mn[1]}"
                + ("" if self.a_major == "k" else f".a{self.a_major}")
                + ("" if self.b_major == "k" else f".b{self.b_major}")
                + (f".{self.schedule}" if self.schedule else "")
                + (f".k{self.k_split}" if self.k_split > 1 else "")
                + (f".{self.flavor}" if self.flavor else ""))

    @property
    def function_prefix(self) -> str:
        """A C identifier derived from `key`: the exported function's name in the object."""
        return "jbg_" + re.sub(r"[^0-9A-Za-z_]", "_", self.key)


def takes_alpha(v: KernelVariant) -> bool:
    """Whether variant `v`'s exported function takes NVFP4's alpha tensor (after amax): the E4M3-scale gemm_amax
    kernels (the handler passes alpha = 1 when the call has none)."""
    return v.op == "gemm_amax" and v.sf_dtype == "float8_e4m3fn"


def grid_cluster_ctas(v: KernelVariant) -> int:
    """0 when variant `v`'s exported function takes no grid size; else the CTAs of one of its clusters: the sm_100a
    gemm_amax kernels take max_ctas after l, and the handler sizes it in whole clusters."""
    if v.op != "gemm_amax" or v.arch != "sm_100a":
        return 0
    return v.cluster_mn[0] * v.cluster_mn[1]


def _hopper_factory(v: KernelVariant) -> Any:
    from jax_blockgemm.kernels.sm90.gemm_amax import HopperGemmAmaxAlpha, HopperMxf8GemmAmax

    cls = HopperGemmAmaxAlpha if takes_alpha(v) else HopperMxf8GemmAmax
    # one tile and no clusters: every sm_90a gemm_amax variant is keyed t128x128.c1x1
    return cls(ab_dtype=v.ab_dtype, c_dtype=v.c_dtype, sf_vec_size=v.sf_vec_size, sf_dtype=v.sf_dtype,
               a_major=v.a_major, b_major=v.b_major)


def _blackwell_factory(v: KernelVariant) -> Any:
    from jax_blockgemm.kernels.sm100.gemm_amax import (BlackwellBlockScaledGemmAmax,
                                                       BlackwellBlockScaledGemmAmaxAlpha)

    cls = BlackwellBlockScaledGemmAmaxAlpha if takes_alpha(v) else BlackwellBlockScaledGemmAmax
    return cls(ab_dtype=v.ab_dtype, c_dtype=v.c_dtype, tile_mn=v.tile_mn, cluster_mn=v.cluster_mn,
               sf_vec_size=v.sf_vec_size, sf_dtype=v.sf_dtype, a_major=v.a_major, b_major=v.b_major)


def _hopper_proj_rope_factory(v: KernelVariant) -> Any:
    from jax_blockgemm.kernels.sm90.proj_rope import HopperProjRope

    return HopperProjRope(x_dtype=v.ab_dtype, w_major=v.b_major)


def _blackwell_proj_rope_factory(v: KernelVariant) -> Any:
    from jax_blockgemm.kernels.sm100.proj_rope import BlackwellProjRope

    return BlackwellProjRope(x_dtype=v.ab_dtype, w_major=v.b_major)


def _dequantize_factory(v: KernelVariant) -> Any:
    from jax_blockgemm.kernels.dequantize import MxDequantize

    return MxDequantize(scale_axis=1 if v.a_major == "k" else 0, swap_ab_order=v.schedule == SWAP_AB)


def _ragged_factory(v: KernelVariant) -> Any:
    from jax_blockgemm.kernels.sm90.ragged import HopperRaggedBf16Gemm, HopperRaggedGemmAmax
    from jax_blockgemm.kernels.sm90.ragged_swap_ab import HopperRaggedSwapAB

    if v.schedule == SWAP_AB:
        return HopperRaggedSwapAB(c_dtype=v.c_dtype, token_rows=v.tile_mn[0], weight_warpgroups=v.tile_mn[1] // 64,
                                  k_split=v.k_split, w_dtype=v.ab_dtype, sf_vec_size=v.sf_vec_size, sf_dtype=v.sf_dtype)
    if v.ab_dtype == "bfloat16":
        return HopperRaggedBf16Gemm(c_dtype=v.c_dtype, b_major=v.b_major, tile_n=v.tile_mn[1])
    return HopperRaggedGemmAmax(ab_dtype=v.ab_dtype, c_dtype=v.c_dtype, sf_vec_size=v.sf_vec_size,
                                sf_dtype=v.sf_dtype)


def _blackwell_ragged_factory(v: KernelVariant) -> Any:
    from jax_blockgemm.kernels.sm100.ragged import BlackwellRaggedGemmAmax

    return BlackwellRaggedGemmAmax(ab_dtype=v.ab_dtype, c_dtype=v.c_dtype, sf_vec_size=v.sf_vec_size,
                                   sf_dtype=v.sf_dtype)


def _contraction_factory(v: KernelVariant) -> Any:
    from jax_blockgemm.kernels.sm90.contraction import HopperGroupedContraction

    return HopperGroupedContraction(c_dtype=v.c_dtype)


def _quantize_pair_factory(v: KernelVariant) -> Any:
    from jax_blockgemm.kernels.quantize_pair import MxQuantizePair

    return MxQuantizePair(row_dtype=v.ab_dtype, col_dtype=v.c_dtype, gather=v.schedule in (GATHER, GATHER_VALUES),
                          col_values=v.schedule == GATHER_VALUES)


def _weight_stream_factory(v: KernelVariant) -> Any:
    from jax_blockgemm.kernels.weight_stream import WeightStreamGemm

    return WeightStreamGemm(w_dtype=v.ab_dtype, c_dtype=v.c_dtype, sf_vec_size=v.sf_vec_size, sf_dtype=v.sf_dtype,
                            tile=v.tile_mn)


# (op, arch) -> builds the kernel object (a class instance with `can_implement` and a `@cute.jit` __call__).
_FACTORIES: dict[tuple[str, str], Callable[[KernelVariant], Any]] = {
    ("gemm_amax", "sm_90a"): _hopper_factory, ("gemm_amax", "sm_100a"): _blackwell_factory,
    ("proj_rope", "sm_90a"): _hopper_proj_rope_factory, ("proj_rope", "sm_100a"): _blackwell_proj_rope_factory,
    ("dequantize", "sm_90a"): _dequantize_factory, ("dequantize", "sm_100a"): _dequantize_factory,
    ("weight_stream", "sm_90a"): _weight_stream_factory, ("weight_stream", "sm_100a"): _weight_stream_factory,
    ("ragged", "sm_90a"): _ragged_factory, ("ragged", "sm_100a"): _blackwell_ragged_factory,
    ("contraction", "sm_90a"): _contraction_factory, ("quantize_pair", "sm_90a"): _quantize_pair_factory}

# proj_rope: the tile and schedule each target runs are arch.TABLE's. On sm_90a a persistent kernel, one CTA per SM,
# on 128-token x one-head tiles, whose MMA warpgroups hand each fp32 tile through shared memory to an epilogue
# warpgroup: schedule "staged" ('...t128x192.c1x1[.bn].staged'). On sm_100a one tile of 128 tokens (the 128
# tensor-memory lanes) x one head.
_SM90_POLICY, _SM100_POLICY = arch.policy("sm_90a"), arch.policy("sm_100a")

# the tile field of the dequantize keys (those kernels have no tile; their data path follows a_major)
DEQUANTIZE_TILE = (1, 16)

_FP8 = ("float8_e4m3fn", "float8_e5m2")
_C = ("float32", "bfloat16")

# sm_90a beyond MXFP8 -> f32/bf16 (compiled and checked here, run on an H200 by the GPU tests): MXFP8 -> f16 C;
# MXFP4 (E8M0, block 32) and NVFP4 (E4M3, block 16, alpha) -> every C dtype SPEC allows for FP4 operands (f32, bf16,
# f16, E4M3, E5M2, packed FP4), all through the bf16-dequantization mainloop.
_SM90_FP4_C = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn")
_SM90_FP4_SCALES = ((32, E8M0), (16, "float8_e4m3fn"))

# The decode kernel's weight formats ((codes, scale block, scale dtype): MXFP8 E4M3 and E5M2, MXFP4, NVFP4), its C
# dtypes and its tiles (rows of W per CTA, the most rows of x a variant takes): dispatch picks, per arch, the
# variant of the smallest capacity that holds the call's M.
WEIGHT_STREAM_FORMATS = (("float8_e4m3fn", 32, E8M0), ("float8_e5m2", 32, E8M0), ("float4_e2m1fn", 32, E8M0),
                         ("float4_e2m1fn", 16, "float8_e4m3fn"))
WEIGHT_STREAM_C = ("float32", "bfloat16", "float16")
RAGGED_FORMATS = WEIGHT_STREAM_FORMATS  # MXFP8 E4M3 and E5M2, MXFP4, NVFP4
NO_SCALES = "none"  # the sf_dtype of variants whose operands carry no block scales (bf16), with sf_vec_size 0
# The schedule of the ragged kernels that take the tokens in bf16 and convert only the weights' codes, in registers
# (kernels/sm90/ragged_swap_ab.py); their ABI's a is `swap_ab_layout.kernel_tokens` of the dequantized tokens.
SWAP_AB = "swap_ab"
WEIGHT_STREAM_TILES = ((32, 16), (32, 64))
# (tokens, weight rows, K parts) of the swap_ab ragged kernel's decode tiles: decode-sized calls of the M range
# arch.TABLE's decode_swap_ab_m names run as one group of M tokens on the smallest that holds them (rows past M
# would be TMA zero fill, which costs; docs/design/decode.md). Each splits K over as many MMA warpgroups as its
# stages fit in shared memory: H200, 7168 x 7168, the swap_ab kernel's time per GEMM with K in 1 / 2 / 3 parts was
# 27.7 / 20.5 / 19.2 us at 16 tokens, 28.3 / 21.2 / 19.8 at 32, 29.8 / 22.9 (three parts of 64 tokens do not fit)
# at 64, against the decode kernel's 25.4 at M = 16 (one part's conversion chain per SM is the bound).
SWAP_AB_DECODE_TILES = ((16, 64, 3), (32, 64, 3), (64, 64, 2))
# The weight formats the swap_ab kernel converts in registers ((codes, scale block, scale dtype)): MXFP8 E4M3,
# MXFP4, NVFP4, as the kernel defines them
SWAP_AB_FORMATS = _ragged_swap_ab.WEIGHT_FORMATS
QUANTIZE_PAIR_TILE = (32, 256)  # the tile field of the quantize_pair keys: a warp's rows x columns
# The schedules of the quantize_pair kernels that read their rows through a row map (mx_ragged_dot's tokens, each
# group padded to whole blocks of 32 along the rows), writing the column blocks as codes or as bf16 values
GATHER, GATHER_VALUES = "gather", "gather_values"

CATALOG: tuple[KernelVariant, ...] = (
    tuple(KernelVariant(arch="sm_90a", ab_dtype=ab, c_dtype=c) for ab in _FP8 for c in _C)
    + tuple(KernelVariant(arch="sm_90a", ab_dtype=ab, c_dtype="float16") for ab in _FP8)
    + tuple(KernelVariant(arch="sm_90a", ab_dtype="float4_e2m1fn", c_dtype=c, sf_vec_size=v, sf_dtype=sf)
            for v, sf in _SM90_FP4_SCALES for c in _SM90_FP4_C)
    # MXFP8 with MN-major operands (A as (L, K, M), B as (L, K, N)), every C dtype SPEC allows FP8 operands;
    # c_major="m" runs these on (B, A).
    + tuple(KernelVariant(arch="sm_90a", ab_dtype=ab, c_dtype=c, a_major=am, b_major=bm)
            for am, bm in (("m", "k"), ("k", "n"), ("m", "n")) for ab in _FP8 for c in (*_C, "float16"))
    # sm_100a: compiled and checked here, never run (no Blackwell GPU); every tile and cluster shape of the
    # seed's MXFP8 surface.
    + tuple(KernelVariant(arch="sm_100a", ab_dtype=ab, c_dtype=c, tile_mn=t, cluster_mn=cl)
            for ab in _FP8 for c in _C for t in _sm100.SUPPORTED_TILES_MN for cl in _sm100.SUPPORTED_CLUSTERS_MN)
    # sm_100a FP4 (MXFP4: E8M0 block 32; NVFP4: E4M3 or E8M0 block 16, tile N 128 only): compiled and checked,
    # never run (no Blackwell GPU); reachable through the handler (packed FP4 operands, E4M3 scales, alpha), used
    # after the first-use self-check. Four of the nine cluster shapes the kernel accepts, to keep CI's compile
    # time down.
    + tuple(KernelVariant(arch="sm_100a", ab_dtype="float4_e2m1fn", c_dtype=c, sf_vec_size=v, sf_dtype=sf,
                          tile_mn=t, cluster_mn=cl)
            for v, sf, tiles in ((32, E8M0, _sm100.SUPPORTED_TILES_MN), (16, "float8_e4m3fn", ((128, 128),)),
                                 (16, E8M0, ((128, 128),)))
            for c in _C for t in tiles for cl in ((1, 1), (2, 1), (1, 2), (2, 2)))
    # sm_100a MXFP8 with MN-major operands (compiled and checked, never run): the MMA reads MN-major tiles; one
    # tile and cluster shape (dispatch falls back to it from any other).
    + tuple(KernelVariant(arch="sm_100a", ab_dtype=ab, c_dtype=c, a_major=am, b_major=bm)
            for am, bm in (("m", "k"), ("k", "n"), ("m", "n")) for ab in _FP8 for c in _C)
    # proj_rope on sm_90a: bf16 x and w (MXFP8 inputs are dequantized to bf16 before the kernel), both w layouts.
    + tuple(KernelVariant(op="proj_rope", arch="sm_90a", ab_dtype="bfloat16", c_dtype="float8_e4m3fn",
                          tile_mn=_SM90_POLICY.proj_rope_tile, b_major=b_major,
                          schedule=_SM90_POLICY.proj_rope_schedule)
            for b_major in ("k", "n"))
    # proj_rope on sm_100a: the same ABI and surface; compiled and structurally checked here, never run (no Blackwell
    # GPU). Selected only after the first-use self-check passed on the local GPU (dispatch, selfcheck).
    + tuple(KernelVariant(op="proj_rope", arch="sm_100a", ab_dtype="bfloat16", c_dtype="float8_e4m3fn",
                          tile_mn=_SM100_POLICY.proj_rope_tile, b_major=b_major,
                          schedule=_SM100_POLICY.proj_rope_schedule)
            for b_major in ("k", "n"))
    # MXFP8 -> bf16 for the MXFP8 proj_rope path (its kernels multiply bf16): x and K-major w (a_major "k": scales
    # along the row), (K, N) w (a_major "m"). No MMA: one kernel serves both architectures; only sm_90a has run.
    + tuple(KernelVariant(op="dequantize", arch=arch, ab_dtype="float8_e4m3fn", c_dtype="bfloat16",
                          tile_mn=DEQUANTIZE_TILE, a_major=a_major)
            for arch in ("sm_90a", "sm_100a") for a_major in ("k", "m"))
    # ... and the tokens of the sm_90a swap_ab ragged kernel below: dequantized and written in its column order
    + (KernelVariant(op="dequantize", arch="sm_90a", ab_dtype="float8_e4m3fn", c_dtype="bfloat16",
                     tile_mn=DEQUANTIZE_TILE, schedule=SWAP_AB),)
    # The decode GEMM (weight_stream): bf16 activations, few rows, against a block-scaled weight read once. One
    # design for both targets; the sm_100a objects are compiled here and gated by the first-use self-check.
    + tuple(KernelVariant(op="weight_stream", arch=arch, ab_dtype=w, c_dtype=c, sf_vec_size=v, sf_dtype=sf,
                          tile_mn=tile)
            for arch in ("sm_90a", "sm_100a") for w, v, sf in WEIGHT_STREAM_FORMATS for c in WEIGHT_STREAM_C
            for tile in WEIGHT_STREAM_TILES)
    # The ragged (grouped) GEMM on sm_90a: tokens sorted by group times each group's weight in one launch, the
    # gemm_amax mainloop per work item; the operand formats and C dtypes of the sm_90a gemm_amax kernels (K-major).
    + tuple(KernelVariant(op="ragged", arch="sm_90a", ab_dtype=ab, c_dtype=c, sf_vec_size=v, sf_dtype=sf)
            for ab, v, sf in RAGGED_FORMATS for c in (_SM90_FP4_C if ab == "float4_e2m1fn" else (*_C, "float16")))
    # ... and for MXFP8 E4M3, MXFP4 and NVFP4 weights with f32 or bf16 C, the roles swapped: the tokens dequantized
    # to bf16 by XLA, only the weights' codes converted in the kernel, in registers (what `implementation=None` runs
    # for them), on 128 x 128 tiles and on the decode tiles (16, 32 or 64 tokens x 64 weight rows, a CTA per 64 rows),
    # for decode-sized calls;
    + tuple(KernelVariant(op="ragged", arch="sm_90a", ab_dtype=w, c_dtype=c, sf_vec_size=v, sf_dtype=sf,
                          schedule=SWAP_AB, tile_mn=(tokens, rows), k_split=split)
            for w, v, sf in SWAP_AB_FORMATS for tokens, rows, split in ((128, 128, 1), *SWAP_AB_DECODE_TILES)
            for c in _C)
    # ... on sm_100a the block-scaled tcgen05 form (kernels/sm100/ragged.py; compiled here, gated by the first-use
    # self-check on a B200), f32 or bf16 C (its epilogue stores elements: no FP8/FP4 C there);
    + tuple(KernelVariant(op="ragged", arch="sm_100a", ab_dtype=ab, c_dtype=c, sf_vec_size=v, sf_dtype=sf)
            for ab, v, sf in RAGGED_FORMATS for c in _C)
    # ... and with bf16 operands (mx_ragged_dot's bf16 recipe, and its GEMMs whose contraction is no multiple of 32):
    # no scales; B K-major (dgrad reads the (G, K, N) weights with N as the contraction) or N-major (the forward
    # reads them with K as the contraction, no transposed copy); the tile is arch.TABLE's.
    + tuple(KernelVariant(op="ragged", arch="sm_90a", ab_dtype="bfloat16", c_dtype=c, sf_vec_size=0,
                          sf_dtype=NO_SCALES, b_major=bm, tile_mn=_SM90_POLICY.ragged_bf16_tile)
            for bm in ("k", "n") for c in _C)
    # The per-group contraction over tokens (the ragged product's weight gradient) on sm_90a: bf16 x and y, both
    # read with the tokens as the contraction (MN-major tiles), f32 or bf16 C.
    + tuple(KernelVariant(op="contraction", arch="sm_90a", ab_dtype="bfloat16", c_dtype=c, sf_vec_size=0,
                          sf_dtype=NO_SCALES, a_major="m", b_major="n") for c in _C)
    # Both MX quantizations of a bf16 weight in one pass (mx_ragged_dot's MX recipes on sm_90a: the forward's values
    # along K, dgrad's codes along N): ab_dtype the row blocks' format, c_dtype the column blocks' (every FP8 pair
    # a Recipe can name). sm_90a only: sm_100a's MX recipes hand the ragged GEMMs codes (arch.TABLE).
    + tuple(KernelVariant(op="quantize_pair", arch="sm_90a", ab_dtype=row, c_dtype=col, tile_mn=QUANTIZE_PAIR_TILE)
            for row in _FP8 for col in _FP8)
    # ... and of mx_ragged_dot's tokens (its MX recipes on sm_90a), their rows through the group padding's map: x's
    # values along the tokens for wgrad and along K for the forward (GATHER_VALUES), dY's values along the tokens
    # and codes along N for dgrad (GATHER)
    + tuple(KernelVariant(op="quantize_pair", arch="sm_90a", ab_dtype=row, c_dtype=col, tile_mn=QUANTIZE_PAIR_TILE,
                          schedule=schedule)
            for schedule in (GATHER, GATHER_VALUES) for row in _FP8 for col in _FP8))


# Kernels built outside the package (tests' deliberately broken ones) that forced runs and the self-check may build:
# never selected by `select_variant`. See `register_extra_variant`.
_EXTRA_FACTORIES: dict[KernelVariant, Callable[[KernelVariant], Any]] = {}


def register_extra_variant(v: KernelVariant, factory: Callable[[KernelVariant], Any]) -> None:
    """Make variant `v` (with a `flavor`) buildable by `make_kernel` for forced runs and the self-check, outside the
    catalog: tests register deliberately broken kernels this way to show that the first-use gate catches them."""
    if not v.flavor:
        raise ValueError(f"an extra variant needs a flavor naming what it is; got {v.key!r}")
    _EXTRA_FACTORIES[v] = factory


def extra_variants() -> tuple[KernelVariant, ...]:
    """The variants registered by `register_extra_variant` in this process."""
    return tuple(_EXTRA_FACTORIES)


def variants_for(arch: str, op: str | None = None) -> tuple[KernelVariant, ...]:
    """The catalog's variants compiled for `arch` (e.g. 'sm_90a'), of operation `op` when given."""
    return tuple(v for v in CATALOG if v.arch == arch and op in (None, v.op))


def select_variant(*, arch: str, ab_dtype: str, c_dtype: str, sf_vec_size: int, tile_mn: tuple,
                   cluster_mn: tuple, sf_dtype: str = E8M0, op: str = "gemm_amax",
                   b_major: str = "k", a_major: str = "k", schedule: str = "", k_split: int = 1
                   ) -> KernelVariant | None:
    """The catalog entry matching every field exactly, or None."""
    want = KernelVariant(op=op, arch=arch, ab_dtype=str(ab_dtype), c_dtype=str(c_dtype), sf_vec_size=int(sf_vec_size),
                         tile_mn=tuple(tile_mn), cluster_mn=tuple(cluster_mn), sf_dtype=str(sf_dtype),
                         b_major=b_major, a_major=a_major, schedule=str(schedule), k_split=int(k_split))
    return want if want in CATALOG else None


def swap_ab_decode_tile(tokens: int) -> tuple[tuple[int, int], int] | None:
    """((tokens, weight rows), K parts) of the smallest swap_ab decode tile that holds `tokens` rows, or None."""
    return next((((t, rows), split) for t, rows, split in sorted(SWAP_AB_DECODE_TILES) if t >= tokens), None)


def make_kernel(v: KernelVariant) -> Any:
    """The kernel object of variant `v` (raises ValueError for a variant outside the catalog and the registered
    extras)."""
    if v in _EXTRA_FACTORIES:
        return _EXTRA_FACTORIES[v](v)
    if v not in CATALOG or (v.op, v.arch) not in _FACTORIES:
        raise ValueError(f"variant {v.key!r} is not in the catalog; known: {[c.key for c in CATALOG]}")
    return _FACTORIES[(v.op, v.arch)](v)


def fake_arguments(kernel: Any, op: str = "gemm_amax") -> list:
    """Fake (symbolic-length) arguments in the ABI order of `op`, for compiling without a GPU or real buffers."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    def flat(dtype):
        return make_fake_compact_tensor(dtype, (cute.sym_int64(),), assumed_align=16)

    if op == "dequantize":
        operand = [flat(kernel.ab_dtype), flat(cutlass.Uint8), flat(cutlass.BFloat16), cutlass.Int32(32),
                   cutlass.Int32(64)]
        return operand + operand + [cuda.CUstream(0)]
    if op == "weight_stream":  # scale bytes travel as uint8 whatever their format, as gemm_amax's do
        i32 = cutlass.Int32
        return [flat(cutlass.BFloat16), flat(kernel.ab_dtype), flat(cutlass.Uint8), flat(kernel.c_dtype),
                flat(cutlass.Float32), flat(cutlass.Float32), flat(cutlass.Int64), i32(1), i32(32), i32(64), i32(1),
                i32(0), cuda.CUstream(0)]
    if op == "quantize_pair":
        return [flat(cutlass.BFloat16), flat(cutlass.Int32), flat(cutlass.BFloat16), flat(kernel.c_dtype),
                flat(cutlass.Uint8), cutlass.Int32(32), cutlass.Int32(256), cutlass.Int32(32), cuda.CUstream(0)]
    if op == "contraction":
        i32 = cutlass.Int32
        return [flat(cutlass.BFloat16), flat(cutlass.BFloat16), flat(cutlass.Int32), flat(kernel.c_dtype),
                flat(cutlass.Float32), i32(128), i32(128), i32(128), i32(1), i32(2), cuda.CUstream(0)]
    if op == "ragged":
        i32 = cutlass.Int32
        a_dtype = getattr(kernel, "a_dtype", kernel.ab_dtype)  # the swap_ab kernels read bf16 tokens
        # ... and take amax's tally after alpha and their scales' form (sf_atom) after max_items
        swap_ab = isinstance(kernel, _ragged_swap_ab.HopperRaggedSwapAB)
        tally, sf_atom = ([flat(cutlass.Int64)], [i32(0)]) if swap_ab else ([], [])
        return [flat(a_dtype), flat(kernel.ab_dtype), flat(cutlass.Uint8), flat(cutlass.Uint8),
                flat(cutlass.Int32), flat(kernel.c_dtype), flat(cutlass.Float32), flat(cutlass.Float32), *tally,
                i32(128), i32(128), i32(128), i32(1), i32(1), i32(2), *sf_atom, cuda.CUstream(0)]
    if op == "proj_rope":
        ab, u8 = kernel.ab_dtype, cutlass.Uint8
        return [flat(ab), flat(ab), flat(cutlass.BFloat16), flat(cutlass.BFloat16), flat(u8), flat(u8),
                flat(u8), flat(u8), flat(u8), flat(u8), cutlass.Int32(32), cutlass.Int32(64), cutlass.Int32(1),
                cutlass.Int32(132), cuda.CUstream(0)]
    tensors = [flat(kernel.ab_dtype), flat(kernel.ab_dtype), flat(cutlass.Uint8), flat(cutlass.Uint8),
               flat(kernel.c_dtype), flat(cutlass.Float32)]
    if getattr(kernel, "has_alpha", False):
        tensors.append(flat(cutlass.Float32))
    sizes = [cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(16), cutlass.Int32(1)]
    if getattr(kernel, "takes_grid_ctas", False):  # sm_100a: max_ctas, the persistent grid's bound
        sizes.append(cutlass.Int32(148))
    return tensors + sizes + [cuda.CUstream(0)]


def compile_function(v: KernelVariant, *, keep_ptx: bool = False, kernel: Any = None) -> Any:
    """`cute.compile` of variant `v` for `v.arch` (no GPU needed): the DSL's compiled-function object.

    `keep_ptx` also keeps the cubin (`__ptx__`, `__cubin__`) for structural checks; `kernel` is the object to
    trace (default: a fresh `make_kernel(v)`), passed in when the caller wants the facts it records while traced.
    """
    import cutlass.cute as cute
    from cutlass.cutlass_dsl import CuTeDSL

    kernel = make_kernel(v) if kernel is None else kernel
    options = f"--gpu-arch {v.arch}"
    with _COMPILE_LOCK, tempfile.TemporaryDirectory(prefix="jbg-compile-") as dump_dir:
        if keep_ptx:  # the DSL also writes the files it keeps; keep them out of the working directory
            options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
        envar = CuTeDSL._get_dsl().envar
        saved = envar._arch  # None means "detect on first use"; keep it that way for other users
        envar.arch = v.arch
        try:
            return cute.compile(kernel, *fake_arguments(kernel, v.op), options=options)
        finally:
            envar._arch = saved


def compile_variant(v: KernelVariant) -> bytes:
    """Relocatable object bytes of variant `v`, compiled for `v.arch`, exporting `v.function_prefix`."""
    return compile_function(v).dump_to_object(v.function_prefix)


# The modules outside kernels/ that kernels/ imports (their constants are compiled into the objects), relative to the
# package directory: kernel_source_hash covers them too.
COMPILED_IN_MODULES = ("arch.py", "formats.py", "support.py", "swap_ab_layout.py")


@functools.lru_cache(maxsize=None)
def kernel_source_hash() -> str:
    """SHA-256 over the kernels/ sources, the COMPILED_IN_MODULES and the DSL version: the on-disk object cache
    key."""
    import cutlass

    h = hashlib.sha256(f"cutlass-dsl {getattr(cutlass, '__version__', '?')}\n".encode())
    root = pathlib.Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    for name in COMPILED_IN_MODULES:
        h.update(f"jax_blockgemm/{name}".encode() + b"\0" + (root.parent / name).read_bytes())
    return h.hexdigest()
