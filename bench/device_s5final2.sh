#!/usr/bin/env bash
# Session 5, the closing H200 call after the causal section change (repo root): OUT=... bash bench/device_s5final2.sh
# (1) the whole GPU suite and the fwd_sm90 smoke (bench/device_suite.sh; the shipped tables in place);
# (2) the forward benchmark on the shipped default path, flashgen and SDPA's flash, cuDNN and efficient
#     backends taking turns over 5 rounds per cell (medians): d 64/128 at N 1k-16k.
# Tarballs: $OUT/suite.tgz (device_suite.sh), $OUT/fwd.tgz (fwd.json, bench_fwd.log).
set -o pipefail
export PYTHONPATH=$PWD FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/s5final2}
mkdir -p "$OUT"
OUT="$OUT" SUITE_TIMEOUT=${SUITE_TIMEOUT:-200} SMOKE_TIMEOUT=45 bash bench/device_suite.sh
W=$(mktemp -d)
pack() { tar -czf "$OUT/fwd.tgz" -C "$W" .; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  echo "commit ${FLASHGEN_COMMIT:-}"; date -u; } > "$W/gpu.txt"
timeout ${FWD_TIMEOUT:-140} python3 bench/bench_fwd.py --d 64,128 --seqlens 1024,2048,4096,8192,16384 --rounds 5 \
  --out "$W/fwd.json" > "$W/bench_fwd.log" 2>&1
echo "rc=$?" >> "$W/bench_fwd.log"; tail -26 "$W/bench_fwd.log" | grep -v "^ \{3,\}[0-9]" ; pack
ls -la "$OUT"
