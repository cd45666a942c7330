"""Session 9: the SASS of every default decode_split spec (sm_90a, sm_80) of the flashgen tree this script
is run from, one file per spec in OUTDIR, plus the ptxas report -- to compare two trees (e.g. a
`git worktree` of the last measured commit against the working tree) with diff.

    python3 bench/exp_s9/dump_sass.py OUTDIR [ROOT]
"""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(sys.argv[2]).resolve() if len(sys.argv) > 2 else Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from build_util import disassemblers  # noqa: E402

from flashgen import decoding  # noqa: E402
from flashgen.codegen.compiler import compile_source  # noqa: E402
from flashgen.codegen.render import render  # noqa: E402

NVDISASM = os.environ.get("NVDISASM") or next((t for t in disassemblers() if t.endswith("nvdisasm")), "nvdisasm")


def main(outdir):
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    specs = []
    for arch in ("sm_90a", "sm_80"):
        for s in decoding.default_specs(arch, 227 * 1024 if arch == "sm_90a" else 163 * 1024):
            if s.kind == "decode_split" and s not in specs:
                specs.append(s)
    for spec in specs:
        b = compile_source(render(spec), spec.arch, spec.name)
        (out / "x.cubin").write_bytes(b.cubin)
        text = subprocess.run([NVDISASM, "-c", str(out / "x.cubin")], capture_output=True, text=True, check=True).stdout
        ins = [re.sub(r"\s+", " ", m.group(1)).strip() for line in text.splitlines()
               if (m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?);", line))]
        (out / f"{spec.name}.sass").write_text("\n".join(ins) + "\n")
        print(f"{spec.name}: {b.report.registers} regs, spills {b.report.spill_stores}, {len(ins)} instructions", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
