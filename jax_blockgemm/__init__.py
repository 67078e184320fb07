"""jax_blockgemm: fused block-scaled (MXFP8 / MXFP4 / NVFP4) GEMM kernels as composable JAX primitives.

gemm_amax: block-scaled GEMM that also returns amax = max|C|. gemm_proj_rope_mxfp8: DeepSeek-V3's MLA Q
up-projection (GEMM + per-head RoPE + MXFP8 rowwise and columnwise quantization). Both run everywhere through a
pure-JAX reference and through CuTeDSL kernels where the GPU has one; `formats` holds the quantizers and layouts.
Mixture of experts: `ragged_gemm_amax` (tokens sorted by group times per-group weights) and its differentiable
`mx_ragged_dot`, a drop-in for jax.lax.ragged_dot. For serving: `weight_only_matmul` (x in bf16 / float32 times a
`QuantizedWeight` from `quantize_weight`) and `weight_only_ragged_matmul` (tokens sorted by group times stacked
quantized expert weights).
For training: `mx_dot_general` (a differentiable drop-in for jax.lax.dot_general) and `mla_q_projection`; Flax and
Equinox layers live in `jax_blockgemm.layers` (optional extras).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and editors see; at run time `__getattr__` imports each name on first use
    from jax_blockgemm import formats
    from jax_blockgemm.api import (
        gemm_amax,
        gemm_amax_jax_sm100,
        gemm_proj_rope_mxfp8,
        gemm_proj_rope_mxfp8_jax_sm100,
        ragged_gemm_amax,
        weight_only_matmul,
        weight_only_ragged_matmul,
    )
    from jax_blockgemm.autodiff import RECIPES, Recipe, mx_dot_general, mx_dot_general_amax
    from jax_blockgemm.mla import MXFP8Views, mla_q_projection
    from jax_blockgemm.moe import mx_ragged_dot
    from jax_blockgemm.weight_only import QuantizedWeight, quantize_weight

# Each public name and the module that defines it. Importing the package imports none of them, so that
# `python -m jax_blockgemm.arch` (which every operation's module imports) runs that module once, as `__main__`.
_PUBLIC = {
    "formats": "formats",
    "gemm_amax": "api",
    "gemm_amax_jax_sm100": "api",
    "gemm_proj_rope_mxfp8": "api",
    "gemm_proj_rope_mxfp8_jax_sm100": "api",
    "mx_dot_general": "autodiff",
    "mx_dot_general_amax": "autodiff",
    "mx_ragged_dot": "moe",
    "ragged_gemm_amax": "api",
    "Recipe": "autodiff",
    "RECIPES": "autodiff",
    "MXFP8Views": "mla",
    "mla_q_projection": "mla",
    "QuantizedWeight": "weight_only",
    "quantize_weight": "weight_only",
    "weight_only_matmul": "api",
    "weight_only_ragged_matmul": "api",
}
__all__ = list(_PUBLIC)
__version__ = "0.1.0"


def _register_ffi_targets() -> None:
    """Registers our FFI handlers with JAX so that programs exported elsewhere (jax.export) find them here.

    Cheap and GPU-free; skipped quietly where the native module is not built (the reference still works).
    """
    try:
        from jax_blockgemm import _native

        _native.register_ffi_targets()
    except ImportError:
        pass


_register_ffi_targets()


def __getattr__(name: str) -> Any:
    """A public name, or a submodule (`jbg.reference`), imported on its first use and kept as an attribute."""
    if name.startswith("__"):  # probes such as __wrapped__ name no submodule
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _PUBLIC.get(name, name)
    try:
        found = importlib.import_module(f"{__name__}.{module}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{module}":  # the module exists and failed to import something of its own
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = found if module == name else getattr(found, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The attributes there are now and the public names still to import."""
    return sorted(set(globals()) | set(_PUBLIC))
