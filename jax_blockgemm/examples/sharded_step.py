"""A transformer block trained across devices: FSDP parameters and tensor-parallel heads and MLP on a 2-D mesh.

The block is built from the library's layers (`MXLinear` for the attention and MLP projections, `MLAQProjection`
for the query path, Flax NNX) or, with `mx=False`, from bf16 `nnx.Linear` layers of the same shapes. Parallelism
is only jax.jit plus sharding annotations: every kernel carries a (fsdp, tp) partitioning, the batch is split on
"fsdp", and the heads and the MLP's hidden features on "tp" (column-parallel in, row-parallel out, as Megatron).
The partitioning rules of the primitives (jax_blockgemm/sharding.py) run each GEMM on its shard; the only
gathers are FSDP's weight gathers. Needs optax.

    python -m jax_blockgemm.examples.sharded_step --small     # 8 host CPU devices, a few steps, prints losses
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, Callable, Optional

if __name__ == "__main__" and "--small" in sys.argv:  # 8 host CPU devices, set before jax is imported
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_blockgemm import reference, support
from jax_blockgemm.layers.nnx import MLAQProjection, MXLinear
from jax_blockgemm.support import HEAD_DIM

__all__ = ["BlockConfig", "SMALL", "Block", "make_mesh", "rope_tables", "make_batch", "build_train_step", "main"]

ROPE_DIM, VALUE_DIM = 64, 128  # DeepSeek-V3 MLA head: 192 query/key features (the last 64 rotated), 128 values
FSDP, TP = "fsdp", "tp"


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Sizes of one block and its batch. Under the partitioning rules each shard should hold whole 128-row scale
    atoms: tokens per fsdp shard, d_ff / tp and heads * 128 / tp multiples of 128; heads divisible by tp."""

    d_model: int = 1024
    heads: int = 16
    d_ff: int = 4096
    batch: int = 16
    seq: int = 256


SMALL = BlockConfig(d_model=128, heads=8, d_ff=512, batch=12, seq=64)  # CPU-sized: 768 tokens


def _rms_norm(x: jax.Array) -> jax.Array:
    """Parameter-free RMS norm over the last axis (float32)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)


class Block(nnx.Module):
    """Pre-norm block: attention with MLA-shaped heads (192 query/key features, RoPE on the last 64; 128 value
    features) and a GELU MLP. `mx` picks MXFP8 layers (MXLinear, MLAQProjection) or bf16 nnx.Linear; `mesh`
    (optional) adds sharding constraints on the activations so the partitioner keeps heads and hidden features
    on "tp"."""

    def __init__(self, config: BlockConfig, *, mx: bool, mesh: Optional[Mesh] = None, rngs: nnx.Rngs):
        self.config, self.mx, self.mesh = config, mx, mesh
        d, h, f = config.d_model, config.heads, config.d_ff
        init = nnx.initializers.lecun_normal()

        def linear(n_in: int, n_out: int, axes: tuple) -> nnx.Module:
            kernel_init = nnx.with_partitioning(init, axes)
            if mx:
                return MXLinear(n_in, n_out, recipe="mxfp8", use_bias=False, kernel_init=kernel_init, rngs=rngs)
            return nnx.Linear(n_in, n_out, use_bias=False, dtype=jnp.bfloat16, kernel_init=kernel_init, rngs=rngs)

        if mx:
            self.query = MLAQProjection(d, h, kernel_init=nnx.with_partitioning(init, (FSDP, TP)), rngs=rngs)
        else:
            self.query = linear(d, h * HEAD_DIM, (FSDP, TP))
        self.key = linear(d, h * HEAD_DIM, (FSDP, TP))
        self.value = linear(d, h * VALUE_DIM, (FSDP, TP))
        self.out = linear(h * VALUE_DIM, d, (TP, FSDP))
        self.up = linear(d, f, (FSDP, TP))
        self.down = linear(f, d, (TP, FSDP))

    def _constrain(self, x: jax.Array, *spec: Any) -> jax.Array:
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(*spec)))

    def _queries(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """(T, H, 192) float32 queries, RoPE applied to features 128..191."""
        h = self.config.heads
        if self.mx:
            rowwise, _ = self.query(x, cos, sin).dequantize()  # the fused GEMM + RoPE + MXFP8 quantization
            return rowwise
        q = self.query(x).astype(jnp.float32).reshape(-1, h, HEAD_DIM)
        return reference.apply_rope(q, cos, sin)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """x (B, S, D) -> (B, S, D); cos, sin (B*S, 64) RoPE tables of each token."""
        b, s, d = x.shape
        h = self.config.heads
        tokens = self._constrain(_rms_norm(x).reshape(b * s, d), FSDP, None)
        q = self._constrain(self._queries(tokens, cos, sin), FSDP, TP, None)
        k = reference.apply_rope(self.key(tokens).astype(jnp.float32).reshape(-1, h, HEAD_DIM), cos, sin)
        k = self._constrain(k, FSDP, TP, None)
        v = self._constrain(self.value(tokens).astype(jnp.float32).reshape(-1, h, VALUE_DIM), FSDP, TP, None)
        q, k, v = (t.reshape(b, s, h, -1) for t in (q, k, v))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HEAD_DIM)
        causal = jnp.tril(jnp.ones((s, s), bool))
        weights = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1)
        attn = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b * s, h * VALUE_DIM)
        attn = self._constrain(attn, FSDP, TP)
        x = x + self.out(attn).astype(jnp.float32).reshape(b, s, d)
        hidden = self._constrain(self.up(_rms_norm(x).reshape(b * s, d)), FSDP, TP)
        hidden = jax.nn.gelu(hidden.astype(jnp.float32))
        return x + self.down(hidden).astype(jnp.float32).reshape(b, s, d)


def make_mesh(fsdp: int, tp: int, devices: Optional[list] = None) -> Mesh:
    """A (fsdp, tp) mesh over the first fsdp * tp devices."""
    devices = list(jax.devices() if devices is None else devices)[:fsdp * tp]
    if len(devices) < fsdp * tp:
        raise ValueError(f"a {fsdp}x{tp} mesh needs {fsdp * tp} devices; {len(devices)} visible.")
    return Mesh(np.array(devices).reshape(fsdp, tp), (FSDP, TP))


def rope_tables(tokens: int, seq: int) -> tuple[jax.Array, jax.Array]:
    """cos, sin (tokens, 64) of each token's position in its sequence (tokens = batch * seq)."""
    position = np.arange(tokens) % seq
    inv_freq = 1.0 / (10000.0 ** (np.arange(ROPE_DIM) % (ROPE_DIM // 2) / (ROPE_DIM // 2)))
    angles = position[:, None] * inv_freq[None, :]
    return jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


def make_batch(config: BlockConfig, step: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """(x, target) (B, S, D) float32 of one step: a fixed random linear map of x plus noise, to regress."""
    rng = np.random.default_rng([seed, step])
    x = rng.standard_normal((config.batch, config.seq, config.d_model)).astype(np.float32)
    mix = np.random.default_rng(seed).standard_normal((config.d_model, config.d_model)) / np.sqrt(config.d_model)
    target = np.tanh(x @ mix.astype(np.float32)) + 0.1 * rng.standard_normal(x.shape).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(target)


@dataclasses.dataclass
class TrainStep:
    """A built training step: `state` is (model, optimizer) state, `step(state, x, target) -> (state, loss)` jitted;
    `put(x)` places a batch as the step expects it (batch on "fsdp")."""

    step: Callable
    state: Any
    put: Callable
    mesh: Mesh


def build_train_step(config: BlockConfig, *, mx: bool = True, fsdp: int = 1, tp: int = 1,
                     mesh: Optional[Mesh] = None, seed: int = 0, learning_rate: float = 1e-3) -> TrainStep:
    """The block, its AdamW optimizer and a jitted step on an (fsdp, tp) mesh (1x1: one device, unsharded):
    parameters and optimizer state placed by their kernels' partitioning, batches split on "fsdp". The same seed
    gives the same initial parameters on every mesh."""
    import optax  # lazy: only this example needs optax

    mesh = make_mesh(fsdp, tp) if mesh is None else mesh
    def create() -> tuple[Block, nnx.Optimizer]:
        model = Block(config, mx=mx, mesh=mesh, rngs=nnx.Rngs(seed))
        return model, nnx.Optimizer(model, optax.adamw(learning_rate), wrt=nnx.Param)

    with jax.set_mesh(mesh):  # Flax gives partitioned variables their shardings on the mesh in context
        graphdef, abstract = nnx.split(nnx.eval_shape(create))
        # one jitted initialization, each parameter and optimizer state created on its shards
        state = jax.jit(lambda: nnx.split(create())[1], out_shardings=nnx.get_named_sharding(abstract, mesh))()
    tok = NamedSharding(mesh, P(FSDP, None))
    cos, sin = (jax.device_put(t, tok) for t in rope_tables(config.batch * config.seq, config.seq))

    def loss_fn(model: Block, x: jax.Array, target: jax.Array) -> jax.Array:
        return jnp.mean(jnp.square(model(x, cos, sin) - target))

    @jax.jit
    def step(state: Any, x: jax.Array, target: jax.Array) -> tuple[Any, jax.Array]:
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, target)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    batch_sharding = NamedSharding(mesh, P(FSDP, None, None))
    return TrainStep(step, state, lambda a: jax.device_put(a, batch_sharding), mesh)


def train(built: TrainStep, config: BlockConfig, steps: int, seed: int = 0) -> list[float]:
    """Runs `steps` steps on make_batch's data; returns the losses."""
    losses, state = [], built.state
    for i in range(steps):
        x, target = make_batch(config, i, seed)
        state, loss = built.step(state, built.put(x), built.put(target))
        losses.append(float(loss))
    built.state = state
    return losses


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_blockgemm.examples.sharded_step",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU-sized block on 8 host devices (a 2x4 mesh)")
    parser.add_argument("--fsdp", type=support.count_arg(), default=2)
    parser.add_argument("--tp", type=support.count_arg(), default=4)
    parser.add_argument("--steps", type=support.count_arg(), default=5)
    parser.add_argument("--bf16", action="store_true", help="bf16 nnx.Linear layers instead of MXFP8 ones")
    args = parser.parse_args(argv)
    config = SMALL if args.small else BlockConfig()
    try:
        built = build_train_step(config, mx=not args.bf16, fsdp=args.fsdp, tp=args.tp)
    except ValueError as e:  # a mesh the devices or the block's sizes cannot take
        parser.error(str(e))
    losses = train(built, config, args.steps)
    print(f"{'bf16' if args.bf16 else 'mxfp8'} block on a {args.fsdp}x{args.tp} (fsdp, tp) mesh of "
          f"{jax.devices()[0].platform} devices")
    for i, loss in enumerate(losses):
        print(f"step {i}: loss {loss:.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
