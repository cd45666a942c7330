"""The ``variants`` suite: the masks and score changes of real models (flashgen.variants), each next to
flashgen's plain kernel and FlexAttention (torch ``flex_attention`` compiled, with its block mask and the
equivalent ``score_mod``) in the same interleaved rounds.

Cases (bf16, d = 128 unless ``--d``):

- ``window``: sliding window 4096, causal, N = 32k, GQA 32/8, batch 1; the plain anchor is flashgen's
  dense causal kernel at N = 4k (the same useful work per row), batch 4, GQA 32/8;
- ``softcap``: softcap 50, N = 8k, MHA 16 heads, batch 2, causal and not; anchor: the plain kernel on
  the same inputs;
- ``alibi``: ALiBi (one slope per head), causal, N = 8k, 16 heads, batch 2;
- ``sinks``: one sink per head, causal, N = 8k, 16 heads, batch 2 (FlexAttention has no sink: none);
- ``window_bwd``, ``softcap_bwd``: forward + backward through autograd (window 4096 causal at N = 32k
  against the dense causal kernel at 4k; softcap 50 causal at 8k against the plain kernel), FLOPs 3.5x
  the forward's (the backward's 2.5x).

TFLOP/s count only the (query, key) pairs the mask lets through: 4 B H pairs d (``Variant.pairs``).
Each row carries ``x_plain`` (flashgen's variant over its plain kernel) and ``x_flex`` (over
FlexAttention), above 1 meaning flashgen's variant is faster. ``--cands`` adds candidate kernels (full
names, ``c1``, ``c2``, ... in the table) for the variant call, timed where their flags fit the case.

- ``decode`` (the section of that name): ``flashgen.decode`` over a 128k-key cache, bf16, GQA 32/8, one
  new token, batch 1, 4 and 16 (``--decode-batches``): plain, window (4096, 0), one sink per head, softcap 50, ALiBi, and softcap
  and ALiBi written as score_mods (``softcap_mod``, ``alibi_mod``), all timed in the same interleaved rounds (per round: ``--decode-reps`` calls back to back, replayed from a CUDA graph,
  value checks off; a windowed call at batch 1-4 reads 8-34 MB, shorter than its own host work, so per-call events
  would time the host). TB/s on the K/V bytes each call reads: the whole cache, or with
  the window its 4097 keys per sequence; the window's calls rotate over sequence lengths 4225 keys apart
  (disjoint windows of one cache, at least 256 MB in all) so that L2 does not serve them. Each variant
  carries ``<variant>_x_plain``: its TB/s over the plain decode's (for the window: how well it streams
  the keys it reads, not the time it saves), plus the plan's spec and split count; the mods carry
  ``<mod>_x_builtin``, over the built-in variant they write out.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..spec import KernelSpec
from ..variants import Variant, alibi_slopes
from . import baselines, options
from . import decode as decode_bench
from .registry import Suite, register
from .timing import Skipped, add_ratios, free, graph_us, meta, require_cuda, time_cell, time_ms


@dataclass(frozen=True)
class Case:
    name: str
    n: int
    heads: int
    kv_heads: int
    batch: int
    causal: bool
    options: dict = field(default_factory=dict)  # flashgen.attention's variant keywords (tensors made per run)
    plain_n: int = 0       # the plain anchor's seqlen (0: the case's own) ...
    plain_batch: int = 0   # ... and batch
    grad: bool = False     # forward + backward


CASES = (
    Case("window", 32768, 32, 8, 1, True, {"window": (4096, 0)}, plain_n=4096, plain_batch=4),
    Case("softcap", 8192, 16, 16, 2, True, {"softcap": 50.0}),
    Case("softcap", 8192, 16, 16, 2, False, {"softcap": 50.0}),
    Case("alibi", 8192, 16, 16, 2, True, {"alibi_slopes": "per head"}),
    Case("sinks", 8192, 16, 16, 2, True, {"sinks": "per head"}),
    Case("window_bwd", 32768, 32, 8, 1, True, {"window": (4096, 0)}, plain_n=4096, plain_batch=4, grad=True),
    Case("softcap_bwd", 8192, 16, 16, 2, True, {"softcap": 50.0}, grad=True),
)
IMPLS = ("flashgen", "flashgen_plain", "flex")
RATIOS = (("x_plain", "flashgen_plain"), ("x_flex", "flex"))

# The decode cases: (batch sizes, cache length, heads_q, heads_kv) and the variants, timed together.
# Batch 16 reads 268 MB through the window (16.8 MB a sequence), the size where plain decode streams
# at full bandwidth; batches 1 and 4 are launch- and merge-bound (docs/perf/variants.md).
DECODE_BATCHES = (1, 4, 16)
DECODE_L, DECODE_HEADS, DECODE_KV_HEADS = 131072, 32, 8
DECODE_WINDOW = 4096
DECODE_VARIANTS = (("plain", {}), ("window", {"window": (DECODE_WINDOW, 0)}), ("sinks", {"sinks": "per head"}),
                   ("softcap", {"softcap": 50.0}), ("alibi", {"alibi_slopes": "per head"}),
                   ("softcap_mod", {"score_mod": "softcap"}), ("alibi_mod", {"score_mod": "alibi"}))
# The mods' ratios to the built-in variant they write out.
DECODE_MOD_RATIOS = (("softcap_mod_x_builtin", "softcap_mod", "softcap"), ("alibi_mod_x_builtin", "alibi_mod", "alibi"))
CASE_NAMES = (*dict.fromkeys(c.name for c in CASES), "decode")


def add_args(p) -> None:
    p.add_argument("--cases", default=",".join(CASE_NAMES),
                   help=f"cases to run, comma-separated ({', '.join(CASE_NAMES)}; default all)")
    p.add_argument("--d", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"implementations (default and known: {','.join(IMPLS)})")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per cell (default 5; the median counts)")
    p.add_argument("--budget", type=float, default=0.25, help="seconds of timed calls per implementation per round")
    p.add_argument("--cands", default="", help="candidate kernels for the variant call: full names, comma-separated")
    p.add_argument("--decode-reps", type=int, default=20,
                   help="decode: calls per variant per round, replayed back to back from a CUDA graph (default 20)")
    p.add_argument("--decode-batches", default=",".join(map(str, DECODE_BATCHES)),
                   help="decode: batch sizes, one row each (default %(default)s; the plain call reads a "
                        f"{DECODE_L // 1024}k-key cache per sequence, {DECODE_L * DECODE_KV_HEADS * 2 * 2 * 128 >> 20} MB at d 128)")


def parse(args) -> dict:
    cases = options.names(args.cases, CASE_NAMES, "cases")
    options.positive(args.rounds, "rounds", integer=True)
    options.positive(args.budget, "budget")
    options.positive(args.decode_reps, "decode-reps", integer=True)
    cands = [c for c in str(args.cands).split(",") if c]
    for name in cands:
        KernelSpec.from_name(name)  # ValueError (one line, exit 2) for a name that is not a kernel's
    return {"cases": cases, "d": options.head_dims(str(args.d))[0], "impls": options.names(args.impls, IMPLS, "impls"),
            "rounds": int(args.rounds), "budget": float(args.budget), "cands": cands,
            "decode_reps": int(args.decode_reps), "decode_batches": options.ints(args.decode_batches, "decode-batches")}


def _tensors(case: Case, h: int, device):
    """flashgen's variant keywords with their tensors (ALiBi's geometric slopes, random sinks)."""
    import torch

    kw = {}
    for name, value in case.options.items():
        if name == "alibi_slopes":
            kw[name] = torch.tensor(alibi_slopes(h), device=device)
        elif name == "sinks":
            kw[name] = torch.randn(h, device=device, dtype=torch.float32)
        else:
            kw[name] = value
    return kw


def _flex(case: Case, q, k, v, kw):
    """FlexAttention for the case as a function of (q, k, v) (its block mask built once, here): the
    window as a mask_mod, the softcap and ALiBi as a score_mod, GQA through enable_gqa."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    if "sinks" in kw:
        raise Skipped("FlexAttention has no sink logits")
    nq, nk = q.shape[2], k.shape[2]
    off = nk - nq
    left = kw.get("window", (-1, -1))[0]

    def mask_mod(b, h, i, j):
        seen = i + off >= j if case.causal else (j >= 0)
        return seen & (i + off - j <= left) if left >= 0 else seen

    block_mask = (create_block_mask(mask_mod, None, None, nq, nk, device=q.device)
                  if case.causal or left >= 0 else None)
    score_mod = None
    if "softcap" in kw:
        cap = kw["softcap"]

        def score_mod(score, b, h, i, j):
            return cap * torch.tanh(score / cap)
    elif "alibi_slopes" in kw:
        slopes = kw["alibi_slopes"]

        def score_mod(score, b, h, i, j):
            return score - slopes[h] * (j - i - off).abs()
    fn = baselines.flex_fn()
    gqa = q.shape[1] != k.shape[1]
    return lambda q_, k_, v_: fn(q_, k_, v_, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)


def _with_backward(run, q, k, v):
    """``run(q, k, v)`` and its backward through autograd, on leaves that need grad (one output gradient,
    made once)."""
    import torch

    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    dout = torch.randn_like(q)

    def step():
        for t in leaves:
            t.grad = None
        run(*leaves).backward(dout)
    return step


def decode_keys(variant: str, length: int) -> int:
    """Keys one decode call reads per sequence of ``length`` keys (one new token): all of them, or the
    window's left + 1."""
    return min(length, DECODE_WINDOW + 1) if variant == "window" else length


def decode_lengths(copies: int) -> list:
    """The window case's sequence lengths, one per rotated call: DECODE_L, then 4225 keys shorter each
    (the window's 4097 keys and a 128-key block apart: disjoint windows)."""
    stride = DECODE_WINDOW + 1 + 128
    return [DECODE_L - i * stride for i in range(copies)]


def decode_rows(settings, progress) -> list:
    """One row per batch size: the decode variants of DECODE_VARIANTS timed in the same interleaved rounds
    (TB/s on the bytes each reads), with each variant's TB/s over the plain decode's."""
    import torch

    from .. import api

    d, rows = settings["d"], []
    for batch in settings["decode_batches"]:
        gen = torch.Generator(device="cuda").manual_seed(5000 + batch)
        q = torch.randn(batch, 1, DECODE_HEADS, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(batch, DECODE_L, DECODE_KV_HEADS, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        sinks = torch.randn(DECODE_HEADS, device="cuda", generator=gen)
        slopes = torch.tensor(alibi_slopes(DECODE_HEADS), device="cuda")
        makers, facts, nbytes, copies = {}, {}, {}, {}
        for name, opts in DECODE_VARIANTS:
            kw = {**opts, **({"sinks": sinks} if "sinks" in opts else {}),
                  **({"alibi_slopes": slopes} if "alibi_slopes" in opts else {}),
                  **({"score_mod": _decode_mod(opts["score_mod"], slopes)} if "score_mod" in opts else {})}
            read = decode_keys(name, DECODE_L)
            nbytes[name] = decode_bench.kv_bytes(batch, DECODE_KV_HEADS, read, d)
            copies[name] = decode_bench.copies_for(nbytes[name]) if name == "window" else 1
            lens = [torch.full((batch,), n, dtype=torch.int32, device="cuda") for n in decode_lengths(copies[name])]

            def make(name=name, kw=kw, lens=lens):
                def fn(i):
                    return api.decode(q, k, v, lens[i], check_values=False, **kw)
                facts[name] = decode_bench.plan_facts(fn)
                once = (lambda: fn(0))
                once.fn, once.copies = fn, copies[name]
                return once
            makers[name] = make
        measure = (lambda once: graph_us(lambda i: once.fn(i % once.copies), settings["decode_reps"]))
        cells = time_cell(makers, settings["rounds"], measure, unit="us")
        for name, cell in cells.items():
            if "us" in cell:
                cell["tbps"] = nbytes[name] / cell["us"] / 1e6
            cell.update(facts.get(name, {}), kv_bytes=nbytes[name], copies=copies[name])
        row = {"batch": batch, "L": DECODE_L, "heads": DECODE_HEADS, "kv_heads": DECODE_KV_HEADS, "head_dim": d,
               "window": DECODE_WINDOW, "rounds": settings["rounds"], "reps": settings["decode_reps"],
               "results": cells}
        add_ratios(row, "tbps", [(f"{name}_x_plain", name, "plain") for name, _ in DECODE_VARIANTS[1:]]
                   + list(DECODE_MOD_RATIOS))
        rows.append(row)
        progress(f"decode b={batch}: " + ", ".join(f"{n}={c['tbps']:.2f}" if "tbps" in c else f"{n}=-"
                                                   for n, c in cells.items())
                 + "".join(f" {lbl}={r:.2f}" for lbl, r in row.get("ratios", {}).items()))
        del q, k, v, makers
        free()
    return rows


def _decode_mod(name: str, slopes):
    """The score_mod that writes out a built-in decode variant: the softcap of DECODE_VARIANTS, or ALiBi with
    ``slopes`` (one per head; q_idx is the new token's position, as decode's ALiBi offset counts it)."""
    import torch

    if name == "softcap":
        return lambda score, b, h, q, kv: 50.0 * torch.tanh(score / 50.0)
    return lambda score, b, h, q, kv: score - slopes[h] * (q - kv).abs()


def decode_section(rows, settings) -> dict:
    """The ``decode`` section of the suite's result (a table of its own: TB/s, one row per batch)."""
    return {"metric": "tbps", "precision": 2, "x": "batch", "panels": ["L"],
            "impls": [name for name, _ in DECODE_VARIANTS],
            "ratios": [f"{name}_x_plain" for name, _ in DECODE_VARIANTS[1:]] + [r for r, _, _ in DECODE_MOD_RATIOS],
            "convention": f"flashgen.decode, bf16, d = {settings['d']}, GQA {DECODE_HEADS}/{DECODE_KV_HEADS}, one new "
                          f"token; TB/s = K/V bytes read (window: its {DECODE_WINDOW + 1} keys per sequence) / time per "
                          "call (back-to-back calls replayed from a CUDA graph); "
                          f"median of {settings['rounds']} interleaved rounds; <variant>_x_plain: its TB/s over the "
                          "plain decode's; <mod>_x_builtin: the variant written as a score_mod over the built-in",
            "rows": rows}


def run(args, progress) -> dict:
    import torch

    from .. import api

    settings = parse(args)
    require_cuda("variants")
    d = settings["d"]
    meta_info = meta()
    rows = []
    decode_table = decode_rows(settings, progress) if "decode" in settings["cases"] else None
    for case in (c for c in CASES if c.name in settings["cases"]):
        gen = torch.Generator(device="cuda").manual_seed(case.n + d)

        def rnd(b, h, n):
            return torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)

        q, k, v = rnd(case.batch, case.heads, case.n), rnd(case.batch, case.kv_heads, case.n), \
            rnd(case.batch, case.kv_heads, case.n)
        pn, pb = case.plain_n or case.n, case.plain_batch or case.batch
        if (pn, pb) == (case.n, case.batch):
            pq, pk, pv = q, k, v
        else:
            pq, pk, pv = rnd(pb, case.heads, pn), rnd(pb, case.kv_heads, pn), rnd(pb, case.kv_heads, pn)
        kw = _tensors(case, case.heads, q.device)
        variant = Variant.of(case.causal, kw.get("window"), kw.get("softcap", 0.0))
        work = 3.5 if case.grad else 1.0
        flop = {"flashgen": work * 4.0 * case.batch * case.heads * variant.pairs(case.n, case.n) * d,
                "flashgen_plain": work * 4.0 * pb * case.heads * Variant.of(case.causal).pairs(pn, pn) * d}
        flop["flex"] = flop["flashgen"]
        makers = {}
        for impl in settings["impls"]:
            if impl == "flashgen":
                makers[impl] = (lambda: _with_backward(lambda a, b_, c: api.attention(a, b_, c, causal=case.causal, **kw),
                                                       q, k, v)) if case.grad else \
                    (lambda: (lambda: api.attention(q, k, v, causal=case.causal, **kw)))
            elif impl == "flashgen_plain":
                makers[impl] = (lambda: _with_backward(lambda a, b_, c: api.attention(a, b_, c, causal=case.causal),
                                                       pq, pk, pv)) if case.grad else \
                    (lambda: (lambda: api.attention(pq, pk, pv, causal=case.causal)))
            elif case.grad:
                makers[impl] = lambda: _with_backward(_flex(case, q, k, v, kw), q, k, v)
            else:
                makers[impl] = lambda: (lambda f: lambda: f(q, k, v))(_flex(case, q, k, v, kw))
        full = Variant.of(case.causal, kw.get("window"), kw.get("softcap", 0.0), "alibi_slopes" in kw, "sinks" in kw)
        for i, name in enumerate(settings["cands"], 1):
            spec = KernelSpec.from_name(name)

            def make(spec=spec):
                if any(getattr(spec, f) != on for f, on in full.flags().items()) or spec.head_dim < d:
                    raise Skipped(f"{spec.name} does not fit this case")
                return lambda: api.attention(q, k, v, causal=case.causal, spec=spec, **kw)
            makers[f"c{i}"] = make
            flop[f"c{i}"] = flop["flashgen"]
        measure = lambda fn: time_ms(fn, budget_s=settings["budget"], min_reps=5, max_reps=30, warmup=2)["ms"]  # noqa: E731
        with torch.set_grad_enabled(case.grad):
            cells = time_cell(makers, settings["rounds"], measure)
        for impl, cell in cells.items():
            if "ms" in cell:
                cell["tflops"] = flop[impl] / cell["ms"] / 1e9
        label = case.name + ("" if case.name == "window" or not any(
            c.name == case.name and c.causal != case.causal for c in CASES) else ("_causal" if case.causal else "_full"))
        row = {"case": label, "head_dim": d, "seqlen": case.n, "batch": case.batch, "heads": case.heads,
               "kv_heads": case.kv_heads, "causal": case.causal,
               "options": {k_: (v_ if not hasattr(v_, "shape") else f"tensor{tuple(v_.shape)}") for k_, v_ in kw.items()},
               "plain": {"seqlen": pn, "batch": pb}, "rounds": settings["rounds"], "results": cells}
        add_ratios(row, "tflops", [(lbl, "flashgen", base) for lbl, base in RATIOS]
                   + [(f"c{i}_plain", f"c{i}", "flashgen_plain") for i in range(1, len(settings["cands"]) + 1)])
        rows.append(row)
        progress(f"{label}: " + ", ".join(f"{i}={c['tflops']:.0f}" if "tflops" in c else f"{i}=-"
                                          for i, c in cells.items())
                 + "".join(f" {lbl}={r:.2f}" for lbl, r in row.get("ratios", {}).items()))
        del q, k, v, pq, pk, pv
        free()
    result = {"suite": "variants", "meta": meta_info, "metric": "tflops", "x": "case", "panels": ["head_dim"],
            "convention": "bf16; TFLOP/s = 4 B H (visible query-key pairs) d / time; median of "
                          f"{settings['rounds']} interleaved rounds; x_plain / x_flex: flashgen's variant over "
                          "its plain kernel (window: dense causal at N = 4k) / over FlexAttention",
            "settings": settings, "impls": settings["impls"] + [f"c{i}" for i in range(1, len(settings["cands"]) + 1)],
            "ratios": [r for r, _ in RATIOS] + [f"c{i}_plain" for i in range(1, len(settings["cands"]) + 1)],
            "notes": [f"c{i}: {name}" for i, name in enumerate(settings["cands"], 1)], "rows": rows}
    if decode_table is not None:
        result["sections"] = {"decode": decode_section(decode_table, settings)}
    return result


register(Suite("variants", "window, softcap, ALiBi and sinks: flashgen next to its plain kernel and "
                           "FlexAttention, interleaved rounds", add_args, run))
