"""The variants' one definition (flashgen.variants) without a GPU: the window's normalization and
checks, the block ranges a query block visits and which of its key blocks need masking (against brute
force), the visible-pair count, and the reference's window / softcap / ALiBi / sinks against a
per-element computation, with the sinks' gradient checked numerically."""
from __future__ import annotations

import math
import random

import pytest

from flashgen import variants
from flashgen.errors import UnsupportedError
from flashgen.variants import UNBOUNDED as U

torch = pytest.importorskip("torch")

WINDOWS = [(U, U), (0, 0), (256, 0), (100, 37), (U, 64), (3, U), (0, U), (U, 0), (5, 2)]


def test_window_of_normalizes_and_checks():
    assert variants.window_of(False) == (U, U)
    assert variants.window_of(True) == (U, 0)
    assert variants.window_of(True, (100, 37)) == (100, 0)  # causal sets the right side to 0
    assert variants.window_of(False, [4, 2]) == (4, 2)
    for bad in [(-2, 0), (0, -3), (1.0, 2), (1,), "x", (True, 1)]:
        with pytest.raises(ValueError, match="window"):
            variants.window_of(False, bad)


@pytest.mark.parametrize("value", [0, 0.0, 15, 50.0])
def test_softcap_accepts_zero_and_positive(value):
    assert variants.check_softcap(value) == float(value)


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), True, "50", None])
def test_softcap_refuses_the_rest(value):
    with pytest.raises(ValueError, match="softcap"):
        variants.check_softcap(value)


def test_softcap_must_fit_a_float32():
    with pytest.raises(UnsupportedError, match="float32"):
        variants.check_softcap(1e39)
    with pytest.raises(UnsupportedError, match="float32"):
        variants.check_softcap(1e-40)


def _brute_keys(i0, i1, sq, sk, left, right):
    return {j for i in range(i0, i1) for j in range(sk) if variants.visible(i, j, sq, sk, left, right)}


def test_block_ranges_and_masks_match_brute_force():
    rng = random.Random(1234)  # fixed cases plus random ones; every run checks the same ground
    cases = [(113, 203), (1, 239), (239, 1), (799, 3), (64, 64), (128, 1000), (1000, 128)]
    cases += [(rng.randint(1, 300), rng.randint(1, 300)) for _ in range(12)]
    for sq, sk in cases:
        for left, right in WINDOWS + [(rng.randint(-1, 300), rng.randint(-1, 300))]:
            for bm, bn in ((64, 64), (128, 48), (16, 128)):
                for m0 in range(0, sq, bm):
                    keys = _brute_keys(m0, min(m0 + bm, sq), sq, sk, left, right)
                    first, end = variants.block_range(m0, bm, bn, sq, sk, left, right)
                    blocks = {j // bn for j in keys}
                    assert set(range(first, end)) == blocks, (sq, sk, left, right, bm, bn, m0)
                    for nb in range(first, end):
                        n0 = nb * bn
                        full = all(variants.visible(i, j, sq, sk, left, right) if j < sk else False
                                   for i in range(m0, min(m0 + bm, sq)) for j in range(n0, n0 + bn))
                        assert variants.block_needs_mask(m0, bm, n0, bn, sq, sk, left, right) == (not full), \
                            (sq, sk, left, right, bm, bn, m0, n0)


def test_visible_pairs():
    for sq, sk in [(113, 203), (239, 1), (1, 239), (64, 64)]:
        for left, right in WINDOWS:
            brute = sum(variants.visible(i, j, sq, sk, left, right) for i in range(sq) for j in range(sk))
            assert variants.visible_pairs(sq, sk, left, right) == brute
    n = 1000
    assert variants.visible_pairs(n, n, U, 0) == n * (n + 1) // 2  # causal: the lower triangle
    assert variants.visible_pairs(n, n, U, U) == n * n


def _naive(q, k, v, scale, left, right, softcap, slopes, sinks):
    """Per-element attention in float64 Python arithmetic (no torch ops on whole tensors)."""
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    out = torch.zeros(b, h, sq, d, dtype=torch.float64)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // hk)
            for i in range(sq):
                logits = {}
                for j in range(sk):
                    if not variants.visible(i, j, sq, sk, left, right):
                        continue
                    s = scale * sum(float(q[bi, hi, i, e]) * float(k[bi, kh, j, e]) for e in range(d))
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        m = float(slopes[bi, hi] if slopes.dim() == 2 else slopes[hi])
                        s -= m * abs(j - (i + sk - sq))
                    logits[j] = s
                terms = list(logits.values()) + ([float(sinks[hi])] if sinks is not None else [])
                if not terms:
                    continue
                top = max(terms)
                z = sum(math.exp(t - top) for t in terms)
                lse[bi, hi, i] = top + math.log(z)
                for j, s in logits.items():
                    w = math.exp(s - lse[bi, hi, i].item())
                    for e in range(d):
                        out[bi, hi, i, e] += w * float(v[bi, kh, j, e])
    return out, lse


@pytest.mark.parametrize("window", [None, (0, 0), (2, 1), (-1, 3), (4, -1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("extras", ["plain", "softcap", "alibi", "alibi_batch", "sinks", "all"])
def test_reference_matches_a_per_element_computation(window, causal, extras):
    from flashgen.reference import reference

    g = torch.Generator().manual_seed(7)
    b, h, hk, sq, sk, d = 2, 4, 2, 5, 7, 8
    q, k, v = (torch.randn(b, n_h, n, d, generator=g, dtype=torch.float64)
               for n_h, n in ((h, sq), (hk, sk), (hk, sk)))
    softcap = 0.7 if extras in ("softcap", "all") else 0.0
    slopes = None
    if extras in ("alibi", "all"):
        slopes = torch.rand(h, generator=g, dtype=torch.float64)
    elif extras == "alibi_batch":
        slopes = torch.rand(b, h, generator=g, dtype=torch.float64)
    sinks = torch.randn(h, generator=g, dtype=torch.float64) if extras in ("sinks", "all") else None
    scale = 0.3
    out, lse = reference(q, k, v, causal, scale, torch.float64, window=window, softcap=softcap,
                         alibi_slopes=slopes, sinks=sinks)
    left, right = variants.window_of(causal, window)
    want, want_lse = _naive(q, k, v, scale, left, right, softcap, slopes, sinks)
    assert torch.allclose(out.double(), want, atol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = ~torch.isinf(want_lse)
    assert torch.allclose(lse.double()[finite], want_lse[finite], atol=1e-5)


def test_a_row_that_sees_nothing_gives_zero_and_its_lse_is_the_sink():
    from flashgen.reference import reference

    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0])
    # window (0, 0) with 4 queries over 1 key: only the last query sees it
    out, lse = reference(q, k[:, :, :1], v[:, :, :1], False, 1.0, window=(0, 0))
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3])) and torch.isinf(lse[:, :, :3]).all()
    out, lse = reference(q, k[:, :, :1], v[:, :, :1], False, 1.0, window=(0, 0), sinks=sinks)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert torch.allclose(lse[0, :, :3], sinks[:, None].expand(2, 3))


def test_the_plain_reference_is_unchanged_by_the_variant_arguments():
    from flashgen.reference import reference

    q, k, v = (torch.randn(2, 4, n, 16) for n in (9, 13, 13))
    for causal in (False, True):
        a = reference(q, k, v, causal, 0.25)
        b = reference(q, k, v, causal, 0.25, window=(-1, -1), softcap=0, alibi_slopes=None, sinks=None)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_the_sinks_gradient_is_the_derivative():
    from flashgen.reference import reference

    q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64) for n in (3, 5, 5))
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    # (the reference returns fp32: a coarser step and tolerance than gradcheck's float64 defaults)
    assert torch.autograd.gradcheck(
        lambda s: (reference(q, k, v, True, 0.5, torch.float64, window=(2, 0), sinks=s)[0] * dout).sum(), (sinks,),
        eps=1e-3, atol=1e-3, rtol=1e-3)
