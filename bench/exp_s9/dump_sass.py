"""Session 9: the SASS of every default decode_split spec (sm_90a, sm_80) of the flashgen tree this script
is run from, one file per spec in OUTDIR, plus the ptxas report -- to compare two trees (e.g. a
`git worktree` of the last measured commit against the working tree) with diff.

    python3 bench/exp_s9/dump_sass.py OUTDIR [ROOT]
"""
import sys
from pathlib import Path

ROOT = Path(sys.argv[2]).resolve() if len(sys.argv) > 2 else Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from flashgen.codegen.compiler import compile_source  # noqa: E402  (ROOT's flashgen, imported first:
from flashgen.codegen.render import render  # noqa: E402     sass_diff puts this checkout on the path)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exp_s8"))
from sass_diff import default_decode_split_specs, sass  # noqa: E402  (specs, nvdisasm lookup, SASS lines)


def main(outdir):
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    for spec in default_decode_split_specs():
        b = compile_source(render(spec), spec.arch, spec.name)
        ins = sass(b.cubin, out / "x.cubin")
        (out / f"{spec.name}.sass").write_text("\n".join(ins) + "\n")
        print(f"{spec.name}: {b.report.registers} regs, spills {b.report.spill_stores}, {len(ins)} instructions", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
