"""Per-GPU-model decisions measured on the user's own GPU: where `implementation=None` takes our kernels.

`python -m jax_blockgemm.tune` self-checks and times our kernels against what None would otherwise run and writes
one table per GPU model into the cache directory; dispatch reads it at lowering. A decision only ever says "our
kernel, from this problem size on" for an operation and format (for the decode kernel, which wins at few rows: "up to
this M"), or, where two kernels of ours could serve, which of them (the swap_ab kernel or the other, from a size or a
number of rows on); everything it does not name follows `arch.TABLE`,
and a kernel of a never-run architecture still passes its first-use self-check before any use. A table names the
kernels it timed (`kernels_measured`); one timed on other kernels is ignored with a warning. Set
`JAX_BLOCKGEMM_IGNORE_TUNING=1` to ignore the tables; `python -m jax_blockgemm.tune --reset` deletes the
local GPU model's table (a run of `tune` replaces the decisions it times and keeps the others).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pathlib
import re
import tempfile
import time
from typing import Optional, Sequence

from jax_blockgemm import kernel_cache

logger = logging.getLogger(__name__)

IGNORE_ENV = "JAX_BLOCKGEMM_IGNORE_TUNING"
KERNEL = "kernel"
DEFAULT = "default"
DECODE_OP = "weight_stream"  # the decode kernel: decided by the rows M of x, up to a largest M
# Which of two kernels of ours, where arch.TABLE names one from measurements on another GPU model: the swap_ab kernel
# (KERNEL) or the other one (DEFAULT) for a format's ragged calls, from a problem size on; and the swap_ab decode tile
# (KERNEL) or the decode kernel (DEFAULT) for a format's decode-sized calls, from a number of rows M on.
SWAP_AB_RAGGED_OP = "ragged_swap_ab"
SWAP_AB_DECODE_OP = "decode_swap_ab"


@dataclasses.dataclass(frozen=True)
class Decision:
    """What None takes for one operation and operand format on one GPU model, and the measurements behind it."""

    op: str  # "gemm_amax", "proj_rope", "ragged", "weight_stream" (DECODE_OP), or a choice between two kernels of
    # ours: "ragged_swap_ab" (SWAP_AB_RAGGED_OP), "decode_swap_ab" (SWAP_AB_DECODE_OP)
    fmt: str  # gemm_amax, ragged, weight_stream: "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4"; proj_rope: "bf16",
    # "mxfp8"
    choice: str  # KERNEL or DEFAULT
    min_size: int = 0  # with KERNEL: the smallest problem size (gemm_amax L*M*N*K, proj_rope T*K*H, ragged and
    # ragged_swap_ab T*N*K*L*G; decode_swap_ab: M) it applies to
    measured: tuple = ()  # ((size, kernel_ms, default_ms), ...) at the shapes that were timed (decode: size = M)
    max_m: int = 0  # with KERNEL and DECODE_OP or SWAP_AB_DECODE_OP: the largest M it applies to


def directory() -> pathlib.Path:
    """Where the decision tables are kept, one file per GPU model: tuning/ in the kernel cache directory."""
    return kernel_cache.default_cache_dir() / "tuning"


def table_path(gpu_model: str) -> pathlib.Path:
    """Where the decisions for `gpu_model` (jax.Device.device_kind, e.g. "NVIDIA H200") are kept."""
    slug = re.sub(r"[^0-9A-Za-z]+", "-", gpu_model).strip("-") or "gpu"
    return directory() / f"{slug}.json"


def writable() -> bool:
    """Whether a table can be stored (the directory made, a file written in it): tune asks before it measures."""
    try:
        directory().mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory(), prefix=".probe-"):
            return True
    except OSError:
        return False


def kernels_measured() -> str:
    """What a table's timings hold for: the kernel object cache's key over the kernel sources, the per-architecture
    policy and the DSL version (`catalog.kernel_source_hash`); "" where CuTeDSL cannot be imported."""
    try:
        from jax_blockgemm.kernels import catalog

        return catalog.kernel_source_hash()
    except ImportError:
        return ""


def store(gpu_model: str, decisions: Sequence[Decision]) -> pathlib.Path:
    """Write the decision table of `gpu_model` (replacing any earlier one), with the kernels it was measured on;
    returns its path."""
    path = table_path(gpu_model)
    record = {"gpu": gpu_model, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "kernels": kernels_measured(), "decisions": [dataclasses.asdict(d) for d in decisions]}
    kernel_cache.write_atomic(path, json.dumps(record, indent=1).encode())
    _load.cache_clear()
    return path


def reset(gpu_model: str) -> list[pathlib.Path]:
    """Delete the table of `gpu_model`; returns what was deleted (nothing where it had none)."""
    deleted = [p for p in (table_path(gpu_model),) if p.is_file()]
    for p in deleted:
        p.unlink()
    _load.cache_clear()
    return deleted


def _is_int(x: object) -> bool:
    """Whether `x` is a non-negative int (a bool is none)."""
    return type(x) is int and x >= 0


def _invalid(d: object) -> str:
    """Why the stored decision `d` (a JSON object) does not fit `Decision`'s schema; '' when it does."""
    if not isinstance(d, dict):
        return "not an object"
    names = {f.name for f in dataclasses.fields(Decision)}
    if set(d) - names or not {"op", "fmt", "choice"} <= set(d):
        return f"fields {sorted(d)}, expected {sorted(names)}"
    if not all(isinstance(d[k], str) for k in ("op", "fmt")) or d["choice"] not in (KERNEL, DEFAULT):
        return "op and fmt must be strings, choice 'kernel' or 'default'"
    if not all(_is_int(d.get(k, 0)) for k in ("min_size", "max_m")):
        return "min_size and max_m must be non-negative integers"
    measured = d.get("measured", [])
    if not isinstance(measured, list) or not all(
            isinstance(m, list) and len(m) == 3 and _is_int(m[0])
            and all(type(x) in (int, float) for x in m[1:]) for m in measured):
        return "measured must be a list of [size, kernel_ms, default_ms]"
    return ""


@functools.lru_cache(maxsize=None)
def _load(gpu_model: str, directory: str) -> tuple[Decision, ...]:
    path = table_path(gpu_model)
    try:
        record = json.loads(path.read_text())
        decisions = record["decisions"]
        if not isinstance(decisions, list):
            raise TypeError(f"decisions is a {type(decisions).__name__}, not a list")
    except FileNotFoundError:
        return ()
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("jax_blockgemm: ignoring the unreadable tuning table %s (%s)", path, e)
        return ()
    if record.get("kernels") != kernels_measured():  # timed on other kernels (an upgrade): arch.TABLE until re-tuned
        logger.warning("jax_blockgemm: ignoring the tuning table %s: it was measured on other kernels than these "
                       "(re-run `python -m jax_blockgemm.tune`)", path)
        return ()
    valid = []
    for d in decisions:
        why = _invalid(d)
        if why:
            logger.warning("jax_blockgemm: ignoring the invalid decision %.200s in the tuning table %s (%s)", d, path,
                           why)
            continue
        valid.append(Decision(**{**d, "measured": tuple(tuple(m) for m in d.get("measured", ()))}))
    return tuple(valid)


def load(gpu_model: str) -> tuple[Decision, ...]:
    """The stored decisions of `gpu_model` (read once per process and cache directory; () when there are none)."""
    return _load(gpu_model, str(kernel_cache.default_cache_dir()))


def tables_ignored() -> bool:
    """$JAX_BLOCKGEMM_IGNORE_TUNING as a switch: 1/true/yes/on ignore the stored tables, unset/empty/0/false/no/off
    use them; anything else is refused rather than guessed."""
    raw = os.environ.get(IGNORE_ENV, "").strip()
    if raw.lower() in ("", "0", "false", "no", "off"):
        return False
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{IGNORE_ENV}={raw!r}: expected 1, true, yes or on (ignore the tuning tables) or 0, false, no, "
                     "off or nothing (use them).")


def _decision(gpu_model: Optional[str], op: str, fmt: str) -> Optional[Decision]:
    """The measured decision of `gpu_model` for (op, fmt); None where there is none or tables are ignored."""
    if not gpu_model or tables_ignored():
        return None
    return next((d for d in load(gpu_model) if (d.op, d.fmt) == (op, fmt)), None)


def takes_kernel(gpu_model: Optional[str], op: str, fmt: str, size: int) -> Optional[bool]:
    """Whether the measured table of `gpu_model` sends this call (problem size `size`) of a large-GEMM op (not the
    decode kernel: `decode_max_m`) to our kernel: True or False where a decision for (op, fmt) says so, None where
    there is none, where it keeps None's default (which tune timed the kernel against: arch.TABLE's choice, a kernel
    of ours on sm_90a for proj_rope and ragged) or where tables are ignored: then `arch.TABLE` decides."""
    if op == DECODE_OP:
        raise ValueError(f"op={DECODE_OP!r} is decided by rows: use decode_max_m")
    d = _decision(gpu_model, op, fmt)
    if d is None or d.choice != KERNEL:  # timed against None's default: DEFAULT is arch.TABLE's choice
        return None
    return size >= d.min_size


def decode_max_m(gpu_model: Optional[str], fmt: str) -> Optional[int]:
    """The measured table's largest M for the decode kernel with `fmt` weights on `gpu_model` (timed against the
    reference at N = K = 7168: 0 where the reference won), or None where there is no decision; it replaces
    `arch.TABLE`'s decode_max_m, whose short-K rule still applies (`arch.decode_largest_m`)."""
    d = _decision(gpu_model, DECODE_OP, fmt)
    if d is None:
        return None
    return d.max_m if d.choice == KERNEL else 0


def takes_swap_ab(gpu_model: Optional[str], fmt: str, size: int) -> Optional[bool]:
    """Whether the measured table of `gpu_model` sends a ragged call (problem size `size`, T*N*K*L*G) against `fmt`
    weights to the swap_ab kernel (True) or to the other grouped kernel (False); None where there is no decision or
    tables are ignored: then `arch.TABLE`'s ragged_swap_ab_formats decides."""
    d = _decision(gpu_model, SWAP_AB_RAGGED_OP, fmt)
    if d is None:
        return None
    return d.choice == KERNEL and size >= d.min_size


def decode_swap_ab_rows(gpu_model: Optional[str], fmt: str) -> Optional[tuple[int, int]]:
    """The rows (first M, last M) of decode-sized calls against `fmt` weights that the measured table of `gpu_model`
    gives to the swap_ab decode tile ((1, 0): none, the decode kernel keeps them), or None where there is no decision
    or tables are ignored: then `arch.TABLE`'s decode_swap_ab_m decides."""
    d = _decision(gpu_model, SWAP_AB_DECODE_OP, fmt)
    if d is None:
        return None
    return (d.min_size, d.max_m) if d.choice == KERNEL else (1, 0)


def decide_swap_ab_decode(fmt: str, measured: Sequence[tuple[int, float, float]], *, margin: float = 0.02
                          ) -> Decision:
    """The swap_ab decode tile's decision from timings ((m, tile_ms, decode_kernel_ms), ...): the tile from the
    smallest measured M from which it was faster by at least `margin` at every larger measured M, up to the largest
    measured M; else the decode kernel at every M."""
    d = decide(SWAP_AB_DECODE_OP, fmt, measured, margin=margin)
    return dataclasses.replace(d, max_m=max(m for m, _, _ in measured)) if d.choice == KERNEL else d


def decide_decode(fmt: str, measured: Sequence[tuple[int, float, float]], *, margin: float = 0.02) -> Decision:
    """The decode kernel's decision from timings ((m, kernel_ms, default_ms), ...): our kernel up to the largest
    measured M below which it was faster than the default by at least `margin` at every measured M (never beyond the
    rows measured); else the default."""
    rows = sorted(measured)
    wins = 0
    while wins < len(rows) and rows[wins][1] * (1 + margin) <= rows[wins][2]:
        wins += 1
    if wins == 0:
        return Decision(DECODE_OP, fmt, DEFAULT, measured=tuple(rows))
    return Decision(DECODE_OP, fmt, KERNEL, measured=tuple(rows), max_m=rows[wins - 1][0])


def decide(op: str, fmt: str, measured: Sequence[tuple[int, float, float]], *, margin: float = 0.02) -> Decision:
    """The decision from timings ((size, kernel_ms, default_ms), ...): our kernel from the smallest measured size at
    and above which it was faster than the default by at least `margin` at every measured size (never below the
    sizes measured); else the default."""
    rows = sorted(measured)
    first = len(rows)
    while first > 0 and rows[first - 1][1] * (1 + margin) <= rows[first - 1][2]:
        first -= 1
    if first == len(rows):
        return Decision(op, fmt, DEFAULT, 0, tuple(rows))
    return Decision(op, fmt, KERNEL, rows[first][0], tuple(rows))
