"""Greedy decoding with a random-weight transformer decoder stack whose weights are bf16, MXFP8 or MXFP4 (or NVFP4),
the activations bf16 throughout: the serving case `weight_only_matmul` exists for (SPEC §5b).

    python -m jax_blockgemm.examples.decode            # 16 layers, d = 4096 (about 3.4 B weights): a GPU
    python -m jax_blockgemm.examples.decode --small    # a tiny stack a CPU runs in seconds

The model is a pre-norm decoder (RMSNorm, multi-head attention with rotary positions and a KV cache, a SwiGLU MLP, an
untied output head), each layer's weights in buffers of their own and the layers unrolled (`--scan`: stacked and run
by `jax.lax.scan`, where XLA's bf16 dots run 2.4x slower on the H200: docs/performance.md). A prompt is fed one token
per step and then every step appends the argmax token; the whole loop is one `jax.jit` program, so the figure is
device time. It prints, per weight format and batch size, the time per decode step, tokens per second (batch x steps /
time) and the rate at which the step reads its weights, and how often the model's next token, fed the bf16 model's
output, is the bf16 model's (free-running tokens part ways at the first near-tie and never meet again). The quantized
formats' matmuls are `weight_only_matmul` calls with M = the batch and implementation=None: on a GPU whose
`arch.TABLE` row sets a `decode_max_m` for the format (sm_90a), batches up to that threshold run a kernel that
streams the codes and scales once per step (the swap_ab kernel's decode tiles for the M its `decode_swap_ab_m`
names, the weight_stream decode kernel otherwise); larger batches and other devices run the reference (dequantize to
bf16, then XLA's dot). The last line printed says which for the device at hand, read from the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_blockgemm import api, arch, support, weight_only

__all__ = ["Config", "FULL", "SMALL", "init_params", "quantize_params", "dequantize_params", "weight_bytes",
           "unstack_layers", "generate", "teacher_forced", "next_token_agreement", "matmul_path", "main"]

WEIGHT_FORMATS = ("bf16", *weight_only.WEIGHT_FORMATS)
DEFAULT_FORMATS = ("bf16", "mxfp8_e4m3", "mxfp4")
MATMUL_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")  # per layer, each (out, in)


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of the decoder stack and of the decoding run."""

    layers: int = 16
    d_model: int = 4096
    heads: int = 32
    ffn: int = 11008
    vocab: int = 32000
    prompt: int = 8
    new_tokens: int = 64

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def steps(self) -> int:
        """Decode steps per run: every prompt token but the last is fed, then each new token is produced."""
        return self.prompt + self.new_tokens - 1


FULL = Config()
SMALL = Config(layers=2, d_model=64, heads=4, ffn=128, vocab=256, prompt=4, new_tokens=8)


def init_params(key: jax.Array, cfg: Config) -> dict[str, Any]:
    """Random bf16 weights (normal, scaled by 1/sqrt(fan-in)), layer weights stacked on a leading axis."""
    keys = iter(jax.random.split(key, 8))
    normal = lambda shape: (jax.random.normal(next(keys), shape, jnp.float32)
                            / np.sqrt(shape[-1])).astype(jnp.bfloat16)
    d, f, n = cfg.d_model, cfg.ffn, cfg.layers
    layers = {"wqkv": normal((n, 3 * d, d)), "wo": normal((n, d, d)), "w_gate_up": normal((n, 2 * f, d)),
              "w_down": normal((n, d, f)), "attn_norm": jnp.ones((n, d), jnp.bfloat16),
              "mlp_norm": jnp.ones((n, d), jnp.bfloat16)}
    embed = jax.random.normal(next(keys), (cfg.vocab, d), jnp.float32).astype(jnp.bfloat16)
    return {"embed": embed, "layers": layers, "final_norm": jnp.ones((d,), jnp.bfloat16),
            "lm_head": normal((cfg.vocab, d))}


def quantize_params(params: dict[str, Any], fmt: str) -> dict[str, Any]:
    """Every matmul weight (the layers' and the output head) as a QuantizedWeight in `fmt`; "bf16" keeps them.
    Embedding and norms stay bf16."""
    if fmt == "bf16":
        return params
    one = jax.jit(functools.partial(weight_only.quantize_weight, format=fmt))
    layers = dict(params["layers"])
    for name in MATMUL_WEIGHTS:
        layers[name] = jax.lax.map(one, layers[name])  # one matrix at a time: the float32 temporaries stay small
    return {**params, "layers": layers, "lm_head": one(params["lm_head"])}


def dequantize_params(params: dict[str, Any]) -> dict[str, Any]:
    """The bf16 model with the quantized weights' values (exact for MXFP8 / MXFP4: a code times a power of two)."""
    is_weight = lambda x: isinstance(x, weight_only.QuantizedWeight)
    return jax.tree.map(lambda x: x.dequantize(jnp.bfloat16) if is_weight(x) else x, params, is_leaf=is_weight)


def unstack_layers(params: dict[str, Any]) -> dict[str, Any]:
    """The layers as a list of per-layer dicts, each weight a buffer of its own: `generate` then runs them in a Python
    loop (unrolled in the program) instead of `lax.scan` over the stacked arrays."""
    layers, count = params["layers"], params["layers"]["attn_norm"].shape[0]
    return {**params, "layers": [jax.tree.map(lambda x, i=i: x[i], layers) for i in range(count)]}


def weight_bytes(params: dict[str, Any]) -> int:
    """Bytes of the matmul weights one decode step reads (codes and scales, or bf16 values)."""
    layers = params["layers"] if isinstance(params["layers"], list) else [params["layers"]]
    weights = [params["lm_head"], *(layer[name] for layer in layers for name in MATMUL_WEIGHTS)]
    return sum(w.nbytes if isinstance(w, weight_only.QuantizedWeight) else w.size * w.dtype.itemsize for w in weights)


def _matmul(x: jax.Array, w: Any) -> jax.Array:
    """x (..., in) bf16 times an (out, in) weight -> bf16, fp32 accumulation: weight_only_matmul for a quantized
    weight, XLA's bf16 dot otherwise (the same arithmetic on the same values where the weight is exact in bf16)."""
    if isinstance(w, weight_only.QuantizedWeight):
        return api.weight_only_matmul(x, w, out_dtype=jnp.bfloat16)
    y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(jnp.bfloat16)


def _rms_norm(x: jax.Array, gain: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6) * gain).astype(jnp.bfloat16)


def _rope(x: jax.Array, position: jax.Array) -> jax.Array:
    """Rotary positions on (B, H, Dh), halves rotated (base 10000)."""
    half = x.shape[-1] // 2
    angle = position * jnp.exp2(-jnp.arange(half, dtype=jnp.float32) * (np.log2(10000.0) / half))
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    a, b = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


def _decode_step(params: dict[str, Any], cache: jax.Array, tokens: jax.Array, position: jax.Array, cfg: Config
                 ) -> tuple[jax.Array, jax.Array]:
    """One token per sequence through the stack: (logits (B, vocab) bf16, the cache with this position written).
    cache: (L, 2, B, S, H, Dh) bf16 keys and values."""
    b = tokens.shape[0]
    h = params["embed"][tokens]
    shape = (b, cfg.heads, cfg.head_dim)
    visible = jnp.arange(cache.shape[3]) <= position  # keys written so far

    def layer(carry, p):
        h, cache, i = carry
        q, k, v = jnp.split(_matmul(_rms_norm(h, p["attn_norm"]), p["wqkv"]), 3, axis=-1)
        q, k = _rope(q.reshape(shape), position), _rope(k.reshape(shape), position)
        kv = jnp.stack([k, v.reshape(shape)])[None, :, :, None]  # (1, 2, B, 1, H, Dh)
        cache = jax.lax.dynamic_update_slice(cache, kv, (i, 0, 0, position, 0, 0))
        keys, values = jax.lax.dynamic_index_in_dim(cache, i, keepdims=False)
        scores = jnp.einsum("bhd,bshd->bhs", q, keys, preferred_element_type=jnp.float32) / np.sqrt(cfg.head_dim)
        weights = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1).astype(jnp.bfloat16)
        attended = jnp.einsum("bhs,bshd->bhd", weights, values, preferred_element_type=jnp.float32)
        h = h + _matmul(attended.astype(jnp.bfloat16).reshape(b, -1), p["wo"])
        gate, up = jnp.split(_matmul(_rms_norm(h, p["mlp_norm"]), p["w_gate_up"]), 2, axis=-1)
        h = h + _matmul((jax.nn.silu(gate.astype(jnp.float32)) * up).astype(jnp.bfloat16), p["w_down"])
        return (h, cache, i + 1), None

    if isinstance(params["layers"], list):  # unstacked: one layer after another, each with its own buffers
        carry = (h, cache, jnp.int32(0))
        for p in params["layers"]:
            carry, _ = layer(carry, p)
        h, cache, _ = carry
    else:
        (h, cache, _), _ = jax.lax.scan(layer, (h, cache, jnp.int32(0)), params["layers"])
    return _matmul(_rms_norm(h, params["final_norm"]), params["lm_head"]), cache


@functools.partial(jax.jit, static_argnames=("cfg",))
def generate(params: dict[str, Any], prompt: jax.Array, *, cfg: Config) -> jax.Array:
    """Greedy decoding in one program: prompt (B, cfg.prompt) int32 -> tokens (B, cfg.prompt + cfg.new_tokens)."""
    b = prompt.shape[0]
    length = cfg.prompt + cfg.new_tokens
    tokens = jnp.zeros((b, length), jnp.int32).at[:, :cfg.prompt].set(prompt)
    cache = jnp.zeros((cfg.layers, 2, b, length, cfg.heads, cfg.head_dim), jnp.bfloat16)

    def step(t, state):
        cache, tokens = state
        logits, cache = _decode_step(params, cache, tokens[:, t], t, cfg)
        chosen = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        following = jnp.where(t + 1 < cfg.prompt, tokens[:, t + 1], chosen)  # the prompt is fed as given
        return cache, jax.lax.dynamic_update_slice(tokens, following[:, None], (0, t + 1))

    return jax.lax.fori_loop(0, cfg.steps, step, (cache, tokens))[1]


@functools.partial(jax.jit, static_argnames=("cfg",))
def teacher_forced(params: dict[str, Any], tokens: jax.Array, *, cfg: Config) -> jax.Array:
    """The argmax of every step when fed `tokens` (B, cfg.prompt + cfg.new_tokens) rather than its own choices:
    (B, cfg.steps) predictions of tokens[:, 1:]. Fed another model's tokens, it measures how often the two agree on
    the next token, without one early disagreement changing every later input as in free-running decoding."""
    b = tokens.shape[0]
    cache = jnp.zeros((cfg.layers, 2, b, tokens.shape[1], cfg.heads, cfg.head_dim), jnp.bfloat16)

    def step(t, state):
        cache, chosen = state
        logits, cache = _decode_step(params, cache, tokens[:, t], t, cfg)
        return cache, chosen.at[:, t].set(jnp.argmax(logits, axis=-1).astype(jnp.int32))

    return jax.lax.fori_loop(0, cfg.steps, step, (cache, jnp.zeros((b, cfg.steps), jnp.int32)))[1]


def next_token_agreement(params: dict[str, Any], reference_tokens: np.ndarray, cfg: Config) -> float:
    """Share of the generated positions of `reference_tokens` (another model's greedy output) that this model's
    teacher-forced argmax reproduces."""
    predicted = np.asarray(teacher_forced(params, jnp.asarray(reference_tokens), cfg=cfg))
    return float(np.mean(predicted[:, cfg.prompt - 1:] == reference_tokens[:, cfg.prompt:]))


def matmul_path(device: Any, formats_: Sequence[str]) -> str:
    """What implementation=None runs on `device` for the matmuls of the quantized formats among `formats_` (M = the
    batch), from `arch.TABLE`'s `decode_max_m` for the device's kernel target; "" when every format is bf16."""
    quantized = [fmt for fmt in formats_ if fmt != "bf16"]
    if not quantized:
        return ""
    reference = "the reference (the weight dequantized to bf16, then XLA's dot)"
    capability = getattr(device, "compute_capability", None)  # CUDA devices only
    target = arch.target_of(str(capability)) if capability else None
    if target is None:
        return f"Quantized weights on {device.device_kind}: no kernel of ours runs here, so {reference}."
    rule = arch.decode_rule(arch.policy(target), quantized)
    runs = (f"a decode kernel for {rule} (M: the batch); {reference} for every other batch and format" if rule
            else f"{reference} at every batch")
    return (f"Quantized weights on {target}, implementation=None (arch.TABLE's decode_max_m, unless a tuning table "
            f"measured on this GPU decides otherwise): {runs}.")


def _time_s(fn, *args, repeats: int) -> float:
    """Median wall time of `repeats` waited calls, after one warm-up call (which also compiles)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _formats(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(","))
    for name in names:
        if name not in WEIGHT_FORMATS:
            raise argparse.ArgumentTypeError(f"unknown weight format {name!r}; choose from "
                                             f"{', '.join(WEIGHT_FORMATS)}.")
    return names


def _batches(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected batch sizes >= 1 separated by commas; got {text!r}.")
    return sizes


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    """Runs greedy decoding per weight format and batch size; prints the table; returns its rows."""
    p = argparse.ArgumentParser(prog="python -m jax_blockgemm.examples.decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="a tiny stack (2 layers, d = 64) that a CPU runs in seconds")
    p.add_argument("--formats", type=_formats, default=DEFAULT_FORMATS,
                   help=f"weight formats, a comma list of {', '.join(WEIGHT_FORMATS)} (default: bf16,mxfp8_e4m3,mxfp4)")
    p.add_argument("--batch", type=_batches, default=(1, 16), help="batch sizes, a comma list (default 1,16)")
    count = support.count_arg()
    p.add_argument("--layers", type=count, help="layers (default 16; --small 2)")
    p.add_argument("--d-model", type=count, help="model width d (default 4096; --small 64)")
    p.add_argument("--new-tokens", type=count, help="tokens generated after the prompt (default 64; --small 8)")
    p.add_argument("--repeats", type=count, default=3, help="timed runs per row (the median is reported)")
    p.add_argument("--scan", action="store_true",
                   help="the layers' weights stacked and run by lax.scan (default: each layer's weights as buffers "
                        "of their own, the layers unrolled; docs/performance.md compares the two)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cfg = SMALL if args.small else FULL
    overrides = {"layers": args.layers, "new_tokens": args.new_tokens}
    if args.d_model:
        overrides.update(d_model=args.d_model, heads=max(1, args.d_model // 128), ffn=args.d_model * 11 // 4 // 32 * 32)
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    key_params, key_prompt = jax.random.split(jax.random.key(args.seed))
    base = init_params(key_params, cfg)
    device = jax.devices()[0]
    print(f"greedy decoding: {cfg.layers} layers, d = {cfg.d_model}, {cfg.heads} heads, ffn {cfg.ffn}, vocab "
          f"{cfg.vocab}; a {cfg.prompt}-token prompt, then {cfg.new_tokens} new tokens ({cfg.steps} decode steps, "
          f"one jitted program); bf16 activations; layers {'by lax.scan' if args.scan else 'unrolled'}; "
          f"{device.device_kind} ({device.platform})")
    print(f"{'weights':<11} {'batch':>5} {'ms/step':>9} {'tokens/s':>10} {'weights MB':>11} {'GB/s':>8}  "
          "next token as bf16's")
    rows, reference_tokens = [], {}
    for fmt in args.formats:
        params = quantize_params(base, fmt)
        params = jax.block_until_ready(params if args.scan else unstack_layers(params))
        mbytes = weight_bytes(params)
        for batch in args.batch:
            prompt = jax.random.randint(jax.random.fold_in(key_prompt, batch), (batch, cfg.prompt), 0, cfg.vocab)
            run = functools.partial(generate, cfg=cfg)
            seconds = _time_s(run, params, prompt, repeats=args.repeats)
            tokens = np.asarray(run(params, prompt))
            if fmt == "bf16":
                reference_tokens[batch] = tokens
            agreement = (next_token_agreement(params, reference_tokens[batch], cfg)
                         if batch in reference_tokens else None)
            same = "-" if agreement is None else f"{agreement:.1%}"
            step_s = seconds / cfg.steps
            row = {"format": fmt, "batch": batch, "ms_per_step": 1e3 * step_s, "tokens_per_s": batch / step_s,
                   "weight_bytes": mbytes, "weight_gb_per_s": mbytes / step_s / 1e9, "tokens": tokens.tolist(),
                   "next_token_agreement": agreement}
            rows.append(row)
            print(f"{fmt:<11} {batch:>5} {row['ms_per_step']:>9.3f} {row['tokens_per_s']:>10.1f} "
                  f"{mbytes / 1e6:>11.1f} {row['weight_gb_per_s']:>8.1f}  {same}")
            sys.stdout.flush()
        del params
    note = matmul_path(device, args.formats)
    if note:
        print(note)
    return rows


if __name__ == "__main__":
    main()
