"""The attention reference the tests and the tuner check kernels against.

``reference`` computes softmax(scale q kᵀ) v in a chosen dtype on upcast
inputs, with flashgen's conventions (bhsd, GQA by head groups, bottom-right
causal alignment, a row that sees no key gives 0 and LSE -inf), and the
variants ``flashgen.variants`` defines (window, softcap, ALiBi, sinks). The rule for a
kernel's output (FlashAttention-3's): its max error against the fp32
reference is at most twice that of the same reference computed in the input
dtype, plus a rounding-sized atol (``allowance``). The backward's gradients get
the same rule, each against autograd on fp32 leaves (``grad_tolerance``).
"""
from __future__ import annotations

from .variants import check_softcap, is_banded, window_of


def reference(q, k, v, causal, scale, dtype=None, *, window=None, softcap=0.0, alibi_slopes=None, sinks=None,
              score_mod=None, mask_mod=None, p_fp8=False):
    """(out, lse) in fp32 for bhsd q, k, v, computed in ``dtype`` (default fp32).

    ``window``, ``softcap``, ``alibi_slopes`` ((heads,) or (batch, heads)) and ``sinks`` ((heads,)) as
    ``flashgen.variants`` defines them; autograd runs through all of it (the sinks get a gradient).
    ``score_mod`` / ``mask_mod`` (FlexAttention's functions) are called as written, on the whole score
    matrix and broadcast index tensors (batch, head, query, key), not through flashgen's tracer.
    ``p_fp8``: the FP8 kernels' mixed precision: P relative to its row's max (values in [0, 1]) rounded to
    float8 e4m3 before P V, the row sum taken from the unrounded P (no autograd through it)."""
    import torch

    dtype = dtype or torch.float32
    left, right = window_of(causal, window)
    softcap = check_softcap(softcap)
    b, h, nq = q.shape[0], q.shape[1], q.shape[2]
    group = h // k.shape[1]
    qq, kk, vv = (t.to(dtype) for t in (q, k, v))
    kk = kk.repeat_interleave(group, dim=1)
    vv = vv.repeat_interleave(group, dim=1)
    s = torch.matmul(qq, kk.transpose(-1, -2)) * scale
    nk = k.shape[2]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    offset = (torch.arange(nk, device=q.device)[None, :] - torch.arange(nq, device=q.device)[:, None]
              - (nk - nq))  # o = j - (i + nk - nq)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype).reshape(-1 if alibi_slopes.dim() == 2 else 1, h, 1, 1)
        s = s - slopes * offset.abs().to(dtype)
    hidden = None
    if score_mod is not None or mask_mod is not None:
        idx = [torch.arange(n, device=q.device).reshape([n if a == i else 1 for a in range(4)])
               for i, n in enumerate((b, h, nq, nk))]
        if score_mod is not None:
            s = score_mod(s, *idx).to(dtype)
        if mask_mod is not None:
            hidden = ~mask_mod(*idx).to(torch.bool).expand(b, h, nq, nk)
    if is_banded(left, right):
        hidden = torch.zeros(nq, nk, dtype=torch.bool, device=q.device)
        if left >= 0:
            hidden |= offset < -left
        if right >= 0:
            hidden |= offset > right
    if sinks is not None:  # one more column: the sink's logit, visible from every row
        s = torch.cat([s, sinks.to(dtype).reshape(1, h, 1, 1).expand(b, h, nq, 1)], dim=-1)
        if hidden is not None:
            hidden = torch.cat([hidden, torch.zeros(nq, 1, dtype=torch.bool, device=q.device)], dim=-1)
    if hidden is not None:
        sees = ~hidden.all(dim=-1, keepdim=True)  # rows with at least one key (or a sink)
        lse = torch.logsumexp(s.masked_fill(hidden, float("-inf")).float(), dim=-1)
        # Rows that see nothing give 0 without a NaN anywhere, so autograd can run through it too.
        p = torch.softmax(s.masked_fill(hidden & sees, float("-inf")), dim=-1) * sees.to(s.dtype)
    else:
        lse = torch.logsumexp(s.float(), dim=-1)
        p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :nk]
    if p_fp8:  # p = exp(s - lse): exp(s - m) is p exp(lse - m), m the row's max over its keys (not the sink)
        m = s[..., :nk].masked_fill(hidden[..., :nk], float("-inf")) if hidden is not None else s[..., :nk]
        m = m.float().amax(dim=-1, keepdim=True)
        live = torch.isfinite(m)
        grow = torch.where(live, torch.exp(lse[..., None] - m), torch.zeros_like(m))
        p8 = (p.float() * grow).to(torch.float8_e4m3fn).float()
        out = torch.matmul(p8, vv.float()) * torch.where(live, torch.exp(m - lse[..., None]), torch.zeros_like(m))
        return out.float(), lse
    out = torch.matmul(p.to(dtype), vv)
    return out.float(), lse


def rounding_atol(ref, dtype) -> float:
    """Twice the rounding error of ``dtype`` at the reference's values shifted by 0.3: FlashAttention-3's
    atol (``2 * (ref + 0.3 - 0.3 - ref).abs().max()``, which its tests evaluate on a reference held in the
    input dtype). About 2 ulp of the input dtype at the values' scale (0.004 in bf16 for values below
    0.2): what storing a result in that dtype may cost on its own, e.g. D = rowsum(dO * O) taken from
    the rounded output in a row that sees a few keys. Returns a float; ``ref`` is any float tensor."""
    r = ref.detach().to(dtype)
    return 2 * (r + 0.3 - 0.3 - r).abs().max().item() if r.numel() else 0.0


def allowance(low, ref, dtype) -> float:
    """The rule's allowed max error for a result against the fp32 ``ref``: 2x the max error of the same
    computation done in ``dtype`` (``low``), + ``rounding_atol``."""
    if not ref.numel():
        return 0.0
    return 2 * (low.float() - ref.float()).abs().max().item() + rounding_atol(ref, dtype)


def tolerance(q, k, v, causal, scale, **variant):
    """(fp32 reference output, allowed max error) for bhsd inputs in their own dtype; ``variant``:
    ``reference``'s window, softcap, alibi_slopes, sinks."""
    ref, _ = reference(q, k, v, causal, scale, **variant)
    low, _ = reference(q, k, v, causal, scale, q.dtype, **variant)
    return ref, allowance(low, ref, q.dtype)


def grad_tolerance(q, k, v, dout, causal, scale, **variant):
    """(fp32 reference gradients [dq, dk, dv] (and dsinks with ``sinks``), allowed max error of each) for
    bhsd inputs and the output gradient ``dout``: autograd through ``reference`` on upcast inputs (fp32
    leaves, the sinks' too), the allowance 2x the max error of the same gradients computed in the input
    dtype (the sinks as given: a bf16 parameter's gradient is bf16, rounding included), + the input dtype's
    ``rounding_atol``: the output's rule (``tolerance``), FlashAttention-3's for every gradient.
    ``variant``: ``reference``'s window, softcap, alibi_slopes, sinks."""
    import torch

    def grads(dtype):
        leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
        extra = dict(variant)
        if variant.get("sinks") is not None:
            sinks = variant["sinks"].detach()
            extra["sinks"] = (sinks.float() if dtype == torch.float32 else sinks.clone()).requires_grad_(True)
            leaves.append(extra["sinks"])
        out = reference(*leaves[:3], causal, scale, dtype, **extra)[0].to(dtype)
        out.backward(dout.to(dtype))
        return [t.grad.float() for t in leaves]

    ref, low = grads(torch.float32), grads(q.dtype)
    return ref, [allowance(lo, r, q.dtype) for lo, r in zip(low, ref)]
