"""Problem key -> KernelSpec.

Order of lookup: the user's tuned table (``$FLASHGEN_HOME/configs/<gpu>.yaml``),
the table shipped in ``flashgen/generated/<gpu>.yaml`` (both through
``flashgen.tables``), then the default rule of the key's family
(``flashgen.families``). A table entry that only confirmed the default rule of its
day gives way to the rule once the rule picks another tile (``superseded_by``).
Decisions are cached per key, so a call costs one dict access after the first.
Dispatch never imports Optuna.
"""
from __future__ import annotations

import functools
import math

from . import families, mods, tables, variants
from .codegen import build
from .errors import CompileError, UnsupportedError
from .families.base import first_clean
from .families.bwd_sm90 import WRITER_DQ
from .problem import ProblemKey
from .settings import logger
from .spec import KernelSpec


def resource_problems(spec: KernelSpec) -> list:
    """Why the local NVRTC's binary of ``spec`` would be refused (spills, stack...); [] when it is clean.

    Compiles ``spec`` (disk-cached, so once per machine and toolchain). A build
    that fails outright is not a resource problem: it is left to ``load`` to report.
    """
    try:
        return build(spec).report.problems()
    except CompileError:
        return []


@functools.lru_cache(maxsize=4096)
def select(key: ProblemKey, gpu: str | None, smem_budget: int, verify: bool = False, family: str | None = None,
           regime: str | None = None) -> KernelSpec:
    """The spec for ``key`` on GPU profile ``gpu`` (None: unknown GPU, default rule only).

    ``family`` restricts the pick to one family serving the key's problem: a tuned entry of
    another family gives way to ``family``'s default rule. ``regime`` is the decode rule's
    case (``families.decode.decode_regime``); other rules take none. ``verify`` (the launch
    paths pass True): a tuned table's spec, and each tile of the default rule, whose binary
    the local NVRTC would refuse (``resource_problems``) is skipped -- the table's for the
    default rule, a rule's tile for its next one. The decision is cached with the key, so once
    per process.
    """
    if family is not None and family not in families.serving(key.kind, key.arch):
        raise UnsupportedError(f"{family} does not serve {key.kind} on {key.arch} "
                               f"(families there: {', '.join(families.serving(key.kind, key.arch)) or 'none'})")
    check = resource_problems if verify else None
    if gpu is not None:
        spec = _tuned(gpu, key, smem_budget)
        if spec is None and key.variant:
            # A variant the table has no entry for runs on the tile tuned for its plain problem, where
            # the variant takes that tile (FP8 takes none of bf16's 192-row or lean-softmax tiles);
            # otherwise the default rule, which knows the variant's tiles.
            plain = _tuned(gpu, key.replace(variant=""), smem_budget)
            try:
                spec = plain.with_tokens(key.variant).validate() if plain is not None else None
            except (TypeError, ValueError):
                spec = None
        if spec is not None and (family is None or spec.kind == family):
            if spec.kind not in families.serving(key.kind, key.arch):  # the table refuses such entries
                raise UnsupportedError(f"the tuned {gpu} table's entry for {key} is a {spec.kind} kernel, which "
                                       f"does not serve {key.kind} on {key.arch}")
            problems = check(spec) if check else []
            if not problems:
                return with_bias_gemm(spec, smem_budget, check)
            # Tuned with another NVRTC, this tile spills here (the 255-register cliff): the default
            # rule, checked the same way, serves instead of a refused load.
            logger().warning("dispatch: the tuned %s entry %s is refused by this NVRTC (%s); using the "
                             "default rule", gpu, spec.name, "; ".join(problems))
    rule_args = {} if regime is None else {"regime": regime}
    return with_bias_gemm(families.default_spec(key, smem_budget, check=check, family=family, **rule_args),
                          smem_budget, check)


def with_bias_gemm(spec: KernelSpec, smem_budget: int, check=None) -> KernelSpec:
    """``spec`` with a linear bias's column part in S's GEMM (KernelSpec.bias_gemm: causal ALiBi, a linear
    score_mod) where its family takes that for it, it fits ``smem_budget`` and ``check`` (as ``select``'s)
    finds nothing wrong with it; else ``spec``. The softmax then adds nothing per score: causal ALiBi 8k on an
    H100, the same tile with it and without in two runs, 0.745 -> 0.786x the plain kernel at d = 64, 0.824 ->
    0.864x at d = 128 (docs/perf/variants.md)."""
    if spec.bias_gemm or not (spec.alibi or spec.mod):
        return spec
    try:
        bias = spec.replace(bias_gemm=True).validate()
    except ValueError:  # another kind, fp8, no linear bias (a window, a softcap, a score_mod of another form)
        return spec
    if bias.smem_total() > smem_budget or (check is not None and check(bias)):
        return spec
    return bias


def _tuned(gpu: str, key: ProblemKey, smem_budget: int) -> KernelSpec | None:
    """The tuned tables' spec for ``key``, None where they have none or theirs is superseded (``superseded_by``)."""
    hit = tables.lookup_entry(gpu, key)
    return hit[1]["spec"] if hit is not None and superseded_by(key, hit[1], smem_budget) is None else None


# A tuned winner that beat the rule of its day by less than this did so inside the tuner's own noise (its
# screening's 1-2 % on the H200: tuner.objective.MeasuredObjective.confirm): such an entry confirmed that rule too.
CONFIRMED_WITHIN = 1.02


def superseded_by(key: ProblemKey, entry: dict, smem_budget: int) -> KernelSpec | None:
    """The default rule's pick where a tuned ``entry`` for ``key`` only confirmed the rule of its day, else
    None: the key's baseline is the default rule (``tables.rule_baselined``: the backward's keys, FP8
    forwards), the tuner's winner was that baseline or beat it by less than CONFIRMED_WITHIN, and the rule
    picks another tile now, one the entry was not measured against (not its baseline or a runner-up). Such an
    entry says that the old rule was the best of the space searched then, give or take the noise; the rule
    moved since on a measurement against it, so the rule of now serves until a re-tune decides. (The
    shipped H200 table's backward keys were tuned before the dQ writer, the 128-query step and dq_early
    existed: 13 of its 16 entries are the rule of then, 3 more beat it by 0.4-1.0 %.)"""
    if not tables.rule_baselined(key) or entry.get("baseline") is None:
        return None
    if entry["baseline"]["spec"] != entry["spec"] and entry.get("speedup", math.inf) >= CONFIRMED_WITHIN:
        return None
    try:
        rule = families.default_spec(key, smem_budget)
    except UnsupportedError:
        return None
    if rule in {entry["spec"], entry["baseline"]["spec"]} | {r["spec"] for r in entry.get("runners_up", ())}:
        return None
    return rule


def mod_spec(key: ProblemKey, gpu: str | None, smem_budget: int, token: int, verify: bool = False,
             family: str | None = None, row_bounds: bool | str = False) -> KernelSpec:
    """The kernel of a call with user mods (flashgen.mods; ``token`` the pair's number, KernelSpec.mod):
    the tuned table's entry for the mods' own key (variant "mod<token>", non-causal: ``flashgen tune
    --score-mod/--mask-mod``) where it is a ``family`` kernel that builds clean here; else ``key``'s tile in
    ``family`` (``mod_family``'s by default: fwd_sm90 where it is the default, else fwd_v2): the plain
    key's entry, or the causal key's for a mask that skips much of the square, with the mods' own causal
    flag off. Then the rule's tiles in order where the
    mods' kernel spills (a mod's functions take registers: captured reads, indices; three consumer
    warpgroups keep 160 each), then those tiles with 64-key blocks (half the score registers: a 4-D
    capture's reads spill the d = 64 tiles of 128 keys). ``verify``: the resource check, as ``select``.
    ``row_bounds``: the mask_mod's partial blocks masked by each row's bounds (KernelSpec.row_bounds: a block
    mask whose rows each see one run of keys): where the mask_mod reads a captured tensor per score
    (``mask_loads_per_score``) every tile with them first, then the same without; a mask of index compares alone
    takes them only on a tile where they build clean, each tile with them and then without (on one tile they gain
    a few per cent over such a mask_mod; the 192-row tile, where they spill, is about ten per cent faster than the
    next clean one). ``row_bounds="first"``: the bounds first on every tile whatever the mask reads (tests and
    benchmarks that force the bounds' kernel)."""
    family = family or mod_family(key)
    if gpu is not None:  # the mods' own tuned entry (``flashgen tune --score-mod/--mask-mod``), keyed by their hash
        own = tables.lookup(gpu, key.replace(causal=False, variant=variants.mod_key(token)))
        if own is not None and own.kind == family:
            for mine in _bounds_first(_bias_gemm_first([own], smem_budget), row_bounds, True):
                if not (verify and resource_problems(mine)):
                    return mine
    picked = select(key, gpu, smem_budget, verify=verify, family=family)
    rule = [s for s in families.family(family).rule(key, smem_budget) if s != picked]
    narrow = [s.replace(block_n=64) for s in [picked] + rule if s.block_n > 64]
    tiles = list(dict.fromkeys(s.replace(causal=False, mod=token) for s in [picked] + rule + narrow))
    anywhere = row_bounds == "first" or (row_bounds and mask_loads_per_score(mods.lookup(mods.token_text(token))))
    return first_clean(_bounds_first(_bias_gemm_first(tiles, smem_budget), row_bounds, anywhere),
                       resource_problems if verify else None)


def _bias_gemm_first(specs: list, smem_budget: int) -> list:
    """Each of ``specs`` with KernelSpec.bias_gemm where its score_mod has the linear form (``with_bias_gemm``),
    then as it is (the bias's tile or registers can make a tile spill)."""
    out = []
    for spec in specs:
        bias = with_bias_gemm(spec, smem_budget)
        out += [bias, spec] if bias is not spec else [spec]
    return out


def _bounds_first(specs: list, row_bounds: bool, anywhere: bool) -> list:
    """Mods kernels in order, validated: with ``row_bounds`` and ``anywhere``, each with KernelSpec.row_bounds
    first (they pay most where the mask_mod reads memory: a document mask's forward 1.6x), then the same
    without (the bounds' registers can make a tile spill where the mask_mod's does not); with ``row_bounds``
    alone, each tile with them and then without, so that the bounds never cost the tile."""
    if not row_bounds:
        return [s.validate() for s in specs]
    if anywhere:
        return [s.validate() for s in [s.replace(row_bounds=True) for s in specs] + specs]
    return [t.validate() for s in specs for t in (s.replace(row_bounds=True), s)]


def mask_loads_per_score(pair) -> bool:
    """Whether a pair's mask_mod reads a captured tensor at an index that depends on q or kv (document ids): the
    kernel then loads per score of a partial block (260 LDG in the d = 128 128 x 128 tile), which the row bounds
    replace, paying for a later tile in the forward and for a load per score in the backward. Reads at constant or
    per-(batch, head) indices (an offset read as ``off[0]``, a length per batch) are made once per head
    (``Graph.cuda_hoisted``), so such a mask is index compares, as causal and windows written with constants are:
    there the bounds gain a few per cent on one tile (docs/perf/mods.md)."""
    return pair.mask is not None and pair.mask.loads_per_score()


def mod_decode_spec(key: ProblemKey, gpu: str | None, smem_budget: int, token: int, regime: str,
                    verify: bool = False) -> KernelSpec:
    """The decode_split kernel of a decode call with user mods: ``key``'s (a plain decode key) pick for
    ``regime`` with the pair's token, then the rule's other tiles where a mod's functions make it spill.
    ``verify``: the resource check, as ``select``."""
    picked = select(key, gpu, smem_budget, verify=verify, regime=regime)
    rule = families.family(key.kind).rule(key, smem_budget, regime=regime)
    candidates = []
    for s in [picked] + rule:
        s = s.replace(mod=token)
        if s not in candidates:
            candidates.append(s.validate())
    return first_clean(candidates, resource_problems if verify else None)


# The forward families that take user mods, in preference order.
MOD_FAMILIES = ("fwd_sm90", "fwd_v2")


def mod_family(key: ProblemKey) -> str:
    """The forward family a call with mods runs on for ``key``: the default one where it takes mods (fwd_sm90
    on sm_90a), else fwd_v2 (every arch with mma.sync). UnsupportedError where neither serves."""
    default = families.default_family(key)
    if default in MOD_FAMILIES:
        return default
    if "fwd_v2" in families.serving(key.kind, key.arch):
        return "fwd_v2"
    raise UnsupportedError(f"score_mod / mask_mod: no forward family that takes mods ({', '.join(MOD_FAMILIES)}) "
                           f"serves {key.arch}")


def mod_backward_row_bounds(pair) -> bool:
    """Whether the backward of a mods call whose block mask has row bounds (every query row sees one run of keys)
    takes bwd_sm90 with KernelSpec.row_bounds, as its forward does: where the mask_mod reads a captured tensor
    per score (``mask_loads_per_score``: document ids). The backward's S^T puts a different query row in each of a
    thread's scores, so the bounds cost a load per score of a partial block: cheaper than a mask_mod's reads (documents,
    fwd+bwd 1.27x on an H100), dearer than index compares alone (causal 0.83x, window 0.93x): docs/perf/mods.md."""
    return mask_loads_per_score(pair)


def mod_backward_spec(key: ProblemKey, smem_budget: int, token: int, verify: bool = False,
                      family: str | None = None, row_bounds: bool = False) -> KernelSpec:
    """The dK/dV kernel of a call with user mods for ``key`` (a ``bwd_dkdv`` key), with the mods' token: on
    sm_90a at the head-dim tiles bwd_sm90 has, bwd_sm90's rule tiles in order, then each with dP^T's GEMM
    issued after P^T (``dp_late``: a mod's functions that do not fit beside dP^T's accumulators); elsewhere
    (the other GPUs) the mma.sync dK/dV kernel with dQ by atomics (``bwd_dkdv``), its rule's
    tiles in order (UnsupportedError where none fits); ``family="bwd_dkdv"`` takes that kernel on sm_90a too
    (tests, comparisons). ``verify``: the first that builds clean, else the one
    that spills least (at d = 128 a mod's functions can leave ptxas a few registers short whichever way:
    ``codegen.load(..., accept_spills=True)`` takes it rather than leave the mod without a backward).
    ``row_bounds``: bwd_sm90's partial blocks masked by each query row's bounds (KernelSpec.row_bounds) where
    such a tile builds clean, else the mask_mod's tiles (the mma.sync kernel keeps the mask_mod)."""
    fam = families.family("bwd_sm90")
    plain = key.replace(causal=False, variant="")
    if family not in (None, "bwd_sm90", "bwd_dkdv"):
        raise ValueError(f"the backward of score_mod / mask_mod runs on bwd_sm90 or bwd_dkdv, not {family!r}")
    if family == "bwd_dkdv" or key.arch != "sm_90a" or key.head_dim not in fam.tiles:
        candidates = _mma_mod_rule("bwd_dkdv", key, smem_budget, token)
    else:
        # (the dQ writer walks dense rows: the rule's own tile follows its; 128 queries a step: not with mods yet)
        rule = [s.replace(causal=False, mod=token) for s in fam.rule(plain, smem_budget)
                if s.dq_write not in WRITER_DQ and s.block_m == 64]
        rule = list(dict.fromkeys(rule))
        # (with row bounds: every tile with them, then the same without, before any tile with dP^T late)
        order = _bounds_first(rule, row_bounds, True)
        candidates = order + [s.replace(dp_late=True).validate() for s in order]
    if not verify:
        return candidates[0]
    spilling = []
    for spec in candidates:
        if not resource_problems(spec):
            return spec
        report = build(spec).report
        if not report.problems(spills=False):
            spilling.append((report.spill_stores + report.spill_loads + report.stack_frame, spec))
    return min(spilling, key=lambda x: x[0])[1] if spilling else candidates[-1]


def mod_backward_pair(key: ProblemKey, smem_budget: int, token: int, verify: bool = False) -> tuple:
    """The deterministic backward of a call with user mods: (dK/dV kernel without dQ, dQ kernel), the mma.sync
    pair (``bwd_dkdv_nodq``, ``bwd_dq``: dQ summed in a fixed order, no atomics) with the mods' token, each its
    family's rule tiles for ``key``'s head-dim tile in order (``verify``: the first that builds clean).
    UnsupportedError where a family has no tile that fits."""
    return tuple(first_clean(_mma_mod_rule(kind, key, smem_budget, token), resource_problems if verify else None)
                 for kind in ("bwd_dkdv_nodq", "bwd_dq"))


def _mma_mod_rule(kind: str, key: ProblemKey, smem_budget: int, token: int) -> list:
    """The mma.sync backward kernel ``kind``'s rule tiles for ``key``'s head-dim tile with the mods' token, in
    order, each once (the family's rule refuses a head-dim tile none of its tiles fits)."""
    rule = families.family(kind).rule(key.replace(kind=kind, causal=False, variant=""), smem_budget)
    candidates = [s.validate() for s in dict.fromkeys(s.replace(causal=False, mod=token) for s in rule)]
    if not candidates:
        raise UnsupportedError(f"no {kind} tile fits head-dim tile {key.head_dim} on {key.arch} for the backward of "
                               "score_mod / mask_mod")
    return candidates


@functools.lru_cache(maxsize=256)
def deterministic_twin(spec: KernelSpec, smem_budget: int) -> KernelSpec | None:
    """The dK/dV kernel ``deterministic=True`` runs where dispatch picks ``spec``: bwd_sm90's ``det`` twin of
    it (dQ's adds in a fixed order; packed rows and mods excepted): its two fp32 dQ staging tiles, or where
    they do not fit ``smem_budget`` beside the rest (head dims above 128) the one tile of a warpgroup's
    columns (dq_write 4); None where neither fits, and where the mma.sync pair (bwd_dkdv_nodq + bwd_dq)
    computes dQ instead. (The torch layer also gives up a twin whose build spills.) Cached: the backward
    asks on every deterministic call."""
    if spec.kind != "bwd_sm90" or spec.varlen or spec.mod:
        return None
    for dq_write in (0, 4):
        twin = spec.replace(det=True, dq_write=dq_write).validate()
        if twin.smem_total() <= smem_budget:
            return twin
    return None


# The first-use search (``FLASHGEN_AUTOTUNE``, ``flashgen.autotune``): a function of one
# ``FirstUse`` request that returns the winning spec (and stores it in the user's table) or None. The
# tuner provides it (``flashgen.tuner.autotune.search``, registered by the package on import); the torch
# layer calls it through ``first_use_search`` (it may not import the tuner: imports point down).
_first_use = None


def set_first_use_search(search) -> None:
    global _first_use
    _first_use = search


def first_use_search():
    return _first_use


def clear() -> None:
    """Forget the tables read so far and every cached pick (after tuning, or in tests)."""
    tables.clear()
    select.cache_clear()
