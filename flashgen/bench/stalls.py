"""The ``stalls`` suite: Nsight Compute's view of named forward kernels, where their time goes.

Each ``--kernels`` name (``KernelSpec.from_name``, a forward family: fwd_sm90, fwd_v2) runs in a child
process under ``ncu`` (``--clock-control none``: the clocks as the benchmarks see them) on one
``--shape`` ``b,h,n,d`` (bhsd, self-attention; the kernel's own causal flag and dtype; FP8 kernels on
inputs quantized per (batch, head)); ncu profiles one launch after ``--skip`` warm-up calls, with the
sections of ``--sections``. Per kernel the table gives the duration, the issue slots' busy share, the
pipes' utilization ncu reports (the tensor pipe, the FMA and ALU pipes, XU: MUFU) and the warp stall
reasons, as cycles per issued instruction, the largest first. Every ncu CSV is kept beside the JSON
(``OUT/stalls/<kernel>.csv``): the table is a digest of it. Needs the GPU host's ncu (``--ncu``);
gVisor machines have no hardware counters (the device notes say which runtime has them).
"""
from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ..errors import UnsupportedError
from ..spec import KernelSpec
from . import options
from .registry import Suite, register
from .timing import error_text, meta

SECTIONS = "SpeedOfLight,SchedulerStats,WarpStateStats,ComputeWorkloadAnalysis"
FORWARD_KINDS = ("fwd_sm90", "fwd_v2")
# Raw metric names -> table columns: a stall reason's cycles per issued instruction (the name ncu's
# WarpStateStats section computes from), a pipe's busy share, and the two headline figures.
_STALL = re.compile(r"^smsp__average_warps?_(?:latency_)?issue_stalled_([a-z_]+?)(?:_per_issue_active)?\.ratio$")
_PIPE = re.compile(r"^sm__(?:inst_executed_)?pipe_([a-z0-9_]+?)(?:_cycles_active)?\.avg\.pct_of_peak_sustained_active$")
_FIXED = {"gpu__time_duration.sum": "duration", "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_pct",
          "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct"}
_TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}


def add_args(p) -> None:
    p.add_argument("--kernels", required=True, help="forward kernels to profile (full names, comma-separated)")
    p.add_argument("--shape", default="2,16,8192,128", help="b,h,n,d (default 2,16,8192,128)")
    p.add_argument("--skip", type=int, default=2, help="warm-up calls before the profiled one (default 2)")
    p.add_argument("--sections", default=SECTIONS, help=f"ncu sections (default {SECTIONS})")
    p.add_argument("--ncu", default="ncu", help="the ncu executable (default: ncu on PATH)")
    p.add_argument("--top", type=int, default=8, help="stall reasons in the table, the largest first (default 8)")


def parse(args) -> dict:
    names = [n.strip() for n in str(args.kernels).split(",") if n.strip()]
    if not names:
        raise ValueError("--kernels: name at least one kernel")
    specs = []
    for name in dict.fromkeys(names):
        try:
            spec = KernelSpec.from_name(name)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--kernels {name!r}: {exc}") from None
        if spec.kind not in FORWARD_KINDS:
            raise ValueError(f"--kernels {name!r}: a {spec.kind} kernel; this suite profiles the forward "
                             f"({', '.join(FORWARD_KINDS)})")
        specs.append(spec)
    shape = options.ints(args.shape, "shape")
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(f"--shape {args.shape!r}: b,h,n,d, positive integers")
    for spec in specs:
        if spec.head_dim < shape[3]:
            raise ValueError(f"--kernels {spec.name}: head-dim tile {spec.head_dim} < d = {shape[3]}")
    if args.skip < 0 or args.top < 1:
        raise ValueError("--skip must be >= 0 and --top >= 1")
    sections = [s.strip() for s in str(args.sections).split(",") if s.strip()]
    if not sections or not all(re.fullmatch(r"[A-Za-z]+", s) for s in sections):
        raise ValueError(f"--sections {args.sections!r}: ncu section names, comma-separated")
    return {"specs": specs, "shape": shape, "skip": args.skip, "sections": sections, "ncu": args.ncu,
            "top": args.top}


def ncu_command(settings: dict, spec: KernelSpec) -> list[str]:
    """The ncu command line that profiles launch ``skip`` of ``spec`` in a child ``launch``."""
    cmd = [settings["ncu"], "--clock-control", "none", "--csv", "--page", "raw",
           "-k", f"regex:^{re.escape(spec.name)}$", "--launch-skip", str(settings["skip"]), "--launch-count", "1"]
    for section in settings["sections"]:
        cmd += ["--section", section]
    b, h, n, d = settings["shape"]
    return cmd + [sys.executable, "-m", "flashgen.bench.stalls", spec.name, f"{b},{h},{n},{d}",
                  str(settings["skip"] + 1)]


def digest(text: str) -> dict:
    """{column: number} from ncu's ``--csv --page raw`` output of one profiled launch: ``duration`` (us),
    ``issue_pct``, ``sm_pct``, ``pipe_<name>`` (per cent busy) and ``stall_<reason>`` (cycles per issued
    instruction). ValueError when the text holds no profiled launch."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV in the output (no kernel matched, or ncu could not profile)")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, body = rows[0], rows[1:]
    units = body.pop(0) if body and body[0] and body[0][0] == "" else [""] * len(header)
    if not body:
        raise ValueError("the ncu CSV has no profiled launch")
    values = body[0]
    out: dict = {}
    for name, unit, value in zip(header, units, values):
        try:
            number = float(value.replace(",", ""))
        except ValueError:
            continue
        if name in _FIXED:
            column = _FIXED[name]
            if column == "duration":
                number *= _TO_US.get(unit.strip(), float("nan"))
            out[column] = number
        elif (m := _STALL.match(name)) is not None:
            out[f"stall_{m.group(1)}"] = number
        elif (m := _PIPE.match(name)) is not None:
            out[f"pipe_{m.group(1)}"] = number
    return out


def run(args, progress) -> dict:
    settings = parse(args)
    if shutil.which(settings["ncu"]) is None:
        raise ValueError(f"--ncu {settings['ncu']!r}: not found (Nsight Compute runs on the GPU host)")
    folder = Path(args.out) / "stalls"
    folder.mkdir(parents=True, exist_ok=True)
    rows, found = [], {}
    for spec in settings["specs"]:
        progress(f"ncu: {spec.name} on {','.join(map(str, settings['shape']))}")
        row = {"kernel": spec.name, "kind": spec.kind, "results": {}}
        try:
            run_ = subprocess.run(ncu_command(settings, spec), capture_output=True, text=True, timeout=900)
            kept = run_.stdout + ("\n# stderr\n" + run_.stderr if run_.stderr else "")
            (folder / f"{spec.name}.csv").write_text(kept)
            if run_.returncode != 0:
                raise RuntimeError(f"ncu exited {run_.returncode}: {(run_.stderr or run_.stdout).strip()[-300:]}")
            values = digest(run_.stdout)
        except FileNotFoundError:
            raise ValueError(f"--ncu {settings['ncu']!r}: not found (Nsight Compute runs on the GPU host)") from None
        except Exception as exc:  # noqa: BLE001 -- a kernel that could not be profiled is a row with its error
            row["error"] = error_text(exc, 400)
            rows.append(row)
            continue
        row["results"] = {k: {"value": v} for k, v in values.items()}
        for k, v in values.items():
            if k.startswith("stall_"):
                found[k] = max(found.get(k, 0.0), v)
        rows.append(row)
    top = sorted(found, key=found.get, reverse=True)[:settings["top"]]
    pipes = sorted({k for r in rows for k in r["results"] if k.startswith("pipe_")})
    columns = ["duration", "issue_pct", "sm_pct", *pipes, *top]
    for r in rows:
        r["results"] = {c: r["results"].get(c, {"skipped": "not reported"}) for c in columns} if "error" not in r \
            else {c: {"error": "ncu failed"} for c in columns}
    b, h, n, d = settings["shape"]
    return {"suite": "stalls", "meta": meta(), "metric": "value", "precision": 2, "x": "kernel", "panels": ["kind"],
            "impls": columns, "plot": False,
            "convention": f"ncu --clock-control none, one launch after {settings['skip']} warm-up calls, b={b} h={h} "
                          f"n={n} d={d}: duration (us), issue slots busy and SM throughput (% of peak), pipes busy "
                          "(%), stall reasons (cycles per issued instruction, the largest over the kernels)",
            "settings": {"shape": settings["shape"], "skip": settings["skip"], "sections": settings["sections"],
                         "kernels": [s.name for s in settings["specs"]]},
            "rows": rows, "notes": [f"ncu CSVs: {folder}"]}


def launch(name: str, shape: str, calls: int) -> None:
    """The child ncu profiles: ``calls`` calls of kernel ``name`` on fresh inputs of ``shape``."""
    import torch

    from ..api.entry import attention
    from ..api.fp8 import quantize_fp8

    spec = KernelSpec.from_name(name)
    b, h, n, d = (int(x) for x in shape.split(","))
    dtype = torch.bfloat16 if spec.dtype == "bf16" else torch.float16
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
    extra = {}
    if spec.fp8:
        (q, qd), (k, kd), (v, vd) = (quantize_fp8(t) for t in (q, k, v))
        extra = {"q_descale": qd, "k_descale": kd, "v_descale": vd, "out_dtype": dtype, "check_values": False}
    for _ in range(calls):
        attention(q, k, v, causal=spec.causal, spec=spec, **extra)
    torch.cuda.synchronize()


if __name__ == "__main__":  # the child under ncu (``ncu_command``)
    try:
        launch(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    except (UnsupportedError, ValueError, TypeError) as exc:
        print(f"stalls launch: {exc}", file=sys.stderr)
        sys.exit(2)
else:
    register(Suite("stalls", "Nsight Compute on named forward kernels: duration, issue slots, pipes and warp "
                             "stall reasons per kernel (the GPU host's ncu)", add_args, run))
