#!/usr/bin/env bash
# Nsight Compute on the sm_90a proj_rope kernels at T = 4096 (benchmarks/proj_rope_ncu.py): the full section set with
# per-instruction warp-stall samples, exported as CSV into $1 (details page, SASS source page). Usage (on the H200,
# after `source .devpayload/setup.sh`): bash benchmarks/proj_rope_ncu.sh OUT_DIR [KIND...] (KIND: 1, 2, pp, st, st:epilogue, ...).
set -u
out=$1
shift
kinds=("$@")
[ ${#kinds[@]} -eq 0 ] && kinds=(1 pp)
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
echo "ncu: $ncu"
for kind in "${kinds[@]}"; do
  name=${kind//:/_}
  rep=/tmp/proj_rope_ncu_$name
  "$ncu" --clock-control none --kernel-name regex:HopperProjRope --launch-skip 2 --launch-count 1 --set full \
    --import-source no -f -o "$rep" python3 benchmarks/proj_rope_ncu.py "$kind"
  "$ncu" -i "$rep.ncu-rep" --page details --csv > "$out/ncu_${name}_details.csv"
  "$ncu" -i "$rep.ncu-rep" --page source --csv --print-source sass > "$out/ncu_${name}_sass.csv"
  echo "kind $kind: $(wc -l < "$out/ncu_${name}_details.csv") detail rows, $(wc -l < "$out/ncu_${name}_sass.csv") sass rows"
done
