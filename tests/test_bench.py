"""The benchmark command (`python -m jax_blockgemm.bench`): end to end on the CPU, its numbers, n/a and errors."""

import argparse
import contextlib
import functools
import importlib.util
import io
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg
from jax_blockgemm import dispatch, formats
from jax_blockgemm.bench import cli as bench_cli, columns as bench_columns
from jax_blockgemm.bench.cases import build_cases, time_column
from jax_blockgemm.bench.cli import main as bench_main, parse_formats, parse_shape
from jax_blockgemm.bench.columns import BASELINES, OPS, gemm_columns, gemm_rel_err, proj_rope_columns
from jax_blockgemm.bench.inputs import gemm_inputs, random_mxfp8, random_values
from jax_blockgemm.bench.launch import launch_costs
from jax_blockgemm.bench.report import format_launch
from jax_blockgemm.bench.timing import interleaved_medians_ms, median_ms

GEMM_LABELS = ("ours(None)", "ours(cutedsl)", "reference(xla)", "nn.scaled_matmul", "lax.scaled_dot", "fp8 dot",
               "bf16 dot")
PROJ_LABELS = ("ours(None)", "ours(cutedsl)", "reference(xla)", "bare bf16 dot", "scaled_matmul pipeline")
GEMM_KEYS = {"ours", "ours_cutedsl", "reference", "scaled_matmul", "scaled_dot", "fp8_dot", "bf16_dot"}
PROJ_KEYS = {"ours", "ours_cutedsl", "reference", "bf16_dot", "pipeline"}
SMALL_CASES = [("gemm_amax", "128x128x128"), ("gemm_amax", "64x112x256"), ("gemm_amax", "96x320x64"),
               ("proj_rope", "T=32 H=2 K=64 bf16"), ("proj_rope", "T=32 H=2 K=64 mxfp8"),
               ("proj_rope", "T=64 H=2 K=64 bf16"), ("proj_rope", "T=64 H=2 K=64 mxfp8")]
SMALL_SHAPES = ("128x128x128", "64x112x256", "96x320x64")
FP4_FORMATS = ("mxfp4", "nvfp4")
FP4_TITLES = {"mxfp4": "gemm_amax, MXFP4 E2M1 -> f32, M x N x K",
              "nvfp4": "gemm_amax, NVFP4 E2M1 x alpha -> f32, M x N x K"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _cells(line: str) -> list[str]:
    """Cells of a table line (cells are separated by two or more spaces; labels hold single spaces only)."""
    return re.split(r"\s{2,}", line.strip())


def _table_block(out: str, title_prefix: str) -> list[str]:
    """The lines of one op's table: its header line up to the first blank line or footnote (two-space indent)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title_prefix))
    block = []
    for line in lines[start:]:
        if not line.strip() or re.match(r"  \S", line):
            break
        block.append(line)
    return block


def _has_kernel_gpu() -> bool:
    """Every visible CUDA device has an architecture our kernels are built for."""
    caps = dispatch.local_cuda_capabilities()
    if not caps:
        return False
    from jax_blockgemm import arch  # the per-architecture policy table

    return all(arch.target_of(cc) is not None for cc in caps)


class _BenchRun(absltest.TestCase):
    pytestmark = pytest.mark.end_to_end
    """`python -m jax_blockgemm.bench --small ARGS` run once per class in a fresh process, as a user runs it; its
    JSON record in `record`, its PNG (when PNG is set) at `png_path`. Every test needs the run to have succeeded."""

    ARGS: tuple = ()
    PNG = False

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.dir = tempfile.TemporaryDirectory()
        cls.json_path = os.path.join(cls.dir.name, "bench.json")
        cls.png_path = os.path.join(cls.dir.name, "bench.png")
        cls.proc = subprocess.run(
            [sys.executable, "-m", "jax_blockgemm.bench", "--small", *cls.ARGS, "--reps", "3", "--warmup", "1",
             "--sets", "2", "--json", cls.json_path, *(("--png", cls.png_path) if cls.PNG else ())],
            capture_output=True, text=True, timeout=1200)
        cls.record = None
        if cls.proc.returncode == 0:
            with open(cls.json_path) as f:
                cls.record = json.load(f)

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()
        super().tearDownClass()

    def setUp(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stderr[-3000:])


class EndToEndTest(_BenchRun):
    """`python -m jax_blockgemm.bench --small` (with a PNG)."""

    PNG = True

    def test_table_has_every_column_and_case(self):
        out = self.proc.stdout
        # rows: a header, then per case ms, TFLOP/s, the check and one speedup row per baseline (gemm 3, proj_rope 2)
        for title, labels, rows in (("gemm_amax,", GEMM_LABELS, 1 + 3 * 6), ("gemm_proj_rope_mxfp8,", PROJ_LABELS,
                                                                             1 + 4 * 5)):
            block = _table_block(out, title)
            self.assertEqual(_cells(block[0])[1:], list(labels))
            self.assertLen(block, rows)
            self.assertLen({len(line) for line in block}, 1, "rows of one table must be aligned to one width")
            for row in block[1:]:
                self.assertLen(_cells(row), len(labels) + (1 if row.startswith(" ") else 2), row)
        metrics = [_cells(line)[0] for line in out.splitlines() if line.startswith(" " * 10)]
        for metric in ("TFLOP/s", "rel err vs reference", "codes = reference", "speedup vs nn.scaled_matmul",
                       "speedup vs reference(xla)", "speedup vs lax.scaled_dot", "speedup vs bare bf16 dot",
                       "speedup vs scaled_matmul pipeline"):
            self.assertIn(metric, metrics)
        ms_rows = [_cells(line)[0] for line in out.splitlines() if len(_cells(line)) > 1 and _cells(line)[1] == "ms"]
        self.assertEqual(ms_rows, [name for _, name in SMALL_CASES])
        self.assertIn(f"jax {jax.__version__}", out.splitlines()[0])
        self.assertIn("CuTeDSL", out.splitlines()[0])

    def test_progress_line_per_case(self):
        lines = [line for line in self.proc.stderr.splitlines() if re.match(r"\[\d+/\d+\]", line)]
        self.assertEqual([line.split(":")[0] for line in lines],
                         [f"[{i + 1}/7] {op} {name}" for i, (op, name) in enumerate(SMALL_CASES)])
        for line in lines:
            self.assertRegex(line, r"done in \d+\.\d s$")

    def test_png(self):
        with open(self.png_path, "rb") as f:
            data = f.read()
        self.assertEqual(data[:8], PNG_SIGNATURE)
        self.assertEqual(data[12:16], b"IHDR")
        width, height = struct.unpack(">II", data[16:24])
        self.assertGreaterEqual(width, 600)
        self.assertGreaterEqual(height, 400)
        self.assertGreater(len(data), 20_000)  # two panels of bars, legends and labels; a blank figure is smaller

    def test_json_environment(self):
        env = self.record["environment"]
        self.assertEqual(env["jax"], jax.__version__)
        for key in ("device", "platform", "jaxlib", "cutedsl", "python"):
            self.assertTrue(env[key], key)
        self.assertEqual(self.record["method"]["reps"], 3)
        self.assertEqual(self.record["method"]["warmup"], 1)
        self.assertEqual(self.record["method"]["formats"], ["mxfp8"])  # the default: MXFP8 only
        for case in self.record["cases"]:
            self.assertEqual(case.get("format"), "mxfp8" if case["op"] == "gemm_amax" else None, case["case"])

    def test_json_numbers_and_ratios(self):
        cases = self.record["cases"]
        self.assertEqual([(c["op"], c["case"]) for c in cases], SMALL_CASES)
        checked = 0
        for case in cases:
            columns = case["columns"]
            self.assertEqual(set(columns), GEMM_KEYS if case["op"] == "gemm_amax" else PROJ_KEYS)
            for key, entry in columns.items():
                if "ms" in entry:
                    self.assertTrue(math.isfinite(entry["ms"]) and entry["ms"] > 0, (case["case"], key))
                    self.assertAlmostEqual(entry["tflops"], case["flops"] / entry["ms"] / 1e9,
                                           delta=1e-9 * entry["tflops"])
                else:
                    self.assertTrue(entry["na"], (case["case"], key))  # n/a always says why
            self.assertEqual(set(case["ratios"]), {f"vs_{b}" for b in BASELINES[case["op"]]})
            for name, ratios in case["ratios"].items():
                base = columns[name[3:]]
                for key, ratio in ratios.items():
                    if "ms" in base and "ms" in columns[key]:
                        self.assertAlmostEqual(ratio, base["ms"] / columns[key]["ms"], delta=1e-12 * ratio)
                        checked += 1
                    else:
                        self.assertIsNone(ratio)
        self.assertGreater(checked, 20)

    def test_checks_against_the_reference(self):
        """Columns computing the same function match the reference (SPEC §7 bounds); speed anchors are not checked."""
        for case in self.record["cases"]:
            columns = case["columns"]
            gemm = case["op"] == "gemm_amax"
            self.assertEqual(case["check"], "rel err vs reference" if gemm else "codes = reference")
            unchecked = {"fp8_dot"} if gemm else {"bf16_dot"}
            for key, entry in columns.items():
                if "ms" not in entry or key in unchecked:
                    self.assertNotIn("check", entry, (case["case"], key))
                    continue
                check = entry["check"]
                self.assertTrue(math.isfinite(check), (case["case"], key))
                if key == "reference":
                    self.assertEqual(check, 0.0 if gemm else 1.0)
                elif gemm:
                    self.assertLessEqual(check, 1e-4, (case["case"], key))
                else:
                    self.assertGreaterEqual(check, 0.99, (case["case"], key))

    def test_what_runs_here(self):
        for case in self.record["cases"]:
            columns = case["columns"]
            for key in ("ours", "reference"):
                self.assertIn("ms", columns[key])  # ours and the reference run everywhere
            if jax.default_backend() == "cpu":
                self.assertIn("use implementation=None or 'xla'", columns["ours_cutedsl"]["na"])
            if case["op"] == "gemm_amax":
                self.assertIn("ms", columns["bf16_dot"])
                self.assertEqual("ms" in columns["scaled_dot"], hasattr(jax.lax, "scaled_dot"))
            else:
                dot = columns["bf16_dot"]
                self.assertIn(dot["layout"], ("w_out_in", "w_in_out"))
                self.assertEqual(dot["ms"], min(dot["layouts_ms"].values()))
                self.assertEqual(dot["ms"], dot["layouts_ms"][dot["layout"]])


class SustainedEndToEndTest(_BenchRun):
    """`python -m jax_blockgemm.bench --small --op proj_rope --sustained 0.05`: each column timed for 0.05 s."""

    ARGS = ("--op", "proj_rope", "--sustained", "0.05")

    def test_method_and_header_say_sustained(self):
        method = self.record["method"]
        self.assertEqual(method["sustained_s"], 0.05)
        self.assertIn("samples back to back for 0.05 s per column", method["timing"])
        self.assertIn("median of the samples in the last two thirds of 0.05 s per column, each 10 back-to-back "
                      "calls after 1 warm-up, 2 input sets rotated", self.proc.stdout)

    def test_timings_finite_and_codes_checked(self):
        cases = self.record["cases"]
        self.assertEqual([c["case"] for c in cases], [name for op, name in SMALL_CASES if op == "proj_rope"])
        for case in cases:
            for name in ("ours", "reference", "bf16_dot"):
                ms = case["columns"][name]["ms"]
                self.assertTrue(0 < ms < 1e4, (case["case"], name, ms))
            self.assertEqual(case["columns"]["ours"]["check"], 1.0)


class WeightLayoutEndToEndTest(_BenchRun):
    """`python -m jax_blockgemm.bench --small --op proj_rope --w-in-out`: the proj_rope cases again with w as
    (K, H·192), every column checked against the reference of the same layout."""

    ARGS = ("--op", "proj_rope", "--w-in-out")

    def test_both_layouts_and_every_check(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stderr[-2000:])
        cases = self.record["cases"]
        names = [name for op, name in SMALL_CASES if op == "proj_rope"]
        self.assertEqual([c["case"] for c in cases], names + [n + " w(K,N)" for n in names])
        self.assertEqual([c["dims"]["w_out_in"] for c in cases], [True] * len(names) + [False] * len(names))
        for case in cases:
            for name in ("ours", "reference"):
                self.assertEqual(case["columns"][name]["check"], 1.0, (case["case"], name))
            pipeline = case["columns"]["pipeline"]  # scaled_matmul has no CPU lowering; on a GPU it is checked
            self.assertTrue("na" in pipeline or pipeline["check"] == 1.0, pipeline)
            self.assertIn(case["columns"]["bf16_dot"]["layout"], ("w_out_in", "w_in_out"))


class Fp4EndToEndTest(_BenchRun):
    """`python -m jax_blockgemm.bench --small --format mxfp4,nvfp4`: FP4 gemm_amax tables."""

    ARGS = ("--format", "mxfp4,nvfp4")

    def test_cases_say_the_format(self):
        self.assertEqual(self.record["method"]["formats"], list(FP4_FORMATS))
        gemm = [c for c in self.record["cases"] if c["op"] == "gemm_amax"]
        self.assertEqual([(c["case"], c["format"], c["dims"]["format"]) for c in gemm],
                         [(f"{shape} {fmt}", fmt, fmt) for fmt in FP4_FORMATS for shape in SMALL_SHAPES])
        self.assertEqual([c["case"] for c in self.record["cases"] if c["op"] == "proj_rope"],
                         [name for op, name in SMALL_CASES if op == "proj_rope"])  # proj_rope is MXFP8 only

    def test_one_table_per_format(self):
        out = self.proc.stdout
        self.assertNotIn("MXFP8 E4M3", out)  # only the formats asked for
        for fmt, title in FP4_TITLES.items():
            block = _table_block(out, title)
            self.assertEqual(_cells(block[0])[1:], list(GEMM_LABELS))
            self.assertLen(block, 1 + 3 * 6)
            self.assertLen({len(line) for line in block}, 1, "rows of one table must be aligned to one width")
            ms_rows = [_cells(line)[0] for line in block if len(_cells(line)) > 1 and _cells(line)[1] == "ms"]
            self.assertEqual(ms_rows, [f"{shape} {fmt}" for shape in SMALL_SHAPES])
        self.assertIn("scaled_dot take float4_e2m1fn codes and compact float8_e4m3fn scales per 16", out)
        self.assertIn("scaled_dot take float4_e2m1fn codes and compact float8_e8m0fnu scales per 32", out)

    def test_timings_finite_and_checked_against_the_reference(self):
        """ours matches the reference; the bf16 dot of the bench's dequantized operands (times alpha for NVFP4) and
        scaled_dot, computed apart from gemm_amax, match it too: wrong scales, block or alpha would show there."""
        for case in self.record["cases"]:
            if case["op"] != "gemm_amax":
                continue
            columns = case["columns"]
            for key in ("ours", "reference", "fp8_dot", "bf16_dot"):
                self.assertTrue(math.isfinite(columns[key]["ms"]) and columns[key]["ms"] > 0, (case["case"], key))
            self.assertEqual(columns["reference"]["check"], 0.0)
            self.assertLessEqual(columns["ours"]["check"], 1e-6, case["case"])
            self.assertLessEqual(columns["bf16_dot"]["check"], 1e-5, case["case"])
            self.assertNotIn("check", columns["fp8_dot"])
            for key in ("scaled_matmul", "scaled_dot"):
                if "ms" in columns[key]:
                    self.assertLessEqual(columns[key]["check"], 1e-4, (case["case"], key))
                else:
                    self.assertTrue(columns[key]["na"], (case["case"], key))
            if jax.default_backend() == "cpu":
                self.assertIn("use implementation=None or 'xla'", columns["ours_cutedsl"]["na"])


class Fp4InputsTest(parameterized.TestCase):

    @parameterized.parameters("mxfp4", "nvfp4")
    def test_fp4_inputs(self, fmt):
        """Packed codes, random non-trivial scales (and alpha), consistent forms: the bf16 operands x alpha give
        the reference's C, and approximate the unquantized values' product."""
        m, n, k = 64, 32, 256
        block = 16 if fmt == "nvfp4" else 32
        key = jax.random.key(5)
        d = gemm_inputs(key, m, n, k, fmt)
        self.assertEqual((d["a"].dtype, d["a"].shape), (jnp.uint8, (m, k // 2)))
        self.assertEqual((d["a_sm"].dtype, d["a_sm"].shape), (jnp.float4_e2m1fn, (m, k)))
        self.assertEqual(d["a_fp8"].dtype, jnp.float8_e4m3fn)
        self.assertEqual(d["sfa_sm"].dtype, jnp.float8_e4m3fn if fmt == "nvfp4" else jnp.float8_e8m0fnu)
        self.assertEqual(d["sfa_sm"].shape, (m, k // block))
        scales = np.asarray(formats.scales_to_float32(d["sfa_sm"]))
        self.assertTrue(np.all(np.isfinite(scales)) and np.all(scales > 0))
        self.assertGreater(len(np.unique(scales)), 8)
        self.assertGreater(len(np.unique(scales[0])) + len(np.unique(scales[:, 0])), 4)
        alpha = 1.0
        if fmt == "nvfp4":
            self.assertEqual((d["alpha"].dtype, d["alpha"].shape), (jnp.float32, ()))
            alpha = float(d["alpha"])
            self.assertNotAlmostEqual(alpha, 1.0, delta=0.5)
            self.assertNotEqual(alpha, float(gemm_inputs(jax.random.key(6), m, n, k, fmt)["alpha"]))
        else:
            self.assertNotIn("alpha", d)
        ours = dict(sf_vec_size=block, implementation="xla", alpha=d.get("alpha"))
        c_ref, _ = jbg.gemm_amax(d["a"], d["b"], d["sfa_atom"], d["sfb_atom"], **ours)
        a64, b64 = (np.asarray(d[name], np.float64) for name in ("a_bf16", "b_bf16"))
        c64 = alpha * a64 @ b64.T
        self.assertLess(np.linalg.norm(np.asarray(c_ref) - c64) / np.linalg.norm(c64), 1e-6)
        k_a, k_b = jax.random.split(key)  # the values gemm_inputs drew, before quantization
        values = (np.asarray(random_values(k, shape), np.float64) for k, shape in ((k_a, (m, k)), (k_b, (n, k))))
        exact = np.matmul(next(values), next(values).T)
        self.assertLess(np.linalg.norm(c64 - exact) / np.linalg.norm(exact), 0.2)  # FP4 quantization error only

    def test_nvfp4_bf16_dot_is_checked_times_alpha(self):
        """The bf16 anchor is timed without alpha; its output is multiplied by alpha before the check."""
        sets = [gemm_inputs(jax.random.key(7), 64, 32, 128, "nvfp4")]
        columns = {c.key: c for c in gemm_columns("nvfp4")}
        self.assertEqual(columns["bf16_dot"].check_times, "alpha")
        _, ref = time_column(columns["reference"], sets, warmup=0, reps=1)
        _, out = time_column(columns["bf16_dot"], sets, warmup=0, reps=1)
        self.assertLess(gemm_rel_err(out, ref), 1e-5)
        self.assertGreater(gemm_rel_err(out / sets[0]["alpha"], ref), 0.5)


class MissingScaledDotTest(absltest.TestCase):

    @pytest.mark.end_to_end
    def test_missing_scaled_dot_is_shown_as_na(self):
        """A jax without jax.lax.scaled_dot (simulated) gets "n/a" in that column and every other column runs."""
        if hasattr(jax.lax, "scaled_dot"):
            saved = jax.lax.scaled_dot
            del jax.lax.scaled_dot
            self.addCleanup(setattr, jax.lax, "scaled_dot", saved)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            record = bench_main(["--op", "gemm_amax", "--shape", "64,32,64", "--reps", "2", "--warmup", "0"])
        (case,) = record["cases"]
        self.assertEqual(case["columns"]["scaled_dot"], {"na": f"jax {jax.__version__} has no jax.lax.scaled_dot"})
        self.assertTrue(all(r is None for r in case["ratios"]["vs_scaled_dot"].values()))
        for key in ("ours", "reference", "fp8_dot", "bf16_dot"):
            self.assertIn("ms", case["columns"][key])
        block = _table_block(out.getvalue(), "gemm_amax,")
        column = _cells(block[0]).index("lax.scaled_dot") - 1
        ms_row = _cells(block[1])
        self.assertEqual(ms_row[:2], ["64x32x64", "ms"])
        self.assertEqual(ms_row[2 + column], "n/a")
        self.assertEqual(_cells(block[2])[1 + column], "n/a")  # TFLOP/s
        self.assertIn("n/a lax.scaled_dot: jax", out.getvalue())
        self.assertIn("scaled_dot n/a", err.getvalue())


class NvidiaColumnTest(parameterized.TestCase):
    """NVIDIA's JAX entry points (nvidia-cudnn-frontend) are a column on compute capability 10.x only: absent here,
    added when the capability reads 10.0 (mocked; NVIDIA's kernels are never run), n/a there when they do not
    import."""

    @staticmethod
    def _keys() -> dict[str, list[str]]:
        """The column keys of every gemm format and proj_rope input path and weight layout."""
        keys = {fmt: [c.key for c in gemm_columns(fmt)] for fmt in ("mxfp8", "mxfp4", "nvfp4")}
        for mxfp8 in (False, True):
            for w_out_in in (True, False):
                keys[f"proj_rope mxfp8={mxfp8} w_out_in={w_out_in}"] = [
                    c.key for c in proj_rope_columns(mxfp8, w_out_in)]
        return keys

    def _on(self, capability, load=None):
        """Pretend the bench's device has `capability`; `load` stands in for importing an entry point."""
        self.enter_context(mock.patch.object(bench_columns, "device_capability", return_value=capability))
        if load is not None:
            self.enter_context(mock.patch.object(bench_columns, "_load_entry_point", side_effect=load))

    def test_absent_here(self):
        self.assertNotEqual((bench_columns.device_capability() or "").split(".")[0], "10")
        for name, keys in self._keys().items():
            self.assertNotIn("nvidia", keys, name)

    @parameterized.parameters(None, "9.0", "8.9", "12.0")
    def test_absent_on_other_devices(self, capability):
        self._on(capability, load=lambda module, name: self.fail(f"imported {module} on {capability}"))
        for name, keys in self._keys().items():
            self.assertNotIn("nvidia", keys, name)

    def test_added_on_compute_capability_10(self):
        """On 10.0: a column for MXFP8 gemm_amax (not the FP4 formats, which NVIDIA's entry point is not documented
        for) and proj_rope with w as (H*192, K); n/a with the reason for w as (K, H*192)."""
        loaded = []
        self._on("10.0", load=lambda module, name: loaded.append((module, name)) or (lambda *args: None))
        keys = self._keys()
        self.assertEqual(keys["mxfp8"][-1], "nvidia")
        self.assertNotIn("nvidia", keys["mxfp4"])
        self.assertNotIn("nvidia", keys["nvfp4"])
        self.assertEqual(set(loaded), set(bench_columns.NVIDIA_ENTRY_POINTS.values()))
        (gemm,) = [c for c in gemm_columns("mxfp8") if c.key == "nvidia"]
        self.assertEqual((gemm.inputs, gemm.checked), (("a", "b", "sfa_atom", "sfb_atom"), True))
        for mxfp8, inputs in ((False, ("x_bf16", "w_bf16", "cos", "sin")),
                              (True, ("x", "w", "cos", "sin", "x_scale", "w_scale"))):
            (rope,) = [c for c in proj_rope_columns(mxfp8, True) if c.key == "nvidia"]
            self.assertEqual((rope.inputs, rope.checked), (inputs, True))
            self.assertIsNotNone(rope.fn)
            (other,) = [c for c in proj_rope_columns(mxfp8, False) if c.key == "nvidia"]
            self.assertIsNone(other.fn)
            self.assertIn("takes w as (H*192, K) only", other.missing)

    def test_na_on_compute_capability_10_without_the_wheel(self):
        def load(module, name):
            raise ModuleNotFoundError(f"No module named {module.split('.')[0]!r}")

        self._on("10.0", load=load)
        (gemm,) = [c for c in gemm_columns("mxfp8") if c.key == "nvidia"]
        self.assertIsNone(gemm.fn)
        self.assertIn("gemm_amax_jax_sm100 does not import (ModuleNotFoundError: No module named 'cudnn')",
                      gemm.missing)
        self.assertIn("pip install 'nvidia-cudnn-frontend>=1.28'", gemm.missing)

    @absltest.skipUnless(importlib.util.find_spec("cudnn") is not None, "nvidia-cudnn-frontend is not installed")
    def test_entry_points_resolve_to_nvidia_functions(self):
        """The module paths name NVIDIA's functions in the installed wheel (imported, never called)."""
        self._on("10.0")
        for op, (module, name) in bench_columns.NVIDIA_ENTRY_POINTS.items():
            fn, why = bench_columns.nvidia_entry_point(op)
            self.assertEqual(why, "")
            self.assertEqual((fn.__module__, fn.__name__), (module, name))

    @pytest.mark.end_to_end
    def test_table_on_compute_capability_10(self):
        """The whole bench on the CPU with a 10.0 capability, NVIDIA's entry point played by our function of the same
        signature (jbg.gemm_amax_jax_sm100, the reference path): the column is timed and checked (a wrong operand or
        result reshaping would fail the check), labelled in the table."""
        fake = functools.partial(jbg.gemm_amax_jax_sm100, implementation="xla")
        self._on("10.0", load=lambda module, name: fake if name == "gemm_amax_jax_sm100" else None)
        with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
            record = bench_main(["--op", "gemm_amax", "--shape", "64,32,64", "--reps", "1", "--warmup", "0"])
        (case,) = record["cases"]
        entry = case["columns"]["nvidia"]
        self.assertIn("ms", entry)
        self.assertLessEqual(entry["check"], 1e-6)
        block = _table_block(out.getvalue(), "gemm_amax,")
        self.assertEqual(_cells(block[0])[1:], [*GEMM_LABELS, bench_columns.NVIDIA_LABEL])
        self.assertLen({len(line) for line in block}, 1)


class ArgumentsTest(parameterized.TestCase):

    @parameterized.parameters(
        ("8192,8192", "expected M,N,K"),
        ("8192,x,64", "expected M,N,K"),
        ("1,2,3,4", "expected M,N,K"),
        ("0,64,64", "M, N and K must be positive"),
        ("64,64,48", "K must be a multiple of 32"),
        ("64,2,64", "contiguous dimension N=2 (the result, from b and c_dtype=float32) must be a multiple of 4"),
    )
    def test_bad_shape(self, text, message):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as raised:
            bench_main(["--shape", text])
        self.assertEqual(raised.exception.code, 2)
        self.assertIn("argument --shape", err.getvalue())
        self.assertIn(message, err.getvalue())

    def test_each_format_footnote_names_its_own_codes(self):
        """The table footnote says which input form each column takes: E2M1 only for the FP4 formats."""
        from jax_blockgemm.bench import report
        from jax_blockgemm.bench.inputs import GEMM_FORMATS

        for fmt, spec in GEMM_FORMATS.items():
            self.assertEqual("E2M1" in report._gemm_note(fmt), spec.fp4, fmt)

    @parameterized.parameters(("fp4", "unknown format 'fp4' in 'fp4'"),
                              ("mxfp4,", "unknown format '' in 'mxfp4,'"),
                              ("mxfp8,nvfp8", "unknown format 'nvfp8' in 'mxfp8,nvfp8'"))
    def test_bad_format(self, text, message):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as raised:
            bench_main(["--format", text])
        self.assertEqual(raised.exception.code, 2)
        self.assertIn(f"argument --format: {message}; choose from mxfp8, mxfp8_e5m2, mxfp4, nvfp4", err.getvalue())

    @pytest.mark.end_to_end
    def test_formats_comma_list_or_repeated(self):
        self.assertEqual(parse_formats("mxfp4, NVFP4"), ["mxfp4", "nvfp4"])
        cases = build_cases(ops=("gemm_amax",), shapes=[(64, 32, 64)], small=False,
                                  gemm_formats=("mxfp8", "nvfp4"))
        self.assertEqual([(c.name, c.fmt, c.dims["format"]) for c in cases],
                         [("64x32x64", "mxfp8", "mxfp8"), ("64x32x64 nvfp4", "nvfp4", "nvfp4")])
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            record = bench_main(["--op", "gemm_amax", "--shape", "64,32,64", "--reps", "1", "--warmup", "0",
                                 "--format", "nvfp4", "--format", "mxfp4,nvfp4"])
        self.assertEqual(record["method"]["formats"], ["nvfp4", "mxfp4"])
        self.assertEqual([c["case"] for c in record["cases"]], ["64x32x64 nvfp4", "64x32x64 mxfp4"])

    @pytest.mark.end_to_end
    def test_interleave_times_every_column_in_table_order(self):
        """--interleave: the same columns, checks and table as the default, the method says how it was timed."""
        with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
            record = bench_main(["--op", "gemm_amax", "--shape", "64,32,64", "--reps", "2", "--warmup", "0",
                                 "--interleave"])
        (case,) = record["cases"]
        keys = [c.key for c in gemm_columns()]
        self.assertEqual([k for k in case["columns"] if k in keys], [k for k in keys if k in case["columns"]])
        self.assertEqual(case["columns"]["reference"]["check"], 0.0)
        self.assertIn("ms", case["columns"]["ours"])
        self.assertTrue(record["method"]["interleave"])
        self.assertIn("the columns' samples taken in turn", out.getvalue())

    @pytest.mark.end_to_end
    def test_bad_shape_from_the_command_line(self):
        proc = subprocess.run([sys.executable, "-m", "jax_blockgemm.bench", "--shape", "4096,4096"],
                              capture_output=True, text=True, timeout=300)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("argument --shape: expected M,N,K", proc.stderr)
        self.assertEqual(proc.stdout, "")

    @parameterized.parameters(("--reps", "0"), ("--warmup", "-1"), ("--sets", "two"), ("--sustained", "-1"),
                              ("--sustained", "inf"), ("--sustained", "3s"))
    def test_bad_counts(self, flag, value):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit):
            bench_main([flag, value])
        self.assertIn(f"argument {flag}", err.getvalue())

    @parameterized.parameters((["--decode", "--op", "proj_rope"], "--decode does not take --op"),
                              (["--decode", "--png", "x.png", "--sustained", "5"], "--decode does not take --png, "
                                                                                   "--sustained"),
                              (["--op", "ragged", "--shape", "64,64,64"], "--op ragged does not take --shape"),
                              (["--decode", "--moe", "256,4,96,64"], "--decode does not take --moe"),
                              (["--moe", "256,4,96,64"], "--op gemm_amax / proj_rope does not take --moe"),
                              (["--op", "ragged", "--small", "--moe", "256,4,96,64"],
                               "--op ragged --moe does not take --small"),
                              (["--json", "/no/such/dir/x.json"], "--json /no/such/dir/x.json: its directory"))
    def test_options_a_mode_would_ignore_are_refused(self, argv, message):
        """Before anything runs: a flag the chosen mode ignores (it used to be dropped silently), and an output
        path whose directory is missing (it used to fail after the whole run)."""
        with self.assertRaises(SystemExit) as raised:
            bench_main(argv)
        self.assertIn(message, str(raised.exception.code))

    def test_decode_refuses_a_sets_other_than_the_default_read_without_a_second_parser(self):
        """--decode draws its own inputs: --sets other than DEFAULT_SETS (the parser's default) is refused, the
        default is not; the check reads the constant rather than building the whole parser again."""
        self.assertEqual(bench_cli.parser().get_default("sets"), bench_cli.DEFAULT_SETS)
        given, default = (bench_cli.parser().parse_args(["--decode", *sets]) for sets in (["--sets", "3"], []))
        with mock.patch.object(bench_cli, "parser", side_effect=AssertionError("the parser was built again")):
            with self.assertRaises(SystemExit) as raised:
                bench_cli._refuse_ignored(given)
            self.assertIn("--decode does not take --sets", str(raised.exception.code))
            bench_cli._refuse_ignored(default)

    @parameterized.parameters(("256,4,96", "four integers"), ("256,4,96,x", "four integers"),
                              ("0,4,96,64", "must be positive"), ("250,4,96,64", "T must be a multiple of 4 (G"),
                              ("256,4,80,64", "K must be a multiple of 32 (the MX block)"),
                              ("256,4,96,60", "N must be a multiple of 8 (16-byte rows"))
    def test_bad_moe_cases(self, text, message):
        with self.assertRaises(argparse.ArgumentTypeError) as raised:
            bench_cli.parse_moe_case(text)
        self.assertIn(message, str(raised.exception))
        self.assertEqual(bench_cli.parse_moe_case("16384,32,7168,2048"), (16384, 32, 7168, 2048))

    def test_shapes_replace_the_default_gemm_cases(self):
        self.assertEqual(parse_shape("4096,7168,16384"), (4096, 7168, 16384))
        cases = build_cases(ops=("gemm_amax",), shapes=[(64, 32, 64), (96, 40, 128)], small=False)
        self.assertEqual([(c.name, c.flops) for c in cases], [("64x32x64", 2.0 * 64 * 32 * 64),
                                                              ("96x40x128", 2.0 * 96 * 40 * 128)])
        spec = build_cases(ops=OPS, shapes=[], small=False)
        self.assertEqual([c.name for c in spec],
                         ["8192x8192x8192", "4096x7168x16384", "4096x24576x1536", "T=2048 H=128 K=1536 bf16",
                          "T=2048 H=128 K=1536 mxfp8", "T=4096 H=128 K=1536 bf16", "T=4096 H=128 K=1536 mxfp8"])


class TimingTest(absltest.TestCase):

    def test_median_ms_rotates_sets_and_takes_the_median(self):
        calls = []
        pauses = (0.001, 0.1, 0.001)

        def fn(i):
            calls.append(i)
            time.sleep(pauses[i])
            return jnp.asarray(i)

        ms = median_ms(fn, [(0,), (1,), (2,)], warmup=2, reps=3)
        self.assertEqual(calls, [0, 1, 0, 1, 2])
        self.assertGreaterEqual(ms, 1.0)
        self.assertLess(ms, 25.0)  # the 100 ms call is the outlier the median ignores (a mean would be >= 34 ms)

    def test_median_ms_burst_waits_once_per_sample(self):
        calls, waits = [], []

        def fn(i):
            calls.append(i)
            return jnp.asarray(i)

        real = jax.block_until_ready
        with mock.patch.object(jax, "block_until_ready", side_effect=lambda x: (waits.append(1), real(x))[1]):
            median_ms(fn, [(0,), (1,), (2,)], warmup=1, reps=2, burst=4)
        self.assertEqual(calls, [0, 0, 1, 2, 0, 1, 2, 0, 1])  # warm-up, then 2 x 4 calls cycling the sets
        self.assertLen(waits, 3)  # one per warm-up call, one per sample

    def test_median_ms_sustained_runs_for_the_time_and_skips_the_first_third(self):
        calls = []
        start = time.perf_counter()

        def fn(i):
            calls.append(i)
            # slow while the "GPU warms up" (the first 0.1 s), then fast: the steady state is what counts
            time.sleep(0.03 if time.perf_counter() - start < 0.1 else 0.004)
            return jnp.asarray(i)

        ms = median_ms(fn, [(0,), (1,)], warmup=0, reps=1, sustained=0.45)
        elapsed = time.perf_counter() - start
        self.assertGreaterEqual(elapsed, 0.45)
        self.assertLess(elapsed, 5.0)
        self.assertGreater(len(calls), 20)  # not `reps` samples: as many as fit in the time
        self.assertEqual(calls[:4], [0, 1, 0, 1])
        self.assertGreaterEqual(ms, 4.0)
        self.assertLess(ms, 20.0)  # the slow first 0.1 s (30 ms calls) fall in the skipped first third

    def test_interleaved_medians_take_one_sample_of_each_function_in_turn(self):
        calls = []
        make = lambda name, pause: lambda i: (calls.append((name, i)), time.sleep(pause), jnp.asarray(i))[-1]
        slow, fast = make("slow", 0.02), make("fast", 0.001)
        ms = interleaved_medians_ms([slow, fast], [[(0,), (1,)], [(5,)]], warmup=1, reps=3, burst=2)
        # warm-up of each in turn, then rounds of one 2-call sample of each (in a shuffled order), each cycling its
        # own sets
        self.assertEqual(calls[:2], [("slow", 0), ("fast", 5)])
        rounds = [calls[2 + 4 * r:6 + 4 * r] for r in range(3)]
        self.assertLen(calls, 14)
        slow2, fast2 = [("slow", 0), ("slow", 1)], [("fast", 5), ("fast", 5)]
        for r in rounds:
            self.assertIn(r, (slow2 + fast2, fast2 + slow2))
        self.assertGreaterEqual(ms[0], 20.0)
        self.assertLess(ms[1], 15.0)

    def test_interleaved_orders_vary_the_predecessor(self):
        """Over the rounds every function is preceded by more than one other (a fixed or rotated order would give
        each the same predecessor every time)."""
        order = []
        fns = [lambda i, n=n: (order.append(n), jnp.asarray(i))[-1] for n in range(4)]
        interleaved_medians_ms(fns, [[(0,)]] * 4, warmup=0, reps=12)
        before = {n: {order[i - 1] for i in range(1, len(order)) if order[i] == n} for n in range(4)}
        self.assertTrue(all(len(b) >= 2 for b in before.values()), before)

    def test_interleaved_sustained_shares_the_time(self):
        start = time.perf_counter()
        counts = [0, 0]

        def fn(j):
            def call(i):
                counts[j] += 1
                time.sleep(0.005)
                return jnp.asarray(i)
            return call

        ms = interleaved_medians_ms([fn(0), fn(1)], [[(0,)], [(0,)]], warmup=0, reps=1, sustained=0.3)
        self.assertGreaterEqual(time.perf_counter() - start, 0.3)
        self.assertLess(time.perf_counter() - start, 5.0)
        self.assertEqual(counts[0], counts[1])  # whole rounds only
        self.assertGreater(counts[0], 10)
        self.assertTrue(all(4.0 <= m < 30.0 for m in ms), ms)

    def test_random_mxfp8_scales_are_random_and_never_zero(self):
        codes, scales = random_mxfp8(jax.random.key(3), (64, 256))
        self.assertEqual(codes.dtype, jnp.float8_e4m3fn)
        self.assertEqual(scales.shape, (64, 8))
        self.assertGreater(len(set(scales.tolist()[0]) | set(scales[:, 0].tolist())), 4)
        self.assertTrue(bool(jnp.all((scales > 0) & (scales < 255))))
        self.assertGreater(float(jnp.mean(codes.astype(jnp.float32) != 0)), 0.9)


@pytest.mark.end_to_end
class LaunchCostsTest(absltest.TestCase):

    def test_launch_costs(self):
        """--launch: first calls in fresh processes and per-call costs are positive; no kernel here is n/a."""
        launch = launch_costs(calls=50)
        ours = launch["ours"]
        for key in ("first_call_cold_ms", "first_call_warm_cache_ms", "per_call_us"):
            self.assertTrue(math.isfinite(ours[key]) and ours[key] > 0, key)
        self.assertGreater(launch["plain_xla_op_us"], 0)
        if not _has_kernel_gpu():
            self.assertIn("no CuTeDSL kernel", launch["ours_cutedsl"]["na"])
        lines = format_launch(launch)
        self.assertIn("launch costs, gemm_amax 128x128x128", lines[1])
        self.assertIn(f"{ours['per_call_us']:.1f} us per call", lines[2])


@absltest.skipUnless(_has_kernel_gpu(), "needs a CUDA GPU with a CuTeDSL kernel (sm_90a)")
class GpuBenchTest(absltest.TestCase):

    def test_small_on_the_gpu(self):
        """On a GPU with a kernel, the kernel column and the cuDNN/XLA baselines all produce numbers."""
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            record = bench_main(["--small", "--op", "gemm_amax", "--reps", "3", "--warmup", "1"])
        for case in record["cases"]:
            for key in ("ours", "ours_cutedsl", "reference", "scaled_matmul", "fp8_dot", "bf16_dot"):
                self.assertIn("ms", case["columns"][key], (case["case"], key, case["columns"][key]))
            self.assertIsNotNone(case["ratios"]["vs_scaled_matmul"]["ours_cutedsl"])
            for key in ("ours", "ours_cutedsl", "scaled_matmul"):
                self.assertLessEqual(case["columns"][key]["check"], 1e-4, (case["case"], key))  # SPEC §7, fp32 C


if __name__ == "__main__":
    absltest.main()
