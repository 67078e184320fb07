"""The epilogue the Hopper GEMM kernels share: the wgmma accumulator fragment of two MMA warpgroups stored to C with
row and column bounds, in any C dtype the kernels take, and max|acc| folded into amax by one atomic per CTA."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from jax_blockgemm.kernels import common, epilogue


class AccumulatorStore:
    """Mixin of `store_c_and_amax`. The kernel class sets tile_mnk (the CTA tile, 128 rows), c_kind ("wide": f32,
    bf16, f16; "fp8"; "fp4": packed pairs), c_dtype and c_name (C's cutlass dtype and name), has_alpha (C and amax
    of alpha[l]·acc), num_consumer_warps (8) and epilogue_barrier_id (a named barrier over the MMA warps)."""

    @cute.jit
    def store_c_and_amax(self, acc: cute.Tensor, c: cute.Tensor, amax: cute.Tensor, alpha: cute.Tensor,
                         warp_amax: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, tile_m: cutlass.Int32,
                         tile_n: cutlass.Int32, batch: cutlass.Int32, consumer_wg: cutlass.Int32,
                         local_tid: cutlass.Int32, rows_lo: cutlass.Int32, rows_hi: cutlass.Int32):
        """Store this thread's accumulator values of the CTA tile (tile_m, tile_n, batch) to C (the kernel's flat
        `c_dtype` buffer), its rows in [rows_lo, rows_hi) and columns below N, and fold max|acc| of those into
        amax[l] with one integer atomic max per CTA (`warp_amax`: a shared-memory Int32 slot per consumer warp).
        consumer_wg is this thread's MMA warpgroup (0 or 1: rows 0-63 or 64-127), local_tid its index over the
        256 MMA threads."""
        bm, bn, _ = self.tile_mnk
        if cutlass.const_expr(self.c_kind != "wide"):  # one-byte and packed FP4 C are stored as bytes
            c = cute.make_tensor(cute.recast_ptr(c.iterator, dtype=cutlass.Uint8), cute.make_layout((cute.size(c),)))
        # The wgmma m64nNk16 accumulator fragment: value (v0, v1, v2) of a thread sits at row
        # 16·warp + lane/4 + 8·v1 and column 2·(lane%4) + v0 + 8·v2 of its warpgroup's 64 x bn slice.
        lane = local_tid % 32
        row0 = consumer_wg * 64 + ((local_tid // 32) % 4) * 16 + lane // 4
        col0 = (lane % 4) * 2
        n_col_groups = bn // 8
        amax_bits = cutlass.Int32(0)
        c_row_base = (cutlass.Int64(batch) * m + tile_m * bm) * n + tile_n * bn
        if cutlass.const_expr(self.has_alpha):  # NVFP4: C and amax are of alpha·acc (SPEC §1, §4)
            alpha_l = alpha[batch]
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] * alpha_l
        if cutlass.const_expr(self.c_kind == "wide"):
            for v1 in cutlass.range_constexpr(2):
                r = row0 + 8 * v1
                row_ok = (tile_m * bm + r >= rows_lo) & (tile_m * bm + r < rows_hi)
                for v2 in cutlass.range_constexpr(n_col_groups):
                    for v0 in cutlass.range_constexpr(2):
                        col = col0 + v0 + 8 * v2
                        i = v0 + 2 * v1 + 4 * v2
                        if row_ok & (tile_n * bn + col < n):
                            x = acc[i]
                            c[c_row_base + cutlass.Int64(r) * n + col] = x.to(self.c_dtype)
                            amax_bits = cutlass.max(amax_bits, common.abs_bits(x))
        else:
            # One-byte and packed FP4 C: values v0 = 0, 1 of a thread are adjacent columns (col0 is even), so
            # both go through one conversion; stored as bytes (FP8: one per column, FP4: one per pair, N even).
            c_bytes = c
            for v1 in cutlass.range_constexpr(2):
                r = row0 + 8 * v1
                row_ok = (tile_m * bm + r >= rows_lo) & (tile_m * bm + r < rows_hi)
                for v2 in cutlass.range_constexpr(n_col_groups):
                    col = col0 + 8 * v2
                    i = 2 * v1 + 4 * v2
                    x0, x1 = acc[i], acc[i + 1]
                    index = c_row_base + cutlass.Int64(r) * n + col
                    in0 = row_ok & (tile_n * bn + col < n)
                    in1 = row_ok & (tile_n * bn + col + 1 < n)
                    if cutlass.const_expr(self.c_kind == "fp8"):
                        codes = epilogue.fp8x2(x0, x1, "e4m3" if self.c_name == "float8_e4m3fn" else "e5m2")
                        if in0:
                            c_bytes[index] = (codes & 0xFF).to(cutlass.Uint8)
                            amax_bits = cutlass.max(amax_bits, common.abs_bits(x0))
                        if in1:
                            c_bytes[index + 1] = ((codes >> 8) & 0xFF).to(cutlass.Uint8)
                            amax_bits = cutlass.max(amax_bits, common.abs_bits(x1))
                    else:
                        if in0:  # N is even: the pair is in or out together
                            packed = epilogue.e2m1_nibble(x0) | (epilogue.e2m1_nibble(x1) << 4)
                            c_bytes[index // 2] = packed.to(cutlass.Uint8)
                            amax_bits = cutlass.max(amax_bits, common.abs_bits(x0))
                            amax_bits = cutlass.max(amax_bits, common.abs_bits(x1))
        amax_i32 = cute.make_tensor(cute.recast_ptr(amax.iterator, dtype=cutlass.Int32), cute.make_layout((1,)))
        common.amax_block_reduce_and_publish(
            amax_bits, warp_amax, (amax_i32.iterator + batch), local_tid, self.num_consumer_warps,
            self.epilogue_barrier_id)
