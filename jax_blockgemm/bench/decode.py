"""`--decode`: the weight-streaming regime of serving (SPEC §8), a few rows times many distinct weight matrices.

Per weight format (MXFP8 E4M3, MXFP4, NVFP4), per shape K -> N (7168 -> 7168, 7168 -> 18432, 2048 -> 7168) and per
M in {1, 16, 64}, each column is one jitted program that applies 32 distinct weight matrices, each to its own x, and
returns the 32 results: 32 weights are too many for L2 to keep any of them, no two GEMMs share an operand that XLA
could merge or deduplicate, and dispatch cost is spread over the program. The figure is the program's time / 32, per
GEMM. Columns:

  * ours(None): `weight_only_matmul` (x bf16 as given, the QuantizedWeight, bf16 out), what serving code calls: the
    weight_stream decode kernel where `arch.TABLE`'s `decode_max_m` takes it (per target, the largest M of each
    weight format), the reference elsewhere; the printed footnote spells those thresholds out;
  * reference(xla): the same with implementation="xla";
  * gemm_amax(None): the quantized-x path, x already quantized to the weight's format (its quantization not timed);
    within the same thresholds it runs the decode kernel too, x dequantized to bf16 (exactly) first;
  * bf16 dot: XLA's dot of bf16 x and the bf16 weights of the same values (the unquantized model), bf16 out;
  * fp8 dot: XLA's dot of E4M3 codes of x and of the weights without any scales (a speed anchor), f32 out.

Beside each time: the rate at which that column reads its own weight bytes (codes and scales, bf16 values, or E4M3
codes) as a fraction of the device's read bandwidth, measured in the same run by a jitted max over a large buffer.
`--small` swaps in tiny shapes, M in {1, 4} and 4 matrices, which a CPU runs in seconds; `--shape M,N,K` (repeatable)
times those cases instead of the shapes above. `--kernels` adds the GPU time of each kernel per GEMM (a CUPTI trace of
the program, `kernel_time`): what the GEMM's kernel itself takes, apart from the time the GPU waits for the host
between the program's calls.
`--interleave` compiles every column of a case first and takes their samples in turn (`timing.interleaved_medians_ms`):
columns timed one after another meet the GPU in different states (the reference's long programs heat it), which can
pass for a difference between columns that run the same kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

import jax_blockgemm as jbg
from jax_blockgemm import arch, formats
from jax_blockgemm.bench import kernel_time, report
from jax_blockgemm.bench.inputs import GEMM_FORMATS, quantize_operand, random_values
from jax_blockgemm.bench.timing import interleaved_medians_ms, median_ms

SHAPES = ((7168, 7168), (7168, 18432), (2048, 7168))  # (K, N): SPEC §8's N = K = 7168 and two more
M_VALUES = (1, 16, 64)
MATRICES = 32
SMALL_SHAPES = ((256, 128), (96, 320))
SMALL_M_VALUES = (1, 4)
SMALL_MATRICES = 4
DEFAULT_FORMATS = ("mxfp8", "mxfp4", "nvfp4")
COLUMNS = {"ours": "ours(None)", "reference": "reference(xla)", "gemm_amax": "gemm_amax(None)",
           "bf16_dot": "bf16 dot", "fp8_dot": "fp8 dot", "read_floor": "read floor"}
BANDWIDTH_BYTES, SMALL_BANDWIDTH_BYTES = 2**32, 2**24  # the buffer the read bandwidth is measured on
KERNEL_TRACE_PROGRAMS = 3  # programs traced together for --kernels


@dataclasses.dataclass(frozen=True)
class Column:
    """One column: the per-GEMM function, the input names it takes per matrix, and its weight bytes per GEMM."""

    key: str
    fn: Callable[..., Any]
    inputs: tuple[str, ...]
    weight_bytes: Callable[[dict], int]


def _nt(x: jax.Array, w: jax.Array, out_dtype: Any) -> jax.Array:
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=out_dtype)


def read_all(codes: jax.Array) -> jax.Array:
    """Every byte of a weight's codes (rows of a multiple of 4 bytes) read once: their max as uint32 words."""
    raw = codes if codes.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(codes, jnp.uint8)
    return jnp.max(jax.lax.bitcast_convert_type(raw.reshape(*raw.shape[:-1], -1, 4), jnp.uint32))


def columns(fmt: str) -> list[Column]:
    """The decode columns for weights in `fmt` (an inputs.GEMM_FORMATS name), in table order."""
    block = GEMM_FORMATS[fmt].block
    quantized = lambda inputs: inputs["w"].nbytes

    def gemm_amax(a, sfa, b, sfb, alpha=None):
        return jbg.gemm_amax(a, b, sfa, sfb, alpha=alpha, c_dtype=jnp.bfloat16, sf_vec_size=block)[0]

    alpha = ("alpha",) if fmt == "nvfp4" else ()
    return [Column("ours", lambda x, w: jbg.weight_only_matmul(x, w), ("x", "w"), quantized),
            Column("reference", lambda x, w: jbg.weight_only_matmul(x, w, implementation="xla"), ("x", "w"),
                   quantized),
            Column("gemm_amax", gemm_amax, ("a", "sfa", "b", "sfb", *alpha), quantized),
            Column("bf16_dot", lambda x, w: _nt(x, w, jnp.bfloat16), ("x", "w_bf16"),
                   lambda inputs: inputs["w_bf16"].size * 2),
            Column("fp8_dot", lambda x, w: _nt(x, w, jnp.float32), ("x_fp8", "w_fp8"),
                   lambda inputs: inputs["w_fp8"].size),
            Column("read_floor", read_all, ("b",), lambda inputs: inputs["b"].nbytes)]


def weight_inputs(key: jax.Array, k: int, n: int, fmt: str) -> dict[str, Any]:
    """One weight matrix (N, K) in every form the columns take: the QuantizedWeight, its codes and compact scales
    for gemm_amax (with NVFP4's alpha factor), its bf16 values, and E4M3 codes of the same values."""
    values = random_values(key, (n, k))
    # NVFP4: alpha = 1 / encode, max|w| / (6 * 448) up to rounding (formats.nvfp4_tensor_scales), as inputs.py's
    w = jbg.quantize_weight(values, GEMM_FORMATS[fmt].weight_format)
    return {"w": w, "b": w.codes, "sfb": w.scales, "w_tensor_scale": w.alpha,
            "w_bf16": w.dequantize(jnp.bfloat16),
            "w_fp8": w.codes if fmt == "mxfp8" else formats.quantize_mxfp8(values)[0]}


def activation_inputs(key: jax.Array, m: int, k: int, fmt: str, weight: dict[str, Any]) -> dict[str, Any]:
    """One x (M, K) for one weight: bf16 values, and (for gemm_amax) the same quantized to the weight's format
    (NVFP4: alpha is the product of both per-tensor scales), and E4M3 codes for the fp8 anchor."""
    values = random_values(key, (m, k))
    codes, scales, tensor_scale = quantize_operand(values, GEMM_FORMATS[fmt])
    out = {"x": values.astype(jnp.bfloat16), "a": codes, "sfa": scales,
           "x_fp8": formats.quantize_mxfp8(values)[0]}
    if tensor_scale is not None:  # NVFP4: C = alpha · Â·B̂ᵀ with both per-tensor scales in alpha
        out["alpha"] = (tensor_scale * weight["w_tensor_scale"]).astype(jnp.float32)
    return out


def program(fn: Callable[..., Any]) -> Callable[[list], tuple]:
    """The timed program: fn applied to each matrix's own inputs, every result returned (nothing merged or dropped)."""
    return lambda per_matrix: tuple(fn(*args) for args in per_matrix)


def read_bandwidth(n_bytes: int, *, warmup: int, reps: int) -> dict[str, float]:
    """The device's read bandwidth in GB/s: a jitted max over a uint32 buffer of `n_bytes`, timed like a column."""
    buffer = jnp.arange(n_bytes // 4, dtype=jnp.uint32)
    reduce = jax.jit(jnp.max).lower(buffer).compile()
    ms = median_ms(reduce, [(buffer,)], warmup=max(warmup, 1), reps=reps)
    return {"bytes": n_bytes, "ms": ms, "gb_per_s": n_bytes / (ms * 1e-3) / 1e9}


def _rel_err(out: Any, ref: Any) -> float:
    """||y - y_ref|| / ||y_ref|| over the 32 results (float32)."""
    got = jnp.stack([o.astype(jnp.float32) for o in out])
    want = jnp.stack([r.astype(jnp.float32) for r in ref])
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def run_case(key: jax.Array, fmt: str, k: int, n: int, m_values: Sequence[int], matrices: int, *, warmup: int,
             reps: int, burst: int, read_gbs: float, progress: Any, kernels: bool = False,
             interleave: bool = False) -> list[dict[str, Any]]:
    """Draws `matrices` weights of (N, K) once, then per M compiles and runs every column and times them, one after
    another or (`interleave`) in turn; returns one record per M. With `kernels`, each column's record also holds the
    GPU time per GEMM of each of its kernels ("kernels_us")."""
    key_w, key_x = jax.random.split(key)
    weights = [weight_inputs(kw, k, n, fmt) for kw in jax.random.split(key_w, matrices)]
    jax.block_until_ready(weights)
    records = []
    for m in m_values:
        xs = [activation_inputs(kx, m, k, fmt, w) for kx, w in zip(jax.random.split(jax.random.fold_in(key_x, m),
                                                                                      matrices), weights)]
        inputs = [{**w, **x} for w, x in zip(weights, xs)]
        progress.write(f"  {fmt} {k} -> {n}, M = {m}:")
        results, outputs, ready = {}, {}, {}
        for column in columns(fmt):
            per_matrix = [tuple(i[name] for name in column.inputs) for i in inputs]
            try:
                compiled = jax.jit(program(column.fn)).lower(per_matrix).compile()
                outputs[column.key] = jax.block_until_ready(compiled(per_matrix))
            except Exception as e:  # a column this platform cannot run (e.g. no FP8 dot): n/a, with the reason
                results[column.key] = {"na": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"}
                progress.write(f" {column.key} n/a;")
                continue
            ready[column.key] = (column, compiled, per_matrix)
        timing = dict(warmup=warmup, reps=reps, burst=burst)
        if interleave:
            ms = interleaved_medians_ms([f for _, f, _ in ready.values()], [[(a,)] for _, _, a in ready.values()],
                                        **timing)
        else:
            ms = [median_ms(f, [(a,)], **timing) for _, f, a in ready.values()]
        for (column, compiled, per_matrix), column_ms in zip(ready.values(), ms):
            us = column_ms * 1e3 / matrices
            gbs = column.weight_bytes(inputs[0]) / (us * 1e-6) / 1e9
            results[column.key] = {"us": us, "weight_gb_per_s": gbs, "fraction_of_read_bandwidth": gbs / read_gbs}
            if kernels:
                per_program = kernel_time.kernel_ms(compiled, (per_matrix,), reps=KERNEL_TRACE_PROGRAMS)
                results[column.key]["kernels_us"] = {label: ms * 1e3 / matrices for label, ms in per_program.items()}
            progress.write(f" {column.key} {us:.4g} us;")
        progress.write("\n")
        progress.flush()
        if "ours" in outputs and "reference" in outputs:
            results["ours"]["rel_err_vs_reference"] = _rel_err(outputs["ours"], outputs["reference"])
        records.append({"format": fmt, "k": k, "n": n, "m": m, "matrices": matrices, "columns": results})
    return records


def decode_policy(formats_: Sequence[str]) -> str:
    """Where implementation=None runs a decode kernel for weights in `formats_` (--format names), read from
    `arch.TABLE`: per target, the largest M (per format where they differ), its `decode_short_k` rules and the M that
    its `decode_swap_ab_m` gives the swap_ab tiles (the weight_stream decode kernel takes the rest)."""
    titles = {GEMM_FORMATS[fmt].weight_format: GEMM_FORMATS[fmt].title for fmt in formats_}
    rules = [(row.target, arch.decode_rule(row, list(titles), name=titles.get)) for row in arch.TABLE if row.target]
    places = [f"on {target} for {rule}" for target, rule in rules if rule]
    if not places:
        return ("implementation=None runs the reference (bf16 dequantization, XLA's dot) on every device: no row of "
                "arch.TABLE's decode_max_m takes a decode kernel for these formats")
    return (f"implementation=None runs a decode kernel {'; '.join(places)} (arch.TABLE's "
            "decode_max_m, unless a tuning table measured on the GPU decides otherwise), the reference (bf16 "
            "dequantization, XLA's dot) for every other call")


def format_table(record: dict[str, Any]) -> str:
    """One table per format: per K -> N and M, µs per GEMM and the fraction of the read bandwidth, per column."""
    env, bw = record["environment"], record["read_bandwidth"]
    matrices = record["cases"][0]["matrices"] if record["cases"] else 0
    lines = [f"jax_blockgemm decode benchmark, {record['date']}: {env['device']} ({env['platform']}), jax {env['jax']}",
             f"us per GEMM: one jitted program applies {matrices} distinct weight matrices (each to its own x), median "
             f"of {record['method']['reps']} samples of {record['method']['burst']} programs"
             + ("; the columns' samples taken in turn;" if record["method"].get("interleave") else ";"),
             "in parentheses: the column's weight bytes read per second as a fraction of the measured read bandwidth, "
             f"{bw['gb_per_s']:.0f} GB/s"]
    for fmt in dict.fromkeys(c["format"] for c in record["cases"]):
        cases = [c for c in record["cases"] if c["format"] == fmt]
        rows = [[f"{GEMM_FORMATS[fmt].title} weights, bf16 x", "M", *COLUMNS.values()]]
        for case in cases:
            cells = []
            for key in COLUMNS:
                entry = case["columns"].get(key, {"na": "not run"})
                cells.append("n/a" if "na" in entry else
                             f"{entry['us']:.4g} ({entry['fraction_of_read_bandwidth']:.0%})")
            rows.append([f"{case['k']} -> {case['n']}", str(case["m"]), *cells])
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines.append("")
        lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                  for row in rows]
        errors = [c["columns"]["ours"].get("rel_err_vs_reference") for c in cases if "us" in c["columns"]["ours"]]
        if errors:
            lines.append(f"  ours vs reference: relative error at most {max(errors):.1e}")
        reasons = sorted({(COLUMNS[key], e["na"]) for c in cases for key, e in c["columns"].items() if "na" in e})
        lines += [f"  n/a {label}: {reason}" for label, reason in reasons]
    traced = [(c, key, e["kernels_us"]) for c in record["cases"] for key, e in c["columns"].items()
              if "kernels_us" in e]
    if traced:
        lines += ["", f"GPU time per GEMM by kernel, us (a CUPTI trace of {KERNEL_TRACE_PROGRAMS} programs; kernel "
                  "time only: the column's time above less this sum is the GPU waiting for the host, at each sample's "
                  "start and wherever the host issues a program more slowly than the GPU runs it)"]
        for c, key, times in traced:
            label = f"{GEMM_FORMATS[c['format']].title} {c['k']} -> {c['n']}, M = {c['m']}, {COLUMNS[key]}"
            lines.append(f"  {label}: {kernel_time.describe(times, '.3g')}")
    shown = tuple(dict.fromkeys(c["format"] for c in record["cases"])) or DEFAULT_FORMATS
    notes = (f"ours: weight_only_matmul; {decode_policy(shown)}. gemm_amax: x quantized to the weight's format "
             "beforehand (not timed), then the same choice (the decode kernel takes x dequantized to bf16). bf16 dot: "
             "bf16 weights of the same values; fp8 dot: E4M3 codes of x and the weights, no scales. read floor: "
             "XLA's max over each weight's code bytes, no product (scales not read).")
    lines += ["", *textwrap.wrap(notes, width=118, initial_indent="  ", subsequent_indent="  ")]
    return "\n".join(lines)


def plan(shapes: Sequence[tuple[int, int, int]], *, small: bool) -> list[tuple[int, int, tuple[int, ...]]]:
    """The (K, N, M values) to time: the --shape M,N,K cases grouped by weight (in the order given), else the SPEC §8
    shapes (their tiny twins with `small`), each at every M of the set."""
    if shapes:
        grouped: dict[tuple[int, int], list[int]] = {}
        for m, n, k in shapes:
            grouped.setdefault((k, n), []).append(m)
        return [(k, n, tuple(dict.fromkeys(ms))) for (k, n), ms in grouped.items()]
    return [(k, n, SMALL_M_VALUES if small else M_VALUES) for k, n in (SMALL_SHAPES if small else SHAPES)]


def main(args: argparse.Namespace, command: str, formats_: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Runs the decode benchmark with the command line's --shape, --small, --format, --reps, --warmup, --burst,
    --seed, --kernels, --interleave and --json; prints progress to stderr and the tables to stdout; returns the
    record."""
    cases = plan(args.shape, small=args.small)
    matrices = SMALL_MATRICES if args.small else MATRICES
    chosen = tuple(formats_ or DEFAULT_FORMATS)
    timing = dict(warmup=args.warmup, reps=args.reps, burst=args.burst)
    bandwidth = read_bandwidth(SMALL_BANDWIDTH_BYTES if args.small else BANDWIDTH_BYTES, warmup=args.warmup,
                               reps=args.reps)
    sys.stderr.write(f"read bandwidth: {bandwidth['gb_per_s']:.1f} GB/s\n")
    record = report.new_record(command, dict(timing, seed=args.seed, interleave=args.interleave),
                               read_bandwidth=bandwidth)
    key = jax.random.key(args.seed)
    for i, fmt in enumerate(chosen):
        for j, (k, n, m_values) in enumerate(cases):
            case_key = jax.random.fold_in(key, i * len(cases) + j)
            record["cases"] += run_case(case_key, fmt, k, n, m_values, matrices, read_gbs=bandwidth["gb_per_s"],
                                        progress=sys.stderr, kernels=args.kernels, interleave=args.interleave,
                                        **timing)
    print(format_table(record))
    if args.json:
        report.write_json(record, args.json)
    return record
