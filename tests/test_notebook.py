"""The notebooks' code cells run top to bottom on CPU (so they cannot rot unnoticed), in a scratch directory."""

import json
import os
import pathlib
import tempfile

os.environ.setdefault("MPLBACKEND", "Agg")

import numpy as np
import pytest
from absl.testing import absltest

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"


def run_notebook(name: str) -> dict:
    """Executes the notebook's code cells in one scope inside a temporary directory; returns the scope."""
    path = NOTEBOOKS / name
    cells = json.loads(path.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    scope = {}
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # contextlib.chdir needs Python 3.11; the package supports 3.10
        try:
            exec(compile(code, str(path), "exec"), scope)
            scope["_files"] = sorted(os.listdir(tmp))
        finally:
            os.chdir(cwd)
    import matplotlib.pyplot as plt
    plt.close("all")
    return scope


@pytest.mark.end_to_end
class NotebookTest(absltest.TestCase):

    def test_quickstart_runs(self):
        scope = run_notebook("quickstart.ipynb")
        self.assertEqual(scope["c"].shape, (512, 256))
        self.assertEqual(scope["amaxes"].shape, (2,))

    def test_mla_q_projection_runs(self):
        scope = run_notebook("mla_q_projection.ipynb")
        self.assertEqual(scope["row"].shape, (128, 2, 192))
        for grad, exact in ((scope["dx"], scope["ex_dx"]), (scope["dw"], scope["ex_dw"])):
            rel = float(np.linalg.norm(grad - exact) / np.linalg.norm(exact))
            self.assertLess(rel, 0.1)  # MXFP8 quantization error, a few percent
            self.assertGreater(rel, 1e-3)  # and the quantized path really ran

    def test_serving_runs(self):
        scope = run_notebook("serving_quantized_weights.ipynb")
        errors = scope["errors"]
        self.assertLess(errors["mxfp8_e4m3"], 0.05)  # about 2^-4 per weight element
        for fmt in ("mxfp4", "nvfp4"):
            self.assertLess(errors[fmt], 0.2)
        self.assertGreater(min(errors.values()), 1e-3)  # the quantized weights really ran
        self.assertTrue(scope["same"])  # the stored and reloaded weight
        self.assertIn("w_mxfp4.npz", scope["_files"])
        cfg = scope["cfg"]
        for fmt, tokens in scope["tokens"].items():
            self.assertEqual(tokens.shape, (2, cfg.prompt + cfg.new_tokens), fmt)

    def test_mixture_of_experts_runs(self):
        scope = run_notebook("mixture_of_experts.ipynb")
        rel, exact = scope["rel"], scope["exact"]
        self.assertLess(rel(scope["ys"]["bf16"], exact), 0.01)
        self.assertLess(rel(scope["ys"]["mxfp8"], exact), 0.1)
        self.assertGreater(rel(scope["ys"]["mxfp8"], exact), 1e-3)
        self.assertEqual(int(scope["group_sizes"][-1]), 0)  # an empty expert
        self.assertTrue(bool(np.all(np.asarray(scope["dw"])[-1] == 0)))
        self.assertEqual(float(scope["amax"]), float(np.max(np.abs(np.asarray(scope["c"])))))
        self.assertEqual(scope["y_serve"].shape, scope["y_train"].shape)

    def test_training_runs(self):
        try:
            import optax, sklearn  # noqa: F401,E401
        except ImportError as e:  # pragma: no cover - the test extra installs them
            self.skipTest(f"needs optax and scikit-learn: {e}")
        scope = run_notebook("training_mxfp8.ipynb")
        self.assertIn("training_mxfp8.png", scope["_files"])
        mx, bf = scope["runs"]["mxfp8"], scope["runs"]["bf16"]
        self.assertLessEqual(abs(mx["losses"][-20:].mean() - bf["losses"][-20:].mean()),
                             0.1 * bf["losses"][-20:].mean())


if __name__ == "__main__":
    absltest.main()
