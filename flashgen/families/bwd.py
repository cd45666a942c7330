"""bwd: the backward pass's mma.sync kernels, FlashAttention-2 style (every arch). templates/bwd/.

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
spec field: block_m, block_n and warps decide it). The Hopper dK/dV kernel,
``bwd_sm90``, serves the ``bwd_dkdv`` problem beside ``bwd_dkdv``
(families/bwd_sm90.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..problem import HEAD_DIM_TILES, ProblemKey, bwd_head_dim_tile
from ..spec import DTYPES
from .base import (F32, I32, MOD_PARAMS, PTR, VARIANT_PARAMS, VARLEN_PARAMS, Family, check_mod, mod_context, strides,
                   variant_context, varlen_pairs)

ROW_PAD = 128  # the LSE2 / D buffers hold a multiple of this many rows per (batch, head)

# No 224 tile in the backward: with at most two warps along a 224-wide head dim (14 steps of 16)
# every split keeps >= 112 dK/dV accumulators per thread and spills; d in 193..256 runs on the 256
# tile (problem.bwd_head_dim_tile).
BWD_HEAD_DIMS = tuple(d for d in HEAD_DIM_TILES if d != 224)


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


PRE_PARAMS = (
    ("o", "const elem_t*", PTR), ("dout", "const elem_t*", PTR), ("lse", "const float*", PTR),
    ("dlse", "const float*", PTR), ("dsum", "float*", PTR), ("lse2", "float*", PTR), ("dq_acc", "float*", PTR),
    *strides("o", "dout"),
    ("nq", "int", I32), ("nq_pad", "int", I32), ("heads", "int", I32), ("d", "int", I32),
)

DKDV_PARAMS = (
    ("q", "const elem_t*", PTR), ("k", "const elem_t*", PTR), ("v", "const elem_t*", PTR),
    ("dout", "const elem_t*", PTR), ("lse2", "const float*", PTR), ("dsum", "const float*", PTR),
    ("dq_acc", "float*", PTR), ("dk", "elem_t*", PTR), ("dv", "elem_t*", PTR),
    *strides("q", "k", "v", "dout", "dk", "dv"),
    ("nq", "int", I32), ("nk", "int", I32), ("nq_pad", "int", I32), ("heads", "int", I32), ("group", "int", I32),
    ("d", "int", I32), ("scale", "float", F32), ("scale_log2", "float", F32),
    *VARIANT_PARAMS,
    *VARLEN_PARAMS,
)

DQ_PARAMS = (
    ("q", "const elem_t*", PTR), ("k", "const elem_t*", PTR), ("v", "const elem_t*", PTR),
    ("dout", "const elem_t*", PTR), ("lse2", "const float*", PTR), ("dsum", "const float*", PTR),
    ("dq", "elem_t*", PTR),
    *strides("q", "k", "v", "dout", "dq"),
    ("nq", "int", I32), ("nk", "int", I32), ("nq_pad", "int", I32), ("heads", "int", I32), ("group", "int", I32),
    ("d", "int", I32), ("scale", "float", F32), ("scale_log2", "float", F32),
    *VARIANT_PARAMS,
    *VARLEN_PARAMS,
)

CONVERT_PARAMS = (
    ("dq_acc", "const float*", PTR), ("dq", "elem_t*", PTR), *strides("dq"),
    ("nq", "int", I32), ("heads", "int", I32), ("d", "int", I32), ("scale", "float", F32),
)

# The default rule: kind -> head-dim tile -> (block_m, block_n, warps, stages, causal, arch) in order of
# preference, None meaning any. bwd_dkdv*: block_n keys per CTA, block_m queries per step; bwd_dq:
# block_m queries per CTA, block_n keys per step; the row kernels: block_m rows per CTA (one spec per
# head-dim tile, never causal). From H200 sweeps (docs/perf/backward.md): causal d=64 prefers the
# smaller tile; at d=128 the sweep's winners, 32x128x8 non-causal and 128x64x8 causal (3-4 % faster
# than 64x64x8 there), are spill-free under NVRTC 13.0 and 13.5; 128x64 does not fit sm_80's shared
# memory, 64x64x8 stays as the fallback (shared memory or, with the resource check, spills).
_ROW_TILES = {d: ((64, 64, 4, 2, None, None),) for d in BWD_HEAD_DIMS}
DKDV_TILES = {
    **{d: ((64, 64, 4, 2, True, None), (64, 128, 8, 2, None, None)) for d in (32, 64)},
    **{d: ((64, 64, 8, 2, None, None),) for d in (96, 160)},
    128: ((32, 128, 8, 2, False, None), (128, 64, 8, 2, True, None), (64, 64, 8, 2, None, None)),
    192: ((64, 32, 8, 2, None, None),),
    256: ((64, 32, 8, 2, None, None), (32, 64, 8, 2, None, None)),  # the second fits sm_80
}
DQ_TILES = {
    **{d: ((64, 64, 8, 2, None, None),) for d in (32, 64, 96, 128, 160)},
    **{d: ((64, 32, 8, 2, None, None),) for d in (192, 256)},
}

# How the non-deterministic backward computes dQ with the mma.sync dK/dV kernel (bwd_sm90, where it serves,
# always adds into the accumulator), per head-dim tile: "atomic" (the dK/dV kernel adds
# dS K into an fp32 accumulator, then bwd_convert) or "separate" (bwd_dkdv_nodq + the query-outer
# bwd_dq kernel, the deterministic mode's kernels: two more GEMMs, no atomics). Measured on the H200:
# the separate kernel was 1.16-1.22x faster fwd+bwd at d=128 and 0.87-0.90x at d=64 with scalar
# atomics; with vector atomics and the tiles above, atomic is fastest at d=128 too. d=96 and 160 share
# d=128's old 64x64x8 tile and the separate mode; the rest is unmeasured and stays atomic.
DQ_MODES = ("atomic", "separate")
DQ_MODE = {d: ("separate" if d in (96, 160) else "atomic") for d in BWD_HEAD_DIMS}


def dq_mode(head_dim_tile: int) -> str:
    """The dQ mode of the non-deterministic backward with the mma.sync dK/dV kernel for a head-dim tile
    (``DQ_MODE``)."""
    return DQ_MODE.get(head_dim_tile, "atomic")


@dataclass(frozen=True)
class BwdFamily(Family):
    """What the backward's kinds share: their keys' head-dim tile (no 224)."""

    def key_tile(self, d: int, arch: str) -> int:
        return bwd_head_dim_tile(d, arch)


@dataclass(frozen=True)
class RowFamily(BwdFamily):
    """Row-wise helpers (preprocess, convert): block_m rows per CTA; no tiles, stages or causal."""

    block_ms: tuple = (32, 64, 128)
    block_ns: tuple = (64,)
    warps: tuple = (4, 8)
    stages: tuple = (2,)

    def validate(self, spec) -> None:
        super().validate(spec)
        if spec.causal:
            raise ValueError(f"{self.kind}: has no causal variant (use causal=False)")

    def smem_bytes(self, spec) -> int:
        return 0

    def acc_floats(self, spec) -> int:
        return 0

    def spec(self, key: ProblemKey, **fields):
        return super().spec(key, **fields).replace(causal=False)

    def rule_keys(self, arch: str) -> list:
        return [ProblemKey(self.kind, arch, dt, d, False, 512) for d in self.key_tiles(arch) for dt in DTYPES]


@dataclass(frozen=True)
class BwdTileFamily(BwdFamily):
    """bwd_dkdv / bwd_dkdv_nodq / bwd_dq: warp-tiled GEMMs over shared memory."""

    block_ms: tuple = (32, 64, 128)
    block_ns: tuple = (32, 64, 128)
    warps: tuple = (2, 4, 8)
    stages: tuple = (2, 3)
    max_acc_floats: int = 192
    # What `flashgen tune --kind bwd` searches: every supported tile size (validate drops the warp
    # layouts that do not divide a GEMM, the budget and ptxas the rest); 2 warps never won the sweep.
    tune_space: tuple = (("block_m", (32, 64, 128)), ("block_n", (32, 64, 128)), ("warps", (4, 8)),
                         ("stages", (2, 3)))

    def splits(self, spec) -> dict:
        """Warps along m of each GEMM's output tile (None: the tile cannot be split)."""
        bm, bn, d, w = spec.block_m, spec.block_n, spec.head_dim, spec.warps
        if self.query_outer:
            return {"wa": warp_split(bm, bn, w), "wc": warp_split(bm, d, w)}
        return {"wa": warp_split(bn, bm, w), "wb": warp_split(bn, d, w), "wc": warp_split(bm, d, w)}

    def validate(self, spec) -> None:
        self.require(spec, self.value_rules())
        check_mod(self, spec)
        bad = [k for k, v in self.splits(spec).items() if v is None]
        if bad:
            raise ValueError(f"{self.kind}: {spec.warps} warps cannot tile the {'/'.join(bad)} GEMM(s) of "
                             f"block_m={spec.block_m}, block_n={spec.block_n}, head_dim={spec.head_dim} "
                             "in 16x16 steps")

    def smem_bytes(self, spec) -> int:
        bm, bn, d, st = spec.block_m, spec.block_n, spec.head_dim, spec.stages
        if self.query_outer:
            # Q, dO (once); K, V (ring of `stages`); dS (bm x bn)
            return 2 * (2 * bm * d + 2 * st * bn * d + bm * bn)
        # K, V (once); Q, dO (ring); P, dS (bn x bm); LSE2, D (ring, fp32)
        return 2 * (2 * bn * d + 2 * st * bm * d + 2 * bn * bm) + 4 * 2 * st * bm

    def acc_floats(self, spec) -> int:
        """Live fp32 accumulators per thread at the peak."""
        bm, bn, d, w = spec.block_m, spec.block_n, spec.head_dim, spec.warps * 32
        if self.query_outer:
            return (2 * bm * bn + bm * d) // w          # S, dP and the dQ accumulator
        return (2 * bn * d + 2 * bn * bm) // w          # dK, dV and S^T, dP^T

    def context(self, spec) -> dict:
        ctx = super().context(spec)
        sp = self.splits(spec)
        ctx.update(wa=sp["wa"], wb=sp.get("wb", 0), wc=sp["wc"], dq_atomic=self.gemms == 5, mod=spec.mod,
                   **variant_context(spec))
        ctx.update(mod_context(spec, backward=True))  # (a mod's variant_type replaces the built-in one)
        return ctx


PREPROCESS = RowFamily("bwd_preprocess", "bwd/bwd_preprocess.cu.j2", PRE_PARAMS, head_dims=HEAD_DIM_TILES,
                       tiles=_ROW_TILES, gemms=0)
CONVERT = RowFamily("bwd_convert", "bwd/bwd_convert.cu.j2", CONVERT_PARAMS, tiles=_ROW_TILES, gemms=0)
# The dK/dV kernels own key rows (query_outer False) and do five GEMMs per step with dQ (S^T, dP^T, dV,
# dK, dQ), four without; the dQ kernel owns query rows and does three (S, dP, dQ).
# The dK/dV and dQ kernels also serve user mods (KernelSpec.mod): their captures and block lists follow.
DKDV = BwdTileFamily("bwd_dkdv", "bwd/bwd_dkdv.cu.j2", DKDV_PARAMS + MOD_PARAMS, tiles=DKDV_TILES, gemms=5,
                     query_outer=False)
DKDV_NODQ = BwdTileFamily("bwd_dkdv_nodq", "bwd/bwd_dkdv.cu.j2", DKDV_PARAMS + MOD_PARAMS, tiles=DKDV_TILES, gemms=4,
                          query_outer=False)
# (bwd_dq's block lists, with mods, are the forward's: per query block, BlockMask.for_tile)
DQ = BwdTileFamily("bwd_dq", "bwd/bwd_dq.cu.j2", DQ_PARAMS + MOD_PARAMS, tiles=DQ_TILES, gemms=3)
FAMILIES = (PREPROCESS, DKDV, DKDV_NODQ, DQ, CONVERT)


def common_values(nq: int, nk: int, nq_pad: int, heads: int, heads_kv: int, d: int, scale: float) -> dict:
    """The size and scale parameters the dK/dV and dQ kernels (and bwd_sm90) share."""
    return {"nq": nq, "nk": nk, "nq_pad": nq_pad, "heads": heads, "group": heads // heads_kv, "d": d,
            "scale": scale, "scale_log2": scale * math.log2(math.e)}


def varlen_grid(spec, total_q: int, total_k: int, seqs: int, heads: int, heads_kv: int) -> tuple:
    """The launch grid of a packed-rows call of ``spec`` (bwd_dkdv, bwd_dkdv_nodq or bwd_dq) over ``seqs``
    sequences of ``total_q`` query and ``total_k`` key rows in all: x bounds the work list's (sequence,
    block) pairs (common/varlen.cuh), key blocks of ``block_n`` for the key-outer kernels (one CTA per
    KV head) and query blocks of ``block_m`` for bwd_dq (one per query head); CTAs past the list return."""
    if spec.kind == "bwd_dq":
        return (varlen_pairs(total_q, seqs, spec.block_m), heads, 1)
    return (varlen_pairs(total_k, seqs, spec.block_n), heads_kv, 1)
