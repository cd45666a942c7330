#!/usr/bin/env bash
# Issue 4 (Flash-Decoding), one device call on a fresh H200 box, from the repo root:
#   export FLASHGEN_COMMIT=<sha>; bash bench/device_issue4.sh
# 1. compiles the decode kernels the tests and the benchmark use (4 threads, ~20 s),
# 2. GPU tests (tests/test_gpu_decode.py, < 2 min), 3. the decode benchmark (< 3 min).
# Logs and JSON land in $OUT (the device's output folder; bench/results/ when run by hand).
set -o pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 - <<'PY' 2>&1 | tee "$OUT/decode_precompile.log"
import time
from multiprocessing.pool import ThreadPool
from flashgen import decoding
from flashgen.codegen import build
t = time.time()
specs = decoding.default_specs("sm_90a", 232448)
res = ThreadPool(4).map(lambda s: (s.name, build(s).report), specs)
for name, rep in res:
    print(name, "regs", rep.registers, "spills", rep.spill_stores, rep.spill_loads)
print(f"compiled {len(specs)} decode kernels in {time.time() - t:.1f} s")
PY
timeout 200 python3 -m pytest -q --noconftest -m gpu tests/test_gpu_decode.py -rf --durations=8 \
  --junitxml="$OUT/gpu_decode_tests.xml" 2>&1 | tee "$OUT/gpu_decode_tests.log" | tail -40
timeout ${DECODE_BENCH_TIMEOUT:-330} python3 bench/bench_decode.py --out "$OUT/decode_h200.json" 2>&1 | tee "$OUT/bench_decode.log" | tail -60
