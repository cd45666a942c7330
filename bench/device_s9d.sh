#!/usr/bin/env bash
# Session 9, issue 4: (1) each d=128 tile's own per-CTA rate with few CTAs (bench/exp_s9/ctas.py rate); (2) ab_decode:
# the default against 2 splits everywhere and the 8-warp tile; (3) b8/L128k launch series + per-CTA stamps
# (bench/exp_s9/series.py). One tarball: $OUT/s9d.tgz.
. bench/device_lib.sh
device_setup s9d
timeout 200 python3 bench/exp_s9/ctas.py "$W/rate.json" 5 rate > "$W/rate.log" 2>&1
echo "rc=$?" >> "$W/rate.log"; tail -6 "$W/rate.log"; pack
timeout 200 python3 bench/ab_decode.py --cands "${CANDS:-default,n128w4s2h2@2,n128w8s2h2}" --rounds ${ROUNDS:-7} \
  --out "$W/ab.json" > "$W/ab.log" 2>&1; echo "rc=$?" >> "$W/ab.log"; tail -19 "$W/ab.log" | cut -c1-250; pack
timeout 150 python3 bench/exp_s9/series.py "$W/series.json" 8 40 > "$W/series.log" 2>&1
echo "rc=$?" >> "$W/series.log"; tail -16 "$W/series.log"; pack
