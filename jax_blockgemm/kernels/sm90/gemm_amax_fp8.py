"""Hopper (sm_90a) MXFP8 gemm_amax on the FP8 tensor cores, with the block scales applied on the CUDA cores
("fp8 promote"; accuracy class "tensor-core FP8", SPEC §7: <= 1e-4).

Per 32-wide k-block (one MX block = one k32 FP8 wgmma) a warpgroup computes partial = A_codes · B_codes^T into a
fresh fp32 fragment (scale-d = 0), then promotes it: acc += (partial · sfb[col]) · sfa[row] (one FMUL + one FFMA
per accumulator element). What makes this faster than the first version of the project (5.76 ms at 8192^3) is
that the promotion no longer waits for the tensor cores:

- Each consumer warpgroup owns 64 x bn of a 128 x bn CTA tile and issues its wgmma in chunks of 64 columns
  (m64n64k32): a k-block is bn/64 steps. Two partial register sets (2 x 32 fp32 per thread) alternate: step s+1 is
  issued into the free set, `wgmma.wait_group 1` waits for step s only, and step s is promoted while s+1 runs on
  the tensor cores. Registers per thread: acc bn/2 + 64 (partials) + 16 column scales + 8 row scales.
- Scales are decoded once per CTA, not per thread: three "scale warps" (warps 1-3 of the producer warpgroup, idle
  otherwise) read each k-tile's E8M0 words straight from the SPEC §3 atoms (one 512-byte atom per 128 rows and
  128-wide k-tile), turn them into fp32 2^(b-127) (0 -> 2^-127, 0xFF -> NaN) and write them to a shared-memory ring
  (its own mbarrier pipeline, `scale_stages` deep) in the order the consumers read them: one 16-byte load gives a
  thread 4 of its column scales (padding keeps the 4 quads of a warp in different banks), one gives the 4 k-blocks
  of one of its 2 rows. Per accumulator element and k-block: 2 FP32-pipe instructions + 1/8 shared load.
- A producer warp streams FP8 A and B tiles (128 x 128 and bn x 128 codes, K-major, 128-byte swizzle) with TMA
  through `ab_stages` stages (kernels/sm90/tma_pipeline.py).

NaN scale bytes make their rows/columns NaN (NaN · 0 too) and hence amax NaN; tails in M and N are TMA zero fill
(their scale reads are clamped to a real atom) and predicated stores; K is a multiple of 16 (TMA's 16-byte
rows; past K a k-tile holds zero codes and the 0-byte padding scales). The epilogue (C store + amax) is `gemm_amax.CEpilogue`'s.

Range note: the scales are applied as two fp32 multiplies (partial · sfb, then · sfa), exactly like the
dequantized product as long as partial · sfb stays inside fp32's normal range; with real MX data (scale
exponents far from ±100) it always does.
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
from jax_blockgemm.kernels.sm90.gemm_amax import (_C_DTYPES, E8M0, SF_VEC_SIZE, CEpilogue, HopperMxf8GemmAmax,
                                                  smem_layout_staged)

SUPPORTED_TILES_MN = ((128, 128), (128, 256))
MMA_N = 64  # columns per wgmma (m64n64k32): one promotion step
TILE_K = 128  # codes per k-tile (= one scale atom: 4 k-blocks of 32)
_AB_DTYPES = {"float8_e4m3fn": cutlass.Float8E4M3FN, "float8_e5m2": cutlass.Float8E5M2}
_SMEM_RESERVE = 4096  # mbarriers and the per-warp amax slots
_SCALE_WARPS = 3  # warps 1..3 of the producer warpgroup
_BYTE_ONES = 0x01010101
_BYTE_MSBS = -0x7F7F7F80  # 0x80808080 as a signed int32


class HopperFp8PromoteGemmAmax(CEpilogue):
    """C = (A·sfa)(B·sfb)^T per batch, amax[l] = max|C[l]|, MXFP8 K-major operands, FP8 wgmma + overlapped
    promotion. Same ABI as `HopperMxf8GemmAmax`: fn(a, b, sfa, sfb, c, amax, m, n, k, l, stream)."""

    def __init__(self, *, ab_dtype: str = "float8_e4m3fn", c_dtype: str = "float32",
                 tile_mn: tuple[int, int] = (128, 128), cluster_mn: tuple[int, int] = (1, 1),
                 sf_vec_size: int = SF_VEC_SIZE, sf_dtype: str = E8M0, a_major: str = "k", b_major: str = "k",
                 scale_stages: int = 4):
        common.require_choice("ab_dtype", ab_dtype, sorted(_AB_DTYPES))
        common.require_choice("c_dtype", c_dtype, sorted(_C_DTYPES))
        common.require_choice("(sf_dtype, sf_vec_size)", (sf_dtype, sf_vec_size), ((E8M0, SF_VEC_SIZE),))
        common.require_choice("a_major", a_major, ("k",))
        common.require_choice("b_major", b_major, ("k",))
        common.require_choice("tile_mn", tuple(tile_mn), SUPPORTED_TILES_MN)
        common.require_choice("cluster_mn", tuple(cluster_mn), ((1, 1),))
        common.require_choice("scale_stages", scale_stages, (2, 3, 4, 6, 8))
        self.ab_dtype: Type[cutlass.Numeric] = _AB_DTYPES[ab_dtype]
        self.c_dtype: Type[cutlass.Numeric] = _C_DTYPES[c_dtype]
        self.c_name = c_dtype
        self.c_kind = ("fp4" if c_dtype == "float4_e2m1fn" else
                       "fp8" if c_dtype in ("float8_e4m3fn", "float8_e5m2") else "wide")
        self.has_alpha = False
        self.acc_dtype = cutlass.Float32
        self.sf_vec_size = sf_vec_size
        self.tile_mnk = (*tile_mn, TILE_K)
        self.cluster_mn = tuple(cluster_mn)
        self.chunks = tile_mn[1] // MMA_N  # wgmma steps per k-block
        self.kb_per_tile = TILE_K // SF_VEC_SIZE  # 4
        self.steps_per_tile = self.kb_per_tile * self.chunks  # even: the partial set of each step is static
        self.atom_layout_mnk = (2, 1, 1)
        self.num_consumer_wgs = 2
        self.threads_per_wg = 128
        self.threads_per_cta = (1 + self.num_consumer_wgs) * self.threads_per_wg
        self.num_consumer_warps = self.num_consumer_wgs * 4
        self.scale_threads = 32 * _SCALE_WARPS
        self.producer_regs = 40
        self.consumer_regs = 232
        self.epilogue_barrier_id = 1
        # Decoded scales per stage, fp32: A as [row][kb] (128 x 4), B per k-block as 4 quads x (bn/4 + 4): quad q
        # (lane % 4) holds the columns 16u + 8w + 2q + e at 4u + 2w + e; the 4 padding words shift the quads
        # by 4 banks each.
        bn = tile_mn[1]
        self.sb_quad_stride = bn // 4 + 4
        self.sb_kb_stride = 4 * self.sb_quad_stride
        self.sa_stage = tile_mn[0] * self.kb_per_tile
        self.sb_stage = self.kb_per_tile * self.sb_kb_stride
        self.scale_stages = scale_stages
        scale_bytes = scale_stages * (self.sa_stage + self.sb_stage) * 4
        stage_bytes = (tile_mn[0] + bn) * TILE_K * self.ab_dtype.width // 8
        smem_capacity = cutlass.memory.get_smem_capacity_in_bytes("sm_90")
        self.ab_stages = min(8, (smem_capacity - scale_bytes - _SMEM_RESERVE) // stage_bytes)
        if self.ab_stages < 2:
            raise ValueError(f"tile_mn={tile_mn!r}, scale_stages={scale_stages} leave shared memory for "
                             f"{self.ab_stages} FP8 stages; at least 2 are needed")
        # Words of scale atoms per k-tile (A's one atom, then B's bn/128), and per scale thread.
        self.scale_words = tile_mn[0] + bn
        self.words_per_scale_thread = -(-self.scale_words // self.scale_threads)
        self.buffer_align_bytes = 1024
        # Profiling only (benchmarks/kernel_standalone.py phases): "dequant" leaves out the promotion, "mma" the
        # wgmma, "amax" the amax. The results are then wrong; never set in the catalog.
        self._skip: frozenset = frozenset()

    def can_implement(self, m: int, n: int, k: int, l: int) -> tuple[bool, str]:
        """Whether the kernel handles these sizes, and why not (the caller checks before launching)."""
        if min(m, n, k, l) < 1:
            return False, f"every size must be >= 1, got m={m}, n={n}, k={k}, l={l}"
        if k % 16:  # a last block of 16 codes is fine: TMA fills the rest of the k-tile with zero codes
            return False, f"k must be a multiple of 16 (16-byte rows for TMA), got k={k}"
        if l * max(m, n) * k >= 2**31 or l * m * n >= 2**31:
            return False, f"operands must hold fewer than 2**31 elements, got m={m}, n={n}, k={k}, l={l}"
        return True, ""

    # ------------------------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, c: cute.Tensor,
                 amax: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, l: cutlass.Int32,
                 stream: cuda.CUstream):
        """Host side: (L, M, K)-shaped views of the flat buffers, the TMA atoms, and the launch."""
        kc = cute.assume(k, divby=16)
        mA = common.operand_view(a, m, kc, l, False)
        mB = common.operand_view(b, n, kc, l, False)
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, MMA_N))
        bm, bn, bk = self.tile_mnk
        a_smem_staged = smem_layout_staged(bm, self.ab_dtype, self.ab_stages, bk)
        b_smem_staged = smem_layout_staged(bn, self.ab_dtype, self.ab_stages, bk)
        tma_atom_a, tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(a_smem_staged, (None, None, 0)), (bm, bk))
        tma_atom_b, tma_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mB, cute.slice_(b_smem_staged, (None, None, 0)), (bn, bk))

        @cute.struct
        class SharedStorage:
            pipeline_mbars: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            sc_mbars: cute.struct.MemRange[cutlass.Int64, self.scale_stages * 2]
            warp_amax: cute.struct.MemRange[cutlass.Int32, self.num_consumer_warps]
            sSA: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.sa_stage * self.scale_stages], 16]
            sSB: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.sb_stage * self.scale_stages], 16]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem_staged)],
                                  self.buffer_align_bytes]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem_staged)],
                                  self.buffer_align_bytes]

        self.shared_storage = SharedStorage
        tiles_m = (m + bm - 1) // bm
        tiles_n = (n + bn - 1) // bn
        self.kernel(tma_atom_a, tma_a, tma_atom_b, tma_b, sfa, sfb, c, amax, m, n, k, tiled_mma,
                    a_smem_staged, b_smem_staged).launch(
            grid=(tiles_m, tiles_n, l), block=(self.threads_per_cta, 1, 1), min_blocks_per_mp=1, stream=stream)

    # ------------------------------------------------------------------------------------ device helpers
    def sb_position(self, col):
        """Index, inside one k-block of a B scale stage, of column `col` (0 <= col < bn): quad q = (col % 8) // 2
        at q·(bn/4 + 4) + 4·(col // 16) + 2·((col // 8) % 2) + col % 2. Plain Python or DSL integers."""
        return (((col % 8) // 2) * self.sb_quad_stride + (col // 16) * 4 + ((col // 8) % 2) * 2 + col % 2)

    def issue(self, tiled_mma, part, tCrA, tCrB, kb: int, h: int, stage):
        """wgmma step (k-block kb, columns [64h, +64)) of the stage into the partial `part` (scale-d = 0)."""
        cute.nvgpu.warpgroup.fence()
        if "mma" not in self._skip:
            cute.gemm(tiled_mma, part, tCrA[(None, None, kb, stage)], tCrB[h][(None, None, kb, stage)], part)
        cute.nvgpu.warpgroup.commit_group()

    def load_col_scales(self, sb_frags, sSB_t, quad, kb: int, h: int, stage):
        """This thread's 16 column scales of step (kb, h): 4 16-byte shared loads."""
        for u in range(4):
            cute.autovec_copy(sSB_t[(None, 4 * h + u, quad, kb, stage)], sb_frags[u])

    def promote(self, acc, part, sb_frags, sa_frags, kb: int, h: int):
        """acc[chunk h] += (part · sfb[col]) · sfa[row], one FMUL + one FFMA per element. Fragment value
        i = v0 + 2·v1 + 4·v2 of the m64n64 chunk: row g + 8·v1, column 2·(lane%4) + v0 + 8·v2; its column
        scale is value 2·(v2 % 2) + v0 of sb_frags[v2 // 2]."""
        if "dequant" in self._skip:  # profiling: one add still reads the partial, or ptxas would drop its wgmma
            acc[0] = acc[0] + part[0]
            return
        for i in range(cute.size(part)):
            v0, v1, v2 = i % 2, (i // 2) % 2, i // 4
            t = part[i] * sb_frags[v2 // 2][2 * (v2 % 2) + v0]
            j = MMA_N // 2 * h + i
            acc[j] = acc[j] + t * sa_frags[v1][kb]

    def decode_scale_word(self, word):
        """The 4 E8M0 bytes of a word as fp32 bit patterns: b << 23 (2 integer ops each), except bytes 0 (2^-127)
        and 0xFF (NaN), which take common.e8m0_bits (a word holding either is rare: checked once per word)."""
        vals = [((word >> (8 * j)) & 0xFF) << 23 for j in range(4)]
        # Some byte is 0x00 or 0xFF: the classic "has a zero byte" test on the word and on its complement.
        inv = ~word
        special = (((word - _BYTE_ONES) & inv) | ((inv - _BYTE_ONES) & word)) & _BYTE_MSBS
        return vals, special

    @cute.jit
    def scale_word_bits(self, word):
        """(v0, v1, v2, v3): the fp32 bit patterns of a scale word's 4 bytes, `decode_scale_word`'s fast path, or
        `common.e8m0_bits` per byte when the word holds a 0x00 or 0xFF byte."""
        vals, special = self.decode_scale_word(word)
        v0, v1, v2, v3 = vals
        if special != 0:
            v0 = common.e8m0_bits(word & 0xFF)
            v1 = common.e8m0_bits((word >> 8) & 0xFF)
            v2 = common.e8m0_bits((word >> 16) & 0xFF)
            v3 = common.e8m0_bits((word >> 24) & 0xFF)
        return v0, v1, v2, v3

    # ---------------------------------------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor, tma_atom_b: cute.CopyAtom,
               mB_nkl: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, c: cute.Tensor, amax: cute.Tensor,
               m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, tiled_mma: cute.TiledMma,
               a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout):
        """Warp 0: TMA producer; warps 1-3: scale decoders; warpgroups 1-2: wgmma + promotion + epilogue."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tile_m, tile_n, batch = cute.arch.block_idx()
        bm, bn, bk = self.tile_mnk

        # Every scale thread arrives on "full", every consumer thread on "empty" (initialized before the A+B
        # pipeline, whose init fence then covers both).
        sc_pipelines = []

        def init_scale_pipeline(storage):
            sc_pipelines.append(pipeline.PipelineAsync.create(
                num_stages=self.scale_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.scale_threads),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         self.num_consumer_wgs * self.threads_per_wg),
                barrier_storage=storage.sc_mbars.data_ptr(), defer_sync=True))

        storage, ab_pipeline, sA, sB, views, k_tiles, wg_idx = tma_pipeline.ab_prologue(
            tidx, warp_idx, tma_atom_a, mA_mkl, tma_atom_b, mB_nkl, a_smem_staged, b_smem_staged, self.shared_storage,
            self.ab_dtype, self.ab_stages, self.num_consumer_warps, self.cluster_mn, self.tile_mnk,
            self.threads_per_wg, init_scale_pipeline)
        sc_pipeline = sc_pipelines[0]
        # Decoded scales: A (kb, row, stage); B (value, u, quad, kb, stage), value 2w + e of column 16u + 8w + 2q + e.
        kbt = self.kb_per_tile
        sSA_t = storage.sSA.get_tensor(cute.make_layout((kbt, bm, self.scale_stages),
                                                        stride=(1, kbt, self.sa_stage)))
        sSB_t = storage.sSB.get_tensor(cute.make_layout(
            (4, bn // 16, 4, kbt, self.scale_stages),
            stride=(1, 4, self.sb_quad_stride, self.sb_kb_stride, self.sb_stage)))

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                # -------------------------------------------------------------------------- producer (TMA)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
                state = tma_pipeline.produce_tile(ab_pipeline, state, tma_atom_a, tma_atom_b, views, tile_m, tile_n,
                                                  k_tiles, batch)
                ab_pipeline.producer_tail(state)
            else:
                # -------------------------------------------------------------------------- scale decoders
                # Thread s of the 96 handles atom words s + 96·i of the k-tile: A's 128 words, then B's bn.
                # Word w of an atom holds the 4 k-block bytes of row 32·(w % 4) + w // 4 (SPEC §3).
                sidx = tidx - 32
                sfa_w = cute.make_tensor(cute.recast_ptr(sfa.iterator, dtype=cutlass.Int32),
                                         cute.make_layout((cute.size(sfa) // 4,)))
                sfb_w = cute.make_tensor(cute.recast_ptr(sfb.iterator, dtype=cutlass.Int32),
                                         cute.make_layout((cute.size(sfb) // 4,)))
                k_atoms = (k + common.ATOM_KB * SF_VEC_SIZE - 1) // (common.ATOM_KB * SF_VEC_SIZE)
                a_atoms = (m + common.ATOM_MN - 1) // common.ATOM_MN
                b_atoms = (n + common.ATOM_MN - 1) // common.ATOM_MN
                atom_words = common.ATOM_BYTES // 4
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.scale_stages)
                for kt in range(k_tiles):
                    sc_pipeline.producer_acquire(state)
                    for i in cutlass.range_constexpr(self.words_per_scale_thread):
                        w = sidx + self.scale_threads * i
                        if w < self.scale_words:
                            if w < bm:  # warp-uniform (96 and 128 are multiples of 32)
                                word = sfa_w[((batch * a_atoms + tile_m) * k_atoms + kt) * atom_words + w]
                                row = 32 * (w % 4) + w // 4
                                vs = self.scale_word_bits(word)
                                for j in cutlass.range_constexpr(4):
                                    sSA_t[(j, row, state.index)] = common.f32_from_bits(vs[j])
                            else:
                                wb = w - bm
                                atom = cutlass.min(tile_n * (bn // common.ATOM_MN) + wb // atom_words, b_atoms - 1)
                                ww = wb % atom_words
                                word = sfb_w[((batch * b_atoms + atom) * k_atoms + kt) * atom_words + ww]
                                col = (wb // atom_words) * common.ATOM_MN + 32 * (ww % 4) + ww // 4
                                vs = self.scale_word_bits(word)
                                q = (col % 8) // 2
                                u = col // 16
                                e2 = ((col // 8) % 2) * 2 + col % 2
                                for j in cutlass.range_constexpr(4):
                                    sSB_t[(e2, u, q, j, state.index)] = common.f32_from_bits(vs[j])
                    sc_pipeline.producer_commit(state)
                    state.advance()
        else:
            # ------------------------------------------------------------------------------ consumers
            cute.arch.setmaxregister_increase(self.consumer_regs)
            local_tid = tidx - self.threads_per_wg  # 0..255 over the consumer warpgroups
            thr_mma = tiled_mma.get_slice((wg_idx - 1) * self.threads_per_wg)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))  # (MMA, 1, k-blocks, stage)
            # B per 64-column chunk h (rows [64h, +64) of the stage): (MMA, 1, k-blocks, stage) each.
            tCrB = [tiled_mma.make_fragment_B(thr_mma.partition_B(
                cute.local_tile(sB, (MMA_N, bk, self.ab_stages), (h, 0, 0)))) for h in range(self.chunks)]
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((bm, bn)), self.acc_dtype)  # ((2,2,8),1,bn/64)
            acc.fill(0.0)
            part_shape = thr_mma.partition_shape_C((bm, MMA_N))
            parts = [cute.make_rmem_tensor(part_shape, self.acc_dtype) for _ in range(2)]
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)  # every step starts a fresh partial
            lane = local_tid % 32
            quad = lane % 4
            row_a = (wg_idx - 1) * 64 + ((local_tid // 32) % 4) * 16 + lane // 4  # rows row_a, row_a + 8
            sb_frags = [cute.make_rmem_tensor((4,), cutlass.Float32) for _ in range(4)]
            sa_frags = [cute.make_rmem_tensor((kbt,), cutlass.Float32) for _ in range(2)]
            steps = self.steps_per_tile
            chunks = self.chunks

            # ------------------------------------------------------------------------------ mainloop
            # Per k-tile: step 0 is issued, then step j + 1 is always issued before step j is promoted
            # (`wait_group 1`); the last step of the k-tile is promoted after `wait_group 0`. No wgmma stays in
            # flight across the loop's back edge: ptxas (13.0) would then serialize every wgmma of the loop (C7514).
            ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            sc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.scale_stages)
            for kt in range(k_tiles):
                ab_pipeline.consumer_wait(ab_state)
                self.issue(tiled_mma, parts[0], tCrA, tCrB, 0, 0, ab_state.index)
                sc_pipeline.consumer_wait(sc_state)
                for v1 in cutlass.range_constexpr(2):
                    cute.autovec_copy(sSA_t[(None, row_a + 8 * v1, sc_state.index)], sa_frags[v1])
                for j in cutlass.range_constexpr(steps):
                    kb, h = j // chunks, j % chunks
                    if cutlass.const_expr(j + 1 < steps):
                        self.issue(tiled_mma, parts[(j + 1) % 2], tCrA, tCrB, (j + 1) // chunks, (j + 1) % chunks,
                                   ab_state.index)
                    self.load_col_scales(sb_frags, sSB_t, quad, kb, h, sc_state.index)
                    # Step j done; step j + 1 (if any) in flight.
                    cute.nvgpu.warpgroup.wait_group(1 if j + 1 < steps else 0)
                    self.promote(acc, parts[j % 2], sb_frags, sa_frags, kb, h)
                ab_pipeline.consumer_release(ab_state)
                ab_state.advance()
                sc_pipeline.consumer_release(sc_state)
                sc_state.advance()

            # ------------------------------------------------------------------------------ epilogue
            warp_amax = storage.warp_amax.get_tensor(cute.make_layout((self.num_consumer_warps,)))
            self.store_c_and_amax(acc, c, amax, amax, warp_amax, m, n, tile_m, tile_n, batch, wg_idx,
                                  local_tid)
