"""Flash-Decoding: ``flashgen.decode``, split-KV attention over a contiguous or paged KV cache.

Generation attends with one (or a few) new query tokens per sequence to a long
KV cache. The ``decode_split`` kernel splits each sequence's keys across CTAs;
each CTA packs the query heads that share one KV head (times the new tokens)
into the 16 rows of one mma tile, so every K/V block is read once per group,
and writes a normalised fp32 partial output and its log-sum-exp into a
workspace; ``decode_combine`` merges them exactly. With one split the split
kernel writes the output itself (one launch).

Pure-Python helpers here mirror the kernels' index arithmetic (split ranges,
page lookup, causal limits) so that it is tested without a GPU. The torch
layer (input checks, plan cache, launches) is ``flashgen/decode_api.py``.
"""
from __future__ import annotations

import math

from .dispatch import ProblemKey, _first_clean, bucket_of
from .errors import UnsupportedError
from .families import DECODE_HEAD_DIMS, load_hint_for
from .spec import KernelSpec

PAGE_SIZES = (16, 32, 64, 128, 256)
MAX_SPLITS = 128          # the heuristic's ceiling (num_splits= may go higher, up to MAX_SPLITS_USER)
MAX_SPLITS_USER = 1024
ROWS = 16                 # packed query rows per CTA (one m16n8k16 tile)

# ----------------------------------------------------------------- default rule

# Per head-dim tile: (block_n, warps, stages, load hint) in order of preference; the first whose
# shared memory fits the device's per-block budget is used. The load hint is KernelSpec.hint
# (families.LOAD_HINTS; a bulk hint, 4 or 5, runs as its cp.async stand-in off sm_90a:
# families.load_hint_for). d=128 is measured on the H200 (bench/NOTES.md "Session 6: decode"):
# n128 w4 s2 with the evict_first hint (135 KB: one CTA per SM, 64 KB of K/V in flight) was the best or
# within noise of the best of 10 tiles on every case in two interleaved A/Bs with cuDNN
# (bench/ab_decode.py: b1/hk32 1.006x/1.005x cuDNN at L=32k/128k, b8/hk8/L128k 1.009x, b32 1.011-1.026x),
# where the earlier per-case tiles (n64 w4 s3 h2, two per SM; n64 w4 s2, three per SM) stayed at
# 0.989-0.998x on three of them. The other head dims keep the first rule's tiles (not measured).
DEFAULT_DECODE_TILES = {
    32: ((64, 2, 4, 0), (32, 2, 2, 0)),
    64: ((64, 4, 4, 0), (32, 2, 2, 0)),
    128: ((128, 4, 2, 2), (64, 4, 3, 2), (64, 4, 2, 0), (32, 2, 4, 0), (32, 2, 2, 0)),
    256: ((32, 2, 3, 0), (32, 2, 2, 0)),
}
# Per-case tiles tried before DEFAULT_DECODE_TILES[d] (decode_regime picks the case): "few" (so few
# batch x KV head x m-block groups that a 2-CTA/SM tile would need more than MERGE_SPLITS splits to
# fill the GPU), "some", "full" (the groups alone give every SM a CTA, but at most two) and "many" (more
# than two per SM). Sessions 2-5 shipped three d=128 tiles here (n128 w4 s2 / n64 w4 s3 h2 / n64 w4 s2);
# session 6's A/B found one tile best in all three.
# Session 8 (after the cheaper split merge; bench/NOTES.md "Session 8"): a third ring stage (196 KB, still
# one CTA per SM, two blocks in flight) gained 0.2-0.9 % in two interleaved A/Bs on the "some" cases of
# 32k and 128k keys (b1/hk32, b8/hk8: one wave of 2-4 splits) and lost 1-2 % on b32 (two waves, no split)
# and 0.5-1 % on "few" (16 splits): "some" only. It needs sm_90's per-block budget; elsewhere the rule
# falls through to DEFAULT_DECODE_TILES.
# Session 10 ("full"; bench/NOTES.md "Session 10"): n64 w4 s2 (68 KB, three CTAs per SM) runs every group of
# the "full" regime in one wave, where the one-CTA-per-SM tile runs a second wave that is a few CTAs short
# of filling HBM when the groups barely exceed the SMs: 160 groups (b5/hk32, b20/hk8) 4.38-4.39 TB/s
# against 3.81 (+15 %), 256 groups (b32/hk8, b16/hk16) -0.1 to +0.4 % in A/Bs on three H200s. With more
# than two groups per SM ("many": b48/hk8 384, b64/hk8 512) it lost 0.6 % and 8 %: those keep n128 w4 s2.
# These tiles were measured on the H200 only: other archs take DEFAULT_DECODE_TILES (on sm_80 the 3-CTA/SM
# n64 tile spills under its launch bounds).
DECODE_TILES_BY_REGIME: dict = {128: {"some": ((128, 4, 3, 2),), "full": ((64, 4, 2, 2),)}}
REGIME_TILE_ARCHS = ("sm_90a",)
REGIMES = ("few", "some", "full", "many")
# More splits than this only where one CTA per SM needs them (num_splits_heuristic): each split adds
# a partial (fp32 O + LSE) to write and merge, and the merge is the kernel's tail.
MERGE_SPLITS = 16
COMBINE_WARPS = 4


def decode_head_dim_tile(d: int) -> int:
    """The decode kernels' head-dim tile for an input head dim (multiple of 8, <= 256)."""
    if d < 8 or d % 8 or d > 256:
        raise UnsupportedError(f"head dim {d} is not supported (supported: multiples of 8 up to 256)")
    return next(t for t in DECODE_HEAD_DIMS if d <= t)


def decode_regime(work: int, sms: int) -> str:
    """Which per-case tile serves ``work`` = batch * heads_kv * m_blocks CTAs (before splitting) on a
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


def default_split_spec(arch: str, dtype: str, head_dim: int, smem_budget: int, regime: str = "some",
                       check=None) -> KernelSpec:
    """The rule's first tile for the case that fits ``smem_budget``; with ``check`` (spec -> problems,
    ``dispatch.resource_problems``) a fitting tile the local NVRTC would refuse gives way to the next
    fitting one, as the forward's rule does (``dispatch.default_spec``)."""
    if regime not in REGIMES:
        raise ValueError(f"regime {regime!r} not in {REGIMES}")
    tiles = DECODE_TILES_BY_REGIME.get(head_dim, {}).get(regime, ()) if arch in REGIME_TILE_ARCHS else ()
    tiles += DEFAULT_DECODE_TILES[head_dim]
    fitting = []
    for bn, w, st, hint in tiles:
        spec = KernelSpec(kind="decode_split", arch=arch, dtype=dtype, head_dim=head_dim, block_m=ROWS,
                          block_n=bn, warps=w, stages=st, hint=load_hint_for(arch, hint), causal=True).validate()
        if spec.smem_bytes() <= smem_budget and spec not in fitting:
            fitting.append(spec)
    if not fitting:
        raise UnsupportedError(f"no decode_split tile fits {smem_budget} B of shared memory for d={head_dim}")
    return _first_clean(fitting, check)


def combine_spec(arch: str, dtype: str, head_dim: int) -> KernelSpec:
    return KernelSpec(kind="decode_combine", arch=arch, dtype=dtype, head_dim=head_dim, block_m=16, block_n=16,
                      warps=COMBINE_WARPS, stages=2, refill=0, causal=False).validate()


def default_specs(arch: str, smem_budget: int) -> list:
    """Every spec the decode default rule can pick for ``arch`` (for the compile tests)."""
    out = []
    for d in DECODE_HEAD_DIMS:
        for dtype in ("fp16", "bf16"):
            for regime in REGIMES:
                spec = default_split_spec(arch, dtype, d, smem_budget, regime)
                if spec not in out:
                    out.append(spec)
            out.append(combine_spec(arch, dtype, d))
    return out


def select_split_spec(arch: str, dtype: str, head_dim: int, seqlen_k: int, gpu, smem_budget: int,
                      work: int = 1, sms: int = 0, check=None) -> KernelSpec:
    """Tuned table entry for the decode key if there is one, else the default rule for the case
    (``work`` CTAs before splitting on ``sms`` SMs; sms=0: the "some" tiles). ``check`` (spec ->
    problems): a table entry or rule tile it refuses gives way to the rule's next tile."""
    if gpu is not None:
        from .tables import lookup

        spec = lookup(gpu, ProblemKey("decode_split", arch, dtype, head_dim, True, bucket_of(seqlen_k)))
        if spec is not None and not (check and check(spec)):
            return spec
    regime = decode_regime(work, sms) if sms > 0 else "some"
    return default_split_spec(arch, dtype, head_dim, smem_budget, regime, check)


# ----------------------------------------------------------------- split heuristic


def num_splits_heuristic(batch: int, heads_kv: int, m_blocks: int, seqlen_k: int, block_n: int, sms: int,
                         ctas_per_sm: int = 1, max_splits: int = MAX_SPLITS) -> int:
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

    Measured on the H200 (bench/results/decode/round2/, bench/NOTES.md "dec3"):
    with two CTAs per SM (n64 w4 s3) b1/hk8/L128k ran 4.04 TB/s at 16 splits
    and 3.95 at 33 (one full wave of slots), b8/hk8 4.48-4.50 at 4 (a full
    wave) and 4.45 at 2; with one CTA per SM (n128 w4 s2) b1/hk8 4.05 at 16,
    b8/hk8/L4k 3.20 at 2 (2.92 at 4).
    ``seqlen_k`` is the longest key length the call can see (the cache's
    capacity plus new tokens: actual lengths live on the GPU).
    """
    slots = max(1, sms * ctas_per_sm)
    work = max(1, batch * heads_kv * m_blocks)
    n_blocks = max(1, -(-seqlen_k // block_n))
    if work >= 0.8 * slots:
        return 1
    top = min(max_splits, n_blocks, slots // work)
    if top > MERGE_SPLITS:
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


def split_range(length: int, num_splits: int, split: int, block_n: int) -> tuple[int, int]:
    """Keys [begin, end) of split ``split`` of a sequence of ``length`` keys: whole blocks of
    ``block_n``, ceil(blocks / num_splits) per split; an empty range has end <= begin."""
    blocks = -(-length // block_n)
    per = -(-blocks // num_splits)
    return split * per * block_n, min(length, (split + 1) * per * block_n)


def key_limit(row: int, group: int, length: int, nq: int) -> int:
    """Exclusive key limit of packed row ``row`` (token row // group): bottom-right causal."""
    return min(length, row // group + length - nq + 1)


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
    ``fetch_pages`` in templates/decode_split.cuh; raises AssertionError where the kernel's shuffle
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
    """Splits the merge reads per round trip (CH of merge_splits, templates/decode_merge.cuh): 4, 8 or 16,
    no more loads and exponentials than the split count needs."""
    return 4 if num_splits <= 4 else 8 if num_splits <= 8 else 16


def merge_chunked(lses, outs, chunk: int | None = None):
    """Mirror of the split merge (merge_splits: decode_split's in-kernel merge and decode_combine) for
    one (row, columns) item: ``lses`` the splits' LSEs (floats, -inf for an empty split), ``outs`` their
    normalised partial outputs (float lists). Reads ``chunk`` splits at a time (default: the kernels'
    merge_chunk; indices past the last clamped and weighted 0) with a running max,
    exactly as the kernel orders its arithmetic; returns (out, lse) -- zeros and -inf when every split
    is empty. Needs math only, so the CPU tests check the kernel's formula and its edge cases."""
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
    inv = 1.0 / total if total > 0 else 0.0
    return [x * inv for x in acc], (m + math.log(total) if total > 0 else -math.inf)
