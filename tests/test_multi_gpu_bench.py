"""benchmarks/multi_gpu.py in its CPU mode (8 host devices, the reference): the checks pass and the JSON holds them,
the gemm_amax timing and the sharded training step's weak-scaling rows included."""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
from absl.testing import absltest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "multi_gpu.py"


@pytest.mark.end_to_end
class MultiGpuBenchCpuTest(absltest.TestCase):

    def test_cpu_mode(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = pathlib.Path(tmp) / "multi_gpu.json"
            env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
            run = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--size", "1024", "--reps", "3", "--out",
                                  str(out)], env=env, capture_output=True, text=True, timeout=600)
            self.assertEqual(run.returncode, 0, run.stdout[-3000:] + run.stderr[-3000:])
            record = json.loads(out.read_text())
        self.assertEqual(record["devices"], 8)
        self.assertEqual(record["implementation"], "xla")
        checks = {c["name"]: c for c in record["checks"]}
        self.assertLen(checks, 9)
        for name, check in checks.items():
            self.assertTrue(check["passed"], f"{name}: {check.get('error')}")
        self.assertGreater(checks["K off the scale atoms: gathered"]["all_gathers"], 0)
        self.assertEqual(checks["rows M (odd N)"]["all_gathers"], 0)
        self.assertLen(checks["all devices at once, each checked"]["devices"], 8)
        timing = record["timing"]
        for run_name in ("one device", "rows sharded, jit (the rules)", "rows sharded, reference",
                         "rows sharded, hand-written shard_map"):
            self.assertGreater(timing[run_name]["ms"], 0, run_name)
            self.assertTrue(timing[run_name]["same_result_as_one_device"], run_name)
            self.assertFalse(timing[run_name]["kernel"], run_name)  # CPU: the reference, no kernel call
        self.assertEqual(timing["rows sharded, jit (the rules)"]["all_gathers"], 0)
        step = record["training_step"]
        self.assertEqual(step["mesh"], {"fsdp": 2, "tp": 4})
        for name in ("mxfp8 1x1", "mxfp8 2x4", "bf16 1x1", "bf16 2x4"):
            row = step["runs"][name]
            self.assertGreater(row.get("ms", 0), 0, f"{name}: {row.get('error')}")
            self.assertTrue(0 < row["loss"] < 10, name)
        self.assertEqual(step["runs"]["mxfp8 2x4"]["tokens"], 8 * step["runs"]["mxfp8 1x1"]["tokens"])  # weak scaling
        self.assertEqual(step["runs"]["mxfp8 1x1"]["all_gathers"], 0)
        self.assertGreater(step["runs"]["mxfp8 2x4"]["all_gathers"], 0)  # FSDP's weight gathers
        self.assertGreater(step["runs"]["mxfp8 2x4"]["weak_scaling_efficiency"], 0)
        self.assertIn("checks passed", run.stdout)
        self.assertIn("weak scaling", run.stdout)


if __name__ == "__main__":
    absltest.main()
