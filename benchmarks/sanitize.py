"""compute-sanitizer (memcheck, racecheck, synccheck) over every Hopper kernel variant, and the handler fuzz test.

Usage, on an sm_90a GPU (H100, H200) from the repository root:

    python3 benchmarks/sanitize.py [--out DIR] [--tools memcheck,racecheck,synccheck] [--all-kernels]

It first compiles every sm_90a object (--jobs processes at once), then starts, all at once, one process per tool
under `compute-sanitizer --tool <tool>` that runs every sm_90a gemm_amax variant of the kernel catalog through
`jbg.gemm_amax(..., implementation="cutedsl")` at small odd shapes (tails in M, N and K, partial scale blocks,
L > 1) and every sm_90a proj_rope variant (tiles, clusters and weight layouts, bf16 and MXFP8 inputs, token and k
tails), checks each result against the reference (`implementation="xla"`), and brackets each variant with markers
so that every sanitizer report is attributed to the variant that caused it; beside them, a fourth process runs
tests/test_gpu_handler_fuzz.py (the raw-ffi_call cases) under memcheck. Under memcheck one variant takes about 5 s
on an H200, so the whole catalog needs about 6 minutes; --budget bounds the whole run. It prints one summary line per
tool x variant (and one for the fuzz run), writes the full logs to --out, and exits non-zero when any line is not OK.

racecheck and synccheck instrument only our kernels (`--kernel-name kns=jax_blockgemm`; the kernel symbols carry
the module path), which keeps the run short; --all-kernels instruments XLA's kernels too.
compute-sanitizer is taken from $COMPUTE_SANITIZER, PATH, /usr/local/cuda/bin, or an installed
nvidia-cuda-sanitizer-api wheel (nvidia/cu13 or nvidia/cu12 under any sys.path entry).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

TOOLS = ("memcheck", "racecheck", "synccheck")
# (L, M, N, K): M and N tails past 128-row tiles and scale atoms, K a partial 128-wide k-tile with a partial
# 32-wide scale block (K = 80, 208), L > 1; N a multiple of 8 (16-byte rows of a bfloat16 C).
SHAPES = ((2, 257, 136, 80), (3, 129, 24, 208))
# proj_rope (T, H, K): T a tail of the 128- and 64-token tiles, K a tail of the 64-wide k-tile, H odd.
PROJ_ROPE_SHAPES = ((96, 3, 160), (160, 1, 96))
# FP4 variants: K a multiple of 32 (16-byte rows of packed codes), N of 32 (packed FP4 C rows); tails as above.
FP4_SHAPES = ((2, 257, 160, 96), (3, 129, 32, 224))
# MN-major variants: M and N multiples of 16 (16-byte rows of MN-major codes); K, M tails as above.
MN_SHAPES = ((2, 272, 144, 80), (3, 128, 32, 208))
# Relative Frobenius error allowed against the reference, per C dtype: the kernels are in SPEC §7's exact class,
# so these only absorb C's own rounding (one code step of a narrow C where kernel and reference round apart).
_C_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 1e-2, "float8_e4m3fn": 0.07, "float8_e5m2": 0.13,
                "float4_e2m1fn": 0.3}
BEGIN, END = "@@JBG-SANITIZE BEGIN", "@@JBG-SANITIZE END"
# A sanitizer report line (its stack frames and blank lines are not counted).
_REPORT = re.compile(r"^=+ (Invalid|Error|Warning|Program hit|Race|Barrier|Uninitialized|Leaked|Malformed|"
                     r"Unused|Misaligned|Out-of-range|.*hazard)", re.IGNORECASE)
_ROOT = pathlib.Path(__file__).resolve().parents[1]


def find_sanitizer() -> str | None:
    """Path of the compute-sanitizer executable, or None."""
    candidates = [os.environ.get("COMPUTE_SANITIZER"), shutil.which("compute-sanitizer"),
                  "/usr/local/cuda/bin/compute-sanitizer"]
    for root in sys.path:
        for cuda in ("cu13", "cu12"):
            candidates.append(os.path.join(root or ".", "nvidia", cuda, "compute-sanitizer", "compute-sanitizer"))
        candidates.append(os.path.join(root or ".", "nvidia", "cuda_sanitizer_api", "compute-sanitizer",
                                       "compute-sanitizer"))
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def _mine(case: int, shard: tuple[int, int]) -> bool:
    """Whether case number `case` (counted over every gemm_amax, then proj_rope case) belongs to `shard` = (i, n)."""
    return case % shard[1] == shard[0]


def _on_cpu(*arrays):
    """The arrays on the host CPU device: the references run there, outside the sanitizer's instrumentation (an XLA
    GPU compile with its autotuning under racecheck took minutes)."""
    import jax

    return [jax.device_put(a, jax.devices("cpu")[0]) for a in arrays]


def _selected(variants, keys: frozenset):
    """`variants` restricted to the catalog keys `keys` (all when empty)."""
    return [v for v in variants if not keys or v.key in keys]


def run_variants(shard: tuple[int, int] = (0, 1), first_shape_only: bool = False, keys: frozenset = frozenset()) -> int:
    """The workload run under the sanitizer: every sm_90a variant at SHAPES (or only the first, which has tails in
    every dimension and L > 1), each bracketed by markers; this process runs the cases of `shard`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_blockgemm as jbg
    from jax_blockgemm import dispatch
    from jax_blockgemm.kernels import catalog

    rng = np.random.default_rng(2026)
    failures = 0
    case = -1
    for variant in _selected(catalog.variants_for("sm_90a", "gemm_amax"), keys):
        fp4 = variant.ab_dtype == "float4_e2m1fn"
        mn_major = (variant.a_major, variant.b_major) != ("k", "k")
        shapes = FP4_SHAPES if fp4 else MN_SHAPES if mn_major else SHAPES
        for l, m, n, k in shapes[:1] if first_shape_only else shapes:
            case += 1
            if not _mine(case, shard):
                continue
            label = f"{variant.key} (L, M, N, K) = {(l, m, n, k)}"
            print(f"{BEGIN} {label}", flush=True)
            kb = -(-k // variant.sf_vec_size)
            if fp4:  # packed E2M1 pairs, every nibble
                a = jnp.asarray(rng.integers(0, 256, (l, m, k // 2)), jnp.uint8)
                b = jnp.asarray(rng.integers(0, 256, (l, n, k // 2)), jnp.uint8)
            else:
                ab = jnp.dtype(variant.ab_dtype)
                a = jnp.asarray(rng.standard_normal((l, m, k)) * 4, jnp.float32).astype(ab)
                b = jnp.asarray(rng.standard_normal((l, n, k)) * 4, jnp.float32).astype(ab)
            if variant.sf_dtype == "float8_e4m3fn":  # NVFP4: positive E4M3 scales, and alpha
                sfa, sfb = (jnp.asarray(np.exp2(rng.uniform(-3, 1, (l, mn, kb))), jnp.float32).astype(
                    jnp.float8_e4m3fn) for mn in (m, n))
            else:  # f16 C: smaller scales, so that C stays below float16's 65504
                lo, hi = (114, 124) if variant.c_dtype == "float16" else (120, 134)
                sfa = jnp.asarray(rng.integers(lo, hi, (l, m, kb)), jnp.uint8)
                sfb = jnp.asarray(rng.integers(lo, hi, (l, n, kb)), jnp.uint8)
            options = dict(c_dtype=jnp.dtype(variant.c_dtype), mma_tiler_mn=variant.tile_mn,
                           cluster_shape_mn=variant.cluster_mn, sf_vec_size=variant.sf_vec_size,
                           a_major=variant.a_major, b_major=variant.b_major)
            if variant.a_major == "m":  # the operands as the variant reads them: (L, K, M) / (L, K, N)
                a = jnp.swapaxes(a, 1, 2)
            if variant.b_major == "n":
                b = jnp.swapaxes(b, 1, 2)
            if variant.sf_dtype == "float8_e4m3fn":
                options["alpha"] = jnp.float32(0.375)
            try:
                kernel = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl", **options))
                with dispatch.forced_variants((variant,)):  # exactly this variant, whatever the default is
                    if variant.function_prefix not in kernel.lower(a, b, sfa, sfb).as_text():
                        raise RuntimeError(f"the program holds no jbg_gemm_amax custom call with "
                                           f"{variant.function_prefix}: this variant would not run")
                    c, amax = jax.block_until_ready(kernel(a, b, sfa, sfb))
                c_ref, amax_ref = jbg.gemm_amax(*_on_cpu(a, b, sfa, sfb), implementation="xla", **options)
                got, want = (np.asarray(jbg.formats.unpack_fp4(x) if variant.c_dtype == "float4_e2m1fn" else x,
                                        np.float64) for x in (c, c_ref))
                rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
                tol = _C_TOLERANCE.get(variant.c_dtype, 1e-2)  # SPEC §7 class; narrower C: its rounding
                ok = bool(np.isfinite(got).all() and rel <= tol
                          and abs(float(amax) - float(amax_ref)) <= 1e-4 * abs(float(amax_ref)))
                detail = f"rel_err={rel:.2e} amax={float(amax):.6g} ref={float(amax_ref):.6g}"
            except Exception as e:  # noqa: BLE001 -- reported in the summary, the next variant still runs
                ok, detail = False, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            failures += not ok
            print(f"{END} {label} {'match' if ok else 'MISMATCH'} {detail}", flush=True)
    return (1 if failures else 0) | run_proj_rope_variants(case + 1, shard, first_shape_only, keys)


def run_proj_rope_variants(case0: int, shard: tuple[int, int], first_shape_only: bool,
                           keys: frozenset = frozenset()) -> int:
    """Every sm_90a proj_rope variant (tile x weight layout) at PROJ_ROPE_SHAPES, both input paths (the same values
    as MXFP8 and as bf16: `bench.inputs.proj_rope_inputs`; or only the first shape, bf16 in), bracketed; cases are
    numbered from `case0`. The MXFP8 cases also run the dequantize kernel (`jbg_dequantize_mxfp8`) before the bf16
    one."""
    import jax
    import numpy as np

    import jax_blockgemm as jbg
    from jax_blockgemm import dispatch
    from jax_blockgemm.bench.inputs import proj_rope_arguments, proj_rope_inputs
    from jax_blockgemm.kernels import catalog

    failures = 0
    for n, variant in enumerate(_selected(catalog.variants_for("sm_90a", "proj_rope"), keys)):
        w_out_in = variant.b_major == "k"
        cases = [((0, PROJ_ROPE_SHAPES[0]), False)] if first_shape_only else itertools.product(
            enumerate(PROJ_ROPE_SHAPES), (False, True))
        for (s, (t, h, k)), mxfp8 in cases:
            case0 += 1
            if not _mine(case0 - 1, shard):
                continue
            label = f"{variant.key} {'mxfp8' if mxfp8 else 'bf16'} (T, H, K) = {(t, h, k)}"
            print(f"{BEGIN} {label}", flush=True)
            seed = 2026 + len(PROJ_ROPE_SHAPES) * n + s  # both paths of a shape: the same values
            (x, w, cos, sin), options = proj_rope_arguments(
                proj_rope_inputs(jax.random.key(seed), t, h, k, w_out_in=w_out_in), mxfp8)
            try:
                call = lambda impl, opts: jax.jit(lambda *a: jbg.gemm_proj_rope_mxfp8(
                    *a, w_out_in=w_out_in, implementation=impl, **opts))
                kernel = call("cutedsl", options)
                with dispatch.forced_variants((variant,)):  # this variant's tile, cluster and schedule
                    if "jbg_gemm_proj_rope_mxfp8" not in kernel.lower(x, w, cos, sin).as_text():
                        raise RuntimeError("the program holds no proj_rope custom call: the kernel would not run")
                    got = [np.asarray(o) for o in jax.block_until_ready(kernel(x, w, cos, sin))]
                cpu_options = dict(zip(options, _on_cpu(*options.values())))
                want = [np.asarray(o) for o in call("xla", cpu_options)(*_on_cpu(x, w, cos, sin))]
                # Codes may differ by one E4M3 step where fp32 summation orders round differently (SPEC §7).
                differ = [float(np.mean(g.view(np.uint8) != r.view(np.uint8))) for g, r in zip(got, want)]
                ok = max(differ) <= 0.01
                detail = "bytes differing (row codes, row scales, col codes, col scales): " + ", ".join(
                    f"{d:.2%}" for d in differ)
            except Exception as e:  # noqa: BLE001 -- reported in the summary, the next variant still runs
                ok, detail = False, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            failures += not ok
            print(f"{END} {label} {'match' if ok else 'MISMATCH'} {detail}", flush=True)
    return 1 if failures else 0


_END_LINE = re.compile(re.escape(END) + r" (.*?\)) (match|MISMATCH) ?(.*)$")


def _attribute(log: str) -> tuple[dict, list, str]:
    """Reports per variant label, reports outside any variant, and the tool's summary line."""
    per_label: dict[str, dict] = {}
    outside: list[str] = []
    current = None
    summary = ""
    for line in log.splitlines():
        if line.startswith(BEGIN):
            current = line[len(BEGIN) + 1:]
            per_label[current] = dict(reports=[], result="did not finish")
        elif (end := _END_LINE.match(line)) is not None:
            if end.group(1) in per_label:
                per_label[end.group(1)]["result"] = f"{end.group(2)} {end.group(3)}"
            current = None
        elif re.search(r"(ERROR|RACECHECK|SYNCCHECK) SUMMARY", line):
            summary = line.strip("= ").strip()
        elif _REPORT.match(line):
            (per_label[current]["reports"] if current else outside).append(line.strip())
    return per_label, outside, summary


def _precompile(jobs: int, timeout: int, only: frozenset = frozenset()) -> str:
    """Compiles the sm_90a catalog objects (those in `only`, when given) into the kernel cache with `jobs`
    processes; one line of outcome."""
    from jax_blockgemm import precompile
    from jax_blockgemm.kernels import catalog

    keys = [v.key for v in _selected(catalog.variants_for("sm_90a"), only)]
    failed = precompile.compile_in_processes(keys, jobs, timeout=timeout)
    return (f"precompiled {len(keys)} sm_90a objects in {min(jobs, len(keys))} processes" if not failed
            else "precompile failed:\n" + "\n".join(failed))


def _sanitized(sanitizer: str, tool: str, command: list, *, all_kernels: bool, timeout: int) -> tuple[int, str, float]:
    args = [sanitizer, "--tool", tool, "--print-limit", "50", "--error-exitcode", "86"]
    if tool != "memcheck" and not all_kernels:
        args += ["--kernel-name", "kns=jax_blockgemm"]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0")
    start = time.monotonic()
    # Own process group: a timeout ends the sanitizer AND the Python process it runs (which holds the GPU).
    proc = subprocess.Popen(args + command, cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, time.monotonic() - start
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return 124, (out or "") + f"\n(timed out after {timeout} s)", time.monotonic() - start


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="directory for the full sanitizer logs")
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of " + ",".join(TOOLS))
    parser.add_argument("--all-kernels", action="store_true", help="racecheck/synccheck XLA's kernels too")
    parser.add_argument("--no-fuzz", action="store_true", help="skip the handler fuzz test under memcheck")
    parser.add_argument("--timeout", type=int, default=420, help="seconds per sanitized process at most")
    parser.add_argument("--budget", type=int, default=500, help="seconds for the whole run (each process gets "
                        "what is left, at least 30)")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes compiling the objects before the sanitized runs")
    parser.add_argument("--first-shape", action="store_true",
                        help="one shape per variant (tails in every dimension, L > 1) and proj_rope's bf16 path only")
    parser.add_argument("--shards", default="", metavar="TOOL=N,...",
                        help="split a tool's cases over N sanitized processes at once, e.g. racecheck=6,memcheck=3")
    parser.add_argument("--keys", default="", metavar="KEY,...", help="only these catalog variants")
    parser.add_argument("--run-variants", default=None, help=argparse.SUPPRESS)  # "i/n": the sanitized workload
    args = parser.parse_args(argv)
    keys = frozenset(filter(None, args.keys.split(",")))
    if args.run_variants:
        i, n = (int(x) for x in args.run_variants.split("/"))
        return run_variants((i, n), args.first_shape, keys)
    sanitizer = find_sanitizer()
    if sanitizer is None:
        print("compute-sanitizer not found: set COMPUTE_SANITIZER, or install the nvidia-cuda-sanitizer-api wheel "
              "(cu13) where Python finds it, e.g. pip install --no-index --no-deps --target /tmp/site <wheel>")
        return 2
    tools = [t for t in args.tools.split(",") if t]
    unknown = sorted(set(tools) - set(TOOLS))
    if unknown:
        parser.error(f"--tools: unknown {unknown}; allowed: {', '.join(TOOLS)}")
    out = pathlib.Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    print(f"compute-sanitizer: {sanitizer}")
    started = time.monotonic()
    # Compile every sm_90a object outside the sanitizer first (into the disk cache the sanitized runs read), in
    # --jobs processes at once (the cache takes concurrent writers).
    print(_precompile(args.jobs, args.budget, keys), flush=True)
    limit = int(max(30, min(args.timeout, args.budget - (time.monotonic() - started))))
    # Sanitized processes per tool (their shards of the cases), plus the handler fuzz under memcheck, all at once.
    shards = {tool: 1 for tool in tools}
    for item in filter(None, args.shards.split(",")):
        tool, _, n = item.partition("=")
        if tool not in shards or not n.isdigit() or int(n) < 1:
            parser.error(f"--shards: {item!r} is not TOOL=N with TOOL one of {tools} and N >= 1")
        shards[tool] = int(n)
    from jax_blockgemm.kernels import catalog

    unknown = sorted(keys - {v.key for v in catalog.variants_for("sm_90a")})
    if unknown:
        parser.error(f"--keys: not sm_90a catalog variants: {unknown}")
    script = [sys.executable, str(pathlib.Path(__file__).resolve())] + (["--first-shape"] if args.first_shape else [])
    script += ["--keys", args.keys] if keys else []
    jobs = [((tool, i), tool, script + ["--run-variants", f"{i}/{shards[tool]}"], args.all_kernels)
            for tool in tools for i in range(shards[tool])]
    if not args.no_fuzz:
        fuzz = [sys.executable, "-m", "pytest", "-q", "-x", "tests/test_gpu_handler_fuzz.py", "-k",
                "GpuHandlerFuzzTest"]
        jobs.append(("fuzz", "memcheck", fuzz, True))
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {name: pool.submit(_sanitized, sanitizer, tool, command, all_kernels=all_kernels, timeout=limit)
                   for name, tool, command, all_kernels in jobs}
        results = {name: future.result() for name, future in futures.items()}
    lines, bad = [], 0
    for tool in tools:
        parts = [results[(tool, i)] for i in range(shards[tool])]
        rc = max(p[0] for p in parts)
        log = "\n".join(p[1] for p in parts)
        took = max(p[2] for p in parts)
        if out:
            (out / f"sanitize_{tool}.log").write_text(log)
        per_label, outside, summary = _attribute(log)
        if not per_label:
            lines.append(f"{tool:9s} (no variant ran) FAIL rc={rc} {took:.0f}s: {log.strip().splitlines()[-1:]}")
            bad += 1
        for label, info in per_label.items():
            ok = not info["reports"] and info["result"].startswith("match")
            first = f"; first: {info['reports'][0][:160]}" if info["reports"] else ""
            lines.append(f"{tool:9s} {label:70s} {'OK  ' if ok else 'FAIL'} {len(info['reports'])} reports, "
                         f"{info['result']}{first}")
            bad += not ok
        whole_ok = rc == 0 and not outside
        lines.append(f"{tool:9s} {'(whole process)':70s} {'OK  ' if whole_ok else 'FAIL'} {len(outside)} reports "
                     f"outside any variant, rc={rc}, {summary or 'no sanitizer summary'}, {took:.0f}s"
                     + (f"; first: {outside[0][:160]}" if outside else ""))
        bad += not whole_ok
        print("\n".join(lines[-len(per_label) - 1:]), flush=True)
    if not args.no_fuzz:
        rc, log, took = results["fuzz"]
        if out:
            (out / "sanitize_fuzz_memcheck.log").write_text(log)
        _, outside, summary = _attribute(log)
        passed = re.findall(r"(\d+ passed[^\n]*)", log)
        ran = bool(passed) and "skipped" not in passed[-1]
        ok = rc == 0 and not outside and ran
        lines.append(f"{'memcheck':9s} {'handler fuzz (test_gpu_handler_fuzz.py -k GpuHandlerFuzzTest)':70s} "
                     f"{'OK  ' if ok else 'FAIL'} {len(outside)} reports, rc={rc}, "
                     f"pytest: {passed[-1] if passed else 'no result'}, {summary}, {took:.0f}s")
        bad += not ok
        print(lines[-1], flush=True)
    print(f"\nSUMMARY ({time.monotonic() - started:.0f} s)")
    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
