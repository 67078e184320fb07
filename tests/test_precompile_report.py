"""`python -m jax_blockgemm.precompile --arch sm_100a --report`, the command the README gives B200 users: one row per
variant, dequantize kernels included, exit status 0 (structural checks of the compiled sm_100a objects, no GPU)."""

import contextlib
import io

import pytest
from absl.testing import absltest

from jax_blockgemm import precompile
from jax_blockgemm.kernels import catalog


def _report(keys: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = precompile.main(["--arch", "sm_100a", "--report"] + [a for k in keys for a in ("--variant", k)])
    return rc, out.getvalue()


class PrecompileReportTest(absltest.TestCase):

    def test_one_kernel_of_each_operation(self):
        keys = [catalog.variants_for("sm_100a", op)[0].key for op in catalog.OPS]
        keys.append(next(v.key for v in catalog.variants_for("sm_100a", "dequantize") if v.a_major == "m"))
        rc, text = _report(keys)
        self.assertEqual(rc, 0, text)
        rows = [line for line in text.splitlines() if line.split(" ")[0] in keys]
        self.assertLen(rows, len(keys))
        self.assertTrue(all(row.rstrip().endswith("ok") for row in rows), text)
        self.assertIn(f"{len(keys)} variants in", text)


@pytest.mark.catalog
class WholeCatalogReportTest(absltest.TestCase):

    def test_every_sm100a_variant(self):
        rc, text = _report([])
        variants = catalog.variants_for("sm_100a")
        self.assertEqual(rc, 0, text)
        self.assertIn(f"{len(variants)} variants in", text)
        for v in variants:
            self.assertRegex(text, rf"(?m)^{v.key.replace('.', '[.]')}\s.*\sok$")


if __name__ == "__main__":
    absltest.main()
