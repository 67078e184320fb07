"""Flax NNX layers: `MXLinear` (a drop-in for `nnx.Linear`) and `MLAQProjection`, trained through MX GEMMs.

Amax statistics, reachable without mutating the module (so jax.jit, jax.grad and jax.vmap work on it as on
nnx.Linear): `call_with_amax` returns the forward GEMM's amax, and the gradient with respect to the layer's
`grad_amax` variable (type `GradAmax`, not a Param, so optimizers skip it) is [dgrad amax, wgrad amax]:
`nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, GradAmax)))`.

For serving, `MXLinear.quantized_for_inference(format=...)` (or `WeightOnlyLinear.from_linear` for any nnx.Linear)
returns a `WeightOnlyLinear` holding the kernel as a QuantizedWeight, whose forward is `weight_only_matmul`;
`MXExperts.quantized_for_inference` likewise returns `WeightOnlyExperts` (`weight_only_ragged_matmul`).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jax_blockgemm import autodiff, mla, moe, support, weight_only
from jax_blockgemm.api import weight_only_matmul, weight_only_ragged_matmul

__all__ = ["GradAmax", "MXExperts", "MXLinear", "MLAQProjection", "QuantizedKernel", "WeightOnlyExperts",
           "WeightOnlyLinear"]


class GradAmax(nnx.Variable):
    """A (2,) float32 zeros sink whose gradient is the amax of the layer's dgrad and wgrad GEMMs."""


class MXLinear(nnx.Linear):
    """`nnx.Linear` whose matmul is `mx_dot_general` (block-quantized forward, dgrad and wgrad).

    Same arguments, parameters, initializers and call as nnx.Linear (except `dot_general`, which this layer
    fixes), plus `recipe`: a jax_blockgemm.Recipe or a name in RECIPES ("mxfp8", "mxfp8_hybrid", "nvfp4", "bf16").
    """

    def __init__(self, in_features: int, out_features: int, *, recipe: autodiff.Recipe | str = "mxfp8",
                 **kwargs: Any):
        if "dot_general" in kwargs:
            raise TypeError("MXLinear fixes dot_general (mx_dot_general); pass recipe= to choose the formats.")
        support.check_sizes("MXLinear", in_features=in_features, out_features=out_features)
        for name in ("dtype", "param_dtype", "preferred_element_type"):
            value = kwargs.get(name)
            if value is None:
                continue
            try:
                shown, floating = jnp.dtype(value).name, jnp.issubdtype(value, jnp.floating)
            except TypeError:  # no dtype at all, e.g. 'foo'
                shown, floating = repr(value), False
            if not floating:
                raise TypeError(f"MXLinear: {name}={shown} is not supported; allowed: None or a "
                                "floating dtype (the operands are block-quantized from it).")
        super().__init__(in_features, out_features, **kwargs)
        self.recipe = autodiff.as_recipe(recipe)
        self.grad_amax = GradAmax(jnp.zeros((2,), jnp.float32))

    def call_with_amax(self, inputs: jax.Array, out_sharding: Any = None) -> tuple[jax.Array, jax.Array]:
        """(y, amax of the forward GEMM): the layer's output and max|inputs · kernel| (no gradient)."""
        if jnp.ndim(inputs) < 1 or jnp.shape(inputs)[-1] != self.in_features:
            raise ValueError(f"MXLinear: inputs must have last dimension in_features={self.in_features}; got shape "
                             f"{jnp.shape(inputs)}.")
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        y, amax = autodiff.mx_dot_general_amax(
            inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), self.precision, self.preferred_element_type,
            out_sharding=out_sharding, recipe=self.recipe, grad_amax=self.grad_amax[...])
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y, amax

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        return self.call_with_amax(inputs, out_sharding)[0]

    def quantized_for_inference(self, format: str = "mxfp8_e4m3", *, out_dtype: Any = None) -> "WeightOnlyLinear":
        """This layer for serving: its kernel quantized once to `format` ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4",
        "nvfp4"), its bias kept; the result's forward is weight_only_matmul (inputs not quantized)."""
        return WeightOnlyLinear.from_linear(self, format, out_dtype=self.dtype if out_dtype is None else out_dtype)


class MLAQProjection(nnx.Module):
    """DeepSeek-V3 MLA Q up-projection through the fused gemm_proj_rope_mxfp8: x (T, K) -> MXFP8Views.

    The kernel is (K, H*192), initialized like `nnx.Linear(K, H*192, use_bias=False)`'s (lecun_normal by default),
    which is its bf16 counterpart. Call with x (T, K) and the RoPE tables cos, sin (T, 64); `.dequantize()` on the
    result gives the (rowwise, columnwise) float32 (T, H, 192) views, differentiable w.r.t. x and the kernel.
    recipe.fwd chooses the op's input path ("mxfp8_e4m3" or "bf16").
    """

    def __init__(self, in_features: int, num_heads: int, *, recipe: autodiff.Recipe | str = "mxfp8",
                 param_dtype: Any = jnp.float32, kernel_init: Any = nnx.initializers.lecun_normal(),
                 rngs: nnx.Rngs):
        if num_heads < 1:
            raise ValueError(f"MLAQProjection: num_heads must be at least 1; got {num_heads}.")
        self.in_features, self.num_heads = in_features, num_heads
        self.recipe = autodiff.as_recipe(recipe)
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, num_heads * 192), param_dtype))

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> mla.MXFP8Views:
        return mla.mla_q_projection(x, self.kernel[...], cos, sin, w_out_in=False, recipe=self.recipe)


class QuantizedKernel(nnx.Variable):
    """A layer's QuantizedWeight: not a Param, so optimizers and nnx.grad leave it alone (it has no gradient)."""


class WeightOnlyLinear(nnx.Module):
    """Inference twin of nnx.Linear: y = inputs · Ŵᵀ + bias through `weight_only_matmul`, Ŵ a QuantizedWeight of the
    (out_features, in_features) weight.

    Inputs (..., in_features) in bfloat16 or float32 are used as given (other float dtypes are cast to float32); y
    comes back in `out_dtype` (bfloat16 or float32; None: the inputs' dtype). Build it with `from_linear` or
    `MXLinear.quantized_for_inference`.
    """

    def __init__(self, weight: weight_only.QuantizedWeight, bias: Optional[jax.Array] = None, *,
                 out_dtype: Any = None):
        if not isinstance(weight, weight_only.QuantizedWeight):
            raise TypeError(f"WeightOnlyLinear: weight must be a QuantizedWeight; got {type(weight).__name__}.")
        self.out_features, self.in_features = weight_only.check_weight(weight)
        if bias is not None and jnp.shape(bias) != (self.out_features,):
            raise ValueError(f"WeightOnlyLinear: bias must have shape (out_features,) = ({self.out_features},); got "
                             f"{jnp.shape(bias)}.")
        self.kernel = QuantizedKernel(weight)
        self.bias = None if bias is None else nnx.Param(jnp.asarray(bias))
        self.out_dtype = out_dtype

    @classmethod
    def from_linear(cls, layer: nnx.Linear, format: str = "mxfp8_e4m3", *, out_dtype: Any = None
                    ) -> "WeightOnlyLinear":
        """Quantizes an nnx.Linear's (or MXLinear's) kernel (in, out) as an (out, in) weight along in_features."""
        kernel = layer.kernel[...]
        bias = layer.bias[...] if layer.bias is not None else None
        return cls(weight_only.quantize_weight(kernel.T, format), bias, out_dtype=out_dtype)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        inputs = jnp.asarray(inputs)
        if jnp.ndim(inputs) < 1 or jnp.shape(inputs)[-1] != self.in_features:
            raise ValueError(f"WeightOnlyLinear: inputs must have last dimension in_features={self.in_features}; got "
                             f"shape {jnp.shape(inputs)}.")
        if inputs.dtype not in weight_only.X_DTYPES:
            inputs = inputs.astype(jnp.float32)
        out_dtype = inputs.dtype if self.out_dtype is None else self.out_dtype
        y = weight_only_matmul(inputs, self.kernel.get_value(), out_dtype=out_dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


class MXExperts(nnx.Module):
    """G experts' linear maps for a mixture-of-experts layer: y[t] = x[t] · kernel[g] for the tokens t routed to g.

    kernel: (num_experts, in_features, out_features), each expert initialized like nnx.Linear's kernel. Call with
    x (T, in_features) sorted by expert and group_sizes (num_experts,); the product is `mx_ragged_dot` in `recipe`'s
    formats (rows past sum(group_sizes) come back zero).
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, *,
                 recipe: autodiff.Recipe | str = "mxfp8", param_dtype: Any = jnp.float32,
                 kernel_init: Any = nnx.initializers.lecun_normal(), rngs: nnx.Rngs):
        support.check_sizes("MXExperts", num_experts=num_experts, in_features=in_features, out_features=out_features)
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.recipe = autodiff.as_recipe(recipe)
        init = lambda key: kernel_init(key, (in_features, out_features), param_dtype)
        self.kernel = nnx.Param(jax.vmap(init)(jax.random.split(rngs.params(), num_experts)))

    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        if jnp.ndim(x) != 2 or jnp.shape(x)[1] != self.in_features:
            raise ValueError(f"MXExperts: x must be (T, in_features={self.in_features}); got shape {jnp.shape(x)}.")
        return moe.mx_ragged_dot(x, self.kernel[...], group_sizes, recipe=self.recipe)

    def quantized_for_inference(self, format: str = "mxfp8_e4m3", *, out_dtype: Any = None) -> "WeightOnlyExperts":
        """These experts for serving: each expert's kernel quantized once to `format` along in_features; the
        result's forward is weight_only_ragged_matmul (tokens not quantized)."""
        return WeightOnlyExperts.from_experts(self, format, out_dtype=out_dtype)


class WeightOnlyExperts(nnx.Module):
    """Inference twin of MXExperts: y[t] = x[t] · Ŵ[g]ᵀ for the tokens t routed to expert g, through
    `weight_only_ragged_matmul`, Ŵ a QuantizedWeight of the G stacked (out_features, in_features) weights.

    Tokens (T, in_features) sorted by expert, in bfloat16 or float32, are used as given (other float dtypes are cast
    to float32); y comes back in `out_dtype` (bfloat16 or float32; None: the tokens' dtype). Build it with
    `from_experts` or `MXExperts.quantized_for_inference`.
    """

    def __init__(self, weight: weight_only.QuantizedWeight, *, out_dtype: Any = None):
        if not isinstance(weight, weight_only.QuantizedWeight):
            raise TypeError(f"WeightOnlyExperts: weight must be a QuantizedWeight; got {type(weight).__name__}.")
        self.num_experts, self.out_features, self.in_features = weight_only.check_weight(weight, experts=True)
        self.kernel = QuantizedKernel(weight)
        self.out_dtype = out_dtype

    @classmethod
    def from_experts(cls, layer: MXExperts, format: str = "mxfp8_e4m3", *, out_dtype: Any = None
                     ) -> "WeightOnlyExperts":
        """Quantizes an MXExperts' kernel (G, in, out) as G (out, in) weights along in_features, one per expert
        (NVFP4: one alpha each)."""
        kernel = jnp.swapaxes(layer.kernel[...], 1, 2)
        return cls(jax.vmap(lambda w: weight_only.quantize_weight(w, format))(kernel), out_dtype=out_dtype)

    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        x = jnp.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"WeightOnlyExperts: x must be (T, in_features={self.in_features}); got shape "
                             f"{x.shape}.")
        if x.dtype not in weight_only.X_DTYPES:
            x = x.astype(jnp.float32)
        out_dtype = x.dtype if self.out_dtype is None else self.out_dtype
        return weight_only_ragged_matmul(x, self.kernel.get_value(), group_sizes, out_dtype=out_dtype)
