#!/usr/bin/env bash
# Session 8, issue 4: the Done-when table at this commit (bench_decode.py, 7 interleaved rounds, SDPA flash
# and cuDNN in the same run; paged, split sweep, host overhead), after tests/test_gpu_decode.py.
# One tarball: $OUT/s8final.tgz.
. bench/device_lib.sh
device_setup s8final
timeout 150 python3 -m pytest -q --noconftest -m gpu tests/test_gpu_decode.py -rfs \
  --junitxml="$W/gpu_decode.xml" > "$W/gpu_decode.log" 2>&1
echo "rc=$?" >> "$W/gpu_decode.log"; tail -2 "$W/gpu_decode.log"; pack
timeout 300 python3 bench/bench_decode.py --rounds 7 --out "$W/decode_h200.json" > "$W/bench_decode.log" 2>&1
echo "rc=$?" >> "$W/bench_decode.log"; tail -24 "$W/bench_decode.log"; pack
