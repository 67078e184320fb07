"""`quantize_pair` (both MX quantizations of a weight in one pass) on the CPU: the reference against the float64
oracle bit for bit (values along R, codes and scales along C), tails, errors at trace time, vmap, sharding on 8 host
devices, the CUDA lowering without a GPU, the handler's buffer checks and the kernels compiled for sm_90a.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax, when run directly

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_blockgemm import formats, selfcheck
from jax_blockgemm.quantize_pair import quantize_pair

import oracle
import oracle_ops
import partitioners

_CODES = {"mxfp8_e4m3": (oracle.E4M3, 448.0), "mxfp8_e5m2": (oracle.E5M2, 57344.0)}


def random_weights(rng: np.random.Generator, shape, *, specials: bool = False, tiny: bool = False) -> np.ndarray:
    """bf16 weights with scales spread per row and per column (2**-20 .. 2**20, so both block directions see
    different amaxes), with `specials` a NaN, a +inf, a -inf and an all-zero 32 x 32 tile, and with `tiny` a tile of
    values near 2**-130, whose blocks take the smallest scale (2**-127) and whose values are bf16 subnormals (XLA:CPU
    flushes those: GPU only)."""
    b, r, c = shape
    w = rng.normal(size=shape) * np.exp2(rng.integers(-20, 21, size=(b, r, 1))) \
        * np.exp2(rng.integers(-20, 21, size=(1, 1, c)))
    if specials:
        w[0, rng.integers(r), rng.integers(c)] = np.nan
        w[-1, rng.integers(r), rng.integers(c)] = np.inf
        w[0, rng.integers(r), rng.integers(c)] = -np.inf
        w[-1, :32, -32:] = 0.0
    if tiny:
        w[0, -32:, :32] = rng.normal(size=(32, 32)) * 2.0 ** -130
    return w.astype(ml_dtypes.bfloat16)


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8)


def assert_matches_oracle(test, w, got, row_format: str, col_format: str) -> None:
    """(values, codes, scales) equal the float64 oracle's: codes and scale bytes bit for bit, values bit for bit
    where finite and NaN exactly where the oracle's are."""
    values, codes, scales = (np.asarray(x) for x in got)
    w64 = np.asarray(w).astype(np.float64)
    code_dtype, emax = _CODES[col_format]
    want_codes, want_scales = oracle.quantize_mx_f64(w64, emax=emax, code_dtype=code_dtype, axis=-1)
    np.testing.assert_array_equal(scales, want_scales, err_msg="scales")
    np.testing.assert_array_equal(_bits(codes), _bits(want_codes.astype(code_dtype)), err_msg="codes")
    want_values = oracle_ops.fake_quant_f64(w64, row_format, axis=-2).astype(ml_dtypes.bfloat16)
    nan = np.isnan(want_values.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(values.astype(np.float32)), nan, err_msg="NaN values")
    np.testing.assert_array_equal(_bits(values)[~nan], _bits(want_values)[~nan], err_msg="values")
    test.assertFalse(nan.all(), "the inputs hold finite blocks")


class ReferenceTest(parameterized.TestCase):

    @parameterized.product(shape=((1, 32, 32), (2, 64, 96), (3, 40, 70)),
                           formats=(("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp8_e4m3", "mxfp8_e5m2"),
                                    ("mxfp8_e5m2", "mxfp8_e4m3")))
    def test_against_oracle(self, shape, formats):
        """Whole blocks and tails (R = 40, C = 70: partial blocks both ways), spread scales, NaN, inf, zeros."""
        w = random_weights(np.random.default_rng(sum(shape)), shape, specials=True)
        row, col = formats
        got = jax.jit(lambda w: quantize_pair(w, row_format=row, col_format=col))(w)
        assert_matches_oracle(self, w, got, row, col)

    def test_float32_weights_and_leading_dims(self):
        """float32 w is quantized from its own values (not rounded to bf16 first); leading dims fold and unfold."""
        rng = np.random.default_rng(7)
        w = rng.normal(size=(2, 3, 64, 32)).astype(np.float32) * 3
        values, codes, scales = quantize_pair(w)
        self.assertEqual((values.shape, codes.shape, scales.shape), ((2, 3, 64, 32), (2, 3, 64, 32), (2, 3, 64, 1)))
        want_values = formats.quantize_dequantize(jnp.asarray(w), "mxfp8_e4m3", axis=-2).astype(jnp.bfloat16)
        want_codes, want_scales = formats.quantize_mxfp8(jnp.asarray(w), axis=-1)
        np.testing.assert_array_equal(_bits(values), _bits(want_values))
        np.testing.assert_array_equal(_bits(codes), _bits(want_codes))
        np.testing.assert_array_equal(scales, want_scales)

    def test_vmap(self):
        w = random_weights(np.random.default_rng(8), (4, 64, 64))
        batched = jax.vmap(quantize_pair)(w[:, None])
        for got, want in zip(batched, quantize_pair(w[:, None])):
            np.testing.assert_array_equal(_bits(got), _bits(want))

    def test_errors_at_trace_time(self):
        with self.assertRaisesRegex(TypeError, "w has dtype int32; allowed: bfloat16, float32"):
            quantize_pair(jnp.zeros((32, 32), jnp.int32))
        with self.assertRaisesRegex(ValueError, r"\(\.\.\., R, C\)"):
            quantize_pair(jnp.zeros((32,), jnp.bfloat16))
        with self.assertRaisesRegex(ValueError, "row_format='mxfp4' is not supported"):
            quantize_pair(jnp.zeros((32, 32)), row_format="mxfp4")
        with self.assertRaisesRegex(ValueError, "implementation='cutedsl'.*no CuTeDSL kernel on platform cpu"):
            jax.jit(lambda w: quantize_pair(w, implementation="cutedsl")).lower(jnp.zeros((32, 32), jnp.bfloat16))


def assert_mapped_matches_oracle(test, w, row_map, got, row_format: str, col_format: str, col_values: bool):
    """The values are the oracle's of the rows the map names (zeros elsewhere), the column blocks w's own: codes and
    scale bytes bit for bit, or with col_values the bf16 values of the codes; NaN exactly where the oracle's are."""
    w64 = np.asarray(w).astype(np.float64)
    inside = (row_map >= 0) & (row_map < w64.shape[-2])
    rows = np.where(inside[:, None], w64[np.clip(row_map, 0, w64.shape[-2] - 1)], 0.0)
    values, codes, scales = (np.asarray(x) for x in got)
    code_dtype, emax = _CODES[col_format]
    want_codes, want_scales = oracle.quantize_mx_f64(w64, emax=emax, code_dtype=code_dtype, axis=-1)
    np.testing.assert_array_equal(scales, want_scales, err_msg="scales")
    checks = [("values", values, oracle_ops.fake_quant_f64(rows, row_format, axis=-2).astype(ml_dtypes.bfloat16))]
    if col_values:
        checks.append(("column values", codes,
                       oracle_ops.fake_quant_f64(w64, col_format, axis=-1).astype(ml_dtypes.bfloat16)))
    else:
        np.testing.assert_array_equal(_bits(codes), _bits(want_codes.astype(code_dtype)), err_msg="codes")
    for name, g, want in checks:
        nan = np.isnan(want.astype(np.float32))
        np.testing.assert_array_equal(np.isnan(g.astype(np.float32)), nan, err_msg=f"NaN {name}")
        np.testing.assert_array_equal(_bits(g)[~nan], _bits(want)[~nan], err_msg=name)
        test.assertFalse(nan.all(), "the inputs hold finite blocks")


class RowMapTest(parameterized.TestCase):

    @parameterized.product(shape=((70, 96), (33, 70), (64, 32)), col_values=(False, True),
                           formats=(("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp8_e5m2", "mxfp8_e4m3"),
                                    ("mxfp8_e5m2", "mxfp8_e5m2")))
    def test_against_oracle(self, shape, col_values, formats):
        """Any number of w's rows (70, 33), the map's rows whole blocks or not (a tail of 70 columns), empty and
        out-of-range entries reading zeros, NaN, inf and a zero tile; the row blocks follow the map, the column
        blocks stay w's."""
        rng = np.random.default_rng(sum(shape) + col_values)
        w = random_weights(rng, (1, *shape), specials=True)[0]
        row_map = selfcheck.random_row_map(rng, shape[0], shape[0] + 40)
        row, col = formats
        got = jax.jit(lambda w, m: quantize_pair(w, row_format=row, col_format=col, row_map=m,
                                                 col_values=col_values))(w, row_map)
        self.assertEqual([x.shape for x in got], [(shape[0] + 40, shape[1]), shape, (shape[0], -(-shape[1] // 32))])
        assert_mapped_matches_oracle(self, w, row_map, got, row, col, col_values)

    def test_leading_dims_and_vmap(self):
        """Each batch's map names its own rows: the batched call, vmap over both operands and vmap over w alone
        (one map for every batch) equal per-batch calls."""
        rng = np.random.default_rng(3)
        w = random_weights(rng, (3, 40, 64))
        maps = np.stack([selfcheck.random_row_map(rng, 40, 64) for _ in range(3)])
        f = lambda w, m: quantize_pair(w, row_map=m, col_values=True)
        each = [f(w[i], maps[i]) for i in range(3)]
        for got in (f(w, maps), jax.vmap(f)(w, maps)):
            for i in range(3):
                for g, want in zip(got, each[i]):
                    np.testing.assert_array_equal(_bits(g[i]), _bits(want))
        shared = jax.vmap(f, in_axes=(0, None))(w, maps[0])
        for i in range(3):
            for g, want in zip(shared, f(w[i], maps[0])):
                np.testing.assert_array_equal(_bits(g[i]), _bits(want))

    def test_errors_at_trace_time(self):
        w = jnp.zeros((40, 64), jnp.bfloat16)
        with self.assertRaisesRegex(TypeError, "row_map has dtype int64; allowed: int32"):
            quantize_pair(w, row_map=np.zeros(64, np.int64))
        with self.assertRaisesRegex(ValueError, r"row_map must be \(\.\.\., R'\) with w's leading dimensions"):
            quantize_pair(w, row_map=np.zeros((2, 64), np.int32))

    def test_sharded_columns(self):
        """With a map the columns shard on whole blocks and the rows stay whole: equal to the unsharded call."""
        mesh = jax.make_mesh((4, 2), ("x", "y"))
        rng = np.random.default_rng(5)
        w = random_weights(rng, (1, 72, 512))[0]
        row_map = selfcheck.random_row_map(rng, 72, 128)
        f = jax.jit(lambda w, m: quantize_pair(w, row_map=m))
        for spec in (P(None, "x"), P("x", "y")):
            got = f(jax.device_put(w, NamedSharding(mesh, spec)), row_map)
            for g, want in zip(got, f(w, row_map)):
                np.testing.assert_array_equal(_bits(g), _bits(want))


class ShardingTest(parameterized.TestCase):

    @parameterized.parameters(*((spec, "shardy") for spec in (P("x", None, None), P(None, "x", None),
                                                                P(None, None, "x"), P("x", "y", None),
                                                                P(None, "x", "y"))),
                              (P("x", "y", None), "gspmd"), (P(None, "x", "y"), "gspmd"))
    def test_sharded_equals_unsharded(self, spec, partitioner):
        """B, R and C shard on whole blocks (each shard 32 x n rows or columns); the results equal the unsharded
        call's bit for bit and keep the shard layout (no gather)."""
        mesh = jax.make_mesh((4, 2), ("x", "y"))
        w = random_weights(np.random.default_rng(9), (8, 256, 256))
        ws = jax.device_put(w, NamedSharding(mesh, spec))
        with partitioners.partitioner(partitioner):
            got = jax.jit(quantize_pair)(ws)
            hlo = jax.jit(quantize_pair).lower(ws).compile().as_text()
        for g, want in zip(got, quantize_pair(w)):
            np.testing.assert_array_equal(_bits(g), _bits(want))
        for g in got:
            self.assertTrue(g.sharding.is_equivalent_to(NamedSharding(mesh, spec), 3), g.sharding)
        self.assertNotIn("all-gather", hlo)


class LoweringTest(absltest.TestCase):

    def _cuda_text(self, w) -> str:
        return jax.jit(quantize_pair).trace(w).lower(lowering_platforms=("cuda",)).as_text()

    def test_kernel_call_where_one_applies(self):
        """bf16 w with whole blocks lowers to one jbg_quantize_pair call on CUDA; float32 w and tails keep the
        reference (no custom call)."""
        text = self._cuda_text(jnp.zeros((2, 64, 512), jnp.bfloat16))
        self.assertEqual(text.count("custom_call @jbg_quantize_pair("), 1)
        self.assertNotIn("jbg_quantize_pair", self._cuda_text(jnp.zeros((2, 64, 512), jnp.float32)))
        self.assertNotIn("jbg_quantize_pair", self._cuda_text(jnp.zeros((2, 64, 500), jnp.bfloat16)))
        # rows no multiple of 32 per matrix (a row block would cross two), though the batch's 2 x 48 = 96 are
        self.assertNotIn("jbg_quantize_pair", self._cuda_text(jnp.zeros((2, 48, 512), jnp.bfloat16)))

    def test_row_map_takes_the_gather_kernels(self):
        """With a row map the call lowers to one jbg_quantize_pair call taking w and the map (schedule 1, or 2 for
        col_values); col_values without a map has no kernel (the reference)."""
        w, row_map = jnp.zeros((70, 512), jnp.bfloat16), jnp.zeros((128,), jnp.int32)
        for col_values, schedule in ((False, 1), (True, 2)):
            text = jax.jit(lambda w, m: quantize_pair(w, row_map=m, col_values=col_values)).trace(
                w, row_map).lower(lowering_platforms=("cuda",)).as_text()
            calls = [line for line in text.splitlines() if "custom_call @jbg_quantize_pair(" in line]
            self.assertEqual(len(calls), 1)
            self.assertRegex(calls[0], r"jbg_quantize_pair\(%[^,]+, %[^)]+\)")  # two operands
            self.assertIn(f"schedule = {schedule} : i64", text)
        text = jax.jit(lambda w: quantize_pair(w, col_values=True)).trace(
            jnp.zeros((64, 512), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
        self.assertNotIn("jbg_quantize_pair", text)

    def test_kernel_takes_whole_row_blocks_per_matrix(self):
        """Without a row map the dispatch refuses matrices whose rows are no multiple of 32 even where their batch's
        rows are (a row block of the folded matrix would span two), saying why."""
        from jax_blockgemm import dispatch

        choice = dispatch.quantize_pair_kernels(
            [jax.core.ShapedArray((2, 48, 512), jnp.bfloat16)], row_format="mxfp8_e4m3", col_format="mxfp8_e4m3",
            col_values=False, implementation=None)
        self.assertFalse(choice.variants)
        self.assertIn("without a row map the kernels take R a multiple of 32; got w (2, 48, 512)", choice.reason)

    def test_scale_rule_floor_keeps_the_reference(self):
        with formats.scale_rule("floor"):
            self.assertNotIn("jbg_quantize_pair", self._cuda_text(jnp.zeros((1, 64, 64), jnp.bfloat16)))


class HandlerChecksTest(absltest.TestCase):
    """The execute stage's buffer checks (ffi/quantize_pair.cc), through the extension's test hook."""

    def setUp(self):
        from jax_blockgemm import _native

        self.ext = _native.extension()

    def _check(self, w_shape, *, values=None, codes=None, scales=None, codes_dtype="float8_e4m3fn", address=256):
        scale_shape = (*w_shape[:-1], w_shape[-1] // 32)
        specs = [("bfloat16", list(w_shape), address), ("bfloat16", list(values or w_shape), address),
                 (codes_dtype, list(codes or w_shape), address), ("uint8", list(scales or scale_shape), address)]
        return self.ext.check_quantize_pair_buffers(specs)

    def test_accepts_and_folds_leading_dims(self):
        self.assertEqual(self._check((3, 64, 96)), ("", (192, 96, 192)))
        self.assertEqual(self._check((64, 32), codes_dtype="float8_e5m2"), ("", (64, 32, 64)))
        # past 2**31 elements in w is fine (the kernel addresses in 64 bits); the scales stay below
        self.assertEqual(self._check((65600, 32768))[0], "")

    def test_refuses(self):
        self.assertRegex(self._check((64, 48))[0], "w has shape .* multiples of 32")
        self.assertRegex(self._check((40, 64))[0], "w has shape .* multiples of 32")
        self.assertRegex(self._check((64, 64), values=[64, 32])[0], "values has shape")
        self.assertRegex(self._check((64, 64), codes_dtype="uint8")[0], "codes has shape .* float8_e4m3fn or")
        self.assertRegex(self._check((64, 64), scales=[64, 1])[0], r"scales has shape .* uint8 \(64, 2\)")
        self.assertRegex(self._check((64, 64), address=8)[0], "16-byte aligned")
        self.assertRegex(self._check((2**26, 2**11))[0], "fewer than 2\\*\\*31 scales")

    def _check_gather(self, w_shape, map_shape, *, values=None, codes_dtype="float8_e4m3fn", schedule=1,
                      map_dtype="int32", scales=None):
        scale_shape = (*w_shape[:-1], w_shape[-1] // 32)
        specs = [("bfloat16", list(w_shape), 256), (map_dtype, list(map_shape), 512),
                 ("bfloat16", list(values or (*map_shape, w_shape[-1])), 256), (codes_dtype, list(w_shape), 256),
                 ("uint8", list(scales or scale_shape), 256)]
        return self.ext.check_quantize_pair_buffers(specs, schedule)

    def test_gather_schedules(self):
        """With a row map w's rows may be any number (here 70), the values have the map's rows, and the column
        blocks are codes (gather) or bf16 values (gather_values)."""
        self.assertEqual(self._check_gather((1, 70, 96), (1, 128)), ("", (128, 96, 70)))
        self.assertEqual(self._check_gather((70, 96), (128,), codes_dtype="bfloat16", schedule=2), ("", (128, 96, 70)))
        self.assertRegex(self._check_gather((70, 96), (100,))[0], "row_map has shape .* multiple of 32 entries")
        self.assertRegex(self._check_gather((70, 96), (128,), map_dtype="float32")[0], "row_map .* int32")
        self.assertRegex(self._check_gather((70, 96), (128,), values=[70, 96])[0], r"values .* bfloat16 \(128, 96\)")
        self.assertRegex(self._check_gather((70, 96), (128,), codes_dtype="bfloat16")[0], "codes .* float8_e4m3fn")
        self.assertRegex(self._check_gather((70, 96), (128,), schedule=2)[0], r"codes .* bfloat16 \(70, 96\)")
        self.assertRegex(self._check_gather((70, 80), (128,))[0], "w has shape .* last dimension a positive multiple")
        self.assertRegex(self._check_gather((70, 96), (128,), scales=[70, 2])[0], r"scales .* uint8 \(70, 3\)")


if __name__ == "__main__":
    absltest.main()
