#!/usr/bin/env bash
# One device call on the H200 that checks and times what changed, each step under its own time limit, so that a
# hang costs one step and not the whole call. Run from the project root after `source .devpayload/setup.sh`:
#
#     bash benchmarks/h200_session.sh STEP... (default: every step, in the order below)
#
# Steps: proj_rope_tests (proj_rope_tests_default_tile), proj_rope_kernel, proj_rope_pingpong_tests,
# proj_rope_pingpong_kernel, proj_rope_persistent_tests, proj_rope_persistent_kernel, proj_rope_profile,
# proj_rope_k32_kernel, proj_rope_ncu, sanitize_keys, bench_gemm_fp4, sanitize_proj_rope, bench_proj_rope, bench_gemm, handler_tests,
# selfcheck_tests, gemm_tests, gemm_all_tests, gemm_candidates, autodiff_tests, api_overhead, api_overhead_proj_rope,
# train_step, sanitize, sanitize_bg / selfcheck_bg + wait_bg, sanitize_catalog, soak, proj_rope_cluster_tests,
# multi_gpu
# (the last needs two GPUs: kind nvidia-h200-x2; the single-GPU steps then run on the first).
# Logs go to $OUT, one per step (at most 8 files come back from a device call); 00_session.log holds every step's
# status and tail.
set -u
OUT=${OUT:-/tmp/jbg_out}
mkdir -p "$OUT"
LOG="$OUT/00_session.log"  # sorts first: what comes back first when there are more than 8 files
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(proj_rope_tests proj_rope_kernel bench_proj_rope handler_tests gemm_tests gemm_candidates)

BUDGET=${BUDGET:-540}  # seconds for the whole session: a step that would not fit in what is left is skipped

run_step() {  # name, limit in seconds, log file, command...
  local name=$1 limit=$2 file=$3
  shift 3
  if (( SECONDS + limit > BUDGET )); then
    printf '\n=== %s: skipped (%s s left of the %s s budget, the step may take %s s)\n' "$name" \
      "$((BUDGET - SECONDS))" "$BUDGET" "$limit" | tee -a "$LOG"
    return
  fi
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$file" 2>&1
  local rc=$?
  printf '\n=== %s: rc=%s (%s s, limit %s s)\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" | tee -a "$LOG"
  tail -n 25 "$OUT/$file" | tee -a "$LOG"
}

for step in "${STEPS[@]}"; do
  case "$step" in
    proj_rope_tests)
      run_step "$step" 300 proj_rope_tests.log python3 -m pytest tests/test_gpu_proj_rope.py -q -x -p no:cacheprovider ;;
    proj_rope_tests_default_tile)  # the dispatcher's tile only (64x192, the SmallTile class)
      run_step "$step" 90 proj_rope_tests.log python3 -m pytest tests/test_gpu_proj_rope.py -q -x -p no:cacheprovider \
        -k "SmallTile" ;;
    proj_rope_kernel)
      run_step "$step" 60 proj_rope_kernel.log python3 benchmarks/proj_rope_standalone.py --no-check \
        --consumer-wgs 2,1 ;;
    proj_rope_pingpong_tests)  # the persistent ping-pong kernel: the whole proj_rope suite on it, first on a GPU
      run_step "$step" 150 proj_rope_pingpong_tests.log python3 -m pytest tests/test_gpu_proj_rope.py -q -x \
        -p no:cacheprovider -k PingPong ;;
    proj_rope_pingpong_kernel)  # ping-pong vs the 64x192 two-CTA default: checked (2-3 tiles per CTA too), then timed
      run_step "$step" 120 proj_rope_pingpong_kernel.log python3 benchmarks/proj_rope_standalone.py --quick \
        --consumer-wgs pp,1 --out "$OUT" ;;
    proj_rope_profile)  # T = 4096 with each epilogue phase left out (HopperProjRope._skip), unchecked, 1-WG and ping-pong
      run_step "$step" 200 proj_rope_profile.log python3 benchmarks/proj_rope_standalone.py --no-check \
        --consumer-wgs 1,pp --profile --reps 10 ;;
    proj_rope_persistent_tests)  # the persistent cooperative kernel (128-token tiles): the whole suite on it
      run_step "$step" 150 proj_rope_persistent_tests.log python3 -m pytest tests/test_gpu_proj_rope.py -q -x \
        -p no:cacheprovider -k "Persistent" ;;
    proj_rope_persistent_kernel)  # persistent vs the 64x192 two-CTA default: checked (2-3 tiles per CTA too), timed
      run_step "$step" 120 proj_rope_persistent_kernel.log python3 benchmarks/proj_rope_standalone.py --quick \
        --consumer-wgs ps,1 --out "$OUT" ;;
    proj_rope_k32_kernel)  # 32-wide k-tiles (twice the stages) on three schedules beside the default: checked, timed
      run_step "$step" 170 proj_rope_k32_kernel.log python3 benchmarks/proj_rope_standalone.py --quick \
        --consumer-wgs 1k32,ppk32,psk32,1 --out "$OUT" ;;
    bench_gemm_fp4)  # MXFP4 and NVFP4 gemm_amax at 8192^3 through the public API beside every baseline
      run_step "$step" 150 bench_gemm_fp4.log python3 -m jax_blockgemm.bench --op gemm_amax --format mxfp4,nvfp4 \
        --shape 8192,8192,8192 --reps 10 --json "$OUT/bench_fp4.json" ;;
    sanitize_keys)  # SANITIZE_KEYS (comma-separated catalog keys) under all three tools, one shape each
      run_step "$step" 200 sanitize.log python3 benchmarks/sanitize.py --out /tmp/jbg_sanitize --first-shape \
        --shards racecheck=2,memcheck=1,synccheck=1 --keys "$SANITIZE_KEYS" --no-fuzz --budget 190 --timeout 180 ;;
    proj_rope_ncu)  # Nsight Compute (full set, per-instruction stall samples) of the default and ping-pong kernels
      run_step "$step" 240 proj_rope_ncu.log bash benchmarks/proj_rope_ncu.sh "$OUT" ;;
    sanitize_proj_rope)  # the 12 sm_90a proj_rope variants under all three tools (after an epilogue change)
      keys=$(python3 -c "from jax_blockgemm.kernels import catalog; print(','.join(v.key for v in catalog.CATALOG
if v.op == 'proj_rope' and v.arch == 'sm_90a'))")
      run_step "$step" 290 sanitize.log python3 benchmarks/sanitize.py --out /tmp/jbg_sanitize --first-shape \
        --shards racecheck=4,memcheck=2,synccheck=2 --keys "$keys" --no-fuzz --budget 275 --timeout 260 ;;
    bench_proj_rope)
      run_step "$step" 90 bench.log python3 -m jax_blockgemm.bench --op proj_rope --json "$OUT/bench.json" ;;
    bench_gemm)
      run_step "$step" 120 bench_gemm.log python3 -m jax_blockgemm.bench --op gemm_amax ;;
    handler_tests)
      run_step "$step" 60 handler_tests.log python3 -m pytest tests/test_gpu_handler_fuzz.py tests/test_gpu_epilogue.py \
        -q -p no:cacheprovider ;;
    selfcheck_tests)
      run_step "$step" 300 selfcheck_tests.log python3 -m pytest tests/test_gpu_selfcheck.py -q -p no:cacheprovider ;;
    gemm_tests)
      run_step "$step" 120 gemm_tests.log python3 -m pytest tests/test_gpu_gemm_amax.py -q -p no:cacheprovider ;;
    gemm_candidates)
      run_step "$step" 160 gemm_candidates.log python3 benchmarks/kernel_standalone.py --candidates \
        --only rs_ov_256,bits1_256_b2_ov,rs_bits1_256,rs_ov_128 --no-xla --budget-s 150 \
        --out /tmp/jbg_candidates ;;  # its per-candidate files stay there: the table is in the log
    autodiff_tests)
      run_step "$step" 120 autodiff_tests.log python3 -m pytest tests/test_gpu_autodiff.py -q -p no:cacheprovider ;;
    api_overhead)
      run_step "$step" 120 api_overhead.log python3 benchmarks/api_overhead.py --json "$OUT/api_overhead.json" ;;
    train_step)
      run_step "$step" 110 train_step.log python3 benchmarks/train_step.py --out "$OUT" ;;
    sanitize)
      run_step "$step" 520 sanitize.log python3 benchmarks/sanitize.py --out /tmp/jbg_sanitize --budget 500 ;;
    sanitize_catalog)  # every catalog variant x 3 tools, one shape each, racecheck split 6 ways (~7 min, BUILD.md)
      run_step "$step" 440 sanitize.log python3 benchmarks/sanitize.py --out /tmp/jbg_sanitize --first-shape \
        --shards racecheck=6,memcheck=3,synccheck=3 --budget 425 --timeout 400 ;;
    soak)  # 8 minutes: a call of its own (SOAK_MINUTES to shorten it)
      run_step "$step" $(( ${SOAK_MINUTES:-8} * 60 + 60 )) soak.log python3 benchmarks/soak.py \
        --minutes "${SOAK_MINUTES:-8}" --out /tmp/jbg_soak ;;
    gemm_all_tests)  # the default variants' file and the whole sm_90a surface (FP4, NVFP4, C dtypes, MN-major)
      run_step "$step" 240 gemm_tests.log python3 -m pytest tests/test_gpu_gemm_amax.py \
        tests/test_gpu_gemm_amax_surface.py -q -p no:cacheprovider ;;
    proj_rope_cluster_tests)  # the W-multicast clusters of 64-token tiles
      run_step "$step" 130 proj_rope_cluster_tests.log python3 -m pytest tests/test_gpu_proj_rope.py -q \
        -p no:cacheprovider -k "Cluster2 or Cluster4" ;;
    api_overhead_proj_rope)
      run_step "$step" 80 api_overhead.log python3 benchmarks/api_overhead.py --only proj_rope \
        --json /tmp/api_overhead.json ;;
    sanitize_bg)  # in the background, beside the steps that follow (correctness only, no timing): see `wait_bg`
      ( timeout "${SANITIZE_S:-300}" python3 benchmarks/sanitize.py --out /tmp/jbg_sanitize \
          --budget "$(( ${SANITIZE_S:-300} - 15 ))" > "$OUT/sanitize.log" 2>&1;
        echo "sanitize rc=$?" >> "$OUT/sanitize.log" ) &
      echo "=== sanitize_bg: started" | tee -a "$LOG" ;;
    selfcheck_bg)  # selfcheck_tests in the background (no preallocation), beside correctness steps; see `wait_bg`
      ( XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 330 python3 -m pytest tests/test_gpu_selfcheck.py -q \
          -p no:cacheprovider > "$OUT/selfcheck_tests.log" 2>&1; echo "selfcheck rc=$?" >> "$OUT/selfcheck_tests.log" ) &
      echo "=== selfcheck_bg: started" | tee -a "$LOG" ;;
    wait_bg)  # waits for every background step and prints each one's verdict
      wait
      for f in sanitize selfcheck_tests; do
        [ -f "$OUT/$f.log" ] || continue
        printf '\n=== %s (background): %s\n' "$f" "$(tail -n 1 "$OUT/$f.log")" | tee -a "$LOG"
        grep -E "FAIL|SUMMARY \(|passed|failed" "$OUT/$f.log" | head -20 | tee -a "$LOG"
      done ;;
    multi_gpu)
      run_step "$step" 170 multi_gpu.log python3 benchmarks/multi_gpu.py --out "$OUT/multi_gpu.json" ;;
    *) echo "unknown step $step" | tee -a "$LOG" ;;
  esac
done
