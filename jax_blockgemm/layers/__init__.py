"""Drop-in layers on mx_dot_general and mla_q_projection, one module per framework (optional extras).

Import the one you use: `jax_blockgemm.layers.nnx` (Flax NNX, `pip install -e ".[flax]"`),
`jax_blockgemm.layers.linen` (Flax Linen, same extra) or `jax_blockgemm.layers.equinox` (`pip install -e
".[equinox]"`). Nothing here imports a framework until that module is imported, so the core package never needs one.
"""
