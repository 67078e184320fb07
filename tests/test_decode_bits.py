"""CPU: the decode kernel's E4M3 dequantizer (kernels/weight_stream.py) as bit arithmetic, against float64.

The kernel places each E4M3 code as bf16 bits worth code·2^-120 (`e4m3_pair_bits`) and multiplies by 2^120·scale
in one packed bf16 multiply (`one_multiply_bf16x2`) when the E8M0 byte allows, else by 2^120 and then by the scale
(`e8m0_bf16x2`). Here the same functions run on NumPy int32 words holding every code in every byte position, and
each route's bf16 result must equal the exact code·scale rounded once to bf16, for every scale byte the route
takes; a word holds a NaN code exactly where `e4m3_nan_any` flags it.
"""

import ml_dtypes
import numpy as np
from absl.testing import absltest

from jax_blockgemm.kernels import common

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn


def _bf16(bits: np.ndarray) -> np.ndarray:
    """The bf16 values of 16-bit patterns, as float64."""
    return (np.asarray(bits, np.int64) & 0xFFFF).astype(np.uint16).view(BF16).astype(np.float64)


def _mul(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """A packed bf16 multiply on one half (fma with -0): the exact product rounded to bf16 (float64 holds it)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return (x * y).astype(BF16).astype(np.float64)


def _prmt(word: np.ndarray, selector: int) -> np.ndarray:
    """prmt.b32 of `word` with itself, as the PTX ISA defines it: result byte i is the byte the selector's nibble i
    names (its low 2 bits here), or, where the nibble's bit 3 is set, that byte's top bit copied to all 8 bits."""
    w = np.asarray(word, np.int64) & 0xFFFFFFFF
    out = np.zeros_like(w)
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = (w >> (8 * (nibble & 3))) & 0xFF
        if nibble & 8:
            byte = np.where(byte & 0x80, 0xFF, 0)
        out |= byte << (8 * i)
    return out.astype(np.uint32).view(np.int32)


def _halves(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w = np.asarray(words, np.int64) & 0xFFFFFFFF
    return w & 0xFFFF, w >> 16


class E4M3DequantizerTest(absltest.TestCase):

    def setUp(self):
        super().setUp()
        codes = np.arange(256, dtype=np.uint8)
        # word j holds code j in byte 0, j+1 in byte 1, ...: every code in every byte position
        self.bytes = np.stack([np.roll(codes, -p) for p in range(4)], axis=1)  # (256, 4)
        self.words = self.bytes.copy().view(np.int32).reshape(-1)  # little-endian: byte p at bits 8p..8p+7
        self.values = self.bytes.view(E4M3).astype(np.float64)  # (256, 4), NaN for 0x7F and 0xFF

    def _placed(self) -> np.ndarray:
        """(256, 4) bf16 values of the placed codes, in byte order (pairs: bytes 0, 1 and 2, 3)."""
        out = np.empty((len(self.words), 4))
        for high in (False, True):
            bits = common.e4m3_pair_bits(self.words, high, _prmt)
            self.assertEqual(bits.dtype, np.int32)
            lo, hi = _halves(bits)
            out[:, 2 if high else 0], out[:, 3 if high else 1] = _bf16(lo), _bf16(hi)
        return out

    def test_placement_is_code_times_two_to_the_minus_120(self):
        finite = ~np.isnan(self.values)
        np.testing.assert_array_equal(self._placed()[finite], self.values[finite] * 2.0**-120)

    def test_nan_any_flags_exactly_the_words_with_a_nan_code(self):
        """Every code in every byte position beside random bytes, and random words one or three at a time (with
        several NaN bytes, 0xFF carries and 0x7E/0xFE neighbours): flagged exactly where a byte is 0x7F or 0xFF."""
        rng = np.random.default_rng(7)
        special = np.array([0x7F, 0xFF, 0x7E, 0xFE, 0x00, 0x80], np.uint8)
        for trial in range(4):
            words = self.bytes.copy()
            others = rng.integers(0, 256, size=words.shape, dtype=np.uint8)
            if trial % 2:
                others = rng.choice(special, size=words.shape)
            for p in range(4):  # byte p keeps every code, the other bytes random
                mixed = others.copy()
                mixed[:, p] = words[:, p]
                nan = np.isnan(mixed.view(E4M3).astype(np.float64)).any(axis=1)
                flags = [common.e4m3_nan_any([w]) for w in mixed.view(np.int32).reshape(-1)]
                np.testing.assert_array_equal(np.array(flags) != 0, nan, err_msg=f"byte {p}, trial {trial}")
        for n in (1, 3):
            words = rng.choice(np.concatenate([special, rng.integers(0, 256, 10, dtype=np.uint8)]),
                               size=(20000, n, 4)).astype(np.uint8)
            nan = np.isnan(words.view(E4M3).astype(np.float64)).any(axis=(1, 2))
            packed = words.view(np.int32).reshape(-1, n)
            flags = np.asarray(common.e4m3_nan_any([packed[:, i] for i in range(n)]))
            np.testing.assert_array_equal(flags != 0, nan, err_msg=f"{n} words")

    def test_one_multiply_is_the_exact_product_rounded_once(self):
        """Every byte up to the limit: placed bits times 2^120·scale equals code·2^(b-127) rounded to bf16 once
        (subnormal results included); past the limit the multiplier is no bf16 normal, so two multiplies."""
        placed, finite = self._placed(), ~np.isnan(self.values)
        limit = common.ONE_MULTIPLY_MAX_BYTE
        self.assertEqual(limit, 134)
        for b in range(0, 255):
            exact = (self.values[finite] * 2.0 ** (b - 127)).astype(BF16).astype(np.float64)
            two = _mul(_mul(placed[finite], 2.0**120), _bf16(common.e8m0_bf16x2(b)))
            np.testing.assert_array_equal(two, exact, err_msg=f"two multiplies, byte {b}")
            multiplier = common.one_multiply_bf16x2(b)
            if b <= limit:
                self.assertEqual(multiplier & 0xFFFF, multiplier >> 16)  # the same value in both halves
                self.assertEqual(_bf16(multiplier), 2.0 ** (b - 7))
                np.testing.assert_array_equal(_mul(placed[finite], _bf16(multiplier)), exact,
                                              err_msg=f"one multiply, byte {b}")
            else:
                self.assertFalse(np.isfinite(_bf16(multiplier)) and _bf16(multiplier) == 2.0 ** (b - 7), b)


if __name__ == "__main__":
    absltest.main()
