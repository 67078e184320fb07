"""A real training comparison, small enough for CI: the digits MLP trained with MXFP8 (mx_dot_general) and with
bf16 dots from the same seed (same initial parameters, same batches) for 150 Adam steps.

Margins (measured on CPU at 150 and 400 steps, seeds 0 and 1: at most 2.3%, 0.0022 and 0.45 points):
  * mean training loss over the last 20 steps within 10% of bf16's;
  * held-out loss within 0.02, held-out accuracy within 2 points;
and the two runs must differ (MXFP8 really ran), with the loss falling at least tenfold in both.
Skipped where optax or scikit-learn is not installed (the test extra installs them).
"""

import os
import pathlib
import tempfile

os.environ.setdefault("MPLBACKEND", "Agg")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest

try:
    import optax  # noqa: F401
    import sklearn  # noqa: F401
except ImportError as e:  # pragma: no cover - the test extra installs them
    raise absltest.SkipTest(f"the training comparison needs optax and scikit-learn: {e}")

from jax_blockgemm.examples import mlp

STEPS = 150
TRAIN_LOSS_RTOL = 0.10
TEST_LOSS_ATOL = 0.02
TEST_ACCURACY_ATOL = 0.02


@pytest.mark.end_to_end
class TrainingComparisonTest(absltest.TestCase):

    def test_mxfp8_trains_like_bf16(self):
        data = mlp.digits_data(seed=0)
        runs = {name: mlp.train(mlp.DOT_GENERALS[name], data, steps=STEPS, seed=0) for name in ("mxfp8", "bf16")}
        mx, bf = runs["mxfp8"], runs["bf16"]
        for run in (mx, bf):
            self.assertTrue(np.all(np.isfinite(run["losses"])))
            self.assertLess(run["losses"][-20:].mean(), run["losses"][:5].mean() / 10)
        self.assertGreater(np.max(np.abs(mx["losses"] - bf["losses"])), 0.0, "MXFP8 and bf16 runs are identical")
        final_mx, final_bf = mx["losses"][-20:].mean(), bf["losses"][-20:].mean()
        self.assertLessEqual(abs(final_mx - final_bf), TRAIN_LOSS_RTOL * final_bf)
        self.assertLessEqual(abs(mx["test_loss"] - bf["test_loss"]), TEST_LOSS_ATOL)
        self.assertLessEqual(abs(mx["test_accuracy"] - bf["test_accuracy"]), TEST_ACCURACY_ATOL)
        self.assertGreater(mx["test_accuracy"], 0.9)
        with tempfile.TemporaryDirectory() as tmp:
            path = pathlib.Path(tmp) / "curves.png"
            fig = mlp.plot_curves({k: v["losses"] for k, v in runs.items()}, str(path))
            fig.clf()
            self.assertEqual(path.read_bytes()[:8], b"\x89PNG\r\n\x1a\n")


class JaxNnBaselineTest(absltest.TestCase):
    """The jax.nn.scaled_dot_general baseline of benchmarks/train_step.py: MXFP8 where every contracted size fits
    its 32-wide blocks, the bf16 baseline where one does not (its quantizer asserts otherwise)."""

    dn = (((1,), (0,)), ((), ()))

    def test_narrow_head_takes_bf16(self):
        x, w = jnp.ones((64, 4096), jnp.float32), jnp.ones((4096, 10), jnp.float32)
        text = str(jax.make_jaxpr(lambda a, b: mlp.jax_nn_mxfp8_dot_general(a, b, self.dn))(x, w))
        self.assertNotIn("scaled_matmul", text)
        np.testing.assert_array_equal(mlp.jax_nn_mxfp8_dot_general(x, w, self.dn),
                                      mlp.bf16_dot_general(x, w, self.dn))

    def test_wide_layer_takes_scaled_dot_general(self):
        x, w = jnp.ones((64, 4096), jnp.float32), jnp.ones((4096, 64), jnp.float32)
        text = str(jax.make_jaxpr(lambda a, b: mlp.jax_nn_mxfp8_dot_general(a, b, self.dn))(x, w))
        self.assertIn("scaled_matmul", text)


if __name__ == "__main__":
    absltest.main()
