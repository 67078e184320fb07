"""--launch: what a gemm_amax call costs beyond its math, on a tiny problem.

The first call in a fresh process (trace, kernel object, XLA compile, load, run) with an empty and with a warm
kernel cache, and the per-call cost of back-to-back calls beside a trivial XLA op timed the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Any

import jax

import jax_blockgemm as jbg
from jax_blockgemm import kernel_cache
from jax_blockgemm.bench.columns import NotAvailable
from jax_blockgemm.bench.inputs import gemm_inputs, random_values
from jax_blockgemm.bench.timing import per_call_us

LAUNCH_SHAPE = (128, 128, 128)
IMPLEMENTATIONS = {"ours": None, "ours_cutedsl": "cutedsl"}  # column key -> `implementation`
_OPERANDS = ("a", "b", "sfa_atom", "sfb_atom")

# Run by `first_call_ms` in a fresh interpreter: prints the first call's ms, or "n/a <reason>".
_FIRST_CALL = """
import sys, time
import jax
import jax_blockgemm as jbg
from jax_blockgemm.bench import inputs, launch
m, n, k = launch.LAUNCH_SHAPE
args = inputs.gemm_inputs(jax.random.key(1), m, n, k)
args = [args[name] for name in launch._OPERANDS]
jax.block_until_ready(args)
implementation = launch.IMPLEMENTATIONS[sys.argv[1]]
start = time.perf_counter()
try:
    jax.block_until_ready(jax.jit(lambda *x: jbg.gemm_amax(*x, implementation=implementation))(*args))
except ValueError as e:
    print("n/a", e)
else:
    print((time.perf_counter() - start) * 1e3)
"""


def first_call_ms(column: str, cache_dir: str) -> float:
    """ms of the first jitted gemm_amax call in a fresh process: trace, kernel object, XLA compile, load, run."""
    env = dict(os.environ, **{kernel_cache.CACHE_DIR_ENV: cache_dir})
    proc = subprocess.run([sys.executable, "-c", _FIRST_CALL, column], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"the first-call process for {column} failed:\n{proc.stderr[-2000:]}")
    out = proc.stdout.strip().splitlines()[-1]
    if out.startswith("n/a"):
        raise NotAvailable(out[4:])
    return float(out)


def launch_costs(*, calls: int = 2000) -> dict[str, Any]:
    """First-call latency (empty and warm kernel cache, fresh processes) and per-call cost of a tiny gemm_amax,
    beside a trivial XLA op in the same loop."""
    m, n, k = LAUNCH_SHAPE
    operands = gemm_inputs(jax.random.key(1), m, n, k)
    args = tuple(operands[name] for name in _OPERANDS)
    result: dict[str, Any] = {"shape": list(LAUNCH_SHAPE), "calls": calls}
    for column, implementation in IMPLEMENTATIONS.items():
        try:
            with tempfile.TemporaryDirectory() as cache:
                cold, warm = first_call_ms(column, cache), first_call_ms(column, cache)
            fn = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation=implementation))
            result[column] = {"first_call_cold_ms": cold, "first_call_warm_cache_ms": warm,
                              "per_call_us": per_call_us(fn, args, calls)}
        except NotAvailable as e:
            result[column] = {"na": str(e)}
    plain = jax.jit(lambda x: x * 2.0 + 1.0)
    result["plain_xla_op_us"] = per_call_us(plain, (random_values(jax.random.key(2), (m, n)),), calls)
    return result
