"""The sanitizer tier: compute-sanitizer's memcheck, racecheck, initcheck and synccheck over a small case
matrix of every default kernel path, on the GPU in front of it.

    python3 tests/sanitize.py check [--tools memcheck,racecheck,initcheck,synccheck] [--json FILE]
                                    [--only TEXT] [--package DIR]
    python3 tests/sanitize.py cases [--only TEXT] [--package DIR]   # the case matrix alone

``--only`` keeps the cases whose name contains TEXT; ``--package`` imports flashgen from DIR (a
folder holding a ``flashgen`` package: another checkout, to show a report a change removes).

``check`` runs the cases once without a tool (compiling every kernel into a private binary cache, so no
tool run spends its time in NVRTC), then once under each tool, and exits 1 if any tool reports an
error or a hazard, or a run fails. The cases: the forward through dispatch (fwd_sm90 where it is the
default, fwd_v2 elsewhere) and fwd_v2 forced, at odd sizes, GQA, both layouts, causal and not; the
backward (bwd_sm90 and the mma.sync kernels; deterministic dQ too, bwd_sm90's det twin where it serves);
decode split and unsplit over short ragged caches (lengths 0, 5 and 650 of 704), contiguous and paged, with appends, each regime's tile, and
one long cache. tests/test_gpu_sanitizer.py runs ``check`` as a GPU test.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")


def find_sanitizer() -> str | None:
    """compute-sanitizer on PATH or in the usual CUDA toolkit places."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for path in ("/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if os.path.exists(path):
            return path
    return None


# ------------------------------------------------------------------------------------------- the cases

def _cases():
    """[(name, callable)]: each callable launches one path and checks the result is finite."""
    import torch

    import flashgen
    from flashgen import dispatch, families
    from flashgen.api.device import Device
    from flashgen.families import decode as dec
    from flashgen.problem import ProblemKey

    dev = Device.of(torch.cuda.current_device())
    bf16 = torch.bfloat16

    def rnd(*shape, dtype=bf16):
        return torch.randn(*shape, device="cuda", dtype=torch.float32).to(dtype)

    def finite(*ts):
        for t in ts:
            assert t is not None and bool(torch.isfinite(t).all()), "non-finite result"

    def fwd(b, hq, hk, nq, nk, d, causal, layout="bhsd", dtype=bf16, family=None):
        def run():
            shape = (lambda h, n: (b, h, n, d)) if layout == "bhsd" else (lambda h, n: (b, n, h, d))
            q, k, v = rnd(*shape(hq, nq), dtype=dtype), rnd(*shape(hk, nk), dtype=dtype), rnd(*shape(hk, nk), dtype=dtype)
            spec = None
            if family is not None:
                key = ProblemKey("fwd", dev.arch, "bf16" if dtype == bf16 else "fp16", d, causal, 512)
                # the rule's first tile this NVRTC compiles without spills (under NVRTC 13.0 the fwd_v2
                # rule's first d128 causal tile for sm_90a spills 84 B; dispatch checks the same way)
                spec = families.default_spec(key, dev.smem_budget, check=dispatch.resource_problems, family=family)
            out, lse = flashgen.attention(q, k, v, causal=causal, layout=layout, return_lse=True, spec=spec)
            finite(out)
            assert not bool(torch.isnan(lse).any())
        return run

    def bwd(b, hq, hk, nq, nk, d, causal, deterministic=False):
        def run():
            q, k, v = (rnd(b, h, n, d).requires_grad_() for h, n in ((hq, nq), (hk, nk), (hk, nk)))
            out = flashgen.attention(q, k, v, causal=causal, deterministic=deterministic)
            out.backward(rnd(*out.shape))
            finite(out, q.grad, k.grad, v.grad)
        return run

    def decode(b, nq, cap, lens, d, hq, hk, page=None, with_new=False, num_splits=None, regime=None):
        def run():
            if page:
                pages = b * (cap // page)
                kc, vc = rnd(pages, page, hk, d), rnd(pages, page, hk, d)
                bt = torch.randperm(pages, device="cuda", dtype=torch.int32).view(b, cap // page)
            else:
                kc, vc, bt = rnd(b, cap, hk, d), rnd(b, cap, hk, d), None
            seqlens = torch.tensor(lens, device="cuda", dtype=torch.int32)
            kn = rnd(b, nq, hk, d) if with_new else None
            vn = rnd(b, nq, hk, d) if with_new else None
            spec = None
            if regime is not None:
                spec = dec.first_rule_spec(ProblemKey("decode_split", dev.arch, "bf16", d, True, 512),
                                           dev.smem_budget, regime)
            with torch.no_grad():
                out, lse = flashgen.decode(rnd(b, nq, hq, d), kc, vc, cache_seqlens=seqlens, block_table=bt,
                                           k_new=kn, v_new=vn, num_splits=num_splits, return_lse=True, spec=spec)
            finite(out)
        return run

    cases = []
    for d in (64, 128, 96, 256):
        for causal in (False, True):
            cases.append((f"fwd d{d} 113x203 gqa {'causal' if causal else 'full'}", fwd(2, 4, 2, 113, 203, d, causal)))
    cases += [
        ("fwd d128 1x239 causal", fwd(1, 2, 2, 1, 239, 128, True)),
        ("fwd d128 239x1 full", fwd(1, 2, 1, 239, 1, 128, False)),
        ("fwd d64 799x3 causal bshd", fwd(1, 4, 1, 799, 3, 64, True, layout="bshd")),
        ("fwd d128 1023x1023 causal fp16", fwd(1, 2, 2, 1023, 1023, 128, True, dtype=torch.float16)),
        ("fwd d128 fwd_v2 113x203 causal", fwd(2, 4, 2, 113, 203, 128, True, family="fwd_v2")),
        # d = 256's tile (128 x 80, overlap with early K release) over more K/V blocks than its two stages
        ("fwd d256 300x1000 gqa full", fwd(2, 4, 2, 300, 1000, 256, False)),
        ("fwd d64 fwd_v2 239x1 full bshd", fwd(1, 2, 1, 239, 1, 64, False, layout="bshd", family="fwd_v2")),
    ]
    for d in (64, 128, 96):
        for causal in (False, True):
            cases.append((f"bwd d{d} 113x203 gqa {'causal' if causal else 'full'}", bwd(2, 4, 2, 113, 203, d, causal)))
    # d = 256: the staging tile the two warpgroups fill in turn, freed panel by panel (dq_write 5), over several query
    # blocks a CTA
    cases.append(("bwd d256 300x700 gqa causal", bwd(2, 4, 2, 300, 700, 256, True)))
    cases.append(("bwd d256 300x700 gqa deterministic", bwd(2, 4, 2, 300, 700, 256, False, deterministic=True)))
    cases.append(("bwd d128 239x1023 causal deterministic", bwd(1, 2, 1, 239, 1023, 128, True, deterministic=True)))
    cases.append(("bwd d64 300x700 gqa deterministic", bwd(2, 4, 2, 300, 700, 64, False, deterministic=True)))
    # d = 128 from 1k queries: the dQ writer warp's two staging tiles beside dq_early's dQ before dK
    cases.append(("bwd d128 700x300 gqa causal", bwd(2, 4, 2, 700, 300, 128, True)))
    short = [0, 5, 650]
    for page in (None, 16):
        for with_new in (False, True):
            for splits in (1, 4, None):
                where = f"paged{page}" if page else "contiguous"
                cases.append((f"decode d128 lens 0/5/650 of 704 {where} {'append' if with_new else 'no append'} "
                              f"splits {splits or 'auto'}",
                              decode(3, 1, 704, short, 128, 8, 2, page, with_new, splits)))
    cases.append(("decode d64 lens 0/5/650 of 704 paged16 append 3 tokens",
                  decode(3, 3, 704, short, 64, 8, 2, 16, True, None)))
    for regime in dec.REGIMES:
        cases.append((f"decode d128 regime {regime} tile, paged64 append",
                      decode(3, 1, 704, short, 128, 8, 2, 64, True, None, regime=regime)))
    cases.append(("decode d128 40000 keys splits auto", decode(1, 1, 40960, [40000], 128, 8, 1)))
    return cases


def run_cases(only: str = "") -> int:
    import torch

    failed = 0
    for name, fn in _cases():
        if only not in name:
            continue
        try:
            fn()
            torch.cuda.synchronize()
            print(f"ok    {name}", flush=True)
        except Exception as exc:  # noqa: BLE001 -- every case runs; the count decides
            failed += 1
            print(f"FAIL  {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------- the check

SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
RACE = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


def parse_report(tool: str, text: str) -> dict:
    """{errors, hazards, kernels, summary_seen}: the tool's summary counts (racecheck's RACECHECK SUMMARY
    counts its errors and warnings; the others' ERROR SUMMARY their errors) and the kernels named."""
    errors = sum(int(m) for m in SUMMARY.findall(text))
    races = RACE.findall(text)
    errors += sum(int(m[1]) for m in races)
    hazards = sum(int(m[1]) + int(m[2]) for m in races)
    kernels = sorted(set(re.findall(r"\b((?:fwd|bwd|decode|standard)_\w*?d\d+_\w+)", text)))
    return {"errors": errors, "hazards": hazards, "kernels": kernels,
            "summary_seen": bool(SUMMARY.search(text) or races)}


def check(tools, json_path=None, only: str = "", package: str | None = None) -> int:
    sanitizer = find_sanitizer()
    if sanitizer is None:
        print("compute-sanitizer not found", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault("FLASHGEN_HOME", tempfile.mkdtemp(prefix="flashgen-sanitize-"))
    me = [sys.executable, os.path.abspath(__file__), "cases", "--only", only,
          "--package", package or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    t0 = time.monotonic()
    warm = subprocess.run(me, env=env, capture_output=True, text=True)
    results = {"cases": len([ln for ln in warm.stdout.splitlines() if ln.startswith(("ok", "FAIL"))]),
               "warm_rc": warm.returncode, "warm_s": round(time.monotonic() - t0, 1), "tools": {}}
    bad = warm.returncode != 0
    if bad:
        print(warm.stdout[-3000:], warm.stderr[-3000:], sep="\n")
    for tool in tools:
        t0 = time.monotonic()
        args = [sanitizer, "--tool", tool, "--error-exitcode", "99", "--print-limit", "20"]
        if tool == "racecheck":
            args += ["--racecheck-report", "all"]
        proc = subprocess.run(args + me, env=env, capture_output=True, text=True)
        text = proc.stdout + proc.stderr
        rep = parse_report(tool, text)
        rep.update(rc=proc.returncode, seconds=round(time.monotonic() - t0, 1),
                   failed_cases=[ln for ln in proc.stdout.splitlines() if ln.startswith("FAIL")])
        results["tools"][tool] = rep
        if json_path:  # the tool's whole report beside the summary
            with open(f"{os.path.splitext(json_path)[0]}.{tool}.txt", "w") as f:
                f.write(text[-(2 << 20):])
        clean = proc.returncode == 0 and rep["errors"] == 0 and rep["hazards"] == 0 and rep["summary_seen"]
        bad |= not clean
        if not clean:
            print(f"--- {tool} (rc {proc.returncode}) ---\n{text[-6000:]}")
    print(f"{'tool':<10} {'rc':>4} {'errors':>7} {'hazards':>8} {'seconds':>8}  kernels named")
    for tool, r in results["tools"].items():
        print(f"{tool:<10} {r['rc']:>4} {r['errors']:>7} {r['hazards']:>8} {r['seconds']:>8}  "
              f"{', '.join(r['kernels']) or '-'}")
    print(f"{results['cases']} cases; warm-up rc {results['warm_rc']} in {results['warm_s']} s")
    if json_path:
        import torch

        results.update(only=only, package=package or "this checkout")
        results["device"] = torch.cuda.get_device_name()
        results["torch"] = torch.__version__
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("--tools", default=",".join(TOOLS))
    c.add_argument("--json", default=None)
    cases = sub.add_parser("cases")
    for p in (c, cases):
        p.add_argument("--only", default="", help="only the cases whose name contains this")
        p.add_argument("--package", default=None, help="import flashgen from this folder")
    args = ap.parse_args(argv)
    if args.package:
        sys.path.insert(0, os.path.abspath(args.package))
    if args.cmd == "cases":
        return run_cases(args.only)
    tools = [t for t in args.tools.split(",") if t]
    unknown = set(tools) - set(TOOLS)
    if unknown:
        ap.error(f"unknown tools {sorted(unknown)}; known: {', '.join(TOOLS)}")
    return check(tools, args.json, args.only, args.package)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
