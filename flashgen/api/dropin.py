"""``flashgen.sdpa``: ``torch.nn.functional.scaled_dot_product_attention``'s signature on flashgen's kernels.

Without a mask the call is ``flashgen.attention`` (differentiable; ``is_causal`` with as many queries as
keys is its ``causal``). SDPA's ``is_causal`` is aligned at the top left (query i sees keys j <= i),
which for fewer queries than keys is not flashgen's bottom-right ``causal``; that case, and every
``attn_mask``, run as user mods (``api.modcall``) in the Hopper forward:

- a bool mask (True: the key takes part) becomes a mask_mod that reads it and a block mask made from it,
  so blocks it hides wholly are skipped;
- a float mask is added to the scores, as a score_mod that reads it.

Both read the mask where it is (its size-1 dimensions broadcast: a mod's reads are clamped into each
dimension), with no copy. A masked call's gradients come from the mods' backward (``bwd_sm90`` on sm_90a,
the mma.sync ``bwd_dkdv`` elsewhere and at head dims 129-160; a float mask that requires grad gets its
gradient too, ``api.capturegrad``). Dropout and a value head dim that differs from the query's are refused too.
``fallback=True`` sends what flashgen refuses (``UnsupportedError``) to torch's SDPA instead; argument
mistakes raise either way.

One difference from torch: a query row that sees no key gives 0 here (FlashAttention's convention),
where torch's math backend gives NaN.
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedError
from .blockmask import block_mask_from_dense
from .entry import attention


def top_left_causal(b, h, q_idx, kv_idx):
    """SDPA's ``is_causal``: query i sees keys j <= i (aligned at the top left)."""
    return q_idx >= kv_idx


def sdpa(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None,
         enable_gqa: bool = False, *, fallback: bool = False):
    """SDPA's call, (..., L, E) queries against (..., S, E) keys and values, on flashgen's kernels.

    query (N, H, L, E) or (N, L, E); key and value (N, H_kv, S, E) or (N, S, E); H_kv divides H with
    ``enable_gqa=True``. ``attn_mask``: bool (True: attend) or a float added to the scores, broadcastable
    to (N, H, L, S). ``scale``: the softmax scale (default 1 / sqrt(E)). Returns (N, H, L, E) (or
    (N, L, E)) in query's dtype. ``fallback=True``: what flashgen does not serve (dropout, a masked call
    that needs gradients, a mask or top-left causal call on a GPU without the Hopper kernels, a value
    head dim unlike the query's) runs in ``torch.nn.functional.scaled_dot_product_attention`` instead
    of raising ``UnsupportedError``."""
    try:
        return _served(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, fallback)
    except UnsupportedError:
        if not fallback:
            raise
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)


def _served(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, fallback=False):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if not (query.dim() == key.dim() == value.dim() and query.dim() in (3, 4)):
        raise UnsupportedError(f"sdpa serves (N, H, L, E) or (N, L, E) inputs, got query {tuple(query.shape)}, key "
                               f"{tuple(key.shape)}, value {tuple(value.shape)}")
    if type(is_causal) is not bool or type(enable_gqa) is not bool:
        raise TypeError(f"is_causal and enable_gqa must be bools, got {is_causal!r}, {enable_gqa!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1], got {dropout_p!r}")
    if dropout_p > 0.0:
        raise UnsupportedError(f"dropout_p={dropout_p}: flashgen's kernels have no attention dropout")
    if value.shape[-1] != query.shape[-1]:
        raise UnsupportedError(f"value's head dim {value.shape[-1]} differs from query's {query.shape[-1]}: flashgen's "
                               "kernels take one head dim")
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal=True together: pass one of them (as torch's SDPA requires)")
    three = query.dim() == 3
    q, k, v = (t.unsqueeze(1) for t in (query, key, value)) if three else (query, key, value)
    hq, hk = q.shape[1], k.shape[1]
    if hq != hk and not enable_gqa:
        raise ValueError(f"query has {hq} heads and key {hk}: pass enable_gqa=True for grouped-query attention")
    nq, nk = q.shape[2], k.shape[2]
    if fallback and q.device.type != "cuda":  # (with the fallback on, tensors on the CPU, say, go to torch)
        raise UnsupportedError(f"flashgen runs on CUDA devices, not {q.device}")
    mods = {}
    if attn_mask is not None:
        mods = _mask_mods(attn_mask, q, nk, three)
    elif is_causal and nq != nk:
        mods = {"mask_mod": top_left_causal}
    if not mods:
        out = attention(q, k, v, causal=is_causal, softmax_scale=scale)
    else:
        out = attention(q, k, v, softmax_scale=scale, **mods)
    return out.squeeze(1) if three else out


def _mask_mods(attn_mask, q, nk: int, three: bool) -> dict:
    """The mods of an SDPA mask: a bool mask as a block mask (its mask_mod reads it), a float one as a
    score_mod adding it; the mask viewed with four dimensions, size 1 where it broadcasts."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device}, query on {q.device}")
    mask = attn_mask.unsqueeze(-3) if three and attn_mask.dim() == 3 else attn_mask
    if not 1 <= mask.dim() <= 4:
        raise ValueError(f"attn_mask must have 1 to {3 if three else 4} dims, got {tuple(attn_mask.shape)}")
    mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
    want = (q.shape[0], q.shape[1], q.shape[2], nk)
    if any(m not in (1, w) for m, w in zip(mask.shape, want)):
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (N, H, L, S) = {want}")
    if mask.dtype == torch.bool:
        if mask.shape[2:] != (want[2], want[3]):  # the block mask reads every (query, key) element
            mask = mask.expand(mask.shape[0], mask.shape[1], want[2], want[3])
        return {"block_mask": block_mask_from_dense(mask)}
    if mask.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"attn_mask must be bool or a float dtype, got {mask.dtype}")

    def add_mask(score, b, h, q_idx, kv_idx):
        return score + mask[b, h, q_idx, kv_idx]  # (size-1 dims: a mod's reads are clamped into them)
    return {"score_mod": add_mask}
