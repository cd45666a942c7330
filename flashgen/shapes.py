"""Shapes files: the problem keys a process dispatched, with the shapes it ran them at and how often.

    meta:     format, source ("record")
    entries:  - key:    {kind, arch, dtype, head_dim, causal, bucket[, variant]} (a tuned table's key)
                shape:  {batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim}
                count:  calls at that shape

``with flashgen.record("shapes.yaml"):`` (``record``) or ``FLASHGEN_RECORD=shapes.yaml`` (``from_environment``:
the file is written when the process exits) counts every call the torch layer makes by (key, shape): the
forward (``attention``: kind "fwd"; ``attention_varlen``: "fwd" with the "vl" variant token, batch = the
sequences, seqlen = the longest), the backward (the key kind of its main kernel: "bwd_dkdv" or
"bwd_dkdv_nodq"), and decode ("decode_split", seqlen_q = new tokens per sequence, seqlen_k = the cache's
capacity). ``flashgen tune --from shapes.yaml`` tunes those keys at those shapes.

Writing merges into an existing file under the lock ``flashgen.tables`` takes on the folder (counts of one
(key, shape) add up), atomically; reading uses the tables' loader (``tables.read_document``: a regular file
of at most ``MAX_BYTES``, UTF-8, ``yaml.safe_load``, no aliases) and validates every value, raising
``ConfigError(path, reason)``.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import threading
from pathlib import Path

from . import files, settings, tables
from .errors import ConfigError
from .problem import ProblemKey

FORMAT = 1
SHAPE_FIELDS = ("batch", "heads", "heads_kv", "seqlen_q", "seqlen_k", "head_dim")
# A shapes file holds one entry per (key, shape): far fewer than this many bytes.
MAX_BYTES = tables.MAX_BYTES
MAX_COUNT = 2**62  # a count is a number of calls: anything larger is not one

# The recorders taking notes now (the torch layer checks this list's truth on every call, so not
# recording costs one attribute read).
ACTIVE: list = []
_lock = threading.Lock()
_environment: dict = {}  # path -> the recorder FLASHGEN_RECORD started


def check_shape(shape) -> tuple:
    """``shape`` as a tuple of six positive ints (batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim), or
    ``ValueError``."""
    if not isinstance(shape, (tuple, list)) or len(shape) != len(SHAPE_FIELDS) \
            or any(type(x) is not int or x < 1 for x in shape):
        raise ValueError(f"a shape is six positive ints {SHAPE_FIELDS}, got {shape!r}")
    b, h, hk, _, _, _ = shape
    if h % hk:
        raise ValueError(f"heads ({h}) must be a multiple of heads_kv ({hk}), got {shape!r}")
    return tuple(shape)


class Recorder:
    """Counts of (ProblemKey, shape) for one shapes file; ``save`` merges them into it."""

    def __init__(self, path):
        self.path = Path(path)
        self.counts: dict = {}
        self._lock = threading.Lock()

    def note(self, key: ProblemKey, shape: tuple) -> None:
        item = (key, shape)
        with self._lock:
            self.counts[item] = self.counts.get(item, 0) + 1

    def save(self) -> Path:
        """Merge the counts into the file (under the folder's lock, atomically); they start over."""
        with self._lock:
            counts, self.counts = self.counts, {}
        return update(self.path, counts)


def note(key: ProblemKey, shape: tuple) -> None:
    """Count one call of ``key`` at ``shape`` in every active recorder."""
    for recorder in ACTIVE:
        recorder.note(key, shape)


def check_path(path) -> Path:
    """``path`` as a Path a shapes file can be written to: not a folder; an existing file must be a valid
    shapes file (so a run learns it before it starts, not when it ends). ``ConfigError`` otherwise."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ConfigError(None, f"a shapes file is a path, got {path!r}")
    path = Path(path)
    if path.is_dir():
        raise ConfigError(str(path), "is a directory; name a YAML file")
    if os.path.lexists(path):
        load(path)
    return path


@contextlib.contextmanager
def record(path):
    """Within the block, count the problem keys the torch layer dispatches (see the module notes); at its
    end, merge them into the shapes file at ``path``. Yields the ``Recorder``."""
    recorder = Recorder(check_path(path))
    with _lock:
        ACTIVE.append(recorder)
    try:
        yield recorder
    finally:
        with _lock:
            ACTIVE.remove(recorder)
        recorder.save()


def from_environment() -> None:
    """Start recording to ``FLASHGEN_RECORD`` (once per path per process; the file is written at exit)."""
    path = settings.record_path()
    if path is None or str(path) in _environment:
        return
    with _lock:
        if str(path) in _environment:
            return
        recorder = _environment[str(path)] = Recorder(check_path(path))
        ACTIVE.append(recorder)
    atexit.register(_save_at_exit, recorder)


def _save_at_exit(recorder: Recorder) -> None:
    try:
        recorder.save()
    except Exception as exc:  # noqa: BLE001 -- at exit: say why, never a traceback
        settings.logger().warning("flashgen: could not write the shapes file %s: %s", recorder.path, exc)


# -- the file -------------------------------------------------------------------------------------
def load(path) -> dict:
    """{(ProblemKey, shape): count} of the shapes file at ``path``, every value validated."""
    where = str(path)
    doc = tables.read_document(path)
    if not isinstance(doc, dict) or set(doc) != {"meta", "entries"}:
        raise ConfigError(where, "a shapes file is a mapping with exactly 'meta' and 'entries'")
    meta = doc["meta"]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("source") != "record" \
            or set(meta) != {"format", "source"}:
        raise ConfigError(where, f"meta must be {{format: {FORMAT}, source: record}}, got {meta!r}")
    entries = doc["entries"]
    if not isinstance(entries, list):
        raise ConfigError(where, "entries must be a list")
    out: dict = {}
    for i, record in enumerate(entries):
        at = f"{where}: entries[{i}]"
        if not isinstance(record, dict) or set(record) != {"key", "shape", "count"}:
            raise ConfigError(at, "an entry is a mapping with exactly key, shape and count")
        key = tables.parse_key(at, record["key"])
        shape = record["shape"]
        if not isinstance(shape, dict) or set(shape) != set(SHAPE_FIELDS):
            raise ConfigError(at, f"shape must be a mapping with exactly {list(SHAPE_FIELDS)}, got {shape!r}")
        try:
            shape = check_shape([shape[f] for f in SHAPE_FIELDS])
        except ValueError as exc:
            raise ConfigError(at, str(exc)) from None
        if shape[5] > key.head_dim or shape[5] % 8:
            raise ConfigError(at, f"shape head_dim {shape[5]} does not fit the key's head-dim tile {key.head_dim}")
        count = record["count"]
        if type(count) is not int or not 0 < count < MAX_COUNT:
            raise ConfigError(at, f"count must be a positive int, got {count!r}")
        if (key, shape) in out:
            raise ConfigError(at, "repeats an earlier entry's key and shape")
        out[(key, shape)] = count
    return out


def dump(counts: dict) -> str:
    import yaml

    entries = [{"key": tables.key_record(key), "shape": dict(zip(SHAPE_FIELDS, shape)), "count": n}
               for (key, shape), n in sorted(counts.items(), key=lambda kv: _order(kv[0]))]
    return yaml.safe_dump({"meta": {"format": FORMAT, "source": "record"}, "entries": entries}, sort_keys=False,
                          default_flow_style=None, width=120)


def _order(item):
    key, shape = item
    return (key.kind, key.arch, key.dtype, key.head_dim, key.causal, key.bucket, key.variant, shape)


def update(path, counts: dict) -> Path:
    """Add ``counts`` to the shapes file at ``path`` (created if missing) under the folder's lock, and
    write it atomically."""
    path = Path(path)
    with files.locked(path.parent):
        merged = load(path) if os.path.lexists(path) else {}
        for item, n in counts.items():
            merged[item] = min(MAX_COUNT - 1, merged.get(item, 0) + n)
        files.atomic_write(path, dump(merged).encode())
    return path


def by_key(counts: dict) -> dict:
    """{ProblemKey: (shape, calls)}: each key's most called shape (ties: the most tokens), with the key's
    calls over all its shapes."""
    out: dict = {}
    total: dict = {}
    for (key, shape), n in counts.items():
        total[key] = total.get(key, 0) + n
        best = out.get(key)
        if best is None or (n, shape[0] * shape[3]) > (counts[(key, best)], best[0] * best[3]):
            out[key] = shape
    return {key: (shape, total[key]) for key, shape in out.items()}
