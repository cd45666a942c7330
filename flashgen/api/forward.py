"""The forward launch: checks, the problem key, dispatch, the family's packed arguments, the plan cache.

Checks the inputs and raises before any launch, builds the problem key, asks
dispatch for a spec, and launches the compiled kernel on torch's current
stream with raw pointers and strides (no copies, CUDA-graph safe). The spec's
family packs the kernel's arguments (``launch`` of ``families.fwd_v2`` /
``families.fwd_sm90``); a plan keeps them per call signature.
"""
from __future__ import annotations

from threading import get_ident

import torch

from .. import dispatch, families, shapes
from ..codegen import load
from ..codegen.launch import ensure_context
from ..errors import UnsupportedError
from ..families.base import varlen_list_ints
from ..problem import ProblemKey, bucket_of, head_dim_tile
from . import autotune, baselines
from .checks import (DTYPES, check_attention_call, check_forced_spec, check_packed_call, contiguous_strides,
                     variant_tensors)
from .device import Device, current_device, current_stream, index_of, is_capturing
from .fp8 import check_descale_values, descale_strides
from .plans import PlanCache

ALGORITHMS = ("v2", "v1", "standard")

_plans = PlanCache("attention")
_fp8_plans = PlanCache("attention (fp8)")
_packed_plans = PlanCache("attention_varlen")


def _point_at_variant(params, alibi_slopes, sinks):
    """The parameter block's slope and sink pointers (fp32 contiguous copies where the tensors are not:
    ``variant_tensors``); returns what they point at, which the caller keeps until the launch is queued."""
    slopes, params.alibi_sb, sink_logits = variant_tensors(alibi_slopes, sinks)
    params.alibi = slopes.data_ptr() if slopes is not None else 0
    params.sinks = sink_logits.data_ptr() if sink_logits is not None else 0
    return slopes, sink_logits


def _small(t):
    """What a plan's signature records of an optional small tensor (ALiBi slopes, sinks)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def forward(q, k, v, causal, softmax_scale, layout, return_lse, spec=None, algorithm="v2", window=None,
            softcap=0.0, alibi_slopes=None, sinks=None, out32=None):
    """The forward launch behind ``attention`` (no autograd). ``out32`` (with sinks, for the backward): a
    contiguous fp32 (b, h, nq, d) tensor the kernel also writes the normalised output into."""
    try:
        sig = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
               q.device, k.device, v.device, causal, softmax_scale, layout, return_lse, spec,
               type(causal), type(softmax_scale), type(return_lse), algorithm,  # 1 == True: the types keep checks honest
               window, type(window), softcap, type(softcap), _small(alibi_slopes), _small(sinks))
        plan = _plans.get(sig)
    except (AttributeError, TypeError):  # not tensors, or an unhashable argument: the full check says why
        sig = plan = None
    if plan is None:
        plan = _plan(q, k, v, causal, softmax_scale, layout, return_lse, spec, algorithm, window, softcap,
                     alibi_slopes, sinks)
        _plans.put(sig, plan)
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        raise ValueError("q, k, v must be 16-byte aligned (16-byte loads), got addresses "
                         f"{q.data_ptr():#x}, {k.data_ptr():#x}, {v.data_ptr():#x}")
    if type(plan) is not Plan:  # algorithm="v1"/"standard": several kernels and buffers (baselines)
        return plan.run(q, k, v, return_lse)
    if shapes.ACTIVE and plan.record is not None:  # flashgen.record: count this call's key and shape
        shapes.note(*plan.record)
    # contiguous, q's dtype and device; empty_like parses no size argument (new_empty(q.shape): ~1 us more)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty(plan.lse_shape, dtype=torch.float32) if return_lse else None
    if plan.kernel is not None:
        ensure_context(plan.device_index)  # (a thread's first CUDA call: none may be current)
        params = plan.params_for(q.data_ptr(), k.data_ptr(), v.data_ptr())
        params.o = out.data_ptr()
        params.lse = lse.data_ptr() if lse is not None else 0
        params.o32 = out32.data_ptr() if out32 is not None else 0
        if alibi_slopes is not None or sinks is not None:
            keep = _point_at_variant(params, alibi_slopes, sinks)  # noqa: F841 -- alive until the launch is queued
        if plan.counters:
            params.sched = tile_counters(plan.device_index)
        plan.launch(params)
    return (out, lse) if return_lse else out


def forward_fp8(q, k, v, causal, softmax_scale, layout, return_lse, spec, window, softcap, alibi_slopes, sinks,
                q_descale, k_descale, v_descale, out_dtype, check_values=True):
    """The FP8 forward behind ``attention`` (no autograd): q, k, v float8 e4m3 standing for ``x8 *
    descale``; the output in ``out_dtype``. With ``check_values`` the descales' values are checked on the
    host (finite, positive: one device sync) except while a CUDA graph is being captured."""
    try:
        sig = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
               q.device, k.device, v.device, causal, softmax_scale, layout, return_lse, spec,
               type(causal), type(softmax_scale), type(return_lse),  # 1 == True: the types keep checks honest
               window, type(window), softcap, type(softcap), _small(alibi_slopes), _small(sinks),
               _small(q_descale), _small(k_descale), _small(v_descale), out_dtype)
        plan = _fp8_plans.get(sig)
    except (AttributeError, TypeError):  # not tensors, or an unhashable argument: the full check says why
        sig = plan = None
    if plan is None:
        plan = _plan(q, k, v, causal, softmax_scale, layout, return_lse, spec, "v2", window, softcap,
                     alibi_slopes, sinks, fp8=(q_descale, k_descale, v_descale, out_dtype))
        # (b, h) strides of the factors, and query heads per q factor (their shapes are in the signature)
        plan.descales = (*descale_strides(q_descale, q.shape[1] if layout == "bhsd" else q.shape[2]),
                         *descale_strides(k_descale, 1)[:2], *descale_strides(v_descale, 1)[:2])
        _fp8_plans.put(sig, plan)
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        raise ValueError("q, k, v must be 16-byte aligned (16-byte loads), got addresses "
                         f"{q.data_ptr():#x}, {k.data_ptr():#x}, {v.data_ptr():#x}")
    if check_values and not is_capturing():
        check_descale_values((("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)))
    if shapes.ACTIVE and plan.record is not None:
        shapes.note(*plan.record)
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    lse = q.new_empty(plan.lse_shape, dtype=torch.float32) if return_lse else None
    if plan.kernel is not None:
        ensure_context(plan.device_index)
        params = plan.params_for(q.data_ptr(), k.data_ptr(), v.data_ptr())
        params.o = out.data_ptr()
        params.lse = lse.data_ptr() if lse is not None else 0
        if alibi_slopes is not None or sinks is not None:
            keep = _point_at_variant(params, alibi_slopes, sinks)  # noqa: F841 -- alive until the launch is queued
        params.qd, params.kd, params.vd = q_descale.data_ptr(), k_descale.data_ptr(), v_descale.data_ptr()
        (params.qd_sb, params.qd_sh, params.qd_div, params.kd_sb, params.kd_sh, params.vd_sb,
         params.vd_sh) = plan.descales
        plan.launch(params)
    elif lse is not None:
        lse.fill_(float("-inf"))
    return (out, lse) if return_lse else out


def packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                   seqused_k=None, window=None, softcap=0.0, alibi_slopes=None, sinks=None, spec=None, out32=None,
                   block_table=None, return_lse=True):
    """The forward launch behind ``attention_varlen`` (no autograd, no value checks: the caller's):
    (out (total_q, heads, d), lse (heads, total_q) fp32, or None with ``return_lse=False``: the kernel
    then writes none). ``out32`` (with sinks): an fp32 (heads, total_q, d) tensor the kernel also writes
    the normalised output into. ``block_table``: k and v are paged caches (``check_packed_inputs``)."""
    try:
        # Flat on purpose: this tuple is built and hashed on every call (host overhead); the tensors that
        # are usually absent share one entry.
        sig = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
               q.device, k.device, v.device,
               cu_seqlens_q.shape, cu_seqlens_q.stride(), cu_seqlens_q.dtype, cu_seqlens_q.device,
               None if cu_seqlens_k is None else
               (cu_seqlens_k.shape, cu_seqlens_k.stride(), cu_seqlens_k.dtype, cu_seqlens_k.device),
               max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, softcap, spec,
               type(max_seqlen_q), type(max_seqlen_k), type(causal), type(softmax_scale), type(window),
               type(softcap),  # 1 == True: the types keep checks honest
               None if seqused_k is None and alibi_slopes is None and sinks is None and block_table is None else
               (_small(seqused_k), _small(alibi_slopes), _small(sinks), _small(block_table)))
        plan = _packed_plans.get(sig)
    except (AttributeError, TypeError):
        sig = plan = None
    if plan is None:
        plan = packed_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                           seqused_k, window, softcap, alibi_slopes, sinks, spec, block_table)
        _packed_plans.put(sig, plan)
    if shapes.ACTIVE and plan.record is not None:
        shapes.note(*plan.record)
    qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
    if (qp | kp | vp) & 15:
        raise ValueError(f"q, k, v must be 16-byte aligned (16-byte loads), got addresses {qp:#x}, {kp:#x}, {vp:#x}")
    # contiguous (total_q, heads, d) in q's dtype and device; empty_like reads q's options without the
    # size argument that new_empty parses (a torch.Size there costs about 1 us more on the host)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty(plan.lse_shape, dtype=torch.float32) if return_lse else None
    if plan.kernel is None:  # no query rows, or no sequences
        if lse is not None:
            lse.fill_(float("-inf"))
        return out.zero_(), lse
    ensure_context(plan.device_index)
    params = plan.params_for(qp, kp, vp)
    params.o = out.data_ptr()
    if lse is not None:  # (the parameter block's pointers not set here are null)
        params.lse = lse.data_ptr()
    if out32 is not None:
        params.o32 = out32.data_ptr()
    params.cu_q = cu_seqlens_q.data_ptr()
    if cu_seqlens_k is not None:
        params.cu_k = cu_seqlens_k.data_ptr()
    if seqused_k is not None:
        params.used_k = seqused_k.data_ptr()
    if block_table is not None:
        params.bt, params.bt_stride = block_table.data_ptr(), block_table.stride(0)
    if alibi_slopes is not None or sinks is not None:
        keep = _point_at_variant(params, alibi_slopes, sinks)  # noqa: F841 -- alive until the launch is queued
    idx = plan.device_index
    if idx == current_device():
        _launch_packed(plan, params, current_stream(idx))
    else:
        with torch.cuda.device(idx):
            _launch_packed(plan, params, current_stream(idx))
    return out, lse


def _launch_packed(plan, params, stream: int) -> None:
    """Enqueue a packed call on ``stream`` (the plan's device is current): the work list's builder, then
    the kernel, with the stream's work list (and tile counters, a persistent kernel)."""
    work = _work_list(plan.device_index, stream, plan.list_ints)  # (alive until both launches are queued)
    params.vl_tiles = work.data_ptr()
    if plan.counters:
        params.sched = tile_counters(plan.device_index)
    plan.kernel.launch_after("_tiles", 1024, plan.grid, params, stream)


# Work lists of packed calls, one per (device, stream, thread), grown as needed: the builder rewrites the
# list before each kernel that reads it, and launches on one stream run in order, so one buffer serves
# every call there; the thread is in the key because two threads may interleave their launches on one
# stream (a builder between another call's builder and kernel). While a CUDA graph is being captured the
# list comes from torch's allocator (the graph's pool): a replay must not share the eager calls' list.
_work_lists: dict = {}


def _work_list(idx: int, stream: int, ints: int):
    """An int32 tensor of at least ``ints`` slots on device ``idx`` for a work list on ``stream``."""
    if is_capturing():
        return torch.empty(ints, dtype=torch.int32, device=torch.device("cuda", idx))
    key = (idx, stream, get_ident())
    t = _work_lists.get(key)
    if t is None or t.numel() < ints:
        if len(_work_lists) > 64:  # streams or threads come and go: start over rather than grow forever
            _work_lists.clear()
        t = _work_lists[key] = torch.empty(max(ints, 2 * (t.numel() if t is not None else 0), 1 << 12),
                                           dtype=torch.int32, device=torch.device("cuda", idx))
    return t


def packed_plan(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, seqused_k, window, softcap, alibi_slopes,
                 sinks, spec, block_table=None):
    dims, strides, scale, variant = check_packed_call(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale,
                                                      seqused_k, block_table, window, softcap, alibi_slopes, sinks)
    seqs, h, hk, total_q, total_k, d = dims
    shapes.from_environment()
    index = index_of(q)
    if not (total_q and seqs):
        return Plan(None, None, index, (h, total_q))
    dev = Device.of(index)
    key = ProblemKey("fwd", dev.arch, DTYPES[q.dtype], head_dim_tile(d), variant.causal,
                     bucket_of(max(1, max_q)), variant.key())
    serving = families.serving("fwd", dev.arch)
    kv_pages = tuple(k.shape[:2]) if block_table is not None else None
    dispatched = spec is None
    if spec is None:
        spec = dispatch.select(key, dev.gpu, dev.smem_budget, verify=True)
        if kv_pages is not None:
            spec = families.paged_spec(spec, kv_pages[1])
    else:
        check_forced_spec(spec, {"kind": serving, "dtype": key.dtype, "arch": dev.arch, **variant.flags()}, d,
                          dev.smem_budget)
        if (kv_pages is not None) != bool(getattr(spec, "page_rows", 0)) or (
                kv_pages is not None and kv_pages[1] % spec.page_rows):
            raise ValueError(f"spec {spec.name} does not fit this call's K/V: "
                             + (f"pages of {kv_pages[1]} keys want page_rows dividing them" if kv_pages else
                                "contiguous K/V want page_rows 0"))
    kern = load(spec, dev.index)
    fam = families.family(spec.kind)
    o_strides = (0, d, h * d)  # the output: contiguous (total_q, heads, d)
    grid, params_for = fam.launch(kern, dims, strides, o_strides, scale, dev, variant,
                                  **({"kv_pages": kv_pages} if kv_pages else {}))
    plan = Plan(kern, grid, dev.index, (h, total_q), params_for, fam.needs_tile_counters(spec))
    plan.list_ints = varlen_list_ints(total_q, seqs, spec.block_m)
    if dispatched:
        plan.record = (key, (seqs, h, hk, max(1, max_q), max(1, max_k), d))
    return plan


class Plan:
    """A checked forward call: the kernel, its grid, and ``params_for(q, k, v addresses)``, the family's
    packed parameter block with the inputs filled in (fwd_sm90: their tensor maps, cached per address
    triple); ``counters``: the launch takes the stream's tile counters (a persistent kernel)."""

    __slots__ = ("kernel", "grid", "device_index", "lse_shape", "params_for", "counters", "list_ints", "record",
                 "descales")

    def __init__(self, kernel, grid, device_index, lse_shape, params_for=None, counters=False):
        self.kernel, self.grid, self.device_index, self.lse_shape = kernel, grid, device_index, lse_shape
        self.params_for, self.counters, self.list_ints = params_for, counters, 0
        self.record = None  # (ProblemKey, shape) of a dispatched call, for flashgen.record
        self.descales = ()  # an FP8 call's descale strides (forward_fp8)

    def launch(self, params) -> None:
        """Enqueue the kernel on the current stream of the plan's device."""
        idx = self.device_index
        if idx == current_device():
            self.kernel.launch(self.grid, params, current_stream(idx))
        else:
            with torch.cuda.device(idx):
                self.launch(params)


def _plan(q, k, v, causal, softmax_scale, layout, return_lse, spec, algorithm="v2", window=None, softcap=0.0,
          alibi_slopes=None, sinks=None, fp8=None):
    """``fp8``: (q_descale, k_descale, v_descale, out_dtype) of an FP8 call (the key's dtype is the
    output's, its variant carries the fp8 switch)."""
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    (b, h, nq, d), sq, (hk, nk), sk, sv, scale, variant = check_attention_call(
        q, k, v, causal, softmax_scale, layout, return_lse, window, softcap, alibi_slopes, sinks, fp8)
    if algorithm != "v2" and not variant.plain:
        raise UnsupportedError(f"algorithm={algorithm!r} serves plain and causal attention only, not "
                               f"{', '.join(variant.names())}")
    shapes.from_environment()
    index = index_of(q)
    if not (nq and b and h):
        return Plan(None, None, index, (b, h, nq))
    dev = Device.of(index)
    if fp8 is not None and "fwd_sm90" not in families.serving("fwd", dev.arch):
        raise UnsupportedError(f"FP8 attention runs on sm_90a GPUs (wgmma e4m3: H100, H200), not {dev.arch}")
    dims = (b, h, hk, nq, nk, d)
    o_strides = contiguous_strides(q.shape, layout)  # the output is allocated like q
    if algorithm != "v2":
        # (variant.causal: a window of (-1, 0) is the causal mask, also for the study algorithms)
        return baselines.plan(algorithm, spec, variant.causal, dev, DTYPES[q.dtype], dims, (sq, sk, sv), o_strides,
                              scale)
    # One problem key for the forward; the spec (tuned table, default rule or spec=) may be of any
    # forward family the arch runs, and its family decides the launch. A variant is part of the key
    # (dispatch falls back to the plain problem's tuned tile where the table has no entry for it).
    key = ProblemKey("fwd", dev.arch, DTYPES[q.dtype if fp8 is None else fp8[3]], head_dim_tile(d), variant.causal,
                     bucket_of(nq), variant.key())
    serving = families.serving("fwd", dev.arch)
    dispatched = spec is None
    if spec is None:
        spec = dispatch.select(key, dev.gpu, dev.smem_budget, verify=True)
        if fp8 is None:  # (the first-use search times bf16/fp16 calls)
            spec = autotune.tuned_spec(key, dims, dev, spec) or spec  # (FLASHGEN_AUTOTUNE: a key without an entry)
    else:
        if getattr(spec, "kind", None) in families.PROBLEMS["fwd"] and spec.kind not in serving:
            raise UnsupportedError(f"{spec.kind} does not run on {dev.arch} (this device); the forward here runs "
                                   f"{', '.join(serving)}: use such a spec or none")
        check_forced_spec(spec, {"kind": serving, "dtype": key.dtype, "arch": dev.arch, **variant.flags()}, d,
                          dev.smem_budget)
    kern = load(spec, dev.index)
    fam = families.family(spec.kind)
    grid, params_for = fam.launch(kern, dims, (sq, sk, sv), o_strides, scale, dev, variant)
    plan = Plan(kern, grid, dev.index, (b, h, nq), params_for, fam.needs_tile_counters(spec))
    if dispatched:
        plan.record = (key, dims)
    return plan


_counters: dict = {}


def tile_counters(idx: int) -> int:
    """The address of two zeroed int32 tile counters for a persistent fwd_sm90 launch on the current stream
    of device ``idx``: one pair per stream (launches on one stream run one after another, and each leaves
    the pair zeroed), a fresh pair inside a CUDA graph capture (zeroed by the graph itself on replay)."""
    stream = current_stream(idx)
    if is_capturing():
        t = torch.zeros(2, dtype=torch.int32, device=torch.device("cuda", idx))
        return t.data_ptr()
    t = _counters.get((idx, stream))
    if t is None:
        if len(_counters) > 256:  # streams come and go
            _counters.clear()
        t = _counters[(idx, stream)] = torch.zeros(2, dtype=torch.int32, device=torch.device("cuda", idx))
    return t.data_ptr()
