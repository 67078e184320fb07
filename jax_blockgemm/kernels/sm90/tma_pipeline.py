"""The TMA side every Hopper kernel here shares: an A+B stage pipeline from a producer warp to consumer warps, and
the TMA views of one operand. Plain Python, inlined into each kernel body at trace time."""

from __future__ import annotations

from typing import Any, Type

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline


def make_ab_pipeline(barrier_ptr: Any, a_smem_staged: Any, b_smem_staged: Any, dtype: Type[cutlass.Numeric],
                     stages: int, consumer_warps: int, cluster_mn: tuple) -> pipeline.PipelineTmaAsync:
    """`stages` A+B buffers filled by one TMA thread (the transaction count is one A and one B tile) and released
    by `consumer_warps` warps; also arrives on the pipeline's init barrier (the caller waits on it).

    cluster_mn = (c, 1) with c > 1: the c CTAs of a cluster along M share B, each loading 1/c of it and multicasting
    it to all (`tma_views(..., cta_rank, c)`); a stage is then free only once every CTA of the cluster released it,
    so each consumer warp signals every CTA's empty barrier."""
    tma_bytes = (cute.size_in_bytes(dtype, cute.slice_(a_smem_staged, (None, None, 0)))
                 + cute.size_in_bytes(dtype, cute.slice_(b_smem_staged, (None, None, 0))))
    if cluster_mn[0] * cluster_mn[1] == 1:
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=barrier_ptr, num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
            tx_count=tma_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
    else:
        assert cluster_mn[1] == 1, "only clusters along M (B multicast) are implemented"
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=barrier_ptr, num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * consumer_warps),
            tx_count=tma_bytes, cta_layout_vmnk=cute.make_layout((1, cluster_mn[0], 1, 1)),
            mcast_mode_mn=(0, 1), enable_multicast_signaling=True, defer_sync=True)
    pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_mn, is_relaxed=True)
    return ab_pipeline


def tma_views(tma_atom: cute.CopyAtom, operand: cute.Tensor, smem: cute.Tensor, tile: tuple[int, int],
              cta_rank: Any = 0, multicast: int = 1):
    """(shared, global) TMA views of one operand: its (rows, K, L) tensor cut into `tile` = (rows, k) tiles, indexed
    (copy, row tile, k tile, batch) globally and (copy, stage) in shared memory. With `multicast` CTAs sharing the
    tile, this CTA's views cover its 1/multicast part (`cta_rank` among them), which its copy multicasts."""
    tiles = cute.local_tile(operand, tile, (None, None, None))  # (bRows, bK, RestRows, RestK, L)
    return cute.nvgpu.cpasync.tma_partition(tma_atom, cta_rank, cute.make_layout(multicast),
                                            cute.group_modes(smem, 0, 2), cute.group_modes(tiles, 0, 2))
