"""Decode benchmark: flashgen.decode (Flash-Decoding) next to torch SDPA's flash and cuDNN backends.

bf16, d = 128, one new token per sequence (seqlen_q = 1), (batch, heads_q, heads_kv) in (1,32,32),
(1,32,8), (8,32,8), (32,32,8), cache length L in {4k, 32k, 128k}. Bandwidth = bytes of K and V read
(2 * batch * L * heads_kv * d * 2) / time. Times are medians of CUDA-event-timed calls; where the
K/V of one case is smaller than 256 MB, calls rotate over several copies so that L2 (50 MB) never
serves them. flashgen reads the cache (batch, L, heads_kv, d) as a strided view of the same
(batch, heads_kv, L, d) tensors SDPA gets. SDPA gets GQA through ``enable_gqa=True`` when the backend
takes it, else K/V expanded with repeat_interleave outside the timed region (recorded per row as
"gqa"). Also: paged (page 64, 256) vs contiguous bandwidth, a split-count sweep, and host overhead.

    python3 bench/bench_decode.py --out bench/results/decode_h200.json
"""
from __future__ import annotations

import argparse
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


def time_us(fn, copies, reps=40, warmup=5):
    for i in range(warmup):
        fn(i % copies)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i, (s, e) in enumerate(zip(starts, ends)):
        s.record()
        fn(i % copies)
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


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


def bench_case(b, hq, hk, L):
    copies, qs, ks, vs = make_inputs(b, hq, hk, L)
    nbytes = kv_bytes(b, hk, L)
    row = {"batch": b, "heads_q": hq, "heads_kv": hk, "L": L, "kv_bytes": nbytes, "copies": copies}
    lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    kc = [k.transpose(1, 2) for k in ks]  # (b, L, hk, d) views
    vc = [v.transpose(1, 2) for v in vs]

    def fg(i):
        return flashgen.decode(qs[i], kc[i], vc[i], lens, check_values=False)

    fg(0)
    from flashgen import decode_api
    plan = next(p for p in reversed(list(decode_api._plans.values())) if p.kernel is not None)
    us = time_us(fg, copies)
    row["flashgen"] = {"us": us, "tbps": nbytes / us / 1e6, "splits": plan.splits, "spec": plan.spec.name}
    for name, backend in (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION")):
        run, mode = sdpa_runner(backend, qs, ks, vs, hq, hk)
        if run is None:
            row[name] = {"error": mode}
            continue
        try:
            us = time_us(run, copies)
            row[name] = {"us": us, "tbps": nbytes / us / 1e6, "gqa": mode}
        except Exception as exc:  # noqa: BLE001
            row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}", "gqa": mode}
        torch.cuda.empty_cache()
    del qs, ks, vs, kc, vc
    torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def _plan_facts():
    """(spec name, splits) of the most recently planned flashgen.decode call."""
    from flashgen import decode_api

    plan = next(p for p in reversed(list(decode_api._plans.values())) if p.kernel is not None)
    return plan.spec.name, plan.splits


def bench_paged(b, hq, hk, L, page_sizes=(64, 256), rounds=3):
    """Contiguous vs paged (random page order) bandwidth on the same lengths. All layouts are resident
    at once and timed in turn, ``rounds`` times (contiguous, page64, page256, contiguous, ...), so a
    clock or thermal drift during the run shows as spread instead of as a layout difference; the
    ratio is of the medians over the rounds."""
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
    times = {name: [] for name in layouts}
    for name, fn in layouts.items():
        fn(0)
        out[name] = dict(zip(("spec", "splits"), _plan_facts()))
    for _ in range(rounds):
        for name, fn in layouts.items():
            times[name].append(time_us(fn, copies))
    for name, ts in times.items():
        us = statistics.median(ts)
        out[name].update(us=us, tbps=nbytes / us / 1e6, rounds_us=ts)
        if name != "contiguous":
            out[name]["vs_contiguous"] = out["contiguous"]["us"] / us
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


def host_overhead(calls=200, rounds=20):
    """Per-call host time with a cached kernel and plan: bursts of launches without a sync (the GPU
    work per call is tiny, so the host is what is measured), best of ``rounds``."""
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
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    result = {"meta": meta(), "convention": "bf16, d=128, seqlen_q=1; TB/s = K+V bytes / median time",
              "rows": [], "paged": [], "sweep": []}
    lengths = [32768] if args.quick else LENGTHS
    for b, hq, hk in SHAPES:
        for L in lengths:
            result["rows"].append(bench_case(b, hq, hk, L))
    for b, hq, hk, L in ((1, 32, 8, 131072), (8, 32, 8, 32768), (32, 32, 8, 32768)):
        result["paged"].append(bench_paged(b, hq, hk, L))
    if not args.quick:
        for b, hq, hk, L in ((1, 32, 8, 131072), (1, 32, 32, 32768), (8, 32, 8, 131072)):
            result["sweep"].append(split_sweep(b, hq, hk, L))
    result["host_overhead"] = host_overhead()
    timing.write_json(args.out, result)
    print_table(result)


def print_table(result):
    def tb(r, k):
        return r.get(k, {}).get("tbps", float("nan"))

    print(f"\n{'b':>3} {'hq':>3} {'hk':>3} {'L':>7} {'KV MB':>7} | {'flashgen':>8} {'splits':>6} {'flash':>6} "
          f"{'cudnn':>6} | {'x flash':>7} {'x cudnn':>7}   (TB/s)")
    for r in result["rows"]:
        f, fl, cu = tb(r, "flashgen"), tb(r, "sdpa_flash"), tb(r, "sdpa_cudnn")
        print(f"{r['batch']:>3} {r['heads_q']:>3} {r['heads_kv']:>3} {r['L']:>7} {r['kv_bytes'] / 1e6:7.0f} | "
              f"{f:8.2f} {r['flashgen']['splits']:>6} {fl:6.2f} {cu:6.2f} | {f / fl:7.2f} {f / cu:7.2f}")
    for r in result["rows"]:
        for k in ("sdpa_flash", "sdpa_cudnn"):
            if "error" in r.get(k, {}):
                print(f"  {k} b={r['batch']} hk={r['heads_kv']} L={r['L']}: {r[k]['error']}")
    gqa = {r[k].get("gqa") for r in result["rows"] for k in ("sdpa_flash", "sdpa_cudnn") if "gqa" in r.get(k, {})}
    print("SDPA GQA modes:", sorted(x for x in gqa if x))
    for p in result["paged"]:
        def spread(v):
            r = v.get("rounds_us")
            return f", rounds {min(r):.1f}-{max(r):.1f} us" if r else ""

        print(f"paged b={p['batch']} hk={p['heads_kv']} L={p['L']}: contiguous {p['contiguous']['tbps']:.2f} TB/s "
              f"({p['contiguous'].get('splits', '?')} splits{spread(p['contiguous'])}); "
              + "; ".join(f"{k} {v['tbps']:.2f} TB/s ({v['vs_contiguous']:.2f}x{spread(v)})" for k, v in p.items()
                          if k.startswith("page")))
    for s in result["sweep"]:
        print(f"splits b={s['batch']} hq={s['heads_q']} hk={s['heads_kv']} L={s['L']}: "
              + ", ".join(f"{k}:{v:.2f}" for k, v in s["tbps"].items()))
    print("host overhead per call (us):",
          {k: (round(v, 1) if isinstance(v, float) else v) for k, v in result["host_overhead"].items()})


if __name__ == "__main__":
    main()
