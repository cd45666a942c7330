"""Tune on first use (opt-in): ``FLASHGEN_AUTOTUNE=1`` or ``flashgen.autotune(True)``.

When a call's plan is made for a problem key that neither the user's nor the shipped table has an entry
for, ``tuned_spec`` asks the first-use search (``dispatch.first_use_search``: the tuner's short measured
search, ``flashgen.tuner.autotune``) for a winner, which it has stored in the user's table; later calls
and processes read it from there like any tuned entry. The search is bounded by
``FLASHGEN_AUTOTUNE_BUDGET`` seconds and logged. It never runs while a CUDA graph is being captured or
torch.compile is tracing (the default rule serves that call, and the next plain call tunes), nor inside
another search (its own checks call ``attention``), nor for a GPU without a profile (no table to store
into). Whatever goes wrong in a search is logged and the call runs on the default rule. The search's
random inputs come from forked random streams: the caller's (CPU and the device's) are left as they were.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from .. import dispatch, settings, tables

_override: list = [None]  # flashgen.autotune(on): True/False; None: FLASHGEN_AUTOTUNE decides
_local = threading.local()
_refused: set = set()  # keys a search found nothing for in this process: not searched again


def enable(on: bool | None = True) -> None:
    """Turn tuning on first use on or off for this process; None: follow ``FLASHGEN_AUTOTUNE``."""
    if on is not None and type(on) is not bool:
        raise TypeError(f"autotune takes True, False or None, got {on!r}")
    _override[0] = on


def clear() -> None:
    """Forget ``enable``'s choice and the keys searched in vain (a new process's state; for tests)."""
    _override[0] = None
    _refused.clear()


def enabled() -> bool:
    return _override[0] if _override[0] is not None else settings.autotune()


def _tracing() -> str:
    """Why no search may run now ('' when one may)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "a CUDA graph is being captured"
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and getattr(compiler, "is_compiling", lambda: False)():
        return "torch.compile is tracing"
    return ""


class FirstUse:
    """What a first-use search is asked: the key, the call's shape (batch, heads, heads_kv, seqlen_q,
    seqlen_k, head_dim), the GPU profile name, the device index, the default rule's spec and the budget."""

    __slots__ = ("key", "shape", "gpu", "device_index", "default", "budget_s")

    def __init__(self, key, shape, gpu, device_index, default, budget_s):
        self.key, self.shape, self.gpu, self.device_index = key, shape, gpu, device_index
        self.default, self.budget_s = default, budget_s


def _name(key) -> str:
    return (f"{key.kind} {key.arch} {key.dtype} d{key.head_dim} {'causal' if key.causal else 'full'} "
            f"n{key.bucket}" + (f" {key.variant}" if key.variant else ""))


def tuned_spec(key, shape, dev, default):
    """The first-use search's winner for ``key`` (stored in the user's table by then), or None: tuning on
    first use is off, the key has a table entry, no search may run now, or the search found nothing."""
    if not enabled() or dev.gpu is None or key in _refused or getattr(_local, "searching", False):
        return None
    if tables.lookup(dev.gpu, key) is not None:
        return None
    why = _tracing()
    if why:
        settings.logger().info("flashgen autotune: %s not tuned now (%s); the default rule serves", _name(key),
                               why)
        return None
    search = dispatch.first_use_search()
    if search is None:
        return None
    request = FirstUse(key, tuple(shape), dev.gpu, dev.index, default, settings.autotune_budget())
    _local.searching = True
    try:
        on_gpu = torch.cuda.is_available()
        device = torch.cuda.device(dev.index) if on_gpu else contextlib.nullcontext()
        # fork_rng: the search's random inputs leave the caller's random streams where they were
        with device, torch.no_grad(), torch.random.fork_rng(devices=[dev.index] if on_gpu else []):
            spec = search(request)
    except Exception as exc:  # noqa: BLE001 -- a failed search must not fail the user's call
        settings.logger().warning("flashgen autotune: the search for %s failed (%s: %s); the default rule serves",
                                  _name(key), type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "")
        spec = None
    finally:
        _local.searching = False
    if spec is None:
        _refused.add(key)
        return None
    dispatch.clear()  # the user's table changed: later plans of this key read its new entry
    return spec
