"""The search space: problem keys, the feasible specs of a key, and the paper-rule baseline.

A problem key is (kind, arch, dtype, head-dim tile, causal, seqlen bucket),
``flashgen.dispatch.ProblemKey``. The families searched for a key are those
that serve its kind on its arch (``dispatch.families_for``: for "fwd" on
sm_90a both fwd_v2 and fwd_sm90, elsewhere fwd_v2), optionally restricted
(``--kind fwd_v2`` / ``fwd_sm90``). Its candidates are every combination of
each family's tunable knobs (``Family.tune_space``) that the family accepts
(``validate``: sizes it supports, warp layout dividing the tile) and searches
(``Family.searched``: fwd_sm90 tries its softmax flags only with warpspec, emu
only at d = 64) and that the GPU can hold (``KernelSpec.check``: shared memory
within the budget M, fp32 accumulators per thread within what the register file
plausibly keeps). The
ptxas report decides the rest at compile time (a spilling tile is a recorded
constraint violation, never launched).
"""
from __future__ import annotations

import itertools

from .. import iomodel
from ..dispatch import BUCKETS, ProblemKey
from ..spec import DTYPE_BYTES, KernelSpec


def problem_keys(kind: str, arch: str, dtypes, head_dims, causals, buckets=BUCKETS) -> list[ProblemKey]:
    """The keys of ``kind`` (a forward family's name gives "fwd" keys: restrict with ``families``)."""
    from ..dispatch import head_dim_tile, problem_kind

    kind = problem_kind(kind)
    tiles = sorted({head_dim_tile(d) for d in head_dims})
    return [ProblemKey(kind, arch, dt, d, c, n)
            for dt in dtypes for d in tiles for c in causals for n in buckets]


def problem_shape(key: ProblemKey) -> tuple[int, int, int, int]:
    """(batch, heads, seqlen, d) the key is measured at: hidden 2048, batch * seqlen = 16k tokens."""
    return (*iomodel.hidden2048(key.bucket, key.head_dim), key.bucket, key.head_dim)


def key_name(key: ProblemKey) -> str:
    """Readable and unique; also the Optuna study name."""
    return (f"{key.kind}-{key.arch}-{key.dtype}-d{key.head_dim}-{'causal' if key.causal else 'full'}"
            f"-n{key.bucket}")


def families(key: ProblemKey, only=None) -> tuple:
    """The families searched for ``key``, default first; ``only``: keep just these (``--kind fwd_v2``)."""
    from ..dispatch import families_for

    fams = families_for(key.kind, key.arch)
    if only is not None:
        fams = tuple(f for f in fams if f in only)
    if not fams:
        raise ValueError(f"no kernel family {'among ' + str(tuple(only)) + ' ' if only else ''}serves "
                         f"{key.kind} on {key.arch}")
    return fams


def make_spec(key: ProblemKey, kind: str, **knobs) -> KernelSpec:
    """The ``kind`` spec of ``key`` at one point of that family's ``tune_space`` (not validated)."""
    from ..dispatch import spec_tile
    from ..families import family

    return KernelSpec(kind=kind, arch=key.arch, dtype=key.dtype, head_dim=spec_tile(kind, key), causal=key.causal,
                      **family(kind).complete(knobs))


def _spec(key: ProblemKey, **knobs) -> KernelSpec:
    from ..dispatch import FORWARD_FAMILIES, problem_kind

    return make_spec(key, FORWARD_FAMILIES.get(problem_kind(key.kind), (key.kind,))[0], **knobs)


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
    from ..dispatch import FORWARD_FAMILIES, problem_kind
    from ..families import family

    fam = family(FORWARD_FAMILIES.get(problem_kind(key.kind), (key.kind,))[0])
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
            spec = _spec(key, block_m=bm, block_n=bn, warps=w, stages=2, refill=0)
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


def candidates(key: ProblemKey, profile, only=None) -> list[KernelSpec]:
    """The statically feasible specs of ``key`` on ``profile``: the paper-rule baseline first, then
    each family's (``families(key, only)``, default family first)."""
    from ..families import family

    out = [paper_baseline(key, profile)]
    for kind in families(key, only):
        fam = family(kind)
        names = [n for n, _ in fam.tune_space]
        for values in itertools.product(*(v for _, v in fam.tune_space)):
            try:
                spec = make_spec(key, kind, **dict(zip(names, values))).validate()
            except ValueError:
                continue  # not a layout the template supports (e.g. rows not divisible over the warps)
            if _ok(spec, profile) and fam.searched(spec) and spec not in out:
                out.append(spec)
    return out


def knob_choices(key: ProblemKey, specs) -> dict[str, dict[str, list]]:
    """Per family among ``specs`` (in order of first appearance), per tunable knob of that family,
    the values that occur among its specs: the TPE search dimensions (a ``family`` choice first
    when there are several, then that family's knobs)."""
    from ..families import family

    out: dict = {}
    for s in specs:
        out.setdefault(s.kind, []).append(s)
    return {kind: {n: sorted({getattr(s, n) for s in group}) for n, _ in family(kind).tune_space}
            for kind, group in out.items()}
