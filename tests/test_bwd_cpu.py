"""The backward pass without a GPU: custom ops' fake implementations, autograd wiring, torch.compile
tracing, argument errors, the backward specs' rules.

Meta tensors stand in for CUDA tensors: the ops' fake (meta) implementations give the shapes,
dtypes and strides the real kernels would, so autograd and torch.compile can be checked here.
"""
from __future__ import annotations

import pytest
import torch

import flashgen
import flashgen.api.entry
import flashgen.api.autograd  # noqa: F401 -- registers the ops
from flashgen import KernelSpec, families, gpus
from flashgen.families.bwd import BWD_HEAD_DIMS, DQ_MODES, dq_mode, warp_split
from flashgen.problem import ProblemKey, bwd_head_dim_tile

F16, BF16 = torch.float16, torch.bfloat16


def meta(*shape, dtype=BF16, grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_fwd_op_fake_shapes(layout, dtype):
    """attn_fwd on meta tensors: out like q (contiguous), lse fp32 (batch, heads, seqlen_q) in either layout."""
    if layout == "bhsd":
        q, k = meta(2, 6, 37, 72, dtype=dtype), meta(2, 2, 129, 72, dtype=dtype)
    else:
        q, k = meta(2, 37, 6, 72, dtype=dtype), meta(2, 129, 2, 72, dtype=dtype)
    out, lse, out32 = torch.ops.flashgen.attn_fwd(q, k, k, True, 0.1, layout, False)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (2, 6, 37) and lse.dtype == torch.float32
    assert out32.shape == (0,)  # no sinks: no fp32 output
    sinks = meta(6, dtype=torch.float32)
    *_, out32 = torch.ops.flashgen.attn_fwd(q, k, k, True, 0.1, layout, False, -1, 0, 0.0, None, sinks, True)
    assert out32.shape == (2, 6, 37, 72) and out32.dtype == torch.float32 and out32.is_contiguous()


def test_fwd_and_bwd_ops_on_fake_cuda_tensors():
    """With FakeTensorMode CUDA tensors (what torch.compile traces with), the ops keep device and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 37, 6, 64, dtype=BF16, device="cuda")
        k = torch.empty(2, 50, 2, 64, dtype=BF16, device="cuda")
        out, lse, _ = torch.ops.flashgen.attn_fwd(q, k, k, True, 0.125, "bshd", False)
        assert out.device.type == "cuda" and out.shape == q.shape and lse.shape == (2, 6, 37)
        dq, dk, dv, dsinks = torch.ops.flashgen.attn_bwd(out, q, k, k, out, lse, None, True, 0.125, "bshd", True)
        assert (dq.shape, dk.shape, dv.shape, dsinks.shape) == (q.shape, k.shape, k.shape, (0,))
        assert dq.dtype == dk.dtype == dv.dtype == BF16 and dk.device.type == "cuda"
        sinks = torch.empty(6, dtype=torch.float32, device="cuda")
        out, lse, out32 = torch.ops.flashgen.attn_fwd(q, k, k, True, 0.125, "bshd", False, 64, 0, 30.0, None, sinks,
                                                      True)
        assert out32.shape == (2, 6, 37, 64) and out32.device.type == "cuda"
        *_, dsinks = torch.ops.flashgen.attn_bwd(out, q, k, k, out, lse, None, True, 0.125, "bshd", False, 64, 0,
                                                 30.0, None, sinks, out32)
        assert dsinks.shape == (6,) and dsinks.dtype == torch.float32


@pytest.mark.parametrize("deterministic", [False, True])
def test_autograd_through_meta_tensors(deterministic):
    """attention() with inputs that require grad goes through the op: out has a grad_fn, and backward
    gives q, k, v gradients of their own shapes (GQA: k, v keep their fewer heads)."""
    q = meta(2, 6, 37, 64, grad=True)
    k, v = meta(2, 2, 50, 64, grad=True), meta(2, 2, 50, 64, grad=True)
    out = flashgen.attention(q, k, v, causal=True, deterministic=deterministic)
    assert out.grad_fn is not None and "flashgen" in type(out.grad_fn).__name__
    out.float().sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    out, lse = flashgen.attention(q, k, v, return_lse=True)
    assert lse.shape == (2, 6, 37) and lse.dtype == torch.float32


def test_torch_compile_fullgraph_traces_forward_and_backward():
    """torch.compile(fullgraph=True) traces a function calling flashgen.attention without graph breaks
    (aot_eager on meta tensors: the graph, the op and its autograd formula, without a GPU)."""
    def f(q, k, v):
        return flashgen.attention(q, k, v, causal=True, layout="bshd").float().square().sum()

    q = meta(2, 37, 6, 64, dtype=F16, grad=True)
    k, v = meta(2, 50, 2, 64, dtype=F16, grad=True), meta(2, 50, 2, 64, dtype=F16, grad=True)
    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    loss.backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape
    explained = torch._dynamo.explain(f)(q, k, v)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.parametrize("bad", [1, 0, "yes", None])
def test_deterministic_must_be_a_bool(bad):
    """deterministic is a real bool, checked first (even for inputs that need no gradient)."""
    q = torch.randn(1, 2, 8, 64)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flashgen.attention(q, q, q, deterministic=bad)


def test_grad_path_argument_errors():
    """On the autograd path the flags are checked before the op runs: causal and softmax_scale types,
    layout, and spec (a forced forward kernel has no backward)."""
    q = meta(1, 2, 8, 64, grad=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flashgen.attention(q, q, q, causal=1)
    with pytest.raises(TypeError, match="softmax_scale"):
        flashgen.attention(q, q, q, softmax_scale="0.1")
    with pytest.raises(ValueError, match="layout"):
        flashgen.attention(q, q, q, layout="sbhd")
    with pytest.raises(ValueError, match="spec="):
        flashgen.attention(q, q, q, spec=KernelSpec())


def test_grad_path_checks_inputs_when_it_runs():
    """A CPU tensor that requires grad reaches the op's real implementation, which runs the forward's
    checks: the same clear ValueError as without autograd."""
    q = torch.randn(1, 2, 8, 64, dtype=BF16, requires_grad=True)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        flashgen.attention(q, q, q)


def test_no_grad_inputs_skip_the_op(monkeypatch):
    """Inputs that need no gradient take the direct forward (no custom-op overhead)."""
    def boom(*a, **k):
        raise AssertionError("went through the op")

    monkeypatch.setattr(flashgen.api.entry, "attention_op", boom)
    q = torch.randn(1, 2, 8, 64, dtype=BF16, requires_grad=True)
    with torch.no_grad(), pytest.raises(ValueError, match="CUDA tensor"):
        flashgen.attention(q, q, q)
    with pytest.raises(ValueError, match="CUDA tensor"):
        flashgen.attention(q.detach(), q.detach(), q.detach())


# ---------------------------------------------------------------- specs and rules


def _reference(q, k, v, causal, scale, layout):
    """(out, lse) in fp32 torch (GQA by repeated heads), causal aligned at the last rows."""
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q.float() @ k.float().transpose(-1, -2) * scale
    if causal:
        nq, nk = s.shape[-2:]
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq).logical_not(), float("-inf"))
    lse = s.logsumexp(-1)
    out = (s.softmax(-1) @ v.float()).to(q.dtype)
    return (out.transpose(1, 2) if layout == "bshd" else out), lse


def _kernels_in_torch(monkeypatch):
    """flashgen.api.autograd's forward and backward replaced by _reference and its autograd: the wiring around
    them (saved tensors, flags, dout / dlse, the gradients' order) runs as it would around the kernels."""
    def forward(q, k, v, causal, scale, layout, return_lse, spec, algorithm, window, softcap, alibi, sinks, out32):
        assert return_lse and window is None and sinks is None
        return _reference(q, k, v, causal, scale, layout)

    def attention_backward(dout, q, k, v, out, lse, causal, scale, layout, deterministic, dlse, packed=None, **_):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            o, l = _reference(*leaves, causal, scale, layout)
            if packed is not None:  # (one sequence: the reference's LSE is (1, heads, n) as the packed one)
                l = l.reshape(lse.shape)
            grads = torch.autograd.grad((o, l), leaves, (dout, dlse if dlse is not None else torch.zeros_like(l)))
        return grads

    def packed_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, seqused_k, window, softcap, alibi, sinks,
                       out32=None):
        out, lse = _reference(q[None], k[None], v[None], causal, scale, "bshd")
        return out[0], lse[0]

    monkeypatch.setattr(flashgen.api.autograd, "forward", forward)
    monkeypatch.setattr(flashgen.api.autograd, "attention_backward", attention_backward)
    monkeypatch.setattr(flashgen.api.autograd, "packed_forward", packed_forward)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("used", ["out", "lse", "both"])
def test_eager_autograd_wiring_matches_torch(monkeypatch, layout, used):
    """Eager calls run the ops' forward and formula through a plain autograd.Function (no custom-op dispatch,
    whose host time exceeded a 1k training step's kernels): with the kernels replaced by torch's arithmetic,
    the gradients of q, k and v (GQA) through out, lse or both equal torch autograd's of the same arithmetic."""
    _kernels_in_torch(monkeypatch)
    torch.manual_seed(0)
    shape = (lambda b, h, n, d: (b, h, n, d)) if layout == "bhsd" else (lambda b, h, n, d: (b, n, h, d))
    q = torch.randn(*shape(2, 6, 37, 16), dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(*shape(2, 2, 37, 16), dtype=torch.float64, requires_grad=True) for _ in range(2))
    w_out, w_lse = torch.randn(*shape(2, 6, 37, 16), dtype=torch.float64), torch.randn(2, 6, 37, dtype=torch.float64)

    def loss(out, lse):
        return {"out": (out * w_out).sum(), "lse": (lse * w_lse).sum(),
                "both": (out * w_out).sum() + (lse * w_lse).sum()}[used]

    out, lse = flashgen.api.autograd.attention_op(q, k, v, True, 0.3, layout, True, False, None)
    assert type(out.grad_fn).__name__ == "_EagerBackward"
    got = torch.autograd.grad(loss(out, lse), (q, k, v))
    want = torch.autograd.grad(loss(*_reference(q, k, v, True, 0.3, layout)), (q, k, v), materialize_grads=True)
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.allclose(g, w, atol=1e-10)


def test_eager_autograd_wiring_packed_rows(monkeypatch):
    """The same for attention_varlen's path (one packed sequence): gradients through out and lse."""
    _kernels_in_torch(monkeypatch)
    torch.manual_seed(1)
    q = torch.randn(29, 4, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(29, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, 29], dtype=torch.int32)
    w_out, w_lse = torch.randn(29, 4, 16, dtype=torch.float64), torch.randn(4, 29, dtype=torch.float64)
    out, lse = flashgen.api.autograd.attention_varlen_op(q, k, v, cu, cu, 29, 29, True, 0.3)
    assert type(out.grad_fn).__name__ == "_EagerBackward"
    got = torch.autograd.grad((out * w_out).sum() + (lse * w_lse).sum(), (q, k, v))
    ro, rl = _reference(q[None], k[None], v[None], True, 0.3, "bshd")
    want = torch.autograd.grad((ro[0] * w_out).sum() + (rl[0] * w_lse).sum(), (q, k, v))
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.allclose(g, w, atol=1e-10)


def test_meta_and_compiled_calls_keep_the_ops():
    """Meta tensors (and torch.compile, test above) go through the registered op and its fake kernel."""
    q = meta(1, 2, 8, 64, grad=True)
    out = flashgen.api.autograd.attention_op(q, q, q, False, None, "bhsd", False, False, None)
    assert type(out.grad_fn).__name__ != "_EagerBackward" and "flashgen" in type(out.grad_fn).__name__


def test_warp_split_minimises_fragment_loads():
    """The split of an m x n tile over warps: fewest fragment loads per mma, ties to more warps on m,
    None when 16x16 steps cannot cover it."""
    assert warp_split(128, 64, 8) == 4      # 32 x 32 per warp
    assert warp_split(64, 128, 8) == 2      # 32 x 32 per warp
    assert warp_split(64, 64, 4) == 2
    assert warp_split(32, 224, 8) is None   # 224 = 14 x 16: at most 2 warps along n
    assert warp_split(16, 16, 2) is None


def test_bwd_specs_validate_and_name():
    """Backward specs validate their own rules and name their kind; a split that cannot tile is refused."""
    s = KernelSpec(kind="bwd_dkdv", arch="sm_90a", dtype="bf16", head_dim=128, block_m=64, block_n=64,
                   warps=8, stages=2, causal=True).validate()
    assert s.name == "bwd_dkdv_d128_m64_n64_w8_s2_causal_bf16_sm90a"
    assert "refill" not in s.to_dict()  # fwd_v2's field, not the backward's
    ctx = s.context()
    assert ctx["dq_atomic"] is True and ctx["wa"] and ctx["wb"] and ctx["wc"]
    assert s.replace(kind="bwd_dkdv_nodq").context()["dq_atomic"] is False
    with pytest.raises(ValueError, match="cannot tile"):
        s.replace(head_dim=224, block_n=32).validate()
    with pytest.raises(ValueError, match="causal"):
        KernelSpec(kind="bwd_convert", block_m=64, block_n=64, warps=4, causal=True).validate()


def test_bwd_rule_picks_the_sm80_fallback_for_d256():
    """d = 256: the preferred dK/dV tile needs more shared memory than an A100 has; the rule falls back."""
    key = ProblemKey("bwd_dkdv", "sm_80", "bf16", 256, True, 1024)
    spec = families.default_spec(key, gpus.ARCH_SMEM_PER_BLOCK["sm_80"])
    assert spec.smem_bytes() <= gpus.ARCH_SMEM_PER_BLOCK["sm_80"]
    big = families.default_spec(ProblemKey("bwd_dkdv", "sm_90a", "bf16", 256, True, 1024),
                                gpus.ARCH_SMEM_PER_BLOCK["sm_90a"])
    assert big.smem_bytes() > gpus.ARCH_SMEM_PER_BLOCK["sm_80"]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("d", [8, 64, 136, 160, 168, 200, 224, 256])
def test_bwd_head_dim_tile(d, arch):
    """The backward maps head dims to tiles like the forward, except that 224 runs on the 256 tile, and on
    sm_90a 160 on the 192 tile (bwd_sm90 has no 160 tile); the problem key agrees."""
    want = {8: 32, 64: 64, 136: 160, 160: 160, 168: 192, 200: 256, 224: 256, 256: 256}[d]
    if arch == "sm_90a" and want == 160:
        want = 192
    assert bwd_head_dim_tile(d, arch) == want
    assert families.problem_key("bwd_dkdv", arch, "bf16", d, False, 512).head_dim == want


def test_bwd_sm90_serves_every_backward_tile_of_its_arch():
    """Every head dim's backward tile on sm_90a is one bwd_sm90 has, so the Hopper backward serves them all (the
    mma.sync dK/dV kernel only where a caller forces it)."""
    from flashgen.families.bwd_sm90 import BWD_SM90_TILES
    from flashgen.problem import HEAD_DIM_TILES

    tiles = {bwd_head_dim_tile(d, "sm_90a") for d in range(8, 257, 8)}
    assert tiles <= set(BWD_SM90_TILES), tiles - set(BWD_SM90_TILES)
    for d in range(8, 257, 8):
        key = families.problem_key("bwd_dkdv", "sm_90a", "bf16", d, True, 2048)
        assert families.default_family(key) == "bwd_sm90", d
    assert {bwd_head_dim_tile(d, "sm_80") for d in range(8, 257, 8)} == set(HEAD_DIM_TILES) - {224}


def test_bwd_row_kernels_are_never_causal():
    """Preprocess and convert have one spec for causal and non-causal keys."""
    for kind in ("bwd_preprocess", "bwd_convert"):
        a = families.default_spec(ProblemKey(kind, "sm_90a", "bf16", 128, True, 512), 232448)
        b = families.default_spec(ProblemKey(kind, "sm_90a", "bf16", 128, False, 512), 232448)
        assert a == b and not a.causal


def test_bwd_dq_mode_rule():
    """Every backward head-dim tile has a dQ mode, and it is one the backward knows."""
    for d in BWD_HEAD_DIMS:
        assert dq_mode(d) in DQ_MODES
