"""Training-step time of one MLP with three matmuls: mx_dot_general (MXFP8) vs jax.nn.scaled_dot_general (MXFP8
config, cuDNN) vs bf16 dots, and how closely their loss curves agree. On an H200 it takes under 3 minutes.

Usage: python benchmarks/train_step.py [--out DIR] [--sizes 64,4096,4096,4096,10] [--batch 4096] [--steps 200]

The model is jax_blockgemm.examples.mlp's digits MLP (the notebook's and CI's), widened so the GEMMs are worth
timing. Step time: the jitted Adam step (forward, dgrad, wgrad, update), median of 20 timed steps after 3 warm-up
steps, block_until_ready around each. Loss curves: --steps training steps on digits from the same seed for each
variant; final loss (mean of the last 20 steps) and the largest gap between smoothed curves, relative to bf16's
initial loss.
A variant that cannot run on the device (jax.nn.scaled_dot_general has no CPU lowering, and cuDNN's MXFP8 may need
Blackwell) is reported with its error instead of a time. Prints a table and writes train_step.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback

import jax
import numpy as np

from jax_blockgemm.examples import mlp

VARIANTS = ("mxfp8", "jax.nn mxfp8", "bf16")


def step_time_s(dot_general, sizes, batch, data, *, warmup=3, reps=20) -> float:
    """Median wall time of one jitted training step (after warm-up)."""
    import optax

    x_train, y_train = data[0], data[1]
    params = mlp.init_mlp(jax.random.key(0), sizes)
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(params)
    step = mlp.make_step(dot_general, optimizer)
    rng = np.random.default_rng(0)
    batches = [(jax.device_put(x_train[idx]), jax.device_put(y_train[idx]))
               for idx in (rng.integers(0, len(x_train), batch) for _ in range(4))]
    for i in range(warmup):
        params, opt_state, loss = step(params, opt_state, *batches[i % 4])
    jax.block_until_ready(loss)
    times = []
    for i in range(reps):
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, *batches[i % 4])
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def smoothed(losses: np.ndarray, window: int = 10) -> np.ndarray:
    """The loss curve's moving average over `window` steps, so that curves are compared without step noise."""
    return np.convolve(losses, np.ones(window) / window, mode="valid")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".", help="directory for train_step.json and train_step.png")
    parser.add_argument("--sizes", default="64,4096,4096,4096,10", help="layer widths, input first")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=200, help="training steps for the loss curves")
    args = parser.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))
    data = mlp.digits_data(seed=0)
    device = jax.devices()[0]
    results = {}
    for name in VARIANTS:
        dot_general = mlp.DOT_GENERALS[name]
        try:
            started = time.perf_counter()
            t = step_time_s(dot_general, sizes, args.batch, data)
            run = mlp.train(dot_general, data, sizes=sizes, steps=args.steps, batch=args.batch, seed=0)
            results[name] = {"step_ms": 1e3 * t, "losses": run["losses"].tolist(),
                             "final_loss": float(run["losses"][-20:].mean()), "test_accuracy": run["test_accuracy"],
                             "wall_s": time.perf_counter() - started}
        except Exception as e:  # a variant the device cannot run: reported, not fatal
            where = traceback.extract_tb(e.__traceback__)[-1]
            message = (str(e).splitlines() or [""])[0][:300]
            results[name] = {"error": f"{type(e).__name__}: {message} (at {where.filename}:{where.lineno})"}
    bf16 = results.get("bf16", {})
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}, sizes {sizes}, batch {args.batch}")
    print(f"{'variant':14s} {'step ms':>9s} {'vs bf16':>8s} {'vs jax.nn':>9s} {'final loss':>11s} "
          f"{'max curve gap':>13s} {'accuracy':>9s}")
    jnn = results.get("jax.nn mxfp8", {})
    for name, r in results.items():
        if "error" in r:
            print(f"{name:14s} not run: {r['error']}")
            continue
        ratio = lambda other: f"{r['step_ms'] / other['step_ms']:.2f}x" if "step_ms" in other else "-"
        if "losses" in bf16:
            # relative to bf16's initial loss: both curves fall to ~1e-5, where a ratio of the two is noise
            ref = smoothed(np.array(bf16["losses"]))
            gap = np.max(np.abs(smoothed(np.array(r["losses"])) - ref)) / ref[0]
            r["max_curve_gap_rel"] = float(gap)
        print(f"{name:14s} {r['step_ms']:9.3f} {ratio(bf16):>8s} {ratio(jnn):>9s} {r['final_loss']:11.5f} "
              f"{r.get('max_curve_gap_rel', float('nan')):13.3%} {r['test_accuracy']:9.3f}")
    os.makedirs(args.out, exist_ok=True)
    curves = {k: np.array(v["losses"]) for k, v in results.items() if "losses" in v}
    if curves:
        mlp.plot_curves(curves, os.path.join(args.out, "train_step.png"), title=f"sizes {sizes}, batch {args.batch}")
    record = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__, "sizes": sizes,
              "batch": args.batch, "steps": args.steps, "timing": "median of 20 steps after 3 warm-up",
              "results": results}
    with open(os.path.join(args.out, "train_step.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
