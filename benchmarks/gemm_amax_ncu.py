"""Launch one sm_90a gemm_amax kernel candidate (benchmarks/kernel_standalone.py's CANDIDATES) a few times at an
M = N = K shape, for Nsight Compute: `bash benchmarks/gemm_amax_ncu.sh OUT_DIR fp8p_128:mma` profiles the FP8-promote
kernel with its wgmmas compiled out (the promotion alone). The argument is a candidate name, optionally followed by
":" and phases to leave out, "+"-separated (the kernel's `_skip`: "mma", "dequant", ...). Unchecked: this only gives
the profiler a warm launch."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_standalone import CANDIDATES, KernelRunner, time_kernel  # noqa: E402


def main(kind: str = "fp8p_128", size: int = 4096) -> None:
    name, _, skips = kind.partition(":")
    runner = KernelRunner("float8_e4m3fn", "float32", CANDIDATES[name], frozenset(filter(None, skips.split("+"))))
    ms = time_kernel(runner, (1, size, size, size), reps=3)
    print(f"launched {kind} at {size}^3: {ms:.3f} ms")


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["fp8p_128"]), *[int(v) for v in sys.argv[2:3]])
