"""Tuned tables: the user's results, then the ones shipped with flashgen.

``lookup(gpu, key)`` asks ``$FLASHGEN_HOME/configs/<gpu>.yaml`` (written by
``flashgen tune``) first, then ``flashgen/generated/<gpu>.yaml``; None when
neither has the key (dispatch then uses its default rule). Each file is read
and validated once per process (``clear()`` forgets them, e.g. after tuning).
A broken or foreign file raises ``ConfigError`` with its path: never a silent
fallback to another table.
"""
from __future__ import annotations

import threading

_cache: dict = {}
_lock = threading.Lock()


def tables(gpu: str) -> list:
    """[(origin, Table)] for ``gpu`` in lookup order; origin is 'user' or 'shipped'."""
    with _lock:
        found = _cache.get(gpu)
        if found is None:
            from .tuner import store

            found = []
            for origin, path in (("user", store.default_path(gpu)), ("shipped", store.shipped_path(gpu))):
                if path.is_file():
                    found.append((origin, store.load(path, gpu=gpu)))
            _cache[gpu] = found
        return found


def lookup(gpu: str, key):
    """The tuned spec for ``key`` on ``gpu``, or None."""
    hit = lookup_entry(gpu, key)
    return hit[1]["spec"] if hit else None


def lookup_entry(gpu: str, key):
    """(origin, entry) of the first table that has ``key``, or None."""
    for origin, table in tables(gpu):
        entry = table.entries.get(key)
        if entry is not None:
            return origin, entry
    return None


def clear() -> None:
    """Forget the tables read so far (and dispatch's cached picks)."""
    from . import dispatch

    with _lock:
        _cache.clear()
    dispatch.select.cache_clear()
