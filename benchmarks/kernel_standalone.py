"""Device script: check the Hopper MXFP8 gemm_amax kernel against a float64 oracle, then time it at 8192^3.

Runs the kernel straight through CuTeDSL's JIT launch (no FFI): compiled for the local GPU, fed torch tensors
through DLPack. Beside it, in the same run, times XLA's plain fp8 dot and `jax.nn.scaled_matmul` (MXFP8).

    python3 benchmarks/kernel_standalone.py [--quick] [--no-bench] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
try:  # the kernels need only jax_blockgemm.kernels: don't let the rest of the package block this script
    import jax_blockgemm  # noqa: F401
except Exception:  # pragma: no cover - device-only fallback
    import types

    _pkg = types.ModuleType("jax_blockgemm")
    _pkg.__path__ = [os.path.join(ROOT, "jax_blockgemm")]
    sys.modules["jax_blockgemm"] = _pkg

from jax_blockgemm.kernels.sm90.gemm_amax import DEQUANT_MODES  # noqa: E402

DEFAULT_DEQUANT = DEQUANT_MODES[0]
NP_AB = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
SHAPES = [(1, 128, 128, 128), (2, 200, 136, 96), (1, 1000, 776, 512), (3, 257, 129, 1040), (1, 8192, 8192, 8192),
          (1, 4096, 7168, 16384)]
BIG = (1, 8192, 8192, 8192)
LONG_K = (1, 4096, 7168, 16384)  # SPEC §8's longest K: the accumulation-precision stress


# ------------------------------------------------------------------------------------- inputs and the oracle
def random_codes(rng: np.random.Generator, shape: tuple, ab_dtype: str) -> np.ndarray:
    """FP8 codes of normal random values with a random per-row spread (not all equal, no all-zero rows)."""
    spread = np.exp2(rng.integers(-3, 4, size=shape[:-1] + (1,)))
    return (rng.standard_normal(shape, dtype=np.float32) * spread).astype(NP_AB[ab_dtype])


def to_atom(scales: np.ndarray) -> np.ndarray:
    """Compact (L, MN, KB) E8M0 bytes -> the flat physical 128x4 atom buffer of SPEC §3 (padding = 0)."""
    l, mn, kb = scales.shape
    mnt, kt = -(-mn // 128), -(-kb // 4)
    padded = np.zeros((l, mnt * 128, kt * 4), np.uint8)
    padded[:, :mn, :kb] = scales
    # mn = 128·rm + 32·a1 + a0, kb = 4·rk + ak  ->  physical (l, rm, rk, a0, a1, ak)
    return padded.reshape(l, mnt, 4, 32, kt, 4).transpose(0, 1, 4, 3, 2, 5).reshape(-1)


def dequant64(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 code · 2^(byte − 127), blocks of 32 along the last axis (SPEC §1)."""
    k = codes.shape[-1]
    s = np.exp2(scales.astype(np.float64) - 127.0)
    return codes.astype(np.float64) * np.repeat(s, 32, axis=-1)[..., :k]


def bf16_ulp(x: np.ndarray) -> np.ndarray:
    """One bfloat16 ulp at |x| (x already bf16-representable), floored at the smallest normal's ulp."""
    ax = np.maximum(np.abs(x.astype(np.float64)), 2.0 ** -126)
    return np.exp2(np.floor(np.log2(ax)) - 7)


# ------------------------------------------------------------------------------------------------ the kernel
class KernelRunner:
    """Compiles one catalog variant for the local GPU and launches it on torch tensors."""

    def __init__(self, ab_dtype: str, c_dtype: str, skip: frozenset = frozenset(), dequant: str = "bf16x2"):
        import cuda.bindings.driver as cuda
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_compact_tensor

        from jax_blockgemm.kernels.sm90.gemm_amax import HopperMxf8GemmAmax

        self.cute, self.cutlass, self.cuda = cute, cutlass, cuda
        self.kernel = HopperMxf8GemmAmax(ab_dtype=ab_dtype, c_dtype=c_dtype, dequant=dequant)
        self.kernel._skip = frozenset(skip)  # profiling only: wrong results

        def fake(dt):
            return make_fake_compact_tensor(dt, (cute.sym_int64(),), assumed_align=16)

        t0 = time.perf_counter()
        self.compiled = cute.compile(
            self.kernel, fake(self.kernel.ab_dtype), fake(self.kernel.ab_dtype), fake(cutlass.Uint8),
            fake(cutlass.Uint8), fake(self.kernel.c_dtype), fake(cutlass.Float32), cutlass.Int32(1),
            cutlass.Int32(1), cutlass.Int32(16), cutlass.Int32(1), cuda.CUstream(0))
        self.compile_s = time.perf_counter() - t0

    def wrap(self, t, dtype):
        from cutlass.cute.runtime import from_dlpack

        x = from_dlpack(t, assumed_align=16)
        x.element_type = dtype
        return x

    def __call__(self, a, b, sfa, sfb, c, amax, m, n, k, l):
        import torch

        cutlass = self.cutlass
        ok, why = self.kernel.can_implement(m, n, k, l)
        assert ok, why
        stream = self.cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        self.compiled(self.wrap(a, self.kernel.ab_dtype), self.wrap(b, self.kernel.ab_dtype),
                      self.wrap(sfa, cutlass.Uint8), self.wrap(sfb, cutlass.Uint8),
                      self.wrap(c, self.kernel.c_dtype), self.wrap(amax, cutlass.Float32),
                      cutlass.Int32(m), cutlass.Int32(n), cutlass.Int32(k), cutlass.Int32(l), stream)


def check_one(runner: KernelRunner, ab_dtype: str, c_dtype: str, shape: tuple, rng: np.random.Generator,
              special: bool = False) -> dict:
    """Run once on fresh random inputs (C poisoned with NaN) and compare with the float64 oracle.

    `special` plants scale byte 0xFF (NaN: row 5 of batch 0 must be NaN, and amax[0]), byte 0 (2^-127), and
    non-finite codes (e4m3 NaN / e5m2 inf) in row 11 of the last batch.
    """
    import torch

    l, m, n, k = shape
    kb = -(-k // 32)
    a = random_codes(rng, (l, m, k), ab_dtype)
    b = random_codes(rng, (l, n, k), ab_dtype)
    sa = rng.integers(118, 137, size=(l, m, kb), dtype=np.uint8)
    sb = rng.integers(118, 137, size=(l, n, kb), dtype=np.uint8)
    if special:
        a.view(np.uint8)[-1, 11, 3] = 0x7F if ab_dtype == "float8_e4m3fn" else 0x7C  # NaN / +inf code
        sa[0, 5, kb - 1] = 0xFF
        sb[0, 7, 0] = 0
        sa[-1, 9, :] = 0
    dev = lambda x: torch.from_numpy(np.ascontiguousarray(x).view(np.uint8).reshape(-1)).cuda()
    ta, tb, tsa, tsb = dev(a), dev(b), dev(to_atom(sa)), dev(to_atom(sb))
    tdt = torch.float32 if c_dtype == "float32" else torch.bfloat16
    tc = torch.full((l * m * n,), float("nan"), dtype=tdt, device="cuda")
    tamax = torch.zeros((l,), dtype=torch.float32, device="cuda")
    runner(ta, tb, tsa, tsb, tc, tamax, m, n, k, l)
    torch.cuda.synchronize()
    c = tc.float().cpu().numpy().reshape(l, m, n)
    amax = tamax.cpu().numpy()

    big = m * n * k * l > 2**34
    a64 = dequant64(a, sa)
    b64 = dequant64(b, sb)
    if special:
        a64[0, 5, 32 * (kb - 1):] = np.nan
    if big:  # a random subset of rows for C; the full product (float64, on the GPU) for amax
        rows = np.sort(rng.choice(m, size=256, replace=False))
        ref = np.matmul(a64[:, rows], b64.transpose(0, 2, 1))
        c = c[:, rows]
        full = torch.einsum("lmk,lnk->lmn", torch.from_numpy(a64).cuda(), torch.from_numpy(b64).cuda())
        amax_ref = full.abs().amax(dim=(1, 2)).cpu().numpy()
        del full
    else:
        ref = np.matmul(a64, b64.transpose(0, 2, 1))
        amax_ref = np.abs(ref).max(axis=(1, 2))
    res = {"ab": ab_dtype, "c": c_dtype, "shape": shape, "nan": int(np.isnan(c).sum())}
    if special:  # NaN exactly where the oracle has it; then compare the rest
        res["special"] = True
        inf = np.isinf(ref)
        nan_ok = (bool(np.array_equal(np.isnan(c), np.isnan(ref))) and bool(np.array_equal(c[inf], ref[inf]))
                  and bool(np.isnan(amax[0])) and bool(np.array_equal(amax[-1], amax_ref[-1], equal_nan=True)))
        keep = np.isfinite(ref).all(axis=-1, keepdims=True)
        c, ref = np.where(keep, c, 0.0), np.where(keep, ref, 0.0)
        amax, amax_ref = amax[1:-1], amax_ref[1:-1]
        res["nan"] = 0 if nan_ok else -1
    res["amax_rel"] = (float(np.max(np.abs(amax - amax_ref) / amax_ref, initial=0.0))
                       if np.all(np.isfinite(amax)) else float("nan"))
    if c_dtype == "float32":
        res["c_rel"] = float(np.linalg.norm(c - ref) / np.linalg.norm(ref))
        res["ok"] = res["nan"] == 0 and res["c_rel"] <= 1e-5 and res["amax_rel"] <= 1e-5
    else:
        ref_bf = ref.astype(ml_dtypes.bfloat16).astype(np.float64)
        ulps = np.abs(c - ref_bf) / bf16_ulp(ref_bf)
        # SPEC §7 (as tests/oracle_ops.py reads it): within one ulp, or, for an element that cancels far below
        # its summands, within one ulp plus the fp32 accumulation error the float32 criterion allows.
        accumulation_tol = 1e-5 * np.sqrt(np.mean(np.square(ref)))
        bad = (ulps > 1.0) & ~(np.abs(c - ref) <= bf16_ulp(c) + accumulation_tol)
        res["c_max_ulp"] = float(np.max(ulps))
        res["c_bad"] = int(bad.sum())
        res["c_rel"] = float(np.linalg.norm(c - ref) / np.linalg.norm(ref))
        res["ok"] = res["nan"] == 0 and res["c_bad"] == 0 and res["amax_rel"] <= 1e-5
    return res


# ---------------------------------------------------------------------------------------------------- timing
def time_kernel(runner: KernelRunner, reps: int = 25) -> float:
    """Median milliseconds of the kernel at 8192^3 (CUDA events around each launch, after warm-up)."""
    import torch

    l, m, n, k = BIG
    rng = np.random.default_rng(7)
    dev = lambda x: torch.from_numpy(np.ascontiguousarray(x).view(np.uint8).reshape(-1)).cuda()
    ta = dev(random_codes(rng, (l, m, k), "float8_e4m3fn"))
    tb = dev(random_codes(rng, (l, n, k), "float8_e4m3fn"))
    tsa = dev(to_atom(rng.integers(118, 137, size=(l, m, k // 32), dtype=np.uint8)))
    tsb = dev(to_atom(rng.integers(118, 137, size=(l, n, k // 32), dtype=np.uint8)))
    tc = torch.empty((l * m * n,), dtype=torch.float32, device="cuda")
    tamax = torch.zeros((l,), dtype=torch.float32, device="cuda")
    for _ in range(3):
        runner(ta, tb, tsa, tsb, tc, tamax, m, n, k, l)
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        tamax.zero_()
        e0.record()
        runner(ta, tb, tsa, tsb, tc, tamax, m, n, k, l)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


def time_xla(reps: int = 25) -> dict:
    """Median milliseconds of XLA's fp8 dot (f32 out) and jax.nn.scaled_matmul MXFP8 at 8192^3."""
    import jax
    import jax.numpy as jnp

    _, m, n, k = BIG
    key = jax.random.PRNGKey(0)
    a = jax.random.normal(key, (1, m, k), jnp.float32).astype(jnp.float8_e4m3fn)
    b = jax.random.normal(jax.random.fold_in(key, 1), (1, n, k), jnp.float32).astype(jnp.float8_e4m3fn)
    sa = jnp.full((1, m, k // 32), 1.0, jnp.float32).astype(jnp.float8_e8m0fnu)
    sb = jnp.full((1, n, k // 32), 0.5, jnp.float32).astype(jnp.float8_e8m0fnu)
    fns = {
        "xla_fp8_dot": (jax.jit(lambda x, y: jnp.einsum("lmk,lnk->lmn", x, y, preferred_element_type=jnp.float32)),
                        (a, b)),
        "jax_scaled_matmul": (jax.jit(lambda x, y, s, t: jax.nn.scaled_matmul(x, y, s, t)), (a, b, sa, sb)),
    }
    out = {}
    for name, (fn, args) in fns.items():
        for _ in range(3):
            fn(*args).block_until_ready()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(*args).block_until_ready()
            times.append((time.perf_counter() - t0) * 1e3)
        out[name] = statistics.median(times)
    # Hopper's FP8 tensor-core accumulation, for the notes: XLA's fp8 dot against float64 on 256 rows.
    c = np.asarray(fns["xla_fp8_dot"][0](a[:, :256], b))[0].astype(np.float64)
    ref = np.asarray(a[0, :256]).astype(np.float64) @ np.asarray(b[0]).astype(np.float64).T
    print("xla fp8 dot rel err vs float64:", float(np.linalg.norm(c - ref) / np.linalg.norm(ref)), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="skip the 8192^3 correctness check")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--no-xla", action="store_true", help="time the kernel only")
    p.add_argument("--modes", default=",".join(DEQUANT_MODES), help="dequant modes to check (comma-separated)")
    p.add_argument("--profile", action="store_true", help="also time every dequant mode (8192^3)")
    p.add_argument("--profile-phases", action="store_true", help="with --profile: also leave phases out")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    import torch

    print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__, flush=True)
    profile = []
    if args.profile:
        for dq in DEQUANT_MODES:
            for skip in ((), ("dequant",)) if args.profile_phases else ((),):
                ms = time_kernel(KernelRunner("float8_e4m3fn", "float32", frozenset(skip), dq))
                profile.append(f"| {dq} | {','.join(skip) or 'none'} | {ms:.3f} | {2 * np.prod(BIG) / ms / 1e9:.0f} |")
                print(profile[-1], flush=True)
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    results, runners = [], {}
    for dq in args.modes.split(","):
        for ab in ("float8_e4m3fn", "float8_e5m2"):
            for cd in ("float32", "bfloat16"):
                runner = KernelRunner(ab, cd, dequant=dq)
                if dq == DEFAULT_DEQUANT:
                    runners[(ab, cd)] = runner
                print(f"compiled {ab} -> {cd} ({dq}) in {runner.compile_s:.2f} s", flush=True)
                for shape in ["special"] + SHAPES:
                    big_ok = dq == DEFAULT_DEQUANT and not args.quick
                    if shape == BIG and not (big_ok and (ab, cd) in {("float8_e4m3fn", "float32"),
                                                                     ("float8_e5m2", "bfloat16")}):
                        continue
                    if shape == LONG_K and not (big_ok and (ab, cd) == ("float8_e4m3fn", "float32")):
                        continue
                    try:
                        if shape == "special":
                            r = check_one(runner, ab, cd, (2, 200, 136, 96), rng, special=True)
                        else:
                            r = check_one(runner, ab, cd, shape, rng)
                    except Exception as e:  # keep going: report every case
                        r = {"ab": ab, "c": cd, "shape": shape, "ok": False, "error": repr(e)[:300]}
                    r["dequant"] = dq
                    results.append(r)
                    print(json.dumps(r), flush=True)
    timing = {}
    if not args.no_bench:
        flops = 2.0 * np.prod(BIG)
        timing["kernel"] = time_kernel(runners[("float8_e4m3fn", "float32")])
        if not args.no_xla:
            timing.update(time_xla())
        timing = {name: (ms, flops / ms / 1e9) for name, ms in timing.items()}
    with open(os.path.join(args.out, "kernel_standalone.json"), "w") as f:
        json.dump({"results": results, "timing": timing}, f, indent=1, default=str)
    print("\n| ab | c | dequant | L,M,N,K | ok | C err | amax rel |")
    for r in results:
        err = r.get("c_max_ulp", r.get("c_rel", "-"))
        err = f"{err:.2e}" if isinstance(err, float) else err
        unit = " ulp" if "c_max_ulp" in r else ""
        if "c_bad" in r:
            unit += f" ({r['c_bad']} bad)"
        if r.get("special"):
            unit += " [NaN/0 scales]"
        shape = ",".join(map(str, r["shape"]))
        print(f"| {r['ab'][7:]} | {r['c']} | {r['dequant']} | {shape} | {r['ok']} | {err}{unit} | "
              f"{r.get('amax_rel', r.get('error'))} |")
    if profile:
        print("\n| dequant | 8192^3 e4m3 -> f32, phases left out | ms | TFLOP/s |")
        print("\n".join(profile))
    if timing:
        print("\n| 8192^3 e4m3 -> f32 | ms (median of 25) | TFLOP/s |")
        for name, (ms, tf) in timing.items():
            print(f"| {name} | {ms:.3f} | {tf:.0f} |")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
