"""Both MX quantizations of a bf16 matrix in one pass: what a training step needs of a weight that it multiplies
with one axis as the contraction (forward) and then with the other (dgrad), or of tokens that it contracts over their
features (forward, dgrad) and over each group's rows (wgrad).

For w as a (rows, cols) matrix (a batch of (R, C) matrices with R a multiple of 32 is one such matrix: no block
crosses a batch boundary) the kernel reads w once and writes

  * values: code·scale of w quantized with its blocks of 32 along the rows (one scale per 32 rows of a column), as
    bfloat16, exact (SPEC §6): the forward's operand, multiplied on the bf16 tensor cores;
  * codes and scales: w quantized with its blocks of 32 along the columns, (rows, cols) FP8 codes and (rows,
    cols / 32) E8M0 bytes: what dgrad hands the ragged GEMM, which reads its weight with the columns as the
    contraction, as they lie.

Both are `formats.quantize_dequantize` and `formats.quantize_mxfp8` of the same w, bit for bit (the "ceil" scale
rule of SPEC §2, computed on the amax bits; RNE conversions by the hardware with saturation, which the rule never
needs; a block holding NaN or inf gets the byte 0xFF, zero codes and NaN values).

The GATHER schedules read their rows through a map instead: row i of the row-blocked matrix is w's row row_map[i]
(zeros where it is negative), so that blocks of 32 along the rows can follow groups of tokens that do not start at
multiples of 32 (mx_ragged_dot's wgrad pads each group to whole blocks); the column blocks belong to w's rows and are
written at row_map[i] (rows the map does not name are not written). GATHER_VALUES writes them as bf16 code·scale
instead of codes (the scales as well).

A warp owns a tile of 32 rows (one block) by 256 columns. Each lane copies 16 bytes (8 columns) of each of the 32
rows into its own slots in shared memory with `cp.async` (all 32 copies in flight at once; a lane reads back only
what it copied, so waiting for its own copies is the only synchronization), then reads its rows twice: once for its
columns' maxima (the blocks along the rows: the lane's own), once to convert and store row by row, where a row
block's max over its 32 columns is a max over the 4 lanes that hold it (two shuffles). Maxima are integer maxima
of the bf16 magnitude bits, two at a time (`max.u16x2`, sm_90 and later): NaN above inf above every finite value,
as `formats.magnitude_max` orders them. Columns past `cols` (a multiple of 32, so a block's 4 lanes are live or not
together) are neither read nor written. Bandwidth-bound: 2 bytes read and 3 + 1/32 written per element; 64
registers, three CTAs (12 warps, 192 KB of tiles in flight) per SM.

ABI (catalog op "quantize_pair"): fn(w, row_map, values, codes, scales, rows, cols, src_rows, stream), flat
buffers: w bf16 (src_rows, cols); row_map int32 (rows,), read by the GATHER schedules only (src_rows = rows
otherwise); values bf16 (rows, cols); codes (src_rows, cols) in the column blocks' FP8 format (bf16 for
GATHER_VALUES); scales uint8 (src_rows, cols / 32); rows and cols int32, multiples of 32, src_rows >= 1; element
offsets in 64 bits (rows · cols may pass 2**31). Map entries outside [0, src_rows) read zeros and write nothing. The
handler (ffi/quantize_pair.cc) checks every size against `can_implement`.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_blockgemm.kernels import common, epilogue, ptx_ops
from jax_blockgemm.support import MX_BLOCK

WARPS = 4  # warps per CTA, one tile each
THREADS = 32 * WARPS
LANE_COLS = 8  # columns per lane: 16 bytes of bf16 per row, one cp.async
WORDS = LANE_COLS // 2  # bf16 pairs per lane and row
QUAD = MX_BLOCK // LANE_COLS  # lanes that hold one row block along the columns
TILE_COLS = 32 * LANE_COLS  # columns of a warp's tile
ROW_BYTES = 2 * TILE_COLS  # shared-memory bytes of one row of a warp's tile
WARP_BYTES = MX_BLOCK * ROW_BYTES  # a warp's tile in shared memory: 16 KB
CTAS_PER_SM = 3  # 192 KB of tiles in flight per SM
CODE_FORMATS = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
_ABS_X2 = 0x7FFF7FFF  # the magnitude bits of two bf16 values


@dsl_user_op
def _max_u16x2(a, b, *, loc=None, ip=None) -> cutlass.Int32:
    """The two 16-bit halves' unsigned maxima (sm_90 and later)."""
    return cutlass.Int32(ptx_ops.asm(T.i32(), [cutlass.Int32(a), cutlass.Int32(b)], "max.u16x2 $0, $1, $2;",
                                     "=r,r,r", False, loc, ip))


@dsl_user_op
def _fp8x2_to_f32(pair, fmt: str, *, loc=None, ip=None) -> tuple:
    """The two FP8 codes of `fmt` in the low 16 bits of `pair` (low byte first) as float32 values, exactly."""
    ret = llvm.StructType.get_literal([T.f32()] * 2)
    out = ptx_ops.asm(ret, [cutlass.Int32(pair)],
                      f"{{ .reg .b16 c, l, h; .reg .b32 p; cvt.u16.u32 c, $2; cvt.rn.f16x2.{fmt}x2 p, c; "
                      "mov.b32 {l, h}, p; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }", "=f,=f,r", False, loc, ip)
    return tuple(cutlass.Float32(llvm.extractvalue(T.f32(), out, [i], loc=loc, ip=ip)) for i in range(2))


class MxQuantizePair:
    """w (rows, cols) bf16 -> its values quantized along the rows in `row_dtype` (bf16) and its codes and scales
    quantized along the columns in `col_dtype`; both FP8 MX formats (E4M3 or E5M2), E8M0 scales per 32. `gather`:
    the rows come through a row map (the module's GATHER schedules); `col_values`: the column blocks are written as
    bf16 code·scale instead of codes (GATHER_VALUES)."""

    # What the structural report reads of every kernel (kernels/structure.py): no MMA, no tensor memory.
    threads_per_cta = THREADS
    tmem_columns_used = tmem_columns_allocated = 0

    def __init__(self, *, row_dtype: str = "float8_e4m3fn", col_dtype: str = "float8_e4m3fn", gather: bool = False,
                 col_values: bool = False):
        common.require_choice("row_dtype", row_dtype, tuple(CODE_FORMATS))
        common.require_choice("col_dtype", col_dtype, tuple(CODE_FORMATS))
        if col_values and not gather:
            raise ValueError("col_values is a GATHER schedule's option: it needs gather=True")
        self.row_fmt, self.col_fmt = CODE_FORMATS[row_dtype], CODE_FORMATS[col_dtype]
        self.gather, self.col_values = gather, col_values
        self.ab_dtype = cutlass.BFloat16
        fp8 = cutlass.Float8E4M3FN if col_dtype == "float8_e4m3fn" else cutlass.Float8E5M2
        self.c_dtype = cutlass.BFloat16 if col_values else fp8  # what the codes buffer holds

    @staticmethod
    def can_implement(rows: int, cols: int, src_rows: int | None = None) -> tuple[bool, str]:
        """Whether the kernel takes a (rows, cols) matrix (read from src_rows rows of w through a map, where given),
        and why not."""
        src_rows = rows if src_rows is None else src_rows
        if min(rows, cols) < 1 or rows % MX_BLOCK or cols % MX_BLOCK:
            return False, f"rows and cols must be positive multiples of {MX_BLOCK}, got {rows} x {cols}"
        if src_rows < 1:
            return False, f"w must have at least one row, got {src_rows}"
        if max(rows, src_rows, cols) >= 2**31 or max(rows, src_rows) * (cols // MX_BLOCK) >= 2**31:
            return False, (f"rows, cols and the scales' rows * cols / 32 must be below 2**31, got {rows} x {cols} "
                           f"({src_rows} rows of w)")
        if (rows // MX_BLOCK) * -(-cols // TILE_COLS) >= 2**31:
            return False, f"too many tiles of {MX_BLOCK} x {TILE_COLS} in {rows} x {cols}"
        return True, ""

    @cute.jit
    def __call__(self, w: cute.Tensor, row_map: cute.Tensor, values: cute.Tensor, codes: cute.Tensor,
                 scales: cute.Tensor, rows: cutlass.Int32, cols: cutlass.Int32, src_rows: cutlass.Int32,
                 stream: cuda.CUstream):
        """Host side: one warp per tile, WARPS tiles per CTA."""
        fields = dict(tiles=cute.struct.Align[cute.struct.MemRange[cutlass.Int32, WARPS * WARP_BYTES // 4], 128])
        self.shared_storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        tiles = (rows // MX_BLOCK) * ((cols + TILE_COLS - 1) // TILE_COLS)
        self.kernel(w, row_map, values, codes, scales, rows, cols, src_rows).launch(
            grid=((tiles + WARPS - 1) // WARPS, 1, 1), block=(THREADS, 1, 1), smem=self.shared_storage.size_in_bytes(),
            min_blocks_per_mp=CTAS_PER_SM, preferred_smem_carveout=100, stream=stream)

    @cute.kernel
    def kernel(self, w: cute.Tensor, row_map: cute.Tensor, values: cute.Tensor, codes: cute.Tensor,
               scales: cute.Tensor, rows: cutlass.Int32, cols: cutlass.Int32, src_rows: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        lane, warp = tidx & 31, tidx >> 5
        tile = bidx * WARPS + warp
        col_tiles = (cols + TILE_COLS - 1) // TILE_COLS
        if tile < (rows // MX_BLOCK) * col_tiles:  # the same for the whole warp: every lane takes the shuffles
            row_block = tile // col_tiles
            col = (tile - row_block * col_tiles) * TILE_COLS + lane * LANE_COLS
            live = col < cols
            first = cutlass.Int64(row_block * MX_BLOCK) * cols + col  # element offset of the lane's first row
            lane_col = cutlass.Int64(cutlass.select_(live, col, 0))
            # the row of w that the tile's row r reads: itself, or through the map, where lane l loads row l's entry
            # and a shuffle hands it to every lane (-1 for a negative entry or one past w's rows: zeros read,
            # nothing written)
            mapped = row_block * MX_BLOCK + lane
            if cutlass.const_expr(self.gather):
                mapped = cutlass.Int32(row_map[mapped])
                mapped = cutlass.select_((mapped >= 0) & (mapped < src_rows), mapped, -1)
            # the lane's 16 bytes of every row into its own slots (a lane past cols, or a row the map leaves empty,
            # copies nothing, zero-filled, from a valid address): it reads back only what it copied, so its own wait
            # is the only synchronization
            slot0 = storage.tiles.data_ptr().toint() + warp * WARP_BYTES + lane * 16
            w0 = w.iterator.toint()
            for r in cutlass.range_constexpr(MX_BLOCK):
                src = row_block * MX_BLOCK + r
                if cutlass.const_expr(self.gather):
                    src = cute.arch.shuffle_sync(mapped, r)
                offset = cutlass.Int64(cutlass.max(src, 0)) * cols + lane_col
                ptx_ops.cp_async_16(slot0 + r * ROW_BYTES, w0 + offset * 2,
                                    cutlass.select_(live & (src >= 0), 16, 0))
            ptx_ops.cp_async_commit()
            ptx_ops.cp_async_wait(0)
            # the blocks along the rows: each column's max magnitude over the 32 rows, the lane's own (as integer
            # maxima of the bf16 magnitude bits, two columns per word)
            col_max = cute.make_rmem_tensor((WORDS,), cutlass.Int32)
            col_max.fill(0)
            for r in cutlass.range(MX_BLOCK, unroll=4):
                words = ptx_ops.ld_shared_v4(slot0 + r * ROW_BYTES)
                for j in cutlass.range_constexpr(WORDS):
                    col_max[j] = _max_u16x2(col_max[j], words[j] & _ABS_X2)
            inv_col = cute.make_rmem_tensor((LANE_COLS,), cutlass.Float32)
            scale_col = cute.make_rmem_tensor((LANE_COLS,), cutlass.Float32)
            for e in cutlass.range_constexpr(LANE_COLS):
                byte, inv, _ = epilogue.e8m0_scale(((col_max[e // 2] >> (16 * (e % 2))) & 0xFFFF) << 16, self.row_fmt)
                inv_col[e] = inv
                scale_col[e] = common.f32_from_bits(common.e8m0_bits(byte))  # NaN for a NaN/inf block
            v0, c0, s0 = values.iterator.toint(), codes.iterator.toint(), scales.iterator.toint()
            for r in cutlass.range(MX_BLOCK, unroll=2):
                words = ptx_ops.ld_shared_v4(slot0 + r * ROW_BYTES)
                src = row_block * MX_BLOCK + r
                if cutlass.const_expr(self.gather):
                    src = cute.arch.shuffle_sync(mapped, r)
                # the row's block along the columns: LANE_COLS columns here, 32 over the QUAD lanes that hold it
                m = cutlass.Int32(0)
                for j in cutlass.range_constexpr(WORDS):
                    m = _max_u16x2(m, words[j] & _ABS_X2)
                m = cutlass.max(m & 0xFFFF, (m >> 16) & 0xFFFF)
                for o in cutlass.range_constexpr(QUAD.bit_length() - 1):
                    m = cutlass.max(m, cute.arch.shuffle_sync_bfly(m, offset=1 << o))
                row_byte, row_inv, row_bad = epilogue.e8m0_scale(m << 16, self.col_fmt)
                row_scale = common.f32_from_bits(common.e8m0_bits(row_byte))  # NaN for a NaN/inf block
                out_words, code_pairs, col_words = [], [], []
                for j in cutlass.range_constexpr(WORDS):
                    lo = common.f32_from_bits(words[j] << 16)
                    hi = common.f32_from_bits(words[j] & ptx_ops.s32(0xFFFF0000))
                    pair = epilogue.fp8x2(lo * inv_col[2 * j], hi * inv_col[2 * j + 1], self.row_fmt)
                    v_lo, v_hi = _fp8x2_to_f32(pair, self.row_fmt)
                    out_words.append(epilogue.bf16x2(v_lo * scale_col[2 * j], v_hi * scale_col[2 * j + 1]))
                    code_pairs.append(epilogue.fp8x2(lo * row_inv, hi * row_inv, self.col_fmt))
                    if cutlass.const_expr(self.col_values):
                        c_lo, c_hi = _fp8x2_to_f32(code_pairs[j], self.col_fmt)
                        col_words.append(epilogue.bf16x2(c_lo * row_scale, c_hi * row_scale))
                ptx_ops.st_global_v4_if(v0 + (first + cutlass.Int64(r) * cols) * 2, *out_words, cutlass.Int32(live))
                at = cutlass.Int64(cutlass.max(src, 0)) * cols + lane_col  # the column blocks' row: w's own
                stored = live & (src >= 0)
                if cutlass.const_expr(self.col_values):
                    ptx_ops.st_global_v4_if(c0 + at * 2, *col_words, cutlass.Int32(stored))
                else:
                    keep = cutlass.Int32(cutlass.select_(row_bad, 0, -1))  # a NaN/inf block's codes are zero
                    ptx_ops.st_global_v2_if(c0 + at, (code_pairs[0] | (code_pairs[1] << 16)) & keep,
                                            (code_pairs[2] | (code_pairs[3] << 16)) & keep, cutlass.Int32(stored))
                first_of_block = (lane & (QUAD - 1)) == 0  # one lane of the QUAD stores the row block's byte
                ptx_ops.st_global_u8_if(s0 + at // MX_BLOCK, row_byte, cutlass.Int32(stored & first_of_block))
