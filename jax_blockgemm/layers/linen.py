"""Flax Linen twins of the NNX layers: `MXDense` (a drop-in for `nn.Dense`) and `MLAQProjection`.

The forward GEMM's amax is sown into the "intermediates" collection (`apply(..., mutable=["intermediates"])`);
the gradient with respect to the "mx_grad_amax" collection's (2,) zeros is [dgrad amax, wgrad amax].

For serving, `MXDense.quantized_for_inference(variables, format=...)` (or `WeightOnlyDense.convert` for any nn.Dense)
returns a `WeightOnlyDense` and its variables, the kernel a QuantizedWeight; its forward is `weight_only_matmul`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from jax_blockgemm import autodiff, mla, support, weight_only
from jax_blockgemm.api import weight_only_matmul

__all__ = ["MXDense", "MLAQProjection", "GRAD_AMAX", "WeightOnlyDense"]

GRAD_AMAX = "mx_grad_amax"  # the collection holding each layer's (2,) gradient-amax sink


class MXDense(nn.Dense):
    """`nn.Dense` whose matmul is `mx_dot_general`: same fields, parameters and initializers, plus `recipe` (a
    jax_blockgemm.Recipe or a name in RECIPES); `dot_general` / `dot_general_cls` are not used."""

    recipe: Any = "mxfp8"

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        recipe = autodiff.as_recipe(self.recipe)
        if self.dot_general is not None or self.dot_general_cls is not None:
            raise TypeError("MXDense fixes dot_general (mx_dot_general); pass recipe= to choose the formats.")
        if jnp.ndim(inputs) < 1:
            raise ValueError(f"MXDense: inputs must have rank >= 1; got shape {jnp.shape(inputs)}.")
        support.check_sizes("MXDense", features=self.features)
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        if self.is_mutable_collection(GRAD_AMAX) or self.has_variable(GRAD_AMAX, "dgrad_wgrad"):
            sink = self.variable(GRAD_AMAX, "dgrad_wgrad", jnp.zeros, (2,), jnp.float32).value
        else:  # applied with its params only (as a TrainState's apply_fn is): the backward's amaxes go unreported
            sink = jnp.zeros((2,), jnp.float32)
        y, amax = autodiff.mx_dot_general_amax(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
                                               self.precision, recipe=recipe, grad_amax=sink)
        self.sow("intermediates", "amax", amax)
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y

    def quantized_for_inference(self, variables: Any, format: str = "mxfp8_e4m3", *, out_dtype: Any = None
                                ) -> tuple["WeightOnlyDense", dict]:
        """(module, variables) for serving this layer: its kernel quantized once to `format`, its bias kept; the
        module's forward is weight_only_matmul. `variables` are this layer's ({"params": {"kernel", "bias"}})."""
        return WeightOnlyDense.convert(self, variables, format, out_dtype=out_dtype)


class MLAQProjection(nn.Module):
    """MLA Q up-projection through the fused gemm_proj_rope_mxfp8: x (T, K), cos, sin (T, 64) -> MXFP8Views.

    The kernel (K, num_heads*192) is initialized like `nn.Dense(num_heads*192, use_bias=False)`'s.
    """

    num_heads: int
    recipe: Any = "mxfp8"
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> mla.MXFP8Views:
        if self.num_heads < 1:
            raise ValueError(f"MLAQProjection: num_heads must be at least 1; got {self.num_heads}.")
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(x)[-1], self.num_heads * 192), self.param_dtype)
        return mla.mla_q_projection(x, kernel, cos, sin, w_out_in=False, recipe=autodiff.as_recipe(self.recipe))


class WeightOnlyDense(nn.Module):
    """Inference twin of `nn.Dense`: y = inputs · Ŵᵀ + bias through `weight_only_matmul`; the "kernel" param is a
    QuantizedWeight of the (features, in) weight (not differentiable), the bias a plain array.

    Inputs in bfloat16 or float32 are used as given (other float dtypes are cast to float32); y comes back in
    `out_dtype` (None: the inputs' dtype). `init` quantizes a freshly initialized kernel; `convert` quantizes a
    trained nn.Dense's (or MXDense's).
    """

    features: int
    format: str = "mxfp8_e4m3"
    use_bias: bool = True
    out_dtype: Any = None
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()

    @staticmethod
    def convert(dense: nn.Dense, variables: Any, format: str = "mxfp8_e4m3", *, out_dtype: Any = None
                ) -> tuple["WeightOnlyDense", dict]:
        """(WeightOnlyDense, its variables) of an nn.Dense (or MXDense) and its variables: the (in, features) kernel
        quantized along `in` as a (features, in) weight, the bias kept."""
        params = variables["params"]
        quantized = {"kernel": weight_only.quantize_weight(jnp.asarray(params["kernel"]).T, format)}
        if dense.use_bias:
            quantized["bias"] = params["bias"]
        out_dtype = dense.dtype if out_dtype is None else out_dtype  # the dense layer's output dtype, if it fixed one
        module = WeightOnlyDense(features=dense.features, format=format, use_bias=dense.use_bias,
                                 out_dtype=out_dtype, parent=None)  # a top-level module, not a child of `dense`
        return module, {"params": quantized}

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        support.check_sizes("WeightOnlyDense", features=self.features)
        inputs = jnp.asarray(inputs)
        if inputs.ndim < 1:
            raise ValueError(f"WeightOnlyDense: inputs must have rank >= 1; got shape {inputs.shape}.")
        in_features = inputs.shape[-1]
        kernel = self.param("kernel", lambda key: weight_only.quantize_weight(
            self.kernel_init(key, (in_features, self.features), jnp.float32).T, self.format))
        if inputs.dtype not in weight_only.X_DTYPES:
            inputs = inputs.astype(jnp.float32)
        out_dtype = inputs.dtype if self.out_dtype is None else self.out_dtype
        y = weight_only_matmul(inputs, kernel, out_dtype=out_dtype)
        if self.use_bias:
            y = y + self.param("bias", self.bias_init, (self.features,), jnp.float32).astype(y.dtype)
        return y
