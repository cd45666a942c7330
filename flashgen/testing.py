"""What tests (and studies) need of flashgen's internals, as public names.

- ``clear_caches()``: forget the tuned tables read, dispatch's cached picks and every plan the torch
  layer keeps, so that a changed table, setting or monkeypatched rule takes effect;
- ``ENVIRONMENT``: every ``FLASHGEN_*`` variable flashgen reads (``flashgen.settings``), for a test
  harness to clear;
- ``plans(entry)``: the plan cache of ``"attention"``, ``"attention_varlen"`` or ``"decode"`` (to look at what a
  call planned);
- ``varlen_work_list(...)``: the work list the device builds for an ``attention_varlen`` call (its
  ``_tiles`` entry alone), to hold against ``families.base.varlen_work``.
"""
from __future__ import annotations

from . import dispatch, settings

ENVIRONMENT = tuple(settings.VARIABLES)


def clear_caches() -> None:
    dispatch.clear()
    try:
        import torch  # noqa: F401 -- the torch layer exists only with torch
    except ImportError:
        return
    from .api import autotune, plans

    plans.clear_all()
    autotune.clear()


def plans(entry: str) -> dict:
    """The plan cache of one torch-layer entry point: "attention" or "decode" (signature -> plan)."""
    import flashgen.api  # noqa: F401 -- the entry points create their caches on import
    from .api import plans as plan_caches

    return plan_caches.cache(entry)


def varlen_work_list(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, seqused_k=None,
                     window=None, spec=None):
    """(pairs, spec): the (sequence, query block) pairs, an int64 (count, 2) CPU tensor in the device's
    order, that ``attention_varlen`` with these arguments would compute, and the spec it would run."""
    import torch

    from .api.checks import set_packed
    from .api.forward import packed_plan
    from .api.device import current_stream

    plan = packed_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, None, seqused_k,
                       window, 0.0, None, None, spec)
    if plan.kernel is None:
        return torch.zeros((0, 2), dtype=torch.int64), None
    work = torch.full((plan.list_ints,), -1, dtype=torch.int32, device=q.device)
    params = plan.params_for(q.data_ptr(), k.data_ptr(), v.data_ptr())
    set_packed(params, cu_seqlens_q, cu_seqlens_k, seqused_k, work)
    plan.kernel.launch_entry("_tiles", 1024, params, current_stream(plan.device_index))
    host = work.to("cpu").long()
    count = int(host[0])
    return host[2:2 + 2 * count].reshape(count, 2), plan.kernel.spec


def padded_batch(lengths, width: int, left: bool, vocab: int, seed: int = 0):
    """(input_ids, attention_mask) on the CPU for sequences of ``lengths`` tokens (random ids in [1, vocab),
    seeded) padded to ``width`` on the left (generation) or the right (training), pads 0 in both."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        where = slice(width - n, width) if left else slice(0, n)
        ids[i, where] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, where] = 1
    return ids, mask
