#!/usr/bin/env bash
# The whole GPU test suite at this commit, one H200 call (repo root): OUT=... bash bench/device_suite.sh
# Every tests/test_gpu_*.py with --noconftest (one kernel cache for the run), the shipped tables in place,
# then the fwd_sm90 smoke (one case per process) of the flag sets the ablation uses. One tarball,
# $OUT/suite.tgz: gpu.txt, gpu_suite.log, gpu_suite.xml, smoke.log.
set -o pipefail
export PYTHONPATH=$PWD FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/suite}
W=$(mktemp -d); mkdir -p "$OUT"
pack() { tar -czf "$OUT/suite.tgz" -C "$W" .; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  echo "commit ${FLASHGEN_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; date -u; } 2>&1 | tee "$W/gpu.txt"
timeout ${SUITE_TIMEOUT:-260} python3 -m pytest -q --noconftest -m gpu tests/test_gpu_*.py --durations=8 \
  --junitxml="$W/gpu_suite.xml" > "$W/gpu_suite.log" 2>&1
echo "rc=$?" >> "$W/gpu_suite.log"; tail -14 "$W/gpu_suite.log"; pack
CUDA_LAUNCH_BLOCKING=1 timeout ${SMOKE_TIMEOUT:-60} python3 bench/smoke_sm90.py --isolated \
  --flags "${SMOKE_FLAGS:-ws_ov_s3,ws_pp_kv_s3_m192,full_kv_lz_e1_s3_m192,ws_pp_kv_lz_e1_s3_n192}" --dims 64,128 --bms 128 \
  --jobs 12 --case-timeout 40 > "$W/smoke.log" 2>&1
echo "smoke rc=$?" >> "$W/smoke.log"; tail -3 "$W/smoke.log"; pack
ls -la "$OUT"
