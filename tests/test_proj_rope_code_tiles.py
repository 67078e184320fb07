"""CPU model of the Hopper proj_rope epilogue's data movement (kernels/sm90/proj_rope.py `_epilogue`, layout in
kernels/sm90/code_tiles.py): which thread holds which value, the code words, the rowwise quad butterfly, the
columnwise transposing butterfly and partner exchange, the per-warp scale table, the swizzled shared code tiles, the
byte-permuting reader and every global store, for one warpgroup's 64 x 192 tile, in NumPy, against a direct
rowwise/columnwise MXFP8 quantization of the same tile. Also: every shared byte written exactly once, and no bank
conflicts in any quarter warp of the 16-byte shared stores and loads.
"""

import ml_dtypes
import numpy as np
from absl.testing import absltest, parameterized

from jax_blockgemm import formats
from jax_blockgemm.kernels.sm90 import code_tiles as ct

ROWS, FEATS = 64, 192
LANES, WARPS = 32, 4


def e8m0(amax: np.ndarray) -> np.ndarray:
    e = np.asarray(formats.scale_exponent(amax.astype(np.float32), 448.0))
    return np.where(e == 128, 255, e + 127).astype(np.int64)


def inv_of(byte):
    return np.array((254 - byte) << 23, np.uint32).view(np.float32)


def e4m3(x: np.ndarray) -> np.ndarray:
    return np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.int64)


def prmt(a: int, b: int, sel: int) -> int:
    src = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def reference(y: np.ndarray):
    """Direct MXFP8 of a (64, 192) tile: row codes/scales, col codes/scales (2 blocks of 32 tokens)."""
    a = np.abs(y)
    rs = e8m0(np.nanmax(np.where(np.isnan(a), np.inf, a).reshape(ROWS, 6, 32), axis=2))
    rs = np.where(np.isnan(a).reshape(ROWS, 6, 32).any(axis=2), 255, rs)
    cs = e8m0(np.nanmax(np.where(np.isnan(a), np.inf, a).reshape(2, 32, FEATS), axis=1))
    cs = np.where(np.isnan(a).reshape(2, 32, FEATS).any(axis=1), 255, cs)

    def codes(scale_full):
        c = e4m3(y * inv_of(np.minimum(scale_full, 254)))
        return np.where(scale_full == 255, 0, c)

    rc = codes(np.repeat(rs, 32, axis=1))
    cc = codes(np.repeat(cs, 32, axis=0))
    return rc, rs, cc, cs


def bits(x):
    return (np.array(x, np.float32).view(np.uint32) & 0x7FFFFFFF).astype(np.int64)


def model(y: np.ndarray, tile_rows: int = 64, row_base: int = 0):
    """The kernel's path, thread by thread. Returns (row codes, row scales, col codes, col scales) as written to
    global memory, the two shared tiles' write counts, and the shared addresses of each quarter warp's accesses."""
    members = [ct.word_members(n) for n in range(ct.WORDS)]
    thr = [(w, lane) for w in range(WARPS) for lane in range(LANES)]

    def val(w, lane, j, v0, v1):
        return y[16 * w + lane // 4 + 8 * v1, ct.feature(j, v0, lane % 4)]

    out_rs = np.full((ROWS, 6), -1)
    out_cs = np.full((2, FEATS), -1)
    row_words, col_words = {}, {}
    # rowwise: local max of 8, then the quad butterfly (max over lanes lane^1, lane^2)
    local = {}
    for w, lane in thr:
        for v1 in range(2):
            for b in range(6):
                local[w, lane, v1, b] = max(bits(val(w, lane, j, v0, v1)) for n in (2 * b, 2 * b + 1)
                                            for j, v0 in members[n])
    for o in (1, 2):
        local = {(w, lane, v1, b): max(m, local[w, lane ^ o, v1, b]) for (w, lane, v1, b), m in local.items()}
    for w, lane in thr:
        q = lane % 4
        for v1 in range(2):
            bytes_ = [int(e8m0(np.array(local[w, lane, v1, b]).astype(np.uint32).view(np.float32))) for b in range(6)]
            if q < 3:  # lane q stores scale bytes 2q, 2q+1 of its row
                out_rs[16 * w + lane // 4 + 8 * v1, 2 * q:2 * q + 2] = bytes_[2 * q:2 * q + 2]
            words = []
            for n in range(ct.WORDS):
                byte = bytes_[n // 2]
                x = [val(w, lane, j, v0, v1) * inv_of(min(byte, 254)) for j, v0 in members[n]]
                word = sum(int(c) << (8 * k) for k, c in enumerate(e4m3(np.array(x, np.float32))))
                words.append(0 if byte == 255 else word)
            row_words[w, lane, v1] = words

    # columnwise: transposing butterfly over lane bits 4, 3, 2
    part = {(w, lane): [max(bits(val(w, lane, j, v0, 0)), bits(val(w, lane, j, v0, 1)))
                        for n in range(ct.WORDS) for j, v0 in members[n]] for w, lane in thr}
    for o in (16, 8, 4):
        new = {}
        for (w, lane), v in part.items():
            half = len(v) // 2
            upper = bool(lane & o)
            keep = v[half:] if upper else v[:half]
            pv = part[w, lane ^ o]
            sent = pv[half:] if upper else pv[:half]  # the partner sends the half this lane keeps
            new[w, lane] = [max(a, b) for a, b in zip(keep, sent)]
        part = new
    table = np.zeros((WARPS, 192), np.int64)
    for w, lane in thr:
        q, lb = lane % 4, lane // 4
        full = [max(a, b) for a, b in zip(part[w, lane], part[w ^ 1, lane])]
        cb = [int(e8m0(np.array(f).astype(np.uint32).view(np.float32))) for f in full]
        table[w, q * 48 + 6 * lb:q * 48 + 6 * lb + 6] = cb
        if w % 2 == 0:  # global column scales: the kernel's predicates and addresses
            for p in range(3):
                e0 = 6 * lb + 2 * p
                if e0 < 32:
                    f = 8 * (e0 >> 1) + 2 * q
                    out_cs[w // 2, f:f + 2] = cb[2 * p:2 * p + 2]
                    assert [ct.col_list_feature(e0, q), ct.col_list_feature(e0 + 1, q)] == [f, f + 1]
                else:
                    r = e0 - 32
                    f = 128 + 32 * (r >> 3) + 4 * (r & 7) + q
                    out_cs[w // 2, f] = cb[2 * p]
                    out_cs[w // 2, f + 4] = cb[2 * p + 1]
                    assert [ct.col_list_feature(e0, q), ct.col_list_feature(e0 + 1, q)] == [f, f + 4]
    for w, lane in thr:
        q = lane % 4
        sw = table[w, q * 48:q * 48 + 48]  # 3 x 16-byte loads = 12 scale words
        for v1 in range(2):
            words = []
            for n in range(ct.WORDS):
                word = 0
                for k, (j, v0) in enumerate(members[n]):
                    byte = int(sw[4 * n + k])
                    c = int(e4m3(np.array([val(w, lane, j, v0, v1) * inv_of(min(byte, 254))], np.float32))[0])
                    word |= (0 if byte == 255 else c) << (8 * k)
                words.append(word)
            col_words[w, lane, v1] = words

    # stage: 3 x 16-byte stores per thread, row and tile
    tiles = {name: np.zeros(tile_rows * ct.ROW_BYTES, np.int64) for name in ("row", "col")}
    writes = {name: np.zeros(tile_rows * ct.ROW_BYTES, np.int64) for name in ("row", "col")}
    accesses = []  # (instruction, quarter warp id, [16-byte unit addresses])
    for name, words_of in (("row", row_words), ("col", col_words)):
        for v1 in range(2):
            for unit in range(3):
                for w in range(WARPS):
                    for qw in range(4):
                        addrs = []
                        for lane in range(8 * qw, 8 * qw + 8):
                            r = row_base + 16 * w + lane // 4 + 8 * v1
                            q = lane % 4
                            off = (ct.nope_unit_offset(r, q, unit) if unit < 2
                                   else ct.rope_unit_offset(tile_rows, r, q))
                            words = words_of[w, lane, v1][4 * unit:4 * unit + 4]
                            for i, word in enumerate(words):
                                for k in range(4):
                                    tiles[name][off + 4 * i + k] = (word >> (8 * k)) & 0xFF
                                    writes[name][off + 4 * i + k] += 1
                            addrs.append(off)
                        accesses.append(((name, "st", v1, unit, w), addrs))

    # read: thread (rr, hh): nope unit hh of both tiles, rope unit of tile hh
    out = {"row": np.full((ROWS, FEATS), -1), "col": np.full((ROWS, FEATS), -1)}

    def ld(name, off):
        return [int(sum(int(tiles[name][off + 4 * i + k]) << (8 * k) for k in range(4))) for i in range(4)]

    for kind in ("row", "col", "rope"):
        for q in range(4):
            for tid0 in range(0, 128, 8):
                addrs = []
                for tid in range(tid0, tid0 + 8):
                    rr, hh = tid & 63, tid >> 6
                    r = row_base + rr
                    addrs.append(ct.nope_unit_offset(r, q, hh) if kind != "rope"
                                 else ct.rope_unit_offset(tile_rows, r, q))
                accesses.append(((kind, "ld", q, tid0), addrs))
    for tid in range(128):
        rr, hh = tid & 63, tid >> 6
        r = row_base + rr
        for name in ("row", "col"):
            qs = [ld(name, ct.nope_unit_offset(r, q, hh)) for q in range(4)]
            for w in range(4):
                o = [prmt(qs[0][w], qs[1][w], ct.PRMT_LO16), prmt(qs[2][w], qs[3][w], ct.PRMT_LO16),
                     prmt(qs[0][w], qs[1][w], ct.PRMT_HI16), prmt(qs[2][w], qs[3][w], ct.PRMT_HI16)]
                base = 64 * hh + 16 * w
                for i, word in enumerate(o):
                    for k in range(4):
                        assert out[name][rr, base + 4 * i + k] == -1
                        out[name][rr, base + 4 * i + k] = (word >> (8 * k)) & 0xFF
        name = ("row", "col")[hh]
        qs = [ld(name, ct.rope_unit_offset(tile_rows, r, q)) for q in range(4)]
        for m in range(4):
            lo01, hi01 = prmt(qs[0][m], qs[1][m], ct.PRMT_ZIP_LO), prmt(qs[0][m], qs[1][m], ct.PRMT_ZIP_HI)
            lo23, hi23 = prmt(qs[2][m], qs[3][m], ct.PRMT_ZIP_LO), prmt(qs[2][m], qs[3][m], ct.PRMT_ZIP_HI)
            o = [prmt(lo01, lo23, ct.PRMT_LO16), prmt(lo01, lo23, ct.PRMT_HI16), prmt(hi01, hi23, ct.PRMT_LO16),
                 prmt(hi01, hi23, ct.PRMT_HI16)]
            for i, word in enumerate(o):
                for k in range(4):
                    assert out[name][rr, 128 + 16 * m + 4 * i + k] == -1
                    out[name][rr, 128 + 16 * m + 4 * i + k] = (word >> (8 * k)) & 0xFF
    return out["row"], out_rs, out["col"], out_cs, writes, accesses


class CodeTilesTest(parameterized.TestCase):

    @parameterized.parameters((64, 0, 0), (128, 0, 1), (128, 64, 2))
    def test_model_matches_direct_quantization(self, tile_rows, row_base, seed):
        rng = np.random.default_rng(seed)
        y = (rng.standard_normal((ROWS, FEATS)) * np.exp2(rng.integers(-20, 20, (ROWS, FEATS)))).astype(np.float32)
        y[:, 40:48] = 0.0  # zero column pieces
        y[3, 70] = np.inf  # a rowwise block and a column block with inf
        y[40, 150] = np.nan
        y[50, 33] = -np.inf
        y[10:12, 160:192] = 0.0  # all-zero row blocks
        want = reference(y)
        rc, rs, cc, cs, writes, accesses = model(y, tile_rows, row_base)
        np.testing.assert_array_equal(rs, want[1])
        np.testing.assert_array_equal(cs, want[3])
        np.testing.assert_array_equal(rc, want[0])
        np.testing.assert_array_equal(cc, want[2])
        # every byte of this warpgroup's rows in both tiles written exactly once
        for name in ("row", "col"):
            tile = writes[name]
            mine = np.zeros_like(tile)
            for r in range(row_base, row_base + ROWS):
                mine[r * 128:r * 128 + 128] = 1
                mine[tile_rows * 128 + r * 64:tile_rows * 128 + r * 64 + 64] = 1
            np.testing.assert_array_equal(tile, mine)
        # no bank conflicts: a quarter warp's 8 16-byte accesses cover 8 different 16-byte bank groups
        for key, addrs in accesses:
            self.assertEqual(len({(a // 16) % 8 for a in addrs}), 8, key)
            self.assertTrue(all(a % 16 == 0 for a in addrs), key)

    def test_ff_bytes_marks_exactly_the_nan_scale_bytes(self):
        rng = np.random.default_rng(0)
        for _ in range(20000):
            b = [int(x) for x in rng.choice([0, 1, 126, 127, 128, 200, 254, 255], 4)]
            word = sum(x << (8 * k) for k, x in enumerate(b))
            z = ct.ff_bytes_bit7(word)
            self.assertEqual(prmt(z, z, ct.PRMT_SIGN_BYTES), sum((0xFF if x == 255 else 0) << (8 * k)
                                                                 for k, x in enumerate(b)))

    def test_words_cover_each_thread_fragment_once(self):
        seen = sorted((j, v0) for n in range(ct.WORDS) for j, v0 in ct.word_members(n))
        self.assertEqual(seen, [(j, v0) for j in range(24) for v0 in range(2)])
        for n in range(ct.WORDS):  # rowwise block of word n is n // 2
            blocks = {ct.feature(j, v0, q) // 32 for j, v0 in ct.word_members(n) for q in range(4)}
            self.assertEqual(blocks, {n // 2})
        for q in range(4):
            feats = sorted(ct.col_list_feature(i, q) for i in range(48))
            self.assertEqual(len(set(feats)), 48)
        self.assertEqual(sorted(ct.col_list_feature(i, q) for i in range(48) for q in range(4)), list(range(192)))


if __name__ == "__main__":
    absltest.main()
