"""`python -m jax_blockgemm.tune` and the per-GPU-model decision tables that implementation=None follows (CPU: the
GPU, its timings and the lowering's device are faked; the decisions, the store and dispatch are real)."""

import io
import json
import os
import pathlib
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import jax_blockgemm as jbg
from jax_blockgemm import arch, dispatch, tune, tuning

import oracle

H200 = "NVIDIA H200"


class DecideTest(absltest.TestCase):

    def test_kernel_from_the_smallest_size_from_which_it_always_wins(self):
        d = tuning.decide("gemm_amax", "mxfp4", [(8, 1.0, 2.0), (1, 1.0, 0.5), (64, 3.0, 4.0)])
        self.assertEqual((d.choice, d.min_size), (tuning.KERNEL, 8))
        d = tuning.decide("gemm_amax", "mxfp4", [(8, 1.0, 2.0), (1, 1.0, 2.0)])
        self.assertEqual((d.choice, d.min_size), (tuning.KERNEL, 1))

    def test_default_when_the_kernel_loses_at_the_largest_size_or_wins_by_less_than_the_margin(self):
        self.assertEqual(tuning.decide("proj_rope", "bf16", [(1, 1.0, 2.0), (9, 2.0, 1.9)]).choice, tuning.DEFAULT)
        self.assertEqual(tuning.decide("proj_rope", "bf16", [(9, 1.0, 1.01)]).choice, tuning.DEFAULT)


class DecideDecodeTest(absltest.TestCase):

    def test_kernel_up_to_the_largest_m_below_which_it_always_wins(self):
        d = tuning.decide_decode("mxfp4", [(64, 3.0, 2.0), (1, 1.0, 2.0), (16, 1.0, 1.5)])
        self.assertEqual((d.op, d.choice, d.max_m), ("weight_stream", tuning.KERNEL, 16))
        d = tuning.decide_decode("mxfp4", [(1, 1.0, 2.0), (16, 2.0, 1.0), (64, 1.0, 2.0)])  # a loss at 16 ends it
        self.assertEqual((d.choice, d.max_m), (tuning.KERNEL, 1))

    def test_default_when_it_loses_at_the_fewest_rows(self):
        d = tuning.decide_decode("nvfp4", [(1, 1.0, 1.01), (16, 1.0, 2.0)])  # within the margin at M = 1
        self.assertEqual((d.choice, d.max_m), (tuning.DEFAULT, 0))

    def test_a_decode_decision_is_read_by_rows(self):
        with mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": self.enter_context(
                tempfile.TemporaryDirectory()), tuning.IGNORE_ENV: ""}):
            tuning.store(H200, [tuning.decide_decode("mxfp8_e4m3", [(1, 1.0, 2.0), (16, 1.0, 2.0),
                                                                   (64, 3.0, 2.0)])])
            self.assertEqual(tuning.decode_max_m(H200, "mxfp8_e4m3"), 16)
            self.assertIsNone(tuning.decode_max_m(H200, "mxfp4"))  # no decision: arch.TABLE decides
            self.assertIsNone(tuning.decode_max_m("NVIDIA B200", "mxfp8_e4m3"))  # another GPU model
            with self.assertRaisesRegex(ValueError, "decided by rows: use decode_max_m"):
                tuning.takes_kernel(H200, "weight_stream", "mxfp8_e4m3", 1)


class StoreTest(absltest.TestCase):

    def setUp(self):
        self.enter_context(mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": self.enter_context(
            tempfile.TemporaryDirectory())}))
        self.enter_context(mock.patch.dict(os.environ, {tuning.IGNORE_ENV: ""}))

    def test_round_trip_threshold_ignore_and_reset(self):
        self.assertIsNone(tuning.takes_kernel(H200, "gemm_amax", "mxfp4", 10))
        tuning.store(H200, [tuning.decide("gemm_amax", "mxfp4", [(8, 1.0, 2.0)]),
                            tuning.decide("proj_rope", "bf16", [(8, 2.0, 1.0)])])
        self.assertTrue(tuning.takes_kernel(H200, "gemm_amax", "mxfp4", 8))
        self.assertFalse(tuning.takes_kernel(H200, "gemm_amax", "mxfp4", 7))  # below what was measured
        self.assertFalse(tuning.takes_kernel(H200, "proj_rope", "bf16", 100))  # measured slower
        self.assertIsNone(tuning.takes_kernel(H200, "gemm_amax", "nvfp4", 100))  # not measured: arch.TABLE
        self.assertIsNone(tuning.takes_kernel("NVIDIA B200", "gemm_amax", "mxfp4", 100))  # another GPU model
        for ignore in ("1", "true", "Yes", " on "):
            with mock.patch.dict(os.environ, {tuning.IGNORE_ENV: ignore}):
                self.assertIsNone(tuning.takes_kernel(H200, "gemm_amax", "mxfp4", 8), ignore)
        for use in ("0", "false", "No", "off"):
            with mock.patch.dict(os.environ, {tuning.IGNORE_ENV: use}):
                self.assertTrue(tuning.takes_kernel(H200, "gemm_amax", "mxfp4", 8), use)
        with mock.patch.dict(os.environ, {tuning.IGNORE_ENV: "maybe"}), \
                self.assertRaisesRegex(ValueError, "JAX_BLOCKGEMM_IGNORE_TUNING='maybe': expected 1, true"):
            tuning.takes_kernel(H200, "gemm_amax", "mxfp4", 8)
        self.assertEqual(tuning.load(H200)[0].measured, ((8, 1.0, 2.0),))
        self.assertEqual(tuning.reset(H200), [tuning.table_path(H200)])
        self.assertIsNone(tuning.takes_kernel(H200, "gemm_amax", "mxfp4", 8))

    def test_a_failed_store_leaves_the_old_table_and_no_temporary_file(self):
        """The table is replaced atomically or not at all: a rename that fails raises, keeps the earlier table and
        leaves nothing beside it."""
        path = tuning.store(H200, [tuning.decide("gemm_amax", "mxfp4", [(8, 1.0, 2.0)])])
        before = path.read_bytes()
        with mock.patch("os.replace", side_effect=OSError("disk full")), self.assertRaisesRegex(OSError, "disk full"):
            tuning.store(H200, [tuning.decide("gemm_amax", "mxfp4", [(8, 2.0, 1.0)])])
        self.assertEqual(path.read_bytes(), before)
        self.assertEqual(sorted(p.name for p in path.parent.iterdir()), [path.name])

    def test_a_table_measured_on_other_kernels_is_ignored_with_a_warning(self):
        """A table carries the kernels it timed (the object cache's source hash); after an upgrade that changed
        them its decisions no longer hold, and arch.TABLE decides until tune runs again."""
        path = tuning.store(H200, [tuning.decide("gemm_amax", "mxfp4", [(8, 1.0, 2.0)])])
        record = json.loads(path.read_text())
        self.assertEqual(record["kernels"], tuning.kernels_measured())
        self.assertLen(record["kernels"], 64)
        self.assertTrue(tuning.takes_kernel(H200, "gemm_amax", "mxfp4", 8))
        for stale in ({**record, "kernels": "0" * 64}, {k: v for k, v in record.items() if k != "kernels"}):
            path.write_text(json.dumps(stale))
            tuning._load.cache_clear()
            with self.assertLogs("jax_blockgemm.tuning", "WARNING") as logs:
                self.assertIsNone(tuning.takes_kernel(H200, "gemm_amax", "mxfp4", 8))
            self.assertIn("measured on other kernels", "".join(logs.output))

    def test_an_unreadable_table_is_ignored_with_a_warning(self):
        path = tuning.table_path(H200)
        path.parent.mkdir(parents=True)
        path.write_text("{not json")
        tuning._load.cache_clear()
        with self.assertLogs("jax_blockgemm.tuning", "WARNING"):
            self.assertIsNone(tuning.takes_kernel(H200, "gemm_amax", "mxfp4", 8))


    def test_a_decision_of_the_wrong_types_is_dropped_with_a_warning_and_the_others_kept(self):
        good = dict(op="gemm_amax", fmt="mxfp4", choice="kernel", min_size=8, measured=[[8, 1.0, 2.0]], max_m=0)
        bad = [dict(good, fmt="nvfp4", min_size="1000"), dict(good, fmt="nvfp4", min_size=None),
               dict(good, fmt="nvfp4", min_size=True), dict(good, fmt="nvfp4", min_size=1.5),
               dict(good, fmt="nvfp4", min_size=-1), dict(good, fmt="nvfp4", extra=1),
               dict(good, fmt="nvfp4", choice="KERNEL"), dict(good, fmt="nvfp4", measured=[[1, "a", 2.0]]),
               dict(good, fmt=None), dict(good, op="weight_stream", fmt="mxfp8_e4m3", max_m="64"),
               dict(good, op="weight_stream", fmt="mxfp8_e4m3", max_m=None),
               dict(good, op="decode_swap_ab", fmt="mxfp8_e4m3", min_size="17", max_m=64),
               dict(good, op="ragged_swap_ab", fmt="mxfp8_e4m3", min_size=[1]), "a string", None, [1]]
        path = tuning.table_path(H200)
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"gpu": H200, "kernels": tuning.kernels_measured(), "decisions": [good] + bad}))
        tuning._load.cache_clear()
        with self.assertLogs("jax_blockgemm.tuning", "WARNING") as logs:
            self.assertEqual(tuning.load(H200), (tuning.Decision("gemm_amax", "mxfp4", "kernel", 8, ((8, 1.0, 2.0),)),))
        self.assertLen(logs.output, len(bad))
        self.assertIn("ignoring the invalid decision", logs.output[0])
        self.assertIsNone(tuning.takes_kernel(H200, "gemm_amax", "nvfp4", 10**6))  # dropped: arch.TABLE decides
        self.assertIsNone(tuning.decode_max_m(H200, "mxfp8_e4m3"))
        self.assertIsNone(tuning.decode_swap_ab_rows(H200, "mxfp8_e4m3"))
        self.assertIsNone(tuning.takes_swap_ab(H200, "mxfp8_e4m3", 10**6))
        self.assertTrue(tuning.takes_kernel(H200, "gemm_amax", "mxfp4", 8))


def _gemm_text(m: int, fmt: str = "mxfp8_e4m3") -> str:
    rng = np.random.default_rng(0)
    dtype = jnp.float8_e4m3fn if fmt == "mxfp8_e4m3" else jnp.float8_e5m2
    a = jnp.asarray(rng.standard_normal((m, 128)), jnp.float32).astype(dtype)
    b = jnp.asarray(rng.standard_normal((128, 128)), jnp.float32).astype(dtype)
    s = lambda r: jnp.asarray(oracle.random_scale_bytes(rng, (r, 4)))
    f = jax.jit(lambda *x: jbg.gemm_amax(*x))  # a fresh function: no lowering cached from another test
    return f.trace(a, b, s(m), s(128)).lower(lowering_platforms=("cuda",)).as_text()


def _fake_h200(test: absltest.TestCase) -> None:
    """For `test`: a fresh cache directory with tables honoured, lowerings as on an H200 (sm_90a) whose objects are
    stand-in bytes and pass their first-use self-checks (a schedule arch.TABLE lists as unverified)."""
    from jax_blockgemm import kernel_cache

    test.enter_context(mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": test.enter_context(
        tempfile.TemporaryDirectory()), tuning.IGNORE_ENV: ""}))
    test.enter_context(mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)))
    test.enter_context(mock.patch.object(dispatch, "local_gpu_model", return_value=H200))
    test.enter_context(mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: v.key.encode()))
    test.enter_context(mock.patch.object(dispatch, "_failed_self_checks", return_value=""))


class DispatchFollowsTheTableTest(absltest.TestCase):
    """A lowering on a (faked) H200 with a stored decision: None takes the kernel exactly where the table says."""

    def setUp(self):
        _fake_h200(self)
        tuning.store(H200, [tuning.Decision("gemm_amax", "mxfp8_e4m3", tuning.KERNEL, min_size=256 * 128 * 128)])

    def test_none_takes_the_kernel_from_the_threshold_on(self):
        self.assertIn("jbg_gemm_amax", _gemm_text(256))
        self.assertNotIn("jbg_gemm_amax", _gemm_text(128))  # below the measured sizes
        self.assertNotIn("jbg_gemm_amax", _gemm_text(256, "mxfp8_e5m2"))  # no decision: arch.TABLE's reference

    def test_the_environment_variable_and_another_gpu_model_ignore_it(self):
        with mock.patch.dict(os.environ, {tuning.IGNORE_ENV: "1"}):
            self.assertNotIn("jbg_gemm_amax", _gemm_text(256))
        with mock.patch.object(dispatch, "local_gpu_model", return_value="NVIDIA H100 80GB HBM3"):
            self.assertNotIn("jbg_gemm_amax", _gemm_text(256))

    def test_kernels_in_names_the_local_targets_objects(self):
        text = _gemm_text(256)
        self.assertEqual([v.key for v in tune.kernels_in(text, "sm_90a")],
                         ["gemm_amax.sm_90a.e4m3.f32.sf32.t128x128.c1x1"])


def _weight_only_text(m: int, fmt: str = "mxfp8_e4m3") -> str:
    w = jbg.quantize_weight(jnp.ones((64, 128), jnp.float32), fmt)
    x = jnp.ones((m, 128), jnp.bfloat16)
    f = jax.jit(lambda x, w: jbg.weight_only_matmul(x, w))  # a fresh function: no lowering cached from another test
    return f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()


class DispatchFollowsADecodeDecisionTest(absltest.TestCase):
    """A stored decode decision (by M, timed at long K) replaces arch.TABLE's threshold both ways on a (faked) H200;
    below the short-K rule's K that rule still caps it."""

    def setUp(self):
        _fake_h200(self)
        # the decode kernel's rows alone (on the H200 the swap_ab decode tiles take E4M3's decode-sized calls)
        self.enter_context(arch.overridden("9.0", decode_swap_ab_m={}))

    def test_up_to_the_decided_rows_and_not_beyond(self):
        table_rows = arch.decode_largest_m("sm_90a", "mxfp8_e4m3", 128)  # the table alone at K = 128: up to these
        self.assertLess(table_rows, 40)  # decode_short_k: MXFP8 weight rows of 128 codes take few rows
        self.assertIn("jbg_weight_stream", _weight_only_text(table_rows))
        self.assertNotIn("jbg_weight_stream", _weight_only_text(table_rows + 1))
        tuning.store(H200, [tuning.Decision("weight_stream", "mxfp8_e4m3", tuning.KERNEL, max_m=table_rows // 2)])
        self.assertIn("jbg_weight_stream", _weight_only_text(table_rows // 2))  # fewer rows measured: fewer taken
        self.assertNotIn("jbg_weight_stream", _weight_only_text(table_rows // 2 + 1))
        tuning.store(H200, [tuning.Decision("weight_stream", "mxfp8_e4m3", tuning.KERNEL, max_m=40)])
        self.assertIn("jbg_weight_stream", _weight_only_text(table_rows))  # more rows measured at long K: the
        self.assertNotIn("jbg_weight_stream", _weight_only_text(table_rows + 1))  # short-K rule still caps K = 128
        tuning.store(H200, [tuning.Decision("weight_stream", "mxfp8_e4m3", tuning.DEFAULT)])
        self.assertNotIn("jbg_weight_stream", _weight_only_text(1))  # measured slower here: the reference


class TuneCommandTest(absltest.TestCase):

    def setUp(self):
        self.enter_context(mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": self.enter_context(
            tempfile.TemporaryDirectory()), tuning.IGNORE_ENV: ""}))

    def test_without_a_gpu_it_says_so(self):
        with mock.patch.object(dispatch, "local_gpu_model", return_value=None), \
                mock.patch("sys.stdout", new_callable=io.StringIO) as out:
            self.assertEqual(tune.main([]), 2)
        self.assertIn("no CUDA GPU visible", out.getvalue())

    def test_measures_prints_stores_and_resets(self):
        def timer(op, fmt, shape):
            if fmt == "mxfp8_e5m2":
                return None, "no kernel: no CuTeDSL kernel applies"
            return ((1.0, 2.0) if op == "gemm_amax" else (3.0, 2.0)), ""

        with mock.patch.object(dispatch, "local_gpu_model", return_value=H200), \
                mock.patch("sys.stdout", new_callable=io.StringIO) as out:
            self.assertEqual(tune.main(["--format", "mxfp8_e4m3", "--format", "mxfp8_e5m2", "--format", "bf16",
                                        "--shape", "256,256,256", "--shape", "16,256,256"], timer=timer), 0)
            text = out.getvalue()
            self.assertRegex(text, r"gemm_amax\s+mxfp8_e4m3\s+256x256x256\s+1.000\s+2.000\s+2.00x")
            self.assertRegex(text, r"gemm_amax\s+mxfp8_e5m2\s+256x256x256\s+-\s+-\s+-\s+no kernel")
            self.assertIn("gemm_amax mxfp8_e4m3: our kernel from size 1048576", text)  # 16 x 256 x 256 and up
            self.assertRegex(text, r"weight_stream\s+mxfp8_e4m3\s+16x256x256\s+3.000\s+2.000")  # M <= 64 only
            self.assertIn("proj_rope bf16: the default", text)
            self.assertIn("weight_stream mxfp8_e4m3: the default", text)  # the fake kernel loses: (3.0, 2.0)
            self.assertTrue(tuning.takes_kernel(H200, "gemm_amax", "mxfp8_e4m3", 256 ** 3))
            self.assertFalse(tuning.takes_kernel(H200, "proj_rope", "bf16", 10 ** 12))
            self.assertEqual(tune.main(["--reset"]), 0)
        self.assertIsNone(tuning.takes_kernel(H200, "gemm_amax", "mxfp8_e4m3", 256 ** 3))


    def test_a_run_of_some_ops_keeps_the_stored_decisions_of_the_others(self):
        timer = lambda op, fmt, shape: ((1.0, 2.0), "")  # our kernel twice as fast everywhere
        with mock.patch.object(dispatch, "local_gpu_model", return_value=H200), \
                mock.patch("sys.stdout", new_callable=io.StringIO) as out:
            self.assertEqual(tune.main(["--op", "gemm_amax", "--format", "mxfp4", "--format", "nvfp4"], timer=timer), 0)
            self.assertEqual(tune.main(["--op", "proj_rope", "--format", "bf16"], timer=timer), 0)
            self.assertIn("gemm_amax mxfp4: our kernel from size", out.getvalue().split("stored in")[1])
            timer = lambda op, fmt, shape: ((2.0, 1.0), "")  # now slower: gemm_amax mxfp4 timed again
            self.assertEqual(tune.main(["--op", "gemm_amax", "--format", "mxfp4"], timer=timer), 0)
        decisions = {(d.op, d.fmt): d.choice for d in tuning.load(H200)}
        self.assertEqual(decisions, {("gemm_amax", "mxfp4"): tuning.DEFAULT, ("gemm_amax", "nvfp4"): tuning.KERNEL,
                                     ("proj_rope", "bf16"): tuning.KERNEL})

    def test_an_unwritable_table_directory_stops_it_before_measuring(self):
        blocker = pathlib.Path(os.environ["JAX_BLOCKGEMM_CACHE_DIR"]) / "file"
        blocker.write_bytes(b"x")  # the tables' directory would lie under a regular file
        timer = mock.Mock(return_value=((1.0, 2.0), ""))
        with mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": str(blocker)}), \
                mock.patch.object(dispatch, "local_gpu_model", return_value=H200), \
                mock.patch("sys.stdout"), mock.patch("sys.stderr", new_callable=io.StringIO) as err:
            self.assertEqual(tune.main(["--op", "gemm_amax", "--format", "mxfp4"], timer=timer), 1)
        timer.assert_not_called()
        self.assertIn("cannot store decisions", err.getvalue())

    def test_bad_shapes_and_sample_counts_are_usage_errors(self):
        """--shape takes the benchmark's M,N,K rule and --reps a positive count, refused before anything runs."""
        for argv in (["--shape", "16,7168"], ["--shape", "0,7168,7168"], ["--shape", "16,7168,7000"],
                     ["--reps", "0"], ["--reps", "x"]):
            with mock.patch("sys.stderr"), self.assertRaises(SystemExit) as stop:
                tune.main(argv)
            self.assertEqual(stop.exception.code, 2, argv)

    def test_reset_deletes_the_local_gpu_models_table_only_and_nothing_without_a_gpu(self):
        for model in (H200, "NVIDIA B200"):
            tuning.store(model, [tuning.Decision("gemm_amax", "mxfp4", tuning.KERNEL)])
        with mock.patch.object(dispatch, "local_gpu_model", return_value=None), \
                mock.patch("sys.stdout", new_callable=io.StringIO) as out:
            self.assertEqual(tune.main(["--reset"]), 2)
        self.assertIn("no GPU model's table to reset", out.getvalue())
        self.assertTrue(tuning.table_path(H200).is_file() and tuning.table_path("NVIDIA B200").is_file())
        with mock.patch.object(dispatch, "local_gpu_model", return_value=H200), \
                mock.patch("sys.stdout", new_callable=io.StringIO):
            self.assertEqual(tune.main(["--reset"]), 0)
        self.assertFalse(tuning.table_path(H200).exists())
        self.assertTrue(tuning.table_path("NVIDIA B200").is_file())
        self.assertIn("delete this GPU model's stored decisions", tune._parser().format_help())


class ProgramsTest(absltest.TestCase):

    def test_every_timed_program_traces_with_our_kernel_and_its_baseline(self):
        """What tune times must be a valid call of the op in its format (the benchmark's operands of that format; the
        MXFP8 proj_rope call with its scales), for the kernel and for the baseline, with the same outputs: checked at
        small shapes by tracing."""
        codes = {"mxfp8_e4m3": jnp.float8_e4m3fn, "mxfp8_e5m2": jnp.float8_e5m2, "mxfp4": np.uint8, "nvfp4": np.uint8}
        self.assertEqual(set(tune.GEMM_FORMATS), set(codes))
        cases = [("gemm_amax", f, (64, 128, 256)) for f in tune.GEMM_FORMATS]
        cases += [("proj_rope", f, (128, 256, 2)) for f in tune.PROJ_ROPE_FORMATS]
        cases += [(tuning.DECODE_OP, f, (4, 128, 256)) for f in ("mxfp8_e4m3", "mxfp4", "nvfp4")]
        cases += [("ragged", f, (256, 4, 64, 128)) for f in tune.GEMM_FORMATS]
        for op, fmt, shape in cases:
            with self.subTest(op=op, fmt=fmt), mock.patch.object(tune, "DECODE_MATRICES", 2):
                call, arg_sets, baseline = tune.programs(op, fmt, shape)
                self.assertNotEmpty(arg_sets)
                outs = [jax.tree.map(lambda x: (x.shape, x.dtype), jax.eval_shape(call(impl), *arg_sets[0]))
                        for impl in ("cutedsl", baseline)]
                self.assertEqual(outs[0], outs[1])
                if op == "proj_rope" and fmt == "mxfp8":  # codes in, so the MXFP8 path with its scales
                    self.assertEqual(np.dtype(arg_sets[0][0].dtype), np.dtype(jnp.float8_e4m3fn))
                    self.assertLen(arg_sets[0], 6)
                if op == "ragged":  # T tokens of K codes, G weights (N, K), C (T, N)
                    self.assertEqual(np.dtype(arg_sets[0][0].dtype), np.dtype(codes[fmt]), fmt)
                    self.assertEqual(arg_sets[0][1].shape[:2], (4, 64), fmt)
                    self.assertEqual(outs[0][0], ((256, 64), np.dtype(jnp.bfloat16)), fmt)
                if op == "gemm_amax":  # the benchmark's operands of the format: codes (FP4 packed), scale bytes
                    a, b, sfa = arg_sets[0][:3]
                    self.assertEqual(np.dtype(a.dtype), np.dtype(codes[fmt]), fmt)
                    self.assertEqual(b.shape, (shape[1], shape[2] // (2 if codes[fmt] is np.uint8 else 1)), fmt)
                    scale = jnp.float8_e4m3fn if fmt == "nvfp4" else np.uint8  # NVFP4's E4M3, else E8M0 bytes
                    self.assertEqual(np.dtype(sfa.dtype), np.dtype(scale), fmt)


class DecodeProblemsTest(absltest.TestCase):

    def test_the_decode_timing_runs_the_decode_kernel_at_every_m(self):
        """On an H200, MXFP8 E4M3 calls of decode_swap_ab_m's rows take the swap_ab decode tile; while tune times the
        decode op, "cutedsl" runs the weight_stream kernel there (the kernel its decision governs)."""
        try:
            from jax_blockgemm.kernels import catalog  # noqa: F401
        except ImportError as e:
            self.skipTest(f"CuTeDSL is not importable: {e}")
        from jax_blockgemm import kernel_cache

        m = arch.policy("sm_90a").decode_swap_ab_small[0] + 1  # past the rows that small weights keep off the tile
        self.assertTrue(arch.decode_takes_swap_ab("sm_90a", "mxfp8_e4m3", m, n=128, k=256))
        with mock.patch.object(dispatch, "_failed_self_checks", return_value=""), \
                mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)), \
                mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: v.key.encode()), \
                mock.patch.object(tune, "DECODE_MATRICES", 1):
            call, arg_sets, _ = tune.programs(tuning.DECODE_OP, "mxfp8_e4m3", (m, 128, 256))
            lower = lambda: jax.jit(call("cutedsl")).trace(*arg_sets[0]).lower(lowering_platforms=("cuda",)).as_text()
            self.assertIn("jbg_ragged_gemm_amax", lower())
            with tune._the_decode_kernel_alone(tuning.DECODE_OP):
                text = lower()
            self.assertIn("jbg_weight_stream", text)
            self.assertNotIn("jbg_ragged_gemm_amax", text)
            with tune._the_decode_kernel_alone("gemm_amax"):
                self.assertIn("jbg_ragged_gemm_amax", lower())

    def test_decode_rows_are_timed_per_weight_format_and_only_shapes_of_few_rows(self):
        todo = tune.problems(("weight_stream",), ("mxfp4", "bf16"), [])
        self.assertEqual(todo, [("weight_stream", "mxfp4", s) for s in tune.DECODE_SHAPES])
        todo = tune.problems(("weight_stream",), ("nvfp4",), [(8, 256, 512), (4096, 256, 512)])
        self.assertEqual(todo, [("weight_stream", "nvfp4", (8, 256, 512))])
        self.assertEqual(tune.problem_size("weight_stream", (8, 256, 512)), 8)


class RaggedTuningTest(absltest.TestCase):

    def test_ragged_shapes_per_format_and_the_size_dispatch_compares(self):
        """Every ragged shape per MX format, and the problem size of each the very one dispatch computes for that
        call (T*N*K*L*G): a stored decision then turns the kernel on for None on a (faked) B200 from that size on,
        after its self-check, and not below."""
        from jax_blockgemm import gate

        self.assertEqual(tune.problems(("ragged",), ("nvfp4", "bf16"), [(8, 256, 512)]),
                         [("ragged", "nvfp4", s) for s in tune.RAGGED_SHAPES])
        t, g, n, k = 256, 4, 64, 128
        self.enterContext(mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": self.enterContext(
            tempfile.TemporaryDirectory()), tuning.IGNORE_ENV: ""}))
        tuning.store("NVIDIA B200", [tuning.Decision("ragged", "mxfp8_e4m3", tuning.KERNEL,
                                                     min_size=tune.problem_size("ragged", (t, g, n, k)))])
        sa = jax.core.ShapedArray

        def choice(tokens):
            avals = [sa((1, tokens, k), jnp.float8_e4m3fn), sa((1, g, n, k), jnp.float8_e4m3fn),
                     sa((1, tokens, k // 32), np.uint8), sa((1, g, n, k // 32), np.uint8), sa((1, g), jnp.int32),
                     sa((1, g), jnp.int32)]
            return dispatch.ragged_kernels(avals, c_dtype=np.dtype(jnp.bfloat16), sf_vec_size=32, k=k,
                                           implementation=None)

        ok = lambda v, device=None: gate.Verdict(v.key, "NVIDIA B200", "x", True, "ok")
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("10.0",)), \
                mock.patch.object(dispatch, "local_gpu_model", return_value="NVIDIA B200"), \
                mock.patch.object(gate, "ensure_verified", side_effect=ok) as checked:
            self.assertIn("ragged.sm_100a.e4m3.bf16.sf32.t128x128.c1x1", [v.key for v in choice(t).variants])
            self.assertEqual([c.args[0].key for c in checked.call_args_list],
                             ["ragged.sm_100a.e4m3.bf16.sf32.t128x128.c1x1"])
            self.assertEqual(choice(t // 2).variants, ())  # below the measured size: arch.TABLE's reference

    def test_a_default_decision_keeps_the_kernel_that_arch_table_takes(self):
        """tune times the ragged kernel against None's default, which on an H200 is that kernel: a DEFAULT decision
        (no margin over itself) must leave it on, where a DEFAULT for the decode kernel (timed against the
        reference) turns that one off."""
        self.enterContext(mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": self.enterContext(
            tempfile.TemporaryDirectory()), tuning.IGNORE_ENV: ""}))
        tuning.store(H200, [tuning.Decision("ragged", "mxfp8_e4m3", tuning.DEFAULT),
                            tuning.Decision("proj_rope", "bf16", tuning.DEFAULT),
                            tuning.Decision(tuning.DECODE_OP, "mxfp4", tuning.DEFAULT)])
        self.assertIsNone(tuning.takes_kernel(H200, "ragged", "mxfp8_e4m3", 2**30))
        self.assertIsNone(tuning.takes_kernel(H200, "proj_rope", "bf16", 2**30))
        self.assertEqual(tuning.decode_max_m(H200, "mxfp4"), 0)  # the reference won: never the decode kernel


def _ragged_choice(fmt: str, tokens: int = 256, values: bool = False) -> tuple[str, ...]:
    """The schedules of dispatch.ragged_kernels' variants under None for a ragged call against `fmt` weights (codes
    of the tokens too, or bf16 tokens as values: the weight-only ragged matmul)."""
    t, g, n, k = tokens, 4, 64, 256
    block = 16 if fmt == "nvfp4" else 32
    code = jnp.float8_e4m3fn if fmt == "mxfp8_e4m3" else jnp.uint8
    row = k if fmt == "mxfp8_e4m3" else k // 2
    scale = jnp.float8_e4m3fn if fmt == "nvfp4" else np.uint8
    sa = jax.core.ShapedArray
    a = sa((1, t, k), jnp.bfloat16) if values else sa((1, t, row), code)
    sfa = sa((1, t, 0), np.uint8) if values else sa((1, t, k // block), scale)
    avals = [a, sa((1, g, n, row), code), sfa, sa((1, g, n, k // block), scale), sa((1, g), jnp.int32),
             sa((1, g), jnp.int32)]
    choice = dispatch.ragged_kernels(avals, c_dtype=np.dtype(jnp.bfloat16), sf_vec_size=block, k=k,
                                     implementation=None)
    return tuple(v.schedule for v in choice.variants)


class SwapAbChoiceTest(absltest.TestCase):
    """The choices between two kernels of ours that arch.TABLE makes from H200 measurements: tune times both on the
    local GPU and its decision replaces the table's entry, either way, for that GPU model."""

    def test_decode_tile_from_the_smallest_m_from_which_it_always_wins(self):
        d = tuning.decide_swap_ab_decode("mxfp4", [(17, 2.0, 1.5), (32, 1.0, 1.5), (64, 1.0, 3.0)])
        self.assertEqual((d.op, d.choice, d.min_size, d.max_m), ("decode_swap_ab", tuning.KERNEL, 32, 64))
        d = tuning.decide_swap_ab_decode("mxfp4", [(17, 1.0, 1.5), (64, 1.0, 3.0)])
        self.assertEqual((d.min_size, d.max_m), (17, 64))
        d = tuning.decide_swap_ab_decode("nvfp4", [(17, 1.0, 1.5), (64, 3.0, 1.0)])  # loses at the most rows
        self.assertEqual((d.choice, d.max_m), (tuning.DEFAULT, 0))

    def test_problems_and_sizes(self):
        self.assertEqual(tune.problems(("decode_swap_ab",), ("mxfp4", "mxfp8_e5m2"), ()),
                         [("decode_swap_ab", "mxfp4", s) for s in tune.DECODE_SWAP_AB_SHAPES])  # E5M2: no swap_ab
        self.assertEqual(tune.problems(("decode_swap_ab",), ("nvfp4",), [(16, 64, 64), (40, 64, 64), (65, 8, 8)]),
                         [("decode_swap_ab", "nvfp4", (16, 64, 64)), ("decode_swap_ab", "nvfp4", (40, 64, 64))])
        self.assertEqual(tune.problems(("ragged_swap_ab",), ("mxfp8_e4m3", "bf16"), ()),
                         [("ragged_swap_ab", "mxfp8_e4m3", s) for s in tune.RAGGED_SHAPES])
        self.assertEqual(tune.problem_size("decode_swap_ab", (40, 64, 64)), 40)
        self.assertEqual(tune.problem_size("ragged_swap_ab", (256, 4, 64, 128)), 256 * 4 * 64 * 128)

    def test_ragged_decisions_replace_the_table_either_way(self):
        """On a (faked) H200 whose table gives MXFP8 codes swap_ab and keeps FP4 codes on the block-scaled kernel
        (and bf16 tokens against FP4 experts on the reference); stored decisions turn MXFP4 on from a size and MXFP8
        off, NVFP4's DEFAULT keeps it block-scaled yet lets bf16 tokens take swap_ab (timed here either way)."""
        _fake_h200(self)
        self.enterContext(arch.overridden("9.0", ragged_swap_ab_formats=("mxfp8_e4m3",),
                                          decode_swap_ab_m={"mxfp8_e4m3": (17, 64)}))  # the table as these read it
        self.assertEqual(_ragged_choice("mxfp8_e4m3"), ("swap_ab",))
        self.assertEqual(_ragged_choice("mxfp4"), ("",))
        self.assertEqual(_ragged_choice("nvfp4", values=True), ())  # the reference
        size = tune.problem_size("ragged_swap_ab", (256, 4, 64, 256))
        tuning.store(H200, [tuning.Decision("ragged_swap_ab", "mxfp4", tuning.KERNEL, min_size=size),
                            tuning.Decision("ragged_swap_ab", "mxfp8_e4m3", tuning.DEFAULT),
                            tuning.Decision("ragged_swap_ab", "nvfp4", tuning.DEFAULT)])
        self.assertEqual(_ragged_choice("mxfp4"), ("swap_ab",))
        self.assertEqual(_ragged_choice("mxfp4", tokens=128), ("",))  # below the measured size
        self.assertEqual(_ragged_choice("mxfp8_e4m3"), ("",))  # the block-scaled kernel won here
        self.assertEqual(_ragged_choice("nvfp4"), ("",))
        self.assertEqual(_ragged_choice("nvfp4", values=True), ("swap_ab",))
        with mock.patch.dict(os.environ, {tuning.IGNORE_ENV: "1"}):
            self.assertEqual(_ragged_choice("mxfp4"), ("",))

    def test_decode_decisions_replace_the_table_either_way(self):
        """A table that gives MXFP8 E4M3 rows 17-64 to the swap_ab decode tile and FP4 none; a stored decision gives
        NVFP4 rows 32-64 and takes MXFP8's away (the decode kernel won)."""
        _fake_h200(self)
        self.enterContext(arch.overridden("9.0", ragged_swap_ab_formats=("mxfp8_e4m3",),
                                          decode_swap_ab_m={"mxfp8_e4m3": (17, 64)}))  # the table as these read it
        tile = lambda m, fmt: "jbg_ragged_gemm_amax" in _weight_only_text(m, fmt)
        self.assertTrue(tile(40, "mxfp8_e4m3"))
        self.assertFalse(tile(40, "nvfp4"))
        tuning.store(H200, [tuning.Decision("decode_swap_ab", "nvfp4", tuning.KERNEL, min_size=32, max_m=64),
                            tuning.Decision("decode_swap_ab", "mxfp8_e4m3", tuning.DEFAULT)])
        self.assertTrue(tile(40, "nvfp4"))
        self.assertFalse(tile(20, "nvfp4"))  # below the decided rows: the decode kernel
        self.assertFalse(tile(40, "mxfp8_e4m3"))  # (at this K the decode kernel's short-K rule leaves it to the
        self.assertIn("jbg_weight_stream", _weight_only_text(16, "mxfp8_e4m3"))  # reference; 16 rows it takes)

    def test_the_timing_forces_each_kernel_through_the_table(self):
        """_swap_ab_table sets the format's entry to the swap_ab kernel or not (the other formats' entries kept) on
        every local GPU, with the tuning tables ignored."""
        _fake_h200(self)
        self.enterContext(arch.overridden("9.0", ragged_swap_ab_formats=("mxfp8_e4m3",),
                                          decode_swap_ab_m={"mxfp8_e4m3": (17, 64)}))  # the table as these read it
        for swap_ab, want in ((True, ("mxfp8_e4m3", "mxfp4")), (False, ("mxfp8_e4m3",))):
            with tune._swap_ab_table("ragged_swap_ab", "mxfp4", swap_ab):
                self.assertEqual(arch.policy("sm_90a").ragged_swap_ab_formats, want)
                self.assertEqual(os.environ[tuning.IGNORE_ENV], "1")
        with tune._swap_ab_table("ragged_swap_ab", "mxfp8_e4m3", False):
            self.assertEqual(arch.policy("sm_90a").ragged_swap_ab_formats, ())
        with tune._swap_ab_table("decode_swap_ab", "nvfp4", True):
            self.assertEqual(arch.policy("sm_90a").decode_swap_ab_m["nvfp4"], (1, 64))
            self.assertIn("mxfp8_e4m3", arch.policy("sm_90a").decode_swap_ab_m)
        with tune._swap_ab_table("decode_swap_ab", "nvfp4", False):
            self.assertEqual(arch.policy("sm_90a").decode_swap_ab_m, {})
        self.assertEqual(arch.policy("sm_90a").ragged_swap_ab_formats, ("mxfp8_e4m3",))  # restored

    def test_each_timed_program_runs_the_kernel_it_forces(self):
        """_measure_choice on a (faked) H200, lowered for CUDA (the compile and the timing stood in for): the swap_ab
        program carries only swap_ab objects (the decode tile; MXFP8's token dequantization too) and the other only
        the decode kernel or the block-scaled one, each object self-checked once; E5M2, which swap_ab does not
        convert, is no choice."""
        from jax_blockgemm import gate
        from jax_blockgemm.bench import timing

        _fake_h200(self)
        lowered = []

        class Lowered:  # the lowering for CUDA, its compile stood in for
            def __init__(self, fn, args):
                self.text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
                lowered.append(self.text)

            def as_text(self):
                return self.text

            def compile(self):
                return lambda *args: None

        checked = []
        verdict = lambda v: (checked.append(v.key), gate.Verdict(v.key, H200, "x", True, "ok"))[1]
        self.enter_context(mock.patch.object(gate, "check", side_effect=verdict))
        self.enter_context(mock.patch.object(timing, "interleaved_medians_ms", return_value=[1.0, 2.0]))
        cases = [("decode_swap_ab", "mxfp4", (17, 256, 512), ["e2m1.bf16.sf32.t32x64.c1x1.swap_ab.k3"],
                  ["weight_stream.sm_90a.e2m1.bf16"]),
                 ("decode_swap_ab", "nvfp4", (16, 256, 512), ["e2m1.bf16.sf16e4m3.t16x64.c1x1.swap_ab.k3"],
                  ["weight_stream.sm_90a.e2m1.bf16.sf16e4m3"]),
                 ("ragged_swap_ab", "mxfp8_e4m3", (512, 4, 128, 512),
                  ["dequantize.sm_90a.e4m3.bf16.sf32.t1x16.c1x1.swap_ab", "e4m3.bf16.sf32.t128x128.c1x1.swap_ab"],
                  ["ragged.sm_90a.e4m3.bf16.sf32.t128x128.c1x1"])]
        for op, fmt, shape, swapped, other in cases:
            checked.clear()
            lowered.clear()
            times, why = tune._measure_choice(op, fmt, shape, reps=1, lower=Lowered)
            per_call = tune.DECODE_MATRICES if op == "decode_swap_ab" else 1
            self.assertEqual((times, why), ((1.0 / per_call, 2.0 / per_call), ""), op)
            self.assertLen(checked, len(set(checked)))  # each object once
            self.assertEqual(len(checked), len(swapped) + len(other))
            for key, want in zip(checked, swapped + other):
                self.assertIn(want, key)
            self.assertNotIn("swap_ab", lowered[1])
        self.assertEqual(tune._measure_choice("decode_swap_ab", "mxfp8_e5m2", (32, 256, 512), reps=1, lower=Lowered),
                         (None, "the swap_ab kernel does not serve this call here"))
        failing = lambda v: gate.Verdict(v.key, H200, "x", "swap_ab" not in v.key, "hung: killed after 120 s")
        with mock.patch.object(gate, "check", side_effect=failing):  # a swap_ab object that fails: no timing
            self.assertEqual(tune._measure_choice("decode_swap_ab", "mxfp4", (17, 256, 512), reps=1, lower=Lowered),
                             (None, "self-check failed: hung: killed after 120 s"))

    def test_the_command_prints_and_stores_the_choices(self):
        _fake_h200(self)

        def timer(op, fmt, shape):  # swap_ab faster for MXFP4 everywhere, slower for NVFP4
            return ((1.0, 2.0) if fmt == "mxfp4" else (2.0, 1.0)), ""

        with mock.patch("sys.stdout", new_callable=io.StringIO) as out:
            self.assertEqual(tune.main(["--op", "ragged_swap_ab", "--op", "decode_swap_ab", "--format", "mxfp4",
                                        "--format", "nvfp4"], timer=timer), 0)
        text = out.getvalue()
        self.assertRegex(text, r"decode_swap_ab\s+mxfp4\s+17x7168x7168\s+1.000\s+2.000\s+2.00x\s+ours: swap_ab")
        self.assertIn("ragged_swap_ab mxfp4: the swap_ab kernel from size", text)
        self.assertIn("ragged_swap_ab nvfp4: the block-scaled kernel", text)
        self.assertIn("decode_swap_ab mxfp4: the swap_ab decode tile at M = 1-64", text)
        self.assertIn("decode_swap_ab nvfp4: the decode kernel", text)
        self.assertEqual(tuning.decode_swap_ab_rows(H200, "mxfp4"), (1, 64))
        self.assertEqual(tuning.decode_swap_ab_rows(H200, "nvfp4"), (1, 0))
        self.assertIsNone(tuning.decode_swap_ab_rows(H200, "mxfp8_e4m3"))  # not timed: arch.TABLE decides
        self.assertFalse(tuning.takes_swap_ab(H200, "nvfp4", 2**40))


if __name__ == "__main__":
    absltest.main()
