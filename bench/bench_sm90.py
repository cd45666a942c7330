"""fwd_sm90 vs fwd_v2 vs torch SDPA (flash, cuDNN) on the hidden-2048 convention, plus the flag ablation.

    python bench/bench_sm90.py --out DIR [--quick] [--flags NAME] [--flags-d64 NAME]

Shapes: batch = 16384 / N, heads = 2048 / d, bf16, bhsd. TFLOP/s = 4 b h N^2 d /
time (halved when causal). Writes DIR/sm90.json (sm90.partial.json while
running) and prints a table; the ablation (each flag set of fwd_sm90 on the
same cells, families.SM90_ABLATION, beside cuDNN) follows, and the per-call host
time with cached descriptors. Flag sets are named as in families.sm90_flag_set
(``ws_pp_kv_lz_e1_s3_m192``: warpspec + ping-pong, sepkv, lazy, emu 1, 3 stages,
block_m 192; ``_ps``: persist, the persistent kernel).

    python bench/bench_sm90.py --out DIR --persist [--seqlens 2048,8192] [--dims 128,64]

times only the persistent kernel against its non-persistent twin: per cell the shipped default path
(dispatch's pick), the same spec with persist=True, PERSIST_PAIRS' named flag sets with and without
``_ps``, and cuDNN; writes DIR/persist.json.

    python bench/bench_sm90.py --out DIR --order [--seqlens ...] [--dims ...] [--rounds R]

the causal tile order (variant_table): the default spec in the L2-section order and in the old
pair-after-pair order, persist, ORDER_ALTS; then the non-causal default vs persist; writes DIR/order.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402

import flashgen  # noqa: E402
from flashgen import dispatch  # noqa: E402
from flashgen.families import SM90_ABLATION, SM90_FLAG_BASES, sm90_named_spec  # noqa: E402

from bench_fwd import flops, sdpa_fn, time_ms  # noqa: E402  (same folder)

FLAGS = SM90_FLAG_BASES  # the base names; any families.sm90_flag_set name is accepted
# Ablation cells: (d, causal, N); --quick keeps the first four (d = 128 and 64 at 8k, causal both).
ABLATION_CELLS = [(128, False, 8192), (128, True, 8192), (64, False, 8192), (64, True, 8192), (256, False, 4096)]
ABLATION_256 = ("plain", "ws", "ws_pp", "full", "ws_kv", "ws_pp_kv", "ws_pp_kv_lz", "ws_pp_kv_lz_e1")


# --persist: the named flag sets timed with and without persist, per head dim.
PERSIST_PAIRS = {128: ("ws_ov_s3", "full_s3_n112"), 64: ("ws_s3_m192", "full_s3_m192")}


def sm90_spec(d, causal, flags="full", bm=None, bn=None, stages=None):
    fields = {k: v for k, v in (("block_m", bm), ("block_n", bn), ("stages", stages)) if v is not None}
    return sm90_named_spec(dispatch.sm90_head_dim_tile(d), causal, flags, **fields)


def ablation_sets(d):
    return (*SM90_ABLATION.get(d, ABLATION_256), "plain_m64")


def cell(n, d, causal, impls, reps):
    b, h = max(1, 16384 // n), 2048 // d
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    f = flops(b, h, n, d, causal)
    row = {"seqlen": n, "head_dim": d, "causal": causal, "batch": b, "heads": h}
    for name, make in impls.items():
        try:
            ms = time_ms(make(q, k, v, causal), reps=reps, warmup=3)
            row[name] = {"ms": ms, "tflops": f / ms / 1e9}
        except Exception as exc:  # noqa: BLE001 -- recorded, not fatal
            row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return row


def interleaved(n, d, causal, run, rounds, reps):
    """``cell`` over ``rounds`` rounds, each starting one impl of ``run`` later (none is always timed
    first): the cell's row with each impl's median-TFLOP/s round and all its rounds (``rounds_tflops``)."""
    names = list(run)
    rounds_rows = []
    for i in range(rounds):
        turn = names[i % len(names):] + names[:i % len(names)]
        rounds_rows.append(cell(n, d, causal, {k: run[k] for k in turn}, reps))
    row = dict(rounds_rows[0])
    for k in names:
        ok = sorted((r[k] for r in rounds_rows if "tflops" in r[k]), key=lambda x: x["tflops"])
        row[k] = dict(ok[(len(ok) - 1) // 2]) if ok else rounds_rows[0][k]
        row[k]["rounds_tflops"] = [r[k].get("tflops") for r in rounds_rows]
    return row


def fg(spec=None):
    return lambda q, k, v, causal: (lambda: flashgen.attention(q, k, v, causal=causal, spec=spec))


def host_us(spec, calls=100):
    """Per-call host time of a cached ``spec`` (flashgen.bench.timing.host_us, the one host timer)."""
    from flashgen.bench import timing

    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fn = lambda: flashgen.attention(q, k, v, spec=spec)  # noqa: E731
    fn()
    return timing.host_us(fn, calls)


def default_spec(d, causal, n):
    """The spec the shipped default path (tuned table, else the default rule) picks for this cell."""
    from flashgen import api

    dev = api._Device.of(torch.cuda.current_device())  # as api._plan asks (without compiling anything)
    key = dispatch.ProblemKey("fwd", dev.arch, "bf16", dispatch.head_dim_tile(d), causal, dispatch.bucket_of(n))
    return dispatch.select(key, dev.gpu, dev.smem_budget)


def with_env(spec, env):
    """fg(spec) with environment knobs (FLASHGEN_TILE_SECTION, ...) set for its plan: the plan cache is
    cleared when the cell makes the callable, so the next plan reads them; they are unset again after."""
    from flashgen import api

    def make(q, k, v, causal):
        for name in ("FLASHGEN_TILE_SECTION",):
            os.environ.pop(name, None)
        os.environ.update(env)
        api._plans.clear()
        fn = fg(spec)(q, k, v, causal)
        fn()  # the plan is made now, with env
        for name in env:
            os.environ.pop(name)
        return fn
    return make


# --order: named flag sets timed beside the default per causal cell (fwd_sm90, families.sm90_flag_set names).
ORDER_ALTS = {128: ("ws_ov_s3", "ws_pp", "ws_pp_s3"), 64: ("ws_s3_m192", "ws_ov_s3", "ws_pp_kv_s3_m192")}
ORDER_ALTS_FULL = {128: ("ws_ov_s3_m192_n80", "ws_pp_s3"), 64: ()}  # non-causal cells


def variant_table(out, seqlens, dims, order=False, reps=10, rounds=1, alts=True):
    """--persist: the default path vs the same spec with persist, named pairs with and without _ps, cuDNN.
    --order (causal cells, then non-causal): the default spec in the shipped tile order (api.tile_sections),
    in sections of half the L2 (default_l2half) and in the old order (FLASHGEN_TILE_SECTION=1: one
    (batch, head) pair's m-blocks after another), its twin with or without persist in the shipped and the
    old order, and (unless --no-alts) ORDER_ALTS' / ORDER_ALTS_FULL's flag sets with and without _ps.
    ``rounds`` repeats every cell, each round starting one impl later (the median round counts)."""
    from multiprocessing.pool import ThreadPool

    from flashgen import api, gpus
    from flashgen.codegen import build

    h200 = gpus.get("h200")
    cells = [(d, c, n) for d in dims for c in ((True, False) if order else (False, True)) for n in seqlens]
    plans = {}
    for d, c, n in cells:
        base = default_spec(d, c, n)
        impls = {"default": (base, {})}
        if order:
            impls["default_sec1"] = (base, {"FLASHGEN_TILE_SECTION": "1"})
            if base.kind == "fwd_sm90":  # sections of half the L2 instead of the shipped quarter
                l2 = api._Device.of(torch.cuda.current_device()).l2_bytes
                half = max(1, (l2 // 2) // (2 * n * base.head_dim * 2))
                impls["default_l2half"] = (base, {"FLASHGEN_TILE_SECTION": str(half)})
        if base.kind == "fwd_sm90" and base.warpspec:
            ps = base.replace(persist=not base.persist)  # the default's twin, with or without persist
            impls["default_ps" if ps.persist else "default_nops"] = (ps, {})
            if order:
                impls[("default_ps" if ps.persist else "default_nops") + "_sec1"] = (ps, {"FLASHGEN_TILE_SECTION": "1"})
        for f in ((ORDER_ALTS if c else ORDER_ALTS_FULL).get(d, ()) if order else PERSIST_PAIRS.get(d, ())) * alts:
            if sm90_spec(d, c, f) != base:  # (the default may be this very spec)
                impls[f], impls[f + "_ps"] = (sm90_spec(d, c, f), {}), (sm90_spec(d, c, f + "_ps"), {})
        plans[(d, c, n)] = {k: se for k, se in impls.items() if not se[0].check(h200)}

    def try_build(s):
        try:
            build(s)
        except Exception as exc:  # noqa: BLE001 -- the cell that uses it records the error
            print("compile failed:", s.name, str(exc)[:300], flush=True)

    specs = sorted({se[0] for p in plans.values() for se in p.values()}, key=lambda s: s.name)
    t0 = time.time()
    with ThreadPool(16) as pool:
        pool.map(try_build, specs)
    print(f"precompiled {len(specs)} kernels in {time.time() - t0:.1f}s", flush=True)
    rows = []
    for (d, c, n), impls in plans.items():
        run = {k: with_env(s, env) for k, (s, env) in impls.items()}
        run["sdpa_cudnn"] = lambda q, k, v, cz: sdpa_fn("sdpa_cudnn", q, k, v, cz)
        row = interleaved(n, d, c, run, rounds, reps)
        row["specs"] = {k: se[0].name for k, se in impls.items()}
        row["env"] = {k: se[1] for k, se in impls.items() if se[1]}
        rows.append(row)
        t = {k: row[k].get("tflops", float("nan")) for k in run}
        cu = t["sdpa_cudnn"]
        print(f"d={d:3d} causal={str(c):5s} N={n:5d} cudnn={cu:.0f} | "
              + "  ".join(f"{k}={t[k]:.0f} ({t[k] / cu:.2f}x)" for k in run if k != "sdpa_cudnn")
              + f"   [default: {impls['default'][0].name}]", flush=True)
        for k in run:
            if "error" in row[k]:
                print(f"   {k}: {row[k]['error']}", flush=True)
        with open(os.path.join(out, "order.json" if order else "persist.json"), "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "cells": rows}, fh, indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--flags", default="full", help="fwd_sm90 flag set of the main table (families.sm90_flag_set)")
    ap.add_argument("--flags-d64", default=None, help="the main table's flag set at d=64 (default: --flags)")
    ap.add_argument("--no-ablation", action="store_true")
    ap.add_argument("--persist", action="store_true", help="only the persist table (see the module doc)")
    ap.add_argument("--order", action="store_true", help="only the causal tile-order table (see the module doc)")
    ap.add_argument("--seqlens", default="2048,8192", help="--persist, --order: sequence lengths")
    ap.add_argument("--dims", default="128,64", help="--persist, --order: head dims")
    ap.add_argument("--no-alts", action="store_true", help="--persist, --order: the default's variants only")
    ap.add_argument("--rounds", type=int, default=1, help="--persist, --order: rounds per cell (median counts)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.persist or args.order:
        variant_table(args.out, [int(x) for x in args.seqlens.split(",")], [int(x) for x in args.dims.split(",")],
                      order=args.order, rounds=args.rounds, alts=not args.no_alts)
        return
    seqlens = [2048, 8192] if args.quick else [2048, 4096, 8192, 16384]
    reps = 10
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cells": [], "ablation": [],
              "host_us": {}}
    partial = os.path.join(args.out, "sm90.partial.json")

    def save():
        with open(partial, "w") as fh:
            json.dump(result, fh, indent=1)

    from multiprocessing.pool import ThreadPool

    from flashgen.codegen import build

    main_flags = {64: args.flags_d64 or args.flags, 128: args.flags}
    abl_cells = ABLATION_CELLS[:4] if args.quick else ABLATION_CELLS
    specs = {sm90_spec(d, c, main_flags[d]) for d in (64, 128) for c in (False, True)}
    if not args.no_ablation:
        specs |= {sm90_spec(d, c, f) for d, c, _ in abl_cells for f in ablation_sets(d)}
    print("main table:", {d: sm90_spec(d, False, f).name for d, f in main_flags.items()}, flush=True)

    def try_build(s):
        try:
            build(s)
        except Exception as exc:  # noqa: BLE001 -- the cell that uses it records the error
            print("compile failed:", s.name, str(exc)[:300], flush=True)

    t0 = time.time()
    with ThreadPool(12) as pool:
        pool.map(try_build, sorted(specs, key=lambda s: s.name))
    print(f"precompiled {len(specs)} fwd_sm90 kernels in {time.time() - t0:.1f}s", flush=True)
    try:
        result["host_us"]["fwd_sm90"] = host_us(sm90_spec(64, False))
        result["host_us"]["fwd_v2"] = host_us(None)
    except Exception as exc:  # noqa: BLE001
        result["host_us"]["error"] = f"{type(exc).__name__}: {exc}"
    print("host time per call (us):", result["host_us"], flush=True)
    save()

    print(f"\n{'d':>4} {'causal':>6} {'N':>6} | {'sm90':>7} {'v2':>7} {'flash':>7} {'cudnn':>7} | {'x cudnn':>7}"
          "   (TFLOP/s)", flush=True)
    for d in (64, 128):
        for causal in (False, True):
            for n in seqlens:
                impls = {"fwd_sm90": fg(sm90_spec(d, causal, main_flags[d])), "fwd_v2": fg(None),
                         "sdpa_flash": lambda q, k, v, c: sdpa_fn("sdpa_flash", q, k, v, c),
                         "sdpa_cudnn": lambda q, k, v, c: sdpa_fn("sdpa_cudnn", q, k, v, c)}
                row = cell(n, d, causal, impls, reps)
                result["cells"].append(row)
                save()
                t = lambda k: row[k].get("tflops", float("nan"))  # noqa: E731
                print(f"{d:4d} {str(causal):>6} {n:6d} | {t('fwd_sm90'):7.1f} {t('fwd_v2'):7.1f} "
                      f"{t('sdpa_flash'):7.1f} {t('sdpa_cudnn'):7.1f} | {t('fwd_sm90') / t('sdpa_cudnn'):7.2f}"
                      + ("" if "tflops" in row["fwd_sm90"] else f"   sm90: {row['fwd_sm90'].get('error')}"),
                      flush=True)

    if args.no_ablation:
        return
    print("\nablation (fwd_sm90 TFLOP/s per flag set, families.sm90_flag_set names; cuDNN in the same cell)",
          flush=True)
    for d, causal, n in abl_cells:
        impls = {f: fg(sm90_spec(d, causal, f)) for f in ablation_sets(d)}
        impls["sdpa_cudnn"] = lambda q, k, v, c: sdpa_fn("sdpa_cudnn", q, k, v, c)
        row = cell(n, d, causal, impls, reps)
        result["ablation"].append(row)
        save()
        t = {k: row[k].get("tflops", float("nan")) for k in impls}
        best = max((k for k in impls if k != "sdpa_cudnn" and t[k] == t[k]), key=t.get, default=None)
        print(f"d={d:3d} causal={str(causal):5s} N={n:5d}: cudnn={t['sdpa_cudnn']:.0f}"
              + (f"  best {best}={t[best]:.0f} ({t[best] / t['sdpa_cudnn']:.2f}x cudnn)" if best else ""), flush=True)
        names = [k for k in impls if k != "sdpa_cudnn"]
        for i in range(0, len(names), 6):
            print("    " + "  ".join(f"{k}={t[k]:.0f}" for k in names[i:i + 6]), flush=True)
        for k in impls:
            if "error" in row[k]:
                print(f"   {k}: {row[k]['error']}", flush=True)
    with open(os.path.join(args.out, "sm90.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    os.remove(partial)


if __name__ == "__main__":
    main()
