"""The torch layer's plan cache: what a call checked and prepared, kept per call signature.

A plan holds everything about a call that depends only on shapes, strides,
dtypes, devices and flags (the kernels, grids, packed parameter templates), so
that the per-call path is a dict lookup, the allocations, a few pointers and
the launch. Each entry point (attention, decode) keeps one ``PlanCache``;
``clear_all`` forgets every plan (``flashgen.testing.clear_caches``).
"""
from __future__ import annotations

_caches: dict = {}


class PlanCache(dict):
    """signature -> plan, bounded (a workload with ever-new shapes starts over rather than grow)."""

    LIMIT = 4096

    def __init__(self, name: str):
        super().__init__()
        if name in _caches:
            raise ValueError(f"a plan cache named {name!r} exists already")
        self.name = name
        _caches[name] = self

    def put(self, sig, plan) -> None:
        if sig is None:
            return
        if len(self) > self.LIMIT:
            self.clear()
        self[sig] = plan


def cache(name: str) -> PlanCache:
    """The plan cache of one entry point ("attention", "decode")."""
    if name not in _caches:
        raise ValueError(f"no plan cache {name!r}; known: {sorted(_caches)}")
    return _caches[name]


def clear_all() -> None:
    for c in _caches.values():
        c.clear()
