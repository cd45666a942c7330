"""The ``varlen`` suite: packed rows (``flashgen.attention_varlen``) next to the same work as rectangular
batches, in the same interleaved rounds.

Case ``packed`` (bf16, d = 128 unless ``--d``, GQA 32/8, causal unless ``--full``): 16 sequence lengths
drawn once (seed ``--seed``) from 64 to 8192 and scaled to 64k tokens in all. Implementations:

- ``flashgen``: one ``attention_varlen`` call over the packed rows (value checks off);
- ``flashgen_dense``: ``flashgen.attention`` on equal-length rows of the same total (16 x 4096): the
  rectangular kernel's speed on the same number of tokens, the anchor of ``x_dense``;
- ``sdpa_cudnn``, ``sdpa_flash``: SDPA on the batch padded to its longest row (K/V expanded to the query
  heads beforehand, not timed): what a caller without varlen pays, the anchors of ``x_cudnn``/``x_flash``.

TFLOP/s count the useful (query, key) pairs of each call's own rows (4 H pairs d, halved-diagonal for
causal: ``Variant.pairs``), so the padded baselines are credited only with the real rows' work.

Case ``packed_bwd``: the same calls forward + backward through autograd (one output gradient per
implementation, made once), FLOPs 3.5x the forward's.

Case ``paged`` (chunked prefill against a paged KV cache): batch 8, each sequence 2048 new query
tokens against 30720 cached keys plus their own (32768 keys, bottom-right causal, GQA 32/8, d as above):

- ``flashgen_p16``, ``flashgen_p64``, ``flashgen_p256``: ``attention_varlen`` with a block table over
  shuffled pages of 16, 64 and 256 keys (value checks off);
- ``flashgen_contig``: the same call on contiguous packed K/V (cu_seqlens_k), the anchor of ``x_contig_*``;
- ``decode_p64``: the same work through ``flashgen.decode`` (q (8, 2048, heads, d), the 64-key pages,
  cache_seqlens 32768): the anchor of ``x_decode``.

Row ``host``: microseconds of host time per ``attention_varlen`` call (``check_values=False``) over
16 sequences of 64 tokens, 200 calls back to back with the GPU running behind.
"""
from __future__ import annotations

import random
import time

from ..variants import Variant
from . import baselines, options
from .registry import Suite, register
from .timing import add_ratios, free, meta, require_cuda, time_cell, time_ms

IMPLS = ("flashgen", "flashgen_dense", "sdpa_cudnn", "sdpa_flash")
RATIOS = (("x_dense", "flashgen_dense"), ("x_cudnn", "sdpa_cudnn"), ("x_flash", "sdpa_flash"))
SEQS, TOTAL, SHORTEST, LONGEST = 16, 65536, 64, 8192
HEADS, KV_HEADS = 32, 8


def lengths(seed: int, seqs: int = SEQS, total: int = TOTAL, lo: int = SHORTEST, hi: int = LONGEST) -> list:
    """``seqs`` lengths in [lo, hi] summing to ``total``: uniform draws scaled to the total, clipped, and the
    remainder spread one token at a time over the sequences that have room."""
    rng = random.Random(seed)
    raw = [rng.uniform(lo, hi) for _ in range(seqs)]
    scale = total / sum(raw)
    out = [min(hi, max(lo, int(x * scale))) for x in raw]
    i = 0
    while sum(out) != total:
        step = 1 if sum(out) < total else -1
        j = i % seqs
        if lo <= out[j] + step <= hi:
            out[j] += step
        i += 1
    return out


def add_args(p) -> None:
    p.add_argument("--d", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--full", action="store_true", help="non-causal (default causal)")
    p.add_argument("--seed", type=int, default=0, help="the lengths' draw (default 0)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"implementations (default and known: {','.join(IMPLS)})")
    p.add_argument("--paged-impls", default=",".join(PAGED_IMPLS),
                   help=f"the paged case's implementations (default and known: {','.join(PAGED_IMPLS)})")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per cell (default 5; the median counts)")
    p.add_argument("--budget", type=float, default=0.25, help="seconds of timed calls per implementation per round")
    p.add_argument("--cases", default=",".join(CASES), help=f"cases ({', '.join(CASES)}; default all)")


CASES = ("packed", "packed_bwd", "paged")
PAGED_IMPLS = ("flashgen_p16", "flashgen_p64", "flashgen_p256", "flashgen_contig", "decode_p64")
PAGED_RATIOS = (("x_contig_p16", "flashgen_p16", "flashgen_contig"), ("x_contig_p64", "flashgen_p64", "flashgen_contig"),
                ("x_contig_p256", "flashgen_p256", "flashgen_contig"), ("x_decode", "flashgen_p64", "decode_p64"))
PREFILL_BATCH, PREFILL_NEW, PREFILL_CACHED = 8, 2048, 30720


def parse(args) -> dict:
    options.positive(args.rounds, "rounds", integer=True)
    options.positive(args.budget, "budget")
    return {"cases": options.names(args.cases, CASES, "cases"), "d": options.head_dims(str(args.d))[0],
            "causal": not args.full, "seed": int(args.seed),
            "impls": options.names(args.impls, IMPLS, "impls"),
            "paged_impls": options.names(args.paged_impls, PAGED_IMPLS, "paged-impls"), "rounds": int(args.rounds),
            "budget": float(args.budget)}


def _padded(q, k, v, lens, longest):
    """The packed batch padded to its longest row, bhsd (B, H, longest, d), K/V expanded to the query heads."""
    import torch

    d = q.shape[-1]
    pq = torch.zeros(SEQS, HEADS, longest, d, device="cuda", dtype=torch.bfloat16)
    pk, pv = torch.zeros_like(pq), torch.zeros_like(pq)
    group = HEADS // KV_HEADS
    for s, n in enumerate(lens):
        a = sum(lens[:s])
        pq[s, :, :n] = q[a:a + n].transpose(0, 1)
        pk[s, :, :n] = k[a:a + n].transpose(0, 1).repeat_interleave(group, 0)
        pv[s, :, :n] = v[a:a + n].transpose(0, 1).repeat_interleave(group, 0)
    return pq, pk, pv


def host_us(d: int, causal: bool) -> float:
    """Host microseconds per attention_varlen call (check_values off) on a small packed batch."""
    import torch

    from .. import api

    q = torch.randn(SEQS * 64, HEADS, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(SEQS * 64, KV_HEADS, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, SEQS * 64 + 1, 64, dtype=torch.int32, device="cuda")
    for _ in range(20):
        api.attention_varlen(q, k, k, cu, cu, 64, 64, causal=causal, check_values=False)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200):
            api.attention_varlen(q, k, k, cu, cu, 64, 64, causal=causal, check_values=False)
        best = min(best, (time.perf_counter() - t0) / 200 * 1e6)
        torch.cuda.synchronize()
    return best


def paged_tables(batch: int, keys: int, page: int, gen):
    """A block table (batch, keys / page) over every page of a cache of batch x keys, shuffled."""
    import torch

    per = keys // page
    order = torch.randperm(batch * per, device="cuda", generator=gen).to(torch.int32)
    return order.view(batch, per)


def paged_case(d: int, causal: bool, settings, gen, progress) -> dict:
    """The ``paged`` row: chunked prefill through block tables of three page sizes, contiguous K/V and decode."""
    import torch

    from .. import api

    b, new, keys = PREFILL_BATCH, PREFILL_NEW, PREFILL_CACHED + PREFILL_NEW

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    q = rnd(b * new, HEADS, d)
    k, v = rnd(b * keys, KV_HEADS, d), rnd(b * keys, KV_HEADS, d)
    cu_q = torch.arange(0, b * new + 1, new, dtype=torch.int32, device="cuda")
    cu_k = torch.arange(0, b * keys + 1, keys, dtype=torch.int32, device="cuda")
    used = torch.full((b,), keys, dtype=torch.int32, device="cuda")
    caches = {}
    for page in (16, 64, 256):
        table = paged_tables(b, keys, page, gen)
        # Page p of the cache holds the rows the table's entry for it names: a gather of the packed rows.
        src = torch.empty(b * keys // page, dtype=torch.long, device="cuda")
        src[table.reshape(-1).long()] = torch.arange(b * keys // page, device="cuda")
        kc, vc = (t.view(-1, page, KV_HEADS, d)[src] for t in (k, v))
        caches[page] = (kc, vc, table)
    runs = {f"flashgen_p{page}": (lambda kc=kc, vc=vc, table=table: api.attention_varlen(
                q, kc, vc, cu_q, None, new, keys, causal=causal, seqused_k=used, block_table=table,
                check_values=False)) for page, (kc, vc, table) in caches.items()}
    runs["flashgen_contig"] = lambda: api.attention_varlen(q, k, v, cu_q, cu_k, new, keys, causal=causal,
                                                           check_values=False)
    kc64, vc64, t64 = caches[64]
    q4 = q.view(b, new, HEADS, d)
    runs["decode_p64"] = lambda: api.decode(q4, kc64, vc64, used, t64, check_values=False)
    impls = [i for i in PAGED_IMPLS if i in settings["paged_impls"]]
    if not causal:
        impls = [i for i in impls if i != "decode_p64"]  # decode is causal
    # Same answer from every implementation before timing (one call each).
    ref = runs["flashgen_contig"]()
    for impl in impls:
        got = runs[impl]().view(ref.shape)
        err = (got.float() - ref.float()).abs().max().item()
        if not err < 2e-2:
            raise RuntimeError(f"paged case: {impl} differs from the contiguous call by {err:.3g}")
    pairs = Variant.of(causal).pairs(new, keys)
    flop = 4.0 * HEADS * b * pairs * d
    makers = {impl: (lambda fn=runs[impl]: fn) for impl in impls}
    measure = lambda fn: time_ms(fn, budget_s=settings["budget"], min_reps=5, max_reps=30, warmup=2)["ms"]  # noqa: E731
    with torch.no_grad():
        cells = time_cell(makers, settings["rounds"], measure)
    for cell in cells.values():
        if "ms" in cell:
            cell["tflops"] = flop / cell["ms"] / 1e9
    row = {"case": "paged", "head_dim": d, "causal": causal, "batch": b, "new_tokens": new, "keys": keys,
           "heads": HEADS, "kv_heads": KV_HEADS, "rounds": settings["rounds"], "results": cells}
    add_ratios(row, "tflops", PAGED_RATIOS)
    progress("paged: " + ", ".join(f"{i}={c['tflops']:.0f}" if "tflops" in c else f"{i}=-" for i, c in cells.items())
             + "".join(f" {lbl}={r:.2f}" for lbl, r in row.get("ratios", {}).items()))
    return row


def run(args, progress) -> dict:
    import torch

    from .. import api

    settings = parse(args)
    require_cuda("varlen")
    d, causal = settings["d"], settings["causal"]
    lens = lengths(settings["seed"])
    gen = torch.Generator(device="cuda").manual_seed(settings["seed"] + d)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v = rnd(TOTAL, HEADS, d), rnd(TOTAL, KV_HEADS, d), rnd(TOTAL, KV_HEADS, d)
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(SEQS)], dtype=torch.int32, device="cuda")
    longest, equal = max(lens), TOTAL // SEQS
    variant = Variant.of(causal)
    useful = sum(variant.pairs(n, n) for n in lens)

    def with_grad(run, *tensors):
        leaves = [t.detach().requires_grad_(True) for t in tensors]
        dout = torch.randn_like(run(*leaves))

        def step():
            for t in leaves:
                t.grad = None
            run(*leaves).backward(dout)
        return step

    dense = (rnd(SEQS, HEADS, equal, d), rnd(SEQS, KV_HEADS, equal, d), rnd(SEQS, KV_HEADS, equal, d))
    padded = _padded(q, k, v, lens, longest) if any(i.startswith("sdpa") for i in settings["impls"]) else None
    runs = {"flashgen": (lambda a, b_, c: api.attention_varlen(a, b_, c, cu, cu, longest, longest, causal=causal,
                                                               check_values=False), (q, k, v)),
            "flashgen_dense": (lambda a, b_, c: api.attention(a, b_, c, causal=causal), dense)}
    for impl in settings["impls"]:
        if impl.startswith("sdpa"):
            runs[impl] = ((lambda impl: lambda a, b_, c: baselines.sdpa(impl, a, b_, c, causal)())(impl), padded)
    rows = []
    for case in settings["cases"]:
        if case == "paged":
            continue
        grad = case == "packed_bwd"
        work = 3.5 if grad else 1.0
        flop = {"flashgen": work * 4.0 * HEADS * useful * d,
                "flashgen_dense": work * 4.0 * HEADS * SEQS * variant.pairs(equal, equal) * d}
        makers = {}
        for impl in settings["impls"]:
            fn, tensors = runs[impl]
            flop.setdefault(impl, flop["flashgen"])
            if grad:
                makers[impl] = (lambda fn=fn, tensors=tensors: with_grad(fn, *tensors))
            else:
                makers[impl] = (lambda fn=fn, tensors=tensors: (lambda: fn(*tensors)))
        measure = lambda fn: time_ms(fn, budget_s=settings["budget"], min_reps=5, max_reps=30, warmup=2)["ms"]  # noqa: E731
        with torch.set_grad_enabled(grad):
            cells = time_cell(makers, settings["rounds"], measure)
        for impl, cell in cells.items():
            if "ms" in cell:
                cell["tflops"] = flop[impl] / cell["ms"] / 1e9
        row = {"case": case, "head_dim": d, "causal": causal, "lengths": lens, "tokens": TOTAL, "heads": HEADS,
               "kv_heads": KV_HEADS, "longest": longest, "rounds": settings["rounds"], "results": cells}
        add_ratios(row, "tflops", [(lbl, "flashgen", base) for lbl, base in RATIOS])
        rows.append(row)
        progress(f"{case}: " + ", ".join(f"{i}={c['tflops']:.0f}" if "tflops" in c else f"{i}=-"
                                         for i, c in cells.items())
                 + "".join(f" {lbl}={r:.2f}" for lbl, r in row.get("ratios", {}).items()))
    del q, k, v, runs, dense, padded
    free()
    if "paged" in settings["cases"]:
        rows.append(paged_case(d, causal, settings, gen, progress))
        free()
    host = host_us(d, causal)
    progress(f"host: {host:.1f} us per call")
    return {"suite": "varlen", "meta": meta(), "metric": "tflops", "x": "case", "panels": ["head_dim"],
            "convention": f"bf16, GQA {HEADS}/{KV_HEADS}, {SEQS} sequences, {TOTAL} tokens; TFLOP/s = 4 H (useful "
                          "query-key pairs of the real rows) d / time; median of "
                          f"{settings['rounds']} interleaved rounds; packed_bwd: forward + backward, 3.5x the "
                          "forward's FLOPs; x_dense: over flashgen.attention on "
                          f"{SEQS} x {equal} rows; x_cudnn / x_flash: over SDPA on the batch padded to its longest row; "
                          f"paged: {PREFILL_BATCH} x {PREFILL_NEW} new tokens against {PREFILL_CACHED} cached keys, "
                          "x_contig_*: over the contiguous call, x_decode: over flashgen.decode",
            "settings": settings, "impls": settings["impls"],
            "ratios": [r for r, _ in RATIOS] + [r for r, _, _ in PAGED_RATIOS], "host_us": host, "rows": rows}


register(Suite("varlen", "packed rows (attention_varlen) next to equal-length dense rows and SDPA on the padded "
                         "batch, interleaved rounds", add_args, run))
