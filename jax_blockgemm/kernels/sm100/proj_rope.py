"""Blackwell (sm_100a) gemm_proj_rope_mxfp8: Y = x·Wᵀ per head, RoPE, rowwise and columnwise MXFP8, one kernel.

COMPILED AND STRUCTURALLY CHECKED HERE, NEVER RUN: no Blackwell GPU was available when this was written. The
mainloop follows the kernels NVIDIA runs on B200 (CUTLASS's CuTeDSL `dense_gemm_persistent.py`, cuDNN frontend's
proj_rope): TMA loads, tcgen05 MMA (kind::f16, bf16 operands) into a tensor-memory accumulator, mbarrier
pipelines, a persistent tile scheduler. The first-use self-check (`jax_blockgemm.selfcheck`) runs it against the
reference before the library uses it on a GPU.

One output tile is 128 tokens x 192 features: exactly one head, so RoPE and both quantizations finish inside it.
Warp roles (one CTA of 6 warps per SM, persistent over (token tile, head) tiles):

- `producer` (warp 5): TMA loads of bf16 x and W k-tiles (64 wide) into a ring of shared-memory stages;
- `mma` (warp 4): tcgen05.mma of each k-tile into one of two tensor-memory accumulator stages (2 x 192 of the 512
  columns), so the epilogue of tile i overlaps the MMAs of tile i+1;
- `epilogue` (warps 0-3): tensor memory -> fp32 registers with the 32x32b load, which gives thread 32w + l the
  accumulator row (token) 32w + l and 32 consecutive columns (features) per load. So a rowwise block (32 features
  of one token) is one load of one thread, reduced inside the thread; a columnwise block (32 tokens of one feature)
  is one register across the 32 lanes of a warp, reduced with a transposing butterfly (`epilogue.warp_column_max`).
  RoPE pairs (p[2j], p[2j+1]) sit in one thread too. Everything stays fp32 from the accumulator to the E4M3
  conversion (no bf16 staging, SPEC §5): the math is kernels/epilogue.py's, run per token row by
  kernels/token_rows.py, which the sm_90a "staged" kernel shares. Each thread writes its token's codes (two
  192-byte rows) and rowwise scales; lane l of warp w writes the column scale of feature 32b + l of the warp's
  32-token block.

Tokens past T (a tail tile; T is a multiple of 32) are whole warps of the epilogue: TMA fills their x rows with
zeros, and those warps store nothing. w_major "k" reads w as (H·192, K) (`w_out_in=True`), "n" as (K, H·192): only
the TMA view and the MMA's B major mode differ. The exported ABI is the catalog's proj_rope ABI (the same as the
Hopper kernel's), so ffi/proj_rope.cc launches it unchanged. Phases are marked `producer`, `mma`, `epilogue`.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import cpasync, tcgen05

from jax_blockgemm.kernels import common, token_rows
from jax_blockgemm.kernels.sm100 import MAX_AB_STAGES, SMEM_CAPACITY, persistent
from jax_blockgemm.kernels.token_rows import (  # noqa: F401 (the index maps, re-exported for the model test)
    TILE_T, code_word, col_scale_index, rope_source, row_scale_index, table_entry)
from jax_blockgemm.support import HEAD_DIM, MX_BLOCK, QK_NOPE

W_MAJORS = ("k", "n")
TILE_K = 64  # bf16: one 128-byte swizzle row
ACC_STAGES = 2  # 2 x 192 fp32 columns of the 512


class BlackwellProjRope(persistent.PersistentKernel):
    """Fused MLA Q up-projection for bf16 x and W on sm_100a (SPEC §5): E4M3 codes + E8M0 scales, both ways.

    Compile-time configuration only; T, K and H are run-time scalars of the exported function.
    """

    def __init__(self, *, x_dtype: str = "bfloat16", w_major: str = "k"):
        common.require_choice("x_dtype", x_dtype, ("bfloat16",))
        common.require_choice("w_major", w_major, W_MAJORS)
        self.ab_dtype = cutlass.BFloat16
        self.acc_dtype = cutlass.Float32
        self.w_major = w_major
        self.mma_tiler = (TILE_T, HEAD_DIM, TILE_K)
        self.cta_group = tcgen05.CtaGroup.ONE
        self.acc_stages = ACC_STAGES
        self.cluster_mn = (1, 1)  # no multicast: each CTA loads its own operands
        super().__init__()  # the warp roles, as in the gemm_amax kernel; all 512 tensor-memory columns (384 used)

    # Whether the kernel handles these sizes, and why not (the caller checks before launching).
    can_implement = staticmethod(common.proj_rope_can_implement)

    # ------------------------------------------------------------------------------------------ set-up
    def _setup(self):
        """The MMA, stage count and shared-memory layouts (trace time, plain Python)."""
        b_mode = cute.nvgpu.OperandMajorMode.K if self.w_major == "k" else cute.nvgpu.OperandMajorMode.MN
        self.tiled_mma = sm100_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, cute.nvgpu.OperandMajorMode.K, b_mode, self.acc_dtype, self.cta_group,
            self.mma_tiler[:2])
        self.cluster_layout_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (self.tiled_mma.thr_id.shape,))
        one_a = sm100_utils.make_smem_layout_a(self.tiled_mma, self.mma_tiler, self.ab_dtype, 1)
        one_b = sm100_utils.make_smem_layout_b(self.tiled_mma, self.mma_tiler, self.ab_dtype, 1)
        self.tma_bytes = cute.size_in_bytes(self.ab_dtype, one_a) + cute.size_in_bytes(self.ab_dtype, one_b)
        reserved = 1024 + self.buffer_align_bytes  # mbarriers, tmem pointer; alignment slack
        self.ab_stages = min(MAX_AB_STAGES, (SMEM_CAPACITY - reserved) // self.tma_bytes)  # 5 x 40 KB
        self.a_smem_staged = sm100_utils.make_smem_layout_a(self.tiled_mma, self.mma_tiler, self.ab_dtype,
                                                            self.ab_stages)
        self.b_smem_staged = sm100_utils.make_smem_layout_b(self.tiled_mma, self.mma_tiler, self.ab_dtype,
                                                            self.ab_stages)

    # ------------------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor, x_scale: cute.Tensor,
                 w_scale: cute.Tensor, row_codes: cute.Tensor, row_scales: cute.Tensor, col_codes: cute.Tensor,
                 col_scales: cute.Tensor, t: cutlass.Int32, k: cutlass.Int32, h: cutlass.Int32,
                 sms: cutlass.Int32, stream: cuda.CUstream):
        """Host side: (rows, K, 1)-shaped views of x and W, the TMA atoms, the persistent grid; launch.

        x_scale/w_scale: unused (bf16 inputs; MXFP8 inputs arrive dequantized). sms: the device's SM count (the
        grid is min(tiles, sms) CTAs).
        """
        self._setup()
        k8 = cute.assume(k, divby=8)
        n = cute.assume(h * HEAD_DIM, divby=64)
        mA = cute.make_tensor(x.iterator, cute.make_layout((t, k8, 1), stride=(k8, 1, t * k8)))
        if cutlass.const_expr(self.w_major == "k"):
            mB = cute.make_tensor(w.iterator, cute.make_layout((n, k8, 1), stride=(k8, 1, n * k8)))
        else:
            mB = cute.make_tensor(w.iterator, cute.make_layout((n, k8, 1), stride=(1, n, n * k8)))

        cluster_shape = self.cluster_layout_vmnk.shape
        a_one = cute.slice_(self.a_smem_staged, (None, None, None, 0))
        b_one = cute.slice_(self.b_smem_staged, (None, None, None, 0))
        tma_atom_a, tma_a = cute.nvgpu.make_tiled_tma_atom_A(
            sm100_utils.cluster_shape_to_tma_atom_A((1, 1), self.tiled_mma.thr_id), mA, a_one, self.mma_tiler,
            self.tiled_mma, cluster_shape)
        tma_atom_b, tma_b = cute.nvgpu.make_tiled_tma_atom_B(
            sm100_utils.cluster_shape_to_tma_atom_B((1, 1), self.tiled_mma.thr_id), mB, b_one, self.mma_tiler,
            self.tiled_mma, cluster_shape)

        tiles = ((t + TILE_T - 1) // TILE_T, h, 1)  # (token tile, head, 1): tile_t varies fastest
        sched_params, grid = persistent.schedule(tiles, self.cluster_mn, sms)

        self._set_shared_storage({}, {"sA": (self.ab_dtype, self.a_smem_staged.outer),
                                      "sB": (self.ab_dtype, self.b_smem_staged.outer)})
        self.kernel(self.tiled_mma, tma_atom_a, tma_a, tma_atom_b, tma_b, cos, sin, row_codes, row_scales,
                    col_codes, col_scales, t, h, self.cluster_layout_vmnk, self.a_smem_staged, self.b_smem_staged,
                    sched_params).launch(
            grid=grid, block=(self.threads_per_cta, 1, 1), cluster=(1, 1, 1), min_blocks_per_mp=1, stream=stream)

    # ------------------------------------------------------------------------------------------ device
    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor,
               tma_atom_b: cute.CopyAtom, mB_nkl: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor,
               row_codes: cute.Tensor, row_scales: cute.Tensor, col_codes: cute.Tensor, col_scales: cute.Tensor,
               t: cutlass.Int32, h: cutlass.Int32, cluster_layout_vmnk: cute.Layout,
               a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
               sched_params: persistent.SchedulerParams):
        """Device body: warp 5 produces (TMA), warp 4 issues the MMAs, warps 0-3 run the fused epilogue."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == self.producer_warp:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ab_pipeline, acc_pipeline, tmem = self._make_pipelines(storage, cluster_layout_vmnk, 1, (1, 1))

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)

        # Global tiles: (bM, bK, RestM, RestK, L), partitioned the MMA's way, then for TMA (one CTA, no multicast).
        thr_mma = tiled_mma.get_slice(0)
        tCgA = thr_mma.partition_A(cute.local_tile(mA_mkl, cute.slice_(self.mma_tiler, (None, 0, None)),
                                                   (None, None, None)))
        tCgB = thr_mma.partition_B(cute.local_tile(mB_nkl, cute.slice_(self.mma_tiler, (0, None, None)),
                                                   (None, None, None)))
        k_tiles = cute.size(tCgA, mode=[4])
        one_cta = cute.make_layout(1)
        tAsA, tAgA = cpasync.tma_partition(tma_atom_a, 0, one_cta, cute.group_modes(sA, 0, 3),
                                           cute.group_modes(tCgA, 0, 3))
        tBsB, tBgB = cpasync.tma_partition(tma_atom_b, 0, one_cta, cute.group_modes(sB, 0, 3),
                                           cute.group_modes(tCgB, 0, 3))

        tCrA, tCrB, tCtAcc_fake = self._mma_fragments(tiled_mma, sA, sB)
        self.tmem_columns_used = tcgen05.find_tmem_tensor_col_offset(tCtAcc_fake)  # 384, reported by precompile

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if warp_idx == self.producer_warp:
            # ------------------------------------------------------------------------------ producer
            # (token tile, head) tiles: x's row tile is the token tile (M), W's the head (N).
            self._produce(ab_pipeline, sched_params, k_tiles,
                          ((tma_atom_a, tAgA, tAsA, 0, None), (tma_atom_b, tBgB, tBsB, 1, None)), batched=False)

        if warp_idx == self.mma_warp:
            # ------------------------------------------------------------------------------ mma
            tmem.wait_for_alloc()
            tCtAcc_base = cute.make_tensor(tmem.retrieve_ptr(self.acc_dtype), tCtAcc_fake.layout)
            self._mma(tiled_mma, tCtAcc_base, tCrA, tCrB, ab_pipeline, acc_pipeline, sched_params, k_tiles)

        if warp_idx < self.mma_warp:
            # ------------------------------------------------------------------------------ epilogue
            self._with_tmem(tmem, tCtAcc_fake.layout, lambda tCtAcc_base: self._epilogue(
                tidx, tCtAcc_base, cos, sin, row_codes, row_scales, col_codes, col_scales, t, h, acc_pipeline,
                sched_params))

    @cute.jit
    def _epilogue(self, tidx: cutlass.Int32, tCtAcc_base: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor,
                  row_codes: cute.Tensor, row_scales: cute.Tensor, col_codes: cute.Tensor, col_scales: cute.Tensor,
                  t: cutlass.Int32, h: cutlass.Int32, acc_pipeline, sched_params: persistent.SchedulerParams):
        """Per tile: six 32-column loads of this thread's token, RoPE on the last two, both quantizations, stores."""
        # (TILE_T, 192, STAGE) accumulator -> (TILE_T, 32, 1, 6, STAGE) column blocks; thread tidx reads row tidx.
        tAcc_blocks = cute.flat_divide(tCtAcc_base[((None, None), 0, 0, None)], (TILE_T, MX_BLOCK))
        t2r = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32),
                                                         self.acc_dtype),
                                     tAcc_blocks[(None, None, 0, 0, 0)])
        thr_t2r = t2r.get_slice(tidx)
        tTR_tAcc = thr_t2r.partition_S(tAcc_blocks)  # (T2R, T2R_M, T2R_N, 1, 6, STAGE)
        block_shape = thr_t2r.partition_D(cute.make_identity_tensor((TILE_T, MX_BLOCK))).shape
        nope_blocks = QK_NOPE // MX_BLOCK
        lane = tidx % 32
        warp = tidx // 32
        row32, col32, cos32, sin32 = token_rows.word_views(row_codes, col_codes, cos, sin)

        walk = persistent.TileWalk(sched_params, self.cluster_mn)
        index = walk.first
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.acc_stages)
        while index < walk.count:
            tile_t, head, _ = walk.tile(index)
            token = tile_t * TILE_T + tidx
            live = token < t  # uniform over a warp: T is a multiple of 32
            # This token's rotary tables, loaded before the accumulator wait so their latency hides.
            rcos, rsin = token_rows.load_rope_tables(cos32, sin32, token, t)
            out_word = code_word(token, head, h)
            row_scale0 = row_scale_index(token, head, h)
            col_scale0 = col_scale_index(tile_t, warp, lane, head, h)

            acc_pipeline.consumer_wait(acc_state)
            tAcc = tTR_tAcc[(None, None, None, 0, None, acc_state.index)]
            # ------------------------------------------------------------------ features 0..127: no RoPE
            for b in cutlass.range_constexpr(nope_blocks):
                vals = cute.make_rmem_tensor(block_shape, self.acc_dtype)
                cute.copy(t2r, tAcc[(None, None, None, b)], vals)
                cute.arch.fence_view_async_tmem_load()
                token_rows.quantize_block_shuffled(vals, b, lane, live, row32, col32, row_scales, col_scales,
                                                   out_word, row_scale0, col_scale0)
            # ------------------------------------------------------------------ features 128..191: RoPE
            p_lo = cute.make_rmem_tensor(block_shape, self.acc_dtype)  # p[0..31]
            p_hi = cute.make_rmem_tensor(block_shape, self.acc_dtype)  # p[32..63]
            cute.copy(t2r, tAcc[(None, None, None, nope_blocks)], p_lo)
            cute.copy(t2r, tAcc[(None, None, None, nope_blocks + 1)], p_hi)
            # The accumulator stage is in registers now (once the loads completed): hand it back to the MMA warp.
            cute.arch.fence_view_async_tmem_load()
            with cute.arch.elect_one():
                acc_pipeline.consumer_release(acc_state)
            acc_state.advance()
            out_lo = cute.make_rmem_tensor(block_shape, self.acc_dtype)  # out[128 + j]
            out_hi = cute.make_rmem_tensor(block_shape, self.acc_dtype)  # out[160 + j]
            token_rows.rope(p_lo, p_hi, rcos, rsin, out_lo, out_hi)
            token_rows.quantize_block_shuffled(out_lo, nope_blocks, lane, live, row32, col32, row_scales,
                                               col_scales, out_word, row_scale0, col_scale0)
            token_rows.quantize_block_shuffled(out_hi, nope_blocks + 1, lane, live, row32, col32, row_scales,
                                               col_scales, out_word, row_scale0, col_scale0)
            index += walk.stride
