#!/usr/bin/env bash
# Nsight Compute on the LoRA kernels of one op (one_op.py), general and decode-shaped, one report each:
#   OUT=DIR bash bench/lora_decode/ncu_run.sh "gate_up d64" "gate_up d64 512,512,4,1" ...
# Each argument: OP CASE [K,N,WARPS,DOT]. Writes DIR/ncu-OP-CASE-VARIANT.txt.
source scripts/device_env.sh
O="${OUT:-/tmp/ncu}"; mkdir -p "$O"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
SECTIONS=(--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats
          --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters)
for spec in "$@"; do
  set -- $spec
  name="ncu-$1-$2-${3:-general}"; name="${name//,/_}"
  (cd bench/lora_decode && timeout 120 "$NCU" --clock-control none -k 'regex:^_(shrink|expand)' --launch-skip 2 \
    --launch-count 2 "${SECTIONS[@]}" python3 one_op.py --op "$1" --case "$2" ${3:+--decode "$3"}) \
    > "$O/$name.txt" 2>&1
  echo "$name: rc=$? $(grep -c 'Duration' "$O/$name.txt") durations"
done
