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
count is the row's ``splits`` in the main table), ``fp8`` (the same cache in FP8 against the 16-bit one,
below) and ``host`` (per-call host time, the ``host`` suite's decode part).

The ``fp8`` section (``--fp8-cases``): per case, ``flashgen.decode`` over the 16-bit cache and over the
same cache quantized to float8 e4m3 per (batch, KV head) (``flashgen.quantize_fp8``; the descales stay
on the device), interleaved in the same rounds, same q, same shapes; ``--fp8-tiles`` adds FP8 kernels
forced to other tiles. Each cell has tokens/s (batch x seqlen_q / time, the table's metric) and TB/s on
the bytes that call reads (2 bytes per K/V element for the 16-bit cache, 1 for FP8); ``fp8/<dtype>`` is
the tokens/s ratio. The notes check the FP8 cache against its bar on every case whose 16-bit K+V is at
least 256 MB: >= 1.8x the 16-bit cache's tokens/s and >= 4.0 TB/s on the FP8 bytes read.
"""
from __future__ import annotations

import math

from .. import testing
from ..families import decode as decode_family
from ..problem import smallest_tile
from ..spec import KernelSpec
from . import baselines, options
from .registry import Suite, register
from .timing import add_ratios, free, host_row, meta, require_cuda, rotating, time_cell, time_ms

SHAPES = ((1, 32, 32), (1, 32, 8), (8, 32, 8), (32, 32, 8))
LENGTHS = (4096, 32768, 131072)
CASES = tuple((b, hq, hk, L) for b, hq, hk in SHAPES for L in LENGTHS)
PAGED_CASES = ((1, 32, 8, 131072), (8, 32, 8, 32768), (32, 32, 8, 32768))
SPLIT_CASES = ((1, 32, 8, 131072), (1, 32, 32, 32768), (8, 32, 8, 131072))
# The fp8 section's cases: one per regime at 256 MB of 16-bit K+V or more (few: b1/hk8, some: b1/hk32 and
# b8/hk8, full: b32/hk8, many: b64/hk8), and one small read.
FP8_CASES = ((1, 32, 8, 32768), (1, 32, 8, 131072), (1, 32, 32, 32768), (8, 32, 8, 32768), (8, 32, 8, 131072),
             (32, 32, 8, 32768), (64, 32, 8, 8192))
FP8_BAR = (1.8, 4.0, 256 * 2**20)  # tokens/s over the 16-bit cache's, TB/s on FP8 bytes, from this 16-bit K+V
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
    p.add_argument("--fp8-cases", default=None,
                   help="shapes of the fp8 section (an FP8 cache against the 16-bit one; default "
                        + ";".join(",".join(map(str, c)) for c in FP8_CASES) + "; 'none')")
    p.add_argument("--fp8-tiles", default="",
                   help='FP8 kernels forced to these tiles in the fp8 section too, "block_n/warps/stages/kv_load,..." '
                        '(default: only the rule\'s pick)')
    p.add_argument("--fp8-splits", default="",
                   help="the FP8 cache at these forced split counts too, in the fp8 section (default: only the "
                        "heuristic's)")
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
    fp8_cases = _cases(getattr(args, "fp8_cases", "none"), "fp8-cases", FP8_CASES)
    if not cases and not fp8_cases:
        raise ValueError("--cases: give at least one shape b,hq,hk,L")
    return {"cases": cases, "d": int(args.d), "dtype": args.dtype,
            "impls": options.names(args.impls, IMPLS, "impls"), "rounds": int(args.rounds), "reps": int(args.reps),
            "paged": paged, "page_sizes": page_sizes,
            "split_cases": _cases(args.split_cases, "split-cases", SPLIT_CASES),
            "splits": splits, "host": not args.no_host, "fp8_cases": fp8_cases,
            "fp8_tiles": fp8_tiles(getattr(args, "fp8_tiles", ""), int(args.d), args.dtype),
            "fp8_splits": fp8_splits(getattr(args, "fp8_splits", ""))}


def fp8_splits(text) -> list:
    """``--fp8-splits``: split counts (1 .. MAX_SPLITS_USER), each once."""
    if not str(text).strip():
        return []
    splits = list(dict.fromkeys(options.ints(text, "fp8-splits")))
    if any(s > decode_family.MAX_SPLITS_USER for s in splits):
        raise ValueError(f"--fp8-splits: at most {decode_family.MAX_SPLITS_USER}")
    return splits


def fp8_impls(settings) -> list:
    """The fp8 section's cells after the 16-bit cache's: the rule's FP8 pick, each forced tile, each forced
    split count."""
    return ["fp8", *("fp8_" + "/".join(map(str, t)) for t in settings["fp8_tiles"]),
            *(f"fp8@{n}" for n in settings["fp8_splits"])]


def fp8_tiles(text, d: int, dtype: str) -> list:
    """``--fp8-tiles`` as (block_n, warps, stages, kv_load) tuples, each a valid FP8 decode_split tile for
    head dim ``d`` (checked on sm_90a here; the run builds them for the GPU's arch)."""
    tiles = []
    for word in filter(None, (w.strip() for w in str(text).split(","))):
        try:
            tile = tuple(int(x) for x in word.split("/"))
        except ValueError:
            tile = ()
        if len(tile) != 4:
            raise ValueError(f"--fp8-tiles: {word!r} is not block_n/warps/stages/kv_load")
        try:
            fp8_tile_spec(tile, "sm_90a", d, dtype)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--fp8-tiles {word}: {exc}") from None
        if tile not in tiles:
            tiles.append(tile)
    return tiles


def fp8_tile_spec(tile, arch: str, d: int, dtype: str):
    """The FP8 decode_split spec of a (block_n, warps, stages, kv_load) tile for inputs of head dim ``d``."""
    bn, w, st, load = tile
    head_dim = smallest_tile(d, decode_family.FP8_HEAD_DIMS)
    return KernelSpec(kind="decode_split", arch=arch, dtype=dtype, head_dim=head_dim, block_m=decode_family.ROWS,
                      block_n=bn, warps=w, stages=st, kv_load=load, causal=True, fp8=True).validate()


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

        self._fp8 = None
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

    def fp8(self):
        """The copies' caches in FP8, made once: (k8 (b, L, hk, d) views, v8 views, k descales, v descales),
        quantized per (batch, KV head) by ``flashgen.quantize_fp8``."""
        from ..api.fp8 import quantize_fp8

        if self._fp8 is None:
            k8, v8 = [quantize_fp8(k, per="head") for k in self.ks], [quantize_fp8(v, per="head") for v in self.vs]
            self._fp8 = ([k.transpose(1, 2) for k, _ in k8], [v.transpose(1, 2) for v, _ in v8],
                         [s for _, s in k8], [s for _, s in v8])
        return self._fp8

    def flashgen(self, spec=None, num_splits=None, fp8=False):
        """(callable(i), plan facts) of flashgen.decode on this case (``fp8``: on its FP8 cache), planned now."""
        from .. import api

        if fp8:
            k8, v8, kd, vd = self.fp8()

            def fn(i):
                return api.decode(self.qs[i], k8[i], v8[i], self.lens, num_splits=num_splits, check_values=False,
                                  spec=spec, k_descale=kd[i], v_descale=vd[i])
        else:
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


def fp8_rows(settings, dtype, progress) -> list:
    """Per fp8 case: flashgen.decode over the 16-bit cache, over its FP8 copy (the rule's pick) and over
    the FP8 copy with each ``--fp8-tiles`` tile and each ``--fp8-splits`` split count forced, in
    interleaved rounds; tokens/s and TB/s on the bytes each reads, and the tokens/s ratios to the 16-bit
    cache."""
    from ..api.device import Device, current_device

    base, rows = settings["dtype"], []
    arch = Device.of(current_device()).arch
    for i, (b, hq, hk, L) in enumerate(settings["fp8_cases"]):
        case = Case(b, hq, hk, L, settings["d"], dtype, seed=4000 + i)
        makers = {base: case.flashgen, "fp8": lambda: case.flashgen(fp8=True)}
        for tile in settings["fp8_tiles"]:
            spec = fp8_tile_spec(tile, arch, settings["d"], base)
            makers["fp8_" + "/".join(map(str, tile))] = (lambda spec: lambda: case.flashgen(spec=spec, fp8=True))(spec)
        for n in settings["fp8_splits"]:
            makers[f"fp8@{n}"] = (lambda n: lambda: case.flashgen(num_splits=n, fp8=True))(n)
        cells = fp8_metrics(timed(makers, settings, case.copies, case.nbytes), base, case.nbytes, b)
        row = {**case.row(), "kv_bytes_fp8": case.nbytes // 2, "rounds": settings["rounds"], "results": cells}
        add_ratios(row, "tokens_per_s", [(f"{name}/{base}", name, base) for name in makers if name != base])
        rows.append(row)
        progress(f"fp8 b={b} hq={hq} hk={hk} L={L}: " + ", ".join(
            f"{n}={c['tbps']:.2f} TB/s" if "tbps" in c else f"{n}=-" for n, c in cells.items())
            + (f" (fp8/{base} {row['ratios'][f'fp8/{base}']:.3f}x tokens/s)" if f"fp8/{base}" in row.get("ratios", {})
               else ""))
        del case, makers
        free()
    return rows


def fp8_metrics(cells: dict, base: str, nbytes: int, batch: int) -> dict:
    """``cells`` (timed's, one new token per sequence) with each timed cell's tokens/s (batch / time) and
    TB/s on the bytes it reads: ``nbytes`` of K and V for the ``base`` (16-bit) cache, half that for an
    FP8 one."""
    for name, cell in cells.items():
        if "us" in cell:
            cell["tbps"] = (nbytes if name == base else nbytes // 2) / cell["us"] / 1e6
            cell["tokens_per_s"] = batch / (cell["us"] * 1e-6)
    return cells


def fp8_notes(rows, base: str) -> list:
    """The FP8 cache against its bar (FP8_BAR) on every row of at least its 16-bit K+V size, and where not."""
    speedup, tbps, least = FP8_BAR
    out = []
    for r in rows:
        if r["kv_bytes"] < least:
            continue
        cell, ratio = r["results"].get("fp8", {}), (r.get("ratios") or {}).get(f"fp8/{base}")
        if ratio is None or "tbps" not in cell:
            out.append(f"b{r['batch']}/hk{r['heads_kv']}/L{r['L']}: no FP8 timing")
            continue
        ok = ratio >= speedup and cell["tbps"] >= tbps
        out.append(f"b{r['batch']}/hk{r['heads_kv']}/L{r['L']} ({r['kv_bytes'] / 2**20:.0f} MB {base}): fp8 "
                   f"{ratio:.3f}x {base} tokens/s, {cell['tbps']:.2f} TB/s of FP8 bytes "
                   f"(bar {speedup}x, {tbps} TB/s): {'meets' if ok else 'BELOW'}")
    return out


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
    if settings["fp8_cases"]:
        rows8 = fp8_rows(settings, dtype, progress)
        base = settings["dtype"]
        sections["fp8"] = {"metric": "tokens_per_s", "precision": 0, "x": "L",
                           "panels": ["batch", "heads_q", "heads_kv"],
                           "impls": [base, *fp8_impls(settings)],
                           "ratios": [f"{name}/{base}" for name in fp8_impls(settings)],
                           "convention": f"flashgen.decode, the {base} cache against its FP8 copy (per-(batch, KV "
                                         "head) descales), interleaved rounds; cells also hold TB/s on the bytes "
                                         "each reads",
                           "rows": rows8, "notes": fp8_notes(rows8, base)}
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
