"""Forward benchmark: flashgen fwd_v2 next to torch SDPA's backends, same run.

Convention (FlashAttention papers): hidden 2048 (heads = 2048 / d), batch =
16384 / seqlen, FLOPs = 4 * B * H * N^2 * d, halved for causal. Times are
medians of CUDA-event-timed repeats after warm-up, on fresh random inputs.

    python3 bench/bench_fwd.py --out bench/results/fwd_h200.json [--d 64,128] [--seqlens ...]
    python3 bench/bench_fwd.py --sweep   # also time candidate tiles (to pick the default rule)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import flashgen  # noqa: E402
from flashgen import KernelSpec, iomodel  # noqa: E402
from flashgen.bench import timing  # noqa: E402

SDPA = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
}


def flops(b, h, n, d, causal):
    return iomodel.flops(b, h, n, n, d, causal)


def time_ms(fn, reps=30, warmup=5):
    """Median ms by CUDA events over at most ``reps`` repeats (flashgen.bench.timing, the one timer)."""
    return timing.time_ms(fn, budget_s=0.3, min_reps=min(10, reps), max_reps=reps, warmup=warmup)["ms"]


def sdpa_fn(backend, q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = getattr(SDPBackend, SDPA[backend])

    def run():
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def inputs(n, d, dtype=torch.bfloat16):
    b, h = max(1, 16384 // n), 2048 // d
    mk = lambda: torch.randn(b, h, n, d, device="cuda", dtype=dtype)  # noqa: E731
    return (b, h), mk(), mk(), mk()


def bench_cell(n, d, causal, impls, rounds=1):
    """TFLOP/s of each impl on one cell. ``rounds`` > 1: the impls take turns, round after round (so a
    clock or thermal drift touches all alike); each impl's time is the median of its rounds, and its
    rounds are kept (``rounds_ms``)."""
    (b, h), q, k, v = inputs(n, d)
    f = flops(b, h, n, d, causal)
    row = {"seqlen": n, "head_dim": d, "causal": causal, "batch": b, "heads": h, "rounds": rounds}
    fns, times = {}, {name: [] for name in impls}
    for name, make in impls.items():
        try:
            fns[name] = make(q, k, v, causal)
        except Exception as exc:  # a backend that refuses a shape is recorded, not fatal
            row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    for _ in range(rounds):
        for name, fn in fns.items():
            if name in row:
                continue
            try:
                times[name].append(time_ms(fn))
            except Exception as exc:  # noqa: BLE001
                row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    for name in fns:
        if name not in row:
            ms = statistics.median(times[name])
            row[name] = {"ms": ms, "tflops": f / ms / 1e9, "rounds_ms": times[name]}
    return row


def flashgen_impl(spec=None):
    return lambda q, k, v, causal: (lambda: flashgen.attention(q, k, v, causal=causal, spec=spec))


def sweep_candidates(d, causal, arch="sm_90a"):
    tiles = [(128, 64, 4, st, r) for st in (2, 3) for r in (0, 1, 2)] + [(128, 32, 4, 3, 0), (64, 64, 4, 2, 0),
                                                                         (128, 128, 8, 2, 0)]
    for bm, bn, w, st, r in tiles:
        spec = KernelSpec(kind="fwd_v2", arch=arch, dtype="bf16", head_dim=d, block_m=bm, block_n=bn, warps=w,
                          stages=st, refill=r, causal=causal)
        try:
            spec.validate()
        except ValueError:
            continue
        yield spec


def host_overhead_us(calls=100, rounds=20):
    """Per-call host time of flashgen.attention on a cached kernel.

    Times bursts of ``calls`` launches without synchronizing (well under the
    launch queue's depth, so the host is what is measured), best of ``rounds``;
    SDPA's flash backend timed the same way for scale.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)

    def burst(fn):
        return timing.host_us(fn, calls, rounds)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, q, q)

    fg = lambda: flashgen.attention(q, q, q)  # noqa: E731
    fg()
    sdpa()
    result = {"flashgen_us": burst(fg), "sdpa_flash_us": burst(sdpa)}
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        fg()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    print(buf.getvalue()[-2500:])
    return result


def peak_memory(n, h=16, d=128):
    """Bytes the call allocates beyond its inputs, output and LSE (batch 1)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    result = out.numel() * out.element_size() + lse.numel() * lse.element_size()
    return {"seqlen": n, "heads": h, "head_dim": d, "peak_extra_bytes": peak, "output_and_lse_bytes": result,
            "beyond_output_bytes": peak - result, "standard_attention_S_bytes": h * n * n * 2}


def meta():
    return timing.meta()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="time candidate tiles at 2k/8k too")
    ap.add_argument("--no-main", action="store_true", help="skip the main table")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds per cell (median counts)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    result = {"meta": meta(), "convention": "hidden 2048, batch 16384/N, 4BHN^2d FLOPs (causal /2), bf16",
              "rows": [], "sweep": []}
    impls = {"flashgen": flashgen_impl(), **{name: (lambda be: lambda q, k, v, c: sdpa_fn(be, q, k, v, c))(name)
                                             for name in SDPA}}
    ds = [int(x) for x in args.d.split(",")]
    if args.sweep:
        for d in ds:
            for causal in (False, True):
                for n in (2048, 8192):
                    cands = {s.name: flashgen_impl(s) for s in sweep_candidates(d, causal)}
                    row = bench_cell(n, d, causal, cands)
                    result["sweep"].append(row)
                    best = max((k for k in cands if "tflops" in row[k]), key=lambda k: row[k]["tflops"])
                    print(f"sweep d={d} causal={causal} N={n}: best {best} {row[best]['tflops']:.0f} TFLOP/s; "
                          + ", ".join(f"{'_'.join(k.split('_')[3:8])}={row[k].get('tflops', 0):.0f}" for k in cands),
                          flush=True)
    if not args.no_main:
        for d in ds:
            for causal in (False, True):
                for n in (int(x) for x in args.seqlens.split(",")):
                    result["rows"].append(bench_cell(n, d, causal, impls, args.rounds))
        result["host_overhead"] = host_overhead_us()
        result["memory"] = [peak_memory(16384), peak_memory(65536)]
    timing.write_json(args.out, result)
    print_table(result)


def print_table(result):
    rows = result["rows"]
    if not rows:
        return
    print(f"\n{'d':>4} {'causal':>6} {'N':>6} | {'flashgen':>8} {'flash':>7} {'cudnn':>7} {'effic':>7} | "
          f"{'x flash':>7} {'x cudnn':>7}   (TFLOP/s)")
    for r in rows:
        t = lambda k: r[k].get("tflops", float("nan"))  # noqa: E731
        print(f"{r['head_dim']:>4} {str(r['causal']):>6} {r['seqlen']:>6} | {t('flashgen'):8.1f} "
              f"{t('sdpa_flash'):7.1f} {t('sdpa_cudnn'):7.1f} {t('sdpa_efficient'):7.1f} | "
              f"{t('flashgen') / t('sdpa_flash'):7.2f} {t('flashgen') / t('sdpa_cudnn'):7.2f}")
    if "host_overhead" in result:
        print("host overhead per call (us):", {k: round(v, 1) for k, v in result["host_overhead"].items()})
    for m in result.get("memory", []):
        print(f"memory N={m['seqlen']}: beyond output+lse {m['beyond_output_bytes']} B "
              f"(standard attention's S alone: {m['standard_attention_S_bytes'] / 2**30:.1f} GiB)")


if __name__ == "__main__":
    main()
