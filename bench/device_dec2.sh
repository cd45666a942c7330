#!/usr/bin/env bash
# Decode follow-up (branch dec2), one device call on a fresh H200 box, from the repo root:
#   bash bench/device_dec2.sh
# (a) GPU tests of flashgen.decode (< 2 min; compiles the default decode kernels first),
# (b) bench/sweep_decode.py: 14 decode_split specs x the Done-when cases + split counts + fused vs
#     separate combine (~1-2 min, budget 150 s), (c) bench/bench_decode.py (~2 min).
# Each step has its own timeout and runs whether or not the previous one failed; total < 8 min.
# Logs and JSON land in $OUT (the device's output folder; bench/results/decode/ when run by hand).
set -o pipefail
export PYTHONPATH=$PWD FLASHGEN_HOME=/tmp/flashgen PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/decode}
mkdir -p "$OUT"
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
git log -1 --format='commit %H %s' 2>/dev/null || true

echo "== (a) GPU tests =="
timeout ${DEC_TESTS_TIMEOUT:-120} python3 -m pytest -q --noconftest -m gpu tests/test_gpu_decode.py -rf --durations=8 \
  --junitxml="$OUT/gpu_decode_tests.xml" 2>&1 | tee "$OUT/gpu_decode_tests.log" | tail -40
echo "(a) rc=$? at $(( $(date +%s) - start )) s"

echo "== (b) sweep =="
timeout ${DEC_SWEEP_TIMEOUT:-180} python3 bench/sweep_decode.py --budget ${DEC_SWEEP_BUDGET:-150} --out "$OUT/sweep_decode.json" 2>&1 \
  | tee "$OUT/sweep_decode.log" | tail -60
echo "(b) rc=$? at $(( $(date +%s) - start )) s"

echo "== (c) bench =="
timeout ${DEC_BENCH_TIMEOUT:-180} python3 bench/bench_decode.py --out "$OUT/decode_h200.json" 2>&1 \
  | tee "$OUT/bench_decode.log" | tail -45
echo "(c) rc=$? at $(( $(date +%s) - start )) s"
