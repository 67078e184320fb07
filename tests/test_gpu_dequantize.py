"""GPU: the MXFP8 -> bf16 dequantize kernel (kernels/dequantize.py) through its FFI call, one operand or two per
launch, bit for bit against a float64 oracle, in the swap_ab ragged kernel's column order, and inside the MXFP8
proj_rope path.

Skipped without a CUDA device that has a kernel (CI has none). The handler poisons the output before each launch
(JAX_BLOCKGEMM_POISON_OUTPUTS=1, set below: every byte 0xFF, a bf16 NaN), so an element the kernel leaves unwritten
fails the comparison.
"""

import os

os.environ["JAX_BLOCKGEMM_POISON_OUTPUTS"] = "1"

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest, parameterized
from jax.extend import core as jex_core
from jax.interpreters import mlir

import jax_blockgemm as jbg
from jax_blockgemm import arch, dispatch, ffi_lowering, swap_ab_layout

import oracle
import oracle_ops

_dequantize_p = jex_core.Primitive("jbg_test_dequantize_mxfp8")
_dequantize_p.multiple_results = True


@_dequantize_p.def_abstract_eval
def _abstract_eval(*operands, scale_axis):
    return [jax.core.ShapedArray(codes.shape, jnp.bfloat16) for codes in operands[::2]]


def _cuda_lowering(ctx, *operands, scale_axis):
    """One jbg_dequantize_mxfp8 call for (codes, scales[, codes1, scales1])."""
    archs = {arch.target_of(cc) for cc in dispatch.local_cuda_capabilities()}
    paired = ctx.avals_in[2].shape if len(operands) == 4 else None
    variants = dispatch.dequantize_variants(archs, ctx.avals_in[0].shape, scale_axis=scale_axis, paired_shape=paired)
    if not variants:
        raise ValueError(f"no dequantize kernel for {ctx.avals_in} with scale_axis {scale_axis}")
    pairs = [tuple(operands[i:i + 2]) for i in range(0, len(operands), 2)]
    avals = [tuple(ctx.avals_in[i:i + 2]) for i in range(0, len(operands), 2)]
    return ffi_lowering.emit_dequantize(ctx, pairs, avals=avals, variants=variants, scale_axis=scale_axis)


mlir.register_lowering(_dequantize_p, _cuda_lowering, platform="cuda")

_swap_ab_p = jex_core.Primitive("jbg_test_dequantize_swap_ab_order")


@_swap_ab_p.def_abstract_eval
def _swap_ab_abstract_eval(codes, scales):
    return jax.core.ShapedArray(codes.shape, jnp.bfloat16)


def _swap_ab_lowering(ctx, codes, scales):
    """One jbg_dequantize_mxfp8 call through the swap_ab order's object."""
    archs = {arch.target_of(cc) for cc in dispatch.local_cuda_capabilities()}
    variants = dispatch.dequantize_variants(archs, ctx.avals_in[0].shape, scale_axis=-1, swap_ab_order=True)
    if not variants:
        raise ValueError(f"no swap_ab dequantize kernel for {ctx.avals_in}")
    return ffi_lowering.emit_dequantize(ctx, [(codes, scales)], avals=[tuple(ctx.avals_in)], variants=variants,
                                        scale_axis=-1)


mlir.register_lowering(_swap_ab_p, _swap_ab_lowering, platform="cuda")


def _has_kernel_gpu() -> bool:
    caps = dispatch.local_cuda_capabilities()
    return bool(caps) and all(arch.target_of(cc) for cc in caps)


def _kernel(codes: np.ndarray, scales: np.ndarray, scale_axis: int, *paired: np.ndarray) -> list[np.ndarray]:
    """The kernel's bf16 values for (codes, scales) and, with `paired` (codes1, scales1: scales along the rows),
    for a second operand in the same launch."""
    f = jax.jit(lambda *ops: _dequantize_p.bind(*ops, scale_axis=scale_axis))
    return [np.asarray(y) for y in f(*(jnp.asarray(a) for a in (codes, scales, *paired)))]


def _oracle(codes: np.ndarray, scales: np.ndarray, scale_axis: int) -> np.ndarray:
    """code x 2^(byte-127) in float64 (exact; byte 255 is NaN, SPEC §1), rounded once to bf16."""
    return oracle.dequantize_f64(codes, scales, block=32, axis=scale_axis).astype(ml_dtypes.bfloat16)


def _assert_same_bits(test, got: np.ndarray, want: np.ndarray) -> None:
    """Equal bf16 bit patterns, except that any NaN matches any NaN (never a number)."""
    got_nan, want_nan = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(got_nan, want_nan)
    differ = (got.view(np.uint16) != want.view(np.uint16)) & ~want_nan
    test.assertEqual(int(differ.sum()), 0, f"{int(differ.sum())} of {got.size} elements differ")


def _random(rng, shape, scale_axis):
    codes = np.clip(rng.standard_normal(shape) * 32.0, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    scale_shape = list(shape)
    scale_shape[scale_axis] //= 32
    return codes, rng.integers(100, 155, scale_shape, dtype=np.uint8)  # 2^-27 .. 2^27: no two blocks alike


@absltest.skipUnless(_has_kernel_gpu(), "needs a CUDA GPU with a CuTeDSL kernel (sm_90a, sm_100a)")
class GpuDequantizeTest(parameterized.TestCase):

    @parameterized.parameters(((2048, 1536), -1), ((1, 24576, 1536), -1), ((1, 1536, 24576), -2),
                              ((96, 4128), -1), ((2, 64, 96), -2), ((32, 32), -2), ((1, 32), -1))
    def test_random_operands(self, shape, scale_axis):
        codes, scales = _random(np.random.default_rng(sum(shape)), shape, scale_axis)
        (got,) = _kernel(codes, scales, scale_axis)
        _assert_same_bits(self, got, _oracle(codes, scales, scale_axis))

    @parameterized.parameters(((1, 24576, 1536), -1, (1, 2048, 1536)), ((1, 1536, 24576), -2, (1, 2048, 1536)),
                              ((96, 4128), -1, (1, 32)), ((2, 64, 96), -2, (96, 4128)), ((32, 32), -2, (3, 4160)),
                              ((1, 32), -1, (8224, 32)))
    def test_two_operands_in_one_launch(self, shape, scale_axis, shape1):
        """Operand 1 (scales along its rows) beside operand 0 in either layout, sizes off the kernels' chunk
        multiples: both bit-exact, both outputs poisoned before the launch."""
        rng = np.random.default_rng(sum(shape) + sum(shape1))
        codes, scales = _random(rng, shape, scale_axis)
        codes1, scales1 = _random(rng, shape1, -1)
        got, got1 = _kernel(codes, scales, scale_axis, codes1, scales1)
        _assert_same_bits(self, got, _oracle(codes, scales, scale_axis))
        _assert_same_bits(self, got1, _oracle(codes1, scales1, -1))

    @parameterized.parameters(-1, -2)
    def test_every_code_times_every_scale_byte(self, scale_axis):
        """All 256 codes (NaN, zeros, subnormals, +-448) against all 256 scale bytes (2^-127 .. 2^127, NaN): results
        in the bf16 subnormal range, past its largest finite value, and NaN."""
        if scale_axis == -1:  # row s: the 256 codes, 8 blocks all scaled by byte s
            codes = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
            scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 8, axis=1)
        else:  # row r: code r % 256 in every column; block i (32 rows), column j: byte j
            codes = np.tile(np.repeat(np.arange(256, dtype=np.uint8)[:, None], 256, axis=1), (32, 1))
            scales = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
        codes = codes.view(ml_dtypes.float8_e4m3fn)
        (got,) = _kernel(codes, scales, scale_axis)
        want = _oracle(codes, scales, scale_axis)
        _assert_same_bits(self, got, want)
        self.assertTrue(np.isinf(want.astype(np.float32)).any())  # the grid reaches past bf16's range...
        tiny = np.abs(want.astype(np.float32))
        self.assertTrue(((tiny > 0) & (tiny < 2.0**-126)).any())  # ...and into its subnormals

    @parameterized.parameters((1, 333, 512), (2, 70, 7168), (1, 1, 256))
    def test_swap_ab_order(self, l, t, k):
        """The swap_ab ragged kernel's tokens: the oracle's bf16 values, every 128 columns in
        `swap_ab_layout.swap_ab_column_order`, bit for bit; all 256 codes and the scale bytes 0, 1, 254 and 255 among
        them; the output poisoned first."""
        rng = np.random.default_rng(t + k)
        codes, scales = _random(rng, (l, t, k), -1)
        codes.reshape(-1)[:256] = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
        scales.reshape(-1)[:4] = (0, 1, 254, 255)
        got = np.asarray(jax.jit(_swap_ab_p.bind)(jnp.asarray(codes), jnp.asarray(scales)))
        want = np.asarray(swap_ab_layout.swap_ab_tokens(jnp.asarray(_oracle(codes, scales, -1))))
        self.assertEqual(want.shape, got.shape)  # K a multiple of 256: no padding
        _assert_same_bits(self, got, want)

    @parameterized.parameters(True, False)
    def test_mxfp8_proj_rope_equals_the_bf16_path_on_the_same_values(self, w_out_in):
        """The MXFP8 path (dequantize kernels, then the bf16 kernel) and the bf16 path on the dequantized values run
        the same kernel on the same bf16 operands: all four outputs byte-identical. The compiled program holds one
        dequantize call (w and x in one launch)."""
        t, h, k = 160, 3, 256
        inp = oracle_ops.random_proj_rope_inputs(np.random.default_rng(11), t=t, h=h, k=k, mxfp8=True,
                                                 w_out_in=w_out_in)
        x16 = _oracle(inp["x"], inp["x_scale"], -1)
        w16 = _oracle(inp["w"], inp["w_scale"], -1 if w_out_in else -2)
        mx = jax.jit(lambda x, w, c, s, xs, ws: jbg.gemm_proj_rope_mxfp8(
            x, w, c, s, x_scale=xs, w_scale=ws, w_out_in=w_out_in, implementation="cutedsl"))
        bf = jax.jit(lambda x, w, c, s: jbg.gemm_proj_rope_mxfp8(x, w, c, s, w_out_in=w_out_in,
                                                                   implementation="cutedsl"))
        args = [jnp.asarray(inp[n]) for n in ("x", "w", "cos", "sin", "x_scale", "w_scale")]
        self.assertEqual(mx.lower(*args).compile().as_text().count('custom_call_target="jbg_dequantize_mxfp8"'), 1)
        got = mx(*args)
        want = bf(jnp.asarray(x16), jnp.asarray(w16), args[2], args[3])
        for name, g, w in zip(("row codes", "row scales", "col codes", "col scales"), got, want):
            np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8), name)


if __name__ == "__main__":
    absltest.main()
