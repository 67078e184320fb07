"""The persistent tile schedule every sm_100a kernel shares: one CTA (or cluster) per SM, each walking tiles.

`schedule` is host side (the grid and the scheduler's parameters for a tile count); `tile_scheduler` is device
side (each warp role builds its own scheduler and walks the same tiles in the same order). The scheduler's state
advances in the kernel's own loop body (`sched.advance_to_next_work()`), never in a helper: the DSL carries across
dynamic loop iterations only what the loop body itself mutates.
"""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.utils as utils

from jax_blockgemm.kernels.sm100 import SM_COUNT

SchedulerParams = utils.PersistentTileSchedulerParams


def schedule(tiles_mnl, cluster_mn: tuple[int, int]):
    """(scheduler parameters, launch grid) for `tiles_mnl` output tiles on a B200 (SM_COUNT SMs)."""
    params = utils.PersistentTileSchedulerParams(tiles_mnl, (*cluster_mn, 1))
    grid = utils.StaticPersistentTileScheduler.get_grid_shape(params, SM_COUNT // (cluster_mn[0] * cluster_mn[1]))
    return params, grid


def tile_scheduler(params: SchedulerParams) -> utils.StaticPersistentTileScheduler:
    """This CTA's static persistent scheduler (device side; its first tile is `initial_work_tile_info()`)."""
    return utils.StaticPersistentTileScheduler.create(params, cute.arch.block_idx(), cute.arch.grid_dim())
