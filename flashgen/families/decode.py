"""decode: Flash-Decoding over a contiguous or paged KV cache (templates/decode/).

Generation attends with one (or a few) new query tokens per sequence to a long
KV cache. The ``decode_split`` kernel splits each sequence's keys across CTAs;
each CTA packs the query heads that share one KV head (times the new tokens)
into the 16 rows of one mma tile, so every K/V block is read once per group,
and writes a normalised fp32 partial output and its log-sum-exp into a
workspace; the last CTA of a group to finish merges the group's partials in
split order inside the same launch (``merge_splits``), or, where the caller
asks for it, ``decode_combine`` merges them in a second launch. With one split
the split kernel writes the output itself.

The variants (a sliding window, softcap, ALiBi, sinks: templates/decode/decode_variant.cuh) are
compile-time switches of ``decode_split`` (the spec's window, softcap, alibi and sinks fields) and
their values launch parameters. With a window (left, 0) a CTA's splits cover only the keys from the
first one its rows see (``first_key``), so the kernel reads the window and not the cache before it,
and the split heuristic counts those keys (``window_keys``).

An FP8 cache (the spec's ``fp8``: float8 e4m3 K/V rows, fp32 descale factors) is the same kernel on
rows of head_dim bytes: half the bytes a bf16 cache streams for the same keys. The K/V fragments are
widened to the query's dtype in registers before each mma (templates/decode/decode_fp8.cuh), the K
descale joins the softmax's scale and the V descale the output's normalisation, so the block loop
gains no fp32 work per element; appended tokens are quantized as they are written.

The pure-Python helpers at the end mirror the kernels' index arithmetic (split
ranges, window starts, page lookup, causal limits, the merge) and the FP8 conversions so that they are
tested without a GPU.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from ..gpus import ARCH_SMEM_PER_BLOCK
from ..problem import ProblemKey, smallest_tile
from ..spec import DTYPES, KernelSpec
from ..variants import UNBOUNDED, key_flags
from .. import mods
from .base import F32, I32, I64, MOD_PARAMS, MOD_TOKEN_LIMIT, PTR, Family, first_clean, strides

PAGE_SIZES = (16, 32, 64, 128, 256)
MAX_SPLITS = 128          # the heuristic's ceiling (num_splits= may go higher, up to MAX_SPLITS_USER)
MAX_SPLITS_USER = 1024
ROWS = 16                 # packed query rows per CTA (one m16n8k16 tile)
COMBINE_WARPS = 4
# Head-dim tiles of the decode kernels: inputs with a smaller d are rounded up to the next (chunks
# past d are zero-filled without reading memory).
DECODE_HEAD_DIMS = (32, 64, 128, 256)

# decode_split's K/V load flavours, KernelSpec.kv_load.
KV_LOADS = {0: "cp.async.cg", 1: "cp.async.cg + L2::256B prefetch", 2: "cp.async.cg + L2 evict_first",
            3: "cp.async.cg + L2 evict_first + L2::256B prefetch",
            4: "cp.async.bulk rows + per-warp mbarriers (sm_90a)",
            5: "cp.async.bulk rows + per-warp mbarriers + L2 evict_first (sm_90a)"}
# The bulk loader's flavours (sm_90a only), each with the cp.async flavour that stands in for it elsewhere.
BULK_LOADS = {4: 0, 5: 2}
# Head-dim tiles of an FP8 cache: its ring rows are head_dim bytes, swizzled in 16-byte chunks like a
# 16-bit tile of head_dim / 2 columns, which needs at least four chunks (common/tile.cuh); d <= 32 runs in
# the 64 tile (columns past d are zero-filled without a read, so no byte more is streamed).
FP8_HEAD_DIMS = (64, 128, 256)


def kv_elem_bytes(spec) -> int:
    """Bytes per K/V element in the cache and the ring: 1 for an FP8 cache, else the dtype's 2."""
    return 1 if spec.fp8 else 2


def is_fp8_key(key: ProblemKey) -> bool:
    """Whether a decode_split problem key is one of an FP8 cache (its variant holds the fp8 token)."""
    return key_flags(key.variant)["fp8"]


def kv_load_for(arch: str, kv_load: int) -> int:
    """``kv_load`` where ``arch`` runs it, else its cp.async stand-in (a bulk flavour off sm_90a)."""
    return BULK_LOADS[kv_load] if kv_load in BULK_LOADS and arch != "sm_90a" else kv_load


# k and v are kv_t: elem_t, or bytes for an FP8 cache (the entry template's typedef).
DECODE_PARAMS = (
    ("q", "const elem_t*", PTR), ("k", "const kv_t*", PTR), ("v", "const kv_t*", PTR),
    ("knew", "const elem_t*", PTR), ("vnew", "const elem_t*", PTR),
    ("o", "elem_t*", PTR), ("lse", "float*", PTR), ("o_ws", "float*", PTR), ("lse_ws", "float*", PTR),
    ("seqlens", "const int*", PTR), ("block_table", "const int*", PTR),
    # The in-kernel merge's counters, two ints per (batch, KV head, m-block): a ticket and a count of
    # stored partials, zero between launches (the merging CTA resets its group's); null: the splits only
    # write the workspace (decode_combine merges).
    ("counters", "int*", PTR),
    # (batch or page, seq, head) strides; for a paged cache "_sb" is the page stride.
    *strides("q", "k", "v", "knew", "vnew", "o"),
    ("bt_sb", "long long", I64), ("total_rows", "long long", I64),
    ("nq", "int", I32), ("heads_q", "int", I32), ("group", "int", I32), ("rows", "int", I32),
    ("d", "int", I32), ("seqlen_k", "int", I32), ("page_shift", "int", I32), ("num_splits", "int", I32),
    ("scale", "float", F32), ("scale_log2", "float", F32),
    # An FP8 cache's descale factors (fp32, one per (batch, KV head) at b * sb + hk * sh; strides 0 for
    # one factor); null and 0 for a 16-bit cache. k, v, and their strides, are then in bytes (kv_t).
    ("kd", "const float*", PTR), ("vd", "const float*", PTR), ("kd_sb", "int", I32), ("kd_sh", "int", I32),
    ("vd_sb", "int", I32), ("vd_sh", "int", I32),
    # The variants' values (templates/decode/decode_variant.cuh; zero where the kernel's switch is off):
    # the window's left side (clipped to the longest sequence), the softcap's factor before the tanh (the
    # scale fields then hold the cap: flashgen.variants.Variant.values), the ALiBi slopes (fp32, (heads_q,)
    # or (batch, heads_q): batch stride 0 or heads_q) and the sinks (fp32, (heads_q,)).
    ("win_left", "int", I32), ("cap_in", "float", F32), ("alibi_sb", "int", I32),
    ("alibi", "const float*", PTR), ("sinks", "const float*", PTR),
    # User mods (templates/decode/decode_mod.cuh): their captured tensors; no block mask (zero).
    *MOD_PARAMS,
)

COMBINE_PARAMS = (
    ("o_ws", "const float*", PTR), ("lse_ws", "const float*", PTR), ("o", "elem_t*", PTR), ("lse", "float*", PTR),
    ("total_rows", "long long", I64), ("nq", "int", I32), ("heads_q", "int", I32), ("d", "int", I32),
    ("num_splits", "int", I32),
)

# ----------------------------------------------------------------- default rule

# Per head-dim tile: (block_n, warps, stages, kv_load) in order of preference; the first whose shared
# memory fits the device's per-block budget is used (a bulk flavour, 4 or 5, runs as its cp.async
# stand-in off sm_90a: kv_load_for). d=128 is measured on the H200 (docs/perf/decode.md, "Tiles"):
# n128 w4 s2 with the evict_first flavour (135 KB: one CTA per SM, 64 KB of K/V in flight) was the best
# or within noise of the best of 10 tiles on every case in two interleaved A/Bs with cuDNN (b1/hk32
# 1.006x/1.005x cuDNN at L=32k/128k, b8/hk8/L128k 1.009x, b32 1.011-1.026x), where per-case tiles
# (n64 w4 s3 h2, two per SM; n64 w4 s2, three per SM) stayed at 0.989-0.998x on three of them. The
# other head dims keep the first rule's tiles (not measured).
DEFAULT_DECODE_TILES = {
    32: ((64, 2, 4, 0), (32, 2, 2, 0)),
    64: ((64, 4, 4, 0), (32, 2, 2, 0)),
    128: ((128, 4, 2, 2), (64, 4, 3, 2), (64, 4, 2, 0), (32, 2, 4, 0), (32, 2, 2, 0)),
    256: ((32, 2, 3, 0), (32, 2, 2, 0)),
}
# Per-regime tiles tried before DEFAULT_DECODE_TILES[d] (decode_regime picks the regime): "few" (so
# few batch x KV head x m-block groups that a 2-CTA/SM tile would need more than MERGE_SPLITS splits
# to fill the GPU), "some", "full" (the groups alone give every SM a CTA, but at most two) and "many"
# (more than two per SM). "some": a third ring stage (196 KB, still one CTA per SM, two blocks in
# flight) gained 0.2-0.9 % in two interleaved A/Bs on the one-wave cases of 2-4 splits (b1/hk32,
# b8/hk8 at 32k and 128k keys) and lost 1-2 % on b32 (two waves, no split) and 0.5-1 % on "few"
# (16 splits); it needs sm_90's per-block budget. "full": n64 w4 s2 (68 KB, three CTAs per SM) runs
# every group in one wave, where the one-CTA-per-SM tile runs a second wave a few CTAs short of
# filling HBM when the groups barely exceed the SMs: 160 groups (b5/hk32, b20/hk8) 4.38-4.39 TB/s
# against 3.81 (+15 %), 256 groups -0.1 to +0.4 %; with more than two groups per SM ("many", b48/hk8,
# b64/hk8) it lost 0.6 % and 8 %, so those keep n128 w4 s2. These tiles were measured on the H200
# only: other archs take DEFAULT_DECODE_TILES (on sm_80 the 3-CTA/SM n64 tile spills under its
# launch bounds).
DECODE_TILES_BY_REGIME: dict = {128: {"some": ((128, 4, 3, 2),), "full": ((64, 4, 2, 2),)}}
REGIME_TILE_ARCHS = ("sm_90a",)
REGIMES = ("few", "some", "full", "many")
# An FP8 cache's tiles (spec.fp8), per head-dim tile as DEFAULT_DECODE_TILES, for every regime. Chosen by
# bytes, not measured yet (docs/perf/decode.md, "FP8 cache"): 128 keys of K and V are 32 KB at d = 128,
# so 128/4/2 keeps the 16-bit tile's keys per block and warps in 68 KB, and an SM holds two such CTAs
# (194 registers) where it held one 16-bit CTA: the widening adds integer work per key, and more warps
# per SM hide its latency. A load pass covers 32 * warps * 16 / head_dim rows, which must divide 16 (so
# d = 64 takes two warps), and the epilogue's scratch must fit in the ring. Four-warp tiles with 16 keys
# per warp at d = 128 (64/4/3) spill under ptxas's 168-register choice for them (NVRTC 13.0), so the
# fallback there has two warps of 32 keys.
DEFAULT_DECODE_TILES_FP8 = {
    64: ((128, 2, 4, 0), (64, 2, 4, 0)),
    128: ((128, 4, 2, 2), (64, 2, 3, 2)),
    256: ((32, 2, 4, 0), (64, 2, 2, 0)),
}
# More splits than this only where one CTA per SM needs them (num_splits_heuristic): each split adds
# a partial (fp32 O + LSE) to write and merge, and the merge is the kernel's tail.
MERGE_SPLITS = 16


def decode_regime(work: int, sms: int) -> str:
    """Which per-regime tile serves ``work`` = batch * heads_kv * m_blocks CTAs (before splitting) on a
    GPU of ``sms`` SMs: "many" when they give every SM more than two CTAs, "full" when they give every
    SM one or two, "few" when a tile of two CTAs per SM would need more than MERGE_SPLITS splits to
    fill the GPU, else "some"."""
    work = max(1, work)
    if work > 2 * sms:
        return "many"
    if work >= sms:
        return "full"
    if 2 * sms // work > MERGE_SPLITS:
        return "few"
    return "some"


@dataclass(frozen=True)
class DecodeSplitFamily(Family):
    """One split of the keys (templates/decode/decode_split.cuh).

    One CTA owns 16 packed query rows (the query heads of one KV head times the
    new tokens) and one split of one sequence's keys; its warps share those rows
    and each takes block_n / warps keys of every block_n-key block. Fixed
    fields: block_m = 16, causal = True (bottom-right aligned). ``kv_load``
    picks the K/V load flavour (KV_LOADS): 0 plain ``cp.async.cg``, 1 with the
    ``.L2::256B`` prefetch hint, 2 with an evict_first L2 cache policy, 3 both;
    4 and 5 (sm_90a only) the bulk loader: one ``cp.async.bulk`` per K/V row
    into rows padded by 16 bytes, per-warp mbarriers (5 with evict_first).
    """

    def validate(self, spec) -> None:
        self.require(spec, (*self.value_rules(), ("causal", (True,)), ("kv_load", tuple(KV_LOADS))))
        if spec.block_n % (16 * spec.warps):
            raise ValueError(f"{self.kind}: block_n={spec.block_n} must split into 16-key slices over "
                             f"{spec.warps} warps")
        if spec.fp8:
            self.require(spec, (("head_dim", FP8_HEAD_DIMS),))
            if spec.kv_load in BULK_LOADS:
                loads = ", ".join(str(h) for h in KV_LOADS if h not in BULK_LOADS)
                raise ValueError(f"{self.kind}: kv_load={spec.kv_load} (cp.async.bulk rows) does not load an FP8 "
                                 f"cache (fp8 takes kv_load {loads})")
        # The K/V loader covers 32*warps 16-byte chunks per pass, rows of head_dim * kv_elem_bytes bytes; a
        # pass must stay inside one 16-row group (one page of a paged cache).
        chunks = 32 * spec.warps * 16
        row = spec.head_dim * kv_elem_bytes(spec)
        step = chunks // row
        if chunks % row or step == 0 or 16 % step:
            raise ValueError(f"{self.kind}: {spec.warps} warps do not tile head_dim={spec.head_dim} rows"
                             f"{' of FP8' if spec.fp8 else ''} (rows per load pass must divide 16)")
        if not 0 <= spec.mod < MOD_TOKEN_LIMIT:
            raise ValueError(f"{self.kind}: mod={spec.mod} is not a mod token (0 <= mod < 2^48)")
        if spec.mod and (spec.window or spec.softcap or spec.alibi or spec.sinks or spec.fp8):
            raise ValueError(f"{self.kind}: mod={spec.mod} takes no built-in variant (window, softcap, alibi, sinks) "
                             "and no FP8 cache: a mod expresses its own mask and scores")
        if spec.kv_load in BULK_LOADS and spec.arch != "sm_90a":
            raise ValueError(f"{self.kind}: kv_load={spec.kv_load} (cp.async.bulk) needs sm_90a, not {spec.arch}")
        # The epilogue merges the warps through fp32 scratch in the K/V ring (the template's static_assert).
        ring = 2 * spec.stages * spec.block_n * self.row_bytes(spec)
        scratch = 4 * (spec.warps * 16 * (spec.head_dim + 4) + 16 * spec.head_dim)
        if scratch > ring:
            raise ValueError(f"{self.kind}: the epilogue's {scratch} B of scratch do not fit in the {ring} B K/V "
                             "ring it reuses (more keys per block or more stages)")

    def row_bytes(self, spec) -> int:
        """Bytes of one K or V row in the ring: head_dim elements of the cache's type, padded by 16 bytes
        for the bulk loader (its copies cannot swizzle)."""
        return spec.head_dim * kv_elem_bytes(spec) + (16 if spec.kv_load in BULK_LOADS else 0)

    def smem_bytes(self, spec) -> int:
        # Q tile (16 rows) + K and V rings; the cross-warp reduction reuses both. The bulk loader adds
        # 2 * stages * warps mbarriers. decode_smem_bytes() in the template is the same formula (static_assert).
        bulk = spec.kv_load in BULK_LOADS
        return (2 * spec.head_dim * 16 + 2 * spec.stages * spec.block_n * self.row_bytes(spec)
                + (16 * spec.stages * spec.warps if bulk else 0))

    def acc_floats(self, spec) -> int:
        return (spec.head_dim // 8 + spec.block_n // spec.warps // 8) * 4

    def context(self, spec) -> dict:
        """Adds ``min_ctas``, the bulk loader's __launch_bounds__ minimum: the CTAs an sm_90a SM holds by
        shared memory (plus the driver's 1 KB each). Without it ptxas caps those kernels at 128 registers
        and the n128 tile spills; with it ptxas may use what that residency leaves. 0: no minimum given
        (the cp.async kernels keep their plain bounds). And ``variant_type``, the decode_variant
        instantiation of the spec's window, softcap, alibi and sinks switches (with user mods the
        decode_mod_variant of the traced pair, whose functions are ``mod_source``)."""
        ctx = super().context(spec)
        per_sm = ARCH_SMEM_PER_BLOCK["sm_90a"] + 1024
        ctx["min_ctas"] = max(1, per_sm // (self.smem_bytes(spec) + 1024)) if spec.kv_load in BULK_LOADS else 0
        flags = (spec.window, spec.softcap, spec.alibi, spec.sinks)
        ctx["variant_type"] = "decode_variant<" + ", ".join("true" if f else "false" for f in flags) + ">"
        ctx["mod_source"] = ""
        if spec.mod:  # user mods: the traced pair's functions (this process must have traced them)
            pair = mods.of_number(spec.mod)
            ctx["mod_source"] = pair.cuda()
            flags = (pair.score is not None, pair.mask is not None)
            ctx["variant_type"] = "decode_mod_variant<" + ", ".join("true" if f else "false" for f in flags) + ">"
        return ctx

    def key_tile(self, d: int, arch: str) -> int:
        return smallest_tile(d, DECODE_HEAD_DIMS)

    def tile(self, key: ProblemKey) -> int:
        """The key's head-dim tile, or for an FP8 cache the FP8 tile that covers it (FP8_HEAD_DIMS)."""
        return smallest_tile(key.head_dim, FP8_HEAD_DIMS) if is_fp8_key(key) else key.head_dim

    def rule(self, key: ProblemKey, budget: int, regime: str = "some") -> list:
        """The rule's tiles for the regime (``decode_regime``) that fit ``budget``, in order (an FP8
        cache: DEFAULT_DECODE_TILES_FP8, the same in every regime)."""
        if regime not in REGIMES:
            raise ValueError(f"regime {regime!r} not in {REGIMES}")
        d = self.tile(key)
        if is_fp8_key(key):
            tiles = DEFAULT_DECODE_TILES_FP8[d]
        else:
            by_regime = DECODE_TILES_BY_REGIME.get(d, {}).get(regime, ()) if key.arch in REGIME_TILE_ARCHS else ()
            tiles = by_regime + DEFAULT_DECODE_TILES[d]
        out = []
        for bn, w, st, load in tiles:
            self._fit(out, self.spec(key, block_m=ROWS, block_n=bn, warps=w, stages=st,
                                     kv_load=kv_load_for(key.arch, load)).replace(causal=True), budget)
        return self._fitting(out, key, budget)

    def rule_specs(self, arch: str, budget: int) -> list:
        """Every spec the rule can pick on ``arch`` under ``budget`` (for the compile tier): each head-dim
        tile, dtype and regime, with a 16-bit and with an FP8 cache."""
        out = []
        for d in DECODE_HEAD_DIMS:
            for dtype in DTYPES:
                for variant in ("", "fp8"):
                    key = ProblemKey(self.kind, arch, dtype, d, True, 512, variant)
                    for regime in REGIMES:
                        spec = self.rule(key, budget, regime)[0]
                        if spec not in out:
                            out.append(spec)
        return out


@dataclass(frozen=True)
class DecodeCombineFamily(Family):
    """Merges the splits' partial outputs by their log-sum-exps (templates/decode/decode_combine.cuh).

    Tunable: warps only. The tile fields it does not use are fixed (block_m =
    block_n = 16, stages = 2, causal = False) so one kernel has one name.
    """

    def validate(self, spec) -> None:
        self.require(spec, (("head_dim", self.head_dims), ("warps", self.warps), ("block_m", (16,)),
                            ("block_n", (16,)), ("stages", (2,)), ("causal", (False,)), ("arch", self.archs)))
        if spec.head_dim // 4 > 32 * spec.warps:
            raise ValueError(f"{self.kind}: a row of head_dim={spec.head_dim} needs {spec.head_dim // 4} threads, "
                             f"more than {spec.warps} warps")

    def smem_bytes(self, spec) -> int:
        return 0

    def acc_floats(self, spec) -> int:
        return 4

    def key_tile(self, d: int, arch: str) -> int:
        return smallest_tile(d, DECODE_HEAD_DIMS)

    def rule(self, key: ProblemKey, budget: int) -> list:
        """The one combine kernel of the key's (arch, dtype, head-dim tile): it needs no shared memory."""
        return [self.spec_for(key.arch, key.dtype, key.head_dim)]

    def spec_for(self, arch: str, dtype: str, head_dim: int) -> KernelSpec:
        """The one combine kernel of a (arch, dtype, head-dim tile)."""
        return KernelSpec(kind=self.kind, arch=arch, dtype=dtype, head_dim=head_dim, block_m=16, block_n=16,
                          warps=COMBINE_WARPS, stages=2, causal=False).validate()

    def rule_specs(self, arch: str, budget: int) -> list:
        return [self.spec_for(arch, dt, d) for d in DECODE_HEAD_DIMS for dt in DTYPES]


SPLIT = DecodeSplitFamily("decode_split", "decode/decode_split.cu.j2", DECODE_PARAMS, head_dims=DECODE_HEAD_DIMS,
                          block_ms=(ROWS,), block_ns=(16, 32, 48, 64, 96, 128), stages=(2, 3, 4, 5, 6, 8, 10, 12),
                          untuned_reason="its tile and split count are chosen per call from batch x KV heads "
                          "against the SMs (decode_regime, num_splits_heuristic; docs/perf/decode.md), which "
                          "a table key does not hold, so a tuned entry could not follow them")
COMBINE = DecodeCombineFamily("decode_combine", "decode/decode_combine.cu.j2", COMBINE_PARAMS,
                              head_dims=DECODE_HEAD_DIMS, untuned_reason="the study's two-launch merge, "
                              "not dispatched by the torch layer")
FAMILIES = (SPLIT, COMBINE)


def first_rule_spec(key: ProblemKey, budget: int, regime: str = "some", check=None) -> KernelSpec:
    """The rule's first tile for the regime that fits ``budget``; with ``check`` (spec -> problems) a
    fitting tile the local NVRTC would refuse gives way to the next fitting one."""
    return first_clean(SPLIT.rule(key, budget, regime), check)


# ----------------------------------------------------------------- split heuristic


def num_splits_heuristic(batch: int, heads_kv: int, m_blocks: int, seqlen_k: int, block_n: int, sms: int,
                         ctas_per_sm: int = 1, max_splits: int = MAX_SPLITS, fill_slots: bool = False) -> int:
    """How many splits of the keys to launch: fill one wave of SM slots, but past MERGE_SPLITS
    splits only as far as one CTA per SM.

    ``work`` = batch * heads_kv * m_blocks CTAs without splitting, ``slots`` =
    sms * ctas_per_sm CTAs resident at once. No split when work already fills
    80 % of the slots (as FlashAttention-2's rule, KERNELS.md section 4).
    Otherwise the split kernel is memory-bound and its bandwidth grows with the
    CTAs in flight, so s goes as high as one wave of slots allows (work * s <=
    slots, s <= max_splits and <= the key blocks) -- except that more than
    MERGE_SPLITS splits are taken only up to one CTA per SM (work * s <= sms):
    every split is one more partial to write and merge, and the merge is the
    kernel's tail. Then s goes down to the fewest splits with the same critical
    path ceil(blocks / s) (fewer partials to merge).

    Measured on the H200 (docs/perf/decode.md, "The split heuristic"):
    with two CTAs per SM (n64 w4 s3) b1/hk8/L128k ran 4.04 TB/s at 16 splits
    and 3.95 at 33 (one full wave of slots), b8/hk8 4.48-4.50 at 4 (a full
    wave) and 4.45 at 2; with one CTA per SM (n128 w4 s2) b1/hk8 4.05 at 16,
    b8/hk8/L4k 3.20 at 2 (2.92 at 4).
    ``seqlen_k`` is the most keys one CTA can read: the cache's capacity (actual
    lengths live on the GPU), or with a window the keys it spans (``window_keys``).

    ``fill_slots`` (an FP8 cache) drops the one-CTA-per-SM limit past MERGE_SPLITS: one wave of
    slots at any split count. That limit holds where one CTA per SM already reads faster than HBM
    serves (the 16-bit kernel: 74.5 GB/s per CTA, 9.8 TB/s over 132 SMs); an FP8 CTA reads its keys at
    half the bytes but widens every K/V element to 16 bits, so per key it does more work than the
    16-bit CTA, and one CTA per SM is predicted to fall short of HBM (docs/perf/decode.md, "FP8 cache").
    """
    slots = max(1, sms * ctas_per_sm)
    work = max(1, batch * heads_kv * m_blocks)
    n_blocks = max(1, -(-seqlen_k // block_n))
    if work >= 0.8 * slots:
        return 1
    top = min(max_splits, n_blocks, slots // work)
    if top > MERGE_SPLITS and not fill_slots:
        top = min(top, max(MERGE_SPLITS, sms // work))
    top = max(1, top)
    per = -(-n_blocks // top)
    return -(-n_blocks // per)  # the fewest splits of `per` blocks that cover them


def ctas_per_sm(smem_bytes: int, threads: int, registers: int, smem_per_sm: int, regs_per_sm: int = 65536,
                max_threads: int = 2048) -> int:
    """Resident CTAs per SM from shared memory (plus the 1 KB the driver reserves per CTA), registers
    (allocated per warp in units of 256) and threads."""
    by_smem = smem_per_sm // (smem_bytes + 1024) if smem_bytes else 32
    regs_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = regs_per_sm // (regs_warp * (threads // 32))
    return max(1, min(by_smem, by_regs, max_threads // threads, 32))


# ----------------------------------------------------------------- index arithmetic (mirrors the kernel)


def split_range(length: int, num_splits: int, split: int, block_n: int, first: int = 0) -> tuple[int, int]:
    """Keys [begin, end) of split ``split`` of the keys [first, length) of a sequence (``first`` a
    multiple of ``block_n``: 0, or a window's ``first_key``): whole blocks of ``block_n``,
    ceil(blocks / num_splits) per split; an empty range has end <= begin."""
    blocks = -(-(length - first) // block_n)
    per = -(-blocks // num_splits)
    return first + split * per * block_n, min(length, first + (split + 1) * per * block_n)


def first_key(first_row: int, group: int, length: int, nq: int, left: int, block_n: int) -> int:
    """The first key the splits of a CTA cover (decode_variant::first_key): 0 without a window (``left``
    -1), else the first key its first packed row ``first_row`` sees (token first_row // group, of a
    sequence of ``length`` keys with ``nq`` new tokens), rounded down to a block of ``block_n``."""
    if left == UNBOUNDED:
        return 0
    return max(0, first_row // group + length - nq - left) // block_n * block_n


def split_keys(length: int, nq: int, group: int, rows: int, m_block: int, num_splits: int, split: int,
               block_n: int, left: int = UNBOUNDED) -> tuple[int, int, int]:
    """(n_begin, n_end, n_blocks) of one CTA of decode_split (its constructor's arithmetic): split
    ``split`` of m-block ``m_block`` (packed rows 16 m_block .. of ``rows``) over a sequence of ``length``
    keys (appended ones included) with ``nq`` new tokens and a window's ``left`` side (-1: none). The CTA
    reads the K/V rows [n_begin, n_end) (the rows of its n_blocks blocks past n_end are zero-filled
    without a read)."""
    r0 = m_block * ROWS
    last = min(r0 + ROWS - 1, rows - 1)
    kv_end = max(0, min(length, last // group + length - nq + 1))
    begin, split_end = split_range(length, num_splits, split, block_n,
                                   first_key(r0, group, length, nq, left, block_n))
    n_end = min(kv_end, split_end)
    return begin, n_end, (-(-(n_end - begin) // block_n) if n_end > begin else 0)


def window_keys(capacity: int, nq: int, left: int) -> int:
    """The most keys one CTA reads in a cache of ``capacity`` keys (appended ones included) with ``nq``
    new tokens and a window's ``left`` side (-1: none, every key): its rows' windows span at most
    left + nq keys (less a block's rounding, which the heuristic's block count covers)."""
    return capacity if left == UNBOUNDED else max(1, min(capacity, left + nq))


def key_limit(row: int, group: int, length: int, nq: int) -> int:
    """Exclusive key limit of packed row ``row`` (token row // group): bottom-right causal."""
    return min(length, row // group + length - nq + 1)


def key_first(row: int, group: int, length: int, nq: int, left: int) -> int:
    """The first key packed row ``row`` sees under a window's ``left`` side (-1: 0), as the kernel's mask
    takes it (it may be negative: no key hidden)."""
    return 0 if left == UNBOUNDED else row // group + length - nq - left


def kv_source(key: int, len_cache: int, page_size: int | None, block_table_row=None):
    """Where the kernel reads key ``key`` of a sequence with ``len_cache`` cached keys:
    ``("new", i)`` (row i of k_new/v_new), ``("cache", page, row)`` for a paged cache or
    ``("cache", None, key)`` for a contiguous one."""
    if key >= len_cache:
        return ("new", key - len_cache)
    if page_size is None:
        return ("cache", None, key)
    shift = page_size.bit_length() - 1
    return ("cache", int(block_table_row[key >> shift]), key & (page_size - 1))


def window_pages(table_row, n_begin: int, n_blocks: int, n_end: int, len_cache: int, block_n: int,
                 page_size: int) -> list:
    """The pages decode_split's loader uses for each 16-row group of blocks 0..n_blocks of a split (one
    past the last, as the kernel's lookahead does), through its per-warp block-table window: 64
    entries in two 32-lane registers, stepped by 32 when a block starts past the lower half. Mirrors
    ``fetch_pages`` in templates/decode/decode_split.cuh; raises AssertionError where the kernel's shuffle
    index would leave the window. Unused groups (past n_end or the cached length) get 0."""
    shift = page_size.bit_length() - 1
    tab_len = len(table_row)

    def load(start):
        return [table_row[start + i] if start + i < tab_len else 0 for i in range(32)]

    wb = n_begin >> shift
    lo, hi = load(wb), load(wb + 32)
    out = []
    for jb in range(n_blocks + 1):
        n0 = n_begin + jb * block_n
        if (n0 >> shift) - wb >= 32:
            wb += 32
            lo, hi = hi, load(wb + 32)
        pages = []
        for e in range(block_n // 16):
            key0 = n0 + e * 16
            idx = (key0 >> shift) - wb
            assert 0 <= idx < 64, (n0, key0, wb, idx)
            pages.append((lo if idx < 32 else hi)[idx & 31] if key0 < n_end and key0 < len_cache else 0)
        out.append(pages)
    return out


def merge_chunk(num_splits: int) -> int:
    """Splits the merge reads per round trip (CH of merge_splits, templates/decode/decode_merge.cuh): 4, 8 or 16,
    no more loads and exponentials than the split count needs."""
    return 4 if num_splits <= 4 else 8 if num_splits <= 8 else 16


def merge_chunked(lses, outs, chunk: int | None = None, sink: float | None = None):
    """Mirror of the split merge (merge_splits: decode_split's in-kernel merge and decode_combine) for
    one (row, columns) item: ``lses`` the splits' LSEs (floats, -inf for an empty split), ``outs`` their
    normalised partial outputs (float lists). Reads ``chunk`` splits at a time (default: the kernels'
    merge_chunk; indices past the last clamped and weighted 0) with a running max,
    exactly as the kernel orders its arithmetic; returns (out, lse) -- zeros and -inf when every split
    is empty. ``sink``: the row's sink logit joins the sum once, after the splits (merge_item's SINK;
    every split empty: zeros and the sink). Needs math only, so the CPU tests check the kernel's formula
    and its edge cases."""
    n = len(lses)
    chunk = merge_chunk(n) if chunk is None else chunk
    width = len(outs[0]) if outs else 0
    m, total, acc = -math.inf, 0.0, [0.0] * width
    for s0 in range(0, n, chunk):
        idx = [min(s0 + k, n - 1) for k in range(chunk)]
        ls = [lses[i] for i in idx]
        mc = m
        for k in range(chunk):
            mc = max(mc, ls[k] if s0 + k < n else -math.inf)
        mref = 0.0 if mc == -math.inf else mc
        a = math.exp(m - mref)
        total *= a
        acc = [x * a for x in acc]
        for k in range(chunk):
            used = s0 + k < n and ls[k] != -math.inf
            w = math.exp(ls[k] - mref) if used else 0.0
            total += w
            acc = [x + (w * y if used else 0.0) for x, y in zip(acc, outs[idx[k]])]
        m = mc
    if sink is not None:
        top = max(m, sink)
        a = math.exp(m - top) if m != -math.inf else 0.0
        total = total * a + math.exp(sink - top)
        acc = [x * a for x in acc]
        m = top
    inv = 1.0 / total if total > 0 else 0.0
    return [x * inv for x in acc], (m + math.log(total) if total > 0 else -math.inf)


# ----------------------------------------------------------------- FP8 conversions (templates/decode/decode_fp8.cuh)

E4M3_MAX = 448.0  # e4m3fn's largest finite value
# (left shift, kept bits, the power of two that restores the value) of e4m3x2_widen_signed per 16-bit type.
_WIDEN = {"bf16": (4, 0x87F0, 2.0 ** 120), "fp16": (7, 0xBF80, 2.0 ** 8)}


def e4m3_widen_bits(byte: int, dtype: str) -> int:
    """The 16-bit pattern e4m3x4_widen forms from an e4m3 ``byte`` before its multiply: the byte with its
    sign replicated above it (prmt's sign mode), shifted and masked (``dtype`` "bf16" or "fp16"). As a
    ``dtype`` number it is the e4m3 value over ``widen_factor(dtype)``."""
    shift, keep, _ = _WIDEN[dtype]
    signed = byte | (0xFF00 if byte & 0x80 else 0)
    return (signed << shift) & keep


def widen_factor(dtype: str) -> float:
    """The power of two the kernel multiplies a widened e4m3 value by (2^120 for bf16, 2^8 for fp16)."""
    return _WIDEN[dtype][2]


def e4m3_from_float(x: float) -> int:
    """The e4m3 byte decode_fp8.cuh's e4m3_from_float gives ``x`` (a float32 value): round to nearest
    even, saturating at +-448, NaN to NaN; the kernel's arithmetic on the fp32 bit pattern."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    sign = (bits >> 24) & 0x80
    if x != x:
        return sign | 0x7F
    a = min(abs(x), E4M3_MAX)
    if a < 2.0 ** -6:
        return sign | round(a * 512.0)  # Python's round: half to even, as __float2int_rn
    v = struct.unpack("<I", struct.pack("<f", a))[0] - (120 << 23)
    return sign | ((v + 0x7FFFF + ((v >> 20) & 1)) >> 20)
