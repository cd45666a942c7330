"""The Hugging Face transformers adapter without a GPU (``flashgen.integrations.transformers``).

- registration, and the refusals (each names its option) before anything runs;
- the padding mask -> packed rows conversion (left and right padding, rows of pads only, holes) and the
  packing read from position_ids, against loops over the mask;
- small random-weight models of five architectures (Llama, Mistral with a sliding window, Qwen2, Gemma 2
  with a softcap and alternating local/global layers, gpt-oss with sinks and sliding layers), in fp32 on
  the CPU, with torch references (``flashgen.reference``) standing in for ``flashgen.attention`` and
  ``attention_varlen``: the whole adapter (masks, padding, packing, windows, softcap, sinks, GQA, decode
  steps with a cache) against transformers' own "eager" attention, and the arguments the kernels get;
- the same models on ``device="meta"`` through the real entry points (their shape-only path).
"""
from __future__ import annotations

import copy
import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flashgen.errors import UnsupportedError  # noqa: E402
from flashgen.integrations import transformers as hf  # noqa: E402
from flashgen.reference import reference  # noqa: E402
from flashgen.testing import padded_batch  # noqa: E402

F32 = torch.float32


# ---------------------------------------------------------------- torch references for the kernels


class Kernels:
    """Stand-ins for flashgen.attention / attention_varlen (fp32 torch on the CPU, the reference's
    conventions) that record each call's path and options."""

    def __init__(self):
        self.calls = []

    def attention(self, q, k, v, causal=False, softmax_scale=None, layout="bhsd", return_lse=False, spec=None,
                  algorithm="v2", deterministic=False, *, window=None, softcap=0.0, alibi_slopes=None, sinks=None):
        assert layout == "bshd" and not return_lse and alibi_slopes is None
        self.calls.append(dict(path="dense", causal=causal, window=window, softcap=softcap, sinks=sinks is not None,
                               shape=tuple(q.shape), kv_shape=tuple(k.shape), scale=softmax_scale))
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        out, _ = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, scale, window=window,
                           softcap=softcap, sinks=sinks)
        return out.transpose(1, 2).to(q.dtype)

    def attention_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal=False, softmax_scale=None, seqused_k=None,
                         block_table=None, return_lse=False, deterministic=False, *, window=None, softcap=0.0,
                         alibi_slopes=None, sinks=None, check_values=True, spec=None):
        assert seqused_k is None and block_table is None and not return_lse and alibi_slopes is None
        assert cu_q.dtype == cu_k.dtype == torch.int32 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        lens_q, lens_k = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
        assert max(lens_q, default=0) <= max_q and max(lens_k, default=0) <= max_k  # the kernels' bucket bound
        assert cu_q[-1] == q.shape[0] and cu_k[-1] == k.shape[0]
        self.calls.append(dict(path="varlen", causal=causal, window=window, softcap=softcap, sinks=sinks is not None,
                               shape=tuple(q.shape), lens_q=lens_q, lens_k=lens_k, max_q=max_q, max_k=max_k,
                               scale=softmax_scale))
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        out = torch.zeros_like(q)
        for s, (nq, nk) in enumerate(zip(lens_q, lens_k)):
            if nq == 0:
                continue
            a, c = int(cu_q[s]), int(cu_k[s])
            o, _ = reference(q[a:a + nq].transpose(0, 1)[None], k[c:c + nk].transpose(0, 1)[None],
                             v[c:c + nk].transpose(0, 1)[None], causal, scale, window=window, softcap=softcap,
                             sinks=sinks)
            out = out.index_copy(0, torch.arange(a, a + nq), o[0].transpose(0, 1).to(q.dtype))
        return out


@pytest.fixture
def kernels(monkeypatch):
    fake = Kernels()
    monkeypatch.setattr(hf, "attention", fake.attention)
    monkeypatch.setattr(hf, "attention_varlen", fake.attention_varlen)
    monkeypatch.setattr(hf, "DTYPES", hf.DTYPES + (F32,))
    return fake


# ---------------------------------------------------------------- models


def _config(arch: str, **over):
    """A small random-weight model config of ``arch``: GQA 4/2, head dim 16, 2-4 layers, initialised
    widely enough (initializer_range 0.2) that attention is not uniform, so a wrong mask shows."""
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=256, initializer_range=0.2, pad_token_id=0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, **common)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(num_hidden_layers=2, sliding_window=5, **common)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(num_hidden_layers=2, **common)
    elif arch == "gemma2":  # a small softcap so it changes the scores; local/global layers alternate
        cfg = transformers.Gemma2Config(num_hidden_layers=4, sliding_window=5, attn_logit_softcapping=0.8,
                                        final_logit_softcapping=30.0, query_pre_attn_scalar=16, **common)
    elif arch == "gpt_oss":  # sinks on every layer; sliding and full layers alternate
        cfg = transformers.GptOssConfig(num_hidden_layers=2, sliding_window=5, num_local_experts=4,
                                        num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                                        **common)
    else:
        raise ValueError(arch)
    for key, value in over.items():
        setattr(cfg, key, value)
    return cfg


ARCHS = ["llama", "mistral", "qwen2", "gemma2", "gpt_oss"]
_models = {}


def _model(arch: str):
    """(ours, eager): the same random weights under both attention implementations, fp32, eval mode."""
    if arch not in _models:
        torch.manual_seed(0)
        cfg = _config(arch)
        ours = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=hf.register(),
                                                             dtype=F32).eval()
        if arch == "gpt_oss":  # sinks start at zero: make them matter
            with torch.no_grad():
                for layer in ours.model.layers:
                    layer.self_attn.sinks.normal_(0.0, 1.0)
        eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager",
                                                              dtype=F32).eval()
        assert ours.config._attn_implementation == hf.NAME  # (each model owns its config)
        eager.load_state_dict(ours.state_dict())
        _models[arch] = ours, eager
    return _models[arch]


def _batch(lengths, width, left: bool, seed=1):
    """input_ids and attention_mask of sequences of ``lengths`` padded to ``width`` on the left or right."""
    return padded_batch(lengths, width, left, 97, seed)


# ---------------------------------------------------------------- registration


def test_register_is_idempotent_and_the_name_takes_the_custom_path():
    """register() returns the same name each time, puts the attention and the mask function in
    transformers' tables, and a model builds with it (a name with "flash" would be sent to the
    flash-attention package loader instead)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert hf.register() == hf.register() == hf.NAME == "fgen"
    assert "flash" not in hf.NAME.lower()
    assert AttentionInterface._global_mapping[hf.NAME] is hf.attention_forward
    assert AttentionMaskInterface._global_mapping[hf.NAME] is hf.padding_mask
    model = transformers.AutoModelForCausalLM.from_config(_config("llama"), attn_implementation=hf.NAME)
    assert model.config._attn_implementation == hf.NAME


# ---------------------------------------------------------------- refusals


def _qkv(b=2, hq=4, hk=2, sq=6, sk=6, d=16, dtype=torch.bfloat16):
    return torch.randn(b, hq, sq, d, dtype=dtype), torch.randn(b, hk, sk, d, dtype=dtype), \
        torch.randn(b, hk, sk, d, dtype=dtype)


CAUSAL = types.SimpleNamespace(is_causal=True)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(dropout=0.1), UnsupportedError, "dropout"),
    (dict(output_attentions=True), UnsupportedError, "output_attentions"),
    (dict(position_bias=torch.zeros(1)), UnsupportedError, "position_bias"),
    (dict(attention_mask=torch.ones(2, 1, 6, 6, dtype=torch.bool)), UnsupportedError, "4-D attention mask"),
    (dict(attention_mask=torch.zeros(2, 6)), UnsupportedError, "additive"),
    (dict(attention_mask=torch.ones(2, 9, dtype=torch.bool)), ValueError, "does not fit"),
    (dict(sliding_window=4, is_causal=False), UnsupportedError, "bidirectional"),
    (dict(sliding_window=0), ValueError, "sliding_window"),
    (dict(attention_mask=torch.ones(2, 6, dtype=torch.bool), is_causal=False, sq=4), UnsupportedError,
     "cross-attention"),
    (dict(cu_seq_lens_q=torch.tensor([0, 12], dtype=torch.int32)), ValueError, "together"),
])
def test_refusals_name_the_option(kwargs, error, match):
    """What the kernels cannot serve exactly raises before anything runs, naming the option."""
    q, k, v = _qkv(sq=kwargs.pop("sq", 6))
    mask = kwargs.pop("attention_mask", None)
    with pytest.raises(error, match=match):
        hf.attention_forward(CAUSAL, q, k, v, mask, **kwargs)


def test_refuses_float32_outside_autocast_and_other_value_head_dims():
    q, k, v = _qkv(dtype=F32)
    with pytest.raises(TypeError, match="float32.*autocast"):
        hf.attention_forward(CAUSAL, q, k, v, None)
    q, k, v = _qkv()
    with pytest.raises(UnsupportedError, match="value head dim"):
        hf.attention_forward(CAUSAL, q, k, v[..., :8], None)


def test_refuses_a_window_over_a_mask_with_holes():
    """Pads between a row's real tokens: the window would count real tokens where eager counts positions."""
    q, k, v = _qkv(sq=8, sk=8)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 3] = False
    with pytest.raises(UnsupportedError, match="pads between"):
        hf.attention_forward(CAUSAL, q, k, v, mask, sliding_window=3)


def test_the_mask_function_refuses_what_is_more_than_padding():
    from transformers.masking_utils import and_masks, causal_mask_function, or_masks

    base = dict(batch_size=2, q_length=6, kv_length=6)
    with pytest.raises(UnsupportedError, match="custom mask function"):
        hf.padding_mask(**base, mask_function=and_masks(causal_mask_function, causal_mask_function), use_vmap=True)
    with pytest.raises(UnsupportedError, match="block_sequence_ids"):
        hf.padding_mask(**base, mask_function=or_masks(causal_mask_function, causal_mask_function))
    with pytest.raises(UnsupportedError, match="attention_chunk_size"):
        hf.padding_mask(**base, config=types.SimpleNamespace(attention_chunk_size=8))
    with pytest.raises(UnsupportedError, match="static"):  # a static cache: slots past the queries, no mask
        hf.padding_mask(batch_size=2, q_length=6, kv_length=64, q_offset=torch.tensor(0))
    assert hf.padding_mask(**base) is None  # no padding: no mask
    assert hf.padding_mask(batch_size=1, q_length=1, kv_length=7, q_offset=6) is None  # a decode step
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(hf.padding_mask(**base, attention_mask=mask), mask)
    assert hf.padding_mask(**base, attention_mask=torch.ones(2, 6, dtype=torch.bool)) is None


# ---------------------------------------------------------------- masks -> rows


def _rows_by_loops(mask, sq):
    b, n = mask.shape
    iq, ik, lq, lk = [], [], [], []
    for r in range(b):
        keys = [t for t in range(n) if mask[r, t]]
        queries = [t for t in keys if t >= n - sq]
        ik += [r * n + t for t in keys]
        iq += [r * sq + t - (n - sq) for t in queries]
        lk.append(len(keys))
        lq.append(len(queries))
    holes = any(keys and keys[-1] - keys[0] + 1 != len(keys)
                for keys in ([t for t in range(n) if mask[r, t]] for r in range(b)))
    return iq, ik, lq, lk, holes


def _cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


@pytest.mark.parametrize("case", ["left", "right", "all_pad_row", "holes", "decode", "few_queries", "random"])
def test_padding_rows_match_loops(case):
    g = torch.Generator().manual_seed(hash(case) % 1000)
    n, sq = 11, 11
    mask = torch.ones(5, n, dtype=torch.bool)
    if case == "left":
        for r, pads in enumerate([0, 3, 10, 1, 5]):
            mask[r, :pads] = False
    elif case == "right":
        for r, pads in enumerate([0, 3, 10, 1, 5]):
            mask[r, n - pads:] = False
    elif case == "all_pad_row":
        mask[2] = False
        mask[0, :4] = False
    elif case == "holes":
        mask[1, 4:6] = False
        mask[3, 0] = False
    elif case in ("decode", "few_queries"):
        sq = 1 if case == "decode" else 3
        for r, pads in enumerate([0, 3, 9, 1, 5]):
            mask[r, :pads] = False
    else:
        mask = torch.rand(5, n, generator=g) > 0.4
    rows = hf.padding_rows(mask, sq)
    iq, ik, lq, lk, holes = _rows_by_loops(mask, sq)
    assert rows.index_q.tolist() == iq and rows.index_k.tolist() == ik
    assert rows.cu_q.tolist() == _cu(lq) and rows.cu_k.tolist() == _cu(lk)
    assert rows.cu_q.dtype == rows.cu_k.dtype == torch.int32
    assert (rows.max_q, rows.max_k, rows.holes) == (max(lq), max(lk), holes)


def test_packed_rows_match_loops():
    """New sequences start where a position is not the one before plus one, in every batch row; the
    static form (for torch.compile) has one slot per token and the same sequences, empty ones between."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]])
    cu, most = hf.packed_rows(pos, 2, 10)
    assert cu.tolist() == [0, 3, 5, 10, 18, 20] and most == 8 and cu.dtype == torch.int32
    static, bound = hf.packed_rows(pos, 2, 10, static=True)
    assert static.shape == (21,) and bound == 10 and static.dtype == torch.int32
    lens = (static[1:] - static[:-1]).tolist()
    assert [n for n in lens if n] == [3, 2, 5, 8, 2] and static[0] == 0 and static[-1] == 20
    assert hf.packed_rows(torch.arange(7)[None] + 3, 4, 7) is None  # one sequence per row (offset positions)
    assert hf.packed_rows(torch.zeros(3, 2, 7, dtype=torch.long), 2, 7) is None  # not 2-D: not a packing signal


# ---------------------------------------------------------------- whole models against eager


def _close(a, b, what, tol=2e-4):
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), f"{what}: max error {err}"


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_batches_match_eager(arch, kernels):
    """Right padding (training) and left padding (generation): the logits of the real tokens equal eager's,
    through the varlen path with each row's real lengths (no rows of pads computed); the model's window,
    softcap and sinks reach the kernels."""
    ours, eager = _model(arch)
    lengths = [12, 5, 9, 1]
    for left in (False, True):
        ids, mask = _batch(lengths, 12, left)
        kernels.calls.clear()
        with torch.no_grad():
            got = ours(input_ids=ids, attention_mask=mask, use_cache=False).logits
            want = eager(input_ids=ids, attention_mask=mask, use_cache=False).logits
        real = mask.bool()
        _close(got[real], want[real], f"{arch} {'left' if left else 'right'} padding")
        assert got[~real].isfinite().all()
        layers = ours.config.num_hidden_layers
        assert len(kernels.calls) == layers and all(c["path"] == "varlen" for c in kernels.calls)
        assert all(c["lens_q"] == lengths and c["lens_k"] == lengths and c["max_k"] == 12 for c in kernels.calls)
        _check_variants(arch, ours, kernels.calls)


def test_padding_and_packing_under_inference_mode(kernels):
    """Inference-mode tensors (pipelines run under torch.inference_mode) have no version counter: the rows
    are computed each time, and the answers stay eager's."""
    ours, eager = _model("llama")
    ids, mask = _batch([9, 4], 9, left=True)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]] * 2)
    with torch.inference_mode():
        for _ in range(2):
            got = ours(input_ids=ids, attention_mask=mask, use_cache=False).logits
            _close(got[mask.bool()], eager(input_ids=ids, attention_mask=mask, use_cache=False).logits[mask.bool()],
                   "inference mode, padded")
            packed = ours(input_ids=ids, position_ids=pos, use_cache=False).logits
            _close(packed[:, 4:7], eager(input_ids=ids[:, 4:7], use_cache=False).logits, "inference mode, packed")
    assert [c["path"] for c in kernels.calls] == ["varlen"] * 8


def test_mask_memo_keeps_the_masks_in_use(monkeypatch):
    """A full memo drops the entries of dead tensors, then the least recently used, never a mask still in
    use: two masks used in turn beside seven older live entries are converted once each (emptying the whole
    memo when full converted the first again, as the full suite's leftovers made happen in the test below)."""
    monkeypatch.setattr(hf, "_memo_entries", {})
    older = [torch.ones(2, 3, dtype=torch.bool) for _ in range(hf._MEMO_SIZE - 1)]
    for t in older:
        hf._memo(t, 1, lambda: "older")
    gone = torch.ones(1, 1, dtype=torch.bool)
    hf._memo(gone, 1, lambda: "gone")
    del gone
    made = []
    a, b = torch.ones(2, 12, dtype=torch.bool), torch.ones(2, 12, dtype=torch.bool)
    for mask in (a, b, a, b, a):
        assert hf._memo(mask, 12, lambda m=mask: made.append(m) or id(m)) == id(mask)
    assert len(made) == 2 and made[0] is a and made[1] is b
    assert len(hf._memo_entries) <= hf._MEMO_SIZE
    b.logical_not_()  # an in-place change misses
    hf._memo(b, 12, lambda: made.append(b))
    assert len(made) == 3


def test_layers_share_the_rows_of_one_mask(kernels, monkeypatch):
    """The host reads of a padding mask happen once per mask and forward, not once per layer: Gemma 2's four
    layers use two masks (global and sliding), so two conversions; a new forward converts again."""
    ours, _ = _model("gemma2")
    made = []
    real = hf.padding_rows
    monkeypatch.setattr(hf, "padding_rows", lambda mask, sq: made.append(sq) or real(mask, sq))
    ids, mask = _batch([12, 7], 12, left=False)
    with torch.no_grad():
        for _ in range(2):
            ours(input_ids=ids, attention_mask=mask, use_cache=False)
    assert len(kernels.calls) == 8 and made == [12] * 4


def _check_variants(arch, model, calls):
    """The per-layer options the kernels got: windows (w - 1, 0) on sliding layers, softcap, sinks, scale."""
    cfg = model.config
    types_ = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    for layer, call in enumerate(calls[:cfg.num_hidden_layers]):
        sliding = arch == "mistral" or (arch in ("gemma2", "gpt_oss") and types_[layer] == "sliding_attention")
        assert call["window"] == ((cfg.sliding_window - 1, 0) if sliding else None), (arch, layer, call)
        assert call["softcap"] == (cfg.attn_logit_softcapping if arch == "gemma2" else 0.0)
        assert call["sinks"] == (arch == "gpt_oss")
        assert call["causal"] is True
        assert call["scale"] == model.model.layers[layer].self_attn.scaling
    if arch in ("gemma2", "gpt_oss"):
        assert {c["window"] for c in calls[:cfg.num_hidden_layers]} == {None, (cfg.sliding_window - 1, 0)}


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_sequences_match_one_by_one(arch, kernels):
    """Sequences packed in rows (position_ids restarting at 0, two rows) give the logits of the same
    sequences run one at a time; so do cu_seq_lens_q/k kwargs (transformers' padding-free collator)."""
    ours, eager = _model(arch)
    lengths = [[4, 7, 1], [9, 3]]
    g = torch.Generator().manual_seed(3)
    seqs = [[torch.randint(1, 97, (n,), generator=g) for n in row] for row in lengths]
    ids = torch.stack([torch.cat(row) for row in seqs])
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    with torch.no_grad():
        got = ours(input_ids=ids, position_ids=pos, use_cache=False).logits
        assert all(c["path"] == "varlen" and c["lens_q"] == [4, 7, 1, 9, 3] for c in kernels.calls)
        for r, row in enumerate(seqs):
            at = 0
            for s in row:
                want = eager(input_ids=s[None], use_cache=False).logits[0]
                _close(got[r, at:at + len(s)], want, f"{arch} packed row {r} at {at}")
                at += len(s)
        flat = torch.cat([torch.cat(row) for row in seqs])[None]
        cu = torch.tensor(_cu([4, 7, 1, 9, 3]), dtype=torch.int32)
        kernels.calls.clear()
        got_cu = ours(input_ids=flat, position_ids=pos.reshape(1, -1), use_cache=False, cu_seq_lens_q=cu,
                      cu_seq_lens_k=cu, max_length_q=9, max_length_k=9).logits
        assert all(c["path"] == "varlen" and c["max_q"] == 9 for c in kernels.calls)
        _close(got_cu.reshape(got.shape), got, f"{arch} cu_seq_lens")


def test_packed_static_form_under_compile_matches_eager(kernels, monkeypatch):
    """Under torch.compile the packing read from position_ids takes the static form (one slot per token,
    no host read): the same logits as eager's one by one, also for rows that are one sequence each."""
    ours, eager = _model("gemma2")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    lengths = [[4, 7, 1], [12]]
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(4))
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    with torch.no_grad():
        got = ours(input_ids=ids, position_ids=pos, use_cache=False).logits
    monkeypatch.undo()
    assert all(c["path"] == "varlen" and c["max_q"] == 12 and len(c["lens_q"]) == 24 for c in kernels.calls)
    assert [n for n in kernels.calls[0]["lens_q"] if n] == [4, 7, 1, 12]
    with torch.no_grad():
        for r, row in enumerate(lengths):
            at = 0
            for n in row:
                _close(got[r, at:at + n], eager(input_ids=ids[r:r + 1, at:at + n], use_cache=False).logits[0],
                       f"static packed row {r} at {at}")
                at += n


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt_oss"])
def test_generate_with_left_padding_matches_eager(arch, kernels):
    """Greedy decoding from a left-padded batch with the default cache: the prefill and the decode steps
    (one query against the cache) go through varlen, with each row's real keys (a sliding layer's cache
    keeps the window only: once the pads have slid out of it, its steps are dense), and the tokens are
    eager's."""
    ours, eager = _model(arch)
    ids, mask = _batch([7, 3, 5], 7, left=True, seed=5)
    args = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = ours.generate(**args)
        want = eager.generate(**args)
    assert torch.equal(got, want)
    layers = ours.config.num_hidden_layers
    assert kernels.calls[0]["path"] == "varlen" and kernels.calls[0]["lens_q"] == [7, 3, 5]
    steps = [c for c in kernels.calls if c.get("max_q") == 1 or (c["path"] == "dense" and c["shape"][1] == 1)]
    assert len(steps) == 5 * layers
    last = [c for c in steps if c["path"] == "varlen" and c["lens_k"] == [12, 8, 10]]  # full layers' last step
    window = [c for c in steps if c["path"] == "dense" and c["kv_shape"][1] == 5]  # sliding layers past the pads
    if arch == "llama":
        assert all(c["path"] == "varlen" for c in steps) and len(last) == layers and not window
    else:  # window 5: a sliding layer's cache holds the 4 keys before the new one
        assert len(last) == (1 if arch == "gpt_oss" else 0) and window


def test_unpadded_batch_and_decode_take_the_dense_path(kernels):
    """No padding: flashgen.attention on the tensors as given (GQA 4/2, no repeated K/V), queries after a
    cache aligned bottom-right."""
    ours, eager = _model("qwen2")
    ids = torch.randint(1, 97, (2, 9))
    with torch.no_grad():
        out = ours(input_ids=ids, use_cache=True)
        step = ours(input_ids=ids[:, :2], past_key_values=out.past_key_values).logits
        ref = eager(input_ids=torch.cat([ids, ids[:, :2]], 1)).logits[:, -2:]
    assert [c["path"] for c in kernels.calls] == ["dense"] * 4
    assert kernels.calls[0]["shape"] == (2, 9, 4, 16) and kernels.calls[0]["kv_shape"] == (2, 9, 2, 16)
    assert kernels.calls[-1]["shape"] == (2, 2, 4, 16) and kernels.calls[-1]["kv_shape"] == (2, 11, 2, 16)
    _close(step, ref, "decode after a cache")


def test_decode_steps_past_the_window_without_a_mask(kernels):
    """One sequence decoded token by token past its sliding window with no attention_mask (the sliding
    cache keeps the last keys): each step's logits equal eager's on the whole sequence."""
    ours, eager = _model("mistral")
    ids = torch.randint(1, 97, (1, 11), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = eager(input_ids=ids, use_cache=False).logits[0]
        out = ours(input_ids=ids[:, :4])
        steps = [out.logits[0, -1]]
        for t in range(4, 11):
            out = ours(input_ids=ids[:, t:t + 1], past_key_values=out.past_key_values)
            steps.append(out.logits[0, -1])
    _close(torch.stack(steps[:-1]), want[3:10], "decode steps past the window")
    steps = kernels.calls[2:]  # (after the prompt's two layers) the cache holds the window's last 4 keys
    assert len(steps) == 14 and all(c["path"] == "dense" and c["kv_shape"][1] == 5 for c in steps)


def test_training_gradients_match_eager(kernels):
    """A training step (right padding, labels): the loss and every parameter gradient equal eager's."""
    torch.manual_seed(0)
    cfg = _config("mistral")
    ours = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=hf.register(), dtype=F32).train()
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager",
                                                          dtype=F32).train()
    eager.load_state_dict(ours.state_dict())
    ids, mask = _batch([10, 6, 8], 10, left=False, seed=7)
    labels = ids.masked_fill(mask == 0, -100)
    for model in (ours, eager):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    for (name, p), q in zip(ours.named_parameters(), eager.parameters()):
        _close(p.grad, q.grad, f"grad of {name}", tol=1e-3)


# ---------------------------------------------------------------- meta tensors


@pytest.mark.parametrize("arch", ARCHS)
def test_meta_forward_through_the_real_entry_points(arch, monkeypatch):
    """On device="meta" (model tooling) a bf16 forward runs through flashgen's real entry points' shape-only
    path: logits of the right shape, every layer's call checked and served."""
    seen = []
    real = hf.attention

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append((tuple(out.shape), out.device.type, kwargs.get("window"), kwargs.get("softcap"),
                     kwargs.get("sinks") is not None))
        return out

    monkeypatch.setattr(hf, "attention", spy)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config(arch), attn_implementation=hf.register(),
                                                              dtype=torch.bfloat16)
    ids = torch.zeros(2, 13, dtype=torch.long, device="meta")
    logits = model(input_ids=ids).logits  # (with use_cache=False transformers reads position_ids on the host)
    assert logits.shape == (2, 13, 97) and logits.device.type == "meta"
    assert len(seen) == model.config.num_hidden_layers
    assert all(s[0] == (2, 13, 4, 16) and s[1] == "meta" for s in seen)
    assert any(s[2] == (4, 0) for s in seen) == (arch in ("mistral", "gemma2", "gpt_oss"))
    assert all(s[4] == (arch == "gpt_oss") for s in seen)


def test_meta_call_with_a_mask_and_packing_kwargs():
    """The attention function on meta tensors with a padding mask, or with cu_seq_lens, gives the output shape
    through the entry points' shape-only paths (no values to read)."""
    q = torch.empty(2, 8, 5, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 2, 9, 64, dtype=torch.bfloat16, device="meta")
    mask = torch.empty(2, 9, dtype=torch.bool, device="meta")
    out, weights = hf.attention_forward(CAUSAL, q, k, k, mask, sliding_window=4, s_aux=torch.empty(8, device="meta"))
    assert out.shape == (2, 5, 8, 64) and out.device.type == "meta" and weights is None
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    q1 = torch.empty(1, 8, 10, 64, dtype=torch.bfloat16, device="meta")
    k1 = torch.empty(1, 2, 10, 64, dtype=torch.bfloat16, device="meta")
    out, _ = hf.attention_forward(CAUSAL, q1, k1, k1, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert out.shape == (1, 10, 8, 64)
