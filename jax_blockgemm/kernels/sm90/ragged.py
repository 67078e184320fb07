"""Hopper (sm_90a) ragged gemm_amax: the mixture-of-experts product, tokens sorted by group, each group times its own
weight, in one launch with no host synchronization.

The work is a table of items computed on the device from the group bounds. For the block-scaled kernel
(`ragged.kernel_items`, `work_item`) item i is a 128-row tile of the token grid, a group, and the rows [first, end)
of that tile the group holds: a tile that holds rows of two groups is two items, each storing only its own rows (no
atomics on C: deterministic). The rows of no group, before the first group (a shard of the experts) and past the
last, are items of group -1, whose CTAs store zeros after one k-tile. Items past the count have first == end and
their CTAs return at once. The kernel clamps every item into range (its rows into its row tile and below T, its
group below G), so no table can make it read or write outside its buffers.

Each CTA runs one output tile of the gemm_amax mainloop (kernels/sm90/gemm_amax.py: codes x scales dequantized to
bf16 in shared memory, bf16 wgmma) with B's batch coordinate set to the item's group. The grid is (N tiles, item
bound, L) with the N tiles fastest, so the CTAs running at once share a few A tiles and groups' weights in L2.

MXFP8 E4M3 weights with f32 or bf16 C take `ragged_swap_ab.HopperRaggedSwapAB` instead (only the weights converted,
in registers; the tokens dequantized by XLA), over group-local items like the bf16 kernel below.

`HopperRaggedBf16Gemm` runs bf16 operands (no dequantization, no scale atoms tied to the 128-row grid) over
group-local items (`ragged.group_items`): each group's rows cut into tiles of 128 from its own first row, so a group
boundary costs no second item; the A tile is loaded at the item's first row. A producer warp and two wgmma
warpgroups per tile of 128 rows and `arch.TABLE`'s columns (`bf16_tile`: 128 at two CTAs per SM, so that one CTA's
epilogue overlaps the other's mainloop, or 256 at one, a third fewer bytes from L2 per product). A warpgroup none of
whose 64 rows an item holds (a group's last, short tile) issues no MMAs.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from jax_blockgemm.kernels import common
from jax_blockgemm.kernels.sm90 import tma_pipeline, wgmma_mainloop
from jax_blockgemm.kernels.sm90.bf16_tile import Bf16TileKernel
from jax_blockgemm.kernels.sm90.gemm_amax import HopperMxf8GemmAmax

ITEM_ROWS = 128  # rows of the token grid per work item: the CTA tile's M
ITEM_FIELDS = 4  # (row tile or 0 in a group-local table, group or -1, first row, end row) per item, int32


def work_item(items: cute.Tensor, batch, item, max_items, t, g):
    """(row tile, group, first row, end row) of `item` in `batch`, clamped into range whatever the table holds: the
    rows lie in the row tile and below T, the group names one of the batch's weights (or is negative: zeros). The
    CTA has nothing to do when first >= end."""
    entry = (batch * max_items + item) * ITEM_FIELDS
    row_tile = cutlass.min(cutlass.max(items[entry], 0), (t - 1) // ITEM_ROWS)
    group = cutlass.min(items[entry + 1], g - 1)
    rows_lo = cutlass.max(items[entry + 2], row_tile * ITEM_ROWS)
    rows_hi = cutlass.min(cutlass.min(items[entry + 3], row_tile * ITEM_ROWS + ITEM_ROWS), t)
    return row_tile, group, rows_lo, rows_hi


def group_item(items: cute.Tensor, batch, item, max_items, t, g):
    """(group, first row, end row) of `item` in `batch` of a group-local table (`ragged.group_items`), clamped into
    range whatever the table holds: the rows lie in [0, T) and span at most one tile of ITEM_ROWS, the group names
    one of the batch's weights (or is negative: zeros). The CTA has nothing to do when first >= end."""
    entry = (batch * max_items + item) * ITEM_FIELDS
    group = cutlass.min(items[entry + 1], g - 1)
    rows_lo = cutlass.min(cutlass.max(items[entry + 2], 0), t)
    rows_hi = cutlass.min(cutlass.min(items[entry + 3], rows_lo + ITEM_ROWS), t)
    return group, rows_lo, rows_hi


class BlockScaledGroups:
    """The size rule of a block-scaled ragged kernel built on a gemm_amax kernel (mixed in before it)."""

    def can_implement(self, t: int, n: int, k: int, l: int, g: int = 1) -> tuple[bool, str]:
        """Whether the kernel handles these sizes, and why not: gemm_amax's rules for A (L, T, K), C (L, T, N) and
        one weight (N, K); b as a whole may hold more than 2**31 elements (TMA addresses it by batch)."""
        if g < 1:
            return False, f"g must be >= 1, got g={g}"
        return super().can_implement(t, n, k, l)


class HopperRaggedGemmAmax(BlockScaledGroups, HopperMxf8GemmAmax):
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
        row_tile, group, rows_lo, rows_hi = work_item(items, batch, item, max_items, t, g)
        if rows_lo < rows_hi:
            self.tile(tma_atom_a, mA_mkl, tma_atom_b, mB_nkl, sfa, sfb, c, amax, alpha, t, n, k, tiled_mma,
                      (a_smem_staged, b_smem_staged, a16_smem_staged, b16_smem_staged), row_tile, tile_n, batch,
                      batch * g + cutlass.max(group, 0), rows_lo, rows_hi, group < 0)


class HopperRaggedBf16Gemm(Bf16TileKernel):
    """C[rows of group g] = A·B[g]^T per batch l, amax[l] = max|C[l]|, bf16 operands, f32 or bf16 C.

    The ragged ABI (`HopperRaggedGemmAmax`) with a (L, T, K) and b (L·G, N, K) for b_major "k" or (L·G, K, N) for
    "n" in bf16, and a group-local item table (`group_item`); sfa, sfb and alpha are not read. Per CTA one output
    tile of 128 rows x `tile_n` columns of one item, from the item's first row: warp 8 streams 64-wide k-tiles of A
    and B by TMA through the stages of `bf16_tile.TILE_COLUMNS`, warps 0-7 (two warpgroups of 64 rows) run bf16 wgmma
    with fp32 accumulation in the tensor cores and store their rows of the item.
    """

    def __init__(self, *, tile_n: int, c_dtype: str = "float32", b_major: str = "k"):
        super().__init__(c_dtype=c_dtype, tile_n=tile_n)
        common.require_choice("b_major", b_major, ("k", "n"))
        self.b_mn = b_major == "n"
        assert self.tile_mnk[0] == ITEM_ROWS

    def can_implement(self, t: int, n: int, k: int, l: int, g: int = 1) -> tuple[bool, str]:
        """Whether the kernel handles these sizes, and why not: 16-byte rows (K, and N when B is N-major, multiples
        of 8) and 32-bit element counts for A, C and one weight."""
        if min(t, n, k, l, g) < 1:
            return False, f"every size must be >= 1, got t={t}, n={n}, k={k}, l={l}, g={g}"
        if k % 8:
            return False, f"k must be a multiple of 8 (16-byte rows of bf16), got k={k}"
        if self.b_mn and n % 8:
            return False, f"n must be a multiple of 8 for an N-major b (16-byte rows of bf16), got n={n}"
        if l * t * max(n, k) >= 2**31 or n * k >= 2**31 or l * g >= 2**31:
            return False, f"a, c and one weight must hold fewer than 2**31 elements, got t={t}, n={n}, k={k}, l={l}"
        return True, ""

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, items: cute.Tensor,
                 c: cute.Tensor, amax: cute.Tensor, alpha: cute.Tensor, t: cutlass.Int32, n: cutlass.Int32,
                 k: cutlass.Int32, l: cutlass.Int32, g: cutlass.Int32, max_items: cutlass.Int32,
                 stream: cuda.CUstream):
        """Host side: the TMA views of A as L batches and B as L·G, and a launch of (N tiles, max_items, L)."""
        bn = self.tile_mnk[1]
        k8 = cute.assume(k, divby=8)
        mA = common.operand_view(a, t, k8, l, False)
        mB = common.operand_view(b, n, k8, l * g, self.b_mn, row_align=8)
        tma_a, tma_b, tiled_mma, layouts = self.tma_operands(mA, mB, False, self.b_mn)
        tiles_n = (n + bn - 1) // bn
        self.kernel(*tma_a, *tma_b, items, c, amax, t, n, g, max_items, tiled_mma, *layouts).launch(
            **self.launch_config((tiles_n, max_items, l)), stream=stream)

    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor, tma_atom_b: cute.CopyAtom, mB_nkl: cute.Tensor,
               items: cute.Tensor, c: cute.Tensor, amax: cute.Tensor, t: cutlass.Int32, n: cutlass.Int32,
               g: cutlass.Int32, max_items: cutlass.Int32, tiled_mma: cute.TiledMma,
               a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout):
        """Device body: the CTA reads its item and runs that output tile (producer warp 8, MMA warps 0-7), or
        returns when the item is empty. Items of group -1 (rows of no group) store zeros after one k-tile."""
        tile_n, item, batch = cute.arch.block_idx()
        group, rows_lo, rows_hi = group_item(items, batch, item, max_items, t, g)
        if rows_lo < rows_hi:
            tidx, _, _ = cute.arch.thread_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            bm = self.tile_mnk[0]
            # A's tile 0 starts at the item's first row (TMA fills rows past T with zeros; rows past the item's end
            # are computed and not stored)
            mA_item = cute.domain_offset((rows_lo, 0, 0), mA_mkl)
            storage, ab_pipeline, sA, sB, views, k_tiles, wg_idx = tma_pipeline.ab_prologue(
                tidx, warp_idx, tma_atom_a, mA_item, tma_atom_b, mB_nkl, a_smem_staged, b_smem_staged,
                self.shared_storage, self.ab_dtype, self.ab_stages, self.num_consumer_warps, self.tile_mnk,
                self.threads_per_wg)
            zero = group < 0
            k_tiles = cutlass.min(k_tiles, cutlass.select_(zero, 1, k_tiles))
            if warp_idx == self.producer_warp:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
                state = tma_pipeline.produce_tile(ab_pipeline, state, tma_atom_a, tma_atom_b, views, 0, tile_n,
                                                  k_tiles, batch, batch * g + cutlass.max(group, 0))
                ab_pipeline.producer_tail(state)
            elif warp_idx < self.producer_warp:
                tCrA, tCrB, acc = self.mma_fragments(tiled_mma, sA, sB, wg_idx)
                read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
                release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)  # acc starts from zero
                # A warpgroup none of whose 64 rows the item holds (a group's last tile of 64 rows or fewer) issues
                # no MMAs: the item then costs the tensor cores half a tile. Items of no group issue none and store
                # the zeroed accumulator.
                active = (rows_hi > rows_lo + wg_idx * (bm // 2)) & (group >= 0)
                read_state, release_state = wgmma_mainloop.mma_tile(ab_pipeline, read_state, release_state,
                                                                    tiled_mma, acc, tCrA, tCrB,
                                                                    cute.size(tCrA, mode=[2]), k_tiles, active)
                warp_amax = storage.warp_amax.get_tensor(cute.make_layout((self.num_consumer_warps,)))
                self.store_c_and_amax(acc, c, amax, amax, warp_amax, t, n, rows_lo, tile_n, batch, batch, wg_idx,
                                      tidx, rows_lo, rows_hi)


__all__ = ["HopperRaggedGemmAmax", "HopperRaggedBf16Gemm", "ITEM_ROWS", "ITEM_FIELDS", "work_item", "group_item"]
