#!/usr/bin/env bash
# Device call: GPU tests of fwd_v2 + baselines, re-tune d=128 non-causal with the widened space,
# then the forward benchmark (d=128) and the issue-5 bench/explain with the new table in place.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen}
OUT=${OUT:-bench/results}
timeout 120 python3 -m pytest -q --noconftest -m gpu tests/test_gpu_fwd.py tests/test_gpu_baselines.py 2>&1 \
  | tee "$OUT/gpu_tests_fwd_baselines.log" | tail -4
for dt in bf16 fp16; do
  timeout 200 python3 -m flashgen.cli tune --gpu h200 --d 128 --causal false --dtype $dt --trials 200 \
    --report "$OUT/tune_h200_d128_full_$dt.json" 2>&1 | tee "$OUT/tune_h200_d128_full_$dt.log" | tail -8
done
cp "$FLASHGEN_HOME/configs/h200.yaml" "$OUT/h200_d128_full.yaml"
timeout 90 python3 bench/bench_fwd.py --d 128 --out "$OUT/fwd_d128_retuned.json" 2>&1 | tail -16
SKIP_TESTS=1 BENCH_TIMEOUT=150 bash bench/device_issue5.sh > "$OUT/issue5_stdout.log" 2>&1
tail -3 "$OUT/issue5_stdout.log"
