"""Autograd and torch.compile support: flashgen's forward and backward as torch custom ops.

- ``flashgen::attn_fwd(q, k, v, causal, softmax_scale, layout, deterministic, win_left, win_right,
  softcap, alibi_slopes, sinks, keep_fp32) -> (out, lse, out32)``
- ``flashgen::attn_bwd(dout, q, k, v, out, lse, dlse, causal, softmax_scale, layout, deterministic,
  win_left, win_right, softcap, alibi_slopes, sinks, out32) -> (dq, dk, dv, dsinks)`` (dsinks empty
  without sinks)

The variant options (flashgen.variants) travel as plain values: the window's two sides (-1: unbounded),
the softcap (0: off), the optional slopes and sinks; the sinks get a gradient, the slopes none. With
sinks and ``keep_fp32`` (a gradient will be needed) the forward also returns its output in fp32, (b, h,
nq, d), from which the backward takes D = rowsum(dO O) (``attention_backward``'s ``out32``); otherwise
``out32`` is empty.

Both have fake (meta) implementations, so ``torch.compile(fullgraph=True)``
traces a model that calls ``flashgen.attention`` without graph breaks, and
``attn_fwd`` has an autograd formula (``register_autograd``) that saves q, k, v,
out and lse and calls ``attn_bwd``. ``flashgen.attention`` routes here when a
gradient is needed or while torch.compile traces; otherwise it launches the
forward directly (no op overhead). Eager calls with a gradient run the ops' own
functions and formula through a plain ``torch.autograd.Function`` (``_Eager``):
the op dispatch's host time is then saved too; torch.compile and meta tensors
keep the ops. The packed-rows ops (``attn_varlen_fwd`` / ``attn_varlen_bwd``) alike.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from .forward import forward, packed_forward
from .backward import attention_backward
from ..variants import Variant, check_softcap, window_of
from .checks import LAYOUTS, check_flag, checked_scale
from .device import is_compiling


def _lse_shape(q: Tensor, layout: str):
    if layout == "bshd":
        return (q.shape[0], q.shape[2], q.shape[1])
    return (q.shape[0], q.shape[1], q.shape[2])


def _out32_shape(q: Tensor, layout: str, kept: bool):
    """The fp32 output's shape: (b, h, nq, d) when kept, else empty."""
    if not kept:
        return (0,)
    b, h, n = _lse_shape(q, layout)
    return (b, h, n, q.shape[-1])


def _window(win_left: int, win_right: int):
    return None if (win_left, win_right) == (-1, -1) else (win_left, win_right)


def _attn_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float, layout: str,
              deterministic: bool, win_left: int = -1, win_right: int = -1, softcap: float = 0.0,
              alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
              keep_fp32: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Forward: (out, lse, out32). ``deterministic`` is only carried to the backward."""
    out32 = q.new_empty(_out32_shape(q, layout, sinks is not None and keep_fp32), dtype=torch.float32)
    out, lse = forward(q, k, v, causal, softmax_scale, layout, True, None, "v2", _window(win_left, win_right),
                       softcap, alibi_slopes, sinks, out32 if out32.numel() else None)
    return out, lse, out32


attn_fwd = torch.library.custom_op("flashgen::attn_fwd", mutates_args=())(_attn_fwd)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, causal, softmax_scale, layout, deterministic, win_left=-1, win_right=-1, softcap=0.0,
                   alibi_slopes=None, sinks=None, keep_fp32=False):
    # The real op allocates its outputs contiguous in q's shape; the fake matches.
    return (q.new_empty(q.shape), q.new_empty(_lse_shape(q, layout), dtype=torch.float32),
            q.new_empty(_out32_shape(q, layout, sinks is not None and keep_fp32), dtype=torch.float32))


def _attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
              causal: bool, softmax_scale: float, layout: str, deterministic: bool, win_left: int = -1,
              win_right: int = -1, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
              sinks: Optional[Tensor] = None, out32: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward: (dq, dk, dv, dsinks), contiguous in the shapes of q, k, v (and the sinks'; empty without)."""
    variant = Variant.of(causal, _window(win_left, win_right), softcap, alibi_slopes is not None, sinks is not None)
    grads = attention_backward(dout, q, k, v, out, lse, variant.causal, softmax_scale, layout, deterministic, dlse,
                               variant=variant, alibi_slopes=alibi_slopes, sinks=sinks,
                               out32=out32 if out32 is not None and out32.numel() else None)
    if sinks is None:
        return (*grads, q.new_empty((0,), dtype=torch.float32))
    return grads


attn_bwd = torch.library.custom_op("flashgen::attn_bwd", mutates_args=())(_attn_bwd)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, dlse, causal, softmax_scale, layout, deterministic, win_left=-1,
                   win_right=-1, softcap=0.0, alibi_slopes=None, sinks=None, out32=None):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, layout, deterministic, win_left, win_right, softcap, alibi, sinks, _ = inputs
    out, lse, out32 = output
    ctx.mark_non_differentiable(out32)
    ctx.save_for_backward(q, k, v, out, lse, alibi, sinks, out32)
    ctx.flags = (causal, softmax_scale, layout, deterministic, win_left, win_right, softcap)


def _grads(ctx, dout, dlse, bwd):
    """The gradients of attn_fwd's inputs from ``bwd`` (the op, or its function on the eager path)."""
    q, k, v, out, lse, alibi, sinks, out32 = ctx.saved_tensors
    causal, softmax_scale, layout, deterministic, win_left, win_right, softcap = ctx.flags
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    dq, dk, dv, dsinks = bwd(dout, q, k, v, out, lse, dlse, causal, softmax_scale, layout, deterministic, win_left,
                             win_right, softcap, alibi, sinks, out32)
    return dq, dk, dv, None, None, None, None, None, None, None, None, (dsinks if sinks is not None else None), None


def _backward(ctx, dout, dlse, _dout32):  # out32 is the backward's own input, never a result the caller uses
    return _grads(ctx, dout, dlse, torch.ops.flashgen.attn_bwd)


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """An op's forward and autograd formula without the op, for eager calls: ``Op`` (below) names the forward
    function, its ``setup_context`` and its gradients (both ops' outputs are (out, lse, out32), out32 no result
    the caller differentiates). torch.library's dispatch and autograd wrapper around the ops took 0.4-0.6 ms of
    host time per forward + backward on an H100 host (about 1 ms a step against 0.56 here), more than a
    training step's kernels at N = 1k (0.78 ms at d = 128, causal); torch.compile and meta tensors keep the ops
    (their fake kernels, no graph breaks)."""

    @staticmethod
    def forward(op, *inputs):
        return op.forward(*inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):  # (the separate form: what torch.func's transforms need)
        op, *rest = inputs
        op.setup_context(ctx, tuple(rest), output)
        ctx.op = op
        ctx.set_materialize_grads(False)  # (None for an unused output, as the op's formula gets)

    @staticmethod
    def backward(ctx, *grads):
        return None, *ctx.op.grads(ctx, *grads[:-1])


class Op(NamedTuple):
    forward: Callable
    setup_context: Callable
    grads: Callable  # (ctx, dout, dlse) -> the inputs' gradients


PADDED = Op(_attn_fwd, _setup_context, lambda ctx, dout, dlse: _grads(ctx, dout, dlse, _attn_bwd))


def _run(op: Op, registered, q: Tensor, *args):
    """``registered(q, *args)`` (the custom op) while torch.compile traces or on meta tensors, else the same
    forward and formula through ``_Eager``."""
    if is_compiling() or q.is_meta:
        return registered(q, *args)
    return _Eager.apply(op, q, *args)


def attention_op(q, k, v, causal, softmax_scale, layout, return_lse, deterministic, spec, window=None, softcap=0.0,
                 alibi_slopes=None, sinks=None):
    """``flashgen.attention`` with autograd: the custom op while torch.compile traces (or on meta tensors), else
    the op's forward and formula through ``_Eager``."""
    if spec is not None:
        raise ValueError("spec= forces one forward kernel and is not supported when a gradient is needed "
                         "or under torch.compile; call under torch.no_grad()")
    check_flag("causal", causal)
    check_flag("return_lse", return_lse)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a 4-D torch.Tensor ({layout})")
    scale = checked_scale(softmax_scale, q.shape[-1])
    left, right = window_of(False, window)  # checked here: the op takes two ints
    check_softcap(softcap)
    keep_fp32 = sinks is not None and torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v, sinks) if isinstance(t, Tensor))
    out, lse, _ = _run(PADDED, torch.ops.flashgen.attn_fwd, q, k, v, causal, scale, layout, deterministic, left,
                       right, float(softcap), alibi_slopes, sinks, keep_fp32)
    return (out, lse) if return_lse else out


def _packed_out32_shape(q: Tensor, kept: bool):
    """A packed forward's fp32 output: (heads, total_q, d) when kept, else empty."""
    return (q.shape[1], q.shape[0], q.shape[2]) if kept else (0,)


def _attn_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, causal: bool, softmax_scale: float, deterministic: bool = False,
                     seqused_k: Optional[Tensor] = None, win_left: int = -1, win_right: int = -1, softcap: float = 0.0,
                     alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                     keep_fp32: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Packed-rows forward: (out (total_q, heads, d), lse (heads, total_q), out32); values unchecked (the
    entry's). ``deterministic`` is only carried to the backward; out32 as ``attn_fwd``'s, (heads, total_q, d)."""
    out32 = q.new_empty(_packed_out32_shape(q, sinks is not None and keep_fp32), dtype=torch.float32)
    out, lse = packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                              seqused_k, _window(win_left, win_right), softcap, alibi_slopes, sinks,
                              out32=out32 if out32.numel() else None)
    return out, lse, out32


attn_varlen_fwd = torch.library.custom_op("flashgen::attn_varlen_fwd", mutates_args=())(_attn_varlen_fwd)


@attn_varlen_fwd.register_fake
def _attn_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                          deterministic=False, seqused_k=None, win_left=-1, win_right=-1, softcap=0.0,
                          alibi_slopes=None, sinks=None, keep_fp32=False):
    return (q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32),
            q.new_empty(_packed_out32_shape(q, sinks is not None and keep_fp32), dtype=torch.float32))


def _attn_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
                     cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_k: Optional[Tensor], causal: bool,
                     softmax_scale: float, deterministic: bool, win_left: int = -1, win_right: int = -1,
                     softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                     out32: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Packed-rows backward: (dq, dk, dv, dsinks) in the packed shapes (dsinks empty without sinks); the
    tensors go to ``attention_backward`` as one batch of packed rows."""
    variant = Variant.of(causal, _window(win_left, win_right), softcap, alibi_slopes is not None, sinks is not None,
                         varlen=True)
    one = [t.unsqueeze(0) for t in (dout, q, k, v, out)]
    grads = attention_backward(*one, lse.unsqueeze(0), variant.causal, softmax_scale, "bshd", deterministic,
                               dlse.unsqueeze(0) if dlse is not None else None, variant=variant,
                               alibi_slopes=alibi_slopes, sinks=sinks,
                               out32=out32.unsqueeze(0) if out32 is not None and out32.numel() else None,
                               packed=(cu_seqlens_q, cu_seqlens_k, seqused_k, cu_seqlens_q.shape[0] - 1))
    dq, dk, dv = (g.squeeze(0) for g in grads[:3])
    if seqused_k is not None and k.shape[0]:
        # Keys past a sequence's seqused_k are no key of the call: their gradients are 0 (the kernels write
        # only the keys in use). Found on the device, with no sync.
        rows = torch.arange(k.shape[0], device=k.device, dtype=torch.int32)
        seq = (torch.searchsorted(cu_seqlens_k, rows, right=True) - 1).clamp_(0, seqused_k.shape[0] - 1)
        unused = (rows - cu_seqlens_k[seq]) >= seqused_k[seq]
        dk.masked_fill_(unused[:, None, None], 0)
        dv.masked_fill_(unused[:, None, None], 0)
    return dq, dk, dv, grads[3] if sinks is not None else q.new_empty((0,), dtype=torch.float32)


attn_varlen_bwd = torch.library.custom_op("flashgen::attn_varlen_bwd", mutates_args=())(_attn_varlen_bwd)


@attn_varlen_bwd.register_fake
def _attn_varlen_bwd_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, causal, softmax_scale,
                          deterministic, win_left=-1, win_right=-1, softcap=0.0, alibi_slopes=None, sinks=None,
                          out32=None):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, _mq, _mk, causal, scale, deterministic, seqused_k, win_left, win_right, softcap, alibi,
     sinks, _) = inputs
    out, lse, out32 = output
    ctx.mark_non_differentiable(out32)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seqused_k, alibi, sinks, out32)
    ctx.flags = (causal, scale, deterministic, win_left, win_right, softcap)


def _varlen_grads(ctx, dout, dlse, bwd):
    q, k, v, out, lse, cu_q, cu_k, seqused_k, alibi, sinks, out32 = ctx.saved_tensors
    causal, scale, deterministic, win_left, win_right, softcap = ctx.flags
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsinks = bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, seqused_k, causal, scale, deterministic,
                             win_left, win_right, softcap, alibi, sinks, out32)
    return (dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None,
            dsinks if sinks is not None else None, None)


def _varlen_backward(ctx, dout, dlse, _dout32):
    return _varlen_grads(ctx, dout, dlse, torch.ops.flashgen.attn_varlen_bwd)


attn_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)
PACKED = Op(_attn_varlen_fwd, _varlen_setup_context, lambda ctx, dout, dlse: _varlen_grads(ctx, dout, dlse,
                                                                                          _attn_varlen_bwd))


@torch.library.custom_op("flashgen::attn_paged_fwd", mutates_args=())
def attn_paged_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Optional[Tensor],
                   max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
                   seqused_k: Optional[Tensor], block_table: Tensor, win_left: int = -1, win_right: int = -1,
                   softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                   sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Packed rows against a paged K/V cache (no gradient): (out (total_q, heads, d), lse (heads, total_q))."""
    return packed_forward(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                          softmax_scale, seqused_k, _window(win_left, win_right), softcap, alibi_slopes, sinks,
                          block_table=block_table)


@attn_paged_fwd.register_fake
def _attn_paged_fwd_fake(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                         softmax_scale, seqused_k, block_table, win_left=-1, win_right=-1, softcap=0.0,
                         alibi_slopes=None, sinks=None):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def attention_paged_op(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                       softmax_scale, seqused_k=None, window=None, softcap=0.0, alibi_slopes=None, sinks=None, *,
                       block_table):
    """``attention_varlen`` over a paged cache through its custom op (traceable by torch.compile)."""
    if not isinstance(q, Tensor) or q.dim() != 3:
        raise ValueError("q must be a 3-D torch.Tensor (total_tokens, heads, d)")
    left, right = window_of(False, window)
    check_softcap(softcap)
    return torch.ops.flashgen.attn_paged_fwd(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, causal, checked_scale(softmax_scale, q.shape[-1]),
                                             seqused_k, block_table, left, right, float(softcap), alibi_slopes,
                                             sinks)


def attention_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                        deterministic=False, seqused_k=None, window=None, softcap=0.0, alibi_slopes=None, sinks=None):
    """``attention_varlen`` with autograd, as ``attention_op``: (out, lse)."""
    if not isinstance(q, Tensor) or q.dim() != 3:
        raise ValueError("q must be a 3-D torch.Tensor (total_tokens, heads, d)")
    scale = checked_scale(softmax_scale, q.shape[-1])
    left, right = window_of(False, window)
    check_softcap(softcap)
    keep_fp32 = sinks is not None and torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v, sinks) if isinstance(t, Tensor))
    out, lse, _ = _run(PACKED, torch.ops.flashgen.attn_varlen_fwd, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k, causal, scale, deterministic, seqused_k, left, right, float(softcap), alibi_slopes,
                       sinks, keep_fp32)
    return out, lse
