"""Ship a table tuned on the device: keep only specs this machine's NVRTC accepts.

    python3 bench/ship_table.py DEVICE.yaml [--into flashgen/generated/h200.yaml] [--jobs N] [--ab AB.json ...]

The device compiles with its NVRTC (13.0 on the H200 so far), CI and pip users with theirs (13.5):
a backward tile at the 255-register cliff can be spill-free on one and spill on the other
(bench/NOTES.md). This compiles every entry's spec here (``dispatch.resource_problems``: spills,
stack frame, registers), swaps a refused winner for its fastest clean runner-up
(``store.without_refused``), prints each change, and writes the table (default: over the shipped
table of its GPU). No GPU needed; the compile tier (tests/test_compile.py) then checks the same.
``--ab`` (bench/ab_fwd.py's ab.json, bf16 forward cells) first gives each cell's key to the best of the
A/B's ranking that is the tuner's winner or one of its recorded runners-up (``store.with_preferred``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen import dispatch  # noqa: E402
from flashgen.tuner import run, store  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="the tuned YAML from the device run")
    ap.add_argument("--into", default=None, help="where to write (default: flashgen/generated/<gpu>.yaml)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--ab", action="append", default=[], help="ab.json of bench/ab_fwd.py: its winners preferred")
    args = ap.parse_args(argv)
    table = store.load(args.table)
    for path in args.ab:
        with open(path) as fh:
            cells = json.load(fh)["cells"]
        arch = table.meta["arch"]
        prefer = {dispatch.ProblemKey("fwd", arch, "bf16", dispatch.head_dim_tile(c["head_dim"]), c["causal"],
                                      dispatch.bucket_of(c["seqlen"])):
                  [c["specs"][f] for f in sorted(c["specs"], key=lambda f: -c["median_tflops"][f])] for c in cells}
        table, changes = store.with_preferred(table, prefer)
        for line in changes:
            print(line)
    run.precompile([e["spec"] for e in table.entries.values()], args.jobs, log=print)  # disk cache, in parallel
    shipped, changes = store.without_refused(table, dispatch.resource_problems)
    for line in changes:
        print(line)
    path = store.save(shipped, args.into or store.shipped_path(table.meta["gpu"]))
    print(f"wrote {path}: {len(shipped.entries)} of {len(table.entries)} entries, {len(changes)} changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
