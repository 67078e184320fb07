"""GPU: the gemm_amax support surface beyond MXFP8 -> f32/bf16, kernel (implementation="cutedsl") vs float64 oracle.

sm_90a (H200): MXFP4 (E8M0 per 32) and NVFP4 (E4M3 per 16, alpha) operands into every C dtype SPEC allows them
(f32, bf16, f16, E4M3, E5M2, packed FP4), MXFP8 into f16; odd shapes (M, N and K tails, K = 32, M = 1, L > 1, a
K that ends 32 codes into a 128-wide k-tile), fresh random codes over each format's whole range, random
non-trivial scales, outputs poisoned by the handler before every launch (JAX_BLOCKGEMM_POISON_OUTPUTS=1, set
below: NaN in f32/bf16/f16/E4M3/E5M2 C; in packed FP4 C 0xFF reads as -6 in both nibbles, which the oracle
comparison still catches wherever the true code differs). NaN scales and overflow to inf checked separately.
sm_100a (B200, never run here): the FP4 -> f32/bf16 kernels that the handler now reaches, the MN-major MXFP8
kernels and c_major="m", same oracle.

Skipped without a CUDA device of the arch in question (CI has none); run on the H200 as BUILD.md describes.
"""

import os

os.environ["JAX_BLOCKGEMM_POISON_OUTPUTS"] = "1"

import math

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg
from jax_blockgemm import arch, dispatch

import oracle
import oracle_ops


def _local_archs() -> set:
    caps = dispatch.local_cuda_capabilities() or ()
    return {arch.target_of(cc) for cc in caps}


# (L, M, N, K): N a multiple of 32 (16-byte rows of packed FP4 C), K of 32 (16-byte rows of packed FP4 codes).
SHAPES = [(1, 128, 128, 128), (2, 200, 160, 96), (3, 257, 288, 1056), (1, 1, 32, 32), (1, 64, 32, 4096),
          (2, 33, 64, 160)]
FP4_C = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn")
# Mean square of a code, for scales that keep C inside a narrow C dtype's range (E2M1: uniform nibbles).
_CODE_MEAN_SQUARE = {"mxfp4": 68.5 / 8, "nvfp4": 68.5 / 8, "mxfp8_e4m3": 4.0**6 / (12 * math.log(4)),
                     "mxfp8_e5m2": 4.0**10 / (20 * math.log(4))}
# Typical |C| each C dtype is exercised at: around its saturation for FP8/FP4 (some elements saturate).
_TARGET = {"float16": 16.0, "float8_e4m3fn": 64.0, "float8_e5m2": 1024.0, "float4_e2m1fn": 2.0}


def _inputs(rng, fmt, c_dtype, l, m, n, k, a_major="k", b_major="k"):
    """Random operands; scales centred so that |C| is typically _TARGET[c_dtype] (f32/bf16: the default range)."""
    scale_log2 = None
    if c_dtype in _TARGET:
        typical = math.sqrt(k) * _CODE_MEAN_SQUARE[fmt]
        mid = 0.5 * math.log2(_TARGET[c_dtype] / typical)
        scale_log2 = (mid - 1.0, mid + 1.0) if fmt == "nvfp4" else (math.floor(mid) - 1, math.floor(mid) + 1)
    return oracle_ops.random_gemm_inputs(rng, l=l, m=m, n=n, k=k, fmt=fmt, scale_log2=scale_log2, a_major=a_major,
                                         b_major=b_major)


def _run(d, c_dtype, *, alpha=None, implementation="cutedsl", c_major="n", a_major="k", b_major="k"):
    kwargs = dict(c_dtype=jnp.dtype(c_dtype), sf_vec_size=d["sf_vec_size"], implementation=implementation,
                  c_major=c_major, a_major=a_major, b_major=b_major)
    if alpha is not None:
        kwargs["alpha"] = jnp.float32(alpha)
    fn = jax.jit(lambda *x: jbg.gemm_amax(*x, **kwargs))
    c, amax = fn(jnp.asarray(d["a"]), jnp.asarray(d["b"]), jnp.asarray(d["sfa_atom"]), jnp.asarray(d["sfb_atom"]))
    return np.asarray(c), np.asarray(amax)


def _check(test, d, c, amax, c_dtype, alpha=None, c_major="n", a_major="k", b_major="k"):
    c_ref, amax_ref = oracle_ops.gemm_amax_oracle(d["a"], d["b"], d["sfa"], d["sfb"], k=d["k"],
                                                  sf_vec_size=d["sf_vec_size"], alpha=alpha, a_major=a_major,
                                                  b_major=b_major)
    oracle_ops.assert_gemm_close(test, c, c_ref, c_dtype=jnp.dtype(c_dtype), c_major=c_major)
    oracle_ops.assert_amax_close(test, amax, np.max(amax_ref))


@absltest.skipUnless("sm_90a" in _local_archs(), "needs an sm_90a GPU (H100/H200)")
class Sm90SurfaceTest(parameterized.TestCase):

    @parameterized.product(shape=SHAPES, fmt=("mxfp4", "nvfp4"), c_dtype=FP4_C)
    def test_fp4_matches_oracle(self, shape, fmt, c_dtype):
        """Every C dtype from MXFP4 and NVFP4 (with a random alpha) against the float64 oracle, C poisoned."""
        rng = np.random.default_rng(hash((shape, fmt, c_dtype)) % 2**32)
        d = _inputs(rng, fmt, c_dtype, *shape)
        alpha = float(d["alpha"]) if fmt == "nvfp4" else None
        c, amax = _run(d, c_dtype, alpha=alpha)
        _check(self, d, c, amax, c_dtype, alpha=alpha)

    @parameterized.product(shape=SHAPES, fmt=("mxfp8_e4m3", "mxfp8_e5m2"))
    def test_mxfp8_f16_matches_oracle(self, shape, fmt):
        rng = np.random.default_rng(hash((shape, fmt, "f16")) % 2**32)
        d = _inputs(rng, fmt, "float16", *shape)
        c, amax = _run(d, "float16")
        _check(self, d, c, amax, "float16")

    @parameterized.product(shape=[(2, 208, 160, 96), (3, 272, 64, 1056), (1, 32, 32, 32), (1, 16, 128, 256)],
                           fmt=("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4"),
                           c_dtype=("float32", "bfloat16", "float16", "float8_e4m3fn"))
    def test_c_major_m_matches_oracle(self, shape, fmt, c_dtype):
        """c_major="m" (C^T returned, (L, N, M)): the kernels run on (B, A); M is a multiple of 16 (C^T's rows).
        FP8 C only with FP4 operands (SPEC)."""
        if c_dtype == "float8_e4m3fn" and fmt.startswith("mxfp8"):
            self.skipTest("FP8 C takes FP4 operands only")
        rng = np.random.default_rng(hash((shape, fmt, c_dtype, "m")) % 2**32)
        d = _inputs(rng, fmt, c_dtype, *shape)
        alpha = float(d["alpha"]) if fmt == "nvfp4" else None
        c, amax = _run(d, c_dtype, alpha=alpha, c_major="m")
        self.assertEqual(c.shape, (shape[0], shape[2], shape[1]))
        _check(self, d, c, amax, c_dtype, alpha=alpha, c_major="m")

    @parameterized.product(shape=[(2, 208, 160, 96), (3, 272, 64, 1056), (1, 16, 32, 32), (1, 128, 128, 4096)],
                           fmt=("mxfp8_e4m3", "mxfp8_e5m2"), majors=(("m", "k"), ("k", "n"), ("m", "n")),
                           c_major=("n", "m"), c_dtype=("float32", "bfloat16", "float16"))
    def test_mn_major_matches_oracle(self, shape, fmt, majors, c_major, c_dtype):
        """MN-major A ((L, K, M)) and/or B ((L, K, N)), either C major: the MN-major sm_90a variants (c_major="m"
        runs them on (B, A) with the majors swapped). M and N multiples of 16 (16-byte rows of MN-major codes)."""
        a_major, b_major = majors
        rng = np.random.default_rng(hash((shape, fmt, majors, c_major, c_dtype)) % 2**32)
        d = _inputs(rng, fmt, c_dtype, *shape, a_major=a_major, b_major=b_major)
        layout = dict(c_major=c_major, a_major=a_major, b_major=b_major)
        c, amax = _run(d, c_dtype, **layout)
        _check(self, d, c, amax, c_dtype, **layout)

    def test_mn_major_nan_scale(self):
        """A NaN scale byte of an M-major A poisons exactly its row of C (the row scale of one of 16 codes)."""
        d = _inputs(np.random.default_rng(7), "mxfp8_e4m3", "float32", 2, 256, 128, 128, a_major="m", b_major="n")
        d["sfa"][1, 21, 3] = 0xFF
        d["sfa_atom"] = oracle.compact_to_atom_np(d["sfa"])
        c, amax = _run(d, "float32", a_major="m", b_major="n")
        self.assertTrue(np.isnan(amax))
        _check(self, d, c, amax, "float32", a_major="m", b_major="n")
        self.assertTrue(np.isnan(c[1, 21]).all())
        self.assertFalse(np.isnan(c[1, 20]).any() or np.isnan(c[1, 22]).any())

    @parameterized.parameters("float32", "float4_e2m1fn")
    def test_nvfp4_without_alpha(self, c_dtype):
        """No alpha: the lowering passes ones to the alpha-taking kernel; C and amax are the plain product's."""
        d = _inputs(np.random.default_rng(3), "nvfp4", c_dtype, 2, 200, 160, 96)
        c, amax = _run(d, c_dtype)
        _check(self, d, c, amax, c_dtype)

    @parameterized.product(fmt=("mxfp4", "nvfp4"), c_dtype=("float32", "float8_e4m3fn", "float4_e2m1fn"))
    def test_nan_scale_poisons_its_rows_and_amax(self, fmt, c_dtype):
        d = _inputs(np.random.default_rng(4), fmt, c_dtype, 2, 256, 128, 128)
        nan = np.array(0x7F, np.uint8).view(d["sfa"].dtype) if fmt == "nvfp4" else np.uint8(0xFF)
        d["sfa"][1, 17, 2] = nan
        d["sfa_atom"] = oracle.compact_to_atom_np(d["sfa"])
        alpha = float(d["alpha"]) if fmt == "nvfp4" else None
        c, amax = _run(d, c_dtype, alpha=alpha)
        self.assertTrue(np.isnan(amax))
        _check(self, d, c, amax, c_dtype, alpha=alpha)  # NaN exactly in row 17 of batch 1 (FP4 C has no NaN)
        if c_dtype != "float4_e2m1fn":
            self.assertTrue(np.isnan(c[1, 17].astype(np.float32)).all())
            self.assertFalse(np.isnan(c[1, 16].astype(np.float32)).any())

    @parameterized.parameters("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn")
    def test_overflow_to_inf_matches_the_reference(self, c_dtype):
        """alpha large enough that alpha·acc overflows float32 for the biggest elements: amax is inf, C is inf there
        (f32/bf16/f16) or saturates (FP8/FP4), exactly as the XLA reference on the same GPU."""
        d = _inputs(np.random.default_rng(5), "nvfp4", "float32", 1, 128, 64, 64)
        c_ref, amax_ref = oracle_ops.gemm_amax_oracle(d["a"], d["b"], d["sfa"], d["sfb"], k=64, sf_vec_size=16)
        alpha = float(np.float32(3.0e38 / np.max(np.abs(c_ref)) * 4.0))
        c, amax = _run(d, c_dtype, alpha=alpha)
        c_xla, amax_xla = _run(d, c_dtype, alpha=alpha, implementation="xla")
        self.assertEqual(float(amax), np.inf)
        self.assertEqual(float(amax_xla), np.inf)
        got = c.astype(np.float32) if c.dtype != np.uint8 else c
        want = c_xla.astype(np.float32) if c_xla.dtype != np.uint8 else c_xla
        self.assertTrue(np.array_equal(np.isinf(got), np.isinf(want)))
        finite = np.isfinite(want)
        if c_dtype in ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"):
            np.testing.assert_array_equal(got, want)  # saturated codes: bit-for-bit the reference's
        else:
            np.testing.assert_allclose(got[finite], want[finite], rtol=2e-2)

    def test_the_kernel_is_what_runs(self):
        """'cutedsl' lowers FP4 and NVFP4 calls to the custom call with the sm_90a object."""
        d = _inputs(np.random.default_rng(6), "nvfp4", "float4_e2m1fn", 1, 128, 128, 128)
        fn = jax.jit(lambda *x: jbg.gemm_amax(*x, c_dtype=jnp.float4_e2m1fn, sf_vec_size=16, alpha=jnp.float32(2.0),
                                              implementation="cutedsl"))
        text = fn.lower(d["a"], d["b"], d["sfa_atom"], d["sfb_atom"]).as_text()
        self.assertIn("jbg_gemm_amax", text)
        self.assertIn("jbg_gemm_amax_sm_90a_e2m1_e2m1_sf16e4m3", text)


@absltest.skipUnless("sm_100a" in _local_archs(), "needs an sm_100a GPU (B200)")
class Sm100Fp4Test(parameterized.TestCase):
    """The sm_100a FP4 kernels (compiled and checked here, never run), now reachable: after the first-use self-check,
    against the float64 oracle. f32/bf16 C only (the catalog's sm_100a FP4 variants)."""

    @parameterized.product(shape=[(1, 128, 128, 256), (2, 200, 160, 96), (3, 257, 288, 1056)],
                           fmt=("mxfp4", "nvfp4"), c_dtype=("float32", "bfloat16"))
    def test_fp4_matches_oracle(self, shape, fmt, c_dtype):
        rng = np.random.default_rng(hash((shape, fmt, c_dtype, 100)) % 2**32)
        d = _inputs(rng, fmt, c_dtype, *shape)
        alpha = float(d["alpha"]) if fmt == "nvfp4" else None
        c, amax = _run(d, c_dtype, alpha=alpha)
        _check(self, d, c, amax, c_dtype, alpha=alpha)

    @parameterized.product(shape=[(2, 208, 160, 96), (1, 128, 256, 1024)], fmt=("mxfp8_e4m3", "mxfp8_e5m2"),
                           majors=(("m", "k"), ("k", "n"), ("m", "n")), c_major=("n", "m"),
                           c_dtype=("float32", "bfloat16"))
    def test_mn_major_matches_oracle(self, shape, fmt, majors, c_major, c_dtype):
        """The sm_100a MN-major MXFP8 kernels (tile 128x128, cluster 1x1), either C major."""
        a_major, b_major = majors
        rng = np.random.default_rng(hash((shape, fmt, majors, c_major, c_dtype, 100)) % 2**32)
        d = _inputs(rng, fmt, c_dtype, *shape, a_major=a_major, b_major=b_major)
        layout = dict(c_major=c_major, a_major=a_major, b_major=b_major)
        c, amax = _run(d, c_dtype, **layout)
        _check(self, d, c, amax, c_dtype, **layout)

    @parameterized.product(fmt=("mxfp8_e4m3", "mxfp4", "nvfp4"), c_dtype=("float32", "bfloat16"))
    def test_c_major_m_matches_oracle(self, fmt, c_dtype):
        d = _inputs(np.random.default_rng(hash((fmt, c_dtype, 101)) % 2**32), fmt, c_dtype, 2, 208, 160, 96)
        alpha = float(d["alpha"]) if fmt == "nvfp4" else None
        c, amax = _run(d, c_dtype, alpha=alpha, c_major="m")
        _check(self, d, c, amax, c_dtype, alpha=alpha, c_major="m")


if __name__ == "__main__":
    absltest.main()
