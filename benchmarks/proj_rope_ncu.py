"""Launch one sm_90a proj_rope kernel at the DeepSeek-V3 shape (T = 4096, K = 1536, H = 128) a few times, for
Nsight Compute: `ncu --kernel-name regex:HopperProjRope --launch-skip 2 --launch-count 1 python3
benchmarks/proj_rope_ncu.py 1` (h200_session.sh step proj_rope_ncu). The kernel argument is as in
proj_rope_standalone.py's --consumer-wgs (1, 2, pp, st, ...), optionally followed by ":" and profile phases to leave
out ("st:epilogue", HopperProjRope._skip), then "@n" for W as (K, N) ("st@n", "stk64:ywrite@n"). Unchecked: this
only gives the profiler a warm launch."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from proj_rope_standalone import Runner, bf16_dev  # noqa: E402
from jax_blockgemm.support import HEAD_DIM, QK_ROPE  # noqa: E402


def main(kind: str = "1", t: int = 4096, h: int = 128, k: int = 1536) -> None:
    import torch

    kind, _, w_major = kind.partition("@")  # "st@n": W as (K, N) (w_out_in=False); default (N, K)
    kind, _, skips = kind.partition(":")  # "st:epilogue": the staged kernel with its epilogue compiled out
    w_major = w_major or "k"
    runner = Runner(w_major, kind, frozenset(filter(None, skips.split("+"))))
    rng = np.random.default_rng(0)
    bf16 = lambda a: bf16_dev(np.asarray(a, np.float32).astype(ml_dtypes.bfloat16))
    x = bf16(rng.standard_normal((t, k)))
    w = bf16(rng.standard_normal((h * HEAD_DIM, k) if w_major == "k" else (k, h * HEAD_DIM)) / 40)
    ang = rng.uniform(-3, 3, (t, QK_ROPE))
    cos, sin = bf16(np.cos(ang)), bf16(np.sin(ang))
    n = h * HEAD_DIM
    outs = [torch.empty((s,), dtype=torch.uint8, device="cuda") for s in (t * n, t * h * 6, t * n, (t // 32) * n)]
    launch = runner.bind(x, w, cos, sin, outs, t, k, h)
    for _ in range(4):
        launch()
    torch.cuda.synchronize()
    print(f"launched {runner.label} 4 times at T={t} H={h} K={k}")


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["1"]))
