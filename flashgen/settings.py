"""Settings, read from environment variables with the ``FLASHGEN_`` prefix.

- ``FLASHGEN_HOME``: cache root (compiled kernels, user tuning results);
  default ``~/.cache/flashgen``.
- ``FLASHGEN_GPU``: GPU profile name to use instead of detecting it.
- ``FLASHGEN_LOG``: ``debug`` / ``info`` / ``warning`` (default ``warning``).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path


def home() -> Path:
    """The cache root; read on every call so tests can point it elsewhere."""
    return Path(os.environ.get("FLASHGEN_HOME") or Path.home() / ".cache" / "flashgen")


def gpu_override() -> str | None:
    value = os.environ.get("FLASHGEN_GPU")
    return value.strip().lower() if value else None


def logger() -> logging.Logger:
    log = logging.getLogger("flashgen")
    level = os.environ.get("FLASHGEN_LOG")
    if level:
        log.setLevel(level.upper())
    return log
