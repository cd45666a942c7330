#!/usr/bin/env bash
# Branch sm90x (issue 7: fwd_sm90 at d=64), one H200 call from the repo root: OUT=... bash bench/device_sm90x.sh
# (1) compile every fwd_sm90 spec the steps below use with the device NVRTC (13.0): registers, spills, C75xx
#     per spec (the later steps hit the disk cache), <= 50 s;
# (2) smoke of the new flag sets (emu, sepkv, lazy, s3/s4, 192-row/192-key tiles) at d 64/128/256 x causal,
#     each case in its own process with CUDA_LAUNCH_BLOCKING=1, <= 70 s;
# (3) tests/test_gpu_sm90.py (663 tests: the fwd_v2 matrix per flag set, the new flags at d 64/128/256), <= 110 s;
# (4) bench/bench_sm90.py --quick: main table (d=128: ws_pp_kv_lz_s3, d=64: ws_pp_kv_lz_e1_s3_m192) and the
#     ablation of families.SM90_ABLATION at d 64/128, N=8k, causal both, beside cuDNN, <= 120 s.
# Worst case ~6 minutes. One tarball, $OUT/sm90x.tgz (rewritten after every step, so a timeout keeps the rest).
set -o pipefail
export PYTHONPATH=$PWD FLASHGEN_HOME=${FLASHGEN_HOME:-/tmp/flashgen} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/sm90x}
W=$(mktemp -d)
mkdir -p "$OUT"
pack() { tar -czf "$OUT/sm90x.tgz" -C "$W" .; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  echo "commit ${FLASHGEN_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; date -u; } 2>&1 | tee "$W/gpu.txt"

SMOKE_DEFAULT=ws_kv,ws_pp_kv,full_kv,ws_lz,ws_e1,ws_e2,ws_e4,plain_lz_e2,ws_pp_kv_lz_e1_s3,full_kv_lz_e2
SMOKE_DEFAULT=$SMOKE_DEFAULT,ws_pp_kv_lz_e1_s4,ws_pp_kv_lz_e1_s3_m192,full_kv_lz_e1_s3_m192,ws_pp_kv_lz_e1_s3_n192
export SMOKE_FLAGS=${SMOKE_FLAGS:-$SMOKE_DEFAULT}

echo "== (1) compile (device NVRTC)" | tee "$W/run.log"
timeout 50 python3 - 2>&1 <<'PY' | tee "$W/compile.txt" | tail -8
import os, sys, time
from multiprocessing.pool import ThreadPool
sys.path[:0] = ["tests", "bench"]
from flashgen.codegen import build
from flashgen.codegen.compiler import nvrtc_version
import bench_sm90, smoke_sm90, test_gpu_sm90
specs = set(test_gpu_sm90.ALL_SPECS)
specs |= {bench_sm90.sm90_spec(d, c, f) for d, c, _ in bench_sm90.ABLATION_CELLS[:4]
          for f in bench_sm90.ablation_sets(d)}
specs |= {bench_sm90.sm90_spec(d, c, f) for d, f in ((128, "ws_pp_kv_lz_s3"), (64, "ws_pp_kv_lz_e1_s3_m192"))
          for c in (False, True)}
specs |= {smoke_sm90.spec(d, c, f) for f in os.environ["SMOKE_FLAGS"].split(",") for d in (64, 128, 256)
          for c in (False, True) if smoke_sm90.runnable(d, c, f)}
def one(s):
    try:
        b = build(s)
        r = b.report
        warn = [c for c in ("C7508", "C7510", "C7511", "C7512", "C7513", "C7514", "C7515") if c in b.log]
        return (f"{s.name:82s} regs {r.registers:3d} spill {r.spill_stores}/{r.spill_loads} {warn or ''} "
                f"{r.problems() or ''}")
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

echo "== (2) smoke, new flag sets" | tee -a "$W/run.log"
CUDA_LAUNCH_BLOCKING=1 timeout 70 python3 bench/smoke_sm90.py --isolated --flags "$SMOKE_FLAGS" --dims 64,128,256 \
  --bms 128 --jobs 12 --case-timeout 40 > "$W/smoke.log" 2>&1
echo "smoke rc=$?" >> "$W/smoke.log"
grep -E "^FAIL|^smoke|^compiled|^== .*\(rc=[1-9]" "$W/smoke.log" | tail -30 | tee -a "$W/run.log"
pack

echo "== (3) tests/test_gpu_sm90.py" | tee -a "$W/run.log"
timeout 110 python3 -m pytest -q --noconftest -m gpu tests/test_gpu_sm90.py --maxfail=40 --durations=5 \
  --junitxml="$W/gpu_tests_sm90.xml" > "$W/gpu_tests_sm90.log" 2>&1
echo "rc=$?" >> "$W/gpu_tests_sm90.log"
grep -E "^FAILED|passed|failed|error" "$W/gpu_tests_sm90.log" | tail -25 | tee -a "$W/run.log"
pack

echo "== (4) bench_sm90 --quick" | tee -a "$W/run.log"
timeout 120 python3 bench/bench_sm90.py --quick --out "$W" --flags ws_pp_kv_lz_s3 --flags-d64 ws_pp_kv_lz_e1_s3_m192 \
  ${BENCH_ARGS:-} > "$W/bench_sm90.log" 2>&1
echo "bench rc=$?" >> "$W/bench_sm90.log"
tail -45 "$W/bench_sm90.log" | tee -a "$W/run.log"
pack
ls -la "$OUT"
