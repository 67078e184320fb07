"""Benchmark: `python -m jax_blockgemm.bench` times both operations beside the baselines a JAX user has, in one run.

gemm_amax, MXFP8 E4M3 -> f32 C, at the SPEC §8 shapes (or `--shape M,N,K`, repeatable): ours with
implementation=None and "cutedsl", the pure-JAX reference ("xla"), `jax.nn.scaled_matmul`, `jax.lax.scaled_dot`
(where the installed jax has it), and two anchors without block scales: an FP8 dot and a bf16 dot, both -> f32.
`--format mxfp4,nvfp4` (or repeated; default mxfp8) times the same columns with FP4 operands instead, one table per
format: MXFP4 (E2M1 codes packed two per byte, E8M0 scales, block 32) and NVFP4 (E2M1 packed, E4M3 scales, block
16, the fp32 per-tensor alpha); the anchors stay an E4M3 dot and a bf16 dot of the same M, N, K.

gemm_proj_rope_mxfp8 at DeepSeek-V3's K = 1536, H = 128, T in {2048, 4096}, w as (H*192, K) (with --w-in-out also as
(K, H*192)), bf16 and MXFP8 inputs: ours (None and "cutedsl"), the reference, XLA's bare bf16 dot of the same shape
(-> bf16; the faster of the two weight layouts) and the unfused pipeline through `jax.nn.scaled_matmul` (MXFP8 in on
both paths: scaled_matmul -> RoPE -> rowwise and columnwise MXFP8 quantization).

Method: fresh random inputs (normal values whose rows differ in magnitude, quantized by `formats.quantize_mxfp8`
/ `quantize_mxfp4` / `quantize_nvfp4`, so block scales are random and never zero; NVFP4 first divides each operand
by its per-tensor scale amax / (6 * 448), and alpha is the product of the two), several input sets rotated so
that caches cannot hold them, every function compiled ahead under jax.jit, warm-up calls, then the median of
--reps samples, each --burst calls (10) issued back to back and ended by one block_until_ready, per call: the device
time per call, as a model step sees it (--burst 1 waits for every call and adds its host latency, 0.1-0.4 ms on an
H200, to every column). `--sustained SECONDS` keeps each column busy that long instead and reports the median of
the last two thirds: the steady state at the GPU's power limit (an H200 then runs both GEMMs and our kernels at
1.5-1.6 GHz, not 1.98), which short bursts only partly see. Columns are timed one after another, so the first
meets a cooler GPU than the last; `--interleave` compiles them all first and takes their samples in turn instead,
in a fresh shuffled order each round.
Ratios are speedups, baseline ms / column ms (> 1: faster than the baseline), against
`jax.nn.scaled_matmul`, the reference and `jax.lax.scaled_dot` for gemm_amax, against the bare dot and the unfused
pipeline for proj_rope. Every column that computes the same function is checked against the reference on the
first input set (gemm_amax: ||C - C_ref|| / ||C_ref||; proj_rope: the fraction of E4M3 codes equal to the
reference's), so that a fast wrong answer shows. A column that cannot run here (no kernel applies, the installed
jax lacks the API or the format, no lowering for this platform; an error at compile time or on the first call)
shows "n/a", and the reason is printed below the table and kept in the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jax_blockgemm as jbg
from jax_blockgemm import formats, kernel_cache, reference, support

GEMM_SHAPES = ((8192, 8192, 8192), (4096, 7168, 16384), (4096, 24576, 1536))  # SPEC §8
PROJ_K, PROJ_HEADS, PROJ_TOKENS = 1536, 128, (2048, 4096)  # SPEC §8: DeepSeek-V3 MLA Q up-projection
SMALL_GEMM_SHAPES = ((128, 128, 128), (64, 112, 256), (96, 320, 64))  # --small: a tiny twin of each case
SMALL_PROJ_K, SMALL_PROJ_HEADS, SMALL_PROJ_TOKENS = 64, 2, (32, 64)

GEMM_COLUMNS = {"ours": "ours(None)", "ours_cutedsl": "ours(cutedsl)", "reference": "reference(xla)",
                "scaled_matmul": "nn.scaled_matmul", "scaled_dot": "lax.scaled_dot", "fp8_dot": "fp8 dot",
                "bf16_dot": "bf16 dot"}
PROJ_COLUMNS = {"ours": "ours(None)", "ours_cutedsl": "ours(cutedsl)", "reference": "reference(xla)",
                "bf16_dot": "bare bf16 dot", "pipeline": "scaled_matmul pipeline"}
BASELINES = {"gemm_amax": ("scaled_matmul", "reference", "scaled_dot"), "proj_rope": ("bf16_dot", "pipeline")}
OPS = ("gemm_amax", "proj_rope")


@dataclasses.dataclass(frozen=True)
class GemmFormat:
    """A gemm_amax input format --format can pick: its name, its table title, its block (sf_vec_size)."""

    name: str
    title: str
    block: int

    @property
    def fp4(self) -> bool:
        return self.name != "mxfp8"


GEMM_FORMATS = {f.name: f for f in (
    GemmFormat("mxfp8", "MXFP8 E4M3", support.MX_BLOCK),
    GemmFormat("mxfp4", "MXFP4 E2M1", support.MX_BLOCK),
    GemmFormat("nvfp4", "NVFP4 E2M1 x alpha", 16))}
DEFAULT_FORMATS = ("mxfp8",)
CHECKS = {"gemm_amax": ("rel err vs reference", ".1e"), "proj_rope": ("codes = reference", ".2%")}


class NotAvailable(Exception):
    """A column that cannot run here: no kernel applies, the installed jax lacks the API, or no lowering exists."""


# --------------------------------------------------------------------------------------------------------------
# Inputs


@functools.partial(jax.jit, static_argnums=1)
def random_values(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """float32 normal values whose rows are scaled by 2**-6 .. 2**5, so that block scales differ along the rows."""
    k_values, k_rows = jax.random.split(key)
    row_exponent = jax.random.randint(k_rows, (*shape[:-1], 1), -6, 6)
    return jax.random.normal(k_values, shape, jnp.float32) * jnp.exp2(row_exponent.astype(jnp.float32))


def random_mxfp8(key: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """A random MXFP8 E4M3 operand: (codes, uint8 E8M0 scale bytes per 32 along the last axis) of random_values."""
    return formats.quantize_mxfp8(random_values(key, tuple(shape)))


def _as_e8m0(scale_bytes: jax.Array) -> jax.Array:
    """uint8 E8M0 bytes as float8_e8m0fnu, the scale dtype jax.nn.scaled_matmul and jax.lax.scaled_dot take."""
    return jax.lax.bitcast_convert_type(scale_bytes, jnp.float8_e8m0fnu)


def nvfp4_tensor_scale(values: jax.Array) -> jax.Array:
    """NVFP4's per-tensor fp32 scale, amax / (6 * 448): the operand divided by it fills the E4M3 scale range."""
    return jnp.max(jnp.abs(values)) / (formats.emax(formats.E2M1) * formats.emax(formats.E4M3))


def quantize_operand(values: jax.Array, fmt: GemmFormat) -> tuple[jax.Array, jax.Array, Optional[jax.Array]]:
    """(codes, compact scales, per-tensor scale or None) of values in `fmt`, by the library's own quantizers.

    MXFP8: E4M3 codes and uint8 E8M0 bytes; MXFP4: packed uint8 E2M1 codes and uint8 E8M0 bytes; NVFP4: packed
    codes and float8_e4m3fn scales of values / nvfp4_tensor_scale(values), which is returned as the third item.
    """
    if fmt.name == "mxfp8":
        return (*formats.quantize_mxfp8(values), None)
    if fmt.name == "mxfp4":
        return (*formats.quantize_mxfp4(values), None)
    tensor_scale = nvfp4_tensor_scale(values)
    return (*formats.quantize_nvfp4(values / tensor_scale), tensor_scale)


def gemm_inputs(key: jax.Array, m: int, n: int, k: int, fmt: str = "mxfp8") -> dict[str, jax.Array]:
    """One input set for a gemm_amax case in format `fmt`: codes and scales in each form the columns take.

    a, b, sfa_atom, sfb_atom (and alpha, NVFP4): what ours and the reference take (FP4 packed two per byte);
    a_sm, b_sm, sfa_sm, sfb_sm: what scaled_matmul / scaled_dot take (float4_e2m1fn codes, compact float8 scales);
    a_fp8, b_fp8: E4M3 codes of the same values for the FP8 dot anchor (for MXFP8 the operands themselves);
    a_bf16, b_bf16: the dequantized operands (code x block scale, without NVFP4's alpha; exact in bf16).
    """
    spec = GEMM_FORMATS[fmt]
    k_a, k_b = jax.random.split(key)
    values = (random_values(k_a, (m, k)), random_values(k_b, (n, k)))
    (a, sfa, ta), (b, sfb, tb) = (quantize_operand(v, spec) for v in values)
    codes = (formats.unpack_fp4(a), formats.unpack_fp4(b)) if spec.fp4 else (a, b)
    inputs = {"a": a, "b": b, "sfa_atom": formats.to_scale_atom(sfa), "sfb_atom": formats.to_scale_atom(sfb),
              "a_sm": codes[0], "b_sm": codes[1],
              "a_bf16": reference.dequantize_bf16(codes[0], sfa, block=spec.block, axis=-1),
              "b_bf16": reference.dequantize_bf16(codes[1], sfb, block=spec.block, axis=-1)}
    e8m0 = sfa.dtype == jnp.uint8  # MX formats; NVFP4's scales are float8_e4m3fn already
    inputs["sfa_sm"], inputs["sfb_sm"] = (_as_e8m0(sfa), _as_e8m0(sfb)) if e8m0 else (sfa, sfb)
    if spec.fp4:
        inputs["a_fp8"], inputs["b_fp8"] = (formats.quantize_mxfp8(v)[0] for v in values)
    else:
        inputs["a_fp8"], inputs["b_fp8"] = a, b
    if ta is not None:
        inputs["alpha"] = (ta * tb).astype(jnp.float32)
    return inputs


def proj_rope_inputs(key: jax.Array, tokens: int, heads: int, k: int, w_out_in: bool = True
                     ) -> dict[str, jax.Array]:
    """One input set for a proj_rope case: x and w as MXFP8 and as the same values in bf16, cos, sin.

    w, w_scale and w_bf16 are (H*192, K) for w_out_in, else (K, H*192) (the same values); w_bf16_t is w_bf16 in
    the other layout; w_oi and w_scale_e8m0 are always (H*192, K) (the scaled_matmul pipeline's).
    `proj_rope_arguments` picks the arguments of one input path.
    """
    k_x, k_w, k_angle = jax.random.split(key, 3)
    x, x_scale = random_mxfp8(k_x, (tokens, k))
    w, w_scale = random_mxfp8(k_w, (heads * support.HEAD_DIM, k))
    angles = jax.random.uniform(k_angle, (tokens, support.QK_ROPE), jnp.float32, 0.0, 2 * np.pi)
    w_bf16 = reference.dequantize_bf16(w, w_scale, block=support.MX_BLOCK, axis=-1)
    w_oi, w_scale_oi = w, w_scale  # (H*192, K) in either case: what the scaled_matmul pipeline takes
    if not w_out_in:
        w, w_scale, w_bf16 = (jnp.asarray(a.T) for a in (w, w_scale, w_bf16))
    return {"x": x, "w": w, "x_scale": x_scale, "w_scale": w_scale, "w_oi": w_oi,
            "x_scale_e8m0": _as_e8m0(x_scale), "w_scale_e8m0": _as_e8m0(w_scale_oi),
            "x_bf16": reference.dequantize_bf16(x, x_scale, block=support.MX_BLOCK, axis=-1), "w_bf16": w_bf16,
            "w_bf16_t": jnp.asarray(w_bf16.T), "cos": jnp.cos(angles).astype(jnp.bfloat16),
            "sin": jnp.sin(angles).astype(jnp.bfloat16)}


def proj_rope_arguments(inputs: dict[str, jax.Array], mxfp8: bool) -> tuple[tuple, dict]:
    """(x, w, cos, sin) and the scale keywords of `gemm_proj_rope_mxfp8` for a `proj_rope_inputs` set: the MXFP8
    codes and scales, or (bf16 path) the same values in bf16."""
    if mxfp8:
        return ((inputs["x"], inputs["w"], inputs["cos"], inputs["sin"]),
                {"x_scale": inputs["x_scale"], "w_scale": inputs["w_scale"]})
    return (inputs["x_bf16"], inputs["w_bf16"], inputs["cos"], inputs["sin"]), {}


# --------------------------------------------------------------------------------------------------------------
# What each column runs


@dataclasses.dataclass(frozen=True)
class Column:
    """One timed function of a case: which inputs it takes, and which errors at compile time mean "n/a here"."""

    key: str
    fn: Optional[Callable[..., Any]]  # None: not available, see `missing`
    inputs: tuple[str, ...]
    na_errors: tuple[type[BaseException], ...] = ()
    missing: str = ""
    checked: bool = False  # computes the same function as the reference: its output is compared with it
    check_times: str = ""  # an input (NVFP4's alpha) the output is multiplied by before the check, not timed


def _nt_dot(lhs: jax.Array, rhs: jax.Array, out_dtype: Any = jnp.float32) -> jax.Array:
    """lhs (M, K) . rhs (N, K)^T, contracting the last axes of both."""
    return jax.lax.dot_general(lhs, rhs, (((1,), (1,)), ((), ())), preferred_element_type=out_dtype)


def _scaled_matmul(a: jax.Array, b: jax.Array, sa: jax.Array, sb: jax.Array, alpha: Optional[jax.Array] = None
                   ) -> jax.Array:
    """jax.nn.scaled_matmul on 2-D operands (it takes (B, M, K)) -> f32: MXFP8 E4M3 or FP4 float4_e2m1fn codes,
    E8M0 (or NVFP4's E4M3) scales; it has no per-tensor scale, so NVFP4's alpha multiplies its result."""
    c = jax.nn.scaled_matmul(a[None], b[None], sa[None], sb[None], preferred_element_type=jnp.float32)[0]
    return c if alpha is None else c * alpha


def _scaled_dot_column(inputs: tuple[str, ...]) -> Column:
    """jax.lax.scaled_dot where the installed jax has it (0.11 does; older ones may not); NVFP4: times alpha."""
    scaled_dot = getattr(jax.lax, "scaled_dot", None)
    if scaled_dot is None:
        return Column("scaled_dot", None, inputs, missing=f"jax {jax.__version__} has no jax.lax.scaled_dot")

    def fn(a: jax.Array, b: jax.Array, sa: jax.Array, sb: jax.Array, alpha: Optional[jax.Array] = None
           ) -> jax.Array:
        c = scaled_dot(a, b, lhs_scale=sa, rhs_scale=sb, dimension_numbers=(((1,), (1,)), ((), ())),
                       preferred_element_type=jnp.float32)
        return c if alpha is None else c * alpha

    return Column("scaled_dot", fn, inputs, na_errors=(Exception,), checked=True)


def gemm_columns(fmt: str = "mxfp8") -> list[Column]:
    """The gemm_amax columns in format `fmt`, in table order (input names: `gemm_inputs`)."""
    spec = GEMM_FORMATS[fmt]
    alpha = ("alpha",) if fmt == "nvfp4" else ()
    ours = ("a", "b", "sfa_atom", "sfb_atom", *alpha)
    scaled = ("a_sm", "b_sm", "sfa_sm", "sfb_sm", *alpha)
    impl = lambda implementation: lambda a, b, sa, sb, alpha=None: jbg.gemm_amax(
        a, b, sa, sb, alpha=alpha, sf_vec_size=spec.block, implementation=implementation)
    return [Column("ours", impl(None), ours, checked=True),
            Column("ours_cutedsl", impl("cutedsl"), ours, na_errors=(ValueError,), checked=True),
            Column("reference", impl("xla"), ours, checked=True),
            Column("scaled_matmul", _scaled_matmul, scaled, na_errors=(Exception,), checked=True),
            _scaled_dot_column(scaled),
            # E4M3 codes without scales: a speed anchor (for FP4 formats: the same values quantized to MXFP8)
            Column("fp8_dot", _nt_dot, ("a_fp8", "b_fp8"), na_errors=(Exception,)),
            # the bare dot of the dequantized operands; NVFP4's alpha is applied to its output for the check only
            Column("bf16_dot", _nt_dot, ("a_bf16", "b_bf16"), na_errors=(Exception,), checked=True,
                   check_times=alpha[0] if alpha else "")]


def _unfused_pipeline(x: jax.Array, w: jax.Array, x_scale: jax.Array, w_scale: jax.Array, cos: jax.Array,
                      sin: jax.Array) -> tuple[jax.Array, ...]:
    """proj_rope the unfused way: jax.nn.scaled_matmul -> RoPE -> rowwise and columnwise MXFP8 quantization."""
    y = _scaled_matmul(x, w, x_scale, w_scale)
    y = reference.apply_rope(y.reshape(y.shape[0], -1, support.HEAD_DIM), cos, sin)
    row_codes, row_scales = formats.quantize_mxfp8(y, axis=-1, block=support.MX_BLOCK)
    col_codes, col_scales = formats.quantize_mxfp8(y, axis=0, block=support.MX_BLOCK)
    return row_codes, row_scales, col_codes, col_scales


def proj_rope_columns(mxfp8: bool, w_out_in: bool = True) -> list[Column]:
    """The proj_rope columns in table order; the bare dot is timed in both weight layouts (the faster is kept).
    With w_out_in=False ours runs on w as (K, H·192); the scaled_matmul pipeline always takes w as (H·192, K)."""
    if mxfp8:
        ours = ("x", "w", "cos", "sin", "x_scale", "w_scale")
        impl = lambda implementation: lambda x, w, c, s, xs, ws: jbg.gemm_proj_rope_mxfp8(
            x, w, c, s, x_scale=xs, w_scale=ws, w_out_in=w_out_in, implementation=implementation)
    else:
        ours = ("x_bf16", "w_bf16", "cos", "sin")
        impl = lambda implementation: lambda x, w, c, s: jbg.gemm_proj_rope_mxfp8(
            x, w, c, s, w_out_in=w_out_in, implementation=implementation)
    kn_dot = lambda x, w_t: jax.lax.dot_general(x, w_t, (((1,), (0,)), ((), ())))
    w_nk, w_kn = ("w_bf16", "w_bf16_t") if w_out_in else ("w_bf16_t", "w_bf16")
    return [Column("ours", impl(None), ours, checked=True),
            Column("ours_cutedsl", impl("cutedsl"), ours, na_errors=(ValueError,), checked=True),
            Column("reference", impl("xla"), ours, checked=True),
            Column("bf16_dot:w_out_in", functools.partial(_nt_dot, out_dtype=jnp.bfloat16), ("x_bf16", w_nk),
                   na_errors=(Exception,)),
            Column("bf16_dot:w_in_out", kn_dot, ("x_bf16", w_kn), na_errors=(Exception,)),
            Column("pipeline", _unfused_pipeline, ("x", "w_oi", "x_scale_e8m0", "w_scale_e8m0", "cos", "sin"),
                   na_errors=(Exception,), checked=True)]


def gemm_rel_err(out: Any, ref: Any) -> float:
    """||C - C_ref|| / ||C_ref|| (Frobenius) of a column's C against the reference's (gemm_amax returns (c, amax))."""
    c, c_ref = (o[0] if isinstance(o, tuple) else o for o in (out, ref))
    return float(jnp.linalg.norm(c - c_ref) / jnp.linalg.norm(c_ref))


def proj_rope_codes_equal(out: Any, ref: Any) -> float:
    """Fraction of E4M3 codes bitwise equal to the reference's, the smaller over the rowwise and columnwise copies."""
    as_bytes = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8)
    return min(float(jnp.mean(as_bytes(out[i]) == as_bytes(ref[i]))) for i in (0, 2))


# --------------------------------------------------------------------------------------------------------------
# Cases and timing


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark problem: the op, a name for the table, its GEMM flops, how to draw inputs, what to time."""

    op: str
    name: str
    dims: dict[str, Any]
    flops: float
    make_inputs: Callable[[jax.Array], dict[str, jax.Array]]
    columns: Callable[[], list[Column]]
    check: Callable[[Any, Any], float]  # (a checked column's output, the reference's) -> the "check" number
    fmt: Optional[str] = None  # gemm_amax: the GEMM_FORMATS name of its inputs


def gemm_case(m: int, n: int, k: int, fmt: str = "mxfp8") -> Case:
    """gemm_amax at M x N x K in format `fmt` -> f32; the name says the format unless it is the default MXFP8."""
    name = f"{m}x{n}x{k}" if fmt == "mxfp8" else f"{m}x{n}x{k} {fmt}"
    return Case("gemm_amax", name, {"m": m, "n": n, "k": k, "format": fmt}, 2.0 * m * n * k,
                functools.partial(gemm_inputs, m=m, n=n, k=k, fmt=fmt), functools.partial(gemm_columns, fmt),
                gemm_rel_err, fmt)


def proj_rope_case(tokens: int, heads: int, k: int, mxfp8: bool, w_out_in: bool = True) -> Case:
    """gemm_proj_rope_mxfp8 with T tokens, H heads, K inputs, on the MXFP8 or the bf16 input path; w as (H·192, K),
    or (w_out_in=False, the Flax layers' layout) as (K, H·192)."""
    n = heads * support.HEAD_DIM
    name = f"T={tokens} H={heads} K={k} {'mxfp8' if mxfp8 else 'bf16'}" + ("" if w_out_in else " w(K,N)")
    return Case("proj_rope", name,
                {"tokens": tokens, "heads": heads, "k": k, "input": "mxfp8" if mxfp8 else "bf16",
                 "w_out_in": w_out_in},
                2.0 * tokens * n * k,
                functools.partial(proj_rope_inputs, tokens=tokens, heads=heads, k=k, w_out_in=w_out_in),
                functools.partial(proj_rope_columns, mxfp8, w_out_in), proj_rope_codes_equal)


def median_ms(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, warmup: int, reps: int, burst: int = 1,
              sustained: float = 0.0) -> float:
    """Median over `reps` samples of the wall time in ms per call, after `warmup` untimed calls.

    A sample is `burst` calls issued back to back and ended by one block_until_ready, divided by `burst`: with
    burst=1 each call's host latency (dispatch, launch, the wait) is in the figure; with more the host overlaps the
    device and the figure approaches the device time per call (benchmarks/api_overhead.py measures both). The
    calls cycle through `arg_sets` (several input sets, so that caches do not hold one set between calls).
    With `sustained` > 0 seconds, samples follow each other for that long instead of `reps` times, and the median
    is over the samples of the last two thirds: the steady state of a GPU kept busy (clocks settle at its power
    limit within about a second), which is what a training loop sees.
    """
    return interleaved_medians_ms([fn], [arg_sets], warmup=warmup, reps=reps, burst=burst, sustained=sustained)[0]


def interleaved_medians_ms(fns: Sequence[Callable[..., Any]], arg_sets: Sequence[Sequence[tuple]], *, warmup: int,
                           reps: int, burst: int = 1, sustained: float = 0.0) -> list[float]:
    """`median_ms` of several functions at once (fns[i] on arg_sets[i]): each round takes one sample of every
    function in turn, so all of them meet the GPU in the same thermal state (timed one after another, the first
    runs on a cool GPU and the last on a hot one). Each round takes them in a fresh order (a seeded shuffle), so
    that no function always follows the same one: on the H200 the column that always ran right after the
    scaled_matmul pipeline's 15 ms burst was 3% slower than the same kernel in the next column, also with the order
    rotated (a rotation keeps every function's predecessor). With `sustained`, the functions share that time."""
    for fn, sets in zip(fns, arg_sets):
        for i in range(warmup):
            jax.block_until_ready(fn(*sets[i % len(sets)]))
    times: list[list[float]] = [[] for _ in fns]
    ends, calls = [], [0] * len(fns)
    orders = np.random.default_rng(0)
    first = time.perf_counter()
    while len(ends) < reps if sustained <= 0 else (not ends or ends[-1] - first < sustained):
        for j in orders.permutation(len(fns)):
            fn, sets = fns[j], arg_sets[j]
            start = time.perf_counter()
            out = None
            for _ in range(burst):
                out = fn(*sets[calls[j] % len(sets)])
                calls[j] += 1
            jax.block_until_ready(out)
            times[j].append((time.perf_counter() - start) / burst)
        ends.append(time.perf_counter())
    if sustained > 0:
        keep = [i for i, end in enumerate(ends) if end - first >= sustained / 3] or [len(ends) - 1]
        times = [[t[i] for i in keep] for t in times]
    return [1e3 * statistics.median(t) for t in times]


def _first_line(e: BaseException) -> str:
    """The exception's type and first line: enough to say why a column is n/a without a traceback."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def prepare_column(column: Column, sets: list[dict[str, jax.Array]]) -> tuple[Any, list[tuple], Any]:
    """Compiles `column` ahead and runs it once (a compile-time or first-call error in na_errors becomes
    NotAvailable). Returns (the compiled function, its argument sets, the output on the first input set where the
    column is checked, else None)."""
    if column.fn is None:
        raise NotAvailable(column.missing)
    arg_sets = [tuple(s[name] for name in column.inputs) for s in sets]
    try:
        compiled = jax.jit(column.fn).lower(*arg_sets[0]).compile()
        out = jax.block_until_ready(compiled(*arg_sets[0]))  # some backends refuse a format only when run
    except column.na_errors as e:
        raise NotAvailable(_first_line(e)) from e
    if not column.checked:
        return compiled, arg_sets, None
    return compiled, arg_sets, (out * sets[0][column.check_times] if column.check_times else out)


def time_column(column: Column, sets: list[dict[str, jax.Array]], *, warmup: int, reps: int, burst: int = 1,
                sustained: float = 0.0) -> tuple[float, Any]:
    """`prepare_column`, then `median_ms`. Returns (median ms, the checked output or None)."""
    compiled, arg_sets, out = prepare_column(column, sets)
    return median_ms(compiled, arg_sets, warmup=warmup, reps=reps, burst=burst, sustained=sustained), out


def _merge_layouts(results: dict[str, dict], prefix: str) -> None:
    """Replaces the `prefix:layout` entries by one `prefix` entry holding the faster layout (and both times)."""
    variants = {key.split(":", 1)[1]: results.pop(key) for key in list(results) if key.startswith(prefix + ":")}
    if not variants:
        return
    timed = {layout: r for layout, r in variants.items() if "ms" in r}
    if not timed:
        results[prefix] = {"na": "; ".join(f"{layout}: {r['na']}" for layout, r in variants.items())}
        return
    layout = min(timed, key=lambda name: timed[name]["ms"])
    results[prefix] = dict(timed[layout], layout=layout, layouts_ms={name: r["ms"] for name, r in timed.items()})


def run_case(case: Case, key: jax.Array, *, sets: int, warmup: int, reps: int, progress: Any, burst: int = 1,
             sustained: float = 0.0, interleave: bool = False) -> dict[str, Any]:
    """Draws `sets` fresh input sets, times every column, and returns the case's record (ms, TFLOP/s, ratios).
    interleave: compile every column first, then sample them in turn (`interleaved_medians_ms`)."""
    inputs = [case.make_inputs(k) for k in jax.random.split(key, sets)]
    jax.block_until_ready(inputs)
    results: dict[str, dict] = {}
    outputs: dict[str, Any] = {}
    timing = dict(warmup=warmup, reps=reps, burst=burst, sustained=sustained)
    prepared: dict[str, tuple] = {}
    columns = case.columns()
    for column in columns:
        try:
            if interleave:
                compiled, arg_sets, outputs[column.key] = prepare_column(column, inputs)
                prepared[column.key] = (compiled, arg_sets)
                continue
            ms, outputs[column.key] = time_column(column, inputs, **timing)
            results[column.key] = {"ms": ms, "tflops": case.flops / (ms * 1e-3) / 1e12}
            progress.write(f" {column.key} {ms:.4g} ms;")
        except NotAvailable as e:
            results[column.key] = {"na": str(e)}
            progress.write(f" {column.key} n/a;")
        progress.flush()
    if prepared:
        medians = interleaved_medians_ms([c for c, _ in prepared.values()], [a for _, a in prepared.values()],
                                         **timing)
        for name, ms in zip(prepared, medians):
            results[name] = {"ms": ms, "tflops": case.flops / (ms * 1e-3) / 1e12}
            progress.write(f" {name} {ms:.4g} ms;")
        results = {column.key: results[column.key] for column in columns}  # table order
    for name, out in outputs.items():
        if out is not None:
            results[name]["check"] = case.check(out, outputs["reference"])
    _merge_layouts(results, "bf16_dot")
    ratios = {}
    for base in BASELINES[case.op]:
        base_ms = results.get(base, {}).get("ms")
        ratios[f"vs_{base}"] = {name: (base_ms / r["ms"] if base_ms and "ms" in r else None)
                                for name, r in results.items()}
    record = {"op": case.op, "case": case.name, "dims": case.dims, "flops": case.flops,
              "check": CHECKS[case.op][0], "columns": results, "ratios": ratios}
    return record if case.fmt is None else {**record, "format": case.fmt}


def build_cases(*, ops: Sequence[str], shapes: Sequence[tuple[int, int, int]], small: bool,
                gemm_formats: Sequence[str] = DEFAULT_FORMATS, w_in_out: bool = False) -> list[Case]:
    """The cases to run, in order: gemm_amax per format, its shapes, then proj_rope T x {bf16, mxfp8} (and with
    `w_in_out` the same again with w as (K, H·192))."""
    cases = []
    if "gemm_amax" in ops:
        cases += [gemm_case(*s, fmt) for fmt in gemm_formats
                  for s in (shapes or (SMALL_GEMM_SHAPES if small else GEMM_SHAPES))]
    if "proj_rope" in ops:
        tokens, heads, k = ((SMALL_PROJ_TOKENS, SMALL_PROJ_HEADS, SMALL_PROJ_K) if small
                            else (PROJ_TOKENS, PROJ_HEADS, PROJ_K))
        cases += [proj_rope_case(t, heads, k, mxfp8, w_out_in) for w_out_in in (True, False)[:1 + w_in_out]
                  for t in tokens for mxfp8 in (False, True)]
    return cases


# --------------------------------------------------------------------------------------------------------------
# Launch costs (--launch): what a call costs beyond the math


LAUNCH_SHAPE = (128, 128, 128)
IMPLEMENTATIONS = {"ours": None, "ours_cutedsl": "cutedsl"}

_FIRST_CALL = """
import sys, time
import jax
import jax_blockgemm as jbg
from jax_blockgemm import bench
m, n, k = bench.LAUNCH_SHAPE
args = bench.gemm_inputs(jax.random.key(1), m, n, k)
args = [args[name] for name in ("a", "b", "sfa_atom", "sfb_atom")]
jax.block_until_ready(args)
implementation = bench.IMPLEMENTATIONS[sys.argv[1]]
start = time.perf_counter()
try:
    jax.block_until_ready(jax.jit(lambda *x: jbg.gemm_amax(*x, implementation=implementation))(*args))
except ValueError as e:
    print("n/a", e)
else:
    print((time.perf_counter() - start) * 1e3)
"""


def first_call_ms(column: str, cache_dir: str) -> float:
    """ms of the first jitted gemm_amax call in a fresh process: trace, kernel object, XLA compile, load, run."""
    env = dict(os.environ, **{kernel_cache.CACHE_DIR_ENV: cache_dir})
    proc = subprocess.run([sys.executable, "-c", _FIRST_CALL, column], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"the first-call process for {column} failed:\n{proc.stderr[-2000:]}")
    out = proc.stdout.strip().splitlines()[-1]
    if out.startswith("n/a"):
        raise NotAvailable(out[4:])
    return float(out)


def per_call_us(fn: Callable[..., Any], args: tuple, calls: int) -> float:
    """µs per call of `calls` back-to-back calls (no sync between them), after one warm-up call."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e6


def launch_costs(*, calls: int = 2000) -> dict[str, Any]:
    """First-call latency (empty and warm kernel cache, fresh processes) and per-call cost of a tiny gemm_amax,
    beside a trivial XLA op in the same loop."""
    m, n, k = LAUNCH_SHAPE
    inputs = gemm_inputs(jax.random.key(1), m, n, k)
    args = tuple(inputs[name] for name in ("a", "b", "sfa_atom", "sfb_atom"))
    result: dict[str, Any] = {"shape": list(LAUNCH_SHAPE), "calls": calls}
    for column, implementation in IMPLEMENTATIONS.items():
        try:
            with tempfile.TemporaryDirectory() as cache:
                cold, warm = first_call_ms(column, cache), first_call_ms(column, cache)
            fn = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation=implementation))
            result[column] = {"first_call_cold_ms": cold, "first_call_warm_cache_ms": warm,
                              "per_call_us": per_call_us(fn, args, calls)}
        except NotAvailable as e:
            result[column] = {"na": str(e)}
    plain = jax.jit(lambda x: x * 2.0 + 1.0)
    result["plain_xla_op_us"] = per_call_us(plain, (random_values(jax.random.key(2), (m, n)),), calls)
    return result


def format_launch(launch: dict[str, Any]) -> list[str]:
    """The launch-cost lines printed under the table."""
    shape = "x".join(map(str, launch["shape"]))
    lines = ["", f"launch costs, gemm_amax {shape} (first call: fresh process; per call: {launch['calls']} "
                 f"back-to-back calls; a trivial XLA op: {launch['plain_xla_op_us']:.1f} us per call)"]
    for column in IMPLEMENTATIONS:
        entry = launch[column]
        if "na" in entry:
            lines.append(f"  {GEMM_COLUMNS[column]}: n/a ({entry['na']})")
        else:
            lines.append(f"  {GEMM_COLUMNS[column]}: first call {entry['first_call_cold_ms']:.0f} ms with an empty "
                         f"kernel cache, {entry['first_call_warm_cache_ms']:.0f} ms with a warm one; "
                         f"{entry['per_call_us']:.1f} us per call")
    return lines


# --------------------------------------------------------------------------------------------------------------
# Reporting


def _version(dist: str) -> str:
    """An installed distribution's version, read from its metadata (importing CuTeDSL would cost seconds)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment() -> dict[str, str]:
    """Device and software versions, recorded with every run."""
    device = jax.devices()[0]
    return {"device": device.device_kind, "platform": device.platform, "device_count": str(jax.device_count()),
            "jax": jax.__version__, "jaxlib": _version("jaxlib"), "cutedsl": _version("nvidia-cutlass-dsl"),
            "jax_blockgemm": jbg.__version__, "python": platform.python_version()}


def _labels(op: str) -> dict[str, str]:
    """Column key -> table label, in table order."""
    return GEMM_COLUMNS if op == "gemm_amax" else PROJ_COLUMNS


def _title(op: str, fmt: Optional[str] = None) -> str:
    """The heading of a table and chart panel: the op and, for gemm_amax, the format (MXFP8 E4M3 if unsaid)."""
    if op == "gemm_amax":
        return f"gemm_amax, {GEMM_FORMATS[fmt or 'mxfp8'].title} -> f32, M x N x K"
    return "gemm_proj_rope_mxfp8, w (H*192, K) unless a case says w(K,N)"


def _sections(record: dict[str, Any]) -> list[tuple[str, Optional[str], list[dict[str, Any]]]]:
    """(op, format, cases) per table and chart panel: per op in OPS, one per gemm format in the order run."""
    sections = []
    for op in OPS:
        cases = [c for c in record["cases"] if c["op"] == op]
        for fmt in dict.fromkeys(c.get("format") for c in cases):
            sections.append((op, fmt, [c for c in cases if c.get("format") == fmt]))
    return sections


def _gemm_note(fmt: Optional[str]) -> str:
    """The footnote of a gemm_amax table: which input form each column takes."""
    if fmt in (None, "mxfp8"):
        return ("  ours and the reference take scales in the 128x4 atom (converted before timing); scaled_matmul "
                "and scaled_dot take compact float8_e8m0fnu scales; fp8 dot: codes without scales; bf16 dot: the "
                "dequantized operands")
    scales = "float8_e8m0fnu scales per 32" if fmt == "mxfp4" else "float8_e4m3fn scales per 16"
    alpha = ("; alpha (fp32 per-tensor scale): ours take it, scaled_matmul and scaled_dot multiply their result by "
             "it, the bf16 dot's result is multiplied by it for the check only" if fmt == "nvfp4" else "")
    return (f"  ours and the reference take E2M1 codes packed two per byte and scales in the 128x4 atom; "
            f"scaled_matmul and scaled_dot take float4_e2m1fn codes and compact {scales}; fp8 dot: E4M3 codes of "
            f"the same values without scales; bf16 dot: the dequantized operands{alpha}")


def header_lines(record: dict[str, Any]) -> list[str]:
    """Device, versions and method: the first lines of the table and the chart's title."""
    env, method = record["environment"], record["method"]
    return [f"jax_blockgemm benchmark, {record['date']}: {env['device']} ({env['platform']}), jax {env['jax']}, "
            f"jaxlib {env['jaxlib']}, CuTeDSL {env['cutedsl']}, Python {env['python']}",
            (f"median of the samples in the last two thirds of {method['sustained_s']:g} s per "
             f"{'case' if method.get('interleave') else 'column'}, each "
             if method.get("sustained_s") else f"median of {method['reps']} samples of ")
            + f"{method.get('burst', 1)} back-to-back calls after {method['warmup']} warm-up, {method['sets']} "
            "input sets rotated; " + ("the columns' samples taken in turn; " if method.get("interleave") else "")
            + "TFLOP/s counts the GEMM's 2*M*N*K; speedup = baseline ms / column ms"]


def _cell(entry: dict[str, Any], field: str, fmt: str) -> str:
    """A table cell: the formatted number, "n/a" for a column that did not run, "-" for a number it does not have."""
    if "ms" not in entry:
        return "n/a"
    return format(entry[field], fmt) if field in entry else "-"


def format_table(record: dict[str, Any]) -> str:
    """The aligned text table: per op, one block of rows per case (ms, TFLOP/s, check, a speedup row per baseline)."""
    lines = header_lines(record)
    for op, gemm_format, cases in _sections(record):
        labels = _labels(op)
        rows = [[_title(op, gemm_format), "", *labels.values()]]
        for case in cases:
            cols = [case["columns"][key] for key in labels]
            rows.append([case["case"], "ms", *(_cell(c, "ms", ".4g") for c in cols)])
            rows.append(["", "TFLOP/s", *(_cell(c, "tflops", ".4g") for c in cols)])
            check, fmt = CHECKS[op]
            rows.append(["", check, *(_cell(c, "check", fmt) for c in cols)])
            for base in BASELINES[op]:
                ratios = case["ratios"][f"vs_{base}"]
                rows.append(["", f"speedup vs {labels[base]}",
                             *("n/a" if ratios[key] is None else f"{ratios[key]:.3g}x" for key in labels)])
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines.append("")
        for row in rows:
            lines.append("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                                   for i, (cell, w) in enumerate(zip(row, widths))).rstrip())
        reasons = {(labels[key], entry["na"]) for case in cases for key, entry in case["columns"].items()
                   if "na" in entry}
        lines += [f"  n/a {label}: {reason}" for label, reason in sorted(reasons)]
        if op == "gemm_amax":
            lines.append(_gemm_note(gemm_format))
        if op == "proj_rope":
            lines.append("  bare bf16 dot: x . w^T -> bf16, the faster weight layout; scaled_matmul pipeline: MXFP8 "
                         "in on both paths")
    if "launch" in record:
        lines += format_launch(record["launch"])
    return "\n".join(lines)


def write_png(record: dict[str, Any], path: str) -> None:
    """A bar chart of TFLOP/s per case and column (matplotlib, imported here: the `bench` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise SystemExit(f"--png needs matplotlib: pip install 'jax_blockgemm[bench]' ({e}).")
    sections = _sections(record)
    fig, axes = plt.subplots(len(sections), 1, figsize=(11, 4.2 * len(sections)), squeeze=False)
    for ax, (op, fmt, cases) in zip(axes[:, 0], sections):
        labels = _labels(op)
        width = 0.8 / len(labels)
        handles = []
        for j, (key, label) in enumerate(labels.items()):
            timed = [(i, c["columns"][key]["tflops"]) for i, c in enumerate(cases) if "ms" in c["columns"][key]]
            xs = [i + (j - (len(labels) - 1) / 2) * width for i, _ in timed]
            ax.bar(xs, [y for _, y in timed], width, color=f"C{j}")
            handles.append(Patch(color=f"C{j}", label=label if timed else f"{label} (n/a)"))
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([c["case"] for c in cases], fontsize=8)
        ax.set_ylabel("TFLOP/s (GEMM flops)")
        ax.set_title(_title(op, fmt), fontsize=10)
        ax.set_ylim(top=1.3 * ax.get_ylim()[1])  # room for the legend
        ax.legend(handles=handles, fontsize=7, ncol=4, loc="upper left")
    fig.suptitle("\n".join(header_lines(record)), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------------
# Command line


def parse_shape(text: str) -> tuple[int, int, int]:
    """--shape M,N,K: three positive integers, K a multiple of 32 (the MX block; also 16-byte FP4 rows), 16-byte
    aligned rows."""
    parts = text.split(",")
    try:
        if len(parts) != 3:
            raise ValueError
        m, n, k = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected M,N,K (three integers separated by commas); got {text!r}.")
    if min(m, n, k) < 1:
        raise argparse.ArgumentTypeError(f"M, N and K must be positive; got {text!r}.")
    if k % support.MX_BLOCK:
        raise argparse.ArgumentTypeError(f"K must be a multiple of {support.MX_BLOCK} (the MXFP8 block, which every "
                                         f"baseline needs whole); got K={k}.")
    try:
        support.check_alignment(ab_dtype=formats.E4M3, c_dtype=jnp.float32, m=m, n=n, k=k, a_major="k",
                                b_major="k", c_major="n")
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}")
    return m, n, k


def parse_formats(text: str) -> list[str]:
    """--format: one gemm_amax format or a comma list of them, each one of GEMM_FORMATS."""
    names = [name.strip().lower() for name in text.split(",")]
    for name in names:
        if name not in GEMM_FORMATS:
            raise argparse.ArgumentTypeError(f"unknown format {name!r} in {text!r}; choose from "
                                             f"{', '.join(GEMM_FORMATS)} (a comma list, or the option repeated).")
    return names


def _seconds(text: str) -> float:
    """A --sustained duration: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0.0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}; got {text!r}.")
        return value
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jax_blockgemm.bench", description=__doc__.split("\n\n")[0],
                                epilog="Without options: the SPEC §8 cases of both operations.")
    p.add_argument("--shape", type=parse_shape, action="append", default=[], metavar="M,N,K",
                   help="a gemm_amax shape to run instead of the SPEC §8 ones (repeatable)")
    p.add_argument("--format", type=parse_formats, action="append", default=[], metavar="FORMAT[,FORMAT]",
                   help=f"gemm_amax input format(s): {', '.join(GEMM_FORMATS)} (repeatable or a comma list; "
                        "default mxfp8; proj_rope is MXFP8 only)")
    p.add_argument("--op", choices=OPS, action="append", default=[], help="run only this operation (repeatable)")
    p.add_argument("--small", action="store_true", help="a tiny twin of every case (runs on a CPU in seconds)")
    p.add_argument("--reps", type=_count(1), default=20, help="timed calls per column (the median is reported)")
    p.add_argument("--warmup", type=_count(0), default=3, help="untimed calls per column before timing")
    p.add_argument("--burst", type=_count(1), default=10,
                   help="calls per timed sample, issued back to back with one wait (1: each call waited for)")
    p.add_argument("--sets", type=_count(1), default=2, help="input sets drawn per case and rotated between calls")
    p.add_argument("--sustained", type=_seconds, default=0.0, metavar="SECONDS",
                   help="time each column by samples back to back for this long instead of --reps, median of the "
                        "last two thirds: the steady state at the GPU's power limit (0: off)")
    p.add_argument("--interleave", action="store_true",
                   help="compile a case's columns first, then take their samples in turn (a shuffled order each "
                        "round), so that every column meets the GPU in the same thermal state (with --sustained the "
                        "columns share that time)")
    p.add_argument("--w-in-out", action="store_true",
                   help="also time proj_rope with w as (K, H*192) (w_out_in=False, the Flax layers' layout)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--launch", action="store_true",
                   help="also measure launch costs: first-call latency in fresh processes, per-call overhead")
    p.add_argument("--json", metavar="PATH", help="write the raw numbers here")
    p.add_argument("--png", metavar="PATH", help="write a bar chart here (needs matplotlib)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Runs the benchmark; prints progress to stderr and the table to stdout; returns the record."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    gemm_formats = tuple(dict.fromkeys(name for names in args.format for name in names)) or DEFAULT_FORMATS
    cases = build_cases(ops=args.op or OPS, shapes=args.shape, small=args.small, gemm_formats=gemm_formats,
                        w_in_out=args.w_in_out)
    record = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": " ".join(["python -m jax_blockgemm.bench", *argv]), "environment": environment(),
              "method": {"reps": args.reps, "warmup": args.warmup, "sets": args.sets, "seed": args.seed,
                         "burst": args.burst, "formats": list(gemm_formats), "sustained_s": args.sustained,
                         "interleave": args.interleave,
                         "timing": "median over samples of the wall time per call of `burst` jitted calls issued "
                                   "back to back and ended by one block_until_ready"
                                   + (f"; samples back to back for {args.sustained:g} s per "
                                      f"{'case' if args.interleave else 'column'}, the median over the last two "
                                      "thirds" if args.sustained else "")
                                   + ("; the columns' samples taken in turn" if args.interleave else "")},
              "cases": []}
    key = jax.random.key(args.seed)
    for i, (case, case_key) in enumerate(zip(cases, jax.random.split(key, len(cases)))):
        start = time.perf_counter()
        sys.stderr.write(f"[{i + 1}/{len(cases)}] {case.op} {case.name}:")
        sys.stderr.flush()
        record["cases"].append(run_case(case, case_key, sets=args.sets, warmup=args.warmup, reps=args.reps,
                                        progress=sys.stderr, burst=args.burst, sustained=args.sustained,
                                        interleave=args.interleave))
        sys.stderr.write(f" done in {time.perf_counter() - start:.1f} s\n")
        sys.stderr.flush()
    if args.launch:
        sys.stderr.write("launch costs (fresh processes) ...\n")
        record["launch"] = launch_costs()
    print(format_table(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    if args.png:
        write_png(record, args.png)
    return record


if __name__ == "__main__":
    main()
