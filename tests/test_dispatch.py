"""Which implementation a CUDA lowering picks: kernel, reference, or a clear error (no GPU needed)."""

import os
import re
import tempfile
import types
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg
from jax_blockgemm import arch, dispatch, formats, gate, primitives, reference, tuning

import decode_standin
import oracle


def _operands(m=256, n=128, k=128):
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32).astype(jnp.float8_e4m3fn)
    b = jnp.asarray(rng.standard_normal((n, k)), jnp.float32).astype(jnp.float8_e4m3fn)
    sfa = jnp.asarray(oracle.random_scale_bytes(rng, (m, k // 32)))
    sfb = jnp.asarray(oracle.random_scale_bytes(rng, (n, k // 32)))
    return a, b, sfa, sfb


def _none_takes(op: str, choice: str, capability: str = "9.0"):
    """arch.TABLE with implementation=None taking `choice` for `op` on `capability`."""
    default = next(p.default for p in arch.TABLE if p.capability == capability)
    return arch.overridden(capability, default={**default, op: choice})


def _cuda_text(**kwargs) -> str:
    f = jax.jit(lambda *x: jbg.gemm_amax(*x, **kwargs))
    return f.trace(*_operands()).lower(lowering_platforms=("cuda",)).as_text()


class DispatchTest(parameterized.TestCase):

    def test_cutedsl_emits_the_kernel_call(self):
        text = _cuda_text(implementation="cutedsl")
        self.assertIn("jbg_gemm_amax", text)
        self.assertIn('archs = "sm_100a,sm_90a"', text)  # both objects travel; the handler picks by CC

    def test_xla_never_does(self):
        self.assertNotIn("jbg_gemm_amax", _cuda_text(implementation="xla"))

    def test_default_follows_the_measured_preference(self):
        with _none_takes("gemm_amax", "reference"):
            self.assertNotIn("jbg_gemm_amax", _cuda_text())
        with _none_takes("gemm_amax", "kernel"):
            self.assertIn("jbg_gemm_amax", _cuda_text())

    def test_gpu_without_kernel(self):
        """On an sm_80 machine, None falls back to the reference and 'cutedsl' says why it cannot run."""
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("8.0",)), \
                _none_takes("gemm_amax", "kernel"):
            self.assertNotIn("jbg_gemm_amax", _cuda_text())
            with self.assertRaisesRegex(ValueError,
                                        "no kernel for compute capability 8.0 .kernels exist for sm_100a, sm_90a"):
                _cuda_text(implementation="cutedsl")

    def test_cutedsl_without_kernel_raises(self):
        """MN-major operands leave K free of the 16-byte rule at the API, but the kernels need K % 16 == 0."""
        sd = jax.ShapeDtypeStruct
        operands = (sd((40, 256), jnp.float8_e4m3fn), sd((40, 128), jnp.float8_e4m3fn), sd((256, 2), jnp.uint8),
                    sd((128, 2), jnp.uint8))
        f = jax.jit(lambda *x: jbg.gemm_amax(*x, a_major="m", b_major="n", implementation="cutedsl"))
        with self.assertRaisesRegex(ValueError, r"implementation='cutedsl': no CuTeDSL kernel applies.*cannot take "
                                                r"\(M, N, K, L\) = \(256, 128, 40, 1\): k must be a multiple of 16"):
            f.trace(*operands).lower(lowering_platforms=("cuda",))

    def test_an_arch_whose_kernel_module_cannot_import_is_left_out(self):
        from jax_blockgemm.kernels import catalog

        def broken(v):
            raise ImportError("cutlass.utils has no PersistentTileSchedulerParams")

        with mock.patch.dict(catalog._FACTORIES, {("gemm_amax", "sm_100a"): broken}):
            self.assertIn('archs = "sm_90a"', _cuda_text(implementation="cutedsl"))
            with mock.patch.dict(catalog._FACTORIES, {("gemm_amax", "sm_90a"): broken}), \
                    self.assertRaisesRegex(ValueError, "no kernel can be built here: sm_100a: cutlass.utils has no"):
                _cuda_text(implementation="cutedsl")

    def test_native_bridge_missing(self):
        """Without the built extension, None takes the reference and 'cutedsl' says why."""
        from jax_blockgemm import _native

        with mock.patch.object(_native, "extension", side_effect=ImportError("bridge not built")):
            self.assertNotIn("jbg_gemm_amax", _cuda_text(implementation=None))
            with self.assertRaisesRegex(ValueError, "no kernel can run here: bridge not built"):
                _cuda_text(implementation="cutedsl")




def _proj_rope_text(*, w_out_in=True, mxfp8=False, t=64, h=2, k=128, **kwargs) -> str:
    dtype = jnp.float8_e4m3fn if mxfp8 else jnp.bfloat16
    x = jax.ShapeDtypeStruct((t, k), dtype)
    w = jax.ShapeDtypeStruct((h * 192, k) if w_out_in else (k, h * 192), dtype)
    cs = jax.ShapeDtypeStruct((t, 64), jnp.bfloat16)
    scales = {}
    if mxfp8:
        scales = dict(x_scale=jax.ShapeDtypeStruct((t, k // 32), jnp.uint8),
                      w_scale=jax.ShapeDtypeStruct((h * 192, k // 32) if w_out_in else (k // 32, h * 192), jnp.uint8))
    f = jax.jit(lambda x, w, c, s, sc: jbg.gemm_proj_rope_mxfp8(x, w, c, s, w_out_in=w_out_in, **sc, **kwargs))
    return f.trace(x, w, cs, cs, scales).lower(lowering_platforms=("cuda",)).as_text()


class ProjRopeDispatchTest(parameterized.TestCase):

    @parameterized.parameters(True, False)
    def test_cutedsl_emits_the_kernel_call(self, w_out_in):
        text = _proj_rope_text(w_out_in=w_out_in, implementation="cutedsl")
        self.assertIn("jbg_gemm_proj_rope_mxfp8", text)
        self.assertIn(f"w_out_in = {str(w_out_in).lower()}", text)
        # the layout's own object of the default schedule ("staged", 128-token tiles)
        self.assertIn("_t128x192_c1x1" + ("" if w_out_in else "_bn") + "_staged", text)

    def test_xla_never_does(self):
        self.assertNotIn("jbg_gemm_proj_rope_mxfp8", _proj_rope_text(implementation="xla"))

    @parameterized.parameters(True, False)
    def test_cutedsl_carries_the_sm100a_object_too(self, w_out_in):
        text = _proj_rope_text(w_out_in=w_out_in, implementation="cutedsl")
        self.assertIn('archs = "sm_100a,sm_90a"', text)
        self.assertIn("jbg_proj_rope_sm_100a_bf16_e4m3_sf32_t128x192_c1x1" + ("" if w_out_in else "_bn"), text)

    def test_default_never_takes_the_never_run_sm100a_kernel(self):
        """Never run, never measured: None takes the reference on a Blackwell machine, without a self-check."""

        self.assertFalse(arch.none_takes_kernel("proj_rope", "sm_100a"))
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("10.0",)), \
                mock.patch.object(gate, "ensure_verified", side_effect=AssertionError("no check expected")):
            self.assertNotIn("jbg_gemm_proj_rope_mxfp8", _proj_rope_text())

    def test_default_follows_the_measured_preference(self):
        with _none_takes("proj_rope", "reference"):
            self.assertNotIn("jbg_gemm_proj_rope_mxfp8", _proj_rope_text())
        with _none_takes("proj_rope", "kernel"):
            self.assertIn("jbg_gemm_proj_rope_mxfp8", _proj_rope_text())

    @parameterized.parameters(True, False)
    def test_mxfp8_inputs_are_dequantized_for_the_kernel(self, w_out_in):
        text = _proj_rope_text(mxfp8=True, w_out_in=w_out_in, implementation="cutedsl")
        call = [line for line in text.splitlines() if "stablehlo.custom_call @jbg_gemm_proj_rope_mxfp8" in line]
        self.assertLen(call, 1)
        self.assertIn("bf16>, tensor<1x", call[0].split("->")[0].split(":")[-1])  # bf16 operands reach the kernel
        # codes x scales by the dequantize kernel (one call for w and x), not in XLA
        self.assertEqual(text.count("stablehlo.custom_call @jbg_dequantize_mxfp8"), 1)
        self.assertNotIn("stablehlo.multiply", text)

    def test_vmap_over_weights_takes_the_reference(self):
        x = jnp.zeros((64, 128), jnp.bfloat16)
        w = jnp.zeros((3, 192, 128), jnp.bfloat16)
        cs = jnp.zeros((64, 64), jnp.bfloat16)
        f = jax.jit(jax.vmap(lambda w: jbg.gemm_proj_rope_mxfp8(x, w, cs, cs, implementation="cutedsl")))
        with self.assertRaisesRegex(ValueError, "one weight matrix per call; got 3"):
            f.trace(w).lower(lowering_platforms=("cuda",))
        with _none_takes("proj_rope", "kernel"):
            g = jax.jit(jax.vmap(lambda w: jbg.gemm_proj_rope_mxfp8(x, w, cs, cs)))
            self.assertNotIn("jbg_gemm_proj_rope_mxfp8", g.trace(w).lower(lowering_platforms=("cuda",)).as_text())

    def test_floor_scale_rule_takes_the_reference(self):
        from jax_blockgemm import formats

        with formats.scale_rule("floor"), self.assertRaisesRegex(ValueError, "'ceil' scale rule"):
            _proj_rope_text(implementation="cutedsl")

def _proj_rope_operands():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((64, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2 * 192, 96)), jnp.bfloat16)
    cs = jnp.asarray(rng.uniform(-1, 1, (64, 64)), jnp.bfloat16)
    return x, w, cs, cs


class DequantizeVariantsTest(parameterized.TestCase):
    """`dispatch.dequantize_variants`: which dequantize objects the MXFP8 proj_rope lowering gets, for w alone or
    with x beside it in the same launch."""

    @parameterized.parameters((-1, "k"), (-2, "m"))
    def test_one_object_per_arch_by_operand_0s_scale_axis(self, axis, a_major):
        variants = dispatch.dequantize_variants({"sm_90a", "sm_100a"}, (1, 24576, 1536) if axis == -1
                                                else (1, 1536, 24576), scale_axis=axis, paired_shape=(1, 2048, 1536))
        self.assertEqual([(v.op, v.arch, v.a_major) for v in variants],
                         [("dequantize", "sm_100a", a_major), ("dequantize", "sm_90a", a_major)])

    @parameterized.parameters(
        ((1, 96, 48), -1, None),  # operand 0's rows (scales along them) are not whole blocks of 32
        ((1, 48, 96), -2, None),  # scales along its columns: its rows must be whole blocks
        ((1, 96, 64), -1, (1, 64, 48)),  # operand 1's rows (its scales run along them) are not whole blocks
        ((1, 65536, 32768), -1, None),  # 2**31 codes
        ((1, 96, 64), -1, (1, 65536, 32768)),
    )
    def test_none_where_the_kernel_cannot_take_an_operand(self, shape, axis, paired):
        self.assertEqual(dispatch.dequantize_variants({"sm_90a"}, shape, scale_axis=axis, paired_shape=paired), ())

    def test_none_where_an_arch_has_no_object(self):
        self.assertEqual(dispatch.dequantize_variants({"sm_90a", "sm_80"}, (1, 96, 64), scale_axis=-1), ())

    def test_swap_ab_order(self):
        """The swap_ab ragged kernel's tokens: the sm_90a object of that order (sm_100a has none), for columns in
        whole 64-column tiles with scales along them only."""
        variants = dispatch.dequantize_variants({"sm_90a"}, (1, 300, 512), scale_axis=-1, swap_ab_order=True)
        self.assertEqual([(v.arch, v.a_major, v.schedule) for v in variants], [("sm_90a", "k", "swap_ab")])
        for archs, shape, axis in (({"sm_90a", "sm_100a"}, (1, 300, 512), -1), ({"sm_90a"}, (1, 300, 96), -1),
                                   ({"sm_90a"}, (1, 320, 512), -2)):
            self.assertEqual(dispatch.dequantize_variants(archs, shape, scale_axis=axis, swap_ab_order=True), (),
                             (archs, shape, axis))


class OffCudaTest(parameterized.TestCase):
    """SPEC §6 on the CPU: 'cutedsl' demands a kernel and fails loudly; None and 'xla' run the reference."""

    @parameterized.named_parameters(
        ("gemm_amax", jbg.gemm_amax, _operands, "gemm_amax"),
        ("proj_rope", jbg.gemm_proj_rope_mxfp8, _proj_rope_operands, "gemm_proj_rope_mxfp8"),
    )
    def test_cutedsl_raises_on_cpu(self, op, operands, name):
        args = jax.device_put(operands(), jax.devices("cpu")[0])  # committed to the CPU: jit runs there
        f = jax.jit(lambda *x: op(*x, implementation="cutedsl"))
        with self.assertRaisesRegex(ValueError, f"implementation='cutedsl': {name} has no CuTeDSL kernel on "
                                                "platform cpu .*use implementation=None or 'xla'"):
            f(*args)
        ref = jax.jit(lambda *x: op(*x, implementation="xla"))(*args)
        best = jax.jit(lambda *x: op(*x, implementation=None))(*args)
        for r, b in zip(ref, best):
            self.assertFalse(np.isnan(np.asarray(r, np.float32)).any())
            np.testing.assert_array_equal(np.atleast_1d(r).view(np.uint8), np.atleast_1d(b).view(np.uint8))

    def test_multi_platform_lowering_names_every_platform_without_a_kernel(self):
        f = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl"))
        with self.assertRaisesRegex(ValueError, "no CuTeDSL kernel on platforms cpu, tpu"):
            f.trace(*_operands()).lower(lowering_platforms=("cpu", "tpu"))


def _abstract(l, m, n, k, *, ab=jnp.float8_e4m3fn):
    """Abstract batched MXFP8 operands with compact scales: shapes only, no memory."""
    sd = jax.ShapeDtypeStruct
    return sd((l, m, k), ab), sd((l, n, k), ab), sd((l, m, k // 32), jnp.uint8), sd((l, n, k // 32), jnp.uint8)


def _lower_for_cuda(operands, **kwargs):
    f = jax.jit(lambda *x: jbg.gemm_amax(*x, **kwargs))
    return f.trace(*operands).lower(lowering_platforms=("cuda",)).as_text()


class Int32LimitTest(parameterized.TestCase):
    """More than 2**31 elements in an operand or in C never reaches the kernel or the handler: None takes the
    reference and 'cutedsl' raises when the program is lowered. Abstract shapes only (jax.eval_shape, .lower())."""

    def setUp(self):
        super().setUp()
        # The kernel would be the default here, so that None taking the reference shows the size decided it;
        # the object bytes are a stand-in (nothing is compiled or run).
        self.enterContext(_none_takes("gemm_amax", "kernel"))
        from jax_blockgemm import kernel_cache
        self.enterContext(mock.patch.object(kernel_cache, "get_object", return_value=b"\x7fELF stand-in"))

    @parameterized.named_parameters(
        ("a_exactly_2_31", (1, 65536, 128, 32768), "a", "2147483648 elements"),
        ("b_past_2_31", (1, 128, 65540, 32768), "b", "2147614720 elements"),
        ("c_2_32", (1, 65536, 65536, 32), "c", "4294967296 elements"),
        ("c_batched", (2, 32768, 32768, 32), "c", "2147483648 elements"),
        ("a_batched_l3", (3, 32768, 64, 32768), "a", "3221225472 elements"),
    )
    def test_refused_or_reference(self, shape, name, count):
        l, m, n, k = shape
        operands = _abstract(l, m, n, k)
        c, amax = jax.eval_shape(lambda *x: jbg.gemm_amax(*x), *operands)  # the call itself is fine
        self.assertEqual((c.shape, amax.shape), ((l, m, n), ()))
        with self.assertRaisesRegex(ValueError, rf"implementation='cutedsl': .*{name} \(.*\) holds {count}, past "
                                                r"the kernels' 32-bit indexing"):
            _lower_for_cuda(operands, implementation="cutedsl")
        self.assertNotIn("jbg_gemm_amax", _lower_for_cuda(operands))  # None: the reference

    def test_just_under_the_limit_takes_the_kernel(self):
        operands = _abstract(1, 65535, 64, 32768)  # a: 2**31 - 32768 elements
        self.assertIn("jbg_gemm_amax", _lower_for_cuda(operands, implementation="cutedsl"))
        self.assertIn("jbg_gemm_amax", _lower_for_cuda(operands))

    def test_vmap_folding_past_the_limit(self):
        """vmap folds its axis into L, so the folded call is what is measured: 2 x 2**30 elements of C."""
        sd = jax.ShapeDtypeStruct
        operands = (sd((2, 32768, 32), jnp.float8_e4m3fn), sd((2, 32768, 32), jnp.float8_e4m3fn),
                    sd((2, 32768, 1), jnp.uint8), sd((2, 32768, 1), jnp.uint8))
        f = jax.jit(jax.vmap(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl")))
        with self.assertRaisesRegex(ValueError, r"c \(2, 32768, 32768\) holds 2147483648 elements"):
            f.trace(*operands).lower(lowering_platforms=("cuda",))
        c, amax = jax.eval_shape(jax.vmap(lambda *x: jbg.gemm_amax(*x)), *operands)
        self.assertEqual((c.shape, amax.shape), ((2, 32768, 32768), (2,)))

def _surface_operands(fmt: str, *, l=2, m=200, n=160, k=256):
    """Packed FP4 (uint8) or FP8 operands with atom scales for `fmt`, as abstract shapes."""
    sd = jax.ShapeDtypeStruct
    fp4 = fmt in ("mxfp4", "nvfp4", "fp4_e8m0_16")
    v = 32 if fmt in ("mxfp4", "mxfp8") else 16
    sf = jnp.float8_e4m3fn if fmt == "nvfp4" else jnp.uint8
    ab, row = (jnp.uint8, k // 2) if fp4 else (jnp.float8_e4m3fn, k)
    kp = -(-(-(-k // v)) // 4)
    return (sd((l, m, row), ab), sd((l, n, row), ab), sd((l, -(-m // 128), kp, 32, 4, 4), sf),
            sd((l, -(-n // 128), kp, 32, 4, 4), sf)), v


class SurfaceDispatchTest(parameterized.TestCase):
    """FP4 operands (MXFP4, NVFP4 with and without alpha) and every C dtype reach the kernels: one object per arch
    that has the variant (sm_90a: all of them; sm_100a: FP4 -> f32/bf16), with the attributes the handler parses."""

    def setUp(self):
        super().setUp()
        from jax_blockgemm import kernel_cache
        self.get_object = self.enterContext(mock.patch.object(kernel_cache, "get_object",
                                                              side_effect=lambda v: b"\x7fELF " + v.key.encode()))

    def _lower(self, fmt, c_dtype, *, alpha=False, **kwargs):
        operands, v = _surface_operands(fmt)
        extra = dict(alpha=jnp.float32(0.75)) if alpha else {}
        f = jax.jit(lambda *x: jbg.gemm_amax(*x, c_dtype=c_dtype, sf_vec_size=v, **extra, **kwargs))
        text = f.trace(*operands).lower(lowering_platforms=("cuda",)).as_text()
        calls = [line for line in text.splitlines() if "stablehlo.custom_call @jbg_gemm_amax" in line]
        self.assertLen(calls, 1)
        return calls[0]

    @parameterized.product(fmt=("mxfp4", "nvfp4"), c_dtype=("float32", "bfloat16", "float16", "float8_e4m3fn",
                                                             "float8_e5m2", "float4_e2m1fn"))
    def test_fp4_reaches_the_kernels(self, fmt, c_dtype):
        call = self._lower(fmt, jnp.dtype(c_dtype), implementation="cutedsl", alpha=fmt == "nvfp4")
        archs = "sm_100a,sm_90a" if c_dtype in ("float32", "bfloat16") else "sm_90a"
        self.assertIn(f'archs = "{archs}"', call)
        self.assertIn('ab_dtype = "float4_e2m1fn"', call)
        self.assertIn(f'c_dtype = "{c_dtype}"', call)
        sf, v = ("float8_e4m3fn", 16) if fmt == "nvfp4" else ("float8_e8m0fnu", 32)
        self.assertIn(f'sf_dtype = "{sf}"', call)
        self.assertIn(f"sf_vec_size = {v} : i64", call)
        for target in archs.split(","):
            self.assertRegex(call, rf"jbg_gemm_amax_{target}_e2m1_")
        operand_types = call.split(" : (")[-1].split(") -> ")[0]
        self.assertEqual(operand_types.count("tensor<"), 5 if fmt == "nvfp4" else 4)  # alpha after sfb
        c_type = {"float4_e2m1fn": "2x200x80xui8", "float8_e4m3fn": "2x200x160xf8E4M3FN"}.get(c_dtype)
        if c_type:
            self.assertIn(f"-> (tensor<{c_type}>", call)

    def test_nvfp4_without_alpha_passes_ones(self):
        call = self._lower("nvfp4", jnp.float32, implementation="cutedsl")
        self.assertIn("%arg3, %cst", call)  # a constant (L,) operand: ones
        operand_types = call.split(" : (")[-1].split(") -> ")[0]
        self.assertTrue(operand_types.endswith("tensor<2xf32>"), operand_types)

    @parameterized.parameters(("mxfp8", "float32", 4), ("nvfp4", "bfloat16", 5), ("mxfp4", "float16", 4))
    def test_c_major_m_runs_the_kernels_on_b_and_a(self, fmt, c_dtype, count):
        """c_major="m": the custom call gets (b, a, sfb, sfa[, alpha]) and returns C^T (L, N, M) N-major."""
        call = self._lower(fmt, jnp.dtype(c_dtype), implementation="cutedsl", c_major="m", alpha=fmt == "nvfp4")
        operand_types, result_types = call.split(" : (")[-1].split(") -> ")
        types = [t.strip() for t in operand_types.split(", ")]
        self.assertLen(types, count)
        row = 128 if fmt != "mxfp8" else 256  # K/2 bytes of packed FP4, K codes of FP8
        self.assertRegex(types[0], rf"tensor<2x160x{row}x")  # b (N = 160) first
        self.assertRegex(types[1], rf"tensor<2x200x{row}x")
        self.assertIn("tensor<2x160x200x", result_types)  # (L, N, M)
        archs = "sm_100a,sm_90a" if c_dtype in ("float32", "bfloat16") else "sm_90a"
        self.assertIn(f'archs = "{archs}"', call)

    @parameterized.parameters(("m", "k", "n", "m", "k"), ("k", "n", "n", "k", "n"), ("m", "n", "n", "m", "n"),
                              ("m", "k", "m", "k", "n"), ("k", "n", "m", "m", "k"), ("m", "n", "m", "m", "n"))
    def test_mn_major_operands_reach_the_kernels(self, a_major, b_major, c_major, kernel_a, kernel_b):
        """Every MN-major layout runs the MN-major variants of both archs (c_major="m" swaps A and B, and their
        majors)."""
        sd = jax.ShapeDtypeStruct
        l, m, n, k = 2, 208, 96, 256
        a = sd((l, k, m) if a_major == "m" else (l, m, k), jnp.float8_e5m2)
        b = sd((l, k, n) if b_major == "n" else (l, n, k), jnp.float8_e5m2)
        sfa, sfb = sd((l, m, k // 32), jnp.uint8), sd((l, n, k // 32), jnp.uint8)
        f = jax.jit(lambda *x: jbg.gemm_amax(*x, a_major=a_major, b_major=b_major, c_major=c_major,
                                             c_dtype=jnp.bfloat16, implementation="cutedsl"))
        text = f.trace(a, b, sfa, sfb).lower(lowering_platforms=("cuda",)).as_text()
        call = [line for line in text.splitlines() if "stablehlo.custom_call @jbg_gemm_amax" in line]
        self.assertLen(call, 1)
        self.assertIn('archs = "sm_100a,sm_90a"', call[0])
        self.assertIn(f'a_major = "{kernel_a}"', call[0])
        self.assertIn(f'b_major = "{kernel_b}"', call[0])
        suffix = ("_am" if kernel_a == "m" else "") + ("_bn" if kernel_b == "n" else "")
        self.assertIn(f'function_prefixes = "jbg_gemm_amax_sm_100a_e5m2_bf16_sf32_t128x128_c1x1{suffix},'
                      f'jbg_gemm_amax_sm_90a_e5m2_bf16_sf32_t128x128_c1x1{suffix}"', call[0])
        self.assertIn("tensor<2x208x96xbf16>" if c_major == "n" else "tensor<2x96x208xbf16>",
                      call[0].split(") -> ")[-1])

    def test_mxfp8_f16_c_is_sm90a_only(self):
        call = self._lower("mxfp8", jnp.float16, implementation="cutedsl")
        self.assertIn('archs = "sm_90a"', call)
        self.assertIn('c_dtype = "float16"', call)

    def test_fp4_with_e8m0_blocks_of_16_has_no_kernel_for_f16(self):
        with self.assertRaisesRegex(ValueError, "no kernel in the catalog for float4_e2m1fn operands, float16 C, "
                                                "float8_e8m0fnu scales per 16"):
            self._lower("fp4_e8m0_16", jnp.float16, implementation="cutedsl")

    def test_a_b200_without_the_c_dtype_falls_back(self):
        """sm_100a has FP4 kernels for f32/bf16 C only: on a B200 an FP8 C call takes the reference (None) or
        raises ('cutedsl')."""
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("10.0",)), \
                _none_takes("gemm_amax", "kernel"), _none_takes("gemm_amax", "kernel", "10.0"):
            with self.assertRaisesRegex(ValueError, r"no kernel for compute capability 10.0 \(kernels exist for "
                                                    r"sm_90a\)"):
                self._lower("mxfp4", jnp.float8_e4m3fn, implementation="cutedsl")
            operands, v = _surface_operands("mxfp4")
            f = jax.jit(lambda *x: jbg.gemm_amax(*x, c_dtype=jnp.float8_e4m3fn, sf_vec_size=v))
            self.assertNotIn("jbg_gemm_amax", f.trace(*operands).lower(lowering_platforms=("cuda",)).as_text())


# --------------------------------------------------------------------------------------------------------------
# The decode kernel (op "weight_stream"): weight_only_matmul with bf16 x, and gemm_amax with M <= 64


def _gemm_avals(m, n=144, k=96, l=2, *, fmt="mxfp8_e4m3"):
    """gemm_amax's canonical avals (atom scales) for `fmt` weights."""
    sa = jax.core.ShapedArray
    fp4 = fmt in ("mxfp4", "nvfp4")
    v = 16 if fmt == "nvfp4" else 32
    codes = {"mxfp8_e4m3": jnp.float8_e4m3fn, "mxfp8_e5m2": jnp.float8_e5m2}.get(fmt, jnp.uint8)
    sf = jnp.float8_e4m3fn if fmt == "nvfp4" else jnp.uint8
    row = k // 2 if fp4 else k
    atom = lambda mn: sa(formats.atom_shape(l, mn, -(-k // v)), sf)
    return [sa((l, m, row), codes), sa((l, n, row), codes), atom(m), atom(n)], v


def _decode(m, *, implementation="cutedsl", fmt="mxfp8_e4m3", c_dtype=jnp.bfloat16, k=96, n=144, **params):
    avals, v = _gemm_avals(m, n=n, k=k, fmt=fmt)
    config = dict(c_dtype=np.dtype(c_dtype), sf_vec_size=v, a_major="k", b_major="k", c_major="n", k=k)
    return dispatch.decode_kernels(avals, **{**config, **params}, implementation=implementation)


class DecodeDispatchTest(parameterized.TestCase):
    """Which decode variants dispatch names, and why none, with a stand-in kernel class (the real one need not
    exist) answering can_implement as documented."""

    def setUp(self):
        super().setUp()
        self.enterContext(decode_standin.stand_in_kernels())
        self.enterContext(arch.overridden("9.0", decode_swap_ab_m={}))  # the decode kernel's rules alone (the swap_ab
        # tile's: DecodeSwapAbDispatchTest)

    @parameterized.parameters((1, 16), (16, 16), (17, 64), (64, 64))
    def test_the_smallest_capacity_that_holds_m(self, m, rows):
        choice = _decode(m)
        self.assertEqual([(v.op, v.arch, v.tile_mn) for v in choice.variants],
                         [("weight_stream", "sm_100a", (32, rows)), ("weight_stream", "sm_90a", (32, rows))])
        self.assertTrue(all(v.ab_dtype == "float8_e4m3fn" and v.c_dtype == "bfloat16" for v in choice.variants))

    @parameterized.parameters(("mxfp8_e5m2", "float8_e5m2", 32, "float8_e8m0fnu"),
                              ("mxfp4", "float4_e2m1fn", 32, "float8_e8m0fnu"),
                              ("nvfp4", "float4_e2m1fn", 16, "float8_e4m3fn"))
    def test_each_weight_format_selects_its_variants(self, fmt, codes, v, sf):
        choice = _decode(8, fmt=fmt, c_dtype=jnp.float16)
        self.assertLen(choice.variants, 2)
        self.assertTrue(all((x.ab_dtype, x.sf_vec_size, x.sf_dtype, x.c_dtype) == (codes, v, sf, "float16")
                            for x in choice.variants), choice.variants)

    @parameterized.parameters((jnp.float8_e4m3fn, "float32"), (jnp.float8_e5m2, "float32"),
                              (jnp.float4_e2m1fn, "float32"), (jnp.float16, "float16"))
    def test_c_dtypes_the_kernel_does_not_write_take_its_float32_variants(self, c_dtype, kernel_c):
        """FP8 and packed FP4 C (MXFP4 / NVFP4 operands): the kernel writes float32, XLA converts."""
        choice = _decode(8, fmt="mxfp4", c_dtype=c_dtype)
        self.assertLen(choice.variants, 2)
        self.assertEqual({v.c_dtype for v in choice.variants}, {kernel_c})

    def test_either_a_major_and_c_major_take_the_kernel(self):
        for params in (dict(c_major="m"), dict(a_major="m"), dict(a_major="m", c_major="m")):
            with self.subTest(**params):
                avals, v = _gemm_avals(8)
                if params.get("a_major") == "m":
                    a = avals[0]
                    avals[0] = jax.ShapeDtypeStruct((a.shape[0], a.shape[2], a.shape[1]), a.dtype)  # (L, K, M)
                config = dict(c_dtype=np.dtype(jnp.bfloat16), sf_vec_size=v, a_major="k", b_major="k", c_major="n",
                              k=96)
                choice = dispatch.decode_kernels(avals, **{**config, **params}, implementation="cutedsl")
                self.assertEqual([(v.arch, v.tile_mn, v.c_dtype) for v in choice.variants],
                                 [("sm_100a", (32, 16), "bfloat16"), ("sm_90a", (32, 16), "bfloat16")])

    @parameterized.parameters(
        (dict(m=65), "M = 65 rows is more than the decode kernel takes .64."),
        (dict(m=8, b_major="n"), "streams a K-major weight; got b_major='n'"),
        (dict(m=8, implementation="xla"), "implementation='xla' forces the reference"),
    )
    def test_why_none(self, kwargs, reason):
        m = kwargs.pop("m")
        choice = _decode(m, **kwargs)
        self.assertEqual(choice.variants, ())
        self.assertRegex(choice.reason, reason)

    def test_k_the_kernel_cannot_take(self):
        avals, _ = _gemm_avals(8, k=40)
        choice = dispatch.decode_kernels(avals, c_dtype=np.dtype(jnp.float32), sf_vec_size=32, a_major="k",
                                         b_major="k", c_major="n", k=40, implementation="cutedsl")
        self.assertRegex(choice.reason, r"the sm_100a kernel cannot take \(M, N, K, L\) = \(8, 144, 40, 2\): k "
                                        r"must be a multiple of 16")

    def test_none_follows_the_thresholds_of_the_local_gpu(self):
        """No GPU seen: None carries the objects of every arch whose threshold holds M (sm_90a only). An H200: the
        sm_90a kernel up to its threshold. A B200 (threshold 0): no object None may run there, so the reference,
        without a self-check."""

        self.assertEqual([v.arch for v in _decode(8, implementation=None).variants], ["sm_90a"])
        largest = arch.policy("sm_90a").decode_max_m["mxfp8_e4m3"]
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)):
            self.assertEqual([v.arch for v in _decode(largest, implementation=None, k=7168).variants], ["sm_90a"])
            # below the short-K rule's K (decode_short_k), None takes fewer rows: MXFP8 at K = 96 up to 16
            short_k, short_m = arch.policy("sm_90a").decode_short_k["mxfp8_e4m3"]
            self.assertLess(short_m, largest)
            self.assertEqual([v.arch for v in _decode(short_m, implementation=None, k=96).variants], ["sm_90a"])
            self.assertRegex(_decode(short_m + 1, implementation=None, k=short_k - 32).reason,
                             "implementation=None takes the reference")
            self.assertEqual([v.arch for v in _decode(short_m + 1, implementation=None, k=short_k).variants],
                             ["sm_90a"])
            with arch.overridden("9.0", decode_max_m={"mxfp8_e4m3": 8}):
                self.assertEqual([v.arch for v in _decode(8, implementation=None).variants], ["sm_90a"])
                self.assertRegex(_decode(9, implementation=None).reason, "implementation=None takes the reference "
                                                                         "over the sm_100a, sm_90a kernel")
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("10.0",)), \
                mock.patch.object(gate, "ensure_verified", side_effect=AssertionError("no check expected")):
            choice = _decode(8, implementation=None)
            self.assertEqual(choice.variants, ())
            self.assertIn("no kernel for compute capability 10.0 (kernels exist for sm_90a)", choice.reason)

    def test_the_tuning_table_overrides_the_threshold(self):
        """A measured decision for ("weight_stream", format) on the local GPU model decides for None: off on an
        H200, on (after the self-check) on a B200."""

        self.enterContext(mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": self.enterContext(
            tempfile.TemporaryDirectory()), tuning.IGNORE_ENV: ""}))
        tuning.store("NVIDIA H200", [tuning.Decision("weight_stream", "mxfp8_e4m3", tuning.DEFAULT)])
        tuning.store("NVIDIA B200", [tuning.Decision("weight_stream", "mxfp8_e4m3", tuning.KERNEL, max_m=64)])
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)), \
                mock.patch.object(dispatch, "local_gpu_model", return_value="NVIDIA H200"):
            self.assertEqual(_decode(8, implementation=None).variants, ())
            self.assertLen(_decode(8, implementation=None, fmt="mxfp4").variants, 1)  # no decision: arch.TABLE
        ok = lambda v, device=None: gate.Verdict(v.key, "NVIDIA B200", "x", True, "ok")
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("10.0",)), \
                mock.patch.object(dispatch, "local_gpu_model", return_value="NVIDIA B200"), \
                mock.patch.object(gate, "ensure_verified", side_effect=ok) as checked:
            self.assertEqual([v.arch for v in _decode(8, implementation=None).variants], ["sm_100a", "sm_90a"])
            self.assertEqual([c.args[0].key for c in checked.call_args_list],
                             ["weight_stream.sm_100a.e4m3.bf16.sf32.t32x16.c1x1"])

    def test_the_short_k_rule_caps_a_measured_threshold(self):
        """tune times the decode kernel at K = 7168 only: its largest M replaces arch.TABLE's decode_max_m, and below
        the short-K rule's K None still takes the kernel only up to the rule's M."""
        self.enterContext(mock.patch.dict(os.environ, {"JAX_BLOCKGEMM_CACHE_DIR": self.enterContext(
            tempfile.TemporaryDirectory()), tuning.IGNORE_ENV: ""}))
        short_k, short_m = arch.policy("sm_90a").decode_short_k["mxfp8_e4m3"]
        tuning.store("NVIDIA H200", [tuning.Decision("weight_stream", "mxfp8_e4m3", tuning.KERNEL, max_m=48)])
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)), \
                mock.patch.object(dispatch, "local_gpu_model", return_value="NVIDIA H200"):
            self.assertEqual([v.arch for v in _decode(48, implementation=None, k=short_k).variants], ["sm_90a"])
            self.assertRegex(_decode(49, implementation=None, k=short_k).reason,
                             "implementation=None takes the reference")
            self.assertEqual([v.arch for v in _decode(short_m, implementation=None, k=96).variants], ["sm_90a"])
            self.assertRegex(_decode(short_m + 1, implementation=None, k=96).reason,
                             "implementation=None takes the reference")

    def test_a_failed_self_check_leaves_the_decode_kernel(self):

        failed = lambda v, device=None: gate.Verdict(v.key, "NVIDIA B200", "x", False, "C differs")
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("10.0",)), \
                mock.patch.object(gate, "ensure_verified", side_effect=failed):
            self.assertRegex(_decode(8).reason, "first-use self-check failed: weight_stream.sm_100a.*C differs")

    def test_each_local_gpu_model_checks_the_kernel(self):
        """A host with two GPU models of one architecture: the kernel is checked on each (it was checked on the
        first only, and the other ran it without a verdict of its own), and a failure on either leaves it."""

        models = [types.SimpleNamespace(device_kind="NVIDIA B200"), types.SimpleNamespace(device_kind="NVIDIA B300")]
        seen = []

        def verdict(v, device):
            seen.append(device.device_kind)
            return gate.Verdict(v.key, device.device_kind, "x", device.device_kind == "NVIDIA B200", "C differs")

        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("10.0", "10.0")), \
                mock.patch.object(gate, "local_models", return_value=models), \
                mock.patch.object(gate, "ensure_verified", side_effect=verdict):
            self.assertRegex(_decode(8).reason, "self-check failed: weight_stream.sm_100a.* on NVIDIA B300: C differs")
        self.assertEqual(seen, ["NVIDIA B200", "NVIDIA B300"])

    def test_forced_variants(self):
        """The self-check's forced variants: a weight_stream one is what a decode-sized 'cutedsl' call runs; a
        gemm_amax one leaves the decode path empty (the gemm_amax path then runs it)."""
        from jax_blockgemm.kernels import catalog

        ws = catalog.select_variant(op="weight_stream", arch="sm_90a", ab_dtype="float8_e4m3fn", c_dtype="float32",
                                    sf_vec_size=32, tile_mn=(32, 64), cluster_mn=(1, 1))
        gemm = catalog.select_variant(arch="sm_90a", ab_dtype="float8_e4m3fn", c_dtype="float32", sf_vec_size=32,
                                      tile_mn=(128, 128), cluster_mn=(1, 1))
        with dispatch.forced_variants([ws, gemm]):
            self.assertEqual(_decode(40, c_dtype=jnp.float32).variants, (ws,))
        with dispatch.forced_variants([gemm]):
            self.assertEqual(_decode(40, c_dtype=jnp.float32).variants, ())
            self.assertEqual(_decode(40, fmt="mxfp4", c_dtype=jnp.float32, implementation=None,
                                     k=7168).variants[0].op, "weight_stream")  # MXFP4's threshold (arch.TABLE)
            # at K = 7168 is past 40 rows

    def test_weight_only_choice(self):
        sa = jax.core.ShapedArray
        avals = [sa((1, 3, 64), jnp.bfloat16), sa((1, 48, 32), jnp.uint8), sa((1, 48, 4), jnp.float8_e4m3fn),
                 sa((1,), jnp.float32)]
        choice = dispatch.weight_only_kernels(avals, fmt="nvfp4", out_dtype=np.dtype(jnp.float32),
                                              implementation="cutedsl")
        self.assertEqual([v.key for v in choice.variants], ["weight_stream.sm_100a.e2m1.f32.sf16e4m3.t32x16.c1x1",
                                                            "weight_stream.sm_90a.e2m1.f32.sf16e4m3.t32x16.c1x1"])
        f32 = dispatch.weight_only_kernels([sa((1, 3, 64), jnp.float32), *avals[1:]], fmt="nvfp4",
                                           out_dtype=np.dtype(jnp.float32), implementation="cutedsl")
        self.assertEqual(f32.variants, ())
        self.assertIn("x is float32: the decode kernel takes bfloat16 activations", f32.reason)
        huge = [sa((1, 1, 32768), jnp.bfloat16), sa((1, 131072, 16384), jnp.uint8), sa((1, 131072, 2048),
                                                                                       jnp.float8_e4m3fn), avals[3]]
        self.assertRegex(dispatch.weight_only_kernels(huge, fmt="nvfp4", out_dtype=np.dtype(jnp.float32),
                                                      implementation="cutedsl").reason,
                         r"w \(1, 131072, 16384\) holds 2147483648 elements, past the kernels' 32-bit indexing")

    def test_an_unbuildable_decode_kernel_leaves_the_other_paths(self):
        """Where the decode kernel's module cannot be imported (not written yet, or a DSL piece missing), dispatch
        says so and the gemm_amax lowering takes its large-GEMM kernel."""
        from jax_blockgemm.kernels import catalog

        def missing(v):
            raise ImportError("No module named 'jax_blockgemm.kernels.weight_stream'")

        with mock.patch.dict(catalog._FACTORIES, {("weight_stream", a): missing for a in ("sm_90a", "sm_100a")}):
            self.assertRegex(_decode(8).reason, "no kernel can be built here: sm_100a: No module named")
            sd = jax.ShapeDtypeStruct
            from jax_blockgemm import kernel_cache
            with mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: v.key.encode()):
                f = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl"))
                text = f.trace(sd((8, 64), jnp.float8_e4m3fn), sd((48, 64), jnp.float8_e4m3fn), sd((8, 2), jnp.uint8),
                               sd((48, 2), jnp.uint8)).lower(lowering_platforms=("cuda",)).as_text()
            self.assertIn("custom_call @jbg_gemm_amax", text)
            self.assertNotIn("jbg_weight_stream", text)


class DecodeSwapAbDispatchTest(parameterized.TestCase):
    """Decode-sized MXFP8 E4M3 calls of arch.TABLE's decode_swap_ab_m rows take the swap_ab ragged kernel's decode
    tile where every local GPU has one; every other call keeps the decode kernel's rules."""

    def setUp(self):
        super().setUp()
        try:
            from jax_blockgemm.kernels import catalog  # noqa: F401
        except ImportError as e:
            self.skipTest(f"CuTeDSL is not importable: {e}")
        self.enterContext(decode_standin.stand_in_kernels())
        # the tiles' first-use self-checks pass (the swap_ab schedule may be listed as unverified)
        self.enterContext(mock.patch.object(dispatch, "_failed_self_checks", return_value=""))
        self.first, self.last = arch.policy("sm_90a").decode_swap_ab_m["mxfp8_e4m3"]

    def test_the_rows_of_the_range_on_an_h200(self):
        from jax_blockgemm.kernels import catalog

        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)):
            for implementation in (None, "cutedsl"):
                # the smallest tile that holds M; at most decode_swap_ab_small's rows against a weight that large
                # (2048 -> 7168 at M <= 16: the tile since it orders x itself, measured faster than the decode kernel)
                for m, n, k, tile in ((self.first, 7168, 4096, (16, 64, 3)), (16, 7168, 7168, (16, 64, 3)),
                                      (self.first, 7168, 2048, (16, 64, 3)), (16, 7168, 2048, (16, 64, 3)),
                                      (17, 144, 96, (32, 64, 3)), (32, 144, 7168, (32, 64, 3)),
                                      (33, 144, 7168, (64, 64, 2)), (self.last, 144, 7168, (64, 64, 2))):
                    with self.subTest(implementation=implementation, m=m, k=k):
                        (v,) = _decode(m, implementation=implementation, k=k, n=n).variants
                        self.assertEqual((v.op, v.arch, v.schedule, (*v.tile_mn, v.k_split), v.c_dtype),
                                         ("ragged", "sm_90a", catalog.SWAP_AB, tile, "bfloat16"))
                small_m, small_n, small_k = arch.policy("sm_90a").decode_swap_ab_small
                for n, k in ((small_n - 8, 7168), (7168, small_k - 32), (144, 96)):  # smaller: the decode kernel
                    with self.subTest(implementation=implementation, n=n, k=k):
                        self.assertEqual(_decode(small_m, implementation=implementation, k=k, n=n).variants[0].op,
                                         "weight_stream")
            with arch.overridden("9.0", decode_swap_ab_m={"mxfp8_e4m3": (17, 64)}):  # as a tuning table can set it
                self.assertEqual(_decode(16, k=7168, n=7168).variants[0].op, "weight_stream")
                self.assertEqual(_decode(17, k=7168).variants[0].op, "ragged")
            self.assertEqual(_decode(self.last + 1, k=7168).variants, ())  # past every decode kernel: M > 64
            self.assertEqual(_decode(40, k=7168, c_dtype=jnp.float32).variants[0].c_dtype, "float32")
            self.assertEqual(_decode(40, k=7168, c_dtype=jnp.float16).variants[0].op, "weight_stream")
            self.assertEqual(_decode(40, k=7168, fmt="mxfp8_e5m2").variants[0].op, "weight_stream")
            self.assertEqual(_decode(40, k=7168, fmt="mxfp4").variants[0].op, "ragged")  # FP4: the tile too

    def test_a_tile_that_failed_its_self_check_leaves_the_rows_to_the_decode_kernel(self):
        failed = lambda variants: "failed" if any(v.schedule == "swap_ab" for v in variants) else ""
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)), \
                mock.patch.object(dispatch, "_failed_self_checks", side_effect=failed):
            for implementation in (None, "cutedsl"):
                for m in (1, 16, 40, 64):
                    variants = _decode(m, k=7168, implementation=implementation).variants
                    self.assertEqual({v.op for v in variants}, {"weight_stream"}, (implementation, m))

    def test_elsewhere_the_decode_kernel(self):
        """No GPU seen (a program lowered here may run on any target), a B200, a machine with both, or a process that
        forces variants (the self-check): the decode kernel, whose objects cover every architecture."""
        self.assertEqual(_decode(40, k=7168).variants[0].op, "weight_stream")
        for capabilities in (("10.0",), ("9.0", "10.0")):
            with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=capabilities), \
                    mock.patch.object(dispatch, "_failed_self_checks", return_value=""):
                self.assertNotIn("ragged", [v.op for v in _decode(40, k=7168).variants])
        from jax_blockgemm.kernels import catalog

        ws = catalog.select_variant(op="weight_stream", arch="sm_90a", ab_dtype="float8_e4m3fn", c_dtype="bfloat16",
                                    sf_vec_size=32, tile_mn=(32, 64), cluster_mn=(1, 1))
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)), \
                dispatch.forced_variants([ws]):
            self.assertEqual(_decode(40, k=7168).variants, (ws,))

    def test_the_tile_refuses_more_tokens_than_it_holds(self):
        from jax_blockgemm.kernels import catalog

        for tokens, rows, split in catalog.SWAP_AB_DECODE_TILES:
            v = catalog.select_variant(op="ragged", arch="sm_90a", ab_dtype="float8_e4m3fn", c_dtype="float32",
                                       sf_vec_size=32, tile_mn=(tokens, rows), cluster_mn=(1, 1), k_split=split,
                                       schedule=catalog.SWAP_AB)
            kernel = catalog.make_kernel(v)
            self.assertEqual(kernel.can_implement(tokens, 160, 96, 1), (True, ""))
            fits, why = kernel.can_implement(tokens + 1, 160, 96, 1)
            self.assertFalse(fits)
            self.assertIn(f"t must be at most {tokens}", why)


class DecodeOperandTest(parameterized.TestCase):
    """The decode path's x: gemm_amax's A with its atom scales as bf16, exactly the values the reference multiplies
    (checked against the float32 dequantization of the compact scales, on the CPU)."""

    @parameterized.product(fmt=("mxfp8_e4m3", "mxfp4", "nvfp4"), a_major=("k", "m"))
    def test_a_is_dequantized_exactly(self, fmt, a_major):
        rng = np.random.default_rng(3)
        m, k = 7, 96
        block = formats.FORMATS[fmt].block
        a = rng.standard_normal((m, k)).astype(np.float32)
        if fmt == "nvfp4":
            codes, scales = formats.quantize_nvfp4(jnp.asarray(a), axis=-1)
        elif fmt == "mxfp4":
            codes, scales = formats.quantize_mxfp4(jnp.asarray(a), axis=-1)
        else:
            codes, scales = formats.quantize_mxfp8(jnp.asarray(a), axis=-1)
        atom = formats.to_scale_atom(scales[None])
        if a_major == "m" and fmt != "mxfp8_e4m3":
            self.skipTest("FP4 operands are K-major only (gemm_amax refuses an M-major FP4 A)")
        a_codes = codes[None] if a_major == "k" else jnp.swapaxes(codes[None], 1, 2)  # (1, K, M)
        (x,) = primitives._dequantized_a(a_codes, atom, m=m, k=k, sf_vec_size=block, a_major=a_major)
        unpacked = formats.unpack_fp4(codes)[..., :k] if np.dtype(codes.dtype) == np.uint8 else codes
        want = formats.dequantize(unpacked, scales, block=block, axis=-1)  # float32
        self.assertEqual(x.dtype, jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(x[0], np.float32), np.asarray(want, np.float32))


class DecodeResultTest(parameterized.TestCase):
    """The decode path's C: the kernel's (L, M, N) in `dispatch.decode_c_dtype`, finished by `primitives.decode_c`,
    holds the same bytes the reference returns from the same float32 sums (on the CPU)."""

    @parameterized.parameters("mxfp8_e4m3", "mxfp4")
    def test_an_m_major_c_is_transposed_even_when_m_equals_n(self, fmt):
        """C^T (L, N, M) has the kernel's (L, M, N) shape and dtype when M = N: the lowering must still transpose
        (it returned the kernel's C as it was, which the H200 caught: every M-major decode call with M = N wrong)."""
        a, b, sfa, sfb = _abstract(1, 32, 32, 256, ab=jnp.float8_e4m3fn if fmt == "mxfp8_e4m3" else jnp.uint8)
        if fmt == "mxfp4":
            a, b = (jax.ShapeDtypeStruct((*x.shape[:2], 128), jnp.uint8) for x in (a, b))
        atoms = [jax.ShapeDtypeStruct((1, 1, 2, 32, 4, 4), jnp.uint8)] * 2  # one 128-row atom, 8 blocks of K
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)), \
                mock.patch.object(gate, "ensure_verified",
                                  side_effect=lambda v, device=None: gate.Verdict(v.key, "H200", "x", True, "ok")):
            text = _lower_for_cuda((a, b, *atoms), c_dtype=jnp.float32, c_major="m", implementation="cutedsl")
        (result,) = re.findall(r"(%\w+):2 = stablehlo.custom_call @jbg_(?:weight_stream|ragged_gemm_amax)", text)
        (transposed,) = re.findall(rf"(%\w+) = stablehlo.transpose {result}#0, dims = \[0, 2, 1\]", text)
        self.assertRegex(text, rf"return {transposed}, ")

    @parameterized.parameters((jnp.float8_e4m3fn, "n"), (jnp.float8_e5m2, "n"), (jnp.float4_e2m1fn, "n"),
                              (jnp.bfloat16, "m"), (jnp.float16, "m"), (jnp.float32, "m"))
    def test_finished_c_is_the_references(self, c_dtype, c_major):
        rng = np.random.default_rng(5)
        magnitudes = rng.choice([1e-3, 1.0, 300.0, 1e5], size=(2, 5, 64))
        sums = (rng.standard_normal((2, 5, 64)) * magnitudes).astype(np.float32)  # (L, M, N), past E4M3's range too
        sums[0, 1, 3], sums[1, 4, 60] = np.nan, -np.inf
        c_dtype = np.dtype(c_dtype)
        kernel_c = jnp.asarray(sums).astype(dispatch.decode_c_dtype(c_dtype))  # what the kernel stores
        (c,) = primitives.decode_c(kernel_c, c_dtype=c_dtype, c_major=c_major)
        want = reference.convert_c(jnp.asarray(sums if c_major == "n" else np.swapaxes(sums, 1, 2)), c_dtype)
        self.assertEqual((c.shape, c.dtype), (want.shape, want.dtype))
        self.assertEqual(np.asarray(c).tobytes(), np.asarray(want).tobytes())


if __name__ == "__main__":
    absltest.main()
