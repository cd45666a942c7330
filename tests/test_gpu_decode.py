"""GPU tier: flashgen.decode (Flash-Decoding) against an fp32 reference on upcast inputs.

Rule: max error against the fp32 reference <= 2x the max error of the same reference computed in the
input dtype, + a rounding-sized atol. Fresh random inputs; cache rows past each sequence's length (and unused pages)
are NaN, so a kernel that reads a key it should not shows; outputs and workspaces come from freed
NaN-filled memory. Each case runs with the default split count and with num_splits=1 (one launch,
direct output); both must pass the rule, and the cache must hold k_new/v_new exactly after an append.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)"),
]

from flashgen.families.decode import DECODE_TILES_BY_REGIME, DEFAULT_DECODE_TILES  # noqa: E402
from flashgen.reference import allowance  # noqa: E402
from gpu_util import (DTYPES, bits, capture, check_decode_output, decode_reference, flat_cache, make_case,  # noqa: E402
                      poison)


def reference(case, scale, dtype=torch.float32):
    """(out (b, nq, hq, d), lse (b, hq, nq)) in fp32, computed in ``dtype``; bottom-right causal."""
    return decode_reference(case, scale, dtype)


def check_case(b, nq, L, d, hq, hk, page, with_new, dtype_name, num_splits_list=(None, 1), spec=None):
    import flashgen

    dtype = DTYPES[dtype_name]
    case = make_case(b, nq, L, d, hq, hk, page, with_new, dtype)
    scale = 1.0 / math.sqrt(d)
    ref, ref_lse = reference(case, scale)
    low, _ = reference(case, scale, dtype)
    tol = allowance(low, ref, dtype)
    before_k, before_v = flat_cache(case, "k_cache").clone(), flat_cache(case, "v_cache").clone()
    results = []
    for ns in num_splits_list:
        poison(b * nq * hq * (d + 1) * 4 * 64)
        out, lse = flashgen.decode(case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"],
                                   case["block_table"], case["k_new"], case["v_new"], num_splits=ns,
                                   return_lse=True, spec=spec)
        torch.cuda.synchronize()
        masked = check_decode_output(out, lse, case["q"], ref, ref_lse, tol, ns)
        if (~masked).any():
            lse_err = (lse[~masked] - ref_lse[~masked]).abs().max().item()
            assert lse_err <= 1e-3 * max(1.0, ref_lse[~masked].abs().max().item()), f"lse err {lse_err:.3e}"
        results.append(out)
    # The cache after the append: new rows exactly k_new/v_new, every other element untouched.
    after_k, after_v = flat_cache(case, "k_cache"), flat_cache(case, "v_cache")
    if with_new:
        for i, n in enumerate(case["lens"]):
            before_k[i, n:n + nq] = case["k_new"][i]
            before_v[i, n:n + nq] = case["v_new"][i]
    assert torch.equal(bits(after_k), bits(before_k)), "K cache content differs"
    assert torch.equal(bits(after_v), bits(before_v)), "V cache content differs"
    return results


# (batch, seqlen_q, cache length, d, heads_q, heads_kv, page size or None, append, dtype): a covering
# subset of the decode grid (every (seqlen_q, length) pair, every d and group, both caches, with and
# without k_new, both dtypes), each run with the default split count and with num_splits=1.
CASES = [
    (3, 1, 128, 128, 8, 1, None, False, "bf16"),
    (3, 1, 339, 64, 4, 4, 16, True, "fp16"),
    (3, 3, 1024, 128, 8, 8, 32, False, "bf16"),
    (2, 64, 800, 256, 4, 1, 64, True, "bf16"),
    (3, 64, 256, 128, 1, 1, None, True, "bf16"),
    (3, 3, 799, 256, 8, 4, None, True, "fp16"),
    (2, 64, 2048, 64, 8, 8, 128, False, "bf16"),
    (3, 16, 20000, 128, 8, 1, 256, True, "bf16"),
    (2, 1, 131072, 128, 8, 1, None, False, "bf16"),
    (2, 16, 131072, 64, 4, 4, 64, True, "bf16"),
    (2, 128, 128, 128, 4, 4, 16, False, "bf16"),
    (3, 1, 4096, 128, 32, 8, 64, True, "bf16"),
    (2, 2, 500, 96, 4, 2, None, True, "bf16"),       # d=96: rounded up to the 128 tile and masked
    (2, 1, 300, 32, 8, 8, 32, False, "fp16"),
    (2, 1, 5000, 256, 1, 1, 256, False, "bf16"),
    (2, 1, 40, 136, 4, 2, None, False, "bf16"),      # d=136 in the 256 tile; the L2 warm-up covers the whole cache
    (40, 1, 1001, 128, 16, 4, 64, True, "bf16"),     # 160 groups: the "full" regime's tile (H200), split in two
]


@pytest.mark.parametrize("b,nq,L,d,hq,hk,page,with_new,dtype", CASES,
                         ids=[f"b{c[0]}_q{c[1]}_L{c[2]}_d{c[3]}_h{c[4]}-{c[5]}_{'p' + str(c[6]) if c[6] else 'contig'}"
                              f"_{'new' if c[7] else 'nonew'}_{c[8]}" for c in CASES])
def test_matches_reference(b, nq, L, d, hq, hk, page, with_new, dtype):
    """Default splits and one split both meet the rule; LSE -inf exactly for rows that see no key."""
    check_case(b, nq, L, d, hq, hk, page, with_new, dtype)


D128_TILES = [*DEFAULT_DECODE_TILES[128], *(t for r in DECODE_TILES_BY_REGIME.get(128, {}).values() for t in r)]


@pytest.mark.parametrize("tile", D128_TILES, ids=[f"n{t[0]}_w{t[1]}_s{t[2]}_ld{t[3]}" for t in D128_TILES])
def test_every_default_tile(tile):
    """Each d=128 tile the default rule can pick (flashgen.families.decode.DEFAULT_DECODE_TILES[128] in
    order of preference, which shared-memory budget falls back to which, and any per-regime
    DECODE_TILES_BY_REGIME tile), forced: paged (page 16: 8 pages per 128-key block; page 64; page 256),
    ragged with appends, split (default, 7, and past the blocks) and not; and a contiguous cache."""
    from flashgen.api.device import Device
    from flashgen.families.decode import kv_load_for
    from flashgen.spec import KernelSpec

    dev = Device.of(torch.cuda.current_device())
    bn, w, st, kv_load = tile
    spec = KernelSpec(kind="decode_split", arch=dev.arch, dtype="bf16", head_dim=128, block_m=16, block_n=bn,
                      warps=w, stages=st, kv_load=kv_load_for(dev.arch, kv_load), causal=True).validate()
    if spec.smem_bytes() > dev.smem_budget:
        pytest.skip(f"{spec.name} needs {spec.smem_bytes()} B of shared memory (this device: {dev.smem_budget})")
    check_case(3, 1, 3000, 128, 32, 8, 16, True, "bf16", num_splits_list=(None, 7, 1), spec=spec)
    check_case(2, 3, 5000, 128, 8, 2, 64, True, "bf16", num_splits_list=(None, 50), spec=spec)
    check_case(3, 1, 2100, 128, 4, 4, 256, False, "bf16", num_splits_list=(None, 3), spec=spec)
    check_case(2, 2, 1500, 128, 8, 8, None, True, "bf16", num_splits_list=(None, 1), spec=spec)


BULK_TILES = [(128, 4, 2), (64, 4, 3), (64, 4, 2)]  # the earlier d=128 default tiles (the bulk loader: opt-in)


@pytest.mark.parametrize("kv_load", [4, 5], ids=["ld4_bulk", "ld5_bulk_evict_first"])
@pytest.mark.parametrize("tile", BULK_TILES, ids=[f"n{t[0]}_w{t[1]}_s{t[2]}" for t in BULK_TILES])
def test_bulk_loader(tile, kv_load):
    """The sm_90a bulk loader (KernelSpec.kv_load 4/5, families.decode.BULK_LOADS: cp.async.bulk rows
    into padded rows, per-warp mbarriers, no CTA barrier in the block loop) on each of these d=128
    tiles: the same cases as test_every_default_tile (paged 16/64/256 and contiguous, ragged, appends,
    split and not), plus many appended tokens (whole blocks of knew rows), d=96 (columns past d zeroed
    once), fp16, and splits past the blocks (empty splits, zero-row blocks)."""
    from flashgen.api.device import Device
    from flashgen.spec import KernelSpec

    dev = Device.of(torch.cuda.current_device())
    if dev.arch != "sm_90a":
        pytest.skip(f"the bulk loader is sm_90a only (this device: {dev.arch})")
    bn, w, st = tile

    def spec(dtype="bf16"):
        return KernelSpec(kind="decode_split", arch="sm_90a", dtype=dtype, head_dim=128, block_m=16, block_n=bn,
                          warps=w, stages=st, kv_load=kv_load, causal=True).validate()

    check_case(3, 1, 3000, 128, 32, 8, 16, True, "bf16", num_splits_list=(None, 7, 1), spec=spec())
    check_case(2, 3, 5000, 128, 8, 2, 64, True, "bf16", num_splits_list=(None, 50), spec=spec())
    check_case(3, 1, 2100, 128, 4, 4, 256, False, "bf16", num_splits_list=(None, 3), spec=spec())
    check_case(2, 2, 1500, 128, 8, 8, None, True, "bf16", num_splits_list=(None, 1), spec=spec())
    check_case(2, 64, 700, 128, 4, 1, None, True, "bf16", num_splits_list=(None, 1, 5), spec=spec())
    check_case(2, 2, 500, 96, 4, 2, 32, True, "bf16", num_splits_list=(None, 1), spec=spec())
    check_case(3, 1, 1000, 128, 8, 2, None, False, "fp16", num_splits_list=(None, 40), spec=spec("fp16"))
    check_case(2, 1, 339, 128, 8, 2, 16, False, "bf16", num_splits_list=(37,), spec=spec())


def test_many_empty_splits():
    """num_splits far past the key blocks: most splits are empty (LSE -inf) and the combine ignores them."""
    check_case(2, 1, 339, 128, 8, 2, None, False, "bf16", num_splits_list=(37, 300))
    check_case(2, 3, 100, 64, 4, 4, 16, True, "bf16", num_splits_list=(64,))


def test_empty_cache_gives_zeros():
    """Every length 0 and no new tokens: output 0 and LSE -inf (no NaN), split or not."""
    import flashgen

    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.zeros(2, dtype=torch.int32, device="cuda")
    for ns in (None, 1, 4):
        out, lse = flashgen.decode(q, k, k, lens, num_splits=ns, return_lse=True)
        assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_value_errors_before_launch():
    """Out-of-range block-table entries and lengths past the cache raise ValueError; nothing is written."""
    import flashgen

    case = make_case(2, 1, 100, 64, 4, 4, 16, True, torch.bfloat16)
    snapshot = case["k_cache"].clone()
    bt = case["block_table"].clone()
    bt[0, 0] = case["k_cache"].shape[0]
    with pytest.raises(ValueError, match="block_table"):
        flashgen.decode(case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"], bt, case["k_new"],
                        case["v_new"])
    lens = case["cache_seqlens"].clone()
    lens[1] = bt.shape[1] * 16
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashgen.decode(case["q"], case["k_cache"], case["v_cache"], lens, case["block_table"], case["k_new"],
                        case["v_new"])
    torch.cuda.synchronize()
    assert torch.equal(bits(case["k_cache"]), bits(snapshot))


def test_cuda_graph_capture_and_replay():
    """Capture decode (paged, split, append), change q, lengths and the block table in place, replay:
    the output equals an eager call on the same inputs."""
    import flashgen

    case = make_case(3, 1, 3000, 128, 32, 8, 64, True, torch.bfloat16, lens=[3000, 1200, 0])
    args = (case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"], case["block_table"],
            case["k_new"], case["v_new"])
    flashgen.decode(*args, return_lse=True)  # compile, load and plan outside the capture
    torch.cuda.synchronize()
    g, (static_out, static_lse) = capture(lambda: flashgen.decode(*args, return_lse=True))
    bt, k_cache, v_cache = case["block_table"], case["k_cache"], case["v_cache"]
    in_use = set(bt[bt >= 0].tolist())
    spares = [p for p in range(k_cache.shape[0]) if p not in in_use]
    for step in range(3):
        case["q"].copy_(torch.randn_like(case["q"]))
        case["k_new"].copy_(torch.randn_like(case["k_new"]))
        case["cache_seqlens"].copy_(torch.tensor([2999 - step, 1100 + step, step], dtype=torch.int32))
        # move sequence 0's page `step` to a spare page and poison the old one: replay must follow the table
        old, new = int(bt[0, step]), spares[step]
        k_cache[new], v_cache[new] = k_cache[old], v_cache[old]
        k_cache[old], v_cache[old] = float("nan"), float("nan")
        bt[0, step] = new
        g.replay()
        torch.cuda.synchronize()
        expect, expect_lse = flashgen.decode(*args, return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(static_out, expect) and torch.equal(static_lse, expect_lse)
        assert torch.isfinite(static_out.float()).all()


def test_strided_query_and_alignment():
    """q as a view with a padded head stride works; a misaligned cache is a ValueError."""
    import flashgen

    case = make_case(2, 2, 300, 64, 4, 2, None, False, torch.bfloat16)
    big = torch.randn(2, 2, 4, 72, device="cuda", dtype=torch.bfloat16)
    q = big[..., :64]
    q.copy_(case["q"])
    out = flashgen.decode(q, case["k_cache"], case["v_cache"], case["cache_seqlens"])
    ref, _ = reference(case, 1 / 8)
    low, _ = reference(case, 1 / 8, torch.bfloat16)
    assert (out.float() - ref).abs().max().item() <= allowance(low, ref, torch.bfloat16)
    base = torch.zeros(2 * 300 * 2 * 64 + 4, device="cuda", dtype=torch.bfloat16)
    mis = base[4:].view(2, 300, 2, 64)
    with pytest.raises(ValueError, match="aligned"):
        flashgen.decode(q, mis, mis, case["cache_seqlens"])


@pytest.fixture
def fresh_decode_plans():
    """No decode plan made under a test's setting (FUSED_COMBINE is read when a call is planned)
    outlives it, and none made before serves it."""
    from flashgen import testing

    testing.plans("decode").clear()
    yield
    testing.plans("decode").clear()


@pytest.mark.parametrize("fused", [True, False], ids=["fused_combine", "combine_kernel"])
def test_both_combine_paths(monkeypatch, fused, fresh_decode_plans):
    """The in-kernel merge (the CTA that draws a group's last ticket) and the decode_combine launch both
    meet the rule; every counter is back at 0 afterwards, so the cached workspace serves the next call."""
    from flashgen.api import decoding

    monkeypatch.setattr(decoding, "FUSED_COMBINE", fused)
    check_case(3, 3, 1024, 128, 8, 2, 32, True, "bf16", num_splits_list=(None, 5, 1))
    check_case(2, 1, 5000, 64, 8, 8, None, False, "fp16", num_splits_list=(7, 64))
    check_case(2, 64, 2048, 256, 4, 1, 64, False, "bf16", num_splits_list=(3,))
    torch.cuda.synchronize()
    # The split workspaces (fp32 partials, tickets) per (device, stream, thread): private, no public name.
    for _, tickets in decoding._workspaces.values():
        assert int(tickets.abs().sum()) == 0, "a ticket was left non-zero"


@pytest.mark.parametrize("num_splits", [2, 5, 16, 40])
def test_split_merge_is_deterministic(num_splits):
    """Whichever CTA of a group merges (the last to finish, by timing), the splits are summed in index
    order: repeated calls on the same inputs give the same bits, output and LSE."""
    import flashgen

    case = make_case(3, 2, 6000, 128, 16, 4, None, False, torch.bfloat16)
    args = (case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"])
    first = flashgen.decode(*args, num_splits=num_splits, return_lse=True, check_values=False)
    for _ in range(20):
        out, lse = flashgen.decode(*args, num_splits=num_splits, return_lse=True, check_values=False)
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1])


def test_back_to_back_calls_share_the_workspace():
    """Several split calls queued without a sync (one cached workspace, tickets reused): each output is
    its own inputs' attention, for two shapes interleaved."""
    import flashgen

    cases = [make_case(2, 1, 4000, 128, 32, 8, None, False, torch.bfloat16) for _ in range(3)]
    cases += [make_case(1, 2, 9000, 64, 8, 1, 64, False, torch.bfloat16) for _ in range(2)]
    outs = [flashgen.decode(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], c["block_table"],
                            check_values=False) for c in cases + cases[::-1]]
    torch.cuda.synchronize()
    for c, out in zip(cases + cases[::-1], outs):
        d = c["q"].shape[-1]
        ref, _ = reference(c, 1 / math.sqrt(d))
        low, _ = reference(c, 1 / math.sqrt(d), torch.bfloat16)
        assert (out.float() - ref).abs().max().item() <= allowance(low, ref, torch.bfloat16)
