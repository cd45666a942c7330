"""bwd_sm90 (Hopper backward: TMA + wgmma) without a GPU: spec rules, names, dispatch, the host's
tensor maps and family switch, a model of the shared-memory addressing, and compiles.

Every spec the bwd_sm90 default rule can pick, and the variants the benchmark and the GPU tests
run (stages, dQ write mode, 64-key tiles), compile with NVRTC for sm_90a with no spills, no stack
frame and none of ptxas's Hopper diagnostics (C7508 setmaxnreg ignored, C7510-C7519 wgmma
serialized or a warpgroup.arrive injected).
"""
from __future__ import annotations

import itertools
import re

import pytest

from flashgen import KernelSpec, UnsupportedError, dispatch, families, gpus
from flashgen.problem import ProblemKey
from build_util import clean_binary, ptx_of, r2ur_before_hgmma, sass_of

H200 = gpus.get("h200")
BUDGET = gpus.ARCH_SMEM_PER_BLOCK["sm_90a"]


def bwd90(d=128, bn=128, st=2, dq_write=0, causal=False, dtype="bf16", bm=64, dqe=False):
    consumers = 2 if d > 128 else bn // 64  # (above 128: two warpgroups over the same 64 keys)
    return KernelSpec(kind="bwd_sm90", arch="sm_90a", dtype=dtype, head_dim=d, block_m=bm, block_n=bn,
                      warps=4 * (consumers + 1), stages=st, dq_write=dq_write, causal=causal, dq_early=dqe)


# dq_write 4's tiles in the tests (the GPU tests' too): one warpgroup (the tile is all of dQ), an uneven split
# (d = 96: 64 and 32 columns; d = 32 on 128 keys: 32 and none), the 3-stage Q ring, and the split tiles.
DQ_HALVES = ((32, 64, 2), (32, 128, 2), (64, 128, 3), (96, 128, 2), (128, 128, 2), (192, 64, 2), (256, 64, 2))
DEFAULTS = [s for s in families.rule_specs("sm_90a", BUDGET) if s.kind == "bwd_sm90"]
# What the GPU tests and the backward benchmark's variants run beside the defaults.
VARIANTS = [bwd90(d, 128, st, w, c, dt) for d in (32, 64, 96, 128) for st in (2, 3) for w in (0, 1, 2)
            for c in (False, True) for dt in ("bf16", "fp16") if (d, st, w) != (128, 3, 2)] + [
    bwd90(64, 64, st, w, c) for st in (2, 3) for w in (0, 1) for c in (False, True)] + [
    # above d = 128, dK/dV split by columns over 64 keys (the rule's dQ write and the other one at 192)
    bwd90(d, 64, 2, w, c, dt) for d, w in ((192, 0), (192, 1), (256, 1)) for c in (False, True)
    for dt in ("bf16", "fp16")] + [
    # the vector adds after a lane-pair swap (dq_write 3; by name, out of the tune space)
    bwd90(d, bn, 2, 3, c) for d, bn in ((32, 64), (64, 128), (96, 128), (128, 128), (192, 64), (256, 64))
    for c in (False, True)] + [
    # one staging tile the warpgroups fill in turn beside a one-stage dO ring (dq_write 4), in the tune space
    bwd90(d, bn, st, 4, c) for d, bn, st in DQ_HALVES for c in (False, True)] + [
    # the same tile freed panel by panel (dq_write 5; by name, not measured yet), where the columns split evenly
    bwd90(d, bn, st, 5, c) for d, bn, st in DQ_HALVES if d not in (32, 96) for c in (False, True)] + [
    bwd90(d, 64, 2, 5, c).replace(det=True) for d in (192, 256) for c in (False, True)] + [
    # 128 queries a step where the registers allow (the GPU tests' set; at d = 64 on 128 keys the writer's two
    # staging tiles do not fit), and the det twins by name
    bwd90(d, bn, 2, w, c, dt, bm=128) for d in (32, 64) for bn in (64, 128) for w in (0, 1, 2, 3, 4)
    if (d, bn, w) != (64, 128, 2) for c in (False, True) for dt in (("bf16", "fp16") if w == 0 else ("bf16",))] + [
    bwd90(d, 128, 2, w, c, bm=128).replace(det=True) for d, w in ((32, 0), (64, 4)) for c in (False, True)] + [
    # dQ's GEMM between dV's and dK's (dq_early, which the rule and the tuner's candidates take up to d = 128): the
    # rule's tiles up to d = 128 with each dQ write, one warpgroup of 64 keys, 128 queries a step, and a det twin
    bwd90(d, 128, st, w, c).replace(dq_early=True) for d, st in ((32, 3), (64, 3), (96, 2), (128, 2))
    for w in (0, 1, 2, 4) for c in (False, True) if (d, st, w) != (32, 3, 4)] + [
    bwd90(d, 64, 2, w, c, dqe=True) for d in (64, 128) for w in (0, 1) for c in (False, True)] + [
    bwd90(64, 128, 2, 0, c, bm=128).replace(dq_early=True) for c in (False, True)] + [
    bwd90(128, 128, 2, 0, c).replace(dq_early=True, det=True) for c in (False, True)]
# deterministic=True's twins of the defaults (dQ's adds take turns: the det field)
DET = list(dict.fromkeys(t for t in (dispatch.deterministic_twin(s, BUDGET) for s in DEFAULTS) if t is not None))
ALL = list(dict.fromkeys(DEFAULTS + VARIANTS + DET))


def test_names_and_rules():
    s = bwd90(causal=True)
    assert s.name == "bwd_sm90_d128_m64_n128_w12_s2_causal_bf16_sm90a"
    assert s.validate() is s and s.feasible(H200)
    assert KernelSpec.from_dict(s.to_dict()) == s == KernelSpec.from_name(s.name)
    assert bwd90(dq_write=1).name == "bwd_sm90_d128_m64_n128_w12_s2_dq1_full_bf16_sm90a"
    det = s.replace(det=True).validate()
    assert det.name == "bwd_sm90_d128_m64_n128_w12_s2_det_causal_bf16_sm90a" and KernelSpec.from_name(det.name) == det
    assert KernelSpec.from_dict(det.to_dict()) == det and "det" not in s.to_dict()
    for change in ({"dq_write": 1}, {"varlen": True}, {"mod": 5}):
        with pytest.raises(ValueError, match="det .deterministic dQ. takes the TMA adds"):
            det.replace(causal=False, **change).validate()
    from flashgen.codegen import render

    # (the body's last template arguments: dp_late, then dq_early and det)
    assert "false,\n                false, true>(p);" in render(det)
    assert "false,\n                false, false>(p);" in render(s)
    with pytest.raises(ValueError, match="warps"):
        s.replace(warps=8).validate()
    with pytest.raises(ValueError, match="block_m"):
        s.replace(block_m=96).validate()
    # 128 queries a step (d <= 64 in practice): valid, but at d = 128 the consumers' values pass their registers,
    # and the split tiles take 64
    assert any("fp32 values per consumer thread" in r for r in s.replace(block_m=128).validate().check(H200))
    assert not s.replace(head_dim=64, block_m=128).validate().check(H200)
    with pytest.raises(ValueError, match="splits S.T / dP.T by queries"):
        s.replace(head_dim=256, block_n=64, block_m=128).validate()
    with pytest.raises(ValueError, match="head_dim"):
        s.replace(head_dim=160).validate()
    with pytest.raises(ValueError, match="arch"):
        s.replace(arch="sm_80").validate()
    with pytest.raises(ValueError, match="dq_write"):
        s.replace(dq_write=6).validate()
    assert bwd90(dq_write=2).name == "bwd_sm90_d128_m64_n128_w12_s2_dq2_full_bf16_sm90a"
    # dQ's GEMM between dV's and dK's: the tiles without the split
    early = bwd90(dq_write=2).replace(dq_early=True).validate()
    assert early.name == "bwd_sm90_d128_m64_n128_w12_s2_dq2_dqe_full_bf16_sm90a"
    assert KernelSpec.from_name(early.name) == early
    with pytest.raises(ValueError, match="dq_early"):
        bwd90(256, 64, dq_write=5).replace(dq_early=True).validate()
    # dq_write 5 frees the one staging tile panel by panel: every warpgroup's part the same panels
    det5 = bwd90(256, 64, dq_write=5).replace(det=True).validate()
    assert det5.name == "bwd_sm90_d256_m64_n64_w12_s2_dq5_det_full_bf16_sm90a"
    for d, bn in ((96, 128), (32, 128)):
        with pytest.raises(ValueError, match="dq_write 5 frees the staging tile panel by panel"):
            bwd90(d, bn, dq_write=5).validate()
    for w in (2, 4, 5):
        for change in ({"varlen": True}, {"mod": 5}):
            with pytest.raises(ValueError, match=f"dq_write {w} .the dQ writer warp. walks dense rows"):
                bwd90(dq_write=w).replace(**change).validate()
    with pytest.raises(ValueError, match="not a field of this kind"):
        s.replace(warp_specialized=True).validate()
    assert s.check(gpus.get("a100"))  # not an sm_90a GPU
    # d=128 with one consumer warpgroup: dK, dV and a 128-column dQ part do not fit the registers
    assert any("would spill" in r for r in bwd90(d=128, bn=64).check(H200))
    assert bwd90(d=64, bn=64).check(H200) == []
    # the 3-stage d=128 ring fits the H200's 227 KB (with the 1 KB alignment slack)
    assert bwd90(st=3).smem_bytes() <= H200.smem_per_block
    # the other backward kinds have no dq_write field
    assert KernelSpec(kind="bwd_dkdv", head_dim=128, block_m=64, block_n=64, warps=8).name == \
        "bwd_dkdv_d128_m64_n64_w8_s2_full_bf16_sm90a"


def test_family_rules_and_smem_formula():
    fam = bwd90().family
    for s in ALL:
        d, bn, st, bm = s.head_dim, s.block_n, s.stages, s.block_m
        # staging tiles of d columns: two where the dQ writer adds them; dq_write 4: one of a warpgroup's columns
        halves = fam.dq_cols(s)[0] / d
        staging = {0: 2 if s.det else 1, 1: 0, 2: 2, 3: 0, 4: halves, 5: halves}[s.dq_write]
        st_do = 1 if s.dq_write in (4, 5) else st  # (dq_write 4 and 5: dO's ring of one stage)
        p_t = 2 * bn * bm * 2 if d > 128 else 0  # (split: P^T's two buffers)
        want = 2 * d * 2 * bn + (st + st_do) * bm * d * 2 + 2 * bn * bm * 2 + p_t + staging * bm * d * 4 \
            + (st + st_do) * bm * 4 + 1024
        assert s.smem_bytes() == want, s.name
        if d % 64 == 0:
            assert fam.dq_cols(s) == (d // fam.consumers(s),) * 2
    assert fam.dq_cols(bwd90(96)) == (64, 32) and fam.dq_cols(bwd90(32)) == (32, 0)
    assert fam.dq_cols(bwd90(96, bn=64)) == (96, 96) and fam.panel_cols(bwd90(96)) == 32
    assert fam.panel_cols(bwd90(128)) == 64 and fam.panel_cols(bwd90(32)) == 32
    # above 128: two consumer warpgroups over 64 keys, d / 2 columns each, starting on a panel
    assert fam.consumers(bwd90(256, bn=64)) == 2 and fam.dq_cols(bwd90(192, bn=64)) == (96, 96)
    assert fam.panel_cols(bwd90(192, bn=64)) == 32 and fam.panel_cols(bwd90(256, bn=64)) == 64
    ctx = bwd90(256, bn=64, dq_write=1).context()
    assert (ctx["split"], ctx["qn"], ctx["dkv_n"], ctx["dq_n"]) == (True, 32, 128, 128)
    with pytest.raises(ValueError, match="block_n=64"):
        bwd90(256, bn=128).validate()
    assert any("shared memory" in r for r in bwd90(256, bn=64).check(H200))  # the fp32 staging does not fit
    # ... a warpgroup's half of it does, beside a one-stage dO ring: 32 KB in place of 32 KB of dO
    assert bwd90(256, bn=64, dq_write=4).smem_bytes() == 231168 and not bwd90(256, bn=64, dq_write=4).check(H200)
    ctx = bwd90(256, bn=64, dq_write=4).context()
    assert (ctx["do_stages"], ctx["staging_bytes"]) == (1, 64 * 128 * 4)
    ctx = bwd90().context()
    assert ctx["dq_n"] == 64 and ctx["producer_regs"] == 24 and ctx["consumer_regs"] == 240
    # det: two staging tiles (the consumers write one while the dQ writer adds the other); the writer
    # lives in the producer warpgroup's 24 registers (168 x 384 at launch = 128 x 24 + 256 x 240)
    det = bwd90().replace(det=True)
    assert det.context()["producer_regs"] == 24 and det.smem_bytes() == bwd90().smem_bytes() + 64 * 128 * 4
    for s in ALL:
        producer, consumer = fam.regs(s)
        assert 128 * producer + 128 * (s.warps // 4 - 1) * consumer <= 168 * 128 * (s.warps // 4) or not producer
    assert det.smem_bytes() <= H200.smem_per_block
    assert ctx["param_bytes"] % 64 == 0
    struct = fam.param_struct()
    for name in ("tm_q", "tm_k", "tm_v", "tm_do", "tm_dq"):
        assert getattr(struct, name).offset % 64 == 0


def test_block_m_128_fit_and_static_shared_memory():
    """128 queries a step (by name and in the tune space): at d = 64 on 128 keys the dQ writer's two staging tiles
    fill the block's dynamic shared memory exactly (232448 B) and the kernel's barriers (static) then do not fit,
    so the fit refuses it; the det twin of the consumers' dQ (two staging tiles) does not fit either and takes the
    one tile of a warpgroup's columns (dq_write 4). Above d = 64 the consumers' values pass their registers."""
    fam = bwd90().family
    wide = bwd90(64, bm=128)
    assert not wide.check(H200) and fam.acc_floats(wide) == 192
    writer = wide.replace(dq_write=2).validate()
    assert writer.smem_bytes() == BUDGET and writer.smem_total() == BUDGET + 96
    assert any("shared memory" in r for r in writer.check(H200))
    twin = dispatch.deterministic_twin(wide, BUDGET)
    assert (twin.block_m, twin.dq_write, twin.det) == (128, 4, True) and not twin.check(H200)
    assert any("fp32 values per consumer thread" in r for r in bwd90(96, bm=128).check(H200))
    # the tuner's candidates at d = 64 take both steps; at d = 128 the 128-query ones are refused by the registers
    from flashgen.tuner import space

    cands = [c for c in space.candidates(ProblemKey("bwd_dkdv", "sm_90a", "bf16", 64, True, 4096), H200)
             if c.kind == "bwd_sm90"]
    assert {c.block_m for c in cands} == {64, 128} and all(not c.check(H200) for c in cands)
    # the barriers: K/V, three per stage, and the writer's full / empty pairs (dq_write 5: an empty one per panel)
    assert fam.static_smem_bytes(bwd90()) == 64 and fam.static_smem_bytes(bwd90(dq_write=2)) == 96
    assert fam.static_smem_bytes(bwd90(256, 64, dq_write=5)) == -(-8 * (1 + 6 + 2 + 2 * 4) // 16) * 16


def test_wide_step_rule():
    """d = 64's plain keys take 128 queries a step first (WIDE_STEP); keys with variants, packed rows, mods and
    the other head dims the 64-query tiles."""
    from flashgen.families.bwd_sm90 import WIDE_STEP

    fam = bwd90().family
    for bucket in (512, 2048, 16384):
        for causal in (False, True):
            plain = fam.rule(ProblemKey("bwd_dkdv", "sm_90a", "bf16", 64, causal, bucket), BUDGET)
            assert (plain[0].block_m, plain[0].block_n, plain[0].stages, plain[0].dq_write) == (128, *WIDE_STEP[64][0])
            assert all(s.block_m == 64 for s in plain[1:])
            for variant in ("cap", "win", "vl"):
                key = ProblemKey("bwd_dkdv", "sm_90a", "bf16", 64, causal, bucket, variant)
                assert all(s.block_m == 64 for s in fam.rule(key, BUDGET))
    for d in (32, 96, 128, 192, 256):
        assert all(s.block_m == 64 for s in fam.rule(ProblemKey("bwd_dkdv", "sm_90a", "bf16", d, False, 2048), BUDGET))
    assert dispatch.mod_backward_spec(ProblemKey("bwd_dkdv", "sm_90a", "bf16", 64, False, 2048), BUDGET, 5).block_m == 64


def test_dispatch():
    assert families.serving("bwd_dkdv", "sm_90a") == ("bwd_sm90", "bwd_dkdv")
    assert families.serving("bwd_dkdv", "sm_80") == ("bwd_dkdv",)
    assert families.FAMILIES["bwd_sm90"].serves == "bwd_dkdv" and families.FAMILIES["bwd_dkdv"].serves == "bwd_dkdv"
    kinds = families.problems()
    assert "bwd_dkdv" in kinds and "bwd_sm90" not in kinds and len(kinds) == len(set(kinds))
    # the default family of the bwd_dkdv problem on sm_90a is bwd_sm90 (measured 1.6-1.9x the mma.sync
    # kernel's backward on the H200)
    key = ProblemKey("bwd_dkdv", "sm_90a", "bf16", 128, True, 4096)
    assert families.default_spec(key, BUDGET).kind == "bwd_sm90"
    assert dispatch.select(key, "h200", BUDGET).kind == "bwd_sm90"
    # (the dQ writer warp first where DQ_WRITER_FROM puts it: d = 128 from a later bucket, 2 x 2 more specs; d = 64's
    # 128-query tile comes before its writer tile at every bucket; d = 256 from the first bucket, in place of its
    # red.global tile)
    assert len(DEFAULTS) == 6 * 2 * 2 + 4 and all(s.kind == "bwd_sm90" and not s.check(H200) for s in DEFAULTS)
    # above d = 128, and beside d = 64's 128-query step, the det twin's two fp32 staging tiles do not fit: it takes
    # dq_write 4's one tile instead
    assert all(dispatch.deterministic_twin(s, BUDGET) is not None for s in DEFAULTS)
    assert {t.head_dim: t.dq_write for t in DET} == {32: 0, 64: 4, 96: 0, 128: 0, 192: 4, 256: 4}
    assert len(DET) == 6 * 2 * 2 and all(not t.check(H200) for t in DET)
    d256 = next(s for s in DEFAULTS if s.head_dim == 256)
    assert dispatch.deterministic_twin(d256, bwd90(256, 64, dq_write=4).smem_bytes() - 1) is None
    assert [s for s in families.rule_specs("sm_80", 166912) if s.kind == "bwd_sm90"] == []
    k64 = ProblemKey("bwd_dkdv", "sm_90a", "fp16", 64, False, 2048)
    assert dispatch.select(k64, "h200", BUDGET, family="bwd_sm90") == bwd90(d=64, dtype="fp16", bm=128, dqe=True)
    # the dQ writer only for plain keys from DQ_WRITER_FROM's bucket on (dense rows, where it was measured)
    assert dispatch.select(k64.replace(bucket=1024), "h200", BUDGET, family="bwd_sm90").dq_write == 0
    assert dispatch.select(k64.replace(variant="win"), "h200", BUDGET, family="bwd_sm90").dq_write == 0
    k128 = ProblemKey("bwd_dkdv", "sm_90a", "fp16", 128, True, 8192)
    assert dispatch.select(k128, "h200", BUDGET).dq_write == 2
    assert dispatch.select(k128.replace(bucket=512), "h200", BUDGET).dq_write == 0
    # d = 256: dq_write 5 (one staging tile in turns, freed panel by panel) from the first bucket for every key
    # without packed rows, which take the red.global tile; so do the mods (the writer walks dense rows)
    k256 = ProblemKey("bwd_dkdv", "sm_90a", "bf16", 256, True, 512)
    for variant in ("", "win", "cap_alibi_sink"):
        assert dispatch.select(k256.replace(variant=variant), None, BUDGET).dq_write == 5
    assert dispatch.select(k256.replace(variant="vl"), None, BUDGET).dq_write == 1
    assert dispatch.mod_backward_spec(k256, BUDGET, 5).dq_write == 1
    assert dispatch.mod_backward_spec(k64, BUDGET, 5).dq_write == 0
    with pytest.raises(UnsupportedError, match="bwd_sm90 does not serve"):
        dispatch.select(ProblemKey("bwd_dkdv", "sm_80", "fp16", 64, False, 2048), None, 166912, family="bwd_sm90")
    with pytest.raises(UnsupportedError, match="head-dim tile"):
        families.default_spec(ProblemKey("bwd_dkdv", "sm_90a", "bf16", 160, False, 2048), BUDGET, family="bwd_sm90")
    # a smaller shared memory: the d=64 rule falls back to 2 stages
    small = families.default_spec(k64, bwd90(d=64, st=3).smem_bytes() - 1)
    assert small.kind == "bwd_sm90" and small.stages == 2


def test_tune_space_candidates():
    from flashgen.tuner import space

    key = ProblemKey("bwd_dkdv", "sm_90a", "bf16", 128, True, 4096)
    cands = space.candidates(key, H200, only=("bwd_sm90",))
    sm90 = [c for c in cands if c.kind == "bwd_sm90"]
    assert sm90 and all(not c.check(H200) for c in sm90)
    assert {c.block_n for c in sm90} == {128} and {c.stages for c in sm90} == {2, 3}
    assert {c.dq_write for c in sm90} == {0, 1, 2, 4}  # (dq_write 3 measured below dq_write 1: not searched)
    # the dQ writer's second staging tile does not fit beside a 3-stage d = 128 ring
    assert {(c.stages, c.dq_write) for c in sm90} == {(2, 0), (2, 1), (2, 2), (2, 4), (3, 0), (3, 1), (3, 4)}
    # above 128: the split tile (64 keys, 12 warps) whatever block_n the space names, where it fits (and the
    # rule's own dq_write 5, which the space does not name)
    big = [c for c in space.candidates(ProblemKey("bwd_dkdv", "sm_90a", "bf16", 256, True, 4096), H200)
           if c.kind == "bwd_sm90"]
    assert sorted(c.name for c in big) == ["bwd_sm90_d256_m64_n64_w12_s2_dq1_causal_bf16_sm90a",
                                           "bwd_sm90_d256_m64_n64_w12_s2_dq4_causal_bf16_sm90a",
                                           "bwd_sm90_d256_m64_n64_w12_s2_dq5_causal_bf16_sm90a"]
    # a varlen key: the writer walks dense rows only
    vl = space.candidates(ProblemKey("bwd_dkdv", "sm_90a", "bf16", 128, True, 4096, "vl"), H200, only=("bwd_sm90",))
    assert vl and {c.dq_write for c in vl if c.kind == "bwd_sm90"} == {0, 1}


def test_family_switch(monkeypatch):
    """Unset, dispatch picks (None) where bwd_sm90 serves (sm_90a, d tile 32/64/96/128) and the mma.sync family
    elsewhere, or where a tensor's strides are not the TMA's; FLASHGEN_BWD_FAMILY forces one family where
    it serves. (The separate-dQ mode never asks: it runs bwd_dkdv_nodq.)"""
    from flashgen.api import backward

    def key(arch, d):
        return ProblemKey("bwd_dkdv", arch, "bf16", d, False, 512)

    monkeypatch.delenv("FLASHGEN_BWD_FAMILY", raising=False)
    assert backward.dkdv_family(key("sm_90a", 128)) is None
    assert backward.dkdv_family(key("sm_90a", 160)) == "bwd_dkdv"
    assert backward.dkdv_family(key("sm_80", 64)) == "bwd_dkdv"
    monkeypatch.setenv("FLASHGEN_BWD_FAMILY", "bwd_sm90")
    assert backward.dkdv_family(key("sm_90a", 128)) == "bwd_sm90"
    assert backward.dkdv_family(key("sm_90a", 64)) == "bwd_sm90"
    assert backward.dkdv_family(key("sm_90a", 96)) == "bwd_sm90"
    assert backward.dkdv_family(key("sm_90a", 160)) == "bwd_dkdv"
    assert backward.dkdv_family(key("sm_80", 128)) == "bwd_dkdv"
    monkeypatch.setenv("FLASHGEN_BWD_FAMILY", "bwd_dkdv")
    assert backward.dkdv_family(key("sm_90a", 128)) == "bwd_dkdv"
    monkeypatch.setenv("FLASHGEN_BWD_FAMILY", "fa3")
    with pytest.raises(ValueError, match="FLASHGEN_BWD_FAMILY"):
        backward.dkdv_family(key("sm_90a", 128))


def test_backward_default_rule_is_bwd_sm90_on_sm90a():
    """The bwd_dkdv problem's default rule: bwd_sm90 on sm_90a at d tiles 32/64/96/128 (measured faster
    than the mma.sync kernel's: docs/perf/backward.md), the mma.sync family elsewhere; family="bwd_dkdv"
    gives the mma.sync rule where bwd_sm90 cannot run."""
    budget = H200.smem_per_block
    for d in (32, 64, 96, 128):
        key = ProblemKey("bwd_dkdv", "sm_90a", "bf16", d, False, 4096)
        assert families.default_spec(key, budget).kind == "bwd_sm90"
        mma = dispatch.select(key, None, budget, family="bwd_dkdv")
        assert mma.kind == "bwd_dkdv" and mma == families.default_spec(key, budget, family="bwd_dkdv")
    for arch, d in (("sm_90a", 160), ("sm_80", 128)):
        key = ProblemKey("bwd_dkdv", arch, "bf16", d, True, 4096)
        assert families.default_spec(key, 163840).kind == "bwd_dkdv"
    with pytest.raises(ValueError, match="does not serve"):
        families.default_spec(ProblemKey("bwd_dkdv", "sm_90a", "bf16", 64, False, 512), budget, family="fwd_v2")


@pytest.mark.parametrize("d,D", [(40, 64), (72, 96)])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_tensor_maps(monkeypatch, layout, d, D):
    """The five maps: (d, seq, head, batch) with the tensors' byte strides, boxes of one swizzle panel's
    columns (64; 32 where the tile D is an odd multiple of 32) by block_m (Q, dO) or block_n (K, V) rows;
    dQ's fp32 accumulator (D, nq, h, b) with 32-column boxes."""
    torch = pytest.importorskip("torch")
    from flashgen import tma
    from flashgen.api.checks import dims as bhs_dims

    calls = []
    monkeypatch.setattr(tma, "encode", lambda ptr, dtype, dims, strides, box: calls.append(
        (ptr, dtype, tuple(dims), tuple(strides), tuple(box))) or bytes(128))
    b, h, hk, nq, nk = 2, 8, 2, 100, 77
    shape = (lambda n, hh: (b, hh, n, d)) if layout == "bhsd" else (lambda n, hh: (b, n, hh, d))
    q, k, v, do = (torch.empty(shape(n, hh), device="meta") for n, hh in ((nq, h), (nk, hk), (nk, hk), (nq, h)))
    spec = bwd90(d=D)

    class FakeKernel:
        def __init__(self):
            self.spec = spec

        def params(self, **values):
            return spec.family.param_struct()(**values)

    kern = FakeKernel()
    params = kern.params()
    tensors = {"q": (16, bhs_dims(q, layout)[1]), "k": (32, bhs_dims(k, layout)[1]),
               "v": (48, bhs_dims(v, layout)[1]), "dout": (64, bhs_dims(do, layout)[1]),
               "dq_acc": (80, (h * nq * D, nq * D, D))}
    spec.family.write_maps(params, spec, (b, h, hk, nq, nk, d, D), tensors)
    byptr = {c[0]: c for c in calls}

    def want(t, n, hh):
        s = t.stride()
        seq, head = (s[2], s[1]) if layout == "bhsd" else (s[1], s[2])
        return (d, n, hh, b), (2 * seq, 2 * head, 2 * s[0])

    for ptr, t, n, hh, rows in ((16, q, nq, h, 64), (32, k, nk, hk, 128), (48, v, nk, hk, 128), (64, do, nq, h, 64)):
        dims, strides = want(t, n, hh)
        assert byptr[ptr][1:] == ("bf16", dims, strides, (64 if D % 64 == 0 else 32, rows, 1, 1)), (layout, ptr)
    assert byptr[80][1:] == ("fp32", (D, nq, h, b), (4 * D, 4 * nq * D, 4 * h * nq * D), (32, 64, 1, 1))


# ---------------------------------------------------------------- the addressing model


@pytest.mark.parametrize("d,bn,bm", [(64, 128, 64), (128, 128, 64), (64, 64, 64), (32, 128, 64), (96, 128, 64),
                                     (96, 64, 64), (32, 64, 64), (192, 64, 64), (256, 64, 64), (64, 128, 128),
                                     (32, 128, 128), (64, 64, 128)])
def test_smem_layout_model(d, bn, bm):
    """CPU model of bwd_sm90's shared-memory addressing (the constants of bwd_sm90.cuh, restated).

    Where the TMA puts Q, K, V, dO (panels of rb-byte rows, rb = 128 where d is a multiple of 64, else
    64, in the matching swizzle: 16-byte chunk c ^ (r % (rb / 16)) of a row) must be where the wgmma
    descriptors read them: K-major (start + k16 step, SBO 8 rows) for S^T = K_w Q^T and dP^T; MN-major
    (LBO = panel stride, SBO 8 rows) for dO / Q as B of dV / dK. The dS^T stores (a per-lane base XOR 32
    kk) must be where the MN-major A descriptor of dQ = dS K reads dS (128-byte rows), and K's MN-major B,
    started inside a swizzle row for a warpgroup's columns, must read K[:, its columns] -- assuming, as
    for the K-major k steps of the forward (start + 32 B), that the swizzle applies to the computed
    address (the dS^T stores are stmatrix x4: lane l addresses row l % 8 of matrix l / 8). dQ's 32-column
    panels split over the warpgroups as the kernel splits them (the first take one more; each computes
    the widest share over a window ending at d, and stages only its own columns). The fp32
    staging stores (row base XOR 32 (nj % 4)) must be where the TMA's reduce reads a 32-column box
    (128-byte swizzle on 4-byte elements). Above d = 128 (split): both warpgroups hold every key, S^T
    / dP^T for 32 queries each (B's rows from 32 cw), P^T and dS^T stored with that query offset, and
    dV / dK of d / 2 columns each from SS descriptors (A K-major from the P^T / dS^T buffers, B MN-major
    from the warpgroup's first panel). A block of 128 queries (bm): S^T / dP^T of 128 queries, dS^T in two
    panels of 64 queries (k16 step kk of the stores in panel kk / 4 at XOR 32 (kk % 4)), and dQ's part in
    two m64 GEMMs, one per panel, staged at rows 64 mq + ....
    """
    import numpy as np

    split = d > 128
    st, nwg, mq_n = 2, 2 if split else bn // 64, bm // 64
    half = d // 2 if split else d  # a warpgroup's dK / dV columns
    qn = bm // 2 if split else bm  # a warpgroup's S^T / dP^T queries
    rb = 128 if half % 64 == 0 and d % 64 == 0 else 64  # bytes per swizzle row of Q, K, V, dO
    pc, kpp = rb // 2, rb // 32  # columns per panel, k16 steps per panel row
    dqp = d // 32
    dq_lo, dq_hi = dqp // nwg * 32, -(-dqp // nwg) * 32
    dq_n = [dq_hi if dq_lo == dq_hi or cw < dqp % nwg else dq_lo for cw in range(nwg)]
    dq_c0 = [cw * dq_lo + min(cw, dqp % nwg) * 32 for cw in range(nwg)]
    dq_w0 = [min(c0, d - dq_hi) for c0 in dq_c0]
    assert sum(dq_n) == d and all(dq_c0[cw] + dq_n[cw] == (dq_c0 + [d])[cw + 1] for cw in range(nwg))
    assert families.family("bwd_sm90").dq_cols(bwd90(d, bn)) == (dq_hi, dq_lo)

    def swz(addr, row=128):  # the swizzle on a base aligned to its period: chunk bits ^= row bits
        return addr ^ (((addr >> 7) & (row // 16 - 1)) << 4)

    def tma_addr(base, rows, r, c, elem=2, row=128):  # box of `row` bytes x rows, one box per panel
        per = row // elem
        return swz(base + (c // per) * rows * row + r * row + (c % per) * elem, row)

    def kmajor(start, i, k):
        return swz(start + (i // 8) * 8 * rb + (i % 8) * rb + 2 * k, rb)

    def mnmajor(start, lbo, k, n, row=rb):
        per = row // 2
        return swz(start + (n // per) * lbo + (k // 8) * 8 * row + (k % 8) * row + 2 * (n % per), row)

    kmajor_off = lambda kk, rows: (kk // kpp) * rows * rb + (kk % kpp) * 32  # noqa: E731
    kv_bytes, qt_bytes, ds_bytes = bn * d * 2, bm * d * 2, bn * bm * 2
    sK = 0
    sV = sK + kv_bytes
    sQ = sV + kv_bytes
    sdO = sQ + st * qt_bytes
    sdS = sdO + st * qt_bytes
    sP = sdS + 2 * ds_bytes  # (split: P^T's two buffers)
    sStg = sP + (2 * ds_bytes if split else 0)
    assert all(x % 1024 == 0 for x in (sV, sQ, sdO, sdS, sP, sStg, qt_bytes))  # (the swizzles' periods)
    rng = np.random.default_rng(0)
    s, buf = 1, 1  # stage 1, dS buffer 1
    smem = {}
    K, V = (rng.integers(-4, 5, size=(bn, d)) for _ in range(2))
    Q, dO = (rng.integers(-4, 5, size=(bm, d)) for _ in range(2))
    for M, base, rows in ((K, sK, bn), (V, sV, bn), (Q, sQ + s * qt_bytes, bm), (dO, sdO + s * qt_bytes, bm)):
        for r in range(rows):
            for c in range(d):
                smem[tma_addr(base, rows, r, c, row=rb)] = M[r, c]
    dS, P = (rng.integers(-3, 4, size=(bm, bn)) for _ in range(2))  # queries x keys
    # dS^T stores, stmatrix x4 per k16 step kk of warp wq in warpgroup cw: lane l addresses row l % 8 of
    # matrix l / 8; matrix i's row r is written from register i of lanes 4r .. 4r + 3, lane 4r + t holding
    # its pair at columns 2t, 2t + 1; register i of a thread is da[kk][i], (key row g + 8 (i % 2),
    # queries qh0 + 8 (2kk + i // 2) + 2t, + 1) with g = r (split: qh0 = 32 cw, the rows every key's, and
    # P^T stored likewise 2 buffers after).
    written = set()
    for M, off in ((dS, 0), (P, 2 * ds_bytes)) if split else ((dS, 0),):
        for cw in range(nwg):
            qh0, k0 = (qn * cw, 0) if split else (0, cw * 64)
            for wq in range(4):
                bases = [sdS + (k0 + wq * 16 + 8 * ((lane >> 3) & 1) + (lane & 7)) * 128
                         + ((((lane >> 4) ^ lane) & 7) << 4) + buf * ds_bytes for lane in range(32)]
                for kk in range(qn // 16):
                    for i in range(4):
                        for r in range(8):
                            row_addr = (((bases[8 * i + r] + off) ^ ((kk % 4 + qh0 // 16) << 5))
                                        + (kk // 4) * bn * 128)
                            key, nj = k0 + wq * 16 + r + 8 * (i % 2), 2 * kk + i // 2
                            for t in range(4):
                                a = row_addr + 4 * t
                                q = qh0 + 8 * nj + 2 * t
                                smem[a], smem[a + 2] = M[q, key], M[q + 1, key]
                                written |= {a, a + 2}
    assert len(written) == bn * bm * (2 if split else 1)  # every element of the buffers once
    staged = set()
    for cw in range(nwg):
        # S^T = K_w Q^T (and dP^T = V_w dO^T, same descriptors)
        qh0, k0, dkv0 = (qn * cw, 0, half * cw) if split else (0, cw * 64, 0)
        for A, B, sa, sb in ((K, Q, sK, sQ), (V, dO, sV, sdO)):
            S = np.zeros((64, qn), dtype=np.int64)
            for kk in range(d // 16):
                a0 = sa + k0 * rb + kmajor_off(kk, bn)
                b0 = sb + s * qt_bytes + qh0 * rb + kmajor_off(kk, bm)
                Am = np.array([[smem[kmajor(a0, i, k)] for k in range(16)] for i in range(64)])
                Bm = np.array([[smem[kmajor(b0, n, k)] for k in range(16)] for n in range(qn)])
                S += Am @ Bm.T
            assert (S == A[k0:k0 + 64] @ B[qh0:qh0 + qn].T).all()
        # dV += P^T dO, dK += dS^T Q: B MN-major from the warpgroup's first column (a panel's), LBO = the
        # panel stride of a 64-row tile; A from registers (a random P^T here), or (split) K-major from the
        # P^T / dS^T buffers (128-byte rows of 64 queries, k16 step kk at byte 32 kk)
        Pr = rng.integers(-3, 4, size=(64, bm))
        assert dkv0 % pc == 0
        for B, sb, At, sa in ((dO, sdO, P.T, sP), (Q, sQ, dS.T, sdS)):
            At = At if split else Pr
            O = np.zeros((64, half), dtype=np.int64)
            for kk in range(bm // 16):
                b0 = sb + s * qt_bytes + (dkv0 // pc) * bm * rb + kk * 16 * rb
                Bm = np.array([[smem[mnmajor(b0, bm * rb, k, n)] for n in range(half)] for k in range(16)])
                if split:
                    a0 = sa + buf * ds_bytes + 32 * kk
                    Am = np.array([[smem[swz(a0 + (i // 8) * 1024 + (i % 8) * 128 + 2 * k)] for k in range(16)]
                                   for i in range(64)])
                else:
                    Am = At[:, 16 * kk:16 * kk + 16]
                O += Am @ Bm
            assert (O == At @ B[:, dkv0:dkv0 + half]).all()
        n, c0, w0 = dq_n[cw], dq_c0[cw], dq_w0[cw]
        assert w0 <= c0 and c0 + n <= w0 + dq_hi <= d and w0 % 32 == 0
        # dQ[:, window] = dS K[:, window]: A = dS MN-major (128-byte rows) from sdS, B = K MN-major
        kstart = sK + (w0 // pc) * bn * rb + (w0 % pc) * 2
        dQ = np.zeros((bm, dq_hi), dtype=np.int64)
        for mq in range(mq_n):  # queries [64 mq, 64 mq + 64): dS^T's panel mq
            for kk in range(bn // 16):
                a0 = sdS + buf * ds_bytes + mq * bn * 128 + kk * 16 * 128
                Am = np.array([[smem[mnmajor(a0, ds_bytes, k, m, row=128)] for k in range(16)] for m in range(64)])
                Bm = np.array([[smem[mnmajor(kstart + kk * 16 * rb, bn * rb, k, j)] for j in range(dq_hi)]
                               for k in range(16)])
                dQ[64 * mq:64 * mq + 64] += Am @ Bm
        assert (dQ == dS @ K[:, w0:w0 + dq_hi]).all()
        skip = (c0 - w0) // 8
        # staging: thread (wq, g, t), row h, its own chunks nj of part mq hold dQ[64 mq + krow + 8h, w0 + 8 nj
        # + 2t (+1)]; the tile of all d columns (column col in panel col / 32), or dq_write 4's of the
        # warpgroup's own, which the dQ writer adds from its first panel at column c0 (column col in panel
        # (col - c0) / 32)
        for halves in (False, True):
            pan0 = w0 // 32 - (c0 // 32 if halves else 0)
            for wq in range(4):
                for g in range(8):
                    for t in range(4):
                        for h, mq in itertools.product(range(2), range(mq_n)):
                            r = 64 * mq + wq * 16 + g + 8 * h
                            base = sStg + pan0 * bm * 128 + r * 128 + (((t >> 1) ^ g) << 4) + (t & 1) * 8
                            for nj in range(skip, skip + n // 8):
                                a = (base ^ ((nj % 4) << 5)) + (nj // 4) * bm * 128
                                col = w0 + 8 * nj + 2 * t
                                box = (col - c0 if halves else col) // 32
                                for e in range(2):
                                    assert a + 4 * e == tma_addr(sStg + box * bm * 128, bm, r, (col + e) % 32,
                                                                 elem=4), (cw, wq, g, t, h, nj, e, halves)
                                    staged.add((r, col + e, halves))
                                    assert not halves or 0 <= box < dq_hi // 32  # (inside the one tile)
    assert len(staged) == 2 * bm * d  # every dQ column from one warpgroup, both ways


# ---------------------------------------------------------------- compiles


@pytest.fixture(scope="module")
def compiled(compile_session):
    return compile_session.build_all(ALL)


@pytest.mark.parametrize("spec", ALL, ids=lambda s: s.name)
def test_compiles_clean_for_sm90a(spec, compiled):
    # (the barriers the fit counts are the kernel's static shared memory)
    assert compiled[spec].report.static_smem == spec.family.static_smem_bytes(spec), spec.name
    binary = clean_binary(compiled, spec)
    r = binary.report
    assert "C75" not in binary.log, binary.log  # C7508 setmaxnreg ignored, C7510-C7519 wgmma diagnostics
    assert r.static_smem + spec.smem_bytes() <= BUDGET


def test_sass_has_hgmma_tma_and_reduce(tmp_path, compiled):
    """The d=128 default's SASS: HGMMA, UTMALDG (Q/K/V/dO), UBLKCP (LSE2/D rows), UTMAREDG (the dQ
    reduce-add) -- with a disassembler that reads the cubin, or a local nvcc's build of the same
    source (optional tools; skips without them)."""
    spec = bwd90(causal=True)
    sass, nvcc_log = sass_of(spec, compiled[spec].cubin, tmp_path)
    if nvcc_log is not None:  # SASS from a local nvcc's build: its ptxas log must be clean too
        assert "C75" not in nvcc_log and "spill stores" in nvcc_log and " 0 bytes spill stores" in nvcc_log, nvcc_log
    assert sass.count("HGMMA") >= 32
    for op in ("UTMALDG", "UBLKCP", "UTMAREDG", "USETMAXREG"):
        assert op in sass, op


@pytest.mark.parametrize("spec", [bwd90(64, 128, 3 if w in (2, 4, 5) else 2, w) for w in range(6)]
                         + [bwd90(64, 128, 2, 0).replace(det=True), bwd90(256, 64, 2, 5).replace(det=True)],
                         ids=lambda s: s.name)
def test_dq_path_matches_the_family(spec):
    """The template's dQ path is the one the family's Python sets describe (WRITER_DQ, HALVES_DQ: the fit, the
    writer's barriers, the host): a staged mode (dq_write 0, 2, 4, 5, and det) adds dQ only by the TMA's bulk
    reduce, never by a thread's red.global; dq_write 1 and 3 only by red.global.add.v2 / .v4. (dq_write 5 once
    fell through to the vector adds while its writer waited for staged parts: a hang the CPU tiers missed.)"""
    ptx = ptx_of(spec.validate())
    reds = set(re.findall(r"red\.global\.add\.v\d\.f32", ptx))
    bulk = "cp.reduce.async.bulk" in ptx
    if spec.dq_write in (1, 3):
        assert reds == {f"red.global.add.v{2 if spec.dq_write == 1 else 4}.f32"} and not bulk, (reds, bulk)
    else:
        assert not reds and bulk, (reds, bulk)


def fake_device(monkeypatch):
    """The backward's launches without a GPU: a fake sm_90a device and loader; returns the (spec, grid,
    params) list the launches fill and the tensor maps' (dtype, dims, box) list."""
    torch = pytest.importorskip("torch")
    from flashgen import tma
    from flashgen.api import backward, device

    class Dev:
        index, arch, gpu, smem_budget, sms = 0, "sm_90a", "h200", BUDGET, 132

    launched, maps = [], []

    class FakeKernel:
        def __init__(self, spec):
            self.spec = spec

        def params(self, **values):
            return self.spec.family.param_struct()(**values)

        def launch(self, grid, params, stream):
            launched.append((self.spec, grid, params))

    monkeypatch.setattr(device.Device, "of", classmethod(lambda cls, i: Dev()))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(device, "current_device", lambda: 0)
    monkeypatch.setattr(device, "current_stream", lambda i: 0)
    monkeypatch.setattr(backward, "load", lambda spec, index, **options: FakeKernel(spec))
    monkeypatch.setattr(backward, "ensure_context", lambda index: None)  # (no CUDA driver here)
    monkeypatch.setattr(tma, "encode", lambda ptr, dtype, dims, strides, box: maps.append((dtype, tuple(dims), tuple(box)))
                        or bytes(range(128)))
    return launched, maps


def meta_inputs(b, h, hk, nq, nk, d):
    """q, k, v, dout, out and lse of a bf16 backward call as meta tensors (bhsd)."""
    torch = pytest.importorskip("torch")
    q, do = (torch.empty(b, h, nq, d, dtype=torch.bfloat16, device="meta") for _ in range(2))
    k, v = (torch.empty(b, hk, nk, d, dtype=torch.bfloat16, device="meta") for _ in range(2))
    return q, k, v, do, torch.empty_like(q), torch.empty(b, h, nq, device="meta")


@pytest.mark.parametrize("how", ["env", "specs"])
def test_host_launch_sequence(monkeypatch, how):
    """attention_backward with bwd_sm90 (meta tensors, a fake device and loader): preprocess (which
    zeroes the dQ accumulator), bwd_sm90 over (key blocks, KV heads, batch) with its maps and
    parameters, then bwd_convert; deterministic=True takes the same tile's det twin (the mma.sync pair
    where the twin spills)."""
    from flashgen.api import backward

    launched, maps = fake_device(monkeypatch)
    b, h, hk, nq, nk, d = 2, 8, 2, 300, 333, 128
    q, k, v, do, out, lse = meta_inputs(b, h, hk, nq, nk, d)
    specs = None
    if how == "env":
        monkeypatch.setenv("FLASHGEN_BWD_FAMILY", "bwd_sm90")
    else:
        specs = {"bwd_dkdv": bwd90(causal=True, dq_write=1)}
    dq, dk, dv = backward.attention_backward(do, q, k, v, out, lse, True, 0.1, specs=specs)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)
    kinds = [s.kind for s, _, _ in launched]
    assert kinds == ["bwd_preprocess", "bwd_sm90", "bwd_convert"], kinds
    spec, grid, p = launched[1]
    assert spec == (bwd90(causal=True, dqe=True) if how == "env" else specs["bwd_dkdv"])
    assert grid == (3, hk, b) and backward.last_specs[0] == spec
    assert (p.nq, p.nk, p.nq_pad, p.heads, p.group, p.d) == (nq, nk, 384, h, h // hk, d)
    assert p.scale == pytest.approx(0.1) and p.scale_log2 == pytest.approx(0.1 * 1.4426950408889634)
    assert bytes(p.tm_q.v)[:8] == bytes(range(8)) and bytes(p.tm_dq.v)[120:] == bytes(range(120, 128))
    assert sorted(maps) == sorted([("bf16", (d, nq, h, b), (64, 64, 1, 1))] * 2 + [("bf16", (d, nk, hk, b), (64, 128, 1, 1))] * 2
                                  + [("fp32", (d, nq, h, b), (32, 64, 1, 1))])
    launched.clear()
    if how == "env":  # deterministic: the det twin of the same tile (dQ's adds take turns), or the mma.sync pair
        backward.attention_backward(do, q, k, v, out, lse, True, 0.1, deterministic=True)
        assert [s.kind for s, _, _ in launched] == ["bwd_preprocess", "bwd_sm90", "bwd_convert"]
        assert launched[1][0] == bwd90(causal=True, dqe=True).replace(det=True) and launched[1][1] == (3, hk, b)
        launched.clear()
        # without a causal mask the det twin walks the query blocks rotated, in chunks of det_rotation's size
        backward.attention_backward(do, q, k, v, out, lse, False, 0.1, deterministic=True)
        # (3 key, 5 query blocks)
        assert launched[1][0] == bwd90(dqe=True).replace(det=True) and launched[1][2].dq_rot == 3
        launched.clear()
        monkeypatch.setattr(backward, "_refused", lambda spec: True)  # a twin that spills: not taken
        backward.attention_backward(do, q, k, v, out, lse, True, 0.1, deterministic=True)
        assert [s.kind for s, _, _ in launched] == ["bwd_preprocess", "bwd_dkdv_nodq", "bwd_dq"]
    else:
        with pytest.raises(ValueError, match="adds dQ in any order"):
            backward.attention_backward(do, q, k, v, out, lse, True, 0.1, deterministic=True, specs=specs)
        det = {"bwd_dkdv": bwd90(causal=True).replace(det=True)}
        backward.attention_backward(do, q, k, v, out, lse, True, 0.1, deterministic=True, specs=det)
        assert [s.kind for s, _, _ in launched] == ["bwd_preprocess", "bwd_sm90", "bwd_convert"]
        assert launched[1][0] == det["bwd_dkdv"]


def test_head_dim_96_routes_by_family(monkeypatch):
    """d = 80 (tile 96): by default bwd_sm90 (dQ into the accumulator, 32-column boxes), whose dQ mode is
    always the accumulator's; the mma.sync family forced keeps its separate dQ kernel there (bwd.DQ_MODE);
    an mma.sync spec forced through specs= runs the separate pair as before; an explicit dq_mode wins."""
    from flashgen.api import backward

    launched, maps = fake_device(monkeypatch)
    b, h, hk, nq, nk, d = 1, 4, 2, 200, 130, 80
    q, k, v, do, out, lse = meta_inputs(b, h, hk, nq, nk, d)

    def kinds(**kw):
        launched.clear()
        backward.attention_backward(do, q, k, v, out, lse, False, 0.1, **kw)
        return [s.kind for s, _, _ in launched]

    monkeypatch.delenv("FLASHGEN_BWD_FAMILY", raising=False)
    assert kinds() == ["bwd_preprocess", "bwd_sm90", "bwd_convert"]
    assert launched[1][0] == bwd90(96, dqe=True) and launched[1][1] == (2, hk, b)
    assert ("bf16", (d, nq, h, b), (32, 64, 1, 1)) in maps and ("fp32", (96, nq, h, b), (32, 64, 1, 1)) in maps
    assert kinds(deterministic=True)[1] == "bwd_sm90" and launched[1][0] == bwd90(96, dqe=True).replace(det=True)
    assert kinds(dq_mode="separate") == ["bwd_preprocess", "bwd_dkdv_nodq", "bwd_dq"]
    monkeypatch.setenv("FLASHGEN_BWD_FAMILY", "bwd_dkdv")
    assert kinds() == ["bwd_preprocess", "bwd_dkdv_nodq", "bwd_dq"]
    assert kinds(dq_mode="atomic") == ["bwd_preprocess", "bwd_dkdv", "bwd_convert"]
    monkeypatch.delenv("FLASHGEN_BWD_FAMILY")
    mma = dispatch.select(ProblemKey("bwd_dkdv", "sm_90a", "bf16", 96, False, 512), None, BUDGET, family="bwd_dkdv")
    assert kinds(specs={"bwd_dkdv": mma}) == ["bwd_preprocess", "bwd_dkdv_nodq", "bwd_dq"]


def test_torch_deterministic_algorithms_take_the_deterministic_path(monkeypatch):
    """torch.use_deterministic_algorithms(True) when the backward runs: the det twin, as deterministic=True
    gives; mods' backward kernels made without their deterministic form (api.modcall asks for that form under
    the flag) raise torch's RuntimeError, or warn with warn_only=True."""
    from types import SimpleNamespace

    torch = pytest.importorskip("torch")
    from flashgen.api import backward

    launched, _ = fake_device(monkeypatch)
    q, do = (torch.empty(1, 4, 200, 64, dtype=torch.bfloat16, device="meta") for _ in range(2))
    out, lse = torch.empty_like(q), torch.empty(1, 4, 200, device="meta")
    torch.use_deterministic_algorithms(True)
    try:
        backward.attention_backward(do, q, q, q, out, lse, False, 0.1)
        assert launched[1][0] == bwd90(d=64, dq_write=4, bm=128, dqe=True).replace(det=True)
        with pytest.raises(RuntimeError, match="score_mod / mask_mod .* torch.use_deterministic_algorithms"):
            backward.attention_backward(do, q, q, q, out, lse, False, 0.1, mods=SimpleNamespace(deterministic=False))
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="no deterministic form"):
            backward._alert_nondeterministic("this backward")
    finally:
        torch.use_deterministic_algorithms(False)
    launched.clear()
    backward.attention_backward(do, q, q, q, out, lse, False, 0.1)
    assert not launched[1][0].det
    # kernels forced for study (the tuner's dQ keys): deterministic=True keeps the caller's mma.sync pair
    from flashgen.problem import ProblemKey

    dq_spec = families.default_spec(ProblemKey("bwd_dq", "sm_90a", "bf16", 64, False, 512, ""), BUDGET)
    launched.clear()
    backward.attention_backward(do, q, q, q, out, lse, False, 0.1, deterministic=True, specs={"bwd_dq": dq_spec})
    assert [s.kind for s, _, _ in launched] == ["bwd_preprocess", "bwd_dkdv_nodq", "bwd_dq"]
    assert launched[2][0] == dq_spec


def test_wgmma_descriptors_stay_in_uniform_registers(tmp_path, compiled):
    """As in test_sm90.py: at most one R2UR just before every four HGMMA. Before the consumer index was
    broadcast from lane 0, the shipped specs had 12-17 of them before 24-32 HGMMA (SASS)."""
    for spec, binary in compiled.items():
        if isinstance(binary, Exception):
            raise binary
        near, hgmma = r2ur_before_hgmma(spec, binary.cubin, tmp_path)
        assert hgmma and near <= hgmma // 4, f"{spec.name}: {near} R2UR just before its {hgmma} HGMMA"
    assert compiled


def test_dq_vector_adds_cover_each_element_once():
    """dq_write 3's lane-pair swap (templates/bwd_sm90): lane t of a quad holds dQ[krow + 8h][8nj + 2t + e]
    as acc[4nj + 2h + e]; after the two shuffles with lane t ^ 1 each lane adds four consecutive columns
    of one row (even t: row krow, from column 2t; odd t: row krow + 8, from column 2t - 2), so the quad's
    four vector adds cover the 2 x 8 block once, each with its own value."""
    nj_count = 4
    acc = {t: [(h, 8 * nj + 2 * t + e) for nj in range(nj_count) for h in (0, 1) for e in (0, 1)]
           for t in range(4)}  # acc[t][4nj + 2h + e] = the (row half, column) it holds
    added = []
    for t in range(4):
        odd, partner = t & 1, acc[t ^ 1]
        row, col0 = (1 if odd else 0), 2 * (t & ~1)
        for nj in range(nj_count):
            mine = acc[t][4 * nj:4 * nj + 4]
            # each lane sends the pair of the row it does not keep: odd lanes row krow's, even lanes krow + 8's
            got = partner[4 * nj + 2:4 * nj + 4] if odd else partner[4 * nj:4 * nj + 2]
            keep = mine[2:4] if odd else mine[0:2]
            vec = got + keep if odd else keep + got
            assert vec == [(row, 8 * nj + col0 + i) for i in range(4)], (t, nj, vec)
            added += vec
    assert sorted(added) == sorted(x for t in range(4) for x in acc[t])


def _halves_turns(nwg, steps, seed, own_barriers=True, panels=1):
    """One random schedule of dq_write 4's hand-offs (templates/bwd_sm90), restated: each step, after the
    consumers' named barrier, warpgroup w waits on bar_se(w) (the part before its turn read: warpgroup w - 1's
    of this step, the last one's of the step before for w = 0), stages its part and arrives on bar_sf(w); the
    dQ writer waits on bar_sf(w) of each step in warpgroup order, has the TMA read the tile and arrives on
    bar_se(w + 1). An mbarrier's parity wait passes once the phase of that parity has completed, i.e. while
    its completed phases' count has the other parity (so a wait two phases early passes). Returns None,
    or what went wrong. ``own_barriers=False``: one shared bar_se, each use u waiting for use u - 1's read
    (the parity of u - 1). ``panels`` > 1: dq_write 5, the tile in panels, each with its own empty barrier
    per warpgroup (bar_sep(w, p)): a warpgroup waits for panel p before staging it, the writer reads the
    panels in order and frees each on its own."""
    import random

    rnd = random.Random(seed)
    done = {}  # barrier -> completed phases (one arrival completes a phase: the 128 threads as one)

    def passes(bar, k):  # wait for completion k: parity k & 1
        return done.get(bar, 0) & 1 != k & 1

    def arrive(bar):
        done[bar] = done.get(bar, 0) + 1

    tile = [None] * panels  # per panel: ("written", it, w) or None (free: read)
    cons = [[0, "sync", 0] for _ in range(nwg)]  # per warpgroup: step, where, the next panel to stage
    wr = [0, 0, -1]  # writer: step, warpgroup, the last panel read (-1: waiting for the part)
    released = -1  # the last step whose named barrier every warpgroup has reached
    while True:
        if all(c[:2] == [released + 1, "sync"] for c in cons):
            released += 1
        moves = []
        for w, (it, where, pn) in enumerate(cons):
            if it == steps:
                continue
            if where == "sync" and released >= it:
                moves.append(("sync", w))
            elif where == "wait":
                if own_barriers:
                    k = it - 1 if w == 0 else it
                    ok = k < 0 or passes(("se", w, pn), k)
                else:
                    u = it * nwg + w
                    ok = u == 0 or passes("se", u - 1)
                if ok:
                    moves.append(("stage", w))
        if wr[0] < steps and (wr[2] >= 0 or passes(("sf", wr[1]), wr[0])):
            moves.append(("read", None))
        if not moves:
            return None if wr[0] == steps and all(c[0] == steps for c in cons) else "deadlock"
        what, w = rnd.choice(moves)
        if what == "sync":
            cons[w][1:] = ["wait", 0]
        elif what == "stage":
            it, _, pn = cons[w]
            if tile[pn] is not None:
                return f"warpgroup {w} staged step {it} panel {pn} over {tile[pn]}"
            tile[pn] = ("written", it, w)
            if pn + 1 < panels:
                cons[w][2] = pn + 1
            else:
                arrive(("sf", w))
                cons[w] = [it + 1, "sync", 0]
        else:
            it, w, last = wr
            pn = last + 1
            if tile[pn] != ("written", it, w):
                return f"the writer read {tile[pn]} for step {it}, warpgroup {w}, panel {pn}"
            tile[pn] = None
            arrive(("se", (w + 1) % nwg, pn) if own_barriers else "se")
            wr[:] = [it, w, pn] if pn + 1 < panels else [it + (w + 1) // nwg, (w + 1) % nwg, -1]


def test_dq_halves_turns_model():
    """dq_write 4's one staging tile: over random schedules every part is staged on a free tile and read by
    the writer once, with no deadlock, for 1-3 consumer warpgroups; dq_write 5's, freed panel by panel (2-4
    panels a part), likewise. The same hand-off on one shared empty barrier fails: a warpgroup can wait two
    phases early (the parity of a phase not yet reached)."""
    for nwg in (1, 2, 3):
        for panels in (1, 2, 4):
            for seed in range(200 if panels == 1 else 100):
                assert _halves_turns(nwg, 6, seed, panels=panels) is None, (nwg, panels, seed)
    assert any(_halves_turns(2, 6, seed, own_barriers=False) for seed in range(300))


def det_walk(n_block, key_blocks, query_blocks, rot):
    """The bwd_sm90 template's rotated walk (ROT, rot_turn), restated: where key block ``n_block``'s CTA starts
    its walk over ``query_blocks`` blocks under chunk ``rot``, and its turn at each query block (its position
    among the key blocks that add to it)."""
    m = query_blocks
    c, j = divmod(n_block, rot)
    rc = min(rot, key_blocks - c * rot)
    start = 0 if j == 0 else m - j
    return start, [c * rot + (j + max(0, u + rc - m) if u + j < m else j - (m - u)) for u in range(m)]


def _rotated_order(key_blocks, query_blocks, rot):
    """Each CTA's walk under chunk ``rot`` (det_walk's start, then cyclically) and, per query block, the
    CTAs in the order they reach it: the chunks in order, within one by the step they reach it at."""
    walks = [[(det_walk(n, key_blocks, query_blocks, rot)[0] + s) % query_blocks for s in range(query_blocks)]
             for n in range(key_blocks)]
    order = [sorted(range(key_blocks), key=lambda n: (n // rot, walks[n].index(m))) for m in range(query_blocks)]
    return walks, order


def test_det_rotation_turns_follow_arrival():
    """The det twin's rotated walk (templates/bwd_sm90, rot_turn): every CTA visits every query block once,
    the CTAs of a chunk reach a block at different steps, and each CTA's turn at a block is its place in the
    order of arrival (the chunks before first), so the turns at a block are 0 .. K - 1. A chunk of 1 is the
    walk from block 0 with the turns in key-block order."""
    from flashgen.families.bwd_sm90 import det_rotation

    for kb in range(1, 14):
        for mb in range(1, 14):
            for rot in range(1, min(kb, mb) + 1):
                walks, order = _rotated_order(kb, mb, rot)
                for n in range(kb):
                    assert sorted(walks[n]) == list(range(mb))
                    turns = det_walk(n, kb, mb, rot)[1]
                    assert [order[m].index(n) for m in range(mb)] == turns, (kb, mb, rot, n)
                    if rot == 1:
                        assert walks[n] == list(range(mb)) and turns == [n] * mb
                for m in range(mb):
                    for c in range(0, kb, rot):
                        steps = [walks[n].index(m) for n in range(c, min(kb, c + rot))]
                        assert len(set(steps)) == len(steps)
    assert [det_rotation(*a, 132) for a in ((32, 32), (128, 128), (16, 32), (3, 5), (65, 129), (8, 2))] == \
        [32, 64, 16, 3, 64, 2]
    assert det_rotation(40, 40, 60) == 30 and det_rotation(0, 0, 132) == 1


def _rotated_schedule(key_blocks, query_blocks, rot, slots, group, seed):
    """One random schedule of the det twin's turns: CTAs start in launch order as slots free up (a CTA frees
    its slot when done), each walks (query head, query block) steps, its heads in turn, and adds to a block
    only when the block's counter reads its turn. Returns True if every CTA finishes, False at a deadlock."""
    import random

    rnd = random.Random(seed)
    plan = [det_walk(n, key_blocks, query_blocks, rot) for n in range(key_blocks)]
    counter = [[0] * query_blocks for _ in range(group)]
    step, running, launched = [0] * key_blocks, [], 0
    total = group * query_blocks
    while True:
        while launched < key_blocks and len(running) < slots:
            running.append(launched)
            launched += 1
        ready = []
        for n in running:
            qh, s = divmod(step[n], query_blocks)
            m = (plan[n][0] + s) % query_blocks
            if counter[qh][m] == plan[n][1][m]:
                ready.append((n, qh, m))
        if not ready:
            return not running and launched == key_blocks
        n, qh, m = rnd.choice(ready)
        counter[qh][m] += 1
        step[n] += 1
        if step[n] == total:
            running.remove(n)


def test_det_rotation_needs_a_chunk_resident():
    """The rotated walk's turns always come (random schedules, GQA groups of 1 and 2) while a chunk fits the
    slots the GPU holds at once, and can deadlock when it does not: a CTA waits for one of its chunk launched
    after it. det_rotation keeps a chunk within half the SMs."""
    for kb, mb, rot, slots in ((8, 8, 8, 8), (9, 5, 4, 4), (13, 13, 5, 6), (7, 3, 3, 3), (12, 12, 1, 2)):
        for group in (1, 2):
            for seed in range(40):
                assert _rotated_schedule(kb, mb, rot, slots, group, seed), (kb, mb, rot, slots, group, seed)
    assert not all(_rotated_schedule(8, 8, 8, 4, 1, seed) for seed in range(40))
