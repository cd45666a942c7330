"""The ``mods`` suite: user mods (``score_mod`` / ``mask_mod``, flashgen.mods) in flashgen's forward (or, with
``--mode fwd+bwd``, a forward and its backward: ``torch.autograd.grad`` with a random dO, counted as 3.5
forwards), next to flashgen's built-in equivalent and FlexAttention (torch ``flex_attention`` compiled,
with its block mask) running the same Python functions, in the same interleaved rounds.

Cases (bf16, d = 128 unless ``--d``; the mods are FlexAttention's examples):

- ``causal``: mask_mod ``q >= kv`` at N = 8k, MHA 16 heads x batch 2 and GQA 32/8 x batch 1; built-in:
  ``causal=True``;
- ``alibi``: an ALiBi score_mod (one slope per head) with the causal mask_mod, 8k MHA; built-in:
  ``alibi_slopes`` with ``causal=True``;
- ``softcap``: a softcap-50 score_mod with the causal mask_mod, 8k MHA; built-in: ``softcap=50``, causal;
- ``window``: a sliding-window mask_mod (4096 back, causal) at N = 32k, GQA 32/8, batch 1; built-in:
  ``window=(4096, 0)``, causal;
- ``document``: 16 documents of random lengths packed in one 32k row, causal inside each, GQA 32/8, as a
  mask_mod over captured document ids; built-in: ``attention_varlen`` on the same documents;
- ``relative``: a relative-position bias table (heads x (2N - 1), captured) as a score_mod, causal, 8k
  MHA; no built-in equivalent;
- ``prefix``: prefix-LM, ``kv <= prefix[b] | q >= kv`` with a captured prefix length per batch (1500 and
  3000 of 8k, MHA 16 heads x batch 2: the block mask per batch); no built-in equivalent;
- ``host`` (a section of its own): an ALiBi score_mod with the causal mask_mod on 1 x 2 x 128 x 64
  inputs: the first call with a mod no cache has seen (trace, render, NVRTC, load: its constant is
  new each run), the host time per later call (``timing.host_us``, cached plan) next to the plain
  causal call's, and a new process's time from ``import flashgen`` to its first result with the
  kernel in the disk cache (median of 3 processes).

``--family fwd_v2`` runs flashgen's calls (the mods and the built-in equivalent) on the mma.sync forward, the
kernel of the GPUs without fwd_sm90, to compare the two there.

TFLOP/s count the visible (query, key) pairs (the block mask's ``pairs``). ``x_builtin`` and ``x_flex``:
flashgen's mods over the built-in equivalent / over FlexAttention (above 1: the mods are faster).
"""
from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from .. import dispatch, mods
from .. import settings as flashgen_settings
from ..problem import ProblemKey, bucket_of, head_dim_tile
from ..variants import Variant, alibi_slopes
from . import baselines, options
from .registry import Suite, register
from .timing import Skipped, add_ratios, free, host_us, meta, require_cuda, time_cell, time_ms


@dataclass(frozen=True)
class Case:
    name: str
    n: int
    heads: int
    kv_heads: int
    batch: int
    per_batch: bool = False  # the mask reads b: block masks (flashgen's and FlexAttention's) per batch


CASES = (
    Case("causal", 8192, 16, 16, 2), Case("causal", 8192, 32, 8, 1), Case("alibi", 8192, 16, 16, 2),
    Case("softcap", 8192, 16, 16, 2), Case("window", 32768, 32, 8, 1), Case("document", 32768, 32, 8, 1),
    Case("relative", 8192, 16, 16, 2), Case("prefix", 8192, 16, 16, 2, per_batch=True),
)
CASE_NAMES = (*dict.fromkeys(c.name for c in CASES), "host")
IMPLS = ("flashgen", "builtin", "flex")
# flashgen_mask_mod: the mods' kernel without KernelSpec.row_bounds (the mask_mod called per score of a partial
# block), where the case's mask has row bounds (dispatch's kernel masks by them): what the bounds are worth.
KNOWN_IMPLS = (*IMPLS, "flashgen_mask_mod")
RATIOS = (("x_builtin", "builtin"), ("x_flex", "flex"))
ROWS_RATIOS = (("rows_gain", "flashgen", "flashgen_mask_mod"),)
MODES = ("fwd", "fwd+bwd")
FAMILIES = ("auto", "fwd_v2")
BWD_FLOPS = 2.5  # the backward's FLOPs over the forward's (the suite convention)
WINDOW, SOFTCAP, DOCS, PREFIXES = 4096, 50.0, 16, (1500, 3000)


def add_args(p) -> None:
    p.add_argument("--cases", default=",".join(CASE_NAMES),
                   help=f"cases to run, comma-separated ({', '.join(CASE_NAMES)}; default all)")
    p.add_argument("--d", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"implementations (default {','.join(IMPLS)}; known: {','.join(KNOWN_IMPLS)})")
    p.add_argument("--mode", choices=MODES, default="fwd",
                   help="the forward alone (default), or a forward and its backward (torch.autograd.grad of the "
                        "output with a random dO; counted as 3.5 forwards)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per cell (default 5; the median counts)")
    p.add_argument("--budget", type=float, default=0.25, help="seconds of timed calls per implementation per round")
    p.add_argument("--family", choices=FAMILIES, default="auto",
                   help="the forward family of flashgen's calls, mods and built-in alike: dispatch's (auto, the "
                        "default) or fwd_v2 (the mma.sync kernel the GPUs without fwd_sm90 run)")


def parse(args) -> dict:
    options.positive(args.rounds, "rounds", integer=True)
    options.positive(args.budget, "budget")
    return {"cases": options.names(args.cases, CASE_NAMES, "cases"), "d": options.head_dims(str(args.d))[0],
            "impls": options.names(args.impls, KNOWN_IMPLS, "impls"), "mode": args.mode, "rounds": int(args.rounds),
            "budget": float(args.budget), "family": getattr(args, "family", "auto")}


def doc_bounds(n: int, docs: int, seed: int) -> list:
    """``docs`` document starts in ``n`` tokens (random cut points, seed ``seed``), then ``n``."""
    import random

    cuts = sorted(random.Random(seed).sample(range(1, n), docs - 1))
    return [0, *cuts, n]


def case_token(name: str, batch: int, heads: int, n: int) -> int:
    """The mod token (``KernelSpec.mod``) of case ``name``'s functions built for (batch, heads, n): traced on
    the CPU (a token depends on the graphs, not on where their tensors are). ValueError for an unknown case."""
    if name not in {c.name for c in CASES}:
        raise ValueError(f"--mods {name!r}: one of {', '.join(dict.fromkeys(c.name for c in CASES))}")
    score_mod, mask_mod, _, _ = case_mods(Case(name, n, heads, heads, batch), "cpu")
    return mods.token_number(mods.trace_pair(score_mod, mask_mod, allow_cpu=True))


def case_mods(case: Case, device):
    """(score_mod, mask_mod, built-in keywords or None, packed documents' bounds or None) of a case."""
    import torch

    n, h = case.n, case.heads

    def causal(b, h_, q, kv):
        return q >= kv

    if case.name == "causal":
        return None, causal, {"causal": True}, None
    if case.name == "alibi":
        slopes = torch.tensor(alibi_slopes(h), device=device)

        def alibi(score, b, h_, q, kv):
            return score - slopes[h_] * (q - kv).abs()
        return alibi, causal, {"causal": True, "alibi_slopes": slopes}, None
    if case.name == "softcap":
        def softcap(score, b, h_, q, kv):
            return SOFTCAP * torch.tanh(score / SOFTCAP)
        return softcap, causal, {"causal": True, "softcap": SOFTCAP}, None
    if case.name == "window":
        def window(b, h_, q, kv):
            return (q >= kv) & (q - kv <= WINDOW)
        return None, window, {"causal": True, "window": (WINDOW, 0)}, None
    if case.name == "document":
        bounds = doc_bounds(n, DOCS, seed=n)
        doc = torch.zeros(n, dtype=torch.int32, device=device)
        for i, start in enumerate(bounds[1:-1], 1):
            doc[start:] = i

        def document(b, h_, q, kv):
            return (doc[q] == doc[kv]) & (q >= kv)
        return None, document, None, bounds
    if case.name == "relative":
        bias = torch.randn(h, 2 * n - 1, device=device) * 0.5

        def relative(score, b, h_, q, kv):
            return score + bias[h_, q - kv + (n - 1)]
        return relative, causal, None, None
    if case.name == "prefix":
        prefix = torch.tensor(PREFIXES[:case.batch], dtype=torch.int32, device=device)

        def prefix_lm(b, h_, q, kv):
            return (kv <= prefix[b]) | (q >= kv)
        return None, prefix_lm, None, None
    raise ValueError(f"unknown mods case {case.name!r}")


def run(args, progress) -> dict:
    import torch

    from .. import api

    settings = parse(args)
    require_cuda("mods")
    d = settings["d"]
    grads = settings["mode"] == "fwd+bwd"
    meta_info = meta()
    rows = []
    host = host_section(progress) if "host" in settings["cases"] else None
    for case in (c for c in CASES if c.name in settings["cases"]):
        gen = torch.Generator(device="cuda").manual_seed(case.n + d + case.heads)

        def rnd(h):
            return torch.randn(case.batch, h, case.n, d, device="cuda", dtype=torch.bfloat16, generator=gen)

        q, k, v = (t.requires_grad_(grads) for t in (rnd(case.heads), rnd(case.kv_heads), rnd(case.kv_heads)))
        score_mod, mask_mod, builtin, bounds = case_mods(case, q.device)
        mask_batch = case.batch if case.per_batch else None
        block_mask = api.create_block_mask(mask_mod, mask_batch, None, case.n, case.n)
        pairs = block_mask.for_tile(128, 128).pairs  # over the mask's batches (one where it takes none)
        flop = 4.0 * (case.batch // (mask_batch or 1)) * case.heads * pairs * d * (1 + BWD_FLOPS if grads else 1)
        mod_spec, builtin_spec = _forced(settings["family"], q, score_mod, block_mask, builtin, bounds)
        makers, cells_spec = {}, {}  # (cells_spec: the forced kernels the makers chose)
        for impl in settings["impls"]:
            if impl == "flashgen":
                makers[impl] = lambda: _timed(lambda: api.attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                                    spec=mod_spec), (q, k, v), grads)
            elif impl == "flashgen_mask_mod":
                def rows_call():
                    spec = _mask_mod_spec(settings["family"], q, score_mod, block_mask)
                    cells_spec["flashgen_mask_mod"] = spec
                    return _timed(lambda: api.attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                        spec=spec), (q, k, v), grads)
                makers[impl] = rows_call
            elif impl == "builtin":
                makers[impl] = lambda: _timed(*_builtin(q, k, v, builtin, bounds, api, builtin_spec), grads)
            else:
                makers[impl] = lambda: _timed(_flex(q, k, v, score_mod, mask_mod, case), (q, k, v), grads)
        measure = lambda fn: time_ms(fn, budget_s=settings["budget"], min_reps=5, max_reps=30, warmup=2)["ms"]  # noqa: E731
        with torch.set_grad_enabled(grads):
            cells = time_cell(makers, settings["rounds"], measure)
        for impl, cell in cells.items():
            if "ms" in cell:
                cell["tflops"] = flop / cell["ms"] / 1e9
        if "ms" in cells.get("flashgen", {}):  # the kernel the mods ran on (the plan of this case's call)
            cells["flashgen"]["spec"] = _mod_kernel(q, block_mask, mod_spec)
        if "ms" in cells.get("flashgen_mask_mod", {}):
            cells["flashgen_mask_mod"]["spec"] = cells_spec["flashgen_mask_mod"].name
        if builtin_spec is not None and "ms" in cells.get("builtin", {}):
            cells["builtin"]["spec"] = builtin_spec.name
        label = f"{case.name}_gqa" if case.heads != case.kv_heads and case.name == "causal" else case.name
        row = {"case": label, "head_dim": d, "seqlen": case.n, "batch": case.batch, "heads": case.heads,
               "kv_heads": case.kv_heads, "pairs": pairs, "rounds": settings["rounds"], "results": cells}
        add_ratios(row, "tflops", [(lbl, "flashgen", base) for lbl, base in RATIOS] + list(ROWS_RATIOS))
        rows.append(row)
        progress(f"{label}: " + ", ".join(f"{i}={c['tflops']:.0f}" if "tflops" in c else f"{i}=-"
                                          for i, c in cells.items())
                 + "".join(f" {lbl}={r:.2f}" for lbl, r in row.get("ratios", {}).items()))
        del q, k, v, block_mask
        free()
    result = {"suite": "mods", "meta": meta_info, "metric": "tflops", "x": "case", "panels": ["head_dim"],
            "convention": "bf16; TFLOP/s = 4 B H (visible query-key pairs) d / time"
                          + (" (x 3.5: a forward and its backward)" if grads else "") + "; median of "
                          f"{settings['rounds']} interleaved rounds; x_builtin / x_flex: flashgen's mods over its "
                          "built-in equivalent / over FlexAttention (compiled) running the same functions",
            "settings": settings, "impls": settings["impls"],
            "ratios": [r for r, _ in RATIOS] + ([r for r, _, _ in ROWS_RATIOS]
                                                 if "flashgen_mask_mod" in settings["impls"] else []), "rows": rows}
    if host is not None:
        result["sections"] = {"host": host}
    return result


# A new process's first call with a mod (its kernel already in FLASHGEN_HOME's disk cache).
_CHILD = """
import json, time, torch
q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
slopes = torch.rand(2, device="cuda")
torch.cuda.synchronize()
t0 = time.perf_counter()
import flashgen
def alibi(score, b, h, q_idx, kv_idx):
    return score - slopes[h] * (q_idx - kv_idx).abs() * {c!r}
def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx
with torch.no_grad():
    out = flashgen.attention(q, q, q, score_mod=alibi, mask_mod=causal)
torch.cuda.synchronize()
print(json.dumps({{"first_result_s": time.perf_counter() - t0}}))
"""


def host_section(progress) -> dict:
    """The ``host`` section: a new mod's first call, the per-call host time, a new process's first result."""
    import torch

    from .. import api

    c = 1.0 + random.random() * 1e-3  # a constant no cache has: a new graph, a new kernel
    q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    slopes = torch.rand(2, device="cuda")

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs() * c

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    rows = []
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        api.attention(q, q, q, score_mod=alibi, mask_mod=causal)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        rows.append({"measure": "first call, new mod", "value": first, "unit": "s"})
        for name, fn in (("per call, mods", lambda: api.attention(q, q, q, score_mod=alibi, mask_mod=causal)),
                         ("per call, causal=True", lambda: api.attention(q, q, q, causal=True))):
            for _ in range(500):
                fn()
            rows.append({"measure": name, "value": host_us(fn, 200, 20), "unit": "us"})
    env = flashgen_settings.child_environment(PYTHONUNBUFFERED="1")
    samples = []
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", _CHILD.format(c=c)], env=env, capture_output=True, text=True,
                              timeout=600, cwd=os.getcwd())
        if proc.returncode != 0:
            raise RuntimeError((proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300])
        samples.append(json.loads(proc.stdout.strip().splitlines()[-1])["first_result_s"])
    rows.append({"measure": "new process, warm cache, to first result", "value": statistics.median(samples),
                 "unit": "s", "runs": samples})
    for r in rows:
        progress(f"host {r['measure']}: {r['value']:.4g} {r['unit']}")
    return {"metric": "value", "x": "measure", "impls": ["value"], "precision": 4,
            "convention": "1 x 2 x 128 x 64 bf16, an ALiBi score_mod and the causal mask_mod; first call: trace, "
                          "render, NVRTC, load and the launch (synchronized); per call: host time with a cached "
                          "plan (best of 20 bursts of 200); new process: import flashgen to the first result, "
                          "the kernel in the disk cache (median of 3)",
            "rows": [{**r, "results": {"value": {"value": r["value"]}}} for r in rows]}


def _mod_kernel(q, block_mask, spec=None) -> str:
    """The spec name of the newest mods plan for ``q``'s shape with ``block_mask`` and the forced ``spec`` (None:
    dispatch's pick) (api.modcall's cache)."""
    from ..api.plans import cache

    names = [plan.base.kernel.spec.name for sig, plan in cache("attention with mods").items()
             if sig[0] == q.shape and sig[-1] is block_mask and sig[-4] == spec and plan.base.kernel is not None]
    return names[-1] if names else ""


def _timed(fn, inputs, grads: bool):
    """The timed call: ``fn`` (the forward), or with ``grads`` the forward and ``torch.autograd.grad`` of its
    output over ``inputs`` with a random dO (made once)."""
    import torch

    if not grads:
        return fn
    dout = torch.randn_like(fn())
    return lambda: torch.autograd.grad(fn(), inputs, dout)


def _forced(family: str, q, score_mod, block_mask, builtin, bounds):
    """(the mods call's spec, the built-in call's spec) in ``family``: (None, None) for dispatch's picks
    ("auto"), else the kernels dispatch takes in that family (the mods' by ``api.modcall.mod_spec``, as the
    call would; the built-in's its variant key's pick)."""
    if family == "auto":
        return None, None
    from ..api.device import Device
    from ..api.modcall import call_spec

    dev = Device.of(q.device.index)
    d, n = q.shape[-1], q.shape[-2]
    spec = call_spec(q, score_mod, block_mask, family)
    if bounds is not None:
        variant = Variant.of(True, None, 0.0, False, False).replace(varlen=True)
    elif builtin is not None:
        variant = Variant.of(builtin.get("causal", False), builtin.get("window"), builtin.get("softcap", 0.0),
                             builtin.get("alibi_slopes") is not None, False)
    else:
        return spec, None
    key = ProblemKey("fwd", dev.arch, "bf16", head_dim_tile(d), variant.causal, bucket_of(n), variant.key())
    return spec, dispatch.select(key, dev.gpu, dev.smem_budget, verify=True, family=family)


def _mask_mod_spec(family: str, q, score_mod, block_mask):
    """The kernel dispatch (or ``family``'s rule) picks for the mods call without ``row_bounds`` (the mask_mod
    per score); ``Skipped`` where the case's mask has no row bounds (no mask_mod, or a row that sees two runs of
    keys: the call's own kernel)."""
    from ..api.modcall import call_spec, has_row_bounds

    if not has_row_bounds(block_mask):
        raise Skipped("the mask has no row bounds")
    return call_spec(q, score_mod, block_mask, None if family == "auto" else family, row_bounds=False)


def _builtin(q, k, v, builtin, bounds, api, spec=None):
    """(the call, its inputs) of flashgen's own equivalent of a case: ``attention`` with its variant keywords,
    or ``attention_varlen`` over the case's documents (one row of packed sequences); ``spec`` forces a kernel."""
    import torch

    if bounds is not None:
        cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        packed = tuple(t.detach()[0].transpose(0, 1).contiguous().requires_grad_(t.requires_grad)
                       for t in (q, k, v))  # (total, heads, d)
        return (lambda: api.attention_varlen(*packed, cu, cu, longest, longest, causal=True, check_values=False,
                                             spec=spec), packed)
    if builtin is None:
        raise Skipped("no built-in equivalent")
    return lambda: api.attention(q, k, v, spec=spec, **builtin), (q, k, v)


def _flex(q, k, v, score_mod, mask_mod, case):
    from torch.nn.attention.flex_attention import create_block_mask

    fn = baselines.flex_fn()
    block_mask = create_block_mask(mask_mod, case.batch if case.per_batch else None, None, case.n, case.n,
                                   device=q.device)
    gqa = q.shape[1] != k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    return lambda: fn(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa, scale=scale)


register(Suite("mods", "user score_mod / mask_mod: flashgen next to its built-in equivalent and FlexAttention, "
                       "interleaved rounds", add_args, run))
