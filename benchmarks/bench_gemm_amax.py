"""gemm_amax through `python -m jax_blockgemm.bench`, with the options of the commands recorded in RESULTS.md.

Usage: python benchmarks/bench_gemm_amax.py [--out DIR] [--quick] [any option of jax_blockgemm.bench]
Runs the gemm_amax cases and the launch costs, and writes DIR/bench_gemm_amax.json (and .png where matplotlib is
installed). --quick: 8192³ only, 10 timed calls.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

from jax_blockgemm import bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for the JSON and the PNG")
    parser.add_argument("--quick", action="store_true", help="8192³ only, 10 timed calls")
    args, rest = parser.parse_known_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_gemm_amax")
    argv = ["--op", "gemm_amax", "--launch", "--json", path + ".json"]
    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--png", path + ".png"]
    if args.quick:
        argv += ["--shape", "8192,8192,8192", "--reps", "10"]
    bench.main(argv + rest)


if __name__ == "__main__":
    main()
