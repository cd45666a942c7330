#!/usr/bin/env bash
# Session 10, issue 4: the whole GPU suite (bench/device_suite.sh), the Done-when table at this commit
# (bench_decode.py, 7 interleaved rounds, SDPA flash and cuDNN in the same run; paged, split sweep, host
# overhead), then the default rule next to cuDNN on "full"/"many"-regime shapes beyond the table
# (ab_decode.py --cases), then the per-call host time part by part (exp_s10/host_parts.py). Tarballs:
# $OUT/suite.tgz, $OUT/s10final.tgz.
SUITE_TIMEOUT=${SUITE_TIMEOUT:-280} bash bench/device_suite.sh
. bench/device_lib.sh
device_setup s10final
timeout 300 python3 bench/bench_decode.py --rounds 7 --out "$W/decode_h200.json" > "$W/bench_decode.log" 2>&1
echo "rc=$?" >> "$W/bench_decode.log"; pack
timeout 120 python3 bench/ab_decode.py --rounds 7 --cands default \
  --cases "5,32,32,32768;20,32,8,32768;16,32,16,65536;48,32,8,16384;64,32,8,8192" --out "$W/ab_full.json" \
  2>&1 | grep -v Warn > "$W/ab_full.log"; echo "rc=$?" >> "$W/ab_full.log"; pack
timeout 100 python3 bench/exp_s10/host_parts.py "$W/host.json" 2>&1 | grep -v Warn > "$W/host.log"; pack
tail -13 "$W/host.log"; tail -7 "$W/ab_full.log"; tail -24 "$W/bench_decode.log"
