"""standard: standard attention in three generated kernels, for study and comparison (templates/standard/).

- ``standard_qk``: S = scale QK^T to HBM, one CTA per (Q block, K block) tile, staged through shared memory;
- ``standard_softmax``: row softmax of S in place (giving P) and the LSE, one warp per row;
- ``standard_pv``: O = PV, P and V tiles through a cp.async ring (like fwd_v2 without the softmax).

``algorithm="standard"`` runs the three in order (flashgen.api.baselines).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..problem import ProblemKey
from .base import F32, I32, I64, PTR, Family

KINDS = ("standard_qk", "standard_softmax", "standard_pv")

# Tiles whose rows are staged through Tile<BN> (templates/common/tile.cuh) need BN % 32 == 0.
_TILE_WIDTHS = (32, 64, 96, 128, 160, 192, 224, 256)

# One parameter block for the three passes (each uses the fields it needs).
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

# The default rule: (block_m, block_n, warps, stages) in order of preference; the first that fits wins.
_TILES = {
    "standard_qk": ((128, 128, 8, 1), (64, 64, 4, 1), (32, 32, 2, 1)),
    "standard_softmax": ((4, 256, 4, 1),),
    "standard_pv": ((128, 64, 4, 2), (64, 64, 4, 2), (64, 32, 4, 2)),
}


@dataclass(frozen=True)
class StandardFamily(Family):
    def rule(self, key: ProblemKey, budget: int) -> list:
        out = []
        for bm, bn, w, st in _TILES[self.kind]:
            self._fit(out, self.spec(key, block_m=bm, block_n=bn, warps=self.rule_warps(key, bm, w), stages=st),
                      budget)
        return self._fitting(out, key, budget)

    def rule_warps(self, key: ProblemKey, block_m: int, warps: int) -> int:
        """The warps the rule gives a tile of ``block_m`` rows (the table's, unless the pass says otherwise)."""
        return warps


@dataclass(frozen=True)
class StandardQK(StandardFamily):
    """Pass 1: S = scale QK^T, one CTA per (Q block, K block) tile, staged through shared memory."""

    def smem_bytes(self, spec) -> int:
        return 2 * (spec.block_m * spec.head_dim + spec.block_n * spec.head_dim + spec.block_m * spec.block_n)

    def acc_floats(self, spec) -> int:
        return spec.block_m // spec.warps // 16 * spec.block_n // 8 * 4


@dataclass(frozen=True)
class StandardSoftmax(StandardFamily):
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
class StandardPV(StandardFamily):
    """Pass 3: O = PV, P and V tiles through an ST-stage cp.async ring (like fwd_v2 without softmax)."""

    def rule_warps(self, key: ProblemKey, block_m: int, warps: int) -> int:
        # 128 O accumulators per thread at most: 8 warps for a 128-row tile above d = 128
        return 8 if key.head_dim > 128 and block_m % 128 == 0 else warps

    def smem_bytes(self, spec) -> int:
        ring = spec.stages * (spec.block_m * spec.block_n + spec.block_n * spec.head_dim)
        return 2 * max(ring, spec.block_m * spec.head_dim)  # the O staging reuses the ring

    def acc_floats(self, spec) -> int:
        return spec.block_m // spec.warps // 16 * spec.head_dim // 8 * 4


FAMILIES = (
    StandardQK("standard_qk", "standard/standard.cu.j2", STANDARD_PARAMS, block_ns=_TILE_WIDTHS, stages=(1,)),
    StandardSoftmax("standard_softmax", "standard/standard.cu.j2", STANDARD_PARAMS, block_ms=(1, 2, 4, 8),
                    block_ns=(256,), stages=(1,), gemms=0),
    StandardPV("standard_pv", "standard/standard.cu.j2", STANDARD_PARAMS, block_ns=_TILE_WIDTHS, stages=(2, 3)),
)
