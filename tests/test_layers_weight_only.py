"""Layers converted for inference (NNX, Linen, Equinox): the quantized layer equals the weight-only oracle of its
QuantizedWeight, and stays within the format's quantization error of the float layer it came from, in every format;
jit, gradients with respect to the inputs and the bias, and their errors.

Skipped where flax or equinox is not installed (the test extra installs them).
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg

import oracle_ops
from oracle_weight_only import FORMATS, weight_only_oracle

try:
    import equinox as eqx
    from flax import linen as nn
    from flax import nnx

    from jax_blockgemm.layers import equinox as leqx
    from jax_blockgemm.layers import linen as llinen
    from jax_blockgemm.layers import nnx as lnnx
except ImportError as e:  # pragma: no cover - the test extra installs them
    raise absltest.SkipTest(f"layers need flax and equinox: {e}")


def _x(seed, shape=(2, 5, 96)):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape) * np.exp2(rng.integers(-3, 4, (*shape[:-1], 1))), jnp.float32)


def _assert_layer(test, y, x, weight, bias, w_out_in, fmt):
    """y equals the weight-only oracle of `weight` (+ bias), and lies within the format's error of x · w_out_inᵀ."""
    x64 = np.asarray(x, np.float64)
    want = weight_only_oracle(x, weight) + np.asarray(bias, np.float64)
    oracle_ops.assert_gemm_close(test, np.asarray(y, np.float32), want, c_dtype=jnp.float32)
    u, eps = oracle_ops.QUANT_ERROR[fmt]
    w64 = np.asarray(w_out_in, np.float64)
    err_w = u * np.abs(w64) + eps * oracle_ops._block_amax(w64, 1, 16 if fmt == "nvfp4" else 32)
    bound = np.abs(x64) @ err_w.T + oracle_ops.ACCUMULATION_SLACK * (np.abs(x64) @ np.abs(w64).T)
    exact = x64 @ w64.T + np.asarray(bias, np.float64)
    oracle_ops.assert_within_bound(test, f"{fmt} layer vs the float layer", np.asarray(y), exact, bound)


class NNXTest(parameterized.TestCase):

    @parameterized.parameters(*FORMATS)
    def test_quantized_for_inference(self, fmt):
        layer = lnnx.MXLinear(96, 48, rngs=nnx.Rngs(0))
        layer.bias[...] = jnp.asarray(np.random.default_rng(1).standard_normal(48), jnp.float32)
        served = layer.quantized_for_inference(format=fmt)
        self.assertIsInstance(served, lnnx.WeightOnlyLinear)
        self.assertEqual((served.in_features, served.out_features), (96, 48))
        weight = served.kernel.get_value()
        self.assertEqual((weight.format, weight.shape), (fmt, (48, 96)))
        x = _x(2)
        y = nnx.jit(lambda m, x: m(x))(served, x)
        self.assertEqual((y.shape, y.dtype), ((2, 5, 48), jnp.float32))
        _assert_layer(self, y, x, weight, layer.bias[...], layer.kernel[...].T, fmt)

    def test_from_plain_linear_bf16_and_gradients(self):
        plain = nnx.Linear(64, 32, rngs=nnx.Rngs(3))
        served = lnnx.WeightOnlyLinear.from_linear(plain, "mxfp4", out_dtype=jnp.bfloat16)
        x = _x(4, (3, 64)).astype(jnp.bfloat16)
        y = served(x)
        self.assertEqual(y.dtype, jnp.bfloat16)
        ref = weight_only_oracle(x, served.kernel.get_value()) + np.asarray(plain.bias[...], np.float64)
        # bf16 y: the product rounds to bf16, then the bias adds in bf16 (one more rounding)
        oracle_ops.assert_rel_close(self, "y", y, ref, 2**-7)
        # the QuantizedWeight is no Param: optimizers and nnx.grad see the bias only
        self.assertEqual([leaf.shape for leaf in jax.tree.leaves(nnx.state(served, nnx.Param))], [(32,)])
        grads = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32)))(served)
        np.testing.assert_array_equal(np.asarray(grads["bias"][...]), np.full(32, 3.0, np.float32))
        dx = jax.grad(lambda x: jnp.sum(served(x).astype(jnp.float32)))(x.astype(jnp.float32))
        want = np.asarray(served.kernel.get_value().dequantize(), np.float64).sum(0)
        np.testing.assert_allclose(np.asarray(dx)[0], want, rtol=1e-6)

    def test_errors(self):
        served = lnnx.MXLinear(64, 32, rngs=nnx.Rngs(0)).quantized_for_inference("mxfp8_e5m2")
        with self.assertRaisesRegex(ValueError, "in_features=64"):
            served(jnp.ones((2, 63)))
        with self.assertRaisesRegex(ValueError, "format='int4' is not supported"):
            lnnx.MXLinear(64, 32, rngs=nnx.Rngs(0)).quantized_for_inference("int4")
        with self.assertRaisesRegex(TypeError, "weight must be a QuantizedWeight"):
            lnnx.WeightOnlyLinear(jnp.ones((32, 64)))
        stacked = jax.vmap(jbg.quantize_weight)(jnp.ones((2, 32, 64)))
        with self.assertRaisesRegex(ValueError, r"w.codes must be an \(N, K\) matrix; got shape \(2, 32, 64\)"):
            lnnx.WeightOnlyLinear(stacked)
        with self.assertRaisesRegex(ValueError, r"WeightOnlyLinear: bias must have shape \(out_features,\) = \(32,\); "
                                                r"got \(3,\)"):
            lnnx.WeightOnlyLinear(jbg.quantize_weight(jnp.ones((32, 64))), jnp.ones(3))

    @parameterized.parameters(*FORMATS)
    def test_experts_quantized_for_inference(self, fmt):
        """MXExperts -> WeightOnlyExperts: each expert's kernel (in, out) quantized as an (out, in) weight; the
        served layer's rows of group g equal the weight-only oracle of expert g and stay within the format's error
        of the float experts; rows of no group are zero."""
        layer = lnnx.MXExperts(3, 96, 40, rngs=nnx.Rngs(2))
        served = layer.quantized_for_inference(fmt)
        self.assertIsInstance(served, lnnx.WeightOnlyExperts)
        self.assertEqual((served.num_experts, served.in_features, served.out_features), (3, 96, 40))
        weight = served.kernel.get_value()
        self.assertEqual((weight.format, weight.shape), (fmt, (3, 40, 96)))
        x = _x(5, (20, 96))
        sizes = np.array([6, 0, 11], np.int32)
        y = nnx.jit(lambda m, x, s: m(x, s))(served, x, sizes)
        self.assertEqual((y.shape, y.dtype), ((20, 40), jnp.float32))
        start = 0
        for g, size in enumerate(sizes):
            one = jbg.QuantizedWeight(weight.codes[g], weight.scales[g], weight.alpha[g], fmt)
            rows = slice(start, start + size)
            _assert_layer(self, y[rows], x[rows], one, np.zeros(40), layer.kernel[...][g].T, fmt)
            start += size
        self.assertFalse(np.asarray(y)[17:].any())
        with self.assertRaisesRegex(ValueError, "in_features=96"):
            served(jnp.ones((4, 95)), sizes)


class LinenTest(parameterized.TestCase):

    @parameterized.parameters(*FORMATS)
    def test_quantized_for_inference(self, fmt):
        dense = llinen.MXDense(48, bias_init=nn.initializers.normal(1.0))
        x = _x(5)
        variables = dense.init(jax.random.key(0), x)
        module, served = dense.quantized_for_inference(variables, fmt)
        self.assertIsInstance(module, llinen.WeightOnlyDense)
        weight = served["params"]["kernel"]
        self.assertEqual((weight.format, weight.shape), (fmt, (48, 96)))
        y = jax.jit(module.apply)(served, x)
        params = variables["params"]
        _assert_layer(self, y, x, weight, params["bias"], params["kernel"].T, fmt)

    def test_conversions_keep_the_layers_output_dtype(self):
        """A layer built with dtype=bfloat16 answers in bfloat16 for float32 inputs; its served form does too (it
        answered in the inputs' float32), in Linen and NNX."""
        x = _x(5)
        dense = llinen.MXDense(48, dtype=jnp.bfloat16)
        variables = dense.init(jax.random.key(0), x)
        module, served = dense.quantized_for_inference(variables, "mxfp8_e4m3")
        self.assertEqual((dense.apply(variables, x).dtype, module.apply(served, x).dtype), (jnp.bfloat16,) * 2)
        layer = lnnx.MXLinear(96, 48, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        self.assertEqual((layer(x).dtype, layer.quantized_for_inference()(x).dtype), (jnp.bfloat16,) * 2)

    def test_init_quantizes_and_bias_gradient(self):
        module = llinen.WeightOnlyDense(16, format="nvfp4")
        x = _x(6, (4, 32))
        variables = module.init(jax.random.key(1), x)
        weight = variables["params"]["kernel"]
        self.assertIsInstance(weight, jbg.QuantizedWeight)
        self.assertEqual(weight.shape, (16, 32))
        y = module.apply(variables, x)
        oracle_ops.assert_gemm_close(self, y, weight_only_oracle(x, weight), c_dtype=jnp.float32)
        grad = jax.grad(lambda b: jnp.sum(module.apply({"params": {**variables["params"], "bias": b}}, x)))(
            variables["params"]["bias"])
        np.testing.assert_array_equal(np.asarray(grad), np.full(16, 4.0, np.float32))

    def test_features_must_be_positive(self):
        with self.assertRaisesRegex(ValueError, "WeightOnlyDense: features must be at least 1; got 0"):
            llinen.WeightOnlyDense(features=0).init(jax.random.key(0), jnp.ones((4, 64)))


class EquinoxTest(parameterized.TestCase):

    @parameterized.parameters(*FORMATS)
    def test_quantized_for_inference(self, fmt):
        layer = leqx.MXLinear(96, 48, key=jax.random.key(0))
        served = layer.quantized_for_inference(fmt)
        self.assertIsInstance(served, leqx.WeightOnlyLinear)
        x = _x(7)
        y = eqx.filter_jit(lambda m, x: m(x))(served, x)
        _assert_layer(self, y, x, served.weight, layer.bias, layer.weight, fmt)
        # called on one (in,) vector and vmapped, as eqx.nn.Linear is
        np.testing.assert_allclose(np.asarray(jax.vmap(served)(x[0])), np.asarray(y[0]), rtol=1e-5, atol=1e-6)

    def test_filter_grad_of_a_model_holding_it(self):
        """eqx.filter_grad over a model that holds a served layer trains the rest (here its bias and a float
        layer after it): the quantized weight is frozen (its floating leaves used to receive tangents, which
        weight_only_matmul refuses)."""
        served = leqx.MXLinear(96, 48, key=jax.random.key(0)).quantized_for_inference("mxfp8_e4m3")
        model = (served, eqx.nn.Linear(48, 8, key=jax.random.key(1)))
        x = _x(7, (4, 96))
        loss = lambda m: jnp.mean(jax.vmap(lambda v: m[1](m[0](v)))(x) ** 2)
        grads = eqx.filter_grad(loss)(model)
        self.assertGreater(float(jnp.max(jnp.abs(grads[0].bias))), 0.0)
        self.assertGreater(float(jnp.max(jnp.abs(grads[1].weight))), 0.0)

    def test_scalar_features_and_errors(self):
        layer = eqx.nn.Linear("scalar", "scalar", key=jax.random.key(1))
        served = leqx.WeightOnlyLinear.from_linear(layer, "mxfp8_e4m3")
        y = served(jnp.float32(2.0))
        self.assertEqual(y.shape, ())
        want = float(served.weight.dequantize()[0, 0]) * 2.0 + float(layer.bias[0])
        np.testing.assert_allclose(float(y), want, rtol=1e-6)
        with self.assertRaisesRegex(ValueError, "takes a scalar x"):
            served(jnp.ones(2))
        with self.assertRaisesRegex(ValueError, "must be even"):
            leqx.WeightOnlyLinear.from_linear(layer, "mxfp4")


if __name__ == "__main__":
    absltest.main()
