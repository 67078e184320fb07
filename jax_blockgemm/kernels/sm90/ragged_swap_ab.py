"""Hopper (sm_90a) ragged GEMM for MXFP8 E4M3, MXFP4 and NVFP4 weights with the roles swapped: each expert's weights
are the wgmma's A operand, converted from codes to bf16 in registers (register-sourced wgmma), and the tokens,
dequantized to bf16 before the launch, its B operand from shared memory.

Why: in a mixture-of-experts layer each weight element meets only T/G tokens (512 at T = 16384, G = 32), so the
gemm_amax mainloop (kernels/sm90/gemm_amax.py), which converts both operands' codes through shared memory on every
tile, spends as long converting as multiplying. Here only the weights are converted, once per 128-token tile, with
no shared-memory round trip: a thread loads its 32 codes of two weight rows per k-tile (16-byte shared loads),
turns them into its own A-fragment registers, and the tensor cores read them there. The tokens, T x K, are
dequantized once before the launch (MXFP8 codes by kernels/dequantize.py, written in this kernel's column order; about
a tenth of the GEMM's time). Design and figures: docs/design/moe.md.

The A fragment of a bf16 m64nNk16 wgmma gives lane (g, c) = (lane / 4, lane % 4) of warp w the k's 2c, 2c + 1 and
2c + 8, 2c + 9 of rows 16w + g and + 8 per k-step, while a k-tile is 128 codes of each row (eight k-steps) and the
thread holds codes 32c .. 32c + 31 of its rows: one 32-wide scale block, so one scale byte per row and k-tile, and for
FP8 two 16-byte loads from rows stored 128-byte swizzled. A dot product does not care about the order of k, so the
thread feeds its codes to its slots as loaded and the tokens arrive with the same permutation of every 128 columns
(`swap_ab_layout.swap_ab_tokens`): logical column 16s + 8h + 2c + j of a k-tile holds column 32c + 4s + 2h + j
(k-step s, half h, pair element j). (K-tiles of 64 codes, which the MoE tile had first, paid each k-tile's fixed work,
barriers, wgmma issues and scale bytes, twice per code.)

E4M3 to bf16 exactly as the decode kernel does it (kernels/weight_stream.py): bit moves make code·2^-120 a bf16
pair, then one packed multiply by 2^120·scale (scale bytes up to 134, voted per warp; else two multiplies); a NaN
code among the codes of a row a thread loads at once makes that row's factor NaN for them, which gives the outputs
a NaN product gives.

FP4 (packed E2M1, two codes a byte): a k-tile is 64 bytes of a row, a thread's 32 codes one 16-byte load. The bit model
of kernels/common.py (`e2m1_pair_bits`) pairs codes i and i + 4 of a 32-bit word as code·2^-126, so the fragment's pairs
come in another order and the tokens take their own permutation (`swap_ab_layout`, fp4=True): logical column 16s + 8h +
2c + j of a k-tile holds column 32c + 8(s // 2) + 2(s % 2) + h + 4j. MXFP4 then multiplies once by 2^126·scale (bytes up
to 128, voted per warp; else twice); NVFP4 multiplies by 2^126 and by its E4M3 block scale (one per 16 codes: the two
halves of a thread's codes of a row).

alpha, one float32 per weight (per batch and group), multiplies the sums in every format: NVFP4's per-tensor (or
per-expert) factor, ones for the MX formats from ragged_gemm_amax; the weight-only ragged matmul passes its weights'
own alpha.

Per CTA: one work item (a group-local table, `ragged.group_items`: up to 128 of a group's tokens from the item's first
row, where the tokens' TMA view starts) times a 128-row tile of the group's weights: warpgroups 1 and 2 of 64 weight
rows each, warp 0 the TMA producer (tokens and codes in 4 stages of 48 KB, FP4's 5 of 40). An item of fewer tokens (a
group's last, or a small group's only one: 245 of 659 items at the benchmark's 256 skewed groups) runs the narrowest
wgmma of 32, 64 or 96 tokens that holds them, through the same stages (a stage's first token rows are a swizzled tile of
their own): the tensor cores' work follows the tokens, the weights' conversion does not. Each warpgroup alternates two
register fragments: it converts k-tile k + 1 while the tensor cores multiply k-tile k. Every two k-tiles (256 of K) the
tensor cores' partial sum is added to the fp32 accumulator with round-to-nearest adds (their truncating sums drift with
K: 6e-6 relative over 8192 as gemm_amax measured, so about 2e-7 over 256): SPEC §7's "exact" class. The accumulator
holds C transposed (weight rows x tokens); the epilogue writes it through shared memory (reusing the stages) and stores
C rows of the item with 16-byte stores. amax needs nothing zeroed first: the batch's two words of a tally the handler
keeps per call site (zero between launches) let the first CTA to arrive zero amax and open it (`ptx_ops.tally_open`);
each CTA's producer warp takes its turn there once its loads are issued, so its trips to L2 overlap the last k-tiles'
MMAs, and the CTA then folds the max |C| of what it stored into amax with one reduction that nothing waits for (an empty
item's CTA arrives and leaves at once: `ptx_ops.tally_pass`); without a tally (a caller that drops amax) the kernel
skips amax.

The decode tiles (few tokens, one 64-row warpgroup) leave an SM one conversion chain per CTA; with `k_split` parts the
CTA runs that many MMA warpgroups on the same weight rows, part p multiplying K's promotion groups p, p + k_split, ...
out of stages it alone reads (two promotion groups of stages per part), and the epilogue adds the parts' fp32 tiles
in part order: the same bits on every run. The 16-token tile takes the tokens in their own order (no XLA pass before
the launch): warps 1-3 of the producer warpgroup reorder each landed k-tile in shared memory and mark it ready on a
second barrier per stage, which the MMA warpgroups wait for (`order_tokens`).

ABI: the ragged one with amax's tally after alpha and the scales' form last (catalog "ragged", schedule "swap_ab"),
fn(a, b, sfa, sfb, items, c, amax, alpha, tally, t, n, k, l, g, max_items, sf_atom, stream), with a the bf16 tokens
(L, T, K256), permuted (`swap_ab_layout.kernel_tokens`: in their own order for the 16-token tile), K256 = K rounded up
to 256 (zeros past K); b the codes (L·G, N, K), packed FP4 (L·G, N, K/2); sfb
their scale bytes (E8M0, or E4M3 for NVFP4) compact, (L·G, N, ceil(K/block)), for sf_atom = 0, or SPEC §3's 128x4
atoms of the L·G weights for sf_atom = 1: whichever form the caller holds, read in place (converting would cost a
pass over every weight's scales per call: 2.75 µs of a 7168 x 7168 decode GEMM's 30 on the H200); sfa an empty uint8
buffer; alpha (L·G,) float32, one per weight; c (L, T, N) float32 or bfloat16; amax (L,) float32 (written, never
read); tally (L,) int64 (two int32 words per batch), zero at the launch and left so, or a null pointer where amax is
not wanted; k the logical K.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils

from jax_blockgemm import swap_ab_layout
from jax_blockgemm.kernels import common, epilogue, ptx_ops
from jax_blockgemm.kernels.sm90 import tma_pipeline
from jax_blockgemm.kernels.sm90.gemm_amax import smem_layout_staged
from jax_blockgemm.kernels.sm90.ragged import ITEM_ROWS, group_item

C_DTYPES = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16}
K_PAD = swap_ab_layout.SWAP_AB_K_PAD  # K per partial sum of the tensor cores, added to the fp32 accumulator; the
# tokens' K is padded to it: the mainloop runs whole promotion groups
MAX_STAGE_BYTES = 200 * 1024  # the stages' shared memory, leaving room for barriers within the SM's 227 KB: the MoE
# tile takes as many stages as fit (4 of 48 KB with FP8 codes: 32 KB of tokens, 16 KB of codes; 5 of 40 KB with FP4)
REGISTERS = 65536  # per SM, all a CTA of these kernels is launched with (one CTA per SM)
MIN_CONSUMER_REGS = 144  # the least an MMA warpgroup gets: the 16-token tile's three K parts convert unspilled
TOKEN_WRITER_WARPS = 3  # the 16-token tile: warps 1-3 of the producer warpgroup order the tokens' columns, k-tile
# kt by warp 1 + kt % 3
NARROW_ITEM_WIDTHS = (32, 64, 96)  # the MoE tile's narrower wgmmas, for items of fewer tokens than ITEM_ROWS
SWIZZLE_BYTES = 128  # a token row's line in a swizzle atom (64 bf16 columns): a 128-column k-tile has two atoms
E8M0 = "float8_e8m0fnu"
# The weight formats the kernel converts: (codes, scale block, scale dtype): MXFP8 E4M3, MXFP4, NVFP4
WEIGHT_FORMATS = (("float8_e4m3fn", 32, E8M0), ("float4_e2m1fn", 32, E8M0), ("float4_e2m1fn", 16, "float8_e4m3fn"))


class HopperRaggedSwapAB:
    """C[rows of group g] = alpha[l, g]·(tokens)(B[g]·sfb)^T per batch l and amax[l] = max|C[l]|, for bf16 tokens
    (permuted, `swap_ab_layout.swap_ab_tokens`) and MXFP8 E4M3, MXFP4 or NVFP4 weights (alpha one float32 per
    weight); f32 or bf16 C. Compile-time configuration only."""

    def __init__(self, *, c_dtype: str = "float32", token_rows: int = ITEM_ROWS, weight_warpgroups: int = 2,
                 k_split: int = 1, w_dtype: str = "float8_e4m3fn", sf_vec_size: int = 32, sf_dtype: str = E8M0):
        """token_rows: tokens per CTA tile (the wgmma's N; an item's rows past it are not computed, so a tile
        smaller than ITEM_ROWS serves only calls whose groups fit in it); weight_warpgroups: MMA warpgroups of a
        part, each 64 weight rows; k_split: parts per CTA, part p taking K's promotion groups p, p + k_split, ...
        of the same weight rows (more conversion chains per SM for few tokens; the parts' fp32 tiles summed in
        part order); (w_dtype, sf_vec_size, sf_dtype): the weights' format, one of WEIGHT_FORMATS."""
        common.require_choice("c_dtype", c_dtype, tuple(C_DTYPES))
        common.require_choice("token_rows", token_rows, (16, 32, 64, ITEM_ROWS))
        common.require_choice("weight_warpgroups", weight_warpgroups, (1, 2))
        common.require_choice("k_split", k_split, (1, 2, 3))
        common.require_choice("(w_dtype, sf_vec_size, sf_dtype)", (w_dtype, sf_vec_size, sf_dtype), WEIGHT_FORMATS)
        self.fp4 = w_dtype == "float4_e2m1fn"
        # the 16-token tile takes the tokens in their own order and puts each k-tile's columns in the fragments' order
        # itself (warps 1-3 of the producer warpgroup, in shared memory): no pass over x before the launch
        self.orders_tokens = swap_ab_layout.kernel_orders_tokens(token_rows)
        self.sf_e4m3 = sf_dtype == "float8_e4m3fn"  # NVFP4: E4M3 scales per 16 codes, and alpha
        self.sf_vec_size = sf_vec_size
        self.a_dtype = cutlass.BFloat16  # the tokens, as the kernel reads them
        self.ab_dtype = cutlass.Uint8 if self.fp4 else cutlass.Float8E4M3FN  # the weights' codes (FP4: packed)
        self.k_tile = swap_ab_layout.SWAP_AB_K_TILE
        self.promote_tiles = K_PAD // self.k_tile  # k-tiles per promotion group
        self.row_bytes = self.k_tile // 2 if self.fp4 else self.k_tile  # bytes of a weight row per k-tile
        # FP8's 128-byte rows lie 128-byte swizzled: a thread's two 16-byte loads of a row would otherwise meet the
        # same banks in every row (`_code_addresses`); FP4's 64-byte rows lie plain
        self.swizzled_codes = self.row_bytes == SWIZZLE_BYTES
        # scale blocks a lane's 32 codes of a row span per k-tile: 2 for NVFP4, else 1
        self.lane_blocks = self.k_tile // 4 // sf_vec_size
        self.c_name = c_dtype
        self.c_dtype = C_DTYPES[c_dtype]
        self.acc_dtype = cutlass.Float32
        self.weight_warpgroups = weight_warpgroups
        self.k_split = k_split
        self.tile_mnk = (token_rows, 64 * weight_warpgroups, self.k_tile)  # tokens (the TMA's A), weight rows, k-tile
        # the narrower wgmma widths (tokens) of an item whose rows fit one (a group's last, or a small group): the
        # MoE tile only (the decode tiles are sized to their calls)
        self.narrow_widths = NARROW_ITEM_WIDTHS if token_rows == ITEM_ROWS else ()
        self.c_stage_stride = self.tile_mnk[1] + 4  # words per token row of the epilogue's fp32 tile (the 4 extra
        # spread the banks)
        self.threads_per_wg = 128
        self.release_warps = 4 * weight_warpgroups  # the warps that read (and release) a stage: one part's
        self.num_consumer_warps = self.release_warps * k_split
        # Warpgroup 0 produces (its warp 0 issues the TMA copies) with few registers, the MMA warpgroups multiply
        # with up to 232: ptxas budgets a wgmma kernel's registers per warpgroup, so 384 threads would cap all at
        # 168. setmaxnreg moves registers between warpgroups within what the CTA was launched with (64 K).
        mma_warpgroups = weight_warpgroups * k_split
        self.threads_per_cta = (1 + mma_warpgroups) * self.threads_per_wg
        # what ptxas gives each thread at launch (one CTA per SM; whole warps of 256): setmaxnreg can only share out
        # that much, and a warpgroup asking for more than is free waits forever
        self.launch_regs = REGISTERS // self.threads_per_cta // 8 * 8
        # the producer warpgroup's least: 40 for the TMA warp, 64 where its other warps order the tokens' columns
        # (at 56 they spilled 8 bytes ordering FP8's 128-column k-tiles)
        least_producer_regs = 64 if self.orders_tokens else 40
        per_warpgroup = (self.launch_regs * (1 + mma_warpgroups) - least_producer_regs) // mma_warpgroups
        self.consumer_regs = min(232, per_warpgroup // 8 * 8)
        # the producer warpgroup keeps what the MMA warpgroups leave (the 16-token tile: 80 beside three parts at 144)
        self.producer_regs = min(232, (self.launch_regs * (1 + mma_warpgroups) - self.consumer_regs * mma_warpgroups)
                                 // 8 * 8)
        if self.consumer_regs < MIN_CONSUMER_REGS:
            raise ValueError(f"weight_warpgroups * k_split must leave each MMA warpgroup {MIN_CONSUMER_REGS} "
                             f"registers a thread, got {weight_warpgroups} * {k_split}")
        self.epilogue_barrier_id = 1
        self.amax_barrier_id = 2  # the MMA warps' amax slots written and the producer's turn at the tally taken
        # k_split parts: two promotion groups of stages each (at least one is needed: a part waits for its next
        # group's first k-tile before it releases its current group's last), so each part's next group streams in
        # while it multiplies the current one; part p's groups then always land in the same stages
        stage_bytes = token_rows * self.k_tile * 2 + 64 * weight_warpgroups * self.row_bytes
        self.stages = MAX_STAGE_BYTES // stage_bytes if k_split == 1 else 2 * k_split * self.promote_tiles
        if self.stages * stage_bytes > MAX_STAGE_BYTES:
            raise ValueError(f"{self.stages} stages of {stage_bytes} bytes exceed {MAX_STAGE_BYTES} bytes of shared "
                             f"memory: token_rows={token_rows}, weight_warpgroups={weight_warpgroups}, "
                             f"k_split={k_split}")
        # the epilogue's fp32 tiles, one per part, lie over the tokens' drained stages
        assert k_split * token_rows * self.c_stage_stride * 4 <= self.stages * token_rows * self.k_tile * 2
        self.has_alpha = True  # the ABI passes alpha, one per weight (L·G)

    def can_implement(self, t: int, n: int, k: int, l: int, g: int = 1) -> tuple[bool, str]:
        """Whether the kernel handles these sizes, and why not: K a multiple of 16 (FP8) or 32 (FP4): 16-byte TMA
        rows of codes, 32-bit element counts for the tokens, C and one weight, and T within one tile where the tile
        holds fewer tokens than a work item (the decode tile)."""
        if min(t, n, k, l, g) < 1:
            return False, f"every size must be >= 1, got t={t}, n={n}, k={k}, l={l}, g={g}"
        row_codes = 32 if self.fp4 else 16
        if k % row_codes:
            return False, (f"k must be a multiple of {row_codes} (16-byte rows of "
                           f"{'packed FP4' if self.fp4 else 'E4M3'} codes), got k={k}")
        if self.tile_mnk[0] < ITEM_ROWS and t > self.tile_mnk[0]:  # a work item's rows past the tile go uncomputed
            return False, f"t must be at most {self.tile_mnk[0]} (one tile of tokens), got t={t}"
        k_pad = -(-k // K_PAD) * K_PAD
        if l * t * k_pad >= 2**31 or l * t * n >= 2**31 or n * k >= 2**31 or l * g >= 2**31:
            return False, f"tokens, c and one weight must hold fewer than 2**31 elements, got t={t}, n={n}, k={k}"
        return True, ""

    # ------------------------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, items: cute.Tensor,
                 c: cute.Tensor, amax: cute.Tensor, alpha: cute.Tensor, tally: cute.Tensor, t: cutlass.Int32,
                 n: cutlass.Int32, k: cutlass.Int32, l: cutlass.Int32, g: cutlass.Int32, max_items: cutlass.Int32,
                 sf_atom: cutlass.Int32, stream: cuda.CUstream):
        """Host side: TMA views of the tokens (L batches of (T, K256) bf16) and codes (L·G of (N, K) bytes, (N, K/2)
        packed FP4), a launch of (N tiles, max_items, L) CTAs."""
        bt, bw, bk = self.tile_mnk
        k_pad = cute.assume((k + K_PAD - 1) // K_PAD * K_PAD, divby=K_PAD)
        tokens = common.operand_view(a, t, k_pad, l, False)
        code_row = cute.assume(k // 2 if cutlass.const_expr(self.fp4) else k, divby=16)  # bytes per weight row
        codes = common.operand_view(b, n, code_row, l * g, False)
        tiled_mma = self._tiled_mma(bt)
        x_staged = smem_layout_staged(bt, cutlass.BFloat16, self.stages, bk)
        # The codes' stages as rows of a k-tile's bytes: each thread reads a quarter of two rows. FP4's rows of 64
        # bytes lie plain: a quarter-warp's two rows are contiguous bytes, no bank conflict. FP8's rows of 128 bytes
        # lie 128-byte swizzled (16-byte piece p of row r at 16·(p ^ r % 8)), which spreads a quarter-warp's pieces
        # of two rows over all the banks.
        rb = self.row_bytes
        swizzle = cute.make_swizzle(3, 4, 3) if cutlass.const_expr(self.swizzled_codes) else cute.make_swizzle(0, 4, 3)
        w_staged = cute.make_composed_layout(swizzle, 0, cute.make_layout((bw, rb, self.stages),
                                                                          stride=(rb, 1, bw * rb)))
        tma_atom_x, tma_x = tma_pipeline.load_atom(tokens, x_staged, (bt, bk))
        tma_atom_w, tma_w = tma_pipeline.load_atom(codes, w_staged, (bw, rb))

        @cute.struct
        class SharedStorage:
            pipeline_mbars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            ready_mbars: cute.struct.MemRange[cutlass.Int64, self.stages]  # the 16-token tile's ordered tokens
            warp_amax: cute.struct.MemRange[cutlass.Int32, self.num_consumer_warps]
            sA: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(x_staged)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(w_staged)], 1024]

        self.shared_storage = SharedStorage
        tiles_n = (n + bw - 1) // bw
        self.kernel(tma_atom_x, tma_x, tma_atom_w, tma_w, sfb, items, c, amax, alpha, tally, t, n, k, g, max_items,
                    sf_atom, tiled_mma, x_staged, w_staged).launch(grid=(tiles_n, max_items, l),
                                                          block=(self.threads_per_cta, 1, 1), min_blocks_per_mp=1,
                                                          stream=stream)

    def _tiled_mma(self, tokens: int) -> cute.TiledMma:
        """The register-sourced bf16 wgmma of the MMA warpgroups: 64 weight rows each, `tokens` wide."""
        kmajor = cute.nvgpu.OperandMajorMode.K
        return sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, kmajor, kmajor, self.acc_dtype, (self.weight_warpgroups, 1, 1),
            tiler_mn=(64, tokens), a_source=cute.nvgpu.warpgroup.OperandSource.RMEM)

    # ---------------------------------------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, tma_atom_x: cute.CopyAtom, mX: cute.Tensor, tma_atom_w: cute.CopyAtom, mW: cute.Tensor,
               sfb: cute.Tensor, items: cute.Tensor, c: cute.Tensor, amax: cute.Tensor, alpha: cute.Tensor,
               tally: cute.Tensor, t: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, g: cutlass.Int32,
               max_items: cutlass.Int32, sf_atom: cutlass.Int32, tiled_mma: cute.TiledMma,
               x_staged: cute.ComposedLayout, w_staged: cute.ComposedLayout):
        """Device body: the CTA reads its item and runs (weight tile, item), or, when the item is empty, only
        counts itself in amax's tally. Items of group -1 (rows of no group) store zeros after one group of
        promote_tiles k-tiles (the mainloop's unit: the producer must fill, and the consumers release, a whole
        group)."""
        tile_n, item, batch = cute.arch.block_idx()
        group, rows_lo, rows_hi = group_item(items, batch, item, max_items, t, g)
        if rows_lo >= rows_hi:
            tidx, _, _ = cute.arch.thread_idx()
            if (tally.iterator.toint() != 0) & (tidx == 0):  # every CTA of the batch takes its turn at the tally
                ptx_ops.tally_pass(*self._amax_words(tally, amax, batch), 2 * self._batch_ctas())
        else:
            tidx, _, _ = cute.arch.thread_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            # the tokens' tile 0 starts at the item's first row (group-local items, as the bf16 grouped kernel's)
            mX_item = cute.domain_offset((rows_lo, 0, 0), mX)
            storage, ab_pipeline, sX, sW, views, k_tiles, wg_idx = tma_pipeline.ab_prologue(
                tidx, warp_idx, tma_atom_x, mX_item, tma_atom_w, mW, x_staged, w_staged, self.shared_storage,
                (cutlass.BFloat16, self.ab_dtype), self.stages, self.release_warps, self.tile_mnk,
                self.threads_per_wg, self.row_bytes)
            zero = group < 0
            k_tiles = cutlass.select_(zero, self.promote_tiles, k_tiles)  # zeros: one group of k-tiles, never added
            w_batch = batch * g + cutlass.max(group, 0)
            ready = storage.ready_mbars.data_ptr()
            if cutlass.const_expr(self.orders_tokens):
                if tidx == 0:
                    for s in cutlass.range_constexpr(self.stages):
                        cute.arch.mbarrier_init(ready + s, 1)  # one writer warp's arrival per fill
                cute.arch.mbarrier_init_fence()
                cute.arch.barrier()
            if wg_idx == 0:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == 0:
                    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                    state = tma_pipeline.produce_tile(ab_pipeline, state, tma_atom_x, tma_atom_w, views, 0, tile_n,
                                                      k_tiles, batch, w_batch)
                    if tally.iterator.toint() != 0:  # amax open before the epilogue folds this CTA's max in
                        if tidx == 0:
                            ptx_ops.tally_open(*self._amax_words(tally, amax, batch), 2 * self._batch_ctas())
                        cute.arch.barrier_arrive(barrier_id=self.amax_barrier_id,
                                                 number_of_threads=self._amax_barrier_threads())
                    ab_pipeline.producer_tail(state)
                elif cutlass.const_expr(self.orders_tokens):
                    self.order_tokens(ab_pipeline, ready, sX, warp_idx, k_tiles, rows_hi - rows_lo)
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                mma_tid = tidx - self.threads_per_wg  # 0.. over the MMA warpgroups
                # MMA warpgroup w: weight rows 64(w % weight_warpgroups) of part w // weight_warpgroups
                row_wg = (wg_idx - 1) % self.weight_warpgroups
                part = 0
                if cutlass.const_expr(self.k_split > 1):
                    part = (wg_idx - 1) // self.weight_warpgroups
                operands = (ab_pipeline, ready, sX, sW, sfb, sf_atom, row_wg, part, mma_tid, tile_n, w_batch, n, k,
                            k_tiles, zero, alpha, storage, c, amax, tally, t, batch, rows_lo, rows_hi)
                self.multiply_and_store_narrowest(tiled_mma, rows_hi - rows_lo, operands)

    @cute.jit
    def multiply_and_store_narrowest(self, tiled_mma: cute.TiledMma, rows, operands: tuple,
                                     first: cutlass.Constexpr[int] = 0):
        """`multiply_and_store` with the narrowest of `narrow_widths[first:]` that holds the item's `rows`, else the
        tile's width (`tiled_mma`): uniform branches per CTA, so that the tensor cores' work follows the item's
        tokens in steps of 32 while the weights' conversion stays the same."""
        if cutlass.const_expr(first == len(self.narrow_widths)):
            self.multiply_and_store(tiled_mma, self.tile_mnk[0], *operands)
        else:
            width = self.narrow_widths[first]
            if rows <= width:
                self.multiply_and_store(self._tiled_mma(width), width, *operands)
            else:
                self.multiply_and_store_narrowest(tiled_mma, rows, operands, first + 1)

    @cute.jit
    def multiply_and_store(self, tiled_mma: cute.TiledMma, tokens: cutlass.Constexpr[int], ab_pipeline, ready, sX, sW,
                           sfb, sf_atom, row_wg, part, mma_tid, tile_n, w_batch, n, k, k_tiles, zero, alpha, storage, c,
                           amax, tally, t, batch, rows_lo, rows_hi):
        """An MMA warpgroup's work on its item: the mainloop over the item's first `tokens` rows (`tiled_mma` that
        wide), alpha, and the epilogue."""
        acc = self.mainloop(ab_pipeline, ready, tiled_mma, tokens, sX, sW, sfb, sf_atom, row_wg, part, mma_tid, tile_n,
                            w_batch, n, k, k_tiles)
        scale = alpha[w_batch]  # this weight's factor on the sums (ones for the MX formats' usual call)
        for j in cutlass.range_constexpr(cute.size(acc)):
            acc[j] = acc[j] * scale
        if zero:  # after alpha: rows of no group stay zero whatever group 0's alpha holds
            acc.fill(0.0)
        self.epilogue(acc, tokens, storage, c, amax, tally, t, n, tile_n, batch, rows_lo, rows_hi, row_wg, part,
                      mma_tid)

    @cute.jit
    def mainloop(self, ab_pipeline, ready, tiled_mma: cute.TiledMma, tokens: cutlass.Constexpr[int], sX: cute.Tensor,
                 sW: cute.Tensor, sfb: cute.Tensor, sf_atom, wg_idx, part, tidx, tile_n, w_batch, n, k, k_tiles):
        """This thread's part of the warpgroup's fp32 accumulator (its 64 weight rows x the tile's tokens) over
        K's promotion groups part, part + k_split, ... (all of K without a split). k_tiles is a multiple of
        promote_tiles (the tokens' K is padded to K_PAD). Stage s is read by part s // promote_tiles % k_split
        alone: the parts' states start promote_tiles·part stages apart and skip the other parts' groups."""
        _, bw, bk = self.tile_mnk
        thr_mma = tiled_mma.get_slice(wg_idx * self.threads_per_wg)
        # the stages' first `tokens` token rows (the same swizzled rows: a tile's first rows are a tile of their own)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(cute.local_tile(sX, (tokens, bk, self.stages),
                                                                             (0, 0, 0))))
        frag_shape = thr_mma.partition_shape_A((bw, bk))
        frags = (tiled_mma.make_fragment_A(frag_shape), tiled_mma.make_fragment_A(frag_shape))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((bw, tokens)), self.acc_dtype)
        partial = cute.make_rmem_tensor(thr_mma.partition_shape_C((bw, tokens)), self.acc_dtype)
        acc.fill(0.0)
        k_steps = cute.size(tCrB, mode=[2])

        lane = tidx % 32
        quad, pair = lane // 4, lane % 4
        row0 = wg_idx * 64 + (tidx // 32 % 4) * 16 + quad  # and row0 + 8: tile-relative weight rows
        code_at = self._code_addresses(sW.iterator.toint(), row0, quad, pair)
        stage_bytes = bw * self.row_bytes

        # Scale bytes, compact (L·G, N, KB) or in atoms (`sf_atom`): this thread's codes of a row lie in one block
        # (NVFP4's 128-code k-tiles: two neighbouring blocks, neighbouring bytes in either form), lane_blocks bytes per
        # row and k-tile (`_scale_offset`); a group's (promote_tiles k-tiles x rows row0, row0 + 8 x lane_blocks) are
        # loaded a group ahead, a list of scalars the DSL carries through the loop.
        blocks = (k + self.sf_vec_size - 1) // self.sf_vec_size
        rows_at = [self._scale_row_at(sfb, sf_atom, w_batch, tile_n * bw + r, n, blocks) for r in (row0, row0 + 8)]
        walk = self._scale_walk(pair, blocks, sf_atom)
        per = self.promote_tiles
        lbk = self.lane_blocks
        group_scales = lambda q: [ptx_ops.ld_global_nc_u8(at + self._scale_offset(walk, q, i, b))
                                  for i in range(per) for at in rows_at for b in range(lbk)]
        tile_scales = lambda scales, i: scales[2 * lbk * i:2 * lbk * (i + 1)]  # k-tile i's: row0's, then row0 + 8's

        split = self.k_split
        first, skip = self.part_walk(part)
        read_state = pipeline.PipelineState(self.stages, cutlass.Int32(0), cutlass.Int32(first), cutlass.Int32(0))
        release_state = pipeline.PipelineState(self.stages, cutlass.Int32(0), cutlass.Int32(first), cutlass.Int32(0))
        mine = (k_tiles // per - part + split - 1) // split  # this part's promotion groups (part 0 has one or more)
        here = group_scales(part)
        if mine > 0:  # a part past the last group has none (without a split, part 0 always has one)
            self.wait_stage(ab_pipeline, ready, read_state)
            self.convert(frags[0], code_at, read_state.index * stage_bytes, tile_scales(here, 0))
        for nth in range(mine):
            q = part + nth * split
            ahead = group_scales(q + split)
            for i in cutlass.range_constexpr(per):
                cute.nvgpu.warpgroup.fence()
                for ks in cutlass.range_constexpr(k_steps):
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, i + ks > 0)
                    cute.gemm(tiled_mma, partial, frags[i % 2][(None, None, ks)],
                              tCrB[(None, None, ks, read_state.index)], partial)
                cute.nvgpu.warpgroup.commit_group()
                read_state.advance()
                if cutlass.const_expr(i > 0):  # k-tile i - 1 is done: its fragment and stage are free
                    cute.nvgpu.warpgroup.wait_group(1)
                    ab_pipeline.consumer_release(release_state)
                    release_state.advance()
                # k-tile i + 1 into the other fragment while the tensor cores run k-tile i
                if cutlass.const_expr(i + 1 < per):
                    self.wait_stage(ab_pipeline, ready, read_state)
                    self.convert(frags[(i + 1) % 2], code_at, read_state.index * stage_bytes,
                                 tile_scales(here, i + 1))
                else:
                    if cutlass.const_expr(split > 1):
                        read_state.advance(skip)  # past the other parts' groups
                    if nth + 1 < mine:
                        self.wait_stage(ab_pipeline, ready, read_state)
                        self.convert(frags[0], code_at, read_state.index * stage_bytes, tile_scales(ahead, 0))
            cute.nvgpu.warpgroup.wait_group(0)
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
            if cutlass.const_expr(split > 1):
                release_state.advance(skip)
            for j in cutlass.range_constexpr(cute.size(acc)):
                acc[j] = acc[j] + partial[j]
            here = ahead
        return acc

    @cute.jit
    def wait_stage(self, ab_pipeline, ready, state):
        """Wait until stage `state` holds its k-tile as the MMA warpgroups read it: TMA's copies landed, and for the
        16-token tile the tokens' columns ordered (`order_tokens`)."""
        if cutlass.const_expr(self.orders_tokens):
            cute.arch.mbarrier_wait(ready + state.index, state.phase)
        else:
            ab_pipeline.consumer_wait(state)

    @cute.jit
    def order_tokens(self, ab_pipeline, ready, sX: cute.Tensor, warp_idx, k_tiles, rows):
        """The 16-token tile's producer warp 1, 2 or 3: for the k-tiles kt = warp - 1, warp + 2, ... as TMA lands
        them (the tokens in their own column order), moves each token row's columns in place into the order of the
        weights' codes in the MMA fragments (`swap_ab_layout.swap_ab_column_order`) and marks the stage ready. A
        row's 16 chunks of 16 bytes go one to a lane, two rows a pass; a lane loads four passes' chunks before any
        store (a warp barrier between), so a row's chunks are all read before one is overwritten. The stages are
        128-byte swizzled: chunk j of row r lies in the row's line of swizzle atom j // 8 (atoms of all the tile's
        rows one after another) at 16·(j % 8 ^ r % 8). Rows from the item's `rows` on (TMA's zeros past the call's M,
        or another group's tokens) feed only C rows the epilogue does not store: four passes wholly among them are
        skipped."""
        bt = self.tile_mnk[0]
        chunks = self.k_tile // 8
        per_pass = 32 // chunks  # rows a pass
        lane = cute.arch.lane_idx()
        v = lane % chunks  # this lane's chunk of its rows
        base = sX.iterator.toint()
        at = lambda stage, r, j: stage + j // 8 * (bt * SWIZZLE_BYTES) + r * SWIZZLE_BYTES + (j % 8 ^ r % 8) * 16
        for kt in cutlass.range(warp_idx - 1, k_tiles, TOKEN_WRITER_WARPS, unroll=1):
            index = kt % self.stages
            ab_pipeline.consumer_wait(pipeline.PipelineState(self.stages, kt, index, (kt // self.stages) % 2))
            stage = base + index * (bt * self.k_tile * 2)
            for first in cutlass.range_constexpr(0, bt, 4 * per_pass):
                if first < rows:  # warp-uniform
                    mine = [first + per_pass * p + lane // chunks for p in range(4)]
                    loaded = [ptx_ops.ld_shared_v4(at(stage, r, v)) for r in mine]
                    cute.arch.sync_warp()  # every chunk of these rows read before any is overwritten
                    for r, words in zip(mine, loaded):
                        words = common.token_chunk_words(words, self.fp4, ptx_ops.byte_perm)
                        for q in cutlass.range_constexpr(4):
                            chunk, offset = common.token_chunk_place(v, q)
                            ptx_ops.st_shared_u32(at(stage, r, chunk) + offset, words[q])
            cute.arch.fence_proxy("async.shared", space="cta")  # the stores, visible to the wgmma's reads
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.mbarrier_arrive(ready + index)

    def part_walk(self, part):
        """(the stage of part `part`'s first k-tile, the stages its pipeline states skip after each of its promotion
        groups): the producer fills stages in K order, and part p reads groups p, p + k_split, ..."""
        return self.promote_tiles * part, self.promote_tiles * (self.k_split - 1)

    @staticmethod
    def _scale_row_at(sfb: cute.Tensor, sf_atom, w_batch, row, n, blocks) -> cutlass.Int64:
        """The address of the first scale byte of weight w_batch's row `row` (clamped to N - 1: rows past N are
        TMA's zeros): compact, KB = `blocks` a row, or (`sf_atom`) in SPEC §3's atoms, whose byte of block kb adds
        `_scale_offset`."""
        row = cutlass.min(row, n - 1)
        compact = (w_batch * n + row) * blocks
        atom_rows = (n + common.ATOM_MN - 1) // common.ATOM_MN
        atom_kbs = (blocks + common.ATOM_KB - 1) // common.ATOM_KB
        atom = (common.atom_chunk_index(w_batch, row // common.ATOM_MN, 0, atom_rows, atom_kbs) * common.ATOM_BYTES
                + 4 * common.atom_word_offset(row % common.ATOM_MN))
        return sfb.iterator.toint() + cutlass.Int64(HopperRaggedSwapAB._in_form(compact, atom, sf_atom))

    @staticmethod
    def _in_form(compact, atom, sf_atom):
        """`compact` or `atom`, whichever the scales' form (`sf_atom`, 0 or 1) reads, without a branch."""
        return compact + sf_atom * (atom - compact)

    def _scale_walk(self, pair, blocks, sf_atom) -> tuple:
        """What this lane's scale reads add to its rows' first bytes, worked out once (compact, or in atoms:
        `sf_atom`): (its block's offset in k-tile 0, the step per promotion group, the steps to each k-tile of a
        group, the offset of K's last block). Its block in k-tile i of group q is block q·(blocks a group) + i·(blocks
        a k-tile) + (its block within a k-tile), whose offset in atoms is the sum of the parts' offsets (the group's
        and the k-tile's blocks multiples of ATOM_KB, the lane's even where it has two blocks, whose second is then the
        next byte); offsets grow with the block in both forms, so the least of an offset and the last block's clamps
        the block to K (codes past K are TMA's zeros)."""
        per_tile = self.k_tile // self.sf_vec_size  # blocks per k-tile: 4, or NVFP4's 8
        lane_block = pair * per_tile // 4
        blend = lambda block: self._in_form(block, common.atom_block_offset(block), sf_atom)
        step = blend(self.promote_tiles * per_tile)
        tiles = [blend(i * per_tile) for i in range(self.promote_tiles)]
        return blend(lane_block), step, tiles, blend(blocks - 1)

    @staticmethod
    def _scale_offset(walk: tuple, q, i: int, b: int = 0):
        """The offset of this lane's block b (0, or 1: NVFP4's second block in a 128-code k-tile, the next byte in
        either form) in k-tile i of promotion group q (`_scale_walk`), clamped to K's last."""
        first, step, tiles, last = walk
        return cutlass.min(q * step + first + tiles[i] + b, last)

    def _code_addresses(self, w_base, row0, quad, pair) -> tuple:
        """Per row (row0, row0 + 8), the stage-0 shared addresses of this lane's codes of a k-tile: FP4's one 16-byte
        piece `pair` of a plain 64-byte row, or FP8's two 16-byte pieces 2·pair and 2·pair + 1 of a swizzled 128-byte
        row, which lie at 16·(piece ^ row % 8) (row % 8 = quad for both rows)."""
        rb = self.row_bytes
        if cutlass.const_expr(self.swizzled_codes):
            return tuple(tuple(w_base + row * rb + ((2 * pair + i) ^ quad) * 16 for i in range(2))
                         for row in (row0, row0 + 8))
        return tuple((w_base + row * rb + 16 * pair,) for row in (row0, row0 + 8))

    @cute.jit
    def convert(self, frag: cute.Tensor, code_at: tuple, stage_offset, scales: list):
        """This thread's A fragment of one k-tile: its codes of rows row0 and row0 + 8 (a quarter of a k-tile's;
        shared memory, at `code_at` (`_code_addresses`) + `stage_offset`) times their rows' scale bytes `scales`, as
        bf16 pairs in the fragment's slots (k-step s: row0's first pair, row0 + 8's, row0's second, row0 + 8's; which
        codes, `_convert_words` and `_convert_fp4_words`)."""
        words = cute.recast_tensor(frag, cutlass.Int32)  # 4 words per k-step
        if cutlass.const_expr(self.sf_e4m3):  # NVFP4: always two multiplies
            self._convert_pieces(words, code_at, stage_offset, scales, False)
        else:
            limit = common.E2M1_ONE_MULTIPLY_MAX_BYTE if cutlass.const_expr(self.fp4) else common.ONE_MULTIPLY_MAX_BYTE
            big = cutlass.Boolean(False)
            for byte in scales:  # a Python list: unrolled
                big = big | (byte > limit)
            if cute.arch.vote_any_sync(big):
                self._convert_pieces(words, code_at, stage_offset, scales, False)
            else:
                self._convert_pieces(words, code_at, stage_offset, scales, True)

    @cute.jit
    def _convert_pieces(self, words: cute.Tensor, code_at: tuple, stage_offset, scales: list,
                        one: cutlass.Constexpr[bool]):
        """`convert` one load of each row at a time (FP8's 128-code k-tiles: two 16-byte pieces of four k-steps
        each, so that only one piece's codes are live)."""
        for p in cutlass.range_constexpr(len(code_at[0])):
            codes = [ptx_ops.ld_shared_v4(code_at[r][p] + stage_offset) for r in range(2)]
            if cutlass.const_expr(self.fp4):
                self._convert_fp4_words(words, codes, scales, one)
            else:
                self._convert_words(words, codes, scales, one, 4 * p)

    @cute.jit
    def _convert_words(self, words: cute.Tensor, codes: list, scales: list, one: cutlass.Constexpr[bool],
                       first_step: cutlass.Constexpr[int]):
        """`convert`'s bit moves and packed multiplies for k-steps first_step .. + 3, k-step first_step + i taking
        word i of each row's four (`codes`): `one` multiply by 2^120·scale per pair (every scale byte of the warp at
        most common.ONE_MULTIPLY_MAX_BYTE), else by 2^120 and then by the scale. A NaN code among a row's words makes
        that row's factor NaN for them (and so the row's sums NaN)."""
        neg_zero = cutlass.Int32(common.NEG_ZERO_BF16X2)
        two120 = cutlass.Int32(common.BF16X2_TWO_POW_120)
        factors = []
        for r in cutlass.range_constexpr(2):
            nan = common.e4m3_nan_any(codes[r])  # a Python list of words: unrolled
            if cutlass.const_expr(one):
                factor = common.one_multiply_bf16x2(scales[r])
            else:
                factor = common.e8m0_bf16x2(scales[r])
            factors.append(cutlass.select_(nan != 0, cutlass.Int32(common.E4M3_NAN_BF16X2), factor))
        for i in cutlass.range_constexpr(4):
            s = first_step + i
            for high in cutlass.range_constexpr(2):
                for r in cutlass.range_constexpr(2):
                    bits = common.e4m3_pair_bits(codes[r][i], bool(high),
                                                 lambda w, sel: ptx_ops.byte_perm(w, w, sel))
                    if cutlass.const_expr(not one):
                        bits = cute.arch.fma_packed_bf16x2(bits, two120, neg_zero)
                    words[4 * s + 2 * high + r] = cute.arch.fma_packed_bf16x2(bits, factors[r], neg_zero)

    @cute.jit
    def _convert_fp4_words(self, words: cute.Tensor, codes: list, scales: list, one: cutlass.Constexpr[bool]):
        """The FP4 form of `_convert_words`: codes·2^-126 by `common.e2m1_pair_bits` (the pair p of word w: codes
        8w + p and 8w + p + 4), k-step s taking pairs 2(s % 2) and 2(s % 2) + 1 of word s // 2; then `one` multiply
        by 2^126·scale (MXFP4, every scale byte of the warp at most common.E2M1_ONE_MULTIPLY_MAX_BYTE), else by 2^126
        and by the scale (E8M0, or NVFP4's E4M3; scales row0's lane_blocks bytes, then row0 + 8's, the second block
        for the k-steps of the k-tile's second half). E2M1 has no NaN code; a NaN scale gives NaN products."""
        neg_zero = cutlass.Int32(common.NEG_ZERO_BF16X2)
        two126 = cutlass.Int32(common.BF16X2_TWO_POW_126)
        factors = []
        for byte in scales:  # a Python list: row0's blocks, then row0 + 8's
            if cutlass.const_expr(self.sf_e4m3):
                factors.append(common.e4m3_scale_bf16x2(byte))
            elif cutlass.const_expr(one):
                factors.append(common.one_multiply_bf16x2(byte, common.E2M1_PLACEMENT))
            else:
                factors.append(common.e8m0_bf16x2(byte))
        k_steps = self.k_tile // 16
        for s in cutlass.range_constexpr(k_steps):
            block = s * self.lane_blocks // k_steps
            for high in cutlass.range_constexpr(2):
                for r in cutlass.range_constexpr(2):
                    bits = common.e2m1_pair_bits(codes[r][s // 2], 2 * (s % 2) + high)
                    if cutlass.const_expr(not one):
                        bits = cute.arch.fma_packed_bf16x2(bits, two126, neg_zero)
                    words[4 * s + 2 * high + r] = cute.arch.fma_packed_bf16x2(
                        bits, factors[r * self.lane_blocks + block], neg_zero)

    @cute.jit
    def epilogue(self, acc: cute.Tensor, tokens: cutlass.Constexpr[int], storage, c: cute.Tensor, amax: cute.Tensor,
                 tally: cute.Tensor, t, n, tile_n, batch, rows_lo, rows_hi, wg_idx, part, tidx):
        """C rows [rows_lo, rows_hi) of the item (its token tile starts at rows_lo), columns of this weight tile
        below N, from the transposed accumulators: written to shared memory as an fp32 (token, weight row) tile per
        part over the drained stages, then each token row (the parts' tiles summed in part order) stored in 16-byte
        pieces where N allows (else element by element); amax of what was stored, through the tally where there is
        one. `tokens`: the accumulators' width (the item's rows lie within it)."""
        bt, bw, _ = self.tile_mnk
        mma_threads = self.num_consumer_warps * 32
        cute.arch.barrier(barrier_id=self.epilogue_barrier_id, number_of_threads=mma_threads)  # stages drained
        part_bytes = bt * self.c_stage_stride * 4
        tile_at = storage.sA.data_ptr().toint() + part * part_bytes
        lane = tidx % 32
        row0 = wg_idx * 64 + (tidx // 32 % 4) * 16 + lane // 4
        # accumulator value (v0, v1, j): weight row row0 + 8·v1, token 8j + 2·(lane % 4) + v0
        for j in cutlass.range_constexpr(tokens // 8):
            for v1 in cutlass.range_constexpr(2):
                for v0 in cutlass.range_constexpr(2):
                    token = 8 * j + 2 * (lane % 4) + v0
                    ptx_ops.st_shared_u32(tile_at + (token * self.c_stage_stride + row0 + 8 * v1) * 4,
                                          common.bits_from_f32(acc[v0 + 2 * v1 + 4 * j]))
        cute.arch.barrier(barrier_id=self.epilogue_barrier_id, number_of_threads=mma_threads)
        tile_at = storage.sA.data_ptr().toint()

        # Each thread stores `per` consecutive columns of a token row: 4 (f32) or 8 (bf16) per 16 bytes.
        per = 16 // (self.c_dtype.width // 8)
        threads_per_row = bw // per
        rows_per_pass = mma_threads // threads_per_row
        col = (tidx % threads_per_row) * per
        gcol = tile_n * bw + col
        vector = (n % per == 0) & (gcol + per <= n)
        c_addr = c.iterator.toint()
        amax_bits = cutlass.Int32(0)
        rows_end = rows_hi  # k_split parts can leave a pass more threads than the tile has token rows
        if cutlass.const_expr(tokens % rows_per_pass):
            rows_end = cutlass.min(rows_hi, rows_lo + tokens)
        for pass_ in cutlass.range_constexpr(-(-tokens // rows_per_pass)):
            token = pass_ * rows_per_pass + tidx // threads_per_row
            row = rows_lo + token
            if row < rows_end:
                values = []
                for q in cutlass.range_constexpr(per // 4):
                    values += ptx_ops.ld_shared_v4(tile_at + (token * self.c_stage_stride + col + 4 * q) * 4)
                at = (cutlass.Int64(batch) * t + row) * n + gcol
                xs = [common.f32_from_bits(v) for v in values]
                for p in cutlass.range_constexpr(1, self.k_split):
                    for q in cutlass.range_constexpr(per // 4):
                        more = ptx_ops.ld_shared_v4(tile_at + p * part_bytes
                                                    + (token * self.c_stage_stride + col + 4 * q) * 4)
                        for e in cutlass.range_constexpr(4):
                            xs[4 * q + e] = xs[4 * q + e] + common.f32_from_bits(more[e])
                if cutlass.const_expr(self.k_split > 1):
                    values = [common.bits_from_f32(x) for x in xs]
                for e in cutlass.range_constexpr(per):
                    if gcol + e < n:
                        amax_bits = cutlass.max(amax_bits, common.abs_bits(xs[e]))
                if vector:
                    if cutlass.const_expr(self.c_name == "float32"):
                        ptx_ops.st_global_v4_if(c_addr + at * 4, values[0], values[1], values[2], values[3], 1)
                    else:
                        ptx_ops.st_global_v4_if(c_addr + at * 2, *[epilogue.bf16x2(xs[2 * i], xs[2 * i + 1])
                                                                   for i in range(4)], 1)
                else:
                    for e in cutlass.range_constexpr(per):
                        if gcol + e < n:
                            c[at + e] = xs[e].to(self.c_dtype)
        if tally.iterator.toint() != 0:  # a tally: the caller wants amax, open since the producer's turn
            warp_amax = storage.warp_amax.get_tensor(cute.make_layout((self.num_consumer_warps,)))
            common.amax_block_reduce_into_open(amax_bits, warp_amax, self._amax_words(tally, amax, batch)[1], tidx,
                                               self.num_consumer_warps, self.amax_barrier_id,
                                               self._amax_barrier_threads())

    @staticmethod
    def _amax_words(tally: cute.Tensor, amax: cute.Tensor, batch) -> tuple:
        """The addresses of batch `batch`'s two tally words and of its amax."""
        return (tally.iterator.toint() + cutlass.Int64(batch) * 8, amax.iterator.toint() + cutlass.Int64(batch) * 4)

    def _amax_barrier_threads(self) -> int:
        """The threads of the amax barrier: the MMA warps and the producer warp."""
        return self.num_consumer_warps * 32 + 32

    @staticmethod
    def _batch_ctas():
        """The CTAs of one batch: every (weight tile, work item) of the grid, empty items included."""
        tiles_n, max_items, _ = cute.arch.grid_dim()
        return tiles_n * max_items


__all__ = ["HopperRaggedSwapAB", "K_PAD", "WEIGHT_FORMATS"]
