"""jax_blockgemm.formats against the float64 oracles of tests/oracle.py (SPEC §1-§3), bit-exactly, eager and jitted."""

import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest, parameterized

import oracle
import oracle_ops
from jax_blockgemm import formats as F

_E4M3, _E5M2, _E2M1 = np.dtype(F.E4M3), np.dtype(F.E5M2), np.dtype(F.E2M1)
_EMAX = {_E4M3: 448.0, _E5M2: 57344.0, _E2M1: 6.0}


def _seed(*args) -> int:
    """A reproducible seed per test case (str hashes vary between processes)."""
    return zlib.crc32(repr(args).encode())


def _bits(a) -> np.ndarray:
    """Raw bytes of a 1-byte-element array (codes or scales), for bit-exact comparison (-0, NaN payloads)."""
    a = np.asarray(a)
    assert a.dtype.itemsize == 1, a.dtype
    return a.view(np.uint8)


def _hard_input(rng: np.random.Generator, shape, axis: int, block: int) -> np.ndarray:
    """float32 data spanning ~80 binades, with zero, NaN, +inf, -inf, saturating and subnormal blocks."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-60, 60, size=shape[:-1] + (1,)))
    x = np.moveaxis(x.astype(np.float32), axis, -1).copy()
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[-1]
    rows = rng.permutation(flat.shape[0])
    flat[rows[0], :min(block, n)] = 0.0                              # an all-zero (first) block
    flat[rows[1], rng.integers(n)] = np.nan                            # NaN blocks
    flat[rows[2], rng.integers(n)] = np.inf
    flat[rows[3], rng.integers(n)] = -np.inf
    flat[rows[4]] = np.float32(3e38) * rng.choice([-1, 1], n)          # near float32 max
    flat[rows[5]] = rng.standard_normal(n).astype(np.float32) * np.float32(1e-41)  # float32 subnormals
    flat[rows[6], -1] = -0.0                                           # a lonely negative zero
    return np.moveaxis(x, -1, axis)


def _quantize(fmt: str, x, axis: int, *, jit: bool, packed: bool = False, rule=None):
    """Call the formats quantizer for `fmt` (optionally under jit); return numpy (codes, scales)."""
    def run(x):
        if fmt in ("e4m3", "e5m2"):
            return F.quantize_mxfp8(x, axis=axis, dtype=F.E4M3 if fmt == "e4m3" else F.E5M2, rule=rule)
        if fmt == "mxfp4":
            return F.quantize_mxfp4(x, axis=axis, packed=packed, rule=rule)
        return F.quantize_nvfp4(x, axis=axis, packed=packed)
    c, s = (jax.jit(run) if jit else run)(jnp.asarray(x))
    return np.asarray(c), np.asarray(s)


def _quantize_fn(fmt: str):
    """The formats quantizer for `fmt` with default arguments (FP4 codes packed)."""
    return {"e4m3": F.quantize_mxfp8, "e5m2": lambda x: F.quantize_mxfp8(x, dtype=F.E5M2),
            "mxfp4": F.quantize_mxfp4, "nvfp4": F.quantize_nvfp4}[fmt]


def _oracle(fmt: str, x, axis: int, rule: str = "ceil"):
    if fmt == "nvfp4":
        return oracle.quantize_nvfp4_f64(x, axis=axis)
    dtype = {"e4m3": _E4M3, "e5m2": _E5M2, "mxfp4": _E2M1}[fmt]
    return oracle.quantize_mx_f64(x, emax=_EMAX[dtype], code_dtype=dtype, axis=axis, rule=rule)


class QuantizeTest(parameterized.TestCase):

    @parameterized.product(fmt=["e4m3", "e5m2", "mxfp4", "nvfp4"], axis=[-1, 0],
                           shape_jit=[((24, 203), False), ((16, 128), True), ((3, 9, 70), True)])
    def test_matches_oracle(self, fmt, axis, shape_jit):
        shape, jit = shape_jit
        rng = np.random.default_rng(_seed(fmt, axis, shape, jit))
        block = 16 if fmt == "nvfp4" else 32
        x = _hard_input(rng, shape, axis, block)
        codes, scales = _quantize(fmt, x, axis, jit=jit)
        want_codes, want_scales = _oracle(fmt, x, axis)
        self.assertEqual(codes.dtype, want_codes.dtype)
        self.assertEqual(scales.dtype, np.uint8 if fmt != "nvfp4" else _E4M3)
        np.testing.assert_array_equal(_bits(codes), _bits(want_codes))
        np.testing.assert_array_equal(_bits(scales), _bits(want_scales))
        # sanity of the special blocks themselves, not only agreement with the oracle
        nb = -(-shape[axis] // block)
        self.assertEqual(scales.shape[axis], nb)
        s = oracle.scales_to_f64(scales)
        has_nonfinite = ~np.isfinite(oracle._blocks(x, axis, block)[0]).all(-1)
        np.testing.assert_array_equal(np.isnan(np.moveaxis(s, axis, -1)), has_nonfinite)
        self.assertTrue(np.isfinite(oracle.codes_to_f64(codes)).all())

    @parameterized.product(fmt=["e4m3", "e5m2", "mxfp4"], jit=[False, True])
    def test_round_up_boundary(self, fmt, jit):
        """amax = emax*2**e exactly and one float32 ulp either side: bytes e+127, e+127, e+128 (ceil rule)."""
        dtype = {"e4m3": _E4M3, "e5m2": _E5M2, "mxfp4": _E2M1}[fmt]
        emax = np.float32(_EMAX[dtype])
        rng = np.random.default_rng(7)
        exps = np.array([-100, -20, -3, 0, 5, 40, 100])
        on = (emax * np.exp2(exps)).astype(np.float32)
        amaxes = np.stack([np.nextafter(on, np.float32(0)), on, np.nextafter(on, np.float32(np.inf))], axis=1)
        x = (rng.uniform(-1, 1, (amaxes.size, 32)) * amaxes.reshape(-1, 1)).astype(np.float32)
        x[np.arange(amaxes.size), rng.integers(32, size=amaxes.size)] = amaxes.ravel() * rng.choice([-1, 1],
                                                                                                    amaxes.size)
        codes, scales = _quantize(fmt, x, -1, jit=jit)
        want = np.stack([exps, exps, exps + 1], axis=1).ravel() + 127
        np.testing.assert_array_equal(scales[:, 0], want.astype(np.uint8))
        want_codes, want_scales = _oracle(fmt, x, -1)
        np.testing.assert_array_equal(_bits(codes), _bits(want_codes))
        np.testing.assert_array_equal(scales, want_scales)
        # the element at amax exactly on the boundary becomes +-emax (the largest code), not saturated noise
        vals = np.abs(oracle.codes_to_f64(codes)).max(axis=1).reshape(-1, 3)
        np.testing.assert_array_equal(vals[:, 1], emax)

    @parameterized.parameters("e4m3", "e5m2", "mxfp4")
    def test_floor_rule_switch_and_restore(self, fmt):
        rng = np.random.default_rng(11)
        x = _hard_input(rng, (20, 96), -1, 32)
        x[0, :32] = np.float32(1.9) * np.float32(2.0**5)  # mantissa > 1.75: the two rules must differ here
        self.assertEqual(F.get_scale_rule(), "ceil")
        with F.scale_rule("floor"):
            self.assertEqual(F.SCALE_RULE, "floor")
            codes, scales = _quantize(fmt, x, -1, jit=True)
        self.assertEqual(F.SCALE_RULE, "ceil")
        want_codes, want_scales = _oracle(fmt, x, -1, rule="floor")
        np.testing.assert_array_equal(_bits(codes), _bits(want_codes))
        np.testing.assert_array_equal(scales, want_scales)
        _, ceil_scales = _quantize(fmt, x, -1, jit=True)
        self.assertEqual(int(ceil_scales[0, 0]), int(scales[0, 0]) + 1)
        # explicit rule= and set_scale_rule agree with the context manager
        _, s2 = _quantize(fmt, x, -1, jit=False, rule="floor")
        np.testing.assert_array_equal(s2, scales)
        F.set_scale_rule("floor")
        try:
            _, s3 = _quantize(fmt, x, -1, jit=False)
        finally:
            F.set_scale_rule("ceil")
        np.testing.assert_array_equal(s3, scales)

    def test_rule_restored_on_error_and_validated(self):
        with self.assertRaises(RuntimeError):
            with F.scale_rule("floor"):
                raise RuntimeError("boom")
        self.assertEqual(F.SCALE_RULE, "ceil")
        with self.assertRaisesRegex(ValueError, "rule.*'round'"):
            F.set_scale_rule("round")
        with self.assertRaisesRegex(ValueError, "rule"):
            F.quantize_mxfp8(jnp.ones((4, 32)), rule="nearest")

    @parameterized.parameters("ceil", "floor")
    def test_scale_exponent_exact(self, rule):
        rng = np.random.default_rng(3)
        bits = rng.integers(1, 0x7F800000, size=20000, dtype=np.int64).astype(np.uint32)  # every positive finite
        amax = bits.view(np.float32)
        for emax in (448.0, 57344.0, 6.0):
            on = (emax * np.exp2(np.arange(-130, 112))).astype(np.float32)  # stays below float32 max
            on = on[on > 0]
            a = np.concatenate([amax, on, np.nextafter(on, np.float32(0)), np.nextafter(on, np.float32(np.inf))])
            got = np.asarray(jax.jit(lambda a: F.scale_exponent(a, emax, rule=rule))(a))
            np.testing.assert_array_equal(got, oracle.mx_exponent_f64(a, emax, rule))
        specials = np.array([0.0, np.nan, np.inf], np.float32)
        np.testing.assert_array_equal(np.asarray(F.scale_exponent(specials, 448.0)), [-127, 128, 128])

    def test_e2m1_rounding_ties_and_saturation(self):
        grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])
        mids = (grid[1:] + grid[:-1]) / 2                      # .25 .75 1.25 1.75 2.5 3.5 5
        want_mid = np.array([0, 1, 1, 2, 2, 4, 4])            # ties go to the even code
        y = np.concatenate([mids, -mids, [6.5, 7, 1e30, -9]])
        want = np.concatenate([want_mid, -want_mid, [6, 6, 6, -6]])
        got = np.asarray(jax.jit(F.round_to_e2m1)(jnp.asarray(y, jnp.float32))).astype(np.float64)
        np.testing.assert_array_equal(got, want)
        rng = np.random.default_rng(5)
        y = (rng.standard_normal(5000) * 3).astype(np.float32)
        np.testing.assert_array_equal(_bits(F.round_to_e2m1(y)), _bits(oracle.round_to_dtype_f64(y, _E2M1)))

    def test_nvfp4_scale_rule(self):
        """Scale = RNE(amax/6) in E4M3, bumped one step when amax/scale > 6; zero -> 0; NaN/inf -> NaN."""
        amax = np.array([6.0 * 1.06, 6.0 * 1.05, 6.0, 0.0, 6 * 2.0**-12, 6 * 448.0 * 4, 6 * 1.0625], np.float32)
        want = np.array([1.125, 1.125, 1.0, 0.0, 2.0**-9, 448.0, 1.125])
        x = np.zeros((amax.size + 1, 16), np.float32)
        x[:-1, 3] = amax
        x[:-1, 7] = -amax / 3
        x[-1, 5] = np.nan
        codes, scales = _quantize("nvfp4", x, -1, jit=True)
        s = scales.astype(np.float64)[:, 0]
        np.testing.assert_array_equal(s[:-1], want)
        self.assertTrue(np.isnan(s[-1]))
        np.testing.assert_array_equal(_bits(codes[-1]), 0)
        deq = oracle.dequantize_f64(codes[:-1], scales[:-1], block=16)
        self.assertTrue((np.abs(deq[:, 3]) <= np.maximum(amax.astype(np.float64), 6 * 448.0)).all())

    def test_vmap_and_low_precision_inputs(self):
        rng = np.random.default_rng(29)
        x = _hard_input(rng, (4, 6, 80), -1, 32)
        codes, scales = jax.vmap(lambda v: F.quantize_mxfp8(v))(jnp.asarray(x))
        want_codes, want_scales = _oracle("e4m3", x, -1)
        np.testing.assert_array_equal(_bits(codes), _bits(want_codes))
        np.testing.assert_array_equal(np.asarray(scales), want_scales)
        xb = jnp.asarray(rng.standard_normal((5, 48)) * 1e3, jnp.bfloat16)
        codes, scales = F.quantize_nvfp4(xb, packed=False)
        want_codes, want_scales = _oracle("nvfp4", np.asarray(xb.astype(jnp.float32)), -1)
        np.testing.assert_array_equal(_bits(codes), _bits(want_codes))
        np.testing.assert_array_equal(_bits(scales), _bits(want_scales))

    def test_nvfp4_tensor_scales(self):
        """x · encode (encode = 6·448 / max|x| in float32) quantizes to the same codes eagerly and under jit, those
        of the float32 oracle; a quotient x / alpha did not (XLA rewrites it into a product with the rounded
        reciprocal: element 10, 0.75 at its block scale, a tie, rounded to 0.5 under jit and to 1.0 eagerly)."""
        x = jnp.asarray([-0.451171875, -1.140625, 1.140625, 0.67578125, 0.74609375, 0.46875, 0.89453125, 0.421875,
                         -0.173828125, 1.0078125, 0.23828125, -0.53515625, 0.3515625, -1.90625, 0.1455078125,
                         -0.66796875], jnp.bfloat16)

        def quantize(v):
            encode, alpha = F.nvfp4_tensor_scales(v)
            return (*F.quantize_nvfp4(v.astype(jnp.float32) * encode, packed=False), alpha)

        eager, jitted = quantize(x), jax.jit(quantize)(x)
        encode, alpha = oracle_ops.nvfp4_tensor_factors(np.asarray(x.astype(jnp.float32)))
        want_codes, want_scales = oracle.quantize_nvfp4_f64(np.asarray(x, np.float32) * encode)
        for got in (eager, jitted):
            np.testing.assert_array_equal(_bits(got[0]), _bits(want_codes))
            np.testing.assert_array_equal(_bits(got[1]), _bits(want_scales))
            self.assertEqual(float(got[2]), float(alpha))
        self.assertEqual(float(_bits(want_codes)[10]), float(_bits(jnp.asarray(1.0, F.E2M1))))
        for special in (jnp.zeros((4,)), jnp.asarray([1.0, jnp.inf]), jnp.asarray([jnp.nan, 2.0])):
            self.assertEqual([float(f) for f in F.nvfp4_tensor_scales(special)], [1.0, 1.0])

    def test_empty_axes(self):
        """An empty axis, the block axis or another, gives empty codes and scales of the right shapes."""
        for shape, axis in (((0, 64), -1), ((4, 0), 0), ((2, 0, 64), 2), ((4, 0), -1)):
            x = jnp.ones(shape, jnp.float32)
            kb = -(-shape[axis] // 32)
            scale_shape = tuple(kb if d == axis % len(shape) else s for d, s in enumerate(shape))
            for name, q in (("mxfp8", F.quantize_mxfp8), ("mxfp4", lambda v, axis: F.quantize_mxfp4(v, axis=axis,
                                                                                                   packed=False)),
                            ("nvfp4", lambda v, axis: F.quantize_nvfp4(v, axis=axis, block=32, packed=False))):
                with self.subTest(shape=shape, axis=axis, fmt=name):
                    codes, scales = q(x, axis=axis)
                    self.assertEqual((codes.shape, scales.shape), (shape, scale_shape))
            self.assertEqual(F.quantize_dequantize(x, "mxfp8_e4m3", axis=axis).shape, shape)
        codes, scales = F.quantize_mxfp4(jnp.ones((0, 64)))
        self.assertEqual((codes.shape, scales.shape), ((0, 32), (0, 2)))

    def test_invalid_arguments(self):
        x = jnp.ones((4, 32), jnp.float32)
        with self.assertRaisesRegex(ValueError, "dtype.*float8_e4m3fn or float8_e5m2"):
            F.quantize_mxfp8(x, dtype=jnp.bfloat16)
        with self.assertRaisesRegex(ValueError, "axis.*5"):
            F.quantize_mxfp4(x, axis=5)
        with self.assertRaisesRegex(ValueError, "block.*0"):
            F.quantize_nvfp4(x, block=0)
        with self.assertRaisesRegex(ValueError, r"quantize_mxfp8: block=1000000000 is longer than axis 1 \(32 "
                                                r"elements\) rounded up to a multiple of 32; allowed: at most 32"):
            jax.eval_shape(lambda v: F.quantize_mxfp8(v, block=10**9), x)
        with self.assertRaisesRegex(ValueError, "quantize_nvfp4: block=128 is longer than axis 0"):
            F.quantize_nvfp4(jnp.ones((40, 4)), axis=0, block=128)
        self.assertEqual(F.quantize_mxfp8(jnp.ones((3, 40)), block=64)[1].shape, (3, 1))  # 40 rounds up to 64
        self.assertEqual(F.quantize_nvfp4(jnp.ones((3, 5)), block=32, packed=False)[1].shape, (3, 1))
        with self.assertRaisesRegex(ValueError, "last axis.*even"):
            F.quantize_mxfp4(jnp.ones((4, 33)))
        with self.assertRaisesRegex(TypeError, "floating-point.*int32"):
            F.quantize_mxfp8(jnp.ones((4, 32), jnp.int32))
        with self.assertRaisesRegex(TypeError, "quantize_nvfp4: x must be a floating-point array; got NoneType"):
            F.quantize_nvfp4(None)
        with self.assertRaisesRegex(ValueError, "emax"):
            F.emax(jnp.float32)


class PackTest(parameterized.TestCase):

    def test_hand_built_bytes(self):
        codes = np.array([[0.5, -1.0, 6.0, 0.0, -6.0, 1.5]], np.float32).astype(_E2M1)
        want = np.array([[0xA1, 0x07, 0x3F]], np.uint8)   # 0.5=0x1 | -1=0xA<<4, 6=0x7 | 0=0x0, -6=0xF | 1.5=0x3
        np.testing.assert_array_equal(np.asarray(F.pack_fp4(codes)), want)
        np.testing.assert_array_equal(_bits(F.unpack_fp4(want)), _bits(codes))
        np.testing.assert_array_equal(oracle.codes_to_f64(want), codes.astype(np.float64))

    @parameterized.parameters(((7, 10),), ((2, 3, 64),), ((2,),))
    def test_round_trips(self, shape):
        rng = np.random.default_rng(len(shape))
        packed = rng.integers(0, 256, size=shape, dtype=np.uint8)
        codes = jax.jit(F.unpack_fp4)(packed)
        self.assertEqual(codes.shape, shape[:-1] + (2 * shape[-1],))
        np.testing.assert_array_equal(np.asarray(jax.jit(F.pack_fp4)(codes)), packed)
        np.testing.assert_array_equal(np.asarray(codes).astype(np.float64), oracle.codes_to_f64(packed))

    @parameterized.product(fmt=["mxfp4", "nvfp4"], axis=[-1, 0])
    def test_packed_quantizer_output(self, fmt, axis):
        rng = np.random.default_rng(17)
        x = _hard_input(rng, (34, 100), axis, 32)
        packed, s1 = _quantize(fmt, x, axis, jit=True, packed=True)
        codes, s2 = _quantize(fmt, x, axis, jit=False, packed=False)
        self.assertEqual(packed.dtype, np.uint8)
        self.assertEqual(packed.shape, (34, 50))
        np.testing.assert_array_equal(packed, np.asarray(F.pack_fp4(codes)))
        np.testing.assert_array_equal(_bits(s1), _bits(s2))
        np.testing.assert_array_equal(oracle.codes_to_f64(packed), _oracle(fmt, x, axis)[0].astype(np.float64))

    def test_pack_rejects_bad_input(self):
        with self.assertRaisesRegex(ValueError, "even"):
            F.pack_fp4(jnp.zeros((3, 5), F.E2M1))
        with self.assertRaisesRegex(TypeError, "float4_e2m1fn.*uint8"):
            F.pack_fp4(jnp.zeros((3, 4), jnp.uint8))


class DequantizeTest(parameterized.TestCase):

    def test_e8m0_all_bytes(self):
        b = np.arange(256, dtype=np.uint8)
        want = np.where(b == 255, np.nan, np.exp2(b.astype(np.float64) - 127))
        for arg in (b, b.view(ml_dtypes.float8_e8m0fnu)):
            for fn in (F.e8m0_to_float32, jax.jit(F.e8m0_to_float32)):
                got = np.asarray(fn(arg))
                self.assertEqual(got.dtype, np.float32)
                np.testing.assert_array_equal(got.astype(np.float64), want)
        np.testing.assert_array_equal(oracle.scales_to_f64(b), want)
        self.assertEqual(float(F.e8m0_to_float32(np.uint8(0))), 2.0**-127)

    @parameterized.product(kind=["e4m3", "e5m2", "fp4", "fp4_packed", "nvfp4"], axis=[-1, 0],
                           scale_dtype_jit=[("uint8", False), ("e8m0", True)])
    def test_matches_oracle(self, kind, axis, scale_dtype_jit):
        scale_dtype, jit = scale_dtype_jit
        rng = np.random.default_rng(_seed(kind, axis, scale_dtype, jit))
        shape, block = (50, 74), (16 if kind == "nvfp4" else 32)
        if kind in ("e4m3", "e5m2"):
            dt = _E4M3 if kind == "e4m3" else _E5M2
            codes = rng.integers(0, 256, size=shape, dtype=np.uint8).view(dt)
            codes = np.where(np.isfinite(codes.astype(np.float32)), codes, dt.type(1.5))
        else:
            codes = rng.integers(0, 256, size=(shape[0], shape[1] // 2), dtype=np.uint8)
            if kind != "fp4_packed":
                codes = np.asarray(F.unpack_fp4(codes))
        sshape = list(shape)
        sshape[axis] = -(-shape[axis] // block)
        if kind == "nvfp4":
            scales = oracle.random_e4m3_scales(rng, sshape)
        else:
            scales = oracle.random_scale_bytes(rng, sshape, lo=100, hi=150)
            scales[0, 0] = 0xFF  # a NaN block
            if scale_dtype == "e8m0":
                scales = scales.view(ml_dtypes.float8_e8m0fnu)
        fn = lambda c, s: F.dequantize(c, s, block=block, axis=axis)
        got = np.asarray((jax.jit(fn) if jit else fn)(codes, scales))
        self.assertEqual(got.dtype, np.float32)
        want = oracle.dequantize_f64(codes, scales, block=block, axis=axis)
        np.testing.assert_array_equal(got.astype(np.float64), want)   # exact: code x scale fits in float32
        if kind != "nvfp4":
            blk = got[:block, 0] if axis == 0 else got[0, :block]
            self.assertTrue(np.isnan(blk).all())

    @parameterized.parameters("e4m3", "mxfp4", "nvfp4")
    def test_quantize_dequantize_error_bound(self, fmt):
        """Round trip error is at most half a code step (times the block scale) on finite, in-range data."""
        rng = np.random.default_rng(23)
        x = (rng.standard_normal((16, 77)) * np.exp2(rng.integers(-8, 8, (16, 1)))).astype(np.float32)
        codes, scales = _quantize(fmt, x, -1, jit=True, packed=False)  # 77: an odd tail, so unpacked
        block = 16 if fmt == "nvfp4" else 32
        y = np.asarray(F.dequantize(codes, scales, block=block)).astype(np.float64)
        s = np.repeat(oracle.scales_to_f64(scales), block, axis=-1)[:, :77]
        step = s * (0.125 * 2.0 ** np.floor(np.log2(np.maximum(np.abs(x) / s, 2.0**-6))) if fmt == "e4m3" else 2.0)
        self.assertTrue((np.abs(y - x) <= step / 2 + 1e-30).all())

    @parameterized.parameters("e4m3", "e5m2", "mxfp4", "nvfp4")
    def test_fused_quantize_dequantize(self, fmt):
        """Quantize and dequantize inside ONE jit: XLA must not skip the rounding (convert pairs, excess precision)."""
        rng = np.random.default_rng(31)
        x = (rng.standard_normal((8, 96)) * np.exp2(rng.integers(-10, 10, (8, 1)))).astype(np.float32)
        block = 16 if fmt == "nvfp4" else 32

        def roundtrip(x):
            codes, scales = _quantize_fn(fmt)(x)
            return F.dequantize(codes, scales, block=block)

        codes, scales = _oracle(fmt, x, -1)
        want = oracle.dequantize_f64(codes, scales, block=block)
        np.testing.assert_array_equal(np.asarray(jax.jit(roundtrip)(x)).astype(np.float64), want)

    def test_bad_scales_shape(self):
        with self.assertRaisesRegex(ValueError, r"scales must have shape \(4, 2\)"):
            F.dequantize(jnp.zeros((4, 40), F.E4M3), jnp.zeros((4, 1), jnp.uint8), block=32)


class QuantizeDequantizeTest(parameterized.TestCase):
    """quantize_dequantize splits the blocks where they lie: its values must be those of dequantize(quantize), bit for
    bit, along any axis, with tails, NaN / inf blocks, zero blocks and scales spread over 40 binades."""

    _QUANTIZERS = {"mxfp8_e4m3": lambda x, a: F.quantize_mxfp8(x, axis=a),
                   "mxfp8_e5m2": lambda x, a: F.quantize_mxfp8(x, axis=a, dtype=F.E5M2),
                   "mxfp4": lambda x, a: F.quantize_mxfp4(x, axis=a, packed=False),
                   "nvfp4": lambda x, a: F.quantize_nvfp4(x, axis=a, packed=False)}

    @parameterized.product(fmt=tuple(F.FORMATS), case=(((3, 70, 5), 1), ((4, 6, 96), 2), ((50, 7), 0),
                                                       ((2, 33, 40), -2)))
    def test_equals_dequantized_codes(self, fmt, case):
        shape, axis = case
        rng = np.random.default_rng(zlib.crc32(f"{fmt}{shape}".encode()))
        x = rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape))
        x.flat[5], x.flat[77 % x.size] = np.nan, -np.inf
        x[..., 0] = 0.0
        x = jnp.asarray(x, jnp.float32)
        want = np.asarray(F.dequantize(*self._QUANTIZERS[fmt](x, axis), block=F.FORMATS[fmt].block, axis=axis))
        got = np.asarray(jax.jit(lambda x: F.quantize_dequantize(x, fmt, axis=axis))(x))
        self.assertEqual(got.shape, x.shape)
        self.assertTrue(np.isnan(got).any())
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        np.testing.assert_array_equal(got.astype(jnp.bfloat16).astype(np.float32), got)  # exact in bf16

    def test_refuses_unknown_format(self):
        with self.assertRaisesRegex(ValueError, "fmt must be one of .*'mxfp8_e4m3'.*got 'fp8'"):
            F.quantize_dequantize(jnp.zeros((4, 32)), "fp8")
        with self.assertRaisesRegex(TypeError, "floating-point"):
            F.quantize_dequantize(jnp.zeros((4, 32), jnp.int32), "mxfp4")


class AtomTest(parameterized.TestCase):

    _SHAPES = [(1, 128, 4), (2, 256, 8), (1, 200, 5), (3, 37, 3), (1, 129, 1), (2, 1, 9)]

    def _scales(self, rng, shape, dtype):
        if dtype == "e4m3":
            return oracle.random_e4m3_scales(rng, shape)
        s = oracle.random_scale_bytes(rng, shape, lo=1, hi=254)
        return s.view(ml_dtypes.float8_e8m0fnu) if dtype == "e8m0" else s

    @parameterized.product(shape=_SHAPES, dtype_jit=[("uint8", True), ("e8m0", False), ("e4m3", True)])
    def test_matches_byte_offset_formula(self, shape, dtype_jit):
        dtype, jit = dtype_jit
        rng = np.random.default_rng(_seed(shape, dtype))
        s = self._scales(rng, shape, dtype)
        to_atom = jax.jit(F.to_scale_atom) if jit else F.to_scale_atom
        atom = np.asarray(to_atom(s))
        self.assertEqual(atom.shape, F.atom_shape(*shape))
        self.assertEqual(atom.dtype, s.dtype)
        want = oracle.compact_to_atom_np(s)
        np.testing.assert_array_equal(_bits(atom), _bits(want))
        # padding is byte 0: exactly the bytes not written by the formula
        self.assertEqual(int(np.count_nonzero(_bits(atom))), int(np.count_nonzero(_bits(s))))
        back = np.asarray((jax.jit(F.from_scale_atom, static_argnums=(1, 2)) if jit else F.from_scale_atom)(
            atom, shape[1], shape[2]))
        np.testing.assert_array_equal(_bits(back), _bits(s))
        np.testing.assert_array_equal(_bits(oracle.atom_to_compact_np(atom, shape[1], shape[2])), _bits(s))

    @parameterized.parameters(*_SHAPES)
    def test_seed_view(self, l, mn, kb):
        rng = np.random.default_rng(mn * kb)
        s = self._scales(rng, (l, mn, kb), "uint8")
        atom = F.to_scale_atom(s)
        view = np.asarray(jax.jit(F.atom_to_seed_view)(atom))
        self.assertEqual(view.shape, (32, 4, -(-mn // 128), 4, -(-kb // 4), l))
        for _ in range(50):
            li, m, k = rng.integers(l), rng.integers(mn), rng.integers(kb)
            self.assertEqual(view[m % 32, (m // 32) % 4, m // 128, k % 4, k // 4, li], s[li, m, k])
        np.testing.assert_array_equal(np.asarray(jax.jit(F.seed_view_to_atom)(view)), np.asarray(atom))

    def test_two_dimensional_input(self):
        s = oracle.random_scale_bytes(np.random.default_rng(1), (70, 6))
        atom = np.asarray(F.to_scale_atom(s))
        self.assertEqual(atom.shape, (1, 1, 2, 32, 4, 4))
        np.testing.assert_array_equal(atom, oracle.compact_to_atom_np(s[None]))
        np.testing.assert_array_equal(np.asarray(F.from_scale_atom(atom[0], 70, 6)), s[None])

    def test_bad_shapes(self):
        with self.assertRaisesRegex(ValueError, "from_scale_atom"):
            F.from_scale_atom(jnp.zeros((1, 1, 1, 32, 4, 4), jnp.uint8), 200, 3)
        with self.assertRaisesRegex(ValueError, "to_scale_atom"):
            F.to_scale_atom(jnp.zeros((5,), jnp.uint8))
        with self.assertRaisesRegex(TypeError, "float32"):
            F.to_scale_atom(jnp.zeros((5, 3), jnp.float32))


if __name__ == "__main__":
    absltest.main()
