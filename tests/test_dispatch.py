"""Which implementation a CUDA lowering picks: kernel, reference, or a clear error (no GPU needed)."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg
from jax_blockgemm import dispatch

import oracle


def _operands(m=256, n=128, k=128):
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32).astype(jnp.float8_e4m3fn)
    b = jnp.asarray(rng.standard_normal((n, k)), jnp.float32).astype(jnp.float8_e4m3fn)
    sfa = jnp.asarray(oracle.random_scale_bytes(rng, (m, k // 32)))
    sfb = jnp.asarray(oracle.random_scale_bytes(rng, (n, k // 32)))
    return a, b, sfa, sfb


_GEMM90, _ROPE90 = ("gemm_amax", "sm_90a"), ("proj_rope", "sm_90a")


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
        with mock.patch.dict(dispatch.DEFAULT_TAKES_KERNEL, {_GEMM90: False}):
            self.assertNotIn("jbg_gemm_amax", _cuda_text())
        with mock.patch.dict(dispatch.DEFAULT_TAKES_KERNEL, {_GEMM90: True}):
            self.assertIn("jbg_gemm_amax", _cuda_text())

    def test_gpu_without_kernel(self):
        """On an sm_80 machine, None falls back to the reference and 'cutedsl' says why it cannot run."""
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("8.0",)), \
                mock.patch.dict(dispatch.DEFAULT_TAKES_KERNEL, {_GEMM90: True}):
            self.assertNotIn("jbg_gemm_amax", _cuda_text())
            with self.assertRaisesRegex(ValueError,
                                        "no kernel for compute capability 8.0 .kernels exist for sm_100a, sm_90a"):
                _cuda_text(implementation="cutedsl")

    @parameterized.parameters(
        (dict(c_major="m"), "kernels take K-major A and B and N-major C"),
        (dict(c_dtype=jnp.float16), "no kernel in the catalog for float8_e4m3fn operands, float16 C"),
    )
    def test_cutedsl_without_kernel_raises(self, kwargs, reason):
        with self.assertRaisesRegex(ValueError, "implementation='cutedsl': no CuTeDSL kernel applies.*" + reason):
            _cuda_text(implementation="cutedsl", **kwargs)

    def test_fp4_kernels_are_compiled_but_never_selected(self):
        """The sm_100a FP4 variants exist in the catalog, but the handler takes FP8 codes only: no FP4 call gets one."""
        from jax_blockgemm.kernels import catalog

        self.assertTrue(any(v.ab_dtype == "float4_e2m1fn" for v in catalog.CATALOG))
        rng = np.random.default_rng(1)
        a, sfa = jbg.formats.quantize_mxfp4(jnp.asarray(rng.standard_normal((256, 128)), jnp.float32))
        b, sfb = jbg.formats.quantize_mxfp4(jnp.asarray(rng.standard_normal((128, 128)), jnp.float32))
        f = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation="cutedsl"))
        with self.assertRaisesRegex(ValueError, "no kernel in the catalog for uint8 operands"):
            f.trace(a, b, sfa, sfb).lower(lowering_platforms=("cuda",))

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
        self.assertIn("_t64x192_c1x1" + ("" if w_out_in else "_bn"), text)  # the layout's own object
        with mock.patch.dict(dispatch.PROJ_ROPE_TILE, {"sm_90a": (128, 192)}):
            self.assertIn("_t128x192_c1x1", _proj_rope_text(w_out_in=w_out_in, implementation="cutedsl"))

    def test_xla_never_does(self):
        self.assertNotIn("jbg_gemm_proj_rope_mxfp8", _proj_rope_text(implementation="xla"))

    @parameterized.parameters(True, False)
    def test_cutedsl_carries_the_sm100a_object_too(self, w_out_in):
        text = _proj_rope_text(w_out_in=w_out_in, implementation="cutedsl")
        self.assertIn('archs = "sm_100a,sm_90a"', text)
        self.assertIn("jbg_proj_rope_sm_100a_bf16_e4m3_sf32_t128x192_c1x1" + ("" if w_out_in else "_bn"), text)

    def test_default_never_takes_the_never_run_sm100a_kernel(self):
        """Never run, never measured: None takes the reference on a Blackwell machine, without a self-check."""
        from jax_blockgemm import selfcheck

        self.assertEqual(dispatch.PROJ_ROPE_TILE["sm_100a"], (128, 192))
        self.assertFalse(dispatch.DEFAULT_TAKES_KERNEL[("proj_rope", "sm_100a")])
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("10.0",)), \
                mock.patch.object(selfcheck, "ensure_verified", side_effect=AssertionError("no check expected")):
            self.assertNotIn("jbg_gemm_proj_rope_mxfp8", _proj_rope_text())

    def test_default_follows_the_measured_preference(self):
        with mock.patch.dict(dispatch.DEFAULT_TAKES_KERNEL, {_ROPE90: False}):
            self.assertNotIn("jbg_gemm_proj_rope_mxfp8", _proj_rope_text())
        with mock.patch.dict(dispatch.DEFAULT_TAKES_KERNEL, {_ROPE90: True}):
            self.assertIn("jbg_gemm_proj_rope_mxfp8", _proj_rope_text())

    @parameterized.parameters(True, False)
    def test_mxfp8_inputs_are_dequantized_for_the_kernel(self, w_out_in):
        text = _proj_rope_text(mxfp8=True, w_out_in=w_out_in, implementation="cutedsl")
        call = [line for line in text.splitlines() if "stablehlo.custom_call @jbg_gemm_proj_rope_mxfp8" in line]
        self.assertLen(call, 1)
        self.assertIn("bf16>, tensor<1x", call[0].split("->")[0].split(":")[-1])  # bf16 operands reach the kernel
        self.assertIn("stablehlo.multiply", text)  # codes x scales, in XLA

    def test_vmap_over_weights_takes_the_reference(self):
        x = jnp.zeros((64, 128), jnp.bfloat16)
        w = jnp.zeros((3, 192, 128), jnp.bfloat16)
        cs = jnp.zeros((64, 64), jnp.bfloat16)
        f = jax.jit(jax.vmap(lambda w: jbg.gemm_proj_rope_mxfp8(x, w, cs, cs, implementation="cutedsl")))
        with self.assertRaisesRegex(ValueError, "one weight matrix per call; got 3"):
            f.trace(w).lower(lowering_platforms=("cuda",))
        with mock.patch.dict(dispatch.DEFAULT_TAKES_KERNEL, {_ROPE90: True}):
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
        self.enterContext(mock.patch.dict(dispatch.DEFAULT_TAKES_KERNEL, {("gemm_amax", "sm_90a"): True}))
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

if __name__ == "__main__":
    absltest.main()
