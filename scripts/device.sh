#!/usr/bin/env bash
# One command for a GPU host, run from a checkout (the package need not be installed):
#
#   scripts/device.sh [tests] SUITE ["SUITE --option value ..."] ...
#   e.g. scripts/device.sh tests fwd decode
#        scripts/device.sh "fwd --d 128 --seqlens 2048,8192 --rounds 3" "ablation --d 64"
#
# Steps run in the order given: `tests` is the GPU test suite (pytest -m gpu tests/; "tests ARGS"
# runs pytest -m gpu ARGS instead, e.g. "tests tests/test_gpu_decode.py -x"; the whole suite, about 5300
# tests, runs about 2.9 a second on an H100 with a fresh kernel cache, some 1900 s, more than one device call:
# "tests tests/ --shard 1/5" to 5/5, about 1070 tests each, in five calls; ARGS are split as the shell splits
# words, quotes kept: "tests tests/ -k 'a or b'"), every other
# word is a `flashgen bench` suite (fwd, bwd, decode, ablation, ab, host, startup, sass), optionally quoted
# together with its options. Each step writes into its own folder, packed as $OUT/<step>.tgz as soon
# as the step ends (a step stopped by its timeout is packed with what it wrote so far: a suite's
# <suite>.partial.json): the table (table.txt), the progress log, the JSON and the PNG of a suite;
# pytest.log, junit.xml and failures.txt (each failure's report as it happened, kept when the time
# limit stops pytest before its own report) of the tests. $OUT/summary.txt holds the GPU, clocks and
# commit, and one line per step; it is printed last with the head of each table. The device tool
# brings back at most 8 files of $OUT: summary.txt and up to 7 steps per call.
#
# Environment: OUT (default ./bench-results/device), FLASHGEN_COMMIT (the commit to record: a device
# copy has no .git), FLASHGEN_HOME (default: a fresh temporary folder, so every kernel is compiled by
# this host's NVRTC), TIMEOUT (seconds per step, default per step below), TIMEOUT_<STEP> (one step,
# e.g. TIMEOUT_FWD=300), TEST_TIMEOUT (seconds one GPU test's call may take before the tests step ends with
# its name and stacks in failures.txt, default 120: a hung kernel then costs that, not the step's limit).
# Carried wheels in .whl/ are installed into /tmp/site first.
set -o pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
if [ $# -eq 0 ]; then
  sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'
  exit 2
fi

export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
export FLASHGEN_HOME=${FLASHGEN_HOME:-$(mktemp -d /tmp/flashgen-home.XXXXXX)}
OUT=${OUT:-$ROOT/bench-results/device}
mkdir -p "$OUT" "$FLASHGEN_HOME"
W=$(mktemp -d /tmp/flashgen-steps.XXXXXX)
SUMMARY=$OUT/summary.txt
COMMIT=${FLASHGEN_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export FLASHGEN_COMMIT=$COMMIT

# Seconds per step unless TIMEOUT or TIMEOUT_<STEP> says otherwise; a device call has 600 s in all.
# The GPU tests: a fifth of the suite (--shard K/5) about 370 s on an H100 (a third did not end in 540 s).
default_timeout() {
  case $1 in
    tests) echo 560 ;; host|startup) echo 120 ;; sass) echo 500 ;; *) echo 420 ;;
  esac
}

{
  echo "# flashgen device run, $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "commit $COMMIT"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv 2>&1 || echo "nvidia-smi: not available"
  python3 - <<'EOF' 2>&1
import platform
print("python", platform.python_version())
for name in ("torch", "cupy"):
    try:
        print(name, __import__(name).__version__)
    except Exception as exc:  # noqa: BLE001
        print(name, "missing:", exc)
try:
    from flashgen.codegen.compiler import nvrtc_version
    print("nvrtc", ".".join(map(str, nvrtc_version())))
except Exception as exc:  # noqa: BLE001
    print("nvrtc: unknown", exc)
EOF
  echo "FLASHGEN_HOME $FLASHGEN_HOME"
  echo "# steps"
} > "$SUMMARY"
cat "$SUMMARY"

declare -A SEEN
STEPS=()
FAILED=0
for spec in "$@"; do
  # A step's words as the shell would split them (quotes kept together: "tests tests/x.py -k 'a or b'").
  mapfile -t words < <(python3 -c 'import shlex, sys; print("\n".join(shlex.split(sys.argv[1])))' "$spec" 2>/dev/null)
  if [ ${#words[@]} -eq 0 ] && [ -n "${spec// /}" ]; then
    echo ">> $spec: its quotes do not close; skipped" | tee -a "$SUMMARY"
    FAILED=1
    continue
  fi
  name=${words[0]:-}
  [ -z "$name" ] && continue
  SEEN[$name]=$(( ${SEEN[$name]:-0} + 1 ))
  step=$name
  [ "${SEEN[$name]}" -gt 1 ] && step=$name${SEEN[$name]}
  STEPS+=("$step")
  dir=$W/$step
  mkdir -p "$dir"
  var=TIMEOUT_$(echo "$name" | tr '[:lower:]' '[:upper:]')
  limit=${!var:-${TIMEOUT:-$(default_timeout "$name")}}
  echo ">> $step (timeout ${limit} s): $spec"
  t0=$(date +%s)
  if [ "$name" = tests ]; then
    # "tests" alone: every GPU test; "tests ARGS...": pytest ARGS instead of tests/ (a file, -k, -x ...).
    targets=("${words[@]:1}")
    [ ${#targets[@]} -eq 0 ] && targets=(tests/)
    timeout -k 10 "$limit" python3 -m pytest -q -m gpu "${targets[@]}" --junitxml="$dir/junit.xml" \
      --failure-log="$dir/failures.txt" --test-timeout="${TEST_TIMEOUT:-120}" > "$dir/pytest.log" 2>&1
    rc=$?
    last=$(grep -E "passed|failed|error|skipped|no tests ran" "$dir/pytest.log" | tail -1)
  else
    timeout -k 10 "$limit" python3 -m flashgen.cli bench "$name" --out "$dir" "${words[@]:1}" \
      > "$dir/table.txt" 2> "$dir/progress.log"
    rc=$?
    last=$(grep -m1 "^wrote .*\.json" "$dir/table.txt" || tail -1 "$dir/progress.log")
  fi
  secs=$(( $(date +%s) - t0 ))
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && last="TIMED OUT after ${limit} s; $last"
  [ "$rc" -ne 0 ] && FAILED=1
  last=${last//$W\//}
  # The clock, temperature and power right after the step (a throttled card shows here).
  after=$(nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader 2>/dev/null)
  line="$step rc=$rc ${secs}s [${after:-no nvidia-smi}]: $last"
  echo "$line" >> "$SUMMARY"
  echo "   $line"
  cp "$SUMMARY" "$dir/summary.txt"
  tar -czf "$OUT/$step.tgz" -C "$W" "$step"
done

echo
echo "================ summary ================"
cat "$SUMMARY"
for step in "${STEPS[@]}"; do
  if [ -s "$W/$step/table.txt" ]; then
    echo
    echo "---- $step (head of the table; all of it in $step.tgz)"
    head -n 40 "$W/$step/table.txt"
  elif [ -f "$W/$step/progress.log" ]; then
    echo
    echo "---- $step (no table; the end of its log)"
    tail -n 8 "$W/$step/progress.log"
  elif [ -f "$W/$step/pytest.log" ]; then
    echo
    echo "---- $step"
    grep -E "^(FAILED|ERROR)" "$W/$step/pytest.log" | head -20
    tail -n 3 "$W/$step/pytest.log"
    # failures as they happened (kept when the step's time limit cut pytest before its report)
    [ -s "$W/$step/failures.txt" ] && grep -A12 "^==== " "$W/$step/failures.txt" | head -60
  fi
done
ls -la "$OUT"
exit $FAILED
