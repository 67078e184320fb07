"""A small MLP on scikit-learn's digits, trained with a swappable dot_general: MXFP8 against bf16 (and, on a GPU,
against `jax.nn.scaled_dot_general`). Shared by notebooks/training_mxfp8.ipynb, tests/test_training.py and
benchmarks/train_step.py, so the three show the same model. Needs optax and scikit-learn (and matplotlib to plot).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_blockgemm import autodiff

__all__ = ["digits_data", "bf16_dot_general", "jax_nn_mxfp8_dot_general", "DOT_GENERALS", "init_mlp", "mlp_apply",
           "train", "plot_curves"]

DotGeneral = Callable[..., jax.Array]


def digits_data(seed: int = 0, test_fraction: float = 0.25) -> tuple[np.ndarray, ...]:
    """(x_train, y_train, x_test, y_test): the 1797 8x8 digits as standardized float32 (n, 64) and int32 labels."""
    from sklearn.datasets import load_digits  # lazy: only the examples need scikit-learn

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order].astype(np.float32), y[order].astype(np.int32)
    n_test = int(len(x) * test_fraction)
    mean, std = x[n_test:].mean(0), x[n_test:].std(0) + 1e-3
    x = (x - mean) / std
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def bf16_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any = None,
                     preferred_element_type: Any = None, **_: Any) -> jax.Array:
    """The bf16 baseline: bfloat16 operands, float32 accumulation, the operands' dtype out (plain XLA autodiff)."""
    out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
    return jax.lax.dot_general(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), dimension_numbers,
                               preferred_element_type=jnp.float32).astype(out_dtype)


def jax_nn_mxfp8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any = None,
                             preferred_element_type: Any = None, **_: Any) -> jax.Array:
    """`jax.nn.scaled_dot_general` with its MXFP8 config for all three GEMMs (cuDNN; no CPU lowering).

    Its quantizer asserts that every contracted size (the forward's K, and the M, N and batch sizes the backward
    GEMMs contract) is a multiple of the 32-wide block; a layer where one is not (a 10-class head) runs the bf16
    baseline instead, as mx_dot_general's recipe falls back to bf16 for a GEMM no format fits.
    """
    (lc, rc), (lb, _) = dimension_numbers
    free = lambda x, contract, batch: [d for i, d in enumerate(x.shape) if i not in (*contract, *batch)]
    sizes = [lhs.shape[i] for i in lc] + free(lhs, lc, lb) + free(rhs, rc, lb)
    if any(d % 32 for d in sizes):
        return bf16_dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    configs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3
    out = jax.nn.scaled_dot_general(lhs, rhs, dimension_numbers, configs=configs)
    return out.astype(preferred_element_type or jnp.result_type(lhs, rhs))


DOT_GENERALS: dict[str, DotGeneral] = {
    "mxfp8": functools.partial(autodiff.mx_dot_general, recipe=autodiff.RECIPES["mxfp8"]),
    "bf16": bf16_dot_general,
    "jax.nn mxfp8": jax_nn_mxfp8_dot_general,
}


def init_mlp(key: jax.Array, sizes: Sequence[int]) -> list[tuple[jax.Array, jax.Array]]:
    """[(kernel (in, out), bias (out,))] per layer: lecun_normal kernels and zero biases, as nnx.Linear's."""
    init = jax.nn.initializers.lecun_normal()
    keys = jax.random.split(key, len(sizes) - 1)
    return [(init(k, (n_in, n_out), jnp.float32), jnp.zeros((n_out,), jnp.float32))
            for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:])]


def mlp_apply(params: Sequence[tuple[jax.Array, jax.Array]], x: jax.Array, dot_general: DotGeneral) -> jax.Array:
    """Logits of a ReLU MLP whose every matmul goes through `dot_general`."""
    for i, (kernel, bias) in enumerate(params):
        x = dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ()))) + bias
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x


def _loss(params, x, y, dot_general):
    logits = mlp_apply(params, x, dot_general)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0])


def make_step(dot_general: DotGeneral, optimizer: Any) -> Callable:
    """A jitted Adam step (params, opt_state, x, y) -> (params, opt_state, loss)."""
    import optax  # lazy: only the examples need optax

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y, dot_general)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def train(dot_general: DotGeneral, data: tuple[np.ndarray, ...], *, sizes: Sequence[int] = (64, 256, 256, 10),
          steps: int = 400, batch: int = 128, learning_rate: float = 1e-3, seed: int = 0) -> dict:
    """Adam on minibatches drawn with `seed` (the same batches and initial parameters for every dot_general).

    Returns {"losses": per-step training loss (steps,), "test_loss": float, "test_accuracy": float, "params"}.
    """
    import optax

    x_train, y_train, x_test, y_test = data
    params = init_mlp(jax.random.key(seed), sizes)
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(params)
    step = make_step(dot_general, optimizer)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        idx = rng.integers(0, len(x_train), batch)
        params, opt_state, loss = step(params, opt_state, x_train[idx], y_train[idx])
        losses.append(loss)
    logits = jax.jit(mlp_apply, static_argnums=2)(params, x_test, dot_general)
    return {"losses": np.asarray(jnp.stack(losses)), "params": params,
            "test_loss": float(_loss(params, x_test, y_test, dot_general)),
            "test_accuracy": float(np.mean(np.argmax(np.asarray(logits), -1) == y_test))}


def plot_curves(curves: dict[str, np.ndarray], path: str | None = None, *, smooth: int = 10, title: str = ""):
    """Training-loss curves (moving average over `smooth` steps) on a log scale; saved as PNG to `path` if given.

    Returns the matplotlib Figure (a notebook displays it; scripts should close it).
    """
    import matplotlib.pyplot as plt  # lazy: only plotting needs matplotlib

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    kernel = np.ones(smooth) / smooth
    for (name, losses), style in zip(curves.items(), ("-", "--", ":", "-.")):
        ax.plot(np.arange(smooth - 1, len(losses)), np.convolve(losses, kernel, mode="valid"), style, label=name)
    ax.set(xlabel="step", ylabel="training loss", yscale="log", title=title)
    ax.legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path)
    return fig
