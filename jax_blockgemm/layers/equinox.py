"""Equinox `MXLinear`: `eqx.nn.Linear`'s parameters and initialization, its matmul through mx_dot_general; and
`WeightOnlyLinear`, its inference twin holding a QuantizedWeight (`MXLinear.quantized_for_inference`)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp

from jax_blockgemm import autodiff, weight_only
from jax_blockgemm.api import weight_only_matmul

__all__ = ["MXLinear", "WeightOnlyLinear"]


class MXLinear(eqx.Module):
    """Like `eqx.nn.Linear` (weight (out, in), bias (out,), the same uniform initialization, "scalar" features),
    with `recipe` (a jax_blockgemm.Recipe or a name in RECIPES) choosing the block formats.

    Called on x of shape (in,) as eqx.nn.Linear is (vmap it for a batch), or (..., in) directly, which
    quantizes the whole batch in one GEMM. `call_with_amax` also returns the forward GEMM's amax.
    """

    weight: jax.Array
    bias: Optional[jax.Array]
    in_features: Union[int, Literal["scalar"]] = eqx.field(static=True)
    out_features: Union[int, Literal["scalar"]] = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    recipe: autodiff.Recipe = eqx.field(static=True)

    def __init__(self, in_features, out_features, use_bias: bool = True, dtype: Any = None, *,
                 recipe: autodiff.Recipe | str = "mxfp8", key: jax.Array):
        reference = eqx.nn.Linear(in_features, out_features, use_bias, dtype, key=key)  # same initialization
        self.weight, self.bias = reference.weight, reference.bias
        self.in_features, self.out_features, self.use_bias = in_features, out_features, use_bias
        self.recipe = autodiff.as_recipe(recipe)

    def call_with_amax(self, x: jax.Array, grad_amax: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
        """(y, forward amax); pass grad_amax ((2,) zeros) to receive [dgrad amax, wgrad amax] as its gradient."""
        x = _as_input_rows(x, self.in_features, "MXLinear")
        y, amax = autodiff.mx_dot_general_amax(x, self.weight, (((x.ndim - 1,), (1,)), ((), ())), recipe=self.recipe,
                                               grad_amax=grad_amax)
        if self.bias is not None:
            y = y + self.bias
        if self.out_features == "scalar":
            y = y[..., 0]
        return y, amax

    def __call__(self, x: jax.Array, *, key: Optional[jax.Array] = None) -> jax.Array:
        return self.call_with_amax(x)[0]

    def quantized_for_inference(self, format: str = "mxfp8_e4m3", *, out_dtype: Any = None) -> "WeightOnlyLinear":
        """This layer for serving: its (out, in) weight quantized once to `format`, its bias kept; the result's
        forward is weight_only_matmul (inputs not quantized)."""
        return WeightOnlyLinear.from_linear(self, format, out_dtype=out_dtype)


def _as_input_rows(x: jax.Array, in_features: Union[int, Literal["scalar"]], name: str) -> jax.Array:
    """x as (..., in) for the matmul: a scalar for in_features="scalar", else x's last axis must be in_features."""
    if in_features == "scalar":
        if jnp.shape(x) != ():
            raise ValueError(f"{name}: in_features='scalar' takes a scalar x; got shape {jnp.shape(x)}.")
        return jnp.broadcast_to(x, (1,))
    if jnp.ndim(x) < 1 or jnp.shape(x)[-1] != in_features:
        raise ValueError(f"{name}: x must have shape (..., {in_features}) (in_features={in_features}); got "
                         f"{jnp.shape(x)}.")
    return x


class WeightOnlyLinear(eqx.Module):
    """Inference twin of `eqx.nn.Linear`: y = x · Ŵᵀ + bias through `weight_only_matmul`, Ŵ a QuantizedWeight of the
    (out, in) weight. Called like eqx.nn.Linear (x of shape (in,), or (..., in) directly); x in bfloat16 or float32
    is used as given (other float dtypes are cast to float32), y comes back in `out_dtype` (None: x's dtype)."""

    weight: weight_only.QuantizedWeight
    bias: Optional[jax.Array]
    in_features: Union[int, Literal["scalar"]] = eqx.field(static=True)
    out_features: Union[int, Literal["scalar"]] = eqx.field(static=True)
    out_dtype: Any = eqx.field(static=True, default=None)

    @classmethod
    def from_linear(cls, layer: eqx.nn.Linear, format: str = "mxfp8_e4m3", *, out_dtype: Any = None
                    ) -> "WeightOnlyLinear":
        """Quantizes an eqx.nn.Linear's (or MXLinear's) (out, in) weight along in."""
        return cls(weight_only.quantize_weight(layer.weight, format), layer.bias, layer.in_features,
                   layer.out_features, out_dtype)

    def __call__(self, x: jax.Array, *, key: Optional[jax.Array] = None) -> jax.Array:
        x = _as_input_rows(jnp.asarray(x), self.in_features, "WeightOnlyLinear")
        if x.dtype not in weight_only.X_DTYPES:
            x = x.astype(jnp.float32)
        weight = jax.lax.stop_gradient(self.weight)  # frozen: eqx.filter_grad of a model holding it trains the rest
        y = weight_only_matmul(x, weight, out_dtype=x.dtype if self.out_dtype is None else self.out_dtype)
        if self.bias is not None:
            y = y + self.bias.astype(y.dtype)
        return y[..., 0] if self.out_features == "scalar" else y
