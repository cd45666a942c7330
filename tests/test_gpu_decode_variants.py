"""GPU tier: flashgen.decode's variants (window, softcap, ALiBi, sinks) against the fp32 reference.

Rule (tests/gpu_util.py): max error against the fp32 reference on upcast inputs <= 2x the max error of
the same reference computed in the input dtype, + a rounding-sized atol (``flashgen.reference.allowance``); the LSE (which includes the sink) within 1e-3
relative or that rule. Fresh random inputs (tests/test_gpu_decode.py's cases: ragged lengths, one of
them 0, NaN past every length and in the unused pages), outputs from freed NaN-filled memory, each
variant alone and combined, contiguous and paged caches, with and without appended tokens, GQA, split
counts including 1 (the one-split epilogue adds the sink) and past the blocks (empty splits). With a
window, the cache rows before the window (before its first key rounded down to 128, the largest block)
are NaN too, and the pages wholly before it are remapped to a NaN page: a kernel that reads a key
before the window shows.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)"),
]

from gpu_util import DTYPES, check_decode_lse, check_decode_output, flat_cache, make_case, poison  # noqa: E402

from flashgen.bench.timing import graph_us  # noqa: E402
from flashgen.reference import allowance, reference  # noqa: E402


def variant_kwargs(b, hq, window=None, softcap=0.0, alibi=None, sinks=False) -> dict:
    """decode's variant keywords with fresh random tensors: ``alibi`` None, "head" or "batch";
    ``sinks`` False, True (fp32) or a torch dtype."""
    kw = {"window": window, "softcap": softcap}
    if alibi is not None:
        shape = (hq,) if alibi == "head" else (b, hq)
        kw["alibi_slopes"] = torch.rand(shape, device="cuda") * 0.5 + 0.01
    if sinks is not False:
        kw["sinks"] = (torch.randn(hq, device="cuda") * 2).to(torch.float32 if sinks is True else sinks)
    return kw


def variant_reference(case, scale, kw, dtype=torch.float32):
    """(out (b, nq, hq, d), lse (b, hq, nq)) per sequence through flashgen.reference (bottom-right
    offsets over the sequence's own keys, appended ones included), computed in ``dtype``."""
    q = case["q"]
    b, nq, hq, d = q.shape
    outs, lses = [], []
    for i, n in enumerate(case["lens"]):
        k, v = case["k_flat"][i, :n], case["v_flat"][i, :n]
        if case["k_new"] is not None:
            k, v = torch.cat([k, case["k_new"][i]]), torch.cat([v, case["v_new"][i]])
        slopes = kw.get("alibi_slopes")
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[i:i + 1]
        out, lse = reference(q[i:i + 1].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2), True,
                             scale, dtype, window=kw["window"], softcap=kw["softcap"], alibi_slopes=slopes,
                             sinks=kw.get("sinks"))
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


def poison_before_window(case, left):
    """NaN in the kernel's cache rows before each sequence's window (before its first key rounded down to
    128, a multiple of every block_n): contiguous rows directly, and for a paged cache every page wholly
    before that key remapped to a spare NaN page (so neither its rows nor its block-table entry may be
    used). The reference keeps the clean k_flat/v_flat."""
    nq = case["q"].shape[1]
    n_new = nq if case["k_new"] is not None else 0
    if case["page"] is not None:
        bt = case["block_table"]
        used = set(bt[bt >= 0].tolist())
        spare = next(p for p in range(case["k_cache"].shape[0]) if p not in used)  # all NaN (make_case)
    for i, n in enumerate(case["lens"]):
        upto = max(0, n + n_new - nq - left) // 128 * 128
        if not upto:
            continue
        if case["page"] is None:
            case["k_cache"][i, :upto] = float("nan")
            case["v_cache"][i, :upto] = float("nan")
        else:
            bt[i, :upto // case["page"]] = spare


def check_variant_case(b, nq, L, d, hq, hk, page, with_new, dtype_name, options, num_splits_list=(None, 1)):
    """One case: every split count of ``num_splits_list`` meets the rule against the variant reference,
    finite outputs, the LSE's -inf pattern (none with sinks), and the appended rows exactly in the cache."""
    import flashgen

    dtype = DTYPES[dtype_name]
    case = make_case(b, nq, L, d, hq, hk, page, with_new, dtype)
    kw = variant_kwargs(b, hq, **options)
    scale = 1.0 / math.sqrt(d)
    ref, ref_lse = variant_reference(case, scale, kw)
    low, low_lse = variant_reference(case, scale, kw, dtype)
    tol = allowance(low, ref, dtype)
    window = kw["window"]
    if window is not None and window[0] >= 0:
        poison_before_window(case, window[0])
    for ns in num_splits_list:
        poison(b * nq * hq * (d + 1) * 4 * 64)
        out, lse = flashgen.decode(case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"],
                                   case["block_table"], case["k_new"], case["v_new"], num_splits=ns, return_lse=True,
                                   check_values=page is None, **kw)  # (the remapped pages: no value check)
        torch.cuda.synchronize()
        masked = check_decode_output(out, lse, case["q"], ref, ref_lse, tol, ns)
        if "sinks" in kw:
            assert not masked.any()
        check_decode_lse(lse, ref_lse, low_lse, masked, ns)
    if with_new:
        after_k, after_v = flat_cache(case, "k_cache"), flat_cache(case, "v_cache")
        for i, n in enumerate(case["lens"]):
            assert torch.equal(after_k[i, n:n + nq], case["k_new"][i]), "appended K rows differ"
            assert torch.equal(after_v[i, n:n + nq], case["v_new"][i]), "appended V rows differ"


ALL = dict(window=(300, 0), softcap=30.0, alibi="batch", sinks=True)
# (variant options, batch, seqlen_q, cache length, d, heads_q, heads_kv, page size or None, append, dtype)
CASES = [
    (dict(window=(4096, 0)), 2, 1, 20000, 128, 32, 8, None, False, "bf16"),
    (dict(window=(4096, 0)), 3, 1, 20000, 128, 32, 8, 64, True, "bf16"),
    (dict(window=(100, -1)), 3, 3, 3001, 128, 8, 2, 16, True, "fp16"),
    (dict(window=(0, 0)), 3, 4, 777, 64, 8, 8, None, True, "bf16"),      # each token sees its own key only
    (dict(window=(37, 0)), 2, 64, 5000, 256, 4, 1, 256, False, "bf16"),  # a window shorter than the new tokens
    (dict(softcap=50.0), 3, 1, 4096, 128, 32, 8, None, False, "bf16"),
    (dict(softcap=5.0), 3, 3, 1001, 64, 4, 4, 32, True, "fp16"),
    (dict(alibi="head"), 3, 1, 3000, 128, 16, 2, None, True, "bf16"),
    (dict(alibi="batch"), 3, 16, 2049, 128, 8, 1, 64, False, "bf16"),
    (dict(sinks=True), 3, 1, 5000, 128, 32, 8, None, False, "bf16"),
    (dict(sinks=torch.bfloat16), 3, 2, 1300, 96, 8, 2, 128, True, "bf16"),
    (dict(sinks=torch.float16), 3, 3, 200, 32, 8, 8, 16, False, "fp16"),
    (dict(window=(512, 0), sinks=True), 3, 1, 9000, 128, 32, 8, 32, True, "bf16"),
    (dict(softcap=30.0, alibi="head"), 2, 1, 6000, 128, 32, 8, None, False, "bf16"),
    (ALL, 3, 1, 4500, 128, 32, 8, None, True, "bf16"),
    (ALL, 3, 3, 4500, 128, 8, 2, 64, True, "fp16"),
    (ALL, 2, 1, 1000, 64, 8, 1, 16, False, "bf16"),
    (ALL, 2, 2, 800, 256, 4, 2, None, True, "bf16"),
]


def _id(c):
    opts = "_".join(f"{k}{'' if v is True else v}".replace(" ", "").replace("torch.", "") for k, v in c[0].items())
    return f"{opts}-b{c[1]}_q{c[2]}_L{c[3]}_d{c[4]}_h{c[5]}-{c[6]}_{'p' + str(c[7]) if c[7] else 'contig'}" \
           f"_{'new' if c[8] else 'nonew'}_{c[9]}"


@pytest.mark.parametrize("options,b,nq,L,d,hq,hk,page,with_new,dtype", CASES, ids=[_id(c) for c in CASES])
def test_variant_matches_reference(options, b, nq, L, d, hq, hk, page, with_new, dtype):
    """The default split count, one split (the epilogue's sink) and 7 splits (the merge's) meet the rule."""
    check_variant_case(b, nq, L, d, hq, hk, page, with_new, dtype, options, num_splits_list=(None, 1, 7))


@pytest.mark.parametrize("options", [dict(window=(64, 0)), dict(sinks=True), ALL], ids=["window", "sinks", "all"])
def test_variant_with_many_splits(options):
    """Split counts past the key blocks (most splits empty; with a window, empty before it): the merge
    weighs them nothing and adds the sink once."""
    check_variant_case(2, 1, 700, 128, 8, 2, None, False, "bf16", options, num_splits_list=(40, 300))
    check_variant_case(2, 3, 300, 64, 4, 4, 16, True, "bf16", options, num_splits_list=(64,))


@pytest.mark.parametrize("fused", [True, False], ids=["fused_combine", "combine_kernel"])
def test_sinks_on_both_combine_paths(monkeypatch, fused):
    """decode_combine has no sinks: with FUSED_COMBINE off a call with sinks still merges in the kernel
    (and adds the sink once), one without them takes the combine kernel; both meet the rule."""
    from flashgen import testing
    from flashgen.api import decoding

    monkeypatch.setattr(decoding, "FUSED_COMBINE", fused)
    testing.plans("decode").clear()
    try:
        check_variant_case(3, 2, 3000, 128, 16, 4, 32, True, "bf16", dict(sinks=True, window=(999, 0)),
                           num_splits_list=(5,))
        check_variant_case(3, 2, 3000, 128, 16, 4, None, True, "bf16", dict(softcap=20.0), num_splits_list=(5,))
        plans = [p for p in testing.plans("decode").values() if p.kernel is not None]
        assert [p.combine is not None for p in plans] == [False, not fused]
    finally:
        testing.plans("decode").clear()


def test_empty_sequences_with_sinks():
    """Every length 0, no new tokens: output 0; the LSE is -inf, or the sink with sinks (split or not)."""
    import flashgen

    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.zeros(2, dtype=torch.int32, device="cuda")
    sinks = torch.randn(8, device="cuda")
    for ns in (None, 1, 4):
        out, lse = flashgen.decode(q, k, k, lens, num_splits=ns, return_lse=True, sinks=sinks, window=(16, 0))
        # (the merge takes the sink through base 2: equal to rounding)
        assert torch.all(out == 0) and torch.allclose(lse, sinks[None, :, None].expand(2, 8, 1), rtol=1e-6, atol=1e-6)
        out, lse = flashgen.decode(q, k, k, lens, num_splits=ns, return_lse=True, softcap=10.0, window=(16, 0))
        assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_a_4096_key_window_reads_only_the_window():
    """A 4096-key window over a 128k-key cache (bf16, d=128, GQA 32/8, one new token): the plan's splits
    cover only the window (from its first key rounded down to a block), the heuristic splits the window's
    blocks (fewer splits than over the whole cache), the cache before the window is NaN and the output is
    right; and it runs much faster than the plain decode over the whole cache."""
    import flashgen
    from flashgen import testing
    from flashgen.api.device import Device
    from flashgen.families import decode as dk

    b, L, hq, hk, d, left = 1, 131072, 32, 8, 128, 4096
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(b, L, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(b, L, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    first = (L - 1 - left) // 128 * 128
    ref, _ = reference(q.transpose(1, 2), k[:, first:].transpose(1, 2), v[:, first:].transpose(1, 2), True,
                       1 / math.sqrt(d), window=(left, 0))
    low, _ = reference(q.transpose(1, 2), k[:, first:].transpose(1, 2), v[:, first:].transpose(1, 2), True,
                       1 / math.sqrt(d), torch.bfloat16, window=(left, 0))
    plans = testing.plans("decode")
    plans.clear()
    plain = flashgen.decode(q, k, v, lens)  # the plain plan, for its split count and time
    plain_plan = next(p for p in plans.values() if p.kernel is not None)
    plans.clear()
    k[:, :first], v[:, :first] = float("nan"), float("nan")
    out = flashgen.decode(q, k, v, lens, window=(left, 0))
    torch.cuda.synchronize()
    plan = next(p for p in plans.values() if p.kernel is not None)
    assert torch.isfinite(out.float()).all()
    tol = allowance(low, ref, q.dtype)
    assert (out.float().transpose(1, 2) - ref).abs().max().item() <= tol
    ranges = plan.key_ranges(L, 1, hq // hk)
    read = sum(max(0, e - s) for s, e in ranges)
    assert min(s for s, e in ranges if e > s) >= first and max(e for s, e in ranges) == L
    assert read <= left + 1 + plan.spec.block_n - 1
    assert plan.splits <= plain_plan.splits
    dev = Device.of(torch.cuda.current_device())
    occ = dk.ctas_per_sm(plan.spec.smem_bytes(), plan.spec.warps * 32, plan.kernel.binary.report.registers or 255,
                         dev.smem_per_sm)
    assert plan.splits == dk.num_splits_heuristic(b, hk, 1, dk.window_keys(L, 1, left), plan.spec.block_n, dev.sms,
                                                  occ)
    del plain

    # GPU time (calls replayed back to back from a CUDA graph): a windowed call is shorter than its own host
    # work, so events around host-issued calls would time the host.
    k[:, :first], v[:, :first] = 0.0, 0.0
    t_window = graph_us(lambda i: flashgen.decode(q, k, v, lens, window=(left, 0), check_values=False), 20)
    t_plain = graph_us(lambda i: flashgen.decode(q, k, v, lens, check_values=False), 20)
    assert t_window < t_plain / 4, (t_window, t_plain)  # 32x fewer bytes; launch and merge costs remain
