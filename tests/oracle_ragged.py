"""Float64 oracles of the ragged (mixture-of-experts) GEMM and of mx_ragged_dot's straight-through gradients.

Written from the contract, per group with plain slices: group g owns rows [sum(sizes[:g]), sum(sizes[:g+1])); rows
after the last group are zero and take no part in amax.
"""

from __future__ import annotations


import numpy as np

import oracle
import oracle_ops


def bounds(group_sizes) -> list[tuple[int, int]]:
    """[(start, end)] of each group's rows."""
    ends = np.cumsum(np.asarray(group_sizes, np.int64))
    return [(int(e - s), int(e)) for s, e in zip(np.asarray(group_sizes, np.int64), ends)]


def ragged_oracle(a, b, sfa, sfb, group_sizes, *, k: int, sf_vec_size: int, alpha=None) -> tuple[np.ndarray, float]:
    """(C (T, N) float64, amax): a (T, K) codes, b (G, N, K) codes, compact scales (T, KB) and (G, N, KB)."""
    a_hat = oracle.dequantize_f64(a, np.asarray(sfa), block=sf_vec_size)
    t = a_hat.shape[0]
    n = np.asarray(b).shape[1]
    c = np.zeros((t, n))
    touched = np.zeros(t, bool)
    with np.errstate(invalid="ignore", over="ignore"):
        for g, (s, e) in enumerate(bounds(group_sizes)):
            b_hat = oracle.dequantize_f64(np.asarray(b)[g], np.asarray(sfb)[g], block=sf_vec_size)
            c[s:e] = a_hat[s:e] @ b_hat.T
            touched[s:e] = True
        if alpha is not None:
            c = c * float(alpha)
    amax = float(np.max(np.abs(c[touched]))) if touched.any() else 0.0
    return c, amax


def grouped_dot_oracle(x, w_gkn, group_sizes) -> tuple[np.ndarray, float]:
    """(out (T, N) float64, amax) of the bf16 grouped product: x (T, K) and w (G, K, N) as the float64 values of
    their (bf16) elements, each group's rows times its weight."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w_gkn, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    touched = np.zeros(x.shape[0], bool)
    with np.errstate(invalid="ignore", over="ignore"):
        for g, (s, e) in enumerate(bounds(group_sizes)):
            out[s:e] = x[s:e] @ w[g]
            touched[s:e] = True
    return out, (float(np.max(np.abs(out[touched]))) if touched.any() else 0.0)


def random_bf16_grouped(rng: np.random.Generator, *, t: int, g: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """bf16 x (T, K) and w (G, K, N) with random per-row and per-column magnitudes (2^-4 .. 2^4)."""
    import ml_dtypes

    x = rng.standard_normal((t, k)) * np.exp2(rng.uniform(-4, 4, (t, 1)))
    w = rng.standard_normal((g, k, n)) * np.exp2(rng.uniform(-4, 4, (g, 1, n))) / np.sqrt(k)
    return x.astype(ml_dtypes.bfloat16), w.astype(ml_dtypes.bfloat16)


def ragged_oracle_of(d: dict, group_sizes) -> tuple[np.ndarray, float]:
    """`ragged_oracle` of one `random_ragged_inputs` call (with its NVFP4 alpha where the scales are E4M3)."""
    alpha = d["alpha"] if np.asarray(d["sfa"]).dtype == oracle.E4M3 else None
    return ragged_oracle(d["a"], d["b"], d["sfa"], d["sfb"], group_sizes, k=d["k"], sf_vec_size=d["sf_vec_size"],
                         alpha=alpha)


def wgrad_blocks_f64(x: np.ndarray, fmt: str, group_sizes) -> np.ndarray:
    """x (T, F) quantized along the tokens in blocks of 32 that start at each group's first row (each group zero-
    padded to a multiple of 32), NVFP4's tensor scale taken over all of x; rows of no group are zero."""
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    if fmt == "nvfp4":
        encode, alpha = oracle_ops.nvfp4_tensor_factors(x)
        for s, e in bounds(group_sizes):
            if e > s:
                codes, scales = oracle.quantize_nvfp4_f64(x[s:e].astype(np.float32) * encode, axis=0)
                out[s:e] = oracle.dequantize_f64(codes, scales, block=16, axis=0) * np.float64(alpha)
        return out
    for s, e in bounds(group_sizes):
        if e > s:
            out[s:e] = oracle_ops.fake_quant_f64(x[s:e], fmt, axis=0)
    return out


def mx_ragged_dot_oracle(x, w, group_sizes, dy, *, fwd: str, dgrad: str, wgrad: str) -> dict:
    """Straight-through rule in float64: out = Q_K(x)·Q_K(w_g), dx = Q_N(dy)·Q_N(w_g)ᵀ, dw_g = Q_T(x_g)ᵀ·Q_T(dy_g).

    x (T, K), w (G, K, N), dy (T, N). A contraction of the forward or dgrad off the multiple of 32 rounds to bf16;
    wgrad quantizes along each group's tokens (`wgrad_blocks_f64`). Returns {"out", "dx", "dw"} in float64.
    """
    x, w, dy = (np.asarray(v, np.float64) for v in (x, w, dy))
    t, k = x.shape
    g_count, _, n = w.shape
    f = lambda fmt, size: "bf16" if size % 32 else fmt
    xq = oracle_ops.fake_quant_f64(x, f(fwd, k), axis=1)
    wq = _tensor_fake_quant(w, f(fwd, k), axis=1)
    dyq = oracle_ops.fake_quant_f64(dy, f(dgrad, n), axis=1)
    wq_n = _tensor_fake_quant(w, f(dgrad, n), axis=2)
    out, dx = np.zeros((t, n)), np.zeros((t, k))
    dw = np.zeros((g_count, k, n))
    xw = wgrad_blocks_f64(x, wgrad, group_sizes) if wgrad != "bf16" else oracle_ops.fake_quant_f64(x, "bf16", 0)
    dyw = wgrad_blocks_f64(dy, wgrad, group_sizes) if wgrad != "bf16" else oracle_ops.fake_quant_f64(dy, "bf16", 0)
    for g, (s, e) in enumerate(bounds(group_sizes)):
        out[s:e] = xq[s:e] @ wq[g]
        dx[s:e] = dyq[s:e] @ wq_n[g].T
        dw[g] = xw[s:e].T @ dyw[s:e]
    return {"out": out, "dx": dx, "dw": dw}


def _tensor_fake_quant(w: np.ndarray, fmt: str, axis: int) -> np.ndarray:
    """fake_quant_f64 of the stacked weights (G, K, N) with one NVFP4 tensor scale over all groups."""
    return oracle_ops.fake_quant_f64(w, fmt, axis=axis)


def random_ragged_inputs(rng: np.random.Generator, *, t: int, g: int, n: int, k: int, fmt: str) -> dict:
    """Random codes and scales for one ragged call: a (T, K), b (G, N, K) (FP4 packed), compact scales."""
    a = oracle_ops.random_gemm_inputs(rng, l=1, m=t, n=1, k=k, fmt=fmt)
    b = oracle_ops.random_gemm_inputs(rng, l=g, m=1, n=n, k=k, fmt=fmt)
    return dict(a=a["a"][0], sfa=a["sfa"][0], b=b["b"], sfb=b["sfb"], sf_vec_size=a["sf_vec_size"],
                alpha=a["alpha"], k=k)


def random_group_sizes(rng: np.random.Generator, t: int, g: int, *, fill: bool = True) -> np.ndarray:
    """Random (G,) int32 sizes summing to T (fill) or to a random total <= T, with empty groups likely."""
    total = t if fill else int(rng.integers(0, t + 1))
    cuts = np.sort(rng.integers(0, total + 1, size=g - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)


