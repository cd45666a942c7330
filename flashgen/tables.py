"""Tuned tables: one YAML file per GPU, the user's results first, then the one shipped with flashgen.

    meta:     format, gpu, device_name, arch, sms, smem_per_block, source,
              date, versions {flashgen, nvrtc, cuda, cupy, torch},
              model_check (a model-ranked table: MODEL_CHECK, the cost model against measurement)
    entries:  - key:        {kind, arch, dtype, head_dim, causal, bucket}
                            (kind is the problem: "fwd" for the forward, whatever family serves it;
                            bwd_dkdv, bwd_dkdv_nodq or bwd_dq for the backward's tuned kernels, head_dim
                            their tile, problem.bwd_head_dim_tile)
                spec:       the KernelSpec record (KernelSpec.to_dict: the fields its kind uses)
                time_ms, tflops, source (measured | model)
                            (a backward key: the whole backward's time, FLOPs 2.5x the forward's)
                baseline:   {spec, time_ms} (the paper rule; for a backward key the default rule;
                            time null if it failed)
                speedup:    baseline time / winner time (null if the baseline failed)
                runners_up: [{spec, time_ms}, ...]
                trials, candidates, failures {status: count}

``lookup(gpu, key)`` asks ``$FLASHGEN_HOME/configs/<gpu>.yaml`` (written by
``flashgen tune``) first, then ``flashgen/generated/<gpu>.yaml``; None when
neither has the key (dispatch then uses its default rule). Each file is read
and validated once per process (``clear()`` forgets them). Reading uses
``yaml.safe_load`` only and validates every value (types, enums, ranges, the
spec against its key and the GPU's shared memory) before anything is used,
raising ``ConfigError(path, reason)``: never a silent fallback to another
table. A file written for another GPU is refused, and so is anything that is not
a regular file of at most ``MAX_BYTES`` bytes of UTF-8 YAML without aliases (an
alias bomb or ``/dev/zero`` as a table costs nothing), a field the format does not
know, or a key of another arch.

Writers merge under a lock: ``update(path, table)`` takes an exclusive lock on the
table's folder, reads what is there, merges and writes atomically, so concurrent
tuning runs lose no entry. Where the user's table and the shipped one both have a
key, a measured entry wins over one ranked by the cost model (``source: model``)
unless ``FLASHGEN_PREFER_MODEL`` is set; otherwise the user's entry wins.

Format 3 (this one) records a spec by the fields its kind uses, with
descriptive names (``warp_specialized``, ``fma_exp2``, ``kv_load``,
``dq_write`` ...). Format 2 named them after the kernels' history (``warpspec``,
``emu``, one ``hint`` field meaning two things) and wrote every field for
every kind; format 1 also keyed the forward by its family (``fwd_v2``,
``fwd_sm90``) where format 2 says "fwd". Older files are migrated on read with a
warning (``migrate(path)`` rewrites one). Writing is atomic (temp file +
``os.replace``); ``merge`` keeps the entries of keys a new run did not touch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import datetime
import math
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from . import families, files, gpus, settings, variants
from .codegen.compiler import nvrtc_version
from .errors import ConfigError
from .problem import BUCKETS, ProblemKey
from .spec import ARCHS, DTYPES, KernelSpec, fields_of
from .version import __version__

FORMAT = 3
SOURCES = ("measured", "model")
_KEY_FIELDS = {"kind": str, "arch": str, "dtype": str, "head_dim": int, "causal": bool, "bucket": int}
_KEY_OPTIONAL = {"variant": str}  # absent for a plain problem
_META_FIELDS = {"format": int, "gpu": str, "arch": str, "sms": int, "smem_per_block": int, "source": str,
                "date": str, "versions": dict}
_META_OPTIONAL = {"device_name": str, "model_check": dict}
# A model-ranked table's ``model_check``: how the cost model that ranked it fared against measurement where
# both can be had (the H200), so that a table nobody measured says how far to trust it.
_CHECK_FIELDS = {"gpu": str, "keys": str, "measured": int, "geomean_regret": float, "worst_regret": float,
                 "median_spearman": float, "command": str, "date": str}
# The cost model's last check (``flashgen tune --validate-model`` on the H200, docs/perf/h200/tuner_validate.txt,
# docs/perf/tuner.md); written into every model-ranked table's meta. Measure again when the model changes.
MODEL_CHECK = {"gpu": "h200", "keys": "forward, d 64/128, N 1k/4k, causal both (bf16)", "measured": 8,
               "geomean_regret": 1.017, "worst_regret": 1.047, "median_spearman": 0.85,
               "command": "flashgen tune --gpu h200 --d 64,128 --seqlens 1024,4096 --causal both --validate-model "
                          "--trials 16",
               "date": "2026-12-04"}
_ENTRY_REQUIRED = ("key", "spec", "time_ms", "source")
_ENTRY_FIELDS = frozenset((*_ENTRY_REQUIRED, "tflops", "baseline", "speedup", "runners_up", "trials", "candidates",
                           "failures"))
# A tuned table is a few hundred kilobytes (the shipped H200 table: 64 entries, 90 KB); a file far larger
# than any table can be is refused before it is parsed.
MAX_BYTES = 8 << 20


@dataclass
class Table:
    meta: dict
    entries: dict = field(default_factory=dict)  # ProblemKey -> entry dict (spec as KernelSpec)
    path: str | None = None

    def spec(self, key: ProblemKey) -> KernelSpec | None:
        entry = self.entries.get(key)
        return entry["spec"] if entry else None


def versions() -> dict:
    """Versions of what produced a table, without importing torch or CuPy for it (torch alone takes
    seconds to import: a ``tune --model`` worker never needs it). A module already imported gives its
    own version; otherwise the installed distribution's metadata does, and CUDA comes from torch's
    local version label (``2.11.0+cu130`` -> ``13.0``)."""
    import importlib.metadata
    import re
    import sys

    out = {"flashgen": __version__}
    try:
        out["nvrtc"] = ".".join(map(str, nvrtc_version()))
    except Exception:  # noqa: BLE001 -- metadata only
        out["nvrtc"] = "unknown"
    for mod, dist in (("cupy", ("cupy-cuda13x", "cupy-cuda12x", "cupy")), ("torch", ("torch",))):
        version = getattr(sys.modules.get(mod), "__version__", None)
        for name in dist if version is None else ():
            try:
                version = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        out[mod] = str(version or "unknown")
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None) if torch is not None else None
    if cuda is None:
        m = re.search(r"\+cu(\d+)(\d)$", out["torch"])
        cuda = f"{m.group(1)}.{m.group(2)}" if m else "unknown"
    out["cuda"] = str(cuda)
    return out


def make_meta(profile, source: str, device_name: str | None = None) -> dict:
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    meta = {"format": FORMAT, "gpu": profile.name, "device_name": device_name or profile.device_name,
            "arch": profile.arch, "sms": profile.sms, "smem_per_block": profile.smem_per_block, "source": source,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": versions()}
    if source == "model":
        meta["model_check"] = dict(MODEL_CHECK)
    return meta


def default_path(gpu: str) -> Path:
    """Where ``flashgen tune`` writes, and dispatch first looks: ``$FLASHGEN_HOME/configs/<gpu>.yaml``."""
    return settings.home() / "configs" / f"{gpu}.yaml"


def shipped_path(gpu: str) -> Path:
    return Path(__file__).resolve().parent / "generated" / f"{gpu}.yaml"


def shipped_gpus() -> list:
    """The GPU profiles a table is shipped for."""
    return sorted(p.stem for p in shipped_path("x").parent.glob("*.yaml"))


# -- reading ------------------------------------------------------------------
def _typed(where, what, value, want):
    if type(value) is not want:  # bool is not an int here, nor the other way round
        raise ConfigError(where, f"{what} must be {want.__name__}, got {value!r}")
    return value


def _model_check(where, meta) -> None:
    """``meta.model_check``: only in a model-ranked table, exactly _CHECK_FIELDS, regrets >= 1, rho in [-1, 1]."""
    check = meta["model_check"]
    if meta.get("source") != "model":
        raise ConfigError(where, "meta.model_check belongs to a model-ranked table (meta.source model)")
    if set(check) != set(_CHECK_FIELDS):
        raise ConfigError(where, f"meta.model_check must have exactly {', '.join(sorted(_CHECK_FIELDS))}, got "
                                 f"{', '.join(sorted(map(str, check)))}")
    for name, want in _CHECK_FIELDS.items():
        value = check[name]
        if want is float and type(value) is int:
            value = float(value)
        _typed(where, f"meta.model_check.{name}", value, want)
    for name in ("geomean_regret", "worst_regret"):
        if not (math.isfinite(check[name]) and 1.0 <= check[name] <= 1e3):
            raise ConfigError(where, f"meta.model_check.{name} must be a regret (>= 1), got {check[name]!r}")
    if not -1.0 <= check["median_spearman"] <= 1.0:
        raise ConfigError(where, f"meta.model_check.median_spearman must be in [-1, 1], got {check['median_spearman']!r}")
    if check["measured"] < 1 or check["worst_regret"] < check["geomean_regret"]:
        raise ConfigError(where, "meta.model_check: no key measured, or a worst regret below the mean")


def _number(where, what, value, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(where, f"{what} must be a positive number, got {value!r}")
    return float(value)


def _key(where, record, arch: str) -> ProblemKey:
    if not isinstance(record, dict):
        raise ConfigError(where, f"entry key must be a mapping, got {record!r}")
    if not set(_KEY_FIELDS) <= set(record) <= set(_KEY_FIELDS) | set(_KEY_OPTIONAL):
        raise ConfigError(where, f"entry key needs exactly the fields {sorted(_KEY_FIELDS)} (and optionally "
                                 f"{sorted(_KEY_OPTIONAL)}), got {sorted(record)}")
    for name, want in {**_KEY_FIELDS, **_KEY_OPTIONAL}.items():
        if name in record:
            _typed(where, f"key.{name}", record[name], want)
    if not variants.is_key_variant(record.get("variant", "")):
        raise ConfigError(where, f"key.variant {record['variant']!r} is not variant tokens (win, cap, alibi, sink "
                                 "in that order, joined by '_'), nor one user mods' mod<token>")
    if variants.mod_of(record.get("variant", "")) and (record.get("kind") != "fwd" or record.get("causal")):
        raise ConfigError(where, f"key.variant {record['variant']!r} (user mods) is a forward key's, not causal: "
                                 "a mod expresses its own mask")
    if record["kind"] not in families.problems() or record["arch"] not in ARCHS or record["dtype"] not in DTYPES:
        raise ConfigError(where, f"unknown kind, arch or dtype in key {record!r}")
    if record["arch"] != arch:
        raise ConfigError(where, f"key.arch {record['arch']!r} is not the table's arch {arch!r}")
    if record["bucket"] not in BUCKETS:
        raise ConfigError(where, f"key.bucket {record['bucket']} is not one of {BUCKETS}")
    return ProblemKey(**record)


def parse_key(where, record, arch: str | None = None) -> ProblemKey:
    """A problem key from its YAML record (the fields of an entry's ``key``), every value checked;
    ``arch`` given: refuse a key of another arch. ``ConfigError(where, reason)`` otherwise."""
    if arch is None:
        arch = record.get("arch") if isinstance(record, dict) else None
    return _key(where, record, arch)


def key_record(key: ProblemKey) -> dict:
    """The YAML record of a problem key (``parse_key`` reads it back)."""
    record = {f: getattr(key, f) for f in _KEY_FIELDS}
    if key.variant:
        record["variant"] = key.variant
    return record


def _spec(where, record, key, profile) -> KernelSpec:
    spec = KernelSpec.from_dict(record, where, complete=True)
    serving = families.serving(key.kind, key.arch)
    if spec.kind not in serving:
        raise ConfigError(where, f"spec {spec.name} is a {spec.kind} kernel, which does not serve {key.kind} on "
                                 f"{key.arch} (families there: {', '.join(serving) or 'none'})")
    for name in ("arch", "dtype", "causal"):
        if getattr(spec, name) != getattr(key, name):
            raise ConfigError(where, f"spec {spec.name} does not match its key ({name}: {getattr(key, name)!r})")
    if spec != spec.replace(**variants.VARIANT_OFF, mod=0).with_tokens(key.variant):
        raise ConfigError(where, f"spec {spec.name} does not match its key (variant: {key.variant!r})")
    tile = families.family(spec.kind).tile(key)
    if spec.head_dim != tile:
        raise ConfigError(where, f"spec {spec.name} does not match its key (head_dim: {tile!r} for a {spec.kind} "
                                 f"spec of key head_dim {key.head_dim})")
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
    unknown = sorted(map(str, set(record) - _ENTRY_FIELDS))
    if unknown:
        raise ConfigError(where, f"unknown entry field(s): {', '.join(unknown)}")
    key = _key(where, record["key"], profile.arch)
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


def _without_aliases(node) -> None:
    """Refuse a YAML node graph in which any node is reached twice: that is what an alias (``*name``)
    makes, and a table never needs one (nested aliases expand exponentially: a few hundred bytes can ask
    for gigabytes once constructed). The composer shares an aliased node instead of copying it, so this
    walk is linear in the document's size however the aliases nest."""
    import yaml

    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if id(n) in seen:
            raise yaml.YAMLError(f"line {n.start_mark.line + 1}: YAML aliases (*name) are not allowed in a tuned "
                                 "table (this node is used more than once)")
        seen.add(id(n))
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                todo += (k, v)
        elif isinstance(n, yaml.SequenceNode):
            todo += n.value


def _safe_document(text: str):
    """The document of ``text`` through PyYAML's safe loader (libyaml's parser where PyYAML has it: about
    5x faster on the shipped tables, which every new process reads before its first call), no aliases."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _without_aliases(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def read_document(path):
    """The YAML document of the file at ``path`` (a regular file of at most MAX_BYTES bytes of UTF-8, no
    aliases); ``ConfigError`` naming the path and the reason otherwise."""
    where = str(path)
    try:
        data = files.read_regular(path, MAX_BYTES)
    except files.NotARegularFile:
        raise ConfigError(where, "not a regular file (a tuned table is a YAML file)") from None
    except files.TooLarge:
        raise ConfigError(where, f"larger than {MAX_BYTES} bytes: not a tuned table") from None
    except OSError as exc:
        raise ConfigError(where, f"cannot read: {exc.strerror or exc}") from None
    digest = hashlib.sha256(data).hexdigest()
    doc = _parsed(path, digest)
    if doc is not _MISS:
        return doc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(where, f"not UTF-8 text (byte {exc.start})") from None
    import yaml  # (after the parsed-document cache: importing PyYAML takes 40 ms)

    try:
        doc = _safe_document(text)
    except yaml.YAMLError as exc:
        raise ConfigError(where, f"not valid YAML: {str(exc).splitlines()[0]}") from None
    _keep_parsed(path, digest, doc)
    return doc


# Parsed documents as JSON under $FLASHGEN_HOME/cache/tables/, one file per table path (named by the
# path's hash, so a table rewritten by each tune run replaces its own entry instead of adding one),
# holding the SHA-256 of the bytes it was parsed from: a new process reads the shipped table (about
# 100 kB, 12k YAML nodes: a quarter of a second to parse) from there in about a millisecond. Only the
# exact bytes hit; the document is validated like a parsed one; only a document that JSON gives back
# unchanged is kept; an unusable cache is skipped.
_MISS = object()


def _parsed_path(path) -> Path:
    where = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:32]
    return settings.home() / "cache" / "tables" / f"{where}.json"


def _parsed(path, digest: str):
    try:
        record = json.loads(files.read_regular(_parsed_path(path), 4 * MAX_BYTES))
    except (OSError, ValueError):
        return _MISS
    if not isinstance(record, dict) or record.get("sha256") != digest or "document" not in record:
        return _MISS
    return record["document"]


def _keep_parsed(path, digest: str, doc) -> None:
    try:
        text = json.dumps({"sha256": digest, "document": doc}, allow_nan=True)
        if json.loads(text)["document"] != doc:  # a YAML-only value (a date, a non-string key): not kept
            return
        cached = _parsed_path(path)
        cached.parent.mkdir(parents=True, exist_ok=True)
        files.atomic_write(cached, text.encode())
    except (OSError, TypeError, ValueError):
        pass


def load(path, gpu: str | None = None) -> Table:
    """Read and validate a table; ``gpu`` given: refuse a file written for another GPU."""
    where = str(path)
    doc = read_document(path)
    if not isinstance(doc, dict) or set(doc) != {"meta", "entries"}:
        raise ConfigError(where, "a tuned table is a mapping with exactly 'meta' and 'entries'")
    meta = doc["meta"]
    if not isinstance(meta, dict):
        raise ConfigError(where, "meta must be a mapping")
    for name, want in _META_FIELDS.items():
        if name not in meta:
            raise ConfigError(where, f"meta is missing {name}")
        _typed(where, f"meta.{name}", meta[name], want)
    for name, want in _META_OPTIONAL.items():
        if name in meta:
            _typed(where, f"meta.{name}", meta[name], want)
    unknown = sorted(map(str, set(meta) - set(_META_FIELDS) - set(_META_OPTIONAL)))
    if unknown:
        raise ConfigError(where, f"unknown meta field(s): {', '.join(unknown)}")
    if "model_check" in meta:
        _model_check(where, meta)
    entries = doc["entries"]
    if meta["format"] in (1, 2):
        entries = _migrate_entries(where, entries, meta["format"])
        warnings.warn(f"{where}: table format {meta['format']} read as format {FORMAT} (spec fields renamed, "
                      "forward keys of kind fwd_v2/fwd_sm90 are kind 'fwd'); rewrite it with "
                      "flashgen.tables.migrate or re-tune", stacklevel=2)
        meta = {**meta, "format": FORMAT}
    elif meta["format"] != FORMAT:
        raise ConfigError(where, f"table format {meta['format']} is not the supported {FORMAT} (or 1-2, migrated)")
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


# -- older formats -------------------------------------------------------------
_FORMAT1_KINDS = {"fwd_v2": "fwd", "fwd_sm90": "fwd"}  # format 1 -> 2: forward keys name the problem
# Format 2's spec fields -> format 3's (fwd_sm90's flags); ``hint`` became kv_load or dq_write by kind.
_RENAMED = {"warpspec": "warp_specialized", "overlap": "softmax_overlap", "emu": "fma_exp2",
            "sepkv": "early_k_release", "lazy": "lean_softmax", "persist": "persistent"}
_HINT_FIELD = {"decode_split": "kv_load", "bwd_sm90": "dq_write"}


def migrate_spec_record(record):
    """A format-2 spec record in format 3: fields renamed, ``hint`` to the kind's own field, and the
    fields the kind does not use dropped where they hold their default (False or 0; a set one is left
    for the validation to refuse). Anything malformed is returned as it is for the validation to report."""
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return record
    kind = record["kind"]
    out = {}
    for name, value in record.items():
        if name == "hint":
            name = _HINT_FIELD.get(kind, "hint")
        name = _RENAMED.get(name, name)
        out[name] = value
    used = {f.name for f in fields_of(kind)}
    defaults = {f.name: f.default for f in dataclasses.fields(KernelSpec)}
    defaults["hint"] = 0  # a kind without a hint field of its own wrote hint: 0
    for name in list(out):
        if name not in used and name in defaults and type(out[name]) is type(defaults[name]) \
                and out[name] == defaults[name]:
            del out[name]
    for name in used - set(out):  # fields added after format 2 was written keep their default
        if name in _RENAMED.values() or name in _HINT_FIELD.values():
            out[name] = defaults[name]
    return out


def _migrate_entries(where, entries, fmt: int):
    """Format-1/2 entries as format 3 (see the module's notes). Where two format-1 keys become one (a
    fwd_v2 and a fwd_sm90 entry of one problem), the entry with the smaller time_ms is kept: both were
    timed at the key's problem shape. Anything malformed is left for the validation to report."""
    if not isinstance(entries, list):
        return entries
    out, index = [], {}
    for record in entries:
        if isinstance(record, dict):
            record = dict(record)
            for name in ("spec",):
                record[name] = migrate_spec_record(record.get(name))
            if isinstance(record.get("baseline"), dict):
                record["baseline"] = {**record["baseline"], "spec": migrate_spec_record(record["baseline"].get("spec"))}
            if isinstance(record.get("runners_up"), list):
                record["runners_up"] = [{**r, "spec": migrate_spec_record(r.get("spec"))} if isinstance(r, dict) else r
                                        for r in record["runners_up"]]
        key = record.get("key") if isinstance(record, dict) else None
        if fmt == 1 and isinstance(key, dict) and key.get("kind") in _FORMAT1_KINDS:
            record = {**record, "key": {**key, "kind": _FORMAT1_KINDS[key["kind"]]}}
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
        elif fmt >= 2 and isinstance(key, dict) and key.get("kind") in _FORMAT1_KINDS:
            raise ConfigError(where, f"key.kind {key['kind']!r} is a kernel family; since table format 2 the "
                                     f"forward's key kind is 'fwd' (its spec names the family)")
        out.append(record)
    return out


def migrate(path) -> Path:
    """Rewrite an older table at ``path`` in the current format (every entry and number kept)."""
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


class _Dumper:
    """safe_dump's Dumper without anchors and aliases (the reader refuses them); libyaml's emitter where
    PyYAML has it (the same text, about 3.5x faster on the shipped tables)."""

    @staticmethod
    def get():
        import yaml

        class Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):
            def ignore_aliases(self, data):
                return True
        return Dumper


def dump(table: Table) -> str:
    import yaml

    entries = []
    for key in sorted(table.entries, key=lambda k: (k.kind, k.arch, k.dtype, k.head_dim, k.causal, k.bucket,
                                                    k.variant)):
        entry = {"key": key_record(key), **_plain(table.entries[key])}
        entries.append(entry)
    return yaml.dump({"meta": {**table.meta, "format": FORMAT}, "entries": entries}, Dumper=_Dumper.get(),
                     sort_keys=False, default_flow_style=None, width=120)


def save(table: Table, path) -> Path:
    """Write ``table`` to ``path`` atomically (readers never see half a file); the file's mode follows
    the umask."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return files.atomic_write(path, dump(table).encode())


def check_writable(path, gpu: str) -> None:
    """``ConfigError`` unless ``path`` can take a table of ``gpu``: not a directory, its folder
    writable (or creatable), and an existing file a valid table of that GPU (so a tuning run learns
    it before the search, not after)."""
    path = Path(path)
    where = str(path)
    if path.is_dir():
        raise ConfigError(where, "is a directory; name a YAML file")
    if os.path.lexists(path):
        load(path, gpu=gpu)
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(where, f"cannot write there ({parent} is not a writable folder)")


def update(path, table: Table) -> Table:
    """Merge ``table`` into the one at ``path`` (if any) and write the result, under an exclusive lock
    on the folder: concurrent writers each merge into what the previous one wrote, so no entry is lost.
    Returns the merged table."""
    path = Path(path)
    with files.locked(path.parent):
        old = load(path, gpu=table.meta["gpu"]) if os.path.lexists(path) else None
        merged = merge(old, table)
        save(merged, path)
    return merged


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


# -- lookup (dispatch) --------------------------------------------------------
_cache: dict = {}
_lock = threading.Lock()


def tables(gpu: str) -> list:
    """[(origin, Table)] for ``gpu`` in lookup order; origin is 'user' or 'shipped'. A path that exists
    but is not a valid table (a directory, a FIFO, a dangling link, a bad file) is a ``ConfigError``."""
    with _lock:
        found = _cache.get(gpu)
        if found is None:
            found = []
            for origin, path in (("user", default_path(gpu)), ("shipped", shipped_path(gpu))):
                if os.path.lexists(path):
                    found.append((origin, load(path, gpu=gpu)))
            _cache[gpu] = found
        return found


# The problem kinds of the backward's tuned keys (the tuner's BWD_KEY_MODES).
BACKWARD_KEY_KINDS = ("bwd_dkdv", "bwd_dkdv_nodq", "bwd_dq")


def rule_baselined(key) -> bool:
    """Whether ``key``'s entries record dispatch's default rule as their baseline: a backward key, or an FP8
    forward key (the paper's tile is fwd_v2's, which takes no FP8 inputs); other keys record the paper rule."""
    return key.kind in BACKWARD_KEY_KINDS or variants.key_flags(key.variant)["fp8"]


def ranked(gpu: str, key) -> list:
    """[(origin, entry)] of every table that has ``key``, the one dispatch uses first: measured
    entries before model-ranked ones (unless ``FLASHGEN_PREFER_MODEL``), then the user's table before
    the shipped one."""
    hits = [(origin, table.entries[key]) for origin, table in tables(gpu) if key in table.entries]
    if settings.prefer_model():
        return hits
    return sorted(hits, key=lambda hit: hit[1]["source"] != "measured")  # stable: user first among equals


def lookup_entry(gpu: str, key):
    """(origin, entry) of the table entry dispatch uses for ``key`` (``ranked``), or None."""
    hits = ranked(gpu, key)
    return hits[0] if hits else None


def lookup(gpu: str, key):
    """The tuned spec for ``key`` on ``gpu``, or None."""
    hit = lookup_entry(gpu, key)
    return hit[1]["spec"] if hit else None


def clear() -> None:
    """Forget the tables read so far (dispatch.clear also forgets its cached picks)."""
    with _lock:
        _cache.clear()
