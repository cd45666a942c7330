"""``flashgen tune``: from the command line to a YAML table.

1. the GPU: ``--gpu`` names a profile; measured tuning needs that very GPU in
   the machine (another one would measure the wrong chip). Without a GPU, or
   with ``--model``, candidates are ranked by the cost model instead;
2. the keys (kind x dtype x head-dim tile x causal x seqlen bucket: ``--kind
   fwd`` the forward, ``--kind bwd`` the backward's main kernel, see
   ``space``) and each key's feasible candidates, all compiled up front in
   parallel (the disk cache serves the trials); measured runs log an estimate
   of their time first (``estimate_seconds``);
3. one study per key (``study``), in this process or in ``--workers N``
   processes sharing one storage, one per visible GPU;
4. the winners to YAML (``store``), merged into the existing file, and with
   ``--report`` a JSON of every trial.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

from .. import dispatch, families, gpus, mods, settings, tables, variants
from ..codegen import build
from ..errors import CompileError, FlashgenError
from ..problem import BUCKETS
from ..spec import DTYPES, KernelSpec
from .. import shapes as record_file
from . import space, store, study, validation
from .objective import MOD_FUNCTIONS, MeasuredObjective, ModelObjective, timing_calls

DEFAULT_TRIALS = 100


def _build_one(record):
    """Worker-process side of the parallel precompile: (name, problems or error)."""
    spec = KernelSpec.from_dict(record)
    try:
        return spec.name, build(spec).report.problems()
    except CompileError as exc:
        return spec.name, [f"compile error: {str(exc).splitlines()[0]}"]


def precompile(specs, jobs: int, log=None) -> dict:
    """Compile every spec into the disk cache, ``jobs`` processes at a time; name -> problems."""
    import multiprocessing

    unique = list(dict.fromkeys(specs))
    # User mods' kernels render from this process's traced graphs: compiled here, not in the spawned workers.
    here, unique = [s for s in unique if getattr(s, "mod", 0)], [s for s in unique if not getattr(s, "mod", 0)]
    if here:
        jobs = 1
        unique = here + unique
    t0 = time.monotonic()
    tty = log is not None and sys.stderr.isatty()
    out = {}

    def note(done):
        if tty:
            print(f"\rcompiling {done}/{len(unique)} kernels ({time.monotonic() - t0:.0f} s)", end="",
                  file=sys.stderr, flush=True)

    if jobs <= 1 or len(unique) < 2:
        for i, s in enumerate(unique, 1):
            name, problems = _build_one(s.to_dict())
            out[name] = problems
            note(i)
    else:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for i, (name, problems) in enumerate(pool.map(_build_one, [s.to_dict() for s in unique], chunksize=2), 1):
                out[name] = problems
                note(i)
    if tty:
        print(file=sys.stderr)
    if log:
        bad = sum(1 for p in out.values() if p)
        log(f"compiled {len(unique)} kernels in {time.monotonic() - t0:.1f} s ({jobs} jobs); "
            f"{bad} refused by their ptxas report")
    return out


def gpu_mode(profile, want_model: bool) -> tuple[str, str]:
    """('measured' | 'model', why). Measured tuning needs the GPU it names: without one, or with another,
    it refuses (``--model`` is the explicit way to rank without measuring: the table then says
    ``source: model``, and its entries never shadow measured ones)."""
    if want_model:
        return "model", "--model"
    try:
        import torch

        have_gpu = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        have_gpu = False
    if not have_gpu:
        raise FlashgenError(f"measured tuning for {profile.name} needs that GPU, and this machine has no CUDA GPU: "
                            "add --model to rank candidates by the cost model instead")
    name = torch.cuda.get_device_name(0)
    if not name.startswith(profile.device_name):
        raise FlashgenError(f"the GPU here is {name!r}, not {profile.name} ({profile.device_name}): measured "
                            f"tuning would time the wrong chip. Run on a {profile.name}, or add --model to rank "
                            "candidates by the cost model without measuring")
    return "measured", name


def _csv(text, conv, what):
    try:
        values = [conv(x.strip()) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise FlashgenError(f"--{what}: expected a comma-separated list, got {text!r}") from None
    if not values:
        raise FlashgenError(f"--{what}: empty list")
    return values


def parse_scope(args):
    """(profile, keys, families) from the command line, every value checked.

    ``--kind fwd`` (the default) searches every forward family the GPU runs
    (fwd_v2; and fwd_sm90 on sm_90a); ``--kind fwd_v2`` or ``fwd_sm90`` is the
    same "fwd" problem restricted to that family (``families``; None: no restriction).
    ``--kind bwd`` tunes the backward's main kernel per head dim (``space.problem_keys``);
    ``bwd_dkdv``, ``bwd_dkdv_nodq`` or ``bwd_dq`` that key kind.
    """
    profile = gpus.get(args.gpu)
    if args.smem is not None and not 0 < args.smem <= profile.smem_per_block:
        raise FlashgenError(f"--smem {args.smem}: a budget from 1 to {profile.name}'s {profile.smem_per_block} B "
                            "(smaller simulates a smaller GPU)")
    try:
        profile = gpus.with_smem(profile, args.smem)
    except ValueError as exc:
        raise FlashgenError(f"--smem: {exc}") from None
    for name, value in (("trials", args.trials), ("workers", args.workers), ("jobs", args.jobs)):
        if value < 1:
            raise FlashgenError(f"--{name} must be at least 1, got {value}")
    if args.seed < 0:
        raise FlashgenError(f"--seed must be a non-negative integer, got {args.seed}")
    if args.time_budget is not None and not args.time_budget > 0:
        raise FlashgenError(f"--time-budget must be a positive number of seconds, got {args.time_budget}")
    if not 0 < args.stale_after < float("inf"):
        raise FlashgenError(f"--stale-after must be a positive number of seconds, got {args.stale_after}")
    validate = getattr(args, "validate_model", False)
    if validate and args.model:
        raise FlashgenError("--validate-model measures the cost model's picks against the GPU: not with --model")
    if validate and args.out is not None and os.path.lexists(args.out) and not os.path.isdir(args.out):
        raise FlashgenError(f"--out {args.out}: with --validate-model, a folder for the report (not a table)")
    if not args.worker_only and not validate:  # where the winners go: checked now, not after the search
        tables.check_writable(args.out or tables.default_path(profile.name), profile.name)
    if getattr(args, "from_file", None) is not None:
        given = [f"--{n}" for n in ("d", "seqlens", "variant", "kind", "dtype", "causal")
                 if getattr(args, n, None) is not None]
        if given:
            raise FlashgenError(f"--from tunes the keys the shapes file holds: {', '.join(given)} do not apply")
        keys, _, _ = recorded_keys(args.from_file, profile)
        return profile, keys, None
    args.kind = args.kind or "fwd"
    args.dtype = args.dtype or "bf16"
    args.causal = args.causal or "both"
    if args.d is None:
        raise FlashgenError("--d is required (head dims, e.g. --d 64,128), or --from a recorded shapes file")
    known = space.tune_kinds()
    if args.kind not in known:
        raise FlashgenError(f"--kind {args.kind!r}: known kinds {list(known)} (the other kernels are not "
                            "tuned: their default rule serves)")
    only = None if args.kind == "bwd" or space.problem_of(args.kind) == args.kind else (args.kind,)
    if args.kind != "bwd" and not (families.serving(args.kind, profile.arch) if only is None
                                   else families.family(args.kind).runs_on(profile.arch)):
        raise FlashgenError(f"--kind {args.kind}: no kernel family serves it on {profile.name} ({profile.arch})")
    ds = _csv(args.d, int, "d")
    for d in ds:
        if d % 8 or not 8 <= d <= 256:
            raise FlashgenError(f"--d {d}: head dims are multiples of 8 from 8 to 256")
    dtypes = _csv(args.dtype, str, "dtype")
    for dt in dtypes:
        if dt not in DTYPES:
            raise FlashgenError(f"--dtype {dt!r}: one of {DTYPES}")
    causals = {"both": [False, True], "true": [True], "false": [False]}.get(str(args.causal).lower())
    if causals is None:
        raise FlashgenError(f"--causal {args.causal!r}: both, true or false")
    buckets = _csv(args.seqlens, int, "seqlens") if args.seqlens else list(BUCKETS)
    for n in buckets:
        if n not in BUCKETS:
            raise FlashgenError(f"--seqlens {n}: tuned lengths are the buckets {BUCKETS}")
    text = getattr(args, "variant", None)
    variant_list = [("" if v == "none" else v) for v in _csv(text, str, "variant")] if text else [""]
    if getattr(args, "score_mod", None) or getattr(args, "mask_mod", None):
        if text or args.kind not in ("fwd", "fwd_sm90", "fwd_v2") or str(args.causal).lower() == "true":
            raise FlashgenError("--score-mod/--mask-mod tune the forward's key of those mods (non-causal: a mod "
                                "expresses its own mask): not with --variant, --kind " + str(args.kind)
                                + " or --causal true")
        causals, variant_list = [False], [variants.mod_key(traced_mods(args))]
    for v in variant_list:
        if not variants.is_key_variant(v):
            raise FlashgenError(f"--variant {v!r}: 'none' or variant tokens joined by '_' (win, cap, alibi, sink, "
                                "in that order)")
        if v and (args.kind == "bwd" or space.is_backward(args.kind)):
            raise FlashgenError("--variant: the backward's variants are not tuned (they run on the plain "
                                "problem's tiles)")
        if v and only is None and args.kind != "fwd":
            raise FlashgenError(f"--variant: only the forward's keys take a variant, not --kind {args.kind}")
    return profile, space.problem_keys(args.kind, profile.arch, dtypes, ds, causals, buckets, variant_list), only


def traced_mods(args) -> int:
    """The token of ``--score-mod``/``--mask-mod`` (``mods.from_files``: traced and registered), their
    functions kept for the measured trials (``objective.MOD_FUNCTIONS``). A measured tune needs their captured
    tensors on the GPU (the file runs on the GPU host); ranking by the model (--model) takes any."""
    try:
        pair, functions = mods.from_files(args.score_mod, args.mask_mod, allow_cpu=args.model)
    except mods.ModError as exc:
        raise FlashgenError(str(exc)) from None
    token = mods.token_number(pair)
    MOD_FUNCTIONS[token] = functions
    return token


def recorded_keys(path, profile) -> tuple[list, dict, list]:
    """(keys, {key: shape}, skipped) of a shapes file (``flashgen.record``) for ``profile``: the keys the
    tuner tunes (the forward's, with its variants; the backward's plain keys), each at its most called
    shape (``shapes.by_key``); ``skipped``: one line per key it does not tune, and why. A file that cannot
    be read, or holds nothing to tune here, is a ``FlashgenError`` (``ConfigError``) of one line."""
    recorded = record_file.by_key(record_file.load(path))
    keys, found, skipped = [], {}, []
    for key, (shape, calls) in sorted(recorded.items(), key=lambda kv: -kv[1][1]):
        why = None
        if key.arch != profile.arch:
            why = f"recorded on {key.arch}, not {profile.name}'s {profile.arch}"
        elif key.kind not in space.TUNED_PROBLEMS:
            reasons = [families.family(k).untuned_reason for k in families.PROBLEMS.get(key.kind, ())]
            why = f"{key.kind} is not tuned: " + ("; ".join(r for r in reasons if r) or "the tuner has no space for it") \
                + "; its default rule serves"
        elif space.is_backward(key.kind) and key.variant:
            why = "the backward's variants are not tuned (they run on the plain problem's tiles)"
        if why:
            skipped.append(f"{space.key_name(key)} ({calls} calls): {why}")
            continue
        keys.append(key)
        found[key] = shape
    if not keys:
        raise FlashgenError(f"--from {path}: no key to tune for {profile.name} among its {len(recorded)} "
                            + ("; ".join(skipped[:3]) if skipped else "(the file has no entries)"))
    return keys, found, skipped


# For the time estimate only: the fraction of the datasheet tensor rate the searched kernels run
# at, on the slow side (H200 measurements: the forward's candidates 30-60 %, the backward's
# 11-25 %, docs/perf/tuner.md), and the seconds of a trial besides its timed calls.
ESTIMATE_RATE = {"fwd": 0.3, "bwd": 0.12}
ESTIMATE_TRIAL_S = 0.02
ESTIMATE_CHECK_S = 0.3      # one correctness check (once per spec)
ESTIMATE_COMPILE_S = 2.0    # one NVRTC compile, divided over --jobs
CONFIRM_CALLS = 3 * 4       # confirm_finalists: 3 interleaved rounds of the 3 fastest and the baseline


def estimate_seconds(keys, cands, trials: int, profile, jobs: int = 1, confirm: bool = True, shapes=None) -> dict:
    """A rough measured-mode duration: {'compile', 'check', 'time', 'total'} seconds.

    Each key's call takes ``space.key_flops`` at ``ESTIMATE_RATE`` of the profile's tensor rate;
    a timed trial makes ``objective.timing_calls`` calls of it; the evaluated trials per key are
    min(trials, candidates), plus the confirm step's re-timings; each distinct spec is checked once.
    An overestimate when most candidates run near the best; the ptxas refusals (never launched)
    make it one too.
    """
    timed = 0.0
    for key in keys:
        rate = profile.peak_flops * ESTIMATE_RATE["bwd" if space.is_backward(key.kind) else "fwd"]
        ms = space.key_flops(key, space.measured_shape(key, shapes) if shapes and key in shapes else None) / rate * 1e3
        per_trial = timing_calls(ms) * ms / 1e3 + ESTIMATE_TRIAL_S
        n = min(trials, len(cands[key]))
        timed += per_trial * (n + (CONFIRM_CALLS if confirm and n > 1 else 0))
    distinct = len({s for key in keys for s in cands[key][:trials]})
    out = {"compile": ESTIMATE_COMPILE_S * distinct / max(1, jobs), "check": ESTIMATE_CHECK_S * distinct,
           "time": timed}
    out["total"] = sum(out.values())
    return out


def _say(msg, quiet=False):
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


class Progress:
    """One status line per key (rewritten in place on a terminal)."""

    def __init__(self, total_keys: int, n_specs: dict, quiet: bool = False):
        self.total, self.n_specs, self.quiet = total_keys, n_specs, quiet
        self.index, self.tty = 0, sys.stderr.isatty()

    def __call__(self, key, st):
        if self.quiet or not self.tty:
            return
        trials = [t for t in st.get_trials(deepcopy=False) if study.evaluated(t)]
        ok = [t for t in trials if t.value is not None]
        best = min(ok, key=lambda t: t.value) if ok else None
        if key != getattr(self, "_key", None):
            self._key, self._t0 = key, time.monotonic()
        done, total = len(trials), self.n_specs[key]
        rate = (time.monotonic() - self._t0) / max(1, done)
        line = (f"[{self.index}/{self.total}] {space.key_name(key)} trial {done}/{total}"
                + (f" best {best.value:.3f} ms" if best else "") + f", about {rate * max(0, total - done):.0f} s left")
        print("\r" + line[:150].ljust(150), end="", file=sys.stderr, flush=True)


def run_keys(keys, cands, objective, args, storage, worker_index=0, progress=None, worker=None, leading=None):
    for i, key in enumerate(keys, 1):
        t0 = time.monotonic()
        if progress:
            progress.index = i
        study.run_study(key, objective, cands[key], n_trials=args.trials, time_budget=args.time_budget,
                        storage=storage, seed=args.seed + _seed_offset(args), worker_index=worker_index,
                        progress=progress, worker=worker, stale_after=args.stale_after,
                        leading=(leading or {}).get(key, 1))
        if progress and not progress.quiet:  # one line per key also where stderr is not a terminal
            r = study.collect(key, storage, cands[key])
            best = r.best
            print(("\r" if progress.tty else "") + f"[{i}/{len(keys)}] {space.key_name(key)}: {len(r.trials)} trials, "
                  f"{sum(r.failures().values())} failed; best "
                  + (f"{best.spec.name} {best.time_ms:.3f} ms" if best else "none")
                  + f" ({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)


def _visible_devices(n: int) -> list[str]:
    """The device each of ``n`` workers takes: the i-th of this process's CUDA_VISIBLE_DEVICES, or i."""
    mask = settings.visible_devices()
    return [mask[i] if i < len(mask) else str(i) for i in range(n)]


def _start_workers(argv, n, mode, storage_url) -> list:
    """Copies of this command for workers 1 .. n-1 on one shared storage (each seeing one GPU when
    measured), started now so that their interpreter, torch import and CUDA start overlap this process's
    compile step; each then waits at a gate (``--gate``: its stdin) until ``_run_workers`` opens it."""
    devices = _visible_devices(n)
    procs = []
    for i in range(1, n):
        env = settings.child_environment(**({"CUDA_VISIBLE_DEVICES": devices[i]} if mode == "measured" else {}))
        cmd = [sys.executable, "-m", "flashgen.cli", "tune", *argv, "--worker-index", str(i),
               "--storage", storage_url, "--workers", "1", "--worker-only", "--jobs", "1", "--gate"]
        procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE))
    return procs


def _run_workers(procs, n, mode, log, work):
    """Open the started workers' gate, run worker 0 here, ``work(label)``, on this process's first GPU
    (one interpreter, torch import and CUDA start fewer than n copies), and wait for all."""
    devices = _visible_devices(n)
    for p in procs:
        p.stdin.close()  # the gate: the worker reads its stdin to the end before its first trial
    try:
        work(f"{socket.gethostname()}:{os.getpid()}" + (f":gpu{devices[0]}" if mode == "measured" else ""))
    finally:
        codes = [p.wait() for p in procs]
    if any(codes):
        raise FlashgenError(f"tuning workers exited with {codes}")
    log(f"{n} workers finished")


def summarize(results, mode) -> list[dict]:
    rows = []
    for r in results:
        best, base = r.best, r.baseline_trial
        row = {"key": space.key_name(r.key), "mode": r.mode, "candidates": r.candidates, "trials": len(r.trials),
               "failures": r.failures(), "workers": r.workers(),
               "best": best.spec.name if best else None, "best_ms": best.time_ms if best else None,
               "baseline": r.baseline.name, "baseline_ms": base.time_ms if base and base.status == "ok" else None,
               "baseline_status": base.status if base else "not run",
               "baseline_reason": base.reason if base else ""}
        row["speedup"] = row["baseline_ms"] / row["best_ms"] if row["baseline_ms"] and row["best_ms"] else None
        if mode == "measured":
            row["rank_agreement"] = study.rank_agreement(r)
        row["trial_log"] = [{"n": t.number, "spec": t.spec.name, "status": t.status, "ms": t.time_ms,
                             "reason": t.reason, "worker": t.worker, **t.info} for t in r.trials]
        rows.append(row)
    return rows


def print_summary(rows, out=None, baseline="paper-rule"):
    out = out or sys.stdout
    print(f"{'key':42s} {'best':44s} {'ms':>8s} {'base ms':>8s} {'gain':>6s} {'ok/run':>7s}", file=out)
    for r in rows:
        ok = r["trials"] - sum(r["failures"].values())
        gain = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        best_ms = f"{r['best_ms']:.3f}" if r["best_ms"] else "-"
        base_ms = f"{r['baseline_ms']:.3f}" if r["baseline_ms"] else r["baseline_status"]
        print(f"{r['key']:42s} {str(r['best']):44s} {best_ms:>8s} {base_ms:>8s} {gain:>6s} "
              f"{ok:>3d}/{r['trials']:<3d}", file=out)
    gains = [r["speedup"] for r in rows if r["speedup"]]
    if gains:
        print(f"median gain over the {baseline} baseline: {statistics.median(gains):.2f}x "
              f"(min {min(gains):.2f}x, max {max(gains):.2f}x, {len(gains)} keys)", file=out)
    agree = [r["rank_agreement"] for r in rows if r.get("rank_agreement")]
    if agree:
        print(f"cost model vs measured: median Spearman {statistics.median(a['spearman'] for a in agree):.2f}; "
              f"model's pick runs at median {statistics.median(a['model_pick_slowdown'] for a in agree):.2f}x "
              "the measured best", file=out)


def require_optuna() -> None:
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise FlashgenError("tuning needs Optuna, which is not installed: pip install -e \".[tune]\" "
                            "(or pip install optuna)") from None


def open_storage(url):
    """The study storage of ``--storage`` (in memory for None), or a one-line FlashgenError."""
    try:
        return study.open_storage(url)
    except Exception as exc:  # noqa: BLE001 -- Optuna and SQLAlchemy raise many kinds for a bad URL
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FlashgenError(f"--storage {url!r}: cannot open it ({first[:200]}); use journal:PATH or an RDB URL "
                            "such as postgresql://user@host/db or sqlite:///path.db") from None


def tune(args, argv) -> int:
    t_start = time.monotonic()
    quiet = args.quiet
    log = lambda msg: _say(msg, quiet)  # noqa: E731
    require_optuna()
    profile, keys, only = parse_scope(args)
    shapes = {}
    if getattr(args, "from_file", None) is not None:
        keys, shapes, skipped = recorded_keys(args.from_file, profile)
        if not args.worker_only:
            log(f"--from {args.from_file}: {len(keys)} recorded keys to tune, each at its most called shape"
                + (f"; {len(skipped)} not tuned:" if skipped else ""))
            for line in skipped:  # also with --quiet: a recorded key left out is not progress output
                _say(f"  {line}" if not quiet else f"flashgen tune --from: not tuned: {line}")
    mode, why = gpu_mode(profile, args.model)
    if args.storage is not None:
        open_storage(args.storage)  # a bad URL is refused before anything is compiled
    kinds = list(dict.fromkeys(k.kind for k in keys))
    fams = list(dict.fromkeys(f for k in {k.kind: k for k in keys}.values() for f in space.families(k, only)))
    if not args.worker_only:
        log(f"tuning {len(keys)} keys ({', '.join(kinds)}) for {profile.name} ({profile.arch}, "
            f"{profile.smem_per_block} B shared memory per block), "
            f"{'measured on ' + why if mode == 'measured' else 'cost model (' + why + ')'}; "
            f"families {', '.join(fams) or '-'}")
    try:
        restrict = space.parse_restrict(args.space, fams)
    except ValueError as exc:
        raise FlashgenError(str(exc)) from None
    try:
        cands = {key: space.candidates(key, profile, only, restrict) for key in keys}
    except ValueError as exc:  # no tile of the kind fits this GPU's shared memory at some head dim
        raise FlashgenError(f"--d {args.d}: {exc}") from None
    if getattr(args, "validate_model", False):
        cands = {key: validation.sample(key, c, args.trials, args.seed) for key, c in cands.items()}
    current = {}
    if shapes:  # recorded keys: what runs now (a table's entry or the default rule) is a candidate too
        for key in keys:
            current[key] = dispatch.select(key, profile.name, profile.smem_per_block)
            if current[key] != cands[key][0] and not current[key].check(profile):  # second, queued first
                cands[key] = [cands[key][0], current[key], *(s for s in cands[key][1:] if s != current[key])]
    if not args.worker_only and mode == "measured":
        est = estimate_seconds(keys, cands, args.trials, profile, args.jobs, not args.no_confirm, shapes)
        log(f"estimate: ~{est['total']:.0f} s ({sum(min(args.trials, len(c)) for c in cands.values())} trials; "
            f"compile ~{est['compile']:.0f} s, checks ~{est['check']:.0f} s, timing ~{est['time']:.0f} s"
            + (f"; --time-budget caps each key at {args.time_budget:.0f} s" if args.time_budget else "") + ")")
    if args.workers > 1 and mode == "measured":
        import torch

        if torch.cuda.device_count() < args.workers:
            raise FlashgenError(f"--workers {args.workers}: only {torch.cuda.device_count()} GPU(s) visible")
    storage_url = args.storage
    tmpdir = None
    if args.workers > 1 and storage_url is None:
        tmpdir = tempfile.mkdtemp(prefix="flashgen-tune-")
        storage_url = f"journal:{os.path.join(tmpdir, 'studies.journal')}"
    try:
        return _tune(args, argv, t_start, log, profile, keys, only, mode, why, cands, storage_url, shapes, current)
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _seed_offset(args) -> int:
    """Independent workers on one shared study (``--storage`` given to each, no coordinator) must not
    propose the same points: each takes an offset from its process id. Coordinated workers
    (``--workers N``) have their worker index; a private study keeps the seed as given."""
    if args.storage is not None and args.workers == 1 and not args.worker_only:
        return 7907 * (os.getpid() % 65521)
    return 0


def _tune(args, argv, t_start, log, profile, keys, only, mode, why, cands, storage_url, shapes=None,
          current=None) -> int:
    quiet = args.quiet
    procs = []
    if args.workers > 1:  # started before the compile step, held at their gate until it is done
        passthrough = [a for a in argv if a not in ("--quiet",)]
        passthrough = _strip(passthrough, ("--workers", "--storage", "--jobs", "--out", "--report", "--worker-index"))
        procs = _start_workers(passthrough + ["--quiet"], args.workers, mode, storage_url)
    try:
        if not args.worker_only:
            # Exhaustive keys: every candidate runs, so compile them all now; TPE keys compile on demand.
            specs = [s for key in keys for s in (cands[key] if len(cands[key]) <= args.trials else cands[key][:1])]
            precompile(specs, args.jobs, log)
        objective = MeasuredObjective(profile) if mode == "measured" else ModelObjective(profile)
        objective.shapes = dict(shapes or {})
        storage = open_storage(storage_url)
    except BaseException:
        for p in procs:  # never let a gated worker run after this process failed
            p.kill()
        raise
    if args.gate:
        sys.stdin.read()  # until the coordinator has compiled (or closed us because it stopped)
    progress = Progress(len(keys), {k: min(args.trials, len(v)) for k, v in cands.items()}, quiet)
    leading = {key: 2 for key in (current or {}) if len(cands[key]) > 1 and cands[key][1] == current[key]}
    if args.workers > 1:
        _run_workers(procs, args.workers, mode, log,
                     lambda label: run_keys(keys, cands, objective, args, storage, 0, progress, label, leading))
    else:
        run_keys(keys, cands, objective, args, storage, args.worker_index, progress, leading=leading)
    if not quiet and sys.stderr.isatty():
        print(file=sys.stderr)
    if args.worker_only:
        return 0
    results = [study.collect(key, storage, cands[key]) for key in keys]
    if getattr(args, "validate_model", False):
        return validation.report(results, objective, args, profile, why, time.monotonic() - t_start, log)
    if mode == "measured" and not args.no_confirm:
        results = [study.confirm_finalists(r, objective, also=[(current or {}).get(r.key)]) for r in results]
    for r in results:  # recorded keys: the winner against what ran before
        now = next((t for t in r.ok() if t.spec == (current or {}).get(r.key)), None)
        if now is not None and r.best is not None:
            log(f"{space.key_name(r.key)} at {tuple(shapes[r.key])}: {r.best.spec.name} {r.best.time_ms:.3f} ms, "
                f"{now.time_ms / r.best.time_ms:.3f}x the current {now.spec.name} ({now.time_ms:.3f} ms)")
    rows = summarize(results, mode)
    new = tables.Table(meta=tables.make_meta(profile, mode, why if mode == "measured" else None))
    for r in results:
        if r.best is None:
            log(f"{space.key_name(r.key)}: no candidate passed ({r.failures()}); not written")
            continue
        new.entries[r.key] = store.entry_from_result(r, mode, (shapes or {}).get(r.key))
    path = args.out or tables.default_path(profile.name)
    tables.update(path, new)  # merged under a lock with what concurrent runs wrote meanwhile
    dispatch.clear()
    wall = time.monotonic() - t_start
    if args.report:
        report = {"meta": new.meta, "mode": mode, "gpu_profile": profile.name, "argv": argv, "wall_s": wall,
                  "keys": rows}
        os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
        with open(args.report, "w") as fh:
            json.dump(report, fh, indent=1, default=str)
    print_summary(rows, baseline=" / ".join(dict.fromkeys(space.baseline_label(k) for k in keys)) or "paper-rule")
    log(f"wrote {path} ({len(new.entries)} entries, source: {mode}) in {wall:.0f} s")
    return 0


def _strip(argv, options):
    """``argv`` without the given options and their values (both ``--x v`` and ``--x=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in options:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def add_arguments(p) -> None:
    p.add_argument("--gpu", required=True, help="GPU profile to tune for (a100, h100, h200, l4, rtx4090)")
    p.add_argument("--d", default=None, help="head dims, comma-separated (e.g. 64,128); required unless --from")
    p.add_argument("--from", dest="from_file", default=None, metavar="SHAPES",
                   help="tune the keys a shapes file recorded (flashgen.record / FLASHGEN_RECORD), each at its "
                        "most called shape, instead of --d/--seqlens/--kind/--dtype/--causal/--variant at the "
                        "benchmark shape (hidden 2048)")
    p.add_argument("--validate-model", action="store_true",
                   help="measure how well the cost model ranks: per key a seeded sample of --trials candidates "
                        "(the baseline first), every one checked and timed, then the model's pick re-timed with "
                        "the measured best; prints regret (its time / the best's) and Spearman rank correlation; "
                        "--out DIR gets validation.json and the measured winners as table.yaml (the user's "
                        "table is not touched)")
    p.add_argument("--dtype", default=None, help="fp16, bf16 or both comma-separated (default bf16)")
    p.add_argument("--causal", default=None, help="both (default), true or false")
    p.add_argument("--seqlens", default=None, help=f"seqlen buckets to tune (default all: {BUCKETS})")
    p.add_argument("--variant", default=None,
                   help="forward variants to tune, comma-separated: 'none' (plain) or tokens joined by '_' "
                        "(win, cap, alibi, sink, vl, fp8; e.g. none,win,cap,vl); a window is measured at 4096 keys "
                        "(a quarter of the length below 16k), a softcap at 50, packed rows (vl: attention_varlen) "
                        "at seeded random lengths from seqlen/8 to seqlen, FP8 inputs (fp8: sm_90a) quantized "
                        "per head (default: plain only)")
    p.add_argument("--score-mod", metavar="FILE.py:NAME", default=None,
                   help="tune the forward's key of this score_mod (the key is its traced pair's hash: "
                        "attention calls with the same mods take the winner); FILE is imported; measured, its "
                        "captured tensors must be on the GPU")
    p.add_argument("--mask-mod", metavar="FILE.py:NAME", default=None,
                   help="likewise a mask_mod (with --score-mod or alone)")
    p.add_argument("--kind", default=None, help="problem kind (default fwd: every forward family the GPU runs, "
                                                  "fwd_v2 and on sm_90a fwd_sm90); fwd_v2 or fwd_sm90 restricts "
                                                  "the forward to that family; bwd: the backward's main kernel "
                                                  "per head dim (bwd_dkdv where dQ is added by atomics), timing "
                                                  "the whole backward; bwd_dkdv, bwd_dkdv_nodq or bwd_dq: that "
                                                  "backward kernel")
    p.add_argument("--trials", type=int, default=DEFAULT_TRIALS,
                   help=f"evaluated trials per key (default {DEFAULT_TRIALS}; all candidates when fewer)")
    p.add_argument("--time-budget", type=float, default=None, help="seconds per key (default: no limit)")
    p.add_argument("--smem", type=int, default=None, help="shared-memory budget M per block in bytes "
                                                          "(default: the profile's; smaller simulates a smaller GPU)")
    p.add_argument("--model", action="store_true", help="rank by the cost model, no measuring (also without a GPU)")
    p.add_argument("--storage", default=None, help="Optuna storage shared by workers: journal:PATH, *.log or an "
                                                   "RDB URL (default: in memory)")
    p.add_argument("--stale-after", type=float, default=study.STALE_AFTER,
                   help="shared exhaustive studies: seconds another worker's trial may go without a heartbeat "
                        f"before it counts as dead and its candidate runs again (default {study.STALE_AFTER:.0f})")
    p.add_argument("--workers", type=int, default=1, help="worker processes, one per visible GPU (default 1)")
    p.add_argument("--out", default=None, help="YAML to write/merge (default $FLASHGEN_HOME/configs/<gpu>.yaml)")
    p.add_argument("--report", default=None, help="also write every trial as JSON here")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles (default: CPUs)")
    p.add_argument("--seed", type=int, default=0, help="TPE seed (default 0)")
    p.add_argument("--space", nargs="+", default=None, metavar="KNOB=V1,V2",
                   help="narrow the searched space on these knobs (e.g. early_k_release=false block_n=64,128); values "
                        "must be in the family's tune space")
    p.add_argument("--no-confirm", action="store_true",
                   help="measured mode: keep the screening times (default: re-time the 3 fastest and the "
                        "baseline, interleaved, before picking the winner)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--worker-index", type=int, default=0, help=argparse_suppress())
    p.add_argument("--worker-only", action="store_true", help=argparse_suppress())
    p.add_argument("--gate", action="store_true", help=argparse_suppress())


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS
