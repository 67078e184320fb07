"""CPU: the shared-memory tile Y of the sm_90a "staged" proj_rope kernel (kernels/sm90/y_tile.py), by its own
offset functions on plain integers.

The MMA warpgroups write their wgmma fragments into Y (`fragment_bases`, `fragment_address`); the epilogue warpgroup
reads each token's row (`row_addresses`: eight base addresses, chunk 8m + c at + 128·m) and, per 32-feature block,
lane l of warp w reads feature 32b + l of the warp's 32 rows (`column_offsets`), then parks each block's codes in
its own row (`code_slot`). Checked here: every fp32 of the 128 x 192 tile is written exactly once at the address
`offset` defines for its (token, feature); the row and column readers fetch exactly that value; the codes stay in
their block's chunks; and no access has a shared-memory bank conflict beyond its width (a 16-byte access by a
quarter warp hits 8 distinct 16-byte bank groups, a 4-byte access by a warp 32 distinct banks).
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

    def test_row_reads_and_their_banks(self):
        """Token row r, block b, chunk c: `_y_row(r)[c] + 128·b` holds features 32b + 4c .. + 3; the 8 threads of a
        quarter warp (8 consecutive rows) reading the same chunk hit 8 different bank groups."""
        for row in range(ROWS):
            addrs = K.row_addresses(0, row)
            for b in range(BLOCKS):
                for c in range(MX_BLOCK // 4):
                    self.assertEqual(addrs[c] + 128 * b, _addr(row, MX_BLOCK * b + 4 * c))
        for first in range(0, ROWS, 8):
            for b in range(BLOCKS):
                for c in range(MX_BLOCK // 4):
                    self.assertEqual(_banks16([K.row_addresses(0, r)[c] + 128 * b for r in range(first, first + 8)]), 8)

    def test_column_reads_and_their_banks(self):
        """Lane l of epilogue warp w, block b, row r of the warp: y_warp + 128·b + 768·r + offsets[r % 8] holds
        (32w + r, 32b + l), and the warp's 32 lanes read 32 distinct banks."""
        offsets = [K.column_offsets(lane) for lane in range(32)]
        for warp in range(4):
            y_warp = warp * MX_BLOCK * HEAD_DIM * 4
            for b in range(BLOCKS):
                for r in range(MX_BLOCK):
                    addrs = [y_warp + b * MX_BLOCK * 4 + r * HEAD_DIM * 4 + offsets[lane][r % 8]
                             for lane in range(32)]
                    for lane in range(32):
                        self.assertEqual(addrs[lane], _addr(32 * warp + r, MX_BLOCK * b + lane))
                    self.assertEqual(len({(a // 4) % 32 for a in addrs}), 32)


class StagedCodeSlotsTest(absltest.TestCase):

    def test_codes_stay_in_their_own_block_and_never_collide(self):
        """`code_slot`: block b's 4 code chunks (2 outputs x 2 halves) lie among block b's own 8 chunks of the row
        (the only ones free once block b is read), all 24 are distinct, and the 6 blocks' chunks of one kind spread
        over at least 4 bank groups (the whole-row store reads them across a row)."""
        slots = {}
        for b in range(BLOCKS):
            for out in range(2):
                for half in range(2):
                    c = K.code_slot(out, half, b)
                    self.assertEqual(c // 8, b)
                    slots[(out, half, b)] = c
        self.assertEqual(len(set(slots.values())), 4 * BLOCKS)
        for out in range(2):
            for half in range(2):
                self.assertGreaterEqual(len({slots[(out, half, b)] % 8 for b in range(BLOCKS)}), 4)


class StagedCodePathTest(absltest.TestCase):

    def test_staged_codes_leave_as_the_token_rows(self):
        """The bytes' path: each thread parks block b's 32 code bytes of each output in its own row of Y
        (`stage_codes`: chunk `code_slot` of the row); then lane l of warp w, step k, moves chunk
        `code_store_item(l, k)` of token 32w + r to bytes 16q.. of that token's 192-byte output row. Played here on
        byte arrays with random codes: both outputs come out exactly, every byte written once."""
        rng = np.random.default_rng(3)
        codes = rng.integers(0, 256, (2, ROWS, HEAD_DIM), dtype=np.uint8)  # (output, token, byte of the row)
        y = np.zeros(K.BYTES, np.uint8)
        for row in range(ROWS):
            for b in range(BLOCKS):
                for out in range(2):
                    for half in range(2):
                        a = K.offset(row, K.code_slot(out, half, b))
                        y[a:a + 16] = codes[out, row, 32 * b + 16 * half:32 * b + 16 * (half + 1)]
        got = np.zeros_like(codes)
        written = np.zeros(codes.shape, np.int64)
        for warp in range(4):
            for lane in range(32):
                for k in range(HEAD_DIM // 16):
                    r, q, b, half = K.code_store_item(lane, k)
                    self.assertEqual((b, half), (q // 2, q % 2))
                    for out in range(2):
                        a = K.offset(32 * warp + r, K.code_slot(out, half, b))
                        got[out, 32 * warp + r, 16 * q:16 * q + 16] = y[a:a + 16]
                        written[out, 32 * warp + r, 16 * q:16 * q + 16] += 1
        np.testing.assert_array_equal(written, 1)
        np.testing.assert_array_equal(got, codes)

    def test_a_store_step_writes_contiguous_rows(self):
        """Within one step k the warp's 32 lanes cover at most 4 tokens, each as one contiguous run of chunks."""
        for k in range(HEAD_DIM // 16):
            items = [K.code_store_item(lane, k) for lane in range(32)]
            tokens = sorted({r for r, *_ in items})
            self.assertLessEqual(len(tokens), 4)
            for t in tokens:
                qs = [q for r, q, *_ in items if r == t]
                self.assertEqual(qs, list(range(qs[0], qs[0] + len(qs))))


class StagedRowScalesTest(absltest.TestCase):

    def test_row_scale_pieces_cover_each_token_run_once(self):
        """`store_row_scales`: over its 3 steps the warp's lanes store each of its 32 tokens' three 16-bit pieces
        exactly once, at row_scale_index(token) + 2q: every byte of the warp's (32, H, 6) slab once, nothing else."""
        h, head, token0 = 7, 3, 64
        written = np.zeros(128 * h * BLOCKS, np.int64)
        for lane in range(32):
            for k in range(BLOCKS // 2):
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
        for k in range(BLOCKS // 2):
            items = [K.row_scale_piece(lane, k) for lane in range(32)]
            self.assertEqual([3 * r + q for r, q in items], list(range(32 * k, 32 * k + 32)))
            self.assertLessEqual(len({r for r, _ in items}), 12)


if __name__ == "__main__":
    absltest.main()
