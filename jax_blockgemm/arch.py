"""Per-architecture policy, in one table: what each GPU runs and what `implementation=None` takes there.

Dispatch, the first-use self-check, precompile, the benchmark and the docs all read this module; adding an
architecture means adding a row here (and its kernels to the catalog). It imports nothing of the package, so any
module may read it. `python -m jax_blockgemm.arch` prints the table as the docs show it.

What `None` takes, per operation:
  * "kernel": our CuTeDSL kernel (where one applies to the call; else the reference);
  * "reference": the pure-JAX reference (bf16 dequantization + dot, SPEC §6). Where `scaled_dot_min_size` is set,
    the reference takes the accumulator of its MXFP8 E4M3 GEMMs (gemm_amax's, and proj_rope's with MXFP8 inputs)
    from `jax.lax.scaled_dot` instead, which XLA hands to cuDNN's block-scaled GEMM on the FP8 tensor cores (SPEC
    §7's "tensor-core FP8" class); other formats, and smaller calls, keep the exact bf16 route.
The decode kernel (op "weight_stream": bf16 activations of few rows against a block-scaled weight, for
weight_only_matmul and small-M gemm_amax) has its own column: per weight format, the largest M for which None
takes it (`decode_max_m`; 0 or absent: never), and below a K where fewer rows pay (`decode_short_k`).
A per-GPU-model decision table measured by `python -m jax_blockgemm.tune` (`tuning`) may send calls to our kernels
instead; this table is what holds without one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Callable, Iterator, Literal, Mapping, Optional, Sequence

Choice = Literal["kernel", "reference"]
OPS = ("gemm_amax", "proj_rope", "ragged")
DECODE_OP = "weight_stream"
DECODE_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4")  # the weight formats the decode kernel reads
# Kernels that follow another operation's column: the grouped contraction (the ragged product's weight gradient)
# and the pair quantization of its weights are part of the mixture-of-experts family, "ragged".
_POLICY_OF = {"contraction": "ragged", "quantize_pair": "ragged"}


@dataclasses.dataclass(frozen=True)
class ArchPolicy:
    """One compute capability: the target our objects are built for, and what runs there by default."""

    capability: str  # as jax.Device.compute_capability spells it, e.g. "9.0"
    target: Optional[str]  # CuTeDSL target of our kernel objects for it ("sm_90a"), None where we have none
    verified: bool  # our kernels have run correct on a GPU of this capability; else each is self-checked first
    default: Mapping[str, Choice]  # operation -> what implementation=None takes
    proj_rope_tile: tuple[int, int] = (128, 192)  # (tokens, features) of one proj_rope tile
    proj_rope_schedule: str = ""  # the proj_rope kernel's schedule ("" for the target's only one)
    scaled_dot_min_size: Optional[int] = None  # smallest GEMM (L*M*N*K) whose MXFP8 E4M3 accumulator the reference
    # takes from jax.lax.scaled_dot; None: never
    why: str = ""  # the evidence behind `default`, one line for the docs
    # weight format (DECODE_FORMATS) -> the largest M (rows of x) for which None takes the decode kernel; 0 or
    # absent: never (a tuning table measured on the local GPU may still turn it on)
    decode_max_m: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # weight format -> (K, M): for calls with fewer than K columns (codes per weight row) None takes the decode
    # kernel only up to M rows (the kernel's cost per row of x does not shrink with K as the reference's does)
    decode_short_k: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    # weight format -> (first M, last M): decode-sized calls of these M take the swap_ab ragged kernel's decode tile
    # (wgmma, one group of M tokens; catalog.SWAP_AB_DECODE_TILES) instead of the decode kernel, where every local GPU
    # has one, but for `decode_swap_ab_small`'s calls
    decode_swap_ab_m: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    # (M, N, K): calls of at most M rows against a weight of fewer than N rows or K columns keep the decode kernel
    # even within decode_swap_ab_m (the tile's extra pass over x and its 64-row CTAs cost more than it saves there);
    # M = 0: no such calls
    decode_swap_ab_small: tuple[int, int, int] = (0, 0, 0)
    # kernel schedules (the catalog's KernelVariant.schedule) of this target whose kernels have not yet run correct
    # on such a GPU: self-checked first even where `verified` holds
    unverified_schedules: tuple[str, ...] = ()
    # weight formats whose ragged calls take the swap_ab kernel (only the weights' codes converted, in registers; the
    # tokens in bf16), measured faster here than the block-scaled grouped kernel on codes and than the reference for
    # bf16 tokens against quantized experts; other formats keep the block-scaled kernel, and their bf16-token calls
    # the reference under None ("cutedsl" runs the swap_ab objects there, the only kernel that reads bf16 tokens)
    ragged_swap_ab_formats: tuple[str, ...] = ()
    # what mx_ragged_dot's MX recipes hand their forward and dgrad ragged GEMMs: "bf16", the operands quantized and
    # dequantized in place (the same values, exact in bf16; no transposed copy) for the bf16 grouped GEMM, or
    # "codes", the quantized codes for a block-scaled one (worth it where MX codes run faster than bf16)
    mx_ragged_operands: Literal["bf16", "codes"] = "bf16"
    # (rows, columns) of the bf16 grouped GEMM's CTA tile (kernels/sm90/bf16_tile.py), where the target has one
    ragged_bf16_tile: tuple[int, int] = (128, 128)


TABLE: tuple[ArchPolicy, ...] = (
    ArchPolicy(
        capability="9.0", target="sm_90a", verified=True,
        default={"gemm_amax": "reference", "proj_rope": "kernel", "ragged": "kernel"},
        proj_rope_tile=(128, 192), proj_rope_schedule="staged",
        # H200, weight_only_matmul inside a many-weight program (docs/performance.md, decode and tune): at K = 7168
        # the kernel beats the reference up to M = 64 (MXFP4 at 7168 -> 7168, M = 64 within 5%), at K = 2048 only
        # up to M = 16 in every format (M = 32: 36-38 against 29-33 us of GPU time)
        decode_max_m={"mxfp8_e4m3": 64, "mxfp8_e5m2": 64, "mxfp4": 64, "nvfp4": 64},
        decode_short_k={fmt: (7168, 16) for fmt in DECODE_FORMATS},
        # The swap_ab decode tiles with K split (catalog.SWAP_AB_DECODE_TILES), weight-only in the 32-weight program,
        # 7168 -> 7168, us per GEMM against the decode kernel: MXFP8 (H200) 24.5 / 25.5 at M = 1, 23.5 / 28.0 at 16,
        # 25.2 / 71.5 at 32, 28.1 / 85.8 at 64; MXFP4 (H100) 23.5 / 23.5 at M = 1, 24.2 / 29.4 at 16; NVFP4 (H100,
        # `tune --op decode_swap_ab`, two K parts at 16 tokens) 1.18x / 1.06x faster at M = 1 / 16. At 2048 -> 7168,
        # M = 64, the tile (one part) took 15.7 us of GPU time against the reference's 31.7 (docs/design/decode.md)
        # Every swap_ab object (these decode tiles and the MoE tile) passed its GPU tests on an H100 (5 December), so
        # no schedule of this row is self-checked first.
        decode_swap_ab_m={"mxfp8_e4m3": (1, 64), "mxfp4": (1, 64), "nvfp4": (1, 64)},
        # H100, the tiles against the decode kernel at M = 1 / 16 in the same program, us per GEMM (5 December,
        # docs/design/decode.md): the tile wins at 7168 x 7168 (MXFP8 29 / 30 against 30 / 32, `tune`) and
        # 4096 -> 11008 (MXFP8 31.0 / 32.0 against 33.6 / 37.0) but loses at 4096 -> 4096 (MXFP8 16.9 / 17.6 against
        # 14.3 / 15.0) and 11008 -> 4096 (MXFP8 32.1 / 32.0 against 27.0 / 29.8), whose 64 CTAs leave half the SMs
        # idle; at M = 64 it wins everywhere. At 2048 -> 7168 it lost while x's permutation was a launch of its own
        # and wins since the 16-token tile orders x itself (MXFP8 11.4-12.0 against 13.3-14.7, MXFP4 10.4-11.2
        # against 11.3-13.9, NVFP4 10.3-12.2 against 12.5-15.8; H100, 5 December, interleaved)
        decode_swap_ab_small=(16, 7168, 2048),
        # H200 (`tune --op ragged_swap_ab`): 1.5-1.7x faster than the block-scaled grouped kernel on MXFP8 E4M3,
        # MXFP4 and NVFP4 codes alike (docs/design/moe.md)
        ragged_swap_ab_formats=("mxfp8_e4m3", "mxfp4", "nvfp4"),
        # H200: an MX ragged GEMM runs at the bf16 tensor rate, and quantizing the (G, K, N) weights to K-major codes
        # (a transposed copy) took 3.2 ms, three times the GEMM (docs/design/moe.md)
        mx_ragged_operands="bf16",
        # H200: 128 x 256 tiles, one CTA per SM, read a third fewer bytes from L2 than 128 x 128 at two
        # (docs/design/moe.md)
        ragged_bf16_tile=(128, 256),
        why="H200: the proj_rope kernel is faster than the reference at every measured shape; MX gemm_amax is "
            "bound by the bf16 tensor rate there, where XLA's dot is as fast as ours (docs/design/gemm_amax.md); "
            "the decode kernel is faster than the reference up to the M shown (docs/design/decode.md); the ragged "
            "kernels and the grouped contraction are faster than the reference's tile loops (docs/design/moe.md)"),
    ArchPolicy(
        capability="10.0", target="sm_100a", verified=False,
        default={"gemm_amax": "reference", "proj_rope": "reference", "ragged": "reference"},
        proj_rope_tile=(128, 192), scaled_dot_min_size=0, decode_max_m={fmt: 0 for fmt in DECODE_FORMATS},
        mx_ragged_operands="codes",  # the block-scaled tcgen05 ragged kernel multiplies MX codes at the FP8 rate
        why="B200: our kernels (the ragged one too) compiled, never run here, so never the default; MXFP8 E4M3 "
            "GEMMs through XLA's block-scaled dot (cuDNN on the FP8 tensor cores), unmeasured here"),
    ArchPolicy(
        capability="10.3", target=None, verified=False,
        default={"gemm_amax": "reference", "proj_rope": "reference", "ragged": "reference"},
        scaled_dot_min_size=0,
        why="B300: no kernel of ours; MXFP8 E4M3 GEMMs through XLA's block-scaled dot, unmeasured here"),
)


def _row_of_capability(capability: str) -> Optional[ArchPolicy]:
    return next((p for p in TABLE if p.capability == capability), None)


def policy(target: str) -> ArchPolicy:
    """The row of kernel target `target` (e.g. "sm_90a"); KeyError for a target no row names."""
    for p in TABLE:
        if p.target == target:
            return p
    raise KeyError(f"no architecture policy for target {target!r}; known: {targets()}")


def targets() -> tuple[str, ...]:
    """Every kernel target the table names, in table order."""
    return tuple(p.target for p in TABLE if p.target is not None)


def target_of(capability: str) -> Optional[str]:
    """The kernel target a GPU of `capability` runs ("9.0" -> "sm_90a"), or None where we build none."""
    row = _row_of_capability(capability)
    return row.target if row else None


def is_verified(target: str, schedule: str = "") -> bool:
    """Whether our `target` kernels (of `schedule`) have run correct on such a GPU; unverified ones pass a self-check
    first."""
    row = policy(target)
    return row.verified and schedule not in row.unverified_schedules


def decode_largest_m(target: str, fmt: str, k: Optional[int] = None, *, measured_max_m: Optional[int] = None) -> int:
    """The most rows of x for which None takes the decode kernel on `target` for `fmt` weights of `k` columns (k
    None: at long K); 0: never. `measured_max_m`: the local GPU's tuning table's threshold (timed at long K), which
    replaces `decode_max_m`; the short-K rule still caps it below its K."""
    row = policy(target)
    largest = row.decode_max_m.get(fmt, 0) if measured_max_m is None else measured_max_m
    short_k, short_m = row.decode_short_k.get(fmt, (0, largest))
    return min(largest, short_m) if k is not None and k < short_k else largest


def decode_takes_swap_ab(target: str, fmt: str, m: int, *, n: int, k: int,
                         measured_rows: Optional[tuple[int, int]] = None) -> bool:
    """Whether a decode-sized call of `m` rows against `fmt` weights of `n` rows and `k` columns takes the swap_ab
    ragged kernel's decode tile on `target`: `decode_swap_ab_m`, or `measured_rows` (first, last), the local GPU's
    tuning table's (timed at 7168 x 7168), which replace it; either way not `decode_swap_ab_small`'s calls."""
    row = policy(target)
    first, last = row.decode_swap_ab_m.get(fmt, (1, 0)) if measured_rows is None else measured_rows
    small_m, small_n, small_k = row.decode_swap_ab_small
    return first <= m <= last and not (m <= small_m and (n < small_n or k < small_k))


def ragged_takes_swap_ab(target: str, fmt: str, *, measured: Optional[bool] = None) -> bool:
    """Whether ragged calls against `fmt` weights take the swap_ab kernel on `target`: `ragged_swap_ab_formats`, or
    `measured`, the local GPU's tuning table's decision, which replaces it."""
    return fmt in policy(target).ragged_swap_ab_formats if measured is None else measured


def none_takes_kernel(op: str, target: str, *, fmt: str = "", m: Optional[int] = None,
                      k: Optional[int] = None, measured_max_m: Optional[int] = None) -> bool:
    """Whether implementation=None takes our `op` kernel on `target` (where one applies to the call). For the decode
    kernel (DECODE_OP) that depends on the weight format `fmt`, the call's rows `m` and columns `k`: M at most
    `decode_largest_m` (with `m` None: whether it ever does; `measured_max_m` as there)."""
    if op == DECODE_OP:
        largest = decode_largest_m(target, fmt, k, measured_max_m=measured_max_m)
        return largest > 0 and (m is None or m <= largest)
    return policy(target).default.get(_POLICY_OF.get(op, op)) == "kernel"


def mx_ragged_operands(capabilities: Sequence[str]) -> str:
    """What mx_ragged_dot's MX recipes hand their ragged GEMMs on GPUs of `capabilities` (`mx_ragged_operands`):
    "codes" where any of them has a row that asks for codes, else "bf16" (also with no GPU: the reference then runs
    on the same values either way)."""
    rows = (_row_of_capability(c) for c in capabilities)
    return "codes" if any(r is not None and r.mx_ragged_operands == "codes" for r in rows) else "bf16"


def scaled_dot_min_size(device_kind: str) -> Optional[int]:
    """For a lowering's device kind ("cuda:<capability>", "cpu", or "cuda" with no GPU visible): the smallest
    L*M*N*K from which the reference takes its MXFP8 E4M3 accumulator from jax.lax.scaled_dot, or None where it
    never does."""
    platform, _, capability = device_kind.partition(":")
    row = _row_of_capability(capability) if platform == "cuda" else None
    return row.scaled_dot_min_size if row else None


@contextlib.contextmanager
def overridden(capability: str, **changes) -> Iterator[ArchPolicy]:
    """Within this block, the row of `capability` has `changes` applied (for tests and experiments)."""
    global TABLE
    saved = TABLE
    row = _row_of_capability(capability)
    if row is None:
        raise KeyError(f"no architecture policy for compute capability {capability!r}")
    new = dataclasses.replace(row, **changes)
    TABLE = tuple(new if p is row else p for p in saved)
    try:
        yield new
    finally:
        TABLE = saved


def _decode_cell(p: ArchPolicy) -> str:
    """What None takes for decode-sized calls on row `p`: "decode kernel for M <= 64" (every format), "never", or
    per format."""
    if p.target is None:
        return "-"
    rule = decode_rule(p, DECODE_FORMATS)
    return ("decode kernel for " if rule.startswith("M <=") else "") + rule if rule else "never"


def decode_rule(p: ArchPolicy, formats: Sequence[str], *, name: Callable[[str], str] = str) -> str:
    """Up to how many rows None takes the decode kernel on row `p` for weights in `formats` (DECODE_FORMATS names;
    `name` spells them): "M <= 64" where they share one threshold, else "name: M <= 64, name: never"; then the
    short-K rules ("; M <= 16 below K = 7168 for name, name", without the names where every format has it) and the
    swap_ab tiles' ranges ("; name, name at M = 1-64: the swap_ab tile", with `decode_swap_ab_small`'s exception);
    "" where none of the formats ever takes it."""
    largest = {fmt: p.decode_max_m.get(fmt, 0) for fmt in formats}
    if not any(largest.values()):
        return ""
    if len(set(largest.values())) == 1:
        text = f"M <= {next(iter(largest.values()))}"
    else:
        text = ", ".join(f"{name(fmt)}: M <= {value}" if value else f"{name(fmt)}: never"
                         for fmt, value in largest.items())
    rules: dict[tuple[int, int], list[str]] = {}
    for fmt, rule in p.decode_short_k.items():
        if fmt in largest and 0 < rule[1] < largest[fmt]:
            rules.setdefault(tuple(rule), []).append(name(fmt))
    every = sorted(name(fmt) for fmt in formats)
    for_names = lambda names: "" if sorted(names) == every else f" for {', '.join(names)}"
    text += "".join(f"; M <= {m} below K = {k}{for_names(names)}" for (k, m), names in sorted(rules.items()))
    tiles: dict[tuple[int, int], list[str]] = {}  # formats that share a swap_ab range are named together
    for fmt, span in p.decode_swap_ab_m.items():
        if fmt in largest:
            tiles.setdefault(tuple(span), []).append(name(fmt))
    text += "".join(f"; {', '.join(names)} at M = {first}-{last}: the swap_ab tile"
                    for (first, last), names in tiles.items())
    small_m, small_n, small_k = p.decode_swap_ab_small
    if small_m and any(first <= small_m for first, _ in tiles):
        text += f", at M <= {small_m} only for N >= {small_n}, K >= {small_k}"
    return text


def _ragged_cell(p: ArchPolicy) -> str:
    """What None takes for ragged calls on row `p`: "kernel" (with the formats the swap_ab kernel serves) or
    "reference"."""
    swap_ab = f" (swap_ab for {', '.join(p.ragged_swap_ab_formats)})" if p.ragged_swap_ab_formats else ""
    return p.default["ragged"] + (swap_ab if p.default["ragged"] == "kernel" else "")


def markdown_table() -> str:
    """The table as the docs show it: one row per compute capability."""
    lines = ["| compute capability | kernel target | kernels verified on it | None: gemm_amax | None: proj_rope "
             "| None: decode (weight-only, small-M gemm_amax) | None: ragged; mx_ragged_dot's MX GEMMs take "
             "| reference's MXFP8 E4M3 GEMM "
             "| proj_rope tile, schedule | why |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in TABLE:
        tile = f"{p.proj_rope_tile[0]}x{p.proj_rope_tile[1]}, {p.proj_rope_schedule or 'default'}" if p.target else "-"
        gemm = "bf16 dot" if p.scaled_dot_min_size is None else "jax.lax.scaled_dot"
        verified = "no (self-checked first)" if not p.verified else "yes" + "".join(
            f" (but the {name} kernels: self-checked first)" for name in p.unverified_schedules)
        lines.append(f"| {p.capability} | {p.target or '-'} | {verified} "
                     f"| {p.default['gemm_amax']} | {p.default['proj_rope']} | {_decode_cell(p)} "
                     f"| {_ragged_cell(p)}; {p.mx_ragged_operands} | {gemm} | {tile} "
                     f"| {p.why} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(prog="python -m jax_blockgemm.arch",
                            description="Print the per-architecture policy as the docs show it.").parse_args()
    sys.stdout.write(markdown_table() + "\n")
