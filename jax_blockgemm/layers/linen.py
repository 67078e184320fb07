"""Flax Linen twins of the NNX layers: `MXDense` (a drop-in for `nn.Dense`) and `MLAQProjection`.

The forward GEMM's amax is sown into the "intermediates" collection (`apply(..., mutable=["intermediates"])`);
the gradient with respect to the "mx_grad_amax" collection's (2,) zeros is [dgrad amax, wgrad amax].
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from jax_blockgemm import autodiff, mla

__all__ = ["MXDense", "MLAQProjection", "GRAD_AMAX"]

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
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        sink = self.variable(GRAD_AMAX, "dgrad_wgrad", jnp.zeros, (2,), jnp.float32)
        y, amax = autodiff.mx_dot_general_amax(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
                                               self.precision, recipe=recipe, grad_amax=sink.value)
        self.sow("intermediates", "amax", amax)
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y


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
