"""Partitioning rules of the primitives: under jax.jit each device runs the op on its own shard.

`primitives.py` splits each operation into an outer primitive (what the API binds: batching and partitioning) and a
local primitive (abstract eval and the per-platform lowerings: kernel on CUDA, reference elsewhere). The outer
primitive lowers through `jax.experimental.custom_partitioning` built here, so XLA's partitioner (Shardy by
default, GSPMD where `jax_use_shardy_partitioner` is off) hands every device its shard instead of gathering the
operands around an opaque custom call. Each primitive's rules are one `OpRules` value (which shardings its plan
keeps, the program each device runs, GSPMD's propagation, Shardy's rule), whose `partitioned(local)` the primitive
registers. What runs natively and what is gathered (see README "On many GPUs"):

gemm_amax, canonical operands a (L, M, K) / (L, K, M), b (L, N, K) / (L, K, N), scales as atoms
(L, MN', K', 32, 4, 4) or compact (L, MN, KB):
  * L, M and N shard on any mesh axes, also together. Scales shard with their operand's MN. Atoms split cleanly
    only on 128-row boundaries: M (N) stays sharded when each shard holds a multiple of 128 rows and is gathered
    otherwise. Compact scales split on any row (the local op makes each device's atoms), so M (N) stays sharded
    wherever each shard keeps the operands' 16-byte alignment (`_row_quantum`). C follows the operands
    (c_major="m" and MN-major operands included); amax (L,) is sharded like L and is the NaN-safe max over the M
    and N shards (one all-reduce of L floats).
  * K shards natively on mesh axes that L, M and N leave free when every shard holds whole K scale atoms (a
    multiple of 4·sf_vec_size elements) and C is a float dtype: each device multiplies its K slice into a float32
    partial C, the partials are summed over the K shards (one all-reduce of the fp32 C), then amax is taken on the
    sum and C converted. This is what training needs: wgrad contracts over the data-sharded tokens and a
    row-parallel layer over its tensor-parallel features, and gathering there would make every device compute the
    whole product. The sum's order differs from the unsharded call (float32 sums, SPEC §7's class, not bitwise).
    Any other K split is gathered (bitwise equal to the unsharded call), as is K when its axes are taken (FSDP's
    weight gather: the weight's K is sharded on the axis that also shards the activations' rows).
gemm_proj_rope_mxfp8, canonical operands x (G, T, K), w (G, N, K) / (G, K, N), cos/sin (G, T, 64), scales like
their codes:
  * G, tokens T (each shard a multiple of 32 tokens: the columnwise blocks) and heads (N on 192-feature
    boundaries: H divisible by the shard count) shard natively; outputs follow. K and any other split gather.

weight_only_matmul, canonical operands x (L, M, K), codes (L, N, K or K/2), scales (L, N, K/block), alpha (L,):
  * L, the rows M of x and the weight's rows N shard natively on any mesh axes; the weight is never gathered.
  * K shards in whole scale blocks per shard: each device multiplies its slice of x by its slice of the weight,
    and the fp32 partial products are summed over the K shards (one all-reduce of L·M·N floats, small in decode,
    where the weight is the large operand), then alpha and the conversion to out_dtype follow. The summation order
    differs from the unsharded call (fp32 sums, still SPEC §7's exact class). Another K split gathers K.

Limits: jax.export cannot serialize these rules (Python callbacks), so an exported program carries the local op
unpartitioned (see primitives._partitioned_lowering). Under Shardy, a dimension is tied to its coarse twin (M to
the atoms' M', T to out_scales_col's T/32) only when the coarse count is a multiple of the mesh's device count
(`_linkable`); otherwise the op still runs per shard, but proj_rope's small out_scales_col is gathered after it.
The rules read NamedShardings (a mesh); shardings on Shardy sub-axes cannot be decoded by custom_partitioning.
Scale atoms reshaped from compact scales sharded finer than an atom would be sharded on sub-axes (IndivisibleError),
which is why gemm_amax keeps compact scales compact up to the local op.
Inside a shard_map that leaves some mesh axes automatic, JAX gives the rules no mesh, so they gather (correct,
not per shard): make every axis manual there, or call the op outside the shard_map.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_blockgemm import formats, reference
from jax_blockgemm.support import HEAD_DIM, MX_BLOCK, element_bits, is_fp4

ATOM_ROWS = 128  # rows of one 128x4 scale atom: the finest split of M (N) that keeps a shard's scales whole
ATOM_SCALES = 4  # scale columns of one atom: K splits in multiples of 4 blocks

Axes = tuple[str, ...]
Params = tuple[tuple[str, Any], ...]  # the primitive's params, frozen so that custom_partitioning can hold them


def freeze_params(params: dict) -> Params:
    """Params as a hashable tuple, the static argument of the partitioned call."""
    return tuple(sorted(params.items()))


def _dim_axes(sharding: Any, dim: int) -> Axes:
    """The mesh axes that shard dimension `dim` of an operand (none for a replicated or unknown sharding)."""
    if not isinstance(sharding, NamedSharding) or dim >= len(sharding.spec):
        return ()
    entry = sharding.spec[dim]
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _shard_count(mesh: Any, axes: Axes) -> int:
    """How many shards `axes` cut a dimension into."""
    return math.prod(mesh.shape[a] for a in axes)


def _keep(mesh: Any, axes: Axes, size: int, quantum: int, taken: Axes) -> Axes:
    """`axes` if they split `size` into whole multiples of `quantum` and are not used by another dimension, else ()."""
    if not axes or set(axes) & set(taken):
        return ()
    return axes if size % (quantum * _shard_count(mesh, axes)) == 0 else ()


def _spec(*dims: Axes) -> P:
    """A PartitionSpec from per-dimension axes (() replicated, one axis by name, several as a tuple)."""
    return P(*(None if not d else d[0] if len(d) == 1 else d for d in dims))


def _global_amax(amax: jax.Array, axes: Axes) -> jax.Array:
    """Max over the shards of `axes`, NaN-safe: a pmax of the magnitude bits (NaN > inf > finite)."""
    if not axes:
        return amax
    return jax.lax.bitcast_convert_type(jax.lax.pmax(formats.magnitude_bits(amax), axes), jnp.float32)


def _shape(t: Any) -> tuple[int, ...]:
    """The static shape of an MLIR tensor type (what a Shardy rule callback receives)."""
    return tuple(t.shape)


def _linkable(size: int, quantum: int, mesh: Any) -> bool:
    """Whether a Shardy rule may write a dimension as (coarse, quantum), linking it to a coarser twin (M to the
    scale atoms' M', T to the columnwise scales' T/32): whole quanta, more than one, and a coarse size that every
    product of mesh axes divides (otherwise Shardy splits a mesh axis into sub-axes, which custom_partitioning
    cannot turn into a PartitionSpec). An unlinked twin is still sharded by the partition callback; Shardy just
    does not propagate between the two."""
    coarse, rest = divmod(size, quantum)
    return rest == 0 and coarse > 1 and coarse % max(mesh.size, 1) == 0


def _fine(name: str, linked: bool, quantum: int, sizes: dict) -> str:
    """The rule term of a dimension: `(name_t name_i)` when linked to its coarse twin, else the plain `name`."""
    if not linked:
        return name
    sizes[f"{name}_i"] = quantum
    return f"({name}_t {name}_i)"


def _coarse(name: str, linked: bool) -> str:
    """The rule term of the coarse twin: `name_t` when linked, an independent factor otherwise."""
    return f"{name}_t" if linked else f"{name}_c"


def _named(mesh: Any, specs: Sequence[P]) -> tuple[NamedSharding, ...]:
    """The specs on `mesh`, as custom_partitioning's callbacks must return them."""
    return tuple(NamedSharding(mesh, s) for s in specs)


def _c_and_amax_by_l(params: dict, result_shape: Any) -> tuple[NamedSharding, NamedSharding]:
    """propagate for ops returning (C, amax (L,)): a user's sharding of C is kept, amax follows C's L."""
    c = result_shape[0].sharding
    return c, NamedSharding(c.mesh, _spec(_dim_axes(c, 0)))


def _shard_first_row(starts: jax.Array, ends: jax.Array, rows: int, axes: Axes) -> tuple[jax.Array, jax.Array]:
    """Group bounds of a token-sharded op on this shard's `rows` rows: moved to the shard's first row and clipped to
    its rows (a group outside the shard becomes empty)."""
    first = jax.lax.axis_index(axes if len(axes) > 1 else axes[0]) * rows
    return (jnp.clip(starts - first, 0, rows).astype(starts.dtype),
            jnp.clip(ends - first, 0, rows).astype(ends.dtype))


class Plan(Protocol):
    """The mesh axes one call runs sharded on, per logical dimension, as the specs of its operands and results."""

    def operand_specs(self, params: dict, shapes: Sequence[Any]) -> tuple[P, ...]: ...

    def result_specs(self, params: dict) -> tuple[P, ...]: ...


@dataclasses.dataclass(frozen=True)
class OpRules:
    """How one primitive partitions: `plan(params, mesh, operand shapes)` keeps what it can of the operands'
    shardings, `per_shard(local, params, plan, mesh)` is the program each device runs on its shards (the local op
    and any cross-shard reduction), `propagate(params, result shapes)` answers GSPMD's question of a user's result
    sharding and `rule(params, mesh, operand types)` is Shardy's sharding rule (string, factor sizes)."""

    plan: Callable[[dict, Any, Sequence[Any]], Plan]
    per_shard: Callable[[Callable, dict, Any, Any], Callable]
    propagate: Callable[[dict, Any], tuple]
    rule: Callable[[dict, Any, Any], tuple[str, dict]]

    def partition(self, local: Callable, params: Params, mesh: Any, arg_shapes: Any, result_shape: Any) -> tuple:
        """custom_partitioning's partition: the plan's shardings and the per-shard program."""
        p = dict(params)
        plan = self.plan(p, mesh, arg_shapes)
        return (mesh, self.per_shard(local, p, plan, mesh), _named(mesh, plan.result_specs(p)),
                _named(mesh, plan.operand_specs(p, arg_shapes)))

    def infer(self, params: Params, mesh: Any, arg_shapes: Any, result_shape: Any) -> tuple[NamedSharding, ...]:
        """GSPMD: the result shardings the plan gives these operands."""
        p = dict(params)
        return _named(mesh, self.plan(p, mesh, arg_shapes).result_specs(p))

    def partitioned(self, local: Callable[..., Sequence[jax.Array]]) -> custom_partitioning:
        """custom_partitioning around `local(*operands, **params)`: call it as `(freeze_params(params), *operands)`."""

        def call(params: Params, *operands):
            return tuple(local(*operands, **dict(params)))

        partitioned = custom_partitioning(call, static_argnums=(0,))
        partitioned.def_partition(
            partition=functools.partial(self.partition, local), infer_sharding_from_operands=self.infer,
            propagate_user_sharding=lambda params, mesh, result_shape: self.propagate(dict(params), result_shape),
            sharding_rule=lambda params, mesh, operand_types, result_types: self.rule(dict(params), mesh,
                                                                                     operand_types))
        return partitioned


# --------------------------------------------------------------------------------------------------------------
# gemm_amax
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """Mesh axes each logical dimension of one gemm_amax call runs sharded on (K: partial sums reduced over k)."""

    l: Axes
    m: Axes
    n: Axes
    k: Axes = ()

    def operand_specs(self, params: dict, shapes: Sequence[Any]) -> tuple[P, ...]:
        a = _spec(self.l, self.m, self.k) if params["a_major"] == "k" else _spec(self.l, self.k, self.m)
        b = _spec(self.l, self.n, self.k) if params["b_major"] == "k" else _spec(self.l, self.k, self.n)
        specs = (a, b, _spec(self.l, self.m, self.k), _spec(self.l, self.n, self.k), _spec(self.l))
        return specs[:len(shapes)]

    def result_specs(self, params: dict) -> tuple[P, P]:
        c = _spec(self.l, self.m, self.n) if params["c_major"] == "n" else _spec(self.l, self.n, self.m)
        return c, _spec(self.l)


def k_atom(params: dict) -> int:
    """K elements one scale atom column covers (4 scales of sf_vec_size): the finest K split that keeps atoms whole."""
    return ATOM_SCALES * params["sf_vec_size"]


def _k_splittable(params: dict) -> bool:
    """Whether partial products over K can be summed: a float C (packed FP4 C is quantized per block of N)."""
    return not is_fp4(params["c_dtype"])


def _row_quantum(params: dict, dim: str, codes: Any, scales: Any) -> int:
    """The finest split of M (dim "m": a's `codes`, sfa `scales`) or N ("n": b's, sfb) that keeps a shard a valid
    call: whole 128-row atoms where the scales travel as atoms; with compact scales, 16 bytes of every operand whose
    contiguous dimension it is (as support.check_alignment asks of the whole call)."""
    if len(scales.shape) != 3:
        return ATOM_ROWS
    quantum = 1
    if params["a_major" if dim == "m" else "b_major"] == dim:
        quantum = 128 // element_bits(codes.dtype)
    if params["c_major"] == dim:
        quantum = max(quantum, 128 // element_bits(params["c_dtype"]))
    return quantum


def gemm_plan(params: dict, mesh: Any, shapes: Sequence[Any]) -> GemmPlan:
    """Which of a's and b's shardings the op keeps: L from a (else b), M from a, N from b, on whole scale atoms
    (compact scales: whole aligned rows); then K from a (else b) on the axes left, in whole K atoms."""
    a, b = shapes[0], shapes[1]
    m_dim = 1 if params["a_major"] == "k" else 2
    n_dim = 1 if params["b_major"] == "k" else 2
    l_axes = _dim_axes(a.sharding, 0) or _dim_axes(b.sharding, 0)
    l_axes = _keep(mesh, l_axes, a.shape[0], 1, ())
    m_axes = _keep(mesh, _dim_axes(a.sharding, m_dim), a.shape[m_dim], _row_quantum(params, "m", a, shapes[2]),
                   l_axes)
    n_axes = _keep(mesh, _dim_axes(b.sharding, n_dim), b.shape[n_dim], _row_quantum(params, "n", b, shapes[3]),
                   l_axes + m_axes)
    k_axes: Axes = ()
    if _k_splittable(params):
        k_axes = _dim_axes(a.sharding, 3 - m_dim) or _dim_axes(b.sharding, 3 - n_dim)
        k_axes = _keep(mesh, k_axes, params["k"], k_atom(params), l_axes + m_axes + n_axes)
    return GemmPlan(l_axes, m_axes, n_axes, k_axes)


def _gemm_per_shard(local: Callable, p: dict, plan: GemmPlan, mesh: Any) -> Callable:
    """The local GEMM on each shard and amax over the M and N shards; with K split, float32 partial C summed over the
    K shards before amax and C's conversion."""
    reduce_axes = plan.m + plan.n

    def per_shard(*operands):
        if not plan.k:
            c, amax = local(*operands, **p)
            return c, _global_amax(amax, reduce_axes)
        # this shard's K slice into a float32 partial C, summed over the K shards; amax and C's dtype after the sum
        local_k = p["k"] // _shard_count(mesh, plan.k)
        partial, _ = local(*operands, **{**p, "k": local_k, "c_dtype": jnp.dtype(jnp.float32)})
        c = jax.lax.psum(partial, plan.k)
        amax = formats.magnitude_max(c.reshape(c.shape[0], -1), axis=1) if c.size else jnp.zeros(c.shape[:1])
        return reference.convert_c(c, p["c_dtype"]), _global_amax(amax, reduce_axes)  # FP8 saturates

    return per_shard


def _gemm_rule(p: dict, mesh: Any, operand_types: Any) -> tuple[str, dict]:
    """Shardy: L passes through; M (N) is linked to the scale atoms' M' (N') when it fills whole atoms, and is the
    very factor of compact scales' rows; K is a reduction factor linked to the scales' K' (K/32) when it fills whole
    K atoms (and C is a float), else replicated."""
    a, b = _shape(operand_types[0]), _shape(operand_types[1])
    m = a[1] if p["a_major"] == "k" else a[2]
    n = b[1] if p["b_major"] == "k" else b[2]
    compact_a, compact_b = (len(_shape(operand_types[i])) == 3 for i in (2, 3))
    sizes: dict = {}
    m_linked = not compact_a and _linkable(m, ATOM_ROWS, mesh)
    n_linked = not compact_b and _linkable(n, ATOM_ROWS, mesh)
    mf, nf = _fine("m", m_linked, ATOM_ROWS, sizes), _fine("n", n_linked, ATOM_ROWS, sizes)
    c_n = nf
    if is_fp4(p["c_dtype"]):  # packed C (L, M, N/2): link its N/2 to b's N through N's atoms, else through pairs
        if n_linked:
            sizes["nc_i"] = ATOM_ROWS // 2
            c_n = "(n_t nc_i)"
        elif _linkable(n, 2, mesh):
            sizes["n_pair"] = 2
            nf, c_n = "(n_half n_pair)", "n_half"
        else:
            c_n = "n_packed"
    k_codes = _shape(operand_types[0])[2 if p["a_major"] == "k" else 1]  # K, or K/2 for packed FP4 codes
    if _k_splittable(p) and _linkable(p["k"], k_atom(p), mesh):
        sizes["ki"] = k_atom(p) * k_codes // p["k"]  # the codes of one K atom column
        if compact_a or compact_b:
            sizes["ks"] = ATOM_SCALES  # and its compact scales
        if compact_a and compact_b:
            sizes["kt"] = p["k"] // k_atom(p)  # no atom operand names K' alone
        kf, k_scales, reduced, replicated = "(kt ki)", "(kt ks)", ("kt",), ["ki"]
    else:
        kf, k_scales, reduced, replicated = "k", "kb", (), ["k"]
    a_rule = f"l {mf} {kf}" if p["a_major"] == "k" else f"l {kf} {mf}"
    b_rule = f"l {nf} {kf}" if p["b_major"] == "k" else f"l {kf} {nf}"
    scale_rules = []
    for compact, fine, coarse in ((compact_a, mf, _coarse("m", m_linked)), (compact_b, nf, _coarse("n", n_linked))):
        scale_rules.append(f"l {fine} {k_scales}" if compact else f"l {coarse} kt s0 s1 s2")
        replicated.append(("ks" if reduced else "kb") if compact else "kt")
    operands = [a_rule, b_rule, *scale_rules, "l"][:len(operand_types)]
    c_rule = f"l {mf} {c_n}" if p["c_major"] == "n" else f"l {c_n} {mf}"
    rule = f"{', '.join(operands)} -> {c_rule}, l"
    special = dict(need_replication_factors=tuple(dict.fromkeys(f for f in replicated if f not in reduced)))
    if reduced:
        special["reduction_factors"] = reduced
    return rule, dict(**special, **sizes)


GEMM_AMAX = OpRules(gemm_plan, _gemm_per_shard, _c_and_amax_by_l, _gemm_rule)


# --------------------------------------------------------------------------------------------------------------
# gemm_proj_rope_mxfp8
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProjRopePlan:
    """Mesh axes the group axis G, the tokens T and the heads H run sharded on (K never: it is gathered)."""

    g: Axes
    t: Axes
    h: Axes

    def operand_specs(self, params: dict, shapes: Sequence[Any]) -> tuple[P, ...]:
        tok = _spec(self.g, self.t, ())
        w = _spec(self.g, self.h, ()) if params["w_out_in"] else _spec(self.g, (), self.h)
        return (tok, w, tok, tok, tok, w)[:len(shapes)]

    def result_specs(self, params: dict) -> tuple[P, ...]:
        out = _spec(self.g, self.t, self.h, ())
        return out, out, out, out  # out_scales_col's T/32 axis splits with T (each shard holds whole blocks)


def proj_rope_plan(params: dict, mesh: Any, shapes: Sequence[Any]) -> ProjRopePlan:
    """G and T from x (T in whole 32-token blocks), heads from w's output dimension (whole heads of 192)."""
    x, w = shapes[0], shapes[1]
    n_dim = 1 if params["w_out_in"] else 2
    g_axes = _keep(mesh, _dim_axes(x.sharding, 0) or _dim_axes(w.sharding, 0), x.shape[0], 1, ())
    t_axes = _keep(mesh, _dim_axes(x.sharding, 1), x.shape[1], MX_BLOCK, g_axes)
    h_axes = _keep(mesh, _dim_axes(w.sharding, n_dim), w.shape[n_dim], HEAD_DIM, g_axes + t_axes)
    return ProjRopePlan(g_axes, t_axes, h_axes)


def _local_per_shard(local: Callable, p: dict, plan: Any, mesh: Any) -> Callable:
    """The local op, unchanged, on each shard: for ops whose shards need nothing of each other."""
    return lambda *operands: tuple(local(*operands, **p))


def _proj_rope_propagate(p: dict, result_shape: Any) -> tuple[NamedSharding, ...]:
    """A user's sharding of one output (G, T, H) is suggested for all four."""
    s = result_shape[0].sharding
    spec = _spec(_dim_axes(s, 0), _dim_axes(s, 1), _dim_axes(s, 2), ())
    return tuple(NamedSharding(s.mesh, spec) for _ in range(4))


def _proj_rope_rule(p: dict, mesh: Any, operand_types: Any) -> tuple[str, dict]:
    """Shardy: G passes through, tokens in blocks of 32 (linking T to out_scales_col's T/32), heads of 192."""
    t = _shape(operand_types[0])[1]
    n = _shape(operand_types[1])[1 if p["w_out_in"] else 2]
    sizes: dict = {}
    t_linked = _linkable(t, MX_BLOCK, mesh)
    tf = _fine("t", t_linked, MX_BLOCK, sizes)
    hf = "nh"  # one head: w's features stand alone (Shardy refuses a size-1 part of a compound factor)
    if n != HEAD_DIM:  # w's features split into (heads, 192): hd is w's part, d the outputs' whole dimension
        sizes["hd"] = HEAD_DIM
        hf = "(h hd)"
    w = f"g {hf} k" if p["w_out_in"] else f"g k {hf}"
    ws = f"g {hf} kb" if p["w_out_in"] else f"g kb {hf}"
    operands = [f"g {tf} k", w, f"g {tf} r", f"g {tf} r", f"g {tf} kb", ws][:len(operand_types)]
    outs = [f"g {tf} h d", f"g {tf} h q", f"g {tf} h d", f"g {_coarse('t', t_linked)} h d"]
    replicated = ("k", "kb") if len(operand_types) > 4 else ("k",)
    return f"{', '.join(operands)} -> {', '.join(outs)}", dict(need_replication_factors=replicated, **sizes)


PROJ_ROPE = OpRules(proj_rope_plan, _local_per_shard, _proj_rope_propagate, _proj_rope_rule)


# --------------------------------------------------------------------------------------------------------------
# weight_only_matmul
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WeightOnlyPlan:
    """Mesh axes of L, x's rows M, the weight's rows N, and K (in whole scale blocks; partial sums are reduced)."""

    l: Axes
    m: Axes
    n: Axes
    k: Axes

    def operand_specs(self, params: dict, shapes: Sequence[Any]) -> tuple[P, ...]:
        weight = _spec(self.l, self.n, self.k)
        return _spec(self.l, self.m, self.k), weight, weight, _spec(self.l)

    def result_specs(self, params: dict) -> tuple[P]:
        return (_spec(self.l, self.m, self.n),)


def weight_only_plan(params: dict, mesh: Any, shapes: Sequence[Any]) -> WeightOnlyPlan:
    """L from x (else the codes), M from x, N from the codes, K from x (else the codes) when each shard holds whole
    blocks of `formats.FORMATS[fmt].block` elements (so codes, packed FP4 bytes and scales split with it)."""
    x, codes = shapes[0], shapes[1]
    block = formats.FORMATS[params["fmt"]].block
    l_axes = _keep(mesh, _dim_axes(x.sharding, 0) or _dim_axes(codes.sharding, 0), x.shape[0], 1, ())
    m_axes = _keep(mesh, _dim_axes(x.sharding, 1), x.shape[1], 1, l_axes)
    n_axes = _keep(mesh, _dim_axes(codes.sharding, 1), codes.shape[1], 1, l_axes + m_axes)
    k_axes = _dim_axes(x.sharding, 2) or _dim_axes(codes.sharding, 2)
    k_axes = _keep(mesh, k_axes, x.shape[2], block, l_axes + m_axes + n_axes)
    return WeightOnlyPlan(l_axes, m_axes, n_axes, k_axes)


def _weight_only_per_shard(local: Callable, p: dict, plan: WeightOnlyPlan, mesh: Any) -> Callable:
    """The local op per shard; with K split, fp32 partial sums reduced over K, then alpha and the conversion (as the
    unsharded reference applies them)."""
    if not plan.k:
        return _local_per_shard(local, p, plan, mesh)

    def per_shard(x, codes, scales, alpha):
        (acc,) = local(x, codes, scales, jnp.ones_like(alpha), **{**p, "out_dtype": jnp.dtype(jnp.float32)})
        acc = jax.lax.psum(acc, plan.k)
        return ((acc * alpha[:, None, None]).astype(p["out_dtype"]),)

    return per_shard


def _weight_only_propagate(p: dict, result_shape: Any) -> tuple[NamedSharding]:
    """A user's sharding of y (L, M, N) is kept."""
    return (result_shape[0].sharding,)


def _weight_only_rule(p: dict, mesh: Any, operand_types: Any) -> tuple[str, dict]:
    """Shardy: L, M, N pass through; K is a reduction factor linked across x, the codes and the scales in whole
    blocks where `_linkable` allows (else their K factors stay unlinked and Shardy propagates no K sharding between
    them; the partition callback still splits K wherever the operands arrive split in whole blocks)."""
    block_format = formats.FORMATS[p["fmt"]]
    k = _shape(operand_types[0])[2]
    sizes: dict = {}
    if k % block_format.block == 0 and _linkable(k, block_format.block, mesh):
        sizes["ki"] = block_format.block
        sizes["kci"] = block_format.block // 2 if block_format.is_fp4 else block_format.block
        x, codes, scales = "l m (kb ki)", "l n (kb kci)", "l n kb"
        special = dict(reduction_factors=("kb",), need_replication_factors=("ki", "kci"))
    else:
        x, codes, scales = "l m k", "l n kc", "l n kb"
        special = dict(need_replication_factors=("k", "kc", "kb"))
    return f"{x}, {codes}, {scales}, l -> l m n", dict(**special, **sizes)


WEIGHT_ONLY = OpRules(weight_only_plan, _weight_only_per_shard, _weight_only_propagate, _weight_only_rule)


# --------------------------------------------------------------------------------------------------------------
# ragged_gemm_amax
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RaggedPlan:
    """Mesh axes of L, the tokens T, the groups G (experts) and the weights' rows N (K never: it is gathered)."""

    l: Axes
    t: Axes
    g: Axes
    n: Axes

    def operand_specs(self, params: dict, shapes: Sequence[Any]) -> tuple[P, ...]:
        """a, b, sfa, sfb, starts, ends[, alpha]: alpha (L,) per batch, or (L, G) per weight."""
        tokens = _spec(self.l, self.t, ())
        weights = _spec(self.l, self.g, self.n, ())  # and sfb, (L, G, N, KB) in either layout of b
        b = weights if params["b_major"] == "k" else _spec(self.l, self.g, (), self.n)
        bounds = _spec(self.l, self.g)
        alpha = bounds if len(shapes) > 6 and len(shapes[6].shape) == 2 else _spec(self.l)
        return (tokens, b, tokens, weights, bounds, bounds, alpha)[:len(shapes)]

    def result_specs(self, params: dict) -> tuple[P, P]:
        return _spec(self.l, self.t, self.n), _spec(self.l)


def ragged_plan(params: dict, mesh: Any, shapes: Sequence[Any]) -> RaggedPlan:
    """L from a (else b), T from a, G from b (else the group bounds), N from b (in pairs for packed FP4 C)."""
    a, b, starts = shapes[0], shapes[1], shapes[4]
    n_dim = 2 if params["b_major"] == "k" else 3
    l_axes = _keep(mesh, _dim_axes(a.sharding, 0) or _dim_axes(b.sharding, 0), a.shape[0], 1, ())
    t_axes = _keep(mesh, _dim_axes(a.sharding, 1), a.shape[1], 1, l_axes)
    g_axes = _keep(mesh, _dim_axes(b.sharding, 1) or _dim_axes(starts.sharding, 1), b.shape[1], 1, l_axes + t_axes)
    n_quantum = 2 if is_fp4(params["c_dtype"]) else 1
    n_axes = _keep(mesh, _dim_axes(b.sharding, n_dim), b.shape[n_dim], n_quantum, l_axes + t_axes + g_axes)
    return RaggedPlan(l_axes, t_axes, g_axes, n_axes)


def _sum_disjoint(c: jax.Array, axes: Axes) -> jax.Array:
    """Combines per-shard C whose nonzero rows are disjoint: a sum of the bit patterns (the other shards hold zero
    bits there), so every dtype, NaN payloads and -0 come through unchanged."""
    if not axes:
        return c
    bits = jnp.dtype(f"uint{8 * c.dtype.itemsize}")
    as_bits = c if c.dtype == bits else jax.lax.bitcast_convert_type(c, bits)
    summed = jax.lax.psum(as_bits, axes)
    return summed if c.dtype == bits else jax.lax.bitcast_convert_type(summed, c.dtype)


def _ragged_per_shard(local: Callable, p: dict, plan: RaggedPlan, mesh: Any) -> Callable:
    """Each device multiplies its tokens by its experts' weights.

    Tokens sharded: the group bounds move to the shard's first row (clipped to its rows), no communication. Experts
    sharded: each device computes the rows of its groups (zero elsewhere) and C is combined over the expert axes
    (`_sum_disjoint`, one all-reduce of C). amax is the NaN-safe max over every sharded axis but L.
    """

    def per_shard(a, b, sfa, sfb, starts, ends, *alpha):
        if plan.t:
            starts, ends = _shard_first_row(starts, ends, a.shape[1], plan.t)
        c, amax = local(a, b, sfa, sfb, starts, ends, *alpha, **p)
        return _sum_disjoint(c, plan.g), _global_amax(amax, plan.t + plan.g + plan.n)

    return per_shard


def _ragged_rule(p: dict, mesh: Any, operand_types: Any) -> tuple[str, dict]:
    """Shardy: L, T and N pass through, G is a reduction factor (the expert-sharded combine), K is replicated (the
    tokens' K and the codes' K are separate factors: tokens that are values have K columns where packed FP4 codes
    have K/2); alpha follows L, or L and G where it is one per weight."""
    n = _shape(operand_types[3])[2]  # sfb (L, G, N, KB): N in either layout of b
    sizes: dict = {}
    nf = c_n = "n"
    if is_fp4(p["c_dtype"]):  # packed C (L, T, N/2): linked to b's N through pairs where Shardy allows it
        if _linkable(n, 2, mesh):
            sizes["n_pair"] = 2
            nf, c_n = "(n_half n_pair)", "n_half"
        else:
            c_n = "n_packed"
    b = f"l g {nf} kc" if p["b_major"] == "k" else f"l g kc {nf}"
    alpha = "l g" if len(operand_types) > 6 and len(_shape(operand_types[6])) == 2 else "l"
    operands = ["l t ka", b, "l t kas", f"l g {nf} kb", "l g", "l g", alpha][:len(operand_types)]
    return (f"{', '.join(operands)} -> l t {c_n}, l",
            dict(reduction_factors=("g",), need_replication_factors=("ka", "kc", "kas", "kb"), **sizes))


RAGGED = OpRules(ragged_plan, _ragged_per_shard, _c_and_amax_by_l, _ragged_rule)


# --------------------------------------------------------------------------------------------------------------
# The per-group contraction (contraction.py)
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ContractionPlan:
    """Mesh axes of L, the tokens T (summed over), the groups G, and the result's K and N."""

    l: Axes
    t: Axes
    g: Axes
    k: Axes
    n: Axes

    def operand_specs(self, params: dict, shapes: Sequence[Any]) -> tuple[P, ...]:
        bounds = _spec(self.l, self.g)
        return _spec(self.l, self.t, self.k), _spec(self.l, self.t, self.n), bounds, bounds

    def result_specs(self, params: dict) -> tuple[P, P]:
        return _spec(self.l, self.g, self.k, self.n), _spec(self.l)


def contraction_plan(params: dict, mesh: Any, shapes: Sequence[Any]) -> ContractionPlan:
    """L from x (else y), T from x (else y), G from the group bounds, K from x, N from y: each on axes no other
    dimension took."""
    x, y, starts = shapes[0], shapes[1], shapes[2]
    l_axes = _keep(mesh, _dim_axes(x.sharding, 0) or _dim_axes(y.sharding, 0), x.shape[0], 1, ())
    t_axes = _keep(mesh, _dim_axes(x.sharding, 1) or _dim_axes(y.sharding, 1), x.shape[1], 1, l_axes)
    g_axes = _keep(mesh, _dim_axes(starts.sharding, 1), starts.shape[1], 1, l_axes + t_axes)
    k_axes = _keep(mesh, _dim_axes(x.sharding, 2), x.shape[2], 1, l_axes + t_axes + g_axes)
    n_axes = _keep(mesh, _dim_axes(y.sharding, 2), y.shape[2], 1, l_axes + t_axes + g_axes + k_axes)
    return ContractionPlan(l_axes, t_axes, g_axes, k_axes, n_axes)


def _contraction_per_shard(local: Callable, p: dict, plan: ContractionPlan, mesh: Any) -> Callable:
    """Each device contracts its tokens for its groups, (K, N) block. Tokens sharded: the group bounds move to the
    shard's first row (clipped to its rows) and the partial sums are added over the token axes in float32 (then
    converted to C's dtype)."""
    c_dtype = p["c_dtype"]

    def per_shard(x, y, starts, ends):
        if not plan.t:
            c, amax = local(x, y, starts, ends, **p)
            return c, _global_amax(amax, plan.g + plan.k + plan.n)
        starts, ends = _shard_first_row(starts, ends, x.shape[1], plan.t)
        c, _ = local(x, y, starts, ends, **dict(p, c_dtype=jnp.dtype(jnp.float32)))
        c = jax.lax.psum(c, plan.t)
        return c.astype(c_dtype), _global_amax(formats.magnitude_max(c, axis=(1, 2, 3)), plan.g + plan.k + plan.n)

    return per_shard


def _contraction_rule(p: dict, mesh: Any, operand_types: Any) -> tuple[str, dict]:
    """Shardy: L, G, K and N pass through, T is a reduction factor (the token-sharded sum)."""
    return "l t k, l t n, l g, l g -> l g k n, l", dict(reduction_factors=("t",))


CONTRACTION = OpRules(contraction_plan, _contraction_per_shard, _c_and_amax_by_l, _contraction_rule)


# --------------------------------------------------------------------------------------------------------------
# Both MX quantizations of a weight (quantize_pair.py): w (B, R, C) -> values (B, R, C), codes (B, R, C), scales
# (B, R, C/32); with a row map (1, R') w is (1, R, C) and the values (1, R', C)
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QuantizePairPlan:
    """Mesh axes of w's B, R and C; the three results shard like w (the scales' C/32 like C: whole blocks)."""

    b: Axes
    r: Axes
    c: Axes

    def operand_specs(self, params: dict, shapes: Sequence[Any]) -> tuple[P, ...]:
        return (_spec(self.b, self.r, self.c), _spec())[:len(shapes)]  # a row map whole on every device

    def result_specs(self, params: dict) -> tuple[P, P, P]:
        spec = _spec(self.b, self.r, self.c)
        return spec, spec, spec


def quantize_pair_plan(params: dict, mesh: Any, shapes: Sequence[Any]) -> QuantizePairPlan:
    """B, R and C of w: each kept where it splits its dimension into whole blocks of 32 (B: any split), on axes no
    other dimension took; every block then lies in one shard and the op runs per shard as it is. With a row map (a
    second operand) only C: a map may name any row, so the rows stay whole on every device."""
    w = shapes[0]
    if len(shapes) > 1:
        return QuantizePairPlan((), (), _keep(mesh, _dim_axes(w.sharding, 2), w.shape[2], MX_BLOCK, ()))
    b_axes = _keep(mesh, _dim_axes(w.sharding, 0), w.shape[0], 1, ())
    r_axes = _keep(mesh, _dim_axes(w.sharding, 1), w.shape[1], MX_BLOCK, b_axes)
    c_axes = _keep(mesh, _dim_axes(w.sharding, 2), w.shape[2], MX_BLOCK, b_axes + r_axes)
    return QuantizePairPlan(b_axes, r_axes, c_axes)


def _quantize_pair_propagate(p: dict, result_shape: Any) -> tuple[NamedSharding, ...]:
    """A user's sharding of the values is kept for all three results."""
    values = result_shape[0].sharding
    return values, values, values


def _quantize_pair_rule(p: dict, mesh: Any, operand_types: Any) -> tuple[str, dict]:
    """Shardy: B and R pass through; C is tied to the scales' C/32 where `_linkable` (else they are separate factors
    and the partition callback still keeps C in whole blocks). With a row map the rows (R, R') are replicated."""
    sizes: dict = {}
    linked = _linkable(_shape(operand_types[0])[2], MX_BLOCK, mesh)
    c = _fine("c", linked, MX_BLOCK, sizes)
    if len(operand_types) > 1:
        return (f"b r {c}, b p -> b p {c}, b r {c}, b r {_coarse('c', linked)}",
                dict(need_replication_factors=("b", "r", "p"), **sizes))
    return f"b r {c} -> b r {c}, b r {c}, b r {_coarse('c', linked)}", sizes


QUANTIZE_PAIR = OpRules(quantize_pair_plan, _local_per_shard, _quantize_pair_propagate, _quantize_pair_rule)
