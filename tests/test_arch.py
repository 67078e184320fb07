"""The per-architecture policy table: consistent with the catalog, read by dispatch, and shown in the README."""

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

    def test_the_readme_shows_the_current_table(self):
        self.assertIn(arch.markdown_table(), (ROOT / "README.md").read_text())
        printed = subprocess.run([sys.executable, "-m", "jax_blockgemm.arch"], capture_output=True, text=True,
                                 check=True).stdout
        self.assertEqual(printed.strip(), arch.markdown_table())


if __name__ == "__main__":
    absltest.main()
