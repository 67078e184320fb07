"""Which CuTeDSL kernels serve a primitive call: by architecture, dtypes, layouts and the local GPU.

The CUDA lowering embeds one object per architecture that has a matching kernel, so a program lowered (or
exported) anywhere runs on any GPU the catalog covers; the FFI handler picks by compute capability at run time.
What `implementation=None` takes per architecture is `arch.TABLE`'s; where the local GPU has no kernel it takes the
reference. A kernel of an architecture (or schedule) where ours never ran (`arch.is_verified`) is used on a local
GPU only once its first-use self-check has passed there (`gate`: checked in a child process, verdicts kept on
disk); when it failed, None falls back to the reference and "cutedsl" raises (the ragged kernels: to the
block-scaled grouped kernel where the swap_ab one failed; decode-sized calls: to the decode kernel where a swap_ab
decode tile failed).

Decode-sized calls (few rows of activations against a block-scaled weight) have their own kernel, op
"weight_stream": weight_only_matmul with bf16 x, and gemm_amax with M <= 64 (its A dequantized to bf16 first), take
it before any other; `arch.TABLE`'s `decode_max_m` says up to which M None does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
import threading
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_blockgemm import arch, formats, support, tuning

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
    are of their operation (gemm_amax, proj_rope; weight_stream for decode-sized gemm_amax and weight-only calls).

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


def mx_ragged_operands() -> str:
    """What mx_ragged_dot's MX recipes hand their ragged GEMMs on the local GPUs: "bf16" values or "codes"
    (`arch.mx_ragged_operands`)."""
    return arch.mx_ragged_operands(local_cuda_capabilities() or ())


def _past_int32(avals_in: Sequence[Any], a_major: str = "k", b_major: str = "k") -> str:
    """Why a canonical call (a (L, M, K) or (L, K, M), b likewise) is too large for int32 indexing, or ""."""
    l, m = avals_in[0].shape[0], avals_in[0].shape[2 if a_major == "m" else 1]
    n = avals_in[1].shape[2 if b_major == "n" else 1]
    named = [(name, tuple(x.shape)) for name, x in zip(("a", "b", "sfa", "sfb"), avals_in)] + [("c", (l, m, n))]
    return _first_past_int32(named)


def _settled_by_implementation(implementation: Any, op: str) -> KernelChoice | None:
    """The choice `implementation` makes alone for an `op` call: "xla" forces the reference, "cutedsl" inside
    `forced_variants` takes those of `op`; None when dispatch must look at the call."""
    if implementation == "xla":
        return KernelChoice(reason="implementation='xla' forces the reference")
    forced = getattr(_FORCED, "variants", None)
    if forced is not None and implementation == "cutedsl":
        return KernelChoice(variants=tuple(v for v in forced if v.op == op))
    return None


def _first_past_int32(named_shapes: Sequence[tuple[str, tuple]]) -> str:
    """Why the first of the (name, shape) buffers with 2**31 elements or more cannot reach a kernel, or ""."""
    for name, shape in named_shapes:
        if math.prod(shape) >= MAX_KERNEL_ELEMENTS:
            return (f"{name} {tuple(shape)} holds {math.prod(shape)} elements, past the kernels' 32-bit indexing "
                    f"(fewer than 2**31 = {MAX_KERNEL_ELEMENTS}); implementation=None or 'xla' takes the reference")
    return ""


def _kernels_missing() -> str:
    """Why no kernel can run in this process (CuTeDSL or the native bridge missing), or "" when they can; the
    reference serves every call either way."""
    try:
        from jax_blockgemm import _native

        importlib.import_module("jax_blockgemm.kernels.catalog")  # CuTeDSL itself
        _native.extension()
    except ImportError as e:
        return f"no kernel can run here: {e}"
    return ""


def _quantizing_kernels_unavailable() -> str:
    """Why no kernel that quantizes (proj_rope, quantize_pair: the "ceil" scale rule only) can serve a call here, or
    ""."""
    if formats.get_scale_rule() != "ceil":
        return f"the kernel quantizes with the 'ceil' scale rule; the process uses {formats.get_scale_rule()!r}"
    return _kernels_missing()


def gemm_amax_kernels(avals_in: Sequence[Any], *, c_dtype: Any, sf_vec_size: int, a_major: str, b_major: str,
                      c_major: str, mma_tiler_mn: tuple, cluster_shape_mn: tuple, implementation: Any,
                      k: int | None = None, **_: Any) -> KernelChoice:
    """The kernel variants that compute this gemm_amax call exactly, one per covered architecture.

    FP4 operands and C arrive packed (uint8) and select the "float4_e2m1fn" variants; E4M3 scales (NVFP4) select
    the variants that take alpha (the lowering passes ones when the call has none)."""
    settled = _settled_by_implementation(implementation, "gemm_amax")
    if settled is not None:
        return settled
    # c_major="m": C^T (L, N, M) is the N-major result of the kernels run on (B, A); an M-major A is then the
    # kernel's N-major B and an N-major B its M-major A.
    swap_ab = c_major == "m"
    if swap_ab:
        avals_in = [avals_in[1], avals_in[0], avals_in[3], avals_in[2], *avals_in[4:]]
        a_major, b_major = ("m" if b_major == "n" else "k"), ("n" if a_major == "m" else "k")
    if too_large := _past_int32(avals_in, a_major, b_major):
        return KernelChoice(reason=too_large)
    missing = _kernels_missing()
    if missing:
        return KernelChoice(reason=missing)
    from jax_blockgemm.kernels import catalog
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
    settled = _settled_by_implementation(implementation, "proj_rope")
    if settled is not None:
        return settled
    g, t, k = avals_in[0].shape
    if g != 1:
        return KernelChoice(reason=f"the kernel takes one weight matrix per call; got {g} (vmap over w)")
    unavailable = _quantizing_kernels_unavailable()
    if unavailable:
        return KernelChoice(reason=unavailable)
    from jax_blockgemm.kernels import catalog
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


_E8M0 = "float8_e8m0fnu"
_DECODE_C_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))


def _decode_variants(*, ab_dtype: str, c_dtype: str, sf_dtype: str, sf_vec_size: int, m: int) -> list:
    """Per architecture, the decode variant for these dtypes with the smallest capacity (tile_mn[1]) that holds m
    rows; an architecture without one is left out."""
    from jax_blockgemm.kernels import catalog

    variants = []
    for target in sorted({v.arch for v in catalog.CATALOG}):
        for tile in sorted(catalog.WEIGHT_STREAM_TILES, key=lambda t: t[1]):
            if tile[1] < m:
                continue
            variant = catalog.select_variant(op="weight_stream", arch=target, ab_dtype=ab_dtype, c_dtype=c_dtype,
                                             sf_vec_size=sf_vec_size, sf_dtype=sf_dtype, tile_mn=tile,
                                             cluster_mn=(1, 1))
            if variant is not None:
                variants.append(variant)
                break
    return variants


def _decode_choice(implementation: Any, *, fmt: str, ab_dtype: str, sf_dtype: str, sf_vec_size: int, c_dtype: Any,
                   sizes: tuple[int, int, int, int], shapes: Sequence[tuple[str, tuple]]) -> KernelChoice:
    """The decode kernels for a call of `sizes` (M, N, K, L) whose buffers have `shapes` ((name, shape), ...), or why
    there are none: the last steps weight_only_kernels and decode_kernels share."""
    too_large = _first_past_int32(shapes)
    if too_large:
        return KernelChoice(reason=too_large)
    missing = _kernels_missing()
    if missing:
        return KernelChoice(reason=missing)
    from jax_blockgemm.kernels import catalog
    m = sizes[0]
    forced = getattr(_FORCED, "variants", None)
    if forced is None or implementation != "cutedsl":  # forced variants (the self-check's) are weight_stream ones
        swapped = _decode_swap_ab_choice(fmt=fmt, ab_dtype=ab_dtype, sf_dtype=sf_dtype, sf_vec_size=sf_vec_size,
                                         c_dtype=c_dtype, sizes=sizes)
        if swapped is not None:
            return swapped
    capacity = max(tile[1] for tile in catalog.WEIGHT_STREAM_TILES)
    if m > capacity:
        return KernelChoice(reason=f"M = {m} rows is more than the decode kernel takes ({capacity})")
    if forced is not None and implementation == "cutedsl":
        return KernelChoice(variants=tuple(v for v in forced if v.op == "weight_stream"))
    c_name = str(np.dtype(c_dtype))
    variants = _decode_variants(ab_dtype=ab_dtype, c_dtype=c_name, sf_dtype=sf_dtype, sf_vec_size=sf_vec_size, m=m)
    if not variants:
        return KernelChoice(reason=f"no decode kernel in the catalog for {fmt} weights into {c_name}")
    return _usable(variants, implementation, sizes=sizes, names="(M, N, K, L)", fmt=fmt)


def _decode_swap_ab_choice(*, fmt: str, ab_dtype: str, sf_dtype: str, sf_vec_size: int, c_dtype: Any,
                           sizes: tuple[int, int, int, int]) -> KernelChoice | None:
    """For a decode-sized call of `sizes` (M, N, K, L) that `arch.TABLE`'s decode_swap_ab_m (or the local GPU
    model's tuning table, `tuning.decode_swap_ab_rows`; not decode_swap_ab_small's calls) gives to the swap_ab ragged
    kernel's decode tiles on every local GPU (`fmt` weights of codes ab_dtype with sf_dtype scales per sf_vec_size,
    f32 or bf16 C): the variants of the smallest tile that holds M, run as one group of M tokens
    (`ffi_lowering.emit_decode_swap_ab`); None where the call keeps the decode kernel. The M range is
    implementation=None's choice and "cutedsl"'s alike: there the tile is the faster kernel."""
    from jax_blockgemm.kernels import catalog

    m, n, k, l = sizes
    local_targets = {arch.target_of(cc) for cc in local_cuda_capabilities() or ()}
    rows = tuning.decode_swap_ab_rows(local_gpu_model(), fmt) if local_targets else None
    if not local_targets or not all(arch.decode_takes_swap_ab(t, fmt, m, n=n, k=k, measured_rows=rows)
                                    for t in local_targets):
        return None
    tile = catalog.swap_ab_decode_tile(m)
    if tile is None:
        return None
    variants = [catalog.select_variant(op="ragged", arch=t, ab_dtype=ab_dtype, c_dtype=str(np.dtype(c_dtype)),
                                       sf_vec_size=sf_vec_size, sf_dtype=sf_dtype, tile_mn=tile[0], k_split=tile[1],
                                       cluster_mn=(1, 1), schedule=catalog.SWAP_AB) for t in sorted(local_targets)]
    if any(v is None for v in variants):  # e.g. a float16 C, which the tile does not write
        return None
    choice = _usable(variants, "cutedsl", sizes=(m, n, k, l, 1), names="(T, N, K, L, G)", fmt=fmt)
    return choice if choice.variants else None


def weight_only_kernels(avals_in: Sequence[Any], *, fmt: str, out_dtype: Any, implementation: Any,
                        **_: Any) -> KernelChoice:
    """The decode kernels (one per covered architecture) for a weight_only_matmul call: x (L, M, K) bf16 times `fmt`
    weights (codes (L, N, K) or packed FP4 (L, N, K/2), compact scales); or why there are none. The kernel takes
    bf16 activations only: float32 x keeps the reference, whose dot runs in float32."""
    if implementation == "xla":
        return KernelChoice(reason="implementation='xla' forces the reference")
    x, codes, scales = avals_in[:3]
    if np.dtype(x.dtype) != np.dtype(jnp.bfloat16):
        return KernelChoice(reason=f"x is {np.dtype(x.dtype)}: the decode kernel takes bfloat16 activations, so "
                                   f"{np.dtype(x.dtype)} x runs the reference (its dot in x's dtype)")
    block_format = formats.FORMATS[fmt]
    l, m, k = x.shape
    n = codes.shape[1]
    return _decode_choice(implementation, fmt=fmt, ab_dtype=str(block_format.code_dtype),
                          sf_dtype=_E8M0 if block_format.scale_kind == "e8m0" else "float8_e4m3fn",
                          sf_vec_size=block_format.block, c_dtype=out_dtype, sizes=(m, n, k, l),
                          shapes=(("x", x.shape), ("w", codes.shape), ("sw", scales.shape), ("y", (l, m, n))))


def decode_c_dtype(c_dtype: Any) -> np.dtype:
    """The C dtype the decode kernel writes for a gemm_amax call of `c_dtype`: that dtype where the kernel writes it
    (float32, bfloat16, float16), else float32, which XLA then converts (FP8, packed FP4) as the reference does."""
    return np.dtype(c_dtype) if np.dtype(c_dtype) in _DECODE_C_DTYPES else np.dtype(np.float32)


def decode_kernels(avals_in: Sequence[Any], *, c_dtype: Any, sf_vec_size: int, a_major: str, b_major: str,
                   c_major: str, implementation: Any, k: int | None = None, **_: Any) -> KernelChoice:
    """The decode kernels (one per covered architecture) for a gemm_amax call, which the CUDA lowering tries before
    the large-GEMM kernels: M at most the decode kernel's capacity (64) and a K-major B, the weight the kernel
    streams (B (L, N, K) with its atom scales, sf_atom = 1). A of either major is dequantized to bf16 (exact) before
    the kernel; the kernel writes C (L, M, N) in `decode_c_dtype(c_dtype)`, which XLA converts to FP8 or packed FP4
    and transposes for an M-major C. Under implementation="cutedsl" such a call takes this kernel."""
    if implementation == "xla":
        return KernelChoice(reason="implementation='xla' forces the reference")
    if b_major != "k":
        return KernelChoice(reason=f"the decode kernel streams a K-major weight; got b_major={b_major!r}")
    a, b, sfa, sfb = avals_in[:4]
    packed = np.dtype(b.dtype) == np.uint8
    ab_dtype = "float4_e2m1fn" if packed else str(np.dtype(b.dtype))
    sf_dtype = _E8M0 if np.dtype(sfb.dtype) == np.uint8 else str(np.dtype(sfb.dtype))
    l, m, n = a.shape[0], a.shape[1 if a_major == "k" else 2], b.shape[1]
    k = k if k is not None else b.shape[2] * (2 if packed else 1)
    return _decode_choice(implementation, fmt=format_key(ab_dtype, sf_dtype, sf_vec_size), ab_dtype=ab_dtype,
                          sf_dtype=sf_dtype, sf_vec_size=sf_vec_size, c_dtype=decode_c_dtype(c_dtype),
                          sizes=(m, n, k, l),
                          shapes=(("x", (l, m, k)), ("b", b.shape), ("sfb", sfb.shape), ("c", (l, m, n))))


def ragged_kernels(avals_in: Sequence[Any], *, c_dtype: Any, sf_vec_size: int, k: int, implementation: Any,
                   b_major: str = "k", **_: Any) -> KernelChoice:
    """The grouped kernel variants (one per covered architecture) for a canonical ragged_gemm_amax call: a (L, T, K)
    codes (packed FP4: uint8) or bf16, b (L, G, N, K) (bf16 with b_major "n": (L, G, K, N)), compact scales sfa
    (L, T, KB) and sfb (L, G, N, KB) (KB = 0 for bf16); or, for the weight-only ragged matmul, tokens as values (bf16
    or float32, sfa (L, T, 0)) against codes b, which only the swap_ab kernel takes (bf16 tokens only)."""
    settled = _settled_by_implementation(implementation, "ragged")
    if settled is not None:
        return settled
    a, b, sfa = avals_in[:3]
    l, t = a.shape[:2]
    g = b.shape[1]
    n = b.shape[2] if b_major == "k" else b.shape[3]
    # One weight (N, K) and every other buffer within 32-bit element counts; b as a whole may be larger (TMA
    # addresses it by batch).
    too_large = _first_past_int32((("a", a.shape), ("one weight of b", (n, k)), ("sfb", avals_in[3].shape),
                                   ("c", (l, t, n))))
    if too_large:
        return KernelChoice(reason=too_large)
    missing = _kernels_missing()
    if missing:
        return KernelChoice(reason=missing)
    from jax_blockgemm.kernels import catalog

    values = support.tokens_are_values(a.dtype, sf_vec_size)  # the weight-only ragged matmul: b alone holds codes
    codes, scales = (b, avals_in[3]) if values else (a, sfa)
    ab_dtype = "float4_e2m1fn" if np.dtype(codes.dtype) == np.uint8 else str(np.dtype(codes.dtype))
    if sf_vec_size == 0:  # bf16 operands
        sf_dtype = catalog.NO_SCALES
    else:
        sf_dtype = catalog.E8M0 if np.dtype(scales.dtype) == np.uint8 else str(np.dtype(scales.dtype))
    def tile_of(target: str, schedule: str) -> tuple[tuple[int, int], int]:
        """(tile, K parts): the bf16 kernels take the table's tile; the swap_ab kernel, where all T tokens fit in one
        of its decode tiles (MoE decode: a few tokens over many experts), the smallest that holds them (less zero
        fill, and 64-row weight tiles: twice the CTAs); the others 128 x 128."""
        if sf_vec_size == 0:
            return arch.policy(target).ragged_bf16_tile, 1
        if schedule == catalog.SWAP_AB:
            return catalog.swap_ab_decode_tile(t) or ((128, 128), 1)
        return (128, 128), 1

    def catalog_variants(schedule: str) -> list:
        found = []
        for target in arch.targets():
            tile, split = tile_of(target, schedule)
            v = catalog.select_variant(op="ragged", arch=target, ab_dtype=ab_dtype, c_dtype=str(np.dtype(c_dtype)),
                                       sf_vec_size=sf_vec_size, sf_dtype=sf_dtype, tile_mn=tile, k_split=split,
                                       cluster_mn=(1, 1), b_major=b_major, schedule=schedule)
            if v is not None:
                found.append(v)
        return found

    fmt = format_key(ab_dtype, sf_dtype, sf_vec_size)
    # The kernels that convert only the weights (MXFP8 E4M3: the tokens dequantized by XLA) where every local GPU
    # has one, else the block-scaled ones (also with no GPU: a program lowered here may run on any target).
    swapped = catalog_variants(catalog.SWAP_AB)
    local_targets = {arch.target_of(cc) for cc in local_cuda_capabilities() or ()}
    tuned = tuning.takes_swap_ab(local_gpu_model(), fmt, t * n * k * l * g) if local_targets else None
    measured = bool(local_targets) and all(arch.ragged_takes_swap_ab(target, fmt, measured=tuned)
                                           for target in local_targets)
    if values:  # tokens as values have no block-scaled kernel: a tuned decision either way timed swap_ab here
        measured = measured or tuned is not None
    if values and np.dtype(a.dtype) != np.dtype(jnp.bfloat16):
        return KernelChoice(reason="float32 tokens keep the reference (the swap_ab kernel reads bf16 tokens)")
    if values and implementation is None and not measured:
        return KernelChoice(reason=f"implementation=None keeps the reference for bf16 tokens against {fmt} weights "
                                   f"until the swap_ab kernel is measured on this GPU (arch.TABLE's "
                                   f"ragged_swap_ab_formats, or `python -m jax_blockgemm.tune --op ragged_swap_ab`; "
                                   f"'cutedsl' runs it)")
    if local_targets and local_targets <= {v.arch for v in swapped} and (measured or values):
        choice = _usable(swapped, implementation, sizes=(t, n, k, l, g), names="(T, N, K, L, G)", fmt=fmt)
        if choice.variants or values:
            return choice
    if values:  # only the swap_ab kernel reads tokens as values
        return KernelChoice(reason=f"bf16 tokens against {fmt} weights run on the swap_ab kernel only, which needs "
                                   f"every local GPU to be an sm_90a one (local: {sorted(local_targets) or 'none'})")
    variants = catalog_variants("")
    if not variants:
        layout = "" if b_major == "k" else f", b_major {b_major!r}"
        return KernelChoice(reason=f"no ragged kernel in the catalog for {ab_dtype} operands, {np.dtype(c_dtype)} C, "
                                   f"{sf_dtype} scales per {sf_vec_size}{layout}")
    return _usable(variants, implementation, sizes=(t, n, k, l, g), names="(T, N, K, L, G)", fmt=fmt)


def contraction_kernels(avals_in: Sequence[Any], *, c_dtype: Any, implementation: Any, **_: Any) -> KernelChoice:
    """The grouped contraction kernel variants (one per covered architecture) for a canonical call: x (L, T, K) and
    y (L, T, N) bf16, starts and ends (L, G)."""
    settled = _settled_by_implementation(implementation, "contraction")
    if settled is not None:
        return settled
    x, y, starts = avals_in[:3]
    l, t, k = x.shape
    n, g = y.shape[2], starts.shape[1]
    too_large = _first_past_int32((("x", x.shape), ("y", y.shape), ("one (K, N) result", (k, n))))
    if too_large:
        return KernelChoice(reason=too_large)
    missing = _kernels_missing()
    if missing:
        return KernelChoice(reason=missing)
    from jax_blockgemm.kernels import catalog

    variants = [v for v in (catalog.select_variant(op="contraction", arch=target, ab_dtype="bfloat16",
                                                   c_dtype=str(np.dtype(c_dtype)), sf_vec_size=0,
                                                   sf_dtype=catalog.NO_SCALES, tile_mn=(128, 128), cluster_mn=(1, 1),
                                                   a_major="m", b_major="n")
                            for target in arch.targets()) if v is not None]
    if not variants:
        return KernelChoice(reason=f"no grouped contraction kernel in the catalog for {np.dtype(c_dtype)} C")
    return _usable(variants, implementation, sizes=(t, k, n, l, g), names="(T, K, N, L, G)", fmt="bfloat16")


def quantize_pair_kernels(avals_in: Sequence[Any], *, row_format: str, col_format: str, col_values: bool,
                          implementation: Any, **_: Any) -> KernelChoice:
    """The pair-quantization kernel variants (one per covered architecture) for a canonical call: w (B, R, C), or
    w (1, R, C) and a row map (1, R') (the GATHER schedules; GATHER_VALUES for col_values)."""
    settled = _settled_by_implementation(implementation, "quantize_pair")
    if settled is not None:
        return settled
    w, *row_map = avals_in
    if np.dtype(w.dtype) != np.dtype(jnp.bfloat16):
        return KernelChoice(reason=f"the kernel reads bfloat16 w; got {np.dtype(w.dtype)}")
    if col_values and not row_map:
        return KernelChoice(reason="the kernels write the column blocks' values only through a row map")
    # without a row map the kernels fold w to (B·R, C): a row block there would span two of the B matrices
    if not row_map and w.shape[1] % support.MX_BLOCK:
        return KernelChoice(reason=f"without a row map the kernels take R a multiple of {support.MX_BLOCK}; "
                                   f"got w {w.shape}")
    unavailable = _quantizing_kernels_unavailable()
    if unavailable:
        return KernelChoice(reason=unavailable)
    from jax_blockgemm.kernels import catalog

    schedule = (catalog.GATHER_VALUES if col_values else catalog.GATHER) if row_map else ""
    row_dtype, col_dtype = (str(np.dtype(formats.FORMATS[f].code_dtype)) for f in (row_format, col_format))
    variants = [v for v in (catalog.select_variant(op="quantize_pair", arch=target, ab_dtype=row_dtype,
                                                   c_dtype=col_dtype, sf_vec_size=32,
                                                   tile_mn=catalog.QUANTIZE_PAIR_TILE, cluster_mn=(1, 1),
                                                   schedule=schedule)
                            for target in arch.targets()) if v is not None]
    if not variants:
        return KernelChoice(reason=f"no quantize_pair kernel in the catalog for {row_format} row blocks and "
                                   f"{col_format} column blocks")
    b, r, c = w.shape
    if not row_map:
        return _usable(variants, implementation, sizes=(b * r, c), names="(rows, cols)", fmt=row_format)
    return _usable(variants, implementation, sizes=(row_map[0].shape[1], c, r), names="(rows, cols, src_rows)",
                   fmt=row_format)


def dequantize_variants(archs: Sequence[str], shape: Sequence[int], *, scale_axis: int,
                        paired_shape: Sequence[int] | None = None, swap_ab_order: bool = False) -> tuple:
    """The dequantize kernels (one per arch in `archs`) for MXFP8 codes of `shape` with scales per 32 along
    `scale_axis` (-1 or -2), and with `paired_shape` a second operand (scales along its last axis) in the same
    launch; or () when an arch has none, the kernel cannot take a shape or a self-check failed (the caller then lets
    XLA dequantize). Used on the MXFP8 proj_rope path, whose kernels multiply bf16, and with `swap_ab_order` for the
    swap_ab ragged kernel's tokens (scales along K, every 128 columns in its order: `swap_ab_layout.swap_ab_tokens`
    without the padding)."""
    try:
        from jax_blockgemm.kernels import catalog
        from jax_blockgemm.kernels.dequantize import MxDequantize
    except ImportError:
        return ()
    operands = [(shape, 1 if scale_axis == -1 else 0)] + ([(paired_shape, 1)] if paired_shape is not None else [])
    if not all(MxDequantize.can_implement(math.prod(s[:-1]), s[-1], axis, swap_ab_order)[0] for s, axis in operands):
        return ()
    variants = tuple(catalog.select_variant(op="dequantize", arch=target, ab_dtype="float8_e4m3fn",
                                            c_dtype="bfloat16", sf_vec_size=32, tile_mn=catalog.DEQUANTIZE_TILE,
                                            cluster_mn=(1, 1), a_major="k" if scale_axis == -1 else "m",
                                            schedule=catalog.SWAP_AB if swap_ab_order else "")
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


def _none_takes(v: Any, fmt: str, sizes: tuple, local_targets: set) -> bool:
    """Whether implementation=None takes variant `v` for a call of `sizes` (M or T first): the local GPU model's
    measured decision (`tuning`, for the problem size prod(sizes)) where one exists for its target, else
    `arch.TABLE`. The decode kernel (sizes (M, N, K, L)) by the weight format, M and K: up to the measured largest M
    where the table has one, else arch.TABLE's, and below the short-K rule's K at most its M either way."""
    local = v.arch in local_targets
    if v.op == arch.DECODE_OP:
        measured_max_m = tuning.decode_max_m(local_gpu_model(), fmt) if local else None
        return arch.none_takes_kernel(v.op, v.arch, fmt=fmt, m=sizes[0], k=sizes[2], measured_max_m=measured_max_m)
    if local:
        measured = tuning.takes_kernel(local_gpu_model(), v.op, fmt, math.prod(sizes))
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
        taken = [v for v in variants if _none_takes(v, fmt, sizes, local_targets)]
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
        if v.arch in local_targets and not arch.is_verified(v.arch, v.schedule):
            from jax_blockgemm import gate  # lazy: it reads and writes the verdict store on disk

            # each local GPU model that would run it (None: the gate's own choice, where no device is listed)
            for device in gate.local_models(v.arch) or [None]:
                verdict = gate.ensure_verified(v, device=device)
                if not verdict.ok:
                    failures.append(f"{v.key} on {verdict.device}: {verdict.detail}")
    return "; ".join(failures)
