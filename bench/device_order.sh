#!/usr/bin/env bash
# Session 4, the causal tile order (L2 sections, longest rows first), one H200 call from the repo root:
#   OUT=... bash bench/device_order.sh
# (1) GPU tests: tests/test_gpu_sm90.py (every flag set, persist, the uneven-section test) and
#     tests/test_gpu_fwd.py (the default path), <= 240 s;
# (2) bench_sm90.py --order: causal cells d 128/64, N 2k-16k: the default spec in the new order and the
#     old (FLASHGEN_TILE_SECTION=1), persist, ORDER_ALTS; then non-causal default vs persist; 2 rounds,
#     cuDNN in the same cells, <= 150 s. One tarball: $OUT/order.tgz.
set -o pipefail
export PYTHONPATH=$PWD FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/order}
W=$(mktemp -d); mkdir -p "$OUT"
pack() { tar -czf "$OUT/order.tgz" -C "$W" .; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  echo "commit ${FLASHGEN_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; date -u; } 2>&1 | tee "$W/gpu.txt"
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q --noconftest -m gpu tests/test_gpu_sm90.py tests/test_gpu_fwd.py \
  -p no:cacheprovider --durations=5 --junitxml="$W/tests.xml" > "$W/tests.log" 2>&1
echo "rc=$?" >> "$W/tests.log"; tail -12 "$W/tests.log"; pack
timeout ${BENCH_TIMEOUT:-150} python3 bench/bench_sm90.py --out "$W" --order --seqlens 2048,4096,8192,16384 \
  --dims 128,64 --rounds 2 2>&1 | tee "$W/bench.txt" | grep -v "^precompiled"
pack; ls -la "$OUT"
