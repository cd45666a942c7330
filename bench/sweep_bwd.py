"""Sweep of backward tile specs and dQ modes: one device call picks the defaults of dispatch.BWD_TILES.

For each head dim, causal flag and seqlen (bench convention: hidden 2048, batch 16384 / N, bf16)
it times ``flashgen.backward.attention_backward`` (the backward launches only: preprocess, dK/dV,
dQ) with a forced spec per kind, next to SDPA flash's backward (``torch.autograd.grad`` through a
saved graph). Two stages per shape (coordinate descent, to stay within one device call):
  1. dQ mode "atomic": every candidate ``bwd_dkdv`` spec;
     dQ mode "separate": every candidate ``bwd_dkdv_nodq`` spec with the default ``bwd_dq``.
  2. "separate" again: every candidate ``bwd_dq`` spec with stage 1's best ``bwd_dkdv_nodq``.
Candidates are compiled first (in parallel); those that spill or do not fit are dropped with the
reason. Each timed configuration is checked once against SDPA's gradients (max abs error relative
to the largest gradient; > 3e-2 marks it WRONG and it is never ranked first).

    python3 bench/sweep_bwd.py --out sweep_bwd.json [--d 128,64] [--seqlens 2048,8192] [--budget-s 190]

Prints, per (d, causal), a ranked table (geometric mean over the seqlens of the time relative to
the best) and the suggested BWD_TILES / BWD_DQ_MODE entries.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from multiprocessing.pool import ThreadPool

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_fwd import flops, meta, time_ms  # noqa: E402

import flashgen  # noqa: E402
from flashgen import dispatch  # noqa: E402
from flashgen.api import _Device  # noqa: E402
from flashgen.backward import attention_backward  # noqa: E402
from flashgen.codegen import build  # noqa: E402
from flashgen.spec import KernelSpec  # noqa: E402

# (block_m, block_n, warps, stages) per kind; infeasible or spilling ones are dropped at compile time.
# (On sm_90a with this commit's templates, d=128 bwd_dkdv fits without spills at 64x64w8, 128x64w8s3,
# 128x32w8, 64x32w4/w8, 32x64w8, 32x32w4; 64x128w8 spilled 252 B then and was dropped; since bwd5
# 64x128w8s2 is spill-free at the 251-255 cap, so it is swept.)
GRID = {kind: [(bm, bn, w, st) for bm in (32, 64, 128) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
        for kind in ("bwd_dkdv", "bwd_dq")}
GRID["bwd_dkdv_nodq"] = GRID["bwd_dkdv"]
TOL = 3e-2


def candidates(kind, d, causal, dev):
    """(feasible spill-free specs, {name: reason} of the dropped) for one kind and key."""
    specs, dropped = [], {}
    for bm, bn, w, st in GRID[kind]:
        spec = KernelSpec(kind=kind, arch=dev.arch, dtype="bf16", head_dim=d, block_m=bm, block_n=bn, warps=w,
                          stages=st, refill=0, causal=causal)
        try:
            spec.validate()
        except ValueError as exc:
            dropped[spec.name] = str(exc)[:120]
            continue
        if spec.smem_bytes() > dev.smem_budget:
            dropped[spec.name] = f"smem {spec.smem_bytes()} > {dev.smem_budget}"
            continue
        specs.append(spec)
    return specs, dropped


def compile_all(specs, threads):
    """{spec: None if usable else the reason}: compiled in parallel, spills and errors refused."""
    def one(spec):
        try:
            problems = build(spec).report.problems()
            return spec, "; ".join(problems) or None
        except Exception as exc:  # noqa: BLE001 -- a candidate that fails to build is dropped with its reason
            return spec, f"{type(exc).__name__}: {str(exc)[:200]}"

    with ThreadPool(threads) as pool:
        return dict(pool.map(one, sorted(set(specs), key=lambda s: s.name)))


def rel_err(got, want):
    return max((g.float() - w.float()).abs().max().item() / max(w.float().abs().max().item(), 1e-6)
               for g, w in zip(got, want))


def shape_inputs(n, d, causal):
    b, h = max(1, 16384 // n), 2048 // d
    torch.manual_seed(0)
    mk = lambda: torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v, dout = mk(), mk(), mk(), mk()
    scale = 1.0 / math.sqrt(d)
    out, lse = flashgen.attention(q, k, v, causal=causal, return_lse=True)
    # SDPA flash: its backward alone (a saved graph, retained), and its gradients as the check.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref_out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    ref = torch.autograd.grad(ref_out, leaves, dout, retain_graph=True)
    sdpa_bwd = lambda: torch.autograd.grad(ref_out, leaves, dout, retain_graph=True)  # noqa: E731
    return dict(b=b, h=h, q=q, k=k, v=v, dout=dout, out=out, lse=lse, scale=scale, ref=ref, sdpa_bwd=sdpa_bwd)


def time_config(x, causal, mode, specs, reps):
    run = lambda: attention_backward(x["dout"], x["q"], x["k"], x["v"], x["out"], x["lse"], causal,  # noqa: E731
                                     x["scale"], dq_mode=mode, specs=specs)
    err = rel_err(run(), x["ref"])
    ms = time_ms(run, reps=reps, warmup=2)
    return ms, err


def label(mode, specs):
    main = specs.get("bwd_dkdv") or specs.get("bwd_dkdv_nodq")
    parts = [f"{mode:8s} kv={main.block_m}x{main.block_n}w{main.warps}s{main.stages}"]
    if "bwd_dq" in specs:
        s = specs["bwd_dq"]
        parts.append(f"dq={s.block_m}x{s.block_n}w{s.warps}s{s.stages}")
    return " ".join(parts)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="128,64")
    ap.add_argument("--seqlens", default="2048,8192")
    ap.add_argument("--causal", default="both", choices=("both", "true", "false"))
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=190.0, help="stop timing new configurations after this")
    ap.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 4))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t0 = time.time()
    dev = _Device.of(torch.cuda.current_device())
    dims = [int(x) for x in args.d.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]

    # ---- compile every candidate first (and the default specs), in parallel ----
    cands, dropped = {}, {}
    for d in dims:
        for causal in causals:
            for kind in ("bwd_dkdv", "bwd_dkdv_nodq", "bwd_dq"):
                specs, bad = candidates(kind, d, causal, dev)
                cands[(kind, d, causal)] = specs
                dropped.update(bad)
    defaults = {(kind, d, causal): dispatch.select(dispatch.ProblemKey(kind, dev.arch, "bf16", d, causal, 2048),
                                                   dev.gpu, dev.smem_budget, verify=True)
                for d in dims for causal in causals for kind in ("bwd_dkdv", "bwd_dkdv_nodq", "bwd_dq")}
    status = compile_all([s for v in cands.values() for s in v] + list(defaults.values()), args.threads)
    for spec, why in status.items():
        if why:
            dropped[spec.name] = why
    for key in cands:
        cands[key] = [s for s in cands[key] if status.get(s) is None]
    print(f"compiled {len(status)} specs in {time.time() - t0:.0f} s; {len(dropped)} dropped", flush=True)
    for name, why in sorted(dropped.items()):
        print(f"  dropped {name}: {why}")

    result = {"meta": meta(), "convention": "backward only, hidden 2048, batch 16384/N, bf16; bwd FLOPs = 2.5x fwd",
              "dropped": dropped, "defaults": {f"{k[0]}/d{k[1]}/{'causal' if k[2] else 'full'}": s.name
                                               for k, s in defaults.items()},
              "rows": []}
    out_of_time = False

    def record(d, causal, n, x, mode, specs, stage):
        nonlocal out_of_time
        if time.time() - t0 > args.budget_s:
            out_of_time = True
            return None
        try:
            ms, err = time_config(x, causal, mode, specs, args.reps)
        except Exception as exc:  # noqa: BLE001 -- recorded, not fatal
            row = {"d": d, "causal": causal, "seqlen": n, "mode": mode, "stage": stage, "config": label(mode, specs),
                   "specs": {k: s.name for k, s in specs.items()}, "error": f"{type(exc).__name__}: {exc}"[:300]}
            result["rows"].append(row)
            print(f"  ERROR {row['config']}: {row['error']}", flush=True)
            return None
        f = 2.5 * flops(x["b"], x["h"], n, d, causal)
        row = {"d": d, "causal": causal, "seqlen": n, "mode": mode, "stage": stage, "config": label(mode, specs),
               "specs": {k: s.name for k, s in specs.items()}, "ms": ms, "tflops": f / ms / 1e9, "rel_err": err,
               "ok": err <= TOL}
        result["rows"].append(row)
        print(f"  {row['config']:48s} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s  err {err:.1e}"
              f"{'' if row['ok'] else '  WRONG'}", flush=True)
        return row

    for d in dims:
        for causal in causals:
            for n in seqlens:
                if out_of_time:
                    break
                x = shape_inputs(n, d, causal)
                sdpa_ms = time_ms(x["sdpa_bwd"], reps=args.reps, warmup=2)
                f = 2.5 * flops(x["b"], x["h"], n, d, causal)
                result["rows"].append({"d": d, "causal": causal, "seqlen": n, "mode": "sdpa_flash", "stage": 0,
                                       "config": "sdpa_flash", "ms": sdpa_ms, "tflops": f / sdpa_ms / 1e9, "ok": True})
                print(f"d={d} causal={causal} N={n}: sdpa_flash bwd {sdpa_ms:.3f} ms {f / sdpa_ms / 1e9:.1f} TFLOP/s",
                      flush=True)
                dq_default = defaults[("bwd_dq", d, causal)]
                for spec in cands[("bwd_dkdv", d, causal)]:
                    record(d, causal, n, x, "atomic", {"bwd_dkdv": spec}, 1)
                best_nodq, best_ms = None, float("inf")
                for spec in cands[("bwd_dkdv_nodq", d, causal)]:
                    row = record(d, causal, n, x, "separate", {"bwd_dkdv_nodq": spec, "bwd_dq": dq_default}, 1)
                    if row and row["ok"] and row["ms"] < best_ms:
                        best_nodq, best_ms = spec, row["ms"]
                if best_nodq is not None:
                    for spec in cands[("bwd_dq", d, causal)]:
                        if spec != dq_default:
                            record(d, causal, n, x, "separate", {"bwd_dkdv_nodq": best_nodq, "bwd_dq": spec}, 2)
                del x
                torch.cuda.empty_cache()
                if args.out:
                    _write(args.out, result)
    if out_of_time:
        print(f"budget of {args.budget_s:.0f} s reached: the remaining configurations were not timed")
    result["summary"] = summarize(result["rows"])
    if args.out:
        _write(args.out, result)
    print(f"done in {time.time() - t0:.0f} s")


def summarize(rows):
    """Per (d, causal): configurations ranked by the geometric mean over seqlens of time / best time."""
    summary = {}
    keys = sorted({(r["d"], r["causal"]) for r in rows})
    for d, causal in keys:
        rs = [r for r in rows if r["d"] == d and r["causal"] == causal and "ms" in r]
        seqlens = sorted({r["seqlen"] for r in rs})
        best = {n: min((r["ms"] for r in rs if r["seqlen"] == n and r["ok"] and r["mode"] != "sdpa_flash"),
                       default=float("nan")) for n in seqlens}
        sdpa = {n: next((r["ms"] for r in rs if r["seqlen"] == n and r["mode"] == "sdpa_flash"), float("nan"))
                for n in seqlens}
        configs = {}
        for r in rs:
            if r["mode"] == "sdpa_flash":
                continue
            c = configs.setdefault(r["config"], {"config": r["config"], "mode": r["mode"], "specs": r["specs"],
                                                 "ms": {}, "ok": True})
            c["ms"][r["seqlen"]] = r["ms"]
            c["ok"] = c["ok"] and r["ok"]
        ranked = []
        for c in configs.values():
            if len(c["ms"]) != len(seqlens):
                continue  # not timed at every seqlen (stage 2 or out of budget)
            c["rel"] = math.exp(sum(math.log(c["ms"][n] / best[n]) for n in seqlens) / len(seqlens))
            c["x_sdpa"] = math.exp(sum(math.log(sdpa[n] / c["ms"][n]) for n in seqlens) / len(seqlens))
            ranked.append(c)
        ranked.sort(key=lambda c: (not c["ok"], c["rel"]))
        tag = f"d={d} {'causal' if causal else 'full'}"
        print(f"\n== {tag}: ranked (time / best, geomean over N={seqlens}; x sdpa = sdpa bwd time / ours) ==")
        for i, c in enumerate(ranked[:12]):
            ms = " ".join(f"{c['ms'][n]:7.3f}" for n in seqlens)
            print(f"{i + 1:3d}. {c['config']:48s} {c['rel']:6.3f}  x sdpa {c['x_sdpa']:5.2f}  ms {ms}"
                  f"{'' if c['ok'] else '  WRONG'}")
        if ranked and ranked[0]["ok"]:
            top = ranked[0]
            print(f"    suggested: BWD_DQ_MODE[{d}] = {top['mode']!r}; specs {top['specs']}")
        summary[tag] = ranked
    return summary


def _write(path, result):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
