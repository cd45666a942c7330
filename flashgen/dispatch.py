"""Problem key -> KernelSpec.

Order of lookup: the user's tuning results (``$FLASHGEN_HOME/configs/<gpu>.yaml``),
the table shipped in ``flashgen/generated/<gpu>.yaml``, then the default rule
below. Lookups are cached per key, so a call costs one dict access after the
first. Dispatch never imports Optuna.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .errors import UnsupportedError
from .families import MMA_HEAD_DIMS
from .spec import KernelSpec

# Seqlen buckets the tuner measures at; any length maps to the nearest one at or above it.
BUCKETS = (512, 1024, 2048, 4096, 8192, 16384)


def bucket_of(seqlen: int) -> int:
    for b in BUCKETS:
        if seqlen <= b:
            return b
    return BUCKETS[-1]


def head_dim_tile(d: int) -> int:
    """The kernel head-dim tile for an input head dim (multiple of 8, at most 256).

    ``UnsupportedError`` for any other head dim: the kernels load rows in
    8-element (16-byte) chunks, so a d of 12 must not map to the 32 tile.
    """
    if d < 8 or d % 8:
        raise UnsupportedError(f"head dim {d} is not supported (supported: multiples of 8 up to 256)")
    for tile in MMA_HEAD_DIMS:
        if d <= tile:
            return tile
    raise UnsupportedError(f"head dim {d} is not supported (supported: multiples of 8 up to 256)")


def sm90_head_dim_tile(d: int) -> int:
    """fwd_sm90's head-dim tile (64, 128 or 256: rows are whole 128-byte swizzle panels)."""
    head_dim_tile(d)  # same input rule (multiples of 8 up to 256)
    for tile in (64, 128, 256):
        if d <= tile:
            return tile
    raise UnsupportedError(f"head dim {d} is not supported (supported: multiples of 8 up to 256)")


def tile_for(kind: str, d: int) -> int:
    """The head-dim tile ``kind`` runs an input head dim ``d`` on."""
    return sm90_head_dim_tile(d) if kind == "fwd_sm90" else head_dim_tile(d)


@dataclass(frozen=True)
class ProblemKey:
    """What dispatch and the tuned tables key on.

    ``kind`` names the problem: ``"fwd"`` for the forward (any family in
    ``FORWARD_FAMILIES["fwd"]`` may serve it; ``head_dim`` is then the finest
    tile, ``head_dim_tile(d)``, and each family's spec has its own tile for it,
    ``spec_tile``), or the one family that serves every other problem
    (decode_*, bwd_*, standard_*, fwd_v1: kind = family name, as before).
    A key whose kind is a forward family's name (``fwd_v2``, ``fwd_sm90``) is
    the forward restricted to that family: dispatch gives its default rule, or
    the tuned "fwd" entry when that entry is of this family. Tables store
    "fwd" keys only. The backward's dK/dV problem works the same way
    (``BACKWARD_FAMILIES``): key kind "bwd_dkdv" (default family bwd_dkdv,
    bwd_sm90 beside it on sm_90a) or "bwd_sm90" (that family alone).
    """

    kind: str
    arch: str
    dtype: str
    head_dim: int      # the kernel's head-dim tile
    causal: bool
    bucket: int        # seqlen bucket of the query length


# Problem kinds served by several kernel families, in order of preference: the
# first is the default rule's family. fwd_sm90 stays opt-in (a tuned entry or
# spec=) until the tuner has measured both families per key on a Hopper GPU.
# Each family's arch limit is its Family.archs (fwd_sm90: sm_90a only).
FORWARD_FAMILIES = {"fwd": ("fwd_v2", "fwd_sm90")}
# The backward's dK/dV problem (with dQ into the fp32 accumulator): bwd_dkdv (mma.sync, every
# arch) or, on sm_90a, bwd_sm90 (TMA + wgmma). bwd_sm90 is opt-in until measured on the H200:
# a spec= / specs= override, or FLASHGEN_BWD_FAMILY=bwd_sm90 (flashgen.backward).
BACKWARD_FAMILIES = {"bwd_dkdv": ("bwd_dkdv", "bwd_sm90")}
PROBLEM_FAMILIES = {**FORWARD_FAMILIES, **BACKWARD_FAMILIES}
_FAMILY_PROBLEM = {f: kind for kind, fams in PROBLEM_FAMILIES.items() for f in fams}


def problem_kind(kind: str) -> str:
    """The problem a key kind asks for: "fwd" for a forward family's name, "bwd_dkdv" for bwd_sm90,
    else the kind itself."""
    return _FAMILY_PROBLEM.get(kind, kind)


def problem_kinds() -> tuple:
    """Every kind a tuned table's key may have: the multi-family problems and every other family."""
    from .families import FAMILIES

    return tuple(PROBLEM_FAMILIES) + tuple(k for k in FAMILIES if k not in _FAMILY_PROBLEM)


def families_for(kind: str, arch: str) -> tuple:
    """The families that serve key kind ``kind`` on ``arch``, default first (() when none does).

    "fwd": every family of FORWARD_FAMILIES["fwd"] that runs on ``arch``; a forward
    family's own name: that family alone (when it runs on ``arch``); any other kind: itself.
    """
    from .families import family

    fams = PROBLEM_FAMILIES.get(kind, (kind,))
    return tuple(f for f in fams if arch in family(f).archs)


def spec_tile(family_kind: str, key: "ProblemKey") -> int:
    """The head-dim tile a ``family_kind`` spec for ``key`` has (fwd_sm90 rounds up to 64/128/256)."""
    if family_kind == key.kind:
        return tile_for(family_kind, key.head_dim) if family_kind == "fwd_sm90" else key.head_dim
    return tile_for(family_kind, key.head_dim)


# The default rule: per head-dim tile, (block_m, block_n, warps, stages, refill,
# causal, arch) in order of preference, None meaning any; the first that fits
# the GPU's shared memory is used. Chosen from FA2's tiles and our H200
# sweeps (bench/NOTES.md), kept to tiles that compile without spills
# (tests/test_compile.py checks every one).
DEFAULT_TILES = {
    32: ((128, 64, 4, 2, 0, None, None), (64, 64, 4, 2, 0, None, None)),
    64: ((128, 64, 4, 2, 0, None, None), (64, 64, 4, 2, 0, None, None)),
    96: ((128, 64, 8, 2, 0, None, None), (64, 64, 4, 2, 0, None, None)),
    128: ((128, 64, 4, 2, 1, True, "sm_90a"), (128, 48, 4, 3, 0, False, "sm_90a"),
          (128, 32, 4, 3, 0, None, None), (64, 64, 4, 2, 0, None, None)),
    160: ((128, 64, 8, 2, 0, None, None), (64, 32, 4, 2, 0, None, None)),
    192: ((128, 64, 8, 2, 0, None, None), (64, 32, 4, 2, 0, None, None)),
    224: ((128, 64, 8, 2, 0, None, None), (64, 32, 4, 2, 0, None, None)),
    256: ((128, 64, 8, 2, 0, None, None), (64, 32, 4, 2, 0, None, None)),
}


# The backward kinds' default rule, same shape as DEFAULT_TILES: kind -> head-dim
# tile -> (block_m, block_n, warps, stages, refill, causal, arch) in order of
# preference. bwd_dkdv*: block_n keys per CTA, block_m queries per step;
# bwd_dq: block_m queries per CTA, block_n keys per step; bwd_preprocess and
# bwd_convert: block_m rows per CTA (one spec per head-dim tile, never causal).
# What a tuner should vary for `--kind bwd`: block_m, block_n, warps, stages of
# bwd_dkdv (the bulk of the time), bwd_dkdv_nodq + bwd_dq (deterministic mode);
# the row kernels are memory-bound and need no tuning.
# No 224 tile in the backward: with at most two warps along a 224-wide head dim
# (14 steps of 16) every split keeps >= 112 dK/dV accumulators per thread and
# spills; d in 193..256 runs on the 256 tile (bwd_head_dim_tile).
_BWD_DIMS = tuple(d for d in MMA_HEAD_DIMS if d != 224)
_BWD_ROW = {d: ((64, 64, 4, 2, 0, None, None),) for d in _BWD_DIMS}
BWD_TILES = {
    "bwd_preprocess": _BWD_ROW,
    "bwd_convert": _BWD_ROW,
    "bwd_dkdv": {
        # From bench/sweep_bwd.py on the H200 (bench/results/bwd2/round3): causal d=64 prefers the
        # smaller tile. At d=128 the sweep's winners, 32x128x8 non-causal and 128x64x8 causal (3-4 %
        # faster than 64x64x8 there), spilled under NVRTC 13.5 until bwd3's address tables; now
        # spill-free under 13.5 and 13.0 (bench/NOTES.md, bwd3). 128x64 does not fit sm_80's shared
        # memory; 64x64x8 stays as the fallback (shared memory or, with verify, spills).
        **{d: ((64, 64, 4, 2, 0, True, None), (64, 128, 8, 2, 0, None, None)) for d in (32, 64)},
        **{d: ((64, 64, 8, 2, 0, None, None),) for d in (96, 160)},
        128: ((32, 128, 8, 2, 0, False, None), (128, 64, 8, 2, 0, True, None), (64, 64, 8, 2, 0, None, None)),
        192: ((64, 32, 8, 2, 0, None, None),),
        256: ((64, 32, 8, 2, 0, None, None), (32, 64, 8, 2, 0, None, None)),  # the second fits sm_80
    },
    "bwd_dq": {
        **{d: ((64, 64, 8, 2, 0, None, None),) for d in (32, 64, 96, 128, 160)},
        **{d: ((64, 32, 8, 2, 0, None, None),) for d in (192, 256)},
    },
}
BWD_TILES["bwd_dkdv_nodq"] = BWD_TILES["bwd_dkdv"]

# How the non-deterministic backward computes dQ, per head-dim tile: "atomic"
# (bwd_dkdv adds dS K into an fp32 accumulator with red.global.add, then
# bwd_convert) or "separate" (bwd_dkdv_nodq + the query-outer bwd_dq kernel,
# the deterministic mode's kernels: two more GEMMs, no atomics). The first H200
# run (bench/NOTES.md) had the separate kernel 1.16-1.22x faster fwd+bwd at
# d=128 and 0.87-0.90x at d=64 (scalar atomics then); d=96 and 160 share
# d=128's 64x64x8 tile and follow it; the rest is unmeasured and stays atomic.
# bench/sweep_bwd.py measures both per tile.
BWD_DQ_MODES = ("atomic", "separate")
BWD_DQ_MODE = {d: ("separate" if d in (96, 160) else "atomic") for d in _BWD_DIMS}
# (d=128 measured atomic fastest once dQ used vector atomics and the tiles above: sweep round 3.)


def bwd_dq_mode(head_dim_tile: int) -> str:
    """The dQ mode of the non-deterministic backward for a head-dim tile (``BWD_DQ_MODE``)."""
    return BWD_DQ_MODE.get(head_dim_tile, "atomic")


# fwd_sm90's default rule (sm_90a only): head-dim tile -> (block_m, block_n,
# stages, warpspec, pingpong, overlap) in order of preference. From the first
# tuning over both forward families on the H200 (bench/results/s3tune, session 3):
# fwd_sm90 won all 24 bf16 keys; at N >= 2k the winners are 192x128 with warp
# specialization (d=64; 2 or 3 stages) and 128x128, 3 stages, warp specialization
# and softmax overlap (d=128, 7 of 12 keys; the rest within a few per cent).
# The second tile of each is the pre-tuning default (fits every sm_90a budget).
SM90_TILES = {
    64: ((192, 128, 3, True, False, False), (128, 128, 2, True, False, False)),
    128: ((128, 128, 3, True, False, True), (128, 128, 2, True, False, False)),
    256: ((128, 64, 2, True, False, False),),
}
# The forward's default family: fwd_sm90 on sm_90a when its head-dim tile pads
# the head dim by at most a third (64, 96-128, 192-256: it ran ~1.4-2x fwd_v2's
# speed at d=64/128, so a third more work still wins); fwd_v2 elsewhere (d=32,
# d=160 on the 256 tile, every other arch).
SM90_MAX_PAD = 4 / 3


def default_forward_family(arch: str, head_dim: int) -> str:
    """The family the "fwd" default rule uses on ``arch`` for an input head dim."""
    if arch == "sm_90a" and head_dim >= 64 and sm90_head_dim_tile(head_dim) <= SM90_MAX_PAD * head_dim:
        return "fwd_sm90"
    return "fwd_v2"


BWD_KINDS = tuple(BWD_TILES)

# bwd_sm90's default rule (sm_90a only): head-dim tile -> (block_n, stages, hint) in order of
# preference; block_m is 64 and warps = 4 (block_n / 64 + 1). FA3's shape: two consumer
# warpgroups of 64 keys and a producer. hint 0: dQ added by the TMA's reduce-add from a staging
# tile (bwd_families.DQ_WRITES). d=64 takes a 3-stage Q/dO ring (shared memory to spare, one CTA
# per SM either way); d=128 two (three fit: 231936 + 64 B of 232448, measured as a variant).
BWD_SM90_TILES = {
    64: ((128, 3, 0), (128, 2, 0)),
    128: ((128, 2, 0),),
}
# Kinds whose default rule lives in flashgen/baseline_specs.py (standard attention's passes, fwd_v1).
BASELINE_KINDS = ("standard_qk", "standard_softmax", "standard_pv", "fwd_v1")


def bwd_head_dim_tile(d: int) -> int:
    """The backward kernels' head-dim tile for an input head dim (``head_dim_tile``, 224 -> 256)."""
    tile = head_dim_tile(d)
    return 256 if tile == 224 else tile


def resource_problems(spec: KernelSpec) -> list:
    """Why the local NVRTC's binary of ``spec`` would be refused (spills, stack...); [] when it is clean.

    Compiles ``spec`` (disk-cached, so once per machine and toolchain). A build
    that fails outright is not a resource problem: it is left to ``load`` to report.
    """
    from .codegen import build
    from .errors import CompileError

    try:
        return build(spec).report.problems()
    except CompileError:
        return []


def _first_clean(candidates, check):
    """The first of ``candidates`` (in the rule's order) that ``check`` finds no problem with.

    A refused candidate is skipped with a debug log; the last one is returned
    unchecked (nothing is left to fall back to: ``load`` reports its problems).
    """
    for i, spec in enumerate(candidates):
        if check is None or i == len(candidates) - 1:
            return spec
        problems = check(spec)
        if not problems:
            return spec
        from .settings import logger

        logger().debug("dispatch: skipping %s (%s) for the next tile of the rule", spec.name, "; ".join(problems))
    raise AssertionError("unreachable")


def default_backward_family(arch: str, d_tile: int) -> str:
    """The family the "bwd_dkdv" default rule uses: bwd_sm90 on sm_90a for the head-dim tiles it has
    (measured 1.6-1.9x bwd_dkdv's backward at d=64/128 on the H200, bench/results/bwd90), else bwd_dkdv."""
    return "bwd_sm90" if arch == "sm_90a" and d_tile in BWD_SM90_TILES else "bwd_dkdv"


def default_spec(key: ProblemKey, smem_budget: int, check=None, family: str | None = None) -> KernelSpec:
    """The default rule's spec for ``key`` under ``smem_budget`` bytes per block.

    The rule lists tiles in order of preference; the first that fits the shared
    memory is taken. With ``check`` (spec -> list of problems, e.g.
    ``resource_problems``), a fitting tile that ``check`` refuses is skipped for
    the next fitting one: a tile the device's NVRTC compiles spill-free may spill
    under another NVRTC version, and the rule's later tiles are the fallback.
    ``family`` (a problem key only) takes that family's rule instead of the
    problem's default family -- "bwd_dkdv" names both a problem and a family.
    """
    if key.kind in PROBLEM_FAMILIES:  # the problem's default family
        if family is None:
            family = (default_forward_family(key.arch, key.head_dim) if key.kind == "fwd" else
                      default_backward_family(key.arch, key.head_dim))
        elif family not in PROBLEM_FAMILIES[key.kind]:
            raise ValueError(f"{family} does not serve {key.kind} (families: {PROBLEM_FAMILIES[key.kind]})")
        if family != key.kind:  # (family == kind: bwd_dkdv's own BWD_TILES rule below)
            key = ProblemKey(family, key.arch, key.dtype, key.head_dim, key.causal, key.bucket)
    if key.kind == "bwd_sm90":
        if key.arch != "sm_90a":
            raise UnsupportedError(f"bwd_sm90 (wgmma + TMA) needs an sm_90a GPU (H100/H200), not {key.arch}")
        if key.head_dim not in BWD_SM90_TILES:
            raise UnsupportedError(f"bwd_sm90 has no head-dim tile {key.head_dim} (it serves "
                                   f"{sorted(BWD_SM90_TILES)})")
        fitting = []
        for bn, st, hint in BWD_SM90_TILES[key.head_dim]:
            spec = KernelSpec(kind="bwd_sm90", arch=key.arch, dtype=key.dtype, head_dim=key.head_dim, block_m=64,
                              block_n=bn, warps=4 * (bn // 64 + 1), stages=st, hint=hint, causal=key.causal)
            if spec.validate().smem_bytes() <= smem_budget:
                fitting.append(spec)
        if fitting:
            return _first_clean(fitting, check)
        raise UnsupportedError(f"no default bwd_sm90 tile fits {smem_budget} B of shared memory for d={key.head_dim}")
    if key.kind == "fwd_sm90":
        if key.arch != "sm_90a":
            raise UnsupportedError(f"fwd_sm90 (wgmma + TMA) needs an sm_90a GPU (H100/H200), not {key.arch}")
        d = spec_tile("fwd_sm90", key)
        if d not in SM90_TILES:
            raise UnsupportedError(f"fwd_sm90 has no head-dim tile {key.head_dim} (see sm90_head_dim_tile)")
        fitting = []
        for bm, bn, st, ws, pp, ov in SM90_TILES[d]:
            spec = KernelSpec(kind="fwd_sm90", arch=key.arch, dtype=key.dtype, head_dim=d, block_m=bm,
                              block_n=bn, warps=4 * (bm // 64 + ws), stages=st, warpspec=ws, pingpong=pp,
                              overlap=ov, causal=key.causal)
            if spec.validate().smem_bytes() <= smem_budget:
                fitting.append(spec)
        if fitting:
            return _first_clean(fitting, check)
        raise UnsupportedError(f"no default fwd_sm90 tile fits {smem_budget} B of shared memory for d={d}")
    if key.kind in BASELINE_KINDS:  # the baselines (standard attention's passes, fwd_v1) have their own rules
        from .baseline_specs import default_spec as baseline_default

        return baseline_default(key, smem_budget)
    if key.kind in BWD_TILES and key.head_dim not in BWD_TILES[key.kind]:
        raise UnsupportedError(f"{key.kind} has no head-dim tile {key.head_dim} (see bwd_head_dim_tile: "
                               f"{sorted(BWD_TILES[key.kind])})")
    tiles = BWD_TILES[key.kind][key.head_dim] if key.kind in BWD_TILES else DEFAULT_TILES[key.head_dim]
    row_kernel = key.kind in ("bwd_preprocess", "bwd_convert")  # no causal variant
    fitting = []
    for bm, bn, w, st, refill, causal, arch in tiles:
        if (causal is not None and causal != key.causal) or (arch is not None and arch != key.arch):
            continue
        spec = KernelSpec(kind=key.kind, arch=key.arch, dtype=key.dtype, head_dim=key.head_dim, block_m=bm,
                          block_n=bn, warps=w, stages=st, refill=refill, causal=key.causal and not row_kernel)
        if spec.validate().smem_bytes() <= smem_budget and spec not in fitting:
            fitting.append(spec)
    if fitting:
        return _first_clean(fitting, check)
    raise UnsupportedError(f"no default {key.kind} tile fits {smem_budget} B of shared memory for d={key.head_dim}")


def default_specs(arch: str, smem_budget: int, kind: str = "fwd"):
    """Every spec the default rule can pick for ``arch`` (for the compile tests)."""
    out = []
    if not families_for(kind, arch):
        return out
    dims = (BWD_TILES[kind] if kind in BWD_TILES else SM90_TILES if kind == "fwd_sm90" else
            BWD_SM90_TILES if kind == "bwd_sm90" else MMA_HEAD_DIMS)
    for d in dims:
        for dtype in ("fp16", "bf16"):
            for causal in (False, True):
                spec = default_spec(ProblemKey(kind, arch, dtype, d, causal, BUCKETS[0]), smem_budget)
                if spec not in out:  # the row kernels have one spec for both causal keys
                    out.append(spec)
    return out


@functools.lru_cache(maxsize=4096)
def select(key: ProblemKey, gpu: str | None, smem_budget: int, verify: bool = False) -> KernelSpec:
    """The spec for ``key`` on GPU profile ``gpu`` (None: unknown GPU, default rule only).

    ``verify`` (the launch paths pass True): a tuned table's spec, and each tile
    of the default rule, whose binary the local NVRTC would refuse
    (``resource_problems``) is skipped — the table's for the default rule, a
    rule's tile for its next one. The decision is cached with the key, so once
    per process.
    """
    if gpu is not None:
        from .tables import lookup  # tuned YAML tables (user's, then shipped)

        problem = key if problem_kind(key.kind) == key.kind else ProblemKey(
            problem_kind(key.kind), key.arch, key.dtype, key.head_dim, key.causal, key.bucket)
        spec = lookup(gpu, problem)
        if spec is not None:
            serving = families_for(key.kind, key.arch)
            if spec.kind in serving:
                problems = resource_problems(spec) if verify else []
                if not problems:
                    return spec
                # Tuned with another NVRTC, this tile spills here (the 255-register cliff):
                # the default rule, checked the same way, serves instead of a refused load.
                from .settings import logger

                logger().warning("dispatch: the tuned %s entry %s is refused by this NVRTC (%s); using the "
                                 "default rule", gpu, spec.name, "; ".join(problems))
            elif problem is key:  # the store refuses such entries; never launch one
                raise UnsupportedError(f"the tuned {gpu} table's entry for {key} is a {spec.kind} kernel, which "
                                       f"does not serve {key.kind} on {key.arch} (families here: {serving})")
            # a family-restricted key (fwd_v2, fwd_sm90) and an entry of another family: that family's rule
    return default_spec(key, smem_budget, check=resource_problems if verify else None)


def select_family(key: ProblemKey, family: str, gpu: str | None, smem_budget: int, verify: bool = False):
    """``select(key)`` restricted to one family of a problem key: the tuned or default pick when it is
    of ``family``, else ``family``'s default rule (e.g. the mma.sync backward where bwd_sm90 cannot run)."""
    spec = select(key, gpu, smem_budget, verify)
    if spec.kind == family:
        return spec
    return default_spec(key, smem_budget, check=resource_problems if verify else None, family=family)
