"""GPU tier: the backward pass (dQ, dK, dV) against an fp32 reference, determinism, training, torch.compile.

Rule (``flashgen.reference.grad_tolerance``): flashgen's max gradient error against autograd through
the fp32 reference (on upcast inputs) must be at most 2x the max error of the same reference computed
in the input dtype, + the input dtype's rounding-sized atol. Inputs and output gradients are fresh random normals; sizes are odd; GQA
4:1 sums dK/dV over the query-head group.

Both dK/dV families run the checks parametrized by ``family``: the mma.sync kernel (bwd_dkdv,
forced through FLASHGEN_BWD_FAMILY=bwd_dkdv) and the Hopper kernel (bwd_sm90, the default where it
serves: sm_90a, d tiles 32/64/96/128/192/256; forced the same way); ``-k bwd_sm90`` selects the latter. Its variants
(stages, dQ write mode, 64-key tiles) run through ``specs=``; the unparametrized tests (training,
torch.compile, determinism) take the default path.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)"),
]

SEQLENS = [(113, 203), (1023, 1024), (1, 239), (239, 1)]

from flashgen.reference import grad_tolerance  # noqa: E402
from gpu_util import DTYPES, is_sm90, precompile_skipped, to_bhsd, warm  # noqa: E402


def _dispatch_picks(verify):
    """Every kernel dispatch picks for this module's calls (the launch paths pass ``verify=True``): the
    forward, and each backward problem at d 32/64/96/128/160/192/256 (each dK/dV family where it serves), and on
    sm_90a bwd_sm90's default rule at every key it has a tile for."""
    from flashgen import dispatch, families
    from flashgen.api.device import Device
    from flashgen.errors import UnsupportedError
    from flashgen.problem import BUCKETS, ProblemKey, bwd_head_dim_tile, head_dim_tile

    dev = Device.of(torch.cuda.current_device())
    specs = set()
    backward = ("bwd_preprocess", "bwd_dkdv", "bwd_dkdv_nodq", "bwd_dq", "bwd_convert")
    for d in (32, 64, 96, 128, 160, 192, 256):
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                for problem in ("fwd", *backward):
                    tile = head_dim_tile(d) if problem == "fwd" else bwd_head_dim_tile(d, dev.arch)
                    key = ProblemKey(problem, dev.arch, dtype, tile, causal, BUCKETS[0])
                    specs.add(dispatch.select(key, dev.gpu, dev.smem_budget, verify=verify))
                    if problem == "bwd_dkdv":  # each family (FLASHGEN_BWD_FAMILY forces one), where it serves
                        for fam in families.serving(problem, dev.arch):
                            try:
                                specs.add(dispatch.select(key, dev.gpu, dev.smem_budget, verify=verify,
                                                          family=fam))
                            except UnsupportedError:  # bwd_sm90 without this head-dim tile
                                pass
    if dev.arch == "sm_90a":
        bwd90 = families.family("bwd_sm90")
        specs.update(families.default_spec(key, dev.smem_budget, family="bwd_sm90")
                     for key in bwd90.rule_keys("sm_90a"))
    return specs


@pytest.fixture(scope="module", autouse=True)
def warm_kernels(request, tmp_path_factory):
    """Compile every kernel this module uses, in parallel (NVRTC releases the GIL), before the tests."""
    if precompile_skipped(request):
        return
    warm(SM90_VARIANTS if is_sm90() else (), tmp_path_factory, pick=_dispatch_picks)


def run_flashgen(q, k, v, dout, causal, layout, deterministic=False):
    import flashgen

    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = flashgen.attention(*leaves, causal=causal, layout=layout, deterministic=deterministic)
    out.backward(dout)
    return out, [t.grad for t in leaves]


def make(b, hq, hk, nq, nk, d, dtype, layout):
    def rnd(h, n):
        shape = (b, h, n, d) if layout == "bhsd" else (b, n, h, d)
        return torch.randn(shape, device="cuda", dtype=torch.float32).to(dtype)

    q, k, v = rnd(hq, nq), rnd(hk, nk), rnd(hk, nk)
    return q, k, v, rnd(hq, nq)


def check(b, hq, hk, nq, nk, d, dtype_name, causal, layout="bhsd", deterministic=False, spec=None):
    """flashgen's (dq, dk, dv) against the rule; ``spec``: a dK/dV KernelSpec forced through
    attention_backward's ``specs=`` (the forward still runs through flashgen.attention)."""
    dtype = DTYPES[dtype_name]
    q, k, v, dout = make(b, hq, hk, nq, nk, d, dtype, layout)
    scale = 1.0 / math.sqrt(d)
    if spec is None:
        out, grads = run_flashgen(q, k, v, dout, causal, layout, deterministic)
    else:
        import flashgen
        from flashgen.api.backward import attention_backward

        out, lse = flashgen.attention(q, k, v, causal=causal, layout=layout, return_lse=True)
        grads = attention_backward(dout, q, k, v, out, lse, causal, scale, layout, specs={"bwd_dkdv": spec})
    torch.cuda.synchronize()
    # fp32 reference gradients (bhsd) and the allowed error of each: 2x the input-dtype reference's + a rounding-sized atol.
    refs, tols = grad_tolerance(*(to_bhsd(t, layout) for t in (q, k, v, dout)), causal, scale)
    for name, got, r, tol, t in zip("qkv", grads, refs, tols, (q, k, v)):
        assert got.shape == t.shape and got.dtype == dtype, name
        got = to_bhsd(got, layout).float()
        assert torch.isfinite(got).all(), f"d{name}: non-finite gradient"
        err = (got - r).abs().max().item()
        assert err <= tol, f"d{name}: max err {err:.3e} > tol {tol:.3e}"
    return grads


def use_family(family, d, monkeypatch):
    """Run the backward with dK/dV family ``family``, forced through FLASHGEN_BWD_FAMILY (bwd_sm90:
    skipped where it does not serve)."""
    monkeypatch.setenv("FLASHGEN_BWD_FAMILY", family)
    if family == "bwd_sm90":
        if not is_sm90():
            pytest.skip("bwd_sm90 needs an sm_90a GPU")
        assert serves("bwd_sm90", d), f"the parametrization gives bwd_sm90 only head dims it serves, not {d}"
        monkeypatch.setenv("FLASHGEN_BWD_FAMILY", "bwd_sm90")
    from flashgen.api import backward

    backward.last_specs.clear()


def ran_family(family, d=None):
    """The dK/dV family the last backward launched is ``family`` (the mma.sync family at a head dim ``d``
    whose dQ mode is separate: its dK/dV kernel without dQ, bwd_dkdv_nodq)."""
    from flashgen.api import backward
    from flashgen.families import bwd
    from flashgen.problem import bwd_head_dim_tile

    ran = backward.last_specs[torch.cuda.current_device()]
    if family == "bwd_dkdv" and d is not None and bwd.dq_mode(bwd_head_dim_tile(d, ran.arch)) == "separate":
        family = "bwd_dkdv_nodq"
    assert ran.kind == family, ran.name


def _sm90(d, bn=128, st=2, dq_write=0, causal=False, dtype="bf16", bm=64):
    from flashgen import KernelSpec

    consumers = 2 if d > 128 else bn // 64  # (above 128: two warpgroups over the same 64 keys)
    return KernelSpec(kind="bwd_sm90", arch="sm_90a", dtype=dtype, head_dim=d, block_m=bm, block_n=bn,
                      warps=4 * (consumers + 1), stages=st, dq_write=dq_write, causal=causal)


# bwd_sm90 variants beside its default rule: the other ring depth, the red.global dQ writes and the dQ
# writer warp (families.bwd_sm90.DQ_WRITES), 64-key tiles.
SM90_VARIANTS = [_sm90(d, 128, st, dq_write, c, dt) for d in (32, 64, 96, 128)
                 for st, dq_write in ((2, 1), (3, 0), (2, 2), (3, 2)) for c in (False, True) for dt in ("bf16", "fp16")
                 if (d, st, dq_write) != (128, 3, 2)] + [  # (two staging tiles beside 3 stages: not at 128)
    _sm90(d, 64, 2, dq_write, c) for d in (32, 64, 96) for dq_write in (0, 1, 2) for c in (False, True)] + [
    # above d = 128: dK/dV split by columns over 64 keys (the rule's dQ write and, at 192, the other)
    _sm90(d, 64, 2, dq_write, c, dt) for d, dq_write in ((192, 0), (192, 1), (256, 1)) for c in (False, True)
    for dt in ("bf16", "fp16")] + [
    # the vector adds after a lane-pair swap (dq_write 3; by name, out of the tune space)
    _sm90(d, bn, 2, 3, c) for d, bn in ((32, 64), (64, 128), (96, 128), (128, 128), (192, 64), (256, 64))
    for c in (False, True)] + [
    # one staging tile the warpgroups fill in turn beside a one-stage dO ring (dq_write 4; the tune space's):
    # one warpgroup, uneven column splits (96; 32 on 128 keys), the 3-stage Q ring, the split tiles
    _sm90(d, bn, st, 4, c, dt) for d, bn, st in ((32, 64, 2), (32, 128, 2), (64, 128, 3), (96, 128, 2),
                                                 (128, 128, 2), (192, 64, 2), (256, 64, 2))
    for c in (False, True) for dt in (("bf16", "fp16") if d == 256 else ("bf16",))] + [
    # the same tile freed panel by panel (dq_write 5; by name), where dQ's columns split evenly
    _sm90(d, bn, st, 5, c, dt)
    for d, bn, st in ((64, 64, 2), (64, 128, 3), (128, 128, 2), (192, 64, 2), (256, 64, 2))
    for c in (False, True) for dt in (("bf16", "fp16") if d == 256 else ("bf16",))] + [
    # 128 queries a step (block_m 128: S^T / dP^T of m64n128, dQ in two m64 GEMMs) where the registers allow (at
    # d = 64 on 128 keys the writer's two staging tiles do not fit)
    _sm90(d, bn, 2, dq_write, c, dt, bm=128) for d in (32, 64) for bn in (64, 128) for dq_write in (0, 1, 2, 3, 4)
    if (d, bn, dq_write) != (64, 128, 2) for c in (False, True) for dt in (("bf16", "fp16") if dq_write == 0 else
                                                                         ("bf16",))] + [
    # dQ's GEMM between dV's and dK's (dq_early, which the rule and the tuner's candidates take up to d = 128): the
    # rule's tiles with each dQ write, one warpgroup of 64 keys, 128 queries a step, a det twin
    _sm90(d, 128, st, dq_write, c).replace(dq_early=True) for d, st in ((32, 3), (64, 3), (96, 2), (128, 2))
    for dq_write in (0, 1, 2, 4) for c in (False, True) if (d, st, dq_write) != (32, 3, 4)] + [
    _sm90(d, 64, 2, dq_write, c).replace(dq_early=True) for d in (64, 128) for dq_write in (0, 1)
    for c in (False, True)] + [
    _sm90(64, 128, 2, 0, c, bm=128).replace(dq_early=True) for c in (False, True)] + [
    _sm90(128, 128, 2, 0, c).replace(dq_early=True, det=True) for c in (False, True)]


FAMILIES = ["bwd_dkdv", "bwd_sm90"]


def serves(family: str, d: int) -> bool:
    """Whether ``family`` has a head-dim tile for d (bwd_sm90, on sm_90a: 32, 64, 96, 128, 192, 256, with 129-160 on
    192; the mma.sync kernels: all)."""
    from flashgen.families.bwd_sm90 import BWD_SM90_TILES
    from flashgen.problem import bwd_head_dim_tile

    return family != "bwd_sm90" or bwd_head_dim_tile(d, "sm_90a") in BWD_SM90_TILES


# (family, head dim) pairs each family serves: no case is collected only to be skipped.
FAMILY_DIMS = [(f, d) for d in (32, 64, 96, 128, 160, 192, 256) for f in FAMILIES if serves(f, d)]
FAMILY_DIM_IDS = [f"{f}-d{d}" for f, d in FAMILY_DIMS]


@pytest.mark.parametrize("family,d", FAMILY_DIMS, ids=FAMILY_DIM_IDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", SEQLENS)
def test_grads_bf16(nq, nk, d, causal, family, monkeypatch):
    """Every seqlen pair x head dim x causal, bf16, MHA."""
    use_family(family, d, monkeypatch)
    check(2, 3, 3, nq, nk, d, "bf16", causal)
    ran_family(family, d)


# (1, 239) for bwd_sm90 only: the mma.sync kernels run it in test_grads_bf16.
FP16_GQA_CASES = [(nq, nk, f, d) for nq, nk in ((113, 203), (1023, 1024), (1, 239), (239, 1)) for f, d in FAMILY_DIMS
                  if not ((nq, nk) == (1, 239) and f == "bwd_dkdv")]


@pytest.mark.parametrize("nq,nk,family,d", FP16_GQA_CASES, ids=[f"{nq}-{nk}-{f}-d{d}" for nq, nk, f, d in FP16_GQA_CASES])
@pytest.mark.parametrize("causal", [False, True])
def test_grads_fp16_gqa(nq, nk, d, causal, family, monkeypatch):
    """fp16 with GQA 4:1: dK, dV summed over the four query heads of each KV head."""
    use_family(family, d, monkeypatch)
    check(1, 8, 2, nq, nk, d, "fp16", causal)
    ran_family(family, d)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(113, 203), (1, 239), (512, 300)])
def test_grads_bshd_gqa(nq, nk, causal, dtype, family, monkeypatch):
    """The (batch, seqlen, heads, d) layout through strides, with GQA 4:1 and an odd head dim (40)."""
    use_family(family, 40, monkeypatch)
    check(2, 4, 1, nq, nk, 40, dtype, causal, layout="bshd")
    ran_family(family, 40)


@pytest.mark.parametrize("spec", SM90_VARIANTS, ids=lambda s: s.name)
@pytest.mark.parametrize("nq,nk", [(113, 203), (1023, 1024), (1, 239)])
def test_grads_bwd_sm90_variants(nq, nk, spec):
    """bwd_sm90's variants through specs= (GQA 4:1): the 3-stage ring, dQ by red.global.add from
    registers (dq_write 1, 3) and by the dQ writer warp (dq_write 2, 4), one consumer warpgroup (64-key
    tiles), and head dims 192 / 256 with dK/dV split by columns."""
    if not is_sm90():
        pytest.skip("bwd_sm90 needs an sm_90a GPU")
    check(2, 4, 1, nq, nk, spec.head_dim, spec.dtype, spec.causal, spec=spec)


# det twins reached by name: dq_write 5's (the staging tile freed panel by panel) and 128 queries a step
DET_BY_NAME = [(d, 64, 5, 64) for d in (192, 256)] + [(32, 128, 0, 128), (64, 128, 4, 128)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,bn,dq_write,bm", DET_BY_NAME, ids=[f"d{d}-dq{w}-m{m}" for d, _, w, m in DET_BY_NAME])
def test_det_twin_by_name(d, bn, dq_write, bm, causal):
    """Det twins outside the rule through specs= (dQ's adds in turns; rotated without a mask): within the rule,
    and three passes over the same inputs give the same bits."""
    if not is_sm90():
        pytest.skip("bwd_sm90 needs an sm_90a GPU")
    import flashgen
    from flashgen.api.backward import attention_backward

    spec = _sm90(d, bn, 2, dq_write, causal, bm=bm).replace(det=True).validate()
    check(2, 4, 2, 1023, 1024, d, "bf16", causal, spec=spec)
    q, k, v, dout = make(2, 4, 2, 1023, 1024, d, torch.bfloat16, "bhsd")
    out, lse = flashgen.attention(q, k, v, causal=causal, return_lse=True)
    runs = [attention_backward(dout, q, k, v, out, lse, causal, 1.0 / math.sqrt(d), "bhsd", specs={"bwd_dkdv": spec})
            for _ in range(3)]
    for again in runs[1:]:
        for a, b in zip(runs[0], again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,n,dtype", [(64, 2100, "bf16"), (64, 4097, "fp16"), (128, 8200, "bf16"), (256, 300, "fp16"),
                                       (256, 1000, "bf16")])
def test_dq_writer_by_default(d, n, dtype, causal):
    """Plain keys of d = 128 from 8k and d = 256 from the first bucket: the rule's kernel has the dQ writer warp
    (families.bwd_sm90.DQ_WRITER_FROM: dq_write 2, and 4 at d = 256); d = 64 takes 128 queries a step first
    (WIDE_STEP), its dQ by the consumers; through flashgen.attention's autograd, within the rule."""
    if not is_sm90():
        pytest.skip("bwd_sm90 needs an sm_90a GPU")
    from flashgen.api import backward
    from flashgen.families.bwd_sm90 import DQ_WRITER_FROM, WIDE_STEP

    backward.last_specs.clear()
    check(1, 4, 2, n, n, d, dtype, causal)
    spec = backward.last_specs[torch.cuda.current_device()]
    want = (128, WIDE_STEP[d][0][2]) if d in WIDE_STEP else (64, DQ_WRITER_FROM[d][1])
    assert spec.kind == "bwd_sm90" and (spec.block_m, spec.dq_write) == want, spec.name


@pytest.mark.parametrize("causal", [False, True])
def test_bwd_sm90_multi_block_gqa(causal, monkeypatch):
    """Several K/V blocks per head, several query blocks and heads per CTA, batch 2, GQA 4:1, d=128:
    the ring wraps many times and the dQ of each query row sums over every K/V block."""
    use_family("bwd_sm90", 128, monkeypatch)
    check(2, 8, 2, 777, 1337, 128, "bf16", causal)
    ran_family("bwd_sm90")


@pytest.mark.parametrize("mode", ["atomic", "separate"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("nq,nk", [(113, 203), (239, 1), (1023, 1024)])
def test_grads_both_dq_modes(nq, nk, d, causal, mode, monkeypatch):
    """Both ways of computing dQ in the default (non-deterministic) backward, whichever the dispatch rule
    picks for the head dim: fp32 atomics (bwd_dkdv + bwd_convert) and the separate bwd_dq kernel."""
    from flashgen.families import bwd

    monkeypatch.setitem(bwd.DQ_MODE, d, mode)  # (d is its own head-dim tile here)
    check(1, 4, 2, nq, nk, d, "bf16", causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 160, 192, 256])
def test_deterministic_mode_is_bitwise_reproducible(d, causal):
    """deterministic=True: three backward passes give bitwise identical dQ, dK, dV, within the rule."""
    check(2, 8, 2, 1023, 1024, d, "bf16", causal, deterministic=True)
    q, k, v, dout = make(2, 8, 2, 1023, 1024, d, torch.bfloat16, "bhsd")
    first = run_flashgen(q, k, v, dout, causal, "bhsd", True)[1]
    for _ in range(2):
        again = run_flashgen(q, k, v, dout, causal, "bhsd", True)[1]
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("shape,layout", [((2, 8, 2, 1023, 1024), "bhsd"), ((1, 4, 4, 113, 2051), "bshd"),
                                          ((3, 6, 3, 2049, 333), "bhsd"), ((1, 16, 2, 4096, 4096), "bshd"),
                                          ((2, 2, 1, 1, 239), "bhsd"), ((1, 2, 2, 239, 1), "bshd"),
                                          ((1, 2, 1, 4160, 8320), "bshd")])
def test_deterministic_hopper_kernel(shape, layout, d, causal):
    """deterministic=True on sm_90a: bwd_sm90's det twin (dQ's adds take turns per query block; above d = 128
    from dq_write 4's one staging tile) serves the head dims it has tiles for, within the rule, and five passes
    over fresh inputs of a shape with many CTAs per query block give the same bits. Without a causal mask the
    key blocks walk rotated in chunks (families/bwd_sm90.det_rotation): one chunk of all of them (1023 x 1024,
    2049 x 333, 4096), chunks of 2 with a short last one (113 x 2051), and chunks of 64 with a short last one
    (4160 x 8320: 65 or 130 key blocks)."""
    if not is_sm90():
        pytest.skip("bwd_sm90 needs an sm_90a GPU")
    from flashgen.api import backward

    backward.last_specs.clear()
    check(*shape, d, "bf16", causal, layout=layout, deterministic=True)
    spec = backward.last_specs[torch.cuda.current_device()]
    assert spec.kind == "bwd_sm90" and spec.det, spec.name
    q, k, v, dout = make(*shape, d, torch.bfloat16, layout)
    first = run_flashgen(q, k, v, dout, causal, layout, True)[1]
    for _ in range(4):
        again = run_flashgen(q, k, v, dout, causal, layout, True)[1]
        for a, b in zip(first, again):
            assert torch.equal(a, b)


def test_torch_deterministic_algorithms():
    """torch.use_deterministic_algorithms(True): the backward takes the deterministic path without
    deterministic=True (bwd_sm90's det twin on sm_90a), within the rule and the same bits twice."""
    from flashgen.api import backward

    torch.use_deterministic_algorithms(True, warn_only=True)  # (warn_only: torch's own ops in the test)
    try:
        backward.last_specs.clear()
        check(1, 8, 2, 1023, 777, 128, "bf16", True)
        spec = backward.last_specs[torch.cuda.current_device()]
        assert spec.det if is_sm90() else spec.kind == "bwd_dkdv_nodq", spec.name
        q, k, v, dout = make(1, 8, 2, 1023, 777, 128, torch.bfloat16, "bhsd")
        first = run_flashgen(q, k, v, dout, True, "bhsd")[1]
        again = run_flashgen(q, k, v, dout, True, "bhsd")[1]
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    finally:
        torch.use_deterministic_algorithms(False)


def test_lse_gradient():
    """A loss that uses the returned LSE too: its gradient flows (dS gains P * dLSE)."""
    import flashgen

    q, k, v, dout = make(1, 2, 2, 200, 300, 64, torch.bfloat16, "bhsd")
    dlse = torch.randn(1, 2, 200, device="cuda")
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = flashgen.attention(*leaves, causal=True, return_lse=True)
    (out.float() * dout.float()).sum().add((lse * dlse).sum()).backward()

    ref_leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    s = ref_leaves[0] @ ref_leaves[1].transpose(-1, -2) / 8.0
    i = torch.arange(200, device="cuda")[:, None]
    j = torch.arange(300, device="cuda")[None, :]
    s = s.masked_fill(j > i + 100, float("-inf"))
    ref_out = torch.softmax(s, -1) @ ref_leaves[2]
    ((ref_out * dout.float()).sum() + (torch.logsumexp(s, -1) * dlse).sum()).backward()
    for got, want in zip(leaves, ref_leaves):
        err = (got.grad.float() - want.grad).abs().max().item()
        assert err <= 0.05 * max(1.0, want.grad.abs().max().item()), err


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_that_see_no_key_get_zero_gradients(family, monkeypatch):
    """Causal with seqlen_q > seqlen_k: the first rows see nothing, so their dQ is exactly 0."""
    use_family(family, 64, monkeypatch)
    q, k, v, dout = make(1, 2, 2, 300, 100, 64, torch.bfloat16, "bhsd")
    grads = check(1, 2, 2, 300, 100, 64, "bf16", True)
    _, (dq, dk, dv) = run_flashgen(q, k, v, dout, True, "bhsd")
    assert torch.all(dq[:, :, :200] == 0)
    assert torch.isfinite(grads[0].float()).all()
    ran_family(family, 64)


# ---------------------------------------------------------------- training


class _Block(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads, attend):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.attend = attend

    def forward(self, x):
        b, n, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, n, self.heads, self.hd)
        k, v = self.kv(h).view(b, n, 2, self.kv_heads, self.hd).unbind(2)
        a = self.attend(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16))  # (b, n, heads, hd)
        x = x + self.o(a.float().reshape(b, n, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    """A two-layer causal transformer with GQA (4 query heads, 2 KV heads, head dim 64)."""

    def __init__(self, attend, vocab=64, dim=256, layers=2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(_Block(dim, 4, 2, attend) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def _flashgen_attend(q, k, v):
    import flashgen

    return flashgen.attention(q, k, v, causal=True, layout="bshd")


def _sdpa_attend(q, k, v):
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=True)
    return out.transpose(1, 2)


def _batch(gen, n=8, length=192, vocab=64):
    """A task a small model learns in a few dozen steps: each sequence counts up from a random start
    with a stride of 1, 2 or 3 (mod vocab). The next token is one of three given the current one, so
    the loss falls from ln(vocab) = 4.16 toward ln(3) = 1.10 as the model learns the transitions
    (reading the stride off earlier tokens, through attention, would go lower still)."""
    start = torch.randint(0, vocab, (n, 1), generator=gen, device="cuda")
    stride = torch.randint(1, 4, (n, 1), generator=gen, device="cuda")
    steps = torch.arange(length, device="cuda")[None, :]
    return (start + stride * steps) % vocab


def _train(attend, steps=50, compile_model=False, lr=1e-3, warmup=10, clip=1.0):
    """(training losses, held-out loss) of TinyLM trained from seed 0 with ``attend``.

    fp32 master weights (the attention inputs are cast to bf16 in _Block, the rest
    runs in fp32), AdamW with a linear warmup and a cosine decay to a tenth of lr,
    and gradient clipping: a smooth curve whose end does not amplify the rounding
    differences between two correct attention kernels (see test_training_matches_sdpa).
    """
    torch.manual_seed(0)
    model = TinyLM(attend).cuda()
    run = torch.compile(model, fullgraph=True) if compile_model else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 0.1 + 0.45 * (1 + math.cos(math.pi * s / steps))))
    gen = torch.Generator(device="cuda").manual_seed(1)
    loss_fn = torch.nn.functional.cross_entropy
    losses = []
    for _ in range(steps):
        tokens = _batch(gen)
        logits = run(tokens[:, :-1])
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
    held_out = _batch(torch.Generator(device="cuda").manual_seed(99), n=32)
    with torch.no_grad():
        logits = model(held_out[:, :-1])
        held = loss_fn(logits.reshape(-1, logits.shape[-1]), held_out[:, 1:].reshape(-1)).item()
    return losses, held


def test_training_matches_sdpa():
    """50 AdamW steps of a small GQA transformer from one seed on a counting task: flashgen attention
    and SDPA end within 1 % of each other, and the model learned (loss below half of chance's).

    Compared: the mean of the last 10 training losses (10 batches, so one batch's noise does not
    decide) and the held-out loss. Two correct bf16 kernels differ by rounding (~2^-9 relative per
    element of O, dQ, dK, dV); training turns that into a loss difference that stays small only
    where the curve is smooth. The first version (constant lr 3e-3, held-out loss after step 50)
    was in a regime with loss spikes (the model starts reading the stride off earlier tokens; on a
    CPU stand-in its batch losses went 0.14 -> 0.53 -> 0.30 over steps 35-45), and the two runs
    ended 21 % apart on the H200 (0.219 vs 0.278). Hence the schedule in _train: warmup, lr 1e-3,
    cosine decay to 1e-4, gradient clipping at 1.0. The CPU stand-in (SDPA vs SDPA with uniform
    relative noise of +-2^-8 or +-2^-6 on q, k, v, O and their gradients) put the old design at
    2.8 % apart on the last-10 mean (0.3-5 % held out) and this one at <= 0.13 % on both.
    """
    ours, ours_held = _train(_flashgen_attend)
    theirs, theirs_held = _train(_sdpa_attend)
    assert all(math.isfinite(x) for x in ours + theirs + [ours_held, theirs_held])
    tail_ours, tail_theirs = sum(ours[-10:]) / 10, sum(theirs[-10:]) / 10
    assert abs(tail_ours - tail_theirs) <= 0.01 * tail_theirs, (tail_ours, tail_theirs, ours[-10:], theirs[-10:])
    assert abs(ours_held - theirs_held) <= 0.01 * theirs_held, (ours_held, theirs_held)
    # The comparison is of a model that learns: well below chance (ln 64 = 4.16) after 50 steps.
    assert tail_theirs < 0.5 * math.log(64), theirs


def test_torch_compile_fullgraph_trains():
    """torch.compile(model, fullgraph=True) with flashgen attention runs forward and backward (no graph
    breaks) and trains like the eager model."""
    eager = _train(_flashgen_attend, steps=5)[1]
    compiled = _train(_flashgen_attend, steps=5, compile_model=True)[1]
    assert math.isfinite(compiled)
    assert abs(compiled - eager) <= 0.02 * eager, (compiled, eager)
