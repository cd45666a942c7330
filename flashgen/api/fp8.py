"""FP8 (float8 e4m3) inputs: the quantizing helper users and tests share, and the checks of descale factors.

An FP8 tensor ``x8`` stands for ``x8.float() * descale``: ``descale`` is fp32, one factor for the whole
tensor (shape ``()`` or ``(1,)``) or one per (batch, head) (shape ``(batch, heads)``), FlashAttention-3's
``q_descale`` / ``k_descale`` / ``v_descale``. The forward's q descale may be per query head or, as
FlashAttention-3 has it, per KV head (``(batch, heads_kv)``, shared by the query heads of a group).
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
_TINY = 2.0 ** -20  # a descale below this would make an all-zero block's scale 0 (inf after inversion)


def quantize_fp8(x: torch.Tensor, per: str = "head", layout: str = "bhsd") -> tuple[torch.Tensor, torch.Tensor]:
    """``(x8, descale)``: ``x`` (fp16, bf16 or fp32, 4-D in ``layout``, "bhsd" or "bshd") in
    ``torch.float8_e4m3fn`` scaled so that each group's largest magnitude maps to 448 (e4m3's largest
    value), and the fp32 factors that bring it back (``x ≈ x8.float() * descale``). ``per="head"``: one
    factor per (batch, head), shape (batch, heads); ``per="tensor"``: one, shape (1,). A group of zeros
    gets the factor 2^-20 (any positive value serves)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_fp8 takes a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"quantize_fp8 takes fp16, bf16 or fp32, got {x.dtype}")
    if x.dim() != 4 or layout not in ("bhsd", "bshd"):
        raise ValueError(f"quantize_fp8 takes a 4-D tensor in layout 'bhsd' or 'bshd', got {x.dim()}-D, "
                         f"layout={layout!r}")
    if per not in ("head", "tensor"):
        raise ValueError(f"per must be 'head' or 'tensor', got {per!r}")
    xf = x.float()
    if not torch.isfinite(xf).all():
        raise ValueError("quantize_fp8: x holds inf or NaN")
    if per == "tensor":
        amax = xf.abs().amax().reshape(1)
        expand = amax
    else:
        over = (2, 3) if layout == "bhsd" else (1, 3)
        amax = xf.abs().amax(dim=over)  # (batch, heads)
        expand = amax[:, :, None, None] if layout == "bhsd" else amax[:, None, :, None]
    descale = (amax / FP8_MAX).clamp_min(_TINY)
    scale = descale if per == "tensor" else (expand / FP8_MAX).clamp_min(_TINY)
    x8 = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x8, descale.contiguous()


def dequantize_fp8(x8: torch.Tensor, descale: torch.Tensor, layout: str = "bhsd", heads: int | None = None):
    """``x8`` as fp32 values (``x8.float() * descale``), ``descale`` of shape (), (1,) or (batch, h) with h
    ``x8``'s heads or a divisor of them (one factor per group of ``heads // h`` consecutive heads, the
    forward's q descale per KV head)."""
    xf = x8.float()
    if descale.numel() == 1:
        return xf * descale.reshape(()).float()
    b, h = descale.shape
    hx = x8.shape[1] if layout == "bhsd" else x8.shape[2]
    per = descale.float().repeat_interleave(hx // h, dim=1)
    return xf * (per[:, :, None, None] if layout == "bhsd" else per[:, None, :, None])


def descale_shapes(batch: int, heads: tuple) -> tuple:
    """The shapes a descale may have for a tensor of ``batch`` and any of ``heads``: one factor, or one
    per (batch, head)."""
    return ((), (1,), *((batch, h) for h in dict.fromkeys(heads)))


def check_descale_values(named) -> None:
    """Every (name, tensor) of ``named`` holds finite, positive values (one device sync for all)."""
    tensors = [t for _, t in named]
    if not tensors:
        return
    ok = torch.stack([(torch.isfinite(t) & (t > 0)).all() for t in tensors]).cpu()
    for (name, _), good in zip(named, ok.tolist()):
        if not good:
            raise ValueError(f"{name} must hold finite, positive descale factors")


def descale_strides(t, batch_heads: int) -> tuple[int, int, int]:
    """(batch stride, head stride, heads per factor) of a checked descale tensor, as the kernels index it:
    factor (b, h) at ``b * sb + (h // div) * sh``; one factor: all 0 (div 1). ``batch_heads``: the heads
    the kernel indexes it by (the query heads for q, the KV heads for k and v)."""
    if t.numel() == 1 and t.dim() < 2:
        return 0, 0, 1
    sb, sh = t.stride()
    return sb, sh, batch_heads // t.shape[1]
