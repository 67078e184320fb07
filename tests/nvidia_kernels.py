"""NVIDIA's own sm_100a CuTeDSL kernels (the cuDNN frontend wheel) compiled with our pinned CuTeDSL, and the PTX
reading that compares their warp roles with ours: per-role instruction sequences, mbarrier initial counts and the
operands fed to tcgen05.mma.

NVIDIA's kernel modules are loaded from their files in the installed wheel, with `cudnn` stood in by a bare package
object while they import: the real `cudnn/__init__.py` loads cuDNN's compiled module, which can need CUDA libraries
that a CPU machine lacks; the kernels only need the wheel's pure-Python CuTeDSL helpers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import pathlib
import re
import sys
import tempfile
import threading
import types
from typing import Any, Iterator, Optional, Sequence

WHEEL = "nvidia-cudnn-frontend"
GEMM_AMAX_FILE = "gemm/cutedsl/dense/amax/dense_blockscaled_gemm_persistent_amax.py"
PROJ_ROPE_FILE = "gemm/cutedsl/dense/proj_rope_mxfp8/gemm_proj_rope_mxfp8_bf16in.py"
# NVIDIA's gemm_amax takes the GPU's max active clusters as a compile-time constant (ours reads the GPU's CTA capacity
# at run time): a B200's SM count per cluster. It only sizes the grid, which no compared instruction depends on.
B200_SMS = 148
_LOCK = threading.Lock()
_PATCHED_SOURCES = tempfile.TemporaryDirectory(prefix="jbg-nvidia-src-")  # edited kernel sources, for this process


def package_root() -> Optional[pathlib.Path]:
    """The installed wheel's `cudnn` folder, or None when the wheel (or its CuTeDSL GEMM kernels) is absent."""
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return None
    root = pathlib.Path(dist.locate_file("cudnn"))
    return root if (root / GEMM_AMAX_FILE).is_file() and (root / PROJ_ROPE_FILE).is_file() else None


@contextlib.contextmanager
def _cudnn_without_init(root: pathlib.Path) -> Iterator[None]:
    """`import cudnn.x` finds the wheel's submodules without running cudnn/__init__.py; everything imported under
    the stand-in is dropped from sys.modules afterwards (the loaded kernel module keeps its own references)."""
    if "cudnn" in sys.modules:  # the real package is already loaded: nothing to stand in for
        yield
        return
    stand_in = types.ModuleType("cudnn")
    stand_in.__path__ = [str(root)]
    sys.modules["cudnn"] = stand_in
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n == "cudnn" or n.startswith("cudnn.")]:
            del sys.modules[name]


def load_module(relative_path: str, name: str, replace: Sequence[tuple[str, str]] = ()) -> types.ModuleType:
    """The wheel's module file `relative_path` executed as module `name`. `replace`: (regex, replacement) pairs
    applied to its source first (each must match exactly once), to compile it with a module constant changed."""
    root = package_root()
    if root is None:
        raise FileNotFoundError(f"{WHEEL} with CuTeDSL GEMM kernels is not installed")
    path = root / relative_path
    source = path.read_text()
    for pattern, replacement in replace:
        source, count = re.subn(pattern, replacement, source, flags=re.MULTILINE)
        if count != 1:
            raise AssertionError(f"{path}: pattern {pattern!r} matched {count} times, expected once")
    if replace:  # the DSL re-reads a kernel's source from its file to rewrite its loops: give it the edited one
        path = pathlib.Path(_PATCHED_SOURCES.name) / f"{name}.py"
        path.write_text(source)
    module = types.ModuleType(name)
    module.__file__ = str(path)
    with _cudnn_without_init(root):
        sys.modules[name] = module  # the DSL's decorators may look their module up while it executes
        try:
            exec(compile(source, str(path), "exec", dont_inherit=True), module.__dict__)
        finally:
            del sys.modules[name]
    return module


def compile_for_sm100(fn: Any, *args: Any) -> Any:
    """`cute.compile(fn, *args)` for sm_100a with the PTX kept (no GPU needed), as the catalog compiles ours."""
    import cutlass.cute as cute
    from cutlass.cutlass_dsl import CuTeDSL

    with _LOCK, tempfile.TemporaryDirectory(prefix="jbg-nvidia-") as dump_dir:
        envar = CuTeDSL._get_dsl().envar
        saved = envar._arch
        envar.arch = "sm_100a"
        try:
            return cute.compile(fn, *args, options=f"--gpu-arch sm_100a --keep-ptx --keep-cubin --dump-dir {dump_dir}")
        finally:
            envar._arch = saved


@dataclasses.dataclass(frozen=True)
class NvidiaCompiled:
    """NVIDIA's kernel as compiled here: its PTX and the stage counts it was built with, and would choose itself."""

    ptx: str
    stages: dict  # {"ab": ..., "acc": ...} compiled with
    native_stages: dict  # what NVIDIA's own heuristic picks for this configuration


def compile_nvidia_gemm_amax(ab_dtype: str, c_dtype: str, tile_mn: tuple, cluster_mn: tuple, *,
                             sf_vec_size: int = 32, sf_dtype: str = "float8_e8m0fnu", a_major: str = "k",
                             b_major: str = "k") -> NvidiaCompiled:
    """NVIDIA's `Sm100BlockScaledPersistentDenseGemmKernel` as shipped, for sm_100a with row-major C, over symbolic
    M, N, K, L as ours takes them (our catalog's dtype names)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    module = load_module(GEMM_AMAX_FILE, "nvidia_dense_blockscaled_gemm_persistent_amax")
    dtypes = {"float8_e4m3fn": cutlass.Float8E4M3FN, "float8_e5m2": cutlass.Float8E5M2,
              "float4_e2m1fn": cutlass.Float4E2M1FN, "float8_e8m0fnu": cutlass.Float8E8M0FNU,
              "float32": cutlass.Float32, "bfloat16": cutlass.BFloat16}
    kernel = module.Sm100BlockScaledPersistentDenseGemmKernel(
        sf_vec_size=sf_vec_size, mma_tiler_mn=tuple(tile_mn), cluster_shape_mn=tuple(cluster_mn))
    m, n, l = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    k = cute.sym_int32(divisibility=32 if ab_dtype == "float4_e2m1fn" else 16)

    def tensor(dtype, shape, major_first: bool = False):  # (rows, cols, L): cols contiguous, or rows when MN-major
        return make_fake_compact_tensor(dtype, shape, stride_order=(0, 1, 2) if major_first else (1, 0, 2),
                                        assumed_align=16)

    def scales():  # the kernel reads only the pointer and builds the SPEC §3 atom layout itself
        return make_fake_compact_tensor(dtypes[sf_dtype], (cute.sym_int64(),), assumed_align=16)

    amax = make_fake_compact_tensor(cutlass.Float32, (1, 1, 1), assumed_align=16)
    max_active_clusters = B200_SMS // (cluster_mn[0] * cluster_mn[1])
    fn = compile_for_sm100(kernel, tensor(dtypes[ab_dtype], (m, k, l), a_major == "m"),
                           tensor(dtypes[ab_dtype], (n, k, l), b_major == "n"), scales(), scales(),
                           tensor(dtypes[c_dtype], (m, n, l)), amax, max_active_clusters, cuda.CUstream(0))
    stages = {"ab": kernel.num_ab_stage, "acc": kernel.num_acc_stage}  # set while it was traced
    return NvidiaCompiled(ptx=fn.__ptx__, stages=stages, native_stages=stages)


def proj_rope_native_stages() -> dict:
    """The stage counts NVIDIA's bf16-input proj_rope kernel is written with (module constants)."""
    module = load_module(PROJ_ROPE_FILE, "nvidia_gemm_proj_rope_native")
    return {"ab": module.ab_stages, "acc": module.acc_stages}


def compile_nvidia_proj_rope(w_major: str, stages: Optional[dict] = None, heads: int = 2,
                             k_loops_rolled: bool = False) -> NvidiaCompiled:
    """NVIDIA's bf16-input proj_rope kernel for sm_100a: x (T, K) bf16, w (H·192, K) ("k", their `w_out_in`) or
    (K, H·192) ("n"), symbolic K (its token-tile and head counts are compile-time constants). `stages` ({"ab",
    "acc"}) replaces its module's stage constants; `k_loops_rolled` compiles its two k-tile loops with unroll=1,
    as ours are (the compiler otherwise unrolls them)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

    native = proj_rope_native_stages()
    replace = []
    if stages:
        replace = [(r"^ab_stages = \d+$", f"ab_stages = {int(stages['ab'])}"),
                   (r"^acc_stages = \d+$", f"acc_stages = {int(stages['acc'])}")]
    if k_loops_rolled:  # the producer's loop (it acquires stages) and the MMA warp's (it waits for them)
        replace += [(r"(for k_tile_idx in cutlass\.range\(num_k_tiles)\):(\s+handle = ab_" + role + ")",
                     r"\1, unroll=1):\2") for role in ("producer", "consumer")]
    module = load_module(PROJ_ROPE_FILE, "nvidia_gemm_proj_rope", replace)
    tokens, k = 128, cute.sym_int32(divisibility=8)
    proj = heads * module.HEAD_DIM
    bf16, u8, e4m3 = cutlass.BFloat16, cutlass.Uint8, cutlass.Float8E4M3FN
    x = make_fake_compact_tensor(bf16, (tokens, k), stride_order=(1, 0), assumed_align=16)
    if w_major == "k":
        w = make_fake_compact_tensor(bf16, (proj, k), stride_order=(1, 0), assumed_align=16)
    else:  # (K, H·192) storage presented as its (H·192, K) transpose, as NVIDIA's wrapper does
        w = make_fake_tensor(bf16, (proj, k), (1, proj), assumed_align=16)
    rope = [make_fake_compact_tensor(bf16, (tokens, module.QK_ROPE), stride_order=(1, 0), assumed_align=16)
            for _ in range(2)]
    outputs = [make_fake_compact_tensor(dtype, shape, stride_order=(2, 1, 0), assumed_align=16)
               for dtype, shape in ((e4m3, (tokens, heads, module.HEAD_DIM)),
                                    (u8, (tokens, heads, module.HEAD_DIM // module.BLOCK)),
                                    (e4m3, (tokens, heads, module.HEAD_DIM)),
                                    (u8, (tokens // module.BLOCK, heads, module.HEAD_DIM)))]
    fn = compile_for_sm100(module.gemm_proj_rope_mxfp8_host, x, w, *rope, *outputs, tokens // module.TILE_M, heads,
                           B200_SMS, 8, cuda.CUstream(0))
    used = {"ab": module.ab_stages, "acc": module.acc_stages}
    return NvidiaCompiled(ptx=fn.__ptx__, stages=used, native_stages=native)


# ------------------------------------------------------------------------------------------------ PTX reading
_REGISTER = re.compile(r"^%[a-z]+\d+$")
_IMMEDIATE = re.compile(r"^-?(?:0[xX][0-9a-fA-F]+|\d+)$")
# Instructions whose first operand is read, not written (stores, barriers, asynchronous copies, MMAs).
_NO_DESTINATION = ("st.", "red.", "bra", "bar.", "barrier.", "fence", "prefetch", "cp.", "tcgen05.mma",
                   "tcgen05.commit", "tcgen05.cp", "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.relinquish",
                   "tcgen05.st", "tcgen05.wait", "tcgen05.fence", "mbarrier.init", "ret", "exit", "trap")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One PTX instruction: its opcode with qualifiers, its operands as written, its guard predicate if any."""

    index: int
    opcode: str
    operands: tuple[str, ...]
    guard: str = ""

    def destinations(self) -> tuple[str, ...]:
        """The registers this instruction writes (its first operand, a `{..}` vector or `a|b` pair)."""
        if not self.operands or self.opcode.startswith(_NO_DESTINATION):
            return ()
        first = self.operands[0].strip("{}")
        return tuple(r for r in re.split(r"[,|]\s*", first) if _REGISTER.match(r.strip()))

    def sources(self) -> tuple[str, ...]:
        return self.operands if not self.destinations() else self.operands[1:]


def _split_operands(text: str) -> tuple[str, ...]:
    """Comma-separated operands, commas inside [..] and {..} kept."""
    out, depth, current = [], 0, ""
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        out.append(current.strip())
    return tuple(out)


@dataclasses.dataclass
class Ptx:
    """A single-kernel PTX listing as instructions, with the positions of its labels and its register definitions."""

    instructions: list[Instruction]
    labels: dict[str, int]  # label -> index of the next instruction
    definitions: dict[str, list[Instruction]]

    @classmethod
    def parse(cls, text: str) -> "Ptx":
        entries = text.count(".entry ")
        if entries != 1:
            raise AssertionError(f"expected one kernel entry in the PTX, found {entries}")
        body = text[text.index(".entry "):]
        instructions, labels = [], {}
        for raw in body.splitlines():
            line = raw.split("//")[0].strip()
            if not line or line in "{}" or line.startswith((".", "(", ")")):
                continue
            label = re.match(r"^([$\w]+):$", line)
            if label:
                labels[label.group(1)] = len(instructions)
                continue
            line = line.rstrip(";").strip()
            guard = ""
            if line.startswith("@"):
                guard, line = line.split(None, 1)
            opcode, _, rest = line.partition(" ")
            instructions.append(Instruction(len(instructions), opcode, _split_operands(rest.strip()), guard))
        definitions: dict[str, list[Instruction]] = {}
        for ins in instructions:
            for reg in ins.destinations():
                definitions.setdefault(reg, []).append(ins)
        return cls(instructions, labels, definitions)

    # -------------------------------------------------------------------------------------- warp roles
    def role(self, warp: int, marker: str) -> list[Instruction]:
        """The instructions of the branch taken only by warp `warp` (`setp.ne %p, %rW, warp; @%p bra L`: the code
        between the branch and L) that holds an instruction starting with `marker`: that warp role's body."""
        found = []
        for i, ins in enumerate(self.instructions[:-1]):
            if not (ins.opcode.startswith("setp.ne.") and len(ins.operands) == 3 and ins.operands[2] == str(warp)):
                continue
            nxt = next((b for b in self.instructions[i + 1:] if b.guard == "@" + ins.operands[0]), None)
            if nxt is not None and nxt.opcode.startswith("bra"):
                end = self.labels[nxt.operands[0]]
                body = self.instructions[nxt.index + 1:end]
                if any(b.opcode.startswith(marker) for b in body):
                    found.append(body)
        if len(found) != 1:
            raise AssertionError(f"expected one branch of warp {warp} holding {marker}, found {len(found)}")
        body = found[0]
        # The role's code is contiguous: every jump stays inside it (or leaves the kernel, after an if/elif chain).
        allowed = {label for label, at in self.labels.items()
                   if body[0].index <= at <= body[-1].index + 1 or self.instructions[at].opcode in ("ret", "exit")}
        for ins in body:
            if ins.opcode.startswith("bra") and ins.operands[0] not in allowed | {"DONE", "LAB_WAIT"}:
                raise AssertionError(f"warp {warp}'s code branches out of its region at {ins}")
        return body

    # -------------------------------------------------------------------------------------- values
    def expression(self, operand: str, *, descriptor: bool = False, depth: int = 24) -> str:
        """How `operand` is computed, as a register-free expression: immediates kept, registers replaced by the
        instructions defining them, recursively; a register defined more than once (a loop-carried value) is
        `phi`, one never defined (a kernel parameter) `param`, a value loaded from shared or global memory a leaf
        named by its load. `descriptor`: the operand is a shared-memory matrix descriptor, whose 14-bit start
        address field ((address >> 4) & 0x3FFF) prints as `start_address`: where each kernel places its buffers
        depends on its storage struct; the other fields (strides, swizzle, version) and their advances print."""
        operand = operand.strip()
        if _IMMEDIATE.match(operand):
            return operand
        if operand.startswith("{") and operand.endswith("}"):
            parts = [p.strip() for p in operand[1:-1].split(",")]
            return "{" + ", ".join(self.expression(p, descriptor=descriptor, depth=depth) for p in parts) + "}"
        if operand.startswith("[") and operand.endswith("]"):
            base, plus, offset = operand[1:-1].partition("+")
            return f"[{self.expression(base, descriptor=descriptor, depth=depth)}{plus}{offset}]"
        if not _REGISTER.match(operand):  # a special register (%tid.x), `_`, or a symbol: a kernel parameter's
            return re.sub(r"^\w+_(param_\d+)$", r"\1", operand)  # name holds the kernel's name; keep its position
        defs = self.definitions.get(operand, [])
        if not defs:
            return "param"
        if len(defs) > 1:
            return "phi"
        ins = defs[0]
        if depth == 0 or ins.opcode.startswith(("ld.shared", "ld.global")):
            # a loaded value is a leaf: e.g. the tensor-memory base that tcgen05.alloc wrote, kept at a place in
            # shared memory that depends on each kernel's storage struct
            return ins.opcode
        if descriptor and ins.opcode == "and.b32" and ins.operands[1] in self.definitions \
                and self.definitions[ins.operands[1]][0].opcode == "shr.u32" \
                and self.definitions[ins.operands[1]][0].operands[2] == "4":
            return "start_address"
        args = [self.expression(src, descriptor=descriptor, depth=depth - 1) for src in ins.sources()]
        which = ins.destinations().index(operand) if len(ins.destinations()) > 1 else None
        return f"{ins.opcode}{'' if which is None else f'#{which}'}({', '.join(args)})"

    def constant(self, operand: str) -> Optional[int]:
        """The integer value of `operand` when it is an immediate or a register set once from one."""
        text = self.expression(operand)
        for pattern in (r"^(-?\d+)$", r"^mov\.[bsu]\d+\((-?\d+)\)$"):
            found = re.match(pattern, text)
            if found:
                return int(found.group(1))
        return None


def opcode_sequence(body: Sequence[Instruction], prefixes: Sequence[str]) -> list[str]:
    """The opcodes (with qualifiers, without operands) of `body` that start with one of `prefixes`, in order."""
    return [ins.opcode for ins in body if ins.opcode.startswith(tuple(prefixes))]


def mbarrier_init_counts(ptx: Ptx) -> list[tuple[str, int]]:
    """(address, initial arrival count) of every mbarrier.init in the kernel, by address; a count that is not a
    constant fails."""
    out = []
    for ins in ptx.instructions:
        if ins.opcode.startswith("mbarrier.init"):
            count = ptx.constant(ins.operands[1])
            if count is None:
                raise AssertionError(f"mbarrier.init count {ins.operands[1]} is not a constant: "
                                     f"{ptx.expression(ins.operands[1])}")
            out.append((ptx.expression(ins.operands[0]), count))
    return sorted(out, key=lambda item: (re.sub(r"\+\d+\]$", "]", item[0]), _offset(item[0])))


def _offset(address: str) -> int:
    found = re.search(r"\+(\d+)\]$", address)
    return int(found.group(1)) if found else 0


def mma_operands(ptx: Ptx, body: Sequence[Instruction]) -> list[dict[str, str]]:
    """Per tcgen05.mma of `body`, in order: how each operand is computed: the accumulator's tensor-memory address
    `d`, the shared-memory descriptors of A and B (start addresses masked), the instruction descriptor `idesc`, the
    scale factors' tensor-memory addresses (block-scaled MMAs) and the accumulate predicate."""
    out = []
    for ins in body:
        if not ins.opcode.startswith("tcgen05.mma"):
            continue
        ops = ins.operands
        entry = {"d": ptx.expression(ops[0]), "a_desc": ptx.expression(ops[1], descriptor=True),
                 "b_desc": ptx.expression(ops[2], descriptor=True), "idesc": ptx.expression(ops[3]),
                 "accumulate": ptx.expression(ops[-1])}
        if ".block_scale" in ins.opcode:
            entry.update(sfa=ptx.expression(ops[4]), sfb=ptx.expression(ops[5]))
        out.append(entry)
    return out


def rebase_tensor_memory(expression: str, base_column: int) -> str:
    """`expression` with every tensor-memory address `ld.shared.b32 + X` (the allocation's base, loaded from shared
    memory, plus a constant whose low 16 bits are a column and high 16 bits a lane / sub-partition field) written
    as `tmem(column - base_column, high bits)`: scale addresses compare relative to where each kernel puts them."""
    def rebase(found: re.Match) -> str:
        value = int(found.group(1)) & 0xFFFFFFFF
        return f"tmem({(value & 0xFFFF) - base_column}, {value >> 16})"

    return re.sub(r"add\.s32\(ld\.shared\.b32, (-?\d+)\)", rebase, expression)


def tensor_memory_column(expression: str) -> int:
    """The column of a tensor-memory address `[add.s32(ld.shared.b32, X)]` (the low 16 bits of X)."""
    found = re.fullmatch(r"\[add\.s32\(ld\.shared\.b32, (-?\d+)\)\]", expression)
    if not found:
        raise AssertionError(f"not a constant tensor-memory address: {expression}")
    return int(found.group(1)) & 0xFFFF


def expect_tx_bytes(ptx: Ptx, body: Sequence[Instruction]) -> list[Optional[int]]:
    """The transaction byte counts the role arms its full barriers with (mbarrier.arrive.expect_tx)."""
    return [ptx.constant(ins.operands[2]) for ins in body if ins.opcode.startswith("mbarrier.arrive.expect_tx")]


# The opcodes that make up a warp role's part in the mainloop: TMA copies, mbarrier operations, MMAs, their commits
# (which arrive on mbarriers when the MMAs complete) and the scale copies to tensor memory.
MAINLOOP_OPCODES = ("cp.async.bulk", "mbarrier.", "tcgen05.mma", "tcgen05.commit", "tcgen05.cp")


@dataclasses.dataclass(frozen=True)
class MainloopFacts:
    """What the comparison reads from one kernel's PTX: the producer's and the MMA warp's mainloop opcodes in order,
    every mbarrier's initial count, the producer's transaction byte counts, the operands of every MMA."""

    producer: tuple[str, ...]
    mma: tuple[str, ...]
    mbarrier_init: tuple[tuple[str, int], ...]
    expect_tx: tuple[Optional[int], ...]
    mma_operands: tuple[dict, ...]


def mainloop_facts(ptx_text: str, producer_warp: int, mma_warp: int) -> MainloopFacts:
    """The facts of a warp-specialized sm_100a kernel whose TMA warp is `producer_warp` and MMA warp `mma_warp`."""
    ptx = Ptx.parse(ptx_text)
    producer = ptx.role(producer_warp, "cp.async.bulk.tensor")
    mma = ptx.role(mma_warp, "tcgen05.mma")
    return MainloopFacts(producer=tuple(opcode_sequence(producer, MAINLOOP_OPCODES)),
                         mma=tuple(opcode_sequence(mma, MAINLOOP_OPCODES)),
                         mbarrier_init=tuple(mbarrier_init_counts(ptx)),
                         expect_tx=tuple(expect_tx_bytes(ptx, producer)),
                         mma_operands=tuple(mma_operands(ptx, mma)))
