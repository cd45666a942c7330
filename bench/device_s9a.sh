#!/usr/bin/env bash
# Session 9, issue 4: CTA-count experiment (bench/exp_s9/ctas.py). One tarball: $OUT/s9a.tgz.
. bench/device_lib.sh
device_setup s9a
timeout 300 python3 bench/exp_s9/ctas.py "$W/ctas.json" ${ROUNDS:-7} > "$W/ctas.log" 2>&1
echo "rc=$?" >> "$W/ctas.log"; tail -12 "$W/ctas.log"; pack
