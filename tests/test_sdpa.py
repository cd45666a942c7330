"""``flashgen.sdpa`` without a GPU: its refusals and argument errors (before any launch), the explicit
fallback to torch's SDPA, and the mods it makes of SDPA's masks, checked against torch's SDPA through
the fp32 reference (the functions as written) and through the traced graphs' evaluator (the kernel's
semantics: clamped reads broadcast a mask's size-1 dimensions)."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen import mods  # noqa: E402
from flashgen.api.dropin import _mask_mods, top_left_causal  # noqa: E402
from flashgen.reference import reference  # noqa: E402

F = torch.nn.functional


def qkv(n=2, h=4, hk=4, nq=37, nk=53, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(nq * 100 + nk)
    return (torch.randn(n, h, nq, d, generator=g, dtype=dtype), torch.randn(n, hk, nk, d, generator=g, dtype=dtype),
            torch.randn(n, hk, nk, d, generator=g, dtype=dtype))


@pytest.mark.parametrize("kwargs,error,match", [
    ({"dropout_p": 0.1}, flashgen.UnsupportedError, "dropout"),
    ({"dropout_p": 1.5}, ValueError, "dropout_p"),
    ({"is_causal": 1}, TypeError, "is_causal"),
    ({"attn_mask": torch.ones(37, 53, dtype=torch.bool), "is_causal": True}, ValueError, "attn_mask and is_causal"),
])
def test_argument_errors_and_refusals(kwargs, error, match):
    q, k, v = qkv()
    with pytest.raises(error, match=match):
        flashgen.sdpa(q, k, v, **kwargs)


def test_shapes_refused_or_wrong():
    q, k, v = qkv(hk=2)
    with pytest.raises(ValueError, match="enable_gqa"):
        flashgen.sdpa(q, k, v)
    q, k, v = qkv()
    with pytest.raises(flashgen.UnsupportedError, match="head dim"):
        flashgen.sdpa(q, k, v[..., :8])
    with pytest.raises(flashgen.UnsupportedError, match=r"\(N, H, L, E\)"):
        flashgen.sdpa(q[None], k[None], v[None])
    with pytest.raises(ValueError, match="does not broadcast"):
        _mask_mods(torch.ones(3, 53, dtype=torch.bool), q, 53, False)
    with pytest.raises(TypeError, match="bool or a float"):
        _mask_mods(torch.ones(37, 53, dtype=torch.int32), q, 53, False)


def test_fallback_is_explicit_and_takes_torch():
    """Refusals go to torch only when asked; argument mistakes raise either way."""
    q, k, v = qkv()
    with pytest.raises(flashgen.UnsupportedError):
        flashgen.sdpa(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    got = flashgen.sdpa(q, k, v, dropout_p=0.5, fallback=True)
    torch.manual_seed(0)
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, dropout_p=0.5))
    mask = torch.rand(37, 53) < 0.7
    assert torch.equal(flashgen.sdpa(q, k, v, attn_mask=mask, fallback=True),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=mask))  # CPU tensors: torch
    with pytest.raises(ValueError, match="enable_gqa"):
        flashgen.sdpa(*qkv(hk=2), fallback=True)


def _torch_ref(q, k, v, **kw):
    kw = {n: (m.double() if isinstance(m, torch.Tensor) and m.is_floating_point() else m) for n, m in kw.items()}
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw).float()  # (a float mask of
    # another dtype than the inputs gives torch's CPU kernel wrong values: the mask goes in as double too)


@pytest.mark.parametrize("shape", [(2, 4, 37, 53), (37, 53)])
def test_mask_mods_match_torch_sdpa(shape):
    """A full-size mask: the mods' reference (the functions called as written) equals torch's SDPA, for a
    bool mask (rows keeping a key) and a float one; top-left causal likewise."""
    q, k, v = qkv()
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(*shape, generator=g) < 0.6
    keep[..., 0] = True  # every row sees a key (torch gives NaN where none)
    scale = 1 / math.sqrt(q.shape[-1])
    made = _mask_mods(keep, q, 53, False)
    mask_mod = made["block_mask"].mask_mod
    full = keep.expand(2, 4, 37, 53)
    out, _ = reference(q, k, v, False, scale, mask_mod=lambda b, h, i, j: full[b, h, i, j])
    torch.testing.assert_close(out, _torch_ref(q, k, v, attn_mask=keep), rtol=1e-4, atol=1e-5)
    graph = mods.trace_mask_mod(mask_mod, allow_cpu=True)
    idx = [torch.arange(n).reshape([n if a == i else 1 for a in range(4)]) for i, n in enumerate((2, 4, 37, 53))]
    assert torch.equal(graph.evaluate(None, *idx), full)  # the kernel's reads, clamped: the same mask
    bias = torch.randn(*shape, generator=g)
    add = _mask_mods(bias, q, 53, False)["score_mod"]
    big = bias.expand(2, 4, 37, 53)
    out, _ = reference(q, k, v, False, scale, score_mod=lambda s, b, h, i, j: s + big[b, h, i, j])
    torch.testing.assert_close(out, _torch_ref(q, k, v, attn_mask=bias), rtol=1e-4, atol=1e-5)
    s = torch.randn(2, 4, 37, 53, generator=g)
    assert torch.allclose(mods.trace_score_mod(add, allow_cpu=True).evaluate(s, *idx), s + big)
    out, _ = reference(q, k, v, False, scale, mask_mod=top_left_causal)
    torch.testing.assert_close(out, _torch_ref(q, k, v, is_causal=True), rtol=1e-4, atol=1e-5)


def test_three_dim_inputs_and_masks():
    """(N, L, E) inputs and an (N, L, S) mask take a head dimension of 1 (torch's broadcasting)."""
    q, k, v = (t[:, 0] for t in qkv())
    keep = torch.rand(2, 37, 53) < 0.5
    made = _mask_mods(keep, q.unsqueeze(1), 53, True)
    graph = mods.trace_mask_mod(made["block_mask"].mask_mod, allow_cpu=True)
    idx = [torch.arange(n).reshape([n if a == i else 1 for a in range(4)]) for i, n in enumerate((2, 1, 37, 53))]
    assert torch.equal(graph.evaluate(None, *idx), keep.unsqueeze(1))
    assert torch.equal(flashgen.sdpa(q, k, v, attn_mask=keep, fallback=True),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=keep))
