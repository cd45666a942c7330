#!/usr/bin/env bash
# fwd_sm90 minimal device smoke (<= ~60 s on a warm H200): the plain-flag cases (no warpspec / pingpong /
# overlap) for d = 64, 128, 256 x causal x block_m = 64, 128, each in its own subprocess with
# CUDA_LAUNCH_BLOCKING=1 (an illegal address ends only its case), max error per case and, for a failing
# case, the diagnostics of bench/smoke_sm90.py --one (error per block, the kernel's S dump vs Q K^T,
# swizzle-permuted references). From the repo root:
#   bash bench/smoke_sm90_min.sh                    (plain only)
#   FLAGS=plain,ov,ws,full bash bench/smoke_sm90_min.sh   (more flag sets, more time)
set -o pipefail
export PYTHONPATH=$PWD FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen} PYTHONUNBUFFERED=1 CUDA_LAUNCH_BLOCKING=1
OUT=${OUT:-bench/results/sm90fix}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
timeout ${SMOKE_TIMEOUT:-85} python3 bench/smoke_sm90.py --isolated --flags "${FLAGS:-plain}" \
  --dims "${DIMS:-64,128,256}" --bms "${BMS:-64,128}" --jobs "${JOBS:-6}" --case-timeout "${CASE_TIMEOUT:-40}" \
  2>&1 | tee "$OUT/smoke_min.log"
echo "smoke_min rc=$?" | tee -a "$OUT/smoke_min.log"
