"""bwd_sm90: the backward's dK/dV kernel (dQ into the fp32 accumulator) on Hopper: TMA, mbarriers, wgmma,
a producer warpgroup (templates/bwd_sm90/), sm_90a only. It serves the ``bwd_dkdv`` problem beside the
mma.sync ``bwd_dkdv`` kernel and runs between the same preprocess and convert kernels (families/bwd.py).

Head-dim tiles 32, 64, 96, 128, and 192 and 256 split (``split``); Q, K, V, dO in swizzle
panels of 64 columns, or of 32 where a warpgroup's columns are an odd multiple of 32. block_n = 64 x
consumer warpgroups (each owns 64 keys; split: two warpgroups over 64 keys); block_m = 64 queries per
step, or 128 without the split (FA3's step at d = 64: S^T / dP^T of m64n128, dQ in two m64 GEMMs); warps =
4 x (consumer warpgroups + the producer warpgroup); stages: the Q/dO ring; ``dq_write``: how dQ reaches the
accumulator (DQ_WRITES). Always warp-specialized (the producer is not a field here).
"""
from __future__ import annotations

import ctypes

from .. import tma, variants
from ..errors import UnsupportedError
from ..problem import ProblemKey, bwd_head_dim_tile
from .base import (F32, I32, MOD_PARAMS, MOD_ROWS_PARAMS, PTR, TMAP, VARIANT_PARAMS, VARLEN_PARAMS, Family,
                   aligned_struct, check_mod, hopper_checks, mod_context, strides, variant_context)

# The parameter block: tensor maps first (64-byte aligned, as the C struct's alignas(64) wants),
# Q/K/V/dO in the input dtype with 64-column boxes, and the fp32 dQ accumulator (b, h, nq, head-dim
# tile) with 32-column boxes (the TMA's reduce-add target).
SM90_BWD_PARAMS = (
    ("tm_q", "fg_tmap", TMAP), ("tm_k", "fg_tmap", TMAP), ("tm_v", "fg_tmap", TMAP), ("tm_do", "fg_tmap", TMAP),
    ("tm_dq", "fg_tmap", TMAP),
    ("lse2", "const float*", PTR), ("dsum", "const float*", PTR), ("dq_acc", "float*", PTR), ("dq_sem", "int*", PTR),
    ("dk", "elem_t*", PTR), ("dv", "elem_t*", PTR),
    *strides("dk", "dv"),
    ("nq", "int", I32), ("nk", "int", I32), ("nq_pad", "int", I32), ("heads", "int", I32), ("group", "int", I32),
    ("d", "int", I32), ("scale", "float", F32), ("scale_log2", "float", F32),
    *VARIANT_PARAMS,
    *VARLEN_PARAMS,
    *MOD_PARAMS,
    *MOD_ROWS_PARAMS,
    ("dq_rot", "int", I32),  # det without a right or left bound: the rotated walk's chunk (det_rotation)
)

# How dQ reaches the fp32 accumulator (KernelSpec.dq_write).
DQ_WRITES = {0: "TMA reduce-add from a shared-memory staging tile", 1: "red.global.add.v2.f32 from registers",
             2: "TMA reduce-add from two staging tiles, issued by a dQ writer warp (dense rows, no mods)",
             3: "red.global.add.v4.f32 from registers, lane pairs swapping a pair of columns (measured below 1; not "
                "in the tune space)",
             4: "TMA reduce-add from one staging tile of a warpgroup's columns, the warpgroups in turn, issued by "
                "the dQ writer warp, beside a one-stage dO ring (dense rows, no mods)",
             5: "as 4, the tile freed panel by panel (the next warpgroup stages a panel once the TMA has read it; "
                "not in the tune space)"}
# The modes whose adds the dQ writer warp issues: it walks dense rows (no packed rows, no mods).
WRITER_DQ = (2, 4, 5)
# The modes with one staging tile of a warpgroup's columns that the warpgroups fill in turn.
HALVES_DQ = (4, 5)

# The default rule: head-dim tile -> (block_n, stages, dq_write) in order of preference; block_m is 64
# and warps = 4 (consumer warpgroups + 1). FA3's shape: two consumer warpgroups of 64 keys and a producer.
# d=64 takes a 3-stage Q/dO ring (shared memory to spare, one CTA per SM either way); d=128 two (three
# fit: 231936 + 64 B of 232448, measured as a variant). Measured 1.6-1.9x the mma.sync kernel's
# backward on the H200 (docs/perf/backward.md), hence the default where it has a tile. d=32 and 96 in
# panels of 64-byte rows (panel_cols): fwd+bwd 1.2-1.3x (32) and 2.2-2.4x (96) the mma.sync path on an
# H100; 32 takes d=64's rings, 96 d=128's. 192 and 256 split (64 keys, two warpgroups over their
# columns), 256 with dQ by red.global (no room for the staging tile): fwd+bwd 2.2-2.4x (192) and
# 1.8-1.9x (256) the mma.sync path on an H100; 256 takes dq_write 5 first (below). (No 160 tile, its 80 columns
# a warpgroup start on no panel: on sm_90a the backward's keys put head dims 129-160 on the 192 tile,
# problem.BWD_TILE_UP.)
BWD_SM90_TILES = {
    32: ((128, 3, 0), (128, 2, 0)),
    64: ((128, 3, 0), (128, 2, 0)),
    96: ((128, 2, 0),),
    128: ((128, 2, 0),),
    192: ((64, 2, 0),),
    256: ((64, 2, 1),),
}
# The dQ writer warp in place of the tile's own dQ write, head-dim tile -> (from which bucket, dq_write,
# whether for keys with variants too; never packed rows, which the writer does not walk): d=64 and 128
# dq_write 2 for plain keys (where it was measured), fwd+bwd on an H100, two runs (docs/perf/backward.md):
# d=64 -1 to +5 % (+2 % on average) at N = 2k-16k; d=128 +2-3 % from 8k, -1 to -4 % at 2k, and with dq_early
# (below) the backward alone 1.03-1.08x dq_write 0 at 1k-2k and 1.01x at 512 (one run), so from 1k. d=256
# dq_write 5 for every key: dq_write 4 measured fwd+bwd 1.25-1.27x the red.global tile at N = 2k and 8k, causal
# both, and 5 (its tile freed panel by panel) 1.00-1.07x dq_write 4 at N = 2k-16k, causal both (H100).
DQ_WRITER_FROM = {64: (2048, 2, False), 128: (1024, 2, False), 256: (512, 5, True)}
# 128 queries a step, first for plain keys (no variant, packed rows or mods: the only keys measured with it),
# head-dim tile -> (block_n, stages, dq_write): FA3's step at d = 64 (S^T / dP^T of m64n128, half the steps and
# their fixed costs); fwd+bwd 1.03-1.12x the 64-query rule's kernel on an H100 at N = 2k and 8k, causal both
# (docs/perf/backward.md). The dQ writer's two staging tiles do not fit beside it (232448 B and 96 B of
# barriers), so the 64-query tiles with the writer follow it.
WIDE_STEP = {64: ((128, 2, 0),)}
# dQ's GEMM between dV's and dK's (KernelSpec.dq_early) on every tile without the split (head dims up to 128):
# the backward alone 1.03-1.06x (d = 64, 128 queries a step) and 1.03-1.08x (d = 128, dq_write 0 and 2) the
# same tile without it at N = 2k-8k, causal both, one run on an H100 (docs/perf/backward.md). complete() sets it,
# for the rule's tiles and the tuner's candidates alike.


# The det twin's walk where every key block sees every query block (no causal mask, no window): CTA j of
# a chunk of R consecutive key blocks starts at query block -j mod M (M query blocks) and walks them
# cyclically, so at each step the chunk's CTAs add to R different blocks, and a block's turns go in the
# order the CTAs reach it (the chunks before first). Walked from block 0 by all of them, the K key blocks
# reached each block at the same step and took their turns one after another (a wavefront as deep as K).
# A CTA may wait for a CTA of its chunk launched after it, so a chunk must fit the GPU at once: at most
# half its SMs (room for a kernel beside it) and DET_ROTATION (docs/perf/backward.md, "The deterministic
# mode").
DET_ROTATION = 64


def splits(head_dim: int) -> bool:
    """Whether a tile of this head dim splits dK and dV by columns over two consumer warpgroups (above 128)."""
    return head_dim > 128


def det_rotation(key_blocks: int, query_blocks: int, sms: int) -> int:
    """The rotated walk's chunk R (the kernel's p.dq_rot): at most the query blocks (two CTAs of a chunk never
    reach a block at the same step), half the SMs and DET_ROTATION; 1 is the walk from block 0."""
    return max(1, min(key_blocks, query_blocks, sms // 2, DET_ROTATION))


class Bwd90Family(Family):
    @staticmethod
    def split(spec) -> bool:
        """Head dims above 128: dK and dV split by columns over two consumer warpgroups of the same 64
        keys (S^T / dP^T by queries, P^T and dS^T through shared memory): each warpgroup's dK/dV for
        all the columns would not fit its registers."""
        return splits(spec.head_dim)

    def consumers(self, spec) -> int:
        return 2 if self.split(spec) else spec.block_n // 64

    def dq_cols(self, spec) -> tuple[int, int]:
        """dQ columns the consumer warpgroups add, (most, fewest): the head dim's 32-column fp32 panels
        split over them, the first warpgroups taking one more where they do not split evenly (d = 96: 64
        and 32; d = 32: 32 and none). Each computes the most (one wgmma shape) and adds its own."""
        panels, wgs = spec.head_dim // 32, self.consumers(spec)
        return -(-panels // wgs) * 32, panels // wgs * 32

    @classmethod
    def panel_cols(cls, spec) -> int:
        """Columns per swizzle panel of the Q, K, V, dO tiles (and their TMA boxes): 64 (128-byte rows)
        where the head dim (split: a warpgroup's half, which must start on a panel) is a multiple of 64,
        else 32 (64-byte rows: d = 32, 96, 192)."""
        d = spec.head_dim // 2 if cls.split(spec) else spec.head_dim
        return 64 if d % 64 == 0 else 32

    def validate(self, spec) -> None:
        self.require(spec, (("head_dim", self.head_dims), ("block_m", self.block_ms), ("block_n", self.block_ns),
                            ("stages", self.stages), ("arch", self.archs), ("dq_write", tuple(DQ_WRITES))))
        check_mod(self, spec)
        if spec.det and (spec.dq_write not in (0, *HALVES_DQ) or spec.varlen or spec.mod):
            raise ValueError(f"{self.kind}: det (deterministic dQ) takes the TMA adds (dq_write 0, 4 or 5) and dense "
                             "rows: no varlen, no mods")
        if spec.dq_write in WRITER_DQ and (spec.varlen or spec.mod):
            raise ValueError(f"{self.kind}: dq_write {spec.dq_write} (the dQ writer warp) walks dense rows: "
                             "no varlen, no mods")
        if spec.dq_write == 5 and len(set(self.dq_cols(spec))) > 1:
            raise ValueError(f"{self.kind}: dq_write 5 frees the staging tile panel by panel, for dQ's columns split "
                             f"evenly over the warpgroups (head_dim={spec.head_dim}, block_n={spec.block_n}: "
                             f"{self.dq_cols(spec)})")
        if spec.dq_early and self.split(spec):
            raise ValueError(f"{self.kind}: dq_early orders the GEMMs of the tile without the split (head dims up to "
                             "128: the split tile's dV and dK read both warpgroups' P^T and dS^T, so all three GEMMs "
                             f"wait for its barrier); got {spec.name}")
        if spec.block_m == 128 and (variants.spec_key(spec) or spec.mod):
            raise ValueError(f"{self.kind}: block_m=128 serves plain keys only (a window, softcap, ALiBi, sinks, packed "
                             f"rows or mods over 128-query blocks have not run on a GPU); got {spec.name}")
        want = 4 * (self.consumers(spec) + 1)
        if spec.warps != want:
            raise ValueError(f"{self.kind}: block_n={spec.block_n} means {self.consumers(spec)} consumer "
                             f"warpgroup(s) and a producer: warps={want}, got {spec.warps}")
        if spec.head_dim % 32:
            raise ValueError(f"{self.kind}: head_dim={spec.head_dim} is not a multiple of 32 (the dQ panels)")
        if self.split(spec) and spec.block_m != 64:
            raise ValueError(f"{self.kind}: head_dim={spec.head_dim} splits S^T / dP^T by queries over 64 a step: "
                             f"block_m=64, got {spec.block_m}")
        if self.split(spec) and spec.block_n != 64:
            raise ValueError(f"{self.kind}: head_dim={spec.head_dim} splits dK/dV by columns over 64 keys: "
                             f"block_n=64, got {spec.block_n}")

    def complete(self, knobs: dict) -> dict:
        """block_m defaults to 64 and warps follows from block_n (above head dim 128: two consumer
        warpgroups whatever block_n): warps is not a knob. dq_early is on where the tile has no split
        (head dims up to 128, ``split``)."""
        out = dict(knobs)
        out.setdefault("block_m", 64)
        split = splits(out.get("head_dim", 0))
        if "head_dim" in out:
            out.setdefault("dq_early", not split)
        if "warps" not in out and "block_n" in out:
            out["warps"] = 4 * ((2 if split else out["block_n"] // 64) + 1)
        return out

    def staging_bytes(self, spec) -> int:
        """The fp32 dQ staging tiles (dq_write 0, 2, 4 and 5): two where a dQ writer adds them (dq_write 2, det on
        dq_write 0), one the consumers write while the writer adds the other; dq_write 4 and 5 one of a
        warpgroup's columns."""
        if spec.dq_write in HALVES_DQ:
            return 4 * spec.block_m * self.dq_cols(spec)[0]
        tiles = {0: 2 if spec.det else 1, 1: 0, 2: 2, 3: 0}[spec.dq_write]
        return tiles * 4 * spec.block_m * spec.head_dim

    def static_smem_bytes(self, spec) -> int:
        """The kernel's mbarriers (bars[] in the template): K/V, three per Q/dO stage, and with the dQ writer a
        full and an empty one per staging tile or warpgroup's turn (dq_write 5: an empty one per panel);
        8 bytes each, 16-byte aligned."""
        writer = spec.det or spec.dq_write in WRITER_DQ
        turns = self.consumers(spec) if spec.dq_write in HALVES_DQ else 2
        panels = self.dq_cols(spec)[0] // 32 if spec.dq_write == 5 else 1
        bars = 1 + 3 * spec.stages + (turns + turns * panels if writer else 0)
        return -(-8 * bars // 16) * 16

    @staticmethod
    def do_stages(spec) -> int:
        """Stages of the dO ring (and its D rows): the Q ring's, or one beside dq_write 4's (5's) staging tile."""
        return 1 if spec.dq_write in HALVES_DQ else spec.stages

    def smem_bytes(self, spec) -> int:
        # K, V (once); Q, dO (rings); two dS^T buffers; the fp32 dQ staging tiles;
        # LSE2 and D rows (rings, fp32); 1 KB to align the tiles to 1024 bytes. Barriers are static.
        # Packed rows: the LSE2 / D rows of a stage are copied from the 16-byte boundary before the tile's
        # first row, 4 floats more each.
        bm, bn, d, st = spec.block_m, spec.block_n, spec.head_dim, spec.stages + self.do_stages(spec)
        rows = bm + (4 if spec.varlen else 0)
        p_t = 4 * bn * bm if self.split(spec) else 0  # split: P^T through shared memory, two buffers as dS^T's
        return 2 * d * (2 * bn + st * bm) + 4 * bn * bm + p_t + self.staging_bytes(spec) + 4 * st * rows + 1024

    def regs(self, spec) -> tuple[int, int]:
        """(producer, consumer) registers per thread after setmaxnreg (two or more consumers). The pool is
        what the launch gave the CTA (168 a thread at 384 threads, the allocation's granularity), so
        128 x 24 + 256 x 240 is all of it: with 32 for the producer warpgroup (det's dQ writer lives
        there) the consumers' setmaxnreg.inc to 240 waited forever (a hang on the H100)."""
        return {2: (24, 240), 3: (24, 160)}.get(self.consumers(spec), (0, 0))

    def acc_floats(self, spec) -> int:
        """fp32 values live per consumer thread at the peak: dK and dV (head_dim / 2 each; split: half
        that) plus S^T and dP^T (block_m / 2 each; split: half that), or plus packed P^T, dS^T and the dQ
        part (one per 64 queries of the block)."""
        d, q = (spec.head_dim // 2, spec.block_m // 2) if self.split(spec) else (spec.head_dim, spec.block_m)
        return d + max(q, q // 2 + spec.block_m // 64 * self.dq_cols(spec)[0] // 2)

    def extra_checks(self, spec, profile) -> list[str]:
        return hopper_checks(self, spec, profile, "addressing")

    def context(self, spec) -> dict:
        producer, consumer = self.regs(spec)
        return {"params": [(n, c) for n, c, _ in self.params], "param_bytes": ctypes.sizeof(self.param_struct()),
                "producer_regs": producer or 24, "consumer_regs": consumer or 240,
                "dq_n": self.dq_cols(spec)[0], "split": self.split(spec),
                "qn": spec.block_m // 2 if self.split(spec) else spec.block_m,
                "dkv_n": spec.head_dim // 2 if self.split(spec) else spec.head_dim,
                "staging_bytes": self.staging_bytes(spec), "do_stages": self.do_stages(spec),
                "dq_write_how": DQ_WRITES[spec.dq_write],
                "dp_late": spec.dp_late, "dq_early": spec.dq_early, "det": spec.det, **variant_context(spec),
                **mod_context(spec, backward=True)}

    def param_struct(self):
        return aligned_struct(self)

    # -- problems and rule ----------------------------------------------------
    def key_tile(self, d: int, arch: str) -> int:
        return bwd_head_dim_tile(d, arch)

    def rule_keys(self, arch: str) -> list:
        """The base keys and, where the rule takes the dQ writer from a later bucket, the same at that bucket."""
        keys = super().rule_keys(arch)
        return keys + [k.replace(bucket=DQ_WRITER_FROM[k.head_dim][0]) for k in keys
                       if k.head_dim in DQ_WRITER_FROM and DQ_WRITER_FROM[k.head_dim][0] > k.bucket]

    @staticmethod
    def writer_mode(key: ProblemKey) -> int | None:
        """The dq_write with the dQ writer warp the rule puts first for ``key`` (DQ_WRITER_FROM), or None."""
        if key.head_dim not in DQ_WRITER_FROM:
            return None
        from_bucket, mode, variants = DQ_WRITER_FROM[key.head_dim]
        served = not key.variant or (variants and "vl" not in key.variant.split("_"))
        return mode if served and key.bucket >= from_bucket else None

    def default_for(self, key: ProblemKey) -> bool:
        return key.arch == "sm_90a" and key.head_dim in BWD_SM90_TILES

    def rule(self, key: ProblemKey, budget: int) -> list:
        if not self.runs_on(key.arch):
            raise UnsupportedError(f"bwd_sm90 (wgmma + TMA) needs an sm_90a GPU (H100/H200), not {key.arch}")
        if key.head_dim not in BWD_SM90_TILES:
            raise UnsupportedError(f"bwd_sm90 has no head-dim tile {key.head_dim} (it serves "
                                   f"{sorted(BWD_SM90_TILES)})")
        writer = self.writer_mode(key)
        out = []

        def add(bm, bn, st, dq):
            knobs = self.complete({"head_dim": key.head_dim, "block_m": bm, "block_n": bn, "stages": st,
                                   "dq_write": dq})
            self._fit(out, self.spec(key, **{k: v for k, v in knobs.items() if k != "head_dim"}), budget)

        for bn, st, dq_write in WIDE_STEP.get(key.head_dim, ()) if not key.variant else ():
            add(128, bn, st, dq_write)
        for bn, st, dq_write in BWD_SM90_TILES[key.head_dim]:
            # the writer's tile first, the rule's own behind it (a budget without room for the writer's staging
            # tiles; mods, which the writer does not take: dispatch.mod_backward_spec)
            for dq in (writer, dq_write) if writer is not None else (dq_write,):
                add(64, bn, st, dq)
        return self._fitting(out, key, budget)

    # -- launch ---------------------------------------------------------------
    def write_maps(self, params, spec, dims, tensors) -> None:
        """Write the five tensor maps into the parameter block (built by the driver, cached per
        address/shape/strides in flashgen.tma). ``dims``: (b, h, hk, nq, nk, d, d_tile); ``tensors``:
        name -> (data_ptr, element strides (batch, head, seq)) for q, k, v, dout and the fp32 dq_acc."""
        b, h, hk, nq, nk, d, d_tile = dims
        struct = type(params)
        cols = self.panel_cols(spec)
        base = ctypes.addressof(params)
        rows = {"q": (nq, h, spec.block_m), "dout": (nq, h, spec.block_m), "k": (nk, hk, spec.block_n),
                "v": (nk, hk, spec.block_n)}
        for name, fld in (("q", "tm_q"), ("k", "tm_k"), ("v", "tm_v"), ("dout", "tm_do")):
            ptr, st = tensors[name]
            n, heads, box = rows[name]
            dims4, strides4 = tma.tensor_dims(d, n, heads, b, st[::-1])
            ctypes.memmove(base + getattr(struct, fld).offset,
                           tma.encode(ptr, spec.dtype, dims4, strides4, (cols, box, 1, 1)), 128)
        ptr, st = tensors["dq_acc"]
        dims4, strides4 = tma.tensor_dims(d_tile, nq, h, b, st[::-1], elem_bytes=4)
        ctypes.memmove(base + struct.tm_dq.offset, tma.encode(ptr, "fp32", dims4, strides4, (32, spec.block_m, 1, 1)),
                       128)


FAMILY = Bwd90Family("bwd_sm90", "bwd_sm90/bwd_sm90.cu.j2", SM90_BWD_PARAMS, problem="bwd_dkdv",
                     head_dims=(32, 64, 96, 128, 192, 256), block_ms=(64, 128), block_ns=(64, 128), warps=(8, 12),
                     stages=(2, 3), archs=("sm_90a",), tiles=BWD_SM90_TILES, gemms=5, query_outer=False,
                     tune_space=(("block_m", (64, 128)), ("block_n", (64, 128)), ("stages", (2, 3)),
                                 ("dq_write", (0, 1, 2, 4))))
