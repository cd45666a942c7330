"""GPU tier for the FP8 forward (fwd_sm90 with e4m3 q, k, v and descales; sm_90a).

The reference is the fp32 attention of the dequantized inputs (``x8 * descale``); the rule: the kernel's
max error at most 2x that of the same reference with P rounded to e4m3 before P V (``reference``'s
``p_fp8``, the kernel's mixed precision) and stored in the output dtype, + the output dtype's rounding
atol. The LSE (fp32 row sums of the unrounded P) within its row's allowance (``_lse_allowance``: the e4m3
accumulation's error bound, at least 1e-3 of the row's LSE). Fresh inputs every call,
the output poisoned first, odd sizes, GQA, both layouts, per-tensor and per-head descales (q's per query
head and per KV head), dispatch's tile and every FP8 tile of the family forced, the variants.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from gpu_util import capture, is_sm90, poison_output, to_bhsd, variant_inputs  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not is_sm90(), reason="the FP8 forward needs an sm_90 GPU (H100/H200)"),
]

import flashgen  # noqa: E402
from flashgen import gpus  # noqa: E402
from flashgen.api.fp8 import dequantize_fp8  # noqa: E402
from flashgen.families import fwd_sm90  # noqa: E402
from flashgen.reference import allowance, reference  # noqa: E402

SEQLENS = [(1, 1), (113, 203), (128, 217), (1, 239), (239, 1), (799, 3), (256, 512), (512, 256),
           (1023, 1024), (2048, 2048)]
# Forced tiles: every FP8 technique the family takes, over the rule's tile shapes and 192-key blocks (V^T in
# a 128-key and a 64-key panel).
TILES = ["ws", "ws_n64", "ws_s3", "ws_ov_s3", "ws_pp", "ws_pp_s3", "ws_pp_ov_s3", "ws_kr_s3", "ws_pp_fx1_kr_s3",
         "ws_m64", "ws_n192", "ws_pp_n192", "ws_pp_s3_n192"]


def _quantized(b, hq, hk, nq, nk, d, layout, per, q_per_kv=False, magnitude=1.0):
    """Fresh random q, k, v quantized to e4m3: ((q8, k8, v8), (qd, kd, vd)); ``per`` "head" or "tensor";
    ``q_per_kv``: q's descale per KV head (FlashAttention-3's shape), its largest group's amax."""
    def rnd(h, n):
        shape = (b, h, n, d) if layout == "bhsd" else (b, n, h, d)
        return torch.randn(shape, device="cuda") * magnitude * (1 + 3 * torch.rand((), device="cuda"))

    out, ds = [], []
    for h, n in ((hq, nq), (hk, nk), (hk, nk)):
        x8, dsc = flashgen.quantize_fp8(rnd(h, n), per=per, layout=layout)
        out.append(x8)
        ds.append(dsc)
    if q_per_kv and per == "head":  # one factor per KV head: requantize q under its group's largest factor
        g = hq // hk
        qd = ds[0].reshape(b, hk, g).amax(dim=2)
        qf = dequantize_fp8(out[0], ds[0], layout)
        per_q = qd.repeat_interleave(g, dim=1)
        per_q = per_q[:, :, None, None] if layout == "bhsd" else per_q[:, None, :, None]
        out[0] = (qf / per_q).clamp(-448, 448).to(torch.float8_e4m3fn)
        ds[0] = qd.contiguous()
    return out, ds


def check_fp8(b, hq, hk, nq, nk, d, causal, layout="bhsd", per="head", q_per_kv=False, spec=None, variant=None,
              out_dtype=torch.bfloat16):
    (q8, k8, v8), (qd, kd, vd) = _quantized(b, hq, hk, nq, nk, d, layout, per, q_per_kv)
    scale = 1.0 / math.sqrt(d)
    extra = variant_inputs(b, hq, **(variant or {}))
    poison_output(torch.empty(q8.shape, device="cuda", dtype=out_dtype))
    out, lse = flashgen.attention(q8, k8, v8, causal=causal, layout=layout, return_lse=True, spec=spec,
                                  q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=out_dtype, **extra)
    torch.cuda.synchronize()
    assert out.shape == q8.shape and out.dtype == out_dtype
    qf, kf, vf = (to_bhsd(dequantize_fp8(x, dsc, layout), layout) for x, dsc in ((q8, qd), (k8, kd), (v8, vd)))
    ref, ref_lse = reference(qf, kf, vf, causal, scale, **extra)
    emu, _ = reference(qf, kf, vf, causal, scale, p_fp8=True, **extra)
    got = to_bhsd(out, layout).float()
    assert torch.isfinite(got).all(), "non-finite output (unwritten or NaN)"
    err = (got - ref).abs().max().item()
    tol = allowance(emu.to(out_dtype), ref, out_dtype)
    assert err <= tol, f"max err {err:.3e} > tol {tol:.3e} (the P-in-e4m3 emulation's {tol / 2:.3e} x 2 + atol)"
    masked = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), masked)
    if (~masked).any():
        lse_err = (lse - ref_lse).abs()[~masked]
        lse_tol = _lse_allowance(qf, kf, scale, ref_lse)[~masked]
        worst = (lse_err - lse_tol).argmax()
        assert (lse_err <= lse_tol).all(), f"lse err {lse_err[worst]:.3e} > tol {lse_tol[worst]:.3e} (its row)"
    return out


# The e4m3 tensor-core product keeps about 14 bits when it adds into its accumulator (DeepSeek-V3's report,
# section 3.3.2), once per wgmma's 32 columns of d: a score's error is bounded by ceil(d / 32) such units of
# sum_i |q_i k_i|, not by the score, and a row's LSE (a smooth max of its scores, d LSE / d s_j = p_j) is
# off by at most its largest score's error.
FP8_ACC_UNIT = 2.0 ** -14


def _lse_allowance(qf, kf, scale, ref_lse):
    """Per row (b, h, nq): twice that bound, scale * ceil(d / 32) units * max_j sum_i |q_i k_ji| over the row's
    keys, or 1e-3 of the row's |LSE| (at least 1e-3), whichever is larger."""
    group, steps = qf.shape[1] // kf.shape[1], -(-qf.shape[-1] // 32)
    mags = torch.matmul(qf.abs(), kf.abs().repeat_interleave(group, dim=1).transpose(-1, -2))
    acc = 2 * steps * FP8_ACC_UNIT * scale * mags.amax(dim=-1)
    return torch.maximum(acc, 1e-3 * ref_lse.abs().clamp(min=1.0))


@pytest.mark.parametrize("nq,nk", SEQLENS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_dispatch(nq, nk, d, causal):
    check_fp8(2, 4, 2, nq, nk, d, causal)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("per,q_per_kv", [("tensor", False), ("head", False), ("head", True)])
@pytest.mark.parametrize("d", [80, 128])
def test_fp8_layouts_and_descales(layout, per, q_per_kv, d):
    check_fp8(3, 8, 2, 333, 517, d, True, layout=layout, per=per, q_per_kv=q_per_kv)


def test_fp8_fp16_output():
    check_fp8(2, 4, 4, 300, 300, 128, False, out_dtype=torch.float16)


# Every tile of TILES the family's check takes at each head dim (192-key blocks at d = 256 need more
# shared memory and registers than a block has: test_fp8.py checks that they are refused).
TILE_CASES = [(tokens, d) for d in (64, 128, 256) for tokens in TILES
              if not fwd_sm90.variant(d, False, tokens, fp8=True).check(gpus.get("h200"))]


@pytest.mark.parametrize("tokens,d", TILE_CASES, ids=[f"d{d}-{t}" for t, d in TILE_CASES])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_tiles(tokens, d, causal):
    spec = fwd_sm90.variant(d, causal, tokens, fp8=True)
    assert spec.check(gpus.get("h200")) == []
    check_fp8(2, 4, 2, 1023, 1100, d, causal, spec=spec)


@pytest.mark.parametrize("variant", [{"window": (256, 0)}, {"window": (100, 37)}, {"softcap": 15.0},
                                     {"alibi": "head"}, {"alibi": "batch"}, {"sinks": True},
                                     {"window": (100, 37), "softcap": 15.0, "alibi": "batch", "sinks": True}])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_variants(variant, causal):
    check_fp8(2, 4, 2, 700, 901, 128, causal, variant=variant)


def test_fp8_matches_bf16_forward():
    """The FP8 call on quantized inputs and the bf16 call on the same (dequantized) values agree to FP8's
    precision: the descales reach the scores and the output."""
    (q8, k8, v8), (qd, kd, vd) = _quantized(2, 8, 2, 1000, 1000, 128, "bhsd", "head")
    qb, kb, vb = (dequantize_fp8(x, dsc).to(torch.bfloat16) for x, dsc in ((q8, qd), (k8, kd), (v8, vd)))
    o8 = flashgen.attention(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd).float()
    ob = flashgen.attention(qb, kb, vb, causal=True).float()
    rel = (o8 - ob).norm() / ob.norm()
    assert rel < 0.05, f"relative difference {rel:.3e}"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_fp8_refuses_bad_descale_values(bad):
    """A non-finite or non-positive descale is refused before the launch (check_values, the default)."""
    (q8, k8, v8), (qd, kd, vd) = _quantized(1, 2, 2, 64, 64, 64, "bhsd", "head")
    kd = kd.clone()
    kd[0, 1] = bad
    with pytest.raises(ValueError, match="k_descale must hold finite, positive"):
        flashgen.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)


def test_fp8_cuda_graph_replay():
    """An FP8 call captured in a CUDA graph (no host check inside the capture) replays to the eager result,
    with new values in the captured inputs and descales."""
    (q8, k8, v8), (qd, kd, vd) = _quantized(2, 4, 2, 500, 700, 128, "bhsd", "head")
    kw = dict(causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    flashgen.attention(q8, k8, v8, **kw)  # compile, load and plan outside the capture
    torch.cuda.synchronize()
    g, static_out = capture(lambda: flashgen.attention(q8, k8, v8, **kw))
    (q2, k2, v2), (qd2, kd2, vd2) = _quantized(2, 4, 2, 500, 700, 128, "bhsd", "head")
    for dst, src in ((q8, q2), (k8, k2), (v8, v2), (qd, qd2), (kd, kd2), (vd, vd2)):
        dst.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    eager = flashgen.attention(q8, k8, v8, **kw)
    assert torch.equal(static_out, eager)
