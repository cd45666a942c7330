# What the bench/device_*.sh calls of session 5 on share (sourced, from the repo root):
#   device_setup NAME   strict pipes; PYTHONPATH (the repo, then Optuna's wheels when a carried .whl/
#                       holds them, installed into /tmp/site), FLASHGEN_HOME, unbuffered output; OUT
#                       (default bench/results/NAME), a fresh work folder W, and W/gpu.txt (GPU, clocks,
#                       commit, date), echoed;
#   pack                W as $OUT/NAME.tgz (after every step: a step that runs out of time keeps the rest);
#   sm90_checks FLAGS   the fwd_sm90 smoke of flag sets FLAGS (one case per process: a hang is a case
#                       timeout) and tests/test_gpu_sm90.py; fails when a test does;
#   tune_into_copy ARG  `flashgen tune --gpu h200 --dtype bf16 --kind fwd_sm90 ARG...` merged into a copy of
#                       the shipped table, which the default path then reads first ($FLASHGEN_HOME/configs);
#   fwd_table SEQLENS   bench_fwd.py on the default path, d 64/128, 5 interleaved rounds (medians).
device_setup() {
  DEVICE_RUN=$1
  set -o pipefail
  export PYTHONUNBUFFERED=1 FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen} PYTHONPATH=$PWD
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=$PWD:/tmp/site
  fi
  OUT=${OUT:-bench/results/$DEVICE_RUN}
  W=$(mktemp -d)
  mkdir -p "$OUT" "$FLASHGEN_HOME/configs"
  { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
    echo "commit ${FLASHGEN_COMMIT:-}"; date -u; } | tee "$W/gpu.txt"
}

pack() { tar -czf "$OUT/$DEVICE_RUN.tgz" -C "$W" .; }

sm90_checks() {
  CUDA_LAUNCH_BLOCKING=1 timeout 90 python3 bench/smoke_sm90.py --isolated --flags "$1" --dims 64,128 --bms 128 \
    --jobs 12 --case-timeout 40 > "$W/smoke.log" 2>&1
  echo "smoke rc=$?" >> "$W/smoke.log"; tail -3 "$W/smoke.log"
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q --noconftest -x tests/test_gpu_sm90.py \
    --junitxml="$W/gpu_sm90.xml" > "$W/gpu_sm90.log" 2>&1
  echo "rc=$?" >> "$W/gpu_sm90.log"; tail -3 "$W/gpu_sm90.log"; pack
  grep -q "^rc=0" "$W/gpu_sm90.log"
}

tune_into_copy() {
  cp flashgen/generated/h200.yaml "$FLASHGEN_HOME/configs/h200.yaml"
  timeout ${TUNE_TIMEOUT:-300} python3 -m flashgen.cli tune --gpu h200 --dtype bf16 --kind fwd_sm90 \
    --report "$W/tune_report.json" "$@" > "$W/tune.log" 2>&1
  echo "tune rc=$?" >> "$W/tune.log"; tail -20 "$W/tune.log"
  cp "$FLASHGEN_HOME/configs/h200.yaml" "$W/h200.yaml"; pack
}

fwd_table() {
  timeout ${FWD_TIMEOUT:-150} python3 bench/bench_fwd.py --d 64,128 --seqlens "$1" --rounds 5 \
    --out "$W/fwd.json" > "$W/bench_fwd.log" 2>&1
  echo "rc=$?" >> "$W/bench_fwd.log"; tail -26 "$W/bench_fwd.log" | grep -v "^ \{3,\}[0-9]"; pack
}
