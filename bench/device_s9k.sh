#!/usr/bin/env bash
# Session 9, issue 4: (1) decode GPU tests; (2) ab_src: head (O rescaled only when a row's max moved) against
# ptr_s9 (= f1a0aba's template, bench/exp_s8/variants, carried); (3) ab_decode: the default against s3 forced
# (the "full" regime's candidate now that a CTA reads faster). One tarball: $OUT/s9k.tgz.
. bench/device_lib.sh
device_setup s9k
timeout 150 python3 -m pytest -q --noconftest -m gpu tests/test_gpu_decode.py -rfs -x \
  --junitxml="$W/gpu_decode.xml" > "$W/gpu_decode.log" 2>&1
echo "rc=$?" >> "$W/gpu_decode.log"; tail -3 "$W/gpu_decode.log"; pack
timeout 250 python3 bench/exp_s8/ab_src.py "$W/ab.json" ${ROUNDS:-7} ptr=bench/exp_s8/variants/ptr_s9.cuh \
  > "$W/ab.log" 2>&1; echo "rc=$?" >> "$W/ab.log"
grep -v "^  decode_split" "$W/ab.log" | tail -16 | cut -c1-200; pack
timeout 200 python3 bench/ab_decode.py --cands "default,n128w4s3h2" --rounds ${ROUNDS:-7} --out "$W/abt.json" > "$W/abt.log" 2>&1
echo "rc=$?" >> "$W/abt.log"; tail -19 "$W/abt.log" | cut -c1-200; pack
