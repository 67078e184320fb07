"""Time the pure-JAX reference on one device, beside its baselines, in one run.

Usage: python3 benchmarks/reference_variants.py --out OUT/refvariants.json [--small] [--reps 20] [--budget-s 200]
                                                 [--no-hlo]

proj_rope: `reference.gemm_proj_rope_reference` ("reference"), the same through the public API ("public_api",
`jbg.gemm_proj_rope_mxfp8(implementation="xla")`), XLA's bare bf16 dot (both weight layouts) and a plain unfused
jnp pipeline (bf16 dot -> RoPE -> row + column MXFP8, float32 Y), at T in {2048, 4096}, K = 1536, H = 128,
bf16 and MXFP8 inputs. The public API's four outputs must be bit-identical to the reference's, on the timing
inputs and on inputs with planted zero, NaN and inf blocks. (The candidate formulations this script timed on
2026-11-29, and the decision they led to, are in benchmarks/NOTES.md, "Reference speed"; the formulation before
them is kept as `legacy_proj_rope` in tests/test_reference_formulation.py.)

gemm_amax: the reference with the bfloat16-dequantization dot and with the `jax.lax.scaled_dot` route (where
the installed jax has it; off in the primitives, see reference.SCALED_DOT_MIN_SIZE), plus bare
`jax.lax.scaled_dot`, MXFP8 E4M3 -> f32 at 8192^3, 4096x24576x1536 and 4096x7168x16384; the route's C must be
within 1e-4 (normwise) of the dequant path's and its amax within 1e-4, and a NaN scale must poison its row of C
and amax. At the first shape, the dequant path's phases are also timed alone (operand dequantization, bf16 dot
of ready operands, amax of a ready C).

Times: median of --reps jitted calls, each ended by block_until_ready, after 3 warm-up calls, two fresh random
input sets (non-zero, random block scales) alternating. Prints a progress line per case and a table at the end;
writes everything to --out as JSON, and the optimized HLO (XLA's fusions) of the reference at the first T and
of both GEMM routes at the first shape, gzipped, to <out without .json>_hlo/. --small runs tiny shapes (a
minute on a CPU) to test the script itself. Cases started after --budget-s seconds are skipped.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

try:
    import jax_blockgemm as jbg
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax_blockgemm as jbg
from jax_blockgemm import bench, formats, reference

E4M3 = jnp.float8_e4m3fn
REFERENCE = "reference"  # reference.gemm_proj_rope_reference; every other proj_rope variant is compared with it


# ----------------------------------------------------------------------------------------------------------------
# Baselines


def bare_dot(x, w, *, w_out_in):
    """XLA's bf16 dot of the projection's shape, bf16 out (the issue's anchor)."""
    return jax.lax.dot_general(x, w, (((1,), (1 if w_out_in else 0,)), ((), ())))


def _plain_mxfp8(blocks: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """Textbook MXFP8 on a block view (no NaN/inf/zero-block care): ceil(log2(amax/448)), scale, cast."""
    amax = jnp.max(jnp.abs(blocks), axis=axis, keepdims=True)
    e = jnp.clip(jnp.ceil(jnp.log2(amax / 448.0)), -127, 127)
    codes = jnp.clip(blocks * jnp.exp2(-e), -448.0, 448.0).astype(E4M3)
    return codes, (e + 127).astype(jnp.uint8)


def unfused_pipeline(x, w, cos, sin, *, x_scale=None, w_scale=None):
    """A plain jnp pipeline of the same math: bf16 dot (f32 out) -> RoPE -> row and column MXFP8 (w as (N, K))."""
    if x.dtype == np.dtype(E4M3):
        x = reference.dequantize_bf16(x, x_scale, block=32, axis=1)
        w = reference.dequantize_bf16(w, w_scale, block=32, axis=1)
    y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    t, n = y.shape
    y = reference.apply_rope(y.reshape(t, n // 192, 192), cos, sin)
    row_codes, row_scales = _plain_mxfp8(y.reshape(t, n // 192, 6, 32), -1)
    col_codes, col_scales = _plain_mxfp8(y.reshape(t // 32, 32, n), 1)
    return row_codes.reshape(t, n // 192, 192), row_scales, col_codes.reshape(t, n // 192, 192), col_scales


# ----------------------------------------------------------------------------------------------------------------
# Timing and inputs


def median_ms(fn: Callable, arg_sets: list, *, reps: int, warmup: int = 3) -> float:
    """The benchmark's timing method (jax_blockgemm.bench.median_ms), with this script's default warm-up."""
    return bench.median_ms(fn, arg_sets, warmup=warmup, reps=reps)


def proj_rope_inputs(key, *, t: int, h: int, k: int, mxfp8: bool, special: bool = False) -> tuple:
    """(x, w, cos, sin[, x_scale, w_scale]) with w as (H*192, K), made on the device. special=True plants a zero
    token and a zero feature, and a NaN and an inf in x (MXFP8 path: a NaN scale byte, overflowing scales)."""
    kx, kw, ka, ks1, ks2 = jax.random.split(key, 5)
    n = h * 192
    angles = jax.random.uniform(ka, (t, 64), jnp.float32, -np.pi, np.pi)
    cos, sin = jnp.cos(angles).astype(jnp.bfloat16), jnp.sin(angles).astype(jnp.bfloat16)
    if mxfp8:
        x = jnp.clip(jax.random.normal(kx, (t, k)) * 32.0, -448, 448).astype(E4M3)
        w = jnp.clip(jax.random.normal(kw, (n, k)) * 32.0, -448, 448).astype(E4M3)
        x_scale = jax.random.randint(ks1, (t, k // 32), 119, 128).astype(jnp.uint8)
        w_scale = jax.random.randint(ks2, (n, k // 32), 119, 128).astype(jnp.uint8)
    else:
        x = (jax.random.normal(kx, (t, k)) * 2.0).astype(jnp.bfloat16)
        w = (jax.random.normal(kw, (n, k)) / np.sqrt(k)).astype(jnp.bfloat16)
    if special:  # zero token 1 and feature 5 (zero row and column blocks), NaN in token t/2, inf in token t-1
        x, w = x.at[1].set(0), w.at[5].set(0)
        if mxfp8:  # E4M3 has no inf: a NaN scale byte, and scale bytes that overflow the dequantized operand
            x_scale = x_scale.at[t // 2, 0].set(0xFF).at[t - 1, :].set(254)
        else:
            x = x.at[t // 2, 3].set(jnp.nan).at[t - 1, k // 2].set(jnp.inf)
    return (x, w, cos, sin, x_scale, w_scale) if mxfp8 else (x, w, cos, sin)


def _as_bits(a: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype != np.dtype(jnp.uint8) else a


def mismatches(outs, ref) -> list[int]:
    """Differing elements per output (compared as raw bytes, so NaN codes compare too)."""
    return [int(jnp.sum(_as_bits(a) != _as_bits(b))) for a, b in zip(outs, ref)]


def proj_rope_fns(mxfp8: bool) -> dict[str, Callable]:
    def with_scales(fn):
        if mxfp8:
            return lambda x, w, c, s, xs, ws: fn(x, w, c, s, x_scale=xs, w_scale=ws)
        return lambda x, w, c, s: fn(x, w, c, s)

    fns = {REFERENCE: with_scales(reference.gemm_proj_rope_reference),
           "public_api": with_scales(functools.partial(jbg.gemm_proj_rope_mxfp8, implementation="xla"))}
    return {name: jax.jit(fn) for name, fn in fns.items()}


class Budget:
    """Wall-clock budget: cases after the deadline are recorded as skipped, not run."""

    def __init__(self, seconds: float):
        self.start, self.seconds = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> bool:
        return self.elapsed() < self.seconds


def log(budget: Budget, msg: str) -> None:
    print(f"[{budget.elapsed():6.1f}s] {msg}", flush=True)


def dump_hlo(hlo_dir: str | None, name: str, fn: Callable, args: tuple, budget: Budget) -> None:
    """Writes the optimized HLO (XLA's fusions, as compiled for this device) of fn(*args) as gzipped text."""
    if not hlo_dir or not budget.left():
        return
    try:
        text = fn.lower(*args).compile().as_text()
        os.makedirs(hlo_dir, exist_ok=True)
        with gzip.open(os.path.join(hlo_dir, name.replace("/", "_") + ".hlo.txt.gz"), "wt") as f:
            f.write(text)
        log(budget, f"wrote the optimized HLO of {name}")
    except Exception as e:  # a missing dump never costs the measurements
        log(budget, f"no HLO for {name}: {type(e).__name__}: {str(e)[:200]}")


def run_proj_rope(key, *, t: int, h: int, k: int, mxfp8: bool, reps: int, budget: Budget,
                  hlo_dir: str | None = None) -> dict:
    path = "mxfp8" if mxfp8 else "bf16"
    case = {"t": t, "h": h, "k": k, "path": path, "variants": {}}
    sets = [proj_rope_inputs(kk, t=t, h=h, k=k, mxfp8=mxfp8) for kk in jax.random.split(key, 2)]
    special = proj_rope_inputs(jax.random.fold_in(key, 7), t=t, h=h, k=k, mxfp8=mxfp8, special=True)
    baselines = {"unfused_pipeline": jax.jit(lambda x, w, c, s, *sc: unfused_pipeline(x, w, c, s, **(
        dict(x_scale=sc[0], w_scale=sc[1]) if sc else {})))}
    if not mxfp8:
        wt = [jnp.asarray(s[1].T) for s in sets]
        baselines["bare_dot_w_nk"] = jax.jit(lambda x, w, *_: bare_dot(x, w, w_out_in=True))
        baselines["bare_dot_w_kn"] = jax.jit(lambda x, w, *_: bare_dot(x, w, w_out_in=False))
    for name, fn in baselines.items():  # first: cheap to compile, and every ratio needs them
        if not budget.left():
            case["variants"][name] = {"skipped": "time budget"}
            continue
        arg_sets = [(s[0], wt[i]) for i, s in enumerate(sets)] if name == "bare_dot_w_kn" else sets
        case["variants"][name] = {"ms": median_ms(fn, arg_sets, reps=reps)}
        log(budget, f"proj_rope T={t} {path:5} {name:24} {case['variants'][name]['ms']:8.3f} ms")
    fns = proj_rope_fns(mxfp8)
    ref_clean, ref_special = fns[REFERENCE](*sets[0]), fns[REFERENCE](*special)
    for name, fn in fns.items():
        if not budget.left():
            case["variants"][name] = {"skipped": "time budget"}
            continue
        try:
            m_clean, m_special = mismatches(fn(*sets[0]), ref_clean), mismatches(fn(*special), ref_special)
            ms = median_ms(fn, sets, reps=reps)
            case["variants"][name] = {"ms": ms, "identical": not any(m_clean) and not any(m_special),
                                      "mismatches_clean": m_clean, "mismatches_special": m_special}
            log(budget, f"proj_rope T={t} {path:5} {name:24} {ms:8.3f} ms  identical="
                        f"{case['variants'][name]['identical']}")
        except Exception as e:  # a formulation that fails to compile or run is reported, not hidden
            case["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            log(budget, f"proj_rope T={t} {path:5} {name:24} ERROR {case['variants'][name]['error']}")
    dump_hlo(hlo_dir, f"proj_rope_T{t}_{path}_{REFERENCE}", fns[REFERENCE], sets[0], budget)
    return case


def gemm_inputs(key, m: int, n: int, k: int) -> tuple:
    """E4M3 codes (1, M, K), (1, N, K) and physical scale atoms with random bytes in [118, 136)."""
    ka, kb, ksa, ksb = jax.random.split(key, 4)
    a = jnp.clip(jax.random.normal(ka, (1, m, k)) * 4.0, -448, 448).astype(E4M3)
    b = jnp.clip(jax.random.normal(kb, (1, n, k)) * 4.0, -448, 448).astype(E4M3)
    sfa = jax.random.randint(ksa, (1, m, k // 32), 118, 136).astype(jnp.uint8)
    sfb = jax.random.randint(ksb, (1, n, k // 32), 118, 136).astype(jnp.uint8)
    return a, b, formats.to_scale_atom(sfa), formats.to_scale_atom(sfb), sfa, sfb


def gemm_fns(k: int) -> dict[str, Callable]:
    ref = functools.partial(reference.gemm_amax_reference, k=k, sf_vec_size=32, c_dtype=np.dtype(jnp.float32))
    fns = {"dequant": lambda a, b, sa, sb, *_: ref(a, b, sa, sb, scaled_dot=False)}
    if reference.has_scaled_dot():
        fns["scaled_dot"] = lambda a, b, sa, sb, *_: ref(a, b, sa, sb, scaled_dot=True)

        def bare(a, b, _sa, _sb, sa, sb):
            e8 = lambda s: jax.lax.bitcast_convert_type(s, formats.E8M0)
            return jax.lax.scaled_dot(a, b, lhs_scale=e8(sa), rhs_scale=e8(sb),
                                      dimension_numbers=(((2,), (2,)), ((0,), (0,))),
                                      preferred_element_type=jnp.float32)

        fns["lax_scaled_dot_bare"] = bare
    return {name: jax.jit(fn) for name, fn in fns.items()}


def gemm_phases(m: int, n: int, k: int, sets: list, c: jax.Array, *, reps: int, budget: Budget) -> dict:
    """The dequant path's phases timed alone: both operands to bf16, the bf16 dot (f32 out) of ready operands,
    and the amax reduction of a ready C (where the reference's time goes beyond the bare dot)."""
    dequant = jax.jit(lambda a, b, sa, sb, *_: tuple(
        reference._dequantize_operand(x, s, mn=mn, k=k, sf_vec_size=32, k_axis=2)
        for x, s, mn in ((a, sa, m), (b, sb, n))))
    dot = jax.jit(lambda a_hat, b_hat: reference._bf16_dot(a_hat, b_hat, (((2,), (2,)), ((0,), (0,)))))
    amax = jax.jit(lambda c: formats.magnitude_max(c, axis=(1, 2)))
    phases = {}
    try:
        phases["dequant_operands"] = median_ms(dequant, sets, reps=reps)
        phases["bf16_dot_f32_out"] = median_ms(dot, [dequant(*args) for args in sets], reps=reps)
        phases["amax_of_c"] = median_ms(amax, [(c,)], reps=reps)
    except Exception as e:
        phases["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    log(budget, f"gemm {m}x{n}x{k} phases of the dequant path (ms): "
                f"{ {name: round(v, 3) if isinstance(v, float) else v for name, v in phases.items()} }")
    return phases


def _relative(got: jax.Array, want: jax.Array) -> float:
    err = jnp.sqrt(jnp.sum(jnp.square(got - want)))
    return float(err / jnp.sqrt(jnp.sum(jnp.square(want))))


def nan_scale_poisons(k: int = 128) -> dict:
    """The scaled_dot route with one NaN scale byte in A: exactly that row of C NaN, amax NaN."""
    a, b, _, _, sfa, sfb = gemm_inputs(jax.random.key(3), 160, 96, k)
    sfa = sfa.at[0, 37, 1].set(0xFF)
    fn = jax.jit(functools.partial(reference.gemm_amax_reference, k=k, sf_vec_size=32,
                                   c_dtype=np.dtype(jnp.float32), scaled_dot=True))
    c, amax = fn(a, b, formats.to_scale_atom(sfa), formats.to_scale_atom(sfb))
    nan_rows = np.flatnonzero(np.isnan(np.asarray(c[0])).any(axis=1))
    full_row = bool(np.isnan(np.asarray(c[0, 37])).all())
    return {"nan_rows": nan_rows.tolist(), "row_all_nan": full_row, "amax_nan": bool(np.isnan(amax[0])),
            "ok": nan_rows.tolist() == [37] and full_row and bool(np.isnan(amax[0]))}


def run_gemm(key, *, m: int, n: int, k: int, reps: int, budget: Budget, hlo_dir: str | None = None,
             phases: bool = False) -> dict:
    case = {"shape": [m, n, k], "variants": {}}
    flops = 2.0 * m * n * k
    sets = [gemm_inputs(kk, m, n, k) for kk in jax.random.split(key, 2)]
    fns = gemm_fns(k)
    c_ref, amax_ref = fns["dequant"](*sets[0])
    for name, fn in fns.items():
        if not budget.left():
            case["variants"][name] = {"skipped": "time budget"}
            continue
        try:
            out = fn(*sets[0])
            c = out[0] if isinstance(out, tuple) else out
            row = {"rel_err_vs_dequant": _relative(c, c_ref)}
            if isinstance(out, tuple):
                row["amax_rel_err"] = float(jnp.abs(out[1][0] - amax_ref[0]) / amax_ref[0])
            row["ok"] = row["rel_err_vs_dequant"] <= 1e-4 and row.get("amax_rel_err", 0.0) <= 1e-4
            del out, c
            row["ms"] = median_ms(fn, sets, reps=reps)
            row["tflops"] = flops / row["ms"] / 1e9
            case["variants"][name] = row
            log(budget, f"gemm {m}x{n}x{k} {name:20} {row['ms']:8.3f} ms {row['tflops']:6.0f} TF  "
                        f"rel {row['rel_err_vs_dequant']:.2e} ok={row['ok']}")
        except Exception as e:
            case["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            log(budget, f"gemm {m}x{n}x{k} {name:20} ERROR {case['variants'][name]['error']}")
    if phases and budget.left():
        case["phases_ms"] = gemm_phases(m, n, k, sets, c_ref, reps=reps, budget=budget)
    for name in ("dequant", "scaled_dot"):
        if name in fns:
            dump_hlo(hlo_dir, f"gemm_{m}x{n}x{k}_{name}", fns[name], sets[0], budget)
    return case


# ----------------------------------------------------------------------------------------------------------------
# Report


def _cell(v: dict, base_ms: float | None = None) -> str:
    if "ms" not in v:
        return "skipped" if "skipped" in v else "ERROR"
    ratio = f" {v['ms'] / base_ms:5.2f}x" if base_ms else ""
    flag = "" if v.get("identical", True) else " DIFF"
    return f"{v['ms']:7.3f}{ratio}{flag}"


def _faster_bare_dots(cases: list) -> dict:
    """T -> the faster of the two bare bf16 dots (either weight layout) timed in the bf16 case of that T."""
    dots = {}
    for c in cases:
        if c["path"] == "bf16":
            ms = [c["variants"][d]["ms"] for d in ("bare_dot_w_nk", "bare_dot_w_kn")
                  if "ms" in c["variants"].get(d, {})]
            dots[c["t"]] = min(ms) if ms else None
    return dots


def print_summary(cases: list) -> None:
    """Per case, the reference against the unfused pipeline and the faster bare bf16 dot."""
    print("\nreference per case (ratio to the unfused pipeline, to the faster bare bf16 dot of the same T):")
    dots = _faster_bare_dots(cases)
    for c in cases:
        ref = c["variants"].get(REFERENCE, {}).get("ms")
        if ref is None:
            continue
        pipeline, dot = c["variants"].get("unfused_pipeline", {}).get("ms"), dots.get(c["t"])
        print(f"  T={c['t']} {c['path']:5} {ref:7.3f} ms"
              + (f"  {ref / pipeline:5.2f}x pipeline" if pipeline else "")
              + (f"  {ref / dot:5.2f}x bare dot" if dot else ""))


def print_tables(record: dict) -> None:
    cases = record["proj_rope"]
    if cases:
        print("\nproj_rope: ms and ratio to the faster bare bf16 dot of the same T (DIFF = not bit-identical to the "
              "reference)")
        cols = [f"T={c['t']} {c['path']}" for c in cases]
        print(f"{'variant':24}" + "".join(f"{h:>22}" for h in cols))
        dots = _faster_bare_dots(cases)
        names = list(dict.fromkeys(n for c in cases for n in c["variants"]))
        for name in names:
            row = [_cell(c["variants"].get(name, {"skipped": 1}), dots.get(c["t"])) for c in cases]
            print(f"{name:24}" + "".join(f"{r:>22}" for r in row))
        for c in cases:
            if "error" in c:
                print(f"T={c['t']} {c['path']}: ERROR {c['error']}")
        print_summary(cases)
    if record["gemm"]:
        print("\ngemm_amax reference, E4M3 -> f32: ms (TFLOP/s), C error against the dequant path")
        for c in record["gemm"]:
            m, n, k = c["shape"]
            parts = []
            for name, v in c["variants"].items():
                if "ms" in v:
                    parts.append(f"{name} {v['ms']:.3f} ({v['tflops']:.0f}) rel {v['rel_err_vs_dequant']:.1e}"
                                 f"{'' if v['ok'] else ' FAIL'}")
                else:
                    parts.append(f"{name} {'skipped' if 'skipped' in v else 'ERROR'}")
            dq, sd = c["variants"].get("dequant", {}), c["variants"].get("scaled_dot", {})
            speedup = f"  scaled_dot/dequant {sd['ms'] / dq['ms']:.2f}" if "ms" in dq and "ms" in sd else ""
            print(f"{m}x{n}x{k}: " + " | ".join(parts) + speedup + (f"ERROR {c['error']}" if "error" in c else ""))
            if "phases_ms" in c:
                phases = c["phases_ms"].items()
                print("  dequant path alone, phase by phase: " + ", ".join(
                    f"{name} {v:.3f} ms" if isinstance(v, float) else f"{name} {v}" for name, v in phases))
    if "nan_scale" in record:
        print(f"\nscaled_dot route, NaN scale byte: {record['nan_scale']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "refvariants.json"))
    parser.add_argument("--small", action="store_true", help="tiny shapes: a quick run of the script on a CPU")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per case (default 20, --small 3)")
    parser.add_argument("--no-hlo", action="store_true",
                        help="skip the optimized-HLO dumps (default: a few, gzipped, in <out>_hlo/)")
    parser.add_argument("--budget-s", type=float, default=200.0, help="skip cases started after this many seconds")
    args = parser.parse_args(argv)
    reps = args.reps or (3 if args.small else 20)
    if args.small:
        proj_shapes, h, k, gemm_shapes = [64], 3, 96, [(256, 192, 320), (96, 160, 64)]
    else:
        proj_shapes, h, k = [4096, 2048], 128, 1536
        gemm_shapes = [(8192, 8192, 8192), (4096, 24576, 1536), (4096, 7168, 16384)]
    budget = Budget(args.budget_s)
    device = jax.devices()[0]
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "device": device.device_kind,
              "platform": device.platform, "jax": jax.__version__, "command": " ".join(sys.argv),
              "has_scaled_dot": reference.has_scaled_dot(),
              "reps": reps, "proj_rope": [], "gemm": []}
    log(budget, f"{record['device']} ({record['platform']}), jax {record['jax']}, "
                f"scaled_dot {'present' if record['has_scaled_dot'] else 'absent'}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    hlo_dir = None if args.no_hlo else os.path.splitext(os.path.abspath(args.out))[0] + "_hlo"

    def save() -> None:  # after every case, so that a run cut short still leaves its figures
        record["elapsed_s"] = budget.elapsed()
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)

    key = jax.random.key(2026)

    def guarded(run: Callable, stub: dict) -> dict:  # a case that fails outside its variants is recorded, not fatal
        try:
            return run()
        except Exception as e:
            log(budget, f"case {stub} failed: {type(e).__name__}: {str(e)[:300]}")
            return {**stub, "variants": {}, "error": f"{type(e).__name__}: {str(e)[:300]}"}

    def proj_rope_cases(t: int) -> None:
        for mxfp8 in (False, True):
            run = functools.partial(run_proj_rope, jax.random.fold_in(key, t * 2 + mxfp8), t=t, h=h, k=k,
                                    mxfp8=mxfp8, reps=reps, budget=budget,
                                    hlo_dir=hlo_dir if t == proj_shapes[0] else None)
            record["proj_rope"].append(guarded(run, {"t": t, "h": h, "k": k, "path": "mxfp8" if mxfp8 else "bf16"}))
            save()

    proj_rope_cases(proj_shapes[0])  # the headline T first, then the GEMMs, then the other T (budget order)
    for i, (m, n, kk) in enumerate(gemm_shapes):
        run = functools.partial(run_gemm, jax.random.fold_in(key, 100 + i), m=m, n=n, k=kk, reps=reps,
                                budget=budget, hlo_dir=hlo_dir if i == 0 else None, phases=i == 0)
        record["gemm"].append(guarded(run, {"shape": [m, n, kk]}))
        save()
    for t in proj_shapes[1:]:
        proj_rope_cases(t)
    if reference.has_scaled_dot():
        try:
            record["nan_scale"] = nan_scale_poisons()
        except Exception as e:
            record["nan_scale"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    save()
    print_tables(record)
    print(f"\nwrote {args.out} after {record['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
