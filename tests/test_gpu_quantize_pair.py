"""GPU: the pair quantization kernel (kernels/quantize_pair.py) through `quantize_pair`, bit for bit against the
float64 oracle (SPEC §2: codes, scale bytes and dequantized values), on fresh random weights with spread scales,
NaN, inf, zero and tiny blocks, column tails off the 256-column tile, every format pair, and past 2**31 elements;
and its gather schedules (rows through a row map, the column blocks as codes or bf16 values) likewise, on maps
that name every row once among empty and out-of-range entries, and on mx_ragged_dot's group-padding map.

Skipped without a CUDA device that has a kernel (CI has none). The handler poisons the outputs before each launch
(JAX_BLOCKGEMM_POISON_OUTPUTS=1, set below: every byte 0xFF, NaN in bf16 and FP8), so an element the kernel leaves
unwritten fails the comparison.
"""

import os

os.environ["JAX_BLOCKGEMM_POISON_OUTPUTS"] = "1"

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from jax_blockgemm import arch, dispatch, selfcheck
from jax_blockgemm.quantize_pair import quantize_pair

from test_quantize_pair import assert_mapped_matches_oracle, assert_matches_oracle, random_weights


def _has_kernel_gpu() -> bool:
    caps = dispatch.local_cuda_capabilities()
    return bool(caps) and all(arch.target_of(cc) == "sm_90a" for cc in caps)


@absltest.skipUnless(_has_kernel_gpu(), "needs a CUDA GPU with a quantize_pair kernel (sm_90a)")
class QuantizePairKernelTest(parameterized.TestCase):

    @parameterized.product(shape=((1, 32, 32), (3, 64, 96), (2, 96, 544), (1, 256, 4096), (5, 160, 2080)),
                           formats=(("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp8_e4m3", "mxfp8_e5m2"),
                                    ("mxfp8_e5m2", "mxfp8_e4m3"), ("mxfp8_e5m2", "mxfp8_e5m2")))
    def test_against_oracle(self, shape, formats):
        w = random_weights(np.random.default_rng(sum(shape)), shape, specials=True, tiny=True)
        row, col = formats
        got = jax.jit(lambda w: quantize_pair(w, row_format=row, col_format=col, implementation="cutedsl"))(w)
        assert_matches_oracle(self, w, got, row, col)

    def test_weights_of_a_deepseek_expert_layer(self):
        """32 experts of 7168 -> 2048, as the MoE benchmark quantizes them; the kernel against the reference (XLA)."""
        w = jax.random.normal(jax.random.PRNGKey(3), (32, 7168, 2048), jnp.bfloat16)
        f = lambda impl: jax.jit(lambda w: quantize_pair(w, implementation=impl))(w)
        for name, got, want in zip(("values", "codes", "scales"), f("cutedsl"), f("xla")):
            bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16 if a.dtype == jnp.bfloat16 else jnp.uint8)
            self.assertTrue(bool(jnp.array_equal(bits(got), bits(want))), name)

    def test_past_int32_elements(self):
        """2**31 + 2**21 elements: the kernel's 64-bit offsets reach the last rows (checked against the reference on
        the first and last 64 rows)."""
        w = jax.random.normal(jax.random.PRNGKey(4), (1, 65600, 32768), jnp.bfloat16)
        got = jax.jit(lambda w: quantize_pair(w, implementation="cutedsl"))(w)
        for rows in (slice(0, 64), slice(-64, None)):
            part = w[:, rows]
            want = jax.jit(lambda w: quantize_pair(w, implementation="xla"))(part)
            for name, g, r in zip(("values", "codes", "scales"), got, want):
                bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16 if a.dtype == jnp.bfloat16 else jnp.uint8)
                self.assertTrue(bool(jnp.array_equal(bits(g[:, rows]), bits(r))), f"{name} rows {rows}")

    @parameterized.product(shape=((70, 96), (33, 544), (1000, 2080)), col_values=(False, True),
                           formats=(("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp8_e5m2", "mxfp8_e4m3"),
                                    ("mxfp8_e5m2", "mxfp8_e5m2")))
    def test_row_map_against_oracle(self, shape, col_values, formats):
        """The gather kernels: w's rows any number, the map's a multiple of 32 with empty and out-of-range entries,
        each of w's rows named once in a random order; outputs poisoned, so a row or column left unwritten fails."""
        rng = np.random.default_rng(sum(shape) + col_values)
        w = random_weights(rng, (1, *shape), specials=True, tiny=True)[0]
        row_map = selfcheck.random_row_map(rng, shape[0], -(-(shape[0] + 50) // 32) * 32)
        row, col = formats
        got = jax.jit(lambda w, m: quantize_pair(w, row_format=row, col_format=col, row_map=m, col_values=col_values,
                                                 implementation="cutedsl"))(w, row_map)
        assert_mapped_matches_oracle(self, w, row_map, got, row, col, col_values)

    def test_row_map_of_routed_tokens(self):
        """16384 tokens of 7168 features in 32 skewed groups through the group-padding map mx_ragged_dot builds (the
        rows of no group after the padded groups): the kernel against the reference (XLA), bit for bit."""
        from jax_blockgemm import moe, ragged

        sizes = np.random.default_rng(6).dirichlet(np.full(32, 0.5)) * 16000
        sizes = jnp.asarray(np.floor(sizes), jnp.int32)
        starts, ends = ragged.group_bounds(sizes, 16384)
        row_map = moe._group_padding_map(starts, ends, 16384)
        x = jax.random.normal(jax.random.PRNGKey(5), (16384, 7168), jnp.bfloat16)
        for col_values in (False, True):
            f = lambda impl: jax.jit(lambda x, m: quantize_pair(x, row_map=m, col_values=col_values,
                                                                implementation=impl))(x, row_map)
            for name, got, want in zip(("values", "codes", "scales"), f("cutedsl"), f("xla")):
                bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16 if a.dtype == jnp.bfloat16 else jnp.uint8)
                self.assertTrue(bool(jnp.array_equal(bits(got), bits(want))), f"{name}, col_values={col_values}")


if __name__ == "__main__":
    absltest.main()
