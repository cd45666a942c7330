"""fwd_v1: FlashAttention V1's loop order, for study and comparison (templates/fwd_v1/).

A CTA per K/V block walks the Q blocks: K_j, V_j stay resident, Q blocks are
double-buffered, and O, m, l round-trip through HBM (fp32 partials, ordered by
per-(batch, head) counters: see the template for how the updates are ordered).
Exact and bitwise deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import iomodel
from ..problem import ProblemKey
from .base import FWD_PARAMS, PTR, Family

KIND = "fwd_v1"

# fwd_v2's parameters plus the fp32 partial O, the (m, l) pairs and the ordering counters.
V1_PARAMS = FWD_PARAMS + (
    ("acc", "float*", PTR),   # partial O, fp32, (batch*heads, nq, head_dim tile)
    ("ml", "float*", PTR),    # (m, l) per row, fp32 pairs, (batch*heads, nq, 2)
    ("sync", "int*", PTR),    # per (batch, head): [ticket, progress of Q block 0, 1, ...], zeroed
)

# Where the rule's tile spills with NVRTC 13 (ptxas runs out of registers at d = 224 on sm_80 for
# every 64-row tile): (arch, head_dim) -> (block_m, block_n, warps), found by compiling candidates.
V1_OVERRIDES = {("sm_80", 224): (32, 16, 2)}


def v1_acc_cap(head_dim: int) -> int:
    """Accumulators per thread the rule may use: 128 up to d = 128, 112 above (the larger Q/K/V address
    sets need registers too), and at least the O tile plus 8 S values. Checked spill-free by
    tests/test_compile.py."""
    return max(128 if head_dim <= 128 else 112, head_dim // 8 * 4 + 8)


@dataclass(frozen=True)
class FwdV1(Family):
    """K_j, V_j resident, Q blocks double-buffered."""

    def smem_bytes(self, spec) -> int:
        return 2 * spec.head_dim * (2 * spec.block_n + 2 * spec.block_m)

    def rule(self, key: ProblemKey, budget: int) -> list:
        """The paper's tiles, rounded to what the template supports: B_r = min(B_c, d), B_c = ceil(M/4d)
        with M the shared memory in elements; each capped at 128, rounded down to a supported size, and
        shrunk until the accumulators fit ``v1_acc_cap`` registers per thread and the tiles fit. Every
        tile that fits follows in that order: a compiler that spills the first (the H200 image's NVRTC
        at d = 128, m128 n128 w8: 16 B) gets the next from a verifying dispatch."""
        out = []
        if (key.arch, key.head_dim) in V1_OVERRIDES:
            bm, bn, w = V1_OVERRIDES[key.arch, key.head_dim]
            self._fit(out, self.spec(key, block_m=bm, block_n=bn, warps=w, stages=2), budget)
        br, bc = iomodel.paper_block_sizes(budget, key.head_dim)
        for bm in sorted((m for m in self.block_ms if m <= min(br, 128)), reverse=True):
            for bn in sorted((n for n in self.block_ns if n <= min(bc, 128)), reverse=True):
                for w in (4, 8, 2, 1):
                    if bm % (16 * w) or bm // (16 * w) > 2:
                        continue
                    spec = self.spec(key, block_m=bm, block_n=bn, warps=w, stages=2).validate()
                    if self.acc_floats(spec) <= v1_acc_cap(key.head_dim):
                        self._fit(out, spec, budget)
        return self._fitting(out, key, budget)


FAMILY = FwdV1(KIND, "fwd_v1/fwd_v1.cu.j2", V1_PARAMS, stages=(2,))
