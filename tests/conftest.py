"""Shared fixtures for the whole suite.

Every test gets its own, empty ``FLASHGEN_HOME`` so that no test reads or
writes the user's kernel cache or tuning results, and no test depends on
another's cache entries. The other ``FLASHGEN_*`` settings are cleared so the
caller's environment cannot change what a test sees.

Nothing GPU-specific is registered here: GPU tests (tests/test_gpu_*.py) mark
themselves with ``pytest.mark.gpu`` and skip themselves without CUDA.
"""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def flashgen_home(tmp_path, monkeypatch):
    """A private, empty FLASHGEN_HOME for one test; returns its path."""
    home = tmp_path / "flashgen_home"
    monkeypatch.setenv("FLASHGEN_HOME", str(home))
    for var in ("FLASHGEN_GPU", "FLASHGEN_LOG", "FLASHGEN_NO_COMPILE", "FLASHGEN_ALLOW_SPILLS"):
        monkeypatch.delenv(var, raising=False)
    return home
