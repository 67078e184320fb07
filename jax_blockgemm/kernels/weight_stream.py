"""Decode GEMM: a few rows of bf16 activations times block-scaled weights streamed once from memory, with amax.

C[l, m, n] = Σ_k x[l, m, k] · Ŵ[l, n, k] for M up to the variant's token capacity (decode: M = 1..64), where the
time is that of reading Ŵ (N·K codes and their scales) once. One design for sm_90 and later (TMA copies; no wgmma,
no tensor memory): warp-level `mma.sync` m16n8k16 bf16 with fp32 accumulation.

Roles are swapped against the large-GEMM kernels: the weight rows are the MMA's M (16 per instruction) and the
tokens its N (8), so one token pads only the N of 8. A CTA of WARPS warps owns tile[0] consecutive weight rows and
all of K; warp w takes the K-chunks w, w + WARPS, ... (a chunk is 64 FP8 or 128 FP4 codes of every row), so every
warp streams. Each warp's chunks arrive by TMA, one box of the CTA's rows per chunk (zeros past N and K), in a
shared-memory ring of its own, up to MAX_STAGES - 1 chunks ahead of the one it multiplies, each completing on the
stage's mbarrier: the bytes in flight take shared memory, not registers, and the warp that multiplies a stage is the
one that refills it, so a warp synchronizes with no other. Each lane reads 16 bytes of codes per row slot. Its scale
bytes (one per row slot and block, loaded as bytes: no word to pick them from) and the
activations (L2-resident: every CTA reads them) come a chunk ahead in registers. The codes become bf16 code·scale in
registers (exact: SPEC §6's argument): E4M3 by bit moves and packed bf16 multiplies, E5M2 through the hardware
converter (which keeps its infinities and NaNs), FP4 by the bit model of kernels/common.py. Each lane's 16 bytes
feed the k-slots the mma gives that lane (a permutation of K applied identically to the activations, which each lane
loads for the same k's), and every chunk's MMAs sum into a fresh fp32 partial that is then added to the accumulator.
At the end the warps' partial C tiles meet in shared memory and are summed in warp order: the result is the same bits
on every run (a deterministic split of K). alpha (NVFP4's per-tensor factor; 1 otherwise) multiplies the sums, which
are stored with predication (any M, N). amax[l] needs nothing to zero it first: each CTA folds its max |C| bits and
its arrival into the batch's two words of a tally the handler keeps per call site and device (zero between
launches), and the last of the batch's CTAs to arrive writes amax[l] and zeroes the words again (a memset before the
launch cost a decode GEMM as much as 10% on XLA's stream). Without a tally (a caller that drops amax) amax is
skipped.

Accuracy: SPEC §7's "exact" class (bf16 products are exact, sums in fp32 per chunk of at most 128 products).
What it reaches on the H200, what limits it and the designs measured before it: docs/design/decode.md.

ABI (catalog op "weight_stream"): fn(x, w, sw, c, amax, alpha, tally, m, n, k, l, sf_atom, stream), flat buffers:
x bf16 (L, M, K); w codes (L, N, K) (packed FP4: (L, N, K/2) uint8); sw scale bytes, compact (L, N, ceil(K/v)) when
sf_atom is 0, SPEC §3's atom form when 1; c (L, M, N) row-major; amax (L,) float32 (written, never read); alpha (L,)
float32; tally (L,) int64 (two int32 words per batch), zero at the launch and left so (the handler's), or a null
pointer where amax is not wanted; sizes int32 (k counts codes). The handler (ffi/weight_stream.cc) checks every size
against `can_implement`.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_blockgemm.kernels import common
from jax_blockgemm.kernels.ptx_ops import (asm, byte_perm, ld_global_nc_u8_if, ld_global_nc_v4_if, ld_shared_v4,
                                          words)

WARPS = 8  # warps per CTA, each on its own K-chunks of the CTA's rows
THREADS = 32 * WARPS
LANE_BYTES = 16  # bytes of codes a lane multiplies per row and chunk
ROW_BYTES = 4 * LANE_BYTES  # bytes of codes of one row per chunk (a quad of lanes): a row of a TMA box
MAX_STAGES = 8  # shared-memory ring stages per warp at most (7 chunks of codes in flight while one is multiplied)
SHARED_BYTES_PER_SM = 216 * 1024  # the rings (later the partial C tiles) of the CTAs on one SM (227 KB on sm_90/100)
CTAS_PER_SM_X_AHEAD = 2  # CTAs per SM (splitting its shared memory and registers) for tiles whose activations are
# loaded ahead (x_ahead: few registers); the 64-token tile needs its registers and runs one CTA per SM
X_STAGES = 2  # register stages of activations: the chunk being multiplied and X_STAGES - 1 loaded ahead
X_AHEAD_MAX_TILES = 2  # token tiles whose activations are loaded ahead (more would cost too many registers)
X_AHEAD_MAX_WORDS = 16  # and at most this many registers per stage: FP4's second tile (16 words) loads where used
_W_DTYPES = {"float8_e4m3fn": cutlass.Float8E4M3FN, "float8_e5m2": cutlass.Float8E5M2,
             "float4_e2m1fn": cutlass.Uint8}
_C_DTYPES = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
_SCALINGS = {(32, "float8_e8m0fnu"), (16, "float8_e4m3fn")}


@dsl_user_op
def fp8x4_scaled_bf16(word, scale, e5m2: bool, *, loc=None, ip=None) -> list:
    """Four FP8 codes (bytes 0..3 of `word`) times the float32 `scale` as two bf16x2 words (codes 0,1 and 2,3),
    exactly: code -> f16 (hardware converter) -> f32, times the scale in f32, rounded to bf16 (exact for a power of
    two scale unless the product leaves bf16's range, as in the reference)."""
    fmt = "e5m2x2" if e5m2 else "e4m3x2"
    ret = llvm.StructType.get_literal([T.i32()] * 2)
    out = asm(ret, [cutlass.Int32(word), cutlass.Float32(scale)],
              "{ .reg .b16 l, h, a, b, c, d; .reg .b32 p, q; .reg .f32 f0, f1, f2, f3; "
              "mov.b32 {l, h}, $2; "
              f"cvt.rn.f16x2.{fmt} p, l; cvt.rn.f16x2.{fmt} q, h; "
              "mov.b32 {a, b}, p; mov.b32 {c, d}, q; "
              "cvt.f32.f16 f0, a; cvt.f32.f16 f1, b; cvt.f32.f16 f2, c; cvt.f32.f16 f3, d; "
              "mul.rn.f32 f0, f0, $3; mul.rn.f32 f1, f1, $3; mul.rn.f32 f2, f2, $3; mul.rn.f32 f3, f3, $3; "
              "cvt.rn.bf16x2.f32 $0, f1, f0; cvt.rn.bf16x2.f32 $1, f3, f2; }", "=r,=r,r,f", False, loc, ip)
    return words(out, 2, loc, ip)


@dsl_user_op
def mma_bf16_m16n8k16(a: list, b: list, c: list, *, loc=None, ip=None) -> list:
    """D = A·B + C of one mma.sync m16n8k16 (bf16 operands, fp32 accumulator): a four words, b two, c four floats."""
    ret = llvm.StructType.get_literal([T.f32()] * 4)
    args = [cutlass.Int32(x) for x in a] + [cutlass.Int32(x) for x in b] + [cutlass.Float32(x) for x in c]
    out = asm(ret, args, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, "
                         "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
              "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3", False, loc, ip)
    return [cutlass.Float32(llvm.extractvalue(T.f32(), out, [i], loc=loc, ip=ip)) for i in range(4)]


class WeightStreamGemm:
    """The decode GEMM for one weight format, C dtype and tile: (weight rows per CTA, largest M)."""

    def __init__(self, *, w_dtype: str = "float8_e4m3fn", c_dtype: str = "float32", sf_vec_size: int = 32,
                 sf_dtype: str = "float8_e8m0fnu", tile: tuple = (32, 16)):
        common.require_choice("w_dtype", w_dtype, _W_DTYPES)
        common.require_choice("c_dtype", c_dtype, _C_DTYPES)
        if (sf_vec_size, sf_dtype) not in _SCALINGS:
            raise ValueError(f"(sf_vec_size, sf_dtype)=({sf_vec_size}, {sf_dtype!r}) is not supported; allowed: "
                             f"{sorted(_SCALINGS)}")
        self.fp4 = w_dtype == "float4_e2m1fn"
        if sf_dtype == "float8_e4m3fn" and not self.fp4:
            raise ValueError("E4M3 scales (NVFP4) take float4_e2m1fn weights")
        rows, tokens = tile
        if rows % 16 or rows < 16 or tokens % 8 or tokens < 8:
            raise ValueError(f"tile=({rows}, {tokens}): rows must be a multiple of 16, tokens a multiple of 8")
        self.w_name = w_dtype
        self.ab_dtype = _W_DTYPES[w_dtype]
        self.c_dtype = _C_DTYPES[c_dtype]
        self.sf_vec_size, self.sf_e4m3 = sf_vec_size, sf_dtype == "float8_e4m3fn"
        self.rows, self.tokens = rows, tokens
        self.row_tiles, self.token_tiles = rows // 16, tokens // 8
        self.lane_codes = 2 * LANE_BYTES if self.fp4 else LANE_BYTES  # codes per lane, row and chunk
        self.chunk = 4 * self.lane_codes  # codes of a row per chunk: the four lanes of a quad
        self.steps = self.lane_codes // 4  # mma k16 steps per chunk
        self.lane_scales = max(1, self.lane_codes // sf_vec_size)  # scale blocks per lane, row and chunk (2: NVFP4)
        self.x_words = self.lane_codes // 2  # bf16x2 words of one token's activations per lane and chunk
        # with few tokens the activations are loaded a chunk ahead in registers; with many, where they are used
        self.x_ahead = self.token_tiles <= X_AHEAD_MAX_TILES
        # token tiles whose activations load a chunk ahead (the others load where they are used)
        self.x_ahead_tiles = min(self.token_tiles, X_AHEAD_MAX_WORDS // self.x_words) if self.x_ahead else 0
        # one warp's share of a ring stage, a TMA box: ROW_BYTES of codes per row (scale bytes go to registers)
        self.warp_stage_bytes = rows * ROW_BYTES
        self.scale_shift = sf_vec_size.bit_length() - 1  # code index >> scale_shift = its scale block
        self.ctas_per_sm = CTAS_PER_SM_X_AHEAD if self.x_ahead else 1
        self.stages = min(MAX_STAGES, SHARED_BYTES_PER_SM // self.ctas_per_sm // (WARPS * self.warp_stage_bytes))
        if self.stages < 2:
            raise ValueError(f"tile=({rows}, {tokens}) leaves no room for two ring stages in shared memory")
        self.sums_per_thread = rows * tokens // THREADS  # C elements each thread sums and stores in the epilogue
        if rows * tokens % THREADS:
            raise ValueError(f"tile=({rows}, {tokens}): rows x tokens must be a multiple of {THREADS}")
        # the warps' partial C tiles reuse the ring's bytes once every warp is past its mainloop
        self.shared_words = max(self.stages * WARPS * self.warp_stage_bytes, 4 * WARPS * rows * tokens) // 4

    def can_implement(self, m: int, n: int, k: int, l: int) -> tuple[bool, str]:
        """Whether this variant takes (M, N, K, L)."""
        if min(m, n, k, l) < 1:
            return False, f"every size must be >= 1, got (M, N, K, L) = ({m}, {n}, {k}, {l})"
        if m > self.tokens:
            return False, f"M = {m} is past this variant's {self.tokens} tokens"
        row_bytes = 16 * (2 if self.fp4 else 1)
        if k % row_bytes:
            return False, f"K must be a multiple of {row_bytes} (16-byte weight rows), got {k}"
        if max(l * m * k, l * n * k, l * m * n) >= 2**31:
            return False, "operands must hold fewer than 2**31 elements"
        return True, ""

    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, sw: cute.Tensor, c: cute.Tensor, amax: cute.Tensor,
                 alpha: cute.Tensor, tally: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
                 l: cutlass.Int32, sf_atom: cutlass.Int32, stream: cuda.CUstream):
        """Host side: the TMA view of the codes (L, N, row bytes) in (rows, ROW_BYTES) boxes, one CTA per tile[0]
        weight rows and batch."""
        row_bytes = cute.assume(k // 2 if cutlass.const_expr(self.fp4) else k, divby=16)
        codes = common.operand_view(cute.make_tensor(cute.recast_ptr(w.iterator, dtype=cutlass.Uint8), w.layout), n,
                                    row_bytes, l, False)
        # the ring: per stage and warp one box of the warp's chunk, plain ROW_BYTES rows (no swizzle: a quad reads
        # 64 consecutive bytes and two rows fill the 32 banks)
        staged = cute.make_composed_layout(cute.make_swizzle(0, 4, 3), 0, cute.make_layout(
            (self.rows, ROW_BYTES, self.stages * WARPS), stride=(ROW_BYTES, 1, self.warp_stage_bytes)))
        tma_atom, tma_codes = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), codes, cute.slice_(staged, (None, None, 0)),
            (self.rows, ROW_BYTES))
        fields = dict(ring=cute.struct.Align[cute.struct.MemRange[cutlass.Int32, self.shared_words], 1024],
                      full=cute.struct.MemRange[cutlass.Int64, WARPS * self.stages],
                      warp_amax=cute.struct.MemRange[cutlass.Int32, WARPS])
        self.shared_storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        self.kernel(x, tma_atom, tma_codes, staged, sw, c, amax, alpha, tally, m, n, k, l, sf_atom).launch(
            grid=((n + self.rows - 1) // self.rows, l, 1), block=(THREADS, 1, 1),
            smem=self.shared_storage.size_in_bytes(), min_blocks_per_mp=self.ctas_per_sm,
            preferred_smem_carveout=100, stream=stream)  # all of L1 as shared memory: ctas_per_sm rings fit

    # ------------------------------------------------------------------------------------------- device helpers
    def _slot_offset(self, r: int) -> int:
        """Row slot r's row inside the CTA's tile (the mma fragment's rows group and group + 8 of each 16-row tile),
        without the lane's group."""
        return 16 * (r // 2) + 8 * (r % 2)

    def _slot_row(self, row0, group, r: int, n):
        """The weight row of this lane's row slot r, clamped to N - 1."""
        return cutlass.min(row0 + self._slot_offset(r) + group, n - 1)

    def _scale_row_parts(self, batch, row0, group, n, kb_count, sf_atom):
        """Per row slot, the part of its scale bytes' offset that depends on the row (and batch) only: compact
        row-major, or SPEC §3's atom form; `_scale_block_part` gives the block's part. Rows past N are clamped to
        N - 1."""
        atom_rows = (n + common.ATOM_MN - 1) // common.ATOM_MN
        atom_kbs = (kb_count + common.ATOM_KB - 1) // common.ATOM_KB
        parts = cute.make_rmem_tensor((2 * self.row_tiles,), cutlass.Int32)
        for r in range(2 * self.row_tiles):
            row = self._slot_row(row0, group, r, n)
            compact = (batch * n + row) * kb_count
            atom = (common.atom_chunk_index(batch, row // common.ATOM_MN, 0, atom_rows, atom_kbs) * common.ATOM_BYTES
                    + 4 * common.atom_word_offset(row % common.ATOM_MN))
            parts[r] = cutlass.select_(sf_atom != 0, atom, compact)
        return parts

    def _sum_place(self, e: int, tidx):
        """The (row, token) of C the thread sums and stores in its e-th turn of the epilogue."""
        idx = e * THREADS + tidx
        return idx % self.rows, idx // self.rows

    def _first_code(self, quad_codes, chunk_index):
        """The first of this lane's codes in chunk `chunk_index`; `quad_codes` (the lane's place in its quad times
        lane_codes) is loop-invariant."""
        return chunk_index * self.chunk + quad_codes

    def _scale_block_part(self, first_code, s: int, in_k, sf_atom):
        """The block's part of the scale offset of this lane's block s in a chunk (row parts add the rest): block
        first_code / sf_vec_size + s, in compact or atom form; 0 (the row's first block) where the codes lie past K.
        Shifts and masks, not divisions: every operand is non-negative."""
        kb = (first_code >> self.scale_shift) + s
        atom = common.atom_block_offset(kb)
        return cutlass.select_(in_k, cutlass.select_(sf_atom != 0, atom, kb), 0)

    @cute.jit
    def _issue_chunk(self, tma_atom, views, full, slot, warp, chunk_index, row_block, batch, live, lane):
        """Start one chunk's copy into the warp's ring stage `slot`: one TMA box of the CTA's rows (zeros past N and
        K), completing on the stage's mbarrier `full + slot`; nothing where the chunk is not the warp's (`live`)."""
        if live:
            if lane == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(full + slot, self.warp_stage_bytes)
            ring_view, codes_view = views  # the copy elects one lane: the whole warp comes here
            cute.copy(tma_atom, codes_view[(None, row_block, chunk_index, batch)],
                      ring_view[(None, slot * WARPS + warp)], tma_bar_ptr=full + slot)

    def _scale_bytes(self, sw, row_parts, first_code, live, k, sf_atom) -> list:
        """This lane's scale bytes of one chunk, one word per row slot (NVFP4's two blocks as bytes 0 and 1), read
        straight into registers a chunk before they are used; 0 where the codes lie past K (they are zero-filled,
        so any finite scale adds 0)."""
        in_k = live & (first_code < k)
        ok = in_k.to(cutlass.Int32)
        block_parts = [self._scale_block_part(first_code, s, in_k, sf_atom) for s in range(self.lane_scales)]
        sw0 = sw.iterator.toint()
        out = []
        for r in range(2 * self.row_tiles):
            word = cutlass.Int32(0)
            for s in range(self.lane_scales):
                word = word | (ld_global_nc_u8_if(sw0 + cutlass.Int64(row_parts[r] + block_parts[s]), ok) << (8 * s))
            out.append(word)
        return out

    def _read_codes(self, stage_at) -> list:
        """This lane's codes (four words per row slot) of the chunk in the ring stage at `stage_at` (rows of
        ROW_BYTES), once its mbarrier has completed."""
        return [wd for r in range(2 * self.row_tiles)
                for wd in ld_shared_v4(stage_at + self._slot_offset(r) * ROW_BYTES)]

    def _x_tile(self, x, batch, group, first_code, live, m, k, j: int) -> list:
        """The raw bf16x2 words (x_words) of token tile j's activations at this lane's codes of a chunk (the lane's
        token row clamped to M - 1); zeros past M or K, or where `live` is false."""
        token = 8 * j + group
        x_row = x.iterator.toint() + (cutlass.Int64(batch) * m + cutlass.min(token, m - 1)) * k * 2
        ok = (live & (token < m) & (first_code < k)).to(cutlass.Int32)
        base = x_row + cutlass.min(first_code, k - self.lane_codes) * 2
        return [wd for i in range(self.x_words // 4) for wd in ld_global_nc_v4_if(base + 16 * i, ok)]

    @staticmethod
    def _fill(stage, at: int, words: list) -> None:
        """`words` into the register stage `stage` from element `at` on."""
        for e, word in enumerate(words):
            stage[at + e] = word

    def _chunk_x(self, x_stages, r: int, x, batch, group, first_code, m, k, j: int) -> list:
        """Token tile j's activation words of the chunk being multiplied: from register stage r where they were
        loaded ahead, else loaded now."""
        if cutlass.const_expr(j < self.x_ahead_tiles):
            return [x_stages[r][j * self.x_words + e] for e in range(self.x_words)]
        return self._x_tile(x, batch, group, first_code, True, m, k, j)

    def _needs_two_multiplies(self, scales):
        """Whether a scale byte of this chunk, in any lane of the warp, is too large for one multiply per word (a
        warp-uniform answer: the two forms are two code paths)."""
        big = cutlass.Boolean(False)
        for byte in scales:
            big = big | (byte > common.ONE_MULTIPLY_MAX_BYTE)
        return cute.arch.vote_any_sync(big)

    def _operand_words(self, codes, scales, r: int, one: bool):
        """bf16x2 words code·scale of row slot r (2·steps words, two per mma step, the k order of `_x_pairs`);
        `one`: the one-multiply form of E4M3 codes (`_needs_two_multiplies`; the other formats have one form)."""
        out = []
        if cutlass.const_expr(self.w_name == "float8_e5m2"):  # the converter keeps E5M2's infinities and NaNs
            scale = common.f32_from_bits(common.e8m0_bits(scales[r]))
            for i in range(4):
                out += fp8x4_scaled_bf16(codes[4 * r + i], scale, True)
            return out
        if cutlass.const_expr(not self.fp4):
            return self._e4m3_words(codes, scales, r, one)
        neg_zero = cutlass.Int32(common.NEG_ZERO_BF16X2)
        two126 = cutlass.Int32(common.BF16X2_TWO_POW_126)
        for i in range(4):  # word i holds codes 8i..8i+7 (lane-relative); NVFP4: words 0, 1 and 2, 3 per block
            byte = scales[r] >> (8 * (i // 2)) if self.lane_scales == 2 else scales[r]  # bits 8+: masked below
            scale = common.e4m3_scale_bf16x2(byte) if cutlass.const_expr(self.sf_e4m3) else common.e8m0_bf16x2(byte)
            for p in range(4):  # pair p: codes 8i+p (low half) and 8i+p+4 (high half)
                bits = common.e2m1_pair_bits(codes[4 * r + i], p)
                bits = cute.arch.fma_packed_bf16x2(bits, two126, neg_zero)
                out.append(cute.arch.fma_packed_bf16x2(bits, scale, neg_zero))
        return out

    def _e4m3_words(self, codes, scales, r: int, one: bool) -> list:
        """bf16x2 words code·scale of an E4M3 row slot by bit moves and packed bf16 multiplies (no converter).

        Bytes 0, 1 and 2, 3 of each word pair up as (low, high) halves; an E4M3 byte s|eeee|mmm placed as the bf16
        bits s<<15 | eeeemmm<<4 is exactly code·2^-120 (subnormals included), times 2^120 the code, times the
        block scale code·scale, both exact; or, where `one`, times 2^120·scale at once (one rounding of the same
        exact product). A NaN code (0x7F, 0xFF) would read as 480: a NaN anywhere in the lane's
        16 codes of the row makes its scale NaN instead, which gives the same outputs a NaN product gives (NaN in
        every C element of that row, whatever x holds)."""
        neg_zero = cutlass.Int32(common.NEG_ZERO_BF16X2)
        two120 = cutlass.Int32(common.BF16X2_TWO_POW_120)
        byte = scales[r]
        nan_bytes = common.e4m3_nan_any(codes[4 * r:4 * r + 4])
        nan_pair = cutlass.Int32(common.E4M3_NAN_BF16X2)
        pair_of = common.one_multiply_bf16x2 if cutlass.const_expr(one) else common.e8m0_bf16x2
        scale = cutlass.select_(nan_bytes != 0, nan_pair, pair_of(byte))
        out = []
        for i in range(4):
            for high in (False, True):
                bits = common.e4m3_pair_bits(codes[4 * r + i], high, lambda w, sel: byte_perm(w, w, sel))
                if cutlass.const_expr(not one):
                    bits = cute.arch.fma_packed_bf16x2(bits, two120, neg_zero)
                out.append(cute.arch.fma_packed_bf16x2(bits, scale, neg_zero))
        return out

    def _x_pairs(self, v: list) -> list:
        """Raw activation words in `_operand_words`' k order: as loaded for FP8 (pairs of consecutive codes); for
        FP4 the pairs (8i+p, 8i+p+4)."""
        if cutlass.const_expr(not self.fp4):
            return v
        out = []
        for i in range(4):  # v[4i..4i+3] = x01 x23 x45 x67 of codes 8i..8i+7
            a, b, c_, d = v[4 * i:4 * i + 4]
            out += [byte_perm(a, c_, 0x5410), byte_perm(a, c_, 0x7632), byte_perm(b, d, 0x5410),
                    byte_perm(b, d, 0x7632)]
        return out

    def _row_operands(self, codes, scales, t: int, one: bool) -> list:
        """Row tile t's A words of one chunk (four per mma step): its codes times their scales in bf16."""
        lo, hi = self._operand_words(codes, scales, 2 * t, one), self._operand_words(codes, scales, 2 * t + 1, one)
        return [[lo[2 * s], hi[2 * s], lo[2 * s + 1], hi[2 * s + 1]] for s in range(self.steps)]

    def _multiply_tile(self, acc, operands, xs, t: int, j: int) -> None:
        """acc += one chunk's products of row tile t and token tile j (activation pairs `xs`), through a fresh
        fp32 partial."""
        part = [cutlass.Float32(0.0)] * 4
        for s in range(self.steps):
            part = mma_bf16_m16n8k16(operands[s], [xs[2 * s], xs[2 * s + 1]], part)
        for v in range(4):
            acc[(t * self.token_tiles + j) * 4 + v] = acc[(t * self.token_tiles + j) * 4 + v] + part[v]

    @cute.jit
    def _multiply_chunk(self, acc, codes, scales, x_pairs, chunk_x, m, one: cutlass.Constexpr[bool]) -> None:
        """acc += one chunk's products, row tile by row tile (one row tile's operands live at a time), for every token
        tile below M; activations not at hand (`x_pairs` None) load here."""
        for t in cutlass.range_constexpr(self.row_tiles):
            operands = self._row_operands(codes, scales, t, one)
            self._multiply_tile(acc, operands, x_pairs[0], t, 0)
            for j in cutlass.range_constexpr(1, self.token_tiles):
                if 8 * j < m:
                    xs = x_pairs[j]
                    if cutlass.const_expr(xs is None):
                        xs = self._x_pairs(self._chunk_x(*chunk_x, j))
                    self._multiply_tile(acc, operands, xs, t, j)

    # ------------------------------------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, x: cute.Tensor, tma_atom: cute.CopyAtom, w_tma: cute.Tensor, staged: cute.ComposedLayout,
               sw: cute.Tensor, c: cute.Tensor, amax: cute.Tensor, alpha: cute.Tensor, tally: cute.Tensor,
               m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, l: cutlass.Int32, sf_atom: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        row_block, batch, _ = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sw = cute.make_tensor(cute.recast_ptr(sw.iterator, dtype=cutlass.Uint8), cute.make_layout((cute.size(sw),)))
        ring = storage.ring.data_ptr()
        partials = cute.make_tensor(cute.recast_ptr(ring, dtype=cutlass.Float32),
                                    cute.make_layout(WARPS * self.rows * self.tokens))
        warp_amax = storage.warp_amax.get_tensor(cute.make_layout(WARPS))
        ring0 = ring.toint()
        warp, lane = tidx >> 5, tidx & 31
        group, quad_codes = lane >> 2, (lane & 3) * self.lane_codes
        row0 = row_block * self.rows
        kb_count = (k + self.sf_vec_size - 1) // self.sf_vec_size
        chunks = (k + self.chunk - 1) // self.chunk
        mine = (chunks - warp + WARPS - 1) // WARPS  # chunks warp, warp + WARPS, ... below `chunks`
        row_parts = self._scale_row_parts(batch, row0, group, n, kb_count, sf_atom)
        ring_view = cute.make_tensor(cute.recast_ptr(ring, dtype=cutlass.Uint8), staged)
        views = cute.nvgpu.cpasync.tma_partition(
            tma_atom, 0, cute.make_layout(1), cute.group_modes(ring_view, 0, 2),
            cute.group_modes(cute.local_tile(w_tma, (self.rows, ROW_BYTES), (None, None, None)), 0, 2))
        warp_ring = ring0 + warp * self.warp_stage_bytes  # the warp's part of ring stage 0
        stage_bytes = WARPS * self.warp_stage_bytes
        full = storage.full.data_ptr() + warp * self.stages  # the warp's mbarriers, one per ring stage
        lane_at = group * ROW_BYTES + (lane & 3) * LANE_BYTES  # this lane's codes of its first row slot in a stage
        if lane == 0:
            for r in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(full + r, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_warp()

        acc = cute.make_rmem_tensor((self.row_tiles * self.token_tiles * 4,), cutlass.Float32)
        acc.fill(0.0)
        # mainloop: codes in a shared-memory ring of `stages` per warp (stages - 1 chunks in flight while one is
        # multiplied), each chunk one TMA box completing on its stage's mbarrier; the scale bytes (and, with few
        # tokens, the activations) X_STAGES - 1 chunks ahead in X_STAGES register stages. Token tiles past M (all but
        # the first) are skipped.
        for r in cutlass.range_constexpr(self.stages - 1):
            self._issue_chunk(tma_atom, views, full, r, warp, warp + WARPS * r, row_block, batch, r < mine, lane)
        s_stages = [cute.make_rmem_tensor((2 * self.row_tiles,), cutlass.Int32)
                    for _ in range(X_STAGES)]
        x_stages = [cute.make_rmem_tensor((self.x_ahead_tiles * self.x_words,), cutlass.Int32)
                    for _ in range(X_STAGES)] if cutlass.const_expr(self.x_ahead) else None
        for r in cutlass.range_constexpr(X_STAGES - 1):
            first_code = self._first_code(quad_codes, warp + WARPS * r)
            self._fill(s_stages[r], 0, self._scale_bytes(sw, row_parts, first_code, r < mine, k, sf_atom))
            if cutlass.const_expr(self.x_ahead):
                for j in cutlass.range_constexpr(self.x_ahead_tiles):
                    self._fill(x_stages[r], j * self.x_words,
                               self._x_tile(x, batch, group, first_code, r < mine, m, k, j))
        slot = cutlass.Int32(0)  # the ring stage of chunk `index`: index % stages, kept as a counter
        phase = cutlass.Int32(0)  # and the parity of its mbarrier's phase: (index // stages) % 2
        for i in cutlass.range(0, mine, X_STAGES, unroll=1):
            for r in cutlass.range_constexpr(X_STAGES):
                index = i + r
                ahead = index + self.stages - 1  # its copies go to the stage chunk index - 1 has just left
                free = cutlass.select_(slot == 0, self.stages - 1, slot - 1)
                cute.arch.sync_warp()  # every lane has read chunk index - 1 out of the stage the copies now refill
                self._issue_chunk(tma_atom, views, full, free, warp, warp + WARPS * ahead, row_block, batch,
                                  ahead < mine, lane)
                next_index = index + X_STAGES - 1  # the chunk whose scale bytes (and activations) load now
                next_stage = (r + X_STAGES - 1) % X_STAGES
                next_first = self._first_code(quad_codes, warp + WARPS * next_index)
                self._fill(s_stages[next_stage], 0,
                           self._scale_bytes(sw, row_parts, next_first, next_index < mine, k, sf_atom))
                if cutlass.const_expr(self.x_ahead):
                    x_next = x_stages[next_stage]
                    self._fill(x_next, 0, self._x_tile(x, batch, group, next_first, next_index < mine, m, k, 0))
                    for j in cutlass.range_constexpr(1, self.x_ahead_tiles):
                        if 8 * j < m:
                            self._fill(x_next, j * self.x_words,
                                       self._x_tile(x, batch, group, next_first, next_index < mine, m, k, j))
                if index < mine:
                    first_code = self._first_code(quad_codes, warp + WARPS * index)
                    cute.arch.mbarrier_wait(full + slot, phase)
                    codes = self._read_codes(warp_ring + slot * stage_bytes + lane_at)
                    scales = [s_stages[r][e] for e in range(2 * self.row_tiles)]
                    # the activation pairs of every token tile at hand now: tiles loaded ahead, and with many tokens
                    # all tiles at once (their loads in flight together); the others load where they are used
                    x_pairs = [self._x_pairs(self._chunk_x(x_stages, r, x, batch, group, first_code, m, k, j))
                               if j < self.x_ahead_tiles or not self.x_ahead else None
                               for j in range(self.token_tiles)]
                    chunk_x = (x_stages, r, x, batch, group, first_code, m, k)
                    if cutlass.const_expr(self.w_name == "float8_e4m3fn"):  # E4M3: one multiply where scales allow
                        if self._needs_two_multiplies(scales):
                            self._multiply_chunk(acc, codes, scales, x_pairs, chunk_x, m, False)
                        else:
                            self._multiply_chunk(acc, codes, scales, x_pairs, chunk_x, m, True)
                    else:
                        self._multiply_chunk(acc, codes, scales, x_pairs, chunk_x, m, False)
                phase = cutlass.select_(slot == self.stages - 1, phase ^ 1, phase)
                slot = cutlass.select_(slot == self.stages - 1, 0, slot + 1)
        cute.arch.sync_threads()  # every warp is done with the ring (every copy issued was waited for): the partial
        # tiles may take its bytes

        # epilogue: the warps' partial tiles summed in warp order (deterministic), alpha, C, amax
        quad = lane & 3
        for t in cutlass.range_constexpr(self.row_tiles):
            for j in cutlass.range_constexpr(self.token_tiles):
                for v in cutlass.range_constexpr(4):
                    row = 16 * t + group + 8 * (v // 2)
                    token = 8 * j + 2 * quad + v % 2
                    partials[(warp * self.rows + row) * self.tokens + token] = acc[(t * self.token_tiles + j) * 4 + v]
        cute.arch.sync_threads()
        # the sums first, then amax's tally (its round trips to L2 on the first thread) while every thread stores C
        scale = alpha[batch]
        amax_bits = cutlass.Int32(0)
        totals = cute.make_rmem_tensor((self.sums_per_thread,), cutlass.Float32)
        for e in cutlass.range_constexpr(self.sums_per_thread):
            row, token = self._sum_place(e, tidx)
            total = partials[row * self.tokens + token]
            for p in cutlass.range_constexpr(1, WARPS):
                total = total + partials[(p * self.rows + row) * self.tokens + token]
            totals[e] = total * scale
            if (token < m) & (row0 + row < n):
                amax_bits = cutlass.max(amax_bits, common.abs_bits(totals[e]))
        if tally.iterator.toint() != 0:  # a tally: the caller wants amax
            row_blocks, _, _ = cute.arch.grid_dim()
            common.amax_block_reduce_and_fold_last(
                amax_bits, warp_amax, tally.iterator.toint() + cutlass.Int64(batch) * 8,
                amax.iterator.toint() + cutlass.Int64(batch) * 4, row_blocks, tidx, WARPS, 1)
        for e in cutlass.range_constexpr(self.sums_per_thread):
            row, token = self._sum_place(e, tidx)
            if (token < m) & (row0 + row < n):
                c[(cutlass.Int64(batch) * m + token) * n + row0 + row] = totals[e].to(self.c_dtype)
