#!/usr/bin/env bash
# Session 7, issue 4: ncu on flashgen's decode kernel and cuDNN's at b1/hk32/L32k (DRAM bytes, duration,
# throughput), then the Done-when table at this commit. One tarball: $OUT/s7ncu.tgz.
. bench/device_lib.sh
device_setup s7ncu
python3 bench/ncu_decode.py > /dev/null 2>&1  # compile outside the profiler
timeout 200 ncu --clock-control none --launch-skip 2 \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_op_read_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__registers_per_thread,launch__occupancy_limit_shared_mem \
  python3 bench/ncu_decode.py > "$W/ncu.log" 2>&1
echo "rc=$?" >> "$W/ncu.log"; pack
grep -E "^\s+[a-z_]+__|==PROF==|^  [A-Za-z_].*\(|rc=" "$W/ncu.log" | grep -v "^==PROF== Connected" | cut -c1-150 | head -60
timeout 150 python3 -m pytest -q --noconftest -m gpu tests/test_gpu_decode.py -rfs \
  --junitxml="$W/gpu_decode.xml" > "$W/gpu_decode.log" 2>&1
echo "rc=$?" >> "$W/gpu_decode.log"; tail -2 "$W/gpu_decode.log"; pack
timeout 240 python3 bench/bench_decode.py --rounds 7 --out "$W/decode_h200.json" > "$W/bench_decode.log" 2>&1
echo "rc=$?" >> "$W/bench_decode.log"; tail -22 "$W/bench_decode.log"; pack
