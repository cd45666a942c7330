#!/usr/bin/env bash
# Session 6's first H200 call, ready (repo root; carry .whl): OUT=... bash bench/device_s6first.sh  (<= 9.5 min)
# (1) the GPU suite and the forward table on the shipped table as session 5 left it (bench/NOTES.md,
#     "Next"): the same-run table issue 7 still lacks since the d=128 non-causal 2k entry changed;
# (2) the bf16 forward N 2k-16k re-tuned with sepkv and lazy searched (lazy took all ten top places at the
#     one key tried) into a copy of the table, and the forward table again on that copy.
# Tarballs: $OUT/suite.tgz (device_suite.sh), $OUT/s6first.tgz (fwd_shipped.json, tune*, h200.yaml, fwd.json).
. bench/device_lib.sh
device_setup s6first
OUT="$OUT" SUITE_TIMEOUT=${SUITE_TIMEOUT:-200} SMOKE_TIMEOUT=45 bash bench/device_suite.sh
FWD_TIMEOUT=${FWD_TIMEOUT:-110} fwd_table 2048,4096,8192,16384
mv "$W/fwd.json" "$W/fwd_shipped.json"; mv "$W/bench_fwd.log" "$W/bench_fwd_shipped.log"; pack
TUNE_TIMEOUT=${TUNE_TIMEOUT:-240} tune_into_copy --d 64,128 --seqlens 2048,4096,8192,16384 --trials 700 \
  --space warpspec=true emu=0 block_m=128,192 block_n=80,112,128 stages=3
FWD_TIMEOUT=${FWD_TIMEOUT:-110} fwd_table 2048,4096,8192,16384
ls -la "$OUT"
