"""flashgen.decode's variants without a GPU: input checks, the mirrors of the kernel's window arithmetic
(split ranges from the window's first key, the block-table window, which keys a split reads) against
brute force, an emulation of the kernel's per-split arithmetic with every variant against the
reference, and the plan's launch values.

Window, softcap, ALiBi and sinks are decode_split's compile-time switches
(templates/decode/decode_variant.cuh); their values are launch parameters (flashgen.variants.Variant.values).
The compile tier (tests/test_compile.py) builds the variant kernels dispatch picks.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

import flashgen
from flashgen import UnsupportedError, dispatch, testing
from flashgen.api import decoding as decode_entry
from flashgen.families import decode as dk
from flashgen.reference import reference
from flashgen.variants import UNBOUNDED, Variant
from fake_util import fake

BF16 = torch.bfloat16
B, NQ, HQ, HK, D, L = 3, 2, 8, 2, 128, 100


def good(**over):
    args = dict(q=fake(B, NQ, HQ, D), k_cache=fake(B, L, HK, D), v_cache=fake(B, L, HK, D))
    args.update(over)
    return args


# ---------------------------------------------------------------- input checks


@pytest.mark.parametrize("over,exc,message", [
    (dict(window=(64, 1)), UnsupportedError, r"right side is 0 or -1 .*window=\(64, 1\)"),
    (dict(window=(64, 300)), UnsupportedError, "window"),
    (dict(window=(-2, 0)), ValueError, "window left must be an int >= -1"),
    (dict(window=(64, -2)), ValueError, "window right must be an int >= -1"),
    (dict(window=(1.5, 0)), ValueError, "window left must be an int"),
    (dict(window=(True, 0)), ValueError, "window left must be an int"),
    (dict(window=(64,)), ValueError, r"window must be \(left, right\)"),
    (dict(window=64), ValueError, r"window must be \(left, right\)"),
    (dict(softcap=-1.0), ValueError, "softcap must be 0 .* or a finite positive number"),
    (dict(softcap=math.inf), ValueError, "softcap"),
    (dict(softcap=math.nan), ValueError, "softcap"),
    (dict(softcap="50"), ValueError, "softcap must be a number"),
    (dict(softcap=1e-300), UnsupportedError, "float32"),
    (dict(alibi_slopes=[0.5] * HQ), TypeError, "alibi_slopes must be a torch.Tensor"),
    (dict(alibi_slopes=fake(HQ, dtype=BF16)), TypeError, "alibi_slopes must be float32"),
    (dict(alibi_slopes=fake(HQ + 1, dtype=torch.float32)), ValueError, r"alibi_slopes must have shape \(8,\) or \(3, 8\)"),
    (dict(alibi_slopes=fake(B, HK, dtype=torch.float32)), ValueError, "alibi_slopes must have shape"),
    (dict(alibi_slopes=torch.ones(HQ)), ValueError, "alibi_slopes must be on q's device"),
    (dict(sinks=fake(HQ, dtype=torch.int32)), TypeError, "sinks must be float32 or bfloat16"),
    (dict(sinks=fake(HQ, dtype=torch.float16)), TypeError, "sinks must be float32 or bfloat16"),
    (dict(sinks=fake(B, HQ, dtype=torch.float32)), ValueError, r"sinks must have shape \(8,\)"),
    (dict(sinks=torch.ones(HQ)), ValueError, "sinks must be on q's device"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_bad_variant_arguments_raise_before_launch(no_launch, over, exc, message):
    """Each bad variant argument is refused with a message naming it, before dispatch or a launch (the
    checks flashgen.attention makes; decode's window must end at the causal edge)."""
    with pytest.raises(exc, match=message):
        flashgen.decode(**good(**over))


@pytest.mark.parametrize("window,softcap,alibi,sinks,want", [
    ((64, 0), 0.0, None, None, Variant.of(True, (64, 0))),
    ((64, -1), 0.0, None, None, Variant.of(True, (64, 0))),  # -1 on the right: the causal edge too
    ((-1, -1), 0.0, None, None, Variant.of(True)),             # no bound: plain decode
    ((-1, 0), 0.0, None, None, Variant.of(True)),
    ((0, 0), 50.0, None, None, Variant.of(True, (0, 0), 50.0)),
    ((L, 0), 0.0, None, None, Variant.of(True)),               # reaches past every sequence's start: no window
    ((L - 1, 0), 0.0, None, None, Variant.of(True, (L - 1, 0))),
    (None, 0.0, (B, HQ), (HQ,), Variant.of(True, None, 0.0, True, True)),
    (None, 30, (HQ,), None, Variant.of(True, None, 30.0, True)),
])
def test_valid_variant_arguments(window, softcap, alibi, sinks, want):
    """The variant a valid call runs: causal, the window's right side 0; a left side of at least the
    cache's capacity hides nothing and runs the kernel without a window; slopes of (heads,) or
    (batch, heads); sinks fp32 or q's dtype."""
    q = fake(B, NQ, HQ, D)
    slopes = fake(*alibi, dtype=torch.float32) if alibi else None
    sink = fake(*sinks, dtype=BF16) if sinks else None
    got = decode_entry._check_variant(q, window, softcap, slopes, sink, B, NQ, HQ, L)
    assert got == want
    assert got.key() == "_".join(t for t, on in (("win", got.windowed), ("cap", got.softcap > 0),
                                                 ("alibi", got.alibi), ("sink", got.sinks)) if on)


def test_variant_values_must_be_finite():
    """With check_values the slopes and sinks are checked on the host (one sync for both): a NaN or inf
    is refused naming the argument and the index."""
    decode_entry.check_variant_values(torch.ones(2, 4), torch.zeros(4))
    decode_entry.check_variant_values(None, torch.tensor([1.0, -30.0], dtype=BF16))
    with pytest.raises(ValueError, match=re.escape("alibi_slopes must be finite, got inf at flat index 5")):
        decode_entry.check_variant_values(torch.tensor([[0.0] * 4, [0, math.inf, 0, 0]]), torch.zeros(4))
    with pytest.raises(ValueError, match=re.escape("sinks must be finite, got nan at flat index 1")):
        decode_entry.check_variant_values(None, torch.tensor([0.0, math.nan]))
    with pytest.raises(ValueError, match="sinks must be finite, got -inf"):
        decode_entry.check_variant_values(torch.ones(4), torch.tensor([-math.inf, 0.0]))


# ---------------------------------------------------------------- the window's key ranges (mirrors)


def _visible(row, key, group, length, nq, left):
    """Whether packed row ``row`` sees key ``key`` (bottom-right causal, the window's left side)."""
    o = key - (row // group + length - nq)
    return o <= 0 and (left == UNBOUNDED or o >= -left) and 0 <= key < length


CASES = [(length, nq, group, left) for length in (1, 17, 129, 1000, 4099) for nq in (1, 3)
         for group in (1, 4, 8) for left in (UNBOUNDED, 0, 5, 64, 127, 128, 1000, 5000) if nq <= length]


@pytest.mark.parametrize("block_n", [32, 64, 128])
def test_splits_read_the_window_and_nothing_before_it(block_n):
    """For every CTA (m-block) and split count: the splits' key ranges (split_keys, the kernel's
    arithmetic) are disjoint, in order and cover every key some row of the CTA sees; with a window they
    start at the CTA's first visible key rounded down to a block (so no K/V row before the window is read
    and at most block_n - 1 before any row's window), and a CTA reads at most window_keys + block_n - 1
    keys; without one they start at key 0 (plain decode's ranges)."""
    for length, nq, group, left in CASES:
        rows = nq * group
        for mb in range(-(-rows // 16)):
            r0, r1 = 16 * mb, min(16 * mb + 16, rows)
            seen = {j for r in range(r0, r1) for j in range(length) if _visible(r, j, group, length, nq, left)}
            lo = min(seen)
            for splits in (1, 2, 3, 7, 40):
                ranges = [dk.split_keys(length, nq, group, rows, mb, splits, s, block_n, left) for s in range(splits)]
                read = []
                for begin, end, n_blocks in ranges:
                    assert begin % block_n == 0
                    assert n_blocks == (-(-(end - begin) // block_n) if end > begin else 0)
                    read += range(begin, max(begin, end))
                assert read == sorted(set(read)), (length, nq, group, left, splits)  # disjoint, in order
                assert seen <= set(read)
                assert max(read) == max(seen)  # nothing past the last row's diagonal
                if left == UNBOUNDED:
                    assert min(read) == 0
                    assert ranges[0][0] == 0 and [r[:2] for r in ranges] == [
                        (b_, min(e_, max(seen) + 1)) for b_, e_ in
                        (dk.split_range(length, splits, s, block_n) for s in range(splits))]
                else:
                    assert min(read) == lo // block_n * block_n
                    assert len(read) <= dk.window_keys(length, nq, left) + block_n - 1


def test_window_keys_for_the_heuristic():
    """window_keys: the capacity without a window, else left + nq clipped to it; the heuristic then splits
    a 4096-key window over a 128k cache like a 4k cache (b1, hk8, one m-block, n128 one CTA per SM on
    132 SMs: 11 splits of 3 blocks, against 16 of 64 for the whole cache)."""
    assert dk.window_keys(131072, 1, UNBOUNDED) == 131072
    assert dk.window_keys(131072, 1, 4096) == 4097
    assert dk.window_keys(100, 3, 4096) == 100
    assert dk.window_keys(100, 1, 0) == 1
    assert dk.num_splits_heuristic(1, 8, 1, dk.window_keys(131072, 1, 4096), 128, 132, 1) == 11
    assert dk.num_splits_heuristic(1, 8, 1, 131072, 128, 132, 1) == 16


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("block_n", [32, 64, 128])
def test_paged_window_skips_the_pages_before_it(page_size, block_n):
    """With a window, the loader's block-table window (window_pages, the kernel's fetch_pages) starts at the
    split's first page: every page it hands out is the table's page of that key, and no table entry
    before the page of the window's first key (rounded down to a block) is ever loaded."""
    gen = torch.Generator().manual_seed(page_size + block_n)
    for length, left in ((5003, 700), (40000, 4096), (40000, 100), (300, 17)):
        nq, group = 1, 4
        tab = torch.randperm(-(-length // page_size) + 3, generator=gen).tolist()
        for splits in (1, 3, 11):
            for s in range(splits):
                begin, end, n_blocks = dk.split_keys(length, nq, group, group, 0, splits, s, block_n, left)
                first = dk.first_key(0, group, length, nq, left, block_n)
                assert begin >= first >= length - nq - left - block_n
                loaded = []
                got = dk.window_pages([(i, p) for i, p in enumerate(tab)], begin, n_blocks, end, length, block_n,
                                      page_size)
                for jb, pages in enumerate(got):
                    for e, entry in enumerate(pages):
                        key0 = begin + jb * block_n + e * 16
                        if key0 < end:
                            assert entry == (key0 // page_size, tab[key0 // page_size])
                            loaded.append(entry[0])
                assert all(i >= first // page_size for i in loaded)
                assert (begin >> (page_size.bit_length() - 1)) >= first // page_size  # the window's first load


# ---------------------------------------------------------------- the kernel's arithmetic, emulated


def _emulate(q, k, v, lens, nq, scale, num_splits, block_n, variant, slopes, sinks):
    """decode_split's arithmetic in fp64 on the CPU: per (batch, KV head, m-block, split) its key range
    (split_keys), scores transformed in the kernel's units (Variant.values: tanh(s cap_in), the scale
    replaced by the cap; ALiBi's slope over scale_log2 ln 2), masked by the causal limit and the window's
    first key, a partial softmax (max, sum of exp2, LSE), then the sink in the one-split finish
    (finish_sink) or the merge (merge_chunked with the sink). q (b, nq, hq, d), k/v (b, len, hk, d)."""
    b, _, hq, d = q.shape
    hk = k.shape[2]
    group = hq // hk
    rows = nq * group
    out = torch.zeros(b, nq, hq, d, dtype=torch.float64)
    lse = torch.zeros(b, hq, nq, dtype=torch.float64)
    cap = max(lens)
    vals = variant.values(nq, cap, scale)
    sc, sl2, cap_in = vals.get("scale", scale), vals.get("scale_log2", scale * math.log2(math.e)), vals["cap_in"]
    left = variant.left
    for bi in range(b):
        length = lens[bi]
        for h in range(hk):
            for mb in range(-(-rows // 16)):
                for r in range(16 * mb, min(16 * mb + 16, rows)):
                    tok, head = r // group, h * group + r % group
                    parts = []
                    for s in range(num_splits):
                        begin, end, _ = dk.split_keys(length, nq, group, rows, mb, num_splits, s, block_n, left)
                        keys = torch.arange(begin, max(begin, end))
                        x = (k[bi, keys, h] @ q[bi, tok, head]) if len(keys) else torch.zeros(0, dtype=torch.float64)
                        if variant.softcap:
                            x = torch.tanh(x * cap_in)
                        if variant.alibi:
                            x = x - slopes[bi, head] / (sl2 * math.log(2)) * (keys - (tok + length - nq)).abs()
                        hi = dk.key_limit(r, group, length, nq)
                        lo = dk.key_first(r, group, length, nq, left)
                        x = x.masked_fill((keys >= hi) | (keys < lo), -math.inf)
                        if len(keys) == 0 or bool(torch.isinf(x).all()):
                            parts.append((-math.inf, [0.0] * d, 0.0, -math.inf))
                            continue
                        m = float(x.max())
                        p = torch.exp2((x - m) * sl2)
                        l_ = float(p.sum())
                        parts.append((m * sc + math.log(l_), ((p @ v[bi, keys, h]) / l_).tolist(), l_, m))
                    sink = float(sinks[head]) if sinks is not None else None
                    if num_splits == 1 and sink is not None:  # finish_sink
                        part_lse, o, l_, m = parts[0]
                        mn = m * sc if l_ > 0 else -math.inf
                        top = max(mn, sink)
                        a = math.exp(mn - top) if mn != -math.inf else 0.0
                        total = l_ * a + math.exp(sink - top)
                        o_row = [x * l_ * a / total for x in o]
                        row_lse = top + math.log(total)
                    elif num_splits == 1:
                        o_row, row_lse = parts[0][1], parts[0][0]
                    else:
                        o_row, row_lse = dk.merge_chunked([p_[0] for p_ in parts], [p_[1] for p_ in parts],
                                                          sink=sink)
                    out[bi, tok, head] = torch.tensor(o_row, dtype=torch.float64)
                    lse[bi, head, tok] = row_lse
    return out, lse


@pytest.mark.parametrize("options", [
    dict(window=(5, 0)), dict(window=(0, 0)), dict(softcap=2.0), dict(alibi="head"), dict(alibi="batch"),
    dict(sinks=True), dict(window=(7, 0), softcap=1.5, alibi="batch", sinks=True), dict(window=(40, -1), sinks=True),
], ids=lambda o: "_".join(f"{k}{v}" for k, v in o.items()))
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_emulated_kernel_matches_the_reference(options, num_splits):
    """The emulation of the kernel's arithmetic (its units, masks, window ranges, sink placement) equals
    flashgen.reference's variant attention per sequence, odd lengths (one shorter than the new tokens:
    rows that see no key, output 0 and LSE -inf, or the sink), GQA 4 with 3 new tokens."""
    gen = torch.Generator().manual_seed(num_splits * 31 + len(options))
    b, nq, hq, hk, d, bn = 3, 3, 8, 2, 8, 16
    lens = [101, 37, 2]
    cap = max(lens)
    q = torch.randn(b, nq, hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, cap, hk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, cap, hk, d, generator=gen, dtype=torch.float64)
    slopes = None
    if options.get("alibi"):
        slopes = torch.rand(b, hq, generator=gen, dtype=torch.float64) * 0.5 + 0.05
        if options["alibi"] == "head":
            slopes = slopes[:1].expand(b, hq)
    sinks = torch.randn(hq, generator=gen, dtype=torch.float64) * 2 if options.get("sinks") else None
    window, softcap = options.get("window"), options.get("softcap", 0.0)
    scale = 0.4
    variant = Variant.of(True, window, softcap, slopes is not None, sinks is not None)
    out, lse = _emulate(q, k, v, lens, nq, scale, num_splits, bn, variant, slopes, sinks)
    for i, n in enumerate(lens):
        qi = q[i:i + 1].transpose(1, 2)
        ki, vi = (t[i:i + 1, :n].transpose(1, 2) for t in (k, v))
        ref, ref_lse = reference(qi, ki, vi, True, scale, torch.float64, window=window, softcap=softcap,
                                 alibi_slopes=None if slopes is None else slopes[i:i + 1], sinks=sinks)
        assert torch.allclose(out[i].transpose(0, 1), ref[0].double(), atol=1e-6), i
        assert torch.equal(torch.isinf(lse[i]), torch.isinf(ref_lse[0])), i
        fin = ~torch.isinf(ref_lse[0])
        assert torch.allclose(lse[i][fin], ref_lse[0][fin].double(), atol=1e-5), i


def test_merge_mirror_with_a_sink():
    """merge_chunked with a sink: the sink joins the splits' sum once (LSE = ln(sum e^lse_s + e^sink), O
    scaled by the splits' share); every split empty: O = 0 and LSE = the sink."""
    lses, outs = [0.3, -math.inf, 1.2, -0.5, 2.0], [[1.0, 2.0], [math.nan] * 2, [0.5, -1.0], [3.0, 0.0], [0.0, 1.0]]
    for sink in (-3.0, 0.7, 9.0):
        out, lse = dk.merge_chunked(lses, outs, sink=sink)
        used = [i for i in range(5) if lses[i] != -math.inf]
        want_lse = math.log(sum(math.exp(lses[i]) for i in used) + math.exp(sink))
        assert lse == pytest.approx(want_lse, rel=1e-12)
        for c in range(2):
            assert out[c] == pytest.approx(sum(math.exp(lses[i] - want_lse) * outs[i][c] for i in used), rel=1e-9)
    assert dk.merge_chunked([-math.inf] * 3, [[math.nan]] * 3, sink=-1.5) == ([0.0], -1.5)


# ---------------------------------------------------------------- kernels and plans


def test_variant_specs_spell_their_switches():
    """decode_split takes the variant fields (name tokens before _causal; from_name reads them back) and
    renders them as decode_variant's switches; the plain kernel's source names every switch off."""
    from flashgen.codegen import render
    from flashgen.problem import ProblemKey
    from flashgen.spec import KernelSpec

    key = ProblemKey("decode_split", "sm_90a", "bf16", 128, True, 512, "win_cap_alibi_sink")
    spec = dk.first_rule_spec(key, 232448, "few")
    assert spec.name == "decode_split_d128_m16_n128_w4_s2_ld2_win_cap_alibi_sink_causal_bf16_sm90a"
    assert KernelSpec.from_name(spec.name) == spec
    assert "2, decode_variant<true, true, true, true>>(p);" in render(spec)
    plain = dk.first_rule_spec(key.replace(variant=""), 232448, "few")
    assert "2, decode_variant<false, false, false, false>>(p);" in render(plain)
    assert spec.replace(window=False, softcap=False, alibi=False, sinks=False) == plain
    assert [n for n, _, _ in dk.DECODE_PARAMS[-11:-6]] == ["win_left", "cap_in", "alibi_sb", "alibi", "sinks"]
    assert [n for n, _, _ in dk.DECODE_PARAMS[-6:]] == ["mod", "bm_count", "bm_index", "bm_sb", "bm_sh", "bm_nb"]
    with pytest.raises(ValueError, match="not a field of this kind"):
        KernelSpec(kind="decode_combine", sinks=True).validate()
