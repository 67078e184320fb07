"""`--op ragged`: mixture-of-experts GEMMs (tokens sorted by expert, one weight per expert), forward and training step.

Per shape (T tokens, G experts, K -> N) and grouping (equal groups, or skewed: Dirichlet(0.5) shares of the tokens,
one seed), each column is one jitted program timed like the other benchmarks. Forward columns:

  * ours(None): `ragged_gemm_amax`, MXFP8 E4M3 codes of x and of the weights (quantized beforehand, not timed), bf16 C;
  * weight-only mxfp8: `weight_only_ragged_matmul`, the serving form: bf16 x as given times the experts quantized
    to MXFP8 E4M3 beforehand (not timed), bf16 out;
  * with `--format` (mxfp8, mxfp8_e5m2, mxfp4, nvfp4; default mxfp8) these two columns for each format named, the
    others once (NVFP4: x and the weights each with its per-tensor scale, alpha their product; the experts one
    alpha each);
  * mx_ragged_dot mxfp8: `mx_ragged_dot` with the mxfp8 recipe on bf16 x and w, their quantization included;
  * mx_ragged_dot bf16: `mx_ragged_dot` with the bf16 recipe (bf16 operands, float32 accumulation);
  * lax.ragged_dot: `jax.lax.ragged_dot` on bf16 operands (XLA masks a dense operand per group on GPU);
  * dense bf16: a batched bf16 dot of the same FLOPs, (G, T/G, K) x (G, K, N), the speed every MoE GEMM wants.

Training-step columns (forward, dgrad and wgrad of y = x · W_g: the loss <y, dy> with a fixed dy and its gradients,
the loss returned too so that the forward is not dropped as dead code): `mx_ragged_dot`
with the mxfp8 and the bf16 recipes, and the batched dense bf16 dots. Each result is compared with the dense bf16
dot's on equal groups (where the two compute the same product). `--small` swaps in tiny shapes a CPU runs in seconds;
`--moe T,G,K,N` (repeatable) times those cases instead of the three shapes; `--grouping` and `--columns` time only
those groupings and columns.
`--sustained` and `--interleave` time the columns as the other benchmarks do (the GPU's steady state at its power
limit; the columns' samples taken in turn). `--kernels` adds where each column's time goes: the GPU time of each of
its kernels, from a CUPTI trace (for `ours`, the tokens' dequantization apart from the grouped kernel; for a step,
its GEMMs and quantization passes).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

import jax_blockgemm as jbg
from jax_blockgemm.bench import kernel_time, report
from jax_blockgemm.bench.inputs import GEMM_FORMATS, quantize_operand, random_values
from jax_blockgemm.bench.timing import describe, interleaved_medians_ms, median_ms

SHAPES = ((16384, 32, 7168, 2048), (16384, 32, 2048, 7168), (65536, 256, 7168, 2048))  # (T, G, K, N)
SMALL_SHAPES = ((256, 4, 96, 64), (512, 8, 64, 96))
GROUPINGS = ("equal", "skewed")
DIRICHLET_ALPHA = 0.5
FORWARD = {"ours": "ours(None)", "weight_only": "weight-only mxfp8", "mxfp8_recipe": "mx_ragged_dot mxfp8",
           "bf16_recipe": "mx_ragged_dot bf16", "ragged_dot": "lax.ragged_dot", "dense": "dense bf16"}
STEP = {"step_mxfp8": "step mxfp8", "step_bf16": "step bf16 recipe", "step_dense": "step dense bf16"}
KERNEL_TRACE_CALLS = 5  # calls traced together for --kernels


def group_sizes(tokens: int, groups: int, grouping: str, seed: int) -> np.ndarray:
    """(G,) int32 sizes summing to `tokens`: equal (the remainder spread over the first groups), or skewed by a
    Dirichlet(0.5) draw rounded by largest remainders (empty groups possible)."""
    if grouping == "equal":
        sizes = np.full(groups, tokens // groups)
        sizes[:tokens % groups] += 1
        return sizes.astype(np.int32)
    shares = np.random.default_rng(seed).dirichlet(np.full(groups, DIRICHLET_ALPHA)) * tokens
    sizes = np.floor(shares).astype(np.int64)
    order = np.argsort(sizes - shares)  # the largest remainders first
    sizes[order[:tokens - sizes.sum()]] += 1
    return sizes.astype(np.int32)


def format_key(base: str, fmt: str) -> str:
    """The column key of `base` ("ours", "weight_only") in format `fmt`: the bare key for MXFP8 E4M3."""
    return base if fmt == "mxfp8" else f"{base}_{fmt}"


def forward_columns(fmts: tuple[str, ...] = ("mxfp8",)) -> dict[str, str]:
    """Forward column key -> label: ours and weight-only per format, then the others."""
    per_format = {}
    for fmt in fmts:
        suffix = "" if fmt == "mxfp8" else f" {fmt}"
        per_format[format_key("ours", fmt)] = FORWARD["ours"] + suffix
        per_format[format_key("weight_only", fmt)] = f"weight-only {fmt}"
    return {**per_format, **{key: label for key, label in FORWARD.items() if key not in ("ours", "weight_only")}}


def inputs(key: jax.Array, tokens: int, groups: int, k: int, n: int, fmts: tuple[str, ...] = ("mxfp8",)
           ) -> dict[str, Any]:
    """bf16 x (T, K), w (G, K, N) and a cotangent dy (T, N); per format in `fmts` (suffixed by `format_key`): the
    codes and scales of x and of w (K-major, "a", "sfa", "b", "sfb"), alpha (NVFP4: the product of their per-tensor
    scales; else None) and w's experts as a QuantizedWeight ("wq", (G, N, K))."""
    kx, kw, kd = jax.random.split(key, 3)
    x, w = random_values(kx, (tokens, k)), random_values(kw, (groups, n, k))
    data = {"x": x.astype(jnp.bfloat16), "w": jnp.swapaxes(w, 1, 2).astype(jnp.bfloat16),
            "dy": jax.random.normal(kd, (tokens, n), jnp.bfloat16)}
    for fmt in fmts:
        (a, sfa, ta), (b, sfb, tb) = (quantize_operand(v, GEMM_FORMATS[fmt]) for v in (x, w))
        alpha = None if ta is None else (ta * tb).astype(jnp.float32)
        wq = jax.vmap(lambda e: jbg.quantize_weight(e, GEMM_FORMATS[fmt].weight_format))(w)
        data.update({format_key(name, fmt): value for name, value in
                     (("a", a), ("sfa", sfa), ("b", b), ("sfb", sfb), ("alpha", alpha), ("wq", wq))})
    return data


def _bf16_einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """One batched dot of bf16 operands, float32 accumulation, bf16 result."""
    return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32).astype(jnp.bfloat16)


@jax.custom_vjp
def _dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """The batched dense dot of the same FLOPs: x as (G, T/G, K) against w (G, K, N) (equal groups' layout). Its
    gradient is two more bf16 dots (dgrad, wgrad), as mx_ragged_dot's bf16 recipe computes them: autodiff of the
    float32-accumulating dot alone would run them on float32 cotangents, at a fraction of the bf16 rate."""
    g = w.shape[0]
    return _bf16_einsum("gtk,gkn->gtn", x.reshape(g, -1, x.shape[-1]), w).reshape(x.shape[0], -1)


def _dense_fwd(x, w):
    return _dense(x, w), (x, w)


def _dense_bwd(residuals, dy):
    x, w = residuals
    g = w.shape[0]
    xg, dyg = x.reshape(g, -1, x.shape[-1]), dy.reshape(g, -1, dy.shape[-1])
    dx = _bf16_einsum("gtn,gkn->gtk", dyg, w).reshape(x.shape)
    return dx.astype(x.dtype), _bf16_einsum("gtk,gtn->gkn", xg, dyg).astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)


def _step(matmul: Callable[[jax.Array, jax.Array], jax.Array]) -> Callable[..., Any]:
    """Forward, dgrad and wgrad of <matmul(x, w), dy>: what one expert layer's training step runs. The loss comes back
    with the gradients: they do not depend on the forward's result (the loss is linear in it), so with the gradients
    alone XLA would drop the forward GEMM."""
    def loss(x, w, dy):
        return jnp.vdot(matmul(x, w).astype(jnp.float32), dy.astype(jnp.float32))
    return jax.value_and_grad(loss, argnums=(0, 1))


def _ours(gs: jax.Array, fmt: str) -> tuple[Callable[..., Any], tuple[str, ...]]:
    """The ragged_gemm_amax column of format `fmt`: codes of x and w, bf16 C (NVFP4 with its alpha)."""
    block = GEMM_FORMATS[fmt].block
    if fmt == "nvfp4":
        return ((lambda a, b, sfa, sfb, alpha: jbg.ragged_gemm_amax(a, b, sfa, sfb, gs, alpha=alpha, sf_vec_size=block,
                                                                    c_dtype=jnp.bfloat16)[0]),
                tuple(format_key(x, fmt) for x in ("a", "b", "sfa", "sfb", "alpha")))
    return ((lambda a, b, sfa, sfb: jbg.ragged_gemm_amax(a, b, sfa, sfb, gs, sf_vec_size=block,
                                                         c_dtype=jnp.bfloat16)[0]),
            tuple(format_key(x, fmt) for x in ("a", "b", "sfa", "sfb")))


def columns(gs: jax.Array, fmts: tuple[str, ...] = ("mxfp8",), only: Optional[tuple[str, ...]] = None
            ) -> dict[str, tuple[Callable[..., Any], tuple[str, ...]]]:
    """Column key -> (function, the input names it takes), for the group sizes `gs` and the formats `fmts` of the
    ours and weight-only columns; with `only` (keys of FORWARD and STEP), those columns alone (in every format)."""
    bf16 = jnp.bfloat16
    per_format = {}
    for fmt in fmts:
        per_format[format_key("ours", fmt)] = _ours(gs, fmt)
        per_format[format_key("weight_only", fmt)] = (lambda x, wq: jbg.weight_only_ragged_matmul(x, wq, gs),
                                                      ("x", format_key("wq", fmt)))
    every = {
        **per_format,
        "mxfp8_recipe": (lambda x, w: jbg.mx_ragged_dot(x, w, gs, recipe="mxfp8"), ("x", "w")),
        "bf16_recipe": (lambda x, w: jbg.mx_ragged_dot(x, w, gs, recipe="bf16"), ("x", "w")),
        "ragged_dot": (lambda x, w: jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32).astype(bf16),
                       ("x", "w")),
        "dense": (_dense, ("x", "w")),
        "step_mxfp8": (_step(lambda x, w: jbg.mx_ragged_dot(x, w, gs, recipe="mxfp8")), ("x", "w", "dy")),
        "step_bf16": (_step(lambda x, w: jbg.mx_ragged_dot(x, w, gs, recipe="bf16")), ("x", "w", "dy")),
        "step_dense": (_step(_dense), ("x", "w", "dy")),
    }
    if only is None:
        return every
    wanted = {format_key(base, fmt) for base in only for fmt in fmts} | set(only)
    return {key: column for key, column in every.items() if key in wanted}


def _rel_err(got: Any, want: Any) -> float:
    leaves = zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))
    num = den = 0.0
    for g, w in leaves:
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        num, den = num + float(np.sum((g - w) ** 2)), den + float(np.sum(w ** 2))
    return (num / den) ** 0.5 if den else float("nan")


def run_case(key: jax.Array, tokens: int, groups: int, k: int, n: int, grouping: str, *, warmup: int, reps: int,
             burst: int, seed: int, progress: Any, kernels: bool = False, sustained: float = 0.0,
             interleave: bool = False, fmts: tuple[str, ...] = ("mxfp8",),
             only: Optional[tuple[str, ...]] = None) -> dict[str, Any]:
    """Times every column on one shape and grouping; returns the case's record. `sustained` and `interleave` as in
    `timing.interleaved_medians_ms` (interleaved: every column compiled first, then their samples taken in turn).
    With `kernels`, each column's record also holds the GPU time of each of its kernels ("kernels": label -> ms per
    call, `kernel_time`). `fmts`: the formats of the ours and weight-only columns; `only`: the columns to time
    (`columns`), all without it."""
    data = jax.block_until_ready(inputs(key, tokens, groups, k, n, fmts))
    gs = jnp.asarray(group_sizes(tokens, groups, grouping, seed))
    flops = 2.0 * tokens * k * n
    results: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    ready: dict[str, tuple[Callable[..., Any], tuple]] = {}
    progress.write(f"  T={tokens} G={groups} {k} -> {n}, {grouping}:")
    timing = dict(warmup=warmup, reps=reps, burst=burst, sustained=sustained)

    def record(name: str, ms: float) -> None:
        results[name] = {"ms": ms, "tflops": (3 if name in STEP else 1) * flops / (ms * 1e-3) / 1e12}
        if kernels:
            results[name]["kernels"] = kernel_time.kernel_ms(*ready[name], reps=KERNEL_TRACE_CALLS)
        progress.write(f" {name} {ms:.4g} ms;")

    for name, (fn, names) in columns(gs, fmts, only).items():
        args = tuple(data[x] for x in names)
        try:
            compiled = jax.jit(fn).lower(*args).compile()
            out = jax.block_until_ready(compiled(*args))
            outputs[name] = out[1] if name in STEP else out  # a step's gradients (not its loss) are compared
        except Exception as e:  # e.g. lax.ragged_dot out of memory at 256 experts: reported, not fatal
            results[name] = {"na": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"}
            progress.write(f" {name} n/a;")
            continue
        ready[name] = (compiled, args)
        if not interleave:
            record(name, median_ms(compiled, [args], **timing))
    if interleave and ready:
        times = interleaved_medians_ms([fn for fn, _ in ready.values()], [[args] for _, args in ready.values()],
                                       **timing)
        for name, ms in zip(ready, times):
            record(name, ms)
    progress.write("\n")
    progress.flush()
    if grouping == "equal":  # the dense dot computes the same product only when the groups are equal
        compared = [(name, "dense") for name in forward_columns(fmts) if name != "dense"]
        for name, ref in [*compared, ("step_mxfp8", "step_dense"), ("step_bf16", "step_dense")]:
            if name in outputs and ref in outputs:
                results[name]["rel_err_vs_dense"] = _rel_err(outputs[name], outputs[ref])
    return {"tokens": tokens, "groups": groups, "k": k, "n": n, "grouping": grouping, "formats": list(fmts),
            "group_sizes": [int(s) for s in np.asarray(gs)], "columns": results}


def _cell(result: dict[str, Any], dense: Optional[dict[str, Any]]) -> str:
    if "na" in result:
        return "fails"
    ratio = f" ({result['ms'] / dense['ms']:.2f}x)" if dense and "ms" in dense else ""
    return f"{result['ms']:.4g}{ratio}"


def format_table(record: dict[str, Any]) -> str:
    """Two tables (forward; training step): ms per call and, in parentheses, the ratio to the dense bf16 column."""
    lines = [f"{record['environment'].get('device', '?')}, {record['date']}: ms per call (x the dense bf16 dot's "
             "time of the same FLOPs); " + record["method"]["timing"]]
    fmts = tuple(record["method"].get("formats", ("mxfp8",)))
    forward = forward_columns(fmts)
    timed = {key for case in record["cases"] for key in case["columns"]}
    for title, keys, dense_key in (("forward -> bf16 (ours: codes of x and the experts, MXFP8 E4M3 unless named; "
                                    "weight-only: bf16 x, quantized experts; mx_ragged_dot mxfp8) and bf16", forward,
                                    "dense"),
                                   ("training step: forward, dgrad, wgrad", STEP, "step_dense")):
        keys = {key: label for key, label in keys.items() if key in timed}  # --columns may leave some out
        if not keys:
            continue
        lines += ["", title, "T, G, K -> N, groups".ljust(36) + "".join(v.rjust(24) for v in keys.values())]
        for case in record["cases"]:
            cols = case["columns"]
            label = f"{case['tokens']}, {case['groups']}, {case['k']} -> {case['n']}, {case['grouping']}"
            lines.append(label.ljust(36) + "".join(_cell(cols.get(key, {"na": "-"}), cols.get(dense_key)).rjust(24)
                                                   for key in keys))
    failures = [(case, key, r["na"]) for case in record["cases"] for key, r in case["columns"].items() if "na" in r]
    for case, key, why in failures:
        lines.append(f"  {key} at T={case['tokens']}, G={case['groups']}: {why}")
    worst: dict[str, float] = {}
    for case in record["cases"]:
        for key, r in case["columns"].items():
            if r.get("rel_err_vs_dense") is not None:
                worst[key] = max(worst.get(key, 0.0), r["rel_err_vs_dense"])
    if worst:
        names = {**forward, **STEP}
        lines.append("  equal groups, relative error against the dense bf16 dot (quantized columns: the format's own "
                     "rounding): " + ", ".join(f"{names[k]} {v:.2g}" for k, v in worst.items()))
    traced = [(case, key, r["kernels"]) for case in record["cases"] for key, r in case["columns"].items()
              if "kernels" in r]
    if traced:
        lines += ["", "GPU time per kernel, ms per call (a CUPTI trace of "
                  f"{KERNEL_TRACE_CALLS} calls; kernel time only, no gaps)"]
        names = {**forward, **STEP}
        for case, key, times in traced:
            label = f"{case['tokens']}, {case['groups']}, {case['k']} -> {case['n']}, {case['grouping']}, {names[key]}"
            lines.append(f"  {label}: {kernel_time.describe(times)}")
    return "\n".join(lines)


def main(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Runs the ragged benchmark with the command line's --moe, --small, --format, --grouping, --columns, --reps,
    --warmup, --burst, --sustained, --interleave, --seed, --kernels and --json; prints progress to stderr and the
    tables to stdout; returns the record."""
    shapes = args.moe or (SMALL_SHAPES if args.small else SHAPES)
    fmts = tuple(dict.fromkeys(name for names in args.format for name in names)) or ("mxfp8",)
    only = tuple(dict.fromkeys(name for names in args.columns for name in names)) or None
    groupings = tuple(dict.fromkeys(args.grouping)) or GROUPINGS
    timing = dict(warmup=args.warmup, reps=args.reps, burst=args.burst, sustained=args.sustained,
                  interleave=args.interleave)
    method = dict(warmup=args.warmup, reps=args.reps, burst=args.burst, sustained_s=args.sustained,
                  interleave=args.interleave, seed=args.seed, formats=list(fmts))  # the main benchmark's keys
    if only:
        method["columns"] = list(only)
    record = report.new_record(command, dict(method, timing=describe(
        reps=args.reps, burst=args.burst, sustained=args.sustained, interleave=args.interleave)))
    key = jax.random.key(args.seed)
    for i, (tokens, groups, k, n) in enumerate(shapes):
        for grouping in groupings:
            record["cases"].append(run_case(jax.random.fold_in(key, i), tokens, groups, k, n, grouping,
                                            seed=args.seed, progress=sys.stderr, kernels=args.kernels, fmts=fmts,
                                            only=only, **timing))
    print(format_table(record))
    if args.json:
        report.write_json(record, args.json)
    return record
