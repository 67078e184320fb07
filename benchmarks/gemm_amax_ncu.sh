#!/usr/bin/env bash
# Nsight Compute on sm_90a gemm_amax candidates at 4096^3 (benchmarks/gemm_amax_ncu.py): the full section set,
# exported as CSV into $1 (details page; SASS source page with per-instruction stall samples; ncu_export.sh). Usage
# (on the H200, after `source .devpayload/setup.sh`): bash benchmarks/gemm_amax_ncu.sh OUT_DIR [KIND...] (KIND:
# fp8p_128, fp8p_128:mma, current, ...). The 4th launch is profiled (gemm_amax_ncu.py warms up with 3).
set -u
out=$1
shift
kinds=("$@")
[ ${#kinds[@]} -eq 0 ] && kinds=(fp8p_128:mma fp8p_128)
exec bash "$(dirname "$0")/ncu_export.sh" "$out" gemm_amax Hopper 3 benchmarks/gemm_amax_ncu.py "${kinds[@]}"
