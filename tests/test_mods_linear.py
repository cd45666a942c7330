"""The linear form of score_mods (flashgen/mods/linear.py), no GPU: which mods have it, and that where the
mask shows a key the form's parts give the mod's value (x + a(b, h) kv + r(b, h, q), with a and r read from
the form's graph as the kernel reads them); the forward's source and launch units that follow from it."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from flashgen import mods  # noqa: E402
from flashgen.mods.linear import linear_form  # noqa: E402
from flashgen.variants import Variant  # noqa: E402

H, NQ, NK = 4, 45, 70
SLOPES = torch.rand(H) + 0.05
TABLE = torch.randn(H, 3)
OFF = torch.tensor([NK - NQ], dtype=torch.int32)
OTHER = torch.tensor([NK - NQ], dtype=torch.int32)
REL = torch.randn(H, NQ + NK)
DOC = torch.repeat_interleave(torch.arange(10, dtype=torch.int32), 8)[:NK]


def alibi_abs(score, b, h, q, kv):
    return score - SLOPES[h] * (q - kv).abs()


def alibi_abs_swapped(score, b, h, q, kv):
    return score - SLOPES[h] * torch.abs(kv - q)


def alibi_flex(score, b, h, q, kv):  # FlexAttention's spelling: no |.|, so no mask is needed
    return score + (kv - q) * SLOPES[h]


def alibi_offset(score, b, h, q, kv):
    return score - SLOPES[h] * (q + OFF[0] - kv).abs()


def alibi_other_offset(score, b, h, q, kv):  # another tensor than the mask's bound: |.| stays
    return score - SLOPES[h] * (q + OTHER[0] - kv).abs()


def scaled_bias(score, b, h, q, kv):  # folded factors, a division, int arithmetic, a row-only function
    return 2.0 * (score * 0.5 + (3 * kv - 2 * q).float() / 4.0 * TABLE[h, b] + torch.tanh(q.float() * 0.1))


def head_bias(score, b, h, q, kv):
    return score + TABLE[h, 1]


def softcap(score, b, h, q, kv):
    return 30.0 * torch.tanh(score / 30.0)


def relative(score, b, h, q, kv):
    return score + REL[h, q - kv + NK]


def quadratic(score, b, h, q, kv):
    return score - SLOPES[h] * (q - kv) * (q - kv)


def head_scaled(score, b, h, q, kv):  # the score's coefficient moves with the head
    return score * SLOPES[h] + kv


def clamped(score, b, h, q, kv):
    return score - SLOPES[h] * (q - kv).clamp(min=0)


def causal(b, h, q, kv):
    return q >= kv


def strictly_causal(b, h, q, kv):
    return q > kv


def causal_offset(b, h, q, kv):
    return q + OFF[0] >= kv


def causal_document(b, h, q, kv):
    return (DOC[q % NK] == DOC[kv]) & (q >= kv)


def window(b, h, q, kv):
    return (q - kv <= 8) & (q >= kv)


def either(b, h, q, kv):  # an |: the order is not implied
    return (q >= kv) | (kv < 3)


def reversed_order(b, h, q, kv):
    return kv >= q


def pair_of(score, mask):
    return mods.pair(mods.trace_score_mod(score, allow_cpu=True),
                     mods.trace_mask_mod(mask, allow_cpu=True) if mask else None)


LINEAR = [(alibi_abs, causal), (alibi_abs, strictly_causal), (alibi_abs, causal_document), (alibi_abs, window),
          (alibi_abs_swapped, causal), (alibi_flex, None), (alibi_flex, either), (alibi_offset, causal_offset),
          (scaled_bias, None), (head_bias, None)]
NOT_LINEAR = [(alibi_abs, None), (alibi_abs, either), (alibi_abs, reversed_order), (alibi_offset, causal),
              (alibi_other_offset, causal_offset), (softcap, causal), (relative, causal), (quadratic, causal),
              (head_scaled, None), (clamped, causal)]


@pytest.mark.parametrize("score,mask", LINEAR, ids=lambda f: getattr(f, "__name__", "none"))
def test_linear_mods_match_where_the_mask_shows_the_key(score, mask):
    """For every (b, h, q, kv) the mask shows, x + a kv + r(q) from the form's graphs as fwd_sm90 evaluates
    them (a from kv_coef; r(q) as beta q + f(0, b, h, 0, 0) with beta from q_coef, or f(0, b, h, q, 0)) equals
    c f(k x) of the mod's own graph, k and c its folded factors."""
    pair = pair_of(score, mask)
    form = pair.linear
    assert form is not None
    k, c = pair.factors
    b = torch.arange(2).view(2, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = torch.arange(NQ).view(1, 1, NQ, 1)
    kv = torch.arange(NK).view(1, 1, 1, NK)
    x = torch.randn(2, H, NQ, NK) * 4
    want = pair.score.evaluate(x, b, h, q, kv)
    a = form.kv_coef.evaluate(0.0, b, h, 0, 0)
    if form.q_coef is not None:
        r = form.q_coef.evaluate(0.0, b, h, 0, 0) * q + form.f.evaluate(0.0, b, h, 0, 0)
    else:
        r = form.f.evaluate(0.0, b, h, q, 0)
    got = c * (k * x + a * kv + r)
    seen = pair.mask.evaluate(None, b, h, q, kv).expand_as(x) if pair.mask else torch.ones_like(x, dtype=torch.bool)
    assert seen.any()
    torch.testing.assert_close(got[seen], want[seen], rtol=1e-5, atol=1e-4)
    assert (form.q_coef is None) == (score is scaled_bias)  # only its r (a tanh of q) is not linear in q


@pytest.mark.parametrize("score,mask", NOT_LINEAR, ids=lambda f: getattr(f, "__name__", "none"))
def test_other_mods_keep_the_per_score_function(score, mask):
    assert pair_of(score, mask).linear is None


def test_no_score_mod_has_no_form():
    assert linear_form(None, mods.trace_mask_mod(causal)) is None
    assert mods.pair(None, mods.trace_mask_mod(causal)).linear is None


def test_the_printed_form_reads_abs_as_the_difference():
    pair = pair_of(alibi_abs, causal)
    text = pair.cuda(linear=True)
    lin = text.split("fg_score_mod_lin")[1].split("fg_mask_mod")[0]
    assert " < 0 ?" in text.split("fg_score_mod_lin")[0]  # the mod's own |.|
    assert " < 0 ?" not in lin and "__fsub_rn" in lin
    with pytest.raises(mods.ModError, match="not a bias linear in kv_idx"):
        pair_of(softcap, causal).cuda(linear=True)


def test_linear_launch_units():
    """A linear mod's scores stay raw q.k: the softmax's exp2 factor and the LSE's scale take the softmax
    scale (times c), as a plain kernel's; a per-score mod runs them in natural units."""
    scale, c = 0.125, 2.0
    per_score = Variant(scored=True, score_factor=c).values(64, 64, scale)
    linear = Variant(scored=True, score_factor=c, linear=True).values(64, 64, scale)
    assert per_score["cap_in"] == linear["cap_in"] == scale
    assert per_score["scale_log2"] == pytest.approx(c * math.log2(math.e)) and per_score["scale"] == c
    assert linear["scale_log2"] == pytest.approx(c * scale * math.log2(math.e)) and linear["scale"] == c * scale


def test_forward_source_and_family():
    """fwd_sm90 renders a linear mod with the LINEAR variant and fg_score_mod_lin; fwd_v2 and the backward
    keep the per-score function; a softcap mod is not linear anywhere."""
    from flashgen import dispatch, families
    from flashgen.codegen import render
    from flashgen.families import fwd_sm90
    from flashgen.problem import ProblemKey
    from flashgen.spec import KernelSpec

    pair = pair_of(alibi_abs, causal)
    mods.register(pair)
    tok = mods.token_number(pair)
    spec = fwd_sm90.variant(128, False, "ws_ov_s3").replace(mod=tok).validate()
    assert families.family("fwd_sm90").linear_mod(spec)
    src = render(spec)
    assert "fg_mod_variant<true, true, false, true, true>" in src and "FG_DEVICE float fg_score_mod_lin(" in src
    assert "FG_DEVICE float fg_score_mod_kv(" in src and "FG_DEVICE float fg_score_mod_q(" in src
    v2_spec = KernelSpec(kind="fwd_v2", head_dim=128, block_m=128, block_n=32, warps=4, mod=tok).validate()
    assert not families.family("fwd_v2").linear_mod(v2_spec)
    assert "fg_mod_variant<true, true>" in render(v2_spec) and "FG_DEVICE float fg_score_mod_lin(" not in render(v2_spec)
    key = ProblemKey("bwd_dkdv", "sm_90a", "bf16", 128, False, 4096, "")
    bwd_spec = dispatch.mod_backward_spec(key, 232448, tok)
    assert bwd_spec.kind == "bwd_sm90" and "FG_DEVICE float fg_score_mod_lin(" not in render(bwd_spec)
    cap = pair_of(softcap, causal)
    mods.register(cap)
    cap_spec = spec.replace(mod=mods.token_number(cap))
    assert not families.family("fwd_sm90").linear_mod(cap_spec)
    assert "fg_mod_variant<true, true>" in render(cap_spec)
