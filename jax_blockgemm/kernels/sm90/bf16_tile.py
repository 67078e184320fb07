"""What the sm_90a kernels with bf16 operands share (the bf16 ragged GEMM, the grouped contraction): one output tile
of 128 rows and 128 or 256 columns per CTA, a producer warp (warp 8) and two wgmma warpgroups (warps 0-7) over 64-wide
k-tiles; the TMA atoms and shared memory of A and B in either major, and each MMA thread's fragments. The epilogue is
`c_store`'s.

A 128-column tile runs two CTAs per SM (288 threads of at most 112 registers, three 32 KB stages, ~97 KB of shared
memory each), so that one CTA's epilogue overlaps the other's mainloop; a 256-column tile one CTA per SM (a 64 x 256
fp32 accumulator per warpgroup: 128 registers a thread) with four 48 KB stages. The wider tile moves a third fewer
bytes from L2 per product (48 KB per 128 x 256 x 64 k-tile against 32 KB per 128 x 128 x 64)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils

from jax_blockgemm.kernels import common
from jax_blockgemm.kernels.sm90 import tma_pipeline
from jax_blockgemm.kernels.sm90.c_store import AccumulatorStore
from jax_blockgemm.kernels.sm90.gemm_amax import smem_layout_staged

C_DTYPES = ("float32", "bfloat16")
# columns of the CTA tile -> (CTAs per SM, A+B stages): what fits the SM's registers and 228 KB of shared memory
TILE_COLUMNS = {128: (2, 3), 256: (1, 4)}


class Bf16TileKernel(AccumulatorStore):
    """Compile-time configuration of a bf16 tile kernel; subclasses add the ABI (`__call__`) and the kernel body."""

    def __init__(self, *, c_dtype: str, tile_n: int = 128):
        common.require_choice("c_dtype", c_dtype, C_DTYPES)
        common.require_choice("tile_n", tile_n, tuple(TILE_COLUMNS))
        self.ab_dtype = cutlass.BFloat16
        self.acc_dtype = cutlass.Float32
        self.c_name = c_dtype
        self.c_dtype = cutlass.Float32 if c_dtype == "float32" else cutlass.BFloat16
        self.c_kind = "wide"
        self.has_alpha = False
        self.tile_mnk = (128, tile_n, 64)  # rows of A and of B per CTA, and the k-tile
        self.threads_per_wg = 128
        self.num_consumer_warps = 8  # warps 0-7: the two MMA warpgroups
        self.producer_warp = self.num_consumer_warps
        self.threads_per_cta = (self.num_consumer_warps + 1) * 32
        self.epilogue_barrier_id = 1
        self.ctas_per_sm, self.ab_stages = TILE_COLUMNS[tile_n]
        self.buffer_align_bytes = 1024

    @cute.jit
    def tma_operands(self, mA: cute.Tensor, mB: cute.Tensor, a_mn: bool, b_mn: bool):
        """Host side, inlined into `__call__`: for A (rows, K, L) and B (rows, K, L) views, K- or MN-major, the bf16
        tiled MMA, the staged shared-memory layouts, the TMA atoms and views, and `self.shared_storage` (the stage
        pipeline's mbarriers, the per-warp amax slots, A's and B's stages). Returns ((atom A, view A),
        (atom B, view B), tiled MMA, (A layout, B layout))."""
        bm, bn, bk = self.tile_mnk
        major = lambda mn: cute.nvgpu.OperandMajorMode.MN if mn else cute.nvgpu.OperandMajorMode.K
        tiled_mma = sm90_utils.make_trivial_tiled_mma(self.ab_dtype, self.ab_dtype, major(a_mn), major(b_mn),
                                                      self.acc_dtype, (2, 1, 1), tiler_mn=(64, bn))
        a_smem_staged = smem_layout_staged(bm, self.ab_dtype, self.ab_stages, bk, a_mn)
        b_smem_staged = smem_layout_staged(bn, self.ab_dtype, self.ab_stages, bk, b_mn)
        tma_atom_a, tma_a = tma_pipeline.load_atom(mA, a_smem_staged, (bm, bk))
        tma_atom_b, tma_b = tma_pipeline.load_atom(mB, b_smem_staged, (bn, bk))

        @cute.struct
        class SharedStorage:
            pipeline_mbars: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            warp_amax: cute.struct.MemRange[cutlass.Int32, self.num_consumer_warps]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem_staged)],
                                  self.buffer_align_bytes]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem_staged)],
                                  self.buffer_align_bytes]

        self.shared_storage = SharedStorage
        return (tma_atom_a, tma_a), (tma_atom_b, tma_b), tiled_mma, (a_smem_staged, b_smem_staged)

    def mma_fragments(self, tiled_mma: cute.TiledMma, sA: cute.Tensor, sB: cute.Tensor, wg_idx):
        """An MMA thread's wgmma operands over every stage and its accumulator (not zeroed): (tCrA, tCrB, acc)."""
        thr_mma = tiled_mma.get_slice(wg_idx * self.threads_per_wg)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        return tCrA, tCrB, cute.make_rmem_tensor(thr_mma.partition_shape_C(self.tile_mnk[:2]), self.acc_dtype)

    def launch_config(self, grid: tuple) -> dict:
        """The launch keywords of every bf16 tile kernel, for `grid`."""
        return dict(grid=grid, block=(self.threads_per_cta, 1, 1), min_blocks_per_mp=self.ctas_per_sm,
                    preferred_smem_carveout=100)


__all__ = ["Bf16TileKernel", "C_DTYPES", "TILE_COLUMNS"]
