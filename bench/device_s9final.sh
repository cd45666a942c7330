#!/usr/bin/env bash
# Session 9, issue 4: the whole GPU suite (bench/device_suite.sh), then the Done-when table at this commit
# (bench_decode.py, 7 interleaved rounds, SDPA flash and cuDNN in the same run; paged, split sweep, host
# overhead). Tarballs: $OUT/suite.tgz, $OUT/s9final.tgz.
SUITE_TIMEOUT=${SUITE_TIMEOUT:-280} bash bench/device_suite.sh
. bench/device_lib.sh
device_setup s9final
timeout 300 python3 bench/bench_decode.py --rounds 7 --out "$W/decode_h200.json" > "$W/bench_decode.log" 2>&1
echo "rc=$?" >> "$W/bench_decode.log"; tail -24 "$W/bench_decode.log"; pack
