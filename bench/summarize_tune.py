"""Summarize tuning runs (``flashgen tune --report``) next to the forward benchmark of the same
device call: per key the tuned spec, its time, the paper-rule baseline, the gain, the cost
model's rank agreement, and per cell flashgen (tuned table) vs SDPA flash and cuDNN.

    python3 bench/summarize_tune.py --tune A.json [B.json ...] --bench fwd.json --out summary.json
"""
from __future__ import annotations

import argparse
import json
import statistics


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tune", nargs="+", required=True, help="tune --report JSON files")
    ap.add_argument("--bench", nargs="*", default=[], help="bench_fwd.py JSON files run right after tuning")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    keys, metas = [], []
    for path in args.tune:
        rep = json.load(open(path))
        metas.append({"file": path, "wall_s": rep["wall_s"], **rep["meta"]})
        for k in rep["keys"]:
            keys.append({f: k[f] for f in ("key", "mode", "candidates", "trials", "failures", "best", "best_ms",
                                           "baseline", "baseline_ms", "baseline_status", "speedup",
                                           "rank_agreement")})
    cells = []
    for path in args.bench:
        b = json.load(open(path))
        for r in b["rows"]:
            t = {n: r[n].get("tflops") for n in ("flashgen", "sdpa_flash", "sdpa_cudnn") if n in r}
            cells.append({"head_dim": r["head_dim"], "causal": r["causal"], "seqlen": r["seqlen"], "tflops": t,
                          "x_flash": t["flashgen"] / t["sdpa_flash"], "x_cudnn": t["flashgen"] / t["sdpa_cudnn"],
                          "bench_commit": b["meta"]["commit"]})
    gains = [k["speedup"] for k in keys if k["speedup"]]
    agree = [k["rank_agreement"] for k in keys if k.get("rank_agreement")]
    summary = {
        "runs": metas,
        "keys": keys,
        "cells": cells,
        "tuned_vs_baseline": {"keys": len(keys), "never_worse": all(g >= 1.0 for g in gains) and len(gains) == len(keys),
                              "median_gain": statistics.median(gains), "min_gain": min(gains), "max_gain": max(gains)},
        "cost_model": {"median_spearman": statistics.median(a["spearman"] for a in agree),
                       "min_spearman": min(a["spearman"] for a in agree),
                       "median_model_pick_slowdown": statistics.median(a["model_pick_slowdown"] for a in agree),
                       "max_model_pick_slowdown": max(a["model_pick_slowdown"] for a in agree)} if agree else None,
    }
    with open(args.out, "w") as fh:
        json.dump(summary, fh, indent=1)
    print(f"{'key':42s} {'best':46s} {'ms':>7s} {'base':>7s} {'gain':>5s} {'rho':>5s}")
    for k in keys:
        rho = f"{k['rank_agreement']['spearman']:.2f}" if k.get("rank_agreement") else "-"
        print(f"{k['key']:42s} {k['best']:46s} {k['best_ms']:7.3f} {k['baseline_ms'] or float('nan'):7.3f} "
              f"{k['speedup'] or float('nan'):5.2f} {rho:>5s}")
    print(json.dumps({n: summary[n] for n in ("tuned_vs_baseline", "cost_model")}, indent=1))
    for c in cells:
        print(f"d={c['head_dim']:>3} causal={str(c['causal']):5s} N={c['seqlen']:>5}: flashgen "
              f"{c['tflops']['flashgen']:.0f}, flash {c['tflops']['sdpa_flash']:.0f}, cudnn "
              f"{c['tflops']['sdpa_cudnn']:.0f} TFLOP/s -> x{c['x_flash']:.2f} flash, x{c['x_cudnn']:.2f} cudnn")


if __name__ == "__main__":
    main()
