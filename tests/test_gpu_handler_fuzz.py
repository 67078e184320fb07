"""Fuzzing the XLA FFI handlers: inconsistent buffers and attributes must end in an error naming the problem.

Raw `jax.ffi.ffi_call` bypasses every Python check (api.py, support.py, ffi_lowering.py), so the handler's own C++
checks are all that stands between a bad call and a kernel reading or writing out of range. Each handler is a
`Target`: a well-formed call plus a table of broken variants of it (`Case`s). The same table runs
- on CPU, always: through the very C++ functions the handler calls (the `_jbg_ffi` test hooks), plus XLA:CPU's real
  instantiate stage for the attribute cases, plus hypothesis-generated dims and bytes;
- on a GPU with a kernel (skipped elsewhere, e.g. in CI): through raw `jax.ffi.ffi_call` on CUDA; afterwards the
  well-formed call must still match the float64 oracle. benchmarks/sanitize.py runs this module under
  `compute-sanitizer --tool memcheck`.
Each handler (gemm_amax in four kinds, proj_rope, dequantize) is one `Target` in TARGETS.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
try:  # the test extra has it; a bare GPU machine may not, and the GPU cases need none of it
    from hypothesis import HealthCheck, given, settings, strategies as st
except ImportError:
    st = None

from jax_blockgemm import _native, arch, dispatch, kernel_cache

import oracle
import oracle_ops

ext = _native.extension()
U8, F32, BF16, E4M3, E5M2 = "uint8", "float32", "bfloat16", "float8_e4m3fn", "float8_e5m2"
E8M0, E2M1 = "float8_e8m0fnu", "float4_e2m1fn"
DEVICE_ARCH = "sm_90a"  # the arch whose object the GPU run loads (the H200); CPU checks emulate that device


@dataclasses.dataclass(frozen=True)
class Buffer:
    dtype: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Call:
    """One raw custom call: operand and result buffers and the typed-FFI attributes."""

    operands: tuple[Buffer, ...]
    results: tuple[Buffer, ...]
    attrs: dict

    def replace(self, *, operand: int | None = None, result: int | None = None, buffer: Buffer | None = None,
                **attrs: Any) -> "Call":
        ops, res = list(self.operands), list(self.results)
        if operand is not None:
            ops[operand] = buffer
        if result is not None:
            res[result] = buffer
        return Call(tuple(ops), tuple(res), {**self.attrs, **attrs})


@dataclasses.dataclass(frozen=True)
class Case:
    """A broken call and the regex its error must match. stage: where the handler refuses it ('attributes':
    parsing at instantiation, before any device is touched; 'object': loading at instantiation; 'buffers':
    every execution). cpu=False for cases only a device can decide (which capability it has)."""

    name: str
    call: Call
    message: str
    stage: str
    cpu: bool = True


@dataclasses.dataclass(frozen=True)
class Target:
    """One FFI handler under fuzz: its name, the object it loads, a well-formed call, its cases and a CPU twin
    that runs the handler's C++ checks on a call through the module's test hooks ('' = accepted)."""

    name: str
    object_fn: Callable[[], tuple[bytes, str]]
    well_formed: Callable[[bytes, str], Call]
    cases: Callable[[Call], list[Case]]
    cpu_check: Callable[[Call], str]


# --------------------------------------------------------------------------------------------------------------
# jbg_gemm_amax


def _cdiv(x: int, y: int) -> int:
    return -(-x // y)


def gemm_amax_buffers(l: int, m: int, n: int, k: int, ab: str = E4M3, c: str = F32) -> tuple[tuple, tuple]:
    """Well-formed (operands, results) of the handler: a, b, sfa, sfb and c, amax."""
    kp = _cdiv(_cdiv(k, 32), 4)
    operands = (Buffer(ab, (l, m, k)), Buffer(ab, (l, n, k)), Buffer(U8, (l, _cdiv(m, 128), kp, 32, 4, 4)),
                Buffer(U8, (l, _cdiv(n, 128), kp, 32, 4, 4)))
    return operands, (Buffer(c, (l, m, n)), Buffer(F32, (l,)))


@functools.lru_cache(maxsize=None)
def _gemm_amax_object() -> tuple[bytes, str]:
    """The real sm_90a e4m3 -> f32 object (compiled by CuTeDSL without a GPU, cached) and its function prefix."""
    from jax_blockgemm.kernels import catalog

    variant = catalog.select_variant(arch=DEVICE_ARCH, ab_dtype=E4M3, c_dtype=F32, sf_vec_size=32,
                                     tile_mn=(128, 128), cluster_mn=(1, 1))
    return kernel_cache.get_object(variant), variant.function_prefix


def _gemm_amax_well_formed(obj: bytes, prefix: str) -> Call:
    operands, results = gemm_amax_buffers(2, 200, 136, 96)
    return Call(operands, results, dict(archs=DEVICE_ARCH, function_prefixes=prefix, objects=obj,
                                        offsets=(0, len(obj)), ab_dtype=E4M3, c_dtype=F32, sf_dtype=E8M0,
                                        sf_vec_size=32, a_major="k", b_major="k", cluster_ctas=(0,)))


def _gemm_amax_cases(good: Call) -> list[Case]:
    obj, prefix = good.attrs["objects"], good.attrs["function_prefixes"]
    a, b, sfa, sfb = good.operands
    c, amax = good.results
    l, m, k = a.shape
    n = b.shape[1]
    kp = sfa.shape[2]
    elf_header_only = obj[:64]
    buffers = [
        ("a of another dtype", dict(operand=0, buffer=Buffer(BF16, a.shape)), r"a is bfloat16 \(2, 200, 96\); "
         r"expected float8_e4m3fn or float8_e5m2"),
        ("a and b e5m2 for an e4m3 kernel", None, r"a is float8_e5m2 .*compiled for float8_e4m3fn operands"),
        ("b of another fp8 dtype", dict(operand=1, buffer=Buffer(E5M2, b.shape)), r"b is float8_e5m2 .*expected "
         r"the dtype of a \(float8_e4m3fn\)"),
        ("sfa as int8", dict(operand=2, buffer=Buffer("int8", sfa.shape)), r"sfa is another dtype .*expected uint8"),
        ("sfb as float32", dict(operand=3, buffer=Buffer(F32, sfb.shape)), r"sfb is float32 .*expected uint8"),
        ("c bf16 for an f32 kernel (would be written past its end)", dict(result=0, buffer=Buffer(BF16, c.shape)),
         r"c is bfloat16 \(2, 200, 136\); the kernel objects were compiled for a float32 C"),
        ("c float16 for an f32 kernel", dict(result=0, buffer=Buffer("float16", c.shape)),
         r"c is float16 \(2, 200, 136\); the kernel objects were compiled for a float32 C"),
        ("c int32", dict(result=0, buffer=Buffer("int32", c.shape)), r"c is int32 .*expected float32, "
         r"bfloat16, float16"),
        ("amax bf16", dict(result=1, buffer=Buffer(BF16, amax.shape)), r"amax is bfloat16 \(2,\); expected float32"),
        ("a rank 2", dict(operand=0, buffer=Buffer(E4M3, (m, k))), r"a is .*expected rank 3 \(L, M, K\)"),
        ("a rank 4", dict(operand=0, buffer=Buffer(E4M3, (1, l, m, k))), r"a is .*expected rank 3"),
        ("M = 0", dict(operand=0, buffer=Buffer(E4M3, (l, 0, k))), r"a is .*\(2, 0, 96\); expected every dimension"),
        ("L = 0", dict(operand=0, buffer=Buffer(E4M3, (0, m, k))), r"a is .*expected every dimension >= 1"),
        ("K = 0", dict(operand=0, buffer=Buffer(E4M3, (l, m, 0))), r"a is .*expected every dimension >= 1"),
        ("K not a multiple of 16", dict(operand=0, buffer=Buffer(E4M3, (l, m, 40))), r"a is .*K a multiple of 16"),
        ("N = 0", dict(operand=1, buffer=Buffer(E4M3, (l, 0, k))), r"b is .*expected \(L, N, K\) = \(2, N >= 1, 96\)"),
        ("b's K disagrees with a's", dict(operand=1, buffer=Buffer(E4M3, (l, n, k + 16))), r"b is .*\(L, N, K\) = "
         r"\(2, N >= 1, 96\)"),
        ("b's L disagrees with a's", dict(operand=1, buffer=Buffer(E4M3, (l + 1, n, k))), r"b is .*\(L, N, K\)"),
        ("b rank 2", dict(operand=1, buffer=Buffer(E4M3, (n, k))), r"b is .*\(L, N, K\)"),
        ("sfa for a smaller M", dict(operand=2, buffer=Buffer(U8, (l, 1, kp, 32, 4, 4))),
         r"sfa is uint8 \(2, 1, 1, 32, 4, 4\); expected \(2, 2, 1, 32, 4, 4\)"),
        ("sfa for a larger K", dict(operand=2, buffer=Buffer(U8, (l, 2, kp + 1, 32, 4, 4))), r"sfa is .*expected "
         r"\(2, 2, 1, 32, 4, 4\)"),
        ("sfa flat", dict(operand=2, buffer=Buffer(U8, (l * 2 * kp * 512,))), r"sfa is uint8 \(2048,\); expected"),
        ("sfa compact form", dict(operand=2, buffer=Buffer(U8, (l, m, 3))), r"sfa is .*the 128x4 scale atom"),
        ("sfb zero-sized", dict(operand=3, buffer=Buffer(U8, (l, 0, kp, 32, 4, 4))), r"sfb is .*expected "
         r"\(2, 2, 1, 32, 4, 4\)"),
        ("sfb transposed atom", dict(operand=3, buffer=Buffer(U8, (l, 2, kp, 4, 32, 4))), r"sfb is .*expected"),
        ("c transposed", dict(result=0, buffer=Buffer(F32, (l, n, m))), r"c is float32 \(2, 136, 200\); expected "
         r"\(2, 200, 136\) \(L, M, N\)"),
        ("c too small", dict(result=0, buffer=Buffer(F32, (l, m, n - 8))), r"c is .*expected \(2, 200, 136\)"),
        ("c unbatched", dict(result=0, buffer=Buffer(F32, (m, n))), r"c is .*expected \(2, 200, 136\)"),
        ("amax scalar", dict(result=1, buffer=Buffer(F32, ())), r"amax is float32 \(\); expected \(2,\)"),
        ("amax one entry for L = 2", dict(result=1, buffer=Buffer(F32, (1,))), r"amax is .*\(1,\); expected \(2,\)"),
        ("amax (L, 1)", dict(result=1, buffer=Buffer(F32, (l, 1))), r"amax is .*\(2, 1\); expected \(2,\)"),
        ("amax zero-sized", dict(result=1, buffer=Buffer(F32, (0,))), r"amax is .*\(0,\); expected \(2,\)"),
    ]
    cases = []
    for name, change, message in buffers:
        if change is None:  # both operands change together
            call = good.replace(operand=0, buffer=Buffer(E5M2, a.shape))
            call = call.replace(operand=1, buffer=Buffer(E5M2, b.shape))
        else:
            call = good.replace(**change)
        cases.append(Case(name, call, "jbg_gemm_amax: " + message, "buffers"))
    attributes = [
        ("empty archs", dict(archs="", function_prefixes="", offsets=(0,)), "archs is empty"),
        ("unknown arch", dict(archs="sm90"), r'arch "sm90" is not of the form'),
        ("one prefix for two archs", dict(archs="sm_90a,sm_100a", offsets=(0, 10, len(obj))), "one prefix per arch"),
        ("empty function prefix", dict(function_prefixes=""), "function_prefixes has 0 entries"),
        ("empty second prefix", dict(archs="sm_90a,sm_100a", function_prefixes=prefix + ",",
                                     offsets=(0, 10, len(obj))), "function prefix for sm_100a is empty"),
        ("prefix not an identifier", dict(function_prefixes=prefix + ".x"), "is not a C identifier"),
        ("prefix with a space", dict(function_prefixes="jbg gemm"), "is not a C identifier"),
        ("arch listed twice", dict(archs="sm_90a,sm_90a", function_prefixes=f"{prefix},{prefix}",
                                   offsets=(0, 10, len(obj))), "arch sm_90a is listed twice"),
        ("offsets too short", dict(offsets=(0,)), "offsets has 1 entries; expected 2"),
        ("offsets too long", dict(offsets=(0, 5, len(obj))), "offsets has 3 entries; expected 2"),
        ("offsets end short of objects", dict(offsets=(0, len(obj) - 1)), r"end at the size of objects"),
        ("offsets end past objects", dict(offsets=(0, len(obj) + 4096)), r"end at the size of objects"),
        ("offsets start past zero", dict(offsets=(8, len(obj))), r"start at 0"),
        ("negative offset", dict(archs="sm_90a,sm_100a", function_prefixes="p,q", offsets=(0, -5, len(obj))),
         "object for sm_90a is empty"),
        ("offsets decreasing", dict(archs="sm_90a,sm_100a", function_prefixes="p,q",
                                    offsets=(0, len(obj) + 7, len(obj))), "object for sm_100a is empty"),
        ("empty objects", dict(objects=b"", offsets=(0, 0)), "object for sm_90a is empty"),
        ("unknown ab_dtype", dict(ab_dtype="float8_e4m3"), r'ab_dtype "float8_e4m3" is not supported'),
        ("ab_dtype bf16", dict(ab_dtype=BF16), r'ab_dtype "bfloat16" is not supported'),
        ("empty c_dtype", dict(c_dtype=""), r'c_dtype "" is not supported; expected float32, bfloat16, float16'),
    ]
    cases += [Case(name, good.replace(**change), "jbg_gemm_amax attributes: .*" + message, "attributes")
              for name, change, message in attributes]
    objects = [
        ("unknown function prefix", dict(function_prefixes="jbg_no_such_kernel"),
         "exports no function named jbg_no_such_kernel"),
        ("prefix of another variant", dict(function_prefixes=prefix.replace("f32", "bf16")), "exports no function"),
        ("truncated to its ELF header", dict(objects=elf_header_only, offsets=(0, 64)), "is truncated"),
        ("truncated by one byte", dict(objects=obj[:-1], offsets=(0, len(obj) - 1)), "is truncated"),
        ("truncated to half", dict(objects=obj[: len(obj) // 2], offsets=(0, len(obj) // 2)), "is truncated"),
        ("foreign bytes", dict(objects=b"\x00" * 4096, offsets=(0, 4096)), "is not an ELF object"),
        ("text instead of an object", dict(objects=b"not an object at all", offsets=(0, 20)), "is not an ELF object"),
        ("a 32-bit ELF", dict(objects=obj[:4] + b"\x01" + obj[5:]), "is not a 64-bit little-endian ELF"),
        ("a shared library, not relocatable", dict(objects=obj[:16] + b"\x03\x00" + obj[18:]),
         "is not a relocatable object"),
        ("another machine's object", dict(objects=obj[:18] + b"\xb7\x00" + obj[20:]), "is built for ELF machine"),
        ("section headers past the end", dict(objects=obj[:40] + (len(obj) - 100).to_bytes(8, "little") + obj[48:]),
         "is truncated: its section headers end past"),
    ]
    cases += [Case(name, good.replace(**change), "jbg_gemm_amax: the kernel object for .*" + message, "object")
              for name, change, message in objects]
    cases.append(Case("only an object for another GPU", good.replace(archs="sm_100a"),
                      r"no kernel object for compute capability 9\.0.*sm_100a", "object", cpu=False))
    return cases


def _address_list(call: Call) -> list:
    """(dtype, dims, address) per buffer, at distinct 16-byte aligned stand-in addresses (never dereferenced)."""
    return [(b.dtype, list(b.shape), (1 << 20) + 4096 * i) for i, b in enumerate(call.operands + call.results)]


def _object_table_problem(attrs: dict, target: str) -> str:
    """What the shared instantiate stage (ffi/kernel_objects.cc) says of a call site's object table when it runs on
    an sm_90a device: '' when the device's object may be loaded."""
    try:
        table = ext.parse_object_table(attrs["archs"], attrs["function_prefixes"], len(attrs["objects"]),
                                       list(attrs["offsets"]), target=target)
    except ValueError as e:
        return str(e)
    for target_arch, prefix, _, _, begin, end in table:
        if target_arch == DEVICE_ARCH:
            message = ext.check_kernel_object(bytes(attrs["objects"][begin:end]), prefix)
            if message:
                return f"{target}: {message}"
    return ""


def _gemm_amax_cpu_check(call: Call) -> str:
    """What the handler's C++ says about `call`, as if instantiated and executed on an sm_90a device."""
    attrs = call.attrs
    try:  # the gemm_amax instantiate stage parses its dtypes, then the shared object table
        ext.parse_kernel_dtypes(attrs["ab_dtype"], attrs["c_dtype"], attrs["sf_dtype"], attrs["sf_vec_size"],
                                attrs["a_major"], attrs["b_major"])
    except ValueError as e:
        return str(e)
    if problem := _object_table_problem(attrs, _native.GEMM_AMAX_TARGET):
        return problem
    buffers = _address_list(call)
    if len(call.operands) == 5:  # the hook takes the handler's order: a, b, sfa, sfb, c, amax, alpha
        buffers = buffers[:4] + buffers[5:] + buffers[4:5]
    try:
        return ext.check_gemm_amax_buffers(buffers, attrs["ab_dtype"], attrs["c_dtype"],
                                           attrs["sf_dtype"], attrs["sf_vec_size"], attrs["a_major"],
                                           attrs["b_major"])[0]
    except ValueError as e:  # a dtype the hook cannot describe to the C++ side
        return f"jbg_gemm_amax: {e}"


GEMM_AMAX = Target(_native.GEMM_AMAX_TARGET, _gemm_amax_object, _gemm_amax_well_formed, _gemm_amax_cases,
                   _gemm_amax_cpu_check)


# The FP4 surface of the same handler: packed E2M1 operands (K/2 bytes per row), NVFP4's E4M3 scales per 16 with
# alpha (a fifth operand), and packed FP4 C (N/2 bytes per row), each with the sm_90a object compiled for it.

def fp4_buffers(l: int, m: int, n: int, k: int, *, sf_vec_size: int, sf: str, c: str = F32,
                alpha: bool = False) -> tuple[tuple, tuple]:
    """Well-formed (operands, results) of an FP4 call: a, b packed (L, MN, K/2), scales, [alpha], c, amax."""
    kp = _cdiv(_cdiv(k, sf_vec_size), 4)
    operands = (Buffer(U8, (l, m, k // 2)), Buffer(U8, (l, n, k // 2)), Buffer(sf, (l, _cdiv(m, 128), kp, 32, 4, 4)),
                Buffer(sf, (l, _cdiv(n, 128), kp, 32, 4, 4))) + ((Buffer(F32, (l,)),) if alpha else ())
    c_shape = (l, m, n // 2) if c == U8 else (l, m, n)
    return operands, (Buffer(c, c_shape), Buffer(F32, (l,)))


def _fp4_object(c_dtype: str, sf_vec_size: int, sf_dtype: str) -> tuple[bytes, str]:
    from jax_blockgemm.kernels import catalog

    variant = catalog.select_variant(arch=DEVICE_ARCH, ab_dtype=E2M1, c_dtype=c_dtype, sf_vec_size=sf_vec_size,
                                     sf_dtype=sf_dtype, tile_mn=(128, 128), cluster_mn=(1, 1))
    return kernel_cache.get_object(variant), variant.function_prefix


def _fp4_attrs(obj: bytes, prefix: str, **dtypes: Any) -> dict:
    return dict(archs=DEVICE_ARCH, function_prefixes=prefix, objects=obj, offsets=(0, len(obj)), ab_dtype=E2M1,
                a_major="k", b_major="k", cluster_ctas=(0,), **dtypes)


def _nvfp4_well_formed(obj: bytes, prefix: str) -> Call:
    operands, results = fp4_buffers(2, 200, 136, 96, sf_vec_size=16, sf=E4M3, alpha=True)
    return Call(operands, results, _fp4_attrs(obj, prefix, c_dtype=F32, sf_dtype=E4M3, sf_vec_size=16))


def _nvfp4_cases(good: Call) -> list[Case]:
    a, b, sfa, sfb, alpha = good.operands
    c, amax = good.results
    l, m, row = a.shape
    n = b.shape[1]
    no_alpha = Call(good.operands[:4], good.results, good.attrs)
    buffers = [
        ("alpha missing", no_alpha, r"alpha is missing; the kernel objects \(NVFP4, E4M3 scales\) take alpha"),
        ("alpha bf16", good.replace(operand=4, buffer=Buffer(BF16, (l,))), r"alpha is bfloat16 \(2,\); expected "
         r"float32"),
        ("alpha one entry for L = 2", good.replace(operand=4, buffer=Buffer(F32, (1,))), r"alpha is float32 \(1,\); "
         r"expected \(2,\)"),
        ("alpha scalar", good.replace(operand=4, buffer=Buffer(F32, ())), r"alpha is float32 \(\); expected"),
        ("a as FP8 codes", good.replace(operand=0, buffer=Buffer(E4M3, a.shape)),
         r"a is float8_e4m3fn .*compiled for float4_e2m1fn operands \(uint8 pairs\)"),
        ("a and b unpacked (K codes per row)", Call((Buffer(U8, (l, m, 2 * row)), Buffer(U8, (l, n, 2 * row)),
                                                     sfa, sfb, alpha), good.results, good.attrs),
         r"sfa is float8_e4m3fn \(2, 2, 2, 32, 4, 4\); expected \(2, 2, 3, 32, 4, 4\)"),
        ("K/2 not a multiple of 16", good.replace(operand=0, buffer=Buffer(U8, (l, m, 40))),
         r"a is uint8 \(2, 200, 40\); expected \(L, M, K/2\) with K/2 a multiple of 16"),
        ("b's K/2 disagrees with a's", good.replace(operand=1, buffer=Buffer(U8, (l, n, row + 16))),
         r"b is uint8 .*expected \(L, N, K/2\) = \(2, N >= 1, 48\)"),
        ("sfa as E8M0 bytes", good.replace(operand=2, buffer=Buffer(U8, sfa.shape)),
         r"sfa is uint8 .*expected float8_e4m3fn scales \(NVFP4\)"),
        ("sfb sized for blocks of 32", good.replace(operand=3, buffer=Buffer(E4M3, (l, 2, 1, 32, 4, 4))),
         r"sfb is float8_e4m3fn \(2, 2, 1, 32, 4, 4\); expected \(2, 2, 2, 32, 4, 4\)"),
        ("c packed FP4 for an f32 kernel", good.replace(result=0, buffer=Buffer(U8, (l, m, n // 2))),
         r"c is uint8 .*compiled for a float32 C"),
    ]
    cases = [Case(name, call, "jbg_gemm_amax: " + message, "buffers") for name, call, message in buffers]
    attributes = [
        ("unknown sf_dtype", dict(sf_dtype="float8_e8m0"), r'sf_dtype "float8_e8m0" is not supported'),
        ("sf_vec_size 64", dict(sf_vec_size=64), r"sf_vec_size 64 is not supported; expected 16 or 32"),
        ("E4M3 scales per 32", dict(sf_vec_size=32), r"sf_dtype float8_e4m3fn \(NVFP4\) takes ab_dtype "
         r"float4_e2m1fn with sf_vec_size 16"),
        ("E4M3 scales with FP8 codes", dict(ab_dtype=E4M3), r"ab_dtype float8_e4m3fn takes sf_dtype float8_e8m0fnu "
         r"with sf_vec_size 32"),
        ("FP4 with an M-major A", dict(a_major="m"), r"ab_dtype float4_e2m1fn takes K-major operands"),
    ]
    cases += [Case(name, good.replace(**change), "jbg_gemm_amax attributes: .*" + message, "attributes")
              for name, change, message in attributes]
    return cases


def _fp4_c_well_formed(obj: bytes, prefix: str) -> Call:
    operands, results = fp4_buffers(2, 200, 160, 64, sf_vec_size=32, sf=U8, c=U8)
    return Call(operands, results, _fp4_attrs(obj, prefix, c_dtype=E2M1, sf_dtype=E8M0, sf_vec_size=32))


def _fp4_c_cases(good: Call) -> list[Case]:
    a, b, sfa, sfb = good.operands
    c, amax = good.results
    l, m, row = a.shape
    n = b.shape[1]
    buffers = [
        ("c unpacked (N bytes per row)", good.replace(result=0, buffer=Buffer(U8, (l, m, n))),
         r"c is uint8 \(2, 200, 160\); expected \(2, 200, 80\) \(L, M, N/2\): packed FP4 pairs"),
        ("c float32 for a packed FP4 kernel", good.replace(result=0, buffer=Buffer(F32, (l, m, n))),
         r"c is float32 .*compiled for a float4_e2m1fn C \(uint8 pairs\)"),
        ("N odd", Call((a, Buffer(U8, (l, n - 1, row)), sfa, sfb), good.results, good.attrs),
         r"b is uint8 \(2, 159, 32\); expected N even for a packed FP4 C"),
        ("an alpha for an MXFP4 kernel", Call(good.operands + (Buffer(F32, (l,)),), good.results, good.attrs),
         r"alpha is float32 \(2,\); the kernel objects take no alpha"),
        ("sfa as E4M3 for an E8M0 kernel", good.replace(operand=2, buffer=Buffer(E4M3, sfa.shape)),
         r"sfa is float8_e4m3fn .*expected uint8 E8M0 scale bytes"),
    ]
    return [Case(name, call, "jbg_gemm_amax: " + message, "buffers") for name, call, message in buffers]


# MN-major FP8 operands: a (L, K, M), b (L, K, N), M and N multiples of 16, with the sm_90a "am_bn" object.

def _mn_object() -> tuple[bytes, str]:
    from jax_blockgemm.kernels import catalog

    variant = catalog.select_variant(arch=DEVICE_ARCH, ab_dtype=E4M3, c_dtype=F32, sf_vec_size=32, tile_mn=(128, 128),
                                     cluster_mn=(1, 1), a_major="m", b_major="n")
    return kernel_cache.get_object(variant), variant.function_prefix


def _mn_well_formed(obj: bytes, prefix: str) -> Call:
    l, m, n, k = 2, 208, 144, 96
    kp = _cdiv(_cdiv(k, 32), 4)
    operands = (Buffer(E4M3, (l, k, m)), Buffer(E4M3, (l, k, n)), Buffer(U8, (l, _cdiv(m, 128), kp, 32, 4, 4)),
                Buffer(U8, (l, _cdiv(n, 128), kp, 32, 4, 4)))
    return Call(operands, (Buffer(F32, (l, m, n)), Buffer(F32, (l,))),
                dict(archs=DEVICE_ARCH, function_prefixes=prefix, objects=obj, offsets=(0, len(obj)), ab_dtype=E4M3,
                     c_dtype=F32, sf_dtype=E8M0, sf_vec_size=32, a_major="m", b_major="n", cluster_ctas=(0,)))


def _mn_cases(good: Call) -> list[Case]:
    a, b, sfa, sfb = good.operands
    l, k, m = a.shape
    n = b.shape[2]
    buffers = [
        ("a K-major for an M-major kernel (read as K = 208)", good.replace(operand=0, buffer=Buffer(E4M3, (l, m, k))),
         r"b is float8_e4m3fn \(2, 96, 144\); expected \(L, K, N\) = \(2, 208, N >= 1\)"),
        ("M not a multiple of 16", good.replace(operand=0, buffer=Buffer(E4M3, (l, k, m - 8))),
         r"a is .*\(2, 96, 200\); expected \(L, K, M\) with M a multiple of 16"),
        ("b K-major for an N-major kernel", good.replace(operand=1, buffer=Buffer(E4M3, (l, n, k))),
         r"b is float8_e4m3fn \(2, 144, 96\); expected \(L, K, N\) = \(2, 96, N >= 1\) with N a multiple of 16"),
        ("b's K disagrees with a's", good.replace(operand=1, buffer=Buffer(E4M3, (l, k + 16, n))),
         r"b is .*expected \(L, K, N\) = \(2, 96, N >= 1\)"),
        ("c transposed", good.replace(result=0, buffer=Buffer(F32, (l, n, m))),
         r"c is float32 \(2, 144, 208\); expected \(2, 208, 144\) \(L, M, N\)"),
        ("sfa sized by K instead of M", good.replace(operand=2, buffer=Buffer(U8, (l, 1, 1, 32, 4, 4))),
         r"sfa is uint8 \(2, 1, 1, 32, 4, 4\); expected \(2, 2, 1, 32, 4, 4\)"),
    ]
    cases = [Case(name, call, "jbg_gemm_amax: " + message, "buffers") for name, call, message in buffers]
    attributes = [
        ("unknown a_major", dict(a_major="n"), r'a_major "n" is not supported; expected k or m'),
        ("unknown b_major", dict(b_major="m"), r'b_major "m" is not supported; expected k or n'),
    ]
    return cases + [Case(name, good.replace(**change), "jbg_gemm_amax attributes: .*" + message, "attributes")
                    for name, change, message in attributes]


GEMM_AMAX_MN = Target(_native.GEMM_AMAX_TARGET, functools.lru_cache(maxsize=None)(_mn_object), _mn_well_formed,
                      _mn_cases, _gemm_amax_cpu_check)
GEMM_AMAX_NVFP4 = Target(_native.GEMM_AMAX_TARGET, functools.lru_cache(maxsize=None)(
    lambda: _fp4_object(F32, 16, E4M3)), _nvfp4_well_formed, _nvfp4_cases, _gemm_amax_cpu_check)
GEMM_AMAX_FP4_C = Target(_native.GEMM_AMAX_TARGET, functools.lru_cache(maxsize=None)(
    lambda: _fp4_object(E2M1, 32, E8M0)), _fp4_c_well_formed, _fp4_c_cases, _gemm_amax_cpu_check)


# --------------------------------------------------------------------------------------------------------------
# jbg_gemm_proj_rope_mxfp8


def proj_rope_buffers(t: int, k: int, h: int, w_out_in: bool = True) -> tuple[tuple, tuple]:
    """Well-formed (operands, results): x, w, cos, sin and the four outputs, with the leading group axis of 1."""
    n = h * 192
    operands = (Buffer(BF16, (1, t, k)), Buffer(BF16, (1, n, k) if w_out_in else (1, k, n)),
                Buffer(BF16, (1, t, 64)), Buffer(BF16, (1, t, 64)))
    results = (Buffer(E4M3, (1, t, h, 192)), Buffer(U8, (1, t, h, 6)), Buffer(E4M3, (1, t, h, 192)),
               Buffer(U8, (1, t // 32, h, 192)))
    return operands, results


@functools.lru_cache(maxsize=None)
def _proj_rope_object() -> tuple[bytes, str]:
    """The real sm_90a proj_rope object (w as (H*192, K)) and its function prefix."""
    from jax_blockgemm.kernels import catalog

    variant = catalog.select_variant(op="proj_rope", arch=DEVICE_ARCH, ab_dtype=BF16, c_dtype=E4M3, sf_vec_size=32,
                                     tile_mn=arch.policy(DEVICE_ARCH).proj_rope_tile, cluster_mn=(1, 1),
                                     schedule=arch.policy(DEVICE_ARCH).proj_rope_schedule)
    return kernel_cache.get_object(variant), variant.function_prefix


def _proj_rope_well_formed(obj: bytes, prefix: str) -> Call:
    operands, results = proj_rope_buffers(96, 64, 2)
    return Call(operands, results, dict(archs=DEVICE_ARCH, function_prefixes=prefix, objects=obj,
                                        offsets=(0, len(obj)), w_out_in=True))


def _proj_rope_cases(good: Call) -> list[Case]:
    x, w, cos, sin = good.operands
    row, row_s, col, col_s = good.results
    t, k = x.shape[1:]
    h = row.shape[2]
    buffers = [
        ("x float32", dict(operand=0, buffer=Buffer(F32, x.shape)), r"x has shape .*expected bfloat16 \(1, T, K\)"),
        ("x without the group axis", dict(operand=0, buffer=Buffer(BF16, (t, k))), r"x has shape \(96, 64\)"),
        ("T not a multiple of 32", dict(operand=0, buffer=Buffer(BF16, (1, 80, k))),
         r"x has shape \(1, 80, 64\).*T a positive multiple of 32"),
        ("K not a multiple of 8", dict(operand=0, buffer=Buffer(BF16, (1, t, 60))),
         r"x has shape \(1, 96, 60\).*K a positive multiple of 8"),
        ("w with another K", dict(operand=1, buffer=Buffer(BF16, (1, 384, 32))), r"w has shape .*with K = 64"),
        ("w not whole heads", dict(operand=1, buffer=Buffer(BF16, (1, 200, k))),
         r"w has shape .*H\*192 output features"),
        ("w in the other layout", dict(operand=1, buffer=Buffer(BF16, (1, k, 384))), r"w has shape \(1, 64, 384\)"),
        ("cos too short", dict(operand=2, buffer=Buffer(BF16, (1, t - 32, 64))), r"cos has shape"),
        ("sin float32", dict(operand=3, buffer=Buffer(F32, sin.shape)), r"sin has shape"),
        ("row codes uint8", dict(result=0, buffer=Buffer(U8, row.shape)), r"out_fp8_row .*float8_e4m3fn"),
        ("row scales per 16", dict(result=1, buffer=Buffer(U8, (1, t, h, 12))), r"out_scales_row"),
        ("col codes for one head", dict(result=2, buffer=Buffer(E4M3, (1, t, 1, 192))), r"out_fp8_col"),
        ("col scales per token", dict(result=3, buffer=Buffer(U8, (1, t, h, 192))), r"out_scales_col"),
    ]
    cases = [Case(name, good.replace(**change), "jbg_gemm_proj_rope_mxfp8: " + message, "buffers")
             for name, change, message in buffers]
    cases.append(Case("layout attribute that disagrees with w", good.replace(w_out_in=False),
                      r"w has shape \(1, 384, 64\).*\(1, K, H\*192\)", "buffers"))
    attributes = [
        ("no archs", dict(archs="", function_prefixes=""), r"archs is empty"),
        ("offsets past the objects", dict(offsets=(0, len(good.attrs["objects"]) + 1)), r"offsets must .*end"),
        ("two prefixes for one arch", dict(function_prefixes=good.attrs["function_prefixes"] + ",x"),
         r"function_prefixes has 2 entries"),
    ]
    cases += [Case(name, good.replace(**change), "jbg_gemm_proj_rope_mxfp8 attributes: .*" + message, "attributes")
              for name, change, message in attributes]
    cases.append(Case("truncated object", good.replace(objects=good.attrs["objects"][:64], offsets=(0, 64)),
                      r"jbg_gemm_proj_rope_mxfp8: .*", "object"))
    return cases


def _proj_rope_cpu_check(call: Call) -> str:
    """What the proj_rope handler's C++ says about `call`, as if instantiated and executed on an sm_90a device."""
    attrs = call.attrs
    if problem := _object_table_problem(attrs, _native.PROJ_ROPE_TARGET):
        return problem
    return ext.check_proj_rope_buffers(_address_list(call), attrs["w_out_in"])[0]


PROJ_ROPE = Target(_native.PROJ_ROPE_TARGET, _proj_rope_object, _proj_rope_well_formed, _proj_rope_cases,
                   _proj_rope_cpu_check)


# --------------------------------------------------------------------------------------------------------------
# jbg_dequantize_mxfp8


@functools.lru_cache(maxsize=None)
def _dequantize_object() -> tuple[bytes, str]:
    """The real sm_90a dequantize object (scales along the last axis) and its function prefix."""
    from jax_blockgemm.kernels import catalog

    variant = catalog.select_variant(op="dequantize", arch=DEVICE_ARCH, ab_dtype=E4M3, c_dtype=BF16, sf_vec_size=32,
                                     tile_mn=catalog.DEQUANTIZE_TILE, cluster_mn=(1, 1), a_major="k")
    return kernel_cache.get_object(variant), variant.function_prefix


def _dequantize_well_formed(obj: bytes, prefix: str) -> Call:
    return Call((Buffer(E4M3, (1, 96, 128)), Buffer(U8, (1, 96, 4))), (Buffer(BF16, (1, 96, 128)),),
                dict(archs=DEVICE_ARCH, function_prefixes=prefix, objects=obj, offsets=(0, len(obj)), scale_axis=-1))


def _dequantize_cases(good: Call) -> list[Case]:
    buffers = [
        ("codes bf16", dict(operand=0, buffer=Buffer(BF16, (1, 96, 128))), r"codes has shape .*float8_e4m3fn"),
        ("codes of rank 1", dict(operand=0, buffer=Buffer(E4M3, (128,))), r"codes has shape \(128,\).*rank >= 2"),
        ("columns not whole blocks", dict(operand=0, buffer=Buffer(E4M3, (1, 96, 120))),
         r"codes has shape \(1, 96, 120\).*multiple of 32"),
        ("scales for fewer rows", dict(operand=1, buffer=Buffer(U8, (1, 64, 4))),
         r"scales has shape \(1, 64, 4\).*uint8 \(1, 96, 4\)"),
        ("scales per 16", dict(operand=1, buffer=Buffer(U8, (1, 96, 8))), r"scales has shape \(1, 96, 8\)"),
        ("scales int8", dict(operand=1, buffer=Buffer("int8", (1, 96, 4))), r"scales .*expected uint8"),
        ("out float32", dict(result=0, buffer=Buffer(F32, (1, 96, 128))), r"out has shape .*bfloat16"),
        ("out too small", dict(result=0, buffer=Buffer(BF16, (1, 96, 64))), r"out has shape \(1, 96, 64\)"),
    ]
    cases = [Case(name, good.replace(**change), "jbg_dequantize_mxfp8: " + message, "buffers")
             for name, change, message in buffers]
    cases.append(Case("scale axis that disagrees with the scales", good.replace(scale_axis=-2),
                      r"jbg_dequantize_mxfp8: scales has shape \(1, 96, 4\).*expected uint8 \(1, 3, 128\)", "buffers"))
    cases.append(Case("scale axis 0", good.replace(scale_axis=0), r"jbg_dequantize_mxfp8: scale_axis must be -1 or -2",
                      "buffers"))
    codes1, scales1, out1 = Buffer(E4M3, (1, 64, 96)), Buffer(U8, (1, 64, 3)), Buffer(BF16, (1, 64, 96))
    whole = r"expected codes and scales with out, or also codes1 and scales1 with out1; "  # operands come whole
    pairs = [  # a second operand (scales along its rows) beside the first: (name, operands, results, message)
        ("second operand's scales along the columns", (codes1, Buffer(U8, (1, 2, 96))), (out1,),
         r"scales1 has shape \(1, 2, 96\).*expected uint8 \(1, 64, 3\)"),
        ("second operand's codes not whole blocks", (Buffer(E4M3, (1, 64, 80)), Buffer(U8, (1, 64, 2))),
         (Buffer(BF16, (1, 64, 80)),), r"codes1 has shape \(1, 64, 80\).*multiple of 32"),
        ("second operand's out too small", (codes1, scales1), (Buffer(BF16, (1, 32, 96)),),
         r"out1 has shape \(1, 32, 96\)"),
        ("second operand without out1", (codes1, scales1), (), whole + "got 4 inputs and 1 outputs"),
        ("out1 without a second operand", (), (out1,), whole + "got 2 inputs and 2 outputs"),
        ("codes1 without scales1", (codes1,), (out1,), whole + "got 3 inputs and 2 outputs"),
    ]
    cases += [Case(name, Call(good.operands + ops, good.results + res, good.attrs), "jbg_dequantize_mxfp8: " + message,
                   "buffers") for name, ops, res, message in pairs]
    cases.append(Case("no archs", good.replace(archs="", function_prefixes=""),
                      r"jbg_dequantize_mxfp8 attributes: .*archs is empty", "attributes"))
    cases.append(Case("truncated object", good.replace(objects=good.attrs["objects"][:64], offsets=(0, 64)),
                      r"jbg_dequantize_mxfp8: .*", "object"))
    return cases


def _dequantize_cpu_check(call: Call) -> str:
    """What the dequantize handler's C++ says about `call`, as if instantiated and executed on an sm_90a device."""
    if problem := _object_table_problem(call.attrs, _native.DEQUANTIZE_TARGET):
        return problem
    return ext.check_dequantize_buffers(_address_list(call), call.attrs["scale_axis"], inputs=len(call.operands))[0]


DEQUANTIZE = Target(_native.DEQUANTIZE_TARGET, _dequantize_object, _dequantize_well_formed, _dequantize_cases,
                    _dequantize_cpu_check)
# --------------------------------------------------------------------------------------------------------------
# jbg_weight_stream (the decode kernel): operands x, w, sw, alpha; results c, amax


@functools.lru_cache(maxsize=None)
def _weight_stream_object() -> tuple[bytes, str]:
    """The real sm_90a decode object (E4M3 weights, f32 C, up to 16 rows) and its function prefix."""
    from jax_blockgemm.kernels import catalog

    variant = catalog.select_variant(op="weight_stream", arch=DEVICE_ARCH, ab_dtype=E4M3, c_dtype=F32, sf_vec_size=32,
                                     tile_mn=(32, 16), cluster_mn=(1, 1))
    return kernel_cache.get_object(variant), variant.function_prefix


def _weight_stream_well_formed(obj: bytes, prefix: str) -> Call:
    l, m, n, k = 2, 5, 72, 96
    return Call((Buffer(BF16, (l, m, k)), Buffer(E4M3, (l, n, k)), Buffer(U8, (l, n, _cdiv(k, 32))), Buffer(F32, (l,))),
                (Buffer(F32, (l, m, n)), Buffer(F32, (l,))),
                dict(archs=DEVICE_ARCH, function_prefixes=prefix, objects=obj, offsets=(0, len(obj)), w_dtype=E4M3,
                     c_dtype=F32, sf_dtype=E8M0, sf_vec_size=32, max_m=16, amax_batches=2))


def _weight_stream_cases(good: Call) -> list[Case]:
    buffers = [
        ("x float32", dict(operand=0, buffer=Buffer(F32, (2, 5, 96))), r"x is float32 .*expected bfloat16"),
        ("x of more rows than the objects take", dict(operand=0, buffer=Buffer(BF16, (2, 17, 96))),
         r"x is bfloat16 \(2, 17, 96\); expected M <= 16"),
        ("x rows not 16 bytes of codes", dict(operand=0, buffer=Buffer(BF16, (2, 5, 88))),
         r"x is bfloat16 \(2, 5, 88\); expected K a multiple of 16"),
        ("w E5M2 for E4M3 objects", dict(operand=1, buffer=Buffer(E5M2, (2, 72, 96))),
         r"w is float8_e5m2 .*compiled for"),
        ("w of another K", dict(operand=1, buffer=Buffer(E4M3, (2, 72, 64))), r"w is float8_e4m3fn \(2, 72, 64\)"),
        ("sw per 16", dict(operand=2, buffer=Buffer(U8, (2, 72, 6))), r"sw is uint8 \(2, 72, 6\).*compact form"),
        ("sw atom of the wrong shape", dict(operand=2, buffer=Buffer(U8, (2, 2, 1, 32, 4, 4))), r"sw .*atom form"),
        ("sw int8", dict(operand=2, buffer=Buffer("int8", (2, 72, 3))), r"sw .*expected uint8 E8M0 scale bytes"),
        ("alpha of one batch", dict(operand=3, buffer=Buffer(F32, (1,))),
         r"alpha is float32 \(1,\); expected float32 \(2,\) \(L,\)"),
        ("c bfloat16 for float32 objects", dict(result=0, buffer=Buffer(BF16, (2, 5, 72))),
         r"c is bfloat16 .*float32 C"),
        ("c too small", dict(result=0, buffer=Buffer(F32, (2, 5, 64))), r"c is float32 \(2, 5, 64\); expected"),
        ("amax per row", dict(result=1, buffer=Buffer(F32, (5,))),
         r"amax is float32 \(5,\); expected float32 \(2,\) \(L,\)"),
    ]
    cases = [Case(name, good.replace(**change), "jbg_weight_stream: " + message, "buffers")
             for name, change, message in buffers]
    where = "jbg_weight_stream attributes: "
    cases += [
        Case("w_dtype bfloat16", good.replace(w_dtype=BF16), where + 'w_dtype "bfloat16" is not supported',
             "attributes"),
        Case("c_dtype E4M3", good.replace(c_dtype=E4M3), where + 'c_dtype "float8_e4m3fn" is not supported',
             "attributes"),
        Case("NVFP4 scales for FP8 weights", good.replace(sf_dtype=E4M3, sf_vec_size=16), where + "sf_dtype",
             "attributes"),
        Case("no row capacity", good.replace(max_m=0), where + "max_m 0 is not supported", "attributes"),
        Case("negative batches", good.replace(amax_batches=-1), where + "amax_batches -1 is not supported",
             "attributes"),
        Case("truncated object", good.replace(objects=good.attrs["objects"][:64], offsets=(0, 64)),
             r"jbg_weight_stream: .*", "object"),
    ]
    return cases


def _weight_stream_cpu_check(call: Call) -> str:
    """What the weight_stream handler's C++ says about `call`, as if instantiated and executed on an sm_90a device."""
    attrs = call.attrs
    dtypes = dict(w_dtype=attrs["w_dtype"], c_dtype=attrs["c_dtype"], sf_dtype=attrs["sf_dtype"],
                  sf_vec_size=attrs["sf_vec_size"], max_m=attrs["max_m"])
    try:
        ext.parse_weight_stream_attributes(**dtypes, amax_batches=attrs["amax_batches"])
    except ValueError as e:
        return str(e)
    if problem := _object_table_problem(attrs, _native.WEIGHT_STREAM_TARGET):
        return problem
    x, w, sw, alpha, c, amax = _address_list(call)  # the hook takes the handler's order: x, w, sw, c, amax, alpha
    try:
        return ext.check_weight_stream_buffers([x, w, sw, c, amax, alpha], **dtypes)[0]
    except ValueError as e:  # a dtype the hook cannot describe to the C++ side
        return f"jbg_weight_stream: {e}"


WEIGHT_STREAM = Target(_native.WEIGHT_STREAM_TARGET, _weight_stream_object, _weight_stream_well_formed,
                       _weight_stream_cases, _weight_stream_cpu_check)
TARGETS = (GEMM_AMAX, GEMM_AMAX_NVFP4, GEMM_AMAX_FP4_C, GEMM_AMAX_MN, PROJ_ROPE, DEQUANTIZE, WEIGHT_STREAM)


# --------------------------------------------------------------------------------------------------------------
# Runners


def _target_cases() -> list[tuple[str, Target, Case]]:
    out = []
    for target in TARGETS:
        obj, prefix = target.object_fn()
        out += [(f"{target.name}: {case.name}", target, case)
                for case in target.cases(target.well_formed(obj, prefix))]
    return out


ARRAY_ATTRS = ("offsets", "cluster_ctas")  # the int64-array attributes; the typed FFI refuses a tuple for either


def ffi_attrs(attrs: dict) -> dict:
    """`attrs` as jax.ffi.ffi_call takes them: the objects as a uint8 array, the ARRAY_ATTRS as int64 arrays."""
    return {k: (np.frombuffer(bytes(v), np.uint8) if k == "objects" else
                np.asarray(v, np.int64) if k in ARRAY_ATTRS else v) for k, v in attrs.items()}


def _ffi_call(target: Target, call: Call, *, device: Any) -> Any:
    """Runs `call` through raw jax.ffi.ffi_call on `device`, bypassing every Python check; returns the results."""
    attrs = ffi_attrs(call.attrs)
    operands = [jax.device_put(jnp.zeros(b.shape, b.dtype), device) for b in call.operands]
    results = [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in call.results]
    fn = jax.jit(lambda *xs: jax.ffi.ffi_call(target.name, results)(*xs, **attrs))
    return jax.block_until_ready(fn(*operands))


def _cutedsl_or_skip(test: absltest.TestCase) -> None:
    try:
        import cutlass  # noqa: F401  (only whether it imports)
    except ImportError as e:
        test.skipTest(f"CuTeDSL is not importable (the cases need a real kernel object): {e}")


class CpuHandlerChecksTest(absltest.TestCase):
    """Every case through the handler's own C++ checks, on CPU (what CI proves)."""

    def setUp(self):
        super().setUp()
        _cutedsl_or_skip(self)

    def test_well_formed_calls_pass(self):
        for target in TARGETS:
            self.assertEqual(target.cpu_check(target.well_formed(*target.object_fn())), "", target.name)

    def test_raw_call_attributes_are_types_the_typed_ffi_takes(self):
        """A tuple attribute passes the C++ hooks but XLA refuses it ('Unsupported attribute type'): after ffi_attrs
        every well-formed attribute must be a str, an int or a NumPy array, else the GPU run fails on the good call."""
        for target in TARGETS:
            attrs = ffi_attrs(target.well_formed(*target.object_fn()).attrs)
            unsupported = {k: type(v).__name__ for k, v in attrs.items() if not isinstance(v, (str, int, np.ndarray))}
            self.assertEqual(unsupported, {}, target.name)
            for key in ARRAY_ATTRS:
                if key in attrs:
                    self.assertEqual(attrs[key].dtype, np.int64, f"{target.name}: {key}")

    def test_every_case_is_refused_with_its_message(self):
        cases = [c for c in _target_cases() if c[2].cpu]
        self.assertGreater(len(cases), 50)
        for label, target, case in cases:
            with self.subTest(case=label):
                message = target.cpu_check(case.call)
                self.assertRegex(message, case.message)

    def test_attribute_cases_through_xla_cpu(self):
        """XLA:CPU runs the handler's real instantiate stage; the attribute cases fail there before any device is
        touched, with the same message, as a Python exception."""
        cpu = jax.devices("cpu")[0]
        _native.register_ffi_targets(platform="cpu")
        cases = [c for c in _target_cases() if c[2].stage == "attributes"]
        self.assertGreater(len(cases), 15)
        for label, target, case in cases:
            with self.subTest(case=label):
                with self.assertRaisesRegex(Exception, "INVALID_ARGUMENT: .*" + case.message):
                    _ffi_call(target, case.call, device=cpu)




def _consistent(buffers: list, ab: str, c: str) -> bool:
    """Independent statement of what the kernel needs (BUILD.md's table), for the hypothesis oracle."""
    (da, sa, _), (db, sb, _), (dsa, ssa, _), (dsb, ssb, _), (dc, sc, _), (dm, sm, _) = buffers
    if (da, db, dsa, dsb, dc, dm) != (ab, ab, U8, U8, c, F32) or len(sa) != 3:
        return False
    l, m, k = sa
    if min(l, m, k) < 1 or k % 16 or len(sb) != 3 or sb[0] != l or sb[2] != k or sb[1] < 1:
        return False
    n, kp = sb[1], _cdiv(_cdiv(k, 32), 4)
    want = [[l, _cdiv(m, 128), kp, 32, 4, 4], [l, _cdiv(n, 128), kp, 32, 4, 4], [l, m, n], [l]]
    if [ssa, ssb, sc, sm] != want:
        return False
    return all(int(np.prod(np.array(s, dtype=object))) < 2**31 for s in (sa, sb, ssa, ssb, sc, sm))


if st is not None:
    # Hypothesis strategies: a dim near what the buffer needs, or anything (0, negative, huge).
    _dim = st.one_of(st.integers(1, 300), st.sampled_from([0, -1, 16, 32, 128, 129, 2**31, 2**40, 2**62]))
    _dtype = st.sampled_from([E4M3, E5M2, U8, F32, BF16, "float16", "int32", "int8"])

    class CpuHypothesisTest(absltest.TestCase):
        """Generated inputs for the C++ checks: they never crash, and accept exactly what the kernel can take."""

        @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(l=_dim, m=_dim, n=_dim, k=_dim, ab=st.sampled_from([E4M3, E5M2]), c=st.sampled_from([F32, BF16]),
               which=st.integers(0, 5), dims=st.lists(_dim, max_size=7), dtype=_dtype, keep=st.booleans())
        def test_buffer_checks(self, l, m, n, k, ab, c, which, dims, dtype, keep):
            call = Call(*gemm_amax_buffers(l, m, n, k, ab=ab, c=c), {})
            buffers = _address_list(call)
            if not keep:  # perturb one buffer's dims and dtype
                buffers[which] = (dtype, dims, buffers[which][2])
            message, got = ext.check_gemm_amax_buffers(buffers, ab, c)
            if _consistent(buffers, ab, c):
                self.assertEqual(message, "")
                self.assertEqual(got, (m, n, k, l))
            else:
                self.assertRegex(message, r"^jbg_gemm_amax: (a|b|sfa|sfb|c|amax) is .*; (expected|the kernel objects)")

        @settings(max_examples=300, deadline=None)
        @given(cuts=st.lists(st.integers(-3, 2**40), min_size=1, max_size=5), size=st.integers(0, 2**20),
               archs=st.lists(st.sampled_from(["sm_90a", "sm_100a", "sm_120f", "sm_9", "x"]), max_size=4))
        def test_object_table(self, cuts, size, archs):
            offsets = [0, *cuts]
            prefixes = ",".join(f"p{i}" for i in range(len(archs)))
            try:
                table = ext.parse_object_table(",".join(archs), prefixes, size, offsets)
            except ValueError as e:
                self.assertRegex(str(e), "^jbg_gemm_amax attributes: ")
                return
            # Accepted: every entry lies inside the objects, in order, and covers them exactly.
            self.assertEqual([t[0] for t in table], archs)
            self.assertEqual([(t[4], t[5]) for t in table], list(zip(offsets[:-1], offsets[1:])))
            self.assertTrue(all(0 <= b < e <= size for *_, b, e in table))
            self.assertEqual(len(set(archs)), len(archs))

        @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(data=st.data())
        def test_object_bytes(self, data):
            """Truncations and byte flips of a real object: no crash; a truncated one is always refused."""
            _cutedsl_or_skip(self)
            obj, prefix = _gemm_amax_object()
            cut = data.draw(st.integers(0, len(obj) - 1))
            self.assertRegex(ext.check_kernel_object(obj[:cut], prefix), "is truncated|is not an ELF object")
            flips = data.draw(st.lists(st.tuples(st.integers(0, len(obj) - 1), st.integers(1, 255)), max_size=8))
            mutated = bytearray(obj)
            for i, x in flips:
                mutated[i] ^= x
            self.assertIsInstance(ext.check_kernel_object(bytes(mutated), prefix), str)


def _has_kernel_gpu() -> bool:
    caps = dispatch.local_cuda_capabilities()
    return bool(caps) and DEVICE_ARCH in {arch.target_of(cc) for cc in caps}


@absltest.skipUnless(_has_kernel_gpu(), "needs a CUDA GPU with a CuTeDSL kernel (sm_90a)")
class GpuHandlerFuzzTest(absltest.TestCase):
    """Every case through raw jax.ffi.ffi_call on the GPU: an exception naming the problem, never a crash."""

    def test_every_case_raises_then_the_well_formed_call_is_correct(self):
        gpu = jax.devices("cuda")[0]
        cases = _target_cases()
        self.assertGreater(len(cases), 50)
        for label, target, case in cases:
            with self.subTest(case=label):
                with self.assertRaisesRegex(Exception, case.message):
                    _ffi_call(target, case.call, device=gpu)
        # The handler and the device are still sound: the well-formed raw call matches the float64 oracle.
        good = _gemm_amax_well_formed(*_gemm_amax_object())
        rng = np.random.default_rng(17)
        l, m, k = good.operands[0].shape
        n = good.operands[1].shape[1]
        codes = [np.clip(rng.standard_normal((l, mn, k)) * 8, -448, 448).astype(np.float32).astype(oracle_ops.E4M3)
                 for mn in (m, n)]
        scales = [oracle.random_scale_bytes(rng, (l, mn, _cdiv(k, 32))) for mn in (m, n)]
        attrs = ffi_attrs(good.attrs)
        results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in good.results]
        fn = jax.jit(lambda *xs: jax.ffi.ffi_call(GEMM_AMAX.name, results)(*xs, **attrs))
        c, amax = fn(*codes, *(oracle.compact_to_atom_np(s) for s in scales))
        c_ref, amax_ref = oracle_ops.gemm_amax_oracle(*codes, *scales, k=k, sf_vec_size=32)
        oracle_ops.assert_gemm_close(self, np.asarray(c), c_ref, c_dtype=jnp.float32)
        oracle_ops.assert_amax_close(self, np.asarray(amax), amax_ref)

if __name__ == "__main__":
    absltest.main()
