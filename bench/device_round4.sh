#!/usr/bin/env bash
# Device call: first run of fwd_sm90 (smoke, tests, bench) and decode round 2 (tests, sweep, bench).
# Outputs packed in one tarball (at most 8 files come back).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen}
FINAL=$OUT; R=/tmp/r4; mkdir -p $R/sm90 $R/dec2
OUT=$R/sm90 bash bench/device_sm90.sh > $R/sm90/stdout.log 2>&1; tail -${SM90_TAIL:-50} $R/sm90/stdout.log
tar czf $FINAL/round4.tgz -C $R .
OUT=$R/dec2 bash bench/device_dec2.sh > $R/dec2/stdout.log 2>&1; tail -${DEC_TAIL:-50} $R/dec2/stdout.log
tar czf $FINAL/round4.tgz -C $R .
