"""The command line of `python -m jax_blockgemm.bench`: options, their checks, and the run from cases to report."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from jax_blockgemm import bench, formats, support
from jax_blockgemm.bench import report, timing
from jax_blockgemm.bench.cases import build_cases, run_case
from jax_blockgemm.bench.columns import OPS
from jax_blockgemm.bench.inputs import DEFAULT_FORMATS, GEMM_FORMATS
from jax_blockgemm.bench.launch import launch_costs

PROG = "python -m jax_blockgemm.bench"
DEFAULT_SETS = 2  # --sets without the option; --decode refuses any other value (it draws its own inputs)


def parse_shape(text: str) -> tuple[int, int, int]:
    """--shape M,N,K: three positive integers, K a multiple of 32 (the MX block; also 16-byte FP4 rows), 16-byte
    aligned rows."""
    parts = text.split(",")
    try:
        if len(parts) != 3:
            raise ValueError
        m, n, k = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected M,N,K (three integers separated by commas); got {text!r}.")
    if min(m, n, k) < 1:
        raise argparse.ArgumentTypeError(f"M, N and K must be positive; got {text!r}.")
    if k % support.MX_BLOCK:
        raise argparse.ArgumentTypeError(f"K must be a multiple of {support.MX_BLOCK} (the MXFP8 block, which every "
                                         f"baseline needs whole); got K={k}.")
    try:
        support.check_alignment(ab_dtype=formats.E4M3, c_dtype=jnp.float32, m=m, n=n, k=k, a_major="k",
                                b_major="k", c_major="n")
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}")
    return m, n, k


def parse_moe_case(text: str) -> tuple[int, int, int, int]:
    """--moe T,G,K,N: four positive integers, T a multiple of G (the dense baseline's (G, T/G, K) tokens), K a
    multiple of 32 (the MX block; 16-byte FP4 rows) and N of 8 (16-byte rows of the bf16 results)."""
    parts = text.split(",")
    try:
        if len(parts) != 4:
            raise ValueError
        t, g, k, n = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected T,G,K,N (four integers separated by commas); got {text!r}.")
    if min(t, g, k, n) < 1:
        raise argparse.ArgumentTypeError(f"T, G, K and N must be positive; got {text!r}.")
    for name, value, multiple, why in (("T", t, g, "G, for the dense baseline's (G, T/G, K) tokens"),
                                       ("K", k, support.MX_BLOCK, "the MX block"),
                                       ("N", n, 8, "16-byte rows of the bf16 results")):
        if value % multiple:
            raise argparse.ArgumentTypeError(f"{name} must be a multiple of {multiple} ({why}); got {text!r}.")
    return t, g, k, n


def parse_formats(text: str) -> list[str]:
    """--format: one gemm_amax format or a comma list of them, each one of inputs.GEMM_FORMATS."""
    names = [name.strip().lower() for name in text.split(",")]
    for name in names:
        if name not in GEMM_FORMATS:
            raise argparse.ArgumentTypeError(f"unknown format {name!r} in {text!r}; choose from "
                                             f"{', '.join(GEMM_FORMATS)} (a comma list, or the option repeated).")
    return names


def parse_ragged_columns(text: str) -> list[str]:
    """--columns: one column key of `--op ragged` or a comma list of them (MXFP8's keys; other formats' columns
    follow from --format)."""
    from jax_blockgemm.bench.ragged import FORWARD, STEP

    known = {**FORWARD, **STEP}
    names = [name.strip() for name in text.split(",")]
    for name in names:
        if name not in known:
            raise argparse.ArgumentTypeError(f"unknown column {name!r} in {text!r}; choose from "
                                             f"{', '.join(known)} (a comma list, or the option repeated).")
    return names


def _seconds(text: str) -> float:
    """A --sustained duration: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0.0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    """Every option of the benchmark; the description is the first line of the package's docstring."""
    p = argparse.ArgumentParser(prog=PROG, description=bench.__doc__.split("\n\n")[0],
                                epilog="Without options: the SPEC §8 cases of both operations.")
    p.add_argument("--shape", type=parse_shape, action="append", default=[], metavar="M,N,K",
                   help="a gemm_amax shape to run instead of the SPEC §8 ones (repeatable); with --decode, M rows "
                        "against an N x K weight")
    p.add_argument("--format", type=parse_formats, action="append", default=[], metavar="FORMAT[,FORMAT]",
                   help=f"gemm_amax input format(s): {', '.join(GEMM_FORMATS)} (repeatable or a comma list; "
                        "default mxfp8; proj_rope is MXFP8 only; with --op ragged, the formats of the ragged "
                        "GEMM's and the weight-only columns)")
    p.add_argument("--op", choices=OPS + ("ragged",), action="append", default=[],
                   help="run only this operation (repeatable); 'ragged': the mixture-of-experts GEMMs instead "
                        "(bench/ragged.py)")
    p.add_argument("--small", action="store_true", help="a tiny twin of every case (runs on a CPU in seconds)")
    p.add_argument("--reps", type=support.count_arg(1), default=20,
                   help="timed calls per column (the median is reported)")
    p.add_argument("--warmup", type=support.count_arg(0), default=3, help="untimed calls per column before timing")
    p.add_argument("--burst", type=support.count_arg(1), default=10,
                   help="calls per timed sample, issued back to back with one wait (1: each call waited for)")
    p.add_argument("--sets", type=support.count_arg(1), default=DEFAULT_SETS,
                   help="input sets drawn per case and rotated between calls")
    p.add_argument("--sustained", type=_seconds, default=0.0, metavar="SECONDS",
                   help="time each column by samples back to back for this long instead of --reps, median of the "
                        "last two thirds: the steady state at the GPU's power limit (0: off)")
    p.add_argument("--interleave", action="store_true",
                   help="compile a case's columns first, then take their samples in turn (a shuffled order each "
                        "round), so that every column meets the GPU in the same thermal state (with --sustained the "
                        "columns share that time)")
    p.add_argument("--w-in-out", action="store_true",
                   help="also time proj_rope with w as (K, H*192) (w_out_in=False, the Flax layers' layout)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--launch", action="store_true",
                   help="also measure launch costs: first-call latency in fresh processes, per-call overhead")
    p.add_argument("--decode", action="store_true",
                   help="time the decode regime instead (bench/decode.py): weight-only matmuls of small M against 32 "
                        "distinct weight matrices per program, beside the bf16 and FP8 dots (--format picks the "
                        "weight formats, default all three)")
    p.add_argument("--moe", type=parse_moe_case, action="append", default=[], metavar="T,G,K,N",
                   help="with --op ragged: a mixture-of-experts case (T tokens, G experts, K -> N; equal and skewed "
                        "groups) to time instead of the three default shapes (repeatable)")
    p.add_argument("--grouping", choices=("equal", "skewed"), action="append", default=[],
                   help="with --op ragged: only this grouping of the tokens (repeatable; default both)")
    p.add_argument("--columns", type=parse_ragged_columns, action="append", default=[], metavar="KEY[,KEY]",
                   help="with --op ragged: only these columns (repeatable): ours, weight_only, mxfp8_recipe, "
                        "bf16_recipe, ragged_dot, dense, step_mxfp8, step_bf16, step_dense (default all)")
    p.add_argument("--kernels", action="store_true",
                   help="with --op ragged or --decode: also the GPU time of each kernel (a CUPTI trace through "
                        "jax.profiler) of every ragged column, or per GEMM of every decode column: where the time "
                        "goes")
    p.add_argument("--json", metavar="PATH", help="write the raw numbers here")
    p.add_argument("--png", metavar="PATH", help="write a bar chart here (needs matplotlib)")
    return p


def _method(args: argparse.Namespace, gemm_formats: Sequence[str]) -> dict[str, Any]:
    """The record's "method": the options that decide what the numbers mean, and the timing in words."""
    return {"reps": args.reps, "warmup": args.warmup, "sets": args.sets, "seed": args.seed, "burst": args.burst,
            "formats": list(gemm_formats), "sustained_s": args.sustained, "interleave": args.interleave,
            "timing": timing.describe(reps=args.reps, burst=args.burst, sustained=args.sustained,
                                      interleave=args.interleave)}


def _refuse_ignored(args: argparse.Namespace) -> None:
    """Options the chosen mode would ignore are refused (--decode and --op ragged take their own shapes and
    timing), so that no flag is silently dropped."""
    if args.decode:
        mode = "--decode"
        given = {"--op": args.op, "--png": args.png, "--sustained": args.sustained,
                 "--sets": args.sets != DEFAULT_SETS, "--launch": args.launch, "--moe": args.moe,
                 "--grouping": args.grouping, "--columns": args.columns}
    elif "ragged" in args.op:
        mode = "--op ragged" + (" --moe" if args.moe else "")
        given = {"--shape": args.shape, "--png": args.png, "--launch": args.launch, "--small": args.small and args.moe}
    else:
        mode = "--op gemm_amax / proj_rope"
        given = {"--moe": args.moe, "--grouping": args.grouping, "--columns": args.columns}
    ignored = [flag for flag, value in given.items() if value]
    if ignored:
        raise SystemExit(f"{PROG}: {mode} does not take {', '.join(ignored)}")


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Runs the benchmark; prints progress to stderr and the table to stdout; returns the record."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    if args.kernels and not (args.decode or "ragged" in args.op):
        raise SystemExit(f"{PROG}: --kernels goes with --op ragged or --decode")
    _refuse_ignored(args)
    for flag, path in (("--json", args.json), ("--png", args.png)):  # before the run, not after it
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise SystemExit(f"{PROG}: {flag} {path}: its directory does not exist")
    if args.decode:
        from jax_blockgemm.bench import decode

        chosen = tuple(dict.fromkeys(name for names in args.format for name in names))
        return decode.main(args, " ".join([PROG, *argv]), chosen)
    if "ragged" in args.op:
        if set(args.op) != {"ragged"}:
            raise SystemExit(f"{PROG}: --op ragged runs on its own (bench/ragged.py); got --op {' '.join(args.op)}")
        from jax_blockgemm.bench import ragged

        return ragged.main(args, " ".join([PROG, *argv]))
    gemm_formats = tuple(dict.fromkeys(name for names in args.format for name in names)) or DEFAULT_FORMATS
    cases = build_cases(ops=args.op or OPS, shapes=args.shape, small=args.small, gemm_formats=gemm_formats,
                        w_in_out=args.w_in_out)
    record = report.new_record(" ".join([PROG, *argv]), _method(args, gemm_formats))
    key = jax.random.key(args.seed)
    for i, (case, case_key) in enumerate(zip(cases, jax.random.split(key, len(cases)))):
        start = time.perf_counter()
        sys.stderr.write(f"[{i + 1}/{len(cases)}] {case.op} {case.name}:")
        sys.stderr.flush()
        record["cases"].append(run_case(case, case_key, sets=args.sets, warmup=args.warmup, reps=args.reps,
                                        progress=sys.stderr, burst=args.burst, sustained=args.sustained,
                                        interleave=args.interleave))
        sys.stderr.write(f" done in {time.perf_counter() - start:.1f} s\n")
        sys.stderr.flush()
    if args.launch:
        sys.stderr.write("launch costs (fresh processes) ...\n")
        record["launch"] = launch_costs()
    print(report.format_table(record))
    if args.json:
        report.write_json(record, args.json)
    if args.png:
        report.write_png(record, args.png)
    return record
