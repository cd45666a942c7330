"""The first-use search behind ``FLASHGEN_AUTOTUNE`` / ``flashgen.autotune`` (``flashgen.api.autotune`` asks
it, through ``dispatch.first_use_search``, for a forward key no table has).

Within ``request.budget_s`` seconds, on the live GPU, at the call's own shape:

1. rank the key's feasible candidates (``space.candidates``) by the cost model, with the registers a
   candidate is expected to take before it is compiled (``expected_registers``), and keep the ``TOP``
   best whose estimates differ (the model cannot tell apart candidates it estimates alike: timing
   several of them spends the budget on what it cannot rank);
2. compile them in parallel for at most half the budget, re-rank those built with their ptxas registers;
3. run the default rule's spec, then those, each through the tuner's ``MeasuredObjective``: refused on
   its ptxas report, checked against the fp32 reference (the tuner's rule), timed at the call's shape;
   a candidate starts only if one as long as the longest so far would end within the budget (so only
   the default rule's own evaluation can overrun it);
4. re-time the fastest and the default rule in interleaved rounds when they fit in the budget, and keep
   the default unless another is faster;
5. store the winner in the user's table (``tables.update``: locked, atomic), with the default rule as its
   baseline, and log what was measured.

Returns the winner, or None when nothing passed (the default rule then serves).
"""
from __future__ import annotations

import time
from multiprocessing.pool import ThreadPool

from .. import dispatch, families, gpus, settings, tables
from ..codegen import build
from . import cost, space, store, study
from .objective import MeasuredObjective, Outcome

TOP = 4                # candidates measured besides the default rule
CONFIRM_ROUNDS = 3
COMPILE_THREADS = 8    # NVRTC releases the GIL


def expected_registers(spec) -> int:
    """Registers per thread ``spec`` is expected to take before it is compiled: what setmaxnreg gives a
    warp-specialized consumer, else its fp32 accumulators and 64 more, within the launch's share of
    the register file and 255."""
    fam = families.family(spec.kind)
    regs = getattr(fam, "regs", None)
    consumer = regs(spec)[1] if regs is not None else 0
    return consumer or min(255, 65536 // (spec.warps * 32) // 8 * 8, fam.acc_floats(spec) + 64)


def shortlist(key, shape, profile, default, top: int = TOP) -> list:
    """The ``top`` candidates of ``key`` the cost model ranks best at ``shape`` (distinct estimates, the
    default rule's spec left out: it is measured anyway)."""
    b, h, _, nq, _, _ = shape
    model_shape = (b, h, nq, key.head_dim)
    ranked = sorted(((cost.estimate(s, model_shape, profile, expected_registers(s)), i, s)
                     for i, s in enumerate(space.candidates(key, profile)) if s != default))
    out, seen = [], []
    for est, _, spec in ranked:
        if len(out) == top:
            break
        if any(abs(est - e) <= 1e-3 * e for e in seen):
            continue
        out.append(spec)
        seen.append(est)
    return out


def search(request, objective=None, clock=time.monotonic, compile_all=None, log=None) -> object:
    """The first-use search for ``request`` (``api.autotune.FirstUse``): see the module notes.
    ``objective`` (a ``MeasuredObjective``), ``clock``, ``compile_all(specs, timeout)`` (-> the specs built)
    and ``log`` are for tests."""
    t0 = clock()
    deadline = t0 + request.budget_s
    log = log or settings.logger().warning
    key, shape, default = request.key, tuple(request.shape), request.default
    profile = gpus.get(request.gpu)
    if objective is None:
        objective = MeasuredObjective(profile, device_index=request.device_index)
    objective.shapes = {**getattr(objective, "shapes", {}), key: shape}
    specs = [default, *shortlist(key, shape, profile, default)]
    compiled = (compile_all or compile_in_time)(specs[1:], max(0.0, (deadline - clock()) / 2))
    modelled: dict = {}
    order = [default, *sorted((s for s in specs[1:] if s in compiled),
                              key=lambda s: _model_ms(objective, key, s, modelled))]
    records, longest = [], 0.0
    for spec in order:
        start = clock()
        if start + longest > deadline:  # one more like the longest so far would end past the budget
            break
        try:
            outcome = objective(key, spec)
        except Exception as exc:  # noqa: BLE001 -- a failed candidate is data
            outcome = Outcome("launch_error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
        records.append(study.TrialRecord(len(records), spec, outcome.status, outcome.time_ms, outcome.reason,
                                         outcome.info))
        longest = max(longest, clock() - start)
    result = study.KeyResult(key, len(specs), default, records, mode="first-use")
    ok = result.ok()
    if not ok:
        log("flashgen autotune: %s: none of %d candidates passed (%s); the default rule serves",
            space.key_name(key), len(records), result.failures())
        return None
    finalists = list(dict.fromkeys([ok[0].spec, *(t.spec for t in ok if t.spec == default)]))
    if len(finalists) > 1 and clock() + CONFIRM_ROUNDS * len(finalists) * longest <= deadline:
        confirmed = objective.confirm(key, finalists, CONFIRM_ROUNDS)
        for t in records:
            if t.spec in confirmed:
                t.info = {**t.info, "screen_ms": t.time_ms}
                t.time_ms = confirmed[t.spec]
    best = result.best
    base = result.baseline_trial
    entry = store.entry_from_result(result, "measured", shape)
    table = tables.Table(meta=tables.make_meta(profile, "measured"))
    table.entries[key] = entry
    path = tables.default_path(profile.name)
    tables.update(path, table)
    dispatch.clear()  # this process's later picks read the new entry
    gain = (f"{base.time_ms / best.time_ms:.2f}x the default rule's {base.time_ms:.3f} ms"
            if base is not None and base.status == "ok" else "the default rule failed")
    log("flashgen autotune: %s at shape %s: %d candidates measured in %.1f s (budget %.0f s); %s %.3f ms, %s; "
        "stored in %s", space.key_name(key), shape, len(records), clock() - t0, request.budget_s, best.spec.name,
        best.time_ms, gain, path)
    return best.spec


def _model_ms(objective, key, spec, cache) -> float:
    """The cost model's estimate of ``spec`` from its ptxas registers (compiled already); inf when it
    does not build cleanly (it is measured last, and refused then)."""
    if spec not in cache:
        try:
            regs = objective.build(spec).report.registers
            cache[spec] = cost.estimate(spec, (objective.shapes[key][0], objective.shapes[key][1],
                                               objective.shapes[key][3], key.head_dim), objective.profile, regs)
        except Exception:  # noqa: BLE001
            cache[spec] = float("inf")
    return cache[spec]


def compile_in_time(specs, timeout: float) -> set:
    """Compile ``specs`` in parallel; the set of those that built within ``timeout`` seconds (a compile
    still running then finishes in the background, into the disk cache, for a later search)."""
    def one(spec):
        try:
            build(spec)
            return spec
        except Exception:  # noqa: BLE001 -- not measured; a trial would record the same failure
            return None

    if not specs:
        return set()
    pool = ThreadPool(min(COMPILE_THREADS, len(specs)))
    pending = [pool.apply_async(one, (s,)) for s in specs]
    pool.close()
    end = time.monotonic() + timeout
    done = set()
    for p in pending:
        p.wait(max(0.0, end - time.monotonic()))
        if p.ready() and p.get() is not None:
            done.add(p.get())
    return done
