"""The architecture-neutral epilogue pieces (kernels/epilogue.py), each against formats.py / NumPy on a GPU.

A small probe kernel applies every piece to arrays: E8M0 scale bytes and factors from amax bit patterns (zero,
subnormal, normal, around every power-of-two boundary, inf, NaN), E4M3 conversion with RNE and saturation (two and four
codes per word), RoPE of a pair, the NaN-propagating |max| and the byte mask. On CPU (CI) the probe is compiled for
sm_90a, which proves it builds; on a Hopper or Blackwell GPU it runs (torch tensors through DLPack) and every output is
compared exactly.
"""

import os
import tempfile

import ml_dtypes
import numpy as np
from absl.testing import absltest

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    from jax_blockgemm.kernels import common, epilogue
except ImportError as e:  # pragma: no cover - CuTeDSL is a hard dependency of this test file
    raise absltest.SkipTest(f"CuTeDSL not importable: {e}")

from jax_blockgemm import formats

N = 4096  # elements per input array; one CTA of 128 threads, 32 elements each


@cute.kernel
def _probe_kernel(amax_bits: cute.Tensor, byte_out: cute.Tensor, inv_out: cute.Tensor, lo: cute.Tensor,
                  hi: cute.Tensor, codes_out: cute.Tensor, rope_in: cute.Tensor, rope_out: cute.Tensor,
                  lanes_in: cute.Tensor, extra_out: cute.Tensor):
    tid, _, _ = cute.arch.thread_idx()
    for r in cutlass.range_constexpr(N // 128):
        i = tid + 128 * r
        byte, inv, _ = epilogue.e8m0_scale(amax_bits[i])
        byte_out[i] = byte
        inv_out[i] = inv
        codes_out[i] = epilogue.fp8x2(lo[i] * inv, hi[i] * inv, "e4m3")
        first, second = epilogue.rope_pair(rope_in[6 * i], rope_in[6 * i + 1], rope_in[6 * i + 2],
                                           rope_in[6 * i + 3], rope_in[6 * i + 4], rope_in[6 * i + 5])
        rope_out[2 * i] = first
        rope_out[2 * i + 1] = second
        extra_out[3 * i] = common.bits_from_f32(epilogue.nan_abs_max(-common.f32_from_bits(amax_bits[i]), lo[i]))
        extra_out[3 * i + 1] = epilogue.byte_mask(lanes_in[i])
        extra_out[3 * i + 2] = epilogue.e4m3x4(lo[i] * inv, hi[i] * inv, -lo[i] * inv, -hi[i] * inv)


@cute.jit
def _probe(amax_bits, byte_out, inv_out, lo, hi, codes_out, rope_in, rope_out, lanes_in, extra_out,
           stream: cuda.CUstream):
    _probe_kernel(amax_bits, byte_out, inv_out, lo, hi, codes_out, rope_in, rope_out, lanes_in,
                  extra_out).launch(grid=(1, 1, 1), block=(128, 1, 1), stream=stream)


_DTYPES = (cutlass.Int32, cutlass.Int32, cutlass.Float32, cutlass.Float32, cutlass.Float32, cutlass.Int32,
           cutlass.Float32, cutlass.Float32, cutlass.Int32, cutlass.Int32)


def _compile(arch: str | None):
    """The probe compiled for `arch` (None: the local GPU)."""
    from cutlass.cutlass_dsl import CuTeDSL

    fakes = [make_fake_compact_tensor(dt, (cute.sym_int64(),), assumed_align=16) for dt in _DTYPES]
    envar = CuTeDSL._get_dsl().envar
    saved = envar._arch
    if arch:
        envar.arch = arch
    try:  # the DSL writes the PTX it keeps to --dump-dir (default: the working directory)
        with tempfile.TemporaryDirectory(prefix="jbg-probe-") as dump_dir:
            return cute.compile(_probe, *fakes, cuda.CUstream(0),
                                options=f"--keep-ptx --dump-dir {dump_dir}" if arch else "")
    finally:
        envar._arch = saved


def _amax_patterns(rng: np.random.Generator) -> np.ndarray:
    """|x| bit patterns: zero, subnormals, the E4M3 boundaries 448 * 2^k and their neighbours, random normals, the
    largest finite, inf and NaN."""
    boundary = np.float32(448.0) * np.exp2(np.arange(-130, 120, dtype=np.float32)).astype(np.float32)
    bits = boundary[np.isfinite(boundary) & (boundary > 0)].view(np.int32)
    special = np.array([0, 1, 0x7FFFF, 0x800000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7F800001], np.int32)
    rand = (np.abs(rng.standard_normal(N)) * np.exp2(rng.integers(-60, 60, N))).astype(np.float32).view(np.int32)
    out = np.concatenate([special, bits - 1, bits, bits + 1, rand])[:N]
    return out & 0x7FFFFFFF


def _has_hopper_or_blackwell() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)


class EpilogueCompileTest(absltest.TestCase):

    def test_compiles_for_sm90a_with_the_fp8_converter(self):
        ptx = _compile("sm_90a").__ptx__
        self.assertIn("cvt.rn.satfinite.e4m3x2.f32", ptx)


@absltest.skipUnless(_has_hopper_or_blackwell(), "needs torch and a Hopper or Blackwell GPU")
class GpuEpilogueTest(absltest.TestCase):

    def test_each_piece_matches_formats(self):
        import torch

        rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
        amax_bits = _amax_patterns(rng)
        amax = amax_bits.view(np.float32)
        lo = (rng.standard_normal(N) * 300).astype(np.float32)
        hi = (rng.standard_normal(N) * 300).astype(np.float32)
        rope_in = rng.standard_normal(6 * N).astype(np.float32)
        lanes_in = rng.integers(0, 2**31 - 1, N, dtype=np.int32)
        host = [amax_bits, np.zeros(N, np.int32), np.zeros(N, np.float32), lo, hi, np.zeros(N, np.int32), rope_in,
                np.zeros(2 * N, np.float32), lanes_in, np.zeros(3 * N, np.int32)]
        dev = [torch.from_numpy(a.copy()).cuda() for a in host]
        from cutlass.cute.runtime import from_dlpack

        fn = _compile(None)
        fn(*(from_dlpack(t, assumed_align=16) for t in dev), cuda.CUstream(torch.cuda.current_stream().cuda_stream))
        torch.cuda.synchronize()
        byte, inv, codes, rope_out, extra = (dev[i].cpu().numpy() for i in (1, 2, 5, 7, 9))

        # E8M0: the byte formats.py gives (the SPEC §2 rule), 0xFF for inf/NaN; the factor is exactly 2^-e.
        e = np.asarray(formats.scale_exponent(amax, 448.0))
        np.testing.assert_array_equal(byte, np.where(e == 128, 255, e + 127))
        finite = e <= 127
        np.testing.assert_array_equal(inv[finite], np.exp2(-e[finite].astype(np.float64)).astype(np.float32))

        # E4M3 codes of v * 2^-e: round-to-nearest-even with saturation at 448 (ml_dtypes rounds the same way).
        def e4m3_bytes(v):
            return np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.int32)

        scale = np.where(finite, inv, 0.0).astype(np.float32)
        want = e4m3_bytes(lo * scale) | (e4m3_bytes(hi * scale) << 8)
        np.testing.assert_array_equal(codes[finite], want[finite])

        # RoPE of a pair (SPEC §5) in fp32: within one fp32 rounding of the float64 formula (FMA contraction).
        p = rope_in.reshape(N, 6).astype(np.float64)
        ref = np.stack([p[:, 0] * p[:, 2] - p[:, 1] * p[:, 3], p[:, 1] * p[:, 4] + p[:, 0] * p[:, 5]], axis=1)
        np.testing.assert_allclose(rope_out.reshape(N, 2), ref, rtol=0, atol=4 * np.finfo(np.float32).eps
                                   * np.abs(p).max() ** 2)

        # max(|a|, |b|) propagates NaN (a block amax must see it) and is exact otherwise.
        got = extra.reshape(N, 3)[:, 0].view(np.float32)
        nan = np.isnan(amax)
        self.assertTrue(nan.any() and np.isnan(got[nan]).all())
        np.testing.assert_array_equal(got[~nan], np.maximum(np.abs(amax[~nan]), np.abs(lo[~nan])))
        # byte k of the mask is 0xFF where bit k of the input is set (bits 0..3 only).
        bits4 = (lanes_in[:, None] >> np.arange(4)) & 1
        want_mask = (bits4 * (0xFF << (8 * np.arange(4)))).sum(axis=1).astype(np.int64)
        np.testing.assert_array_equal(extra.reshape(N, 3)[:, 1].view(np.uint32), want_mask.astype(np.uint32))
        # four codes per word, the first lowest
        four = [lo * scale, hi * scale, -lo * scale, -hi * scale]
        want4 = sum(e4m3_bytes(v).astype(np.int64) << (8 * k) for k, v in enumerate(four))
        np.testing.assert_array_equal(extra.reshape(N, 3)[finite, 2].view(np.uint32), want4[finite].astype(np.uint32))


if __name__ == "__main__":
    absltest.main()
