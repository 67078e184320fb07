"""Public API: shapes without running (eval_shape), every trace-time error, primitives under jit and vmap."""

import ast
import importlib
import pathlib
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg
from jax_blockgemm import primitives

import oracle
import oracle_ops


def _fp8(rng, shape, dtype=jnp.float8_e4m3fn):
    return jnp.asarray((rng.standard_normal(shape) * 3).astype(np.float32)).astype(dtype)


def _mx_inputs(rng, l, m, n, k, dtype=jnp.float8_e4m3fn):
    """FP8 codes and compact E8M0 scale bytes (random, non-trivial); leading L only when l is not None."""
    lead = () if l is None else (l,)
    kb = -(-k // 32)
    a, b = _fp8(rng, (*lead, m, k), dtype), _fp8(rng, (*lead, n, k), dtype)
    sfa = jnp.asarray(oracle.random_scale_bytes(rng, (*lead, m, kb)))
    sfb = jnp.asarray(oracle.random_scale_bytes(rng, (*lead, n, kb)))
    return a, b, sfa, sfb


def _rope_inputs(rng, t, h, k, mxfp8=False):
    x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((h * 192, k)) / np.sqrt(k), jnp.bfloat16)
    ang = rng.uniform(0, 2 * np.pi, (t, 64))
    cos, sin = jnp.asarray(np.cos(ang), jnp.bfloat16), jnp.asarray(np.sin(ang), jnp.bfloat16)
    if not mxfp8:
        return dict(x=x, w=w, cos=cos, sin=sin)
    xq, xs = jbg.formats.quantize_mxfp8(x.astype(jnp.float32))
    wq, ws = jbg.formats.quantize_mxfp8(w.astype(jnp.float32))
    return dict(x=xq, w=wq, cos=cos, sin=sin, x_scale=xs, w_scale=ws)


def _assert_close(test, x, y):
    """fp32 results of differently batched dots: XLA may sum in another order, so compare to SPEC §7's 1e-5."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    test.assertEqual(x.shape, y.shape)
    test.assertFalse(np.isnan(x).any() or np.isnan(y).any())
    test.assertLessEqual(np.linalg.norm(x - y), 1e-5 * np.linalg.norm(y))


def _assert_same(test, x, y):
    x, y = np.asarray(x), np.asarray(y)
    test.assertEqual(x.shape, y.shape)
    test.assertEqual(x.dtype, y.dtype)
    np.testing.assert_array_equal(x.view(np.uint8) if x.dtype.itemsize == 1 else x,
                                  y.view(np.uint8) if y.dtype.itemsize == 1 else y)


class PackageNamespaceTest(absltest.TestCase):
    """The package imports its public names on first use: each is its defining module's own object, and the imports
    that type checkers see (under TYPE_CHECKING) name the same ones."""

    def test_every_public_name_is_its_modules_object_and_what_type_checkers_see(self):
        tree = ast.parse(pathlib.Path(jbg.__file__).read_text())
        guarded = next(node for node in tree.body
                       if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
        seen = {alias.name: alias.name if node.module == "jax_blockgemm" else node.module.split(".")[-1]
                for node in guarded.body for alias in node.names}
        self.assertEqual(seen, jbg._PUBLIC)
        self.assertEqual(jbg.__all__, list(jbg._PUBLIC))
        for name, module_name in jbg._PUBLIC.items():
            module = importlib.import_module(f"jax_blockgemm.{module_name}")
            self.assertIs(getattr(jbg, name), module if name == module_name else getattr(module, name), name)
            self.assertIn(name, dir(jbg))
        self.assertIs(jbg.reference, importlib.import_module("jax_blockgemm.reference"))  # any submodule, as before
        for missing in ("no_such_name", "__wrapped__"):
            self.assertFalse(hasattr(jbg, missing), missing)


class EvalShapeTest(parameterized.TestCase):

    @parameterized.parameters(
        dict(c_dtype=jnp.float32, c_major="n", expect=((3, 200, 256), jnp.float32)),
        dict(c_dtype=jnp.bfloat16, c_major="m", expect=((3, 256, 200), jnp.bfloat16)),
        dict(c_dtype=jnp.float16, c_major="n", expect=((3, 200, 256), jnp.float16)),
    )
    def test_gemm_amax_shapes(self, c_dtype, c_major, expect):
        a = jax.ShapeDtypeStruct((3, 200, 96), jnp.float8_e5m2)
        b = jax.ShapeDtypeStruct((3, 256, 96), jnp.float8_e5m2)
        sfa = jax.ShapeDtypeStruct((3, 2, 1, 32, 4, 4), jnp.float8_e8m0fnu)
        sfb = jax.ShapeDtypeStruct((3, 2, 1, 32, 4, 4), jnp.float8_e8m0fnu)
        c, amax = jax.eval_shape(lambda *x: jbg.gemm_amax(*x, c_dtype=c_dtype, c_major=c_major), a, b, sfa, sfb)
        self.assertEqual((c.shape, c.dtype), (expect[0], np.dtype(expect[1])))
        self.assertEqual((amax.shape, amax.dtype), ((), np.dtype(np.float32)))

    def test_gemm_amax_fp4_packed_c(self):
        a = jax.ShapeDtypeStruct((130, 64), jnp.uint8)  # K = 128 E2M1 codes
        b = jax.ShapeDtypeStruct((64, 64), jnp.uint8)
        sfa = jax.ShapeDtypeStruct((130, 8), jnp.float8_e4m3fn)  # compact NVFP4 scales, sf_vec_size 16
        sfb = jax.ShapeDtypeStruct((64, 8), jnp.float8_e4m3fn)
        c, amax = jax.eval_shape(
            lambda *x: jbg.gemm_amax(*x, c_dtype=jnp.float4_e2m1fn, sf_vec_size=16), a, b, sfa, sfb)
        self.assertEqual((c.shape, c.dtype), ((130, 32), np.dtype(np.uint8)))
        self.assertEqual(amax.shape, ())

    def test_seed_form_shapes(self):
        a = jax.ShapeDtypeStruct((256, 128, 1), jnp.float8_e4m3fn)
        b = jax.ShapeDtypeStruct((384, 128, 1), jnp.float8_e4m3fn)
        sfa = jax.ShapeDtypeStruct((1, 2, 1, 32, 4, 4), jnp.float8_e8m0fnu)
        sfb = jax.ShapeDtypeStruct((32, 4, 3, 4, 1, 1), jnp.float8_e8m0fnu)  # the seed's logical view
        c, amax = jax.eval_shape(jbg.gemm_amax_jax_sm100, a, b, sfa, sfb)
        self.assertEqual(c.shape, (256, 384, 1))
        self.assertEqual(amax.shape, (1, 1, 1))

    @parameterized.parameters(True, False)
    def test_proj_rope_shapes(self, w_out_in):
        t, h, k = 64, 3, 96
        x = jax.ShapeDtypeStruct((t, k), jnp.float8_e4m3fn)
        w = jax.ShapeDtypeStruct((h * 192, k) if w_out_in else (k, h * 192), jnp.float8_e4m3fn)
        cs = jax.ShapeDtypeStruct((t, 64), jnp.bfloat16)
        xs = jax.ShapeDtypeStruct((t, k // 32), jnp.uint8)
        ws = jax.ShapeDtypeStruct((h * 192, k // 32) if w_out_in else (k // 32, h * 192), jnp.uint8)
        outs = jax.eval_shape(
            lambda x, w, c, s, xs, ws: jbg.gemm_proj_rope_mxfp8(x, w, c, s, x_scale=xs, w_scale=ws,
                                                                w_out_in=w_out_in), x, w, cs, cs, xs, ws)
        self.assertEqual([(o.shape, o.dtype) for o in outs], [
            ((t, h, 192), np.dtype(jnp.float8_e4m3fn)), ((t, h, 6), np.dtype(np.uint8)),
            ((t, h, 192), np.dtype(jnp.float8_e4m3fn)), ((t // 32, h, 192), np.dtype(np.uint8))])

    def test_ops_are_primitives(self):
        rng = np.random.default_rng(0)
        jaxpr = jax.make_jaxpr(jbg.gemm_amax)(*_mx_inputs(rng, None, 128, 128, 64))
        self.assertIn(primitives.gemm_amax_p, [e.primitive for e in jaxpr.jaxpr.eqns])
        r = _rope_inputs(rng, 32, 1, 64)
        jaxpr = jax.make_jaxpr(jbg.gemm_proj_rope_mxfp8)(r["x"], r["w"], r["cos"], r["sin"])
        self.assertIn(primitives.proj_rope_p, [e.primitive for e in jaxpr.jaxpr.eqns])

    @parameterized.parameters(None, 1, 3)
    def test_amax_of_one_batch_takes_no_reduction(self, l):
        """One batch's amax is the primitive's own (a reduction after the kernel would cost a launch of its own);
        several batches' are reduced. What follows the primitive in the jaxpr is what XLA runs after the kernel."""
        jaxpr = jax.make_jaxpr(jbg.gemm_amax)(*_mx_inputs(np.random.default_rng(l or 0), l, 128, 64, 64)).jaxpr
        names = [e.primitive.name for e in jaxpr.eqns]
        after = set(names[names.index(primitives.gemm_amax_p.name) + 1:])
        if l == 3:
            self.assertIn("reduce_max", after)
        else:
            self.assertFalse(after & {"reduce_max", "and", "max"}, after)


def _gemm_error_cases():
    f8, f5, u8 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.uint8
    s = jax.ShapeDtypeStruct
    ok = dict(a=s((128, 64), f8), b=s((128, 64), f8), sfa=s((128, 2), u8), sfb=s((128, 2), u8))
    fp4 = dict(a=s((128, 64), u8), b=s((128, 64), u8), sfa=s((128, 8), f8), sfb=s((128, 8), f8))
    return [
        ("a_dtype", dict(ok, a=s((128, 64), jnp.bfloat16)), {}, TypeError, "a has dtype bfloat16; allowed"),
        ("mixed_dtypes", dict(ok, b=s((128, 64), f5)), {}, TypeError, "a and b must have the same dtype"),
        ("fp4_containers", dict(fp4, b=s((128, 128), jnp.float4_e2m1fn)), dict(sf_vec_size=16), ValueError,
         "a and b must use the same FP4 container.*got a: uint8, b: float4_e2m1fn"),
        ("fp4_containers_reversed", dict(fp4, a=s((128, 128), jnp.float4_e2m1fn)), dict(sf_vec_size=16), ValueError,
         "a and b must use the same FP4 container.*got a: float4_e2m1fn, b: uint8"),
        ("rank", dict(ok, a=s((64,), f8)), {}, ValueError, "a must have rank 2 or 3"),
        ("k_mismatch", dict(ok, b=s((128, 96), f8)), {}, ValueError, "a and b disagree on K"),
        ("rank_mismatch", dict(ok, a=s((1, 128, 64), f8)), {}, ValueError, "a and b must have the same rank"),
        ("empty", dict(ok, a=s((0, 64), f8)), {}, ValueError, "M must be at least 1"),
        ("batch_mismatch", dict(ok, a=s((2, 128, 64), f8), b=s((3, 128, 64), f8)), {}, ValueError,
         "same batch size L"),
        ("a_major", ok, dict(a_major="n"), ValueError, "a_major='n' is not supported; allowed: 'k', 'm'"),
        ("b_major", ok, dict(b_major="m"), ValueError, "b_major='m' is not supported; allowed: 'k', 'n'"),
        ("c_major", ok, dict(c_major="k"), ValueError, "c_major='k' is not supported"),
        ("fp4_major", fp4, dict(a_major="m", sf_vec_size=16), ValueError, "FP4 operands must be K-major"),
        ("sf_vec_size", ok, dict(sf_vec_size=64), ValueError, "sf_vec_size=64 is not supported; allowed: 16, 32"),
        ("mxfp8_sf16", ok, dict(sf_vec_size=16), ValueError, "FP8 operands .MXFP8. need sf_vec_size=32"),
        ("nvfp4_sf32", fp4, {}, ValueError, "E4M3 scales .NVFP4. need sf_vec_size=16"),
        ("e4m3_scales_fp8", dict(ok, sfa=s((128, 4), f8), sfb=s((128, 4), f8)), dict(sf_vec_size=16), ValueError,
         "E4M3 scales .NVFP4. need FP4 operands"),
        ("scale_dtype", dict(ok, sfa=s((128, 2), jnp.float32), sfb=s((128, 2), jnp.float32)), {}, TypeError,
         "sfa/sfb have dtype float32"),
        ("scale_dtypes_differ", dict(ok, sfb=s((128, 2), jnp.float8_e8m0fnu)), {}, TypeError,
         "sfa and sfb must have the same dtype"),
        ("scale_shape", dict(ok, sfa=s((128, 3), u8)), {}, ValueError, r"sfa has shape \(128, 3\)"),
        ("acc_dtype", ok, dict(acc_dtype=jnp.bfloat16), ValueError, "acc_dtype=bfloat16 is not supported"),
        ("c_dtype", ok, dict(c_dtype=jnp.int32), TypeError, "c_dtype=int32 is not supported"),
        ("c_dtype_scalar_type", ok, dict(c_dtype=np.int32), TypeError, "c_dtype=int32 is not supported; allowed"),
        ("c_dtype_float64_type", ok, dict(c_dtype=np.float64), TypeError, "c_dtype=float64 is not supported"),
        ("acc_dtype_scalar_type", ok, dict(acc_dtype=np.float16), ValueError,
         "acc_dtype=float16 is not supported; allowed: float32"),
        ("c_dtype_no_dtype", ok, dict(c_dtype="foo"), TypeError, "c_dtype='foo' is not supported; allowed: float32"),
        ("acc_dtype_no_dtype", ok, dict(acc_dtype="foo"), TypeError, "acc_dtype='foo' is not supported; allowed"),
        ("c_dtype_none", ok, dict(c_dtype=None), TypeError, "c_dtype=None is not supported; allowed: float32"),
        ("fp8_in_fp8_out", ok, dict(c_dtype=f8), ValueError, "with FP8 operands is not supported"),
        ("fp4_c_fp8_in", ok, dict(c_dtype=jnp.float4_e2m1fn), ValueError, "packed FP4 C. needs FP4 operands"),
        ("fp4_c_m_major", fp4, dict(c_dtype=u8, c_major="m", sf_vec_size=16), ValueError, "FP4 C must be N-major"),
        ("tiler", ok, dict(mma_tiler_mn=(256, 128)), ValueError, r"mma_tiler_mn=\(256, 128\) is not supported"),
        ("cluster", ok, dict(cluster_shape_mn=(3, 1)), ValueError, r"cluster_shape_mn=\(3, 1\) is not supported"),
        ("sf_vec_size_float", ok, dict(sf_vec_size=32.0), TypeError,
         "sf_vec_size=32.0 is not supported: it must be an int"),
        ("tiler_float", ok, dict(mma_tiler_mn=(128.0, 128)), TypeError,
         r"mma_tiler_mn=\(128.0, 128\) is not supported: its values must be ints"),
        ("cluster_bool", ok, dict(cluster_shape_mn=(True, 1)), TypeError,
         r"cluster_shape_mn=\(True, 1\) is not supported: its values must be ints"),
        ("tiler_int", ok, dict(mma_tiler_mn=128), TypeError,
         r"mma_tiler_mn=128 is not supported; allowed: \(128, 128\)"),
        ("tiler_none", ok, dict(mma_tiler_mn=None), TypeError, "mma_tiler_mn=None is not supported; allowed"),
        ("tiler_three", ok, dict(mma_tiler_mn=(128, 128, 1)), ValueError, "mma_tiler_mn=.* is not supported"),
        ("cluster_int", ok, dict(cluster_shape_mn=1), TypeError, "cluster_shape_mn=1 is not supported; allowed"),
        ("tiler_sf16", fp4, dict(mma_tiler_mn=(128, 256), sf_vec_size=16), ValueError,
         r"mma_tiler_mn=\(128, 256\) with sf_vec_size=16"),
        ("fp4_n256_small_k", dict(fp4, sfa=s((128, 4), u8), sfb=s((128, 4), u8)),
         dict(mma_tiler_mn=(128, 256), c_dtype=jnp.float8_e4m3fn), ValueError, "needs K > 128; got K=128"),
        ("align_k", dict(ok, a=s((128, 40), f8), b=s((128, 40), f8)), {}, ValueError,
         "a's contiguous dimension K=40 must be a multiple of 16"),
        ("align_c", dict(ok, b=s((130, 64), f8), sfb=s((130, 2), u8)), {}, ValueError,
         r"c's contiguous dimension N=130 \(the result, from b and c_dtype=float32\) must be a multiple of 4"),
        ("alpha_mxfp8", ok, dict(alpha=np.float32(2.0)), ValueError, "alpha .the per-tensor fp32 scale. belongs"),
        ("alpha_shape", fp4, dict(alpha=np.ones(2, np.float32), sf_vec_size=16), ValueError,
         "alpha must be a float32 scalar"),
        ("alpha_string", fp4, dict(alpha="2", sf_vec_size=16), TypeError, "alpha must be a float32 scalar; got '2'"),
        ("implementation", ok, dict(implementation="triton"), ValueError,
         "implementation='triton' is not supported; allowed: None, 'cutedsl', 'xla'"),
    ]


class ErrorTest(parameterized.TestCase):

    @parameterized.named_parameters(*_gemm_error_cases())
    def test_gemm_amax_errors(self, args, kwargs, error, pattern):
        with self.assertRaisesRegex(error, pattern):
            jax.eval_shape(lambda a, b, sfa, sfb: jbg.gemm_amax(a, b, sfa, sfb, **kwargs), **args)

    def test_numpy_integer_choices(self):
        """NumPy integers are ints: sf_vec_size, mma_tiler_mn and cluster_shape_mn may be given as them."""
        s = jax.ShapeDtypeStruct
        a, sf = s((128, 64), jnp.float8_e4m3fn), s((128, 2), jnp.uint8)
        c, _ = jax.eval_shape(lambda *o: jbg.gemm_amax(*o, sf_vec_size=np.int64(32), mma_tiler_mn=(np.int32(128), 128),
                                                       cluster_shape_mn=(np.int64(1), 1)), a, a, sf, sf)
        self.assertEqual(c.shape, (128, 128))

    def test_non_array_operands(self):
        """Lists, None and scalars get a TypeError naming the argument; NumPy arrays are arrays."""
        a, b, sfa, sfb = _mx_inputs(np.random.default_rng(0), None, 128, 128, 64)
        cases = ((lambda: jbg.gemm_amax([[1]], b, sfa, sfb), "a must be an array .*; got list"),
                 (lambda: jbg.gemm_amax(a, None, sfa, sfb), "b must be an array .*; got NoneType"),
                 (lambda: jbg.gemm_amax(a, b, 1.0, sfb), "sfa must be an array .*; got float"),
                 (lambda: jbg.gemm_amax_jax_sm100([[1]], b[..., None], sfa, sfb), "a_tensor must be an array"),
                 (lambda: jbg.gemm_amax_jax_sm100(a[..., None], b[..., None], sfa, [1]),
                  "sfb_tensor must be an array"))
        for call, pattern in cases:
            with self.subTest(pattern=pattern), self.assertRaisesRegex(TypeError, pattern):
                call()
        r = _rope_inputs(np.random.default_rng(1), 32, 1, 64, mxfp8=True)
        with self.assertRaisesRegex(TypeError, "x must be an array .*; got list"):
            jbg.gemm_proj_rope_mxfp8(np.asarray(r["x"]).tolist(), r["w"], r["cos"], r["sin"])
        with self.assertRaisesRegex(TypeError, "x_scale must be an array .*; got list"):
            jbg.gemm_proj_rope_mxfp8(r["x"], r["w"], r["cos"], r["sin"], x_scale=[1], w_scale=r["w_scale"])
        c, amax = jbg.gemm_amax(*(np.asarray(v) for v in (a, b, sfa, sfb)), implementation="xla")
        self.assertEqual(c.shape, (128, 128))

    def test_seed_form_names_its_arguments(self):
        """gemm_amax_jax_sm100's errors name a_tensor / b_tensor and show their (MN, K, L) shapes."""
        s = jax.ShapeDtypeStruct
        f8, sf = jnp.float8_e4m3fn, s((128, 2), jnp.uint8)
        with self.assertRaisesRegex(ValueError, r"a_tensor and b_tensor disagree on K: a_tensor gives K=64 \(shape "
                                                r"\(128, 64, 1\)\), b_tensor gives K=96 \(shape \(128, 96, 1\)\)"):
            jax.eval_shape(jbg.gemm_amax_jax_sm100, s((128, 64, 1), f8), s((128, 96, 1), f8), sf, sf)
        with self.assertRaisesRegex(TypeError, "a_tensor has dtype float32; allowed"):
            jax.eval_shape(jbg.gemm_amax_jax_sm100, s((128, 64, 1), jnp.float32), s((128, 64, 1), f8), sf, sf)
        with self.assertRaisesRegex(ValueError, r"a_tensor and b_tensor must have the same batch size L; got "
                                                r"a_tensor: \(128, 64, 2\), b_tensor: \(128, 64, 1\)"):
            jax.eval_shape(jbg.gemm_amax_jax_sm100, s((128, 64, 2), f8), s((128, 64, 1), f8), sf, sf)

    def test_seed_form_rank(self):
        a = jax.ShapeDtypeStruct((128, 64), jnp.float8_e4m3fn)
        with self.assertRaisesRegex(ValueError, r"a_tensor must have shape \(MN, K, L\); got \(128, 64\)"):
            jax.eval_shape(jbg.gemm_amax_jax_sm100, a, a, a, a)

    @parameterized.named_parameters(
        ("x_dtype", dict(x=jnp.float32), {}, TypeError, "x has dtype float32; allowed: bfloat16"),
        ("mixed", dict(w=jnp.float8_e4m3fn), {}, TypeError, "x and w must have the same dtype"),
        ("w_rows", dict(w_shape=(190, 64)), {}, ValueError, "positive multiple of HEAD_DIM=192"),
        ("w_k", dict(w_shape=(192, 32)), {}, ValueError, "does not match x's K=64"),
        ("w_layout", dict(w_shape=(64, 192)), {}, ValueError, r"expected \(H\*192, K\) for w_out_in=True"),
        ("tokens", dict(t=48), {}, ValueError, "multiple of 32"),
        ("k_bf16", dict(k=60, w_shape=(192, 60)), {}, ValueError, "multiple of 8 on the bf16 path"),
        ("k_mxfp8", dict(k=48, w_shape=(192, 48), x=jnp.float8_e4m3fn, w=jnp.float8_e4m3fn), {}, ValueError,
         "multiple of 32 on the MXFP8 path"),
        ("x_rank", dict(x_shape=(1, 32, 64)), {}, ValueError, "x must have rank 2"),
        ("cos_dtype", dict(cos=jnp.float32), {}, TypeError, "cos has dtype float32; allowed: bfloat16"),
        ("sin_shape", dict(sin_shape=(32, 32)), {}, ValueError, r"sin has shape \(32, 32\); expected \(T, 64\)"),
        ("scales_on_bf16", {}, dict(x_scale=jax.ShapeDtypeStruct((32, 2), jnp.uint8)), ValueError,
         "must be None on the bf16 path"),
        ("missing_scales", dict(x=jnp.float8_e4m3fn, w=jnp.float8_e4m3fn), {}, ValueError,
         "x_scale and w_scale are required"),
        ("w_out_in", {}, dict(w_out_in="yes"), TypeError, "w_out_in must be a bool"),
        ("implementation", {}, dict(implementation="cudnn"), ValueError, "implementation='cudnn' is not supported"),
    )
    def test_proj_rope_errors(self, shapes, kwargs, error, pattern):
        t, k = shapes.get("t", 32), shapes.get("k", 64)
        s = jax.ShapeDtypeStruct
        x = s(shapes.get("x_shape", (t, k)), shapes.get("x", jnp.bfloat16))
        w = s(shapes.get("w_shape", (192, k)), shapes.get("w", jnp.bfloat16))
        cos = s((t, 64), shapes.get("cos", jnp.bfloat16))
        sin = s(shapes.get("sin_shape", (t, 64)), jnp.bfloat16)
        kw = dict(kwargs)
        scales = {name: kw.pop(name) for name in ("x_scale", "w_scale") if name in kw}
        with self.assertRaisesRegex(error, pattern):
            jax.eval_shape(lambda *o: jbg.gemm_proj_rope_mxfp8(*o, **scales, **kw), x, w, cos, sin)

    def test_proj_rope_scale_errors(self):
        s = jax.ShapeDtypeStruct
        x, w = s((32, 64), jnp.float8_e4m3fn), s((192, 64), jnp.float8_e4m3fn)
        cs = s((32, 64), jnp.bfloat16)
        with self.assertRaisesRegex(ValueError, r"w_scale has shape \(2, 192\); expected \(192, 2\)"):
            jax.eval_shape(lambda *o: jbg.gemm_proj_rope_mxfp8(*o[:4], x_scale=o[4], w_scale=o[5]),
                           x, w, cs, cs, s((32, 2), jnp.uint8), s((2, 192), jnp.uint8))
        with self.assertRaisesRegex(TypeError, "x_scale has dtype float32"):
            jax.eval_shape(lambda *o: jbg.gemm_proj_rope_mxfp8(*o[:4], x_scale=o[4], w_scale=o[5]),
                           x, w, cs, cs, s((32, 2), jnp.float32), s((192, 2), jnp.uint8))


class EndToEndTest(parameterized.TestCase):
    """The public API's normalization (scale forms and dtypes, FP4 containers, majors, alpha) against the oracle."""

    @parameterized.named_parameters(
        dict(testcase_name="mxfp8_mn_major_seed_view", fmt="mxfp8_e4m3", a_major="m", b_major="n", c_major="m",
             scales="seed", scale_dtype="e8m0", c_dtype=jnp.float32),
        dict(testcase_name="mxfp8_e5m2_compact_int8", fmt="mxfp8_e5m2", scales="compact", scale_dtype="int8",
             c_dtype=jnp.bfloat16),
        dict(testcase_name="mxfp4_float4_arrays", fmt="mxfp4", scales="atom", scale_dtype="uint8",
             c_dtype=jnp.float16, float4=True),
        dict(testcase_name="nvfp4_alpha_fp4_c", fmt="nvfp4", scales="compact", scale_dtype="e4m3",
             c_dtype=jnp.float4_e2m1fn, alpha=True),
        dict(testcase_name="nvfp4_fp8_c", fmt="nvfp4", scales="seed", scale_dtype="e4m3", c_dtype=jnp.float8_e4m3fn),
    )
    def test_matches_oracle(self, fmt, scales, scale_dtype, c_dtype, a_major="k", b_major="k", c_major="n",
                            float4=False, alpha=False):
        rng = np.random.default_rng(abs(hash(fmt + scales)) % 2**32)
        narrow = np.dtype(c_dtype) not in (np.dtype(np.float32), np.dtype(jnp.bfloat16))
        d = oracle_ops.random_gemm_inputs(rng, l=2, m=144, n=64, k=96, fmt=fmt, a_major=a_major, b_major=b_major,
                                          scale_log2=(-5.0, -3.0) if narrow else None)
        a, b = jnp.asarray(d["a"]), jnp.asarray(d["b"])
        if float4:
            a, b = jbg.formats.unpack_fp4(a), jbg.formats.unpack_fp4(b)
        form = {"compact": lambda key: d[key], "atom": lambda key: d[key + "_atom"],
                "seed": lambda key: np.asarray(jbg.formats.atom_to_seed_view(jnp.asarray(d[key + "_atom"])))}[scales]
        sfa, sfb = jnp.asarray(form("sfa")), jnp.asarray(form("sfb"))
        if scale_dtype == "e8m0":
            sfa, sfb = (jax.lax.bitcast_convert_type(x, jnp.float8_e8m0fnu) for x in (sfa, sfb))
        elif scale_dtype == "int8":
            sfa, sfb = (jax.lax.bitcast_convert_type(x, jnp.int8) for x in (sfa, sfb))
        kw = dict(c_dtype=c_dtype, a_major=a_major, b_major=b_major, c_major=c_major, sf_vec_size=d["sf_vec_size"])
        if alpha:
            kw["alpha"] = jnp.float32(d["alpha"])
        c, amax = jax.jit(lambda *x: jbg.gemm_amax(*x, **kw))(a, b, sfa, sfb)
        c_ref, amax_ref = oracle_ops.gemm_amax_oracle(
            d["a"], d["b"], d["sfa"], d["sfb"], k=96, sf_vec_size=d["sf_vec_size"], a_major=a_major,
            b_major=b_major, alpha=d["alpha"] if alpha else None)
        oracle_ops.assert_gemm_close(self, np.asarray(c), c_ref, c_dtype=c_dtype, c_major=c_major)
        oracle_ops.assert_amax_close(self, np.asarray(amax), np.max(amax_ref))

    @parameterized.parameters(True, False)
    def test_proj_rope_matches_oracle(self, w_out_in):
        rng = np.random.default_rng(17)
        d = oracle_ops.random_proj_rope_inputs(rng, t=64, h=2, k=128, mxfp8=True, w_out_in=w_out_in)
        args = {k: jnp.asarray(v) for k, v in d.items() if k in ("x", "w", "cos", "sin", "x_scale", "w_scale")}
        outs = jax.jit(lambda x, w, cos, sin, x_scale, w_scale: jbg.gemm_proj_rope_mxfp8(
            x, w, cos, sin, x_scale=x_scale, w_scale=w_scale, w_out_in=w_out_in))(**args)
        y_ref = oracle_ops.proj_rope_oracle(d["x"], d["w"], d["cos"], d["sin"], x_scale=d["x_scale"],
                                            w_scale=d["w_scale"], w_out_in=w_out_in)
        oracle_ops.assert_proj_rope_close(self, [np.asarray(o) for o in outs], y_ref)


class TransformTest(parameterized.TestCase):

    @parameterized.parameters(0, 2)
    def test_nan_in_any_batch_poisons_amax(self, bad):
        a, b, sfa, sfb = _mx_inputs(np.random.default_rng(20), 3, 128, 128, 64)
        sfa = sfa.at[bad, 7, 1].set(0xFF)
        c, amax = jax.jit(jbg.gemm_amax)(a, b, sfa, sfb)
        self.assertTrue(np.isnan(float(amax)))
        self.assertTrue(np.isnan(np.asarray(c)[bad, 7]).all())

    def test_gemm_jit_matches_eager(self):
        args = _mx_inputs(np.random.default_rng(1), 2, 136, 132, 96)
        eager = jbg.gemm_amax(*args)
        jitted = jax.jit(jbg.gemm_amax)(*args)
        for x, y in zip(eager, jitted):
            _assert_same(self, x, y)

    @parameterized.parameters(
        ((0, 0, 0, 0),), ((0, None, 0, None),), ((None, 0, None, 0),), ((1, 0, 1, 0),), ((None, None, 0, None),))
    def test_gemm_vmap_matches_loop(self, in_axes):
        rng = np.random.default_rng(2)
        batch = 3
        a, b, sfa, sfb = _mx_inputs(rng, None, 128, 132, 64)
        stacked = [jnp.stack([_mx_inputs(rng, None, 128, 132, 64)[i] for _ in range(batch)], axis=ax or 0)
                   if ax is not None else x for i, (x, ax) in enumerate(zip((a, b, sfa, sfb), in_axes))]
        c, amax = jax.jit(jax.vmap(jbg.gemm_amax, in_axes=in_axes))(*stacked)
        self.assertEqual(c.shape, (batch, 128, 132))
        self.assertEqual(amax.shape, (batch,))
        for i in range(batch):
            one = [jnp.take(x, i, axis=ax) if ax is not None else x for x, ax in zip(stacked, in_axes)]
            c_i, amax_i = jbg.gemm_amax(*one)
            _assert_close(self, c[i], c_i)
            _assert_close(self, amax[i], amax_i)
        # Each example's amax is its own, not the batch's: they differ on random data.
        self.assertGreater(len(np.unique(np.asarray(amax))), 1)

    def test_gemm_nested_vmap(self):
        rng = np.random.default_rng(3)
        sets = [_mx_inputs(rng, None, 128, 128, 64) for _ in range(4)]
        args = [jnp.stack([jnp.stack([s[i] for s in sets[:2]]), jnp.stack([s[i] for s in sets[2:]])])
                for i in range(4)]  # (outer 2, inner 2, ...)
        fn = jax.vmap(jax.vmap(lambda *o: jbg.gemm_amax(*o)))
        c, amax = jax.jit(fn)(*args)
        self.assertEqual(c.shape, (2, 2, 128, 128))
        self.assertEqual(amax.shape, (2, 2))
        c00, amax00 = jbg.gemm_amax(*[x[0, 1] for x in args])
        _assert_close(self, c[0, 1], c00)
        _assert_close(self, amax[0, 1], amax00)

    @parameterized.parameters(None, 2)
    def test_cudnn_form_matches_gemm_amax(self, l):
        """(MN, K, L) operands and physical atoms give gemm_amax's result with L moved last, for any L."""
        rng = np.random.default_rng(4)
        a, b, sfa, sfb = _mx_inputs(rng, l, 128, 256, 64)
        c, amax = jbg.gemm_amax(a, b, sfa, sfb)
        to_mkl = (lambda x: x[..., None]) if l is None else (lambda x: jnp.moveaxis(x, 0, -1))
        atom_a, atom_b = jbg.formats.to_scale_atom(sfa), jbg.formats.to_scale_atom(sfb)
        c3, amax3 = jax.jit(jbg.gemm_amax_jax_sm100)(to_mkl(a), to_mkl(b), atom_a, atom_b)
        _assert_close(self, c3, to_mkl(c))
        _assert_close(self, amax3, amax.reshape(1, 1, 1))
        c3_m, _ = jbg.gemm_amax_jax_sm100(to_mkl(a), to_mkl(b), atom_a, atom_b, c_major="m")
        _assert_close(self, c3_m, jnp.swapaxes(c3, 0, 1))

    @parameterized.parameters(False, True)
    def test_proj_rope_vmap_over_tokens(self, mxfp8):
        rng = np.random.default_rng(5)
        batch = [_rope_inputs(rng, 64, 2, 64, mxfp8) for _ in range(3)]
        w_kw = {k: batch[0][k] for k in ("w", "w_scale") if k in batch[0]}
        stacked = {k: jnp.stack([d[k] for d in batch]) for k in ("x", "cos", "sin", "x_scale") if k in batch[0]}

        def fn(x, cos, sin, x_scale=None):
            return jbg.gemm_proj_rope_mxfp8(x, w_kw["w"], cos, sin, x_scale=x_scale, w_scale=w_kw.get("w_scale"))

        outs = jax.jit(jax.vmap(fn))(**stacked)
        self.assertEqual(outs[3].shape, (3, 2, 2, 192))
        for i, d in enumerate(batch):
            ref = jbg.gemm_proj_rope_mxfp8(d["x"], w_kw["w"], d["cos"], d["sin"], x_scale=d.get("x_scale"),
                                           w_scale=w_kw.get("w_scale"))
            for o, r in zip(outs, ref):
                _assert_same(self, o[i], r)

    def test_proj_rope_vmap_over_weights(self):
        rng = np.random.default_rng(6)
        base = _rope_inputs(rng, 32, 1, 64)
        ws = jnp.stack([_rope_inputs(rng, 32, 1, 64)["w"] for _ in range(2)])
        fn = lambda w, x: jbg.gemm_proj_rope_mxfp8(x, w, base["cos"], base["sin"])
        xs = jnp.stack([base["x"], base["x"] * 2])
        outs = jax.jit(jax.vmap(jax.vmap(fn, in_axes=(None, 0)), in_axes=(0, None)))(ws, xs)
        self.assertEqual(outs[0].shape, (2, 2, 32, 1, 192))
        ref = jbg.gemm_proj_rope_mxfp8(xs[1], ws[0], base["cos"], base["sin"])
        for o, r in zip(outs, ref):
            _assert_same(self, o[0, 1], r)


if __name__ == "__main__":
    absltest.main()
