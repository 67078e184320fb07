"""MXFP8 codes times E8M0 block scales as bfloat16, on any GPU architecture (no MMA): the input pass of the MXFP8
proj_rope path, whose kernels (sm_90a, sm_100a) multiply bf16 operands.

XLA's fusion of the same expression (reference.dequantize_bf16) moves DeepSeek-V3's w (37.7 MB of codes in, 75.5 MB
of bf16 out) in ~47 us on the H200 (~2.4 TB/s); this kernel, with 16-byte loads and stores of whole runs of codes
per thread, in ~35 us (benchmarks/RESULTS.md; the sm_100a object is compiled, never run). The values are the
reference's, bit for bit (SPEC §6): code -> float32 (exact), times the float32 scale 2^(b-127) (exact but for
results below float32's normal range, rounded the same way as the reference's multiply), rounded to bfloat16.

ABI (catalog op "dequantize"): fn(codes, scales, out, rows, cols, stream), flat buffers:
    codes (rows, cols) float8_e4m3fn, row-major; out (rows, cols) bfloat16;
    scales uint8 E8M0: (rows, cols / 32) for `scale_axis` 1 (blocks of 32 along a row), (rows / 32, cols) for 0.
cols must be a multiple of `codes_per_thread` and of 32 for scale_axis 1; rows of 32 for scale_axis 0 (the handler
checks).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from jax_blockgemm.kernels import common
from jax_blockgemm.support import MX_BLOCK

CODES_PER_THREAD = (8, 16, 32)  # an 8-, 16- or 2 x 16-byte load of codes per thread
THREADS = 256
SCALE_AXES = (0, 1)


class MxDequantize:
    """codes·2^(scale-127) as bfloat16 for MXFP8 E4M3 codes with scales per 32 along `scale_axis`."""

    def __init__(self, *, scale_axis: int = 1, codes_per_thread: int = 16):
        common.require_choice("scale_axis", scale_axis, SCALE_AXES)
        common.require_choice("codes_per_thread", codes_per_thread, CODES_PER_THREAD)
        self.scale_axis = scale_axis
        self.per_thread = codes_per_thread
        self.ab_dtype = cutlass.Float8E4M3FN

    @staticmethod
    def can_implement(rows: int, cols: int, scale_axis: int, codes_per_thread: int = 16) -> tuple[bool, str]:
        """Whether the kernel takes a (rows, cols) operand with scales along `scale_axis`, and why not."""
        if min(rows, cols) < 1:
            return False, f"rows and cols must be >= 1, got {rows} x {cols}"
        multiple = max(codes_per_thread, MX_BLOCK if scale_axis == 1 else 1)
        if cols % multiple:
            return False, f"cols must be a multiple of {multiple}, got {cols}"
        if scale_axis == 0 and rows % MX_BLOCK:
            return False, f"rows must be a multiple of {MX_BLOCK} (scales along rows), got {rows}"
        if rows * cols >= 2**31:
            return False, f"the operand must hold fewer than 2**31 elements, got {rows} x {cols}"
        return True, ""

    @cute.jit
    def __call__(self, codes: cute.Tensor, scales: cute.Tensor, out: cute.Tensor, rows: cutlass.Int32,
                 cols: cutlass.Int32, stream: cuda.CUstream):
        """Host side: one thread per `codes_per_thread` codes of a row."""
        chunks = rows * (cols // self.per_thread)
        self.kernel(codes, scales, out, rows, cols).launch(
            grid=((chunks + THREADS - 1) // THREADS, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, codes: cute.Tensor, scales: cute.Tensor, out: cute.Tensor, rows: cutlass.Int32,
               cols: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        chunk = bidx * THREADS + tidx
        n = self.per_thread
        chunks_per_row = cols // n
        if chunk < rows * chunks_per_row:
            row = chunk // chunks_per_row
            col = (chunk - row * chunks_per_row) * n
            first = cute.assume(chunk * n, divby=n)
            src = cute.make_rmem_tensor((n,), self.ab_dtype)
            cute.autovec_copy(cute.make_tensor(codes.iterator + first, src.layout), src)
            values = src.load().to(cutlass.Float32)
            dst = cute.make_rmem_tensor((n,), cutlass.BFloat16)
            if cutlass.const_expr(self.scale_axis == 1):  # n <= 32: the run is inside one block
                byte = scales[row * (cols // MX_BLOCK) + col // MX_BLOCK].to(cutlass.Int32)
                dst.store((values * common.f32_from_bits(common.e8m0_bits(byte))).to(cutlass.BFloat16))
            else:
                scale_bytes = cute.make_rmem_tensor((n,), cutlass.Uint8)  # one scale per column
                scale0 = cute.assume((row // MX_BLOCK) * cols + col, divby=n)
                cute.autovec_copy(cute.make_tensor(scales.iterator + scale0, scale_bytes.layout), scale_bytes)
                factors = cute.make_rmem_tensor((n,), cutlass.Float32)
                for i in cutlass.range_constexpr(n):
                    factors[i] = common.f32_from_bits(common.e8m0_bits(scale_bytes[i].to(cutlass.Int32)))
                dst.store((values * factors.load()).to(cutlass.BFloat16))
            cute.autovec_copy(dst, cute.make_tensor(out.iterator + first, dst.layout))
