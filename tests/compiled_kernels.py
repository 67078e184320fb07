"""Catalog kernels compiled on the CPU for the structure and ABI tests: each variant once per test process, and the
two test tiers, one representative variant per kernel class by default, every variant under the `catalog` marker."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import warnings
from typing import Any, Iterable

from jax_blockgemm.kernels import catalog


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What the tests read from one compiled variant."""

    ptx: str
    object_bytes: bytes  # the relocatable object that the FFI library links
    header: str  # the C header of the exported wrapper, which ffi/*.cc calls
    fn: Any  # the DSL's compiled function (its cubin)
    kernel: Any  # the kernel object it was traced from (the facts it records while traced)
    deprecations: tuple[str, ...]  # the deprecation warnings tracing and compiling it raised (APIs due to go)


_COMPILED: dict[str, Compiled] = {}


def compiled(v: catalog.KernelVariant) -> Compiled:
    """Variant `v` compiled for its architecture with its PTX and cubin kept; compiled once per process."""
    if v.key not in _COMPILED:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kernel = catalog.make_kernel(v)
            fn = catalog.compile_function(v, keep_ptx=True, kernel=kernel)
        deprecations = tuple(sorted({f"{w.filename}:{w.lineno}: {w.message}" for w in caught
                                     if issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning))}))
        with tempfile.TemporaryDirectory() as d:
            fn.export_to_c(d, v.function_prefix, function_prefix=v.function_prefix)
            with open(os.path.join(d, v.function_prefix + ".h")) as f:
                header = f.read()
        _COMPILED[v.key] = Compiled(fn.__ptx__, fn.dump_to_object(v.function_prefix), header, fn, kernel,
                                    deprecations)
    return _COMPILED[v.key]


# One variant per kernel class, compiled by the default tier; the catalog tier compiles every variant. Chosen to
# reach the most code paths of their class (FP4 and FP8 C, alpha, both operands MN-major, a multicast cluster).
REPRESENTATIVE_KEYS: frozenset[str] = frozenset({
    "gemm_amax.sm_90a.e4m3.f32.sf32.t128x128.c1x1",  # MXFP8, K-major operands
    "gemm_amax.sm_90a.e2m1.e2m1.sf32.t128x128.c1x1",  # MXFP4 into packed FP4 C
    "gemm_amax.sm_90a.e2m1.e4m3.sf16e4m3.t128x128.c1x1",  # NVFP4 with alpha into FP8 C
    "gemm_amax.sm_90a.e5m2.f16.sf32.t128x128.c1x1.am.bn",  # MN-major A and B, f16 C
    "proj_rope.sm_90a.bf16.e4m3.sf32.t128x192.c1x1.staged",  # w (N, K)
    "proj_rope.sm_90a.bf16.e4m3.sf32.t128x192.c1x1.bn.staged",  # w (K, N), the Flax layers' layout
    "dequantize.sm_90a.e4m3.bf16.sf32.t1x16.c1x1",  # scales along the rows
    "dequantize.sm_90a.e4m3.bf16.sf32.t1x16.c1x1.am",  # scales along the columns
    "gemm_amax.sm_100a.e5m2.bf16.sf32.t128x256.c2x1",  # MXFP8, the wide tile, a multicast cluster
    "gemm_amax.sm_100a.e2m1.f32.sf16e4m3.t128x128.c2x2",  # NVFP4 with alpha
    "gemm_amax.sm_100a.e4m3.bf16.sf32.t128x128.c1x1.am.bn",  # MN-major A and B
    "proj_rope.sm_100a.bf16.e4m3.sf32.t128x192.c1x1",  # w (N, K)
    "dequantize.sm_100a.e4m3.bf16.sf32.t1x16.c1x1",
    "dequantize.sm_100a.e4m3.bf16.sf32.t1x16.c1x1.am",
    "weight_stream.sm_90a.e2m1.bf16.sf16e4m3.t32x64.c1x1",  # the decode GEMM: NVFP4 (packed codes, E4M3 scales)
    "weight_stream.sm_100a.e4m3.f32.sf32.t32x16.c1x1",  # MXFP8, the 16-row variant
    "ragged.sm_90a.e2m1.bf16.sf16e4m3.t128x128.c1x1",  # the grouped GEMM: NVFP4 (alpha), bf16 C
    "ragged.sm_100a.e4m3.f32.sf32.t128x128.c1x1",  # ... its tcgen05 form: MXFP8, the row-predicated epilogue
    "ragged.sm_90a.bf16.f32.sf0none.t128x256.c1x1.bn",  # the bf16 grouped GEMM, N-major weights
    "contraction.sm_90a.bf16.bf16.sf0none.t128x128.c1x1.am.bn",  # the grouped contraction (weight gradient)
    "quantize_pair.sm_90a.e4m3.e5m2.sf32.t32x256.c1x1",  # both quantizations of a weight, E4M3 values, E5M2 codes
})


def representatives(variants: Iterable[catalog.KernelVariant]) -> list[catalog.KernelVariant]:
    """The representative variants among `variants` (the default tier's share of a parametrization)."""
    return [v for v in variants if v.key in REPRESENTATIVE_KEYS]


def named(variants: Iterable[catalog.KernelVariant]) -> list[tuple[str, catalog.KernelVariant]]:
    """`parameterized.named_parameters` arguments: one test per variant, named by its key."""
    return [(v.key, v) for v in variants]
