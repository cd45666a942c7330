"""The ``bwd`` suite: forward + backward (or the backward alone), flashgen next to SDPA flash and cuDNN.

Convention (FlashAttention papers): hidden 2048 (heads = 2048 / d), batch = 16384 / N,
forward FLOPs = 4·B·H·N²·d (halved for causal), the backward counted as 2.5x the forward,
so one forward + backward is 3.5x the forward's FLOPs. bf16 by default, fresh random inputs.

Modes (``--mode``; ``both`` gives one row of each per cell, ``mode`` is a panel field):

- ``fwd+bwd``: one forward and its backward, ``torch.autograd.grad`` of the output with a random dO
  (no gradient accumulation in the timed region);
- ``bwd``: the backward alone: ``flashgen.api.attention_backward`` on a saved out/LSE, SDPA's
  backward through a retained graph.

Implementations:

- ``flashgen``: ``flashgen.attention`` through autograd (the dK/dV family dispatch picks);
- ``flashgen_det``: the same with ``deterministic=True`` (on sm_90a bwd_sm90's det twin, dQ added in a
  fixed order; elsewhere a separate dQ kernel, no atomics);
- ``flashgen_bwd_sm90``, ``flashgen_bwd_dkdv``: the dK/dV kernel of that family (dispatch's pick
  restricted to it) passed as ``attention_backward(..., specs={"bwd_dkdv": spec})``; in ``fwd+bwd``
  mode after a forward without autograd (what the autograd op runs, less its bookkeeping); skipped
  where the family does not serve the cell;
- ``dkdv:NAME`` (``--dkdv``, full kernel names): that dK/dV kernel the same way, in the cells of its
  head-dim tile, causal flag and dtype (skipped in the others): variants beside the rule's pick, such
  as another ``dq_write`` or a tile the rule does not take yet;
- ``sdpa_flash``, ``sdpa_cudnn``: torch SDPA with that backend forced.

In ``fwd+bwd`` mode each implementation's forward is timed alone in the same rounds (flashgen's
default forward for every flashgen column): its cell gets ``fwd_ms``, ``bwd_ms`` (the difference of
the medians) and ``bwd_tflops``. ``x_flash`` / ``x_cudnn``: ``flashgen`` over SDPA flash / cuDNN;
``det_cost``: ``flashgen_det`` over ``flashgen`` (below 1: what determinism costs).
"""
from __future__ import annotations

from .. import dispatch, families
from ..iomodel import flops, hidden2048
from ..problem import bwd_head_dim_tile
from ..spec import KernelSpec
from . import baselines, options
from .fwd import measure_ms, pick
from .registry import Suite, register
from .timing import Skipped, add_ratios, free, kernel_us, meta, prebuild, require_cuda, time_cell

FAMILY_IMPLS = ("flashgen_bwd_sm90", "flashgen_bwd_dkdv")  # "flashgen_" + a family serving "bwd_dkdv"
IMPLS = ("flashgen", "flashgen_det", *FAMILY_IMPLS, "sdpa_flash", "sdpa_cudnn")
DEFAULT_IMPLS = ("flashgen", "flashgen_det", "sdpa_flash", "sdpa_cudnn")
MODES = {"fwd+bwd": ("fwd+bwd",), "bwd": ("bwd",), "both": ("fwd+bwd", "bwd")}
FLOPS_FACTOR = {"fwd+bwd": 3.5, "bwd": 2.5}
RATIOS = (("x_flash", "flashgen", "sdpa_flash"), ("x_cudnn", "flashgen", "sdpa_cudnn"),
          ("det_cost", "flashgen_det", "flashgen"))


def add_args(p) -> None:
    p.add_argument("--d", default="64,128", help="head dims, comma-separated (default 64,128)")
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384", help="sequence lengths, comma-separated")
    p.add_argument("--causal", choices=tuple(options.CAUSAL), default="both")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                   help=f"implementations (default {','.join(DEFAULT_IMPLS)}; known: {','.join(IMPLS)})")
    p.add_argument("--mode", choices=tuple(MODES), default="fwd+bwd",
                   help="fwd+bwd through autograd (default), the backward alone, or both")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell (default 3)")
    p.add_argument("--budget", type=float, default=0.25, help="seconds of timed calls per implementation per round")
    p.add_argument("--kernels", action="store_true",
                   help="also profile each implementation's call (torch.profiler, 3 calls): device time per "
                        "kernel in each cell's 'kernels' (where the backward's time goes)")
    p.add_argument("--no-fwd-split", action="store_true",
                   help="fwd+bwd mode: do not time the forwards alone (no fwd_ms/bwd_ms per cell)")
    p.add_argument("--dkdv", default="",
                   help="dK/dV kernels to time too (full names, comma-separated): each a 'dkdv:NAME' column, "
                        "run in the cells of its head-dim tile, causal flag and dtype")


def dkdv_specs(text: str, dtype: str) -> list:
    """The ``--dkdv`` kernels: full names of kernels serving the dK/dV problem, in the suite's dtype."""
    specs = []
    for name in (x.strip() for x in str(text).split(",")):
        if not name:
            continue
        try:
            spec = KernelSpec.from_name(name)
        except ValueError as exc:
            raise ValueError(f"--dkdv {name}: {exc}") from None
        if families.family(spec.kind).serves != "bwd_dkdv" or spec.dtype != dtype:
            raise ValueError(f"--dkdv {name}: not a {dtype} dK/dV kernel (the bwd_dkdv problem's families: "
                             f"{', '.join(families.PROBLEMS['bwd_dkdv'])})")
        specs.append(spec)
    return list(dict.fromkeys(specs))


def parse(args) -> dict:
    impls = options.names(args.impls, IMPLS, "impls")
    impls += [f"dkdv:{s.name}" for s in dkdv_specs(getattr(args, "dkdv", ""), args.dtype)]
    options.positive(args.rounds, "rounds", integer=True)
    options.positive(args.budget, "budget")
    return {"d": options.head_dims(args.d), "seqlens": options.ints(args.seqlens, "seqlens"),
            "causal": list(options.CAUSAL[args.causal]), "dtype": args.dtype, "impls": impls,
            "modes": list(MODES[args.mode]), "rounds": int(args.rounds), "budget": float(args.budget),
            "fwd_split": not args.no_fwd_split, "kernels": bool(args.kernels)}


def _bwd_key(dev, dtype, kind, d, causal, n):
    return families.problem_key(kind, dev.arch, dtype, d, causal, n)


def dkdv_spec(dev, dtype, d, causal, n, family, verify=True):
    """dispatch's dK/dV kernel for the cell, restricted to ``family``."""
    return dispatch.select(_bwd_key(dev, dtype, "bwd_dkdv", d, causal, n), dev.gpu, dev.smem_budget, verify=verify,
                           family=family)


def prebuild_specs(settings, dev) -> set:
    """The forward's picks and every backward kernel the cells can use (without compiling)."""
    specs = set()
    for d in settings["d"]:
        for causal in settings["causal"]:
            for n in settings["seqlens"]:
                try:
                    specs.add(pick(dev, settings["dtype"], d, causal, n, verify=False))
                except Exception:  # noqa: BLE001 -- the cell records it
                    pass
                for kind, c in (("bwd_preprocess", False), ("bwd_convert", False), ("bwd_dkdv", causal),
                                ("bwd_dkdv_nodq", causal), ("bwd_dq", causal)):
                    try:
                        specs.add(dispatch.select(_bwd_key(dev, settings["dtype"], kind, d, c, n), dev.gpu,
                                                  dev.smem_budget))
                    except Exception:  # noqa: BLE001
                        pass
                for impl in settings["impls"]:
                    if impl.startswith("dkdv:"):
                        specs.add(KernelSpec.from_name(impl[len("dkdv:"):]))
                    fam = impl[len("flashgen_"):] if impl in FAMILY_IMPLS else None
                    if fam and fam in families.serving("bwd_dkdv", dev.arch):
                        try:
                            specs.add(dkdv_spec(dev, settings["dtype"], d, causal, n, fam, verify=False))
                        except Exception:  # noqa: BLE001
                            pass
    return specs


def _makers(settings, dev, mode, tensors, d, causal, n):
    """{impl: maker} of one cell and mode; and {forward name: maker} (fwd+bwd mode with the split)."""
    import torch

    from .. import api
    from flashgen.api import attention_backward

    q, k, v, dout = tensors
    qd, kd, vd = (t.detach() for t in (q, k, v))
    scale = 1.0 / d ** 0.5

    def family_spec(fam):
        if fam not in families.serving("bwd_dkdv", dev.arch):
            raise Skipped(f"{fam} does not serve the backward on {dev.arch}")
        spec = dkdv_spec(dev, settings["dtype"], d, causal, n, fam)
        if spec.kind != fam:
            raise Skipped(f"{fam} does not serve this cell (dispatch gives {spec.kind})")
        return spec

    def named_spec(name):
        spec = KernelSpec.from_name(name)
        tile = bwd_head_dim_tile(d, dev.arch)
        if (spec.head_dim, spec.causal) != (tile, causal):
            raise Skipped(f"{name} is not this cell's kernel (head-dim tile {tile}, causal {causal})")
        return spec

    def grads(out):
        return torch.autograd.grad(out, (q, k, v), dout)

    def saved():
        with torch.no_grad():
            return api.attention(qd, kd, vd, causal=causal, return_lse=True)

    makers = {}
    for impl in settings["impls"]:
        det = impl == "flashgen_det"
        if impl in ("flashgen", "flashgen_det"):
            if mode == "fwd+bwd":
                makers[impl] = (lambda det: lambda: (
                    lambda: grads(api.attention(q, k, v, causal=causal, deterministic=det))))(det)
            else:
                def make(det=det):
                    out, lse = saved()
                    return lambda: attention_backward(dout, qd, kd, vd, out, lse, causal, scale, deterministic=det)
                makers[impl] = make
        elif impl in FAMILY_IMPLS or impl.startswith("dkdv:"):
            def make(impl=impl):
                name = impl.split(":", 1)[1] if impl.startswith("dkdv:") else None
                spec = named_spec(name) if name else family_spec(impl[len("flashgen_"):])
                specs = {"bwd_dkdv": spec}
                if mode == "fwd+bwd":
                    def run():
                        out, lse = api.attention(qd, kd, vd, causal=causal, return_lse=True)
                        return attention_backward(dout, qd, kd, vd, out, lse, causal, scale, specs=specs)
                    return run
                out, lse = saved()
                return lambda: attention_backward(dout, qd, kd, vd, out, lse, causal, scale, specs=specs)
            makers[impl] = make
        else:
            def make(name=impl):
                fwd = baselines.sdpa(name, q, k, v, causal)
                if mode == "fwd+bwd":
                    return lambda: grads(fwd())
                out = fwd()
                return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            makers[impl] = make
    forwards = {}
    if mode == "fwd+bwd" and settings["fwd_split"]:
        for impl in settings["impls"]:
            name = "flashgen" if impl.startswith(("flashgen", "dkdv:")) else impl
            if name in forwards:
                continue
            if name == "flashgen":
                forwards[name] = lambda: (lambda: api.attention(qd, kd, vd, causal=causal))
            else:
                forwards[name] = (lambda nm: lambda: baselines.sdpa(nm, qd, kd, vd, causal))(name)
    return makers, forwards


def run(args, progress) -> dict:
    import torch

    from ..api.device import Device

    settings = parse(args)
    require_cuda("bwd")
    dtype = options.dtype_of(settings["dtype"])
    dev = Device.of(torch.cuda.current_device())
    meta_info = meta()
    checkpoint = getattr(args, "checkpoint", None)
    prebuild(prebuild_specs(settings, dev), progress)
    rows = []
    for d in settings["d"]:
        for causal in settings["causal"]:
            for n in settings["seqlens"]:
                b, h = hidden2048(n, d)
                f = flops(b, h, n, n, d, causal)
                gen = torch.Generator(device="cuda").manual_seed(n * 1000 + d * 2 + causal)
                q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
                for t in (q, k, v):
                    t.requires_grad_(True)
                for mode in settings["modes"]:
                    makers, forwards = _makers(settings, dev, mode, (q, k, v, dout), d, causal, n)
                    tag = {name: f"fwd:{name}" for name in forwards}
                    cells = time_cell({**makers, **{tag[nm]: m for nm, m in forwards.items()}}, settings["rounds"],
                                      measure_ms(settings["budget"]))
                    fwd_cells = {nm: cells.pop(tag[nm]) for nm in forwards}
                    if settings["kernels"]:
                        for impl, make in makers.items():
                            if "ms" in cells.get(impl, {}):
                                cells[impl]["kernels"] = kernel_us(make())
                                top = next(iter(cells[impl]["kernels"].items()), None)
                                if top:
                                    progress(f"  {impl}: {sum(cells[impl]['kernels'].values()):.0f} us of kernels, "
                                             f"the largest {top[0][:60]} {top[1]:.0f} us")
                    for cell in cells.values():
                        if "ms" in cell:
                            cell["tflops"] = FLOPS_FACTOR[mode] * f / cell["ms"] / 1e9
                    for impl, cell in cells.items():
                        base = fwd_cells.get("flashgen" if impl.startswith(("flashgen", "dkdv:")) else impl, {})
                        if "ms" in cell and "ms" in base:
                            bwd_ms = cell["ms"] - base["ms"]
                            cell.update(fwd_ms=base["ms"], bwd_ms=bwd_ms,
                                        bwd_tflops=2.5 * f / bwd_ms / 1e9 if bwd_ms > 0 else None)
                    row = {"head_dim": d, "causal": causal, "mode": mode, "seqlen": n, "batch": b, "heads": h,
                           "flops": f, "rounds": settings["rounds"], "results": cells}
                    if fwd_cells:
                        row["forward"] = {nm: {**c, "tflops": f / c["ms"] / 1e9} if "ms" in c else c
                                          for nm, c in fwd_cells.items()}
                    add_ratios(row, "tflops", RATIOS)
                    rows.append(row)
                    progress(f"d={d} causal={causal} N={n} {mode}: " + ", ".join(
                        f"{i}={c['tflops']:.0f}" if "tflops" in c else f"{i}=-" for i, c in cells.items()))
                    if checkpoint is not None:
                        checkpoint(_result(settings, meta_info, rows))
                del q, k, v, dout
                free()
    return _result(settings, meta_info, rows)


def _result(settings, meta_info, rows) -> dict:
    impls = settings["impls"]
    ratios = [label for label, num, den in RATIOS if num in impls and den in impls]
    return {"suite": "bwd", "meta": meta_info, "metric": "tflops", "x": "seqlen",
            "panels": ["head_dim", "causal", "mode"],
            "convention": f"hidden 2048, batch 16384/N, fwd 4BHN^2d FLOPs (causal /2), fwd+bwd = 3.5x fwd, "
                          f"bwd alone = 2.5x fwd, {settings['dtype']}, median of {settings['rounds']} "
                          "interleaved rounds",
            "settings": settings, "impls": impls, "ratios": ratios, "rows": rows}


register(Suite("bwd", "forward + backward (or the backward alone): flashgen default and deterministic next to "
                      "SDPA flash and cuDNN, interleaved rounds", add_args, run))
