"""`python -m jax_blockgemm.bench --decode` on the CPU (`--small`): its tables and JSON, the inputs each column
takes (the same weight values in every form), the timed program (every matrix applied to its own x, every result
kept) and the read-bandwidth measurement.
"""

import contextlib
import io
import json
import os
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg
from jax_blockgemm import arch, formats
from jax_blockgemm.bench import decode, inputs
from jax_blockgemm.bench.cli import main as bench_main, parser

import oracle_ops


class DecodeBenchTest(parameterized.TestCase):

    def test_shapes_given_replace_the_default_cases_grouped_by_weight(self):
        self.assertEqual(decode.plan([(16, 7168, 2048), (1, 4096, 1024), (1, 7168, 2048), (16, 7168, 2048)],
                                     small=False),
                         [(2048, 7168, (16, 1)), (1024, 4096, (1,))])
        self.assertEqual(decode.plan([], small=False), [(k, n, decode.M_VALUES) for k, n in decode.SHAPES])
        self.assertEqual(decode.plan([], small=True), [(k, n, decode.SMALL_M_VALUES) for k, n in decode.SMALL_SHAPES])

    @pytest.mark.end_to_end
    def test_a_run_with_shapes_times_exactly_those_cases(self):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            record = bench_main(["--decode", "--small", "--shape", "3,64,96", "--format", "mxfp4", "--reps", "1",
                                 "--warmup", "0", "--burst", "1"])
        self.assertEqual([(c["format"], c["m"], c["n"], c["k"]) for c in record["cases"]], [("mxfp4", 3, 64, 96)])
        self.assertGreater(record["cases"][0]["columns"]["ours"]["us"], 0)

    def test_interleave_samples_the_columns_in_turn(self):
        """--interleave: every column of a case compiled first, then one interleaved timing over all of them (the
        default times them one after another); the record's method and the table's header say which."""
        from unittest import mock

        calls = []
        real = decode.interleaved_medians_ms

        def spy(fns, arg_sets, **kw):
            calls.append(len(fns))
            return real(fns, arg_sets, **kw)

        runs = {}
        for flags in ([], ["--interleave"]):
            out = io.StringIO()
            with mock.patch.object(decode, "interleaved_medians_ms", spy), contextlib.redirect_stdout(out), \
                    contextlib.redirect_stderr(io.StringIO()):
                record = bench_main(["--decode", "--small", "--shape", "2,64,96", "--format", "mxfp8", "--reps", "1",
                                     "--warmup", "0", "--burst", "1", *flags])
            runs[bool(flags)] = (record, out.getvalue(), list(calls))
            calls.clear()
        timed = [key for key, e in runs[True][0]["cases"][0]["columns"].items() if "us" in e]
        self.assertGreaterEqual(len(timed), 4)
        self.assertEqual(runs[True][2], [len(timed)])  # one call over all the case's columns
        self.assertEqual(runs[False][2], [])  # median_ms per column
        self.assertTrue(runs[True][0]["method"]["interleave"])
        self.assertFalse(runs[False][0]["method"]["interleave"])
        self.assertIn("the columns' samples taken in turn", runs[True][1])
        self.assertNotIn("taken in turn", runs[False][1])

    def test_kernels_option_traces_every_column(self):
        """--kernels records each column's kernels per GEMM; on a CPU the trace has no GPU stream, so each breakdown is
        empty and the table says so. Without --op ragged or --decode the option is refused."""
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            record = bench_main(["--decode", "--small", "--shape", "2,64,96", "--format", "mxfp8", "--reps", "1",
                                 "--warmup", "0", "--burst", "1", "--kernels"])
        columns = record["cases"][0]["columns"]
        self.assertTrue(all("kernels_us" in e for e in columns.values() if "us" in e))
        if jax.default_backend() == "cpu":
            self.assertEqual({key: e["kernels_us"] for key, e in columns.items() if "us" in e},
                             {key: {} for key, e in columns.items() if "us" in e})
            self.assertIn("M = 2, ours(None): no GPU kernels in the trace", out.getvalue())
        self.assertIn("GPU time per GEMM by kernel", out.getvalue())
        with self.assertRaises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            bench_main(["--small", "--kernels"])

    @pytest.mark.end_to_end
    def test_small_run_prints_the_tables_and_writes_json(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "decode.json")
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                record = bench_main(["--decode", "--small", "--format", "mxfp8,nvfp4", "--reps", "2", "--warmup",
                                     "1", "--burst", "1", "--json", path])
            with open(path) as f:
                self.assertEqual(json.load(f)["cases"], json.loads(json.dumps(record["cases"])))
        text = out.getvalue()
        self.assertGreater(record["read_bandwidth"]["gb_per_s"], 0)
        cases = [(c["format"], c["k"], c["n"], c["m"]) for c in record["cases"]]
        self.assertEqual(cases, [(f, k, n, m) for f in ("mxfp8", "nvfp4") for k, n in decode.SMALL_SHAPES
                                 for m in decode.SMALL_M_VALUES])
        for case in record["cases"]:
            self.assertEqual(case["matrices"], decode.SMALL_MATRICES)
            self.assertEqual(set(case["columns"]), set(decode.COLUMNS))
            for key, entry in case["columns"].items():
                if "na" in entry:  # only the FP8 anchor may be missing on some platforms
                    self.assertEqual(key, "fp8_dot", entry)
                    continue
                self.assertGreater(entry["us"], 0)
                self.assertAlmostEqual(entry["fraction_of_read_bandwidth"],
                                       entry["weight_gb_per_s"] / record["read_bandwidth"]["gb_per_s"])
            self.assertLessEqual(case["columns"]["ours"]["rel_err_vs_reference"], 1e-6)
        for title in ("MXFP8 E4M3 weights, bf16 x", "NVFP4 E2M1 x alpha weights, bf16 x"):
            self.assertIn(title, text)
        header = next(line for line in text.splitlines() if line.startswith("MXFP8"))
        self.assertEqual(re.split(r"\s{2,}", header)[1:], ["M", *decode.COLUMNS.values()])
        rows = [line for line in text.splitlines() if re.match(r"\d+ -> \d+ ", line)]
        self.assertLen(rows, len(cases))
        self.assertRegex(rows[0], r"^256 -> 128 +1 +[0-9.]+ \(\d+%\)")
        footnote = " ".join(text[text.index("ours: weight_only_matmul"):].split())  # unwrapped
        self.assertIn(" ".join(decode.decode_policy(("mxfp8", "nvfp4")).split()), footnote)
        for row in arch.TABLE:  # every threshold the table holds for these formats is spelled out with its target
            largest = {row.decode_max_m.get(inputs.GEMM_FORMATS[f].weight_format, 0) for f in ("mxfp8", "nvfp4")}
            if row.target and max(largest) > 0:
                self.assertIn(f"a decode kernel on {row.target} for ", footnote)
                for value in largest - {0}:
                    self.assertIn(f"M <= {value}", footnote)
        self.assertEqual(decode.format_table(json.loads(json.dumps(record))), text.rstrip("\n"))

    def test_the_footnote_reads_the_decode_thresholds_from_the_arch_table(self):
        formats_ = ("mxfp8", "mxfp4", "nvfp4")
        first, last = arch.policy("sm_90a").decode_swap_ab_m["mxfp8_e4m3"]
        self.assertRegex(decode.decode_policy(formats_),
                         rf"; MXFP8 E4M3(, [^;]+)? at M = {first}-{last}: the swap_ab tile")
        with arch.overridden("9.0", decode_swap_ab_m={"mxfp8_e4m3": (first, last)}):  # a format the tile lacks
            self.assertNotIn("swap_ab", decode.decode_policy(("mxfp4",)))
        self.enterContext(arch.overridden("9.0", decode_swap_ab_m={}))  # below: the decode kernel's rules alone
        with arch.overridden("9.0", decode_max_m={f: 48 for f in arch.DECODE_FORMATS}, decode_short_k={}):
            self.assertIn("a decode kernel on sm_90a for M <= 48 (", decode.decode_policy(formats_))
        with arch.overridden("9.0", decode_max_m={f: 48 for f in arch.DECODE_FORMATS},
                             decode_short_k={"mxfp8_e4m3": (4096, 16)}):
            self.assertIn("on sm_90a for M <= 48; M <= 16 below K = 4096 for MXFP8 E4M3 (",
                          decode.decode_policy(formats_))
            self.assertIn("on sm_90a for M <= 48 (", decode.decode_policy(("mxfp4",)))  # not its rule
        with arch.overridden("9.0", decode_max_m={"mxfp8_e4m3": 16, "mxfp4": 0, "nvfp4": 32}, decode_short_k={}):
            self.assertIn("on sm_90a for MXFP8 E4M3: M <= 16, MXFP4 E2M1: never, NVFP4 E2M1 x alpha: M <= 32 (",
                          decode.decode_policy(formats_))
            self.assertIn("on sm_90a for M <= 16 (", decode.decode_policy(("mxfp8",)))
        with arch.overridden("9.0", decode_max_m={}), arch.overridden("10.0", decode_max_m={"mxfp4": 8}):
            policy = decode.decode_policy(formats_)
            self.assertNotIn("sm_90a", policy)
            self.assertIn("on sm_100a for MXFP8 E4M3: never, MXFP4 E2M1: M <= 8, NVFP4 E2M1 x alpha: never", policy)
            self.assertRegex(decode.decode_policy(("nvfp4",)), r"runs the reference .* on every device")

    def test_decode_is_a_flag_of_the_benchmark(self):
        self.assertIn("--decode", parser().format_help())

    @parameterized.parameters("mxfp4", "nvfp4", "mxfp8_e5m2")
    def test_every_column_takes_the_same_weight_values(self, fmt):
        k, n, m = 96, 40, 3
        weight = decode.weight_inputs(jax.random.key(0), k, n, fmt)
        x = decode.activation_inputs(jax.random.key(1), m, k, fmt, weight)
        w = weight["w"]
        self.assertEqual((w.format, w.shape), (inputs.GEMM_FORMATS[fmt].weight_format, (n, k)))
        np.testing.assert_array_equal(np.asarray(weight["w_bf16"], np.float32), np.asarray(w.dequantize()).astype(
            jnp.bfloat16).astype(np.float32))
        block = 16 if fmt == "nvfp4" else 32
        # gemm_amax's operands: the same codes and scales as the QuantizedWeight, alpha = both per-tensor scales
        np.testing.assert_array_equal(np.asarray(weight["sfb"]), np.asarray(w.scales))
        c, _ = jbg.gemm_amax(x["a"], weight["b"], x["sfa"], weight["sfb"], sf_vec_size=block, alpha=x.get("alpha"))
        a_hat = formats.dequantize(x["a"], x["sfa"], block=block)
        b_hat = np.asarray(w.dequantize(), np.float64) / float(w.alpha)  # the codes times their block scales
        alpha = float(x["alpha"]) if fmt == "nvfp4" else 1.0  # NVFP4: both per-tensor scales
        want = alpha * np.asarray(a_hat, np.float64) @ b_hat.T
        oracle_ops.assert_rel_close(self, "gemm_amax column", c, want, 1e-5)

    def test_the_program_applies_each_matrix_to_its_own_x(self):
        matrices = [decode.weight_inputs(jax.random.key(i), 64, 32, "mxfp4") for i in range(3)]
        xs = [decode.activation_inputs(jax.random.key(10 + i), 2, 64, "mxfp4", w) for i, w in enumerate(matrices)]
        ours = next(c for c in decode.columns("mxfp4") if c.key == "ours")
        per_matrix = [(x["x"], w["w"]) for x, w in zip(xs, matrices)]
        outs = jax.jit(decode.program(ours.fn))(per_matrix)
        self.assertLen(outs, 3)
        for out, (x, w) in zip(outs, per_matrix):
            np.testing.assert_array_equal(np.asarray(out), np.asarray(jbg.weight_only_matmul(x, w)))
        self.assertEqual(ours.weight_bytes({"w": matrices[0]["w"]}), 32 * 32 + 32 * 2)  # packed codes + scales

    @parameterized.parameters("mxfp8", "mxfp4")
    def test_the_read_floor_reads_every_code_byte(self, fmt):
        codes = decode.weight_inputs(jax.random.key(3), 96, 40, fmt)["b"]
        raw = np.asarray(jax.lax.bitcast_convert_type(codes, jnp.uint8) if codes.dtype != jnp.uint8 else codes)
        self.assertEqual(int(decode.read_all(codes)), int(raw.view(np.uint32).max()))
        for row, col in ((0, 0), (39, raw.shape[1] - 1), (17, raw.shape[1] // 2)):  # the largest word anywhere
            marked = raw.copy()
            marked[row, col - col % 4:col - col % 4 + 4] = 0xFF
            as_codes = jnp.asarray(marked) if codes.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(
                jnp.asarray(marked), codes.dtype)
            self.assertEqual(int(decode.read_all(as_codes)), 0xFFFFFFFF)

    def test_read_bandwidth(self):
        measured = decode.read_bandwidth(2**20, warmup=0, reps=2)
        self.assertEqual(measured["bytes"], 2**20)
        self.assertAlmostEqual(measured["gb_per_s"], 2**20 / (measured["ms"] * 1e-3) / 1e9)


if __name__ == "__main__":
    absltest.main()
