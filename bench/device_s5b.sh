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
. bench/device_lib.sh
device_setup s5b
sm90_checks full_ps,ws_ov_s3_ps,full_s3_n112_ps,full_s4_m192_n80_ps,ws_pp_kv_s3_m192_ps,ws_ov_s3_m192_n80_ps,full,ws_ov_s3_m192_n80 \
  || exit 1
tune_into_copy --d 64,128 --seqlens 2048,4096,8192,16384 --trials 400 \
  --space warpspec=true sepkv=false lazy=false emu=0 block_m=128,192 block_n=80,96,112,128,160,176 stages=2,3
fwd_table 2048,4096,8192,16384
ls -la "$OUT"
