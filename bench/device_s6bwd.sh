#!/usr/bin/env bash
# Session 6: bwd_sm90 with the consumer index broadcast from lane 0 (after) against the template before it
# (BEFORE=path, an untracked copy of the previous bwd_sm90.cuh sent with the tree), one H200 call (repo root):
#   git show de887c3:flashgen/templates/bwd_sm90.cuh > bench/bwd_sm90_before.cuh
#   OUT=... BEFORE=bench/bwd_sm90_before.cuh bash bench/device_s6bwd.sh            (<= 9 min)
# (1) (unless SUITE=0) the GPU suite on this tree (the re-tuned forward table and the new template);
# (2) bench_bwd.py (fwd+bwd, SDPA flash/cuDNN beside, --direct: the backward alone) on after and before
#     in turn, 3 rounds each (the template file swapped between processes; the cache key holds the source),
#     then per cell the medians and after/before. One tarball: $OUT/s6bwd.tgz.
. bench/device_lib.sh
device_setup s6bwd
[ "${SUITE:-1}" = 0 ] || OUT="$OUT" SUITE_TIMEOUT=${SUITE_TIMEOUT:-200} SMOKE_TIMEOUT=45 bash bench/device_suite.sh
T=flashgen/templates/bwd_sm90.cuh
cp "$T" "$W/after.cuh"; cp "$BEFORE" "$W/before.cuh"
for r in 1 2 3; do
  for side in after before; do
    cp "$W/$side.cuh" "$T"
    timeout ${BWD_TIMEOUT:-70} python3 bench/bench_bwd.py --d 64,128 \
      --seqlens 2048,4096,8192,16384 --impls flashgen,sdpa_cudnn --direct --reps 10 \
      --out "$W/bwd_${side}_$r.json" > "$W/bwd_${side}_$r.log" 2>&1
    echo "$side round $r rc=$?"
  done
  pack
done
cp "$W/after.cuh" "$T"
python3 - "$W" <<'PY' | tee "$W/ab.txt"
import json, statistics as st, sys, glob, os
w = sys.argv[1]
runs = {s: [json.load(open(p))["rows"] for p in sorted(glob.glob(os.path.join(w, f"bwd_{s}_*.json")))]
        for s in ("after", "before")}
def med(side, i, get):
    vals = []
    for rows in runs[side]:
        try:
            vals.append(get(rows[i]))
        except (KeyError, IndexError):
            pass
    return st.median(vals) if vals else float("nan")
bwd = lambda r: r["direct"]["bwd_sm90"]["bwd_tflops"]
fb = lambda r: r["flashgen"]["tflops"]
cu = lambda r: r["sdpa_cudnn"]["tflops"]
print(f"{'d':>4} {'causal':>6} {'N':>6} | bwd alone after before  a/b | fwd+bwd after before cudnn  a/cudnn b/cudnn")
for i, r in enumerate(runs["after"][0]):
    a, b = med("after", i, bwd), med("before", i, bwd)
    fa, fbb = med("after", i, fb), med("before", i, fb)
    c = st.median([med("after", i, cu), med("before", i, cu)])
    print(f"{r['head_dim']:>4} {str(r['causal']):>6} {r['seqlen']:>6} | {a:16.1f} {b:6.1f} {a / b:5.3f} |"
          f" {fa:13.1f} {fbb:6.1f} {c:5.1f} {fa / c:8.3f} {fbb / c:7.3f}")
PY
pack; ls -la "$OUT"
