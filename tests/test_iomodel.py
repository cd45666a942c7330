"""The I/O model (flashgen.iomodel) and `flashgen explain`, no GPU."""
from __future__ import annotations

import pytest

from flashgen import gpus, iomodel
from flashgen.explain import analyse, format_text


@pytest.mark.parametrize("d,n,want", [(64, 256, 43), (64, 2048, 60), (64, 4096, 62), (128, 2048, 114),
                                      (128, 4096, 120), (256, 2048, 205), (256, 4096, 228)])
def test_intensity_matches_the_published_table(d, n, want):
    """S = QK^T in standard attention: 2N²d / (2·(2Nd + N²)) FLOPs/byte, rounded, as published."""
    assert round(iomodel.intensity_qk(n, d)) == want


def test_a100_ridge_point():
    """A100-40GB: 312 TFLOP/s over 1.555 TB/s is 201 FLOPs/byte; every published QK^T at d <= 128 is below."""
    a100 = gpus.get("a100")
    assert round(iomodel.ridge_point(a100)) == 201
    assert iomodel.intensity_qk(4096, 128) < iomodel.ridge_point(a100) < iomodel.intensity_qk(4096, 256)


def test_flops_convention():
    assert iomodel.flops(2, 3, 5, 7, 8, False) == 4 * 2 * 3 * 5 * 7 * 8
    assert iomodel.flops(2, 3, 5, 7, 8, True) == 2 * 2 * 3 * 5 * 7 * 8


def test_paper_block_sizes():
    """B_c = ceil(M/4d) with M in elements, B_r = min(B_c, d)."""
    assert iomodel.paper_block_sizes(232448, 128) == (128, 227)   # H200: M = 116224 elements
    assert iomodel.paper_block_sizes(166912, 64) == (64, 326)     # A100
    assert iomodel.paper_block_sizes(1024, 128) == (1, 1)         # M = 512 elements: ceil(512/512)


def test_v2_bytes_by_hand():
    """nq = nk = 64, d = 32, one Q block of 64, K/V blocks of 32: Q once, K and V once, O once, LSE."""
    t = iomodel.hbm_traffic("v2", 1, 1, 64, 64, 32, False, 64, 32)
    assert t == {"read_q": 64 * 32 * 2, "read_kv": 2 * 64 * 32 * 2, "write_o_lse": 64 * (32 * 2 + 4)}
    # two Q blocks of 32: K and V are read once per Q block
    assert iomodel.hbm_traffic("v2", 1, 1, 64, 64, 32, False, 32, 32)["read_kv"] == 2 * 2 * 64 * 32 * 2
    # batch and heads multiply everything
    assert iomodel.hbm_bytes("v2", 3, 5, 64, 64, 32, False, 64, 32) == 15 * sum(t.values())


def test_v1_bytes_by_hand():
    """nq = nk = 64, d = 32, B_r = 32, B_c = 32: two K/V blocks each visit both Q blocks; the first visit
    writes the fp32 partial O and (m, l), the second reads them and writes the final O and LSE."""
    t = iomodel.hbm_traffic("v1", 1, 1, 64, 64, 32, False, 32, 32)
    assert t["read_kv"] == 2 * 64 * 32 * 2
    assert t["read_q"] == 2 * 64 * 32 * 2                    # each Q block read by both K/V blocks
    assert t["write_partial_o_m_l"] == 64 * (32 * 4 + 8)     # one round trip per row
    assert t["read_partial_o_m_l"] == 64 * (32 * 4 + 8)
    assert t["write_o_lse"] == 64 * (32 * 2 + 4)
    # a single K/V block needs no round trip
    one = iomodel.hbm_traffic("v1", 1, 1, 64, 32, 32, False, 32, 32)
    assert one["read_partial_o_m_l"] == one["write_partial_o_m_l"] == 0


def test_standard_bytes_by_hand():
    """nq = 16, nk = 20 (rows padded to 24), d = 8, one tile: S written and read, P written and read."""
    t = iomodel.hbm_traffic("standard", 1, 1, 16, 20, 8, False, 16, 32)
    assert t["qk_read_q"] == 16 * 8 * 2 and t["qk_read_k"] == 20 * 8 * 2
    assert t["qk_write_s"] == 16 * 24 * 2
    assert t["softmax_read_s"] == 16 * 20 * 2 and t["softmax_write_p"] == 16 * 24 * 2
    assert t["pv_read_p"] == 16 * 24 * 2 and t["pv_read_v"] == 20 * 8 * 2 and t["pv_write_o"] == 16 * 8 * 2


def test_causal_reads_about_half():
    """Causal masking skips the tiles above the diagonal: V2's K/V reads are about half at long N."""
    full = iomodel.hbm_traffic("v2", 1, 1, 4096, 4096, 64, False, 128, 64)["read_kv"]
    causal = iomodel.hbm_traffic("v2", 1, 1, 4096, 4096, 64, True, 128, 64)["read_kv"]
    assert 0.5 < causal / full < 0.53
    # a fully masked Q block (nq > nk, bottom-right) still gets V1's single visit from K/V block 0
    t = iomodel.hbm_traffic("v1", 1, 1, 256, 64, 32, True, 64, 64)
    assert t["write_o_lse"] == 256 * (32 * 2 + 4) and t["read_partial_o_m_l"] == 0


def test_ordering_standard_v1_v2():
    """At N = 4096, d = 128 the model orders the bytes standard > V1 > V2."""
    b, h = iomodel.hidden2048(4096, 128)
    s, v1, v2 = (iomodel.hbm_bytes(a, b, h, 4096, 4096, 128, False, bm, bn)
                 for a, bm, bn in (("standard", 128, 128), ("v1", 128, 128), ("v2", 128, 64)))
    assert s > v1 > v2


@pytest.mark.parametrize("bad", [dict(algorithm="v3"), dict(b=-1), dict(block_m=0), dict(d=1.5),
                                 dict(causal=1)])
def test_bad_arguments(bad):
    args = dict(algorithm="v2", b=1, h=1, nq=8, nk=8, d=8, causal=False, block_m=16, block_n=16)
    args.update(bad)
    with pytest.raises((ValueError, TypeError)):
        iomodel.hbm_bytes(**args)


def test_explain_analysis_a100():
    """`flashgen explain` on the A100 profile: intensity column, ridge, bound, paper blocks, three algorithms."""
    info = analyse("a100", 64, 2048)
    assert round(info["ridge"]) == 201 and round(info["intensity_qk"]) == 60 and info["qk_bound"] == "memory"
    assert [round(r["intensity"]) for r in info["intensity_table"]] == [43, 60, 62, 114, 120, 205, 228]
    assert info["paper_blocks"] == {"B_r": 64, "B_c": 326, "M_elements": 83456}
    assert set(info["algorithms"]) == {"standard", "v1", "v2"}
    assert info["algorithms"]["v2"]["bytes_vs_v2"] == 1.0
    text = format_text(info)
    for word in ("ridge point 201", "memory-bound", "B_c = ⌈M/4d⌉ = 326", "standard", "v1", "v2"):
        assert word in text
