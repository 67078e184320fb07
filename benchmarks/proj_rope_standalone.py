"""Device script: check the Hopper gemm_proj_rope_mxfp8 kernel against the float64 oracle, then time it.

Runs the kernel straight through CuTeDSL's JIT launch (no FFI), on torch tensors through DLPack, so it isolates the
kernel from the bridge. Outputs are poisoned (codes 0xFF = E4M3 NaN, scales 0xFE) before every launch. Beside the
kernel, in the same run: XLA's bare bf16 dot of the same shape (both weight layouts) and the library's reference.

    python3 benchmarks/proj_rope_standalone.py [--quick] [--no-bench] [--out DIR] [--consumer-wgs pp,2,1] [--profile]

--consumer-wgs picks the kernels: "1" / "2" consumer warpgroups per CTA (one tile per CTA), "ps" the persistent
cooperative kernel (128-token tiles), "pp" the persistent
ping-pong schedule (two consumer warpgroups on alternate 64-token tiles); the ping-pong kernel is also checked on
PINGPONG_CHECK_SHAPES, where CTAs get 2-3 tiles. --profile also times each kernel with one phase left out
(PROFILE_SKIPS: the wgmmas, the whole epilogue, the code tiles' global stores, the rowwise or the columnwise
quantization with its stores; for the staged kernel STAGED_PROFILE_SKIPS: the wgmmas, the whole epilogue, all of
the mainloop but one k-tile per tile, the epilogue's global stores, or the MMA warpgroups' writes of Y); those
results are wrong by design and are not checked. Kernel times are CUDA events around bursts of BURST launches (host launch cost hidden).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import unittest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import oracle_ops  # noqa: E402

from jax_blockgemm.support import HEAD_DIM, QK_ROPE  # noqa: E402

CHECK_SHAPES = [(32, 1, 64), (96, 3, 136), (160, 2, 520), (256, 5, 1536), (1000 // 32 * 32, 7, 1024)]
BENCH_SHAPES = [(2048, 128, 1536), (4096, 128, 1536)]
# More tiles than the 132 persistent CTAs: 297 (half tail tile, fewer k-tiles than stages), 264 (one k-tile, k tail).
PINGPONG_CHECK_SHAPES = [(2080, 9, 200), (8448, 2, 40)]
PROFILE_SKIPS = ("mma", "epilogue", "stores", "rowwise", "columnwise")
STAGED_PROFILE_SKIPS = ("mma", "epilogue", "mainloop", "stores", "ywrite")
BURST = 10


class Runner:
    """Compiles the kernel for one weight layout for the local GPU and launches it on torch tensors."""

    def __init__(self, w_major: str, consumer_wgs: int | str = 2, skip: frozenset = frozenset()):
        import cuda.bindings.driver as cuda
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_compact_tensor

        from jax_blockgemm.kernels.sm90.proj_rope import STAGED_TILE_K, HopperProjRope

        self.cute, self.cutlass, self.cuda = cute, cutlass, cuda
        # "1k32": one consumer warpgroup, 32-wide k-tiles
        kind, _, tile_k = str(consumer_wgs).partition("k")
        # no suffix: the staged kernel takes the catalog's k-tile for this W layout, the others 64
        tile_k = int(tile_k) if tile_k else STAGED_TILE_K[w_major] if kind in ("st", "st-nopdl") else 64
        if kind in ("pp", "ps", "st", "st-nopdl"):  # st-nopdl: staged without programmatic dependent launch
            schedule = {"pp": "pingpong", "ps": "persistent", "st": "staged", "st-nopdl": "staged"}[kind]
            self.kernel = HopperProjRope(w_major=w_major, schedule=schedule, tile_k=tile_k, pdl=kind == "st")
            self.label = schedule + (" no-pdl" if kind == "st-nopdl" else "")
        else:
            self.kernel = HopperProjRope(w_major=w_major, consumer_wgs=int(kind), tile_k=tile_k)
            self.label = f"{kind}wg"
        if tile_k != 64:
            self.label += f" k{tile_k}"
        self.kernel._skip = frozenset(skip)  # profiling only: phases left out
        if skip:
            self.label += " no-" + "+".join(sorted(skip))
        flat = lambda dt: make_fake_compact_tensor(dt, (cute.sym_int64(),), assumed_align=16)
        bf, u8 = cutlass.BFloat16, cutlass.Uint8
        t0 = time.perf_counter()
        self.compiled = cute.compile(self.kernel, flat(bf), flat(bf), flat(bf), flat(bf), flat(u8), flat(u8),
                                     flat(u8), flat(u8), flat(u8), flat(u8), cutlass.Int32(32), cutlass.Int32(64),
                                     cutlass.Int32(1), cutlass.Int32(132), cuda.CUstream(0))
        self.compile_s = time.perf_counter() - t0

    def wrap(self, x, dtype):
        from cutlass.cute.runtime import from_dlpack

        w = from_dlpack(x, assumed_align=16)
        w.element_type = dtype
        return w

    def bind(self, x, w, cos, sin, outs, t, k, h):
        """A no-argument launch of the kernel on these tensors (wrapped once, so a timed launch is only the launch)."""
        import torch

        ok, why = self.kernel.can_implement(t, k, h)
        assert ok, why
        c = self.cutlass
        stream = self.cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        bf = [self.wrap(v, c.BFloat16) for v in (x, w, cos, sin)]
        u8 = [self.wrap(v, c.Uint8) for v in (outs[0], outs[0], *outs)]  # x_scale/w_scale unused on bf16
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        args = (*bf, *u8, c.Int32(t), c.Int32(k), c.Int32(h), c.Int32(sms), stream)
        return lambda: self.compiled(*args)

    def __call__(self, x, w, cos, sin, outs, t, k, h):
        self.bind(x, w, cos, sin, outs, t, k, h)()


def to_dev(a: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8).reshape(-1).copy()).cuda()


def bf16_dev(a: np.ndarray):
    import torch

    return to_dev(a).view(torch.bfloat16)


def run_once(runner: Runner, inp: dict, t: int, k: int, h: int):
    """Poisoned outputs, one launch, outputs back as (row codes, row scales, col codes, col scales) NumPy arrays."""
    import ml_dtypes
    import torch

    sizes = (t * h * HEAD_DIM, t * h * 6, t * h * HEAD_DIM, (t // 32) * h * HEAD_DIM)
    outs = [torch.full((s,), v, dtype=torch.uint8, device="cuda") for s, v in zip(sizes, (0xFF, 0xFE, 0xFF, 0xFE))]
    runner(bf16_dev(inp["x"]), bf16_dev(inp["w"]), bf16_dev(inp["cos"]), bf16_dev(inp["sin"]), outs, t, k, h)
    torch.cuda.synchronize()
    o = [v.cpu().numpy() for v in outs]
    return (o[0].view(ml_dtypes.float8_e4m3fn).reshape(t, h, HEAD_DIM), o[1].reshape(t, h, 6),
            o[2].view(ml_dtypes.float8_e4m3fn).reshape(t, h, HEAD_DIM), o[3].reshape(t // 32, h, HEAD_DIM))


class _Check(unittest.TestCase):
    def runTest(self):  # pragma: no cover - only a carrier for the assert helpers
        pass


def check(runner: Runner, w_out_in: bool, shape: tuple, rng, tables: str) -> dict:
    t, h, k = shape
    inp = oracle_ops.random_proj_rope_inputs(rng, t=t, h=h, k=k, mxfp8=False, w_out_in=w_out_in)
    if tables == "yarn":
        inp["cos"], inp["sin"] = oracle_ops.rotary_tables(t)
    outs = run_once(runner, inp, t, k, h)
    heads = list(range(h)) if h <= 8 else sorted(rng.choice(h, size=3, replace=False).tolist())
    y_ref = oracle_ops.proj_rope_oracle(inp["x"], inp["w"], inp["cos"], inp["sin"], w_out_in=w_out_in, heads=heads)
    outs = [o[:, heads] for o in outs]
    res = dict(w_out_in=w_out_in, shape=shape, tables=tables, heads=heads)
    try:
        oracle_ops.assert_proj_rope_close(_Check(), outs, y_ref)
        res["ok"] = True
    except AssertionError as e:
        res["ok"], res["error"] = False, str(e)[:600]
    res["row_identical"] = float(np.mean(outs[0].astype(np.float32) == oracle_quant(y_ref, 2)))
    res["col_identical"] = float(np.mean(outs[2].astype(np.float32) == oracle_quant(y_ref, 0)))
    return res


def oracle_quant(y_ref: np.ndarray, axis: int) -> np.ndarray:
    import ml_dtypes

    import oracle

    codes, _ = oracle.quantize_mx_f64(y_ref, block=32, emax=448.0, code_dtype=ml_dtypes.float8_e4m3fn, axis=axis)
    return codes.astype(np.float32)


def check_special(runner: Runner, w_out_in: bool, rng) -> dict:
    """NaN, inf and zero tokens: their row blocks, and the column blocks they fall in, follow SPEC §2 exactly."""
    t, h, k = 96, 2, 64
    inp = oracle_ops.random_proj_rope_inputs(rng, t=t, h=h, k=k, mxfp8=False, w_out_in=w_out_in)
    x = inp["x"].astype(np.float32)
    x[5, 3] = np.nan  # token 5: all-NaN Y -> every block of token 5 and column block 0 is 0xFF, codes 0
    x[40, :] = 0.0  # token 40: zero Y -> row scales byte 0, codes 0; column block 1 unaffected
    x[70, 7] = np.inf  # token 70: inf -> NaN/inf Y
    import ml_dtypes

    inp["x"] = x.astype(ml_dtypes.bfloat16)
    rc, rs, cc, cs = run_once(runner, inp, t, k, h)
    ok = bool((rs[5] == 0xFF).all() and (rs[70] == 0xFF).all() and (rs[40] == 0).all())
    ok &= bool((rc[[5, 40, 70]].astype(np.float32) == 0).all())
    ok &= bool((cs[0] == 0xFF).all() and (cs[2] == 0xFF).all() and (cs[1] != 0xFF).all())
    ok &= bool((cc[:32].astype(np.float32) == 0).all() and (cc[64:].astype(np.float32) == 0).all())
    ok &= not bool(np.isnan(rc.astype(np.float32)).any() or np.isnan(cc.astype(np.float32)).any())
    finite = [i for i in range(t) if i not in (5, 40, 70)]
    ok &= bool((rs[finite] != 0xFF).all() and (rs[finite] != 0xFE).all())
    return dict(w_out_in=w_out_in, shape=(t, h, k), tables="special", ok=ok)


def median_ms(fn, reps: int) -> float:
    """Median over `reps` of CUDA-event time per launch, timed over bursts of BURST back-to-back launches."""
    return interleaved_medians_ms([fn], reps)[0]


def interleaved_medians_ms(fns: list, reps: int) -> list:
    """`median_ms` of several launches at once: each round times one burst of each, in a fresh shuffled order, so
    that an A/B of two kernels meets the GPU in the same thermal state and neither always runs after the other
    (benchmarks/RESULTS.md, 2026-11-30 16:00: in a fixed order the column after the heaviest ran 3% slow)."""
    import torch

    for fn in fns:
        for _ in range(3):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    order = np.random.default_rng(0)
    for _ in range(reps):
        for j in order.permutation(len(fns)):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(BURST):
                fns[j]()
            b.record()
            b.synchronize()
            times[j].append(a.elapsed_time(b) / BURST)
    return [statistics.median(t) for t in times]


def bench(runners: dict, reps: int) -> list:
    import jax
    import jax.numpy as jnp
    import torch

    import jax_blockgemm as jbg

    rows = []
    for t, h, k in BENCH_SHAPES:
        n = h * HEAD_DIM
        rng = np.random.default_rng(3)
        launches, names = [], []
        for (w_out_in, _), runner in runners.items():  # every kernel's samples interleaved: a fair A/B
            inp = oracle_ops.random_proj_rope_inputs(rng, t=t, h=h, k=k, mxfp8=False, w_out_in=w_out_in)
            args = [bf16_dev(inp[n_]) for n_ in ("x", "w", "cos", "sin")]
            sizes = (t * n, t * h * 6, t * n, (t // 32) * n)
            outs = [torch.empty((s,), dtype=torch.uint8, device="cuda") for s in sizes]
            launches.append(runner.bind(*args, outs, t, k, h))
            names.append(f"kernel {runner.label} w_out_in={w_out_in}")
        for name, ms in zip(names, interleaved_medians_ms(launches, reps)):
            rows.append(dict(what=name, t=t, ms=ms, tflops=2 * t * n * k / ms / 1e9))
        # cuBLAS through torch, timed like the kernel (CUDA events over bursts): the dot's device time
        xt = torch.randn((t, k), device="cuda", dtype=torch.bfloat16)
        wt = torch.randn((n, k), device="cuda", dtype=torch.bfloat16) / 40
        for name, f in (("torch bf16 matmul x.w^T, events", lambda: torch.matmul(xt, wt.t())),
                        ("torch bf16 matmul x.w (K,N), events", lambda wk=wt.t().contiguous(): torch.matmul(xt, wk))):
            ms = median_ms(f, reps)
            rows.append(dict(what=name, t=t, ms=ms, tflops=2 * t * n * k / ms / 1e9))
        # XLA baselines, same shapes: bare bf16 dot (both layouts) and the library reference
        x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
        w_nk = jnp.asarray(rng.standard_normal((n, k)) / 40, jnp.bfloat16)
        w_kn = jnp.asarray(np.asarray(w_nk, np.float32).T, jnp.bfloat16)
        ang = rng.uniform(-3, 3, (t, QK_ROPE))
        cos, sin = jnp.asarray(np.cos(ang), jnp.bfloat16), jnp.asarray(np.sin(ang), jnp.bfloat16)
        cases = {
            "XLA bf16 dot, w (N,K)": (jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32)
                                              .astype(jnp.bfloat16)), (x, w_nk)),
            "XLA bf16 dot, w (K,N)": (jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
                                              .astype(jnp.bfloat16)), (x, w_kn)),
            "reference (xla)": (jax.jit(lambda x, w, c, s: jbg.gemm_proj_rope_mxfp8(x, w, c, s,
                                                                                    implementation="xla")),
                                (x, w_nk, cos, sin)),
        }
        for name, (f, a) in cases.items():
            jax.block_until_ready(f(*a))
            times = []
            for _ in range(reps + 3):
                t0 = time.perf_counter()
                jax.block_until_ready(f(*a))
                times.append((time.perf_counter() - t0) * 1e3)
            ms = statistics.median(times[3:])
            rows.append(dict(what=name, t=t, ms=ms, tflops=2 * t * n * k / ms / 1e9))
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1, help="time everything this many times over (drift shows)")
    p.add_argument("--out", default=None)
    p.add_argument("--consumer-wgs", default="2",
                   help="comma-separated kernels to check and time: 1, 2 (consumer warpgroups), pp (ping-pong), "
                        "ps (persistent), st (staged); a suffix k32 / k64 takes 32- / 64-wide k-tiles (the "
                        "default: st as the catalog, STAGED_TILE_K; the others 64), e.g. 1k32")
    p.add_argument("--profile", action="store_true",
                   help="also time each kernel (w_out_in=True) with one phase left out (not checked)")
    args = p.parse_args()
    runners, profiled = {}, {}
    for wgs in args.consumer_wgs.split(","):
        for w_out_in in (True, False):
            r = runners[(w_out_in, wgs)] = Runner("k" if w_out_in else "n", wgs)
            print(f"compiled {wgs}wg w_out_in={w_out_in} in {r.compile_s:.1f} s", file=sys.stderr, flush=True)
        skips = STAGED_PROFILE_SKIPS if wgs.startswith("st") else PROFILE_SKIPS
        for phase in skips if args.profile else ():
            r = profiled[(True, f"{wgs} no-{phase}")] = Runner("k", wgs, frozenset({phase}))
            print(f"compiled {r.label} in {r.compile_s:.1f} s", file=sys.stderr, flush=True)
    rng = np.random.default_rng(int(time.time()))
    results = []
    shapes = [] if args.no_check else CHECK_SHAPES[:2] if args.quick else CHECK_SHAPES
    for (w_out_in, wgs), runner in runners.items():
        multi_tile = PINGPONG_CHECK_SHAPES if wgs[:2] in ("pp", "ps", "st") and not args.no_check else []
        for shape in shapes + multi_tile:
            for tables in ("random", "yarn"):
                r = dict(check(runner, w_out_in, shape, rng, tables), wgs=wgs)
                results.append(r)
                print(f"check {r}", file=sys.stderr, flush=True)
        if args.no_check:
            continue
        r = dict(check_special(runner, w_out_in, rng), wgs=wgs)
        results.append(r)
        print(f"check {r}", file=sys.stderr, flush=True)
    if not (args.quick or args.no_check):
        r = check(next(iter(runners.values())), True, (4096, 128, 1536), rng, "yarn")
        results.append(r)
        print(f"check {r}", file=sys.stderr, flush=True)
    rows = [] if args.no_bench else [dict(r, round=i) for i in range(args.rounds)
                                     for r in bench({**runners, **profiled}, args.reps)]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "proj_rope_standalone.json"), "w") as f:
            json.dump(dict(checks=results, bench=rows), f, indent=1, default=str)
    print(f"\nchecks: {sum(r['ok'] for r in results)}/{len(results)} passed")
    for r in results:
        if not r["ok"]:
            print("FAILED", r)
    for r in rows:
        print(f"{r['what']:<30} T={r['t']:<5} {r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s  round {r['round']}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
