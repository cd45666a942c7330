"""``flashgen bench``: named benchmark suites, one result format, a table, JSON and plots.

A suite is registered with ``register(Suite(...))`` (``fwd`` here; ``decode``
and ``bwd`` are added by their own modules the same way). It adds its options
to the ``bench`` parser and returns a result dict:

    {"suite": name, "meta": {...}, "convention": text, "metric": "tflops",
     "x": "seqlen", "panels": ["head_dim", "causal"], "impls": [names...],
     "rows": [{"head_dim": 64, "causal": false, "seqlen": 512, ...,
               "results": {impl: {"ms": .., "tflops": ..} | {"error": ..} | {"skipped": ..}}}]}

``x`` names the row field on the plots' x axis and ``panels`` the fields whose
values make one panel each; every suite's result can then be printed and
plotted by the same code (``flashgen.bench.report``). A cell that fails is
recorded with its reason and the run goes on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

SUITES: dict[str, "Suite"] = {}


@dataclass(frozen=True)
class Suite:
    name: str
    help: str
    add_args: Callable      # (argparse parser) -> None: the suite's own options
    run: Callable           # (argparse namespace, progress: Callable[[str], None]) -> result dict


def register(suite: Suite) -> Suite:
    if suite.name in SUITES:
        raise ValueError(f"bench suite {suite.name!r} is already registered")
    SUITES[suite.name] = suite
    return suite


def suites() -> dict[str, Suite]:
    """Every registered suite (importing the built-in ones first)."""
    from . import fwd  # noqa: F401 -- registers "fwd"

    return SUITES
