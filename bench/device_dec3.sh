#!/usr/bin/env bash
# Decode round 3 (branch dec3), one device call on a fresh H200 box, from the repo root:
#   bash bench/device_dec3.sh
# (0) compile every default decode spec in parallel (so the tests do not compile one by one),
# (a) GPU tests of flashgen.decode (<= 60 s), (b) bench/bench_decode.py, the Done-when table, paged
# vs contiguous interleaved over 3 rounds, split scans, host overhead (<= 150 s), (c) a short
# bench/sweep_decode.py: the per-case default rule next to 6 tiles on every case, split scans of the
# default's picks (<= 120 s). Each step has its own timeout and runs whether or not the previous one
# failed; total < 6.5 min. Everything lands in ONE tarball, $OUT/dec3_results.tgz (at most 8 files
# come back from the device), and the step summaries go to stdout.
set -o pipefail
export PYTHONPATH=$PWD FLASHGEN_HOME=/tmp/flashgen PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/decode}
mkdir -p "$OUT"
R=$(mktemp -d /tmp/dec3.XXXXXX)
start=$(date +%s)
pack() { tar czf "$OUT/dec3_results.tgz" -C "$R" . && echo "packed $(ls "$R" | wc -l) files into $OUT/dec3_results.tgz"; }
trap pack EXIT
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  git log -1 --format='commit %H %s' 2>/dev/null || echo "commit: (no git) $(git rev-parse HEAD 2>/dev/null)"
  python3 -c "import torch; from flashgen.codegen.compiler import nvrtc_version; print('nvrtc', nvrtc_version(), 'torch', torch.__version__)"
} 2>&1 | tee "$R/env.txt"

echo "== (0) compile the default decode specs =="
timeout ${DEC_COMPILE_TIMEOUT:-60} python3 - <<'EOF' 2>&1 | tee "$R/compile.log" | tail -8
import time
from concurrent.futures import ThreadPoolExecutor
import torch
from flashgen import decoding
from flashgen.api import _Device
from flashgen.codegen import build
t0 = time.time()
dev = _Device.of(torch.cuda.current_device())
specs = decoding.default_specs(dev.arch, dev.smem_budget)
with ThreadPoolExecutor(8) as ex:
    for s, b in zip(specs, ex.map(build, specs)):
        r = b.report
        print(f"{s.name}: {r.registers} registers, spills {r.spill_stores}/{r.spill_loads}", flush=True)
print(f"compiled {len(specs)} specs in {time.time() - t0:.0f} s")
EOF
echo "(0) rc=$? at $(( $(date +%s) - start )) s"

echo "== (a) GPU tests =="
timeout ${DEC_TESTS_TIMEOUT:-60} python3 -m pytest -q --noconftest -m gpu tests/test_gpu_decode.py -rf --durations=8 \
  --junitxml="$R/gpu_decode_tests.xml" 2>&1 | tee "$R/gpu_decode_tests.log" | tail -30
echo "(a) rc=$? at $(( $(date +%s) - start )) s"

echo "== (b) bench =="
timeout ${DEC_BENCH_TIMEOUT:-150} python3 bench/bench_decode.py --out "$R/decode_h200.json" 2>&1 \
  | tee "$R/bench_decode.log" | tail -26
echo "(b) rc=$? at $(( $(date +%s) - start )) s"

echo "== (c) short sweep =="
timeout ${DEC_SWEEP_TIMEOUT:-120} python3 bench/sweep_decode.py --short --budget ${DEC_SWEEP_BUDGET:-100} \
  --out "$R/sweep_decode.json" 2>&1 | tee "$R/sweep_decode.log" | grep -v "^compiled \|^checked " | tail -70
echo "(c) rc=$? at $(( $(date +%s) - start )) s"
