"""Both operations under sharding on 8 host devices: jit with sharded inputs and inside shard_map.

The partitioning rules (jax_blockgemm/sharding.py) are checked case by case: every sharding gives the unsharded
call's result bit for bit (the reference on CPU; checked against the float64 oracle too), the compiled program
holds no all-gather where the rules run the op on each shard (and holds one where they gather on purpose, so the
check can fail), and outputs come back sharded like the inputs; the same under both partitioners (Shardy, GSPMD),
jax.vmap, a jitted training step and jax.export.
"""

import functools
import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax, when run directly

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_blockgemm as jbg
from jax_blockgemm import formats

import oracle
import oracle_ops
import partitioners


def _mesh():
    devices = jax.devices()
    if len(devices) < 8:
        raise absltest.SkipTest("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return Mesh(np.array(devices[:8]).reshape(4, 2), ("data", "model"))


def _inputs(rng, l, m, n, k):
    a = jnp.asarray(rng.standard_normal((l, m, k)) * 4, jnp.float32).astype(jnp.float8_e4m3fn)
    b = jnp.asarray(rng.standard_normal((l, n, k)) * 4, jnp.float32).astype(jnp.float8_e4m3fn)
    sfa = jnp.asarray(oracle.random_scale_bytes(rng, (l, m, k // 32)))
    sfb = jnp.asarray(oracle.random_scale_bytes(rng, (l, n, k // 32)))
    return a, b, sfa, sfb


def _assert_same_result(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


class ShardingTest(absltest.TestCase):

    def test_gemm_amax_batch_sharded_jit(self):
        mesh = _mesh()
        a, b, sfa, sfb = _inputs(np.random.default_rng(0), 4, 128, 64, 64)
        want_c, want_amax = jbg.gemm_amax(a, b, sfa, sfb)
        spec = NamedSharding(mesh, P("data"))
        sharded = [jax.device_put(x, spec) for x in (a, b, sfa, sfb)]
        c, amax = jax.jit(jbg.gemm_amax)(*sharded)
        _assert_same_result((c, amax), (want_c, want_amax))

    def test_gemm_amax_rows_sharded_jit(self):
        mesh = _mesh()
        a, b, sfa, sfb = [x[0] for x in _inputs(np.random.default_rng(1), 1, 256, 128, 96)]
        want_c, want_amax = jbg.gemm_amax(a, b, sfa, sfb)
        a_s = jax.device_put(a, NamedSharding(mesh, P("data", None)))
        b_s = jax.device_put(b, NamedSharding(mesh, P("model", None)))
        c, amax = jax.jit(jbg.gemm_amax)(a_s, b_s, sfa, sfb)
        _assert_same_result((c, amax), (want_c, want_amax))

    def test_gemm_amax_in_shard_map(self):
        """Each shard computes its rows; the global amax is the pmax of the per-shard amaxes."""
        mesh = _mesh()
        a, b, sfa, sfb = [x[0] for x in _inputs(np.random.default_rng(2), 1, 512, 128, 64)]
        want_c, want_amax = jbg.gemm_amax(a, b, sfa, sfb)

        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P(), P("data"), P()),
                           out_specs=(P("data"), P()), check_vma=False)
        def per_shard(a, b, sfa, sfb):
            c, amax = jbg.gemm_amax(a, b, sfa, sfb)
            return c, jax.lax.pmax(amax, "data")

        c, amax = jax.jit(per_shard)(a, b, sfa, sfb)
        _assert_same_result((c, amax), (want_c, want_amax))

    def test_proj_rope_token_sharded(self):
        mesh = _mesh()
        rng = np.random.default_rng(3)
        t, h, k = 256, 2, 64
        x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((h * 192, k)) / 8, jnp.bfloat16)
        ang = rng.uniform(0, 6.3, (t, 64))
        cos, sin = jnp.asarray(np.cos(ang), jnp.bfloat16), jnp.asarray(np.sin(ang), jnp.bfloat16)
        want = jbg.gemm_proj_rope_mxfp8(x, w, cos, sin)
        tok = NamedSharding(mesh, P("data", None))
        got = jax.jit(jbg.gemm_proj_rope_mxfp8)(jax.device_put(x, tok), w, jax.device_put(cos, tok),
                                                jax.device_put(sin, tok))
        for g, r in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(r).view(np.uint8))


# ------------------------------------------------------------------------------------------------------------------
# The partitioning rules (sharding.py)

_GATHER = re.compile(r"=\s*\S+\s+all-gather(-start)?\(")  # an all-gather instruction in compiled HLO text


def _gathers(hlo: str) -> list[str]:
    """The all-gather instructions of a compiled program's HLO text."""
    return [line.strip() for line in hlo.splitlines() if _GATHER.search(line)]


def _put(mesh, x, spec):
    return None if x is None else jax.device_put(x, NamedSharding(mesh, spec))


def _bits(x) -> np.ndarray:
    """An output's raw bytes (FP8 codes compare as bytes: NaN codes must match too)."""
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x


class _PartitionCase(parameterized.TestCase):
    """Shared checks: equal results, the all-gather count of the compiled program, output shardings."""

    def check_partitioned(self, fn, args, sharded_args, *, gathers: bool, out_specs=None, mesh=None):
        """jit(fn) on `sharded_args` equals fn(*args) bit for bit; the program all-gathers iff `gathers`."""
        want = fn(*args)
        jitted = jax.jit(fn)
        lowered = jitted.lower(*sharded_args)
        self.assertIn("CustomSPMDPartitioning", lowered.as_text())  # the rules are in the program
        found = _gathers(lowered.compile().as_text())
        if gathers:
            self.assertNotEmpty(found, "expected the rules to gather an operand explicitly")
        else:
            self.assertEmpty(found, "the compiled program gathers an operand")
        got = jitted(*sharded_args)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(_bits(g), _bits(w))
        if out_specs is not None:
            for g, spec in zip(jax.tree.leaves(got), out_specs):
                self.assertTrue(g.sharding.is_equivalent_to(NamedSharding(mesh, spec), g.ndim),
                                f"output sharded {g.sharding.spec}, expected {spec}")
        return got


# name, (l, m, n, k), fmt, (a_major, b_major, c_major), c_dtype, specs of (a, b, sfa, sfb), C's spec (None: the
# rules gather, C's spec is whatever the partitioner makes of it)
GEMM_CASES = [
    ("batch", (4, 256, 128, 128), "mxfp8_e4m3", ("k", "k", "n"), "float32",
     (P("data"), P("data"), P("data"), P("data")), P("data")),
    ("rows_and_columns", (1, 1024, 512, 160), "mxfp8_e4m3", ("k", "k", "n"), "float32",
     (P(None, "data"), P(None, "model"), P(None, "data"), P(None, "model")), P(None, "data", "model")),
    ("rows_on_two_axes_odd_n", (3, 1024, 200, 96), "mxfp8_e5m2", ("k", "k", "n"), "bfloat16",
     (P(None, ("data", "model")), P(), P(None, ("data", "model")), P()), P(None, ("data", "model"))),
    ("batch_and_rows", (2, 512, 136, 64), "mxfp8_e4m3", ("k", "k", "n"), "float32",
     (P("model", "data"), P("model"), P("model", "data"), P("model")), P("model", "data")),
    ("mn_major_operands_m_major_c", (1, 512, 256, 96), "mxfp8_e4m3", ("m", "n", "m"), "float32",
     (P(None, None, "data"), P(None, None, "model"), P(None, "data"), P(None, "model")), P(None, "model", "data")),
    ("nvfp4_packed_c_columns", (2, 256, 512, 128), "nvfp4", ("k", "k", "n"), "uint8",
     (P(), P(None, "data"), P(), P(None, "data")), P(None, None, "data")),
    ("mxfp4_batch_rows", (2, 512, 128, 256), "mxfp4", ("k", "k", "n"), "float16",
     (P("model", "data"), P("model"), P("model", "data"), P("model")), P("model", "data")),
    ("gathered_k", (1, 256, 128, 256), "mxfp8_e4m3", ("k", "k", "n"), "float32",
     (P(None, None, "data"), P(None, None, "data"), P(), P()), None),
    ("gathered_rows_off_atoms", (1, 256, 128, 64), "mxfp8_e4m3", ("k", "k", "n"), "float32",
     (P(None, "data"), P(), P(), P()), None),
]


def _gemm_problem(rng, shape, fmt, majors, c_dtype, scales=("atom", "atom")):
    """Random operands (sfa and sfb in the forms `scales` names: "atom" or "compact") and the unsharded function of
    them, plus the float64 oracle's (C, amax)."""
    l, m, n, k = shape
    a_major, b_major, c_major = majors
    d = oracle_ops.random_gemm_inputs(rng, l=l, m=m, n=n, k=k, fmt=fmt, a_major=a_major, b_major=b_major,
                                      scale_log2=(-3.0, 3.0))
    alpha = jnp.float32(d["alpha"]) if fmt == "nvfp4" else None

    def fn(a, b, sfa, sfb):
        return jbg.gemm_amax(a, b, sfa, sfb, alpha=alpha, c_dtype=jnp.dtype(c_dtype), a_major=a_major,
                             b_major=b_major, c_major=c_major, sf_vec_size=d["sf_vec_size"])

    scale_names = (name + "_atom" if form == "atom" else name for name, form in zip(("sfa", "sfb"), scales))
    args = tuple(jnp.asarray(d[name]) for name in ("a", "b", *scale_names))
    ref = oracle_ops.gemm_amax_oracle(d["a"], d["b"], d["sfa"], d["sfb"], k=k, sf_vec_size=d["sf_vec_size"],
                                      a_major=a_major, b_major=b_major, alpha=alpha)
    return fn, args, ref


# Compact (L, MN, KB) scales shard with their operand's rows, in any split that keeps each shard's rows aligned
# (the primitive makes each device's atoms): the fields of GEMM_CASES, then the forms of sfa and sfb.
COMPACT_GEMM_CASES = [
    ("rows_finer_than_an_atom", (1, 256, 128, 128), "mxfp8_e4m3", ("k", "k", "n"), "float32",
     (P(None, ("data", "model")), P(), P(None, ("data", "model")), P()), P(None, ("data", "model")),
     ("compact", "compact")),
    ("rows_and_columns_off_atoms_m_major_c", (2, 192, 96, 160), "mxfp8_e4m3", ("k", "k", "m"), "bfloat16",
     (P(None, "data"), P(None, "model"), P(None, "data"), P(None, "model")), P(None, "model", "data"),
     ("compact", "compact")),
    ("m_major_rows", (1, 256, 64, 96), "mxfp8_e5m2", ("m", "k", "n"), "float32",
     (P(None, None, ("data", "model")), P(), P(None, ("data", "model")), P()), P(None, ("data", "model")),
     ("compact", "compact")),
    ("nvfp4_packed_c_columns", (1, 128, 256, 128), "nvfp4", ("k", "k", "n"), "uint8",
     (P(), P(None, "data"), P(), P(None, "data")), P(None, None, "data"), ("compact", "compact")),
    ("compact_rows_atom_columns", (1, 256, 256, 64), "mxfp4", ("k", "k", "n"), "float32",  # N: 128-row atoms a shard
     (P(None, "data"), P(None, "model"), P(None, "data"), P(None, "model")), P(None, "data", "model"),
     ("compact", "atom")),
    ("gathered_rows_off_alignment", (1, 208, 64, 64), "mxfp8_e4m3", ("m", "k", "n"), "float32",
     (P(None, None, "data"), P(), P(None, "data"), P()), None, ("compact", "compact")),
]


def _partitioners(cases: list, gspmd_too: int = 1) -> list[dict]:
    """Every case under Shardy (JAX's partitioner), the first `gspmd_too` also under the legacy GSPMD one."""
    return ([dict(case=c, partitioner="shardy") for c in cases]
            + [dict(case=c, partitioner="gspmd") for c in cases[:gspmd_too]])


class GemmAmaxPartitionTest(_PartitionCase):

    def check_case(self, case, partitioner, seed, scales=("atom", "atom")):
        """One GEMM_CASES case under `partitioner`: bit for bit the unsharded call, the all-gathers as the case says,
        C sharded as it says, and within SPEC §7's class of the float64 oracle."""
        name, shape, fmt, majors, c_dtype, specs, c_spec = case
        mesh = _mesh()
        fn, args, (c_ref, amax_ref) = _gemm_problem(np.random.default_rng(seed), shape, fmt, majors, c_dtype,
                                                    scales)
        sharded = [_put(mesh, x, s) for x, s in zip(args, specs)]
        with partitioners.partitioner(partitioner):
            c, amax = self.check_partitioned(fn, args, sharded, gathers=c_spec is None, mesh=mesh,
                                             out_specs=None if c_spec is None else (c_spec, P()))
        oracle_ops.assert_gemm_close(self, c, c_ref, c_dtype=jnp.dtype(c_dtype), c_major=majors[2])
        oracle_ops.assert_amax_close(self, amax, amax_ref)

    @parameterized.parameters(*_partitioners(GEMM_CASES))
    def test_sharded_equals_unsharded(self, case, partitioner):
        self.check_case(case, partitioner, len(case[0]))

    @parameterized.parameters(*_partitioners(COMPACT_GEMM_CASES, gspmd_too=len(COMPACT_GEMM_CASES)))
    def test_compact_scales_shard_with_their_rows(self, case, partitioner):
        """Compact scales split like their operand's rows, finer than a 128-row atom too (256 rows over 8 devices,
        as data-parallel decode makes them): each device makes atoms of its own rows, nothing is gathered."""
        self.check_case(case[:-1], partitioner, len(case[0]) + 50, case[-1])

    def _per_shard_cuda_text(self, args, specs) -> str:
        """The partition callback's per-shard function of gemm_amax(*args, implementation="cutedsl") on operands
        sharded by `specs`, lowered for CUDA (no GPU needed; kernel objects stubbed, nothing compiled); checks that
        the callback keeps the operands where they are."""
        from unittest import mock

        from jax_blockgemm import _native, kernel_cache, primitives, sharding

        try:
            _native.extension()
            import cutlass  # noqa: F401  (the catalog's kernels are CuTeDSL classes)
        except ImportError as e:
            raise absltest.SkipTest(f"needs the native bridge and CuTeDSL: {e}")
        mesh = _mesh()
        jaxpr = jax.make_jaxpr(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl"))(*args)
        params = next(e.params for e in jaxpr.eqns if e.primitive is primitives.gemm_amax_p)
        shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        _, per_shard, out_shardings, arg_shardings = sharding.GEMM_AMAX.partition(
            primitives.gemm_amax_local_p.bind, sharding.freeze_params(params), mesh, shapes, None)
        for got, spec, x in zip(arg_shardings, specs, args):  # operands stay where they are
            self.assertTrue(got.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), got)
        spmd = jax.shard_map(per_shard, mesh=mesh, in_specs=specs, out_specs=tuple(s.spec for s in out_shardings),
                             check_vma=False)
        with mock.patch.object(kernel_cache, "get_object", return_value=b"stand-in object"):
            return jax.jit(spmd).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()

    def test_each_shard_lowers_to_the_kernel_on_cuda(self):
        """The per-shard function calls the kernel on the local shapes: the same per-platform rule as an unsharded
        call."""
        _, args, _ = _gemm_problem(np.random.default_rng(11), (1, 512, 256, 96), "mxfp8_e4m3", ("k", "k", "n"),
                                   "float32")
        text = self._per_shard_cuda_text(args, (P(None, "data"), P(None, "model"), P(None, "data"), P(None, "model")))
        calls = re.findall(r"stablehlo.custom_call @jbg_gemm_amax\(.*", text)
        self.assertLen(calls, 1, text)
        self.assertIn("tensor<1x128x96xf8E4M3FN>, tensor<1x128x96xf8E4M3FN>", calls[0])  # M/4 and N/2 per shard

    def test_rows_finer_than_an_atom_take_the_decode_kernel_per_shard(self):
        """256 quantized rows with compact scales over 8 devices: each device's 32 rows are a decode-sized call, so
        its shard lowers to the decode kernel on its own rows, with its compact scale rows as they are (no atoms)."""
        _, args, _ = _gemm_problem(np.random.default_rng(13), (1, 256, 256, 96), "mxfp8_e4m3", ("k", "k", "n"),
                                   "float32", scales=("compact", "compact"))
        text = self._per_shard_cuda_text(args, (P(None, ("data", "model")), P(), P(None, ("data", "model")), P()))
        self.assertNotIn("all-gather", text)
        calls = re.findall(r"stablehlo.custom_call @jbg_weight_stream\(.*", text)  # no local GPU: every arch's kernel
        self.assertLen(calls, 1, text)
        # x: the shard's 32 rows dequantized to bf16; the weight (N, K) and its compact scales whole
        self.assertIn("tensor<1x32x96xbf16>, tensor<1x256x96xf8E4M3FN>, tensor<1x256x3xui8>", calls[0])

    def test_nan_in_one_shard_poisons_amax(self):
        """A NaN scale in the last row shard makes the global amax NaN, however large the other shards are."""
        mesh = _mesh()
        fn, args, _ = _gemm_problem(np.random.default_rng(5), (1, 1024, 256, 128), "mxfp8_e4m3", ("k", "k", "n"),
                                    "float32")
        a, b, sfa, sfb = args
        compact = formats.from_scale_atom(sfa, 1024, 4)
        sfa = formats.to_scale_atom(compact.at[0, 1000, 1].set(0xFF))  # row 1000 lives on the 4th of 4 shards
        specs = (P(None, "data"), P(None, "model"), P(None, "data"), P(None, "model"))
        sharded = [_put(mesh, x, s) for x, s in zip((a, b, sfa, sfb), specs)]
        c, amax = self.check_partitioned(fn, (a, b, sfa, sfb), sharded, gathers=False)
        self.assertTrue(np.isnan(float(amax)))
        self.assertTrue(np.isnan(np.asarray(c)[0, 1000]).all())
        self.assertFalse(np.isnan(np.asarray(c)[0, :1000]).any())

    def test_vmap_of_sharded_call(self):
        """vmap folds its axis into L: a vmapped axis sharded on 'data' with N on 'model' stays sharded."""
        mesh = _mesh()
        rng = np.random.default_rng(6)
        fn, _, _ = _gemm_problem(rng, (2, 256, 256, 64), "mxfp8_e4m3", ("k", "k", "n"), "float32")
        batches = [_gemm_problem(rng, (2, 256, 256, 64), "mxfp8_e4m3", ("k", "k", "n"), "float32")[1]
                   for _ in range(4)]
        args = tuple(jnp.stack(xs) for xs in zip(*batches))  # (B=4, L=2, ...)
        specs = (P("data"), P("data", None, "model"), P("data"), P("data", None, "model"))
        sharded = [_put(mesh, x, s) for x, s in zip(args, specs)]
        c, amax = self.check_partitioned(jax.vmap(fn), args, sharded, gathers=False, mesh=mesh,
                                         out_specs=(P("data", None, None, "model"), P("data")))
        for i, batch in enumerate(batches):  # each example equals its own unbatched call
            want_c, want_amax = fn(*batch)
            np.testing.assert_array_equal(np.asarray(c[i]), np.asarray(want_c))
            np.testing.assert_array_equal(np.asarray(amax[i]), np.asarray(want_amax))

    def test_training_step(self):
        """A jitted step: quantize activations and weights, gemm_amax, a loss on C / amax, SGD on a bias."""
        mesh = _mesh()
        rng = np.random.default_rng(7)
        m, n, k = 512, 256, 96
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((n, k)) / 8, jnp.float32)
        bias = jnp.asarray(rng.standard_normal((n,)), jnp.float32)
        target = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)

        def step(x, w, bias, target):
            a, sfa = formats.quantize_mxfp8(x)
            b, sfb = formats.quantize_mxfp8(w)
            c, amax = jbg.gemm_amax(a, b, sfa, sfb)
            loss_fn = lambda bias: jnp.mean(jnp.square(c / amax + bias - target))
            loss, grad = jax.value_and_grad(loss_fn)(bias)
            return loss, bias - 0.5 * grad, amax

        want = step(x, w, bias, target)
        specs = (P("data"), P("model"), P("model"), P("data", "model"))
        sharded = [_put(mesh, v, s) for v, s in zip((x, w, bias, target), specs)]
        jitted = jax.jit(step)
        hlo = jitted.lower(*sharded).compile().as_text()
        self.assertEmpty(_gathers(hlo), "the step gathers an operand")
        loss, new_bias, amax = jitted(*sharded)
        np.testing.assert_array_equal(np.asarray(amax), np.asarray(want[2]))
        np.testing.assert_allclose(np.asarray(loss), np.asarray(want[0]), rtol=1e-6)  # sums split across shards
        np.testing.assert_allclose(np.asarray(new_bias), np.asarray(want[1]), rtol=1e-6, atol=1e-7)
        self.assertTrue(new_bias.sharding.is_equivalent_to(NamedSharding(mesh, P("model")), 1))

    def test_partially_manual_shard_map(self):
        """Inside a shard_map manual over 'data' only, with N auto-sharded on 'model': correct results.

        JAX hands custom_partitioning no mesh there (GSPMD shardings only), so the rules gather ('model' is
        replicated around the op): correct, not per shard. Documented in sharding.py.
        """
        mesh = _mesh()
        fn, args, _ = _gemm_problem(np.random.default_rng(12), (1, 1024, 512, 128), "mxfp8_e4m3", ("k", "k", "n"),
                                    "float32")

        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(None, "data"), P(), P(None, "data"), P()),
                           out_specs=(P(None, "data"), P()), axis_names={"data"}, check_vma=False)
        def per_row_shard(a, b, sfa, sfb):
            c, amax = fn(a, b, sfa, sfb)
            return c, jax.lax.pmax(amax, "data")

        specs = (P(None, "data"), P(None, "model"), P(None, "data"), P(None, "model"))
        sharded = [_put(mesh, x, s) for x, s in zip(args, specs)]
        _assert_same_result(jax.jit(per_row_shard)(*sharded), fn(*args))

    def test_k_split_fp8_c_saturates_like_the_unsharded_call(self):
        """MXFP4 into an E4M3 C, K sharded on whole atoms: the float32 partial sums are added, then C is converted as
        the unsharded call converts it: FP8 saturates at its largest finite value (a plain cast made every |C| >
        448 a NaN)."""
        mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
        d = oracle_ops.random_gemm_inputs(np.random.default_rng(31), l=1, m=32, n=32, k=1024, fmt="mxfp4",
                                          scale_log2=(2.0, 6.0))

        def fn(a, b, sfa, sfb):
            return jbg.gemm_amax(a, b, sfa, sfb, c_dtype=jnp.float8_e4m3fn)

        args = tuple(jnp.asarray(d[name]) for name in ("a", "b", "sfa_atom", "sfb_atom"))
        specs = (P(None, None, "x"), P(None, None, "x"), P(None, None, "x"), P(None, None, "x"))
        c, amax = jax.jit(fn)(*[_put(mesh, x, spec) for x, spec in zip(args, specs)])
        c_ref, amax_ref = oracle_ops.gemm_amax_oracle(d["a"], d["b"], d["sfa"], d["sfb"], k=1024, sf_vec_size=32)
        self.assertGreater(int((np.abs(c_ref) > 448).sum()), 100)
        self.assertFalse(np.isnan(np.asarray(c, np.float32)).any())
        oracle_ops.assert_gemm_close(self, c, c_ref, c_dtype=jnp.dtype(jnp.float8_e4m3fn))
        oracle_ops.assert_amax_close(self, amax, amax_ref)

    def test_k_split_with_compact_scales(self):
        """K sharded with compact scales (whole K atoms per shard): float32 partial products summed over the shards,
        each device making atoms of its own K slice of the scales; no operand gathered, C within SPEC §7's class."""
        mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
        fn, args, (c_ref, amax_ref) = _gemm_problem(np.random.default_rng(32), (1, 96, 64, 1024), "mxfp8_e4m3",
                                                    ("k", "k", "n"), "float32", scales=("compact", "compact"))
        specs = (P(None, None, "x"),) * 4
        jitted = jax.jit(fn)
        sharded = [_put(mesh, x, spec) for x, spec in zip(args, specs)]
        self.assertEmpty(_gathers(jitted.lower(*sharded).compile().as_text()))
        c, amax = jitted(*sharded)
        oracle_ops.assert_gemm_close(self, c, c_ref, c_dtype=jnp.dtype(jnp.float32))
        oracle_ops.assert_amax_close(self, amax, amax_ref)

    def test_readme_example(self):
        """README "On many GPUs": its code runs (smaller sizes), C comes back row-sharded, nothing is gathered."""
        import pathlib

        readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
        section = readme[readme.index("## On many GPUs"):]
        code = section[section.index("```python") + len("```python"):]
        code = code[:code.index("```")]
        for big, small in (("4096", "512"), ("7168", "256"), ("2048", "384")):
            code = code.replace(big, small)
        scope: dict = {}
        exec(code, scope)  # noqa: S102 (the README's own example)
        c, amax, layer, x, w = (scope[n] for n in ("c", "amax", "layer", "x", "w"))
        self.assertEqual(c.shape, (512, 384))
        self.assertTrue(c.sharding.is_equivalent_to(NamedSharding(scope["mesh"], P("x")), 2))
        self.assertEmpty(_gathers(layer.lower(x, w).compile().as_text()))
        want_c, want_amax = layer(*(jax.device_put(v, jax.devices()[0]) for v in (x, w)))
        _assert_same_result((c, amax), (want_c, want_amax))

    def test_export_sharded_program(self):
        """jax.export of a jitted sharded call: serialize, deserialize, call on the same shardings.

        custom_partitioning's rules are Python callbacks that cannot be serialized, so the exported program carries
        the local op and XLA partitions it like any op (the reference does, natively); shard_map exports the
        per-shard call explicitly, with no gather (the second half).
        """
        mesh = _mesh()
        fn, args, _ = _gemm_problem(np.random.default_rng(8), (1, 512, 256, 64), "mxfp8_e4m3", ("k", "k", "n"),
                                    "float32")
        specs = (P(None, "data"), P(None, "model"), P(None, "data"), P(None, "model"))
        shardings = tuple(NamedSharding(mesh, s) for s in specs)
        sharded = [jax.device_put(x, s) for x, s in zip(args, shardings)]
        want = fn(*args)
        exported = jax.export.export(jax.jit(fn, in_shardings=shardings))(*args)
        self.assertNotIn("CustomSPMDPartitioning", exported.mlir_module())
        restored = jax.export.deserialize(exported.serialize())
        c, amax = restored.call(*sharded)
        _assert_same_result((c, amax), want)
        self.assertTrue(c.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "data", "model")), 3))

        @functools.partial(jax.shard_map, mesh=mesh, in_specs=specs, out_specs=(P(None, "data", "model"), P()),
                           check_vma=False)
        def per_shard(a, b, sfa, sfb):
            c, amax = fn(a, b, sfa, sfb)
            return c, jax.lax.pmax(amax, ("data", "model"))

        exported = jax.export.export(jax.jit(per_shard))(*args)
        restored = jax.export.deserialize(exported.serialize())
        self.assertEmpty(_gathers(jax.jit(restored.call).lower(*sharded).compile().as_text()))
        _assert_same_result(restored.call(*sharded), want)


# name, (t, h, k), mxfp8, w_out_in, spec of the token operands (x, cos, sin, x_scale), spec of w (and w_scale),
# the outputs' spec (None: the rules gather)
PROJ_ROPE_CASES = [
    ("tokens", (256, 2, 96), False, True, P("data"), P(), P("data")),
    ("heads_w_in_out", (256, 4, 64), True, False, P(), P(None, "model"), P(None, "model")),
    ("tokens_and_heads", (512, 2, 64), True, True, P("data"), P("model"), P("data", "model")),
    ("tokens_on_two_axes", (256, 3, 64), False, False, P(("data", "model")), P(), P(("data", "model"))),
    ("one_block_per_shard_one_head", (256, 1, 32), True, True, P(("model", "data")), P(), P(("model", "data"))),
    ("gathered_tokens_off_blocks", (64, 2, 64), False, True, P("data"), P(), None),
    ("gathered_heads_off_192", (256, 3, 64), True, True, P(), P("model"), None),
    ("gathered_k", (256, 2, 128), True, True, P(None, "data"), P(None, "data"), None),
]


class RaggedShardMapTest(parameterized.TestCase):
    """The ragged ops inside jax.shard_map (its default check_vma=True): each device its tokens and its experts."""

    @parameterized.parameters("mx_ragged_dot_bf16", "mx_ragged_dot_mxfp8", "ragged_gemm_amax", "weight_only")
    def test_experts_and_their_tokens_per_device(self, op):
        """8 experts of 8 tokens each, one expert and its tokens per device: the loop's carry varies like the
        operands (a zero constant did not, and the while loop refused it), and the result is the unsharded one."""
        mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
        rng = np.random.default_rng(33)
        x = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((8, 64, 32)), jnp.float32)
        gs = jnp.full((8,), 8, jnp.int32)
        if op.startswith("mx_ragged_dot"):
            fn = functools.partial(jbg.mx_ragged_dot, recipe=op.rsplit("_", 1)[1])
        elif op == "ragged_gemm_amax":
            def fn(x, w, gs):
                a, sfa = formats.quantize_mxfp8(x)
                b, sfb = formats.quantize_mxfp8(jnp.swapaxes(w, 1, 2))
                return jbg.ragged_gemm_amax(a, b, sfa, sfb, gs)[0]
        else:
            def fn(x, w, gs):
                return jbg.weight_only_ragged_matmul(x, jax.vmap(jbg.quantize_weight)(jnp.swapaxes(w, 1, 2)), gs)
        per_device = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x")))
        _assert_same_result([per_device(x, w, gs)], [fn(x, w, gs)])


def _proj_rope_problem(rng, t, h, k, mxfp8, w_out_in):
    d = oracle_ops.random_proj_rope_inputs(rng, t=t, h=h, k=k, mxfp8=mxfp8, w_out_in=w_out_in)

    def fn(x, w, cos, sin, x_scale=None, w_scale=None):
        return jbg.gemm_proj_rope_mxfp8(x, w, cos, sin, x_scale=x_scale, w_scale=w_scale, w_out_in=w_out_in)

    names = ("x", "w", "cos", "sin") + (("x_scale", "w_scale") if mxfp8 else ())
    args = tuple(jnp.asarray(d[n]) for n in names)
    y_ref = oracle_ops.proj_rope_oracle(d["x"], d["w"], d["cos"], d["sin"], x_scale=d["x_scale"],
                                        w_scale=d["w_scale"], w_out_in=w_out_in)
    return fn, args, y_ref


class ProjRopePartitionTest(_PartitionCase):

    @parameterized.parameters(*_partitioners(PROJ_ROPE_CASES))
    def test_sharded_equals_unsharded(self, case, partitioner):
        name, (t, h, k), mxfp8, w_out_in, tok_spec, w_spec, out_spec = case
        mesh = _mesh()
        fn, args, y_ref = _proj_rope_problem(np.random.default_rng(len(name)), t, h, k, mxfp8, w_out_in)
        specs = (tok_spec, w_spec, tok_spec, tok_spec, tok_spec, w_spec)
        sharded = [_put(mesh, x, s) for x, s in zip(args, specs)]
        with partitioners.partitioner(partitioner):
            outs = self.check_partitioned(fn, args, sharded, gathers=out_spec is None, mesh=mesh,
                                          out_specs=None if out_spec is None else (out_spec,) * 4)
        oracle_ops.assert_proj_rope_close(self, outs, y_ref)

    def test_few_token_blocks_gather_only_the_column_scales(self):
        """T/32 = 4 blocks on an 8-device mesh: the rule cannot link T to out_scales_col's T/32 for Shardy (see
        sharding._linkable), so that small output is gathered after the op; no operand is."""
        mesh = _mesh()
        fn, args, _ = _proj_rope_problem(np.random.default_rng(10), 128, 2, 64, True, True)
        sharded = [_put(mesh, x, s) for x, s in zip(args, (P("data"), P(), P("data"), P("data"), P("data"), P()))]
        found = _gathers(jax.jit(fn).lower(*sharded).compile().as_text())
        self.assertNotEmpty(found)
        for line in found:
            self.assertIn("= u8[1,4,2,192]", line)  # (G, T/32, H, 192): out_scales_col, nothing else
        _assert_same_result([_bits(o) for o in jax.jit(fn)(*sharded)], [_bits(o) for o in fn(*args)])

    def test_vmap_over_tokens_and_over_weights(self):
        """vmap over token operands folds into T, vmap over the weights into the group axis; both stay sharded.

        Sharded equals unsharded bit for bit; each example is checked against its own float64 oracle (a folded
        call is a larger GEMM, whose fp32 sums XLA may order differently from the per-example call's).
        """
        mesh = _mesh()
        rng = np.random.default_rng(9)
        fn, shared, _ = _proj_rope_problem(rng, 128, 2, 64, True, True)
        per_token = [_proj_rope_problem(rng, 128, 2, 64, True, True) for _ in range(4)]
        stacked = tuple(jnp.stack([p[1][i] for p in per_token]) for i in range(6))
        d = [oracle_ops.proj_rope_oracle(p[1][0], shared[1], p[1][2], p[1][3], x_scale=p[1][4],
                                         w_scale=shared[5]) for p in per_token]
        for in_axes, args, specs, out_spec, refs in (
                ((0, None, 0, 0, 0, None), (stacked[0], shared[1], *stacked[2:5], shared[5]),
                 (P("data"), P("model"), P("data"), P("data"), P("data"), P("model")), P("data", None, "model"), d),
                (0, stacked, (P("data"),) * 6, P("data"), [p[2] for p in per_token])):
            sharded = [_put(mesh, x, s) for x, s in zip(args, specs)]
            outs = self.check_partitioned(jax.vmap(fn, in_axes=in_axes), args, sharded, gathers=False, mesh=mesh,
                                          out_specs=(out_spec,) * 4)
            for i, y_ref in enumerate(refs):
                oracle_ops.assert_proj_rope_close(self, [o[i] for o in outs], y_ref)


if __name__ == "__main__":
    absltest.main()
