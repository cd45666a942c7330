#!/usr/bin/env bash
# Device call: decode round 2 again (the first try failed to compile under NVRTC 13.0: generic lambda).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen}
FINAL=$OUT; R=/tmp/r5; mkdir -p $R/dec2
OUT=$R/dec2 bash bench/device_dec2.sh > $R/dec2/stdout.log 2>&1; tail -${DEC_TAIL:-70} $R/dec2/stdout.log
tar czf $FINAL/round5.tgz -C $R .
