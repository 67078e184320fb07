"""Hopper (sm_90a) MXFP8 gemm_amax: FP8 codes x E8M0 scales dequantized to bf16 in shared memory, bf16 wgmma.

Hopper has FP8 wgmma but no block-scaled MMA, and its FP8 wgmma accumulates with reduced precision inside each
instruction (~2^-14 relative: SPEC §7's 1e-5 is out of reach that way, see benchmarks/NOTES.md). code·2^(s-127)
is exact in bf16, so the consumers fold the scales into the operands and the bf16 tensor cores (fp32
accumulation) do the rest. A producer warp streams FP8 A/B tiles with TMA through an mbarrier pipeline; the two
consumer warpgroups dequantize k-tile k+1 into one of two bf16 buffers while the wgmma of k-tile k runs on the
other; each k-tile's wgmma sum goes into a fresh partial that is added to the accumulator in fp32 (the tensor
cores truncate when accumulating, which would bias long K). Scale words are read from the 512-byte atoms of
SPEC §3 straight from global memory, one k-tile ahead. The epilogue stores C with predication (any M, N) and
folds max|acc| into amax[l] with one integer atomic max per CTA.

Phases are marked `producer`, `dequantize`, `mainloop`, `epilogue` in the kernel body.
"""

from __future__ import annotations

from typing import Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils

from jax_blockgemm.kernels import common

_AB_DTYPES = {"float8_e4m3fn": cutlass.Float8E4M3FN, "float8_e5m2": cutlass.Float8E5M2}
_C_DTYPES = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16}
SUPPORTED_TILES_MN = ((128, 128),)
SUPPORTED_CLUSTERS_MN = ((1, 1),)
SF_VEC_SIZE = 32
# How codes x scales become bf16 (both exact, both verified on the H200): "f32" converts through float32
# (FP8x2 -> f16x2 -> f32, multiply, f32x2 -> bf16x2); "bf16x2" converts codes to f16x2 in hardware, moves the
# f16 bits into bf16 fields with integer ops (value · 2^-112; FP8 values are normal f16 or exact f16 subnormals;
# inf/NaN kept) and applies 2^112 and the scale with packed bf16 multiplies. The integer ops cost more than the
# conversions they replace: 8192^3 takes 4.87 ms with "bf16x2" against 3.42 ms with "f32" (NOTES.md).
DEQUANT_MODES = ("f32", "bf16x2")  # the first is the default
_BF16X2_2POW112 = 0x77807780  # bf16 2^112 in both halves
_BF16X2_NEG_ZERO = -0x7FFF8000  # 0x80008000 as int32: x·s + (-0) == x·s, also for x·s == +0


class HopperMxf8GemmAmax:
    """C = (A·sfa) (B·sfb)^T per batch, amax[l] = max|C[l]|, for MXFP8 K-major operands on sm_90a.

    Compile-time configuration only; every size is a run-time scalar of the exported function.
    """

    def __init__(self, *, ab_dtype: str = "float8_e4m3fn", c_dtype: str = "float32",
                 tile_mn: tuple[int, int] = (128, 128), cluster_mn: tuple[int, int] = (1, 1),
                 dequant: str = "f32"):
        if ab_dtype not in _AB_DTYPES:
            raise ValueError(f"ab_dtype={ab_dtype!r} is not supported; expected one of {sorted(_AB_DTYPES)}")
        if c_dtype not in _C_DTYPES:
            raise ValueError(f"c_dtype={c_dtype!r} is not supported; expected one of {sorted(_C_DTYPES)}")
        if tuple(tile_mn) not in SUPPORTED_TILES_MN:
            raise ValueError(f"tile_mn={tile_mn!r} is not supported; expected one of {SUPPORTED_TILES_MN}")
        if tuple(cluster_mn) not in SUPPORTED_CLUSTERS_MN:
            raise ValueError(f"cluster_mn={cluster_mn!r} is not supported; expected one of {SUPPORTED_CLUSTERS_MN}")
        if dequant not in DEQUANT_MODES:
            raise ValueError(f"dequant={dequant!r} is not supported; expected one of {DEQUANT_MODES}")
        self.dequant_mode = dequant
        self.ab_dtype: Type[cutlass.Numeric] = _AB_DTYPES[ab_dtype]
        self.c_dtype: Type[cutlass.Numeric] = _C_DTYPES[c_dtype]
        self.acc_dtype = cutlass.Float32
        self.tile_mnk = (*tile_mn, 4 * SF_VEC_SIZE)  # one k-tile = 4 k-blocks = one scale atom along K
        self.cluster_mn = tuple(cluster_mn)
        # Codes x scales are exact in bfloat16 (same exponent range as float32, 8-bit significand), and the bf16
        # tensor cores accumulate in float32 at full precision, unlike Hopper's FP8 wgmma (see NOTES.md).
        self.mma_dtype = cutlass.BFloat16
        # Two consumer warpgroups, each owning 64 rows of the tile (64 + 64 fp32 registers per thread: the
        # accumulator and the k-tile partial).
        self.atom_layout_mnk = (2, 1, 1)
        self.num_consumer_wgs = 2
        self.threads_per_wg = 128
        self.threads_per_cta = (1 + self.num_consumer_wgs) * self.threads_per_wg
        self.num_consumer_warps = self.num_consumer_wgs * 4
        self.producer_regs = 40
        self.consumer_regs = 232
        self.epilogue_barrier_id = 1
        self.mainloop_barrier_id = 2
        tile_elems = (self.tile_mnk[0] + self.tile_mnk[1]) * self.tile_mnk[2]
        self.mma_buffers = 2  # bf16 tiles: the tensor cores read one while the consumers fill the other
        mma_bytes = self.mma_buffers * tile_elems * self.mma_dtype.width // 8
        smem_capacity = cutlass.memory.get_smem_capacity_in_bytes("sm_90")
        self.ab_stages = min(6, (smem_capacity - mma_bytes - 4096) // (tile_elems * self.ab_dtype.width // 8))
        self.buffer_align_bytes = 1024
        # Profiling only (benchmarks/kernel_standalone.py --profile): phases to leave out, from
        # {"dequant", "mma"}. The results are then wrong; never set in the catalog.
        self._skip: frozenset = frozenset()

    @staticmethod
    def can_implement(m: int, n: int, k: int, l: int) -> tuple[bool, str]:
        """Whether the kernel handles these sizes, and why not (the caller checks before launching)."""
        if min(m, n, k, l) < 1:
            return False, f"every size must be >= 1, got m={m}, n={n}, k={k}, l={l}"
        if k % 16:
            return False, f"k must be a multiple of 16 (16-byte rows for TMA), got k={k}"
        if l * max(m, n) * k >= 2**31 or l * m * n >= 2**31:
            return False, f"operands must hold fewer than 2**31 elements, got m={m}, n={n}, k={k}, l={l}"
        return True, ""

    # ------------------------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, c: cute.Tensor,
                 amax: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, l: cutlass.Int32,
                 stream: cuda.CUstream):
        """Host side: build (L, M, K)-shaped views of the flat buffers, the TMA atoms, and launch."""
        k16 = cute.assume(k, divby=16)
        mA = cute.make_tensor(a.iterator, cute.make_layout((m, k16, l), stride=(k16, 1, m * k16)))
        mB = cute.make_tensor(b.iterator, cute.make_layout((n, k16, l), stride=(k16, 1, n * k16)))

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.mma_dtype, self.mma_dtype, cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K, self.acc_dtype, self.atom_layout_mnk,
            tiler_mn=(64, self.tile_mnk[1]))
        a_smem_staged = self._smem_layout_staged(self.tile_mnk[0], self.ab_dtype, self.ab_stages)
        b_smem_staged = self._smem_layout_staged(self.tile_mnk[1], self.ab_dtype, self.ab_stages)
        a16_smem_staged = self._smem_layout_staged(self.tile_mnk[0], self.mma_dtype, self.mma_buffers)
        b16_smem_staged = self._smem_layout_staged(self.tile_mnk[1], self.mma_dtype, self.mma_buffers)
        tma_atom_a, tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(a_smem_staged, (None, None, 0)),
            (self.tile_mnk[0], self.tile_mnk[2]))
        tma_atom_b, tma_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mB, cute.slice_(b_smem_staged, (None, None, 0)),
            (self.tile_mnk[1], self.tile_mnk[2]))

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
        tiles_m = (m + self.tile_mnk[0] - 1) // self.tile_mnk[0]
        tiles_n = (n + self.tile_mnk[1] - 1) // self.tile_mnk[1]
        self.kernel(tma_atom_a, tma_a, tma_atom_b, tma_b, sfa, sfb, c, amax, m, n, k, tiled_mma,
                    a_smem_staged, b_smem_staged, a16_smem_staged, b16_smem_staged).launch(
            grid=(tiles_m, tiles_n, l), block=(self.threads_per_cta, 1, 1), min_blocks_per_mp=1, stream=stream)

    def _smem_layout_staged(self, rows: int, dtype: Type[cutlass.Numeric], stages: int) -> cute.ComposedLayout:
        """Swizzled K-major shared-memory layout (the wgmma's) for `stages` (rows, bk) tiles of `dtype`."""
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(cutlass.tensor_utils.LayoutEnum.ROW_MAJOR, dtype, self.tile_mnk[2]),
            dtype)
        return cute.tile_to_shape(atom, (rows, self.tile_mnk[2], stages), order=(0, 1, 2))

    @staticmethod
    def load_scale_words(words, sfa_w, sfb_w, a_word, b_word, reps: int):
        """Load this thread's scale words of one k-tile (its `reps` rows of A, then of B) into `words`."""
        for r in range(reps):
            words[r] = sfa_w[a_word + r]
            words[reps + r] = sfb_w[b_word + r]

    def dequantize(self, ab_pipeline, read_state, words, sfa_w, sfb_w, next_a_word, next_b_word, kblock, tXsA8,
                   tXsB8, tXsA16, tXsB16, frag8, frag16, frag_h, reps: int, buf):
        """Wait for one FP8 stage, write code x 2^(scale-127) as bf16 into buffer `buf`, release the stage.

        Plain Python (inlined at trace time). `words` holds this tile's scale words (loaded one tile ahead, so
        their global-memory latency hides behind a k-tile); the next tile's are loaded here. Each thread converts
        16 codes per row with float32 arithmetic (exact) and stores 16 bf16 values.
        """
        decode = common.e8m0_word_to_f32 if self.dequant_mode == "f32" else common.e8m0_word_to_bf16x2
        sa = [decode(words[r], kblock) for r in range(reps)]
        sb = [decode(words[reps + r], kblock) for r in range(reps)]
        self.load_scale_words(words, sfa_w, sfb_w, next_a_word, next_b_word, reps)
        ab_pipeline.consumer_wait(read_state)
        for src, dst, scales in (() if "dequant" in self._skip else ((tXsA8, tXsA16, sa), (tXsB8, tXsB16, sb))):
            cute.autovec_copy(src[(None, None, None, read_state.index)], frag8)
            for r in range(reps):
                if self.dequant_mode == "f32":
                    vals = frag8[(None, r, 0)].load().to(cutlass.Float32) * scales[r]
                    frag16[(None, r, 0)].store(vals.to(self.mma_dtype))
                else:
                    self._codes_to_bf16x2(frag8[(None, r, 0)], frag16[(None, r, 0)], scales[r], frag_h)
            cute.autovec_copy(frag16, dst[(None, None, None, buf)])
        ab_pipeline.consumer_release(read_state)

    @staticmethod
    def _codes_to_bf16x2(codes: cute.Tensor, out: cute.Tensor, scale_bf16x2, frag_h: cute.Tensor):
        """out = codes · scale in bf16 (exact): hardware FP8->f16x2, f16 bits -> bf16 fields, two bf16x2 FMAs."""
        frag_h.store(codes.load().to(cutlass.Float16))
        h_words = cute.recast_tensor(frag_h, cutlass.Int32)
        o_words = cute.recast_tensor(out, cutlass.Int32)
        for i in range(cute.size(h_words)):
            h = h_words[i]
            x = ((h >> 3) & 0x0FFF0FFF) | (h & _BF16X2_NEG_ZERO)  # bf16 bits of (value · 2^-112), both halves
            # f16 inf/NaN (exponent 31) must keep an all-ones bf16 exponent: OR 0x7000 into those halves.
            special = ((h & 0x7C007C00) + 0x04000400) & _BF16X2_NEG_ZERO  # bit 15 of each inf/NaN half
            x = x | ((special >> 3) & 0x10001000) * 7
            x = cute.arch.fma_packed_bf16x2(x, cutlass.Int32(_BF16X2_2POW112), cutlass.Int32(_BF16X2_NEG_ZERO))
            o_words[i] = cute.arch.fma_packed_bf16x2(x, scale_bf16x2, cutlass.Int32(_BF16X2_NEG_ZERO))

    # ---------------------------------------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor, tma_atom_b: cute.CopyAtom,
               mB_nkl: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, c: cute.Tensor, amax: cute.Tensor,
               m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, tiled_mma: cute.TiledMma,
               a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
               a16_smem_staged: cute.ComposedLayout, b16_smem_staged: cute.ComposedLayout):
        """Device body: warpgroup 0 produces (TMA), warpgroups 1-2 consume (dequantize + wgmma + epilogue)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tile_m, tile_n, batch = cute.arch.block_idx()
        bm, bn, bk = self.tile_mnk

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        tma_bytes = (cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem_staged, (None, None, 0)))
                     + cute.size_in_bytes(self.ab_dtype, cute.slice_(b_smem_staged, (None, None, 0))))
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.pipeline_mbars.data_ptr(), num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_warps),
            tx_count=tma_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        gA = cute.local_tile(mA_mkl, (bm, bk), (None, None, None))  # (bM, bK, RestM, RestK, L)
        gB = cute.local_tile(mB_nkl, (bn, bk), (None, None, None))  # (bN, bK, RestN, RestK, L)
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_atom_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        k_tiles = cute.size(gA, mode=[3])

        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_mn)

        if wg_idx == 0:
            # ------------------------------------------------------------------------------ producer
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
                for kt in range(k_tiles):
                    ab_pipeline.producer_acquire(state)
                    bar = ab_pipeline.producer_get_barrier(state)
                    cute.copy(tma_atom_a, tAgA[(None, tile_m, kt, batch)], tAsA[(None, state.index)],
                              tma_bar_ptr=bar)
                    cute.copy(tma_atom_b, tBgB[(None, tile_n, kt, batch)], tBsB[(None, state.index)],
                              tma_bar_ptr=bar)
                    ab_pipeline.producer_commit(state)
                    state.advance()
                ab_pipeline.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            local_tid = tidx - self.threads_per_wg  # 0..255 over the consumer warpgroups
            thr_mma = tiled_mma.get_slice((wg_idx - 1) * self.threads_per_wg)
            sA16 = storage.sA16.get_tensor(a16_smem_staged.outer, swizzle=a16_smem_staged.inner)
            sB16 = storage.sB16.get_tensor(b16_smem_staged.outer, swizzle=b16_smem_staged.inner)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA16))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB16))
            # The tensor cores truncate when they add into their accumulator, which biases long sums; each k-tile
            # is summed into `partial` (8 wgmma k-steps) and added to `acc` with round-to-nearest fp32 adds.
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((bm, bn)), self.acc_dtype)
            partial = cute.make_rmem_tensor(thr_mma.partition_shape_C((bm, bn)), self.acc_dtype)
            acc.fill(0.0)
            num_k_steps = cute.size(tCrA, mode=[2])

            # Dequantization: thread t converts rows t/8 + 32·rep (rep < 4) and k-columns [16·(t%8), +16) of
            # both tiles; all 16 columns lie in k-block (t%8)/2, and the 4 rows' scale words are contiguous.
            cvt_thr = cute.make_layout((32, 8), stride=(8, 1))
            cvt_val = cute.make_layout((1, 16), stride=(16, 1))
            copy_f8 = cute.make_tiled_copy_tv(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.ab_dtype, num_bits_per_copy=128),
                cvt_thr, cvt_val)
            copy_16 = cute.make_tiled_copy_tv(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.mma_dtype, num_bits_per_copy=128),
                cvt_thr, cvt_val)
            thr_f8 = copy_f8.get_slice(local_tid)
            thr_16 = copy_16.get_slice(local_tid)
            tXsA8 = thr_f8.partition_S(sA)  # (CPY, REP_M, 1, STAGE)
            tXsB8 = thr_f8.partition_S(sB)
            tXsA16 = thr_16.partition_D(sA16)  # (CPY, REP_M, 1, BUF)
            tXsB16 = thr_16.partition_D(sB16)
            reps = cute.size(tXsA8, mode=[1])
            frag8 = cute.make_rmem_tensor(tXsA8[(None, None, None, 0)].shape, self.ab_dtype)
            frag16 = cute.make_rmem_tensor(tXsA16[(None, None, None, 0)].shape, self.mma_dtype)
            frag_h = cute.make_rmem_tensor((cute.size(frag8, mode=[0]),), cutlass.Float16)
            cvt_row = local_tid // 8
            cvt_kblock = (local_tid % 8) // 2

            # Scale atoms as 32-bit words: word (chunk·128 + (r%32)·4 + r//32) holds the 4 k-block scales of r.
            sfa_w = cute.make_tensor(cute.recast_ptr(sfa.iterator, dtype=cutlass.Int32),
                                     cute.make_layout((cute.size(sfa) // 4,)))
            sfb_w = cute.make_tensor(cute.recast_ptr(sfb.iterator, dtype=cutlass.Int32),
                                     cute.make_layout((cute.size(sfb) // 4,)))
            tiles_m = (m + bm - 1) // bm
            tiles_n = (n + bn - 1) // bn
            a_word0 = (batch * tiles_m + tile_m) * k_tiles * 128 + cvt_row * 4
            b_word0 = (batch * tiles_n + tile_n) * k_tiles * 128 + cvt_row * 4

            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            words = cute.make_rmem_tensor((2 * reps,), cutlass.Int32)
            self.load_scale_words(words, sfa_w, sfb_w, a_word0, b_word0, reps)
            # ------------------------------------------------------------------------------ dequantize tile 0
            kt1 = cutlass.min(1, k_tiles - 1) * 128
            self.dequantize(ab_pipeline, read_state, words, sfa_w, sfb_w, a_word0 + kt1, b_word0 + kt1,
                            cvt_kblock, tXsA8, tXsB8, tXsA16, tXsB16, frag8, frag16, frag_h, reps, 0)
            read_state.advance()
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=self.mainloop_barrier_id, number_of_threads=2 * self.threads_per_wg)

            # ------------------------------------------------------------------------------ mainloop
            for kt in range(k_tiles):
                buf = kt % 2
                cute.nvgpu.warpgroup.fence()
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                for ks in cutlass.range_constexpr(0 if "mma" in self._skip else num_k_steps):
                    cute.gemm(tiled_mma, partial, tCrA[(None, None, ks, buf)], tCrB[(None, None, ks, buf)], partial)
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.nvgpu.warpgroup.commit_group()
                if kt + 1 < k_tiles:  # dequantize the next tile into the other buffer while the tensor cores run
                    kt2 = cutlass.min(kt + 2, k_tiles - 1) * 128
                    self.dequantize(ab_pipeline, read_state, words, sfa_w, sfb_w, a_word0 + kt2, b_word0 + kt2,
                                    cvt_kblock, tXsA8, tXsB8, tXsA16, tXsB16, frag8, frag16, frag_h, reps, 1 - buf)
                    read_state.advance()
                    cute.arch.fence_proxy("async.shared", space="cta")
                cute.nvgpu.warpgroup.wait_group(0)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    acc[i] = acc[i] + partial[i]
                cute.arch.barrier(barrier_id=self.mainloop_barrier_id, number_of_threads=2 * self.threads_per_wg)

            # ------------------------------------------------------------------------------ epilogue
            # The wgmma m64nNk16 accumulator fragment: value (v0, v1, v2) of a thread sits at row
            # 16·warp + lane/4 + 8·v1 and column 2·(lane%4) + v0 + 8·v2 of its warpgroup's 64 x bn slice.
            lane = local_tid % 32
            row0 = (wg_idx - 1) * 64 + ((local_tid // 32) % 4) * 16 + lane // 4
            col0 = (lane % 4) * 2
            n_col_groups = bn // 8
            amax_bits = cutlass.Int32(0)
            c_row_base = (cutlass.Int64(batch) * m + tile_m * bm) * n + tile_n * bn
            for v1 in cutlass.range_constexpr(2):
                r = row0 + 8 * v1
                row_ok = tile_m * bm + r < m
                for v2 in cutlass.range_constexpr(n_col_groups):
                    for v0 in cutlass.range_constexpr(2):
                        col = col0 + v0 + 8 * v2
                        i = v0 + 2 * v1 + 4 * v2
                        if row_ok & (tile_n * bn + col < n):
                            x = acc[i]
                            c[c_row_base + cutlass.Int64(r) * n + col] = x.to(self.c_dtype)
                            amax_bits = cutlass.max(amax_bits, common.abs_bits(x))
            warp_amax = storage.warp_amax.get_tensor(cute.make_layout((self.num_consumer_warps,)))
            amax_i32 = cute.make_tensor(cute.recast_ptr(amax.iterator, dtype=cutlass.Int32), cute.make_layout((1,)))
            common.amax_block_reduce_and_publish(
                amax_bits, warp_amax, (amax_i32.iterator + batch), local_tid, self.num_consumer_warps,
                self.epilogue_barrier_id)
