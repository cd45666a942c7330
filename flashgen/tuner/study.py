"""One Optuna study per problem key.

``run_study`` adds trials to the key's study; ``collect`` reads the finished
study back as a ``KeyResult``. Both work on any Optuna storage, so several
processes (on several GPUs or hosts) can share one study per key:

- **exhaustive** (the feasible set is no larger than the trial budget): trial
  number i evaluates candidate i. Optuna numbers the trials of a study
  uniquely across every process sharing it, so each candidate is taken by
  exactly one worker. A worker beats a counter on the trial it runs; a running
  trial whose counter stands still for ``stale_after`` seconds (its worker was
  killed) is failed by whichever worker notices first, and its candidate is
  queued again as a waiting trial (popping one is atomic too). A popped trial
  whose candidate another trial already holds (finished, or running since
  earlier) is dropped as a duplicate, so a rare double queueing never
  evaluates twice. A worker stops only when every candidate has a result, so
  every worker collects the same study.
- **TPE** (larger sets): a seeded ``TPESampler`` over the family's knobs
  (each worker offsets the seed, so workers do not propose the same points).
  When the candidates hold several families (``fwd`` on sm_90a: fwd_v2 and
  fwd_sm90) the space is conditional: a categorical ``family`` parameter,
  then that family's knobs named ``<family>.<knob>`` (``space.knob_choices``);
  the paper-rule baseline is enqueued first. A proposal that is not feasible
  is recorded as a ``constraint`` failure without compiling; a proposal equal
  to an earlier trial reuses that trial's result and is not evaluated again.

Every trial records the spec, the status and reason of a failure, the
objective's extra information (registers, modelled time) and the worker.
"""
from __future__ import annotations

import contextlib
import math
import os
import random
import socket
import threading
import time
from dataclasses import dataclass, field

from .. import settings
from ..spec import KernelSpec
from . import space
from .objective import Outcome

_MAX_PROPOSALS = 5  # TPE: stop after this many proposals per evaluated trial (a small space is exhausted)
STALE_AFTER = 120.0  # seconds a running trial's heartbeat may stand still before its worker counts as dead


def open_storage(url: str | None):
    """An Optuna storage: None -> in memory; ``journal:PATH`` or a ``*.log``/``*.journal``
    path -> a journal file (several processes may share it); anything else -> an RDB URL."""
    import optuna

    if url is None:
        return optuna.storages.InMemoryStorage()
    if not isinstance(url, str):
        return url  # already a storage object
    path = url[len("journal:"):] if url.startswith("journal:") else url
    if url.startswith("journal:") or url.endswith((".log", ".journal")):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(path))
    return optuna.storages.RDBStorage(url)


def worker_name() -> str:
    gpu = ",".join(settings.visible_devices())
    return f"{socket.gethostname()}:{os.getpid()}" + (f":gpu{gpu}" if gpu else "")


@dataclass
class TrialRecord:
    number: int
    spec: KernelSpec
    status: str
    time_ms: float | None
    reason: str = ""
    info: dict = field(default_factory=dict)
    worker: str = ""


@dataclass
class KeyResult:
    key: object
    candidates: int
    baseline: KernelSpec
    trials: list  # TrialRecord, one per evaluated spec (duplicates dropped), in trial order
    mode: str = "exhaustive"

    def ok(self) -> list:
        return sorted((t for t in self.trials if t.status == "ok"), key=lambda t: (t.time_ms, t.number))

    @property
    def best(self) -> TrialRecord | None:
        ok = self.ok()
        return ok[0] if ok else None

    def runners_up(self, n: int = 3) -> list:
        return self.ok()[1:1 + n]

    @property
    def baseline_trial(self) -> TrialRecord | None:
        return next((t for t in self.trials if t.spec == self.baseline), None)

    def failures(self) -> dict:
        counts: dict = {}
        for t in self.trials:
            if t.status != "ok":
                counts[t.status] = counts.get(t.status, 0) + 1
        return counts

    def workers(self) -> dict:
        counts: dict = {}
        for t in self.trials:
            counts[t.worker] = counts.get(t.worker, 0) + 1
        return counts


def _study(key, storage, sampler=None):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(study_name=space.key_name(key), storage=storage, direction="minimize",
                               sampler=sampler, load_if_exists=True)


def _record(trial, spec, outcome, worker):
    trial.set_user_attr("spec", spec.to_dict())
    trial.set_user_attr("status", outcome.status)
    trial.set_user_attr("reason", outcome.reason)
    trial.set_user_attr("info", outcome.info)
    trial.set_user_attr("worker", worker)


def _param_name(kind, knob, choices):
    return f"{kind}.{knob}" if len(choices) > 1 else knob


def _params(spec, choices) -> dict:
    """The TPE parameters of ``spec`` (for ``enqueue_trial``)."""
    out = {"family": spec.kind} if len(choices) > 1 else {}
    out.update({_param_name(spec.kind, n, choices): getattr(spec, n) for n in choices[spec.kind]})
    return out


def _suggest(key, trial, choices):
    """The spec a TPE trial proposes: a family (when there are several), then that family's knobs."""
    kinds = list(choices)
    kind = trial.suggest_categorical("family", kinds) if len(kinds) > 1 else kinds[0]
    knobs = {n: trial.suggest_categorical(_param_name(kind, n, choices), v) for n, v in choices[kind].items()}
    return space.make_spec(key, kind, **knobs)


def _tell(study, trial, spec, outcome, worker):
    import optuna

    _record(trial, spec, outcome, worker)
    if outcome.status == "ok":
        study.tell(trial, outcome.time_ms)
    else:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)


def run_study(key, objective, specs, *, n_trials: int, time_budget: float | None = None, storage=None,
              seed: int = 0, worker: str | None = None, worker_index: int = 0, progress=None,
              stale_after: float = STALE_AFTER, leading: int = 1):
    """Evaluate specs of ``key`` until the study holds ``n_trials`` evaluated trials, every
    candidate is done, or ``time_budget`` seconds pass. ``specs[0]`` is the baseline.

    ``objective(key, spec) -> Outcome`` never raises for a bad spec (its failures are
    outcomes); an exception escaping it is recorded as a ``launch_error`` and the run goes on.
    ``stale_after``: exhaustive studies, seconds after which another worker's running trial
    with a still heartbeat is failed and its candidate queued again. ``leading``: TPE studies, how many
    of the first specs are queued before the sampler proposes (the baseline; ``tune --from`` also the
    spec that runs now). Returns the storage (pass it to ``collect``).
    """
    import optuna

    storage = open_storage(storage)
    worker = worker or worker_name()
    exhaustive = len(specs) <= n_trials
    deadline = None if time_budget is None else time.monotonic() + time_budget

    def evaluate(spec):
        try:
            return objective(key, spec)
        except Exception as exc:  # noqa: BLE001 — a broken trial must not stop the run
            return Outcome("launch_error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")

    if exhaustive:
        _run_exhaustive(key, specs, storage, evaluate, worker, deadline, progress, stale_after)
        return storage
    sampler = optuna.samplers.TPESampler(seed=seed + 7919 * worker_index)
    study = _study(key, storage, sampler)
    study.set_user_attr("mode", "tpe")
    choices = space.knob_choices(key, specs)
    feasible = set(specs)
    if not study.get_trials(deepcopy=False):
        for spec in specs[:max(1, leading)]:  # the baseline is the first trial
            study.enqueue_trial(_params(spec, choices))
    proposals = 0
    rng = random.Random(seed + 7919 * worker_index)

    while deadline is None or time.monotonic() < deadline:
        trials = study.get_trials(deepcopy=False)
        done = {KernelSpec(**t.user_attrs["spec"]) for t in trials
                if "spec" in t.user_attrs and t.user_attrs.get("duplicate_of") is None}
        evaluated = sum(1 for t in trials if "spec" in t.user_attrs and t.user_attrs.get("duplicate_of") is None
                        and not t.user_attrs.get("static"))
        if evaluated >= min(n_trials, len(specs)) or proposals >= _MAX_PROPOSALS * n_trials:
            break
        proposals += 1
        trial = study.ask()
        spec = _suggest(key, trial, choices)
        if spec in done or spec not in feasible:
            # A wasted proposal: queue an untried candidate (seeded choice) for the next ask,
            # so a small or oddly shaped space is still covered within the budget.
            untried = [s for s in specs if s not in done and s != spec]
            if untried:
                pick = untried[rng.randrange(len(untried))]
                study.enqueue_trial(_params(pick, choices))
        if spec in done:  # the sampler proposed a spec already evaluated: reuse its result
            prior = next(t for t in trials if t.user_attrs.get("spec") == spec.to_dict()
                         and t.user_attrs.get("duplicate_of") is None)
            trial.set_user_attr("duplicate_of", prior.number)
            if prior.state == optuna.trial.TrialState.COMPLETE:
                study.tell(trial, prior.value)
            else:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            continue
        if spec not in feasible:
            reasons = "; ".join(spec.check(_profile_of(objective))) or "outside the feasible set"
            trial.set_user_attr("static", True)  # refused without compiling; not an evaluated trial
            _tell(study, trial, spec, Outcome("constraint", reason=f"statically infeasible: {reasons}"),
                  worker)
            continue
        _tell(study, trial, spec, evaluate(spec), worker)
        if progress is not None:
            progress(key, study)
    return storage


def _enqueue(study, candidates, retry_of=None) -> None:
    for c in candidates:
        attrs = {"candidate": c} if retry_of is None else {"candidate": c, "retry_of": retry_of}
        study.enqueue_trial({}, user_attrs=attrs)


@contextlib.contextmanager
def _heartbeat(trial, interval: float):
    """Beat a counter (user attribute ``beat``) on ``trial`` every ``interval`` s while the body runs."""
    stop = threading.Event()

    def beat():
        n = 0
        while not stop.wait(interval):
            n += 1
            try:
                trial.set_user_attr("beat", n)
            except Exception:  # noqa: BLE001 — finished meanwhile (failed as stale): nothing to beat
                return

    thread = threading.Thread(target=beat, name="flashgen-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _candidate(trial, n: int):
    """The candidate index a trial of an exhaustive study holds: a queued retry names it, a fresh
    trial numbered below ``n`` is that candidate, anything else (an idle ask) holds none."""
    c = trial.user_attrs.get("candidate")
    if c is None and trial.number < n and "retry_of" not in trial.user_attrs and not trial.user_attrs.get("idle"):
        return trial.number
    return c


def _run_exhaustive(key, specs, storage, evaluate, worker, deadline, progress, stale_after):
    """Every candidate of ``key`` once over all workers sharing ``storage`` (see the module notes).

    The fast path asks and evaluates without reading the study: fresh trial i is candidate i (the
    storages number a study's trials uniquely). Once an ask comes back past the last candidate,
    the worker reads the study each ``poll``: it stops when every candidate has a result, fails
    trials whose heartbeat stands still, queues again the candidates no trial holds (a stale one's,
    or one whose number a queued retry took), and asks again while something waits. A study where
    anything was queued checks every queued pop for a duplicate."""
    import optuna

    TS = optuna.trial.TrialState
    n = len(specs)
    study = _study(key, storage)
    study.set_user_attr("mode", "exhaustive")
    interval = max(0.05, stale_after / 4)
    poll = min(0.5, interval)
    study_id = storage.get_study_id_from_name(space.key_name(key))
    beats: dict = {}  # another worker's running trial -> (its beat, when this worker first saw that beat)

    def requeue(candidates, retry_of=None):
        if candidates:
            study.set_user_attr("requeued", True)  # before the trials exist: every later pop sees it
            _enqueue(study, candidates, retry_of)

    fast = True
    while deadline is None or time.monotonic() < deadline:
        if not fast:
            trials = study.get_trials(deepcopy=False)
            done = {_candidate(t, n) for t in trials if evaluated(t)}
            if len(done - {None}) >= n:
                break
            now = time.monotonic()
            for t in trials:
                if t.state != TS.RUNNING or _candidate(t, n) is None:
                    continue
                seen = beats.get(t.number)
                if seen is None or seen[0] != t.user_attrs.get("beat"):
                    beats[t.number] = (t.user_attrs.get("beat"), now)
                elif now - seen[1] >= stale_after:  # its worker stopped beating: killed, or its host lost
                    del beats[t.number]
                    try:
                        storage.set_trial_state_values(
                            storage.get_trial_id_from_study_id_trial_number(study_id, t.number), TS.FAIL)
                    except RuntimeError:  # finished meanwhile, or another worker failed it first
                        continue
                    if _candidate(t, n) not in done:
                        requeue([_candidate(t, n)], retry_of=t.number)
            live = study.get_trials(deepcopy=False, states=(TS.WAITING, TS.RUNNING))
            held = done | {_candidate(t, n) for t in live}
            if max((t.number for t in trials), default=-1) >= n - 1:  # every number below n was handed out
                requeue([c for c in range(n) if c not in held])
            if not any(t.state == TS.WAITING for t in live):
                time.sleep(poll)  # the rest runs on other workers: wait for their results (or their death)
                continue
        trial = study.ask()
        c = _candidate(trial, n)
        if c is None:  # past the last candidate, nothing queued: from now on, read the study first
            trial.set_user_attr("idle", True)
            study.tell(trial, state=TS.FAIL)
            fast = False
            continue
        if "retry_of" in trial.user_attrs or "candidate" in trial.user_attrs:
            # A queued candidate may be held twice: the earlier claim evaluates it.
            mine = study.get_trials(deepcopy=False)
            me = next(t for t in mine if t.number == trial.number)
            first = next((t for t in mine if t.number != trial.number and _candidate(t, n) == c
                          and t.user_attrs.get("duplicate_of") is None
                          and (evaluated(t) or (t.state == TS.RUNNING and
                                                (t.datetime_start, t.number) < (me.datetime_start, me.number)))),
                         None)
            if first is not None:
                trial.set_user_attr("duplicate_of", first.number)
                study.tell(trial, state=TS.FAIL)
                continue
        spec = specs[c]
        with _heartbeat(trial, interval):
            outcome = evaluate(spec)
        try:
            _tell(study, trial, spec, outcome, worker)
        except RuntimeError:  # failed as stale by another worker meanwhile: its retry stands instead
            pass
        if progress is not None:
            progress(key, study)


def _profile_of(objective):
    return getattr(objective, "profile", None) or _NoProfile()


class _NoProfile:
    name = "?"
    smem_per_block = math.inf
    regs_per_sm = 65536


def evaluated(trial) -> bool:
    """Whether a trial stands for an evaluated spec: complete, or failed with a recorded failure
    (a RUNNING trial of another worker has no result yet; a trial failed as stale after recording
    success never told its time), not a duplicate of an earlier one, not refused statically."""
    import optuna

    attrs = trial.user_attrs
    if "spec" not in attrs or attrs.get("duplicate_of") is not None or attrs.get("static"):
        return False
    if trial.state == optuna.trial.TrialState.COMPLETE:
        return True
    return trial.state == optuna.trial.TrialState.FAIL and attrs.get("status", "ok") != "ok"


def collect(key, storage, specs) -> KeyResult:
    """The finished study of ``key`` as a KeyResult (one record per evaluated spec)."""
    import optuna

    storage = open_storage(storage)
    study = optuna.load_study(study_name=space.key_name(key), storage=storage)
    records, seen = [], set()
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
    for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        attrs = t.user_attrs
        # A trial another worker is still running (or one it left RUNNING when it died) has no result:
        # its user attributes may already be set while its value is not.
        if "spec" not in attrs or attrs.get("duplicate_of") is not None or t.state not in finished:
            continue
        if t.state == optuna.trial.TrialState.FAIL and attrs.get("status", "ok") == "ok":
            continue  # failed as stale before its result was told: its candidate was queued again
        spec = KernelSpec(**attrs["spec"])  # not validated: infeasible proposals are recorded too
        if spec in seen:  # two workers raced on one TPE proposal: keep the first
            continue
        seen.add(spec)
        ok = t.state == optuna.trial.TrialState.COMPLETE and t.value is not None
        status = attrs.get("status", "ok")
        records.append(TrialRecord(t.number, spec, status, t.value if ok else None, attrs.get("reason", ""),
                                   attrs.get("info", {}), attrs.get("worker", "")))
    return KeyResult(key, len(specs), specs[0], records, study.user_attrs.get("mode", "exhaustive"))


def confirm_finalists(result: KeyResult, objective, top: int = 3, also=()) -> KeyResult:
    """Re-time the ``top`` fastest ok trials, the baseline and the ok trials of the specs in ``also``
    with ``objective.confirm``; their times become the confirmed ones (the screening time stays in
    ``info['screen_ms']``)."""
    confirm = getattr(objective, "confirm", None)
    ok = result.ok()
    if confirm is None or len(ok) < 2:
        return result
    finalists = ok[:top]
    for t in [result.baseline_trial, *(t for t in ok if t.spec in also)]:
        if t is not None and t.status == "ok" and t not in finalists:
            finalists.append(t)
    confirmed = confirm(result.key, [t.spec for t in finalists])
    for t in finalists:
        t.info = {**t.info, "screen_ms": t.time_ms}
        t.time_ms = confirmed[t.spec]
    return result


def rank_agreement(result: KeyResult) -> dict | None:
    """How well the modelled times rank the measured ones among a key's ok trials:
    Spearman's rho, and the measured time of the model's pick against the measured best."""
    ok = [t for t in result.ok() if "model_ms" in t.info]
    if len(ok) < 3:
        return None

    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        r = [0.0] * len(values)
        i = 0
        while i < len(order):  # average ranks over ties
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for m in range(i, j + 1):
                r[order[m]] = (i + j) / 2
            i = j + 1
        return r

    measured = ranks([t.time_ms for t in ok])
    modelled = ranks([t.info["model_ms"] for t in ok])
    n = len(ok)
    mean = (n - 1) / 2
    cov = sum((a - mean) * (b - mean) for a, b in zip(measured, modelled))
    var = math.sqrt(sum((a - mean) ** 2 for a in measured) * sum((b - mean) ** 2 for b in modelled))
    pick = min(ok, key=lambda t: t.info["model_ms"])
    return {"n": n, "spearman": cov / var if var else 0.0, "model_pick": pick.spec.name,
            "model_pick_ms": pick.time_ms, "best_ms": ok[0].time_ms,
            "model_pick_slowdown": pick.time_ms / ok[0].time_ms}
