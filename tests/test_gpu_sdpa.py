"""GPU tier for ``flashgen.sdpa`` (api.dropin): torch SDPA's calls on flashgen's kernels against the fp32
reference (torch's SDPA math on upcast inputs) with the 2x rule, the same-dtype reference being torch's
math on the inputs' dtype: no mask, causal with as many and with fewer or more queries than keys
(SDPA aligns it at the top left), bool masks (key padding, random), float masks, GQA, three-dim
inputs; the gradient of the unmasked call; the refusals and the explicit fallback."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)"),
]

import flashgen  # noqa: E402
from flashgen.reference import allowance  # noqa: E402
from gpu_util import is_sm90, poison_output  # noqa: E402

F = torch.nn.functional
needs_sm90 = pytest.mark.skipif(not is_sm90(), reason="masked sdpa runs as mods on fwd_sm90 (an sm_90 GPU)")


def _math(q, k, v, dtype, **kw):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kw = {n: (m.to(dtype) if isinstance(m, torch.Tensor) and m.is_floating_point() else m) for n, m in kw.items()}
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), **kw).float()


def check(q, k, v, **kw):
    poison_output(q)
    with torch.no_grad():
        out = flashgen.sdpa(q, k, v, **kw)
    torch.cuda.synchronize()
    ref, low = _math(q, k, v, torch.float32, **kw), _math(q, k, v, q.dtype, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = (out.float() - ref).abs().max().item()
    tol = allowance(low, ref, q.dtype)
    assert err <= tol, f"max err {err:.3e} > tol {tol:.3e}"


def inputs(n, h, hk, nq, nk, d=64, dtype=torch.bfloat16):
    return (torch.randn(n, h, nq, d, device="cuda", dtype=dtype), torch.randn(n, hk, nk, d, device="cuda", dtype=dtype),
            torch.randn(n, hk, nk, d, device="cuda", dtype=dtype))


@pytest.mark.parametrize("nq,nk", [(1, 1), (113, 203), (257, 257), (1023, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unmasked(nq, nk, dtype):
    check(*inputs(2, 4, 4, nq, nk, dtype=dtype))


@needs_sm90
@pytest.mark.parametrize("nq,nk", [(113, 203), (239, 1), (799, 3), (257, 257), (1, 239)])
def test_causal_top_left(nq, nk):
    check(*inputs(2, 8, 2, nq, nk), is_causal=True, enable_gqa=True)


@needs_sm90
@pytest.mark.parametrize("nq,nk", [(113, 203), (1023, 1024), (300, 300)])
def test_bool_masks(nq, nk):
    q, k, v = inputs(3, 4, 4, nq, nk, d=128)
    lengths = torch.tensor([nk, max(1, nk // 2), 1], device="cuda")
    padding = (torch.arange(nk, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]  # (N, 1, 1, S)
    check(q, k, v, attn_mask=padding)
    keep = torch.rand(3, 4, nq, nk, device="cuda") < 0.3
    keep[..., nk // 3] = True  # every row sees a key (torch's math gives NaN where none does)
    check(q, k, v, attn_mask=keep)


@needs_sm90
@pytest.mark.parametrize("shape", [(113, 203), (2, 1, 113, 203)])
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bfloat16])
def test_float_masks(shape, mask_dtype):
    q, k, v = inputs(2, 4, 4, 113, 203)
    check(q, k, v, attn_mask=(torch.randn(*shape, device="cuda") * 2).to(mask_dtype))


@needs_sm90
def test_three_dim_inputs():
    q, k, v = (t[:, 0] for t in inputs(2, 1, 1, 200, 300))
    check(q, k, v)
    check(q, k, v, attn_mask=torch.rand(2, 200, 300, device="cuda") < 0.5)


def test_unmasked_gradients_flow():
    q, k, v = (t.requires_grad_(True) for t in inputs(2, 4, 4, 300, 300))
    flashgen.sdpa(q, k, v, is_causal=True).float().square().sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    F.scaled_dot_product_attention(*leaves, is_causal=True).square().sum().backward()
    for g, leaf in zip(got, leaves):
        assert (g.float() - leaf.grad).abs().max().item() < 5e-2 * max(1.0, leaf.grad.abs().max().item())


@needs_sm90
@pytest.mark.parametrize("d", [64, 160])
@pytest.mark.parametrize("kind", ["bool", "float", "top_left"])
def test_masked_gradients(kind, d):
    """A masked call's gradients (the mods' backward: bwd_sm90, and the mma.sync bwd_dkdv at head-dim tile 160)
    against torch's SDPA in fp32 (every row sees a key)."""
    q, k, v = (t.requires_grad_(True) for t in inputs(2, 4, 2, 150, 230, d))
    extra = {"is_causal": True} if kind == "top_left" else {
        "attn_mask": (torch.rand(150, 230, device="cuda") < 0.5) | (torch.arange(230, device="cuda") == 0)
        if kind == "bool" else torch.randn(2, 1, 150, 230, device="cuda")}
    dout = torch.randn(2, 4, 150, d, device="cuda", dtype=torch.bfloat16)
    flashgen.sdpa(q, k, v, enable_gqa=True, **extra).backward(dout)
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    F.scaled_dot_product_attention(*leaves, enable_gqa=True, **extra).backward(dout.float())
    for g, leaf in zip((q.grad, k.grad, v.grad), leaves):
        assert (g.float() - leaf.grad).abs().max().item() < 5e-2 * max(1.0, leaf.grad.abs().max().item())
