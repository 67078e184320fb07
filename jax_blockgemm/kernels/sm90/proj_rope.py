"""Hopper (sm_90a) gemm_proj_rope_mxfp8: Y = x·Wᵀ per head, RoPE, rowwise and columnwise MXFP8, in one kernel.

One CTA computes a (64·consumer_wgs)-token x 192-feature tile: exactly one head, so RoPE and both quantizations
finish inside it and Y never leaves the registers. A producer warp streams bf16 x and W tiles with TMA through an
mbarrier pipeline; each consumer warpgroup (64 tokens) runs bf16 wgmma into fp32 accumulators, keeping one wgmma
group in flight. The codes are staged in W's pipeline buffers once every wgmma of the CTA is done, which leaves
room for a deep pipeline: with two consumer warpgroups, one CTA of 5 stages fills the SM; with one, two CTAs of 3
stages share it, so one CTA's epilogue overlaps the other's mainloop.
The epilogue (kernels/epilogue.py does the math) works on the wgmma fragment: value (v0, v1, j) of a thread is token
16·warp + lane/4 + 8·v1 and feature 8·j + 2·(lane%4) + v0 of its warpgroup's 64 x 192 slice. So a RoPE pair
(p[2i], p[2i+1]) sits in one thread; a rowwise block of 32 features is 8 values of each of a quad's 4 lanes; a
columnwise block of 32 tokens is 2 values x 8 quads of a warp, then the partner warp through shared memory. Codes go
through shared memory so that each token's 192 bytes leave as 16-byte stores; scale bytes are stored directly.

w_major "k" reads w as (H·192, K) (`w_out_in=True`), "n" as (K, H·192): only the TMA view and the shared-memory
layout of B differ. cluster_t > 1 launches clusters of that many consecutive token tiles of one head: each CTA loads
1/cluster_t of every W tile and multicasts it to the cluster (W is 3/4 of the bytes a 64-token CTA reads), and a
stage is refilled only once every CTA of the cluster has released it. Phases are marked `producer`, `mainloop`, `rope`, `rowwise`, `columnwise`, `store`.

schedule="pingpong" (`kernel_pingpong`): a persistent kernel, min(tiles, PERSISTENT_CTAS) CTAs of 384 threads (one
per SM: registers 40 / 232 / 232 by setmaxnreg). Tiles are 64 tokens x one head, numbered head-major (tile_t fastest,
so the CTAs running at once share a head's W in L2); CTA c takes tiles c, c + grid, c + 2·grid, ... (its tiles
i = 0, 1, ..., n-1, n >= 1). Warp 0 streams every k-tile of those tiles, in that order, through `ab_stages` (5)
x/W stages. Consumer warpgroup w (0 or 1) owns its own 64 x 192 fp32 accumulator and runs tiles i = w, w + 2, ...:
mainloop, then the same epilogue as the other schedule (`_epilogue`), with its own code tiles (64 x 208 bytes, rows
and columns) outside the pipeline's buffers, so while one warpgroup runs its epilogue the other issues wgmmas.
Barrier protocol (every count holds on every path: a CTA's tile count n is known to all its threads, tiles past T
only mask stores, and a warpgroup with no tile (n = 1, w = 1) touches no barrier but the init one):
- mbarrier pipeline (PipelineTmaAsync): full[s] completes by the producer's arrive.expect_tx + the TMA bytes; empty[s]
  needs 4 arrivals, one per warp of the one warpgroup that read stage s. Each warpgroup walks the stages in the
  producer's order: it starts k_tiles·w stages in, and after each of its tiles advances past the other warpgroup's
  k_tiles, so both read/release states stay in step with the producer's state (n·k_tiles stages in all).
- order barrier, named barriers 3 + w ("warpgroup w may issue its mainloop"), 256 threads = bar.sync of the 128
  threads of w + bar.arrive of the 128 of the other: before tile i > 0, warpgroup i % 2 syncs on 3 + i % 2; after
  issuing tile i's last wgmma and if i + 1 < n, it arrives on 3 + (i + 1) % 2. So there are n - 1 syncs and n - 1
  arrives, matched one to one (tile i's arrive with tile i + 1's sync), and a warpgroup cannot arrive twice on a
  barrier before the other synced on it (its next arrive follows its own next sync, which needs the other's arrive):
  no arrival is ever left pending at exit.
- named barriers 1 + w (128 threads, warpgroup w only): the columnwise exchange and the store inside the epilogue, and
  one at its start (the previous tile's store has read the code tiles before they are rewritten).
- named barrier 0: the pipeline init (all 384 threads, once).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils import LayoutEnum

from jax_blockgemm.kernels import common, epilogue
from jax_blockgemm.kernels.sm90 import tma_pipeline
from jax_blockgemm.support import HEAD_DIM, MX_BLOCK, QK_NOPE, QK_ROPE

W_MAJORS = ("k", "n")
TILE_K = 64  # bf16: one 128-byte swizzle row
CONSUMER_WGS = (1, 2)
CLUSTER_T = (1, 2, 4)  # CTAs (consecutive token tiles of one head) sharing each W tile through TMA multicast
_ROW_PAD = 16  # shared-memory code rows of 192 + 16 bytes: the quads of a warp hit different banks
SCHEDULES = ("", "pingpong")  # "": one tile per CTA; "pingpong": persistent, consumer warpgroups on alternate tiles
SMEM_BYTES = 227 * 1024  # the most dynamic shared memory one sm_90 CTA may use
PERSISTENT_CTAS = 132  # ping-pong grid: at most this many CTAs (one per SM of an H100/H200 SXM)
_ORDER_BARRIER0 = 3  # ping-pong: named barrier 3 + w = "consumer warpgroup w may issue its mainloop" (1, 2: per-wg)


class HopperProjRope:
    """Fused MLA Q up-projection for bf16 x and W on sm_90a (SPEC §5): E4M3 codes + E8M0 scales, both ways.

    Compile-time configuration only; T, K and H are run-time scalars of the exported function.
    """

    def __init__(self, *, x_dtype: str = "bfloat16", w_major: str = "k", consumer_wgs: int = 2, cluster_t: int = 1,
                 schedule: str = "", persistent_ctas: int = PERSISTENT_CTAS):
        common.require_choice("x_dtype", x_dtype, ("bfloat16",))
        common.require_choice("schedule", schedule, SCHEDULES)
        if schedule == "pingpong" and (consumer_wgs, cluster_t) != (2, 1):
            raise ValueError(f"schedule='pingpong' runs two consumer warpgroups without clusters, got "
                             f"consumer_wgs={consumer_wgs}, cluster_t={cluster_t}")
        self.schedule = schedule
        self.persistent_ctas = persistent_ctas
        # Profiling only (benchmarks/proj_rope_standalone.py --profile): phases to leave out, from {"mma", "epilogue",
        # "stores"} (the wgmmas; the whole epilogue; the code tiles' global stores). The results are then wrong;
        # never set in the catalog.
        self._skip: frozenset = frozenset()
        common.require_choice("w_major", w_major, W_MAJORS)
        common.require_choice("consumer_wgs", consumer_wgs, CONSUMER_WGS)
        common.require_choice("cluster_t", cluster_t, CLUSTER_T)
        # cluster_t > 1: each CTA loads 1/cluster_t of the W tile and multicasts it to the cluster, which divides
        # W's traffic from L2 into shared memory (most of the bytes a CTA reads) by cluster_t.
        self.cluster_t = cluster_t
        self.ab_dtype = cutlass.BFloat16
        self.acc_dtype = cutlass.Float32
        self.w_major = w_major
        self.num_consumer_wgs = consumer_wgs
        self.tile_mnk = (64 * consumer_wgs, HEAD_DIM, TILE_K)
        self.atom_layout_mnk = (consumer_wgs, 1, 1)  # consumer warpgroups stacked along tokens
        self.threads_per_wg = 128
        self.num_consumer_warps = 4 * self.num_consumer_wgs
        self.threads_per_cta = (1 + self.num_consumer_wgs) * self.threads_per_wg
        self.code_row_bytes = HEAD_DIM + _ROW_PAD
        self.producer_regs = 40
        if consumer_wgs == 2:  # one CTA per SM: 5 x 40 KB of bf16 tiles
            self.ctas_per_sm, self.consumer_regs, self.ab_stages = 1, 232, 5
        else:  # two CTAs per SM: 64K registers and 227 KB of shared memory split in two (3 x 32 KB each)
            self.ctas_per_sm, self.consumer_regs, self.ab_stages = 2, 208, 3
        b_buffer_bytes = HEAD_DIM * TILE_K * self.ab_dtype.width // 8 * self.ab_stages
        assert 2 * self.tile_mnk[0] * self.code_row_bytes <= b_buffer_bytes  # both code tiles fit W's buffers
        self.buffer_align_bytes = 1024
        if schedule == "pingpong":
            # Each consumer warpgroup owns a 64-token tile and its 64 x 192 accumulator; the pipeline never drains,
            # so each warpgroup stages its codes (row and column tiles of 64 x 208 bytes) outside W's buffers, and
            # the stages take what is left of the 227 KB (5 x 32 KB).
            self.tile_mnk = (64, HEAD_DIM, TILE_K)
            self.atom_layout_mnk = (1, 1, 1)
            self.codes_bytes_per_wg = 2 * 64 * self.code_row_bytes
            stage_bytes = (64 + HEAD_DIM) * TILE_K * self.ab_dtype.width // 8
            fixed = (self.num_consumer_wgs * self.codes_bytes_per_wg + self.num_consumer_warps * HEAD_DIM * 4
                     + 3 * self.buffer_align_bytes)  # + mbarriers and the two 1 KB-aligned buffers' padding
            self.ab_stages = (SMEM_BYTES - fixed) // stage_bytes
            assert self.ab_stages >= 2, self.ab_stages

    # Whether the kernel handles these sizes, and why not (the caller checks before launching).
    can_implement = staticmethod(common.proj_rope_can_implement)

    # ------------------------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor, x_scale: cute.Tensor,
                 w_scale: cute.Tensor, row_codes: cute.Tensor, row_scales: cute.Tensor, col_codes: cute.Tensor,
                 col_scales: cute.Tensor, t: cutlass.Int32, k: cutlass.Int32, h: cutlass.Int32,
                 stream: cuda.CUstream):
        """Host side: (rows, K)-shaped views of x and W, the TMA atoms, the launch. x_scale/w_scale: unused here."""
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
        tma_atom_a, tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(a_smem_staged, (None, None, 0)),
            (self.tile_mnk[0], self.tile_mnk[2]))
        if cutlass.const_expr(self.cluster_t == 1):
            tma_atom_b, tma_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mB, cute.slice_(b_smem_staged, (None, None, 0)),
                (self.tile_mnk[1], self.tile_mnk[2]))
        else:
            tma_atom_b, tma_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp(), mB,
                cute.slice_(b_smem_staged, (None, None, 0)), (self.tile_mnk[1], self.tile_mnk[2]),
                num_multicast=self.cluster_t)
        self.shared_storage = self._shared_storage(a_smem_staged, b_smem_staged)
        args = (tma_atom_a, tma_a, tma_atom_b, tma_b, cos, sin, row_codes, row_scales, col_codes, col_scales, t, h,
                tiled_mma, a_smem_staged, b_smem_staged)
        tiles_t = (t + self.tile_mnk[0] - 1) // self.tile_mnk[0]
        # preferred_smem_carveout=100: all of the SM's memory as shared memory
        if cutlass.const_expr(self.schedule == "pingpong"):  # min(tiles, persistent_ctas) CTAs, one per SM
            ctas = cutlass.min(tiles_t * h, cutlass.Int32(self.persistent_ctas))
            self.kernel_pingpong(*args).launch(grid=(ctas, 1, 1), block=(self.threads_per_cta, 1, 1),
                                               min_blocks_per_mp=1, preferred_smem_carveout=100, stream=stream)
        elif cutlass.const_expr(self.cluster_t == 1):
            self.kernel(*args).launch(grid=(tiles_t, h, 1), block=(self.threads_per_cta, 1, 1),
                                      min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=100, stream=stream)
        else:  # whole clusters: a CTA past T loads its share of W for the others and stores nothing
            tiles_t = (tiles_t + self.cluster_t - 1) // self.cluster_t * self.cluster_t
            self.kernel(*args).launch(grid=(tiles_t, h, 1), block=(self.threads_per_cta, 1, 1),
                                      cluster=(self.cluster_t, 1, 1), min_blocks_per_mp=self.ctas_per_sm,
                                      preferred_smem_carveout=100, stream=stream)

    def _shared_storage(self, a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout):
        """The CTA's shared-memory struct: the stage pipeline's mbarriers, the columnwise amax exchange, with
        schedule="pingpong" each consumer warpgroup's own code tiles, then the x and W stages (1 KB-aligned).
        Built from a field dict: a `class` body here would keep its annotations as strings (module's __future__
        import), which cute.struct does not evaluate."""
        fields = dict(pipeline_mbars=cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2],
                      col_amax=cute.struct.MemRange[cutlass.Int32, self.num_consumer_warps * HEAD_DIM])
        if self.schedule == "pingpong":
            fields["codes"] = cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, self.num_consumer_wgs * self.codes_bytes_per_wg], 128]
        for name, staged in (("sA", a_smem_staged), ("sB", b_smem_staged)):
            fields[name] = cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(staged)],
                                             self.buffer_align_bytes]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    # ---------------------------------------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor, tma_atom_b: cute.CopyAtom,
               mB_nkl: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor, row_codes: cute.Tensor,
               row_scales: cute.Tensor, col_codes: cute.Tensor, col_scales: cute.Tensor, t: cutlass.Int32,
               h: cutlass.Int32, tiled_mma: cute.TiledMma, a_smem_staged: cute.ComposedLayout,
               b_smem_staged: cute.ComposedLayout):
        """Device body: warpgroup 0 produces (TMA), warpgroups 1-2 consume (wgmma + the fused epilogue)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tile_t, head, _ = cute.arch.block_idx()
        bm = self.tile_mnk[0]
        storage, ab_pipeline, sA, sB, views, k_tiles, wg_idx = tma_pipeline.ab_prologue(
            tidx, warp_idx, tma_atom_a, mA_mkl, tma_atom_b, mB_nkl, a_smem_staged, b_smem_staged, self.shared_storage,
            self.ab_dtype, self.ab_stages, self.num_consumer_warps, (self.cluster_t, 1), self.tile_mnk,
            self.threads_per_wg)

        if wg_idx == 0:
            # ------------------------------------------------------------------------------ producer
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
                for kt in range(k_tiles):
                    tma_pipeline.load_k_tile(ab_pipeline, state, tma_atom_a, tma_atom_b, views, tile_t, head, kt,
                                             multicast=self.cluster_t)
                    state.advance()
                ab_pipeline.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            wg, wg_tid, warp, lane, quad, row0, tCrA, tCrB, acc = self._consumer_operands(tidx, wg_idx, tiled_mma,
                                                                                          sA, sB)
            acc.fill(0.0)
            num_k_steps = 0 if "mma" in self._skip else cute.size(tCrA, mode=[2])

            # The rotary tables of this thread's two tokens, loaded before the mainloop so their latency hides.
            rope_tab = cute.make_rmem_tensor((2, QK_ROPE // 8, 4), cutlass.BFloat16)
            self._load_rope_tab(rope_tab, cos, sin, tile_t * bm, row0, quad, t)

            # ------------------------------------------------------------------------------ mainloop
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)  # acc starts at zero
            read_state, release_state = self._issue_k_tiles(ab_pipeline, read_state, release_state, tiled_mma, acc,
                                                            tCrA, tCrB, num_k_steps, k_tiles)
            cute.nvgpu.warpgroup.wait_group(0)
            ab_pipeline.consumer_release(release_state)

            def stage_codes():
                # The code tiles live in W's pipeline buffers: free once every consumer warpgroup's wgmmas are done
                # (all loads were consumed, so the producer writes no more).
                if cutlass.const_expr(self.num_consumer_wgs > 1):
                    cute.arch.barrier(barrier_id=1 + self.num_consumer_wgs,
                                      number_of_threads=self.num_consumer_wgs * self.threads_per_wg)
                code_layout = cute.make_layout((bm, self.code_row_bytes), stride=(self.code_row_bytes, 1))
                b_bytes = cute.recast_ptr(storage.sB.data_ptr(), dtype=cutlass.Uint8)
                return (cute.make_tensor(b_bytes, code_layout),
                        cute.make_tensor(b_bytes + cute.cosize(code_layout), code_layout))

            if cutlass.const_expr("epilogue" not in self._skip):
                self._epilogue(acc, rope_tab, stage_codes, storage, row_codes, row_scales, col_codes, col_scales,
                               tile_t * bm, wg * 64, row0, wg, warp, lane, quad, wg_tid, t, h, head)

    # ------------------------------------------------------------------------------------ ping-pong (persistent)
    @cute.kernel
    def kernel_pingpong(self, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor, tma_atom_b: cute.CopyAtom,
                        mB_nkl: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor, row_codes: cute.Tensor,
                        row_scales: cute.Tensor, col_codes: cute.Tensor, col_scales: cute.Tensor, t: cutlass.Int32,
                        h: cutlass.Int32, tiled_mma: cute.TiledMma, a_smem_staged: cute.ComposedLayout,
                        b_smem_staged: cute.ComposedLayout):
        """Device body of the ping-pong schedule (module docstring: the barrier protocol). Warp 0 produces the
        k-tiles of this CTA's tiles cta, cta + grid, cta + 2·grid, ... in that order; consumer warpgroup w takes its
        tiles i = w, w + 2, ... (i counts this CTA's tiles)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        bm = self.tile_mnk[0]
        tiles_t = (t + bm - 1) // bm
        my_tiles = (tiles_t * h - 1 - cta) // n_ctas + 1  # >= 1: the grid is at most the tile count
        # A stage is read by one consumer warpgroup: its 4 warps release it.
        storage, ab_pipeline, sA, sB, views, k_tiles, wg_idx = tma_pipeline.ab_prologue(
            tidx, warp_idx, tma_atom_a, mA_mkl, tma_atom_b, mB_nkl, a_smem_staged, b_smem_staged, self.shared_storage,
            self.ab_dtype, self.ab_stages, 4, (self.cluster_t, 1), self.tile_mnk, self.threads_per_wg)

        if wg_idx == 0:
            # ------------------------------------------------------------------------------ producer
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
                for i in range(my_tiles):
                    tile = cta + i * n_ctas  # head-major: consecutive CTAs share W's head in L2
                    tile_t = tile % tiles_t
                    head = tile // tiles_t
                    for kt in range(k_tiles):
                        tma_pipeline.load_k_tile(ab_pipeline, state, tma_atom_a, tma_atom_b, views, tile_t, head,
                                                 kt, multicast=self.cluster_t)
                        state.advance()
                ab_pipeline.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            wg, wg_tid, warp, lane, quad, row0, tCrA, tCrB, acc = self._consumer_operands(tidx, wg_idx, tiled_mma,
                                                                                          sA, sB)
            num_k_steps = 0 if "mma" in self._skip else cute.size(tCrA, mode=[2])
            rope_tab = cute.make_rmem_tensor((2, QK_ROPE // 8, 4), cutlass.BFloat16)

            # This warpgroup's own code tiles (rows, then columns), outside the pipeline's buffers.
            code_layout = cute.make_layout((bm, self.code_row_bytes), stride=(self.code_row_bytes, 1))
            own_codes = storage.codes.data_ptr() + cute.assume(wg * self.codes_bytes_per_wg, divby=128)
            sRow_own = cute.make_tensor(own_codes, code_layout)
            sCol_own = cute.make_tensor(own_codes + cute.cosize(code_layout), code_layout)

            def stage_codes():
                # The previous tile's store (every thread of this warpgroup) has read the code tiles.
                cute.arch.barrier(barrier_id=1 + wg, number_of_threads=self.threads_per_wg)
                return sRow_own, sCol_own

            # Stages are consumed in the producer's order: warpgroup 1 starts after warpgroup 0's first tile, and
            # each warpgroup skips the other's k-tiles after each of its own tiles.
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            read_state.advance(k_tiles * wg)
            release_state.advance(k_tiles * wg)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)  # acc is zeroed per tile
            for it in range((my_tiles + 1 - wg) // 2):
                i = 2 * it + wg
                tile = cta + i * n_ctas
                tile_t = tile % tiles_t
                head = tile // tiles_t
                self._load_rope_tab(rope_tab, cos, sin, tile_t * bm, row0, quad, t)
                acc.fill(0.0)
                # ------------------------------------------------------------------------------ mainloop
                if i > 0:  # the other warpgroup has issued every wgmma of tile i - 1
                    cute.arch.barrier(barrier_id=_ORDER_BARRIER0 + wg, number_of_threads=2 * self.threads_per_wg)
                read_state, release_state = self._issue_k_tiles(ab_pipeline, read_state, release_state, tiled_mma,
                                                                acc, tCrA, tCrB, num_k_steps, k_tiles)
                if i + 1 < my_tiles:  # hand the tensor cores to the other warpgroup's tile i + 1
                    cute.arch.barrier_arrive(barrier_id=_ORDER_BARRIER0 + 1 - wg,
                                             number_of_threads=2 * self.threads_per_wg)
                cute.nvgpu.warpgroup.wait_group(0)
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
                read_state.advance(k_tiles)  # the other warpgroup's tile i + 1
                release_state.advance(k_tiles)
                if cutlass.const_expr("epilogue" not in self._skip):
                    self._epilogue(acc, rope_tab, stage_codes, storage, row_codes, row_scales, col_codes, col_scales,
                                   tile_t * bm, 0, row0, wg, warp, lane, quad, wg_tid, t, h, head)

    def _consumer_operands(self, tidx, wg_idx, tiled_mma, sA, sB):
        """A consumer thread's place and wgmma operands: (wg, wg_tid, warp, lane, quad, row0, tCrA, tCrB, acc).
        row0 is this thread's first token (+8 the second) in the CTA's tile, whose 64-token slices are the
        warpgroups' (default schedule), or in its warpgroup's own tile (ping-pong); acc is not zeroed."""
        wg = wg_idx - 1
        wg_tid = tidx % self.threads_per_wg
        warp = wg_tid // 32
        lane = tidx % 32
        quad = lane % 4
        if self.schedule == "pingpong":
            row0 = warp * 16 + lane // 4
            thr_mma = tiled_mma.get_slice(0)
        else:
            row0 = wg * 64 + warp * 16 + lane // 4
            thr_mma = tiled_mma.get_slice(wg * self.threads_per_wg)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C(self.tile_mnk[:2]), self.acc_dtype)
        return wg, wg_tid, warp, lane, quad, row0, tCrA, tCrB, acc

    @cute.jit
    def _epilogue(self, acc, rope_tab, stage_codes, storage, row_codes, row_scales, col_codes, col_scales, token0,
                  row_base, row0, wg, warp, lane, quad, wg_tid, t, h, head):
        """RoPE, rowwise and columnwise MXFP8 of one warpgroup's 64 x 192 fragment `acc` (tokens token0 + row_base +
        0..63 of head `head`), codes through shared memory, every store predicated on token < t. Inlined into the
        kernel at trace time. `stage_codes()` synchronizes as the schedule needs and returns the (rows, 208)-byte row and
        column code tiles this warpgroup writes at rows row_base..row_base+63; row0 is this thread's first row there."""
        half = QK_ROPE // 2
        # ------------------------------------------------------------------------------ rope
        # Feature groups j >= 16 hold the rope pairs: (v0=0, v1, j) <- out[128+i], (v0=1, v1, j) <- out[160+i].
        n_groups = HEAD_DIM // 8
        rope_group0 = QK_NOPE // 8
        for v1 in cutlass.range_constexpr(2):
            for q in cutlass.range_constexpr(n_groups - rope_group0):
                i0 = 4 * (rope_group0 + q) + 2 * v1
                first, second = epilogue.rope_pair(
                    acc[i0], acc[i0 + 1], rope_tab[v1, q, 0].to(cutlass.Float32),
                    rope_tab[v1, q, 1].to(cutlass.Float32), rope_tab[v1, q, 2].to(cutlass.Float32),
                    rope_tab[v1, q, 3].to(cutlass.Float32))
                acc[i0] = first
                acc[i0 + 1] = second

        sRow, sCol = stage_codes()
        sRow16 = cute.recast_tensor(sRow, cutlass.Uint16)
        sCol16 = cute.recast_tensor(sCol, cutlass.Uint16)
        n_blocks = HEAD_DIM // MX_BLOCK

        # ------------------------------------------------------------------------------ rowwise
        # Block b < 4 holds groups 4b..4b+3 (both v0); block 4 the v0=0 rope values, block 5 the v0=1 ones.
        for v1 in cutlass.range_constexpr(2):
            r = row0 + 8 * v1
            token = token0 + r
            for b in cutlass.range_constexpr(n_blocks):
                bits = cutlass.Int32(0)
                for j, v0 in self._row_block_members(b):
                    bits = cutlass.max(bits, common.abs_bits(acc[v0 + 2 * v1 + 4 * j]))
                byte, inv, bad = epilogue.e8m0_scale(epilogue.lane_max(bits, 0, 2))
                if (quad == 0) & (token < t):
                    row_scales[(token * h + head) * n_blocks + b] = byte.to(cutlass.Uint8)
                if cutlass.const_expr(b < QK_NOPE // MX_BLOCK):
                    for j in cutlass.range_constexpr(4 * b, 4 * b + 4):
                        i = 2 * v1 + 4 * j
                        codes = epilogue.quantize_pair(acc[i], acc[i + 1], inv, inv, bad, bad)
                        sRow16[r, (8 * j + 2 * quad) // 2] = codes.to(cutlass.Uint16)
                else:
                    v0 = b - QK_NOPE // MX_BLOCK
                    for q in cutlass.range_constexpr(n_groups - rope_group0):
                        codes = epilogue.quantize_pair(acc[v0 + 2 * v1 + 4 * (rope_group0 + q)], 0.0, inv, inv,
                                                       bad, bad)
                        sRow[r, QK_NOPE + half * v0 + 4 * q + quad] = codes.to(cutlass.Uint8)

        # ------------------------------------------------------------------------------ columnwise
        # A column block is 32 tokens = this warp's 16 rows (2 values x 8 quads) and the partner warp's.
        col_amax = storage.col_amax.get_tensor(cute.make_layout((self.num_consumer_warps, HEAD_DIM),
                                                                stride=(HEAD_DIM, 1)))
        warp_slot = wg * 4 + warp
        for j in cutlass.range_constexpr(n_groups):
            for v0 in cutlass.range_constexpr(2):
                bits = cutlass.max(common.abs_bits(acc[v0 + 4 * j]), common.abs_bits(acc[v0 + 2 + 4 * j]))
                bits = epilogue.lane_max(bits, 2, 3)
                if lane < 4:
                    col_amax[warp_slot, self._feature(j, v0, quad)] = bits
        cute.arch.barrier(barrier_id=1 + wg, number_of_threads=self.threads_per_wg)
        block_token0 = token0 + row_base + (warp // 2) * MX_BLOCK
        for j in cutlass.range_constexpr(n_groups):
            f0 = self._feature(j, 0, quad)
            f1 = self._feature(j, 1, quad)
            byte0, inv0, bad0 = epilogue.e8m0_scale(
                cutlass.max(col_amax[warp_slot, f0], col_amax[warp_slot ^ 1, f0]))
            byte1, inv1, bad1 = epilogue.e8m0_scale(
                cutlass.max(col_amax[warp_slot, f1], col_amax[warp_slot ^ 1, f1]))
            if (warp % 2 == 0) & (lane < 4) & (block_token0 < t):
                scale_row = ((block_token0 // MX_BLOCK) * h + head) * HEAD_DIM
                col_scales[scale_row + f0] = byte0.to(cutlass.Uint8)
                col_scales[scale_row + f1] = byte1.to(cutlass.Uint8)
            for v1 in cutlass.range_constexpr(2):
                r = row0 + 8 * v1
                i = 2 * v1 + 4 * j
                codes = epilogue.quantize_pair(acc[i], acc[i + 1], inv0, inv1, bad0, bad1)
                if cutlass.const_expr(j < rope_group0):
                    sCol16[r, f0 // 2] = codes.to(cutlass.Uint16)
                else:
                    sCol[r, f0] = (codes & 0xFF).to(cutlass.Uint8)
                    sCol[r, f1] = (codes >> 8).to(cutlass.Uint8)

        # ------------------------------------------------------------------------------ store
        # This warpgroup's 64 rows of both code tiles leave as 16-byte chunks: 12 per token row.
        cute.arch.barrier(barrier_id=1 + wg, number_of_threads=self.threads_per_wg)
        chunks_per_row = HEAD_DIM // 16
        sRow32 = cute.recast_tensor(sRow, cutlass.Int32)
        sCol32 = cute.recast_tensor(sCol, cutlass.Int32)
        out_row32 = cute.make_tensor(cute.recast_ptr(row_codes.iterator, dtype=cutlass.Int32),
                                     cute.make_layout((cute.size(row_codes) // 4,)))
        out_col32 = cute.make_tensor(cute.recast_ptr(col_codes.iterator, dtype=cutlass.Int32),
                                     cute.make_layout((cute.size(col_codes) // 4,)))
        stores = 0 if "stores" in self._skip else 64 * chunks_per_row // self.threads_per_wg
        for rep in cutlass.range_constexpr(stores):
            idx = wg_tid + rep * self.threads_per_wg
            r = row_base + idx // chunks_per_row
            chunk = idx % chunks_per_row
            token = token0 + r
            if token < t:
                dst = ((token * h + head) * HEAD_DIM + 16 * chunk) // 4
                for wd in cutlass.range_constexpr(4):
                    out_row32[dst + wd] = sRow32[r, 4 * chunk + wd]
                    out_col32[dst + wd] = sCol32[r, 4 * chunk + wd]


    @staticmethod
    @cute.jit
    def _load_rope_tab(rope_tab, cos, sin, token0, row0, quad, t):
        """The rotary tables of this thread's two tokens (token0 + row0, +8), loaded before the mainloop so their
        latency hides: entry (v1, q, c) is c = 0: cos[t, i], 1: sin[t, i], 2: cos[t, 32+i], 3: sin[t, 32+i],
        i = 4q + quad. Tail rows read a valid row, unused."""
        half = QK_ROPE // 2
        for v1 in cutlass.range_constexpr(2):
            token = cutlass.min(token0 + row0 + 8 * v1, t - 1)
            for q in cutlass.range_constexpr(QK_ROPE // 8):
                base = token * QK_ROPE + 4 * q + quad
                rope_tab[v1, q, 0] = cos[base]
                rope_tab[v1, q, 1] = sin[base]
                rope_tab[v1, q, 2] = cos[base + half]
                rope_tab[v1, q, 3] = sin[base + half]

    @cute.jit
    def _issue_k_tiles(self, ab_pipeline, read_state, release_state, tiled_mma, acc, tCrA, tCrB, num_k_steps: int,
                       k_tiles):
        """One tile's mainloop: the wgmmas of its k_tiles stages, one committed group per k-tile, keeping one group in
        flight; each stage is released once the next k-tile's group is issued and its own is done. The last group is
        left in flight and its stage held: the caller waits for it and releases that stage.

        Returns the advanced (read_state, release_state), which the caller must rebind: the DSL carries a state that
        a dynamic loop advances by rebinding the loop's own names, so the caller's objects keep their old values."""
        self.mma_k_tile(ab_pipeline, read_state, tiled_mma, acc, tCrA, tCrB, num_k_steps)
        read_state.advance()
        for kt in range(1, k_tiles):
            # Pipeline states advance in the loop body itself: the DSL carries only what the body mutates.
            self.mma_k_tile(ab_pipeline, read_state, tiled_mma, acc, tCrA, tCrB, num_k_steps)
            read_state.advance()
            cute.nvgpu.warpgroup.wait_group(1)  # the previous k-tile's group is done: free its stage
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
        return read_state, release_state

    @staticmethod
    def mma_k_tile(ab_pipeline, read_state, tiled_mma, acc, tCrA, tCrB, num_k_steps: int):
        """Wait for one k-tile's stage and issue its wgmma steps as one committed group (not waited for)."""
        ab_pipeline.consumer_wait(read_state)
        cute.nvgpu.warpgroup.fence()
        for ks in range(num_k_steps):  # plain Python: this helper is inlined at trace time
            cute.gemm(tiled_mma, acc, tCrA[(None, None, ks, read_state.index)],
                      tCrB[(None, None, ks, read_state.index)], acc)
        cute.nvgpu.warpgroup.commit_group()

    @staticmethod
    def _feature(j: int, v0: int, quad):
        """Output feature of fragment value (v0, j) after RoPE: 8j + 2·quad + v0, or 128 + 32·v0 + 4(j-16) + quad."""
        if j < QK_NOPE // 8:
            return 8 * j + 2 * quad + v0
        return QK_NOPE + (QK_ROPE // 2) * v0 + 4 * (j - QK_NOPE // 8) + quad

    @staticmethod
    def _row_block_members(b: int) -> list[tuple[int, int]]:
        """The (group j, v0) fragment values of rowwise block b held by one thread for one token (8 of them)."""
        if b < QK_NOPE // MX_BLOCK:
            return [(j, v0) for j in range(4 * b, 4 * b + 4) for v0 in range(2)]
        return [(j, b - QK_NOPE // MX_BLOCK) for j in range(QK_NOPE // 8, HEAD_DIM // 8)]
