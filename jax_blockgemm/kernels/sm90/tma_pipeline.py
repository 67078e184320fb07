"""The TMA side every Hopper kernel here shares: an A+B stage pipeline from a producer warp to consumer warps, the
TMA views of one operand, the kernel prologue that sets both up, and the producer's load of one k-tile. Inlined into
each kernel body at trace time. One CTA per cluster: no multicast."""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

_NO_CLUSTER = (1, 1)


def load_atom(operand: cute.Tensor, smem_staged: Any, tile: tuple):
    """Host side: (TMA load atom, its view of `operand`) copying `tile` blocks of the (rows, K, L) operand into the
    stages of `smem_staged`."""
    return cute.nvgpu.cpasync.make_tiled_tma_atom(cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), operand,
                                                  cute.slice_(smem_staged, (None, None, 0)), tile)


def make_ab_pipeline(barrier_ptr: Any, a_smem_staged: Any, b_smem_staged: Any, dtype: Any, stages: int,
                     consumer_warps: int) -> pipeline.PipelineTmaAsync:
    """`stages` A+B buffers filled by one TMA thread (the transaction count is one A and one B tile) and released
    by `consumer_warps` warps; also arrives on the pipeline's init barrier (the caller waits on it). `dtype` is
    both operands' element type, or an (A type, B type) pair."""
    a_dtype, b_dtype = dtype if isinstance(dtype, tuple) else (dtype, dtype)
    tma_bytes = (cute.size_in_bytes(a_dtype, cute.slice_(a_smem_staged, (None, None, 0)))
                 + cute.size_in_bytes(b_dtype, cute.slice_(b_smem_staged, (None, None, 0))))
    ab_pipeline = pipeline.PipelineTmaAsync.create(
        barrier_storage=barrier_ptr, num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=tma_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
    pipeline.pipeline_init_arrive(cluster_shape_mn=_NO_CLUSTER, is_relaxed=True)
    return ab_pipeline


def tma_views(tma_atom: cute.CopyAtom, operand: cute.Tensor, smem: cute.Tensor, tile: tuple[int, int]):
    """(shared, global) TMA views of one operand: its (rows, K, L) tensor cut into `tile` = (rows, k) tiles, indexed
    (copy, row tile, k tile, batch) globally and (copy, stage) in shared memory."""
    tiles = cute.local_tile(operand, tile, (None, None, None))  # (bRows, bK, RestRows, RestK, L)
    return cute.nvgpu.cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2),
                                            cute.group_modes(tiles, 0, 2))


@cute.jit
def ab_prologue(tidx, warp_idx, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor, tma_atom_b: cute.CopyAtom,
                mB_nkl: cute.Tensor, a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
                shared_storage: Any, dtype: Any, stages: int, consumer_warps: int,
                tile_mnk: tuple, threads_per_wg: int, b_tile_k: int = 0):
    """Everything before a Hopper kernel's warp roles split: the TMA descriptors' prefetch (warp 0), the shared
    storage (`shared_storage`, a cute.struct with fields pipeline_mbars, sA and sB), the A+B stage pipeline
    (`make_ab_pipeline`; `dtype` as there), the TMA views of (tile_mnk[0], tile_mnk[2]) A tiles and (tile_mnk[1],
    b_tile_k or tile_mnk[2]) B tiles (b_tile_k: B's elements per k-tile where they differ from A's, e.g. bytes of
    packed FP4 codes) and the pipeline's init barrier. Returns (storage, ab_pipeline, sA, sB, (tAsA, tAgA, tBsB,
    tBgB), k_tiles, wg_idx). Pipeline states are made and advanced by the caller, in its own loops."""
    bm, bn, bk = tile_mnk
    if warp_idx == 0:
        cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
        cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)

    smem = cutlass.memory.SmemAllocator()
    storage = smem.allocate(shared_storage)
    ab_pipeline = make_ab_pipeline(storage.pipeline_mbars.data_ptr(), a_smem_staged, b_smem_staged, dtype, stages,
                                   consumer_warps)

    sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
    sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
    tAsA, tAgA = tma_views(tma_atom_a, mA_mkl, sA, (bm, bk))
    tBsB, tBgB = tma_views(tma_atom_b, mB_nkl, sB, (bn, b_tile_k or bk))
    k_tiles = cute.size(tAgA, mode=[2])

    wg_idx = cute.arch.make_warp_uniform(tidx // threads_per_wg)
    pipeline.pipeline_init_wait(cluster_shape_mn=_NO_CLUSTER)
    return storage, ab_pipeline, sA, sB, (tAsA, tAgA, tBsB, tBgB), k_tiles, wg_idx


def load_k_tile(ab_pipeline: Any, state: Any, tma_atom_a: cute.CopyAtom, tma_atom_b: cute.CopyAtom, views: tuple,
                a_tile: Any, b_tile: Any, kt: Any, batch: Any = 0, b_batch: Any = None) -> None:
    """Wait for stage `state` to be free and load into it k-tile kt of A's row tile `a_tile` in batch `batch` and
    B's `b_tile` in batch `b_batch` (default: `batch`). `views` are `ab_prologue`'s. The caller advances `state` in
    its own loop body (the DSL carries only what a loop mutates)."""
    tAsA, tAgA, tBsB, tBgB = views
    ab_pipeline.producer_acquire(state)
    bar = ab_pipeline.producer_get_barrier(state)
    cute.copy(tma_atom_a, tAgA[(None, a_tile, kt, batch)], tAsA[(None, state.index)], tma_bar_ptr=bar)
    b_batch = batch if b_batch is None else b_batch
    cute.copy(tma_atom_b, tBgB[(None, b_tile, kt, b_batch)], tBsB[(None, state.index)], tma_bar_ptr=bar)
    ab_pipeline.producer_commit(state)


@cute.jit
def produce_tile(ab_pipeline: Any, state: Any, tma_atom_a: cute.CopyAtom, tma_atom_b: cute.CopyAtom, views: tuple,
                 a_tile: Any, b_tile: Any, k_tiles: Any, batch: Any = 0, b_batch: Any = None):
    """The producer's loads of one output tile: k-tiles 0..k_tiles-1 of A's row tile `a_tile` and B's `b_tile`
    (batches as `load_k_tile`), each into the next stage. Returns the advanced `state`, which the caller must rebind
    (the DSL carries what a loop advances only through the loop's own names)."""
    for kt in range(k_tiles):
        load_k_tile(ab_pipeline, state, tma_atom_a, tma_atom_b, views, a_tile, b_tile, kt, batch, b_batch)
        state.advance()
    return state
