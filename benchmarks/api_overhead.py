"""Where the time between a kernel's CUDA events and a jitted API call goes (issue 10: API within 5% of events).

    python3 benchmarks/api_overhead.py [--reps 30] [--json FILE]

For each case it times the jitted call two ways, on the same inputs (rotating among 3 sets):
  single:    median wall time of one call ended by block_until_ready (what bench.py reports);
  pipelined: wall time of 20 calls issued back to back and one block_until_ready, divided by 20: the host's
             dispatch overlaps the device, so this approaches the device time per call.
single − pipelined is per-call latency (dispatch, launch, sync), which every column of bench.py pays alike.
At 128³ the kernel itself takes microseconds, so those rows show the fixed cost of one call of each path.
"""

from __future__ import annotations

import argparse
import json
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import jax_blockgemm as jbg
from jax_blockgemm import bench, dispatch
from jax_blockgemm.kernels import catalog


GEMM, PROJ_ROPE = (8192, 8192, 8192), (4096, 128, 1536)  # the SPEC §8 / DeepSeek-V3 sizes


def single_ms(fn, arg_sets, reps: int) -> float:
    return bench.median_ms(fn, arg_sets, warmup=3, reps=reps)


def pipelined_ms(fn, arg_sets, reps: int, burst: int = 20) -> float:
    """Median over `reps // 5` bursts of the wall time of `burst` back-to-back calls, per call."""
    return bench.median_ms(fn, arg_sets, warmup=1, reps=max(3, reps // 5), burst=burst)


def gemm_cases(m: int, n: int, k: int):
    inputs = [bench.gemm_inputs(jax.random.key(i), m, n, k) for i in range(3)]
    sets = [tuple(x[name] for name in ("a", "b", "sfa_atom", "sfb_atom")) for x in inputs]
    dot_sets = [(x["a_bf16"], x["b_bf16"]) for x in inputs]
    yield f"gemm_amax {m}x{n}x{k} kernel", jax.jit(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl")), sets
    yield f"gemm_amax {m}x{n}x{k} reference", jax.jit(lambda *x: jbg.gemm_amax(*x, implementation="xla")), sets
    yield (f"bf16 dot {m}x{n}x{k}", jax.jit(lambda a, b: jax.lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)), dot_sets)


def proj_rope_cases(t: int, h: int, k: int):
    sets = []
    for i in range(3):
        inp = bench.proj_rope_inputs(jax.random.key(10 + i), t, h, k)
        sets.append((inp["x_bf16"], inp["w_bf16"], inp["cos"], inp["sin"]))
    kernel = jax.jit(lambda *x: jbg.gemm_proj_rope_mxfp8(*x, implementation="cutedsl"))
    yield f"proj_rope T={t} H={h} K={k} kernel", kernel, sets
    for v in catalog.variants_for("sm_90a", "proj_rope"):  # each tile, cluster and schedule, patched in to compile
        if v.b_major != "k":
            continue
        with mock.patch.dict(dispatch.PROJ_ROPE_TILE, {"sm_90a": v.tile_mn}), \
                mock.patch.dict(dispatch.PROJ_ROPE_CLUSTER, {"sm_90a": v.cluster_mn}), \
                mock.patch.dict(dispatch.PROJ_ROPE_SCHEDULE, {"sm_90a": v.schedule}):
            try:
                compiled = kernel.lower(*sets[0]).compile()
            except Exception:  # noqa: BLE001 -- no kernel here (CPU): the plain kernel row already says why
                continue
        yield (f"proj_rope T={t} H={h} K={k} {v.tile_mn[0]}x{v.tile_mn[1]} c{v.cluster_mn[0]}"
               + (f" {v.schedule}" if v.schedule else ""), compiled, sets)
    yield (f"bf16 dot T={t} N={h * 192} K={k}", jax.jit(lambda x, w: jax.lax.dot_general(
        x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)), [s[:2] for s in sets])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--json", default=None)
    parser.add_argument("--small", action="store_true", help="small sizes (a quick check of the script)")
    parser.add_argument("--only", choices=("gemm_amax", "proj_rope"), default=None, help="one operation's cases")
    args = parser.parse_args()
    global GEMM, PROJ_ROPE
    if args.small:
        GEMM, PROJ_ROPE = (256, 256, 256), (128, 2, 256)
    rows = []
    groups = []
    if args.only in (None, "gemm_amax"):
        groups += [gemm_cases(*GEMM), gemm_cases(128, 128, 128)]
    if args.only in (None, "proj_rope"):
        groups += [proj_rope_cases(*PROJ_ROPE), proj_rope_cases(PROJ_ROPE[0] // 2, *PROJ_ROPE[1:]),
                   proj_rope_cases(32, 1, 64)]
    print(f"{'case':40s} {'single ms':>10s} {'pipelined ms':>13s} {'latency ms':>11s}", flush=True)
    for group in groups:
        for name, fn, sets in group:
            try:
                s, p = single_ms(fn, sets, args.reps), pipelined_ms(fn, sets, args.reps)
            except Exception as e:  # noqa: BLE001 -- a path that cannot run here is reported, the rest still run
                print(f"{name:40s} not run: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                continue
            rows.append(dict(case=name, single_ms=s, pipelined_ms=p))
            print(f"{name:40s} {s:10.4f} {p:13.4f} {s - p:11.4f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
