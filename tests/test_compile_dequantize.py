"""CPU: the MXFP8 -> bf16 kernel of the MXFP8 proj_rope path (and, in the swap_ab column order, of the swap_ab ragged
kernel's tokens), compiled for sm_90a and sm_100a (about 0.2 s each, so every variant in the default tier): two
operands per launch, the bulk-copy path where operand 0's scales run along
the rows and the per-thread 16-byte path where they run along the columns, the hardware FP8 converter, no local
memory, programmatic dependent launch."""

import re

from absl.testing import absltest, parameterized

from compiled_kernels import compiled, named
from jax_blockgemm.kernels import catalog, structure
from jax_blockgemm.kernels import dequantize as dq


class DequantizeCompileTest(parameterized.TestCase):

    @parameterized.named_parameters(named(v for v in catalog.CATALOG if v.op == "dequantize"))
    def test_structure(self, v):
        c = compiled(v)
        ptx = c.ptx
        self.assertGreater(len(c.object_bytes), 1000)
        self.assertIn(f".target {v.arch}", ptx)
        count = lambda pattern: len(re.findall(pattern, ptx))
        if v.a_major == "k":  # both operands by bulk copies: every chunk in and out, converted shared -> shared
            per_operand = dq.STAGES
            self.assertEqual(count(r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes"),
                             2 * per_operand)
            self.assertEqual(count(r"cp\.async\.bulk\.global\.shared::cta\.bulk_group"), 2 * per_operand)
            self.assertEqual(count(r"cp\.async\.bulk\.wait_group\.read\s+0;"), 2)
            runs = 2 * dq.STAGES * dq.RUNS
            self.assertEqual(count(r"ld\.shared\.v2\.b32"), runs)  # a run's 8 codes
            if v.schedule == catalog.SWAP_AB:  # its 4 bf16 pairs, each to its column in the swap_ab order
                self.assertEqual((count(r"st\.shared\.v4\.b32"), count(r"st\.shared\.b32")), (0, 4 * runs))
            else:  # its 8 bf16 values
                self.assertEqual(count(r"st\.shared\.v4\.b32"), runs)
            self.assertEqual(count(r"ld\.global\.[vb]"), runs)  # its scale byte, one per run
            self.assertEqual(count(r"ld\.global\.u8|ld\.global\.b8"), runs)
            self.assertEqual(count(r"st\.global"), 0)
            converted = runs * dq.RUN
        else:  # per thread from global memory: operand 0 with 16 column scales, operand 1 with one row scale
            self.assertEqual(count(r"cp\.async\.bulk"), 0)
            self.assertEqual(count(r"ld\.global(?:\.nc)?\.v4\.b32"), 3)  # codes twice, column scales once
            self.assertEqual(count(r"ld\.global(?:\.nc)?\.(?:u8|b8)"), 1)
            self.assertEqual(count(r"st\.global\.v4\.b32"), 4)
            converted = 2 * dq.THREAD_RUN
        self.assertEqual(count(r"cvt\.rn\.f16x2\.e4m3x2"), converted // 2)
        self.assertEqual(count(r"cvt\.rn\.bf16x2\.f32"), converted // 2)
        self.assertNotIn(".local", ptx)
        self.assertNotRegex(ptx, r"mul\.ftz")  # scale byte 0 is the float32 subnormal 2^-127: no flushing
        # programmatic dependent launch: the next kernel may launch once every CTA started; each thread waits for
        # the previous grid before its first global access
        self.assertEqual(count(r"griddepcontrol\.launch_dependents"), 1)
        self.assertEqual(count(r"griddepcontrol\.wait"), 1)
        self.assertLess(ptx.index("griddepcontrol.wait"), min(ptx.index(x) for x in ("ld.global", "cp.async.bulk")
                                                             if x in ptx))
        if v.arch == "sm_100a":  # no tcgen05 at all, within the B200's limits
            self.assertEqual(structure.sm100_report(v, c.fn, c.kernel).problems(), [])


if __name__ == "__main__":
    absltest.main()
