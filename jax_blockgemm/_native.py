"""The native FFI bridge: imports `jax_blockgemm._jbg_ffi`, finds the CuTeDSL runtime, registers the targets.

Everything here is lazy and idempotent: importing jax_blockgemm never touches the extension, the DSL or a GPU;
the first CUDA lowering of a kernel call runs `register_ffi_targets()`. Registration needs no GPU (JAX queues
CUDA registrations until its CUDA backend starts). The DSL runtime is loaded when found; where it is missing, the
handler's instantiate stage reports that instead of crashing.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import pathlib
import threading
from types import ModuleType

import jax

#: Environment variable that overrides where libcute_dsl_runtime.so is taken from.
logger = logging.getLogger(__name__)

RUNTIME_ENV = "JAX_BLOCKGEMM_CUTE_DSL_RUNTIME"
RUNTIME_NAME = "libcute_dsl_runtime.so"
GEMM_AMAX_TARGET = "jbg_gemm_amax"
PROJ_ROPE_TARGET = "jbg_gemm_proj_rope_mxfp8"
DEQUANTIZE_TARGET = "jbg_dequantize_mxfp8"
WEIGHT_STREAM_TARGET = "jbg_weight_stream"
RAGGED_TARGET = "jbg_ragged_gemm_amax"
CONTRACTION_TARGET = "jbg_grouped_contraction"
QUANTIZE_PAIR_TARGET = "jbg_quantize_pair"

_LOCK = threading.Lock()
_REGISTERED: set[str] = set()


@functools.lru_cache(maxsize=None)
def extension() -> ModuleType:
    """The compiled module `jax_blockgemm._jbg_ffi` (raises ImportError with a build hint when missing)."""
    try:
        import jax_blockgemm._jbg_ffi as _jbg_ffi  # the submodule itself, not the package's namespace
    except ImportError as e:
        raise ImportError(
            "jax_blockgemm's native FFI bridge (jax_blockgemm._jbg_ffi) is not built; build it with "
            "`pip install --no-build-isolation -e .` (needs a C++17 compiler, cmake, nanobind and jax; "
            f"see BUILD.md): {e}") from e
    return _jbg_ffi


def runtime_library_path() -> pathlib.Path | None:
    """Where libcute_dsl_runtime.so is: $JAX_BLOCKGEMM_CUTE_DSL_RUNTIME, else the nvidia-cutlass-dsl wheel
    (the cu13 build first, then cu12). None when neither exists. Does not import the DSL."""
    override = os.environ.get(RUNTIME_ENV)
    if override:
        return pathlib.Path(override)
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        for cuda in ("cu13", "cu12"):
            candidate = pathlib.Path(root) / cuda / "lib" / RUNTIME_NAME
            if candidate.is_file():
                return candidate
    return None


def load_runtime() -> pathlib.Path | None:
    """dlopens the CuTeDSL runtime into the bridge once; returns its path, or None when it cannot be found."""
    ext = extension()
    if ext.runtime_path():
        return pathlib.Path(ext.runtime_path())
    path = runtime_library_path()
    if path is None:
        return None
    ext.load_runtime(str(path))  # RuntimeError with dlerror's text when the file is not loadable
    return path


def register_ffi_targets(platform: str = "CUDA") -> None:
    """Registers the handler state type and every FFI target with JAX for `platform`, once per process.

    The state type goes first: XLA rejects a stateful handler whose state type it does not know yet.
    """
    with _LOCK:
        if platform in _REGISTERED:
            return
        ext = extension()
        try:
            load_runtime()
        except RuntimeError as e:  # the instantiate stage reports it if a program ever needs a kernel
            logger.warning("jax_blockgemm: %s", e)
        for name, registration in ext.ffi_types().items():
            jax.ffi.register_ffi_type(name, registration, platform=platform)
        for name, stages in ext.ffi_targets().items():
            jax.ffi.register_ffi_target(name, stages, platform=platform, api_version=1)
        _REGISTERED.add(platform)
