"""What a run reports: the environment, speedups against the baselines, the text table, the JSON and the chart.

All of it reads only the run's record (a plain dict, the JSON's content), so a saved record can be reported again.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
from typing import Any, Optional, Sequence

import jax

import jax_blockgemm as jbg
from jax_blockgemm.bench.columns import BASELINES, CHECKS, GEMM_COLUMNS, LABELS, OPS
from jax_blockgemm.bench.inputs import GEMM_FORMATS
from jax_blockgemm.bench.launch import IMPLEMENTATIONS

Section = tuple[str, Optional[str], list[dict[str, Any]]]  # (op, gemm format or None, its case records)


def _version(dist: str) -> str:
    """An installed distribution's version, read from its metadata (importing CuTeDSL would cost seconds)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment() -> dict[str, str]:
    """Device and software versions, recorded with every run."""
    device = jax.devices()[0]
    return {"device": device.device_kind, "platform": device.platform, "device_count": str(jax.device_count()),
            "jax": jax.__version__, "jaxlib": _version("jaxlib"), "cutedsl": _version("nvidia-cutlass-dsl"),
            "jax_blockgemm": jbg.__version__, "python": platform.python_version()}


def new_record(command: str, method: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A run's record before its cases: when (UTC, to the minute), the command, the environment, the method, and
    `extra` fields (e.g. the measured read bandwidth)."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "command": command,
            "environment": environment(), "method": method, **extra, "cases": []}


def speedups(results: dict[str, dict], baselines: Sequence[str]) -> dict[str, dict[str, Optional[float]]]:
    """Per baseline `vs_<key>`: baseline ms / column ms for every column (None where either did not run)."""
    ratios = {}
    for base in baselines:
        base_ms = results.get(base, {}).get("ms")
        ratios[f"vs_{base}"] = {name: (base_ms / r["ms"] if base_ms and "ms" in r else None)
                                for name, r in results.items()}
    return ratios


def _title(op: str, fmt: Optional[str] = None) -> str:
    """The heading of a table and chart panel: the op and, for gemm_amax, the format (MXFP8 E4M3 if unsaid)."""
    if op == "gemm_amax":
        return f"gemm_amax, {GEMM_FORMATS[fmt or 'mxfp8'].title} -> f32, M x N x K"
    return "gemm_proj_rope_mxfp8, w (H*192, K) unless a case says w(K,N)"


def _sections(record: dict[str, Any]) -> list[Section]:
    """(op, format, cases) per table and chart panel: per op in OPS, one per gemm format in the order run."""
    sections = []
    for op in OPS:
        cases = [c for c in record["cases"] if c["op"] == op]
        for fmt in dict.fromkeys(c.get("format") for c in cases):
            sections.append((op, fmt, [c for c in cases if c.get("format") == fmt]))
    return sections


def _gemm_note(fmt: Optional[str]) -> str:
    """The footnote of a gemm_amax table: which input form each column takes."""
    if fmt in (None, "mxfp8", "mxfp8_e5m2"):
        return ("  ours and the reference take scales in the 128x4 atom (converted before timing); scaled_matmul "
                "and scaled_dot take compact float8_e8m0fnu scales; fp8 dot: codes without scales; bf16 dot: the "
                "dequantized operands")
    scales = "float8_e8m0fnu scales per 32" if fmt == "mxfp4" else "float8_e4m3fn scales per 16"
    alpha = ("; alpha (fp32 per-tensor scale): ours take it, scaled_matmul and scaled_dot multiply their result by "
             "it, the bf16 dot's result is multiplied by it for the check only" if fmt == "nvfp4" else "")
    return (f"  ours and the reference take E2M1 codes packed two per byte and scales in the 128x4 atom; "
            f"scaled_matmul and scaled_dot take float4_e2m1fn codes and compact {scales}; fp8 dot: E4M3 codes of "
            f"the same values without scales; bf16 dot: the dequantized operands{alpha}")


def header_lines(record: dict[str, Any]) -> list[str]:
    """Device, versions and method: the first lines of the table and the chart's title."""
    env, method = record["environment"], record["method"]
    return [f"jax_blockgemm benchmark, {record['date']}: {env['device']} ({env['platform']}), jax {env['jax']}, "
            f"jaxlib {env['jaxlib']}, CuTeDSL {env['cutedsl']}, Python {env['python']}",
            (f"median of the samples in the last two thirds of {method['sustained_s']:g} s per "
             f"{'case' if method.get('interleave') else 'column'}, each "
             if method.get("sustained_s") else f"median of {method['reps']} samples of ")
            + f"{method.get('burst', 1)} back-to-back calls after {method['warmup']} warm-up, {method['sets']} "
            "input sets rotated; " + ("the columns' samples taken in turn; " if method.get("interleave") else "")
            + "TFLOP/s counts the GEMM's 2*M*N*K; speedup = baseline ms / column ms"]


def _labels(op: str, cases: list[dict[str, Any]]) -> dict[str, str]:
    """The columns of one table, key -> label in table order: those its cases ran or marked n/a (NVIDIA's entry
    points are a column only where they apply)."""
    return {key: label for key, label in LABELS[op].items() if any(key in c["columns"] for c in cases)}


def _cell(entry: dict[str, Any], field: str, fmt: str) -> str:
    """A table cell: the formatted number, "n/a" for a column that did not run, "-" for a number it does not have."""
    if "ms" not in entry:
        return "n/a"
    return format(entry[field], fmt) if field in entry else "-"


def format_table(record: dict[str, Any]) -> str:
    """The aligned text table: per op, one block of rows per case (ms, TFLOP/s, check, a speedup row per baseline)."""
    lines = header_lines(record)
    for op, gemm_format, cases in _sections(record):
        labels = _labels(op, cases)
        rows = [[_title(op, gemm_format), "", *labels.values()]]
        for case in cases:
            cols = [case["columns"].get(key, {}) for key in labels]
            rows.append([case["case"], "ms", *(_cell(c, "ms", ".4g") for c in cols)])
            rows.append(["", "TFLOP/s", *(_cell(c, "tflops", ".4g") for c in cols)])
            check, fmt = CHECKS[op]
            rows.append(["", check, *(_cell(c, "check", fmt) for c in cols)])
            for base in BASELINES[op]:
                ratios = case["ratios"][f"vs_{base}"]
                rows.append(["", f"speedup vs {labels[base]}",
                             *("n/a" if ratios.get(key) is None else f"{ratios[key]:.3g}x" for key in labels)])
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines.append("")
        for row in rows:
            lines.append("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                                   for i, (cell, w) in enumerate(zip(row, widths))).rstrip())
        reasons = {(labels[key], entry["na"]) for case in cases for key, entry in case["columns"].items()
                   if "na" in entry}
        lines += [f"  n/a {label}: {reason}" for label, reason in sorted(reasons)]
        if op == "gemm_amax":
            lines.append(_gemm_note(gemm_format))
        if op == "proj_rope":
            lines.append("  bare bf16 dot: x . w^T -> bf16, the faster weight layout; scaled_matmul pipeline: MXFP8 "
                         "in on both paths")
    if "launch" in record:
        lines += format_launch(record["launch"])
    return "\n".join(lines)


def format_launch(launch: dict[str, Any]) -> list[str]:
    """The --launch lines printed under the table."""
    shape = "x".join(map(str, launch["shape"]))
    lines = ["", f"launch costs, gemm_amax {shape} (first call: fresh process; per call: {launch['calls']} "
                 f"back-to-back calls; a trivial XLA op: {launch['plain_xla_op_us']:.1f} us per call)"]
    for column in IMPLEMENTATIONS:
        entry = launch[column]
        if "na" in entry:
            lines.append(f"  {GEMM_COLUMNS[column]}: n/a ({entry['na']})")
        else:
            lines.append(f"  {GEMM_COLUMNS[column]}: first call {entry['first_call_cold_ms']:.0f} ms with an empty "
                         f"kernel cache, {entry['first_call_warm_cache_ms']:.0f} ms with a warm one; "
                         f"{entry['per_call_us']:.1f} us per call")
    return lines


def write_json(record: dict[str, Any], path: str) -> None:
    """The whole record, every number unrounded, for later comparison or `format_table` again."""
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def write_png(record: dict[str, Any], path: str) -> None:
    """A bar chart of TFLOP/s per case and column (matplotlib, imported here: the `bench` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise SystemExit(f"--png needs matplotlib: pip install 'jax_blockgemm[bench]' ({e}).")
    sections = _sections(record)
    fig, axes = plt.subplots(len(sections), 1, figsize=(11, 4.2 * len(sections)), squeeze=False)
    for ax, (op, fmt, cases) in zip(axes[:, 0], sections):
        labels = _labels(op, cases)
        width = 0.8 / len(labels)
        handles = []
        for j, (key, label) in enumerate(labels.items()):
            timed = [(i, c["columns"][key]["tflops"]) for i, c in enumerate(cases)
                     if "ms" in c["columns"].get(key, {})]
            xs = [i + (j - (len(labels) - 1) / 2) * width for i, _ in timed]
            ax.bar(xs, [y for _, y in timed], width, color=f"C{j}")
            handles.append(Patch(color=f"C{j}", label=label if timed else f"{label} (n/a)"))
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([c["case"] for c in cases], fontsize=8)
        ax.set_ylabel("TFLOP/s (GEMM flops)")
        ax.set_title(_title(op, fmt), fontsize=10)
        ax.set_ylim(top=1.3 * ax.get_ylim()[1])  # room for the legend
        ax.legend(handles=handles, fontsize=7, ncol=4, loc="upper left")
    fig.suptitle("\n".join(header_lines(record)), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
