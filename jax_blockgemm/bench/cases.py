"""The benchmark's problems (cases) and how one is run: fresh inputs, each column compiled, checked and timed.

A case's record holds per column its median ms and TFLOP/s (or why it is n/a), the check against the reference
and the speedups against each baseline; `report` turns the records into the table, the JSON and the chart.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence, TextIO

import jax

from jax_blockgemm import support
from jax_blockgemm.bench import report
from jax_blockgemm.bench.columns import (BASELINES, CHECKS, Column, NotAvailable, gemm_columns, gemm_rel_err,
                                         proj_rope_codes_equal, proj_rope_columns)
from jax_blockgemm.bench.inputs import DEFAULT_FORMATS, gemm_inputs, proj_rope_inputs
from jax_blockgemm.bench.timing import interleaved_medians_ms, median_ms

GEMM_SHAPES = ((8192, 8192, 8192), (4096, 7168, 16384), (4096, 24576, 1536))  # SPEC §8
PROJ_K, PROJ_HEADS, PROJ_TOKENS = 1536, 128, (2048, 4096)  # SPEC §8: DeepSeek-V3 MLA Q up-projection
SMALL_GEMM_SHAPES = ((128, 128, 128), (64, 112, 256), (96, 320, 64))  # --small: a tiny twin of each case
SMALL_PROJ_K, SMALL_PROJ_HEADS, SMALL_PROJ_TOKENS = 64, 2, (32, 64)


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark problem: the op, a name for the table, its GEMM flops, how to draw inputs, what to time."""

    op: str
    name: str
    dims: dict[str, Any]
    flops: float
    make_inputs: Callable[[jax.Array], dict[str, jax.Array]]
    columns: Callable[[], list[Column]]
    check: Callable[[Any, Any], float]  # (a checked column's output, the reference's) -> the "check" number
    fmt: Optional[str] = None  # gemm_amax: the inputs.GEMM_FORMATS name of its inputs


def gemm_case(m: int, n: int, k: int, fmt: str = "mxfp8") -> Case:
    """gemm_amax at M x N x K in format `fmt` -> f32; the name says the format unless it is the default MXFP8."""
    name = f"{m}x{n}x{k}" if fmt == "mxfp8" else f"{m}x{n}x{k} {fmt}"
    return Case("gemm_amax", name, {"m": m, "n": n, "k": k, "format": fmt}, 2.0 * m * n * k,
                functools.partial(gemm_inputs, m=m, n=n, k=k, fmt=fmt), functools.partial(gemm_columns, fmt),
                gemm_rel_err, fmt)


def proj_rope_case(tokens: int, heads: int, k: int, mxfp8: bool, w_out_in: bool = True) -> Case:
    """gemm_proj_rope_mxfp8 with T tokens, H heads, K inputs, on the MXFP8 or the bf16 input path; w as (H·192, K),
    or (w_out_in=False, the Flax layers' layout) as (K, H·192)."""
    n = heads * support.HEAD_DIM
    name = f"T={tokens} H={heads} K={k} {'mxfp8' if mxfp8 else 'bf16'}" + ("" if w_out_in else " w(K,N)")
    return Case("proj_rope", name,
                {"tokens": tokens, "heads": heads, "k": k, "input": "mxfp8" if mxfp8 else "bf16",
                 "w_out_in": w_out_in},
                2.0 * tokens * n * k,
                functools.partial(proj_rope_inputs, tokens=tokens, heads=heads, k=k, w_out_in=w_out_in),
                functools.partial(proj_rope_columns, mxfp8, w_out_in), proj_rope_codes_equal)


def build_cases(*, ops: Sequence[str], shapes: Sequence[tuple[int, int, int]], small: bool,
                gemm_formats: Sequence[str] = DEFAULT_FORMATS, w_in_out: bool = False) -> list[Case]:
    """The cases to run, in order: gemm_amax per format, its shapes, then proj_rope T x {bf16, mxfp8} (and with
    `w_in_out` the same again with w as (K, H·192))."""
    cases = []
    if "gemm_amax" in ops:
        cases += [gemm_case(*s, fmt) for fmt in gemm_formats
                  for s in (shapes or (SMALL_GEMM_SHAPES if small else GEMM_SHAPES))]
    if "proj_rope" in ops:
        tokens, heads, k = ((SMALL_PROJ_TOKENS, SMALL_PROJ_HEADS, SMALL_PROJ_K) if small
                            else (PROJ_TOKENS, PROJ_HEADS, PROJ_K))
        cases += [proj_rope_case(t, heads, k, mxfp8, w_out_in) for w_out_in in (True, False)[:1 + w_in_out]
                  for t in tokens for mxfp8 in (False, True)]
    return cases


def _first_line(e: BaseException) -> str:
    """The exception's type and first line: enough to say why a column is n/a without a traceback."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def prepare_column(column: Column, sets: list[dict[str, jax.Array]]) -> tuple[Any, list[tuple], Any]:
    """Compiles `column` ahead and runs it once (a compile-time or first-call error in na_errors becomes
    NotAvailable). Returns (the compiled function, its argument sets, the output on the first input set where the
    column is checked, else None)."""
    if column.fn is None:
        raise NotAvailable(column.missing)
    arg_sets = [tuple(s[name] for name in column.inputs) for s in sets]
    try:
        compiled = jax.jit(column.fn).lower(*arg_sets[0]).compile()
        out = jax.block_until_ready(compiled(*arg_sets[0]))  # some backends refuse a format only when run
    except column.na_errors as e:
        raise NotAvailable(_first_line(e)) from e
    if not column.checked:
        return compiled, arg_sets, None
    return compiled, arg_sets, (out * sets[0][column.check_times] if column.check_times else out)


def time_column(column: Column, sets: list[dict[str, jax.Array]], *, warmup: int, reps: int, burst: int = 1,
                sustained: float = 0.0) -> tuple[float, Any]:
    """`prepare_column`, then `timing.median_ms`. Returns (median ms, the checked output or None)."""
    compiled, arg_sets, out = prepare_column(column, sets)
    return median_ms(compiled, arg_sets, warmup=warmup, reps=reps, burst=burst, sustained=sustained), out


def _merge_layouts(results: dict[str, dict], prefix: str) -> None:
    """Replaces the `prefix:layout` entries by one `prefix` entry holding the faster layout (and both times)."""
    variants = {key.split(":", 1)[1]: results.pop(key) for key in list(results) if key.startswith(prefix + ":")}
    if not variants:
        return
    timed = {layout: r for layout, r in variants.items() if "ms" in r}
    if not timed:
        results[prefix] = {"na": "; ".join(f"{layout}: {r['na']}" for layout, r in variants.items())}
        return
    layout = min(timed, key=lambda name: timed[name]["ms"])
    results[prefix] = dict(timed[layout], layout=layout, layouts_ms={name: r["ms"] for name, r in timed.items()})


def run_case(case: Case, key: jax.Array, *, sets: int, warmup: int, reps: int, progress: TextIO, burst: int = 1,
             sustained: float = 0.0, interleave: bool = False) -> dict[str, Any]:
    """Draws `sets` fresh input sets, times every column, and returns the case's record (ms, TFLOP/s, ratios).
    interleave: compile every column first, then sample them in turn (`timing.interleaved_medians_ms`)."""
    inputs = [case.make_inputs(k) for k in jax.random.split(key, sets)]
    jax.block_until_ready(inputs)
    results: dict[str, dict] = {}
    outputs: dict[str, Any] = {}
    timing = dict(warmup=warmup, reps=reps, burst=burst, sustained=sustained)
    prepared: dict[str, tuple] = {}
    columns = case.columns()
    for column in columns:
        try:
            if interleave:
                compiled, arg_sets, outputs[column.key] = prepare_column(column, inputs)
                prepared[column.key] = (compiled, arg_sets)
                continue
            ms, outputs[column.key] = time_column(column, inputs, **timing)
            results[column.key] = {"ms": ms, "tflops": case.flops / (ms * 1e-3) / 1e12}
            progress.write(f" {column.key} {ms:.4g} ms;")
        except NotAvailable as e:
            results[column.key] = {"na": str(e)}
            progress.write(f" {column.key} n/a;")
        progress.flush()
    if prepared:
        medians = interleaved_medians_ms([c for c, _ in prepared.values()], [a for _, a in prepared.values()],
                                         **timing)
        for name, ms in zip(prepared, medians):
            results[name] = {"ms": ms, "tflops": case.flops / (ms * 1e-3) / 1e12}
            progress.write(f" {name} {ms:.4g} ms;")
        results = {column.key: results[column.key] for column in columns}  # table order
    for name, out in outputs.items():
        if out is not None:
            results[name]["check"] = case.check(out, outputs["reference"])
    _merge_layouts(results, "bf16_dot")
    record = {"op": case.op, "case": case.name, "dims": case.dims, "flops": case.flops,
              "check": CHECKS[case.op][0], "columns": results, "ratios": report.speedups(results, BASELINES[case.op])}
    return record if case.fmt is None else {**record, "format": case.fmt}
