"""GPU tier: standard attention (3 passes) and FlashAttention V1 against the fp32 reference.

Same rule and helpers as tests/test_gpu_fwd.py (tests/gpu_util.py; the 2x rule: max error against
the fp32 reference at most twice that of the same reference in the input
dtype, + a rounding-sized atol), on its odd seqlen pairs, causal and not, fp16 and bf16, GQA.
Output buffers are poisoned first: the allocator's pool is filled with NaN and
freed, so an element a kernel never writes shows up as non-finite. V1 must be
bitwise deterministic (its cross-CTA updates are ordered, templates/fwd_v1/fwd_v1.cuh).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gpu_util import check, make_inputs, precompile_skipped, warm  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)"),
]


def _dispatch_picks(verify):
    """dispatch's picks for this module's calls: the three standard passes, fwd_v1 and the forward's
    default ("fwd": test_algorithms_agree_with_v2), at the head dims and buckets the tests use."""
    from flashgen import dispatch
    from flashgen.api.device import Device
    from flashgen.families import fwd_v1, standard
    from flashgen.problem import ProblemKey, bucket_of

    dev = Device.of(torch.cuda.current_device())
    return {dispatch.select(ProblemKey(kind, dev.arch, dtype, d, causal, bucket_of(n)), dev.gpu, dev.smem_budget,
                            verify=verify)
            for kind in (*standard.KINDS, fwd_v1.KIND, "fwd") for dtype in ("bf16", "fp16")
            for d in (32, 64, 96, 128) for causal in (False, True) for n in (512, 1024, 2048)}


@pytest.fixture(scope="module", autouse=True)
def prebuilt(request, tmp_path_factory):
    """Compile the kernels this module uses in parallel first (NVRTC releases the GIL), so the tests
    themselves only load them."""
    if precompile_skipped(request):
        return
    warm((), tmp_path_factory, pick=_dispatch_picks)


SEQLENS = [(113, 203), (1023, 1024), (1, 239), (239, 1), (256, 512), (512, 256)]
ALGORITHMS = ["v1", "standard"]


def poison(numel=1 << 24):
    """Fill and free a block so the next allocations reuse NaN memory."""
    junk = torch.full((numel,), float("nan"), device="cuda", dtype=torch.bfloat16)
    del junk


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 40])
@pytest.mark.parametrize("nq,nk", SEQLENS)
def test_matches_reference(algorithm, nq, nk, d, causal):
    """bf16, MHA, odd sizes; d=40 runs on the 64 tile with the columns past 40 masked."""
    poison()
    check(2, 3, 3, nq, nk, d, "bf16", causal, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [96, 128])
@pytest.mark.parametrize("nq,nk", [(113, 203), (1023, 1024)])
def test_fp16(algorithm, nq, nk, d, causal):
    poison()
    check(1, 2, 2, nq, nk, d, "fp16", causal, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_and_layouts(algorithm, causal, layout):
    """6 query heads over 2 and 1 K/V heads, both layouts (strided views, no copies)."""
    check(2, 6, 2, 300, 517, 64, "bf16", causal, layout, algorithm=algorithm)
    check(1, 6, 1, 517, 300, 128, "fp16", causal, layout, algorithm=algorithm)


@pytest.mark.parametrize("causal", [False, True])
def test_v1_is_bitwise_deterministic(causal):
    """Two V1 runs on many K/V blocks (the ordered cross-CTA updates) give the same bits, O and LSE."""
    import flashgen

    q, k, v = make_inputs(2, 4, 4, 2047, 2053, 128, torch.bfloat16)
    runs = []
    for _ in range(2):
        poison()
        runs.append(flashgen.attention(q, k, v, causal=causal, algorithm="v1", return_lse=True))
    torch.cuda.synchronize()
    (a, la), (b, lb) = runs
    assert torch.isfinite(a.float()).all()
    assert torch.equal(a, b) and torch.equal(la, lb)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_fully_masked_rows_and_empty_keys(algorithm):
    """Causal with nq > nk: the first rows see nothing (O = 0, LSE -inf); nk = 0: every row."""
    import flashgen

    out, lse = check(1, 2, 2, 300, 100, 64, "bf16", True, algorithm=algorithm)
    assert torch.all(out[:, :, :200] == 0) and torch.all(torch.isneginf(lse[:, :, :200]))
    q = torch.randn(1, 2, 17, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 0, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = flashgen.attention(q, k, k, return_lse=True, algorithm=algorithm)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_standard_refuses_what_does_not_fit():
    """An N x N buffer larger than the device's memory is an UnsupportedError before any launch."""
    import flashgen

    free, total = torch.cuda.mem_get_info()
    n = 1 << 17  # 128k: heads x n x n x 2 bytes
    heads = max(1, int(2 * total // (n * n * 2)) + 1)
    q = torch.randn(1, heads, n, 8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(flashgen.UnsupportedError, match="S/P buffer"):
        flashgen.attention(q, q, q, algorithm="standard")


def test_algorithms_agree_with_v2():
    """The three families give nearly the same output on one problem (v2 being the tested default)."""
    import flashgen

    q, k, v = make_inputs(1, 4, 4, 777, 777, 64, torch.float16)
    ref = flashgen.attention(q, k, v, causal=True).float()
    for algorithm in ALGORITHMS:
        out = flashgen.attention(q, k, v, causal=True, algorithm=algorithm).float()
        assert (out - ref).abs().max().item() < 2e-2, algorithm
