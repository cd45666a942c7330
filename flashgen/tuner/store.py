"""Tuned tables on disk: one YAML file per GPU.

    meta:     format, gpu, device_name, arch, sms, smem_per_block, source,
              date, versions {flashgen, nvrtc, cuda, cupy, torch}
    entries:  - key:        {kind, arch, dtype, head_dim, causal, bucket}
                            (kind is the problem: "fwd" for the forward, whatever family serves it;
                            bwd_dkdv, bwd_dkdv_nodq or bwd_dq for the backward's tuned kernels,
                            head_dim their tile, dispatch.bwd_head_dim_tile)
                spec:       every KernelSpec field (for "fwd": a fwd_v2 spec, or fwd_sm90 on sm_90a)
                time_ms, tflops, source (measured | model)
                            (a backward key: the whole backward's time, FLOPs 2.5x the forward's)
                baseline:   {spec, time_ms} (the paper rule; for a backward key the default rule;
                            time null if it failed)
                speedup:    baseline time / winner time (null if the baseline failed)
                runners_up: [{spec, time_ms}, ...]
                trials, candidates, failures {status: count}

Reading uses ``yaml.safe_load`` only and validates every value (types, enums,
ranges, the spec against its key and the GPU's shared memory) before anything
is used, raising ``ConfigError(path, reason)``. A file written for another GPU
is refused.

Format 2 (this one) keys the forward as kind "fwd"; format 1 keyed it by the
family (``fwd_v2``, or ``fwd_sm90`` from ``--kind fwd_sm90``). A format-1 file
is migrated on read with a warning (those keys read as "fwd"; where one key
then has two entries, the faster is kept), so a user's own tuning results stay
in use; ``migrate(path)`` rewrites a file in the new format. In a format-2
file a family name as key kind is a ``ConfigError``. Writing is atomic (temp file + ``os.replace``); ``merge`` keeps the
entries of keys a new run did not touch.

This module has no Optuna import: dispatch reads tables through it.
"""
from __future__ import annotations

import datetime
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__, gpus
from ..dispatch import BUCKETS, ProblemKey
from ..errors import ConfigError
from ..spec import ARCHS, DTYPES, KernelSpec

FORMAT = 2
_MIGRATED_KINDS = {"fwd_v2": "fwd", "fwd_sm90": "fwd"}  # format 1 -> 2: forward keys name the problem
SOURCES = ("measured", "model")
_KEY_FIELDS = {"kind": str, "arch": str, "dtype": str, "head_dim": int, "causal": bool, "bucket": int}
_META_FIELDS = {"format": int, "gpu": str, "arch": str, "sms": int, "smem_per_block": int, "source": str,
                "date": str, "versions": dict}
_ENTRY_REQUIRED = ("key", "spec", "time_ms", "source")


@dataclass
class Table:
    meta: dict
    entries: dict = field(default_factory=dict)  # ProblemKey -> entry dict (spec as KernelSpec)
    path: str | None = None

    def spec(self, key: ProblemKey) -> KernelSpec | None:
        entry = self.entries.get(key)
        return entry["spec"] if entry else None


def versions() -> dict:
    """Versions of what produced a table (none of these imports needs a GPU)."""
    out = {"flashgen": __version__}
    try:
        from ..codegen.compiler import nvrtc_version

        out["nvrtc"] = ".".join(map(str, nvrtc_version()))
    except Exception:  # noqa: BLE001 — metadata only
        out["nvrtc"] = "unknown"
    for mod in ("cupy", "torch"):
        try:
            out[mod] = str(__import__(mod).__version__)
        except Exception:  # noqa: BLE001
            out[mod] = "unknown"
    try:
        import torch

        out["cuda"] = str(torch.version.cuda)
    except Exception:  # noqa: BLE001
        out["cuda"] = "unknown"
    return out


def make_meta(profile, source: str, device_name: str | None = None) -> dict:
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    return {"format": FORMAT, "gpu": profile.name, "device_name": device_name or profile.device_name,
            "arch": profile.arch, "sms": profile.sms, "smem_per_block": profile.smem_per_block, "source": source,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": versions()}


def default_path(gpu: str) -> Path:
    from .. import settings

    return settings.home() / "configs" / f"{gpu}.yaml"


def shipped_path(gpu: str) -> Path:
    return Path(__file__).resolve().parent.parent / "generated" / f"{gpu}.yaml"


# -- reading ------------------------------------------------------------------
def _typed(where, what, value, want):
    if type(value) is not want:  # bool is not an int here, nor the other way round
        raise ConfigError(where, f"{what} must be {want.__name__}, got {value!r}")
    return value


def _number(where, what, value, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(where, f"{what} must be a positive number, got {value!r}")
    return float(value)


def _key(where, record) -> ProblemKey:
    if not isinstance(record, dict):
        raise ConfigError(where, f"entry key must be a mapping, got {record!r}")
    if set(record) != set(_KEY_FIELDS):
        raise ConfigError(where, f"entry key needs exactly the fields {sorted(_KEY_FIELDS)}, got {sorted(record)}")
    for name, want in _KEY_FIELDS.items():
        _typed(where, f"key.{name}", record[name], want)
    from ..dispatch import problem_kind, problem_kinds

    if record["kind"] in _MIGRATED_KINDS and problem_kind(record["kind"]) != record["kind"]:
        raise ConfigError(where, f"key.kind {record['kind']!r} is a kernel family; since table format 2 the "
                                 f"forward's key kind is {problem_kind(record['kind'])!r} (its spec names the family)")
    if record["kind"] not in problem_kinds() or record["arch"] not in ARCHS or record["dtype"] not in DTYPES:
        raise ConfigError(where, f"unknown kind, arch or dtype in key {record!r}")
    if record["bucket"] not in BUCKETS:
        raise ConfigError(where, f"key.bucket {record['bucket']} is not one of {BUCKETS}")
    return ProblemKey(**record)


def _spec(where, record, key, profile) -> KernelSpec:
    from dataclasses import fields

    if not isinstance(record, dict):
        raise ConfigError(where, f"spec must be a mapping, got {record!r}")
    from ..spec import LATER_FIELDS

    # A table must say everything (no silent defaults), except the fields added after tables
    # existed, whose default is the old behaviour (fwd_sm90's flags: False).
    missing = {f.name for f in fields(KernelSpec)} - set(record) - set(LATER_FIELDS)
    if missing:
        raise ConfigError(where, f"spec is missing field(s): {', '.join(sorted(missing))}")
    spec = KernelSpec.from_dict(record, where)
    from ..dispatch import families_for, spec_tile

    serving = families_for(key.kind, key.arch)
    if spec.kind not in serving:
        raise ConfigError(where, f"spec {spec.name} is a {spec.kind} kernel, which does not serve {key.kind} on "
                                 f"{key.arch} (families there: {', '.join(serving) or 'none'})")
    for name in ("arch", "dtype", "causal"):
        if getattr(spec, name) != getattr(key, name):
            raise ConfigError(where, f"spec {spec.name} does not match its key ({name}: {getattr(key, name)!r})")
    if spec.head_dim != spec_tile(spec.kind, key):
        raise ConfigError(where, f"spec {spec.name} does not match its key (head_dim: {spec_tile(spec.kind, key)!r} "
                                 f"for a {spec.kind} spec of key head_dim {key.head_dim})")
    reasons = spec.check(profile)
    if reasons:
        raise ConfigError(where, f"spec {spec.name} is not feasible on {profile.name}: {'; '.join(reasons)}")
    return spec


def _entry(where, record, profile) -> tuple[ProblemKey, dict]:
    if not isinstance(record, dict):
        raise ConfigError(where, f"an entry must be a mapping, got {type(record).__name__}")
    missing = [f for f in _ENTRY_REQUIRED if f not in record]
    if missing:
        raise ConfigError(where, f"entry is missing {', '.join(missing)}")
    key = _key(where, record["key"])
    entry = dict(record)
    entry["spec"] = _spec(where, record["spec"], key, profile)
    entry["time_ms"] = _number(where, "time_ms", record["time_ms"])
    if record["source"] not in SOURCES:
        raise ConfigError(where, f"entry source must be one of {SOURCES}, got {record['source']!r}")
    for name in ("tflops", "speedup"):
        entry[name] = _number(where, name, record.get(name), allow_none=True)
    base = record.get("baseline")
    if base is not None:
        if not isinstance(base, dict) or "spec" not in base:
            raise ConfigError(where, f"baseline must be a mapping with a spec, got {base!r}")
        entry["baseline"] = {"spec": _spec(where, base["spec"], key, profile),
                             "time_ms": _number(where, "baseline.time_ms", base.get("time_ms"), allow_none=True)}
    runners = record.get("runners_up", [])
    if not isinstance(runners, list):
        raise ConfigError(where, "runners_up must be a list")
    entry["runners_up"] = [{"spec": _spec(where, r.get("spec") if isinstance(r, dict) else r, key, profile),
                            "time_ms": _number(where, "runners_up.time_ms", r.get("time_ms"))} for r in runners]
    for name in ("trials", "candidates"):
        if name in record and (type(record[name]) is not int or record[name] < 0):
            raise ConfigError(where, f"{name} must be a non-negative int, got {record[name]!r}")
    fails = record.get("failures", {})
    if not isinstance(fails, dict) or any(type(v) is not int or v < 0 for v in fails.values()):
        raise ConfigError(where, f"failures must map a status to a count, got {fails!r}")
    return key, entry


def load(path, gpu: str | None = None) -> Table:
    """Read and validate a table; ``gpu`` given: refuse a file written for another GPU."""
    import yaml

    where = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(where, f"cannot read: {exc.strerror or exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(where, f"not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(doc, dict) or set(doc) != {"meta", "entries"}:
        raise ConfigError(where, "a tuned table is a mapping with exactly 'meta' and 'entries'")
    meta = doc["meta"]
    if not isinstance(meta, dict):
        raise ConfigError(where, "meta must be a mapping")
    for name, want in _META_FIELDS.items():
        if name not in meta:
            raise ConfigError(where, f"meta is missing {name}")
        _typed(where, f"meta.{name}", meta[name], want)
    entries = doc["entries"]
    if meta["format"] == 1:
        entries = _migrate_entries(where, entries)
        warnings.warn(f"{where}: table format 1 read as format {FORMAT} (forward keys of kind fwd_v2/fwd_sm90 are "
                      f"now kind 'fwd'); rewrite it with flashgen.tuner.store.migrate or re-tune", stacklevel=2)
        meta = doc["meta"] = {**meta, "format": FORMAT}
    elif meta["format"] != FORMAT:
        raise ConfigError(where, f"table format {meta['format']} is not the supported {FORMAT} (or 1, migrated)")
    if meta["source"] not in SOURCES:
        raise ConfigError(where, f"meta.source must be one of {SOURCES}, got {meta['source']!r}")
    try:
        profile = gpus.get(meta["gpu"])
    except Exception:  # noqa: BLE001
        raise ConfigError(where, f"meta.gpu {meta['gpu']!r} is not a known GPU profile") from None
    if gpu is not None and profile.name != gpus.get(gpu).name:
        raise ConfigError(where, f"this table was tuned for {profile.name}, not {gpu}: refusing to use it")
    if meta["arch"] != profile.arch or meta["smem_per_block"] > profile.smem_per_block:
        raise ConfigError(where, f"meta arch/smem ({meta['arch']}, {meta['smem_per_block']} B) do not match "
                                 f"the {profile.name} profile")
    profile = gpus.with_smem(profile, meta["smem_per_block"])
    if meta["versions"].get("flashgen") != __version__:
        warnings.warn(f"{where}: tuned with flashgen {meta['versions'].get('flashgen')}, this is {__version__}; "
                      "re-tune for the best kernels", stacklevel=2)
    if not isinstance(entries, list):
        raise ConfigError(where, "entries must be a list")
    table = Table(meta=meta, path=where)
    for i, record in enumerate(entries):
        key, entry = _entry(f"{where}: entries[{i}]", record, profile)
        if key in table.entries:
            raise ConfigError(where, f"entries[{i}] repeats the key {record['key']}")
        table.entries[key] = entry
    return table


def _migrate_entries(where, entries):
    """Format-1 entries as format 2: forward keys (kind fwd_v2 / fwd_sm90) become kind "fwd".

    Where two old keys become one (a fwd_v2 and a fwd_sm90 entry of one problem), the
    entry with the smaller time_ms is kept: both were timed at the key's problem shape.
    Anything malformed is left as it is for the validation that follows to report.
    """
    if not isinstance(entries, list):
        return entries
    out, index = [], {}
    for record in entries:
        key = record.get("key") if isinstance(record, dict) else None
        if isinstance(key, dict) and key.get("kind") in _MIGRATED_KINDS:
            record = {**record, "key": {**key, "kind": _MIGRATED_KINDS[key["kind"]]}}
            try:
                ident = tuple(sorted(record["key"].items()))
                hash(ident)
            except TypeError:
                ident = None
            if ident is not None and ident in index:
                prior = out[index[ident]]
                try:
                    faster = float(record["time_ms"]) < float(prior["time_ms"])
                except (KeyError, TypeError, ValueError):
                    faster = False
                if faster:
                    out[index[ident]] = record
                continue
            if ident is not None:
                index[ident] = len(out)
        out.append(record)
    return out


def migrate(path) -> Path:
    """Rewrite a format-1 table at ``path`` in the current format (every entry and number kept)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = load(path)
    return save(table, path)


# -- writing ------------------------------------------------------------------
def _plain(entry: dict) -> dict:
    out = {}
    for name, value in entry.items():
        if isinstance(value, KernelSpec):
            value = value.to_dict()
        elif name == "baseline" and value is not None:
            value = {"spec": value["spec"].to_dict(), "time_ms": value["time_ms"]}
        elif name == "runners_up":
            value = [{"spec": r["spec"].to_dict(), "time_ms": r["time_ms"]} for r in value]
        out[name] = value
    return out


def dump(table: Table) -> str:
    import yaml

    entries = []
    for key in sorted(table.entries, key=lambda k: (k.kind, k.arch, k.dtype, k.head_dim, k.causal, k.bucket)):
        entry = {"key": {f: getattr(key, f) for f in _KEY_FIELDS}, **_plain(table.entries[key])}
        entries.append(entry)
    return yaml.safe_dump({"meta": table.meta, "entries": entries}, sort_keys=False, default_flow_style=None,
                          width=120)


def save(table: Table, path) -> Path:
    """Write ``table`` to ``path`` atomically (readers never see half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(dump(table))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def merge(old: Table | None, new: Table) -> Table:
    """``new``'s entries over ``old``'s; keys only ``old`` has are kept. The meta is ``new``'s,
    with ``source`` 'measured' only when every entry was measured."""
    if old is None:
        return new
    if old.meta["gpu"] != new.meta["gpu"]:
        raise ConfigError(old.path, f"cannot merge a {new.meta['gpu']} table into one for {old.meta['gpu']}")
    entries = {**old.entries, **new.entries}
    meta = dict(new.meta)
    meta["source"] = "measured" if all(e["source"] == "measured" for e in entries.values()) else "model"
    return Table(meta=meta, entries=entries, path=new.path)


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
    have (bench/NOTES.md, the register cliff), and the compile tier checks every shipped spec."""
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
    longer interleaved A/B among candidates the tuner found within its own noise, bench/ab_fwd.py) won
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


def entry_from_result(result, source: str) -> dict:
    """A table entry from a tuner ``KeyResult`` (its winner must exist)."""
    from .space import key_flops

    best = result.best
    base = result.baseline_trial
    base_ms = base.time_ms if base is not None and base.status == "ok" else None
    return {
        "spec": best.spec, "time_ms": best.time_ms,
        "tflops": key_flops(result.key) / (best.time_ms * 1e-3) / 1e12,
        "source": source,
        "baseline": {"spec": result.baseline, "time_ms": base_ms},
        "speedup": base_ms / best.time_ms if base_ms else None,
        "runners_up": [{"spec": t.spec, "time_ms": t.time_ms} for t in result.runners_up()],
        "trials": len(result.trials), "candidates": result.candidates, "failures": result.failures(),
    }
