"""Hopper (sm_90a) ragged gemm_amax: the mixture-of-experts product, tokens sorted by group, each group times its own
weight, in one launch with no host synchronization.

The work is a table of items computed on the device from the group sizes (`ragged.kernel_items`): item i is a
128-row tile of the token grid, a group, and the rows [first, end) of that tile the group holds. A tile that holds
rows of two groups is two items, each storing only its own rows (no atomics on C: deterministic). The rows of no
group, past the sum of the sizes, are items of group -1, whose CTAs store zeros after one k-tile. Items past the
count have first == end and their CTAs return at once. The kernel clamps every item into range (its rows into its
row tile and below T, its group below G), so no table can make it read or write outside its buffers.

Each CTA runs one output tile of the gemm_amax mainloop (kernels/sm90/gemm_amax.py: codes x scales dequantized to
bf16 in shared memory, bf16 wgmma) with B's batch coordinate set to the item's group. The grid is (N tiles, item
bound, L) with the N tiles fastest, so the CTAs running at once share a few A tiles and groups' weights in L2.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from jax_blockgemm.kernels.sm90.gemm_amax import HopperMxf8GemmAmax

ITEM_ROWS = 128  # rows of the token grid per work item: the CTA tile's M
ITEM_FIELDS = 4  # (row tile, group or -1, first row, end row) per item, int32


class HopperRaggedGemmAmax(HopperMxf8GemmAmax):
    """C[rows of group g] = alpha[l]·(A·sfa)(B[g]·sfb)^T per batch l, amax[l] = max|C[l]|, K-major MXFP8, MXFP4
    or NVFP4 operands.

    The exported function: fn(a, b, sfa, sfb, items, c, amax, alpha, t, n, k, l, g, max_items, stream) with a
    (L, T, K) codes (packed FP4: (L, T, K/2) bytes), b (L·G, N, K) likewise, sfa/sfb their scale bytes in the SPEC
    §3 atom layout of (L, T, K) and (L·G, N, K), items int32 (L, max_items, 4), c (L, T, N), amax and alpha (L,)
    float32 (alpha: ones for the MX formats).
    """

    def __init__(self, *, ab_dtype: str = "float8_e4m3fn", c_dtype: str = "float32", sf_vec_size: int = 32,
                 sf_dtype: str = "float8_e8m0fnu"):
        super().__init__(ab_dtype=ab_dtype, c_dtype=c_dtype, sf_vec_size=sf_vec_size, sf_dtype=sf_dtype)
        self.has_alpha = True
        assert self.tile_mnk[0] == ITEM_ROWS

    def can_implement(self, t: int, n: int, k: int, l: int, g: int = 1) -> tuple[bool, str]:
        """Whether the kernel handles these sizes, and why not: gemm_amax's rules for A (L, T, K), C (L, T, N) and
        one weight (N, K); b as a whole may hold more than 2**31 elements (TMA addresses it by batch)."""
        if g < 1:
            return False, f"g must be >= 1, got g={g}"
        return super().can_implement(t, n, k, l)

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, items: cute.Tensor,
                 c: cute.Tensor, amax: cute.Tensor, alpha: cute.Tensor, t: cutlass.Int32, n: cutlass.Int32,
                 k: cutlass.Int32, l: cutlass.Int32, g: cutlass.Int32, max_items: cutlass.Int32,
                 stream: cuda.CUstream):
        """Host side: the TMA views of A as L batches and B as L·G, and a launch of (N tiles, max_items, L)."""
        tma_a, tma_b, tiled_mma, layouts = self.operands(a, b, t, n, k, l, l * g)
        tiles_n = (n + self.tile_mnk[1] - 1) // self.tile_mnk[1]
        self.ragged_kernel(*tma_a, *tma_b, sfa, sfb, items, c, amax, alpha, t, n, k, g, max_items, tiled_mma,
                           *layouts).launch(grid=(tiles_n, max_items, l), block=(self.threads_per_cta, 1, 1),
                                            min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def ragged_kernel(self, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor, tma_atom_b: cute.CopyAtom,
                      mB_nkl: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, items: cute.Tensor, c: cute.Tensor,
                      amax: cute.Tensor, alpha: cute.Tensor, t: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
                      g: cutlass.Int32, max_items: cutlass.Int32, tiled_mma: cute.TiledMma,
                      a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
                      a16_smem_staged: cute.ComposedLayout, b16_smem_staged: cute.ComposedLayout):
        """Device body: the CTA reads its item and runs that output tile, or returns when the item is empty."""
        tile_n, item, batch = cute.arch.block_idx()
        entry = (batch * max_items + item) * ITEM_FIELDS
        # Clamped into range whatever the table holds: the rows stored lie in the row tile and below T, the group
        # names one of this batch's weights (or is negative: zeros).
        row_tile = cutlass.min(cutlass.max(items[entry], 0), (t - 1) // ITEM_ROWS)
        group = cutlass.min(items[entry + 1], g - 1)
        rows_lo = cutlass.max(items[entry + 2], row_tile * ITEM_ROWS)
        rows_hi = cutlass.min(cutlass.min(items[entry + 3], row_tile * ITEM_ROWS + ITEM_ROWS), t)
        if rows_lo < rows_hi:
            self.tile(tma_atom_a, mA_mkl, tma_atom_b, mB_nkl, sfa, sfb, c, amax, alpha, t, n, k, tiled_mma,
                      (a_smem_staged, b_smem_staged, a16_smem_staged, b16_smem_staged), row_tile, tile_n, batch,
                      batch * g + cutlass.max(group, 0), rows_lo, rows_hi, group < 0)


__all__ = ["HopperRaggedGemmAmax", "ITEM_ROWS", "ITEM_FIELDS"]
