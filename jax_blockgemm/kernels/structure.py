"""Structural checks of a compiled kernel, without a GPU: what its PTX holds and what its cubin uses.

Used by the CI compile tests and by `python -m jax_blockgemm.precompile --report`. For a kernel that no GPU here
can run (sm_100a), these checks are what stands between the source and the hardware: the right tensor-core
instruction (kind and scale-vector size), tensor memory allocated and freed, no local memory, and shared memory,
registers and tensor-memory columns within the target's limits. The decode kernel (weight_stream) is the exception
by design: on every architecture it multiplies with warp-level `mma.sync` (bf16 m16n8k16, fp32 accumulation) and
holds its accumulators in registers, so its check is that instruction and no tcgen05 MMA or tensor memory at all.
"""

from __future__ import annotations

import dataclasses
import re
import struct
from typing import Any

# Limits of one sm_100 SM (CUDA C Programming Guide, compute capability 10.0).
SM100_SMEM_PER_CTA = 232448  # bytes of dynamic + static shared memory one CTA may use
SM100_REGS_PER_THREAD = 255
SM100_REGS_PER_SM = 65536
SM100_TMEM_COLUMNS = 512

# PTX spelling of the MMA's kind for each operand dtype (block-scaled for the FP8/FP4 gemm_amax kernels; plain
# kind::f16 for proj_rope's bf16 operands), and of the scale-vector size for each sf_vec_size.
SM100_MMA_KIND = {"float8_e4m3fn": "mxf8f6f4", "float8_e5m2": "mxf8f6f4", "float4_e2m1fn": "mxf4nvf4",
                  "bfloat16": "f16"}
SCALE_VEC = {32: "block32", 16: "block16"}
# The one warp-level MMA of the weight_stream kernel (bf16 x bf16 -> fp32), the same opcode on sm_90a and sm_100a.
WARP_MMA_BF16 = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
WARP_MMA_OPS = {"weight_stream": WARP_MMA_BF16}  # op -> its expected mma.sync opcode (instead of tcgen05)
# The decode kernel holds its operands in registers: objects of at most this many tokens (two CTAs per SM, at most 128
# registers) must not spill; the 64-token FP4 objects keep 80-112 stack bytes (docs/design/decode.md), reported only.
DECODE_SPILL_FREE_TOKENS = 16

_EIATTR_FRAME_SIZE = 0x11
_EIATTR_MIN_STACK_SIZE = 0x12
_EIATTR_MAX_STACK_SIZE = 0x23
_EIATTR_REGCOUNT = 0x2F
_EIFMT_SVAL = 4


@dataclasses.dataclass(frozen=True)
class CubinResources:
    """Per-kernel resources read from a cubin's ELF sections: registers, local-memory frame, static shared memory."""

    registers: int
    frame_bytes: int
    stack_bytes: int
    static_smem_bytes: int


def _sections(cubin: bytes) -> list[tuple[str, int, int, int]]:
    """(name, offset, size, info) of every section of a little-endian ELF64 file."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = raw[shstrndx][4]

    def name(offset: int) -> str:
        end = cubin.index(b"\0", names_at + offset)
        return cubin[names_at + offset:end].decode()

    return [(name(h[0]), h[4], h[5], h[7]) for h in raw]


def _eiattr_values(data: bytes) -> list[tuple[int, bytes]]:
    """(attribute, payload) records of an `.nv.info*` section (4-byte headers; SVAL records carry a payload)."""
    out, p = [], 0
    while p + 4 <= len(data):
        fmt, attr = data[p], data[p + 1]
        if fmt == _EIFMT_SVAL:
            size, = struct.unpack_from("<H", data, p + 2)
            out.append((attr, data[p + 4:p + 4 + size]))
            p += 4 + size
        else:
            out.append((attr, data[p + 2:p + 4]))
            p += 4
    return out


def cubin_resources(cubin: bytes) -> CubinResources:
    """Registers (max over kernels), local frame and stack bytes, static shared memory of a cubin's kernels."""
    regs = frame = stack = smem = 0
    for name, offset, size, info in _sections(cubin):
        data = cubin[offset:offset + size]
        if name.startswith(".nv.info"):
            for attr, payload in _eiattr_values(data):
                if len(payload) != 8:
                    continue
                _, value = struct.unpack("<II", payload)  # (function symbol, value)
                if attr == _EIATTR_REGCOUNT:
                    regs = max(regs, value)
                elif attr == _EIATTR_FRAME_SIZE:
                    frame = max(frame, value)
                elif attr in (_EIATTR_MIN_STACK_SIZE, _EIATTR_MAX_STACK_SIZE):
                    stack = max(stack, value)
        elif name.startswith(".text."):
            regs = max(regs, info >> 24)  # the register count also sits in the top byte of sh_info
        elif name.startswith(".nv.shared.") and not name.startswith(".nv.shared.reserved"):
            smem = max(smem, size)
    return CubinResources(registers=regs, frame_bytes=frame, stack_bytes=stack, static_smem_bytes=smem)


@dataclasses.dataclass(frozen=True)
class Sm100Report:
    """The structural facts of one compiled sm_100a variant, and the limits they are held to."""

    key: str
    mma: tuple[str, ...]  # distinct `tcgen05.mma...` opcodes in the PTX
    has_alloc: bool
    has_dealloc: bool
    tmem_loads: int  # `tcgen05.ld` instructions in the PTX (asynchronous: each needs a later tcgen05.wait::ld)
    tmem_load_waits: int  # `tcgen05.wait::ld` instructions
    ptx_local: int  # `.local` mentions in the PTX
    resources: CubinResources
    dynamic_smem_bytes: int
    tmem_columns_used: int
    tmem_columns_allocated: int
    threads_per_cta: int
    expect_kind: str  # "" for a kernel without tcgen05 MMA (dequantize, weight_stream)
    expect_scale_vec: str  # "" for an MMA without block scales (kind::f16)
    warp_mma: tuple[str, ...] = ()  # distinct `mma.sync...` opcodes in the PTX
    expect_warp_mma: str = ""  # the only mma.sync opcode a warp-level-MMA kernel (weight_stream) may hold; "" none
    spills_allowed: bool = False  # local memory reported, not a defect (the wide decode objects)

    @property
    def mma_label(self) -> str:
        """The MMA as the report's table shows it: the tcgen05 kinds, else the mma.sync shape, else "-"."""
        kinds = sorted({k for op in self.mma for k in op.split(".") if k.startswith("kind::")})
        shapes = sorted({k for op in self.warp_mma for k in op.split(".") if re.fullmatch(r"m\d+n\d+k\d+", k)})
        return ",".join(kinds) or ("mma.sync " + ",".join(shapes) if shapes else "-")

    @property
    def smem_bytes(self) -> int:
        return self.dynamic_smem_bytes + self.resources.static_smem_bytes

    def problems(self) -> list[str]:
        """Every violated expectation, in words (empty when the variant passes)."""
        out = []
        if not self.expect_kind:  # no tcgen05 at all: dequantize (no MMA), weight_stream (mma.sync, registers)
            if self.mma or self.has_alloc or self.tmem_loads:
                out.append(f"expected no tcgen05 MMA or tensor memory; found MMA {list(self.mma)}, "
                           f"alloc={self.has_alloc}, {self.tmem_loads} tcgen05.ld")
            if self.expect_warp_mma and self.warp_mma != (self.expect_warp_mma,):
                out.append(f"warp MMA opcodes {list(self.warp_mma)}: expected only {self.expect_warp_mma}")
        else:
            scaled = f".block_scale.{self.expect_scale_vec}" if self.expect_scale_vec else ""
            want = re.compile(r"^tcgen05\.mma\.cta_group::[12]\.kind::" + re.escape(self.expect_kind + scaled)
                              + r"(?:\.collector\S*)?$")
            if not self.mma or not all(want.match(op) for op in self.mma):
                out.append(f"MMA opcodes {list(self.mma)}: expected only tcgen05.mma...kind::{self.expect_kind}"
                           f"{scaled}")
            if not (self.has_alloc and self.has_dealloc):
                out.append(f"tcgen05.alloc present={self.has_alloc}, tcgen05.dealloc present={self.has_dealloc}")
            if self.tmem_loads and not self.tmem_load_waits:
                out.append(f"{self.tmem_loads} tcgen05.ld but no tcgen05.wait::ld: registers read before the load "
                           "lands")
            if not 0 < self.tmem_columns_used <= self.tmem_columns_allocated <= SM100_TMEM_COLUMNS:
                out.append(f"tensor memory: {self.tmem_columns_used} columns used of {self.tmem_columns_allocated} "
                           f"allocated (at most {SM100_TMEM_COLUMNS})")
        if (self.ptx_local or self.resources.frame_bytes or self.resources.stack_bytes) and not self.spills_allowed:
            out.append(f"local memory: {self.ptx_local} .local in PTX, frame {self.resources.frame_bytes} B, "
                       f"stack {self.resources.stack_bytes} B")
        if self.smem_bytes > SM100_SMEM_PER_CTA:
            out.append(f"shared memory {self.smem_bytes} B > {SM100_SMEM_PER_CTA}")
        regs = self.resources.registers
        if not 0 < regs <= SM100_REGS_PER_THREAD or regs * self.threads_per_cta > SM100_REGS_PER_SM:
            out.append(f"{regs} registers x {self.threads_per_cta} threads: outside the sm_100 limits")
        return out


def mma_opcodes(ptx: str) -> tuple[str, ...]:
    """The distinct tcgen05.mma opcodes (instruction names with their qualifiers) in `ptx`."""
    return tuple(sorted(set(re.findall(r"\btcgen05\.mma[.\w:]*", ptx))))


def warp_mma_opcodes(ptx: str) -> tuple[str, ...]:
    """The distinct warp-level mma.sync opcodes in `ptx`."""
    return tuple(sorted(set(re.findall(r"\bmma\.sync[.\w]*", ptx))))


def _launch_facts(variant: Any, kernel: Any) -> tuple[int, int, int, int]:
    """(dynamic shared memory bytes, TMEM columns used, TMEM columns allocated, threads per CTA) of a traced kernel.
    The weight_stream kernel records none of them itself: its shared storage (its copy ring and the warps' partial C
    tiles) is sized while traced, its CTA is weight_stream.THREADS threads, and it has no tensor memory."""
    if variant.op == "weight_stream":
        from jax_blockgemm.kernels import weight_stream

        return int(kernel.shared_storage.size_in_bytes()), 0, 0, weight_stream.THREADS
    return (int(kernel.smem_bytes), int(kernel.tmem_columns_used), int(kernel.tmem_columns_allocated),
            int(kernel.threads_per_cta))


def sm100_report(variant: Any, compiled: Any, kernel: Any) -> Sm100Report:
    """The report of `variant`, from its compiled function (`keep_ptx`) and the kernel object it was traced from."""
    ptx = compiled.__ptx__
    smem, tmem_used, tmem_allocated, threads = _launch_facts(variant, kernel)
    tcgen05 = variant.op not in ("dequantize", *WARP_MMA_OPS)
    return Sm100Report(
        key=variant.key, mma=mma_opcodes(ptx), has_alloc="tcgen05.alloc" in ptx,
        has_dealloc="tcgen05.dealloc" in ptx, tmem_loads=len(re.findall(r"\btcgen05\.ld\.", ptx)),
        tmem_load_waits=len(re.findall(r"\btcgen05\.wait::ld\b", ptx)), ptx_local=len(re.findall(r"\.local\b", ptx)),
        resources=cubin_resources(compiled.__cubin__), dynamic_smem_bytes=smem, tmem_columns_used=tmem_used,
        tmem_columns_allocated=tmem_allocated, threads_per_cta=threads,
        expect_kind=SM100_MMA_KIND[variant.ab_dtype] if tcgen05 else "",
        expect_scale_vec=SCALE_VEC[variant.sf_vec_size] if variant.op in ("gemm_amax", "ragged") else "",
        warp_mma=warp_mma_opcodes(ptx), expect_warp_mma=WARP_MMA_OPS.get(variant.op, ""),
        spills_allowed=variant.op in WARP_MMA_OPS and variant.tile_mn[1] > DECODE_SPILL_FREE_TOKENS)

