"""``flashgen bench``: named benchmark suites, one result format, a table, JSON and plots.

Suites (one module each, registered with ``register(Suite(...))`` when imported):

- ``fwd``: the forward, flashgen next to SDPA's backends (and FlexAttention), hidden-2048 convention;
- ``bwd``: forward + backward through autograd (or the backward alone), default and deterministic;
- ``decode``: Flash-Decoding over a KV cache next to SDPA, TB/s of K/V read; paged, split counts, host time;
- ``ablation``: the Hopper forward's techniques one by one (``families.fwd_sm90.ABLATION``) beside cuDNN;
- ``ab``: candidate kernels (full names) side by side on given shapes, cuDNN as the anchor;
- ``host``: per-call host time of ``flashgen.attention`` / ``flashgen.decode`` with cached plans;
- ``startup``: time to the first ``flashgen.attention`` result of a new process (warm and cold cache);
- ``sass``: no GPU: ptxas reports and SASS instruction counts of every kernel dispatch can pick;
- ``stalls``: Nsight Compute on named forward kernels: issue slots, pipes, warp stall reasons;
- ``variants``: window, softcap, ALiBi, sinks next to the plain kernel and FlexAttention;
- ``varlen``: packed rows next to dense rows and SDPA on the padded batch;
- ``mods``: user score_mod / mask_mod next to flashgen's built-in equivalents and FlexAttention;
- ``models``: a transformers Llama model end to end (prefill, training steps), attn_implementation "fgen"
  next to "sdpa", with attention's share of each.

A suite (``registry.Suite``) adds its options to the ``bench`` parser, checks them before touching
a GPU (ValueError: the CLI prints one line and exits 2), and returns a result:

    {"suite": name, "meta": {...}, "convention": text, "metric": "tflops",
     "x": "seqlen", "panels": ["head_dim", "causal"], "impls": [names...],
     "rows": [{"head_dim": 64, "causal": false, "seqlen": 512, ...,
               "results": {impl: {"ms": .., "tflops": ..} | {"error": ..} | {"skipped": ..}}}]}

``x`` names the row field on the plots' x axis (numbers, or names such as an
ablation's variants) and ``panels`` the fields whose values make one panel
each; every suite's result can then be printed and plotted by the same code
(``flashgen.bench.report``, which also lists the optional parts: ratios,
notes, sections, precision). A cell that fails is recorded with its reason and
the run goes on. Timed suites use interleaved rounds (``timing.rounds_order``):
every implementation of a cell once per round, the order reversed every other
round, the cell's value the median over the rounds, every round kept.
"""
from __future__ import annotations

from .registry import SUITES, Suite, register

__all__ = ["SUITES", "Suite", "register", "suites", "BUILT_IN"]

BUILT_IN = ("fwd", "bwd", "decode", "ablation", "ab", "host", "startup", "sass", "stalls", "variants", "varlen", "models",
            "mods")


def suites() -> dict[str, Suite]:
    """Every registered suite (importing the built-in ones first; none of them imports torch at import)."""
    from . import (ab, ablation, bwd, decode, fwd, host, models, mods, sass, stalls, startup,  # noqa: F401
                   variants, varlen)  # (each registers itself)

    return SUITES
