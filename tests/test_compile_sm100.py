"""CPU: the sm_100a kernels (never run here: no Blackwell GPU) compile to block-scaled or bf16 tcgen05 MMAs fed by
TMA, with tensor memory allocated and freed, and pass the B200 limits of kernels/structure.py.

The default tier compiles one representative gemm_amax variant per class and one proj_rope variant
(compiled_kernels.py); the `catalog` tier compiles every sm_100a gemm_amax and proj_rope variant."""

import re

import pytest
from absl.testing import absltest, parameterized

import compiled_kernels
from compiled_kernels import compiled, named
from jax_blockgemm.kernels import catalog, structure

_GEMM_AMAX = catalog.variants_for("sm_100a", "gemm_amax")
_PROJ_ROPE = catalog.variants_for("sm_100a", "proj_rope")


class _Checks(parameterized.TestCase):
    """The structural checks of one sm_100a variant (no tests of its own)."""

    def assert_gemm_amax_structure(self, v: catalog.KernelVariant) -> None:
        """Block-scaled tcgen05 MMA of the right kind and scale-vector size, tensor memory allocated and freed, no
        local memory, shared memory, registers and tensor-memory columns within the B200's limits."""
        c = compiled(v)
        ptx = c.ptx
        self.assertGreater(len(c.object_bytes), 1000)
        self.assertIn(".target sm_100a", ptx)
        report = structure.sm100_report(v, c.fn, c.kernel)
        self.assertEqual(report.problems(), [])
        kind = "mxf4nvf4" if v.ab_dtype == "float4_e2m1fn" else "mxf8f6f4"
        self.assertEqual(report.mma, (f"tcgen05.mma.cta_group::1.kind::{kind}.block_scale.block{v.sf_vec_size}"
                                      ".collector::a::discard",))
        self.assertIn("tcgen05.cp.cta_group::1.32x128b.warpx4", ptx)  # scale factors: shared -> tensor memory
        self.assertIn("tcgen05.ld.sync.aligned", ptx)  # epilogue: tensor memory -> registers
        self.assertIn("cp.async.bulk.tensor", ptx)  # TMA loads
        self.assertEqual("multicast::cluster" in ptx, v.cluster_mn != (1, 1))
        self.assertIn("atom.global.max.s32", ptx)  # amax: integer atomic max on the float's bits
        # C leaves by TMA stores of shared-memory sub-tiles, never by per-element global stores: each thread writes
        # its row of a sub-tile with 16-byte shared stores, fenced for the TMA, and a staging buffer is reused only
        # once the store that read it has.
        self.assertIn("cp.async.bulk.tensor.3d.global.shared::cta", ptx)
        self.assertNotIn("st.global", ptx)
        self.assertIn("fence.proxy.async.shared::cta", ptx)
        self.assertIn("cp.async.bulk.wait_group.read", ptx)
        wide_stores = len(re.findall(r"st\.shared\.(v4\.b32|v2\.b64)\s", ptx))  # 16 bytes each
        self.assertEqual(wide_stores, c.kernel.epi_columns * (4 if v.c_dtype == "float32" else 2) // 16)
        # Two accumulator buffers for every tile, then one column per 4 scale blocks of a k-tile for SFA and for
        # each 128 columns of SFB (a k-tile is 128 FP8 or 256 FP4 elements), all within the 512 columns.
        blocks = (256 if v.ab_dtype == "float4_e2m1fn" else 128) // v.sf_vec_size
        scale_columns = blocks * (1 + v.tile_mn[1] // 128)
        k = c.kernel
        self.assertEqual(k.acc_buffers, 2)
        self.assertEqual(report.tmem_columns_used, k.acc_buffer_columns + v.tile_mn[1] + scale_columns)
        self.assertLessEqual(report.tmem_columns_used, 512)
        if v.tile_mn[1] == 128:
            self.assertEqual(k.acc_buffer_columns, 128)  # side by side
        else:
            # 2 x 256 leaves no room for the scales: the second buffer starts inside the first by at least the
            # scales' columns, and the epilogue hands a buffer back only once it has read every shared column.
            shared = 256 - k.acc_buffer_columns
            self.assertGreaterEqual(shared, scale_columns)
            self.assertGreaterEqual((k.acc_release_subtile + 1) * k.epi_columns, shared)
            self.assertLess(k.acc_release_subtile + 1, 256 // k.epi_columns)  # and before the last sub-tile
        # The host function reads max_ctas (the argument before the stream) to size the persistent grid.
        host = str(c.fn.ir_module)
        body = host[host.index("llvm.func @cutlass___call__"):]
        body = body[body.index("{\n"):body.index("\n  }\n")]
        self.assertRegex(body, rf"%arg{6 + catalog.takes_alpha(v) + 4}\b")

    def assert_proj_rope_structure(self, v: catalog.KernelVariant) -> None:
        """bf16 tcgen05 MMA (kind::f16, no block scales) from TMA-fed shared memory into tensor memory, the epilogue
        from tensor memory in fp32 (32x32b loads, waited for), no local memory, within the B200's limits, and as many
        operand stages as shared memory holds."""
        c = compiled(v)
        ptx = c.ptx
        self.assertGreater(len(c.object_bytes), 1000)
        self.assertIn(".target sm_100a", ptx)
        report = structure.sm100_report(v, c.fn, c.kernel)
        self.assertEqual(report.problems(), [])
        self.assertEqual(report.mma, ("tcgen05.mma.cta_group::1.kind::f16.collector::a::discard",))
        self.assertEqual(ptx.count("tcgen05.mma.cta_group"), 4)  # a 64-wide k-tile is 4 k16 MMAs, unrolled
        self.assertIn("cp.async.bulk.tensor", ptx)  # TMA loads
        self.assertNotIn("multicast::cluster", ptx)
        # Six 32-column loads per tile (4 pass-through blocks, 2 rope inputs), each waited for before use/release.
        self.assertEqual(ptx.count("tcgen05.ld.sync.aligned.32x32b.x32.b32"), 6)
        self.assertEqual(ptx.count("tcgen05.wait::ld"), 5)
        # Per block of 32 features: 16 rowwise + 16 columnwise pairs to E4M3, straight from fp32; 31 butterfly
        # shuffles (the transposing column max) and 32 scale-byte broadcasts.
        self.assertEqual(ptx.count("cvt.rn.satfinite.e4m3x2.f32"), 6 * 32)
        self.assertEqual(ptx.count("shfl.sync.bfly"), 6 * 31)
        self.assertNotRegex(ptx, r"cvt\.rn(\.satfinite)?\.bf16")  # no bf16 staging of the accumulator (SPEC §5)
        # Codes leave as 16-byte stores (2 x 2 per block), the rope tables arrive as 16-byte loads.
        self.assertEqual(ptx.count("st.global.v4.b32"), 6 * 4)
        self.assertEqual(ptx.count("ld.global.v4.b32"), 2 * 8)
        self.assertEqual(report.tmem_columns_used, 2 * 192)  # two accumulator stages of one head
        self.assertGreater(report.smem_bytes + c.kernel.tma_bytes, structure.SM100_SMEM_PER_CTA)  # no room for one more


class CompileTest(_Checks):
    """One variant per sm_100a kernel class."""

    @parameterized.named_parameters(named(compiled_kernels.representatives(_GEMM_AMAX)))
    def test_gemm_amax_structure(self, v):
        self.assert_gemm_amax_structure(v)

    @parameterized.named_parameters(named(compiled_kernels.representatives(_PROJ_ROPE)))
    def test_proj_rope_structure(self, v):
        self.assert_proj_rope_structure(v)

    def test_tmem_load_gives_each_thread_one_token(self):
        """The proj_rope epilogue's premise: the 32x32b x32 load of a 128 x 32 accumulator block gives thread s row
        (token) s and its value i column (feature) i of the block, for every thread of the 4 epilogue warps."""
        import cutlass
        import cutlass.cute as cute
        import cutlass.utils.blackwell_helpers as sm100_utils
        from cutlass.cute.nvgpu import tcgen05
        from cutlass.cutlass_dsl import CuTeDSL

        seen = {}

        @cute.jit
        def probe():
            mma = sm100_utils.make_trivial_tiled_mma(
                cutlass.BFloat16, cutlass.BFloat16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
                cutlass.Float32, tcgen05.CtaGroup.ONE, (128, 192))
            acc = mma.make_fragment_C(cute.append(mma.partition_shape_C((128, 192)), 2))
            blocks = cute.flat_divide(acc[((None, None), 0, 0, None)], (128, 32))
            t2r = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32),
                                                             cutlass.Float32), blocks[(None, None, 0, 0, 0)])
            for s in list(range(128)):  # a Python list, not a DSL loop: static thread indices, static coordinates
                c = t2r.get_slice(s).partition_D(cute.make_identity_tensor((128, 32)))
                seen[s] = [tuple(c[i]) for i in range(cute.size(c))]

        envar = CuTeDSL._get_dsl().envar
        saved = envar._arch
        envar.arch = "sm_100a"
        try:
            cute.compile(probe)
        finally:
            envar._arch = saved
        self.assertEqual(seen, {s: [(s, i) for i in range(32)] for s in range(128)})


@pytest.mark.catalog
class CatalogCompileTest(_Checks):
    """Every sm_100a gemm_amax and proj_rope variant."""

    @parameterized.named_parameters(named(_GEMM_AMAX))
    def test_gemm_amax_structure(self, v):
        self.assert_gemm_amax_structure(v)

    @parameterized.named_parameters(named(_PROJ_ROPE))
    def test_proj_rope_structure(self, v):
        self.assert_proj_rope_structure(v)


if __name__ == "__main__":
    absltest.main()
