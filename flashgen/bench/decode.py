"""The ``decode`` suite: ``flashgen.decode`` (Flash-Decoding) next to torch SDPA's flash and cuDNN backends.

bf16, d = 128, one new token per sequence (seqlen_q = 1), (batch, heads_q, heads_kv) in (1,32,32),
(1,32,8), (8,32,8), (32,32,8), cache length L in {4k, 32k, 128k} (``--cases`` for others).
Bandwidth = bytes of K and V read (2 · batch · L · heads_kv · d · 2) / time, TB/s.

Method. flashgen and the SDPA backends of a case are timed in interleaved rounds with all their
inputs resident (``--rounds``, the order reversed every other round; each round the median of
``--reps`` CUDA-event-timed calls); a row reports the median over the rounds per implementation,
the rounds themselves and their spread, and ``x_flash`` / ``x_cudnn`` are ratios of those medians,
so a clock or thermal drift during the run shows as spread, not as a difference between
implementations. Where the K/V of one case is smaller than 256 MB, calls rotate over several
copies of the inputs so that L2 (50-60 MB on the H200) never serves them. flashgen reads the cache
(batch, L, heads_kv, d) as a strided view of the same (batch, heads_kv, L, d) tensors SDPA gets.
SDPA gets GQA through ``enable_gqa=True`` where the backend takes it, else K/V expanded with
repeat_interleave outside the timed region (recorded per cell as ``gqa``). The value checks of
``flashgen.decode`` (a device sync) are off in the timed calls (``check_values=False``).

Sections: ``paged`` (page 64 and 256, a random page order, against a contiguous cache of the same
lengths, interleaved), ``splits`` (flashgen at forced split counts, interleaved; the heuristic's
count is the row's ``splits`` in the main table) and ``host`` (per-call host time, the ``host``
suite's decode part).
"""
from __future__ import annotations

import math

from .. import testing
from ..families import decode as decode_family
from . import baselines, options
from .registry import Suite, register
from .timing import add_ratios, free, host_row, meta, require_cuda, rotating, time_cell, time_ms

SHAPES = ((1, 32, 32), (1, 32, 8), (8, 32, 8), (32, 32, 8))
LENGTHS = (4096, 32768, 131072)
CASES = tuple((b, hq, hk, L) for b, hq, hk in SHAPES for L in LENGTHS)
PAGED_CASES = ((1, 32, 8, 131072), (8, 32, 8, 32768), (32, 32, 8, 32768))
SPLIT_CASES = ((1, 32, 8, 131072), (1, 32, 32, 32768), (8, 32, 8, 131072))
SPLITS = (1, 4, 8, 16, 24, 32, 48, 64, 96, 128)
PAGE_SIZES = (64, 256)
IMPLS = ("flashgen", "sdpa_flash", "sdpa_cudnn")
ROTATE_BYTES = 256 * 2**20   # K/V bytes the rotated copies of a case add up to at least (L2 is 50-60 MB)
MAX_COPIES = 16
EXPAND_LIMIT = 40 * 2**30    # don't materialise repeat_interleave'd K/V past this
CASE_FIELDS = ("b", "hq", "hk", "L")


def _cases(text, what, default):
    if text is None:
        return [tuple(c) for c in default]
    if str(text).strip().lower() == "none":
        return []
    cases = options.shapes(text, what, CASE_FIELDS)
    for b, hq, hk, L in cases:
        if hq % hk:
            raise ValueError(f"--{what}: heads_kv {hk} must divide heads_q {hq}")
    return cases


def add_args(p) -> None:
    p.add_argument("--cases", default=None,
                   help='cache shapes "b,hq,hk,L;..." (default: the 12 of b,hq,hk in (1,32,32),(1,32,8),(8,32,8),'
                        '(32,32,8) x L in 4k,32k,128k)')
    p.add_argument("--d", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"implementations (default and known: {','.join(IMPLS)})")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds per case (default 7)")
    p.add_argument("--reps", type=int, default=20, help="timed calls per implementation per round (default 20)")
    p.add_argument("--paged-cases", default=None,
                   help="shapes of the paged section (default 1,32,8,131072;8,32,8,32768;32,32,8,32768; 'none')")
    p.add_argument("--page-sizes", default=",".join(map(str, PAGE_SIZES)), help="page sizes (default 64,256)")
    p.add_argument("--split-cases", default=None,
                   help="shapes of the split-count section (default 1,32,8,131072;1,32,32,32768;8,32,8,131072; "
                        "'none')")
    p.add_argument("--splits", default=",".join(map(str, SPLITS)), help="split counts of that section")
    p.add_argument("--no-host", action="store_true", help="leave out the per-call host time section")


def parse(args) -> dict:
    options.positive(args.rounds, "rounds", integer=True)
    options.positive(args.reps, "reps", integer=True)
    options.head_dims(str(args.d))
    page_sizes = options.ints(args.page_sizes, "page-sizes")
    allowed = decode_family.PAGE_SIZES
    bad = [p for p in page_sizes if p not in allowed]
    if bad:
        raise ValueError(f"--page-sizes {bad}: flashgen.decode takes pages of {', '.join(map(str, allowed))}")
    paged = _cases(args.paged_cases, "paged-cases", PAGED_CASES)
    for b, hq, hk, L in paged:
        if any(L % p for p in page_sizes):
            raise ValueError(f"--paged-cases: L={L} must be a multiple of every page size {page_sizes}")
    splits = options.ints(args.splits, "splits")
    if any(s > decode_family.MAX_SPLITS_USER for s in splits):
        raise ValueError(f"--splits: at most {decode_family.MAX_SPLITS_USER}")
    cases = _cases(args.cases, "cases", CASES)
    if not cases:
        raise ValueError("--cases: give at least one shape b,hq,hk,L")
    return {"cases": cases, "d": int(args.d), "dtype": args.dtype,
            "impls": options.names(args.impls, IMPLS, "impls"), "rounds": int(args.rounds), "reps": int(args.reps),
            "paged": paged, "page_sizes": page_sizes,
            "split_cases": _cases(args.split_cases, "split-cases", SPLIT_CASES),
            "splits": splits, "host": not args.no_host}


def kv_bytes(b, hk, L, d, elem=2) -> int:
    return 2 * b * L * hk * d * elem


def copies_for(nbytes: int, limit: int = MAX_COPIES) -> int:
    """Input copies to rotate over so that one round's K/V add up to at least ROTATE_BYTES."""
    return max(1, min(limit, math.ceil(ROTATE_BYTES / max(1, nbytes))))


def measure_us(reps: int, copies: int):
    """A measure for ``timing.interleaved``: the median µs of ``reps`` calls of ``fn(i)``, i rotating."""
    return lambda fn: time_ms(rotating(fn, copies), min_reps=reps, max_reps=reps, warmup=3)["ms"] * 1e3


def plan_facts(fn) -> dict:
    """{"spec", "splits"} of the plan ``flashgen.decode`` makes for ``fn(0)``: the decode plan cache is
    emptied first, so the one plan in it afterwards is that call's (re-planning a later case costs a
    dict miss, not a compile: dispatch's picks and the loaded kernels are cached apart)."""
    plans = testing.plans("decode")
    plans.clear()
    fn(0)
    plan = next((p for p in plans.values() if getattr(p, "kernel", None) is not None), None)
    return {"spec": plan.spec.name, "splits": plan.splits} if plan is not None else {}


class Case:
    """The inputs of one case: ``copies`` resident copies of q (b, 1, hq, d) and K/V (b, hk, L, d)."""

    def __init__(self, b, hq, hk, L, d, dtype, seed):
        import torch

        self.b, self.hq, self.hk, self.L, self.d = b, hq, hk, L, d
        self.nbytes = kv_bytes(b, hk, L, d)
        self.copies = copies_for(self.nbytes)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.qs = [torch.randn(b, 1, hq, d, device="cuda", dtype=dtype, generator=gen) for _ in range(self.copies)]
        self.ks = [torch.randn(b, hk, L, d, device="cuda", dtype=dtype, generator=gen) for _ in range(self.copies)]
        self.vs = [torch.randn(b, hk, L, d, device="cuda", dtype=dtype, generator=gen) for _ in range(self.copies)]
        self.lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
        self.kc = [k.transpose(1, 2) for k in self.ks]  # (b, L, hk, d) views of the same memory
        self.vc = [v.transpose(1, 2) for v in self.vs]

    def row(self) -> dict:
        return {"batch": self.b, "heads_q": self.hq, "heads_kv": self.hk, "L": self.L, "head_dim": self.d,
                "kv_bytes": self.nbytes, "copies": self.copies}

    def flashgen(self, spec=None, num_splits=None):
        """(callable(i), plan facts) of flashgen.decode on this case, planned now."""
        from .. import api

        def fn(i):
            return api.decode(self.qs[i], self.kc[i], self.vc[i], self.lens, num_splits=num_splits,
                                   check_values=False, spec=spec)
        return fn, plan_facts(fn)

    def sdpa(self, name):
        """(callable(i), gqa mode) of one SDPA backend; raises when the backend refuses the case."""
        qh = [q.transpose(1, 2) for q in self.qs]  # (b, hq, 1, d)
        group = self.hq // self.hk
        if group == 1:
            baselines.sdpa(name, qh[0], self.ks[0], self.vs[0])()
            return (lambda i: baselines.sdpa(name, qh[i], self.ks[i], self.vs[i])()), "none (MHA)"
        try:
            baselines.sdpa(name, qh[0], self.ks[0], self.vs[0], enable_gqa=True)()
            return (lambda i: baselines.sdpa(name, qh[i], self.ks[i], self.vs[i], enable_gqa=True)()), "enable_gqa"
        except Exception as exc:  # noqa: BLE001 -- try the expanded K/V next
            first = f"{type(exc).__name__}: {str(exc)[:120]}"
        expanded = sum(k.numel() for k in self.ks) * 2 * 2 * group
        if expanded > EXPAND_LIMIT:
            raise RuntimeError(f"enable_gqa refused ({first}); expanded K/V would be {expanded / 2**30:.0f} GiB")
        ke = [k.repeat_interleave(group, dim=1) for k in self.ks]
        ve = [v.repeat_interleave(group, dim=1) for v in self.vs]
        baselines.sdpa(name, qh[0], ke[0], ve[0])()
        return (lambda i: baselines.sdpa(name, qh[i], ke[i], ve[i])()), \
            "repeat_interleave (outside timing; reads hq/hk x the bytes)"


def timed(makers: dict, settings, copies, nbytes) -> dict:
    """``timing.time_cell`` over makers of (callable of the copy index i, facts): cells in µs with TB/s and
    each maker's facts (plan facts: a dict; SDPA: its GQA mode, a string)."""
    facts, plain = {}, {}
    for name, make in makers.items():
        def made(name=name, make=make):
            fn, fact = make()
            facts[name] = fact
            once = rotating(fn, copies)  # time_cell's first, untimed call
            once.fn = fn
            return once
        plain[name] = made
    measure = measure_us(settings["reps"], copies)
    cells = time_cell(plain, settings["rounds"], lambda once: measure(once.fn), unit="us")
    for name, cell in cells.items():
        if "us" in cell:
            cell["tbps"] = nbytes / cell["us"] / 1e6
        if isinstance(facts.get(name), dict):
            cell.update(facts[name])
        elif facts.get(name):
            cell["gqa"] = facts[name]
    return cells




def main_rows(settings, dtype, progress, checkpoint=None, rows=None) -> list:
    rows = [] if rows is None else rows
    for i, (b, hq, hk, L) in enumerate(sorted(settings["cases"], key=lambda c: kv_bytes(c[0], c[2], c[3], 1))):
        case = Case(b, hq, hk, L, settings["d"], dtype, seed=1000 + i)
        makers = {}
        for impl in settings["impls"]:
            makers[impl] = case.flashgen if impl == "flashgen" else (lambda name: lambda: case.sdpa(name))(impl)
        row = {**case.row(), "rounds": settings["rounds"], "reps": settings["reps"],
               "results": timed(makers, settings, case.copies, case.nbytes)}
        add_ratios(row, "tbps", [("x_flash", "flashgen", "sdpa_flash"), ("x_cudnn", "flashgen", "sdpa_cudnn")])
        rows.append(row)
        del case, makers
        free()
        progress(f"b={b} hq={hq} hk={hk} L={L}: " + ", ".join(
            f"{n}={c['tbps']:.2f}" if "tbps" in c else f"{n}=-" for n, c in row["results"].items())
            + (f" (x cudnn {row['ratios']['x_cudnn']:.3f})" if "x_cudnn" in row.get("ratios", {}) else ""))
        if checkpoint is not None:
            checkpoint(rows)
    return rows


def paged_rows(settings, dtype, progress) -> list:
    """Contiguous vs paged (random page order) bandwidth on the same lengths, all layouts resident and
    timed in interleaved rounds; ``page<P>/contig`` is the ratio of the medians."""
    import torch

    from .. import api

    rows = []
    d = settings["d"]
    for i, (b, hq, hk, L) in enumerate(settings["paged"]):
        nbytes = kv_bytes(b, hk, L, d)
        copies = copies_for(nbytes, 8)
        gen = torch.Generator(device="cuda").manual_seed(2000 + i)
        qs = [torch.randn(b, 1, hq, d, device="cuda", dtype=dtype, generator=gen) for _ in range(copies)]
        lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
        kc = [torch.randn(b, L, hk, d, device="cuda", dtype=dtype, generator=gen) for _ in range(copies)]
        vc = [torch.randn_like(k) for k in kc]
        makers = {"contiguous": lambda: (lambda i: api.decode(qs[i], kc[i], vc[i], lens, check_values=False))}
        keep = []
        for ps in settings["page_sizes"]:
            pages = b * L // ps
            kp = [torch.randn(pages, ps, hk, d, device="cuda", dtype=dtype, generator=gen) for _ in range(copies)]
            vp = [torch.randn_like(k) for k in kp]
            bts = [torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(b, L // ps)
                   for _ in range(copies)]
            keep.append((kp, vp, bts))

            def make(kp=kp, vp=vp, bts=bts):
                api.decode(qs[0], kp[0], vp[0], lens, bts[0])  # value-checked once
                return lambda i: api.decode(qs[i], kp[i], vp[i], lens, bts[i], check_values=False)
            makers[f"page{ps}"] = make

        def with_facts(make):
            def made():
                fn = make()
                return fn, plan_facts(fn)
            return made
        makers = {name: with_facts(m) for name, m in makers.items()}
        row = {"batch": b, "heads_q": hq, "heads_kv": hk, "L": L, "kv_bytes": nbytes, "copies": copies,
               "rounds": settings["rounds"], "results": timed(makers, settings, copies, nbytes)}
        add_ratios(row, "tbps", [(f"page{ps}/contig", f"page{ps}", "contiguous") for ps in settings["page_sizes"]])
        rows.append(row)
        progress(f"paged b={b} hk={hk} L={L}: " + ", ".join(
            f"{n}={c['tbps']:.2f}" if "tbps" in c else f"{n}=-" for n, c in row["results"].items()))
        del qs, kc, vc, keep, makers
        free()
    return rows


def split_rows(settings, dtype, progress) -> list:
    """flashgen at each forced split count on one case, the counts in interleaved rounds (one row per
    case and count: x = splits)."""
    rows = []
    for i, (b, hq, hk, L) in enumerate(settings["split_cases"]):
        case = Case(b, hq, hk, L, settings["d"], dtype, seed=3000 + i)
        makers = {str(s): (lambda s: lambda: case.flashgen(num_splits=s))(s) for s in settings["splits"]}
        makers["heuristic"] = lambda: case.flashgen()
        cells = timed(makers, settings, case.copies, case.nbytes)
        heuristic = cells.pop("heuristic")
        for s in settings["splits"]:
            rows.append({**case.row(), "splits": s, "heuristic_splits": heuristic.get("splits"),
                         "results": {"flashgen": cells[str(s)], "heuristic": heuristic}})
        progress(f"splits b={b} hq={hq} hk={hk} L={L}: " + ", ".join(
            f"{s}:{cells[str(s)].get('tbps', float('nan')):.2f}" for s in settings["splits"])
            + f"; heuristic {heuristic.get('splits')} splits {heuristic.get('tbps', float('nan')):.2f}")
        del case, makers
        free()
    return rows


def host_inputs():
    """(q, k, lens, paged k, block table) of the host-time rows: b1, hq32, hk8, 512 keys, d 128, bf16 (a
    call whose GPU work is a few µs, so bursts of calls measure the host)."""
    import torch

    d = 128
    q = torch.randn(1, 1, 32, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 512, 8, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((1,), 512, dtype=torch.int32, device="cuda")
    kp = torch.randn(8, 64, 8, d, device="cuda", dtype=torch.bfloat16)
    bt = torch.arange(8, dtype=torch.int32, device="cuda").view(1, 8)
    return q, k, lens, kp, bt


def host_rows(calls=200, rounds=20, warmup=1000, progress=print) -> list:
    """Per-call host time of flashgen.decode with a cached plan: split (the heuristic's count), one split,
    paged, with the value checks (a device sync and two small host copies); SDPA flash with enable_gqa on
    the same shape for scale."""
    from .. import api

    q, k, lens, kp, bt = host_inputs()
    qh, kh = q.transpose(1, 2), k.transpose(1, 2).contiguous()
    cases = {
        "split": lambda: api.decode(q, k, k, lens, check_values=False),
        "nosplit": lambda: api.decode(q, k, k, lens, num_splits=1, check_values=False),
        "paged": lambda: api.decode(q, kp, kp, lens, bt, check_values=False),
        "checked": lambda: api.decode(q, k, k, lens),
        "sdpa_flash": baselines.sdpa("sdpa_flash", qh, kh, kh, enable_gqa=True),
    }
    rows = []
    for name, fn in cases.items():
        facts = {}
        if name != "sdpa_flash":
            try:
                facts = plan_facts(lambda i, fn=fn: fn())
            except Exception:  # noqa: BLE001 -- the row records the error
                pass
        rows.append(host_row("decode", name, fn, calls, rounds, warmup,
                             spec=facts.get("spec", "") + (f" ({facts['splits']} splits)" if facts else "")))
        progress(f"host decode {name}: {rows[-1]['results']['host']}")
    return rows


def _geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def notes(rows) -> list:
    out = []
    xs = [(r, r["ratios"]["x_cudnn"]) for r in rows if "x_cudnn" in r.get("ratios", {})]
    if xs:
        below = [f"b{r['batch']}/hk{r['heads_kv']}/L{r['L']} {x:.3f}" for r, x in xs if x < 1.0]
        out.append(f"x_cudnn over {len(xs)} cases: min {min(x for _, x in xs):.3f}, geomean "
                   f"{_geomean([x for _, x in xs]):.3f}; below 1.0: {', '.join(below) or 'none'}")
    gqa = sorted({c.get("gqa") for r in rows for n, c in r["results"].items() if n != "flashgen" and c.get("gqa")})
    if gqa:
        out.append("SDPA GQA modes: " + "; ".join(gqa))
    splits = [f"b{r['batch']}/hk{r['heads_kv']}/L{r['L']}: {r['results']['flashgen'].get('splits')}"
              for r in rows if "splits" in r["results"].get("flashgen", {})]
    if splits:
        out.append("flashgen splits: " + ", ".join(splits))
    return out


def run(args, progress) -> dict:
    settings = parse(args)
    require_cuda("decode")
    dtype = options.dtype_of(settings["dtype"])
    meta_info = meta()
    checkpoint = getattr(args, "checkpoint", None)
    rows = main_rows(settings, dtype, progress,
                     checkpoint=(lambda r: checkpoint(_result(settings, meta_info, r))) if checkpoint else None)
    result = _result(settings, meta_info, rows)
    sections = {}
    if settings["paged"]:
        sections["paged"] = {"metric": "tbps", "precision": 2, "x": "L", "panels": ["batch", "heads_q", "heads_kv"],
                             "impls": ["contiguous", *(f"page{p}" for p in settings["page_sizes"])],
                             "ratios": [f"page{p}/contig" for p in settings["page_sizes"]],
                             "convention": "flashgen.decode, contiguous vs paged cache (random page order), "
                                           "interleaved rounds",
                             "rows": paged_rows(settings, dtype, progress)}
        result["sections"] = sections
        if checkpoint is not None:
            checkpoint(result)
    if settings["split_cases"]:
        sections["splits"] = {"metric": "tbps", "precision": 2, "x": "splits",
                              "panels": ["batch", "heads_q", "heads_kv", "L"], "fields": ["heuristic_splits"],
                              "impls": ["flashgen", "heuristic"],
                              "convention": "flashgen.decode at forced split counts (heuristic: num_splits=None), "
                                            "interleaved rounds",
                              "rows": split_rows(settings, dtype, progress)}
        result["sections"] = sections
        if checkpoint is not None:
            checkpoint(result)
    if settings["host"]:
        sections["host"] = {"metric": "us", "precision": 1, "x": "call", "panels": ["entry"], "impls": ["host"],
                            "fields": ["spec"],
                            "convention": "per-call host time, cached plan: bursts of calls without a sync, best of "
                                          "rounds (flashgen.bench.timing.host_us)",
                            "rows": host_rows(calls=200, rounds=20, warmup=1000, progress=progress)}
        result["sections"] = sections
    return result


def _result(settings, meta_info, rows) -> dict:
    impls = settings["impls"]
    ratios = [label for label, base in (("x_flash", "sdpa_flash"), ("x_cudnn", "sdpa_cudnn"))
              if base in impls and "flashgen" in impls]
    return {"suite": "decode", "meta": meta_info, "metric": "tbps", "precision": 2, "x": "L",
            "panels": ["batch", "heads_q", "heads_kv"],
            "convention": f"{settings['dtype']}, d={settings['d']}, seqlen_q=1; TB/s = K+V bytes / median time; "
                          f"interleaved over {settings['rounds']} rounds x {settings['reps']} calls, medians of the "
                          "rounds; x_flash / x_cudnn: flashgen over SDPA flash / cuDNN",
            "settings": settings, "impls": impls, "ratios": ratios, "rows": rows, "notes": notes(rows)}


register(Suite("decode", "Flash-Decoding over a KV cache next to SDPA flash and cuDNN: TB/s, paged layouts, "
                         "split counts, host time", add_args, run))
