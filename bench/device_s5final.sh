#!/usr/bin/env bash
# Session 5, the closing H200 call (repo root): OUT=... bash bench/device_s5final.sh  (<= 9.5 min)
# (1) the whole GPU suite and the fwd_sm90 smoke (bench/device_suite.sh; the shipped tables in place);
# (2) the forward benchmark on the shipped default path, flashgen and SDPA's flash, cuDNN and efficient
#     backends taking turns over 5 rounds per cell (medians): d 64/128 at N 1k-16k, then d 256 (3 rounds);
# (3) bench_sm90.py --quick: the fixed-flag main table and the flag ablation (plain, ws, ws_pp, full, ...).
# Tarballs: $OUT/suite.tgz (device_suite.sh), $OUT/s5final.tgz (fwd.json, fwd256.json, sm90.json, logs; it ran
# as fwd.tgz before bench/device_lib.sh). D256=0 ABLATION=0 leave out (2) d 256 and (3): the "final2" call.
. bench/device_lib.sh
device_setup s5final
OUT="$OUT" SUITE_TIMEOUT=${SUITE_TIMEOUT:-200} SMOKE_TIMEOUT=45 bash bench/device_suite.sh
FWD_TIMEOUT=${FWD_TIMEOUT:-140} fwd_table 1024,2048,4096,8192,16384
if [ "${D256:-1}" = 1 ]; then
  timeout ${FWD256_TIMEOUT:-50} python3 bench/bench_fwd.py --d 256 --seqlens 1024,2048,4096,8192,16384 --rounds 3 \
    --out "$W/fwd256.json" > "$W/bench_fwd256.log" 2>&1
  echo "rc=$?" >> "$W/bench_fwd256.log"; grep -E "^ +256|rc=" "$W/bench_fwd256.log"; pack
fi
if [ "${ABLATION:-1}" = 1 ]; then
  timeout ${ABL_TIMEOUT:-110} python3 bench/bench_sm90.py --out "$W" --quick > "$W/sm90.log" 2>&1
  echo "rc=$?" >> "$W/sm90.log"; grep -A40 "^ablation" "$W/sm90.log" | head -40; pack
fi
ls -la "$OUT"
