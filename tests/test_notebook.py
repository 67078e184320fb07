"""The quickstart notebook's code cells run top to bottom (so the notebook cannot rot unnoticed)."""

import json
import pathlib

from absl.testing import absltest

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


class NotebookTest(absltest.TestCase):

    def test_quickstart_runs(self):
        cells = json.loads(NOTEBOOK.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        scope = {}
        exec(compile(code, str(NOTEBOOK), "exec"), scope)
        self.assertEqual(scope["c"].shape, (512, 256))
        self.assertEqual(scope["amaxes"].shape, (2,))


if __name__ == "__main__":
    absltest.main()
