"""Hopper (sm_90a) per-group contraction over tokens: c[l, g] = x[l, rows of g]ᵀ · y[l, rows of g], the weight
gradient of a mixture-of-experts product (tokens sorted by group), in one launch with no host synchronization.

A CTA computes one 128 x 128 tile of one group's (K, N) result: the grid is (K tiles, N tiles, L·G). Both operands are
read with the tokens as the contraction, so their TMA tiles are MN-major (K or N contiguous) and the bf16 wgmma reads
both transposed. The TMA views start at the group's first row (`cute.domain_offset`), so a group may start at any
row; its 64-token k-tiles run to its end. In the last one only the wgmma k-steps (16 tokens each) that hold rows of
the group are issued, and their rows past the group (the next group's, or zeros past T) are zeroed in shared memory
before the MMA reads them, so neither their values nor a NaN among them reach the sum. An empty group stores zeros
after one masked k-step. The group bounds are clamped into [0, T]: no table can make the kernel read or write
outside its buffers.

The rest is the bf16 tile kernels' design (kernels/sm90/bf16_tile.py) in its 128 x 128 form: a producer warp, two
wgmma warpgroups, three 32 KB stages, two CTAs per SM, the shared epilogue (`c_store`).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from jax_blockgemm.kernels import common, ptx_ops
from jax_blockgemm.kernels.sm90 import tma_pipeline, wgmma_mainloop
from jax_blockgemm.kernels.sm90.bf16_tile import Bf16TileKernel

_MASK_BARRIER_ID = 2  # the MMA warps, after zeroing the rows past the group in the last k-tile


class HopperGroupedContraction(Bf16TileKernel):
    """c[l, g] = x[l, rows of g]ᵀ · y[l, rows of g] (K, N) per batch l and group g, amax[l] = max|c[l]|: bf16 x
    (L, T, K) and y (L, T, N), f32 or bf16 c (L·G, K, N). The ABI: fn(x, y, bounds, c, amax, t, k, n, l, g, stream),
    bounds int32 (L, G, 2) the rows [start, end) of each group (kernels/catalog.py)."""

    def __init__(self, *, c_dtype: str = "float32"):
        super().__init__(c_dtype=c_dtype)  # tile_mnk: (rows of K, columns of N, tokens) per CTA and k-tile

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
        bm, bn, _ = self.tile_mnk
        mA = common.operand_view(x, k, t, l, True, row_align=8)
        mB = common.operand_view(y, n, t, l, True, row_align=8)
        tma_a, tma_b, tiled_mma, layouts = self.tma_operands(mA, mB, True, True)
        self.kernel(*tma_a, *tma_b, bounds, c, amax, t, k, n, g, tiled_mma, *layouts).launch(
            **self.launch_config(((k + bm - 1) // bm, (n + bn - 1) // bn, l * g)), stream=stream)

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
        bk = self.tile_mnk[2]
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
            tCrA, tCrB, acc = self.mma_fragments(tiled_mma, sA, sB, wg_idx)
            acc.fill(0.0)
            num_k_steps = cute.size(tCrA, mode=[2])
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)  # acc starts from zero
            # k-tile 0, then 1 .. k_tiles - 1 keeping one wgmma group in flight (`wgmma_mainloop.issue_k_tiles`;
            # the last k-tile only its k-steps up to the group's end, their rows past it zeroed first)
            k_step = bk // num_k_steps  # tokens per wgmma k-step
            # the last k-tile's k-steps that hold rows of the group (the first always runs: it starts the sum); the
            # others would add only zeroed rows
            last_steps = cutlass.max((valid + k_step - 1) // k_step, 1)
            ab_pipeline.consumer_wait(read_state)
            self.issue_k_tile(tiled_mma, acc, tCrA, tCrB, sA, sB, read_state.index, k_tiles == 1, valid, last_steps,
                              k_step, tidx)
            read_state.advance()
            for kt in range(1, k_tiles):
                ab_pipeline.consumer_wait(read_state)
                self.issue_k_tile(tiled_mma, acc, tCrA, tCrB, sA, sB, read_state.index, kt == k_tiles - 1, valid,
                                  last_steps, k_step, tidx)
                read_state.advance()
                cute.nvgpu.warpgroup.wait_group(1)  # the previous k-tile's group is done: free its stage
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            ab_pipeline.consumer_release(release_state)
            warp_amax = storage.warp_amax.get_tensor(cute.make_layout((self.num_consumer_warps,)))
            # c is (L·G, K, N): batch lg of (K, N) results; amax has one slot per l
            self.store_c_and_amax(acc, c, amax, amax, warp_amax, k, n, tile_m * self.tile_mnk[0], tile_n, lg, batch,
                                  wg_idx, tidx, cutlass.Int32(0), k)

    @cute.jit
    def issue_k_tile(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
                     sA: cute.Tensor, sB: cute.Tensor, stage, last, valid, last_steps, k_step: int, local_tid):
        """The wgmmas of the k-tile in `stage` as one committed group: all its k-steps, or for the group's `last`
        k-tile its first `last_steps`, their rows from `valid` on zeroed first."""
        num_k_steps = cute.size(tCrA, mode=[2])
        steps = cutlass.Int32(num_k_steps)
        if last:
            self.zero_rows_past(sA, sB, stage, valid, last_steps * k_step, local_tid)
            steps = last_steps
        wgmma_mainloop.issue_first_steps(tiled_mma, acc, tCrA, tCrB, num_k_steps, stage, steps)

    @cute.jit
    def zero_rows_past(self, sA: cute.Tensor, sB: cute.Tensor, stage, valid, used, local_tid):
        """Zero tokens valid .. used - 1 of both operands' k-tile in `stage` (when valid < used: the k-steps issued
        cover tokens 0 .. used - 1), then make the writes visible to the tensor cores and wait for every MMA thread
        (both warpgroups read all of B).

        The stages are MN-major with the 128-byte swizzle: a token's 64 consecutive rows of one half of the tile fill
        one 128-byte line (the swizzle permutes the line's 16-byte pieces, never moves them out of it), so a token is
        zeroed by 16-byte stores of whole lines, without the swizzle: 16 per token and operand."""
        bm, _, bk = self.tile_mnk  # A and B tiles alike: bm rows each
        half = bm // 2
        layouts = (sA.layout, sB.layout)  # unswizzled: the swizzle lives in the iterator
        for layout in layouts:  # (static) each token's rows of each half: one whole line, its own
            for token in cutlass.range_constexpr(bk):
                for row0 in (0, half):
                    first = cute.crd2idx((row0, token, 0), layout)
                    assert first % half == 0 and cute.crd2idx((row0 + half - 1, token, 0), layout) == first + half - 1
            assert cute.crd2idx((0, 0, 1), layout) % half == 0  # stages start on a line
        if valid < used:
            bases = (sA.iterator.toint(), sB.iterator.toint())
            for i in range(local_tid, (used - valid) * 16, self.num_consumer_warps * 32):  # 2 lines of 8 pieces
                piece, row0, token = i % 8, (i // 8) % 2 * half, valid + i // 16
                for op in cutlass.range_constexpr(2):  # A, then B: each lane one 16-byte piece of a line
                    line = cute.crd2idx((row0, token, stage), layouts[op]) * 2  # a line's first byte (asserted)
                    ptx_ops.st_shared_v4(bases[op] + line + 16 * piece, 0, 0, 0, 0)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=_MASK_BARRIER_ID, number_of_threads=self.num_consumer_warps * 32)


__all__ = ["HopperGroupedContraction"]
