"""Soak: a mixed workload of both operations for a fixed time, checking errors, memory growth and determinism.

    python3 benchmarks/soak.py --minutes 8 [--out DIR] [--implementation cutedsl|xla|none]

One process per command-buffer setting (XLA_FLAGS --xla_gpu_enable_command_buffer off, then FUSION,CUSTOM_CALL),
each getting half the time. A process cycles through a fixed list of cases (gemm_amax: FP8 formats, C dtypes, L,
tails; proj_rope: bf16 and MXFP8 inputs, both weight layouts, odd T and H), each run once under jax.jit and once
eagerly, on inputs drawn once from a per-case seed. The first pass records a digest of every output; every later pass
must reproduce it byte for byte (the kernels are deterministic: no atomics in C, amax by an order-free max).
After each pass it samples device memory in use (`memory_stats`) and the host's resident set (/proc/self/status):
growth past the first pass by more than --max-device-growth-mib / --max-rss-growth-mib fails the run.
Prints one line per pass and a summary; writes soak.json to --out. Exit status 0 only when every check held.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any, Callable

COMMAND_BUFFERS = {"off": "--xla_gpu_enable_command_buffer=",
                   "on": "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"}
# gemm_amax (L, M, N, K, ab dtype, C dtype) and proj_rope (T, H, K, MXFP8 inputs, w_out_in): tails in every size.
GEMM_CASES = ((1, 1000, 776, 512, "float8_e4m3fn", "float32"), (2, 257, 136, 1040, "float8_e5m2", "bfloat16"),
              (1, 2048, 2048, 2048, "float8_e4m3fn", "bfloat16"), (3, 64, 8, 32, "float8_e4m3fn", "float32"))
PROJ_ROPE_CASES = ((96, 3, 160, False, True), (256, 5, 512, True, False), (2048, 16, 1536, False, True),
                   (32, 1, 64, True, True))


def rss_mib() -> float:
    """This process's resident set in MiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def device_mib(device: Any) -> float:
    """Device memory in use in MiB, as the runtime reports it (0 where it reports none, e.g. a CPU)."""
    stats = device.memory_stats() or {}
    return stats.get("bytes_in_use", 0) / 2**20


def digest(outputs: Any) -> str:
    """A short hash of every output's bytes: equal digests across passes mean bit-identical results."""
    import jax
    import numpy as np

    h = hashlib.sha256()
    for leaf in jax.tree.leaves(outputs):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


def make_cases(implementation: Any) -> list[tuple[str, Callable[[], Any]]]:
    """(name, thunk) pairs; each case's inputs are drawn once from its own seed; a thunk returns the outputs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_blockgemm as jbg
    from jax_blockgemm.bench.inputs import proj_rope_arguments, proj_rope_inputs

    cases = []
    for i, (l, m, n, k, ab, c_dtype) in enumerate(GEMM_CASES):
        def gemm_inputs(i=i, l=l, m=m, n=n, k=k, ab=ab):
            rng = np.random.default_rng(1000 + i)
            a = jnp.asarray(rng.standard_normal((l, m, k)) * 4, jnp.float32).astype(ab)
            b = jnp.asarray(rng.standard_normal((l, n, k)) * 4, jnp.float32).astype(ab)
            kb = -(-k // 32)
            return (a, b, jnp.asarray(rng.integers(118, 137, (l, m, kb)), jnp.uint8),
                    jnp.asarray(rng.integers(118, 137, (l, n, kb)), jnp.uint8))

        op = lambda *x, c_dtype=c_dtype: jbg.gemm_amax(*x, c_dtype=jnp.dtype(c_dtype), implementation=implementation)
        jitted = jax.jit(op)
        name = f"gemm_amax L,M,N,K={l},{m},{n},{k} {ab}->{c_dtype}"
        inputs = gemm_inputs()
        cases.append((name + " jit", lambda f=jitted, x=inputs: f(*x)))
        cases.append((name + " eager", lambda f=op, x=inputs: f(*x)))
    for i, (t, h, k, mxfp8, w_out_in) in enumerate(PROJ_ROPE_CASES):
        def op(x, w, c, s, scales, w_out_in=w_out_in):
            return jbg.gemm_proj_rope_mxfp8(x, w, c, s, w_out_in=w_out_in, implementation=implementation, **scales)

        jitted = jax.jit(op)
        name = f"proj_rope T,H,K={t},{h},{k} {'mxfp8' if mxfp8 else 'bf16'} w_out_in={w_out_in}"
        operands, scales = proj_rope_arguments(
            proj_rope_inputs(jax.random.key(2000 + i), t, h, k, w_out_in=w_out_in), mxfp8)
        cases.append((name + " jit", lambda f=jitted, x=operands, s=scales: f(*x, s)))
        cases.append((name + " eager", lambda f=op, x=operands, s=scales: f(*x, s)))
    return cases


def soak(seconds: float, implementation: Any, max_device_growth: float, max_rss_growth: float) -> dict:
    """Runs passes over every case until `seconds` have passed; the result record (ok, passes, memory, errors)."""
    import jax

    device = jax.devices()[0]
    cases = make_cases(implementation)
    first: dict[str, str] = {}
    record: dict[str, Any] = dict(device=str(device), xla_flags=os.environ.get("XLA_FLAGS", ""), passes=[],
                                  errors=[], mismatches=[], cases=len(cases))
    start = time.monotonic()
    baseline = None
    while time.monotonic() - start < seconds or len(record["passes"]) < 2:
        t0 = time.monotonic()
        for name, thunk in cases:
            try:
                d = digest(jax.block_until_ready(thunk()))
            except Exception as e:  # noqa: BLE001 -- any error fails the soak; keep going to see how often
                record["errors"].append(f"pass {len(record['passes'])}: {name}: {type(e).__name__}: {e}"[:400])
                continue
            if name not in first:
                first[name] = d
            elif d != first[name]:
                record["mismatches"].append(f"pass {len(record['passes'])}: {name}: {d} != first {first[name]}")
        sample = dict(seconds=round(time.monotonic() - t0, 2), device_mib=round(device_mib(device), 1),
                      rss_mib=round(rss_mib(), 1))
        record["passes"].append(sample)
        if baseline is None:
            baseline = sample  # compilation and caches fill during the first pass
        print(f"pass {len(record['passes']):4d}: {sample['seconds']:6.2f} s, device {sample['device_mib']:9.1f} MiB, "
              f"host RSS {sample['rss_mib']:8.1f} MiB, errors {len(record['errors'])}, "
              f"mismatches {len(record['mismatches'])}", flush=True)
    last = record["passes"][-1]
    record["device_growth_mib"] = round(max(p["device_mib"] for p in record["passes"]) - baseline["device_mib"], 1)
    record["rss_growth_mib"] = round(max(p["rss_mib"] for p in record["passes"]) - baseline["rss_mib"], 1)
    record["bounds_mib"] = dict(device=max_device_growth, rss=max_rss_growth)
    record["ok"] = (not record["errors"] and not record["mismatches"] and len(record["passes"]) >= 2
                    and record["device_growth_mib"] <= max_device_growth and record["rss_growth_mib"] <= max_rss_growth)
    record["last"] = last
    return record


def main(argv: list | None = None) -> int:
    """Runs one child process per command-buffer setting (or, with --child, the soak itself); 0 when all held."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=8.0, help="total soak time over both processes")
    parser.add_argument("--out", default=None, help="directory for soak.json")
    parser.add_argument("--implementation", default="cutedsl", choices=("cutedsl", "xla", "none"))
    parser.add_argument("--max-device-growth-mib", type=float, default=64.0)
    parser.add_argument("--max-rss-growth-mib", type=float, default=256.0)
    parser.add_argument("--command-buffers", default="off,on", help="comma-separated subset of off,on")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one process's run, result as JSON
    args = parser.parse_args(argv)
    implementation = None if args.implementation == "none" else args.implementation
    if args.child:
        record = soak(args.minutes * 60, implementation, args.max_device_growth_mib, args.max_rss_growth_mib)
        pathlib.Path(args.child).write_text(json.dumps(record, indent=1))
        return 0 if record["ok"] else 1
    settings = [s for s in args.command_buffers.split(",") if s]
    out = pathlib.Path(args.out or ".")
    out.mkdir(parents=True, exist_ok=True)
    results, ok = {}, True
    for setting in settings:
        child_out = out / f"soak_{setting}.json"
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + COMMAND_BUFFERS[setting]).strip())
        print(f"--- command buffers {setting}: {env['XLA_FLAGS']}", flush=True)
        share = args.minutes / len(settings)
        proc = subprocess.run([sys.executable, __file__, "--minutes", str(share), "--implementation",
                               args.implementation, "--max-device-growth-mib", str(args.max_device_growth_mib),
                               "--max-rss-growth-mib", str(args.max_rss_growth_mib), "--child", str(child_out)],
                              env=env, timeout=share * 60 + 240)
        record = json.loads(child_out.read_text()) if child_out.exists() else dict(ok=False, errors=["no result"])
        results[setting] = record
        ok &= proc.returncode == 0 and record.get("ok", False)
    print("\nSUMMARY")
    for setting, r in results.items():
        passes = r.get("passes", [])
        print(f"command buffers {setting:3s}: {'OK  ' if r.get('ok') else 'FAIL'} {len(passes)} passes of "
              f"{r.get('cases', '?')} cases, errors {len(r.get('errors', []))}, mismatches "
              f"{len(r.get('mismatches', []))}, device growth {r.get('device_growth_mib')} MiB "
              f"(bound {args.max_device_growth_mib}), host RSS growth {r.get('rss_growth_mib')} MiB "
              f"(bound {args.max_rss_growth_mib})" + (f"; first error: {r['errors'][0]}" if r.get("errors") else ""))
    (out / "soak.json").write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
