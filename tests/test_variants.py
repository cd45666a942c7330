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


# ---------------------------------------------------------------- the kernels' side, without a GPU


def _kernel_block_range(m0, bm, bn, sq, sk, left, right):
    """templates/common/variant.cuh's block_first / block_end, transcribed: the host's encoding of the
    window (Variant.values) and the device's integer arithmetic."""
    causal = right == 0
    v = variants.Variant.of(causal, (left, right) if (left, right) != (U, U) else None)
    vals = v.values(sq, sk, 1.0)
    diag = sk - sq
    has_right, has_left = v.causal or v.windowed, v.windowed
    r = vals["win_right"] if v.windowed else 0

    def key_lo(row):
        return max(0, row + diag - vals["win_left"]) if has_left else 0

    def key_hi(row):
        return min(sk, row + diag + r + 1) if has_right else sk

    if m0 >= sq:
        return 0, 0
    first = key_lo(m0) // bn
    hi = key_hi(min(m0 + bm, sq) - 1)
    end = 0 if hi <= 0 else -(-hi // bn)
    return first, max(first, end)


def test_the_kernels_block_range_matches_the_definition():
    """The device's block range (with the host's encoding of unbounded sides as nk / nq) visits every key
    block holding a visible key and, where it visits any, starts and ends where variants.block_range
    does: the same keys, computed by the kernels' integer formulas."""
    for sq, sk in ((1, 1), (113, 203), (239, 1), (1, 239), (799, 3), (300, 300)):
        for left, right in [(U, U), (0, 0), (256, 0), (100, 37), (U, 64), (5, 2), (3, U)]:
            for bm, bn in ((64, 64), (128, 128), (192, 128)):
                for m0 in range(0, sq, bm):
                    first, end = _kernel_block_range(m0, bm, bn, sq, sk, left, right)
                    want = variants.block_range(m0, bm, bn, sq, sk, left, right)
                    if want == (0, 0):
                        assert end <= first or all(
                            not variants.visible(i, j, sq, sk, left, right)
                            for i in range(m0, min(m0 + bm, sq)) for j in range(first * bn, min(end * bn, sk)))
                    else:
                        assert (first, end) == want, (sq, sk, left, right, bm, bn, m0)


def test_variant_normalizes_and_encodes():
    """A non-causal window whose right side is 0 is the causal kernel's mask; unbounded sides become
    bounds no row reaches (clipped so that index sums stay in int32); a softcap replaces the scale the
    forward's LSE uses (the backward keeps the softmax's)."""
    v = variants.Variant.of(False, (-1, 0))
    assert v.causal and not v.windowed and v.plain and v.key() == ""
    w = variants.Variant.of(True, (4096, 17))
    assert (w.left, w.right, w.windowed, w.key()) == (4096, 0, True, "win")
    assert w.values(100, 200, 0.125) == {"win_left": 200, "win_right": 0, "cap_in": 0.0}
    u = variants.Variant.of(False, (5, -1), 30.0, True, True)
    vals = u.values(100, 200, 0.125)
    assert vals["win_left"] == 5 and vals["win_right"] == 100 and vals["cap_in"] == 0.125 / 30.0
    assert vals["scale"] == 30.0 and vals["scale_log2"] == pytest.approx(30.0 * math.log2(math.e))
    assert "scale" not in u.values(100, 200, 0.125, forward=False)
    assert u.key() == "win_cap_alibi_sink" and u.backward().key() == "win_cap_alibi"
    assert u.names() == ["window", "softcap", "alibi_slopes", "sinks"]
    assert variants.Variant.of(True).pairs(4, 4) == 10


def test_check_variant_inputs_refuses_bad_tensors():
    """Slopes and sinks of the wrong type, dtype, shape or device raise before anything runs."""
    from flashgen.api.checks import check_variant_inputs, variant_tensors

    q = torch.empty(2, 4, 8, 64, dtype=torch.bfloat16)
    ok = check_variant_inputs(q, False, (8, 8), 0.0, torch.ones(4), torch.ones(4, dtype=torch.bfloat16), 2, 4, 8, 8)
    assert ok[0].key() == "win_alibi_sink"
    bad = [
        (dict(alibi_slopes=[1.0] * 4), TypeError), (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError),
        (dict(alibi_slopes=torch.ones(3)), ValueError), (dict(alibi_slopes=torch.ones(4, 2)), ValueError),
        (dict(alibi_slopes=torch.ones(4, device="meta")), ValueError),
        (dict(sinks=torch.ones(2, 4)), ValueError), (dict(sinks=torch.ones(4, dtype=torch.float16)), TypeError),
        (dict(window=(-3, 1)), ValueError), (dict(softcap=float("inf")), ValueError),
    ]
    for kwargs, exc in bad:
        args = {"window": None, "softcap": 0.0, "alibi_slopes": None, "sinks": None, **kwargs}
        with pytest.raises(exc):
            check_variant_inputs(q, False, args["window"], args["softcap"], args["alibi_slopes"], args["sinks"],
                                 2, 4, 8, 8)
    slopes, sb, sinks = variant_tensors(torch.ones(2, 4).t().contiguous().t(), torch.ones(4, dtype=torch.bfloat16))
    assert slopes.is_contiguous() and sb == 4 and sinks.dtype == torch.float32
    assert variant_tensors(torch.ones(4), None)[1] == 0


def test_a_variant_key_takes_the_plain_entry_tile(tmp_path, monkeypatch):
    """Dispatch: a variant key without a table entry of its own runs the plain key's tuned tile with the
    variant's switches; an entry of its own wins; a table entry whose spec does not match its key's
    variant is refused."""
    from flashgen import ConfigError, dispatch, tables
    from flashgen.families import fwd_sm90
    from flashgen.problem import ProblemKey

    monkeypatch.setenv("FLASHGEN_HOME", str(tmp_path))
    plain = ProblemKey("fwd", "sm_90a", "bf16", 128, True, 4096)
    gpu = "h200"
    try:
        dispatch.clear()
        shipped = tables.lookup(gpu, plain)
        got = dispatch.select(plain.replace(variant="win_cap"), gpu, 232448)
        assert got == shipped.replace(window=True, softcap=True)
        own = fwd_sm90.variant(128, True, "ws_pp_s3").replace(window=True, softcap=True).validate()
        table = tables.Table(meta={**tables.load(tables.shipped_path(gpu), gpu=gpu).meta}, entries={
            plain.replace(variant="win_cap"): {"spec": own, "time_ms": 1.0, "source": "measured"}})
        path = tables.default_path(gpu)
        tables.save(table, path)
        dispatch.clear()
        assert dispatch.select(plain.replace(variant="win_cap"), gpu, 232448) == own
        text = path.read_text()
        assert "variant: win_cap" in text
        path.write_text(text.replace("variant: win_cap", "variant: win"))
        dispatch.clear()
        with pytest.raises(ConfigError, match="variant"):
            tables.load(path, gpu=gpu)
        path.write_text(text.replace("variant: win_cap", "variant: cap_win"))
        with pytest.raises(ConfigError, match="variant"):
            tables.load(path, gpu=gpu)
    finally:
        dispatch.clear()


def test_tuner_keys_and_specs_carry_the_variant():
    """``tune --variant``: the keys carry it, the candidates have its switches, the FLOP count follows
    the window's band (a 4096-key window at 16k: about a quarter of the causal pairs)."""
    from flashgen import gpus
    from flashgen.tuner import space

    keys = space.problem_keys("fwd", "sm_90a", ["bf16"], [128], [True], [16384], ["", "win"])
    assert [k.variant for k in keys] == ["", "win"]
    cands = space.candidates(keys[1], gpus.get("h200"))
    assert cands and all(s.window and not s.softcap for s in cands)
    assert space.key_name(keys[1]).endswith("-win")
    ratio = space.key_flops(keys[1]) / space.key_flops(keys[0])
    assert 0.4 < ratio < 0.5  # 4097 of ~8192 keys on average per row, against half of 16384


def test_cli_emit_prints_the_variant_kernel(capsys):
    """``flashgen emit`` with the variant options prints that kernel; a bad option is one line, exit 2."""
    from cli_util import run_main

    code, out, _ = run_main(capsys, "emit", "--d", "128", "--causal", "--window", "4096,0", "--softcap", "30",
                            "--sinks")
    assert code == 0 and "_win_cap_sink_causal_bf16_sm90a" in out.splitlines()[1]
    for bad in (["--window", "5"], ["--softcap", "-1"], ["--kind", "decode_split", "--window", "5,3"], ["--kind", "decode_combine", "--alibi"]):
        code, _, err = run_main(capsys, "emit", "--d", "128", *bad)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for bad in (["--variant", "cap_win"], ["--variant", "win", "--kind", "bwd"]):
        code, _, err = run_main(capsys, "tune", "--gpu", "h200", "--d", "128", "--model", *bad)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err



def test_the_rules_atol_is_the_input_dtypes_rounding_at_the_values_scale():
    from flashgen.reference import allowance, rounding_atol

    small = torch.randn(64, 64) * 0.05  # |x| + 0.3 in [0.25, 0.5): one binade, its ulp 2^-9 (bf16), 2^-12 (fp16)
    small = small.clamp(-0.05, 0.05)
    assert rounding_atol(small, torch.bfloat16) <= 2 * 2 ** -9
    assert rounding_atol(small, torch.float16) <= 2 * 2 ** -12
    assert rounding_atol(small, torch.float32) < 1e-7
    # larger values round more coarsely (bf16's ulp is 2^-6 in [2, 4))
    assert rounding_atol(torch.randn(4096) * 4, torch.bfloat16) > 2 * 2 ** -9
    assert rounding_atol(torch.zeros(0), torch.bfloat16) == 0.0
    low = small + 0.01
    assert allowance(low, small, torch.bfloat16) == pytest.approx(0.02 + rounding_atol(small, torch.bfloat16))
    assert allowance(torch.zeros(0), torch.zeros(0), torch.bfloat16) == 0.0
