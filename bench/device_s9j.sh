#!/usr/bin/env bash
# Session 9: ncu warp states + source counters of decode_split n128 w4 s3 at 16 CTAs (bench/exp_s9/ncu_rate.py).
. bench/device_lib.sh
device_setup s9j
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
timeout 240 "$NCU" --clock-control none --section WarpStateStats --section SourceCounters --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis_Tables -k regex:decode_split --launch-skip 2 --launch-count 1 \
  python3 bench/exp_s9/ncu_rate.py 3 > "$W/ncu_s3.log" 2>&1; echo "rc=$?" >> "$W/ncu_s3.log"; pack
grep -iE "stall|Warp Cycles|Issued|Eligible|Active Warps|Bank|Shared|Pipe|rc=" "$W/ncu_s3.log" | head -60
