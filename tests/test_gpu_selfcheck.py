"""GPU: the first-use self-check for real, on whatever GPU this is (skips without a CUDA GPU that has kernels).

On the H200 it checks the sm_90a kernels (they must pass) and the deliberately wrong test variant (it must fail,
and the gate must then fall back to the reference or raise). On a B200 the same file checks every sm_100a
variant, which is how a Blackwell user verifies the never-run kernels:

    JAX_BLOCKGEMM_CACHE_DIR=$(mktemp -d) python -m pytest tests/test_gpu_selfcheck.py tests/test_gpu_gemm_amax.py -q
"""

import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import jax_blockgemm as jbg
from jax_blockgemm import dispatch, precompile, selfcheck

import oracle_ops


def _local_arch():
    caps = dispatch.local_cuda_capabilities()
    archs = {dispatch.ARCH_OF_CAPABILITY.get(cc) for cc in caps or ()}
    return archs.pop() if len(archs) == 1 and None not in archs else None


_ARCH = _local_arch()
_FMT = "mxfp8_e4m3"


@absltest.skipUnless(_ARCH, "needs a CUDA GPU of one architecture that has kernels (sm_90a or sm_100a)")
class GpuSelfCheckTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        """One fresh object cache for the class, filled in parallel: compiling every local variant one by one, twice
        (in-process and in the CLI's subprocess), took longer than the test's time on the H200."""
        super().setUpClass()
        from jax_blockgemm.kernels import catalog

        cls.dir = tempfile.mkdtemp(prefix="jbg_selfcheck_test_")
        with mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": cls.dir}):
            failed = precompile.compile_in_processes([v.key for v in catalog.variants_for(_ARCH)],
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
        # Objects are shared across the class; verdicts are not (each test starts with none on disk).
        shutil.rmtree(os.path.join(self.dir, "selfcheck"), ignore_errors=True)
        self.enter_context(mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": self.dir}))
        self.enter_context(mock.patch.dict(selfcheck._MEMORY, clear=True))
        self.enter_context(mock.patch.object(selfcheck, "_WARNED", set()))

    def test_every_local_kernel_passes(self):
        for v in self.catalog.variants_for(_ARCH):  # gemm_amax and proj_rope (on an H200: known-good kernels)
            with self.subTest(v.key):
                verdict = selfcheck.check(v, force=True)
                self.assertTrue(verdict.ok, verdict.detail)
                self.assertEqual(verdict.device, jax.devices("cuda")[0].device_kind)

    def _broken(self):
        if _ARCH != "sm_90a":
            self.skipTest("the deliberately wrong test kernel is an sm_90a one")
        return self.catalog.TEST_VARIANTS[0]

    def test_broken_kernel_is_caught(self):
        verdict = selfcheck.check(self._broken(), force=True)
        self.assertFalse(verdict.ok)
        self.assertRegex(verdict.detail, r"^\(L, M, N, K\) = \(1, 200, 136, 96\): 1 of 27200 C elements off, "
                                         r"worst at \(0, 0, 0\)")

    def _gated(self, variant, implementation):
        """gemm_amax on this GPU with `variant` as the catalog's choice and the gate on for this arch."""
        rng = np.random.default_rng(3)
        x = oracle_ops.random_gemm_inputs(rng, l=1, m=256, n=128, k=256, fmt=_FMT)
        a, b, sfa, sfb = (jnp.asarray(x[name]) for name in ("a", "b", "sfa", "sfb"))
        select = lambda **kw: variant if kw["arch"] == _ARCH else None
        with mock.patch.object(selfcheck, "UNVERIFIED_ARCHS", frozenset({_ARCH})), \
                mock.patch.dict(dispatch.DEFAULT_TAKES_KERNEL, {("gemm_amax", _ARCH): True}), \
                mock.patch.object(self.catalog, "select_variant", side_effect=select):
            fn = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation=implementation))
            text = fn.lower(a, b, sfa, sfb).as_text()
            c, amax = fn(a, b, sfa, sfb)
        c_ref, amax_ref = oracle_ops.gemm_amax_oracle(np.asarray(a), np.asarray(b), np.asarray(sfa), np.asarray(sfb),
                                                      k=256, sf_vec_size=32)
        oracle_ops.assert_gemm_close(self, np.asarray(c), c_ref, c_dtype=jnp.float32)
        oracle_ops.assert_amax_close(self, np.asarray(amax), np.max(amax_ref))
        return text

    def test_gate_falls_back_from_the_broken_kernel_with_a_warning(self):
        broken = self._broken()
        with self.assertWarnsRegex(RuntimeWarning, f"kernel {broken.key} failed its first-use self-check"):
            text = self._gated(broken, None)
        self.assertNotIn("jbg_gemm_amax", text)
        with self.assertRaisesRegex(ValueError, "first-use self-check failed: " + broken.key):
            self._gated(broken, "cutedsl")

    def test_gate_uses_a_kernel_that_passed(self):
        v = self.catalog.variants_for(_ARCH, "gemm_amax")[0]
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            self.assertIn("jbg_gemm_amax", self._gated(v, None))
        self.assertTrue(selfcheck.verdict_path(*next(iter(selfcheck._MEMORY))).is_file())

    def test_cli_table(self):
        args = [sys.executable, "-m", "jax_blockgemm.selfcheck", "--arch", _ARCH, "--force"]
        if _ARCH == "sm_90a":
            args.append("--include-test-variants")
        out = subprocess.run(args, capture_output=True, text=True, env={**os.environ}, timeout=1800)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertRegex(out.stdout, r"kernel\s+device\s+verdict\s+source")
        self.assertEqual(out.stdout.count(" PASS "), len(self.catalog.variants_for(_ARCH)))
        if _ARCH == "sm_90a":
            self.assertIn("FAIL (must FAIL)", out.stdout)


if __name__ == "__main__":
    absltest.main()
