"""What the tuner adds to the tuned tables: entries from its results, and promotions among runners-up.

The YAML format itself (reading, validation, migration, merging, writing) is
``flashgen.tables``; this module builds entries from a tuning run
(``entry_from_result``) and rewrites entries for shipping (``without_refused``,
``with_preferred``).
"""
from __future__ import annotations

from ..tables import Table
from .space import key_flops


def _promoted(entry: dict, runners: list, pick: int, runners_up: list | None = None) -> dict:
    """``entry`` with runner-up ``runners[pick]`` (runners sorted by time) as its winner: its recorded
    time, speedup and TFLOP/s; its runners-up ``runners_up``, by default the runners after it."""
    r = runners[pick]
    base_ms = (entry.get("baseline") or {}).get("time_ms")
    new = {**entry, "spec": r["spec"], "time_ms": r["time_ms"],
           "runners_up": runners[pick + 1:] if runners_up is None else runners_up,
           "speedup": base_ms / r["time_ms"] if base_ms else None}
    if entry.get("tflops"):
        new["tflops"] = entry["tflops"] * entry["time_ms"] / r["time_ms"]
    return new


def without_refused(table: Table, problems) -> tuple[Table, list[str]]:
    """``table`` with each entry whose spec ``problems(spec)`` refuses (non-empty list; e.g.
    ``dispatch.resource_problems``: this NVRTC spills it) replaced by its fastest runner-up that is
    not refused (its recorded time, speedup and TFLOP/s), or dropped when none is (dispatch's default
    rule then serves the key); and one line per change. For shipping a table tuned under another
    toolchain: a tile spill-free under the device's NVRTC may spill under the one CI and pip users
    have (docs/perf/toolchain.md, the register cliff), and the compile tier checks every shipped spec."""
    out = Table(meta=dict(table.meta), path=table.path)
    changes = []
    for key, entry in table.entries.items():
        why = problems(entry["spec"])
        if not why:
            out.entries[key] = entry
            continue
        runners = sorted(entry.get("runners_up", []), key=lambda r: r["time_ms"])
        pick = next((i for i, r in enumerate(runners) if not problems(r["spec"])), None)
        if pick is None:
            changes.append(f"{key}: {entry['spec'].name} refused ({'; '.join(why)}); no clean runner-up: dropped")
            continue
        out.entries[key] = new = _promoted(entry, runners, pick)
        changes.append(f"{key}: {entry['spec'].name} refused ({'; '.join(why)}); runner-up {new['spec'].name} "
                       f"({new['time_ms']:.3f} ms, {new['time_ms'] / entry['time_ms']:.3f}x the winner's time)")
    return out, changes


def with_preferred(table: Table, prefer: dict) -> tuple[Table, list[str]]:
    """``table`` with each key of ``prefer`` (ProblemKey -> spec names, best first: e.g. the ranking of a
    longer interleaved A/B among candidates the tuner found within its own noise, ``flashgen bench ab``) won
    by the first name that is its winner already (kept) or one of its runners-up (promoted, with the
    time the tuner recorded for it). One line per key asked for."""
    out = Table(meta=dict(table.meta), path=table.path, entries=dict(table.entries))
    changes = []
    for key, names in prefer.items():
        entry = table.entries.get(key)
        if entry is None:
            changes.append(f"{key}: no entry")
            continue
        runners = sorted(entry.get("runners_up", []), key=lambda r: r["time_ms"])
        at = {r["spec"].name: i for i, r in enumerate(runners)}
        name = next((n for n in names if n == entry["spec"].name or n in at), None)
        if name is None or name == entry["spec"].name:
            changes.append(f"{key}: kept {entry['spec'].name} ({'preferred' if name else 'no preferred spec recorded'})")
            continue
        # Every other runner and the tuner's winner stay runners-up.
        others = sorted([r for r in runners if r["spec"].name != name]
                        + [{"spec": entry["spec"], "time_ms": entry["time_ms"]}], key=lambda r: r["time_ms"])
        out.entries[key] = new = _promoted(entry, runners, at[name], others)
        changes.append(f"{key}: {entry['spec'].name} -> {name} (preferred; tuner time {new['time_ms']:.4f} ms, "
                       f"{new['time_ms'] / entry['time_ms']:.3f}x the tuner's winner)")
    return out, changes


def entry_from_result(result, source: str, shape=None) -> dict:
    """A table entry from a tuner ``KeyResult`` (its winner must exist); ``shape``: the shape it was
    timed at (``space.measured_shape``) when not the key's benchmark shape, for its TFLOP/s."""
    best = result.best
    base = result.baseline_trial
    base_ms = base.time_ms if base is not None and base.status == "ok" else None
    return {
        "spec": best.spec, "time_ms": best.time_ms,
        "tflops": key_flops(result.key, shape) / (best.time_ms * 1e-3) / 1e12,
        "source": source,
        "baseline": {"spec": result.baseline, "time_ms": base_ms},
        "speedup": base_ms / best.time_ms if base_ms else None,
        "runners_up": [{"spec": t.spec, "time_ms": t.time_ms} for t in result.runners_up()],
        "trials": len(result.trials), "candidates": result.candidates, "failures": result.failures(),
    }
