"""Tuned tables: the user's results, then the ones shipped with flashgen.

Filled in by the tuner (``flashgen tune``); until a table exists for a GPU,
``lookup`` finds nothing and dispatch uses the default rule.
"""
from __future__ import annotations


def lookup(gpu: str, key):
    """The tuned spec for ``key`` on ``gpu``, or None."""
    return None
