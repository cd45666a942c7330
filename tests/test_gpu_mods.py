"""GPU tier for user mods (flashgen.mods, api.modcall): FlexAttention's example mods in the forward, on
fwd_sm90 (sm_90a's pick) and fwd_v2 (the other GPUs'; forced here through ``dispatch.mod_family``).

Each call against the fp32 reference with the 2x rule: the reference calls the mod functions as
written on the whole score matrix (``flashgen.reference``), the kernel runs their traced graphs; the
output is poisoned first and must be written everywhere; the LSE is -inf exactly where a row sees no
key. Odd sizes, GQA, both layouts, fp16 and bf16, dispatch's tile at each size, block masks made by
the call and passed in (and reused), and one comparison with torch's FlexAttention itself.
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
from flashgen.reference import allowance, reference  # noqa: E402
from gpu_util import (MOD_NAMES, banded_mask, example_mods, is_sm90, make_inputs, poison_output, to_bhsd,  # noqa: E402
                      warm_mods)

needs_sm90 = pytest.mark.skipif(not is_sm90(), reason="user mods run on fwd_sm90 (an sm_90 GPU)")
FAMILIES = ["fwd_sm90", "fwd_v2"]

SEQLENS = [(1, 1), (113, 203), (1, 239), (239, 1), (799, 3), (1023, 1024), (2048, 2048)]


# (mods, head dim, dtype, query lengths) of the tests below: their kernels are compiled in parallel first.
CALLS = [(MOD_NAMES, 128, "bf16", [nq for nq, _ in SEQLENS] + [1000, 777]),
         (["causal", "document", "alibi", "alibi_causal", "softcap_document"], 64, "fp16", [113, 799, 1023]),
         (["causal", "document", "alibi", "alibi_causal", "softcap_document"], 256, "fp16", [113, 799, 1023])]


@pytest.fixture(scope="module", autouse=True)
def _precompile(request, tmp_path_factory):
    warm_mods(request, tmp_path_factory, CALLS, families=FAMILIES)


@pytest.fixture(params=FAMILIES)
def family(request, monkeypatch):
    """The forward family the calls run on: dispatch's choice, or fwd_v2 forced (a fresh plan cache, whose
    plans do not record the family)."""
    from flashgen import dispatch
    from flashgen.api.plans import cache

    plans = cache("attention with mods")
    if request.param == "fwd_sm90" and not is_sm90():
        pytest.skip("fwd_sm90 needs an sm_90 GPU")
    if dispatch.mod_family(_fwd_key()) != request.param:
        monkeypatch.setattr(dispatch, "mod_family", lambda key: request.param)
    plans.clear()
    yield request.param
    plans.clear()


def _fwd_key():
    from flashgen.api.device import Device
    from flashgen.problem import ProblemKey

    return ProblemKey("fwd", Device.of(torch.cuda.current_device()).arch, "bf16", 128, False, 1024, "")


def check_mods(b, hq, hk, nq, nk, d, dtype, name, layout="bhsd", block_mask=False, tokens=None, rows=None,
               given=None, bias_gemm=False):
    """One call with ``example_mods``' ``name`` (or the ``given`` (score_mod, mask_mod)) against the reference;
    ``tokens``: a fwd_sm90 tile (name tokens, fwd_sm90.variant's) forced with the mods' token instead of
    dispatch's pick; ``rows`` (the block mask made here): dispatch's pick masks by the row bounds where the mask
    reads a captured tensor per score (else where they build clean on its tile); True runs the bounds' kernel (the
    first tile where they build clean, forced where the pick has none); False, the pick without them forced (the
    mask_mod per score of a partial block); ``bias_gemm``: the forced tile with KernelSpec.bias_gemm (a linear
    score_mod's column part from S's GEMM)."""
    q, k, v = make_inputs(b, hq, hk, nq, nk, d, dtype, layout)
    score_mod, mask_mod = given or example_mods(b, hq, nq, nk)[name]
    scale = 1.0 / math.sqrt(d)
    extra = {"score_mod": score_mod, "mask_mod": mask_mod}
    if tokens is not None:
        from flashgen import mods
        from flashgen.families import fwd_sm90

        pair = mods.pair(mods.trace_score_mod(score_mod) if score_mod else None,
                         mods.trace_mask_mod(mask_mod) if mask_mod else None)
        extra["spec"] = fwd_sm90.variant(d, False, tokens).replace(dtype={torch.bfloat16: "bf16"}.get(dtype, "fp16"),
                                                                   mod=mods.token_number(pair),
                                                                   bias_gemm=bias_gemm).validate()
    if block_mask and mask_mod is not None:
        extra = {"score_mod": score_mod, "block_mask": flashgen.create_block_mask(mask_mod, b, hq, nq, nk)}
    if rows is not None:
        extra = {"score_mod": score_mod, "block_mask": flashgen.create_block_mask(mask_mod, b, hq, nq, nk)}
        from flashgen import dispatch, mods

        spec = _call_spec(to_bhsd(q, layout), score_mod, extra["block_mask"])
        if dispatch.mask_loads_per_score(mods.of_number(spec.mod)):
            assert spec.row_bounds, "dispatch's kernel for a mask that reads per score masks by its row bounds"
        if not rows:
            extra["spec"] = _call_spec(to_bhsd(q, layout), score_mod, extra["block_mask"], row_bounds=False)
        elif not spec.row_bounds:
            extra["spec"] = _call_spec(to_bhsd(q, layout), score_mod, extra["block_mask"], row_bounds="first")
    poison_output(q)
    with torch.no_grad():
        out, lse = flashgen.attention(q, k, v, layout=layout, return_lse=True, **extra)
    torch.cuda.synchronize()
    qb, kb, vb = (to_bhsd(t, layout) for t in (q, k, v))
    ref, ref_lse = reference(qb, kb, vb, False, scale, torch.float32, score_mod=score_mod, mask_mod=mask_mod)
    low, _ = reference(qb, kb, vb, False, scale, dtype, score_mod=score_mod, mask_mod=mask_mod)
    got = to_bhsd(out, layout).float()
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(got).all(), "non-finite output (unwritten or NaN)"
    err = (got - ref).abs().max().item()
    tol = allowance(low, ref, dtype)
    assert err <= tol, f"{name}: max err {err:.3e} > tol {tol:.3e}"
    masked = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), masked), f"{name}: LSE -inf where the reference's is not (or not where it is)"
    if (~masked).any():
        lse_err = (lse[~masked] - ref_lse[~masked]).abs().max().item()
        assert lse_err <= 1e-3 * max(1.0, ref_lse[~masked].abs().max().item()), f"{name}: lse err {lse_err:.3e}"
    return out


@pytest.mark.parametrize("nq,nk", SEQLENS)
@pytest.mark.parametrize("name", MOD_NAMES)
def test_mods_bf16(family, name, nq, nk):
    check_mods(2, 4, 2, nq, nk, 128, torch.bfloat16, name)
    assert _ran(family)


@pytest.mark.parametrize("nq,nk", [(113, 203), (799, 3), (1023, 1024)])
@pytest.mark.parametrize("name", ["causal", "document", "alibi", "alibi_causal", "softcap_document"])
@pytest.mark.parametrize("d", [64, 256])
def test_mods_head_dims_fp16(family, name, nq, nk, d):
    check_mods(1, 4, 1, nq, nk, d, torch.float16, name, layout="bshd")
    assert _ran(family)


@pytest.mark.parametrize("name", ["causal", "sliding", "block_sparse", "alibi_causal"])
def test_mods_given_block_mask(family, name):
    check_mods(2, 4, 4, 1000, 1500, 128, torch.bfloat16, name, block_mask=True)
    assert _ran(family)


@needs_sm90
@pytest.mark.parametrize("tokens", ["ws_ov_ls_ps_s2", "ws_pp_ps_s3_n96"])
@pytest.mark.parametrize("name", ["causal", "document", "alibi_causal", "block_sparse"])
def test_mods_on_persistent_tiles(name, tokens):
    """The persistent tiles (a tuned mods entry may be one: the cost model ranks them first) walk each
    tile's block list as the one-tile kernels do."""
    check_mods(2, 4, 2, 1023, 1024, 128, torch.bfloat16, name, tokens=tokens)
    check_mods(1, 4, 4, 239, 1, 128, torch.bfloat16, name, tokens=tokens)


@needs_sm90
@pytest.mark.parametrize("nq,nk", [(113, 203), (1, 239), (239, 1), (799, 3), (1023, 1024)])
@pytest.mark.parametrize("tokens", ["ws_ov_s3", "ws_ov_ls_ps_s2"])  # (the 192 x 80 tile spills with alibi_causal)
@pytest.mark.parametrize("name", ["alibi_causal", "alibi_flex"])
def test_linear_mods_bias_gemm(name, tokens, nq, nk):
    """The linear score_mods (ALiBi under a causal mask_mod, FlexAttention's ALiBi) with their column part
    from S's GEMM (KernelSpec.bias_gemm), and at d = 64 in fp16 (the bias step stays bf16)."""
    check_mods(2, 4, 2, nq, nk, 128, torch.bfloat16, name, tokens=tokens, bias_gemm=True)
    check_mods(1, 4, 1, nq, nk, 64, torch.float16, name, layout="bshd", tokens="ws_pp_ov_ls_s3_m192", bias_gemm=True)


def _call_spec(q, score_mod, block_mask, row_bounds=None):
    """Dispatch's kernel for the call (its family: the fixture's; ``row_bounds``: with or without them)."""
    from flashgen.api.modcall import call_spec

    return call_spec(q, score_mod, block_mask, row_bounds=row_bounds)


@pytest.mark.parametrize("nq,nk", [(113, 203), (1, 239), (239, 1), (799, 3), (1023, 1024)])
@pytest.mark.parametrize("name", ["causal", "sliding", "prefix_lm", "document", "alibi_causal", "softcap_document"])
@pytest.mark.parametrize("rows", [True, False], ids=["row_bounds", "mask_mod"])
def test_mods_row_bounds(family, name, nq, nk, rows):
    """The example masks whose rows see one run of keys (prefix_lm's bounds per batch): the kernel with the
    bounds masks the partial blocks by each row's first and last visible key (KernelSpec.row_bounds,
    BlockMask.row_bounds); dispatch's pick without them, forced, calls the mask_mod per score."""
    check_mods(2, 4, 2, nq, nk, 128, torch.bfloat16, name, rows=rows)
    assert _ran(family) and all((p.rows is not None) == rows for p in _plans())


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_mods_row_bounds_per_batch_and_head(family, layout):
    """Bounds that differ per head and per batch (a window per head, shifted per batch: strides in rows of both),
    fp16, GQA."""
    b, hq, hk, nq, nk = 3, 6, 2, 517, 700
    check_mods(b, hq, hk, nq, nk, 64, torch.float16, "banded", layout=layout, rows=True,
               given=(None, banded_mask(b, hq, nq, nk)))
    assert _ran(family) and all(p.rows is not None and p.rows.shape[:2] == (b, hq) for p in _plans())


def test_row_bounds_refused_where_a_row_sees_two_runs():
    """A forced ``row_bounds`` kernel with a mask whose rows see several runs of keys is refused before launch."""
    q, k, v = make_inputs(1, 2, 2, 300, 300, 128, torch.bfloat16, "bhsd")

    def strided(b_, h, q_, kv):
        return kv % 3 == 0
    mask = flashgen.create_block_mask(strided, 1, 2, 300, 300)
    picked = _call_spec(q, None, mask)
    assert not picked.row_bounds, "dispatch masks these rows by the mask_mod"
    spec = picked.replace(row_bounds=True).validate()
    with pytest.raises(flashgen.UnsupportedError, match="more than one run"):
        flashgen.attention(q, k, v, block_mask=mask, spec=spec)


def _plans():
    from flashgen.api.plans import cache

    return [p for p in cache("attention with mods").values() if p.base.kernel is not None]


def _ran(family) -> bool:
    """Whether every plan the test made runs a kernel of ``family``."""
    from flashgen.api.plans import cache

    kinds = {p.base.kernel.spec.kind for p in cache("attention with mods").values() if p.base.kernel is not None}
    return kinds == {family}


@needs_sm90
def test_block_mask_reused_across_calls_and_layers():
    """One block mask, made once (broadcast over batch and heads), serves several calls and head counts."""
    nq = nk = 777

    def causal(b, h, q, kv):
        return q >= kv

    bm = flashgen.create_block_mask(causal, None, None, nq, nk)
    for hq, hk in ((4, 4), (8, 2)):
        q, k, v = make_inputs(2, hq, hk, nq, nk, 128, torch.bfloat16)
        with torch.no_grad():
            out = flashgen.attention(q, k, v, block_mask=bm)
            again = flashgen.attention(q, k, v, block_mask=bm)
        ref, _ = reference(q, k, v, False, 1 / math.sqrt(128), score_mod=None, mask_mod=causal)
        low, _ = reference(q, k, v, False, 1 / math.sqrt(128), torch.bfloat16, mask_mod=causal)
        assert torch.equal(out, again)
        assert (out.float() - ref).abs().max().item() <= allowance(low, ref, torch.bfloat16)


@needs_sm90
def test_matches_flex_attention():
    """Against torch's own FlexAttention (eager) on a document mask with an ALiBi score_mod."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    b, h, n, d = 1, 4, 512, 64
    q, k, v = make_inputs(b, h, h, n, n, d, torch.bfloat16)
    doc = torch.sort(torch.randint(0, 3, (n,), device="cuda")).values
    slopes = torch.rand(h, device="cuda") * 0.3

    def mask(b_, h_, q_, kv):
        return (doc[q_] == doc[kv]) & (q_ >= kv)

    def score(s, b_, h_, q_, kv):
        return s - slopes[h_] * (q_ - kv).abs()

    with torch.no_grad():
        ours = flashgen.attention(q, k, v, score_mod=score, mask_mod=mask)
        theirs = fa.flex_attention(q, k, v, score_mod=score, block_mask=fa.create_block_mask(mask, None, None, n, n))
    ref, _ = reference(q, k, v, False, 1 / math.sqrt(d), score_mod=score, mask_mod=mask)
    low, _ = reference(q, k, v, False, 1 / math.sqrt(d), torch.bfloat16, score_mod=score, mask_mod=mask)
    tol = allowance(low, ref, torch.bfloat16)
    assert (ours.float() - ref).abs().max().item() <= tol
    assert (ours.float() - theirs.float()).abs().max().item() <= 2 * tol


@needs_sm90
def test_mod_refusals_before_launch():
    q, k, v = make_inputs(1, 2, 2, 64, 64, 64, torch.bfloat16)

    def cpu_capture(score, b, h, qi, kv):
        return score + torch.ones(4)[h]

    with pytest.raises(ValueError, match="CPU"):
        flashgen.attention(q, k, v, score_mod=cpu_capture)

    def control_flow(score, b, h, qi, kv):
        return score if qi > kv else -score

    with pytest.raises(ValueError, match="control flow"):
        flashgen.attention(q, k, v, score_mod=control_flow)
    with pytest.raises(flashgen.UnsupportedError, match="causal"):
        flashgen.attention(q, k, v, causal=True, score_mod=lambda s, b, h, qi, kv: s)
