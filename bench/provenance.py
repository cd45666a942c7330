"""Are the kernels a measurement ran the kernels this checkout runs? Compare two checkouts, no GPU.

    python3 bench/provenance.py list SPECS.json                 # in the newer checkout: the spec list
    python3 bench/provenance.py hash SPECS.json OUT.json [ROOT] # in each checkout (ROOT: its repo root)
    python3 bench/provenance.py compare OLD.json NEW.json

The list: every spec the shipped tables record (winners, baselines, runners-up), every default rule's
spec (forward, backward, baselines, decode; sm_80 and sm_90a) and bench_sm90's ablation flag sets.
``hash`` records the rendered source's SHA-256 of each spec this checkout can express (a later field at
its default is dropped) and, for the Hopper families, whose sources carry more than the spec decides,
the NVRTC cubin's (whole: flashgen/codegen/elf.py, this checkout's copy, also for older checkouts, whose
cache kept cubins one byte short). ``compare`` counts same/different per family.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import sys
from multiprocessing.pool import ThreadPool

CUBIN_KINDS = ("fwd_sm90", "bwd_sm90")


def list_specs(path):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_sm90
    from flashgen import decoding, dispatch, gpus
    from flashgen.baseline_specs import STANDARD_KINDS, V1_KIND
    from flashgen.tuner import store

    specs = set()
    for table in sorted(store.shipped_path("x").parent.glob("*.yaml")):
        for e in store.load(table, gpu=table.stem).entries.values():
            specs.update([e["spec"], e["baseline"]["spec"], *(r["spec"] for r in e.get("runners_up", []))])
    for arch in ("sm_80", "sm_90a"):
        budget = gpus.ARCH_SMEM_PER_BLOCK[arch]
        for kind in ("fwd", *dispatch.BWD_KINDS, *STANDARD_KINDS, V1_KIND):
            specs.update(dispatch.default_specs(arch, budget, kind))
        specs.update(decoding.default_specs(arch, budget))
    for d in (64, 128):
        for causal in (False, True):
            specs.update(bench_sm90.sm90_spec(d, causal, f) for f in bench_sm90.ablation_sets(d))
    out = [s.to_dict() for s in sorted(specs, key=lambda s: s.name)]
    with open(path, "w") as fh:
        json.dump(out, fh)
    print(len(out), "specs")


def _whole_elf():
    """whole_elf from this tool's own checkout, loaded by file path (an older ROOT may not have it)."""
    import importlib.util

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "flashgen", "codegen", "elf.py")
    spec = importlib.util.spec_from_file_location("_provenance_elf", here)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.whole_elf


def hash_specs(path, out_path, root):
    whole = _whole_elf()
    sys.path.insert(0, root)
    from flashgen.codegen import render
    from flashgen.codegen.compiler import compile_source
    from flashgen.spec import KernelSpec

    known = {f.name for f in dataclasses.fields(KernelSpec)}
    specs = []
    for d in json.load(open(path)):
        d = {k: v for k, v in d.items() if k in known or v}  # drop later fields at their default
        if set(d) <= known:
            specs.append(KernelSpec.from_dict(d))

    def one(s):
        src = render(s)
        r = {"src": hashlib.sha256(src.encode()).hexdigest()}
        if s.kind in CUBIN_KINDS:
            r["cubin"] = hashlib.sha256(whole(compile_source(src, s.arch, s.name).cubin)).hexdigest()
        return s.name, r

    os.environ.setdefault("CUDA_CACHE_DISABLE", "1")
    with ThreadPool(os.cpu_count() or 2) as pool:
        result = dict(pool.map(one, specs))
    with open(out_path, "w") as fh:
        json.dump(result, fh, indent=0)
    print(len(result), "specs hashed")


def compare(old_path, new_path):
    old, new = json.load(open(old_path)), json.load(open(new_path))
    counts, differ = collections.Counter(), []
    for name, a in old.items():
        b = new.get(name)
        if b is None:
            continue
        field = "cubin" if "cubin" in a else "src"
        family = next((k for k in CUBIN_KINDS if name.startswith(k)), name.split("_d")[0])
        same = a[field] == b.get(field)
        counts[f"{family} {field} {'same' if same else 'DIFFERENT'}"] += 1
        if not same:
            differ.append(name)
    summary = {"compared": sum(counts.values()), "counts": dict(sorted(counts.items())), "different": differ}
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "list":
        list_specs(sys.argv[2])
    elif cmd == "hash":
        hash_specs(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else ".")
    elif cmd == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
