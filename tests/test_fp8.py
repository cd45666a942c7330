"""FP8 without a GPU: the quantizing helper, the FP8 reference, the fwd_sm90 fp8 spec rules, the TMA's
swizzle choice, and every refusal of an FP8 ``flashgen.attention`` call (meta tensors: the checks run,
nothing launches)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen import tma  # noqa: E402
from flashgen.api.fp8 import FP8, check_descale_values, dequantize_fp8, descale_strides  # noqa: E402
from flashgen.errors import UnsupportedError  # noqa: E402
from flashgen.families import fwd_sm90  # noqa: E402
from flashgen.problem import ProblemKey  # noqa: E402
from flashgen.reference import reference  # noqa: E402
from flashgen.spec import KernelSpec  # noqa: E402

E4M3_MAX = 448.0


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("per", ["head", "tensor"])
def test_quantize_round_trip(layout, per):
    x = torch.randn(2, 3, 37, 64) * torch.tensor([0.01, 1.0, 300.0]).reshape(1, 3, 1, 1)
    if layout == "bshd":
        x = x.transpose(1, 2).contiguous()
    x8, ds = flashgen.quantize_fp8(x, per=per, layout=layout)
    assert x8.dtype == FP8 and x8.shape == x.shape and ds.dtype == torch.float32
    assert ds.shape == ((2, 3) if per == "head" else (1,))
    back = dequantize_fp8(x8, ds, layout)
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 of each group's largest magnitude's scale
    heads = 1 if layout == "bhsd" else 2
    groups = x.abs().amax(dim=(2, 3) if layout == "bhsd" else (1, 3), keepdim=True) if per == "head" else x.abs().max()
    assert ((back - x).abs() <= groups * 2.0 ** -4 + 1e-30).all()
    assert x8.float().abs().max() <= E4M3_MAX
    if per == "head":  # each group's largest value maps to e4m3's largest
        top = x8.float().abs().amax(dim=(2, 3) if heads == 1 else (1, 3))
        assert torch.equal(top, torch.full_like(top, E4M3_MAX))


def test_quantize_refuses():
    with pytest.raises(TypeError):
        flashgen.quantize_fp8(torch.zeros(1, 1, 4, 16, dtype=torch.int32))
    with pytest.raises(ValueError):
        flashgen.quantize_fp8(torch.zeros(4, 16))
    with pytest.raises(ValueError):
        flashgen.quantize_fp8(torch.zeros(1, 1, 4, 16), per="row")
    with pytest.raises(ValueError, match="inf or NaN"):
        flashgen.quantize_fp8(torch.full((1, 1, 4, 16), float("inf")))
    x8, ds = flashgen.quantize_fp8(torch.zeros(1, 2, 4, 16))  # all zeros: a positive factor all the same
    assert (ds > 0).all() and (x8.float() == 0).all()


def test_descale_values_and_strides():
    check_descale_values((("a", torch.ones(2, 3)), ("b", torch.tensor([0.5]))))
    for bad in (torch.tensor([float("nan")]), torch.tensor([0.0]), torch.tensor([-1.0]), torch.tensor([float("inf")])):
        with pytest.raises(ValueError, match="q_descale"):
            check_descale_values((("k_descale", torch.ones(1)), ("q_descale", bad)))
    assert descale_strides(torch.ones(()), 8) == (0, 0, 1)
    assert descale_strides(torch.ones(1), 8) == (0, 0, 1)
    assert descale_strides(torch.ones(3, 8), 8) == (8, 1, 1)
    assert descale_strides(torch.ones(3, 2), 8) == (2, 1, 4)  # q per KV head: 4 query heads a factor


def test_reference_p_fp8():
    """P in e4m3: exact where P is (one key: P = 1), close to fp32 otherwise, within e4m3's rounding."""
    q, k, v = torch.randn(1, 2, 5, 32), torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32)
    out, _ = reference(q, k, v, False, 0.2, p_fp8=True)
    assert torch.allclose(out, v.expand(1, 2, 5, 32), atol=0, rtol=1e-6)
    q, k, v = torch.randn(2, 4, 50, 64), torch.randn(2, 2, 70, 64), torch.randn(2, 2, 70, 64)
    ref, lse = reference(q, k, v, True, 0.125)
    emu, lse8 = reference(q, k, v, True, 0.125, p_fp8=True)
    assert torch.equal(lse, lse8)
    err = (emu - ref).abs().max().item()
    assert 0 < err < 2.0 ** -4 * v.abs().max().item()


def test_spec_token_and_rules():
    spec = fwd_sm90.variant(128, True, "ws_ov_s3", fp8=True)
    assert "_fp8_" in spec.name and KernelSpec.from_name(spec.name) == spec
    assert spec.replace(fp8=False).with_tokens("fp8") == spec
    # the bytes: Q, K ring, V^T ring, two raw V blocks, one byte an element
    assert spec.smem_bytes() == 128 * (128 + 2 * 3 * 128 + 2 * 128) + 1024
    for bad in ("ws_ps", "", "ws_n96", "ws_vl", "ws_ls", "ws_m192"):
        with pytest.raises(ValueError, match="fp8"):
            fwd_sm90.variant(128, False, bad, fp8=True)
    with pytest.raises(ValueError, match="fp8"):
        KernelSpec(kind="fwd_v2", fp8=True).validate()


def test_rule_and_compile_tier_take_fp8_keys():
    for d in (64, 96, 128, 256):
        key = ProblemKey("fwd", "sm_90a", "bf16", d, False, 8192, "fp8")
        spec = flashgen.families.default_spec(key, 232448 - 1024)
        assert spec.kind == "fwd_sm90" and spec.fp8 and spec.head_dim >= d
    assert any(s.fp8 for s in flashgen.families.rule_specs("sm_90a", 232448 - 1024))
    with pytest.raises(UnsupportedError):
        flashgen.families.default_spec(ProblemKey("fwd", "sm_80", "bf16", 128, False, 8192, "fp8"), 166912)


def test_shipped_tables_leave_fp8_to_its_rule():
    """An FP8 key with no entry of its own in a shipped table does not take the plain problem's tuned
    tile where FP8 refuses it (the H200's bf16 d=128 tiles are 192-row or lean): the FP8 rule serves."""
    from flashgen import dispatch, tables

    for gpu in ("h100", "h200"):
        for d in (64, 128, 256):
            for causal in (False, True):
                key = ProblemKey("fwd", "sm_90a", "bf16", d, causal, 8192, "fp8")
                spec = dispatch.select(key, gpu, 232448 - 1024)
                assert spec.kind == "fwd_sm90" and spec.fp8, (gpu, d, causal, spec.name)
                plain = tables.lookup(gpu, key.replace(variant=""))
                if plain is not None and plain.kind == "fwd_sm90" and not (plain.block_m == 192 or plain.lean_softmax):
                    assert (spec.block_m, spec.block_n) == (plain.block_m, plain.block_n)


def test_tma_swizzle_follows_the_box_row():
    assert tma.SWIZZLES[128 * tma.DTYPE_BYTES["e4m3"]] == 3 and tma.SWIZZLES[64 * tma.DTYPE_BYTES["e4m3"]] == 2
    with pytest.raises(UnsupportedError, match="swizzle"):
        tma.encode(1 << 20, "e4m3", (48, 64, 1, 1), (48, 3072, 3072), (48, 64, 1, 1))


# ---- an FP8 call's refusals (meta tensors: the checks, no launch) ----

def _meta(b=2, h=4, hk=2, n=64, d=64, dtype=FP8):
    q = torch.empty(b, h, n, d, device="meta", dtype=dtype)
    k = torch.empty(b, hk, n, d, device="meta", dtype=dtype)
    return q, k, torch.empty_like(k)


def _ds(*shape, dtype=torch.float32, device="meta"):
    return torch.empty(shape, device=device, dtype=dtype)


def test_meta_call_shapes():
    q, k, v = _meta()
    out, lse = flashgen.attention(q, k, v, causal=True, return_lse=True, q_descale=_ds(2, 2), k_descale=_ds(2, 2),
                                  v_descale=_ds(1), out_dtype=torch.float16)
    assert out.shape == q.shape and out.dtype == torch.float16 and lse.shape == (2, 4, 64)
    out = flashgen.attention(q, k, v, q_descale=_ds(2, 4), k_descale=_ds(), v_descale=_ds(1))
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("change,error,match", [
    ({"q_descale": None}, ValueError, "q_descale is missing"),
    ({"v_descale": None}, ValueError, "v_descale is missing"),
    ({"k_descale": "shape"}, ValueError, "k_descale must have shape"),
    ({"k_descale": "qshape"}, ValueError, "k_descale must have shape"),  # (2, 4): k's factors are per KV head
    ({"q_descale": "dtype"}, TypeError, "q_descale must be float32"),
    ({"v_descale": "device"}, ValueError, "v_descale must be on"),
    ({"q_descale": "list"}, TypeError, "q_descale must be a torch.Tensor"),
    ({"out_dtype": torch.float32}, TypeError, "out_dtype"),
    ({"v": "bf16"}, TypeError, "v must be float8_e4m3fn"),
    ({"q": "bf16"}, TypeError, "q must be float8_e4m3fn"),
    ({"d": 72}, UnsupportedError, "multiples of 16"),
    ({"score_mod": lambda s, b, h, i, j: s}, UnsupportedError, "score_mod"),
    ({"deterministic": True}, UnsupportedError, "deterministic"),
    ({"algorithm": "standard"}, UnsupportedError, "algorithm"),
])
def test_fp8_refusals(change, error, match):
    q, k, v = _meta(d=change.pop("d", 64))
    kw = {"q_descale": _ds(2, 4), "k_descale": _ds(2, 2), "v_descale": _ds(2, 2)}
    for name, value in change.items():
        if name in ("q", "v"):
            t = torch.empty((q if name == "q" else v).shape, device="meta", dtype=torch.bfloat16)
            q, v = (t, v) if name == "q" else (q, t)
        elif value == "shape":
            kw[name] = _ds(3)
        elif value == "qshape":
            kw[name] = _ds(2, 4)
        elif value == "dtype":
            kw[name] = _ds(2, 4, dtype=torch.float16)
        elif value == "device":
            kw[name] = _ds(2, 2, device="cpu")
        elif value == "list":
            kw[name] = [1.0]
        else:
            kw[name] = value
    with pytest.raises(error, match=match):
        flashgen.attention(q, k, v, **kw)


def test_bf16_call_names_the_descales_for_fp8_inputs():
    q, k, v = _meta()
    qb = torch.empty(q.shape, device="meta", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        flashgen.attention(qb, k, v, q_descale=_ds(1), k_descale=_ds(1), v_descale=_ds(1))


def test_fp8_refuses_gradients():
    q = torch.empty(1, 1, 16, 64, device="meta", dtype=torch.float32, requires_grad=True)
    k8 = torch.empty(1, 1, 16, 64, device="meta", dtype=FP8)
    with pytest.raises(UnsupportedError, match="forward-only"):
        flashgen.attention(q, k8, k8, q_descale=_ds(1), k_descale=_ds(1), v_descale=_ds(1))


# ---- the forward's V transpose (fwd_sm90.cuh transpose_v), emulated lane by lane ----

def _swz(rb: int, r: int, c: int) -> int:
    """fwd_sm90_cta::swz: byte c of row r in a swizzled panel of rb-byte rows (the TMA's 128/64-byte swizzle)."""
    return r * rb + ((((c >> 4) ^ ((r * rb >> 7) & (rb // 16 - 1))) << 4) | (c & 15))


def _prmt(a: int, b: int, sel: int) -> int:
    src = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    return int.from_bytes(bytes(src[(sel >> (4 * i)) & 7] for i in range(4)), "little")


def _sigma(pos: int) -> int:
    """The key V^T's position ``pos`` holds: inside every 16, position 4t + i holds key [2t, 2t+1, 2t+8, 2t+9][i]
    (the order the consumers' P registers, packed from S's accumulators, are wgmma's A fragment in)."""
    t, i = (pos % 16) // 4, pos % 4
    return 16 * (pos // 16) + (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)[i]


def _wavefronts(addresses: list[int], width: int) -> int:
    """Shared-memory wavefronts one warp access of ``width`` bytes a lane takes: lanes go in phases of
    128 / width, and a phase takes as many wavefronts as the most distinct 4-byte words one bank holds."""
    per_phase, total = 128 // width, 0
    for p0 in range(0, len(addresses), per_phase):
        banks: dict[int, set[int]] = {}
        for a in addresses[p0:p0 + per_phase]:
            for word in range(a // 4, (a + width) // 4):
                banks.setdefault(word % 32, set()).add(word)
        total += max(len(words) for words in banks.values())
    return total


def _vt_at(d: int, bn: int, n: int, p: int) -> int:
    """Byte offset of V^T's (d row n, sigma position p) in a stage: panels of 128 keys (one of bn keys at
    bn = 64), each d rows of its row bytes in that swizzle; the last is 64-byte rows at bn = 192."""
    rb = min(128, bn - p // 128 * 128)
    return p // 128 * d * 128 + _swz(rb, n, p % 128)


@pytest.mark.parametrize("d,bn", [(64, 128), (64, 64), (64, 192), (128, 128), (128, 64), (128, 192), (256, 64),
                                  (256, 128)])
def test_v_transpose_lane_by_lane(d, bn):
    """The 96 transposing threads' loads, byte permutes and stores, step by step as the template issues them,
    turn a raw V block (key rows in the TMA's swizzle) into V^T with sigma's key order, every byte written
    once; the loads and stores stay 16- and 4-byte aligned, a load takes two wavefronts per 128 bytes (the
    counted conflict), a store one (two with 64-key spans)."""
    import random

    rowb = min(128, d)
    raw = bytearray(bn * d)
    v = [[random.randrange(256) for _ in range(d)] for _ in range(bn)]
    for r in range(bn):
        for c in range(d):
            raw[(c // rowb) * bn * rowb + _swz(rowb, r, c % rowb)] = v[r][c]
    vt, written = bytearray(bn * d), [0] * (bn * d)
    kg = bn // 16
    kgs = 8 if kg == 8 else 4
    per = 8 // kgs
    csteps = (d // 16) // per
    steps = (kg // kgs) * csteps
    last = bn % 128 if bn > 128 and bn % 128 else min(bn, 128)
    loads: dict[tuple, list[int]] = {}   # (warp, step, i) -> the warp's load addresses, lane order
    stores: dict[tuple, list[int]] = {}
    for x in range(96):
        w, lane = x // 32, x % 32
        tq, kq, sub = lane % 4, (lane // 4) % kgs, lane // (4 * kgs)
        for st in range(w, steps, 3):
            key0 = (st // csteps) * kgs * 16 + kq * 16
            c = ((st % csteps) * per + sub) * 16
            rbp = last if key0 >= bn // 128 * 128 else min(bn, 128)
            pos = key0 + 4 * tq
            panel, out_panel = (c // rowb) * bn * rowb, pos // 128 * d * 128
            words = []
            for i in range(4):
                r = key0 + 2 * tq + (i & 1) + 8 * (i >> 1)
                a = panel + _swz(rowb, r, c % rowb)
                assert a % 16 == 0
                loads.setdefault((w, st, i), []).append(a)
                words.append([int.from_bytes(raw[a + 4 * k:a + 4 * k + 4], "little") for k in range(4)])
            for q in range(4):
                a, b, cc, dd = (words[i][q] for i in range(4))
                t0, t1 = _prmt(a, b, 0x5140), _prmt(a, b, 0x7362)
                t2, t3 = _prmt(cc, dd, 0x5140), _prmt(cc, dd, 0x7362)
                out = (_prmt(t0, t2, 0x5410), _prmt(t0, t2, 0x7632), _prmt(t1, t3, 0x5410), _prmt(t1, t3, 0x7632))
                for e in range(4):
                    at = out_panel + _swz(rbp, c + 4 * q + e, pos % 128)
                    assert at % 4 == 0
                    stores.setdefault((w, st, q, e), []).append(at)
                    vt[at:at + 4] = out[e].to_bytes(4, "little")
                    for k in range(4):
                        written[at + k] += 1
    assert written == [1] * (bn * d)
    for n in range(d):
        for p in range(bn):
            assert vt[_vt_at(d, bn, n, p)] == v[_sigma(p)][n], (n, p)
    assert {_wavefronts(a, 16) for a in loads.values()} == {8}
    assert {_wavefronts(a, 4) for a in stores.values()} == {1 if kgs == 8 else 2}


def test_192_key_blocks_compile_clean():
    """block_n 192 (V^T in a 128-key panel and a 64-key one, two descriptors) compiles without spills or
    serialized wgmma where S, O and P fit (d 64, 128); d = 256 spills and the family's check refuses it."""
    from flashgen import gpus
    from flashgen.codegen.compiler import compile_source
    from flashgen.codegen.render import render

    spec = fwd_sm90.variant(128, True, "ws_pp", fp8=True, block_n=192)
    report = compile_source(render(spec), "sm_90a", spec.name).report
    assert report.spill_stores == report.spill_loads == report.stack_frame == 0 and report.problems() == []
    assert spec.smem_bytes() <= gpus.get("h200").smem_per_block
    assert spec.check(gpus.get("h200")) == []
    assert fwd_sm90.variant(256, False, "ws", fp8=True, block_n=192).check(gpus.get("h200"))


def test_tuner_space_of_an_fp8_key():
    """An FP8 forward key's candidates are fwd_sm90 FP8 specs the family takes, its baseline the default
    rule's (the paper's tile is fwd_v2's, which takes no FP8 inputs)."""
    from flashgen import gpus
    from flashgen.tuner import space

    h200 = gpus.get("h200")
    key = ProblemKey("fwd", "sm_90a", "bf16", 128, True, 8192, "fp8")
    cands = space.candidates(key, h200)
    assert cands[0] == flashgen.families.default_spec(key, h200.smem_per_block)
    assert space.baseline_label(key) == "default-rule"
    assert len(cands) > 5 and all(c.kind == "fwd_sm90" and c.fp8 and not c.check(h200) for c in cands)
    assert not any(c.lean_softmax or c.persistent or c.block_m == 192 for c in cands)
    assert space.baseline_label(key.replace(variant="")) == "paper-rule"


def test_check_values_is_a_flag():
    q, k, v = _meta()
    with pytest.raises(TypeError, match="check_values"):
        flashgen.attention(q, k, v, q_descale=_ds(1), k_descale=_ds(1), v_descale=_ds(1), check_values="no")
