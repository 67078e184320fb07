"""CPU: the sm_100a structural checks of kernels/structure.py (each limit, on a report that breaks it; the cubin
parser on a compiled kernel) and the table `python -m jax_blockgemm.precompile --arch sm_100a --report` prints."""

import contextlib
import dataclasses
import io
import re
from unittest import mock

from absl.testing import absltest

from compiled_kernels import compiled
from jax_blockgemm import precompile
from jax_blockgemm.kernels import catalog, structure

_GEMM_AMAX_KEY = "gemm_amax.sm_100a.e5m2.bf16.sf32.t128x256.c2x1"  # a representative (compiled_kernels.py)
_PROJ_ROPE_KEY = "proj_rope.sm_100a.bf16.e4m3.sf32.t128x192.c1x1"


def _precompile_report(*argv: str) -> tuple[int, str]:
    """precompile's exit status and what it printed, for `--arch sm_100a --report` and `argv`."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = precompile.main(["--arch", "sm_100a", "--report", *argv])
    return rc, out.getvalue()


class ReportTest(absltest.TestCase):

    def test_one_row_per_variant(self):
        """A gemm_amax row (block-scaled MMA) and a proj_rope row (bf16 MMA, no scale vector), both passing."""
        rc, text = _precompile_report("--variant", _GEMM_AMAX_KEY, "--variant", _PROJ_ROPE_KEY)
        self.assertEqual(rc, 0, text)
        self.assertRegex(text, re.escape(_GEMM_AMAX_KEY) + r"\s+\d+\.\d\d kind::mxf8f6f4\s+block32\s+yes/yes\s+0\s+"
                               r"\d+\s+\d+\s+476/512\s+ok")
        self.assertRegex(text, re.escape(_PROJ_ROPE_KEY) + r"\s+\d+\.\d\d kind::f16\s+-\s+yes/yes\s+0\s+\d+\s+\d+\s+"
                                                           r"384/512\s+ok")
        self.assertIn("2 variants in", text)

    def test_a_failing_check_sets_the_exit_status(self):
        v = next(v for v in catalog.CATALOG if v.key == _GEMM_AMAX_KEY)
        done = compiled(v)  # compiled once per process: the report reads it instead of compiling again
        with mock.patch.object(catalog, "make_kernel", return_value=done.kernel), \
                mock.patch.object(catalog, "compile_function", return_value=done.fn), \
                mock.patch.object(structure.Sm100Report, "problems", return_value=["shared memory 300000 B > 232448"]):
            rc, text = _precompile_report("--variant", _GEMM_AMAX_KEY)
        self.assertEqual(rc, 1)
        self.assertIn("FAIL: shared memory 300000 B > 232448", text)

    def test_hopper_only_selection_is_refused(self):
        with self.assertRaisesRegex(SystemExit, "no sm_100a variant selected"):
            precompile.main(["--arch", "sm_90a", "--report"])


class StructureTest(absltest.TestCase):
    """The checks themselves: each limit, on a report that breaks it."""

    def _report(self, **changes):
        good = structure.Sm100Report(
            key="k", mma=("tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32.collector::a::discard",),
            has_alloc=True, has_dealloc=True, tmem_loads=8, tmem_load_waits=8, ptx_local=0,
            resources=structure.CubinResources(registers=52, frame_bytes=0, stack_bytes=0, static_smem_bytes=1024),
            dynamic_smem_bytes=200000, tmem_columns_used=264, tmem_columns_allocated=512, threads_per_cta=192,
            expect_kind="mxf8f6f4", expect_scale_vec="block32")
        return dataclasses.replace(good, **changes)

    def test_good_report_passes(self):
        self.assertEqual(self._report().problems(), [])

    def test_each_violation_is_named(self):
        cases = [
            (dict(mma=("tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block32",)), "MMA opcodes"),
            (dict(mma=("tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block16",)), "MMA opcodes"),
            (dict(mma=("tcgen05.mma.cta_group::1.kind::f16",)), "MMA opcodes"),
            (dict(mma=()), "MMA opcodes"),
            (dict(has_dealloc=False), "tcgen05.dealloc present=False"),
            (dict(tmem_load_waits=0), "8 tcgen05.ld but no tcgen05.wait::ld"),
            (dict(ptx_local=2), "local memory"),
            (dict(resources=structure.CubinResources(52, 16, 0, 1024)), "local memory"),
            (dict(dynamic_smem_bytes=232000), "shared memory 233024 B > 232448"),
            (dict(resources=structure.CubinResources(256, 0, 0, 0)), "256 registers"),
            (dict(tmem_columns_used=520), "tensor memory"),
            (dict(tmem_columns_allocated=1024, tmem_columns_used=600), "tensor memory"),
        ]
        for changes, match in cases:
            problems = self._report(**changes).problems()
            self.assertLen(problems, 1, changes)
            self.assertIn(match, problems[0])

    def test_spills_fail_every_kernel_but_the_wide_decode_objects(self):
        """Local memory is a defect in the tcgen05 kernels and in the decode kernel's objects of at most 16 tokens;
        its 64-token objects (operands in registers) may spill, which the report lists without failing them."""
        spilled = structure.CubinResources(registers=255, frame_bytes=440, stack_bytes=440, static_smem_bytes=1024)
        warp = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
        wide = self._report(mma=(), has_alloc=False, has_dealloc=False, tmem_loads=0, tmem_load_waits=0,
                            tmem_columns_used=0, tmem_columns_allocated=0, expect_kind="", expect_scale_vec="",
                            warp_mma=(warp,), expect_warp_mma=warp, threads_per_cta=256, dynamic_smem_bytes=0,
                            resources=spilled, spills_allowed=True)
        self.assertEqual(wide.problems(), [])
        narrow = dataclasses.replace(wide, spills_allowed=False)
        self.assertIn("local memory", " ".join(narrow.problems()))
        self.assertIn("local memory", " ".join(self._report(resources=spilled).problems()))
        dequantize = dataclasses.replace(narrow, warp_mma=(), expect_warp_mma="")
        self.assertIn("local memory", " ".join(dequantize.problems()))

    def test_the_16_token_decode_objects_hold_their_operands_in_128_registers(self):
        """The decode path of M <= 16 (two CTAs per SM): no local memory and at most 128 registers, for the H200's
        sm_90a objects and the sm_100a ones, in the two weight widths (FP8 and packed FP4 codes)."""
        for arch in ("sm_90a", "sm_100a"):
            for w in ("float8_e4m3fn", "float4_e2m1fn"):
                v = next(v for v in catalog.variants_for(arch, "weight_stream")
                         if v.tile_mn[1] == structure.DECODE_SPILL_FREE_TOKENS and v.ab_dtype == w
                         and v.sf_vec_size == 32 and v.c_dtype == "bfloat16")
                res = structure.cubin_resources(compiled(v).fn.__cubin__)
                self.assertEqual((res.frame_bytes, res.stack_bytes), (0, 0), v.key)
                self.assertLessEqual(res.registers, 128, v.key)
                if arch == "sm_100a":
                    report = structure.sm100_report(v, compiled(v).fn, compiled(v).kernel)
                    self.assertFalse(report.spills_allowed)
                    self.assertEqual(report.problems(), [], v.key)

    def test_cubin_parser_reads_a_compiled_kernel(self):
        v = next(v for v in catalog.CATALOG if v.key == _GEMM_AMAX_KEY)
        res = structure.cubin_resources(compiled(v).fn.__cubin__)
        self.assertGreater(res.registers, 16)
        self.assertLessEqual(res.registers, 255)
        with self.assertRaisesRegex(ValueError, "not an ELF64"):
            structure.cubin_resources(b"PK\x03\x04")


if __name__ == "__main__":
    absltest.main()
