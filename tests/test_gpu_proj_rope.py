"""GPU: the CuTeDSL gemm_proj_rope_mxfp8 kernel through the FFI bridge, against the float64 oracle.

Skipped on machines without a CUDA device that has a kernel (CI has none); run on the H200 as described in
BUILD.md. The handler poisons every output before each launch (JAX_BLOCKGEMM_POISON_OUTPUTS=1, set below: codes
0xFF = E4M3 NaN, scale bytes 0xFE), so an element the kernel leaves unwritten fails the oracle checks.
"""

import os

os.environ["JAX_BLOCKGEMM_POISON_OUTPUTS"] = "1"

import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from unittest import mock

import jax_blockgemm as jbg
from jax_blockgemm import dispatch

import oracle_ops

# (T, H, K): T = 32 (one column block), odd head counts, K tails of the 64-wide k-tile, more k-tiles than pipeline
# stages, T not a multiple of the 128-token tile. DeepSeek-V3's shape has its own test (oracle on a few heads).
SHAPES = [(32, 1, 64), (96, 3, 136), (160, 2, 520), (256, 5, 1536), (992, 7, 1024)]


def _has_kernel_gpu() -> bool:
    caps = dispatch.local_cuda_capabilities()
    # sm_90a (run and verified on an H200) and sm_100a (never run here: on a B200 these tests are its first run,
    # after the first-use self-check that implementation="cutedsl" triggers).
    return bool(caps) and all(cc in ("9.0", "10.0") for cc in caps)


def _inputs(seed, t, h, k, *, w_out_in, tables, mxfp8=False):
    rng = np.random.default_rng(seed)
    inp = oracle_ops.random_proj_rope_inputs(rng, t=t, h=h, k=k, mxfp8=mxfp8, w_out_in=w_out_in)
    if tables == "rotary":
        inp["cos"], inp["sin"] = oracle_ops.rotary_tables(t)
    return inp


def _run(inp, *, w_out_in, implementation="cutedsl"):
    scales = {n: jnp.asarray(inp[n]) for n in ("x_scale", "w_scale") if inp.get(n) is not None}
    f = jax.jit(lambda x, w, c, s, sc: jbg.gemm_proj_rope_mxfp8(x, w, c, s, w_out_in=w_out_in, **sc,
                                                                implementation=implementation))
    return [np.asarray(o) for o in f(*(jnp.asarray(inp[n]) for n in ("x", "w", "cos", "sin")), scales)]


@absltest.skipUnless(_has_kernel_gpu(), "needs a CUDA GPU with a CuTeDSL proj_rope kernel (sm_90a, sm_100a)")
class GpuProjRopeTest(parameterized.TestCase):
    """The kernel dispatch takes on the local GPU: on sm_90a the persistent kernel whose fourth warpgroup quantizes
    each fp32 tile from shared memory (kernels/sm90/proj_rope.py), on sm_100a the tensor-memory kernel."""

    @parameterized.product(shape=SHAPES, w_out_in=(True, False), tables=("random", "rotary"))
    def test_matches_oracle(self, shape, w_out_in, tables):
        t, h, k = shape
        inp = _inputs(np.random.SeedSequence().entropy, t, h, k, w_out_in=w_out_in, tables=tables)
        outs = _run(inp, w_out_in=w_out_in)
        y_ref = oracle_ops.proj_rope_oracle(inp["x"], inp["w"], inp["cos"], inp["sin"], w_out_in=w_out_in)
        oracle_ops.assert_proj_rope_close(self, outs, y_ref)

    @parameterized.product(shape=[(32, 1, 64), (160, 2, 520 // 32 * 32), (992, 7, 1024)], w_out_in=(True, False))
    def test_mxfp8_inputs_match_oracle(self, shape, w_out_in):
        """E4M3 codes + E8M0 scales: dequantized exactly to bf16 by XLA, then the same kernel."""
        t, h, k = shape
        inp = _inputs(np.random.SeedSequence().entropy, t, h, k, w_out_in=w_out_in, tables="rotary", mxfp8=True)
        outs = _run(inp, w_out_in=w_out_in)
        y_ref = oracle_ops.proj_rope_oracle(inp["x"], inp["w"], inp["cos"], inp["sin"], x_scale=inp["x_scale"],
                                            w_scale=inp["w_scale"], w_out_in=w_out_in)
        oracle_ops.assert_proj_rope_close(self, outs, y_ref)

    @parameterized.product(w_out_in=(True, False), mxfp8=(False, True))
    def test_deepseek_v3_shape(self, w_out_in, mxfp8):
        t, h, k = 4096, 128, 1536
        inp = _inputs(np.random.SeedSequence().entropy, t, h, k, w_out_in=w_out_in, tables="rotary", mxfp8=mxfp8)
        outs = _run(inp, w_out_in=w_out_in)
        heads = sorted(np.random.default_rng().choice(h, size=3, replace=False).tolist())
        y_ref = oracle_ops.proj_rope_oracle(inp["x"], inp["w"], inp["cos"], inp["sin"], x_scale=inp["x_scale"],
                                            w_scale=inp["w_scale"], w_out_in=w_out_in, heads=heads)
        oracle_ops.assert_proj_rope_close(self, [o[:, heads] for o in outs], y_ref)
        self.assertFalse((outs[1] == 0xFE).any() or (outs[3] == 0xFE).any())  # every scale byte was written

    def test_lowers_to_the_kernel(self):
        inp = _inputs(0, 64, 2, 128, w_out_in=True, tables="random")
        f = jax.jit(lambda *a: jbg.gemm_proj_rope_mxfp8(*a, implementation="cutedsl"))
        text = f.lower(*(inp[n] for n in ("x", "w", "cos", "sin"))).as_text()
        self.assertIn("jbg_gemm_proj_rope_mxfp8", text)
        self.assertIn("_t128x192_", text)  # both architectures' kernels take 128-token x one-head tiles

    @parameterized.parameters(True, False)
    def test_nan_inf_and_zero_tokens(self, w_out_in):
        """SPEC §2 per block: NaN/inf -> scale 0xFF and codes 0 (rowwise and the column blocks they touch);
        an all-zero token -> scale byte 0 and codes 0; the kernel agrees byte for byte with the reference there."""
        t, h, k = 96, 2, 64
        inp = _inputs(np.random.SeedSequence().entropy, t, h, k, w_out_in=w_out_in, tables="random")
        x = inp["x"].astype(np.float32)
        x[5, 3], x[70, 7], x[40, :] = np.nan, np.inf, 0.0
        inp["x"] = x.astype(inp["x"].dtype)
        rc, rs, cc, cs = _run(inp, w_out_in=w_out_in)
        ref = _run(inp, w_out_in=w_out_in, implementation="xla")
        for i in (5, 40, 70):
            np.testing.assert_array_equal(rs[i], ref[1][i])
            np.testing.assert_array_equal(rc[i].view(np.uint8) & 0x7F, ref[0][i].view(np.uint8) & 0x7F)
        self.assertTrue((rs[[5, 70]] == 0xFF).all() and (rs[40] == 0).all())
        np.testing.assert_array_equal(cs[[0, 2]], ref[3][[0, 2]])
        self.assertTrue((cs[[0, 2]] == 0xFF).all() and (cs[1] != 0xFF).all())
        self.assertFalse(np.isnan(rc.astype(np.float32)).any() or np.isnan(cc.astype(np.float32)).any())
        finite = [i for i in range(t) if i not in (5, 40, 70)]
        y_ref = oracle_ops.proj_rope_oracle(inp["x"][finite], inp["w"], inp["cos"][finite], inp["sin"][finite],
                                            w_out_in=w_out_in)
        self.assertTrue((rs[finite] < 0xFE).all())  # every finite token's row blocks were written
        # column blocks mix special tokens, so only the finite tokens' rowwise blocks meet the float64 oracle here
        oracle_ops.assert_quantized_close(self, "rowwise", rc[finite], rs[finite], y_ref, axis=2)

    @parameterized.parameters(True, False)
    def test_nan_inf_feature_columns(self, w_out_in):
        """NaN/inf in single features (a row of W): the column blocks of exactly those output features get scale
        0xFF and codes 0 in every token block, next to finite columns of the same 32-feature group (a partial
        NaN/inf column mask in a warp); RoPE carries a bad input feature to both outputs of its pair."""
        t, h, k = 96, 3, 64
        inp = _inputs(np.random.SeedSequence().entropy, t, h, k, w_out_in=w_out_in, tables="random")
        w = inp["w"].astype(np.float32)
        rows = w if w_out_in else w.T  # (H*192, K) view
        bad_inputs = {(1, 3): np.nan, (1, 129): np.nan, (0, 77): np.inf}  # (head, feature of Y before RoPE)
        for (hd, f), v in bad_inputs.items():
            rows[hd * 192 + f, 5] = v
        inp["w"] = w.astype(inp["w"].dtype)
        rc, rs, cc, cs = _run(inp, w_out_in=w_out_in)
        bad = {(1, 3), (1, 128), (1, 160), (0, 77)}  # output features: p[1] feeds out[128] and out[160]
        for hd in range(h):
            for f in range(192):
                col_bytes = cs[:, hd, f]
                if (hd, f) in bad:
                    self.assertTrue((col_bytes == 0xFF).all(), (hd, f, col_bytes))
                    self.assertTrue((cc[:, hd, f].astype(np.float32) == 0).all(), (hd, f))
                    self.assertTrue((rs[:, hd, f // 32] == 0xFF).all(), (hd, f))
                    self.assertTrue((rc[:, hd, f // 32 * 32:(f // 32 + 1) * 32].astype(np.float32) == 0).all())
                else:
                    self.assertTrue((col_bytes < 0xFE).all(), (hd, f, col_bytes))
        self.assertFalse(np.isnan(rc.astype(np.float32)).any() or np.isnan(cc.astype(np.float32)).any())
        clean = inp["w"].astype(np.float32)
        (clean if w_out_in else clean.T)[np.isnan(rows) | np.isinf(rows)] = 0.0
        y_ref = oracle_ops.proj_rope_oracle(inp["x"], clean.astype(inp["w"].dtype), inp["cos"], inp["sin"],
                                            w_out_in=w_out_in)
        oracle_ops.assert_proj_rope_close(self, [o[:, 2:] for o in (rc, rs, cc, cs)], y_ref[:, 2:])
        for hd in (0, 1):
            good = [f for f in range(192) if (hd, f) not in bad]
            oracle_ops.assert_quantized_close(self, f"columnwise head {hd}", cc[:, hd, good], cs[:, hd, good],
                                              y_ref[:, hd, good], axis=0)

    def test_vmap_over_tokens_runs_the_kernel(self):
        t, h, k = 64, 2, 128
        inp = _inputs(np.random.SeedSequence().entropy, 2 * t, h, k, w_out_in=True, tables="rotary")
        x, cos, sin = (jnp.asarray(inp[n]).reshape(2, t, -1) for n in ("x", "cos", "sin"))
        f = jax.jit(jax.vmap(lambda x, c, s: jbg.gemm_proj_rope_mxfp8(x, inp["w"], c, s, implementation="cutedsl")))
        outs = f(x, cos, sin)
        for g in range(2):
            y_ref = oracle_ops.proj_rope_oracle(inp["x"][g * t:(g + 1) * t], inp["w"], inp["cos"][g * t:(g + 1) * t],
                                                inp["sin"][g * t:(g + 1) * t])
            oracle_ops.assert_proj_rope_close(self, [np.asarray(o[g]) for o in outs], y_ref)

    # SHAPES give fewer tiles than an H200 has SMs (one tile per CTA); these give CTAs up to 2 tiles of 128 tokens:
    # 153 tiles with a tail tile and fewer k-tiles than stages; 160 with 24 k-tiles; 132 of one k-tile with a k tail.
    @parameterized.product(shape=[(2080, 9, 200), (4096, 5, 1536), (8448, 2, 40)], w_out_in=(True, False))
    def test_several_tiles_per_cta_match_oracle(self, shape, w_out_in):
        t, h, k = shape
        inp = _inputs(np.random.SeedSequence().entropy, t, h, k, w_out_in=w_out_in, tables="rotary")
        outs = _run(inp, w_out_in=w_out_in)
        y_ref = oracle_ops.proj_rope_oracle(inp["x"], inp["w"], inp["cos"], inp["sin"], w_out_in=w_out_in)
        oracle_ops.assert_proj_rope_close(self, outs, y_ref)

    def test_grid_follows_the_sm_count(self):
        """The handler passes the device's SM count and the grid is min(tiles, SMs): with JAX_BLOCKGEMM_SM_LIMIT
        (read when a program is loaded) at 114 (an H100 PCIe) and at 7, CTAs walk more tiles each and the outputs
        still match the oracle; at 7 the kernel takes several times longer than on the whole GPU, which shows that
        the limit reached the launch."""
        t, h, k = 2080, 9, 200
        inp = _inputs(np.random.SeedSequence().entropy, t, h, k, w_out_in=True, tables="rotary")
        y_ref = oracle_ops.proj_rope_oracle(inp["x"], inp["w"], inp["cos"], inp["sin"], w_out_in=True)
        big = _inputs(5, 4096, 64, 1536, w_out_in=True, tables="random")
        times = {}
        for limit in ("114", "7", ""):
            with mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_SM_LIMIT": limit}):
                oracle_ops.assert_proj_rope_close(self, _run(inp, w_out_in=True), y_ref)
                f = jax.jit(lambda x, w, c, s: jbg.gemm_proj_rope_mxfp8(x, w, c, s, implementation="cutedsl"))
                args = [jnp.asarray(big[n]) for n in ("x", "w", "cos", "sin")]
                jax.block_until_ready(f(*args))
                start = time.perf_counter()
                for _ in range(5):
                    out = f(*args)
                jax.block_until_ready(out)
                times[limit] = time.perf_counter() - start
        self.assertGreater(times["7"], 4 * times[""], times)

    def test_same_bytes_in_a_larger_program_and_under_command_buffers(self):
        """Inside a bigger jitted program, and with XLA's CUDA graphs on, the outputs of both input paths are
        byte-identical."""
        script = textwrap.dedent("""
            import os, sys
            os.environ["JAX_BLOCKGEMM_POISON_OUTPUTS"] = "1"
            sys.path.insert(0, sys.argv[1])
            import jax, jax.numpy as jnp, numpy as np
            import jax_blockgemm as jbg, oracle_ops
            def step(x, w, c, s, xs=None, ws=None):
                x, c = (x * 1, c) if xs is None else (x, c * 1)  # an XLA op right before the custom call(s)
                outs = jbg.gemm_proj_rope_mxfp8(x, w, c, s, x_scale=xs, w_scale=ws, implementation="cutedsl")
                return outs, jnp.sum(outs[0].astype(jnp.float32))
            for mxfp8 in (False, True):  # the MXFP8 path adds the dequantize kernel (both launched with PDL)
                inp = oracle_ops.random_proj_rope_inputs(np.random.default_rng(5), t=256, h=3, k=512, mxfp8=mxfp8)
                args = [jnp.asarray(inp[n]) for n in ("x", "w", "cos", "sin")]
                if mxfp8:
                    args += [jnp.asarray(inp["x_scale"]), jnp.asarray(inp["w_scale"])]
                for _ in range(3):
                    outs, _ = jax.jit(step)(*args)
                sys.stdout.write("".join(np.asarray(o).view(np.uint8).tobytes().hex()[:4096] for o in outs))
        """)
        tests_dir = os.path.dirname(os.path.abspath(__file__))
        argv = [sys.executable, "-c", script, tests_dir]
        plain = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=dict(os.environ, XLA_FLAGS=""))
        graphs = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                                env=dict(os.environ, XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"))
        self.assertEqual(plain.returncode, 0, plain.stderr[-2000:])
        self.assertEqual(graphs.returncode, 0, graphs.stderr[-2000:])
        self.assertGreater(len(plain.stdout), 1000)
        self.assertEqual(plain.stdout, graphs.stdout)


if __name__ == "__main__":
    absltest.main()
