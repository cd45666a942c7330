"""GPU tier for packed rows: ``flashgen.attention_varlen`` against the fp32 reference run sequence by
sequence, FlashAttention-3's rule over the whole call (output poisoned first and written everywhere, the
LSE -inf exactly where a row sees nothing).

Lengths: zeros, ones, odd pairs with sq != sk, one sequence far longer than the rest, fresh random sets;
causal both, GQA, every head-dim tile, fp16 and bf16, seqused_k, the variants per sequence; dispatch's
pick (fwd_sm90 on an H200), fwd_v2 forced and the fwd_sm90 techniques (persistent, ping-pong, 192 rows);
the device-built work list against its host mirror; the value checks.
"""
from __future__ import annotations

import math
import random

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)"),
]

import flashgen  # noqa: E402
from flashgen import testing  # noqa: E402
from flashgen.errors import UnsupportedError  # noqa: E402
from flashgen.families import fwd_sm90, paged_spec  # noqa: E402
from flashgen.families.base import varlen_work  # noqa: E402
from flashgen.reference import grad_tolerance, reference, rounding_atol  # noqa: E402
from flashgen.spec import KernelSpec  # noqa: E402
from flashgen.variants import Variant  # noqa: E402
from gpu_util import DTYPES, is_sm90, poison_output, variant_inputs  # noqa: E402

needs_sm90 = pytest.mark.skipif(not is_sm90(), reason="fwd_sm90 needs an sm_90 GPU")

# (q lengths, k lengths): zeros and ones, FA3's odd pairs per sequence, one sequence far longer than the rest.
LENGTHS = {
    "odd": ([113, 1, 239, 799, 0, 1023], [203, 239, 1, 3, 17, 1024]),
    "zeros": ([0, 5, 0, 0, 64], [0, 0, 7, 0, 64]),
    "one_long": ([3000, 17, 1, 64, 130], [3000, 17, 1, 64, 130]),
    "equal": ([512] * 6, [512] * 6),
}


def _random_lengths(seqs, most):
    q = [random.choice([0, 1, random.randint(1, most)]) for _ in range(seqs)]
    k = [random.choice([n, random.randint(0, most)]) for n in q]
    return q, k


def _cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


def paged_cache(kv, cu_k, k_lens, page, spare_pages=3, spare_entries=2):
    """The packed rows of each tensor of ``kv`` (sequence s: rows cu_k[s] + [0, k_lens[s])) as paged caches
    (pages, page, hk, d) in one shuffled order, and their block table (rows padded with -1 past the pages
    in use). Rows past a sequence's keys in its last page, and pages no sequence uses, hold large finite
    junk (a kernel that weighed them would fail the tolerance)."""
    need = [-(-n // page) for n in k_lens]
    pages = sum(need) + spare_pages
    order = torch.randperm(pages).tolist()
    caches = [(torch.randn(pages, page, *t.shape[1:], device=t.device) * 50).to(t.dtype) for t in kv]
    table = torch.full((len(k_lens), max(need, default=0) + spare_entries), -1, dtype=torch.int32)
    at = 0
    for s, n in enumerate(k_lens):
        for j in range(need[s]):
            table[s, j] = phys = order[at]
            at += 1
            lo, hi = cu_k[s] + j * page, cu_k[s] + min(n, (j + 1) * page)
            for cache, t in zip(caches, kv):
                cache[phys, :hi - lo] = t[lo:hi]
    return caches, table.to(kv[0].device)


def check_varlen(q_lens, k_lens, hq=4, hk=2, d=128, dtype_name="bf16", causal=False, spec=None, used=None,
                 variant=None, stored_k=None, page=None, no_cu_k=False):
    """One ``attention_varlen`` call against the rule; ``used`` the seqused_k list (keys in use per sequence,
    each at most its k length); ``stored_k`` (with ``used``) the k lengths of the packing, else k_lens.
    ``page``: K/V from a paged cache of that page size (``paged_cache``), ``no_cu_k`` (with ``used``)
    without cu_seqlens_k."""
    dtype = DTYPES[dtype_name]
    stored = stored_k or k_lens
    tq, tk = sum(q_lens), sum(stored)
    q = torch.randn(tq, hq, d, device="cuda").to(dtype)
    k = torch.randn(tk, hk, d, device="cuda").to(dtype)
    v = torch.randn(tk, hk, d, device="cuda").to(dtype)
    cu_q, cu_k = _cu(q_lens), _cu(stored)
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda") if used is not None else None
    extra = variant_inputs(len(q_lens), hq, **(variant or {}))
    kv, paged = (k, v), {}
    if page is not None:
        kv, table = paged_cache((k, v), cu_k.tolist(), stored, page)
        paged = {"block_table": table}
    poison_output(q)
    out, lse = flashgen.attention_varlen(q, *kv, cu_q, None if no_cu_k else cu_k, max(q_lens, default=0),
                                         max(stored, default=0), causal=causal, seqused_k=seqused, return_lse=True,
                                         spec=spec, **paged, **extra)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (hq, tq)
    assert torch.isfinite(out.float()).all(), f"non-finite output (unwritten or NaN), lengths {q_lens} {k_lens}"
    scale = 1.0 / math.sqrt(d)
    err = tol_err = atol = lse_err = 0.0
    lse_tol = 1e-3
    for s, (nq, nk) in enumerate(zip(q_lens, k_lens)):
        if nq == 0:
            continue
        q0, k0 = int(cu_q[s]), int(cu_k[s])
        qs = q[q0:q0 + nq].transpose(0, 1)[None]
        ks, vs = (t[k0:k0 + nk].transpose(0, 1)[None] for t in (k, v))
        ex = dict(extra)
        if ex.get("alibi_slopes") is not None and ex["alibi_slopes"].dim() == 2:
            ex["alibi_slopes"] = ex["alibi_slopes"][s:s + 1]
        ref, ref_lse = reference(qs, ks, vs, causal, scale, torch.float32, **ex)
        low, low_lse = reference(qs, ks, vs, causal, scale, dtype, **ex)
        got = out[q0:q0 + nq].transpose(0, 1)[None].float()
        err = max(err, (got - ref).abs().max().item())
        tol_err = max(tol_err, (low - ref).abs().max().item())
        atol = max(atol, rounding_atol(ref, dtype))
        got_lse = lse[:, q0:q0 + nq][None]
        masked = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(got_lse), masked), f"LSE -inf pattern of sequence {s} ({nq}, {nk})"
        if (~masked).any():
            lse_err = max(lse_err, (got_lse[~masked] - ref_lse[~masked]).abs().max().item())
            lse_tol = max(lse_tol, 1e-3 * ref_lse[~masked].abs().max().item(),
                          2 * (low_lse[~masked] - ref_lse[~masked]).abs().max().item() + 1e-5)
    tol = 2 * tol_err + atol
    assert err <= tol, f"max err {err:.3e} > tol {tol:.3e} (lengths {q_lens} / {k_lens})"
    assert lse_err <= lse_tol, f"lse err {lse_err:.3e} > tol {lse_tol:.3e}"
    return out, lse


@pytest.mark.parametrize("lengths", list(LENGTHS), ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_lengths(lengths, causal, d):
    q_lens, k_lens = LENGTHS[lengths]
    check_varlen(q_lens, k_lens, 8, 2, d, "bf16", causal)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (6, 1)], ids=str)
def test_random_lengths(dtype, causal, heads):
    q_lens, k_lens = _random_lengths(16, 1500)
    check_varlen(q_lens, k_lens, *heads, 128, dtype, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k(causal):
    q_lens, stored = [113, 64, 0, 300, 1], [400, 64, 50, 300, 239]
    used = [203, 0, 17, 300, 1]
    check_varlen(q_lens, used, 4, 2, 128, "bf16", causal, used=used, stored_k=stored)


@pytest.mark.parametrize("variant", [{"window": (100, 37)}, {"window": (256, 0)}, {"softcap": 15.0},
                                     {"alibi": "batch"}, {"alibi": "head"}, {"sinks": True},
                                     {"window": (100, 37), "softcap": 15.0, "alibi": "batch", "sinks": True}], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_variants(variant, causal):
    check_varlen(*LENGTHS["odd"], 4, 2, 128, "bf16", causal, variant=variant)


def _v2(d, causal, **flags):
    bm, bn, st = {64: (128, 64, 2), 128: (128, 32, 3), 256: (64, 32, 2)}[d]
    return KernelSpec(kind="fwd_v2", arch="sm_90a" if is_sm90() else "sm_80", dtype="bf16", head_dim=d, causal=causal,
                      block_m=bm, block_n=bn, warps=4, stages=st, varlen=True, **flags).validate()


@pytest.mark.parametrize("lengths", ["odd", "zeros", "one_long"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fwd_v2(lengths, causal, d):
    check_varlen(*LENGTHS[lengths], 4, 2, d, "bf16", causal, spec=_v2(d, causal))


@needs_sm90
@pytest.mark.parametrize("tokens", ["ws", "ws_ov_s3", "ws_pp", "ws_ps", "ws_pp_kr_ps", "ws_ov_ls_ps_s4_m192_n80",
                                    "ws_s2_m192_n80"])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_techniques(tokens, causal):
    spec = fwd_sm90.variant(128, causal, tokens, varlen=True)
    check_varlen(*LENGTHS["odd"], 4, 2, 128, "bf16", causal, spec=spec)
    check_varlen(*LENGTHS["one_long"], 4, 2, 128, "bf16", causal, spec=spec)


@needs_sm90
@pytest.mark.parametrize("alibi", ["batch", "head"])
@pytest.mark.parametrize("tokens", ["ws_ov_s3", "ws_ov_ls_ps_s4_m192_n80"])
def test_alibi_bias_gemm(tokens, alibi):
    """Causal ALiBi with its column part from S's GEMM (bias_gemm) over packed rows: the slope of each
    sequence's tile (per-sequence slopes with "batch")."""
    spec = fwd_sm90.variant(128, True, tokens, varlen=True, alibi=True, bias_gemm=True)
    check_varlen(*LENGTHS["odd"], 4, 2, 128, "bf16", True, spec=spec, variant={"alibi": alibi})
    check_varlen(*LENGTHS["one_long"], 4, 2, 128, "bf16", True, spec=spec, variant={"alibi": alibi})


@needs_sm90
@pytest.mark.parametrize("ctas", [1, 3])
def test_persistent_few_ctas(ctas, monkeypatch):
    """More tiles per CTA than the SMs give (and fewer tiles than CTAs elsewhere in this file)."""
    monkeypatch.setenv("FLASHGEN_PERSIST_CTAS", str(ctas))
    testing.clear_caches()
    spec = fwd_sm90.variant(128, True, "ws_ps", varlen=True)
    check_varlen(*LENGTHS["odd"], 4, 2, 128, "bf16", True, spec=spec)
    testing.clear_caches()


@pytest.mark.parametrize("lengths", ["odd", "zeros", "one_long"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (100, 37)], ids=str)
def test_work_list(lengths, causal, window):
    """The device's list holds every (sequence, query block) once, most key blocks first (the host mirror's
    costs), and nothing else."""
    q_lens, k_lens = LENGTHS[lengths]
    q = torch.randn(sum(q_lens), 4, 128, device="cuda").to(torch.bfloat16)
    k = torch.randn(sum(k_lens), 2, 128, device="cuda").to(torch.bfloat16)
    pairs, spec = testing.varlen_work_list(q, k, k, _cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens), causal,
                                           window=window)
    mirror = varlen_work(q_lens, k_lens, spec.block_m, spec.block_n, Variant.of(causal, window, varlen=True))
    cost = {(s, m): c for c, s, m in mirror}
    got = [tuple(p) for p in pairs.tolist()]
    assert sorted(got) == sorted(cost), "the device's pairs are not every (sequence, block) once"
    costs = [cost[p] for p in got]
    assert costs == sorted(costs, reverse=True), "the device's list is not most costly first"


def test_empty():
    q = torch.randn(0, 4, 64, device="cuda").to(torch.bfloat16)
    cu = torch.zeros(1, dtype=torch.int32, device="cuda")
    out, lse = flashgen.attention_varlen(q, q[:, :2], q[:, :2], cu, cu, 0, 0, return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0)
    check_varlen([0, 0, 0], [0, 5, 0], 4, 2, 64)
    check_varlen([3, 0, 2], [0, 0, 0], 4, 2, 64, causal=True)


def test_deterministic():
    q_lens, k_lens = _random_lengths(12, 1000)
    torch.manual_seed(0)
    tq, tk = sum(q_lens), sum(k_lens)
    q = torch.randn(tq, 8, 128, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(tk, 2, 128, device="cuda").to(torch.bfloat16) for _ in range(2))
    args = (q, k, v, _cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
    first = flashgen.attention_varlen(*args, causal=True)
    for _ in range(3):
        assert torch.equal(flashgen.attention_varlen(*args, causal=True), first)


def test_work_list_shared_by_calls_and_kept_by_a_cuda_graph():
    """Calls back to back on one stream share its work list (each call's builder rewrites it after the
    last kernel has read it, also when a longer list grows it), a side stream has its own, and a CUDA
    graph captures a list of its own: replays between eager calls of other lengths give the captured
    lengths' rows."""
    def inputs(q_lens, k_lens):
        q = torch.randn(sum(q_lens), 4, 64, device="cuda").to(torch.bfloat16)
        k, v = (torch.randn(sum(k_lens), 2, 64, device="cuda").to(torch.bfloat16) for _ in range(2))
        return q, k, v, _cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens)

    calls = [inputs([300, 17, 129], [310, 17, 5]), inputs([5, 1000, 64, 77, 3], [5, 900, 64, 77, 300]),
             inputs([64], [64])]
    wants = []
    for args in calls:
        wants.append(flashgen.attention_varlen(*args, causal=True))
        torch.cuda.synchronize()
    outs = [flashgen.attention_varlen(*calls[i % 3], causal=True, check_values=False) for i in range(9)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        side_out = flashgen.attention_varlen(*calls[1], causal=True, check_values=False)
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        assert torch.equal(out, wants[i % 3]), f"call {i} of a burst"
    assert torch.equal(side_out, wants[1])

    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            static = flashgen.attention_varlen(*calls[0], causal=True, check_values=False)
    torch.cuda.current_stream().wait_stream(stream)
    eager = []
    for _ in range(2):
        eager.append(flashgen.attention_varlen(*calls[1], causal=True, check_values=False))
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, wants[0])
    assert all(torch.equal(out, wants[1]) for out in eager)


def test_value_checks():
    q = torch.randn(10, 4, 64, device="cuda").to(torch.bfloat16)
    k = torch.randn(12, 2, 64, device="cuda").to(torch.bfloat16)

    def call(cu_q, cu_k, mq=10, mk=12, **kw):
        cq = torch.tensor(cu_q, dtype=torch.int32, device="cuda")
        ck = torch.tensor(cu_k, dtype=torch.int32, device="cuda")
        return flashgen.attention_varlen(q, k, k, cq, ck, mq, mk, **kw)

    call([0, 4, 10], [0, 5, 12])
    for cu_q, cu_k, mq, mk, what in (([1, 4, 10], [0, 5, 12], 10, 12, r"cu_seqlens_q\[0\]"),
                                     ([0, 6, 4, 10], [0, 5, 6, 12], 10, 12, "non-decreasing"),
                                     ([0, 4, 9], [0, 5, 12], 10, 12, "packed length 10"),
                                     ([0, 4, 10], [0, 5, 12], 5, 12, "max_seqlen_q"),
                                     ([0, 4, 10], [0, 5, 12], 10, 6, "max_seqlen_k")):
        with pytest.raises(ValueError, match=what):
            call(cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match="seqused_k"):
        call([0, 4, 10], [0, 5, 12], seqused_k=torch.tensor([6, 1], dtype=torch.int32, device="cuda"))
    with pytest.raises(TypeError, match="int32"):
        flashgen.attention_varlen(q, k, k, torch.tensor([0, 10], device="cuda"), torch.tensor([0, 12], device="cuda"),
                                  10, 12)
    with pytest.raises(ValueError, match="device"):
        flashgen.attention_varlen(q, k, k, torch.tensor([0, 10], dtype=torch.int32),
                                  torch.tensor([0, 12], dtype=torch.int32, device="cuda"), 10, 12)
    with pytest.raises(ValueError, match="3-D"):
        flashgen.attention_varlen(q[None], k, k, torch.tensor([0, 10], dtype=torch.int32, device="cuda"),
                                  torch.tensor([0, 12], dtype=torch.int32, device="cuda"), 10, 12)
    with pytest.raises(ValueError, match="4-D"):  # a block table with packed k, v
        call([0, 4, 10], [0, 5, 12], block_table=torch.zeros(2, 1, dtype=torch.int32, device="cuda"))


def test_torch_compile():
    q_lens, k_lens = [113, 0, 64], [203, 5, 64]
    q = torch.randn(sum(q_lens), 4, 64, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(sum(k_lens), 2, 64, device="cuda").to(torch.bfloat16) for _ in range(2))
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)

    def f(q, k, v):
        return flashgen.attention_varlen(q, k, v, cu_q, cu_k, 113, 203, causal=True) * 2

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    assert torch.equal(compiled, eager)


def check_varlen_grads(q_lens, k_lens, hq=4, hk=2, d=128, dtype_name="bf16", causal=False, deterministic=False,
                       used=None, stored_k=None, variant=None):
    """One differentiable ``attention_varlen`` call: dq, dk, dv (and dsinks) against the fp32 reference's
    gradients sequence by sequence, the 2x rule over the whole call; gradients written everywhere (keys
    past seqused_k: 0)."""
    dtype = DTYPES[dtype_name]
    stored = stored_k or k_lens
    tq, tk = sum(q_lens), sum(stored)
    q = torch.randn(tq, hq, d, device="cuda").to(dtype).requires_grad_(True)
    k = torch.randn(tk, hk, d, device="cuda").to(dtype).requires_grad_(True)
    v = torch.randn(tk, hk, d, device="cuda").to(dtype).requires_grad_(True)
    cu_q, cu_k = _cu(q_lens), _cu(stored)
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda") if used is not None else None
    extra = variant_inputs(len(q_lens), hq, **(variant or {}))
    if extra.get("sinks") is not None:
        extra["sinks"].requires_grad_(True)
    dout = torch.randn(tq, hq, d, device="cuda").to(dtype)
    out = flashgen.attention_varlen(q, k, v, cu_q, cu_k, max(q_lens, default=0), max(stored, default=0),
                                    causal=causal, seqused_k=seqused, deterministic=deterministic, **extra)
    leaves = [q, k, v] + ([extra["sinks"]] if extra.get("sinks") is not None else [])
    grads = torch.autograd.grad(out, leaves, dout)
    for name, g in zip(("dq", "dk", "dv", "dsinks"), grads):
        assert torch.isfinite(g.float()).all(), f"non-finite {name}"
    scale = 1.0 / math.sqrt(d)
    errs, tols = [0.0] * len(leaves), [0.0] * len(leaves)
    ref_dsinks = None
    for s, (nq, nk) in enumerate(zip(q_lens, k_lens)):
        q0, k0 = int(cu_q[s]), int(cu_k[s])
        if nq == 0:  # no query: no gradient to the sequence's keys
            for g in grads[1:3]:
                assert g[k0:k0 + nk].abs().max().item() == 0 if nk else True
            continue
        if nk == 0:  # no key: no gradient to the sequence's queries (the sinks' gradient: dLSE only, none here)
            assert grads[0][q0:q0 + nq].abs().max().item() == 0
            continue
        qs = q[q0:q0 + nq].transpose(0, 1)[None].detach()
        ks, vs = (t[k0:k0 + nk].transpose(0, 1)[None].detach() for t in (k, v))
        ex = {n: t for n, t in extra.items()}
        if ex.get("alibi_slopes") is not None and ex["alibi_slopes"].dim() == 2:
            ex["alibi_slopes"] = ex["alibi_slopes"][s:s + 1]
        ref, tol = grad_tolerance(qs, ks, vs, dout[q0:q0 + nq].transpose(0, 1)[None], causal, scale, **ex)
        got = [grads[0][q0:q0 + nq], grads[1][k0:k0 + nk], grads[2][k0:k0 + nk]]
        for i in range(3):
            errs[i] = max(errs[i], (got[i].transpose(0, 1)[None].float() - ref[i]).abs().max().item())
            tols[i] = max(tols[i], tol[i])
        if len(leaves) == 4:  # the sinks' gradient sums over sequences
            ref_dsinks = ref[3] if ref_dsinks is None else ref_dsinks + ref[3]
            tols[3] = max(tols[3], tol[3])
    if used is not None:  # keys past seqused_k: gradient 0
        for s, (n_used, n_stored) in enumerate(zip(used, stored)):
            k0 = int(cu_k[s])
            for g in grads[1:3]:
                assert g[k0 + n_used:k0 + n_stored].abs().max().item() == 0 if n_stored > n_used else True
    if ref_dsinks is not None:
        errs[3] = (grads[3].float() - ref_dsinks).abs().max().item()
        tols[3] *= len(q_lens)
    for name, err, tol in zip(("dq", "dk", "dv", "dsinks"), errs, tols):
        assert err <= tol, f"{name}: max err {err:.3e} > tol {tol:.3e} (lengths {q_lens} / {k_lens})"


@pytest.mark.parametrize("lengths", ["odd", "zeros", "one_long", "equal"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 96, 192, 256])
def test_backward(lengths, causal, d):
    check_varlen_grads(*LENGTHS[lengths], 8, 2, d, "bf16", causal)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_deterministic(d, causal):
    q_lens, k_lens = LENGTHS["odd"]
    check_varlen_grads(q_lens, k_lens, 4, 2, d, "bf16", causal, deterministic=True)
    # Bitwise the same over runs.
    torch.manual_seed(1)
    tq, tk = sum(q_lens), sum(k_lens)
    q = torch.randn(tq, 4, d, device="cuda").to(torch.bfloat16).requires_grad_(True)
    k, v = (torch.randn(tk, 2, d, device="cuda").to(torch.bfloat16).requires_grad_(True) for _ in range(2))
    dout = torch.randn(tq, 4, d, device="cuda").to(torch.bfloat16)
    args = (q, k, v, _cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
    first = torch.autograd.grad(flashgen.attention_varlen(*args, causal=causal, deterministic=True), (q, k, v), dout)
    for _ in range(2):
        again = torch.autograd.grad(flashgen.attention_varlen(*args, causal=causal, deterministic=True), (q, k, v),
                                    dout)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_backward_random_lengths_gqa(dtype):
    q_lens, k_lens = _random_lengths(12, 1200)
    check_varlen_grads(q_lens, k_lens, 8, 2, 128, dtype, True)
    check_varlen_grads(q_lens, k_lens, 6, 1, 64, dtype, False)


def test_backward_seqused_k():
    check_varlen_grads([113, 64, 0, 300, 1], [203, 0, 17, 300, 1], 4, 2, 128, "bf16", True,
                       used=[203, 0, 17, 300, 1], stored_k=[400, 64, 50, 300, 239])


@pytest.mark.parametrize("variant", [{"window": (100, 37)}, {"softcap": 15.0}, {"alibi": "batch"}, {"sinks": True}],
                         ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_backward_variants(variant, d):
    check_varlen_grads([113, 1, 239, 512, 0, 700], [203, 239, 64, 512, 17, 700], 4, 2, d, "bf16", True,
                       variant=variant)


# ---- paged K/V: chunked prefill against a block table's pages ----

PAGED_LENGTHS = {
    "odd": ([113, 1, 239, 799, 0, 1023], [203, 239, 1, 803, 17, 1024]),
    "prefill": ([200, 64, 1, 300], [2200, 64, 1000, 301]),  # new tokens against a longer cache
}


@needs_sm90
@pytest.mark.parametrize("page", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_paged(page, causal, d):
    for lengths in PAGED_LENGTHS.values():
        check_varlen(*lengths, 8, 2, d, "bf16", causal, page=page)


@needs_sm90
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("no_cu_k", [False, True])
def test_paged_seqused_k(page, no_cu_k):
    q_lens, stored = [113, 64, 0, 300, 1], [400, 64, 50, 300, 239]
    used = [203, 0, 17, 300, 1]
    check_varlen(q_lens, used, 4, 2, 128, "bf16", True, used=used, stored_k=stored, page=page, no_cu_k=no_cu_k)


@needs_sm90
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 1)], ids=str)
def test_paged_random(dtype, heads):
    q_lens, k_lens = _random_lengths(12, 1500)
    k_lens = [max(a, b) for a, b in zip(q_lens, k_lens)]
    check_varlen(q_lens, k_lens, *heads, 128, dtype, True, page=random.choice([16, 32, 64, 128, 256]))


@needs_sm90
@pytest.mark.parametrize("variant", [{"window": (100, 37)}, {"softcap": 15.0}, {"alibi": "batch"}, {"sinks": True}],
                         ids=str)
def test_paged_variants(variant):
    check_varlen(*PAGED_LENGTHS["odd"], 4, 2, 128, "bf16", True, variant=variant, page=16)


@needs_sm90
@pytest.mark.parametrize("tokens", ["ws_ps", "ws_pp_kr_ps", "ws_ov_ls_ps_s4_m192_n80", "", "ws_s2_m192_n80"])
def test_paged_techniques(tokens):
    spec = fwd_sm90.variant(128, True, tokens, varlen=True)
    for page in (16, 256):
        paged = paged_spec(spec, page)
        check_varlen(*PAGED_LENGTHS["prefill"], 4, 2, 128, "bf16", True, spec=paged, page=page)
    if spec.warp_specialized:  # the rows gathered by cp.async instead (kv_gather)
        for page in (16, 64):
            paged = paged_spec(spec, page, gather=True)
            check_varlen(*PAGED_LENGTHS["prefill"], 4, 2, 128, "bf16", True, spec=paged, page=page)


@needs_sm90
def test_paged_deterministic_and_compile():
    q_lens, k_lens = [113, 0, 300], [400, 5, 300]
    q = torch.randn(sum(q_lens), 4, 128, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(sum(k_lens), 2, 128, device="cuda").to(torch.bfloat16) for _ in range(2))
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    (kc, vc), table = paged_cache((k, v), cu_k.tolist(), k_lens, 16)

    def f(q, kc, vc):
        return flashgen.attention_varlen(q, kc, vc, cu_q, cu_k, 300, 400, causal=True, block_table=table) * 2

    eager = f(q, kc, vc)
    for _ in range(3):
        assert torch.equal(f(q, kc, vc), eager)
    assert torch.equal(torch.compile(f, fullgraph=True)(q, kc, vc), eager)


@needs_sm90
def test_paged_value_checks():
    q = torch.randn(10, 4, 64, device="cuda").to(torch.bfloat16)
    kc = torch.randn(4, 16, 2, 64, device="cuda").to(torch.bfloat16)
    cq = torch.tensor([0, 4, 10], dtype=torch.int32, device="cuda")
    ck = torch.tensor([0, 20, 30], dtype=torch.int32, device="cuda")
    table = torch.tensor([[0, 1, -1], [2, -1, -1]], dtype=torch.int32, device="cuda")

    def call(cu_k=ck, bt=table, mk=20, cache=kc, **kw):
        return flashgen.attention_varlen(q, cache, cache, cq, cu_k, 6, mk, causal=True, block_table=bt, **kw)

    call()
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 7"):
        call(bt=torch.tensor([[0, 1, -1], [7, -1, -1]], dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = -1"):
        call(bt=torch.tensor([[0, -1, -1], [2, -1, -1]], dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="past its block-table row"):
        call(bt=table[:, :1], mk=20)
    with pytest.raises(ValueError, match="page size"):
        call(cache=torch.randn(4, 24, 2, 64, device="cuda").to(torch.bfloat16))
    with pytest.raises(ValueError, match="cu_seqlens_k or seqused_k"):
        call(cu_k=None)
    with pytest.raises(ValueError, match=r"block_table must be \(sequences=2"):
        call(bt=table[:1])
    with pytest.raises(TypeError, match="int32"):
        call(bt=table.long())
    with pytest.raises(UnsupportedError, match="no backward"):
        flashgen.attention_varlen(q.requires_grad_(), kc, kc, cq, ck, 6, 20, block_table=table)


@needs_sm90
def test_tuner_measures_a_varlen_key():
    """The tuner's objective on a varlen key: the default tile passes the per-sequence check, a time comes
    back for the packed call over the key's lengths, and the outcome is ok."""
    from flashgen import families, gpus
    from flashgen.problem import ProblemKey
    from flashgen.tuner.objective import MeasuredObjective

    key = ProblemKey("fwd", "sm_90a", "bf16", 128, True, 1024, "vl")
    spec = families.default_spec(key.replace(variant=""), gpus.get("h200").smem_per_block).with_tokens("vl")
    obj = MeasuredObjective(gpus.get("h200"))
    assert obj.check(spec) == ""
    outcome = obj(key, spec)
    assert outcome.status == "ok" and 0 < outcome.time_ms < 50, outcome
