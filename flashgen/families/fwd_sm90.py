"""fwd_sm90: FlashAttention's forward on Hopper, TMA + mbarriers + wgmma (sm_90a only). templates/fwd_sm90/.

block_m = 64 x consumer warpgroups; warps = 4 x (consumer warpgroups + a
producer warpgroup when warp_specialized). Its own fields: warp_specialized,
pingpong (needs warp_specialized and two or three consumers: they take
turns), softmax_overlap, fma_exp2 (FMA_EXP2S: eighths of S's columns whose exp2
runs on the FMA pipe), early_k_release (needs warp_specialized: separate K and V
empty barriers), lean_softmax, persistent (needs warp_specialized: the grid
sized to the SMs). The grid is 1-D over the tiles, walked in sections of
(batch, head) pairs whose K/V fit in a share of the L2 (causal: longest rows
first, ``tile_sections``). Q, K and V reach the kernel through TMA descriptors
(``launch``), O and the LSE through pointers.

fp8: Q, K and V in float8 e4m3 (one byte an element: a 64-byte swizzle at d = 64), wgmma k32; the
producer warpgroup's warp 0 issues the loads and warps 1-3 transpose each V block into V^T (wgmma takes
FP8 operands K-major only) through two raw V buffers; O is written from the registers. The descale
factors (``FP8_PARAMS``) join the scales per tile. One tile per CTA, contiguous K/V, no mods.

bias_gemm (opt-in; no rule or tuning space takes it yet): a linear bias's column part, causal ALiBi's or a
linear score_mod's slope times the key's column in its block, comes out of S's GEMM as one more k16 step
(bf16 operands: the slope split in three parts from registers, constant columns in a small tile after the V
ring, ``bias_tile_bytes``), so the softmax adds nothing per score.
"""
from __future__ import annotations

import ctypes

from .. import mods, settings, tma
from ..errors import UnsupportedError
from ..problem import ProblemKey, smallest_tile
from ..spec import KernelSpec
from ..variants import PLAIN
from .base import (F32, FP8_PARAMS, FWD_O32_PARAMS, I32, MOD_PARAMS, MOD_ROWS_PARAMS, PTR, TMAP, VARIANT_PARAMS,
                   VARLEN_PARAMS, Family, aligned_struct, check_mod, forward_values, hopper_checks, mod_context,
                   mod_masked, strides, stride_values, variant_context, varlen_pairs)

# The parameter block: the three tensor maps first (each at a 64-byte-aligned offset, as the C
# struct's alignas(64) wants), then what the epilogue and the masks need.
SM90_PARAMS = (
    ("tm_q", "fg_tmap", TMAP), ("tm_k", "fg_tmap", TMAP), ("tm_v", "fg_tmap", TMAP),
    ("o", "elem_t*", PTR), ("lse", "float*", PTR),
    ("dbg_s", "float*", PTR),  # debug only (null in every normal call): S of the first K block
    *strides("o"),
    ("nq", "int", I32), ("nk", "int", I32), ("heads", "int", I32), ("group", "int", I32),
    ("d", "int", I32), ("scale", "float", F32), ("scale_log2", "float", F32),
    # The tile walk (tile_coords in the template): the persistent kernel's two tile counters (next
    # tile, CTAs done; zero between launches; null otherwise), the tile count (m-blocks x heads x
    # batch), the m-blocks per (batch, head), and the L2 sections of (batch, head) pairs: sec_big of
    # sec + 1, then sections of sec (tile_sections).
    ("sched", "int*", PTR), ("tiles", "int", I32), ("m_blocks", "int", I32), ("sec", "int", I32),
    ("sec_big", "int", I32),
    *VARIANT_PARAMS,
    *FWD_O32_PARAMS,
    *VARLEN_PARAMS,
    # Paged K/V (spec.page_rows, with packed rows): the block table (int32, row s: sequence s's pages, in
    # order), its row stride and log2 of the page size in keys (a power of two); the K/V maps then see
    # the cache's pages as batches.
    ("bt", "const int*", PTR), ("bt_stride", "int", I32), ("page_shift", "int", I32),
    # Gathered paged K/V (spec.kv_gather): the caches themselves and their (page, head, row) element strides.
    ("kc", "const elem_t*", PTR), ("vc", "const elem_t*", PTR), *strides("k", "v"),
    *MOD_PARAMS,
    *MOD_ROWS_PARAMS,
    # fp8: the descale factors of q, k and v (fp32), factor (b, h) at b * sb + (h / div) * sh, h the query
    # head for q (div: query heads per factor) and the KV head for k and v (api.fp8.descale_strides).
    *FP8_PARAMS,
)

SM90_HEAD_DIMS = (64, 128, 256)
# fp8's tiles: block_n in V^T panels of whole 64- or 128-byte swizzle rows (192: a 128-key panel and a
# 64-key one), and what a tile supports (refused flags: api errors name them). Whether S, O and P fit the
# consumers' registers is the resource check's (192 keys: 96 accumulators of S a thread; d = 256 spills).
FP8_BLOCK_NS = (64, 128, 192)
# In order of preference, from the FP8 ablations (docs/perf/fp8.md; measured on an H100, none of it on
# an H200 yet), against plain warp specialization: ping-pong at d = 128 (+5-21 %), there over 192-key
# blocks (-7 to +16 % against 128 keys per cell over three runs, +5 % on average), ping-pong with a third
# stage at d = 256 (+0-4 %), overlap with a third stage at d = 64 (+1-7 %).
FP8_TILES = {
    64: ((128, 128, 3, "ws_ov"), (128, 128, 2, "ws"), (128, 64, 2, "ws")),
    128: ((128, 192, 2, "ws_pp"), (128, 128, 2, "ws_pp"), (128, 128, 2, "ws"), (128, 64, 2, "ws")),
    256: ((128, 64, 3, "ws_pp"), (128, 64, 2, "ws")),
}

# The cost model's terms for the flags (``Sm90Family.model_techniques``, from the H200 measurements cited
# there): a K/V step with ping-pong or overlap and a spare stage; with overlap and none; the persistent
# kernel's step (the middle of its 1-5 % loss at 8k-16k); a one-tile CTA's prologue in SM clocks (0.76 us
# at 1.98 GHz; with the 900 clocks of latency every tile already pays in the model, ~1.2 us: the measured
# Q and first-K/V latency was ~1-2 us per tile).
PIPELINE_STEP = 0.92
STARVED_OVERLAP_STEP = 1.25
PERSIST_STEP = 1.03
TILE_PROLOGUE_CLK = 1500

# The default rule: head-dim tile -> (block_m, block_n, stages, name tokens) in order of preference.
# From tuning over both forward families on the H200 (docs/perf/forward-hopper.md): fwd_sm90 won every
# bf16 key; at N >= 2k the winners are 192x128 with warp specialization (d=64; 2 or 3 stages) and
# 128x128, 3 stages, warp specialization and softmax overlap (d=128, most keys; the rest within a few
# per cent). d=256: 128x80 (FA3's tile there), 2 stages, softmax overlap with early K release: with overlap
# and no spare stage the consumers waited on K(j+1) every step (31 % of the warps' samples, H100) until K's
# stage was released apart from V's; 1.12-1.28x cuDNN at N = 4k-16k, 1.25-1.37x the 128x64 tile it
# replaces there, 0.93-1.11x at 1k (H100, docs/perf/forward-hopper.md). The second tile of each fits
# every sm_90a budget.
SM90_TILES = {
    64: ((192, 128, 3, "ws"), (128, 128, 2, "ws")),
    128: ((128, 128, 3, "ws_ov"), (128, 128, 2, "ws")),
    256: ((128, 80, 2, "ws_ov_kr"), (128, 64, 2, "ws")),
}
# Dense keys (no variant: no window, softcap, ALiBi, sinks, packed or paged rows, FP8; the mods ride on them)
# take a first tile by bucket before SM90_TILES': head-dim tile -> ((up to bucket, (block_m, block_n, stages,
# tokens) or None), ...), the first whose bucket holds the key's (None: SM90_TILES' own; 512 was not measured).
# The 192-row tiles the H200's tuned table picks from N = 2k, persistent up to the bucket where the persistent
# kernel's Q ring (the next tile's Q loading during this tile: the 3-stage 128x128 tile at d = 128 has no room
# for it) stops paying: on an H100, one run against the tiles above, forward 1.12-1.19x at d = 64 and
# 0.99-1.18x at d = 128 (N = 1k-2k, causal both), 1.04-1.14x at 4k-16k (docs/perf/forward-hopper.md, "N = 1k").
DENSE_FIRST = {
    64: ((512, None), (4096, (192, 128, 3, "ws_ov_kr_ps")), (16384, (192, 128, 3, "ws_ov_kr_ls"))),
    128: ((512, None), (2048, (192, 80, 3, "ws_ov_ls_ps")), (16384, (192, 80, 3, "ws_ov_ls"))),
}
# The forward's default family on sm_90a when its head-dim tile pads the head dim by at most a third
# (64, 96-128, 192-256: it ran ~1.4-2x fwd_v2's speed at d=64/128, so a third more work still wins);
# fwd_v2 elsewhere (d=32, d=160 on the 256 tile, every other arch).
SM90_MAX_PAD = 4 / 3

# The variants bench's ablation times per head dim (hidden 2048, N = 8k, causal both) and the compile
# tier builds, as name tokens over a 128x128 (d=256: 128x64), two-stage spec: the ladder of the
# Hopper techniques, then each later technique alone and together (early K release, lean softmax, FMA
# exp2 1/2/4), deeper rings, and at d = 64 the 192-row (three consumers) and 192-key tiles.
ABLATION = {
    64: ("", "ws", "ws_pp", "ws_pp_ov", "ws_s3", "ws_pp_s3", "ws_pp_ov_s3",
         "ws_kr", "ws_pp_kr", "ws_pp_ov_kr", "ws_pp_kr_s3", "ws_pp_ov_kr_s3", "ws_pp_kr_ls_s3",
         "ws_pp_fx1_kr_s3", "ws_pp_fx2_kr_s3", "ws_pp_fx4_kr_s3", "ws_pp_fx1_kr_ls_s3", "ws_pp_fx2_kr_ls_s3",
         "ws_pp_ov_fx1_kr_ls_s3", "ws_fx1_kr_ls_s3", "ws_pp_fx1_kr_ls_s4",
         "ws_s3_m192", "ws_pp_kr_s3_m192", "ws_pp_fx1_kr_ls_s3_m192", "ws_pp_ov_fx1_kr_ls_s3_m192",
         "ws_pp_fx1_kr_ls_s3_n192"),
    128: ("", "ws", "ws_pp", "ws_pp_ov", "ws_s3", "ws_pp_s3", "ws_ov_s3", "ws_pp_ov_s3",
          "ws_kr", "ws_pp_kr", "ws_pp_ov_kr", "ws_pp_kr_s3", "ws_pp_ov_kr_s3", "ws_pp_kr_ls_s3",
          "ws_pp_fx1_kr_s3", "ws_pp_fx2_kr_s3", "ws_pp_fx4_kr_s3", "ws_pp_fx1_kr_ls_s3", "ws_pp_ov_kr_ls_s3",
          "ws_kr_ls_s3"),
}


def is_fp8(key: ProblemKey) -> bool:
    """Whether a forward key's inputs are FP8 (its variant carries the fp8 token)."""
    return "fp8" in key.variant.split("_")


def bias_tile_bytes(block_n: int) -> int:
    """Bytes of bias_gemm's B tile (the kernel's fill_bias_tile): 64 per 8 keys of a
    block (four 16-byte rows of their columns, B's k = 0-3) and 128 more, which the GEMM's rows k 4-15 of
    the last keys read (times zeros of A)."""
    return 8 * block_n + 128


def warps_for(block_m: int, warp_specialized: bool) -> int:
    """4 warps per consumer warpgroup (64 rows each), 4 more for the producer warpgroup."""
    return 4 * (block_m // 64 + int(warp_specialized))


def variant(head_dim: int, causal: bool, tokens: str = "ws", dtype: str = "bf16", **fields) -> KernelSpec:
    """The fwd_sm90 spec of the name tokens ``tokens`` ("ws_pp_kr_s3_m192"; "" for no technique) over
    block_m 128, block_n 128 (64 at d = 256) and 2 stages, ``fields`` last; warps follow from block_m and
    warp_specialized. Validated."""
    base = KernelSpec(kind="fwd_sm90", arch="sm_90a", dtype=dtype, head_dim=head_dim, causal=causal,
                      block_m=128, block_n=64 if head_dim == 256 else 128, stages=2)
    spec = base.with_tokens(tokens).replace(**fields)
    return spec.replace(warps=warps_for(spec.block_m, spec.warp_specialized)).validate()


def tile_sections(pairs: int, kv_bytes: int, l2_bytes: int, per: int | None = None,
                  causal: bool = False) -> tuple[int, int]:
    """The tile order's sections: (sec, sec_big) = ``pairs`` (batch, head) pairs split into as few even
    sections (sec_big of sec + 1 pairs, the rest of sec) as keep each at most ``per`` pairs; by default
    ``per`` is what keeps a section's K/V (``kv_bytes`` per pair) within a quarter of the L2 (Hopper's L2
    is two partitions, and data every SM reads may be held in both: half the L2, halved again for what
    else stays there; with half of it the persistent kernel at d = 128, N = 2k ran 6 % slower than pair
    after pair), causal (and a mask_mod's block mask, walked in causal's order) within half of it: its
    tiles are unequal, and more pairs per section balance the SMs better (causal +0.4 to +5.9 % at
    d = 128, +0.4 to +0.8 % at d = 64 in interleaved rounds on the H200, while non-causal with half read
    -1.7 to +1 %). Inside a section the kernel walks m-block by
    m-block over every pair (causal: longest rows first, so the short tiles fill the tail); the hardware
    hands tiles to SMs in that order (docs/perf/forward-hopper.md, "Tile order")."""
    if per is None:
        per = (l2_bytes // (2 if causal else 4)) // max(1, kv_bytes)
    sections = -(-pairs // max(1, per))
    return pairs // sections, pairs % sections


def persist_ctas_per_sm(spec, report, smem_per_sm: int) -> int:
    """CTAs of a persistent kernel one SM holds at once: by shared memory (dynamic + static + the 1 KB
    the driver reserves per block) and by registers (ptxas's count, allocated per warp in units of 8 per
    thread); at least 1. 1 for every tile measured so far (the launch bound is 1)."""
    threads = spec.warps * 32
    by_smem = smem_per_sm // (spec.smem_bytes() + report.static_smem + 1024)
    regs = (max(report.registers, 1) + 7) // 8 * 8
    by_regs = 65536 // (threads * regs)
    return max(1, min(by_smem, by_regs))


class Sm90Family(Family):
    FMA_EXP2S = (0, 1, 2, 4)
    # Dynamic + static shared memory one sm_90a block may use, and what the mbarriers (static) may take.
    SMEM_LIMIT, STATIC_RESERVE = 232448, 256

    def consumers(self, spec) -> int:
        return spec.block_m // 64

    def validate(self, spec) -> None:
        self.require(spec, (("head_dim", self.head_dims), ("block_m", self.block_ms),
                            ("block_n", self.block_ns), ("stages", self.stages), ("arch", self.archs),
                            ("fma_exp2", self.FMA_EXP2S)))
        want = warps_for(spec.block_m, spec.warp_specialized)
        if spec.warps != want:
            raise ValueError(f"{self.kind}: block_m={spec.block_m} with warp_specialized={spec.warp_specialized} "
                             f"means warps={want}, got {spec.warps}")
        if spec.pingpong and not (spec.warp_specialized and self.consumers(spec) >= 2):
            raise ValueError(f"{self.kind}: pingpong needs warp_specialized and two or three consumer "
                             "warpgroups (block_m=128 or 192)")
        if spec.early_k_release and not spec.warp_specialized:
            raise ValueError(f"{self.kind}: early_k_release needs warp_specialized (the producer warpgroup waits "
                             "on the K and V barriers)")
        if spec.persistent and not spec.warp_specialized:
            raise ValueError(f"{self.kind}: persistent needs warp_specialized (the producer warpgroup runs ahead "
                             "into the next tile; without it the loads are issued in line by a consumer)")
        if spec.page_rows and not (spec.varlen and spec.page_rows % 8 == 0 and spec.block_n % spec.page_rows == 0):
            raise ValueError(f"{self.kind}: page_rows={spec.page_rows} must be a multiple of 8 dividing block_n "
                             f"({spec.block_n}), on a varlen spec (paged K/V is a packed-rows call's)")
        if spec.kv_gather and not (spec.page_rows and spec.warp_specialized and not spec.persistent):
            raise ValueError(f"{self.kind}: kv_gather gathers paged rows (page_rows > 0) with the producer warpgroup "
                             "(warp_specialized) of a one-tile-per-CTA kernel (not persistent)")
        check_mod(self, spec)
        if spec.fp8:
            # (lean_softmax: P relative to a max up to 2^8 stale, rounded to e4m3, missed the 2x rule by up to
            # 30 % on an H100; block_m 192: three consumer warpgroups leave the transposing warps too few
            # registers.)
            refused = [f for f, on in (("persistent", spec.persistent), ("page_rows", spec.page_rows),
                                       ("kv_gather", spec.kv_gather), ("varlen", spec.varlen), ("mod", spec.mod),
                                       ("lean_softmax", spec.lean_softmax), ("block_m 192", spec.block_m == 192),
                                       ("warp_specialized off", not spec.warp_specialized)) if on]
            if refused or spec.block_n not in FP8_BLOCK_NS:
                raise ValueError(f"{self.kind}: fp8 runs one tile per CTA with the producer warpgroup (its warps "
                                 f"transpose V), contiguous K/V, no mods and no lean softmax, block_m 64 or 128, "
                                 f"block_n in {FP8_BLOCK_NS}; got "
                                 f"{', '.join(refused) or f'block_n={spec.block_n}'}")
        if spec.bias_gemm:
            self.check_bias_gemm(spec)
        if spec.page_rows and spec.persistent and spec.block_m >= 192:
            raise ValueError(f"{self.kind}: page_rows with persistent at block_m {spec.block_m}: three consumer "
                             "warpgroups leave the producer 32 registers and the paged loads spill them; drop "
                             "persistent (families.paged_spec does)")

    def check_bias_gemm(self, spec, render: bool = False) -> None:
        """``ValueError`` unless ``spec.bias_gemm`` has a linear bias to move into S's GEMM: causal ALiBi with
        no window and no softcap (the bias joins after the cap's tanh), or a score_mod the kernel runs in
        the linear form; bf16/fp16 operands (an fp8 GEMM's k step is 32). A mod pair this process has not
        traced is checked when the kernel is rendered (``render``)."""
        if spec.fp8:
            raise ValueError(f"{self.kind}: bias_gemm adds a k16 step of bf16 operands to S's GEMM; an fp8 spec's "
                             "steps are k32 e4m3: drop bias_gemm or fp8")
        if spec.mod:
            try:
                linear = self.linear_mod(spec)
            except mods.UnknownModError:
                if render:
                    raise
                return
            if not linear:
                raise ValueError(f"{self.kind}: bias_gemm needs a score_mod of the linear form (score + a(b, h) kv + "
                                 f"r(b, h, q): flashgen.mods.linear); mod {spec.mod} has none")
            return
        if not (spec.alibi and spec.causal and not spec.window and not spec.softcap):
            raise ValueError(f"{self.kind}: bias_gemm moves causal ALiBi's column part into S's GEMM: it needs alibi "
                             "and causal, with no window (keys on both sides of the diagonal) and no softcap (the bias "
                             f"joins after its tanh); got {spec.name}")

    def complete(self, knobs: dict) -> dict:
        """warps follows from block_m and warp_specialized: not a knob."""
        out = dict(knobs)
        if "warps" not in out and "block_m" in out:
            out["warps"] = warps_for(out["block_m"], out.get("warp_specialized", False))
        return out

    def searched(self, spec) -> bool:
        """The softmax techniques (fma_exp2, lean_softmax) only with warp specialization: without a
        producer warpgroup the kernel is the plain baseline, slower at every measured point; fma_exp2 only
        at d = 64, the one head dim where the exp2s take as long as the GEMMs (at 128 and 256 they take
        half or less)."""
        return ((spec.warp_specialized or not (spec.fma_exp2 or spec.lean_softmax))
                and (spec.head_dim == 64 or not spec.fma_exp2))

    def q_pieces(self, spec) -> int:
        """Q pieces in shared memory: one per consumer warpgroup (64 rows each); a persistent kernel gets
        a ring of twice that where it fits (the next tile's Q loads during this tile), else one spare
        piece (the first warpgroup's next Q loads while the last finishes this tile), else none."""
        nwg = self.consumers(spec)
        if spec.persistent:
            # (paged K/V: the producer's block-table slots follow the mbarriers in static memory)
            reserve = self.STATIC_RESERVE + (4 * (spec.block_n // spec.page_rows) if spec.page_rows else 0)
            for pieces in (2 * nwg, nwg + 1):
                if self._smem(spec, pieces) + reserve <= self.SMEM_LIMIT:
                    return pieces
        return nwg

    @staticmethod
    def _smem(spec, pieces) -> int:
        # Q pieces of 64 rows, K and V rings, and 1 KB to align the tiles to 1024 bytes (the
        # 128-byte swizzle's period); the mbarriers are static shared memory. fp8: one byte an element,
        # the V ring holds V^T, and two raw V blocks more.
        # bias_gemm: the GEMM's constant B tile after the V ring.
        if spec.fp8:
            return spec.head_dim * (pieces * 64 + 2 * spec.stages * spec.block_n + 2 * spec.block_n) + 1024
        bias = bias_tile_bytes(spec.block_n) if spec.bias_gemm else 0
        return 2 * spec.head_dim * (pieces * 64 + 2 * spec.stages * spec.block_n) + 1024 + bias

    def smem_bytes(self, spec) -> int:
        return self._smem(spec, self.q_pieces(spec))

    def regs(self, spec) -> tuple[int, int]:
        """(producer, consumer) registers per thread after setmaxnreg (only with warp specialization and
        two or three consumers). persistent: the producer's tile loop (fetching tiles, the Q ring)
        spilled at 24 (NVRTC 13.5: 4-8 bytes), so it keeps 40 (two consumers, 232 each) or 32 (three,
        160 each); 128 x 40 + 256 x 232 = 64512 and 128 x 32 + 384 x 160 = 65536 registers."""
        if not spec.warp_specialized:
            return (0, 0)
        if spec.fp8:  # warps 1-3 of the producer transpose V: 64 registers hold a step's 16 words and addresses
            return {2: (64, 216)}.get(self.consumers(spec), (0, 0))
        if spec.persistent:
            return {2: (40, 232), 3: (32, 160)}.get(self.consumers(spec), (0, 0))
        return {2: (24, 240), 3: (24, 160)}.get(self.consumers(spec), (0, 0))

    def model_techniques(self, spec) -> tuple[float, float]:
        """The H200 measurements behind the cost model's view of the flags (docs/perf/forward-hopper.md,
        docs/perf/h200/fwd_ablation.json; docs/perf/tuner.md, "The flags in the cost model"):

        - ping-pong or softmax overlap hide the softmax behind the other GEMMs only with a stage to spare
          (3 or 4 stages, or 2 with early_k_release): then one of them ran 0.875-0.95x warp
          specialization's time in the N = 8k ablation (mean 0.92, d 64/128, causal both; both together
          0.90-0.98, not better than one, so one factor for either or both). With 2 stages and no early
          release the held stage starves the producer: overlap (with or without ping-pong) ran
          1.23-1.33x, ping-pong alone 0.93-1.08x (taken as 1);
        - a one-tile CTA pays each tile's prologue (Q and the first K/V loads, the pipeline filling:
          ~1-2 us of a tile's 4.4 us fixed cost at d = 128) as exposed latency (one CTA per SM: nothing
          else hides it); the persistent kernel's
          producer runs ahead into the next tile and hides it, at a steady-state cost (it lost 1-5 %
          at N = 8k-16k against its twin): so it wins on short tiles (d = 64 causal 2k +10 %) and loses
          on long ones.

        fma_exp2 1, lean_softmax and early_k_release with a spare stage measured within a few per cent
        either way (sign depending on the cell): not modelled."""
        factor = 1.0
        if spec.pingpong or spec.softmax_overlap:
            if spec.stages >= 3 or spec.early_k_release:
                factor *= PIPELINE_STEP
            elif spec.softmax_overlap:
                factor *= STARVED_OVERLAP_STEP
        if spec.persistent:
            return factor * PERSIST_STEP, 0.0
        return factor, TILE_PROLOGUE_CLK

    def acc_floats(self, spec) -> int:
        """Per consumer thread: O (head_dim / 2), S (block_n / 2) and packed P (block_n / 4; fp8 block_n / 8)."""
        return spec.head_dim // 2 + spec.block_n // 2 + spec.block_n // (8 if spec.fp8 else 4)

    def extra_checks(self, spec, profile) -> list[str]:
        return hopper_checks(self, spec, profile, "addressing and softmax state")

    def context(self, spec) -> dict:
        if spec.bias_gemm:
            self.check_bias_gemm(spec, render=True)
        producer, consumer = self.regs(spec)
        return {"params": [(n, c) for n, c, _ in self.params],
                "param_bytes": ctypes.sizeof(self.param_struct()),
                "producer_regs": producer or 24, "consumer_regs": consumer or 240,
                "q_pieces": self.q_pieces(spec), "in_bytes": 1 if spec.fp8 else 2,
                "bias_bytes": bias_tile_bytes(spec.block_n) if spec.bias_gemm else 0,
                **variant_context(spec), **mod_context(spec, linear=self.linear_mod(spec))}

    def param_struct(self):
        return aligned_struct(self)

    # -- problems and rule ----------------------------------------------------
    def tile(self, key: ProblemKey) -> int:
        """64, 128 or 256: rows are whole 128-byte swizzle panels."""
        return smallest_tile(key.head_dim, SM90_HEAD_DIMS)

    def default_for(self, key: ProblemKey) -> bool:
        """sm_90a where the tile pads d by at most a third; FP8 keys always (no other family serves them)."""
        return key.arch == "sm_90a" and (is_fp8(key) or (key.head_dim >= 64
                                                         and self.tile(key) <= SM90_MAX_PAD * key.head_dim))

    def rule(self, key: ProblemKey, budget: int) -> list:
        if not self.runs_on(key.arch):
            raise UnsupportedError(f"fwd_sm90 (wgmma + TMA) needs an sm_90a GPU (H100/H200), not {key.arch}")
        out = []
        tile = self.tile(key)
        rows = (FP8_TILES if is_fp8(key) else SM90_TILES)[tile]
        if not key.variant:  # (the dense keys' first tile per bucket range; a variant key keeps the table's order)
            first = next((row for upto, row in DENSE_FIRST.get(tile, ()) if key.bucket <= upto), None)
            rows = rows if first is None else (first, *rows)
        for bm, bn, st, tokens in rows:
            spec = self.spec(key, block_m=bm, block_n=bn, stages=st).with_tokens(tokens)
            self._fit(out, spec.replace(warps=warps_for(bm, spec.warp_specialized)), budget)
        return self._fitting(out, key, budget)

    def rule_keys(self, arch: str) -> list:
        if not self.runs_on(arch):
            return []
        keys = [ProblemKey("fwd", arch, dt, d, c, 512, variant) for d in SM90_HEAD_DIMS for dt in ("fp16", "bf16")
                for c in (False, True) for variant in ("", "fp8")]
        # (and the dense keys of each later bucket range of DENSE_FIRST)
        return keys + [k.replace(bucket=upto) for k in keys if not k.variant
                       for upto, _ in DENSE_FIRST.get(k.head_dim, ())[1:]]

    # -- launch ---------------------------------------------------------------
    def needs_tile_counters(self, spec) -> bool:
        return spec.persistent

    def launch(self, kern, dims, strides_bhs, o_strides, scale, dev, variant=PLAIN, kv_pages=None):
        """(grid, params_for) of one launch: ``params_for(q_ptr, k_ptr, v_ptr)`` gives the parameter
        block with the three tensor maps filled in (built by the driver, flashgen.tma), kept per address
        triple, so a call that reuses its buffers -- the caching allocator hands the same addresses
        back -- costs one dict lookup and one copy. ``dev``: the device's ``l2_bytes``, ``sms`` and
        ``smem_per_sm``; ``variant`` (flashgen.variants.Variant) the window and softcap values (the slope
        and sink pointers are the caller's). The persistent kernel's tile counters (``sched``,
        ``needs_tile_counters``) are the caller's to set: they belong to its stream.

        Packed rows (``variant.varlen``): ``dims`` = (sequences, h, hk, total_q, total_k, d) and the
        strides' batch entries unused; the maps see one batch of the packed rows, the grid is the bound on
        the device-built work list (``varlen_pairs`` x heads), whose buffer and the sequence pointers are
        the caller's (``vl_tiles``, ``cu_q``, ``cu_k``, ``used_k``).

        Paged K/V (``kv_pages`` = (pages, page size), a ``page_rows`` spec): k and v are caches of
        (pages, page size, hk, d) whose strides ``strides_bhs`` gives as (page, head, row); the K/V maps
        see a page as a batch of page-size rows and copy boxes of ``page_rows`` rows. The block table's
        pointer is the caller's (``bt``)."""
        spec = kern.spec
        b, h, hk, nq, nk, d = dims
        varlen = variant.varlen
        sq, sk, sv = strides_bhs
        values = {**forward_values(dims, strides_bhs, o_strides, scale), **variant.values(nq, nk, scale)}
        template = kern.params(**stride_values("o", o_strides),
                               **{n: values[n] for n in ("nq", "nk", "heads", "group", "d", "scale", "scale_log2",
                                                         *(n for n, _, _ in VARIANT_PARAMS if n in values))},
                               **({n: values[n] for n in ("k_sb", "k_sh", "k_ss", "v_sb", "v_sh", "v_ss")}
                                  if spec.kv_gather else {}))
        m_blocks = (nq + spec.block_m - 1) // spec.block_m
        eb = 1 if spec.fp8 else 2  # bytes per element of q, k, v
        tiles = (varlen_pairs(nq, b, spec.block_m) if varlen else m_blocks * b) * h
        if tiles > 2**31 - 1:
            raise UnsupportedError(f"{tiles} tiles (m-blocks x heads x batch) are past the kernel's 32-bit tile count")
        template.tiles, template.m_blocks = tiles, m_blocks
        if varlen:
            template.seqs, template.sec = b, 1
        else:
            kv_bytes = 2 * nk * spec.head_dim * eb // (h // hk)  # K and V per query head (GQA: shared)
            template.sec, template.sec_big = tile_sections(b * h, kv_bytes, dev.l2_bytes, settings.tile_section(),
                                                           causal=spec.causal or mod_masked(spec))
        mb = 1 if varlen else b
        struct = type(template)
        off_q, off_k, off_v = struct.tm_q.offset, struct.tm_k.offset, struct.tm_v.offset
        # (batch, head, seq) strides reversed: the map's order is (seq, head, batch), innermost first.
        # Passing them unreordered made the map step rows by the batch stride: garbage rows, NaN, and
        # illegal addresses on the first H200 run.
        q_dims, q_str = tma.tensor_dims(d, nq, h, mb, sq[::-1], eb)
        kv_rows, kv_batches, kv_box = nk, mb, spec.block_n
        if (kv_pages is not None) != bool(spec.page_rows):
            raise ValueError(f"{spec.name}: kv_pages={kv_pages} does not go with page_rows={spec.page_rows}")
        if kv_pages is not None:
            kv_batches, kv_rows = kv_pages
            kv_box = spec.page_rows
            if kv_rows & (kv_rows - 1):
                raise UnsupportedError(f"paged K/V: the page size must be a power of two, got {kv_rows}")
            template.page_shift, template.bt_stride = kv_rows.bit_length() - 1, 0
        if nk:
            k_dims, k_str = tma.tensor_dims(d, kv_rows, hk, kv_batches, sk[::-1], eb)
            v_dims, v_str = tma.tensor_dims(d, kv_rows, hk, kv_batches, sv[::-1], eb)
        # Boxes of one swizzle panel's row (128 bytes; fp8 at d = 64: 64) by the tile's rows; Q: one
        # 64-row piece per consumer warpgroup.
        row = min(128, spec.head_dim * eb) // eb
        box_q, box_kv = (row, 64, 1, 1), (row, kv_box, 1, 1)
        dtype, encode, memmove = "e4m3" if spec.fp8 else spec.dtype, tma.encode, ctypes.memmove

        gather = spec.kv_gather

        def fill(params, q_ptr, k_ptr, v_ptr):
            if gather:
                params.kc, params.vc = k_ptr, v_ptr
            base = ctypes.addressof(params)
            memmove(base + off_q, encode(q_ptr, dtype, q_dims, q_str, box_q), 128)
            if nk:
                memmove(base + off_k, encode(k_ptr, dtype, k_dims, k_str, box_kv), 128)
                memmove(base + off_v, encode(v_ptr, dtype, v_dims, v_str, box_kv), 128)
            else:  # no K/V block is ever loaded; a valid map keeps the prefetch harmless
                memmove(base + off_k, base + off_q, 128)
                memmove(base + off_v, base + off_q, 128)

        blank, filled = bytes(template), {}

        def params_for(q_ptr, k_ptr, v_ptr):
            blob = filled.get((q_ptr, k_ptr, v_ptr))
            if blob is None:
                params = struct.from_buffer_copy(blank)
                fill(params, q_ptr, k_ptr, v_ptr)
                blob = bytes(params)
                if len(filled) >= 64:  # addresses churn (fresh tensors every call): keep the cache small
                    filled.clear()
                filled[(q_ptr, k_ptr, v_ptr)] = blob
            return struct.from_buffer_copy(blob)

        if spec.persistent:
            ctas = dev.sms * persist_ctas_per_sm(spec, kern.binary.report, dev.smem_per_sm)
            cap = settings.persist_ctas()  # tests and study: fewer CTAs, more tiles each
            grid = (min(tiles, ctas, cap or ctas), 1, 1)
        else:
            grid = (tiles, 1, 1)
        return grid, params_for


FAMILY = Sm90Family(
    "fwd_sm90", "fwd_sm90/fwd_sm90.cu.j2", SM90_PARAMS, problem="fwd", head_dims=SM90_HEAD_DIMS,
    block_ms=(64, 128, 192), block_ns=(64, 80, 96, 112, 128, 144, 160, 176, 192), warps=(4, 8, 12, 16),
    stages=(2, 3, 4), archs=("sm_90a",), tiles=SM90_TILES, linear_mods=True,
    # wgmma with warp specialization: the fraction of the datasheet rate FlashAttention-3 reports (661 of
    # 989 TFLOP/s at d = 128; arXiv 2407.08608), for the cost model; not fitted.
    tensor_fraction=0.67,
    # warps is implied by block_m and warp_specialized (complete), not searched. fma_exp2 2 and 4 (a
    # quarter / half of the exp2s on the FMA pipe) are not searched: both lost at every H200 ablation
    # cell; fma_exp2 1 (-1/+2 % at d=64) and lean_softmax (-7..+3 %) are mixed, so the tuner decides per
    # key. persistent won 2-5 % at N = 2k-4k and lost up to 10 % at 16k: the tuner decides per key
    # (docs/perf/forward-hopper.md).
    tune_space=(("block_m", (64, 128, 192)), ("block_n", (64, 80, 96, 112, 128, 160, 176, 192)),
                ("stages", (2, 3, 4)), ("warp_specialized", (False, True)), ("pingpong", (False, True)),
                ("softmax_overlap", (False, True)), ("early_k_release", (False, True)),
                ("lean_softmax", (False, True)), ("fma_exp2", (0, 1)), ("persistent", (False, True))))
