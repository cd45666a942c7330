#!/usr/bin/env bash
# Session 3, first H200 call (repo root): OUT=... bash bench/device_s3a.sh
# (0) the device NVRTC's ptxas report for the d=128 causal default (was once "spills 32 B");
# (1) tests/test_gpu_fwd.py through the default path (one-key fwd dispatch, CUDA_CACHE_DISABLE);
# (2) bench/device_sm90perf.sh (smoke of every fwd_sm90 flag set, bench --quick with the ablation).
# One tarball: $OUT/s3a.tgz.
set -o pipefail
export PYTHONPATH=$PWD FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/s3a}
W=$(mktemp -d)
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  echo "commit ${FLASHGEN_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; date -u; } | tee "$W/gpu.txt"
echo "== (0) ptxas report of default specs on this NVRTC"
timeout 60 python3 - 2>&1 <<'PY' | tee "$W/reports.txt"
from flashgen import dispatch
from flashgen.codegen import build
from flashgen.codegen.compiler import nvrtc_version
print("nvrtc", nvrtc_version())
for d in (64, 128):
    for causal in (False, True):
        key = dispatch.ProblemKey("fwd", "sm_90a", "bf16", d, causal, 4096)
        s = dispatch.select(key, "h200", 232448, verify=True)
        r = build(s).report
        print(f"{s.name:70s} regs {r.registers} spill {r.spill_stores}/{r.spill_loads}")
PY
echo "== (1) tests/test_gpu_fwd.py, default path"
timeout 200 python3 -m pytest -q --noconftest -m gpu tests/test_gpu_fwd.py --durations=5 \
  --junitxml="$W/gpu_tests_fwd.xml" > "$W/gpu_tests_fwd.log" 2>&1
echo "rc=$?" >> "$W/gpu_tests_fwd.log"; tail -12 "$W/gpu_tests_fwd.log"
tar -czf "$OUT/s3a.tgz" -C "$W" .
echo "== (2) sm90perf"
OUT=$W/sm90perf bash bench/device_sm90perf.sh 2>&1 | tail -70
tar -czf "$OUT/s3a.tgz" -C "$W" .
ls -la "$OUT"
