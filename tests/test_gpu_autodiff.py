"""GPU: mx_dot_general and mla_q_projection on a CUDA device, against the same float64 oracles as on CPU.

The CPU suites' cases rerun here with the GPU as the default device (gemm_amax then takes whatever implementation
`implementation=None` picks there). Skipped without a CUDA device (CI has none). On the H200:
`python -m pytest tests/test_gpu_autodiff.py -q`.
"""

import jax
from absl.testing import absltest

import test_autodiff
import test_mla


def _has_cuda() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@absltest.skipUnless(_has_cuda(), "needs a CUDA GPU")
class GpuStraightThroughTest(test_autodiff.StraightThroughTest):
    """Values, gradients and amaxes of mx_dot_general (all recipes and cases) on the GPU."""


@absltest.skipUnless(_has_cuda(), "needs a CUDA GPU")
class GpuDropInTest(test_autodiff.DropInTest):
    """bf16 operands, the bf16 fallback, vmap and single tracing on the GPU."""


@absltest.skipUnless(_has_cuda(), "needs a CUDA GPU")
class GpuMLAQProjectionTest(test_mla.MLAQProjectionTest):
    """The fused forward and the straight-through gradients of mla_q_projection on the GPU."""


if __name__ == "__main__":
    absltest.main()
