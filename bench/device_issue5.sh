#!/usr/bin/env bash
# One device call for issue 5 (standard / V1 kernels, bench, explain), from the repo root of a fresh GPU box:
#   export FLASHGEN_COMMIT=<commit>; OUT=$OUT bash bench/device_issue5.sh
# Writes under $OUT: gpu_tests_issue5.{log,xml}, fwd.json (fwd.partial.json while running), fwd.png when
# matplotlib is installed there (else plot here later: flashgen bench --plot-from fwd.json --out DIR),
# bench_fwd.log, explain_h200_d128_4096.txt (+ causal). Expected: ~1.5 min tests, ~4 min bench, <1 min explain.
set -o pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, cupy; from flashgen.codegen.compiler import nvrtc_version; print('torch', torch.__version__, 'cupy', cupy.__version__, 'nvrtc', nvrtc_version())" | tee -a "$OUT/gpu.txt"
python3 -c "import matplotlib" 2>/dev/null || echo "matplotlib missing: no PNG here; plot later from fwd.json" | tee -a "$OUT/gpu.txt"

if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 150 python3 -m pytest -q --noconftest -m gpu ${TESTS:-tests/test_gpu_baselines.py} \
    --junitxml="$OUT/gpu_tests_issue5.xml" 2>&1 | tee "$OUT/gpu_tests_issue5.log" | tail -30
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  timeout ${BENCH_TIMEOUT:-300} python3 -m flashgen.cli bench fwd --out "$OUT" --d 64,128 \
    --seqlens 512,1024,2048,4096,8192,16384 --causal both --budget 0.2 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_fwd.log"
fi

for c in "" "--causal"; do
  timeout 60 python3 -m flashgen.cli explain --gpu h200 --d 128 --seqlen 4096 $c --measure \
    2>&1 | tee "$OUT/explain_h200_d128_4096${c:+_causal}.txt"
done
