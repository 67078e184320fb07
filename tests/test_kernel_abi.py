"""CPU: the C header each compiled kernel exports declares the wrapper that the FFI handlers call (ffi/gemm_amax.cc,
ffi/proj_rope.cc, ffi/dequantize.cc, ffi/ragged.cc, ffi/contraction.cc, ffi/quantize_pair.cc): its tensor structs,
its parameters in order, the argument array it launches with.

The default tier checks the representative variants (compiled_kernels.py), every dequantize variant and the broken
kernel the GPU self-check tests load; the `catalog` tier checks every variant. The representative variants also
compile without a deprecation warning from the DSL: an API it has announced it will remove (its static persistent
tile scheduler was one) would stop every user's compile on the release that removes it."""

import re

import pytest
from absl.testing import absltest, parameterized

import broken_kernels
import compiled_kernels
from compiled_kernels import compiled, named
from jax_blockgemm.kernels import catalog

_GEMM_AMAX = tuple(v for v in catalog.CATALOG if v.op == "gemm_amax")
_PROJ_ROPE = tuple(v for v in catalog.CATALOG if v.op == "proj_rope")
# (tensors, int32 sizes) of the wrappers that take their tensors and then their sizes (the grouped kernels and the
# pair quantization), in the order the handlers pass them
_PLAIN_ABI = {"ragged": (("a", "b", "sfa", "sfb", "items", "c", "amax", "alpha"), ("t", "n", "k", "l", "g",
                                                                                  "max_items")),
              "contraction": (("x", "y", "bounds", "c", "amax"), ("t", "k", "n", "l", "g")),
              "quantize_pair": (("w", "row_map", "values", "codes", "scales"), ("rows", "cols", "src_rows"))}
_PLAIN = tuple(v for v in catalog.CATALOG if v.op in _PLAIN_ABI)
_PROJ_ROPE_TENSORS = ("x", "w", "cos", "sin", "x_scale", "w_scale", "row_codes", "row_scales", "col_codes",
                      "col_scales")


def _wrapper_params(header: str, prefix: str) -> list[str]:
    """The exported wrapper's parameters after its first (the module handle), as declared."""
    wrapper = re.search(rf"int32_t cute_dsl_{prefix}_wrapper\(([^)]*)\)", header).group(1)
    return [x.strip() for x in wrapper.split(",")][1:]


def _launch_args(header: str) -> tuple[int, list[str]]:
    """The length of the wrapper's `void *args[n]` and its entries."""
    args = re.search(r"void \*args\[(\d+)\] = \{([^}]*)\}", header)
    return int(args.group(1)), [x.strip() for x in args.group(2).split(",")]


class _AbiChecks(parameterized.TestCase):
    """The header checks of one variant (no tests of its own)."""

    def assert_gemm_amax_abi(self, v: catalog.KernelVariant) -> None:
        header, p = compiled(v).header, v.function_prefix
        tensors = ("a", "b", "sfa", "sfb", "c", "amax") + (("alpha",) if catalog.takes_alpha(v) else ())  # NVFP4
        for name in tensors:
            struct = re.search(r"typedef struct \{([^}]*)\}\s*" + re.escape(f"{p}_Tensor_{name}_t;"), header)
            self.assertIsNotNone(struct, f"no tensor struct for {name!r}")
            fields = [f.strip() for f in struct.group(1).split(";") if f.strip()]
            self.assertEqual(fields, ["void *data", "int64_t dynamic_shapes[1]"], name)
        # sm_100a: max_ctas, the persistent grid the handler works out per device (catalog.grid_cluster_ctas).
        sizes = list("mnkl") + (["max_ctas"] if catalog.grid_cluster_ctas(v) else [])
        self.assertEqual(catalog.grid_cluster_ctas(v) > 0, v.arch == "sm_100a")
        self.assertEqual(_wrapper_params(header, p), [f"{p}_Tensor_{t}_t *{t}" for t in tensors]
                         + [f"int32_t {s}" for s in sizes] + ["cudaStream_t stream"])
        self.assertEqual(_launch_args(header), (len(tensors) + len(sizes) + 2,
                                                list(tensors) + [f"&{s}" for s in sizes] + ["&stream", "&ret"]))

    def assert_proj_rope_abi(self, v: catalog.KernelVariant) -> None:
        header, p = compiled(v).header, v.function_prefix
        self.assertEqual(_wrapper_params(header, p), [f"{p}_Tensor_{t}_t *{t}" for t in _PROJ_ROPE_TENSORS]
                         + [f"int32_t {s}" for s in ("t", "k", "h", "sms")] + ["cudaStream_t stream"])
        self.assertEqual(_launch_args(header)[0], 16)

    def assert_plain_abi(self, v: catalog.KernelVariant) -> None:
        header, p = compiled(v).header, v.function_prefix
        tensors, sizes = _PLAIN_ABI[v.op]
        if v.schedule == catalog.SWAP_AB:  # the swap_ab ragged kernels take amax's tally after alpha, sfb's form last
            tensors, sizes = tensors + ("tally",), sizes + ("sf_atom",)
        self.assertEqual(_wrapper_params(header, p), [f"{p}_Tensor_{t}_t *{t}" for t in tensors]
                         + [f"int32_t {s}" for s in sizes] + ["cudaStream_t stream"])
        self.assertEqual(_launch_args(header), (len(tensors) + len(sizes) + 2,
                                                list(tensors) + [f"&{s}" for s in sizes] + ["&stream", "&ret"]))


class AbiTest(_AbiChecks):

    @parameterized.named_parameters(named(compiled_kernels.representatives(_GEMM_AMAX)
                                          + [broken_kernels.NEGATED_CORNER]))
    def test_gemm_amax(self, v):
        self.assert_gemm_amax_abi(v)

    @parameterized.named_parameters(named(compiled_kernels.representatives(_PROJ_ROPE)))
    def test_proj_rope(self, v):
        self.assert_proj_rope_abi(v)

    @parameterized.named_parameters(named(compiled_kernels.representatives(_PLAIN)))
    def test_plain(self, v):
        self.assert_plain_abi(v)

    @parameterized.named_parameters(named(v for v in catalog.CATALOG if v.op == "dequantize"))
    def test_dequantize(self, v):
        """Two operands per launch, each codes, scales, out, rows, cols."""
        header, p = compiled(v).header, v.function_prefix
        operand = lambda s: [f"{p}_Tensor_{t}{s}_t *{t}{s}" for t in ("codes", "scales", "out")] + [
            f"int32_t rows{s}", f"int32_t cols{s}"]
        self.assertEqual(_wrapper_params(header, p), operand("") + operand("1") + ["cudaStream_t stream"])
        self.assertEqual(_launch_args(header)[1], ["codes", "scales", "out", "&rows", "&cols", "codes1", "scales1",
                                                   "out1", "&rows1", "&cols1", "&stream", "&ret"])

    @parameterized.named_parameters(named(compiled_kernels.representatives(catalog.CATALOG)))
    def test_no_deprecated_dsl_api(self, v):
        self.assertEqual(compiled(v).deprecations, ())


@pytest.mark.catalog
class CatalogAbiTest(_AbiChecks):

    @parameterized.named_parameters(named(_GEMM_AMAX + broken_kernels.BROKEN))
    def test_gemm_amax(self, v):
        self.assert_gemm_amax_abi(v)

    @parameterized.named_parameters(named(_PROJ_ROPE))
    def test_proj_rope(self, v):
        self.assert_proj_rope_abi(v)

    @parameterized.named_parameters(named(_PLAIN))
    def test_plain(self, v):
        self.assert_plain_abi(v)


if __name__ == "__main__":
    absltest.main()
