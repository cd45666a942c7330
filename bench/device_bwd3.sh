#!/usr/bin/env bash
# bwd3 device run (one H200 call, repo root): (a) backward GPU tests, (b) the backward tile/dQ-mode
# sweep, (c) the fwd+bwd benchmark, plus the ptxas numbers of the d=128 tiles under the device's
# NVRTC. Each step has its own timeout; a failing step never stops the next ones. Everything lands
# in ONE tarball, $OUT/bwd3.tar.gz (gpu.txt, regs.txt, gpu_tests_bwd.{log,xml}, sweep_bwd.{log,json},
# bench_bwd.{log,json}), with the summary on stdout.
# The tarball is re-packed after every step, so a run cut short still brings back what it has.
#   OUT=... bash bench/device_bwd3.sh        (at most ~9 minutes: 45 + 150 + 190 + 140 s + start-up)
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen}
OUT=${OUT:-bench/results/bwd3}
R="$OUT/bwd3"
mkdir -p "$R"
pack() { tar -C "$OUT" -czf "$OUT/bwd3.tar.gz.tmp" bwd3 && mv "$OUT/bwd3.tar.gz.tmp" "$OUT/bwd3.tar.gz"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$R/gpu.txt"
python3 -c "import torch, cupy; from flashgen.codegen.compiler import nvrtc_version; print('torch', torch.__version__, 'cupy', cupy.__version__, 'nvrtc', nvrtc_version())" | tee -a "$R/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$R/gpu.txt"

echo "== (0) ptxas numbers of the d=128 backward tiles (device NVRTC) and what dispatch picks"
timeout 45 python3 - > "$R/regs.txt" 2>&1 <<'PY'
from multiprocessing.pool import ThreadPool
from flashgen import dispatch
from flashgen.codegen import build
from flashgen.spec import KernelSpec
specs = [KernelSpec(kind=kind, arch="sm_90a", dtype="bf16", head_dim=128, block_m=bm, block_n=bn, warps=8, stages=2,
                    causal=causal).validate()
         for kind in ("bwd_dkdv", "bwd_dkdv_nodq", "bwd_dq") for bm, bn in ((64, 64), (32, 128), (128, 64), (64, 128))
         for causal in (False, True)]
def one(s):
    try:
        r = build(s).report
        return f"{s.name:60s} regs {r.registers:3d} spill {r.spill_stores}/{r.spill_loads} stack {r.stack_frame}"
    except Exception as exc:  # noqa: BLE001
        return f"{s.name:60s} {type(exc).__name__}: {str(exc)[:100]}"
with ThreadPool(16) as pool:
    print("\n".join(pool.map(one, specs)))
for kind in ("bwd_dkdv", "bwd_dq"):
    for d in (64, 128):
        for causal in (False, True):
            key = dispatch.ProblemKey(kind, "sm_90a", "bf16", d, causal, 2048)
            print("dispatch", key, "->", dispatch.select(key, "h200", 232448, verify=True).name)
PY
echo "rc=$?" >> "$R/regs.txt"
cat "$R/regs.txt"
pack

echo "== (a) GPU tests of the backward"
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q --noconftest -m gpu tests/test_gpu_bwd.py --durations=10 \
  --junitxml="$R/gpu_tests_bwd.xml" > "$R/gpu_tests_bwd.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests_bwd.log"
tail -40 "$R/gpu_tests_bwd.log"
pack

echo "== (b) sweep of backward specs and dQ modes"
timeout ${SWEEP_TIMEOUT:-190} python3 bench/sweep_bwd.py --d 128,64 --seqlens 2048,8192 --budget-s ${SWEEP_BUDGET:-155} \
  --out "$R/sweep_bwd.json" > "$R/sweep_bwd.log" 2>&1
echo "rc=$?" >> "$R/sweep_bwd.log"
sed -n '/^== d=/,$p' "$R/sweep_bwd.log" | head -80
pack

echo "== (c) fwd+bwd benchmark"
timeout ${BENCH_TIMEOUT:-140} python3 bench/bench_bwd.py --seqlens 1024,2048,4096,8192,16384 --out "$R/bench_bwd.json" \
  > "$R/bench_bwd.log" 2>&1
echo "rc=$?" >> "$R/bench_bwd.log"
tail -25 "$R/bench_bwd.log"

pack && rm -rf "$R"
ls -l "$OUT"
exit 0
