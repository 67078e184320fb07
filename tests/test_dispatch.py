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
        self.assertIn('archs = "sm_90a"', text)

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
            with self.assertRaisesRegex(ValueError, "no kernel for compute capability 8.0 .kernels exist for sm_90a"):
                _cuda_text(implementation="cutedsl")

    @parameterized.parameters(
        (dict(c_major="m"), "kernels take K-major A and B and N-major C"),
        (dict(c_dtype=jnp.float16), "no kernel in the catalog for float8_e4m3fn operands, float16 C"),
    )
    def test_cutedsl_without_kernel_raises(self, kwargs, reason):
        with self.assertRaisesRegex(ValueError, "implementation='cutedsl': no CuTeDSL kernel applies.*" + reason):
            _cuda_text(implementation="cutedsl", **kwargs)

    def test_native_bridge_missing(self):
        """Without the built extension, None takes the reference and 'cutedsl' says why."""
        from jax_blockgemm import _native

        with mock.patch.object(_native, "extension", side_effect=ImportError("bridge not built")):
            self.assertNotIn("jbg_gemm_amax", _cuda_text(implementation=None))
            with self.assertRaisesRegex(ValueError, "no kernel can run here: bridge not built"):
                _cuda_text(implementation="cutedsl")

    def test_proj_rope_cutedsl_raises(self):
        x = jnp.zeros((32, 64), jnp.bfloat16)
        w = jnp.zeros((192, 64), jnp.bfloat16)
        cs = jnp.zeros((32, 64), jnp.bfloat16)
        f = jax.jit(lambda *o: jbg.gemm_proj_rope_mxfp8(*o, implementation="cutedsl"))
        with self.assertRaisesRegex(ValueError, "gemm_proj_rope_mxfp8 has no CuTeDSL kernel yet"):
            f.trace(x, w, cs, cs).lower(lowering_platforms=("cuda",))


def _abstract(l, m, n, k, *, ab=jnp.float8_e4m3fn):
    """Abstract batched MXFP8 operands with compact scales: shapes only, no memory."""
    sd = jax.ShapeDtypeStruct
    return sd((l, m, k), ab), sd((l, n, k), ab), sd((l, m, k // 32), jnp.uint8), sd((l, n, k // 32), jnp.uint8)


def _lower_for_cuda(operands, **kwargs):
    f = jax.jit(lambda *x: jbg.gemm_amax(*x, **kwargs))
    return f.trace(*operands).lower(lowering_platforms=("cuda",)).as_text()


class Int32LimitTest(parameterized.TestCase):
    """More than 2**31 elements in an operand or in C never reaches the kernel or the handler: None takes the
    reference and 'cutedsl' raises when the program is lowered. Abstract shapes only (jax.eval_shape, .lower())."""

    def setUp(self):
        super().setUp()
        # The kernel would be the default here, so that None taking the reference shows the size decided it;
        # the object bytes are a stand-in (nothing is compiled or run).
        self.enterContext(mock.patch.dict(dispatch.DEFAULT_TAKES_KERNEL, {"sm_90a": True}))
        from jax_blockgemm import kernel_cache
        self.enterContext(mock.patch.object(kernel_cache, "get_object", return_value=b"\x7fELF stand-in"))

    @parameterized.named_parameters(
        ("a_exactly_2_31", (1, 65536, 128, 32768), "a", "2147483648 elements"),
        ("b_past_2_31", (1, 128, 65540, 32768), "b", "2147614720 elements"),
        ("c_2_32", (1, 65536, 65536, 32), "c", "4294967296 elements"),
        ("c_batched", (2, 32768, 32768, 32), "c", "2147483648 elements"),
        ("a_batched_l3", (3, 32768, 64, 32768), "a", "3221225472 elements"),
    )
    def test_refused_or_reference(self, shape, name, count):
        l, m, n, k = shape
        operands = _abstract(l, m, n, k)
        c, amax = jax.eval_shape(lambda *x: jbg.gemm_amax(*x), *operands)  # the call itself is fine
        self.assertEqual((c.shape, amax.shape), ((l, m, n), ()))
        with self.assertRaisesRegex(ValueError, rf"implementation='cutedsl': .*{name} \(.*\) holds {count}, past "
                                                r"the kernels' 32-bit indexing"):
            _lower_for_cuda(operands, implementation="cutedsl")
        self.assertNotIn("jbg_gemm_amax", _lower_for_cuda(operands))  # None: the reference

    def test_just_under_the_limit_takes_the_kernel(self):
        operands = _abstract(1, 65535, 64, 32768)  # a: 2**31 - 32768 elements
        self.assertIn("jbg_gemm_amax", _lower_for_cuda(operands, implementation="cutedsl"))
        self.assertIn("jbg_gemm_amax", _lower_for_cuda(operands))

    def test_vmap_folding_past_the_limit(self):
        """vmap folds its axis into L, so the folded call is what is measured: 2 x 2**30 elements of C."""
        sd = jax.ShapeDtypeStruct
        operands = (sd((2, 32768, 32), jnp.float8_e4m3fn), sd((2, 32768, 32), jnp.float8_e4m3fn),
                    sd((2, 32768, 1), jnp.uint8), sd((2, 32768, 1), jnp.uint8))
        f = jax.jit(jax.vmap(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl")))
        with self.assertRaisesRegex(ValueError, r"c \(2, 32768, 32768\) holds 2147483648 elements"):
            f.trace(*operands).lower(lowering_platforms=("cuda",))
        c, amax = jax.eval_shape(jax.vmap(lambda *x: jbg.gemm_amax(*x)), *operands)
        self.assertEqual((c.shape, amax.shape), ((2, 32768, 32768), (2,)))

if __name__ == "__main__":
    absltest.main()
