#!/usr/bin/env bash
# Session 5 (repo root): OUT=... bash bench/device_s5ab2.sh  (<= 3 min)
# The d=128 non-causal cells, where the tuner's top candidates lie within its own noise (bench/NOTES.md,
# "Session 5"): each cell's close candidates and cuDNN, 9 interleaved rounds, medians (bench/ab_fwd.py).
# One tarball: $OUT/s5ab2.tgz.
. bench/device_lib.sh
device_setup s5ab2
timeout ${AB_TIMEOUT:-170} python3 bench/ab_fwd.py --out "$W" --rounds 9 \
  --cell 128,0,2048:full_s3_m192_n80_ps,ws_ov_s3,ws_ov_s3_m192_n80,full_s3_m192_n80,ws_ov_s3_m192_n80_ps \
  --cell 128,0,4096:full_s3_m192_n80,ws_ov_s3_n112,ws_s3_m192_n80,ws_ov_s3,ws_ov_s3_m192_n80 \
  --cell 128,0,8192:full_s3,ws_ov_s3,full_s3_m192_n80,ws_ov_s3_n112 \
  --cell 128,0,16384:ws_ov_s3,full_s3_m192_n80,ws_ov_s3_n96,full_s3 2>&1 | tee "$W/ab.txt"
pack; ls -la "$OUT"
