"""Benchmark: `python -m jax_blockgemm.bench` times both operations beside the baselines a JAX user has, in one run.

gemm_amax, MXFP8 E4M3 -> f32 C, at the SPEC §8 shapes (or `--shape M,N,K`, repeatable): ours with
implementation=None and "cutedsl", the pure-JAX reference ("xla"), `jax.nn.scaled_matmul`, `jax.lax.scaled_dot`
(where the installed jax has it), and two anchors without block scales: an FP8 dot and a bf16 dot, both -> f32.
`--format mxfp4,nvfp4` (or repeated; default mxfp8) times the same columns with FP4 operands instead, one table per
format: MXFP4 (E2M1 codes packed two per byte, E8M0 scales, block 32) and NVFP4 (E2M1 packed, E4M3 scales, block
16, the fp32 per-tensor alpha); the anchors stay an E4M3 dot and a bf16 dot of the same M, N, K.

gemm_proj_rope_mxfp8 at DeepSeek-V3's K = 1536, H = 128, T in {2048, 4096}, w as (H*192, K) (with --w-in-out also as
(K, H*192)), bf16 and MXFP8 inputs: ours (None and "cutedsl"), the reference, XLA's bare bf16 dot of the same shape
(-> bf16; the faster of the two weight layouts) and the unfused pipeline through `jax.nn.scaled_matmul` (MXFP8 in on
both paths: scaled_matmul -> RoPE -> rowwise and columnwise MXFP8 quantization).

On a GPU of compute capability 10.x with nvidia-cudnn-frontend installed, NVIDIA's own JAX entry points for the same
operations are one more column ("cudnn-fe sm100"): `gemm_amax_jax_sm100` (MXFP8 tables) and
`gemm_proj_rope_mxfp8_jax_sm100` (w as (H*192, K); n/a for the other layout). Their kernels are built for sm_100
only, so the tables elsewhere do not show the column.

Method: fresh random inputs (normal values whose rows differ in magnitude, quantized by `formats.quantize_mxfp8` /
`quantize_mxfp4` / `quantize_nvfp4`, so block scales are random and never zero; NVFP4 first multiplies each operand
by its per-tensor factor 6 * 448 / amax, and alpha is the product of the two factors' inverses), several input sets
rotated so that caches cannot hold them, every function compiled ahead under jax.jit, warm-up calls, then the median
of --reps samples, each --burst calls (10) issued back to back and ended by one block_until_ready, per call: the
device time per call, as a model step sees it (--burst 1 waits for every call and adds its host latency, 0.1-0.4 ms
on an H200, to every column). `--sustained SECONDS` keeps each column busy that long instead and reports the median
of the last two thirds: the steady state at the GPU's power limit (an H200 then runs both GEMMs and our kernels at
1.5-1.6 GHz, not 1.98), which short bursts only partly see. Columns are timed one after another, so the first meets
a cooler GPU than the last; `--interleave` compiles them all first and takes their samples in turn instead, in a
fresh shuffled order each round. Ratios are speedups, baseline ms / column ms (> 1: faster than the baseline),
against `jax.nn.scaled_matmul`, the reference and `jax.lax.scaled_dot` for gemm_amax, against the bare dot and the
unfused pipeline for proj_rope. Every column that computes the same function is checked against the reference on the
first input set (gemm_amax: ||C - C_ref|| / ||C_ref||; proj_rope: the fraction of E4M3 codes equal to the
reference's), so that a fast wrong answer shows. A column that cannot run here (no kernel applies, the installed jax
lacks the API or the format, no lowering for this platform; an error at compile time or on the first call) shows
"n/a", and the reason is printed below the table and kept in the JSON.

Modules, each importable alone: `inputs` (random operands in every form the columns take), `timing` (warm-up,
bursts, sustained runs, interleaving, medians), `columns` (what each column runs and how it is checked), `cases`
(the problems and running one), `launch` (--launch: first-call and per-call costs), `report` (environment, table,
JSON, chart) and `cli` (the command line).
"""
