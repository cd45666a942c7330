"""GPU tier: the backward's tuned entries (``flashgen tune --kind bwd``) as dispatch serves them.

For every backward key in the tables dispatch reads on this GPU (the user's
``$FLASHGEN_HOME/configs/<gpu>.yaml``, then the shipped one): dispatch picks the
table's spec for that key as the launch path asks for it (``verify=True``, and for a
``bwd_dkdv`` key the dK/dV family the call's tensors need, ``api.backward.dkdv_family``),
the backward launches that spec, and a backward through dispatch at a length in that
key's bucket (odd, GQA 2:1, a masked head-dim tail) meets the gradient rule of
tests/test_gpu_bwd.py (2x the input-dtype reference's error,
``flashgen.reference.grad_tolerance``). Skipped where no table has a backward key.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)"),
]


def _tuned_backward_keys(dev):
    """{key: spec} of every backward entry dispatch can read here (the first table that has it)."""
    from flashgen import tables
    from flashgen.tuner import space

    found = {}
    if dev.gpu is None:
        return found
    for _origin, table in tables.tables(dev.gpu):
        for key, entry in table.entries.items():
            if space.is_backward(key.kind) and key.arch == dev.arch and key not in found:
                found[key] = entry["spec"]
    return found


def test_tuned_backward_entries_are_served_and_correct():
    import flashgen
    from flashgen import dispatch
    from flashgen.api import attention_backward, backward
    from flashgen.api.device import Device
    from flashgen.problem import bucket_of, bwd_head_dim_tile
    from flashgen.reference import grad_tolerance
    from flashgen.tuner import space

    dev = Device.of(torch.cuda.current_device())
    entries = _tuned_backward_keys(dev)
    if not entries:
        pytest.skip(f"no tuned backward entries for {dev.gpu or 'this GPU'}")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    problems = []
    for key in sorted(entries, key=lambda k: (k.kind, k.dtype, k.head_dim, k.causal, k.bucket)):
        spec = entries[key]
        n = key.bucket - 3
        d = key.head_dim - 8 if key.head_dim > 32 else key.head_dim
        assert bucket_of(n) == key.bucket and bwd_head_dim_tile(d, dev.arch) == key.head_dim
        torch.manual_seed(key.bucket + key.head_dim)
        q, dout = (torch.randn(1, 2, n, d, device="cuda", dtype=dtypes[key.dtype]) for _ in range(2))
        k, v = (torch.randn(1, 1, n, d, device="cuda", dtype=dtypes[key.dtype]) for _ in range(2))
        family = backward.dkdv_family(key, (q, k, v, dout)) if key.kind == "bwd_dkdv" else None
        picked = dispatch.select(key, dev.gpu, dev.smem_budget, verify=True, family=family)
        if picked != spec:
            problems.append(f"{space.key_name(key)}: dispatch picks {picked.name}, not the table's {spec.name}")
        out, lse = flashgen.attention(q, k, v, causal=key.causal, return_lse=True)
        grads = attention_backward(dout, q, k, v, out, lse, key.causal, d ** -0.5,
                                   dq_mode=space.BWD_KEY_MODES[key.kind])
        torch.cuda.synchronize()
        ran = backward.last_specs.get(dev.index)  # the dK/dV kernel of that backward
        if key.kind != "bwd_dq" and ran != spec:
            problems.append(f"{space.key_name(key)}: the backward ran {ran.name if ran else None}, not the "
                            f"table's {spec.name}")
        refs, tols = grad_tolerance(q, k, v, dout, key.causal, d ** -0.5)
        for name, got, ref, tol in zip("qkv", grads, refs, tols):
            err = (got.float() - ref).abs().max().item()
            if not err <= tol:
                problems.append(f"{space.key_name(key)} ({spec.name}), n={n}, d={d}: d{name} max error "
                                f"{err:.3e} > {tol:.3e}")
        del q, k, v, dout, out, lse, grads, refs
        torch.cuda.empty_cache()
    assert not problems, "\n".join(problems)
