"""The two operations as JAX primitives: abstract evaluation, lowering, batching and partitioning rules.

Operands reach these primitives canonical (see `api.py`): batched 3-D GEMM operands, scales in the physical
128x4 atom form (gemm_amax's also compact, (L, MN, KB): each device makes its own atoms where a kernel needs them),
FP4 as packed uint8. Each operation is two primitives: the one the API binds (`gemm_amax_p`,
`proj_rope_p`: batching, and a lowering through the partitioning rules of `sharding.py`, so that under jit with
sharded inputs every device runs the op on its own shard) and a local one (`*_local_p`: what one device runs).
The local one lowers to the pure-JAX reference (`reference.py`) on every platform; on CUDA it first asks
`dispatch.py` for CuTeDSL kernels and, where one applies, emits the XLA FFI custom call (`ffi_lowering.py`)
instead (a decode-sized gemm_amax, M <= 64, tries the decode kernel first). Rules are registered in one block at
the end of the module.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch as jax_dispatch
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

from jax_blockgemm import formats, reference, sharding
from jax_blockgemm.support import MX_BLOCK, HEAD_DIM, is_fp4

gemm_amax_p = jex_core.Primitive("jbg_gemm_amax")
gemm_amax_local_p = jex_core.Primitive("jbg_gemm_amax_local")
proj_rope_p = jex_core.Primitive("jbg_gemm_proj_rope_mxfp8")
proj_rope_local_p = jex_core.Primitive("jbg_gemm_proj_rope_mxfp8_local")

_NOT_MAPPED = None  # how a batching rule sees an operand that vmap does not map


# --------------------------------------------------------------------------------------------------------------
# gemm_amax: operands (a, b, sfa, sfb[, alpha]); a (L, M, K) or (L, K, M); each scale operand the atom
# (L, MN', K', 32, 4, 4) or compact (L, MN, KB) (made atoms per device where a kernel needs them); alpha (L,) float32
# when present.
# Params: k, sf_vec_size, c_dtype (np.dtype), a_major, b_major, c_major, mma_tiler_mn, cluster_shape_mn,
# implementation. Results: c (L, M, N) / (L, N, M) / packed FP4 (L, M, N//2), and amax (L,) float32: each batch's
# max |C|, its sign bit clear (NaN > inf > finite, as formats.magnitude_max orders them).
# --------------------------------------------------------------------------------------------------------------


def _gemm_dims(a_shape: Sequence[int], b_shape: Sequence[int], a_major: str, b_major: str) -> tuple[int, int, int]:
    l = a_shape[0]
    m = a_shape[1] if a_major == "k" else a_shape[2]
    n = b_shape[1] if b_major == "k" else b_shape[2]
    return l, m, n


def gemm_amax_out_shapes(a_shape, b_shape, *, c_dtype, a_major, b_major, c_major) -> tuple[tuple, tuple]:
    """Shapes of (c, amax) for canonical operands."""
    l, m, n = _gemm_dims(a_shape, b_shape, a_major, b_major)
    if is_fp4(c_dtype):
        c_shape = (l, m, n // 2)
    else:
        c_shape = (l, m, n) if c_major == "n" else (l, n, m)
    return c_shape, (l,)


def _gemm_c_storage_dtype(c_dtype: np.dtype) -> np.dtype:
    return np.dtype(jnp.uint8) if is_fp4(c_dtype) else np.dtype(c_dtype)


def _gemm_amax_abstract_eval(a, b, sfa, sfb, *maybe_alpha, c_dtype, a_major, b_major, c_major, **_):
    c_shape, amax_shape = gemm_amax_out_shapes(a.shape, b.shape, c_dtype=c_dtype, a_major=a_major,
                                               b_major=b_major, c_major=c_major)
    return (jax.core.ShapedArray(c_shape, _gemm_c_storage_dtype(c_dtype)),
            jax.core.ShapedArray(amax_shape, np.float32))


def _gemm_amax_reference(a, b, sfa, sfb, *maybe_alpha, k, sf_vec_size, c_dtype, a_major, b_major, c_major,
                         scaled_dot=False, **_):
    alpha = maybe_alpha[0] if maybe_alpha else None
    return reference.gemm_amax_reference(a, b, sfa, sfb, k=k, sf_vec_size=sf_vec_size, c_dtype=c_dtype,
                                         a_major=a_major, b_major=b_major, c_major=c_major, alpha=alpha,
                                         scaled_dot=scaled_dot)


def _lowering_platforms(ctx) -> tuple[str, ...]:
    """The platforms this lowering rule emits code for (a subset of the module's under multi-platform export)."""
    return tuple(getattr(ctx, "platforms", None) or ctx.module_context.platforms)


def no_kernel_off_cuda(ctx, op: str, implementation: Any) -> None:
    """SPEC §6: 'cutedsl' demands a kernel and there is none off CUDA, so say so rather than run the reference."""
    if implementation == "cutedsl":
        platforms = _lowering_platforms(ctx)
        raise ValueError(f"implementation='cutedsl': {op} has no CuTeDSL kernel on platform"
                         f"{'s' * (len(platforms) > 1)} {', '.join(platforms)} (kernels run on CUDA GPUs only); use "
                         "implementation=None or 'xla'.")


def no_kernel_applies(op: str, implementation: Any, reason: str) -> None:
    """'cutedsl' demands a kernel: where dispatch found none for this call on CUDA, raise at lowering, saying why."""
    if implementation == "cutedsl":
        raise ValueError(f"implementation='cutedsl': no CuTeDSL kernel applies to this {op} call: {reason}")


def kernel_or_reference(op: str, choose: str, kernel: Callable, reference: Callable) -> Callable:
    """The CUDA lowering of an op with one kernel choice: `kernel(ctx, *args, variants=..., **params)` where
    `dispatch.<choose>` names kernels for the call, else `reference` (which 'cutedsl' refuses, saying why)."""

    def lowering(ctx, *args, **params):
        from jax_blockgemm import dispatch  # lazy: keeps CuTeDSL out of CPU-only imports

        choice = getattr(dispatch, choose)(ctx.avals_in, **params)
        if choice.variants:
            return kernel(ctx, *args, variants=choice.variants, **params)
        no_kernel_applies(op, params["implementation"], f"{choice.reason}; use implementation=None or 'xla'.")
        return reference(ctx, *args, **params)

    return lowering


def _device_kinds(ctx) -> tuple[str, ...]:
    """The device kinds this lowering targets, as `arch.scaled_dot_min_size` takes them: each platform, CUDA
    as "cuda:<compute capability>" per visible GPU ("cuda" where JAX sees none, e.g. an export on a CPU host)."""
    kinds = []
    for platform in _lowering_platforms(ctx):
        capabilities = None
        if platform == "cuda":
            from jax_blockgemm import dispatch  # lazy, as in the CUDA lowering below

            capabilities = dispatch.local_cuda_capabilities()
        kinds += [f"cuda:{cc}" for cc in capabilities] if capabilities else [platform]
    return tuple(kinds)


def _scales_as_atoms(ctx, args: Sequence[Any]) -> tuple[Any, list]:
    """(ctx, args) with compact (L, MN, KB) sfa / sfb made the physical atom (one small XLA copy each), as the
    block-scaled kernels read them; under sharding this runs on each device's own rows."""
    avals, args = list(ctx.avals_in), list(args)
    for i in (2, 3):
        if avals[i].ndim == 3:
            atom = jax.core.ShapedArray(formats.atom_shape(*avals[i].shape), avals[i].dtype)
            (args[i],) = mlir.lower_fun(lambda s: [formats.to_scale_atom(s)], multiple_results=True)(
                ctx.replace(avals_in=[avals[i]], avals_out=[atom]), args[i])
            avals[i] = atom
    return ctx.replace(avals_in=avals), args


def _gemm_amax_reference_lowering(ctx, *args, **params):
    no_kernel_off_cuda(ctx, "gemm_amax", params["implementation"])
    a, b = ctx.avals_in[:2]
    l, m, n = _gemm_dims(a.shape, b.shape, params["a_major"], params["b_major"])
    # "xla" is the exact reference the GPU tests judge kernels by: only None may take scaled_dot's FP8 accumulator
    scaled_dot = params["implementation"] is None and reference.use_scaled_dot(
        _device_kinds(ctx), a.dtype, b.dtype, sf_vec_size=params["sf_vec_size"], l=l, m=m, n=n, k=params["k"])
    reference_fn = functools.partial(_gemm_amax_reference, **params, scaled_dot=scaled_dot)
    return mlir.lower_fun(reference_fn, multiple_results=True)(ctx, *args)


def _dequantized_a(a, sfa, *, m, k, sf_vec_size, a_major):
    """A codes, (L, M, K) or M-major (L, K, M) (packed FP4: (L, M, K/2)), times its scales (compact or atom) as
    bf16 (L, M, K): exact, as the reference's."""
    if a_major == "m":
        a = jnp.swapaxes(a, 1, 2)  # codes only move
    return [reference._dequantize_operand(a, sfa, mn=m, k=k, sf_vec_size=sf_vec_size, k_axis=2)]


def decode_c(c, *, c_dtype, c_major):
    """The decode kernel's C (L, M, N), in `dispatch.decode_c_dtype(c_dtype)`, as gemm_amax returns it: transposed
    for an M-major C, converted to FP8 or packed FP4 by `reference.convert_c` (from float32, as the reference
    converts its accumulator)."""
    if c_major == "m":
        c = jnp.swapaxes(c, 1, 2)
    return [c if c.dtype == np.dtype(c_dtype) else reference.convert_c(c, c_dtype)]


def _gemm_amax_decode_lowering(ctx, a, b, sfa, sfb, *maybe_alpha, variants, k, sf_vec_size, c_dtype, a_major,
                               c_major, **_):
    """gemm_amax through the decode kernel `variants`: A dequantized to bf16 (L, M, K) in XLA is its x, B (L, N, K)
    its streamed weight with its scales sfb in the form given (the kernels read either); alpha is the call's, else
    ones. C leaves the kernel (L, M, N) in the variants' C dtype and XLA finishes it (`decode_c`) where the call
    wants another dtype or major."""
    from jax_blockgemm import ffi_lowering

    a_aval, b_aval, sfa_aval, sfb_aval = ctx.avals_in[:4]
    c_aval, amax_aval = ctx.avals_out
    l, m, n = a_aval.shape[0], a_aval.shape[1 if a_major == "k" else 2], b_aval.shape[1]
    x_aval = jax.core.ShapedArray((l, m, k), np.dtype(jnp.bfloat16))
    dequantize = functools.partial(_dequantized_a, m=m, k=k, sf_vec_size=sf_vec_size, a_major=a_major)
    (x,) = mlir.lower_fun(dequantize, multiple_results=True)(
        ctx.replace(avals_in=[a_aval, sfa_aval], avals_out=[x_aval]), a, sfa)
    alpha_aval = jax.core.ShapedArray((l,), np.dtype(np.float32))
    alpha = maybe_alpha[0] if maybe_alpha else mlir.ir_constant(np.ones((l,), np.float32))
    kernel_c_aval = jax.core.ShapedArray((l, m, n), np.dtype(variants[0].c_dtype))
    c, amax = ffi_lowering.emit_decode(
        ctx.replace(avals_in=[x_aval, b_aval, sfb_aval, alpha_aval], avals_out=[kernel_c_aval, amax_aval]), x, b, sfb,
        alpha, variants=variants)
    if c_major == "n" and kernel_c_aval.dtype == c_aval.dtype:  # (L, N, M) can equal (L, M, N): M = N
        return [c, amax]
    finish = functools.partial(decode_c, c_dtype=c_dtype, c_major=c_major)
    (c,) = mlir.lower_fun(finish, multiple_results=True)(
        ctx.replace(avals_in=[kernel_c_aval], avals_out=[c_aval]), c)
    return [c, amax]


def _gemm_amax_cuda_lowering(ctx, *args, **params):
    """The GPU hook: a CuTeDSL kernel through the FFI bridge where one applies (the decode kernel first, which reads
    scales in either form; the others read atoms), else the reference."""
    from jax_blockgemm import dispatch  # lazy: keeps CuTeDSL out of CPU-only imports

    decode = dispatch.decode_kernels(ctx.avals_in, **params)
    if decode.variants:
        return _gemm_amax_decode_lowering(ctx, *args, variants=decode.variants, **params)
    choice = dispatch.gemm_amax_kernels(ctx.avals_in, **params)
    if choice.variants:
        from jax_blockgemm import ffi_lowering

        ctx, args = _scales_as_atoms(ctx, args)
        if choice.swap_ab:  # c_major="m": C^T = B·A^T, the kernel's N-major result on (b, a, sfb, sfa[, alpha])
            order = (1, 0, 3, 2, *range(4, len(args)))
            args = [args[i] for i in order]
            ctx = ctx.replace(avals_in=[ctx.avals_in[i] for i in order])
        return ffi_lowering.emit_gemm_amax(ctx, *args, variants=choice.variants, sf_vec_size=params["sf_vec_size"])
    no_kernel_applies("gemm_amax", params["implementation"], choice.reason)
    return _gemm_amax_reference_lowering(ctx, *args, **params)


def move_to_front(x, dim, size):
    """Puts the vmapped axis first (broadcasting an unbatched operand to `size`)."""
    if dim is _NOT_MAPPED:
        return jnp.broadcast_to(x, (size, *x.shape))
    return jnp.moveaxis(x, dim, 0)


def _fold_into_leading(args, dims, size):
    """Merges the vmapped axis into every operand's leading axis: (B, L, ...) -> (B*L, ...)."""
    fronted = [move_to_front(x, d, size) for x, d in zip(args, dims)]
    return [x.reshape(size * x.shape[1], *x.shape[2:]) for x in fronted]


def fold_into_l_batch_rule(p):
    """The batching rule of a primitive `p` whose operands and results (c, amax) all lead with L: vmap folds the
    mapped axis into L, (B, L, ...) -> (B*L, ...) (an unmapped operand is broadcast); each example keeps its own
    amax."""

    def rule(args, dims, **params):
        size = next(x.shape[d] for x, d in zip(args, dims) if d is not _NOT_MAPPED)
        c, amax = p.bind(*_fold_into_leading(args, dims, size), **params)
        return (c.reshape(size, -1, *c.shape[1:]), amax.reshape(size, -1)), (0, 0)

    return rule


# --------------------------------------------------------------------------------------------------------------
# gemm_proj_rope_mxfp8: operands (x, w, cos, sin[, x_scale, w_scale]) with a leading group axis G (vmap over the
# weights folds into G, vmap over tokens folds into T). Params: w_out_in, mxfp8, implementation.
# Results: out_fp8_row (G,T,H,192), out_scales_row (G,T,H,6), out_fp8_col (G,T,H,192), out_scales_col (G,T/32,H,192).
# --------------------------------------------------------------------------------------------------------------


def proj_rope_out_shapes(x_shape, w_shape, *, w_out_in) -> tuple[tuple, ...]:
    g, t, _ = x_shape
    n = w_shape[1] if w_out_in else w_shape[2]
    h = n // HEAD_DIM
    return ((g, t, h, HEAD_DIM), (g, t, h, HEAD_DIM // MX_BLOCK), (g, t, h, HEAD_DIM),
            (g, t // MX_BLOCK, h, HEAD_DIM))


def _proj_rope_abstract_eval(x, w, *_, w_out_in, **__):
    shapes = proj_rope_out_shapes(x.shape, w.shape, w_out_in=w_out_in)
    dtypes = (jnp.float8_e4m3fn, jnp.uint8, jnp.float8_e4m3fn, jnp.uint8)
    return tuple(jax.core.ShapedArray(s, d) for s, d in zip(shapes, dtypes))


def _proj_rope_reference(x, w, cos, sin, *scales, w_out_in, mxfp8, scaled_dot=False, **_):
    def one_group(x, w, cos, sin, *scales):
        x_scale, w_scale = scales if mxfp8 else (None, None)
        return reference.gemm_proj_rope_reference(x, w, cos, sin, x_scale=x_scale, w_scale=w_scale,
                                                  w_out_in=w_out_in, scaled_dot=scaled_dot)

    return jax.vmap(one_group)(x, w, cos, sin, *scales)


def _proj_rope_reference_lowering(ctx, *args, **params):
    no_kernel_off_cuda(ctx, "gemm_proj_rope_mxfp8", params["implementation"])
    x, w = ctx.avals_in[:2]
    g, t, k = x.shape
    n = w.shape[1] if params["w_out_in"] else w.shape[2]
    # MXFP8 inputs: only None may take scaled_dot's FP8 accumulator, where arch.TABLE sends the device kinds there
    scaled_dot = params["implementation"] is None and params["mxfp8"] and reference.use_scaled_dot(
        _device_kinds(ctx), x.dtype, w.dtype, sf_vec_size=MX_BLOCK, l=g, m=t, n=n, k=k)
    reference_fn = functools.partial(_proj_rope_reference, **params, scaled_dot=scaled_dot)
    return mlir.lower_fun(reference_fn, multiple_results=True)(ctx, *args)


def _proj_rope_via_bf16(x, w, cos, sin, x_scale, w_scale, *, w_out_in, implementation, **_):
    """MXFP8 inputs on the kernel path where no dequantize kernel applies: XLA dequantizes codes x E8M0 scales to
    bf16 (exact, SPEC §6; one fusion per operand, about 47 us for DeepSeek-V3's w on the H200), then the bf16
    kernel runs."""
    x = reference.dequantize_bf16(x, x_scale, block=MX_BLOCK, axis=2)
    w = reference.dequantize_bf16(w, w_scale, block=MX_BLOCK, axis=2 if w_out_in else 1)
    return proj_rope_local_p.bind(x, w, cos, sin, w_out_in=w_out_in, mxfp8=False, implementation=implementation)


def _proj_rope_mxfp8_lowering(ctx, x, w, cos, sin, x_scale, w_scale, *, variants, **params):
    """MXFP8 inputs on the kernel path: one dequantize launch (kernels/dequantize.py: the same bf16 values, exact,
    at ~3.6 TB/s against XLA's ~2.4) turns w and x into bf16, then the bf16 kernel `variants` runs; where the
    catalog has no dequantize kernel for each of their archs, XLA's fusion does it (`_proj_rope_via_bf16`)."""
    from jax_blockgemm import dispatch, ffi_lowering

    x_aval, w_aval, cos_aval, sin_aval, xs_aval, ws_aval = ctx.avals_in
    w_axis = -1 if params["w_out_in"] else -2
    kernels = dispatch.dequantize_variants({v.arch for v in variants}, w_aval.shape, scale_axis=w_axis,
                                           paired_shape=x_aval.shape)
    if not kernels:
        return mlir.lower_fun(functools.partial(_proj_rope_via_bf16, **params), multiple_results=True)(
            ctx, x, w, cos, sin, x_scale, w_scale)
    w16, x16 = ffi_lowering.emit_dequantize(ctx, [(w, w_scale), (x, x_scale)], avals=[(w_aval, ws_aval),
                                                                                    (x_aval, xs_aval)],
                                            variants=kernels, scale_axis=w_axis)
    bf16 = [a.update(dtype=np.dtype(jnp.bfloat16)) for a in (x_aval, w_aval)]
    return ffi_lowering.emit_proj_rope(ctx.replace(avals_in=[*bf16, cos_aval, sin_aval]), x16, w16, cos, sin,
                                       variants=variants, w_out_in=params["w_out_in"])


def _proj_rope_cuda_lowering(ctx, *args, **params):
    """The GPU hook: a CuTeDSL kernel through the FFI bridge where one applies, else the reference."""
    from jax_blockgemm import dispatch  # lazy: keeps CuTeDSL out of CPU-only imports

    choice = dispatch.proj_rope_kernels(ctx.avals_in, **params)
    if choice.variants and params["mxfp8"]:
        return _proj_rope_mxfp8_lowering(ctx, *args, variants=choice.variants, **params)
    if choice.variants:
        from jax_blockgemm import ffi_lowering

        return ffi_lowering.emit_proj_rope(ctx, *args, variants=choice.variants, w_out_in=params["w_out_in"])
    no_kernel_applies("gemm_proj_rope_mxfp8", params["implementation"], choice.reason)
    return _proj_rope_reference_lowering(ctx, *args, **params)


_TOKEN_OPERANDS = (0, 2, 3, 4)  # x, cos, sin, x_scale: token axis 1, right after G


def _proj_rope_batch(args, dims, **params):
    """Folds vmap into tokens when only token-side operands are mapped, else into the group axis G."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not _NOT_MAPPED)
    weights_mapped = any(dims[i] is not _NOT_MAPPED for i in (1, 5) if i < len(dims))
    if not weights_mapped:
        folded = list(args)
        for i in _TOKEN_OPERANDS:
            if i < len(args):
                x = move_to_front(args[i], dims[i], size)  # (B, G, T, ...)
                x = jnp.moveaxis(x, 0, 1)  # (G, B, T, ...)
                folded[i] = x.reshape(x.shape[0], size * x.shape[2], *x.shape[3:])
        outs = proj_rope_p.bind(*folded, **params)
        unfolded = [o.reshape(o.shape[0], size, o.shape[1] // size, *o.shape[2:]) for o in outs]
        return unfolded, (1, 1, 1, 1)
    outs = proj_rope_p.bind(*_fold_into_leading(args, dims, size), **params)
    return [o.reshape(size, -1, *o.shape[1:]) for o in outs], (0, 0, 0, 0)


# --------------------------------------------------------------------------------------------------------------
# Partitioning: the outer primitive lowers through sharding.py's custom_partitioning around the local one.
# --------------------------------------------------------------------------------------------------------------


def _partitioned_lowering(local_p, partitioned):
    """Lowers an outer primitive to its partitioned call; on one device that is the local primitive inline.

    jax.export cannot serialize custom_partitioning (its rules are Python callbacks), so an exported program
    carries the local primitive itself and XLA partitions it as it would any op (see sharding.py).
    """

    def lowering(ctx, *args, **params):
        if ctx.module_context.lowering_parameters.for_export:
            return mlir.lower_fun(functools.partial(local_p.bind, **params), multiple_results=True)(ctx, *args)
        frozen = sharding.freeze_params(params)
        return mlir.lower_fun(lambda *ops: partitioned(frozen, *ops), multiple_results=True)(ctx, *args)

    return lowering


# --------------------------------------------------------------------------------------------------------------
# Registration.
# --------------------------------------------------------------------------------------------------------------

def register(p, local_p, *, abstract_eval, reference_lowering, cuda_lowering, batch_rule, partitioned) -> None:
    """Registers an operation's pair of primitives: `local_p` (what one device runs: the reference, and on CUDA the
    kernel hook) and `p` (lowered through the partitioning rules `partitioned` of sharding.py, batched by
    `batch_rule`). Both return several results."""
    for q in (p, local_p):
        q.multiple_results = True
        q.def_impl(functools.partial(jax_dispatch.apply_primitive, q))
        q.def_abstract_eval(abstract_eval)
    mlir.register_lowering(local_p, reference_lowering)
    mlir.register_lowering(local_p, cuda_lowering, platform="cuda")
    mlir.register_lowering(p, _partitioned_lowering(local_p, partitioned(local_p.bind)))
    jax_dispatch.prim_requires_devices_during_lowering.add(p)  # its lowering needs the device assignment
    batching.primitive_batchers[p] = batch_rule


register(gemm_amax_p, gemm_amax_local_p, abstract_eval=_gemm_amax_abstract_eval,
         reference_lowering=_gemm_amax_reference_lowering, cuda_lowering=_gemm_amax_cuda_lowering,
         batch_rule=fold_into_l_batch_rule(gemm_amax_p), partitioned=sharding.GEMM_AMAX.partitioned)
register(proj_rope_p, proj_rope_local_p, abstract_eval=_proj_rope_abstract_eval,
         reference_lowering=_proj_rope_reference_lowering, cuda_lowering=_proj_rope_cuda_lowering,
         batch_rule=_proj_rope_batch, partitioned=sharding.PROJ_ROPE.partitioned)
