"""Session 9: the d=32 fp16 decode tile's ptxas report with this machine's NVRTC, several compiles each, for the
working tree's template and the variants in bench/exp_s8/variants (is a spill a property of the source or
of the compile?).

    python3 bench/exp_s9/spill_check.py
"""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from flashgen import decoding  # noqa: E402
from flashgen.codegen.compiler import compile_source, nvrtc_version  # noqa: E402
from flashgen.codegen.render import render  # noqa: E402

HEAD = (ROOT / "flashgen/templates/decode_split.cuh").read_text()
variants = {"head": HEAD}
for f in [] if os.environ.get("HEAD_ONLY") else sorted((ROOT / "bench/exp_s8/variants").glob("*_s9.cuh")):
    if f.stem not in ("base_s9", "ptr_s9"):
        continue
    variants[f.stem] = f.read_text()
print("nvrtc", nvrtc_version())
for arch in ("sm_90a",):
    for dtype in ("fp16", "bf16"):
        for d in (32, 64, 256):
            spec = decoding.default_split_spec(arch, dtype, d, 227 * 1024 if arch == "sm_90a" else 163 * 1024)
            src = render(spec)
            for name, text in variants.items():
                reps = [compile_source(src.replace(HEAD, text), spec.arch, spec.name).report for _ in range(1 if os.environ.get("HEAD_ONLY") else 2)]
                print(f"{spec.name:<58} {name:<10} " + "  ".join(f"{r.registers}r/{r.spill_stores}s" for r in reps), flush=True)
