#!/usr/bin/env bash
# Session 5, first H200 call (repo root): OUT=... bash bench/device_s5a.sh  (<= 8 min)
# The Q-piece / cross-tile ping-pong change to fwd_sm90 (bench/NOTES.md, "Session 5"): a one-case-per-process
# smoke of the persistent flag sets first (a hang shows as a case timeout, not a lost call), the fwd_sm90 GPU
# tests, then the persist table (default path vs its persist twin, PERSIST_PAIRS with and without _ps, cuDNN;
# 5 rotated rounds, medians). One tarball: $OUT/s5a.tgz.
set -o pipefail
export PYTHONPATH=$PWD FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/s5a}
W=$(mktemp -d); mkdir -p "$OUT"
pack() { tar -czf "$OUT/s5a.tgz" -C "$W" .; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  echo "commit ${FLASHGEN_COMMIT:-}"; date -u; } | tee "$W/gpu.txt"
CUDA_LAUNCH_BLOCKING=1 timeout 90 python3 bench/smoke_sm90.py --isolated \
  --flags full_ps,ws_ov_s3_ps,full_s3_n112_ps,full_s4_m192_n80_ps,ws_pp_kv_s3_m192_ps,ws_ov_s3_m192_n80_ps,full \
  --dims 64,128 --bms 128 --jobs 12 --case-timeout 40 > "$W/smoke.log" 2>&1
echo "smoke rc=$?" >> "$W/smoke.log"; tail -4 "$W/smoke.log"; pack
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q --noconftest -x tests/test_gpu_sm90.py \
  --junitxml="$W/gpu_sm90.xml" > "$W/gpu_sm90.log" 2>&1
echo "rc=$?" >> "$W/gpu_sm90.log"; tail -5 "$W/gpu_sm90.log"; pack
timeout ${BENCH_TIMEOUT:-200} python3 bench/bench_sm90.py --out "$W" --persist --rounds 5 \
  --seqlens 2048,4096,8192,16384 --dims 128,64 2>&1 | tee "$W/bench.txt" | grep -v "^precompiled"
pack; ls -la "$OUT"
