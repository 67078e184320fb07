"""MXFP8 codes times E8M0 block scales as bfloat16, on any GPU architecture (no MMA): the input pass of the MXFP8
proj_rope path, whose kernels (sm_90a, sm_100a) multiply bf16 operands, and (in its column order) of the swap_ab ragged
kernel's tokens. One launch converts two operands (w and x).

The values are the reference's, bit for bit (SPEC §6): code -> float32 (exact, through the hardware E4M3x2 -> f16x2
converter), times the float32 scale 2^(b-127) (exact but for results below float32's normal range, rounded the same
way as the reference's multiply; no flush to zero), rounded to bfloat16.

Two data paths, chosen by operand 0's scale axis (H200 figures below, their measurement in docs/design/proj_rope.md;
the sm_100a objects are compiled, never run):
- scales along the rows (`scale_axis` 1, both operands): bulk copies. A CTA owns UNIT consecutive codes in STAGES
  chunks; one thread issues every chunk's global -> shared bulk copy at once (one mbarrier each), the threads convert
  shared -> shared in runs of RUN codes (warp-contiguous 8-byte loads and 16-byte stores), one bulk store per chunk.
  DeepSeek-V3's w (24576 x 1536): 31.8 us on the H200, against 35 for one thread per 16 codes from global memory
  and 29.6 for a plain copy of the same bytes.
- scales along the columns (`scale_axis` 0, operand 0 only): one thread per THREAD_RUN codes of a row straight from
  global memory (one 16-byte load of codes and one of their 16 column scales, two 16-byte stores): 32.1 us for w as
  (K, N), where the bulk path's per-run scale loads made it slower (34.1). Operand 1 then takes the same path.

The bulk path has a second output order, for the tokens of the ragged swap_ab kernel (`swap_ab_order`,
kernels/sm90/ragged_swap_ab.py): within every 128 columns, column 16s + 8h + 2c + j of the output holds code
32c + 4s + 2h + j (`swap_ab_layout.swap_ab_column_order`), the order in which that kernel's threads hold the
weights' codes.
A run of 8 codes is 4 bf16 pairs, each stored to its own place in the shared-memory chunk (`swap_ab_pair_column`),
so the bulk store still writes whole chunks; the chunks start on 128-column tiles, and with the operand's columns a
multiple of 128 every tile lies in one row. It replaces XLA's dequantization with a gather, which was slower
(docs/design/moe.md).

Both paths launch with programmatic dependent launch: every thread first waits for the previous grid, and the CTAs
signal at once that the next grid (the proj_rope kernel) may launch, so its prologue overlaps this kernel's tail.

ABI (catalog op "dequantize"): fn(codes, scales, out, rows, cols, codes1, scales1, out1, rows1, cols1, stream), flat
buffers: codes (rows, cols) float8_e4m3fn, row-major; out (rows, cols) bfloat16; scales uint8 E8M0: (rows, cols / 32)
for `scale_axis` 1 (blocks of 32 along a row), (rows / 32, cols) for 0. Operand 1 always has its scales along its
rows; rows1 = 0 means there is none (its buffers are then never touched). Sizes per `can_implement`; the handler
(ffi/dequantize.cc) checks them.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from jax_blockgemm import swap_ab_layout
from jax_blockgemm.kernels import common
from jax_blockgemm.kernels.ptx_ops import bulk_load, bulk_store, st_shared_u32
from jax_blockgemm.support import MX_BLOCK

THREADS = 256
SCALE_AXES = (0, 1)
# bulk path (scales along the rows)
RUN = 8  # codes a thread converts at a time
RUNS = 2  # runs per thread per chunk
CHUNK = THREADS * RUN * RUNS  # codes per bulk copy (4 KB in, 8 KB out)
STAGES = 2  # chunks per CTA, all in flight at once
UNIT = CHUNK * STAGES  # codes per CTA
# per-thread path (scales along the columns)
THREAD_RUN = 16  # codes per thread: one 16-byte load
SWAP_AB_TILE = swap_ab_layout.SWAP_AB_K_TILE  # the columns the swap_ab output order permutes among


def swap_ab_pair_column(run, pair: int):
    """The output column (within its SWAP_AB_TILE-column tile) of bf16 pair `pair` (codes 2·pair, 2·pair + 1) of the
    run of RUN codes that starts at column 8·run of the tile, in the swap_ab order: codes 32c + 8x + e (run = 4c + x)
    are 32c + 4s + 2h + j with s = 2x + e // 4, h = e // 2 % 2, j = e % 2, and go to column 16s + 8h + 2c + j. Plain
    arithmetic: `run` may be a traced Int32."""
    c, x = run // 4, run % 4
    return 32 * x + 16 * (pair // 2) + 8 * (pair % 2) + 2 * c


@cute.jit
def _ceil_div(n: cutlass.Int32, d: int) -> cutlass.Int32:
    """ceil(n / d) for 0 <= n < 2**31 without forming n + d - 1 (which overflows Int32 near the top)."""
    return n // d + cutlass.min(n % d, 1)


@cute.jit
def _scaled_bf16(codes: cute.Tensor, factors, dst: cute.Tensor, per_element: cutlass.Constexpr):
    """dst (bf16) = codes (E4M3, in registers) x the decoded E8M0 factor(s): one scale byte (Int32) for the whole run,
    or with `per_element` a register tensor of one byte per code."""
    values = codes.load().to(cutlass.Float32)
    if cutlass.const_expr(per_element):
        n = cute.size(codes)
        decoded = cute.make_rmem_tensor((n,), cutlass.Float32)
        for i in cutlass.range_constexpr(n):
            decoded[i] = common.f32_from_bits(common.e8m0_bits(factors[i].to(cutlass.Int32)))
        dst.store((values * decoded.load()).to(cutlass.BFloat16))
    else:
        dst.store((values * common.f32_from_bits(common.e8m0_bits(factors))).to(cutlass.BFloat16))


class MxDequantize:
    """codes·2^(scale-127) as bfloat16 for up to two MXFP8 E4M3 operands in one launch; operand 0 has its scales per
    32 along `scale_axis`, operand 1 along its rows. `swap_ab_order` (scales along the rows only): every SWAP_AB_TILE
    columns written in the swap_ab kernel's token order."""

    # What the structural report reads of every kernel (kernels/structure.py): no MMA, no tensor memory.
    threads_per_cta = THREADS
    tmem_columns_used = tmem_columns_allocated = 0

    def __init__(self, *, scale_axis: int = 1, swap_ab_order: bool = False):
        common.require_choice("scale_axis", scale_axis, SCALE_AXES)
        if swap_ab_order and scale_axis != 1:
            raise ValueError("swap_ab_order takes scales along the rows (scale_axis 1)")
        self.scale_axis = scale_axis
        self.swap_ab_order = swap_ab_order
        self.bulk = scale_axis == 1
        self.per_cta = UNIT if self.bulk else THREADS * THREAD_RUN
        self.ab_dtype = cutlass.Float8E4M3FN
        self.smem_bytes = 0  # dynamic shared memory per CTA, set when traced (the bulk path's stage buffers)

    @staticmethod
    def can_implement(rows: int, cols: int, scale_axis: int, swap_ab_order: bool = False) -> tuple[bool, str]:
        """Whether the kernel takes a (rows, cols) operand with scales along `scale_axis` (in the swap_ab order:
        `swap_ab_order`), and why not."""
        if min(rows, cols) < 1:
            return False, f"rows and cols must be >= 1, got {rows} x {cols}"
        if cols % MX_BLOCK:
            return False, f"cols must be a multiple of {MX_BLOCK}, got {cols}"
        if swap_ab_order and (scale_axis != 1 or cols % SWAP_AB_TILE):
            return False, (f"the swap_ab order takes scales along the rows and cols a multiple of {SWAP_AB_TILE}, "
                           f"got scale_axis {scale_axis}, cols {cols}")
        if scale_axis == 0 and rows % MX_BLOCK:
            return False, f"rows must be a multiple of {MX_BLOCK} (scales along rows), got {rows}"
        if rows * cols >= 2**31:
            return False, f"the operand must hold fewer than 2**31 elements, got {rows} x {cols}"
        return True, ""

    @cute.jit
    def __call__(self, codes: cute.Tensor, scales: cute.Tensor, out: cute.Tensor, rows: cutlass.Int32,
                 cols: cutlass.Int32, codes1: cute.Tensor, scales1: cute.Tensor, out1: cute.Tensor,
                 rows1: cutlass.Int32, cols1: cutlass.Int32, stream: cuda.CUstream):
        """Host side: operand 0's CTAs, then operand 1's."""
        ctas = _ceil_div(rows * cols, self.per_cta) + _ceil_div(rows1 * cols1, self.per_cta)
        smem = 0
        if cutlass.const_expr(self.bulk):
            fields = dict(full=cute.struct.MemRange[cutlass.Int64, STAGES],
                          src=cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, UNIT], 128],
                          dst=cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, UNIT], 128])
            self.shared_storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
            smem = self.shared_storage.size_in_bytes()
            self.smem_bytes = smem
        self.kernel(codes, scales, out, rows, cols, codes1, scales1, out1, rows1, cols1).launch(
            grid=(ctas, 1, 1), block=(THREADS, 1, 1), smem=smem, stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, codes: cute.Tensor, scales: cute.Tensor, out: cute.Tensor, rows: cutlass.Int32,
               cols: cutlass.Int32, codes1: cute.Tensor, scales1: cute.Tensor, out1: cute.Tensor,
               rows1: cutlass.Int32, cols1: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        # programmatic dependent launch (sm_90 and later): this grid may start while the previous kernel finishes,
        # and lets the next one (the proj_rope kernel) start as soon as all of its own CTAs have started, so the
        # proj_rope CTAs' prologue overlaps this kernel's last wave; every thread waits for the previous grid before
        # its first global access
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()
        ctas0 = _ceil_div(rows * cols, self.per_cta)
        if cutlass.const_expr(self.bulk):
            storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
            if bidx < ctas0:
                self._bulk_unit(storage, codes, scales, out, rows * cols, bidx, tidx)
            else:
                self._bulk_unit(storage, codes1, scales1, out1, rows1 * cols1, bidx - ctas0, tidx)
        else:
            if bidx < ctas0:
                self._thread_run(codes, scales, out, rows, cols, bidx, tidx, self.scale_axis)
            else:
                self._thread_run(codes1, scales1, out1, rows1, cols1, bidx - ctas0, tidx, 1)

    @cute.jit
    def _bulk_unit(self, storage, codes: cute.Tensor, scales: cute.Tensor, out: cute.Tensor, total: cutlass.Int32,
                   unit: cutlass.Int32, tidx: cutlass.Int32):
        """Codes [unit·UNIT, +UNIT) ∩ [0, total) of an operand with scales along its rows (total: a multiple of 32,
        so every chunk's bytes are a multiple of 16 and every run lies inside one scale block)."""
        full0 = storage.full.data_ptr()
        src0 = storage.src.data_ptr().toint()
        dst0 = storage.dst.data_ptr().toint()
        first = unit * UNIT
        left = total - first
        if tidx == 0:
            for s in cutlass.range_constexpr(STAGES):
                cute.arch.mbarrier_init(full0 + s, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if tidx == 0:
            for s in cutlass.range_constexpr(STAGES):
                n = cutlass.max(cutlass.min(left - s * CHUNK, CHUNK), 0)
                if n > 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(full0 + s, n)
                    bulk_load(src0 + s * CHUNK, codes.iterator.toint() + cutlass.Int64(first + s * CHUNK), n,
                              (full0 + s).toint())
        # every run's scale byte, loaded while the chunks are in flight (a run past the end reads the last one; the
        # offset is clamped before it is added, so no sum passes `total`)
        factors = []
        for s in cutlass.range_constexpr(STAGES):
            for r in cutlass.range_constexpr(RUNS):
                code = first + cutlass.min(s * CHUNK + r * (THREADS * RUN) + tidx * RUN, left - 1)
                factors.append(scales[code // MX_BLOCK].to(cutlass.Int32))
        for s in cutlass.range_constexpr(STAGES):
            n = cutlass.max(cutlass.min(left - s * CHUNK, CHUNK), 0)
            if n > 0:  # the same for every thread
                cute.arch.mbarrier_wait(full0 + s, 0)
                for r in cutlass.range_constexpr(RUNS):
                    at = r * (THREADS * RUN) + tidx * RUN
                    if at < n:
                        src = cute.make_rmem_tensor((RUN,), self.ab_dtype)
                        sp = cute.make_ptr(self.ab_dtype, src0 + s * CHUNK + at, cute.AddressSpace.smem,
                                           assumed_align=RUN)
                        cute.autovec_copy(cute.make_tensor(sp, src.layout), src)
                        dst = cute.make_rmem_tensor((RUN,), cutlass.BFloat16)
                        _scaled_bf16(src, factors[s * RUNS + r], dst, False)
                        if cutlass.const_expr(self.swap_ab_order):  # run tidx % 16 of a 128-column tile
                            run = tidx % (SWAP_AB_TILE // RUN)
                            tile_at = dst0 + 2 * (s * CHUNK + at - RUN * run)
                            pairs = cute.recast_tensor(dst, cutlass.Int32)
                            for q in cutlass.range_constexpr(RUN // 2):
                                st_shared_u32(tile_at + 2 * swap_ab_pair_column(run, q), pairs[q])
                        else:
                            dp = cute.make_ptr(cutlass.BFloat16, dst0 + 2 * (s * CHUNK + at),
                                               cute.AddressSpace.smem, assumed_align=2 * RUN)
                            cute.autovec_copy(dst, cute.make_tensor(dp, dst.layout))
                cute.arch.fence_proxy("async.shared", space="cta")  # the converted chunk, visible to the bulk copy
                cute.arch.sync_threads()
                if tidx == 0:
                    bulk_store(out.iterator.toint() + cutlass.Int64(first + s * CHUNK) * 2, dst0 + 2 * s * CHUNK,
                               2 * n)
                    cute.arch.cp_async_bulk_commit_group()
        if tidx == 0:  # shared memory stays the CTA's until its bulk stores have read it
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _thread_run(self, codes: cute.Tensor, scales: cute.Tensor, out: cute.Tensor, rows: cutlass.Int32,
                    cols: cutlass.Int32, cta: cutlass.Int32, tidx: cutlass.Int32, scale_axis: cutlass.Constexpr):
        """One thread's THREAD_RUN consecutive codes of a row (cols: a multiple of 32), straight from global
        memory."""
        n = THREAD_RUN
        run = cta * THREADS + tidx
        runs_per_row = cols // n
        if run < rows * runs_per_row:
            row = run // runs_per_row
            col = (run - row * runs_per_row) * n
            first = cute.assume(run * n, divby=n)
            src = cute.make_rmem_tensor((n,), self.ab_dtype)
            cute.autovec_copy(cute.make_tensor(codes.iterator + first, src.layout), src)
            dst = cute.make_rmem_tensor((n,), cutlass.BFloat16)
            if cutlass.const_expr(scale_axis == 1):  # the run lies inside one block
                _scaled_bf16(src, scales[row * (cols // MX_BLOCK) + col // MX_BLOCK].to(cutlass.Int32), dst, False)
            else:  # one scale per column
                column_scales = cute.make_rmem_tensor((n,), cutlass.Uint8)
                scale0 = cute.assume((row // MX_BLOCK) * cols + col, divby=n)
                cute.autovec_copy(cute.make_tensor(scales.iterator + scale0, column_scales.layout), column_scales)
                _scaled_bf16(src, column_scales, dst, True)
            cute.autovec_copy(dst, cute.make_tensor(out.iterator + first, dst.layout))
