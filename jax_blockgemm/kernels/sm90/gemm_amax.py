"""Hopper (sm_90a) block-scaled gemm_amax: codes x scales dequantized to bf16 in shared memory, bf16 wgmma.

Hopper has FP8 wgmma but no block-scaled MMA, and its FP8 wgmma accumulates with reduced precision inside each
instruction. code·2^(s-127) is exact in bf16, so the consumers fold the scales into the operands and the bf16 tensor
cores (fp32 accumulation) do the rest. A producer warp streams FP8 (or packed FP4) A/B tiles of 128 x 128 x 128
with TMA through an mbarrier pipeline; the two consumer warpgroups dequantize k-tile k+1 into one of two bf16
buffers while the wgmma of k-tile k runs on the other. Each k-tile's wgmma sum goes into a fresh partial added to
the accumulator in fp32 (the tensor cores truncate when they accumulate, which biases long sums). Scale words are
read from the 512-byte atoms of SPEC §3 straight from global memory, one k-tile ahead. The epilogue stores C with
predication (any M, N) and folds max|acc| into amax[l] with one integer atomic max per CTA.

FP8 codes are dequantized through the conversion pipe (FP8x2 -> f16x2 -> f32, times the scale, -> bf16x2), exact.
Beyond MXFP8, through the same mainloop:
- packed FP4 operands (MXFP4: E8M0 per 32; NVFP4: E4M3 per 16) through `convert_e2m1`, exact (the bit model in
  kernels/common.py); NVFP4's per-tensor alpha through `HopperGemmAmaxAlpha` (a 7th ABI tensor);
- C in f32, bf16, f16, E4M3, E5M2 (saturating) or packed FP4 (software round-to-nearest-even, saturating);
- MN-major FP8 operands (`a_major="m"`, `b_major="n"`): MN-major TMA tiles and bf16 buffers, 16 rows at one k
  per thread pass, each with its own row scale (`_mn_operand`), transposed bf16 wgmma.

Why this design, its bound and the alternatives that were built and measured: docs/design/gemm_amax.md. Phases are
marked `producer`, `dequantize`, `mainloop`, `epilogue` in the kernel body.
"""

from __future__ import annotations

from typing import Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils

from jax_blockgemm.kernels import common
from jax_blockgemm.kernels.sm90 import tma_pipeline
from jax_blockgemm.kernels.sm90.c_store import AccumulatorStore

# Operand codes as they travel through TMA and shared memory: FP4 (E2M1) as packed bytes, two codes each.
_AB_DTYPES = {"float8_e4m3fn": cutlass.Float8E4M3FN, "float8_e5m2": cutlass.Float8E5M2,
              "float4_e2m1fn": cutlass.Uint8}
# C as stored: FP8 codes as their dtype, packed FP4 C as bytes (two codes each, the even column in the low nibble).
_C_DTYPES = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16,
             "float8_e4m3fn": cutlass.Float8E4M3FN, "float8_e5m2": cutlass.Float8E5M2,
             "float4_e2m1fn": cutlass.Uint8}
E8M0 = "float8_e8m0fnu"
# (scale dtype, sf_vec_size) per operand format: MXFP8 and MXFP4 take E8M0 per 32, NVFP4 E4M3 per 16.
_SCALINGS = {"fp8": ((E8M0, 32),), "fp4": ((E8M0, 32), ("float8_e4m3fn", 16))}
TILE_MNK = (128, 128, 128)  # the CTA tile: two consumer warpgroups of 64 rows; 128 codes of K per stage
MMA_BUFFERS = 2  # bf16 tiles: the tensor cores read one while the consumers fill the other
SF_VEC_SIZE = 32  # MXFP8's (and MXFP4's) block; NVFP4's is 16 (`sf_vec_size`)
_SMEM_RESERVE = 4096  # mbarriers and the per-warp amax slots




def smem_layout_staged(rows: int, dtype: Type[cutlass.Numeric], stages: int, cols: int,
                       mn_major: bool = False) -> cute.ComposedLayout:
    """The wgmma's swizzled shared-memory layout for `stages` (rows, cols) tiles of `dtype`, K-major (cols = k) or
    MN-major; the widest swizzle the tile allows."""
    if mn_major:
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(cutlass.tensor_utils.LayoutEnum.COL_MAJOR, dtype, rows), dtype)
        return cute.tile_to_shape(atom, (rows, cols, stages), order=(1, 0, 2))
    atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(cutlass.tensor_utils.LayoutEnum.ROW_MAJOR, dtype, cols), dtype)
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


class HopperMxf8GemmAmax(AccumulatorStore):
    """C = (A·sfa) (B·sfb)^T per batch, amax[l] = max|C[l]|, for MXFP8 (K- or MN-major) and MXFP4/NVFP4 (K-major)
    operands on sm_90a.

    Compile-time configuration only; every size is a run-time scalar of the exported function.
    """

    def __init__(self, *, ab_dtype: str = "float8_e4m3fn", c_dtype: str = "float32", sf_vec_size: int = SF_VEC_SIZE,
                 sf_dtype: str = E8M0, a_major: str = "k", b_major: str = "k"):
        common.require_choice("ab_dtype", ab_dtype, sorted(_AB_DTYPES))
        common.require_choice("c_dtype", c_dtype, sorted(_C_DTYPES))
        self.fp4 = ab_dtype == "float4_e2m1fn"
        common.require_choice("(sf_dtype, sf_vec_size)", (sf_dtype, sf_vec_size),
                              _SCALINGS["fp4" if self.fp4 else "fp8"])
        common.require_choice("a_major", a_major, ("k", "m"))
        common.require_choice("b_major", b_major, ("k", "n"))
        # MN-major operands (A given as (L, K, M), B as (L, K, N)): TMA copies MN-major tiles, the consumers
        # dequantize 16 consecutive rows at one k (16 row scales) into MN-major bf16 buffers, and the wgmma reads
        # those MN-major (the bf16 wgmma takes both majors). FP8 codes only.
        self.a_mn, self.b_mn = a_major == "m", b_major == "n"
        if (self.a_mn or self.b_mn) and self.fp4:
            raise ValueError(f"a_major={a_major!r}, b_major={b_major!r}: MN-major operands need FP8 codes, "
                             f"got ab_dtype={ab_dtype!r}")
        # "f32" (FP8 codes through the conversion pipe) or "e2m1" (packed FP4 codes, `convert_e2m1`)
        self.dequant_mode = "e2m1" if self.fp4 else "f32"
        self.sf_vec_size = sf_vec_size
        self.sf_e4m3 = sf_dtype == "float8_e4m3fn"
        # Codes per byte of the operand buffers: the TMA tiles and FP8/FP4 stages are (rows, bk / code_div) bytes.
        self.code_div = 2 if self.fp4 else 1
        # How the epilogue stores C: "wide" (f32/bf16/f16: one element at a time), "fp8" (two adjacent columns
        # through one saturating conversion, stored as bytes) or "fp4" (two adjacent columns packed into a byte).
        self.c_kind = ("fp4" if c_dtype == "float4_e2m1fn" else
                       "fp8" if c_dtype in ("float8_e4m3fn", "float8_e5m2") else "wide")
        self.c_name = c_dtype
        # NVFP4's per-tensor alpha: the exported function then takes a 7th tensor (see HopperGemmAmaxAlpha).
        self.has_alpha = False
        self.ab_dtype: Type[cutlass.Numeric] = _AB_DTYPES[ab_dtype]
        self.c_dtype: Type[cutlass.Numeric] = _C_DTYPES[c_dtype]
        self.acc_dtype = cutlass.Float32
        self.tile_mnk = TILE_MNK
        tile_k = self.tile_mnk[2]
        # Codes x scales are exact in bfloat16 (same exponent range as float32, 8-bit significand), and the bf16
        # tensor cores accumulate in float32, unlike Hopper's FP8 wgmma.
        self.mma_dtype = cutlass.BFloat16
        # Two consumer warpgroups, each owning 64 rows of the tile (64 fp32 accumulator registers per thread, twice
        # that with the per-k-tile partial).
        self.atom_layout_mnk = (2, 1, 1)
        self.num_consumer_wgs = 2
        self.threads_per_wg = 128
        self.threads_per_cta = (1 + self.num_consumer_wgs) * self.threads_per_wg
        self.num_consumer_warps = self.num_consumer_wgs * 4
        self.producer_regs = 40
        self.consumer_regs = 232
        self.epilogue_barrier_id = 1
        self.mainloop_barrier_id = 2
        tile_elems = (self.tile_mnk[0] + self.tile_mnk[1]) * tile_k
        mma_bytes = MMA_BUFFERS * tile_elems * self.mma_dtype.width // 8
        smem_capacity = cutlass.memory.get_smem_capacity_in_bytes("sm_90")
        stage_bytes = tile_elems // self.code_div * self.ab_dtype.width // 8
        self.ab_stages = min(6, (smem_capacity - mma_bytes - _SMEM_RESERVE) // stage_bytes)
        assert self.ab_stages >= 2, self.ab_stages
        self.buffer_align_bytes = 1024
        # Dequantization: each consumer thread converts 16 consecutive codes of a row per pass.
        self.cvt_threads_per_row = tile_k // 16
        self.cvt_rows_per_pass = self.num_consumer_wgs * self.threads_per_wg // self.cvt_threads_per_row
        # Scale words per thread of A (its rows; B's follow): 16 rows of an MN-major A, else one per K-major row pass.
        self._words_a = 16 if self.a_mn else self.tile_mnk[0] // self.cvt_rows_per_pass
        # Both operands MN-major: the 32 scale words are loaded right before each conversion instead of one k-tile
        # ahead (their latency is then exposed, but they do not occupy 32 registers across the wgmma, which would
        # spill).
        self.late_words = self.a_mn and self.b_mn

    def can_implement(self, m: int, n: int, k: int, l: int) -> tuple[bool, str]:
        """Whether the kernel handles these sizes, and why not (the caller checks before launching)."""
        if min(m, n, k, l) < 1:
            return False, f"every size must be >= 1, got m={m}, n={n}, k={k}, l={l}"
        k_multiple = 16 * self.code_div
        if k % k_multiple:
            return False, f"k must be a multiple of {k_multiple} (16-byte rows for TMA), got k={k}"
        if self.c_kind == "fp4" and n % 2:
            return False, f"n must be even for a packed FP4 C (two codes per byte), got n={n}"
        for size, name, mn_major in ((m, "m", self.a_mn), (n, "n", self.b_mn)):
            if mn_major and size % 16:
                return False, (f"{name} must be a multiple of 16 for an MN-major operand (16-byte rows), "
                               f"got {name}={size}")
        if l * max(m, n) * k >= 2**31 or l * m * n >= 2**31:
            return False, f"operands must hold fewer than 2**31 elements, got m={m}, n={n}, k={k}, l={l}"
        return True, ""

    # ------------------------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, c: cute.Tensor,
                 amax: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, l: cutlass.Int32,
                 stream: cuda.CUstream):
        """Host side: build (L, M, K)-shaped views of the flat buffers, the TMA atoms, and launch."""
        self._launch(a, b, sfa, sfb, c, amax, amax, m, n, k, l, stream)

    @cute.jit
    def _launch(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, c: cute.Tensor,
                amax: cute.Tensor, alpha: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
                l: cutlass.Int32, stream: cuda.CUstream):
        """The body of both ABIs' `__call__`: `alpha` is NVFP4's (L,) float32 tensor with `has_alpha`, else a
        stand-in (amax) that the kernel never reads."""
        tma_a, tma_b, tiled_mma, layouts = self.operands(a, b, m, n, k, l, l)
        tiles_m = (m + self.tile_mnk[0] - 1) // self.tile_mnk[0]
        tiles_n = (n + self.tile_mnk[1] - 1) // self.tile_mnk[1]
        self.kernel(*tma_a, *tma_b, sfa, sfb, c, amax, alpha, m, n, k, tiled_mma, *layouts).launch(
            grid=(tiles_m, tiles_n, l), block=(self.threads_per_cta, 1, 1), min_blocks_per_mp=1, stream=stream)

    @cute.jit
    def operands(self, a: cute.Tensor, b: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
                 l_a: cutlass.Int32, l_b: cutlass.Int32):
        """Host side, inlined into `__call__`: the TMA atoms and views of A ((L_a, M, K) codes) and B
        ((L_b, N, K)), the bf16 tiled MMA, the four shared-memory layouts (FP8/FP4 stages of A and B, bf16 buffers of
        A and B), and `self.shared_storage`. Returns ((atom A, view A), (atom B, view B), tiled MMA, layouts)."""
        # Row length in bytes: K codes, or K/2 bytes of packed FP4 pairs.
        kc = cute.assume(k // self.code_div, divby=16)
        mA = common.operand_view(a, m, kc, l_a, self.a_mn)
        mB = common.operand_view(b, n, kc, l_b, self.b_mn)

        major = lambda mn: cute.nvgpu.OperandMajorMode.MN if mn else cute.nvgpu.OperandMajorMode.K
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.mma_dtype, self.mma_dtype, major(self.a_mn), major(self.b_mn), self.acc_dtype, self.atom_layout_mnk,
            tiler_mn=(64, self.tile_mnk[1]), a_source=cute.nvgpu.warpgroup.OperandSource.SMEM)
        bk_codes = self.tile_mnk[2] // self.code_div  # bytes per row of one FP8/FP4 stage
        a_smem_staged = self._smem_layout_staged(self.tile_mnk[0], self.ab_dtype, self.ab_stages, bk_codes, self.a_mn)
        b_smem_staged = self._smem_layout_staged(self.tile_mnk[1], self.ab_dtype, self.ab_stages, bk_codes, self.b_mn)
        a16_smem_staged = self._smem_layout_staged(self.tile_mnk[0], self.mma_dtype, MMA_BUFFERS,
                                                   mn_major=self.a_mn)
        b16_smem_staged = self._smem_layout_staged(self.tile_mnk[1], self.mma_dtype, MMA_BUFFERS,
                                                   mn_major=self.b_mn)
        tma_atom_a, tma_a = tma_pipeline.load_atom(mA, a_smem_staged, (self.tile_mnk[0], bk_codes))
        tma_atom_b, tma_b = tma_pipeline.load_atom(mB, b_smem_staged, (self.tile_mnk[1], bk_codes))

        @cute.struct
        class SharedStorage:
            pipeline_mbars: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            warp_amax: cute.struct.MemRange[cutlass.Int32, self.num_consumer_warps]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem_staged)],
                                  self.buffer_align_bytes]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem_staged)],
                                  self.buffer_align_bytes]
            sA16: cute.struct.Align[cute.struct.MemRange[self.mma_dtype, cute.cosize(a16_smem_staged)],
                                    self.buffer_align_bytes]
            sB16: cute.struct.Align[cute.struct.MemRange[self.mma_dtype, cute.cosize(b16_smem_staged)],
                                    self.buffer_align_bytes]

        self.shared_storage = SharedStorage
        layouts = (a_smem_staged, b_smem_staged, a16_smem_staged, b16_smem_staged)
        return (tma_atom_a, tma_a), (tma_atom_b, tma_b), tiled_mma, layouts

    def _smem_layout_staged(self, rows: int, dtype: Type[cutlass.Numeric], stages: int,
                            cols: int | None = None, mn_major: bool = False) -> cute.ComposedLayout:
        """Swizzled shared-memory layout (the wgmma's) for `stages` (rows, cols) tiles of `dtype`, K-major or
        MN-major (cols defaults to bk; the packed FP4 stages hold bk/2 bytes per row)."""
        return smem_layout_staged(rows, dtype, stages, self.tile_mnk[2] if cols is None else cols, mn_major)

    # ------------------------------------------------------------------------------------ dequantization
    def tile_scale_byte(self, kt, lane_in_row, k_atoms=None):
        """(k-atom, byte) of this thread's scales in k-tile `kt`: the atom holds 4 k-blocks of sf_vec_size, a
        k-tile bk/sf_vec_size, and thread `lane_in_row` of a row converts codes [16·lane, +16): one k-block.

        With more than 4 k-blocks per tile (NVFP4's blocks of 16 in a 128-wide k-tile) a tile spans two atoms and
        the atom depends on the lane; it is clamped to the last one (`k_atoms`), so that a tile past the end of K
        reads a real scale of the same row, which then multiplies TMA's zero codes.
        """
        blocks_per_tile = self.tile_mnk[2] // self.sf_vec_size
        lane_block = lane_in_row // 2 if self.sf_vec_size == 32 else lane_in_row
        if blocks_per_tile <= common.ATOM_KB:
            tiles_per_atom = common.ATOM_KB // blocks_per_tile
            return kt // tiles_per_atom, (kt % tiles_per_atom) * blocks_per_tile + lane_block
        kb = kt * blocks_per_tile + lane_block
        return cutlass.min(kb // common.ATOM_KB, k_atoms - 1), kb % common.ATOM_KB

    def atom_lane(self, lane_in_row):
        """The lane whose atom a thread loads: lane 0's (one atom per k-tile) unless a k-tile spans two atoms."""
        return lane_in_row if self.tile_mnk[2] // self.sf_vec_size > common.ATOM_KB else 0

    @staticmethod
    def scale_word_bases(bases, rows_a, rows_b, batches, tile_m, tile_n, tile_mn, m, n, k_atoms):
        """Word index (at k-atom 0) of the scale word of each row this thread converts: `rows_a`, then `rows_b`
        (`batches`: A's batch, B's batch).

        Rows are tile-relative; the atom index is clamped to the last atom, so rows past M (N) read a real scale
        word (their codes are TMA's zero fill and their C elements are never stored).
        """
        i = 0
        for tile, rows, tile_rows, size, batch in ((tile_m, rows_a, tile_mn[0], m, batches[0]),
                                                   (tile_n, rows_b, tile_mn[1], n, batches[1])):
            atoms = (size + common.ATOM_MN - 1) // common.ATOM_MN
            for row in rows:
                atom = cutlass.min(tile * (tile_rows // common.ATOM_MN) + row // common.ATOM_MN, atoms - 1)
                in_atom = (row % 32) * 4 + (row // 32) % 4
                bases[i] = (batch * atoms + atom) * k_atoms * (common.ATOM_BYTES // 4) + in_atom
                i += 1

    def load_scale_words(self, words, bases, sfa_w, sfb_w, k_atom):
        """Load this thread's scale words of one k-atom (its rows of A, then of B) into `words`."""
        reps_a = self._words_a
        for i in range(cute.size(words)):
            src = sfa_w if i < reps_a else sfb_w
            first = 0 if i < reps_a else reps_a
            if (self.a_mn if i < reps_a else self.b_mn):
                # 16 consecutive rows from a multiple of 16: one atom, in-atom words 4 apart (fewer live registers)
                base = bases[first] + 4 * (i - first)
            else:
                base = bases[i]
            words[i] = src[base + k_atom * (common.ATOM_BYTES // 4)]

    def dequantize(self, ab_pipeline, read_state, words, bases, sfa_w, sfb_w, next_k_atom, jfirst, jbyte, operands,
                   buf, mn_operands=(), this_k_atom=None):
        """Wait for one FP8/FP4 stage and load this thread's codes; returns the scales of this thread's rows.

        Plain Python (inlined at trace time). `words` holds this tile's scale words (loaded one tile ahead, so
        their global-memory latency hides behind a k-tile); the next tile's are loaded here. `operands` lists
        (code source, bf16 destination, code fragment, bf16 fragment, first scale) for the K-major operands,
        `mn_operands` the MN-major ones (`_mn_operand`). `jfirst` is the tile's first k-block in its atom, `jbyte`
        this thread's. FP8 codes are converted and stored here (`scales` are float32 values); for FP4 `scales`
        are the scale bytes and the caller runs `convert_e2m1`.
        """
        if self.late_words and this_k_atom is not None:  # this tile's words, just before they are used
            self.load_scale_words(words, bases, sfa_w, sfb_w, this_k_atom)
        if self.dequant_mode == "f32":
            scales = [common.e8m0_word_to_f32(words[i], jbyte) for i in range(cute.size(words))]
        else:
            scales = [(words[i] >> (8 * jbyte)) & 0xFF for i in range(cute.size(words))]
        # (With MN-major operands the next tile's words are loaded after the conversion, which reads this tile's:
        # 16 words per operand stay live instead of 16 more.)
        if next_k_atom is not None and not mn_operands:
            self.load_scale_words(words, bases, sfa_w, sfb_w, next_k_atom)
        ab_pipeline.consumer_wait(read_state)
        for src, dst, frag8, frag16, first in operands:
            cute.autovec_copy(src[(None, None, None, read_state.index)], frag8)
            if self.dequant_mode == "f32":
                for r in range(cute.size(frag8, mode=[1])):
                    vals = frag8[(None, r, 0)].load().to(cutlass.Float32) * scales[first + r]
                    frag16[(None, r, 0)].store(vals.to(self.mma_dtype))
                cute.autovec_copy(frag16, dst[(None, None, None, buf)])
        for src, dst, frag8, frag16, rep_bytes, first in mn_operands:
            # 16 consecutive rows at one k per rep: codes times their rows' scales, elementwise in float32.
            cute.autovec_copy(src[(None, None, None, read_state.index)], frag8)
            vals = cute.make_rmem_tensor(frag8[(None, 0, 0)].shape, cutlass.Float32)  # the 16 codes' shape
            for r in range(len(rep_bytes)):
                vals.store(frag8[(None, 0, r)].load().to(cutlass.Float32))
                for i in range(16):  # each scale decoded where it is used: few registers live at once
                    vals[i] = vals[i] * common.e8m0_word_to_f32(words[first + i], jfirst + rep_bytes[r])
                frag16[(None, 0, r)].store(vals.load().to(self.mma_dtype))
            cute.autovec_copy(frag16, dst[(None, None, None, buf)])
        if next_k_atom is not None and mn_operands and not self.late_words:
            self.load_scale_words(words, bases, sfa_w, sfb_w, next_k_atom)
        return scales

    def _mn_operand(self, s8: cute.Tensor, s16: cute.Tensor, rows: int, local_tid):
        """Dequantization of an MN-major operand: thread t converts rows [16·(t % c), +16) (c = rows / 16 chunks)
        at k-columns t // c + kpp·rep (kpp = 256 / c, 16 or 32: within one scale block per rep). Returns
        ((FP8 source, bf16 destination, FP8 fragment, bf16 fragment, scale byte of each rep within the tile), the
        16 tile-relative rows whose scale words the thread loads)."""
        chunks = rows // 16
        kpp = self.num_consumer_wgs * self.threads_per_wg // chunks
        if kpp > self.sf_vec_size or self.sf_vec_size % kpp or self.tile_mnk[2] % kpp:
            raise ValueError(f"an MN-major operand of {rows} rows needs k-columns per pass ({kpp}) dividing the "
                             f"scale block ({self.sf_vec_size}) and bk ({self.tile_mnk[2]})")
        thr = cute.make_layout((chunks, kpp), stride=(1, chunks))
        val = cute.make_layout((16, 1), stride=(1, 16))
        copy8 = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.ab_dtype, num_bits_per_copy=128), thr, val)
        copy16 = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.mma_dtype, num_bits_per_copy=128), thr, val)
        src = copy8.get_slice(local_tid).partition_S(s8)  # (CPY, 1, REP_K, STAGE)
        dst = copy16.get_slice(local_tid).partition_D(s16)  # (CPY, 1, REP_K, BUF)
        frag8 = cute.make_rmem_tensor(src[(None, None, None, 0)].shape, self.ab_dtype)
        frag16 = cute.make_rmem_tensor(dst[(None, None, None, 0)].shape, self.mma_dtype)
        rep_bytes = [(kpp * r) // self.sf_vec_size for r in range(self.tile_mnk[2] // kpp)]
        chunk = local_tid % chunks
        return (src, dst, frag8, frag16, rep_bytes), [chunk * 16 + i for i in range(16)]

    def convert_e2m1(self, operands, scale_bytes, buf):
        """Convert the loaded packed FP4 codes (`dequantize`) to bf16 code·scale into buffer `buf`, exactly.

        Per 32-bit word of 8 codes, 4 output words (`common.e2m1_pair_bits`: codes i and i+4 of the word, the
        same k permutation for A and B), each times 2^126 (-> the code) and times the block scale, both packed bf16
        multiplies. The scale is an E8M0 byte (2^(b-127); 0 -> 2^-127, 255 -> NaN) or an E4M3 byte (NVFP4).
        """
        neg_zero = cutlass.Int32(common.NEG_ZERO_BF16X2)
        two126 = cutlass.Int32(common.BF16X2_TWO_POW_126)
        for src, dst, frag8, frag16, first in operands:
            q = cute.recast_tensor(frag8, cutlass.Int32)  # 2 words (16 codes) per row
            o = cute.recast_tensor(frag16, cutlass.Int32)  # 8 bf16x2 words per row
            for r in range(cute.size(frag8, mode=[1])):
                byte = scale_bytes[first + r]
                if self.sf_e4m3:
                    scale = common.e4m3_scale_bf16x2(byte)
                else:
                    scale = common.e8m0_bits(byte)
                    scale = scale | ((scale >> 16) & 0xFFFF)
                for w in range(2):
                    for i in range(4):
                        x = common.e2m1_pair_bits(q[2 * r + w], i)
                        x = cute.arch.fma_packed_bf16x2(x, two126, neg_zero)
                        o[8 * r + 4 * w + i] = cute.arch.fma_packed_bf16x2(x, scale, neg_zero)
            cute.autovec_copy(frag16, dst[(None, None, None, buf)])

    # ---------------------------------------------------------------------------------------------- epilogue
    # ---------------------------------------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor, tma_atom_b: cute.CopyAtom,
               mB_nkl: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, c: cute.Tensor, amax: cute.Tensor,
               alpha: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, tiled_mma: cute.TiledMma,
               a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
               a16_smem_staged: cute.ComposedLayout, b16_smem_staged: cute.ComposedLayout):
        """Device body: the CTA computes output tile (tile_m, tile_n) of batch l (its block index)."""
        tile_m, tile_n, batch = cute.arch.block_idx()
        self.tile(tma_atom_a, mA_mkl, tma_atom_b, mB_nkl, sfa, sfb, c, amax, alpha, m, n, k, tiled_mma,
                  (a_smem_staged, b_smem_staged, a16_smem_staged, b16_smem_staged), tile_m, tile_n, batch, batch,
                  cutlass.Int32(0), m, None)

    @cute.jit
    def tile(self, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor, tma_atom_b: cute.CopyAtom, mB_nkl: cute.Tensor,
             sfa: cute.Tensor, sfb: cute.Tensor, c: cute.Tensor, amax: cute.Tensor, alpha: cute.Tensor,
             m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, tiled_mma: cute.TiledMma, layouts: tuple,
             tile_m: cutlass.Int32, tile_n: cutlass.Int32, batch: cutlass.Int32, b_batch: cutlass.Int32,
             rows_lo: cutlass.Int32, rows_hi: cutlass.Int32, zero: cutlass.Boolean | None):
        """One output tile, inlined into a kernel: warpgroup 0 produces (TMA), warpgroups 1-2 consume (dequantize +
        wgmma + epilogue). A's row tile `tile_m` of batch `batch` times B's row tile `tile_n` of batch `b_batch`;
        C rows [rows_lo, rows_hi) of the tile are stored (of batch `batch`) and folded into amax[batch]. `zero`
        (None: never) stores zeros instead, after a single k-tile (the ragged kernel's rows of no group)."""
        a_smem_staged, b_smem_staged, a16_smem_staged, b16_smem_staged = layouts
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bm, bn, bk = self.tile_mnk

        storage, ab_pipeline, sA, sB, views, k_tiles, wg_idx = tma_pipeline.ab_prologue(
            tidx, warp_idx, tma_atom_a, mA_mkl, tma_atom_b, mB_nkl, a_smem_staged, b_smem_staged, self.shared_storage,
            self.ab_dtype, self.ab_stages, self.num_consumer_warps, (bm, bn, bk // self.code_div), self.threads_per_wg)
        if cutlass.const_expr(zero is not None):
            k_tiles = cutlass.min(k_tiles, cutlass.select_(zero, 1, k_tiles))

        if wg_idx == 0:
            # ------------------------------------------------------------------------------ producer
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
                state = tma_pipeline.produce_tile(ab_pipeline, state, tma_atom_a, tma_atom_b, views, tile_m, tile_n,
                                                  k_tiles, batch, b_batch)
                ab_pipeline.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            local_tid = tidx - self.threads_per_wg  # 0..255 over the consumer warpgroups
            thr_mma = tiled_mma.get_slice((wg_idx - 1) * self.threads_per_wg)
            sA16 = storage.sA16.get_tensor(a16_smem_staged.outer, swizzle=a16_smem_staged.inner)
            sB16 = storage.sB16.get_tensor(b16_smem_staged.outer, swizzle=b16_smem_staged.inner)
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB16))
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA16))
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((bm, bn)), self.acc_dtype)
            acc.fill(0.0)
            # Each k-tile is summed into `partial` and added to `acc` with round-to-nearest fp32 adds (the tensor
            # cores truncate when they add into their accumulator, which biases long sums).
            partial = cute.make_rmem_tensor(thr_mma.partition_shape_C((bm, bn)), self.acc_dtype)
            num_k_steps = cute.size(tCrA, mode=[2])

            # Dequantization through shared memory: thread t converts rows t / tpr + rows_per_pass·rep and
            # k-columns [16·(t % tpr), +16) (tpr = bk / 16 threads per row); all 16 columns lie in one k-block.
            tpr = self.cvt_threads_per_row
            cvt_thr = cute.make_layout((self.cvt_rows_per_pass, tpr), stride=(tpr, 1))
            cvt_val = cute.make_layout((1, 16), stride=(16, 1))
            # The same 16 codes as 16 // code_div bytes (8 bytes of packed FP4 pairs).
            code_val = cute.make_layout((1, 16 // self.code_div), stride=(16 // self.code_div, 1))
            copy_f8 = cute.make_tiled_copy_tv(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.ab_dtype,
                                    num_bits_per_copy=128 // self.code_div),
                cvt_thr, code_val)
            copy_16 = cute.make_tiled_copy_tv(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.mma_dtype, num_bits_per_copy=128),
                cvt_thr, cvt_val)
            thr_f8 = copy_f8.get_slice(local_tid)
            thr_16 = copy_16.get_slice(local_tid)
            tXsA8 = thr_f8.partition_S(sA)  # (CPY, REP_M, 1, STAGE)
            tXsB8 = thr_f8.partition_S(sB)
            tXsA16 = thr_16.partition_D(sA16)  # (CPY, REP_M, 1, BUF)
            tXsB16 = thr_16.partition_D(sB16)
            cvt_row = local_tid // tpr
            lane_in_row = local_tid % tpr
            rpp = self.cvt_rows_per_pass
            mn_ops = []  # MN-major operands: (src, dst, frag8, frag16, per-rep scale byte, first word)
            if cutlass.const_expr(self.b_mn):
                b_mn_op, rows_b = self._mn_operand(sB, sB16, bn, local_tid)
            else:
                rows_b = [cvt_row + rpp * rep for rep in range(bn // rpp)]
                b_operand = (tXsB8, tXsB16,
                             cute.make_rmem_tensor(tXsB8[(None, None, None, 0)].shape, self.ab_dtype),
                             cute.make_rmem_tensor(tXsB16[(None, None, None, 0)].shape, self.mma_dtype))
            k_ops = []
            if cutlass.const_expr(self.a_mn):
                a_mn_op, rows_a = self._mn_operand(sA, sA16, bm, local_tid)
                mn_ops.append(a_mn_op + (0,))
            else:
                rows_a = [cvt_row + rpp * rep for rep in range(bm // rpp)]
                k_ops.append((tXsA8, tXsA16,
                              cute.make_rmem_tensor(tXsA8[(None, None, None, 0)].shape, self.ab_dtype),
                              cute.make_rmem_tensor(tXsA16[(None, None, None, 0)].shape, self.mma_dtype), 0))
            if cutlass.const_expr(self.b_mn):
                mn_ops.append(b_mn_op + (len(rows_a),))
            else:
                k_ops.append(b_operand + (len(rows_a),))
            operands = tuple(k_ops)
            reps = len(rows_a) + len(rows_b)

            # Scale atoms as 32-bit words: word (chunk·128 + (r%32)·4 + r//32) holds the 4 k-block scales of r.
            sfa_w = cute.make_tensor(cute.recast_ptr(sfa.iterator, dtype=cutlass.Int32),
                                     cute.make_layout((cute.size(sfa) // 4,)))
            sfb_w = cute.make_tensor(cute.recast_ptr(sfb.iterator, dtype=cutlass.Int32),
                                     cute.make_layout((cute.size(sfb) // 4,)))
            k_atoms = (k + common.ATOM_KB * self.sf_vec_size - 1) // (common.ATOM_KB * self.sf_vec_size)
            atom_lane = self.atom_lane(lane_in_row)
            bases = cute.make_rmem_tensor((reps,), cutlass.Int32)
            self.scale_word_bases(bases, rows_a, rows_b, (batch, b_batch), tile_m, tile_n, (bm, bn), m, n,
                                  k_atoms)
            words = cute.make_rmem_tensor((reps,), cutlass.Int32)
            atom0, _ = self.tile_scale_byte(0, atom_lane, k_atoms)
            self.load_scale_words(words, bases, sfa_w, sfb_w, atom0)

            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            # ------------------------------------------------------------------------------ dequantize tile 0
            # (Names here differ from the mainloop's: a name assigned in both would become a loop-carried value.)
            _, jfirst0 = self.tile_scale_byte(0, 0, k_atoms)
            _, jbyte0 = self.tile_scale_byte(0, lane_in_row, k_atoms)
            next_atom0, _ = self.tile_scale_byte(cutlass.min(1, k_tiles - 1), lane_in_row, k_atoms)
            scales0 = self.dequantize(ab_pipeline, read_state, words, bases, sfa_w, sfb_w, next_atom0, jfirst0, jbyte0,
                                      operands, 0, mn_ops)
            if cutlass.const_expr(self.dequant_mode == "e2m1"):
                self.convert_e2m1(operands, scales0, 0)
            ab_pipeline.consumer_release(read_state)
            read_state.advance()
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=self.mainloop_barrier_id, number_of_threads=2 * self.threads_per_wg)

            # ------------------------------------------------------------------------------ mainloop
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            for kt in range(k_tiles):
                buf = kt % MMA_BUFFERS
                cute.nvgpu.warpgroup.fence()
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                for ks in cutlass.range_constexpr(num_k_steps):
                    cute.gemm(tiled_mma, partial, tCrA[(None, None, ks, buf)], tCrB[(None, None, ks, buf)], partial)
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.nvgpu.warpgroup.commit_group()
                if kt + 1 < k_tiles:  # dequantize the next tile into the other buffer while the tensor cores run
                    _, jfirst = self.tile_scale_byte(kt + 1, 0, k_atoms)
                    _, jbyte = self.tile_scale_byte(kt + 1, lane_in_row, k_atoms)
                    next_atom, _ = self.tile_scale_byte(cutlass.min(kt + 2, k_tiles - 1), lane_in_row, k_atoms)
                    nbuf = (kt + 1) % MMA_BUFFERS
                    scales = self.dequantize(ab_pipeline, read_state, words, bases, sfa_w, sfb_w, next_atom, jfirst,
                                             jbyte, operands, nbuf, mn_operands=mn_ops,
                                             this_k_atom=self.tile_scale_byte(kt + 1, atom_lane, k_atoms)[0])
                    if cutlass.const_expr(self.dequant_mode == "e2m1"):
                        self.convert_e2m1(operands, scales, nbuf)
                    ab_pipeline.consumer_release(read_state)
                    read_state.advance()
                    cute.arch.fence_proxy("async.shared", space="cta")
                cute.nvgpu.warpgroup.wait_group(0)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    acc[i] = acc[i] + partial[i]
                cute.arch.barrier(barrier_id=self.mainloop_barrier_id, number_of_threads=2 * self.threads_per_wg)
            cute.nvgpu.warpgroup.wait_group(0)

            # ------------------------------------------------------------------------------ epilogue
            warp_amax = storage.warp_amax.get_tensor(cute.make_layout((self.num_consumer_warps,)))
            if cutlass.const_expr(zero is not None):
                if zero:
                    acc.fill(0.0)
            self.store_c_and_amax(acc, c, amax, alpha, warp_amax, m, n, tile_m * self.tile_mnk[0], tile_n, batch,
                                  batch, wg_idx - 1, local_tid, rows_lo, rows_hi)


class HopperGemmAmaxAlpha(HopperMxf8GemmAmax):
    """NVFP4 with its per-tensor fp32 scale: C = alpha[l]·(A·sfa)(B·sfb)^T, amax of that, before C's conversion.

    The exported function takes one more tensor, `alpha` ((L,) float32), right after amax:
    fn(a, b, sfa, sfb, c, amax, alpha, m, n, k, l, stream).
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.has_alpha = True

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, c: cute.Tensor,
                 amax: cute.Tensor, alpha: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
                 l: cutlass.Int32, stream: cuda.CUstream):
        """Host side of the alpha ABI: as `HopperMxf8GemmAmax.__call__`, with alpha[l] applied in the epilogue."""
        self._launch(a, b, sfa, sfb, c, amax, alpha, m, n, k, l, stream)
