"""Deliberately broken sm_90a kernels, to show that the first-use gate catches a bad kernel whatever it does.

Importing this module registers them with the catalog (`catalog.register_extra_variant`); the gate's child process
imports it too when $JAX_BLOCKGEMM_EXTRA_VARIANTS_MODULE names it (tests set that, with tests/ on PYTHONPATH).
Never selected by dispatch; only forced runs and the self-check build them.
"""

from __future__ import annotations

from typing import Callable

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from jax_blockgemm.kernels import catalog
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


class SpinningHopperGemmAmax(HopperMxf8GemmAmax):
    """The Hopper kernel, then a one-thread launch that waits forever on an mbarrier nobody arrives at (a hang)."""

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, c: cute.Tensor,
                 amax: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, l: cutlass.Int32,
                 stream: cuda.CUstream):
        """Run the real kernel, then hang on the same stream."""
        HopperMxf8GemmAmax.__call__(self, a, b, sfa, sfb, c, amax, m, n, k, l, stream)
        self.spin(c).launch(grid=(1, 1, 1), block=(32, 1, 1), smem=64, stream=stream)

    @cute.kernel
    def spin(self, c: cute.Tensor):
        """Initialize an mbarrier for one arrival, never arrive, wait for its first phase."""
        storage = cutlass.memory.SmemAllocator()
        bar = storage.allocate_array(cutlass.Int64, 1)
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            cute.arch.mbarrier_init(bar, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        cute.arch.mbarrier_wait(bar, 0)
        c[0] = c[0]  # unreachable: keeps the kernel's argument live


class IllegalAddressHopperGemmAmax(HopperMxf8GemmAmax):
    """The Hopper kernel, then a one-thread launch that stores far past the end of C (an illegal address)."""

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, c: cute.Tensor,
                 amax: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, l: cutlass.Int32,
                 stream: cuda.CUstream):
        """Run the real kernel, then fault on the same stream."""
        HopperMxf8GemmAmax.__call__(self, a, b, sfa, sfb, c, amax, m, n, k, l, stream)
        self.fault(c).launch(grid=(1, 1, 1), block=(1, 1, 1), stream=stream)

    @cute.kernel
    def fault(self, c: cute.Tensor):
        """Store to C's address plus 2**46 bytes, far outside any allocation."""
        far = cute.make_ptr(c.element_type, c.iterator.toint() + cutlass.Int64(1 << 46), cute.AddressSpace.gmem,
                            assumed_align=16)
        out = cute.make_tensor(far, cute.make_layout(1))
        out[0] = c[0]


def _factory(cls: type) -> Callable[[catalog.KernelVariant], HopperMxf8GemmAmax]:
    return lambda v: cls(ab_dtype=v.ab_dtype, c_dtype=v.c_dtype)


NEGATED_CORNER = catalog.KernelVariant(arch="sm_90a", flavor="broken_negc0")
SPINNING = catalog.KernelVariant(arch="sm_90a", flavor="broken_spin")
ILLEGAL_ADDRESS = catalog.KernelVariant(arch="sm_90a", flavor="broken_illegal_address")
BROKEN = (NEGATED_CORNER, SPINNING, ILLEGAL_ADDRESS)
for _variant, _cls in zip(BROKEN, (NegatedCornerHopperGemmAmax, SpinningHopperGemmAmax,
                                   IllegalAddressHopperGemmAmax)):
    catalog.register_extra_variant(_variant, _factory(_cls))
