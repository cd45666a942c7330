"""Packed rows without a GPU: the work list's host mirror against brute force, the value checks of
``attention_varlen`` (cu_seqlens, seqused_k, max lengths) and its argument checks."""
from __future__ import annotations

import random

import pytest

from flashgen.families.base import varlen_list_ints, varlen_pairs, varlen_work
from flashgen.variants import Variant, visible

torch = pytest.importorskip("torch")


def _brute_blocks(nq, nk, m, bm, bn, variant):
    """The key blocks holding a key some row of query block m sees (by testing every pair)."""
    left, right = variant.left, 0 if variant.causal else variant.right
    blocks = set()
    for i in range(m * bm, min(nq, m * bm + bm)):
        for j in range(nk):
            if visible(i, j, nq, nk, left, right):
                blocks.add(j // bn)
    return blocks


CASES = [([113, 1, 239, 799, 0, 1023], [203, 239, 1, 3, 17, 1024]), ([0, 0], [0, 5]), ([64] * 5, [64] * 5),
         ([300, 17, 1, 64, 130], [300, 17, 1, 64, 130])]


@pytest.mark.parametrize("case", range(len(CASES) + 3))
@pytest.mark.parametrize("variant", [Variant.of(False), Variant.of(True), Variant.of(False, (100, 37)),
                                     Variant.of(True, (40, 0)), Variant.of(False, (-1, 5))], ids=str)
@pytest.mark.parametrize("tile", [(128, 128), (64, 80), (192, 64)], ids=str)
def test_work_list_covers_every_tile_once(case, variant, tile):
    if case < len(CASES):
        q_lens, k_lens = CASES[case]
    else:
        q_lens = [random.choice([0, 1, random.randint(1, 700)]) for _ in range(random.randint(1, 9))]
        k_lens = [random.choice([n, random.randint(0, 700)]) for n in q_lens]
    bm, bn = tile
    work = varlen_work(q_lens, k_lens, bm, bn, variant.replace(varlen=True))
    pairs = [(s, m) for _, s, m in work]
    # Every (sequence, query block) once, no block of a sequence of length 0, within the launch's bound.
    assert sorted(pairs) == [(s, m) for s, n in enumerate(q_lens) for m in range(-(-n // bm))]
    assert len(pairs) <= varlen_pairs(sum(q_lens), len(q_lens), bm)
    assert varlen_list_ints(sum(q_lens), len(q_lens), bm) == 2 + 2 * varlen_pairs(sum(q_lens), len(q_lens), bm)
    costs = [c for c, _, _ in work]
    assert costs == sorted(costs, reverse=True)
    for cost, s, m in work:
        need = _brute_blocks(q_lens[s], k_lens[s], m, bm, bn, variant)
        # The cost counts the blocks the kernel visits: at least every block with a visible pair, and
        # exactly their span (first to last) when there is one (the band is contiguous per row).
        if need:
            assert cost == max(need) - min(need) + 1, (s, m, need, cost)
        else:  # rows that see nothing: no block, or the one block at the key end a clipped window points at
            assert cost <= 1, (s, m, cost)


def _cpu(values):
    return torch.tensor(values, dtype=torch.int32)


def test_packed_values():
    from flashgen.api.packed import check_packed_values

    check_packed_values(_cpu([0, 4, 10]), _cpu([0, 5, 12]), None, 10, 12, 6, 7)
    check_packed_values(_cpu([0, 0, 0]), _cpu([0, 0, 3]), _cpu([0, 2]), 0, 3, 0, 3)
    check_packed_values(_cpu([0]), _cpu([0]), None, 0, 0, 0, 0)
    for cu_q, cu_k, used, tq, tk, mq, mk, what in (
            ([1, 4, 10], [0, 5, 12], None, 10, 12, 10, 12, r"cu_seqlens_q\[0\] must be 0"),
            ([0, 5, 12], [2, 5, 12], None, 12, 12, 10, 12, r"cu_seqlens_k\[0\] must be 0"),
            ([0, 6, 4, 10], [0, 1, 2, 12], None, 10, 12, 10, 12, "non-decreasing, got 6 then 4 at 1"),
            ([0, 4, 9], [0, 5, 12], None, 10, 12, 10, 12, "packed length 10, got 9"),
            ([0, 4, 10], [0, 5, 13], None, 10, 12, 10, 12, "packed length 12, got 13"),
            ([0, 4, 10], [0, 5, 12], None, 10, 12, 5, 12, "sequence 1 has 6 rows in cu_seqlens_q, more than max_seqlen_q = 5"),
            ([0, 4, 10], [0, 5, 12], None, 10, 12, 10, 6, "more than max_seqlen_k = 6"),
            ([0, 4, 10], [0, 5, 12], [6, 1], 10, 12, 10, 12, r"seqused_k\[0\] = 6 is negative or past sequence 0's 5"),
            ([0, 4, 10], [0, 5, 12], [1, -1], 10, 12, 10, 12, r"seqused_k\[1\] = -1")):
        with pytest.raises(ValueError, match=what):
            check_packed_values(_cpu(cu_q), _cpu(cu_k), None if used is None else _cpu(used), tq, tk, mq, mk)


def test_packed_inputs_refused_before_launch():
    """Argument mistakes raise before anything reads device memory (CPU tensors: the device check)."""
    import flashgen

    q = torch.randn(10, 4, 64).to(torch.bfloat16)
    cu = _cpu([0, 10])
    with pytest.raises(ValueError, match="3-D"):
        flashgen.attention_varlen(q[None], q, q, cu, cu, 10, 10)
    with pytest.raises(ValueError, match="CUDA"):
        flashgen.attention_varlen(q, q, q, cu, cu, 10, 10)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flashgen.attention_varlen(q, q, q, cu, cu, 10, 10, causal=1)
    with pytest.raises(TypeError, match="check_values must be a bool"):
        flashgen.attention_varlen(q, q, q, cu, cu, 10, 10, check_values="no")


@pytest.mark.parametrize("kind", ["fwd_sm90", "fwd_v2", "bwd_sm90", "bwd_dkdv", "bwd_dq"])
def test_set_packed_fills_the_varlen_rows_of_every_block(kind):
    """One helper writes a varlen launch's sequence pointers and list into each family's parameter block."""
    from flashgen.api.checks import set_packed
    from flashgen.families import family

    params = family(kind).param_struct()()
    cu_q, cu_k, used, work = (torch.zeros(n, dtype=torch.int32) for n in (3, 3, 2, 8))
    set_packed(params, cu_q, cu_k, None, work)
    assert (params.cu_q, params.cu_k, params.used_k, params.vl_tiles) == (cu_q.data_ptr(), cu_k.data_ptr(), None,
                                                                          work.data_ptr())
    set_packed(params, cu_q, cu_k, used, work)
    assert params.used_k == used.data_ptr()


def test_paged_values():
    """The block table's rules: entries among the pages in use in range (padding past them ignored), key
    counts within a table row; without cu_seqlens_k the counts are seqused_k's."""
    from flashgen.api.packed import check_packed_values

    cu_q = _cpu([0, 4, 10])
    table = _cpu([[3, 0, -1], [1, -1, -1]])
    check_packed_values(cu_q, _cpu([0, 20, 30]), None, 10, None, 6, 20, table, (4, 16))
    check_packed_values(cu_q, None, _cpu([32, 16]), 10, None, 6, 32, table, (4, 16))
    for cu_k, used, bt, what in (
            ([0, 20, 37], None, table, r"block_table\[1, 1\] = -1 is out of range: the cache has 4 pages"),
            ([0, 20, 30], None, _cpu([[3, 4, -1], [1, -1, -1]]), r"block_table\[0, 1\] = 4"),
            (None, [49, 1], table, "sequence 0 has 49 keys: negative, past its block-table row's 48 keys"),
            (None, [-1, 1], table, "sequence 0 has -1 keys"),
            ([0, 20, 30], [21, 1], table, r"seqused_k\[0\] = 21")):
        with pytest.raises(ValueError, match=what):
            check_packed_values(cu_q, None if cu_k is None else _cpu(cu_k), None if used is None else _cpu(used),
                                10, None, 6, 64, bt, (4, 16))
    with pytest.raises(ValueError, match="past max_seqlen_k = 20"):
        check_packed_values(cu_q, None, _cpu([32, 16]), 10, None, 6, 20, table, (4, 16))


def test_paged_spec():
    """A paged call's kernel: the forward's pick with boxes of gcd(page, block_n) rows (block_n lowered
    where that gcd is below both; a warp-specialized tile with several boxes a block one tile per CTA);
    with gather=True the tile as it is with gathered rows, one tile per CTA. page_rows wants packed rows
    and a multiple of 8 dividing block_n, kv_gather a paged warp-specialized one-tile spec; the families without paged K/V refuse by
    name."""
    import math

    from flashgen.families import paged_spec
    from flashgen.errors import UnsupportedError
    from flashgen.families import fwd_sm90
    from flashgen.spec import KernelSpec

    spec = fwd_sm90.variant(128, True, "ws_ov_s3_n80", varlen=True)
    for page, block_n in ((16, 80), (32, 64), (64, 64), (128, 64), (256, 64)):  # no 16-row boxes in a big page
        got = paged_spec(spec, page, gather=False)
        assert got.page_rows == math.gcd(page, block_n) and got.replace(page_rows=0) == spec.replace(block_n=block_n)
        assert KernelSpec.from_name(got.name) == got and f"_pg{got.page_rows}_" in got.name and not got.kv_gather
        gathered = paged_spec(spec.replace(persistent=True), page, gather=True)
        assert gathered == spec.replace(page_rows=math.gcd(page, 80), kv_gather=True)
        assert KernelSpec.from_name(gathered.name) == gathered and gathered.name.endswith("_ga_causal_bf16_sm90a")
        assert paged_spec(spec, page) == got
    wide = fwd_sm90.variant(128, True, "ws_ov_s2", varlen=True)
    assert [paged_spec(wide, p, gather=False).page_rows for p in (16, 64, 256)] == [16, 64, 128]
    for bad in ({"page_rows": 24}, {"page_rows": 12}, {"page_rows": 16, "varlen": False}):
        with pytest.raises(ValueError, match="page_rows"):
            fwd_sm90.variant(128, True, "ws", **{"varlen": True, **bad})
    for bad in ({}, {"page_rows": 16, "persistent": True}):
        with pytest.raises(ValueError, match="kv_gather"):
            fwd_sm90.variant(128, True, "ws", varlen=True, kv_gather=True, **bad)
    with pytest.raises(ValueError, match="kv_gather"):
        fwd_sm90.variant(128, True, "", varlen=True, kv_gather=True, page_rows=16)
    wide = fwd_sm90.variant(128, True, "ws_ov_ls_ps_s4_m192_n80", varlen=True)
    with pytest.raises(ValueError, match="persistent at block_m 192"):
        wide.replace(page_rows=16).validate()
    assert not paged_spec(wide, 256).persistent and paged_spec(spec.replace(persistent=True), 256).persistent
    # several boxes a block: one tile per CTA, whose producer warp issues them one lane each
    assert not paged_spec(spec.replace(persistent=True), 16).persistent
    v2 = KernelSpec(kind="fwd_v2", head_dim=64, block_m=128, block_n=64, warps=4, varlen=True).validate()
    with pytest.raises(UnsupportedError, match="runs on fwd_sm90"):
        paged_spec(v2, 16)
    with pytest.raises(ValueError, match="not a field of this kind"):
        v2.replace(page_rows=16).validate()


def test_tuner_varlen_key():
    """``tune --variant vl``: the keys and candidates carry packed rows; a key is measured at seeded random
    lengths (bucket/8 to the bucket, the first at it, as many tokens as the dense key) and its FLOPs are
    those lengths' pairs, not the dense batch's."""
    from flashgen import gpus
    from flashgen.tuner import space

    keys = space.problem_keys("fwd", "sm_90a", ["bf16"], [128], [True], [2048], ["", "vl"])
    b, h, n, d = space.problem_shape(keys[1])
    lengths = space.tuning_lengths(keys[1])
    assert lengths == space.tuning_lengths(keys[1]) and sum(lengths) == b * n and lengths[0] == max(lengths) == n
    assert all(n // 8 <= m for m in lengths[:-1]) and len(set(lengths)) > 2
    cands = space.candidates(keys[1], gpus.get("h200"))
    assert cands and all(s.varlen for s in cands)
    assert space.key_flops(keys[1]) == 4.0 * h * d * sum(m * (m + 1) // 2 for m in lengths)
    assert space.key_flops(keys[1]) < space.key_flops(keys[0])  # shorter sequences: fewer causal pairs


def test_tuner_varlen_objective(monkeypatch):
    """The measured objective on a CPU stand-in of attention_varlen: a varlen spec is checked sequence by
    sequence (an exact stand-in passes, one wrong row of one sequence fails by that sequence) and timed as
    one packed call over the key's lengths with the spec forced and the value check off."""
    import itertools

    import flashgen.api
    from flashgen import families, gpus
    from flashgen.problem import ProblemKey
    from flashgen.reference import reference
    from flashgen.tuner import objective, space

    key = ProblemKey("fwd", "sm_90a", "bf16", 128, True, 1024, "vl")
    spec = families.default_spec(key.replace(variant=""), gpus.get("h200").smem_per_block).with_tokens("vl")
    calls = []

    def exact(q, k, v, cu_q, cu_k, max_q, max_k, causal, spec=None, check_values=True, bad=None, **kw):
        calls.append((q.shape, k.shape, cu_q.tolist(), max_q, causal, spec, check_values, kw))
        out = torch.full_like(q, float("nan"))
        for s in range(len(cu_q) - 1):
            rows, keys = slice(int(cu_q[s]), int(cu_q[s + 1])), slice(int(cu_k[s]), int(cu_k[s + 1]))
            if rows.stop > rows.start:
                bhsd = [t[i].transpose(0, 1).unsqueeze(0).float() for t, i in ((q, rows), (k, keys), (v, keys))]
                out[rows] = reference(*bhsd, causal, q.shape[-1] ** -0.5)[0][0].transpose(0, 1).to(q.dtype)
        if bad is not None:
            out[int(cu_q[bad])] += 1.0
        return out

    obj = objective.MeasuredObjective(gpus.get("h200"), build=lambda s: None)
    obj.device = "cpu"
    monkeypatch.setattr(flashgen.api, "attention_varlen", exact)
    assert obj.check(spec) == ""
    assert calls[-1][2] == [0, 203, 204, 204, 521] and calls[-1][1][1] == 2 and calls[-1][5] == spec
    monkeypatch.setattr(flashgen.api, "attention_varlen", lambda *a, **kw: exact(*a, **kw, bad=3))
    assert "at sequence 3" in obj.check(spec)
    monkeypatch.setattr(flashgen.api, "attention_varlen", lambda *a, **kw: (calls.append((a, kw)), a[0])[1])
    monkeypatch.setattr(objective, "median_ms", lambda fn: (fn(), 2.5)[1])
    assert obj.timer(key, spec) == 2.5
    (q, k, v, cu_q, cu_k, max_q, max_k, causal), kw = calls[-1]
    cu = [0, *itertools.accumulate(space.tuning_lengths(key))]
    assert cu_q.tolist() == cu_k.tolist() == cu and cu[-1] == 16384 and q.shape == (16384, 16, 128) == k.shape
    assert (max_q, max_k, causal) == (1024, 1024, True) and kw == {"spec": spec, "check_values": False}
