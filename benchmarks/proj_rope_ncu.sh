#!/usr/bin/env bash
# Nsight Compute on the sm_90a proj_rope kernels at T = 4096 (benchmarks/proj_rope_ncu.py): the full section set with
# per-instruction warp-stall samples, exported as CSV into $1 (details page, SASS source page; ncu_export.sh). Usage
# (on the H200, after `source .devpayload/setup.sh`): bash benchmarks/proj_rope_ncu.sh OUT_DIR [KIND...] (KIND: 1, 2,
# pp, st, st:epilogue, ...).
set -u
out=$1
shift
kinds=("$@")
[ ${#kinds[@]} -eq 0 ] && kinds=(1 pp)
exec bash "$(dirname "$0")/ncu_export.sh" "$out" proj_rope HopperProjRope 2 benchmarks/proj_rope_ncu.py "${kinds[@]}"
