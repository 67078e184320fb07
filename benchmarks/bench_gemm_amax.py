"""Benchmark gemm_amax on the GPU against the baselines of BASELINES.md, measured in the same run.

Usage: python benchmarks/bench_gemm_amax.py [--out DIR] [--quick]
Prints a table (median of repeated block_until_ready timings after warm-up, fresh random data, several input sets
rotated so the L2 cannot hold them) and writes bench_gemm_amax.json under --out. Also measures first-call latency
(compile + load, cold and with a warm disk cache, each in a fresh process) and per-call dispatch overhead on a
tiny problem beside a plain XLA op.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_blockgemm as jbg

SHAPES = [(8192, 8192, 8192), (4096, 7168, 16384), (4096, 24576, 1536)]


def median_s(fn, args_sets, *, warmup=3, reps=20) -> float:
    for i in range(warmup):
        jax.block_until_ready(fn(*args_sets[i % len(args_sets)]))
    times = []
    for i in range(reps):
        args = args_sets[i % len(args_sets)]
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_inputs(rng, m, n, k, sets=2):
    out = []
    for _ in range(sets):
        a = jnp.asarray(rng.standard_normal((m, k), np.float32) * 4).astype(jnp.float8_e4m3fn)
        b = jnp.asarray(rng.standard_normal((n, k), np.float32) * 4).astype(jnp.float8_e4m3fn)
        sfa = jnp.asarray(rng.integers(118, 136, (m, k // 32)), jnp.uint8)
        sfb = jnp.asarray(rng.integers(118, 136, (n, k // 32)), jnp.uint8)
        out.append((a, b, jbg.formats.to_scale_atom(sfa)[0], jbg.formats.to_scale_atom(sfb)[0], sfa, sfb))
    return out


def bench_shape(rng, m, n, k, reps):
    sets = make_inputs(rng, m, n, k)
    flops = 2.0 * m * n * k
    ours = jax.jit(lambda a, b, sa, sb, *_: jbg.gemm_amax(a, b, sa, sb, implementation="cutedsl"))
    ref = jax.jit(lambda a, b, sa, sb, *_: jbg.gemm_amax(a, b, sa, sb, implementation="xla"))
    fp8_dot = jax.jit(lambda a, b, *_: jnp.dot(a, b.T, preferred_element_type=jnp.float32))
    fp8_dot_amax = jax.jit(lambda a, b, *_: (lambda c: (c, jnp.max(jnp.abs(c))))(
        jnp.dot(a, b.T, preferred_element_type=jnp.float32)))

    def scaled(a, b, sa_atom, sb_atom, sa, sb):
        sa8 = jax.lax.bitcast_convert_type(sa, jnp.float8_e8m0fnu)
        sb8 = jax.lax.bitcast_convert_type(sb, jnp.float8_e8m0fnu)
        return jax.nn.scaled_matmul(a[None], b[None], sa8[None], sb8[None], preferred_element_type=jnp.float32)

    scaled_mm = jax.jit(scaled)
    row = {"shape": [m, n, k]}
    for name, fn in (("ours", ours), ("reference", ref), ("xla_fp8_dot", fp8_dot),
                     ("xla_fp8_dot_plus_amax", fp8_dot_amax), ("jax_nn_scaled_matmul", scaled_mm)):
        try:
            t = median_s(fn, sets, reps=reps)
            row[name] = {"ms": 1e3 * t, "tflops": flops / t / 1e12}
        except Exception as e:  # a baseline that cannot run here is reported, not hidden
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return row


FIRST_CALL = """
import time, numpy as np, jax, jax.numpy as jnp
t0 = time.perf_counter()
import jax_blockgemm as jbg
a = jnp.ones((1, 256, 256), jnp.float8_e4m3fn); s = jnp.full((1, 2, 2, 32, 4, 4), 127, jnp.uint8)
jax.block_until_ready((a, s))
t1 = time.perf_counter()
jax.block_until_ready(jax.jit(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl"))(a, a, s, s))
t2 = time.perf_counter()
print((t2 - t1) * 1e3)
"""


def first_call_latency() -> dict:
    """First jitted call (trace + compile kernel or hit cache + XLA compile + module load + run), fresh processes."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, JAX_BLOCKGEMM_CACHE_DIR=cache)
        run = lambda: float(subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True,
                                           text=True, check=True).stdout.strip().splitlines()[-1])
        cold = run()
        warm = run()
    return {"cold_ms": cold, "warm_disk_cache_ms": warm}


def dispatch_overhead(reps=2000) -> dict:
    """Per-call wall time of a tiny gemm_amax and of a tiny plain XLA op, called back to back."""
    rng = np.random.default_rng(0)
    a, b, sa, sb, _, _ = make_inputs(rng, 128, 128, 128, sets=1)[0]
    ours = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl"))
    plain = jax.jit(lambda x: x * 2.0 + 1.0)
    x = jnp.ones((128, 128), jnp.float32)
    result = {}
    for name, fn, args in (("ours_us", ours, (a, b, sa, sb)), ("plain_xla_op_us", plain, (x,))):
        jax.block_until_ready(fn(*args))
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        result[name] = (time.perf_counter() - start) / reps * 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true", help="one shape, fewer repetitions")
    args = parser.parse_args()
    rng = np.random.default_rng(2026)
    record = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "command": " ".join(sys.argv), "shapes": []}
    for m, n, k in SHAPES[:1] if args.quick else SHAPES:
        record["shapes"].append(bench_shape(rng, m, n, k, reps=10 if args.quick else 20))
    record["first_call"] = first_call_latency()
    record["dispatch"] = dispatch_overhead()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_gemm_amax.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"{record['device']}, jax {record['jax']}, {record['date']}")
    names = ("ours", "reference", "xla_fp8_dot", "xla_fp8_dot_plus_amax", "jax_nn_scaled_matmul")
    print("shape".ljust(20) + "".join(n.rjust(24) for n in names))
    for row in record["shapes"]:
        cells = [f"{row[n]['ms']:.3f} ms {row[n]['tflops']:.0f} TF" if "ms" in row[n] else "error" for n in names]
        print(f"{'x'.join(map(str, row['shape'])):20}" + "".join(c.rjust(24) for c in cells))
        for n in names:
            if "error" in row[n]:
                print(f"  {n}: {row[n]['error']}")
    print("first call:", record["first_call"])
    print("dispatch:", record["dispatch"])


if __name__ == "__main__":
    main()
