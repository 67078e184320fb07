"""Blackwell (sm_100a) block-scaled gemm_amax: TMA, tcgen05 block-scaled MMA, persistent tiles, fused amax.

COMPILED AND CHECKED HERE, NEVER RUN: no Blackwell GPU was available when this was written. The structure follows
the kernels NVIDIA runs on B200 (CUTLASS's CuTeDSL `dense_blockscaled_gemm_persistent*.py`, cuDNN frontend's
`gemm_amax`), so the hardware testing of those carries over as far as the structure does; the first-use self-check
(`jax_blockgemm.selfcheck`) runs it against the reference before the library trusts it on a GPU.

Unlike Hopper, the tensor cores apply the block scales themselves (`tcgen05.mma...block_scale`: kind mxf8f6f4
with one E8M0 scale per 32 K-elements for MXFP8; kind mxf4nvf4 for MXFP4 (E8M0, block 32) and NVFP4 (E4M3 or
E8M0, block 16)), reading them from tensor memory; the scale atoms of SPEC §3 are exactly the layout that MMA
expects, so TMA copies them unchanged into shared memory and `tcgen05.cp` moves them on to tensor memory.
The FP4 variants take packed E2M1 pairs (the handler passes the uint8 buffers); the E4M3-scale (NVFP4) ones take
the per-tensor alpha as a 7th tensor (`BlackwellBlockScaledGemmAmaxAlpha`), applied in the epilogue before amax.
FP8 operands may be MN-major (`a_major="m"`: A as (L, K, M); `b_major="n"`): the MMA reads MN-major tiles.
Warp roles (one CTA of 6 warps per SM, persistent over output tiles):

- `producer` (warp 5): TMA loads of A, B, SFA, SFB k-tiles into a ring of shared-memory stages (mbarriers),
  multicast across the cluster;
- `mma` (warp 4): scales to tensor memory, then the block-scaled MMAs into one of two tensor-memory accumulator
  buffers, so that the epilogue of tile i overlaps the MMAs of tile i+1. Two 256-column buffers leave no room for
  the scales, so the 128x256 tile overlaps its buffers by the scales' columns (as NVIDIA's
  `dense_blockscaled_gemm_persistent` does): the epilogue reads the shared columns first and hands the buffer back
  as soon as it has them;
- `epilogue` (warps 0-3): tensor memory -> registers (tcgen05.ld) by sub-tiles, fp32 amax of the in-bounds
  elements, conversion to C's dtype into a shared-memory sub-tile that one thread stores by TMA (which clips the
  M and N tails), then one integer atomic max per tile into amax[l] through the helper the Hopper kernel uses
  (kernels/common.py).

The exported ABI is the catalog's: fn(a, b, sfa, sfb, c, amax[, alpha], m, n, k, l, max_ctas, stream) over flat
buffers; max_ctas is how many CTAs of this kernel the GPU holds at once (the handler asks the driver), a multiple
of the cluster size: the persistent grid is at most that many.
"""

from __future__ import annotations

from typing import Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass.cute.nvgpu import cpasync, tcgen05

from jax_blockgemm.kernels import common
from jax_blockgemm.kernels.sm100 import (C_STAGES, MAX_AB_STAGES, SMEM_CAPACITY, SUPPORTED_CLUSTERS_MN,
                                         SUPPORTED_TILES_MN, TILE_K, persistent)

_AB_DTYPES = {"float8_e4m3fn": cutlass.Float8E4M3FN, "float8_e5m2": cutlass.Float8E5M2,
              "float4_e2m1fn": cutlass.Float4E2M1FN}
_C_DTYPES = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16}
_SF_DTYPES = {"float8_e8m0fnu": cutlass.Float8E8M0FNU, "float8_e4m3fn": cutlass.Float8E4M3FN}


def scale_layout(shape_mkl: tuple, sf_vec_size: int) -> cute.Layout:
    """The layout the block-scaled MMA reads scales through, over the SPEC §3 atom buffer (mn, k, l) -> byte.

    ((32, 4, MN'), ((sf_vec_size, 4), K'), L) with strides ((16, 4, 512·K'), ((0, 1), 512), 512·MN'·K'): exactly
    the physical atom of SPEC §3 (tests/test_scale_atom_layout.py checks it against `formats.to_scale_atom`).
    """
    return blockscaled_utils.tile_atom_to_shape_SF(shape_mkl, sf_vec_size)


class BlackwellBlockScaledGemmAmax(persistent.PersistentKernel):
    """C = (A·sfa) (B·sfb)^T per batch, amax[l] = max|C[l]|, for MXFP8/MXFP4/NVFP4 K-major operands on sm_100a.

    Compile-time configuration only; every size is a run-time scalar of the exported function.
    """

    def __init__(self, *, ab_dtype: str = "float8_e4m3fn", c_dtype: str = "float32",
                 tile_mn: tuple[int, int] = (128, 128), cluster_mn: tuple[int, int] = (1, 1),
                 sf_vec_size: int = 32, sf_dtype: str = "float8_e8m0fnu", a_major: str = "k", b_major: str = "k"):
        common.require_choice("ab_dtype", ab_dtype, sorted(_AB_DTYPES))
        common.require_choice("c_dtype", c_dtype, sorted(_C_DTYPES))
        common.require_choice("tile_mn", tuple(tile_mn), SUPPORTED_TILES_MN)
        common.require_choice("cluster_mn", tuple(cluster_mn), SUPPORTED_CLUSTERS_MN)
        # The seed's couplings: FP8 codes take block 32 (E8M0); E4M3 scales take block 16 (NVFP4, FP4 codes only).
        fp8 = ab_dtype != "float4_e2m1fn"
        allowed = ((32, "float8_e8m0fnu"),) if fp8 else ((32, "float8_e8m0fnu"), (16, "float8_e8m0fnu"),
                                                         (16, "float8_e4m3fn"))
        if (sf_vec_size, sf_dtype) not in allowed:
            raise ValueError(f"sf_vec_size={sf_vec_size!r} with sf_dtype={sf_dtype!r} is not supported for "
                             f"ab_dtype={ab_dtype!r}; expected one of {allowed}")
        common.require_choice("a_major", a_major, ("k", "m"))
        common.require_choice("b_major", b_major, ("k", "n"))
        # MN-major operands (A as (L, K, M), B as (L, K, N)): the MMA reads MN-major shared-memory tiles (the
        # instruction descriptor's transpose bits); FP8 codes only (packed FP4 is K-major).
        self.a_mn, self.b_mn = a_major == "m", b_major == "n"
        if not fp8 and (self.a_mn or self.b_mn):
            raise ValueError(f"a_major={a_major!r}, b_major={b_major!r}: MN-major operands need FP8 codes, got "
                             f"ab_dtype={ab_dtype!r}")
        if sf_vec_size == 16 and tuple(tile_mn) == (128, 256):
            raise ValueError("tile_mn=(128, 256) with sf_vec_size=16 is disabled in the seed for float32/bfloat16 "
                             f"C; expected {SUPPORTED_TILES_MN[0]}")
        self.ab_dtype_name = ab_dtype
        self.ab_dtype: Type[cutlass.Numeric] = _AB_DTYPES[ab_dtype]
        self.c_dtype: Type[cutlass.Numeric] = _C_DTYPES[c_dtype]
        self.has_alpha = False  # NVFP4's per-tensor alpha (BlackwellBlockScaledGemmAmaxAlpha)
        self.sf_dtype: Type[cutlass.Numeric] = _SF_DTYPES[sf_dtype]
        self.acc_dtype = cutlass.Float32
        self.sf_vec_size = sf_vec_size
        self.k_align = 16 if fp8 else 32  # elements per 16 bytes: TMA rows must be 16-byte multiples
        self.tile_mn = tuple(tile_mn)
        self.cluster_mn = tuple(cluster_mn)
        self.cta_group = tcgen05.CtaGroup.ONE
        major = lambda mn: cute.nvgpu.OperandMajorMode.MN if mn else cute.nvgpu.OperandMajorMode.K
        self.a_major, self.b_major = major(self.a_mn), major(self.b_mn)
        self.c_layout = cutlass.tensor_utils.LayoutEnum.ROW_MAJOR
        self.c_per_16_bytes = 128 // self.c_dtype.width  # C's rows start 16-byte aligned (TMA stores them)
        self.takes_grid_ctas = True  # the exported function takes max_ctas after l (catalog.fake_arguments)
        super().__init__()  # the warp roles; the whole of tensor memory (one CTA per SM)
        # Two accumulator buffers of TILE_N fp32 columns each. Beside the scales they fit when TILE_N is 128; at 256
        # they share the scales' worth of columns, with one pipeline stage whose phase picks the buffer.
        self.overlapping_acc = self.tile_mn[1] == 256
        self.acc_stages = 1 if self.overlapping_acc else 2
        self.c_stages = C_STAGES

    def can_implement(self, m: int, n: int, k: int, l: int) -> tuple[bool, str]:
        """Whether the kernel handles these sizes, and why not (the caller checks before launching)."""
        if min(m, n, k, l) < 1:
            return False, f"every size must be >= 1, got m={m}, n={n}, k={k}, l={l}"
        if k % self.k_align:
            return False, f"k must be a multiple of {self.k_align} (16-byte rows for TMA), got k={k}"
        for size, name, mn_major in ((m, "m", self.a_mn), (n, "n", self.b_mn)):
            if mn_major and size % 16:
                return False, (f"{name} must be a multiple of 16 for an MN-major operand (16-byte rows), "
                               f"got {name}={size}")
        if n % self.c_per_16_bytes:
            return False, (f"n must be a multiple of {self.c_per_16_bytes} (16-byte rows of C, which TMA stores), "
                           f"got n={n}")
        if l * max(m, n) * k >= 2**31 or l * m * n >= 2**31:
            return False, f"operands must hold fewer than 2**31 elements, got m={m}, n={n}, k={k}, l={l}"
        return True, ""

    # ------------------------------------------------------------------------------------------ set-up
    def _setup(self):
        """Derive the MMA, tile, cluster, stage and shared-memory layout facts (trace time, plain Python)."""
        self.tiled_mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, self.a_major, self.b_major, self.sf_dtype, self.sf_vec_size,
            self.cta_group, self.tile_mn)
        mma_k = cute.size(self.tiled_mma.shape_mnk, mode=[2])  # 32 for FP8, 64 for FP4
        tile_k = TILE_K[self.ab_dtype_name]
        assert tile_k == 4 * mma_k, (tile_k, mma_k)  # the self-check sizes K by TILE_K (no DSL there)
        self.mma_tiler = (*self.tile_mn, tile_k)  # one k-tile = 4 MMAs = 1 (FP8) to 4 (NVFP4) atoms along K
        self.cta_tile_mnk = self.mma_tiler  # one CTA per MMA (no two-CTA instructions)
        self.cluster_layout_vmnk = cute.tiled_divide(cute.make_layout((*self.cluster_mn, 1)),
                                                     (self.tiled_mma.thr_id.shape,))
        self.mcast_ctas_a = self.cluster_mn[1]  # A is shared by the CTAs of one cluster row (same M tile)
        self.mcast_ctas_b = self.cluster_mn[0]
        self.epi_tile = sm100_utils.compute_epilogue_tile_shape(
            self.cta_tile_mnk, False, self.c_layout, self.c_dtype)
        self.c_smem_staged = sm100_utils.make_smem_layout_epi(self.c_dtype, self.c_layout, self.epi_tile,
                                                              self.c_stages)
        self.ab_stages = self._ab_stages()
        self.a_smem_staged = sm100_utils.make_smem_layout_a(
            self.tiled_mma, self.mma_tiler, self.ab_dtype, self.ab_stages)
        self.b_smem_staged = sm100_utils.make_smem_layout_b(
            self.tiled_mma, self.mma_tiler, self.ab_dtype, self.ab_stages)
        self.sfa_smem_staged = blockscaled_utils.make_smem_layout_sfa(
            self.tiled_mma, self.mma_tiler, self.sf_vec_size, self.ab_stages)
        self.sfb_smem_staged = blockscaled_utils.make_smem_layout_sfb(
            self.tiled_mma, self.mma_tiler, self.sf_vec_size, self.ab_stages)

    def stage_bytes(self) -> int:
        """Shared-memory bytes of one A/B/SFA/SFB stage."""
        one = [sm100_utils.make_smem_layout_a(self.tiled_mma, self.mma_tiler, self.ab_dtype, 1),
               sm100_utils.make_smem_layout_b(self.tiled_mma, self.mma_tiler, self.ab_dtype, 1)]
        sfs = [blockscaled_utils.make_smem_layout_sfa(self.tiled_mma, self.mma_tiler, self.sf_vec_size, 1),
               blockscaled_utils.make_smem_layout_sfb(self.tiled_mma, self.mma_tiler, self.sf_vec_size, 1)]
        return (sum(cute.size_in_bytes(self.ab_dtype, x) for x in one)
                + sum(cute.size_in_bytes(self.sf_dtype, x) for x in sfs))

    def _ab_stages(self) -> int:
        """As many stages as fit beside the barriers, the amax slots and C's staging sub-tiles."""
        reserved = 1024 + self.buffer_align_bytes  # mbarriers, tmem pointer, amax slots; alignment slack
        c_bytes = cute.size_in_bytes(self.c_dtype, self.c_smem_staged)
        return min(MAX_AB_STAGES, (SMEM_CAPACITY - reserved - c_bytes) // self.stage_bytes())

    # ------------------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, c: cute.Tensor,
                 amax: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, l: cutlass.Int32,
                 max_ctas: cutlass.Int32, stream: cuda.CUstream):
        """Host side: (M, K, L)-shaped views of the flat buffers, the TMA atoms, the persistent grid; launch."""
        self._launch(a, b, sfa, sfb, c, amax, amax, m, n, k, l, max_ctas, stream)

    @cute.jit
    def _launch(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, c: cute.Tensor,
                amax: cute.Tensor, alpha: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
                l: cutlass.Int32, max_ctas: cutlass.Int32, stream: cuda.CUstream):
        """The body of both ABIs' `__call__`: `alpha` is NVFP4's (L,) float32 tensor with `has_alpha`, else a
        stand-in (amax) that the kernel never reads."""
        self._setup()
        k16 = cute.assume(k, divby=self.k_align)
        mA = common.operand_view(a, m, k16, l, self.a_mn)
        mB = common.operand_view(b, n, k16, l, self.b_mn)
        n16 = cute.assume(n, divby=self.c_per_16_bytes)  # can_implement and the handler require it
        mC = cute.make_tensor(c.iterator, cute.make_layout((m, n16, l), stride=(n16, 1, m * n16)))
        # The SPEC §3 atom buffer is the layout the block-scaled MMA reads: ((32,4,M'),(32,4,K'),L) over bytes.
        mSFA = cute.make_tensor(cute.recast_ptr(sfa.iterator, dtype=self.sf_dtype),
                                scale_layout(mA.shape, self.sf_vec_size))
        mSFB = cute.make_tensor(cute.recast_ptr(sfb.iterator, dtype=self.sf_dtype),
                                scale_layout(mB.shape, self.sf_vec_size))

        operands = self.operand_atoms(mA, mB, mSFA, mSFB)
        # C leaves by TMA stores of epilogue sub-tiles staged in shared memory; TMA writes no element past M or N.
        tma_atom_c, tma_c = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mC, cute.slice_(self.c_smem_staged, (None, None, 0)), self.epi_tile)

        tiles_mnl = cute.ceil_div(mC.shape, (self.cta_tile_mnk[0], self.cta_tile_mnk[1], 1))
        sched_params, grid = persistent.schedule(tiles_mnl, self.cluster_mn, max_ctas)

        self.set_stage_storage(c_staging=True)
        self.kernel(self.tiled_mma, *operands[0], *operands[1], *operands[2], *operands[3], tma_atom_c, tma_c, amax,
                    alpha, self.cluster_layout_vmnk, self.a_smem_staged,
                    self.b_smem_staged, self.sfa_smem_staged, self.sfb_smem_staged, self.c_smem_staged,
                    self.epi_tile, sched_params).launch(
            grid=grid, block=(self.threads_per_cta, 1, 1), cluster=(*self.cluster_mn, 1), min_blocks_per_mp=1,
            stream=stream)

    def operand_atoms(self, mA: cute.Tensor, mB: cute.Tensor, mSFA: cute.Tensor, mSFB: cute.Tensor) -> tuple:
        """Host side: the TMA atoms and views ((atom, view) each) of A, B, SFA and SFB for their (rows, K, L) views,
        and `self.tma_bytes`, the bytes one stage's loads bring."""
        cluster_shape = self.cluster_layout_vmnk.shape
        a_op = sm100_utils.cluster_shape_to_tma_atom_A(self.cluster_mn, self.tiled_mma.thr_id)
        b_op = sm100_utils.cluster_shape_to_tma_atom_B(self.cluster_mn, self.tiled_mma.thr_id)
        a_one = cute.slice_(self.a_smem_staged, (None, None, None, 0))
        b_one = cute.slice_(self.b_smem_staged, (None, None, None, 0))
        sfa_one = cute.slice_(self.sfa_smem_staged, (None, None, None, 0))
        sfb_one = cute.slice_(self.sfb_smem_staged, (None, None, None, 0))
        tma_atom_a, tma_a = cute.nvgpu.make_tiled_tma_atom_A(
            a_op, mA, a_one, self.mma_tiler, self.tiled_mma, cluster_shape)
        tma_atom_b, tma_b = cute.nvgpu.make_tiled_tma_atom_B(
            b_op, mB, b_one, self.mma_tiler, self.tiled_mma, cluster_shape)
        # Scale bytes travel as 16-bit TMA elements (the atom rows are 4 bytes; a byte element is too narrow).
        tma_atom_sfa, tma_sfa = cute.nvgpu.make_tiled_tma_atom_A(
            a_op, mSFA, sfa_one, self.mma_tiler, self.tiled_mma, cluster_shape, internal_type=cutlass.Int16)
        sfb_op = sm100_utils.cluster_shape_to_tma_atom_SFB(self.cluster_mn, self.tiled_mma.thr_id)
        tma_atom_sfb, tma_sfb = cute.nvgpu.make_tiled_tma_atom_B(
            sfb_op, mSFB, sfb_one, self.mma_tiler, self.tiled_mma, cluster_shape, internal_type=cutlass.Int16)
        self.tma_bytes = (cute.size_in_bytes(self.ab_dtype, a_one) + cute.size_in_bytes(self.ab_dtype, b_one)
                          + cute.size_in_bytes(self.sf_dtype, sfa_one) + cute.size_in_bytes(self.sf_dtype, sfb_one))
        return (tma_atom_a, tma_a), (tma_atom_b, tma_b), (tma_atom_sfa, tma_sfa), (tma_atom_sfb, tma_sfb)

    def set_stage_storage(self, *, c_staging: bool) -> None:
        """Host side: the shared storage of the epilogue warps' amax slots and the A, B, SFA, SFB stages, and with
        `c_staging` C's sub-tiles on their way to a TMA store."""
        buffers = {"sA": (self.ab_dtype, self.a_smem_staged.outer), "sB": (self.ab_dtype, self.b_smem_staged.outer),
                   "sSFA": (self.sf_dtype, self.sfa_smem_staged), "sSFB": (self.sf_dtype, self.sfb_smem_staged)}
        if c_staging:
            buffers["sC"] = (self.c_dtype, self.c_smem_staged.outer)
        self._set_shared_storage({"warp_amax": cute.struct.MemRange[cutlass.Int32, len(self.epilogue_warps)]}, buffers)

    def publish_tile_amax(self, amax_bits, storage, amax: cute.Tensor, batch, tidx) -> None:
        """The end of a tile's epilogue: once every epilogue thread is past the previous tile's reduction (thread 0
        has read the warp slots), the threads' max |C| bits (`amax_bits`) folded into amax[batch]."""
        cute.arch.barrier(barrier_id=self.epilogue_barrier_id, number_of_threads=self.epilogue_threads)
        warp_amax = storage.warp_amax.get_tensor(cute.make_layout((len(self.epilogue_warps),)))
        amax_i32 = cute.make_tensor(cute.recast_ptr(amax.iterator, dtype=cutlass.Int32), cute.make_layout((1,)))
        common.amax_block_reduce_and_publish(amax_bits, warp_amax, amax_i32.iterator + batch, tidx,
                                             len(self.epilogue_warps), self.epilogue_barrier_id)

    # ------------------------------------------------------------------------------------------ device
    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor,
               tma_atom_b: cute.CopyAtom, mB_nkl: cute.Tensor, tma_atom_sfa: cute.CopyAtom, mSFA_mkl: cute.Tensor,
               tma_atom_sfb: cute.CopyAtom, mSFB_nkl: cute.Tensor, tma_atom_c: cute.CopyAtom, mC_mnl: cute.Tensor,
               amax: cute.Tensor, alpha: cute.Tensor, cluster_layout_vmnk: cute.Layout,
               a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout, sfa_smem_staged: cute.Layout,
               sfb_smem_staged: cute.Layout, c_smem_staged: cute.ComposedLayout, epi_tile: cute.Tile,
               sched_params: persistent.SchedulerParams):
        """Device body: warp 5 produces (TMA), warp 4 issues the MMAs, warps 0-3 run the epilogue (TMA stores)."""
        tidx, _, _ = cute.arch.thread_idx()
        self.roles(tiled_mma, ((tma_atom_a, mA_mkl), (tma_atom_b, mB_nkl), (tma_atom_sfa, mSFA_mkl),
                               (tma_atom_sfb, mSFB_nkl)), (tma_atom_c,), cluster_layout_vmnk,
                   (a_smem_staged, b_smem_staged, sfa_smem_staged, sfb_smem_staged), epi_tile, sched_params,
                   lambda tCtAcc_base, storage, acc_pipeline: self._epilogue(
                       tiled_mma, epi_tile, tidx, tCtAcc_base, tma_atom_c, mC_mnl,
                       storage.sC.get_tensor(c_smem_staged.outer, swizzle=c_smem_staged.inner), amax, alpha, storage,
                       acc_pipeline, sched_params))

    @cute.jit
    def roles(self, tiled_mma: cute.TiledMma, operands, other_atoms, cluster_layout_vmnk: cute.Layout, staged,
              epi_tile: cute.Tile, sched_params: persistent.SchedulerParams, epilogue, plan=None):
        """The warp roles of the device body: `operands` ((TMA atom, (rows, K, L) view) of A, B, SFA, SFB),
        `other_atoms` (more TMA descriptors to prefetch), `staged` (the shared-memory layouts of A, B, SFA, SFB),
        `epi_tile` (the epilogue's sub-tile),
        `epilogue(tCtAcc_base, storage, acc_pipeline)` (the epilogue warps' part), `plan` (None: every tile
        loads its own M and N tiles; else as `PersistentKernel._produce` takes it)."""
        (tma_atom_a, mA_mkl), (tma_atom_b, mB_nkl), (tma_atom_sfa, mSFA_mkl), (tma_atom_sfb, mSFB_nkl) = operands
        a_smem_staged, b_smem_staged, sfa_smem_staged, sfb_smem_staged = staged
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.producer_warp:
            for atom in (tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb, *other_atoms):
                cpasync.prefetch_descriptor(atom)

        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cta_coord_vmnk = cluster_layout_vmnk.get_flat_coord(cta_rank)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # A stage is free again once every CTA that multicasts into it has seen its MMAs finish.
        ab_pipeline, acc_pipeline, tmem = self._make_pipelines(
            storage, cluster_layout_vmnk, self.mcast_ctas_a + self.mcast_ctas_b - 1, self.cluster_mn)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sSFA = storage.sSFA.get_tensor(sfa_smem_staged)
        sSFB = storage.sSFB.get_tensor(sfb_smem_staged)

        # Global tiles: (bM, bK, RestM, RestK, L) and friends, partitioned the MMA's way.
        tiler_mk = cute.slice_(self.mma_tiler, (None, 0, None))
        tiler_nk = cute.slice_(self.mma_tiler, (0, None, None))
        thr_mma = tiled_mma.get_slice(0)
        tCgA = thr_mma.partition_A(cute.local_tile(mA_mkl, tiler_mk, (None, None, None)))
        tCgB = thr_mma.partition_B(cute.local_tile(mB_nkl, tiler_nk, (None, None, None)))
        tCgSFA = thr_mma.partition_A(cute.local_tile(mSFA_mkl, tiler_mk, (None, None, None)))
        tCgSFB = thr_mma.partition_B(cute.local_tile(mSFB_nkl, tiler_nk, (None, None, None)))
        k_tiles = cute.size(tCgA, mode=[4])

        # TMA partitions: A and SFA multicast along the cluster's N side, B and SFB along its M side.
        a_cta_layout = cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, 0, None, 0)).shape)
        b_cta_layout = cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, None, 0, 0)).shape)
        tAsA, tAgA = cpasync.tma_partition(tma_atom_a, cta_coord_vmnk[2], a_cta_layout,
                                           cute.group_modes(sA, 0, 3), cute.group_modes(tCgA, 0, 3))
        tBsB, tBgB = cpasync.tma_partition(tma_atom_b, cta_coord_vmnk[1], b_cta_layout,
                                           cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3))
        tAsSFA, tAgSFA = cpasync.tma_partition(tma_atom_sfa, cta_coord_vmnk[2], a_cta_layout,
                                               cute.group_modes(sSFA, 0, 3), cute.group_modes(tCgSFA, 0, 3))
        tBsSFB, tBgSFB = cpasync.tma_partition(tma_atom_sfb, cta_coord_vmnk[1], b_cta_layout,
                                               cute.group_modes(sSFB, 0, 3), cute.group_modes(tCgSFB, 0, 3))
        tAsSFA, tAgSFA = cute.filter_zeros(tAsSFA), cute.filter_zeros(tAgSFA)
        tBsSFB, tBgSFB = cute.filter_zeros(tBsSFB), cute.filter_zeros(tBgSFB)

        # Tensor-memory columns: the accumulator buffers, then one k-tile of SFA and of SFB (static counts).
        sfa_tmem_layout = blockscaled_utils.make_tmem_layout_sfa(
            tiled_mma, self.mma_tiler, self.sf_vec_size, cute.slice_(sfa_smem_staged, (None, None, None, 0)))
        sfb_tmem_layout = blockscaled_utils.make_tmem_layout_sfb(
            tiled_mma, self.mma_tiler, self.sf_vec_size, cute.slice_(sfb_smem_staged, (None, None, None, 0)))
        tCrA, tCrB, tCtAcc_one = self._mma_fragments(tiled_mma, sA, sB)
        sf_fake_ptr = cute.recast_ptr(tCtAcc_one.iterator, dtype=self.sf_dtype)
        sfa_cols = tcgen05.find_tmem_tensor_col_offset(cute.make_tensor(sf_fake_ptr, sfa_tmem_layout))
        sfb_cols = tcgen05.find_tmem_tensor_col_offset(cute.make_tensor(sf_fake_ptr, sfb_tmem_layout))
        self.acc_buffer_columns = self.tile_mn[1]  # where the second accumulator buffer starts
        if cutlass.const_expr(self.overlapping_acc):
            # It starts inside the first by the columns NVIDIA's kernel sets aside for the scales (one per 32 rows
            # of the tile and MMA of a k-tile: more than the layouts take, sfa_cols + sfb_cols), which then follow
            # the second buffer up to the end of tensor memory.
            mmas_per_k_tile = self.mma_tiler[2] // cute.size(tiled_mma.shape_mnk, mode=[2])
            self.sf_tmem_columns = (self.tile_mn[0] + self.tile_mn[1]) // 32 * mmas_per_k_tile
            assert sfa_cols + sfb_cols <= self.sf_tmem_columns, (sfa_cols, sfb_cols)
            self.acc_buffer_columns = self.tile_mn[1] - self.sf_tmem_columns
            tCrA, tCrB, tCtAcc_fake = self._mma_fragments(tiled_mma, sA, sB, self.acc_buffer_columns)
        else:
            self.sf_tmem_columns = sfa_cols + sfb_cols
            tCtAcc_fake = tCtAcc_one
        acc_cols = tcgen05.find_tmem_tensor_col_offset(tCtAcc_fake)
        self.tmem_columns_used = acc_cols + sfa_cols + sfb_cols  # reported by precompile; TMEM_COLUMNS allocated
        self.acc_buffers = cute.size(tCtAcc_fake, mode=[3])
        self.epi_columns = cute.size(epi_tile[1])
        self.acc_release_subtile = self.sf_tmem_columns // self.epi_columns

        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_mn)

        if warp_idx == self.producer_warp:
            # ------------------------------------------------------------------------------ producer
            mcast = self.mcast_ctas_a > 1 or self.mcast_ctas_b > 1
            a_mask = b_mask = None
            if cutlass.const_expr(mcast):
                a_mask = cpasync.create_tma_multicast_mask(cluster_layout_vmnk, cta_coord_vmnk, mcast_mode=2)
                b_mask = cpasync.create_tma_multicast_mask(cluster_layout_vmnk, cta_coord_vmnk, mcast_mode=1)
            # A and SFA are read by the M tile, B and SFB by the N tile.
            self._produce(ab_pipeline, sched_params, k_tiles,
                          ((tma_atom_a, tAgA, tAsA, 0, a_mask), (tma_atom_b, tBgB, tBsB, 1, b_mask),
                           (tma_atom_sfa, tAgSFA, tAsSFA, 0, a_mask), (tma_atom_sfb, tBgSFB, tBsSFB, 1, b_mask)),
                          batched=True, plan=plan)

        if warp_idx == self.mma_warp:
            # ------------------------------------------------------------------------------ mma
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc_base = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)
            # Scale factors live in tensor memory right after the accumulator stages: SFA, then SFB.
            tCtSFA = cute.make_tensor(cute.recast_ptr(acc_ptr + acc_cols, dtype=self.sf_dtype), sfa_tmem_layout)
            tCtSFB = cute.make_tensor(cute.recast_ptr(acc_ptr + acc_cols + sfa_cols, dtype=self.sf_dtype),
                                      sfb_tmem_layout)
            scales = (self._scale_copy_to_tmem(sSFA, tCtSFA), self._scale_copy_to_tmem(sSFB, tCtSFB))
            self._mma(tiled_mma, tCtAcc_base, tCrA, tCrB, ab_pipeline, acc_pipeline, sched_params, k_tiles, scales,
                      plan=plan)

        if warp_idx < self.mma_warp:
            # ------------------------------------------------------------------------------ epilogue
            self._with_tmem(tmem, tCtAcc_fake.layout,
                            lambda tCtAcc_base: epilogue(tCtAcc_base, storage, acc_pipeline))

    def _scale_copy_to_tmem(self, sSF: cute.Tensor, tSF: cute.Tensor):
        """The tcgen05.cp (4x32x128b) copy of staged scales in shared memory to their tensor-memory tensor `tSF`:
        (copy, its source by stage, its destination, tSF), as `PersistentKernel._mma` takes each of its scales."""
        tCsSF = cute.filter_zeros(sSF)  # (MMA, MMA_MN, MMA_K, STAGE)
        tCtSF = cute.filter_zeros(tSF)  # (MMA, MMA_MN, MMA_K)
        s2t = tcgen05.make_s2t_copy(cute.make_copy_atom(tcgen05.Cp4x32x128bOp(self.cta_group), self.sf_dtype), tCtSF)
        thr = s2t.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(s2t, thr.partition_S(tCsSF))
        return s2t, src, thr.partition_D(tCtSF), tSF

    def accumulator_reads(self, tiled_mma: cute.TiledMma, epi_tile: cute.Tile, tidx: cutlass.Int32,
                          tCtAcc_base: cute.Tensor, mC_mnl: cute.Tensor) -> tuple:
        """The epilogue thread's view of the accumulators: (the tensor-memory load, its source by (sub-tile, stage),
        C's tiles by epilogue sub-tile, the (row, col, l) coordinates of this thread's elements likewise, and the
        registers one sub-tile loads into)."""
        tiler_mn = cute.slice_(self.mma_tiler, (None, None, 0))
        thr_mma = tiled_mma.get_slice(0)
        tCgC = thr_mma.partition_C(cute.local_tile(mC_mnl, tiler_mn, (None, None, None)))
        # The same partition applied to coordinates: (row, col, l) of every element, for the store predicates.
        tCcC = thr_mma.partition_C(cute.local_tile(cute.make_identity_tensor(mC_mnl.shape), tiler_mn,
                                                   (None, None, None)))
        t2r_atom = sm100_utils.get_tmem_load_op(self.cta_tile_mnk, self.c_layout, self.c_dtype, self.acc_dtype,
                                                epi_tile, False)
        tAcc_epi = cute.flat_divide(tCtAcc_base[((None, None), 0, 0, None)], epi_tile)
        t2r = tcgen05.make_tmem_copy(t2r_atom, tAcc_epi[(None, None, 0, 0, 0)])
        thr_t2r = t2r.get_slice(tidx)
        tTR_tAcc_base = thr_t2r.partition_S(tAcc_epi)  # (T2R, T2R_M, T2R_N, EPI_M, EPI_N, STAGE)
        gC_epi = cute.flat_divide(tCgC[((None, None), 0, 0, None, None, None)], epi_tile)
        tTR_cC_all = thr_t2r.partition_D(cute.flat_divide(tCcC[((None, None), 0, 0, None, None, None)],
                                                          epi_tile))
        tTR_rAcc = cute.make_rmem_tensor(thr_t2r.partition_D(gC_epi)[(None, None, None, 0, 0, 0, 0, 0)].shape,
                                         self.acc_dtype)
        return t2r, tTR_tAcc_base, gC_epi, tTR_cC_all, tTR_rAcc

    @cute.jit
    def _epilogue(self, tiled_mma: cute.TiledMma, epi_tile: cute.Tile, tidx: cutlass.Int32, tCtAcc_base: cute.Tensor,
                  tma_atom_c: cute.CopyAtom, mC_mnl: cute.Tensor, sC: cute.Tensor, amax: cute.Tensor,
                  alpha: cute.Tensor, storage, acc_pipeline, sched_params: persistent.SchedulerParams):
        """Per tile and epilogue sub-tile: tensor memory -> registers, amax of the in-bounds elements, C's dtype
        into a shared-memory sub-tile, one TMA store of it; then amax into amax[l]."""
        t2r, tTR_tAcc_base, gC_epi, tTR_cC_all, tTR_rAcc = self.accumulator_reads(tiled_mma, epi_tile, tidx,
                                                                                  tCtAcc_base, mC_mnl)
        tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, self.c_dtype)
        # Registers -> the shared-memory sub-tile (the store op that matches the tensor-memory load's layout),
        # then TMA: the sub-tile as one bulk copy to its place in C.
        r2s = cute.make_tiled_copy_D(sm100_utils.get_smem_store_op(self.c_layout, self.c_dtype, self.acc_dtype, t2r),
                                     t2r)
        thr_r2s = r2s.get_slice(tidx)
        tRS_sC = thr_r2s.partition_D(sC)  # (R2S, R2S_M, R2S_N, C_STAGE)
        tRS_rC = r2s.retile(tTR_rC)
        bSG_sC, bSG_gC_all = cpasync.tma_partition(tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
                                                   cute.group_modes(gC_epi, 0, 2))
        c_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=self.c_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.epilogue_threads))
        bounds = mC_mnl.shape
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        subtiles = self.tile_mn[1] // cute.size(epi_tile[1])

        walk = persistent.TileWalk(sched_params, self.cluster_mn)
        index = walk.first
        done = cutlass.Int32(0)  # tiles this CTA has stored: their sub-tiles cycle through the C staging buffers
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.acc_stages)
        while index < walk.count:
            tile_m, tile_n, batch = walk.tile(index)
            buffer = self.acc_buffer(acc_state, producer=False)
            # Overlapping buffers share buffer 0's last and buffer 1's first columns: read those first.
            reverse = self.overlapping_acc and buffer == 0
            tTR_tAcc = cute.group_modes(tTR_tAcc_base[(None, None, None, None, None, buffer)], 3, 5)
            bSG_gC = cute.group_modes(bSG_gC_all[(None, None, None, tile_m, tile_n, batch)], 1, 3)
            tTR_cC = cute.group_modes(tTR_cC_all[(None, None, None, None, None, tile_m, tile_n, batch)], 3, 5)
            acc_pipeline.consumer_wait(acc_state)
            first_subtile = done * subtiles
            amax_bits = cutlass.Int32(0)
            for step in cutlass.range(subtiles):
                sub = step
                if cutlass.const_expr(self.overlapping_acc):
                    if reverse:
                        sub = subtiles - 1 - step
                cute.copy(t2r, tTR_tAcc[(None, None, None, sub)], tTR_rAcc)
                # tcgen05.ld is asynchronous: wait for it before reading the registers (and before the release
                # below hands the buffer back to the MMA warp), as the sm_100a proj_rope epilogue does.
                cute.arch.fence_view_async_tmem_load()
                if cutlass.const_expr(self.overlapping_acc):
                    if step == self.acc_release_subtile:  # the shared columns are in registers
                        with cute.arch.elect_one():
                            acc_pipeline.consumer_release(acc_state)
                        acc_state.advance()
                if cutlass.const_expr(self.has_alpha):  # NVFP4: C and amax are of alpha·acc (SPEC §1, §4)
                    tTR_rAcc.store(tTR_rAcc.load() * alpha[batch])
                cC = tTR_cC[(None, None, None, sub)]
                for i in cutlass.range_constexpr(cute.size(tTR_rAcc)):
                    if cute.elem_less(cC[i], bounds):  # rows past M and columns past N hold no result
                        amax_bits = cutlass.max(amax_bits, common.abs_bits(tTR_rAcc[i]))
                tTR_rC.store(tTR_rAcc.load().to(self.c_dtype))
                c_stage = (first_subtile + step) % self.c_stages
                cute.copy(r2s, tRS_rC, tRS_sC[(None, None, None, c_stage)])
                # The generic-proxy stores must be visible to the TMA (async proxy) before it reads the sub-tile.
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=self.epilogue_barrier_id, number_of_threads=self.epilogue_threads)
                if warp_idx == self.epilogue_warps[0]:
                    cute.copy(tma_atom_c, bSG_sC[(None, c_stage)], bSG_gC[(None, sub)])
                    c_pipeline.producer_commit()
                    c_pipeline.producer_acquire()  # the next use of a staging buffer waits for its store's read
                cute.arch.barrier(barrier_id=self.epilogue_barrier_id, number_of_threads=self.epilogue_threads)
            if cutlass.const_expr(not self.overlapping_acc):
                # The accumulator stage is in registers now: hand it back to the MMA warp before the reduction.
                with cute.arch.elect_one():
                    acc_pipeline.consumer_release(acc_state)
                acc_state.advance()
            self.publish_tile_amax(amax_bits, storage, amax, batch, tidx)
            done += 1
            index += walk.stride
        c_pipeline.producer_tail()  # the last stores have read their sub-tiles before the CTA exits


class BlackwellBlockScaledGemmAmaxAlpha(BlackwellBlockScaledGemmAmax):
    """NVFP4 with its per-tensor fp32 scale: C = alpha[l]·(A·sfa)(B·sfb)^T, amax of that, before C's conversion.

    The exported function takes one more tensor, `alpha` ((L,) float32), right after amax.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.has_alpha = True

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, c: cute.Tensor,
                 amax: cute.Tensor, alpha: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
                 l: cutlass.Int32, max_ctas: cutlass.Int32, stream: cuda.CUstream):
        """Host side of the alpha ABI: as `BlackwellBlockScaledGemmAmax.__call__`, alpha[l] applied per tile."""
        self._launch(a, b, sfa, sfb, c, amax, alpha, m, n, k, l, max_ctas, stream)
