"""GPU: every kernel of this GPU's architecture passes its first-use self-check (skips without a CUDA GPU that has
kernels). Its own file, apart from tests/test_gpu_selfcheck.py, so that pytest-xdist can run the two side by side.
On a B200 this is how a user verifies the never-run sm_100a kernels:

    JAX_BLOCKGEMM_CACHE_DIR=$(mktemp -d) python -m pytest tests/test_gpu_selfcheck_catalog.py -q
"""

import jax
from absl.testing import absltest

from jax_blockgemm import gate

import gate_fixture


@absltest.skipUnless(gate_fixture.ARCH, "needs a CUDA GPU of one architecture that has kernels (sm_90a or sm_100a)")
class GpuSelfCheckCatalogTest(gate_fixture.FreshGateCache):

    def test_every_local_kernel_passes(self):
        for v in self.catalog.variants_for(gate_fixture.ARCH):  # every operation of the catalog
            with self.subTest(v.key):
                verdict = gate.check(v, force=True, run=gate_fixture.in_process)
                self.assertTrue(verdict.ok, verdict.detail)
                self.assertEqual(verdict.device, jax.devices("cuda")[0].device_kind)


if __name__ == "__main__":
    absltest.main()
