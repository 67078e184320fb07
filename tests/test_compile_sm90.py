"""CPU: the sm_90a kernels compile without a GPU to the instructions their design rests on (docs/design/): FP8 or
FP4 codes dequantized to bf16 for the bf16 wgmma, TMA loads, the amax atomic, no local memory; proj_rope's
warp-specialized persistent schedule and its epilogue's instruction counts.

The default tier compiles one representative gemm_amax variant per class (compiled_kernels.py), both proj_rope
variants and every bf16 tile kernel (the bf16 grouped GEMM, the grouped contraction: their occupancy); the `catalog`
tier compiles every sm_90a gemm_amax variant and the deliberately broken kernels."""

import re

import pytest
from absl.testing import absltest, parameterized

import broken_kernels
import compiled_kernels
from compiled_kernels import compiled, named
from jax_blockgemm import arch
from jax_blockgemm.kernels import catalog, structure
from jax_blockgemm.kernels.sm90 import bf16_tile

_PTX_FP8 = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
_GEMM_AMAX = catalog.variants_for("sm_90a", "gemm_amax")
_SM90_SMEM_PER_CTA = 227 * 1024  # the most shared memory one sm_90 CTA may use (CUDA C++ Programming Guide)


class _GemmAmaxChecks(parameterized.TestCase):
    """The structural checks of one sm_90a gemm_amax variant (no tests of its own)."""

    def assert_gemm_amax_structure(self, v: catalog.KernelVariant) -> None:
        """A cubin for sm_90a with the bf16 wgmma over the tile's width, TMA loads, the amax atomic, no local memory
        or stack, at most 255 registers, and what each format, C dtype and operand major must compile to."""
        c = compiled(v)
        ptx = c.ptx
        self.assertGreater(len(c.object_bytes), 1000)
        self.assertIn(".target sm_90a", ptx)
        self.assertRegex(ptx, rf"wgmma\.mma_async\.sync\.aligned\.m64n{v.tile_mn[1]}k16\.f32\.bf16\.bf16")
        self.assertIn("cp.async.bulk.tensor", ptx)  # TMA loads
        self.assertIn("atom.global.max.s32", ptx)  # amax: integer atomic max on the float's bits
        self.assertNotIn(".local", ptx)
        resources = structure.cubin_resources(c.fn.__cubin__)
        self.assertEqual((resources.frame_bytes, resources.stack_bytes), (0, 0))
        self.assertLessEqual(resources.registers, 255)
        if v.ab_dtype == "float4_e2m1fn":
            # FP4: no FP8 converter; per k-tile each consumer thread converts 8 rows (4 of A, 4 of B) of 16 codes:
            # one 8-byte shared load and 8 output words of 2 packed bf16 multiplies each; the first k-tile before
            # the mainloop, then once inside it.
            self.assertNotRegex(ptx, r"cvt\.rn\.f16x2\.e[45]m[23]x2")
            self.assertEqual(ptx.count("ld.shared.v2.b32"), 2 * 8)
            self.assertEqual(len(re.findall(r"(?:mul|fma\.rn)\.bf16x2", ptx)), 2 * 8 * 8 * 2)
        else:  # FP8 codes become bf16 exactly through the hardware FP8 converter
            self.assertIn(f"cvt.rn.f16x2.{_PTX_FP8[v.ab_dtype]}x2", ptx)
        # C: 64 accumulator values per thread (two 64-row warpgroups x 128 columns / 128 threads).
        conversions = {"float16": ("cvt.rn.f16.f32", 64), "float8_e4m3fn": ("cvt.rn.satfinite.e4m3x2.f32", 32),
                       "float8_e5m2": ("cvt.rn.satfinite.e5m2x2.f32", 32)}
        if v.c_dtype in conversions:
            instruction, count = conversions[v.c_dtype]
            self.assertEqual(ptx.count(instruction), count)
        if v.c_dtype in ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"):
            self.assertIn("st.global.b8", ptx)  # byte stores of codes (FP8) or packed pairs (FP4)
        if v.c_dtype == "float4_e2m1fn":  # software round-to-nearest-even to E2M1: 7 threshold compares per value
            self.assertNotIn("cvt.rn.satfinite", ptx)
            self.assertGreaterEqual(len(re.findall(r"setp\.(?:gt|ge)\.f32", ptx)), 7 * 64)
        # The wgmma's transpose flags: 1 for an MN-major operand's bf16 tile (imm-trans-a, imm-trans-b).
        flags = set(re.findall(r"wgmma\.mma_async[^;]*, p, 1,\s*1, (\d), (\d);", ptx))
        self.assertEqual(flags, {(str(int(v.a_major == "m")), str(int(v.b_major == "n")))})
        if v.a_major + v.b_major != "kk":  # per k-tile and operand: 4 passes of 16 rows at one k, 16 scale words
            self.assertEqual(ptx.count("ld.shared.v4.b32"), 2 * 8 + 2)
            # Scale words (16 per MN-major operand, 4 per K-major one): before the first tile, ahead of tile 1 and
            # in the mainloop; with both operands MN-major, right before each conversion instead (setup + loop).
            self.assertEqual(ptx.count("ld.global.b32"), 3 * 20 if v.a_major + v.b_major != "mn" else 2 * 32)
        if catalog.takes_alpha(v):  # alpha[l] times each of the 64 accumulator values, before amax and conversion
            self.assertGreaterEqual(len(re.findall(r"mul\.(?:rn\.)?f32", ptx)), 64)
            self.assertTrue(c.kernel.has_alpha)


class GemmAmaxTest(_GemmAmaxChecks):
    """One variant per sm_90a gemm_amax class, and the broken kernel the GPU self-check tests must see fail."""

    @parameterized.named_parameters(named(compiled_kernels.representatives(_GEMM_AMAX)))
    def test_structure(self, v):
        self.assert_gemm_amax_structure(v)

    def test_broken_kernel_compiles_as_its_base(self):
        """The deliberately wrong kernel is the real one plus a second launch: the same structure."""
        self.assert_gemm_amax_structure(broken_kernels.NEGATED_CORNER)


@pytest.mark.catalog
class GemmAmaxCatalogTest(_GemmAmaxChecks):
    """Every sm_90a gemm_amax variant and every deliberately broken kernel."""

    @parameterized.named_parameters(named(_GEMM_AMAX + broken_kernels.BROKEN))
    def test_structure(self, v):
        self.assert_gemm_amax_structure(v)


class ProjRopeTest(parameterized.TestCase):
    """The staged proj_rope kernel, both w layouts (each about a second to compile)."""

    @parameterized.named_parameters(named(catalog.variants_for("sm_90a", "proj_rope")))
    def test_bf16_wgmma_tma_and_the_epilogue_instructions(self, v):
        ptx = compiled(v).ptx
        self.assertGreater(len(compiled(v).object_bytes), 1000)
        self.assertIn(".target sm_90a", ptx)
        self.assertRegex(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n192k16\.f32\.bf16\.bf16")
        self.assertIn("cp.async.bulk.tensor", ptx)
        self.assertNotRegex(ptx, r"st\.shared\.(u8|b8)")
        self.assertNotIn(".local", ptx)  # the accumulator and the rope tables stay in registers
        # Epilogue warpgroup (kernels/token_rows.py, kernels/sm90/y_tile.py): one token per thread. RoPE in
        # place in Y (2 blocks: 16 16-byte loads and stores), then one loop body for all 6 blocks: 8 16-byte
        # loads of the row, 32 4-byte loads of the lane's column across the warp's rows, one 4-byte store of the
        # column factor and 8 broadcast 16-byte loads of the warp's 32 factors, a ballot of the NaN/inf columns;
        # 31 + 31 NaN-propagating abs-max; 32 pair conversions; the block's codes into two boxes in Y (4 16-byte
        # stores), a proxy fence and one TMA store per output, one bulk group. After the loop: the rowwise scale
        # runs (3 x 2 shuffles and 16-bit stores), one wait for the TMA's reads. No global code stores, no
        # butterflies.
        self.assertEqual(ptx.count("cvt.rn.satfinite.e4m3x2.f32"), 32)
        self.assertEqual(ptx.count("ld.shared.v4.b32"), 16 + 8 + 8)
        self.assertEqual(ptx.count("st.shared.v4.b32"), 16 + 4)
        self.assertEqual(ptx.count("ld.shared.b32"), 32)
        self.assertEqual(ptx.count("st.shared.b32"), 1)
        self.assertEqual(ptx.count("max.NaN.f32"), 62)
        self.assertEqual(ptx.count("@p st.global.v4.b32"), 0)
        self.assertEqual(ptx.count("cp.async.bulk.tensor.3d.global.shared::cta"), 2)
        self.assertEqual(ptx.count("cp.async.bulk.commit_group"), 1)
        self.assertEqual(ptx.count("cp.async.bulk.wait_group.read"), 1)
        self.assertEqual(ptx.count("fence.proxy.async.shared::cta"), 1)
        self.assertEqual(ptx.count("@p st.global.b16"), 3)
        self.assertEqual(len(re.findall(r"vote\.sync\.ballot", ptx)), 1)
        self.assertNotRegex(ptx, r"shfl\.sync\.bfly")

    @parameterized.named_parameters(named(catalog.variants_for("sm_90a", "proj_rope")))
    def test_persistent_structure(self, v):
        """A grid-strided tile loop; a fourth (epilogue) warpgroup and the two barriers of 384 threads that hand it
        the fp32 tile, none of 256 (both MMA warpgroups read every stage); registers split 40/128/216, no spills, and
        shared memory (the stages + the fp32 tile) within one sm_90 CTA's, with no room for one more stage."""
        c = compiled(v)
        ptx, kernel = c.ptx, c.kernel
        self.assertIn("%nctaid.x", ptx)  # tiles cta, cta + grid, ...
        self.assertNotRegex(ptx, r"bar\.(sync|arrive)\s+%r\d+, 256;")
        threads = 512
        for bar in (1, 2):  # Y full (1) and Y empty (2): each synced by one side, arrived on by the other
            self.assertRegex(ptx, rf"bar\.sync\s+{bar}, 384;")
            self.assertRegex(ptx, rf"bar\.arrive\s+{bar}, 384;")
        self.assertNotRegex(ptx, r"bar\.sync\s+%r\d+, 128;")
        self.assertIn("setmaxnreg.inc.sync.aligned.u32 \t216", ptx)
        self.assertEqual(ptx.count("st.shared.v2.b32"), 48)  # the 96 accumulators of an MMA thread into Y
        self.assertIn("setmaxnreg.dec.sync.aligned.u32 \t40", ptx)
        self.assertIn(f".reqntid {threads}, 1, 1", ptx)
        resources = structure.cubin_resources(c.fn.__cubin__)
        self.assertEqual((resources.frame_bytes, resources.stack_bytes), (0, 0))
        self.assertLessEqual(resources.registers, 65536 // threads)
        smem = kernel.shared_storage.size_in_bytes() + resources.static_smem_bytes
        self.assertLessEqual(smem, _SM90_SMEM_PER_CTA)
        stage_bytes = (kernel.tile_mnk[0] + 192) * kernel.tile_mnk[2] * 2  # a bf16 tile of x and one of w
        self.assertGreater(smem, _SM90_SMEM_PER_CTA - stage_bytes)  # no room left for one more stage

    def test_pdl_waits_for_the_previous_grid_before_any_global_access(self):
        """Programmatic dependent launch: one launch_dependents and one griddepcontrol.wait, the wait before the
        first TMA load and the first global load."""
        ptx = compiled(catalog.variants_for("sm_90a", "proj_rope")[0]).ptx
        self.assertEqual(ptx.count("griddepcontrol.launch_dependents"), 1)
        self.assertEqual(ptx.count("griddepcontrol.wait"), 1)
        wait = ptx.index("griddepcontrol.wait")
        for access in ("cp.async.bulk.tensor", "ld.global"):
            self.assertLess(wait, ptx.index(access), access)



_BF16_TILE = ([v for v in catalog.variants_for("sm_90a", "ragged") if v.ab_dtype == "bfloat16"]
              + list(catalog.variants_for("sm_90a", "contraction")))


class Bf16TileStructureTest(parameterized.TestCase):
    """The bf16 tile kernels (kernels/sm90/bf16_tile.py: the bf16 grouped GEMM, the grouped contraction) fit the
    occupancy their tile is built for: the registers and shared memory of `TILE_COLUMNS`' CTAs per SM."""

    @parameterized.named_parameters(named(_BF16_TILE))
    def test_structure(self, v):
        """TMA loads, the bf16 wgmma over the tile's columns with each operand's transpose flag, no local memory;
        CTAs per SM x threads x registers within the SM's 64 K registers and x shared memory within its 228 KB."""
        c = compiled(v)
        ptx, kernel = c.ptx, c.kernel
        self.assertEqual(kernel.tile_mnk[:2], v.tile_mn)
        self.assertIn(".target sm_90a", ptx)
        self.assertIn("cp.async.bulk.tensor", ptx)
        self.assertRegex(ptx, rf"wgmma\.mma_async\.sync\.aligned\.m64n{v.tile_mn[1]}k16\.f32\.bf16\.bf16")
        flags = set(re.findall(r"wgmma\.mma_async[^;]*, p, 1,\s*1, (\d), (\d);", ptx))
        self.assertEqual(flags, {(str(int(v.a_major == "m")), str(int(v.b_major == "n")))})
        self.assertNotIn(".local", ptx)
        resources = structure.cubin_resources(c.fn.__cubin__)
        self.assertEqual((resources.frame_bytes, resources.stack_bytes), (0, 0))
        ctas, stages = bf16_tile.TILE_COLUMNS[v.tile_mn[1]]
        self.assertEqual((kernel.ctas_per_sm, kernel.ab_stages), (ctas, stages))
        self.assertLessEqual(ctas * kernel.threads_per_cta * resources.registers, 64 * 1024)
        smem = kernel.shared_storage.size_in_bytes() + resources.static_smem_bytes
        self.assertLessEqual(smem, _SM90_SMEM_PER_CTA)
        self.assertLessEqual(ctas * smem, 228 * 1024)

    def test_the_ragged_tile_is_the_tables(self):
        """The catalog's bf16 grouped GEMMs are built with arch.TABLE's tile; the contraction keeps 128 x 128."""
        tiles = {(v.op, v.tile_mn) for v in _BF16_TILE}
        self.assertEqual(tiles, {("ragged", arch.policy("sm_90a").ragged_bf16_tile), ("contraction", (128, 128))})


class QuantizePairStructureTest(parameterized.TestCase):

    @parameterized.named_parameters(named(catalog.variants_for("sm_90a", "quantize_pair")))
    def test_structure(self, v):
        """The pair quantization: 32 cp.async of 16 bytes per lane (a tile's rows), the magnitudes' maxima as u16x2
        integer maxima, hardware FP8 conversions both ways for the row blocks' format, RNE to bf16, no MMA, no local
        memory, at most 128 registers (three CTAs per SM) and the tiles' shared memory within the per-CTA limit."""
        c = compiled(v)
        ptx = c.ptx
        row, col = _PTX_FP8[v.ab_dtype], _PTX_FP8[v.c_dtype]
        self.assertIn(".target sm_90a", ptx)
        self.assertEqual(len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)), 32)
        self.assertIn("max.u16x2", ptx)
        self.assertIn(f"cvt.rn.satfinite.{row}x2.f32", ptx)
        self.assertIn(f"cvt.rn.satfinite.{col}x2.f32", ptx)
        self.assertIn(f"cvt.rn.f16x2.{row}x2", ptx)
        self.assertIn("cvt.rn.bf16x2.f32", ptx)
        self.assertNotRegex(ptx, r"\b(w?gmma|mma\.sync)")
        self.assertNotIn(".local", ptx)
        resources = structure.cubin_resources(c.fn.__cubin__)
        self.assertEqual((resources.frame_bytes, resources.stack_bytes), (0, 0))
        self.assertLessEqual(resources.registers, 128)
        smem = c.kernel.shared_storage.size_in_bytes() + resources.static_smem_bytes
        self.assertLessEqual(3 * smem, 228 * 1024)  # three CTAs fit an SM's shared memory
        gather = v.schedule in (catalog.GATHER, catalog.GATHER_VALUES)
        # the GATHER schedules: one map entry per lane (one global load: the kernel's only one), handed to every
        # lane by an index shuffle per row (32 for the copies, one per row of the store loop, unrolled twice)
        self.assertEqual(len(re.findall(r"ld\.global", ptx)), int(gather))
        shuffles = len(re.findall(r"shfl\.sync\.idx", ptx))
        self.assertTrue(34 <= shuffles <= 36 if gather else shuffles < 32, shuffles)
        # values along the rows as 16-byte stores (the store loop unrolled twice), along the columns too for
        # GATHER_VALUES, whose column blocks leave no codes (8-byte stores)
        col_values = v.schedule == catalog.GATHER_VALUES
        self.assertEqual(len(re.findall(r"st\.global\.v4", ptx)), 4 if col_values else 2)
        self.assertEqual(len(re.findall(r"st\.global\.v2", ptx)), 0 if col_values else 2)


if __name__ == "__main__":
    absltest.main()
