"""Re-rank a ``tune --validate-model`` report's candidates with the cost model as it is now, on a CPU.

    python3 scripts/model_regret_offline.py [REPORT]   (default docs/perf/h200/tuner_check.json)

REPORT: a ``validation.json`` (``--out`` of ``tune --validate-model``) or ``scripts/tuner_check.py``'s
summary file (its key ``validate``). Per key the seeded candidate sample is drawn again
(``validation.sample``; the report's ``samples_per_key`` and ``seed``), each candidate estimated with the
registers ptxas reports (a setmaxnreg kernel: the launch bound's share; others: ``expected_registers``),
and the model's pick compared with the report. The report holds only the pick's and the best's confirmed
times, so a new pick that is neither has an unknown regret. Prints one line per key and, when every
regret is known, their geometric mean and worst. Reports of forward keys only.
"""
from __future__ import annotations

import json
import math
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from flashgen import families, gpus  # noqa: E402
from flashgen.problem import ProblemKey  # noqa: E402
from flashgen.tuner import cost, objective, space, validation  # noqa: E402
from flashgen.tuner.autotune import expected_registers  # noqa: E402


def registers(spec) -> int:
    regs = getattr(families.family(spec.kind), "regs", None)
    if regs is not None and regs(spec)[1]:
        return min(255, 65536 // (spec.warps * 32) // 8 * 8)
    return expected_registers(spec)


def parse_key(name: str) -> ProblemKey:
    kind, arch, dtype, d, mask, n = name.split("-")[:6]
    return ProblemKey(kind, arch, dtype, int(d[1:]), mask == "causal", int(n[1:]))


def main(path: str) -> int:
    doc = json.load(open(path))
    doc = doc.get("validate", doc)
    profile = gpus.get(doc["gpu"])
    logs, unknown = [], 0
    for row in doc["keys"]:
        if row.get("status") != "ok":
            continue
        key = parse_key(row["key"])
        sample = validation.sample(key, space.candidates(key, profile), doc["samples_per_key"], doc["seed"])
        shape = objective.model_shape(key)
        order = sorted((e, i, s.name) for i, s in enumerate(sample)
                       if math.isfinite(e := cost.estimate(s, shape, profile, registers(s))))
        names = [nm for _, _, nm in order]
        pick = names[0]
        times = {row["model_pick"]: row["model_pick_ms"], row["best"]: row["best_ms"]}
        regret = times[pick] / row["best_ms"] if pick in times else None
        rank = 1 + names.index(row["best"]) if row["best"] in names else None
        print(f"{row['key']:40s} regret {row['regret']:.3f} -> {'%.3f' % regret if regret else 'unknown'}  "
              f"rank of the best {row['model_rank_of_best']} -> {rank}  pick {pick}")
        if regret is None:
            unknown += 1
        else:
            logs.append(math.log(regret))
    if logs and not unknown:
        print(f"geometric mean {math.exp(sum(logs) / len(logs)):.3f}, worst {math.exp(max(logs)):.3f}")
    else:
        print(f"{unknown} keys with a pick whose time the report does not hold")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "docs/perf/h200/tuner_check.json")))
