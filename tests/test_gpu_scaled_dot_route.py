"""GPU: the route `implementation=None` takes on Blackwell, XLA's block-scaled dot (`jax.lax.scaled_dot`), forced
onto this GPU through its policy row. On the H200 XLA runs it as dequantization + dot; on a B200 as cuDNN's
block-scaled GEMM. Either way the result must be in SPEC §7's "tensor-core FP8" class (1e-4) of the float64 oracle.
Skipped without a CUDA device (CI has none); the CPU twin is tests/test_reference_formulation.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg
from jax_blockgemm import arch, dispatch, reference

import oracle_ops


def _capability() -> str | None:
    caps = dispatch.local_cuda_capabilities()
    return caps[0] if caps and arch.target_of(caps[0]) else None


@absltest.skipUnless(_capability() and reference.has_scaled_dot(),
                     "needs a CUDA GPU with a policy row and a jax with jax.lax.scaled_dot")
class GpuScaledDotRouteTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        # None takes the reference for both operations, from the smallest size on through scaled_dot, no decode kernel
        self.enter_context(arch.overridden(_capability(), scaled_dot_min_size=0, decode_max_m={},
                                           default={"gemm_amax": "reference", "proj_rope": "reference"}))

    @parameterized.parameters(((1, 200, 136, 544), "float32"), ((3, 96, 72, 1024), "bfloat16"))
    def test_gemm_amax(self, shape, c_dtype):
        l, m, n, k = shape
        inp = oracle_ops.random_gemm_inputs(np.random.default_rng(m + n), l=l, m=m, n=n, k=k, fmt="mxfp8_e4m3")
        args = [jnp.asarray(inp[x]) for x in ("a", "b", "sfa", "sfb")]
        fn = jax.jit(lambda *x: jbg.gemm_amax(*x, c_dtype=jnp.dtype(c_dtype)))
        self.assertIn("xla.scaled_dot", fn.lower(*args).as_text())
        c, amax = fn(*args)
        c_ref, amax_ref = oracle_ops.gemm_amax_oracle(inp["a"], inp["b"], inp["sfa"], inp["sfb"], k=k,
                                                      sf_vec_size=32)
        oracle_ops.assert_gemm_close(self, np.asarray(c), c_ref, c_dtype=c_dtype, rtol=oracle_ops.GEMM_RTOL_TC_FP8)
        oracle_ops.assert_amax_close(self, np.asarray(amax), amax_ref, rtol=oracle_ops.GEMM_RTOL_TC_FP8)

    def test_proj_rope_mxfp8(self):
        inp = oracle_ops.random_proj_rope_inputs(np.random.default_rng(5), t=256, h=2, k=160, mxfp8=True)
        args = [jnp.asarray(inp[x]) for x in ("x", "w", "cos", "sin")]
        scales = dict(x_scale=jnp.asarray(inp["x_scale"]), w_scale=jnp.asarray(inp["w_scale"]))
        fn = jax.jit(lambda *a, **kw: jbg.gemm_proj_rope_mxfp8(*a, **kw))
        self.assertIn("xla.scaled_dot", fn.lower(*args, **scales).as_text())
        outs = [np.asarray(o) for o in fn(*args, **scales)]
        y_ref = oracle_ops.proj_rope_oracle(inp["x"], inp["w"], inp["cos"], inp["sin"], x_scale=inp["x_scale"],
                                            w_scale=inp["w_scale"])
        oracle_ops.assert_proj_rope_close(self, outs, y_ref)


if __name__ == "__main__":
    absltest.main()
