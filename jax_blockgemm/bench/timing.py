"""Wall-clock timing of jitted calls: warm-up, back-to-back bursts, sustained runs, interleaved columns, medians.

Everything here takes plain callables and argument tuples, so it times any function, not only the benchmark's.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np


def median_ms(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, warmup: int, reps: int, burst: int = 1,
              sustained: float = 0.0) -> float:
    """Median over `reps` samples of the wall time in ms per call, after `warmup` untimed calls.

    A sample is `burst` calls issued back to back and ended by one block_until_ready, divided by `burst`: with
    burst=1 each call's host latency (dispatch, launch, the wait) is in the figure; with more the host overlaps the
    device and the figure approaches the device time per call. The calls cycle through `arg_sets` (several input
    sets, so that caches do not hold one set between calls).
    With `sustained` > 0 seconds, samples follow each other for that long instead of `reps` times, and the median
    is over the samples of the last two thirds: the steady state of a GPU kept busy (clocks settle at its power
    limit within about a second), which is what a training loop sees.
    """
    return interleaved_medians_ms([fn], [arg_sets], warmup=warmup, reps=reps, burst=burst, sustained=sustained)[0]


def interleaved_medians_ms(fns: Sequence[Callable[..., Any]], arg_sets: Sequence[Sequence[tuple]], *, warmup: int,
                           reps: int, burst: int = 1, sustained: float = 0.0) -> list[float]:
    """`median_ms` of several functions at once (fns[i] on arg_sets[i]): each round takes one sample of every
    function in turn, so all of them meet the GPU in the same thermal state (timed one after another, the first
    runs on a cool GPU and the last on a hot one). Each round takes them in a fresh order (a seeded shuffle), so
    that no function always follows the same one: on the H200 the column that always ran right after the
    scaled_matmul pipeline's 15 ms burst was 3% slower than the same kernel in the next column, also with the order
    rotated (a rotation keeps every function's predecessor). With `sustained`, the functions share that time."""
    for fn, sets in zip(fns, arg_sets):
        for i in range(warmup):
            jax.block_until_ready(fn(*sets[i % len(sets)]))
    times: list[list[float]] = [[] for _ in fns]
    ends: list[float] = []
    calls = [0] * len(fns)
    orders = np.random.default_rng(0)
    first = time.perf_counter()
    while len(ends) < reps if sustained <= 0 else (not ends or ends[-1] - first < sustained):
        for j in orders.permutation(len(fns)):
            fn, sets = fns[j], arg_sets[j]
            start = time.perf_counter()
            out = None
            for _ in range(burst):
                out = fn(*sets[calls[j] % len(sets)])
                calls[j] += 1
            jax.block_until_ready(out)
            times[j].append((time.perf_counter() - start) / burst)
        ends.append(time.perf_counter())
    if sustained > 0:
        keep = [i for i, end in enumerate(ends) if end - first >= sustained / 3] or [len(ends) - 1]
        times = [[t[i] for i in keep] for t in times]
    return [1e3 * statistics.median(t) for t in times]


def describe(*, reps: int, burst: int, sustained: float = 0.0, interleave: bool = False) -> str:
    """The timing protocol of `interleaved_medians_ms` in words, for a record's method and a table's header: what
    the ratios between columns mean depends on it (docs/performance.md)."""
    per = "case" if interleave else "column"
    samples = (f"samples back to back for {sustained:g} s per {per}, the median over the last two thirds" if sustained
               else f"the median of {reps} samples")
    return (f"wall time per call of {burst} jitted calls issued back to back and ended by one block_until_ready; "
            + samples + ("; the columns' samples taken in turn" if interleave else ""))


def per_call_us(fn: Callable[..., Any], args: tuple, calls: int) -> float:
    """µs per call of `calls` back-to-back calls (no sync between them), after one warm-up call."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e6
