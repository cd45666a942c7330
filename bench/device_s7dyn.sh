#!/usr/bin/env bash
# Session 7, issue 4: KernelSpec.dynamic (an m-block's CTAs take its key blocks from a counter), one H200 call:
# (1) tests/test_gpu_decode.py (the dynamic tiles forced, graphs, back-to-back calls, every default tile);
# (2) A/B on the 12 Done-when cases: the default tile static vs dynamic, cuDNN in the same rounds;
# (3) the %globaltimer timeline of the dynamic tile (loop-end spread). One tarball: $OUT/s7dyn.tgz.
. bench/device_lib.sh
device_setup s7dyn
timeout 150 python3 -m pytest -q --noconftest -m gpu tests/test_gpu_decode.py -rfs -x \
  --junitxml="$W/gpu_decode.xml" > "$W/gpu_decode.log" 2>&1
echo "rc=$?" >> "$W/gpu_decode.log"; tail -4 "$W/gpu_decode.log"; pack
timeout 200 python3 bench/ab_decode.py --cands "${CANDS:-n128w4s2h2,n128w4s2h2d}" --rounds ${ROUNDS:-5} \
  --out "$W/ab.json" > "$W/ab.log" 2>&1
echo "rc=$?" >> "$W/ab.log"; tail -20 "$W/ab.log"; pack
timeout 120 python3 bench/decode_probe.py timeline_dyn "$W/probe_timeline_dyn.json" > "$W/probe_timeline_dyn.log" 2>&1
echo "rc=$?" >> "$W/probe_timeline_dyn.log"; pack
python3 - "$W/probe_timeline_dyn.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["timeline_dyn"]:
    st = r["launches"][-1]
    print(r["batch"], r["heads_kv"], r["L"], "S", r["splits"], "event %.1f" % r["event_us"],
          "loop_end %.1f/%.1f/%.1f" % (st["loop_end"]["min"], st["loop_end"]["med"], st["loop_end"]["max"]),
          "end %.1f" % max(v["max"] for v in st.values()))
PY
