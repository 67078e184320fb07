"""CPU (CI): every catalog kernel compiles for its architecture without a GPU and exports the ABI the FFI handler
is written against; the Hopper ones hold the bf16 wgmma, the Blackwell ones (never run: no Blackwell GPU here)
pass the structural checks of kernels/structure.py. Also the host-side layout math the kernels rely on."""

import contextlib
import dataclasses
import io
import os
import re
import tempfile
from unittest import mock

import numpy as np
from absl.testing import absltest, parameterized

try:
    from jax_blockgemm.kernels import catalog, common, structure
    from jax_blockgemm.kernels.sm90.gemm_amax import HopperMxf8GemmAmax
    from jax_blockgemm.kernels.sm100.gemm_amax import BlackwellBlockScaledGemmAmax
except ImportError as e:  # pragma: no cover - CuTeDSL is a hard dependency of this test file
    raise absltest.SkipTest(f"CuTeDSL not importable: {e}")

_ABI_TENSORS = ("a", "b", "sfa", "sfb", "c", "amax")
_PROJ_ROPE_ABI_TENSORS = ("x", "w", "cos", "sin", "x_scale", "w_scale", "row_codes", "row_scales", "col_codes",
                          "col_scales")
_PROJ_ROPE_VARIANTS = [v for v in catalog.CATALOG if v.op == "proj_rope"]
_PTX_AB = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
_WIDE_C = ("float32", "bfloat16")  # the original sm_90a MXFP8 variants; the rest: Sm90SurfaceCompileTest
_ALPHA_ABI_TENSORS = ("a", "b", "sfa", "sfb", "c", "amax", "alpha")
_COMPILED = {}  # key -> (ptx, object bytes, header text, compiled function, kernel): each variant compiled once


def _compiled(v: "catalog.KernelVariant"):
    if v.key not in _COMPILED:
        kernel = catalog.make_kernel(v)
        fn = catalog.compile_function(v, keep_ptx=True, kernel=kernel)
        with tempfile.TemporaryDirectory() as d:
            fn.export_to_c(d, v.function_prefix, function_prefix=v.function_prefix)
            with open(os.path.join(d, v.function_prefix + ".h")) as f:
                header = f.read()
        _COMPILED[v.key] = (fn.__ptx__, fn.dump_to_object(v.function_prefix), header, fn, kernel)
    return _COMPILED[v.key]


def _assert_tma_amax_no_spills(test: absltest.TestCase, ptx: str, fn) -> None:
    """An sm_90a gemm_amax kernel's common structure: TMA loads, the amax atomic, no local memory, no frame or
    stack in the cubin, at most 255 registers."""
    test.assertIn("cp.async.bulk.tensor", ptx)
    test.assertIn("atom.global.max.s32", ptx)
    test.assertNotIn(".local", ptx)
    resources = structure.cubin_resources(fn.__cubin__)
    test.assertEqual((resources.frame_bytes, resources.stack_bytes), (0, 0))
    test.assertLessEqual(resources.registers, 255)


class CatalogTest(parameterized.TestCase):

    def test_keys_are_unique_and_prefixes_are_c_identifiers(self):
        keys = [v.key for v in catalog.CATALOG]
        self.assertLen(set(keys), len(keys))
        for v in catalog.CATALOG:
            self.assertRegex(v.key, r"^[0-9A-Za-z_.]+$")
            self.assertRegex(v.function_prefix, r"^[A-Za-z_][0-9A-Za-z_]*$")
        self.assertEqual(catalog.KernelVariant().key, "gemm_amax.sm_90a.e4m3.f32.sf32.t128x128.c1x1")

    def test_sm90a_covers_both_fp8_codes_and_both_outputs(self):
        got = {(v.ab_dtype, v.c_dtype, v.sf_dtype, v.sf_vec_size, v.a_major, v.b_major)
               for v in catalog.variants_for("sm_90a", "gemm_amax")}
        fp8 = {(a, c, "float8_e8m0fnu", 32, "k", "k") for a in ("float8_e4m3fn", "float8_e5m2")
               for c in ("float32", "bfloat16", "float16")}
        # FP4 operands: every C dtype SPEC allows them (FP8 and packed FP4 C only with FP4 operands).
        fp4 = {("float4_e2m1fn", c, sf, v, "k", "k") for sf, v in (("float8_e8m0fnu", 32), ("float8_e4m3fn", 16))
               for c in ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn")}
        # MN-major FP8 operands, f32/bf16/f16 C (c_major="m" runs these on (B, A)).
        mn = {(a, c, "float8_e8m0fnu", 32, am, bm) for a in ("float8_e4m3fn", "float8_e5m2")
              for c in ("float32", "bfloat16", "float16") for am, bm in (("m", "k"), ("k", "n"), ("m", "n"))}
        self.assertEqual(got, fp8 | fp4 | mn)
        self.assertTrue(all(catalog.takes_alpha(v) == (v.sf_dtype == "float8_e4m3fn")
                            for v in catalog.variants_for("sm_90a", "gemm_amax")))
        self.assertEqual(catalog.variants_for("sm_75"), ())
        rope = catalog.variants_for("sm_90a", "proj_rope")
        self.assertEqual({v.key for v in rope}, {"proj_rope.sm_90a.bf16.e4m3.sf32.t128x192.c1x1.staged",
                                                 "proj_rope.sm_90a.bf16.e4m3.sf32.t128x192.c1x1.bn.staged"})
        self.assertEqual(len({v.key for v in catalog.CATALOG}), len(catalog.CATALOG))

    def test_sm100a_proj_rope_variants_cover_both_w_layouts(self):
        rope = catalog.variants_for("sm_100a", "proj_rope")
        self.assertEqual({(v.tile_mn, v.b_major, v.ab_dtype, v.c_dtype) for v in rope},
                         {((128, 192), b, "bfloat16", "float8_e4m3fn") for b in ("k", "n")})
        self.assertEqual({v.key for v in rope}, {"proj_rope.sm_100a.bf16.e4m3.sf32.t128x192.c1x1",
                                                 "proj_rope.sm_100a.bf16.e4m3.sf32.t128x192.c1x1.bn"})

    def test_select_variant(self):
        cfg = dict(arch="sm_90a", ab_dtype="float8_e5m2", c_dtype="bfloat16", sf_vec_size=32)
        v = catalog.select_variant(**cfg, tile_mn=(128, 128), cluster_mn=(1, 1))
        self.assertEqual((v.ab_dtype, v.c_dtype, v.arch), ("float8_e5m2", "bfloat16", "sm_90a"))
        self.assertIsNone(catalog.select_variant(**cfg, tile_mn=(128, 256), cluster_mn=(1, 1)))
        self.assertIsNone(catalog.select_variant(**{**cfg, "sf_vec_size": 16}, tile_mn=(128, 128), cluster_mn=(1, 1)))
        self.assertIsNone(catalog.select_variant(**{**cfg, "arch": "sm_75"}, tile_mn=(128, 128), cluster_mn=(1, 1)))
        wide = catalog.select_variant(**{**cfg, "arch": "sm_100a"}, tile_mn=(128, 256), cluster_mn=(2, 4))
        self.assertEqual((wide.arch, wide.tile_mn, wide.cluster_mn), ("sm_100a", (128, 256), (2, 4)))
        self.assertIsNone(catalog.select_variant(**{**cfg, "arch": "sm_100a"}, tile_mn=(256, 128), cluster_mn=(2, 1)))

    def test_fp4_kernels_can_implement_needs_32_aligned_k(self):
        fp4 = BlackwellBlockScaledGemmAmax(ab_dtype="float4_e2m1fn", sf_vec_size=16, sf_dtype="float8_e4m3fn")
        self.assertEqual(fp4.can_implement(100, 100, 64, 1), (True, ""))
        self.assertIn("multiple of 32", fp4.can_implement(100, 100, 48, 1)[1])

    def test_sm100a_fp4_variants(self):
        fp4 = {(v.sf_vec_size, v.sf_dtype, v.c_dtype, v.tile_mn, v.cluster_mn) for v in catalog.variants_for("sm_100a")
               if v.ab_dtype == "float4_e2m1fn"}
        clusters = ((1, 1), (2, 1), (1, 2), (2, 2))
        want = {(32, "float8_e8m0fnu", c, t, cl) for c in ("float32", "bfloat16") for t in ((128, 128), (128, 256))
                for cl in clusters}
        want |= {(16, sf, c, (128, 128), cl) for sf in ("float8_e8m0fnu", "float8_e4m3fn")
                 for c in ("float32", "bfloat16") for cl in clusters}
        self.assertEqual(fp4, want)
        keys = {v.key for v in catalog.variants_for("sm_100a")}
        self.assertIn("gemm_amax.sm_100a.e2m1.bf16.sf16e4m3.t128x128.c2x1", keys)
        self.assertIn("gemm_amax.sm_100a.e2m1.f32.sf16.t128x128.c1x1", keys)

    def test_sm100a_covers_the_seed_mxfp8_surface(self):
        got = {(v.ab_dtype, v.c_dtype, v.tile_mn, v.cluster_mn) for v in catalog.variants_for("sm_100a", "gemm_amax")
               if v.ab_dtype != "float4_e2m1fn"}
        clusters = {(cm, cn) for cm in (1, 2, 4) for cn in (1, 2, 4)}
        self.assertEqual(got, {(a, c, t, cl) for a in ("float8_e4m3fn", "float8_e5m2") for c in ("float32", "bfloat16")
                               for t in ((128, 128), (128, 256)) for cl in clusters})
        self.assertTrue(all(v.sf_vec_size == 32 and v.sf_dtype == "float8_e8m0fnu" and not v.flavor
                            for v in catalog.variants_for("sm_100a") if v.ab_dtype != "float4_e2m1fn"))

    def test_test_variants_are_never_selected(self):
        for v in catalog.TEST_VARIANTS:
            self.assertNotIn(v, catalog.CATALOG)
            self.assertTrue(v.flavor)
            self.assertTrue(v.key.endswith("." + v.flavor))
            same = dict(arch=v.arch, ab_dtype=v.ab_dtype, c_dtype=v.c_dtype, sf_vec_size=v.sf_vec_size)
            self.assertEqual(catalog.select_variant(**same, tile_mn=v.tile_mn, cluster_mn=v.cluster_mn),
                             dataclasses.replace(v, flavor=""))

    def test_source_hash_is_stable_hex(self):
        self.assertRegex(catalog.kernel_source_hash(), r"^[0-9a-f]{64}$")
        self.assertEqual(catalog.kernel_source_hash(), catalog.kernel_source_hash())

    def test_make_kernel_rejects_unknown_variant(self):
        with self.assertRaisesRegex(ValueError, "not in the catalog"):
            catalog.make_kernel(catalog.KernelVariant(tile_mn=(64, 64)))

    @parameterized.parameters(
        dict(kwargs=dict(ab_dtype="float16"), match="ab_dtype='float16'"),
        dict(kwargs=dict(c_dtype="int8"), match="c_dtype='int8'"),
        dict(kwargs=dict(sf_vec_size=16), match="(sf_dtype, sf_vec_size)=('float8_e8m0fnu', 16)"),
        dict(kwargs=dict(ab_dtype="float4_e2m1fn", sf_dtype="float8_e4m3fn"),
             match="(sf_dtype, sf_vec_size)=('float8_e4m3fn', 32)"),
        dict(kwargs=dict(a_major="n"), match="a_major='n'"),
        dict(kwargs=dict(ab_dtype="float4_e2m1fn", b_major="n"), match="MN-major operands need FP8 codes"))
    def test_kernel_config_errors_name_the_argument(self, kwargs, match):
        with self.assertRaisesRegex(ValueError, re.escape(match)):
            HopperMxf8GemmAmax(**kwargs)

    @parameterized.parameters(
        dict(kwargs=dict(ab_dtype="float16"), match="ab_dtype='float16'"),
        dict(kwargs=dict(c_dtype="float8_e4m3fn"), match="c_dtype='float8_e4m3fn'"),
        dict(kwargs=dict(sf_vec_size=16), match="sf_vec_size=16 with sf_dtype='float8_e8m0fnu' is not supported for "
                                                "ab_dtype='float8_e4m3fn'"),
        dict(kwargs=dict(ab_dtype="float4_e2m1fn", sf_dtype="float8_e4m3fn"), match="sf_vec_size=32 with sf_dtype"),
        dict(kwargs=dict(ab_dtype="float4_e2m1fn", sf_vec_size=16, tile_mn=(128, 256)),
             match="tile_mn=(128, 256) with sf_vec_size=16 is disabled"),
        dict(kwargs=dict(tile_mn=(256, 128)), match="tile_mn=(256, 128)"),
        dict(kwargs=dict(cluster_mn=(8, 1)), match="cluster_mn=(8, 1)"),
        dict(kwargs=dict(cluster_mn=(3, 1)), match="cluster_mn=(3, 1)"))
    def test_blackwell_config_errors_name_the_argument(self, kwargs, match):
        with self.assertRaisesRegex(ValueError, re.escape(match)):
            BlackwellBlockScaledGemmAmax(**kwargs)

    @parameterized.parameters(
        dict(mnkl=(1, 1, 16, 1), ok=True), dict(mnkl=(257, 129, 1040, 3), ok=True),
        dict(mnkl=(128, 128, 100, 1), ok=False), dict(mnkl=(0, 128, 128, 1), ok=False),
        dict(mnkl=(65536, 65536, 65536, 1), ok=False))
    def test_can_implement(self, mnkl, ok):
        for kernel in (HopperMxf8GemmAmax(), BlackwellBlockScaledGemmAmax()):
            got, why = kernel.can_implement(*mnkl)
            self.assertEqual(got, ok, why)
            self.assertEqual(bool(why), not ok)


class CompileTest(parameterized.TestCase):

    @parameterized.named_parameters((v.key, v) for v in catalog.variants_for("sm_90a", "gemm_amax")
                                    + catalog.TEST_VARIANTS
                                    if v.ab_dtype in _PTX_AB and v.c_dtype in _WIDE_C and v.a_major + v.b_major == "kk")
    def test_compiles_for_its_arch_with_wgmma_and_tma(self, v):
        ptx, obj, *_ = _compiled(v)
        self.assertGreater(len(obj), 1000)
        self.assertIn(f".target {v.arch}", ptx)
        ab = _PTX_AB[v.ab_dtype]
        # FP8 codes are dequantized (exactly) to bf16 with the hardware FP8 converter, then bf16 wgmma.
        self.assertIn(f"cvt.rn.f16x2.{ab}x2", ptx)
        self.assertRegex(ptx, rf"wgmma\.mma_async\.sync\.aligned\.m64n{v.tile_mn[1]}k16\.f32\.bf16\.bf16")
        self.assertIn("cp.async.bulk.tensor", ptx)  # TMA loads
        self.assertIn("atom.global.max.s32", ptx)  # amax: integer atomic max on the float's bits

    @parameterized.named_parameters((v.key, v) for v in catalog.variants_for("sm_90a", "proj_rope"))
    def test_proj_rope_compiles_with_bf16_wgmma_tma_and_the_fp8_converter(self, v):
        ptx, obj, *_ = _compiled(v)
        self.assertGreater(len(obj), 1000)
        self.assertIn(f".target {v.arch}", ptx)
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

    @parameterized.named_parameters((v.key, v) for v in catalog.variants_for("sm_90a", "proj_rope"))
    def test_proj_rope_persistent_structure(self, v):
        """A grid-strided tile loop; a fourth (epilogue) warpgroup and the two barriers of 384 threads that hand it
        the fp32 tile, none of 256 (both MMA warpgroups read every stage); registers split 40/128/216, no spills, and
        shared memory (the stages + the fp32 tile) within the 227 KB of one sm_90 CTA, with no room for one more
        stage."""
        ptx, _, _, fn, kernel = _compiled(v)
        # (tokens per tile, k-tile, stages): 64-wide k-tiles for W (N, K), 32-wide (twice the stages) for W (K, N)
        expected = (128, 64, 3) if v.b_major == "k" else (128, 32, 6)
        self.assertEqual((kernel.tile_mnk[0], kernel.tile_mnk[2], kernel.ab_stages), expected)
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
        resources = structure.cubin_resources(fn.__cubin__)
        self.assertEqual((resources.frame_bytes, resources.stack_bytes), (0, 0))
        self.assertLessEqual(resources.registers, 65536 // threads)
        smem = kernel.shared_storage.size_in_bytes() + resources.static_smem_bytes
        self.assertLessEqual(smem, 227 * 1024)
        stage_bytes = (kernel.tile_mnk[0] + 192) * kernel.tile_mnk[2] * 2
        self.assertGreater(smem, 227 * 1024 - stage_bytes)  # no room left for one more stage

    def test_proj_rope_pdl_waits_for_the_previous_grid_before_any_global_access(self):
        """Programmatic dependent launch: one launch_dependents and one griddepcontrol.wait, the wait before the
        first TMA load and the first global load."""
        v = catalog.variants_for("sm_90a", "proj_rope")[0]
        ptx, *_ = _compiled(v)
        self.assertEqual(ptx.count("griddepcontrol.launch_dependents"), 1)
        self.assertEqual(ptx.count("griddepcontrol.wait"), 1)
        wait = ptx.index("griddepcontrol.wait")
        for access in ("cp.async.bulk.tensor", "ld.global"):
            self.assertLess(wait, ptx.index(access), access)

    @parameterized.named_parameters((v.key, v) for v in _PROJ_ROPE_VARIANTS)
    def test_proj_rope_header_matches_abi(self, v):
        _, _, header, *_ = _compiled(v)
        p = v.function_prefix
        wrapper = re.search(rf"int32_t cute_dsl_{p}_wrapper\(([^)]*)\)", header).group(1)
        params = [x.strip() for x in wrapper.split(",")]
        self.assertEqual(params[1:], [f"{p}_Tensor_{t}_t *{t}" for t in _PROJ_ROPE_ABI_TENSORS]
                         + [f"int32_t {s}" for s in ("t", "k", "h", "sms")] + ["cudaStream_t stream"])
        args = re.search(r"void \*args\[(\d+)\] = \{([^}]*)\}", header)
        self.assertEqual(int(args.group(1)), 16)  # what the proj_rope handler passes (ffi/proj_rope.cc)

    @parameterized.named_parameters((v.key, v) for v in catalog.variants_for("sm_100a", "gemm_amax"))
    def test_sm100a_structure(self, v):
        """Block-scaled tcgen05 MMA of the right kind and scale-vector size, tensor memory allocated and freed, no
        local memory, shared memory, registers and tensor-memory columns within the B200's limits."""
        ptx, obj, _, fn, kernel = _compiled(v)
        self.assertGreater(len(obj), 1000)
        self.assertIn(".target sm_100a", ptx)
        report = structure.sm100_report(v, fn, kernel)
        self.assertEqual(report.problems(), [])
        kind = "mxf4nvf4" if v.ab_dtype == "float4_e2m1fn" else "mxf8f6f4"
        self.assertEqual(report.mma, (f"tcgen05.mma.cta_group::1.kind::{kind}.block_scale.block{v.sf_vec_size}"
                                      ".collector::a::discard",))
        self.assertIn("tcgen05.cp.cta_group::1.32x128b.warpx4", ptx)  # scale factors: shared -> tensor memory
        self.assertIn("tcgen05.ld.sync.aligned", ptx)  # epilogue: tensor memory -> registers
        self.assertIn("cp.async.bulk.tensor", ptx)  # TMA loads
        self.assertEqual("multicast::cluster" in ptx, v.cluster_mn != (1, 1))
        self.assertIn("atom.global.max.s32", ptx)  # amax: integer atomic max on the float's bits
        # Accumulator stages (2 x 128 or 1 x 256 columns), then one column per 4 scale blocks of a k-tile for SFA and
        # for each 128 columns of SFB; a k-tile is 128 FP8 or 256 FP4 elements.
        blocks = (256 if v.ab_dtype == "float4_e2m1fn" else 128) // v.sf_vec_size
        self.assertEqual(report.tmem_columns_used, 256 + blocks * (1 + v.tile_mn[1] // 128))

    @parameterized.named_parameters((v.key, v) for v in catalog.variants_for("sm_100a", "proj_rope"))
    def test_sm100a_proj_rope_structure(self, v):
        """bf16 tcgen05 MMA (kind::f16, no block scales) from TMA-fed shared memory into tensor memory, the epilogue
        from tensor memory in fp32 (32x32b loads, waited for), no local memory, within the B200's limits."""
        ptx, obj, _, fn, kernel = _compiled(v)
        self.assertGreater(len(obj), 1000)
        self.assertIn(".target sm_100a", ptx)
        report = structure.sm100_report(v, fn, kernel)
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
        self.assertEqual(kernel.ab_stages, 5)  # 5 x (16 + 24) KB of x and W tiles

    def test_sm100a_tmem_load_gives_each_thread_one_token(self):
        """The epilogue's premise: the 32x32b x32 load of a 128 x 32 accumulator block gives thread s row (token) s
        and its value i column (feature) i of the block, for every thread of the 4 epilogue warps."""
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

    @parameterized.named_parameters((v.key, v) for v in catalog.CATALOG + catalog.TEST_VARIANTS
                                    if v.op == "gemm_amax")
    def test_header_matches_abi(self, v):
        _, _, header, *_ = _compiled(v)
        p = v.function_prefix
        tensors = _ALPHA_ABI_TENSORS if catalog.takes_alpha(v) else _ABI_TENSORS  # NVFP4: alpha after amax
        for name in tensors:
            struct = re.search(r"typedef struct \{([^}]*)\}\s*" + re.escape(f"{p}_Tensor_{name}_t;"), header)
            self.assertIsNotNone(struct, f"no tensor struct for {name!r}")
            fields = [f.strip() for f in struct.group(1).split(";") if f.strip()]
            self.assertEqual(fields, ["void *data", "int64_t dynamic_shapes[1]"], name)
        wrapper = re.search(rf"int32_t cute_dsl_{p}_wrapper\(([^)]*)\)", header).group(1)
        params = [x.strip() for x in wrapper.split(",")]
        self.assertEqual(params[1:], [f"{p}_Tensor_{t}_t *{t}" for t in tensors]
                         + [f"int32_t {s}" for s in "mnkl"] + ["cudaStream_t stream"])
        args = re.search(r"void \*args\[(\d+)\] = \{([^}]*)\}", header)
        self.assertEqual(int(args.group(1)), 6 + len(tensors))  # what ffi/gemm_amax.cc passes
        self.assertEqual([x.strip() for x in args.group(2).split(",")],
                         list(tensors) + ["&m", "&n", "&k", "&l", "&stream", "&ret"])


class DequantizeCompileTest(parameterized.TestCase):
    """The MXFP8 -> bf16 kernel of the MXFP8 proj_rope path: compiled for both archs, two operands per launch, the
    bulk-copy path where operand 0's scales run along the rows and the per-thread 16-byte path where they run along
    the columns, the hardware FP8 converter, no local memory, the ABI ffi/dequantize.cc passes."""

    @parameterized.named_parameters((v.key, v) for v in catalog.CATALOG if v.op == "dequantize")
    def test_structure_and_abi(self, v):
        from jax_blockgemm.kernels import dequantize as dq

        ptx, obj, header, *_ = _compiled(v)
        self.assertGreater(len(obj), 1000)
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
            self.assertEqual(count(r"st\.shared\.v4\.b32"), runs)  # its 8 bf16 values
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
        p = v.function_prefix
        wrapper = re.search(rf"int32_t cute_dsl_{p}_wrapper\(([^)]*)\)", header).group(1)
        params = [x.strip() for x in wrapper.split(",")]
        operand = lambda s: [f"{p}_Tensor_{t}{s}_t *{t}{s}" for t in ("codes", "scales", "out")] + [
            f"int32_t rows{s}", f"int32_t cols{s}"]
        self.assertEqual(params[1:], operand("") + operand("1") + ["cudaStream_t stream"])
        args = re.search(r"void \*args\[(\d+)\] = \{([^}]*)\}", header)
        self.assertEqual([x.strip() for x in args.group(2).split(",")],
                         ["codes", "scales", "out", "&rows", "&cols", "codes1", "scales1", "out1", "&rows1",
                          "&cols1", "&stream", "&ret"])  # ffi/dequantize.cc

    def test_can_implement(self):
        from jax_blockgemm.kernels.dequantize import MxDequantize

        self.assertEqual(MxDequantize.can_implement(2048, 1536, 1), (True, ""))
        self.assertEqual(MxDequantize.can_implement(1536, 24576, 0), (True, ""))
        for rows, cols, axis, why in ((64, 48, 1, "cols must be a multiple of 32"),
                                      (64, 48, 0, "cols must be a multiple of 32"),
                                      (48, 64, 0, "rows must be a multiple of 32"),
                                      (0, 64, 1, "must be >= 1"), (65536, 32768, 1, "fewer than 2\\*\\*31")):
            ok, message = MxDequantize.can_implement(rows, cols, axis)
            self.assertFalse(ok)
            self.assertRegex(message, why)
        with self.assertRaisesRegex(ValueError, "scale_axis=2 is not supported"):
            MxDequantize(scale_axis=2)


_SURFACE_90 = [v for v in catalog.variants_for("sm_90a", "gemm_amax")
               if v.ab_dtype not in _PTX_AB or v.c_dtype not in _WIDE_C or v.a_major + v.b_major != "kk"]


class Sm90SurfaceCompileTest(parameterized.TestCase):
    """The sm_90a variants beyond MXFP8 -> f32/bf16 (FP4 operands, alpha, f16/FP8/FP4 C): compiled once each (the
    module's cache, shared with the ABI header test), with the structural checks of the FP8 ones plus what each
    addition must compile to, and the cubin's resources (no spills)."""

    @parameterized.named_parameters((v.key, v) for v in _SURFACE_90)
    def test_structure(self, v):
        ptx, obj, _, fn, kernel = _compiled(v)
        self.assertGreater(len(obj), 1000)
        self.assertIn(".target sm_90a", ptx)
        self.assertRegex(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16")
        _assert_tma_amax_no_spills(self, ptx, fn)
        if v.ab_dtype == "float4_e2m1fn":
            # FP4: no FP8 converter; per k-tile each consumer thread converts 8 rows (4 of A, 4 of B) of 16 codes:
            # one 8-byte shared load and 8 output words of 2 packed bf16 multiplies each; the first k-tile before
            # the mainloop, then once inside it.
            self.assertNotRegex(ptx, r"cvt\.rn\.f16x2\.e[45]m[23]x2")
            self.assertEqual(ptx.count("ld.shared.v2.b32"), 2 * 8)
            self.assertEqual(len(re.findall(r"(?:mul|fma\.rn)\.bf16x2", ptx)), 2 * 8 * 8 * 2)
        else:
            self.assertIn(f"cvt.rn.f16x2.{_PTX_AB[v.ab_dtype]}x2", ptx)
        # C: 64 accumulator values per thread (two 64-row warpgroups x 128 columns / 128 threads).
        conversions = {"float16": ("cvt.rn.f16.f32", 64), "float8_e4m3fn": ("cvt.rn.satfinite.e4m3x2.f32", 32),
                       "float8_e5m2": ("cvt.rn.satfinite.e5m2x2.f32", 32)}
        if v.c_dtype in conversions:
            instruction, count = conversions[v.c_dtype]
            self.assertEqual(ptx.count(instruction), count)
        if v.c_dtype in ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"):
            self.assertIn("st.global.b8", ptx)  # byte stores of codes (FP8) or packed pairs (FP4)
        if v.c_dtype == "float4_e2m1fn":  # software RNE to E2M1: 7 threshold compares per value
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
            self.assertTrue(kernel.has_alpha)


class ReportTest(absltest.TestCase):
    """`python -m jax_blockgemm.precompile --arch sm_100a --report` prints the structural table."""

    KEY = "gemm_amax.sm_100a.e5m2.bf16.sf32.t128x256.c2x1"

    def _report(self, *extra):
        from jax_blockgemm import precompile

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = precompile.main(["--arch", "sm_100a", "--report", "--variant", self.KEY, *extra])
        return rc, out.getvalue()

    def test_table_row(self):
        rc, text = self._report()
        self.assertEqual(rc, 0, text)
        self.assertRegex(text, re.escape(self.KEY) + r"\s+\d+\.\d\d kind::mxf8f6f4\s+block32\s+yes/yes\s+0\s+"
                               r"\d+\s+\d+\s+268/512\s+ok")
        self.assertIn("1 variants in", text)

    def test_proj_rope_rows(self):
        from jax_blockgemm import precompile

        keys = [v.key for v in catalog.variants_for("sm_100a", "proj_rope")]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = precompile.main(["--arch", "sm_100a", "--report"] + [a for k in keys for a in ("--variant", k)])
        self.assertEqual(rc, 0, out.getvalue())
        for key in keys:
            self.assertRegex(out.getvalue(), re.escape(key) + r"\s+\d+\.\d\d kind::f16\s+-\s+yes/yes\s+0\s+\d+\s+\d+\s+"
                                                             r"384/512\s+ok")

    def test_a_failing_check_sets_the_exit_status(self):
        with mock.patch.object(structure.Sm100Report, "problems", return_value=["shared memory 300000 B > 232448"]):
            rc, text = self._report()
        self.assertEqual(rc, 1)
        self.assertIn("FAIL: shared memory 300000 B > 232448", text)

    def test_hopper_only_selection_is_refused(self):
        from jax_blockgemm import precompile

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

    def test_cubin_parser_reads_a_compiled_kernel(self):
        v = catalog.variants_for("sm_100a")[0]
        fn = _compiled(v)[3]
        res = structure.cubin_resources(fn.__cubin__)
        self.assertGreater(res.registers, 16)
        self.assertLessEqual(res.registers, 255)
        with self.assertRaisesRegex(ValueError, "not an ELF64"):
            structure.cubin_resources(b"PK\x03\x04")


class AtomLayoutTest(absltest.TestCase):

    def test_byte_offset_matches_spec_formula(self):
        rng = np.random.default_rng()
        for _ in range(200):
            mn_size, kb_size = (int(x) for x in rng.integers(1, 700, 2))
            l_size = int(rng.integers(1, 4))
            l, mn, kb = int(rng.integers(l_size)), int(rng.integers(mn_size)), int(rng.integers(kb_size))
            mnp, kp = -(-mn_size // 128), -(-kb_size // 4)
            spec = ((l * mnp + mn // 128) * kp + kb // 4) * 512 + (mn % 32) * 16 + ((mn // 32) % 4) * 4 + kb % 4
            self.assertEqual(common.atom_byte_offset(l, mn, kb, mn_size, kb_size), spec)

    def test_blackwell_scale_layout_is_the_spec_atom(self):
        """The layout the sm_100a kernel reads scales through addresses exactly the SPEC §3 byte of each scale."""
        import cutlass.cute as cute

        from jax_blockgemm.kernels.sm100.gemm_amax import scale_layout

        rng = np.random.default_rng()
        m, k, l = int(rng.integers(129, 700)), 32 * int(rng.integers(5, 40)), int(rng.integers(1, 4))
        coords = [(int(rng.integers(m)), int(rng.integers(k)), int(rng.integers(l))) for _ in range(300)]
        got = {}

        @cute.jit
        def probe():
            layout = scale_layout((m, k, l), 32)
            for c in coords:
                got[c] = cute.crd2idx(c, layout)

        cute.compile(probe)
        for mn, kk, ll in coords:
            self.assertEqual(got[(mn, kk, ll)], common.atom_byte_offset(ll, mn, kk // 32, m, -(-k // 32)),
                             (mn, kk, ll, m, k, l))

    def test_word_offsets_of_one_atom_are_a_permutation(self):
        words = sorted(common.atom_word_offset(r) for r in range(128))
        self.assertEqual(words, list(range(128)))


if __name__ == "__main__":
    absltest.main()
