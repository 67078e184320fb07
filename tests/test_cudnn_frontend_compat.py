"""The *_jax_sm100 entry points against cuDNN frontend's JAX entry points of the same names.

They exist so that a cuDNN frontend user can switch by changing the import: every call valid against NVIDIA's
function must be valid against ours and mean the same. NVIDIA's sources are read with `ast` from the installed
`nvidia-cudnn-frontend` wheel, never imported (importing the cudnn package can need CUDA libraries).
"""

import ast
import importlib.metadata
import inspect
import pathlib
import subprocess
import sys
from typing import Any, Callable, Optional

import cutlass
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_blockgemm as jbg

WHEEL = "nvidia-cudnn-frontend"
# Our function name -> the folder under cudnn/gemm/cutedsl/dense/ whose jax_api.py defines NVIDIA's.
NVIDIA_MODULES = {"gemm_amax_jax_sm100": "amax", "gemm_proj_rope_mxfp8_jax_sm100": "proj_rope_mxfp8"}
# The benchmark's problem sizes: GEMM (M, N, K), and DeepSeek-V3's MLA Q up-projection (K, heads, tokens).
GEMM_SHAPES = ((8192, 8192, 8192), (4096, 7168, 16384), (4096, 24576, 1536))
PROJ_K, PROJ_HEADS, PROJ_TOKENS = 1536, 128, (2048, 4096)


def _nvidia_wheel() -> Optional[importlib.metadata.Distribution]:
    try:
        return importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_source(dist: importlib.metadata.Distribution, folder: str) -> pathlib.Path:
    """The installed jax_api.py of one dense GEMM family, found through the wheel's file record."""
    suffix = f"cudnn/gemm/cutedsl/dense/{folder}/jax_api.py"
    for record in dist.files or ():
        if str(record).replace("\\", "/").endswith(suffix):
            return pathlib.Path(dist.locate_file(record))
    raise AssertionError(f"{WHEEL} {dist.version} is installed but ships no {suffix}; the *_jax_sm100 entry points "
                         "have nothing to mirror.")


def _default_value(node: ast.expr) -> Any:
    """A default as NVIDIA's code spells it: a literal, or a CuTeDSL dtype `cutlass.Name`."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cutlass":
        return getattr(cutlass, node.attr)
    return ast.literal_eval(node)


def _nvidia_parameters(dist: importlib.metadata.Distribution, name: str) -> list[inspect.Parameter]:
    """NVIDIA's function `name` as inspect.Parameters (annotations dropped), from its source alone."""
    tree = ast.parse(_nvidia_source(dist, NVIDIA_MODULES[name]).read_text())
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, f"{WHEEL}: expected one top-level def {name}, found {len(found)}"
    args, P = found[0].args, inspect.Parameter
    positional = args.posonlyargs + args.args
    defaults = [P.empty] * (len(positional) - len(args.defaults)) + [_default_value(d) for d in args.defaults]
    params = [P(arg.arg, P.POSITIONAL_ONLY if i < len(args.posonlyargs) else P.POSITIONAL_OR_KEYWORD, default=default)
              for i, (arg, default) in enumerate(zip(positional, defaults))]
    if args.vararg:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    params += [P(arg.arg, P.KEYWORD_ONLY, default=P.empty if default is None else _default_value(default))
               for arg, default in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return params


def _gemm_operands(m: int, n: int, k: int, l: int = 1, dtype: Any = jnp.float8_e4m3fn) -> tuple[Any, ...]:
    """Abstract MXFP8 operands in NVIDIA's layout: (MN, K, L) codes and physical (L, MN', K', 32, 4, 4) atoms."""
    kt = -(-k // 128)
    return (jax.ShapeDtypeStruct((m, k, l), dtype), jax.ShapeDtypeStruct((n, k, l), dtype),
            jax.ShapeDtypeStruct((l, -(-m // 128), kt, 32, 4, 4), jnp.uint8),
            jax.ShapeDtypeStruct((l, -(-n // 128), kt, 32, 4, 4), jnp.uint8))


def _proj_rope_operands(t: int, k: int, h: int, mxfp8: bool, scale_dtype: Any = jnp.uint8) -> tuple[Any, ...]:
    """Abstract proj_rope inputs with w as (H*192, K); positional scales only on the MXFP8 path."""
    dtype = jnp.float8_e4m3fn if mxfp8 else jnp.bfloat16
    ops = (jax.ShapeDtypeStruct((t, k), dtype), jax.ShapeDtypeStruct((h * 192, k), dtype),
           jax.ShapeDtypeStruct((t, 64), jnp.bfloat16), jax.ShapeDtypeStruct((t, 64), jnp.bfloat16))
    if mxfp8:
        ops += (jax.ShapeDtypeStruct((t, k // 32), scale_dtype),
                jax.ShapeDtypeStruct((h * 192, k // 32), scale_dtype))
    return ops


def _avals(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[tuple[tuple[int, ...], np.dtype]]:
    outs = jax.eval_shape(lambda *ops: fn(*ops, **kwargs), *args)
    return [(tuple(o.shape), np.dtype(o.dtype)) for o in outs]


# Valid abstract operands per function, for checking that a default means the same when passed explicitly.
SAMPLE_OPERANDS = {"gemm_amax_jax_sm100": _gemm_operands(256, 384, 128),
                   "gemm_proj_rope_mxfp8_jax_sm100": _proj_rope_operands(64, 128, 2, mxfp8=True)}


@absltest.skipIf(_nvidia_wheel() is None, f"{WHEEL} is not installed (pip install -e '.[test]' brings it)")
class SignatureTest(parameterized.TestCase):
    """Same parameter names, order, kinds and defaults as NVIDIA's; our additions keyword-only with defaults."""

    @parameterized.parameters(*NVIDIA_MODULES)
    def test_nvidia_parameters_come_first_with_the_same_names_and_kinds(self, name):
        theirs = _nvidia_parameters(_nvidia_wheel(), name)
        ours = list(inspect.signature(getattr(jbg, name)).parameters.values())
        not_keyword_only = [p for p in ours if p.kind != inspect.Parameter.KEYWORD_ONLY]
        self.assertEqual([(p.name, p.kind) for p in not_keyword_only],
                         [(p.name, p.kind) for p in theirs if p.kind != inspect.Parameter.KEYWORD_ONLY])

    @parameterized.parameters(*NVIDIA_MODULES)
    def test_our_additions_are_keyword_only_with_defaults(self, name):
        theirs = {p.name for p in _nvidia_parameters(_nvidia_wheel(), name)}
        ours = inspect.signature(getattr(jbg, name)).parameters
        extras = [p for p in ours.values() if p.name not in theirs]
        self.assertTrue(extras, "expected at least `implementation` beyond NVIDIA's parameters")
        for p in extras:
            self.assertEqual(p.kind, inspect.Parameter.KEYWORD_ONLY, p.name)
            self.assertIsNot(p.default, inspect.Parameter.empty, p.name)
        self.assertIn("implementation", ours)

    @parameterized.parameters(*NVIDIA_MODULES)
    def test_defaults_mean_the_same(self, name):
        fn = getattr(jbg, name)
        ours = inspect.signature(fn).parameters
        operands = SAMPLE_OPERANDS[name]
        implicit = _avals(fn, *operands)
        for p in _nvidia_parameters(_nvidia_wheel(), name):
            if p.default is inspect.Parameter.empty:
                continue
            with self.subTest(parameter=p.name):
                self.assertIsNot(ours[p.name].default, inspect.Parameter.empty, "NVIDIA's has a default, ours not")
                if isinstance(p.default, type) and p.default.__module__.startswith("cutlass"):
                    # A CuTeDSL dtype: passing NVIDIA's default explicitly must change nothing.
                    self.assertEqual(_avals(fn, *operands, **{p.name: p.default}), implicit)
                elif isinstance(p.default, tuple):
                    self.assertEqual(tuple(ours[p.name].default), p.default)
                else:
                    self.assertEqual(ours[p.name].default, p.default)


class GemmAmaxShapeTest(parameterized.TestCase):
    """C (M, N, L) in c_dtype and amax (1, 1, 1) float32, as NVIDIA's function declares them."""

    @parameterized.product(shape=GEMM_SHAPES,
                           c_dtype=[(cutlass.Float32, jnp.float32), (cutlass.BFloat16, jnp.bfloat16),
                                    (cutlass.Float16, jnp.float16), (jnp.bfloat16, jnp.bfloat16),
                                    ("float16", jnp.float16)])
    def test_benchmark_shapes(self, shape, c_dtype):
        m, n, k = shape
        given, expected = c_dtype
        (c, amax) = _avals(jbg.gemm_amax_jax_sm100, *_gemm_operands(m, n, k), c_dtype=given)
        self.assertEqual(c, ((m, n, 1), np.dtype(expected)))
        self.assertEqual(amax, ((1, 1, 1), np.dtype(np.float32)))

    def test_every_parameter_positional_as_nvidia_orders_them(self):
        fn = lambda *ops: jbg.gemm_amax_jax_sm100(*ops, cutlass.BFloat16, cutlass.Float32, (128, 256), (2, 1), 32)
        c, amax = jax.eval_shape(fn, *_gemm_operands(512, 768, 256))
        self.assertEqual((c.shape, np.dtype(c.dtype)), ((512, 768, 1), np.dtype(jnp.bfloat16)))
        self.assertEqual(amax.shape, (1, 1, 1))

    def test_batch_beyond_nvidia(self):
        (c, amax) = _avals(jbg.gemm_amax_jax_sm100, *_gemm_operands(256, 128, 64, l=3))
        self.assertEqual(c, ((256, 128, 3), np.dtype(np.float32)))
        self.assertEqual(amax, ((1, 1, 1), np.dtype(np.float32)))

    @parameterized.named_parameters(
        ("c_int8", dict(c_dtype=cutlass.Int8), TypeError, "c_dtype=cutlass.Int8 is not supported"),
        ("acc_f16", dict(acc_dtype=cutlass.Float16), ValueError, "acc_dtype=float16 is not supported"),
    )
    def test_cutlass_dtypes_nvidia_rejects_are_rejected(self, kwargs, error, pattern):
        with self.assertRaisesRegex(error, pattern):
            _avals(jbg.gemm_amax_jax_sm100, *_gemm_operands(256, 256, 128), **kwargs)


class ProjRopeShapeTest(parameterized.TestCase):
    """The four outputs NVIDIA's function declares: E4M3 codes and E8M0 bytes, rowwise and columnwise."""

    @parameterized.product(tokens=PROJ_TOKENS, path=["bf16", "mxfp8_uint8", "mxfp8_e8m0"])
    def test_benchmark_shapes(self, tokens, path):
        scale_dtype = jnp.float8_e8m0fnu if path == "mxfp8_e8m0" else jnp.uint8
        ops = _proj_rope_operands(tokens, PROJ_K, PROJ_HEADS, mxfp8=path != "bf16", scale_dtype=scale_dtype)
        e4m3, byte = np.dtype(jnp.float8_e4m3fn), np.dtype(np.uint8)
        self.assertEqual(_avals(jbg.gemm_proj_rope_mxfp8_jax_sm100, *ops),
                         [((tokens, PROJ_HEADS, 192), e4m3), ((tokens, PROJ_HEADS, 6), byte),
                          ((tokens, PROJ_HEADS, 192), e4m3), ((tokens // 32, PROJ_HEADS, 192), byte)])

    def test_w_in_out_beyond_nvidia(self):
        x, w, cos, sin, xs, ws = _proj_rope_operands(64, 128, 2, mxfp8=True)
        w_t = jax.ShapeDtypeStruct(w.shape[::-1], w.dtype)
        ws_t = jax.ShapeDtypeStruct(ws.shape[::-1], ws.dtype)
        self.assertEqual(_avals(jbg.gemm_proj_rope_mxfp8_jax_sm100, x, w_t, cos, sin, xs, ws_t, w_out_in=False),
                         _avals(jbg.gemm_proj_rope_mxfp8_jax_sm100, x, w, cos, sin, xs, ws))


class ImportTest(absltest.TestCase):

    def test_package_import_leaves_cutedsl_unloaded(self):
        """Accepting cutlass dtypes must not make `import jax_blockgemm` load CuTeDSL (a slow import)."""
        code = "import sys, jax_blockgemm; print(sorted(m for m in sys.modules if m.split('.')[0] == 'cutlass'))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        self.assertEqual(out.strip(), "[]")


if __name__ == "__main__":
    absltest.main()
