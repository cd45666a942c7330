#!/usr/bin/env bash
# Session 9, issue 4: b8/L128k per-launch series and per-CTA stamps (bench/exp_s9/series.py). $OUT/s9b.tgz.
. bench/device_lib.sh
device_setup s9b
timeout 300 python3 bench/exp_s9/series.py "$W/series.json" ${BLOCKS:-16} ${PROBED:-40} > "$W/series.log" 2>&1
echo "rc=$?" >> "$W/series.log"; tail -25 "$W/series.log"; pack
