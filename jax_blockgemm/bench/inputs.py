"""Random benchmark operands, drawn fresh per case and quantized by the library's own quantizers.

Values are normal with rows scaled by different powers of two, so that block scales vary and are never zero; each
input set holds the same values in every form a column takes (our packed codes and 128x4 scale atoms, the compact
scales of `jax.nn.scaled_matmul`, the dequantized bf16 operands), so that every column computes on equal numbers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_blockgemm import formats, reference, support


@dataclasses.dataclass(frozen=True)
class GemmFormat:
    """A gemm_amax input format --format can pick: its name, its table title, its block (sf_vec_size), and the name
    `formats.FORMATS` (quantize_weight, the tuning tables) gives it."""

    name: str
    title: str
    block: int
    weight_format: str

    @property
    def fp4(self) -> bool:
        """True for the E2M1 formats, whose codes are packed two per byte."""
        return self.name in ("mxfp4", "nvfp4")


GEMM_FORMATS = {f.name: f for f in (
    GemmFormat("mxfp8", "MXFP8 E4M3", support.MX_BLOCK, "mxfp8_e4m3"),
    GemmFormat("mxfp8_e5m2", "MXFP8 E5M2", support.MX_BLOCK, "mxfp8_e5m2"),
    GemmFormat("mxfp4", "MXFP4 E2M1", support.MX_BLOCK, "mxfp4"),
    GemmFormat("nvfp4", "NVFP4 E2M1 x alpha", 16, "nvfp4"))}
DEFAULT_FORMATS = ("mxfp8",)


@functools.partial(jax.jit, static_argnums=1)
def random_values(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """float32 normal values whose rows are scaled by 2**-6 .. 2**5, so that block scales differ along the rows."""
    k_values, k_rows = jax.random.split(key)
    row_exponent = jax.random.randint(k_rows, (*shape[:-1], 1), -6, 6)
    return jax.random.normal(k_values, shape, jnp.float32) * jnp.exp2(row_exponent.astype(jnp.float32))


def random_mxfp8(key: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """A random MXFP8 E4M3 operand: (codes, uint8 E8M0 scale bytes per 32 along the last axis) of random_values."""
    return formats.quantize_mxfp8(random_values(key, tuple(shape)))


def as_e8m0(scale_bytes: jax.Array) -> jax.Array:
    """uint8 E8M0 bytes as float8_e8m0fnu, the scale dtype jax.nn.scaled_matmul and jax.lax.scaled_dot take."""
    return jax.lax.bitcast_convert_type(scale_bytes, jnp.float8_e8m0fnu)


def quantize_operand(values: jax.Array, fmt: GemmFormat) -> tuple[jax.Array, jax.Array, Optional[jax.Array]]:
    """(codes, compact scales, per-tensor scale or None) of values in `fmt`, by the library's own quantizers.

    MXFP8: E4M3 (or E5M2, "mxfp8_e5m2") codes and uint8 E8M0 bytes; MXFP4: packed uint8 E2M1 codes and uint8 E8M0
    bytes; NVFP4: packed codes and float8_e4m3fn scales of values times their per-tensor encode factor, and alpha
    (`formats.nvfp4_tensor_scales`) as the third item.
    """
    if fmt.name == "mxfp8":
        return (*formats.quantize_mxfp8(values), None)
    if fmt.name == "mxfp8_e5m2":
        return (*formats.quantize_mxfp8(values, dtype=formats.E5M2), None)
    if fmt.name == "mxfp4":
        return (*formats.quantize_mxfp4(values), None)
    encode, alpha = formats.nvfp4_tensor_scales(values)
    return (*formats.quantize_nvfp4(values * encode), alpha)


def gemm_inputs(key: jax.Array, m: int, n: int, k: int, fmt: str = "mxfp8") -> dict[str, jax.Array]:
    """One input set for a gemm_amax case in format `fmt`: codes and scales in each form the columns take.

    a, b, sfa_atom, sfb_atom (and alpha, NVFP4): what ours and the reference take (FP4 packed two per byte);
    a_sm, b_sm, sfa_sm, sfb_sm: what scaled_matmul / scaled_dot take (float4_e2m1fn codes, compact float8 scales);
    a_fp8, b_fp8: E4M3 codes of the same values for the FP8 dot anchor (for MXFP8 the operands themselves);
    a_bf16, b_bf16: the dequantized operands (code x block scale, without NVFP4's alpha; exact in bf16).
    """
    spec = GEMM_FORMATS[fmt]
    k_a, k_b = jax.random.split(key)
    values = (random_values(k_a, (m, k)), random_values(k_b, (n, k)))
    (a, sfa, ta), (b, sfb, tb) = (quantize_operand(v, spec) for v in values)
    codes = (formats.unpack_fp4(a), formats.unpack_fp4(b)) if spec.fp4 else (a, b)
    inputs = {"a": a, "b": b, "sfa_atom": formats.to_scale_atom(sfa), "sfb_atom": formats.to_scale_atom(sfb),
              "a_sm": codes[0], "b_sm": codes[1],
              "a_bf16": reference.dequantize_bf16(codes[0], sfa, block=spec.block, axis=-1),
              "b_bf16": reference.dequantize_bf16(codes[1], sfb, block=spec.block, axis=-1)}
    e8m0 = sfa.dtype == jnp.uint8  # MX formats; NVFP4's scales are float8_e4m3fn already
    inputs["sfa_sm"], inputs["sfb_sm"] = (as_e8m0(sfa), as_e8m0(sfb)) if e8m0 else (sfa, sfb)
    if spec.fp4:
        inputs["a_fp8"], inputs["b_fp8"] = (formats.quantize_mxfp8(v)[0] for v in values)
    else:
        inputs["a_fp8"], inputs["b_fp8"] = a, b
    if ta is not None:
        inputs["alpha"] = (ta * tb).astype(jnp.float32)
    return inputs


def proj_rope_inputs(key: jax.Array, tokens: int, heads: int, k: int, w_out_in: bool = True
                     ) -> dict[str, jax.Array]:
    """One input set for a proj_rope case: x and w as MXFP8 and as the same values in bf16, cos, sin.

    w, w_scale and w_bf16 are (H*192, K) for w_out_in, else (K, H*192) (the same values); w_bf16_t is w_bf16 in
    the other layout; w_oi and w_scale_e8m0 are always (H*192, K) (the scaled_matmul pipeline's).
    `proj_rope_arguments` picks the arguments of one input path.
    """
    k_x, k_w, k_angle = jax.random.split(key, 3)
    x, x_scale = random_mxfp8(k_x, (tokens, k))
    w, w_scale = random_mxfp8(k_w, (heads * support.HEAD_DIM, k))
    angles = jax.random.uniform(k_angle, (tokens, support.QK_ROPE), jnp.float32, 0.0, 2 * np.pi)
    w_bf16 = reference.dequantize_bf16(w, w_scale, block=support.MX_BLOCK, axis=-1)
    w_oi, w_scale_oi = w, w_scale  # (H*192, K) in either case: what the scaled_matmul pipeline takes
    if not w_out_in:
        w, w_scale, w_bf16 = (jnp.asarray(a.T) for a in (w, w_scale, w_bf16))
    return {"x": x, "w": w, "x_scale": x_scale, "w_scale": w_scale, "w_oi": w_oi,
            "x_scale_e8m0": as_e8m0(x_scale), "w_scale_e8m0": as_e8m0(w_scale_oi),
            "x_bf16": reference.dequantize_bf16(x, x_scale, block=support.MX_BLOCK, axis=-1), "w_bf16": w_bf16,
            "w_bf16_t": jnp.asarray(w_bf16.T), "cos": jnp.cos(angles).astype(jnp.bfloat16),
            "sin": jnp.sin(angles).astype(jnp.bfloat16)}


def proj_rope_arguments(inputs: dict[str, jax.Array], mxfp8: bool) -> tuple[tuple, dict]:
    """(x, w, cos, sin) and the scale keywords of `gemm_proj_rope_mxfp8` for a `proj_rope_inputs` set: the MXFP8
    codes and scales, or (bf16 path) the same values in bf16."""
    if mxfp8:
        return ((inputs["x"], inputs["w"], inputs["cos"], inputs["sin"]),
                {"x_scale": inputs["x_scale"], "w_scale": inputs["w_scale"]})
    return (inputs["x_bf16"], inputs["w_bf16"], inputs["cos"], inputs["sin"]), {}
