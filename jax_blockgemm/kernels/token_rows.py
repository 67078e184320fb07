"""The proj_rope epilogue on token rows, shared by the kernels whose epilogue threads each hold one token's features:
sm_100a (tensor-memory 32x32b loads) and sm_90a (rows of an fp32 tile in shared memory, kernels/sm90/y_tile.py).

Thread 32·warp + lane of a 128-token tile owns token 32·warp + lane and takes its 192 features in six 32-feature
blocks. A rowwise block is then 32 values of one thread (reduced in the thread) and a columnwise block (32 tokens of
one feature) is one value in each of a warp's 32 lanes (its maximum: `shuffled_col_code_words` from registers, or the
caller's own from shared memory). RoPE pairs (p[2j], p[2j+1]) sit in one thread. The math is kernels/epilogue.py's;
this module only says where values come from and go to.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from jax_blockgemm.kernels import common, epilogue
from jax_blockgemm.support import HEAD_DIM, MX_BLOCK, QK_ROPE

TILE_T = 128  # tokens per tile: four warps of 32 token rows
WORDS_PER_BLOCK = MX_BLOCK // 4  # one 32-feature block of E4M3 codes is 8 32-bit words


# --- index maps (plain arithmetic on DSL or Python/NumPy integers: the kernels use them, tests/ model them) ------
def code_word(token, head, h):
    """First 32-bit word of (token, head)'s 192 codes in either code output (T, H, 192) (rowwise and columnwise)."""
    return (token * h + head) * (HEAD_DIM // 4)


def row_scale_index(token, head, h):
    """Index of (token, head)'s first rowwise scale byte in out_scales_row (T, H, 6); block b is at + b."""
    return (token * h + head) * (HEAD_DIM // MX_BLOCK)


def col_scale_index(tile_t, warp, lane, head, h):
    """Index, in out_scales_col (T/32, H, 192), of the column scale that lane `lane` of epilogue warp `warp` writes
    for block 0 of token tile `tile_t`: feature `lane` of the warp's 32-token block; block b (features 32b..) is at
    + 32·b."""
    return ((tile_t * (TILE_T // MX_BLOCK) + warp) * h + head) * HEAD_DIM + lane


def rope_source(j: int) -> tuple[int, int]:
    """Where RoPE pair j's even input p[2j] sits among the two 32-feature blocks of features 128..191: (block,
    value); p[2j+1] is the next value of the same block."""
    return (2 * j) // MX_BLOCK, (2 * j) % MX_BLOCK


def table_entry(i: int) -> tuple[int, bool]:
    """Where entry i of a token's 64 bf16 cos (sin) values sits among its 32 words: (word, in the high half)."""
    return i // 2, i % 2 == 1


# --- device pieces ------------------------------------------------------------------------------------------------
def bf16_at(words: cute.Tensor, i: int) -> cutlass.Float32:
    """Entry i of a row of bf16 values held two per 32-bit word (little-endian), as fp32 (exact)."""
    at, high = table_entry(i)
    word = words[at]
    bits = (word & cutlass.Int32(-65536)) if high else (word << 16)
    return common.f32_from_bits(bits)


@cute.jit
def row_code_words(vals: cute.Tensor, inv: cutlass.Float32, bad: cutlass.Boolean) -> cute.Tensor:
    """Rowwise: the block's 32 codes at one scale factor `inv`, four per word (value 4·wd + k in byte k of word wd);
    all zero when the block holds a NaN or inf (`bad`)."""
    words = cute.make_rmem_tensor((WORDS_PER_BLOCK,), cutlass.Int32)
    for wd in cutlass.range_constexpr(WORDS_PER_BLOCK):
        codes = epilogue.e4m3x4(vals[4 * wd] * inv, vals[4 * wd + 1] * inv, vals[4 * wd + 2] * inv,
                                vals[4 * wd + 3] * inv)
        words[wd] = cutlass.Int32(cutlass.select_(bad, cutlass.Int32(0), codes))
    return words


def column_word(vals: cute.Tensor, wd: int, inv: list) -> cutlass.Int32:
    """Codes of values 4·wd .. 4·wd + 3, each at its own column's factor (inv: those four factors)."""
    return epilogue.e4m3x4(*[vals[4 * wd + e] * inv[e] for e in range(4)])


@cute.jit
def zero_bad_columns(words: cute.Tensor, bad_mask: cutlass.Int32):
    """Codes of the columns whose block holds a NaN or inf (bit i of `bad_mask`, a warp ballot: the branch is
    uniform and rarely taken) set to zero, SPEC §2."""
    if bad_mask != 0:
        for wd in cutlass.range_constexpr(WORDS_PER_BLOCK):
            words[wd] = words[wd] & ~epilogue.byte_mask(bad_mask >> (4 * wd))


@cute.jit
def col_code_words(vals: cute.Tensor, inv: cute.Tensor, bad_mask: cutlass.Int32) -> cute.Tensor:
    """Columnwise: value i at its column's factor inv[i], packed as `row_code_words`; NaN/inf columns zero."""
    words = cute.make_rmem_tensor((WORDS_PER_BLOCK,), cutlass.Int32)
    for wd in cutlass.range_constexpr(WORDS_PER_BLOCK):
        words[wd] = column_word(vals, wd, [inv[4 * wd + e] for e in range(4)])
    zero_bad_columns(words, bad_mask)
    return words


@cute.jit
def shuffled_col_code_words(vals: cute.Tensor, lane: cutlass.Int32):
    """`col_code_words` with the column scales from registers alone (sm_100a, whose epilogue has the values only in
    registers): a transposing butterfly for the maxima, then each column's byte by one shuffle as its factor is
    needed (the 32 factors are never live at once). Returns (byte of column `lane`, the code words)."""
    col_bits = cute.make_rmem_tensor((MX_BLOCK,), cutlass.Int32)
    for i in cutlass.range_constexpr(MX_BLOCK):
        col_bits[i] = common.abs_bits(vals[i])
    col_byte, _, col_bad = epilogue.e8m0_scale(epilogue.warp_column_max(col_bits, lane))
    words = cute.make_rmem_tensor((WORDS_PER_BLOCK,), cutlass.Int32)
    for wd in cutlass.range_constexpr(WORDS_PER_BLOCK):
        inv = []
        for e in cutlass.range_constexpr(4):
            factor, _ = epilogue.e8m0_inverse(cute.arch.shuffle_sync(col_byte, 4 * wd + e))
            inv.append(factor)
        words[wd] = column_word(vals, wd, inv)
    zero_bad_columns(words, cute.arch.vote_ballot_sync(col_bad))
    return col_byte, words


@cute.jit
def row_quantize(vals: cute.Tensor):
    """Rowwise: this thread's 32 values are the block (amax by `epilogue.amax_tree`). Returns (scale byte, the 8
    code words)."""
    amax = epilogue.amax_tree([vals[i] for i in range(MX_BLOCK)])  # a comprehension: unrolled
    row_byte, inv, bad = epilogue.e8m0_scale(common.bits_from_f32(amax))
    return row_byte, row_code_words(vals, inv, bad)


@cute.jit
def store_scales(row_byte: cutlass.Int32, col_byte: cutlass.Int32, b: cutlass.Int32, live: cutlass.Boolean,
                 row_scales: cute.Tensor, col_scales: cute.Tensor, row_scale0: cutlass.Int32,
                 col_scale0: cutlass.Int32):
    """Block b's scale bytes: this token's rowwise one, and (lane l) column 32b + l's of the warp's 32 tokens.
    row_scale0 = row_scale_index(token, ..), col_scale0 = col_scale_index(tile_t, warp, lane, ..); a warp past T
    (`live` false) stores nothing."""
    if live:
        row_scales[row_scale0 + b] = row_byte.to(cutlass.Uint8)
        col_scales[col_scale0 + b * MX_BLOCK] = col_byte.to(cutlass.Uint8)


@cute.jit
def quantize_block(vals: cute.Tensor, col_words: cute.Tensor, col_byte: cutlass.Int32, b: cutlass.Int32,
                   live: cutlass.Boolean, row32: cute.Tensor, col32: cute.Tensor, row_scales: cute.Tensor,
                   col_scales: cute.Tensor, out_word: cutlass.Int32, row_scale0: cutlass.Int32,
                   col_scale0: cutlass.Int32):
    """Output features 32b..32b+31 of this thread's token (`vals`, fp32): the rowwise quantization, then this
    thread's stores of both (its token's 32 code bytes of each output, its scale bytes).

    Columnwise: value i's block is value i of the warp's 32 lanes (32 consecutive tokens); the caller brings its
    codes and this lane's column scale byte (`shuffled_col_code_words`). row32/col32 are 32-bit views of the code
    outputs, out_word = code_word(token, ..); the scale indices as `store_scales`.
    """
    row_byte, row_words = row_quantize(vals)
    if live:
        first = cute.assume(out_word + b * WORDS_PER_BLOCK, divby=WORDS_PER_BLOCK)  # 32-byte aligned
        cute.autovec_copy(row_words, cute.make_tensor(row32.iterator + first, row_words.layout))
        cute.autovec_copy(col_words, cute.make_tensor(col32.iterator + first, col_words.layout))
    store_scales(row_byte, col_byte, b, live, row_scales, col_scales, row_scale0, col_scale0)


@cute.jit
def quantize_block_shuffled(vals: cute.Tensor, b: cutlass.Int32, lane: cutlass.Int32, live: cutlass.Boolean,
                            row32: cute.Tensor, col32: cute.Tensor, row_scales: cute.Tensor, col_scales: cute.Tensor,
                            out_word: cutlass.Int32, row_scale0: cutlass.Int32, col_scale0: cutlass.Int32):
    """`quantize_block` with the columnwise codes from registers (`shuffled_col_code_words`): the sm_100a epilogue."""
    col_byte, col_words = shuffled_col_code_words(vals, lane)
    quantize_block(vals, col_words, col_byte, b, live, row32, col32, row_scales, col_scales, out_word, row_scale0,
                   col_scale0)


def word_views(row_codes: cute.Tensor, col_codes: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor) -> tuple:
    """32-bit views of the byte outputs and of the bf16 rotary tables (two values per word)."""
    def words(tensor: cute.Tensor, per_word: int) -> cute.Tensor:
        return cute.make_tensor(cute.recast_ptr(tensor.iterator, dtype=cutlass.Int32),
                                cute.make_layout((cute.size(tensor) // per_word,)))
    return words(row_codes, 4), words(col_codes, 4), words(cos, 2), words(sin, 2)


def load_rope_tables(cos32: cute.Tensor, sin32: cute.Tensor, token, t) -> tuple[cute.Tensor, cute.Tensor]:
    """This token's rotary tables as 32 words each (word q: entries 2q, low half, and 2q+1); a token past T reads
    row T - 1 (valid memory, unused). 128-byte rows: 16-byte loads."""
    table_row = cutlass.min(token, t - 1) * (QK_ROPE // 2)
    rcos = cute.make_rmem_tensor((QK_ROPE // 2,), cutlass.Int32)
    rsin = cute.make_rmem_tensor((QK_ROPE // 2,), cutlass.Int32)
    table_word0 = cute.assume(table_row, divby=QK_ROPE // 2)
    cute.autovec_copy(cute.make_tensor(cos32.iterator + table_word0, rcos.layout), rcos)
    cute.autovec_copy(cute.make_tensor(sin32.iterator + table_word0, rsin.layout), rsin)
    return rcos, rsin


def rope(p_lo: cute.Tensor, p_hi: cute.Tensor, rcos: cute.Tensor, rsin: cute.Tensor, out_lo: cute.Tensor,
         out_hi: cute.Tensor) -> None:
    """SPEC §5 RoPE of a token's 64 rope features p = (p_lo, p_hi) (features 128..191 of Y) into out[128 + j]
    (out_lo) and out[160 + j] (out_hi), in fp32."""
    half = QK_ROPE // 2
    for j in range(half):
        load, e = rope_source(j)
        src = (p_lo, p_hi)[load]
        first, second = epilogue.rope_pair(src[e], src[e + 1], bf16_at(rcos, j), bf16_at(rsin, j),
                                           bf16_at(rcos, half + j), bf16_at(rsin, half + j))
        out_lo[j] = first
        out_hi[j] = second
