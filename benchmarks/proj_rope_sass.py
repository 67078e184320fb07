"""SASS instruction counts of the sm_90a proj_rope kernels, compiled on the CPU (no GPU): the whole kernel and the
profiling build without the epilogue (`HopperProjRope._skip = {"epilogue"}`), so the epilogue's count is the
difference (that build keeps its wgmmas: `HopperProjRope._keep_live`). Used to compare epilogue versions before they
can be timed (benchmarks/NOTES.md). SASS by nvdisasm (`kernels/structure.sass`; the test extra installs it).

    CUTE_DSL_ARCH=sm_90a python3 benchmarks/proj_rope_sass.py [--keys SUBSTR,...] [--dump DIR] [--skip PHASE,...]
"""

from __future__ import annotations

import argparse
import collections
import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from jax_blockgemm.kernels import catalog, structure  # noqa: E402

CLASSES = (  # (label, opcode regex on the base opcode + modifiers)
    ("SHFL", r"^SHFL"), ("STS.8", r"^STS\.U8"), ("STS.16", r"^STS\.U16"), ("STS.32", r"^STS$"),
    ("STS.64", r"^STS\.64"), ("STS.128", r"^STS\.128"), ("LDS", r"^LDS"), ("STG.8", r"^STG\.E\.U8"), ("STG.16", r"^STG\.E\.U16"),
    ("STG.32", r"^STG\.E$"), ("STG.64", r"^STG\.E\.64"), ("STG.128", r"^STG\.E\.128"), ("BAR", r"^BAR"), ("BSSY", r"^BSSY"), ("WARPSYNC", r"^WARPSYNC"),
    ("F2FP", r"^F2FP"), ("IMNMX", r"^(IMNMX|VIMNMX)"), ("FMNMX", r"^FMNMX"), ("PRMT", r"^PRMT"),
    ("FMUL/FFMA", r"^(FMUL|FFMA)"), ("SEL/LOP", r"^(SEL|LOP3)"), ("ISETP", r"^ISETP"), ("BRA", r"^BRA"),
)


def sass(cubin: bytes) -> list[str]:
    ops = []
    for line in structure.sass(cubin).splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops.append(m.group(2))
    return ops


def counts(ops: list[str]) -> collections.Counter:
    c = collections.Counter()
    for op in ops:
        c["total"] += 1
        for label, rx in CLASSES:
            if re.match(rx, op):
                c[label] += 1
                break
    return c


def compiled(v, skip=frozenset()):
    k = catalog.make_kernel(v)
    k._skip = frozenset(skip)
    fn = catalog.compile_function(v, keep_ptx=True, kernel=k)
    return fn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--keys", default="t128x192.c1x1,t64x192.c1x1,pingpong",
                   help="comma-separated substrings of variant keys (b_major k only unless '.bn' given)")
    p.add_argument("--dump", default="", help="write each kernel's SASS and PTX here")
    p.add_argument("--all", action="store_true", help="every sm_90a proj_rope variant (registers, spills only)")
    args = p.parse_args()
    variants = catalog.variants_for("sm_90a", "proj_rope")
    if args.all:
        for v in variants:
            fn = compiled(v)
            r = structure.cubin_resources(fn.__cubin__)
            print(f"{v.key}: registers {r.registers}, frame {r.frame_bytes}, stack {r.stack_bytes}, "
                  f"local in PTX: {'.local' in fn.__ptx__}")
        return
    keys = args.keys.split(",")
    for v in variants:
        if not any(k in v.key for k in keys) or (".bn" in v.key and not any(".bn" in k for k in keys)):
            continue
        full_fn, noepi_fn = compiled(v), compiled(v, {"epilogue"})
        full, noepi = counts(sass(full_fn.__cubin__)), counts(sass(noepi_fn.__cubin__))
        r = structure.cubin_resources(full_fn.__cubin__)
        print(f"## {v.key}: registers {r.registers}, frame {r.frame_bytes} B, stack {r.stack_bytes} B")
        print("| class | full | no epilogue | epilogue |")
        print("|---|---|---|---|")
        for label in ("total",) + tuple(lbl for lbl, _ in CLASSES):
            print(f"| {label} | {full[label]} | {noepi[label]} | {full[label] - noepi[label]} |")
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, v.key + ".sass"), "w") as f:
                f.write(disasm(full_fn.__cubin__))
            with open(os.path.join(args.dump, v.key + ".ptx"), "w") as f:
                f.write(full_fn.__ptx__)


if __name__ == "__main__":
    main()
