#!/usr/bin/env bash
# Session 8, issue 4: the merge handshake with the ticket taken at loop end (the merger never stores its
# own partial; release/acquire instead of three SC fences) against the template before it
# (bench/exp_s8/variants/base_decode_split.cuh = dcf335b's, carried; more as VARIANTS="name=file ..."). One H200 call: (1) tests/test_gpu_decode.py; (2) the in-process
# source A/B (bench/exp_s8/ab_src.py: both kernels swapped into the same plan, cuDNN in the same rounds,
# 7 rounds); (3) the %globaltimer timeline of the new kernel. One tarball: $OUT/s8a.tgz.
. bench/device_lib.sh
device_setup s8a
timeout 150 python3 -m pytest -q --noconftest -m gpu tests/test_gpu_decode.py -rfs -x \
  --junitxml="$W/gpu_decode.xml" > "$W/gpu_decode.log" 2>&1
echo "rc=$?" >> "$W/gpu_decode.log"; tail -3 "$W/gpu_decode.log"; pack
timeout 400 python3 bench/exp_s8/ab_src.py "$W/ab.json" ${ROUNDS:-7} base=bench/exp_s8/variants/base_decode_split.cuh $VARIANTS \
  > "$W/ab.log" 2>&1; echo "rc=$?" >> "$W/ab.log"; grep -v "^  decode_split" "$W/ab.log" | tail -20; pack
timeout 100 python3 bench/decode_probe.py timeline "$W/tl.json" > "$W/tl.log" 2>&1; echo "rc=$?" >> "$W/tl.log"
python3 - "$W/tl.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["timeline"]:
    st = r["launches"][-1]
    print(r["batch"], r["heads_kv"], r["L"], "S", r["splits"], "event %.1f" % r["event_us"],
          " ".join("%s %.1f/%.1f" % (k, v["med"], v["max"]) for k, v in st.items() if k not in ("start",)))
PY
pack
