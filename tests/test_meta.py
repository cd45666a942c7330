"""The entry points on meta tensors (no GPU): argument checks, then outputs of the shapes and dtypes the
kernels give (the custom ops' fake kernels; decode's own shape rule), so meta-device model tooling runs."""
from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.errors import UnsupportedError

BF16, F16 = torch.bfloat16, torch.float16


def meta(*shape, dtype=BF16, grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


def ints(*shape):
    return torch.empty(*shape, dtype=torch.int32, device="meta")


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_attention_shapes(layout, dtype):
    """Output like q (either layout, GQA 6/2, odd lengths), LSE fp32 (batch, heads, seqlen_q); the variants
    take the same path; nothing is launched (no GPU here)."""
    q, k = (meta(2, 6, 113, 72, dtype=dtype), meta(2, 2, 203, 72, dtype=dtype)) if layout == "bhsd" else \
        (meta(2, 113, 6, 72, dtype=dtype), meta(2, 203, 2, 72, dtype=dtype))
    out, lse = flashgen.attention(q, k, k, causal=True, layout=layout, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and out.device.type == "meta"
    assert lse.shape == (2, 6, 113) and lse.dtype == torch.float32
    out = flashgen.attention(q, k, k, layout=layout, window=(64, 0), softcap=30.0,
                             alibi_slopes=meta(6, dtype=torch.float32), sinks=meta(6, dtype=torch.float32))
    assert out.shape == q.shape and out.dtype == dtype


def test_attention_backward_shapes():
    """With leaves that need a gradient the custom op's autograd runs on meta: gradients shaped as the
    leaves (the sinks' too)."""
    q, k, v = meta(1, 4, 239, 64, grad=True), meta(1, 2, 17, 64, grad=True), meta(1, 2, 17, 64, grad=True)
    sinks = meta(4, dtype=torch.float32, grad=True)
    flashgen.attention(q, k, v, causal=True, sinks=sinks).sum().backward()
    assert [t.grad.shape for t in (q, k, v, sinks)] == [q.shape, k.shape, v.shape, sinks.shape]


@pytest.mark.parametrize("call, error, match", [
    (lambda q, k: flashgen.attention(q, meta(2, 3, 32, 64), meta(2, 3, 32, 64)), ValueError, "multiple of heads"),
    (lambda q, k: flashgen.attention(q, k, k, sinks=meta(3, dtype=torch.float32)), ValueError, "sinks must have"),
    (lambda q, k: flashgen.attention(q, k, k, softcap=-1.0), ValueError, "softcap"),
    (lambda q, k: flashgen.attention(q, torch.empty(2, 2, 32, 64, dtype=BF16), k), ValueError, "k must be a CUDA"),
    (lambda q, k: flashgen.attention(q, k.float(), k), TypeError, "float16 or bfloat16"),
    (lambda q, k: flashgen.attention(q, k, k, return_lse=1), TypeError, "return_lse"),
    (lambda q, k: flashgen.attention(q, k, k, algorithm="v1"), UnsupportedError, "no meta"),
    (lambda q, k: flashgen.attention(q, k, k, spec=flashgen.KernelSpec()), ValueError, "spec="),
])
def test_attention_checks_still_apply(call, error, match):
    """Meta tensors skip the launch, not the checks: the same errors as on the GPU, before anything runs."""
    q, k = meta(2, 8, 32, 64), meta(2, 2, 32, 64)
    with pytest.raises(error, match=match):
        call(q, k)


def test_attention_varlen_shapes():
    """Packed rows: out like q, LSE (heads, total_q); a gradient flows; paged K/V gives the same shapes;
    the value checks (which read the lengths) are skipped, the shape checks are not."""
    q, k = meta(300, 8, 128), meta(280, 2, 128)
    cu = ints(4)
    out, lse = flashgen.attention_varlen(q, k, k, cu, cu, 200, 200, causal=True, return_lse=True)
    assert out.shape == q.shape and out.dtype == BF16 and lse.shape == (8, 300) and lse.dtype == torch.float32
    qg = meta(300, 8, 128, grad=True)
    flashgen.attention_varlen(qg, k, k, cu, cu, 200, 200).sum().backward()
    assert qg.grad.shape == q.shape
    cache = meta(64, 16, 2, 128)
    out = flashgen.attention_varlen(q, cache, cache, cu, None, 200, 320, causal=True, seqused_k=ints(3),
                                    block_table=ints(3, 20))
    assert out.shape == q.shape
    with pytest.raises(ValueError, match="sinks must have"):
        flashgen.attention_varlen(q, k, k, cu, cu, 200, 200, sinks=meta(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="cu_seqlens"):
        flashgen.attention_varlen(q, k, k, ints(4, 1), cu, 200, 200)


def test_decode_shapes():
    """Decode on meta: out like q, LSE (batch, heads, new tokens); a gradient or spec= is refused as on the
    GPU; bad shapes give the GPU path's errors."""
    q, cache, lens = meta(4, 3, 8, 128), meta(4, 1000, 2, 128), ints(4)
    out, lse = flashgen.decode(q, cache, cache, lens, return_lse=True, window=(256, 0), softcap=50.0)
    assert out.shape == q.shape and out.dtype == BF16 and lse.shape == (4, 8, 3) and lse.dtype == torch.float32
    new = meta(4, 3, 2, 128)
    assert flashgen.decode(q, cache, cache, lens, k_new=new, v_new=new).shape == q.shape
    with pytest.raises(UnsupportedError, match="no backward"):
        flashgen.decode(meta(4, 3, 8, 128, grad=True), cache, cache, lens)
    with pytest.raises(ValueError, match="must have one shape"):
        flashgen.decode(q, cache, meta(4, 999, 2, 128), lens)


def test_meta_model_forward():
    """A module built on the meta device (as model tooling builds one before loading weights) runs its
    forward through flashgen.attention."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(512, 3 * 512, dtype=BF16)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, 8, 64).unbind(2)
            return flashgen.attention(q, k, v, causal=True, layout="bshd").reshape(b, n, 512)

    with torch.device("meta"):
        block = Block()
        y = block(torch.empty(2, 77, 512, dtype=BF16))
    assert y.shape == (2, 77, 512) and y.device.type == "meta"


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_mods_shapes(layout):
    """User mods on meta tensors: the mods are traced (captures anywhere) and the arguments checked, then
    outputs of the right shapes; nothing is compiled or launched, no block mask is made."""
    slopes = torch.rand(6)
    q, k = (meta(2, 6, 113, 64), meta(2, 2, 203, 64)) if layout == "bhsd" else (meta(2, 113, 6, 64), meta(2, 203, 2, 64))

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    out, lse = flashgen.attention(q, k, k, layout=layout, score_mod=alibi, mask_mod=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == BF16 and out.device.type == "meta"
    assert lse.shape == (2, 6, 113) and lse.dtype == torch.float32
    mask = flashgen.create_block_mask(causal, None, None, 113, 203, device="cpu")
    assert flashgen.attention(q, k, k, layout=layout, block_mask=mask).shape == q.shape


def test_mods_checks_on_meta():
    q, k = meta(2, 6, 113, 64), meta(2, 4, 203, 64)
    with pytest.raises(ValueError, match="heads"):  # 6 query heads over 4 KV heads
        flashgen.attention(q, k, k, mask_mod=lambda b, h, i, j: i >= j)
    k = meta(2, 2, 203, 64)
    with pytest.raises(ValueError, match="control flow"):
        flashgen.attention(q, k, k, score_mod=lambda s, b, h, i, j: s if i > j else -s)
    with pytest.raises(ValueError, match="made for"):
        flashgen.attention(q, k, k, block_mask=flashgen.create_block_mask(lambda b, h, i, j: i >= j, None, None,
                                                                          50, 50, device="cpu"))
    with pytest.raises(UnsupportedError, match="causal"):
        flashgen.attention(q, k, k, causal=True, mask_mod=lambda b, h, i, j: i >= j)
