"""Helpers the GPU-tier tests share (tests/test_gpu_*.py): inputs, the forward's correctness check, the
decode tests' caches, the parallel precompile step.

The forward's rule (the FlashAttention repository's): flashgen's max error against the fp32 reference
on upcast inputs must be at most 2x the max error of the same reference computed in the input dtype,
+ a rounding-sized atol (``flashgen.reference.allowance``). Imported by the GPU test modules after their
``pytest.importorskip("torch")``; nothing here runs at import but the definitions.
"""
from __future__ import annotations

import math
from multiprocessing.pool import ThreadPool

import pytest
import torch

from flashgen.reference import allowance, reference

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Odd and even seqlen pairs, nq > nk and nq < nk, one query, one key.
SEQLENS = [(113, 203), (128, 217), (108, 256), (256, 512), (512, 256), (1023, 1024), (1024, 1023),
           (2048, 2048), (1, 239), (239, 1)]


def is_sm90() -> bool:
    """Whether the current CUDA device is an sm_90 GPU (H100/H200: the Hopper families run there)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def make_inputs(b, hq, hk, nq, nk, d, dtype, layout="bhsd", scale=1.0):
    """Fresh random normal q, k, v (times ``scale``) on the GPU, in ``layout`` ("bhsd" or "bshd")."""
    def rnd(h, n):
        shape = (b, h, n, d) if layout == "bhsd" else (b, n, h, d)
        return (torch.randn(shape, device="cuda", dtype=torch.float32) * scale).to(dtype)

    return rnd(hq, nq), rnd(hk, nk), rnd(hk, nk)


def to_bhsd(t, layout):
    return t if layout == "bhsd" else t.transpose(1, 2)


def poison_output(like):
    """Fill a block the size of ``like`` with NaN and free it, just before a call allocates its output
    (the first allocation of every forward path): the caching allocator hands that block back, so an
    element the kernel never writes shows as non-finite. Best effort: the allocator may pick another
    free block of that size, whose stale values (another call's) would then most likely fail the
    tolerance instead."""
    junk = torch.full(like.shape, float("nan"), device=like.device, dtype=like.dtype)
    del junk


def variant_inputs(b, hq, window=None, softcap=0.0, alibi=None, sinks=False) -> dict:
    """The variant keywords of one call, with fresh random tensors: ``alibi`` None, "head" ((heads,)
    slopes) or "batch" ((batch, heads)); ``sinks`` False, True (fp32) or a torch dtype."""
    out = {"window": window, "softcap": softcap}
    if alibi is not None:
        shape = (hq,) if alibi == "head" else (b, hq)
        out["alibi_slopes"] = torch.rand(shape, device="cuda", dtype=torch.float32) * 0.5 + 0.01
    if sinks is not False:
        dtype = torch.float32 if sinks is True else sinks
        out["sinks"] = (torch.randn(hq, device="cuda", dtype=torch.float32) * 2).to(dtype)
    return out


def check(b, hq, hk, nq, nk, d, dtype_name, causal, layout="bhsd", magnitude=1.0, spec=None, algorithm="v2",
          poison=True, variant=None):
    """One ``flashgen.attention`` call against the rule; returns (out, lse). ``variant``: the keywords
    of ``variant_inputs`` (window, softcap, ALiBi slopes, sinks), for the kernel and the reference.

    The output is poisoned first (``poison_output``); it must have q's shape and dtype, be finite
    everywhere and meet the 2x rule. The LSE must be -inf exactly where the row sees no key and
    elsewhere within 1e-3 (relative to its magnitude, at least 1) of the fp32 reference's
    (``algorithm="standard"``, which stores S in the input dtype: the 2x rule, if looser)."""
    import flashgen

    dtype = DTYPES[dtype_name]
    q, k, v = make_inputs(b, hq, hk, nq, nk, d, dtype, layout, magnitude)
    scale = 1.0 / math.sqrt(d)
    if poison:
        poison_output(q)
    extra = variant_inputs(b, hq, **(variant or {}))
    out, lse = flashgen.attention(q, k, v, causal=causal, layout=layout, return_lse=True, spec=spec,
                                  algorithm=algorithm, **extra)
    torch.cuda.synchronize()
    qb, kb, vb = (to_bhsd(t, layout) for t in (q, k, v))
    ref, ref_lse = reference(qb, kb, vb, causal, scale, torch.float32, **extra)
    low, low_lse = reference(qb, kb, vb, causal, scale, dtype, **extra)
    got = to_bhsd(out, layout).float()
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(got).all(), "non-finite output (unwritten or NaN)"
    err = (got - ref).abs().max().item()
    tol = allowance(low, ref, dtype)
    assert err <= tol, f"max err {err:.3e} > tol {tol:.3e}"
    # LSE: -inf exactly where the row sees no key, else close to the fp32 reference.
    masked = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), masked)
    if (~masked).any():
        lse_err = (lse[~masked] - ref_lse[~masked]).abs().max().item()
        lse_tol = 1e-3 * max(1.0, ref_lse[~masked].abs().max().item())
        # S stored in the input dtype (algorithm "standard"), or a variant's transformed scores (a softcap's
        # tanh: a row with one key has the capped score as its LSE): the 2x rule, as for the output.
        if algorithm == "standard" or variant:
            lse_tol = max(lse_tol, 2 * (low_lse[~masked] - ref_lse[~masked]).abs().max().item() + 1e-5)
        assert lse_err <= lse_tol, f"lse err {lse_err:.3e} > tol {lse_tol:.3e}"
    return out, lse


def precompile_skipped(request) -> bool:
    """Whether the GPU modules skip their parallel precompile step (conftest's ``--no-precompile``: a
    ``-k`` subset compiles lazily; False where the option is not registered, e.g. ``--noconftest``)."""
    return bool(request.config.getoption("--no-precompile", default=False))


def warm(specs, tmp_path_factory, pick=None) -> None:
    """Compile ``specs`` in parallel (NVRTC releases the GIL) and load them into the process's kernel
    cache, so the tests only find them there. The compiles go to a private FLASHGEN_HOME: a module
    fixture runs before conftest gives each test its own empty one, and a binary left in the caller's
    home would be compiled again by the first test that loads it.

    ``pick(verify)``: a callable returning more specs, dispatch's picks for the module's calls. It runs
    twice in that home: unverified first (compiled in parallel with ``specs``), then as the launch paths
    ask (``verify=True``: dispatch's resource check compiles, now from the cache; a tile it refuses
    gives way to the rule's next one, compiled then). A spec that fails to build or load is left to the
    test that uses it to report."""
    from flashgen.codegen import build, load

    def one(spec):
        try:
            build(spec)
        except Exception:  # noqa: BLE001 -- the test that uses it reports it
            pass

    def build_all(todo):
        with ThreadPool(8) as pool:
            pool.map(one, sorted(todo, key=lambda s: s.name))

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHGEN_HOME", str(tmp_path_factory.mktemp("gpu_warm")))
        mp.delenv("FLASHGEN_NO_COMPILE", raising=False)
        done = set(specs) | (set(pick(False)) if pick is not None else set())
        build_all(done)
        if pick is not None:
            verified = set(pick(True))
            build_all(verified - done)
            done |= verified
        index = torch.cuda.current_device()
        for spec in sorted(done, key=lambda s: s.name):
            try:
                load(spec, index)
            except Exception:  # noqa: BLE001 -- as above
                pass


# ---------------------------------------------------------------- decode (test_gpu_decode*.py)


def make_case(b, nq, L, d, hq, hk, page, with_new, dtype, lens=None, device="cuda"):
    """Inputs for one case: ragged lengths (the longest L, one 0), a NaN-padded cache, a paged copy."""
    n_new = nq if with_new else 0
    if lens is None:
        lens = [L, max(0, L // 3 - 5), 0][:b] if b <= 3 else [L] + [max(0, L - 17 * i) for i in range(1, b)]
    cap = L + n_new
    if page:
        cap = -(-cap // page) * page
    k_flat = torch.full((b, cap, hk, d), float("nan"), device=device, dtype=dtype)
    v_flat = torch.full_like(k_flat, float("nan"))
    for i, n in enumerate(lens):
        k_flat[i, :n] = torch.randn(n, hk, d, device=device).to(dtype)
        v_flat[i, :n] = torch.randn(n, hk, d, device=device).to(dtype)
    case = dict(q=torch.randn(b, nq, hq, d, device=device).to(dtype),
                cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device), lens=lens, page=page,
                k_flat=k_flat, v_flat=v_flat, k_new=None, v_new=None)
    if with_new:
        case["k_new"] = torch.randn(b, nq, hk, d, device=device).to(dtype)
        case["v_new"] = torch.randn(b, nq, hk, d, device=device).to(dtype)
    if page:
        max_pages = cap // page
        num_pages = b * max_pages + 3
        perm = torch.randperm(num_pages, device=device).to(torch.int32)
        bt = torch.full((b, max_pages), -1, dtype=torch.int32, device=device)
        k_pages = torch.full((num_pages, page, hk, d), float("nan"), device=device, dtype=dtype)
        v_pages = torch.full_like(k_pages, float("nan"))
        for i, n in enumerate(lens):
            used = -(-(n + n_new) // page)
            ids = perm[i * max_pages: i * max_pages + used]
            bt[i, :used] = ids
            k_pages[ids.long()] = k_flat[i, :used * page].view(used, page, hk, d)
            v_pages[ids.long()] = v_flat[i, :used * page].view(used, page, hk, d)
        case.update(k_cache=k_pages, v_cache=v_pages, block_table=bt)
    else:
        case.update(k_cache=k_flat.clone(), v_cache=v_flat.clone(), block_table=None)
    return case


def poison(nbytes):
    junk = torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")
    del junk


def bits(t):
    return t.view(torch.int16)


def flat_cache(case, name):
    """The cache as (b, cap, hk, d), gathered back through the block table for a paged cache."""
    cache = case[name]
    if case["page"] is None:
        return cache
    bt, page = case["block_table"], case["page"]
    out = torch.full_like(case["k_flat"], float("nan"))
    n_new = case["q"].shape[1] if case["k_new"] is not None else 0
    for i, n in enumerate(case["lens"]):
        used = -(-(n + n_new) // page)
        out[i, :used * page] = cache[bt[i, :used].long()].reshape(used * page, *cache.shape[2:])
    return out


def decode_reference(case, scale, dtype=torch.float32, score_mod=None, mask_mod=None):
    """(out (b, nq, hq, d), lse (b, hq, nq)) in fp32 of a ``make_case`` decode case, scores in ``dtype``:
    bottom-right causal, then (user mods) ``score_mod`` on the scores (in fp32) and ``mask_mod`` hiding more,
    both as written on whole tensors, with q_idx the new token's position (token i of nq at i + L - nq)
    and kv_idx the key's."""
    q = case["q"]
    b, nq, hq, d = q.shape
    hk = case["k_flat"].shape[2]
    outs, lses = [], []
    for i, n in enumerate(case["lens"]):
        k, v = case["k_flat"][i, :n], case["v_flat"][i, :n]
        if case["k_new"] is not None:
            k, v = torch.cat([k, case["k_new"][i]]), torch.cat([v, case["v_new"][i]])
        lt = k.shape[0]
        qq = q[i].transpose(0, 1).to(dtype)                                   # (hq, nq, d)
        kk = k.transpose(0, 1).to(dtype).repeat_interleave(hq // hk, dim=0)   # (hq, lt, d)
        vv = v.transpose(0, 1).to(dtype).repeat_interleave(hq // hk, dim=0)
        s = torch.matmul(qq, kk.transpose(-1, -2)) * scale
        qi = torch.arange(nq, device=q.device)[:, None] + (lt - nq)
        j = torch.arange(lt, device=q.device)[None, :]
        seen = j <= qi
        if score_mod is not None or mask_mod is not None:
            h, bi = torch.arange(hq, device=q.device)[:, None, None], torch.tensor(i, device=q.device)
            if score_mod is not None:
                s = score_mod(s.float(), bi, h, qi[None], j[None]).to(dtype)
            if mask_mod is not None:
                seen = seen & mask_mod(bi, h, qi[None], j[None])
        s = s.masked_fill(~seen, float("-inf"))
        lses.append(torch.logsumexp(s.float(), dim=-1))
        p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
        outs.append(torch.matmul(p.to(dtype), vv).float().transpose(0, 1))
    return torch.stack(outs), torch.stack(lses)


def check_decode_output(out, lse, q, ref, ref_lse, tol, ns):
    """One flashgen.decode result against its reference: q's shape and dtype, the LSE's shape, finite, the
    output within ``tol``, the LSE -inf exactly where the reference's is, no NaN. Returns the -inf mask."""
    b, nq, hq, _ = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, hq, nq)
    got = out.float()
    assert torch.isfinite(got).all(), f"non-finite output (num_splits={ns})"
    err = (got - ref).abs().max().item()
    assert err <= tol, f"num_splits={ns}: max err {err:.3e} > tol {tol:.3e}"
    masked = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), masked), f"num_splits={ns}: LSE -inf pattern differs"
    assert not torch.isnan(lse).any()
    return masked


def capture(fn):
    """(graph, outputs): ``fn()`` captured in a CUDA graph on a side stream (its first call, the compile,
    load and plan, already made outside the capture, as a graph needs)."""
    g, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(g):
            out = fn()
    torch.cuda.current_stream().wait_stream(stream)
    return g, out


def check_decode_lse(lse, ref_lse, low_lse, masked, ns):
    """The LSE of the rows that see a key, within 1e-3 of the fp32 reference's (relative to its magnitude,
    at least 1) or the 2x rule against ``low_lse`` (the reference in the input dtype), if looser."""
    if (~masked).any():
        lse_err = (lse[~masked] - ref_lse[~masked]).abs().max().item()
        lse_tol = max(1e-3 * max(1.0, ref_lse[~masked].abs().max().item()),
                      2 * (low_lse[~masked] - ref_lse[~masked]).abs().max().item() + 1e-5)
        assert lse_err <= lse_tol, f"num_splits={ns}: lse err {lse_err:.3e} > tol {lse_tol:.3e}"


# ---- user mods (flashgen.mods): FlexAttention's examples, for the mods' forward and backward tiers


def banded_mask(b, hq, nq, nk):
    """A mask_mod whose rows each see one run of keys that differs per head and per batch (a window per head,
    shifted per batch, bottom-right aligned): row bounds with strides in rows of both."""
    wins = torch.randint(0, 400, (hq,), device="cuda", dtype=torch.int32)
    shift = torch.randint(0, 50, (b,), device="cuda", dtype=torch.int32)
    diag = torch.tensor([nk - nq], device="cuda", dtype=torch.int32)

    def banded(b_, h, q, kv):
        return (kv <= q + diag[0]) & (kv >= q + diag[0] - wins[h] - shift[b_])
    return banded


def example_mods(b, hq, nq, nk):
    """name -> (score_mod, mask_mod) of FlexAttention's examples, with fresh captured tensors."""
    dev = "cuda"
    slopes = torch.rand(hq, device=dev) * 0.5 + 0.01
    rel = torch.randn(hq, nq + nk - 1, device=dev)
    rel16 = torch.randn(hq, nq + nk - 1, device=dev).to(torch.bfloat16)
    n = max(nq, nk)
    doc = torch.sort(torch.randint(0, 4, (n,), device=dev, dtype=torch.int32)).values
    prefix = torch.randint(0, max(1, nk), (b,), device=dev, dtype=torch.int64)
    blocks = torch.rand(-(-nq // 128), -(-nk // 128), device=dev) < 0.5
    # (offsets that depend on the sizes are captured, not constants: a constant is part of the mod's graph,
    # and each new one compiles a new kernel)
    diag = torch.tensor([nk - nq], device=dev, dtype=torch.int32)
    last = torch.tensor([nk - 1], device=dev, dtype=torch.int32)

    def causal(b_, h, q, kv):
        return q + diag[0] >= kv

    def sliding(b_, h, q, kv):
        return (q + diag[0] >= kv) & (q + diag[0] - kv <= 64)

    def prefix_lm(b_, h, q, kv):
        return (kv <= prefix[b_]) | (q + diag[0] >= kv)

    def document(b_, h, q, kv):
        return doc[q] == doc[kv]

    def block_sparse(b_, h, q, kv):
        return blocks[q // 128, kv // 128]

    def alibi(score, b_, h, q, kv):
        return score - slopes[h] * (q + diag[0] - kv).abs()

    def alibi_flex(score, b_, h, q, kv):  # FlexAttention's spelling (no |.|): a bias linear in kv without a mask
        return score + (kv - q) * slopes[h]

    def softcap(score, b_, h, q, kv):
        return 30.0 * torch.tanh(score / 30.0)

    def relative(score, b_, h, q, kv):
        return score + rel[h, q - kv + last[0]]

    def relative_bf16(score, b_, h, q, kv):
        return score + rel16[h, q - kv + last[0]]

    return {"causal": (None, causal), "sliding": (None, sliding), "prefix_lm": (None, prefix_lm),
            "document": (None, document), "block_sparse": (None, block_sparse), "alibi": (alibi, None),
            "alibi_flex": (alibi_flex, None),
            "softcap": (softcap, None), "relative": (relative, None), "relative_bf16": (relative_bf16, None),
            "alibi_causal": (alibi, causal), "softcap_document": (softcap, document)}


MOD_NAMES = ["causal", "sliding", "prefix_lm", "document", "block_sparse", "alibi", "alibi_flex", "softcap", "relative",
             "relative_bf16", "alibi_causal", "softcap_document"]  # the keys of example_mods


def warm_mods(request, tmp_path_factory, calls, backward: bool = False, families=("fwd_sm90",)) -> None:
    """A mods module's precompile: dispatch's kernels for ``calls`` ((mod names, head dim, dtype, query
    lengths), ...) of ``example_mods``, the forward's at each length (and the causal key's for masks) in
    each of ``families`` that runs here, with ``backward`` the backward's dK/dV kernel too; compiled in
    parallel (``warm``)."""
    families = [f for f in families if f != "fwd_sm90" or is_sm90()]
    if precompile_skipped(request) or not families:
        return
    from flashgen import dispatch, mods
    from flashgen.api.device import Device
    from flashgen.api.modcall import mod_spec
    from flashgen.problem import ProblemKey

    dev = Device.of(torch.cuda.current_device())

    def pick(verify):
        out = set()
        for names, d, dtype, lengths in calls:
            for name in names:
                score, mask = example_mods(2, 4, 64, 64)[name]
                pair = mods.pair(mods.trace_score_mod(score) if score else None,
                                 mods.trace_mask_mod(mask) if mask else None)
                mods.register(pair)
                out |= {mod_spec(dtype, d, nq, dev, pair, verify, causal_like, family, rows) for nq in lengths
                        for causal_like in ((False, True) if mask else (False,)) for family in families
                        for rows in ((False, True) if mask else (False,))}
                if backward and is_sm90():
                    key = ProblemKey("bwd_dkdv", dev.arch, dtype, d, False, 1024, "")
                    out.add(dispatch.mod_backward_spec(key, dev.smem_budget, mods.token_number(pair), verify))
        return out
    warm([], tmp_path_factory, pick)
