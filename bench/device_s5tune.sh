#!/usr/bin/env bash
# Session 5, one H200 call (repo root; carry .whl): OUT=... bash bench/device_s5tune.sh  (<= 9 min)
# (1) re-tune the bf16 forward at N 2k-16k (d 64/128, causal both) after the Q-piece / warp-uniform change
#     to fwd_sm90 (bench/NOTES.md, "Session 5"): fwd_sm90 with warpspec, block_m 128/192, block_n 80-128,
#     2-3 stages, ping-pong / overlap / persist both ways (every candidate runs), merged into a copy of the
#     shipped table; <= 330 s;
# (2) the forward benchmark with that table in place ($FLASHGEN_HOME/configs/h200.yaml comes first):
#     flashgen and SDPA's flash, cuDNN and efficient backends taking turns, 5 rounds per cell, medians,
#     d 64/128 at N 2k-16k; <= 150 s.
# One tarball: $OUT/s5tune.tgz (tune.log, tune_report.json, h200.yaml, fwd.json, bench_fwd.log).
set -o pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen}
OUT=${OUT:-bench/results/s5tune}
W=$(mktemp -d); mkdir -p "$OUT" "$FLASHGEN_HOME/configs"
pack() { tar -czf "$OUT/s5tune.tgz" -C "$W" .; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  echo "commit ${FLASHGEN_COMMIT:-}"; date -u; } | tee "$W/gpu.txt"
cp flashgen/generated/h200.yaml "$FLASHGEN_HOME/configs/h200.yaml"
timeout ${TUNE_TIMEOUT:-330} python3 -m flashgen.cli tune --gpu h200 --d 64,128 --dtype bf16 --kind fwd_sm90 \
  --seqlens 2048,4096,8192,16384 --trials 400 --report "$W/tune_report.json" \
  --space warpspec=true sepkv=false lazy=false emu=0 block_m=128,192 block_n=80,96,112,128 stages=2,3 \
  > "$W/tune.log" 2>&1
echo "tune rc=$?" >> "$W/tune.log"; tail -20 "$W/tune.log"
cp "$FLASHGEN_HOME/configs/h200.yaml" "$W/h200.yaml"; pack
timeout ${FWD_TIMEOUT:-150} python3 bench/bench_fwd.py --d 64,128 --seqlens 2048,4096,8192,16384 --rounds 5 \
  --out "$W/fwd.json" > "$W/bench_fwd.log" 2>&1
echo "rc=$?" >> "$W/bench_fwd.log"; tail -22 "$W/bench_fwd.log" | grep -v "^ \{3,\}[0-9]"; pack
ls -la "$OUT"
