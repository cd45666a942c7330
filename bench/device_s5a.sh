#!/usr/bin/env bash
# Session 5, first H200 call (repo root): OUT=... bash bench/device_s5a.sh  (<= 8 min)
# The Q-piece / cross-tile ping-pong change to fwd_sm90 (bench/NOTES.md, "Session 5"): a one-case-per-process
# smoke of the persistent flag sets first (a hang shows as a case timeout, not a lost call), the fwd_sm90 GPU
# tests, then the persist table (default path vs its persist twin, PERSIST_PAIRS with and without _ps, cuDNN;
# 5 rotated rounds, medians). One tarball: $OUT/s5a.tgz.
. bench/device_lib.sh
device_setup s5a
sm90_checks full_ps,ws_ov_s3_ps,full_s3_n112_ps,full_s4_m192_n80_ps,ws_pp_kv_s3_m192_ps,ws_ov_s3_m192_n80_ps,full
timeout ${BENCH_TIMEOUT:-200} python3 bench/bench_sm90.py --out "$W" --persist --rounds 5 \
  --seqlens 2048,4096,8192,16384 --dims 128,64 2>&1 | tee "$W/bench.txt" | grep -v "^precompiled"
pack; ls -la "$OUT"
