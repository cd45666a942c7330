"""``flashgen.attention``: the forward, or ``api.autograd`` when a gradient is needed.

The forward itself is ``api.forward``; the differentiable path is ``api.autograd``'s: the
``flashgen::attn_fwd`` custom op while torch.compile traces, its forward and formula through a plain
autograd.Function in eager calls.
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedError
from .autograd import attention_op
from .checks import check_attention_call, check_flag, on_meta
from .device import is_compiling
from .fp8 import FP8
from .forward import ALGORITHMS, forward, forward_fp8
from .modcall import mod_attention, mod_forward, mod_meta


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, layout: str = "bhsd",
              return_lse: bool = False, spec=None, algorithm: str = "v2", deterministic: bool = False, *,
              window=None, softcap: float = 0.0, alibi_slopes=None, sinks=None, score_mod=None, mask_mod=None,
              block_mask=None, q_descale=None, k_descale=None, v_descale=None, out_dtype=None, check_values=True):
    """Scaled dot-product attention, softmax(scale * q k^T) v, by a generated kernel.

    q: (batch, heads, seqlen_q, d) for ``layout="bhsd"`` (torch's order) or
    (batch, seqlen_q, heads, d) for ``"bshd"``; k, v likewise with heads_kv
    dividing heads (GQA/MQA, no copies). fp16 or bf16 on one CUDA device; any
    strides with a contiguous last dimension (16-byte aligned). ``d`` any
    multiple of 8 up to 256. ``causal`` masks bottom-right aligned: query i sees
    keys j <= i + seqlen_k - seqlen_q; a row that sees no key gives 0 (LSE -inf).

    Variants (``flashgen.variants`` defines them; they combine freely). Query i and key j are
    ``o = j - (i + seqlen_k - seqlen_q)`` apart:

    - ``window=(left, right)``: key j is visible iff ``-left <= o <= right`` (FlashAttention's
      ``window_size``); -1 leaves a side unbounded; with ``causal`` the right side is 0. Key blocks
      outside the window are skipped: the cost follows the band.
    - ``softcap=c > 0``: the scaled score s becomes ``c * tanh(s / c)`` (Gemma 2); 0 is off.
    - ``alibi_slopes``: fp32 ``(heads,)`` or ``(batch, heads)``; ``-slope * |o|`` joins each score
      (after the softcap).
    - ``sinks``: ``(heads,)``, fp32 or q's dtype: one learned logit per head that joins every row's
      softmax denominator and brings no value (gpt-oss); the LSE includes it.

    User mods (FlexAttention's signatures; ``flashgen.mods`` traces them, docs in the README):

    - ``score_mod(score, b, h, q_idx, kv_idx) -> score``: changes each scaled score (h is the query head);
    - ``mask_mod(b, h, q_idx, kv_idx) -> bool``: True where query q_idx sees key kv_idx (indices from 0,
      no bottom-right alignment);
    - ``block_mask``: ``flashgen.create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN)``, made once and reused
      across calls and layers (without it a mask_mod call makes one and keeps the newest few).
    They may read captured CUDA tensors by index. They take none of causal, window, softcap, alibi_slopes
    or sinks (write those as mods). The forward runs on fwd_sm90 (sm_90a) or fwd_v2 (sm_80 and later), and
    so do gradients (q, k, v, and captured tensors that require grad): bwd_sm90 on sm_90a, the mma.sync
    bwd_dkdv elsewhere and at head dims 129-160.

    FP8 (sm_90a): q, k and v in ``torch.float8_e4m3fn`` stand for ``x8 * descale`` with fp32
    ``q_descale``, ``k_descale``, ``v_descale`` (all three required): one factor (shape () or (1,)) or one
    per (batch, head), (batch, heads_kv) for k and v, (batch, heads) or (batch, heads_kv) for q
    (FlashAttention-3's). ``flashgen.quantize_fp8`` makes both from bf16 tensors. The output is
    ``out_dtype`` (bf16 by default, or fp16); P is rounded to e4m3 for the P V product (the row sums are
    fp32). d a multiple of 16; causal, the window, softcap, ALiBi and sinks as above; forward only (no
    gradient), no mods. The descales' values must be finite and positive: ``check_values=True`` (the
    default) checks them on the host (one device sync per call; skipped while a CUDA graph is captured);
    pass False in a hot loop whose descales you trust. It is FP8's only (16-bit calls read no values).

    ``spec`` forces one KernelSpec instead of dispatch's pick (for the tuner
    and for study); it must match the problem (a forward family the GPU runs:
    ``fwd_v2``, or ``fwd_sm90`` on sm_90a; dtype, causal, arch, and a head-dim
    tile that covers d). Dispatch's pick, too, may be of either family (a tuned
    table's entry for the "fwd" key); the spec's family decides the launch.

    ``algorithm`` picks the kernel family: ``"v2"`` (FlashAttention-2, the
    default and the fast one), ``"v1"`` (FlashAttention V1's loop order: K/V
    blocks outside, O/m/l through HBM) or ``"standard"`` (three passes with S
    and P in HBM; ``UnsupportedError`` when that N x N buffer does not fit in
    free GPU memory). The last two are for study and comparison; with them,
    ``spec`` is a ``fwd_v1`` spec, or a tuple of the three ``standard_*`` specs.

    Returns the output in q's layout and dtype, and with ``return_lse`` also the
    log-sum-exp of the scaled scores, fp32 (batch, heads, seqlen_q).
    Raises TypeError/ValueError on bad inputs and UnsupportedError for requests
    outside what the kernels serve, always before launching anything. On meta
    tensors (``device="meta"``) the call checks its arguments and returns
    outputs of the right shapes and dtypes, launching nothing.

    Differentiable: when q, k or v requires grad (or under torch.compile) the
    call goes through ``flashgen.api.autograd`` (the ``flashgen::attn_fwd`` custom op
    under torch.compile), whose backward runs flashgen's backward kernels. ``deterministic=True``
    (or ``torch.use_deterministic_algorithms(True)`` when the backward runs) makes dQ
    independent of the order of its adds (on sm_90a the Hopper kernel adds in a fixed
    order, elsewhere, and with mods everywhere, a separate query-outer dQ kernel computes it;
    somewhat slower); dK and dV are deterministic either way.
    """
    check_flag("deterministic", deterministic)
    check_flag("check_values", check_values)
    if (q_descale is not None or k_descale is not None or v_descale is not None or out_dtype is not None
            or any(getattr(t, "dtype", None) == FP8 for t in (q, k, v))):
        return _fp8(q, k, v, causal, softmax_scale, layout, return_lse, spec, algorithm, deterministic, window,
                    softcap, alibi_slopes, sinks, score_mod, mask_mod, block_mask, q_descale, k_descale, v_descale,
                    out_dtype, check_values)
    if score_mod is not None or mask_mod is not None or block_mask is not None:
        return _with_mods(q, k, v, causal, softmax_scale, layout, return_lse, spec, algorithm, deterministic, window,
                          softcap, alibi_slopes, sinks, score_mod, mask_mod, block_mask)
    if on_meta(q) and not is_compiling():  # shapes only: the custom op's fake kernel, after the same argument checks
        check_attention_call(q, k, v, causal, softmax_scale, layout, return_lse, window, softcap, alibi_slopes, sinks)
        if algorithm != "v2":
            raise UnsupportedError(f"algorithm={algorithm!r} has no meta (shape-only) path: use algorithm='v2'")
        return attention_op(q, k, v, causal, softmax_scale, layout, return_lse, deterministic, spec, window, softcap,
                            alibi_slopes, sinks)
    if is_compiling() or (torch.is_grad_enabled() and (getattr(q, "requires_grad", False) or
                                                        getattr(k, "requires_grad", False) or
                                                        getattr(v, "requires_grad", False) or
                                                        getattr(sinks, "requires_grad", False))):
        if algorithm != "v2":
            if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
                raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
            raise UnsupportedError(f"algorithm={algorithm!r} is forward-only (for study); gradients need "
                                   "algorithm='v2'")
        return attention_op(q, k, v, causal, softmax_scale, layout, return_lse, deterministic, spec, window, softcap,
                            alibi_slopes, sinks)
    return forward(q, k, v, causal, softmax_scale, layout, return_lse, spec, algorithm, window, softcap,
                   alibi_slopes, sinks)


def _fp8(q, k, v, causal, softmax_scale, layout, return_lse, spec, algorithm, deterministic, window, softcap,
         alibi_slopes, sinks, score_mod, mask_mod, block_mask, q_descale, k_descale, v_descale, out_dtype,
         check_values):
    """The FP8 forward (api.forward.forward_fp8), after refusing what it does not serve."""
    others = [name for name, on in (("score_mod", score_mod is not None), ("mask_mod", mask_mod is not None),
                                    ("block_mask", block_mask is not None), ("deterministic", deterministic),
                                    ("algorithm", algorithm != "v2")) if on]
    if others:
        raise UnsupportedError(f"FP8 attention takes none of {', '.join(others)}")
    if out_dtype is None:
        out_dtype = torch.bfloat16
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v, sinks)):
        raise UnsupportedError("FP8 attention is forward-only: no input may require grad (call it under "
                               "torch.no_grad(), or use bf16/fp16 inputs for training)")
    if on_meta(q):  # shapes only
        check_attention_call(q, k, v, causal, softmax_scale, layout, return_lse, window, softcap, alibi_slopes, sinks,
                             (q_descale, k_descale, v_descale, out_dtype))
        out = torch.empty(q.shape, dtype=out_dtype, device="meta")
        if not return_lse:
            return out
        b, h, n = (q.shape[0], q.shape[1], q.shape[2]) if layout == "bhsd" else (q.shape[0], q.shape[2], q.shape[1])
        return out, torch.empty((b, h, n), dtype=torch.float32, device="meta")
    return forward_fp8(q, k, v, causal, softmax_scale, layout, return_lse, spec, window, softcap, alibi_slopes, sinks,
                       q_descale, k_descale, v_descale, out_dtype, check_values)


def _with_mods(q, k, v, causal, softmax_scale, layout, return_lse, spec, algorithm, deterministic, window, softcap,
               alibi_slopes, sinks, score_mod, mask_mod, block_mask):
    """The forward with user mods (api.modcall), after refusing what it does not combine with."""
    others = [name for name, on in (("causal", causal is not False), ("window", window is not None),
                                    ("softcap", softcap != 0.0), ("alibi_slopes", alibi_slopes is not None),
                                    ("sinks", sinks is not None), ("algorithm", algorithm != "v2")) if on]
    if others:
        raise UnsupportedError(f"score_mod / mask_mod / block_mask take none of {', '.join(others)}: express "
                               "them as mods (a causal or window mask_mod, a softcap or ALiBi score_mod)")
    if is_compiling():
        raise UnsupportedError("score_mod / mask_mod do not run under torch.compile (the mods are traced by "
                               "flashgen, not by dynamo): call flashgen.attention outside the compiled region")
    if on_meta(q):  # shapes only
        return mod_meta(q, k, v, softmax_scale, layout, return_lse, score_mod, mask_mod, block_mask)
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v)):
        return mod_attention(q, k, v, softmax_scale, layout, return_lse, spec, score_mod, mask_mod, block_mask,
                             deterministic)
    return mod_forward(q, k, v, softmax_scale, layout, return_lse, spec, score_mod, mask_mod, block_mask)
