"""Autograd and torch.compile support: flashgen's forward and backward as torch custom ops.

- ``flashgen::attn_fwd(q, k, v, causal, softmax_scale, layout, deterministic, win_left, win_right,
  softcap, alibi_slopes, sinks) -> (out, lse)``
- ``flashgen::attn_bwd(dout, q, k, v, out, lse, dlse, causal, softmax_scale, layout, deterministic,
  win_left, win_right, softcap, alibi_slopes, sinks) -> (dq, dk, dv, dsinks)`` (dsinks empty without
  sinks)

The variant options (flashgen.variants) travel as plain values: the window's two sides (-1: unbounded),
the softcap (0: off), the optional slopes and sinks; the sinks get a gradient, the slopes none.

Both have fake (meta) implementations, so ``torch.compile(fullgraph=True)``
traces a model that calls ``flashgen.attention`` without graph breaks, and
``attn_fwd`` has an autograd formula (``register_autograd``) that saves q, k, v,
out and lse and calls ``attn_bwd``. ``flashgen.attention`` routes here when a
gradient is needed or while torch.compile traces; otherwise it launches the
forward directly (no op overhead).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .forward import forward
from .backward import attention_backward
from ..variants import Variant, check_softcap, window_of
from .checks import LAYOUTS, check_flag, checked_scale


def _lse_shape(q: Tensor, layout: str):
    if layout == "bshd":
        return (q.shape[0], q.shape[2], q.shape[1])
    return (q.shape[0], q.shape[1], q.shape[2])


def _window(win_left: int, win_right: int):
    return None if (win_left, win_right) == (-1, -1) else (win_left, win_right)


@torch.library.custom_op("flashgen::attn_fwd", mutates_args=())
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float, layout: str,
             deterministic: bool, win_left: int = -1, win_right: int = -1, softcap: float = 0.0,
             alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Forward: (out, lse). ``deterministic`` is only carried to the backward."""
    return forward(q, k, v, causal, softmax_scale, layout, True, None, "v2", _window(win_left, win_right), softcap,
                   alibi_slopes, sinks)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, causal, softmax_scale, layout, deterministic, win_left=-1, win_right=-1, softcap=0.0,
                   alibi_slopes=None, sinks=None):
    # The real op allocates its outputs contiguous in q's shape; the fake matches.
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q, layout), dtype=torch.float32)


@torch.library.custom_op("flashgen::attn_bwd", mutates_args=())
def attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
             causal: bool, softmax_scale: float, layout: str, deterministic: bool, win_left: int = -1,
             win_right: int = -1, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
             sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward: (dq, dk, dv, dsinks), contiguous in the shapes of q, k, v (and the sinks'; empty without)."""
    variant = Variant.of(causal, _window(win_left, win_right), softcap, alibi_slopes is not None, sinks is not None)
    grads = attention_backward(dout, q, k, v, out, lse, variant.causal, softmax_scale, layout, deterministic, dlse,
                               variant=variant, alibi_slopes=alibi_slopes, sinks=sinks)
    if sinks is None:
        return (*grads, q.new_empty((0,), dtype=torch.float32))
    return grads


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, dlse, causal, softmax_scale, layout, deterministic, win_left=-1,
                   win_right=-1, softcap=0.0, alibi_slopes=None, sinks=None):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, layout, deterministic, win_left, win_right, softcap, alibi, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi, sinks)
    ctx.flags = (causal, softmax_scale, layout, deterministic, win_left, win_right, softcap)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, alibi, sinks = ctx.saved_tensors
    causal, softmax_scale, layout, deterministic, win_left, win_right, softcap = ctx.flags
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    dq, dk, dv, dsinks = torch.ops.flashgen.attn_bwd(dout, q, k, v, out, lse, dlse, causal, softmax_scale, layout,
                                                     deterministic, win_left, win_right, softcap, alibi, sinks)
    return dq, dk, dv, None, None, None, None, None, None, None, None, (dsinks if sinks is not None else None)


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention_op(q, k, v, causal, softmax_scale, layout, return_lse, deterministic, spec, window=None, softcap=0.0,
                 alibi_slopes=None, sinks=None):
    """``flashgen.attention`` through the custom op (differentiable, traceable by torch.compile)."""
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
    out, lse = torch.ops.flashgen.attn_fwd(q, k, v, causal, scale, layout, deterministic, left, right,
                                           float(softcap), alibi_slopes, sinks)
    return (out, lse) if return_lse else out
