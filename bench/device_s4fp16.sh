#!/usr/bin/env bash
# Session 4, one H200 call (repo root; carry .whl): OUT=... bash bench/device_s4fp16.sh
# The fp16 forward keys (d 64/128, causal both, every bucket) were session 2's fwd_v2-only entries: re-tune
# them over both families with the bf16 re-tune's narrowed space (persist searched), merged into a copy of
# the shipped table; then the forward GPU tests with that table in place. One tarball: $OUT/s4fp16.tgz.
set -o pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen}
OUT=${OUT:-bench/results/s4fp16}
W=$(mktemp -d); mkdir -p "$OUT" "$FLASHGEN_HOME/configs"
pack() { tar -czf "$OUT/s4fp16.tgz" -C "$W" .; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  echo "commit ${FLASHGEN_COMMIT:-}"; date -u; } | tee "$W/gpu.txt"
cp flashgen/generated/h200.yaml "$FLASHGEN_HOME/configs/h200.yaml"
timeout ${TUNE_TIMEOUT:-420} python3 -m flashgen.cli tune --gpu h200 --d 64,128 --dtype fp16 --trials 400 \
  --report "$W/tune_report.json" --space sepkv=false lazy=false emu=0 block_n=64,80,96,112,128 stages=2,3 \
  > "$W/tune.log" 2>&1
echo "tune rc=$?" >> "$W/tune.log"; tail -29 "$W/tune.log"
cp "$FLASHGEN_HOME/configs/h200.yaml" "$W/h200.yaml"; pack
timeout ${TEST_TIMEOUT:-90} python3 -m pytest -q --noconftest -m gpu tests/test_gpu_fwd.py -p no:cacheprovider \
  > "$W/gpu_tests_fwd.log" 2>&1
echo "rc=$?" >> "$W/gpu_tests_fwd.log"; tail -3 "$W/gpu_tests_fwd.log"; pack
ls -la "$OUT"
