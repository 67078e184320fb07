"""The demo (`python -m jax_blockgemm`) in a fresh process: its table, and that it runs without the benchmark."""

import contextlib
import io
import re
import subprocess
import sys

import jax
import pytest
from absl.testing import absltest

# Runs the demo as `python -m jax_blockgemm` does, then lists the benchmark modules it left imported.
_RUN_DEMO = """
import runpy, sys
sys.argv = ["jax_blockgemm", *sys.argv[1:]]
runpy.run_module("jax_blockgemm", run_name="__main__", alter_sys=True)
print("bench modules:", sorted(name for name in sys.modules if name.split(".")[:2] == ["jax_blockgemm", "bench"]))
"""


@pytest.mark.end_to_end
class DemoTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.proc = subprocess.run([sys.executable, "-c", _RUN_DEMO, "--m", "128", "--n", "64", "--k", "256"],
                                  capture_output=True, text=True, timeout=600)

    def setUp(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stderr[-3000:])

    def test_does_not_import_the_benchmark(self):
        self.assertEqual(self.proc.stdout.splitlines()[-1], "bench modules: []")

    def test_table_rows(self):
        rows = [[cell.strip() for cell in line.split("|")] for line in self.proc.stdout.splitlines() if "|" in line]
        self.assertEqual(rows[0], ["problem", "ran on", "check against the reference", "time", "reference time"])
        problems = [row[0] for row in rows[2:]]
        self.assertEqual(problems[0], "gemm_amax MXFP8 128x64x256 -> f32 [best]")
        self.assertEqual(problems[-2:], ["proj_rope bf16 in, T=64 H=4 K=256", "proj_rope MXFP8 in, T=64 H=4 K=256"])
        for row in rows[2:]:
            self.assertRegex(row[3], r"^\d+\.\d{3} ms")
            self.assertRegex(row[4], r"^\d+\.\d{3} ms$")
        gemm_check = re.fullmatch(r"rel err (\S+), amax (\S+) vs (\S+)", rows[2][2])
        self.assertIsNotNone(gemm_check, rows[2][2])
        self.assertLess(float(gemm_check[1]), 1e-4)
        amax, amax_ref = float(gemm_check[2]), float(gemm_check[3])
        self.assertGreater(amax_ref, 0.0)
        self.assertAlmostEqual(amax, amax_ref, delta=1e-3 * amax_ref)  # as printed: 4 significant digits
        for row in rows[-2:]:
            codes, scales = re.fullmatch(r"bytes equal to reference: codes (\S+)%, scales (\S+)%", row[2]).groups()
            self.assertGreaterEqual(float(codes), 99.0)
            self.assertGreaterEqual(float(scales), 99.0)
        if jax.default_backend() == "cpu":  # no kernels on a CPU: the reference answers, bit for bit
            self.assertEqual([row[1] for row in rows[2:]], ["reference (no kernel here)"] * 3)
            self.assertEqual(float(gemm_check[1]), 0.0)


class ArgumentsTest(absltest.TestCase):

    def test_refused_sizes_are_usage_errors(self):
        """A size below 1, or one the operations refuse (K not a multiple of 16), ends in a usage error naming it
        (exit status 2), not a traceback."""
        from jax_blockgemm import __main__ as demo

        for argv, message in ((["--m", "0"], "argument --m: expected an integer >= 1; got '0'"),
                              (["--k", "33"], "K=33 must be a multiple of 16")):
            with self.subTest(argv=argv), contextlib.redirect_stderr(io.StringIO()) as err, \
                    self.assertRaises(SystemExit) as raised:
                demo.main(argv)
            self.assertEqual(raised.exception.code, 2)
            self.assertIn(message, err.getvalue())


if __name__ == "__main__":
    absltest.main()
