"""The ``stalls`` suite: Nsight Compute's view of named attention kernels, where their time goes.

Each ``--kernels`` name (``KernelSpec.from_name``: a forward family, fwd_sm90 or fwd_v2, or the
backward's dK/dV kernel, bwd_sm90 or bwd_dkdv, run by ``api.backward.attention_backward`` with the
kernel forced, after a default forward; plain backward kernels only) runs in a child process under ``ncu`` (``--clock-control none``: the clocks as the benchmarks see them) on one
``--shape`` ``b,h,n,d`` (bhsd, self-attention; the kernel's own causal flag and dtype; FP8 kernels on
inputs quantized per (batch, head); a kernel with a window, softcap, ALiBi or sinks at the tuner's
values, ``variants.tuning_kwargs``; a forward kernel with user mods called with the functions of the
``--mods`` case of ``flashgen bench mods``, built at that shape, whose token must be the kernel's);
ncu profiles one launch after ``--skip`` warm-up calls, with the
sections of ``--sections``. Per kernel the table gives the duration, the issue slots' busy share, the
pipes' utilization ncu reports (the tensor pipe, the FMA and ALU pipes, XU: MUFU) and the warp stall
reasons, as cycles per issued instruction, the largest first. Every ncu CSV is kept beside the JSON
(``OUT/stalls/<kernel>.csv``): the table is a digest of it. Needs the GPU host's ncu (``--ncu``);
gVisor machines have no hardware counters (the device notes say which runtime has them).

``--source`` adds a second profile of the same launch with ncu's warp sampling per SASS instruction
(``SourceCounters``), kept as ``OUT/stalls/<kernel>.source.csv`` (``--page source``) and digested per
loop: instructions grouped by how often they executed (a loop body's instructions all run the same
number of times), and for the groups holding the most samples, each opcode's share of the group's
samples and its main stall reason. That is where a warp's time goes inside its main loop: the
softmax's exp2s, the row max, the GEMM issue and waits, the barrier waits (docs/perf/fp8.md used it).
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
from ..variants import spec_key, tuning_kwargs
from . import options
from .mods import Case, case_mods, case_token
from .registry import Suite, register
from .timing import error_text, meta

SECTIONS = "SpeedOfLight,SchedulerStats,WarpStateStats,ComputeWorkloadAnalysis"
FORWARD_KINDS = ("fwd_sm90", "fwd_v2")
BACKWARD_KINDS = ("bwd_sm90", "bwd_dkdv")  # the dK/dV kernel ("bwd_dkdv" in attention_backward's specs)
# Raw metric names -> table columns: a stall reason's cycles per issued instruction (the name ncu's
# WarpStateStats section computes from), a pipe's busy share, and the two headline figures.
_STALL = re.compile(r"^smsp__average_warps?_(?:latency_)?issue_stalled_([a-z_]+?)(?:_per_issue_active)?\.ratio$")
_PIPE = re.compile(r"^sm__(?:inst_executed_)?pipe_([a-z0-9_]+?)(?:_cycles_active)?\.avg\.pct_of_peak_sustained_active$")
_FIXED = {"gpu__time_duration.sum": "duration", "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_pct",
          "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct"}
_TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}


def add_args(p) -> None:
    p.add_argument("--kernels", required=True, help="forward or dK/dV kernels to profile (full names, comma-separated)")
    p.add_argument("--shape", default="2,16,8192,128", help="b,h,n,d (default 2,16,8192,128)")
    p.add_argument("--skip", type=int, default=2, help="warm-up calls before the profiled one (default 2)")
    p.add_argument("--sections", default=SECTIONS, help=f"ncu sections (default {SECTIONS})")
    p.add_argument("--ncu", default="ncu", help="the ncu executable (default: ncu on PATH)")
    p.add_argument("--top", type=int, default=8, help="stall reasons in the table, the largest first (default 8)")
    p.add_argument("--mods", default=None, metavar="CASE",
                   help="the score_mod / mask_mod of the mod kernels in --kernels: a case of flashgen bench mods "
                        "(causal, alibi, softcap, window, document, relative), built at --shape (that suite's "
                        "JSON names its kernels)")
    p.add_argument("--source", action="store_true",
                   help="also sample stalls per SASS instruction (a second ncu run) and digest the hottest loops")


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
        if spec.kind not in FORWARD_KINDS + BACKWARD_KINDS:
            raise ValueError(f"--kernels {name!r}: a {spec.kind} kernel; this suite profiles the forward "
                             f"({', '.join(FORWARD_KINDS)}) and the backward's dK/dV kernel "
                             f"({', '.join(BACKWARD_KINDS)})")
        if spec.kind in BACKWARD_KINDS and (spec_key(spec) or getattr(spec, "mod", "")):
            raise ValueError(f"--kernels {name!r}: backward kernels are profiled plain (no variant, mod or fp8)")
        if getattr(spec, "varlen", False):
            raise ValueError(f"--kernels {name!r}: packed rows need their own inputs; this suite runs dense "
                             "(b, h, n, d) calls (with a kernel's window, softcap, ALiBi, sinks or --mods)")
        if getattr(spec, "mod", 0) and getattr(args, "mods", None) is None:
            raise ValueError(f"--kernels {name!r}: a kernel with user mods; --mods CASE names their functions "
                             "(a flashgen bench mods case)")
        specs.append(spec)
    shape = options.ints(args.shape, "shape")
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(f"--shape {args.shape!r}: b,h,n,d, positive integers")
    case = getattr(args, "mods", None)
    if case is not None:
        token = case_token(case, shape[0], shape[1], shape[2])
        for spec in specs:
            if spec.mod and spec.mod != token:
                raise ValueError(f"--kernels {spec.name}: its mods (token {spec.mod}) are not --mods {case}'s at "
                                 f"--shape {args.shape} (token {token})")
    for spec in specs:
        if spec.head_dim < shape[3]:
            raise ValueError(f"--kernels {spec.name}: head-dim tile {spec.head_dim} < d = {shape[3]}")
    if args.skip < 0 or args.top < 1:
        raise ValueError("--skip must be >= 0 and --top >= 1")
    sections = [s.strip() for s in str(args.sections).split(",") if s.strip()]
    if not sections or not all(re.fullmatch(r"[A-Za-z]+", s) for s in sections):
        raise ValueError(f"--sections {args.sections!r}: ncu section names, comma-separated")
    return {"specs": specs, "shape": shape, "skip": args.skip, "sections": sections, "ncu": args.ncu,
            "top": args.top, "source": bool(getattr(args, "source", False)), "mods": case}


def ncu_command(settings: dict, spec: KernelSpec, report: Path | None = None) -> list[str]:
    """The ncu command line that profiles launch ``skip`` of ``spec`` in a child ``launch``: the raw page
    as CSV on stdout, or with ``report`` the per-instruction sampling (SourceCounters) saved as
    ``report``.ncu-rep."""
    cmd = [settings["ncu"], "--clock-control", "none"]
    cmd += ["--csv", "--page", "raw"] if report is None else ["-f", "-o", str(report)]
    cmd += ["-k", f"regex:^{re.escape(spec.name)}$", "--launch-skip", str(settings["skip"]), "--launch-count", "1"]
    for section in (settings["sections"] if report is None else ["SourceCounters", "WarpStateStats"]):
        cmd += ["--section", section]
    b, h, n, d = settings["shape"]
    return cmd + [sys.executable, "-m", "flashgen.bench.stalls", spec.name, f"{b},{h},{n},{d}",
                  str(settings["skip"] + 1)] + ([settings["mods"]] if spec.mod else [])


def source_command(settings: dict, report: Path) -> list[str]:
    """ncu reading a saved report's source page: one CSV row per SASS instruction."""
    return [settings["ncu"], "-i", str(report), "--page", "source", "--csv", "--print-source", "sass"]


_SAMPLES = "Warp Stall Sampling (All Samples)"
_EXECUTED = "Instructions Executed"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def source_digest(text: str, groups: int = 3, ops: int = 8) -> dict:
    """The hottest loops of ncu's ``--page source --csv`` output: instructions grouped by their execution
    count, the ``groups`` groups with the most samples, each with its instruction count, executions,
    share of all samples and its ``ops`` heaviest opcodes (share of the group's samples, main stall
    reason). ValueError when the text holds no per-instruction table."""
    rows = _csv_table(text, '"Address"', "no per-instruction table in ncu's source page")
    header, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    col = {name: i for i, name in enumerate(header)}
    if _SAMPLES not in col or _EXECUTED not in col or "Source" not in col:
        raise ValueError("ncu's source page lacks the sampling or execution columns")
    reasons = [n for n in header if n.startswith("stall_") and "(Not Issued)" not in n]
    total = sum(_number(r[col[_SAMPLES]]) for r in body)
    by_count: dict = {}
    for r in body:
        by_count.setdefault(int(_number(r[col[_EXECUTED]])), []).append(r)
    ranked = sorted(((sum(_number(r[col[_SAMPLES]]) for r in members), count, members)
                     for count, members in by_count.items() if count > 0), key=lambda g: -g[0])
    out = []
    for samples, count, members in ranked[:groups]:
        per_op: dict = {}
        for r in members:
            words = r[col["Source"]].split()
            op = (words[1] if words and words[0].startswith("@") and len(words) > 1 else (words or ["?"])[0])
            op = op.split(".")[0]
            entry = per_op.setdefault(op, {"op": op, "count": 0, "samples": 0.0, "reasons": {}})
            entry["count"] += 1
            entry["samples"] += _number(r[col[_SAMPLES]])
            for reason in reasons:
                entry["reasons"][reason[6:]] = entry["reasons"].get(reason[6:], 0.0) + _number(r[col[reason]])
        heavy = sorted(per_op.values(), key=lambda e: -e["samples"])[:ops]
        out.append({"instructions": len(members), "executions": count,
                    "share": round(100 * samples / total, 1) if total else 0.0,
                    "ops": [{"op": e["op"], "count": e["count"],
                             "share": round(100 * e["samples"] / samples, 1) if samples else 0.0,
                             "reason": max(e["reasons"], key=e["reasons"].get) if e["reasons"] else ""}
                            for e in heavy]})
    return {"samples": total, "groups": out}


def source_lines(name: str, digest_: dict) -> list[str]:
    """One note per group: the kernel, the group's size and share, its opcodes' shares and reasons."""
    return [f"{name}: {g['instructions']} instructions x {g['executions']} executions, {g['share']} % of the "
            f"samples: " + ", ".join(f"{o['op']} x{o['count']} {o['share']} % ({o['reason']})" for o in g["ops"])
            for g in digest_["groups"]]


def _csv_table(text: str, first: str, missing: str) -> list:
    """The rows of the CSV table in ncu's output (its log lines come first) from the line that starts with
    ``first`` (its header's first cell); ValueError(``missing``) when there is none."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(first)), None)
    if start is None:
        raise ValueError(missing)
    return list(csv.reader(io.StringIO("\n".join(lines[start:]))))


def digest(text: str) -> dict:
    """{column: number} from ncu's ``--csv --page raw`` output of one profiled launch: ``duration`` (us),
    ``issue_pct``, ``sm_pct``, ``pipe_<name>`` (per cent busy) and ``stall_<reason>`` (cycles per issued
    instruction). ValueError when the text holds no profiled launch."""
    rows = _csv_table(text, '"ID"', "no ncu CSV in the output (no kernel matched, or ncu could not profile)")
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
    rows, found, source_notes = [], {}, []
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
        if settings["source"]:
            try:
                row["source"] = profile_source(settings, spec, folder)
                source_notes += source_lines(spec.name, row["source"])
            except Exception as exc:  # noqa: BLE001 -- the raw figures stand without the per-instruction view
                row["source_error"] = error_text(exc, 400)
                source_notes.append(f"{spec.name}: no per-instruction view ({row['source_error']})")
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
            "rows": rows, "notes": [f"ncu CSVs: {folder}", *source_notes]}


def profile_source(settings: dict, spec: KernelSpec, folder: Path) -> dict:
    """The per-instruction sampling of ``spec``'s profiled launch: a saved report, its source page kept as
    ``<kernel>.source.csv`` and digested (``source_digest``)."""
    base = folder / spec.name  # ncu -o appends .ncu-rep
    report = folder / f"{spec.name}.ncu-rep"
    run_ = subprocess.run(ncu_command(settings, spec, report=base), capture_output=True, text=True, timeout=900)
    if run_.returncode != 0:
        raise RuntimeError(f"ncu exited {run_.returncode}: {(run_.stderr or run_.stdout).strip()[-300:]}")
    page = subprocess.run(source_command(settings, report), capture_output=True, text=True, timeout=300)
    (folder / f"{spec.name}.source.csv").write_text(page.stdout)
    if page.returncode != 0:
        raise RuntimeError(f"ncu -i exited {page.returncode}: {(page.stderr or page.stdout).strip()[-300:]}")
    report.unlink(missing_ok=True)  # the CSV holds what the digest reads; reports run to megabytes
    return source_digest(page.stdout)


def launch(name: str, shape: str, calls: int, case: str | None = None) -> None:
    """The child ncu profiles: ``calls`` calls of kernel ``name`` on fresh inputs of ``shape`` (a kernel with
    mods: with the functions of mods case ``case``)."""
    import torch

    from ..api.entry import attention
    from ..api.fp8 import quantize_fp8

    spec = KernelSpec.from_name(name)
    b, h, n, d = (int(x) for x in shape.split(","))
    dtype = torch.bfloat16 if spec.dtype == "bf16" else torch.float16
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
    if spec.kind in BACKWARD_KINDS:  # the default forward once, then the forced dK/dV kernel's backward
        from ..api.backward import attention_backward

        scale = d ** -0.5
        out, lse = attention(q, k, v, causal=spec.causal, softmax_scale=scale, return_lse=True)
        dout = torch.randn_like(out)
        for _ in range(calls):
            attention_backward(dout, q, k, v, out, lse, spec.causal, scale, specs={"bwd_dkdv": spec})
        torch.cuda.synchronize()
        return
    extra = {}
    if spec.mod:  # the case's functions at this shape (parse checked that their token is the kernel's)
        score_mod, mask_mod, _, _ = case_mods(Case(case, n, h, h, b), "cuda")
        extra = {k: f for k, f in (("score_mod", score_mod), ("mask_mod", mask_mod)) if f is not None}
        for _ in range(calls):
            attention(q, k, v, spec=spec, **extra)
        torch.cuda.synchronize()
        return
    if spec.fp8:
        (q, qd), (k, kd), (v, vd) = (quantize_fp8(t) for t in (q, k, v))
        extra = {"q_descale": qd, "k_descale": kd, "v_descale": vd, "out_dtype": dtype, "check_values": False}
    # the kernel's variant at the tuner's values (window 4096, softcap 50, geometric slopes, random sinks)
    extra.update(tuning_kwargs(spec_key(spec), spec.causal, n, h, "cuda"))
    for _ in range(calls):
        attention(q, k, v, causal=spec.causal, spec=spec, **extra)
    torch.cuda.synchronize()


if __name__ == "__main__":  # the child under ncu (``ncu_command``)
    try:
        launch(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
    except (UnsupportedError, ValueError, TypeError) as exc:
        print(f"stalls launch: {exc}", file=sys.stderr)
        sys.exit(2)
else:
    register(Suite("stalls", "Nsight Compute on named forward and dK/dV kernels: duration, issue slots, pipes and warp "
                             "stall reasons per kernel, per SASS instruction with --source (the GPU host's ncu)",
                   add_args, run))
