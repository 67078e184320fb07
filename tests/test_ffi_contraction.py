"""The jbg_grouped_contraction bridge on a CPU machine: the handler's attribute parsing and buffer checks
(ffi/contraction.cc, through the module's test hooks), its registration with XLA, and emit_contraction's custom call
lowered for CUDA."""

import dataclasses
import textwrap
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.extend import core as jex_core
from jax.interpreters import mlir

from jax_blockgemm import _native, ffi_lowering, kernel_cache

import lowered_calls
import xla_probe

ext = _native.extension()

U8, I32, F32, BF16, F16, E4M3 = "uint8", "int32", "float32", "bfloat16", "float16", "float8_e4m3fn"
FP4 = "float4_e2m1fn"
# XLA FFI dtype codes (xla/ffi/api/c_api.h).
CODE = {U8: 6, I32: 4, F32: 11, BF16: 16, F16: 10, E4M3: 20}
TARGET = "jbg_grouped_contraction"


def _buffers(l, t, k, n, g, *, c=F32, base=1 << 20):
    """Well-formed (dtype, dims, address) for x, y, bounds, c, amax; addresses 4096 apart."""
    dims = [[l, t, k], [l, t, n], [l, g, 2], [l, g, k, n], [l]]
    dtypes = [BF16, BF16, I32, c, F32]
    return [(d, s, base + 4096 * i) for i, (d, s) in enumerate(zip(dtypes, dims))]


def _replace(buffers, index, *, dtype=None, dims=None, address=None):
    out = list(buffers)
    d, s, p = out[index]
    out[index] = (dtype or d, s if dims is None else dims, p if address is None else address)
    return out


class ContractionAttributesTest(parameterized.TestCase):
    """The instantiate stage's attribute parsing: bfloat16 operands, a float32 or bfloat16 C."""

    @parameterized.parameters((F32,), (BF16,))
    def test_attributes_map_to_buffer_dtypes(self, c):
        self.assertEqual(ext.parse_contraction_attributes(BF16, c), (CODE[BF16], CODE[c]))

    @parameterized.parameters(
        ((F16, F32), 'ab_dtype "float16" is not supported; expected bfloat16$'),
        ((E4M3, F32), 'ab_dtype "float8_e4m3fn" is not supported; expected bfloat16$'),
        ((FP4, BF16), 'ab_dtype "float4_e2m1fn" is not supported; expected bfloat16$'),
        (("", F32), 'ab_dtype "" is not supported; expected bfloat16$'),
        (("bf16", F32), 'ab_dtype "bf16" is not supported; expected bfloat16$'),
        ((BF16, F16), 'c_dtype "float16" is not supported; expected float32 or bfloat16$'),
        ((BF16, E4M3), 'c_dtype "float8_e4m3fn" is not supported; expected float32 or bfloat16$'),
        ((BF16, FP4), 'c_dtype "float4_e2m1fn" is not supported; expected float32 or bfloat16$'),
        ((BF16, I32), 'c_dtype "int32" is not supported; expected float32 or bfloat16$'),
        ((BF16, ""), 'c_dtype "" is not supported; expected float32 or bfloat16$'),
        ((F16, F16), 'ab_dtype "float16" is not supported'))  # the operands are named first
    def test_attributes_are_refused_by_name(self, args, message):
        with self.assertRaisesRegex(ValueError, "^jbg_grouped_contraction attributes: " + message):
            ext.parse_contraction_attributes(*args)


class ContractionBufferCheckTest(parameterized.TestCase):
    """The execute stage's buffer checks (ffi/contraction.cc), through the test hook."""

    @parameterized.product(dims=[(1, 1, 8, 8, 1), (2, 200, 160, 72, 3), (3, 129, 4104, 256, 8),
                                 (1, 4096, 7168, 2048, 160)], c=[F32, BF16])
    def test_well_formed(self, dims, c):
        """The dims are (t, k, n, l, g): G from bounds."""
        l, t, k, n, g = dims
        self.assertEqual(ext.check_contraction_buffers(_buffers(l, t, k, n, g, c=c), BF16, c), ("", (t, k, n, l, g)))

    @parameterized.parameters(F32, BF16)
    def test_c_past_int32_elements_is_taken(self, c):
        """c as a whole may hold 2**31 elements or more (the kernel addresses it in 64 bits) when one (K, N) slice
        fits: 160 groups of 2048 x 7168."""
        buffers = _buffers(1, 512, 2048, 7168, 160, c=c)
        self.assertGreaterEqual(np.prod(buffers[3][1]), 2**31)
        self.assertEqual(ext.check_contraction_buffers(buffers, BF16, c), ("", (512, 2048, 7168, 1, 160)))
        many = _buffers(4, 128, 1024, 1024, 1024, c=c)  # 2**32 elements over L*G = 4096 slices
        self.assertEqual(ext.check_contraction_buffers(many, BF16, c), ("", (128, 1024, 1024, 4, 1024)))

    def test_each_violation_is_named(self):
        good = _buffers(2, 200, 160, 72, 3)
        bf16_c = _buffers(2, 200, 160, 72, 3, c=BF16)
        cases = [
            (good, _replace(good, 0, dtype=F16), r"x is float16 \(2, 200, 160\); the kernel objects were compiled "
                                                 r"for bfloat16 operands$"),
            (good, _replace(good, 0, dtype=E4M3), r"x is float8_e4m3fn .*compiled for bfloat16 operands"),
            (good, _replace(good, 0, dims=[200, 160]), r"x is bfloat16 \(200, 160\); expected rank 3 \(L, T, K\)$"),
            (good, _replace(good, 0, dims=[1, 2, 200, 160]), r"x is .*expected rank 3 \(L, T, K\)"),
            (good, _replace(good, 0, dims=[2, 0, 160]), r"x is bfloat16 \(2, 0, 160\); expected every dimension "
                                                        r">= 1$"),
            (good, _replace(good, 0, dims=[0, 200, 160]), r"x is .*expected every dimension >= 1"),
            (good, _replace(good, 0, dims=[2, 200, 0]), r"x is .*expected every dimension >= 1"),
            (good, _replace(good, 0, dims=[2, 200, 164]), r"x is bfloat16 \(2, 200, 164\); expected K a multiple of "
                                                          r"8 \(16-byte rows of bfloat16\)$"),
            (good, _replace(good, 1, dtype=F32), r"y is float32 \(2, 200, 72\); the kernel objects were compiled "
                                                 r"for bfloat16 operands$"),
            (good, _replace(good, 1, dims=[2, 199, 72]), r"y is bfloat16 \(2, 199, 72\); expected \(L, T, N\) = "
                                                         r"\(2, 200, N >= 1\) for x's L and T$"),
            (good, _replace(good, 1, dims=[1, 200, 72]), r"y is .*expected \(L, T, N\) = \(2, 200, N >= 1\)"),
            (good, _replace(good, 1, dims=[400, 72]), r"y is bfloat16 \(400, 72\); expected \(L, T, N\)"),
            (good, _replace(good, 1, dims=[2, 200, 0]), r"y is .*expected \(L, T, N\) = \(2, 200, N >= 1\)"),
            (good, _replace(good, 1, dims=[2, 200, 76]), r"y is bfloat16 \(2, 200, 76\); expected N a multiple of 8 "
                                                         r"\(16-byte rows of bfloat16\)$"),
            (good, _replace(good, 2, dtype=F32), r"bounds is float32 \(2, 3, 2\); expected int32 group bounds$"),
            (good, _replace(good, 2, dtype=U8), r"bounds is uint8 .*expected int32 group bounds"),
            (good, _replace(good, 2, dims=[2, 3]), r"bounds is int32 \(2, 3\); expected \(L, G, 2\) = \(2, G >= 1, "
                                                   r"2\): the rows \[start, end\) of each group$"),
            (good, _replace(good, 2, dims=[2, 3, 3]), r"bounds is int32 \(2, 3, 3\); expected \(L, G, 2\)"),
            (good, _replace(good, 2, dims=[1, 3, 2]), r"bounds is int32 \(1, 3, 2\); expected \(L, G, 2\)"),
            (good, _replace(good, 2, dims=[2, 0, 2]), r"bounds is int32 \(2, 0, 2\); expected \(L, G, 2\)"),
            (good, _replace(good, 3, dtype=BF16), r"c is bfloat16 \(2, 3, 160, 72\); the kernel objects were "
                                                  r"compiled for a float32 C$"),
            (good, _replace(good, 3, dtype=F16), r"c is float16 .*compiled for a float32 C"),
            (bf16_c, _replace(bf16_c, 3, dtype=F32), r"c is float32 .*compiled for a bfloat16 C"),
            (good, _replace(good, 3, dims=[2, 3, 72, 160]), r"c is float32 \(2, 3, 72, 160\); expected \(2, 3, 160, "
                                                            r"72\) \(L, G, K, N\)$"),
            (good, _replace(good, 3, dims=[6, 160, 72]), r"c is .*expected \(2, 3, 160, 72\) \(L, G, K, N\)"),
            (good, _replace(good, 3, dims=[2, 2, 160, 72]), r"c is .*expected \(2, 3, 160, 72\)"),
            (good, _replace(good, 3, dims=[2, 200, 72]), r"c is float32 \(2, 200, 72\); expected \(2, 3, 160, 72\)"),
            (good, _replace(good, 4, dims=[1]), r"amax is float32 \(1,\); expected float32 \(2,\) \(L,\)$"),
            (good, _replace(good, 4, dims=[2, 1]), r"amax is float32 \(2, 1\); expected float32 \(2,\)"),
            (good, _replace(good, 4, dtype=BF16), r"amax is bfloat16 \(2,\); expected float32 \(2,\)"),
            (good, _replace(good, 0, address=0), r"x is .* at address 0; expected a 16-byte aligned pointer$"),
            (good, _replace(good, 1, address=(1 << 20) + 4096 + 2), r"y is .* at address \d+; expected a 16-byte "
                                                                    r"aligned pointer"),
            (good, _replace(good, 2, address=(1 << 20) + 2 * 4096 + 8), r"bounds is .* at address .*16-byte "
                                                                        r"aligned"),
            (good, _replace(good, 3, address=(1 << 20) + 3 * 4096 + 4), r"c is .* at address .*16-byte aligned"),
            (good, _replace(good, 3, address=0), r"c is .* at address 0; expected a 16-byte aligned pointer"),
            (good, _replace(good, 4, address=0), r"amax is .* at address 0; expected a 16-byte aligned pointer"),
        ]
        self.assertEqual(ext.check_contraction_buffers(good, BF16, F32)[0], "")
        self.assertEqual(ext.check_contraction_buffers(bf16_c, BF16, BF16)[0], "")
        for base, buffers, message in cases:
            with self.subTest(message=message):
                got, dims = ext.check_contraction_buffers(buffers, BF16, BF16 if base is bf16_c else F32)
                self.assertRegex(got, "^jbg_grouped_contraction: " + message)
                self.assertEqual(dims, (0, 0, 0, 0, 0))  # nothing to launch with

    def test_n_and_k_need_no_other_multiple(self):
        """16-byte rows are all the handler asks of K and N: no multiple of the tile."""
        self.assertEqual(ext.check_contraction_buffers(_buffers(1, 3, 24, 40, 5), BF16, F32), ("", (3, 24, 40, 1, 5)))

    def test_element_counts_fit_int32(self):
        """x, y and bounds of 2**31 elements are refused even though every dimension fits an int32, and so are c's
        (K, N) slices of 2**31 elements and L·G slices of 2**31 or more."""
        big_x = _buffers(1, 1 << 16, 1 << 15, 8, 1)
        self.assertRegex(ext.check_contraction_buffers(big_x, BF16, F32)[0],
                         r"^jbg_grouped_contraction: x is bfloat16 \(1, 65536, 32768\); expected fewer than 2\*\*31 "
                         r"elements$")
        big_y = _buffers(1, 1 << 16, 8, 1 << 15, 1)
        self.assertRegex(ext.check_contraction_buffers(big_y, BF16, F32)[0],
                         r"^jbg_grouped_contraction: y is bfloat16 \(1, 65536, 32768\); expected fewer than 2\*\*31 "
                         r"elements$")
        big_slice = _buffers(1, 1, 1 << 16, 1 << 15, 1)
        self.assertRegex(ext.check_contraction_buffers(big_slice, BF16, F32)[0],
                         r"^jbg_grouped_contraction: c is float32 \(1, 1, 65536, 32768\); expected one \(K, N\) slice "
                         r"of fewer than 2\*\*31 elements$")
        just_fits = _buffers(1, 1, 1 << 16, (1 << 15) - 8, 2)
        self.assertEqual(ext.check_contraction_buffers(just_fits, BF16, F32)[0], "")
        many = _buffers(2, 1, 8, 8, 1 << 30)
        self.assertRegex(ext.check_contraction_buffers(many, BF16, F32)[0],
                         r"^jbg_grouped_contraction: c is float32 \(2, 1073741824, 8, 8\); expected L\*G below "
                         r"2\*\*31$")
        big_bounds = _buffers(1, 1, 8, 8, 1 << 30)  # L*G = 2**30 slices fit; bounds' 2**31 elements do not
        self.assertRegex(ext.check_contraction_buffers(big_bounds, BF16, F32)[0],
                         r"^jbg_grouped_contraction: bounds is int32 \(1, 1073741824, 2\); expected fewer than "
                         r"2\*\*31 elements$")

    def test_hook_takes_five_buffers(self):
        with self.assertRaisesRegex(ValueError, "expected 5 buffers: x, y, bounds, c, amax"):
            ext.check_contraction_buffers(_buffers(1, 1, 8, 8, 1)[:4], BF16, F32)
        with self.assertRaisesRegex(ValueError, 'jbg_grouped_contraction attributes: c_dtype "int32"'):
            ext.check_contraction_buffers(_buffers(1, 1, 8, 8, 1), BF16, I32)
        with self.assertRaisesRegex(ValueError, 'jbg_grouped_contraction attributes: ab_dtype "float16"'):
            ext.check_contraction_buffers(_buffers(1, 1, 8, 8, 1), F16, F32)


class ContractionModuleTest(absltest.TestCase):

    def test_target_is_registered_under_one_name(self):
        self.assertEqual(ext.CONTRACTION_TARGET, TARGET)
        self.assertEqual(_native.CONTRACTION_TARGET, ext.CONTRACTION_TARGET)
        self.assertEqual(ffi_lowering.CONTRACTION_TARGET, ext.CONTRACTION_TARGET)
        self.assertEqual(set(ext.ffi_targets()[TARGET]), {"instantiate", "execute"})
        self.assertIn(jax.export.DisabledSafetyCheck.custom_call(TARGET), ffi_lowering.export_disabled_checks())

    def test_execute_handler_is_command_buffer_compatible(self):
        _, _, traits = ext.handler_metadata(TARGET, "execute")
        self.assertEqual(traits & ext.TRAIT_COMMAND_BUFFER_COMPATIBLE, ext.TRAIT_COMMAND_BUFFER_COMPATIBLE)


# ----------------------------------------------------------------------------------------------------------------
# emit_contraction lowered for CUDA without a GPU


@dataclasses.dataclass(frozen=True)
class StandInContractionVariant:
    """The fields of a catalog.KernelVariant that the lowering reads."""
    arch: str
    op: str = "contraction"
    ab_dtype: str = BF16
    c_dtype: str = F32

    @property
    def key(self):
        return f"standin.{self.op}.{self.arch}"

    @property
    def function_prefix(self):
        return f"jbg_standin_{self.op}_{self.arch}"


# A tiny primitive whose CUDA lowering is emit_contraction; abstract eval gives c (L, G, K, N) (or c_shape) and amax.
_contraction_test_p = jex_core.Primitive("jbg_test_contraction")
_contraction_test_p.multiple_results = True


@_contraction_test_p.def_abstract_eval
def _abstract_eval(x, y, bounds, *, variants, c_dtype, c_shape):
    if c_shape is None:  # whatever the operands' ranks: emit_contraction is the one to refuse them
        c_shape = (x.shape[0], bounds.shape[1] if bounds.ndim > 1 else 1, x.shape[-1], y.shape[-1])
    return jax.core.ShapedArray(c_shape, c_dtype), jax.core.ShapedArray((x.shape[0],), jnp.float32)


mlir.register_lowering(_contraction_test_p, lambda ctx, *ops, variants, c_dtype, c_shape: (
    ffi_lowering.emit_contraction(ctx, *ops, variants=variants)), platform="cuda")

_NAMES = ("archs", "function_prefixes", "objects", "offsets", "ab_dtype", "c_dtype")


def _operands(l=2, t=200, k=160, n=72, g=3):
    sd = jax.ShapeDtypeStruct
    return sd((l, t, k), jnp.bfloat16), sd((l, t, n), jnp.bfloat16), sd((l, g, 2), jnp.int32)


def _function(variants, c_dtype, c_shape=None):
    return jax.jit(lambda *x: _contraction_test_p.bind(*x, variants=tuple(variants), c_dtype=np.dtype(c_dtype),
                                                       c_shape=c_shape))


def _lower(operands, variants, c_dtype=jnp.float32, c_shape=None):
    with mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: v.key.encode()):
        return _function(variants, c_dtype, c_shape).trace(*operands).lower(lowering_platforms=("cuda",))


def _custom_call(lowered, target=TARGET):
    """(attributes, operand types, result types) of the one `target` custom call in `lowered`."""
    return lowered_calls.custom_call(lowered, target, _NAMES)


class EmitContractionTest(absltest.TestCase):
    """emit_contraction: the custom call, its attributes and the contract it refuses to break."""

    def test_custom_call_carries_the_objects_and_what_they_were_compiled_for(self):
        variants = (StandInContractionVariant("sm_90a"), StandInContractionVariant("sm_100a"))
        lowered = _lower(_operands(), variants)
        text = lowered.as_text(dialect="hlo")
        self.assertRegex(text, r'custom_call_target="jbg_grouped_contraction".*api_version=API_VERSION_TYPED_FFI')
        attrs, operands, results = _custom_call(lowered)
        self.assertEqual(attrs["archs"], "sm_100a,sm_90a")  # sorted by arch
        self.assertEqual(attrs["function_prefixes"], "jbg_standin_contraction_sm_100a,jbg_standin_contraction_sm_90a")
        self.assertEqual(attrs["objects"].tobytes(), b"standin.contraction.sm_100astandin.contraction.sm_90a")
        np.testing.assert_array_equal(attrs["offsets"], [0, 27, 53])
        self.assertEqual((attrs["ab_dtype"], attrs["c_dtype"]), (BF16, F32))
        self.assertEqual(operands, ["tensor<2x200x160xbf16>", "tensor<2x200x72xbf16>", "tensor<2x3x2xi32>"])
        self.assertEqual(results, ["tensor<2x3x160x72xf32>", "tensor<2xf32>"])

    def test_bf16_c(self):
        variant = StandInContractionVariant("sm_90a", c_dtype=BF16)
        attrs, operands, results = _custom_call(_lower(_operands(l=1, t=7, k=8, n=16, g=5), [variant],
                                                       c_dtype=jnp.bfloat16))
        self.assertEqual((attrs["ab_dtype"], attrs["c_dtype"]), (BF16, BF16))
        self.assertEqual(operands, ["tensor<1x7x8xbf16>", "tensor<1x7x16xbf16>", "tensor<1x5x2xi32>"])
        self.assertEqual(results, ["tensor<1x5x8x16xbf16>", "tensor<1xf32>"])

    def test_catalog_variants(self):
        """The catalog's contraction entries (sm_90a, f32 and bf16 C) lower the same way (their keys name the
        objects)."""
        try:
            from jax_blockgemm.kernels import catalog
        except ImportError as e:
            self.skipTest(f"CuTeDSL is not importable: {e}")
        variants = catalog.variants_for("sm_90a", "contraction")
        self.assertEqual({v.c_dtype for v in variants}, {F32, BF16})
        for v in variants:
            with self.subTest(key=v.key):
                attrs, _, results = _custom_call(_lower(_operands(), [v], c_dtype=jnp.dtype(v.c_dtype)))
                self.assertEqual(attrs["archs"], "sm_90a")
                self.assertEqual(attrs["function_prefixes"], v.function_prefix)
                self.assertEqual(attrs["objects"].tobytes(), v.key.encode())
                self.assertEqual((attrs["ab_dtype"], attrs["c_dtype"]), (BF16, v.c_dtype))
                c_type = {F32: "f32", BF16: "bf16"}[v.c_dtype]
                self.assertEqual(results, [f"tensor<2x3x160x72x{c_type}>", "tensor<2xf32>"])

    def test_refuses_what_the_handler_would(self):
        ok = StandInContractionVariant("sm_90a")
        good = _operands()
        sd = jax.ShapeDtypeStruct

        def swap(i, aval):
            return good[:i] + (aval,) + good[i + 1:]

        cases = [
            (swap(0, sd((200, 160), jnp.bfloat16)), [ok], {}, r"x \(L, T, K\) bfloat16"),
            (swap(0, sd((2, 200, 160), jnp.float32)), [ok], {}, r"x \(L, T, K\) bfloat16"),
            (swap(0, sd((2, 0, 160), jnp.bfloat16)), [ok], dict(c_shape=(2, 3, 160, 72)), "every dimension >= 1"),
            (swap(1, sd((2, 199, 72), jnp.bfloat16)), [ok], {}, r"y \(L, T, N\) bfloat16 for x"),
            (swap(1, sd((1, 200, 72), jnp.bfloat16)), [ok], dict(c_shape=(2, 3, 160, 72)), r"y \(L, T, N\)"),
            (swap(1, sd((2, 200, 72), jnp.float16)), [ok], {}, r"y \(L, T, N\) bfloat16"),
            (swap(0, sd((2, 200, 164), jnp.bfloat16)), [ok], {}, r"K = 164 and N = 72 must be multiples of 8 "
                                                                 r"\(16-byte rows of bfloat16\)"),
            (swap(1, sd((2, 200, 76), jnp.bfloat16)), [ok], {}, "K = 160 and N = 76 must be multiples of 8"),
            (swap(2, sd((2, 3), jnp.int32)), [ok], dict(c_shape=(2, 3, 160, 72)), r"bounds \(2, G >= 1, 2\) int32"),
            (swap(2, sd((2, 3, 3), jnp.int32)), [ok], {}, r"bounds \(2, G >= 1, 2\) int32"),
            (swap(2, sd((1, 3, 2), jnp.int32)), [ok], {}, r"bounds \(2, G >= 1, 2\) int32"),
            (swap(2, sd((2, 3, 2), jnp.uint32)), [ok], {}, r"bounds \(2, G >= 1, 2\) int32"),
            (good, [ok], dict(c_dtype=jnp.float16), "c float32 or bfloat16"),
            (good, [ok], dict(c_shape=(2, 3, 72, 160)), r"results c \(2, 3, 160, 72\) and amax \(2,\) float32"),
            (good, [ok], dict(c_shape=(2, 200, 72)), r"results c \(2, 3, 160, 72\)"),
            (good, [StandInContractionVariant("sm_90a", c_dtype=BF16)], {}, r"variant 'standin.contraction.sm_90a' "
                                                                            r"is not a contraction kernel compiled "
                                                                            r"for the call's \('bfloat16', "
                                                                            r"'float32'\) \(operands, C\)"),
            (good, [StandInContractionVariant("sm_90a", op="ragged")], {}, "not a contraction kernel"),
            (good, [StandInContractionVariant("sm_90a", ab_dtype=E4M3)], {}, "not a contraction kernel"),
            (good, [ok, StandInContractionVariant("sm_100a", c_dtype=BF16)], {}, r"variant "
                                                                                 r"'standin.contraction.sm_100a' is "
                                                                                 r"not a contraction kernel"),
            (good, [], {}, "at least one variant"),
        ]
        for operands, variants, kwargs, message in cases:
            with self.subTest(message=message), self.assertRaisesRegex(ValueError, message):
                _lower(operands, variants, **kwargs)

    def test_attributes_refuse_a_c_dtype_the_handler_would(self):
        with self.assertRaisesRegex(ValueError, "c_dtype float16 is not supported; expected float32 or bfloat16"):
            ffi_lowering.contraction_attributes([StandInContractionVariant("sm_90a", c_dtype=F16)], [b"x"],
                                                c_dtype=jnp.float16)
        attrs = ffi_lowering.contraction_attributes([StandInContractionVariant("sm_90a", c_dtype=BF16)], [b"xy"],
                                                    c_dtype=jnp.bfloat16)
        self.assertEqual((attrs["ab_dtype"], attrs["c_dtype"], attrs["archs"]), (BF16, BF16, "sm_90a"))
        self.assertEqual(set(attrs), set(_NAMES))

    def test_export_names_the_target(self):
        with mock.patch.object(kernel_cache, "get_object", side_effect=lambda v: v.key.encode()):
            exported = jax.export.export(_function([StandInContractionVariant("sm_90a")], jnp.float32),
                                         platforms=("cuda",),
                                         disabled_checks=ffi_lowering.export_disabled_checks())(*_operands())
        self.assertIn("stablehlo.custom_call @jbg_grouped_contraction", exported.mlir_module())
        self.assertEqual([a.shape for a in exported.out_avals], [(2, 3, 160, 72), (2,)])


# The lowering's attributes, given to the real instantiate stage by XLA:CPU in a fresh process: well-formed ones
# reach the device query (no GPU here), malformed ones are refused by name.
_XLA_PROBE = textwrap.dedent("""
    import types
    import jax, jax.numpy as jnp, numpy as np
    from jax_blockgemm import _native, ffi_lowering
    jax.devices()  # start the CPU client so that the registrations below reach XLA now
    _native.register_ffi_targets(platform="cpu")
    l, t, k, n, g = 1, 200, 160, 72, 3
    ops = (jnp.zeros((l, t, k), jnp.bfloat16), jnp.zeros((l, t, n), jnp.bfloat16), jnp.zeros((l, g, 2), jnp.int32))
    # (name, c_dtype of the variant, attributes to override)
    for name, c_dtype, override in (("GOOD", "float32", {}), ("GOODBF16", "bfloat16", {}),
                                    ("BADAB", "float32", {"ab_dtype": "float16"}),
                                    ("BADC", "float32", {"c_dtype": "float16"})):
        variant = types.SimpleNamespace(op="contraction", arch="sm_90a", key="p90", function_prefix="p90",
                                        ab_dtype="bfloat16", c_dtype=c_dtype)
        attributes = ffi_lowering.contraction_attributes([variant], [b"x" * 1000], c_dtype=np.dtype(c_dtype))
        attributes.update(override)
        out = (jax.ShapeDtypeStruct((l, g, k, n), np.dtype(c_dtype)), jax.ShapeDtypeStruct((l,), jnp.float32))
        call = jax.ffi.ffi_call("jbg_grouped_contraction", out)
        try:
            jax.jit(lambda *x: call(*x, **attributes))(*ops)
            print(name, "RAN")
        except Exception as e:
            print(name, " ".join(str(e).split())[:500])
""")


class XlaInstantiateTest(absltest.TestCase):
    """Registers the real handlers with XLA:CPU (in a fresh process) so that XLA runs the instantiate stage on the
    attributes contraction_attributes makes: its names and types are the ones the handler binds."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.output, cls.lines = xla_probe.run(_XLA_PROBE)

    def test_well_formed_attributes_reach_the_device_query(self):
        for name in ("GOOD", "GOODBF16"):
            got = self.lines.get(name, self.output)
            self.assertNotIn("RAN", got)
            self.assertNotIn("attributes", got)
            self.assertRegex(got, r"jbg_grouped_contraction: (cannot load the CUDA driver|cuInit failed|"
                                  r"cuDeviceGetCount|no kernel)")

    def test_malformed_attributes_are_invalid_arguments(self):
        self.assertRegex(self.lines.get("BADAB", self.output),
                         r'INVALID_ARGUMENT: jbg_grouped_contraction attributes: ab_dtype "float16" is not '
                         r"supported; expected bfloat16")
        self.assertRegex(self.lines.get("BADC", self.output),
                         r'INVALID_ARGUMENT: jbg_grouped_contraction attributes: c_dtype "float16" is not '
                         r"supported; expected float32 or bfloat16")


if __name__ == "__main__":
    absltest.main()
