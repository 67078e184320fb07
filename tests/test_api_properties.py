"""Property-based tests (hypothesis) of the public API on CPU.

Random shapes (odd and round), formats, dtypes, majors, scale forms and scale dtypes, options and a few deliberate
mistakes go into `gemm_amax` and `gemm_proj_rope_mxfp8`. Every call must end in exactly one of two ways: a
ValueError/TypeError whose message names the offending argument, or a result that matches the float64 oracle
(tests/oracle_ops.py) by SPEC §7. Any other exception type, or a wrong or NaN result, fails. Each test also checks
that both outcomes actually occurred and that a known-good subset (SPEC §4's core: MXFP8, K-major, float32 C,
16-byte aligned sizes) always succeeds, so neither branch can pass vacuously.
"""

from __future__ import annotations

import collections
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from absl.testing import absltest

pytest.importorskip("hypothesis", reason="hypothesis is in the test extra: pip install -e '.[test]'")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import jax_blockgemm as jbg

import oracle_ops  # noqa: E402
from test_reference import _scale_log2  # noqa: E402

_ARGS = ("a", "b", "sfa", "sfb", "alpha", "c_dtype", "c_major", "a_major", "b_major", "acc_dtype", "mma_tiler_mn",
         "cluster_shape_mn", "sf_vec_size", "implementation", "x", "w", "cos", "sin", "x_scale", "w_scale",
         "w_out_in")
# An argument named as the subject of the message: "c_dtype=", "a's", "sfa/sfb", "sfa has", "x must", "a and b",
# "alpha (...)", ...
NAMES_AN_ARGUMENT = re.compile(r"(?<![\w.])(" + "|".join(_ARGS)
                               + r")(=|'s |/| has | have | must | and | disagree|: | \()")
# Fresh examples every run; nothing written to disk (no .hypothesis database in the repository).
# derandomize: the same examples every run, so the checks that both outcomes occur cannot flake.
_SETTINGS = dict(deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

C_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "uint8", "int32")
MISTAKES = ("b_dtype", "b_rank", "b_k", "sfb_dtype", "sfb_shape", "sf_vec_size", "alpha")


def _check_error(test: absltest.TestCase, e: Exception) -> None:
    """A clear trace-time error: ValueError/TypeError naming an argument; anything else fails the test."""
    if not isinstance(e, (ValueError, TypeError)):
        raise AssertionError(f"expected a ValueError or TypeError, got {type(e).__name__}: {e}") from e
    test.assertRegex(str(e), NAMES_AN_ARGUMENT, "the message does not name the offending argument")


def _seed_view(atom: np.ndarray) -> np.ndarray:
    """SPEC §3: the seed's view (32, 4, MN', 4, K', L) is the physical atom transposed by (3, 4, 1, 5, 2, 0)."""
    return np.ascontiguousarray(np.transpose(atom, (3, 4, 1, 5, 2, 0)))


def _scale_dtype_view(s: np.ndarray, dtype: str) -> np.ndarray:
    """E8M0 bytes as uint8, float8_e8m0fnu or int8 (same bits); E4M3 scales stay E4M3."""
    if s.dtype == np.uint8 and dtype != "uint8":
        return s.view({"float8_e8m0fnu": ml_dtypes.float8_e8m0fnu, "int8": np.int8}[dtype])
    return s


@st.composite
def gemm_calls(draw) -> dict:
    """Half the draws stay in the support surface's core (aligned sizes, K-major, float32/bfloat16 C, default
    tiling) with random formats, shapes, scale forms and scale dtypes; the other half draw every option freely."""
    fmt = draw(st.sampled_from(oracle_ops.FORMATS))
    fp4 = fmt in ("mxfp4", "nvfp4")
    batched = draw(st.booleans())
    common = dict(fmt=fmt, batched=batched, l=draw(st.integers(1, 3)) if batched else 1, m=draw(st.integers(1, 80)),
                  form=draw(st.sampled_from(["compact", "atom", "seed"])),
                  e8m0=draw(st.sampled_from(["uint8", "float8_e8m0fnu", "int8"])),
                  use_alpha=fmt == "nvfp4" and draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        return dict(common, n=32 * draw(st.integers(1, 3)), k=32 * draw(st.integers(1, 9)), a_major="k",
                    b_major="k", c_major="n", c_dtype=draw(st.sampled_from(["float32", "bfloat16"])),
                    tiler=(128, 128), cluster=(1, 1), implementation=draw(st.sampled_from([None, "xla"])),
                    mistake=None)
    k = draw(st.one_of(st.sampled_from([32, 64, 96, 160, 256]), st.integers(1, 200)))
    return dict(
        common, n=draw(st.one_of(st.sampled_from([16, 32, 64]), st.integers(1, 80))), k=k + (k % 2 if fp4 else 0),
        a_major=draw(st.sampled_from(["k", "m"])), b_major=draw(st.sampled_from(["k", "n"])),
        c_major=draw(st.sampled_from(["n", "m"])), c_dtype=draw(st.sampled_from(C_DTYPES)),
        tiler=draw(st.sampled_from([(128, 128), (128, 256), (64, 128)])),
        cluster=draw(st.sampled_from([(1, 1), (2, 1), (3, 1)])),
        implementation=draw(st.sampled_from([None, "xla", "gpu"])),
        mistake=draw(st.sampled_from([None] * 3 + list(MISTAKES))))


def _known_good(call: dict) -> bool:
    """SPEC §4's core: MXFP8, K-major A/B, N-major float32 C, default tiling, aligned sizes, no mistake."""
    return (call["fmt"].startswith("mxfp8") and call["mistake"] is None and call["k"] % 32 == 0
            and call["n"] % 4 == 0 and (call["a_major"], call["b_major"], call["c_major"]) == ("k", "k", "n")
            and call["c_dtype"] == "float32" and call["tiler"] == (128, 128) and call["cluster"] == (1, 1)
            and call["implementation"] != "gpu")


def _gemm_arguments(call: dict, inp: dict) -> tuple[list, dict]:
    """Positional arrays and keyword options for jbg.gemm_amax, with the drawn mistake applied."""
    unbatch = (lambda x: x) if call["batched"] else (lambda x: x[0])
    a, b = unbatch(inp["a"]), unbatch(inp["b"])
    if call["form"] == "compact":
        sfa, sfb = unbatch(inp["sfa"]), unbatch(inp["sfb"])
    elif call["form"] == "atom":
        sfa, sfb = unbatch(inp["sfa_atom"]), unbatch(inp["sfb_atom"])
    else:
        sfa, sfb = _seed_view(inp["sfa_atom"]), _seed_view(inp["sfb_atom"])
    sfa, sfb = _scale_dtype_view(sfa, call["e8m0"]), _scale_dtype_view(sfb, call["e8m0"])
    kwargs = dict(c_dtype=jnp.dtype(call["c_dtype"]), a_major=call["a_major"], b_major=call["b_major"],
                  c_major=call["c_major"], mma_tiler_mn=call["tiler"], cluster_shape_mn=call["cluster"],
                  sf_vec_size=inp["sf_vec_size"], implementation=call["implementation"])
    if call["use_alpha"] or call["mistake"] == "alpha":
        kwargs["alpha"] = inp["alpha"] if call["mistake"] != "alpha" else np.full((2,), inp["alpha"], np.float32)
    mistake = call["mistake"]
    if mistake == "b_dtype":
        b = b.astype(np.float32)
    elif mistake == "b_rank":
        b = b[None, None]
    elif mistake == "b_k":
        b = np.concatenate([b, b[..., :16]], axis=-1)
    elif mistake == "sfb_dtype":
        sfb = sfb.astype(np.float32)
    elif mistake == "sfb_shape":
        sfb = np.concatenate([sfb, sfb[..., :1]], axis=-1)
    elif mistake == "sf_vec_size":
        kwargs["sf_vec_size"] = 48 - inp["sf_vec_size"]  # 16 <-> 32
    return [a, b, sfa, sfb], kwargs


@st.composite
def proj_rope_calls(draw) -> dict:
    """Half the draws inside SPEC §5 (T a multiple of 32, K of 32), the other half free, mistakes included."""
    common = dict(h=draw(st.integers(1, 2)), mxfp8=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)),
                  w_out_in=draw(st.sampled_from([True, False])))
    if draw(st.booleans()):
        return dict(common, t=32 * draw(st.integers(1, 3)), k=32 * draw(st.integers(1, 4)), mistake=None,
                    implementation=draw(st.sampled_from([None, "xla"])))
    return dict(common, t=draw(st.one_of(st.sampled_from([32, 64]), st.integers(1, 70))),
                k=draw(st.one_of(st.sampled_from([32, 64, 96]), st.integers(1, 100))),
                w_out_in=draw(st.sampled_from([True, False, 1])),
                mistake=draw(st.sampled_from([None, "cos_shape", "sin_dtype", "no_scale", "w_k", "x_dtype"])),
                implementation=draw(st.sampled_from([None, "xla", "cuda"])))


class GemmAmaxPropertyTest(absltest.TestCase):

    def _once(self, call: dict) -> str:
        rng = np.random.default_rng(call["seed"])
        c_dtype = call["c_dtype"]
        try:
            scale_log2 = _scale_log2(call["fmt"], "float4_e2m1fn" if c_dtype == "uint8" else c_dtype)
        except KeyError:  # a format / C dtype pair outside the support surface: the call must refuse it
            scale_log2 = None
        if c_dtype == "float16":
            scale_log2 = (-9, -6)  # keep C inside float16's range
        inp = oracle_ops.random_gemm_inputs(rng, l=call["l"], m=call["m"], n=call["n"], k=call["k"], fmt=call["fmt"],
                                            a_major=call["a_major"] if call["fmt"].startswith("mxfp8") else "k",
                                            b_major=call["b_major"] if call["fmt"].startswith("mxfp8") else "k",
                                            scale_log2=scale_log2)
        args, kwargs = _gemm_arguments(call, inp)
        try:
            c, amax = jbg.gemm_amax(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 -- the property is about which exceptions come out
            if _known_good(call):
                raise AssertionError(f"a call inside SPEC §4's core was refused: {call}") from e
            _check_error(self, e)
            return "error"
        c_ref, amax_ref = oracle_ops.gemm_amax_oracle(
            inp["a"], inp["b"], inp["sfa"], inp["sfb"], k=call["k"], sf_vec_size=inp["sf_vec_size"],
            a_major=kwargs["a_major"], b_major=kwargs["b_major"], alpha=inp["alpha"] if "alpha" in kwargs else None)
        self.assertEqual(np.shape(amax), ())
        c = np.asarray(c)
        oracle_ops.assert_gemm_close(self, c if call["batched"] else c[None], c_ref, c_dtype=kwargs["c_dtype"],
                                     c_major=call["c_major"])
        oracle_ops.assert_amax_close(self, np.asarray(amax), amax_ref)
        return "ok"

    def test_error_or_oracle(self):
        outcomes = collections.Counter()

        @settings(max_examples=30, **_SETTINGS)
        @given(call=gemm_calls())
        def run(call):
            outcomes[self._once(call)] += 1

        run()  # derandomized: the same 30 calls every run, about a third of them valid
        self.assertGreaterEqual(outcomes["ok"], 6, outcomes)
        self.assertGreaterEqual(outcomes["error"], 12, outcomes)


class ProjRopePropertyTest(absltest.TestCase):

    def _once(self, call: dict) -> str:
        rng = np.random.default_rng(call["seed"])
        t, h, k, mxfp8 = call["t"], call["h"], call["k"], call["mxfp8"]
        k_built = max(32, -(-k // 32) * 32) if mxfp8 else k  # the input maker needs whole scale blocks
        d = oracle_ops.random_proj_rope_inputs(rng, t=t, h=h, k=k_built, mxfp8=mxfp8,
                                               w_out_in=call["w_out_in"] is not False)
        x, w, cos, sin = d["x"], d["w"], d["cos"], d["sin"]
        kwargs = dict(x_scale=d["x_scale"], w_scale=d["w_scale"], w_out_in=call["w_out_in"],
                      implementation=call["implementation"])
        mistake = call["mistake"]
        if mistake == "cos_shape":
            cos = cos[:, :32]
        elif mistake == "sin_dtype":
            sin = sin.astype(np.float32)
        elif mistake == "no_scale":
            kwargs["x_scale"] = None if mxfp8 else np.zeros((t, 1), np.uint8)
        elif mistake == "w_k":
            w = w[:, :-8] if call["w_out_in"] is not False else w[:-8]
        elif mistake == "x_dtype":
            x = x.astype(np.float32)
        known_good = (mistake is None and isinstance(call["w_out_in"], bool) and call["implementation"] != "cuda"
                      and t % 32 == 0 and k % 32 == 0)
        try:
            outs = jbg.gemm_proj_rope_mxfp8(x, w, cos, sin, **kwargs)
        except Exception as e:  # noqa: BLE001
            if known_good:
                raise AssertionError(f"a call inside SPEC §5 was refused: {call}") from e
            _check_error(self, e)
            return "error"
        y_ref = oracle_ops.proj_rope_oracle(x, w, cos, sin, x_scale=kwargs["x_scale"], w_scale=kwargs["w_scale"],
                                            w_out_in=bool(call["w_out_in"]))
        oracle_ops.assert_proj_rope_close(self, [np.asarray(o) for o in outs], y_ref)
        return "ok"

    def test_error_or_oracle(self):
        outcomes = collections.Counter()

        @settings(max_examples=12, **_SETTINGS)
        @given(call=proj_rope_calls())
        def run(call):
            outcomes[self._once(call)] += 1

        run()
        self.assertGreaterEqual(outcomes["ok"], 6, outcomes)
        self.assertGreaterEqual(outcomes["error"], 4, outcomes)


if __name__ == "__main__":
    absltest.main()
