"""Sweep decode_split's knobs on the Done-when cases of issue 4, so one device call picks the defaults.

For bf16, d = 128, seqlen_q = 1 it
1. compiles every candidate spec (block_n, warps, stages, load hint) in parallel and drops
   the ones that spill or do not fit;
2. checks each against an fp32 reference (ragged paged cache with appended tokens, split and not;
   the 2x rule of tests/test_gpu_decode.py) -- a wrong spec is reported and never ranked;
3. times each spec at its own heuristic split count on every case (cuDNN timed once per case, same
   inputs), then the best specs at other split counts (is the heuristic right?), then the fused
   combine against the decode_combine launch;
4. prints a ranked table (geometric mean and minimum of flashgen / cuDNN over the cases) and the
   DEFAULT_DECODE_TILES line for the winner, and writes everything to JSON.

    python3 bench/sweep_decode.py --out bench/results/decode/sweep.json [--budget 160]

A time budget (seconds) stops the later phases early; what was measured is still written.

``--short`` (bench/device_dec3.sh): the per-case default rule (spec None: flashgen.decoding's regimes)
next to five tiles around it, every case; phase 2 scans the split count of the default's pick on each
case that splits (h/2, h-1, h, h+1, 2h and the one-CTA-per-SM and full-wave counts), twice for the
b1 cases (the run-to-run spread of the small cases is part of the answer); no combine phase.

``--loader`` (bench/device_dec4.sh): the default rule's pick on each case against the same tile with the
sm_90a bulk loader (KernelSpec.hint 4, and 5 = 4 + L2 evict_first), cuDNN in the same interleaved rounds
(bench_decode.interleaved: all resident, order reversed every other round, medians of the rounds);
12 Done-when cases plus paged ones. Prints per regime (few / some / full) whether a bulk hint beats the
default by more than the rounds' spread, and the one line of flashgen/decoding.py that would make it
the default.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import flashgen  # noqa: E402
from bench_decode import D, interleaved, kv_bytes, make_inputs, sdpa_runner, summary, time_us  # noqa: E402
from bench_fwd import meta  # noqa: E402
from flashgen import decode_api, decoding  # noqa: E402
from flashgen.api import _Device  # noqa: E402
from flashgen.spec import KernelSpec  # noqa: E402

# (block_n, warps, stages, load hint). Shared memory per CTA = 2*128*(16 + 2*stages*block_n) bytes:
# ~100 KB -> 2 CTAs per H200 SM, ~68 KB -> 3, ~52 KB -> 4, ~132-196 KB -> 1.
CANDIDATES = [
    (64, 4, 3, 0), (64, 4, 3, 1), (64, 4, 3, 2), (64, 4, 3, 3),   # the first default, and its load hints
    (32, 2, 6, 0), (32, 2, 6, 1), (16, 1, 12, 0), (64, 2, 3, 0),  # ~100 KB, finer stages / fewer warps
    (64, 4, 2, 0), (32, 2, 4, 0),                                  # ~68 KB: 3 CTAs per SM
    (32, 2, 3, 0),                                                 # ~52 KB: 4 CTAs per SM
    (128, 8, 3, 0), (64, 4, 6, 0), (128, 4, 2, 0),                 # 1 CTA per SM, more bytes in flight
]
# --short: the three per-case default tiles (few / some / full) and their nearest alternatives.
CANDIDATES_SHORT = [(128, 4, 2, 0), (128, 4, 2, 2), (64, 4, 3, 2), (64, 4, 3, 0), (64, 4, 2, 0), (64, 4, 6, 0)]
DEFAULT = "default"  # pseudo spec name: flashgen.decode's own choice (spec=None)
# (batch, heads_q, heads_kv, L, layout): "bhsd" = the bench's cache (a (b, L, hk, d) view of (b, hk, L, d)
# memory: each head's rows contiguous); "bshd" = a real (b, L, hk, d) cache; "page64"/"page256" = paged.
CASES = [(b, 32, hk, L, "bhsd") for b, hk in ((1, 32), (1, 8), (8, 8), (32, 8)) for L in (4096, 32768, 131072)]
CASES += [(1, 32, 8, 131072, "bshd"), (1, 32, 8, 131072, "page64"), (1, 32, 8, 131072, "page256")]


def spec_of(bn, w, st, hint, arch):
    return KernelSpec(kind="decode_split", arch=arch, dtype="bf16", head_dim=D, block_m=16, block_n=bn, warps=w,
                      stages=st, hint=hint, causal=True).validate()


def compile_all(cands, arch, budget):
    from flashgen.codegen import build

    ok, rejected = [], {}
    specs = []
    for c in cands:
        try:
            s = spec_of(*c, arch)
        except ValueError as exc:
            rejected[str(c)] = f"invalid: {exc}"
            continue
        if s.smem_bytes() > budget:
            rejected[s.name] = f"{s.smem_bytes()} B of shared memory > {budget}"
            continue
        specs.append(s)
    with ThreadPoolExecutor(8) as ex:
        for s, rep in zip(specs, ex.map(lambda s: build(s).report, specs)):
            if rep.problems():
                rejected[s.name] = "; ".join(rep.problems())
            else:
                ok.append((s, rep.registers))
    for s, regs in ok:
        print(f"compiled {s.name}: {regs} registers, {s.smem_bytes()} B shared", flush=True)
    for name, why in rejected.items():
        print(f"rejected {name}: {why}", flush=True)
    return ok, rejected


def check_spec(spec):
    """None if the spec meets the 2x rule on a ragged paged case with appends (split and not), else why."""
    try:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from test_gpu_decode import make_case, reference
    except Exception as exc:  # noqa: BLE001
        return None if "pytest" in str(exc) else f"cannot import the test helpers: {exc}"
    for page, with_new in ((64, True), (None, False)):
        case = make_case(3, 1, 3000, D, 32, 8, page, with_new, torch.bfloat16)
        ref, _ = reference(case, 1 / math.sqrt(D))
        low, _ = reference(case, 1 / math.sqrt(D), torch.bfloat16)
        tol = 2 * (low - ref).abs().max().item() + 1e-5
        for ns in (None, 1, 7):
            kc, vc = case["k_cache"].clone(), case["v_cache"].clone()  # appends write the cache
            out = flashgen.decode(case["q"], kc, vc, case["cache_seqlens"], case["block_table"], case["k_new"],
                                  case["v_new"], num_splits=ns, spec=spec)
            err = (out.float() - ref).abs().max().item()
            if not err <= tol:
                return f"page={page} new={with_new} num_splits={ns}: max err {err:.3e} > tol {tol:.3e}"
    return None


class Case:
    """Inputs of one case (rotating copies so that L2 never serves a small case) and cuDNN's time
    (``time_cudnn=False``: only its runner, ``cudnn_run``, for the caller to time)."""

    def __init__(self, b, hq, hk, L, layout, time_cudnn=True):
        self.key = f"b{b}_hq{hq}_hk{hk}_L{L}_{layout}"
        self.b, self.hq, self.hk, self.L, self.layout = b, hq, hk, L, layout
        self.nbytes = kv_bytes(b, hk, L)
        self.copies, self.qs, ks, vs = make_inputs(b, hq, hk, L)
        self.lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
        self.bts = [None] * self.copies
        self.cudnn = self.cudnn_run = None
        if layout == "bhsd":
            self.kc, self.vc = [k.transpose(1, 2) for k in ks], [v.transpose(1, 2) for v in vs]
            run, mode = sdpa_runner("CUDNN_ATTENTION", self.qs, ks, vs, hq, hk)
            if run is not None and not time_cudnn:
                self.cudnn_run = run
            elif run is not None:
                try:
                    self.cudnn = time_us(run, self.copies, reps=30, warmup=3)
                except Exception as exc:  # noqa: BLE001
                    print(f"{self.key}: cuDNN failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            else:
                print(f"{self.key}: cuDNN: {mode}", flush=True)
        elif layout == "bshd":
            self.kc = [k.transpose(1, 2).contiguous() for k in ks]
            self.vc = [v.transpose(1, 2).contiguous() for v in vs]
        else:
            ps = int(layout[4:])
            pages = b * L // ps
            self.kc = [k.transpose(1, 2).reshape(pages, ps, hk, D) for k in ks]  # copies (not contiguous views)
            self.vc = [v.transpose(1, 2).reshape(pages, ps, hk, D) for v in vs]
            self.bts = [torch.randperm(pages, device="cuda").to(torch.int32).view(b, L // ps)
                        for _ in range(self.copies)]
        del ks, vs

    def fn(self, spec, splits):
        """(callable(i), plan facts {"splits", "spec"}) of flashgen.decode on this case, planned once."""
        def fn(i):
            return flashgen.decode(self.qs[i], self.kc[i], self.vc[i], self.lens, self.bts[i], spec=spec,
                                   num_splits=splits, check_values=False)
        decode_api._plans.clear()
        fn(0)
        plan = next(iter(decode_api._plans.values()))
        return fn, {"splits": plan.splits, "spec": plan.spec.name}

    def run(self, spec, splits):
        fn, facts = self.fn(spec, splits)
        us = time_us(fn, self.copies, reps=30, warmup=3)
        return {"us": us, "tbps": self.nbytes / us / 1e6, **facts}

    def free(self):
        del self.qs, self.kc, self.vc, self.bts
        self.cudnn_run = None
        torch.cuda.empty_cache()


def dev_sms():
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget", type=float, default=160.0, help="seconds; later phases stop when it runs out")
    ap.add_argument("--short", action="store_true", help="the default rule and 6 tiles; phase 2 on the default")
    ap.add_argument("--loader", action="store_true", help="the default rule vs its tiles with the bulk loader")
    ap.add_argument("--rounds", type=int, default=3, help="--loader: interleaved rounds per case")
    args = ap.parse_args(argv)
    t0 = time.time()
    torch.manual_seed(0)
    dev = _Device.of(torch.cuda.current_device())
    if args.loader:
        return loader_sweep(args, dev, t0)
    result = {"meta": meta(), "convention": "bf16, d=128, seqlen_q=1; TB/s = K+V bytes / median time",
              "candidates": [], "rejected": {}, "wrong": {}, "cases": {}, "splits": {}, "fused": {}}

    def write():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=1)

    result["short"] = args.short
    ok, result["rejected"] = compile_all(CANDIDATES_SHORT if args.short else CANDIDATES, dev.arch, dev.smem_budget)
    print(f"compiled in {time.time() - t0:.0f} s", flush=True)
    specs = []
    for s, regs in ok:
        why = check_spec(s)
        if why:
            result["wrong"][s.name] = why
            print(f"WRONG {s.name}: {why}", flush=True)
        else:
            specs.append(s)
            result["candidates"].append({"spec": s.name, "registers": regs, "smem": s.smem_bytes(),
                                         "tile": [s.block_n, s.warps, s.stages, s.hint]})
    print(f"checked in {time.time() - t0:.0f} s; {len(specs)} specs to time", flush=True)
    write()

    # Phase 1: every spec at its heuristic split count, every case (largest cases last: they cost most).
    times = {}  # (case key, spec name) -> row
    for c in sorted(CASES, key=lambda c: kv_bytes(c[0], c[2], c[3])):
        if time.time() - t0 > args.budget * 0.75:
            print(f"budget: skipping case {c}", flush=True)
            continue
        case = Case(*c)
        result["cases"][case.key] = {"kv_bytes": case.nbytes, "cudnn_us": case.cudnn,
                                     "cudnn_tbps": case.nbytes / case.cudnn / 1e6 if case.cudnn else None,
                                     "flashgen": {}}
        for s in ([None] if args.short else []) + specs:
            try:
                row = case.run(s, None)
            except Exception as exc:  # noqa: BLE001
                row = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            if case.cudnn and "us" in row:
                row["x_cudnn"] = case.cudnn / row["us"]
            name = DEFAULT if s is None else s.name
            times[case.key, name] = row
            result["cases"][case.key]["flashgen"][name] = row
        best = max((r.get("tbps", 0), n) for (k, n), r in times.items() if k == case.key)
        print(f"{case.key}: cuDNN {result['cases'][case.key]['cudnn_tbps'] or float('nan'):.2f} TB/s; best "
              f"{best[0]:.2f} ({best[1]}); {time.time() - t0:.0f} s", flush=True)
        case.free()
        write()

    ranking = rank(result, ([None] if args.short else []) + specs)
    result["ranking"] = ranking
    write()

    # Phase 2: the top specs at other split counts on the cases that split.
    by_name = {s.name: s for s in specs}
    if args.short:  # the default's own pick per case (what decode() runs), its spec forced
        top = [DEFAULT]
    else:
        top = [r["spec"] for r in ranking[:3] if r["spec"] != DEFAULT]
    for c in CASES:
        if c[0] >= 32 or c[4] != "bhsd" or time.time() - t0 > args.budget * 0.9:
            continue
        case = Case(*c)
        res = result["splits"][case.key] = {}
        for name in top:
            row = result["cases"].get(case.key, {}).get("flashgen", {}).get(name, {})
            h, sname = row.get("splits"), row.get("spec")
            if not h:
                continue
            spec = by_name.get(sname)
            if spec is None:  # the default picked a tile that is not among the candidates
                spec = decoding.default_split_spec(dev.arch, "bf16", D, dev.smem_budget,
                                                   decoding.decode_regime(c[0] * c[2], dev_sms()))
            blocks = -(-c[3] // spec.block_n)
            work = c[0] * c[2]
            one_per_sm = max(1, min(blocks, dev_sms() // work))
            alts = sorted({max(1, h // 2), max(1, h - 1), h, min(blocks, h + 1), min(blocks, 2 * h), one_per_sm,
                           max(1, min(blocks, 2 * dev_sms() // work))})
            label = f"{name}={spec.name}" if name == DEFAULT else name
            for rep in range(2 if (args.short and c[0] == 1) else 1):
                key = label if rep == 0 else f"{label} (repeat)"
                res[key] = {}
                for s in alts:
                    try:
                        res[key][s] = case.run(spec, s)["tbps"]
                    except Exception as exc:  # noqa: BLE001
                        res[key][s] = f"{type(exc).__name__}: {str(exc)[:80]}"
                print(f"splits {case.key} {key} (heuristic {h}): "
                      + ", ".join(f"{s}:{v:.2f}" if isinstance(v, float) else f"{s}:{v}" for s, v in res[key].items()),
                      flush=True)
        case.free()
        write()

    # Phase 3: fused combine vs the decode_combine launch, best spec, cases that split.
    if ranking and not args.short:
        best = by_name[next(r["spec"] for r in ranking if r["spec"] != DEFAULT)]
        for c in CASES:
            if c[0] >= 32 or c[4] != "bhsd" or time.time() - t0 > args.budget:
                continue
            case = Case(*c)
            out = {}
            for fused in (True, False):
                decode_api.FUSED_COMBINE = fused
                out["fused" if fused else "combine_kernel"] = case.run(best, None)["us"]
            decode_api.FUSED_COMBINE = True
            decode_api._plans.clear()
            result["fused"][case.key] = out
            print(f"combine {case.key}: fused {out['fused']:.1f} us, kernel {out['combine_kernel']:.1f} us", flush=True)
            case.free()
            write()

    print_ranking(result)
    result["elapsed_s"] = time.time() - t0
    write()


# --loader: the Done-when cases plus paged ones (b1 "few", b8 "some", b32 "full"), smallest first.
LOADER_CASES = [c for c in CASES if c[4] == "bhsd"] + [
    (1, 32, 8, 131072, "page64"), (1, 32, 8, 131072, "page256"), (8, 32, 8, 32768, "page64"),
    (32, 32, 8, 32768, "page64")]
BULK_OF = {"h4": 4, "h5": 5}  # the bulk variants timed next to the default, by name


def loader_sweep(args, dev, t0):
    """The default rule's pick on each case vs the same tile with the bulk loader (hints 4 and 5), cuDNN
    interleaved; a per-regime verdict and the line of flashgen/decoding.py to change."""
    result = {"meta": meta(), "convention": "bf16, d=128, seqlen_q=1; TB/s = K+V bytes / median of the "
              f"medians of {args.rounds} interleaved rounds", "loader": True, "checked": {}, "cases": {}}

    def write():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=1)

    if dev.arch != "sm_90a":
        print(f"--loader needs sm_90a (the bulk loader), this device is {dev.arch}", flush=True)
        return
    sms = dev_sms()
    bulk_ok = {}  # spec name -> None (correct) or why not
    for c in sorted(LOADER_CASES, key=lambda c: kv_bytes(c[0], c[2], c[3])):
        if time.time() - t0 > args.budget:
            print(f"budget: skipping case {c}", flush=True)
            continue
        b, hq, hk, L, layout = c
        case = Case(*c, time_cudnn=False)
        regime = decoding.decode_regime(b * hk * -(-(hq // hk) // decoding.ROWS), sms)
        fns, facts = {}, {}
        fns["default"], facts["default"] = case.fn(None, None)
        base = next(iter(decode_api._plans.values())).spec  # what the default rule picked here
        for name, hint in BULK_OF.items():
            spec = base.replace(hint=hint)
            if spec.name not in bulk_ok:
                bulk_ok[spec.name] = check_spec(spec)
                result["checked"][spec.name] = bulk_ok[spec.name] or "ok"
                print(f"checked {spec.name}: {bulk_ok[spec.name] or 'ok'}", flush=True)
            if bulk_ok[spec.name] is None:
                try:
                    fns[name], facts[name] = case.fn(spec, None)
                except Exception as exc:  # noqa: BLE001 -- recorded with the case
                    facts[name] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
        if case.cudnn_run is not None:
            fns["cudnn"], facts["cudnn"] = case.cudnn_run, {}
        row = result["cases"][case.key] = {"kv_bytes": case.nbytes, "regime": regime}
        row.update({n: f for n, f in facts.items() if n not in fns})
        for name, ts in interleaved(fns, case.copies, rounds=args.rounds).items():
            row[name] = {"error": ts} if isinstance(ts, str) else {**summary(ts, case.nbytes), **facts[name]}
        for name in ("default", *BULK_OF):
            r = row.get(name, {})
            if "us" in r and "us" in row.get("cudnn", {}):
                r["x_cudnn"] = row["cudnn"]["us"] / r["us"]
            if "us" in r and "us" in row["default"]:
                r["vs_default"] = row["default"]["us"] / r["us"]
        print(f"{case.key:<28} [{regime}] " + "  ".join(
            f"{n} {row[n].get('tbps', float('nan')):.3f} TB/s +-{row[n].get('spread_pct', float('nan')):.1f}%"
            + (f" ({row[n]['vs_default']:.3f}x)" if "vs_default" in row[n] else "")
            for n in ("cudnn", "default", *BULK_OF) if n in row) + f"; {time.time() - t0:.0f} s", flush=True)
        case.free()
        write()
    result["verdict"] = loader_verdict(result)
    result["elapsed_s"] = time.time() - t0
    write()


def loader_verdict(result):
    """Per regime: geomean of (default time / variant time) over its cases, the worst case, and the
    largest spread seen; a variant is 'better' when its geomean gain exceeds that spread and no case
    of the regime lost more than it. Prints the table, the x cuDNN summary and the decoding.py line."""
    regimes = {}
    for key, row in result["cases"].items():
        regimes.setdefault(row["regime"], []).append((key, row))
    lines = {"few": 'DECODE_TILES_BY_REGIME[128]["few"]: ((128, 4, 2, 0),)  ->  ((128, 4, 2, {h}),)',
             "full": 'DECODE_TILES_BY_REGIME[128]["full"]: ((64, 4, 2, 0),)  ->  ((64, 4, 2, {h}),)',
             "some": "DEFAULT_DECODE_TILES[128][0]: (64, 4, 3, 2)  ->  (64, 4, 3, {h})"}
    verdict = {}
    print("\nper regime: geomean default time / bulk time (>1: bulk faster), worst case, max spread %")
    for regime, rows in sorted(regimes.items()):
        out = verdict[regime] = {"cases": [k for k, _ in rows]}
        spread = max((r[n].get("spread_pct", 0) for _, r in rows for n in ("default", *BULK_OF) if n in r),
                     default=0)
        for name, hint in BULK_OF.items():
            gains = [r[name]["vs_default"] for _, r in rows if "vs_default" in r.get(name, {})]
            if not gains:
                continue
            g = geomean(gains)
            better = (g - 1) * 100 > spread and (1 - min(gains)) * 100 <= spread
            out[name] = {"geomean_gain": g, "min_gain": min(gains), "max_spread_pct": spread, "better": better}
            print(f"  {regime:<5} {name}: {g:.4f} (worst {min(gains):.4f}, spread {spread:.2f} %) "
                  + ("-> better" if better else "-> keep the default"))
        best = max((n for n in BULK_OF if out.get(n, {}).get("better")),
                   key=lambda n: out[n]["geomean_gain"], default=None)
        out["change"] = lines[regime].format(h=BULK_OF[best]) if best else None
    xs = {n: [r[n]["x_cudnn"] for r in result["cases"].values() if "x_cudnn" in r.get(n, {})]
          for n in ("default", *BULK_OF)}
    for n, v in xs.items():
        if v:
            print(f"x cuDNN {n}: geomean {geomean(v):.3f}, min {min(v):.3f} over {len(v)} cases")
    for regime, out in sorted(verdict.items()):
        print(f"{regime}: " + (f"change flashgen/decoding.py {out['change']}" if out.get("change")
                               else "keep the cp.async default"))
    return verdict


def rank(result, specs):
    """Specs by geometric mean of flashgen/cuDNN over the cases with a cuDNN time (then by minimum)."""
    rows = []
    for s in specs:
        name = DEFAULT if s is None else s.name
        xs = [c["flashgen"].get(name, {}).get("x_cudnn") for c in result["cases"].values() if c["cudnn_us"]]
        xs = [x for x in xs if x]
        big = [c["flashgen"].get(name, {}).get("tbps") for c in result["cases"].values()
               if c["kv_bytes"] >= 256 * 2**20 and c["cudnn_us"]]
        paged = {}
        for k, c in result["cases"].items():
            if "_page" in k or k.endswith("_bshd"):
                paged[k.rsplit("_", 1)[1]] = c["flashgen"].get(name, {}).get("tbps")
        tile = "per case" if s is None else [s.block_n, s.warps, s.stages, s.hint]
        rows.append({"spec": name, "tile": tile, "geomean_x_cudnn": geomean(xs),
                     "min_x_cudnn": min(xs) if xs else float("nan"), "cases": len(xs),
                     "min_tbps_big": min((b for b in big if b), default=float("nan")), "layouts": paged})
    rows.sort(key=lambda r: (-(r["geomean_x_cudnn"] if r["geomean_x_cudnn"] == r["geomean_x_cudnn"] else 0),
                             -(r["min_x_cudnn"] if r["min_x_cudnn"] == r["min_x_cudnn"] else 0)))
    return rows


def print_ranking(result):
    print(f"\n{'rank':>4} {'spec':<52} {'geo x cudnn':>11} {'min x':>6} {'min TB/s >=256MB':>16}  bshd/page64/page256")
    for i, r in enumerate(result.get("ranking", []), 1):
        lay = r["layouts"]
        print(f"{i:>4} {r['spec']:<52} {r['geomean_x_cudnn']:11.3f} {r['min_x_cudnn']:6.3f} "
              f"{r['min_tbps_big']:16.2f}  " + "/".join(f"{lay.get(k) or float('nan'):.2f}"
                                                          for k in ("bshd", "page64", "page256")))
    names = [r["spec"] for r in result.get("ranking", [])]
    if names:
        print("\nper case (TB/s): cuDNN | best spec | the default rule (or n64 w4 s3 h0)")
        base = DEFAULT if DEFAULT in names else next((n for n in names if "_n64_w4_s3_h0_" in n), None)
        for k, c in result["cases"].items():
            rows = c["flashgen"]
            best = max(((r.get("tbps", 0), n) for n, r in rows.items()), default=(0, "-"))
            cu = c["cudnn_tbps"]
            b0 = rows.get(base, {}).get("tbps", float("nan")) if base else float("nan")
            print(f"  {k:<28} {cu or float('nan'):5.2f} | {best[0]:5.2f} {best[1]} | {b0:5.2f}")
        for k, c in result["cases"].items():
            d = c["flashgen"].get(DEFAULT)
            if d and "spec" in d:
                print(f"  default on {k:<28} {d['spec']} at {d['splits']} splits")
        r0 = next((r for r in result["ranking"] if r["spec"] != DEFAULT), None)
        if r0:
            print(f"\nbest single tile: ({', '.join(map(str, r0['tile']))})  "
                  f"# {r0['spec']}, geomean {r0['geomean_x_cudnn']:.3f}x cuDNN, min {r0['min_x_cudnn']:.3f}x")
    for name, why in result.get("wrong", {}).items():
        print(f"WRONG (not ranked) {name}: {why}")


if __name__ == "__main__":
    main()
