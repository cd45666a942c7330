#!/usr/bin/env bash
# bwd2 device run (one H200 call, repo root): backward GPU tests, the backward tile/dQ-mode sweep,
# then the fwd+bwd benchmark. Each step has its own timeout and a failing step never stops the
# next ones. Writes under $OUT: gpu_tests_bwd.{log,xml}, sweep_bwd.{log,json}, bench_bwd.{log,json}.
#   OUT=... bash bench/device_bwd2.sh        (about 7-8 minutes at most; ~5 expected)
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen}
OUT=${OUT:-bench/results/bwd2}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, cupy; from flashgen.codegen.compiler import nvrtc_version; print('torch', torch.__version__, 'cupy', cupy.__version__, 'nvrtc', nvrtc_version())" | tee -a "$OUT/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"

echo "== (a) GPU tests of the backward"
timeout 150 python3 -m pytest -q --noconftest -m gpu tests/test_gpu_bwd.py --durations=10 \
  --junitxml="$OUT/gpu_tests_bwd.xml" > "$OUT/gpu_tests_bwd.log" 2>&1
echo "rc=$?" >> "$OUT/gpu_tests_bwd.log"
tail -40 "$OUT/gpu_tests_bwd.log"

echo "== (b) sweep of backward specs and dQ modes"
timeout ${SWEEP_TIMEOUT:-200} python3 bench/sweep_bwd.py --d 128,64 --seqlens 2048,8192 --budget-s ${SWEEP_BUDGET:-170} \
  --out "$OUT/sweep_bwd.json" > "$OUT/sweep_bwd.log" 2>&1
echo "rc=$?" >> "$OUT/sweep_bwd.log"
sed -n '/^== d=/,$p' "$OUT/sweep_bwd.log" | head -80

echo "== (c) fwd+bwd benchmark"
timeout ${BENCH_TIMEOUT:-150} python3 bench/bench_bwd.py --seqlens 1024,2048,4096,8192,16384 --out "$OUT/bench_bwd.json" \
  > "$OUT/bench_bwd.log" 2>&1
echo "rc=$?" >> "$OUT/bench_bwd.log"
tail -25 "$OUT/bench_bwd.log"
exit 0
