"""Ship a table tuned on the device: keep only specs this machine's NVRTC accepts.

    python3 scripts/ship_table.py DEVICE.yaml [--into flashgen/generated/h200.yaml] [--jobs N] [--ab AB.json ...]

The device compiles with its NVRTC, CI and pip users with theirs: a tile at the 255-register cliff can
be spill-free under one version and spill under another (docs/perf/toolchain.md). This compiles every
entry's spec here (``dispatch.resource_problems``: spills, stack frame, registers), swaps a refused
winner for its fastest clean runner-up (``tuner.store.without_refused``), prints each change, and writes
the table (default: over the shipped table of its GPU). No GPU needed; the compile tier
(tests/test_compile.py) then checks the same. ``--ab`` (the JSON of ``flashgen bench ab --problem fwd``)
first gives each cell's key to the best of the A/B's ranking that is the tuner's winner or one of its
recorded runners-up (``tuner.store.with_preferred``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen import dispatch, families, tables  # noqa: E402
from flashgen.tuner import run, store  # noqa: E402


def ab_preferences(path, arch: str) -> dict:
    """{ProblemKey: kernel names, fastest first} from an ``ab`` result: per forward cell (bf16), its
    candidates' names by median TFLOP/s."""
    with open(path) as fh:
        result = json.load(fh)
    prefer = {}
    for row in result["rows"]:
        cells = {c: v for c, v in row["results"].items() if "tflops" in v and "spec" in v}
        key = families.problem_key("fwd", arch, "bf16", row["head_dim"], row["causal"], row["seqlen"])
        prefer[key] = [v["spec"] for _, v in sorted(cells.items(), key=lambda kv: -kv[1]["tflops"])]
    return prefer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="the tuned YAML from the device run")
    ap.add_argument("--into", default=None, help="where to write (default: flashgen/generated/<gpu>.yaml)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--ab", action="append", default=[], help="JSON of `flashgen bench ab`: its winners preferred")
    args = ap.parse_args(argv)
    table = tables.load(args.table)
    for path in args.ab:
        table, changes = store.with_preferred(table, ab_preferences(path, table.meta["arch"]))
        for line in changes:
            print(line)
    run.precompile([e["spec"] for e in table.entries.values()], args.jobs, log=print)  # disk cache, in parallel
    shipped, changes = store.without_refused(table, dispatch.resource_problems)
    for line in changes:
        print(line)
    path = tables.save(shipped, args.into or tables.shipped_path(table.meta["gpu"]))
    print(f"wrote {path}: {len(shipped.entries)} of {len(table.entries)} entries, {len(changes)} changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
