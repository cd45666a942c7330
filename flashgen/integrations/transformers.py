"""flashgen as an attention implementation of Hugging Face transformers (5.x).

    import flashgen.integrations.transformers as flashgen_hf

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 attn_implementation=flashgen_hf.register())
    model.set_attn_implementation(flashgen_hf.register())   # or switch a model already built

``register()`` adds ``NAME`` to transformers' ``AttentionInterface`` (the attention function,
``attention_forward``) and to ``AttentionMaskInterface`` (``padding_mask``: the models then hand the
attention function the 2-D padding mask, as they do for flash attention, never a dense 4-D mask).

The name is ``"fgen"``, not ``"flashgen"``: transformers treats every implementation whose name contains
"flash" as a flash-attention package (``is_flash_attention_requested`` is a substring test) and, when a
model is built or switched, tries to import that package or a Hub kernel of that name
(``lazy_import_flash_attention``), which fails for a name it only finds in ``AttentionInterface``.
A name without "flash" takes transformers' documented path for custom attention functions, on 5.x as
it stands and without touching transformers' private state.

Registration is explicit: ``import flashgen`` does not import transformers (a heavy import that flashgen,
which even defers torch, should not impose) and does not change another library's global tables as a
side effect; transformers' own documentation registers custom attention functions with an explicit
``AttentionInterface.register`` call, and kernel libraries follow it.

What the attention function does with what the models pass (query/key/value ``(batch, heads, seqlen, d)``):

- no padding: ``flashgen.attention`` on the tensors as they are (GQA without repeating K/V, no copies);
- a padding mask (left padding in generation, right padding in training, rows of pads only): the real
  tokens go to ``flashgen.attention_varlen`` as packed rows, so nothing is computed on padding; padded
  query rows get zeros (flash attention's convention; transformers' eager path gives them garbage);
- packed sequences: ``cu_seq_lens_q/k`` (+ ``max_length_q/k``) keyword arguments (transformers'
  padding-free collator), or, without a padding mask and without cached keys, ``position_ids`` that
  do not count up by one (a new sequence starts where ``position_ids[t] != position_ids[t - 1] + 1``,
  the rule of transformers' mask functions; in every batch row, not only batch size 1);
- ``sliding_window=w`` (causal): ``window=(w - 1, 0)``: the query at position i sees keys i - w + 1 .. i
  (transformers' ``kv_idx > q_idx - sliding_window``); ``softcap``; ``s_aux`` (gpt-oss's sinks);
  ``scaling``; ``is_causal``; a decoding step (one or a few queries against a cache) is the same call.

It refuses, with ``flashgen.UnsupportedError`` naming the option, what it cannot serve exactly:
attention dropout > 0 (a model in training mode with ``attention_dropout`` > 0),
``output_attentions=True``, a 4-D or float (additive) attention mask, a padding mask on
cross-attention, a position bias, custom mask functions on top of the causal mask
(``or_mask_function``/``and_mask_function``, ``block_sequence_ids``), chunked attention, a
bidirectional sliding window, a padding mask with holes inside a sequence together with a sliding
window, a static cache without an attention mask, and float32 inputs outside ``torch.autocast``.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..api import attention, attention_varlen
from ..errors import UnsupportedError

NAME = "fgen"
# The input dtypes the kernels take (the CPU tests widen it to float32, with torch references standing in
# for the kernels).
DTYPES = (torch.float16, torch.bfloat16)

# Keyword arguments some models pass that change the scores; ignoring them would give a wrong answer.
REFUSED_KWARGS = {
    "position_bias": "an additive position bias (T5-style relative attention)",
    "head_mask": "a head mask",
    "indices": "sparse attention's selected key indices",
    "block_indices": "sparse attention's selected key blocks",
}


def register() -> str:
    """Register flashgen with transformers (idempotent) and return the name to pass as
    ``attn_implementation``: ``NAME`` ("fgen"). ImportError without transformers 5."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError("flashgen.integrations.transformers needs transformers 5 (AttentionInterface and "
                          "AttentionMaskInterface): pip install 'transformers>=5'") from e
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, padding_mask)
    return NAME


def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                 use_vmap=False, config=None, **kwargs):
    """transformers' mask function for ``NAME``: what its mask builders (``create_causal_mask`` and the
    sliding-window one) hand the attention function: None without padding, else the bool padding mask
    (batch, keys), sliced to the keys of the layer (transformers' ``flash_attention_mask``).

    Raises UnsupportedError for masks that are more than causal + window + padding + packing (which the
    attention function serves): custom mask functions, block-wise (bidirectional-group) overlays,
    chunked attention, and a cache with key slots past the queries (a static cache) without a mask."""
    from transformers.masking_utils import flash_attention_mask

    if use_vmap:  # transformers sets it when a model combines the causal mask with its own mask function
        raise UnsupportedError(f"attn_implementation={NAME!r}: the model adds a custom mask function to the causal "
                               "mask (or_mask_function/and_mask_function, e.g. bidirectional attention over image "
                               "tokens); flashgen serves causal, sliding-window, padding and packed masks only: use "
                               "attn_implementation='sdpa' for this model")
    if getattr(mask_function, "__qualname__", "").startswith("or_masks"):
        raise UnsupportedError(f"attn_implementation={NAME!r}: the mask widens the causal mask (block_sequence_ids or "
                               "an or_mask_function overlay); flashgen serves causal, sliding-window, padding and "
                               "packed masks only: use attn_implementation='sdpa' for this model")
    if getattr(config, "attention_chunk_size", None):
        raise UnsupportedError(f"attn_implementation={NAME!r}: chunked attention (config.attention_chunk_size) is not "
                               "supported")
    if attention_mask is None:
        if isinstance(q_offset, torch.Tensor) or kv_offset + kv_length != q_offset + q_length:
            raise UnsupportedError(f"attn_implementation={NAME!r}: the cache has key slots past the queries (a static "
                                   "cache) and there is no attention_mask to say which are filled: pass "
                                   "attention_mask (generate does)")
        return None
    return flash_attention_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                                kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """The attention function transformers calls for ``NAME``: query (batch, heads, seqlen_q, d), key and
    value (batch, heads_kv, seqlen_k, d), ``attention_mask`` from ``padding_mask`` (None or bool
    (batch, keys)); returns (output (batch, seqlen_q, heads, d), None). The module's docstring lists what
    it serves and what it refuses (UnsupportedError, before anything runs)."""
    if kwargs.get("output_attentions"):
        raise UnsupportedError(f"attn_implementation={NAME!r} does not return attention weights "
                               "(output_attentions=True): use attn_implementation='eager' for them")
    for name, what in REFUSED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise UnsupportedError(f"attn_implementation={NAME!r} does not support {name} ({what})")
    if dropout:
        raise UnsupportedError(f"attn_implementation={NAME!r} has no attention dropout (got dropout={dropout}: the "
                               "model is in training mode with attention_dropout > 0); set config.attention_dropout "
                               "= 0.0 or use attn_implementation='sdpa'")
    causal = bool(module.is_causal if is_causal is None else is_causal)
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive int, got {sliding_window!r}")
        if not causal:
            raise UnsupportedError(f"attn_implementation={NAME!r}: a bidirectional (non-causal) sliding window is not "
                                   "supported (transformers' eager and flash paths disagree on its width)")
    if value.shape[-1] != query.shape[-1]:
        raise UnsupportedError(f"attn_implementation={NAME!r}: value head dim {value.shape[-1]} differs from the "
                               f"query's {query.shape[-1]}")
    q, k, v = _half(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))  # (batch, seqlen, heads, d)
    options = {"softmax_scale": scaling, "softcap": float(softcap) if softcap else 0.0,
               "sinks": None if s_aux is None else s_aux if s_aux.dtype in (torch.float32, q.dtype) else s_aux.float(),
               "deterministic": bool(kwargs.get("deterministic") or False)}
    b, sq = q.shape[0], q.shape[1]
    if attention_mask is not None:
        mask = _checked_mask(attention_mask, b, sq, k.shape[1])
        if not causal and mask.shape[1] != sq:
            raise UnsupportedError(f"attn_implementation={NAME!r}: a padding mask on non-causal attention whose keys "
                                   f"({mask.shape[1]}) are not its queries ({sq}) (cross-attention) is not supported")
        k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]  # a static cache's slots past the mask are empty
        if q.is_meta:  # shapes only: the same call without the mask (its values decide nothing about shapes)
            return attention(q, k, v, causal, layout="bshd", window=_window(sliding_window, k.shape[1]),
                             **options), None
        return _padded(q, k, v, mask, causal, sliding_window, options), None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        return _packed_by_cu(q, k, v, cu_q, cu_k, kwargs.get("max_length_q"), kwargs.get("max_length_k"), causal,
                             sliding_window, options), None
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and sq == k.shape[1] and sq > 1 and not q.is_meta:
        rows = _packed_rows(position_ids, b, sq)
        if rows is not None:
            cu, most = rows
            out = attention_varlen(q.reshape(b * sq, *q.shape[2:]), k.reshape(b * sq, *k.shape[2:]),
                                   v.reshape(b * sq, *v.shape[2:]), cu, cu, most, most, causal,
                                   window=_window(sliding_window, most), check_values=False, **options)
            return out.view(q.shape), None
    return attention(q, k, v, causal, layout="bshd", window=_window(sliding_window, k.shape[1]), **options), None


def _window(sliding_window, longest_k):
    """flashgen's window for transformers' causal ``sliding_window`` (None: none, or it hides nothing
    because no sequence has keys that far back)."""
    if sliding_window is None or longest_k <= sliding_window:
        return None
    return (sliding_window - 1, 0)


def _half(q, k, v):
    """q, k, v in fp16/bf16: as they are, or cast to torch.autocast's dtype; TypeError otherwise."""
    if q.dtype in DTYPES and k.dtype == v.dtype == q.dtype:
        return q, k, v
    device = q.device.type
    if q.dtype == torch.float32 and device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if dtype in (torch.float16, torch.bfloat16):
            return q.to(dtype), k.to(dtype), v.to(dtype)
    raise TypeError(f"attn_implementation={NAME!r} runs float16 or bfloat16 attention, got query/key/value of "
                    f"{q.dtype}/{k.dtype}/{v.dtype}: load the model with dtype=torch.bfloat16 (or float16), or run "
                    "it under torch.autocast")


def _checked_mask(mask, batch: int, sq: int, sk: int):
    """The 2-D padding mask as bool (batch, keys); UnsupportedError for dense or additive masks."""
    if not isinstance(mask, torch.Tensor):
        raise UnsupportedError(f"attn_implementation={NAME!r} takes a 2-D padding mask, got a "
                               f"{type(mask).__name__} (a mask built for another attention implementation?)")
    if mask.dim() != 2:
        raise UnsupportedError(f"attn_implementation={NAME!r} takes a 2-D padding mask (batch, keys), got a "
                               f"{mask.dim()}-D attention mask of shape {tuple(mask.shape)} (a dense mask built "
                               "outside transformers' mask functions); pass the 2-D padding mask instead")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise UnsupportedError(f"attn_implementation={NAME!r} takes a boolean padding mask, got a {mask.dtype} "
                               "(additive) mask")
    if mask.shape[0] != batch or not sq <= mask.shape[1] <= sk:
        raise ValueError(f"the padding mask's shape {tuple(mask.shape)} does not fit batch {batch}, {sq} queries and "
                         f"{sk} keys")
    return mask if mask.dtype == torch.bool else mask != 0


@dataclass(frozen=True)
class Rows:
    """Where the real tokens of a padded batch are: flat indices into (batch * seqlen) of the queries
    (the last seqlen_q positions of the mask) and keys, their cu_seqlens (int32, batch + 1), the longest
    query and key runs, and whether some row's real tokens have a pad between them."""
    index_q: torch.Tensor
    index_k: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    holes: bool


def padding_rows(mask, sq: int) -> Rows:
    """``Rows`` of a bool padding mask (batch, keys) whose last ``sq`` positions are the queries. The real
    queries of a row are its last real keys, so varlen's bottom-right causal alignment per sequence is the
    mask's causal order. Two host syncs (the lengths, then the indices)."""
    b, n = mask.shape
    mask_q = mask[:, n - sq:]
    lens_k = mask.sum(1, dtype=torch.int32)
    lens_q = lens_k if sq == n else mask_q.sum(1, dtype=torch.int32)
    first = mask.to(torch.uint8).argmax(1)
    last = n - 1 - mask.flip(1).to(torch.uint8).argmax(1)
    holes = ((last - first + 1 != lens_k) & (lens_k > 0)).any()
    max_q, max_k, holes = torch.stack([lens_q.max(), lens_k.max(), holes.to(torch.int32)]).tolist()
    index_k = mask.reshape(-1).nonzero().squeeze(1)
    index_q = index_k if sq == n else mask_q.reshape(-1).nonzero().squeeze(1)
    cu_k = torch.nn.functional.pad(lens_k.cumsum(0, dtype=torch.int32), (1, 0))
    cu_q = cu_k if sq == n else torch.nn.functional.pad(lens_q.cumsum(0, dtype=torch.int32), (1, 0))
    return Rows(index_q, index_k, cu_q, cu_k, int(max_q), int(max_k), bool(holes))


def _padded(q, k, v, mask, causal, sliding_window, options):
    b, sq, h, d = q.shape
    n = mask.shape[1]
    rows = _memo(mask, sq, lambda: padding_rows(mask, sq))
    if sliding_window is not None and rows.holes and rows.max_k > sliding_window:
        raise UnsupportedError(f"attn_implementation={NAME!r}: a padding mask with pads between a row's real tokens "
                               "and a sliding window (the window would count real tokens, transformers' eager path "
                               "counts positions); pad on one side only")
    qp = q[rows.index_q // sq, rows.index_q % sq]  # (real queries, heads, d): one gather, no copy of the batch
    kp = k[rows.index_k // n, rows.index_k % n]
    vp = v[rows.index_k // n, rows.index_k % n]
    out = attention_varlen(qp, kp, vp, rows.cu_q, rows.cu_k, rows.max_q, rows.max_k, causal,
                           window=_window(sliding_window, rows.max_k), check_values=False, **options)
    full = out.new_zeros(b * sq, h, d).index_copy(0, rows.index_q, out)  # padded query rows: zeros
    return full.view(b, sq, h, d)


def packed_rows(position_ids, batch: int, seqlen: int, static: bool = False):
    """(cu_seqlens int32, longest sequence) of the packed sequences that ``position_ids`` (batch or 1,
    seqlen) mark, every batch row split where a position is not the one before plus one; None when each
    row is one sequence. ``static`` (for torch.compile): no host sync and a shape that depends on no
    value: one slot per token (batch * seqlen + 1 entries, most of them empty sequences), longest =
    seqlen, never None."""
    if position_ids.dim() != 2 or position_ids.shape[1] != seqlen or position_ids.shape[0] not in (1, batch):
        return None  # (e.g. multimodal rotary position ids, (3, batch, seqlen)): not a packing signal
    pos = position_ids.expand(batch, seqlen)
    starts = torch.ones(batch, seqlen, dtype=torch.bool, device=pos.device)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    flat = starts.reshape(-1)
    total = batch * seqlen
    if static:  # cu[i] = the first sequence start at or after token i: slot i holds the sequence starting there
        slots = torch.arange(total + 1, device=pos.device)
        first = torch.where(torch.cat([flat, flat.new_ones(1)]), slots, total)
        return first.flip(0).cummin(0).values.flip(0).to(torch.int32), seqlen
    index = flat.nonzero().squeeze(1)
    if index.shape[0] == batch:
        return None
    cu = torch.cat([index, index.new_full((1,), total)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _packed_rows(position_ids, batch: int, seqlen: int):
    if torch.compiler.is_compiling():
        return packed_rows(position_ids, batch, seqlen, static=True)
    return _memo(position_ids, (batch, seqlen), lambda: packed_rows(position_ids, batch, seqlen))


def _packed_by_cu(q, k, v, cu_q, cu_k, max_q, max_k, causal, sliding_window, options):
    if cu_q is None or cu_k is None:
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k must be given together")
    b, sq, h, d = q.shape
    compiling = torch.compiler.is_compiling() or q.is_meta  # (neither reads values on the host)
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    max_q = _longest(max_q, cu_q, sq * b, compiling)
    max_k = _longest(max_k, cu_k, k.shape[0] * k.shape[1], compiling)
    out = attention_varlen(q.reshape(b * sq, h, d), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
                           cu_q, cu_k, max_q, max_k, causal, window=_window(sliding_window, max_k), **options)
    return out.view(b, sq, h, d)


def _longest(given, cu, bound: int, compiling: bool) -> int:
    """A packed call's max_seqlen: the given int, else (a tensor or None) read from cu_seqlens, or the
    packed length under torch.compile (an upper bound, which needs no host read)."""
    if isinstance(given, int) and not isinstance(given, bool):
        return given
    if compiling:
        return bound
    if isinstance(given, torch.Tensor):
        return int(given)
    return int((cu[1:] - cu[:-1]).max()) if cu.shape[0] > 1 else 0


# One forward hands every layer the same mask (and position_ids) tensor: its rows are computed once.
# Keyed by the tensor's id, checked against a weak reference (a dead or different tensor misses) and
# its version counter (an in-place change misses); an inference-mode tensor has no version counter, so
# its rows are computed every time. At most _MEMO_SIZE entries: a new one first drops those whose tensor
# is gone, then the least recently used (emptying the whole memo could drop the other mask of a forward
# in use, Gemma 2's global one between two sliding layers, and convert it again).
_memo_entries: dict = {}
_MEMO_SIZE = 8


def _memo(tensor, extra, build):
    if tensor.is_inference():
        return build()
    key = (id(tensor), extra)
    hit = _memo_entries.pop(key, None)
    if hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
        _memo_entries[key] = hit  # (the most recently used last)
        return hit[2]
    value = build()
    if len(_memo_entries) >= _MEMO_SIZE:
        for dead in [k for k, e in _memo_entries.items() if e[0]() is None]:
            del _memo_entries[dead]
        while len(_memo_entries) >= _MEMO_SIZE:
            del _memo_entries[next(iter(_memo_entries))]
    _memo_entries[key] = (weakref.ref(tensor), tensor._version, value)
    return value
