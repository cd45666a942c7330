#!/usr/bin/env bash
# Session 9, issue 4: the decode template (head) against session 8s (base_s9) and against
# Q in registers alone (qreg_s9 = ab088c0), both in bench/exp_s8/variants (carried; first call: q1sync_s9). (1) decode GPU tests;
# (2) per-CTA rate (bench/exp_s9/ctas.py rate); (3) bench/exp_s8/ab_src.py. One tarball: $OUT/s9i.tgz.
. bench/device_lib.sh
device_setup s9i
timeout 150 python3 -m pytest -q --noconftest -m gpu tests/test_gpu_decode.py -rfs -x \
  --junitxml="$W/gpu_decode.xml" > "$W/gpu_decode.log" 2>&1
echo "rc=$?" >> "$W/gpu_decode.log"; tail -3 "$W/gpu_decode.log"; pack
timeout 100 python3 bench/exp_s9/ctas.py "$W/rate.json" 5 rate > "$W/rate.log" 2>&1
echo "rc=$?" >> "$W/rate.log"; cut -c1-130 "$W/rate.log" | tail -5; pack
timeout 300 python3 bench/exp_s8/ab_src.py "$W/ab.json" ${ROUNDS:-7} base=bench/exp_s8/variants/base_s9.cuh \
  qreg=bench/exp_s8/variants/qreg_s9.cuh > "$W/ab.log" 2>&1; echo "rc=$?" >> "$W/ab.log"
grep -v "^  decode_split" "$W/ab.log" | tail -20 | cut -c1-240; pack
