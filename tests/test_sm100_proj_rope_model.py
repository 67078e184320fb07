"""CPU: a NumPy model of the sm_100a proj_rope epilogue's data movement, with the kernel module's own index maps.

The kernel cannot run here (no Blackwell GPU). What can be checked without it is where every value goes: the model
plays each epilogue thread (token 32·warp + lane of a 128-token tile, as the 32x32b tensor-memory load hands them
out; tests/test_compile_sm100.py checks that map), takes its six 32-feature blocks the way the kernel does (RoPE
inputs from two loads through `rope_source`, the rotary tables as bf16 pairs in words through `table_entry`), packs
codes into words as the kernel does, and writes them, the rowwise and the columnwise scale bytes through
`code_word`, `row_scale_index` and `col_scale_index` into flat buffers, skipping warps past T. The quantization
itself is the library's (`formats.quantize_mxfp8`: the same SPEC §2 rule the kernel computes on bits). The result
must equal the XLA reference (up to fp32 summation order in Y). A wrong index, a swapped RoPE half, a table word
read from the wrong half, or a tail warp that writes lands in the comparison.
"""

import numpy as np
from absl.testing import absltest, parameterized

try:
    from jax_blockgemm.kernels.sm100 import proj_rope as k
except ImportError as e:  # pragma: no cover - CuTeDSL is a hard dependency of this test file
    raise absltest.SkipTest(f"CuTeDSL not importable: {e}")

import jax
import jax.numpy as jnp

import jax_blockgemm as jbg
from jax_blockgemm import formats, selfcheck
from jax_blockgemm.support import HEAD_DIM, MX_BLOCK, QK_NOPE, QK_ROPE

import oracle_ops

POISON_CODE, POISON_SCALE = 0xFF, 0xFE  # what the FFI handler fills the outputs with before a run


def _bf16_words(table: np.ndarray) -> np.ndarray:
    """A (T, 64) bf16 table as the kernel reads it: (T, 32) little-endian 32-bit words."""
    return np.ascontiguousarray(table).view(np.uint32)


def _entry(words: np.ndarray, i: int) -> np.ndarray:
    """`token_rows.bf16_at` for a column of threads: entry i of each token's table, as fp32."""
    at, high = k.table_entry(i)
    w = words[:, at]
    bits = (w & np.uint32(0xFFFF0000)) if high else (w << np.uint32(16))
    return bits.astype(np.uint32).view(np.float32)


def _pack(codes: np.ndarray) -> np.ndarray:
    """The kernel's packing of 32 E4M3 codes per thread into 8 words (`epilogue.e4m3x4`): byte k of word wd is the
    code of value 4wd + k."""
    c = codes.view(np.uint8).astype(np.uint32)
    pair = lambda a, b: c[:, a] | (c[:, b] << 8)
    return np.stack([pair(4 * wd, 4 * wd + 1) | (pair(4 * wd + 2, 4 * wd + 3) << 16) for wd in range(8)], axis=1)


def model(x, w, cos, sin, *, w_out_in: bool):
    """The four outputs as the sm_100a kernel's epilogue would write them (Y in fp32 from NumPy)."""
    t = x.shape[0]
    wt = w.astype(np.float32) if w_out_in else w.astype(np.float32).T  # (H*192, K)
    h = wt.shape[0] // HEAD_DIM
    y = x.astype(np.float32) @ wt.T  # (T, H*192): the accumulator, tile by tile below
    row32 = np.full(t * h * HEAD_DIM // 4, POISON_CODE * 0x01010101, np.uint32)
    col32 = row32.copy()
    row_scales = np.full(t * h * HEAD_DIM // MX_BLOCK, POISON_SCALE, np.uint8)
    col_scales = np.full(t // MX_BLOCK * h * HEAD_DIM, POISON_SCALE, np.uint8)
    cos_words, sin_words = _bf16_words(cos), _bf16_words(sin)
    lane = np.arange(32)
    for tile_t in range(-(-t // k.TILE_T)):
        for head in range(h):
            tidx = np.arange(k.TILE_T)  # the 128 epilogue threads: thread tidx holds accumulator row tidx
            token = tile_t * k.TILE_T + tidx
            rows = np.minimum(token, t - 1)  # TMA zero-fills x past T; the values there are never stored
            acc = np.where((token < t)[:, None], y[rows, head * HEAD_DIM:(head + 1) * HEAD_DIM], 0)
            blocks = [acc[:, MX_BLOCK * b:MX_BLOCK * (b + 1)] for b in range(QK_NOPE // MX_BLOCK)]
            loads = (acc[:, QK_NOPE:QK_NOPE + MX_BLOCK], acc[:, QK_NOPE + MX_BLOCK:])
            out_lo, out_hi = np.zeros_like(loads[0]), np.zeros_like(loads[0])
            half = QK_ROPE // 2
            for j in range(half):
                load, e = k.rope_source(j)
                src = loads[load]
                cos_lo, sin_lo = _entry(cos_words[rows], j), _entry(sin_words[rows], j)
                cos_hi, sin_hi = _entry(cos_words[rows], half + j), _entry(sin_words[rows], half + j)
                out_lo[:, j] = src[:, e] * cos_lo - src[:, e + 1] * sin_lo
                out_hi[:, j] = src[:, e + 1] * cos_hi + src[:, e] * sin_hi
            blocks += [out_lo, out_hi]
            for b, vals in enumerate(blocks):
                row_codes, row_bytes = (np.asarray(a) for a in formats.quantize_mxfp8(vals, axis=1))
                col_codes, col_bytes = (np.asarray(a) for a in formats.quantize_mxfp8(vals, axis=0))
                for warp in range(k.TILE_T // 32):
                    threads = slice(32 * warp, 32 * warp + 32)
                    tok = token[threads]
                    if tok[0] >= t:  # the whole warp is past T: it stores nothing
                        continue
                    first = k.code_word(tok, head, h) + b * 8
                    for wd in range(8):
                        row32[first + wd] = _pack(row_codes[threads])[:, wd]
                        col32[first + wd] = _pack(col_codes[threads])[:, wd]
                    row_scales[k.row_scale_index(tok, head, h) + b] = row_bytes[threads, 0]
                    col_scales[k.col_scale_index(tile_t, warp, lane, head, h) + MX_BLOCK * b] = col_bytes[warp]
    e4m3 = lambda words: words.view(np.uint8).view(jnp.float8_e4m3fn).reshape(t, h, HEAD_DIM)
    return (e4m3(row32), row_scales.reshape(t, h, HEAD_DIM // MX_BLOCK), e4m3(col32),
            col_scales.reshape(t // MX_BLOCK, h, HEAD_DIM))


class EpilogueModelTest(parameterized.TestCase):

    @parameterized.parameters(
        dict(t=96, h=2, kk=72, w_out_in=True),  # a token tail: the last warp of the tile is past T
        dict(t=32, h=1, kk=64, w_out_in=False),
        dict(t=288, h=3, kk=40, w_out_in=False))  # three token tiles, the last one a quarter full
    def test_model_equals_the_reference(self, t, h, kk, w_out_in):
        inp = oracle_ops.random_proj_rope_inputs(np.random.default_rng(t + h), t=t, h=h, k=kk, mxfp8=False,
                                                 w_out_in=w_out_in)
        args = [inp[n] for n in ("x", "w", "cos", "sin")]
        got = model(*args, w_out_in=w_out_in)
        ref = jax.jit(lambda *a: jbg.gemm_proj_rope_mxfp8(*a, w_out_in=w_out_in, implementation="xla"))(*args)
        ref = [np.asarray(r) for r in ref]
        self.assertEqual(selfcheck.compare_proj_rope(got, ref), "")
        self.assertGreater(np.mean([(a.view(np.uint8) == b.view(np.uint8)).mean() for a, b in zip(got, ref)]),
                           0.999)

    def test_index_maps_cover_each_output_exactly_once(self):
        t, h = 160, 3
        words, rows, cols = np.zeros(t * h * 48, int), np.zeros(t * h * 6, int), np.zeros(t // 32 * h * 192, int)
        for tile_t in range(-(-t // k.TILE_T)):
            for head in range(h):
                for warp in range(4):
                    tok = tile_t * k.TILE_T + 32 * warp + np.arange(32)
                    if tok[0] >= t:
                        continue
                    for b in range(6):
                        for wd in range(8):
                            np.add.at(words, k.code_word(tok, head, h) + 8 * b + wd, 1)
                        np.add.at(rows, k.row_scale_index(tok, head, h) + b, 1)
                        np.add.at(cols, k.col_scale_index(tile_t, warp, np.arange(32), head, h) + 32 * b, 1)
        for name, hits in (("code words", words), ("row scales", rows), ("column scales", cols)):
            self.assertTrue((hits == 1).all(), name)

    def test_rope_sources_and_table_entries(self):
        self.assertEqual([k.rope_source(j) for j in (0, 1, 15, 16, 31)], [(0, 0), (0, 2), (0, 30), (1, 0), (1, 30)])
        self.assertEqual([k.table_entry(i) for i in (0, 1, 2, 63)], [(0, False), (0, True), (1, False), (31, True)])


if __name__ == "__main__":
    absltest.main()
