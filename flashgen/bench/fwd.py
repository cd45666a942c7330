"""The ``fwd`` suite: forward attention, flashgen next to torch's implementations, in interleaved rounds.

Convention of the FlashAttention papers: hidden size 2048 (heads = 2048 / d),
16k tokens per batch (batch = 16384 / N), FLOPs 4·B·H·N²·d, halved for causal;
bf16 by default; inputs fresh ``torch.randn`` per cell (never zeros: the tensor
cores draw less power on zeros and run faster, 894 against 788 TFLOP/s for a
bf16 8k matmul on the H200). Implementations:

- ``flashgen``: ``flashgen.attention`` on its default path (dispatch's pick: the tuned table, else
  the default rule; on sm_90a usually ``fwd_sm90``);
- ``flashgen_fwd_sm90``, ``flashgen_fwd_v2``: the pick restricted to that family (``spec=``), skipped
  where the family does not run;
- ``flashgen_v1``, ``flashgen_standard``: ``algorithm="v1"`` / ``"standard"`` (the study algorithms);
- ``flashgen_fp8``: the cell's inputs quantized to float8 e4m3 with one descale per (batch, head)
  (``flashgen.quantize_fp8``, outside the timing), the FP8 forward, bf16 output; its cell carries
  ``x_bf16``, its TFLOP/s over the ``flashgen`` cell's where both run;
- ``sdpa_cudnn_fp8``: torch SDPA's cuDNN backend on the same FP8 tensors (skipped, with torch's reason,
  where this torch offers no FP8 attention);
- ``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``, ``sdpa_math``: torch SDPA with one backend forced;
- ``flex``: ``torch.nn.attention.flex_attention`` under ``torch.compile`` (a block mask when causal).

Every implementation of a cell is timed once per round (``--rounds``), the
order reversed every other round; a cell's value is the median over the
rounds, its rounds and their spread are kept. Each row carries ``x_flash`` and
``x_cudnn``: the first flashgen implementation's TFLOP/s over SDPA flash's and
cuDNN's (above 1: flashgen faster); every flashgen cell carries its own.
``sdpa_math`` is skipped above ``--math-max-seqlen`` (it materialises N x N in
fp32 and takes seconds). A ``memory`` section records what ``flashgen.attention``
allocates beyond its inputs, output and LSE at long sequences (batch 1).
"""
from __future__ import annotations

from .. import dispatch, families
from ..iomodel import flops, hidden2048
from . import baselines, options
from .registry import Suite, register
from .timing import Skipped, add_ratios, error_text, free, meta, prebuild, require_cuda, time_cell, time_ms

FAMILY_IMPLS = ("flashgen_fwd_sm90", "flashgen_fwd_v2")  # "flashgen_" + a family serving the "fwd" problem
IMPLS = ("flashgen", *FAMILY_IMPLS, "flashgen_v1", "flashgen_standard", "flashgen_fp8", "sdpa_flash", "sdpa_cudnn",
         "sdpa_efficient", "sdpa_math", "sdpa_cudnn_fp8", "flex")
DEFAULT_IMPLS = ("flashgen", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
RATIOS = (("x_flash", "sdpa_flash"), ("x_cudnn", "sdpa_cudnn"))


def add_args(p) -> None:
    p.add_argument("--d", default="64,128", help="head dims, comma-separated (default 64,128)")
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384", help="sequence lengths, comma-separated")
    p.add_argument("--causal", choices=tuple(options.CAUSAL), default="both", help="causal, non-causal or both")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                   help=f"implementations to time (default {','.join(DEFAULT_IMPLS)}; known: {','.join(IMPLS)})")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per cell (default 5; the median counts)")
    p.add_argument("--budget", type=float, default=0.25,
                   help="seconds of timed calls per implementation per round (5..30 calls; default 0.25)")
    p.add_argument("--math-max-seqlen", type=int, default=4096, help="skip sdpa_math above this seqlen")
    p.add_argument("--memory-seqlens", default="16384,65536",
                   help="seqlens of the memory section (batch 1, 16 heads, d 128, causal); 'none' to skip")


def parse(args) -> dict:
    """The suite's settings from parsed arguments; ValueError on a bad value (before touching a GPU)."""
    impls = options.names(args.impls, IMPLS, "impls")
    options.positive(args.rounds, "rounds", integer=True)
    options.positive(args.budget, "budget")
    memory = [] if str(args.memory_seqlens).strip().lower() in ("none", "") else \
        options.ints(args.memory_seqlens, "memory-seqlens")
    return {"d": options.head_dims(args.d), "seqlens": options.ints(args.seqlens, "seqlens"),
            "causal": list(options.CAUSAL[args.causal]), "dtype": args.dtype, "impls": impls,
            "rounds": int(args.rounds), "budget": float(args.budget), "math_max_seqlen": args.math_max_seqlen,
            "memory": memory if any(i.startswith("flashgen") for i in impls) else []}


# ------------------------------------------------------------------ shared with ablation and ab


def inputs(n: int, d: int, dtype, seed: int):
    """(batch, heads, q, k, v) of one cell of the hidden-2048 convention, fresh random."""
    import torch

    b, h = hidden2048(n, d)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    return b, h, q, k, v


def fwd_key(dev, dtype: str, d: int, causal: bool, n: int, problem: str = "fwd"):
    return families.problem_key(problem, dev.arch, dtype, d, causal, n)


def pick(dev, dtype: str, d: int, causal: bool, n: int, family: str | None = None, verify: bool = True):
    """The spec ``flashgen.attention`` runs for this cell (``family``: restricted to that family)."""
    return dispatch.select(fwd_key(dev, dtype, d, causal, n), dev.gpu, dev.smem_budget, verify=verify, family=family)


def measure_ms(budget: float):
    """A measure for ``timing.interleaved``: the median ms of as many calls as fit in ``budget`` s (5-30)."""
    return lambda fn: time_ms(fn, budget_s=budget, min_reps=5, max_reps=30, warmup=2)["ms"]


def with_tflops(cells: dict, flops: float) -> dict:
    for cell in cells.values():
        if "ms" in cell:
            cell["tflops"] = flops / cell["ms"] / 1e9
    return cells


# ------------------------------------------------------------------ the suite


def _makers(settings, dev, q, k, v, d, causal, n):
    from .. import api

    dtype = settings["dtype"]

    def flashgen_family(fam):
        def make():
            if fam not in families.serving("fwd", dev.arch):
                raise Skipped(f"{fam} does not run on {dev.arch}")
            spec = pick(dev, dtype, d, causal, n, family=fam)
            return lambda: api.attention(q, k, v, causal=causal, spec=spec)
        return make

    def fp8_inputs():
        if not hasattr(fp8_inputs, "x"):
            fp8_inputs.x = [api.quantize_fp8(t) for t in (q, k, v)]
        return fp8_inputs.x

    def fp8_make():
        (q8, qd), (k8, kd), (v8, vd) = fp8_inputs()
        return lambda: api.attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                     check_values=False)

    def cudnn_fp8_make():
        (q8, _), (k8, _), (v8, _) = fp8_inputs()
        run = baselines.sdpa("sdpa_cudnn", q8, k8, v8, causal)
        try:
            run()
        except Exception as exc:  # noqa: BLE001 -- torch's own refusal is the cell's reason
            raise Skipped(f"torch SDPA's cuDNN backend refuses FP8 inputs: {error_text(exc)}") from None
        return run

    def math_make():
        if n > settings["math_max_seqlen"]:
            raise Skipped(f"seqlen {n} > --math-max-seqlen {settings['math_max_seqlen']} (N x N fp32, slow)")
        return baselines.sdpa("sdpa_math", q, k, v, causal)

    makers = {}
    for impl in settings["impls"]:
        if impl == "flashgen":
            makers[impl] = lambda: (lambda: api.attention(q, k, v, causal=causal))
        elif impl in FAMILY_IMPLS:
            makers[impl] = flashgen_family(impl[len("flashgen_"):])
        elif impl in ("flashgen_v1", "flashgen_standard"):
            algorithm = impl.split("_", 1)[1]
            makers[impl] = (lambda a: lambda: (lambda: api.attention(q, k, v, causal=causal, algorithm=a)))(
                algorithm)
        elif impl == "flashgen_fp8":
            makers[impl] = fp8_make
        elif impl == "sdpa_cudnn_fp8":
            makers[impl] = cudnn_fp8_make
        elif impl == "sdpa_math":
            makers[impl] = math_make
        elif impl in baselines.SDPA:
            makers[impl] = (lambda name: lambda: baselines.sdpa(name, q, k, v, causal))(impl)
        else:
            makers[impl] = lambda: baselines.flex(q, k, v, causal)
    return makers


def prebuild_specs(settings, dev) -> set:
    """Every flashgen kernel the run's cells use (dispatch's picks without compiling: verify=False)."""
    problems = {"flashgen_v1": (families.fwd_v1.KIND,), "flashgen_standard": families.standard.KINDS}
    specs = set()
    for impl in settings["impls"]:
        if not impl.startswith("flashgen"):
            continue
        for d in settings["d"]:
            for causal in settings["causal"]:
                for n in settings["seqlens"]:
                    try:
                        if impl == "flashgen":
                            specs.add(pick(dev, settings["dtype"], d, causal, n, verify=False))
                        elif impl == "flashgen_fp8":
                            key = fwd_key(dev, settings["dtype"], d, causal, n).replace(variant="fp8")
                            specs.add(dispatch.select(key, dev.gpu, dev.smem_budget, verify=False))
                        elif impl in FAMILY_IMPLS:
                            fam = impl[len("flashgen_"):]
                            if fam in families.serving("fwd", dev.arch):
                                specs.add(pick(dev, settings["dtype"], d, causal, n, family=fam, verify=False))
                        else:
                            for problem in problems[impl]:
                                key = fwd_key(dev, settings["dtype"], d, causal, n, problem)
                                specs.add(dispatch.select(key, dev.gpu, dev.smem_budget))
                    except Exception:  # noqa: BLE001 -- the cell records the same refusal
                        pass
    return specs


def memory_rows(settings, progress) -> list:
    """Bytes ``flashgen.attention`` allocates beyond its inputs, output and LSE (batch 1, 16 heads, d 128,
    causal): the forward keeps no N x N buffer, so this stays at the allocator's rounding."""
    import torch

    from .. import api

    rows = []
    for n in settings["memory"]:
        row = {"head_dim": 128, "heads": 16, "seqlen": n, "results": {}}
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            q, k, v = (torch.randn(1, 16, n, 128, device="cuda", dtype=options.dtype_of(settings["dtype"]))
                       for _ in range(3))
            api.attention(q, k, v, causal=True, return_lse=True)  # plan and load outside the count
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out, lse = api.attention(q, k, v, causal=True, return_lse=True)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            kept = out.numel() * out.element_size() + lse.numel() * lse.element_size()
            row["results"]["flashgen"] = {"peak_extra_bytes": peak, "output_and_lse_bytes": kept,
                                          "beyond_output_bytes": peak - kept,
                                          "beyond_output_mib": (peak - kept) / 2**20}
            row["standard_attention_S_gib"] = 16 * n * n * 2 / 2**30
            del q, k, v, out, lse
        except Exception as exc:  # noqa: BLE001
            row["results"]["flashgen"] = {"error": error_text(exc)}
        rows.append(row)
        progress(f"memory N={n}: {row['results']['flashgen']}")
    return rows


def run(args, progress) -> dict:
    """Time every (head dim, causal, seqlen) cell; ``args.checkpoint(result)``, when set, gets the
    result so far after each row."""
    import torch

    from ..api.device import Device

    settings = parse(args)
    require_cuda("fwd")
    dtype = options.dtype_of(settings["dtype"])
    dev = Device.of(torch.cuda.current_device())
    meta_info = meta()
    checkpoint = getattr(args, "checkpoint", None)
    prebuild(prebuild_specs(settings, dev), progress)
    anchor = next((i for i in settings["impls"] if i.startswith("flashgen")), None)
    rows = []
    for d in settings["d"]:
        for causal in settings["causal"]:
            for n in settings["seqlens"]:
                b, h, q, k, v = inputs(n, d, dtype, seed=n * 1000 + d * 2 + causal)
                f = flops(b, h, n, n, d, causal)
                row = {"head_dim": d, "causal": causal, "seqlen": n, "batch": b, "heads": h, "flops": f,
                       "rounds": settings["rounds"]}
                cells = time_cell(_makers(settings, dev, q, k, v, d, causal, n), settings["rounds"],
                                  measure_ms(settings["budget"]))
                row["results"] = with_tflops(cells, f)
                for impl in settings["impls"]:  # every flashgen cell: its own ratios to the SDPA backends
                    if impl.startswith("flashgen") and "tflops" in cells[impl]:
                        for label, base in RATIOS:
                            if "tflops" in cells.get(base, {}):
                                cells[impl][label] = cells[impl]["tflops"] / cells[base]["tflops"]
                if "tflops" in cells.get("flashgen_fp8", {}) and "tflops" in cells.get("flashgen", {}):
                    cells["flashgen_fp8"]["x_bf16"] = cells["flashgen_fp8"]["tflops"] / cells["flashgen"]["tflops"]
                if anchor:
                    add_ratios(row, "tflops", [(label, anchor, base) for label, base in RATIOS])
                del q, k, v
                free()
                rows.append(row)
                if checkpoint is not None:  # a run cut short keeps what it measured
                    checkpoint(_result(settings, meta_info, rows, anchor))
                progress(f"d={d} causal={causal} N={n}: " + ", ".join(
                    f"{i}={c['tflops']:.0f}" if "tflops" in c else f"{i}=-" for i, c in row["results"].items()))
    result = _result(settings, meta_info, rows, anchor)
    if settings["memory"]:
        result["sections"] = {"memory": {
            "metric": "beyond_output_mib", "precision": 2, "x": "seqlen", "panels": ["head_dim"],
            "fields": ["standard_attention_S_gib"], "impls": ["flashgen"], "rows": memory_rows(settings, progress),
            "convention": "MiB flashgen.attention allocates beyond its inputs, output and LSE (batch 1, 16 heads, "
                          "causal); standard_attention_S_gib: the N x N scores alone, bf16"}}
    return result


def _result(settings, meta_info, rows, anchor) -> dict:
    ratios = [label for label, base in RATIOS if base in settings["impls"]] if anchor else []
    return {"suite": "fwd", "meta": meta_info, "metric": "tflops", "x": "seqlen", "panels": ["head_dim", "causal"],
            "convention": f"hidden 2048 (heads 2048/d), batch 16384/N, FLOPs 4BHN^2d (causal /2), "
                          f"{settings['dtype']}, median of {settings['rounds']} interleaved rounds"
                          + (f"; x_flash / x_cudnn: {anchor} over SDPA flash / cuDNN" if ratios else ""),
            "settings": settings, "impls": settings["impls"], "ratios": ratios, "rows": rows}


register(Suite("fwd", "forward attention: flashgen next to torch SDPA's backends (and FlexAttention), "
                      "interleaved rounds", add_args, run))
