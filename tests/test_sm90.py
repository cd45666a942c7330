"""fwd_sm90 (Hopper: TMA + wgmma) without a GPU: spec rules, names, the default rule, and compiles.

Every spec the fwd_sm90 default rule can pick, and the ablation variants the
benchmark times, compile with NVRTC for sm_90a with no spills, no stack frame
and none of ptxas's Hopper diagnostics (C7508 setmaxnreg ignored, C7510-C7515
wgmma serialized). Where a cuobjdump/nvdisasm is found, the SASS must hold
HGMMA (pip's disassemblers may not read NVRTC 13.5 cubins: then a local nvcc,
if any, compiles the same source for the check; otherwise it skips).
"""
from __future__ import annotations


import pytest

from flashgen import KernelSpec, UnsupportedError, dispatch, families, gpus, mods
from flashgen.codegen import parse_ptxas_log
from flashgen.families.fwd_sm90 import ABLATION, FAMILY, persist_ctas_per_sm, tile_sections, variant, warps_for
from flashgen.families import fwd_sm90
from flashgen.problem import BUCKETS, ProblemKey, smallest_tile
from build_util import clean_binary, r2ur_before_hgmma, sass_of

H200 = gpus.get("h200")


def sm90(d=128, bm=128, bn=128, st=2, ws=True, pp=True, ov=True, causal=False, dtype="bf16", persistent=False):
    return KernelSpec(kind="fwd_sm90", arch="sm_90a", dtype=dtype, head_dim=d, block_m=bm, block_n=bn,
                      warps=warps_for(bm, ws), stages=st, warp_specialized=ws, pingpong=pp, softmax_overlap=ov,
                      causal=causal, persistent=persistent)


# The technique ladder the benchmark and the GPU tests run (all off -> all on).
LADDER = [dict(ws=False, pp=False, ov=False), dict(ws=False, pp=False, ov=True), dict(ws=True, pp=False, ov=False),
          dict(ws=True, pp=True, ov=False), dict(ws=True, pp=False, ov=True), dict(ws=True, pp=True, ov=True)]
DEFAULTS = [s for s in families.rule_specs("sm_90a", gpus.ARCH_SMEM_PER_BLOCK["sm_90a"]) if s.kind == "fwd_sm90"]
VARIANTS = [sm90(d=d, bn=bn, causal=c, **f) for d, bn in ((64, 128), (128, 128), (256, 64)) for c in (False, True)
            for f in LADDER] + [sm90(d=64, bm=64, ws=False, pp=False, ov=False),
                                sm90(d=128, bm=64, ws=False, pp=False, ov=False, dtype="fp16")] + [
    # 3-stage K/V ring at d=128, 128x128 (229 KB of the 227 KB + 1 KB opt-in: fits), causal both.
    sm90(d=128, st=3, causal=c, **f) for c in (False, True) for f in LADDER[2:]]
# The benchmark's ablation (fma_exp2, early K release, lean softmax, deeper rings, 192-row/192-key tiles at
# d=64), causal both, and the later techniques at d=256 (2 stages: a third does not fit), in fp16 and
# without warp specialization.
NEW_VARIANTS = [variant(d, c, n) for d, names in ABLATION.items() for n in names for c in (False, True)] + [
    variant(256, c, n) for n in ("ws_kr", "ws_pp_kr_ls_fx1", "ws_pp_ov_kr_ls_fx2", "ws_fx4") for c in (False, True)] + [
    variant(64, True, "ws_pp_kr_ls_fx2_s3", dtype="fp16"),
    variant(128, False, "ws_pp_ov_kr_ls_fx1", dtype="fp16"),
    variant(64, False, "ls_fx2"), variant(128, True, "ov_ls_fx1")]
# The persistent kernel ("ps"): one and two Q buffers, with early K release, overlap, ping-pong, three
# consumers. ws_ov_s3_m192_n80_ps (a tuned d=128 N=2k winner with persistent) and ws_pp_kr_s3_m192_ps
# spilled (56 / 4 B) until the O store's indices went through an opaque move (the epilogue in fwd_sm90.cuh).
PERSIST_NAMES = {128: ("ws_ps", "ws_ov_s3_ps", "ws_pp_s3_ps", "ws_kr_ps", "ws_pp_kr_ps", "ws_pp_ov_kr_ps",
                       "ws_ov_s3_m192_n80_ps", "ws_pp_ov_s3_n112_ps", "ws_pp_ov_s4_m192_n80_ps"),
                 64: ("ws_ps", "ws_s3_m192_ps", "ws_pp_kr_s3_ps", "ws_kr_s3_m192_ps", "ws_pp_kr_s3_m192_ps",
                      "ws_ov_s3_m192_ps")}
PERSIST_VARIANTS = [variant(d, c, n) for d, names in PERSIST_NAMES.items() for n in names for c in (False, True)]
NEW_VARIANTS += PERSIST_VARIANTS
# bias_gemm (causal ALiBi's column part from S's GEMM) on the H200's causal ALiBi picks (d 64, 128, 256: tuned
# and rule tiles), the 128x128 3-stage tile (the largest ring it fits beside), fp16, one consumer warpgroup
# without a producer, ping-pong with early K release, packed rows. Each with its twin without bias_gemm.
BIAS_GEMM_TOKENS = [(64, "ws_pp_ov_ls_s3_m192", {}), (128, "ws_ov_ls_ps_s4_m192_n80", {}), (256, "ws_ov_kr_n80", {}),
                    (128, "ws_ov_s3", {"dtype": "fp16"}), (64, "", {"block_m": 64}), (128, "ws_pp_kr_ls_s3", {}),
                    (128, "ws_ov_s3", {"varlen": True})]
BIAS_GEMM = [variant(d, True, t, alibi=True, bias_gemm=True, **kw) for d, t, kw in BIAS_GEMM_TOKENS]
NEW_VARIANTS += BIAS_GEMM + [s.replace(bias_gemm=False) for s in BIAS_GEMM]
ALL = list(dict.fromkeys(DEFAULTS + VARIANTS + NEW_VARIANTS))


def test_names_and_rules():
    s = sm90(causal=True)
    assert s.name == "fwd_sm90_d128_m128_n128_w12_s2_ws_pp_ov_causal_bf16_sm90a"
    assert s.validate() is s and s.feasible(H200)
    with pytest.raises(ValueError, match="warps"):
        s.replace(warps=8).validate()
    with pytest.raises(ValueError, match="pingpong"):
        sm90(ws=False, pp=True).validate()
    with pytest.raises(ValueError, match="pingpong"):
        sm90(bm=64, pp=True).validate()
    with pytest.raises(ValueError, match="arch"):
        s.replace(arch="sm_80").validate()
    with pytest.raises(ValueError, match="not a field of this kind"):  # fwd_v2 takes no Hopper technique
        KernelSpec(softmax_overlap=True).validate()
    assert KernelSpec().name == "fwd_v2_d128_m128_n64_w4_s2_full_bf16_sm90a"
    assert KernelSpec.from_dict(s.to_dict()) == s == KernelSpec.from_name(s.name)
    assert sm90(d=256, bn=192).check(H200)  # over the shared-memory budget
    # the later techniques: named only when set, validated, round-tripped
    t = s.replace(fma_exp2=2, early_k_release=True, lean_softmax=True)
    assert t.validate().name == "fwd_sm90_d128_m128_n128_w12_s2_ws_pp_ov_fx2_kr_ls_causal_bf16_sm90a"
    assert KernelSpec.from_dict(t.to_dict()) == t == KernelSpec.from_name(t.name) and not t.check(H200)
    for bad, match in ((dict(fma_exp2=3), "fma_exp2"),
                       (dict(warp_specialized=False, pingpong=False, warps=8, early_k_release=True), "early_k_release")):
        with pytest.raises(ValueError, match=match):
            s.replace(**bad).validate()
    for flag in (dict(fma_exp2=1), dict(early_k_release=True), dict(lean_softmax=True)):  # fwd_v2 takes none
        with pytest.raises(ValueError, match="not a field of this kind"):
            KernelSpec(**flag).validate()
    assert sm90(d=64, bm=192, pp=True).validate().warps == 16  # ping-pong over three consumer warpgroups
    # persistent: named only when set, needs warp specialization, a second Q buffer where shared memory has room
    ps = s.replace(persistent=True)
    assert ps.validate().name == "fwd_sm90_d128_m128_n128_w12_s2_ws_pp_ov_ps_causal_bf16_sm90a"
    assert KernelSpec.from_dict(ps.to_dict()) == ps and not ps.check(H200)
    with pytest.raises(ValueError, match="persistent needs warp_specialized"):
        sm90(ws=False, pp=False, persistent=True).validate()
    with pytest.raises(ValueError, match="not a field of this kind"):
        KernelSpec(persistent=True).validate()
    fam = s.family
    assert fam.q_pieces(s) == 2 and fam.q_pieces(ps) == 4 and ps.smem_bytes() == s.smem_bytes() + 128 * 128 * 2
    s3 = sm90(st=3, pp=False, persistent=True)  # 229 KB with one piece per warpgroup: no room for a spare
    assert fam.q_pieces(s3) == 2 and s3.smem_bytes() == sm90(st=3).smem_bytes() and not s3.check(H200)
    s3n = sm90(bn=112, st=3, persistent=True)  # 217 KB: room for one spare piece, not for a second tile
    assert fam.q_pieces(s3n) == 3 and s3n.smem_bytes() == sm90(bn=112, st=3).smem_bytes() + 64 * 128 * 2
    assert not s3n.check(H200)
    assert all(not v.check(H200) for v in PERSIST_VARIANTS)
    rec = s.to_dict()
    del rec["persistent"]  # a field left out of a record keeps its default
    assert KernelSpec.from_dict(rec) == s
    assert not sm90(d=128, bn=128).check(gpus.get("a100")) == []  # not an sm_90a GPU


def test_bias_gemm_spec():
    """bias_gemm: named "bg" when set (after the variant tokens), round-tripped by name and record, left out of a
    record without it; its B tile (8 BN + 128 bytes) joins the shared memory, and the candidates fit the H200
    beside the largest rings (the tuned causal ALiBi tile keeps its spare Q piece); refused with a message
    naming it wherever its bias is not the linear one or the GEMM's steps are not k16."""
    s = variant(128, True, "ws_ov_ls_ps_s4_m192_n80", alibi=True, bias_gemm=True)
    assert s.name == "fwd_sm90_d128_m192_n80_w16_s4_ws_ov_ls_ps_alibi_bg_causal_bf16_sm90a"
    assert KernelSpec.from_name(s.name) == s == KernelSpec.from_dict(s.to_dict()) and s.to_dict()["bias_gemm"]
    twin = s.replace(bias_gemm=False)
    assert "bias_gemm" not in twin.to_dict() and "_bg_" not in twin.name and twin.with_tokens("bg") == s
    fam = s.family
    assert s.smem_bytes() == twin.smem_bytes() + 8 * 80 + 128 and fam.q_pieces(s) == fam.q_pieces(twin) == 4
    assert all(not b.check(H200) for b in BIAS_GEMM)
    alibi = dict(alibi=True, bias_gemm=True)
    for causal, fields, match in ((True, dict(bias_gemm=True), "needs alibi and causal"),
                                  (False, alibi, "needs alibi and causal"),
                                  (True, dict(alibi, window=True), "no window"),
                                  (True, dict(alibi, softcap=True), "no softcap"),
                                  (True, dict(alibi, fp8=True), "bias_gemm .* fp8")):
        with pytest.raises(ValueError, match=match):
            variant(128, causal, "ws", **fields)
    with pytest.raises(ValueError, match="bias_gemm"):
        KernelSpec.from_name(s.name.replace("_causal_", "_full_"))
    with pytest.raises(ValueError, match="not a field of this kind"):  # fwd_v2 keeps the FFMA per score
        KernelSpec(causal=True, **alibi).validate()

    def alibi_mod(score, b, h, q, kv):
        return score + 0.25 * (kv - q)

    def softcap_mod(score, b, h, q, kv):
        return 30.0 * pytest.importorskip("torch").tanh(score / 30.0)

    for fn, linear in ((alibi_mod, True), (softcap_mod, False)):
        pair = mods.pair(mods.trace_score_mod(fn, allow_cpu=True), None)
        mods.register(pair)
        spec = variant(128, False, "ws_ov_s3", mod=mods.token_number(pair))
        if linear:
            assert spec.replace(bias_gemm=True).validate().name.endswith("_bg_full_bf16_sm90a")
        else:
            with pytest.raises(ValueError, match="bias_gemm needs a score_mod of the linear form"):
                spec.replace(bias_gemm=True).validate()


def test_bias_gemm_source():
    """The bias GEMM's wgmma (bf16, register A, transposed B, accumulating) is printed only into a bias_gemm
    kernel, whose kernel instantiation takes BIAS_GEMM on; an fp16 kernel's QK steps stay f16."""
    from flashgen.codegen import render

    s = variant(128, True, "ws_ov_s3", dtype="fp16", alibi=True, bias_gemm=True)
    src, twin = render(s), render(s.replace(bias_gemm=False))
    assert "FG_DEVICE void fg_wgmma_bias(" in src and "FG_DEVICE void fg_wgmma_bias(" not in twin
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " in src and "1, 1, 1, 1;" in src
    assert "m64n128k16.f32.f16.f16" in src and "m64n128k16.f32.bf16.bf16" not in twin
    assert "true, fg_variant<true, false, false, true, false>>(p);" in src
    assert "false, fg_variant<true, false, false, true, false>>(p);" in twin


def test_default_rule():
    # head dims x dtypes x causal, bf16/fp16 inputs and FP8 inputs (the fp8 variant key); the dense keys at d 64 and
    # 128 with a first tile for each bucket range of DENSE_FIRST past 512 (two each)
    assert len(DEFAULTS) == 3 * 2 * 2 * 2 + 2 * 2 * 2 * 2 and all(s.kind == "fwd_sm90" for s in DEFAULTS)
    assert sum(s.fp8 for s in DEFAULTS) == 3 * 2 * 2
    for d, ranges in fwd_sm90.DENSE_FIRST.items():
        for lo, hi in zip((0,) + tuple(upto for upto, _ in ranges), (upto for upto, _ in ranges)):
            for n in (b for b in BUCKETS if lo < b <= hi):
                key = ProblemKey("fwd", "sm_90a", "bf16", d, True, n)
                row = dict(ranges)[hi]
                spec = families.default_spec(key, gpus.ARCH_SMEM_PER_BLOCK["sm_90a"])
                if row is None:  # SM90_TILES' own first tile
                    assert (spec.block_m, spec.block_n, spec.stages) == fwd_sm90.SM90_TILES[d][0][:3], n
                else:
                    assert (spec.block_m, spec.block_n, spec.stages) == row[:3] and f"_{row[3]}_" in spec.name, n
                # a variant's key (here a window) keeps SM90_TILES' tile
                win = families.default_spec(key.replace(variant="win"), gpus.ARCH_SMEM_PER_BLOCK["sm_90a"])
                assert (win.block_m, win.block_n, win.stages) == fwd_sm90.SM90_TILES[d][0][:3]
    assert [s for s in families.rule_specs("sm_80", 166912) if s.kind == "fwd_sm90"] == []
    key = ProblemKey("fwd", "sm_80", "bf16", 128, False, 2048)
    assert families.serving("fwd", "sm_80") == ("fwd_v2",) and families.default_family(key) == "fwd_v2"
    with pytest.raises(UnsupportedError, match="fwd_sm90 does not serve fwd on sm_80"):
        dispatch.select(key, None, 166912, family="fwd_sm90")
    with pytest.raises(UnsupportedError, match="sm_90a"):
        FAMILY.rule(key, 166912)
    assert [smallest_tile(d, (64, 128, 256)) for d in (8, 40, 64, 72, 128, 136, 256)] == [64, 64, 64, 128, 128, 256, 256]
    assert [FAMILY.tile(ProblemKey("fwd", "sm_90a", "bf16", t, False, 512)) for t in (32, 64, 96, 160, 224)] == \
        [64, 64, 128, 256, 256]


def test_tune_space_has_candidates():
    from flashgen.tuner import space

    for d in (64, 128, 256):
        key = ProblemKey("fwd", "sm_90a", "bf16", d, True, 4096)
        cands = space.candidates(key, H200, only=("fwd_sm90",))
        # the paper-rule baseline (fwd_v2) first, then fwd_sm90's own space
        assert cands[0] == space.paper_baseline(key, H200) and cands[0].kind == "fwd_v2"
        assert len(cands) > 5 and all(c.kind == "fwd_sm90" and not c.check(H200) for c in cands[1:])
        assert any(c.pingpong and c.softmax_overlap for c in cands)
        assert {c.warp_specialized for c in cands[1:]} == {False, True} and {c.stages for c in cands[1:]} >= {2, 3}
        assert all(c.warps == warps_for(c.block_m, c.warp_specialized) for c in cands[1:])  # implied, not searched
        # fma_exp2 1 only at d=64 and only with warp specialization (Sm90Family.searched; 2 and 4 lost
        # everywhere: not searched)
        assert {c.fma_exp2 for c in cands[1:]} == ({0, 1} if d == 64 else {0})
        assert any(c.early_k_release for c in cands) and any(c.lean_softmax for c in cands)
        # persistent is searched (measured: +2-5 % at N = 2k-4k, -1..-10 % at 16k), only with warp specialization
        assert any(c.persistent for c in cands) and all(c.warp_specialized for c in cands[1:] if c.persistent)
        assert not any((c.fma_exp2 or c.lean_softmax) and not c.warp_specialized for c in cands[1:])
        if d == 64:  # the d=64 shapes: 128/192 rows x 128/192 keys, 2-4 stages
            got = {(c.block_m, c.block_n, c.stages) for c in cands[1:] if c.warp_specialized}
            assert {(128, 128, 4), (192, 128, 4), (128, 192, 4), (192, 128, 2), (128, 192, 2)} <= got
            assert not any(c.block_m == 192 and c.block_n == 192 for c in cands)  # 176 fp32 values > 128
        # the same key searched over every family holds these and fwd_v2's
        assert set(cands) <= set(space.candidates(key, H200))


def test_hopper_diagnostics_are_problems():
    log = ("ptxas info    : Used 128 registers\n"
           "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
           "to insufficient register resources for the function 'k'\n"
           "ptxas warning : (C7508) Potential Performance Loss: setmaxnreg ignored; unable to determine register "
           "count at entry\n")
    problems = parse_ptxas_log(log, "k").problems()
    assert any("C7512" in p for p in problems) and any("C7508" in p for p in problems)


@pytest.fixture(scope="module")
def compiled(compile_session):
    return compile_session.build_all(ALL)


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


def test_bias_gemm_sass(tmp_path, compiled):
    """Against its twin, a bias_gemm kernel issues one more HGMMA per S issue site (m64nBNk16 with A from
    registers and B transposed: the bias step) and BN / 2 fewer FFMA per site (the per-score column FFMA of the
    consumer's BN / 2 scores). Needs a disassembler that reads NVRTC's cubin (skips without)."""
    import re

    for spec in BIAS_GEMM:
        sass = {}
        for s in (spec, spec.replace(bias_gemm=False)):
            binary = clean_binary(compiled, s)
            sass[s.bias_gemm], _ = sass_of(s, binary.cubin, tmp_path)

        def count(text, op):
            return len(re.findall(op, text))

        sites = count(sass[True], r"\bHGMMA\b") - count(sass[False], r"\bHGMMA\b")
        # (register A, transposed B: P V's form too where BN = D, so counted against the twin)
        rs = rf"HGMMA\.64x{spec.block_n}x16\.F32\.BF16 R\d+, R\d+, gdesc\[UR\d+\]\.tnspB"
        assert sites >= 1 and count(sass[True], rs) - count(sass[False], rs) == sites, spec.name
        assert count(sass[False], r"\bFFMA\b") - count(sass[True], r"\bFFMA\b") == sites * spec.block_n // 2, spec.name


def test_wgmma_descriptors_stay_in_uniform_registers(tmp_path, compiled):
    """Every warp-specialized kernel's wgmma operands come from uniform registers computed as such: at
    most one R2UR (a per-thread value moved to a uniform register) in the four instructions before each
    HGMMA per four HGMMAs (there are none now). A Q-piece layout that read the tile from a
    per-warpgroup slot made the compiler lose the warp-uniformity of everything derived from it, put 2-4
    R2UR before every HGMMA, and the persistent kernel ran 8-15 % slower on the H200; the lane-0
    broadcasts in fwd_sm90.cuh prevent it. Needs a disassembler that reads NVRTC's cubin (skips without)."""
    specs = [s for s in ALL if s.warp_specialized and s.head_dim in (64, 128)]
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
    from flashgen import tma
    from flashgen.api.checks import dims as bhs_dims

    calls = []
    monkeypatch.setattr(tma, "encode", lambda ptr, dtype, dims, strides, box: calls.append(
        (ptr, tuple(dims), tuple(strides), tuple(box))) or bytes(128))
    b, h, hk, nq, nk, d = 2, 6, 3, 100, 77, 64
    shape = (lambda n, hh: (b, hh, n, d)) if layout == "bhsd" else (lambda n, hh: (b, n, hh, d))
    q, k, v = (torch.empty(shape(n, hh), device="meta") for n, hh in ((nq, h), (nk, hk), (nk, hk)))
    sq, sk, sv = (bhs_dims(t, layout)[1] for t in (q, k, v))
    spec = sm90(d=64, bm=64, ws=False, pp=False, ov=False)

    class FakeKernel:
        def params(self, **values):
            return spec.family.param_struct()(**values)

    FakeKernel.spec = spec
    dev = type("Dev", (), {"index": 0, "l2_bytes": 50 << 20, "sms": 132, "smem_per_sm": 233472})()
    _, params_for = FAMILY.launch(FakeKernel(), (b, h, hk, nq, nk, d), (sq, sk, sv), sq, 0.125, dev)
    params = params_for(16, 32, 48)
    assert bytes(params.tm_q) == bytes(128) and params.nq == nq and params.group == h // hk
    assert len(calls) == 3 and params_for(16, 32, 48) is not params and len(calls) == 3  # cached per address
    params_for(16, 32, 64)
    assert len(calls) == 6  # a new triple encodes again (tma.encode keeps its own per-address cache)
    byptr = {c[0]: c for c in calls}

    def want(t, n, hh):
        s = t.stride()  # elements
        seq, head = (s[2], s[1]) if layout == "bhsd" else (s[1], s[2])
        return (d, n, hh, b), (2 * seq, 2 * head, 2 * s[0])

    for ptr, t, n, hh, rows in ((16, q, nq, h, 64), (32, k, nk, hk, 128), (48, v, nk, hk, 128)):
        dims, strides = want(t, n, hh)
        assert byptr[ptr][1:] == (dims, strides, (64, rows, 1, 1)), (layout, ptr)


def test_variants_by_name_tokens():
    """The variants the benchmark, the smoke and the GPU tests use are name tokens over one base spec
    (families.fwd_sm90.variant): the same grammar as the kernel names."""
    assert variant(128, False, "ws").name == "fwd_sm90_d128_m128_n128_w12_s2_ws_full_bf16_sm90a"
    v = variant(128, False, "ws_pp_kr_ls_fx2_s3_m192_n64")
    assert (v.warp_specialized, v.pingpong, v.softmax_overlap, v.early_k_release, v.lean_softmax, v.fma_exp2,
            v.stages, v.block_m, v.block_n, v.warps) == (True, True, False, True, True, 2, 3, 192, 64, 16)
    for bad in ("x", "ws_q", "ws_fx", "ws_kr1", "ws_d"):
        with pytest.raises(ValueError):
            variant(128, False, bad)
    assert variant(128, True, "ws_pp_ov") == sm90(causal=True)
    assert variant(256, False, "", block_m=64).block_n == 64
    ps = variant(128, False, "ws_ov_s3_ps")
    assert (ps.softmax_overlap, ps.stages, ps.persistent, ps.pingpong) == (True, 3, True, False)
    for d, names in ABLATION.items():
        for n in names:
            for c in (False, True):
                assert not variant(d, c, n).check(H200), (d, n)


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
    """persistent: the grid is min(tiles, SMs x CTAs per SM), 1-D; otherwise one CTA per tile, 1-D. The
    params carry the tile count, the m-blocks per (batch, head) and the L2 sections; the stream's tile
    counters are the torch layer's to set (needs_tile_counters)."""
    from flashgen import tma
    from flashgen.codegen.compiler import Report

    monkeypatch.setattr(tma, "encode", lambda ptr, dtype, dims, strides, box: bytes(128))

    report = Report(registers=168, spill_stores=0, spill_loads=0, stack_frame=0, static_smem=96)

    def plan_for(spec, b, h, nq):
        class FakeKernel:
            binary = type("B", (), {"report": report})()

            def params(self, **values):
                return spec.family.param_struct()(**values)

        FakeKernel.spec = spec
        dev = type("Dev", (), {"index": 0, "sms": 132, "smem_per_sm": 233472, "l2_bytes": 50 << 20})()
        st = (h * nq * 64, nq * 64, 64)
        return FAMILY.launch(FakeKernel(), (b, h, h, nq, nq, 64), (st, st, st), st, 0.125, dev)

    spec = sm90(d=64, pp=False, ov=False, causal=causal, persistent=True)
    assert persist_ctas_per_sm(spec, report, 233472) == 1  # 384 threads x 168 registers
    assert FAMILY.needs_tile_counters(spec) and not FAMILY.needs_tile_counters(spec.replace(persistent=False))
    for b, h, nq, grid in ((2, 16, 2048, 132), (1, 3, 300, 9), (1, 1, 1, 1)):
        launch_grid, params_for = plan_for(spec, b, h, nq)
        m_blocks = -(-nq // 128)
        assert launch_grid == (grid, 1, 1) and min(b * h * m_blocks, 132) == grid
        p = params_for(16, 32, 48)
        assert (p.tiles, p.m_blocks, p.sched) == (b * h * m_blocks, m_blocks, None)  # counters: the caller's
        # K/V of one pair: 2 x nq x 64 x 2 bytes; a quarter of 50 MiB holds 25 pairs at N = 2048
        assert (p.sec, p.sec_big) == tile_sections(b * h, 2 * nq * 64 * 2, 50 << 20, causal=causal)
    plain_grid, plain = plan_for(spec.replace(persistent=False), 2, 16, 2048)
    p = plain(16, 32, 48)
    # 32 pairs of 1 MiB K/V: sections of 16 within a quarter of 50 MiB, causal all 32 within half of it
    assert plain_grid == (32 * 16, 1, 1) and not p.sched
    assert (p.tiles, p.m_blocks, p.sec, p.sec_big) == (512, 16, 32 if causal else 16, 0)
    # User mods: a mask_mod's block mask is walked in causal's order and takes causal's sections; a
    # score_mod alone keeps the full square's
    masked = mods.pair(mods.trace_score_mod(lambda s, b, h, q, kv: s * 0.5, allow_cpu=True),
                       mods.trace_mask_mod(lambda b, h, q, kv: q >= kv, allow_cpu=True) if causal else None)
    token = mods.token_number(masked)
    mods.register(masked)
    p = plan_for(spec.replace(persistent=False, causal=False, mod=token), 2, 16, 2048)[1](16, 32, 48)
    assert (p.sec, p.sec_big) == (32 if causal else 16, 0)


@pytest.mark.parametrize("pairs, kv_bytes, l2", [(128, 1 << 20, 50 << 20), (16, 8 << 20, 50 << 20), (7, 1, 50 << 20),
                                                 (5, 1 << 30, 50 << 20), (256, 3 << 19, 40 << 20), (1, 1, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_sections_even_and_within_a_quarter_of_l2(pairs, kv_bytes, l2, causal):
    """tile_sections: sec_big sections of sec + 1 pairs and the rest of sec cover every pair; no section's
    K/V passes a quarter of the L2 (causal: half) unless one pair alone does (then one pair per section);
    the fewest such sections."""
    sec, big = tile_sections(pairs, kv_bytes, l2, causal=causal)
    per = max(1, (l2 // (2 if causal else 4)) // kv_bytes)
    sections = -(-pairs // per)
    assert sec >= 1 and 0 <= big < sections
    assert big * (sec + 1) + (sections - big) * sec == pairs
    assert (sec + (big > 0)) <= per
