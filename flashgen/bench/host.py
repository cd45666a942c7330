"""The ``host`` suite: per-call host time of ``flashgen.attention`` and ``flashgen.decode`` with cached plans.

Each call is timed in bursts of ``--calls`` launches without a sync (the GPU work per call is a few
µs on tiny inputs, and a burst stays well under the launch queue's depth, so the host is what is
measured), best of ``--rounds`` bursts (``flashgen.bench.timing.host_us``), after ``--warmup``
untimed calls (steady state: right after large frees the first case measured once read 21 µs where
it reads 14-16 µs in steady state). Rows (``entry``, ``call``):

- ``attention``: the default path (dispatch's pick), each forward family forced (``spec=``), and
  SDPA's flash backend on the same inputs for scale;
- ``decode``: split, one split, paged, with the value checks (a device sync), SDPA flash (GQA);
- ``training``: a forward with q, k, v requiring grad and its ``torch.autograd.grad`` (``step``), each
  half alone (``forward``; ``backward``, the graph retained), the same step through the registered custom
  op (``step, op``: what eager calls ran before ``api.autograd._Eager``), SDPA flash and cuDNN's step;
- ``decode parts`` (unless ``--no-parts``): an unsplit decode call taken apart -- the output
  allocation, the parameter block copy, the pointer reads, the stream/device and capture queries,
  the launch alone -- next to the whole call and a bare ``torch.empty`` as the host's speed unit;
  ``rest`` is the whole call less the parts (signature, plan lookup, pointer stores). The parts use
  the plan ``flashgen.testing.plans("decode")`` holds (its ``params()``, ``kernel.launch``, ``grid``):
  if the plan no longer has one of them, the breakdown is one row with the error. (The split call
  also fetches its workspace, a private helper of the torch layer: not taken apart here.)

``--profile N`` adds the top N functions of a cProfile of 2000 decode calls to the notes.
The host speed varies ~1.7x between machines: compare rows of one run.
"""
from __future__ import annotations

from .. import families, testing
from . import baselines, options
from .decode import host_inputs, host_rows
from .fwd import pick
from .registry import Suite, register
from .timing import error_text, host_row, meta, require_cuda

ENTRIES = ("attention", "decode", "training")


def add_args(p) -> None:
    p.add_argument("--entries", default=",".join(ENTRIES), help=f"entry points (default {','.join(ENTRIES)})")
    p.add_argument("--calls", type=int, default=200, help="calls per burst (default 200)")
    p.add_argument("--rounds", type=int, default=20, help="bursts; the best counts (default 20)")
    p.add_argument("--warmup", type=int, default=1000, help="untimed calls before each row's bursts (default 1000)")
    p.add_argument("--no-parts", action="store_true", help="leave out the decode call's part-by-part breakdown")
    p.add_argument("--profile", type=int, default=0, help="the top N functions of a cProfile of decode calls")


def parse(args) -> dict:
    options.positive(args.calls, "calls", integer=True)
    options.positive(args.rounds, "rounds", integer=True)
    if args.warmup < 0 or args.profile < 0:
        raise ValueError("--warmup and --profile must not be negative")
    return {"entries": options.names(args.entries, ENTRIES, "entries"), "calls": int(args.calls),
            "rounds": int(args.rounds), "warmup": int(args.warmup), "parts": not args.no_parts,
            "profile": int(args.profile)}


def attention_rows(calls=200, rounds=20, warmup=1000, progress=print) -> list:
    """The forward: default path, each forward family forced, SDPA flash (1 x 2 x 128 x 64, bf16)."""
    import torch

    from .. import api

    from ..api.device import Device

    dev = Device.of(torch.cuda.current_device())
    q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    rows = []
    try:
        default = pick(dev, "bf16", 64, False, 128).name
    except Exception:  # noqa: BLE001
        default = "?"
    rows.append(host_row("attention", "default", lambda: api.attention(q, q, q), calls, rounds, warmup,
                         spec=default))
    for fam in families.serving("fwd", dev.arch):
        try:
            spec = pick(dev, "bf16", 64, False, 128, family=fam)
        except Exception as exc:  # noqa: BLE001
            rows.append({"entry": "attention", "call": fam, "spec": "",
                         "results": {"host": {"error": error_text(exc)}}})
            continue
        rows.append(host_row("attention", fam, lambda s=spec: api.attention(q, q, q, spec=s), calls, rounds,
                             warmup, spec=spec.name))
    rows.append(host_row("attention", "sdpa_flash", baselines.sdpa("sdpa_flash", q, q, q), calls, rounds, warmup,
                         spec=""))
    for r in rows:
        progress(f"host attention {r['call']}: {r['results']['host']}")
    return rows


def training_rows(calls=200, rounds=20, warmup=1000, progress=print) -> list:
    """A training step's host time (1 x 2 x 128 x 64, bf16, causal): flashgen's eager step, its halves, the
    step through the registered op, SDPA flash and cuDNN."""
    import torch

    from .. import api

    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)

    def step(attend):
        return lambda: torch.autograd.grad(attend(), (q, k, v), dout)

    def through_op():
        return torch.ops.flashgen.attn_fwd(q, k, v, True, 0.125, "bhsd", False)[0]

    saved = api.attention(q, k, v, causal=True)
    calls_of = {
        "step": step(lambda: api.attention(q, k, v, causal=True)),
        "forward": lambda: api.attention(q, k, v, causal=True),
        "backward": lambda: torch.autograd.grad(saved, (q, k, v), dout, retain_graph=True),
        "step, op": step(through_op),
    }
    rows = [host_row("training", name, fn, calls, rounds, warmup, spec="") for name, fn in calls_of.items()]
    for impl in ("sdpa_flash", "sdpa_cudnn"):
        rows.append(host_row("training", f"step, {impl}", step(baselines.sdpa(impl, q, k, v, causal=True)), calls,
                             rounds, warmup, spec=""))
    for r in rows:
        progress(f"host training {r['call']}: {r['results']['host']}")
    return rows


def part_rows(calls=200, rounds=20, progress=print) -> list:
    """An unsplit decode call taken apart (cached plan and kernel): each part timed like the whole call."""
    import torch

    from .. import api
    from flashgen.api import device as api_device

    q, k, lens, _, _ = host_inputs()
    whole = lambda: api.decode(q, k, k, lens, num_splits=1, check_values=False)  # noqa: E731
    plans = testing.plans("decode")
    plans.clear()
    whole()
    plan = next(p for p in plans.values() if getattr(p, "kernel", None) is not None)
    index = q.device.index or 0
    stream = api_device.current_stream(index)
    out0 = q.new_empty(q.shape)
    params = plan.params()
    params.q, params.k, params.v, params.o = q.data_ptr(), k.data_ptr(), k.data_ptr(), out0.data_ptr()
    params.seqlens, params.lse = lens.data_ptr(), 0
    parts = {
        "noop": lambda: None,
        "torch_empty": lambda: torch.empty(1, device=q.device),
        "output": lambda: q.new_empty(q.shape),
        "params": plan.params,
        "pointers": lambda: (q.data_ptr(), k.data_ptr(), k.data_ptr(), lens.data_ptr()),
        "stream_device": lambda: (api_device.current_device(), api_device.current_stream(index)),
        "capturing": api_device.is_capturing,
        "launch": lambda: plan.kernel.launch(plan.grid, params, stream),
        "decode": whole,
    }
    rows = [host_row("decode parts", name, fn, calls, rounds, 10,
                     spec=plan.spec.name if name == "decode" else "") for name, fn in parts.items()]
    us = {r["call"]: r["results"]["host"].get("us") for r in rows}
    counted = ("output", "params", "pointers", "stream_device", "capturing", "launch")
    if all(us.get(n) is not None for n in counted + ("decode",)):
        rows.append({"entry": "decode parts", "call": "rest", "spec": "signature, plan lookup, pointer stores",
                     "results": {"host": {"us": us["decode"] - sum(us[n] for n in counted)}}})
    for r in rows:
        progress(f"host part {r['call']}: {r['results']['host']}")
    return rows


def profile_notes(top: int) -> list:
    """The top ``top`` functions by own time of 2000 cached decode calls (cProfile)."""
    import cProfile
    import io
    import pstats

    import torch

    from .. import api

    q, k, lens, _, _ = host_inputs()
    api.decode(q, k, k, lens, check_values=False)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        api.decode(q, k, k, lens, check_values=False)
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return ["cProfile of 2000 decode calls (own time):"] + [ln for ln in buf.getvalue().splitlines() if ln.strip()]


def run(args, progress) -> dict:
    settings = parse(args)
    require_cuda("host")
    result_rows = []
    common = {"calls": settings["calls"], "rounds": settings["rounds"], "progress": progress}
    if "attention" in settings["entries"]:
        result_rows += attention_rows(warmup=settings["warmup"], **common)
    if "training" in settings["entries"]:
        result_rows += training_rows(warmup=settings["warmup"], **common)
    if "decode" in settings["entries"]:
        result_rows += host_rows(warmup=settings["warmup"], **common)
        if settings["parts"]:
            try:
                result_rows += part_rows(**common)
            except Exception as exc:  # noqa: BLE001 -- the parts use the plan's attributes
                result_rows.append({"entry": "decode parts", "call": "setup", "spec": "",
                                    "results": {"host": {"error": error_text(exc)}}})
    result = {"suite": "host", "meta": meta(), "metric": "us", "precision": 2, "x": "call", "panels": ["entry"],
              "fields": ["spec"], "impls": ["host"], "settings": settings, "rows": result_rows,
              "convention": f"host µs per call, cached plan: bursts of {settings['calls']} calls without a sync, "
                            f"best of {settings['rounds']} (flashgen.bench.timing.host_us)"}
    if settings["profile"] and "decode" in settings["entries"]:
        result["notes"] = profile_notes(settings["profile"])
    return result


register(Suite("host", "per-call host time of flashgen.attention and flashgen.decode (cached plans) and of a "
                       "training step, next to SDPA; a decode call part by part", add_args, run))
