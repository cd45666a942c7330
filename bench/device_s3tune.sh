#!/usr/bin/env bash
# Session 3, tuning call (repo root): OUT=... bash bench/device_s3tune.sh
# Tune the bf16 forward keys (d 64/128, causal both, six buckets) over BOTH forward families
# (fwd_v2 and fwd_sm90, every candidate: --trials 400), merged into a copy of the shipped table
# (fp16 entries kept), then the forward GPU tests and the forward benchmark with that table in place.
# One tarball: $OUT/s3tune.tgz (tune log/report, h200.yaml, test log, bench json/log).
set -o pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen}
OUT=${OUT:-bench/results/s3tune}
W=$(mktemp -d); mkdir -p "$OUT" "$FLASHGEN_HOME/configs"
pack() { tar -czf "$OUT/s3tune.tgz" -C "$W" .; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  echo "commit ${FLASHGEN_COMMIT:-}"; date -u; } | tee "$W/gpu.txt"
cp flashgen/generated/h200.yaml "$FLASHGEN_HOME/configs/h200.yaml"
timeout ${TUNE_TIMEOUT:-420} python3 -m flashgen.cli tune --gpu h200 --d ${DS:-64,128} --dtype ${DT:-bf16} \
  --trials ${TRIALS:-400} --report "$W/tune_report.json" ${TUNE_ARGS:-} > "$W/tune.log" 2>&1
echo "tune rc=$?" >> "$W/tune.log"; tail -32 "$W/tune.log"
cp "$FLASHGEN_HOME/configs/h200.yaml" "$W/h200.yaml"; pack
timeout 60 python3 -m pytest -q --noconftest -m gpu tests/test_gpu_fwd.py > "$W/gpu_tests_fwd.log" 2>&1
echo "rc=$?" >> "$W/gpu_tests_fwd.log"; tail -3 "$W/gpu_tests_fwd.log"; pack
timeout ${BENCH_TIMEOUT:-100} python3 bench/bench_fwd.py --seqlens 1024,2048,4096,8192,16384 --out "$W/fwd.json" \
  > "$W/bench_fwd.log" 2>&1
echo "rc=$?" >> "$W/bench_fwd.log"; tail -16 "$W/bench_fwd.log"; pack
ls -la "$OUT"
