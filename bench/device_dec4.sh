#!/usr/bin/env bash
# Decode round 4 (branch dec4), one device call on a fresh H200 box, from the repo root:
#   bash bench/device_dec4.sh
# (0) compile every default decode spec and the bulk-loader variants (hints 4, 5) of the three d=128
#     default tiles in parallel, so nothing compiles inside a timed or tested call (<= 40 s);
# (a) GPU tests of flashgen.decode, test_bulk_loader included (<= 80 s);
# (b) bench/bench_decode.py: the Done-when table, flashgen and SDPA flash/cuDNN interleaved over 5 rounds
#     (medians, spread, ratios of medians), paged vs contiguous, split scans, host overhead (<= 190 s);
# (c) bench/sweep_decode.py --loader: the default rule vs the same tiles with the bulk loader (h4, h5),
#     cuDNN interleaved, 12 cases + 4 paged, per-regime verdict and the decoding.py line (<= 140 s).
# Each step has its own timeout and runs whether or not the previous one failed; worst case 7.5 min.
# Everything lands in ONE tarball, $OUT/dec4_results.tgz (8 files), and the summaries go to stdout.
set -o pipefail
export PYTHONPATH=$PWD FLASHGEN_HOME=/tmp/flashgen PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/decode}
mkdir -p "$OUT"
R=$(mktemp -d /tmp/dec4.XXXXXX)
start=$(date +%s)
pack() { tar czf "$OUT/dec4_results.tgz" -C "$R" . && echo "packed $(ls "$R" | wc -l) files into $OUT/dec4_results.tgz"; }
trap pack EXIT
stamp() { echo "$1 rc=$2 at $(( $(date +%s) - start )) s" | tee -a "$R/env.txt"; }
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  echo "commit ${FLASHGEN_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  python3 -c "import torch; from flashgen.codegen.compiler import nvrtc_version; print('nvrtc', nvrtc_version(), 'torch', torch.__version__)"
} 2>&1 | tee "$R/env.txt"

echo "== (0) compile the default decode specs and the bulk variants =="
timeout ${DEC_COMPILE_TIMEOUT:-40} python3 - <<'PY' 2>&1 | tee "$R/compile.log" | tail -12
import time
from concurrent.futures import ThreadPoolExecutor
import torch
from flashgen import decoding
from flashgen.api import _Device
from flashgen.codegen import build
t0 = time.time()
dev = _Device.of(torch.cuda.current_device())
specs = decoding.default_specs(dev.arch, dev.smem_budget)
if dev.arch == "sm_90a":
    tiles = {decoding.default_split_spec(dev.arch, dt, 128, dev.smem_budget, r) for dt in ("bf16", "fp16")
             for r in decoding.REGIMES}
    specs += [t.replace(hint=h).validate() for t in sorted(tiles, key=lambda s: s.name) for h in (4, 5)]
bad = 0
with ThreadPoolExecutor(8) as ex:
    for s, b in zip(specs, ex.map(build, specs)):
        r = b.report
        bad += bool(r.problems())
        print(f"{s.name}: {r.registers} registers, spills {r.spill_stores}/{r.spill_loads}, smem {s.smem_bytes()} "
              f"{r.problems() or ''}", flush=True)
print(f"compiled {len(specs)} specs in {time.time() - t0:.0f} s, {bad} with problems")
PY
stamp "(0)" $?

echo "== (a) GPU tests =="
timeout ${DEC_TESTS_TIMEOUT:-80} python3 -m pytest -q --noconftest -m gpu tests/test_gpu_decode.py -rfs --durations=8 \
  --junitxml="$R/gpu_decode_tests.xml" 2>&1 | tee "$R/gpu_decode_tests.log" | tail -24
stamp "(a)" $?

echo "== (b) bench (interleaved rounds) =="
timeout ${DEC_BENCH_TIMEOUT:-190} python3 bench/bench_decode.py --out "$R/decode_h200.json" 2>&1 \
  | tee "$R/bench_decode.log" | tail -28
stamp "(b)" $?

echo "== (c) loader sweep: default vs bulk loader =="
timeout ${DEC_SWEEP_TIMEOUT:-140} python3 bench/sweep_decode.py --loader --budget ${DEC_SWEEP_BUDGET:-110} \
  --out "$R/sweep_loader.json" 2>&1 | tee "$R/sweep_loader.log" | tail -40
stamp "(c)" $?
