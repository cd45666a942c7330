#!/usr/bin/env bash
# One device call for issue 7 (fwd_sm90), from the repo root of a fresh H200 box:
#   bash bench/device_sm90.sh            (writes everything under $OUT)
# (a) smoke: small cases per head dim / causal / flag set, CUDA_LAUNCH_BLOCKING=1, then a quick pass under
#     compute-sanitizer when present; (b) the GPU test module; (c) the benchmark + ablation.
# Each step has its own timeout and runs even when an earlier one failed. Worst case (every timeout hit) ~5 minutes; expected ~3.
set -o pipefail
export PYTHONPATH=$PWD FLASHGEN_HOME=/tmp/flashgen PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/sm90}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, cupy; from flashgen.codegen.compiler import nvrtc_version; print('torch', torch.__version__, 'cupy', cupy.__version__, 'nvrtc', nvrtc_version())" 2>&1 | tee -a "$OUT/gpu.txt"

echo "== (a) smoke" | tee "$OUT/smoke.log"
CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 bench/smoke_sm90.py 2>&1 | tee -a "$OUT/smoke.log"
echo "smoke rc=$?" | tee -a "$OUT/smoke.log"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$SAN" ]; then
  echo "== (a') compute-sanitizer ($SAN), quick cases" | tee -a "$OUT/smoke.log"
  [ -z "${SKIP_SANITIZER:-}" ] && CUDA_LAUNCH_BLOCKING=1 timeout 30 "$SAN" --tool memcheck python3 bench/smoke_sm90.py --quick 2>&1 | tail -60 | tee -a "$OUT/smoke.log"
else
  echo "(no compute-sanitizer on this box)" | tee -a "$OUT/smoke.log"
fi

echo "== (b) tests"
timeout ${SM90_TESTS_TIMEOUT:-110} python3 -m pytest -q --noconftest -m gpu tests/test_gpu_sm90.py -x --junitxml="$OUT/gpu_tests_sm90.xml" \
  2>&1 | tee "$OUT/gpu_tests_sm90.log" | tail -40

echo "== (c) bench"
timeout ${SM90_BENCH_TIMEOUT:-100} python3 bench/bench_sm90.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_sm90.log"
ls -la "$OUT"
