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


@dataclass(frozen=True)
class ProblemKey:
    kind: str
    arch: str
    dtype: str
    head_dim: int      # the kernel's head-dim tile
    causal: bool
    bucket: int        # seqlen bucket of the query length


# The default rule: per head-dim tile, (block_m, block_n, warps, stages, refill,
# causal, arch) in order of preference, None meaning any; the first that fits
# the GPU's shared memory is used. Chosen from FA2's tiles and our H200
# sweeps (bench/NOTES.md), kept to tiles that compile without spills
# (tests/test_compile.py checks every one).
DEFAULT_TILES = {
    32: ((128, 64, 4, 2, 0, None, None), (64, 64, 4, 2, 0, None, None)),
    64: ((128, 64, 4, 2, 0, None, None), (64, 64, 4, 2, 0, None, None)),
    96: ((128, 64, 8, 2, 0, None, None), (64, 64, 4, 2, 0, None, None)),
    128: ((128, 64, 4, 2, 1, True, "sm_90a"),
          (128, 32, 4, 3, 0, None, None), (64, 64, 4, 2, 0, None, None)),
    160: ((128, 64, 8, 2, 0, None, None), (64, 32, 4, 2, 0, None, None)),
    192: ((128, 64, 8, 2, 0, None, None), (64, 32, 4, 2, 0, None, None)),
    224: ((128, 64, 8, 2, 0, None, None), (64, 32, 4, 2, 0, None, None)),
    256: ((128, 64, 8, 2, 0, None, None), (64, 32, 4, 2, 0, None, None)),
}


def default_spec(key: ProblemKey, smem_budget: int) -> KernelSpec:
    """The default rule's spec for ``key`` under ``smem_budget`` bytes per block."""
    if key.kind != "fwd_v2":  # the baselines (standard attention's passes, fwd_v1) have their own rules
        from .baseline_specs import default_spec as baseline_default

        return baseline_default(key, smem_budget)
    for bm, bn, w, st, refill, causal, arch in DEFAULT_TILES[key.head_dim]:
        if (causal is not None and causal != key.causal) or (arch is not None and arch != key.arch):
            continue
        spec = KernelSpec(kind=key.kind, arch=key.arch, dtype=key.dtype, head_dim=key.head_dim, block_m=bm,
                          block_n=bn, warps=w, stages=st, refill=refill, causal=key.causal)
        if spec.validate().smem_bytes() <= smem_budget:
            return spec
    raise UnsupportedError(f"no default {key.kind} tile fits {smem_budget} B of shared memory for d={key.head_dim}")


def default_specs(arch: str, smem_budget: int, kind: str = "fwd_v2"):
    """Every spec the default rule can pick for ``arch`` (for the compile tests)."""
    out = []
    for d in MMA_HEAD_DIMS:
        for dtype in ("fp16", "bf16"):
            for causal in (False, True):
                out.append(default_spec(ProblemKey(kind, arch, dtype, d, causal, BUCKETS[0]), smem_budget))
    return out


@functools.lru_cache(maxsize=4096)
def select(key: ProblemKey, gpu: str | None, smem_budget: int) -> KernelSpec:
    """The spec for ``key`` on GPU profile ``gpu`` (None: unknown GPU, default rule only)."""
    if gpu is not None:
        from .tables import lookup  # tuned YAML tables (user's, then shipped)

        spec = lookup(gpu, key)
        if spec is not None:
            return spec
    return default_spec(key, smem_budget)
