#!/usr/bin/env bash
# Next session's first H200 call (repo root): OUT=... bash bench/device_s5ab.sh  (<= 150 s)
# The section-size A/B session 4 left (bench/NOTES.md, "Session 4"): each cell's shipped default spec in
# sections of a quarter of the L2 (shipped), of half of it, and pair after pair, with and without persist,
# cuDNN beside; 7 rounds, each starting one impl later, medians. One tarball: $OUT/s5ab.tgz.
. bench/device_lib.sh
device_setup s5ab
timeout ${AB_TIMEOUT:-140} python3 bench/bench_sm90.py --out "$W" --order --no-alts --rounds 7 \
  --seqlens 2048,4096,8192,16384 --dims 128,64 2>&1 | tee "$W/bench.txt" | grep -v "^precompiled"
pack; ls -la "$OUT"
