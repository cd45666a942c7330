#!/usr/bin/env bash
# Last device call of the session: fwd_sm90 smoke after the stride fix (+ quick bench if it runs),
# then decode round 3 (tests, bench). Outputs packed into tarballs (at most 8 files come back).
set -o pipefail
export PYTHONPATH=$PWD FLASHGEN_HOME=/tmp/flashgen PYTHONUNBUFFERED=1
FINAL=$OUT; mkdir -p /tmp/rf/sm90
FLAGS=plain,full JOBS=8 SMOKE_TIMEOUT=${SMOKE_TIMEOUT:-80} OUT=/tmp/rf/sm90 bash bench/smoke_sm90_min.sh 2>&1 | tail -30
tar czf $FINAL/final_sm90.tgz -C /tmp/rf sm90
if [ -n "${SM90_BENCH:-}" ]; then
  timeout ${SM90_BENCH_TIMEOUT:-60} python3 bench/bench_sm90.py --out /tmp/rf/sm90 --quick 2>&1 | tail -25
  tar czf $FINAL/final_sm90.tgz -C /tmp/rf sm90
fi
OUT=$FINAL DEC_COMPILE_TIMEOUT=40 DEC_TESTS_TIMEOUT=${DEC_TESTS_TIMEOUT:-45} DEC_BENCH_TIMEOUT=${DEC_BENCH_TIMEOUT:-100} \
  DEC_SWEEP_TIMEOUT=1 bash bench/device_dec3.sh 2>&1 | tail -45
