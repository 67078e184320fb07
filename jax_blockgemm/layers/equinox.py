"""Equinox `MXLinear`: `eqx.nn.Linear`'s parameters and initialization, its matmul through mx_dot_general."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp

from jax_blockgemm import autodiff

__all__ = ["MXLinear"]


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
        in_size = 1 if self.in_features == "scalar" else self.in_features
        if self.in_features == "scalar":
            if jnp.shape(x) != ():
                raise ValueError(f"MXLinear: in_features='scalar' takes a scalar x; got shape {jnp.shape(x)}.")
            x = jnp.broadcast_to(x, (1,))
        elif jnp.ndim(x) < 1 or jnp.shape(x)[-1] != in_size:
            raise ValueError(f"MXLinear: x must have shape (..., {in_size}) (in_features={self.in_features}); got "
                             f"{jnp.shape(x)}.")
        y, amax = autodiff.mx_dot_general_amax(x, self.weight, (((x.ndim - 1,), (1,)), ((), ())), recipe=self.recipe,
                                               grad_amax=grad_amax)
        if self.bias is not None:
            y = y + self.bias
        if self.out_features == "scalar":
            y = y[..., 0]
        return y, amax

    def __call__(self, x: jax.Array, *, key: Optional[jax.Array] = None) -> jax.Array:
        return self.call_with_amax(x)[0]
