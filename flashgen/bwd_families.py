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
- ``bwd_sm90``: the dK/dV kernel (dQ into the fp32 accumulator) for Hopper:
  TMA, mbarriers, wgmma, a producer warpgroup (templates/bwd_sm90.cuh); sm_90a
  only. It serves the ``bwd_dkdv`` problem beside ``bwd_dkdv`` (dispatch.PROBLEM_FAMILIES).

Each kernel does its GEMMs as warp tiles over shared memory; how the warps
split each GEMM's output follows from the spec by ``warp_split`` (so it is not a
spec field: block_m, block_n and warps decide it).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from .families import F32, I32, I64, MMA_HEAD_DIMS, PTR, TMAP, Family, Sm90Family, hopper_checks

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


# bwd_sm90's parameter block: tensor maps first (64-byte aligned, as the C struct's alignas(64)
# wants), Q/K/V/dO in the input dtype with 64-column boxes, and the fp32 dQ accumulator
# (b, h, nq, head_dim tile) with 32-column boxes (the TMA's reduce-add target).
SM90_BWD_PARAMS = (
    ("tm_q", "fg_tmap", TMAP), ("tm_k", "fg_tmap", TMAP), ("tm_v", "fg_tmap", TMAP), ("tm_do", "fg_tmap", TMAP),
    ("tm_dq", "fg_tmap", TMAP),
    ("lse2", "const float*", PTR), ("dsum", "const float*", PTR), ("dq_acc", "float*", PTR),
    ("dk", "elem_t*", PTR), ("dv", "elem_t*", PTR),
    *_strides("dk", "dv"),
    ("nq", "int", I32), ("nk", "int", I32), ("nq_pad", "int", I32), ("heads", "int", I32), ("group", "int", I32),
    ("d", "int", I32), ("scale", "float", F32), ("scale_log2", "float", F32),
)

# How bwd_sm90 adds its dQ parts to the fp32 accumulator (KernelSpec.hint).
DQ_WRITES = {0: "TMA reduce-add from a shared-memory staging tile", 1: "red.global.add.v2.f32 from registers"}


@dataclass(frozen=True)
class Bwd90Family(Family):
    """dK, dV (and dQ into the fp32 accumulator) on Hopper: templates/bwd_sm90.cuh, sm_90a only.

    block_n = 64 x consumer warpgroups (each owns 64 keys); block_m = 64 queries per step;
    warps = 4 x (consumer warpgroups + the producer warpgroup); stages: the Q/dO ring;
    hint: how dQ reaches the accumulator (DQ_WRITES); refill unused (0). Always
    warp-specialized (the producer is not a flag here).
    """

    def consumers(self, spec) -> int:
        return spec.block_n // 64

    def dq_cols(self, spec) -> int:
        """dQ columns each consumer warpgroup computes (its share of the head dim)."""
        return spec.head_dim // self.consumers(spec)

    def validate(self, spec) -> None:
        self.require(spec, (("head_dim", self.head_dims), ("block_m", self.block_ms), ("block_n", self.block_ns),
                            ("stages", self.stages), ("refill", (0,)), ("arch", self.archs)))
        want = 4 * (self.consumers(spec) + 1)
        if spec.warps != want:
            raise ValueError(f"{self.kind}: block_n={spec.block_n} means {self.consumers(spec)} consumer "
                             f"warpgroup(s) and a producer: warps={want}, got {spec.warps}")
        if self.dq_cols(spec) % 32:
            raise ValueError(f"{self.kind}: head_dim={spec.head_dim} does not split into 32-column dQ panels "
                             f"over {self.consumers(spec)} warpgroups")

    def complete(self, knobs: dict) -> dict:
        """block_m is fixed (64) and warps follows from block_n: neither is a knob."""
        out = dict(knobs)
        out.setdefault("block_m", 64)
        if "warps" not in out and "block_n" in out:
            out["warps"] = 4 * (out["block_n"] // 64 + 1)
        return out

    def staging_bytes(self, spec) -> int:
        return 4 * spec.block_m * spec.head_dim if spec.hint == 0 else 0

    def smem_bytes(self, spec) -> int:
        # K, V (once); Q, dO (ring); two dS^T buffers; the fp32 dQ staging tile (hint 0);
        # LSE2 and D rows (ring, fp32); 1 KB to align the tiles to 1024 bytes. Barriers are static.
        bm, bn, d, st = spec.block_m, spec.block_n, spec.head_dim, spec.stages
        return 2 * d * (2 * bn + 2 * st * bm) + 4 * bn * bm + self.staging_bytes(spec) + 8 * st * bm + 1024

    def regs(self, spec) -> tuple[int, int]:
        """(producer, consumer) registers per thread after setmaxnreg (two or more consumers)."""
        return {2: (24, 240), 3: (24, 160)}.get(self.consumers(spec), (0, 0))

    def acc_floats(self, spec) -> int:
        """fp32 values live per consumer thread at the peak: dK and dV (head_dim / 2 each) plus
        S^T and dP^T (block_m / 2 each), or plus packed P^T, dS^T and the dQ part."""
        d, bm = spec.head_dim, spec.block_m
        return d + max(bm, bm // 2 + self.dq_cols(spec) // 2)

    def extra_checks(self, spec, profile) -> list[str]:
        return hopper_checks(self, spec, profile, "addressing")

    def context(self, spec) -> dict:
        producer, consumer = self.regs(spec)
        return {"params": [(n, c) for n, c, _ in self.params], "param_bytes": ctypes.sizeof(self.param_struct()),
                "producer_regs": producer or 24, "consumer_regs": consumer or 240, "dq_n": self.dq_cols(spec),
                "staging_bytes": self.staging_bytes(spec), "dq_write": DQ_WRITES[spec.hint]}

    def param_struct(self):
        return Sm90Family.param_struct(self)  # padded to the C struct's alignas(64) size


BWD_FAMILIES = {
    "bwd_preprocess": RowFamily("bwd_preprocess", "bwd_preprocess.cu.j2", PRE_PARAMS, head_dims=MMA_HEAD_DIMS),
    "bwd_dkdv": BwdTileFamily("bwd_dkdv", "bwd_dkdv.cu.j2", DKDV_PARAMS),
    "bwd_dkdv_nodq": BwdTileFamily("bwd_dkdv_nodq", "bwd_dkdv.cu.j2", DKDV_PARAMS),
    "bwd_dq": BwdTileFamily("bwd_dq", "bwd_dq.cu.j2", DQ_PARAMS),
    "bwd_convert": RowFamily("bwd_convert", "bwd_convert.cu.j2", CONVERT_PARAMS),
    "bwd_sm90": Bwd90Family("bwd_sm90", "bwd_sm90.cu.j2", SM90_BWD_PARAMS, head_dims=(64, 128), block_ms=(64,),
                            block_ns=(64, 128), warps=(8, 12), stages=(2, 3), refills=(0,), hints=tuple(DQ_WRITES),
                            archs=("sm_90a",),
                            tune_space=(("block_n", (64, 128)), ("stages", (2, 3)), ("hint", (0, 1)))),
}
