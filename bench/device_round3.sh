#!/usr/bin/env bash
# Device call: fwd tests, re-tune d=128 non-causal (YAML for the shipped table), backward round 2
# (tests, sweep, bench). Everything is packed into one tarball: at most 8 files come back.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen}
FINAL=$OUT; R=/tmp/r3; mkdir -p $R
timeout 90 python3 -m pytest -q --noconftest -m gpu tests/test_gpu_fwd.py 2>&1 | tail -2 | tee $R/gpu_tests_fwd.log
for dt in bf16 fp16; do
  timeout 120 python3 -m flashgen.cli tune --gpu h200 --d 128 --causal false --dtype $dt --trials 200 \
    --time-budget 5 --report $R/tune_h200_d128_full_$dt.json > $R/tune_h200_d128_full_$dt.log 2>&1
  tail -3 $R/tune_h200_d128_full_$dt.log
done
cp $FLASHGEN_HOME/configs/h200.yaml $R/h200_d128_full.yaml
OUT=$R/bwd2 bash bench/device_bwd2.sh 2>&1 | tail -${BWD_TAIL:-60}
tar czf $FINAL/round3.tgz -C $R .
