"""`python -m jax_blockgemm.precompile --arch sm_100a --report`, the command the README gives B200 users: one row per
variant, dequantize kernels included, exit status 0 (structural checks of the compiled sm_100a objects, no GPU). The
weight_stream decode kernel is held to warp-level mma.sync and no tensor memory, the other MMA kernels to tcgen05."""

import contextlib
import dataclasses
import io

import pytest
from absl.testing import absltest

from jax_blockgemm import precompile
from jax_blockgemm.kernels import catalog, structure


def _report(keys: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = precompile.main(["--arch", "sm_100a", "--report"] + [a for k in keys for a in ("--variant", k)])
    return rc, out.getvalue()


class PrecompileReportTest(absltest.TestCase):

    def test_one_kernel_of_each_operation(self):
        ops = [op for op in catalog.OPS if catalog.variants_for("sm_100a", op)]  # the contraction: sm_90a only
        keys = [catalog.variants_for("sm_100a", op)[0].key for op in ops]
        keys.append(next(v.key for v in catalog.variants_for("sm_100a", "dequantize") if v.a_major == "m"))
        rc, text = _report(keys)
        self.assertEqual(rc, 0, text)
        rows = [line for line in text.splitlines() if line.split(" ")[0] in keys]
        self.assertLen(rows, len(keys))
        self.assertTrue(all(row.rstrip().endswith("ok") for row in rows), text)
        self.assertIn(f"{len(keys)} variants in", text)
        # after the compile time: MMA kind, scale_vec, alloc/dealloc, local B, smem B, regs, TMEM used/alloc, verdict
        expected = {"gemm_amax": r"kind::mxf8f6f4 +block32 +yes/yes +0 +\d+ +\d+ +\d+/512",
                    "ragged": r"kind::mxf8f6f4 +block32 +yes/yes +0 +\d+ +\d+ +\d+/512",
                    "proj_rope": r"kind::f16 +- +yes/yes +0 +\d+ +\d+ +\d+/512",
                    "dequantize": r"- +- +NO/NO +0 +\d+ +\d+ +0/0",
                    # the 16-token decode tiles run two CTAs per SM at no more than 128 registers, no local memory
                    "weight_stream": r"mma\.sync m16n8k16 +- +NO/NO +0 +\d+ +\d+ +0/0"}
        self.assertEqual(set(expected), set(ops))
        for row in rows:
            self.assertRegex(row, r"^\S+ +[\d.]+ " + expected[row.split(".")[0]] + " +ok$")


class WeightStreamStructureTest(absltest.TestCase):
    """The decode kernel's own expectation, on its real sm_100a report and on reports that break it."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        variant = catalog.variants_for("sm_100a", "weight_stream")[0]
        kernel = catalog.make_kernel(variant)
        cls.report = structure.sm100_report(variant, catalog.compile_function(variant, keep_ptx=True, kernel=kernel),
                                            kernel)

    def test_the_compiled_kernel_holds_only_the_bf16_mma_sync(self):
        r = self.report
        self.assertEqual(r.warp_mma, (structure.WARP_MMA_BF16,))
        self.assertEqual((r.mma, r.has_alloc, r.tmem_loads, r.expect_kind), ((), False, 0, ""))
        self.assertEqual(r.threads_per_cta, 256)
        self.assertGreater(r.dynamic_smem_bytes, 0)  # the copy ring and the warps' partial C tiles
        self.assertEqual(r.problems(), [])

    def test_tcgen05_or_another_warp_mma_fails_it(self):
        cases = [
            (dict(mma=("tcgen05.mma.cta_group::1.kind::f16",)), "expected no tcgen05 MMA"),
            (dict(has_alloc=True), "expected no tcgen05 MMA"),
            (dict(warp_mma=()), "warp MMA opcodes []"),
            (dict(warp_mma=("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",)), "warp MMA opcodes"),
            (dict(warp_mma=(structure.WARP_MMA_BF16, "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32")),
             "warp MMA opcodes"),
        ]
        for changes, match in cases:
            with self.subTest(changes=changes):
                problems = dataclasses.replace(self.report, **changes).problems()
                self.assertLen(problems, 1)
                self.assertIn(match, problems[0])


@pytest.mark.catalog
class WholeCatalogReportTest(absltest.TestCase):

    def test_every_sm100a_variant(self):
        rc, text = _report([])
        variants = catalog.variants_for("sm_100a")
        self.assertEqual(rc, 0, text)
        self.assertIn(f"{len(variants)} variants in", text)
        for v in variants:
            self.assertRegex(text, rf"(?m)^{v.key.replace('.', '[.]')}\s.*\sok$")


if __name__ == "__main__":
    absltest.main()
