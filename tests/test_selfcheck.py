"""CPU: the first-use self-check's decisions (compare, verdict store, the gate at lowering), GPU parts faked.

The "kernel" here is the float64 oracle (right) or the oracle with one element negated / NaN (wrong), run on the
CPU; the reference it is compared with is the real XLA reference. The gate's child process is replaced by the same
check run in-process, except in GateChildProcessTest, which runs real child processes (that hang, crash or answer).
The real thing, on a GPU, is tests/test_gpu_selfcheck.py and tests/test_gpu_selfcheck_catalog.py.
"""

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg
from jax_blockgemm import arch, dispatch, gate, selfcheck
from jax_blockgemm.kernels import catalog

import broken_kernels
import compiled_kernels
import oracle
import oracle_ops

_SM100 = catalog.select_variant(arch="sm_100a", ab_dtype="float8_e4m3fn", c_dtype="float32", sf_vec_size=32,
                                tile_mn=(128, 128), cluster_mn=(1, 1))

_RUN_PROBLEMS = selfcheck.run_problems  # the real one, for fakes that stand in for it under mock.patch


def _none_takes_kernels(capability: str):
    """A policy row in which implementation=None takes our kernels for both operations."""
    return arch.overridden(capability, default={"gemm_amax": "kernel", "proj_rope": "kernel"})


def _in_process(variant, device):
    """The gate's child, run in this process: (ok, detail) of the real check (with its GPU parts patched)."""
    why = selfcheck.run_check(variant, device)
    return not why, why


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    device_kind: str = "NVIDIA B200"


def _oracle_kernel(perturb=None):
    """A stand-in for a kernel run: the float64 oracle of the self-check's operands, optionally perturbed."""

    def run(variant, args, device):
        a, b, sfa, sfb, *alpha = (np.asarray(x) for x in args)
        k = a.shape[-1] * (2 if a.dtype == np.uint8 else 1)
        c, amax = oracle_ops.gemm_amax_oracle(a, b, sfa, sfb, k=k, sf_vec_size=variant.sf_vec_size,
                                              alpha=alpha[0] if alpha else None)
        c = c.astype(np.float32)
        if perturb is not None:
            perturb(c)
        return c, np.float32(np.max(amax))

    return run


def _cpu_reference(args, device):
    return selfcheck._run_reference(args, jax.devices("cpu")[0])


class CompareTest(parameterized.TestCase):

    def setUp(self):
        rng = np.random.default_rng()
        self.ref = rng.standard_normal((2, 37, 19)).astype(np.float32) * 10
        self.ref[0, 3, 4] = 1e6  # one huge element, as random scales make: a norm check alone would miss a lot
        self.abs = np.abs(self.ref) * 3 + 1  # Σ|products| ≥ |Σ products|
        self.amax = np.float32(np.abs(self.ref).max())

    def _compare(self, c, amax=None, c_dtype="float32"):
        return selfcheck.compare(c, self.amax if amax is None else amax, self.ref, self.amax, self.abs, c_dtype)

    def test_exact_and_tiny_noise_pass(self):
        self.assertEqual(self._compare(self.ref), "")
        noisy = self.ref * (1 + 1e-6 * np.random.default_rng().standard_normal(self.ref.shape))
        self.assertEqual(self._compare(noisy), "")

    @parameterized.named_parameters(
        ("one_element_negated", lambda c: c.__setitem__((1, 0, 0), -c[1, 0, 0] - 1), r"1 of 1406 C elements off"),
        ("bf16_accumulation_class_error", lambda c: c.__imul__(1 + 1e-3), "C elements off"),
        ("nan", lambda c: c.__setitem__((1, 5, 3), np.nan), "non-finite"))
    def test_wrong_c_fails(self, perturb, match):
        c = self.ref.copy()
        perturb(c)
        self.assertRegex(self._compare(c), match)

    def test_norm_check_catches_a_spread_error_within_the_elementwise_bound(self):
        c = self.ref + 0.9 * selfcheck.C_REL_TOLERANCE * self.abs * np.sign(self.ref)
        self.assertRegex(self._compare(c), "C relative error")

    def test_wrong_or_nan_amax_fails(self):
        self.assertRegex(self._compare(self.ref, amax=self.amax * (1 + 1e-3)), "amax")
        self.assertRegex(self._compare(self.ref, amax=np.float32(np.nan)), "non-finite")

    def test_bf16_within_half_ulp_passes_one_ulp_off_fails(self):
        c16 = np.array(jnp.asarray(self.ref).astype(jnp.bfloat16).astype(jnp.float32))
        self.assertEqual(self._compare(c16, c_dtype="bfloat16"), "")
        c16[0, 3, 4] = self.ref[0, 3, 4] * (1 + 2.0**-7)  # a whole bf16 ulp away: 2^-7 ≫ 1e-4 · 3
        self.assertRegex(self._compare(c16, c_dtype="bfloat16"), r"1 of 1406 C elements off, worst at \(0, 3, 4\)")

    @parameterized.parameters("float8_e4m3fn", "float8_e5m2", "float16")
    def test_narrow_c_rounded_and_saturated_passes_one_code_off_fails(self, c_dtype):
        small = self.ref / 8  # most values normal in E4M3, a few past its 448 (saturated) and near zero
        if c_dtype == "float16":  # not saturating: the operands keep C below 65504
            small[0, 3, 4] = 6e4
        rounded = np.array(jnp.asarray(small).astype(c_dtype).astype(jnp.float32)) if c_dtype == "float16" else \
            np.array(jnp.asarray(np.clip(small, -448 if c_dtype == "float8_e4m3fn" else -57344,
                                         448 if c_dtype == "float8_e4m3fn" else 57344)).astype(c_dtype)
                     .astype(jnp.float32))
        compare = lambda c: selfcheck.compare(c, self.amax, small, self.amax, self.abs / 8, c_dtype)
        self.assertEqual(compare(rounded), "")
        i = np.unravel_index(np.argmax(np.abs(rounded) * (np.abs(rounded) < 100)), rounded.shape)
        step = {"float8_e4m3fn": 2.0**-3, "float8_e5m2": 2.0**-2, "float16": 2.0**-10}[c_dtype]
        rounded[i] *= 1 + 2 * step  # two code steps away
        self.assertRegex(compare(rounded), r"1 of 1406 C elements off")

    def test_fp4_c_within_a_code_passes_a_wrong_code_fails(self):
        ref = np.array([[[0.7, 2.4, -5.1, 9.0, 0.2, -1.3]]], np.float32)  # 9.0 saturates to 6
        c = np.array([[[0.5, 2.0, -5.0 + -1.0, 6.0, 0.0, -1.5]]], np.float32)  # E2M1 codes, round to nearest
        abs_ = np.abs(ref) * 0 + 1e-3
        compare = lambda c: selfcheck.compare(c, np.float32(9.0), ref, np.float32(9.0), abs_, "float4_e2m1fn")
        self.assertEqual(compare(c), "")
        c[0, 0, 1] = 3.0  # 2.4 -> 3 is one code past the nearest (2)
        self.assertRegex(compare(c), r"1 of 6 C elements off")

    def test_problems_fit_every_variant_layout(self):
        for v in catalog.CATALOG:
            if v.op != "gemm_amax":
                continue
            for l, m, n, k in selfcheck.problems(v):
                self.assertEqual(k % 32, 0, v.key)
                if v.c_dtype in ("float8_e4m3fn", "float8_e5m2"):
                    self.assertEqual(n % 16, 0, v.key)
                if v.c_dtype == "float4_e2m1fn":
                    self.assertEqual(n % 32, 0, v.key)
                if v.a_major == "m":
                    self.assertEqual(m % 16, 0, v.key)
                if v.b_major == "n":
                    self.assertEqual(n % 16, 0, v.key)
            self.assertTrue(any(m % 128 and n % 128 and k % 128 for _, m, n, k in selfcheck.problems(v)), v.key)

    def test_every_problem_passes_the_public_api_checks(self):
        """The self-check calls gemm_amax like a user (`selfcheck.api_call`): each problem of each variant it runs
        through gemm_amax must get past the API's trace-time checks (C's row alignment for the variant's C dtype among
        them), or the kernel would be failed without ever running."""
        seen = set()
        for v in catalog.CATALOG:
            if v.op not in ("gemm_amax", "weight_stream"):
                continue
            majors = (getattr(v, "a_major", "k"), getattr(v, "b_major", "k"))
            for i, problem in enumerate(selfcheck.problems(v)):
                key = (v.ab_dtype, v.sf_dtype, v.sf_vec_size, v.c_dtype, majors, problem)
                if key in seen:
                    continue
                seen.add(key)
                call, args = selfcheck.api_call(v, selfcheck._operands(v, problem, seed=i), implementation="xla")
                with self.subTest(variant=v.key, problem=problem):
                    c, _ = jax.eval_shape(call, *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args))
                    self.assertEqual(c.shape[:2], problem[:2])
        self.assertGreater(len(seen), 20)

    def test_shape_mismatch_fails(self):
        self.assertRegex(self._compare(self.ref[:1]), "shapes")


class RunProblemsTest(absltest.TestCase):
    """run_problems on the CPU: the operands are real, the 'kernel' is the oracle, the reference is XLA's."""

    def test_right_kernel_passes_every_problem(self):
        self.assertEqual(selfcheck.run_problems(_SM100, None, run_kernel=_oracle_kernel(),
                                                run_reference=_cpu_reference), "")

    def test_nvidia_kernel_is_a_second_oracle_where_it_applies(self):
        seen = []

        def nvidia(shift):
            def run(variant, args, device):
                seen.append(args[0].shape[0])
                c, amax = _oracle_kernel()(variant, args, device)
                return c + shift * np.abs(c).max(), amax
            return run

        self.assertEqual(selfcheck.run_problems(_SM100, None, run_kernel=_oracle_kernel(),
                                                run_reference=_cpu_reference, run_second_oracle=nvidia(0.0)), "")
        self.assertEqual(len(seen), len(selfcheck.problems(_SM100)))  # never on the capped-grid problems
        why = selfcheck.run_problems(_SM100, None, run_kernel=_oracle_kernel(), run_reference=_cpu_reference,
                                     run_second_oracle=nvidia(0.01))
        self.assertRegex(why, r"^\(L, M, N, K\) = \(1, 200, 136, 96\): against NVIDIA's gemm_amax_jax_sm100: .*off")

    def test_no_second_oracle_off_its_surface(self):
        args = selfcheck._operands(_SM100, (2, 64, 64, 64), seed=0)
        self.assertIsNone(selfcheck._run_nvidia(_SM100, args, None))  # L = 2: NVIDIA's takes L = 1 only
        hopper = dataclasses.replace(_SM100, arch="sm_90a")
        self.assertIsNone(selfcheck._run_nvidia(hopper, selfcheck._operands(hopper, (1, 64, 64, 64), 0), None))

    def test_one_wrong_element_is_caught(self):
        why = selfcheck.run_problems(_SM100, None, run_reference=_cpu_reference, run_kernel=_oracle_kernel(
            lambda c: c.__setitem__((0, 0, 0), -c[0, 0, 0])))
        self.assertRegex(why, r"^\(L, M, N, K\) = \(1, 200, 136, 96\): 1 of 27200 C elements off, worst at \(0, 0, 0\)")

    def test_unwritten_tail_is_caught(self):
        def poisoned_tail(c):
            c[..., -1, :] = np.nan  # what the handler's poison leaves where a kernel skips the last row

        why = selfcheck.run_problems(_SM100, None, run_reference=_cpu_reference,
                                     run_kernel=_oracle_kernel(poisoned_tail))
        self.assertIn("non-finite", why)

    def test_a_kernel_that_raises_fails_the_check(self):
        def boom(variant, args, device):
            raise RuntimeError("CUDA_ERROR_ILLEGAL_INSTRUCTION")

        why = selfcheck.run_problems(_SM100, None, run_kernel=boom, run_reference=_cpu_reference)
        self.assertIn("raised RuntimeError: CUDA_ERROR_ILLEGAL_INSTRUCTION", why)

    def test_problems_cover_tails_and_batches(self):
        self.assertTrue(any(m % 128 and n % 128 and k % 128 for _, m, n, k in selfcheck.PROBLEMS))
        self.assertTrue(any(l > 1 for l, *_ in selfcheck.PROBLEMS))
        self.assertTrue(all(k % 32 == 0 for *_, k in selfcheck.PROBLEMS))


_SM100_GEMM = catalog.variants_for("sm_100a", "gemm_amax")
_NVFP4 = next(v for v in _SM100_GEMM if v.sf_dtype == "float8_e4m3fn")


def _tiles_per_cta(problem, tile_mn, cluster_mn) -> int:
    """How many tiles each CTA of a grid of one cluster walks: one per cluster-shaped block of tiles and batch."""
    l, m, n, _ = problem
    return l * -(-m // (tile_mn[0] * cluster_mn[0])) * -(-n // (tile_mn[1] * cluster_mn[1]))


class _GridCoverageChecks(parameterized.TestCase):
    """What the sm_100a self-check problems reach, from each compiled kernel's own tiles and stage counts."""

    def assert_gemm_amax_coverage(self, v):
        kernel = compiled_kernels.compiled(v).kernel
        (tile_m, tile_n, tile_k), stages = kernel.mma_tiler, kernel.ab_stages
        cluster_ctas = v.cluster_mn[0] * v.cluster_mn[1]
        grid = selfcheck.grid_problems(v)
        self.assertNotEmpty(grid)
        for problem, ctas in grid:
            l, m, n, k = problem
            self.assertEqual(ctas, cluster_ctas)  # one cluster walks every tile
            self.assertGreaterEqual(_tiles_per_cta(problem, (tile_m, tile_n), v.cluster_mn), 3)
            self.assertGreaterEqual(l, 3)
            self.assertGreaterEqual(k // tile_k, 2 * stages)  # every tile's k-loop wraps the ring twice
            self.assertTrue(m % tile_m and n % tile_n and k % tile_k, problem)  # tails in M, N and K
            # every CTA of the cluster holds rows and columns in bounds: the multicast paths carry real data
            self.assertEqual(-(-m // tile_m) % v.cluster_mn[0], 0)
            self.assertEqual(-(-n // tile_n) % v.cluster_mn[1], 0)
            self.assertTrue(kernel.can_implement(m, n, k, l)[0], problem)

    def assert_proj_rope_coverage(self, v):
        kernel = compiled_kernels.compiled(v).kernel
        (tile_t, head, tile_k), stages = kernel.mma_tiler, kernel.ab_stages
        self.assertNotEmpty(selfcheck.PROJ_ROPE_GRID_PROBLEMS)
        for (t, h, k), ctas in selfcheck.PROJ_ROPE_GRID_PROBLEMS:
            self.assertGreaterEqual(-(-t // tile_t) * h, 2 * ctas)  # each CTA walks two tiles or more
            self.assertTrue(t % tile_t and k % tile_k)
            self.assertGreaterEqual(k // tile_k, 2 * stages)
            self.assertTrue(kernel.can_implement(t, k, h)[0])


class GridCoverageTest(_GridCoverageChecks):
    """The representative sm_100a variants (compiled once per test process)."""

    @parameterized.named_parameters(compiled_kernels.named(compiled_kernels.representatives(_SM100_GEMM)))
    def test_gemm_amax(self, v):
        self.assert_gemm_amax_coverage(v)

    @parameterized.named_parameters(compiled_kernels.named(compiled_kernels.representatives(
        catalog.variants_for("sm_100a", "proj_rope"))))
    def test_proj_rope(self, v):
        self.assert_proj_rope_coverage(v)

    def test_every_sm100_gemm_amax_variant_gets_a_grid_problem_and_no_sm90_one_does(self):
        shapes = {v.cluster_mn for v in _SM100_GEMM if selfcheck.grid_problems(v)}
        self.assertEqual(shapes, {cl for v in _SM100_GEMM for cl in [v.cluster_mn]})
        self.assertTrue(all(selfcheck.grid_problems(v) for v in _SM100_GEMM))
        self.assertFalse(any(selfcheck.grid_problems(v) for v in catalog.variants_for("sm_90a", "gemm_amax")))

    def test_capped_problems_run_with_the_grid_capped_and_nvfp4_with_its_alpha(self):
        """run_problems launches each grid problem under the handler's cap (one cluster) and the others uncapped,
        and hands NVFP4 kernels and the reference the same alpha, not 1."""
        seen = []

        def kernel(variant, args, device):
            seen.append(("kernel", os.environ.get(selfcheck.GRID_ENV), len(args), float(args[-1]) if len(args) > 4
                         else None))
            return _oracle_kernel()(variant, args, device)

        def reference(args, device):
            seen.append(("reference", None, len(args), float(args[-1]) if len(args) > 4 else None))
            return _cpu_reference(args, device)

        v = dataclasses.replace(_NVFP4, cluster_mn=(2, 1))
        self.enter_context(mock.patch.dict(os.environ))  # restored afterwards, whatever happens here
        os.environ.pop(selfcheck.GRID_ENV, None)
        self.assertEqual(selfcheck.run_problems(v, None, run_kernel=kernel, run_reference=reference), "")
        runs = [x for x in seen if x[0] == "kernel"]
        self.assertEqual([x[1] for x in runs], [None] * len(selfcheck.problems(v)) + ["2"])
        self.assertNotIn(selfcheck.GRID_ENV, os.environ)  # restored after the capped run
        self.assertTrue(all(x[2] == 5 and x[3] == selfcheck.NVFP4_ALPHA != 1 for x in seen), seen)
        # the alpha reaches the reference: its C is alpha times the unscaled one
        args = selfcheck._operands(v, (1, 64, 32, 64), seed=0)
        self.assertLen(args, 5)
        scaled, _ = _cpu_reference(args, None)
        plain, _ = _cpu_reference(args[:4], None)
        np.testing.assert_allclose(scaled, plain * selfcheck.NVFP4_ALPHA, rtol=1e-6)

    def test_a_kernel_ignoring_alpha_fails(self):
        def no_alpha(variant, args, device):
            return _oracle_kernel()(variant, args[:4], device)

        why = selfcheck.run_problems(_NVFP4, None, run_kernel=no_alpha, run_reference=_cpu_reference)
        self.assertRegex(why, r"^\(L, M, N, K\) = \(1, 200, 136, 96\): \d+ of 27200 C elements off")

    def test_proj_rope_capped_problem_runs_on_one_cta(self):
        seen = []

        def kernel(variant, args, device):
            seen.append((args[0].shape, os.environ.get(selfcheck.GRID_ENV)))
            return _proj_rope_stand_in()(variant, args, device)

        self.assertEqual(selfcheck.run_proj_rope_problems(_ROPE100, None, run_kernel=kernel,
                                                          run_reference=_cpu_proj_rope_reference), "")
        (t, h, k), ctas = selfcheck.PROJ_ROPE_GRID_PROBLEMS[0]
        self.assertEqual(seen[-1], ((t, k), str(ctas)))
        self.assertTrue(all(cap is None for _, cap in seen[:-1]))


@pytest.mark.catalog
class CatalogGridCoverageTest(_GridCoverageChecks):
    """Every sm_100a gemm_amax and proj_rope variant."""

    @parameterized.named_parameters(compiled_kernels.named(_SM100_GEMM))
    def test_gemm_amax(self, v):
        self.assert_gemm_amax_coverage(v)

    @parameterized.named_parameters(compiled_kernels.named(catalog.variants_for("sm_100a", "proj_rope")))
    def test_proj_rope(self, v):
        self.assert_proj_rope_coverage(v)


class VerdictCacheTest(absltest.TestCase):

    def setUp(self):
        self.dir = self.enter_context(tempfile.TemporaryDirectory())
        self.enter_context(mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": self.dir}))
        self.enter_context(mock.patch.dict(gate._MEMORY, clear=True))
        self.enter_context(mock.patch.object(gate, "_WARNED", set()))
        self.object = b"object-1"
        self.enter_context(mock.patch("jax_blockgemm.kernel_cache.get_object", side_effect=lambda v: self.object))
        self.calls = []

    def _run(self, why):
        def run(variant, device):
            self.calls.append((variant.key, device.device_kind))
            return not why, why
        return run

    def test_pass_is_cached_in_memory_then_on_disk(self):
        v = gate.check(_SM100, device=FakeDevice(), run=self._run(""))
        self.assertTrue(v.ok)
        self.assertEqual((v.source, v.detail), ("ran", "ok"))
        self.assertEqual(gate.check(_SM100, device=FakeDevice(), run=self._run("x")).source, "memory")
        gate._MEMORY.clear()  # a new process
        again = gate.check(_SM100, device=FakeDevice(), run=self._run("x"))
        self.assertEqual((again.ok, again.source), (True, "disk"))
        self.assertLen(self.calls, 1)
        self.assertTrue(gate.verdict_path(v.key, v.device, v.object_sha).is_file())

    def test_new_object_new_device_or_force_runs_again(self):
        gate.check(_SM100, device=FakeDevice(), run=self._run(""))
        self.object = b"object-2"  # the kernel source or the DSL changed
        gate.check(_SM100, device=FakeDevice(), run=self._run(""))
        gate.check(_SM100, device=FakeDevice("NVIDIA GB200"), run=self._run(""))
        gate.check(_SM100, device=FakeDevice("NVIDIA GB200"), run=self._run(""), force=True)
        self.assertLen(self.calls, 4)

    def test_failure_warns_once_naming_the_kernel_and_is_remembered(self):
        with self.assertWarnsRegex(RuntimeWarning, r"kernel gemm_amax\.sm_100a\.e4m3\.f32\.sf32\.t128x128\.c1x1 "
                                                   r"failed its first-use self-check on NVIDIA B200 \(C relative"):
            v = gate.ensure_verified(_SM100, device=FakeDevice(), run=self._run("C relative error 0.5"))
        self.assertFalse(v.ok)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            self.assertFalse(gate.ensure_verified(_SM100, device=FakeDevice(), run=self._run("")).ok)
        self.assertLen(self.calls, 1)

    def test_unreadable_verdict_file_means_run_again(self):
        v = gate.check(_SM100, device=FakeDevice(), run=self._run(""))
        gate.verdict_path(v.key, v.device, v.object_sha).write_text("{not json")
        gate._MEMORY.clear()
        self.assertEqual(gate.check(_SM100, device=FakeDevice(), run=self._run("")).source, "ran")

    def test_an_unfinished_earlier_attempt_is_a_failure_not_a_silent_retry(self):
        """A process killed while checking (hang, crash) leaves its attempted record: the next one fails it."""
        ident = gate.identity(_SM100, FakeDevice())
        path = gate.verdict_path(*ident)
        path.parent.mkdir(parents=True)
        path.with_suffix(".attempt").write_text('{"pid": 999999999, "when": "then"}')  # no such process
        v = gate.check(_SM100, device=FakeDevice(), run=self._run(""))
        self.assertFalse(v.ok)
        self.assertRegex(v.detail, r"an earlier check \(process 999999999, started then\) never finished")
        self.assertEqual(self.calls, [])
        self.assertFalse(path.with_suffix(".attempt").exists())  # the stored FAIL stands for it now
        gate._MEMORY.clear()
        self.assertFalse(gate.check(_SM100, device=FakeDevice(), run=self._run("")).ok)  # stored
        self.assertTrue(gate.check(_SM100, device=FakeDevice(), run=self._run(""), force=True).ok)
        self.assertFalse(path.with_suffix(".attempt").exists())

    def test_an_interrupted_check_leaves_no_record_and_runs_again(self):
        """A check interrupted in this process (KeyboardInterrupt while waiting for its child) is no verdict on the
        kernel: it re-raises, stores nothing and removes its attempted record, so the next call runs the check."""
        def interrupted(variant, device):
            self.calls.append("interrupted")
            self.assertTrue(gate.verdict_path(*gate.identity(variant, device)).with_suffix(".attempt").exists())
            raise KeyboardInterrupt

        path = gate.verdict_path(*gate.identity(_SM100, FakeDevice()))
        with self.assertRaises(KeyboardInterrupt):
            gate.check(_SM100, device=FakeDevice(), run=interrupted)
        self.assertFalse(path.exists())
        self.assertFalse(path.with_suffix(".attempt").exists())
        self.assertEqual(gate.check(_SM100, device=FakeDevice(), run=self._run("")).source, "ran")
        self.assertEqual(self.calls, ["interrupted", (_SM100.key, FakeDevice().device_kind)])

    @absltest.skipUnless(sys.platform.startswith("linux"), "a zombie is told from a live process by Linux's /proc")
    def test_an_attempt_by_an_exited_unreaped_process_is_not_waited_for(self):
        """A checking process that exited but is not reaped yet (a zombie: its parent has not waited) runs no check:
        its attempted record fails the check at once, not at the time limit. Live processes still run one; where
        /proc cannot tell, the zombie still counts as running."""
        child = subprocess.Popen([sys.executable, "-c", ""])  # a fork and exec: os.fork would copy JAX's threads
        pid = child.pid
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # it has exited; it stays unreaped until the finally
            self.assertFalse(gate._pid_alive(pid))
            with mock.patch.object(gate, "_PROC", pathlib.Path(self.dir) / "no-proc"):
                self.assertTrue(gate._pid_alive(pid))
            path = gate.verdict_path(*gate.identity(_SM100, FakeDevice()))
            path.parent.mkdir(parents=True)
            path.with_suffix(".attempt").write_text(json.dumps({"pid": pid, "host": socket.gethostname(),
                                                                "when": "then"}))
            start = time.monotonic()
            with mock.patch.dict(os.environ, {gate.TIMEOUT_ENV: "5"}):
                v = gate.check(_SM100, device=FakeDevice(), run=self._run(""))
            self.assertLess(time.monotonic() - start, 5)
            self.assertFalse(v.ok)
            self.assertRegex(v.detail, rf"an earlier check \(process {pid}, started then\) never finished")
        finally:
            child.wait()
        self.assertEqual(self.calls, [])
        self.assertTrue(gate._pid_alive(os.getpid()))
        self.assertTrue(gate._pid_alive(os.getppid()))

    def test_an_attempt_on_another_machine_is_waited_for_while_it_is_young(self):
        """A cache shared between machines: another host's process ids mean nothing here, so its record counts as
        running until it is older than the limit (then it fails the check), and a verdict it stores meanwhile is
        taken; it never becomes a FAIL merely because that pid is not alive on this machine."""
        ident = gate.identity(_SM100, FakeDevice())
        path = gate.verdict_path(*ident)
        path.parent.mkdir(parents=True)
        attempt = path.with_suffix(".attempt")
        record = lambda age: json.dumps({"pid": 999999999, "host": "another-host", "started": time.time() - age,
                                         "when": "then", "key": ident[0]})
        attempt.write_text(record(gate.timeout_s() + 60))  # older than the limit: that check never finished
        v = gate.check(_SM100, device=FakeDevice(), run=self._run(""))
        self.assertFalse(v.ok)
        self.assertRegex(v.detail, r"process 999999999 on another-host, started then\) never finished")
        gate._MEMORY.clear()
        path.unlink()
        attempt.write_text(record(1))  # running there now: its verdict arrives while this process waits
        timer = threading.Timer(1.0, lambda: (gate.store(path, gate.Verdict(*ident, ok=True, detail="ok")),
                                              attempt.unlink()))
        timer.start()
        try:
            v = gate.check(_SM100, device=FakeDevice(), run=self._run("should not run"))
        finally:
            timer.join()
        self.assertTrue(v.ok)
        self.assertEqual(self.calls, [])

    def test_the_attempted_record_names_this_machine(self):
        seen = {}

        def run(variant, device):
            attempt = gate.verdict_path(*gate.identity(variant, device)).with_suffix(".attempt")
            seen.update(json.loads(attempt.read_text()))
            return True, ""

        self.assertTrue(gate.check(_SM100, device=FakeDevice(), run=run).ok)
        self.assertEqual((seen["host"], seen["pid"]), (socket.gethostname(), os.getpid()))
        self.assertLess(abs(time.time() - seen["started"]), 60)

    def test_local_models_lists_one_device_per_gpu_model_of_the_target(self):
        """Two B200s, a B300 (another model, the same target) and an H200: the B200 and B300 first devices; the
        first of them is local_device's."""
        devs = [types.SimpleNamespace(device_kind=kind, compute_capability=cc, id=i) for i, (kind, cc) in enumerate(
            [("NVIDIA H200", "9.0"), ("NVIDIA B200", "10.0"), ("NVIDIA B200", "10.0"), ("NVIDIA B300", "10.0")])]
        with mock.patch("jax.devices", return_value=devs):
            self.assertEqual([d.id for d in gate.local_models("sm_100a")], [1, 3])
            self.assertEqual(gate.local_device("sm_100a").id, 1)
            self.assertEqual([d.id for d in gate.local_models("sm_90a")], [0])

    def test_a_garbled_attempted_record_is_no_running_check(self):
        """An attempted record whose pid is no positive int names no process that runs the check: a stored FAIL at
        once, no os.kill on it (0 and -1 signal whole groups), no wait for it, nothing raised."""
        ident = gate.identity(_SM100, FakeDevice())
        path = gate.verdict_path(*ident)
        path.parent.mkdir(parents=True)
        kill = self.enter_context(mock.patch.object(gate.os, "kill", side_effect=AssertionError("os.kill called")))
        for content in ('{"pid": "abc"}', '{"pid": "123"}', '{"pid": null}', '{"pid": [1]}', '{"pid": 0}',
                        '{"pid": -1}', '{"pid": 99999999999999999999}', '{"pid": 1.5}', '{"pid": true}', "{}",
                        "[1]", '"pid"', "null"):
            with self.subTest(content=content), mock.patch.dict(gate._MEMORY, clear=True):
                path.unlink(missing_ok=True)
                path.with_suffix(".attempt").write_text(content)
                start = time.monotonic()
                v = gate.check(_SM100, device=FakeDevice(), run=self._run(""))
                self.assertLess(time.monotonic() - start, 5)
                self.assertFalse(v.ok)
                self.assertRegex(v.detail, r"an earlier check \(process \?, started \?\) never finished")
        kill.assert_not_called()
        self.assertEqual(self.calls, [])

    def test_an_unusable_verdict_store_warns_and_never_raises(self):
        """A cache directory or selfcheck/ that is a file, or a verdict or attempted record that is a directory: the
        gate logs that it cannot keep its records, the check's own outcome decides in this process, nothing raises."""
        ident = gate.identity(_SM100, FakeDevice())
        blockers = {"cache dir is a file": lambda p: (p.parent.parent, False),
                    "selfcheck/ is a file": lambda p: (p.parent, False),
                    "verdict is a directory": lambda p: (p, True),
                    "attempt is a directory": lambda p: (p.with_suffix(".attempt"), True)}
        for name, blocker in blockers.items():
            for why in ("", "C relative error 1"):
                with self.subTest(name=name, why=why), mock.patch.dict(gate._MEMORY, clear=True), \
                        tempfile.TemporaryDirectory() as root, \
                        mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": os.path.join(root, "cache")}):
                    target, is_dir = blocker(gate.verdict_path(*ident))
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.mkdir() if is_dir else target.write_text("a file")
                    with self.assertLogs(gate.logger, "WARNING") as logs:
                        v = gate.check(_SM100, device=FakeDevice(), run=self._run(why))
                    self.assertEqual((v.ok, v.detail), (not why, why or "ok"))
                    self.assertRegex("\n".join(logs.output), r"jax_blockgemm: cannot (write|delete) ")
                    self.assertEqual([f for _, _, fs in os.walk(root) for f in fs if f.endswith(".tmp")], [])

    def test_a_check_that_cannot_start_is_a_stored_failure(self):
        def cannot_spawn(variant, device):
            raise OSError("no such file: python")

        v = gate.check(_SM100, device=FakeDevice(), run=cannot_spawn)
        self.assertFalse(v.ok)
        self.assertIn("could not run: OSError: no such file", v.detail)
        self.assertFalse(gate.verdict_path(*gate.identity(_SM100, FakeDevice())).with_suffix(".attempt").exists())

    def test_no_local_gpu_raises(self):
        with self.assertRaisesRegex(RuntimeError, "no local GPU runs sm_100a kernels"):
            gate.check(_SM100)

    def test_table(self):
        ok = gate.Verdict("k1", "NVIDIA B200", "ab", True, "ok")
        bad = gate.Verdict("k2.broken", "NVIDIA B200", "cd", False, "C relative error 1", "disk")
        text = selfcheck.format_table([ok, bad], expect_fail=["k2.broken"])
        self.assertRegex(text, r"k1\s+NVIDIA B200\s+PASS\s+ran\s+ok")
        self.assertRegex(text, r"k2\.broken\s+NVIDIA B200\s+FAIL \(must FAIL\)\s+disk\s+C relative error 1")


def _operands():
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((200, 96)), jnp.float32).astype(jnp.float8_e4m3fn)
    b = jnp.asarray(rng.standard_normal((136, 96)), jnp.float32).astype(jnp.float8_e4m3fn)
    return a, b, jnp.asarray(oracle.random_scale_bytes(rng, (200, 3))), jnp.asarray(
        oracle.random_scale_bytes(rng, (136, 3)))


def _cuda_text(**kwargs) -> str:
    f = jax.jit(lambda *x: jbg.gemm_amax(*x, **kwargs))
    return f.trace(*_operands()).lower(lowering_platforms=("cuda",)).as_text()


class DispatchGateTest(absltest.TestCase):
    """A CUDA lowering on a (faked) Blackwell machine: the gate runs the check inside the lowering."""

    def setUp(self):
        self.dir = self.enter_context(tempfile.TemporaryDirectory())
        self.enter_context(mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": self.dir}))
        self.enter_context(mock.patch.dict(gate._MEMORY, clear=True))
        self.enter_context(mock.patch.object(gate, "_WARNED", set()))
        self.enter_context(mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("10.0",)))
        self.enter_context(mock.patch.object(gate, "local_device", return_value=FakeDevice()))
        self.enter_context(mock.patch.object(gate, "_run_child", _in_process))
        self.runs = 0

    def _fake_run(self, perturb=None):
        def run(variant, device):
            self.runs += 1
            return _RUN_PROBLEMS(variant, device, run_kernel=_oracle_kernel(perturb), run_reference=_cpu_reference)
        return run

    def test_cutedsl_runs_the_check_once_then_embeds_both_objects(self):
        with mock.patch.object(selfcheck, "run_problems", self._fake_run()):
            text = _cuda_text(implementation="cutedsl")
            _cuda_text(implementation="cutedsl")
        self.assertIn('archs = "sm_100a,sm_90a"', text)
        self.assertEqual(self.runs, 1)

    def test_cutedsl_raises_when_the_check_fails(self):
        negate = lambda c: c.__setitem__((0, 0, 0), -c[0, 0, 0])
        with mock.patch.object(selfcheck, "run_problems", self._fake_run(negate)), \
                self.assertWarnsRegex(RuntimeWarning, "gemm_amax.sm_100a.e4m3.f32.sf32.t128x128.c1x1 failed"), \
                self.assertRaisesRegex(ValueError, "first-use self-check failed: gemm_amax.sm_100a.e4m3.f32.sf32."
                                                   "t128x128.c1x1 on NVIDIA B200: .*1 of 27200 C elements off"):
            _cuda_text(implementation="cutedsl")

    def test_default_falls_back_with_a_warning_when_the_check_fails(self):
        negate = lambda c: c.__setitem__((0, 0, 0), -c[0, 0, 0])
        with _none_takes_kernels("10.0"), \
                mock.patch.object(selfcheck, "run_problems", self._fake_run(negate)), \
                self.assertWarnsRegex(RuntimeWarning, "will not be used: implementation=None takes the next choice"):
            self.assertNotIn("jbg_gemm_amax", _cuda_text())

    def test_a_verdict_file_not_a_boolean_pass_of_this_object_never_takes_the_kernel(self):
        """A stored verdict counts only with `ok` a JSON boolean and this kernel's key, GPU model and object hash;
        anything else is checked again (here the check fails), never read as a pass."""
        negate = lambda c: c.__setitem__((0, 0, 0), -c[0, 0, 0])
        with mock.patch("jax_blockgemm.kernel_cache.get_object", side_effect=lambda v: v.key.encode()):
            key, device, sha = gate.identity(_SM100, FakeDevice())
        mine = {"key": key, "device": device, "object_sha": sha, "detail": "ok"}
        records = [dict(mine, ok=ok) for ok in ("false", "0", [False], {"x": 0}, "true", 1)]
        records += [dict(mine, ok=True, **other) for other in ({"key": "gemm_amax.other"}, {"device": "NVIDIA H200"},
                                                               {"object_sha": "0" * 64}, {"detail": None})]
        for record in records:
            with self.subTest(record=record), \
                    mock.patch("jax_blockgemm.kernel_cache.get_object", side_effect=lambda v: v.key.encode()), \
                    mock.patch.dict(gate._MEMORY, clear=True), mock.patch.object(gate, "_WARNED", set()), \
                    _none_takes_kernels("10.0"), mock.patch.object(selfcheck, "run_problems", self._fake_run(negate)), \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore")
                path = gate.verdict_path(key, device, sha)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(record))
                runs = self.runs
                self.assertNotIn("jbg_gemm_amax", _cuda_text())
                self.assertEqual(self.runs, runs + 1)  # checked again
                self.assertIs(gate.load(path, (key, device, sha)).ok, False)  # the new verdict, a boolean FAIL

    def test_an_unusable_verdict_store_never_raises_out_of_the_op(self):
        """selfcheck/ a file: the op lowers (the failed check falls back to the reference, with its warning)."""
        negate = lambda c: c.__setitem__((0, 0, 0), -c[0, 0, 0])
        with open(os.path.join(self.dir, "selfcheck"), "w") as f:
            f.write("a file")
        with _none_takes_kernels("10.0"), mock.patch.object(selfcheck, "run_problems", self._fake_run(negate)), \
                mock.patch("jax_blockgemm.kernel_cache.get_object", side_effect=lambda v: v.key.encode()), \
                self.assertLogs(gate.logger, "WARNING"), \
                self.assertWarnsRegex(RuntimeWarning, "will not be used: implementation=None takes the next choice"):
            self.assertNotIn("jbg_gemm_amax", _cuda_text())
        self.assertEqual(self.runs, 1)

    def test_default_takes_the_kernel_once_the_check_passed(self):
        with _none_takes_kernels("10.0"), mock.patch.object(selfcheck, "run_problems", self._fake_run()):
            self.assertIn("jbg_gemm_amax", _cuda_text())

    def test_default_today_never_takes_the_never_run_kernel(self):
        self.assertFalse(arch.none_takes_kernel("gemm_amax", "sm_100a"))
        with mock.patch.object(selfcheck, "run_problems", self._fake_run()):
            self.assertNotIn("jbg_gemm_amax", _cuda_text())
        self.assertEqual(self.runs, 0)

    def test_hopper_machine_never_runs_the_check(self):
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)), \
                mock.patch.object(selfcheck, "run_problems", self._fake_run()):
            self.assertIn("jbg_gemm_amax", _cuda_text(implementation="cutedsl"))
        self.assertEqual(self.runs, 0)

    def test_forced_variant_bypasses_selection_and_check(self):
        broken = broken_kernels.NEGATED_CORNER
        with dispatch.forced_variants((broken,)), mock.patch.object(selfcheck, "run_problems", self._fake_run()):
            text = _cuda_text(implementation="cutedsl")
            self.assertNotIn("jbg_gemm_amax", _cuda_text(implementation="xla"))
        self.assertIn(broken.function_prefix, text)
        self.assertNotIn("sm_100a", text)
        self.assertEqual(self.runs, 0)


_ROPE100 = catalog.select_variant(op="proj_rope", arch="sm_100a", ab_dtype="bfloat16", c_dtype="float8_e4m3fn",
                                  sf_vec_size=32, tile_mn=(128, 192), cluster_mn=(1, 1))


_REFERENCE_OUTPUTS: dict = {}


def _cpu_proj_rope_reference(variant, args, device):
    """The reference on the CPU, computed once per operands and layout (the stand-in kernel is the same function)."""
    key = (variant.b_major, hashlib.sha1(b"".join(np.asarray(a).tobytes() for a in args)).hexdigest())
    if key not in _REFERENCE_OUTPUTS:
        _REFERENCE_OUTPUTS[key] = selfcheck._run_proj_rope_reference(variant, args, jax.devices("cpu")[0])
    return _REFERENCE_OUTPUTS[key]


def _proj_rope_stand_in(perturb=None):
    """A stand-in for a proj_rope kernel run: the reference on the CPU, its outputs optionally perturbed in place."""

    def run(variant, args, device):
        outs = [np.array(o) for o in _cpu_proj_rope_reference(variant, args, device)]
        if perturb is not None:
            perturb(outs)
        return tuple(outs)

    return run


def _poison_last_warp(outs):
    """What the handler's poison leaves where a kernel skips the last 32 tokens: NaN codes, 0xFE scales."""
    for codes in (outs[0], outs[2]):
        codes.view(np.uint8)[-32:] = 0xFF
    outs[1][-32:] = 0xFE
    outs[3][-1:] = 0xFE


def _flip_one_code(outs):
    outs[0].view(np.uint8)[0, 0, 5] ^= 0x80  # a sign flip


class DequantizeSelfCheckTest(absltest.TestCase):
    """What the dequantize self-check expects of each object, on the CPU (the kernels run on the H200)."""

    def test_swap_ab_object_expects_the_ragged_kernels_token_order(self):
        """The swap_ab object's expected values are `swap_ab_layout.swap_ab_tokens` of the plain ones without the
        padding to 256 columns (its problems' columns are whole 64-column tiles, each permuted alone), not the plain
        ones."""
        from jax_blockgemm import swap_ab_layout

        rng = np.random.default_rng(0)
        for rows, cols, axis, paired in selfcheck.SWAP_AB_DEQUANTIZE_PROBLEMS:
            for shape in ((rows, cols),) + ((paired,) if paired else ()):
                codes, scales = selfcheck._dequantize_operands(*shape, -1, rng)
                plain = selfcheck._dequantize_expected(codes, scales, -1, False)
                ordered = selfcheck._dequantize_expected(codes, scales, -1, True)
                tokens = np.asarray(swap_ab_layout.swap_ab_tokens(jnp.asarray(plain)))[:, :shape[1]]  # less its padding
                np.testing.assert_array_equal(ordered.view(np.uint16), tokens.view(np.uint16))
                self.assertFalse(np.array_equal(ordered.view(np.uint16), plain.view(np.uint16)))
        swap_ab = [v for v in catalog.CATALOG if v.op == "dequantize" and v.schedule == catalog.SWAP_AB]
        self.assertEqual([v.a_major for v in swap_ab], ["k"])  # scales along the rows: the problems' axis -1


class ProjRopeSelfCheckTest(parameterized.TestCase):
    """The proj_rope self-check on the CPU: real operands, the XLA reference as both 'kernel' and reference."""

    def setUp(self):
        variant = dataclasses.replace(_ROPE100, b_major="n")
        self.args = selfcheck._proj_rope_operands(variant, (96, 2, 72), seed=3)
        self.ref = tuple(np.array(o) for o in _cpu_proj_rope_reference(variant, self.args, None))

    def test_identical_outputs_pass(self):
        self.assertEqual(selfcheck.compare_proj_rope(self.ref, self.ref), "")

    @parameterized.named_parameters(
        ("poisoned_last_warp", _poison_last_warp, r"scales: \d+ of \d+ bytes differ|non-finite"),
        ("one_sign_flipped", _flip_one_code, r"rowwise: 1 of 36864 elements off by more than one E4M3 step, first "
                                             r"at \(0, 0, 5\)"),
        ("scale_off_by_one_everywhere", lambda o: o[3].__iadd__(1), r"columnwise scales: 1152 of 1152 bytes"),
        ("transposed_codes", lambda o: o.__setitem__(2, np.ascontiguousarray(o[2][:, ::-1])), "columnwise"),
        ("shape", lambda o: o.__setitem__(1, o[1][:32]), "out_scales_row has shape"))
    def test_wrong_outputs_fail(self, perturb, match):
        outs = [o.copy() for o in self.ref]
        perturb(outs)
        self.assertRegex(selfcheck.compare_proj_rope(outs, self.ref), match)

    def test_one_step_off_passes_but_not_too_many_codes(self):
        outs = [o.copy() for o in self.ref]
        bits = outs[2].view(np.uint8)
        nonzero = np.flatnonzero((bits & 0x7F) > 8)
        flat = bits.reshape(-1)
        flat[nonzero[:10]] += 1  # one E4M3 step (same sign, away from zero): within the bound
        self.assertEqual(selfcheck.compare_proj_rope(outs, self.ref), "")
        flat[nonzero[:len(nonzero) // 20]] += 1  # 5% of the codes two steps off
        self.assertRegex(selfcheck.compare_proj_rope(outs, self.ref), "columnwise")

    def test_right_kernel_passes_every_problem_and_a_wrong_one_is_named(self):
        for b_major in ("k", "n"):
            variant = dataclasses.replace(_ROPE100, b_major=b_major)
            self.assertEqual(selfcheck.run_proj_rope_problems(variant, None, run_kernel=_proj_rope_stand_in(),
                                                              run_reference=_cpu_proj_rope_reference), "")
        why = selfcheck.run_proj_rope_problems(_ROPE100, None, run_kernel=_proj_rope_stand_in(_poison_last_warp),
                                               run_reference=_cpu_proj_rope_reference)
        self.assertRegex(why, r"^\(T, H, K\) = \(96, 2, 72\): ")

    def test_a_kernel_that_raises_fails_the_check(self):
        def boom(variant, args, device):
            raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS")

        why = selfcheck.run_proj_rope_problems(_ROPE100, None, run_kernel=boom,
                                               run_reference=_cpu_proj_rope_reference)
        self.assertIn("raised RuntimeError: CUDA_ERROR_ILLEGAL_ADDRESS", why)

    def test_problems_cover_tails_heads_k_tails_and_more_tiles_than_sms(self):
        problems = selfcheck.PROJ_ROPE_PROBLEMS
        self.assertTrue(all(t % 32 == 0 and k % 8 == 0 for t, _, k in problems))
        self.assertTrue(any(t % 128 for t, _, _ in problems))
        self.assertTrue(any(h > 1 for _, h, _ in problems) and any(h == 1 for _, h, _ in problems))
        self.assertTrue(any(k % 64 for *_, k in problems))
        self.assertTrue(any(-(-t // 128) * h > 148 for t, h, _ in problems))  # a B200's SMs

    def test_check_runs_the_proj_rope_problems_for_a_proj_rope_variant(self):
        self.enter_context(mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": self.enter_context(
            tempfile.TemporaryDirectory())}))
        self.enter_context(mock.patch.dict(gate._MEMORY, clear=True))
        self.enter_context(mock.patch("jax_blockgemm.kernel_cache.get_object", return_value=b"object"))
        with mock.patch.object(selfcheck, "run_proj_rope_problems", return_value="") as rope, \
                mock.patch.object(selfcheck, "run_problems", return_value="wrong runner") as gemm:
            self.assertTrue(gate.check(_ROPE100, device=FakeDevice(), run=_in_process).ok)
        rope.assert_called_once()
        gemm.assert_not_called()


def _proj_rope_cuda_text(**kwargs) -> str:
    x = jax.ShapeDtypeStruct((96, 72), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((384, 72), jnp.bfloat16)
    cs = jax.ShapeDtypeStruct((96, 64), jnp.bfloat16)
    f = jax.jit(lambda *a: jbg.gemm_proj_rope_mxfp8(*a, **kwargs))
    return f.trace(x, w, cs, cs).lower(lowering_platforms=("cuda",)).as_text()


class ProjRopeDispatchGateTest(absltest.TestCase):
    """A proj_rope CUDA lowering on a (faked) Blackwell machine: the sm_100a kernel only after its self-check."""

    def setUp(self):
        self.enter_context(mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": self.enter_context(
            tempfile.TemporaryDirectory())}))
        self.enter_context(mock.patch.dict(gate._MEMORY, clear=True))
        self.enter_context(mock.patch.object(gate, "_WARNED", set()))
        self.enter_context(mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("10.0",)))
        self.enter_context(mock.patch.object(gate, "local_device", return_value=FakeDevice()))
        self.enter_context(mock.patch.object(gate, "_run_child", _in_process))
        self.enter_context(mock.patch("jax_blockgemm.kernel_cache.get_object", side_effect=lambda v: v.key.encode()))
        self.checked = []

    def _fake_run(self, why):
        def run(variant, device):
            self.checked.append(variant.key)
            return why
        return run

    def test_cutedsl_checks_once_then_embeds_both_objects(self):
        with mock.patch.object(selfcheck, "run_proj_rope_problems", self._fake_run("")):
            text = _proj_rope_cuda_text(implementation="cutedsl")
            _proj_rope_cuda_text(implementation="cutedsl")
        self.assertIn('archs = "sm_100a,sm_90a"', text)
        self.assertEqual(self.checked, [_ROPE100.key])

    def test_cutedsl_raises_and_default_falls_back_when_the_check_fails(self):
        with mock.patch.object(selfcheck, "run_proj_rope_problems", self._fake_run("rowwise: 3 elements off")), \
                self.assertWarnsRegex(RuntimeWarning, "proj_rope.sm_100a.bf16.e4m3.sf32.t128x192.c1x1 failed"), \
                self.assertRaisesRegex(ValueError, "first-use self-check failed: proj_rope.sm_100a.* rowwise"):
            _proj_rope_cuda_text(implementation="cutedsl")
        with _none_takes_kernels("10.0"), \
                mock.patch.object(selfcheck, "run_proj_rope_problems", self._fake_run("rowwise: 3 elements off")):
            self.assertNotIn("jbg_gemm_proj_rope_mxfp8", _proj_rope_cuda_text())

    def test_forced_variant_is_used_alone_and_unchecked(self):
        with dispatch.forced_variants((_ROPE100,)), \
                mock.patch.object(selfcheck, "run_proj_rope_problems", self._fake_run("")):
            text = _proj_rope_cuda_text(implementation="cutedsl")
        self.assertIn('archs = "sm_100a"', text)
        self.assertEqual(self.checked, [])


class CliTest(absltest.TestCase):

    def test_without_gpu_says_so(self):
        with mock.patch.object(gate, "local_device", return_value=None), \
                mock.patch("sys.stdout") as out:
            self.assertEqual(selfcheck.main(["--arch", "sm_100a"]), 2)
        self.assertIn("no local GPU", "".join(str(c.args[0]) for c in out.write.call_args_list))

    def test_unknown_targets_and_keys_are_refused(self):
        with mock.patch("sys.stderr"), self.assertRaises(SystemExit) as stop:
            selfcheck.main(["--arch", "sm_91"])
        self.assertEqual(stop.exception.code, 2)
        key = catalog.variants_for("sm_90a")[0].key
        with mock.patch.object(gate, "check") as check, mock.patch("sys.stderr") as err:
            self.assertEqual(selfcheck.main(["--variant", key, "--variant", key + ".typo"]), 2)
        check.assert_not_called()
        self.assertIn(key + ".typo", "".join(str(c.args[0]) for c in err.write.call_args_list))

    def test_one_row_per_kernel_and_the_exit_status_expects_broken_kernels_to_fail(self):
        """Every sm_90a kernel (gemm_amax, proj_rope and dequantize alike) gets its row; broken ones must FAIL."""
        self.enter_context(mock.patch.dict(os.environ, {gate.EXTRA_VARIANTS_ENV: "broken_kernels"}))
        verdicts = {v.key: gate.Verdict(v.key, "GPU", "x", not v.flavor, "ok", "ran")
                    for v in catalog.variants_for("sm_90a") + broken_kernels.BROKEN}
        with mock.patch.object(gate, "local_device", return_value=FakeDevice("NVIDIA H200")), \
                mock.patch.object(gate, "check", side_effect=lambda v, force: verdicts[v.key]), \
                mock.patch("sys.stdout") as out:
            self.assertEqual(selfcheck.main(["--arch", "sm_90a"]), 0)
            verdicts[broken_kernels.NEGATED_CORNER.key] = dataclasses.replace(
                verdicts[broken_kernels.NEGATED_CORNER.key], ok=True)
            self.assertEqual(selfcheck.main(["--arch", "sm_90a"]), 1)
        printed = "".join(str(c.args[0]) for c in out.write.call_args_list)
        for key in verdicts:
            self.assertIn(key, printed)

    def test_every_kernel_dispatch_can_choose_has_a_problem_set(self):
        device = FakeDevice()
        ran = []
        runners = {name: (lambda op: (lambda v, d: ran.append((op, v.op)) or ""))(name)
                   for name in ("run_problems", "run_proj_rope_problems", "run_dequantize_problems",
                                "run_ragged_problems", "run_contraction_problems", "run_quantize_pair_problems")}
        with mock.patch.multiple(selfcheck, **runners):
            for v in catalog.CATALOG:
                self.assertEqual(selfcheck.run_check(v, device), "", v.key)
        # the decode kernel is checked through gemm_amax calls of small M, so by the gemm_amax runner
        expected = {("run_problems", "gemm_amax"), ("run_problems", "weight_stream"),
                    ("run_proj_rope_problems", "proj_rope"), ("run_dequantize_problems", "dequantize"),
                    ("run_ragged_problems", "ragged"), ("run_contraction_problems", "contraction"),
                    ("run_quantize_pair_problems", "quantize_pair")}
        self.assertEqual(set(ran), expected)
        self.assertEqual({v.op for v in catalog.CATALOG}, {op for _, op in expected})

    def test_quantize_pair_problems_fit_their_schedule(self):
        """Every quantize_pair variant's problems are ones its kernel takes; the gather schedules' maps name each of
        w's rows exactly once (the kernel writes the column blocks of named rows only) and leave some entries empty;
        the reference runs them (with col_values for GATHER_VALUES: bf16 column values)."""
        import jax

        for v in catalog.variants_for("sm_90a", "quantize_pair"):
            kernel = catalog.make_kernel(v)
            count = len(selfcheck.QUANTIZE_PAIR_GATHER_PROBLEMS if v.schedule else selfcheck.QUANTIZE_PAIR_PROBLEMS)
            for i in range(count):
                with self.subTest(variant=v.key, problem=i):
                    w, row_map, _ = selfcheck._quantize_pair_inputs(v, i)
                    if row_map is None:
                        self.assertTrue(kernel.can_implement(int(np.prod(w.shape[:-1])), w.shape[-1])[0])
                    else:
                        self.assertTrue(kernel.can_implement(len(row_map), w.shape[1], w.shape[0])[0])
                        self.assertNotEqual(w.shape[0] % 32, 0)
                        named = row_map[(row_map >= 0) & (row_map < w.shape[0])]
                        np.testing.assert_array_equal(np.sort(named), np.arange(w.shape[0]))
                        self.assertLess(len(named), len(row_map))
                    out = selfcheck._run_quantize_pair(v, w, row_map, jax.devices("cpu")[0], "xla")
                    self.assertEqual(out[1].dtype, np.uint16 if v.schedule == catalog.GATHER_VALUES else np.uint8)

    def test_decode_problems_fit_the_variant_and_reach_its_edges(self):
        """Every weight_stream variant's problems are ones it takes, one of them fills its token capacity, and
        together they cover a single token, a partial token tile, L > 1, N off the CTA's row multiple and a K whose
        chunks wrap every warp's copy ring at least twice."""
        from jax_blockgemm.kernels import weight_stream

        variants = [v for v in catalog.CATALOG if v.op == "weight_stream"]
        self.assertNotEmpty(variants)
        for v in variants:
            with self.subTest(variant=v.key):
                probs = selfcheck.problems(v)
                self.assertEqual(probs, selfcheck.decode_problems(v))
                kernel = weight_stream.WeightStreamGemm(w_dtype=v.ab_dtype, c_dtype=v.c_dtype,
                                                        sf_vec_size=v.sf_vec_size, sf_dtype=v.sf_dtype,
                                                        tile=v.tile_mn)
                for l, m, n, k in probs:
                    self.assertEqual(kernel.can_implement(m, n, k, l), (True, ""), (l, m, n, k))
                    self.assertNotEqual(n % v.tile_mn[0], 0)
                ms = {m for _, m, _, _ in probs}
                self.assertIn(1, ms)
                self.assertIn(v.tile_mn[1], ms)
                self.assertTrue(any(m % 8 for m in ms if m > 1))  # a partial tile of 8 tokens (the MMA's N)
                self.assertGreater(max(l for l, _, _, _ in probs), 1)
                chunks_per_warp = -(-max(k for _, _, _, k in probs) // kernel.chunk) / weight_stream.WARPS
                self.assertGreaterEqual(chunks_per_warp, 2 * kernel.stages)


class GateChildProcessTest(absltest.TestCase):
    """The gate's child process for real (no GPU needed): what a hang, a crash or an answer leaves behind."""

    def _run(self, code: str, timeout: float = 20.0):
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "result.json")
            return gate.run_in_child([sys.executable, "-c", code, "--result", result], gpu="0", timeout=timeout)

    def test_an_answer_is_read(self):
        code = ("import json, sys; open(sys.argv[-1], 'w').write(json.dumps({'ok': False, 'detail': 'C off'}))")
        self.assertEqual(self._run(code), (False, "C off"))
        ok = "import json, sys; open(sys.argv[-1], 'w').write(json.dumps({'ok': True, 'detail': 'ok'}))"
        self.assertEqual(self._run(ok), (True, "ok"))

    def test_a_hang_is_killed_with_its_whole_process_group(self):
        with tempfile.TemporaryDirectory() as tmp:
            pidfile = os.path.join(tmp, "grandchild")
            # the child starts a grandchild that would outlive it, then hangs itself
            code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
                    "'import time; time.sleep(600)']); open(%r, 'w').write(str(p.pid)); time.sleep(600)" % pidfile)
            start = time.monotonic()
            ok, detail = self._run(code, timeout=3.0)
            self.assertLess(time.monotonic() - start, 30)
            self.assertFalse(ok)
            self.assertRegex(detail, r"timed out after 3 s .*process group was killed")
            grandchild = int(open(pidfile).read())
        deadline = time.monotonic() + 10
        while gate._pid_alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertFalse(gate._pid_alive(grandchild), "the hung check's grandchild survived")

    def test_a_crash_without_an_answer_fails_naming_the_status_and_last_words(self):
        ok, detail = self._run("import os, sys; print('CUDA_ERROR_ILLEGAL_ADDRESS'); sys.stdout.flush(); "
                               "os.abort()")
        self.assertFalse(ok)
        self.assertRegex(detail, r"killed by signal 6 .*without a result: CUDA_ERROR_ILLEGAL_ADDRESS")
        ok, detail = self._run("raise SystemExit(3)")
        self.assertRegex(detail, r"exited with status 3")

    def test_a_pass_needs_exit_status_zero_and_a_boolean_ok(self):
        write = "import json, os, signal, sys; open(sys.argv[-1], 'w').write(json.dumps({'ok': %r, 'detail': 'ok'}));"
        ok, detail = self._run(write % True + " sys.exit(3)")
        self.assertFalse(ok)
        self.assertRegex(detail, r"exited with status 3 .*its result: ok=True")
        ok, detail = self._run(write % True + " os.kill(os.getpid(), signal.SIGSEGV)")
        self.assertFalse(ok)
        self.assertRegex(detail, r"killed by signal 11 .*its result: ok=True")
        for value in ("no", "true", 1, [True], None):
            self.assertEqual(self._run(write % value)[0], False, value)

    def test_an_interrupted_wait_kills_the_child_group_and_raises_again(self):
        """Ctrl-C in the parent while its check runs: the child (in its own process group) must not outlive the
        wait."""
        with tempfile.TemporaryDirectory() as tmp:
            pidfile = os.path.join(tmp, "child")

            class Interrupted(subprocess.Popen):
                def wait(self, timeout=None):
                    if timeout is None:  # the wait after the kill
                        return super().wait()
                    while not os.path.exists(pidfile) or not open(pidfile).read():
                        time.sleep(0.05)
                    raise KeyboardInterrupt

            code = "import os, time; open(%r, 'w').write(str(os.getpid())); time.sleep(600)" % pidfile
            with mock.patch.object(gate.subprocess, "Popen", Interrupted), self.assertRaises(KeyboardInterrupt):
                self._run(code)
            child = int(open(pidfile).read())
        self.assertFalse(gate._pid_alive(child), "the interrupted check's child survived")

    def test_the_child_imports_this_copy_of_the_package_whatever_the_callers_directory(self):
        """A `jax_blockgemm` in the caller's working directory (a checkout, a shadow) is not what the child runs."""
        with tempfile.TemporaryDirectory() as shadow:
            os.makedirs(os.path.join(shadow, "jax_blockgemm"))
            with open(os.path.join(shadow, "jax_blockgemm", "__init__.py"), "w") as f:
                f.write("")
            code = ("import json, sys, jax_blockgemm; open(sys.argv[-1], 'w').write(json.dumps({'ok': True, "
                    "'detail': jax_blockgemm.__file__}))")
            with contextlib.chdir(shadow):
                ok, detail = self._run(code)
        self.assertTrue(ok)
        self.assertEqual(os.path.realpath(detail), os.path.realpath(jbg.__file__))
        self.assertEqual(gate.package_root(), os.path.dirname(os.path.dirname(jbg.__file__)))

    def test_the_child_gets_its_gpu_pinned_and_no_preallocation(self):
        code = ("import json, os, sys; open(sys.argv[-1], 'w').write(json.dumps({'ok': True, 'detail': "
                "os.environ['CUDA_VISIBLE_DEVICES'] + ',' + os.environ['XLA_PYTHON_CLIENT_PREALLOCATE']}))")
        with tempfile.TemporaryDirectory() as tmp:
            got = gate.run_in_child([sys.executable, "-c", code, "--result", os.path.join(tmp, "r")], gpu="3",
                                    timeout=20)
        self.assertEqual(got, (True, "3,false"))

    @absltest.skipUnless(sys.platform.startswith("linux"), "the parent-death signal is Linux's")
    def test_the_child_ends_with_a_killed_parent(self):
        """A user process SIGKILLed mid-check (a notebook restart) takes its check with it: the child armed the
        parent-death signal (gate.die_with_parent, as the selfcheck child does first) and is gone within seconds,
        not at its timeout."""
        child = ("from jax_blockgemm import gate; gate.die_with_parent(); import time; print('armed', flush=True); "
                 "time.sleep(120)")
        parent = (f"import os, subprocess, sys, time; env = dict(os.environ, {gate.PARENT_ENV}=str(os.getpid())); "
                  f"p = subprocess.Popen([sys.executable, '-c', {child!r}], env=env, stdout=subprocess.PIPE, "
                  "start_new_session=True); print(p.pid, p.stdout.readline().decode().strip(), flush=True); "
                  "time.sleep(120)")
        proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                                cwd=gate.package_root())
        try:
            pid, state = proc.stdout.readline().split()
            self.assertEqual(state, "armed")
        finally:
            proc.kill()
            proc.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and gate._pid_alive(int(pid)):  # an orphan's zombie may await a reaper
            time.sleep(0.2)
        running = gate._pid_alive(int(pid))
        if running:
            os.kill(int(pid), 9)
        self.assertFalse(running, "the check outlived its parent")

    def test_timeout_comes_from_the_environment(self):
        self.assertEqual(gate.timeout_s(), gate.DEFAULT_TIMEOUT_S)
        with mock.patch.dict(os.environ, {gate.TIMEOUT_ENV: "7.5"}):
            self.assertEqual(gate.timeout_s(), 7.5)
        for bad in ("-1", "0", "inf", "nan", "soon"):
            with mock.patch.dict(os.environ, {gate.TIMEOUT_ENV: bad}), \
                    self.assertRaisesRegex(ValueError, "positive, finite"):
                gate.timeout_s()


if __name__ == "__main__":
    absltest.main()
