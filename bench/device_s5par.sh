#!/usr/bin/env bash
# Session 5 (repo root): OUT=... bash bench/device_s5par.sh  (<= 2 min)
# The two d=128 non-causal cells the final tables put at 0.99x cuDNN (2k in final2, 16k in final): the
# shipped spec, its closest alternatives and cuDNN, 21 interleaved rounds (bench/ab_fwd.py): is the gap
# real or the card's round-to-round noise? One tarball: $OUT/s5par.tgz.
. bench/device_lib.sh
device_setup s5par
timeout ${AB_TIMEOUT:-100} python3 bench/ab_fwd.py --out "$W" --rounds 21 \
  --cell 128,0,2048:full_s3_m192_n80,ws_ov_s3,full_s3_m192_n80_ps \
  --cell 128,0,16384:ws_ov_s3,full_s3_m192_n80 2>&1 | tee "$W/ab.txt"
pack; ls -la "$OUT"
