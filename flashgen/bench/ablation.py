"""The ``ablation`` suite: the Hopper forward's techniques one by one, beside cuDNN and the default pick.

Per head dim, ``flashgen.families.fwd_sm90.ABLATION`` lists name-token strings over a 128x128
(d = 256: 128x64), two-stage ``fwd_sm90`` spec (``families.fwd_sm90.variant``): the ladder of the
techniques (warp specialization ``ws``, ping-pong ``pp``, softmax overlap ``ov``, early K release
``kr``, lean softmax ``ls``, FMA-pipe exp2 ``fx<k>``, stages ``s<k>``, 192-row / 192-key tiles
``m192`` / ``n192``), then later techniques alone and together. ``plain`` is the empty string: none
of them. A variant with the ``fp8`` token runs on the cell's inputs quantized to float8 e4m3 (one
descale per (batch, head), outside the timing). ``--variants`` replaces the ladder;
``--persistent`` adds each warp-specialized variant's
persistent twin (``_ps``: one CTA per SM walks the tiles), and the default pick's (``default_ps``, or
``default_nops`` where the pick is persistent).

Every variant of a cell, ``default`` (the spec ``flashgen.attention`` picks there: the tuned table,
else the default rule) and SDPA's cuDNN backend are timed in the same interleaved rounds at the
hidden-2048 convention (N = 8k by default, causal both). One row per variant: x = the variant,
``flashgen`` its TFLOP/s, ``sdpa_cudnn`` the cell's cuDNN (the same in every row of a cell),
``x_cudnn`` their ratio. Needs an sm_90a GPU (H100/H200).

The tile-order study (``FLASHGEN_TILE_SECTION``: how many (batch, head) pairs share an L2 section) is
not an option here: the section count is read from the environment when a plan is made, and a
suite sets no FLASHGEN_* variable; run ``FLASHGEN_TILE_SECTION=1 flashgen bench ablation ...`` as
its own process to time the pair-after-pair order.
"""
from __future__ import annotations

from ..errors import FlashgenError
from ..families import fwd_sm90
from ..iomodel import flops
from . import baselines, options
from .fwd import inputs, measure_ms, pick, with_tflops
from .registry import Suite, register
from .timing import add_ratios, free, meta, prebuild, require_cuda, time_cell

PLAIN = "plain"


def add_args(p) -> None:
    p.add_argument("--d", default="64,128", help="head dims (default 64,128: the keys of fwd_sm90.ABLATION)")
    p.add_argument("--seqlens", default="8192", help="sequence lengths (default 8192)")
    p.add_argument("--causal", choices=tuple(options.CAUSAL), default="both")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--variants", default=None,
                   help="name-token strings, comma-separated ('plain' for none), instead of fwd_sm90.ABLATION[d]")
    p.add_argument("--persistent", action="store_true",
                   help="also each warp-specialized variant with the persistent kernel (token ps)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell (default 3)")
    p.add_argument("--budget", type=float, default=0.25, help="seconds of timed calls per variant per round")


def ladder(d: int, variants=None, persistent: bool = False) -> list[str]:
    """The variant names of head dim ``d``: ``variants`` or ABLATION[d] ('' spelled 'plain'), and with
    ``persistent`` each warp-specialized one's ``_ps`` twin after it."""
    names = list(variants) if variants is not None else [t or PLAIN for t in fwd_sm90.ABLATION[d]]
    out = []
    for name in names:
        out.append(name)
        tokens = name.split("_")
        if persistent and "ws" in tokens and "ps" not in tokens:
            out.append(f"{name}_ps")
    return list(dict.fromkeys(out))


def variant_spec(d: int, causal: bool, name: str, dtype: str):
    return fwd_sm90.variant(d, causal, "" if name == PLAIN else name, dtype)


def parse(args) -> dict:
    variants = None
    if args.variants is not None:
        variants = [x.strip() for x in str(args.variants).split(",") if x.strip()]
        if not variants:
            raise ValueError("--variants: give name-token strings, e.g. plain,ws,ws_pp_s3")
    allowed = tuple(fwd_sm90.ABLATION) if variants is None else fwd_sm90.SM90_HEAD_DIMS
    dims = options.head_dims(args.d, allowed=allowed)
    causal = list(options.CAUSAL[args.causal])
    options.positive(args.rounds, "rounds", integer=True)
    options.positive(args.budget, "budget")
    specs = {}
    for d in dims:
        for c in causal:
            for name in ladder(d, variants, args.persistent):
                try:
                    specs[(d, c, name)] = variant_spec(d, c, name, args.dtype)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"--variants {name!r} at d={d}: {exc}") from None
    return {"d": dims, "seqlens": options.ints(args.seqlens, "seqlens"), "causal": causal, "dtype": args.dtype,
            "variants": variants, "persistent": bool(args.persistent), "rounds": int(args.rounds),
            "budget": float(args.budget), "specs": specs}


def _twin(spec):
    """(name, spec) of the default pick's persistent twin: ``default_ps`` (the pick with the persistent
    kernel) or ``default_nops`` (without it, when the pick is persistent); (None, None) when the pick
    is not a warp-specialized fwd_sm90 kernel (persistent needs the producer warpgroup)."""
    if spec is None or spec.kind != "fwd_sm90" or not spec.warp_specialized:
        return None, None
    try:
        twin = spec.replace(persistent=not spec.persistent).validate()
    except (TypeError, ValueError):
        return None, None
    return ("default_nops" if spec.persistent else "default_ps"), twin


def run(args, progress) -> dict:
    import torch

    from .. import api

    from ..api.device import Device

    settings = parse(args)
    specs = settings.pop("specs")
    require_cuda("ablation")
    dev = Device.of(torch.cuda.current_device())
    if dev.arch != "sm_90a":
        raise FlashgenError(f"flashgen bench ablation times fwd_sm90 kernels, which need an sm_90a GPU "
                            f"(H100/H200), not {dev.arch}")
    dtype = options.dtype_of(settings["dtype"])
    meta_info = meta()
    checkpoint = getattr(args, "checkpoint", None)
    defaults = {}
    for d in settings["d"]:
        for c in settings["causal"]:
            for n in settings["seqlens"]:
                try:
                    defaults[(d, c, n)] = pick(dev, settings["dtype"], d, c, n, verify=False)
                except Exception:  # noqa: BLE001 -- the cell records it
                    pass
    twins = {key: _twin(spec) for key, spec in defaults.items()} if settings["persistent"] else {}
    prebuild([*specs.values(), *defaults.values(), *(t for _, t in twins.values() if t is not None)], progress)
    for key in defaults:  # as flashgen.attention picks (verify: a tile this NVRTC refuses gives way)
        try:
            defaults[key] = pick(dev, settings["dtype"], *key)
        except Exception:  # noqa: BLE001
            pass
    rows, notes = [], []
    for d in settings["d"]:
        names = ladder(d, settings["variants"], settings["persistent"])
        for causal in settings["causal"]:
            for n in settings["seqlens"]:
                b, h, q, k, v = inputs(n, d, dtype, seed=n * 1000 + d * 2 + causal)
                f = flops(b, h, n, n, d, causal)
                any_fp8 = any(specs[(d, causal, x)].fp8 for x in names)
                fp8 = [api.quantize_fp8(t) for t in (q, k, v)] if any_fp8 else None

                def call(s):
                    if not s.fp8:
                        return lambda: api.attention(q, k, v, causal=causal, spec=s)
                    (q8, qd), (k8, kd), (v8, vd) = fp8
                    return lambda: api.attention(q8, k8, v8, causal=causal, spec=s, q_descale=qd, k_descale=kd,
                                                 v_descale=vd, check_values=False)

                makers = {name: (lambda s: lambda: call(s))(specs[(d, causal, name)]) for name in names}
                makers["default"] = lambda: (lambda: api.attention(q, k, v, causal=causal))
                twin_name, twin = twins.get((d, causal, n), (None, None))
                if twin is not None:
                    specs[(d, causal, twin_name)] = twin
                    makers[twin_name] = lambda: (lambda: api.attention(q, k, v, causal=causal, spec=twin))
                makers["sdpa_cudnn"] = lambda: baselines.sdpa("sdpa_cudnn", q, k, v, causal)
                cells = with_tflops(time_cell(makers, settings["rounds"], measure_ms(settings["budget"])), f)
                cudnn = cells.pop("sdpa_cudnn")
                default_spec = defaults.get((d, causal, n))
                for name, cell in cells.items():
                    spec = specs[(d, causal, name)] if name != "default" else default_spec
                    row = {"head_dim": d, "causal": causal, "seqlen": n, "variant": name, "batch": b, "heads": h,
                           "flops": f, "spec": spec.name if spec is not None else None,
                           "results": {"flashgen": cell, "sdpa_cudnn": cudnn}}
                    add_ratios(row, "tflops", [("x_cudnn", "flashgen", "sdpa_cudnn")])
                    rows.append(row)
                mine = [r for r in rows[-len(cells):] if "tflops" in r["results"]["flashgen"]]
                best = max(mine, key=lambda r: r["results"]["flashgen"]["tflops"], default=None)
                line = f"d={d} causal={causal} N={n}: cudnn {cudnn.get('tflops', float('nan')):.0f}"
                if best is not None:
                    line += (f", best {best['variant']} {best['results']['flashgen']['tflops']:.0f}"
                             f" ({best.get('ratios', {}).get('x_cudnn', float('nan')):.3f}x cudnn)")
                if default_spec is not None:
                    line += f"; default = {default_spec.name}"
                notes.append(line)
                progress(line)
                del q, k, v, fp8
                free()
                if checkpoint is not None:
                    checkpoint(_result(settings, meta_info, rows, notes))
    return _result(settings, meta_info, rows, notes)


def _result(settings, meta_info, rows, notes) -> dict:
    return {"suite": "ablation", "meta": meta_info, "metric": "tflops", "x": "variant",
            "panels": ["head_dim", "causal", "seqlen"], "impls": ["flashgen", "sdpa_cudnn"], "ratios": ["x_cudnn"],
            "convention": f"fwd_sm90 variants (families.fwd_sm90.variant name tokens), hidden 2048, batch 16384/N, "
                          f"FLOPs 4BHN^2d (causal /2), {settings['dtype']}, median of {settings['rounds']} "
                          "interleaved rounds; sdpa_cudnn: the cell's cuDNN",
            "settings": settings, "rows": rows, "notes": notes}


register(Suite("ablation", "the Hopper forward's techniques (fwd_sm90.ABLATION) one by one next to cuDNN and the "
                           "default pick, interleaved rounds", add_args, run))
