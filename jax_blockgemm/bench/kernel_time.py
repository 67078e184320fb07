"""GPU time per kernel of one jitted program: a CUPTI trace taken through `jax.profiler`, summed per kernel.

The benchmark's wall times say how long a program takes; this says which of its kernels take it (a training step's
forward, dgrad and wgrad GEMMs, the quantization passes). Only the device's stream tracks count: on a machine
without a GPU the trace holds none, and the result is empty.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
from typing import Any, Callable, Iterable, Mapping

import jax

# our CuTeDSL kernels carry their module path and class in the symbol, e.g.
# 'kernel_cutlass_kernel_jax_blockgemmkernelssm90raggedHopperRaggedBf16Gemm_object_at__CopyAt...'
_OUR_KERNEL = re.compile(r"jax_blockgemmkernels[a-z0-9_]*?([A-Z][A-Za-z0-9]*?)_object")


def kernel_label(name: str) -> str:
    """A short name for a kernel of the trace: the class of one of our kernels, else the name XLA gave it."""
    match = _OUR_KERNEL.search(name)
    return match.group(1) if match else name


def device_kernel_us(events: Iterable[Mapping[str, Any]], device: str = "/device:GPU:") -> dict[str, float]:
    """Microseconds per kernel label, summed over the complete events ("ph": "X") on the stream tracks ("Stream
    #..." threads) of the processes whose name holds `device`, from a trace in the Chrome trace-event format."""
    events = list(events)
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    totals: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if (e.get("ph") == "X" and device in processes.get(e.get("pid"), "")
                and threads.get((e.get("pid"), e.get("tid")), "").startswith("Stream")):
            totals[kernel_label(e["name"])] += float(e.get("dur", 0.0))
    return dict(totals)


def kernel_ms(fn: Callable[..., Any], args: tuple, *, reps: int) -> dict[str, float]:
    """ms per call of each kernel of `fn(*args)` (a compiled or jitted function, already warm), over `reps` calls
    traced together, largest first; empty where the trace has no GPU stream."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            out = None
            for _ in range(reps):
                out = fn(*args)
            jax.block_until_ready(out)
        paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
        if not paths:
            return {}
        with gzip.open(paths[0], "rt") as f:
            events = json.load(f).get("traceEvents", [])
    totals = device_kernel_us(events)
    return {label: us / reps / 1000 for label, us in sorted(totals.items(), key=lambda kv: -kv[1])}


def describe(times: Mapping[str, float], number: str = ".3f") -> str:
    """One line of a table's footnote: the sum of `times` (label -> time), then each label's time, or that the
    trace holds no GPU kernel."""
    if not times:
        return "no GPU kernels in the trace"
    return f"{sum(times.values()):{number}} = " + ", ".join(f"{label} {t:{number}}" for label, t in times.items())


__all__ = ["describe", "device_kernel_us", "kernel_label", "kernel_ms"]
