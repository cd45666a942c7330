"""Decode benchmark: flashgen.decode (Flash-Decoding) next to torch SDPA's flash and cuDNN backends.

bf16, d = 128, one new token per sequence (seqlen_q = 1), (batch, heads_q, heads_kv) in (1,32,32),
(1,32,8), (8,32,8), (32,32,8), cache length L in {4k, 32k, 128k}. Bandwidth = bytes of K and V read
(2 * batch * L * heads_kv * d * 2) / time. flashgen and the SDPA backends of a case are timed
interleaved, with all their inputs resident: ROUNDS rounds, the order reversed every other round,
each round the median of CUDA-event-timed calls (flashgen.bench.timing.time_ms); a row reports the
median over the rounds per implementation, the rounds themselves and their spread, and the ratios
are of those medians -- a clock or thermal drift during the run shows as spread, not as a
difference between implementations. Where the K/V of one case is smaller than 256 MB, calls rotate
over several copies so that L2 (50 MB) never serves them. flashgen reads the cache (batch, L, heads_kv, d) as a strided view of the same
(batch, heads_kv, L, d) tensors SDPA gets. SDPA gets GQA through ``enable_gqa=True`` when the backend
takes it, else K/V expanded with repeat_interleave outside the timed region (recorded per row as
"gqa"). Also: paged (page 64, 256) vs contiguous bandwidth, a split-count sweep, and host overhead.

    python3 bench/bench_decode.py --out bench/results/decode_h200.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import flashgen  # noqa: E402
from flashgen.bench import timing  # noqa: E402
from bench_fwd import meta  # noqa: E402

D = 128
SHAPES = [(1, 32, 32), (1, 32, 8), (8, 32, 8), (32, 32, 8)]
LENGTHS = [4096, 32768, 131072]
ROTATE_BYTES = 256 * 2**20
EXPAND_LIMIT = 40 * 2**30   # don't materialise repeat_interleave'd K/V past this
ROUNDS = 5                  # interleaved rounds per case (flashgen and each SDPA backend once per round)
REPS = 20                   # timed calls per implementation per round


def time_us(fn, copies, reps=40, warmup=5):
    """Median microseconds of ``fn(i)``, i rotating over ``copies`` input copies (timing.time_ms, fixed reps)."""
    calls = itertools.count()
    ms = timing.time_ms(lambda: fn(next(calls) % copies), min_reps=reps, max_reps=reps, warmup=warmup)["ms"]
    return ms * 1e3


def interleaved(fns, copies, rounds=ROUNDS, reps=REPS, warmup=3):
    """{name: [µs per round]}: every callable of ``fns`` timed once per round, in the given order on even
    rounds and reversed on odd ones, all inputs resident; a failing callable gets its error string."""
    times = {name: [] for name in fns}
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(fns)[::-1]
        for name in order:
            if isinstance(times[name], str):
                continue
            try:
                times[name].append(time_us(fns[name], copies, reps=reps, warmup=warmup))
            except Exception as exc:  # noqa: BLE001
                times[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
    return times


def summary(ts, nbytes):
    """Median, the rounds and their spread ((max - min) / median, in %) of one implementation."""
    us = statistics.median(ts)
    return {"us": us, "tbps": nbytes / us / 1e6, "rounds_us": ts, "spread_pct": (max(ts) - min(ts)) / us * 100}


def kv_bytes(b, hk, L):
    return 2 * b * L * hk * D * 2


def make_inputs(b, hq, hk, L):
    copies = max(1, min(16, math.ceil(ROTATE_BYTES / kv_bytes(b, hk, L))))
    qs = [torch.randn(b, 1, hq, D, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    ks = [torch.randn(b, hk, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    vs = [torch.randn(b, hk, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    return copies, qs, ks, vs


def sdpa_runner(backend, qs, ks, vs, hq, hk):
    """(callable(i), gqa mode) for one SDPA backend, or (None, reason)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = getattr(SDPBackend, backend)
    qh = [q.transpose(1, 2) for q in qs]  # (b, hq, 1, d)

    def call(q, k, v, gqa):
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa) if gqa else \
                F.scaled_dot_product_attention(q, k, v)

    if hq == hk:
        try:
            call(qh[0], ks[0], vs[0], False)
            return (lambda i: call(qh[i], ks[i], vs[i], False)), "none (MHA)"
        except Exception as exc:  # noqa: BLE001
            return None, f"error: {type(exc).__name__}: {str(exc)[:160]}"
    try:
        call(qh[0], ks[0], vs[0], True)
        return (lambda i: call(qh[i], ks[i], vs[i], True)), "enable_gqa"
    except Exception as exc:  # noqa: BLE001
        first = f"{type(exc).__name__}: {str(exc)[:120]}"
    expanded = sum(k.numel() for k in ks) * 2 * 2 * (hq // hk)
    if expanded > EXPAND_LIMIT:
        return None, f"skipped: enable_gqa refused ({first}); expanded K/V would be {expanded / 2**30:.0f} GiB"
    ke = [k.repeat_interleave(hq // hk, dim=1) for k in ks]
    ve = [v.repeat_interleave(hq // hk, dim=1) for v in vs]
    try:
        call(qh[0], ke[0], ve[0], False)
    except Exception as exc:  # noqa: BLE001
        return None, f"error: {type(exc).__name__}: {str(exc)[:160]}"
    return (lambda i: call(qh[i], ke[i], ve[i], False)), "repeat_interleave (outside timing; reads hq/hk x bytes)"


def bench_case(b, hq, hk, L, rounds=ROUNDS):
    copies, qs, ks, vs = make_inputs(b, hq, hk, L)
    nbytes = kv_bytes(b, hk, L)
    row = {"batch": b, "heads_q": hq, "heads_kv": hk, "L": L, "kv_bytes": nbytes, "copies": copies,
           "rounds": rounds}
    lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    kc = [k.transpose(1, 2) for k in ks]  # (b, L, hk, d) views
    vc = [v.transpose(1, 2) for v in vs]

    def fg(i):
        return flashgen.decode(qs[i], kc[i], vc[i], lens, check_values=False)

    fg(0)
    spec, splits = _plan_facts()
    fns, facts = {"flashgen": fg}, {"flashgen": {"splits": splits, "spec": spec}}
    for name, backend in (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION")):
        run, mode = sdpa_runner(backend, qs, ks, vs, hq, hk)
        if run is None:
            row[name] = {"error": mode}
            continue
        fns[name], facts[name] = run, {"gqa": mode}
    for name, ts in interleaved(fns, copies, rounds).items():
        if isinstance(ts, str):
            row[name] = {"error": ts, **facts[name]}
        else:
            row[name] = {**summary(ts, nbytes), **facts[name]}
    for name, key in (("sdpa_flash", "x_flash"), ("sdpa_cudnn", "x_cudnn")):
        if "us" in row[name] and "us" in row["flashgen"]:
            row[key] = row[name]["us"] / row["flashgen"]["us"]  # of the medians over the rounds
    del fns, qs, ks, vs, kc, vc
    torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def _plan_facts():
    """(spec name, splits) of the most recently planned flashgen.decode call."""
    from flashgen import decode_api

    plan = next(p for p in reversed(list(decode_api._plans.values())) if p.kernel is not None)
    return plan.spec.name, plan.splits


def bench_paged(b, hq, hk, L, page_sizes=(64, 256), rounds=ROUNDS):
    """Contiguous vs paged (random page order) bandwidth on the same lengths. All layouts are resident
    at once and timed interleaved over ``rounds`` rounds (``interleaved``), so a clock or thermal
    drift during the run shows as spread instead of as a layout difference; the ratio is of the
    medians over the rounds."""
    nbytes = kv_bytes(b, hk, L)
    copies = max(1, min(8, math.ceil(ROTATE_BYTES / nbytes)))
    qs = [torch.randn(b, 1, hq, D, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    out = {"batch": b, "heads_q": hq, "heads_kv": hk, "L": L, "kv_bytes": nbytes, "rounds": rounds}
    layouts = {}
    kc = [torch.randn(b, L, hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    vc = [torch.randn_like(k) for k in kc]
    layouts["contiguous"] = lambda i: flashgen.decode(qs[i], kc[i], vc[i], lens, check_values=False)
    for ps in page_sizes:
        pages = b * L // ps
        kp = [torch.randn(pages, ps, hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        vp = [torch.randn_like(k) for k in kp]
        bts = [torch.randperm(pages, device="cuda").to(torch.int32).view(b, L // ps) for _ in range(copies)]
        flashgen.decode(qs[0], kp[0], vp[0], lens, bts[0])  # value-checked once
        layouts[f"page{ps}"] = (lambda kp, vp, bts: lambda i: flashgen.decode(qs[i], kp[i], vp[i], lens, bts[i],
                                                                            check_values=False))(kp, vp, bts)
    for name, fn in layouts.items():
        fn(0)
        out[name] = dict(zip(("spec", "splits"), _plan_facts()))
    for name, ts in interleaved(layouts, copies, rounds).items():
        out[name].update(summary(ts, nbytes) if not isinstance(ts, str) else {"error": ts})
    for name in layouts:
        if name != "contiguous" and "us" in out[name] and "us" in out["contiguous"]:
            out[name]["vs_contiguous"] = out["contiguous"]["us"] / out[name]["us"]
    del layouts, kc, vc
    torch.cuda.empty_cache()
    print(json.dumps(out), flush=True)
    return out


def split_sweep(b, hq, hk, L, splits=(1, 4, 8, 16, 24, 29, 32, 48, 64, 96, 128)):
    copies, qs, ks, vs = make_inputs(b, hq, hk, L)
    lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    kc = [k.transpose(1, 2) for k in ks]
    vc = [v.transpose(1, 2) for v in vs]
    res = {"batch": b, "heads_q": hq, "heads_kv": hk, "L": L, "tbps": {}}
    for s in splits:
        us = time_us(lambda i: flashgen.decode(qs[i], kc[i], vc[i], lens, num_splits=s, check_values=False), copies)
        res["tbps"][s] = kv_bytes(b, hk, L) / us / 1e6
    print(json.dumps(res), flush=True)
    del qs, ks, vs, kc, vc
    torch.cuda.empty_cache()
    return res


def host_overhead(calls=200, rounds=20, warmup=1000):
    """Per-call host time with a cached kernel and plan: bursts of launches without a sync (the GPU
    work per call is tiny, so the host is what is measured), best of ``rounds``, after ``warmup``
    untimed calls per case (steady state: right after the table's large frees, the first case
    measured once read 21 us where it reads 14-16 in steady state, bench/NOTES.md "Session 10")."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 1, 32, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 512, 8, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((1,), 512, dtype=torch.int32, device="cuda")
    kp = torch.randn(8, 64, 8, D, device="cuda", dtype=torch.bfloat16)
    bt = torch.arange(8, dtype=torch.int32, device="cuda").view(1, 8)
    qh, kh = q.transpose(1, 2), k.transpose(1, 2).contiguous()

    def burst(fn):
        return timing.host_us(fn, calls, rounds)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(qh, kh, kh, enable_gqa=True)

    cases = {
        "flashgen_split_us": lambda: flashgen.decode(q, k, k, lens, check_values=False),
        "flashgen_nosplit_us": lambda: flashgen.decode(q, k, k, lens, num_splits=1, check_values=False),
        "flashgen_paged_us": lambda: flashgen.decode(q, kp, kp, lens, bt, check_values=False),
        "flashgen_checked_us": lambda: flashgen.decode(q, k, k, lens),
        "sdpa_flash_us": sdpa,
    }
    out = {}
    for name, fn in cases.items():
        try:
            for _ in range(warmup):
                fn()
            out[name] = burst(fn)
        except Exception as exc:  # noqa: BLE001
            out[name] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
    print(json.dumps(out), flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="only L = 32k, no sweep")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds per case and paged layout")
    ap.add_argument("--host-only", action="store_true", help="only the per-call host time")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.host_only:
        print(json.dumps({"meta": meta(), "host_overhead": host_overhead()}))
        return
    result = {"meta": meta(), "convention": "bf16, d=128, seqlen_q=1; TB/s = K+V bytes / median time; "
              f"flashgen and SDPA interleaved over {args.rounds} rounds x {REPS} calls, medians of the rounds",
              "rows": [], "paged": [], "sweep": []}
    lengths = [32768] if args.quick else LENGTHS
    for b, hq, hk in SHAPES:
        for L in lengths:
            result["rows"].append(bench_case(b, hq, hk, L, args.rounds))
    for b, hq, hk, L in ((1, 32, 8, 131072), (8, 32, 8, 32768), (32, 32, 8, 32768)):
        result["paged"].append(bench_paged(b, hq, hk, L, rounds=args.rounds))
    if not args.quick:
        for b, hq, hk, L in ((1, 32, 8, 131072), (1, 32, 32, 32768), (8, 32, 8, 131072)):
            result["sweep"].append(split_sweep(b, hq, hk, L))
    result["host_overhead"] = host_overhead()
    timing.write_json(args.out, result)
    print_table(result)


def print_table(result):
    def tb(r, k):
        return r.get(k, {}).get("tbps", float("nan"))

    def ratio(r, key, k):  # of the medians over the rounds (older results: of the single medians)
        return r.get(key, tb(r, "flashgen") / tb(r, k))

    def spread(r, k):
        return r.get(k, {}).get("spread_pct", float("nan"))

    print(f"\n{'b':>3} {'hq':>3} {'hk':>3} {'L':>7} {'KV MB':>7} | {'flashgen':>8} {'splits':>6} {'flash':>6} "
          f"{'cudnn':>6} | {'x flash':>7} {'x cudnn':>7} | {'spread % fg/cudnn':>17}   (TB/s; medians of rounds)")
    xs = []
    for r in result["rows"]:
        f, fl, cu = tb(r, "flashgen"), tb(r, "sdpa_flash"), tb(r, "sdpa_cudnn")
        xc = ratio(r, "x_cudnn", "sdpa_cudnn")
        xs.append(xc)
        print(f"{r['batch']:>3} {r['heads_q']:>3} {r['heads_kv']:>3} {r['L']:>7} {r['kv_bytes'] / 1e6:7.0f} | "
              f"{f:8.2f} {r['flashgen'].get('splits', '?'):>6} {fl:6.2f} {cu:6.2f} | "
              f"{ratio(r, 'x_flash', 'sdpa_flash'):7.3f} {xc:7.3f} | "
              f"{spread(r, 'flashgen'):8.2f}/{spread(r, 'sdpa_cudnn'):<8.2f}")
    good = [x for x in xs if x == x and x > 0]
    if good:
        print(f"x cudnn over {len(good)} cases: min {min(good):.3f}, geomean "
              f"{math.exp(sum(map(math.log, good)) / len(good)):.3f}; below 1.0: "
              + (", ".join(f"b{r['batch']}/hk{r['heads_kv']}/L{r['L']} {x:.3f}" for r, x in zip(result["rows"], xs)
                           if x == x and x < 1.0) or "none"))
    for r in result["rows"]:
        for k in ("sdpa_flash", "sdpa_cudnn"):
            if "error" in r.get(k, {}):
                print(f"  {k} b={r['batch']} hk={r['heads_kv']} L={r['L']}: {r[k]['error']}")
    gqa = {r[k].get("gqa") for r in result["rows"] for k in ("sdpa_flash", "sdpa_cudnn") if "gqa" in r.get(k, {})}
    print("SDPA GQA modes:", sorted(x for x in gqa if x))
    for p in result["paged"]:
        def rounds(v):
            r = v.get("rounds_us")
            return f", rounds {min(r):.1f}-{max(r):.1f} us" if r else ""

        print(f"paged b={p['batch']} hk={p['heads_kv']} L={p['L']}: contiguous {p['contiguous']['tbps']:.2f} TB/s "
              f"({p['contiguous'].get('splits', '?')} splits{rounds(p['contiguous'])}); "
              + "; ".join(f"{k} {v.get('tbps', float('nan')):.2f} TB/s ({v.get('vs_contiguous', float('nan')):.2f}x"
                          f"{rounds(v)})" for k, v in p.items() if k.startswith("page")))
    for s in result["sweep"]:
        print(f"splits b={s['batch']} hq={s['heads_q']} hk={s['heads_kv']} L={s['L']}: "
              + ", ".join(f"{k}:{v:.2f}" for k, v in s["tbps"].items()))
    print("host overhead per call (us):",
          {k: (round(v, 1) if isinstance(v, float) else v) for k, v in result["host_overhead"].items()})


if __name__ == "__main__":
    main()
