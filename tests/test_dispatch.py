"""Which implementation a CUDA lowering picks: kernel, reference, or a clear error (no GPU needed)."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg
from jax_blockgemm import dispatch

import oracle


def _operands(m=256, n=128, k=128):
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32).astype(jnp.float8_e4m3fn)
    b = jnp.asarray(rng.standard_normal((n, k)), jnp.float32).astype(jnp.float8_e4m3fn)
    sfa = jnp.asarray(oracle.random_scale_bytes(rng, (m, k // 32)))
    sfb = jnp.asarray(oracle.random_scale_bytes(rng, (n, k // 32)))
    return a, b, sfa, sfb


def _cuda_text(**kwargs) -> str:
    f = jax.jit(lambda *x: jbg.gemm_amax(*x, **kwargs))
    return f.trace(*_operands()).lower(lowering_platforms=("cuda",)).as_text()


class DispatchTest(parameterized.TestCase):

    def test_cutedsl_emits_the_kernel_call(self):
        text = _cuda_text(implementation="cutedsl")
        self.assertIn("jbg_gemm_amax", text)
        self.assertIn('archs = "sm_100a,sm_90a"', text)  # both objects travel; the handler picks by CC

    def test_xla_never_does(self):
        self.assertNotIn("jbg_gemm_amax", _cuda_text(implementation="xla"))

    def test_default_follows_the_measured_preference(self):
        with mock.patch.dict(dispatch.DEFAULT_TAKES_KERNEL, {"sm_90a": False}):
            self.assertNotIn("jbg_gemm_amax", _cuda_text())
        with mock.patch.dict(dispatch.DEFAULT_TAKES_KERNEL, {"sm_90a": True}):
            self.assertIn("jbg_gemm_amax", _cuda_text())

    def test_gpu_without_kernel(self):
        """On an sm_80 machine, None falls back to the reference and 'cutedsl' says why it cannot run."""
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("8.0",)), \
                mock.patch.dict(dispatch.DEFAULT_TAKES_KERNEL, {"sm_90a": True}):
            self.assertNotIn("jbg_gemm_amax", _cuda_text())
            with self.assertRaisesRegex(ValueError,
                                        "no kernel for compute capability 8.0 .kernels exist for sm_100a, sm_90a"):
                _cuda_text(implementation="cutedsl")

    @parameterized.parameters(
        (dict(c_major="m"), "kernels take K-major A and B and N-major C"),
        (dict(c_dtype=jnp.float16), "no kernel in the catalog for float8_e4m3fn operands, float16 C"),
    )
    def test_cutedsl_without_kernel_raises(self, kwargs, reason):
        with self.assertRaisesRegex(ValueError, "implementation='cutedsl': no CuTeDSL kernel applies.*" + reason):
            _cuda_text(implementation="cutedsl", **kwargs)

    def test_fp4_kernels_are_compiled_but_never_selected(self):
        """The sm_100a FP4 variants exist in the catalog, but the handler takes FP8 codes only: no FP4 call gets one."""
        from jax_blockgemm.kernels import catalog

        self.assertTrue(any(v.ab_dtype == "float4_e2m1fn" for v in catalog.CATALOG))
        rng = np.random.default_rng(1)
        a, sfa = jbg.formats.quantize_mxfp4(jnp.asarray(rng.standard_normal((256, 128)), jnp.float32))
        b, sfb = jbg.formats.quantize_mxfp4(jnp.asarray(rng.standard_normal((128, 128)), jnp.float32))
        f = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl"))
        with self.assertRaisesRegex(ValueError, "no kernel in the catalog for uint8 operands"):
            f.trace(a, b, sfa, sfb).lower(lowering_platforms=("cuda",))

    def test_an_arch_whose_kernel_module_cannot_import_is_left_out(self):
        from jax_blockgemm.kernels import catalog

        def broken(v):
            raise ImportError("cutlass.utils has no PersistentTileSchedulerParams")

        with mock.patch.dict(catalog._FACTORIES, {("gemm_amax", "sm_100a"): broken}):
            self.assertIn('archs = "sm_90a"', _cuda_text(implementation="cutedsl"))
            with mock.patch.dict(catalog._FACTORIES, {("gemm_amax", "sm_90a"): broken}), \
                    self.assertRaisesRegex(ValueError, "no kernel can be built here: sm_100a: cutlass.utils has no"):
                _cuda_text(implementation="cutedsl")

    def test_native_bridge_missing(self):
        """Without the built extension, None takes the reference and 'cutedsl' says why."""
        from jax_blockgemm import _native

        with mock.patch.object(_native, "extension", side_effect=ImportError("bridge not built")):
            self.assertNotIn("jbg_gemm_amax", _cuda_text(implementation=None))
            with self.assertRaisesRegex(ValueError, "no kernel can run here: bridge not built"):
                _cuda_text(implementation="cutedsl")

    def test_sizes_the_kernel_cannot_take(self):
        """Operands past the kernel's 2**31-element limit go to the reference (None) or raise ('cutedsl')."""
        a = jax.ShapeDtypeStruct((65536, 32768), jnp.float8_e4m3fn)
        b = jax.ShapeDtypeStruct((128, 32768), jnp.float8_e4m3fn)
        sfa = jax.ShapeDtypeStruct((65536, 1024), jnp.uint8)
        sfb = jax.ShapeDtypeStruct((128, 1024), jnp.uint8)
        f = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl"))
        with self.assertRaisesRegex(ValueError, "the sm_(90|100)a kernel cannot take .*fewer than 2\\*\\*31 elements"):
            f.trace(a, b, sfa, sfb).lower(lowering_platforms=("cuda",))

    def test_proj_rope_cutedsl_raises(self):
        x = jnp.zeros((32, 64), jnp.bfloat16)
        w = jnp.zeros((192, 64), jnp.bfloat16)
        cs = jnp.zeros((32, 64), jnp.bfloat16)
        f = jax.jit(lambda *o: jbg.gemm_proj_rope_mxfp8(*o, implementation="cutedsl"))
        with self.assertRaisesRegex(ValueError, "gemm_proj_rope_mxfp8 has no CuTeDSL kernel yet"):
            f.trace(x, w, cs, cs).lower(lowering_platforms=("cuda",))


if __name__ == "__main__":
    absltest.main()
