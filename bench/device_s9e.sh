#!/usr/bin/env bash
# Session 9, issue 4: a plain one-wave read with static, strided and dynamic chunk assignment (bench/exp_s9/balance.py).
. bench/device_lib.sh
device_setup s9e
timeout 200 python3 bench/exp_s9/balance.py "$W/balance.json" > "$W/balance.log" 2>&1
echo "rc=$?" >> "$W/balance.log"; tail -8 "$W/balance.log"; pack
