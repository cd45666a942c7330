"""The ``ab`` suite: candidate kernels side by side on given shapes, cuDNN as the anchor, interleaved rounds.

A candidate is ``default`` (what flashgen's dispatch picks for the shape: the tuned table, else the
default rule) or a full kernel name (``KernelSpec.from_name``:
``fwd_sm90_d128_m128_n128_w12_s3_ws_ov_causal_bf16_sm90a``,
``decode_split_d128_m16_n128_w4_s2_ld2_causal_bf16_sm90a``). For the decode problem a candidate may end
in ``@S``: ``S`` splits (a number), ``@h`` the split heuristic (the default), ``@slots`` one full wave
of the tile's resident CTAs (SMs x CTAs per SM // (batch x KV heads x m-blocks), at least 1) or
``@c<N>`` about N CTAs (N // (batch x KV heads x m-blocks), at least 1).

- ``--problem fwd``: shapes ``b,h,n,d[,causal]`` (bhsd, self-attention, causal 0/1, default 0);
  TFLOP/s at 4·b·h·n²·d FLOPs (halved when causal); a candidate whose causal flag, dtype or head-dim
  tile does not fit a shape is skipped there.
- ``--problem decode``: shapes ``b,hq,hk,L`` (one new token, the cache as the decode suite lays it
  out, rotated copies below 256 MB); TB/s of K/V read; per regime of ``families.decode.decode_regime``
  the geometric mean and minimum of each candidate's ``x_cudnn`` in the notes.

Before timing, every named candidate is checked once against an fp32 reference (the tests' rule:
error at most 2x the same computation's in the input dtype, + a rounding-sized atol; decode: contiguous and paged,
split and not); a wrong one is reported and never timed (``--no-check`` skips this). Then per shape
all candidates and cuDNN run in the same interleaved rounds; labels ``default``, ``c1``, ``c2``, ...
name the columns (the legend is in the notes and ``candidates``).
"""
from __future__ import annotations

import math

from .. import dispatch, families
from ..codegen import build
from ..families import decode as decode_family
from ..iomodel import flops
from ..problem import ProblemKey, bucket_of, smallest_tile
from ..reference import allowance
from ..spec import KernelSpec
from . import baselines, options
from .decode import Case, kv_bytes, timed
from .fwd import measure_ms, pick, with_tflops
from .registry import Suite, register
from .timing import Skipped, add_ratios, error_text, free, meta, prebuild, require_cuda, time_cell

PROBLEMS = ("fwd", "decode")
DEFAULT_SHAPES = {"fwd": "8,16,2048,128,0;8,16,2048,128,1;2,16,8192,128,0;2,16,8192,128,1",
                  "decode": ";".join(",".join(map(str, c)) for c in
                                     ((1, 32, 32, 4096), (1, 32, 32, 32768), (1, 32, 32, 131072), (1, 32, 8, 4096),
                                      (1, 32, 8, 32768), (1, 32, 8, 131072), (8, 32, 8, 4096), (8, 32, 8, 32768),
                                      (8, 32, 8, 131072), (32, 32, 8, 4096), (32, 32, 8, 32768),
                                      (32, 32, 8, 131072)))}
SPLIT_WORDS = ("h", "slots")


def add_args(p) -> None:
    p.add_argument("--problem", choices=PROBLEMS, default="fwd", help="fwd (default) or decode")
    p.add_argument("--cands", required=False, default=None,
                   help="candidates, comma-separated: 'default' or full kernel names (decode: optional @S, @h, @slots, "
                        "@c<CTAs>)")
    p.add_argument("--shapes", default=None,
                   help='fwd: "b,h,n,d[,causal];..." (default: hidden 2048 at N 2k/8k, d 128, causal both); '
                        'decode: "b,hq,hk,L;..." (default: the decode suite\'s 12)')
    p.add_argument("--d", type=int, default=128, help="decode: head dim (default 128)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds per shape (default 7)")
    p.add_argument("--budget", type=float, default=0.25, help="fwd: seconds of timed calls per candidate per round")
    p.add_argument("--reps", type=int, default=20, help="decode: timed calls per candidate per round")
    p.add_argument("--no-check", action="store_true", help="skip the reference check of the named candidates")


def parse_candidate(text: str, problem: str, dtype: str):
    """(spec or None for default, split word or None) of one candidate; ValueError on anything else."""
    name, _, split = text.partition("@")
    if split and problem != "decode":
        raise ValueError(f"--cands {text!r}: '@' (a split count) is for --problem decode")
    if split and split not in SPLIT_WORDS and not split.isdigit() and not (split[:1] == "c" and split[1:].isdigit()):
        raise ValueError(f"--cands {text!r}: after '@' a split count, 'h', 'slots' or c<CTAs>")
    if split.isdigit() and int(split) < 1:
        raise ValueError(f"--cands {text!r}: at least one split")
    if name == "default":
        return None, split or None
    try:
        spec = KernelSpec.from_name(name)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--cands: {exc}") from None
    kinds = families.PROBLEMS["fwd"] if problem == "fwd" else ("decode_split",)
    if spec.kind not in kinds:
        raise ValueError(f"--cands {name}: a {spec.kind} kernel; --problem {problem} takes {', '.join(kinds)}")
    if spec.dtype != dtype:
        raise ValueError(f"--cands {name}: a {spec.dtype} kernel, and --dtype is {dtype}")
    return spec, split or None


def parse(args) -> dict:
    if not args.cands:
        raise ValueError("--cands: give the candidates, e.g. --cands default,<kernel name>")
    options.positive(args.rounds, "rounds", integer=True)
    options.positive(args.budget, "budget")
    options.positive(args.reps, "reps", integer=True)
    problem = args.problem
    texts = [x.strip() for x in args.cands.split(",") if x.strip()]
    if not texts or len(set(texts)) != len(texts):
        raise ValueError(f"--cands: a non-empty list without repeats, got {args.cands!r}")
    cands, n = {}, 0
    for text in texts:
        spec, split = parse_candidate(text, problem, args.dtype)
        if spec is None and split in (None, "h"):
            label = "default"
        else:
            n += 1
            label = f"c{n}"
        if label in cands:
            raise ValueError(f"--cands: 'default' given twice ({args.cands!r})")
        cands[label] = {"text": text, "spec": spec, "split": split}
    shapes_text = args.shapes if args.shapes is not None else DEFAULT_SHAPES[problem]
    if problem == "fwd":
        shapes = options.shapes(shapes_text, "shapes", ("b", "h", "n", "d"), optional=(("causal", 0),))
        for b, h, n, d, c in shapes:
            if c not in (0, 1):
                raise ValueError(f"--shapes: causal is 0 or 1, got {c}")
            options.head_dims(str(d), "shapes")
    else:
        options.head_dims(str(args.d))
        shapes = options.shapes(shapes_text, "shapes", ("b", "hq", "hk", "L"))
        for b, hq, hk, L in shapes:
            if hq % hk:
                raise ValueError(f"--shapes: heads_kv {hk} must divide heads_q {hq}")
        for label, c in cands.items():
            if c["spec"] is not None and c["spec"].head_dim < args.d:
                raise ValueError(f"--cands {c['text']}: head-dim tile {c['spec'].head_dim} < --d {args.d}")
    return {"problem": problem, "cands": cands, "shapes": shapes, "d": int(args.d), "dtype": args.dtype,
            "rounds": int(args.rounds), "budget": float(args.budget), "reps": int(args.reps),
            "check": not args.no_check}


# ------------------------------------------------------------------ reference checks


def _reference(q, k, v, causal: bool, scale: float):
    """fp32 attention of bhsd q, k, v (GQA: K/V heads repeated), causal bottom-right aligned."""
    import torch

    qf, kf, vf = (t.float() for t in (q, k, v))
    group = qf.shape[1] // kf.shape[1]
    if group > 1:
        kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:
        nq, nk = s.shape[-2:]
        keep = torch.arange(nk, device=s.device)[None, :] <= torch.arange(nq, device=s.device)[:, None] + nk - nq
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ vf


def _tolerance(q, k, v, causal, scale, ref):
    """2x the error of the same computation in the input dtype, + its rounding-sized atol (the GPU tests'
    rule, ``flashgen.reference.allowance``)."""
    low = _reference(q, k, v, causal, scale).to(q.dtype).float()
    return allowance(low, ref, q.dtype)


def check_fwd(spec, d: int, causal: bool) -> str | None:
    """None when ``spec`` computes attention within the rule on a ragged (1, 4, 1000, d) case, else why."""
    import torch

    from .. import api

    gen = torch.Generator(device="cuda").manual_seed(7)
    dtype = options.dtype_of(spec.dtype)
    q, k, v = (torch.randn(1, 4, 1000, d, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    scale = 1 / math.sqrt(d)
    ref = _reference(q, k, v, causal, scale)
    out = api.attention(q, k, v, causal=causal, spec=spec).float()
    err, tol = (out - ref).abs().max().item(), _tolerance(q, k, v, causal, scale, ref)
    return None if err <= tol else f"d={d} causal={causal}: max error {err:.3e} > {tol:.3e}"


def check_decode(spec, d: int, splits=None) -> str | None:
    """None when ``spec`` decodes within the rule (b3, hq32, hk8, 3000 keys; contiguous and paged by 64,
    split by the heuristic, not at all, 7 ways and ``splits``), else why."""
    import torch

    from .. import api

    gen = torch.Generator(device="cuda").manual_seed(11)
    dtype = options.dtype_of(spec.dtype)
    b, hq, hk, L = 3, 32, 8, 3000
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(b, L, hk, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(b, L, hk, d, device="cuda", dtype=dtype, generator=gen)
    lens = torch.tensor([L, L // 3, 1], dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(d)
    page = 64
    per = -(-L // page)
    table = torch.randperm(b * per, device="cuda", generator=gen).to(torch.int32).view(b, per)
    kp = torch.zeros(b * per, page, hk, d, device="cuda", dtype=dtype)
    vp = torch.zeros_like(kp)
    for i in range(b):
        for j in range(per):
            rows = slice(j * page, min(L, (j + 1) * page))
            n = rows.stop - rows.start
            kp[table[i, j], :n], vp[table[i, j], :n] = k[i, rows], v[i, rows]
    for i in range(b):
        n = int(lens[i])
        qi, ki, vi = (t[i:i + 1, :n].transpose(1, 2) for t in (q, k, v))
        ref = _reference(qi, ki, vi, True, scale)
        tol = _tolerance(qi, ki, vi, True, scale, ref)
        for ns in dict.fromkeys((None, 1, 7, splits)):
            for paged in (False, True):
                args = (kp, vp, lens, table) if paged else (k, v, lens)
                out = api.decode(q, *args, num_splits=ns, spec=spec)[i:i + 1].transpose(1, 2).float()
                err = (out - ref).abs().max().item()
                if not err <= tol:
                    return (f"sequence {i} ({n} keys), {'paged' if paged else 'contiguous'}, num_splits={ns}: "
                            f"max error {err:.3e} > {tol:.3e}")
    return None


# ------------------------------------------------------------------ the suite


def _fits_fwd(spec, d, causal, dtype) -> str | None:
    if spec.causal != causal:
        return f"{'causal' if spec.causal else 'non-causal'} kernel, {'causal' if causal else 'non-causal'} shape"
    if spec.head_dim < d:
        return f"head-dim tile {spec.head_dim} < d {d}"
    if spec.dtype != dtype:
        return f"{spec.dtype} kernel"
    return None


def _splits_for(word, spec, b, hq, hk, dev) -> int | None:
    """num_splits of a decode candidate's split word (None: the heuristic)."""
    if word in (None, "h"):
        return None
    if word.isdigit():
        return int(word)
    dk = decode_family
    groups = b * hk * -(-(hq // hk) // dk.ROWS)  # CTAs of one split: batch x KV heads x m-blocks
    if word.startswith("c"):
        return max(1, int(word[1:]) // groups)
    occ = dk.ctas_per_sm(spec.smem_bytes(), spec.warps * 32, build(spec).report.registers or 255, dev.smem_per_sm)
    return max(1, dev.sms * occ // groups)


def _default_decode_spec(dev, settings, b, hq, hk, L):
    """The spec flashgen.decode picks for the shape (as the torch layer plans it), for 'default@S' and
    'slots'."""
    dk = decode_family
    tile = smallest_tile(settings["d"], dk.DECODE_HEAD_DIMS)
    m_blocks = -(-(hq // hk) // dk.ROWS)
    key = ProblemKey(dk.SPLIT.kind, dev.arch, settings["dtype"], tile, True, bucket_of(L))
    return dispatch.select(key, dev.gpu, dev.smem_budget, verify=True,
                           regime=dk.decode_regime(b * hk * m_blocks, dev.sms))


def _geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def _check_all(settings, progress) -> dict:
    """{label: "ok" | why} of every named candidate (each (d, causal) it applies to for the forward)."""
    checked = {}
    for label, c in settings["cands"].items():
        spec = c["spec"]
        if spec is None:
            continue
        try:
            if settings["problem"] == "fwd":
                why = None
                for d, causal in dict.fromkeys((s[3], bool(s[4])) for s in settings["shapes"]):
                    if _fits_fwd(spec, d, causal, settings["dtype"]) is None:
                        why = why or check_fwd(spec, d, causal)
            else:
                split = c["split"]
                why = check_decode(spec, settings["d"], int(split) if split and split.isdigit() else None)
        except Exception as exc:  # noqa: BLE001 -- a refused or failing kernel is reported, not timed
            why = error_text(exc)
        checked[label] = why or "ok"
        progress(f"checked {label} {spec.name}: {checked[label]}")
    return checked


def _fwd_rows(settings, dev, usable, progress, checkpoint) -> list:
    import torch

    from .. import api

    dtype = options.dtype_of(settings["dtype"])
    rows = []
    for i, (b, h, n, d, c) in enumerate(settings["shapes"]):
        causal = bool(c)
        gen = torch.Generator(device="cuda").manual_seed(100 + i)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
        f = flops(b, h, n, n, d, causal)
        makers, used = {}, {}
        for label in usable:
            spec = settings["cands"][label]["spec"]

            def make(spec=spec, label=label):
                if spec is not None:
                    why = _fits_fwd(spec, d, causal, settings["dtype"])
                    if why:
                        raise Skipped(why)
                else:
                    used[label] = pick(dev, settings["dtype"], d, causal, n).name
                return lambda: api.attention(q, k, v, causal=causal, spec=spec)
            makers[label] = make
        makers["sdpa_cudnn"] = lambda: baselines.sdpa("sdpa_cudnn", q, k, v, causal)
        cells = with_tflops(time_cell(makers, settings["rounds"], measure_ms(settings["budget"])), f)
        for label in usable:
            spec = settings["cands"][label]["spec"]
            cells[label]["spec"] = spec.name if spec is not None else used.get(label)
        row = {"batch": b, "heads": h, "seqlen": n, "head_dim": d, "causal": causal, "flops": f,
               "rounds": settings["rounds"], "results": cells}
        add_ratios(row, "tflops", [(f"{label}/cudnn", label, "sdpa_cudnn") for label in usable])
        rows.append(row)
        progress(f"b={b} h={h} n={n} d={d} causal={causal}: cudnn {cells['sdpa_cudnn'].get('tflops', float('nan')):.0f}"
                 + "".join(f"  {lab} {cells[lab].get('tflops', float('nan')):.0f}"
                           f" ({row.get('ratios', {}).get(f'{lab}/cudnn', float('nan')):.3f}x)" for lab in usable))
        del q, k, v
        free()
        if checkpoint is not None:
            checkpoint(rows)
    return rows


def _decode_rows(settings, dev, usable, progress, checkpoint) -> list:
    dk = decode_family
    dtype = options.dtype_of(settings["dtype"])
    rows = []
    shapes = sorted(settings["shapes"], key=lambda s: kv_bytes(s[0], s[2], s[3], 1))
    for i, (b, hq, hk, L) in enumerate(shapes):
        case = Case(b, hq, hk, L, settings["d"], dtype, seed=4000 + i)
        makers = {}
        for label in usable:
            c = settings["cands"][label]

            def make(c=c):
                spec = c["spec"]
                splits = None
                if c["split"] not in (None, "h"):
                    base = spec if spec is not None else _default_decode_spec(dev, settings, b, hq, hk, L)
                    splits = _splits_for(c["split"], base, b, hq, hk, dev)
                return case.flashgen(spec=spec, num_splits=splits)
            makers[label] = make
        makers["sdpa_cudnn"] = lambda: case.sdpa("sdpa_cudnn")
        cells = timed(makers, settings, case.copies, case.nbytes)
        m_blocks = -(-(hq // hk) // dk.ROWS)
        row = {**case.row(), "regime": dk.decode_regime(b * hk * m_blocks, dev.sms), "rounds": settings["rounds"],
               "reps": settings["reps"], "results": cells}
        add_ratios(row, "tbps", [(f"{label}/cudnn", label, "sdpa_cudnn") for label in usable])
        rows.append(row)
        progress(f"b={b} hq={hq} hk={hk} L={L} [{row['regime']}]: "
                 f"cudnn {cells['sdpa_cudnn'].get('tbps', float('nan')):.3f}"
                 + "".join(f"  {lab} {cells[lab].get('tbps', float('nan')):.3f}"
                           f" ({row.get('ratios', {}).get(f'{lab}/cudnn', float('nan')):.3f}x, "
                           f"{cells[lab].get('splits', '?')} splits)" for lab in usable))
        del case, makers
        free()
        if checkpoint is not None:
            checkpoint(rows)
    return rows


def _notes(settings, rows, usable, checked) -> list:
    out = [f"{label} = {c['text']}" + (f" (check: {checked[label]})" if label in checked else "")
           for label, c in settings["cands"].items()]
    groups = [("all", rows)]
    if settings["problem"] == "decode":
        groups = [(r, [row for row in rows if row.get("regime") == r]) for r in decode_family.REGIMES] + groups
    out.append("x cuDNN per group (geomean / min):")
    for name, mine in groups:
        if not mine:
            continue
        parts = []
        for label in usable:
            xs = [r["ratios"][f"{label}/cudnn"] for r in mine if f"{label}/cudnn" in r.get("ratios", {})]
            if xs:
                parts.append(f"{label} {_geomean(xs):.3f}/{min(xs):.3f}")
        out.append(f"  {name:<5} ({len(mine)} shapes) " + "  ".join(parts))
    return out


def run(args, progress) -> dict:
    import torch

    from ..api.device import Device

    settings = parse(args)
    require_cuda("ab")
    dev = Device.of(torch.cuda.current_device())
    meta_info = meta()
    prebuild([c["spec"] for c in settings["cands"].values()], progress)
    checked = _check_all(settings, progress) if settings["check"] else {}
    usable = [label for label in settings["cands"] if checked.get(label, "ok") == "ok"]
    checkpoint = getattr(args, "checkpoint", None)
    save = (lambda rows: checkpoint(_result(settings, meta_info, rows, usable, checked))) if checkpoint else None
    rows = (_fwd_rows if settings["problem"] == "fwd" else _decode_rows)(settings, dev, usable, progress, save)
    return _result(settings, meta_info, rows, usable, checked)


def _result(settings, meta_info, rows, usable, checked) -> dict:
    fwd = settings["problem"] == "fwd"
    plain = {**settings, "cands": {label: c["text"] for label, c in settings["cands"].items()}}
    return {"suite": "ab", "meta": meta_info, "metric": "tflops" if fwd else "tbps", "precision": 1 if fwd else 3,
            "x": "seqlen" if fwd else "L",
            "panels": ["batch", "heads", "head_dim", "causal"] if fwd else ["batch", "heads_q", "heads_kv"],
            "convention": (f"{settings['problem']}, {settings['dtype']}, median of {settings['rounds']} interleaved "
                           "rounds; <label>/cudnn: the candidate over cuDNN (above 1: faster)"),
            "settings": plain, "candidates": plain["cands"], "checked": checked,
            "impls": [*usable, "sdpa_cudnn"], "ratios": [f"{label}/cudnn" for label in usable], "rows": rows,
            "notes": _notes(settings, rows, usable, checked)}


register(Suite("ab", "candidate kernels (full names or 'default') side by side on given shapes, cuDNN as the "
                     "anchor, interleaved rounds (forward or decode)", add_args, run))
