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

from .dispatch import ProblemKey, bucket_of
from .errors import UnsupportedError
from .families import DECODE_HEAD_DIMS
from .spec import KernelSpec

PAGE_SIZES = (16, 32, 64, 128, 256)
MAX_SPLITS = 128          # the heuristic's ceiling (num_splits= may go higher, up to MAX_SPLITS_USER)
MAX_SPLITS_USER = 1024
ROWS = 16                 # packed query rows per CTA (one m16n8k16 tile)

# ----------------------------------------------------------------- default rule

# Per head-dim tile: (block_n, warps, stages, load hint) in order of preference; the first whose
# shared memory fits the device's per-block budget is used. Chosen so that two CTAs share an SM on
# Hopper (<= ~113 KB each) with 2-3 K/V blocks of 16-32 KB in flight per CTA: 64-128 KB in flight
# per SM, well past the ~36 KB that HBM bandwidth x latency asks for (bench/NOTES.md, "decode").
# The load hint is KernelSpec.hint (families.LOAD_HINTS). bench/sweep_decode.py
# measures the alternatives on the device; its winners replace these.
DEFAULT_DECODE_TILES = {
    32: ((64, 2, 4, 0), (32, 2, 2, 0)),
    64: ((64, 4, 4, 0), (32, 2, 2, 0)),
    128: ((64, 4, 3, 0), (32, 2, 4, 0), (32, 2, 2, 0)),
    256: ((32, 2, 3, 0), (32, 2, 2, 0)),
}
COMBINE_WARPS = 4


def decode_head_dim_tile(d: int) -> int:
    """The decode kernels' head-dim tile for an input head dim (multiple of 8, <= 256)."""
    if d < 8 or d % 8 or d > 256:
        raise UnsupportedError(f"head dim {d} is not supported (supported: multiples of 8 up to 256)")
    return next(t for t in DECODE_HEAD_DIMS if d <= t)


def default_split_spec(arch: str, dtype: str, head_dim: int, smem_budget: int) -> KernelSpec:
    for bn, w, st, hint in DEFAULT_DECODE_TILES[head_dim]:
        spec = KernelSpec(kind="decode_split", arch=arch, dtype=dtype, head_dim=head_dim, block_m=ROWS,
                          block_n=bn, warps=w, stages=st, hint=hint, causal=True).validate()
        if spec.smem_bytes() <= smem_budget:
            return spec
    raise UnsupportedError(f"no decode_split tile fits {smem_budget} B of shared memory for d={head_dim}")


def combine_spec(arch: str, dtype: str, head_dim: int) -> KernelSpec:
    return KernelSpec(kind="decode_combine", arch=arch, dtype=dtype, head_dim=head_dim, block_m=16, block_n=16,
                      warps=COMBINE_WARPS, stages=2, refill=0, causal=False).validate()


def default_specs(arch: str, smem_budget: int) -> list:
    """Every spec the decode default rule can pick for ``arch`` (for the compile tests)."""
    out = []
    for d in DECODE_HEAD_DIMS:
        for dtype in ("fp16", "bf16"):
            out.append(default_split_spec(arch, dtype, d, smem_budget))
            out.append(combine_spec(arch, dtype, d))
    return out


def select_split_spec(arch: str, dtype: str, head_dim: int, seqlen_k: int, gpu, smem_budget: int) -> KernelSpec:
    """Tuned table entry for the decode key if there is one, else the default rule."""
    if gpu is not None:
        from .tables import lookup

        spec = lookup(gpu, ProblemKey("decode_split", arch, dtype, head_dim, True, bucket_of(seqlen_k)))
        if spec is not None:
            return spec
    return default_split_spec(arch, dtype, head_dim, smem_budget)


# ----------------------------------------------------------------- split heuristic


def num_splits_heuristic(batch: int, heads_kv: int, m_blocks: int, seqlen_k: int, block_n: int, sms: int,
                         ctas_per_sm: int = 1, max_splits: int = MAX_SPLITS) -> int:
    """How many splits of the keys to launch: fill one wave of SM slots.

    ``work`` = batch * heads_kv * m_blocks CTAs without splitting, ``slots`` =
    sms * ctas_per_sm CTAs resident at once. No split when work already fills
    80 % of the slots (as FlashAttention-2's rule, KERNELS.md section 4).
    Otherwise the split kernel is memory-bound and its bandwidth grows with the
    CTAs in flight, so s goes as high as one wave allows (work * s <= slots,
    s <= max_splits and <= the key blocks), and then down to the fewest splits
    with the same critical path ceil(blocks / s) (fewer partials to merge).
    FA2's rule (the smallest s within 85 % of the best wave efficiency) stops
    short of a full wave: on the H200 it picked 7 splits where 8 ran 3 % faster
    (b=1, 32 KV heads, 32k keys) and 29 where 32 did (b=1, 8 KV heads, 128k).
    ``seqlen_k`` is the longest key length the call can see (the cache's
    capacity plus new tokens: actual lengths live on the GPU).
    """
    slots = max(1, sms * ctas_per_sm)
    work = max(1, batch * heads_kv * m_blocks)
    n_blocks = max(1, -(-seqlen_k // block_n))
    if work >= 0.8 * slots:
        return 1
    top = max(1, min(max_splits, n_blocks, slots // work))
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
