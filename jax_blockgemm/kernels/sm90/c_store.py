"""The epilogue the Hopper GEMM kernels share: the wgmma accumulator fragment of two MMA warpgroups stored to C with
row and column bounds, in any C dtype the kernels take, and max|acc| folded into amax by one atomic per CTA."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from jax_blockgemm.kernels import common, epilogue, ptx_ops


class AccumulatorStore:
    """Mixin of `store_c_and_amax`. The kernel class sets tile_mnk (the CTA tile, 128 rows), c_kind ("wide": f32,
    bf16, f16; "fp8"; "fp4": packed pairs), c_dtype and c_name (C's cutlass dtype and name), has_alpha (C and amax
    of alpha[l]·acc), num_consumer_warps (8) and epilogue_barrier_id (a named barrier over the MMA warps)."""

    @cute.jit
    def store_c_and_amax(self, acc: cute.Tensor, c: cute.Tensor, amax: cute.Tensor, alpha: cute.Tensor,
                         warp_amax: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, m_start: cutlass.Int32,
                         tile_n: cutlass.Int32, batch: cutlass.Int32, amax_slot: cutlass.Int32,
                         consumer_wg: cutlass.Int32, local_tid: cutlass.Int32, rows_lo: cutlass.Int32,
                         rows_hi: cutlass.Int32):
        """Store this thread's accumulator values of the CTA tile whose rows start at m_start (column tile tile_n,
        batch `batch`) to C (the kernel's flat `c_dtype` buffer, batches of (m, n)), its rows in [rows_lo, rows_hi)
        and columns below N, and fold max|acc| of those into amax[amax_slot] with one integer atomic max per CTA
        (`warp_amax`: a shared-memory Int32 slot per consumer warp). bf16 C with N a multiple of 8 leaves in 16-byte
        stores (`_store_bf16_rows`). consumer_wg is this thread's MMA warpgroup (0 or 1: rows 0-63 or 64-127),
        local_tid its index over the 256 MMA threads."""
        bn = self.tile_mnk[1]
        if cutlass.const_expr(self.c_kind != "wide"):  # one-byte and packed FP4 C are stored as bytes
            c = cute.make_tensor(cute.recast_ptr(c.iterator, dtype=cutlass.Uint8), cute.make_layout((cute.size(c),)))
        # The wgmma m64nNk16 accumulator fragment: value (v0, v1, v2) of a thread sits at row
        # 16·warp + lane/4 + 8·v1 and column 2·(lane%4) + v0 + 8·v2 of its warpgroup's 64 x bn slice.
        lane = local_tid % 32
        row0 = consumer_wg * 64 + ((local_tid // 32) % 4) * 16 + lane // 4
        col0 = (lane % 4) * 2
        c_row_base = (cutlass.Int64(batch) * m + m_start) * n + tile_n * bn
        if cutlass.const_expr(self.has_alpha):  # NVFP4: C and amax are of alpha·acc (SPEC §1, §4)
            alpha_l = alpha[batch]
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] * alpha_l
        amax_bits = cutlass.Int32(0)
        if cutlass.const_expr(self.c_name == "bfloat16"):
            if n % 8 == 0:
                amax_bits = self._store_bf16_rows(acc, c, n, tile_n, c_row_base, row0, col0, m_start, rows_lo,
                                                  rows_hi, lane)
            else:
                amax_bits = self._store_scalars(acc, c, n, tile_n, c_row_base, row0, col0, m_start, rows_lo,
                                                rows_hi)
        elif cutlass.const_expr(self.c_kind == "wide"):
            amax_bits = self._store_scalars(acc, c, n, tile_n, c_row_base, row0, col0, m_start, rows_lo, rows_hi)
        else:
            amax_bits = self._store_bytes(acc, c, n, tile_n, c_row_base, row0, col0, m_start, rows_lo, rows_hi)
        amax_i32 = cute.make_tensor(cute.recast_ptr(amax.iterator, dtype=cutlass.Int32), cute.make_layout((1,)))
        common.amax_block_reduce_and_publish(
            amax_bits, warp_amax, (amax_i32.iterator + amax_slot), local_tid, self.num_consumer_warps,
            self.epilogue_barrier_id)

    @cute.jit
    def _store_scalars(self, acc, c, n, tile_n, c_row_base, row0, col0, row_base, rows_lo, rows_hi):
        """f32/bf16/f16 C one element at a time; returns the thread's max |acc| bits over what it stored."""
        bn = self.tile_mnk[1]
        amax_bits = cutlass.Int32(0)
        for v1 in cutlass.range_constexpr(2):
            r = row0 + 8 * v1
            row_ok = (row_base + r >= rows_lo) & (row_base + r < rows_hi)
            for v2 in cutlass.range_constexpr(bn // 8):
                for v0 in cutlass.range_constexpr(2):
                    col = col0 + v0 + 8 * v2
                    i = v0 + 2 * v1 + 4 * v2
                    if row_ok & (tile_n * bn + col < n):
                        x = acc[i]
                        c[c_row_base + cutlass.Int64(r) * n + col] = x.to(self.c_dtype)
                        amax_bits = cutlass.max(amax_bits, common.abs_bits(x))
        return amax_bits

    @cute.jit
    def _store_bytes(self, acc, c, n, tile_n, c_row_base, row0, col0, row_base, rows_lo, rows_hi):
        """One-byte and packed FP4 C (`c` as bytes): values v0 = 0, 1 of a thread are adjacent columns (col0 is
        even), so both go through one conversion; stored as bytes (FP8: one per column, FP4: one per pair, N even).
        Returns the thread's max |acc| bits over what it stored."""
        bn = self.tile_mnk[1]
        amax_bits = cutlass.Int32(0)
        for v1 in cutlass.range_constexpr(2):
            r = row0 + 8 * v1
            row_ok = (row_base + r >= rows_lo) & (row_base + r < rows_hi)
            for v2 in cutlass.range_constexpr(bn // 8):
                col = col0 + 8 * v2
                i = 2 * v1 + 4 * v2
                x0, x1 = acc[i], acc[i + 1]
                index = c_row_base + cutlass.Int64(r) * n + col
                in0 = row_ok & (tile_n * bn + col < n)
                in1 = row_ok & (tile_n * bn + col + 1 < n)
                if cutlass.const_expr(self.c_kind == "fp8"):
                    codes = epilogue.fp8x2(x0, x1, "e4m3" if self.c_name == "float8_e4m3fn" else "e5m2")
                    if in0:
                        c[index] = (codes & 0xFF).to(cutlass.Uint8)
                        amax_bits = cutlass.max(amax_bits, common.abs_bits(x0))
                    if in1:
                        c[index + 1] = ((codes >> 8) & 0xFF).to(cutlass.Uint8)
                        amax_bits = cutlass.max(amax_bits, common.abs_bits(x1))
                else:
                    if in0:  # N is even: the pair is in or out together
                        packed = epilogue.e2m1_nibble(x0) | (epilogue.e2m1_nibble(x1) << 4)
                        c[index // 2] = packed.to(cutlass.Uint8)
                        amax_bits = cutlass.max(amax_bits, common.abs_bits(x0))
                        amax_bits = cutlass.max(amax_bits, common.abs_bits(x1))
        return amax_bits

    @cute.jit
    def _store_bf16_rows(self, acc, c, n, tile_n, c_row_base, row0, col0, row_base, rows_lo, rows_hi, lane):
        """bf16 C (N a multiple of 8) in 16-byte stores: the four lanes of a quad hold two adjacent columns each of
        every 8-column group; a 4 x 4 word transpose inside the quad (three xor shuffles) gives lane q the whole
        group 4j + q of four consecutive groups, so each store writes 8 columns and a quad 64 contiguous bytes of a
        row. Returns the thread's max |acc| bits over the elements in bounds (the values before rounding)."""
        bn = self.tile_mnk[1]
        quad = lane % 4
        amax_bits = cutlass.Int32(0)
        c_addr = c.iterator.toint()
        for v1 in cutlass.range_constexpr(2):
            r = row0 + 8 * v1
            row_ok = (row_base + r >= rows_lo) & (row_base + r < rows_hi)
            row_addr = c_addr + (c_row_base + cutlass.Int64(r) * n) * 2
            for j in cutlass.range_constexpr(bn // 32):
                words = []
                for g in cutlass.range_constexpr(4):  # column groups 4j + g: columns col0, col0 + 1 of each
                    i = 2 * v1 + 4 * (4 * j + g)
                    in_cols = tile_n * bn + 8 * (4 * j + g) < n  # n % 8 == 0: the pair is in or out with its group
                    if row_ok & in_cols:
                        amax_bits = cutlass.max(amax_bits, common.abs_bits(acc[i]))
                        amax_bits = cutlass.max(amax_bits, common.abs_bits(acc[i + 1]))
                    words.append(epilogue.bf16x2(acc[i], acc[i + 1]))
                # out[p] = lane p's word for group 4j + quad; round x trades with lane quad ^ x
                out = [words[0], words[1], words[2], words[3]]
                for x in cutlass.range_constexpr(1, 4):
                    send = _pick(words, quad ^ x)
                    got = cute.arch.shuffle_sync_bfly(send, offset=x)
                    for p in cutlass.range_constexpr(4):
                        out[p] = cutlass.select_(p == quad ^ x, got, out[p])
                out_own = _pick(words, quad)
                for p in cutlass.range_constexpr(4):
                    out[p] = cutlass.select_(p == quad, out_own, out[p])
                col = 8 * (4 * j + quad)
                ok = row_ok & (tile_n * bn + col < n)
                ptx_ops.st_global_v4_if(row_addr + col * 2, out[0], out[1], out[2], out[3], ok.to(cutlass.Int32))
        return amax_bits


def _pick(words: list, index):
    """words[index] for a run-time index in [0, 4): three selects."""
    lo = cutlass.select_((index & 1) == 1, words[1], words[0])
    hi = cutlass.select_((index & 1) == 1, words[3], words[2])
    return cutlass.select_((index & 2) == 2, hi, lo)
