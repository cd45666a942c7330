#!/usr/bin/env bash
# Branch persist (fwd_sm90 persistent kernel), one H200 call from the repo root: OUT=... bash bench/device_persist.sh
# (1) compile the persist variants and the specs the timing uses (device NVRTC 13.0: registers, spills, C75xx), <= 25 s;
# (2) smoke: ws_ps, ws_ov_s3_ps (d=128 and 64), ws_s3_m192_ps (d=64), causal both (10 cases), one case per
#     process, CUDA_LAUNCH_BLOCKING=1, 30 s per case, FLASHGEN_PERSIST_CTAS=1 (one CTA walks every tile), <= 24 s;
# (3) pytest -m gpu tests/test_gpu_sm90.py -k ps (99 tests: odd sizes, one key/query, GQA, both layouts,
#     masked rows, empty keys, determinism, bitwise equal to persist=False; grid capped at 1/3/5 CTAs and uncapped), <= 35 s;
# (4) timing, d=128 and 64, N=2048 and 8192, causal both: the shipped default path vs the same spec with
#     persist, ws_ov_s3 (d=128) / ws_s3_m192 (d=64) with and without _ps, cuDNN (bench_sm90.py --persist), <= 30 s.
# Total <= 120 s. One tarball: $OUT/persist.tgz (rewritten after every step, so a timeout keeps the rest).
set -o pipefail
export PYTHONPATH=$PWD FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/persist}
W=$(mktemp -d)
mkdir -p "$OUT"
pack() { tar -czf "$OUT/persist.tgz" -C "$W" .; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  echo "commit ${FLASHGEN_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; date -u; } 2>&1 | tee "$W/gpu.txt"

echo "== (1) compile (device NVRTC)" | tee "$W/run.log"
timeout 25 python3 - 2>&1 <<'PY' | tee "$W/compile.txt" | tail -12
import sys, time
from multiprocessing.pool import ThreadPool
sys.path[:0] = ["tests", "bench"]
from flashgen.codegen import build
from flashgen.codegen.compiler import nvrtc_version
import bench_sm90, test_gpu_sm90
from flashgen.families import sm90_named_spec
specs = set(test_gpu_sm90.PERSIST_SPECS) | {sm90_named_spec(64, c, "ws_ov_s3_ps") for c in (False, True)}  # + smoke's
for d in (128, 64):
    for c in (False, True):
        for n in (2048, 8192):
            base = bench_sm90.default_spec(d, c, n)
            specs |= {base} | ({base.replace(persist=True)} if base.kind == "fwd_sm90" and base.warpspec else set())
        for f in bench_sm90.PERSIST_PAIRS[d]:
            specs |= {bench_sm90.sm90_spec(d, c, f), bench_sm90.sm90_spec(d, c, f + "_ps")}
def one(s):
    try:
        b = build(s)
        r = b.report
        warn = [c for c in ("C7508", "C7510", "C7511", "C7512", "C7513", "C7514", "C7515") if c in b.log]
        return (f"{s.name:82s} regs {r.registers:3d} spill {r.spill_stores}/{r.spill_loads} stack {r.stack_frame} "
                f"smem {s.smem_bytes()}+{r.static_smem} {warn or ''} {r.problems() or ''}")
    except Exception as exc:  # noqa: BLE001
        return f"{s.name:82s} FAILED {type(exc).__name__}: {str(exc)[:400]}"
t0 = time.time()
print("nvrtc", nvrtc_version(), "specs", len(specs), flush=True)
with ThreadPool(16) as pool:
    lines = pool.map(one, sorted(specs, key=lambda s: s.name))
print("\n".join(lines))
bad = [l for l in lines if "FAILED" in l or "spill 0/0" not in l or "C75" in l]
print(f"compiled {len(lines)} in {time.time() - t0:.0f}s; not clean: {len(bad)}")
print("\n".join(bad[:20]))
PY
pack

echo "== (2) smoke (one case per process, one CTA for every tile)" | tee -a "$W/run.log"
FLASHGEN_PERSIST_CTAS=1 CUDA_LAUNCH_BLOCKING=1 timeout 24 python3 bench/smoke_sm90.py --isolated \
    --flags ws_ps,ws_ov_s3_ps,ws_s3_m192_ps --dims 128,64 --bms 128 --jobs 6 --case-timeout 30 2>&1 \
  | tee "$W/smoke.txt" | grep -E "^(OK|FAIL|ERROR|smoke|compiled)|TIMEOUT|Error" | head -20
pack

echo "== (3) GPU tests -k ps" | tee -a "$W/run.log"
FLASHGEN_TEST_NO_PRECOMPILE=1 timeout 35 python3 -m pytest -q --noconftest -m gpu tests/test_gpu_sm90.py -k ps \
  -p no:cacheprovider -x 2>&1 | tee "$W/pytest.txt" | tail -15
pack

echo "== (4) timing: default vs persist, cuDNN" | tee -a "$W/run.log"
timeout 30 python3 bench/bench_sm90.py --out "$W" --persist --seqlens 2048,8192 --dims 128,64 2>&1 \
  | tee "$W/bench.txt" | grep -v "^precompiled"
pack
echo "done; $OUT/persist.tgz" | tee -a "$W/run.log"
pack
