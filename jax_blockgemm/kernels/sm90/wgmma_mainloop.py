"""The bf16 wgmma mainloop the Hopper kernels with bf16 operands share (proj_rope, the bf16 ragged GEMM): each k-tile's
stage waited for and its wgmma steps issued as one committed group, one group kept in flight, each stage released
once the tensor cores are done with it. Inlined into the kernel bodies at trace time."""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute


@cute.jit
def issue_stage(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor, num_k_steps: int,
                stage: Any, active: Any = None) -> None:
    """Issue the wgmma steps of the k-tile in `stage` (already arrived) as one committed group (not waited for).
    With `active` (a run-time flag) false the group is empty: the warpgroup keeps the pipeline's pace and its
    accumulator without using the tensor cores."""
    cute.nvgpu.warpgroup.fence()
    if cutlass.const_expr(active is None):
        for ks in cutlass.range_constexpr(num_k_steps):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, ks, stage)], tCrB[(None, None, ks, stage)], acc)
    else:
        if active:
            for ks in cutlass.range_constexpr(num_k_steps):
                cute.gemm(tiled_mma, acc, tCrA[(None, None, ks, stage)], tCrB[(None, None, ks, stage)], acc)
    cute.nvgpu.warpgroup.commit_group()


@cute.jit
def issue_first_steps(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
                      num_k_steps: cutlass.Constexpr[int], stage: Any, steps: Any) -> None:
    """`issue_stage` for only the k-tile's first min(`steps`, num_k_steps) k-steps (`steps` a run-time count, at
    least 1): a k-tile whose later k-steps hold only zeros. One branch per count, each a whole committed group, so
    that no wgmma sits behind a branch of its own (ptxas would fence the accumulator's registers around each)."""
    if cutlass.const_expr(num_k_steps == 1):
        issue_stage(tiled_mma, acc, tCrA, tCrB, 1, stage)
    else:
        if steps >= num_k_steps:
            issue_stage(tiled_mma, acc, tCrA, tCrB, num_k_steps, stage)
        else:
            issue_first_steps(tiled_mma, acc, tCrA, tCrB, num_k_steps - 1, stage, steps)


def mma_k_tile(ab_pipeline: Any, read_state: Any, tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor,
               tCrB: cute.Tensor, num_k_steps: int, active: Any = None) -> None:
    """Wait for one k-tile's stage and issue its wgmma steps as one committed group (not waited for)."""
    ab_pipeline.consumer_wait(read_state)
    issue_stage(tiled_mma, acc, tCrA, tCrB, num_k_steps, read_state.index, active)


@cute.jit
def issue_k_tiles(ab_pipeline: Any, read_state: Any, release_state: Any, tiled_mma: cute.TiledMma, acc: cute.Tensor,
                  tCrA: cute.Tensor, tCrB: cute.Tensor, num_k_steps: int, k_tiles: Any, active: Any = None):
    """One tile's mainloop: the wgmmas of its k_tiles stages, one committed group per k-tile, keeping one group in
    flight; each stage is released once the next k-tile's group is issued and its own is done. The last group is
    left in flight and its stage held: the caller waits for it and releases that stage.

    Returns the advanced (read_state, release_state), which the caller must rebind: the DSL carries a state that a
    dynamic loop advances by rebinding the loop's own names, so the caller's objects keep their old values."""
    mma_k_tile(ab_pipeline, read_state, tiled_mma, acc, tCrA, tCrB, num_k_steps, active)
    read_state.advance()
    for kt in range(1, k_tiles):
        # Pipeline states advance in the loop body itself: the DSL carries only what the body mutates.
        mma_k_tile(ab_pipeline, read_state, tiled_mma, acc, tCrA, tCrB, num_k_steps, active)
        read_state.advance()
        cute.nvgpu.warpgroup.wait_group(1)  # the previous k-tile's group is done: free its stage
        ab_pipeline.consumer_release(release_state)
        release_state.advance()
    return read_state, release_state


@cute.jit
def mma_tile(ab_pipeline: Any, read_state: Any, release_state: Any, tiled_mma: cute.TiledMma, acc: cute.Tensor,
             tCrA: cute.Tensor, tCrB: cute.Tensor, num_k_steps: int, k_tiles: Any, active: Any = None):
    """One tile's whole mainloop: acc from zero, every k-tile's wgmmas (none where `active` is false), all of them
    waited for, the last stage released. Returns the advanced (read_state, release_state), to rebind (see
    `issue_k_tiles`)."""
    acc.fill(0.0)
    read_state, release_state = issue_k_tiles(ab_pipeline, read_state, release_state, tiled_mma, acc, tCrA, tCrB,
                                              num_k_steps, k_tiles, active)
    cute.nvgpu.warpgroup.wait_group(0)
    ab_pipeline.consumer_release(release_state)
    release_state.advance()
    return read_state, release_state
