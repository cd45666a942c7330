"""Interleaved A/B of fwd_sm90 specs per cell, cuDNN beside: which of the tuner's close candidates wins.

    python bench/ab_fwd.py --out DIR --rounds 7 --cell 128,0,2048:full_s3_m192_n80_ps,ws_ov_s3 [--cell ...]

A cell is ``d,causal,N`` then the candidates as families.sm90_flag_set names, or ``default`` for the spec the
default path picks (the tuned table, $FLASHGEN_HOME/configs first) (hidden 2048: heads = 2048/d, batch =
16384/N, bf16). Every round times each candidate and cuDNN once, each round starting one impl
later; the medians of the rounds are reported. Writes DIR/ab.json; prints one line per cell.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402

from bench_fwd import sdpa_fn  # noqa: E402  (same folder)
from bench_sm90 import default_spec, fg, interleaved, sm90_spec  # noqa: E402


def parse_cell(text):
    head, names = text.split(":")
    d, causal, n = (int(x) for x in head.split(","))
    return d, bool(causal), n, names.split(",")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cell", action="append", required=True, help="d,causal,N:flagset,flagset,...")
    args = ap.parse_args(argv)
    rows = []
    for d, causal, n, names in map(parse_cell, args.cell):
        specs = {f: default_spec(d, causal, n) if f == "default" else sm90_spec(d, causal, f) for f in names}
        run = {f: fg(s) for f, s in specs.items()}
        run["sdpa_cudnn"] = lambda q, k, v, cz: sdpa_fn("sdpa_cudnn", q, k, v, cz)
        keys = list(run)
        row = interleaved(n, d, causal, run, args.rounds, reps=10)
        med = {k: row[k].get("tflops", float("nan")) for k in keys}
        cu = med["sdpa_cudnn"]
        best = max((k for k in keys if k != "sdpa_cudnn"), key=lambda k: med[k])
        rows.append({"head_dim": d, "causal": causal, "seqlen": n, "median_tflops": med,
                     "specs": {f: s.name for f, s in specs.items()}, "best": specs[best].name,
                     "rounds": {k: row[k].get("rounds_tflops") for k in keys}})
        print(f"d={d} causal={causal} N={n} cudnn={cu:.0f} | "
              + "  ".join(f"{k}={med[k]:.0f} ({med[k] / cu:.3f}x)" for k in keys if k != "sdpa_cudnn")
              + f"  -> {best}", flush=True)
        with open(os.path.join(args.out, "ab.json"), "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "rounds": args.rounds, "cells": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
