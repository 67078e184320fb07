"""Eight Python threads tracing, compiling and running both operations at once, each with its own shapes.

Every result is checked against the float64 oracles, and a thread that does not finish within the timeout fails
the test as a deadlock. On CPU this exercises the reference path (tracing, lowering, the kernel-cache lock, JAX's
caches); on a GPU with a kernel the same test runs gemm_amax through the CuTeDSL kernel (implementation="cutedsl"),
so the handler's instantiate stage and the DSL runtime's module cache are hit from eight threads too.
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import jax_blockgemm as jbg
from jax_blockgemm import arch, dispatch

import oracle_ops

THREADS = 8
ROUNDS = 3
TIMEOUT_S = 600


def _kernel_gpu() -> bool:
    caps = dispatch.local_cuda_capabilities()
    return bool(caps) and all(arch.target_of(cc) for cc in caps)


GEMM_IMPLEMENTATION = "cutedsl" if _kernel_gpu() else None


def _gemm_job(rng: np.random.Generator, i: int, r: int) -> dict:
    """One gemm_amax call with shapes and formats of its own (MXFP8: what the kernels take)."""
    l, m, n, k = 1 + (i + r) % 2, 40 + 9 * i + r, 16 * (1 + (i + r) % 4), 64 + 32 * ((i + r) % 3)
    fmt = ("mxfp8_e4m3", "mxfp8_e5m2")[(i + r) % 2]
    c_dtype = (jnp.float32, jnp.bfloat16)[i % 2]
    d = oracle_ops.random_gemm_inputs(rng, l=l, m=m, n=n, k=k, fmt=fmt, scale_log2=(-4.0, 4.0))
    fn = jax.jit(lambda a, b, sfa, sfb: jbg.gemm_amax(a, b, sfa, sfb, c_dtype=c_dtype,
                                                      implementation=GEMM_IMPLEMENTATION))
    c, amax = fn(jnp.asarray(d["a"]), jnp.asarray(d["b"]), jnp.asarray(d["sfa_atom"]), jnp.asarray(d["sfb_atom"]))
    return dict(op="gemm_amax", inputs=d, c_dtype=c_dtype, out=(np.asarray(c), np.asarray(amax)))


def _proj_rope_job(rng: np.random.Generator, i: int, r: int) -> dict:
    """One gemm_proj_rope_mxfp8 call, bf16 or MXFP8 in, with its own T and H."""
    mxfp8 = (i + r) % 2 == 0
    d = oracle_ops.random_proj_rope_inputs(rng, t=32 * (1 + i % 2), h=1 + r % 2, k=64, mxfp8=mxfp8)
    names = ("x", "w", "cos", "sin", "x_scale", "w_scale") if mxfp8 else ("x", "w", "cos", "sin")
    fn = jax.jit(lambda *xs: jbg.gemm_proj_rope_mxfp8(*xs[:4], **dict(zip(("x_scale", "w_scale"), xs[4:]))))
    outs = fn(*(jnp.asarray(d[k]) for k in names))
    return dict(op="proj_rope", inputs=d, out=[np.asarray(o) for o in outs])


class ThreadsTest(absltest.TestCase):

    def test_eight_threads_both_operations(self):
        barrier = threading.Barrier(THREADS)
        results: dict[int, list] = {i: [] for i in range(THREADS)}
        errors: list = []

        def worker(i: int) -> None:
            rng = np.random.default_rng(1000 + i)
            try:
                barrier.wait(timeout=TIMEOUT_S)  # every thread traces and compiles at the same moment
                for r in range(ROUNDS):
                    job = _gemm_job if (i + r) % 2 == 0 else _proj_rope_job
                    results[i].append(job(rng, i, r))
            except BaseException as e:  # reported by the main thread
                errors.append((i, repr(e)))

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(THREADS)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - start)))
        stuck = [i for i, t in enumerate(threads) if t.is_alive()]
        self.assertEqual(stuck, [], f"threads {stuck} did not finish in {TIMEOUT_S} s (a deadlock?)")
        self.assertEqual(errors, [])
        ops = set()
        for i in range(THREADS):
            self.assertLen(results[i], ROUNDS)
            for r, res in enumerate(results[i]):
                ops.add(res["op"])
                with self.subTest(thread=i, round=r, op=res["op"]):
                    d = res["inputs"]
                    if res["op"] == "gemm_amax":
                        c_ref, amax_ref = oracle_ops.gemm_amax_oracle(d["a"], d["b"], d["sfa"], d["sfb"], k=d["k"],
                                                                      sf_vec_size=d["sf_vec_size"])
                        oracle_ops.assert_gemm_close(self, res["out"][0], c_ref, c_dtype=res["c_dtype"])
                        oracle_ops.assert_amax_close(self, res["out"][1], amax_ref)
                    else:
                        y_ref = oracle_ops.proj_rope_oracle(d["x"], d["w"], d["cos"], d["sin"], x_scale=d["x_scale"],
                                                            w_scale=d["w_scale"])
                        oracle_ops.assert_proj_rope_close(self, res["out"], y_ref)
        self.assertEqual(ops, {"gemm_amax", "proj_rope"})


if __name__ == "__main__":
    absltest.main()
