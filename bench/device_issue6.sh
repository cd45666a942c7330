#!/usr/bin/env bash
# Issue 6 device run (fresh H200 box, repo root, no git): backward GPU tests, then the fwd+bwd benchmark.
#   export FLASHGEN_COMMIT=<sha>; bash bench/device_issue6.sh
# Writes gpu_tests_bwd.{log,xml}, bench_bwd.{log,json} under $OUT (default bench/results).
set -o pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, cupy; from flashgen.codegen.compiler import nvrtc_version; print('torch', torch.__version__, 'cupy', cupy.__version__, 'nvrtc', nvrtc_version())"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 170 python3 -m pytest -q --noconftest -m gpu tests/test_gpu_bwd.py --durations=15 \
    --junitxml="$OUT/gpu_tests_bwd.xml" 2>&1 | tee "$OUT/gpu_tests_bwd.log" | tail -60
fi
timeout 200 python3 bench/bench_bwd.py --out "$OUT/bench_bwd.json" "$@" 2>&1 | tee "$OUT/bench_bwd.log"
