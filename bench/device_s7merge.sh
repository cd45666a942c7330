#!/usr/bin/env bash
# Session 7, issue 4: a new fused merge against the one before it (FG_MERGE_OLD). Run first at 931e809 (IG
# items x CH splits per round trip: lost), then at the staged merge (the partials cp.async'd into the free
# ring SC splits at a time, one L2 round trip per chunk). One H200 call: (1) tests/test_gpu_decode.py; (2) ab_decode
# of the default tile, one process with the new merge and one with FG_MERGE_OLD, alternating, cuDNN in each;
# (3) the %globaltimer timeline of both. One tarball: $OUT/s7merge.tgz.
. bench/device_lib.sh
device_setup s7merge
timeout 150 python3 -m pytest -q --noconftest -m gpu tests/test_gpu_decode.py -rfs -x \
  --junitxml="$W/gpu_decode.xml" > "$W/gpu_decode.log" 2>&1
echo "rc=$?" >> "$W/gpu_decode.log"; tail -3 "$W/gpu_decode.log"; pack
for r in 1 2; do
  for m in "" FG_MERGE_OLD; do
    tag=${m:-new}
    timeout 120 python3 bench/decode_probe.py define "$m" n128w4s2h2 "$W/ab_${tag}_$r.json" 3 > "$W/ab_${tag}_$r.log" 2>&1
    echo "rc=$?" >> "$W/ab_${tag}_$r.log"; echo "== $tag round $r"; grep -E "L32768|L131072|L4096_bhsd.*full|rc=" "$W/ab_${tag}_$r.log"; pack
  done
done
for m in "" FG_MERGE_OLD; do
  tag=${m:-new}
  timeout 100 python3 bench/decode_probe.py timeline "$W/tl_$tag.json" $m > "$W/tl_$tag.log" 2>&1; echo "rc=$?" >> "$W/tl_$tag.log"
  python3 - "$W/tl_$tag.json" $tag <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["timeline"]:
    st = r["launches"][-1]
    print(sys.argv[2], r["batch"], r["heads_kv"], r["L"], "S", r["splits"], "event %.1f" % r["event_us"],
          " ".join("%s %.1f" % (k, v["max"]) for k, v in st.items() if k not in ("start", "seqlens")))
PY
done; pack
