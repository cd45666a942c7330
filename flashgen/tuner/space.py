"""The search space: problem keys, the feasible specs of a key, and the paper-rule baseline.

A problem key is (kind, arch, dtype, head-dim tile, causal, seqlen bucket),
``flashgen.problem.ProblemKey``. The families searched for a key are those
that serve its kind on its arch (``families.serving``: for "fwd" on sm_90a
both fwd_sm90 and fwd_v2, elsewhere fwd_v2), optionally restricted
(``--kind fwd_v2`` / ``fwd_sm90``). Its candidates are every combination of
each family's tunable knobs (``Family.tune_space``) that the family accepts
(``validate``: sizes it supports, warp layout dividing the tile) and searches
(``Family.searched``: fwd_sm90 tries its softmax techniques only with warp
specialization, fma_exp2 only at d = 64) and that the GPU can hold (``KernelSpec.check``: shared memory
within the budget M, fp32 accumulators per thread within what the register file
plausibly keeps). The
ptxas report decides the rest at compile time (a spilling tile is a recorded
constraint violation, never launched).

The backward (``--kind bwd``) is tuned through the same keys dispatch reads for
it: ProblemKey(bwd_dkdv | bwd_dkdv_nodq | bwd_dq, arch, dtype,
``problem.bwd_head_dim_tile(d, arch)``, causal, bucket). Each such key kind runs in one dQ mode
(``BWD_KEY_MODES``): a bwd_dkdv spec in the "atomic" backward (preprocess,
dK/dV with dQ atomics, convert), a bwd_dkdv_nodq or bwd_dq spec in the
"separate" one (preprocess, dK/dV, dQ kernel). ``--kind bwd`` is the main kernel
of the mode the default backward uses for the head dim (``bwd_main_kind``: bwd_dkdv where bwd_sm90
serves it or the mma.sync kernel's ``families.bwd.DQ_MODE`` is "atomic", bwd_dkdv_nodq where
"separate"); naming a key kind tunes that one (bwd_dkdv_nodq and bwd_dq also serve
``deterministic=True`` where bwd_sm90 does not; where it does, its det twin runs on the bwd_dkdv key's
tile).
The dQ mode itself is not a knob: it is a per-head-dim rule of dispatch, and a
table entry holds one spec for one key. The baseline of a backward key is
its family's default rule, not the paper's forward rule.
"""
from __future__ import annotations

import functools
import itertools
import random

from .. import families as registry
from .. import iomodel, mods, tables, variants
from ..errors import UnsupportedError
from ..families import bwd
from ..problem import BUCKETS, ProblemKey, bwd_head_dim_tile, head_dim_tile
from ..spec import DTYPE_BYTES, KernelSpec


# The backward's key kinds the tuner times, and the dQ mode of ``attention_backward`` each one's
# spec runs in (the other kernels of that backward come from dispatch, as in any call).
BWD_KEY_MODES = {"bwd_dkdv": "atomic", "bwd_dkdv_nodq": "separate", "bwd_dq": "separate"}


TUNED_PROBLEMS = ("fwd", *BWD_KEY_MODES)


def problem_of(kind: str) -> str:
    """The problem a ``--kind`` names: itself for a problem, the problem a family serves for a family."""
    return kind if kind in registry.PROBLEMS else registry.family(kind).serves


def is_backward(kind: str) -> bool:
    """Whether a key kind (or a family serving one) is a backward key the tuner times."""
    return kind in registry.FAMILIES and problem_of(kind) in BWD_KEY_MODES


def tune_kinds() -> tuple:
    """What ``flashgen tune --kind`` accepts: the problems ("fwd", "bwd" and the backward's key
    kinds) and every family that serves one of them (which restricts the search to it)."""
    return ("bwd", *TUNED_PROBLEMS, *(k for p in TUNED_PROBLEMS for k in registry.PROBLEMS.get(p, ())
                                      if k not in TUNED_PROBLEMS))


def bwd_main_kind(tile: int, arch: str) -> str:
    """The key kind of the backward's main kernel for a head-dim tile in the default dQ mode: the dK/dV
    kernel with dQ ("bwd_dkdv"), unless the arch's default for it is the mma.sync kernel and that
    kernel's dQ mode at the tile is the separate kernel (bwd.DQ_MODE)."""
    key = ProblemKey("bwd_dkdv", arch, "bf16", tile, False, BUCKETS[0])
    mma = registry.default_family(key) == registry.fallback_family("bwd_dkdv", arch)
    return "bwd_dkdv_nodq" if mma and bwd.dq_mode(tile) == "separate" else "bwd_dkdv"


def problem_keys(kind: str, arch: str, dtypes, head_dims, causals, buckets=BUCKETS, variants=("",)) -> list[ProblemKey]:
    """The keys of ``kind`` (a forward family's name gives "fwd" keys: restrict with ``families``;
    "bwd" gives each head dim's ``bwd_main_kind``; a backward key kind its own keys), for each of
    ``variants`` (problem-key variant tokens; "" plain)."""
    if kind == "bwd" or is_backward(kind):
        kinds = {t: bwd_main_kind(t, arch) if kind == "bwd" else problem_of(kind)
                 for t in sorted({bwd_head_dim_tile(d, arch) for d in head_dims})}
    else:
        kinds = {t: problem_of(kind) for t in sorted({head_dim_tile(d) for d in head_dims})}
    return [ProblemKey(k, arch, dt, d, c, n, var)
            for var in variants for dt in dtypes for d, k in kinds.items() for c in causals for n in buckets]


def problem_shape(key: ProblemKey) -> tuple[int, int, int, int]:
    """(batch, heads, seqlen, d) the key is measured at: hidden 2048, batch * seqlen = 16k tokens."""
    return (*iomodel.hidden2048(key.bucket, key.head_dim), key.bucket, key.head_dim)


def tuning_lengths(key: ProblemKey) -> list[int]:
    """The packed rows a varlen key ("vl") is measured at: ``problem_shape``'s batch x seqlen tokens in
    sequences of seeded random lengths from bucket/8 to the bucket, the first at the bucket (the call's
    max_seqlen, which picks the key), the last the remainder: the mix the longest-first schedule serves."""
    b, _, n, _ = problem_shape(key)
    rng, total, out = random.Random(n), b * n, [n]
    while sum(out) < total:
        out.append(min(total - sum(out), rng.randint(max(1, n // 8), n)))
    return out


def measured_shape(key: ProblemKey, shapes=None) -> tuple[int, int, int, int, int, int]:
    """(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim) a key is timed at: its recorded shape in
    ``shapes`` ({ProblemKey: shape}, ``flashgen.shapes``: ``tune --from``), else ``problem_shape`` (MHA,
    seqlen_q = seqlen_k = the bucket, head_dim the key's tile)."""
    if shapes and key in shapes:
        return tuple(shapes[key])
    b, h, n, d = problem_shape(key)
    return (b, h, h, n, n, d)


def key_flops(key: ProblemKey, shape=None) -> float:
    """The work one timed call of ``key`` does: the forward's matmul FLOPs at ``problem_shape`` (or at
    ``shape``, a ``measured_shape``), 2.5 times that for a backward key (its five GEMMs against the
    forward's two: the papers' convention, also ``flashgen bench bwd``'s). Only the (query, key) pairs a
    variant's mask, or a mod key's mask_mod (``mod_pairs``), lets through count."""
    work = 2.5 if is_backward(key.kind) else 1.0
    if variants.mod_of(key.variant):  # user mods: the pairs their mask_mod lets through
        b, h, _, nq, nk, d = shape if shape is not None else measured_shape(key)
        pairs = mod_pairs(key, b, h, nq, nk)
        return (4.0 * pairs * d if pairs is not None else iomodel.flops(b, h, nq, nk, d, False)) * work
    if shape is not None and not variants.key_flags(key.variant)["varlen"]:
        b, h, _, nq, nk, d = shape
        if key.variant:
            v = variants.tuning_variant(key.variant, key.causal, max(nq, nk))
            return 4.0 * b * h * v.pairs(nq, nk) * d * work
        return iomodel.flops(b, h, nq, nk, d, key.causal) * work
    b, h, n, d = problem_shape(key)
    if key.variant:  # only the pairs the variant's mask lets through (a window at its tuning width)
        v = variants.tuning_variant(key.variant, key.causal, n)
        lengths = tuning_lengths(key) if v.varlen else [n] * b
        return 4.0 * h * sum(v.pairs(m, m) for m in lengths) * d * work
    return iomodel.flops(b, h, n, n, d, key.causal) * work


@functools.lru_cache(maxsize=64)
def mod_pairs(key: ProblemKey, b: int, h: int, nq: int, nk: int) -> int | None:
    """The (query, key) pairs a mod key's mask_mod lets through over (b, h, nq, nk), counted by the block
    mask the call makes (flashgen.api.create_block_mask, on the captures' device), or None for mods without
    a mask_mod. The pair must be registered in this process (``flashgen tune --mask-mod`` traces it)."""
    pair = mods.of_number(variants.mod_of(key.variant))
    if pair.mask is None:
        return None
    from ..api.blockmask import create_block_mask

    graph = pair.mask
    device = graph.captures[0].device if graph.captures else "cpu"
    block_mask = create_block_mask(lambda b_, h_, q, kv: graph.evaluate(None, b_, h_, q, kv), b, h, nq, nk,
                                   device=device)
    return block_mask.for_tile(128, 128).pairs


def key_name(key: ProblemKey) -> str:
    """Readable and unique; also the Optuna study name."""
    return (f"{key.kind}-{key.arch}-{key.dtype}-d{key.head_dim}-{'causal' if key.causal else 'full'}"
            f"-n{key.bucket}" + (f"-{key.variant}" if key.variant else ""))


def families(key: ProblemKey, only=None) -> tuple:
    """The families searched for ``key``, in preference order; ``only``: keep just these (``--kind fwd_v2``)."""
    fams = registry.serving(key.kind, key.arch)
    if only is not None:
        fams = tuple(f for f in fams if f in only)
    if not fams:
        raise ValueError(f"no kernel family {'among ' + str(tuple(only)) + ' ' if only else ''}serves "
                         f"{key.kind} on {key.arch}")
    return fams


def make_spec(key: ProblemKey, kind: str, **knobs) -> KernelSpec:
    """The ``kind`` spec of ``key`` at one point of that family's ``tune_space`` (not validated)."""
    fam = registry.family(kind)
    return KernelSpec(kind=kind, arch=key.arch, dtype=key.dtype, causal=key.causal,
                      **fam.complete({"head_dim": fam.tile(key), **knobs})).with_tokens(key.variant)


def _paper_family(key: ProblemKey) -> str:
    """The family the paper's rule is sized for: the problem's portable fallback (fwd_v2 for "fwd")."""
    return registry.fallback_family(key.kind, key.arch)


def _ok(spec: KernelSpec, profile) -> bool:
    return not spec.check(profile)


def paper_baseline(key: ProblemKey, profile) -> KernelSpec:
    """The FlashAttention paper's tile rule under the GPU's budget M.

    B_c = ceil(M / 4d), B_r = min(B_c, d), with M counted in elements of the
    input dtype (the rule sizes Q, K, V, O blocks of B x d elements to fill the
    SRAM). Each is rounded to the nearest tile the family supports (ties go to
    the smaller), the fewest warps whose layout divides B_r and keeps the
    accumulators in registers, 2 stages, the copy issued first; while that does
    not fit, the larger of B_c and B_r steps down to the next supported size.

    A forward key's baseline is always fwd_v2's (the paper's algorithm), also
    when fwd_sm90 is searched beside it or alone: the gain is reported against it.
    """
    kind = _paper_family(key)
    fam = registry.family(kind)
    b_r, b_c = iomodel.paper_block_sizes(profile.smem_per_block, key.head_dim, DTYPE_BYTES[key.dtype])

    def nearest(value, allowed):
        return min(allowed, key=lambda a: (abs(a - value), a))

    bms = sorted(fam.block_ms)
    bns = sorted(fam.block_ns)
    bm, bn = nearest(b_r, bms), nearest(b_c, bns)
    while True:
        for w in sorted(fam.warps):
            if bm % (16 * w) or w < 4 and bm >= 64:
                continue
            spec = make_spec(key, kind, block_m=bm, block_n=bn, warps=w, stages=2, refill=0)
            if _ok(spec, profile):
                return spec
        if bn >= bm and bn > bns[0]:   # step the larger of the two down
            bn = bns[bns.index(bn) - 1]
        elif bm > bms[0]:
            bm = bms[bms.index(bm) - 1]
        elif bn > bns[0]:
            bn = bns[bns.index(bn) - 1]
        else:
            raise ValueError(f"no tile of {key.kind} fits {profile.name} with {profile.smem_per_block} B")


def baseline(key: ProblemKey, profile) -> KernelSpec | None:
    """The spec a key's gain is reported against: the paper's rule for a forward key
    (``paper_baseline``), dispatch's default rule for a backward key (the FlashAttention paper
    has no backward tile rule; the default is what runs without a table). None where the
    default rule has no tile that fits the budget (e.g. bwd_dkdv at d=128 in an L4's 99 KB):
    ``candidates`` then puts its first feasible spec in that place."""
    if tables.rule_baselined(key):
        try:
            return registry.default_spec(key, profile.smem_per_block)
        except UnsupportedError:
            return None
    return paper_baseline(key, profile)


def baseline_label(key: ProblemKey) -> str:
    return "default-rule" if tables.rule_baselined(key) else "paper-rule"


def parse_restrict(items, kinds) -> dict:
    """``--space`` arguments (``KNOB=V1,V2``) as {knob: allowed values}: each knob must be in the tune space
    of one of ``kinds`` and each value among that space's values (ints; true/false or 1/0 for flags).
    ``ValueError`` says what is wrong."""
    spaces: dict = {}
    for kind in kinds:
        for name, values in registry.family(kind).tune_space:
            spaces.setdefault(name, set()).update(values)
    out: dict = {}
    for item in items or ():
        name, eq, text = str(item).partition("=")
        if not eq or name not in spaces:
            raise ValueError(f"--space {item!r}: KNOB=V1,V2 with KNOB one of {sorted(spaces)}")
        vals = []
        for t in text.split(","):
            t = t.strip().lower()
            v = {"true": True, "false": False}.get(t, int(t) if t.lstrip("-").isdigit() else None)
            if v is None or v not in spaces[name]:
                raise ValueError(f"--space {item!r}: {t!r} is not among {name}'s values {sorted(spaces[name])}")
            vals.append(v)
        out[name] = set(vals)
    return out


def candidates(key: ProblemKey, profile, only=None, restrict=None) -> list[KernelSpec]:
    """The statically feasible specs of ``key`` on ``profile``: the baseline first (``baseline``),
    then each family's (``families(key, only)``, default family first). ``restrict`` ({knob: allowed
    values}, ``parse_restrict``) narrows each family's tune space on the knobs it names."""
    base = baseline(key, profile)
    out = [] if base is None else [base]
    seen = set(out)  # (a list's `in` compares field by field: quadratic over a few thousand specs)
    for kind in families(key, only):
        fam = registry.family(kind)
        names = [n for n, _ in fam.tune_space]
        space = [[x for x in v if n not in (restrict or {}) or x in restrict[n]] for n, v in fam.tune_space]
        for values in itertools.product(*space):
            try:
                spec = make_spec(key, kind, **dict(zip(names, values))).validate()
            except ValueError:
                continue  # not a layout the template supports (e.g. rows not divisible over the warps)
            if _ok(spec, profile) and fam.searched(spec) and spec not in seen:
                out.append(spec)
                seen.add(spec)
    if not out:
        raise ValueError(f"no spec of {key.kind} fits {profile.name} with {profile.smem_per_block} B")
    return out


def knob_choices(key: ProblemKey, specs) -> dict[str, dict[str, list]]:
    """Per family among ``specs`` (in order of first appearance), per tunable knob of that family,
    the values that occur among its specs: the TPE search dimensions (a ``family`` choice first
    when there are several, then that family's knobs)."""
    out: dict = {}
    for s in specs:
        out.setdefault(s.kind, []).append(s)
    return {kind: {n: sorted({getattr(s, n) for s in group}) for n, _ in registry.family(kind).tune_space}
            for kind, group in out.items()}
