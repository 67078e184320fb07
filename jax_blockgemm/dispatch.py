"""Which CuTeDSL kernels serve a primitive call: by architecture, dtypes, layouts and the local GPU.

The CUDA lowering embeds one object per architecture that has a matching kernel, so a program lowered (or
exported) anywhere runs on any GPU the catalog covers; the FFI handler picks by compute capability at run time.
What `implementation=None` takes per architecture is `arch.TABLE`'s; where the local GPU has no kernel it takes the
reference. A kernel of an architecture where ours never ran (`arch.is_verified`) is used on a local GPU only once
its first-use self-check has passed there (`gate`: checked in a child process, verdicts kept on disk); when it
failed, None falls back to the reference and "cutedsl" raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from jax_blockgemm import arch, formats, tuning

# The kernels and the FFI handler take sizes and element counts as int32: a call with an operand or C of this many
# elements or more never reaches them (None takes the reference, "cutedsl" raises at lowering).
MAX_KERNEL_ELEMENTS = 2**31


_FORCED = threading.local()


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The kernel variants (one per architecture) for a call, or why there are none."""

    variants: tuple = ()
    reason: str = ""
    # gemm_amax with c_major="m": the kernels compute C^T = B·A^T as an N-major (L, N, M) result, i.e. the call
    # with A and B (and their scales) swapped.
    swap_ab: bool = False


@contextlib.contextmanager
def forced_variants(variants: Sequence[Any]) -> Iterator[None]:
    """Within this block (this thread), lowerings with implementation='cutedsl' use exactly those of `variants` that
    are of their operation (gemm_amax, proj_rope).

    For the self-check's child process, which must run one given variant (also a deliberately broken test one)
    without consulting its own verdict.
    """
    saved = getattr(_FORCED, "variants", None)
    _FORCED.variants = tuple(variants)
    try:
        yield
    finally:
        _FORCED.variants = saved


@functools.lru_cache(maxsize=None)
def local_cuda_capabilities() -> tuple[str, ...] | None:
    """Compute capabilities of the visible CUDA devices, or None where JAX sees no CUDA device."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return None
    return tuple(sorted({str(getattr(d, "compute_capability", "")) for d in devices}))


def _past_int32(avals_in: Sequence[Any], a_major: str = "k", b_major: str = "k") -> str:
    """Why a canonical call (a (L, M, K) or (L, K, M), b likewise) is too large for int32 indexing, or ""."""
    l, m = avals_in[0].shape[0], avals_in[0].shape[2 if a_major == "m" else 1]
    n = avals_in[1].shape[2 if b_major == "n" else 1]
    named = [(name, tuple(x.shape)) for name, x in zip(("a", "b", "sfa", "sfb"), avals_in)] + [("c", (l, m, n))]
    for name, shape in named:
        if math.prod(shape) >= MAX_KERNEL_ELEMENTS:
            return (f"{name} {shape} holds {math.prod(shape)} elements, past the kernels' 32-bit indexing (fewer "
                    f"than 2**31 = {MAX_KERNEL_ELEMENTS}); implementation=None or 'xla' takes the reference")
    return ""


def gemm_amax_kernels(avals_in: Sequence[Any], *, c_dtype: Any, sf_vec_size: int, a_major: str, b_major: str,
                      c_major: str, mma_tiler_mn: tuple, cluster_shape_mn: tuple, implementation: Any,
                      k: int | None = None, **_: Any) -> KernelChoice:
    """The kernel variants that compute this gemm_amax call exactly, one per covered architecture.

    FP4 operands and C arrive packed (uint8) and select the "float4_e2m1fn" variants; E4M3 scales (NVFP4) select
    the variants that take alpha (the lowering passes ones when the call has none)."""
    if implementation == "xla":
        return KernelChoice(reason="implementation='xla' forces the reference")
    forced = getattr(_FORCED, "variants", None)
    if forced is not None and implementation == "cutedsl":
        return KernelChoice(variants=tuple(v for v in forced if v.op == "gemm_amax"))
    # c_major="m": C^T (L, N, M) is the N-major result of the kernels run on (B, A); an M-major A is then the
    # kernel's N-major B and an N-major B its M-major A.
    swap_ab = c_major == "m"
    if swap_ab:
        avals_in = [avals_in[1], avals_in[0], avals_in[3], avals_in[2], *avals_in[4:]]
        a_major, b_major = ("m" if b_major == "n" else "k"), ("n" if a_major == "m" else "k")
    if too_large := _past_int32(avals_in, a_major, b_major):
        return KernelChoice(reason=too_large)
    try:
        from jax_blockgemm import _native
        from jax_blockgemm.kernels import catalog

        _native.extension()
    except ImportError as e:  # CuTeDSL or the native bridge missing: the reference still works
        return KernelChoice(reason=f"no kernel can run here: {e}")
    packed = np.dtype(avals_in[0].dtype) == np.uint8
    ab_dtype = "float4_e2m1fn" if packed else str(np.dtype(avals_in[0].dtype))
    sf_dtype = catalog.E8M0 if np.dtype(avals_in[2].dtype) == np.uint8 else str(np.dtype(avals_in[2].dtype))
    variants = []
    for target in sorted({v.arch for v in catalog.CATALOG}):
        config = dict(arch=target, ab_dtype=ab_dtype, c_dtype=str(np.dtype(c_dtype)), sf_vec_size=sf_vec_size,
                      sf_dtype=sf_dtype, a_major=a_major, b_major=b_major)
        variant = catalog.select_variant(**config, tile_mn=tuple(mma_tiler_mn), cluster_mn=tuple(cluster_shape_mn))
        if variant is None:  # the tile is a performance hint: fall back to the arch's default tile
            variant = catalog.select_variant(**config, tile_mn=(128, 128), cluster_mn=(1, 1))
        if variant is not None:
            variants.append(variant)
    if not variants:
        majors = "" if (a_major, b_major) == ("k", "k") else f" (kernel a_major={a_major!r}, b_major={b_major!r})"
        return KernelChoice(reason=f"no kernel in the catalog for {ab_dtype} operands, "
                                   f"{np.dtype(c_dtype)} C, {sf_dtype} scales per {sf_vec_size}{majors}")
    a_shape, b_shape = avals_in[0].shape, avals_in[1].shape
    l, m, k_row = a_shape[0], a_shape[2 if a_major == "m" else 1], a_shape[1 if a_major == "m" else 2]
    n = b_shape[2 if b_major == "n" else 1]
    k = k if k is not None else k_row * (2 if packed else 1)  # the logical K (packed FP4: two codes per byte)
    fmt = format_key(ab_dtype, sf_dtype, sf_vec_size)
    choice = _usable(variants, implementation, sizes=(m, n, k, l), names="(N, M, K, L)" if swap_ab else "(M, N, K, L)",
                     fmt=fmt)
    return dataclasses.replace(choice, swap_ab=swap_ab) if choice.variants else choice


def proj_rope_kernels(avals_in: Sequence[Any], *, w_out_in: bool, implementation: Any, mxfp8: bool = False,
                      **_: Any) -> KernelChoice:
    """The proj_rope kernel variants (one per covered architecture) for this call, or why there are none.

    The kernels take bf16 x and w; MXFP8 inputs reach them dequantized (exact in bf16; see primitives.py).
    """
    if implementation == "xla":
        return KernelChoice(reason="implementation='xla' forces the reference")
    forced = getattr(_FORCED, "variants", None)
    if forced is not None and implementation == "cutedsl":
        return KernelChoice(variants=tuple(v for v in forced if v.op == "proj_rope"))
    g, t, k = avals_in[0].shape
    if g != 1:
        return KernelChoice(reason=f"the kernel takes one weight matrix per call; got {g} (vmap over w)")
    if formats.get_scale_rule() != "ceil":
        return KernelChoice(reason=f"the kernel quantizes with the 'ceil' scale rule; the process uses "
                                   f"{formats.get_scale_rule()!r}")
    try:
        from jax_blockgemm import _native
        from jax_blockgemm.kernels import catalog

        _native.extension()
    except ImportError as e:  # CuTeDSL or the native bridge missing: the reference still works
        return KernelChoice(reason=f"no kernel can run here: {e}")
    b_major = "k" if w_out_in else "n"
    variants = [v for target in sorted({v.arch for v in catalog.CATALOG})
                if (v := catalog.select_variant(op="proj_rope", arch=target, ab_dtype="bfloat16",
                                                c_dtype="float8_e4m3fn", sf_vec_size=32,
                                                tile_mn=arch.policy(target).proj_rope_tile, cluster_mn=(1, 1),
                                                schedule=arch.policy(target).proj_rope_schedule,
                                                b_major=b_major)) is not None]
    if not variants:
        return KernelChoice(reason="no proj_rope kernel in the catalog")
    h = avals_in[1].shape[1 if w_out_in else 2] // 192
    return _usable(variants, implementation, sizes=(t, k, h), names="(T, K, H)", fmt="mxfp8" if mxfp8 else "bf16")


def weight_only_kernels(avals_in: Sequence[Any], *, fmt: str, out_dtype: Any, implementation: Any,
                        **_: Any) -> KernelChoice:
    """The kernel for a weight_only_matmul call (x (L, M, K) times `fmt` weights): none exists yet, so every device
    runs the reference. A decode kernel, when one is added, is chosen here."""
    if implementation == "xla":
        return KernelChoice(reason="implementation='xla' forces the reference")
    return KernelChoice(reason=f"no decode kernel yet: weight-only {fmt} matmuls run the reference on every device")


def ragged_kernels(avals_in: Sequence[Any], *, implementation: Any, **_: Any) -> KernelChoice:
    """The kernel for a ragged_gemm_amax call (tokens sorted by group times per-group weights): none exists yet, so
    every device runs the reference. A grouped kernel, when one is added, is chosen here."""
    if implementation == "xla":
        return KernelChoice(reason="implementation='xla' forces the reference")
    return KernelChoice(reason="no ragged kernel yet: ragged_gemm_amax runs the reference on every device")


def dequantize_variants(archs: Sequence[str], shape: Sequence[int], *, scale_axis: int,
                        paired_shape: Sequence[int] | None = None) -> tuple:
    """The dequantize kernels (one per arch in `archs`) for MXFP8 codes of `shape` with scales per 32 along
    `scale_axis` (-1 or -2), and with `paired_shape` a second operand (scales along its last axis) in the same
    launch; or () when an arch has none or the kernel cannot take a shape (the caller then lets XLA dequantize).
    Used on the MXFP8 proj_rope path, whose kernels multiply bf16."""
    try:
        from jax_blockgemm.kernels import catalog
        from jax_blockgemm.kernels.dequantize import MxDequantize
    except ImportError:
        return ()
    operands = [(shape, 1 if scale_axis == -1 else 0)] + ([(paired_shape, 1)] if paired_shape is not None else [])
    if not all(MxDequantize.can_implement(math.prod(s[:-1]), s[-1], axis)[0] for s, axis in operands):
        return ()
    variants = tuple(catalog.select_variant(op="dequantize", arch=target, ab_dtype="float8_e4m3fn",
                                            c_dtype="bfloat16", sf_vec_size=32, tile_mn=catalog.DEQUANTIZE_TILE,
                                            cluster_mn=(1, 1), a_major="k" if scale_axis == -1 else "m")
                     for target in sorted(archs))
    if None in variants or _failed_self_checks(variants):
        return ()  # XLA dequantizes instead
    return variants


def format_key(ab_dtype: str, sf_dtype: str, sf_vec_size: int) -> str:
    """The operand format of a gemm_amax call as the tuning tables name it: "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4",
    "nvfp4" (E2M1 with E4M3 scales), or "e2m1_e8m0_16" for E2M1 with E8M0 scales per 16."""
    if ab_dtype == "float4_e2m1fn":
        if sf_dtype == "float8_e4m3fn":
            return "nvfp4"
        return "mxfp4" if sf_vec_size == 32 else f"e2m1_e8m0_{sf_vec_size}"
    return {"float8_e4m3fn": "mxfp8_e4m3", "float8_e5m2": "mxfp8_e5m2"}.get(ab_dtype, ab_dtype)


@functools.lru_cache(maxsize=None)
def local_gpu_model() -> str | None:
    """The model name (jax.Device.device_kind) of the visible CUDA GPUs when they are all one model, else None."""
    try:
        kinds = {str(d.device_kind) for d in jax.devices("cuda")}
    except RuntimeError:
        return None
    return kinds.pop() if len(kinds) == 1 else None


def _none_takes(v: Any, fmt: str, size: int, local_targets: set) -> bool:
    """Whether implementation=None takes variant `v`: the local GPU model's measured decision (`tuning`) where one
    exists for its target, else `arch.TABLE`."""
    if v.arch in local_targets:
        measured = tuning.takes_kernel(local_gpu_model(), v.op, fmt, size)
        if measured is not None:
            return measured
    return arch.none_takes_kernel(v.op, v.arch)


def _usable(variants: list, implementation: Any, *, sizes: tuple, names: str, fmt: str) -> KernelChoice:
    """The variants that take these sizes, that None may use, that cover every local GPU and passed the first-use
    self-check where they never ran before; else why there are none."""
    from jax_blockgemm.kernels import catalog

    buildable, unbuildable = [], []
    for v in variants:
        try:
            kernel = catalog.make_kernel(v)
        except ImportError as e:  # one arch's module needs a DSL piece this install lacks: the others still serve
            unbuildable.append(f"{v.arch}: {e}")
            continue
        fits, why = kernel.can_implement(*sizes)
        if not fits:
            return KernelChoice(reason=f"the {v.arch} kernel cannot take {names} = {sizes}: {why}")
        buildable.append(v)
    variants = buildable
    if not variants:
        return KernelChoice(reason=f"no kernel can be built here: {'; '.join(unbuildable)}")
    capabilities = local_cuda_capabilities()
    if implementation is None:
        local_targets = {arch.target_of(cc) for cc in capabilities or ()}
        taken = [v for v in variants if _none_takes(v, fmt, math.prod(sizes), local_targets)]
        if not taken:
            slower = sorted(v.arch for v in variants)
            return KernelChoice(reason=f"implementation=None takes the reference over the {', '.join(slower)} "
                                       "kernel (arch.TABLE or this GPU's tuning table; 'cutedsl' forces it)")
        variants = taken
    if capabilities is not None:
        targets = {v.arch for v in variants}
        missing = [cc for cc in capabilities if arch.target_of(cc) not in targets]
        if missing:
            return KernelChoice(reason=f"no kernel for compute capability {', '.join(missing)} "
                                       f"(kernels exist for {', '.join(sorted(targets))})")
        failed = _failed_self_checks(variants)
        if failed:
            return KernelChoice(reason=f"the first-use self-check failed: {failed}")
    return KernelChoice(variants=tuple(variants))


def _failed_self_checks(variants: Sequence[Any]) -> str:
    """'' when every variant a local GPU would run has run correct on its architecture or passed its first-use
    self-check there (`gate.verdict`, which checks it in a child process the first time); else why not."""
    capabilities = local_cuda_capabilities() or ()
    local_targets = {arch.target_of(cc) for cc in capabilities}
    failures = []
    for v in variants:
        if v.arch in local_targets and not arch.is_verified(v.arch):
            from jax_blockgemm import gate  # lazy: it reads and writes the verdict store on disk

            verdict = gate.ensure_verified(v)
            if not verdict.ok:
                failures.append(f"{v.key} on {verdict.device}: {verdict.detail}")
    return "; ".join(failures)
