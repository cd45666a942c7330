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
. bench/device_lib.sh
device_setup s5tune
TUNE_TIMEOUT=${TUNE_TIMEOUT:-330} tune_into_copy --d 64,128 --seqlens 2048,4096,8192,16384 --trials 400 \
  --space warpspec=true sepkv=false lazy=false emu=0 block_m=128,192 block_n=80,96,112,128 stages=2,3
fwd_table 2048,4096,8192,16384
ls -la "$OUT"
