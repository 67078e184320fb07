"""TEST ONLY: deliberately wrong kernels, to prove that the first-use self-check (selfcheck.py) catches a bad one.

Never in the catalog (`catalog.TEST_VARIANTS` holds them); only a caller that forces a variant can run one.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from jax_blockgemm.kernels.sm90.gemm_amax import HopperMxf8GemmAmax


class NegatedCornerHopperGemmAmax(HopperMxf8GemmAmax):
    """The Hopper kernel, then C[0, 0, 0] negated by a second one-thread launch: amax stays right, C does not."""

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, c: cute.Tensor,
                 amax: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, l: cutlass.Int32,
                 stream: cuda.CUstream):
        """Run the real kernel, then perturb one element of C on the same stream."""
        HopperMxf8GemmAmax.__call__(self, a, b, sfa, sfb, c, amax, m, n, k, l, stream)
        self.negate_corner(c).launch(grid=(1, 1, 1), block=(1, 1, 1), stream=stream)

    @cute.kernel
    def negate_corner(self, c: cute.Tensor):
        """c[0] = -c[0] (one thread)."""
        c[0] = -c[0]
