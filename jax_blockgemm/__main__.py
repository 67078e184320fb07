"""Demo: `python -m jax_blockgemm` builds a default problem for both operations, runs each on the best available
implementation, checks it against the pure-JAX reference and prints a table of results and timings."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_blockgemm as jbg
from jax_blockgemm import formats, support


def _median_ms(fn: Callable[..., Any], *args: Any, warmup: int = 2, reps: int = 10) -> float:
    """Median wall time in ms of `reps` calls, each waited for, after `warmup` untimed ones: a rough figure for the
    table (`python -m jax_blockgemm.bench` measures with bursts, rotated inputs and its baselines)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)


def _runs_kernel(fn: Callable, *args: Any) -> bool:
    """True when the lowered program calls one of our FFI kernels (rather than the reference)."""
    text = jax.jit(fn).lower(*args).as_text()
    return any("custom_call" in line and "jbg_" in line for line in text.splitlines())


def demo_gemm(m: int, n: int, k: int, implementation: Any) -> list[str]:
    """One table row for gemm_amax (MXFP8 E4M3 -> f32) at M x N x K: where it ran, its error, its time."""
    rng = np.random.default_rng(0)
    a, sfa = formats.quantize_mxfp8(jnp.asarray(rng.standard_normal((m, k)), jnp.float32))
    b, sfb = formats.quantize_mxfp8(jnp.asarray(rng.standard_normal((n, k)), jnp.float32))
    best = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation=implementation))
    ref = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation="xla"))
    (c, amax), (c_ref, amax_ref) = best(a, b, sfa, sfb), ref(a, b, sfa, sfb)
    rel = float(jnp.linalg.norm(c - c_ref) / jnp.linalg.norm(c_ref))
    t_best, t_ref = _median_ms(best, a, b, sfa, sfb), _median_ms(ref, a, b, sfa, sfb)
    kernel = _runs_kernel(lambda *x: jbg.gemm_amax(*x, implementation=implementation), a, b, sfa, sfb)
    tflops = 2 * m * n * k / (t_best * 1e-3) / 1e12
    return [f"gemm_amax MXFP8 {m}x{n}x{k} -> f32 [{implementation or 'best'}]",
            "CuTeDSL kernel" if kernel else "reference (no kernel here)",
            f"rel err {rel:.1e}, amax {float(amax):.4g} vs {float(amax_ref):.4g}",
            f"{t_best:.3f} ms ({tflops:.1f} TFLOP/s)", f"{t_ref:.3f} ms"]


def demo_proj_rope(tokens: int, heads: int, q_lora: int, mxfp8: bool, implementation: Any) -> list[str]:
    """One table row for gemm_proj_rope_mxfp8 on the bf16 or MXFP8 input path: where it ran, how many output bytes
    equal the reference's, its time."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((tokens, q_lora)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((heads * 192, q_lora)) / np.sqrt(q_lora), jnp.float32)
    angles = rng.uniform(0, 2 * np.pi, (tokens, 64))
    cos, sin = jnp.asarray(np.cos(angles), jnp.bfloat16), jnp.asarray(np.sin(angles), jnp.bfloat16)
    if mxfp8:
        (x, xs), (w, ws) = formats.quantize_mxfp8(x), formats.quantize_mxfp8(w)
        kw = dict(x_scale=xs, w_scale=ws)
    else:
        x, w, kw = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), {}
    best = jax.jit(lambda x, w, c, s: jbg.gemm_proj_rope_mxfp8(x, w, c, s, **kw, implementation=implementation))
    ref = jax.jit(lambda x, w, c, s: jbg.gemm_proj_rope_mxfp8(x, w, c, s, **kw, implementation="xla"))
    outs, refs = best(x, w, cos, sin), ref(x, w, cos, sin)
    same = [float(jnp.mean(o.view(jnp.uint8) == r.view(jnp.uint8))) for o, r in zip(outs, refs)]
    t_best, t_ref = _median_ms(best, x, w, cos, sin), _median_ms(ref, x, w, cos, sin)
    kernel = _runs_kernel(
        lambda x, w, c, s: jbg.gemm_proj_rope_mxfp8(x, w, c, s, **kw, implementation=implementation), x, w, cos, sin)
    return [f"proj_rope {'MXFP8' if mxfp8 else 'bf16'} in, T={tokens} H={heads} K={q_lora}",
            "CuTeDSL kernel" if kernel else "reference (no kernel here)",
            f"bytes equal to reference: codes {min(same[0], same[2]):.2%}, scales {min(same[1], same[3]):.2%}",
            f"{t_best:.3f} ms", f"{t_ref:.3f} ms"]


def main(argv: list[str] | None = None) -> None:
    """Parses the sizes (small defaults on a CPU), runs both operations and prints the table."""
    parser = argparse.ArgumentParser(prog="python -m jax_blockgemm", description=__doc__)
    gpu = jax.default_backend() == "gpu"
    parser.add_argument("--m", type=support.count_arg(), default=4096 if gpu else 256)
    parser.add_argument("--n", type=support.count_arg(), default=4096 if gpu else 256)
    parser.add_argument("--k", type=support.count_arg(), default=4096 if gpu else 512)
    parser.add_argument("--tokens", type=support.count_arg(), default=2048 if gpu else 64)
    parser.add_argument("--heads", type=support.count_arg(), default=128 if gpu else 4)
    parser.add_argument("--q-lora", type=support.count_arg(), default=1536 if gpu else 256)
    parser.add_argument("--implementation", choices=("best", "cutedsl", "xla"), default="best")
    args = parser.parse_args(argv)
    try:
        _run(args, gpu)
    except ValueError as e:  # sizes the operations refuse (K a multiple of 32, ...), or no kernel for "cutedsl"
        parser.error(str(e))


def _run(args: argparse.Namespace, gpu: bool) -> None:
    """Both operations at the parsed sizes, and the table."""
    impl = None if args.implementation == "best" else args.implementation
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}); "
          f"implementation={args.implementation}")
    rows = [demo_gemm(args.m, args.n, args.k, impl)]
    if impl is None and gpu:  # also show the kernel where "best" chose the reference for speed
        try:
            rows.append(demo_gemm(args.m, args.n, args.k, "cutedsl"))
        except ValueError as e:  # no kernel for this GPU
            print(f"(no CuTeDSL gemm_amax kernel for this GPU: {e})")
    rows += [demo_proj_rope(args.tokens, args.heads, args.q_lora, False, impl),
             demo_proj_rope(args.tokens, args.heads, args.q_lora, True, impl)]
    header = ["problem", "ran on", "check against the reference", "time", "reference time"]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths)))


if __name__ == "__main__":
    main()
