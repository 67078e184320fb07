"""benchmarks/soak.py on CPU (the reference): a short soak passes, and a non-reproducible output or an error fails
it."""

import importlib.util
import pathlib
from unittest import mock

import pytest
from absl.testing import absltest

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"
_spec = importlib.util.spec_from_file_location("soak", _SCRIPT)
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


@pytest.mark.end_to_end
class SoakCpuTest(absltest.TestCase):
    """The soak's mechanics on the small cases of its lists (the large ones are for a GPU: seconds per pass here)."""

    def setUp(self):
        self.enter_context(mock.patch.object(soak, "GEMM_CASES", tuple(c for c in soak.GEMM_CASES
                                                                       if c[0] * c[1] * c[2] * c[3] < 2**28)))
        self.enter_context(mock.patch.object(soak, "PROJ_ROPE_CASES", tuple(c for c in soak.PROJ_ROPE_CASES
                                                                            if c[0] * c[2] < 2**17)))

    def test_short_soak_passes(self):
        record = soak.soak(2.0, None, max_device_growth=64, max_rss_growth=256)
        self.assertTrue(record["ok"], record)
        self.assertGreaterEqual(len(record["passes"]), 2)
        self.assertEqual(record["cases"], 2 * (len(soak.GEMM_CASES) + len(soak.PROJ_ROPE_CASES)))

    def test_changed_output_is_a_mismatch(self):
        counter = iter(range(10**6))
        with mock.patch.object(soak, "digest", side_effect=lambda _: str(next(counter))):
            record = soak.soak(0.5, None, max_device_growth=64, max_rss_growth=256)
        self.assertFalse(record["ok"])
        self.assertNotEmpty(record["mismatches"])

    def test_error_fails_the_soak(self):
        with mock.patch.object(soak, "make_cases", return_value=[("boom", lambda: 1 / 0)]):
            record = soak.soak(0.2, None, max_device_growth=64, max_rss_growth=256)
        self.assertFalse(record["ok"])
        self.assertIn("ZeroDivisionError", record["errors"][0])

    def test_memory_growth_past_the_bound_fails(self):
        rss = iter([100.0] + [500.0] * 10**4)  # one sample per pass: the first is the baseline
        with mock.patch.object(soak, "rss_mib", side_effect=lambda: next(rss)):
            record = soak.soak(0.5, None, max_device_growth=64, max_rss_growth=256)
        self.assertFalse(record["ok"])
        self.assertEqual(record["rss_growth_mib"], 400.0)


if __name__ == "__main__":
    absltest.main()
