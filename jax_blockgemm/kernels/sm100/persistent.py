"""The persistent warp-specialized skeleton every sm_100a kernel shares: one CTA (or cluster) per SM, each walking
tiles, with a producer warp (TMA), an MMA warp (tcgen05) and four epilogue warps.

`schedule` is host side (the grid and the scheduler's parameters for a tile count); `tile_scheduler` is device
side (each warp role builds its own scheduler and walks the same tiles in the same order). `PersistentKernel` holds
the warp roles and the parts of the device body that do not depend on the operation: the pipelines between the
roles, the producer's and the MMA warp's tile loops, and the epilogue warps' tensor-memory allocation around the
operation's own epilogue.

A loop's states (the scheduler, pipeline states, the MMA's accumulate flag) advance in the body of the loop that
carries them, in the same function: the DSL carries across dynamic loop iterations only what the loop body itself
mutates, so a helper called from a loop body must never advance a state of its caller's loop. Each loop here lives
whole, with its states, inside one method.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values
from cutlass.cute.nvgpu import tcgen05

from jax_blockgemm.kernels.sm100 import TMEM_COLUMNS

SchedulerParams = tuple  # the clusters of output tiles along (M, N, L), three Int32: what `schedule` gives the kernel


def schedule(tiles_mnl, cluster_mn: tuple[int, int], max_ctas: cutlass.Int32):
    """(scheduler parameters, launch grid) for `tiles_mnl` output tiles with at most `max_ctas` CTAs resident at
    once, a run-time Int32 the handler reads from the GPU (the grid is at least one cluster whatever it says).

    The grid is (cluster M, cluster N, clusters): one cluster of CTAs per grid z, each CTA of a cluster on its own
    tile of the cluster's (cluster M x cluster N) block of tiles (`tile_of`)."""
    clusters_mnl = tuple(cutlass.Int32(x) for x in
                         ((tiles_mnl[0] + cluster_mn[0] - 1) // cluster_mn[0],
                          (tiles_mnl[1] + cluster_mn[1] - 1) // cluster_mn[1], tiles_mnl[2]))
    wave = cutlass.max(max_ctas // (cluster_mn[0] * cluster_mn[1]), 1)
    grid = (*cluster_mn, cutlass.min(clusters_mnl[0] * clusters_mnl[1] * clusters_mnl[2], wave))
    return clusters_mnl, grid


def tile_of(index, clusters_mn, cluster_mn: tuple[int, int], cta_mn) -> tuple:
    """The (M, N, L) output tile of the CTA at `cta_mn` within its cluster when the cluster takes block `index` of
    the (clusters M, clusters N, L) blocks of tiles, M fastest. Plain arithmetic on Int32 (tests run it on ints)."""
    cluster_m = index % clusters_mn[0]
    rest = index // clusters_mn[0]
    return (cluster_m * cluster_mn[0] + cta_mn[0], rest % clusters_mn[1] * cluster_mn[1] + cta_mn[1],
            rest // clusters_mn[1])


class TileWalk:
    """Device side: the output tiles one CTA computes, a static persistent schedule. Cluster z of the grid takes
    blocks of tiles z, z + clusters, z + 2 clusters, ... below their count; each warp role builds its own walk and
    visits the same tiles in the same order, its loop carrying an Int32 index (`first`, then `+= stride`)."""

    def __init__(self, clusters_mnl: SchedulerParams, cluster_mn: tuple[int, int], cta_mn=None, first=None,
                 stride=None):
        """The walk of this CTA (block and grid indices read here); the other arguments rebuild a walk inside a
        loop that carries it (`__new_from_mlir_values__`)."""
        self.clusters_mnl, self.cluster_mn = tuple(clusters_mnl), cluster_mn
        if cta_mn is None:
            bidx, bidy, bidz = cute.arch.block_idx()
            cta_mn = (cutlass.Int32(bidx % cluster_mn[0]), cutlass.Int32(bidy % cluster_mn[1]))
            first, stride = cutlass.Int32(bidz), cutlass.Int32(cute.arch.grid_dim()[2])
        self.cta_mn, self.first, self.stride = tuple(cta_mn), first, stride
        self.count = self.clusters_mnl[0] * self.clusters_mnl[1] * self.clusters_mnl[2]

    def tile(self, index: cutlass.Int32) -> tuple:
        """(M tile, N tile, L) of block `index`, warp-uniform."""
        return tuple(cute.arch.make_warp_uniform(cutlass.Int32(x))
                     for x in tile_of(index, self.clusters_mnl, self.cluster_mn, self.cta_mn))

    def _values(self) -> list:
        return [*self.clusters_mnl, *self.cta_mn, self.first, self.stride]

    def __extract_mlir_values__(self) -> list:
        return [v for x in self._values() for v in extract_mlir_values(x)]

    def __new_from_mlir_values__(self, values: list) -> "TileWalk":
        x = [new_from_mlir_values(old, [v]) for old, v in zip(self._values(), values)]
        return TileWalk(x[0:3], self.cluster_mn, x[3:5], x[5], x[6])


class PersistentKernel:
    """Warp roles of one CTA of 6 warps and the operation-independent parts of its device body.

    A subclass sets, before its device body is traced: `acc_dtype`, `mma_tiler`, `ab_stages`,
    `acc_stages` and `tma_bytes` (the bytes one stage's TMA loads bring), and `overlapping_acc` when its two
    accumulator buffers share columns (one pipeline stage whose phase picks the buffer: `acc_buffer`).
    """

    def __init__(self):
        self.epilogue_warps = (0, 1, 2, 3)
        self.mma_warp = 4
        self.producer_warp = 5
        self.threads_per_cta = 32 * (len(self.epilogue_warps) + 2)
        self.epilogue_threads = 32 * len(self.epilogue_warps)
        self.epilogue_barrier_id = 1
        self.tmem_alloc_barrier = pipeline.NamedBarrier(barrier_id=2, num_threads=self.epilogue_threads + 32)
        self.tmem_columns_allocated = TMEM_COLUMNS  # the whole of tensor memory: one CTA per SM
        self.buffer_align_bytes = 1024
        self.overlapping_acc = False

    def acc_buffer(self, state, producer: bool):
        """The accumulator buffer a pipeline state refers to: its stage, or with overlapping buffers (one stage)
        its phase, which flips every tile (a producer's phase starts at 1, a consumer's at 0: both start on 0)."""
        if cutlass.const_expr(not self.overlapping_acc):
            return state.index
        return state.phase ^ 1 if producer else state.phase
    def _set_shared_storage(self, extra: dict, buffers: dict):
        """Builds `shared_storage` and `smem_bytes` (dynamic shared memory per CTA, reported by precompile): the
        pipelines' mbarriers and the tensor-memory address, the `extra` fields (name -> field type), then every
        stage buffer of `buffers` (name -> (dtype, staged layout)), 1 KB-aligned. From a field dict, not a `class`
        body: this module's annotations are strings (the __future__ import), which cute.struct does not evaluate."""
        fields = dict(ab_full=cute.struct.MemRange[cutlass.Int64, self.ab_stages],
                      ab_empty=cute.struct.MemRange[cutlass.Int64, self.ab_stages],
                      acc_full=cute.struct.MemRange[cutlass.Int64, self.acc_stages],
                      acc_empty=cute.struct.MemRange[cutlass.Int64, self.acc_stages],
                      tmem_holding=cutlass.Int32, **extra)
        for name, (dtype, staged) in buffers.items():
            fields[name] = cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(staged)], self.buffer_align_bytes]
        self.shared_storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        self.smem_bytes = self.shared_storage.size_in_bytes()

    def _make_pipelines(self, storage, cluster_layout_vmnk: cute.Layout, ab_consumers: int,
                        cluster_mn: tuple[int, int]):
        """(ab_pipeline, acc_pipeline, tmem): the stage pipeline from the producer's TMA loads to the MMA warp (a
        stage is free again once the MMAs of the `ab_consumers` CTAs that read it completed), the accumulator
        pipeline from the MMA warp to the epilogue warps, and the tensor-memory allocator (the first epilogue warp
        allocates). Arrives on the pipelines' init barrier; the kernel waits on it once its set-up is done."""
        ab_pipeline = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_full.data_ptr(), num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, ab_consumers),
            tx_count=self.tma_bytes, cta_layout_vmnk=cluster_layout_vmnk, defer_sync=True)
        acc_pipeline = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_full.data_ptr(), num_stages=self.acc_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, len(self.epilogue_warps)),
            cta_layout_vmnk=cluster_layout_vmnk, defer_sync=True)
        tmem = cutlass.memory.TmemAllocator(storage.tmem_holding.ptr, barrier_for_retrieve=self.tmem_alloc_barrier,
                                            allocator_warp_id=self.epilogue_warps[0])
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_mn, is_relaxed=True)
        return ab_pipeline, acc_pipeline, tmem

    def _mma_fragments(self, tiled_mma: cute.TiledMma, sA: cute.Tensor, sB: cute.Tensor, buffer_columns=None):
        """(tCrA, tCrB, tCtAcc_fake): the MMA's shared-memory descriptors of A and B, (MMA, MMA_MN, MMA_K, STAGE),
        and the layout of the accumulator buffers in tensor memory (at address 0; the real one comes from tmem).
        `buffer_columns`: with overlapping buffers, the column where the second one starts (else they follow each
        other)."""
        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        if cutlass.const_expr(buffer_columns is None):
            return tCrA, tCrB, tiled_mma.make_fragment_C(cute.append(acc_shape, self.acc_stages))
        two = tiled_mma.make_fragment_C(cute.append(acc_shape, 2))
        stride = (*two.stride[:3], buffer_columns * two.stride[0][1])
        return tCrA, tCrB, cute.make_tensor(two.iterator, cute.make_layout(two.shape, stride=stride))

    @cute.jit
    def _produce(self, ab_pipeline, sched_params: SchedulerParams, k_tiles, loads, batched: bool, plan=None):
        """The producer warp: for each of this CTA's tiles, for each k-tile, wait for a free stage and TMA every
        operand's k-tile into it. `loads`: per operand, (TMA atom, global view (copy, row tile, k-tile, L), shared
        view (copy, stage), 0 if its row tile is the tile's M index or 1 if its N index, multicast mask or None).
        batched=False reads L index 0 (the tile index's L is always 0 there). `plan`: None, or a function of the
        tile index giving ((M-side row tile, N-side row tile), (M-side L, N-side L), whether the tile has products:
        a tile without runs no k-tile)."""
        walk = TileWalk(sched_params, self.cluster_mn)
        index = walk.first
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        while index < walk.count:
            tile_m, tile_n, batch = walk.tile(index)
            rows, batches, count = (tile_m, tile_n), (batch, batch), k_tiles
            if cutlass.const_expr(plan is not None):
                rows, batches, active = plan(tile_m, tile_n, batch)
                count = cutlass.select_(active, k_tiles, 0)
            tiles = [load[1][(None, rows[load[3]], None, batches[load[3]] if batched else 0)] for load in loads]
            for kt in cutlass.range(0, count, 1, unroll=1):
                ab_pipeline.producer_acquire(state)
                bar = ab_pipeline.producer_get_barrier(state)
                for load, tile in zip(loads, tiles):
                    cute.copy(load[0], tile[(None, kt)], load[2][(None, state.index)], tma_bar_ptr=bar,
                              mcast_mask=load[4])
                state.advance()
            index += walk.stride
        ab_pipeline.producer_tail(state)

    @cute.jit
    def _mma(self, tiled_mma: cute.TiledMma, tCtAcc_base: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
             ab_pipeline, acc_pipeline, sched_params: SchedulerParams, k_tiles, scales=None, plan=None):
        """The MMA warp: for each of this CTA's tiles, take a free accumulator stage, and for each k-tile wait for
        its stage, issue its MMAs (the first of the tile overwrites, the rest accumulate) and release the stage
        when they complete (tcgen05.commit); then hand the accumulator stage to the epilogue.

        scales: None, or for the block-scaled MMA a pair (SFA, SFB) of (tcgen05.cp copy, its shared-memory source
        by stage, its tensor-memory destination, the MMA's tensor-memory view (.., .., k-block)): each k-tile's
        scales are copied to tensor memory before its MMAs read them. `plan`: as `_produce` takes it (a tile without
        products runs no k-tile and still hands its accumulator stage, unwritten, to the epilogue)."""
        num_kblocks = cute.size(tCrA, mode=[2])
        walk = TileWalk(sched_params, self.cluster_mn)
        index = walk.first
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.acc_stages)
        while index < walk.count:
            tCtAcc = tCtAcc_base[(None, None, None, self.acc_buffer(acc_state, producer=True))]
            acc_pipeline.producer_acquire(acc_state)
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            count = k_tiles
            if cutlass.const_expr(plan is not None):
                tile_m, tile_n, batch = walk.tile(index)
                count = cutlass.select_(plan(tile_m, tile_n, batch)[2], k_tiles, 0)
            for kt in cutlass.range(0, count, 1, unroll=1):
                ab_pipeline.consumer_wait(ab_state)
                if cutlass.const_expr(scales is not None):
                    for sf in scales:  # (s2t copy, source by stage, destination, MMA view)
                        cute.copy(sf[0], sf[1][(None, None, None, None, ab_state.index)], sf[2])
                for kb in cutlass.range(num_kblocks, unroll_full=True):
                    if cutlass.const_expr(scales is not None):
                        tiled_mma.set(tcgen05.Field.SFA, scales[0][3][(None, None, kb)].iterator)
                        tiled_mma.set(tcgen05.Field.SFB, scales[1][3][(None, None, kb)].iterator)
                    cute.gemm(tiled_mma, tCtAcc, tCrA[(None, None, kb, ab_state.index)],
                              tCrB[(None, None, kb, ab_state.index)], tCtAcc)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                ab_pipeline.consumer_release(ab_state)  # tcgen05.commit: frees the stage when the MMAs end
                ab_state.advance()
            acc_pipeline.producer_commit(acc_state)
            acc_state.advance()
            index += walk.stride
        acc_pipeline.producer_tail(acc_state)

    def _with_tmem(self, tmem, acc_layout: cute.Layout, epilogue):
        """The epilogue warps around `epilogue(tCtAcc_base)`: allocate tensor memory (the MMA warp waits for it),
        run the epilogue on the accumulator stages (`acc_layout` at the allocation), then free the allocation once
        every epilogue warp is done with it."""
        tmem.allocate(self.tmem_columns_allocated)
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(self.acc_dtype)
        epilogue(cute.make_tensor(acc_ptr, acc_layout))
        tmem.relinquish_alloc_permit()
        cute.arch.barrier(barrier_id=self.epilogue_barrier_id, number_of_threads=self.epilogue_threads)
        tmem.free(acc_ptr)
