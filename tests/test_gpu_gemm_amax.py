"""GPU: the CuTeDSL gemm_amax kernels through the FFI bridge, against float64 oracles (runs where a kernel exists).

Skipped on machines without a CUDA device that has a kernel (CI has none); run on the H200 as described in
BUILD.md. Outputs are poisoned by the handler before every launch (JAX_BLOCKGEMM_POISON_OUTPUTS=1, set below), so
an element the kernel fails to write shows up as NaN and fails the oracle check.
"""

import os

os.environ["JAX_BLOCKGEMM_POISON_OUTPUTS"] = "1"

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg
from jax_blockgemm import arch, dispatch

import oracle
import oracle_ops


def _has_kernel_gpu() -> bool:
    caps = dispatch.local_cuda_capabilities()
    return bool(caps) and all(arch.target_of(cc) for cc in caps)


def _inputs(rng, l, m, n, k, dtype):
    kb = -(-k // 32)
    a = (rng.standard_normal((l, m, k)) * 4).astype(np.float32)
    b = (rng.standard_normal((l, n, k)) * 4).astype(np.float32)
    a = jnp.asarray(a).astype(dtype)
    b = jnp.asarray(b).astype(dtype)
    sfa = oracle.random_scale_bytes(rng, (l, m, kb))
    sfb = oracle.random_scale_bytes(rng, (l, n, kb))
    return a, b, sfa, sfb


SHAPES = [(1, 128, 128, 128), (2, 200, 136, 96), (1, 1000, 776, 512), (3, 257, 136, 1040), (1, 64, 8, 16),
          (1, 1024, 1024, 4096)]


@absltest.skipUnless(_has_kernel_gpu(),
                     "needs a CUDA GPU with a CuTeDSL kernel (sm_90a, or sm_100a after its first-use self-check)")
class GpuGemmAmaxTest(parameterized.TestCase):

    @parameterized.product(shape=SHAPES, dtype=("float8_e4m3fn", "float8_e5m2"), c_dtype=("float32", "bfloat16"))
    def test_matches_oracle(self, shape, dtype, c_dtype):
        rng = np.random.default_rng(hash((shape, dtype, c_dtype)) % 2**32)
        l, m, n, k = shape
        a, b, sfa, sfb = _inputs(rng, l, m, n, k, jnp.dtype(dtype))
        fn = jax.jit(lambda *x: jbg.gemm_amax(*x, c_dtype=jnp.dtype(c_dtype), implementation="cutedsl"))
        c, amax = fn(a, b, jnp.asarray(sfa), jnp.asarray(sfb))
        c_ref, amax_ref = oracle_ops.gemm_amax_oracle(np.asarray(a), np.asarray(b), sfa, sfb, k=k, sf_vec_size=32)
        oracle_ops.assert_gemm_close(self, np.asarray(c), c_ref, c_dtype=jnp.dtype(c_dtype))
        oracle_ops.assert_amax_close(self, np.asarray(amax), np.max(amax_ref))

    def test_nan_scale_poisons_amax(self):
        rng = np.random.default_rng(7)
        a, b, sfa, sfb = _inputs(rng, 1, 256, 128, 128, jnp.float8_e4m3fn)
        sfa[0, 17, 2] = 0xFF
        c, amax = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl"))(a, b, jnp.asarray(sfa),
                                                                                jnp.asarray(sfb))
        self.assertTrue(np.isnan(float(amax)))
        self.assertTrue(np.isnan(np.asarray(c)[0, 17]).all())
        self.assertFalse(np.isnan(np.asarray(c)[0, 16]).any())

    def test_which_implementation_runs(self):
        """'cutedsl' lowers to the kernel; None follows the per-architecture policy (arch.TABLE)."""
        a, b, sfa, sfb = _inputs(np.random.default_rng(8), 1, 128, 128, 128, jnp.float8_e4m3fn)
        args = (a, b, jnp.asarray(sfa), jnp.asarray(sfb))
        lower = lambda impl: jax.jit(lambda *x: jbg.gemm_amax(*x, implementation=impl)).lower(*args).as_text()
        self.assertIn("jbg_gemm_amax", lower("cutedsl"))
        target = arch.target_of(dispatch.local_cuda_capabilities()[0])
        self.assertEqual("jbg_gemm_amax" in lower(None), arch.none_takes_kernel("gemm_amax", target))

    def _program(self, implementation):
        """Ops before and after the GEMM in one jitted program, no manual synchronization."""
        def program(x, w):
            a, sfa = jbg.formats.quantize_mxfp8(x * 1.5 + 0.25)
            b, sfb = jbg.formats.quantize_mxfp8(jnp.tanh(w))
            c, amax = jbg.gemm_amax(a, b, sfa, sfb, implementation=implementation)
            return jnp.sum(c * 2.0, axis=0) / amax, amax
        return jax.jit(program)

    def test_inside_larger_program(self):
        rng = np.random.default_rng(9)
        x = jnp.asarray(rng.standard_normal((384, 512)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((256, 512)), jnp.float32)
        got = self._program("cutedsl")(x, w)
        want = self._program("xla")(x, w)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-5)

    def test_command_buffers(self):
        """The same program with XLA command buffers (CUDA graphs) on custom calls gives the same result."""
        script = textwrap.dedent("""
            import numpy as np, jax, jax.numpy as jnp, jax_blockgemm as jbg
            rng = np.random.default_rng(10)
            a = jnp.asarray(rng.standard_normal((1, 384, 256)) * 4, jnp.float32).astype(jnp.float8_e4m3fn)
            b = jnp.asarray(rng.standard_normal((1, 256, 256)) * 4, jnp.float32).astype(jnp.float8_e4m3fn)
            sfa = jnp.asarray(rng.integers(118, 136, (1, 384, 8)), jnp.uint8)
            sfb = jnp.asarray(rng.integers(118, 136, (1, 256, 8)), jnp.uint8)
            f = jax.jit(lambda *x: (lambda c, m: (c + 1.0, m * 2.0))(*jbg.gemm_amax(*x, implementation="cutedsl")))
            for _ in range(3):
                c, m = f(a, b, sfa, sfb)
            np.save("/dev/stdout", np.concatenate([np.asarray(c).ravel(), np.asarray(m).ravel()]))
        """)
        def run(flags):
            env = dict(os.environ, XLA_FLAGS=flags)
            return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, check=True).stdout
        graphs = run("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1")
        plain = run("--xla_gpu_enable_command_buffer=")
        self.assertEqual(graphs, plain)

    def test_export_round_trip(self):
        a, b, sfa, sfb = _inputs(np.random.default_rng(11), 2, 256, 128, 256, jnp.float8_e5m2)
        sfa, sfb = jnp.asarray(sfa), jnp.asarray(sfb)
        fn = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl"))
        exported = jax.export.export(
            fn, disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("jbg_gemm_amax")])(a, b, sfa, sfb)
        restored = jax.export.deserialize(exported.serialize())
        got, want = restored.call(a, b, sfa, sfb), fn(a, b, sfa, sfb)
        for x, y in zip(got, want):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    def _with_objects(self, entries):
        """Lowers gemm_amax with the given (arch, object) entries; the real sm_90a object stands for 'real'."""
        from unittest import mock
        from jax_blockgemm import kernel_cache
        from jax_blockgemm.kernels import catalog

        real = catalog.select_variant(arch="sm_90a", ab_dtype="float8_e4m3fn", c_dtype="float32", sf_vec_size=32,
                                      tile_mn=(128, 128), cluster_mn=(1, 1))
        real_bytes = kernel_cache.get_object(real)
        variants = tuple(real if obj == "real" else
                         type("StandIn", (), dict(arch=arch, key=f"standin.{arch}", function_prefix="jbg_standin"))()
                         for arch, obj in entries)
        objects = {id(v): (real_bytes if obj == "real" else obj) for v, (_, obj) in zip(variants, entries)}
        return (mock.patch.object(dispatch, "gemm_amax_kernels",
                                  return_value=dispatch.KernelChoice(variants=variants)),
                mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: objects[id(v)]))

    def test_runtime_arch_selection(self):
        """A program carrying objects for several archs runs the one matching the device (9.0 -> sm_90a); the
        stand-in sm_80 / sm_100a objects are garbage bytes that would fail if the handler loaded them."""
        a, b, sfa, sfb = _inputs(np.random.default_rng(13), 1, 256, 128, 256, jnp.float8_e4m3fn)
        entries = [("sm_80", b"\x7fELF not an object"), ("sm_90a", "real"), ("sm_100a", b"\x00" * 64)]
        patch_dispatch, patch_cache = self._with_objects(entries)
        with patch_dispatch, patch_cache:
            fn = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl"))
            text = fn.lower(a, b, jnp.asarray(sfa), jnp.asarray(sfb)).as_text()
            c, amax = fn(a, b, jnp.asarray(sfa), jnp.asarray(sfb))
        self.assertIn('archs = "sm_100a,sm_80,sm_90a"', text)
        c_ref, amax_ref = oracle_ops.gemm_amax_oracle(np.asarray(a), np.asarray(b), sfa, sfb, k=256, sf_vec_size=32)
        oracle_ops.assert_gemm_close(self, np.asarray(c), c_ref, c_dtype=jnp.float32)
        oracle_ops.assert_amax_close(self, np.asarray(amax), np.max(amax_ref))

    def test_no_object_for_this_device(self):
        """Only a stand-in for another arch: the handler refuses with the device's capability, it never launches."""
        a, b, sfa, sfb = _inputs(np.random.default_rng(14), 1, 128, 128, 128, jnp.float8_e4m3fn)
        patch_dispatch, patch_cache = self._with_objects([("sm_80", b"\x7fELF not an object")])
        with patch_dispatch, patch_cache:
            fn = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl"))
            with self.assertRaisesRegex(Exception,
                                        "no kernel object for compute capability 9.0.*sm_80.*implementation='xla'"):
                jax.block_until_ready(fn(a, b, jnp.asarray(sfa), jnp.asarray(sfb)))

    def test_no_memory_growth(self):
        import resource
        a, b, sfa, sfb = _inputs(np.random.default_rng(12), 1, 256, 256, 256, jnp.float8_e4m3fn)
        sfa, sfb = jnp.asarray(sfa), jnp.asarray(sfb)
        fn = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl"))
        dev = jax.devices()[0]
        for _ in range(50):
            out = fn(a, b, sfa, sfb)
        jax.block_until_ready(out)
        host0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        dev0 = dev.memory_stats()["bytes_in_use"]
        for _ in range(1000):
            out = fn(a, b, sfa, sfb)
        jax.block_until_ready(out)
        del out
        host1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        dev1 = dev.memory_stats()["bytes_in_use"]
        self.assertLessEqual(dev1, dev0)
        self.assertLess(host1 - host0, 16 * 1024)  # KiB: no per-call host leak

    def test_past_int32_indexing_runs_the_reference(self):
        """C with more than 2**31 elements: None computes it correctly (through the reference), 'cutedsl' refuses it
        when the program is lowered; rows past the 2**31-th element are checked against the float64 oracle."""
        rng = np.random.default_rng(31)
        l, m, n, k = 1, 65600, 32768, 64  # C: 2,149,580,800 elements (8.6 GB of float32)
        a, b, sfa, sfb = _inputs(rng, l, m, n, k, jnp.float8_e4m3fn)
        sfa, sfb = jnp.asarray(sfa), jnp.asarray(sfb)
        with self.assertRaisesRegex(ValueError, r"c \(1, 65600, 32768\) holds 2149580800 elements, past the "
                                                r"kernels' 32-bit indexing"):
            jax.jit(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl")).lower(a, b, sfa, sfb)
        rows = np.array([0, 1, 31337, 65535, 65536, 65599])  # 65536 * 32768 = 2**31: the last three lie past it
        c, amax = jax.jit(lambda *x: jbg.gemm_amax(*x))(a, b, sfa, sfb)
        picked = np.asarray(c[:, rows])
        del c
        a_np, b_np, sfa_np, sfb_np = (np.asarray(x) for x in (a, b, sfa, sfb))
        c_ref, _ = oracle_ops.gemm_amax_oracle(a_np[:, rows], b_np, sfa_np[:, rows], sfb_np, k=k, sf_vec_size=32)
        oracle_ops.assert_gemm_close(self, picked, c_ref, c_dtype=jnp.float32)
        a_hat = oracle.dequantize_f64(a_np[0], sfa_np[0], block=32)
        b_hat_t = oracle.dequantize_f64(b_np[0], sfb_np[0], block=32).T.copy()
        amax_ref = max(float(np.abs(a_hat[r:r + 4096] @ b_hat_t).max()) for r in range(0, m, 4096))  # float64 BLAS
        np.testing.assert_allclose(float(amax), amax_ref, rtol=1e-5)


if __name__ == "__main__":
    absltest.main()
