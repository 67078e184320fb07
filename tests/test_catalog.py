"""CPU, nothing compiled: the kernel catalog's surface (which formats, tiles and clusters each architecture has),
variant selection and naming, and the configuration checks of the kernel classes."""

import dataclasses
import pathlib
import re
import sys
import types
from unittest import mock

from absl.testing import absltest, parameterized

import broken_kernels
import compiled_kernels
import decode_standin
from jax_blockgemm.kernels import catalog
from jax_blockgemm.kernels.dequantize import MxDequantize
from jax_blockgemm.kernels.sm90.gemm_amax import HopperMxf8GemmAmax
from jax_blockgemm.kernels.sm100.gemm_amax import BlackwellBlockScaledGemmAmax


class CatalogTest(absltest.TestCase):

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
        # FP4 operands: every C dtype SPEC §4 allows them (FP8 and packed FP4 C only with FP4 operands).
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

    def test_sm100a_proj_rope_variants_cover_both_w_layouts(self):
        rope = catalog.variants_for("sm_100a", "proj_rope")
        self.assertEqual({(v.tile_mn, v.b_major, v.ab_dtype, v.c_dtype) for v in rope},
                         {((128, 192), b, "bfloat16", "float8_e4m3fn") for b in ("k", "n")})
        self.assertEqual({v.key for v in rope}, {"proj_rope.sm_100a.bf16.e4m3.sf32.t128x192.c1x1",
                                                 "proj_rope.sm_100a.bf16.e4m3.sf32.t128x192.c1x1.bn"})

    def test_sm100a_fp4_variants(self):
        fp4 = {(v.sf_vec_size, v.sf_dtype, v.c_dtype, v.tile_mn, v.cluster_mn)
               for v in catalog.variants_for("sm_100a", "gemm_amax") if v.ab_dtype == "float4_e2m1fn"}
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
        k_major = [v for v in catalog.variants_for("sm_100a", "gemm_amax")
                   if v.ab_dtype != "float4_e2m1fn" and v.a_major + v.b_major == "kk"]
        got = {(v.ab_dtype, v.c_dtype, v.tile_mn, v.cluster_mn) for v in k_major}
        clusters = {(cm, cn) for cm in (1, 2, 4) for cn in (1, 2, 4)}
        self.assertEqual(got, {(a, c, t, cl) for a in ("float8_e4m3fn", "float8_e5m2") for c in ("float32", "bfloat16")
                               for t in ((128, 128), (128, 256)) for cl in clusters})
        self.assertTrue(all(v.sf_vec_size == 32 and v.sf_dtype == "float8_e8m0fnu" and not v.flavor
                            for v in catalog.variants_for("sm_100a") if v.ab_dtype != "float4_e2m1fn"))

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

    def test_broken_kernels_are_never_selected(self):
        for v in broken_kernels.BROKEN:
            self.assertNotIn(v, catalog.CATALOG)
            self.assertTrue(v.flavor)
            self.assertTrue(v.key.endswith("." + v.flavor))
            same = dict(arch=v.arch, ab_dtype=v.ab_dtype, c_dtype=v.c_dtype, sf_vec_size=v.sf_vec_size)
            self.assertEqual(catalog.select_variant(**same, tile_mn=v.tile_mn, cluster_mn=v.cluster_mn),
                             dataclasses.replace(v, flavor=""))

    def test_source_hash_is_stable_hex(self):
        self.assertRegex(catalog.kernel_source_hash(), r"^[0-9a-f]{64}$")
        self.assertEqual(catalog.kernel_source_hash(), catalog.kernel_source_hash())

    def test_source_hash_covers_the_modules_outside_kernels_that_kernels_import(self):
        """Every jax_blockgemm module outside kernels/ that a kernels/ source imports is hashed: a change to one
        (formats.py, support.py, ...) is a new object cache key."""
        root = pathlib.Path(catalog.__file__).parent
        imported = set()
        for path in root.rglob("*.py"):
            for module, names in re.findall(r"^\s*from jax_blockgemm(\.[\w.]+)? import ([\w, ]+)", path.read_text(),
                                            re.M):
                if not module.startswith(".kernels"):
                    imported |= {f"{module[1:]}.py"} if module else {f"{n.strip()}.py" for n in names.split(",")}
        self.assertTrue({"formats.py", "support.py"} <= imported, imported)
        self.assertTrue(imported <= set(catalog.COMPILED_IN_MODULES), imported)
        read_bytes = pathlib.Path.read_bytes
        catalog.kernel_source_hash.cache_clear()
        self.addCleanup(catalog.kernel_source_hash.cache_clear)
        before = catalog.kernel_source_hash()
        for name in catalog.COMPILED_IN_MODULES:
            with self.subTest(name=name), mock.patch.object(
                    pathlib.Path, "read_bytes", autospec=True,
                    side_effect=lambda p: read_bytes(p) + (b"# changed" if p == root.parent / name else b"")):
                catalog.kernel_source_hash.cache_clear()
                self.assertNotEqual(catalog.kernel_source_hash(), before)
        catalog.kernel_source_hash.cache_clear()
        self.assertEqual(catalog.kernel_source_hash(), before)

    def test_make_kernel_rejects_unknown_variant(self):
        with self.assertRaisesRegex(ValueError, "not in the catalog"):
            catalog.make_kernel(catalog.KernelVariant(tile_mn=(64, 64)))

    def test_every_kernel_class_has_one_compiled_representative(self):
        """The default tier compiles the representatives only: each must still be in the catalog, and each (op,
        arch) of the catalog must have one, or a kernel class would go uncompiled outside the catalog tier."""
        keys = {v.key for v in catalog.CATALOG}
        self.assertLessEqual(compiled_kernels.REPRESENTATIVE_KEYS, keys)
        chosen = compiled_kernels.representatives(catalog.CATALOG)
        self.assertEqual({(v.op, v.arch) for v in chosen}, {(v.op, v.arch) for v in catalog.CATALOG})
        gemm = [v for v in chosen if v.op == "gemm_amax"]
        for arch in ("sm_90a", "sm_100a"):  # the gemm_amax classes: MXFP8 K-major, FP4 (with alpha), MN-major
            ours = [v for v in gemm if v.arch == arch]
            self.assertTrue(any(v.ab_dtype != "float4_e2m1fn" and v.a_major + v.b_major == "kk" for v in ours))
            self.assertTrue(any(catalog.takes_alpha(v) for v in ours))
            self.assertTrue(any(v.a_major + v.b_major != "kk" for v in ours))


_WS_FORMATS = {("float8_e4m3fn", 32, "float8_e8m0fnu"), ("float8_e5m2", 32, "float8_e8m0fnu"),
               ("float4_e2m1fn", 32, "float8_e8m0fnu"), ("float4_e2m1fn", 16, "float8_e4m3fn")}


class WeightStreamCatalogTest(parameterized.TestCase):
    """The decode GEMM's catalog entries (op "weight_stream"), its factory and its ABI's fake arguments."""

    def test_every_format_c_dtype_tile_and_arch(self):
        got = [(v.arch, (v.ab_dtype, v.sf_vec_size, v.sf_dtype), v.c_dtype, v.tile_mn, v.cluster_mn, v.a_major,
                v.b_major) for v in catalog.CATALOG if v.op == "weight_stream"]
        want = {(a, f, c, t, (1, 1), "k", "k") for a in ("sm_90a", "sm_100a") for f in _WS_FORMATS
                for c in ("float32", "bfloat16", "float16") for t in ((32, 16), (32, 64))}
        self.assertLen(got, len(want))  # no duplicates
        self.assertEqual(set(got), want)
        self.assertIn("weight_stream", catalog.OPS)
        self.assertEqual({v.op for v in catalog.variants_for("sm_100a")} - {"weight_stream"},
                         {"gemm_amax", "proj_rope", "dequantize", "ragged"})

    def test_keys_name_the_format_c_and_tile(self):
        keys = {v.key for v in catalog.CATALOG if v.op == "weight_stream"}
        self.assertIn("weight_stream.sm_90a.e4m3.f32.sf32.t32x16.c1x1", keys)
        self.assertIn("weight_stream.sm_90a.e2m1.bf16.sf16e4m3.t32x64.c1x1", keys)  # NVFP4
        self.assertIn("weight_stream.sm_100a.e2m1.f16.sf32.t32x64.c1x1", keys)  # MXFP4
        self.assertIn("weight_stream.sm_100a.e5m2.bf16.sf32.t32x16.c1x1", keys)
        v = catalog.select_variant(op="weight_stream", arch="sm_90a", ab_dtype="float4_e2m1fn", c_dtype="float16",
                                   sf_vec_size=16, sf_dtype="float8_e4m3fn", tile_mn=(32, 64), cluster_mn=(1, 1))
        self.assertEqual(v.function_prefix, "jbg_weight_stream_sm_90a_e2m1_f16_sf16e4m3_t32x64_c1x1")
        self.assertFalse(catalog.takes_alpha(v))  # gemm_amax's alpha rule; this ABI always carries alpha
        self.assertEqual(catalog.grid_cluster_ctas(v), 0)

    def test_select_variant_needs_op_and_an_existing_tile(self):
        cfg = dict(arch="sm_90a", ab_dtype="float8_e4m3fn", c_dtype="bfloat16", sf_vec_size=32, cluster_mn=(1, 1))
        self.assertEqual(catalog.select_variant(op="weight_stream", **cfg, tile_mn=(32, 16)).op, "weight_stream")
        self.assertIsNone(catalog.select_variant(op="weight_stream", **cfg, tile_mn=(32, 32)))
        self.assertIsNone(catalog.select_variant(**cfg, tile_mn=(32, 16)))  # op defaults to gemm_amax
        self.assertIsNone(catalog.select_variant(op="weight_stream", **{**cfg, "c_dtype": "float8_e4m3fn"},
                                                 tile_mn=(32, 16)))
        self.assertIsNone(catalog.select_variant(op="weight_stream", **{**cfg, "sf_vec_size": 16},
                                                 sf_dtype="float8_e4m3fn", tile_mn=(32, 16)))  # NVFP4 scales: FP4 only

    def test_factory_passes_the_variant_to_the_interface(self):
        """make_kernel builds kernels.weight_stream.WeightStreamGemm with the variant's dtypes, scales and tile."""
        made = []
        module = types.ModuleType("jax_blockgemm.kernels.weight_stream")
        module.WeightStreamGemm = lambda **kwargs: made.append(kwargs) or kwargs
        v = catalog.select_variant(op="weight_stream", arch="sm_100a", ab_dtype="float4_e2m1fn", c_dtype="float32",
                                   sf_vec_size=16, sf_dtype="float8_e4m3fn", tile_mn=(32, 64), cluster_mn=(1, 1))
        with mock.patch.dict(sys.modules, {module.__name__: module}):
            catalog.make_kernel(v)
        self.assertEqual(made, [dict(w_dtype="float4_e2m1fn", c_dtype="float32", sf_vec_size=16,
                                     sf_dtype="float8_e4m3fn", tile=(32, 64))])

    def test_fake_arguments_follow_the_abi(self):
        """fn(x, w, sw, c, amax, alpha, tally, m, n, k, l, sf_atom, stream): x bf16, w and c as the kernel says,
        scale bytes uint8, amax and alpha float32, the amax tally int64, five int32 scalars, the stream."""
        import cutlass

        kernel = types.SimpleNamespace(ab_dtype=cutlass.Float8E5M2, c_dtype=cutlass.Float16)
        args = catalog.fake_arguments(kernel, "weight_stream")
        self.assertLen(args, 13)
        self.assertEqual([a.element_type for a in args[:7]], [cutlass.BFloat16, cutlass.Float8E5M2, cutlass.Uint8,
                                                             cutlass.Float16, cutlass.Float32, cutlass.Float32,
                                                             cutlass.Int64])
        self.assertTrue(all(isinstance(a, cutlass.Int32) for a in args[7:12]))
        self.assertEqual(type(args[12]).__name__, "CUstream")

    def test_the_real_class_takes_every_catalog_variant(self):
        """Needs kernels/weight_stream.py: each variant builds, with the dtypes the handler checks buffers against
        and the capacity and K rules dispatch relies on."""
        if decode_standin.real_class() is None:
            self.skipTest(decode_standin.MISSING)
        import cutlass

        codes = {"float8_e4m3fn": cutlass.Float8E4M3FN, "float8_e5m2": cutlass.Float8E5M2,
                 "float4_e2m1fn": cutlass.Uint8}
        c_types = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
        for v in (v for v in catalog.CATALOG if v.op == "weight_stream"):
            with self.subTest(v.key):
                kernel = catalog.make_kernel(v)
                self.assertEqual((kernel.ab_dtype, kernel.c_dtype), (codes[v.ab_dtype], c_types[v.c_dtype]))
                step = 32 if v.ab_dtype == "float4_e2m1fn" else 16
                rows = v.tile_mn[1]
                self.assertEqual(kernel.can_implement(rows, 7168, 7168, 1)[0], True)
                self.assertEqual(kernel.can_implement(1, 1, step, 3)[0], True)
                self.assertFalse(kernel.can_implement(rows + 1, 128, 128, 1)[0])
                self.assertFalse(kernel.can_implement(1, 128, 128 + step // 2, 1)[0])

    def test_the_stand_in_agrees_with_the_real_class(self):
        """The dispatch tests use a stand-in with the documented can_implement: it must answer as the real class."""
        if decode_standin.real_class() is None:
            self.skipTest(decode_standin.MISSING)
        sizes = [(m, n, k, l) for m in (1, 16, 17, 64, 65) for n in (1, 200) for k in (16, 32, 48, 96, 7168)
                 for l in (1, 2)]
        for v in (v for v in catalog.CATALOG if v.op == "weight_stream" and v.arch == "sm_90a"):
            real, stand_in = catalog.make_kernel(v), decode_standin.StandInWeightStream(v)
            for size in sizes:
                self.assertEqual(real.can_implement(*size)[0], stand_in.can_implement(*size)[0], (v.key, size))


class KernelConfigTest(parameterized.TestCase):
    """Each kernel class refuses a configuration it cannot run, naming the argument, and says which problem shapes
    it can run."""

    @parameterized.parameters(
        dict(kwargs=dict(ab_dtype="float16"), match="ab_dtype='float16'"),
        dict(kwargs=dict(c_dtype="int8"), match="c_dtype='int8'"),
        dict(kwargs=dict(sf_vec_size=16), match="(sf_dtype, sf_vec_size)=('float8_e8m0fnu', 16)"),
        dict(kwargs=dict(ab_dtype="float4_e2m1fn", sf_dtype="float8_e4m3fn"),
             match="(sf_dtype, sf_vec_size)=('float8_e4m3fn', 32)"),
        dict(kwargs=dict(a_major="n"), match="a_major='n'"),
        dict(kwargs=dict(ab_dtype="float4_e2m1fn", b_major="n"), match="MN-major operands need FP8 codes"))
    def test_hopper_config_errors_name_the_argument(self, kwargs, match):
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
        dict(mnkl=(1, 4, 16, 1), ok=True), dict(mnkl=(257, 132, 1040, 3), ok=True),
        dict(mnkl=(128, 128, 100, 1), ok=False), dict(mnkl=(0, 128, 128, 1), ok=False),
        dict(mnkl=(65536, 65536, 65536, 1), ok=False))
    def test_gemm_amax_can_implement(self, mnkl, ok):
        for kernel in (HopperMxf8GemmAmax(), BlackwellBlockScaledGemmAmax()):
            got, why = kernel.can_implement(*mnkl)
            self.assertEqual(got, ok, why)
            self.assertEqual(bool(why), not ok)

    def test_blackwell_needs_16_byte_c_rows_for_its_tma_stores(self):
        """The sm_100a epilogue stores C by TMA (16-byte rows); the Hopper kernel takes any N."""
        self.assertEqual(HopperMxf8GemmAmax().can_implement(64, 130, 16, 1), (True, ""))
        ok, why = BlackwellBlockScaledGemmAmax().can_implement(64, 130, 16, 1)
        self.assertFalse(ok)
        self.assertIn("16", why)
        self.assertTrue(BlackwellBlockScaledGemmAmax(c_dtype="bfloat16").can_implement(64, 136, 16, 1)[0])

    def test_fp4_gemm_amax_needs_32_aligned_k(self):
        fp4 = BlackwellBlockScaledGemmAmax(ab_dtype="float4_e2m1fn", sf_vec_size=16, sf_dtype="float8_e4m3fn")
        self.assertEqual(fp4.can_implement(100, 100, 64, 1), (True, ""))
        self.assertIn("multiple of 32", fp4.can_implement(100, 100, 48, 1)[1])

    def test_dequantize_can_implement(self):
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


if __name__ == "__main__":
    absltest.main()
