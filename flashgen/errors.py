"""Exceptions raised by flashgen.

Input mistakes (wrong device, dtype, shape, stride) raise the built-in
``ValueError`` / ``TypeError`` with the offending value in the message; the
classes here cover what is specific to flashgen.
"""
from __future__ import annotations


class FlashgenError(Exception):
    """Base class of every flashgen-specific error."""


class UnsupportedError(FlashgenError):
    """A valid request that flashgen cannot serve (head dim, arch, dtype...)."""


class CompileError(FlashgenError):
    """NVRTC rejected a kernel. Carries the compiler log and the source path."""

    def __init__(self, message: str, log: str = "", source_path: str | None = None):
        self.log = log
        self.source_path = source_path
        text = message
        if source_path:
            text += f"\n  emitted source: {source_path}"
        if log:
            text += "\n" + log.strip()
        super().__init__(text)


class ConfigError(FlashgenError):
    """A bad tuning YAML file (or spec record): the path and what is wrong."""

    def __init__(self, path, reason: str):
        self.path = str(path) if path is not None else None
        self.reason = reason
        where = f"{self.path}: " if self.path else ""
        super().__init__(f"{where}{reason}")
