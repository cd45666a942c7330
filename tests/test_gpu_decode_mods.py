"""GPU tier: flashgen.decode with user mods (score_mod / mask_mod, flashgen.mods) against an fp32 reference.

The reference applies the mod functions as written to the whole score matrix of each sequence, with
q_idx the new token's position (token i of nq at i + L - nq, L the length after the append) and kv_idx
the key's, on top of decode's causal limit; the 2x rule as in the other decode tests. Fresh random
inputs, NaN-padded caches (a key past a sequence's length that is read shows), contiguous and paged
caches, appended tokens, GQA, odd lengths, both dtypes, the default split count and one split; a mask
that hides every key of some rows (output 0, LSE -inf).
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)"),
]

from flashgen.reference import allowance  # noqa: E402
from gpu_util import DTYPES, check_decode_lse, check_decode_output, decode_reference, make_case, poison  # noqa: E402


def decode_mods(hq, lmax):
    """name -> (score_mod, mask_mod), with fresh captured tensors (positions up to ``lmax``)."""
    slopes = torch.rand(hq, device="cuda") * 0.5 + 0.01
    rel16 = (torch.randn(hq, 2 * lmax + 1, device="cuda")).to(torch.bfloat16)
    doc = torch.sort(torch.randint(0, 5, (lmax + 1,), device="cuda", dtype=torch.int32)).values
    prefix = torch.randint(0, 64, (8,), device="cuda", dtype=torch.int32)
    origin = torch.tensor([lmax], device="cuda", dtype=torch.int32)

    def alibi(score, b, h, q, kv):
        return score - slopes[h] * (q - kv).abs()

    def softcap(score, b, h, q, kv):
        return 20.0 * torch.tanh(score / 20.0)

    def relative(score, b, h, q, kv):
        return score + rel16[h, kv - q + origin[0]]

    def window(b, h, q, kv):
        return q - kv <= 37

    def document(b, h, q, kv):
        return doc[q] == doc[kv]

    def prefix_or_recent(b, h, q, kv):  # a per-sequence prefix plus the last 16 keys
        return (kv <= prefix[b]) | (q - kv < 16)

    def nothing_for_odd_heads(b, h, q, kv):  # rows of odd heads see no key: output 0, LSE -inf
        return h % 2 == 0

    return {"alibi": (alibi, None), "softcap": (softcap, None), "relative": (relative, None),
            "window": (None, window), "document": (None, document), "prefix_or_recent": (None, prefix_or_recent),
            "alibi_window": (alibi, window), "softcap_document": (softcap, document),
            "empty_rows": (None, nothing_for_odd_heads)}


NAMES = ["alibi", "softcap", "relative", "window", "document", "prefix_or_recent", "alibi_window", "softcap_document",
         "empty_rows"]  # the keys of decode_mods


def reference(case, scale, score_mod, mask_mod, dtype=torch.float32):
    """(out, lse) in fp32, scores in ``dtype``: decode's causal limit, then the mods (``decode_reference``)."""
    return decode_reference(case, scale, dtype, score_mod, mask_mod)


def check_mods(b, nq, L, d, hq, hk, page, with_new, dtype_name, name):
    import flashgen

    dtype = DTYPES[dtype_name]
    case = make_case(b, nq, L, d, hq, hk, page, with_new, dtype)
    score_mod, mask_mod = decode_mods(hq, L + nq)[name]
    scale = 1.0 / math.sqrt(d)
    ref, ref_lse = reference(case, scale, score_mod, mask_mod)
    low, low_lse = reference(case, scale, score_mod, mask_mod, dtype)
    tol = allowance(low, ref, dtype)
    for ns in (None, 1):
        if with_new and ns == 1:  # (the first call appended k_new/v_new: the second reads them from the cache)
            case["cache_seqlens"] += nq
            case["lens"] = [n + nq for n in case["lens"]]
            kn, vn = case["k_new"], case["v_new"]
            case["k_new"] = case["v_new"] = None
        poison(b * nq * hq * (d + 1) * 4 * 64)
        with torch.no_grad():
            out, lse = flashgen.decode(case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"],
                                       case["block_table"], case["k_new"], case["v_new"], num_splits=ns,
                                       return_lse=True, score_mod=score_mod, mask_mod=mask_mod)
        torch.cuda.synchronize()
        masked = check_decode_output(out, lse, case["q"], ref, ref_lse, tol, ns)
        check_decode_lse(lse, ref_lse, low_lse, masked, ns)
        if with_new and ns == 1:
            case["k_new"], case["v_new"] = kn, vn


CASES = [
    (3, 1, 339, 64, 4, 4, 16, True, "fp16"),
    (3, 3, 1024, 128, 8, 8, 32, False, "bf16"),
    (3, 1, 4096, 128, 32, 8, 64, True, "bf16"),
    (2, 2, 500, 96, 4, 2, None, True, "bf16"),
    (2, 1, 20000, 128, 8, 1, None, False, "bf16"),
    (2, 16, 777, 256, 4, 1, 64, True, "bf16"),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("b,nq,L,d,hq,hk,page,with_new,dtype", CASES,
                         ids=[f"b{c[0]}_q{c[1]}_L{c[2]}_d{c[3]}_h{c[4]}-{c[5]}_{'p' + str(c[6]) if c[6] else 'contig'}"
                              f"_{'new' if c[7] else 'nonew'}_{c[8]}" for c in CASES])
def test_mods_match_reference(b, nq, L, d, hq, hk, page, with_new, dtype, name):
    check_mods(b, nq, L, d, hq, hk, page, with_new, dtype, name)


def test_plain_and_mod_calls_share_nothing_stale():
    """A decode call with a mod, then the same shapes without it and with another capture: each meets its own
    reference (the plan cache keys the mods; a rebound capture traces anew)."""
    import flashgen

    case = make_case(2, 1, 300, 128, 8, 2, None, False, torch.bfloat16)
    scale = 1.0 / math.sqrt(128)
    slopes = torch.rand(8, device="cuda")

    def alibi(score, b, h, q, kv):
        return score - slopes[h] * (q - kv).abs()

    for score_mod in (alibi, None, alibi):
        ref, _ = reference(case, scale, score_mod, None)
        low, _ = reference(case, scale, score_mod, None, torch.bfloat16)
        with torch.no_grad():
            out = flashgen.decode(case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"],
                                  score_mod=score_mod)
        assert (out.float() - ref).abs().max().item() <= allowance(low, ref, torch.bfloat16)
        slopes = torch.rand(8, device="cuda") * 2  # rebound: the next alibi call must read these


def test_case_names_are_the_mods():
    assert NAMES == list(decode_mods(1, 1))
