"""The weight-only quantized matmul (SPEC §5b) against its float64 oracle: every format, both x and out dtypes, M = 1,
odd N, K tails, NaN / inf, jit / vmap (stacked weights) / grad, the weight as a stored pytree, errors at trace time,
the CUDA hook, and the partitioning rules on 8 host devices (no gather of the weight, under Shardy and GSPMD).
"""

import dataclasses
import functools
import io
import os
import re
from unittest import mock

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax, when run directly

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_blockgemm as jbg
from jax_blockgemm import formats

import decode_standin
import oracle
import oracle_ops
import partitioners
from oracle_weight_only import (FORMATS, dequantized_f64, magnitude_oracle, random_weight, random_x,
                                 weight_only_oracle)

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
# (x's leading shape, N, K): M = 1; odd N with K a whole number of blocks; a K tail in every format (98 = 3*32 + 2
# = 6*16 + 2) with M from two leading axes and N past 256
SHAPES = (((2, 3), 257, 98), ((1,), 1, 32))  # N and K tails with a batch of rows; M = 1 and N = 1


def _check(test, y, ref, out_dtype, magnitude=None):
    """SPEC §7 against the float64 oracle: float32 relative error <= 1e-5 (of `magnitude`, the oracle of |x|·|Ŵ|ᵀ,
    where given: the one-element C of SHAPES can cancel far below its products), bfloat16 within one ulp per
    element."""
    test.assertEqual(y.dtype, out_dtype)
    test.assertEqual(y.shape, ref.shape)
    oracle_ops.assert_gemm_close(test, y, ref, c_dtype=out_dtype, magnitude=magnitude)


class WeightOnlyMatmulTest(parameterized.TestCase):

    # every format twice, every (x dtype, out dtype) pair with two formats
    @parameterized.parameters(*[dict(fmt=f, x_dtype=x, out_dtype=o) for i, f in enumerate(FORMATS)
                                for x, o in ((("bfloat16", "bfloat16"), ("float32", "float32")),
                                             (("bfloat16", "float32"), ("float32", "bfloat16")))[i % 2]])
    def test_matches_the_oracle(self, fmt, x_dtype, out_dtype):
        rng = np.random.default_rng(abs(hash((fmt, x_dtype, out_dtype))) % 2**32)
        for lead, n, k in SHAPES:
            w = random_weight(rng, n, k, fmt)
            x = random_x(rng, (*lead, k), x_dtype)
            y = jbg.weight_only_matmul(x, w, out_dtype=out_dtype)
            _check(self, y, weight_only_oracle(x, w), jnp.dtype(out_dtype), magnitude_oracle(x, w))

    def test_float32_x_is_used_as_given(self):
        """A float32 x is not rounded to bf16: x = 1 + 2**-20 times Ŵ = 1 gives 1 + 2**-20 exactly."""
        w = jbg.quantize_weight(jnp.ones((4, 32)), "mxfp8_e4m3")
        x = jnp.full((1, 32), 1 + 2**-20, jnp.float32).at[0, 1:].set(0.0)
        y = jbg.weight_only_matmul(x, w, out_dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(y), np.full((1, 4), 1 + 2**-20, np.float32))

    def test_jit_and_implementations_agree_bitwise(self):
        rng = np.random.default_rng(1)
        w = random_weight(rng, 40, 96, "mxfp4")
        x = random_x(rng, (3, 96), BF16)
        eager = jbg.weight_only_matmul(x, w)
        for got in (jax.jit(jbg.weight_only_matmul)(x, w),
                    jbg.weight_only_matmul(x, w, implementation="xla"),
                    jax.jit(functools.partial(jbg.weight_only_matmul, implementation="xla"))(x, w)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(eager))

    def test_vmap_over_x_and_over_stacked_weights(self):
        """vmap over x's examples; over a stack of L = 3 weights (one x, and one x per weight); nested."""
        rng = np.random.default_rng(2)
        fmt, n, k = "nvfp4", 24, 64
        ws = [random_weight(rng, n, k, fmt) for _ in range(3)]
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *ws)
        self.assertEqual(stacked.shape, (3, n, k))
        xs = random_x(rng, (3, 2, k), F32)
        f = functools.partial(jbg.weight_only_matmul, out_dtype=jnp.float32)
        over_x = jax.vmap(f, in_axes=(0, None))(xs, ws[0])
        over_w = jax.vmap(f, in_axes=(None, 0))(xs[0], stacked)
        both = jax.jit(jax.vmap(f))(xs, stacked)
        nested = jax.vmap(jax.vmap(f, in_axes=(0, None)), in_axes=(None, 0))(xs, stacked)
        for i in range(3):
            np.testing.assert_array_equal(np.asarray(over_x[i]), np.asarray(f(xs[i], ws[0])))
            np.testing.assert_array_equal(np.asarray(over_w[i]), np.asarray(f(xs[0], ws[i])))
            np.testing.assert_array_equal(np.asarray(both[i]), np.asarray(f(xs[i], ws[i])))
            _check(self, both[i], weight_only_oracle(xs[i], ws[i]), F32)
            np.testing.assert_array_equal(np.asarray(nested[i]), np.asarray(jax.vmap(f, in_axes=(0, None))(xs, ws[i])))

    def test_scan_over_stacked_weights(self):
        """jax.lax.scan slices a stacked QuantizedWeight into one (N, K) weight per step, like a layer stack."""
        rng = np.random.default_rng(3)
        ws = [random_weight(rng, 32, 32, "mxfp8_e4m3", scale_log2=(-6, -4)) for _ in range(4)]
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *ws)
        x = random_x(rng, (2, 32), F32)
        step = lambda h, w: (jbg.weight_only_matmul(h, w, out_dtype=jnp.float32), None)
        got, _ = jax.jit(lambda x, s: jax.lax.scan(step, x, s))(x, stacked)
        want = x
        for w in ws:
            want = jbg.weight_only_matmul(want, w, out_dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    @parameterized.parameters(*[dict(fmt=f, x_dtype=("bfloat16", "float32")[i % 2]) for i, f in enumerate(FORMATS)])
    def test_gradient_with_respect_to_x(self, fmt, x_dtype):
        """dx = dy · Ŵ (alpha included) against float64, through jax.vjp, jax.grad under jit, and jax.jvp."""
        rng = np.random.default_rng(4)
        w = random_weight(rng, 33, 98, fmt)
        x = random_x(rng, (3, 98), x_dtype)
        dy = jnp.asarray(rng.standard_normal((3, 33)), jnp.float32)
        f = lambda x: jbg.weight_only_matmul(x, w, out_dtype=jnp.float32)
        y, vjp = jax.vjp(f, x)
        (dx,) = vjp(dy)
        self.assertEqual(dx.dtype, jnp.dtype(x_dtype))
        want = np.asarray(dy, np.float64) @ dequantized_f64(w)
        oracle_ops.assert_gemm_close(self, dx, want, c_dtype=jnp.dtype(x_dtype))
        grad = jax.jit(jax.grad(lambda x: jnp.sum(f(x) * dy)))(x)
        np.testing.assert_array_equal(np.asarray(grad), np.asarray(dx))
        t = random_x(rng, (3, 98), x_dtype)
        _, y_dot = jax.jvp(f, (x,), (t,))
        oracle_ops.assert_gemm_close(self, y_dot, weight_only_oracle(t, w), c_dtype=F32)

    def test_gradient_with_respect_to_the_weight_raises(self):
        rng = np.random.default_rng(5)
        x = random_x(rng, (2, 64), F32)
        w = random_weight(rng, 16, 64, "nvfp4")
        loss = lambda w: jnp.sum(jbg.weight_only_matmul(x, w, out_dtype=jnp.float32))
        with self.assertRaisesRegex(ValueError, "differentiable with respect to x only"):
            jax.grad(lambda alpha: loss(dataclasses.replace(w, alpha=alpha)))(w.alpha)
        w8 = random_weight(rng, 16, 64, "mxfp8_e4m3")
        with self.assertRaisesRegex(ValueError, "differentiable with respect to x only"):
            jax.grad(lambda codes: loss(dataclasses.replace(w8, codes=codes)))(w8.codes)
        # and x's gradient is unaffected by a weight that is merely closed over
        self.assertEqual(jax.grad(lambda x: jnp.sum(jbg.weight_only_matmul(x, w8)))(x).shape, x.shape)

    @parameterized.parameters(*FORMATS)
    def test_nan_and_inf_propagate(self, fmt):
        """NaN in x poisons its row; a NaN block scale poisons its weight row's column; inf in x makes inf or NaN
        as in exact arithmetic; everything else stays finite and close."""
        rng = np.random.default_rng(6)
        n, k = 12, 64
        w = random_weight(rng, n, k, fmt)
        nan_scale = np.uint8(0xFF) if fmt != "nvfp4" else np.array(np.nan, oracle.E4M3)
        w = dataclasses.replace(w, scales=w.scales.at[5, 1].set(jnp.asarray(nan_scale)))
        x = np.array(random_x(rng, (6, k), F32))
        x[1, 3] = np.nan
        x[2, 7] = np.inf
        for out_dtype in (F32, BF16):
            y = np.asarray(jbg.weight_only_matmul(jnp.asarray(x), w, out_dtype=out_dtype), np.float64)
            ref = weight_only_oracle(x, w)
            self.assertTrue(np.isnan(y[1]).all() and np.isnan(y[:, 5]).all())
            np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
            np.testing.assert_array_equal(np.isinf(y), np.isinf(ref))
            self.assertFalse(np.isfinite(y[2]).any())  # inf times each weight element: inf, or NaN against a 0
            finite = np.isfinite(ref)
            finite[1:3] = False
            oracle_ops.assert_gemm_close(self, y[finite].astype(out_dtype), ref[finite], c_dtype=out_dtype)

    def test_e5m2_infinite_codes(self):
        """An E5M2 inf code makes its weight element inf: products inf (or NaN against a zero), as the oracle says."""
        rng = np.random.default_rng(7)
        w = random_weight(rng, 4, 32, "mxfp8_e5m2")
        w = dataclasses.replace(w, codes=w.codes.at[2, 0].set(jnp.inf))
        x = np.array(random_x(rng, (3, 32), F32))
        x[1, 0] = 0.0
        y = np.asarray(jbg.weight_only_matmul(jnp.asarray(x), w, out_dtype=jnp.float32), np.float64)
        ref = weight_only_oracle(x, w)
        np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
        np.testing.assert_array_equal(y[np.isinf(ref)], ref[np.isinf(ref)])
        self.assertTrue(np.isnan(y[1, 2]) and np.isinf(y[0, 2]))


class QuantizedWeightTest(parameterized.TestCase):

    @parameterized.parameters(*FORMATS)
    def test_quantize_weight(self, fmt):
        """Codes and scales are the library quantizer's along K; NVFP4 quantizes w · encode (encode = 6·448 / amax
        in float32) and keeps alpha = 1 / encode; the dequantized weight is within the format's error of w."""
        rng = np.random.default_rng(8)
        w = jnp.asarray(rng.standard_normal((40, 96)) * np.exp2(rng.integers(-3, 4, (40, 1))), jnp.float32)
        q = jbg.quantize_weight(w, fmt)
        self.assertEqual((q.format, q.shape), (fmt, (40, 96)))
        if fmt == "nvfp4":
            encode, alpha = oracle_ops.nvfp4_tensor_factors(np.asarray(w))
            self.assertEqual(float(q.alpha), float(alpha))
            codes, scales = oracle.quantize_nvfp4_f64(np.asarray(w, np.float32) * encode)
            packed = np.asarray(formats.pack_fp4(jnp.asarray(codes)))
        else:
            self.assertEqual(float(q.alpha), 1.0)
            code_dtype = {"mxfp8_e4m3": oracle.E4M3, "mxfp8_e5m2": oracle.E5M2, "mxfp4": oracle.E2M1}[fmt]
            emax = formats.emax(code_dtype)
            codes, scales = oracle.quantize_mx_f64(np.asarray(w), emax=emax, code_dtype=code_dtype)
            packed = np.asarray(formats.pack_fp4(jnp.asarray(codes))) if fmt == "mxfp4" else codes
        np.testing.assert_array_equal(np.asarray(q.codes).view(np.uint8), packed.view(np.uint8))
        np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), np.asarray(scales).view(np.uint8))
        rel = {"mxfp8_e4m3": 2**-4, "mxfp8_e5m2": 2**-3, "mxfp4": 2**-1, "nvfp4": 2**-1}[fmt]
        blockmax = np.repeat(np.abs(np.asarray(w)).reshape(40, -1, 16).max(-1), 16, axis=-1)
        err = np.abs(np.asarray(q.dequantize()) - np.asarray(w))
        self.assertTrue(np.all(err <= rel * blockmax * 2), f"max error {np.max(err / blockmax)} of the block max")

    def test_quantize_weight_special_values(self):
        nan_row = jnp.zeros((2, 64)).at[1, 40].set(jnp.nan)
        for fmt in FORMATS:
            q = jbg.quantize_weight(nan_row, fmt)
            self.assertEqual(float(q.alpha), 1.0)  # not finite amax: alpha 1, the NaN block gets a NaN scale
            dq = np.asarray(q.dequantize())
            self.assertTrue(np.isnan(dq[1, 32:48]).all() and not np.isnan(dq[0]).any() and (dq[0] == 0).all())

    @parameterized.parameters(*FORMATS)
    def test_a_stored_pytree(self, fmt):
        """Leaves are plain arrays: tree_flatten / tree_unflatten round-trip it, and so do np.savez / np.load of its
        `to_numpy` dict (the FP8 leaves as their bytes), giving the same results."""
        rng = np.random.default_rng(9)
        q = jbg.quantize_weight(jnp.asarray(rng.standard_normal((24, 64)), jnp.float32), fmt)
        leaves, treedef = jax.tree_util.tree_flatten(q)
        self.assertLen(leaves, 3)
        self.assertEqual(jax.tree_util.tree_unflatten(treedef, leaves), q)
        self.assertNotEqual(treedef, jax.tree_util.tree_structure(jbg.quantize_weight(jnp.ones((2, 32)), "mxfp4")
                                                                  if fmt != "mxfp4" else
                                                                  jbg.quantize_weight(jnp.ones((2, 32)))))
        buffer = io.BytesIO()
        np.savez(buffer, **q.to_numpy())  # plain uint8 / float32 / str arrays: no pickle needed to load them
        buffer.seek(0)
        with np.load(buffer, allow_pickle=False) as stored:
            restored = jbg.QuantizedWeight.from_numpy(stored)
        for got, want in zip(jax.tree.leaves(restored), leaves):
            self.assertEqual(got.dtype, want.dtype)
            np.testing.assert_array_equal(np.atleast_1d(got).view(np.uint8), np.atleast_1d(want).view(np.uint8))
        x = random_x(rng, (3, 64), BF16)
        np.testing.assert_array_equal(np.asarray(jbg.weight_only_matmul(x, restored)),
                                      np.asarray(jax.jit(jbg.weight_only_matmul)(x, q)))

    def test_unpacked_fp4_codes_and_e8m0_scales_are_accepted(self):
        rng = np.random.default_rng(10)
        q = random_weight(rng, 8, 64, "mxfp4")
        other = jbg.QuantizedWeight(formats.unpack_fp4(q.codes), jax.lax.bitcast_convert_type(q.scales, formats.E8M0),
                                    q.alpha, "mxfp4")
        x = random_x(rng, (2, 64), BF16)
        np.testing.assert_array_equal(np.asarray(jbg.weight_only_matmul(x, other)),
                                      np.asarray(jbg.weight_only_matmul(x, q)))


class ErrorsTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        self.w = jbg.quantize_weight(jnp.ones((16, 64)), "mxfp8_e4m3")
        self.x = jnp.ones((2, 64), jnp.bfloat16)

    @parameterized.named_parameters(
        ("x_int", lambda s: jbg.weight_only_matmul(jnp.ones((2, 64), jnp.int32), s.w), TypeError,
         "x has dtype int32; allowed: bfloat16, float32"),
        ("x_f16", lambda s: jbg.weight_only_matmul(jnp.ones((2, 64), jnp.float16), s.w), TypeError, "x has dtype"),
        ("x_none", lambda s: jbg.weight_only_matmul(None, s.w), TypeError,
         "weight_only_matmul: x must be an array .*; got NoneType"),
        ("k_mismatch", lambda s: jbg.weight_only_matmul(jnp.ones((2, 63), jnp.bfloat16), s.w), ValueError,
         r"x must have shape \(..., K\) with K=64"),
        ("scalar_x", lambda s: jbg.weight_only_matmul(jnp.ones((), jnp.bfloat16), s.w), ValueError, "x must have"),
        ("out_dtype", lambda s: jbg.weight_only_matmul(s.x, s.w, out_dtype=jnp.float16), TypeError,
         "out_dtype=.* allowed: bfloat16, float32"),
        ("implementation", lambda s: jbg.weight_only_matmul(s.x, s.w, implementation="triton"), ValueError,
         "implementation='triton' is not supported"),
        ("not_a_weight", lambda s: jbg.weight_only_matmul(s.x, jnp.ones((16, 64))), TypeError,
         "w must be a jax_blockgemm.QuantizedWeight"),
        ("scale_shape", lambda s: jbg.weight_only_matmul(s.x, dataclasses.replace(s.w, scales=s.w.scales[:, :1])),
         ValueError, r"w.scales has shape \(16, 1\).*must be \(16, 2\)"),
        ("scale_dtype", lambda s: jbg.weight_only_matmul(
            s.x, dataclasses.replace(s.w, scales=s.w.scales.astype(jnp.float32))), TypeError,
         "w.scales has dtype float32; format 'mxfp8_e4m3' takes uint8 or float8_e8m0fnu"),
        ("code_dtype", lambda s: jbg.weight_only_matmul(
            s.x, dataclasses.replace(s.w, codes=s.w.codes.astype(jnp.float8_e5m2))), TypeError,
         "w.codes has dtype float8_e5m2; format 'mxfp8_e4m3' takes float8_e4m3fn"),
        ("stacked", lambda s: jbg.weight_only_matmul(s.x, jax.tree.map(lambda a: jnp.stack([a, a]), s.w)),
         ValueError, "Use jax.vmap"),
        ("codes_list", lambda s: jbg.weight_only_matmul(s.x, dataclasses.replace(s.w, codes=s.w.codes.tolist())),
         TypeError, "w.codes must be an array .*; got list"),
        ("empty_k", lambda s: jbg.weight_only_matmul(jnp.ones((2, 0), jnp.bfloat16), jbg.QuantizedWeight(
            jnp.ones((16, 0), jnp.float8_e4m3fn), jnp.ones((16, 0), jnp.uint8), jnp.float32(1), "mxfp8_e4m3")),
         ValueError, r"w must be non-empty: N and K must be at least 1; got \(N, K\) = \(16, 0\)"),
        ("empty_n", lambda s: jbg.weight_only_matmul(s.x, jax.tree.map(lambda a: a[:0] if a.ndim else a, s.w)),
         ValueError, r"w must be non-empty: N and K must be at least 1; got \(N, K\) = \(0, 64\)"),
        ("alpha", lambda s: jbg.weight_only_matmul(s.x, dataclasses.replace(s.w, alpha=jnp.ones(2))), ValueError,
         "w.alpha must be a float32 scalar"),
        ("format_name", lambda s: jbg.quantize_weight(jnp.ones((4, 32)), "fp8"), ValueError,
         "format='fp8' is not supported; allowed: 'mxfp8_e4m3', 'mxfp8_e5m2', 'mxfp4', 'nvfp4'"),
        ("weight_format_name", lambda s: jbg.QuantizedWeight(s.w.codes, s.w.scales, s.w.alpha, "mxfp6"),
         ValueError, "QuantizedWeight.format='mxfp6' is not supported"),
        ("fp4_odd_k", lambda s: jbg.quantize_weight(jnp.ones((4, 33)), "mxfp4"), ValueError, "must be even; got K=33"),
        ("weight_rank", lambda s: jbg.quantize_weight(jnp.ones((4, 2, 32))), ValueError, r"an \(N, K\) matrix"),
        ("weight_dtype", lambda s: jbg.quantize_weight(jnp.ones((4, 32), jnp.int32)), TypeError, "floating dtype"),
        ("cutedsl_on_cpu", lambda s: jbg.weight_only_matmul(s.x, s.w, implementation="cutedsl"), ValueError,
         "implementation='cutedsl': weight_only_matmul has no CuTeDSL kernel on platform cpu"),
    )
    def test_refused_at_trace_time(self, call, error, message):
        with self.assertRaisesRegex(error, message):
            call(self)


class CudaHookTest(absltest.TestCase):
    """The CUDA lowering (no GPU needed): the decode kernel for bf16 x, the reference for float32 x."""

    def _lower(self, x, w, **kwargs):
        from jax_blockgemm import kernel_cache

        with mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: v.key.encode()):
            f = jax.jit(functools.partial(jbg.weight_only_matmul, **kwargs))
            return f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()

    def test_bf16_x_takes_the_decode_kernel(self):
        """Stand-in kernel class: the custom call gets x, the packed codes, the compact scales and alpha, and y is
        its first result; no reference dot."""
        w = jbg.quantize_weight(jnp.ones((16, 64)), "mxfp4")
        x = jnp.ones((2, 64), jnp.bfloat16)
        with decode_standin.stand_in_kernels():
            text = self._lower(x, w)
        call = [line for line in text.splitlines() if "stablehlo.custom_call @jbg_weight_stream" in line]
        self.assertLen(call, 1)
        self.assertIn("(tensor<1x2x64xbf16>, tensor<1x16x32xui8>, tensor<1x16x2xui8>, tensor<1xf32>) -> "
                      "(tensor<1x2x16xbf16>, tensor<1xf32>)", call[0])
        result = call[0].split(" = ")[0].strip()  # "%N:2"
        self.assertRegex(text, re.escape(result.split(":")[0]) + r"#0")
        self.assertNotIn("dot_general", text)

    def test_float32_x_runs_the_reference_and_cutedsl_raises(self):
        w = jbg.quantize_weight(jnp.ones((16, 64)), "mxfp4")
        x = jnp.ones((2, 64), jnp.float32)
        with decode_standin.stand_in_kernels():
            text = self._lower(x, w)
            self.assertIn("stablehlo.dot_general", text)
            self.assertNotIn("custom_call @jbg", text)
            with self.assertRaisesRegex(ValueError, "no CuTeDSL kernel applies .* x is float32: the decode kernel "
                                                    "takes bfloat16 activations"):
                self._lower(x, w, implementation="cutedsl")

    def test_xla_and_an_unbuildable_kernel_run_the_reference(self):
        from jax_blockgemm.kernels import catalog

        def missing(v):
            raise ImportError("No module named 'jax_blockgemm.kernels.weight_stream'")

        w = jbg.quantize_weight(jnp.ones((16, 64)), "mxfp8_e4m3")
        x = jnp.ones((2, 64), jnp.bfloat16)
        with decode_standin.stand_in_kernels():
            self.assertNotIn("custom_call @jbg", self._lower(x, w, implementation="xla"))
        with mock.patch.dict(catalog._FACTORIES, {("weight_stream", a): missing for a in ("sm_90a", "sm_100a")}):
            self.assertNotIn("custom_call @jbg", self._lower(x, w))
            with self.assertRaisesRegex(ValueError, "no CuTeDSL kernel applies .* no kernel can be built here"):
                self._lower(x, w, implementation="cutedsl")

    def test_the_real_kernel_class(self):
        if decode_standin.real_class() is None:
            self.skipTest(decode_standin.MISSING)
        w = jbg.quantize_weight(jnp.ones((16, 64)), "nvfp4")
        text = self._lower(jnp.ones((2, 64), jnp.bfloat16), w, implementation="cutedsl")
        self.assertIn("stablehlo.custom_call @jbg_weight_stream", text)


class ReadmeTest(absltest.TestCase):

    def test_readme_example_runs(self):
        """README "Serving: weight-only MX matmul": its code runs as written and y is the oracle's."""
        import pathlib
        import tempfile

        readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
        section = readme[readme.index("## Serving: weight-only MX matmul"):]
        code = section[section.index("```python") + len("```python"):]
        code = code[:code.index("```")]
        scope: dict = {}
        with tempfile.TemporaryDirectory() as tmp:
            cwd = os.getcwd()
            os.chdir(tmp)
            try:
                exec(code, scope)  # noqa: S102 (the README's own example)
            finally:
                os.chdir(cwd)
        x, w, y = scope["x"], scope["w"], scope["y"]
        self.assertEqual((y.shape, y.dtype, w.format), ((16, 512), BF16, "mxfp4"))
        oracle_ops.assert_gemm_close(self, y, weight_only_oracle(x, w), c_dtype=BF16)


# ------------------------------------------------------------------------------------------------------------------
# Partitioning on 8 host devices

_GATHER = re.compile(r"=\s*\S+\s+all-gather(-start)?\(")


def _mesh():
    devices = jax.devices()
    if len(devices) < 8:
        raise absltest.SkipTest("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return Mesh(np.array(devices[:8]).reshape(4, 2), ("data", "model"))


def _put_weight(mesh, w, spec):
    """The weight's codes and scales sharded by `spec` (over (N, K)); alpha replicated."""
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    return jbg.QuantizedWeight(put(w.codes, spec), put(w.scales, spec), put(w.alpha, P()), w.format)


# name, fmt, (x's leading shape, N, K), x's spec, the weight's spec over (N, K) (over (L, N, K) when stacked), y's
# spec, the weight stacked (vmap, L=4),
# whether the rules split K (partial sums reduced: compared with the oracle, not bit for bit), whether they gather
SHARDING_CASES = [
    ("rows", "mxfp8_e4m3", ((16,), 64, 128), P("data"), P(), P("data"), False, False, False),
    ("weight_rows", "mxfp4", ((3,), 96, 128), P(), P("model"), P(None, "model"), False, False, False),
    ("rows_and_weight_rows", "nvfp4", ((8,), 64, 96), P("data"), P("model"), P("data", "model"), False, False,
     False),
    ("k_both", "mxfp8_e5m2", ((2,), 48, 512), P(None, "data"), P(None, "data"), P(), False, True, False),
    ("k_x_only_weight_replicated", "mxfp4", ((1,), 40, 256), P(None, ("data", "model")), P(), P(), False, True,
     False),
    ("k_and_weight_rows", "nvfp4", ((4,), 64, 256), P(None, "data"), P("model", "data"), P(None, "model"), False,
     True, False),
    ("stacked_weights", "mxfp8_e4m3", ((2,), 32, 64), P("data"), P("data"), P("data"), True, False, False),
    ("gathered_k_off_blocks", "mxfp8_e4m3", ((2,), 32, 96), P(None, "data"), P(), None, False, False, True),
]


class ShardingTest(parameterized.TestCase):

    @parameterized.parameters(*[dict(case=c, partitioner="shardy") for c in SHARDING_CASES]
                              + [dict(case=c, partitioner="gspmd") for c in SHARDING_CASES[:2]])
    def test_sharded(self, case, partitioner):
        name, fmt, (lead, n, k), x_spec, w_spec, y_spec, stacked, split_k, gathers = case
        mesh = _mesh()
        rng = np.random.default_rng(len(name))
        f = functools.partial(jbg.weight_only_matmul, out_dtype=jnp.float32)
        if stacked:  # L = 4 weights, x (4, lead..., K), vmapped: L is sharded
            ws = [random_weight(rng, n, k, fmt) for _ in range(4)]
            w = jax.tree.map(lambda *leaves: jnp.stack(leaves), *ws)
            x = random_x(rng, (4, *lead, k), BF16)
            f = jax.vmap(f)
            ref = np.stack([weight_only_oracle(x[i], ws[i]) for i in range(4)])
        else:
            w = random_weight(rng, n, k, fmt)
            x = random_x(rng, (*lead, k), BF16)
            ref = weight_only_oracle(x, w)
        want = f(x, w)
        xs = jax.device_put(x, NamedSharding(mesh, x_spec))
        ws_ = _put_weight(mesh, w, w_spec)
        with partitioners.partitioner(partitioner):
            jitted = jax.jit(f)
            lowered = jitted.lower(xs, ws_)
            self.assertIn("CustomSPMDPartitioning", lowered.as_text())
            gathered = [line for line in lowered.compile().as_text().splitlines() if _GATHER.search(line)]
            if gathers:
                self.assertNotEmpty(gathered, "expected the rules to gather K")
            else:
                self.assertEmpty(gathered, "the compiled program gathers an operand")
            y = jitted(xs, ws_)
        if split_k:
            oracle_ops.assert_gemm_close(self, y, ref, c_dtype=F32)
        else:
            np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
        if y_spec is not None:
            self.assertTrue(y.sharding.is_equivalent_to(NamedSharding(mesh, y_spec), y.ndim),
                            f"y sharded {y.sharding.spec}, expected {y_spec}")

    def test_gradient_under_sharding(self):
        """jax.grad of a loss through a row- and N-sharded call equals the unsharded gradient."""
        mesh = _mesh()
        rng = np.random.default_rng(20)
        w = random_weight(rng, 64, 128, "mxfp4")
        x = random_x(rng, (16, 128), F32)
        loss = lambda x, w: jnp.sum(jnp.square(jbg.weight_only_matmul(x, w, out_dtype=jnp.float32)))
        want = jax.grad(loss)(x, w)
        got = jax.jit(jax.grad(loss))(jax.device_put(x, NamedSharding(mesh, P("data"))),
                                      _put_weight(mesh, w, P("model")))
        oracle_ops.assert_rel_close(self, "dx", got, want, 1e-6)  # sums split across the N shards


if __name__ == "__main__":
    absltest.main()
