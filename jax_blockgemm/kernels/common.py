"""Device helpers every gemm_amax kernel shares (Hopper now, Blackwell next).

All of them are small `@cute.jit` functions or plain-Python layout math, so a kernel body inlines them:
E8M0 decoding with integer bit arithmetic (Hopper has no E8M0 conversion instruction), the byte offsets of
the SPEC §3 "128x4 atom" scale layout, and the amax reduction that ends in one integer atomic max per CTA.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_blockgemm.kernels import ptx_ops
from jax_blockgemm.support import HEAD_DIM, MX_BLOCK

# --- configuration checks --------------------------------------------------------------------------------
def require_choice(name: str, value, allowed) -> None:
    """Raise ValueError naming `name` unless `value` is one of `allowed` (a kernel's compile-time option)."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; expected one of {allowed}")


def operand_view(x: cute.Tensor, rows, k, l, mn_major: bool, row_align: int = 16) -> cute.Tensor:
    """The (rows, K, L) view of a flat gemm_amax operand buffer: (L, rows, K) K-major, or (L, K, rows) MN-major
    (rows then a multiple of `row_align`, the elements of a 16-byte TMA row: 16 one-byte codes, 8 bf16). `k`
    counts the buffer's elements along K (bytes for packed FP4)."""
    if mn_major:
        rows16 = cute.assume(rows, divby=row_align)
        return cute.make_tensor(x.iterator, cute.make_layout((rows16, k, l), stride=(1, rows16, rows16 * k)))
    return cute.make_tensor(x.iterator, cute.make_layout((rows, k, l), stride=(k, 1, rows * k)))


def proj_rope_can_implement(t: int, k: int, h: int) -> tuple[bool, str]:
    """Whether a proj_rope kernel (sm_90a or sm_100a: the same ABI and size rules) takes (T, K, H), and why not."""
    if min(t, k, h) < 1:
        return False, f"every size must be >= 1, got t={t}, k={k}, h={h}"
    if t % MX_BLOCK:
        return False, f"t must be a multiple of {MX_BLOCK} (the columnwise blocks), got t={t}"
    if k % 8:
        return False, f"k must be a multiple of 8 (16-byte bf16 rows for TMA), got k={k}"
    if max(t, h * HEAD_DIM) * k >= 2**31 or t * h * HEAD_DIM >= 2**31:
        return False, f"operands and outputs must hold fewer than 2**31 elements, got t={t}, k={k}, h={h}"
    return True, ""


# --- the 128x4 scale-factor atom (SPEC §3) ---------------------------------------------------------------
ATOM_MN = 128  # rows (of M or N) covered by one atom
ATOM_KB = 4  # k-blocks covered by one atom
ATOM_BYTES = ATOM_MN * ATOM_KB  # 512: one atom is one contiguous chunk

# Bit patterns used by the decoder and the amax.
F32_ABS_MASK = 0x7FFFFFFF
E8M0_ZERO_BITS = 0x00400000  # 2^-127, the value of E8M0 byte 0 (a float32 subnormal)


def atom_chunk_index(l: int, mn_tile: int, k_tile: int, mn_tiles: int, k_tiles: int) -> int:
    """Index of the 512-byte atom holding rows [128·mn_tile, +128) and k-blocks [4·k_tile, +4) of batch l."""
    return (l * mn_tiles + mn_tile) * k_tiles + k_tile


def atom_word_offset(mn_in_tile: int) -> int:
    """Offset, in 32-bit words inside one atom, of the word holding the 4 k-block scales of row `mn_in_tile`.

    Byte kb%4 of that word is the scale of k-block kb (the atom stores (mn%32)·16 + ((mn//32)%4)·4 + kb%4).
    """
    return (mn_in_tile % 32) * 4 + (mn_in_tile // 32) % 4


def atom_block_offset(kb: int) -> int:
    """The part of a scale's byte offset in the atom buffer that k-block `kb` (>= 0) adds to its row's first byte
    (the atom of k-blocks [4·(kb // 4), +4), byte kb % 4 of the row's word): shifts and masks, as kernels want them."""
    return (kb >> 2) * ATOM_BYTES + (kb & (ATOM_KB - 1))


def atom_byte_offset(l: int, mn: int, kb: int, mn_size: int, kb_size: int) -> int:
    """Byte offset of scale S[l, mn, kb] in the physical atom buffer (SPEC §3), for host-side checks."""
    mn_tiles = -(-mn_size // ATOM_MN)
    k_tiles = -(-kb_size // ATOM_KB)
    row = atom_chunk_index(l, mn // ATOM_MN, 0, mn_tiles, k_tiles) * ATOM_BYTES + 4 * atom_word_offset(mn % ATOM_MN)
    return row + atom_block_offset(kb)


# --- bit casts ---------------------------------------------------------------------------------------------
@dsl_user_op
def f32_from_bits(bits: cutlass.Int32, *, loc=None, ip=None) -> cutlass.Float32:
    """Reinterpret an Int32 bit pattern as a Float32."""
    return cutlass.Float32(llvm.bitcast(T.f32(), cutlass.Int32(bits).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def bits_from_f32(x: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Int32:
    """Reinterpret a Float32 as its Int32 bit pattern."""
    return cutlass.Int32(llvm.bitcast(T.i32(), cutlass.Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


# --- E8M0 -----------------------------------------------------------------------------------------------
@cute.jit
def e8m0_bits(byte: cutlass.Int32) -> cutlass.Int32:
    """Float32 bits of the E8M0 byte `byte` (0..255): b<<23, except 0 -> 2^-127 and 0xFF -> quiet NaN.

    Branch-free: the two exceptions are exactly the bytes for which (b + 1) & 0xFE == 0, and both are fixed
    by setting bit 22 (0 -> 0x00400000, 0x7F800000 -> 0x7FC00000).
    """
    special = (((byte + 1) & 0xFE) - 1) >> 31  # -1 for bytes 0 and 255, else 0 (arithmetic shift)
    return (byte << 23) | (special & E8M0_ZERO_BITS)


@cute.jit
def e8m0_word_to_f32(word: cutlass.Int32, j: cutlass.Int32) -> cutlass.Float32:
    """Decode byte `j` (0..3, little-endian) of a 32-bit word of four E8M0 scales into the Float32 2^(b-127)."""
    return f32_from_bits(e8m0_bits((word >> (8 * j)) & 0xFF))


# --- E2M1 (FP4) codes and E4M3 scales, for dequantizing to bf16 ------------------------------------------
# A byte holds two E2M1 codes (SPEC §1: element 2i in the low nibble), a 32-bit word eight: code j in bits 4j..4j+3.
# Bit model: a nibble s|e1 e0|m (sign, 2 exponent bits, 1 mantissa bit) becomes the bfloat16 bit pattern
# s<<15 | (e1 e0 m)<<6, which is exactly code·2^-126: for e >= 1 it is the normal 2^(e-127)·(1 + m/2) =
# 2^(e-1)·(1 + m/2)·2^-126, and for e = 0 the subnormal m·2^-127 = (m/2)·2^-126. One multiply by 2^126 (a normal
# bf16) gives the code itself, exactly; a second by the block scale gives code·scale, exact in bf16 for an E8M0
# scale (a power of two; byte 0 is the subnormal 2^-127, 0.5·2^-127 is still a bf16 subnormal) and for a
# positive E4M3 scale (at most 2 + 4 significant bits, magnitudes in [2^-10, 2688]).
# Pair i (0..3) of a word: codes i and i + 4 (bits 4i.. and 16 + 4i..) land in the low and high bf16 of one
# 32-bit word with the same shifts for both halves; the kernel writes B with the same order as A, so the k
# permutation this makes inside each group of 8 leaves the dot product unchanged (scale blocks are not crossed).
E2M1_MAG_MASK_X2 = 0x01C001C0  # bf16 bits 6..8 of both halves: (e1 e0 m)
E2M1_SIGN_MASK_X2 = -0x7FFF8000  # 0x80008000 as a signed int32: bit 15 of both halves
BF16X2_TWO_POW_126 = 0x7E807E80  # 2^126 in both halves (biased exponent 253)


def e2m1_pair_shifts(i: int) -> tuple[int, int]:
    """Left shifts (negative: right) that move code i's magnitude to bf16 bit 6 and its sign to bit 15."""
    return 6 - 4 * i, 12 - 4 * i


def _shift(x, amount: int):
    return x << amount if amount > 0 else (x >> -amount if amount < 0 else x)


def e2m1_pair_bits(word, i: int):
    """bf16x2 bit pattern (code·2^-126 each) of codes i (low half) and i + 4 (high half) of a word of 8 E2M1 codes.

    Plain Python on Int32 (the kernel inlines it; tests run it on NumPy int64). Arithmetic right shifts only fill
    bits 26..31, which the masks drop.
    """
    mag_shift, sign_shift = e2m1_pair_shifts(i)
    return (_shift(word, mag_shift) & E2M1_MAG_MASK_X2) | (_shift(word, sign_shift) & E2M1_SIGN_MASK_X2)


F32_TWO_POW_120 = 2.0**120
E4M3_NAN_BF16X2 = 0x7FC07FC0


@cute.jit
def e4m3_scale_bf16x2(byte: cutlass.Int32) -> cutlass.Int32:
    """An E4M3 byte (NVFP4 block scale) as a packed pair of equal bfloat16 values (exact: 4 significant bits).

    Bits 0..6 moved to float32 bits 20..26 are the value·2^-120 (E4M3 subnormals become float32 subnormals of the
    same value·2^-120); times 2^120 in float32 gives the value, whose float32 bits have 16 zero low bits. The
    sign is kept; the NaN bytes 0x7F / 0xFF give a bf16 NaN.
    """
    mag = byte & 0x7F
    value = f32_from_bits(mag << 20) * cutlass.Float32(F32_TWO_POW_120)
    high = ((bits_from_f32(value) >> 16) & 0x7FFF) | ((byte & 0x80) << 8)
    pair = high | (high << 16)
    if mag == 0x7F:
        pair = cutlass.Int32(E4M3_NAN_BF16X2)
    return pair


# --- E4M3 codes to bf16 by bit moves (the decode kernel and the ragged swap_ab kernel) --------------------
NEG_ZERO_BF16X2 = -0x7FFF8000  # bf16x2 -0 (0x80008000), the addend of a packed multiply: x·s + (-0) == x·s, +0 too
E4M3_PLACEMENT = 120  # an E4M3 code placed by e4m3_pair_bits reads as code·2^-E4M3_PLACEMENT
BF16X2_TWO_POW_120 = (127 + E4M3_PLACEMENT) * 0x00800080  # 2^120 in both halves (0x7B807B80)
_HIGH_BITS = -0x7F7F7F80  # 0x80808080: bit 7 of every byte
_BYTE_ONES = 0x01010101  # 1 in every byte
# One packed multiply per E4M3 word instead of two: the placed codes times 2^120·scale at once, while that power of
# two is a bf16 normal (biased exponent at most 254): E8M0 bytes up to 134. Likewise for E2M1 codes placed by
# `e2m1_pair_bits` (code·2^-126) up to byte 128, which the swap_ab kernel uses; the decode kernel's MXFP4 keeps two
# multiplies (with one its 16-token objects spill).
ONE_MULTIPLY_MAX_BYTE = 254 - E4M3_PLACEMENT
E2M1_PLACEMENT = 126  # an E2M1 code placed by e2m1_pair_bits reads as code·2^-E2M1_PLACEMENT
E2M1_ONE_MULTIPLY_MAX_BYTE = 254 - E2M1_PLACEMENT
# prmt selectors spreading bytes 0, 1 (2, 3) of a word into the low bytes of a word's halves, each over a byte of its
# sign bit: the halves read s·0xFF00 | code, so a shift by 4 and one mask place the code (`e4m3_pair_bits`)
E4M3_PAIR_SELECTORS = (0x9180, 0xB3A2)
_E4M3_PAIR_MASK = -0x780F7810  # 0x87F087F0: the sign bit and the 7 bits below bit 11 of both halves


def e8m0_bf16x2(byte):
    """An E8M0 scale byte as a pair of equal bf16 values 2^(b-127): b·0x00800080 puts b in both exponent fields;
    byte 0 (2^-127) becomes the subnormal 0x0040 and byte 255 the NaN 0x7FC0 by setting bit 6 of both halves."""
    special = (((byte + 1) & 0xFE) - 1) >> 31  # -1 for bytes 0 and 255, else 0 (arithmetic shift)
    return byte * 0x00800080 | (special & 0x00400040)


def e4m3_pair_bits(word, high: bool, byte_perm):
    """bf16x2 bits of codes 0, 1 (bytes 0, 1 of `word`; `high`: codes 2, 3) of a word of four E4M3 codes, each
    placed as s<<15 | eeeemmm<<4: exactly code·2^-120, subnormals included (NaN codes read as 480·2^-120). Plain
    Python on Int32 but for `byte_perm(word, selector)`, prmt.b32 of the word with itself: the kernel passes the
    instruction, tests an emulation. Three instructions per pair: prmt, shift, mask."""
    return (byte_perm(word, E4M3_PAIR_SELECTORS[int(high)]) << 4) & _E4M3_PAIR_MASK


def e4m3_nan_any(words):
    """Nonzero exactly where one of `words` (four E4M3 codes each) holds a NaN code (0x7F or 0xFF). Adding 1 to every
    byte flips bit 7 of exactly the NaN bytes (0x7F to 0x80, 0xFF to 0x00), and a carry into a byte needs a 0xFF
    below it: the lowest NaN byte of a word always flips, a word without one flips none. Two instructions a word (the
    add, and one three-input logic op folding its flips into the running OR), the mask once. Plain Python."""
    flips = 0
    for word in words:
        flips = flips | ((word + _BYTE_ONES) ^ word)
    return flips & _HIGH_BITS


# --- the decode tiles' token columns, ordered in shared memory by the producer warps ----------------------------
# A 16-byte chunk v = 4c + u of a token row's 128-column k-tile (its columns 8v .. 8v + 7 as TMA lands them) holds,
# in the order the swap_ab kernel's weight fragments want
# (`swap_ab_layout.swap_ab_column_order`), four bf16 pairs of logical chunks 4u .. 4u + 3, each at byte 4c of its
# chunk: `token_chunk_words` gives the four words, word q going to logical chunk 4u + q.
FP4_TOKEN_PAIR_SELECTORS = (0x5410, 0x7632)  # prmt: the low (high) halves of words a and b as one pair


def token_chunk_words(words: list, fp4: bool, byte_perm) -> list:
    """The four bf16x2 words chunk v of a token row's k-tile contributes, word q to logical chunk 4u + q: for FP8
    weights its own words (codes pair as consecutive bytes, columns pair as loaded); for FP4 weights, whose codes i
    and i + 4 of a word pair up, elements q and q + 4 of the chunk, by one `byte_perm(a, b, selector)` (prmt.b32;
    tests pass an emulation) each. Plain Python otherwise."""
    if not fp4:
        return list(words)
    return [byte_perm(words[q // 2], words[q // 2 + 2], FP4_TOKEN_PAIR_SELECTORS[q % 2]) for q in range(4)]


def token_chunk_place(v, q: int) -> tuple:
    """(logical 16-byte chunk, byte offset in it) of word q of chunk v (`token_chunk_words`) of a 128-column k-tile,
    whose weight codes come four chunks of tokens to a lane: chunk v = 4c + u goes to logical chunk 4u + q at byte
    4c. Plain Python."""
    return 4 * (v % 4) + q, 4 * (v // 4)


def one_multiply_bf16x2(byte, placement: int = E4M3_PLACEMENT):
    """The bf16x2 pair 2^placement·2^(byte-127) for E8M0 byte `byte`: codes placed as code·2^-placement (E4M3 by
    `e4m3_pair_bits`, E2M1 by `e2m1_pair_bits` with E2M1_PLACEMENT) times it give code·scale in one multiply, while
    byte <= 254 - placement. Plain Python."""
    return (byte + placement) * 0x00800080


# --- amax ----------------------------------------------------------------------------------------------
@cute.jit
def abs_bits(x: cutlass.Float32) -> cutlass.Int32:
    """|x| as an Int32 bit pattern: non-negative floats order like ints, and every NaN beats +inf."""
    return bits_from_f32(x) & F32_ABS_MASK


@cute.jit
def _warp_amax_to_shared(thread_amax_bits: cutlass.Int32, smem_warp_amax: cute.Tensor, local_tid: cutlass.Int32,
                         num_warps: cutlass.Constexpr[int], barrier_id: cutlass.Constexpr[int],
                         barrier_threads: cutlass.Constexpr[int] = 0):
    """Each warp's max of per-thread |x| bit patterns (redux.sync) into its shared-memory slot, then a named barrier
    over those `num_warps` warps (or `barrier_threads`, where other warps arrive at it too)."""
    warp_max = cute.arch.warp_redux_sync(thread_amax_bits, "max")
    warp = local_tid // 32
    if local_tid % 32 == 0:
        smem_warp_amax[warp] = warp_max
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=barrier_threads or num_warps * 32)


def _slots_max(smem_warp_amax: cute.Tensor, num_warps: int) -> cutlass.Int32:
    """The max of the warps' slots (`_warp_amax_to_shared`)."""
    block_max = smem_warp_amax[0]
    for w in range(1, num_warps):  # a Python loop: unrolled while traced
        block_max = cutlass.max(block_max, smem_warp_amax[w])
    return block_max


@cute.jit
def amax_block_reduce_and_publish(
    thread_amax_bits: cutlass.Int32,
    smem_warp_amax: cute.Tensor,
    amax_ptr: cute.Pointer,
    local_tid: cutlass.Int32,
    num_warps: cutlass.Constexpr[int],
    barrier_id: cutlass.Constexpr[int],
):
    """Reduce per-thread |x| bit patterns over `num_warps` warps and fold the result into *amax_ptr by one
    `atomicMax` on the int32 view of the float32 amax from the first thread. The caller zeroed *amax_ptr."""
    _warp_amax_to_shared(thread_amax_bits, smem_warp_amax, local_tid, num_warps, barrier_id)
    if local_tid == 0:
        cute.arch.atomic_max(amax_ptr, _slots_max(smem_warp_amax, num_warps))


@cute.jit
def amax_block_reduce_and_fold_last(thread_amax_bits: cutlass.Int32, smem_warp_amax: cute.Tensor,
                                    tally: cutlass.Int64, amax: cutlass.Int64, ctas: cutlass.Int32,
                                    local_tid: cutlass.Int32, num_warps: cutlass.Constexpr[int],
                                    barrier_id: cutlass.Constexpr[int]):
    """Reduce per-thread |x| bit patterns over `num_warps` warps and fold the result into the float32 at address
    `amax` through the two-word `tally` that `ctas` CTAs share (ptx_ops.fold_amax_last_cta): nothing zeroes amax
    before the kernel."""
    _warp_amax_to_shared(thread_amax_bits, smem_warp_amax, local_tid, num_warps, barrier_id)
    if local_tid == 0:
        ptx_ops.fold_amax_last_cta(tally, amax, _slots_max(smem_warp_amax, num_warps), ctas)


@cute.jit
def amax_block_reduce_into_open(thread_amax_bits: cutlass.Int32, smem_warp_amax: cute.Tensor, amax: cutlass.Int64,
                                local_tid: cutlass.Int32, num_warps: cutlass.Constexpr[int],
                                barrier_id: cutlass.Constexpr[int], barrier_threads: cutlass.Constexpr[int]):
    """Reduce per-thread |x| bit patterns over `num_warps` warps and fold the result into the float32 at address
    `amax`, which the open tally zeroed (ptx_ops.tally_open): the barrier's other warps arrive once this CTA's turn
    at the tally is taken, and the fold is one reduction that nothing waits for."""
    _warp_amax_to_shared(thread_amax_bits, smem_warp_amax, local_tid, num_warps, barrier_id, barrier_threads)
    if local_tid == 0:
        ptx_ops.red_max_bits(amax, _slots_max(smem_warp_amax, num_warps))
