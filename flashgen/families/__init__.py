"""Kernel families: one module per family, behind this registry.

A family module owns everything about its kernels: which problems they serve
(arch, head dims), validation of their spec fields, the shared-memory formula,
the template context, the default tiles per GPU (``rule``), the tuning space and
how their arguments are packed for a launch (TMA descriptors included).
Dispatch, the tuner and the CLI ask the registry below; they never compare
kind strings themselves.

- ``fwd_sm90``, ``fwd_v2``: the forward ("fwd" problem), Hopper first;
- ``decode``: Flash-Decoding (``decode_split``, ``decode_combine``);
- ``bwd_sm90``, ``bwd``: the backward (``bwd_dkdv`` problem: Hopper first, then the mma.sync
  kernel; ``bwd_preprocess``, ``bwd_dkdv_nodq``, ``bwd_dq``, ``bwd_convert``);
- ``standard``, ``fwd_v1``: the study families (standard attention's three passes, FlashAttention V1).

Importing this package registers every kind with ``flashgen.spec``.
"""
from __future__ import annotations

import math

from ..errors import UnsupportedError
from ..problem import ProblemKey, bucket_of
from ..spec import KernelSpec, family_of, register_family
from . import bwd, bwd_sm90, decode, fwd_sm90, fwd_v1, fwd_v2, standard
from .base import Family, first_clean

# In preference order within each problem: the first family whose ``default_for`` holds for a key
# serves it by default; the last one that runs on the arch is the problem's fallback.
FAMILIES: dict[str, Family] = {}
for _fam in (fwd_sm90.FAMILY, fwd_v2.FAMILY, *decode.FAMILIES, bwd_sm90.FAMILY, *bwd.FAMILIES,
             *standard.FAMILIES, fwd_v1.FAMILY):
    register_family(_fam)
    FAMILIES[_fam.kind] = _fam

# Problem kind -> the kinds that serve it, in preference order.
PROBLEMS: dict[str, tuple] = {}
for _fam in FAMILIES.values():
    PROBLEMS[_fam.serves] = PROBLEMS.get(_fam.serves, ()) + (_fam.kind,)

# Problems whose fallback family the torch layer takes where the preferred one cannot serve a call
# (the backward: bwd_sm90's tensor maps cannot step every stride; the separate-dQ mode): their
# fallback's rule is reachable where another family is the default.
FALLBACK_REACHABLE = ("bwd_dkdv",)


def family(kind: str) -> Family:
    """The family of ``kind``; ``ValueError`` naming the known kinds otherwise."""
    return family_of(kind)


def problems() -> tuple:
    """Every problem kind a key (and a tuned table's entry) may have."""
    return tuple(PROBLEMS)


def serving(problem: str, arch: str) -> tuple:
    """The kinds that serve ``problem`` on ``arch``, in preference order (() when none does)."""
    return tuple(k for k in PROBLEMS.get(problem, ()) if FAMILIES[k].runs_on(arch))


def default_family(key: ProblemKey) -> str:
    """The kind the default rule uses for ``key``: the first serving family that takes it by
    default, else the last one that runs on the arch. ``UnsupportedError`` when none runs there."""
    kinds = serving(key.kind, key.arch)
    if not kinds:
        raise UnsupportedError(f"no kernel family serves {key.kind} on {key.arch}")
    return next((k for k in kinds if FAMILIES[k].default_for(key)), kinds[-1])


def problem_key(problem: str, arch: str, dtype: str, d: int, causal: bool, seqlen: int) -> ProblemKey:
    """The key of ``problem`` for an input head dim ``d`` and query length ``seqlen``: its head-dim
    tile and bucket."""
    kinds = PROBLEMS.get(problem)
    if not kinds:
        raise ValueError(f"unknown problem {problem!r}; known: {sorted(PROBLEMS)}")
    return ProblemKey(problem, arch, dtype, FAMILIES[kinds[0]].key_tile(d, arch), causal, bucket_of(seqlen))


def fallback_family(problem: str, arch: str) -> str:
    kinds = serving(problem, arch)
    if not kinds:
        raise UnsupportedError(f"no kernel family serves {problem} on {arch}")
    return kinds[-1]


def default_spec(key: ProblemKey, budget: int, check=None, family: str | None = None, **rule_args) -> KernelSpec:
    """The default rule's spec for ``key`` under ``budget`` bytes of shared memory per block.

    The family's rule lists tiles in order of preference; the first that fits is
    taken. With ``check`` (spec -> list of problems, e.g. dispatch.resource_problems)
    a fitting tile that ``check`` refuses is skipped for the next fitting one: a tile
    the device's NVRTC compiles spill-free may spill under another NVRTC version, and
    the rule's later tiles are the fallback. ``family`` takes that family's rule
    instead of the default family's (it must serve the key's problem).
    """
    kind = default_family(key) if family is None else family
    fam = FAMILIES.get(kind)
    if fam is None or fam.serves != key.kind:
        raise ValueError(f"{kind} does not serve {key.kind} (families: {PROBLEMS.get(key.kind, ())})")
    return first_clean(fam.rule(key, budget, **rule_args), check)


def rule_specs(arch: str, budget: int) -> list:
    """Every spec a default rule can give dispatch on ``arch`` under ``budget``: per family, its rule's
    first fitting tile at every key where it is the default family (or a reachable fallback) and some
    tile fits; the decode families' at every regime. For the compile tier and the cubin comparison."""
    out = []
    for fam in FAMILIES.values():
        if hasattr(fam, "rule_specs"):
            specs = fam.rule_specs(arch, budget) if fam.runs_on(arch) else []
        else:
            specs = []
            for key in fam.rule_keys(arch):
                if default_family(key) == fam.kind or (key.kind in FALLBACK_REACHABLE
                                                       and fallback_family(key.kind, arch) == fam.kind):
                    try:
                        specs.append(fam.rule(key, budget)[0])
                    except UnsupportedError:  # no tile of the rule fits this budget: nothing to pick
                        continue
        out += [s for s in dict.fromkeys(specs) if s not in out]  # (keys of one family may share a tile)
    return out


def paged_spec(spec, page_size: int, gather: bool = False):
    """The paged form of a forward spec; UnsupportedError for a family without paged K/V.

    K/V boxes of ``page_rows`` = gcd(page size, block_n) rows, the longest that stay inside one page.
    Where that gcd is below both the page and the tile (a block_n of 80 and pages of 64 get 16-row
    boxes), block_n drops to the largest multiple of 8 that the page divides or that divides the page.
    A persistent tile with several boxes per block runs one tile per CTA, where the producer warp
    issues the boxes one lane each (the persistent producer is one thread: on the H200 one thread's
    16-row boxes held the call at 0.77x the contiguous one, one lane each at 0.94x); a persistent tile of
    three consumer warpgroups always runs one tile per CTA (fwd_sm90 refuses it: its paged producer spills).

    ``gather=True``: the tile as it is, its rows gathered by the producer warpgroup (``kv_gather``,
    block-table entries in runs of gcd(page size, block_n) rows), one tile per CTA. Not the default: on
    the H200 it ran at about 0.5x the contiguous call at every page size (docs/perf/varlen.md)."""
    if spec.kind != "fwd_sm90":
        raise UnsupportedError(f"a paged K/V cache (block_table) runs on fwd_sm90 (sm_90a, head dims 64-256); this "
                               f"call's forward is {spec.kind}")
    block_n = spec.block_n
    if gather:
        return spec.replace(page_rows=math.gcd(page_size, block_n), kv_gather=True, persistent=False).validate()
    if math.gcd(page_size, block_n) < min(page_size, block_n):
        block_n = max(n for n in range(8, block_n + 1, 8) if page_size % n == 0 or n % page_size == 0)
    page_rows = math.gcd(page_size, block_n)
    persistent = spec.persistent and spec.block_m < 192 and page_rows == block_n
    return spec.replace(block_n=block_n, page_rows=page_rows, persistent=persistent,
                        kv_gather=False).validate()


__all__ = ["FAMILIES", "PROBLEMS", "Family", "family", "problems", "serving", "default_family", "fallback_family",
           "default_spec", "rule_specs", "paged_spec", "problem_key", "bwd", "bwd_sm90", "decode", "fwd_sm90", "fwd_v1", "fwd_v2", "standard"]
