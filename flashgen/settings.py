"""Settings: every environment variable flashgen reads, typed and documented. Nothing else reads the
environment.

Each is read when it is used (not at import), so a test or a study can change it
between calls. A value that cannot be read as its type is a ``ConfigError``
naming the variable, never a silent default.

| variable | type | meaning |
|---|---|---|
| ``FLASHGEN_HOME`` | path | cache root: compiled kernels in ``kernels/``, tuning results in ``configs/`` (default ``~/.cache/flashgen``) |
| ``FLASHGEN_GPU`` | name | GPU profile to use instead of detecting the device (``h200``, ``a100``, ...) |
| ``FLASHGEN_LOG`` | level | ``debug``, ``info``, ``warning`` (default ``warning``) |
| ``FLASHGEN_NO_COMPILE`` | flag | any cache miss raises ``CompileError`` instead of compiling (runs that must only use cached kernels) |
| ``FLASHGEN_ALLOW_SPILLS`` | flag | study only: load a kernel whose ptxas report shows spills (normally refused) |
| ``FLASHGEN_PREFER_MODEL`` | flag | a user table's entries ranked by the cost model win over measured shipped ones for the same key (normally a measured entry wins) |
| ``FLASHGEN_BWD_FAMILY`` | kind | force the backward's dK/dV family: ``bwd_dkdv`` (mma.sync) or ``bwd_sm90`` (Hopper, where it serves the call) |
| ``FLASHGEN_TILE_SECTION`` | int | study: fwd_sm90's (batch, head) pairs per tile section (``1``: one pair's m-blocks after another); read when a call's plan is made |
| ``FLASHGEN_PERSIST_CTAS`` | int | study and tests: cap a persistent fwd_sm90 grid at this many CTAs (more tiles each); read when a plan is made |
| ``FLASHGEN_TMA`` | name | the tensor-map encoder: ``ctypes`` (libcuda directly) or ``bindings`` (cuda.bindings); unset: ctypes, else bindings |
| ``FLASHGEN_COMMIT`` | text | the commit benchmarks record (a copy without .git, e.g. on a GPU host); unset: ``git rev-parse HEAD`` |
| ``FLASHGEN_RECORD`` | path | log the problem keys this process dispatches (shapes, counts) to this YAML file at exit (``flashgen.record``); read when a call's plan is made |
| ``FLASHGEN_AUTOTUNE`` | flag | the first call of a key with no tuned entry searches a few candidates on the GPU and stores the winner in the user's table (``flashgen.autotune``) |
| ``FLASHGEN_AUTOTUNE_BUDGET`` | seconds | the most one such search may take (default 30) |

A flag is on for any value but ``""``, ``0``, ``false``, ``no`` and ``off``. Two variables of CUDA's
are read (or set) here too: ``CUDA_VISIBLE_DEVICES`` (``visible_devices``: which GPU a tuning worker
takes) and ``CUDA_CACHE_DISABLE`` (``disable_cuda_compute_cache``).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from .errors import ConfigError

# name -> (type, one line): the table above, for the tests and the documentation.
VARIABLES = {
    "FLASHGEN_HOME": ("path", "cache root for compiled kernels and tuning results"),
    "FLASHGEN_GPU": ("name", "GPU profile to use instead of detecting the device"),
    "FLASHGEN_LOG": ("level", "log level: debug, info, warning"),
    "FLASHGEN_NO_COMPILE": ("flag", "a cache miss raises CompileError instead of compiling"),
    "FLASHGEN_ALLOW_SPILLS": ("flag", "study: load kernels whose ptxas report shows spills"),
    "FLASHGEN_PREFER_MODEL": ("flag", "model-ranked user entries win over measured shipped ones"),
    "FLASHGEN_BWD_FAMILY": ("kind", "force the backward's dK/dV family (bwd_dkdv or bwd_sm90)"),
    "FLASHGEN_TILE_SECTION": ("int", "study: fwd_sm90's (batch, head) pairs per tile section"),
    "FLASHGEN_PERSIST_CTAS": ("int", "study and tests: cap a persistent fwd_sm90 grid at this many CTAs"),
    "FLASHGEN_TMA": ("name", "tensor-map encoder: ctypes or bindings"),
    "FLASHGEN_COMMIT": ("text", "the commit benchmarks record"),
    "FLASHGEN_RECORD": ("path", "log the dispatched problem keys (shapes, counts) to this YAML file"),
    "FLASHGEN_AUTOTUNE": ("flag", "tune a key with no table entry on its first call (short measured search)"),
    "FLASHGEN_AUTOTUNE_BUDGET": ("seconds", "the most one first-use search may take (default 30)"),
}
_OFF = ("", "0", "false", "no", "off")


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    return value.strip() if value is not None else None


def _flag(name: str) -> bool:
    value = _raw(name)
    return value is not None and value.lower() not in _OFF


def _positive_int(name: str) -> int | None:
    value = _raw(name)
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ConfigError(None, f"{name}={value!r}: must be a positive whole number")
    return number


def home() -> Path:
    """The cache root; read on every call so tests can point it elsewhere."""
    return Path(_raw("FLASHGEN_HOME") or Path.home() / ".cache" / "flashgen")


def gpu_override() -> str | None:
    value = _raw("FLASHGEN_GPU")
    return value.lower() if value else None


def logger() -> logging.Logger:
    log = logging.getLogger("flashgen")
    level = _raw("FLASHGEN_LOG")
    if level:
        if level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError(None, f"FLASHGEN_LOG={level!r}: one of debug, info, warning, error")
        log.setLevel(level.upper())
    return log


def no_compile() -> bool:
    return _flag("FLASHGEN_NO_COMPILE")


def allow_spills() -> bool:
    return _flag("FLASHGEN_ALLOW_SPILLS")


def prefer_model() -> bool:
    return _flag("FLASHGEN_PREFER_MODEL")


def bwd_family() -> str | None:
    """The forced dK/dV family name, or None (the torch layer checks that it is one)."""
    return _raw("FLASHGEN_BWD_FAMILY") or None


def tile_section() -> int | None:
    return _positive_int("FLASHGEN_TILE_SECTION")


def persist_ctas() -> int | None:
    return _positive_int("FLASHGEN_PERSIST_CTAS")


def tma_backend() -> str:
    """"" (automatic), "ctypes" or "bindings"."""
    value = (_raw("FLASHGEN_TMA") or "").lower()
    if value not in ("", "ctypes", "bindings"):
        raise ConfigError(None, f"FLASHGEN_TMA={value!r}: ctypes or bindings")
    return value


def commit() -> str | None:
    return _raw("FLASHGEN_COMMIT") or None


def record_path() -> Path | None:
    """Where this process logs the problem keys it dispatches, or None (not recording)."""
    value = _raw("FLASHGEN_RECORD")
    return Path(value) if value else None


def autotune() -> bool:
    return _flag("FLASHGEN_AUTOTUNE")


AUTOTUNE_BUDGET_S = 30.0


def autotune_budget() -> float:
    """Seconds one first-use search may take (``FLASHGEN_AUTOTUNE_BUDGET``, default 30)."""
    value = _raw("FLASHGEN_AUTOTUNE_BUDGET")
    if not value:
        return AUTOTUNE_BUDGET_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ConfigError(None, f"FLASHGEN_AUTOTUNE_BUDGET={value!r}: must be a positive number of seconds")
    return seconds


def visible_devices() -> list:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (the GPUs this process may use), [] when it is unset."""
    return [d.strip() for d in (os.environ.get("CUDA_VISIBLE_DEVICES") or "").split(",") if d.strip()]


def child_environment(**overrides) -> dict:
    """This process's environment with ``overrides`` (name -> value): what a worker copy of the
    command starts with."""
    return {**os.environ, **overrides}


def toolchain_environment() -> dict:
    """What decides which NVRTC library this process loads: the Python prefix (pip's CUDA wheels) and the
    variables CuPy and the dynamic loader search by."""
    import sys

    return {"prefix": sys.prefix, **{v: os.environ.get(v, "") for v in ("LD_LIBRARY_PATH", "CUDA_PATH", "CUDA_HOME",
                                                                          "PATH")}}


def disable_cuda_compute_cache() -> None:
    """Turn off the CUDA compute cache for this process unless the caller set ``CUDA_CACHE_DISABLE``:
    NVRTC 13.0 returns a cubin it found there with an empty program log, and a binary without its ptxas
    resource report cannot be checked for spills (flashgen keeps a binary cache of its own)."""
    os.environ.setdefault("CUDA_CACHE_DISABLE", "1")
