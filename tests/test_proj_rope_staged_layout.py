"""CPU: the shared-memory tile Y of the sm_90a "staged" proj_rope kernel (kernels/sm90/y_tile.py), by its own
offset functions on plain integers.

The MMA warpgroups write their wgmma fragments into Y (`fragment_bases`, `fragment_address`); the epilogue warpgroup
reads each token's row (`row_addresses`: eight base addresses, chunk 8m + c at + BLOCK_REGION·m) and, per 32-feature
block, lane l of warp w reads feature 32b + l of the warp's 32 rows (`column_offsets`), then writes the block's codes
into two TMA boxes in the warp's block region (`box_offset`). Checked here: every fp32 of the 128 x 192 tile is
written exactly once at the address `offset` defines for its (token, feature); the row and column readers fetch
exactly that value; the boxes lie in the block's region and follow the TMA's 32-byte swizzle; and no access has a
shared-memory bank conflict beyond its width (a 16-byte access by a quarter warp hits 8 distinct 16-byte bank
groups, a 4-byte access by a warp 32 distinct banks).
"""

import numpy as np
from absl.testing import absltest

try:
    from jax_blockgemm.kernels.sm90 import y_tile as K
except ImportError as e:  # pragma: no cover - CuTeDSL is a hard dependency of this test file
    raise absltest.SkipTest(f"CuTeDSL not importable: {e}")

from jax_blockgemm.kernels import token_rows
from jax_blockgemm.support import HEAD_DIM, MX_BLOCK

ROWS = 128
BLOCKS = HEAD_DIM // MX_BLOCK


def _addr(row: int, feature: int) -> int:
    """Where Y holds (row, feature) by definition: its 16-byte chunk by `offset`, then 4 bytes per feature."""
    return K.offset(row, feature // 4) + 4 * (feature % 4)


def _banks16(addrs) -> int:
    return len({(a // 16) % 8 for a in addrs})


class StagedYLayoutTest(absltest.TestCase):

    def test_fragments_fill_the_tile_once(self):
        """Thread (warp, lane) of MMA warpgroup g holds rows 64g + 16·warp + lane/4 (+ 8) and features
        8j + 2·(lane % 4) (+ 1): each 8-byte store lands on exactly that pair, and the 256 threads cover Y once."""
        seen = np.zeros((ROWS, HEAD_DIM), np.int64)
        by_addr = {}
        for g in range(2):
            for warp in range(4):
                for lane in range(32):
                    row0, quad = 64 * g + 16 * warp + lane // 4, lane % 4
                    base = K.fragment_bases(0, row0, quad)
                    for v1 in range(2):
                        for j in range(HEAD_DIM // 8):
                            a = K.fragment_address(base, j, v1)
                            row, feature = row0 + 8 * v1, 8 * j + 2 * quad
                            self.assertEqual(a, _addr(row, feature))
                            self.assertEqual(a + 4, _addr(row, feature + 1))
                            seen[row, feature:feature + 2] += 1
                            by_addr[a] = (row, feature)
        np.testing.assert_array_equal(seen, 1)
        self.assertEqual(len(by_addr), ROWS * HEAD_DIM // 2)
        self.assertEqual(max(by_addr) + 8, ROWS * HEAD_DIM * 4)  # the tile is exactly 96 KB

    def test_fragment_stores_are_one_wavefront_per_half_warp(self):
        """An 8-byte `write_fragment` store (fixed j, v1) of a warp: each half warp (16 lanes, 128 bytes) hits 32
        distinct banks, so the warp's 256 bytes take the minimum of 2 wavefronts."""
        for g in range(2):
            for warp in range(4):
                for v1 in range(2):
                    for j in range(HEAD_DIM // 8):
                        for half in range(2):
                            banks = set()
                            for lane in range(16 * half, 16 * half + 16):
                                row0, quad = 64 * g + 16 * warp + lane // 4, lane % 4
                                a = K.fragment_address(K.fragment_bases(0, row0, quad), j, v1)
                                banks |= {(a // 4) % 32, (a // 4 + 1) % 32}
                            self.assertEqual(len(banks), 32, (g, warp, v1, j, half))

    def test_swizzle_key_is_a_permutation(self):
        self.assertEqual(sorted(K.swizzle_key(r) for r in range(8)), list(range(8)))
        self.assertEqual([K.swizzle_key(r) for r in range(16)], [K.swizzle_key(r % 8) for r in range(16)])

    def test_row_reads_and_their_banks(self):
        """Token row r, block b, chunk c: `row_addresses(r)[c] + BLOCK_REGION·b` holds features 32b + 4c .. + 3; the
        8 threads of a quarter warp (8 consecutive rows) reading the same chunk hit 8 different bank groups."""
        for row in range(ROWS):
            addrs = K.row_addresses(0, row)
            for b in range(BLOCKS):
                for c in range(MX_BLOCK // 4):
                    self.assertEqual(addrs[c] + K.BLOCK_REGION * b, _addr(row, MX_BLOCK * b + 4 * c))
        for first in range(0, ROWS, 8):
            for b in range(BLOCKS):
                for c in range(MX_BLOCK // 4):
                    self.assertEqual(
                        _banks16([K.row_addresses(0, r)[c] + K.BLOCK_REGION * b for r in range(first, first + 8)]), 8)

    def test_column_reads_and_their_banks(self):
        """Lane l of epilogue warp w, block b, row r of the warp: warp_offset(w) + BLOCK_REGION·b + ROW_PITCH·r +
        offsets[r % 8] holds (32w + r, 32b + l), and the warp's 32 lanes read 32 distinct banks."""
        offsets = [K.column_offsets(lane) for lane in range(32)]
        for warp in range(4):
            for b in range(BLOCKS):
                for r in range(MX_BLOCK):
                    addrs = [K.warp_offset(warp) + b * K.BLOCK_REGION + r * K.ROW_PITCH + offsets[lane][r % 8]
                             for lane in range(32)]
                    for lane in range(32):
                        self.assertEqual(addrs[lane], _addr(32 * warp + r, MX_BLOCK * b + lane))
                    self.assertEqual(len({(a // 4) % 32 for a in addrs}), 32)

    def test_a_block_region_is_the_warps_rows_of_that_block(self):
        """Block b of warp w's 32 rows is exactly the 4 KB at warp_offset(w) + BLOCK_REGION·b: once the warp has
        read block b (rows and columns), the whole region is free for its code boxes, and nothing else is."""
        for warp in range(4):
            for b in range(BLOCKS):
                lo = K.warp_offset(warp) + b * K.BLOCK_REGION
                got = sorted(_addr(32 * warp + r, MX_BLOCK * b + f) for r in range(32) for f in range(MX_BLOCK))
                self.assertEqual(got, list(range(lo, lo + K.BLOCK_REGION, 4)))


def _sw32(a: int) -> int:
    """The TMA's 32-byte swizzle (CU_TENSOR_MAP_SWIZZLE_32B, cute Swizzle<1,4,3>) of byte offset a."""
    return a ^ (((a >> 7) & 1) << 4)


class StagedCodeBoxesTest(absltest.TestCase):

    def test_boxes_are_what_the_tma_reads(self):
        """`box_offset(out, r, half) + i` is where the TMA store of box `out` (32 tokens x 32 bytes, 32-byte swizzle)
        reads byte 16·half + i of token r: the 2 KB of both boxes exactly, inside the 4 KB block region."""
        seen = set()
        for out in range(2):
            for r in range(32):
                for half in range(2):
                    for i in range(16):
                        a = K.box_offset(out, r, half) + i
                        self.assertEqual(a, K.BOX_BYTES * out + _sw32(32 * r + 16 * half + i))
                        seen.add(a)
        self.assertEqual(sorted(seen), list(range(2 * K.BOX_BYTES)))
        self.assertLessEqual(2 * K.BOX_BYTES, K.BLOCK_REGION)

    def test_box_writes_are_conflict_free(self):
        """A quarter warp (8 consecutive tokens) writing the same half of one box hits 8 bank groups."""
        for out in range(2):
            for first in range(0, 32, 8):
                for half in range(2):
                    self.assertEqual(_banks16([K.box_offset(out, r, half) for r in range(first, first + 8)]), 8)

    def test_the_box_layout_matches_box_offset(self):
        """The cute layout the TMA atoms are built from (`code_box_layout`) maps (byte f, head 0, token r) to the
        same offset as `box_offset`, swizzle included."""
        import cutlass
        import cutlass.cute as cute

        seen = []

        @cute.jit
        def probe():
            layout = K.code_box_layout()
            for r in cutlass.range_constexpr(32):
                for f in cutlass.range_constexpr(32):
                    seen.append((r, f, layout((f, 0, r))))

        probe()
        self.assertEqual(len(seen), 32 * 32)
        for r, f, off in seen:
            self.assertEqual(int(off), K.box_offset(0, r, f // 16) + f % 16)


class StagedRowScalesTest(absltest.TestCase):

    def test_row_scale_pieces_cover_each_token_run_once(self):
        """`store_row_scales`: over its 3 steps the warp's lanes store each of its 32 tokens' three 16-bit pieces
        exactly once, at row_scale_index(token) + 2q: every byte of the warp's (32, H, 6) slab once, nothing else."""
        h, head, token0 = 7, 3, 64
        written = np.zeros(128 * h * BLOCKS, np.int64)
        for lane in range(32):
            for k in range(K.ROW_SCALE_PIECES):
                r, q = K.row_scale_piece(lane, k)
                self.assertLess(r, 32)
                self.assertIn(q, range(BLOCKS // 2))
                a = token_rows.row_scale_index(token0 + r, head, h) + 2 * q
                self.assertEqual(a % 2, 0)  # a 16-bit store needs an even address
                written[a:a + 2] += 1
        expect = np.zeros_like(written)
        for r in range(32):
            first = token_rows.row_scale_index(token0 + r, head, h)
            expect[first:first + BLOCKS] = 1
        np.testing.assert_array_equal(written, expect)

    def test_a_row_scale_step_writes_whole_runs(self):
        """Within one step the lanes take consecutive pieces: at most 11 tokens per store instruction (one L2 request
        each), against 32 for a byte per token."""
        for k in range(K.ROW_SCALE_PIECES):
            items = [K.row_scale_piece(lane, k) for lane in range(32)]
            self.assertEqual([3 * r + q for r, q in items], list(range(32 * k, 32 * k + 32)))
            self.assertLessEqual(len({r for r, _ in items}), 12)


if __name__ == "__main__":
    absltest.main()
