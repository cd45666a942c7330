"""Backward benchmark: forward + backward through autograd, flashgen next to torch SDPA's backends.

Convention (FlashAttention papers): hidden 2048 (heads = 2048 / d), batch = 16384 / seqlen,
forward FLOPs = 4 * B * H * N^2 * d (halved for causal), backward counted as 2.5x the forward,
so one forward + backward is 3.5x the forward's FLOPs. Times are medians of CUDA-event-timed
repeats after warm-up. flashgen runs twice: the default (dQ by fp32 atomics) and
``deterministic=True`` (a separate dQ kernel), so the cost of determinism is in the same table.

``flashgen_bwd90`` is the default forward with the Hopper backward (FLASHGEN_BWD_FAMILY=bwd_sm90,
sm_90a). ``--fwd90`` adds the derived column fg90 = fwd_sm90's forward (timed alone, spec=) + the
bwd_sm90 backward (timed alone): what the pair would give fwd+bwd. ``--direct`` times the backward
alone (attention_backward on a saved out/lse, no forward, no autograd) for the default dK/dV
family and for bwd_sm90, plus any ``--variants`` of bwd_sm90's default spec (``s2``/``s3``:
stages, ``h0``/``h1``: dQ write, ``n64``: 64-key tiles), printed as backward TFLOP/s.

    python3 bench/bench_bwd.py --out bench/results/bwd_h200.json [--d 64,128] [--seqlens ...]
    python3 bench/bench_bwd.py --impls flashgen,flashgen_bwd90,sdpa_flash,sdpa_cudnn --fwd90 --direct \
        --variants s3,h1 --seqlens 2048,4096,8192,16384
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
IMPLS = ("flashgen", "flashgen_det", "flashgen_bwd90", *SDPA)
BWD_ENV = "FLASHGEN_BWD_FAMILY"


class _family:
    """FLASHGEN_BWD_FAMILY=bwd_sm90 while timing flashgen_bwd90 (restored afterwards)."""

    def __init__(self, name):
        self.value = "bwd_sm90" if name == "flashgen_bwd90" else None

    def __enter__(self):
        self.old = os.environ.get(BWD_ENV)
        if self.value:
            os.environ[BWD_ENV] = self.value
        else:
            os.environ.pop(BWD_ENV, None)

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop(BWD_ENV, None)
        else:
            os.environ[BWD_ENV] = self.old


def variant_spec(d, causal, tag):
    """bwd_sm90's default spec for (d, causal) with one knob changed by ``tag`` (s2, s3, h0, h1, n64)."""
    from flashgen import dispatch

    base = dispatch.default_spec(dispatch.ProblemKey("bwd_sm90", "sm_90a", "bf16", d, causal, 4096), 232448)
    if tag in ("", "default"):
        return base
    if tag[0] == "s":
        return base.replace(stages=int(tag[1:]))
    if tag[0] == "h":
        return base.replace(hint=int(tag[1:]))
    if tag[0] == "n":
        bn = int(tag[1:])
        return base.replace(block_n=bn, warps=4 * (bn // 64 + 1))
    raise ValueError(f"unknown variant {tag!r} (s2, s3, h0, h1, n64)")


def bwd_direct(q, k, v, dout, causal, spec):
    """A closure running the backward alone (saved out/lse, no autograd); ``spec``: the dK/dV kernel
    (None: the default family)."""
    from flashgen.backward import attention_backward

    with torch.no_grad():
        out, lse = flashgen.attention(q.detach(), k.detach(), v.detach(), causal=causal, return_lse=True)
    scale = 1.0 / q.shape[-1] ** 0.5
    specs = {"bwd_dkdv": spec} if spec is not None else None
    args = (dout, q.detach(), k.detach(), v.detach(), out, lse, causal, scale)
    return lambda: attention_backward(*args, specs=specs)


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


def bench_cell(n, d, causal, reps, warmup, impls=IMPLS, fwd90=False, direct=False, variants=()):
    b, h = max(1, 16384 // n), 2048 // d
    mk = lambda: torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = (mk().requires_grad_(True) for _ in range(3))
    dout = mk()
    f = flops(b, h, n, d, causal)
    row = {"seqlen": n, "head_dim": d, "causal": causal, "batch": b, "heads": h}
    fwd_cache = {}
    for name in impls:
        try:
            with _family(name):
                ms = time_ms(fwd_bwd(name, q, k, v, dout, causal), reps=reps, warmup=warmup)
            entry = {"ms": ms, "tflops": 3.5 * f / ms / 1e9}
            if name != "flashgen_det":
                fkey = "flashgen" if name.startswith("flashgen") else name  # one forward for all flashgen rows
                if fkey not in fwd_cache:
                    with torch.no_grad():
                        fwd_cache[fkey] = time_ms(fwd_only(name, q.detach(), k.detach(), v.detach(), causal),
                                                  reps=reps, warmup=warmup)
                fms = fwd_cache[fkey]
                entry.update(fwd_ms=fms, bwd_ms=ms - fms, bwd_tflops=2.5 * f / max(ms - fms, 1e-9) / 1e9)
            row[name] = entry
        except Exception as exc:  # a backend that refuses a shape is recorded, not fatal
            row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        q.grad = k.grad = v.grad = None
    if direct or fwd90:
        row["direct"] = {}
        tags = ["default_family", "bwd_sm90", *variants]
        for tag in tags:
            try:
                spec = None if tag == "default_family" else variant_spec(d, causal, "" if tag == "bwd_sm90" else tag)
                ms = time_ms(bwd_direct(q, k, v, dout, causal, spec), reps=reps, warmup=warmup)
                row["direct"][tag] = {"spec": spec.name if spec else None, "ms": ms,
                                      "bwd_tflops": 2.5 * f / ms / 1e9}
            except Exception as exc:  # noqa: BLE001
                row["direct"][tag] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if fwd90:
        try:
            from flashgen import dispatch

            fspec = dispatch.default_spec(dispatch.ProblemKey("fwd_sm90", "sm_90a", "bf16", d, causal, 4096), 232448)
            with torch.no_grad():
                fms = time_ms(lambda: flashgen.attention(q.detach(), k.detach(), v.detach(), causal=causal,
                                                         spec=fspec), reps=reps, warmup=warmup)
            bms = row["direct"]["bwd_sm90"]["ms"]
            row["fg90"] = {"fwd_spec": fspec.name, "fwd_ms": fms, "bwd_ms": bms, "ms": fms + bms,
                           "tflops": 3.5 * f / (fms + bms) / 1e9, "fwd_tflops": f / fms / 1e9}
        except Exception as exc:  # noqa: BLE001
            row["fg90"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    print(_line(row), flush=True)
    if "direct" in row:
        print("      bwd alone (TFLOP/s): " + "  ".join(
            f"{tag} {e['bwd_tflops']:.1f}" if "bwd_tflops" in e else f"{tag} ERR {e['error'][:120]}"
            for tag, e in row["direct"].items()), flush=True)
    return row


def _t(row, key, field="tflops"):
    return row.get(key, {}).get(field, float("nan"))


def _line(r):
    return (f"{r['head_dim']:>4} {str(r['causal']):>6} {r['seqlen']:>6} | {_t(r, 'flashgen'):8.1f} "
            f"{_t(r, 'flashgen_det'):8.1f} {_t(r, 'flashgen_bwd90'):8.1f} {_t(r, 'fg90'):7.1f} "
            f"{_t(r, 'sdpa_flash'):7.1f} {_t(r, 'sdpa_cudnn'):7.1f} | "
            f"{_t(r, 'flashgen') / _t(r, 'sdpa_flash'):7.2f} {_t(r, 'flashgen_bwd90') / _t(r, 'sdpa_flash'):7.2f} "
            f"{_t(r, 'fg90') / _t(r, 'sdpa_flash'):7.2f} {_t(r, 'flashgen') / _t(r, 'sdpa_cudnn'):7.2f} "
            f"{_t(r, 'flashgen_det') / _t(r, 'flashgen'):6.2f} | bwd-only {_t(r, 'flashgen', 'bwd_tflops'):6.1f} "
            f"bwd90 {_t(r, 'flashgen_bwd90', 'bwd_tflops'):6.1f} vs flash {_t(r, 'sdpa_flash', 'bwd_tflops'):6.1f}")


HEADER = (f"{'d':>4} {'causal':>6} {'N':>6} | {'flashgen':>8} {'fg_det':>8} {'fg_bwd90':>8} {'fg90':>7} "
          f"{'flash':>7} {'cudnn':>7} | {'x flash':>7} {'bwd90/fl':>7} {'fg90/fl':>7} {'x cudnn':>7} {'det/fg':>6} | "
          "(fwd+bwd TFLOP/s, backward = 2.5x forward FLOPs; fg90 = fwd_sm90 + bwd_sm90, each timed alone)")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {IMPLS}")
    ap.add_argument("--fwd90", action="store_true", help="derived fg90 = fwd_sm90 forward + bwd_sm90 backward")
    ap.add_argument("--direct", action="store_true", help="time the backward alone (default family, bwd_sm90)")
    ap.add_argument("--variants", default="", help="bwd_sm90 variants timed alone: s2,s3,h0,h1,n64")
    ap.add_argument("--causal", default="both", choices=("both", "yes", "no"))
    args = ap.parse_args(argv)
    impls = tuple(x for x in args.impls.split(",") if x)
    unknown = set(impls) - set(IMPLS)
    if unknown:
        ap.error(f"unknown impls {sorted(unknown)}; known: {IMPLS}")
    variants = tuple(x for x in args.variants.split(",") if x)
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    torch.manual_seed(0)
    result = {"meta": meta(), "convention": "hidden 2048, batch 16384/N, fwd 4BHN^2d FLOPs (causal /2), "
                                            "fwd+bwd = 3.5x fwd, bf16", "rows": []}
    print(HEADER, flush=True)
    for d in (int(x) for x in args.d.split(",")):
        for causal in causals:
            for n in (int(x) for x in args.seqlens.split(",")):
                result["rows"].append(bench_cell(n, d, causal, args.reps, args.warmup, impls, args.fwd90,
                                                 args.direct, tuple(v for v in variants if v != "n64" or d == 64)))
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
