"""GPU tier: the backward of user mods (flashgen.mods) on bwd_sm90, and on the mma.sync bwd_dkdv (the other GPUs';
forced here beside bwd_sm90 by the ``mma_sync`` fixture).

dQ, dK, dV through ``flashgen.attention(..., score_mod=, mask_mod=, block_mask=).backward`` against
autograd through the fp32 reference on fp32 leaves (``flashgen.reference.grad_tolerance``: 2x the
same-dtype reference's error + a rounding-sized atol), for FlexAttention's example mods
(``gpu_util.example_mods``): masks (block lists per key block, the mask on partial blocks only), score_mods
whose derivative multiplies dS (softcap) and ones that only add (ALiBi, a relative-position table in
fp32 and bf16: the latter needs dP^T's GEMM after P^T at d = 128). Odd sizes, GQA, both layouts, fp16 and
bf16, dispatch's kernel, block masks given and reused, the LSE's gradient, torch's FlexAttention's
gradients, and the refusals before any launch.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)"),
]

import flashgen  # noqa: E402
from flashgen.reference import allowance, grad_tolerance, reference  # noqa: E402
from gpu_util import MOD_NAMES, banded_mask, example_mods, is_sm90, make_inputs, to_bhsd, warm_mods  # noqa: E402

needs_sm90 = pytest.mark.skipif(not is_sm90(), reason="the mods' backward runs on bwd_sm90 (an sm_90 GPU)")

SEQLENS = [(1, 1), (113, 203), (1, 239), (239, 1), (799, 3), (1023, 1024)]
SMALL = ["causal", "document", "alibi", "softcap_document", "relative_bf16"]


@pytest.fixture(scope="module", autouse=True)
def _precompile(request, tmp_path_factory):
    lengths = [nq for nq, _ in SEQLENS] + [1000, 700]
    warm_mods(request, tmp_path_factory, [(MOD_NAMES, 128, "bf16", lengths), (SMALL, 64, "fp16", lengths),
                                          (SMALL, 128, "fp16", lengths), (SMALL, 192, "bf16", lengths),
                                          (SMALL, 256, "bf16", lengths)], backward=True)


def check_mod_grads(b, hq, hk, nq, nk, d, dtype, name, layout="bhsd", block_mask=None, given=None):
    """One call's dQ, dK, dV against the rule, with ``example_mods``' ``name`` or the ``given`` (score_mod, mask_mod)."""
    q, k, v = make_inputs(b, hq, hk, nq, nk, d, dtype, layout, 2.0)
    score_mod, mask_mod = given or example_mods(b, hq, nq, nk)[name]
    extra = {"score_mod": score_mod, "mask_mod": mask_mod}
    if block_mask is not None and mask_mod is not None:
        extra = {"score_mod": score_mod, "block_mask": block_mask(mask_mod)}
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = flashgen.attention(*leaves, layout=layout, **extra)
    dout = torch.randn_like(out)
    out.backward(dout)
    torch.cuda.synchronize()
    got = [to_bhsd(t.grad, layout).float() for t in leaves]
    qb, kb, vb, db = (to_bhsd(t, layout) for t in (q, k, v, dout))
    ref, tol = grad_tolerance(qb, kb, vb, db, False, 1.0 / math.sqrt(d), score_mod=score_mod, mask_mod=mask_mod)
    for what, g, r, t in zip(("dq", "dk", "dv"), got, ref, tol):
        assert g.shape == r.shape
        assert torch.isfinite(g).all(), f"{name} {what}: non-finite"
        err = (g - r).abs().max().item()
        assert err <= t, f"{name} {what}: max err {err:.3e} > tol {t:.3e}"
    return leaves


@needs_sm90
@pytest.mark.parametrize("nq,nk", SEQLENS)
@pytest.mark.parametrize("name", MOD_NAMES)
def test_mod_grads_bf16(name, nq, nk):
    check_mod_grads(2, 4, 2, nq, nk, 128, torch.bfloat16, name)


@needs_sm90
@pytest.mark.parametrize("nq,nk", [(113, 203), (799, 3), (1023, 1024)])
@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("d", [64, 96, 128])
def test_mod_grads_fp16_bshd(name, nq, nk, d):
    check_mod_grads(1, 4, 1, nq, nk, d, torch.float16, name, layout="bshd")


@needs_sm90
@pytest.mark.parametrize("nq,nk", [(113, 203), (239, 1), (1023, 1024)])
@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("d", [192, 256])
def test_mod_grads_split_tiles(name, nq, nk, d):
    """Head dims above 128: bwd_sm90's split tile (two warpgroups over the columns of 64 keys) with the mods."""
    check_mod_grads(2, 4, 2, nq, nk, d, torch.bfloat16, name)


@needs_sm90
@pytest.mark.parametrize("name", ["causal", "sliding", "block_sparse", "alibi_causal"])
def test_mod_grads_given_block_mask(name):
    """A block mask made once serves the forward (per query block) and the backward (per key block)."""
    made = {}

    def make(mask_mod):
        made["mask"] = flashgen.create_block_mask(mask_mod, 2, 4, 1000, 1500)
        return made["mask"]

    check_mod_grads(2, 4, 4, 1000, 1500, 128, torch.bfloat16, name, block_mask=make)
    assert (128, 64) in {(t[1], t[0]) for t in made["mask"]._tiles}, "the backward's key-block lists were not made"


@needs_sm90
def test_lse_gradient():
    """dLSE joins the backward (D - dLSE): gradients of out . dout + lse . dl against the fp32 reference."""
    b, h, nq, nk, d = 2, 4, 300, 500, 128
    q, k, v = make_inputs(b, h, h, nq, nk, d, torch.bfloat16, "bhsd", 2.0)
    score_mod, mask_mod = example_mods(b, h, nq, nk)["alibi_causal"]
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = flashgen.attention(*leaves, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    dout, dl = torch.randn_like(out), torch.randn_like(lse)
    seen = torch.isfinite(lse)
    ((out.float() * dout).sum() + (lse[seen] * dl[seen]).sum()).backward()

    def grads(dtype):
        ls = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
        o, l2 = reference(*ls, False, 1 / math.sqrt(d), dtype, score_mod=score_mod, mask_mod=mask_mod)
        ((o.to(dtype).float() * dout.float()).sum() + (l2[seen] * dl[seen]).sum()).backward()
        return [t.grad for t in ls]

    ref, low = grads(torch.float32), grads(torch.bfloat16)
    for what, t, r, lo in zip(("dq", "dk", "dv"), leaves, ref, low):
        err = (t.grad.float() - r).abs().max().item()
        tol = allowance(lo, r, torch.bfloat16)
        assert err <= tol, f"{what}: max err {err:.3e} > tol {tol:.3e}"


@needs_sm90
def test_matches_flex_attention_gradients():
    """Against torch's FlexAttention (eager) on a document mask with an ALiBi score_mod: both within the
    rule of the fp32 reference, and close to each other."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    b, h, n, d = 1, 4, 512, 64
    q, k, v = make_inputs(b, h, h, n, n, d, torch.bfloat16)
    doc = torch.sort(torch.randint(0, 3, (n,), device="cuda")).values
    slopes = torch.rand(h, device="cuda") * 0.3

    def mask(b_, h_, q_, kv):
        return (doc[q_] == doc[kv]) & (q_ >= kv)

    def score(s, b_, h_, q_, kv):
        return s - slopes[h_] * (q_ - kv).abs()

    dout = torch.randn_like(q)
    ours = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    flashgen.attention(*ours, score_mod=score, mask_mod=mask).backward(dout)
    theirs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    fa.flex_attention(*theirs, score_mod=score, block_mask=fa.create_block_mask(mask, None, None, n, n)).backward(dout)
    ref, tol = grad_tolerance(q, k, v, dout, False, 1 / math.sqrt(d), score_mod=score, mask_mod=mask)
    for what, a, f, r, t in zip(("dq", "dk", "dv"), ours, theirs, ref, tol):
        assert (a.grad.float() - r).abs().max().item() <= t, what
        assert (a.grad.float() - f.grad.float()).abs().max().item() <= 2 * t, what


@pytest.fixture
def backward_rows(monkeypatch):
    """The mods' backward with row bounds (bwd_sm90 with KernelSpec.row_bounds where the block mask has them and
    such a tile builds clean) for every mask_mod, not only those that read a tensor
    (dispatch.mod_backward_row_bounds), in a fresh plan cache."""
    from flashgen import dispatch
    from flashgen.api.plans import cache

    monkeypatch.setattr(dispatch, "mod_backward_row_bounds", lambda pair: True)
    plans = cache("attention with mods")
    plans.clear()
    yield
    plans.clear()


def _backward_specs() -> list:
    from flashgen.api.plans import cache

    return [m.spec for p in cache("attention with mods").values() for m in p.backward.values()]


@needs_sm90
@pytest.mark.parametrize("nq,nk", [(113, 203), (1, 239), (239, 1), (799, 3), (1023, 1024)])
@pytest.mark.parametrize("name", ["causal", "sliding", "prefix_lm", "document", "softcap_document"])
@pytest.mark.parametrize("d", [64, 256])
def test_mod_grads_with_row_bounds(backward_rows, name, nq, nk, d):
    """bwd_sm90 masking a partial block's scores by each query row's first and last visible key (the block
    mask's row bounds) instead of the mask_mod: the masks whose rows each see one run of keys, odd sizes, GQA."""
    check_mod_grads(2, 4, 2, nq, nk, d, torch.bfloat16, name)
    specs = _backward_specs()
    assert specs and all(s.kind == "bwd_sm90" for s in specs), [s.name for s in specs]
    if name in ("causal", "document", "softcap_document"):  # (built clean with the bounds offline at 64 and 256)
        assert all(s.row_bounds for s in specs), [s.name for s in specs]


@needs_sm90
def test_row_bounds_backward_per_batch_and_head(backward_rows):
    """Bounds that differ per head and per batch (strides in rows of both), fp16, bshd, GQA; a mask whose rows
    each see two runs of keys keeps the mask_mod. (example_mods' block_sparse would not do: its random 128 x 128
    blocks at 300 x 300 give every row one run two times in three.)"""
    b, hq, hk, nq, nk = 3, 6, 2, 517, 700
    check_mod_grads(b, hq, hk, nq, nk, 64, torch.float16, "banded", layout="bshd",
                    given=(None, banded_mask(b, hq, nq, nk)))
    assert all(s.row_bounds for s in _backward_specs())
    from flashgen.api.plans import cache

    cache("attention with mods").clear()
    def two_runs(b_, h, q, kv):
        return (kv < 64) | (kv >= 192)

    check_mod_grads(2, 4, 2, 300, 300, 64, torch.bfloat16, "two_runs", given=(None, two_runs))
    assert not any(s.row_bounds for s in _backward_specs())


@pytest.fixture
def mma_sync(monkeypatch):
    """The mods' backward on the mma.sync dK/dV kernel (bwd_dkdv), which the GPUs without bwd_sm90 run, here too
    (a fresh plan cache, whose plans keep their backward kernel)."""
    from flashgen import dispatch
    from flashgen.api.plans import cache

    real = dispatch.mod_backward_spec
    monkeypatch.setattr(dispatch, "mod_backward_spec",
                        lambda key, budget, token, verify=False, family=None, row_bounds=False:
                        real(key, budget, token, verify, "bwd_dkdv"))
    plans = cache("attention with mods")
    plans.clear()
    yield
    plans.clear()


def _backward_kinds() -> set:
    from flashgen.api.plans import cache

    return {m.spec.kind for p in cache("attention with mods").values() for m in p.backward.values()}


@pytest.mark.parametrize("nq,nk", [(113, 203), (1, 239), (239, 1), (799, 3), (1023, 1024)])
@pytest.mark.parametrize("name", ["causal", "sliding", "document", "block_sparse", "alibi", "alibi_causal",
                                  "softcap_document", "relative", "relative_bf16"])
def test_mod_grads_on_the_mma_sync_backward(mma_sync, name, nq, nk):
    """bwd_dkdv with the mods: the score_mod's derivative on dS, the block mask's per-key-block lists (per query
    head of the GQA group), the mask on partial blocks and at both ends."""
    check_mod_grads(2, 4, 2, nq, nk, 128, torch.bfloat16, name)
    assert _backward_kinds() == {"bwd_dkdv"}


@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("d", [64, 96, 256])
def test_mod_grads_on_the_mma_sync_backward_fp16_bshd(mma_sync, name, d):
    check_mod_grads(1, 4, 1, 799, 803, d, torch.float16, name, layout="bshd")
    assert _backward_kinds() == {"bwd_dkdv"}


def test_mod_grads_per_head_lists_on_the_mma_sync_backward(mma_sync):
    """A mask that differs per head (a stride per query head) and per batch: each query head of a KV head's group
    walks its own list, heads with an empty list passed over."""
    b, hq, hk, nq, nk = 2, 6, 2, 300, 420
    step = torch.tensor([1, 2, 3, 1, 5, 7], device="cuda")
    cut = torch.tensor([0, 1000], device="cuda")

    def striped(b_, h, q, kv):  # every step[h]-th key; batch 0 a band up to 120 keys past the row; head 3 none
        return (kv % step[h] == 0) & (kv <= q + 120 + cut[b_]) & ((h != 3) | (q < 0))
    check_mod_grads(b, hq, hk, nq, nk, 64, torch.bfloat16, "striped", given=(None, striped))
    assert _backward_kinds() == {"bwd_dkdv"}


@needs_sm90
@pytest.mark.parametrize("name", ["causal", "document", "alibi_causal", "softcap_document"])
def test_mod_grads_at_head_dim_160(name):
    """Head dims 129-160 (no bwd_sm90 tile of their own): the mods backward runs on bwd_sm90's 192 split tile,
    the columns past the head dim zero (its forward fwd_v2)."""
    from flashgen.api.plans import cache

    cache("attention with mods").clear()
    check_mod_grads(2, 4, 2, 333, 517, 160, torch.bfloat16, name)
    assert _backward_kinds() == {"bwd_sm90"}


@pytest.mark.parametrize("name", ["causal", "document", "block_sparse", "alibi_causal", "softcap_document",
                                  "relative_bf16"])
@pytest.mark.parametrize("nq,nk", [(113, 203), (239, 1), (1023, 1024)])
def test_deterministic_mod_grads(name, nq, nk):
    """deterministic=True with mods: the mma.sync pair (bwd_dkdv_nodq, then bwd_dq walking the forward's
    per-query-block lists) within the rule, and the same bits on three runs."""
    from flashgen.api.plans import cache

    cache("attention with mods").clear()
    b, hq, hk, d = 2, 4, 2, 128
    q, k, v = make_inputs(b, hq, hk, nq, nk, d, torch.bfloat16, "bhsd", 2.0)
    score_mod, mask_mod = example_mods(b, hq, nq, nk)[name]
    dout = torch.randn_like(q)
    runs = []
    for _ in range(3):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        flashgen.attention(*leaves, score_mod=score_mod, mask_mod=mask_mod, deterministic=True).backward(dout)
        runs.append([t.grad for t in leaves])
    torch.cuda.synchronize()
    assert _backward_kinds() == {"bwd_dkdv_nodq"}
    for again in runs[1:]:
        assert all(torch.equal(a, g) for a, g in zip(runs[0], again)), f"{name}: the gradients' bits differ"
    ref, tol = grad_tolerance(q, k, v, dout, False, 1.0 / math.sqrt(d), score_mod=score_mod, mask_mod=mask_mod)
    for what, g, r, t in zip(("dq", "dk", "dv"), runs[0], ref, tol):
        assert torch.isfinite(g).all(), f"{name} {what}: non-finite"
        err = (g.float() - r).abs().max().item()
        assert err <= t, f"{name} {what}: max err {err:.3e} > tol {t:.3e}"


def test_deterministic_algorithms_take_the_mods_pair():
    """torch.use_deterministic_algorithms(True) without deterministic=: the backward takes the mods'
    deterministic pair (no alert), with the same gradients as deterministic=True."""
    from flashgen.api.plans import cache

    cache("attention with mods").clear()
    q, k, v = make_inputs(1, 4, 2, 300, 400, 64, torch.bfloat16, "bhsd", 2.0)
    score_mod, mask_mod = example_mods(1, 4, 300, 400)["alibi_causal"]
    dout = torch.randn_like(q)
    grads = []
    for flag in (False, True):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = flashgen.attention(*leaves, score_mod=score_mod, mask_mod=mask_mod, deterministic=flag)
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(not flag)
        try:
            out.backward(dout)
        finally:
            torch.use_deterministic_algorithms(previous)
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert "bwd_dkdv_nodq" in _backward_kinds()


@needs_sm90
def test_first_backward_in_a_new_process():
    """A new process's first backward loads its kernels in the autograd engine's thread, where torch's
    context is not current: the loader pushes it (cuCtxPushCurrent_v2; the unversioned entry point refused
    a context current in another thread: CUDA_ERROR_INVALID_CONTEXT, seen here first)."""
    import subprocess
    import sys

    code = (
        "import torch, flashgen\n"
        "q, k, v = (torch.randn(1, 2, 100, 64, device='cuda', dtype=torch.bfloat16, requires_grad=True)"
        " for _ in range(3))\n"
        "out = flashgen.attention(q, k, v, mask_mod=lambda b, h, i, j: i >= j)\n"
        "dout = torch.randn_like(out)\n"
        "out.backward(dout)\n"
        "ref = [t.detach().float().requires_grad_(True) for t in (q, k, v)]\n"
        "torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True).backward(dout.float())\n"
        "assert all((a.grad.float() - b.grad).abs().max().item() < 0.05 for a, b in zip((q, k, v), ref))\n"
        "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


@needs_sm90
def test_spilling_backward_still_serves():
    """A mod whose backward kernel spills a few bytes in every tile (a 50-softcap with a causal mask_mod at
    d = 128, NVRTC 13.0) runs on the least-spilling one, with gradients within the rule."""
    b, h, n, d = 2, 4, 700, 128
    q, k, v = make_inputs(b, h, h, n, n, d, torch.bfloat16, "bhsd", 2.0)

    def softcap(s, b_, h_, q_, kv):
        return 50.0 * torch.tanh(s / 50.0)

    def causal(b_, h_, q_, kv):
        return q_ >= kv

    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = flashgen.attention(*leaves, score_mod=softcap, mask_mod=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref, tol = grad_tolerance(q, k, v, dout, False, 1 / math.sqrt(d), score_mod=softcap, mask_mod=causal)
    for what, t, r, tl in zip(("dq", "dk", "dv"), leaves, ref, tol):
        err = (t.grad.float() - r).abs().max().item()
        assert err <= tl, f"{what}: max err {err:.3e} > tol {tl:.3e}"


@needs_sm90
def test_captured_tensor_gradients():
    """A learned relative-position table and per-head slopes that require grad get their gradients
    (api.capturegrad) within the rule's spirit: against autograd through the fp32 reference, 2x the
    same-dtype reference's error plus a rounding-sized atol."""
    b, h, nq, nk, d = 2, 4, 300, 410, 128
    q, k, v = make_inputs(b, h, 2, nq, nk, d, torch.bfloat16, "bhsd", 2.0)
    table = torch.randn(h, nq + nk - 1, device="cuda", requires_grad=True)
    slopes = (torch.rand(h, device="cuda") * 0.2).requires_grad_(True)
    last = torch.tensor([nk - 1], device="cuda", dtype=torch.int32)

    def score(s, b_, h_, q_, kv):
        return s + table[h_, q_ - kv + last[0]] - slopes[h_] * (q_ - kv).abs()

    def causal(b_, h_, q_, kv):
        return q_ + (nk - nq) >= kv

    dout = torch.randn(b, h, nq, d, device="cuda", dtype=torch.bfloat16)
    flashgen.attention(q, k, v, score_mod=score, mask_mod=causal).backward(dout)
    got = (table.grad.clone(), slopes.grad.clone())

    def grads(dtype):
        table.grad = slopes.grad = None
        out, _ = reference(q, k, v, False, 1 / math.sqrt(d), dtype, score_mod=score, mask_mod=causal)
        out.to(dtype).float().backward(dout.float())
        return table.grad.clone(), slopes.grad.clone()

    ref, low = grads(torch.float32), grads(torch.bfloat16)
    for what, g, r, lo in zip(("table", "slopes"), got, ref, low):
        err = (g - r).abs().max().item()
        tol = allowance(lo, r, torch.bfloat16)
        assert err <= tol, f"d{what}: max err {err:.3e} > tol {tol:.3e}"
