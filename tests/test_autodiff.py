"""mx_dot_general: values and straight-through gradients against float64 oracles, vmap, jit caching, errors.

Two checks per case, on fresh random inputs (rows and columns spread over 2**-6 .. 2**6, so block scales differ)
at odd and round shapes:
  * tight: against the float64 straight-through rule (oracle_ops.mx_dot_general_oracle: quantize -> dequantize ->
    dot, the backward requantizing dY, W and X along their own contraction axis). The library's products are exact
    dequantized bf16 values summed in float32, so the only difference is float32 accumulation: 1e-5 relative.
  * within MX quantization error of the exact float64 product and gradients, elementwise: every quantized element
    is within u|v| + eps * (its block's amax) of v (u = 2**-(mantissa bits + 1); eps covers codes below the smallest
    normal, see oracle_ops.QUANT_ERROR), so |ÂB̂ - AB| <= ΔA|B| + |A|ΔB + ΔAΔB per element. And a quantized GEMM
    must show at least 0.5% relative error, so a silent bf16 fallback (~0.25%) fails.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg
from jax_blockgemm import autodiff

import oracle_ops

QUANTIZED_MIN_ERR = 0.005
TIGHT_RTOL = 1e-5

# name: (lhs shape, rhs shape, dimension_numbers)
CASES = {
    "linear_round": ((64, 96), (96, 160), (((1,), (0,)), ((), ()))),  # nnx.Linear: kernel (in, out), N-major
    "linear_odd": ((37, 64), (64, 48), (((1,), (0,)), ((), ()))),  # dgrad over N=48, wgrad over M=37: bf16
    "out_in_weight": ((64, 96), (40, 96), (((1,), (1,)), ((), ()))),  # weight (out, in): K-major
    "lhs_mn_major": ((96, 40), (96, 64), (((0,), (0,)), ((), ()))),  # M=40 pads to 16 in the M-major operand
    "batched": ((3, 64, 64), (3, 64, 33), (((2,), (1,)), ((0,), (0,)))),
    "two_contracting": ((5, 32, 2, 16), (2, 16, 32, 7), (((1, 3), (2, 1)), ((2,), (0,)))),  # transposes
}


def _inputs(rng, lhs_shape, rhs_shape, dimension_numbers, dtype=np.float32):
    """Random operands with a random per-row magnitude spread (non-trivial block scales) and a cotangent."""
    lhs = rng.standard_normal(lhs_shape) * np.exp2(rng.integers(-6, 7, lhs_shape[:1] + (1,) * (len(lhs_shape) - 1)))
    rhs = rng.standard_normal(rhs_shape) * np.exp2(rng.integers(-6, 7, (1,) * (len(rhs_shape) - 1) + rhs_shape[-1:]))
    out_shape = jax.eval_shape(functools.partial(jax.lax.dot_general, dimension_numbers=dimension_numbers),
                               jax.ShapeDtypeStruct(lhs_shape, dtype), jax.ShapeDtypeStruct(rhs_shape, dtype)).shape
    g = rng.standard_normal(out_shape)
    return lhs.astype(dtype), rhs.astype(dtype), g.astype(dtype)


def _run(lhs, rhs, g, dimension_numbers, recipe):
    """(out, d_lhs, d_rhs, forward amax, [dgrad amax, wgrad amax]) of mx_dot_general_amax through jax.vjp."""
    def f(lhs, rhs, sink):
        return jbg.mx_dot_general_amax(lhs, rhs, dimension_numbers, recipe=recipe, grad_amax=sink)

    (out, amax), vjp = jax.vjp(f, lhs, rhs, jnp.zeros((2,), jnp.float32))
    d_lhs, d_rhs, grad_amaxes = vjp((jnp.asarray(g), jnp.zeros_like(amax)))
    return out, d_lhs, d_rhs, amax, grad_amaxes


class StraightThroughTest(parameterized.TestCase):

    @parameterized.parameters(*[dict(case=c, recipe="mxfp8") for c in CASES]
                              + [dict(case=c, recipe="mxfp8_hybrid") for c in ("linear_round", "lhs_mn_major",
                                                                                "two_contracting")])
    def test_matches_float64_rule(self, case, recipe):
        self._check(case, jbg.RECIPES[recipe], seed=zlib.crc32(f"{case}/{recipe}".encode()))

    @parameterized.parameters("linear_round", "out_in_weight", "batched")
    def test_fp4_recipes(self, case):
        self._check(case, jbg.Recipe(fwd="nvfp4", dgrad="mxfp4", wgrad="nvfp4"), seed=7)

    def _check(self, case, recipe, seed):
        lhs_shape, rhs_shape, dn = CASES[case]
        lhs, rhs, g = _inputs(np.random.default_rng(seed), lhs_shape, rhs_shape, dn)
        out, d_lhs, d_rhs, amax, grad_amaxes = _run(lhs, rhs, g, dn, recipe)
        fmts = dict(fwd=recipe.fwd, dgrad=recipe.dgrad, wgrad=recipe.wgrad)
        ref = oracle_ops.mx_dot_general_oracle(lhs, rhs, dn, g, **fmts)
        for what, got, gemm in (("out", out, "fwd"), ("d_lhs", d_lhs, "dgrad"), ("d_rhs", d_rhs, "wgrad")):
            rule, exact, bound = ref[what]
            oracle_ops.assert_rel_close(self, what, got, rule, TIGHT_RTOL)
            oracle_ops.assert_within_bound(self, f"{what} vs exact", got, exact, bound)
            if _contraction(lhs_shape, rhs_shape, dn, gemm) % 32 == 0 and fmts[gemm] != "bf16":
                err = np.linalg.norm(np.asarray(got, np.float64) - exact) / np.linalg.norm(exact)
                self.assertGreater(err, QUANTIZED_MIN_ERR, f"{what}: the {fmts[gemm]} GEMM shows no quantization")
        oracle_ops.assert_rel_close(self, "amaxes", [amax, *grad_amaxes], ref["amaxes"], TIGHT_RTOL)


def _contraction(lhs_shape, rhs_shape, dn, gemm):
    """Contraction length of one of the three GEMMs: K (fwd), N (dgrad) or M (wgrad)."""
    (lc, rc), (lb, rb) = dn
    free = lambda shape, b, c: int(np.prod([s for d, s in enumerate(shape) if d not in b and d not in c]))
    return {"fwd": int(np.prod([lhs_shape[d] for d in lc])), "dgrad": free(rhs_shape, rb, rc),
            "wgrad": free(lhs_shape, lb, lc)}[gemm]


class DropInTest(parameterized.TestCase):

    @parameterized.parameters(*CASES)
    def test_shape_and_dtype_like_dot_general(self, case):
        lhs_shape, rhs_shape, dn = CASES[case]
        for dtype, preferred in ((jnp.float32, None), (jnp.bfloat16, None), (jnp.bfloat16, jnp.float32)):
            args = jax.ShapeDtypeStruct(lhs_shape, dtype), jax.ShapeDtypeStruct(rhs_shape, dtype)
            want = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dn, preferred_element_type=preferred), *args)
            got = jax.eval_shape(lambda a, b: jbg.mx_dot_general(a, b, dn, None, preferred), *args)
            self.assertEqual((got.shape, got.dtype), (want.shape, want.dtype))

    def test_bf16_operands(self):
        lhs, rhs, g = _inputs(np.random.default_rng(3), (64, 128), (128, 96), CASES["linear_round"][2], jnp.bfloat16)
        dn = CASES["linear_round"][2]
        out, d_lhs, d_rhs, _, _ = _run(lhs, rhs, g, dn, jbg.RECIPES["mxfp8"])
        self.assertEqual((out.dtype, d_lhs.dtype, d_rhs.dtype), (jnp.bfloat16,) * 3)
        ref = oracle_ops.mx_dot_general_oracle(np.asarray(lhs, np.float32), np.asarray(rhs, np.float32), dn,
                                               np.asarray(g, np.float32), fwd="mxfp8_e4m3", dgrad="mxfp8_e4m3",
                                               wgrad="mxfp8_e4m3")
        for what, got in (("out", out), ("d_lhs", d_lhs), ("d_rhs", d_rhs)):
            oracle_ops.assert_rel_close(self, what, got, ref[what][0], 2.0 ** -8)  # one bf16 rounding of the result

    def test_k_not_a_block_multiple_falls_back_to_bf16(self):
        dn = (((1,), (0,)), ((), ()))
        lhs, rhs, g = _inputs(np.random.default_rng(4), (64, 48), (48, 64), dn)
        out, _, _, amax, _ = _run(lhs, rhs, g, dn, jbg.RECIPES["mxfp8"])
        bf16 = lambda v: np.asarray(v).astype(oracle_ops.BF16).astype(np.float64)
        ref = bf16(lhs) @ bf16(rhs)
        oracle_ops.assert_rel_close(self, "out", out, ref, TIGHT_RTOL)
        oracle_ops.assert_rel_close(self, "amax", amax, np.max(np.abs(ref)), TIGHT_RTOL)

    def test_nan_propagates_and_empty_dimensions(self):
        dn = CASES["linear_round"][2]
        lhs, rhs, g = _inputs(np.random.default_rng(10), (64, 96), (96, 160), dn)
        lhs[3, 5] = np.nan
        out, d_lhs, d_rhs, amax, grad_amaxes = _run(lhs, rhs, g, dn, jbg.RECIPES["mxfp8"])
        nan_rows = np.isnan(np.asarray(out)).any(axis=1)
        np.testing.assert_array_equal(np.flatnonzero(nan_rows), [3])  # the NaN's block poisons its row only
        self.assertTrue(np.isnan(np.asarray(out)[3]).all())
        self.assertTrue(np.isnan(float(amax)) and np.isnan(float(grad_amaxes[1])))
        self.assertTrue(np.isnan(np.asarray(d_rhs)[5]).all())  # wgrad: X's column 5, blocks along M
        self.assertFalse(np.isnan(np.asarray(d_lhs)).any())  # dgrad does not read X
        empty, empty_amax = jbg.mx_dot_general_amax(jnp.ones((0, 64)), jnp.ones((64, 32)), dn)
        self.assertEqual((empty.shape, float(empty_amax)), ((0, 32), 0.0))

    def test_amax_has_no_gradient(self):
        dn = CASES["linear_round"][2]
        lhs, rhs, _ = _inputs(np.random.default_rng(5), (64, 96), (96, 160), dn)
        grads = jax.grad(lambda a, b: jbg.mx_dot_general_amax(a, b, dn)[1], argnums=(0, 1))(lhs, rhs)
        for grad in grads:
            np.testing.assert_array_equal(np.asarray(grad), 0.0)

    def test_vmap_matches_per_example_calls(self):
        dn = CASES["linear_round"][2]
        rng = np.random.default_rng(6)
        xs = jnp.asarray(rng.standard_normal((3, 64, 96)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((96, 160)), jnp.float32)
        loss = lambda x, w: jnp.sum(jnp.sin(jbg.mx_dot_general(x, w, dn)))
        batched = jax.vmap(jax.value_and_grad(loss, argnums=(0, 1)), in_axes=(0, None))(xs, w)
        for i in range(3):
            value, (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1))(xs[i], w)
            np.testing.assert_allclose(batched[0][i], value, rtol=1e-5)
            oracle_ops.assert_rel_close(self, "dx", batched[1][0][i], dx, TIGHT_RTOL)
            oracle_ops.assert_rel_close(self, "dw", batched[1][1][i], dw, TIGHT_RTOL)

    def test_jit_traces_once(self):
        traces = []
        dn = CASES["batched"][2]

        @jax.jit
        def step(a, b):
            traces.append(1)
            return jax.grad(lambda a, b: jnp.sum(jbg.mx_dot_general(a, b, dn) ** 2), argnums=(0, 1))(a, b)

        rng = np.random.default_rng(8)
        for _ in range(3):
            lhs, rhs, _ = _inputs(rng, *CASES["batched"])
            step(lhs, rhs)
        self.assertLen(traces, 1)

    def test_out_sharding_is_applied(self):
        mesh = jax.make_mesh((1,), ("x",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
        dn = CASES["linear_round"][2]
        lhs, rhs, _ = _inputs(np.random.default_rng(9), (64, 96), (96, 160), dn)
        out = jax.jit(lambda a, b: jbg.mx_dot_general(a, b, dn, out_sharding=sharding))(lhs, rhs)
        self.assertEqual(out.sharding, sharding)
        oracle_ops.assert_rel_close(self, "out", out, jbg.mx_dot_general(lhs, rhs, dn), 1e-6)


class ErrorTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        self.x = jnp.ones((64, 96), jnp.float32)
        self.w = jnp.ones((96, 32), jnp.float32)
        self.dn = (((1,), (0,)), ((), ()))

    def test_bad_recipe_fields(self):
        with self.assertRaisesRegex(ValueError, r"Recipe\.fwd='fp8' is not supported; allowed: 'mxfp8_e4m3'"):
            jbg.Recipe(fwd="fp8")
        with self.assertRaisesRegex(ValueError, r"Recipe\.wgrad"):
            jbg.Recipe(wgrad="mxfp8")
        with self.assertRaisesRegex(ValueError, r"Recipe\.implementation='triton'"):
            jbg.Recipe(implementation="triton")

    def test_recipe_must_be_a_recipe(self):
        with self.assertRaisesRegex(TypeError, "recipe must be a jax_blockgemm.Recipe; got 'mxfp8'"):
            jbg.mx_dot_general(self.x, self.w, self.dn, recipe="mxfp8")

    def test_integer_operand(self):
        with self.assertRaisesRegex(TypeError, "rhs has dtype int32; allowed: a floating dtype"):
            jbg.mx_dot_general(self.x, jnp.ones((96, 32), jnp.int32), self.dn)

    def test_mismatched_contraction(self):
        with self.assertRaisesRegex(ValueError, r"contracting dims \(1,\) \(sizes \(96,\)\) and rhs contracting dims "
                                                r"\(0,\) \(sizes \(95,\)\)"):
            jbg.mx_dot_general(self.x, jnp.ones((95, 32)), self.dn)

    def test_malformed_dimension_numbers(self):
        with self.assertRaisesRegex(ValueError, "dimension_numbers must be"):
            jbg.mx_dot_general(self.x, self.w, ((1,), (0,)))
        with self.assertRaisesRegex(ValueError, r"lhs_contracting=\(2,\) must be distinct dimensions in \[0, 2\)"):
            jbg.mx_dot_general(self.x, self.w, (((2,), (0,)), ((), ())))

    def test_integer_preferred_element_type(self):
        with self.assertRaisesRegex(TypeError, "preferred_element_type=int32 is not supported"):
            jbg.mx_dot_general(self.x, self.w, self.dn, None, jnp.int32)

    def test_arguments_that_are_no_dtype_or_array(self):
        with self.assertRaisesRegex(TypeError, "preferred_element_type='foo' is not supported by mx_dot_general; "
                                               "allowed: a floating dtype"):
            jbg.mx_dot_general(self.x, self.w, self.dn, None, "foo")
        with self.assertRaisesRegex(TypeError, "mx_dot_general: lhs must be an array .*; got NoneType"):
            jbg.mx_dot_general(None, self.w, self.dn)
        with self.assertRaisesRegex(TypeError, "mx_dot_general: lhs .float32. and rhs .float8_e4m3fn. have no implicit "
                                               "common dtype; pass preferred_element_type"):
            jbg.mx_dot_general(self.x, self.w.astype(jnp.float8_e4m3fn), self.dn)

    def test_grad_amax_shape(self):
        with self.assertRaisesRegex(ValueError, r"grad_amax must have shape \(2,\)"):
            jbg.mx_dot_general_amax(self.x, self.w, self.dn, grad_amax=jnp.zeros(3))

    def test_grad_amax_dtype(self):
        with self.assertRaisesRegex(TypeError, "grad_amax has dtype int32; allowed: a floating dtype"):
            jbg.mx_dot_general_amax(self.x, self.w, self.dn, grad_amax=jnp.zeros((2,), jnp.int32))

    def test_dimension_numbers_must_be_ints(self):
        """1.5 is no dimension (int() would truncate it to 1); NumPy integers are."""
        for dims in ((((1.5,), (0,)), ((), ())), (((1,), (True,)), ((), ())), ((1, (0,)), ((), ()))):
            with self.subTest(dims=dims), self.assertRaisesRegex(
                    TypeError, "dimension_numbers: (lhs|rhs)_contracting must be a sequence of ints"):
                jbg.mx_dot_general(self.x, self.w, dims)
        out = jbg.mx_dot_general(self.x, self.w, (((np.int64(1),), (np.int32(0),)), ((), ())))
        self.assertEqual(out.shape, (64, 32))

    def test_recipes_are_hashable_and_complete(self):
        self.assertEqual(set(jbg.RECIPES), {"mxfp8", "mxfp8_hybrid", "nvfp4", "bf16"})
        self.assertEqual(len({hash(r) for r in jbg.RECIPES.values()}), 4)
        self.assertEqual(autodiff.K_MULTIPLE, oracle_ops.MX_DOT_K_MULTIPLE)


if __name__ == "__main__":
    absltest.main()
