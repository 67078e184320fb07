"""The fp32 tile Y of the sm_90a "staged" proj_rope kernel (kernels/sm90/proj_rope.py `kernel_staged`): 128 tokens x
192 features of one head in 96 KB of shared memory, written by the two MMA warpgroups from their wgmma fragments and
read by the epilogue warpgroup, one thread per token.

Layout: rows of 192 fp32 (768 bytes); 16-byte chunk c of row r at r·768 + (c ^ (r % 8))·16. The XOR only permutes
chunks within aligned groups of eight, so eight consecutive rows reading the same chunk (a quarter warp's 16-byte
loads) hit eight bank groups, and a warp reading one 32-feature block of one row (the column reads) hits 32 banks
(tests/test_proj_rope_staged_layout.py checks every address).

What the epilogue does with it, per tile: RoPE in place (`rope_in_place`), then per block of 32 features the row
(`read_row_block`), the lane's column across the warp's 32 rows (`read_column`), the column factors through a
per-warp table (`column_scales`), and the block's codes back into the thread's own, already read part of its row
(`stage_codes`), which the warp finally stores as whole 192-byte token rows (`store_code_rows`).

Offsets are plain integer arithmetic (the tests call them on Python ints); the rest emits device code.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from jax_blockgemm.kernels import common, epilogue, token_rows
from jax_blockgemm.kernels.sm90 import ptx_ops
from jax_blockgemm.support import HEAD_DIM, MX_BLOCK, QK_NOPE

ROWS = 128
ROW_BYTES = HEAD_DIM * 4
BYTES = ROWS * ROW_BYTES  # 96 KB
BLOCK_BYTES = MX_BLOCK * 4  # one 32-feature block of a row: 8 chunks


# --- offsets --------------------------------------------------------------------------------------------------------
def offset(row, chunk):
    """Byte offset of 16-byte chunk `chunk` (features 4·chunk .. + 3) of row `row`."""
    return (row * (HEAD_DIM // 4) + (chunk ^ (row & 7))) * 16


def row_offset(row):
    """Byte offset of row `row`'s first byte (its chunk 0 sits somewhere in its first 128 bytes)."""
    return row * ROW_BYTES


def row_addresses(y, row) -> list:
    """Addresses of chunks 0..7 of row `row`; chunk 8m + c is entry c + 128·m: eight registers address a row."""
    return [y + offset(row, c) for c in range(8)]


def fragment_bases(y, row0, quad) -> list:
    """An MMA thread's fragment value (v0, v1, j) is row row0 + 8·v1, feature 8j + 2·quad + v0: chunk 8·(j // 4) + c
    with c = 2·(j % 4) + quad // 2, so four base addresses reach all 96 (rows row0 and row0 + 8 share their
    swizzle); `fragment_address` gives the rest."""
    return [y + offset(row0, 2 * jj + quad // 2) + 8 * (quad % 2) for jj in range(4)]


def fragment_address(base: list, j: int, v1: int):
    """Address of the 8-byte pair (v0 = 0, 1) of fragment value (v1, j), from `fragment_bases`."""
    return base[j % 4] + 128 * (j // 4) + v1 * (8 * ROW_BYTES)


def column_offsets(lane) -> list:
    """Byte offsets, within a warp's 32 rows and a block's 128 bytes, of feature `lane` in a row r with r % 8 = s
    (entry s); row r of the warp adds r·768."""
    return [((lane >> 2) ^ s) * 16 + (lane & 3) * 4 for s in range(8)]


def code_store_item(lane, k: int):
    """Which 16 bytes lane `lane` moves in step k (< 12) of `store_code_rows`: (token r of the warp, 16-byte chunk q
    of its 192-byte code row, block b = q // 2, half = q % 2). Lane-major over the warp's 32 x 12 chunks, so
    consecutive lanes write consecutive bytes of one row."""
    chunks = HEAD_DIM // 16
    i = lane + 32 * k
    r = i // chunks
    q = i - chunks * r
    return r, q, q >> 1, q & 1


def code_slot(out: int, half, b):
    """Chunk of a row that holds 16 bytes `half` of output `out`'s (0 rowwise, 1 columnwise) codes of block b: among
    the block's own 8 chunks (free once the block is read), rotated by b so that the 6 blocks of one kind spread
    over the bank groups."""
    return 8 * b + ((2 * out + half + 2 * b) & 7)


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
        words = ptx_ops.ld_shared_v4(row_addrs[c] + b * BLOCK_BYTES)
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
            ptx_ops.st_shared_v4(row_addrs[c] + b * BLOCK_BYTES,
                                 *[common.bits_from_f32(out[4 * c + e]) for e in range(4)])


def read_column(y_warp, b, offsets: list):
    """Feature 32b + lane of the warp's 32 rows (y_warp: the warp's first row; offsets: `column_offsets(lane)`):
    32 4-byte loads, each one row's block for the whole warp."""
    col = cute.make_rmem_tensor((MX_BLOCK,), cutlass.Float32)
    base = y_warp + b * BLOCK_BYTES
    for r in range(MX_BLOCK):
        col[r] = common.f32_from_bits(ptx_ops.ld_shared_u32(base + r * ROW_BYTES + offsets[r % 8]))
    return col


def column_scales(col, col_tab, lane):
    """Columnwise scales of a block for the warp's 32 tokens, from `read_column`: lane l makes the E8M0 byte of
    column l and publishes its factor in the warp's table (col_tab, 128 bytes); every lane then reads the 32
    factors (8 broadcast 16-byte loads). Returns (byte of column `lane`, the 32 factors, ballot of the columns'
    NaN/inf flags), what `token_rows.col_code_words` takes. Its two warp barriers also order every lane's column
    reads of the block before anything that follows."""
    amax = epilogue.amax_tree([col[r] for r in range(MX_BLOCK)])
    col_byte, col_inv, col_bad = epilogue.e8m0_scale(common.bits_from_f32(amax))
    cute.arch.sync_warp()  # the lanes' reads of the previous block's factors are done
    ptx_ops.st_shared_u32(col_tab + 4 * lane, common.bits_from_f32(col_inv))
    cute.arch.sync_warp()
    inv = cute.make_rmem_tensor((MX_BLOCK,), cutlass.Float32)
    for c in range(MX_BLOCK // 4):
        words = ptx_ops.ld_shared_v4(col_tab + 16 * c)
        for e in range(4):
            inv[4 * c + e] = common.f32_from_bits(words[e])
    return col_byte, inv, cute.arch.vote_ballot_sync(col_bad)


def stage_codes(y, row, b, row_words, col_words):
    """This token's codes of block b (32 bytes per output) into its own row, among block b's chunks."""
    for out, words in ((0, row_words), (1, col_words)):
        for half in range(2):
            ptx_ops.st_shared_v4(y + offset(row, code_slot(out, half, b)), *[words[4 * half + e] for e in range(4)])


def store_code_rows(y, row_codes, col_codes, warp, lane, live, token0, head, h):
    """The warp's 32 tokens' codes (staged by `stage_codes`) to global memory as whole 192-byte rows: 12 16-byte
    chunks per token and output, chunk i = lane + 32k of the warp, so a store instruction writes 2-3 rows'
    contiguous bytes instead of 32 scattered 16-byte pieces. A warp past T (`live` false) stores nothing."""
    for out, codes in ((0, row_codes), (1, col_codes)):
        items = []
        for k in range(HEAD_DIM // 16):
            r, q, b, half = code_store_item(lane, k)
            words = ptx_ops.ld_shared_v4(y + offset(32 * warp + r, code_slot(out, half, b)))
            addr = codes.iterator.toint() + cutlass.Int64(((token0 + r) * h + head) * HEAD_DIM + 16 * q)
            items.append((addr, words))
        for addr, words in items:
            ptx_ops.st_global_v4_if(addr, *words, live)


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
    pieces = HEAD_DIM // MX_BLOCK // 2
    i = lane + 32 * k
    r = i // pieces
    return r, i - pieces * r


def store_row_scales(lo, hi, lane, live, row_scales, token0, head, h):
    """The warp's 32 tokens' rowwise scale bytes (lane r's lo, hi from `add_row_scale`, token token0 + r) as three
    16-bit stores per lane: each store instruction writes ~11 tokens' 6-byte runs (tokens are 6·H bytes apart, one L2
    request each) instead of one byte of all 32 tokens. A warp past T (`live` false) stores nothing."""
    base = row_scales.iterator.toint()
    for k in range(HEAD_DIM // MX_BLOCK // 2):
        r, q = row_scale_piece(lane, k)
        lo_r = cute.arch.shuffle_sync(lo, r)
        hi_r = cute.arch.shuffle_sync(hi, r)
        piece = cutlass.select_(q == 0, lo_r & 0xFFFF, cutlass.select_(q == 1, (lo_r >> 16) & 0xFFFF, hi_r & 0xFFFF))
        addr = base + cutlass.Int64(token_rows.row_scale_index(token0 + r, head, h) + 2 * q)
        ptx_ops.st_global_u16_if(addr, piece, live)
