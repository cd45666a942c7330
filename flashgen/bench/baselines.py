"""The torch implementations the suites time flashgen against: SDPA with one backend forced, FlexAttention.

Each maker returns a no-argument callable (what ``timing.time_ms`` takes). Imports torch when called.
"""
from __future__ import annotations

# Implementation name -> torch.nn.attention.SDPBackend member.
SDPA = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION",
        "sdpa_math": "MATH"}


def sdpa(name: str, q, k, v, causal: bool = False, enable_gqa: bool = False):
    """A callable running F.scaled_dot_product_attention(q, k, v) (bhsd) with backend ``name`` forced."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA[name])
    extra = {"enable_gqa": True} if enable_gqa else {}

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **extra)
    return run


def flex_fn():
    """torch.compile'd flex_attention (one object per process; dynamo recompiles it per shape, with its
    recompile limit raised so that every shape of a run is compiled rather than falling back to eager)."""
    import torch
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 4096))
    from torch.nn.attention.flex_attention import flex_attention

    if not hasattr(flex_fn, "fn"):
        flex_fn.fn = torch.compile(flex_attention, dynamic=False)
    return flex_fn.fn


def flex(q, k, v, causal: bool = False):
    """A callable running FlexAttention on q, k, v (bhsd; a block mask when causal)."""
    from torch.nn.attention.flex_attention import create_block_mask

    fn = flex_fn()
    nq, nk = q.shape[2], k.shape[2]
    off = nk - nq  # bottom-right aligned, as flashgen and SDPA's is_causal for nq == nk
    mask = create_block_mask(lambda b, h, i, j: i + off >= j, None, None, nq, nk, device=q.device) if causal else None
    return lambda: fn(q, k, v, block_mask=mask)
