#!/usr/bin/env bash
# Session 7: ncu of e709bc9's decode kernel, static vs FG_DYN_VARIANT 1 vs 0 (see ncu_dyn.py for the tree it needs).
. bench/device_lib.sh
device_setup s7ncudyn
export FLASHGEN_HOME=/tmp/fgx
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_read.sum,lts__average_gcomp_input_sector_success_rate.pct,smsp__inst_executed.sum,l1tex__m_xbar2l1tex_read_bytes.sum,lts__d_sectors_fill_device.sum
for a in static 1 0; do
  python3 bench/exp_s7/ncu_dyn.py $a > /dev/null 2>&1
  timeout 100 ncu --clock-control none --kernel-name regex:decode_split --launch-skip 1 --launch-count 2 --metrics $M python3 bench/exp_s7/ncu_dyn.py $a > "$W/ncu_$a.log" 2>&1
  echo "== $a rc=$?"; grep -E "^\s+[a-z_0-9]+__" "$W/ncu_$a.log" | awk '{print $1, $(NF-1), $NF}' | head -24
  pack
done
