#!/usr/bin/env bash
# Session 9, issue 4: the lean decode kernel (KernelSpec.persist). (1) tests/test_gpu_decode.py; (2) ab_decode:
# the default against the lean kernel with 2 and 3 stages, cuDNN in the same rounds. One tarball: $OUT/s9c.tgz.
. bench/device_lib.sh
device_setup s9c
timeout 200 python3 -m pytest -q --noconftest -m gpu tests/test_gpu_decode.py -rfs -x \
  --junitxml="$W/gpu_decode.xml" > "$W/gpu_decode.log" 2>&1
echo "rc=$?" >> "$W/gpu_decode.log"; tail -15 "$W/gpu_decode.log"; pack
timeout 300 python3 bench/ab_decode.py --cands "${CANDS:-default,n128w4s2h2L,n128w4s3h2L}" --rounds ${ROUNDS:-7} \
  --out "$W/ab.json" > "$W/ab.log" 2>&1; echo "rc=$?" >> "$W/ab.log"; tail -22 "$W/ab.log"; pack
