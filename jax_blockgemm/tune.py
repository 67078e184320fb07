"""Turn our kernels on where they win on this GPU: `python -m jax_blockgemm.tune`.

    python -m jax_blockgemm.tune [--op gemm_amax|proj_rope|weight_stream|ragged|ragged_swap_ab|decode_swap_ab]
                                 [--format mxfp8_e4m3 ...] [--shape M,N,K ...] [--reps N] [--reset]

For every operation and format that a kernel of ours could serve on the local GPU: self-check that kernel (in a
child process, through the first-use gate), time it (implementation="cutedsl") against what implementation=None runs
without a decision (`arch.TABLE`: the reference, or XLA's block-scaled dot on Blackwell) at the given shapes or the
benchmark's, print a table, and store the decisions for this GPU model (`tuning`), which None follows from then on.
The decode kernel ("weight_stream": `weight_only_matmul` with bf16 x, few rows) is timed against the reference
(implementation="xla") over DECODE_MATRICES distinct weights in one program (one call alone would time its launch),
and its decision reads "our kernel up to M rows" (measured at DECODE_SHAPES' K; below arch.TABLE's short-K rule's K
that rule still caps M); it times the weight_stream kernel at every M, also where arch.TABLE gives MXFP8 rows to the
swap_ab decode tiles (their range is "decode_swap_ab"'s, below). The ragged (grouped) kernel is timed at
RAGGED_SHAPES, equal groups, bf16 C.
Where arch.TABLE picks between two kernels of ours from measurements on another GPU model, the same command times
both here, each forced by that table's entry (both "cutedsl", the swap_ab objects self-checked first):
"ragged_swap_ab" the swap_ab kernel against the block-scaled one on each format's codes (RAGGED_SHAPES; its decision
also lets `weight_only_ragged_matmul` take swap_ab under None), "decode_swap_ab" the swap_ab decode tile against the
decode kernel at DECODE_SWAP_AB_SHAPES (a decision "the tile from this M up to the largest measured").
Decisions for the operations and formats not timed (`--op`, `--format`) stay as stored. `--reset` deletes the local
GPU model's stored table (none without a GPU, or with GPUs of several models); JAX_BLOCKGEMM_IGNORE_TUNING=1 makes
None ignore it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import sys
from typing import Any, Callable, Iterator, Optional, Sequence

from jax_blockgemm import tuning

GEMM_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4")
PROJ_ROPE_FORMATS = ("bf16", "mxfp8")
# SPEC §8's shapes (gemm_amax M, N, K; proj_rope T at K = 1536, H = 128), and two smaller gemm_amax shapes so
# that a decision can start at a size below the large ones.
GEMM_SHAPES = ((2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (4096, 7168, 16384), (4096, 24576, 1536))
PROJ_ROPE_TOKENS = (2048, 4096)
# the decode kernel: (M, N, K) at SPEC §8's N = K = 7168, M up to the kernel's largest token tile
DECODE_SHAPES = ((1, 7168, 7168), (16, 7168, 7168), (64, 7168, 7168))
DECODE_MATRICES = 16
# the ragged kernel: (T, G, N, K), equal groups, from a small problem up to the MoE benchmark's (bench --op ragged)
RAGGED_SHAPES = ((4096, 8, 2048, 7168), (16384, 32, 2048, 7168), (16384, 32, 7168, 2048))
# the swap_ab decode tiles: (M, N, K) from one row to the tiles' 64, each tile at its fewest and most rows (16, 32
# and 64 tokens: catalog.SWAP_AB_DECODE_TILES)
DECODE_SWAP_AB_SHAPES = ((1, 7168, 7168), (16, 7168, 7168), (17, 7168, 7168), (32, 7168, 7168), (64, 7168, 7168))
SWAP_AB_FORMATS = ("mxfp8_e4m3", "mxfp4", "nvfp4")  # the weight formats the swap_ab kernel converts
CHOICE_OPS = (tuning.SWAP_AB_RAGGED_OP, tuning.SWAP_AB_DECODE_OP)  # a choice between two kernels of ours
OPS = ("gemm_amax", "proj_rope", tuning.DECODE_OP, "ragged", *CHOICE_OPS)
_PROJ_ROPE_SCALES = ("x_scale", "w_scale")  # gemm_proj_rope_mxfp8's scale keywords (the MXFP8 path)

# (kernel_ms, default_ms) of one problem, or None when no kernel of ours serves it; `why` says why not.
Timer = Callable[[str, str, tuple], tuple[Optional[tuple[float, float]], str]]


@contextlib.contextmanager
def _tables_ignored() -> Iterator[None]:
    """The default None takes without any decision: the table is ignored while we time it."""
    saved = os.environ.get(tuning.IGNORE_ENV)
    os.environ[tuning.IGNORE_ENV] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(tuning.IGNORE_ENV, None)
        else:
            os.environ[tuning.IGNORE_ENV] = saved


def problem_size(op: str, shape: tuple) -> int:
    """The size a decision's threshold compares, as dispatch computes it for a call: gemm_amax L*M*N*K (L = 1),
    proj_rope T*K*H, ragged and ragged_swap_ab T*N*K*L*G (L = 1); the decode kernel's and tile's rows M."""
    if op in (tuning.DECODE_OP, tuning.SWAP_AB_DECODE_OP):
        return shape[0]
    return shape[0] * shape[1] * shape[2] * (shape[3] if op in ("ragged", tuning.SWAP_AB_RAGGED_OP) else 1)


def kernels_in(hlo_text: str, target: str) -> tuple:
    """The catalog variants of `target` whose objects a lowered program's custom calls carry (in order)."""
    from jax_blockgemm.kernels import catalog

    by_prefix = {v.function_prefix: v for v in catalog.CATALOG if v.arch == target}
    prefixes = [p for group in re.findall(r'function_prefixes = "([^"]*)"', hlo_text) for p in group.split(",")]
    return tuple(by_prefix[p] for p in prefixes if p in by_prefix)


def _bench_format(fmt: str) -> Any:
    """The benchmark's input format (`bench.inputs.GemmFormat`) of the tuning tables' format name `fmt`."""
    from jax_blockgemm.bench import inputs

    return next(f for f in inputs.GEMM_FORMATS.values() if f.weight_format == fmt)


def programs(op: str, fmt: str, shape: tuple) -> tuple[Callable[[Optional[str]], Callable], list[tuple], Optional[str]]:
    """What `measure` times for one problem: `call(implementation)` -> the function; its argument sets (two, rotated
    so that no call finds the previous call's operands in L2; one for the decode program, whose DECODE_MATRICES
    weights already differ); and the implementation the kernel is timed against (None's default; for the decode
    kernel the reference)."""
    import jax

    import jax_blockgemm as jbg
    from jax_blockgemm.bench import inputs

    keys = jax.random.split(jax.random.key(0), 2)
    if op == tuning.DECODE_OP:
        m, n, k = shape
        weights = [jbg.quantize_weight(inputs.random_values(key, (n, k)), fmt)
                   for key in jax.random.split(keys[0], DECODE_MATRICES)]
        xs = [inputs.random_values(key, (m, k)).astype(jax.numpy.bfloat16)
              for key in jax.random.split(keys[1], DECODE_MATRICES)]

        def call(implementation):
            def f(ws, xs):  # every weight applied to its own x, every result kept
                return tuple(jbg.weight_only_matmul(x, w, implementation=implementation) for w, x in zip(ws, xs))
            return f
        return call, [(weights, xs)], "xla"
    if op == "gemm_amax":
        sets = [inputs.gemm_inputs(k, *shape, fmt=_bench_format(fmt).name) for k in keys]
        names = ("a", "b", "sfa_atom", "sfb_atom") + (("alpha",) if fmt == "nvfp4" else ())
        sf = 16 if fmt == "nvfp4" else 32

        def call(implementation):
            def f(a, b, sfa, sfb, *alpha):
                return jbg.gemm_amax(a, b, sfa, sfb, alpha=alpha[0] if alpha else None, sf_vec_size=sf,
                                     implementation=implementation)
            return f
        return call, [tuple(s[n] for n in names) for s in sets], None
    if op == "ragged":
        return _ragged_program(fmt, shape, keys)
    tokens, k, heads = shape
    sets = [inputs.proj_rope_arguments(inputs.proj_rope_inputs(key, tokens, heads, k), fmt == "mxfp8")
            for key in keys]

    def call(implementation):
        def f(x, w, cos, sin, *scales):  # the MXFP8 path's scales, in _PROJ_ROPE_SCALES order
            return jbg.gemm_proj_rope_mxfp8(x, w, cos, sin, **dict(zip(_PROJ_ROPE_SCALES, scales)),
                                            implementation=implementation)
        return f
    return call, [args + tuple(kw[n] for n in _PROJ_ROPE_SCALES if n in kw) for args, kw in sets], None


def _ragged_program(fmt: str, shape: tuple, keys: Any) -> tuple[Callable[[Optional[str]], Callable], list[tuple], None]:
    """`programs` for the ragged kernel: ragged_gemm_amax of T tokens in G equal groups against G weights (N, K) in
    `fmt`, compact scales, bf16 C."""
    import jax
    import jax.numpy as jnp

    import jax_blockgemm as jbg
    from jax_blockgemm.bench import inputs

    tokens, groups, n, k = shape
    fmt_ = _bench_format(fmt)
    sizes = jnp.full((groups,), tokens // groups, jnp.int32)

    def operands(key):
        kx, kw = jax.random.split(key)
        a, sfa, a_scale = inputs.quantize_operand(inputs.random_values(kx, (tokens, k)), fmt_)
        b, sfb, b_scale = inputs.quantize_operand(inputs.random_values(kw, (groups * n, k)), fmt_)
        alpha = () if a_scale is None else ((a_scale * b_scale).astype(jnp.float32),)  # NVFP4's per-tensor scales
        return (a, b.reshape(groups, n, -1), sfa, sfb.reshape(groups, n, -1), *alpha)

    def call(implementation):
        def f(a, b, sfa, sfb, *alpha):
            return jbg.ragged_gemm_amax(a, b, sfa, sfb, sizes, alpha=alpha[0] if alpha else None,
                                        sf_vec_size=fmt_.block, c_dtype=jnp.bfloat16, implementation=implementation)
        return f
    return call, [operands(key) for key in keys], None


@contextlib.contextmanager
def _the_decode_kernel_alone(op: str) -> Iterator[None]:
    """For the decode op, the local GPU's arch.TABLE row without decode_swap_ab_m, so that "cutedsl" runs the
    weight_stream kernel at every M, the kernel whose rows the decision governs (the swap_ab decode tiles' range is
    the "decode_swap_ab" decision's); other ops as they are."""
    from jax_blockgemm import arch, dispatch

    capabilities = dispatch.local_cuda_capabilities() or ()
    with contextlib.ExitStack() as stack:
        if op == tuning.DECODE_OP:
            for capability in capabilities:
                stack.enter_context(arch.overridden(capability, decode_swap_ab_m={}))
        yield


def measure(op: str, fmt: str, shape: tuple, *, reps: int = 20) -> tuple[Optional[tuple[float, float]], str]:
    """Self-check and time our kernel against None's default for one problem on the local GPU (for CHOICE_OPS: the
    swap_ab kernel against the other kernel of ours, `_measure_choice`)."""
    if op in CHOICE_OPS:
        return _measure_choice(op, fmt, shape, reps=reps)
    with _the_decode_kernel_alone(op):
        return _measure(op, fmt, shape, reps=reps)


@contextlib.contextmanager
def _swap_ab_table(op: str, fmt: str, swap_ab: bool) -> Iterator[None]:
    """The local GPUs' arch.TABLE rows with `fmt`'s entry for the choice `op` set to the swap_ab kernel or not, and
    the tuning tables ignored: what forces either kernel for the timing."""
    from jax_blockgemm import arch, dispatch

    with contextlib.ExitStack() as stack:
        for capability in dispatch.local_cuda_capabilities() or ():
            row = arch.policy(arch.target_of(capability))
            if op == tuning.SWAP_AB_DECODE_OP:
                rows = {**row.decode_swap_ab_m, fmt: (1, DECODE_SWAP_AB_SHAPES[-1][0])}  # at every shape timed
                stack.enter_context(arch.overridden(capability, decode_swap_ab_m=rows if swap_ab else {},
                                                    decode_swap_ab_small=(0, 0, 0)))
            else:
                others = tuple(f for f in row.ragged_swap_ab_formats if f != fmt)
                stack.enter_context(arch.overridden(capability,
                                                    ragged_swap_ab_formats=others + ((fmt,) if swap_ab else ())))
        stack.enter_context(_tables_ignored())
        yield


def _measure_choice(op: str, fmt: str, shape: tuple, *, reps: int,
                    lower: Optional[Callable[[Callable, tuple], Any]] = None
                    ) -> tuple[Optional[tuple[float, float]], str]:
    """(swap_ab ms, the other kernel's ms) for one problem of a CHOICE_OPS op: each program lowered (`lower(fn,
    args)`, default jax.jit's for the local GPU) and compiled with the table forcing its kernel ("cutedsl"), the
    swap_ab objects self-checked; None and why where either cannot run here (e.g. no swap_ab object for this GPU)."""
    import jax

    from jax_blockgemm import arch, dispatch
    from jax_blockgemm.bench import timing
    from jax_blockgemm.kernels import catalog

    lower = lower or (lambda fn, args: jax.jit(fn).lower(*args))
    decode = op == tuning.SWAP_AB_DECODE_OP
    call, arg_sets, _ = programs(tuning.DECODE_OP if decode else "ragged", fmt, shape)
    target = arch.target_of(dispatch.local_cuda_capabilities()[0])
    compiled = []
    for swap_ab in (True, False):
        with _swap_ab_table(op, fmt, swap_ab):
            try:
                lowered = lower(call("cutedsl"), arg_sets[0])
            except ValueError as e:
                return None, f"no kernel: {str(e).splitlines()[0]}"
            variants = kernels_in(lowered.as_text(), target)
            if not variants or any((v.schedule == catalog.SWAP_AB) != swap_ab for v in variants):
                kind = "the swap_ab kernel" if swap_ab else "the other kernel"
                return None, f"{kind} does not serve this call here"
            failed = _failed_self_check(variants)
            if failed:
                return None, failed
            compiled.append(lowered.compile())
    ms = timing.interleaved_medians_ms(compiled, [arg_sets, arg_sets], warmup=3, reps=reps, burst=10)
    per_call = DECODE_MATRICES if decode else 1
    return (ms[0] / per_call, ms[1] / per_call), ""


def _failed_self_check(variants: Sequence[Any]) -> str:
    """'' when every one of `variants` (a program's objects, repeats allowed) passed its first-use self-check on the
    local GPU, else why not: the first failure."""
    from jax_blockgemm import gate

    for v in dict.fromkeys(variants):
        verdict = gate.check(v)
        if not verdict.ok:
            return f"self-check failed: {verdict.detail}"
    return ""


def _measure(op: str, fmt: str, shape: tuple, *, reps: int) -> tuple[Optional[tuple[float, float]], str]:
    import jax

    from jax_blockgemm import arch, dispatch
    from jax_blockgemm.bench import timing

    call, arg_sets, baseline = programs(op, fmt, shape)
    try:
        text = jax.jit(call("cutedsl")).lower(*arg_sets[0]).as_text()
    except ValueError as e:
        return None, f"no kernel: {str(e).splitlines()[0]}"
    failed = _failed_self_check(kernels_in(text, arch.target_of(dispatch.local_cuda_capabilities()[0])))
    if failed:
        return None, failed
    with _tables_ignored():
        kernel, default = (jax.jit(call(impl)) for impl in ("cutedsl", baseline))
        ms = timing.interleaved_medians_ms([kernel, default], [arg_sets, arg_sets], warmup=3, reps=reps, burst=10)
    per_call = DECODE_MATRICES if op == tuning.DECODE_OP else 1
    return (ms[0] / per_call, ms[1] / per_call), ""


def run(problems: Sequence[tuple[str, str, tuple]], gpu_model: str, *, timer: Timer,
        out: Any = None) -> list[tuning.Decision]:
    """Measure every (op, fmt, shape), print one row each and one decision per (op, fmt); store them in place of
    the stored decisions of the (op, fmt) timed, keeping the others of `gpu_model`'s table."""
    out = out or sys.stdout
    rows = "{:14s} {:11s} {:>22s} {:>10s} {:>10s} {:>8s}  {}"
    print(f"GPU: {gpu_model}", file=out)
    print(rows.format("op", "format", "shape", "ours ms", "None ms", "speedup", "note"), file=out)
    measured: dict[tuple[str, str], list] = {}
    for op, fmt, shape in problems:
        times, why = timer(op, fmt, shape)
        measured.setdefault((op, fmt), [])
        if times is None:
            print(rows.format(op, fmt, "x".join(map(str, shape)), "-", "-", "-", why), file=out, flush=True)
            continue
        kernel_ms, default_ms = times
        measured[(op, fmt)].append((problem_size(op, shape), kernel_ms, default_ms))
        note = "ours: swap_ab; None: the other kernel" if op in CHOICE_OPS else ""
        print(rows.format(op, fmt, "x".join(map(str, shape)), f"{kernel_ms:.3f}", f"{default_ms:.3f}",
                          f"{default_ms / kernel_ms:.2f}x", note), file=out, flush=True)
    decisions = [_decide(op, fmt, m) for (op, fmt), m in measured.items() if m]
    print("decisions (None from now on):", file=out)
    for d in decisions:
        print(f"  {d.op} {d.fmt}: {_decision_text(d)}", file=out)
    kept = [d for d in tuning.load(gpu_model) if (d.op, d.fmt) not in measured]  # what this run did not time
    for d in kept:
        print(f"  {d.op} {d.fmt}: {_decision_text(d)} (stored earlier, not timed now)", file=out)
    path = tuning.store(gpu_model, kept + decisions)
    print(f"stored in {path}", file=out)
    return decisions


def _decide(op: str, fmt: str, measured: Sequence[tuple[int, float, float]]) -> tuning.Decision:
    """The decision of `op` for `fmt` from its timings (size or M, kernel ms, the other's ms)."""
    if op == tuning.DECODE_OP:
        return tuning.decide_decode(fmt, measured)
    if op == tuning.SWAP_AB_DECODE_OP:
        return tuning.decide_swap_ab_decode(fmt, measured)
    return tuning.decide(op, fmt, measured)


def _decision_text(d: tuning.Decision) -> str:
    """What None takes after decision `d`, in words."""
    if d.op == tuning.SWAP_AB_RAGGED_OP:
        return f"the swap_ab kernel from size {d.min_size}" if d.choice == tuning.KERNEL else "the block-scaled kernel"
    if d.op == tuning.SWAP_AB_DECODE_OP:
        return (f"the swap_ab decode tile at M = {d.min_size}-{d.max_m}" if d.choice == tuning.KERNEL
                else "the decode kernel")
    if d.choice != tuning.KERNEL:
        return "the default (arch.TABLE)"
    if d.op == tuning.DECODE_OP:
        return f"our kernel up to M = {d.max_m}"
    return f"our kernel from size {d.min_size}"


def problems(ops: Sequence[str], fmts: Sequence[str], shapes: Sequence[tuple]) -> list[tuple[str, str, tuple]]:
    """The (op, fmt, shape) to time: gemm_amax and decode shapes are (M, N, K), proj_rope shapes (T, K, H), ragged
    shapes (T, G, N, K) (always RAGGED_SHAPES); the decode tiles' (M, N, K) with M up to 64."""
    out = []
    if "gemm_amax" in ops:
        out += [("gemm_amax", f, s) for f in fmts if f in GEMM_FORMATS for s in (shapes or GEMM_SHAPES)]
    if tuning.DECODE_OP in ops:
        out += [(tuning.DECODE_OP, f, s) for f in fmts if f in GEMM_FORMATS
                for s in ([s for s in shapes if s[0] <= DECODE_SHAPES[-1][0]] if shapes else DECODE_SHAPES)]
    if "proj_rope" in ops:
        out += [("proj_rope", f, (t, 1536, 128)) for f in fmts if f in PROJ_ROPE_FORMATS for t in PROJ_ROPE_TOKENS]
    if "ragged" in ops:
        out += [("ragged", f, s) for f in fmts if f in GEMM_FORMATS for s in RAGGED_SHAPES]
    if tuning.SWAP_AB_RAGGED_OP in ops:
        out += [(tuning.SWAP_AB_RAGGED_OP, f, s) for f in fmts if f in SWAP_AB_FORMATS for s in RAGGED_SHAPES]
    if tuning.SWAP_AB_DECODE_OP in ops:
        out += [(tuning.SWAP_AB_DECODE_OP, f, s) for f in fmts if f in SWAP_AB_FORMATS
                for s in ([s for s in shapes if s[0] <= DECODE_SWAP_AB_SHAPES[-1][0]] if shapes
                          else DECODE_SWAP_AB_SHAPES)]
    return out


def _shape_arg(text: str) -> tuple[int, int, int]:
    """--shape M,N,K: the benchmark's rule (its columns are what tune times)."""
    from jax_blockgemm.bench.cli import parse_shape

    return parse_shape(text)


def _reps_arg(text: str) -> int:
    """--reps: a positive number of timed samples."""
    from jax_blockgemm import support

    return support.count_arg()(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jax_blockgemm.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--op", action="append", choices=OPS, help="repeatable; default: all of them")
    p.add_argument("--format", action="append", choices=GEMM_FORMATS + PROJ_ROPE_FORMATS,
                   help="repeatable; default: every format")
    p.add_argument("--shape", action="append", default=[], type=_shape_arg,
                   metavar="M,N,K", help="gemm_amax (and, with M <= 64, decode) shapes to time (repeatable; default: "
                                         "the benchmark's)")
    p.add_argument("--reps", type=_reps_arg, default=20, help="timed samples per column (default 20)")
    p.add_argument("--reset", action="store_true", help="delete this GPU model's stored decisions and exit")
    return p


def main(argv: Sequence[str] | None = None, *, timer: Timer = measure) -> int:
    """Exit status 0 after storing decisions (or resetting), 1 where they could not be stored (checked before
    measuring), 2 where no CUDA GPU (or GPUs of several models) is visible."""
    args = _parser().parse_args(argv)
    from jax_blockgemm import dispatch

    gpu_model = dispatch.local_gpu_model()
    if args.reset and gpu_model is None:  # a table belongs to one GPU model: which one is not known here
        print("no CUDA GPU visible (or GPUs of several models): no GPU model's table to reset; the tables are in "
              f"{tuning.directory()} (one file per GPU model)")
        return 2
    if args.reset:
        deleted = tuning.reset(gpu_model)
        print("deleted: " + (", ".join(map(str, deleted)) or "nothing"))
        return 0
    if gpu_model is None:
        print("no CUDA GPU visible (or GPUs of several models): nothing to tune; implementation=None follows "
              "arch.TABLE")
        return 2
    if not tuning.writable():  # minutes of measuring that could not be kept
        print(f"cannot store decisions in {tuning.directory()}: set JAX_BLOCKGEMM_CACHE_DIR to a writable directory",
              file=sys.stderr)
        return 1
    todo = problems(args.op or OPS, args.format or GEMM_FORMATS + PROJ_ROPE_FORMATS,
                    args.shape)
    run(todo, gpu_model, timer=functools.partial(timer, reps=args.reps) if timer is measure else timer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
