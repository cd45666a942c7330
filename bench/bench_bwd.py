"""Backward benchmark: forward + backward through autograd, flashgen next to torch SDPA's backends.

Convention (FlashAttention papers): hidden 2048 (heads = 2048 / d), batch = 16384 / seqlen,
forward FLOPs = 4 * B * H * N^2 * d (halved for causal), backward counted as 2.5x the forward,
so one forward + backward is 3.5x the forward's FLOPs. Times are medians of CUDA-event-timed
repeats after warm-up. flashgen runs twice: the default (dQ by fp32 atomics) and
``deterministic=True`` (a separate dQ kernel), so the cost of determinism is in the same table.

    python3 bench/bench_bwd.py --out bench/results/bwd_h200.json [--d 64,128] [--seqlens ...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import flashgen  # noqa: E402
from bench_fwd import flops, meta, time_ms  # noqa: E402

SDPA = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}
IMPLS = ("flashgen", "flashgen_det", *SDPA)


def fwd_bwd(name, q, k, v, dout, causal):
    """A closure running one forward + backward of implementation ``name``."""
    if name.startswith("flashgen"):
        det = name == "flashgen_det"

        def run():
            out = flashgen.attention(q, k, v, causal=causal, deterministic=det)
            out.backward(dout)
        return run
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA[name])

    def run():
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out.backward(dout)
    return run


def fwd_only(name, q, k, v, causal):
    if name.startswith("flashgen"):
        return lambda: flashgen.attention(q, k, v, causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA[name])

    def run():
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def bench_cell(n, d, causal, reps, warmup):
    b, h = max(1, 16384 // n), 2048 // d
    mk = lambda: torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = (mk().requires_grad_(True) for _ in range(3))
    dout = mk()
    f = flops(b, h, n, d, causal)
    row = {"seqlen": n, "head_dim": d, "causal": causal, "batch": b, "heads": h}
    for name in IMPLS:
        try:
            ms = time_ms(fwd_bwd(name, q, k, v, dout, causal), reps=reps, warmup=warmup)
            entry = {"ms": ms, "tflops": 3.5 * f / ms / 1e9}
            if name != "flashgen_det":
                with torch.no_grad():
                    fms = time_ms(fwd_only(name, q.detach(), k.detach(), v.detach(), causal), reps=reps,
                                  warmup=warmup)
                entry.update(fwd_ms=fms, bwd_ms=ms - fms, bwd_tflops=2.5 * f / max(ms - fms, 1e-9) / 1e9)
            row[name] = entry
        except Exception as exc:  # a backend that refuses a shape is recorded, not fatal
            row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        q.grad = k.grad = v.grad = None
    print(_line(row), flush=True)
    return row


def _t(row, key, field="tflops"):
    return row.get(key, {}).get(field, float("nan"))


def _line(r):
    return (f"{r['head_dim']:>4} {str(r['causal']):>6} {r['seqlen']:>6} | {_t(r, 'flashgen'):8.1f} "
            f"{_t(r, 'flashgen_det'):8.1f} {_t(r, 'sdpa_flash'):7.1f} {_t(r, 'sdpa_cudnn'):7.1f} | "
            f"{_t(r, 'flashgen') / _t(r, 'sdpa_flash'):7.2f} {_t(r, 'flashgen') / _t(r, 'sdpa_cudnn'):7.2f} "
            f"{_t(r, 'flashgen_det') / _t(r, 'flashgen'):6.2f} | bwd-only {_t(r, 'flashgen', 'bwd_tflops'):6.1f} "
            f"vs flash {_t(r, 'sdpa_flash', 'bwd_tflops'):6.1f}")


HEADER = (f"{'d':>4} {'causal':>6} {'N':>6} | {'flashgen':>8} {'fg_det':>8} {'flash':>7} {'cudnn':>7} | "
          f"{'x flash':>7} {'x cudnn':>7} {'det/fg':>6} | (fwd+bwd TFLOP/s, backward = 2.5x forward FLOPs)")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    result = {"meta": meta(), "convention": "hidden 2048, batch 16384/N, fwd 4BHN^2d FLOPs (causal /2), "
                                            "fwd+bwd = 3.5x fwd, bf16", "rows": []}
    print(HEADER, flush=True)
    for d in (int(x) for x in args.d.split(",")):
        for causal in (False, True):
            for n in (int(x) for x in args.seqlens.split(",")):
                result["rows"].append(bench_cell(n, d, causal, args.reps, args.warmup))
                if args.out:  # write as we go: a run cut short still leaves its rows
                    _write(args.out, result)
    print("\n" + HEADER)
    for r in result["rows"]:
        print(_line(r))


def _write(path, result):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as fh:
        json.dump(result, fh, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
