"""GPU tier: flashgen.decode over an FP8 (float8 e4m3) KV cache against an fp32 reference on the dequantized cache.

The reference is ``flashgen.reference.reference`` on the cache's values as the kernel must see them:
k8.float() * k_descale (and v), appended tokens as they are quantized into the cache. Rule: max error
against the fp32 reference <= 2x the max error of the same reference computed in q's dtype, + a
rounding-sized atol (``flashgen.reference.allowance``); the LSE within 1e-3 relative or that rule.
Fresh random inputs each run (no seeds); descales per (batch, KV head), per tensor and as one scalar,
chosen from each cache's largest magnitude times a random factor around 1 (some values saturate at
448); ragged lengths (1, 239, 1023, 4097, ...; one of them 0 without appends), contiguous and paged
caches (random page order), GQA, one and several new tokens, with and without k_new/v_new. Cache rows
past each length and unused pages hold e4m3 NaN bytes, outputs and workspaces come from freed
NaN-filled memory, so a read past the keys or an unwritten element shows. After an append the cache
bytes must be exactly the quantized new rows (``(x / descale).clamp(-448, 448).to(float8_e4m3fn)``,
computed on the host) and every other byte unchanged. Exactness probes check the widening of all 254
finite e4m3 values and the column order of K and V through the whole kernel.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)"),
]

from gpu_util import DTYPES, capture, check_decode_lse, check_decode_output, make_case, poison  # noqa: E402

from flashgen.families.decode import DEFAULT_DECODE_TILES_FP8  # noqa: E402
from flashgen.reference import allowance, reference  # noqa: E402

FP8 = torch.float8_e4m3fn
NAN8 = 0x7F  # an e4m3fn NaN byte


def quantize(x, descale):
    """``x`` (fp16/bf16/fp32, any shape) as e4m3 of x / descale, saturating: the kernel's append, on the
    host (IEEE division and rounding, so the expected bytes do not depend on a GPU kernel)."""
    return (x.float().cpu() / descale.float().cpu()).clamp(-448, 448).to(FP8).to(x.device)


def descales(amax, per, scale):
    """Descale factors from a (batch, heads_kv) largest magnitude: "head" (batch, heads_kv), "tensor" (1,),
    "scalar" () -- each amax / 448 times ``scale`` (a factor below 1 saturates the largest values)."""
    if per == "head":
        d = amax / 448 * scale
    else:
        d = (amax.max() / 448 * scale).reshape(() if per == "scalar" else (1,))
    return d.float().clamp_min(2.0 ** -20).contiguous()


def per_row(descale, b, hk):
    """A descale broadcast to (batch, 1, heads_kv, 1) over a (batch, len, heads_kv, d) cache."""
    return descale.reshape(-1).expand(b * hk).reshape(b, 1, hk, 1) if descale.numel() == 1 else \
        descale.reshape(b, 1, hk, 1)


def fp8_case(b, nq, lens, d, hq, hk, page, with_new, dtype, per="head", v_per=None, new_gain=1.5):
    """make_case's inputs with the cache in FP8: k8/v8 (contiguous, or pages in the same random order as
    make_case's block table), their descales, the dequantized flat caches (NaN past each length) and
    k_new/v_new scaled by ``new_gain`` (so some appended values saturate)."""
    L = max(lens)
    case = make_case(b, nq, L, d, hq, hk, page, with_new, dtype, lens=list(lens))
    if with_new:
        case["k_new"] = (case["k_new"].float() * new_gain).to(dtype)
        case["v_new"] = (case["v_new"].float() * new_gain).to(dtype)
    for name, p in (("k", per), ("v", v_per or per)):
        flat = case[f"{name}_flat"]
        amax = torch.nan_to_num(flat.float(), nan=0.0).abs().amax(dim=(1, 3)).clamp_min(1e-3)  # (b, hk)
        ds = descales(amax, p, 0.8 + 0.5 * torch.rand((), device=flat.device))
        flat8 = (flat.float() / per_row(ds, b, hk)).clamp(-448, 448).to(FP8)  # NaN stays NaN
        case[f"{name}_descale"] = ds
        case[f"{name}8_flat"] = flat8
        case[f"{name}_cache"] = pages_of(case, flat8) if page else flat8.clone()
    return case


def pages_of(case, flat8):
    """The FP8 pages of ``flat8`` (b, cap, hk, d) through make_case's block table; unused pages NaN bytes."""
    bt, page = case["block_table"], case["page"]
    pages = torch.full((case["k_cache"].shape[0], page, *flat8.shape[2:]), NAN8, dtype=torch.uint8,
                       device=flat8.device).view(FP8)
    n_new = case["q"].shape[1] if case["k_new"] is not None else 0
    for i, n in enumerate(case["lens"]):
        used = -(-(n + n_new) // page)
        pages[bt[i, :used].long()] = flat8[i, :used * page].view(used, page, *flat8.shape[2:])
    return pages


def flat_bytes(case, name):
    """The FP8 cache as (b, cap, hk, d) bytes, gathered through the block table for a paged cache."""
    cache = case[name]
    if case["page"] is None:
        return cache.view(torch.uint8).clone()
    bt, page = case["block_table"], case["page"]
    out = torch.full(case["k8_flat"].shape, NAN8, dtype=torch.uint8, device=cache.device)
    n_new = case["q"].shape[1] if case["k_new"] is not None else 0
    for i, n in enumerate(case["lens"]):
        used = -(-(n + n_new) // page)
        out[i, :used * page] = cache[bt[i, :used].long()].view(torch.uint8).reshape(used * page, *cache.shape[2:])
    return out


def expected_new(case, name):
    """k_new (or v_new) quantized as the kernel appends it: (b, nq, hk, d) e4m3."""
    b, _, hk, _ = case[f"{name}_new"].shape
    return quantize(case[f"{name}_new"], per_row(case[f"{name}_descale"], b, hk))


def dequantized(case, name, i, n):
    """Sequence i's K (or V) as the kernel sees it, fp32 (n + appended, hk, d)."""
    b, _, hk, _ = case[f"{name}8_flat"].shape
    ds = per_row(case[f"{name}_descale"], b, hk)[i]
    rows = case[f"{name}8_flat"][i, :n].float() * ds
    if case[f"{name}_new"] is not None:
        rows = torch.cat([rows, expected_new(case, name)[i].float() * ds])
    return rows


def fp8_reference(case, scale, kw, dtype=torch.float32):
    """(out (b, nq, hq, d), lse (b, hq, nq)) per sequence through flashgen.reference on the dequantized
    cache (bottom-right offsets over the sequence's own keys), computed in ``dtype``."""
    q = case["q"]
    outs, lses = [], []
    for i, n in enumerate(case["lens"]):
        k, v = dequantized(case, "k", i, n), dequantized(case, "v", i, n)
        slopes = kw.get("alibi_slopes")
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[i:i + 1]
        out, lse = reference(q[i:i + 1].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2), True,
                             scale, dtype, window=kw.get("window"), softcap=kw.get("softcap", 0.0),
                             alibi_slopes=slopes, sinks=kw.get("sinks"))
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


def check_case(case, num_splits_list=(None, 1), spec=None, **kw):
    """flashgen.decode on ``case`` at each split count (the appends happen once, on the first call's
    cache: later calls see the appended rows again from k_new and must give the same attention), each
    result against the rule; then the cache bytes: appended rows exactly quantized, the rest untouched."""
    import flashgen

    q = case["q"]
    b, nq, hq, d = q.shape
    dtype = q.dtype
    scale = 1.0 / math.sqrt(d)
    ref, ref_lse = fp8_reference(case, scale, kw)
    low, low_lse = fp8_reference(case, scale, kw, dtype)
    tol = allowance(low, ref, dtype)
    before_k, before_v = flat_bytes(case, "k_cache"), flat_bytes(case, "v_cache")
    for ns in num_splits_list:
        poison(b * nq * hq * (d + 1) * 4 * 64)
        out, lse = flashgen.decode(q, case["k_cache"], case["v_cache"], case["cache_seqlens"], case["block_table"],
                                   case["k_new"], case["v_new"], num_splits=ns, return_lse=True, spec=spec,
                                   k_descale=case["k_descale"], v_descale=case["v_descale"], **kw)
        torch.cuda.synchronize()
        masked = check_decode_output(out, lse, q, ref, ref_lse, tol, ns)
        if kw.get("sinks") is not None:
            assert not masked.any()
        check_decode_lse(lse, ref_lse, low_lse, masked, ns)
    after_k, after_v = flat_bytes(case, "k_cache"), flat_bytes(case, "v_cache")
    if case["k_new"] is not None:
        new_k, new_v = expected_new(case, "k").view(torch.uint8), expected_new(case, "v").view(torch.uint8)
        for i, n in enumerate(case["lens"]):
            before_k[i, n:n + nq] = new_k[i]
            before_v[i, n:n + nq] = new_v[i]
    assert torch.equal(after_k, before_k), "K cache bytes differ (appended rows: the quantized k_new)"
    assert torch.equal(after_v, before_v), "V cache bytes differ (appended rows: the quantized v_new)"


# (batch, seqlen_q, lengths, d, heads_q, heads_kv, page size or None, append, dtype, descale of K, of V)
CASES = [
    (3, 1, (1, 239, 1023), 128, 32, 8, None, False, "bf16", "head", "head"),
    (3, 1, (4097, 17, 0), 128, 8, 1, 64, False, "bf16", "tensor", "tensor"),
    (4, 2, (1023, 1, 239, 4097), 128, 16, 2, None, True, "bf16", "head", "scalar"),
    (2, 3, (239, 1023), 64, 8, 8, 16, True, "fp16", "head", "head"),
    (2, 1, (4097, 2000), 256, 8, 4, None, False, "bf16", "tensor", "head"),
    (2, 16, (1023, 300), 128, 8, 1, 256, True, "bf16", "head", "head"),      # 128 packed rows: 8 m-blocks
    (3, 1, (20000, 4097, 1), 128, 32, 8, 128, False, "bf16", "head", "head"),
    (2, 2, (500, 239), 96, 4, 2, None, True, "bf16", "head", "tensor"),       # d = 96 in the 128 tile
    (2, 1, (300, 1), 32, 8, 8, 32, False, "fp16", "scalar", "scalar"),        # d = 32 in the 64 tile
    (2, 64, (800, 128), 128, 4, 1, 64, True, "bf16", "head", "head"),         # whole blocks from k_new
    (2, 1, (131072, 70001), 128, 8, 1, None, False, "bf16", "head", "head"),
    (3, 3, (4097, 1023, 1), 128, 32, 8, 16, True, "fp16", "tensor", "head"),
]


def case_id(c) -> str:
    b, nq, lens, d, hq, hk, page, with_new, dtype, k_per, v_per = c
    return (f"b{b}_q{nq}_L{max(lens)}_d{d}_h{hq}-{hk}_{'p' + str(page) if page else 'contig'}_"
            f"{'new' if with_new else 'nonew'}_{dtype}_{k_per}-{v_per}")


@pytest.mark.parametrize("b,nq,lens,d,hq,hk,page,with_new,dtype,k_per,v_per", CASES, ids=[case_id(c) for c in CASES])
def test_matches_reference(b, nq, lens, d, hq, hk, page, with_new, dtype, k_per, v_per):
    """Default splits and one split both meet the rule on the dequantized cache; LSE -inf exactly for
    rows that see no key; appended rows are the quantized new tokens, byte for byte."""
    case = fp8_case(b, nq, lens, d, hq, hk, page, with_new, DTYPES[dtype], k_per, v_per)
    check_case(case)


def test_many_batches_and_forced_splits():
    """160 (batch, KV head) groups ("full" regime), ragged with appends; forced split counts, including
    splits past the key blocks (empty splits) and the merge of many."""
    lens = [1001] + [max(0, 1001 - 17 * i) for i in range(1, 40)]
    check_case(fp8_case(40, 1, lens, 128, 16, 4, 64, True, torch.bfloat16), num_splits_list=(None, 1, 3))
    check_case(fp8_case(2, 1, (3000, 339), 128, 8, 2, None, False, torch.bfloat16), num_splits_list=(7, 50, 300))


FP8_TILES = [(d, t) for d, tiles in DEFAULT_DECODE_TILES_FP8.items() for t in tiles]


@pytest.mark.parametrize("d,tile", FP8_TILES, ids=[f"d{d}_n{t[0]}_w{t[1]}_s{t[2]}_ld{t[3]}" for d, t in FP8_TILES])
def test_every_fp8_tile(d, tile):
    """Each tile of DEFAULT_DECODE_TILES_FP8, forced: paged (page 16: several pages per block; 256),
    ragged with appends, split and not; a contiguous cache; fp16."""
    from flashgen.api.device import Device
    from flashgen.families.decode import kv_load_for
    from flashgen.spec import KernelSpec

    dev = Device.of(torch.cuda.current_device())
    bn, w, st, kv_load = tile

    def spec(dtype="bf16"):
        return KernelSpec(kind="decode_split", arch=dev.arch, dtype=dtype, head_dim=d, block_m=16, block_n=bn,
                          warps=w, stages=st, kv_load=kv_load_for(dev.arch, kv_load), causal=True,
                          fp8=True).validate()
    if spec().smem_bytes() > dev.smem_budget:
        pytest.skip(f"{spec().name} needs {spec().smem_bytes()} B of shared memory (this device: {dev.smem_budget})")
    check_case(fp8_case(3, 1, (3000, 1023, 0), d, 32, 8, 16, True, torch.bfloat16), (None, 7, 1), spec())
    check_case(fp8_case(2, 3, (5000, 239), d, 8, 2, 256, True, torch.bfloat16, "tensor"), (None, 50), spec())
    check_case(fp8_case(2, 2, (1500, 4097), d, 8, 8, None, True, torch.float16), (None, 1), spec("fp16"))


VARIANTS = [
    dict(window=(300, 0)), dict(softcap=30.0), dict(alibi="batch"), dict(sinks=True),
    dict(window=(300, 0), softcap=30.0, alibi="head", sinks=True),
]


def variant_kwargs(b, hq, window=None, softcap=0.0, alibi=None, sinks=False) -> dict:
    """decode's variant keywords with fresh random tensors."""
    kw = {"window": window, "softcap": softcap}
    if alibi is not None:
        kw["alibi_slopes"] = torch.rand((hq,) if alibi == "head" else (b, hq), device="cuda") * 0.5 + 0.01
    if sinks:
        kw["sinks"] = torch.randn(hq, device="cuda") * 2
    return kw


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: "_".join(o))
@pytest.mark.parametrize("page", [None, 64], ids=["contig", "p64"])
def test_variants_with_an_fp8_cache(options, page):
    """The variants on an FP8 cache (the K descale folded into the scale, or into the softcap's factor):
    a window, softcap, ALiBi (per batch and head), sinks, and all four; GQA, ragged, appends."""
    case = fp8_case(3, 2, (4097, 1023, 1), 128, 16, 4, page, True, torch.bfloat16)
    check_case(case, (None, 1, 5), **variant_kwargs(3, 16, **options))


def test_odd_head_dim_in_padded_rows():
    """d = 72 (a 16-byte chunk half inside d: the copy reads 8 bytes and zero-fills 8) in a cache whose
    rows are padded to 80 bytes (strides multiples of 16), contiguous and with appends."""
    case = fp8_case(2, 2, (1023, 239), 72, 8, 2, None, True, torch.bfloat16)
    for name in ("k", "v"):
        padded = torch.full((*case[f"{name}8_flat"].shape[:3], 80), NAN8, dtype=torch.uint8, device="cuda").view(FP8)
        padded[..., :72] = case[f"{name}8_flat"]
        case[f"{name}_cache"] = padded[..., :72]
    check_case(case, (None, 1, 4))


def test_every_e4m3_value_widens_exactly():
    """One key per sequence: the output is that key's V row times v_descale, and with a one-hot query the
    LSE is the K value at the hot column times the scale and k_descale. V rows hold all 254 finite e4m3
    values (sequences 0 and 1: bytes 0-127 and 128-255, NaN bytes replaced), so every value and column
    of the widened V, and every column of K, is checked exactly (bf16 and fp16 outputs of exact values)."""
    import flashgen

    for dtype in (torch.bfloat16, torch.float16):
        b, hq, hk, d = 2, 128, 8, 128
        byte = torch.arange(256, dtype=torch.int32, device="cuda").reshape(2, 128)
        byte = torch.where(byte % 128 == 127, byte - 1, byte).to(torch.uint8)
        v8 = torch.full((b, 4, hk, d), NAN8, dtype=torch.uint8, device="cuda")
        v8[:, 0] = byte[:, None, :]                   # every KV head: the same 128 values
        k8 = torch.full_like(v8, NAN8)
        k8[:, 0] = byte.flip(1)[:, None, :]           # (another order for K)
        q = torch.zeros(b, 1, hq, d, device="cuda", dtype=dtype)
        q[0, 0, torch.arange(hq), torch.arange(hq)] = 1  # query head h is one-hot at column h
        q[1] = q[0]
        kd = torch.tensor([[0.5], [3.0]], device="cuda").expand(b, hk).contiguous()
        vd = torch.tensor([0.25], device="cuda")
        lens = torch.ones(b, dtype=torch.int32, device="cuda")
        out, lse = flashgen.decode(q, k8.view(FP8), v8.view(FP8), lens, return_lse=True, softmax_scale=0.125,
                                   k_descale=kd, v_descale=vd)
        torch.cuda.synchronize()
        vals_v = v8[:, 0].view(FP8).float() * vd                      # (b, hk, d)
        want = vals_v.repeat_interleave(hq // hk, dim=1).to(dtype)    # (b, hq, d)
        assert torch.equal(out[:, 0], want), "widened V values or their columns differ"
        vals_k = k8[:, 0].view(FP8).float()                           # (b, hk, d)
        hot = vals_k[:, torch.arange(hq) // (hq // hk), torch.arange(hq)]  # (b, hq): K at head h's column h
        want_lse = hot * 0.125 * kd[:, :1]
        # (the LSE adds ln of the row's sum, exp2 of a rounding residue: 1 within a few ulp)
        assert torch.allclose(lse[:, :, 0], want_lse, rtol=1e-6, atol=1e-6), "widened K values or their columns differ"


def test_descale_layouts_share_no_plan():
    """One shapes' calls with a per-(batch, head) descale and with one factor (and strided descales) get
    plans of their own: each result meets the rule (a plan reused across descale layouts would index
    the factors wrongly)."""
    case = fp8_case(3, 1, (2000, 700, 33), 128, 16, 4, None, False, torch.bfloat16, "head", "head")
    check_case(case, (None,))
    for name in ("k", "v"):  # requantized with one factor (NaN past the lengths stays NaN)
        flat = case[f"{name}8_flat"].float() * per_row(case[f"{name}_descale"], 3, 4)
        one = (torch.nan_to_num(flat, nan=0.0).abs().amax() / 448).reshape(1).float()
        case[f"{name}8_flat"] = (flat / one).clamp(-448, 448).to(FP8)
        case[f"{name}_cache"] = case[f"{name}8_flat"].clone()
        case[f"{name}_descale"] = one
    check_case(case, (None,))
    for name in ("k", "v"):  # per (batch, head) again, as a view with a head stride of 2
        flat = case[f"{name}8_flat"].float() * case[f"{name}_descale"]
        wide = torch.full((3, 8), float("nan"), device="cuda")
        wide[:, ::2] = (torch.rand(3, 4, device="cuda") + 0.5) * case[f"{name}_descale"]
        ds = wide[:, ::2]
        case[f"{name}8_flat"] = (flat / per_row(ds.contiguous(), 3, 4)).clamp(-448, 448).to(FP8)
        case[f"{name}_cache"] = case[f"{name}8_flat"].clone()
        case[f"{name}_descale"] = ds
    check_case(case, (None,))


def test_bad_descale_values_raise_before_launch():
    """A zero, negative or non-finite descale is a ValueError naming it before any launch (the cache is not
    written); check_values=False skips the check (the caller's promise)."""
    import flashgen

    case = fp8_case(2, 1, (300, 100), 128, 8, 2, None, True, torch.bfloat16)
    snapshot = flat_bytes(case, "k_cache")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        kd = case["k_descale"].clone()
        kd[1, 0] = bad
        with pytest.raises(ValueError, match="k_descale must hold finite, positive"):
            flashgen.decode(case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"], k_new=case["k_new"],
                            v_new=case["v_new"], k_descale=kd, v_descale=case["v_descale"])
    torch.cuda.synchronize()
    assert torch.equal(flat_bytes(case, "k_cache"), snapshot)
    flashgen.decode(case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"],
                    k_descale=case["k_descale"] * 0, v_descale=case["v_descale"], check_values=False)


def test_cuda_graph_capture_and_replay():
    """Capture an FP8 decode (paged, split, append), change q, k_new, the lengths and both descales in
    place, replay: the output equals an eager call on the same inputs."""
    import flashgen

    case = fp8_case(3, 1, (3000, 1200, 5), 128, 32, 8, 64, True, torch.bfloat16)
    kw = dict(k_descale=case["k_descale"], v_descale=case["v_descale"], return_lse=True)
    args = (case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"], case["block_table"],
            case["k_new"], case["v_new"])
    flashgen.decode(*args, **kw)  # compile, load and plan outside the capture
    torch.cuda.synchronize()
    g, (static_out, static_lse) = capture(lambda: flashgen.decode(*args, **kw))
    for step in range(3):
        case["q"].copy_(torch.randn_like(case["q"]))
        case["k_new"].copy_(torch.randn_like(case["k_new"]))
        case["cache_seqlens"].copy_(torch.tensor([2999 - step, 1100 + step, step], dtype=torch.int32))
        case["k_descale"].mul_(1.25)
        case["v_descale"].mul_(0.8)
        g.replay()
        torch.cuda.synchronize()
        expect, expect_lse = flashgen.decode(*args, **kw)
        torch.cuda.synchronize()
        assert torch.equal(static_out, expect) and torch.equal(static_lse, expect_lse)
        assert torch.isfinite(static_out.float()).all()
