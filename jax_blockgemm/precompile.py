"""Fill the kernel object cache ahead of time, on any machine (no GPU needed).

    python -m jax_blockgemm.precompile [--arch sm_90a --arch sm_100a] [--variant KEY ...] [--list]

Without --arch, every architecture in the catalog; without --variant, every variant of those architectures.
Prints, per variant, whether it was compiled or already cached, the time it took and the entry's path.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from jax_blockgemm import kernel_cache


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jax_blockgemm.precompile", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", action="append", default=[], help="target to compile for (repeatable), e.g. sm_90a")
    p.add_argument("--variant", action="append", default=[], metavar="KEY",
                   help="only this catalog key (repeatable); see --list")
    p.add_argument("--list", action="store_true", help="list the selected variants and their cache state; compile "
                                                       "nothing")
    return p


def select(catalog_variants: Sequence, archs: Sequence[str], keys: Sequence[str]) -> list:
    """Catalog variants for `archs` (all when empty) restricted to `keys` (all when empty)."""
    known_archs = sorted({v.arch for v in catalog_variants})
    for arch in archs:
        if arch not in known_archs:
            raise SystemExit(f"--arch {arch!r}: the catalog has kernels for {known_archs}")
    chosen = [v for v in catalog_variants if not archs or v.arch in archs]
    if keys:
        by_key = {v.key: v for v in chosen}
        missing = [k for k in keys if k not in by_key]
        if missing:
            raise SystemExit(f"--variant {missing}: not among the selected variants {sorted(by_key)}")
        chosen = [by_key[k] for k in keys]
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from jax_blockgemm.kernels import catalog

    variants = select(catalog.CATALOG, args.arch, args.variant)
    cache = kernel_cache.default_cache()
    print(f"cache: {cache.directory}")
    if args.list:
        for v in variants:
            state = "cached" if cache.path(v).is_file() else "missing"
            print(f"{state:8s} {v.key}")
        return 0
    total = time.perf_counter()
    for v in variants:
        start = time.perf_counter()
        payload, source = cache.get(v)
        took = time.perf_counter() - start
        print(f"{'compiled' if source == 'compiled' else 'found':8s} {v.key}  {took:6.2f} s  {len(payload):8d} bytes  "
              f"{cache.path(v)}", flush=True)
    print(f"{len(variants)} variants in {time.perf_counter() - total:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
