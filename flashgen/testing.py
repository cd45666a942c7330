"""What tests (and studies) need of flashgen's internals, as public names.

- ``clear_caches()``: forget the tuned tables read, dispatch's cached picks and every plan the torch
  layer keeps, so that a changed table, setting or monkeypatched rule takes effect;
- ``ENVIRONMENT``: every ``FLASHGEN_*`` variable flashgen reads (``flashgen.settings``), for a test
  harness to clear;
- ``plans(entry)``: the plan cache of ``"attention"`` or ``"decode"`` (to look at what a call planned).
"""
from __future__ import annotations

from . import dispatch, settings

ENVIRONMENT = tuple(settings.VARIABLES)


def clear_caches() -> None:
    dispatch.clear()
    try:
        import torch  # noqa: F401 -- the torch layer exists only with torch
    except ImportError:
        return
    from .api import plans

    plans.clear_all()


def plans(entry: str) -> dict:
    """The plan cache of one torch-layer entry point: "attention" or "decode" (signature -> plan)."""
    import flashgen.api  # noqa: F401 -- the entry points create their caches on import
    from .api import plans as plan_caches

    return plan_caches.cache(entry)
