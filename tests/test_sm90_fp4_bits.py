"""CPU: bit-exact NumPy models of the Hopper kernel's FP4 arithmetic, run with the kernel modules' own constants.

- the E2M1 dequantizer (`common.e2m1_pair_bits`, then two packed bf16 multiplies: by 2^126 and by the block
  scale): every one of the 16 codes, in every position of a 32-bit word, times representative E8M0 scales and
  every positive E4M3 scale, must give code x scale exactly (bf16 rounding of the exact product changes nothing);
- the E4M3 scale decoder (`common.e4m3_scale_bf16x2`'s bit steps): all 256 bytes;
- the FP4 C conversion thresholds (`epilogue.E2M1_STRICT` / `E2M1_INCLUSIVE`): round-to-nearest-even with
  saturation, against the library's own quantizer (`formats.round_to_e2m1`).
A wrong mask, shift, constant or tie rule fails here, before any GPU runs the kernel.
"""

import ml_dtypes
import numpy as np
from absl.testing import absltest

try:
    from jax_blockgemm.kernels import common, epilogue
except ImportError as e:  # pragma: no cover - CuTeDSL is a hard dependency of the kernel modules
    raise absltest.SkipTest(f"CuTeDSL not importable: {e}")

from jax_blockgemm import formats

BF16 = ml_dtypes.bfloat16
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _code_value(nibble: np.ndarray) -> np.ndarray:
    """SPEC §1: magnitude by the low 3 bits, sign by bit 3."""
    return np.where(nibble & 8, -1.0, 1.0) * E2M1_VALUES[nibble & 7]


def _bf16_mul(x_bits: np.ndarray, y: np.ndarray) -> np.ndarray:
    """PTX mul.rn.bf16x2 on one half: the exact product rounded to bf16 (float64 holds any bf16 x bf16 product)."""
    x = x_bits.astype(np.uint16).view(BF16).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        return (x * y).astype(BF16).astype(np.float64)


def _halves(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w = words.astype(np.int64) & 0xFFFFFFFF
    return w & 0xFFFF, w >> 16


class E2M1DequantModelTest(absltest.TestCase):

    def _dequantize(self, words: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """The kernel's per-word steps -> (N, 8) values in k order (pair i holds codes i and i + 4)."""
        out = np.zeros((len(words), 8))
        two126 = common.BF16X2_TWO_POW_126 & 0xFFFF
        self.assertEqual(np.array([two126], np.uint16).view(BF16).astype(np.float64)[0], 2.0**126)
        for i in range(4):
            bits = common.e2m1_pair_bits(words, i)  # NumPy int32 in, int32 out: the same shifts and masks
            self.assertEqual(bits.dtype, np.int32)
            for half, code_index in ((0, i), (1, i + 4)):
                h = _halves(bits)[half]
                exact_code = _bf16_mul(h, np.float64(2.0**126))
                with np.errstate(over="ignore", invalid="ignore"):
                    out[:, code_index] = (exact_code * scale.reshape(-1)).astype(BF16).astype(np.float64)
        return out

    def _words(self) -> tuple[np.ndarray, np.ndarray]:
        """Words holding every code in every one of the 8 positions (and random ones), and their nibbles."""
        rng = np.random.default_rng(0)
        nibbles = np.concatenate([np.repeat(np.arange(16)[:, None], 8, axis=1),  # all positions, every code
                                  np.stack([np.roll(np.arange(16), s)[:8] for s in range(16)]),
                                  rng.integers(0, 16, size=(2000, 8))]).astype(np.int64)
        words = np.zeros(len(nibbles), np.int64)
        for j in range(8):  # SPEC §1: element 2i in the low nibble of byte i -> code j at bits 4j..4j+3
            words |= nibbles[:, j] << (4 * j)
        return words.astype(np.uint32).view(np.int32), nibbles

    def test_every_code_times_e8m0_scales(self):
        words, nibbles = self._words()
        want_codes = _code_value(nibbles)
        for byte in (0, 1, 2, 64, 100, 120, 126, 127, 128, 129, 140, 200, 253, 254):
            scale = np.full(len(words), 2.0 ** (byte - 127))  # byte 0 is 2^-127: the bf16 subnormal e8m0 gives
            got = self._dequantize(words, scale)
            want = want_codes * 2.0 ** (byte - 127)
            with self.subTest(byte=byte):
                # Exact wherever code x scale is below 2^128; 6 x 2^126 and up overflow to inf, as the reference's
                # float32/bf16 dequantization does (reference.py), so compare with the product rounded to bf16.
                with np.errstate(over="ignore"):
                    np.testing.assert_array_equal(got, want.astype(BF16).astype(np.float64))
                if byte <= 252:
                    np.testing.assert_array_equal(got, want)
                np.testing.assert_array_equal(np.signbit(got), np.signbit(want_codes))  # -0 stays -0
        nan = self._dequantize(words, np.full(len(words), np.nan))  # byte 255
        self.assertTrue(np.isnan(nan).all())

    def test_one_multiply_is_the_exact_product_for_bytes_up_to_the_limit(self):
        """The swap_ab kernel's MXFP4 form: the placed codes (code·2^-126) times 2^126·scale in one packed multiply
        (`one_multiply_bf16x2` at E2M1_PLACEMENT) give code·scale exactly for every E8M0 byte up to
        E2M1_ONE_MULTIPLY_MAX_BYTE; the next byte's factor would need a bf16 exponent past 254 (the kernel votes
        for two multiplies there)."""
        words, nibbles = self._words()
        want_codes = _code_value(nibbles)
        limit = common.E2M1_ONE_MULTIPLY_MAX_BYTE
        self.assertEqual(limit, 128)
        for byte in range(limit + 1):
            factor = _halves(np.array([common.one_multiply_bf16x2(byte, common.E2M1_PLACEMENT)]))
            self.assertEqual(int(factor[0][0]), int(factor[1][0]))
            f = np.array([factor[0][0]], np.uint16).view(BF16).astype(np.float64)[0]
            self.assertEqual(f, 2.0 ** (byte - 1), byte)
            got = np.zeros((len(words), 8))
            for i in range(4):
                bits = common.e2m1_pair_bits(words, i)
                for half, code_index in ((0, i), (1, i + 4)):
                    got[:, code_index] = _bf16_mul(_halves(bits)[half], np.float64(f))
            np.testing.assert_array_equal(got, want_codes * 2.0 ** (byte - 127), err_msg=f"byte {byte}")
            np.testing.assert_array_equal(np.signbit(got), np.signbit(want_codes))
        self.assertGreater((limit + 1 + common.E2M1_PLACEMENT), 254)  # the next factor is no bf16 normal

    def test_every_code_times_every_positive_e4m3_scale(self):
        words, nibbles = self._words()
        want_codes = _code_value(nibbles)
        scales = np.arange(1, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        for s in scales:
            got = self._dequantize(words, np.full(len(words), s))
            np.testing.assert_array_equal(got, want_codes * s, err_msg=f"scale {s}")

    def test_the_pairing_is_a_permutation_inside_each_group_of_eight(self):
        """Output position 2i + h of a word holds code i + 4h: a bijection of the word's 8 codes, the same for
        A and B (both go through this converter), so the dot product is unchanged and no scale block is crossed."""
        perm = [i + 4 * h for i in range(4) for h in range(2)]
        self.assertEqual(sorted(perm), list(range(8)))
        for i in range(4):
            mag, sign = common.e2m1_pair_shifts(i)
            self.assertEqual((mag, sign), (6 - 4 * i, 12 - 4 * i))


class E4M3ScaleDecodeModelTest(absltest.TestCase):

    def test_all_bytes(self):
        """The steps of `common.e4m3_scale_bf16x2`: bits 0..6 to float32 bits 20..26, times 2^120, high half, sign."""
        byte = np.arange(256, dtype=np.int64)
        mag = byte & 0x7F
        value = (mag << 20).astype(np.uint32).view(np.float32) * np.float32(common.F32_TWO_POW_120)
        high = ((value.view(np.uint32).astype(np.int64) >> 16) & 0x7FFF) | ((byte & 0x80) << 8)
        pair = np.where(mag == 0x7F, common.E4M3_NAN_BF16X2, high | (high << 16))
        lo, hi = _halves(pair)
        np.testing.assert_array_equal(lo, hi)
        got = lo.astype(np.uint16).view(BF16).astype(np.float64)
        want = byte.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        finite = np.isfinite(want)
        np.testing.assert_array_equal(got[finite], want[finite])
        np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(want[finite]))
        self.assertTrue(np.isnan(got[~finite]).all())
        self.assertEqual(int((~finite).sum()), 2)


class E2M1RoundingModelTest(absltest.TestCase):

    def test_thresholds_match_the_quantizer(self):
        """The epilogue's code = #(|x| > strict) + #(|x| >= inclusive), sign from the float's sign bit."""
        grid = np.concatenate([E2M1_VALUES, (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2])
        near = np.concatenate([grid, np.nextafter(grid, np.inf), np.nextafter(grid, -np.inf)])
        rng = np.random.default_rng(1)
        x = np.concatenate([near, -near, rng.uniform(-8, 8, 5000), [7.0, 1e30, -1e30, np.inf, -np.inf, -0.0, 0.0,
                                                                     0.1, -0.1]]).astype(np.float32)
        a = np.abs(x)
        code = sum((a > t).astype(np.int64) for t in epilogue.E2M1_STRICT)
        code = code + sum((a >= t).astype(np.int64) for t in epilogue.E2M1_INCLUSIVE)
        nibble = code | ((x.view(np.uint32).astype(np.int64) >> 28) & 8)
        got = _code_value(nibble)
        want = np.asarray(formats.round_to_e2m1(x).astype(np.float32), np.float64)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


if __name__ == "__main__":
    absltest.main()
