"""Kernel families of the backward pass (FlashAttention-2 style).

- ``bwd_preprocess``: D = rowsum(dO * O) - dLSE and LSE * log2(e) per query row,
  into fp32 buffers padded to a multiple of ``ROW_PAD`` rows (padding rows get
  D = 0 and LSE2 = +inf, so they weigh nothing); zeroes the dQ accumulator.
- ``bwd_dkdv``: one CTA per (K/V block of ``block_n`` rows, KV head, batch),
  walking the query blocks (``block_m`` rows) of every query head of its GQA
  group: recompute S^T and P^T, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - D),
  dK += dS^T Q, and dQ += dS K by fp32 atomics into the accumulator.
- ``bwd_dkdv_nodq``: the same without dQ (deterministic mode).
- ``bwd_dq``: one CTA per (query block, query head, batch) walking K/V blocks:
  dQ = scale * sum dS K with no atomics (deterministic mode).
- ``bwd_convert``: dQ accumulator (fp32) * scale -> dQ in the input dtype.

Each kernel does its GEMMs as warp tiles over shared memory; how the warps
split each GEMM's output follows from the spec by ``warp_split`` (so it is not a
spec field: block_m, block_n and warps decide it).
"""
from __future__ import annotations

from dataclasses import dataclass

from .families import F32, I32, I64, MMA_HEAD_DIMS, PTR, Family

ROW_PAD = 128  # the LSE2 / D buffers hold a multiple of this many rows per (batch, head)


def warp_split(m: int, n: int, warps: int):
    """Warps along m for an m x n fp32 accumulator tile shared by ``warps`` warps, or None.

    Each warp gets an (m/wm) x (n/wn) tile of 16-row by 16-column steps. The
    split that loads the fewest ldmatrix fragments per mma wins (per k-step a
    warp loads mt A and nt/2 B fragments for mt*nt mmas); ties go to more warps
    along m.
    """
    best = None
    for wm in (1, 2, 4, 8):
        if warps % wm:
            continue
        wn = warps // wm
        if m % (16 * wm) or n % (16 * wn):
            continue
        mt, nt = m // wm // 16, n // wn // 8
        cost = (mt + nt / 2) / (mt * nt)
        if best is None or cost < best[0] - 1e-9 or (abs(cost - best[0]) < 1e-9 and wm > best[1]):
            best = (cost, wm)
    return None if best is None else best[1]


def _strides(*tensors):
    return tuple((f"{t}_s{ax}", "long long", I64) for t in tensors for ax in "bhs")


PRE_PARAMS = (
    ("o", "const elem_t*", PTR), ("dout", "const elem_t*", PTR), ("lse", "const float*", PTR),
    ("dlse", "const float*", PTR), ("dsum", "float*", PTR), ("lse2", "float*", PTR), ("dq_acc", "float*", PTR),
    *_strides("o", "dout"),
    ("nq", "int", I32), ("nq_pad", "int", I32), ("heads", "int", I32), ("d", "int", I32),
)

DKDV_PARAMS = (
    ("q", "const elem_t*", PTR), ("k", "const elem_t*", PTR), ("v", "const elem_t*", PTR),
    ("dout", "const elem_t*", PTR), ("lse2", "const float*", PTR), ("dsum", "const float*", PTR),
    ("dq_acc", "float*", PTR), ("dk", "elem_t*", PTR), ("dv", "elem_t*", PTR),
    *_strides("q", "k", "v", "dout", "dk", "dv"),
    ("nq", "int", I32), ("nk", "int", I32), ("nq_pad", "int", I32), ("heads", "int", I32), ("group", "int", I32),
    ("d", "int", I32), ("scale", "float", F32), ("scale_log2", "float", F32),
)

DQ_PARAMS = (
    ("q", "const elem_t*", PTR), ("k", "const elem_t*", PTR), ("v", "const elem_t*", PTR),
    ("dout", "const elem_t*", PTR), ("lse2", "const float*", PTR), ("dsum", "const float*", PTR),
    ("dq", "elem_t*", PTR),
    *_strides("q", "k", "v", "dout", "dq"),
    ("nq", "int", I32), ("nk", "int", I32), ("nq_pad", "int", I32), ("heads", "int", I32), ("group", "int", I32),
    ("d", "int", I32), ("scale", "float", F32), ("scale_log2", "float", F32),
)

CONVERT_PARAMS = (
    ("dq_acc", "const float*", PTR), ("dq", "elem_t*", PTR), *_strides("dq"),
    ("nq", "int", I32), ("heads", "int", I32), ("d", "int", I32), ("scale", "float", F32),
)


@dataclass(frozen=True)
class RowFamily(Family):
    """Row-wise helpers (preprocess, convert): block_m rows per CTA; no tiles, stages or causal."""

    block_ms: tuple = (32, 64, 128)
    block_ns: tuple = (64,)
    warps: tuple = (4, 8)
    stages: tuple = (2,)
    refills: tuple = (0,)

    def validate(self, spec) -> None:
        super().validate(spec)
        if spec.causal:
            raise ValueError(f"{self.kind}: has no causal variant (use causal=False)")

    def smem_bytes(self, spec) -> int:
        return 0

    def acc_floats(self, spec) -> int:
        return 0


@dataclass(frozen=True)
class BwdTileFamily(Family):
    """bwd_dkdv / bwd_dkdv_nodq / bwd_dq: warp-tiled GEMMs over shared memory."""

    block_ms: tuple = (32, 64, 128)
    block_ns: tuple = (32, 64, 128)
    warps: tuple = (2, 4, 8)
    stages: tuple = (2, 3)
    refills: tuple = (0,)
    max_acc_floats: int = 192
    # What `flashgen tune --kind bwd` searches: every supported tile size (validate drops the warp
    # layouts that do not divide a GEMM, the budget and ptxas the rest); 2 warps never won the sweep.
    tune_space: tuple = (("block_m", (32, 64, 128)), ("block_n", (32, 64, 128)), ("warps", (4, 8)),
                         ("stages", (2, 3)))

    def splits(self, spec) -> dict:
        """Warps along m of each GEMM's output tile (None: the tile cannot be split)."""
        bm, bn, d, w = spec.block_m, spec.block_n, spec.head_dim, spec.warps
        if self.kind == "bwd_dq":
            return {"wa": warp_split(bm, bn, w), "wc": warp_split(bm, d, w)}
        return {"wa": warp_split(bn, bm, w), "wb": warp_split(bn, d, w), "wc": warp_split(bm, d, w)}

    def validate(self, spec) -> None:
        self.require(spec, self.value_rules())
        bad = [k for k, v in self.splits(spec).items() if v is None]
        if bad:
            raise ValueError(f"{self.kind}: {spec.warps} warps cannot tile the {'/'.join(bad)} GEMM(s) of "
                             f"block_m={spec.block_m}, block_n={spec.block_n}, head_dim={spec.head_dim} "
                             "in 16x16 steps")

    def smem_bytes(self, spec) -> int:
        bm, bn, d, st = spec.block_m, spec.block_n, spec.head_dim, spec.stages
        if self.kind == "bwd_dq":
            # Q, dO (once); K, V (ring of `stages`); dS (bm x bn)
            return 2 * (2 * bm * d + 2 * st * bn * d + bm * bn)
        # K, V (once); Q, dO (ring); P, dS (bn x bm); LSE2, D (ring, fp32)
        return 2 * (2 * bn * d + 2 * st * bm * d + 2 * bn * bm) + 4 * 2 * st * bm

    def acc_floats(self, spec) -> int:
        """Live fp32 accumulators per thread at the peak."""
        bm, bn, d, w = spec.block_m, spec.block_n, spec.head_dim, spec.warps * 32
        if self.kind == "bwd_dq":
            return (2 * bm * bn + bm * d) // w          # S, dP and the dQ accumulator
        return (2 * bn * d + 2 * bn * bm) // w          # dK, dV and S^T, dP^T

    def context(self, spec) -> dict:
        ctx = super().context(spec)
        sp = self.splits(spec)
        ctx.update(wa=sp["wa"], wb=sp.get("wb", 0), wc=sp["wc"], dq_atomic=self.kind == "bwd_dkdv")
        return ctx


BWD_FAMILIES = {
    "bwd_preprocess": RowFamily("bwd_preprocess", "bwd_preprocess.cu.j2", PRE_PARAMS, head_dims=MMA_HEAD_DIMS),
    "bwd_dkdv": BwdTileFamily("bwd_dkdv", "bwd_dkdv.cu.j2", DKDV_PARAMS),
    "bwd_dkdv_nodq": BwdTileFamily("bwd_dkdv_nodq", "bwd_dkdv.cu.j2", DKDV_PARAMS),
    "bwd_dq": BwdTileFamily("bwd_dq", "bwd_dq.cu.j2", DQ_PARAMS),
    "bwd_convert": RowFamily("bwd_convert", "bwd_convert.cu.j2", CONVERT_PARAMS),
}
