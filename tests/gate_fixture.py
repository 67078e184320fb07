"""The fresh kernel cache the GPU gate tests share (tests/test_gpu_selfcheck*.py): every local variant precompiled
once per test class into its own directory, verdicts cleared before each test, the deliberately broken kernels
registered for the gate's child process, the gate's timeout shortened."""

import os
import pathlib
import shutil
import tempfile
from unittest import mock

from absl.testing import absltest

from jax_blockgemm import arch, dispatch, gate, precompile, selfcheck


def _local_arch():
    caps = dispatch.local_cuda_capabilities()
    targets = {arch.target_of(cc) for cc in caps or ()}
    return targets.pop() if len(targets) == 1 and None not in targets else None


ARCH = _local_arch()  # the one kernel target of this machine's GPUs, or None
TESTS = str(pathlib.Path(__file__).resolve().parent)
TIMEOUT_S = 60.0  # the gate's limit in these tests (120 s by default)


def in_process(variant, device):
    """The gate's check run in this process (for kernels that must pass: no child needed)."""
    why = selfcheck.run_check(variant, device)
    return not why, why


class FreshGateCache(absltest.TestCase):
    """One fresh object cache per test class, filled in parallel (compiling every local variant one by one took
    longer than a test's time on the H200); no verdicts on disk or in memory when each test starts."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        from jax_blockgemm.kernels import catalog

        cls.dir = tempfile.mkdtemp(prefix="jbg_selfcheck_test_")
        with mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": cls.dir}):
            failed = precompile.compile_in_processes([v.key for v in catalog.variants_for(ARCH)],
                                                     min(8, os.cpu_count() or 1))
        if failed:
            raise RuntimeError("precompiling the local variants failed:\n" + "\n".join(failed))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)
        super().tearDownClass()

    def setUp(self):
        from jax_blockgemm.kernels import catalog

        self.catalog = catalog
        shutil.rmtree(os.path.join(self.dir, "selfcheck"), ignore_errors=True)
        path = os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])
        self.enter_context(mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": self.dir, "PYTHONPATH": path,
                                                        gate.EXTRA_VARIANTS_ENV: "broken_kernels",
                                                        gate.TIMEOUT_ENV: str(TIMEOUT_S)}))
        self.enter_context(mock.patch.dict(gate._MEMORY, clear=True))
        self.enter_context(mock.patch.object(gate, "_WARNED", set()))
