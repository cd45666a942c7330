"""The torch layer of Flash-Decoding: ``flashgen.decode``.

Checks the inputs and raises before any launch, plans once per signature
(shapes, strides, dtypes, devices, flags, the variant options: window, softcap,
the slopes' and sinks' shapes -> kernels, grids, split count, packed parameter
templates), and launches on torch's current stream with raw
pointers: no host syncs except the optional value check; one launch per call
(the split kernel merges its splits itself, FUSED_COMBINE); the split
workspace is reused per stream, and inside a CUDA graph capture comes from
torch's allocator (the graph's pool), hence capture and replay work. An FP8
cache (float8 e4m3 k_cache and v_cache with fp32 descales) runs the same
kernel on byte rows; its descales stay on the device (the kernel reads them).
"""
from __future__ import annotations

import math
import numbers
from threading import get_ident

import torch

from .. import dispatch, mods, shapes
from ..codegen import load
from ..codegen.launch import ensure_context
from ..errors import UnsupportedError
from ..families import decode as dk
from ..problem import ProblemKey, bucket_of, smallest_tile
from ..variants import PLAIN, window_of
from .checks import (DTYPES, check_block_table_layout, check_descale, check_flag, check_forced_spec,
                     check_heads_and_dim, check_variant_inputs, checked_scale, extent_bytes, on_meta, overlap,
                     variant_tensors)
from .device import Device, current_device, current_stream, index_of
from .device import is_capturing as _capturing
from .fp8 import FP8, check_descale_values, descale_strides
from .modcall import check_mod_functions, fill_mods, pack_mod_fields, still_traced, traced_pair
from .plans import PlanCache

_plans = PlanCache("decode")

# Merge the splits inside decode_split (the CTA that draws its group's last ticket) instead of launching
# decode_combine: one launch per call. Read when a call is planned: after changing it, clear _plans.
FUSED_COMBINE = True

# Split workspaces (fp32 partials + LSEs, and the in-kernel merge's counters) kept per (device, stream,
# thread) and grown as needed: launches on one stream run in order, so one buffer serves every call
# there; the thread is in the key because two threads may interleave their launches on one stream.
# While a CUDA graph is being captured the buffers come from torch's allocator (the graph's pool).
_workspaces: dict = {}


def _tsig(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())


def decode(q, k_cache, v_cache, cache_seqlens=None, block_table=None, k_new=None, v_new=None,
           softmax_scale=None, num_splits=None, return_lse=False, check_values=True, spec=None, *,
           window=None, softcap=0.0, alibi_slopes=None, sinks=None, k_descale=None, v_descale=None,
           score_mod=None, mask_mod=None):
    """Attention of new query tokens to a KV cache, split over the keys (Flash-Decoding).

    q: (batch, seqlen_q, heads_q, d); the new tokens are causal among themselves
    and see the whole cache (bottom-right alignment: token i sees keys
    j <= i + L - seqlen_q, L the sequence's length including appended tokens).
    k_cache, v_cache: contiguous (batch, max_len, heads_kv, d), or paged
    (num_pages, page_size, heads_kv, d) with ``block_table`` int32 (batch,
    max_pages) naming sequence b's page for keys [p*page_size, (p+1)*page_size);
    page sizes 16, 32, 64, 128, 256. heads_kv divides heads_q (GQA/MQA).
    ``cache_seqlens`` int32 (batch,): each sequence's cached length (0 allowed:
    with no k_new its rows get output 0 and LSE -inf); None means the whole
    cache (max_len, or max_pages * page_size). ``k_new``/``v_new`` (batch,
    seqlen_q, heads_kv, d): written into the cache at positions
    cache_seqlens[b] .. + seqlen_q (in place, exactly) and attended to; they
    need ``cache_seqlens``. fp16 or bf16, one CUDA device, contiguous last
    dimension, 16-byte aligned; d any multiple of 8 up to 256.

    ``num_splits``: how many pieces each sequence's keys are split into (None:
    ``flashgen.families.decode.num_splits_heuristic`` from the SM count, batch, KV heads
    and the cache's capacity). ``check_values`` (default True) copies
    cache_seqlens and block_table to the host (one device sync) and refuses
    lengths past the cache and block-table entries outside [0, num_pages) for
    pages in use; it is skipped while a CUDA graph is being captured (values
    are not checked then) -- pass False in a hot loop whose inputs you trust.

    Returns the output (batch, seqlen_q, heads_q, d) in q's dtype and, with
    ``return_lse``, the log-sum-exp of the scaled scores, fp32 (batch, heads_q,
    seqlen_q). TypeError/ValueError on bad inputs, UnsupportedError on requests
    the kernels do not serve, always before anything is launched.

    The variants of ``flashgen.attention`` (``flashgen.variants``), with the same bottom-right offsets
    (new token i sees key j at o = j - (i + L - seqlen_q)):
    ``window=(left, right)``: key j is visible iff -left <= o <= right (-1: unbounded); decode is causal,
    so right must be 0 or -1 (both the causal edge; > 0 raises UnsupportedError). The kernels then
    read only the keys inside the window (a CTA's splits start at its first visible key, pages
    before it are never looked up, and the split heuristic counts the window's keys).
    ``softcap=c > 0``: the scaled score s becomes c tanh(s / c). ``alibi_slopes``, fp32 (heads_q,) or
    (batch, heads_q): -slope |o| joins the score. ``sinks``, (heads_q,) fp32 or q's dtype: one logit per
    head joins each row's softmax denominator with no value (the LSE includes it; a row that sees no
    key gets output 0 and LSE = its sink). Slopes and sinks are read at launch (one fp32 copy per call
    where they are not fp32 and contiguous); with ``check_values`` they must be finite (checked on
    the host, with the lengths).

    An FP8 cache: ``k_cache`` and ``v_cache`` both ``torch.float8_e4m3fn`` (one FP8 and one 16-bit cache is
    refused), holding k8 and v8 with K = k8 * ``k_descale`` and V = v8 * ``v_descale``; the descales are
    fp32 on q's device, shape () or (1,) (one factor) or (batch, heads_kv) (``flashgen.quantize_fp8``
    makes a cache and its descales). They are required with an FP8 cache and refused without one. q,
    k_new and v_new stay fp16 or bf16 (the output is q's dtype); the cache's strides must be multiples of
    16 elements. The kernel reads half the bytes of a 16-bit cache: it widens the FP8 rows to q's dtype
    in registers (exactly: every e4m3 value is one in bf16 and fp16), folds the K descale into the
    softmax's scale and the V descale into the output's normalisation, per (batch, KV head), on the
    device. ``k_new``/``v_new`` are written into the cache as round-to-nearest e4m3 of k_new / k_descale
    (v_new / v_descale), saturating at +-448 (``quantize_fp8``'s rounding), and attended to as written.
    With ``check_values`` the descales must be finite and positive (checked with the lengths; skipped
    during a CUDA graph capture like them). The variants work with an FP8 cache too.

    User mods (``flashgen.attention``'s, FlexAttention's signatures, traced by ``flashgen.mods``):
    ``score_mod(score, b, h, q_idx, kv_idx)`` changes each scaled score and ``mask_mod(b, h, q_idx, kv_idx)``
    hides keys where it is False, with q_idx the new token's position in its sequence (token i at
    i + L - seqlen_q) and kv_idx the key's, so a mod written for a sequence's prefill means the same here.
    Decode stays causal (a new token sees no later key); the mask_mod hides keys on top of that and is
    evaluated per score (no block mask: no key block is skipped). They take none of window, softcap,
    alibi_slopes, sinks or an FP8 cache (write those as mods).
    """
    try:
        # Flat on purpose: this tuple is built and hashed on every call (host overhead).
        sig = (q.shape, q.stride(), q.dtype, q.get_device(), k_cache.shape, k_cache.stride(), k_cache.dtype,
               k_cache.get_device(), v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.get_device(),
               None if cache_seqlens is None else _tsig(cache_seqlens),
               None if block_table is None else _tsig(block_table),
               None if k_new is None else (_tsig(k_new), _tsig(v_new)),
               softmax_scale, num_splits, return_lse, check_values, spec, type(softmax_scale),
               type(num_splits), type(return_lse), type(check_values),  # 1 == True: the types keep checks honest
               window, type(window), softcap, type(softcap),
               None if alibi_slopes is None else _tsig(alibi_slopes), None if sinks is None else _tsig(sinks),
               None if k_descale is None else _tsig(k_descale), None if v_descale is None else _tsig(v_descale),
               score_mod, mask_mod)
        plan = _plans.get(sig)
    except (AttributeError, TypeError):  # not tensors, or unhashable: the full check says why
        sig = plan = None
    if plan is not None and plan.mods is not None and not plan.mods.current():  # a capture was rebound
        plan = None
    if plan is None and on_meta(q):
        return _meta_decode(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, softmax_scale,
                            num_splits, return_lse, check_values, spec, window, softcap, alibi_slopes, sinks,
                            k_descale, v_descale, score_mod, mask_mod)
    if plan is None:
        plan = _plan(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, softmax_scale, num_splits,
                     return_lse, check_values, spec, window, softcap, alibi_slopes, sinks, k_descale, v_descale,
                     score_mod, mask_mod)
        _plans.put(sig, plan)
    if shapes.ACTIVE and plan.record is not None:  # flashgen.record: count this call's key and shape
        shapes.note(*plan.record)
    qp, kp, vp = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
    has_new = k_new is not None
    knp, vnp = (k_new.data_ptr(), v_new.data_ptr()) if has_new else (0, 0)
    if (qp | kp | vp | knp | vnp) & 15:
        raise ValueError("q, k_cache, v_cache, k_new, v_new must be 16-byte aligned (16-byte loads)")
    if has_new:  # the append writes the caches in place: nothing it writes may be read or written twice
        _check_append_aliasing(plan.extents, kp, vp, knp, vnp)
    _refuse_grad(q, k_cache, v_cache)
    if check_values and plan.kernel is not None and not _capturing():
        check_cache_values(plan.limits, cache_seqlens, block_table)
        if alibi_slopes is not None or sinks is not None:
            check_variant_values(alibi_slopes, sinks)
        if k_descale is not None:
            check_descale_values((("k_descale", k_descale), ("v_descale", v_descale)))
    out = q.new_empty(q.shape)  # contiguous, q's dtype and device (cheaper than torch.empty on the host)
    lse = q.new_empty(plan.lse_shape, dtype=torch.float32) if return_lse else None
    if plan.kernel is None:
        if lse is not None:
            lse.fill_(-math.inf)
        return (out, lse) if return_lse else out
    params = plan.params()
    params.q, params.k, params.v, params.o = qp, kp, vp, out.data_ptr()
    if has_new:
        params.knew, params.vnew = knp, vnp
    if cache_seqlens is not None:
        params.seqlens = cache_seqlens.data_ptr()
    if block_table is not None:
        params.block_table = block_table.data_ptr()
    if k_descale is not None:
        params.kd, params.vd = k_descale.data_ptr(), v_descale.data_ptr()
    if alibi_slopes is not None or sinks is not None:  # (the fp32 copies live until the launch is queued)
        slopes, _, sink_logits = variant_tensors(alibi_slopes, sinks)
        if slopes is not None:
            params.alibi = slopes.data_ptr()
        if sink_logits is not None:
            params.sinks = sink_logits.data_ptr()
    lse_ptr = lse.data_ptr() if lse is not None else 0
    idx = plan.device_index
    if idx != current_device():
        with torch.cuda.device(idx):
            return _launch(plan, params, lse_ptr, current_stream(idx), out, lse, return_lse)
    return _launch(plan, params, lse_ptr, current_stream(idx), out, lse, return_lse)


def _refuse_grad(q, k_cache, v_cache) -> None:
    if (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad) and torch.is_grad_enabled():
        raise UnsupportedError("flashgen.decode has no backward: call it under torch.no_grad() (or pass tensors "
                               "that do not require grad); for a differentiable attention use flashgen.attention")


def _meta_decode(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, softmax_scale, num_splits,
                 return_lse, check_values, spec, window, softcap, alibi_slopes, sinks, k_descale, v_descale,
                 score_mod=None, mask_mod=None):
    """``decode`` on meta tensors: the argument checks (the mods traced; their captures may be anywhere),
    then outputs of the right shapes (no kernel, no append: a meta cache holds nothing)."""
    (b, nq, hq, _, _), *_ = _checked(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, softmax_scale,
                                     num_splits, return_lse, check_values, window, softcap, alibi_slopes, sinks,
                                     k_descale, v_descale)
    _traced_mods(q, score_mod, mask_mod, window, softcap, alibi_slopes, sinks, k_descale, allow_cpu=True)
    if spec is not None:
        raise UnsupportedError("spec= forces one decode kernel: not with meta tensors")
    _refuse_grad(q, k_cache, v_cache)
    out = q.new_empty(q.shape)
    return (out, q.new_empty((b, hq, nq), dtype=torch.float32)) if return_lse else out


def _launch(plan, params, lse_ptr, stream, out, lse, return_lse):
    ensure_context(plan.device_index)  # (a thread's first CUDA call: none may be current)
    params.lse = lse_ptr
    if plan.splits > 1:
        ws, ctr = _workspace(plan, stream)
        params.o_ws = ws_ptr = ws.data_ptr()
        params.lse_ws = ws_lse = ws_ptr + plan.ws_lse_offset
        if plan.combine is None:
            params.counters = ctr.data_ptr()
            plan.kernel.launch(plan.grid, params, stream)
        else:
            cparams = plan.combine_params()
            cparams.o_ws, cparams.lse_ws, cparams.o, cparams.lse = ws_ptr, ws_lse, params.o, lse_ptr
            plan.kernel.launch(plan.grid, params, stream)
            plan.combine.launch(plan.combine_grid, cparams, stream)
    else:
        plan.kernel.launch(plan.grid, params, stream)
    return (out, lse) if return_lse else out


def _workspace(plan, stream):
    """(fp32 workspace of at least plan.ws_numel, int32 tickets of at least plan.ctr_numel, zero)."""
    if _capturing():
        dev = torch.device("cuda", plan.device_index)
        return (torch.empty(plan.ws_numel, dtype=torch.float32, device=dev),
                torch.zeros(max(1, plan.ctr_numel), dtype=torch.int32, device=dev))
    key = (plan.device_index, stream, get_ident())
    entry = _workspaces.get(key)
    if entry is None or entry[0].numel() < plan.ws_numel or entry[1].numel() < plan.ctr_numel:
        dev = torch.device("cuda", plan.device_index)
        if len(_workspaces) > 64:  # streams or threads come and go: start over rather than grow forever
            _workspaces.clear()
        old = entry or (None, None)
        ws = old[0] if old[0] is not None and old[0].numel() >= plan.ws_numel else \
            torch.empty(max(plan.ws_numel, 1 << 16), dtype=torch.float32, device=dev)
        # Tickets start at zero and every launch leaves them at zero, so they are zeroed only here.
        ctr = old[1] if old[1] is not None and old[1].numel() >= plan.ctr_numel else \
            torch.zeros(max(plan.ctr_numel, 1024), dtype=torch.int32, device=dev)
        entry = _workspaces[key] = (ws, ctr)
    return entry


class _Limits:
    """What the value check needs: capacity, appended tokens, paging."""

    __slots__ = ("capacity", "n_new", "page_size", "num_pages")

    def __init__(self, capacity, n_new, page_size, num_pages):
        self.capacity, self.n_new, self.page_size, self.num_pages = capacity, n_new, page_size, num_pages


def check_cache_values(limits: _Limits, cache_seqlens, block_table) -> None:
    """Refuse lengths past the cache and out-of-range block-table entries (ValueError).

    Copies ``cache_seqlens`` and ``block_table`` to the host: one device sync.
    Entries of pages no sequence uses (past its length) are not looked at, so
    tables padded with -1 are fine.
    """
    if cache_seqlens is not None:
        lens = cache_seqlens.to("cpu").long()
        total = lens + limits.n_new
        bad = (lens < 0) | (total > limits.capacity)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"cache_seqlens[{i}] = {int(lens[i])}" + (f" (+ {limits.n_new} new tokens)"
                             if limits.n_new else "") + f" is negative or past the cache's capacity of "
                             f"{limits.capacity} keys")
    else:
        total = None
    if block_table is not None:
        bt = block_table.to("cpu")
        if total is None:
            total = torch.full((bt.shape[0],), limits.capacity, dtype=torch.long)
        check_block_table(bt, total, limits.page_size, limits.num_pages)


def check_block_table(bt, lengths, page_size: int, num_pages: int) -> None:
    """Refuse a block table (on the host) naming a page outside [0, num_pages) among the pages sequence i's
    ``lengths[i]`` keys use (ValueError); entries past them are not looked at (tables padded with -1 are
    fine)."""
    need = (lengths + page_size - 1) // page_size
    used = torch.arange(bt.shape[1])[None, :] < need[:, None]
    bad = used & ((bt < 0) | (bt >= num_pages))
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_table[{i}, {j}] = {int(bt[i, j])} is out of range: the cache has "
                         f"{num_pages} pages (sequence {i} uses its first {int(need[i])} entries)")


def check_variant_values(alibi_slopes, sinks) -> None:
    """Refuse ALiBi slopes or sinks that are not finite (ValueError naming the first): one device sync
    for both. (A sink of -inf or NaN would make a row that sees no key NaN, a non-finite slope every row.)"""
    given = [(n, t) for n, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)) if t is not None]
    flags = torch.stack([torch.isfinite(t).all() for _, t in given]).to("cpu")
    for (name, t), ok in zip(given, flags.tolist()):
        if not ok:
            i = int((~torch.isfinite(t.reshape(-1).to("cpu"))).nonzero()[0, 0])
            raise ValueError(f"{name} must be finite, got {float(t.reshape(-1)[i])} at flat index {i}")


_APPEND_BUFFERS = ("k_cache", "v_cache", "k_new", "v_new")


def _check_append_aliasing(extents, kp, vp, knp, vnp) -> None:
    """With k_new/v_new appended in place, k_cache, v_cache, k_new and v_new must not share memory: one
    cache as both (``k_cache is v_cache``), a new token viewing the cache, or new tokens viewing each
    other would make the append race with the reads (``extents``: their byte extents, from the plan).
    Runs on every appending call (the pointers change): six range comparisons over one tuple."""
    ranges = ((kp, extents[0]), (vp, extents[1]), (knp, extents[2]), (vnp, extents[3]))
    for i in range(3):
        for j in range(i + 1, 4):
            if overlap(ranges[i], ranges[j]):
                raise ValueError(f"{_APPEND_BUFFERS[i]} and {_APPEND_BUFFERS[j]} share memory: with k_new/v_new "
                                 "the caches are written in place, so the caches and the new tokens must be four "
                                 "separate buffers")


class _Mods:
    """A decode plan's user mods: the traced pair (its captures kept alive: their addresses are in the plan's
    parameter template) and the functions it was traced from."""

    __slots__ = ("pair", "functions")

    def __init__(self, pair, functions):
        self.pair, self.functions = pair, functions

    def current(self) -> bool:
        return still_traced(self.pair, self.functions)


def _traced_mods(q, score_mod, mask_mod, window, softcap, alibi_slopes, sinks, k_descale, allow_cpu=False):
    """The decode call's user mods, checked and traced: the pair, or None without mods. TypeError for a
    non-function; UnsupportedError beside a built-in variant or an FP8 cache; ValueError for a capture off
    q's device (``allow_cpu``: the meta path, which launches nothing)."""
    if score_mod is None and mask_mod is None:
        return None
    check_mod_functions(score_mod, mask_mod)
    others = [n for n, on in (("window", window is not None), ("softcap", softcap != 0.0),
                              ("alibi_slopes", alibi_slopes is not None), ("sinks", sinks is not None),
                              ("an FP8 cache", k_descale is not None)) if on]
    if others:
        raise UnsupportedError(f"score_mod / mask_mod take none of {', '.join(others)} in flashgen.decode: a mod "
                               "expresses its own scores and mask")
    return traced_pair(q, score_mod, mask_mod, allow_cpu)


class _Plan:
    """Everything about a call that depends only on its signature (see ``api.plans``)."""

    __slots__ = ("kernel", "grid", "combine", "combine_grid", "device_index", "lse_shape", "ws_numel",
                 "ws_lse_offset", "ctr_numel", "splits", "limits", "spec", "extents", "variant", "_template",
                 "_struct", "_ctemplate", "_cstruct", "record", "mods")

    def __init__(self, device_index, lse_shape, limits, extents=(0, 0, 0, 0)):
        self.device_index, self.lse_shape, self.limits = device_index, lse_shape, limits
        self.extents = extents
        self.kernel = self.grid = self.combine = self.combine_grid = self.spec = None
        self.ws_numel = self.ws_lse_offset = self.ctr_numel = 0
        self.splits = 1
        self.variant = PLAIN
        self._template = self._struct = self._ctemplate = self._cstruct = None
        self.record = None  # (ProblemKey, shape) of a dispatched call, for flashgen.record
        self.mods = None  # _Mods of a call with user mods

    def key_ranges(self, length: int, nq: int, group: int, m_block: int = 0) -> list:
        """The K/V rows [begin, end) each split of m-block ``m_block`` reads for a sequence of ``length``
        keys (appended ones included): the kernel's arithmetic (dk.split_keys), for tests and benchmarks."""
        if self.spec is None:
            return []
        left = self.variant.left
        return [dk.split_keys(length, nq, group, nq * group, m_block, self.splits, s, self.spec.block_n, left)[:2]
                for s in range(self.splits)]

    def params(self):
        return self._struct.from_buffer_copy(self._template)

    def combine_params(self):
        return self._cstruct.from_buffer_copy(self._ctemplate)


def _need_tensor(name, t, optional=False):
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' or None' if optional else ''}, got {type(t).__name__}")


def _check_strides(name, t):
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    per16 = 16 // t.element_size()  # elements in 16 bytes: 8, or 16 in an FP8 cache
    if any(s % per16 for s in t.stride()[:-1]):
        raise ValueError(f"{name} must have strides that are multiples of {per16} elements (16-byte loads), "
                         f"got strides {t.stride()}")


def _check_dtypes(q, k_cache, v_cache, k_new, v_new) -> bool:
    """q, k_new and v_new fp16 or bf16, all q's; the caches q's dtype too, or both float8_e4m3fn (an FP8
    cache). Returns whether the cache is FP8."""
    fp8 = k_cache.dtype == FP8 or v_cache.dtype == FP8
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        if t is None:
            continue
        if fp8 and name in ("k_cache", "v_cache"):
            if t.dtype != FP8:
                other = "v_cache" if name == "k_cache" else "k_cache"
                raise TypeError(f"{name} must be float8_e4m3fn like {other} (an FP8 cache holds K and V in FP8), "
                                f"got {t.dtype}")
            continue
        if t.dtype not in DTYPES:
            if name in ("k_cache", "v_cache"):
                hint = " (or both caches float8_e4m3fn, with k_descale and v_descale)"
            elif t.dtype != FP8:
                hint = ""
            elif name == "q":
                hint = " (an FP8 cache takes fp16/bf16 queries, whose dtype the output has)"
            else:
                hint = " (new tokens come in q's dtype; an FP8 cache stores them quantized by k_descale and v_descale)"
            raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}{hint}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    return fp8


def _check_descales(fp8: bool, k_descale, v_descale, device, batch: int, heads_kv: int) -> None:
    """With an FP8 cache both descales, fp32 on ``device``, of shape (), (1,) or (batch, heads_kv)
    (``api.checks.check_descale``; their values are ``check_descale_values``'s); none without one."""
    named = (("k_descale", k_descale), ("v_descale", v_descale))
    if not fp8:
        given = [n for n, t in named if t is not None]
        if given:
            raise ValueError(f"{given[0]} is given but the cache is not FP8: descales go with a float8_e4m3fn "
                             "k_cache and v_cache")
        return
    for name, t in named:
        if t is None:
            raise ValueError(f"an FP8 cache needs k_descale and v_descale (fp32 factors: K = k_cache * k_descale; "
                             f"flashgen.quantize_fp8 makes both); {name} is missing")
        check_descale(name, t, device, batch, (heads_kv,))


def _check(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, softmax_scale, num_splits, return_lse,
           check_values, k_descale=None, v_descale=None):
    """All shape/dtype/device/flag checks; returns the facts the plan needs (and whether the cache is FP8)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _need_tensor(name, t)
    for name, t in (("cache_seqlens", cache_seqlens), ("block_table", block_table), ("k_new", k_new),
                    ("v_new", v_new)):
        _need_tensor(name, t, optional=True)
    for name, flag in (("return_lse", return_lse), ("check_values", check_values)):
        check_flag(name, flag)
    given = [(n, t) for n, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                                 ("cache_seqlens", cache_seqlens), ("block_table", block_table),
                                 ("k_new", k_new), ("v_new", v_new)) if t is not None]
    for name, t in given:
        if t.device.type not in ("cuda", "meta"):
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
    if len({t.device for _, t in given}) > 1:
        raise ValueError("all tensors must be on one device, got " + ", ".join(f"{n}: {t.device}" for n, t in given))
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        if t is not None and t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
    fp8 = _check_dtypes(q, k_cache, v_cache, k_new, v_new)
    b, nq, hq, d = q.shape
    if nq < 1:
        raise ValueError(f"q must have at least one token (seqlen_q >= 1), got shape {tuple(q.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    paged = block_table is not None
    if paged:
        num_pages, page_size, hk, dkk = k_cache.shape
        if page_size not in dk.PAGE_SIZES:
            raise ValueError(f"page size (k_cache.shape[1]) must be one of {dk.PAGE_SIZES}, got {page_size}")
        check_block_table_layout(block_table, b, "batch", q.device)
        capacity = block_table.shape[1] * page_size
    else:
        bk, capacity, hk, dkk = k_cache.shape
        num_pages = page_size = None
        if bk != b:
            raise ValueError(f"k_cache must be (batch={b}, max_len, heads_kv, d) (or pass block_table for a paged "
                             f"cache), got shape {tuple(k_cache.shape)}")
    if dkk != d:
        raise ValueError(f"q and k_cache must have one head dim, got {d} and {dkk}")
    check_heads_and_dim(hq, hk, d, b, hk, "k_cache/v_cache", "heads_kv")
    _check_descales(fp8, k_descale, v_descale, q.device, b, hk)
    if cache_seqlens is not None:
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens must be int32, got {cache_seqlens.dtype}")
        if tuple(cache_seqlens.shape) != (b,):
            raise ValueError(f"cache_seqlens must be (batch={b},), got shape {tuple(cache_seqlens.shape)}")
        if b > 1 and cache_seqlens.stride(0) != 1:
            raise ValueError(f"cache_seqlens must be contiguous, got stride {cache_seqlens.stride()}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together: pass both or neither")
    if k_new is not None:
        if cache_seqlens is None:
            raise ValueError("k_new/v_new need cache_seqlens (the positions to append at)")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape)):
                raise ValueError(f"{name} is expanded (a stride of 0, strides {t.stride()}): appending k_new/v_new "
                                 "would write one row for several; pass a cache with its own memory")
        want = (b, nq, hk, d)
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must be (batch, seqlen_q, heads_kv, d) = {want}, got {tuple(t.shape)}")
        if nq > capacity:
            raise ValueError(f"{nq} new tokens do not fit a cache of {capacity} keys")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        if t is not None:
            _check_strides(name, t)
    if capacity + nq >= 2 ** 31:
        raise UnsupportedError(f"a cache of {capacity} keys is past the kernels' 32-bit key index")
    scale = checked_scale(softmax_scale, d)
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
            raise TypeError(f"num_splits must be an int or None, got {num_splits!r}")
        if not 1 <= num_splits <= dk.MAX_SPLITS_USER:
            raise ValueError(f"num_splits must be in [1, {dk.MAX_SPLITS_USER}], got {num_splits}")
        num_splits = int(num_splits)
    limits = _Limits(capacity, nq if k_new is not None else 0, page_size, num_pages)
    return (b, nq, hq, hk, d), scale, num_splits, limits, fp8


def _check_variant(q, window, softcap, alibi_slopes, sinks, b, nq, hq, capacity):
    """The decode call's Variant (causal; ``flashgen.attention``'s checks of window, softcap, slopes and
    sinks). A window's right side must be 0 or -1 (decode is causal: both are the causal edge); a left
    side that reaches past every sequence's start (left >= capacity) hides nothing, so the call runs the
    kernel without a window."""
    if window is not None:
        left, right = window_of(False, window)  # ValueError for anything but two ints >= -1
        if right > 0:
            raise UnsupportedError(f"flashgen.decode serves windows whose right side is 0 or -1 (decode is causal: "
                                   f"new tokens see no later key), got window={window!r}")
        if left >= capacity:
            window = None
    variant, _, _ = check_variant_inputs(q, True, window, softcap, alibi_slopes, sinks, b, hq, nq, capacity)
    return variant


def _checked(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, softmax_scale, num_splits, return_lse,
             check_values, window, softcap, alibi_slopes, sinks, k_descale=None, v_descale=None):
    """Every check of a decode call that reads no device memory (the plan and the meta path): ``_check``'s
    facts and the variant (``fp8`` set for an FP8 cache)."""
    dims, scale, num_splits, limits, fp8 = _check(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                                                  softmax_scale, num_splits, return_lse, check_values, k_descale,
                                                  v_descale)
    b, nq, hq = dims[:3]
    variant = _check_variant(q, window, softcap, alibi_slopes, sinks, b, nq, hq, limits.capacity)
    return dims, scale, num_splits, limits, variant.replace(fp8=fp8) if fp8 else variant


def _plan(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, softmax_scale, num_splits, return_lse,
          check_values, spec, window=None, softcap=0.0, alibi_slopes=None, sinks=None, k_descale=None,
          v_descale=None, score_mod=None, mask_mod=None) -> _Plan:
    (b, nq, hq, hk, d), scale, num_splits, limits, variant = _checked(
        q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, softmax_scale, num_splits, return_lse,
        check_values, window, softcap, alibi_slopes, sinks, k_descale, v_descale)
    pair = _traced_mods(q, score_mod, mask_mod, window, softcap, alibi_slopes, sinks, k_descale)
    shapes.from_environment()
    index = index_of(q)
    extents = tuple(extent_bytes(t) if t is not None else 0 for t in (k_cache, v_cache, k_new, v_new))
    plan = _Plan(index, (b, hq, nq), limits, extents)
    plan.variant = variant
    if pair is not None:
        mods.register(pair)
        plan.mods = _Mods(pair, (score_mod, mask_mod))
        k_in, c_out = pair.factors  # c f(k score): k joins the scale the score_mod is given, c the softmax's
        if not 2.0 ** -126 <= abs(scale * k_in) < 2.0 ** 127:
            raise UnsupportedError(f"score_mod's constant factor {k_in!r} on the score times the softmax scale "
                                   f"{scale!r} leaves float32's normal range")
    if b == 0 or hq == 0:
        return plan
    dev = Device.of(index)
    dtype = DTYPES[q.dtype]
    tile = smallest_tile(d, dk.DECODE_HEAD_DIMS)
    group = hq // hk
    rows = nq * group
    m_blocks = -(-rows // dk.ROWS)
    keys = dk.window_keys(limits.capacity, nq, variant.left)  # the most keys a CTA reads
    token = mods.token_number(pair) if pair is not None else 0
    if spec is None:  # (verify: a tile this NVRTC would refuse gives way to the rule's next one)
        key = ProblemKey(dk.SPLIT.kind, dev.arch, dtype, tile, True, bucket_of(keys), variant.key())
        regime = dk.decode_regime(b * hk * m_blocks, dev.sms)
        if pair is not None:  # (the plain key's pick with the mods; the rule's next tiles where it spills)
            spec = dispatch.mod_decode_spec(key, dev.gpu, dev.smem_budget, token, regime, verify=True)
        else:
            spec = dispatch.select(key, dev.gpu, dev.smem_budget, verify=True, regime=regime)
            plan.record = (key, (b, hq, hk, nq, limits.capacity, d))
    else:
        check_forced_spec(spec, {"kind": dk.SPLIT.kind, "dtype": dtype, "arch": dev.arch, "mod": token,
                                 **variant.flags()}, d, dev.smem_budget)
    kern = load(spec, index)
    if num_splits is None:
        occ = dk.ctas_per_sm(spec.smem_bytes(), spec.warps * 32, kern.binary.report.registers or 255, dev.smem_per_sm)
        num_splits = dk.num_splits_heuristic(b, hk, m_blocks, keys, spec.block_n, dev.sms, occ, fill_slots=spec.fp8)
    total_rows = b * nq * hq
    plan.kernel, plan.spec, plan.splits = kern, spec, num_splits
    plan.grid = (num_splits * m_blocks, hk, b)
    s_new = k_new.stride() if k_new is not None else (0, 0, 0)
    s_vnew = v_new.stride() if v_new is not None else (0, 0, 0)
    ks, vs, qs = k_cache.stride(), v_cache.stride(), q.stride()
    # The variant's values: the window's left side, and with a softcap its factor and the cap as the scale
    # (a score_mod: the scale, times k, before it, and c as the softmax's scale).
    values = variant.values(nq, limits.capacity + nq, scale) if not variant.plain else {}
    if pair is not None and pair.score is not None:
        values = variant.replace(scored=True, score_factor=c_out).values(nq, limits.capacity + nq, scale * k_in)
    # An FP8 cache's descales: (batch, KV head) strides, 0 for one factor (the pointers are the call's).
    kd_sb, kd_sh, _ = descale_strides(k_descale, hk) if k_descale is not None else (0, 0, 1)
    vd_sb, vd_sh, _ = descale_strides(v_descale, hk) if v_descale is not None else (0, 0, 1)
    template = kern.params(
        q_sb=qs[0], q_ss=qs[1], q_sh=qs[2], k_sb=ks[0], k_ss=ks[1], k_sh=ks[2], v_sb=vs[0], v_ss=vs[1], v_sh=vs[2],
        knew_sb=s_new[0], knew_ss=s_new[1], knew_sh=s_new[2], vnew_sb=s_vnew[0], vnew_ss=s_vnew[1],
        vnew_sh=s_vnew[2], o_sb=nq * hq * d, o_ss=hq * d, o_sh=d,
        bt_sb=block_table.stride(0) if block_table is not None else 0, total_rows=total_rows,
        nq=nq, heads_q=hq, group=group, rows=rows, d=d, seqlen_k=limits.capacity,
        page_shift=(limits.page_size.bit_length() - 1) if limits.page_size else 0, num_splits=num_splits,
        scale=values.get("scale", scale), scale_log2=values.get("scale_log2", scale * math.log2(math.e)),
        win_left=values.get("win_left", 0) if variant.windowed else 0, cap_in=values.get("cap_in", 0.0),
        alibi_sb=(alibi_slopes.shape[1] if alibi_slopes.dim() == 2 else 0) if alibi_slopes is not None else 0,
        kd_sb=kd_sb, kd_sh=kd_sh, vd_sb=vd_sb, vd_sh=vd_sh,
    )
    if pair is not None:  # the captures' addresses, strides and sizes (fixed while the plan is current)
        offset, blob = pack_mod_fields(type(template), tuple(pair.captures), None)
        fill_mods(template, offset, blob)
    plan._template, plan._struct = bytes(template), type(template)
    if num_splits > 1:
        plan.ws_numel = num_splits * total_rows * (d + 1)
        plan.ws_lse_offset = num_splits * total_rows * d * 4  # bytes: the LSEs follow the partial outputs
        plan.ctr_numel = 2 * b * hk * m_blocks                # a ticket and a count per (batch, KV head, m-block)
        if not FUSED_COMBINE and not variant.sinks:  # (decode_combine has no sinks: the in-kernel merge adds them)
            cspec = dk.COMBINE.spec_for(dev.arch, dtype, spec.head_dim)
            ckern = load(cspec, index)
            per_cta = cspec.warps * 32 // (cspec.head_dim // 4)
            plan.combine = ckern
            plan.combine_grid = (-(-total_rows // per_cta), 1, 1)
            ctemplate = ckern.params(total_rows=total_rows, nq=nq, heads_q=hq, d=d, num_splits=num_splits)
            plan._ctemplate, plan._cstruct = bytes(ctemplate), type(ctemplate)
    return plan
