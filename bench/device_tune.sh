#!/usr/bin/env bash
# One device call for the tuner issue: measured tuning on the H200, then the GPU tests and the
# forward benchmark with the freshly tuned table in place (dispatch reads it from FLASHGEN_HOME).
#   export FLASHGEN_COMMIT=<hash>; DTYPES=bf16 bash bench/device_tune.sh
set -o pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen}
OUT=${OUT:-bench/results}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
for dt in ${DTYPES:-bf16}; do
  /usr/bin/time -f "tune $dt wall %e s" python3 -m flashgen.cli tune --gpu h200 --d ${DS:-64,128} --dtype $dt \
    --report "$OUT/tune_h200_$dt.json" ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune_h200_$dt.log"
done
cp "$FLASHGEN_HOME/configs/h200.yaml" "$OUT/h200.yaml"
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -m gpu --noconftest ${TESTS:-tests/test_gpu_fwd.py} -x 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  python3 bench/bench_fwd.py --out "$OUT/fwd_tuned.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -40
fi
