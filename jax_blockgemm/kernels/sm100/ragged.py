"""Blackwell (sm_100a) ragged gemm_amax: the mixture-of-experts product with the block-scaled tcgen05 MMA.

COMPILED AND CHECKED HERE, NEVER RUN: no Blackwell GPU was available when this was written. A B200 uses it only
after the first-use self-check (`jax_blockgemm.selfcheck`, the ragged problems) has compared it with the reference
there; `implementation=None` keeps the reference on 10.x (arch.TABLE) until `python -m jax_blockgemm.tune --op
ragged` has measured it faster on that GPU model.

The work items are the Hopper kernel's (`kernels/sm90/ragged.py`, `ragged.kernel_items`): item i is a 128-row tile
of the token grid, a group and the rows [first, end) of that tile the group holds. The warp roles and pipelines are
the sm_100a gemm_amax kernel's (`BlackwellBlockScaledGemmAmax.roles`) with a plan per output tile (item, N tile, L):
A and SFA are loaded at the item's row tile of batch l, B and SFB at the N tile of weight l·G + group, and an item
with no rows or of no group (-1) runs no k-tile. The epilogue stores each element itself, only the item's rows (a
row tile shared by two groups is two items, each writing its own rows: no atomics, deterministic), zeros for the
rows of no group; C's TMA store, which writes whole sub-tiles, cannot. One CTA per output tile (the grid is every
item's tiles; the ragged ABI carries no SM count for a persistent grid).
"""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from jax_blockgemm.kernels import common
from jax_blockgemm.kernels.sm100 import persistent
from jax_blockgemm.kernels.sm100.gemm_amax import BlackwellBlockScaledGemmAmax, scale_layout
from jax_blockgemm.kernels.sm90.ragged import ITEM_ROWS, BlockScaledGroups, work_item

RAGGED_TILE_MN = (128, 128)  # one item (128 rows) by 128 columns; no cluster (each item has its own weight)


class BlackwellRaggedGemmAmax(BlockScaledGroups, BlackwellBlockScaledGemmAmax):
    """C[rows of group g] = alpha[l]·(A·sfa)(B[g]·sfb)^T per batch l, amax[l] = max|C[l]|, K-major MXFP8, MXFP4
    or NVFP4 operands, f32 or bf16 C.

    The ragged ABI (`kernels/sm90/ragged.HopperRaggedGemmAmax`): fn(a, b, sfa, sfb, items, c, amax, alpha, t, n, k,
    l, g, max_items, stream), alpha ones for the MX formats.
    """

    def __init__(self, *, ab_dtype: str = "float8_e4m3fn", c_dtype: str = "float32", sf_vec_size: int = 32,
                 sf_dtype: str = "float8_e8m0fnu"):
        super().__init__(ab_dtype=ab_dtype, c_dtype=c_dtype, tile_mn=RAGGED_TILE_MN, cluster_mn=(1, 1),
                         sf_vec_size=sf_vec_size, sf_dtype=sf_dtype)
        self.has_alpha = True  # the ragged ABI always carries alpha
        self.takes_grid_ctas = False  # ... and no max_ctas: one CTA per output tile
        assert self.tile_mn[0] == ITEM_ROWS and not self.overlapping_acc

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, items: cute.Tensor,
                 c: cute.Tensor, amax: cute.Tensor, alpha: cute.Tensor, t: cutlass.Int32, n: cutlass.Int32,
                 k: cutlass.Int32, l: cutlass.Int32, g: cutlass.Int32, max_items: cutlass.Int32,
                 stream: cuda.CUstream):
        """Host side: A as L batches of (T, K), B as L·G of (N, K), their scale atoms, C (T, N, L); one CTA per
        (item, N tile, batch)."""
        self._setup()
        k16 = cute.assume(k, divby=self.k_align)
        mA = common.operand_view(a, t, k16, l, False)
        mB = common.operand_view(b, n, k16, l * g, False)
        n16 = cute.assume(n, divby=self.c_per_16_bytes)
        mC = cute.make_tensor(c.iterator, cute.make_layout((t, n16, l), stride=(n16, 1, t * n16)))
        mSFA = cute.make_tensor(cute.recast_ptr(sfa.iterator, dtype=self.sf_dtype),
                                scale_layout(mA.shape, self.sf_vec_size))
        mSFB = cute.make_tensor(cute.recast_ptr(sfb.iterator, dtype=self.sf_dtype),
                                scale_layout(mB.shape, self.sf_vec_size))
        operands = self.operand_atoms(mA, mB, mSFA, mSFB)
        tiles_n = (n + self.tile_mn[1] - 1) // self.tile_mn[1]
        sched_params, grid = persistent.schedule((max_items, tiles_n, l), self.cluster_mn, max_items * tiles_n * l)
        self.set_stage_storage(c_staging=False)  # the epilogue stores C itself
        self.ragged_kernel(self.tiled_mma, *operands[0], *operands[1], *operands[2], *operands[3], items, mC, amax,
                           alpha, t, g, max_items, self.cluster_layout_vmnk, self.a_smem_staged, self.b_smem_staged,
                           self.sfa_smem_staged, self.sfb_smem_staged, self.epi_tile, sched_params).launch(
            grid=grid, block=(self.threads_per_cta, 1, 1), cluster=(1, 1, 1), min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def ragged_kernel(self, tiled_mma: cute.TiledMma, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor,
                      tma_atom_b: cute.CopyAtom, mB_nkl: cute.Tensor, tma_atom_sfa: cute.CopyAtom,
                      mSFA_mkl: cute.Tensor, tma_atom_sfb: cute.CopyAtom, mSFB_nkl: cute.Tensor, items: cute.Tensor,
                      mC_mnl: cute.Tensor, amax: cute.Tensor, alpha: cute.Tensor, t: cutlass.Int32,
                      g: cutlass.Int32, max_items: cutlass.Int32, cluster_layout_vmnk: cute.Layout,
                      a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
                      sfa_smem_staged: cute.Layout, sfb_smem_staged: cute.Layout, epi_tile: cute.Tile,
                      sched_params: persistent.SchedulerParams):
        """Device body: gemm_amax's warp roles with the items' plan and the row-predicated epilogue."""
        tidx, _, _ = cute.arch.thread_idx()
        plan = functools.partial(self.item_plan, items, t, g, max_items)
        self.roles(tiled_mma, ((tma_atom_a, mA_mkl), (tma_atom_b, mB_nkl), (tma_atom_sfa, mSFA_mkl),
                               (tma_atom_sfb, mSFB_nkl)), (), cluster_layout_vmnk,
                   (a_smem_staged, b_smem_staged, sfa_smem_staged, sfb_smem_staged), epi_tile, sched_params,
                   lambda tCtAcc_base, storage, acc_pipeline: self._rows_epilogue(
                       tiled_mma, epi_tile, tidx, tCtAcc_base, mC_mnl, amax, alpha, storage, acc_pipeline,
                       sched_params, items, t, g, max_items),
                   plan=plan)

    def item_plan(self, items: cute.Tensor, t, g, max_items, item, tile_n, batch) -> tuple:
        """The plan of output tile (item, tile_n, batch) (`PersistentKernel._produce`): A and SFA at the item's row
        tile of the batch, B and SFB at the N tile of weight batch·G + group; products only for an item with rows
        and a group."""
        row_tile, group, rows_lo, rows_hi = work_item(items, batch, item, max_items, t, g)
        return (row_tile, tile_n), (batch, batch * g + cutlass.max(group, 0)), (rows_lo < rows_hi) & (group >= 0)

    @cute.jit
    def _rows_epilogue(self, tiled_mma: cute.TiledMma, epi_tile: cute.Tile, tidx: cutlass.Int32,
                       tCtAcc_base: cute.Tensor, mC_mnl: cute.Tensor, amax: cute.Tensor, alpha: cute.Tensor, storage,
                       acc_pipeline, sched_params: persistent.SchedulerParams, items: cute.Tensor, t: cutlass.Int32,
                       g: cutlass.Int32, max_items: cutlass.Int32):
        """Per output tile and epilogue sub-tile: tensor memory -> registers, alpha, and each element of the item's
        rows (and below N) stored to C and folded into amax; zeros for an item of no group (its accumulator was not
        written); then amax into amax[l]. Every tile takes and returns its accumulator stage, as the MMA warp hands
        each one over."""
        t2r, tTR_tAcc_base, gC_epi, tTR_cC_all, tTR_rAcc = self.accumulator_reads(tiled_mma, epi_tile, tidx,
                                                                                  tCtAcc_base, mC_mnl)
        tTR_gC_all = t2r.get_slice(tidx).partition_D(gC_epi)  # C by element, as the registers hold it
        n = mC_mnl.shape[1]
        subtiles = self.tile_mn[1] // cute.size(epi_tile[1])

        walk = persistent.TileWalk(sched_params, self.cluster_mn)
        index = walk.first
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.acc_stages)
        while index < walk.count:
            item, tile_n, batch = walk.tile(index)
            row_tile, group, rows_lo, rows_hi = work_item(items, batch, item, max_items, t, g)
            buffer = self.acc_buffer(acc_state, producer=False)
            tTR_tAcc = cute.group_modes(tTR_tAcc_base[(None, None, None, None, None, buffer)], 3, 5)
            tTR_gC = cute.group_modes(tTR_gC_all[(None, None, None, None, None, row_tile, tile_n, batch)], 3, 5)
            tTR_cC = cute.group_modes(tTR_cC_all[(None, None, None, None, None, row_tile, tile_n, batch)], 3, 5)
            acc_pipeline.consumer_wait(acc_state)
            amax_bits = cutlass.Int32(0)
            for sub in cutlass.range(subtiles):
                cute.copy(t2r, tTR_tAcc[(None, None, None, sub)], tTR_rAcc)
                cute.arch.fence_view_async_tmem_load()  # tcgen05.ld is asynchronous: wait before reading
                cC = tTR_cC[(None, None, None, sub)]
                gC = tTR_gC[(None, None, None, sub)]
                for i in cutlass.range_constexpr(cute.size(tTR_rAcc)):
                    row, col = cC[i][0], cC[i][1]
                    # an item of no group has no products: its rows are zeros (the accumulator holds stale values)
                    value = cutlass.select_(group >= 0, tTR_rAcc[i] * alpha[batch], cutlass.Float32(0.0))
                    if (row >= rows_lo) & (row < rows_hi) & (col < n):
                        gC[i] = value.to(self.c_dtype)
                        amax_bits = cutlass.max(amax_bits, common.abs_bits(value))
            # The accumulator stage is in registers now: hand it back to the MMA warp before the reduction.
            with cute.arch.elect_one():
                acc_pipeline.consumer_release(acc_state)
            acc_state.advance()
            self.publish_tile_amax(amax_bits, storage, amax, batch, tidx)
            index += walk.stride
