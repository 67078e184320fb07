"""Differentiable block-scaled matmul: `mx_dot_general`, a drop-in for `jax.lax.dot_general` that trains in MX.

High-precision operands go in; each is block-quantized along its contraction axis (formats.quantize_mxfp8 /
quantize_nvfp4) and the product runs through the public `gemm_amax`, so a kernel serves it wherever one applies.
The custom VJP treats quantization as straight-through: the gradient of the dequantized product is taken as the
gradient of the exact one, and both backward GEMMs are themselves block-scaled GEMMs through `gemm_amax`:

  dgrad  dX = dY · W   contracts over N: dY and W are quantized along N (W is read N-major, b_major="n");
  wgrad  dW = dYᵀ · X  contracts over M: dY and X are quantized along M (both read M-major, a_major="m").

So every operand is quantized along ITS OWN contraction axis, and no transposed copy is made for MXFP8 (FP4
operands are K-major only: an M/N-major FP4 operand is transposed first). A `Recipe` names the format of each of
the three GEMMs; `gemm_amax` takes both operands of one GEMM in one dtype, so a "hybrid" recipe puts both backward
operands in E5M2.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_blockgemm import api, formats, support

__all__ = ["Recipe", "RECIPES", "as_recipe", "mx_dot_general", "mx_dot_general_amax", "block_gemm", "GEMM_FORMATS"]

# Formats one GEMM may use; "bf16" is the plain dot (bfloat16 operands, float32 accumulation).
GEMM_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4", "bf16")
# A quantized GEMM needs K to be a whole number of blocks (32 for MX, 16 for NVFP4) and K-major rows of 16 bytes
# (32 packed FP4 codes): 32 covers both for every format, so it is the one contraction multiple asked for.
K_MULTIPLE = 32
_C_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Which block format each of the three GEMMs of a matmul uses (forward, dgrad, wgrad), and where it runs.

    Each field is one of GEMM_FORMATS. A quantized GEMM falls back to "bf16" (bfloat16 operands, float32
    accumulation, plain `jax.lax.dot_general`) only where no format fits its shape: a contraction length that is
    not a multiple of 32 (e.g. wgrad over 37 tokens) or an empty dimension. Frozen, so it hashes as a static
    argument of jit and custom_vjp. `implementation` goes to every gemm_amax call: "cutedsl" demands a kernel for
    all three GEMMs, and the backward ones read MN-major operands, which today's Hopper kernel (K-major only) does
    not take, so keep None (the fastest correct implementation per GEMM) for training.
    """

    fwd: str = "mxfp8_e4m3"
    dgrad: str = "mxfp8_e4m3"
    wgrad: str = "mxfp8_e4m3"
    implementation: api.Implementation = None

    def __post_init__(self) -> None:
        for name in ("fwd", "dgrad", "wgrad"):
            support.check_choice(f"Recipe.{name}", getattr(self, name), GEMM_FORMATS)
        support.check_choice("Recipe.implementation", self.implementation, support.IMPLEMENTATIONS)


RECIPES = {
    "mxfp8": Recipe(),  # E4M3 everywhere, as jax.nn.get_scaled_dot_general_config("mxfp8")
    "mxfp8_hybrid": Recipe(dgrad="mxfp8_e5m2", wgrad="mxfp8_e5m2"),  # E5M2's range for gradients
    "nvfp4": Recipe(fwd="nvfp4"),  # NVFP4 forward, MXFP8 E4M3 gradients
    "bf16": Recipe("bf16", "bf16", "bf16"),
}


def as_recipe(recipe: Recipe | str) -> Recipe:
    """A Recipe, or the Recipe of a name in RECIPES (what the layers accept); raises naming the allowed values."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str) and recipe in RECIPES:
        return RECIPES[recipe]
    raise ValueError(f"recipe={recipe!r} is not supported; allowed: a jax_blockgemm.Recipe or one of "
                     f"{', '.join(map(repr, RECIPES))}.")


# ----------------------------------------------------------------------------------------------------------------
# One block-scaled GEMM on 3-D operands whose contraction axis is 1 or 2


def _pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    """Zero-pads `axis` up to a multiple (a no-op when it already is one)."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    return jnp.pad(x, [(0, extra if i == axis else 0) for i in range(x.ndim)])


def _quantize_operand(x: jax.Array, kaxis: int, fmt: str, mn_multiple: int
                      ) -> tuple[jax.Array, jax.Array, str, Optional[jax.Array]]:
    """Block-quantizes a (B, MN, K) (kaxis=2) or (B, K, MN) (kaxis=1) operand along K.

    Returns (codes, compact scales (B, MN, KB), major "k" or "mn", per-tensor scale or None); MN is zero-padded to
    `mn_multiple` (codes 0, scale byte 0), and an MN-major FP4 operand is transposed, FP4 being K-major only.
    """
    mn_axis = 3 - kaxis
    if fmt in ("nvfp4", "mxfp4") and kaxis == 1:
        x, kaxis, mn_axis = jnp.swapaxes(x, 1, 2), 2, 1
    tensor_scale = None
    if fmt == "nvfp4":
        encode, tensor_scale = formats.nvfp4_tensor_scales(x)
        codes, scales = formats.quantize_nvfp4(x.astype(jnp.float32) * encode, axis=kaxis)
    elif fmt == "mxfp4":
        codes, scales = formats.quantize_mxfp4(x, axis=kaxis)
    else:
        codes, scales = formats.quantize_mxfp8(x, axis=kaxis, dtype=formats.FORMATS[fmt].code_dtype)
    # packed FP4 holds two codes per byte along the last axis; MN is axis 1 there, so padding stays per element
    codes = _pad_axis(codes, mn_axis, mn_multiple)
    scales = _pad_axis(scales, mn_axis, mn_multiple)
    if kaxis == 1:
        scales = jnp.swapaxes(scales, 1, 2)  # compact (B, MN, KB): 1/32 of the operand, a small copy
    return codes, scales, ("k" if kaxis == 2 else "mn"), tensor_scale


def _plain_gemm(a: jax.Array, a_kaxis: int, b: jax.Array, b_kaxis: int, c_dtype: Any, c_transposed: bool
                ) -> tuple[jax.Array, jax.Array]:
    """The bf16 fallback: bfloat16 operands, float32 accumulation; (c, amax of the float32 accumulator)."""
    a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    if c_transposed:
        acc = jax.lax.dot_general(b, a, (((b_kaxis,), (a_kaxis,)), ((0,), (0,))), preferred_element_type=jnp.float32)
    else:
        acc = jax.lax.dot_general(a, b, (((a_kaxis,), (b_kaxis,)), ((0,), (0,))), preferred_element_type=jnp.float32)
    amax = formats.magnitude_max(acc, axis=None) if acc.size else jnp.zeros((), jnp.float32)  # empty: max of nothing
    return acc.astype(c_dtype), amax


def block_gemm(a: jax.Array, a_kaxis: int, b: jax.Array, b_kaxis: int, fmt: str, c_dtype: Any, *,
               c_transposed: bool = False, implementation: api.Implementation = None
               ) -> tuple[jax.Array, jax.Array]:
    """C[l] = A[l]·B[l]ᵀ contracted over each operand's `kaxis` (1 or 2 of a 3-D array), in block format `fmt`.

    a: (L, M, K) for a_kaxis=2 or (L, K, M) for 1; b likewise with N. Returns (c, amax): c (L, M, N), or (L, N, M)
    with c_transposed, in c_dtype; amax = max|C| on the float32 accumulator. fmt="bf16", or a K that is not a
    multiple of K_MULTIPLE, takes the plain bfloat16 dot. Alignment padding of M and N is added and sliced off here.
    """
    l, k = a.shape[0], a.shape[a_kaxis]
    m, n = a.shape[3 - a_kaxis], b.shape[3 - b_kaxis]
    c_dtype = np.dtype(c_dtype)
    if fmt == "bf16" or k % K_MULTIPLE or min(l, m, n, k) == 0:
        return _plain_gemm(a, a_kaxis, b, b_kaxis, c_dtype, c_transposed)
    gemm_c_dtype = c_dtype if c_dtype in _C_DTYPES else np.dtype(jnp.float32)
    c_rows = 16 // gemm_c_dtype.itemsize  # C's contiguous dimension in 16-byte rows
    mn_major_rows = 16  # an MN-major FP8 operand's contiguous dimension is MN: 16 one-byte codes
    a_mult = math.lcm(mn_major_rows if a_kaxis == 1 else 1, c_rows if c_transposed else 1)
    b_mult = math.lcm(mn_major_rows if b_kaxis == 1 else 1, 1 if c_transposed else c_rows)
    qa, sa, a_major, ta = _quantize_operand(a, a_kaxis, fmt, a_mult)
    qb, sb, b_major, tb = _quantize_operand(b, b_kaxis, fmt, b_mult)
    alpha = None if ta is None else (ta * tb).astype(jnp.float32)
    block = formats.FORMATS[fmt].block
    c, amax = api.gemm_amax(qa, qb, sa, sb, alpha=alpha, c_dtype=gemm_c_dtype, c_major="m" if c_transposed else "n",
                            a_major="k" if a_major == "k" else "m", b_major="k" if b_major == "k" else "n",
                            sf_vec_size=block, implementation=implementation)
    rows, cols = (n, m) if c_transposed else (m, n)
    return c[:, :rows, :cols].astype(c_dtype), amax


# ----------------------------------------------------------------------------------------------------------------
# The custom VJP on canonical 3-D operands


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _mx_matmul(x: jax.Array, w: jax.Array, grad_amax: jax.Array, x_kaxis: int, w_kaxis: int, out_dtype: np.dtype,
               recipe: Recipe) -> tuple[jax.Array, jax.Array]:
    """(B, M, N) product of x ((B, M, K) or (B, K, M)) and w ((B, N, K) or (B, K, N)), with the forward amax."""
    return block_gemm(x, x_kaxis, w, w_kaxis, recipe.fwd, out_dtype, implementation=recipe.implementation)


def _mx_matmul_fwd(x, w, grad_amax, x_kaxis, w_kaxis, out_dtype, recipe):
    out = _mx_matmul(x, w, grad_amax, x_kaxis, w_kaxis, out_dtype, recipe)
    return out, (x, w, grad_amax)


def _mx_matmul_bwd(x_kaxis, w_kaxis, out_dtype, recipe, residuals, cotangents):
    """Straight-through: dX = dY·W over N, dW = dYᵀ·X over M, each operand quantized along that axis."""
    x, w, grad_amax = residuals
    g = cotangents[0]  # the forward amax has no gradient: its cotangent is dropped
    dx, dgrad_amax = block_gemm(g, 2, w, 3 - w_kaxis, recipe.dgrad, x.dtype, c_transposed=x_kaxis == 1,
                                implementation=recipe.implementation)
    dw, wgrad_amax = block_gemm(g, 1, x, 3 - x_kaxis, recipe.wgrad, w.dtype, c_transposed=w_kaxis == 1,
                                implementation=recipe.implementation)
    return dx, dw, jnp.stack([dgrad_amax, wgrad_amax]).astype(grad_amax.dtype)


_mx_matmul.defvjp(_mx_matmul_fwd, _mx_matmul_bwd)


# ----------------------------------------------------------------------------------------------------------------
# dot_general's dimension numbers -> canonical 3-D operands


def _check_dims(name: str, dims: Any, ndim: int) -> tuple[int, ...]:
    try:
        given = tuple(dims)
    except TypeError:
        given = None
    if given is None or not all(support.is_int(d) for d in given):  # int(1.5) would truncate
        raise TypeError(f"dimension_numbers: {name} must be a sequence of ints; got {dims!r}.")
    dims = tuple(int(d) for d in given)
    if any(not 0 <= d < ndim for d in dims) or len(set(dims)) != len(dims):
        raise ValueError(f"dimension_numbers: {name}={dims} must be distinct dimensions in [0, {ndim}).")
    return dims


def _parse_dimension_numbers(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any):
    """Validates dot_general's ((lhs_contract, rhs_contract), (lhs_batch, rhs_batch)); returns the four tuples."""
    try:
        (lc, rc), (lb, rb) = dimension_numbers
    except (TypeError, ValueError):
        raise ValueError("dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)); "
                         f"got {dimension_numbers!r}.") from None
    lc, lb = _check_dims("lhs_contracting", lc, lhs.ndim), _check_dims("lhs_batch", lb, lhs.ndim)
    rc, rb = _check_dims("rhs_contracting", rc, rhs.ndim), _check_dims("rhs_batch", rb, rhs.ndim)
    for what, l_dims, r_dims in (("contracting", lc, rc), ("batch", lb, rb)):
        l_sizes = tuple(lhs.shape[d] for d in l_dims)
        r_sizes = tuple(rhs.shape[d] for d in r_dims)
        if l_sizes != r_sizes:
            raise ValueError(f"dimension_numbers: lhs {what} dims {l_dims} (sizes {l_sizes}) and rhs {what} dims "
                             f"{r_dims} (sizes {r_sizes}) must have equal sizes; lhs {tuple(lhs.shape)}, rhs "
                             f"{tuple(rhs.shape)}.")
    if set(lc) & set(lb) or set(rc) & set(rb):
        raise ValueError(f"dimension_numbers: a dimension cannot be both batch and contracting; got "
                         f"{dimension_numbers!r}.")
    return lc, rc, lb, rb


def _to_3d(x: jax.Array, batch: Sequence[int], contract: Sequence[int]) -> tuple[jax.Array, int, tuple[int, ...]]:
    """x as (B, F, K) (K-major, kaxis 2) or, when that is x's own order, (B, K, F) (kaxis 1); plus F's shape.

    Whichever order x already has is taken, so the usual cases (activations (.., K), kernels (K, N)) need no
    transpose, only a reshape.
    """
    free = [d for d in range(x.ndim) if d not in batch and d not in contract]
    size = lambda dims: math.prod(x.shape[d] for d in dims)
    b, f, k = size(batch), size(free), size(contract)
    identity = list(range(x.ndim))
    if [*batch, *contract, *free] == identity and [*batch, *free, *contract] != identity:
        return x.reshape(b, k, f), 1, tuple(x.shape[d] for d in free)
    x = jnp.transpose(x, (*batch, *free, *contract))
    return x.reshape(b, f, k), 2, tuple(x.shape[len(batch):len(batch) + len(free)])


def _out_dtype(lhs: jax.Array, rhs: jax.Array, preferred_element_type: Any, caller: str = "mx_dot_general"
               ) -> np.dtype:
    """The result's dtype: preferred_element_type (a floating dtype), else lhs's and rhs's promoted dtype."""
    if preferred_element_type is None:
        try:
            return np.dtype(jnp.result_type(lhs.dtype, rhs.dtype))
        except (TypeError, ValueError):  # jax's TypePromotionError, e.g. float32 with an 8-bit float
            raise TypeError(f"{caller}: lhs ({support.dtype_name(lhs)}) and rhs ({support.dtype_name(rhs)}) have no "
                            "implicit common dtype; pass preferred_element_type (a floating dtype) or cast one of "
                            "them.") from None
    try:
        dtype = np.dtype(preferred_element_type)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        shown = dtype if dtype is not None else repr(preferred_element_type)
        raise TypeError(f"preferred_element_type={shown} is not supported by {caller}; allowed: a floating "
                        "dtype (float32, bfloat16, float16) or None.")
    return dtype


def mx_dot_general_amax(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any = None,
                        preferred_element_type: Any = None, *, out_sharding: Any = None,
                        recipe: Recipe = RECIPES["mxfp8"], grad_amax: Optional[jax.Array] = None
                        ) -> tuple[jax.Array, jax.Array]:
    """`mx_dot_general` that also returns the forward GEMM's amax (max|out| on the float32 accumulator).

    The amax has no gradient. The backward GEMMs' amaxes come back through `grad_amax`: pass a float32 (2,) array
    (zeros) and its gradient is [amax of dgrad, amax of wgrad] (Flax's "overwrite with gradient" idiom; summed,
    not maxed, over uses of the same array, e.g. under vmap).
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a jax_blockgemm.Recipe; got {recipe!r}.")
    lhs, rhs = support.as_array("lhs", lhs, "mx_dot_general"), support.as_array("rhs", rhs, "mx_dot_general")
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"mx_dot_general: {name} has dtype {support.dtype_name(x)}; allowed: a floating dtype "
                            "(float32, bfloat16, float16), which is block-quantized inside.")
    out_dtype = _out_dtype(lhs, rhs, preferred_element_type)
    lc, rc, lb, rb = _parse_dimension_numbers(lhs, rhs, dimension_numbers)
    x, x_kaxis, lhs_free = _to_3d(lhs, lb, lc)
    w, w_kaxis, rhs_free = _to_3d(rhs, rb, rc)
    if grad_amax is None:
        grad_amax = jnp.zeros((2,), jnp.float32)
    grad_amax = support.as_array("grad_amax", grad_amax, "mx_dot_general_amax")
    if grad_amax.shape != (2,):
        raise ValueError(f"grad_amax must have shape (2,) (dgrad, wgrad); got {grad_amax.shape}.")
    if not jnp.issubdtype(grad_amax.dtype, jnp.floating):  # an integer one's gradient would be float0
        raise TypeError(f"grad_amax has dtype {support.dtype_name(grad_amax)}; allowed: a floating dtype (float32 "
                        "zeros).")
    out, amax = _mx_matmul(x, w, grad_amax, x_kaxis, w_kaxis, out_dtype, recipe)
    out = out.reshape(*(lhs.shape[d] for d in lb), *lhs_free, *rhs_free)
    if out_sharding is not None:
        out = jax.sharding.reshard(out, out_sharding)
    return out, jax.lax.stop_gradient(amax)


def mx_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any = None,
                   preferred_element_type: Any = None, *, out_sharding: Any = None,
                   recipe: Recipe = RECIPES["mxfp8"]) -> jax.Array:
    """Drop-in for `jax.lax.dot_general` that block-quantizes both operands and multiplies through `gemm_amax`.

    lhs, rhs: floating arrays with any batch and contracting dimensions (`dimension_numbers` as in dot_general);
    each is quantized along its (flattened) contraction dimensions in the recipe's forward format. The result has
    dot_general's shape and dtype (`preferred_element_type`, else the operands' promoted dtype). Differentiable:
    a straight-through custom VJP whose dgrad and wgrad are block-scaled GEMMs in the recipe's formats, each
    operand quantized along its own contraction axis. Any GEMM whose contraction length is not a multiple of 32 (or
    that has an empty dimension) runs as a plain bfloat16 dot with float32 accumulation instead.

    precision is accepted for signature compatibility and ignored: the recipe fixes the operands' precision.
    out_sharding, when given, reshards the result (jax.sharding.reshard, as dot_general does). Use
    `functools.partial(mx_dot_general, recipe=...)` as Flax's `dot_general=`; `mx_dot_general_amax` also returns
    the amax of each GEMM.
    """
    return mx_dot_general_amax(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                               out_sharding=out_sharding, recipe=recipe)[0]
