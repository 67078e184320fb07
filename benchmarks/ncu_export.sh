#!/usr/bin/env bash
# Nsight Compute, the full section set, on one launch of a kernel per KIND, exported as CSV into OUT_DIR (details
# page; SASS source page with per-instruction warp-stall samples). The shared body of proj_rope_ncu.sh and
# gemm_amax_ncu.sh. Usage (on the H200, after `source .devpayload/setup.sh`):
#   bash benchmarks/ncu_export.sh OUT_DIR NAME KERNEL_REGEX LAUNCH_SKIP DRIVER KIND...
# NAME prefixes the /tmp report files; DRIVER (a python script) launches the kernel named by KIND a few times.
set -u
out=$1 name=$2 regex=$3 skip=$4 driver=$5
shift 5
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
echo "ncu: $ncu"
for kind in "$@"; do
  tag=${kind//[:@]/_}
  rep=/tmp/${name}_ncu_$tag
  "$ncu" --clock-control none --kernel-name "regex:$regex" --launch-skip "$skip" --launch-count 1 --set full \
    --import-source no -f -o "$rep" python3 "$driver" "$kind"
  "$ncu" -i "$rep.ncu-rep" --page details --csv > "$out/ncu_${tag}_details.csv"
  "$ncu" -i "$rep.ncu-rep" --page source --csv --print-source sass > "$out/ncu_${tag}_sass.csv"
  echo "kind $kind: $(wc -l < "$out/ncu_${tag}_details.csv") detail rows, $(wc -l < "$out/ncu_${tag}_sass.csv") sass rows"
done
