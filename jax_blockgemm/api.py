"""Public entry points: validate at trace time, normalize to the canonical form, bind the primitive."""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_blockgemm import formats, primitives, ragged, support, weight_only, weight_only_ragged

Implementation = Optional[Literal["cutedsl", "xla"]]


def _as_scale_bytes(s: jax.Array) -> jax.Array:
    """E8M0 scales travel as raw uint8 bytes (float8_e8m0fnu and int8 are bit-cast)."""
    if s.dtype in (jnp.float8_e8m0fnu, jnp.int8):
        return jax.lax.bitcast_convert_type(s, jnp.uint8)
    return s


def _canonical_scales(name: str, s: jax.Array, *, l: int, mn: int, kb: int, batched: bool) -> jax.Array:
    """Accepts the physical atom, the seed's 6-D view or the compact form; returns the atom (L, MN', K', 32, 4, 4)
    or the compact (L, MN, KB) form. Compact scales stay compact up to the primitive, which makes atoms of each
    shard's rows: a row split finer than a 128-row atom stays a plain row split (sharding.py)."""
    form = support.scale_form(name, s, l=l, mn=mn, kb=kb, batched=batched)
    if form == "seed":
        return formats.seed_view_to_atom(s)
    return s if s.ndim == (6 if form == "atom" else 3) else s[None]


def gemm_amax(a: jax.Array, b: jax.Array, sfa: jax.Array, sfb: jax.Array, *, alpha: Any = None,
              c_dtype: Any = jnp.float32, c_major: str = "n", a_major: str = "k", b_major: str = "k",
              acc_dtype: Any = jnp.float32, mma_tiler_mn: Sequence[int] = (128, 128),
              cluster_shape_mn: Sequence[int] = (1, 1), sf_vec_size: int = 32,
              implementation: Implementation = None) -> tuple[jax.Array, jax.Array]:
    """Block-scaled GEMM with fused amax: C = Â·B̂ᵀ (fp32 accumulation) and amax = max|C| before conversion.

    a: (M, K) or (L, M, K) codes; with a_major="m" the transpose array (K, M) / (L, K, M). float8_e4m3fn or
      float8_e5m2 (MXFP8), float4_e2m1fn or uint8 holding two E2M1 codes per byte, low nibble first (MXFP4 / NVFP4;
      K-major only). A float4_e2m1fn array is packed into the uint8 container first (one small XLA op).
    b: (N, K) or (L, N, K), likewise (b_major="n": the transpose array).
    sfa, sfb: per-block scales of a and b: E8M0 (float8_e8m0fnu, uint8 or int8 bytes) or, for NVFP4,
      float8_e4m3fn. Either the physical 128x4 atom ((L,) MN', K', 32, 4, 4) the kernels read, the seed's 6-D
      logical view (32, 4, MN', 4, K', L), or the compact ((L,) MN, ceil(K/sf_vec_size)) form: the decode kernels
      and the reference read it as it is, the other kernels get atoms from one small XLA copy on each device (so
      under sharding rows may split finer than an atom).
    alpha: optional float32 scalar (NVFP4's per-tensor scale); multiplies C and amax.
    c_dtype: float32, float16, bfloat16, float8_e4m3fn, float8_e5m2 (FP4 operands only), or float4_e2m1fn / uint8
      for packed FP4 C: a uint8 (.., M, N//2) container, low nibble first.
    c_major: "n" returns (.., M, N); "m" returns the transpose array (.., N, M).
    implementation: None picks the fastest correct one for the device, "cutedsl" demands a kernel, "xla" forces
      the pure-JAX reference.

    Returns (c, amax) with amax a float32 scalar (NaN if C holds a NaN). Under jax.vmap each example gets its own.
    Under jax.jit with inputs sharded on L, M or N each device computes its shard (README "On many GPUs").
    """
    support.check_implementation(implementation)
    l, m, n, k = support.check_gemm_operands(a, b, a_major=a_major, b_major=b_major)
    support.check_array("sfa", sfa)
    support.check_array("sfb", sfb)
    if sfa.dtype != sfb.dtype:
        raise TypeError(f"sfa and sfb must have the same dtype; got sfa: {support.dtype_name(sfa)}, "
                        f"sfb: {support.dtype_name(sfb)}.")
    support.check_gemm_config(ab_dtype=a.dtype, scale_dtype=sfa.dtype, c_dtype=c_dtype, c_major=c_major,
                              acc_dtype=acc_dtype, mma_tiler_mn=mma_tiler_mn, cluster_shape_mn=cluster_shape_mn,
                              sf_vec_size=sf_vec_size, k=k, has_alpha=alpha is not None)
    support.check_alignment(ab_dtype=a.dtype, c_dtype=c_dtype, m=m, n=n, k=k, a_major=a_major, b_major=b_major,
                            c_major=c_major)
    batched = a.ndim == 3
    kb = support.ceil_div(k, sf_vec_size)
    sfa = _canonical_scales("sfa", _as_scale_bytes(sfa), l=l, mn=m, kb=kb, batched=batched)
    sfb = _canonical_scales("sfb", _as_scale_bytes(sfb), l=l, mn=n, kb=kb, batched=batched)
    if a.dtype == jnp.float4_e2m1fn:
        a, b = formats.pack_fp4(a), formats.pack_fp4(b)
    if not batched:
        a, b = a[None], b[None]
    operands = [a, b, sfa, sfb]
    if alpha is not None:
        operands.append(jnp.broadcast_to(support.check_alpha(alpha), (l,)))
    c_dtype = np.dtype(jnp.float4_e2m1fn) if support.is_fp4(c_dtype) else np.dtype(c_dtype)
    c, amax = primitives.gemm_amax_p.bind(
        *operands, k=k, sf_vec_size=sf_vec_size, c_dtype=c_dtype, a_major=a_major, b_major=b_major,
        c_major=c_major, mma_tiler_mn=tuple(mma_tiler_mn), cluster_shape_mn=tuple(cluster_shape_mn),
        implementation=implementation)
    # amax (L,) holds each batch's max |C| with its sign bit clear: one batch's is the answer as it stands (no XLA op
    # after the kernel: a one-element reduction costs a launch of its own), several are reduced on their bits
    amax = amax[0] if l == 1 else formats.magnitude_max(amax, axis=None)
    return (c if batched else c[0]), amax


def gemm_proj_rope_mxfp8(x: jax.Array, w: jax.Array, cos: jax.Array, sin: jax.Array, *,
                         x_scale: Optional[jax.Array] = None, w_scale: Optional[jax.Array] = None,
                         w_out_in: bool = True, implementation: Implementation = None
                         ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """DeepSeek-V3 MLA Q up-projection: GEMM, per-head RoPE on features 128..191, MXFP8 rowwise + columnwise.

    x: (T, K) bfloat16, or float8_e4m3fn codes with x_scale (T, K/32) E8M0 bytes (uint8 or float8_e8m0fnu).
    w: (H*192, K) when w_out_in=True (Transformer Engine's [out, in]), (K, H*192) when False; same dtype as x, with
      w_scale laid out like w. cos, sin: (T, 64) bfloat16, row t for token t. T must be a multiple of 32.

    Returns (out_fp8_row (T, H, 192), out_scales_row (T, H, 6), out_fp8_col (T, H, 192),
    out_scales_col (T/32, H, 192)): E4M3 codes and E8M0 scale bytes (uint8), rowwise blocks of 32 features inside a
    head and columnwise blocks of 32 tokens. Accumulator, RoPE and quantization stay in fp32. Under jax.jit with
    tokens or heads sharded each device computes its shard (README "On many GPUs").
    """
    support.check_implementation(implementation)
    _, _, _, mxfp8 = support.check_proj_rope(x, w, cos, sin, x_scale, w_scale, w_out_in=w_out_in)
    operands = [x, w, cos, sin]
    if mxfp8:
        operands += [_as_scale_bytes(x_scale), _as_scale_bytes(w_scale)]
    outs = primitives.proj_rope_p.bind(*(o[None] for o in operands), w_out_in=bool(w_out_in), mxfp8=mxfp8,
                                       implementation=implementation)
    return tuple(o[0] for o in outs)


def ragged_gemm_amax(a: jax.Array, b: jax.Array, sfa: jax.Array, sfb: jax.Array, group_sizes: jax.Array, *,
                     alpha: Any = None, c_dtype: Any = jnp.float32, sf_vec_size: int = 32,
                     implementation: Implementation = None) -> tuple[jax.Array, jax.Array]:
    """Ragged block-scaled GEMM with fused amax (mixture of experts): C[t] = Â[t]·B̂[g]ᵀ for each row t of group g.

    a: (T, K) codes of the tokens, sorted by group; b: (G, N, K) codes, one (N, K) weight per group; both K-major,
      in the dtypes gemm_amax takes (MXFP8, MXFP4, NVFP4; FP4 as float4_e2m1fn or packed uint8).
    sfa: (T, ceil(K/sf_vec_size)) scales, or their 128x4 atom / seed view as gemm_amax takes them (L = 1); sfb:
      (G, N, ceil(K/sf_vec_size)), or the atom / seed view with L = G.
    group_sizes: (G,) integers, the row count of each group, in order from row 0; zeros allowed. Concrete sizes
      must be non-negative with sum <= T (ValueError otherwise). Traced sizes outside that get a defined meaning: a
      negative size counts as 0 and rows past T are cut off (`ragged.group_bounds`).
    alpha, c_dtype, sf_vec_size, implementation: as in gemm_amax (C is N-major).

    Returns (c (T, N), amax): rows of no group (past sum(group_sizes)) are zero; amax is a float32 scalar, max|C| on
    the float32 accumulator over the rows of the groups (NaN if one holds a NaN). On sm_90a None and "cutedsl" run
    the grouped kernel (one launch; kernels/sm90/ragged.py); elsewhere, and with "xla", the reference runs, which
    never materializes a per-group mask.
    jit, vmap and sharding (tokens, experts, N) work as for gemm_amax (README "Mixture of experts").
    """
    operands, params = ragged.check_call(a, b, sfa, sfb, group_sizes, alpha=alpha, c_dtype=c_dtype,
                                         sf_vec_size=sf_vec_size, implementation=implementation)
    c, amax = ragged.ragged_p.bind(*operands, **params)
    return c[0], amax[0]


def weight_only_matmul(x: jax.Array, w: weight_only.QuantizedWeight, *, out_dtype: Any = jnp.bfloat16,
                       implementation: Implementation = None) -> jax.Array:
    """Weight-only quantized matmul (SPEC §5b): y = x · Ŵᵀ, x used as given, Ŵ the MX-quantized weight.

    x: (..., K) bfloat16 or float32, not quantized. w: a QuantizedWeight of an (N, K) matrix (`quantize_weight`):
    MXFP8 E4M3 / E5M2, MXFP4 or NVFP4 (with its per-tensor alpha). Products are summed in fp32 and y (..., N) is
    returned in out_dtype (bfloat16 or float32). On CUDA, bf16 x with few rows (at most 64) runs the decode kernel
    where dispatch finds one ("cutedsl" forces it; None follows `arch.TABLE`); float32 x and everything else runs the
    reference (Ŵ dequantized to bf16, exact, then one dot in x's dtype with fp32 accumulation).

    jit, vmap (over x's leading axes, or over stacked weights) and sharding work as for the other operations (x
    sharded on rows or K, the weight on N or K: the weight is never gathered). Differentiable with respect to x
    (dx = dy · Ŵ); differentiating with respect to w raises, the quantized weight being a constant.
    """
    x = support.as_array("x", x, "weight_only_matmul")
    weight_only.check_call(x, w, out_dtype, implementation)
    return weight_only.matmul(x, w, np.dtype(out_dtype), implementation)


def weight_only_ragged_matmul(x: jax.Array, w: weight_only.QuantizedWeight, group_sizes: jax.Array, *,
                              out_dtype: Any = jnp.bfloat16, implementation: Implementation = None) -> jax.Array:
    """Weight-only ragged matmul (mixture of experts, serving): y[t] = x[t] · Ŵ[g]ᵀ for each row t of group g.

    x: (T, K) bfloat16 or float32 tokens sorted by group, used as given (not quantized). w: a QuantizedWeight of G
    stacked (N, K) expert weights, codes (G, N, K) (packed FP4: (G, N, K/2)) and scales (G, N, KB), e.g.
    `jax.vmap(jbg.quantize_weight)` of a (G, N, K) array; its alpha is a scalar or one per expert (NVFP4). group_sizes:
    (G,) integers as in ragged_gemm_amax (zeros allowed; rows past their sum are zero). Products summed in fp32, y
    (T, N) in out_dtype (bfloat16 or float32).

    On an H200 bf16 x runs the swap_ab grouped kernel (the weights' codes converted in registers, one launch): under
    "cutedsl" for every format, under None for those arch.TABLE's ragged_swap_ab_formats names; float32 x, other
    GPUs and the rest run the reference (each expert dequantized to bf16, exact, then a grouped dot in x's dtype).
    jit, vmap and sharding (tokens, experts, N) work as for ragged_gemm_amax.
    Differentiable with respect to x (dx = dy · Ŵ per group); the quantized weights are constants (asking for their
    gradient raises ValueError at trace time).
    """
    x = support.as_array("x", x, "weight_only_ragged_matmul")
    group_sizes = weight_only_ragged.check_call(x, w, group_sizes, out_dtype, implementation)
    return weight_only_ragged.matmul(x, w, group_sizes, np.dtype(out_dtype), implementation)


# CuTeDSL's names for the dtypes cuDNN frontend's entry points accept as c_dtype / acc_dtype.
_CUTLASS_DTYPE_NAMES = {"Float32": "float32", "Float16": "float16", "BFloat16": "bfloat16",
                        "Float8E4M3FN": "float8_e4m3fn", "Float8E5M2": "float8_e5m2",
                        "Float4E2M1FN": "float4_e2m1fn", "Uint8": "uint8"}


def _dtype_from_cutlass(name: str, dtype: Any) -> Any:
    """Maps a CuTeDSL dtype class (cutlass.Float32, ...) to the JAX dtype of that name; other dtypes pass through.

    Matched by class name and module, so this module never has to import CuTeDSL.
    """
    if not (isinstance(dtype, type) and dtype.__module__.split(".")[0] == "cutlass"):
        return dtype
    if dtype.__name__ not in _CUTLASS_DTYPE_NAMES:
        raise TypeError(f"{name}=cutlass.{dtype.__name__} is not supported; allowed: "
                        + ", ".join(f"cutlass.{n}" for n in _CUTLASS_DTYPE_NAMES) + ".")
    return np.dtype(getattr(jnp, _CUTLASS_DTYPE_NAMES[dtype.__name__]))


def gemm_amax_jax_sm100(a_tensor: jax.Array, b_tensor: jax.Array, sfa_tensor: jax.Array, sfb_tensor: jax.Array,
                        c_dtype: Any = jnp.float32, acc_dtype: Any = jnp.float32,
                        mma_tiler_mn: Sequence[int] = (128, 128), cluster_shape_mn: Sequence[int] = (1, 1),
                        sf_vec_size: int = 32, *, c_major: str = "n", implementation: Implementation = None
                        ) -> tuple[jax.Array, jax.Array]:
    """gemm_amax with cuDNN frontend's JAX signature, so its callers can switch by changing the import.

    a_tensor (M, K, L), b_tensor (N, K, L), K-major; sfa_tensor / sfb_tensor the physical scale atoms
    (L, MN', K', 32, 4, 4) or any other scale form gemm_amax takes. c_dtype / acc_dtype may be JAX, NumPy or
    CuTeDSL dtypes. Returns c (M, N, L) and amax (1, 1, 1) float32. Beyond cuDNN frontend: any L, c_major="m"
    (c as the transpose (N, M, L)), FP4 C as a (M, N/2, L) uint8 container, and `implementation`.
    """
    for name, x in (("a_tensor", a_tensor), ("b_tensor", b_tensor), ("sfa_tensor", sfa_tensor),
                    ("sfb_tensor", sfb_tensor)):
        support.check_array(name, x)
    for name, x in (("a_tensor", a_tensor), ("b_tensor", b_tensor)):
        if x.ndim != 3:
            raise ValueError(f"{name} must have shape (MN, K, L); got {tuple(x.shape)}.")
    a, b = jnp.moveaxis(a_tensor, 2, 0), jnp.moveaxis(b_tensor, 2, 0)
    # checked here too, so that the messages name a_tensor and b_tensor and show their (MN, K, L) shapes
    support.check_gemm_operands(a, b, a_major="k", b_major="k", names=("a_tensor", "b_tensor"),
                                shapes=(a_tensor.shape, b_tensor.shape))
    c, amax = gemm_amax(a, b, sfa_tensor, sfb_tensor,
                        c_dtype=_dtype_from_cutlass("c_dtype", c_dtype), c_major=c_major,
                        acc_dtype=_dtype_from_cutlass("acc_dtype", acc_dtype), mma_tiler_mn=mma_tiler_mn,
                        cluster_shape_mn=cluster_shape_mn, sf_vec_size=sf_vec_size, implementation=implementation)
    return jnp.moveaxis(c, 0, 2), amax.reshape(1, 1, 1)


def gemm_proj_rope_mxfp8_jax_sm100(x: jax.Array, w: jax.Array, cos: jax.Array, sin: jax.Array,
                                   x_scale: Optional[jax.Array] = None, w_scale: Optional[jax.Array] = None, *,
                                   w_out_in: bool = True, implementation: Implementation = None
                                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """gemm_proj_rope_mxfp8 with cuDNN frontend's JAX signature: the scales positional, w as (H*192, K) by default.

    bfloat16 x / w, or float8_e4m3fn codes with (T, K/32) and (H*192, K/32) E8M0 scales (uint8 or float8_e8m0fnu).
    Beyond cuDNN frontend: w_out_in=False for w as (K, H*192), and `implementation`.
    """
    return gemm_proj_rope_mxfp8(x, w, cos, sin, x_scale=x_scale, w_scale=w_scale, w_out_in=w_out_in,
                                implementation=implementation)
