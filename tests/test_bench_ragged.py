"""`python -m jax_blockgemm.bench --op ragged` on the CPU (`--small`): group sizes, the columns and their tables."""

import contextlib
import io
import json
import os
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest

from jax_blockgemm.bench import kernel_time, ragged
from jax_blockgemm.bench.cli import main as bench_main


class GroupSizesTest(absltest.TestCase):

    def test_equal_groups_differ_by_at_most_one_token(self):
        sizes = ragged.group_sizes(1000, 7, "equal", seed=0)
        self.assertEqual((sizes.sum(), sizes.max() - sizes.min(), sizes.dtype), (1000, 1, np.int32))

    def test_skewed_groups_sum_to_the_tokens_and_follow_the_seed(self):
        a = ragged.group_sizes(16384, 32, "skewed", seed=3)
        self.assertEqual(int(a.sum()), 16384)
        self.assertTrue((a >= 0).all())
        self.assertGreater(a.max(), 3 * 16384 // 32)  # Dirichlet(0.5): some expert takes several times its share
        np.testing.assert_array_equal(a, ragged.group_sizes(16384, 32, "skewed", seed=3))
        self.assertFalse(np.array_equal(a, ragged.group_sizes(16384, 32, "skewed", seed=4)))


class RaggedBenchTest(absltest.TestCase):

    def test_ragged_runs_alone(self):
        with self.assertRaises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            bench_main(["--op", "ragged", "--op", "gemm_amax", "--small"])

    def test_the_step_computes_the_forward(self):
        """The step returns the loss <x · W_g, dy> with its gradients, so its forward is part of the program (with the
        gradients alone XLA drops it: the loss is linear in the forward's result)."""
        rng = np.random.default_rng(0)
        x, w, dy = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((8, 6), (2, 6, 5), (8, 5)))
        loss, (dx, dw) = jax.jit(ragged._step(ragged._dense))(x, w, dy)
        as64 = lambda a: np.asarray(a.astype(jnp.bfloat16), np.float64)  # the dense step multiplies in bf16
        y = np.einsum("gtk,gkn->gtn", as64(x).reshape(2, 4, 6), as64(w)).reshape(8, 5)
        terms = y * np.asarray(dy, np.float64)
        self.assertLess(abs(float(loss) - terms.sum()), 1e-2 * np.abs(terms).sum())
        self.assertEqual((dx.shape, dw.shape), (x.shape, w.shape))
        text = jax.jit(ragged._step(ragged._dense)).lower(x, w, dy).compile().as_text()
        self.assertEqual(text.count(" dot("), 3)  # forward, dgrad, wgrad

    def test_moe_cases_replace_the_default_shapes(self):
        """--moe T,G,K,N (repeatable): those cases, equal and skewed, instead of the three default shapes."""
        with mock.patch.object(ragged, "run_case", side_effect=lambda key, t, g, k, n, grouping, **kw: {
                "tokens": t, "groups": g, "k": k, "n": n, "grouping": grouping}) as run, \
                mock.patch.object(ragged, "format_table", return_value=""), \
                contextlib.redirect_stdout(io.StringIO()):
            record = bench_main(["--op", "ragged", "--moe", "256,4,96,64", "--moe", "128,8,64,32"])
        self.assertEqual([(c["tokens"], c["groups"], c["k"], c["n"], c["grouping"]) for c in record["cases"]],
                         [(256, 4, 96, 64, "equal"), (256, 4, 96, 64, "skewed"),
                          (128, 8, 64, 32, "equal"), (128, 8, 64, 32, "skewed")])
        self.assertEqual(run.call_count, 4)

    def test_grouping_and_columns_choose_what_runs(self):
        """--grouping and --columns (repeatable, comma lists): only those groupings, and only those columns (each
        format's own for the per-format keys); unknown keys and other modes refused."""
        self.assertEqual(list(ragged.columns(jnp.ones(2, jnp.int32), ("mxfp8", "mxfp4"), ("ours", "dense"))),
                         ["ours", "ours_mxfp4", "dense"])
        self.assertLen(ragged.columns(jnp.ones(2, jnp.int32)), len(ragged.FORWARD) + len(ragged.STEP))
        with mock.patch.object(ragged, "run_case", side_effect=lambda key, t, g, k, n, grouping, **kw: {
                "grouping": grouping, "only": kw["only"]}), \
                mock.patch.object(ragged, "format_table", return_value=""), \
                contextlib.redirect_stdout(io.StringIO()):
            record = bench_main(["--op", "ragged", "--moe", "256,4,96,64", "--grouping", "skewed",
                                 "--columns", "ours,dense", "--columns", "step_dense"])
        self.assertEqual(record["cases"], [{"grouping": "skewed", "only": ("ours", "dense", "step_dense")}])
        for argv in (["--op", "ragged", "--columns", "ours,nope"], ["--op", "gemm_amax", "--grouping", "equal"],
                     ["--decode", "--columns", "ours"]):
            with self.subTest(argv=argv), self.assertRaises(SystemExit), \
                    contextlib.redirect_stderr(io.StringIO()):
                bench_main(argv)

    def test_table_shows_only_the_timed_columns(self):
        case = {"tokens": 8, "groups": 2, "k": 64, "n": 32, "grouping": "skewed",
                "columns": {"ours": {"ms": 2.0}, "dense": {"ms": 1.0}}}
        record = {"environment": {"device": "cpu"}, "date": "today", "method": {"timing": "t", "formats": ["mxfp8"]},
                  "cases": [case]}
        table = ragged.format_table(record)
        self.assertIn("2 (2.00x)", table)
        self.assertNotIn("lax.ragged_dot", table)
        self.assertNotIn("training step", table)

    @pytest.mark.end_to_end
    def test_small_run_prints_both_tables_and_writes_json(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ragged.json")
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                record = bench_main(["--op", "ragged", "--small", "--reps", "1", "--warmup", "0", "--burst", "1",
                                     "--json", path])
            with open(path) as f:
                self.assertEqual(json.load(f)["cases"], json.loads(json.dumps(record["cases"])))
        cases = record["cases"]
        self.assertLen(cases, len(ragged.SMALL_SHAPES) * len(ragged.GROUPINGS))
        for case in cases:
            self.assertEqual(sum(case["group_sizes"]), case["tokens"])
            self.assertEqual(set(case["columns"]), set(ragged.FORWARD) | set(ragged.STEP))
            for key, result in case["columns"].items():
                self.assertGreater(result["ms"], 0, key)  # every column runs on a CPU
            if case["grouping"] == "equal":  # bf16 columns agree with the dense dot to bf16 rounding; MXFP8 to its
                cols = case["columns"]
                for key in ("bf16_recipe", "ragged_dot", "step_bf16"):
                    self.assertLess(cols[key]["rel_err_vs_dense"], 1e-2, key)
                for key in ("ours", "weight_only", "mxfp8_recipe", "step_mxfp8"):
                    self.assertLess(cols[key]["rel_err_vs_dense"], 0.1, key)
        text = out.getvalue()
        self.assertIn("training step: forward, dgrad, wgrad", text)
        self.assertIn("wall time per call of 1 jitted calls issued back to back and ended by one block_until_ready; "
                      "the median of 1 samples\n", text)  # the protocol, in the header
        for case in cases:
            self.assertIn(f"{case['tokens']}, {case['groups']}, {case['k']} -> {case['n']}, {case['grouping']}", text)

    @pytest.mark.end_to_end
    def test_formats_add_their_own_columns(self):
        """--format mxfp4,nvfp4: the ragged GEMM on those codes (NVFP4 with its alpha) and the weight-only matmul on
        those experts, each its own column beside the MXFP8 ones it replaces (here kept by naming mxfp8 too), with
        the format's rounding against the dense dot on equal groups."""
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            record = bench_main(["--op", "ragged", "--small", "--reps", "1", "--warmup", "0", "--burst", "1",
                                 "--format", "mxfp8,mxfp4", "--format", "nvfp4"])
        self.assertEqual(record["method"]["formats"], ["mxfp8", "mxfp4", "nvfp4"])
        forward = ragged.forward_columns(("mxfp8", "mxfp4", "nvfp4"))
        self.assertEqual(set(forward) - set(ragged.FORWARD),
                         {"ours_mxfp4", "weight_only_mxfp4", "ours_nvfp4", "weight_only_nvfp4"})
        for case in record["cases"]:
            self.assertEqual(set(case["columns"]), set(forward) | set(ragged.STEP))
            if case["grouping"] == "equal":
                for key in ("ours_mxfp4", "weight_only_mxfp4", "ours_nvfp4", "weight_only_nvfp4"):
                    err = case["columns"][key]["rel_err_vs_dense"]
                    self.assertTrue(0 < err < 0.3, (key, err))  # E2M1's rounding: nonzero, far from garbage
        for label in ("ours(None) mxfp4", "weight-only nvfp4", "weight-only mxfp8"):
            self.assertIn(label, out.getvalue())
        self.assertEqual(ragged.forward_columns(), ragged.FORWARD)  # the default: MXFP8's columns alone

    def test_interleaved_sustained_run_times_every_column_and_records_the_method(self):
        """--interleave compiles a case's columns first and samples them in turn; --sustained replaces --reps by a
        time; both reach the timing and the record's method (the ragged benchmark used to ignore them)."""
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            record = bench_main(["--op", "ragged", "--small", "--warmup", "0", "--burst", "1", "--interleave",
                                 "--sustained", "0.05"])
        self.assertEqual((record["method"]["interleave"], record["method"]["sustained_s"]), (True, 0.05))
        self.assertIn("samples back to back for 0.05 s per case, the median over the last two thirds; the columns' "
                      "samples taken in turn\n", out.getvalue())
        for case in record["cases"]:
            self.assertEqual(set(case["columns"]), set(ragged.FORWARD) | set(ragged.STEP))
            for key, result in case["columns"].items():
                self.assertGreater(result["ms"], 0, key)

    def test_kernels_option_records_every_columns_kernels(self):
        """--kernels traces each column, forward and step; on a CPU the trace has no GPU stream, so the record holds
        an empty breakdown and the table says so (the labels and sums come from `kernel_time`, tested below)."""
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            record = bench_main(["--op", "ragged", "--small", "--reps", "1", "--warmup", "0", "--burst", "1",
                                 "--kernels"])
        on_cpu = jax.default_backend() == "cpu"
        for case in record["cases"]:
            for key, result in case["columns"].items():
                self.assertIn("kernels", result, key)
                if on_cpu:
                    self.assertEqual(result["kernels"], {}, key)
                elif "ms" in result:
                    self.assertTrue(result["kernels"] and min(result["kernels"].values()) > 0, key)
        self.assertIn("GPU time per kernel, ms per call", out.getvalue())
        if on_cpu:
            self.assertIn("step bf16 recipe: no GPU kernels in the trace", out.getvalue())
            self.assertIn("ours(None): no GPU kernels in the trace", out.getvalue())


class KernelTimeTest(absltest.TestCase):
    """`kernel_time`: the GPU stream tracks of a Chrome-format trace, summed per kernel label."""

    def _trace(self):
        meta = lambda ph_name, pid, name, tid=None: dict(ph="M", name=ph_name, pid=pid, args=dict(name=name),
                                                        **({} if tid is None else dict(tid=tid)))
        ours = "kernel_cutlass_kernel_jax_blockgemmkernelssm90ragged_swap_abHopperRaggedSwapAB_object_at__CopyAtom_x"
        contraction = "kernel_cutlass_kernel_jax_blockgemmkernelssm90contractionHopperGroupedContraction_object_a"
        return [meta("process_name", 1, "/device:GPU:0"), meta("process_name", 2, "/host:CPU"),
                meta("thread_name", 1, "Stream #14(Compute,Memset)", 7), meta("thread_name", 1, "XLA Ops", 8),
                meta("thread_name", 2, "python", 9),
                dict(ph="X", pid=1, tid=7, name=ours, dur=300.0), dict(ph="X", pid=1, tid=7, name=ours, dur=200.0),
                dict(ph="X", pid=1, tid=7, name=contraction, dur=100.0),
                dict(ph="X", pid=1, tid=7, name="gemm_fusion_dot_general_9", dur=50.0),
                dict(ph="X", pid=1, tid=8, name="fusion.3", dur=999.0),  # XLA's op track: the same time again
                dict(ph="X", pid=2, tid=9, name=ours, dur=999.0)]  # host side

    def test_sums_stream_tracks_of_the_device_only(self):
        self.assertEqual(kernel_time.device_kernel_us(self._trace()),
                         {"HopperRaggedSwapAB": 500.0, "HopperGroupedContraction": 100.0,
                          "gemm_fusion_dot_general_9": 50.0})
        self.assertEqual(kernel_time.device_kernel_us(self._trace(), device="/device:TPU:"), {})

    def test_describe(self):
        self.assertEqual(kernel_time.describe({"HopperRaggedBf16Gemm": 1.5, "HopperGroupedContraction": 0.25}),
                         "1.750 = HopperRaggedBf16Gemm 1.500, HopperGroupedContraction 0.250")
        self.assertEqual(kernel_time.describe({}), "no GPU kernels in the trace")

    def test_labels(self):
        self.assertEqual(kernel_time.kernel_label(
            "kernel_cutlass_kernel_jax_blockgemmkernelsquantize_pairMxQuantizePair_object_at__tensorptr"),
            "MxQuantizePair")
        self.assertEqual(kernel_time.kernel_label("nvjet_sm90_tss_256x128_64x4_1x2_h_bz_coopA_NNT"),
                         "nvjet_sm90_tss_256x128_64x4_1x2_h_bz_coopA_NNT")


if __name__ == "__main__":
    absltest.main()
