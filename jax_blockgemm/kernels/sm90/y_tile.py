"""The fp32 tile Y of the sm_90a proj_rope kernel (kernels/sm90/proj_rope.py): 128 tokens x 192 features of one
head in 96 KB of shared memory, written by the two MMA warpgroups from their wgmma fragments and read by the epilogue
warpgroup, one thread per token.

Layout: block-major per epilogue warp. Warp w's 32 rows take 24 KB at 24 KB·w; in there, 32-feature block b of the
32 rows is a 4 KB region at 4 KB·b, row r of it 128 bytes at 128·r, and 16-byte chunk c (features 32b + 4c .. + 3)
sits at (c ^ swizzle_key(r))·16 in the row. The XOR makes eight consecutive rows reading the same chunk (a quarter
warp's 16-byte loads) hit eight bank groups, a warp reading one row's block (the column reads) hit 32 banks, and a
half warp of the MMA threads' 8-byte fragment stores hit 32 banks (tests/test_proj_rope_staged_layout.py checks
every address).

What the epilogue does with it, per tile: RoPE in place (`rope_in_place`), then per block of 32 features the row
(`read_row_block`), the lane's column across the warp's 32 rows (`read_column`), the column factors through a
per-warp table (`column_scales`); once the warp has read block b, its 4 KB region is free, and the warp's codes of
the block go there as two dense 32-token x 32-byte boxes (`stage_code_boxes`) that one TMA store each takes to
global memory (`store_code_boxes`).

Offsets are plain integer arithmetic (the tests call them on Python ints); the rest emits device code.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from jax_blockgemm.kernels import common, epilogue, token_rows
from jax_blockgemm.kernels import ptx_ops
from jax_blockgemm.support import HEAD_DIM, MX_BLOCK, QK_NOPE

ROWS = 128
WARP_ROWS = 32  # an epilogue warp's token rows
ROW_PITCH = MX_BLOCK * 4  # one row's 32-feature block: 8 chunks, 128 bytes
BLOCK_REGION = WARP_ROWS * ROW_PITCH  # 4 KB: one block of a warp's 32 rows
WARP_REGION = (HEAD_DIM // MX_BLOCK) * BLOCK_REGION  # 24 KB
BYTES = (ROWS // WARP_ROWS) * WARP_REGION  # 96 KB
BOX_BYTES = WARP_ROWS * MX_BLOCK  # one output's E4M3 codes of a block for a warp's 32 tokens: 1 KB
ROW_SCALE_PIECES = HEAD_DIM // MX_BLOCK // 2  # a token's 6 rowwise scale bytes as 16-bit pieces


# --- offsets --------------------------------------------------------------------------------------------------------
def swizzle_key(row):
    """The XOR key of row `row`'s chunks: its low three bits rotated left by one (a permutation of 0..7). Any
    permutation keeps the row and column reads conflict-free; this one also does for the MMA threads' 8-byte
    fragment stores, whose half warps (4 rows x 2 chunk parities) then take 4 even and 4 odd keys: 8 bank groups
    (plain `row % 8` put two chunks in each of 4 groups: 2 wavefronts per half warp instead of 1)."""
    return ((row << 1) | ((row >> 2) & 1)) & 7


def offset(row, chunk):
    """Byte offset of 16-byte chunk `chunk` (features 4·chunk .. + 3) of row `row`."""
    return (warp_offset(row // WARP_ROWS) + (chunk // 8) * BLOCK_REGION + (row % WARP_ROWS) * ROW_PITCH
            + ((chunk % 8) ^ swizzle_key(row)) * 16)


def warp_offset(warp):
    """Byte offset of epilogue warp `warp`'s 32 rows (its region: 6 blocks of 4 KB)."""
    return warp * WARP_REGION


def row_addresses(y, row) -> list:
    """Addresses of chunks 0..7 of row `row`; chunk 8m + c is entry c + BLOCK_REGION·m: eight registers address a
    row."""
    return [y + offset(row, c) for c in range(8)]


def fragment_bases(y, row0, quad) -> list:
    """An MMA thread's fragment value (v0, v1, j) is row row0 + 8·v1, feature 8j + 2·quad + v0: chunk 8·(j // 4) + c
    with c = 2·(j % 4) + quad // 2, so four base addresses reach all 96 (rows row0 and row0 + 8 share their
    swizzle and their warp region); `fragment_address` gives the rest."""
    return [y + offset(row0, 2 * jj + quad // 2) + 8 * (quad % 2) for jj in range(4)]


def fragment_address(base: list, j: int, v1: int):
    """Address of the 8-byte pair (v0 = 0, 1) of fragment value (v1, j), from `fragment_bases`."""
    return base[j % 4] + BLOCK_REGION * (j // 4) + v1 * (8 * ROW_PITCH)


def column_offsets(lane) -> list:
    """Byte offsets, within a row's block, of feature `lane` in a row r with r % 8 = s (entry s); row r of the warp's
    block region adds ROW_PITCH·r."""
    return [((lane >> 2) ^ swizzle_key(s)) * 16 + (lane & 3) * 4 for s in range(8)]


def box_offset(out: int, r, half):
    """Where, in a warp's block region, the codes of its token r (bytes 16·half .. + 15 of the block's 32) of output
    `out` (0 rowwise, 1 columnwise) go: box `out` (1 KB at BOX_BYTES·out) is 32 rows of 32 bytes in the TMA's
    32-byte swizzle (16-byte chunk index XOR address bit 7), which is the layout `store_code_boxes`' tensor maps
    read; eight consecutive rows writing the same half then hit eight bank groups."""
    return BOX_BYTES * out + r * MX_BLOCK + 16 * (half ^ ((r >> 2) & 1))


# --- the MMA warpgroups -------------------------------------------------------------------------------------------
def write_fragment(acc, y, row0, quad):
    """An MMA thread's 96 accumulator values into Y, one 8-byte store per (v1, j) pair."""
    base = fragment_bases(y, row0, quad)
    for v1 in range(2):
        for j in range(HEAD_DIM // 8):
            ptx_ops.st_shared_v2(fragment_address(base, j, v1), common.bits_from_f32(acc[4 * j + 2 * v1]),
                                 common.bits_from_f32(acc[4 * j + 2 * v1 + 1]))


# --- the epilogue warpgroup ---------------------------------------------------------------------------------------
def read_row_block(row_addrs: list, b):
    """Features 32b..32b+31 of a row (its `row_addresses`) as 32 fp32 registers (eight 16-byte loads)."""
    vals = cute.make_rmem_tensor((MX_BLOCK,), cutlass.Float32)
    for c in range(MX_BLOCK // 4):
        words = ptx_ops.ld_shared_v4(row_addrs[c] + b * BLOCK_REGION)
        for e in range(4):
            vals[4 * c + e] = common.f32_from_bits(words[e])
    return vals


def rope_in_place(row_addrs: list, rcos, rsin):
    """SPEC §5 RoPE of a row (features 128..191, fp32 from the accumulator): read, rotated with the token's tables,
    written back in place, so that the columnwise maxima of the rotated features are read like the others'."""
    nope_blocks = QK_NOPE // MX_BLOCK
    p_lo = read_row_block(row_addrs, nope_blocks)
    p_hi = read_row_block(row_addrs, nope_blocks + 1)
    out_lo = cute.make_rmem_tensor((MX_BLOCK,), cutlass.Float32)  # out[128 + j]
    out_hi = cute.make_rmem_tensor((MX_BLOCK,), cutlass.Float32)  # out[160 + j]
    token_rows.rope(p_lo, p_hi, rcos, rsin, out_lo, out_hi)
    for b, out in ((nope_blocks, out_lo), (nope_blocks + 1, out_hi)):
        for c in range(MX_BLOCK // 4):
            ptx_ops.st_shared_v4(row_addrs[c] + b * BLOCK_REGION,
                                 *[common.bits_from_f32(out[4 * c + e]) for e in range(4)])


def read_column(y_warp, b, offsets: list):
    """Feature 32b + lane of the warp's 32 rows (y_warp: the warp's region; offsets: `column_offsets(lane)`):
    32 4-byte loads, each one row's block for the whole warp."""
    col = cute.make_rmem_tensor((MX_BLOCK,), cutlass.Float32)
    base = y_warp + b * BLOCK_REGION
    for r in range(WARP_ROWS):
        col[r] = common.f32_from_bits(ptx_ops.ld_shared_u32(base + r * ROW_PITCH + offsets[r % 8]))
    return col


def column_scales(col, col_tab, lane):
    """Columnwise scales of a block for the warp's 32 tokens, from `read_column`: lane l makes the E8M0 byte of
    column l and publishes its factor in the warp's table (col_tab, 128 bytes); every lane then reads the 32
    factors (8 broadcast 16-byte loads). Returns (byte of column `lane`, the 32 factors, ballot of the columns'
    NaN/inf flags), what `token_rows.col_code_words` takes. Its two warp barriers also order every lane's column
    reads of the block before anything that follows."""
    amax = epilogue.amax_tree([col[r] for r in range(MX_BLOCK)])
    col_byte, col_inv, col_bad = epilogue.e8m0_scale(common.bits_from_f32(amax))
    inv = cute.make_rmem_tensor((MX_BLOCK,), cutlass.Float32)
    cute.arch.sync_warp()  # the lanes' reads of the previous block's factors are done
    ptx_ops.st_shared_u32(col_tab + 4 * lane, common.bits_from_f32(col_inv))
    cute.arch.sync_warp()
    for c in range(MX_BLOCK // 4):
        words = ptx_ops.ld_shared_v4(col_tab + 16 * c)
        for e in range(4):
            inv[4 * c + e] = common.f32_from_bits(words[e])
    return col_byte, inv, cute.arch.vote_ballot_sync(col_bad)


def stage_code_boxes(box_pair, lane, row_words, col_words):
    """Token `lane`'s codes of a block (8 words per output) into the warp's two code boxes at box_pair (`box_offset`);
    the caller has ordered every lane's earlier use of those bytes before."""
    for out, words in ((0, row_words), (1, col_words)):
        for half in range(2):
            ptx_ops.st_shared_v4(box_pair + box_offset(out, lane, half), *[words[4 * half + e] for e in range(4)])


def code_box_layout() -> cute.ComposedLayout:
    """One code box as the TMA store sees it: (32 code bytes, 1 head, 32 tokens), rows of 32 bytes, 32-byte swizzle
    (Swizzle<1,4,3> on byte offsets: the 16-byte chunk index XOR bit 7), i.e. `box_offset`."""
    return cute.make_composed_layout(cute.make_swizzle(1, 4, 3), 0,
                                     cute.make_layout((MX_BLOCK, 1, WARP_ROWS), stride=(1, MX_BLOCK, MX_BLOCK)))


def code_box_tma(codes: cute.Tensor, t, h) -> tuple:
    """Host side: the TMA store atom and tensor of one code output (T, H, 192) seen as (192 bytes, H, T), box
    `code_box_layout`."""
    view = cute.make_tensor(codes.iterator, cute.make_layout((HEAD_DIM, h, t), stride=(1, HEAD_DIM, HEAD_DIM * h)))
    return cute.nvgpu.cpasync.make_tiled_tma_atom(cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), view,
                                                  code_box_layout(), (MX_BLOCK, 1, WARP_ROWS))


def code_box_views(y_ptr, tma_atoms: tuple, tma_tensors: tuple) -> list:
    """Device side: per output, (boxes, tiles) from `cute.nvgpu.cpasync.tma_partition`: boxes[(None, (out, b, w))]
    is warp w's box `out` of block b in Y (y_ptr: Y's shared-memory pointer; the box pair at warp_offset(w) +
    BLOCK_REGION·b, as `stage_code_boxes` is given it), tiles[(None, (b, head, token / 32))] the (32-token, block)
    tile of that output in global memory."""
    box = code_box_layout()
    stack = cute.make_layout((box.outer.shape, (2, HEAD_DIM // MX_BLOCK, ROWS // WARP_ROWS)),
                             stride=(box.outer.stride, (BOX_BYTES, BLOCK_REGION, WARP_REGION)))
    boxes = cute.make_tensor(cute.recast_ptr(y_ptr, swizzle_=box.inner, dtype=cutlass.Uint8), stack)
    views = []
    for atom, tensor in zip(tma_atoms, tma_tensors):
        tiles = cute.zipped_divide(tensor, (MX_BLOCK, 1, WARP_ROWS))
        views.append(cute.nvgpu.cpasync.tma_partition(atom, 0, cute.make_layout(1), boxes, tiles))
    return views


@cute.jit
def store_code_boxes(tma_atoms: tuple, views: list, warp, b, head, token0, live):
    """After `stage_code_boxes` by the whole warp: the async-proxy fence, then one TMA store per output of the warp's
    block-b boxes to tokens token0 .. + 31 (elected lane), committed as one bulk group. A warp past T (`live`
    false) stores nothing. Before the boxes' bytes are written again the warp waits for the TMA's reads
    (`wait_code_boxes`)."""
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.sync_warp()
    if live:
        for out in cutlass.range_constexpr(2):
            boxes, tiles = views[out]
            cute.copy(tma_atoms[out], boxes[(None, (out, b, warp))], tiles[(None, (b, head, token0 // WARP_ROWS))])
    cute.arch.cp_async_bulk_commit_group()


def wait_code_boxes():
    """Every code box this thread's TMA stores read is read (its bytes may be written again); then the warp
    agrees."""
    cute.arch.cp_async_bulk_wait_group(0, read=True)
    cute.arch.sync_warp()


def add_row_scale(lo, hi, row_byte, b) -> tuple:
    """Block b's rowwise scale byte into a token's six, packed little-endian: bytes 0-3 in lo, 4-5 in hi (b is a loop
    variable: selects, no shift by 32 or more). Returns the new (lo, hi)."""
    lo = cutlass.select_(b < 4, lo | (row_byte << ((b & 3) * 8)), lo)
    hi = cutlass.select_(b >= 4, hi | (row_byte << ((b & 1) * 8)), hi)
    return cutlass.Int32(lo), cutlass.Int32(hi)


def row_scale_piece(lane, k: int):
    """Which 16-bit piece lane `lane` stores in step k (< 3) of `store_row_scales`: (token r of the warp, piece q of
    its six bytes: bytes 2q, 2q + 1). Lane-major over the warp's 32 x 3 pieces, so consecutive lanes write one
    token's whole run, then the next token's."""
    i = lane + 32 * k
    r = i // ROW_SCALE_PIECES
    return r, i - ROW_SCALE_PIECES * r


def store_row_scales(lo, hi, lane, live, row_scales, token0, head, h):
    """The warp's 32 tokens' rowwise scale bytes (lane r's lo, hi from `add_row_scale`, token token0 + r) as three
    16-bit stores per lane: each store instruction writes ~11 tokens' 6-byte runs (tokens are 6·H bytes apart, one L2
    request each) instead of one byte of all 32 tokens. A warp past T (`live` false) stores nothing."""
    base = row_scales.iterator.toint()
    for k in range(ROW_SCALE_PIECES):
        r, q = row_scale_piece(lane, k)
        lo_r = cute.arch.shuffle_sync(lo, r)
        hi_r = cute.arch.shuffle_sync(hi, r)
        piece = cutlass.select_(q == 0, lo_r & 0xFFFF, cutlass.select_(q == 1, (lo_r >> 16) & 0xFFFF, hi_r & 0xFFFF))
        addr = base + cutlass.Int64(token_rows.row_scale_index(token0 + r, head, h) + 2 * q)
        ptx_ops.st_global_u16_if(addr, piece, live)
