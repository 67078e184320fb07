"""The decoding example (jax_blockgemm/examples/decode.py): `--small` runs end to end on the CPU and prints its table;
a quantized model decodes exactly the tokens of the bf16 model holding its dequantized weights; the full 16-layer,
d = 4096 stack traces, with the weight bytes each format should have.
"""

import contextlib
import io
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest

from jax_blockgemm import arch
from jax_blockgemm.examples import decode


class DecodeExampleTest(absltest.TestCase):

    @pytest.mark.end_to_end
    def test_small_runs_and_prints_a_row_per_format_and_batch(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rows = decode.main(["--small", "--repeats", "1", "--batch", "1,3"])
        text = out.getvalue()
        self.assertEqual([(r["format"], r["batch"]) for r in rows],
                         [(f, b) for f in ("bf16", "mxfp8_e4m3", "mxfp4") for b in (1, 3)])
        cfg = decode.SMALL
        for row in rows:
            tokens = np.asarray(row["tokens"])
            self.assertEqual(tokens.shape, (row["batch"], cfg.prompt + cfg.new_tokens))
            self.assertTrue(((tokens >= 0) & (tokens < cfg.vocab)).all())
            self.assertGreater(row["tokens_per_s"], 0)
            self.assertRegex(text, rf"\n{row['format']} +{row['batch']} +[0-9.]+ +[0-9.]+ ")
        for row in rows:  # bf16 fed its own greedy tokens predicts each of them again: exactly 1
            agreement = row["next_token_agreement"]
            self.assertTrue(agreement == 1.0 if row["format"] == "bf16" else 0.0 <= agreement <= 1.0, row)
            self.assertRegex(text, rf"\n{row['format']} +{row['batch']} .* {100 * agreement:.1f}%\n")
        bf16, mxfp8, mxfp4 = (rows[i]["weight_bytes"] for i in (0, 2, 4))
        self.assertEqual(mxfp8, bf16 // 2 + bf16 // 64)  # one byte per weight plus one scale byte per 32
        self.assertEqual(mxfp4, bf16 // 4 + bf16 // 64)
        self.assertEqual(text.rstrip("\n").splitlines()[-1],
                         decode.matmul_path(jax.devices()[0], ("bf16", "mxfp8_e4m3", "mxfp4")))

    @pytest.mark.end_to_end
    def test_sizes_must_be_counts(self):
        """--layers 0 is refused, not replaced by the default; --repeats 0 too (it ended in a StatisticsError)."""
        for flag in ("--layers", "--new-tokens", "--repeats"):
            with contextlib.redirect_stderr(io.StringIO()) as err, self.assertRaises(SystemExit):
                decode.main(["--small", flag, "0"])
            self.assertIn(f"argument {flag}: expected an integer >= 1; got '0'", err.getvalue())

    def test_scan_and_unrolled_layers_decode_the_same_tokens(self):
        """--scan runs the stacked layers by lax.scan, the default unrolls them: the same greedy tokens either way."""
        runs = {}
        for flags in ((), ("--scan",)):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                runs[flags] = decode.main(["--small", "--repeats", "1", "--batch", "2", "--formats", "bf16,mxfp8_e4m3",
                                           *flags])
            self.assertIn("layers by lax.scan;" if flags else "layers unrolled;", out.getvalue())
        for unrolled, scanned in zip(runs[()], runs[("--scan",)]):
            np.testing.assert_array_equal(np.asarray(unrolled["tokens"]), np.asarray(scanned["tokens"]))

    def test_the_last_line_names_the_decode_kernel_and_the_arch_tables_thresholds(self):
        h200 = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200")
        formats_ = ("bf16", "mxfp8_e4m3", "mxfp4", "nvfp4")
        shipped = arch.policy("sm_90a").decode_max_m.get("mxfp4", 0)  # the table as it stands
        self.assertIn(f"a decode kernel for M <= {shipped}" if shipped else "at every batch",
                      decode.matmul_path(h200, ("mxfp4",)))
        self.assertIn("mxfp8_e4m3 at M = ", decode.matmul_path(h200, ("mxfp8_e4m3",)))  # the swap_ab tile's range
        self.enterContext(arch.overridden("9.0", decode_swap_ab_m={}))  # below: the decode kernel's rules alone
        with arch.overridden("9.0", decode_max_m={"mxfp8_e4m3": 16, "mxfp4": 48, "nvfp4": 48}, decode_short_k={}):
            self.assertIn("on sm_90a, implementation=None", decode.matmul_path(h200, formats_))
            self.assertIn("a decode kernel for mxfp8_e4m3: M <= 16, mxfp4: M <= 48, nvfp4: M <= 48 "
                          "(M: the batch); the reference", decode.matmul_path(h200, formats_))
        with arch.overridden("9.0", decode_max_m={"mxfp4": 8}):
            note = decode.matmul_path(h200, formats_)
            self.assertIn("kernel for mxfp8_e4m3: never, mxfp4: M <= 8, nvfp4: never (M: the batch); the reference",
                          note)
            self.assertRegex(decode.matmul_path(h200, ("mxfp8_e4m3",)), r"the reference .* at every batch\.$")
        b200 = types.SimpleNamespace(platform="gpu", compute_capability="10.0", device_kind="NVIDIA B200")
        with arch.overridden("10.0", decode_max_m={}):
            self.assertNotIn("weight_stream", decode.matmul_path(b200, formats_))
        cpu = types.SimpleNamespace(platform="cpu", device_kind="cpu")
        self.assertIn("no kernel of ours runs here", decode.matmul_path(cpu, formats_))
        self.assertEqual(decode.matmul_path(h200, ("bf16",)), "")

    @pytest.mark.end_to_end
    def test_quantized_weights_decode_like_their_bf16_values(self):
        """MXFP8 and MXFP4 weights are exact in bf16, and the reference multiplies as the bf16 dot does: the
        weight-only model and the bf16 model of its dequantized weights choose the same tokens."""
        cfg = decode.SMALL
        params = decode.init_params(jax.random.key(1), cfg)
        prompt = jax.random.randint(jax.random.key(2), (2, cfg.prompt), 0, cfg.vocab)
        for fmt in ("mxfp8_e4m3", "mxfp4"):
            quantized = decode.quantize_params(params, fmt)
            got = decode.generate(quantized, prompt, cfg=cfg)
            want = decode.generate(decode.dequantize_params(quantized), prompt, cfg=cfg)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            np.testing.assert_array_equal(np.asarray(got[:, :cfg.prompt]), np.asarray(prompt))

    def test_unstacked_layers_give_the_scans_logits_and_cache_and_weigh_the_same(self):
        """The layers as separate buffers in an unrolled loop compute what the scan over stacked layers computes: the
        same logits and cache over two steps (to bf16 rounding: XLA may fuse the two programs differently)."""
        cfg = decode.SMALL
        params = decode.init_params(jax.random.key(5), cfg)
        tokens = jax.random.randint(jax.random.key(6), (2, 2), 0, cfg.vocab)
        step = jax.jit(decode._decode_step, static_argnames=("cfg",))
        for fmt in ("mxfp4",):  # QuantizedWeight leaves sliced per layer (bf16 arrays are sliced the same way)
            stacked = decode.quantize_params(params, fmt)
            unstacked = decode.unstack_layers(stacked)
            self.assertLen(unstacked["layers"], cfg.layers)
            self.assertEqual(decode.weight_bytes(unstacked), decode.weight_bytes(stacked))
            caches = [jnp.zeros((cfg.layers, 2, 2, 2, cfg.heads, cfg.head_dim), jnp.bfloat16)] * 2
            for t in range(2):
                (a, caches[0]), (b, caches[1]) = (step(p, c, tokens[:, t], jnp.int32(t), cfg=cfg)
                                                  for p, c in zip((stacked, unstacked), caches))
                np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2,
                                           atol=2e-2 * float(np.abs(np.asarray(a, np.float32)).max()))
            np.testing.assert_allclose(np.asarray(caches[0], np.float32), np.asarray(caches[1], np.float32),
                                       rtol=2e-2, atol=2e-2)

    def test_teacher_forcing_reproduces_greedy_decoding_and_counts_disagreements(self):
        """Fed its own greedy output, a model predicts every generated token again; with each row's last token changed
        (a target of the last step, never an input), exactly one prediction per row disagrees."""
        cfg = decode.SMALL
        params = decode.init_params(jax.random.key(3), cfg)
        prompt = jax.random.randint(jax.random.key(4), (3, cfg.prompt), 0, cfg.vocab)
        tokens = np.asarray(decode.generate(params, prompt, cfg=cfg))
        self.assertEqual(decode.next_token_agreement(params, tokens, cfg), 1.0)
        changed = tokens.copy()
        changed[:, -1] = (changed[:, -1] + 1) % cfg.vocab
        self.assertAlmostEqual(decode.next_token_agreement(params, changed, cfg), 1 - 1 / cfg.new_tokens)

    def test_the_full_stack_traces(self):
        """16 layers, d = 4096, batch 16, MXFP4 weights: shapes only (nothing is allocated)."""
        cfg = decode.FULL
        params = jax.eval_shape(lambda: decode.quantize_params(decode.init_params(jax.random.key(0), cfg), "mxfp4"))
        self.assertEqual(params["layers"]["w_gate_up"].codes.shape, (16, 2 * cfg.ffn, cfg.d_model // 2))
        prompt = jax.ShapeDtypeStruct((16, cfg.prompt), jnp.int32)
        tokens = jax.eval_shape(lambda p, t: decode.generate(p, t, cfg=cfg), params, prompt)
        self.assertEqual(tokens.shape, (16, cfg.prompt + cfg.new_tokens))
        weights = 16 * (3 + 1) * cfg.d_model ** 2 + 16 * 3 * cfg.d_model * cfg.ffn + cfg.vocab * cfg.d_model
        self.assertEqual(decode.weight_bytes(params), weights // 2 + weights // 32)


if __name__ == "__main__":
    absltest.main()
