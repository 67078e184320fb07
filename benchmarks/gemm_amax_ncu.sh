#!/usr/bin/env bash
# Nsight Compute on sm_90a gemm_amax candidates at 4096^3 (benchmarks/gemm_amax_ncu.py): the full section set,
# exported as CSV into $1 (details page; SASS source page with per-instruction stall samples). Usage (on the H200,
# after `source .devpayload/setup.sh`): bash benchmarks/gemm_amax_ncu.sh OUT_DIR [KIND...] (KIND: fp8p_128,
# fp8p_128:mma, current, ...).
set -u
out=$1
shift
kinds=("$@")
[ ${#kinds[@]} -eq 0 ] && kinds=(fp8p_128:mma fp8p_128)
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
echo "ncu: $ncu"
for kind in "${kinds[@]}"; do
  name=${kind//:/_}
  rep=/tmp/gemm_amax_ncu_$name
  "$ncu" --clock-control none --kernel-name regex:Hopper --launch-skip 3 --launch-count 1 --set full \
    --import-source no -f -o "$rep" python3 benchmarks/gemm_amax_ncu.py "$kind"
  "$ncu" -i "$rep.ncu-rep" --page details --csv > "$out/ncu_${name}_details.csv"
  "$ncu" -i "$rep.ncu-rep" --page source --csv --print-source sass > "$out/ncu_${name}_sass.csv"
  echo "kind $kind: $(wc -l < "$out/ncu_${name}_details.csv") detail rows, $(wc -l < "$out/ncu_${name}_sass.csv") sass rows"
done
