"""The ``models`` suite: a Hugging Face transformers model end to end, ``attn_implementation="fgen"``
(``flashgen.integrations.transformers``) next to ``"sdpa"``, in the same interleaved rounds.

The model: a random-weight Llama-architecture model, bf16 on the GPU (default about 1.2B parameters:
hidden 2048, 16 layers, 32 heads / 8 KV heads (d 64), intermediate 8192, vocab 32000); one copy per
implementation (the same weights), so no call switches implementations inside a timed region.

Cases:

- ``prefill``: ``--batch`` x ``--seqlen`` tokens (8 x 4096) through the model under no_grad with the
  default cache, the last position's logits only (``logits_to_keep=1``, as generate's prefill);
- ``train_packed``: one training step (forward with labels + ``loss.backward()``, no optimizer) on
  ``--train-rows`` rows of ``--train-seqlen`` tokens (2 x 8192), each row ``--docs`` sequences packed
  by position_ids (lengths drawn once from ``--seed``): flashgen runs them as varlen rows; transformers
  hands SDPA a block-diagonal causal 4-D mask (whatever kernel SDPA then picks);
- ``train_causal``: the same step with one sequence per row (plain causal: SDPA's flash/cuDNN path).

Implementations: ``flashgen``, ``sdpa``, and ``no_attention`` (an attention function that returns its
query: every other part of the model's work, the anchor of the attention shares). Metric: tokens per
second (the rows' tokens / the call's time); ``x_sdpa``: flashgen over SDPA. Fields ``attn_flashgen``
and ``attn_sdpa``: attention's share of that implementation's time, 1 - t(no_attention) / t(impl).
"""
from __future__ import annotations

import copy
import random

from ..errors import FlashgenError
from . import options
from .registry import Suite, register
from .timing import add_ratios, free, meta, require_cuda, time_cell, time_ms

IMPLS = ("flashgen", "sdpa", "no_attention")
CASES = ("prefill", "train_packed", "train_causal")
NO_ATTENTION = "bench_no_attention"


def add_args(p) -> None:
    p.add_argument("--layers", type=int, default=16, help="decoder layers (default 16)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    p.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (default 8)")
    p.add_argument("--intermediate", type=int, default=8192, help="MLP size (default 8192)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    p.add_argument("--batch", type=int, default=8, help="prefill sequences (default 8)")
    p.add_argument("--seqlen", type=int, default=4096, help="prefill tokens per sequence (default 4096)")
    p.add_argument("--train-rows", type=int, default=2, help="training rows (default 2)")
    p.add_argument("--train-seqlen", type=int, default=8192, help="tokens per training row (default 8192)")
    p.add_argument("--docs", type=int, default=4, help="sequences packed in each train_packed row (default 4)")
    p.add_argument("--seed", type=int, default=0, help="weights, tokens and packed lengths (default 0)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"implementations (default and known: {','.join(IMPLS)})")
    p.add_argument("--cases", default=",".join(CASES), help=f"cases ({', '.join(CASES)}; default all)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per case (default 3; the median counts)")
    p.add_argument("--budget", type=float, default=0.5, help="seconds of timed calls per implementation per round")


def parse(args) -> dict:
    for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "batch", "seqlen", "train_rows",
                 "train_seqlen", "docs", "rounds"):
        options.positive(getattr(args, name), name.replace("_", "-"), integer=True)
    options.positive(args.budget, "budget")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise ValueError(f"--heads ({args.heads}) must divide --hidden ({args.hidden}) and be a multiple of "
                         f"--kv-heads ({args.kv_heads})")
    d = args.hidden // args.heads
    if d % 8 or d > 256:
        raise ValueError(f"the head dim --hidden / --heads = {d} must be a multiple of 8 up to 256")
    if args.docs > args.train_seqlen:
        raise ValueError(f"--docs ({args.docs}) must be at most --train-seqlen ({args.train_seqlen})")
    impls = options.names(args.impls, IMPLS, "impls")
    return {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": d, "intermediate": args.intermediate, "vocab": args.vocab, "batch": args.batch,
            "seqlen": args.seqlen, "train_rows": args.train_rows, "train_seqlen": args.train_seqlen,
            "docs": args.docs, "seed": int(args.seed), "impls": impls,
            "cases": options.names(args.cases, CASES, "cases"), "rounds": int(args.rounds),
            "budget": float(args.budget)}


def doc_lengths(rng: random.Random, total: int, docs: int) -> list:
    """``docs`` lengths of at least 1 summing to ``total``: uniform cut points."""
    cuts = sorted(rng.sample(range(1, total), docs - 1)) if docs > 1 else []
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _no_attention(module, query, key, value, attention_mask, **kwargs):
    """The model without attention's work: the query as the output (batch, seqlen, heads, d), so the
    projections, the rest of the layer and the backward through them still run."""
    return query.transpose(1, 2), None


def run(args, progress) -> dict:
    import torch

    from ..integrations import transformers as hf

    settings = parse(args)
    require_cuda("models")
    try:
        import transformers
        from transformers import AttentionInterface
    except ImportError:
        raise FlashgenError("flashgen bench models needs transformers 5: pip install 'transformers>=5'") from None
    names = {"flashgen": hf.register(), "sdpa": "sdpa", "no_attention": NO_ATTENTION}
    AttentionInterface.register(NO_ATTENTION, _no_attention)
    if "no_attention" in settings["impls"]:
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register(NO_ATTENTION, hf.padding_mask)  # no dense mask built either
    s = settings
    cfg = transformers.LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                                   num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                                   num_key_value_heads=s["kv_heads"], vocab_size=s["vocab"],
                                   max_position_embeddings=max(s["seqlen"], s["train_seqlen"]),
                                   tie_word_embeddings=False)
    torch.manual_seed(s["seed"])
    with torch.device("cuda"):
        base = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    params = sum(p.numel() for p in base.parameters())
    progress(f"model: Llama {s['layers']} x {s['hidden']}, {params / 1e9:.2f}B parameters, bf16")
    models = {}
    for impl in s["impls"]:
        model = base if impl == "sdpa" else copy.deepcopy(base)
        model.set_attn_implementation(names[impl])
        models[impl] = model
    if "sdpa" not in s["impls"]:
        del base
    gen = torch.Generator(device="cuda").manual_seed(s["seed"])
    rng = random.Random(s["seed"])
    label = f"llama {params / 1e9:.2f}B"
    rows, checks = [], []
    for case in s["cases"]:
        if case == "prefill":
            ids = torch.randint(1, s["vocab"], (s["batch"], s["seqlen"]), device="cuda", generator=gen)
            tokens = ids.numel()

            def make(impl, ids=ids):
                model = models[impl].eval()

                def call():
                    with torch.no_grad():
                        return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits
                return call
            train = False
        else:
            rows_, n = s["train_rows"], s["train_seqlen"]
            ids = torch.randint(1, s["vocab"], (rows_, n), device="cuda", generator=gen)
            if case == "train_packed":
                lens = [doc_lengths(rng, n, s["docs"]) for _ in range(rows_)]
                pos = torch.stack([torch.cat([torch.arange(k) for k in row]) for row in lens]).cuda()
            else:
                lens = [[n] for _ in range(rows_)]
                pos = torch.arange(n, device="cuda")[None].expand(rows_, n)
            tokens = ids.numel()

            def make(impl, ids=ids, pos=pos):
                model = models[impl].train()

                def call():
                    model.zero_grad(set_to_none=True)
                    loss = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
                    loss.backward()
                    return loss
                return call
            train = True
        # The answers agree before anything is timed (flashgen against SDPA; no_attention is no answer).
        if "flashgen" in models and "sdpa" in models:
            a, b = make("flashgen")(), make("sdpa")()
            diff = (a.float() - b.float()).abs().max().item()
            checks.append(f"{case}: flashgen vs sdpa {'loss' if train else 'last logits'} max |diff| {diff:.3g}")
            for model in models.values():
                model.zero_grad(set_to_none=True)
        makers = {impl: (lambda impl=impl: make(impl)) for impl in s["impls"]}
        measure = lambda fn: time_ms(fn, budget_s=s["budget"], min_reps=3, max_reps=20, warmup=1)["ms"]  # noqa: E731
        cells = time_cell(makers, s["rounds"], measure)
        for cell in cells.values():
            if "ms" in cell:
                cell["tok_s"] = tokens / cell["ms"] * 1e3
        row = {"model": label, "case": case, "tokens": tokens, "rounds": s["rounds"], "results": cells}
        if case != "prefill":
            row["lengths"] = lens
        none = cells.get("no_attention", {}).get("ms")
        for impl in ("flashgen", "sdpa"):
            ms = cells.get(impl, {}).get("ms")
            row[f"attn_{impl}"] = f"{100 * (1 - none / ms):.0f}%" if ms and none else "-"
        add_ratios(row, "tok_s", [("x_sdpa", "flashgen", "sdpa")])
        rows.append(row)
        progress(f"{case}: " + ", ".join(f"{i}={c['tok_s']:.0f} tok/s" if "tok_s" in c else f"{i}=-"
                                         for i, c in cells.items())
                 + "".join(f" {k}={v:.2f}" for k, v in row.get("ratios", {}).items())
                 + f" attention share: flashgen {row['attn_flashgen']}, sdpa {row['attn_sdpa']}")
        for model in models.values():
            model.zero_grad(set_to_none=True)
        free()
    return _result(settings, {**meta(), "transformers": transformers.__version__}, rows, checks, params)


def _result(settings: dict, info: dict, rows: list, checks: list, params: int) -> dict:
    s = settings
    return {"suite": "models", "meta": info, "metric": "tok_s", "precision": 0, "x": "case", "panels": ["model"],
            "fields": ["tokens", "attn_flashgen", "attn_sdpa"], "impls": s["impls"], "ratios": ["x_sdpa"],
            "settings": settings, "parameters": params,
            "convention": f"bf16, tokens/s of the whole model (median of {s['rounds']} interleaved rounds); prefill: "
                          f"{s['batch']} x {s['seqlen']} under no_grad with the cache, last logits only; train_*: "
                          f"forward + backward on {s['train_rows']} x {s['train_seqlen']} tokens (packed: "
                          f"{s['docs']} sequences per row by position_ids); attn_*: 1 - t(no_attention) / t(impl)",
            "notes": checks, "rows": rows}

register(Suite("models", "a transformers Llama model end to end (prefill, packed and causal training steps): "
                         "attn_implementation 'fgen' next to 'sdpa', interleaved rounds", add_args, run))
