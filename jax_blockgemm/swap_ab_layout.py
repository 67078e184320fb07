"""The token layout of the swap_ab kernels (kernels/sm90/ragged_swap_ab.py), which read bf16 tokens as their wgmma's
B operand in the order their threads hold the weights' codes: K padded with zeros to whole promotion groups, and the
columns of every k-tile permuted (one order for FP8 codes, another for packed FP4, whose bit model pairs codes i and
i + 4 of a word). The MoE tile and the 32- and 64-token decode tiles take the tokens permuted (for MXFP8 tokens the
pass that dequantizes them writes that order); the 16-token decode tile orders the columns itself, in shared memory,
and takes them as they are. Pure NumPy and jax.numpy, below everything that prepares those tokens (the ragged
lowering, the decode lowering in ffi_lowering, the dequantize kernel's oracle) and the kernel, which asks
`kernel_orders_tokens`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SWAP_AB_K_TILE = 128  # codes of K per k-tile of every swap_ab tile (128 bytes of an FP8 weight row, 64 of FP4): the
# span of the tokens' permutation (and of the dequantize kernel's). 64-code k-tiles paid the per-k-tile work (barriers,
# wgmma issues, scale bytes) twice per code (docs/design/decode.md and moe.md, *128-code k-tiles*).
SWAP_AB_K_PAD = 256  # its tokens' K is padded to a multiple of this (it adds partial sums every 256 of K)
# Tiles of at most this many tokens order the tokens' columns in the kernel: the 16-token decode tile, whose calls of
# 1 to 16 rows would otherwise pay a separate launch (XLA's gather, 1.5-2.4 us on the H200) and its gap. The 32- and
# 64-token tiles' producer warps, with 8 and 16 rows a k-tile to move, slowed their kernels (H100: 25.2 against about
# 19.7 us at 32 tokens, 31.4 against 24.6 at 64), so those take the tokens permuted (docs/design/decode.md).
KERNEL_ORDER_MAX_TOKENS = 16


def kernel_orders_tokens(tile_tokens: int) -> bool:
    """Whether the swap_ab object of a tile of `tile_tokens` tokens puts each k-tile's token columns in the
    fragments' order itself (its producer warps, in shared memory), so that it takes the tokens as they are."""
    return tile_tokens <= KERNEL_ORDER_MAX_TOKENS


def swap_ab_column_order(*, fp4: bool = False) -> np.ndarray:
    """For each column 16s + 8h + 2c + j of a k-tile (SWAP_AB_K_TILE codes), the column it takes from: the order in
    which the swap_ab kernel's threads hold the weights' codes in the wgmma A fragment. Thread c of a quad loads
    codes 32c .. 32c + 31 of a row; its slots of k-step s are k 2c, 2c + 1 (h = 0) and 2c + 8, 2c + 9 (h = 1). FP8
    codes pair as consecutive bytes, k-step s taking word s: column 32c + 4s + 2h + j. FP4 (`fp4`) codes i and i + 4
    of a word of eight pair up, k-step s taking pairs 2(s % 2) + h of word s // 2: column 32c + 8(s // 2) + 2(s % 2)
    + h + 4j."""
    col = np.arange(SWAP_AB_K_TILE)
    s, h, c, j = col // 16, (col // 8) % 2, (col // 2) % 4, col % 2
    lane = SWAP_AB_K_TILE // 4 * c  # the first of lane c's codes
    if fp4:
        return lane + 8 * (s // 2) + 2 * (s % 2) + h + 4 * j
    return lane + 4 * s + 2 * h + j


def swap_ab_columns(k: int, *, fp4: bool = False) -> np.ndarray:
    """For each of the K columns (a multiple of SWAP_AB_K_TILE) as the swap_ab kernel reads them, the column it
    takes from: `swap_ab_column_order` (of FP4 codes: `fp4`) within every k-tile."""
    tiles = np.arange(k // SWAP_AB_K_TILE)[:, None] * SWAP_AB_K_TILE
    return (tiles + swap_ab_column_order(fp4=fp4)[None, :]).reshape(-1).astype(np.int32)


def padded_tokens(x: jax.Array) -> jax.Array:
    """Tokens (..., T, K) with zeros past K up to a multiple of SWAP_AB_K_PAD (nothing to do where K is one)."""
    k = x.shape[-1]
    padded = -(-k // SWAP_AB_K_PAD) * SWAP_AB_K_PAD
    return x if padded == k else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - k)])


def kernel_tokens(x: jax.Array, *, fp4: bool, tile_tokens: int) -> jax.Array:
    """Tokens (..., T, K) as the swap_ab object of a tile of `tile_tokens` tokens takes them against `fp4` (or FP8)
    weights: padded, and permuted over its k-tiles (`swap_ab_tokens`) unless the kernel orders them itself
    (`kernel_orders_tokens`)."""
    return padded_tokens(x) if kernel_orders_tokens(tile_tokens) else swap_ab_tokens(x, fp4=fp4)


def swap_ab_tokens(x: jax.Array, *, fp4: bool = False) -> jax.Array:
    """Tokens (..., T, K) as the swap_ab kernel reads them (kernels/sm90/ragged_swap_ab.py) against FP8 (or, `fp4`,
    packed FP4) weights: zeros past K up to a multiple of SWAP_AB_K_PAD, and the columns of every k-tile in
    `swap_ab_column_order`, the order of the weights' codes in the kernel's registers (a dot product over K does not
    depend on the order of its terms). A gather with constant indices, which XLA fuses with the dequantization before
    it (H200: 0.26 ms for 16384 x 7168 tokens, where the same permutation as a reshape and transpose took 1.6 ms)."""
    x = padded_tokens(x)
    return jnp.take(x, jnp.asarray(swap_ab_columns(x.shape[-1], fp4=fp4)), axis=-1, unique_indices=True)
