#!/usr/bin/env bash
# Session 6, issue 4: the one d=128 decode tile (n128 w4 s2, evict_first) as the default rule, one H200 call
# (repo root): OUT=... bash bench/device_s6dec.sh   (<= 5 min)
# (1) tests/test_gpu_decode.py (every d=128 tile of the rule forced, the rule's own picks, graphs, appends);
# (2) bench/bench_decode.py: the Done-when table (flashgen, SDPA flash, cuDNN interleaved, 7 rounds),
#     paged vs contiguous, the split scan, host overhead. One tarball: $OUT/s6dec.tgz.
. bench/device_lib.sh
device_setup s6dec
timeout ${DEC_TESTS_TIMEOUT:-100} python3 -m pytest -q --noconftest -m gpu tests/test_gpu_decode.py -rfs \
  --junitxml="$W/gpu_decode.xml" > "$W/gpu_decode.log" 2>&1
echo "rc=$?" >> "$W/gpu_decode.log"; tail -3 "$W/gpu_decode.log"; pack
timeout ${DEC_BENCH_TIMEOUT:-240} python3 bench/bench_decode.py --rounds 7 --out "$W/decode_h200.json" \
  > "$W/bench_decode.log" 2>&1
echo "rc=$?" >> "$W/bench_decode.log"; tail -22 "$W/bench_decode.log"; pack
