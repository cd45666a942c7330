"""Kernel families of the baselines FlashAttention-2 is compared with, and their default tiles.

- ``standard_qk``, ``standard_softmax``, ``standard_pv``: standard attention in
  three generated kernels (S = scale QK^T to HBM; row softmax of S in place,
  giving P; O = PV). ``algorithm="standard"`` runs the three in order.
- ``fwd_v1``: FlashAttention V1's loop order (a CTA per K/V block walking the
  Q blocks, O/m/l round-tripping through HBM; see templates/fwd_v1.cuh for how
  the updates are ordered).

Registered in ``flashgen.families.FAMILIES``. Pure Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from .families import F32, FWD_PARAMS, I32, I64, MMA_HEAD_DIMS, PTR, Family

STANDARD_KINDS = ("standard_qk", "standard_softmax", "standard_pv")
V1_KIND = "fwd_v1"

# Tiles whose rows are staged through Tile<BN> (templates/tile.cuh) need BN % 32 == 0.
_TILE_WIDTHS = (32, 64, 96, 128, 160, 192, 224, 256)

# One parameter block for the three standard passes (each uses the fields it needs).
STANDARD_PARAMS = (
    ("q", "const elem_t*", PTR), ("k", "const elem_t*", PTR), ("v", "const elem_t*", PTR),
    ("o", "elem_t*", PTR), ("lse", "float*", PTR), ("s", "elem_t*", PTR),
    ("q_sb", "long long", I64), ("q_sh", "long long", I64), ("q_ss", "long long", I64),
    ("k_sb", "long long", I64), ("k_sh", "long long", I64), ("k_ss", "long long", I64),
    ("v_sb", "long long", I64), ("v_sh", "long long", I64), ("v_ss", "long long", I64),
    ("o_sb", "long long", I64), ("o_sh", "long long", I64), ("o_ss", "long long", I64),
    ("s_ld", "long long", I64),  # row stride of S/P in elements: nk rounded up to 8 (16-byte rows)
    ("nq", "int", I32), ("nk", "int", I32), ("heads", "int", I32), ("group", "int", I32),
    ("d", "int", I32), ("scale", "float", F32),
)

# fwd_v1 adds the fp32 partial O, the (m, l) pairs and the ordering counters.
V1_PARAMS = FWD_PARAMS + (
    ("acc", "float*", PTR),   # partial O, fp32, (batch*heads, nq, head_dim tile)
    ("ml", "float*", PTR),    # (m, l) per row, fp32 pairs, (batch*heads, nq, 2)
    ("sync", "int*", PTR),    # per (batch, head): [ticket, progress of Q block 0, 1, ...], zeroed
)


@dataclass(frozen=True)
class StandardQK(Family):
    """Pass 1: S = scale QK^T, one CTA per (Q block, K block) tile, staged through shared memory."""

    def smem_bytes(self, spec) -> int:
        return 2 * (spec.block_m * spec.head_dim + spec.block_n * spec.head_dim + spec.block_m * spec.block_n)

    def acc_floats(self, spec) -> int:
        return spec.block_m // spec.warps // 16 * spec.block_n // 8 * 4


@dataclass(frozen=True)
class StandardSoftmax(Family):
    """Pass 2: one warp per row; block_m rows (= warps) per CTA, 256-column (32 lanes x 8) sweeps."""

    def validate(self, spec) -> None:
        self.require(spec, self.value_rules())
        if spec.block_m != spec.warps:
            raise ValueError(f"{self.kind}: block_m={spec.block_m} must equal warps={spec.warps} "
                             "(one warp per row)")

    def smem_bytes(self, spec) -> int:
        return 0

    def acc_floats(self, spec) -> int:
        return 0


@dataclass(frozen=True)
class StandardPV(Family):
    """Pass 3: O = PV, P and V tiles through an ST-stage cp.async ring (like fwd_v2 without softmax)."""

    def smem_bytes(self, spec) -> int:
        ring = spec.stages * (spec.block_m * spec.block_n + spec.block_n * spec.head_dim)
        return 2 * max(ring, spec.block_m * spec.head_dim)  # the O staging reuses the ring

    def acc_floats(self, spec) -> int:
        return spec.block_m // spec.warps // 16 * spec.head_dim // 8 * 4


@dataclass(frozen=True)
class FwdV1(Family):
    """FlashAttention V1: K_j, V_j resident, Q blocks double-buffered."""

    def smem_bytes(self, spec) -> int:
        return 2 * spec.head_dim * (2 * spec.block_n + 2 * spec.block_m)


BASELINE_FAMILIES = {
    "standard_qk": StandardQK("standard_qk", "standard.cu.j2", STANDARD_PARAMS, block_ns=_TILE_WIDTHS,
                              stages=(1,), refills=(0,)),
    "standard_softmax": StandardSoftmax("standard_softmax", "standard.cu.j2", STANDARD_PARAMS,
                                        block_ms=(1, 2, 4, 8), block_ns=(256,), stages=(1,), refills=(0,)),
    "standard_pv": StandardPV("standard_pv", "standard.cu.j2", STANDARD_PARAMS, block_ns=_TILE_WIDTHS,
                              stages=(2, 3), refills=(0,)),
    V1_KIND: FwdV1(V1_KIND, "fwd_v1.cu.j2", V1_PARAMS, stages=(2,), refills=(0,)),
}


# ---------------------------------------------------------------- default rules

# (block_m, block_n, warps, stages) in order of preference; the first that fits the budget wins.
_STANDARD_TILES = {
    "standard_qk": ((128, 128, 8, 1), (64, 64, 4, 1), (32, 32, 2, 1)),
    "standard_softmax": ((4, 256, 4, 1),),
    "standard_pv": ((128, 64, 4, 2), (64, 64, 4, 2), (64, 32, 4, 2)),
}
# Accumulators per thread the V1 default may use: 128 up to d = 128, 112 above (the larger Q/K/V
# address sets need registers too), and at least the O tile plus 8 S values. Checked spill-free by
# tests/test_compile.py.
def v1_acc_cap(head_dim: int) -> int:
    return max(128 if head_dim <= 128 else 112, head_dim // 8 * 4 + 8)


def standard_spec(kind, arch, dtype, head_dim, causal, smem_budget):
    from .spec import KernelSpec

    for bm, bn, w, st in _STANDARD_TILES[kind]:
        if kind == "standard_pv" and head_dim > 128:
            w = 8  # 128 O accumulators per thread at most
        spec = KernelSpec(kind=kind, arch=arch, dtype=dtype, head_dim=head_dim, block_m=bm, block_n=bn, warps=w,
                          stages=st, refill=0, causal=causal).validate()
        if spec.smem_bytes() <= smem_budget:
            return spec
    return None


# Where the rule's tile spills with NVRTC 13 (ptxas runs out of registers at d = 224 on sm_80 for
# every 64-row tile): (arch, head_dim) -> (block_m, block_n, warps), found by compiling candidates.
V1_OVERRIDES = {("sm_80", 224): (32, 16, 2)}


def v1_spec(arch, dtype, head_dim, causal, smem_budget):
    """The paper's tiles, rounded to what the template supports: B_r = min(B_c, d), B_c = ceil(M/4d) with M
    the shared memory in elements; each capped at 128, rounded down to a supported size, and shrunk until
    the accumulators fit ``v1_acc_cap`` registers per thread and the tiles fit the shared memory."""
    from .iomodel import paper_block_sizes
    from .spec import KernelSpec

    fam = BASELINE_FAMILIES[V1_KIND]
    if (arch, head_dim) in V1_OVERRIDES:
        bm, bn, w = V1_OVERRIDES[arch, head_dim]
        spec = KernelSpec(kind=V1_KIND, arch=arch, dtype=dtype, head_dim=head_dim, block_m=bm, block_n=bn,
                          warps=w, stages=2, refill=0, causal=causal).validate()
        if spec.smem_bytes() <= smem_budget:
            return spec
    br, bc = paper_block_sizes(smem_budget, head_dim)
    for bm in sorted((m for m in fam.block_ms if m <= min(br, 128)), reverse=True):
        for bn in sorted((n for n in fam.block_ns if n <= min(bc, 128)), reverse=True):
            for w in (4, 8, 2, 1):
                if bm % (16 * w) or bm // (16 * w) > 2:
                    continue
                spec = KernelSpec(kind=V1_KIND, arch=arch, dtype=dtype, head_dim=head_dim, block_m=bm, block_n=bn,
                                  warps=w, stages=2, refill=0, causal=causal).validate()
                if fam.acc_floats(spec) <= v1_acc_cap(head_dim) and spec.smem_bytes() <= smem_budget:
                    return spec
    return None


def default_spec(key, smem_budget: int):
    """Default spec for a problem key of one of these kinds (``dispatch.default_spec`` defers here)."""
    from .errors import UnsupportedError

    if key.kind == V1_KIND:
        spec = v1_spec(key.arch, key.dtype, key.head_dim, key.causal, smem_budget)
    else:
        spec = standard_spec(key.kind, key.arch, key.dtype, key.head_dim, key.causal, smem_budget)
    if spec is None:
        raise UnsupportedError(f"no default {key.kind} tile fits {smem_budget} B of shared memory for "
                               f"d={key.head_dim}")
    return spec


__all__ = ["BASELINE_FAMILIES", "STANDARD_KINDS", "V1_KIND", "default_spec", "standard_spec", "v1_spec",
           "MMA_HEAD_DIMS"]
