"""Gradients of the tensors a score_mod captures (a learned bias table, per-head slopes), for
``flashgen.attention(..., score_mod=...)`` when one of them requires grad.

The kernels give dQ, dK and dV. A captured tensor's gradient is the sum, over every visible
(batch, head, query, key), of dL/dS_mod times dS_mod/d(the capture). Here dS_mod = P (dP - D), with
P = exp(S_mod - LSE), dP = dO V^T and D = rowsum(dO O) - dLSE, as in the backward. This module
computes that with torch, a block of query rows at a time, in fp32 on upcast inputs. S_mod comes from
the traced graph's evaluator (``Graph.evaluate``: the kernel's semantics, clamped reads included),
and autograd carries dS_mod back to the captures. It costs about a forward and a backward in torch
matmuls, and no more memory than one block of rows' scores. It is the path for a feature the
kernels do not have (their backward adds nothing to a capture), not a fast path.
"""
from __future__ import annotations

import torch

from ..mods import Graph

# Scores held at once: (batch, heads, rows, keys) fp32 values per block of query rows, a few of them live.
BLOCK_SCORES = 16 * 2**20


def capture_grads(pair, wanted, q, k, v, out, lse, dout, dlse, scale: float, layout: str) -> list:
    """The gradients of ``wanted`` (captured tensors of ``pair``, each requiring grad) for the call
    ``out, lse = attention(q, k, v, score_mod, mask_mod)`` and the gradients ``dout`` (and ``dlse`` or None)
    of its outputs; q/k/v/out/dout in ``layout``, lse (b, h, nq). Returns one tensor per wanted capture,
    in its dtype (zeros for a capture only the mask_mod reads: a mask has no gradient)."""
    if pair.score is None:
        return [torch.zeros_like(t) for t in wanted]
    if layout == "bshd":
        q, k, v, out, dout = (t.transpose(1, 2) for t in (q, k, v, out, dout))
    b, h, nq, _ = q.shape
    hk, nk = k.shape[1], k.shape[2]
    group = h // hk
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    dev = q.device
    bi, hi = (torch.arange(n, device=dev).view(*(n if a == i else 1 for a in range(4))) for i, n in ((0, b), (1, h)))
    ki = torch.arange(nk, device=dev).view(1, 1, 1, nk)
    rows = max(1, BLOCK_SCORES // max(1, b * h * nk))
    grads = [torch.zeros_like(t, dtype=torch.float32) for t in wanted]
    leaves = [t.detach().requires_grad_(True) for t in wanted]
    swap = {id(t): leaf for t, leaf in zip(wanted, leaves)}
    score_graph = _with_captures(pair.score, swap)
    for r0 in range(0, nq, rows):
        r1 = min(nq, r0 + rows)
        qi = torch.arange(r0, r1, device=dev).view(1, 1, -1, 1)
        qf, of, dof = (t[:, :, r0:r1].float() for t in (q, out, dout))
        l = lse[:, :, r0:r1].float().unsqueeze(-1)
        d = (dof * of).sum(-1, keepdim=True)
        if dlse is not None:
            d = d - dlse[:, :, r0:r1].float().unsqueeze(-1)
        s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
        with torch.enable_grad():
            s_mod = score_graph.evaluate(s, bi, hi, qi, ki)
        visible = torch.isfinite(l).expand_as(s)
        if pair.mask is not None:
            visible = visible & pair.mask.evaluate(None, bi, hi, qi, ki).expand_as(s)
        p = torch.where(visible, torch.exp(s_mod.detach() - l), torch.zeros_like(s))
        ds = p * (torch.matmul(dof, vf.transpose(-1, -2)) - d)
        found = torch.autograd.grad(s_mod, leaves, grad_outputs=ds, allow_unused=True)
        for g, f in zip(grads, found):
            if f is not None:
                g += f.float()
    return [g.to(t.dtype) for g, t in zip(grads, wanted)]


def _with_captures(graph, swap: dict):
    """``graph`` reading ``swap[id(t)]`` in place of each capture t found there (the grad-requiring leaves
    the gradients are taken for)."""
    captures = tuple(swap.get(id(t), t) for t in graph.captures)
    return Graph(graph.kind, graph.nodes, captures, graph.capture_types)
