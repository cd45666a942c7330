"""Session 8: compile every default decode_split spec from the base template (bench/exp_s8/variants/base_decode_split.cuh,
dcf335b's, made with git show) and from the working tree; print ptxas reports and where the SASS first differs.

    python3 bench/exp_s8/sass_diff.py [OUTDIR]
"""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from flashgen import decoding  # noqa: E402
from flashgen.codegen.compiler import compile_source  # noqa: E402
from flashgen.codegen.render import render  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from build_util import disassemblers  # noqa: E402  (PATH or pip's nvidia wheels, as the SASS tests)

NVDISASM = os.environ.get("NVDISASM") or next((t for t in disassemblers() if t.endswith("nvdisasm")), "nvdisasm")


def sass(cubin, path):
    path.write_bytes(cubin)
    out = subprocess.run([NVDISASM, "-c", str(path)], capture_output=True, text=True, check=True).stdout
    ins = []
    for line in out.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?);", line)
        if m:
            ins.append(re.sub(r"\s+", " ", m.group(1)).strip())
    return ins


def default_decode_split_specs():
    """Every decode_split spec the default rule can pick on sm_90a and sm_80 (both dtypes, every d)."""
    specs = []
    for arch in ("sm_90a", "sm_80"):
        for s in decoding.default_specs(arch, 227 * 1024 if arch == "sm_90a" else 163 * 1024):
            if s.kind == "decode_split" and s not in specs:
                specs.append(s)
    return specs


def main(outdir="/tmp/s8sass"):
    base = (ROOT / "bench/exp_s8/variants/base_decode_split.cuh").read_text()
    head = (ROOT / "flashgen/templates/decode_split.cuh").read_text()
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    for spec in default_decode_split_specs():
        src = render(spec)
        assert head in src
        base_src = src.replace(head, base)
        a = compile_source(base_src, spec.arch, spec.name)
        b = compile_source(src, spec.arch, spec.name)
        ia, ib = sass(a.cubin, out / "a.cubin"), sass(b.cubin, out / "b.cubin")
        first = next((i for i, (x, y) in enumerate(zip(ia, ib)) if x != y), min(len(ia), len(ib)))
        bars = [i for i, x in enumerate(ib) if x.startswith("BAR.SYNC")]
        print(f"{spec.name}: regs {a.report.registers}->{b.report.registers} spill {a.report.spill_stores}/"
              f"{b.report.spill_stores} ins {len(ia)}->{len(ib)} first diff at {first} "
              f"(HMMA before it: {sum(x.startswith('HMMA') for x in ib[:first])} of {sum(x.startswith('HMMA') for x in ib)})",
              flush=True)
        (out / f"{spec.name}.a.sass").write_text("\n".join(ia))
        (out / f"{spec.name}.b.sass").write_text("\n".join(ib))


if __name__ == "__main__":
    main(*sys.argv[1:])
