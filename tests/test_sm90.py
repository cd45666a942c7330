"""fwd_sm90 (Hopper: TMA + wgmma) without a GPU: spec rules, names, the default rule, and compiles.

Every spec the fwd_sm90 default rule can pick, and the ablation variants the
benchmark times, compile with NVRTC for sm_90a with no spills, no stack frame
and none of ptxas's Hopper diagnostics (C7508 setmaxnreg ignored, C7510-C7515
wgmma serialized). Where a cuobjdump/nvdisasm is found, the SASS must hold
HGMMA (pip's disassemblers may not read NVRTC 13.5 cubins: then a local nvcc,
if any, compiles the same source for the check; otherwise it skips).
"""
from __future__ import annotations

import os

import pytest

from flashgen import KernelSpec, UnsupportedError, dispatch, gpus
from flashgen.codegen import parse_ptxas_log
from flashgen.families import SM90_ABLATION, sm90_flag_set, sm90_named_spec
from build_util import build_all, clean_binary, r2ur_before_hgmma, sass_of

H200 = gpus.get("h200")


def sm90(d=128, bm=128, bn=128, st=2, ws=True, pp=True, ov=True, causal=False, dtype="bf16", persist=False):
    return KernelSpec(kind="fwd_sm90", arch="sm_90a", dtype=dtype, head_dim=d, block_m=bm, block_n=bn,
                      warps=4 * (bm // 64 + ws), stages=st, warpspec=ws, pingpong=pp, overlap=ov, causal=causal,
                      persist=persist)


# The ablation ladder the benchmark and the GPU tests run (flags off -> all on).
ABLATION = [dict(ws=False, pp=False, ov=False), dict(ws=False, pp=False, ov=True), dict(ws=True, pp=False, ov=False),
            dict(ws=True, pp=True, ov=False), dict(ws=True, pp=False, ov=True), dict(ws=True, pp=True, ov=True)]
DEFAULTS = dispatch.default_specs("sm_90a", gpus.ARCH_SMEM_PER_BLOCK["sm_90a"], kind="fwd_sm90")
VARIANTS = [sm90(d=d, bn=bn, causal=c, **f) for d, bn in ((64, 128), (128, 128), (256, 64)) for c in (False, True)
            for f in ABLATION] + [sm90(d=64, bm=64, ws=False, pp=False, ov=False),
                                  sm90(d=128, bm=64, ws=False, pp=False, ov=False, dtype="fp16")] + [
    # 3-stage K/V ring at d=128, 128x128 (229 KB of the 227 KB + 1 KB opt-in: fits), causal both.
    sm90(d=128, st=3, causal=c, **f) for c in (False, True) for f in ABLATION[2:]]
# The benchmark's ablation (emu, sepkv, lazy, deeper rings, 192-row/192-key tiles at d=64), causal both, and
# the new flags at d=256 (2 stages: a third does not fit) and in fp16 and without warpspec.
NEW_VARIANTS = [sm90_named_spec(d, c, n) for d, names in SM90_ABLATION.items() for n in names
                for c in (False, True)] + [
    sm90_named_spec(256, c, n) for n in ("ws_kv", "ws_pp_kv_lz_e1", "full_kv_lz_e2", "ws_e4")
    for c in (False, True)] + [
    sm90_named_spec(64, True, "ws_pp_kv_lz_e2_s3", dtype="fp16"),
    sm90_named_spec(128, False, "full_kv_lz_e1", dtype="fp16"),
    sm90_named_spec(64, False, "plain_lz_e2"), sm90_named_spec(128, True, "ov_lz_e1")]
# The persistent kernel (persist, "_ps"): one and two Q buffers, with sepkv, overlap, ping-pong, three consumers.
# ws_ov_s3_m192_n80_ps is the d=128 N=2k default (s3tune) with persist; it and ws_pp_kv_s3_m192_ps spilled
# (56 / 4 B) until the O store's indices went through an opaque move (fwd_sm90.cuh, epilogue).
PERSIST_NAMES = {128: ("ws_ps", "ws_ov_s3_ps", "ws_pp_s3_ps", "ws_kv_ps", "ws_pp_kv_ps", "full_kv_ps",
                       "ws_ov_s3_m192_n80_ps", "full_s3_n112_ps", "full_s4_m192_n80_ps"),
                 64: ("ws_ps", "ws_s3_m192_ps", "ws_pp_kv_s3_ps", "ws_kv_s3_m192_ps", "ws_pp_kv_s3_m192_ps",
                      "ws_ov_s3_m192_ps")}
PERSIST_VARIANTS = [sm90_named_spec(d, c, n) for d, names in PERSIST_NAMES.items() for n in names for c in (False, True)]
NEW_VARIANTS += PERSIST_VARIANTS
ALL = list(dict.fromkeys(DEFAULTS + VARIANTS + NEW_VARIANTS))


def test_names_and_rules():
    s = sm90(causal=True)
    assert s.name == "fwd_sm90_d128_m128_n128_w12_s2_ws1_pp1_ov1_causal_bf16_sm90a"
    assert s.validate() is s and s.feasible(H200)
    with pytest.raises(ValueError, match="warps"):
        s.replace(warps=8).validate()
    with pytest.raises(ValueError, match="pingpong"):
        sm90(ws=False, pp=True).validate()
    with pytest.raises(ValueError, match="pingpong"):
        sm90(bm=64, pp=True).validate()
    with pytest.raises(ValueError, match="arch"):
        s.replace(arch="sm_80").validate()
    with pytest.raises(ValueError, match="not supported"):  # fwd_v2 takes no Hopper flag
        KernelSpec(overlap=True).validate()
    assert KernelSpec().name == "fwd_v2_d128_m128_n64_w4_s2_r0_full_bf16_sm90a"  # unchanged
    assert KernelSpec.from_dict(s.to_dict()) == s
    assert sm90(d=256, bn=192).check(H200)  # over the shared-memory budget
    # the later flags: named only when set, validated, round-tripped
    t = s.replace(emu=2, sepkv=True, lazy=True)
    assert t.validate().name == "fwd_sm90_d128_m128_n128_w12_s2_ws1_pp1_ov1_e2_kv1_lz1_causal_bf16_sm90a"
    assert KernelSpec.from_dict(t.to_dict()) == t and not t.check(H200)
    for bad, match in ((dict(emu=3), "emu"), (dict(warpspec=False, pingpong=False, warps=8, sepkv=True), "sepkv")):
        with pytest.raises(ValueError, match=match):
            s.replace(**bad).validate()
    for flag in (dict(emu=1), dict(sepkv=True), dict(lazy=True)):  # fwd_v2 takes none of them
        with pytest.raises(ValueError, match="not supported"):
            KernelSpec(**flag).validate()
    assert sm90(d=64, bm=192, pp=True).validate().warps == 16  # ping-pong over three consumer warpgroups
    # persist: named only when set, needs warpspec, a second Q buffer where shared memory has room
    ps = s.replace(persist=True)
    assert ps.validate().name == "fwd_sm90_d128_m128_n128_w12_s2_ws1_pp1_ov1_ps1_causal_bf16_sm90a"
    assert KernelSpec.from_dict(ps.to_dict()) == ps and not ps.check(H200)
    with pytest.raises(ValueError, match="persist needs warpspec"):
        sm90(ws=False, pp=False, persist=True).validate()
    with pytest.raises(ValueError, match="not supported"):
        KernelSpec(persist=True).validate()
    fam = s.family
    assert fam.q_pieces(s) == 2 and fam.q_pieces(ps) == 4 and ps.smem_bytes() == s.smem_bytes() + 128 * 128 * 2
    s3 = sm90(st=3, pp=False, persist=True)  # 229 KB with one piece per warpgroup: no room for a spare
    assert fam.q_pieces(s3) == 2 and s3.smem_bytes() == sm90(st=3).smem_bytes() and not s3.check(H200)
    s3n = sm90(bn=112, st=3, persist=True)  # 217 KB: room for one spare piece, not for a second tile
    assert fam.q_pieces(s3n) == 3 and s3n.smem_bytes() == sm90(bn=112, st=3).smem_bytes() + 64 * 128 * 2
    assert not s3n.check(H200)
    assert all(not v.check(H200) for v in PERSIST_VARIANTS)
    rec = s.to_dict()
    del rec["persist"]  # records written before the flag load as persist=False
    assert KernelSpec.from_dict(rec) == s
    assert not sm90(d=128, bn=128).check(gpus.get("a100")) == []  # not an sm_90a GPU


def test_default_rule():
    assert len(DEFAULTS) == 3 * 2 * 2 and all(s.kind == "fwd_sm90" for s in DEFAULTS)
    assert dispatch.default_specs("sm_80", 166912, kind="fwd_sm90") == []
    key = dispatch.ProblemKey("fwd_sm90", "sm_80", "bf16", 128, False, 2048)
    with pytest.raises(UnsupportedError, match="sm_90a"):
        dispatch.default_spec(key, 166912)
    assert [dispatch.sm90_head_dim_tile(d) for d in (8, 40, 64, 72, 128, 136, 256)] == [64, 64, 64, 128, 128, 256, 256]


def test_tune_space_has_candidates():
    from flashgen.tuner import space

    for d in (64, 128, 256):
        key = dispatch.ProblemKey("fwd", "sm_90a", "bf16", d, True, 4096)
        cands = space.candidates(key, H200, only=("fwd_sm90",))
        # the paper-rule baseline (fwd_v2) first, then fwd_sm90's own space
        assert cands[0] == space.paper_baseline(key, H200) and cands[0].kind == "fwd_v2"
        assert len(cands) > 5 and all(c.kind == "fwd_sm90" and not c.check(H200) for c in cands[1:])
        assert any(c.pingpong and c.overlap for c in cands)
        assert {c.warpspec for c in cands[1:]} == {False, True} and {c.stages for c in cands[1:]} >= {2, 3}
        assert all(c.warps == 4 * (c.block_m // 64 + c.warpspec) for c in cands[1:])  # implied, not searched
        # emu 1 only at d=64 and only with warpspec (Sm90Family.searched; 2 and 4 lost everywhere: not searched)
        assert {c.emu for c in cands[1:]} == ({0, 1} if d == 64 else {0})
        assert any(c.sepkv for c in cands) and any(c.lazy for c in cands)
        # persist is searched (measured: +2-5 % at N = 2k-4k, -1..-10 % at 16k), and only with warpspec
        assert any(c.persist for c in cands) and all(c.warpspec for c in cands[1:] if c.persist)
        assert not any((c.emu or c.lazy) and not c.warpspec for c in cands[1:])
        if d == 64:  # the d=64 shapes: 128/192 rows x 128/192 keys, 2-4 stages
            got = {(c.block_m, c.block_n, c.stages) for c in cands[1:] if c.warpspec}
            assert {(128, 128, 4), (192, 128, 4), (128, 192, 4), (192, 128, 2), (128, 192, 2)} <= got
            assert not any(c.block_m == 192 and c.block_n == 192 for c in cands)  # 176 fp32 values > 128
        assert space.candidates(dispatch.ProblemKey("fwd_sm90", "sm_90a", "bf16", d, True, 4096), H200) == cands


def test_hopper_diagnostics_are_problems():
    log = ("ptxas info    : Used 128 registers\n"
           "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
           "to insufficient register resources for the function 'k'\n"
           "ptxas warning : (C7508) Potential Performance Loss: setmaxnreg ignored; unable to determine register "
           "count at entry\n")
    problems = parse_ptxas_log(log, "k").problems()
    assert any("C7512" in p for p in problems) and any("C7508" in p for p in problems)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return build_all(ALL, tmp_path_factory, "sm90_home", threads=min(8, os.cpu_count() or 2))


@pytest.mark.parametrize("spec", ALL, ids=lambda s: s.name)
def test_compiles_clean_for_sm90a(spec, compiled):
    binary = clean_binary(compiled, spec)
    r = binary.report
    assert not any(c in binary.log for c in ("C7508", "C7510", "C7511", "C7512", "C7513", "C7514", "C7515")), binary.log
    assert r.static_smem + spec.smem_bytes() <= gpus.ARCH_SMEM_PER_BLOCK["sm_90a"]


def test_sass_has_hgmma_and_tma(tmp_path, compiled):
    """The default d=128 kernel's SASS issues HGMMA and UTMALDG (optional tools; skips without them)."""
    spec = sm90()
    binary = compiled[spec]
    if isinstance(binary, Exception):
        raise binary
    sass, _ = sass_of(spec, binary.cubin, tmp_path)
    assert "HGMMA" in sass and "UTMALDG" in sass


def test_wgmma_descriptors_stay_in_uniform_registers(tmp_path, compiled):
    """Every warp-specialized kernel's wgmma operands come from uniform registers computed as such: at
    most one R2UR (a per-thread value moved to a uniform register) in the four instructions before each
    HGMMA per four HGMMAs (there are none now). Session 5's first Q-piece change read the tile from a
    per-warpgroup slot, the compiler lost the warp-uniformity of everything derived from it, put 2-4
    R2UR before every HGMMA, and the persistent kernel ran 8-15 % slower on the H200; the lane-0
    broadcasts in fwd_sm90.cuh prevent it. Needs a disassembler that reads NVRTC's cubin (skips without)."""
    specs = [s for s in ALL if s.warpspec and s.head_dim in (64, 128)]
    for spec in specs:
        binary = compiled[spec]
        if isinstance(binary, Exception):
            raise binary
        near, hgmma = r2ur_before_hgmma(spec, binary.cubin, tmp_path)
        assert hgmma and near <= hgmma // 4, f"{spec.name}: {near} R2UR just before its {hgmma} HGMMA"
    assert len(specs) > 50


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_tensor_maps_step_rows_by_the_seq_stride(monkeypatch, layout):
    """The plan hands the driver (d, seq, head, batch) dims with the matching byte strides, for both
    layouts. (The first H200 run failed because the batch stride was passed as the seq stride.)"""
    torch = pytest.importorskip("torch")
    from flashgen import api, tma

    calls = []
    monkeypatch.setattr(tma, "encode", lambda ptr, dtype, dims, strides, box: calls.append(
        (ptr, tuple(dims), tuple(strides), tuple(box))) or bytes(128))
    b, h, hk, nq, nk, d = 2, 6, 3, 100, 77, 64
    shape = (lambda n, hh: (b, hh, n, d)) if layout == "bhsd" else (lambda n, hh: (b, n, hh, d))
    q, k, v = (torch.empty(shape(n, hh), device="meta") for n, hh in ((nq, h), (nk, hk), (nk, hk)))
    sq, sk, sv = (api._dims(t, layout)[1] for t in (q, k, v))
    spec = sm90(d=64, bm=64, ws=False, pp=False, ov=False)

    class FakeKernel:
        def params(self, **values):
            return spec.family.param_struct()(**values)

    dev = type("Dev", (), {"index": 0, "l2_bytes": 50 << 20})()
    plan = api._plan_sm90(FakeKernel(), spec, dev, (b, h, hk, nq, nk, d), (sq, sk, sv), sq, 0.125)
    params = plan.tma(16, 32, 48)
    assert bytes(params.tm_q) == bytes(128) and params.nq == nq and params.group == h // hk
    assert len(calls) == 3 and plan.tma(16, 32, 48) is not params and len(calls) == 3  # cached per address
    plan.tma(16, 32, 64)
    assert len(calls) == 6  # a new triple encodes again (tma.encode keeps its own per-address cache)
    byptr = {c[0]: c for c in calls}

    def want(t, n, hh):
        s = t.stride()  # elements
        seq, head = (s[2], s[1]) if layout == "bhsd" else (s[1], s[2])
        return (d, n, hh, b), (2 * seq, 2 * head, 2 * s[0])

    for ptr, t, n, hh, rows in ((16, q, nq, h, 64), (32, k, nk, hk, 128), (48, v, nk, hk, 128)):
        dims, strides = want(t, n, hh)
        assert byptr[ptr][1:] == (dims, strides, (64, rows, 1, 1)), (layout, ptr)


def test_named_flag_sets():
    """The flag-set names the benchmark, the smoke and the GPU tests use (families.sm90_flag_set)."""
    assert sm90_flag_set("ws") == dict(warpspec=True, pingpong=False, overlap=False)
    assert sm90_flag_set("ws_pp_kv_lz_e2_s3_m192_n64") == dict(
        warpspec=True, pingpong=True, overlap=False, sepkv=True, lazy=True, emu=2, stages=3, block_m=192, block_n=64)
    for bad in ("x", "ws_q", "ws_e", "ws_kv1", "pp_ws"):
        with pytest.raises(ValueError):
            sm90_flag_set(bad)
    assert sm90_named_spec(128, True, "full") == sm90(causal=True)
    assert sm90_named_spec(256, False, "plain", block_m=64).block_n == 64
    assert sm90_flag_set("ws_ov_s3_ps") == dict(warpspec=True, pingpong=False, overlap=True, stages=3, persist=True)
    for d, names in SM90_ABLATION.items():
        for n in names:
            for c in (False, True):
                assert not sm90_named_spec(d, c, n).check(H200), (d, n)


@pytest.mark.parametrize("d,bm,bn", [(64, 64, 128), (128, 128, 128), (256, 128, 64), (64, 192, 128), (64, 128, 192)])
def test_smem_layout_model(d, bm, bn):
    """CPU model of fwd_sm90's shared-memory addressing (the constants of fwd_sm90.cuh, restated):
    where the TMA puts element (row, col) of Q/K/V (128-byte swizzle: 16-byte chunk (c/8) ^ (r%8) of a
    128-byte row, panels of 64 columns) must be where the wgmma descriptors read it -- K-major
    (start + k16 step, SBO = 1024) for Q and K, MN-major (LBO = panel stride, SBO = 1024) for V --
    and where the epilogue's stores/loads put O."""
    import numpy as np

    def swz(addr):  # the 128B swizzle on a 1024-aligned base: bits 4-6 ^= bits 7-9
        return addr ^ (((addr >> 7) & 7) << 4)

    def tma_addr(base, rows, r, c):  # box of 64 columns x rows, one box per panel
        return swz(base + (c // 64) * rows * 128 + r * 128 + (c % 64) * 2)

    rng = np.random.default_rng(0)
    base_q, kv = 0, bn * d * 2
    base_k = base_q + bm * d * 2
    stage = 1
    sK = base_k + stage * kv
    sV = base_k + 2 * kv + stage * kv
    smem = {}
    Q, K, V = (rng.integers(-4, 5, size=s) for s in ((bm, d), (bn, d), (bn, d)))
    for M, base, rows in ((Q, base_q, bm), (K, sK, bn), (V, sV, bn)):
        for r in range(rows):
            for c in range(d):
                smem[tma_addr(base, rows, r, c)] = M[r, c]

    def kmajor(start, i, k):  # wgmma K-major SW128: rows i, k within one k16 step
        return swz(start + (i // 8) * 1024 + (i % 8) * 128 + 2 * k)

    def mnmajor(start, lbo, k, n):  # MN-major SW128: k rows (keys), n columns
        return swz(start + (n // 64) * lbo + (k // 8) * 1024 + (k % 8) * 128 + 2 * (n % 64))

    kmajor_off = lambda kk, rows: (kk // 4) * rows * 128 + (kk % 4) * 32  # noqa: E731 -- as in fwd_sm90.cuh
    for cw in range(bm // 64):
        S = np.zeros((64, bn), dtype=np.int64)
        for kk in range(d // 16):
            a0 = base_q + cw * 64 * 128 + kmajor_off(kk, bm)
            b0 = sK + kmajor_off(kk, bn)
            A = np.array([[smem[kmajor(a0, i, k)] for k in range(16)] for i in range(64)])
            B = np.array([[smem[kmajor(b0, n, k)] for k in range(16)] for n in range(bn)])
            S += A @ B.T
        assert (S == Q[cw * 64:cw * 64 + 64] @ K.T).all()
        P = rng.integers(-3, 4, size=(64, bn))
        O = np.zeros((64, d), dtype=np.int64)
        for kk in range(bn // 16):
            b0 = sV + kk * 16 * 128
            B = np.array([[smem[mnmajor(b0, bn * 128, k, n)] for n in range(d)] for k in range(16)])
            O += P[:, 16 * kk:16 * kk + 16] @ B
        assert (O == P @ V).all()
    # Epilogue: thread stores (row r, column pair 8i + 2t) at the swizzled chunk, the 16-byte loads read
    # chunk c of row r back: both must agree with the TMA's placement of Q (same formula).
    for r in range(0, bm, 7):
        for i in range(d // 8):
            for t in range(4):
                st = base_q + (i // 8) * bm * 128 + r * 128 + (((i % 8) ^ (r % 8)) * 16) + 4 * t
                assert st == tma_addr(base_q, bm, r, 8 * i + 2 * t)


@pytest.mark.parametrize("causal", [False, True])
def test_persist_plan_grid_and_tiles(causal, monkeypatch):
    """persist: the grid is min(tiles, SMs x CTAs per SM), 1-D; without persist one CTA per tile, 1-D. The
    params carry the tile count, the m-blocks per (batch, head), the L2 sections, and (persist) the
    stream's tile counters."""
    pytest.importorskip("torch")
    from flashgen import api, tma
    from flashgen.codegen.compiler import Report

    monkeypatch.setattr(tma, "encode", lambda ptr, dtype, dims, strides, box: bytes(128))
    monkeypatch.setattr(api, "_tile_counters", lambda idx: 4096)  # (a CUDA allocation otherwise)

    report = Report(registers=168, spill_stores=0, spill_loads=0, stack_frame=0, static_smem=96)

    def plan_for(spec, b, h, nq):
        class FakeKernel:
            binary = type("B", (), {"report": report})()

            def params(self, **values):
                return spec.family.param_struct()(**values)

        dev = type("Dev", (), {"index": 0, "sms": 132, "smem_per_sm": 233472, "l2_bytes": 50 << 20})()
        st = (h * nq * 64, nq * 64, 64)
        return api._plan_sm90(FakeKernel(), spec, dev, (b, h, h, nq, nq, 64), (st, st, st), st, 0.125)

    spec = sm90(d=64, pp=False, ov=False, causal=causal, persist=True)
    assert api.persist_ctas_per_sm(spec, report, 233472) == 1  # 384 threads x 168 registers
    for b, h, nq, grid in ((2, 16, 2048, 132), (1, 3, 300, 9), (1, 1, 1, 1)):
        plan = plan_for(spec, b, h, nq)
        m_blocks = -(-nq // 128)
        assert plan.grid == (grid, 1, 1) and min(b * h * m_blocks, 132) == grid
        p = plan.tma(16, 32, 48)
        assert (p.tiles, p.m_blocks, p.sched) == (b * h * m_blocks, m_blocks, 4096)
        # K/V of one pair: 2 x nq x 64 x 2 bytes; a quarter of 50 MiB holds 25 pairs at N = 2048
        assert (p.sec, p.sec_big) == api.tile_sections(b * h, 2 * nq * 64 * 2, 50 << 20, causal=causal)
    plain = plan_for(spec.replace(persist=False), 2, 16, 2048)
    p = plain.tma(16, 32, 48)
    # 32 pairs of 1 MiB K/V: sections of 16 within a quarter of 50 MiB, causal all 32 within half of it
    assert plain.grid == (32 * 16, 1, 1) and not p.sched
    assert (p.tiles, p.m_blocks, p.sec, p.sec_big) == (512, 16, 32 if causal else 16, 0)


@pytest.mark.parametrize("pairs, kv_bytes, l2", [(128, 1 << 20, 50 << 20), (16, 8 << 20, 50 << 20), (7, 1, 50 << 20),
                                                 (5, 1 << 30, 50 << 20), (256, 3 << 19, 40 << 20), (1, 1, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_sections_even_and_within_a_quarter_of_l2(pairs, kv_bytes, l2, causal):
    """tile_sections: sec_big sections of sec + 1 pairs and the rest of sec cover every pair; no section's
    K/V passes a quarter of the L2 (causal: half) unless one pair alone does (then one pair per section);
    the fewest such sections."""
    pytest.importorskip("torch")
    from flashgen.api import tile_sections

    sec, big = tile_sections(pairs, kv_bytes, l2, causal=causal)
    per = max(1, (l2 // (2 if causal else 4)) // kv_bytes)
    sections = -(-pairs // per)
    assert sec >= 1 and 0 <= big < sections
    assert big * (sec + 1) + (sections - big) * sec == pairs
    assert (sec + (big > 0)) <= per
