"""Flax NNX / Linen and Equinox layers: initializers equal to their bf16 counterparts, outputs equal to
mx_dot_general on the same parameters, amax statistics, jit / grad / vmap / an optax step with one trace, errors.

Skipped where flax, equinox or optax is not installed (the test extra installs them).
"""


import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import jax_blockgemm as jbg

import oracle_ops

try:
    import equinox as eqx
    import optax
    from flax import linen as nn
    from flax import nnx

    from jax_blockgemm.layers import equinox as leqx
    from jax_blockgemm.layers import linen as llinen
    from jax_blockgemm.layers import nnx as lnnx
except ImportError as e:  # pragma: no cover - the test extra installs them
    raise absltest.SkipTest(f"layers need flax, equinox and optax: {e}")

DN = (((1,), (0,)), ((), ()))


def _x(seed, shape=(64, 96)):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape) * np.exp2(rng.integers(-3, 4, (shape[0], 1))), jnp.float32)


class NNXTest(absltest.TestCase):

    def test_drop_in_for_linear(self):
        layer = lnnx.MXLinear(96, 48, rngs=nnx.Rngs(0))
        plain = nnx.Linear(96, 48, rngs=nnx.Rngs(0))
        np.testing.assert_array_equal(layer.kernel[...], plain.kernel[...])
        np.testing.assert_array_equal(layer.bias[...], plain.bias[...])
        x = _x(1)
        y, amax = layer.call_with_amax(x)
        want = jbg.mx_dot_general(x, layer.kernel[...], DN) + layer.bias[...]
        oracle_ops.assert_rel_close(self, "y", y, want, 1e-6)
        ref = oracle_ops.mx_dot_general_oracle(x, layer.kernel[...], DN, np.zeros((64, 48)), fwd="mxfp8_e4m3",
                                               dgrad="bf16", wgrad="bf16")
        oracle_ops.assert_rel_close(self, "amax", amax, ref["amaxes"][0], 1e-5)
        oracle_ops.assert_within_bound(self, "y vs nnx.Linear", y - layer.bias[...], *ref["out"][1:])
        # and nnx.Linear's own injection point takes mx_dot_general (it passes out_sharding)
        injected = nnx.Linear(96, 48, dot_general=jbg.mx_dot_general, rngs=nnx.Rngs(0))
        oracle_ops.assert_rel_close(self, "injected", injected(x), y, 1e-6)

    def test_grad_amax_and_training_step_trace_once(self):
        model = nnx.Sequential(lnnx.MXLinear(96, 64, rngs=nnx.Rngs(0)), jax.nn.relu,
                               lnnx.MXLinear(64, 32, recipe="mxfp8_hybrid", rngs=nnx.Rngs(1)))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        traces = []

        @nnx.jit
        def step(model, optimizer, x, t):
            traces.append(1)
            loss_fn = lambda m: jnp.mean((m(x) - t) ** 2)
            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return loss

        x, t = _x(2), _x(3, (64, 32))
        losses = [float(step(model, optimizer, x, t)) for _ in range(4)]
        self.assertLen(traces, 1)
        self.assertTrue(np.all(np.isfinite(losses)))
        self.assertLess(losses[-1], losses[0])
        # the gradient w.r.t. each layer's GradAmax sink is its [dgrad amax, wgrad amax]
        diff = nnx.DiffState(0, nnx.Any(nnx.Param, lnnx.GradAmax))
        grads = nnx.grad(lambda m: jnp.sum(m(x) * t), argnums=diff)(model)
        last = model.layers[2]
        h = jax.nn.relu(model.layers[0](x))
        _, vjp = jax.vjp(lambda s: jbg.mx_dot_general_amax(h, last.kernel[...], DN, recipe=last.recipe,
                                                           grad_amax=s)[0], jnp.zeros(2))
        np.testing.assert_allclose(grads.layers[2].grad_amax[...], vjp(t)[0], rtol=1e-6)
        self.assertTrue(np.all(np.asarray(grads.layers[0].grad_amax[...]) > 0))

    def test_vmap_and_jax_transforms(self):
        layer = lnnx.MXLinear(96, 48, rngs=nnx.Rngs(0))
        xs = jnp.stack([_x(4), _x(5)])
        ys = jax.jit(jax.vmap(layer))(xs)
        for i in range(2):
            oracle_ops.assert_rel_close(self, "vmap", ys[i], layer(xs[i]), 1e-6)
        dx = jax.grad(lambda x: jnp.sum(layer(x) ** 2))(xs[0])
        self.assertEqual(dx.shape, xs[0].shape)

    def test_mla_q_projection(self):
        layer = lnnx.MLAQProjection(64, 2, rngs=nnx.Rngs(0))
        plain = nnx.Linear(64, 384, use_bias=False, rngs=nnx.Rngs(0))
        np.testing.assert_array_equal(layer.kernel[...], plain.kernel[...])
        x = _x(6, (32, 64))
        ang = jnp.asarray(np.random.default_rng(7).uniform(-3, 3, (32, 64)))
        cos, sin = jnp.cos(ang), jnp.sin(ang)
        views = layer(x, cos, sin)
        want = jbg.mla_q_projection(x, layer.kernel[...], cos, sin, w_out_in=False)
        np.testing.assert_array_equal(np.asarray(views.row_codes).view(np.uint8),
                                      np.asarray(want.row_codes).view(np.uint8))
        grads = nnx.grad(lambda m: jnp.sum(m(x, cos, sin).dequantize()[0] ** 2))(layer)
        self.assertGreater(float(jnp.linalg.norm(grads.kernel[...])), 0.0)

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, "recipe='fp8' is not supported; allowed: a jax_blockgemm.Recipe"):
            lnnx.MXLinear(96, 48, recipe="fp8", rngs=nnx.Rngs(0))
        with self.assertRaisesRegex(TypeError, "MXLinear fixes dot_general"):
            lnnx.MXLinear(96, 48, dot_general=jax.lax.dot_general, rngs=nnx.Rngs(0))
        layer = lnnx.MXLinear(96, 48, rngs=nnx.Rngs(0))
        with self.assertRaisesRegex(ValueError, r"last dimension in_features=96; got shape \(4, 95\)"):
            layer(jnp.ones((4, 95)))
        with self.assertRaisesRegex(TypeError, "MXLinear: dtype=int32 is not supported; allowed: None or a floating"):
            lnnx.MXLinear(96, 48, dtype=jnp.int32, rngs=nnx.Rngs(0))
        with self.assertRaisesRegex(TypeError, "MXLinear: param_dtype='foo' is not supported; allowed: None or a"):
            lnnx.MXLinear(96, 48, param_dtype="foo", rngs=nnx.Rngs(0))
        with self.assertRaisesRegex(ValueError, "num_heads must be at least 1"):
            lnnx.MLAQProjection(64, 0, rngs=nnx.Rngs(0))
        for sizes in ((0, 32), (64, 0)):
            with self.assertRaisesRegex(ValueError, "MXLinear: in_features and out_features must be at least 1"):
                lnnx.MXLinear(*sizes, rngs=nnx.Rngs(0))
        with self.assertRaisesRegex(TypeError, "MXExperts: num_experts must be an int; got 2.5"):
            lnnx.MXExperts(2.5, 64, 32, rngs=nnx.Rngs(0))
        with self.assertRaisesRegex(ValueError, "MXExperts: num_experts, in_features and out_features must be at "
                                                "least 1; got 2, 0, 32"):
            lnnx.MXExperts(2, 0, 32, rngs=nnx.Rngs(0))


class LinenTest(absltest.TestCase):

    def test_drop_in_for_dense_and_training_step(self):
        x, t = _x(8), _x(9, (64, 32))
        layer, plain = llinen.MXDense(32), nn.Dense(32)
        variables = layer.init(jax.random.key(0), x)
        plain_params = plain.init(jax.random.key(0), x)["params"]
        for name in ("kernel", "bias"):
            np.testing.assert_array_equal(variables["params"][name], plain_params[name])
        y, state = layer.apply(variables, x, mutable=["intermediates"])
        want = jbg.mx_dot_general_amax(x, variables["params"]["kernel"], DN)
        oracle_ops.assert_rel_close(self, "y", y, want[0] + variables["params"]["bias"], 1e-6)
        np.testing.assert_allclose(state["intermediates"]["amax"][0], want[1], rtol=1e-6)
        injected = nn.Dense(32, dot_general=jbg.mx_dot_general).apply({"params": plain_params}, x)
        oracle_ops.assert_rel_close(self, "injected", injected, y, 1e-6)
        # an optax step, one trace; the gradient of the grad-amax collection is [dgrad amax, wgrad amax]
        tx = optax.sgd(1e-2)
        opt_state = tx.init(variables["params"])
        traces = []

        @jax.jit
        def step(params, opt_state, sinks):
            traces.append(1)
            loss = lambda p, s: jnp.mean((layer.apply({"params": p, llinen.GRAD_AMAX: s}, x) - t) ** 2)
            value, (g, g_sinks) = jax.value_and_grad(loss, argnums=(0, 1))(params, sinks)
            updates, opt_state = tx.update(g, opt_state)
            return optax.apply_updates(params, updates), opt_state, value, g_sinks

        params, sinks = variables["params"], variables[llinen.GRAD_AMAX]
        for _ in range(3):
            params, opt_state, value, g_sinks = step(params, opt_state, sinks)
        self.assertLen(traces, 1)
        self.assertTrue(np.isfinite(float(value)))
        self.assertTrue(np.all(np.asarray(g_sinks["dgrad_wgrad"]) > 0))
        ys = jax.vmap(lambda v: layer.apply(variables, v))(jnp.stack([x, 2 * x]))
        oracle_ops.assert_rel_close(self, "vmap", ys[0], y, 1e-6)

    def test_apply_with_params_only(self):
        """MXDense applied with its params alone, as nn.Dense is (a TrainState's apply_fn): the same outputs and
        parameter gradients as with the grad-amax collection, which it then neither needs nor reports."""
        x, t = _x(8), _x(9, (64, 32))
        layer = llinen.MXDense(32)
        variables = layer.init(jax.random.key(0), x)
        with_sink = layer.apply(variables, x)
        np.testing.assert_array_equal(layer.apply({"params": variables["params"]}, x), with_sink)
        loss = lambda p, v: jnp.mean((layer.apply({**v, "params": p}, x) - t) ** 2)
        alone = jax.grad(loss)(variables["params"], {})
        full = jax.grad(loss)(variables["params"], {llinen.GRAD_AMAX: variables[llinen.GRAD_AMAX]})
        for name in ("kernel", "bias"):
            np.testing.assert_array_equal(alone[name], full[name])

    def test_mla_q_projection_and_errors(self):
        x = _x(10, (32, 64))
        ang = jnp.asarray(np.random.default_rng(11).uniform(-3, 3, (32, 64)))
        layer = llinen.MLAQProjection(num_heads=1)
        variables = layer.init(jax.random.key(0), x, jnp.cos(ang), jnp.sin(ang))
        plain = nn.Dense(192, use_bias=False).init(jax.random.key(0), x)["params"]
        np.testing.assert_array_equal(variables["params"]["kernel"], plain["kernel"])
        views = layer.apply(variables, x, jnp.cos(ang), jnp.sin(ang))
        self.assertEqual(views.dequantize()[0].shape, (32, 1, 192))
        with self.assertRaisesRegex(ValueError, "recipe='e4m3' is not supported"):
            llinen.MXDense(8, recipe="e4m3").init(jax.random.key(0), x)
        with self.assertRaisesRegex(TypeError, "MXDense fixes dot_general"):
            llinen.MXDense(8, dot_general=jax.lax.dot_general).init(jax.random.key(0), x)
        with self.assertRaisesRegex(ValueError, "MXDense: features must be at least 1; got 0"):
            llinen.MXDense(0).init(jax.random.key(0), x)


class EquinoxTest(absltest.TestCase):

    def test_drop_in_vmap_and_training_step(self):
        key = jax.random.key(0)
        layer, plain = leqx.MXLinear(96, 48, key=key), eqx.nn.Linear(96, 48, key=key)
        np.testing.assert_array_equal(layer.weight, plain.weight)
        np.testing.assert_array_equal(layer.bias, plain.bias)
        x = _x(12)
        batched = layer(x)
        per_example = jax.vmap(layer)(x)
        oracle_ops.assert_rel_close(self, "vmap", per_example, batched, 1e-6)
        want = jbg.mx_dot_general(x, layer.weight, (((1,), (1,)), ((), ()))) + layer.bias
        oracle_ops.assert_rel_close(self, "y", batched, want, 1e-6)
        _, amax = layer.call_with_amax(x)
        np.testing.assert_allclose(amax, jnp.max(jnp.abs(want - layer.bias)), rtol=1e-6)
        tx = optax.adam(1e-2)
        opt_state = tx.init(eqx.filter(layer, eqx.is_array))
        t = _x(13, (64, 48))
        traces = []

        @eqx.filter_jit
        def step(model, opt_state):
            traces.append(1)
            loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - t) ** 2))(model)
            updates, opt_state = tx.update(grads, opt_state)
            return eqx.apply_updates(model, updates), opt_state, loss

        losses = []
        for _ in range(3):
            layer, opt_state, loss = step(layer, opt_state)
            losses.append(float(loss))
        self.assertLen(traces, 1)
        self.assertLess(losses[-1], losses[0])

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, "recipe='mxfp9' is not supported"):
            leqx.MXLinear(4, 4, recipe="mxfp9", key=jax.random.key(0))
        layer = leqx.MXLinear(96, 4, key=jax.random.key(0))
        with self.assertRaisesRegex(ValueError, r"x must have shape \(\.\.\., 96\)"):
            layer(jnp.ones((95,)))


if __name__ == "__main__":
    absltest.main()
