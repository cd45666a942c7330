"""Compare the NVRTC cubins of the pickable specs before and after a template change.

    python3 bench/check_cubins.py save DIR      # before the change: cubins + ptxas reports into DIR
    python3 bench/check_cubins.py compare DIR   # after: recompile, print per spec same/different

The specs: every fwd_v2 spec the shipped tables (flashgen/generated/*.yaml, winners and the
measured baselines and runners-up they record) and the default rule (sm_80, sm_90a) can pick,
plus the default specs of fwd_v1, standard attention's passes, the backward kinds and decoding.
fwd_v2 must be byte-identical ("same"); for the other families an identical ptxas report
(registers, spills, stack, smem) is the floor, and the bytes are compared too. No GPU needed.
CHECK_KINDS=fwd_v2,fwd_v1 limits the run to those kinds.
"""
from __future__ import annotations

import json
import os
import sys
from multiprocessing.pool import ThreadPool
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flashgen import decoding, dispatch, gpus  # noqa: E402
from flashgen.baseline_specs import STANDARD_KINDS, V1_KIND  # noqa: E402
from flashgen.codegen.compiler import compile_source  # noqa: E402
from flashgen.codegen.render import render  # noqa: E402
from flashgen.tuner import store  # noqa: E402

ARCHES = ("sm_80", "sm_90a")


def specs() -> list:
    out = []
    for path in sorted((ROOT / "flashgen" / "generated").glob("*.yaml")):
        for e in store.load(path, gpu=path.stem).entries.values():
            out.append(e["spec"])
            if isinstance(e.get("baseline"), dict) and "spec" in e["baseline"]:
                out.append(e["baseline"]["spec"])
            out += [r["spec"] for r in e.get("runners_up") or ()]
    for arch in ARCHES:
        budget = gpus.ARCH_SMEM_PER_BLOCK[arch]
        out += dispatch.default_specs(arch, budget)
        for kind in (*STANDARD_KINDS, V1_KIND, *dispatch.BWD_KINDS):
            out += dispatch.default_specs(arch, budget, kind=kind)
        out += decoding.default_specs(arch, budget)
    # keep only real KernelSpecs (table entries may hold dicts for non-fwd records)
    seen, uniq = set(), []
    for s in out:
        if hasattr(s, "name") and s.name not in seen:
            seen.add(s.name)
            uniq.append(s)
    kinds = os.environ.get("CHECK_KINDS")  # e.g. CHECK_KINDS=fwd_v2,fwd_v1 for a quicker pass
    if kinds:
        uniq = [s for s in uniq if s.kind in kinds.split(",")]
    return sorted(uniq, key=lambda s: (s.kind, s.name))


def report_dict(b) -> dict:
    r = b.report
    return {"registers": r.registers, "spill_stores": r.spill_stores, "spill_loads": r.spill_loads,
            "stack_frame": r.stack_frame, "static_smem": r.static_smem, "warnings": list(r.warnings)}


def compile_all(todo):
    def one(s):
        return s, compile_source(render(s), s.arch, s.name)
    with ThreadPool(2) as pool:
        return pool.map(one, todo)


def main(argv) -> int:
    if len(argv) != 3 or argv[1] not in ("save", "compare"):
        print(__doc__)
        return 2
    mode, folder = argv[1], Path(argv[2])
    todo = specs()
    if mode == "save":
        folder.mkdir(parents=True, exist_ok=True)
        reports = {}
        for s, b in compile_all(todo):
            (folder / f"{s.name}.cubin").write_bytes(b.cubin)
            reports[s.name] = report_dict(b)
        (folder / "reports.json").write_text(json.dumps(reports, indent=1, sort_keys=True))
        print(f"saved {len(todo)} cubins to {folder}")
        return 0
    before = json.loads((folder / "reports.json").read_text())
    bad = 0
    tally: dict = {}
    for s, b in compile_all(todo):
        old = folder / f"{s.name}.cubin"
        if not old.exists():
            print(f"{s.kind:16s} {s.name}: NEW (no saved cubin)")
            continue
        same_bytes = old.read_bytes() == b.cubin
        same_report = before[s.name] == report_dict(b)
        verdict = "same" if same_bytes else ("different (ptxas report same)" if same_report
                                            else "different (ptxas report DIFFERS)")
        t = tally.setdefault(s.kind, {"same": 0, "different": 0, "report_differs": 0})
        t["same" if same_bytes else "different"] += 1
        t["report_differs"] += not same_report
        if (s.kind == "fwd_v2" and not same_bytes) or not same_report:
            bad += 1
        print(f"{s.kind:16s} {s.name}: {verdict}")
    print()
    for kind, t in sorted(tally.items()):
        print(f"{kind:16s} {t['same']} same, {t['different']} different cubins, "
              f"{t['report_differs']} ptxas reports differ")
    print("OK" if not bad else f"FAIL: {bad} specs break the criterion")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
