"""GPU: the first-use gate for real, on whatever GPU this is (skips without a CUDA GPU that has kernels).

On the H200 it checks three deliberately broken sm_90a kernels (tests/broken_kernels.py: a wrong element, a hang on an
mbarrier, an illegal address), each through the real gate's child process: each must end as a stored FAIL within the
timeout, and this process must then still run the reference correctly; the gate then uses a kernel that passed, falls
back from one that failed, and `python -m jax_blockgemm.selfcheck` prints its table. That every local kernel passes
is tests/test_gpu_selfcheck_catalog.py; on a B200 a user verifies the never-run kernels with it (see its docstring).
"""

import os
import subprocess
import sys
import time
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import jax_blockgemm as jbg
from jax_blockgemm import arch, dispatch, gate

import broken_kernels
import gate_fixture
import oracle_ops

_ARCH = gate_fixture.ARCH
_FMT = "mxfp8_e4m3"
_TIMEOUT_S = gate_fixture.TIMEOUT_S


@absltest.skipUnless(_ARCH, "needs a CUDA GPU of one architecture that has kernels (sm_90a or sm_100a)")
class GpuSelfCheckTest(gate_fixture.FreshGateCache):

    def _broken(self, variant):
        if _ARCH != "sm_90a":
            self.skipTest("the deliberately broken kernels are sm_90a ones")
        return variant

    def _reference_still_runs(self):
        """This process is usable after a broken kernel's check: the reference on this GPU matches the oracle."""
        rng = np.random.default_rng(5)
        x = oracle_ops.random_gemm_inputs(rng, l=1, m=256, n=128, k=256, fmt=_FMT)
        c, amax = jax.jit(lambda *o: jbg.gemm_amax(*o, implementation="xla"))(
            *(jnp.asarray(x[name]) for name in ("a", "b", "sfa", "sfb")))
        c_ref, amax_ref = oracle_ops.gemm_amax_oracle(x["a"], x["b"], x["sfa"], x["sfb"], k=256, sf_vec_size=32)
        oracle_ops.assert_gemm_close(self, np.asarray(c), c_ref, c_dtype=jnp.float32)
        oracle_ops.assert_amax_close(self, np.asarray(amax), np.max(amax_ref))

    def _check_broken(self, variant, detail_pattern):
        start = time.monotonic()
        verdict = gate.check(self._broken(variant), force=True)
        took = time.monotonic() - start
        print(f"\n{variant.key}: FAIL after {took:.1f} s: {verdict.detail}", file=sys.stderr)
        self.assertFalse(verdict.ok)
        self.assertRegex(verdict.detail, detail_pattern)
        self.assertLess(took, _TIMEOUT_S + 30)
        self.assertFalse(gate.verdict_path(*gate.identity(variant, gate.local_device(_ARCH))).with_suffix(
            ".attempt").exists())
        self._reference_still_runs()

    def test_a_wrong_result_is_caught(self):
        self._check_broken(broken_kernels.NEGATED_CORNER,
                           r"^\(L, M, N, K\) = \(1, 200, 136, 96\): 1 of 27200 C elements off, worst at \(0, 0, 0\)")

    def test_a_hang_is_killed_at_the_timeout(self):
        self._check_broken(broken_kernels.SPINNING, r"timed out after 60 s")

    def test_an_illegal_address_fails_in_the_child(self):
        self._check_broken(broken_kernels.ILLEGAL_ADDRESS, r"(?i)illegal|CUDA|without a result|raised")

    def _gated(self, variant, implementation):
        """gemm_amax on this GPU with `variant` as the catalog's choice and this arch treated as never run."""
        rng = np.random.default_rng(3)
        x = oracle_ops.random_gemm_inputs(rng, l=1, m=256, n=128, k=256, fmt=_FMT)
        a, b, sfa, sfb = (jnp.asarray(x[name]) for name in ("a", "b", "sfa", "sfb"))
        select = lambda **kw: variant if kw["arch"] == _ARCH else None
        capability = dispatch.local_cuda_capabilities()[0]
        with arch.overridden(capability, verified=False, default={"gemm_amax": "kernel", "proj_rope": "kernel"}), \
                mock.patch.object(self.catalog, "select_variant", side_effect=select):
            fn = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation=implementation))
            text = fn.lower(a, b, sfa, sfb).as_text()
            c, amax = fn(a, b, sfa, sfb)
        c_ref, amax_ref = oracle_ops.gemm_amax_oracle(np.asarray(a), np.asarray(b), np.asarray(sfa), np.asarray(sfb),
                                                      k=256, sf_vec_size=32)
        oracle_ops.assert_gemm_close(self, np.asarray(c), c_ref, c_dtype=jnp.float32)
        oracle_ops.assert_amax_close(self, np.asarray(amax), np.max(amax_ref))
        return text

    def test_gate_falls_back_from_a_broken_kernel_with_a_warning_and_cutedsl_raises(self):
        broken = self._broken(broken_kernels.NEGATED_CORNER)
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
        self.assertTrue(gate.verdict_path(*next(iter(gate._MEMORY))).is_file())

    def test_cli_table(self):
        """The CLI in its own process (beside this one, which holds most of the GPU's memory): one row per kernel,
        each checked in a child process of its own."""
        chosen = [self.catalog.variants_for(_ARCH, op)[0] for op in ("gemm_amax", "proj_rope", "dequantize")]
        args = [sys.executable, "-m", "jax_blockgemm.selfcheck", "--arch", _ARCH, "--force"]
        for v in chosen + ([broken_kernels.NEGATED_CORNER] if _ARCH == "sm_90a" else []):
            args += ["--variant", v.key]
        out = subprocess.run(args, capture_output=True, text=True, env={**os.environ}, timeout=1800)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertRegex(out.stdout, r"kernel\s+device\s+verdict\s+source")
        self.assertEqual(out.stdout.count(" PASS "), len(chosen))
        if _ARCH == "sm_90a":
            self.assertIn("FAIL (must FAIL)", out.stdout)


if __name__ == "__main__":
    absltest.main()
