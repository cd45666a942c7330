"""The ``sass`` suite (no GPU): what ptxas and the disassembler say about every kernel dispatch can pick.

The kernels: for each arch of ``--archs`` (sm_80, sm_90a) every spec a default rule can give
(``families.rule_specs(arch, gpus.ARCH_SMEM_PER_BLOCK[arch])``), and every spec the shipped tuned
tables record (``tables.load(tables.shipped_path(gpu), gpu=gpu)`` for each shipped GPU: the entries'
winners, their baselines and runners-up) -- or exactly the ``--kernels`` named. ``--filter GLOB``
keeps the names that match (fnmatch; several comma-separated globs: any).

Each is compiled (``flashgen.codegen.build``: NVRTC, disk-cached under FLASHGEN_HOME) and recorded per
kernel: the cubin's SHA-256, the ptxas report (registers, spill stores/loads, stack frame, static
shared memory, warnings) and, where a disassembler is found (cuobjdump or nvdisasm on PATH, or in
pip's nvidia/cu13/bin), the SASS instruction counts by opcode (HGMMA, HMMA, LDSM, LDGSTS, UTMALDG,
LDL/STL, ...). ``--dump`` also writes each kernel's SASS to ``OUT/sass/<kernel>.sass``.

``--compare DIR`` (or a JSON file) compares with an earlier run's ``sass.json``: per kernel
``same`` (identical cubin), ``different (report same)``, ``different (report differs: ...)`` or
``new``; kernels of the earlier run that are gone are listed in the notes. This is how a template
change is checked to leave the binaries (or at least their resources) alone: run once before the
change, once after with ``--compare``. ``--strict`` makes the command exit 1 when any cubin differs.

The result's "impls" are the report's columns (registers, spills, ...) and each cell is
``{"count": n}``: ``report.table`` prints it like any suite; it has no plot.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from multiprocessing.pool import ThreadPool
from pathlib import Path

from .. import families, gpus, tables
from ..codegen import build
from ..spec import ARCHS as ALL_ARCHS
from ..spec import KernelSpec
from . import options
from .registry import Suite, register
from .timing import error_text, meta

ARCHS = ("sm_80", "sm_90a")
REPORT_COLUMNS = ("regs", "spill", "stack", "smem")
SASS_COLUMNS = ("HGMMA", "HMMA", "LDSM", "LDGSTS", "UTMALDG", "LDL", "STL", "total")
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def add_args(p) -> None:
    p.add_argument("--archs", default=",".join(ARCHS), help=f"compile targets (default {','.join(ARCHS)})")
    p.add_argument("--kernels", default=None,
                   help="exactly these kernels (full names, comma-separated) instead of the rules' and tables' specs")
    p.add_argument("--filter", default=None, help="keep kernel names matching GLOB (comma-separated globs: any)")
    p.add_argument("--no-rules", action="store_true", help="leave out the default rules' specs")
    p.add_argument("--no-tables", action="store_true", help="leave out the shipped tables' specs")
    p.add_argument("--jobs", type=int, default=max(1, min(8, os.cpu_count() or 1)),
                   help="parallel compiles (default: CPUs, at most 8)")
    p.add_argument("--no-disassemble", action="store_true", help="ptxas reports only, no SASS counts")
    p.add_argument("--dump", action="store_true", help="also write each kernel's SASS to OUT/sass/<kernel>.sass")
    p.add_argument("--compare", default=None, metavar="DIR", help="an earlier run's folder (or its sass.json)")
    p.add_argument("--strict", action="store_true", help="with --compare: exit 1 when any cubin differs")


def parse(args) -> dict:
    archs = options.names(args.archs, ALL_ARCHS, "archs")
    options.positive(args.jobs, "jobs", integer=True)
    kernels = None
    if args.kernels is not None:
        kernels = []
        for name in (x.strip() for x in args.kernels.split(",")):
            if name:
                try:
                    kernels.append(KernelSpec.from_name(name))
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"--kernels: {exc}") from None
        if not kernels:
            raise ValueError("--kernels: give full kernel names, comma-separated")
    globs = [g.strip() for g in args.filter.split(",") if g.strip()] if args.filter else []
    old = None
    if args.compare:
        path = Path(args.compare)
        path = path / "sass.json" if path.is_dir() else path
        try:
            old = json.loads(path.read_text())
            if old.get("suite") != "sass":
                raise ValueError("not a sass result")
        except (OSError, ValueError, AttributeError) as exc:
            raise ValueError(f"--compare {args.compare}: cannot read an earlier sass result ({exc})") from None
    elif args.strict:
        raise ValueError("--strict needs --compare DIR")
    return {"archs": archs, "kernels": kernels, "globs": globs, "rules": not args.no_rules,
            "tables": not args.no_tables, "jobs": int(args.jobs), "disassemble": not args.no_disassemble,
            "dump": bool(args.dump), "compare": old, "compare_path": args.compare, "strict": bool(args.strict)}


def kernel_sources(archs, rules: bool = True, with_tables: bool = True) -> dict:
    """{spec: [where it comes from]} of every spec the default rules and shipped tables can pick."""
    out: dict = {}

    def add(spec, source):
        if hasattr(spec, "name") and spec.arch in archs:
            out.setdefault(spec, [])
            if source not in out[spec]:
                out[spec].append(source)

    if rules:
        for arch in archs:
            for spec in families.rule_specs(arch, gpus.ARCH_SMEM_PER_BLOCK[arch]):
                add(spec, f"rule {arch}")
    if with_tables:
        for gpu in tables.shipped_gpus():
            table = tables.load(tables.shipped_path(gpu), gpu=gpu)
            for entry in table.entries.values():
                add(entry["spec"], f"table {gpu}")
                if isinstance(entry.get("baseline"), dict):
                    add(entry["baseline"].get("spec"), f"table {gpu} baseline")
                for runner in entry.get("runners_up") or ():
                    add(runner.get("spec"), f"table {gpu} runner-up")
    return out


def disassemblers() -> list[str]:
    """nvdisasm / cuobjdump on PATH, or from pip's nvidia CUDA wheels (nvidia/cu13/bin). nvdisasm first:
    it reads a cubin by itself, where cuobjdump runs the nvdisasm it finds on PATH (pip's bin folder is
    not on it)."""
    found = [shutil.which("nvdisasm"), shutil.which("cuobjdump")]
    folders = [Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" /
               "site-packages" / "nvidia" / "cu13" / "bin"]
    try:
        import nvidia

        folders += [Path(p) / "cu13" / "bin" for p in nvidia.__path__]
    except Exception:  # noqa: BLE001 -- no pip CUDA wheels
        pass
    for folder in folders:
        found += [str(folder / "nvdisasm"), str(folder / "cuobjdump")]
    return list(dict.fromkeys(f for f in found if f and os.path.exists(f)))


def disassemble(cubin: bytes, tools) -> tuple[str, str | None]:
    """(SASS text, the tool that read it) of a cubin: the first of ``tools`` that reads it, else ("", None)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        for tool in tools:
            args = [tool, "--dump-sass", str(path)] if Path(tool).name.startswith("cuobjdump") else [tool, str(path)]
            try:
                out = subprocess.run(args, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if out.returncode == 0 and _INSTRUCTION.search(out.stdout):
                return out.stdout, Path(tool).name
    return "", None


def sass_counts(text: str) -> dict:
    """{opcode: count} of a SASS listing (the opcode without its modifiers: HGMMA.64x128x16.F32 is HGMMA;
    a predicate @P0 / @!UP1 is skipped), plus "total"."""
    counts: dict = {}
    for m in _INSTRUCTION.finditer(text):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    counts = dict(sorted(counts.items()))
    counts["total"] = sum(counts.values())
    return counts


def report_dict(binary) -> dict:
    r = binary.report
    return {"registers": r.registers, "spill_stores": r.spill_stores, "spill_loads": r.spill_loads,
            "stack_frame": r.stack_frame, "static_smem": r.static_smem, "warnings": list(r.warnings),
            "problems": r.problems()}


def kernel_row(spec, binary, sources, sass=None) -> dict:
    """One kernel's row: identity, cubin hash, ptxas report, SASS counts, and the table's cells."""
    rep = report_dict(binary)
    cells = {"regs": rep["registers"], "spill": rep["spill_stores"] + rep["spill_loads"],
             "stack": rep["stack_frame"], "smem": rep["static_smem"]}
    row = {"kind": spec.kind, "arch": spec.arch, "kernel": spec.name, "sources": list(sources),
           "sha256": hashlib.sha256(binary.cubin).hexdigest(), "cubin_bytes": len(binary.cubin), "report": rep}
    if sass is not None:
        row["sass"] = sass
        cells.update({c: sass.get(c, 0) for c in SASS_COLUMNS})
    row["results"] = {c: {"count": v} for c, v in cells.items()}
    return row


def compare(rows, old: dict) -> tuple[list, dict]:
    """Sets each row's ``compare`` verdict against an earlier result; (notes, tally {verdict word: n})."""
    before = {r["kernel"]: r for r in old.get("rows", [])}
    tally = {"same": 0, "different": 0, "report differs": 0, "new": 0}
    per_kind: dict = {}
    for row in rows:
        prev = before.get(row["kernel"])
        kind = per_kind.setdefault(row["kind"], {"same": 0, "different": 0, "report differs": 0, "new": 0})
        if "error" in row:
            row["compare"] = "compile failed"
            continue
        if prev is None:
            verdict, word = "new", "new"
        elif prev.get("sha256") == row["sha256"]:
            verdict, word = "same", "same"
        else:
            fields = ("registers", "spill_stores", "spill_loads", "stack_frame", "static_smem", "warnings")
            changed = [f"{f} {prev.get('report', {}).get(f)} -> {row['report'].get(f)}" for f in fields
                       if prev.get("report", {}).get(f) != row["report"].get(f)]
            counts = []
            if prev.get("sass") and row.get("sass"):
                counts = [f"{c} {prev['sass'].get(c, 0)} -> {row['sass'].get(c, 0)}" for c in SASS_COLUMNS
                          if prev["sass"].get(c, 0) != row["sass"].get(c, 0)]
            if changed:
                verdict = "different (report differs: " + ", ".join(changed + counts) + ")"
            else:
                verdict = "different (report same" + ("; SASS " + ", ".join(counts) if counts else "") + ")"
            word = "report differs" if verdict.startswith("different (report differs") else "different"
        row["compare"] = verdict
        tally[word] += 1
        kind[word] += 1
    gone = sorted(set(before) - {r["kernel"] for r in rows})
    notes = [f"compared with {old.get('meta', {}).get('commit', '?')}: " +
             ", ".join(f"{n} {w}" for w, n in tally.items())]
    notes += [f"  {k}: " + ", ".join(f"{n} {w}" for w, n in t.items() if n) for k, t in sorted(per_kind.items())]
    if gone:
        notes.append(f"gone since then ({len(gone)}): " + ", ".join(gone[:40]) + (" ..." if len(gone) > 40 else ""))
    tally["gone"] = len(gone)
    return notes, tally


def run(args, progress) -> dict:
    settings = parse(args)
    if settings["kernels"] is not None:
        sources = {s: ["--kernels"] for s in settings["kernels"]}
    else:
        sources = kernel_sources(settings["archs"], settings["rules"], settings["tables"])
    if settings["globs"]:
        sources = {s: v for s, v in sources.items() if any(fnmatch.fnmatchcase(s.name, g) for g in settings["globs"])}
    if not sources:
        raise ValueError("no kernel to compile (check --filter, --archs, --kernels, --no-rules/--no-tables)")
    specs = sorted(sources, key=lambda s: (s.kind, s.arch, s.name))
    tools = disassemblers() if settings["disassemble"] else []
    progress(f"compiling {len(specs)} kernels ({settings['jobs']} at a time); disassembler: "
             f"{', '.join(tools) if tools else 'none found (ptxas reports only)'}")
    dump = Path(args.out) / "sass" if settings["dump"] and tools else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)

    def one(spec):
        try:
            binary = build(spec)
        except Exception as exc:  # noqa: BLE001 -- a kernel that does not compile is a row with its error
            return {"kind": spec.kind, "arch": spec.arch, "kernel": spec.name, "sources": sources[spec],
                    "error": error_text(exc, 400), "results": {c: {"error": "compile failed"} for c in REPORT_COLUMNS}}
        sass = None
        if tools:
            text, _ = disassemble(binary.cubin, tools)
            if text:
                sass = sass_counts(text)
                if dump is not None:
                    (dump / f"{spec.name}.sass").write_text(text)
        return kernel_row(spec, binary, sources[spec], sass)

    with ThreadPool(max(1, min(settings["jobs"], len(specs)))) as pool:
        rows = pool.map(one, specs)
    found_sass = any("sass" in r for r in rows)
    result = {"suite": "sass", "meta": meta(), "metric": "count", "precision": 0, "x": "kernel", "panels": ["kind"],
              "impls": [*REPORT_COLUMNS, *(SASS_COLUMNS if found_sass else ())], "plot": False,
              "disassembler": tools[0] if tools else None,
              "convention": "ptxas report (regs, spill bytes stored+loaded, stack frame, static smem) and SASS "
                            "instruction counts per kernel",
              "settings": {k: v for k, v in settings.items() if k not in ("compare", "kernels")}, "rows": rows}
    failed = [r["kernel"] for r in rows if "error" in r]
    notes = [f"{len(rows)} kernels, {len(failed)} failed to compile"
             + (f": {', '.join(failed[:10])}" if failed else "")]
    spilling = [r["kernel"] for r in rows if r.get("report", {}).get("problems")]
    if spilling:
        notes.append(f"{len(spilling)} with a ptxas problem (spills, stack, warnings): {', '.join(spilling[:10])}"
                     + (" ..." if len(spilling) > 10 else ""))
    if settings["compare"] is not None:
        more, tally = compare(rows, settings["compare"])
        notes += more
        result["fields"] = ["compare"]
        result["compare"] = {"with": settings["compare_path"], **tally}
        if settings["strict"] and (tally["different"] or tally["report differs"] or tally["new"] or tally["gone"]):
            result["exit_status"] = 1
    result["notes"] = notes
    return result


register(Suite("sass", "no GPU: ptxas reports and SASS instruction counts of every kernel the default rules and "
                       "shipped tables can pick; compare with an earlier run", add_args, run))
