#!/usr/bin/env bash
# Session 7, issue 4: where a memory-bound decode call's time goes (one H200 call, ~4 min):
# (1) a plain streaming read by size (fixed cost F and rate R of time = F + bytes/R);
# (2) flashgen and cuDNN decode by cache length (the same fit); (3) %globaltimer stamps per CTA inside the
# decode kernel (FLASHGEN_PROBE build). One tarball: $OUT/s7probe.tgz.
. bench/device_lib.sh
device_setup s7probe
for what in stream timeline sweep; do
  timeout 200 python3 bench/decode_probe.py $what "$W/probe_$what.json" > "$W/probe_$what.log" 2>&1
  echo "rc=$?" >> "$W/probe_$what.log"; tail -12 "$W/probe_$what.log"; pack
done
