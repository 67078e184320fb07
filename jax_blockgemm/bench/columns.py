"""The columns of each operation's table: what each one runs, its label, which are baselines, how outputs are checked.

A column names the entries of an input set it takes (`inputs.gemm_inputs` / `inputs.proj_rope_inputs`), so that
every column of a case runs on the same values; the errors it lists as "not available here" turn into an n/a cell.
NVIDIA's own JAX entry points (cuDNN frontend's CuTeDSL kernels, sm_100 only) are a column only on a GPU of compute
capability 10.x: a table elsewhere does not show them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

import jax_blockgemm as jbg
from jax_blockgemm import formats, reference, support
from jax_blockgemm.bench.inputs import GEMM_FORMATS, as_e8m0

OPS = ("gemm_amax", "proj_rope")
NVIDIA_LABEL = "cudnn-fe sm100"  # NVIDIA's JAX entry point: a column on compute capability 10.x only
GEMM_COLUMNS = {"ours": "ours(None)", "ours_cutedsl": "ours(cutedsl)", "reference": "reference(xla)",
                "scaled_matmul": "nn.scaled_matmul", "scaled_dot": "lax.scaled_dot", "fp8_dot": "fp8 dot",
                "bf16_dot": "bf16 dot", "nvidia": NVIDIA_LABEL}
PROJ_COLUMNS = {"ours": "ours(None)", "ours_cutedsl": "ours(cutedsl)", "reference": "reference(xla)",
                "bf16_dot": "bare bf16 dot", "pipeline": "scaled_matmul pipeline", "nvidia": NVIDIA_LABEL}
# Per op: column key -> label, in table order. A table shows the columns its cases ran or marked n/a.
LABELS = {"gemm_amax": GEMM_COLUMNS, "proj_rope": PROJ_COLUMNS}
# NVIDIA's JAX entry points for the two operations (nvidia-cudnn-frontend >= 1.28): (module, function)
NVIDIA_ENTRY_POINTS = {"gemm_amax": ("cudnn.gemm.cutedsl.dense.amax.jax_api", "gemm_amax_jax_sm100"),
                       "proj_rope": ("cudnn.gemm.cutedsl.dense.proj_rope_mxfp8.jax_api",
                                     "gemm_proj_rope_mxfp8_jax_sm100")}
BASELINES = {"gemm_amax": ("scaled_matmul", "reference", "scaled_dot"), "proj_rope": ("bf16_dot", "pipeline")}
CHECKS = {"gemm_amax": ("rel err vs reference", ".1e"), "proj_rope": ("codes = reference", ".2%")}


class NotAvailable(Exception):
    """A column that cannot run here: no kernel applies, the installed jax lacks the API, or no lowering exists."""


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


def device_capability() -> Optional[str]:
    """The compute capability ("10.0") of the device the benchmark runs on (JAX's first), or None if not a GPU."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return None
    return str(getattr(device, "compute_capability", "") or "") or None


def _load_entry_point(module: str, name: str) -> Callable[..., Any]:
    return getattr(importlib.import_module(module), name)


def nvidia_entry_point(op: str) -> tuple[Optional[Callable[..., Any]], str]:
    """(NVIDIA's JAX entry point for `op`, "") where it can run: a GPU of compute capability 10.x with
    nvidia-cudnn-frontend importable; (None, why not) elsewhere, "" as the reason when the GPU is not a 10.x one
    (its kernels are built for sm_100 only: the column does not apply there)."""
    capability = device_capability()
    if capability is None or capability.split(".")[0] != "10":
        return None, ""
    module, name = NVIDIA_ENTRY_POINTS[op]
    try:
        return _load_entry_point(module, name), ""
    except Exception as e:  # not installed, too old, or its CUDA libraries fail to load
        return None, (f"{module}.{name} does not import ({type(e).__name__}: {str(e).strip()[:160]}); pip install "
                      "'nvidia-cudnn-frontend>=1.28'")


def _nvidia_gemm_column(fmt: str) -> list[Column]:
    """NVIDIA's gemm_amax_jax_sm100 on the MXFP8 operands (its documented form: A (M, K, 1), B (N, K, 1) K-major,
    float8_e8m0fnu scales in the (1, MN', K', 32, 4, 4) atom), C as (M, N) for the check; [] where it does not
    apply (another format, or not compute capability 10.x)."""
    fn, why = nvidia_entry_point("gemm_amax")
    if fmt != "mxfp8" or (fn is None and not why):
        return []
    inputs = ("a", "b", "sfa_atom", "sfb_atom")
    if fn is None:
        return [Column("nvidia", None, inputs, missing=why)]

    def run(a: jax.Array, b: jax.Array, sfa: jax.Array, sfb: jax.Array) -> tuple[jax.Array, jax.Array]:
        c, amax = fn(a[:, :, None], b[:, :, None], as_e8m0(sfa), as_e8m0(sfb))
        return c[:, :, 0], amax.reshape(())

    return [Column("nvidia", run, inputs, na_errors=(Exception,), checked=True)]


def _nvidia_proj_rope_column(mxfp8: bool, w_out_in: bool) -> list[Column]:
    """NVIDIA's gemm_proj_rope_mxfp8_jax_sm100 (n/a for w as (K, H·192): its JAX entry point takes (H·192, K)
    only); [] off compute capability 10.x. Its scales round their own way: its codes need not all equal ours."""
    fn, why = nvidia_entry_point("proj_rope")
    if fn is None and not why:
        return []
    inputs = ("x", "w", "cos", "sin", "x_scale", "w_scale") if mxfp8 else ("x_bf16", "w_bf16", "cos", "sin")
    if not w_out_in:
        why = why or "its JAX entry point takes w as (H*192, K) only (w_out_in=True)"
    if fn is None or not w_out_in:
        return [Column("nvidia", None, inputs, missing=why)]
    return [Column("nvidia", fn, inputs, na_errors=(Exception,), checked=True)]


def gemm_columns(fmt: str = "mxfp8") -> list[Column]:
    """The gemm_amax columns in format `fmt`, in table order (input names: `inputs.gemm_inputs`)."""
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
                   check_times=alpha[0] if alpha else ""),
            *_nvidia_gemm_column(fmt)]


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
                   na_errors=(Exception,), checked=True),
            *_nvidia_proj_rope_column(mxfp8, w_out_in)]


def gemm_rel_err(out: Any, ref: Any) -> float:
    """||C - C_ref|| / ||C_ref|| (Frobenius) of a column's C against the reference's (gemm_amax returns (c, amax))."""
    c, c_ref = (o[0] if isinstance(o, tuple) else o for o in (out, ref))
    return float(jnp.linalg.norm(c - c_ref) / jnp.linalg.norm(c_ref))


def proj_rope_codes_equal(out: Any, ref: Any) -> float:
    """Fraction of E4M3 codes bitwise equal to the reference's, the smaller over the rowwise and columnwise copies."""
    as_bytes = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8)
    return min(float(jnp.mean(as_bytes(out[i]) == as_bytes(ref[i]))) for i in (0, 2))
