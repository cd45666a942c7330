"""``flashgen tune --validate-model``: how good the cost model's pick is, measured on the GPU.

Per key, a seeded sample of the feasible candidates (the baseline first, then ``--trials`` - 1 others
drawn with a seed that leaves out the bucket, so every bucket of one (head dim, causal, dtype) draws the
same specs and each compiles once) is run like an exhaustive tuning run: compiled, checked against the
reference, timed. Each clean compile also carries the cost model's estimate from its ptxas registers
(``objective.MeasuredObjective``: ``info['model_ms']``). Then:

- the **model's pick** is the candidate with the smallest estimate among those that compiled cleanly
  (what ``flashgen tune --model`` would write for this sample); the **measured best** the fastest passing
  one;
- the pick, the measured best and the next two are re-timed in interleaved rounds (``objective.confirm``),
  so the comparison is not one screening time against another's lucky one; **regret** = the pick's time /
  the fastest confirmed time (1.00: the model found the best);
- **Spearman's rho** between the estimates and the screening times of the passing candidates
  (``study.rank_agreement``), and the model's rank of the measured best.

The summary is the geometric mean and the worst regret over the keys, and the median rho. A pick that
failed the check or the launch is reported as such and counts as a failed key (no regret). The user's
table is not written; ``--out DIR`` gets ``validation.json`` and the measured winners as ``table.yaml``.
"""
from __future__ import annotations

import json
import math
import os
import random
import statistics
import sys

from .. import tables
from . import space, store, study


def sample(key, candidates: list, n: int, seed: int) -> list:
    """``candidates[0]`` (the baseline) and a seeded sample of ``n - 1`` of the others, in their order;
    all of them when there are no more than ``n``."""
    if len(candidates) <= n:
        return list(candidates)
    rng = random.Random(f"{seed}:{space.key_name(key.replace(bucket=0))}")  # the same draw for every bucket
    picked = sorted(rng.sample(range(1, len(candidates)), n - 1))
    return [candidates[0], *(candidates[i] for i in picked)]


def key_row(result, objective, rounds: int = 3) -> dict:
    """One key's figures (see the module notes); ``objective.confirm`` re-times the pick and the best."""
    row = {"key": space.key_name(result.key), "candidates": result.candidates, "trials": len(result.trials),
           "failures": result.failures()}
    modelled = [t for t in result.trials if "model_ms" in t.info and t.status in ("ok", "wrong", "launch_error")]
    ok = result.ok()
    if not ok or not modelled:
        row["status"] = "no passing candidate" if not ok else "no modelled candidate"
        return row
    pick = min(modelled, key=lambda t: (t.info["model_ms"], t.number))
    best = ok[0]
    row.update({"model_pick": pick.spec.name, "model_pick_ms_model": pick.info["model_ms"],
                "best": best.spec.name, "best_screen_ms": best.time_ms})
    if pick.status != "ok":
        row.update({"status": f"model pick {pick.status}", "reason": pick.reason})
        return row
    finalists = list(dict.fromkeys([pick.spec, *(t.spec for t in ok[:3])]))
    confirmed = objective.confirm(result.key, finalists, rounds)
    fastest = min(confirmed, key=confirmed.get)
    order = sorted(modelled, key=lambda t: (t.info["model_ms"], t.number))
    row.update({
        "status": "ok", "model_pick_ms": confirmed[pick.spec], "best_ms": confirmed[fastest],
        "best": fastest.name, "regret": confirmed[pick.spec] / confirmed[fastest],
        "model_rank_of_best": 1 + next(i for i, t in enumerate(order) if t.spec == fastest),
        "pick_screen_ms": pick.time_ms,
    })
    agree = study.rank_agreement(result)
    row["spearman"] = agree["spearman"] if agree else None
    return row


def summary(rows: list) -> dict:
    regrets = [r["regret"] for r in rows if r.get("status") == "ok"]
    rhos = [r["spearman"] for r in rows if r.get("spearman") is not None]
    out = {"keys": len(rows), "validated": len(regrets), "failed": len(rows) - len(regrets)}
    if regrets:
        out.update({"geomean_regret": math.exp(sum(map(math.log, regrets)) / len(regrets)),
                    "worst_regret": max(regrets),
                    "worst_key": max((r for r in rows if r.get("status") == "ok"), key=lambda r: r["regret"])["key"],
                    "picks_within_1pct": sum(1 for x in regrets if x <= 1.01)})
    if rhos:
        out.update({"median_spearman": statistics.median(rhos), "min_spearman": min(rhos)})
    return out


def print_rows(rows: list, total: dict, out=None) -> None:
    out = out or sys.stdout
    print(f"{'key':40s} {'model pick':44s} {'ms':>8s} {'best ms':>8s} {'regret':>7s} {'rho':>5s} {'rank':>5s}",
          file=out)
    for r in rows:
        if r.get("status") != "ok":
            print(f"{r['key']:40s} {str(r.get('model_pick', '-')):44s} {r['status']}", file=out)
            continue
        rho = f"{r['spearman']:.2f}" if r.get("spearman") is not None else "-"
        print(f"{r['key']:40s} {r['model_pick']:44s} {r['model_pick_ms']:8.3f} {r['best_ms']:8.3f} "
              f"{r['regret']:6.3f}x {rho:>5s} {r['model_rank_of_best']:>5d}", file=out)
    if "geomean_regret" in total:
        print(f"cost model over {total['validated']} keys: regret geometric mean {total['geomean_regret']:.3f}x, "
              f"worst {total['worst_regret']:.3f}x ({total['worst_key']}), pick within 1 % of the best on "
              f"{total['picks_within_1pct']}"
              + (f"; Spearman median {total['median_spearman']:.2f} (min {total['min_spearman']:.2f})"
                 if "median_spearman" in total else "")
              + (f"; {total['failed']} keys failed" if total["failed"] else ""), file=out)
    else:
        print(f"cost model: no key validated ({total['failed']} failed)", file=out)


def report(results, objective, args, profile, device: str, wall_s: float, log) -> int:
    """Print the validation of ``results`` (a measured run over sampled candidates) and, with ``--out``,
    write ``validation.json`` and ``table.yaml`` there. Exit status 0."""
    rows = [key_row(r, objective) for r in results]
    total = summary(rows)
    print_rows(rows, total)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        doc = {"command": ["flashgen", "tune", *getattr(args, "argv", [])], "gpu": profile.name, "device": device,
               "meta": tables.make_meta(profile, "measured", device), "samples_per_key": args.trials,
               "seed": args.seed, "wall_s": wall_s, "summary": total, "keys": rows}
        with open(os.path.join(args.out, "validation.json"), "w") as fh:
            json.dump(doc, fh, indent=1, default=str)
        table = tables.Table(meta=tables.make_meta(profile, "measured", device))
        for r in results:
            if r.best is not None:
                table.entries[r.key] = store.entry_from_result(r, "measured", objective.shapes.get(r.key))
        tables.save(table, os.path.join(args.out, "table.yaml"))
        log(f"wrote {os.path.join(args.out, 'validation.json')} and table.yaml")
    return 0
