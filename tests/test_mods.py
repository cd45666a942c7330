"""User mods (flashgen/mods.py), no GPU: tracing FlexAttention's example mods, the evaluator against the
same functions run by torch, refusals, hashing, the printed CUDA (compiled by NVRTC, which needs no GPU),
pairs, the registry and the trace cache."""
from __future__ import annotations

import math
import re

import pytest
import torch

from flashgen import mods
from flashgen.codegen.render import header
from flashgen.mods import ModError

B, H, Q, K = 2, 3, 37, 300
SLOPES = torch.rand(H)
BIAS = torch.randn(H, 2 * K)
DOC = torch.repeat_interleave(torch.arange(8, dtype=torch.int32), 40)[:K]
BLOCKS = torch.rand(3, 3) < 0.5
PREFIX = 9
WINDOW = 16


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX) | (q_idx >= kv_idx)


def document(b, h, q_idx, kv_idx):
    return DOC[q_idx] == DOC[kv_idx]


def block_sparse(b, h, q_idx, kv_idx):
    return BLOCKS[q_idx // 128, kv_idx // 128]


def alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPES[h] * abs(q_idx - kv_idx)


def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS[h, q_idx - kv_idx + K]


def floor_ops(score, b, h, q_idx, kv_idx):
    d = q_idx - kv_idx
    return score + d // 7 + d % 5 + (d // (2 * kv_idx - 9)) * 100 + d % (9 - 2 * kv_idx) + score // 0.75 + score % -0.5


def math_ops(score, b, h, q_idx, kv_idx):
    x = torch.clamp(score, -3.0, 3.0)
    y = torch.exp(x) + torch.log(torch.abs(x) + 1.0) + torch.sqrt(torch.abs(x)) + torch.sigmoid(x) + x.exp2()
    return torch.where(q_idx >= kv_idx, y * 0.25 - torch.minimum(x, score * 2) / (q_idx + 1), torch.maximum(x, score))


SCORE_MODS = (alibi, softcap, relative_bias, floor_ops, math_ops)
MASK_MODS = (causal, sliding_window, prefix_lm, document, block_sparse)


def grids():
    score = torch.randint(-40, 40, (B, H, Q, K)).float() / 4  # exact quarters: float // and % are exact
    b = torch.arange(B, dtype=torch.int32).view(B, 1, 1, 1)
    h = torch.arange(H, dtype=torch.int32).view(1, H, 1, 1)
    q = torch.arange(Q, dtype=torch.int32).view(1, 1, Q, 1) * 8  # queries spread over the keys' range
    kv = torch.arange(K, dtype=torch.int32).view(1, 1, 1, K)
    return score, b, h, q, kv


# ---------------------------------------------------------------- tracing and the evaluator


@pytest.mark.parametrize("fn", SCORE_MODS, ids=lambda f: f.__name__)
def test_score_mods_evaluate_as_torch_runs_them(fn):
    graph = mods.trace_score_mod(fn, allow_cpu=True)
    assert graph.kind == "score" and graph.nodes[-1].dtype == "f32"
    score, b, h, q, kv = grids()
    got = graph.evaluate(score, b, h, q, kv)
    assert got.dtype == torch.float32 and got.shape == (B, H, Q, K)
    torch.testing.assert_close(got, fn(score, b, h, q, kv).float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fn", MASK_MODS, ids=lambda f: f.__name__)
def test_mask_mods_evaluate_as_torch_runs_them(fn):
    graph = mods.trace_mask_mod(fn, allow_cpu=True)
    assert graph.kind == "mask" and graph.nodes[-1].dtype == "bool" and "score" not in graph.uses
    _, b, h, q, kv = grids()
    got = graph.evaluate(None, b, h, q, kv)
    assert got.dtype == torch.bool and got.shape == (B, H, Q, K)
    assert torch.equal(got, fn(b, h, q, kv).expand(B, H, Q, K))


def test_graph_attributes():
    graph = mods.trace_score_mod(relative_bias, allow_cpu=True)
    assert graph.uses == frozenset({"score", "h", "q", "kv"})
    assert graph.captures[0] is BIAS and graph.capture_types == (("float32", 2),)
    assert re.fullmatch(r"[0-9a-f]{64}", graph.hash)
    assert mods.trace_mask_mod(causal).captures == ()  # no capture: no CPU question
    ops = [n.op for n in mods.trace_mask_mod(causal).nodes]
    assert ops == ["in", "in", "le"]  # q >= kv is kv <= q


def test_common_subexpressions_are_shared():
    graph = mods.trace_score_mod(lambda s, b, h, q, kv: s + SLOPES[h] * SLOPES[h] + (q - kv) * (q - kv),
                                 allow_cpu=True)
    assert sum(n.op == "load" for n in graph.nodes) == 1 and sum(n.op == "sub" for n in graph.nodes) == 1
    assert len(graph.nodes) == len(set(graph.nodes))


def test_promotion_and_casts():
    def types(fn):
        return mods.trace_score_mod(fn, allow_cpu=True).nodes

    nodes = types(lambda s, b, h, q, kv: (q / kv) + (q // 2).float() + (q > kv).float() + q.to(torch.float32))
    assert {n.dtype for n in nodes if n.op == "div"} == {"f32"} and {n.dtype for n in nodes if n.op == "floordiv"} == {"i32"}
    nodes = types(lambda s, b, h, q, kv: s + (q + 0.5).long() + (q * 2).int())
    assert [n.dtype for n in nodes if n.op == "cast"].count("i32") == 1  # .int() of an int is itself
    mask = mods.trace_mask_mod(lambda b, h, q, kv: torch.logical_and(q, kv - 1) | (q.bool() & ~(kv == 3)))
    assert mask.nodes[-1].dtype == "bool"
    _, b, h, q, kv = grids()
    expect = (q != 0) & (kv - 1 != 0) | (q != 0) & ~(kv == 3)
    assert torch.equal(mask.evaluate(None, b, h, q, kv), expect.expand(B, H, Q, K))


def test_constant_results_and_broadcast():
    score_graph = mods.trace_score_mod(lambda s, b, h, q, kv: 1.5)
    mask_graph = mods.trace_mask_mod(lambda b, h, q, kv: True)
    assert score_graph.uses == frozenset() and mask_graph.nodes == (mods.Node("const", "bool", (True,)),)
    _, b, h, q, kv = grids()
    assert torch.equal(mask_graph.evaluate(None, b, h, q, kv), torch.ones(B, H, Q, K, dtype=torch.bool))
    assert score_graph.evaluate(0.0, 0, 0, 0, 0).item() == 1.5


def test_indexing_is_clamped_and_chained():
    table = torch.arange(10, dtype=torch.int64).view(2, 5) * 3
    graph = mods.trace_score_mod(lambda s, b, h, q, kv: s + table[h][q - kv], allow_cpu=True)
    assert graph.hash == mods.trace_score_mod(lambda s, b, h, q, kv: s + table[h, q - kv], allow_cpu=True).hash
    q = torch.tensor([-3, 0, 4, 9], dtype=torch.int32)
    got = graph.evaluate(0.0, 0, torch.tensor([5, 1, 0, -1], dtype=torch.int32), q, 0)
    assert got.tolist() == [table[1, 0], table[1, 0], table[0, 4], table[0, 4]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool])
def test_capture_dtypes(dtype):
    t = (torch.randn(4, 6) * 4).to(dtype)
    graph = mods.trace_score_mod(lambda s, b, h, q, kv: s + t[h, kv], allow_cpu=True)
    assert graph.capture_types == ((str(dtype)[6:], 2),)
    h, kv = torch.arange(4, dtype=torch.int32).view(4, 1), torch.arange(6, dtype=torch.int32)
    expect = 1.0 + t.float() if dtype != torch.int64 else 1.0 + t.to(torch.int32).float()
    assert torch.equal(graph.evaluate(1.0, 0, h, 0, kv), expect)


def test_integer_division_edges():
    graph = mods.trace_score_mod(lambda s, b, h, q, kv: (q // kv).float() + (q % kv).float() * 1000, allow_cpu=True)
    q = torch.tensor([7, -7, 7, -7, 5, -2 ** 31], dtype=torch.int32)
    kv = torch.tensor([2, 2, -2, -2, 0, -1], dtype=torch.int32)
    floor = [math.floor(a / b) for a, b in zip([7, -7, 7, -7], [2, 2, -2, -2])]
    mod = [a % b for a, b in zip([7, -7, 7, -7], [2, 2, -2, -2])]
    assert graph.evaluate(0.0, 0, 0, q, kv).tolist() == [f + 1000 * m for f, m in zip(floor, mod)] + [0.0, -2.0 ** 31]


def test_float_to_int_saturates():
    graph = mods.trace_score_mod(lambda s, b, h, q, kv: s.int().float())
    s = torch.tensor([1.7, -1.7, 3e9, -3e9, math.nan, math.inf])
    assert graph.evaluate(s, 0, 0, 0, 0).tolist() == [1.0, -1.0, 2.0 ** 31, -2.0 ** 31, 0.0, 2.0 ** 31]


# ---------------------------------------------------------------- refusals


def expect_refusal(fn, pattern, kind="score", **kw):
    trace = mods.trace_score_mod if kind == "score" else mods.trace_mask_mod
    with pytest.raises(ModError, match=pattern) as info:
        trace(fn, **kw)
    assert str(info.value).startswith(f"{kind}_mod: ")
    return info.value


@pytest.mark.parametrize("fn, pattern", [
    (lambda s, b, h, q, kv: torch.sin(s), r"torch\.sin is not supported in a mod \(supported: "),
    (lambda s, b, h, q, kv: s.cos(), r"Tensor\.cos is not supported"),
    (lambda s, b, h, q, kv: torch.nn.functional.relu(s), r"torch\.nn\.functional\.relu is not supported"),
    (lambda s, b, h, q, kv: s ** 2, r"\*\* is not supported"),
    (lambda s, b, h, q, kv: s if q > kv else -s, "Python control flow"),
    (lambda s, b, h, q, kv: s * min(q, kv), "Python control flow"),
    (lambda s, b, h, q, kv: s * (q > 0 and kv > 0), "Python control flow"),
    (lambda s, b, h, q, kv: math.exp(s), r"math\.\* on a traced value is not supported"),
    (lambda s, b, h, q, kv: s.add_(1.0), r"in-place Tensor\.add_"),
    (lambda s, b, h, q, kv: torch.add(s, 1.0, out=s), "in-place"),
    (lambda s, b, h, q, kv: q >= kv, "returned a bool value"),
    (lambda s, b, h, q, kv: q - kv, "returned an int value"),
    (lambda s, b, h, q, kv: None, "must return a traced float value or a constant, got NoneType"),
    (lambda s, b, h, q, kv: s * float("nan"), "NaN constant"),
    (lambda s, b, h, q, kv: s * 1e39, "outside float32's range"),
    (lambda s, b, h, q, kv: s + (q // 0), "division by a constant zero"),
    (lambda s, b, h, q, kv: s / 0.0, "division by a constant zero"),
    (lambda s, b, h, q, kv: s + (q + 2 ** 40), "does not fit int32"),
    (lambda s, b, h, q, kv: s + torch.tensor(1.0), "used whole"),
    (lambda s, b, h, q, kv: s[0], "indexing a traced value"),
    (lambda s, b, h, q, kv: s + BIAS[:, h].sum(), "indexed by slice"),
    (lambda s, b, h, q, kv: s + BIAS[h, s], "indexed by a float or bool value"),
    (lambda s, b, h, q, kv: s + BIAS[-1, q], "negative constant index"),
    (lambda s, b, h, q, kv: s + BIAS[h], r"2-dim captured tensor is indexed by 1 index"),
    (lambda s, b, h, q, kv: s + (q > 0) * (kv > 0), "two bool values"),
    (lambda s, b, h, q, kv: s + (q ^ kv), r"\^ is not supported"),
    (lambda s, b, h, q, kv: s.to(torch.float16), r"\.to\(torch\.float16\)"),
])
def test_score_mod_refusals(fn, pattern):
    expect_refusal(fn, pattern, allow_cpu=True)


def test_in_place_item_assignment_is_refused():
    table = torch.zeros(4)

    def writes(s, b, h, q, kv):
        table[h] = s
        return s
    expect_refusal(writes, "in-place", allow_cpu=True)


def test_mask_mod_refusals():
    expect_refusal(lambda b, h, q, kv: q - kv, "returned an int value", kind="mask")
    expect_refusal(lambda b, h, q, kv: (q - kv).float(), "returned a f32 value", kind="mask")
    expect_refusal(lambda b, h, q, kv: 1, "must return a traced bool value or a constant, got int", kind="mask")
    expect_refusal(lambda b, h, q, kv: (q - kv) & kv, "& takes bool values", kind="mask")
    expect_refusal(lambda b, h, q, kv: torch.where(q, True, False), "condition must be a bool", kind="mask")


def test_capture_refusals():
    expect_refusal(alibi, "captures a CPU tensor")  # the default: captured tensors must be CUDA tensors
    expect_refusal(lambda s, b, h, q, kv: s + torch.zeros(1, 1, 1, 1, 1)[b, h, q, kv, 0], "captures a 5-dim tensor",
            allow_cpu=True)
    expect_refusal(lambda s, b, h, q, kv: s + torch.zeros(3, dtype=torch.float64)[h], "captures a float64 tensor",
            allow_cpu=True)
    expect_refusal(lambda s, b, h, q, kv: s + torch.zeros(0)[h], "captures a tensor of shape", allow_cpu=True)
    five = [torch.zeros(3) for _ in range(5)]
    expect_refusal(lambda s, b, h, q, kv: s + sum(t[h] for t in five), "captures 5 tensors", allow_cpu=True)
    four = mods.trace_score_mod(lambda s, b, h, q, kv: s + sum(t[h] for t in five[:4]), allow_cpu=True)
    assert sorted(map(id, four.captures)) == sorted(map(id, five[:4]))  # in the graph's order
    unused = mods.trace_score_mod(lambda s, b, h, q, kv: (five[4][h], s)[1], allow_cpu=True)
    assert unused.captures == ()  # a read the result does not need is not captured


# ---------------------------------------------------------------- hashing


def test_spellings_of_one_mod_hash_alike():
    def spelled(fns, kind="score"):
        trace = mods.trace_score_mod if kind == "score" else mods.trace_mask_mod
        return {trace(fn, allow_cpu=True).hash for fn in fns}

    assert len(spelled([lambda s, b, h, q, kv: s + SLOPES[h], lambda score, bb, hh, qi, ki: SLOPES[hh] + score])) == 1
    assert len(spelled([
        lambda s, b, h, q, kv: torch.where(q >= kv, s, -float("inf")),
        lambda s, b, h, q, kv: torch.where(kv <= q, s, float("-inf")),
        lambda s, b, h, q, kv: s.where(torch.ge(q, kv), -math.inf),
    ])) == 1
    assert len(spelled([lambda b, h, q, kv: (q >= kv) & (DOC[q] == DOC[kv]),
                        lambda b, h, q, kv: (DOC[kv] == DOC[q]) & (kv <= q),
                        lambda b, h, q, kv: torch.logical_and(DOC[q] == DOC[kv], q >= kv)], "mask")) == 1
    other = torch.zeros(3)
    assert len(spelled([lambda s, b, h, q, kv: SLOPES[h] * 2 + other[q],
                        lambda s, b, h, q, kv: other[q] + 2 * SLOPES[h]])) == 1


def test_different_mods_hash_apart():
    hashes = [mods.trace_score_mod(fn, allow_cpu=True).hash for fn in (
        lambda s, b, h, q, kv: s * 0.5, lambda s, b, h, q, kv: s * 0.25, lambda s, b, h, q, kv: s * 0.1,
        lambda s, b, h, q, kv: s * 0.10000000000000002, lambda s, b, h, q, kv: s * 2,
        lambda s, b, h, q, kv: s - q, lambda s, b, h, q, kv: q - s, lambda s, b, h, q, kv: s + SLOPES[h],
        lambda s, b, h, q, kv: s + SLOPES[q])]
    assert len(set(hashes)) == len(hashes)
    assert mods.trace_score_mod(lambda s, b, h, q, kv: 1.0).hash != \
        mods.trace_mask_mod(lambda b, h, q, kv: True).hash


def test_capture_dtype_changes_the_hash_values_and_shapes_do_not():
    def hashed(t):
        return mods.trace_score_mod(lambda s, b, h, q, kv: s + t[h, q], allow_cpu=True).hash

    base = hashed(torch.randn(4, 10))
    assert hashed(torch.zeros(8, 20)) == base
    assert hashed(torch.randn(10, 4).t()) == base
    assert hashed(torch.randn(4, 10).half()) != base


# ---------------------------------------------------------------- the printed CUDA

# What the kernels put before the printed functions: the shared helpers and fg_mod_args with its
# loads and approximations (templates/common/mod_args.cuh).
PRELUDE = header("common/common.cuh") + header("common/mod_args.cuh")


def test_cuda_prints_no_user_text_and_is_deterministic():
    evil_table = torch.zeros(4, 4, dtype=torch.bfloat16)

    def evil_name(score, evil_b, evil_h, evil_q, evil_kv):
        evil_local = evil_table[evil_h, evil_q - evil_kv] * 3.0
        return torch.where(evil_q >= evil_kv, score + evil_local, -float("inf"))

    text = mods.trace_score_mod(evil_name, allow_cpu=True).cuda("fg_score_mod", 1)
    assert "evil" not in text and "a.t[1]" in text and "a.t[0]" not in text
    assert "0x1.8p+1f" in text and "(-INFINITY)" in text
    again = mods.trace_score_mod(lambda s, b, h, q, kv: torch.where(kv <= q, evil_table[h, q - kv] * 3.0 + s,
                                                                    -math.inf), allow_cpu=True)
    assert again.cuda("fg_score_mod", 1) == text
    body = text.splitlines()[1:-2]
    assert all(re.fullmatch(r"    const (float|int|bool) v\d+ = .+;", line) for line in body)


def test_cuda_constants_and_names():
    text = mods.trace_score_mod(lambda s, b, h, q, kv: s * 0.1 + (q + -2 ** 31).float() + math.inf).cuda("f")
    assert f"{struct_f32(0.1)}f" in text and "(-2147483647 - 1)" in text and "= INFINITY;" in text
    graph = mods.trace_mask_mod(causal)
    for bad in ("1x", "a b", "f(){}", "int", "", "x;y"):
        with pytest.raises(ModError, match="not a C identifier"):
            graph.cuda(bad)
    with pytest.raises(ModError, match="slots"):
        mods.trace_score_mod(alibi, allow_cpu=True).cuda("f", 4)


def struct_f32(x: float) -> str:
    import struct

    m, e = struct.unpack("<f", struct.pack("<f", x))[0].hex().split("p")
    return f"{m.rstrip('0')}p{e}"


def test_cuda_compiles_with_nvrtc():
    """Several mods' printed functions, wrapped with the header's declarations and a kernel that calls
    them, compile for sm_90a (NVRTC needs no GPU)."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from flashgen.codegen import compiler

    half = torch.zeros(3, 5, dtype=torch.float16)
    wide = torch.zeros(2, dtype=torch.int64)
    pairs = [mods.pair(mods.trace_score_mod(s, allow_cpu=True), mods.trace_mask_mod(m, allow_cpu=True))
             for s, m in ((alibi, document), (relative_bias, block_sparse), (floor_ops, prefix_lm),
                          (math_ops, sliding_window))]
    pairs.append(mods.pair(mods.trace_score_mod(lambda s, b, h, q, kv: s + half[h, kv] + wide[b].float(),
                                                allow_cpu=True), None))
    pairs.append(mods.pair(None, mods.trace_mask_mod(causal)))
    source = PRELUDE
    for i, p in enumerate(pairs):
        source += f"namespace m{i} {{\n{p.cuda()}}}\n"
    calls = " + ".join(f"(m{i}::fg_mask_mod(0, 1, i, 2, a) ? m{i}::fg_score_mod(x, 0, 1, i, 2, a) : 0.f)"
                       for i in range(len(pairs)))
    source += ('extern "C" __global__ void fg_mods_check(float* out, fg_mod_args a) {\n'
               f"  const int i = threadIdx.x;\n  const float x = out[i];\n  out[i] = {calls};\n}}\n")
    binary = compiler.compile_source(source, "sm_90a", "fg_mods_check")
    assert binary.cubin and not binary.report.problems()


def test_reads_at_per_head_indices_print_apart_from_the_per_score_compares():
    """A mask_mod's reads at constant or (b, h) indices (an offset as ``off[0]``, a length per batch) and what is
    computed from them alone go to ``fg_mask_mod_head``, which a kernel calls once per head; the per-score
    function reads them from its struct and compares indices. A read at a q- or kv-dependent index (document
    ids) stays per score, and so does everything after the first q or kv."""
    off, lens = torch.tensor([3], dtype=torch.int32), torch.tensor([5, 9], dtype=torch.int32)
    offset = mods.trace_mask_mod(lambda b, h, q, kv: (q + off[0] >= kv) | (kv < lens[b] * 2 + h), allow_cpu=True)
    text = offset.cuda_hoisted("fg_mask_mod")
    head, score = text.split("FG_DEVICE bool fg_mask_mod(", 1)
    assert head.count("__ldg(") == 2 and "__ldg(" not in score, text
    assert not offset.loads_per_score() and len(offset.hoisted()) == 2, offset.hoisted()  # off[0], lens[b] * 2 + h
    assert {offset.nodes[i].dtype for i in offset.hoisted()} == {"i32"}
    docs = mods.trace_mask_mod(document, allow_cpu=True)
    assert docs.loads_per_score() and docs.hoisted() == ()
    text = docs.cuda_hoisted("fg_mask_mod")
    assert "struct fg_mask_mod_head_t { };" in text
    assert text.split("FG_DEVICE bool fg_mask_mod(", 1)[1].count("__ldg") == 2
    whole = mods.trace_mask_mod(lambda b, h, q, kv: lens[b] > h, allow_cpu=True)  # no q or kv: all of it per head
    assert whole.hoisted() == (len(whole.nodes) - 1,) and "return v" in whole.cuda_hoisted("m").split("k) {")[1]
    with pytest.raises(ModError, match="prints a mask_mod"):
        mods.trace_score_mod(alibi, allow_cpu=True).cuda_hoisted("f")


# ---------------------------------------------------------------- pairs, registry, cache


def test_pairs_slots_and_tokens():
    score, mask = mods.trace_score_mod(alibi, allow_cpu=True), mods.trace_mask_mod(document, allow_cpu=True)
    both = mods.pair(score, mask)
    assert both.captures == (SLOPES, DOC) and re.fullmatch(r"[0-9a-f]{12}", both.token)
    text = both.cuda()
    assert "fg_score_mod" in text and "fg_mask_mod" in text and "a.t[1]" in text.split("FG_DEVICE bool fg_mask_mod(")[1]
    assert len({both.token, mods.pair(score, None).token, mods.pair(None, mask).token}) == 3
    assert "return true;" in mods.pair(score, None).cuda() and "return score;" in mods.pair(None, mask).cuda()
    assert mods.pair(mods.trace_score_mod(alibi, allow_cpu=True), mask).token == both.token
    with pytest.raises(ModError, match="needs a score_mod or a mask_mod"):
        mods.pair(None, None)
    with pytest.raises(ModError, match="mask half"):
        mods.pair(score, score)
    three = [torch.zeros(2) for _ in range(3)]
    big = mods.trace_score_mod(lambda s, b, h, q, kv: s + three[0][h] + three[1][h] + three[2][h], allow_cpu=True)
    with pytest.raises(ModError, match="capture 5 tensors together"):
        mods.pair(big, mods.trace_mask_mod(lambda b, h, q, kv: DOC[q] == BLOCKS[h, kv].int(), allow_cpu=True))


def test_registry():
    p = mods.pair(None, mods.trace_mask_mod(sliding_window))
    assert mods.register(p) == p.token and mods.lookup(p.token) is p
    with pytest.raises(KeyError):
        mods.lookup("0123456789ab")
    with pytest.raises(ModError, match="mod 0123456789ab is not known in this process: pass the score_mod/mask_mod"):
        mods.lookup("0123456789ab")


CACHED = torch.zeros(4)


def test_trace_cache_reuses_and_sees_rebinding():
    global CACHED

    def reads_global(s, b, h, q, kv):
        return s + CACHED[h]

    first = mods.trace_score_mod(reads_global, allow_cpu=True)
    assert mods.trace_score_mod(reads_global, allow_cpu=True) is first
    CACHED = torch.ones(4)
    second = mods.trace_score_mod(reads_global, allow_cpu=True)
    assert second is not first and second.captures[0] is CACHED and second.hash == first.hash

    limit = 3

    def reads_closure(b, h, q, kv):
        return q - kv <= limit

    one = mods.trace_mask_mod(reads_closure)
    assert mods.trace_mask_mod(reads_closure) is one
    limit = 5
    assert mods.trace_mask_mod(reads_closure).hash != one.hash
    with pytest.raises(ModError, match="CPU"):
        mods.trace_score_mod(reads_global)  # allow_cpu is part of the key


def test_tensor_used_whole_and_bool_min_are_refused():
    t = torch.ones(3, dtype=torch.bool)
    expect_refusal(lambda b, h, q, kv: t & (q > kv), "used whole", kind="mask")
    expect_refusal(lambda s, b, h, q, kv: s + torch.maximum(q > kv, kv > q), "two bool values")


def test_cache_skips_functions_that_read_other_modules():
    import types

    config = types.ModuleType("config")
    config.WINDOW = 3

    def window(b, h, q, kv):
        return q - kv <= config.WINDOW

    first = mods.trace_mask_mod(window)
    config.WINDOW = 4
    assert mods.trace_mask_mod(window).hash != first.hash


def test_one_element_of_a_captured_tensor_by_a_constant_index():
    """``t[0]`` is evaluated by torch while tracing: the view becomes a read of that element (a size offset
    kept in a tensor, so that new sizes do not make new graphs), and its value follows the tensor."""
    off = torch.tensor([3, 40], dtype=torch.int32)
    graph = mods.trace_mask_mod(lambda b, h, q, kv: q + off[1] >= kv, allow_cpu=True)
    assert len(graph.captures) == 1 and graph.captures[0].data_ptr() == off[1].data_ptr()
    q, kv = torch.arange(5)[:, None], torch.arange(60)[None, :]
    assert torch.equal(graph.evaluate(None, 0, 0, q, kv), q + 40 >= kv)
    off[1] = 7
    assert torch.equal(graph.evaluate(None, 0, 0, q, kv), q + 7 >= kv)
    again = mods.trace_mask_mod(lambda b, h, q, kv: q + off[0] >= kv, allow_cpu=True)
    assert again.hash == graph.hash  # which element is read is the capture's business, not the graph's


@pytest.mark.parametrize("fn,factors", [
    (lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0), (1 / 30.0, 30.0)),
    (lambda s, b, h, q, kv: torch.tanh(s * 0.5) * 2.0, (0.5, 2.0)),
    (lambda s, b, h, q, kv: s * 0.5 + s, (1.0, 1.0)),               # the score used apart from its multiple
    (lambda s, b, h, q, kv: -2.0 * torch.tanh(s / 4.0), (0.25, 1.0)),  # c < 0 stays in the function
    (lambda s, b, h, q, kv: s - (q - kv).abs() * 0.5, (1.0, 1.0)),
    (lambda s, b, h, q, kv: s * 2.0, (2.0, 1.0)),
    (lambda s, b, h, q, kv: torch.abs(s) * 2.0, (1.0, 2.0)),           # a unary use of the score
])
def test_score_factors_fold_out_of_the_printed_function(fn, factors):
    """c f(k score): the kernel folds k into its scale and c into its softmax; the printed function is f
    of its (already multiplied) score, and c f(k s) equals the graph's value."""
    graph = mods.trace_score_mod(fn)
    k, c = graph.factors()
    assert (k, c) == pytest.approx(factors)
    folded = graph.cuda("f", fold=True)
    if k != 1.0:
        assert "const float v%d = score;" % next(i for i, n in enumerate(graph.nodes) if n.op == "in") in folded
    if c != 1.0:
        assert folded.count("return") == 1 and graph.cuda("f") != folded


# ---------------------------------------------------------------- the derivative


@pytest.mark.parametrize("fn", [
    lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0),
    lambda s, b, h, q, kv: s - SLOPES[h] * (q - kv).abs(),
    lambda s, b, h, q, kv: torch.clamp(s, -1.0, 2.0) + torch.sigmoid(s) * torch.where(q > kv, s, -s),
    lambda s, b, h, q, kv: (torch.exp(s * 0.3) / (1.0 + s.abs()) + torch.log(s * s + 1.0) + torch.sqrt(s.abs() + 1.0)
                            - torch.rsqrt(s * s + 2.0) + s.exp2() * 0.1 + torch.log2(s.abs() + 3.0)),
    lambda s, b, h, q, kv: (s % 1.5) + s // 0.7 + torch.minimum(s, s * 0.5) + torch.maximum(s, (q - kv).float()),
    lambda s, b, h, q, kv: (q - kv).float() * 0.1,
])
def test_derivative_matches_autograd(fn):
    """d score_mod / d score (mods.grad.derivative) against torch's autograd through the evaluator, away
    from kinks; printed, it compiles with NVRTC."""
    from flashgen.codegen import compiler
    from flashgen.mods.grad import derivative

    graph = mods.trace_score_mod(fn, allow_cpu=True)
    slope = derivative(graph)
    idx = [torch.arange(n).reshape([n if a == i else 1 for a in range(4)]) for i, n in enumerate((2, 8, 5, 7))]
    s = (torch.randn(2, 8, 5, 7, generator=torch.Generator().manual_seed(1)) * 2 + 0.013).requires_grad_(True)
    y = graph.evaluate(s, *idx)
    want = torch.autograd.grad(y.sum(), s, allow_unused=True)[0] if y.requires_grad else None
    want = torch.zeros_like(s) if want is None else want
    torch.testing.assert_close(slope.evaluate(s.detach(), *idx), want, rtol=1e-5, atol=1e-5)
    assert slope.captures == graph.captures and slope.kind == "score"
    source = PRELUDE + slope.cuda("fg_score_mod_grad") + (
        'extern "C" __global__ void k(float* o, fg_mod_args a) { o[0] = fg_score_mod_grad(o[1], 0, 1, 2, 3, a); }\n')
    assert not compiler.compile_source(source, "sm_90a", "fg_grad_check").report.problems()


@pytest.mark.parametrize("fn,constant", [
    (lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0), False),
    (lambda s, b, h, q, kv: torch.tanh(s * 0.5) * 2.0, False),
    (lambda s, b, h, q, kv: s - SLOPES[h] * (q - kv).abs(), True),
    (lambda s, b, h, q, kv: s * 2.0, True),
    (lambda s, b, h, q, kv: torch.where(q >= kv, s * s, s), False),
])
def test_backward_functions_are_f_and_its_derivative(fn, constant):
    """The backward kernel's pair: f of c f(k s) (``inner``) with its value and f' in one function; c k f'(k s)
    is the score_mod's derivative (autograd), and a derivative that is the constant 1 prints none."""
    from flashgen.codegen import compiler

    graph = mods.trace_score_mod(fn, allow_cpu=True)
    pair = mods.pair(graph, None)
    k, c = pair.factors
    inner = graph.inner()
    idx = [torch.arange(n).reshape([n if a == i else 1 for a in range(4)]) for i, n in enumerate((2, 8, 5, 7))]
    s = (torch.randn(2, 8, 5, 7, generator=torch.Generator().manual_seed(2)) * 2 + 0.013).requires_grad_(True)
    torch.testing.assert_close(c * inner.evaluate(k * s.detach(), *idx), graph.evaluate(s.detach(), *idx))
    want = torch.autograd.grad(graph.evaluate(s, *idx).sum(), s)[0]
    grad = pair.score_grad
    assert (grad is None) == constant
    slope = torch.ones_like(s) if grad is None else grad.evaluate(k * s.detach(), *idx)
    torch.testing.assert_close(c * k * slope, want, rtol=1e-5, atol=1e-5)
    source = pair.cuda_backward()
    assert ("fg_score_mod_grad" in source) != constant
    assert source.count("FG_DEVICE float fg_score_mod(") == 1 and "FG_DEVICE bool fg_mask_mod(" in source
    if not constant:
        call = "float g; o[0] = fg_score_mod_grad(o[1], 0, 1, 2, 3, a, g); o[2] = g;"
        source = PRELUDE + source + f'extern "C" __global__ void k(float* o, fg_mod_args a) {{ {call} }}\n'
        assert not compiler.compile_source(source, "sm_90a", "fg_grad_value_check").report.problems()


def test_a_mask_has_no_derivative():
    from flashgen.mods.grad import derivative

    with pytest.raises(ModError, match="only a score_mod"):
        derivative(mods.trace_mask_mod(document, allow_cpu=True))
