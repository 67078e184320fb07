"""Fill the kernel object cache ahead of time, on any machine (no GPU needed).

    python -m jax_blockgemm.precompile [--arch sm_90a --arch sm_100a] [--variant KEY ...] [--jobs N]
                                       [--list | --report]

Without --arch, every architecture in the catalog; without --variant, every variant of those architectures.
--jobs N compiles in N processes at once (the cache takes concurrent writers).
Prints, per variant, whether it was compiled or already cached, the time it took and the entry's path.
--report compiles the sm_100a variants afresh (the cache holds objects, not PTX) and prints their structural
checks instead (kernels/structure.py): MMA kind and scale-vector size, tensor memory, local memory, shared
memory, registers; exit status 1 if any variant fails one. The weight_stream decode kernel is held to warp-level
mma.sync (bf16 m16n8k16) and no tensor memory, the other MMA kernels to Blackwell's tcgen05 MMA.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Sequence

from jax_blockgemm import arch, kernel_cache, support


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jax_blockgemm.precompile", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", action="append", default=[], choices=arch.targets(),
                   help="target to compile for (repeatable)")
    p.add_argument("--variant", action="append", default=[], metavar="KEY",
                   help="only this catalog key (repeatable); see --list")
    p.add_argument("--jobs", type=support.count_arg(), default=1, metavar="N",
                   help="compile in N processes at once (default 1)")
    p.add_argument("--list", action="store_true", help="list the selected variants and their cache state; compile "
                                                       "nothing")
    p.add_argument("--report", action="store_true", help="compile the selected sm_100a variants and print their "
                                                         "structural checks (no cache writes)")
    return p


def report(variants: Sequence) -> int:
    """Print the structural table of the sm_100a `variants`; 1 when any of them fails a check, else 0."""
    from jax_blockgemm.kernels import catalog, structure

    chosen = [v for v in variants if v.arch == "sm_100a"]
    if not chosen:
        raise SystemExit("--report: no sm_100a variant selected (the structural checks are those of sm_100a)")
    print(f"limits: shared memory <= {structure.SM100_SMEM_PER_CTA} B per CTA, registers <= "
          f"{structure.SM100_REGS_PER_THREAD} per thread, tensor memory <= {structure.SM100_TMEM_COLUMNS} columns")
    row = "{:52s} {:>9s} {:17s} {:9s} {:13s} {:>7s} {:>7s} {:>4s} {:>15s}  {}"
    print(row.format("variant", "compile s", "MMA kind", "scale_vec", "alloc/dealloc", "local B", "smem B", "regs",
                     "TMEM used/alloc", "verdict"))
    failed = 0
    total = time.perf_counter()
    for v in chosen:
        start = time.perf_counter()
        kernel = catalog.make_kernel(v)
        r = structure.sm100_report(v, catalog.compile_function(v, keep_ptx=True, kernel=kernel), kernel)
        vecs = sorted({k for op in r.mma for k in op.split(".") if k in structure.SCALE_VEC.values()})
        problems = r.problems()
        failed += bool(problems)
        print(row.format(*[v.key, f"{time.perf_counter() - start:.2f}", r.mma_label, ",".join(vecs) or "-",
                         f"{'yes' if r.has_alloc else 'NO'}/{'yes' if r.has_dealloc else 'NO'}",
                         str(r.ptx_local + r.resources.frame_bytes + r.resources.stack_bytes), str(r.smem_bytes),
                         str(r.resources.registers), f"{r.tmem_columns_used}/{r.tmem_columns_allocated}",
                         "ok" if not problems else "FAIL: " + "; ".join(problems)]), flush=True)
    print(f"{len(chosen)} variants in {time.perf_counter() - total:.2f} s, {failed} failing")
    return 1 if failed else 0


def select(catalog_variants: Sequence, archs: Sequence[str], keys: Sequence[str]) -> list:
    """Catalog variants for `archs` (all when empty) restricted to `keys` (all when empty)."""
    for target in archs:
        if target not in arch.targets():
            raise SystemExit(f"--arch {target!r}: kernels exist for {list(arch.targets())} (arch.TABLE)")
    chosen = [v for v in catalog_variants if not archs or v.arch in archs]
    if keys:
        by_key = {v.key: v for v in chosen}
        missing = [k for k in keys if k not in by_key]
        if missing:
            raise SystemExit(f"--variant {missing}: not among the selected variants {sorted(by_key)}")
        chosen = [by_key[k] for k in keys]
    return chosen


def compile_in_processes(keys: Sequence[str], jobs: int, *, timeout: float = 1800) -> list[str]:
    """Compile the catalog variants `keys` into the kernel cache in `jobs` child processes at once.

    Returns the error tails of the processes that failed (empty when all succeeded). The children inherit the
    environment, so JAX_BLOCKGEMM_CACHE_DIR selects the cache they fill.
    """
    chunks = [list(keys[i::jobs]) for i in range(max(1, jobs)) if keys[i::jobs]]
    procs = [subprocess.Popen([sys.executable, "-m", "jax_blockgemm.precompile",
                               *[arg for key in chunk for arg in ("--variant", key)]],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
             for chunk in chunks]
    failed = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            err = f"timed out after {timeout} s"
        if proc.returncode != 0:
            failed.append(err[-1000:])
    return failed


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from jax_blockgemm.kernels import catalog

    variants = select(catalog.CATALOG, args.arch, args.variant)
    if args.report:
        return report(variants)
    cache = kernel_cache.default_cache()
    print(f"cache: {cache.directory}")
    if args.list:
        for v in variants:
            state = "cached" if cache.path(v).is_file() else "missing"
            print(f"{state:8s} {v.key}")
        return 0
    if args.jobs > 1:
        start = time.perf_counter()
        failed = compile_in_processes([v.key for v in variants], args.jobs)
        print(f"{len(variants)} variants in {args.jobs} processes in {time.perf_counter() - start:.2f} s"
              + ("" if not failed else ", failures:\n" + "\n".join(failed)))
        return 1 if failed else 0
    total = time.perf_counter()
    for v in variants:
        start = time.perf_counter()
        payload, source = cache.get(v)
        took = time.perf_counter() - start
        where = cache.path(v) if cache.writable else "not cached (the cache directory cannot be written)"
        print(f"{'compiled' if source == 'compiled' else 'found':8s} {v.key}  {took:6.2f} s  {len(payload):8d} bytes  "
              f"{where}", flush=True)
    print(f"{len(variants)} variants in {time.perf_counter() - total:.2f} s")
    if not cache.writable:  # filling the cache is this command's whole job
        print(f"error: the kernel cache {cache.directory} cannot be written, so the objects compiled here were not "
              f"kept (set {kernel_cache.CACHE_DIR_ENV} to a writable directory)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
