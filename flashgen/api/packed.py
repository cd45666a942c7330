"""``flashgen.attention_varlen``: attention over packed rows (FlashAttention's varlen interface).

The sequences of a batch are laid end to end, ``cu_seqlens`` gives where each starts; the kernels list the
(sequence, query block) tiles on the device (templates/common/varlen.cuh), so no tile is spent on padding
and the host never reads the lengths on the hot path. The launch is ``api.forward.packed_forward``; this
module checks the values (one device sync, unless the caller opts out) and routes torch.compile through
the ``flashgen::attn_varlen_fwd`` custom op (``api.autograd``); gradients go through its forward and
formula (the op under torch.compile, a plain autograd.Function in eager calls).
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedError
from .autograd import attention_paged_op, attention_varlen_op
from .checks import check_flag, check_packed_call, check_packed_inputs, on_meta
from .decoding import check_block_table, check_variant_values
from .device import is_capturing, is_compiling
from .forward import packed_forward


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                     causal: bool = False, softmax_scale: float | None = None, seqused_k=None, block_table=None,
                     return_lse: bool = False, deterministic: bool = False, *, window=None, softcap: float = 0.0,
                     alibi_slopes=None, sinks=None, check_values: bool = True, spec=None):
    """Attention of packed sequences: sequence s is query rows ``cu_seqlens_q[s] : cu_seqlens_q[s + 1]``
    of q and keys ``cu_seqlens_k[s] : cu_seqlens_k[s + 1]`` of k, v (FlashAttention's ``varlen`` call).

    q: (total_q, heads, d); k, v: (total_k, heads_kv, d), heads_kv dividing heads (GQA/MQA); fp16 or
    bf16 on one CUDA device, contiguous last dimension, 16-byte aligned. ``cu_seqlens_q``/``_k``: int32
    (seqs + 1,) on that device, starting at 0, non-decreasing, ending at total_q / total_k.
    ``max_seqlen_q``/``_k``: ints at least every sequence's length (the problem key's bucket).
    ``seqused_k``: int32 (seqs,), the keys sequence s uses from its start (at most its cu_seqlens_k
    length; the rest are read past but never weigh: they must be finite). Sequences of length 0 give
    no rows and no error. ``causal`` is bottom-right aligned per sequence, and every variant of
    ``flashgen.attention`` (``window``, ``softcap``, ``alibi_slopes`` (heads,) or (seqs, heads),
    ``sinks``) applies per sequence with that sequence's lengths.

    ``check_values`` (default True) copies cu_seqlens and seqused_k to the host (one device sync) and
    refuses values that break the rules above, and non-finite slopes or sinks; skipped while a CUDA
    graph is captured. Pass False in a hot loop whose inputs you trust: wrong values then give wrong
    rows, not a crash of the process, only as far as they stay inside the tensors.

    Returns the output (total_q, heads, d) in q's dtype and, with ``return_lse``, the log-sum-exp of the
    scaled scores, fp32 (heads, total_q). Differentiable (q, k, v, sinks) through
    ``flashgen::attn_varlen_fwd``'s formula (``api.autograd``), whose backward walks the packed rows too;
    ``deterministic`` as ``flashgen.attention``'s. TypeError/ValueError on bad inputs, always before anything
    is launched.

    Paged K/V (chunked prefill against a serving engine's cache): with ``block_table`` int32 (seqs,
    max_pages), k and v are caches (pages, page_size, heads_kv, d) as ``flashgen.decode`` takes them
    (page_size 16, 32, 64, 128 or 256), and sequence s's key j is row j % page_size of page
    ``block_table[s, j // page_size]``. The key counts come from ``seqused_k`` or, without it, from
    ``cu_seqlens_k``'s differences (which may then be None); the value check refuses counts past a
    table row and entries outside [0, pages) among the pages in use (entries past them are never read:
    a table padded with -1 is fine). Rows of a sequence's last page past its keys are read and must be
    finite. Runs on fwd_sm90 (sm_90a, head dims 64-256; UnsupportedError elsewhere), forward only
    (UnsupportedError when a gradient is needed); under torch.compile through the
    ``flashgen::attn_paged_fwd`` custom op.
    """
    if not (type(causal) is type(return_lse) is type(deterministic) is type(check_values) is bool):
        for name, flag in (("causal", causal), ("return_lse", return_lse), ("deterministic", deterministic),
                           ("check_values", check_values)):
            check_flag(name, flag)
    paged = block_table is not None
    grad = torch.is_grad_enabled() and (getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False) or
                                        getattr(v, "requires_grad", False) or getattr(sinks, "requires_grad", False))
    compiling = is_compiling()
    if on_meta(q) and not compiling:  # shapes only (nothing to read on the host): the custom ops' fake kernels
        check_packed_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                          seqused_k, block_table, window, softcap, alibi_slopes, sinks)
        if spec is not None:
            raise UnsupportedError("spec= forces one forward kernel: not with meta tensors")
        compiling, check_values = True, False
    if paged and grad:
        raise UnsupportedError("attention_varlen over a paged K/V cache (block_table) has no backward (it serves "
                               "inference); call it under torch.no_grad() or with tensors that need no gradient")
    if check_values and not compiling:  # shapes, dtypes and devices first (the plan's checks), then the values
        dims, _, _ = check_packed_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                         softmax_scale, seqused_k, block_table)
        if not is_capturing():
            check_packed_values(cu_seqlens_q, cu_seqlens_k, seqused_k, q.shape[0], None if paged else k.shape[0],
                                max_seqlen_q, max_seqlen_k, block_table, k.shape[:2] if paged else None)
            if alibi_slopes is not None or sinks is not None:
                check_variant_values(alibi_slopes, sinks)
    if paged:
        if spec is not None and compiling:
            raise ValueError("spec= forces one forward kernel and is not supported under torch.compile")
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, seqused_k,
                window, softcap, alibi_slopes, sinks)
        if compiling:
            out, lse = attention_paged_op(*args, block_table=block_table)
        else:
            out, lse = packed_forward(*args, spec, block_table=block_table, return_lse=return_lse)
    elif compiling or grad:
        if spec is not None:
            raise ValueError("spec= forces one forward kernel and is not supported when a gradient is needed or "
                             "under torch.compile; call under torch.no_grad()")
        out, lse = attention_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                       softmax_scale, deterministic, seqused_k, window, softcap, alibi_slopes, sinks)
    else:
        out, lse = packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                  softmax_scale, seqused_k, window, softcap, alibi_slopes, sinks, spec,
                                  return_lse=return_lse)  # (without it the kernel writes no LSE)
    return (out, lse) if return_lse else out


def check_packed_values(cu_q, cu_k, seqused_k, total_q: int, total_k, max_q: int, max_k: int, block_table=None,
                        cache_shape=None) -> None:
    """The value rules of ``attention_varlen``'s docstring for cu_seqlens, seqused_k and (paged: ``total_k``
    None, ``cache_shape`` the cache's (pages, page_size)) the block table, in one copy to the host (a
    device sync); ValueError naming the first broken one."""
    n = cu_q.shape[0]
    parts = [cu_q, cu_k if cu_k is not None else cu_q] + ([seqused_k] if seqused_k is not None else [])
    if block_table is not None:
        parts.append(block_table.reshape(-1))
    host = torch.cat(parts).to("cpu").long()
    cq, ck = host[:n], host[n:2 * n]
    used = host[2 * n:3 * n - 1] if seqused_k is not None else None
    checks = [("cu_seqlens_q", cq, total_q, max_q, "max_seqlen_q")]
    if cu_k is not None:
        checks.append(("cu_seqlens_k", ck, total_k, max_k, "max_seqlen_k"))
    for name, cu, total, most, label in checks:
        if int(cu[0]) != 0:
            raise ValueError(f"{name}[0] must be 0, got {int(cu[0])}")
        lens = cu[1:] - cu[:-1]
        if bool((lens < 0).any()):
            i = int((lens < 0).nonzero()[0, 0])
            raise ValueError(f"{name} must be non-decreasing, got {int(cu[i])} then {int(cu[i + 1])} at {i}")
        if total is not None and int(cu[-1]) != total:
            raise ValueError(f"{name}[-1] must be the packed length {total}, got {int(cu[-1])}")
        if lens.numel() and int(lens.max()) > most:
            i = int(lens.argmax())
            raise ValueError(f"sequence {i} has {int(lens[i])} rows in {name}, more than {label} = {most}")
    if used is not None and cu_k is not None:
        room = ck[1:] - ck[:-1]
        bad = (used < 0) | (used > room)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"seqused_k[{i}] = {int(used[i])} is negative or past sequence {i}'s {int(room[i])} "
                             "keys in cu_seqlens_k")
    if block_table is not None:
        pages, page = cache_shape
        keys = used if used is not None else ck[1:] - ck[:-1]
        capacity = block_table.shape[1] * page
        bad = (keys < 0) | (keys > capacity) | (keys > max_k)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"sequence {i} has {int(keys[i])} keys: negative, past its block-table row's {capacity} "
                             f"keys or past max_seqlen_k = {max_k}")
        check_block_table(host[-block_table.numel():].reshape(block_table.shape) if block_table.numel() else
                          torch.zeros(block_table.shape, dtype=torch.long), keys, page, pages)
