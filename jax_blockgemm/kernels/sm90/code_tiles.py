"""The Hopper proj_rope epilogue's code words and shared-memory code tiles (kernels/sm90/proj_rope.py `_epilogue`).

Fragment: value (v0, v1, j) of a consumer thread (warp w of its warpgroup, lane = 4·lb + q) is accumulator index
v0 + 2·v1 + 4·j, token row 16·w + lb + 8·v1, feature `feature(j, v0, q)` after RoPE (j < 16: 8j + 2q + v0; the rope
groups j >= 16: 128 + 32·v0 + 4·(j - 16) + q).

Code words: for one token row, a thread's 48 E4M3 codes are 12 words of 4 bytes, word n byte k holding fragment
value `word_members(n)[k]`: words 0-7 are the nope groups j = 2n, 2n+1 (both v0), words 8-11 the rope values
(v0 = (n-8)//2, j = 16 + 4·((n-8)%2) + k). Rowwise block b is exactly words 2b and 2b+1 (one scale per word), and
the columnwise "list" of a thread's 48 columns is the same order (list index 4n + k), so 4 column scale bytes
packed in that order line up with the code word they scale.

Shared code tile (one per output, `rows` x 192 bytes, 16-byte units, no padding): the nope region (rows x 128 B)
holds unit (row, q, s) = words 4s..4s+3 of lane q (s = 0, 1) at row·128 + ((4s + q) ^ swz(row))·16; the rope
region (after it, rows x 64 B) holds words 8..11 of lane q at rows·128 + row·64 + (q ^ ((row >> 1) & 3))·16. A
writer (one thread, one row) stores 3 units with 16-byte stores; the 8 lanes of a quarter warp (rows 2p, 2p+1 x 4
quads) hit 8 different 16-byte bank groups. A reader thread takes one (row, s) nope unit or one rope unit: 4
16-byte loads (one per quad lane q, 8 consecutive rows per quarter warp: again 8 bank groups), byte permutes, and
four 16-byte global stores of 64 consecutive output bytes.

Everything here is plain integer arithmetic, so the same functions run on Python ints (tests/
test_proj_rope_code_tiles.py models the whole path in NumPy) and on the kernel's Int32 values.
"""

from __future__ import annotations

NOPE_GROUPS = 16  # j < 16: features 0..127
WORDS = 12  # code words per thread and token row
NOPE_UNIT_BYTES = 128  # per row: 4 lanes x 2 units of 16 bytes
ROPE_UNIT_BYTES = 64  # per row: 4 lanes x 1 unit
ROW_BYTES = NOPE_UNIT_BYTES + ROPE_UNIT_BYTES

# PRMT selectors (byte i of the result = byte sel[i] of {b, a}, a = bytes 0-3)
PRMT_LO16 = 0x5410  # a.lo16 | b.lo16 << 16
PRMT_HI16 = 0x7632  # a.hi16 | b.hi16 << 16
PRMT_ZIP_LO = 0x5140  # a.b0 b.b0 a.b1 b.b1
PRMT_ZIP_HI = 0x7362  # a.b2 b.b2 a.b3 b.b3
PRMT_SIGN_BYTES = 0xBA98  # each byte of a replaced by its sign bit, replicated


def word_members(n: int) -> list[tuple[int, int]]:
    """The (j, v0) fragment values of code word n, byte 0 first."""
    if n < 8:
        return [(2 * n + k // 2, k % 2) for k in range(4)]
    v0, w = divmod(n - 8, 2)
    return [(NOPE_GROUPS + 4 * w + k, v0) for k in range(4)]


def feature(j: int, v0: int, q):
    """Output feature of fragment value (j, v0) of quad lane q (after RoPE)."""
    if j < NOPE_GROUPS:
        return 8 * j + 2 * q + v0
    return 128 + 32 * v0 + 4 * (j - NOPE_GROUPS) + q


def swz(row):
    """Nope-region swizzle of a row: bit 2 alternates with the row (writer quarter warps: rows 2p, 2p+1), bits 0-1
    count pairs of rows (reader quarter warps: 8 consecutive rows)."""
    return ((row & 1) << 2) | ((row >> 1) & 3)


def nope_unit_offset(row, q, s):
    """Byte offset in a code tile of lane q's nope unit s (words 4s..4s+3) of `row`."""
    return row * NOPE_UNIT_BYTES + (((4 * s + q) ^ swz(row)) * 16)


def rope_unit_offset(rows: int, row, q):
    """Byte offset in a code tile of `rows` rows of lane q's rope unit (words 8..11) of `row`."""
    return rows * NOPE_UNIT_BYTES + row * ROPE_UNIT_BYTES + ((q ^ ((row >> 1) & 3)) * 16)


def col_list_feature(index: int, q) -> int:
    """Feature of entry `index` (= 4n + k) of quad lane q's column list."""
    j, v0 = word_members(index // 4)[index % 4]
    return feature(j, v0, q)


def ff_bytes_bit7(word: int) -> int:
    """Bit 7 of each byte of the 32-bit `word` set iff that byte is 0xFF (no carry crosses bytes); the kernel then
    spreads it over the byte with PRMT_SIGN_BYTES."""
    return ((word & 0x7F7F7F7F) + 0x01010101) & word & 0x80808080
