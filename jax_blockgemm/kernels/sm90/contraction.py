"""Hopper (sm_90a) per-group contraction over tokens: c[l, g] = x[l, rows of g]ᵀ · y[l, rows of g], the weight
gradient of a mixture-of-experts product (tokens sorted by group), in one launch with no host synchronization.

A CTA computes one 128 x 128 tile of one group's (K, N) result: the grid is (K tiles, N tiles, L·G). Both operands are
read with the tokens as the contraction, so their TMA tiles are MN-major (K or N contiguous) and the bf16 wgmma reads
both transposed. The TMA views start at the group's first row (`cute.domain_offset`), so a group may start at any
row; its 64-token k-tiles run to its end, and in the last one the rows past the group (the next group's, or zeros
past T) are zeroed in shared memory before the MMA reads them, so neither their values nor a NaN among them reach
the sum. An empty group stores zeros after one masked k-tile. The group bounds are clamped into [0, T]: no table can
make the kernel read or write outside its buffers.

The rest is `HopperRaggedBf16Gemm`'s design (kernels/sm90/ragged.py): a producer warp, two wgmma warpgroups, three
32 KB stages, two CTAs per SM, the shared epilogue (`c_store`).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils

from jax_blockgemm.kernels import common
from jax_blockgemm.kernels.sm90 import tma_pipeline, wgmma_mainloop
from jax_blockgemm.kernels.sm90.c_store import AccumulatorStore
from jax_blockgemm.kernels.sm90.gemm_amax import smem_layout_staged

C_DTYPES = ("float32", "bfloat16")
_MASK_BARRIER_ID = 2  # the MMA warps, after zeroing the rows past the group in the last k-tile


class HopperGroupedContraction(AccumulatorStore):
    """c[l, g] = x[l, rows of g]ᵀ · y[l, rows of g] (K, N) per batch l and group g, amax[l] = max|c[l]|: bf16 x
    (L, T, K) and y (L, T, N), f32 or bf16 c (L·G, K, N). The ABI: fn(x, y, bounds, c, amax, t, k, n, l, g, stream),
    bounds int32 (L, G, 2) the rows [start, end) of each group (kernels/catalog.py)."""

    def __init__(self, *, c_dtype: str = "float32"):
        common.require_choice("c_dtype", c_dtype, C_DTYPES)
        self.ab_dtype = cutlass.BFloat16
        self.acc_dtype = cutlass.Float32
        self.c_name = c_dtype
        self.c_dtype = cutlass.Float32 if c_dtype == "float32" else cutlass.BFloat16
        self.c_kind = "wide"
        self.has_alpha = False
        self.tile_mnk = (128, 128, 64)  # (rows of K, columns of N, tokens) per CTA and k-tile; A and B tiles alike
        self.threads_per_wg = 128
        self.num_consumer_warps = 8  # warps 0-7: the two MMA warpgroups
        self.producer_warp = self.num_consumer_warps
        self.threads_per_cta = (self.num_consumer_warps + 1) * 32
        self.epilogue_barrier_id = 1
        self.ctas_per_sm = 2
        self.ab_stages = 3
        self.buffer_align_bytes = 1024

    def can_implement(self, t: int, k: int, n: int, l: int, g: int = 1) -> tuple[bool, str]:
        """Whether the kernel handles these sizes, and why not: 16-byte rows (K and N multiples of 8), 32-bit element
        counts for x, y and one (K, N) result; c as a whole is addressed in 64 bits."""
        if min(t, k, n, l, g) < 1:
            return False, f"every size must be >= 1, got t={t}, k={k}, n={n}, l={l}, g={g}"
        for size, name in ((k, "k"), (n, "n")):
            if size % 8:
                return False, f"{name} must be a multiple of 8 (16-byte rows of bf16), got {name}={size}"
        if l * t * max(k, n) >= 2**31 or k * n >= 2**31 or l * g >= 2**31:
            return False, f"x, y and one (K, N) result must hold fewer than 2**31 elements, got t={t}, k={k}, n={n}"
        return True, ""

    @cute.jit
    def __call__(self, x: cute.Tensor, y: cute.Tensor, bounds: cute.Tensor, c: cute.Tensor, amax: cute.Tensor,
                 t: cutlass.Int32, k: cutlass.Int32, n: cutlass.Int32, l: cutlass.Int32, g: cutlass.Int32,
                 stream: cuda.CUstream):
        """Host side: x and y as (K or N, T, L) MN-major TMA views, and a launch of (K tiles, N tiles, L·G)."""
        bm, bn, bk = self.tile_mnk
        mA = common.operand_view(x, k, t, l, True, row_align=8)
        mB = common.operand_view(y, n, t, l, True, row_align=8)
        mn = cute.nvgpu.OperandMajorMode.MN
        tiled_mma = sm90_utils.make_trivial_tiled_mma(self.ab_dtype, self.ab_dtype, mn, mn, self.acc_dtype, (2, 1, 1),
                                                      tiler_mn=(64, bn))
        a_smem_staged = smem_layout_staged(bm, self.ab_dtype, self.ab_stages, bk, mn_major=True)
        b_smem_staged = smem_layout_staged(bn, self.ab_dtype, self.ab_stages, bk, mn_major=True)
        tma_atom_a, tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(a_smem_staged, (None, None, 0)), (bm, bk))
        tma_atom_b, tma_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mB, cute.slice_(b_smem_staged, (None, None, 0)), (bn, bk))

        @cute.struct
        class SharedStorage:
            pipeline_mbars: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            warp_amax: cute.struct.MemRange[cutlass.Int32, self.num_consumer_warps]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem_staged)],
                                  self.buffer_align_bytes]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem_staged)],
                                  self.buffer_align_bytes]

        self.shared_storage = SharedStorage
        self.kernel(tma_atom_a, tma_a, tma_atom_b, tma_b, bounds, c, amax, t, k, n, g, tiled_mma, a_smem_staged,
                    b_smem_staged).launch(
            grid=((k + bm - 1) // bm, (n + bn - 1) // bn, l * g), block=(self.threads_per_cta, 1, 1),
            min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=100, stream=stream)

    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor, tma_atom_b: cute.CopyAtom, mB_nkl: cute.Tensor,
               bounds: cute.Tensor, c: cute.Tensor, amax: cute.Tensor, t: cutlass.Int32, k: cutlass.Int32,
               n: cutlass.Int32, g: cutlass.Int32, tiled_mma: cute.TiledMma, a_smem_staged: cute.ComposedLayout,
               b_smem_staged: cute.ComposedLayout):
        """Device body: the group's rows as 64-token k-tiles from its first row (producer warp 8, MMA warps 0-7),
        the last k-tile's rows past the group zeroed, then the tile of c[l, g]."""
        tile_m, tile_n, lg = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bm, bn, bk = self.tile_mnk
        batch = lg // g
        start = cutlass.min(cutlass.max(bounds[lg * 2], 0), t)
        end = cutlass.min(cutlass.max(bounds[lg * 2 + 1], start), t)
        k_tiles = cutlass.max((end - start + bk - 1) // bk, 1)  # an empty group: one k-tile, masked whole
        valid = end - start - (k_tiles - 1) * bk  # rows of the group in its last k-tile (0 .. bk)
        # The views start at the group's first row: k-tile kt holds rows start + 64·kt ...
        mA_group = cute.domain_offset((0, start, 0), mA_mkl)
        mB_group = cute.domain_offset((0, start, 0), mB_nkl)
        storage, ab_pipeline, sA, sB, views, _, wg_idx = tma_pipeline.ab_prologue(
            tidx, warp_idx, tma_atom_a, mA_group, tma_atom_b, mB_group, a_smem_staged, b_smem_staged,
            self.shared_storage, self.ab_dtype, self.ab_stages, self.num_consumer_warps, self.tile_mnk,
            self.threads_per_wg)
        if warp_idx == self.producer_warp:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
            state = tma_pipeline.produce_tile(ab_pipeline, state, tma_atom_a, tma_atom_b, views, tile_m, tile_n,
                                              k_tiles, batch)
            ab_pipeline.producer_tail(state)
        elif warp_idx < self.producer_warp:
            thr_mma = tiled_mma.get_slice(wg_idx * self.threads_per_wg)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((bm, bn)), self.acc_dtype)
            acc.fill(0.0)
            num_k_steps = cute.size(tCrA, mode=[2])
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)  # acc starts from zero
            # k-tile 0, then 1 .. k_tiles - 1 keeping one wgmma group in flight (`wgmma_mainloop.issue_k_tiles`,
            # with the last k-tile's rows past the group zeroed first)
            ab_pipeline.consumer_wait(read_state)
            if k_tiles == 1:
                self.zero_rows_past(sA, sB, read_state.index, valid, tidx)
            wgmma_mainloop.issue_stage(tiled_mma, acc, tCrA, tCrB, num_k_steps, read_state.index)
            read_state.advance()
            for kt in range(1, k_tiles):
                ab_pipeline.consumer_wait(read_state)
                if kt == k_tiles - 1:
                    self.zero_rows_past(sA, sB, read_state.index, valid, tidx)
                wgmma_mainloop.issue_stage(tiled_mma, acc, tCrA, tCrB, num_k_steps, read_state.index)
                read_state.advance()
                cute.nvgpu.warpgroup.wait_group(1)  # the previous k-tile's group is done: free its stage
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            ab_pipeline.consumer_release(release_state)
            warp_amax = storage.warp_amax.get_tensor(cute.make_layout((self.num_consumer_warps,)))
            # c is (L·G, K, N): batch lg of (K, N) results; amax has one slot per l
            self.store_c_and_amax(acc, c, amax, amax, warp_amax, k, n, tile_m, tile_n, lg, batch, wg_idx, tidx,
                                  cutlass.Int32(0), k)

    @cute.jit
    def zero_rows_past(self, sA: cute.Tensor, sB: cute.Tensor, stage, valid, local_tid):
        """Zero tokens valid .. 63 of both operands' k-tile in `stage` (when valid < 64), then make the writes visible
        to the tensor cores and wait for every MMA thread (both warpgroups read all of B)."""
        bm, bn, bk = self.tile_mnk
        if valid < bk:
            zero = cutlass.BFloat16(0.0)
            for i in range(local_tid, (bk - valid) * bm, self.num_consumer_warps * 32):
                row, token = i % bm, valid + i // bm
                sA[(row, token, stage)] = zero
                sB[(row, token, stage)] = zero
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=_MASK_BARRIER_ID, number_of_threads=self.num_consumer_warps * 32)


__all__ = ["HopperGroupedContraction", "C_DTYPES"]
