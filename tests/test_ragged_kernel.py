"""The grouped kernel's side that runs without a GPU: its work-item table against the group sizes it encodes,
dispatch and the CUDA lowering (the custom call, its operands, when the reference stays), and the self-check's
ragged problems catching a wrong result.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg
from jax_blockgemm import arch, dispatch, ffi_lowering, ragged, selfcheck
from jax_blockgemm.kernels import catalog
from jax_blockgemm.kernels.sm90 import ragged as ragged_kernel

from oracle_ragged import random_group_sizes, random_ragged_inputs


def _owners(items: np.ndarray, tokens: int) -> np.ndarray:
    """Each token's group as the table says (-1: rows of no group), -2 where no item covers it; asserts that items
    lie in their row tile and never overlap."""
    owner = np.full(tokens, -2)
    for tile, group, lo, hi in items:
        if lo >= hi:
            continue
        rows = ragged_kernel.ITEM_ROWS
        assert tile * rows <= lo < hi <= min(tile * rows + rows, tokens), (tile, lo, hi)
        assert (owner[lo:hi] == -2).all(), "items overlap"
        owner[lo:hi] = group
    return owner


def _group_owners(items: np.ndarray, starts: np.ndarray, ends: np.ndarray, tokens: int) -> np.ndarray:
    """`_owners` for a group-local table: asserts that each item spans at most one tile, starts a whole number of
    tiles past the first row of its part (its group's, or for group -1 that of the rows of no group before the first
    group or after the last) and never overlaps another."""
    owner = np.full(tokens, -2)
    for field, group, lo, hi in items:
        if lo >= hi:
            continue
        rows = ragged_kernel.ITEM_ROWS
        first = starts[group] if group >= 0 else (0 if lo < starts[0] else ends[-1])
        assert field == 0 and 0 <= lo < hi <= min(lo + rows, tokens) and (lo - first) % rows == 0, (group, lo, hi)
        assert (owner[lo:hi] == -2).all(), "items overlap"
        owner[lo:hi] = group
    return owner


def _expected_owners(starts: np.ndarray, ends: np.ndarray, tokens: int) -> np.ndarray:
    owner = np.full(tokens, -1)
    for group, (s, e) in enumerate(zip(starts, ends)):
        owner[s:e] = group
    return owner


class KernelItemsTest(parameterized.TestCase):
    """Both item tables: the grid's (`kernel_items`, 128-row tiles of the token grid) and the group-local one
    (`group_items`, the bf16 and swap_ab kernels': each group's rows in tiles from its own first row)."""

    def assert_tables(self, starts: np.ndarray, ends: np.ndarray, tokens: int) -> None:
        """Both tables of these bounds cover every row once with its group (-1: rows of no group, before the first
        group or past the last), within the bound; the group-local one with one item per started tile of each part
        and its padding after the items."""
        shape = (ragged.max_kernel_items(tokens, len(starts)), ragged_kernel.ITEM_FIELDS)
        expect = _expected_owners(starts, ends, tokens)
        grid = np.asarray(ragged.kernel_items(jnp.asarray(starts), jnp.asarray(ends), tokens))
        self.assertEqual(grid.shape, shape)
        np.testing.assert_array_equal(_owners(grid, tokens), expect)
        local = np.asarray(ragged.group_items(jnp.asarray(starts), jnp.asarray(ends), tokens))
        self.assertEqual(local.shape, shape)
        np.testing.assert_array_equal(_group_owners(local, starts, ends, tokens), expect)
        used = local[local[:, 2] < local[:, 3]]
        parts = (starts[0], *(ends - starts), tokens - ends[-1])
        self.assertEqual(len(used), sum(-(-int(p) // ragged_kernel.ITEM_ROWS) for p in parts),
                         "one group-local item per started tile of each part")
        self.assertTrue((local[len(used):, 2] == local[len(used):, 3]).all(), "padding after the items")

    @parameterized.parameters((1, 1), (127, 3), (128, 4), (700, 9), (1000, 32), (4096, 256), (3, 40), (8, 256),
                              (130, 200))
    def test_every_row_once_with_its_group(self, tokens, groups):
        rng = np.random.default_rng(tokens + groups)
        cases = [random_group_sizes(rng, tokens, groups, fill=False), random_group_sizes(rng, tokens, groups),
                 np.eye(groups, dtype=np.int32)[groups // 2] * tokens, np.zeros(groups, np.int32)]
        for sizes in cases:
            starts, ends = (np.asarray(x) for x in ragged.group_bounds(jnp.asarray(sizes, jnp.int32), tokens))
            self.assertEqual(starts[0], 0)
            self.assertTrue((_expected_owners(starts, ends, tokens) == np.concatenate(
                [np.repeat(np.arange(groups), sizes), np.full(tokens - int(sizes.sum()), -1)])).all())
            self.assert_tables(starts, ends, tokens)
            # a shard of the experts: the last groups' bounds, from their own first row (rows before them: -1)
            half = groups // 2
            if half and ends[-1] > starts[half]:
                self.assert_tables(starts[half:], ends[half:], tokens)

    def test_decode_bound(self):
        """A few tokens over many experts (decode): at most T parts hold a row, so the bound is T items (one tile),
        reached when every token has its own group; more rows than a tile add the tiles' boundaries."""
        self.assertEqual(ragged.max_kernel_items(8, 256), 8)
        self.assertEqual(ragged.max_kernel_items(1, 256), 1)
        self.assertEqual(ragged.max_kernel_items(130, 200), 2 + 130 - 1)
        self.assertEqual(ragged.max_kernel_items(300, 5), 3 + 7 - 1)  # G + 2 parts below T: as before
        sizes = np.zeros(256, np.int32)
        sizes[np.random.default_rng(0).choice(256, 8, replace=False)] = 1
        starts, ends = (np.asarray(x) for x in ragged.group_bounds(jnp.asarray(sizes), 8))
        self.assert_tables(starts, ends, 8)
        for table in (ragged.kernel_items, ragged.group_items):
            items = np.asarray(table(jnp.asarray(starts), jnp.asarray(ends), 8))
            self.assertTrue((items[:, 2] < items[:, 3]).all(), "every item of the bound is used")

    def test_bound_is_reached(self):
        """Every part boundary inside a row tile (rows of no group before the first group and after the last, as a
        shard of the experts sees them): each adds an item to the grid's tiles; the group-local table only cuts
        each part's tail."""
        tokens = 300
        starts = np.array([3, 4, 132, 260, 262], np.int32)  # boundaries at rows 3, 4, 132, 260, 262, 263
        ends = np.array([4, 132, 260, 262, 263], np.int32)
        self.assert_tables(starts, ends, tokens)
        items = np.asarray(ragged.kernel_items(jnp.asarray(starts), jnp.asarray(ends), tokens))
        self.assertEqual(items.shape[0], ragged.max_kernel_items(tokens, 5))  # 3 tiles + 6
        self.assertTrue((items[:, 2] < items[:, 3]).all(), "every item of the bound is used")
        local = np.asarray(ragged.group_items(jnp.asarray(starts), jnp.asarray(ends), tokens))
        self.assertEqual(int((local[:, 2] < local[:, 3]).sum()), 7)  # six parts of one tile, 37 rows after


class ItemTableChoiceTest(parameterized.TestCase):
    """Each ragged kernel gets the table it reads: the lowering passes `group_items` where
    `ffi_lowering.takes_group_items` says so, and the kernel's device code reads entries with `group_item` exactly
    then (`work_item` otherwise)."""

    @parameterized.named_parameters((v.key, v) for v in catalog.CATALOG if v.op == "ragged")
    def test_kernel_reads_the_table_it_is_given(self, v):
        kernel = catalog.make_kernel(v)
        source = "".join(inspect.getsource(c) for c in type(kernel).__mro__
                         if c.__module__.startswith("jax_blockgemm.kernels"))
        local = ffi_lowering.takes_group_items(v)
        self.assertEqual("group_item(" in source, local)
        self.assertEqual("work_item(" in source, not local)


def _lowered(fmt="mxfp8_e4m3", implementation="cutedsl", t=256, g=4, n=64, k=128, vmap=False, c_dtype=jnp.float32):
    d = random_ragged_inputs(np.random.default_rng(0), t=t, g=g, n=n, k=k, fmt=fmt)
    alpha = d["alpha"] if fmt == "nvfp4" else None

    def call(a, sfa, gs):
        return jbg.ragged_gemm_amax(a, d["b"], sfa, d["sfb"], gs, alpha=alpha, sf_vec_size=d["sf_vec_size"],
                                    c_dtype=c_dtype, implementation=implementation)

    a, sfa, gs = d["a"], d["sfa"], jnp.full((g,), t // g, jnp.int32)
    if vmap:
        call, a, sfa, gs = jax.vmap(call), np.stack([a, a]), np.stack([sfa, sfa]), jnp.stack([gs, gs])
    return jax.jit(call).trace(a, sfa, gs).lower(lowering_platforms=("cuda",)).as_text()


class RaggedLoweringTest(parameterized.TestCase):

    @parameterized.parameters("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4")
    def test_cutedsl_and_none_emit_the_kernel_call(self, fmt):
        for implementation in ("cutedsl", None):
            text = _lowered(fmt, implementation)
            self.assertEqual(text.count("jbg_ragged_gemm_amax"), 1, implementation)
            self.assertNotIn("while", text, "the reference's loop must not be in a kernel program")

    def test_cutedsl_carries_the_sm100a_objects_none_does_not(self):
        """sm_100a's tcgen05 objects ride along with "cutedsl" (a B200 runs them after its first-use self-check) for
        f32 and bf16 C; None keeps the reference there (arch.TABLE), so its call carries sm_90a's object only."""
        for fmt in ("mxfp8_e4m3", "nvfp4"):
            for c_dtype in (jnp.float32, jnp.bfloat16):
                self.assertIn('archs = "sm_100a,sm_90a"', _lowered(fmt, "cutedsl", c_dtype=c_dtype))
                self.assertIn('archs = "sm_90a"', _lowered(fmt, None, c_dtype=c_dtype))
        self.assertIn('archs = "sm_90a"', _lowered("mxfp4", "cutedsl", c_dtype=jnp.float16, n=96))  # no sm_100a f16

    def test_xla_keeps_the_reference(self):
        text = _lowered(implementation="xla")
        self.assertNotIn("jbg_ragged_gemm_amax", text)
        self.assertIn("while", text)

    def test_vmap_folds_into_one_launch(self):
        self.assertEqual(_lowered(vmap=True).count("jbg_ragged_gemm_amax"), 1)

    def test_every_c_dtype_of_the_catalog(self):
        for c_dtype in ("bfloat16", "float16", "float8_e4m3fn", "float4_e2m1fn"):
            self.assertIn("jbg_ragged_gemm_amax", _lowered("mxfp4", c_dtype=c_dtype, n=96))

    @parameterized.product(w_major=("k", "n"), implementation=("cutedsl", None))
    def test_bf16_operands_emit_the_bf16_kernel(self, w_major, implementation):
        """grouped_dot (the bf16 recipe) lowers to one launch of the bf16 variant for the weights' layout, with
        empty scales and no transposed copy of an N-major weight."""
        t, g, n, k = 256, 4, 64, 96
        x = jnp.zeros((t, k), jnp.bfloat16)
        w = jnp.zeros((g, n, k) if w_major == "k" else (g, k, n), jnp.bfloat16)
        f = jax.jit(lambda x, w, gs: ragged.grouped_dot(x, w, gs, w_major=w_major, implementation=implementation))
        text = f.trace(x, w, jnp.full((g,), t // g, jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        self.assertEqual(text.count("jbg_ragged_gemm_amax"), 1)
        self.assertIn('ab_dtype = "bfloat16"', text)
        self.assertIn(f'b_major = "{w_major}"', text)
        self.assertNotIn("transpose", text)
        self.assertNotIn("while", text)

    def test_bf16_choice(self):
        sa = jax.core.ShapedArray

        def choice(n, k, w_major, implementation=None):
            w = sa((1, 4, n, k) if w_major == "k" else (1, 4, k, n), jnp.bfloat16)
            avals = [sa((1, 512, k), jnp.bfloat16), w, sa((1, 512, 0), jnp.uint8), sa((1, 4, n, 0), jnp.uint8),
                     sa((1, 4), jnp.int32), sa((1, 4), jnp.int32)]
            return dispatch.ragged_kernels(avals, c_dtype=np.dtype(jnp.float32), sf_vec_size=0, k=k,
                                           implementation=implementation, b_major=w_major)

        tile = "t{}x{}".format(*arch.policy("sm_90a").ragged_bf16_tile)  # the table's tile, not 128 x 128
        self.assertEqual([v.key for v in choice(256, 128, "n").variants],
                         [f"ragged.sm_90a.bf16.f32.sf0none.{tile}.c1x1.bn"])
        self.assertEqual([v.key for v in choice(200, 136, "k").variants],
                         [f"ragged.sm_90a.bf16.f32.sf0none.{tile}.c1x1"])
        self.assertRegex(choice(256, 100, "k").reason, r"k must be a multiple of 8")
        self.assertRegex(choice(100, 128, "n").reason, r"n must be a multiple of 8 for an N-major b")

    def test_choice_by_size(self):
        sa = jax.core.ShapedArray
        e8 = jnp.uint8

        def choice(t, g, n, k, implementation=None):
            avals = [sa((1, t, k), jnp.float8_e4m3fn), sa((1, g, n, k), jnp.float8_e4m3fn), sa((1, t, k // 32), e8),
                     sa((1, g, n, k // 32), e8), sa((1, g), jnp.int32), sa((1, g), jnp.int32)]
            return dispatch.ragged_kernels(avals, c_dtype=np.dtype(jnp.bfloat16), sf_vec_size=32, k=k,
                                           implementation=implementation)

        # 256 experts of 2048 x 7168: b holds 3.8e9 codes, each weight 1.5e7: the kernel takes it
        self.assertEqual([v.key for v in choice(65536, 256, 2048, 7168).variants],
                         ["ragged.sm_90a.e4m3.bf16.sf32.t128x128.c1x1"])
        self.assertRegex(choice(2**18, 2, 256, 8192).reason, r"a \(1, 262144, 8192\) holds .* 32-bit indexing")
        self.assertRegex(choice(64, 2, 2**16, 2**15).reason, r"one weight of b \(65536, 32768\)")
        self.assertIn("forces the reference", choice(64, 2, 64, 64, "xla").reason)
        self.assertEqual([v.key for v in choice(65536, 256, 2048, 7168, "cutedsl").variants],
                         ["ragged.sm_90a.e4m3.bf16.sf32.t128x128.c1x1", "ragged.sm_100a.e4m3.bf16.sf32.t128x128.c1x1"])


class RaggedSelfCheckTest(parameterized.TestCase):
    """The self-check's ragged problems (on the CPU, the reference standing in for the kernel) pass an exact result
    and catch one wrong element, and nonzero rows past the groups."""

    @parameterized.parameters(
        dict(ab_dtype="float8_e4m3fn", sf_vec_size=32, sf_dtype=catalog.E8M0, b_major="k"),
        dict(ab_dtype="bfloat16", sf_vec_size=0, sf_dtype=catalog.NO_SCALES, b_major="n"))
    def test_catches_wrong_results(self, **fields):
        tile = arch.policy("sm_90a").ragged_bf16_tile if fields["sf_vec_size"] == 0 else (128, 128)
        variant = catalog.select_variant(op="ragged", arch="sm_90a", c_dtype="bfloat16", tile_mn=tile,
                                         cluster_mn=(1, 1), **fields)
        self.assertIsNotNone(variant)
        device = jax.devices("cpu")[0]
        exact = lambda v, args, dev: selfcheck._run_ragged(v, args, dev, "xla")

        def off_by_one(v, args, dev):
            c, amax = exact(v, args, dev)
            c = c.astype(np.float32)
            c[np.flatnonzero(c[:, 0])[0], 0] += 1.0
            return c, amax

        def tail_written(v, args, dev):
            c, amax = exact(v, args, dev)
            c = c.astype(np.float32)
            c[-1] = 1.0
            return c, amax

        self.assertEqual(selfcheck.run_ragged_problems(variant, device, run_kernel=exact), "")
        self.assertIn("1 of", selfcheck.run_ragged_problems(variant, device, run_kernel=off_by_one))
        self.assertIn("C elements off", selfcheck.run_ragged_problems(variant, device, run_kernel=tail_written))


if __name__ == "__main__":
    absltest.main()
