#!/usr/bin/env bash
# bwd_sm90's first H200 call (repo root):   OUT=... bash bench/device_bwd90.sh
# (0) environment, precompile (parallel), the device NVRTC's ptxas report of every bwd_sm90 spec the
#     tests/bench use; (1) bench/smoke_bwd90.py: one small backward per subprocess,
#     CUDA_LAUNCH_BLOCKING=1, max error per gradient, diagnostics on failure; (2) the GPU tests of the
#     new family (tests/test_gpu_bwd.py -k bwd_sm90); (3) bench/bench_bwd.py at d 64/128, N 2k-16k,
#     causal both: flashgen (default backward), flashgen_bwd90, SDPA flash/cuDNN, fg90 (fwd_sm90 +
#     bwd_sm90) and the backward alone (default family, bwd_sm90, variants s2, s3, h1).
# Each step has its own timeout (45 + 70 + 90 + 80 s) and runs even when an earlier one failed: worst
# case under 5 minutes with start-up, expected ~3.
# ONE tarball: $OUT/bwd90.tgz with gpu.txt, smoke.log, tests.log, tests.xml, bench.log, bench.json
# (re-packed after every step, so a run cut short still brings back what it has).
set -o pipefail
export PYTHONPATH=$PWD FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/bwd90}
W=$(mktemp -d)
mkdir -p "$OUT"
pack() { tar -czf "$OUT/bwd90.tgz.tmp" -C "$W" . && mv "$OUT/bwd90.tgz.tmp" "$OUT/bwd90.tgz"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  echo "commit ${FLASHGEN_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; date -u
  python3 -c "import torch, cupy; from flashgen.codegen.compiler import nvrtc_version; print('torch', torch.__version__, 'cupy', cupy.__version__, 'nvrtc', nvrtc_version())"
} 2>&1 | tee "$W/gpu.txt"

echo "== (0) precompile + ptxas reports (device NVRTC)" | tee -a "$W/gpu.txt"
timeout ${PRE_TIMEOUT:-45} python3 - 2>&1 <<'PY' | tee -a "$W/gpu.txt"
import sys, time
from multiprocessing.pool import ThreadPool
sys.path.insert(0, "tests"); sys.path.insert(0, "bench")
from flashgen import dispatch
from flashgen.codegen import build
from test_bwd_sm90 import ALL
t0 = time.time()
extra = set()
for d in (64, 128):
    for causal in (False, True):
        for n in (2048, 4096, 8192, 16384):
            extra.add(dispatch.select(dispatch.ProblemKey("fwd", "sm_90a", "bf16", d, causal, n), "h200", 232448))
            extra.add(dispatch.select(dispatch.ProblemKey("bwd_dkdv", "sm_90a", "bf16", d, causal, n), "h200", 232448))
        extra.add(dispatch.default_spec(dispatch.ProblemKey("fwd_sm90", "sm_90a", "bf16", d, causal, 4096), 232448))
        for kind in ("bwd_preprocess", "bwd_convert"):
            extra.add(dispatch.default_spec(dispatch.ProblemKey(kind, "sm_90a", "bf16", d, False, 4096), 232448))
def one(s):
    try:
        r = build(s).report
        return s, f"regs {r.registers:3d} spill {r.spill_stores}/{r.spill_loads} stack {r.stack_frame} smem {r.static_smem}" + (
            f" PROBLEMS {r.problems()}" if r.problems() else "")
    except Exception as exc:  # noqa: BLE001
        return s, f"{type(exc).__name__}: {str(exc)[:300]}"
specs = sorted(set(ALL) | extra, key=lambda s: s.name)
with ThreadPool(16) as pool:
    res = pool.map(one, specs)
for s, line in res:
    if s.kind == "bwd_sm90" or "PROBLEMS" in line or "Error" in line:
        print(f"{s.name:58s} {line}")
print(f"precompiled {len(specs)} kernels in {time.time() - t0:.0f}s")
PY
pack

echo "== (1) smoke"
timeout ${SMOKE_TIMEOUT:-70} python3 bench/smoke_bwd90.py --jobs 4 --case-timeout 40 > "$W/smoke.log" 2>&1
echo "rc=$?" >> "$W/smoke.log"; grep -E "^(OK|FAIL)|smoke_bwd90|TIMEOUT|rc=" "$W/smoke.log" | tail -25
pack

echo "== (2) GPU tests, bwd_sm90"
timeout ${TESTS_TIMEOUT:-90} python3 -m pytest -q --noconftest -m gpu tests/test_gpu_bwd.py -k bwd_sm90 \
  --durations=5 --junitxml="$W/tests.xml" > "$W/tests.log" 2>&1
echo "rc=$?" >> "$W/tests.log"; tail -8 "$W/tests.log"
pack

echo "== (3) bench"
timeout ${BENCH_TIMEOUT:-80} python3 bench/bench_bwd.py --impls flashgen,flashgen_bwd90,sdpa_flash,sdpa_cudnn \
  --fwd90 --direct --variants s2,s3,h1 --d 64,128 --seqlens 2048,4096,8192,16384 --reps 8 --warmup 2 \
  --out "$W/bench.json" > "$W/bench.log" 2>&1
echo "rc=$?" >> "$W/bench.log"; tail -24 "$W/bench.log"
pack
ls -la "$OUT"
