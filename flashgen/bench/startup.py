"""The ``startup`` suite: time to the first result of a new process, and where it goes.

Each run is a new Python process that imports torch and makes its inputs on the GPU first (the
program's own start, not flashgen's), then takes the time from ``import flashgen`` to the first
``flashgen.attention`` result (synchronized). Rows (``cache``, ``phase``):

- ``warm``: the kernel's binary is already in the disk cache (the same ``FLASHGEN_HOME`` as a run
  before); ``cold``: an empty ``FLASHGEN_HOME``, so the first call compiles its kernel;
- ``total`` is ``import flashgen`` plus the first call; ``first call`` the call alone; ``second call``
  the next one (a cached plan) for scale;
- ``parts`` (unless ``--no-parts``): the same steps one at a time in a process of their own, in the
  order the first call takes them: the package import, the torch layer's import, the device query,
  the tuned tables, the toolchain's version, the kernel's build (render, cache key, the cache read or
  the compile), the module load, and the call that is left (plan, launch, sync).

Each cell is the median over ``--runs`` processes (their values are kept). ``--package DIR`` imports
flashgen from DIR (a folder holding a ``flashgen`` package) instead of this one, to compare two
checkouts in one run. ``--max-warm`` and
``--max-cold`` (seconds): the suite fails (exit 1, after the table) when the warm or cold total's
median is above them, so a CI-like GPU job can keep the bound.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import settings
from . import options
from .registry import Suite, register
from .timing import meta, require_cuda

# The child programs. Inputs and torch's CUDA context come first, before t0: a model has them already.
_PRELUDE = """
import json, sys, time
import torch
b, h, n, d = {shape}
q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
torch.cuda.synchronize()
"""
_WHOLE = _PRELUDE + """
t0 = time.perf_counter()
import flashgen
t1 = time.perf_counter()
out = flashgen.attention(q, k, v, causal={causal})
torch.cuda.synchronize()
t2 = time.perf_counter()
out = flashgen.attention(q, k, v, causal={causal})
torch.cuda.synchronize()
t3 = time.perf_counter()
assert bool(torch.isfinite(out).all())
print(json.dumps({{"total": t2 - t0, "first call": t2 - t1, "second call": t3 - t2}}))
"""
_PARTS = _PRELUDE + """
times = {{}}
t = time.perf_counter()
def lap(name):
    global t
    now = time.perf_counter()
    times[name] = now - t
    t = now
import flashgen
lap("import flashgen")
import flashgen.api
lap("import torch layer")
from flashgen import dispatch, families, tables
from flashgen.api.device import Device
from flashgen.codegen import build, compiler, launch
from flashgen.problem import ProblemKey, bucket_of, head_dim_tile
dev = Device.of(torch.cuda.current_device())
lap("device")
key = ProblemKey("fwd", dev.arch, "bf16", head_dim_tile(d), {causal}, bucket_of(n))
tables.lookup(dev.gpu, key) if dev.gpu else None
lap("tables")
compiler.nvrtc_version()
lap("toolchain version")
spec = dispatch.select(key, dev.gpu, dev.smem_budget, verify=True)
build(spec)
lap("build")
launch.load_kernel(spec, dev.index)
lap("module load")
out = flashgen.attention(q, k, v, causal={causal})
torch.cuda.synchronize()
lap("call")
assert bool(torch.isfinite(out).all())
times["total"] = sum(times.values())
print(json.dumps(times))
"""


def add_args(p) -> None:
    p.add_argument("--runs", type=int, default=5, help="processes per cell; the median counts (default 5)")
    p.add_argument("--shape", default="2,16,1024,128", help="batch,heads,seqlen,d of the call (default 2,16,1024,128)")
    p.add_argument("--causal", action="store_true", help="a causal call")
    p.add_argument("--no-parts", action="store_true", help="leave out the step-by-step rows")
    p.add_argument("--package", default=None, help="import flashgen from this folder (default: this flashgen's)")
    p.add_argument("--max-warm", type=float, default=None, help="fail when the warm total's median exceeds this (s)")
    p.add_argument("--max-cold", type=float, default=None, help="fail when the cold total's median exceeds this (s)")


def parse(args) -> dict:
    options.positive(args.runs, "runs", integer=True)
    try:
        shape = tuple(int(x) for x in args.shape.split(","))
    except ValueError:
        raise ValueError(f"--shape must be batch,heads,seqlen,d integers, got {args.shape!r}") from None
    if len(shape) != 4 or min(shape) < 1 or shape[3] % 8 or shape[3] > 256:
        raise ValueError(f"--shape must be four positive integers with d a multiple of 8 up to 256, got {args.shape!r}")
    for name in ("max_warm", "max_cold"):
        value = getattr(args, name)
        if value is not None:
            options.positive(value, name.replace("_", "-"))
    package = os.path.abspath(args.package) if args.package else str(Path(__file__).resolve().parents[2])
    if not (Path(package) / "flashgen" / "__init__.py").is_file():
        raise ValueError(f"--package {package}: no flashgen package there")
    return {"runs": int(args.runs), "package": package, "shape": shape, "causal": bool(args.causal),
            "parts": not args.no_parts, "max_warm": args.max_warm, "max_cold": args.max_cold}


def _child(program: str, home: str, package: str) -> dict:
    env = settings.child_environment(FLASHGEN_HOME=home, PYTHONUNBUFFERED="1")
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as an installed package runs: with its modules' bytecode
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(home))  # not the caller's folder: PYTHONPATH picks the package
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cells(samples: list) -> dict:
    """{phase: {"s": median, "runs": [...]}} over the processes' timings."""
    out = {}
    for phase in samples[0]:
        values = [s[phase] for s in samples]
        out[phase] = {"s": statistics.median(values), "runs": [round(x, 4) for x in values]}
    return out


def run(args, progress) -> dict:
    settings = parse(args)
    require_cuda("startup")
    fill = {"shape": settings["shape"], "causal": settings["causal"]}
    whole, parts = _WHOLE.format(**fill), _PARTS.format(**fill)
    rows, samples = [], {}
    with tempfile.TemporaryDirectory(prefix="flashgen-startup-") as tmp:
        warm_home = os.path.join(tmp, "warm")
        _child(whole, warm_home, settings["package"])  # fills the warm home's kernel cache (and the bytecode)
        plans = [("warm", "whole", whole), ("cold", "whole", whole)]
        if settings["parts"]:
            plans += [("warm", "parts", parts), ("cold", "parts", parts)]
        for cache, kind, program in plans:
            got = []
            for i in range(settings["runs"]):
                home = warm_home if cache == "warm" else os.path.join(tmp, f"cold-{kind}-{i}")
                try:
                    got.append(_child(program, home, settings["package"]))
                except Exception as exc:  # noqa: BLE001 -- recorded, the suite goes on
                    rows.append({"cache": cache, "phase": f"{kind}: error", "results": {"first": {"error": str(exc)}}})
                    break
            if got:
                samples[(cache, kind)] = _cells(got)
                for phase, cell in samples[(cache, kind)].items():
                    label = phase if kind == "whole" else f"part: {phase}"
                    rows.append({"cache": cache, "phase": label, "results": {"first": cell}})
                progress(f"startup {cache} {kind}: " + ", ".join(f"{p} {c['s']:.3f}s"
                                                               for p, c in samples[(cache, kind)].items()))
    result = {"suite": "startup", "meta": meta(), "metric": "s", "precision": 3, "x": "phase", "panels": ["cache"],
              "impls": ["first"], "settings": {**settings, "shape": list(settings["shape"])}, "rows": rows,
              "convention": f"seconds from `import flashgen` to the first flashgen.attention result of a new "
                            f"process (inputs and torch's CUDA context made before), median of {settings['runs']} "
                            f"processes, with bytecode written by a first run; shape {settings['shape']}, bf16, causal={settings['causal']}"}
    failed = []
    for cache in ("warm", "cold"):
        bound = settings[f"max_{cache}"]
        total = samples.get((cache, "whole"), {}).get("total", {}).get("s")
        if bound is not None and (total is None or total > bound):
            failed.append(f"{cache} total {total if total is None else round(total, 3)} s > {bound} s")
    if failed:
        result["exit_status"] = 1
        result["notes"] = [f"over the bound: {'; '.join(failed)}"]
    return result


register(Suite("startup", "time to the first flashgen.attention result of a new process, warm and cold kernel "
                          "cache, and where it goes", add_args, run))
