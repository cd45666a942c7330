"""The suite registry: ``Suite`` and ``register`` (re-exported by ``flashgen.bench``, which imports the
built-in suites; a suite module imports this one, so the package and its suites form no import cycle)."""
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
