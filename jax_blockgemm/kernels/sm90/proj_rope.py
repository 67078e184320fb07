"""Hopper (sm_90a) gemm_proj_rope_mxfp8: Y = x·Wᵀ per head, RoPE, rowwise and columnwise MXFP8, in one kernel.

A persistent kernel: min(tiles, SMs) CTAs of 512 threads, each taking the 128-token x one-head tiles cta, cta + grid,
... in head-major order (token tile fastest, so the CTAs running at once share a few heads' W in L2). One tile is
exactly one head, so RoPE and both quantizations finish inside the CTA. Four warpgroups:
- warpgroup 0 (40 registers): warp 0 streams the bf16 x and W k-tiles of every tile of the CTA through an mbarrier
  pipeline of 3 (W (H·192, K), 64-wide k-tiles) or 6 (W (K, H·192), 32-wide) stages by TMA, without a pause between
  tiles;
- warpgroups 1-2 (128 registers: 96 accumulators): each runs bf16 wgmma on one 64-token half of every stage,
  keeping one wgmma group in flight, then writes its fp32 fragment to the tile Y in shared memory (96 KB,
  kernels/sm90/y_tile.py) and goes on with the next tile;
- warpgroup 3 (216 registers): the epilogue from Y, one thread per token (`kernel_staged`'s docstring; the per-row
  code is kernels/token_rows.py, shared with sm_100a); the codes leave through TMA stores.

The launch uses programmatic dependent launch: its CTAs may start while the previous kernel on the stream finishes,
and every thread waits for that grid (`griddepcontrol.wait`) after the prologue, before its first global access.

w_major "k" reads w as (H·192, K) (`w_out_in=True`), "n" as (K, H·192): only the TMA view, the shared-memory layout
of B and the k-tile differ. Measurements and the designs this one replaced: docs/design/proj_rope.md.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils import LayoutEnum

from jax_blockgemm.kernels import common, token_rows
from jax_blockgemm.kernels.sm90 import tma_pipeline, wgmma_mainloop, y_tile
from jax_blockgemm.support import HEAD_DIM, MX_BLOCK

W_MAJORS = ("k", "n")
# The k-tile per W layout. With W (K, N), 32-wide k-tiles (twice the stages of half the bytes) keep W's rows
# 128-byte swizzled along N and more loads in flight; with W (N, K) they would be 64-byte swizzled K rows, slower
# (docs/design/proj_rope.md).
TILE_K = {"k": 64, "n": 32}
SMEM_BYTES = 227 * 1024  # the most dynamic shared memory one sm_90 CTA may use
# Named barriers between the two MMA warpgroups (256 threads) and the epilogue warpgroup (128)
_Y_FULL, _Y_EMPTY = 1, 2  # "the fp32 tile is in shared memory", "the epilogue has read it"
_Y_BARRIER_THREADS = 384


class HopperProjRope:
    """Fused MLA Q up-projection for bf16 x and W on sm_90a (SPEC §5): E4M3 codes + E8M0 scales, both ways.

    Compile-time configuration only; T, K and H are run-time scalars of the exported function.
    """

    def __init__(self, *, x_dtype: str = "bfloat16", w_major: str = "k"):
        common.require_choice("x_dtype", x_dtype, ("bfloat16",))
        common.require_choice("w_major", w_major, W_MAJORS)
        self.ab_dtype = cutlass.BFloat16
        self.acc_dtype = cutlass.Float32
        self.w_major = w_major
        self.num_consumer_wgs = 2  # the MMA warpgroups
        self.tile_mnk = (64 * self.num_consumer_wgs, HEAD_DIM, TILE_K[w_major])
        self.atom_layout_mnk = (self.num_consumer_wgs, 1, 1)  # MMA warpgroups stacked along tokens
        self.threads_per_wg = 128
        self.num_consumer_warps = 4 * self.num_consumer_wgs
        self.threads_per_cta = (2 + self.num_consumer_wgs) * self.threads_per_wg  # + producer and epilogue
        self.buffer_align_bytes = 1024
        # 512 threads, 128 registers each at launch: the producer gives 88 of its own to the epilogue warpgroup
        # (216), the MMA warpgroups keep 128 (96 accumulators). Shared memory: the fp32 tile (96 KB), then as many
        # x + W stages as fit (3 of 40 KB, or 6 of 20 KB).
        self.producer_regs, self.consumer_regs, self.epilogue_regs = 40, 128, 216
        assert self.producer_regs + 2 * self.consumer_regs + self.epilogue_regs <= 65536 // self.threads_per_wg
        assert self.tile_mnk[0] == y_tile.ROWS
        self.y_bytes = y_tile.BYTES
        stage_bytes = (self.tile_mnk[0] + HEAD_DIM) * self.tile_mnk[2] * self.ab_dtype.width // 8
        self.ab_stages = (SMEM_BYTES - self.y_bytes - 3 * self.buffer_align_bytes) // stage_bytes
        assert self.ab_stages >= 2, self.ab_stages

    # Whether the kernel handles these sizes, and why not (the caller checks before launching).
    can_implement = staticmethod(common.proj_rope_can_implement)

    # ------------------------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor, x_scale: cute.Tensor,
                 w_scale: cute.Tensor, row_codes: cute.Tensor, row_scales: cute.Tensor, col_codes: cute.Tensor,
                 col_scales: cute.Tensor, t: cutlass.Int32, k: cutlass.Int32, h: cutlass.Int32,
                 sms: cutlass.Int32, stream: cuda.CUstream):
        """Host side: (rows, K)-shaped views of x and W, the TMA atoms, the launch of min(tiles, sms) CTAs.
        x_scale/w_scale: unused here; sms: the device's SM count."""
        k8 = cute.assume(k, divby=8)
        n = cute.assume(h * HEAD_DIM, divby=64)
        mA = cute.make_tensor(x.iterator, cute.make_layout((t, k8, 1), stride=(k8, 1, t * k8)))
        if cutlass.const_expr(self.w_major == "k"):
            mB = cute.make_tensor(w.iterator, cute.make_layout((n, k8, 1), stride=(k8, 1, n * k8)))
            b_layout = LayoutEnum.ROW_MAJOR
        else:
            mB = cute.make_tensor(w.iterator, cute.make_layout((n, k8, 1), stride=(1, n, n * k8)))
            b_layout = LayoutEnum.COL_MAJOR

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, cute.nvgpu.OperandMajorMode.K, b_layout.sm90_mma_major_mode(),
            self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, HEAD_DIM))
        a_smem_staged = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, self.tile_mnk, self.ab_dtype,
                                                      self.ab_stages)
        b_smem_staged = sm90_utils.make_smem_layout_b(b_layout, self.tile_mnk, self.ab_dtype, self.ab_stages)
        tma_atom_a, tma_a = tma_pipeline.load_atom(mA, a_smem_staged, (self.tile_mnk[0], self.tile_mnk[2]))
        tma_atom_b, tma_b = tma_pipeline.load_atom(mB, b_smem_staged, (self.tile_mnk[1], self.tile_mnk[2]))
        self.shared_storage = self._shared_storage(a_smem_staged, b_smem_staged)
        tiles_t = (t + self.tile_mnk[0] - 1) // self.tile_mnk[0]
        ctas = cutlass.min(tiles_t * h, sms)
        # the codes leave through TMA stores
        (row_atom, row_tma), (col_atom, col_tma) = (y_tile.code_box_tma(c, t, h) for c in (row_codes, col_codes))
        # preferred_smem_carveout=100: all of the SM's memory as shared memory
        self.kernel_staged(tma_atom_a, tma_a, tma_atom_b, tma_b, cos, sin, row_codes, row_scales, col_codes,
                           col_scales, t, h, tiled_mma, a_smem_staged, b_smem_staged, row_atom, row_tma, col_atom,
                           col_tma).launch(
            grid=(ctas, 1, 1), block=(self.threads_per_cta, 1, 1), min_blocks_per_mp=1, preferred_smem_carveout=100,
            stream=stream, use_pdl=True)

    def _shared_storage(self, a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout):
        """The CTA's shared-memory struct: the stage pipeline's mbarriers, the fp32 tile Y, the epilogue warps'
        column factors, then the x and W stages (1 KB-aligned). Built from a field dict: a `class` body here would
        keep its annotations as strings (module's __future__ import), which cute.struct does not evaluate."""
        fields = dict(pipeline_mbars=cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2])
        # the fp32 tile the MMA warpgroups hand to the epilogue warpgroup (1 KB-aligned: the TMA stores' 32-byte
        # swizzle reads address bit 7 of the code boxes inside it)
        fields["y"] = cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.y_bytes // 4], 1024]
        # each epilogue warp's 32 columnwise scale factors of the block at hand
        fields["col_inv"] = cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 4 * MX_BLOCK], 16]
        for name, staged in (("sA", a_smem_staged), ("sB", b_smem_staged)):
            fields[name] = cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(staged)],
                                             self.buffer_align_bytes]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    # ---------------------------------------------------------------------------------------------- device
    @cute.kernel
    def kernel_staged(self, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor, tma_atom_b: cute.CopyAtom,
                      mB_nkl: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor, row_codes: cute.Tensor,
                      row_scales: cute.Tensor, col_codes: cute.Tensor, col_scales: cute.Tensor, t: cutlass.Int32,
                      h: cutlass.Int32, tiled_mma: cute.TiledMma, a_smem_staged: cute.ComposedLayout,
                      b_smem_staged: cute.ComposedLayout, row_atom: cute.CopyAtom, row_tma: cute.Tensor,
                      col_atom: cute.CopyAtom, col_tma: cute.Tensor):
        """Device body (its name, part of the exported symbol, is the design's: the fp32 tile is staged in shared
        memory): the producer (warpgroup 0), the MMA warpgroups (1-2), which write each fp32 tile Y to shared
        memory (`y_tile.write_fragment`), and the epilogue warpgroup (3), which works from there while the MMA
        warpgroups compute the next tile. Thread i of the epilogue warpgroup owns token i of the tile: it rotates its
        row's 64 rope features in place in Y (`y_tile.rope_in_place`), then for each 32-feature block reads its row
        (rowwise block, reduced in the thread) and, as lane l of its warp, feature 32b + l of the warp's 32 rows
        (columnwise block), publishes that column's factor in a per-warp table and quantizes both ways
        (`token_rows`, the sm_100a kernel's per-row code). No shuffles: the column maxima come from 4-byte loads
        that each read one row's block for the whole warp, conflict-free (tests/test_proj_rope_staged_layout.py).
        The block's codes go into the warp's now free 4 KB of Y as two 32-token boxes, which TMA stores take to
        global memory; the rowwise scale bytes leave as whole 6-byte runs per token, the columnwise ones as 32 bytes
        per warp and block.
        Barriers per tile: the MMA warpgroups arrive on _Y_FULL after writing Y and, from the second tile on, sync
        on _Y_EMPTY before writing it; the epilogue warpgroup syncs on _Y_FULL before reading Y and arrives on
        _Y_EMPTY once the TMA has read its last code boxes, except in its last tile (n arrivals and syncs on
        _Y_FULL, n - 1 on _Y_EMPTY, 384 threads each)."""
        (tidx, warp_idx, cta, n_ctas, tiles_t, my_tiles, storage, ab_pipeline, sA, sB, views, k_tiles,
         wg_idx) = self._prologue(tma_atom_a, mA_mkl, tma_atom_b, mB_nkl, a_smem_staged, b_smem_staged, t, h)
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()  # the previous grid's writes (x, w) are visible from here on
        bm = self.tile_mnk[0]
        y = storage.y.data_ptr().toint()

        if wg_idx == 0:
            # ------------------------------------------------------------------------------ producer
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self._produce_tiles(ab_pipeline, tma_atom_a, tma_atom_b, views, cta, n_ctas, my_tiles, tiles_t,
                                    k_tiles)
        elif wg_idx <= self.num_consumer_wgs:
            # ------------------------------------------------------------------------------ mainloop
            row0, quad, tCrA, tCrB, acc = self._mma_operands(tidx, wg_idx, tiled_mma, sA, sB)
            num_k_steps = cute.size(tCrA, mode=[2])
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)  # acc is zeroed per tile
            for i in range(my_tiles):
                read_state, release_state = wgmma_mainloop.mma_tile(ab_pipeline, read_state, release_state,
                                                                    tiled_mma, acc, tCrA, tCrB, num_k_steps, k_tiles)
                if i > 0:  # the epilogue warpgroup holds the previous tile in registers
                    cute.arch.barrier(barrier_id=_Y_EMPTY, number_of_threads=_Y_BARRIER_THREADS)
                y_tile.write_fragment(acc, y, row0, quad)
                cute.arch.barrier_arrive(barrier_id=_Y_FULL, number_of_threads=_Y_BARRIER_THREADS)
        else:
            # ------------------------------------------------------------------------------ epilogue
            cute.arch.setmaxregister_increase(self.epilogue_regs)
            tid = tidx - (1 + self.num_consumer_wgs) * self.threads_per_wg  # token tid of every tile
            lane = tid % 32
            warp = tid // 32
            _, _, cos32, sin32 = token_rows.word_views(row_codes, col_codes, cos, sin)
            col_tab = storage.col_inv.data_ptr().toint() + warp * (MX_BLOCK * 4)  # this warp's 32 column factors
            column_offsets = y_tile.column_offsets(lane)
            y_warp = y + y_tile.warp_offset(warp)  # the warp's 32 rows of Y
            code_atoms = (row_atom, col_atom)
            # block b's code boxes: in the warp's block-b region of Y, free once the block is read
            code_views = y_tile.code_box_views(storage.y.data_ptr(), code_atoms, (row_tma, col_tma))
            row_addrs = y_tile.row_addresses(y, tid)  # the thread's token row
            for i in range(my_tiles):
                tile = cta + i * n_ctas
                tile_t = tile % tiles_t
                head = tile // tiles_t
                token = tile_t * bm + tid
                live = token < t  # uniform over a warp: T is a multiple of 32
                rcos, rsin = token_rows.load_rope_tables(cos32, sin32, token, t)
                col_scale0 = token_rows.col_scale_index(tile_t, warp, lane, head, h)
                warp_token0 = tile_t * bm + 32 * warp
                cute.arch.barrier(barrier_id=_Y_FULL, number_of_threads=_Y_BARRIER_THREADS)
                y_tile.rope_in_place(row_addrs, rcos, rsin)
                cute.arch.sync_warp()  # each lane reads its columns across the warp's 32 rows
                row_lo, row_hi = cutlass.Int32(0), cutlass.Int32(0)  # the token's 6 rowwise scale bytes
                for b in range(HEAD_DIM // MX_BLOCK):  # a loop, not unrolled: unrolled it spills
                    vals = y_tile.read_row_block(row_addrs, b)
                    col = y_tile.read_column(y_warp, b, column_offsets)
                    col_byte, col_inv, col_bad_mask = y_tile.column_scales(col, col_tab, lane)
                    col_words = token_rows.col_code_words(vals, col_inv, col_bad_mask)
                    row_byte, row_words = token_rows.row_quantize(vals)
                    row_lo, row_hi = y_tile.add_row_scale(row_lo, row_hi, row_byte, b)
                    if live:  # lane l: column 32b + l's byte, 32 consecutive bytes per warp
                        col_scales[col_scale0 + b * MX_BLOCK] = col_byte.to(cutlass.Uint8)
                    # every lane's reads of block b are done (the table's barriers): the block's 4 KB of the warp's
                    # region take its codes, which two TMA stores take out
                    y_tile.stage_code_boxes(y_warp + b * y_tile.BLOCK_REGION, lane, row_words, col_words)
                    y_tile.store_code_boxes(code_atoms, code_views, warp, b, head, warp_token0, live)
                y_tile.store_row_scales(row_lo, row_hi, lane, live, row_scales, warp_token0, head, h)
                y_tile.wait_code_boxes()
                if i + 1 < my_tiles:
                    # the last reads of Y are issued, the TMA has read the code boxes, and a barrier orders both
                    # before the other side's writes
                    cute.arch.barrier_arrive(barrier_id=_Y_EMPTY, number_of_threads=_Y_BARRIER_THREADS)

    @cute.jit
    def _prologue(self, tma_atom_a, mA_mkl, tma_atom_b, mB_nkl, a_smem_staged, b_smem_staged, t, h):
        """What the kernel starts with: this thread's and CTA's place, the token tile count and this CTA's tile
        count (tiles cta, cta + grid, ...), and `tma_pipeline.ab_prologue` with stages released by the 8 MMA warps.
        Returns (tidx, warp_idx, cta, n_ctas, tiles_t, my_tiles, storage, ab_pipeline, sA, sB, views, k_tiles,
        wg_idx)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        bm = self.tile_mnk[0]
        tiles_t = (t + bm - 1) // bm
        my_tiles = (tiles_t * h - 1 - cta) // n_ctas + 1  # >= 1: the grid is at most the tile count
        storage, ab_pipeline, sA, sB, views, k_tiles, wg_idx = tma_pipeline.ab_prologue(
            tidx, warp_idx, tma_atom_a, mA_mkl, tma_atom_b, mB_nkl, a_smem_staged, b_smem_staged, self.shared_storage,
            self.ab_dtype, self.ab_stages, self.num_consumer_warps, self.tile_mnk, self.threads_per_wg)
        return (tidx, warp_idx, cta, n_ctas, tiles_t, my_tiles, storage, ab_pipeline, sA, sB, views, k_tiles,
                wg_idx)

    @cute.jit
    def _produce_tiles(self, ab_pipeline, tma_atom_a, tma_atom_b, views, cta, n_ctas, my_tiles, tiles_t, k_tiles):
        """The producer (warp 0): every k-tile of this CTA's tiles cta, cta + n_ctas, ..., in that order. Tiles are
        numbered head-major (token tile fastest), so the CTAs running at once share a few heads' W in L2."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        for i in range(my_tiles):
            tile = cta + i * n_ctas
            state = tma_pipeline.produce_tile(ab_pipeline, state, tma_atom_a, tma_atom_b, views, tile % tiles_t,
                                              tile // tiles_t, k_tiles)
        ab_pipeline.producer_tail(state)

    def _mma_operands(self, tidx, wg_idx, tiled_mma, sA, sB):
        """An MMA thread's place and wgmma operands: (row0, quad, tCrA, tCrB, acc). row0 is this thread's first token
        (+8 the second) in the CTA's tile, whose 64-token halves are the two warpgroups'; acc is not zeroed."""
        wg = wg_idx - 1
        warp = (tidx % self.threads_per_wg) // 32
        lane = tidx % 32
        quad = lane % 4
        thr_mma = tiled_mma.get_slice(wg * self.threads_per_wg)
        row0 = wg * 64 + warp * 16 + lane // 4
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C(self.tile_mnk[:2]), self.acc_dtype)
        return row0, quad, tCrA, tCrB, acc
