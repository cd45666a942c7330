"""Interleaved A/B of decode_split tiles and split counts on issue 4's cases, cuDNN in the same rounds.

    python3 bench/ab_decode.py --cands "default,n64w4s2h0@slots,n64w4s2h2@slots" [--rounds 7] [--out ab.json]

A candidate is ``default`` (flashgen.decode's own choice) or ``n<block_n>w<warps>s<stages>h<hint>`` with an
optional ``@<splits>``: a number, ``h`` (the split heuristic, also the default), ``slots`` (one full wave
of that tile's resident CTAs: SMs x CTAs per SM // (batch x KV heads), at least 1) or ``c<N>`` (about N CTAs:
N // (batch x KV heads), at least 1). Every forced tile is
first checked against the fp32 reference (sweep_decode.check_spec: the 2x rule, paged + appends, split and
not). Per case, all candidates and cuDNN are timed in the same interleaved rounds (bench_decode.interleaved:
inputs resident, order reversed every other round, medians of the rounds); the table gives TB/s and x cuDNN
per candidate, then per regime (decoding.decode_regime) the geometric mean and minimum of x cuDNN.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import interleaved, kv_bytes, summary  # noqa: E402
from bench_fwd import meta  # noqa: E402
from sweep_decode import CASES, Case, check_spec, dev_sms, geomean, spec_of  # noqa: E402

from flashgen import decoding  # noqa: E402
from flashgen.api import _Device  # noqa: E402
from flashgen.codegen import build  # noqa: E402

_CAND = re.compile(r"^n(\d+)w(\d+)s(\d+)h(\d+)(?:@(\d+|h|slots|c\d+))?$")


def parse(cand, arch):
    """(spec or None, splits word) of one candidate string."""
    if cand == "default":
        return None, "h"
    m = _CAND.match(cand)
    if not m:
        raise SystemExit(f"bad candidate {cand!r}: default or n<bn>w<w>s<st>h<hint>[@N|@h|@slots|@cN]")
    return spec_of(*(int(x) for x in m.groups()[:4]), arch), m.group(5) or "h"


def splits_for(spec, word, b, hk, sms, smem_sm):
    if word == "h":
        return None
    if word.startswith("c"):
        return max(1, int(word[1:]) // (b * hk))
    if word != "slots":
        return int(word)
    occ = decoding.ctas_per_sm(spec.smem_bytes(), spec.warps * 32, build(spec).report.registers or 255, smem_sm)
    return max(1, sms * occ // (b * hk))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cands", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default=None,
                    help='"b,hq,hk,L;..." (bhsd cache) instead of issue 4\'s twelve cases')
    args = ap.parse_args(argv)
    dev = _Device.of(0)
    import torch

    sms = dev_sms()
    smem_sm = torch.cuda.get_device_properties(0).shared_memory_per_multiprocessor
    cands = {c: parse(c, dev.arch) for c in args.cands.split(",") if c}
    checked = {}
    for name, (spec, _) in cands.items():
        if spec is not None:
            checked[name] = check_spec(spec) or "ok"
            print(f"checked {spec.name}: {checked[name]}", flush=True)
    result = {"meta": meta(), "rounds": args.rounds, "checked": checked, "cases": {}}
    cases = [c for c in CASES if c[4] == "bhsd"] if args.cases is None else [
        (*(int(x) for x in c.split(",")), "bhsd") for c in args.cases.split(";") if c]
    for c in sorted(cases, key=lambda c: kv_bytes(c[0], c[2], c[3])):
        b, hq, hk, L, _ = c
        case = Case(*c, time_cudnn=False)
        regime = decoding.decode_regime(b * hk * -(-(hq // hk) // decoding.ROWS), sms)
        fns, facts = {}, {}
        for name, (spec, word) in cands.items():
            if checked.get(name, "ok") != "ok":
                continue
            fns[name], facts[name] = case.fn(spec, splits_for(spec, word, b, hk, sms, smem_sm) if spec else None)
        fns["cudnn"], facts["cudnn"] = case.cudnn_run, {}
        row = result["cases"][case.key] = {"regime": regime, "kv_bytes": case.nbytes}
        for name, ts in interleaved(fns, case.copies, rounds=args.rounds).items():
            row[name] = {"error": ts} if isinstance(ts, str) else {**summary(ts, case.nbytes), **facts[name]}
        for name in fns:
            if name != "cudnn" and "us" in row[name] and "us" in row["cudnn"]:
                row[name]["x_cudnn"] = row["cudnn"]["us"] / row[name]["us"]
        print(f"{case.key:<26} [{regime:<4}] cudnn {row['cudnn'].get('tbps', float('nan')):.3f} | " + "  ".join(
            f"{n} {row[n].get('tbps', float('nan')):.3f} ({row[n].get('x_cudnn', float('nan')):.3f}x"
            f" s{row[n].get('splits', '?')} +-{row[n].get('spread_pct', float('nan')):.1f}%)"
            for n in fns if n != "cudnn"), flush=True)
        case.free()
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=1)
    print("\nx cuDNN per regime (geomean / min) and over all cases:")
    for regime in (*decoding.REGIMES, "all"):
        rows = [r for r in result["cases"].values() if regime in ("all", r["regime"])]
        if rows:
            print(f"  {regime:<5} " + "  ".join(
                f"{n} {geomean(xs):.3f}/{min(xs):.3f}" for n in cands
                for xs in [[r[n]["x_cudnn"] for r in rows if "x_cudnn" in r.get(n, {})]] if xs))


if __name__ == "__main__":
    main()
