"""GPU tier for the variants (window, softcap, ALiBi, sinks; flashgen.variants) in the forward families.

Each call against the fp32 reference with the 2x rule (tests/gpu_util.py's ``check``: output poisoned
first and written everywhere, LSE -inf exactly where a row sees nothing, the sink's logit where it has
one). Dispatch's pick (fwd_sm90 on an H200) over FlashAttention-3's seqlen pairs and windows, softcaps,
slopes and sinks, each alone and together; then fwd_v2 forced, the fwd_sm90 techniques (ping-pong,
early K release, lean softmax, FMA exp2, persistent) under every variant at once, and causal ALiBi with its
column part from S's GEMM (bias_gemm) forced on the ALiBi tiles.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)"),
]

import flashgen  # noqa: E402
from flashgen.errors import UnsupportedError  # noqa: E402
from flashgen.families import fwd_sm90  # noqa: E402
from flashgen.spec import KernelSpec  # noqa: E402
from gpu_util import check, is_sm90, make_inputs  # noqa: E402

SEQLENS = [(1, 1), (113, 203), (128, 217), (1, 239), (239, 1), (799, 3), (256, 512), (512, 256),
           (1023, 1024), (1024, 1023), (2048, 2048)]
WINDOWS = [(-1, -1), (0, 0), (256, 0), (100, 37), (-1, 64)]
HEAD_DIMS = [64, 96, 128, 192, 256]
ALL = {"window": (100, 37), "softcap": 15.0, "alibi": "batch", "sinks": True}

needs_sm90 = pytest.mark.skipif(not is_sm90(), reason="fwd_sm90 needs an sm_90 GPU")
SM90_TECHNIQUES = ["", "ws", "ws_pp", "ws_pp_ov", "ws_pp_kr_ls_s3", "ws_pp_fx1_kr_ls_s3", "ws_ps", "ws_pp_kr_ps",
                   "ws_s3_m192", "ws_pp_ov_fx1_kr_ls_s3_m192"]
V2_VARIANTS = [{"window": (256, 0)}, {"window": (100, 37)}, {"softcap": 15.0}, {"alibi": "head"}, {"sinks": True}, ALL]
# bias_gemm (KernelSpec.bias_gemm, forced: no rule takes it yet): causal ALiBi's column part from one more k16
# step of S's GEMM. (head dim, tokens, dtype): the H200's causal ALiBi tiles at d 64, 128 and 256, the 128x128
# 3-stage overlap tile, ping-pong with early K release and lean softmax, fp16 (the bias step stays bf16).
BIAS_GEMM_CASES = [(64, "ws_pp_ov_ls_s3_m192", "bf16"), (128, "ws_ov_ls_ps_s4_m192_n80", "bf16"),
                   (256, "ws_ov_kr_n80", "bf16"), (128, "ws_ov_s3", "bf16"), (128, "ws_pp_kr_ls_s3", "bf16"),
                   (64, "ws_pp_ov_ls_s3_m192", "fp16"), (128, "ws_ov_s3", "fp16")]


def _flags(causal, variant):
    from flashgen.variants import Variant

    return Variant.of(causal, variant.get("window"), variant.get("softcap", 0.0), "alibi" in variant,
                      "sinks" in variant)


def _v2(d, causal, variant, dtype="bf16"):
    v = _flags(causal, variant)
    flags = {f: on for f, on in v.flags().items() if f != "causal"}
    # Tiles of the default rule that compile without spills: 128 x 64 at d = 64, 128 x 32 (3 stages) at
    # 128, 64 x 32 at 256.
    bm, bn, st = {64: (128, 64, 2), 128: (128, 32, 3), 256: (64, 32, 2)}[d]
    return KernelSpec(kind="fwd_v2", arch="sm_90a" if is_sm90() else "sm_80", dtype=dtype, head_dim=d,
                      causal=v.causal, block_m=bm, block_n=bn, warps=4, stages=st, **flags).validate()


def _sm90(d, causal, tokens):
    return fwd_sm90.variant(d, causal, tokens).replace(window=True, softcap=True, alibi=True, sinks=True).validate()


def _bias_gemm(d, tokens, dtype):
    return fwd_sm90.variant(d, True, tokens, dtype=dtype, alibi=True, bias_gemm=True)


def _picks(verify):
    """Dispatch's specs for every (head dim, dtype, causal, variant) the dispatch tests call."""
    from flashgen import dispatch
    from flashgen.api.device import Device
    from flashgen.problem import ProblemKey, head_dim_tile

    dev = Device.of(torch.cuda.current_device())
    combos = ([{"window": w} for w in WINDOWS] + [{"softcap": 15.0}, {"alibi": "head"}, ALL]
              + [{"window": w, "sinks": True} for w in ((-1, -1), (0, 0), (100, 37))])
    out = set()
    for d in HEAD_DIMS:
        for causal in (False, True):
            for combo in combos:
                v = _flags(causal, combo)
                for dt in ("bf16", "fp16"):
                    key = ProblemKey("fwd", dev.arch, dt, head_dim_tile(d), v.causal, 512, v.key())
                    for bucket in (512, 1024, 2048, 8192):
                        out.add(dispatch.select(key.replace(bucket=bucket), dev.gpu, dev.smem_budget, verify=verify))
    return out


@pytest.fixture(scope="module", autouse=True)
def precompiled(request, tmp_path_factory):
    """Compile every spec this module uses in parallel first (``--no-precompile``: lazily)."""
    from gpu_util import precompile_skipped, warm

    if not torch.cuda.is_available() or precompile_skipped(request):
        return
    specs = {_v2(d, c, v) for d in (64, 128, 256) for c in (False, True) for v in V2_VARIANTS}
    if is_sm90():
        specs |= {_sm90(d, c, t) for d in (64, 128) for c in (False, True) for t in SM90_TECHNIQUES
                  if "m192" not in t or d == 64}
        specs |= {_bias_gemm(d, t, dt) for d, t, dt in BIAS_GEMM_CASES}
    warm(specs, tmp_path_factory, pick=_picks)


@pytest.mark.parametrize("nq,nk", SEQLENS)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_window(nq, nk, window, causal, d):
    check(2, 4, 2, nq, nk, d, "bf16", causal, variant={"window": window})


@pytest.mark.parametrize("nq,nk", [(113, 203), (239, 1), (1023, 1024), (2048, 2048)])
@pytest.mark.parametrize("softcap", [15.0, 50.0, 80.0])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_softcap(nq, nk, softcap, causal, d):
    # Scores of a few tens (inputs of magnitude 3): the cap bends them.
    check(2, 4, 4, nq, nk, d, "bf16", causal, magnitude=3.0, variant={"softcap": softcap})


@pytest.mark.parametrize("nq,nk", [(113, 203), (1, 239), (239, 1), (1024, 1023)])
@pytest.mark.parametrize("alibi", ["head", "batch"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_alibi(nq, nk, alibi, causal, d):
    check(2, 4, 2, nq, nk, d, "bf16", causal, variant={"alibi": alibi})


@needs_sm90
@pytest.mark.parametrize("nq,nk", [(113, 203), (1, 239), (239, 1), (799, 3), (1023, 1023), (1023, 1024), (2048, 2048)])
@pytest.mark.parametrize("alibi", ["head", "batch"])
@pytest.mark.parametrize("d,tokens,dtype", BIAS_GEMM_CASES, ids=[f"d{d}-{t}-{dt}" for d, t, dt in BIAS_GEMM_CASES])
def test_alibi_bias_gemm(nq, nk, alibi, d, tokens, dtype):
    """Causal ALiBi with its column part from S's GEMM (bias_gemm; GQA, 2 query heads a KV head): the 2x rule,
    the LSE -inf exactly where a row sees no key (rows past nk's diagonal at nq > nk) and within 1e-3 elsewhere.
    A wrong B tile or descriptor (the bias step's operands), a wrong A fragment (the slope's halves) or a row
    offset out of step with the GEMM's columns shifts the bias by whole slopes per key: far past the rule."""
    check(2, 4, 2, nq, nk, d, dtype, True, spec=_bias_gemm(d, tokens, dtype), variant={"alibi": alibi})


@needs_sm90
@pytest.mark.parametrize("nq,nk", [(113, 203), (1023, 1024)])
@pytest.mark.parametrize("d,tokens,dtype", BIAS_GEMM_CASES[:2], ids=[f"d{d}-{t}" for d, t, _ in BIAS_GEMM_CASES[:2]])
def test_alibi_bias_gemm_layout_and_groups(nq, nk, d, tokens, dtype):
    """The same with (batch, seqlen, heads, d) inputs, 4 query heads a KV head and larger inputs."""
    check(1, 8, 2, nq, nk, d, dtype, True, "bshd", magnitude=2.0, spec=_bias_gemm(d, tokens, dtype),
          variant={"alibi": "batch"})


@needs_sm90
@pytest.mark.parametrize("nq,nk", [(113, 203), (239, 1), (799, 3), (1023, 1024)])
@pytest.mark.parametrize("sinks", [True, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d,tokens,dtype", BIAS_GEMM_CASES[:3], ids=[f"d{d}-{t}" for d, t, _ in BIAS_GEMM_CASES[:3]])
def test_alibi_bias_gemm_with_sinks(nq, nk, sinks, d, tokens, dtype):
    """Causal ALiBi with sinks on the bias GEMM's kernels, as dispatch picks them (dispatch.with_bias_gemm): the
    sink joins each row's finish, which the bias step leaves alone; LSE with the sink."""
    spec = _bias_gemm(d, tokens, dtype).replace(sinks=True).validate()
    check(2, 4, 2, nq, nk, d, dtype, True, spec=spec, variant={"alibi": "head", "sinks": sinks})


@pytest.mark.parametrize("nq,nk", [(1, 1), (113, 203), (239, 1), (799, 3), (1024, 1023)])
@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (100, 37)], ids=str)
@pytest.mark.parametrize("sinks", [True, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_sinks(nq, nk, window, sinks, causal):
    # (0, 0) with nq > nk leaves rows that see no key: they give 0 and LSE = the sink.
    check(2, 4, 2, nq, nk, 64, "bf16", causal, variant={"window": window, "sinks": sinks})


@pytest.mark.parametrize("nq,nk", [(113, 203), (239, 1), (1023, 1024), (4224, 4224)])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_all_together(nq, nk, layout, dtype, causal, d):
    check(1, 8, 2, nq, nk, d, dtype, causal, layout, magnitude=2.0, variant=ALL)


@pytest.mark.parametrize("nq,nk", [(113, 203), (1, 239), (239, 1), (799, 3), (1023, 1024)])
@pytest.mark.parametrize("variant", V2_VARIANTS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fwd_v2(nq, nk, variant, causal, d):
    check(2, 4, 2, nq, nk, d, "bf16", causal, magnitude=2.0, spec=_v2(d, causal, variant), variant=variant)


# (technique, head dim): every technique at d = 64 and 128, the 192-row tiles at d = 64 only (theirs).
SM90_CASES = [(t, d) for d in (64, 128) for t in SM90_TECHNIQUES if d == 64 or "m192" not in t]


@needs_sm90
@pytest.mark.parametrize("nq,nk", [(113, 203), (239, 1), (1023, 1024), (2048, 2048)])
@pytest.mark.parametrize("tokens,d", SM90_CASES, ids=[f"d{d}-{t or 'plain'}" for t, d in SM90_CASES])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_techniques(nq, nk, tokens, causal, d):
    check(2, 4, 2, nq, nk, d, "bf16", causal, magnitude=2.0, spec=_sm90(d, causal, tokens), variant=ALL)


@needs_sm90
def test_band_cost_follows_the_window():
    """A narrow window reads only its band: at N = 16k with window 256 a 128-row query block visits 3 key
    blocks of 128 against 64.5 on average for the dense causal kernel (21x fewer), so with each tile's
    fixed costs (its Q load, the epilogue) the kernel takes well under a sixth of the dense time (9.7x
    less measured on the H200): the blocks outside the band are never loaded or computed."""
    q, k, v = make_inputs(1, 16, 16, 16384, 16384, 128, torch.bfloat16)
    def timed(**kw):
        flashgen.attention(q, k, v, **kw)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            flashgen.attention(q, k, v, **kw)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    dense, band = timed(causal=True), timed(causal=True, window=(256, 0))
    assert band < dense / 6, f"window 256 at 16k took {band:.3f} ms vs dense causal {dense:.3f} ms"


def test_bad_variant_inputs_raise_before_launch():
    q, k, v = make_inputs(1, 4, 2, 64, 64, 64, torch.bfloat16)
    bad = [
        (dict(window=(-2, 0)), ValueError), (dict(window=(1,)), ValueError), (dict(window=(1.5, 2)), ValueError),
        (dict(softcap=-1.0), ValueError), (dict(softcap=float("nan")), ValueError), (dict(softcap="5"), ValueError),
        (dict(alibi_slopes=torch.ones(3, device="cuda")), ValueError),
        (dict(alibi_slopes=torch.ones(4, device="cuda", dtype=torch.bfloat16)), TypeError),
        (dict(alibi_slopes=torch.ones(4)), ValueError),
        (dict(alibi_slopes=[0.5] * 4), TypeError),
        (dict(sinks=torch.ones(2, 4, device="cuda")), ValueError),
        (dict(sinks=torch.ones(4, device="cuda", dtype=torch.float16)), TypeError),
        (dict(sinks=torch.ones(4)), ValueError),
    ]
    for kwargs, exc in bad:
        with pytest.raises(exc):
            flashgen.attention(q, k, v, **kwargs)
    with pytest.raises(UnsupportedError, match="window"):
        flashgen.attention(q, k, v, window=(4, 4), algorithm="standard")
