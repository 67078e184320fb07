"""The per-architecture policy table: consistent with the catalog, read by dispatch, and shown in the README."""

import functools
import pathlib
import subprocess
import sys

from absl.testing import absltest

from jax_blockgemm import arch

ROOT = pathlib.Path(__file__).resolve().parents[1]


class ArchTableTest(absltest.TestCase):

    def test_every_catalog_target_has_a_row_and_every_row_target_has_kernels(self):
        from jax_blockgemm.kernels import catalog

        catalog_targets = {v.arch for v in catalog.CATALOG}
        self.assertEqual(catalog_targets, set(arch.targets()))
        for target in arch.targets():
            for op in arch.OPS:
                if arch.none_takes_kernel(op, target):
                    self.assertTrue(catalog.variants_for(target, op), f"None takes a {target} {op} kernel: none")

    def test_a_kernel_is_the_default_only_where_ours_have_run(self):
        """An unverified architecture's kernels are never what None takes without a local decision."""
        for p in arch.TABLE:
            if not p.verified:
                self.assertNotIn("kernel", p.default.values(), p.capability)
                self.assertFalse(any(p.decode_max_m.values()), p.capability)

    def test_decode_kernel_by_format_and_rows(self):
        """None takes the decode kernel up to the row's largest M for the weight format, never where that is 0 and
        never on sm_100a; a format the row does not name never."""
        self.assertEqual(set(arch.policy("sm_90a").decode_max_m), set(arch.DECODE_FORMATS))
        for fmt in arch.DECODE_FORMATS:
            largest = arch.policy("sm_90a").decode_max_m[fmt]
            if largest == 0:
                self.assertFalse(arch.none_takes_kernel("weight_stream", "sm_90a", fmt=fmt, m=1), fmt)
                continue
            self.assertTrue(arch.none_takes_kernel("weight_stream", "sm_90a", fmt=fmt, m=1))
            self.assertTrue(arch.none_takes_kernel("weight_stream", "sm_90a", fmt=fmt, m=largest))
            self.assertFalse(arch.none_takes_kernel("weight_stream", "sm_90a", fmt=fmt, m=largest + 1))
            self.assertFalse(arch.none_takes_kernel("weight_stream", "sm_100a", fmt=fmt, m=1))
        self.assertFalse(arch.none_takes_kernel("weight_stream", "sm_90a", fmt="e2m1_e8m0_16", m=1))
        with arch.overridden("10.0", decode_max_m={"mxfp4": 16}):
            self.assertTrue(arch.none_takes_kernel("weight_stream", "sm_100a", fmt="mxfp4", m=16))
            self.assertFalse(arch.none_takes_kernel("weight_stream", "sm_100a", fmt="mxfp4", m=17))
            self.assertFalse(arch.none_takes_kernel("weight_stream", "sm_100a", fmt="nvfp4", m=1))
            row = next(line for line in arch.markdown_table().splitlines() if line.startswith("| 10.0 |"))
            self.assertIn("| mxfp8_e4m3: never, mxfp8_e5m2: never, mxfp4: M <= 16, nvfp4: never |", row)
        with arch.overridden("9.0", decode_max_m={fmt: 48 for fmt in arch.DECODE_FORMATS}, decode_short_k={},
                             decode_swap_ab_m={}):
            self.assertIn("| decode kernel for M <= 48 |", arch.markdown_table().splitlines()[2])

    def test_decode_kernel_takes_fewer_rows_below_the_short_k(self):
        """decode_short_k: below its K, None takes the decode kernel only up to its M; at or above that K (and with
        K unknown) up to decode_max_m; the table's cell names the rule."""
        with arch.overridden("9.0", decode_max_m={"mxfp8_e4m3": 64, "mxfp4": 64},
                             decode_short_k={"mxfp8_e4m3": (4096, 16)}, decode_swap_ab_m={}):
            takes = lambda fmt, m, k: arch.none_takes_kernel("weight_stream", "sm_90a", fmt=fmt, m=m, k=k)
            self.assertTrue(takes("mxfp8_e4m3", 16, 2048))
            self.assertFalse(takes("mxfp8_e4m3", 17, 2048))
            self.assertFalse(takes("mxfp8_e4m3", 17, 4095))
            self.assertTrue(takes("mxfp8_e4m3", 64, 4096))
            self.assertTrue(takes("mxfp8_e4m3", 64, None))
            self.assertTrue(takes("mxfp4", 64, 2048))  # another format keeps its threshold
            self.assertEqual(arch.decode_largest_m("sm_90a", "mxfp8_e4m3", 1024), 16)
            self.assertEqual(arch.decode_largest_m("sm_90a", "mxfp8_e4m3"), 64)
            row = arch.markdown_table().splitlines()[2]
            self.assertIn("mxfp4: M <= 64, nvfp4: never; M <= 16 below K = 4096 for mxfp8_e4m3 |", row)
        with arch.overridden("9.0", decode_max_m={fmt: 64 for fmt in arch.DECODE_FORMATS},
                             decode_short_k={fmt: (4096, 16) for fmt in arch.DECODE_FORMATS}, decode_swap_ab_m={}):
            self.assertFalse(arch.none_takes_kernel("weight_stream", "sm_90a", fmt="nvfp4", m=17, k=2048))
            row = arch.markdown_table().splitlines()[2]
            self.assertIn("| decode kernel for M <= 64; M <= 16 below K = 4096 |", row)  # every format: no names

    def test_the_cell_names_formats_that_share_a_swap_ab_range_together(self):
        with arch.overridden("9.0", decode_swap_ab_m={"mxfp8_e4m3": (1, 64), "mxfp4": (17, 64), "nvfp4": (1, 64)},
                             decode_swap_ab_small=(16, 7168, 4096)):
            row = arch.markdown_table().splitlines()[2]
            self.assertIn("; mxfp8_e4m3, nvfp4 at M = 1-64: the swap_ab tile; mxfp4 at M = 17-64: the swap_ab tile, "
                          "at M <= 16 only for N >= 7168, K >= 4096 |", row)
        with arch.overridden("9.0", decode_swap_ab_m={"mxfp4": (17, 64)}, decode_swap_ab_small=(16, 7168, 4096)):
            self.assertIn("; mxfp4 at M = 17-64: the swap_ab tile |", arch.markdown_table())  # no range reaches 16

    def test_small_weights_keep_the_decode_kernel_at_few_rows(self):
        """decode_swap_ab_small (M, N, K): calls of at most M rows take the swap_ab tile only against weights of at
        least N rows and K columns; more rows take it at any size; a tuning table's measured range obeys the same."""
        with arch.overridden("9.0", decode_swap_ab_m={"mxfp8_e4m3": (1, 64)}, decode_swap_ab_small=(16, 7168, 4096)):
            takes = functools.partial(arch.decode_takes_swap_ab, "sm_90a", "mxfp8_e4m3")
            self.assertTrue(takes(16, n=7168, k=4096))
            self.assertTrue(takes(1, n=18432, k=7168))
            self.assertFalse(takes(16, n=7167, k=7168))
            self.assertFalse(takes(1, n=7168, k=4095))
            self.assertFalse(takes(16, n=4096, k=11008))
            self.assertTrue(takes(17, n=128, k=64))
            self.assertFalse(takes(65, n=7168, k=7168))  # past the range
            self.assertFalse(takes(8, n=2048, k=2048, measured_rows=(1, 64)))
            self.assertTrue(takes(8, n=7168, k=7168, measured_rows=(1, 64)))
            self.assertFalse(takes(8, n=7168, k=7168, measured_rows=(17, 64)))
        with arch.overridden("9.0", decode_swap_ab_m={"mxfp8_e4m3": (1, 64)}, decode_swap_ab_small=(0, 0, 0)):
            self.assertTrue(arch.decode_takes_swap_ab("sm_90a", "mxfp8_e4m3", 1, n=8, k=32))

    def test_every_decode_threshold_has_kernels_that_hold_it(self):
        """Where None takes the decode kernel up to M rows, the catalog has a variant of that format with room for M
        rows (C in every dtype the kernel writes)."""
        from jax_blockgemm.kernels import catalog

        formats = {"mxfp8_e4m3": ("float8_e4m3fn", 32), "mxfp8_e5m2": ("float8_e5m2", 32),
                   "mxfp4": ("float4_e2m1fn", 32), "nvfp4": ("float4_e2m1fn", 16)}
        for target in arch.targets():
            for fmt, largest in arch.policy(target).decode_max_m.items():
                if largest:
                    ab, v = formats[fmt]
                    room = {x.c_dtype for x in catalog.variants_for(target, "weight_stream")
                            if (x.ab_dtype, x.sf_vec_size) == (ab, v) and x.tile_mn[1] >= largest}
                    self.assertEqual(room, {"float32", "bfloat16", "float16"}, (target, fmt))

    def test_capabilities_map_to_targets(self):
        self.assertEqual(arch.target_of("9.0"), "sm_90a")
        self.assertEqual(arch.target_of("10.0"), "sm_100a")
        self.assertIsNone(arch.target_of("8.0"))  # an A100: no kernels, the reference
        self.assertIsNone(arch.target_of("10.3"))  # a row without kernels of ours
        with self.assertRaisesRegex(KeyError, "no architecture policy for target 'sm_80'"):
            arch.policy("sm_80")

    def test_scaled_dot_route_only_on_named_gpus(self):
        self.assertIsNone(arch.scaled_dot_min_size("cpu"))
        self.assertIsNone(arch.scaled_dot_min_size("cuda"))  # a CUDA lowering with no GPU seen
        self.assertIsNone(arch.scaled_dot_min_size("cuda:9.0"))
        self.assertIsNone(arch.scaled_dot_min_size("cuda:8.0"))
        self.assertEqual(arch.scaled_dot_min_size("cuda:10.0"), 0)

    def test_overridden_changes_one_row_and_restores_it(self):
        before = arch.TABLE
        with arch.overridden("9.0", default={"gemm_amax": "kernel", "proj_rope": "reference"}):
            self.assertTrue(arch.none_takes_kernel("gemm_amax", "sm_90a"))
            self.assertFalse(arch.none_takes_kernel("proj_rope", "sm_90a"))
            self.assertEqual(arch.policy("sm_100a"), next(p for p in before if p.target == "sm_100a"))
        self.assertIs(arch.TABLE, before)

    def test_mx_ragged_operands_follow_the_local_gpus(self):
        self.assertEqual(arch.mx_ragged_operands(["9.0"]), "bf16")  # H200: MX GEMMs at the bf16 rate
        self.assertEqual(arch.mx_ragged_operands(["10.0"]), "codes")  # B200: the block-scaled kernel takes codes
        self.assertEqual(arch.mx_ragged_operands(["9.0", "10.0"]), "codes")
        self.assertEqual(arch.mx_ragged_operands([]), "bf16")  # no GPU
        self.assertEqual(arch.mx_ragged_operands(["8.0"]), "bf16")  # no row
        with arch.overridden("9.0", mx_ragged_operands="codes"):
            self.assertEqual(arch.mx_ragged_operands(["9.0"]), "codes")

    def test_an_unverified_schedule_is_self_checked_and_shown(self):
        with arch.overridden("9.0", unverified_schedules=()):
            self.assertTrue(arch.is_verified("sm_90a", "swap_ab"))
            self.assertIn("| 9.0 | sm_90a | yes |", arch.markdown_table())
        with arch.overridden("9.0", unverified_schedules=("swap_ab",)):
            self.assertFalse(arch.is_verified("sm_90a", "swap_ab"))
            self.assertTrue(arch.is_verified("sm_90a"))
            self.assertIn("yes (but the swap_ab kernels: self-checked first)", arch.markdown_table())

    def test_ragged_swap_ab_formats(self):
        """Which weight formats' ragged calls take the swap_ab kernel, and the table's ragged cell naming them."""
        self.assertTrue(arch.ragged_takes_swap_ab("sm_90a", "mxfp8_e4m3"))
        self.assertFalse(arch.ragged_takes_swap_ab("sm_100a", "mxfp8_e4m3"))
        with arch.overridden("9.0", ragged_swap_ab_formats=("mxfp8_e4m3", "mxfp4")):
            self.assertTrue(arch.ragged_takes_swap_ab("sm_90a", "mxfp4"))
            self.assertIn("| kernel (swap_ab for mxfp8_e4m3, mxfp4); bf16 |", arch.markdown_table())
        with arch.overridden("9.0", ragged_swap_ab_formats=()):
            self.assertIn("| kernel; bf16 |", arch.markdown_table())

    def test_the_readme_shows_the_current_table(self):
        """The README holds the table `python -m jax_blockgemm.arch` prints. The command imports the package first,
        which must not import arch (every operation's module does), or runpy warns that arch is in sys.modules
        already and runs a second copy as __main__; it refuses arguments."""
        self.assertIn(arch.markdown_table(), (ROOT / "README.md").read_text())
        printed = subprocess.run([sys.executable, "-m", "jax_blockgemm.arch"], capture_output=True, text=True,
                                 check=True)
        self.assertEqual(printed.stdout.strip(), arch.markdown_table())
        self.assertNotIn("RuntimeWarning", printed.stderr)
        refused = subprocess.run([sys.executable, "-m", "jax_blockgemm.arch", "--foo"], capture_output=True, text=True)
        self.assertEqual((refused.returncode, refused.stdout), (2, ""))
        self.assertIn("unrecognized arguments: --foo", refused.stderr)


if __name__ == "__main__":
    absltest.main()
