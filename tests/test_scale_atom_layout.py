"""CPU: the kernels' view of the 128x4 scale atom (SPEC §3) is the one the library writes. The host-side offsets
(`kernels/common.py`) and the layout the sm_100a kernel reads scales through are checked against where
`formats.to_scale_atom` puts numbered scales, and against the seed's 6-D view, which SPEC §3 defines as the physical
buffer transposed by (3, 4, 1, 5, 2, 0)."""

import numpy as np
from absl.testing import absltest, parameterized

from jax_blockgemm import formats
from jax_blockgemm.kernels import common

# (L, MN, KB): one whole atom, one partial, several atoms with partial tails in both directions, batches.
_SHAPES = ((1, 128, 4), (1, 1, 1), (1, 300, 9), (3, 129, 4), (2, 257, 13))


def _where_to_scale_atom_puts(l: int, mn: int, kb: int) -> np.ndarray:
    """offset[l, mn, kb]: the byte of the flat physical buffer that `formats.to_scale_atom` fills with S[l, mn, kb].

    Each scale is numbered (index + 1, so that padding's 0 stands out) and its number converted as three byte
    planes, each through `to_scale_atom`; a byte of the result is then the number of the scale it came from."""
    numbers = np.arange(1, l * mn * kb + 1, dtype=np.int64).reshape(l, mn, kb)
    planes = [np.asarray(formats.to_scale_atom(((numbers >> (8 * p)) & 0xFF).astype(np.uint8))).reshape(-1)
              for p in range(3)]
    found = planes[0].astype(np.int64) | planes[1].astype(np.int64) << 8 | planes[2].astype(np.int64) << 16
    filled = np.flatnonzero(found)
    assert np.array_equal(np.sort(found[filled]), numbers.reshape(-1)), "to_scale_atom lost or repeated a scale"
    offset = np.empty(l * mn * kb, np.int64)
    offset[found[filled] - 1] = filled
    return offset.reshape(l, mn, kb)


def _seed_view_offsets(l: int, mn: int, kb: int) -> np.ndarray:
    """offset[l, mn, kb] read through the seed's view of a buffer holding each byte's own offset: view index (a0, a1,
    rm, ak, rk, l) with mn = a0 + 32 a1 + 128 rm and kb = ak + 4 rk, the view being the buffer transposed."""
    mn_tiles, k_tiles = -(-mn // 128), -(-kb // 4)
    buffer = np.arange(l * mn_tiles * k_tiles * 512).reshape(l, mn_tiles, k_tiles, 32, 4, 4)
    view = buffer.transpose(3, 4, 1, 5, 2, 0)
    ll, rows, blocks = np.meshgrid(np.arange(l), np.arange(mn), np.arange(kb), indexing="ij")
    return view[rows % 32, (rows // 32) % 4, rows // 128, blocks % 4, blocks // 4, ll]


def _host_offsets(l: int, mn: int, kb: int) -> np.ndarray:
    """`common.atom_byte_offset` of every scale."""
    return np.array([[[common.atom_byte_offset(i, r, b, mn, kb) for b in range(kb)] for r in range(mn)]
                     for i in range(l)], np.int64).reshape(l, mn, kb)


class HostOffsetTest(parameterized.TestCase):

    @parameterized.parameters(*_SHAPES)
    def test_byte_offset_is_where_to_scale_atom_writes(self, l, mn, kb):
        np.testing.assert_array_equal(_host_offsets(l, mn, kb), _where_to_scale_atom_puts(l, mn, kb))

    @parameterized.parameters(*_SHAPES)
    def test_byte_offset_matches_the_seed_view(self, l, mn, kb):
        np.testing.assert_array_equal(_host_offsets(l, mn, kb), _seed_view_offsets(l, mn, kb))

    def test_word_offset_holds_a_row_s_four_scales(self):
        """Row r's scales of k-blocks 0..3 are the bytes of word `atom_word_offset(r)` of an atom, in order."""
        first_atom = _where_to_scale_atom_puts(1, 128, 4)[0]
        for row in range(128):
            self.assertEqual(list(first_atom[row]), [4 * common.atom_word_offset(row) + b for b in range(4)], row)


class Sm100ScaleLayoutTest(absltest.TestCase):

    def test_the_kernel_reads_each_scale_where_to_scale_atom_writes_it(self):
        """The layout the sm_100a kernel reads scales through maps scale (mn, k, l) to the byte holding it."""
        import cutlass.cute as cute

        from jax_blockgemm.kernels.sm100.gemm_amax import scale_layout

        rng = np.random.default_rng(3)
        m, k, l = 300, 32 * 21, 2
        coords = [(int(rng.integers(m)), int(rng.integers(k)), int(rng.integers(l))) for _ in range(300)]
        coords += [(m - 1, k - 1, l - 1), (0, 0, 0)]
        got = {}

        @cute.jit
        def probe():
            layout = scale_layout((m, k, l), 32)
            for c in coords:
                got[c] = cute.crd2idx(c, layout)

        cute.compile(probe)
        written = _where_to_scale_atom_puts(l, m, k // 32)
        for mn, kk, ll in coords:
            self.assertEqual(got[(mn, kk, ll)], written[ll, mn, kk // 32], (mn, kk, ll))


if __name__ == "__main__":
    absltest.main()
