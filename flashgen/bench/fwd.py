"""The ``fwd`` suite: forward attention, flashgen's families next to torch's, in one run.

Convention of the FlashAttention papers: hidden size 2048 (heads = 2048 / d),
16k tokens per batch (batch = 16384 / N), FLOPs 4·B·H·N²·d, halved for causal;
bf16 by default. Implementations:

- ``flashgen_v2``, ``flashgen_v1``, ``flashgen_standard``: ``flashgen.attention(algorithm=...)``;
- ``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``, ``sdpa_math``: torch SDPA with one backend forced;
- ``flex``: ``torch.nn.attention.flex_attention`` under ``torch.compile`` (one compile per shape,
  with dynamo's recompile limit raised so every shape runs compiled; a block mask when causal).

``sdpa_math`` is skipped above ``--math-max-seqlen`` (it materialises N x N in
fp32 and takes seconds); anything that raises is recorded with its error.
"""
from __future__ import annotations

import time

from . import Suite, register

IMPLS = ("flashgen_v2", "flashgen_v1", "flashgen_standard", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient",
         "sdpa_math", "flex")
_SDPA = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION",
         "sdpa_math": "MATH"}


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} takes comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"--{what} takes positive integers, got {text!r}")
    return values


def add_args(p) -> None:
    p.add_argument("--d", default="64,128", help="head dims, comma-separated (default 64,128)")
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384", help="sequence lengths, comma-separated")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both", help="causal, non-causal or both")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"implementations to time (default all: {','.join(IMPLS)})")
    p.add_argument("--math-max-seqlen", type=int, default=4096, help="skip sdpa_math above this seqlen")
    p.add_argument("--budget", type=float, default=0.25, help="seconds of timed repeats per cell (3..30 repeats)")


def parse(args) -> dict:
    """The suite's settings from parsed arguments; ValueError on a bad value (before touching a GPU)."""
    impls = [x.strip() for x in args.impls.split(",") if x.strip()]
    unknown = [x for x in impls if x not in IMPLS]
    if unknown or not impls:
        raise ValueError(f"--impls: unknown {unknown or 'empty list'}; known: {', '.join(IMPLS)}")
    heads = _ints(args.d, "d")
    for d in heads:
        if d % 8 or d > 256:
            raise ValueError(f"--d {d}: head dims are multiples of 8 up to 256")
    causal = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    if args.budget <= 0:
        raise ValueError(f"--budget must be positive, got {args.budget}")
    return {"d": heads, "seqlens": _ints(args.seqlens, "seqlens"), "causal": causal, "dtype": args.dtype,
            "impls": impls, "math_max_seqlen": args.math_max_seqlen, "budget": args.budget}


def _flex():
    """torch.compile'd flex_attention (one object per process; dynamo recompiles it per shape)."""
    import torch
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 4096))
    from torch.nn.attention.flex_attention import flex_attention

    if not hasattr(_flex, "fn"):
        _flex.fn = torch.compile(flex_attention, dynamic=False)
    return _flex.fn


def _make(impl, q, k, v, causal):
    """A no-argument callable running ``impl`` once on q, k, v."""
    import torch.nn.functional as F

    import flashgen

    if impl.startswith("flashgen_"):
        algorithm = impl.split("_", 1)[1]
        return lambda: flashgen.attention(q, k, v, causal=causal, algorithm=algorithm)
    if impl in _SDPA:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, _SDPA[impl])

        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run
    from torch.nn.attention.flex_attention import create_block_mask

    fn = _flex()
    n = q.shape[2]
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n, device=q.device) if causal else None
    return lambda: fn(q, k, v, block_mask=mask)


def prebuild(settings, progress) -> None:
    """Compile every flashgen kernel the run needs, in parallel, before any timing."""
    from multiprocessing.pool import ThreadPool

    from .. import dispatch
    from ..api import _Device
    from ..baseline_specs import STANDARD_KINDS, V1_KIND
    from ..codegen import build

    dev = _Device.of(0)
    # flashgen_v2 is what flashgen.attention runs: the "fwd" key's pick, of any forward family.
    kinds = {"flashgen_v2": ("fwd",), "flashgen_v1": (V1_KIND,), "flashgen_standard": STANDARD_KINDS}
    specs = set()
    for impl in settings["impls"]:
        for kind in kinds.get(impl, ()):
            for d in settings["d"]:
                for causal in settings["causal"]:
                    for n in settings["seqlens"]:
                        key = dispatch.ProblemKey(kind, dev.arch, settings["dtype"], dispatch.head_dim_tile(d),
                                                  causal, dispatch.bucket_of(n))
                        specs.add(dispatch.select(key, dev.gpu, dev.smem_budget, verify=True))
    t0 = time.time()
    with ThreadPool(8) as pool:
        pool.map(lambda s: _quiet(build, s), sorted(specs, key=lambda s: s.name))
    progress(f"compiled {len(specs)} flashgen kernels in {time.time() - t0:.1f} s")


def _quiet(fn, *args):
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 -- the timed call reports the same error in its cell
        return None


def run(args, progress) -> dict:
    """Time every (head dim, causal, seqlen) cell; ``args.checkpoint(result)``, when set, gets the
    result so far after each row."""
    import torch

    from ..iomodel import flops, hidden2048
    from .timing import meta, time_ms

    settings = parse(args)
    if not torch.cuda.is_available():
        from ..errors import FlashgenError

        raise FlashgenError("flashgen bench fwd needs a CUDA device (plots of a stored result do not: "
                            "--plot-from FILE)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[settings["dtype"]]
    meta_info = meta()
    checkpoint = getattr(args, "checkpoint", None)
    if any(i.startswith("flashgen_") for i in settings["impls"]):
        prebuild(settings, progress)
    rows = []
    for d in settings["d"]:
        for causal in settings["causal"]:
            for n in settings["seqlens"]:
                b, h = hidden2048(n, d)
                f = flops(b, h, n, n, d, causal)
                torch.manual_seed(n * 1000 + d)
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
                row = {"head_dim": d, "causal": causal, "seqlen": n, "batch": b, "heads": h, "flops": f,
                       "results": {}}
                for impl in settings["impls"]:
                    if impl == "sdpa_math" and n > settings["math_max_seqlen"]:
                        row["results"][impl] = {"skipped": f"seqlen {n} > --math-max-seqlen "
                                                           f"{settings['math_max_seqlen']} (N x N fp32, slow)"}
                        continue
                    t0 = time.time()
                    try:
                        timed = time_ms(_make(impl, q, k, v, causal), budget_s=settings["budget"])
                        cell = {**timed, "tflops": f / timed["ms"] / 1e9}
                    except Exception as exc:  # noqa: BLE001 -- a refusal or OOM is data, not a crash
                        cell = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:240] if str(exc) else ''}"}
                        torch.cuda.synchronize()
                        torch.cuda.empty_cache()
                    cell["wall_s"] = round(time.time() - t0, 2)
                    row["results"][impl] = cell
                del q, k, v
                torch.cuda.empty_cache()
                rows.append(row)
                if checkpoint is not None:  # a run cut short keeps what it measured
                    checkpoint(_result(settings, meta_info, rows))
                progress(f"d={d} causal={causal} N={n}: " + ", ".join(
                    f"{i}={c['tflops']:.0f}" if "tflops" in c else f"{i}=-" for i, c in row["results"].items()))
    return _result(settings, meta_info, rows)


def _result(settings, meta_info, rows) -> dict:
    return {"suite": "fwd", "meta": meta_info, "metric": "tflops", "x": "seqlen", "panels": ["head_dim", "causal"],
            "convention": f"hidden 2048 (heads 2048/d), batch 16384/N, FLOPs 4BHN^2d (causal /2), "
                          f"{settings['dtype']}, median of CUDA-event-timed repeats",
            "impls": settings["impls"], "rows": rows}


register(Suite("fwd", "forward attention: flashgen v2/v1/standard vs torch SDPA backends and FlexAttention",
               add_args, run))
