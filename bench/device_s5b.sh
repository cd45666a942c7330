#!/usr/bin/env bash
# Session 5, one H200 call (repo root; carry .whl): OUT=... bash bench/device_s5b.sh  (<= 9 min)
# (0) the per-warpgroup live-block change (bench/NOTES.md, "Session 5"): the fwd_sm90 smoke, one case per
#     process, and tests/test_gpu_sm90.py; then as device_s5tune.sh with block_n 160 and 176 added:
# (1) re-tune the bf16 forward at N 2k-16k (d 64/128, causal both) after the Q-piece / warp-uniform change
#     to fwd_sm90 (bench/NOTES.md, "Session 5"): fwd_sm90 with warpspec, block_m 128/192, block_n 80-128,
#     2-3 stages, ping-pong / overlap / persist both ways (every candidate runs), merged into a copy of the
#     shipped table; <= 330 s;
# (2) the forward benchmark with that table in place ($FLASHGEN_HOME/configs/h200.yaml comes first):
#     flashgen and SDPA's flash, cuDNN and efficient backends taking turns, 5 rounds per cell, medians,
#     d 64/128 at N 2k-16k; <= 150 s.
# One tarball: $OUT/s5b.tgz (tune.log, tune_report.json, h200.yaml, fwd.json, bench_fwd.log).
set -o pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen}
OUT=${OUT:-bench/results/s5b}
W=$(mktemp -d); mkdir -p "$OUT" "$FLASHGEN_HOME/configs"
pack() { tar -czf "$OUT/s5b.tgz" -C "$W" .; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  echo "commit ${FLASHGEN_COMMIT:-}"; date -u; } | tee "$W/gpu.txt"
CUDA_LAUNCH_BLOCKING=1 timeout 90 python3 bench/smoke_sm90.py --isolated \
  --flags full_ps,ws_ov_s3_ps,full_s3_n112_ps,full_s4_m192_n80_ps,ws_pp_kv_s3_m192_ps,ws_ov_s3_m192_n80_ps,full,ws_ov_s3_m192_n80 \
  --dims 64,128 --bms 128 --jobs 12 --case-timeout 40 > "$W/smoke.log" 2>&1
echo "smoke rc=$?" >> "$W/smoke.log"; tail -3 "$W/smoke.log"
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q --noconftest -x tests/test_gpu_sm90.py \
  --junitxml="$W/gpu_sm90.xml" > "$W/gpu_sm90.log" 2>&1
echo "rc=$?" >> "$W/gpu_sm90.log"; tail -3 "$W/gpu_sm90.log"; pack
grep -q "^rc=0" "$W/gpu_sm90.log" || exit 1
cp flashgen/generated/h200.yaml "$FLASHGEN_HOME/configs/h200.yaml"
timeout ${TUNE_TIMEOUT:-300} python3 -m flashgen.cli tune --gpu h200 --d 64,128 --dtype bf16 --kind fwd_sm90 \
  --seqlens 2048,4096,8192,16384 --trials 400 --report "$W/tune_report.json" \
  --space warpspec=true sepkv=false lazy=false emu=0 block_m=128,192 block_n=80,96,112,128,160,176 stages=2,3 \
  > "$W/tune.log" 2>&1
echo "tune rc=$?" >> "$W/tune.log"; tail -20 "$W/tune.log"
cp "$FLASHGEN_HOME/configs/h200.yaml" "$W/h200.yaml"; pack
timeout ${FWD_TIMEOUT:-150} python3 bench/bench_fwd.py --d 64,128 --seqlens 2048,4096,8192,16384 --rounds 5 \
  --out "$W/fwd.json" > "$W/bench_fwd.log" 2>&1
echo "rc=$?" >> "$W/bench_fwd.log"; tail -22 "$W/bench_fwd.log" | grep -v "^ \{3,\}[0-9]"; pack
ls -la "$OUT"
