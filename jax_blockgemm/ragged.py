"""Ragged (grouped) block-scaled GEMM with fused amax, the mixture-of-experts product: tokens sorted by group, each
group multiplied by its own expert's weights.

`ragged_gemm_amax` (api.py) validates and binds `ragged_p` (batching, and a lowering through the partitioning rules of
`sharding.py`); `ragged_local_p` is what one device runs. On CUDA it lowers to the grouped kernel where
`dispatch.ragged_kernels` names one (kernels/sm90/ragged.py, through the jbg_ragged_gemm_amax handler; its work items
come from `kernel_items` or `group_items`), else, and on every other platform, to the pure-JAX reference below.

The reference never builds a (G, T, K) or (G, T, N) mask, which is how `jax.lax.ragged_dot` lowers on CPU (and, by
measurement, on GPU): a dense dot over G masked copies of the tokens, G times the work and memory. Here the tokens
are cut into tiles of `tile` rows and a loop visits the (tile, group) pairs that hold rows of that group, CHUNK per
iteration: at most ceil(T / tile) + G - 1 products of (tile, K) x (K, N), each written into its own rows of C.
Work: T·K·N plus at most (G - 1)·tile·K·N multiply-adds; memory: C, the operands, and the weights dequantized to
bfloat16 once (exact), or, where the loop cannot visit as many items as there are weights (decode: a few tokens
routed over many experts, `weights_per_item`), dequantized per chunk of items: only the experts the tokens use.

Canonical operands (what the API binds): a (L, T, K) codes (packed FP4: uint8 (L, T, K/2)); b (L, G, N, K) likewise;
sfa (L, T, KB) and sfb (L, G, N, KB) compact scales (E8M0 bytes as uint8, or float8_e4m3fn for NVFP4); starts, ends
(L, G) int32: the rows [starts[g], ends[g]) of group g (from group_sizes, see `group_bounds`); alpha (L,) float32 when
given. Params: k, sf_vec_size, c_dtype (np.dtype), implementation, b_major, amax_used (False: the caller drops amax,
whose value is then unspecified). Results: c (L, T, N) (packed FP4: (L, T, N/2)) and amax (L,) float32.

bf16 operands (`grouped_dot`, mx_ragged_dot's bf16 recipe) take the same primitive with sf_vec_size 0: a and b in
bf16, b (L, G, N, K) for b_major "k" or (L, G, K, N) for "n" (the (G, K, N) weights of `jax.lax.ragged_dot`, read
without a transposed copy), and empty scales sfa (L, T, 0) and sfb (L, G, N, 0).

Tokens as values (`weight_only_ragged.matmul`, the weight-only ragged matmul): a (L, T, K) bf16 or float32, used as
given, sfa (L, T, 0) empty, with codes b and scales sfb as above (sf_vec_size > 0), and alpha (L,) or one per weight,
(L, G). `support.tokens_are_values` tells the modes apart.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import mlir

from jax_blockgemm import formats, primitives, reference, sharding, support
from jax_blockgemm.swap_ab_layout import SWAP_AB_K_PAD, kernel_orders_tokens, kernel_tokens

__all__ = ["ragged_p", "ragged_local_p", "check_call", "group_bounds", "grouped_rows_dot", "grouped_contraction",
           "grouped_dot", "ragged_reference", "check_group_sizes", "tile_rows", "weights_per_item", "kernel_items",
           "group_items", "max_kernel_items"]

ragged_p = jex_core.Primitive("jbg_ragged_gemm_amax")
ragged_local_p = jex_core.Primitive("jbg_ragged_gemm_amax_local")


# --------------------------------------------------------------------------------------------------------------
# Groups
# --------------------------------------------------------------------------------------------------------------


def check_group_sizes(group_sizes: Any, *, groups: int, tokens: int, name: str = "group_sizes") -> jax.Array:
    """group_sizes as int32 (G,): shape and dtype checked; negative sizes or a sum past T raise when concrete.

    Concrete sizes are checked on the values given, before any cast (jnp.asarray would wrap int64 sizes past int32).
    Traced sizes are not checked (they are only known on the device); `group_bounds` gives them a defined meaning.
    """
    gs = group_sizes
    if not isinstance(gs, jax.Array):  # NumPy arrays, lists: read as given
        try:
            gs = np.asarray(gs)
        except jax.errors.TracerArrayConversionError:  # a sequence holding traced sizes
            gs = jnp.asarray(gs)
        except ValueError:  # a ragged nesting
            gs = np.asarray(None)
    if gs.dtype == object:
        raise TypeError(f"{name} must be an integer array (int32) of shape (G,); got {type(group_sizes).__name__}.")
    if not jnp.issubdtype(gs.dtype, jnp.integer):
        raise TypeError(f"{name} has dtype {support.dtype_name(gs)}; allowed: an integer dtype (int32).")
    if tuple(gs.shape) != (groups,):
        raise ValueError(f"{name} must have shape (G,) = ({groups},), one size per group of the weights; got "
                         f"{tuple(gs.shape)}.")
    if not isinstance(gs, jax.core.Tracer):
        sizes = [int(v) for v in np.asarray(gs).tolist()]  # Python ints: the sum cannot overflow
        if min(sizes, default=0) < 0:
            raise ValueError(f"{name} must be non-negative; got {sizes}.")
        if sum(sizes) > tokens:
            raise ValueError(f"{name} sums to {sum(sizes)}, more than the {tokens} tokens (rows) of the "
                             "input; their sum must be at most T.")
    return jnp.asarray(gs).astype(jnp.int32)


def group_bounds(group_sizes: jax.Array, tokens: int) -> tuple[jax.Array, jax.Array]:
    """(starts, ends) int32 of each group's rows, groups laid out in order from row 0.

    The defined behaviour for traced sizes outside the contract: a negative size counts as 0, and rows past T are
    cut off (the group that crosses T keeps its rows below T, the groups after it are empty).
    """
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes, axis=-1), tokens)  # int32: T < 2**31 rows
    starts = jnp.concatenate([jnp.zeros_like(ends[..., :1]), ends[..., :-1]], axis=-1)
    return starts, ends


# Work items per iteration of the reference's loop: one batched dot of CHUNK (tile, K) x (K, N) products instead of
# one small dot (on the H200 at T = 16384, G = 32: 3.9 ms against 14.1 ms for one item per iteration, bf16). The
# group bounds pass an optimization barrier first: with concrete group sizes XLA's GPU compiler otherwise sinks them
# into the loop as constants and then fails to evaluate the loop ("Failed to evaluate instruction ... sunk.clone").
CHUNK = 8


def tile_rows(tokens: int, groups: int) -> int:
    """Rows per tile of the reference loop: about the mean group size, a power of two in [16, 256]."""
    mean = max(1, -(-tokens // max(groups, 1)))
    return int(min(256, max(16, 1 << (mean - 1).bit_length())))


def _work_items(starts: jax.Array, ends: jax.Array, tile: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The (tile, group) pairs holding rows of a group: (first tile per group, exclusive item offsets, count)."""
    first = starts // tile
    spans = jnp.where(ends > starts, (ends - 1) // tile - first + 1, 0)
    item_ends = jnp.cumsum(spans)
    return first, item_ends, item_ends[-1]


def _item_of(i: jax.Array, first: jax.Array, item_ends: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(group, tile) of work items i, numbered by `item_ends` (exclusive offsets per group), tile counted from the
    group's first tile `first`; i at or past the count gives the group past the last. A comparison against every
    group's offset: no loop, len(i) x G compares."""
    g = jnp.searchsorted(item_ends, i, side="right", method="compare_all").astype(jnp.int32)
    item_start = jnp.concatenate([jnp.zeros((1,), item_ends.dtype), item_ends])[g]  # exclusive offsets
    return g, first[jnp.minimum(g, first.shape[0] - 1)] + i - item_start


def _chunk_items(c: jax.Array, first: jax.Array, item_ends: jax.Array, total: jax.Array, tile: int, rows: jax.Array,
                 starts: jax.Array, ends: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Work items c·CHUNK .. c·CHUNK + CHUNK - 1: (group, first row, (CHUNK, tile) mask of the group's rows); an item
    past the count masks every row (it repeats the last one)."""
    i = c * CHUNK + jnp.arange(CHUNK, dtype=jnp.int32)
    valid = i < total
    g, tile_index = _item_of(jnp.minimum(i, total - 1), first, item_ends)
    row0 = tile_index * tile
    r = row0[:, None] + rows[None, :]
    mine = (r >= starts[g][:, None]) & (r < ends[g][:, None]) & valid[:, None]
    return g, row0, mine


def _parts(starts: jax.Array, ends: jax.Array, tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(starts, ends, group) of the G groups with the rows of no group around them as pseudo-groups -1: the rows
    before the first group ([0, starts[0]): a shard of the experts holds groups from its own first one) and those
    past the last ([ends[-1], tokens)). Every row then belongs to one part, so the kernels write all of C."""
    zero = jnp.zeros((1,), starts.dtype)
    s_all = jnp.concatenate([zero, starts, ends[-1:]])
    e_all = jnp.concatenate([starts[:1], ends, jnp.full((1,), tokens, ends.dtype)])
    group = jnp.concatenate([-jnp.ones((1,), jnp.int32), jnp.arange(starts.shape[0], dtype=jnp.int32),
                             -jnp.ones((1,), jnp.int32)])
    return s_all, e_all, group


def kernel_items(starts: jax.Array, ends: jax.Array, tokens: int, rows: int = 128) -> jax.Array:
    """The block-scaled grouped kernels' work items, on the grid of `rows`-row tiles (their token scale atoms follow
    it): int32 (max_items, 4) rows (row tile, group, first row, end row).

    One item per (tile, part) pair holding rows of that part (`_parts`: the groups in order, the rows of no group
    before and after them as group -1); then padding items with first == end (nothing to do). At most
    `max_kernel_items(tokens, G)` items: each part boundary inside a tile adds one to the tiles of the grid.
    """
    bound = max_kernel_items(tokens, starts.shape[0], rows)
    s_all, e_all, group = _parts(starts, ends, tokens)
    first, item_ends, total = _work_items(s_all, e_all, rows)
    i = jnp.arange(bound, dtype=jnp.int32)
    part, tile = _item_of(i, first, item_ends)
    part = jnp.minimum(part, s_all.shape[0] - 1)  # padding items: the last part, masked below
    lo = jnp.maximum(s_all[part], tile * rows)
    hi = jnp.minimum(e_all[part], tile * rows + rows)
    valid = i < total
    zero = jnp.zeros_like(i)
    return jnp.stack([jnp.where(valid, tile, zero), group[part], jnp.where(valid, lo, zero),
                      jnp.where(valid, hi, zero)], axis=-1).astype(jnp.int32)


def group_items(starts: jax.Array, ends: jax.Array, tokens: int, rows: int = 128) -> jax.Array:
    """The group-local work items of the kernels whose tokens carry no scale atoms (the bf16 grouped and swap_ab
    kernels): int32 (max_items, 4) rows (0, group, first row, end row).

    Each part's rows (`_parts`: the groups in order, the rows of no group before and after them as group -1) cut
    into tiles of `rows` from the part's own first row; then padding items with first == end. A group boundary
    inside a tile of the grid costs no second item here, only a part's last tile may be short: about G/2 fewer items
    than `kernel_items` gives for sizes that are no multiple of `rows`, and never more (`max_kernel_items` bounds
    both)."""
    bound = max_kernel_items(tokens, starts.shape[0], rows)
    s_all, e_all, group = _parts(starts, ends, tokens)
    item_ends = jnp.cumsum(jnp.maximum(-(-(e_all - s_all) // rows), 0))
    i = jnp.arange(bound, dtype=jnp.int32)
    part, tile = _item_of(i, jnp.zeros_like(s_all), item_ends)  # tile: the item's index within its part
    part = jnp.minimum(part, s_all.shape[0] - 1)  # padding items: the last part, masked below
    lo = s_all[part] + tile * rows
    hi = jnp.minimum(lo + rows, e_all[part])
    valid = i < item_ends[-1]
    zero = jnp.zeros_like(i)
    return jnp.stack([zero, group[part], jnp.where(valid, lo, zero), jnp.where(valid, hi, zero)],
                     axis=-1).astype(jnp.int32)


def max_kernel_items(tokens: int, groups: int, rows: int = 128) -> int:
    """The static bound on the count of `kernel_items` and of `group_items`: the tiles of the grid plus one per
    boundary between parts that hold rows (inside a tile or not; for `group_items`, each part's short last tile).
    Of the G + 2 parts at most T hold a row, so a few tokens over many experts (decode) launch a grid of a few items,
    not one of G mostly empty ones."""
    return -(-tokens // rows) + min(tokens, groups + 2) - 1


def _chunk_loop(body: Callable[[jax.Array, jax.Array], jax.Array], total: jax.Array, zeros: jax.Array) -> jax.Array:
    """`body` over the chunks of `total` work items from `zeros`. The first chunk runs before the loop: its result,
    unlike a constant, varies over the mesh axes the operands vary over inside a shard_map, which the loop's carry
    must match; a chunk past the items changes nothing, so `total` = 0 is still the zeros."""
    return jax.lax.fori_loop(1, -(-total // CHUNK), body, body(jnp.int32(0), zeros))


def grouped_rows_dot(x: jax.Array, w: jax.Array | Callable[[jax.Array], jax.Array], starts: jax.Array,
                     ends: jax.Array, tile: Optional[int] = None) -> jax.Array:
    """out[t] = x[t] · w[g]ᵀ for the rows t of group g, 0 on rows of no group: x (T, K), w (G, N, K) -> (T, N) float32.

    w may also be a function giving the (len(g), N, K) weights of an int32 vector of groups g, called once per CHUNK
    work items: the reference's way to dequantize only the experts its items use (`weights_per_item`). Operands in
    bfloat16 (or what they are; float32 ones at full float32 precision, never TF32), float32 accumulation; memory
    O(T·N) plus CHUNK tiles and weights, see the module docstring.
    """
    t, k = x.shape
    g_count = starts.shape[0]
    weights_of = w if callable(w) else (lambda g: w[g])
    n = jax.eval_shape(weights_of, jax.ShapeDtypeStruct((CHUNK,), jnp.int32)).shape[1]
    precision = jax.lax.Precision.HIGHEST if np.dtype(x.dtype) == np.dtype(jnp.float32) else None
    tile = tile or tile_rows(t, g_count)
    padded = -(-t // tile) * tile
    x = jnp.pad(x, ((0, padded - t), (0, 0)))
    starts, ends = jax.lax.optimization_barrier((starts, ends))  # see CHUNK
    first, item_ends, total = _work_items(starts, ends, tile)
    rows = jnp.arange(tile, dtype=jnp.int32)

    def body(c, out):
        g, row0, mine = _chunk_items(c, first, item_ends, total, tile, rows, starts, ends)
        xs = jax.vmap(lambda r: jax.lax.dynamic_slice_in_dim(x, r, tile))(row0)  # (CHUNK, tile, K)
        prod = jnp.einsum("ctk,cnk->ctn", xs, weights_of(g), preferred_element_type=jnp.float32,
                          precision=precision)
        for j in range(CHUNK):  # two items of a chunk may share a tile (a group boundary inside it): in order
            current = jax.lax.dynamic_slice_in_dim(out, row0[j], tile)
            out = jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine[j][:, None], prod[j], current), row0[j], 0)
        return out

    out = _chunk_loop(body, total, jnp.zeros((padded, n), jnp.float32))
    return out[:t]


def weights_per_item(tokens: int, groups: int) -> bool:
    """Whether `grouped_rows_dot` should have its weights made per chunk of work items rather than all G at once:
    where its loop can visit fewer weights than G whatever the group sizes (decode: a few tokens routed over many
    experts). Each item holds at least one row of one group, so the items number at most min(T, G) plus the tile
    boundaries, and the last chunk is filled up to CHUNK."""
    tile = tile_rows(tokens, groups)
    most_items = min(tokens, groups) + -(-tokens // tile) - 1
    return -(-most_items // CHUNK) * CHUNK < groups


def grouped_contraction(x: jax.Array, y: jax.Array, starts: jax.Array, ends: jax.Array,
                        tile: Optional[int] = None) -> jax.Array:
    """out[g] = x_gᵀ · y_g over the rows of group g: x (T, K), y (T, N) -> (G, K, N) float32 (0 for an empty group).

    The weight gradient of a ragged product; the same chunked tile loop as `grouped_rows_dot`, memory O(G·K·N).
    """
    t, k = x.shape
    n = y.shape[1]
    g_count = starts.shape[0]
    tile = tile or tile_rows(t, g_count)
    padded = -(-t // tile) * tile
    x = jnp.pad(x, ((0, padded - t), (0, 0)))
    y = jnp.pad(y, ((0, padded - t), (0, 0)))
    starts, ends = jax.lax.optimization_barrier((starts, ends))  # see CHUNK
    first, item_ends, total = _work_items(starts, ends, tile)
    rows = jnp.arange(tile, dtype=jnp.int32)

    def body(c, out):
        g, row0, mine = _chunk_items(c, first, item_ends, total, tile, rows, starts, ends)
        take = lambda v: jax.vmap(lambda r: jax.lax.dynamic_slice_in_dim(v, r, tile))(row0)  # (CHUNK, tile, ·)
        xs = jnp.where(mine[..., None], take(x), 0)  # select: a NaN outside the group stays out
        ys = jnp.where(mine[..., None], take(y), 0)
        prod = jnp.einsum("ctk,ctn->ckn", xs, ys, preferred_element_type=jnp.float32)
        return out.at[g].add(prod)  # items of one group in one chunk add up

    return _chunk_loop(body, total, jnp.zeros((g_count, k, n), jnp.float32))


# --------------------------------------------------------------------------------------------------------------
# Validation and the canonical form
# --------------------------------------------------------------------------------------------------------------


def _compact_scales(name: str, s: jax.Array, *, l: int, mn: int, kb: int, batched: bool) -> jax.Array:
    """Any scale form gemm_amax accepts -> compact ((L,) MN, KB), E8M0 as uint8 bytes."""
    if s.dtype in (jnp.float8_e8m0fnu, jnp.int8):
        s = jax.lax.bitcast_convert_type(s, jnp.uint8)
    form = support.scale_form(name, s, l=l, mn=mn, kb=kb, batched=batched)
    if form == "compact":
        return s
    atom = formats.seed_view_to_atom(s) if form == "seed" else s
    compact = formats.from_scale_atom(atom, mn, kb)  # (L, MN, KB)
    return compact if batched else compact[0]


def check_call(a: Any, b: Any, sfa: Any, sfb: Any, group_sizes: Any, *, alpha: Any, c_dtype: Any, sf_vec_size: int,
               implementation: Any) -> tuple[list, dict]:
    """Trace-time checks of a ragged_gemm_amax call; returns (canonical operands, params)."""
    support.check_implementation(implementation)
    for name, x in (("a", a), ("b", b), ("sfa", sfa), ("sfb", sfb)):
        support.check_array(name, x)
    support.check_rank("a", a, (2,), "(T, K) tokens sorted by group")
    support.check_rank("b", b, (3,), "(G, N, K): one (N, K) weight per group")
    if a.shape[0] < 1:
        raise ValueError(f"a has shape {tuple(a.shape)}: T, the token count, must be at least 1.")
    if b.shape[0] < 1:
        raise ValueError(f"b has shape {tuple(b.shape)}: G, the group (expert) count, must be at least 1.")
    _, t, n, k = support.check_gemm_operands(a[None], b[:1], a_major="k", b_major="k", shapes=(a.shape, b.shape))
    g = b.shape[0]
    if sfa.dtype != sfb.dtype:
        raise TypeError(f"sfa and sfb must have the same dtype; got sfa: {support.dtype_name(sfa)}, "
                        f"sfb: {support.dtype_name(sfb)}.")
    support.check_gemm_config(ab_dtype=a.dtype, scale_dtype=sfa.dtype, c_dtype=c_dtype, c_major="n",
                              acc_dtype=jnp.float32, mma_tiler_mn=(128, 128), cluster_shape_mn=(1, 1),
                              sf_vec_size=sf_vec_size, k=k, has_alpha=alpha is not None)
    support.check_alignment(ab_dtype=a.dtype, c_dtype=c_dtype, m=t, n=n, k=k, a_major="k", b_major="k", c_major="n")
    kb = support.ceil_div(k, sf_vec_size)
    sfa = _compact_scales("sfa", sfa, l=1, mn=t, kb=kb, batched=False)
    sfb = _compact_scales("sfb", sfb, l=g, mn=n, kb=kb, batched=True)
    gs = check_group_sizes(group_sizes, groups=g, tokens=t)
    if a.dtype == jnp.float4_e2m1fn:
        a, b = formats.pack_fp4(a), formats.pack_fp4(b)
    starts, ends = group_bounds(gs, t)
    operands = [a[None], b[None], sfa[None], sfb[None], starts[None], ends[None]]
    if alpha is not None:
        operands.append(support.check_alpha(alpha).reshape(1))
    c_dtype = np.dtype(jnp.float4_e2m1fn) if support.is_fp4(c_dtype) else np.dtype(c_dtype)
    return operands, dict(k=k, sf_vec_size=sf_vec_size, c_dtype=c_dtype, implementation=implementation, b_major="k",
                          amax_used=True)


def grouped_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, w_major: str, c_dtype: Any = jnp.float32,
                implementation: Any = None) -> tuple[jax.Array, jax.Array]:
    """(out, amax): out[t] = x[t] · w[g]ᵀ for the rows t of group g, 0 on rows of no group, in bf16 with float32
    accumulation, and max|out| as float32: x (T, K), w (G, N, K) for w_major "k" or (G, K, N) for "n", group_sizes
    int32 (G,) (checked by the caller) -> (T, N) in c_dtype (float32 or bfloat16). Through `ragged_p`: the bf16
    grouped kernel where it runs (one launch, no transposed copy of an N-major w), else the reference's chunked loop;
    vmap, sharding as ragged_gemm_amax."""
    support.check_implementation(implementation)
    t, k = x.shape
    g = w.shape[0]
    n = w.shape[1] if w_major == "k" else w.shape[2]
    starts, ends = group_bounds(group_sizes, t)
    operands = [x.astype(jnp.bfloat16)[None], w.astype(jnp.bfloat16)[None], jnp.zeros((1, t, 0), jnp.uint8),
                jnp.zeros((1, g, n, 0), jnp.uint8), starts[None], ends[None]]
    c, amax = ragged_p.bind(*operands, k=k, sf_vec_size=0, c_dtype=np.dtype(c_dtype), implementation=implementation,
                            b_major=w_major, amax_used=True)
    return c[0], amax[0]


# --------------------------------------------------------------------------------------------------------------
# The reference
# --------------------------------------------------------------------------------------------------------------


def row_factors(alpha: jax.Array, starts: jax.Array, ends: jax.Array, tokens: int) -> jax.Array:
    """(T,) the factor of each row: alpha[g] on the rows of group g, 1 on rows of no group (the bounds are sorted:
    the group of a row is the first whose end lies past it)."""
    rows = jnp.arange(tokens, dtype=starts.dtype)
    g = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), alpha.shape[0] - 1)
    return jnp.where((rows >= starts[g]) & (rows < ends[g]), alpha[g], 1.0)


def ragged_reference(a, b, sfa, sfb, starts, ends, *maybe_alpha, k: int, sf_vec_size: int, c_dtype: Any,
                     b_major: str = "k", **_: Any) -> tuple[jax.Array, jax.Array]:
    """The canonical call: both operands dequantized to bfloat16 (exact in the normal range, as gemm_amax's
    reference; bf16 operands, and tokens that are values, as they are; the weights per work item where that is fewer
    of them, `weights_per_item`), `grouped_rows_dot` with float32
    accumulation, alpha (per batch, or per group on its rows), then amax of the float32 accumulator (rows of no group
    are 0; a NaN in a group's rows makes it NaN) and the conversion to c_dtype."""
    values = support.tokens_are_values(a.dtype, sf_vec_size)

    def one(a, b, sfa, sfb, starts, ends, *alpha):
        if sf_vec_size == 0:  # bf16 operands
            a16, b16 = a, (b if b_major == "k" else jnp.swapaxes(b, 1, 2)).astype(a.dtype)
        else:
            dequantized = lambda codes, s: reference.dequantize_bf16(formats.unpacked_codes(codes, k), s,
                                                                     block=sf_vec_size, axis=codes.ndim - 1)
            a16 = a if values else dequantized(a, sfa)
            if weights_per_item(a.shape[0], b.shape[0]):  # only the experts the items use
                b16 = lambda g: dequantized(b[g], sfb[g]).astype(a16.dtype)
            else:
                b16 = dequantized(b, sfb).astype(a16.dtype)
        acc = grouped_rows_dot(a16, b16, starts, ends)
        if alpha and alpha[0].ndim == 1:  # one factor per group
            acc = acc * row_factors(alpha[0], starts, ends, acc.shape[0])[:, None]
        elif alpha:
            acc = acc * alpha[0]
        return reference.convert_c(acc, c_dtype), formats.magnitude_max(acc, axis=None)

    return jax.vmap(one)(a, b, sfa, sfb, starts, ends, *maybe_alpha)


# --------------------------------------------------------------------------------------------------------------
# Primitive rules
# --------------------------------------------------------------------------------------------------------------


def _abstract_eval(a, b, *_, c_dtype, b_major, **__):
    l, t = a.shape[:2]
    n = b.shape[2] if b_major == "k" else b.shape[3]
    fp4 = support.is_fp4(c_dtype)
    c = jax.core.ShapedArray((l, t, n // 2 if fp4 else n), np.dtype(jnp.uint8) if fp4 else np.dtype(c_dtype))
    return c, jax.core.ShapedArray((l,), np.float32)


def _reference_lowering(ctx, *args, **params):
    primitives.no_kernel_off_cuda(ctx, "ragged_gemm_amax", params["implementation"])
    return mlir.lower_fun(functools.partial(ragged_reference, **params), multiple_results=True)(ctx, *args)


def _kernel_operands(a, sfa, sfb, starts, ends, *, tokens: int, sf_vec_size: int, swap_ab: bool,
                     group_local: bool, fp4: bool = False, tokens_ready: bool = False, tile_tokens: int = 0) -> list:
    """What the grouped kernel reads besides the weights' codes: a (the codes, or for `swap_ab` kernels the tokens
    dequantized to bf16 (tokens that are values: as given) as its tile of `tile_tokens` takes them,
    `swap_ab_layout.kernel_tokens`, in the FP4 order for FP4 weights (`fp4`), with empty token scales;
    `tokens_ready`: a is that already, the dequantize kernel's output),
    both scales in the SPEC §3 atom layout (sfb over L·G batches; the swap_ab kernels read sfb compact, (L·G, N,
    KB); bf16 operands' empty scales as they are) and the work items of each batch (`group_items` for kernels that
    start a tile at any row, `group_local`; else `kernel_items`, on the 128-row grid of the tokens' scale atoms)."""
    l, g, n, kb = sfb.shape
    table = group_items if group_local else kernel_items
    items = jax.vmap(lambda s, e: table(s, e, tokens))(starts, ends)
    if kb == 0:
        return [a, sfa, sfb, items]
    sfb = sfb.reshape(l * g, n, kb)
    if swap_ab:
        if not tokens_ready:  # else the dequantize kernel's output, bf16 in the kernel's order already
            if not support.tokens_are_values(a.dtype, sf_vec_size):  # codes (packed FP4: K = 2 x their row)
                a = reference.dequantize_bf16(formats.unpacked_codes(a, 2 * a.shape[-1]), sfa, block=sf_vec_size,
                                              axis=2)
            a = kernel_tokens(a.astype(jnp.bfloat16), fp4=fp4, tile_tokens=tile_tokens)
        return [a, jnp.zeros((l, 0), jnp.uint8), sfb, items]
    return [a, formats.to_scale_atom(sfa), formats.to_scale_atom(sfb), items]


def _kernel_lowering(ctx, a, b, sfa, sfb, starts, ends, *maybe_alpha, variants, sf_vec_size, amax_used, **_):
    """The call through the grouped kernel `variants` (jbg_ragged_gemm_amax): scales to atoms and the item table in XLA
    (a few fusions, no host synchronization), then one launch; alpha is the call's (for swap_ab kernels one per weight),
    else ones; amax_used=False (a caller that drops amax): nothing zeroes or folds amax. For swap_ab kernels
    the tokens become bf16 as the tile takes them (`swap_ab_layout.kernel_tokens`: in the fragments' column order,
    but as they are for the 16-token tile, which orders them itself): by the dequantize kernel where they are MXFP8
    E4M3 codes, K needs no padding and one applies (`dispatch.dequantize_variants`, `swap_ab_order` but for the
    16-token tile; one pass at memory speed), else in XLA."""
    from jax_blockgemm import dispatch, ffi_lowering

    a_aval, b_aval, sfa_aval, sfb_aval, starts_aval, ends_aval = ctx.avals_in[:6]
    l, t = a_aval.shape[:2]
    swap_ab = getattr(variants[0], "schedule", "") == ffi_lowering.SWAP_AB
    tables = {ffi_lowering.takes_group_items(v) for v in variants}
    if len(tables) != 1:  # one call passes one table to every object it carries
        raise ValueError(f"ragged kernels that read different item tables in one call: {[v.key for v in variants]}")
    token_kernels = ()
    tile_tokens = variants[0].tile_mn[0]
    if swap_ab and a_aval.shape[-1] % SWAP_AB_K_PAD == 0 and np.dtype(a_aval.dtype) == np.dtype(jnp.float8_e4m3fn):
        token_kernels = dispatch.dequantize_variants({v.arch for v in variants}, a_aval.shape, scale_axis=-1,
                                                     swap_ab_order=not kernel_orders_tokens(tile_tokens))
    if token_kernels:
        (a,) = ffi_lowering.emit_dequantize(ctx, [(a, sfa)], avals=[(a_aval, sfa_aval)], variants=token_kernels,
                                            scale_axis=-1)
        a_aval = a_aval.update(dtype=np.dtype(jnp.bfloat16))
    prepare = functools.partial(_kernel_operands, tokens=t, sf_vec_size=sf_vec_size, swap_ab=swap_ab,
                                group_local=tables.pop(), fp4=variants[0].ab_dtype == "float4_e2m1fn",
                                tokens_ready=bool(token_kernels), tile_tokens=tile_tokens)
    in_avals = [a_aval, sfa_aval, sfb_aval, starts_aval, ends_aval]
    out_avals = [jax.core.ShapedArray(o.shape, o.dtype) for o in jax.eval_shape(prepare, *in_avals)]
    a_in, sfa_in, sfb_in, items = mlir.lower_fun(prepare, multiple_results=True)(
        ctx.replace(avals_in=in_avals, avals_out=out_avals), a, sfa, sfb, starts, ends)
    g = b_aval.shape[1]
    alpha_shape = (l * g,) if swap_ab else (l,)  # the swap_ab objects take one factor per weight
    alpha_aval = jax.core.ShapedArray(alpha_shape, np.dtype(np.float32))
    if not maybe_alpha:
        alpha = mlir.ir_constant(np.ones(alpha_shape, np.float32))
    elif swap_ab:  # (L,) per batch or (L, G) per weight -> (L·G,)
        given = ctx.avals_in[6]
        per_weight = lambda x: [jnp.broadcast_to(x.reshape(l, -1), (l, g)).reshape(l * g)]
        (alpha,) = mlir.lower_fun(per_weight, multiple_results=True)(
            ctx.replace(avals_in=[given], avals_out=[alpha_aval]), maybe_alpha[0])
    else:
        alpha = maybe_alpha[0]
    return ffi_lowering.emit_ragged(
        ctx.replace(avals_in=[out_avals[0], b_aval, *out_avals[1:], alpha_aval]), a_in, b, sfa_in, sfb_in, items,
        alpha, variants=variants, amax_used=amax_used)


primitives.register(ragged_p, ragged_local_p, abstract_eval=_abstract_eval,
                    reference_lowering=_reference_lowering,
                    cuda_lowering=primitives.kernel_or_reference("ragged_gemm_amax", "ragged_kernels",
                                                                 _kernel_lowering, _reference_lowering),
                    batch_rule=primitives.fold_into_l_batch_rule(ragged_p), partitioned=sharding.RAGGED.partitioned)
