#!/usr/bin/env bash
# Session 4, one H200 call (repo root; carry .whl): OUT=... bash bench/device_s4tune.sh
# (1) the tile order, A/B (bench_sm90.py --order --no-alts --rounds 5): each cell's default spec in the L2-
#     section order and in the old one (FLASHGEN_TILE_SECTION=1), with and without persist, cuDNN beside,
#     5 rounds, each starting one impl later, medians; <= 100 s;
# (2) re-tune the bf16 forward at N 2k-16k (d 64/128, causal both) over both families, persist now searched,
#     the space narrowed to what won or came close before (--space: no sepkv/lazy/emu, block_n 64-128,
#     2-3 stages; every candidate runs), merged into a copy of the shipped table; <= 420 s.
# One tarball: $OUT/s4tune.tgz (order.json, bench.txt, tune.log, tune_report.json, h200.yaml).
set -o pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen}
OUT=${OUT:-bench/results/s4tune}
W=$(mktemp -d); mkdir -p "$OUT" "$FLASHGEN_HOME/configs"
pack() { tar -czf "$OUT/s4tune.tgz" -C "$W" .; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  echo "commit ${FLASHGEN_COMMIT:-}"; date -u; } | tee "$W/gpu.txt"
timeout ${AB_TIMEOUT:-100} python3 bench/bench_sm90.py --out "$W" --order --no-alts --rounds 5 \
  --seqlens 2048,4096,8192,16384 --dims 128,64 2>&1 | tee "$W/bench.txt" | grep -v "^precompiled"
pack
cp flashgen/generated/h200.yaml "$FLASHGEN_HOME/configs/h200.yaml"
timeout ${TUNE_TIMEOUT:-420} python3 -m flashgen.cli tune --gpu h200 --d 64,128 --dtype bf16 \
  --seqlens 2048,4096,8192,16384 --trials 400 --report "$W/tune_report.json" \
  --space sepkv=false lazy=false emu=0 block_n=64,80,96,112,128 stages=2,3 > "$W/tune.log" 2>&1
echo "tune rc=$?" >> "$W/tune.log"; tail -22 "$W/tune.log"
cp "$FLASHGEN_HOME/configs/h200.yaml" "$W/h200.yaml"; pack
ls -la "$OUT"
