#!/usr/bin/env bash
# Branch sm90perf, one device call (H200), from the repo root: OUT=... bash bench/device_sm90perf.sh
# (a) smoke of every flag set (plain, ov, ws, ws_pp, ws_ov, full) at d 64/128/256 x causal, block_m 128,
#     via bench/smoke_sm90_min.sh (correctness after the loop-shape change), <= 60 s;
# (b) bench/bench_sm90.py --quick (main table with all flags, ablation at d=128 N=8k incl. the 3-stage
#     ring), <= 90 s. Everything lands in one tarball, $OUT/sm90perf.tgz.
set -o pipefail
export PYTHONPATH=$PWD FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/sm90perf}
W=$(mktemp -d)
mkdir -p "$OUT"
echo "== (a) smoke, all flag sets" | tee "$W/run.log"
OUT=$W FLAGS=${FLAGS:-plain,ov,ws,ws_pp,ws_ov,full} BMS=${BMS:-128} JOBS=${JOBS:-12} SMOKE_TIMEOUT=60 \
  timeout 70 bash bench/smoke_sm90_min.sh 2>&1 | tail -80 | tee -a "$W/run.log"
echo "== (b) bench --quick" | tee -a "$W/run.log"
timeout 90 python3 bench/bench_sm90.py --quick --out "$W" ${BENCH_ARGS:-} 2>&1 | tee "$W/bench_sm90.log" | tail -60 | tee -a "$W/run.log"
echo "bench rc=$?" | tee -a "$W/run.log"
tar -czf "$OUT/sm90perf.tgz" -C "$W" .
ls -la "$OUT"
