"""Decode over an FP8 (float8 e4m3) KV cache without a GPU: the spec field and its validation, the default
rule's FP8 tiles, the rendered source, the kernel's conversions and fragment layout (mirrored in Python),
and ``flashgen.decode``'s checks of FP8 caches and their descales.

The conversion mirrors in flashgen/families/decode.py (``e4m3_widen_bits``, ``e4m3_from_float``) follow
templates/decode/decode_fp8.cuh step for step and are compared here with torch's own float8 casts; the
fragment emulation below runs the kernel's ldmatrix lane addresses, widening and mma fragment layouts
(PTX ISA semantics) on the CPU and compares S = Q K^T and O = P V with plain matrix products.
"""
from __future__ import annotations

import random
import re
import struct

import pytest
import torch

import flashgen
from flashgen import families, gpus
from flashgen.api.fp8 import check_descale_values
from flashgen.families import decode as dk, fwd_sm90
from flashgen.problem import ProblemKey
from fake_util import decode_quietly as call, fake
from flashgen.spec import KernelSpec
from cli_util import run_main

F16, BF16, FP8 = torch.float16, torch.bfloat16, torch.float8_e4m3fn
H200_BUDGET = gpus.ARCH_SMEM_PER_BLOCK["sm_90a"]


def fp8_key(arch="sm_90a", dtype="bf16", d=128, variant="fp8"):
    return ProblemKey("decode_split", arch, dtype, d, True, 512, variant)


def fp8_spec(**over):
    fields = dict(kind="decode_split", arch="sm_90a", dtype="bf16", head_dim=128, block_m=16, block_n=128, warps=4,
                  stages=2, kv_load=2, causal=True, fp8=True)
    fields.update(over)
    return KernelSpec(**fields)


# ---------------------------------------------------------------- the spec field, the family, the rule


def test_fp8_spec_name_and_record_round_trip():
    """decode_split's fp8 switch is a name token before _causal (from_name reads it back) and an optional
    record field (present only when set); decode_combine does not take it."""
    spec = fp8_spec().validate()
    assert spec.name == "decode_split_d128_m16_n128_w4_s2_ld2_fp8_causal_bf16_sm90a"
    assert KernelSpec.from_name(spec.name) == spec
    assert spec.to_dict()["fp8"] is True and KernelSpec.from_dict(spec.to_dict()) == spec
    plain = spec.replace(fp8=False)
    assert "fp8" not in plain.to_dict() and "_fp8_" not in plain.name
    both = spec.with_tokens("win_cap_alibi_sink")
    assert KernelSpec.from_name(both.validate().name) == both
    with pytest.raises(ValueError, match="not a field of this kind"):
        KernelSpec(kind="decode_combine", head_dim=128, block_m=16, block_n=16, stages=2, fp8=True).validate()


@pytest.mark.parametrize("over,message", [
    (dict(head_dim=32, block_n=64, warps=2), r"head_dim=32 not in \(64, 128, 256\)"),
    (dict(kv_load=4), "kv_load=4 .* does not load an FP8 cache"),
    (dict(kv_load=5), "kv_load=5 .* does not load an FP8 cache"),
    (dict(head_dim=64, block_n=64, warps=4, stages=4), "rows of FP8 .*rows per load pass must divide 16"),
    (dict(head_dim=128, block_n=128, warps=8), "rows of FP8 .*rows per load pass"),
    (dict(block_n=64, stages=2), "scratch do not fit in the 32768 B K/V ring"),
])
def test_fp8_family_refuses(over, message):
    """What an FP8 decode_split cannot be: a head-dim tile below 64 (its byte rows need four 16-byte
    chunks), the bulk loader, a warp count whose load pass leaves a 16-row group (FP8 rows are half as
    long, so one pass covers twice the rows), a ring too small for the epilogue's scratch."""
    with pytest.raises(ValueError, match=message):
        fp8_spec(**over).validate()


def test_fp8_shared_memory_is_byte_rows():
    """The ring holds rows of head_dim bytes (half a 16-bit tile's); the Q tile stays 16-bit; the entry
    template's static_assert names the FP8 row size (decode_smem_bytes<..., true>)."""
    from flashgen.codegen import render

    for (d, bn, w, st) in ((128, 128, 4, 2), (64, 128, 2, 4), (256, 32, 2, 4), (128, 64, 4, 3)):
        spec = fp8_spec(head_dim=d, block_n=bn, warps=w, stages=st, kv_load=0).validate()
        assert spec.smem_bytes() == 2 * d * 16 + 2 * st * bn * d
        assert spec.smem_bytes() < spec.replace(fp8=False).smem_bytes()
        assert f"decode_smem_bytes<{d}, {bn}, {w}, {st}, 0, true>() == {spec.smem_bytes()}" in render(spec)


def test_rule_picks_fp8_tiles():
    """An FP8 key (variant token fp8) takes DEFAULT_DECODE_TILES_FP8's first fitting tile in every regime,
    on the FP8 head-dim tile that covers the key's (d <= 32: 64); the variants ride on it; every such
    pick is among the specs the compile tier builds (families.rule_specs)."""
    for arch in ("sm_80", "sm_90a"):
        budget = gpus.ARCH_SMEM_PER_BLOCK[arch]
        compiled = set(families.rule_specs(arch, budget))
        for d in dk.DECODE_HEAD_DIMS:
            for dtype in ("fp16", "bf16"):
                for regime in dk.REGIMES:
                    spec = dk.first_rule_spec(fp8_key(arch, dtype, d), budget, regime)
                    tile = max(d, 64)
                    bn, w, st, load = dk.DEFAULT_DECODE_TILES_FP8[tile][0]
                    assert spec == KernelSpec(kind="decode_split", arch=arch, dtype=dtype, head_dim=tile, block_m=16,
                                              block_n=bn, warps=w, stages=st, kv_load=load, causal=True, fp8=True)
                    assert spec in compiled
                    with_variants = dk.first_rule_spec(fp8_key(arch, dtype, d, "win_cap_alibi_sink_fp8"), budget,
                                                       regime)
                    assert with_variants == spec.with_tokens("win_cap_alibi_sink")
    fp8_specs = [s for s in dk.SPLIT.rule_specs("sm_90a", H200_BUDGET) if s.fp8]
    assert {s.name for s in fp8_specs if s.dtype == "bf16"} == {
        "decode_split_d64_m16_n128_w2_s4_fp8_causal_bf16_sm90a",
        "decode_split_d128_m16_n128_w4_s2_ld2_fp8_causal_bf16_sm90a",
        "decode_split_d256_m16_n32_w2_s4_fp8_causal_bf16_sm90a"}


@pytest.mark.parametrize("batch,heads_kv,seqlen,want,want_16bit", [
    (1, 8, 131072, 32, 16),   # "few": 8 groups fill 2 x 132 slots with 32 splits; the 16-bit rule stops at 16
    (1, 4, 131072, 64, 32),
    (1, 32, 32768, 8, 8),     # below MERGE_SPLITS both rules fill the slots
    (8, 8, 131072, 4, 4),
    (32, 8, 32768, 1, 1),     # the groups fill 80 % of the slots: no split
])
def test_fp8_splits_fill_the_slots(batch, heads_kv, seqlen, want, want_16bit):
    """An FP8 cache's split count (fill_slots) fills one wave of SM slots (two 128/4/2 FP8 CTAs per SM on
    an H200) at any split count, where the 16-bit rule takes more than MERGE_SPLITS splits only up to one
    CTA per SM."""
    assert dk.num_splits_heuristic(batch, heads_kv, 1, seqlen, 128, 132, 2, fill_slots=True) == want
    assert dk.num_splits_heuristic(batch, heads_kv, 1, seqlen, 128, 132, 2) == want_16bit
    spec = dk.first_rule_spec(fp8_key(), H200_BUDGET)
    assert dk.ctas_per_sm(spec.smem_bytes(), 128, 194, 233472) == 2


def test_every_fp8_tile_is_valid_and_falls_back_by_budget():
    """Each tile of DEFAULT_DECODE_TILES_FP8 is a valid spec on both arches; under a budget that refuses the
    first tile the rule takes the next one that fits."""
    for d, tiles in dk.DEFAULT_DECODE_TILES_FP8.items():
        for bn, w, st, load in tiles:
            for arch in ("sm_80", "sm_90a"):
                fp8_spec(arch=arch, head_dim=d, block_n=bn, warps=w, stages=st, kv_load=load).validate()
    first, second = (fp8_spec(block_n=bn, warps=w, stages=st, kv_load=load).validate()
                     for bn, w, st, load in dk.DEFAULT_DECODE_TILES_FP8[128][:2])
    assert dk.first_rule_spec(fp8_key(), first.smem_bytes() - 1) == second


def test_fp8_source_declares_byte_rows():
    """The rendered FP8 kernel pastes decode_fp8.cuh, types k and v as kv_t = bytes and instantiates the
    body with FP8 on (before the dtype's flag); a 16-bit kernel's kv_t is elem_t and its FP8 flag off."""
    from flashgen.codegen import render

    src = render(fp8_spec().validate())
    assert "// ---- decode/decode_fp8.cuh ----" in src
    assert "typedef kv_elem<true>::type kv_t;" in src
    assert "  const kv_t* k;\n  const kv_t* v;" in src
    assert re.search(r"decode_split_body<128, 128, 4, 2, true,\s+true, 2, decode_variant<false, false, false, false>>",
                     src)
    plain = render(fp8_spec(fp8=False).validate())
    assert "typedef kv_elem<false>::type kv_t;" in plain
    assert re.search(r"decode_split_body<128, 128, 4, 2, false,\s+true, 2, decode_variant", plain)
    names = [n for n, _, _ in dk.DECODE_PARAMS]
    assert {"kd", "vd", "kd_sb", "kd_sh", "vd_sb", "vd_sh"} <= set(names)


def test_cli_takes_fp8_for_decode_and_the_forward(capsys):
    """``flashgen emit --kind decode_split --fp8`` prints the FP8 kernel the rule picks, and the forward's
    on sm_90a; --fp8 where no kernel serves it is a one-line error."""
    code, out, _ = run_main(capsys, "emit", "--kind", "decode_split", "--fp8", "--d", "96", "--arch", "sm_80")
    assert code == 0 and "// spec: decode_split_d128_m16_n128_w4_s2_ld2_fp8_causal_bf16_sm80" in out
    bm, bn, st, tokens = fwd_sm90.FP8_TILES[128][0]  # the FP8 rule's first tile

    def first(causal):
        return fwd_sm90.variant(128, causal, tokens, fp8=True, block_m=bm, block_n=bn, stages=st).name

    code, out, _ = run_main(capsys, "emit", "--fp8", "--d", "128", "--causal", "--arch", "sm_90a")
    assert code == 0 and f"// spec: {first(True)}\n" in out
    # a GPU whose table holds bf16 tiles FP8 refuses (the H200's d = 128): the FP8 rule's tile
    code, out, _ = run_main(capsys, "emit", "--kind", "fwd_sm90", "--fp8", "--d", "128", "--gpu", "h200")
    assert code == 0 and f"// spec: {first(False)}\n" in out
    for argv, text in ((("--kind", "fwd_v2", "--fp8", "--d", "64"), "does not serve fp8"),
                       (("--kind", "bwd_dkdv", "--fp8", "--d", "64"), "--fp8 is the forward's")):
        code, _, err = run_main(capsys, "emit", *argv)
        assert code == 2 and text in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- the conversions (decode_fp8.cuh)


def _as_16bit(bits: int, dtype) -> float:
    return torch.tensor([bits], dtype=torch.int32).to(torch.uint16).view(dtype).float().item()


def _e4m3_value(byte: int) -> float:
    return torch.tensor([byte], dtype=torch.uint8).view(FP8).float().item()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_widening_is_exact_for_every_e4m3_value(dtype):
    """e4m3x4_widen's bit pattern, read as the 16-bit type and multiplied by its power of two, is the e4m3
    value exactly for all 254 finite bytes (signed zeros and the subnormals included); without the
    multiply it is a value of the type (the factor is what puts it back)."""
    torch_dtype = BF16 if dtype == "bf16" else F16
    for byte in range(256):
        if byte & 0x7F == 0x7F:  # NaN
            continue
        want = _e4m3_value(byte)
        got = _as_16bit(dk.e4m3_widen_bits(byte, dtype), torch_dtype) * dk.widen_factor(dtype)
        assert struct.pack("<f", got) == struct.pack("<f", want), (byte, got, want)


def test_quantization_matches_torch():
    """e4m3_from_float is torch's x.clamp(-448, 448).to(float8_e4m3fn) bit for bit: every e4m3 value, the
    midpoints between neighbours (ties to even) and values just beside them, the subnormal range, values
    past 448 and infinities (saturated), and fresh random values over the whole range."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[torch.isfinite(values)].unique().sort().values
    mids = (values[1:] + values[:-1]) / 2
    xs = torch.cat([values, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20),
                    torch.tensor([0.0, -0.0, 448.0, 449.0, 464.0, 465.0, -1e30, 1e30, float("inf"), float("-inf"),
                                  2 ** -6, 2 ** -6 - 2 ** -13, 2 ** -10, 3 * 2 ** -11, 2 ** -30]),
                    (torch.rand(20000) - 0.5) * 1000, torch.randn(20000) * 0.01, torch.randn(5000) * 2 ** -8])
    want = xs.clamp(-448, 448).to(FP8).view(torch.uint8).tolist()
    got = [dk.e4m3_from_float(x) for x in xs.tolist()]
    bad = [(x, g, w) for x, g, w in zip(xs.tolist(), got, want) if g != w]
    assert not bad, bad[:5]
    assert dk.e4m3_from_float(float("nan")) & 0x7F == 0x7F


# ---------------------------------------------------------------- the fragment layout (decode_split.cuh, FP8)
# The PTX ISA's fragments, per lane (g = lane / 4, t = lane % 4): m16n8k16's A registers hold (row, k)
# pairs (g, 2t..), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..), B's two registers (k, n) = (2t.., g),
# (2t+8.., g), the accumulators (g, 2t..), (g+8, 2t..). ldmatrix.x4: lane l gives the row address of
# row l % 8 of matrix l / 8 (8 rows of 16 bytes); lane (g, t) receives bytes 4t..4t+3 of row g of each
# matrix, or with .trans the 16-bit elements (2t, g) and (2t+1, g): bytes 2g, 2g+1 of rows 2t, 2t+1.


def _ldmatrix_x4(rows_of_lane, trans):
    """Per lane, four registers (lists of 4 bytes) from ``rows_of_lane[l]`` (the 16 bytes lane l points at)."""
    mats = [[rows_of_lane[8 * m + r] for r in range(8)] for m in range(4)]
    out = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        if trans:
            out.append([[m[2 * t][2 * g], m[2 * t][2 * g + 1], m[2 * t + 1][2 * g], m[2 * t + 1][2 * g + 1]]
                        for m in mats])
        else:
            out.append([m[g][4 * t: 4 * t + 4] for m in mats])
    return out


_WIDENED: dict = {}


def _widen(word, dtype):
    """e4m3x4_widen: (even pair, odd pair) of values from a register's four bytes."""
    if dtype not in _WIDENED:
        torch_dtype = BF16 if dtype == "bf16" else F16
        _WIDENED[dtype] = [_as_16bit(dk.e4m3_widen_bits(b, dtype), torch_dtype) * dk.widen_factor(dtype)
                           for b in range(256)]
    value = _WIDENED[dtype]
    return (value[word[0]], value[word[2]]), (value[word[1]], value[word[3]])


def _mma(acc, a, b0, b1):
    """acc (per lane 4 floats) += A B for per-lane fragments: ``a`` 4 pairs, ``b0``/``b1`` one pair each."""
    A, B = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for (row, col), pair in zip(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)), a[lane]):
            A[row, col], A[row, col + 1] = pair
        B[2 * t, g], B[2 * t + 1, g] = b0[lane]
        B[2 * t + 8, g], B[2 * t + 9, g] = b1[lane]
    out = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        acc[lane] = [acc[lane][0] + out[g, 2 * t], acc[lane][1] + out[g, 2 * t + 1],
                     acc[lane][2] + out[g + 8, 2 * t], acc[lane][3] + out[g + 8, 2 * t + 1]]


def _random_e4m3(rows, cols):
    """Random e4m3 bytes (no NaN), every exponent represented."""
    b = torch.randint(0, 256, (rows, cols), dtype=torch.uint8)
    return torch.where(b & 0x7F == 0x7F, b - 1, b)


def _emulated_qk(q, k8, dtype):
    """S (16 x KW) as decode_split's FP8 main loop computes it: per pair of k-steps kp and 16 keys nj2, one
    ldmatrix.x4 at row k_row = 8 (lane >> 4) + lane % 8, chunk 2 kp + (lane >> 3) % 2; register m widened
    and multiplied with Q's q_frag8 fragment of k-step 2 kp + m % 2 into n8 tile 2 nj2 + m / 2."""
    kw, d = k8.shape
    acc = [[[0.0] * 4 for _ in range(32)] for _ in range(kw // 8)]
    for kp in range(d // 32):
        qa = [[None] * 32 for _ in range(2)]
        for half in range(2):
            kk = 2 * kp + half
            for lane in range(32):
                g, t = lane // 4, lane % 4
                x = q[g, 16 * kk + 4 * t: 16 * kk + 4 * t + 4].tolist()
                y = q[g + 8, 16 * kk + 4 * t: 16 * kk + 4 * t + 4].tolist()
                qa[half][lane] = [(x[0], x[2]), (y[0], y[2]), (x[1], x[3]), (y[1], y[3])]  # q_frag8's permutes
        for nj2 in range(kw // 16):
            rows = []
            for lane in range(32):
                row = nj2 * 16 + ((lane >> 4) << 3) + (lane & 7)
                chunk = 2 * kp + ((lane >> 3) & 1)
                rows.append(k8[row, 16 * chunk: 16 * chunk + 16].tolist())
            regs = _ldmatrix_x4(rows, trans=False)
            for m in range(4):
                widened = [_widen(regs[lane][m], dtype) for lane in range(32)]
                _mma(acc[2 * nj2 + (m >> 1)], qa[m & 1], [w[0] for w in widened], [w[1] for w in widened])
    s = torch.zeros(16, kw, dtype=torch.float64)
    for nj, tile in enumerate(acc):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            s[g, 8 * nj + 2 * t], s[g, 8 * nj + 2 * t + 1], s[g + 8, 8 * nj + 2 * t], s[g + 8, 8 * nj + 2 * t + 1] = \
                tile[lane]
    return s


def _emulated_pv(p, v8, dtype):
    """O (16 x D) as decode_split's FP8 main loop and epilogue compute it: per k-step kk and pair of chunks
    dq one transposing ldmatrix.x4 at row kk 16 + lane % 16, chunk 2 dq + lane / 16; registers 2c and
    2c + 1 widened into the even- and odd-column tiles acc_o[4 dq + 2c] and acc_o[4 dq + 2c + 1]; the
    epilogue writes lane (g, t)'s chunk-c values at columns 16c + 4t .. + 3 as (even[e], odd[e], even[e+1],
    odd[e+1])."""
    kw, d = v8.shape
    acc = [[[0.0] * 4 for _ in range(32)] for _ in range(d // 8)]
    for kk in range(kw // 16):
        pa = []
        for lane in range(32):  # p_frag: P's A fragment of keys 16 kk .. + 15 (the 16-bit kernel's)
            g, t = lane // 4, lane % 4
            c = 16 * kk + 2 * t
            pa.append([(p[g, c].item(), p[g, c + 1].item()), (p[g + 8, c].item(), p[g + 8, c + 1].item()),
                       (p[g, c + 8].item(), p[g, c + 9].item()), (p[g + 8, c + 8].item(), p[g + 8, c + 9].item())])
        for dq in range(d // 32):
            rows = []
            for lane in range(32):
                chunk = 2 * dq + (lane >> 4)
                rows.append(v8[kk * 16 + (lane & 15), 16 * chunk: 16 * chunk + 16].tolist())
            regs = _ldmatrix_x4(rows, trans=True)
            for c in range(2):
                lo = [_widen(regs[lane][2 * c], dtype) for lane in range(32)]
                hi = [_widen(regs[lane][2 * c + 1], dtype) for lane in range(32)]
                _mma(acc[4 * dq + 2 * c], pa, [w[0] for w in lo], [w[0] for w in hi])
                _mma(acc[4 * dq + 2 * c + 1], pa, [w[1] for w in lo], [w[1] for w in hi])
    o = torch.zeros(16, d, dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for h in range(2):
            for c in range(d // 16):
                even, odd = acc[2 * c][lane], acc[2 * c + 1][lane]
                o[g + 8 * h, 16 * c + 4 * t: 16 * c + 4 * t + 4] = torch.tensor(
                    [even[2 * h], odd[2 * h], even[2 * h + 1], odd[2 * h + 1]], dtype=torch.float64)
    return o


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d,kw", [(64, 16), (128, 32)])
def test_fragment_layout_computes_qk_and_pv(dtype, d, kw):
    """The FP8 main loop's fragment arithmetic, emulated lane by lane with fresh random e4m3 bytes, gives
    S = Q K^T and O = P V exactly (in float64, on values exact in the 16-bit type)."""
    torch_dtype = BF16 if dtype == "bf16" else F16
    q = torch.randn(16, d).to(torch_dtype).double()
    k8, v8 = _random_e4m3(kw, d), _random_e4m3(kw, d)
    p = torch.rand(16, kw).to(torch_dtype).double()
    k = k8.view(FP8).double()
    v = v8.view(FP8).double()
    assert torch.allclose(_emulated_qk(q, k8, dtype), q @ k.T, rtol=1e-12, atol=0)
    assert torch.allclose(_emulated_pv(p, v8, dtype), p @ v, rtol=1e-12, atol=0)


# ---------------------------------------------------------------- flashgen.decode's checks (no GPU)


B, NQ, HQ, HK, D, L = 3, 2, 8, 2, 128, 100


def good(**over):
    """Valid FP8-cache inputs (fake CUDA tensors): per-(batch, head) K descale, one V factor."""
    args = dict(q=fake(B, NQ, HQ, D), k_cache=fake(B, L, HK, D, dtype=FP8), v_cache=fake(B, L, HK, D, dtype=FP8),
                k_descale=fake(B, HK, dtype=torch.float32), v_descale=fake(1, dtype=torch.float32))
    args.update(over)
    return args


NEW = dict(cache_seqlens=None, k_new=None, v_new=None)


@pytest.mark.parametrize("over,exc,message", [
    (dict(k_descale=None), ValueError, "an FP8 cache needs k_descale and v_descale.*k_descale is missing"),
    (dict(v_descale=None), ValueError, "v_descale is missing"),
    (dict(k_descale=[1.0]), TypeError, "k_descale must be a torch.Tensor"),
    (dict(k_descale=fake(B, HK, dtype=BF16)), TypeError, "k_descale must be float32"),
    (dict(v_descale=fake(B, HK, dtype=torch.float64)), TypeError, "v_descale must be float32"),
    (dict(k_descale=fake(B, HQ, dtype=torch.float32)), ValueError,
     r"k_descale must have shape \(\) or \(1,\) or \(3, 2\)"),
    (dict(v_descale=fake(HK, dtype=torch.float32)), ValueError, r"v_descale must have shape .*got \(2,\)"),
    (dict(k_descale=fake(B, HK, 1, dtype=torch.float32)), ValueError, "k_descale must have shape"),
    (dict(k_descale=torch.ones(B, HK)), ValueError, "k_descale must be on the inputs' device"),
    (dict(v_cache=fake(B, L, HK, D)), TypeError, "v_cache must be float8_e4m3fn like k_cache"),
    (dict(k_cache=fake(B, L, HK, D)), TypeError, "k_cache must be float8_e4m3fn like v_cache"),
    (dict(k_cache=fake(B, L, HK, D, dtype=torch.float8_e5m2), v_cache=fake(B, L, HK, D, dtype=torch.float8_e5m2)),
     TypeError, "k_cache must be float16 or bfloat16, got torch.float8_e5m2 .or both caches float8_e4m3fn"),
    (dict(q=fake(B, NQ, HQ, D, dtype=FP8)), TypeError, "q must be float16 or bfloat16, got torch.float8_e4m3fn .an FP8 "
     "cache takes fp16/bf16 queries"),
    (dict(cache_seqlens=fake(B, dtype=torch.int32), k_new=fake(B, NQ, HK, D, dtype=FP8),
          v_new=fake(B, NQ, HK, D, dtype=FP8)), TypeError, "k_new must be float16 or bfloat16.*new tokens come in q's"),
    (dict(cache_seqlens=fake(B, dtype=torch.int32), k_new=fake(B, NQ, HK, D, dtype=F16),
          v_new=fake(B, NQ, HK, D, dtype=F16)), TypeError, "k_new must have q's dtype"),
    (dict(q=fake(B, NQ, HQ, 72), k_cache=fake(B, L, HK, 72, dtype=FP8), v_cache=fake(B, L, HK, 72, dtype=FP8)),
     ValueError, "k_cache must have strides that are multiples of 16 elements"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_bad_fp8_arguments_raise_before_launch(no_launch, over, exc, message):
    """Each bad FP8 argument is refused with a message naming it, before dispatch or a launch."""
    with pytest.raises(exc, match=message):
        call(**good(**over))


@pytest.mark.parametrize("name", ["k_descale", "v_descale"])
def test_descales_without_an_fp8_cache_are_refused(no_launch, name):
    """A descale given with a 16-bit cache is a ValueError naming it (it would be ignored otherwise)."""
    args = dict(q=fake(B, NQ, HQ, D), k_cache=fake(B, L, HK, D), v_cache=fake(B, L, HK, D),
                **{name: fake(1, dtype=torch.float32)})
    with pytest.raises(ValueError, match=f"{name} is given but the cache is not FP8"):
        call(**args)


@pytest.mark.parametrize("over", [
    {}, dict(k_descale=fake(dtype=torch.float32), v_descale=fake(B, HK, dtype=torch.float32)),
    dict(q=fake(B, NQ, HQ, D, dtype=F16)),
    dict(cache_seqlens=fake(B, dtype=torch.int32), k_new=fake(B, NQ, HK, D), v_new=fake(B, NQ, HK, D)),
    dict(q=fake(B, NQ, HQ, 32), k_cache=fake(B, L, HK, 32, dtype=FP8), v_cache=fake(B, L, HK, 32, dtype=FP8)),
    dict(k_cache=fake(40, 64, HK, D, dtype=FP8), v_cache=fake(40, 64, HK, D, dtype=FP8),
         block_table=fake(B, 2, dtype=torch.int32)),
    dict(window=(50, 0), softcap=30.0, alibi_slopes=fake(HQ, dtype=torch.float32), sinks=fake(HQ, dtype=torch.float32)),
], ids=["per_head_k", "one_k_factor", "fp16_q", "append", "d32", "paged", "variants"])
def test_valid_fp8_calls_pass_the_checks(no_launch, monkeypatch, over):
    """Valid FP8-cache calls (descale shapes, fp16 queries, appends, d = 32, a paged cache, every variant)
    get through validation to dispatch (which the fixture stops; the device is an H200's facts)."""
    from types import SimpleNamespace

    from flashgen.api import decoding

    h200 = SimpleNamespace(arch="sm_90a", gpu="h200", smem_budget=H200_BUDGET, sms=132, smem_per_sm=233472)
    monkeypatch.setattr(decoding.Device, "of", classmethod(lambda cls, index: h200))
    with pytest.raises(AssertionError, match="validation let the call through"):
        call(**good(**over))


def test_meta_fp8_call_checks_and_shapes():
    """On meta tensors an FP8-cache call is checked like any other and returns q-shaped output in q's dtype
    and the LSE; a missing descale is refused there too."""
    meta = dict(device="meta")
    q = torch.empty(B, NQ, HQ, D, dtype=BF16, **meta)
    kc = torch.empty(B, L, HK, D, dtype=FP8, **meta)
    kd = torch.empty(B, HK, dtype=torch.float32, **meta)
    out, lse = flashgen.decode(q, kc, kc.clone(), k_descale=kd, v_descale=kd, return_lse=True)
    assert out.shape == q.shape and out.dtype == BF16 and lse.shape == (B, HQ, NQ)
    with pytest.raises(ValueError, match="v_descale is missing"):
        flashgen.decode(q, kc, kc.clone(), k_descale=kd)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_descale_values_must_be_finite_and_positive(bad):
    """The value check flashgen.decode runs with check_values=True (api.fp8.check_descale_values, one
    sync for both descales): a zero, negative or non-finite factor is a ValueError naming its argument."""
    good_one, bad_one = torch.ones(B, HK), torch.ones(B, HK)
    bad_one[1, 0] = bad
    check_descale_values((("k_descale", good_one), ("v_descale", good_one)))
    with pytest.raises(ValueError, match="v_descale must hold finite, positive"):
        check_descale_values((("k_descale", good_one), ("v_descale", bad_one)))
    with pytest.raises(ValueError, match="k_descale must hold finite, positive"):
        check_descale_values((("k_descale", torch.tensor(bad)), ("v_descale", good_one)))


def test_fp8_keys_and_variants():
    """An FP8 call's variant carries fp8 (its problem key's token), whatever else it sets."""
    from flashgen.api import decoding

    args = good()
    *_, variant = decoding._checked(args["q"], args["k_cache"], args["v_cache"], None, None, None, None, None, None,
                                    False, True, (10, 0), 5.0, None, None, args["k_descale"], args["v_descale"])
    assert variant.fp8 and variant.key() == "win_cap_fp8"
    *_, plain = decoding._checked(args["q"], fake(B, L, HK, D), fake(B, L, HK, D), None, None, None, None, None,
                                  None, False, True, None, 0.0, None, None)
    assert not plain.fp8 and plain.key() == ""


def test_random_quantization_helper_agrees_with_the_mirror():
    """quantize_fp8's cast of x / descale is the kernel's append quantization (e4m3_from_float), so an
    appended token's cache bytes equal the test tier's expectation."""
    from flashgen.api.fp8 import quantize_fp8

    x = torch.randn(2, 3, 4, 32) * 3
    x8, descale = quantize_fp8(x, per="head", layout="bhsd")
    scaled = (x / descale[:, :, None, None]).reshape(-1).tolist()
    assert [dk.e4m3_from_float(v) for v in scaled] == x8.view(torch.uint8).reshape(-1).tolist()
    rnd = random.Random()
    vals = [rnd.uniform(-600, 600) for _ in range(1000)]
    assert [dk.e4m3_from_float(v) for v in vals] == \
        torch.tensor(vals).clamp(-448, 448).to(FP8).view(torch.uint8).tolist()


# ---------------------------------------------------------------- the benchmark's fp8 section (no GPU)


def test_bench_fp8_metrics_and_bar():
    """The fp8 section's cells: tokens/s = batch / time, TB/s on the bytes each cache reads (half for FP8);
    its notes hold every case of 256 MB of 16-bit K+V or more against the bar (1.8x tokens/s, 4.0 TB/s of
    FP8 bytes), and leave the smaller ones out."""
    from flashgen.bench import decode as bench
    from flashgen.bench.timing import add_ratios

    nbytes = bench.kv_bytes(8, 8, 131072, 128)  # 4.3 GB of bf16 K+V
    cells = bench.fp8_metrics({"bf16": {"us": 1000.0}, "fp8": {"us": 520.0}, "fp8_64/4/3/2": {"error": "x"}},
                              "bf16", nbytes, 8)
    assert cells["bf16"]["tokens_per_s"] == pytest.approx(8000.0)
    assert cells["bf16"]["tbps"] == pytest.approx(nbytes / 1000.0 / 1e6)
    assert cells["fp8"]["tbps"] == pytest.approx(nbytes / 2 / 520.0 / 1e6)
    assert "tbps" not in cells["fp8_64/4/3/2"]
    row = {"batch": 8, "heads_kv": 8, "L": 131072, "kv_bytes": nbytes, "results": cells}
    add_ratios(row, "tokens_per_s", [("fp8/bf16", "fp8", "bf16")])
    assert row["ratios"]["fp8/bf16"] == pytest.approx(1000 / 520)
    small = {"batch": 1, "heads_kv": 8, "L": 4096, "kv_bytes": bench.kv_bytes(1, 8, 4096, 128), "results": cells,
             "ratios": row["ratios"]}
    notes = bench.fp8_notes([row, small], "bf16")
    assert len(notes) == 1 and notes[0].startswith("b8/hk8/L131072 (4096 MB bf16): fp8 1.923x bf16 tokens/s, 4.13 TB/s")
    assert notes[0].endswith("meets")
    row["results"]["fp8"] = {"us": 560.0, "tbps": nbytes / 2 / 560.0 / 1e6}
    row["ratios"]["fp8/bf16"] = 1000 / 560
    assert bench.fp8_notes([row], "bf16")[0].endswith("BELOW")
    assert all(bench.kv_bytes(b, hk, L, 128) >= bench.FP8_BAR[2] for b, _, hk, L in bench.FP8_CASES[1:])
