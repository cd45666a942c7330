#!/usr/bin/env bash
# Session 5 (repo root; carry .whl): OUT=... bash bench/device_s5lz.sh  (<= 4 min)
# d=128 non-causal N=2k, the one cell still under cuDNN (0.986x over 21 rounds, s5par): sepkv and lazy were
# left out of this session's tune space on session 4's evidence, but the flag ablation after the warp-uniform
# change had full_kv_lz_s3 first at 8k. (1) re-tune that key with sepkv and lazy searched (copy of the shipped
# table); (2) the new pick ("default") against the shipped spec and cuDNN, 15 interleaved rounds.
# One tarball: $OUT/s5lz.tgz.
. bench/device_lib.sh
device_setup s5lz
TUNE_TIMEOUT=${TUNE_TIMEOUT:-150} tune_into_copy --d 128 --causal false --seqlens 2048 --trials 600 \
  --space warpspec=true emu=0 block_m=128,192 block_n=80,96,112,128 stages=2,3
timeout ${AB_TIMEOUT:-60} python3 bench/ab_fwd.py --out "$W" --rounds 15 \
  --cell 128,0,2048:default,full_s3_m192_n80,full_kv_lz_s3_m192_n80 2>&1 | tee "$W/ab.txt"
pack; ls -la "$OUT"
