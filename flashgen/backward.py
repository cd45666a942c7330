"""The backward pass: dQ, dK, dV of ``flashgen.attention`` from its saved tensors.

Four launches on torch's current stream (FlashAttention-2's algorithm):
``bwd_preprocess`` (D = rowsum(dO * O) - dLSE, LSE * log2 e, zeroes the dQ
accumulator), ``bwd_dkdv`` (K/V outer; dQ by fp32 atomics into the
accumulator), ``bwd_convert`` (accumulator * scale -> dQ). With
``deterministic=True`` the dK/dV kernel skips dQ (``bwd_dkdv_nodq``) and a
query-outer ``bwd_dq`` kernel computes dQ without atomics, so the result does
not depend on the order in which blocks run. The non-deterministic backward
uses that pair too for the head dims where it is faster
(``dispatch.BWD_DQ_MODE``).

On sm_90a the dK/dV launch is ``bwd_sm90`` where it serves the call (TMA +
wgmma, dQ by the TMA's reduce-add into the same accumulator; head-dim tiles 64
and 128, dQ by atomics, strides the TMA can step; ``dispatch.BACKWARD_FAMILIES``,
``dispatch.default_backward_family``): measured 1.6-1.9x the mma.sync kernel's
backward on the H200. ``FLASHGEN_BWD_FAMILY=bwd_dkdv`` (or ``=bwd_sm90``) forces
one family for study; ``specs={"bwd_dkdv": <KernelSpec>}`` forces one kernel.

Used by the autograd op in ``flashgen.autograd``; callable directly for study.
"""
from __future__ import annotations

import math
import os

import torch

from . import dispatch
from .api import _DTYPES, _Device, _current_device, _current_stream, _dims
from .bwd_families import ROW_PAD


def _ok_for_kernel(t: torch.Tensor, layout: str) -> bool:
    """Contiguous last dim, 16-byte aligned start and row strides (the kernels' 16-byte loads)."""
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    return all(s % 8 == 0 for s in _dims(t, layout)[1])


def _tma_ok(t: torch.Tensor) -> bool:
    """The TMA's rules for a tensor map: 16-byte aligned start, byte strides multiples of 16
    (stricter than _ok_for_kernel only for strides of size-1 dims, which tma.tensor_dims repacks)."""
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 or n == 1
                                          for s, n in zip(t.stride()[:-1], t.shape[:-1]))


# The dK/dV kernel spec of the last backward launched per device (study and tests: which family ran).
last_specs: dict = {}


def _spec(kind: str, dev, dtype: str, d_tile: int, causal: bool, nq: int, specs=None):
    if specs and kind in specs:
        return specs[kind]
    key = dispatch.ProblemKey(kind, dev.arch, dtype, d_tile, causal, dispatch.bucket_of(nq))
    return dispatch.select(key, dev.gpu, dev.smem_budget, verify=True)


BWD_FAMILY_ENV = "FLASHGEN_BWD_FAMILY"


def dkdv_family(arch: str, d_tile: int, separate: bool) -> str | None:
    """The family the dK/dV launch must be of: "bwd_dkdv" where bwd_sm90 cannot serve the call
    (not sm_90a, a head-dim tile it lacks, dQ in the separate kernel) or ``FLASHGEN_BWD_FAMILY=bwd_dkdv``
    asks for it; "bwd_sm90" when ``FLASHGEN_BWD_FAMILY=bwd_sm90`` asks and it serves; None: dispatch's
    pick (tuned table, else the default rule: bwd_sm90 where it serves)."""
    want = os.environ.get(BWD_FAMILY_ENV, "").strip()
    if want and want not in dispatch.BACKWARD_FAMILIES["bwd_dkdv"]:
        raise ValueError(f"{BWD_FAMILY_ENV} must be one of {dispatch.BACKWARD_FAMILIES['bwd_dkdv']}, got {want!r}")
    if separate or dispatch.default_backward_family(arch, d_tile) != "bwd_sm90":
        return "bwd_dkdv"
    return want or None


def _sm90_maps(kern, params, shapes, tensors):
    """Write bwd_sm90's five tensor maps into its parameter block (built by the driver, cached per
    address/shape/strides in flashgen.tma). ``shapes``: (b, h, hk, nq, nk, d, D); ``tensors``:
    name -> (data_ptr, element strides (batch, head, seq)) for q, k, v, dout and the fp32 dq_acc."""
    import ctypes

    from . import tma

    b, h, hk, nq, nk, d, D = shapes
    spec = kern.spec
    struct = type(params)
    base = ctypes.addressof(params)
    rows = {"q": (nq, h, spec.block_m), "dout": (nq, h, spec.block_m), "k": (nk, hk, spec.block_n),
            "v": (nk, hk, spec.block_n)}
    for name, field in (("q", "tm_q"), ("k", "tm_k"), ("v", "tm_v"), ("dout", "tm_do")):
        ptr, st = tensors[name]
        n, heads, box = rows[name]
        dims, strides = tma.tensor_dims(d, n, heads, b, st[::-1])
        ctypes.memmove(base + getattr(struct, field).offset, tma.encode(ptr, spec.dtype, dims, strides, (64, box, 1, 1)),
                       128)
    ptr, st = tensors["dq_acc"]
    dims, strides = tma.tensor_dims(D, nq, h, b, st[::-1], elem_bytes=4)
    ctypes.memmove(base + struct.tm_dq.offset, tma.encode(ptr, "fp32", dims, strides, (32, spec.block_m, 1, 1)), 128)


def attention_backward(dout, q, k, v, out, lse, causal: bool, softmax_scale: float, layout: str = "bhsd",
                       deterministic: bool = False, dlse=None, dq_mode: str | None = None, specs=None):
    """(dq, dk, dv) for ``out, lse = attention(q, k, v, causal, softmax_scale, layout, return_lse=True)``.

    q, k, v, out, lse are the forward's inputs and outputs (already checked by
    it); ``dout`` is the gradient of ``out`` (any strides; copied only when its
    last dimension is not contiguous or its rows are not 16-byte aligned),
    ``dlse`` the optional gradient of ``lse``. The gradients come back
    contiguous in the shapes (and layout) of q, k, v; dK and dV are summed over
    each KV head's group of query heads (GQA).

    For study and tuning (bench/sweep_bwd.py): ``dq_mode`` ("atomic" or
    "separate", see ``dispatch.BWD_DQ_MODE``; default: the dispatch rule, and
    always "separate" when deterministic) and ``specs``, a dict kind ->
    KernelSpec that replaces dispatch's choice for those kinds.
    """
    if dout.shape != q.shape:
        raise ValueError(f"dout must have the shape of q {tuple(q.shape)}, got {tuple(dout.shape)}")
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    if not _ok_for_kernel(dout, layout):
        dout = dout.contiguous()
    (b, h, nq, d), sq = _dims(q, layout)
    (_, hk, nk, _), sk = _dims(k, layout)
    sv = _dims(v, layout)[1]
    so = _dims(out, layout)[1]
    sdo = _dims(dout, layout)[1]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if not (b and h and nq and nk):
        return dq.zero_(), dk.zero_(), dv.zero_()
    sdq, sdk, sdv = (_dims(t, layout)[1] for t in (dq, dk, dv))

    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    dev = _Device.of(index)
    dtype = _DTYPES[q.dtype]
    d_tile = dispatch.bwd_head_dim_tile(d)
    nq_pad = -(-nq // ROW_PAD) * ROW_PAD
    lse = lse.contiguous()
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    dsum = torch.empty((b, h, nq_pad), dtype=torch.float32, device=q.device)
    lse2 = torch.empty((b, h, nq_pad), dtype=torch.float32, device=q.device)
    forced = specs.get("bwd_dkdv") if specs else None
    if forced is not None and forced.kind == "bwd_sm90":
        # The Hopper kernel always adds dQ into the accumulator (no separate mode).
        if deterministic or dq_mode == "separate":
            raise ValueError("a bwd_sm90 spec computes dQ by atomic adds: not with deterministic=True or "
                             "dq_mode='separate'")
        if forced.head_dim != d_tile:
            raise ValueError(f"spec {forced.name} has head-dim tile {forced.head_dim}, this call needs {d_tile}")
        dq_mode = "atomic"
    if deterministic:
        dq_mode = "separate"
    elif dq_mode is None:
        dq_mode = dispatch.bwd_dq_mode(d_tile)
    elif dq_mode not in dispatch.BWD_DQ_MODES:
        raise ValueError(f"dq_mode must be one of {dispatch.BWD_DQ_MODES}, got {dq_mode!r}")
    if forced is not None:
        kv_spec = forced
    elif dq_mode == "separate":
        kv_spec = None  # bwd_dkdv_nodq, below
    else:
        family = dkdv_family(dev.arch, d_tile, False)
        if family != "bwd_dkdv" and not all(_tma_ok(t) for t in (q, k, v, dout)):
            family = "bwd_dkdv"  # strides the TMA cannot step (a forced spec: the map encoder says why)
        key = dispatch.ProblemKey("bwd_dkdv", dev.arch, dtype, d_tile, causal, dispatch.bucket_of(nq))
        kv_spec = (dispatch.select(key, dev.gpu, dev.smem_budget, verify=True) if family is None else
                   dispatch.select_family(key, family, dev.gpu, dev.smem_budget, verify=True))
    kv_kind = kv_spec.kind if kv_spec is not None else "bwd_dkdv"
    if kv_kind == "bwd_dkdv" and dq_mode == "atomic" and b * h * nq * d_tile >= 2**32:
        # bwd_dkdv addresses the fp32 dQ accumulator by 32-bit element offsets.
        dq_mode = "separate"
    separate = dq_mode == "separate"
    dq_acc = None if separate else torch.empty((b, h, nq, d_tile), dtype=torch.float32, device=q.device)
    scale = float(softmax_scale)
    common = dict(nq=nq, nk=nk, nq_pad=nq_pad, heads=h, group=h // hk, d=d, scale=scale,
                  scale_log2=scale * math.log2(math.e))
    strides = lambda name, s: {f"{name}_sb": s[0], f"{name}_sh": s[1], f"{name}_ss": s[2]}  # noqa: E731

    from .codegen import load

    launches = []
    pre = load(_spec("bwd_preprocess", dev, dtype, d_tile, False, nq, specs), index)
    launches.append((pre, (nq_pad // pre.spec.block_m, h, b), pre.params(
        o=out.data_ptr(), dout=dout.data_ptr(), lse=lse.data_ptr(), dlse=dlse.data_ptr() if dlse is not None else 0,
        dsum=dsum.data_ptr(), lse2=lse2.data_ptr(), dq_acc=dq_acc.data_ptr() if dq_acc is not None else 0,
        **strides("o", so), **strides("dout", sdo), nq=nq, nq_pad=nq_pad, heads=h, d=d)))

    if kv_kind == "bwd_sm90":
        kv = load(kv_spec, index)
        params = kv.params(lse2=lse2.data_ptr(), dsum=dsum.data_ptr(), dq_acc=dq_acc.data_ptr(), dk=dk.data_ptr(),
                           dv=dv.data_ptr(), **strides("dk", sdk), **strides("dv", sdv), **common)
        _sm90_maps(kv, params, (b, h, hk, nq, nk, d, d_tile), {
            "q": (q.data_ptr(), sq), "k": (k.data_ptr(), sk), "v": (v.data_ptr(), sv), "dout": (dout.data_ptr(), sdo),
            "dq_acc": (dq_acc.data_ptr(), (h * nq * d_tile, nq * d_tile, d_tile))})
        launches.append((kv, (-(-nk // kv.spec.block_n), hk, b), params))
    else:
        kv = load(_spec("bwd_dkdv_nodq", dev, dtype, d_tile, causal, nq, specs) if separate else kv_spec, index)
        launches.append((kv, (-(-nk // kv.spec.block_n), hk, b), kv.params(
            q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), dout=dout.data_ptr(), lse2=lse2.data_ptr(),
            dsum=dsum.data_ptr(), dq_acc=dq_acc.data_ptr() if dq_acc is not None else 0, dk=dk.data_ptr(),
            dv=dv.data_ptr(), **strides("q", sq), **strides("k", sk), **strides("v", sv), **strides("dout", sdo),
            **strides("dk", sdk), **strides("dv", sdv), **common)))
    last_specs[index] = kv.spec

    if separate:
        dqk = load(_spec("bwd_dq", dev, dtype, d_tile, causal, nq, specs), index)
        launches.append((dqk, (-(-nq // dqk.spec.block_m), h, b), dqk.params(
            q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), dout=dout.data_ptr(), lse2=lse2.data_ptr(),
            dsum=dsum.data_ptr(), dq=dq.data_ptr(), **strides("q", sq), **strides("k", sk), **strides("v", sv),
            **strides("dout", sdo), **strides("dq", sdq), **common)))
    else:
        cv = load(_spec("bwd_convert", dev, dtype, d_tile, False, nq, specs), index)
        launches.append((cv, (-(-nq // cv.spec.block_m), h, b), cv.params(
            dq_acc=dq_acc.data_ptr(), dq=dq.data_ptr(), **strides("dq", sdq), nq=nq, heads=h, d=d, scale=scale)))

    if index == _current_device():
        stream = _current_stream(index)
        for kern, grid, params in launches:
            kern.launch(grid, params, stream)
    else:
        with torch.cuda.device(index):
            stream = _current_stream(index)
            for kern, grid, params in launches:
                kern.launch(grid, params, stream)
    return dq, dk, dv
