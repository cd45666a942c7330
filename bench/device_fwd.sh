#!/usr/bin/env bash
# One device call: GPU tests, then the forward benchmark (and the tile sweep with --sweep).
#   bash bench/device_fwd.sh [--sweep] [bench args...]
set -o pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen}
OUT=${OUT:-bench/results}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, cupy; from flashgen.codegen.compiler import nvrtc_version; print('torch', torch.__version__, 'cupy', cupy.__version__, 'nvrtc', nvrtc_version())"
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -m gpu ${TESTS:-tests/} -x --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
python3 bench/bench_fwd.py --out "$OUT/fwd.json" "$@" 2>&1 | tee "$OUT/bench.log"
