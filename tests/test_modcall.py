"""User mods in the spec, the template and the torch layer, without a GPU: the ``mod`` token in kernel
names, the family's rules, the emitted source (the traced functions and the variant that calls them), an
offline NVRTC compile of mod kernels without spills, and the torch layer's refusals before any launch."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen import mods  # noqa: E402
from flashgen.codegen import render  # noqa: E402
from flashgen.families import fwd_sm90  # noqa: E402
from flashgen.spec import KernelSpec  # noqa: E402

SLOPES = torch.rand(8)
DOC = torch.arange(64, dtype=torch.int32) // 16


def alibi(score, b, h, q, kv):
    return score - SLOPES[h] * (q - kv).abs()


def document(b, h, q, kv):
    return (DOC[q] == DOC[kv]) & (q >= kv)


def causal(b, h, q, kv):
    return q >= kv


def relative16(score, b, h, q, kv):
    return score + REL16[h, q - kv + 100]


REL16 = torch.randn(8, 300).to(torch.bfloat16)


def registered(score=None, mask=None):
    pair = mods.pair(mods.trace_score_mod(score, allow_cpu=True) if score else None,
                     mods.trace_mask_mod(mask, allow_cpu=True) if mask else None)
    mods.register(pair)
    return pair


def mod_spec(pair, tokens="ws_ov_s3", d=128):
    return fwd_sm90.variant(d, False, tokens).replace(mod=mods.token_number(pair)).validate()


def test_mod_token_in_the_name_round_trips():
    pair = registered(alibi, document)
    spec = mod_spec(pair)
    assert f"_mod{mods.token_number(pair)}_" in spec.name
    assert KernelSpec.from_name(spec.name) == spec
    assert mods.token_text(spec.mod) == pair.token
    assert spec.to_dict()["mod"] == spec.mod and "mod" not in fwd_sm90.variant(128, False).to_dict()


@pytest.mark.parametrize("change,match", [
    ({"causal": True}, "built-in variant"), ({"softcap": True}, "built-in variant"),
    ({"mod": 1 << 48}, "not a mod token"), ({"mod": -1}, "not a mod token")])
def test_mod_spec_rules(change, match):
    spec = fwd_sm90.variant(128, False, "ws").replace(mod=5)
    with pytest.raises(ValueError, match=match):
        spec.replace(**change).validate()


def test_mod_field_belongs_to_the_mod_families_only():
    """The forward families, the backward's dK/dV and dQ kernels and decode_split take a mod token; the row
    kernels (preprocess, convert) do not."""
    for kind in ("fwd_v2", "bwd_dkdv", "bwd_dkdv_nodq", "bwd_dq"):
        assert KernelSpec(kind=kind, head_dim=64, block_m=64, block_n=64, warps=4, mod=5).validate().mod == 5
    for kind in ("bwd_preprocess", "bwd_convert"):
        with pytest.raises(ValueError, match="not a field of this kind"):
            KernelSpec(kind=kind, head_dim=64, block_m=64, block_n=64, warps=4, mod=5).validate()
    with pytest.raises(ValueError, match="built-in variant"):
        KernelSpec(kind="fwd_v2", head_dim=64, block_m=64, block_n=64, warps=4, mod=5, causal=True).validate()


def test_rendered_source_holds_the_traced_functions():
    pair = registered(alibi, document)
    src = render(mod_spec(pair))
    # (alibi under document's q >= kv is a bias linear in kv: tests/test_mods_linear.py)
    assert "fg_mod_variant<true, true, false, true, true>" in src
    assert "FG_DEVICE float fg_score_mod(" in src and "FG_DEVICE bool fg_mask_mod(" in src
    assert pair.token in src
    assert "SLOPES" not in src and "DOC" not in src  # user names never reach the source
    plain = render(fwd_sm90.variant(128, False, "ws_ov_s3"))
    assert "struct fg_mod_variant" not in plain and "FG_DEVICE float fg_score_mod(" not in plain


def test_unknown_token_is_a_clear_error():
    spec = fwd_sm90.variant(128, False, "ws").replace(mod=123456789)
    with pytest.raises(mods.ModError, match="not known in this process"):
        render(spec)


@pytest.mark.parametrize("score,mask,tokens,d", [
    (alibi, None, "ws_ov_s3", 128), (None, document, "ws_ov_s3", 128), (alibi, document, "ws_pp_kr_ls_s3", 64),
    (alibi, document, "ws_ps", 128), (None, document, "ws_s3_m192", 64), (alibi, None, "ws", 256)])
def test_mod_kernels_compile_without_spills(score, mask, tokens, d, tmp_path, monkeypatch):
    """NVRTC compiles for sm_90a offline: the mod kernels of several tiles build with no spills."""
    from flashgen.codegen import build

    monkeypatch.setenv("FLASHGEN_HOME", str(tmp_path))
    spec = mod_spec(registered(score, mask), tokens, d)
    binary = build(spec)
    assert binary.report.spill_stores == 0 and binary.report.spill_loads == 0, binary.report


def softcap(score, b, h, q, kv):
    return 30.0 * torch.tanh(score / 30.0)


@pytest.mark.parametrize("arch,budget", [("sm_80", 166912), ("sm_86", 101376), ("sm_90a", 232448)])
def test_mod_family_by_arch(arch, budget):
    """fwd_sm90 serves mods where it is the default forward (sm_90a), fwd_v2 everywhere else; the block mask's
    list walk and the traced functions reach fwd_v2's source."""
    from flashgen import dispatch
    from flashgen.problem import ProblemKey

    key = ProblemKey("fwd", arch, "bf16", 128, True, 4096, "")
    want = "fwd_sm90" if arch == "sm_90a" else "fwd_v2"
    assert dispatch.mod_family(key) == want
    pair = registered(alibi, document)
    spec = dispatch.mod_spec(key, None, budget, mods.token_number(pair), family="fwd_v2")
    assert spec.kind == "fwd_v2" and spec.mod == mods.token_number(pair) and not spec.causal
    src = render(spec)
    assert "fg_mod_variant<true, true>" in src and "FG_DEVICE bool fg_mask_mod(" in src
    assert "var.set_block_row(p, m_block)" in src and "SLOPES" not in src


@pytest.mark.parametrize("score,mask,arch,d", [
    (alibi, document, "sm_80", 64), (alibi, document, "sm_80", 128), (softcap, None, "sm_86", 128),
    (None, document, "sm_90a", 256), (relative16, document, "sm_80", 128), (softcap, document, "sm_89", 64)])
def test_fwd_v2_mod_kernels_compile_without_spills(score, mask, arch, d, tmp_path, monkeypatch):
    """dispatch's fwd_v2 kernel with mods (the rule's tiles, stepping past any that spill) builds clean for
    the GPUs without fwd_sm90 (offline NVRTC)."""
    from flashgen import dispatch, gpus
    from flashgen.codegen import build
    from flashgen.problem import ProblemKey

    monkeypatch.setenv("FLASHGEN_HOME", str(tmp_path))
    pair = registered(score, mask)
    key = ProblemKey("fwd", arch, "bf16", d, mask is not None, 4096, "")
    spec = dispatch.mod_spec(key, None, gpus.ARCH_SMEM_PER_BLOCK[arch], mods.token_number(pair), verify=True,
                             family="fwd_v2")
    report = build(spec).report
    assert spec.kind == "fwd_v2" and report.spill_stores == 0 and report.stack_frame == 0, (spec.name, report)


MASK4 = torch.randn(1, 1, 113, 203).to(torch.bfloat16)


def add_mask4(score, b, h, q, kv):
    return score + MASK4[b, h, q, kv]


def test_dispatch_steps_past_spilling_tiles(tmp_path, monkeypatch):
    """A 4-D bf16 capture (SDPA's float mask) spills the d = 64 tiles of 128 keys (8 B under NVRTC 13.0):
    dispatch walks on to a spill-free tile, 64-key blocks if need be, instead of the rule's last one."""
    from flashgen import dispatch
    from flashgen.codegen import build
    from flashgen.problem import ProblemKey

    monkeypatch.setenv("FLASHGEN_HOME", str(tmp_path))
    token = mods.token_number(registered(add_mask4))
    key = ProblemKey("fwd", "sm_90a", "bf16", 64, False, 512, "")
    spec = dispatch.mod_spec(key, "h200", 232448, token, verify=True)
    report = build(spec).report
    assert spec.mod == token and report.spill_stores == 0 and report.stack_frame == 0, (spec.name, report)


def test_mods_refuse_other_variants_and_gradients():
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(flashgen.UnsupportedError, match="causal"):
        flashgen.attention(q, q, q, causal=True, score_mod=alibi)
    with pytest.raises(flashgen.UnsupportedError, match="window, softcap"):
        flashgen.attention(q, q, q, window=(4, 0), softcap=5.0, mask_mod=document)
    with pytest.raises(ValueError, match="CUDA"):  # a call that needs gradients checks its inputs as well
        flashgen.attention(q.requires_grad_(True), q, q, score_mod=alibi)


def test_block_mask_of_another_shape_is_refused():
    from flashgen.api.modcall import check_block_mask_shape

    bm = flashgen.create_block_mask(document, None, 2, 64, 64, device="cpu")
    check_block_mask_shape(bm, 3, 2, 64, 64)
    with pytest.raises(ValueError, match="made for"):
        check_block_mask_shape(bm, 3, 4, 64, 64)
    with pytest.raises(ValueError, match="made for"):
        check_block_mask_shape(bm, 1, 2, 63, 64)


def test_mod_fields_are_packed_once_at_their_offsets():
    """The launch copies one packed range into the parameter block: the captures' addresses, strides and
    sizes (unused dims: stride 0, size 1) and the block lists, at the fields the kernel reads."""
    import ctypes

    from flashgen.api.blockmask import block_mask_from_dense
    from flashgen.api.modcall import pack_mod_fields

    struct = fwd_sm90.FAMILY.param_struct()
    bias = torch.randn(3, 40)[:, ::2]
    doc = torch.arange(7, dtype=torch.int32)
    tiles = block_mask_from_dense(torch.rand(2, 1, 100, 90) < 0.5).for_tile(64, 80)
    offset, blob = pack_mod_fields(struct, (bias, doc), tiles)
    params = struct()
    ctypes.memmove(ctypes.addressof(params) + offset, blob, len(blob))
    assert params.mod.t[0] == bias.data_ptr() and params.mod.t[1] == doc.data_ptr() and not params.mod.t[2]
    assert list(params.mod.s[0]) == [40, 2, 0, 0] and list(params.mod.n[0]) == [3, 20, 1, 1]
    assert list(params.mod.s[1]) == [1, 0, 0, 0] and list(params.mod.n[1]) == [7, 1, 1, 1]
    assert params.bm_count == tiles.counts.data_ptr() and params.bm_index == tiles.index.data_ptr()
    assert (params.bm_sb, params.bm_sh, params.bm_nb) == (2, 0, 2)  # (batch stride: 1 head x 2 query blocks)
    assert params.nq == 0 and params.tiles == 0  # nothing outside the range is touched
    keys = block_mask_from_dense(torch.rand(1, 3, 100, 300) < 0.5).for_key_tile(64, 128)  # (1, 3, 3 key blocks)
    offset, blob = pack_mod_fields(struct, (), keys)
    ctypes.memmove(ctypes.addressof(params) + offset, blob, len(blob))
    assert (params.bm_sb, params.bm_sh, params.bm_nb) == (0, 3, 2) and not params.mod.t[0]


def test_row_bounds_field_rules_and_source():
    """``row_bounds`` (token rb): the forward families and bwd_sm90 with a mask_mod only; its kernel masks by the bounds
    (ROWS, the sixth flag of fg_mod_variant) and still prints the mask_mod (the backward's and decode's)."""
    pair = registered(None, document)
    spec = mod_spec(pair).replace(row_bounds=True).validate()
    assert spec.name.endswith("_rb_full_bf16_sm90a") and KernelSpec.from_name(spec.name) == spec
    assert spec.to_dict()["row_bounds"] is True and "row_bounds" not in mod_spec(pair).to_dict()
    src = render(spec)
    assert "fg_mod_variant<false, true, false, false, false, true>" in src and "bm_rows" in src
    assert "fg_mod_variant<false, true>" in render(mod_spec(pair))
    with pytest.raises(ValueError, match="needs mod"):
        fwd_sm90.variant(128, False, "ws").replace(row_bounds=True).validate()
    for kind in ("decode_split", "bwd_dkdv", "bwd_dkdv_nodq", "bwd_dq"):
        with pytest.raises(ValueError, match="not a field of this kind"):
            KernelSpec(kind=kind, head_dim=64, block_m=64, block_n=64, warps=4, mod=5, row_bounds=True).validate()
    with pytest.raises(ValueError, match="no mask_mod"):
        render(mod_spec(registered(alibi, None)).replace(row_bounds=True))


@pytest.mark.parametrize("arch,family,d", [("sm_90a", "fwd_sm90", 64), ("sm_90a", "fwd_sm90", 128),
                                           ("sm_90a", "fwd_sm90", 256), ("sm_80", "fwd_v2", 128),
                                           ("sm_86", "fwd_v2", 64), ("sm_89", "fwd_v2", 256)])
def test_row_bounds_kernels_compile_without_spills(arch, family, d, tmp_path, monkeypatch):
    """Dispatch's document-mask kernel (with a softcap score_mod at d = 128) with ``row_bounds`` builds clean
    offline for every arch that runs it."""
    from flashgen import dispatch, gpus
    from flashgen.codegen import build
    from flashgen.problem import ProblemKey

    monkeypatch.setenv("FLASHGEN_HOME", str(tmp_path))
    pair = registered(softcap if d == 128 else None, document)
    key = ProblemKey("fwd", arch, "bf16", d, True, 4096, "")
    spec = dispatch.mod_spec(key, None, gpus.ARCH_SMEM_PER_BLOCK[arch], mods.token_number(pair), verify=True,
                             family=family, row_bounds=True)
    report = build(spec).report
    assert spec.kind == family and spec.row_bounds, spec.name
    assert report.spill_stores == 0 and report.stack_frame == 0, (spec.name, report)


def test_row_bounds_are_packed_with_their_strides():
    """The forward families' blocks carry the row bounds' address and (batch, head) strides in rows after the
    block lists, in the one packed range; a block without those fields refuses them."""
    import ctypes

    from flashgen.api.modcall import _row_bounds, pack_mod_fields
    from flashgen.families import bwd, bwd_sm90, fwd_v2

    for fam in (fwd_sm90.FAMILY, fwd_v2.FAMILY, bwd_sm90.FAMILY):
        struct = fam.param_struct()
        for b, h, strides in ((2, None, (50, 0)), (None, 3, (0, 50)), (None, None, (0, 0)), (2, 3, (150, 50))):
            mask = flashgen.create_block_mask(lambda b_, h_, q, kv: (kv <= q + b_) & (kv >= q - h_ - 3), b, h, 50, 60,
                                              device="cpu")
            rows, tiles = mask.row_bounds(), mask.for_tile(64, 64)
            offset, blob = pack_mod_fields(struct, (), tiles, rows)
            params = struct()
            ctypes.memmove(ctypes.addressof(params) + offset, blob, len(blob))
            assert params.bm_rows == rows.data_ptr() and (params.bm_rsb, params.bm_rsh) == strides, (b, h)
            assert params.bm_count == tiles.counts.data_ptr()
        offset, blob = pack_mod_fields(struct, (), tiles)
        params = struct()
        ctypes.memmove(ctypes.addressof(params) + offset, blob, len(blob))
        assert not params.bm_rows and (params.bm_rsb, params.bm_rsh) == (0, 0)
    with pytest.raises(ValueError, match="no row bounds fields"):
        pack_mod_fields(bwd.DKDV.param_struct(), (), tiles, rows)
    spec = mod_spec(registered(None, document)).replace(row_bounds=True).validate()
    assert _row_bounds(mod_spec(registered(None, document)), mask) is None
    assert _row_bounds(spec, mask) is rows
    with pytest.raises(flashgen.UnsupportedError, match="more than one run"):
        _row_bounds(spec, flashgen.create_block_mask(lambda b_, h_, q, kv: kv % 3 == 0, None, None, 50, 60,
                                                     device="cpu"))
    with pytest.raises(flashgen.UnsupportedError, match="needs a mask_mod"):
        _row_bounds(spec, None)


def test_calls_take_row_bounds_where_every_row_sees_one_run():
    """has_row_bounds, the call's choice: causal, window and document masks (one run of keys per row, rows
    that see none included) yes; a strided mask (several runs) and no mask no."""
    from flashgen.api.modcall import has_row_bounds

    def window(b_, h_, q, kv):
        return (kv <= q) & (kv > q - 7)
    for fn in (lambda b_, h_, q, kv: q >= kv, window, lambda b_, h_, q, kv: kv > q + 40):
        assert has_row_bounds(flashgen.create_block_mask(fn, None, None, 50, 60, device="cpu"))
    assert not has_row_bounds(flashgen.create_block_mask(lambda b_, h_, q, kv: kv % 3 == 0, None, None, 50, 60,
                                                         device="cpu"))
    assert not has_row_bounds(None)


@pytest.mark.parametrize("score,mask", [(alibi, None), (None, document), (alibi, document), (relative16, None),
                                        (lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0), document)])
@pytest.mark.parametrize("d", [64, 128])
def test_backward_kernels_with_mods_compile_without_spills(score, mask, d, tmp_path, monkeypatch):
    """dispatch's bwd_sm90 kernel for the mods builds with no spill (offline NVRTC for sm_90a): the rule's
    tile, or the same with dP^T's GEMM after P^T (a captured bf16 table at d = 128 needs it)."""
    from flashgen import dispatch
    from flashgen.codegen import build
    from flashgen.problem import ProblemKey

    monkeypatch.setenv("FLASHGEN_HOME", str(tmp_path))
    pair = registered(score, mask)
    key = ProblemKey("bwd_dkdv", "sm_90a", "bf16", d, False, 4096, "")
    spec = dispatch.mod_backward_spec(key, 232448, mods.token_number(pair), verify=True)
    report = build(spec).report
    assert spec.kind == "bwd_sm90" and spec.mod == mods.token_number(pair) and not spec.causal
    assert report.spill_stores == 0 and report.stack_frame == 0, (spec.name, report)
    src = render(spec)
    flags = [pair.score is not None, pair.mask is not None, pair.score_grad is not None]
    assert "fg_mod_variant<" + ", ".join("true" if f else "false" for f in flags) + ">" in src


@pytest.mark.parametrize("score,d,bounded", [(None, 64, True), (softcap, 128, False), (None, 256, True)])
def test_backward_row_bounds_kernels(score, d, bounded, tmp_path, monkeypatch):
    """bwd_sm90 with ``row_bounds`` (dispatch.mod_backward_spec(row_bounds=True)): the document mask's partial
    blocks masked by the rows' bounds (ROWS, fg_mod_variant's sixth flag), built spill-free offline; at d = 128
    the bounds spill (44 B under NVRTC 13.0: two registers a row of the thread's S^T columns where the mask_mod
    keeps one) and the mask_mod's tile is taken; the rows' fields packed into its block; dispatch's own backward
    takes the bounds for a mask_mod that reads a tensor (the document ids), not for index compares alone."""
    import ctypes

    from flashgen import dispatch
    from flashgen.api.modcall import pack_mod_fields
    from flashgen.codegen import build
    from flashgen.families import bwd_sm90
    from flashgen.problem import ProblemKey

    monkeypatch.setenv("FLASHGEN_HOME", str(tmp_path))
    pair = registered(score, document)
    key = ProblemKey("bwd_dkdv", "sm_90a", "bf16", d, False, 4096, "")
    spec = dispatch.mod_backward_spec(key, 232448, mods.token_number(pair), verify=True, row_bounds=True)
    plain = dispatch.mod_backward_spec(key, 232448, mods.token_number(pair), verify=True)
    assert spec.kind == "bwd_sm90" and spec.row_bounds == bounded and not plain.row_bounds
    report = build(spec).report
    assert report.spill_stores == 0 and report.stack_frame == 0, (spec.name, report)
    spec = spec.replace(row_bounds=True)
    flags = [score is not None, True, pair.score_grad is not None, False, False, True]
    assert "_rb_" in spec.name and KernelSpec.from_name(spec.name) == spec
    assert "fg_mod_variant<" + ", ".join("true" if f else "false" for f in flags) + ">" in render(spec)
    assert dispatch.mod_backward_row_bounds(pair) and not dispatch.mod_backward_row_bounds(registered(score, causal))
    mask = flashgen.create_block_mask(document, None, None, 64, 64, device="cpu")
    rows, tiles = mask.row_bounds(), mask.for_key_tile(spec.block_m, spec.block_n)
    struct = bwd_sm90.FAMILY.param_struct()
    offset, blob = pack_mod_fields(struct, (), tiles, rows)
    params = struct()
    params.dq_rot = 7
    ctypes.memmove(ctypes.addressof(params) + offset, blob, len(blob))
    assert params.bm_rows == rows.data_ptr() and params.bm_count == tiles.counts.data_ptr() and params.dq_rot == 7


@pytest.mark.parametrize("score,mask", [(None, document), (softcap, document), (alibi, None), (relative16, None)])
@pytest.mark.parametrize("arch,d", [("sm_80", 64), ("sm_80", 128), ("sm_86", 96), ("sm_89", 64), ("sm_80", 256),
                                    ("sm_80", 160)])
def test_mma_sync_backward_serves_mods_elsewhere(score, mask, arch, d, tmp_path, monkeypatch):
    """Where bwd_sm90 does not run (the other GPUs), the mods' backward is the mma.sync dK/dV
    kernel with dQ by atomics (bwd_dkdv), the rule's tile, built clean offline; a mask walks the block mask's
    per-key-block lists there (the kernel's SPARSE path)."""
    from flashgen import dispatch, gpus
    from flashgen.codegen import build
    from flashgen.problem import ProblemKey

    monkeypatch.setenv("FLASHGEN_HOME", str(tmp_path))
    pair = registered(score, mask)
    key = ProblemKey("bwd_dkdv", arch, "bf16", d, False, 4096, "")
    spec = dispatch.mod_backward_spec(key, gpus.ARCH_SMEM_PER_BLOCK[arch], mods.token_number(pair), verify=True)
    assert spec.kind == "bwd_dkdv" and spec.mod == mods.token_number(pair) and not spec.causal
    report = build(spec).report
    assert report.spill_stores == 0 and report.stack_frame == 0, (spec.name, report)
    src = render(spec)
    flags = [pair.score is not None, pair.mask is not None, pair.score_grad is not None]
    assert "fg_mod_variant<" + ", ".join("true" if f else "false" for f in flags) + ">" in src


def test_mods_backward_kinds_and_rules():
    """No built-in variant beside a mod in the backward kernels; a plain bwd_dkdv kernel's source carries no mod
    functions; no d = 256 tile in 99 KB."""
    with pytest.raises(ValueError, match="built-in variant"):
        KernelSpec(kind="bwd_sm90", head_dim=128, block_m=64, block_n=128, warps=12, mod=5, causal=True).validate()
    for kind in ("bwd_dkdv", "bwd_dkdv_nodq", "bwd_dq"):
        with pytest.raises(ValueError, match="built-in variant"):
            KernelSpec(kind=kind, head_dim=128, block_m=64, block_n=64, warps=8, mod=5, softcap=True).validate()
    plain = render(KernelSpec(kind="bwd_dkdv", arch="sm_80", head_dim=64, block_m=64, block_n=64, warps=4).validate())
    assert "fg_score_mod(" not in plain and "struct fg_mod_variant" not in plain
    from flashgen import dispatch, gpus
    from flashgen.problem import ProblemKey

    with pytest.raises(flashgen.UnsupportedError, match="d=256"):  # (no d = 256 tile in 99 KB, as without mods)
        dispatch.mod_backward_spec(ProblemKey("bwd_dkdv", "sm_89", "bf16", 256, False, 4096, ""),
                                   gpus.ARCH_SMEM_PER_BLOCK["sm_89"], 5)


@pytest.mark.parametrize("score,mask", [(None, document), (softcap, document), (relative16, None)])
@pytest.mark.parametrize("arch,d", [("sm_80", 64), ("sm_80", 128), ("sm_90a", 128), ("sm_90a", 160), ("sm_80", 256)])
def test_deterministic_mods_backward_is_the_mma_sync_pair(score, mask, arch, d, tmp_path, monkeypatch):
    """deterministic=True with mods: bwd_dkdv_nodq and bwd_dq with the mods' token (the dQ kernel walks the
    forward's per-query-block lists), on every GPU, built clean offline."""
    from flashgen import dispatch, gpus
    from flashgen.codegen import build
    from flashgen.problem import ProblemKey

    monkeypatch.setenv("FLASHGEN_HOME", str(tmp_path))
    pair = registered(score, mask)
    key = ProblemKey("bwd_dkdv", arch, "bf16", d, False, 4096, "")
    kv, dq = dispatch.mod_backward_pair(key, gpus.ARCH_SMEM_PER_BLOCK[arch], mods.token_number(pair), verify=True)
    assert (kv.kind, dq.kind) == ("bwd_dkdv_nodq", "bwd_dq")
    for spec in (kv, dq):
        assert spec.mod == mods.token_number(pair) and not spec.causal and spec.arch == arch
        report = build(spec).report
        assert report.spill_stores == 0 and report.stack_frame == 0, (spec.name, report)
        flags = [pair.score is not None, pair.mask is not None, pair.score_grad is not None]
        assert "fg_mod_variant<" + ", ".join("true" if f else "false" for f in flags) + ">" in render(spec)


def test_deterministic_mods_reach_the_backward(monkeypatch):
    """flashgen.attention(..., deterministic=True) with mods is no longer refused: the flag picks the plan's
    deterministic backward before the forward's launch and reaches attention_backward; without it, under
    torch.use_deterministic_algorithms(True), the backward asks for the deterministic one. (Kernels stood in
    for: no GPU here.)"""
    from types import SimpleNamespace

    from flashgen.api import modcall

    pair = registered(None, document)
    monkeypatch.setattr(modcall, "_planned", lambda *a: SimpleNamespace(base=SimpleNamespace(kernel=object()),
                                                                         pair=pair, scale=0.125))
    monkeypatch.setattr(modcall, "_launch", lambda plan, q_, k_, v_, r: (q_.detach() * 1.0, q_.new_zeros(q_.shape[:3])))
    calls = []
    monkeypatch.setattr(modcall, "backward_of", lambda plan, q_, det=False: calls.append(("plan", det)) or "mods")
    monkeypatch.setattr(modcall, "attention_backward", lambda dout, q_, k_, v_, *a, deterministic, mods, **kw: (
        calls.append(("run", deterministic, mods)), (torch.zeros_like(q_), torch.zeros_like(k_), torch.zeros_like(v_)))[1])
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    flashgen.attention(q, q, q, mask_mod=document, deterministic=True).sum().backward()
    assert calls == [("plan", True), ("plan", True), ("run", True, "mods")]
    calls.clear()
    out = flashgen.attention(q, q, q, mask_mod=document)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        out.sum().backward()
    finally:
        torch.use_deterministic_algorithms(previous)
    assert calls == [("plan", False), ("plan", True), ("run", True, "mods")]


def test_backward_takes_the_least_spilling_tile_when_none_is_clean(tmp_path, monkeypatch):
    """A 50-softcap with the causal mask_mod leaves ptxas a few registers short at d = 128 in both dP^T
    orders (NVRTC 13.0): dispatch takes the tile that spills least (the load accepts its spills) instead
    of refusing the mod's backward; a clean tile, where a toolchain finds one, comes first."""
    from flashgen import dispatch
    from flashgen.codegen import build
    from flashgen.problem import ProblemKey

    monkeypatch.setenv("FLASHGEN_HOME", str(tmp_path))
    pair = registered(lambda s, b, h, q, kv: 50.0 * torch.tanh(s / 50.0), lambda b, h, q, kv: q >= kv)
    key = ProblemKey("bwd_dkdv", "sm_90a", "bf16", 128, False, 4096, "")
    spec = dispatch.mod_backward_spec(key, 232448, mods.token_number(pair), verify=True)
    others = [dispatch.mod_backward_spec(key, 232448, mods.token_number(pair)).replace(dp_late=late)
              for late in (False, True)]

    def spilled(s):
        r = build(s).report
        return r.spill_stores + r.spill_loads + r.stack_frame

    problems = dispatch.resource_problems(spec)
    assert all(p.startswith(("spills:", "stack frame")) for p in problems), problems
    assert spilled(spec) == min(spilled(s) for s in others)


@pytest.mark.parametrize("qkv_grad", [True, False], ids=["with-qkv", "captures-only"])
def test_captured_tensors_get_their_gradients(monkeypatch, qkv_grad):
    """A score_mod's captured tensors that require grad get the gradient autograd gives through the fp32
    reference (api.capturegrad, a block of rows at a time; blocks of 7 rows here), beside dQ/dK/dV from the
    kernels (stood in for: no GPU here). Checked through flashgen.attention, so the autograd wiring (the
    captures as extra inputs of the function) is what runs; with q, k and v frozen the captures alone take
    the autograd path, and the backward kernels are not run."""
    import math
    from types import SimpleNamespace

    from flashgen.api import capturegrad, modcall
    from flashgen.reference import reference

    torch.manual_seed(0)
    b, h, hk, nq, nk, d = 2, 4, 2, 37, 53, 16
    q, k, v = torch.randn(b, h, nq, d), torch.randn(b, hk, nk, d), torch.randn(b, hk, nk, d)
    bias = torch.randn(h, nq + nk - 1, requires_grad=True)
    slopes = torch.rand(h, requires_grad=True)
    scale = 1 / math.sqrt(d)

    def score(s, bb, hh, qi, ki):
        return 2.0 * torch.tanh((s + bias[hh, qi - ki + nk - 1]) / 2.0) - slopes[hh] * (qi - ki).abs()

    def mask(bb, hh, qi, ki):
        return (qi >= ki) | (ki < 3)

    def fake_planned(q_, k_, v_, softmax_scale, layout, return_lse, spec, score_mod, mask_mod, block_mask):
        pair = mods.pair(mods.trace_score_mod(score_mod, allow_cpu=True), mods.trace_mask_mod(mask_mod, allow_cpu=True))
        return SimpleNamespace(base=SimpleNamespace(kernel=object()), pair=pair, scale=scale)

    def fake_launch(plan, q_, k_, v_, return_lse):
        with torch.no_grad():
            return reference(q_, k_, v_, False, scale, score_mod=score, mask_mod=mask)

    monkeypatch.setattr(modcall, "_planned", fake_planned)
    monkeypatch.setattr(modcall, "_launch", fake_launch)
    kernel_calls = []
    monkeypatch.setattr(modcall, "backward_of", lambda plan, q_, det=False: kernel_calls.append("plan"))
    monkeypatch.setattr(modcall, "attention_backward", lambda dout, q_, k_, v_, *a, **kw: (
        kernel_calls.append("run"), (torch.zeros_like(q_), torch.zeros_like(k_), torch.zeros_like(v_)))[1])
    monkeypatch.setattr(capturegrad, "BLOCK_SCORES", 7 * b * h * nk)
    leaves = [t.clone().requires_grad_(qkv_grad) for t in (q, k, v)]
    out, lse = flashgen.attention(*leaves, score_mod=score, mask_mod=mask, return_lse=True)
    dout, dl = torch.randn_like(out), torch.randn_like(lse)
    ((out * dout).sum() + (lse * dl).sum()).backward()
    got = (bias.grad.clone(), slopes.grad.clone())
    assert kernel_calls == (["plan", "plan", "run"] if qkv_grad else [])
    bias.grad = slopes.grad = None
    ref_out, ref_lse = reference(q, k, v, False, scale, score_mod=score, mask_mod=mask)
    ((ref_out * dout).sum() + (ref_lse * dl).sum()).backward()
    for g, want in zip(got, (bias.grad, slopes.grad)):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_capture_gradients_read_both_layouts():
    """capture_grads on (b, s, h, d) views gives what it gives on (b, h, s, d) tensors."""
    import math

    from flashgen.api.capturegrad import capture_grads
    from flashgen.reference import reference

    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 20, 8), torch.randn(1, 1, 30, 8), torch.randn(1, 1, 30, 8)
    table = torch.randn(2, 60, requires_grad=True)

    def score(s, bb, hh, qi, ki):
        return s + table[hh, qi - ki + 29]

    pair = mods.pair(mods.trace_score_mod(score, allow_cpu=True), None)
    out, lse = reference(q, k, v, False, 1 / math.sqrt(8), score_mod=score)
    out, dout = out.detach(), torch.randn_like(out)
    bhsd = capture_grads(pair, [table], q, k, v, out, lse.detach(), dout, None, 1 / math.sqrt(8), "bhsd")[0]
    bshd = capture_grads(pair, [table], *(t.transpose(1, 2) for t in (q, k, v, out)), lse.detach(),
                         dout.transpose(1, 2), None, 1 / math.sqrt(8), "bshd")[0]
    torch.testing.assert_close(bhsd, bshd)
    assert bhsd.abs().sum() > 0


def test_a_capture_only_the_mask_reads_gets_a_zero_gradient():
    from flashgen.api.capturegrad import capture_grads

    lengths = torch.tensor([5.0, 9.0], requires_grad=True)
    pair = mods.pair(None, mods.trace_mask_mod(lambda b, h, q, kv: kv < lengths[b], allow_cpu=True))
    q = torch.randn(2, 1, 4, 8)
    grads = capture_grads(pair, [lengths], q, q, q, q, torch.zeros(2, 1, 4), q, None, 0.3, "bhsd")
    assert torch.equal(grads[0], torch.zeros(2))


# ---- decode (decode_split): mods on every block, no block mask

def window_mask(b, h, q, kv):
    return q - kv <= 100


def test_decode_spec_takes_mods_alone():
    base = dict(kind="decode_split", head_dim=128, block_m=16, block_n=128, warps=4, stages=2, causal=True)
    assert KernelSpec(**base, mod=5).validate().mod == 5
    for change in ({"window": True}, {"softcap": True}, {"sinks": True}, {"fp8": True}):
        with pytest.raises(ValueError, match="no built-in variant"):
            KernelSpec(**base, mod=5, **change).validate()
    with pytest.raises(ValueError, match="not a mod token"):
        KernelSpec(**base, mod=1 << 48).validate()


@pytest.mark.parametrize("score,mask,arch,d", [
    (alibi, window_mask, "sm_90a", 128), (softcap, None, "sm_80", 64), (None, document, "sm_90a", 256),
    (relative16, window_mask, "sm_86", 128)])
def test_decode_mod_kernels_compile_without_spills(score, mask, arch, d, tmp_path, monkeypatch):
    """dispatch's decode_split kernel with mods (the plain key's tile, then the rule's) builds clean offline, and
    its source calls the traced functions through decode_mod_variant."""
    from flashgen import dispatch, gpus
    from flashgen.codegen import build
    from flashgen.problem import ProblemKey

    monkeypatch.setenv("FLASHGEN_HOME", str(tmp_path))
    pair = registered(score, mask)
    key = ProblemKey("decode_split", arch, "bf16", d, True, 4096, "")
    spec = dispatch.mod_decode_spec(key, None, gpus.ARCH_SMEM_PER_BLOCK[arch], mods.token_number(pair), "some",
                                    verify=True)
    report = build(spec).report
    assert spec.kind == "decode_split" and spec.mod == mods.token_number(pair)
    assert report.spill_stores == 0 and report.stack_frame == 0, (spec.name, report)
    src = render(spec)
    flags = ", ".join("true" if f else "false" for f in (score is not None, mask is not None))
    assert f"decode_mod_variant<{flags}>" in src and "SLOPES[" not in src and "window_mask" not in src


def test_decode_with_mods_on_meta_and_refusals():
    """On meta tensors a decode call with mods checks and traces them and returns the output's shape; a mod
    beside a built-in variant, or a mod that is not a function, is refused before anything runs."""
    q = torch.empty(2, 1, 8, 128, device="meta", dtype=torch.bfloat16)
    cache = torch.empty(2, 300, 2, 128, device="meta", dtype=torch.bfloat16)
    out, lse = flashgen.decode(q, cache, cache, score_mod=alibi, mask_mod=window_mask, return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 8, 1)
    with pytest.raises(flashgen.UnsupportedError, match="window"):
        flashgen.decode(q, cache, cache, score_mod=alibi, window=(64, 0))
    with pytest.raises(TypeError, match="score_mod must be a function"):
        flashgen.decode(q, cache, cache, score_mod=5)
    with pytest.raises(mods.ModError):
        flashgen.decode(q, cache, cache, score_mod=lambda s, b, h, qi, kv: torch.sin(s))


# ---- tuning keyed by the mods' hash

def test_mod_key_variant_grammar():
    from flashgen import variants

    assert variants.mod_key(5) == "mod5" and variants.mod_of("mod5") == 5 and variants.is_key_variant("mod5")
    for text in ("mod", "mod0", "mod05", "win_mod5", "mod5_win", f"mod{1 << 48}", "modx"):
        assert not variants.is_key_variant(text) and variants.mod_of(text) == 0, text
    for bad in (0, -1, 1 << 48, True, "5"):
        with pytest.raises(ValueError):
            variants.mod_key(bad)


def test_tables_hold_mod_keys_and_refuse_mismatches(tmp_path):
    """A mod key's entry (forward, non-causal) round-trips through a table file; its spec must carry that
    token, and a plain key's spec none."""
    import yaml

    from flashgen import ConfigError, gpus, tables
    from flashgen.problem import ProblemKey

    spec = mod_spec(registered(alibi), "ws_ov_s3")
    key = ProblemKey("fwd", "sm_90a", "bf16", 128, False, 4096, f"mod{spec.mod}")
    path = tmp_path / "h200.yaml"
    tables.save(tables.Table(meta=tables.make_meta(gpus.get("h200"), "model")), path)
    base = yaml.safe_load(path.read_text())
    record = {"key": tables.key_record(key), "spec": spec.to_dict(), "time_ms": 1.0, "source": "model"}

    def load_with(entry):
        path.write_text(yaml.safe_dump({**base, "entries": [entry]}))
        return tables.load(path)

    assert load_with(record).spec(key) == spec
    for change, msg in (({"key": {**record["key"], "variant": "mod7"}}, "does not match its key"),
                        ({"key": {**record["key"], "variant": ""}}, "does not match its key"),
                        ({"key": {**record["key"], "causal": True}}, "not causal")):
        with pytest.raises(ConfigError, match=msg):
            load_with({**record, **change})


def test_tune_model_keys_the_winner_by_the_mods_hash(capsys, tmp_path, monkeypatch):
    """flashgen tune --score-mod/--mask-mod (ranked by the model, no GPU) writes the entry of the mods' own key
    ("mod<token>"), and dispatch's pick for a call with those mods is that entry; other mods keep the plain
    key's tile."""
    from cli_util import run_main
    from flashgen import dispatch
    from flashgen.problem import ProblemKey

    monkeypatch.setenv("FLASHGEN_HOME", str(tmp_path / "home"))
    path = tmp_path / "my_mods.py"
    path.write_text("import torch\nslopes = torch.rand(16)\n"
                    "def alibi(score, b, h, q_idx, kv_idx):\n    return score - slopes[h] * (q_idx - kv_idx).abs()\n"
                    "def causal(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n")
    code, out, err = run_main(capsys, "tune", "--gpu", "h200", "--d", "128", "--seqlens", "4096", "--model",
                              "--score-mod", f"{path}:alibi", "--mask-mod", f"{path}:causal", "--trials", "6",
                              "--space", "persistent=false", "--quiet")
    assert code == 0, err
    from flashgen import tables

    table = tables.load(tmp_path / "home" / "configs" / "h200.yaml")
    (key,) = table.entries
    assert key.variant.startswith("mod") and not key.causal and key.kind == "fwd"
    dispatch.clear()
    call_key = ProblemKey("fwd", "sm_90a", "bf16", 128, True, 4096, "")
    picked = dispatch.mod_spec(call_key, "h200", 232448, int(key.variant[3:]))
    entry = tables.lookup("h200", key)
    assert picked.mod == int(key.variant[3:]) and picked == entry.replace(bias_gemm=True).validate(), \
        "the tuned tile, with the linear ALiBi mod's column part in S's GEMM"
    bounded = dispatch.mod_spec(call_key, "h200", 232448, int(key.variant[3:]), row_bounds=True)
    assert bounded == picked.replace(row_bounds=True), "a mask with row bounds keeps the tuned tile and masks by them"
    other = dispatch.mod_spec(call_key, "h200", 232448, mods.token_number(registered(alibi)))
    assert other != picked and other.mod == mods.token_number(registered(alibi))


def test_row_bounds_never_cost_an_index_mask_its_tile(tmp_path, monkeypatch):
    """With row bounds, a mask_mod of index compares alone (causal, and an offset read as ``off[0]``, which the
    kernel reads once per head) keeps dispatch's tile: the bounds where that tile builds clean with them, else the
    mask_mod on it (the H200's d = 128 causal pick, a 192-row tile of three consumer warpgroups, spills with them);
    a mask that reads a captured tensor per score (documents) takes the bounds on the first tile where they build
    clean."""
    from flashgen import dispatch, gpus
    from flashgen.codegen import build
    from flashgen.problem import ProblemKey

    monkeypatch.setenv("FLASHGEN_HOME", str(tmp_path))
    key = ProblemKey("fwd", "sm_90a", "bf16", 128, True, 8192, "")
    budget = gpus.get("h200").smem_per_block
    off = torch.tensor([0], dtype=torch.int32)
    docs = registered(None, document)
    assert dispatch.mask_loads_per_score(docs)
    for mask in (causal, lambda b, h, q, kv: q + off[0] >= kv):
        index = registered(None, mask)
        assert not dispatch.mask_loads_per_score(index)
        picked = dispatch.mod_spec(key, "h200", budget, mods.token_number(index), verify=True)
        spec = dispatch.mod_spec(key, "h200", budget, mods.token_number(index), verify=True, row_bounds=True)
        bounded = picked.replace(row_bounds=True).validate()
        assert spec == (picked if build(bounded).report.problems() else bounded), (picked.name, spec.name)
        assert (picked.block_m, picked.block_n) == (192, 80), picked.name  # the causal key's tile, clean
    spec = dispatch.mod_spec(key, "h200", budget, mods.token_number(docs), verify=True, row_bounds=True)
    report = build(spec).report
    assert spec.row_bounds and report.spill_stores == 0 and report.stack_frame == 0, (spec.name, report)


def test_mod_keys_count_the_pairs_their_mask_lets_through():
    """The tuner's FLOPs of a mod key (its table entry's TFLOP/s, its time estimate) count the (query, key)
    pairs the mask_mod lets through, as the benchmarks do; a score_mod alone leaves the square."""
    from flashgen import variants
    from flashgen.problem import ProblemKey
    from flashgen.tuner import space

    n, d = 1024, 128
    plain = ProblemKey("fwd", "sm_90a", "bf16", d, False, n, "")
    b, h = space.measured_shape(plain)[:2]

    def key_of(pair):
        return plain.replace(variant=variants.mod_key(mods.token_number(pair)))

    def causal(b_, h_, q, kv):
        return q >= kv

    doc = torch.arange(n, dtype=torch.int32) // 100

    def docs(b_, h_, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    assert space.key_flops(key_of(registered(mask=causal))) == 4.0 * b * h * (n * (n + 1) // 2) * d
    q, kv = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    visible = int(((doc[q] == doc[kv]) & (q >= kv)).sum())
    assert space.key_flops(key_of(registered(alibi, docs))) == 4.0 * b * h * visible * d
    assert space.key_flops(key_of(registered(alibi))) == space.key_flops(plain)
    bwd = key_of(registered(mask=causal)).replace(kind="bwd_dkdv")
    assert space.key_flops(bwd) == 2.5 * space.key_flops(key_of(registered(mask=causal)))
