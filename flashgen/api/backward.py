"""The backward pass: dQ, dK, dV of ``flashgen.attention`` from its saved tensors.

Four launches on torch's current stream (FlashAttention-2's algorithm,
families/bwd.py): ``bwd_preprocess`` (D = rowsum(dO * O) - dLSE, LSE * log2 e,
zeroes the dQ accumulator), the dK/dV kernel (K/V outer; dQ by fp32 atomics
into the accumulator), ``bwd_convert`` (accumulator * scale -> dQ). With
``deterministic=True`` (or with ``torch.use_deterministic_algorithms(True)`` on)
the result does not depend on the order in which blocks run: where ``bwd_sm90``
serves the call its ``det`` twin adds dQ in a fixed order (a turn counter per query
block, templates/bwd_sm90; above d = 128 through dq_write 4's one staging tile,
dispatch.deterministic_twin); elsewhere the dK/dV kernel skips dQ
(``bwd_dkdv_nodq``) and a query-outer ``bwd_dq`` kernel computes dQ without
atomics. The non-deterministic backward uses that pair too for the
head dims where it is faster (``bwd.DQ_MODE``).

The dK/dV kernel is the ``bwd_dkdv`` problem's pick: on sm_90a ``bwd_sm90``
where it serves the call (TMA + wgmma, dQ into the same accumulator; head-dim
tiles 32, 64, 96, 128, 192 and 256, head dims 129-160 on the 192 tile; strides
its tensor maps can step), else the mma.sync ``bwd_dkdv``.
``FLASHGEN_BWD_FAMILY=bwd_dkdv`` (or ``=bwd_sm90``) forces one family for study;
``specs={"bwd_dkdv": <KernelSpec>}`` forces one kernel.

Used by ``flashgen.api.autograd`` (the custom op, and its eager path); callable directly for study.
"""
from __future__ import annotations

import functools
import warnings

import torch

from .. import dispatch, families, settings, shapes
from ..codegen import load
from ..codegen.launch import ensure_context
from ..families import bwd
from ..families.base import stride_values, varlen_list_ints
from ..families.bwd_sm90 import det_rotation
from ..problem import ProblemKey, bucket_of, bwd_head_dim_tile
from ..errors import UnsupportedError
from ..variants import PLAIN
from .checks import DTYPES, dims, set_packed, variant_tensors
from .device import Device, index_of, launch_all

# The dK/dV kernel spec of the last backward launched per device (study and tests: which family ran).
last_specs: dict = {}


def _ok_for_kernel(t: torch.Tensor, layout: str) -> bool:
    """Contiguous last dim, 16-byte aligned start and row strides (the kernels' 16-byte loads)."""
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    return all(s % 8 == 0 for s in dims(t, layout)[1])


def _tma_ok(t: torch.Tensor) -> bool:
    """The TMA's rules for a tensor map: 16-byte aligned start, positive byte strides that are multiples of
    16 (a stride-0 dimension, an expanded tensor, cannot be stepped by a map; size-1 dims are repacked by
    tma.tensor_dims)."""
    return t.data_ptr() % 16 == 0 and all(n == 1 or (s > 0 and s * t.element_size() % 16 == 0)
                                          for s, n in zip(t.stride()[:-1], t.shape[:-1]))


def _select(kind: str, dev, dtype: str, d_tile: int, causal: bool, nq: int, specs=None, variant: str = ""):
    if specs and kind in specs:
        return specs[kind]
    key = ProblemKey(kind, dev.arch, dtype, d_tile, causal, bucket_of(nq), variant)
    return dispatch.select(key, dev.gpu, dev.smem_budget, verify=True)


def dkdv_family(key: ProblemKey, tensors=()) -> str | None:
    """The family the dK/dV launch of ``key`` (a ``bwd_dkdv`` key) must be of, or None for dispatch's
    pick (tuned table, else the default rule). ``FLASHGEN_BWD_FAMILY`` forces one where it serves;
    the problem's fallback (the mma.sync kernel) serves where the default family is not the one the
    rule takes for the key, or where a tensor of ``tensors`` has strides its tensor maps cannot step."""
    want = settings.bwd_family()
    kinds = families.PROBLEMS["bwd_dkdv"]
    if want is not None and want not in kinds:
        raise ValueError(f"FLASHGEN_BWD_FAMILY must be one of {kinds}, got {want!r}")
    fallback = families.fallback_family("bwd_dkdv", key.arch)
    if families.default_family(key) == fallback:
        return fallback
    if not all(_tma_ok(t) for t in tensors):
        return fallback  # strides the TMA cannot step (a forced spec: the map encoder says why)
    return want


class _TilesFirst:
    """A launch list's entry for a varlen kernel's work-list builder (its module's ``_tiles`` entry, one CTA
    of 1024 threads, common/varlen.cuh), queued just before the kernel with the kernel's parameters."""

    def __init__(self, kern):
        self.kern = kern

    def launch(self, grid, params, stream) -> None:
        self.kern.launch_entry("_tiles", 1024, params, stream)


def _queue(launches, kern, grid, params, packed, rows: int):
    """Append ``kern``'s launch to ``launches``; with ``packed`` (cu_q, cu_k, used_k, seqs), first its
    work-list builder, with the sequence pointers and a fresh list (bound: ``rows`` packed rows in blocks
    of the kernel's tile) in the parameters. Returns the list's tensor (the caller keeps it alive until
    the launches are queued), or None."""
    work = None
    if packed is not None:
        cu_q, cu_k, used_k, seqs = packed
        block = kern.spec.block_m if kern.spec.kind == "bwd_dq" else kern.spec.block_n
        work = torch.empty(varlen_list_ints(rows, seqs, block), dtype=torch.int32, device=cu_q.device)
        set_packed(params, cu_q, cu_k, used_k, work)
        params.seqs = seqs
        launches.append((_TilesFirst(kern), None, params))
    launches.append((kern, grid, params))
    return work


def attention_backward(dout, q, k, v, out, lse, causal: bool, softmax_scale: float, layout: str = "bhsd",
                       deterministic: bool = False, dlse=None, dq_mode: str | None = None, specs=None,
                       variant=PLAIN, alibi_slopes=None, sinks=None, out32=None, packed=None, mods=None):
    """(dq, dk, dv) for ``out, lse = attention(q, k, v, causal, softmax_scale, layout, return_lse=True)``.

    q, k, v, out, lse are the forward's inputs and outputs (already checked by
    it); ``dout`` is the gradient of ``out`` (any strides; copied only when its
    last dimension is not contiguous or its rows are not 16-byte aligned),
    ``dlse`` the optional gradient of ``lse``. The gradients come back
    contiguous in the shapes (and layout) of q, k, v; dK and dV are summed over
    each KV head's group of query heads (GQA).

    For study and tuning: ``dq_mode`` ("atomic" or "separate", see
    ``families.bwd.DQ_MODE``; default: the rule, and always "separate" when
    deterministic) and ``specs``, a dict kind -> KernelSpec that replaces
    dispatch's choice for those kinds (key "bwd_dkdv" may hold a bwd_sm90 spec).

    ``variant`` (flashgen.variants.Variant, checked by the forward) with its ``alibi_slopes`` and
    ``sinks`` tensors: the forward's options. ``packed`` (cu_seqlens_q, cu_seqlens_k, seqused_k or None,
    sequences): packed rows (``attention_varlen``), the tensors as one batch of them in the "bshd" layout
    ((1, total, heads, d); lse (1, heads, total_q)), the dK/dV and dQ kernels walking device-built work
    lists (common/varlen.cuh). With sinks the result is (dq, dk, dv, dsinks): dsinks =
    -sum over batch and rows of exp(sink - LSE) D, in the sinks' dtype. ``out32``: the forward's output
    in fp32, (b, h, nq, d) (a sink forward's ``out32``): D = rowsum(dO O) is then taken from it rather
    than from the rounded ``out`` (with a sink, a row whose P nears 1 makes dP - D a difference of two
    close numbers, and the rounding of O alone put dQ/dK past the accuracy rule: docs/perf/variants.md).
    ``mods`` (``api.modcall.ModBackward``): user mods, served by its spec (``bwd_sm90``, or the mma.sync
    ``bwd_dkdv`` where that has no tile; made for ``deterministic``: the mma.sync pair), its variant and scales,
    and its mod fields in the kernels' parameters.
    """
    if not deterministic and torch.are_deterministic_algorithms_enabled():
        # torch.use_deterministic_algorithms(True): the deterministic path where there is one, else torch's
        # alert (an error, or a warning with warn_only=True)
        if mods is None or mods.deterministic:  # (api.modcall asks for the mods' deterministic pair then)
            deterministic = True
        else:
            _alert_nondeterministic("the backward of flashgen.attention with score_mod / mask_mod")
    if mods is not None and deterministic != mods.deterministic:
        raise ValueError(f"deterministic={deterministic} with the mods' {'deterministic ' if mods.deterministic else ''}"
                         "backward kernels (api.modcall.backward_of(plan, q, deterministic))")
    if dout.shape != q.shape:
        raise ValueError(f"dout must have the shape of q {tuple(q.shape)}, got {tuple(dout.shape)}")
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    if not _ok_for_kernel(dout, layout):
        dout = dout.contiguous()
    (b, h, nq, d), sq = dims(q, layout)
    (_, hk, nk, _), sk = dims(k, layout)
    sv, so, sdo = (dims(t, layout)[1] for t in (v, out, dout))
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if not (b and h and nq and nk):
        if sinks is not None:
            no_keys = b and h and nq and not nk  # every row's softmax is the sink alone
            dsinks = _dsinks_no_keys(dlse, sinks) if no_keys else torch.zeros_like(sinks)
            return dq.zero_(), dk.zero_(), dv.zero_(), dsinks
        return dq.zero_(), dk.zero_(), dv.zero_()
    sdq, sdk, sdv = (dims(t, layout)[1] for t in (dq, dk, dv))

    index = index_of(q)
    ensure_context(index)  # (the autograd engine's thread may have no current context yet)
    dev = Device.of(index)
    dtype = DTYPES[q.dtype]
    d_tile = bwd_head_dim_tile(d, dev.arch)
    # Packed rows: a sequence's last query block reads LSE2 / D rows up to a block (and bwd_sm90's aligned
    # copy 4 rows) past the packed end; ROW_PAD more rows keep those reads inside the buffers.
    nq_pad = -(-(nq + (bwd.ROW_PAD if packed is not None else 0)) // bwd.ROW_PAD) * bwd.ROW_PAD
    lse = lse.contiguous()
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    dsum = torch.empty((b, h, nq_pad), dtype=torch.float32, device=q.device)
    lse2 = torch.empty((b, h, nq_pad), dtype=torch.float32, device=q.device)
    kernel_variant = variant.backward() if mods is None else mods.variant
    vkey = kernel_variant.key()
    key = ProblemKey("bwd_dkdv", dev.arch, dtype, d_tile, causal, bucket_of(nq), vkey)
    forced = specs.get("bwd_dkdv") if specs else None
    if mods is not None:
        if mods.spec.kind == "bwd_sm90" and not all(_tma_ok(t) for t in (q, k, v, dout)):
            raise UnsupportedError("the backward of score_mod / mask_mod runs on bwd_sm90 here, whose tensor maps "
                                   "need 16-byte aligned q, k, v, dout with strides in multiples of 16 bytes")
        # bwd_sm90 and bwd_dkdv add dQ into the fp32 accumulator; the deterministic pair (bwd_dkdv_nodq, bwd_dq)
        # sums it in a fixed order
        dq_mode = "separate" if mods.deterministic else "atomic"
        forced = None if mods.deterministic else mods.spec
    if forced is not None and forced.kind != bwd.DKDV.kind:  # a Hopper kernel: dQ always into the accumulator
        if (deterministic and not forced.det) or dq_mode == "separate":
            raise ValueError(f"a {forced.kind} spec without det adds dQ in any order: not with deterministic=True "
                             "(take its det twin) or dq_mode='separate'")
        if forced.head_dim != d_tile:
            raise ValueError(f"spec {forced.name} has head-dim tile {forced.head_dim}, this call needs {d_tile}")
        dq_mode = "atomic"
    if deterministic and not specs and mods is None and packed is None:  # (forced kernels: the caller's pair)
        forced = deterministic_sm90(key, dev, (q, k, v, dout))  # dQ's adds in a fixed order, else the mma.sync pair
        dq_mode = "atomic" if forced is not None else "separate"
    elif deterministic and dq_mode != "atomic":
        dq_mode = "separate"
    elif dq_mode is not None and dq_mode not in bwd.DQ_MODES:
        raise ValueError(f"dq_mode must be one of {bwd.DQ_MODES}, got {dq_mode!r}")
    if forced is not None:
        kv_spec = forced
    elif dq_mode == "separate":
        kv_spec = None  # bwd_dkdv_nodq, below
    else:
        family = dkdv_family(key, (q, k, v, dout))
        kv_spec = dispatch.select(key, dev.gpu, dev.smem_budget, verify=True, family=family)
        if family is None and key.variant and _refused(kv_spec):
            # A variant combination the Hopper kernel's registers do not hold (bwd_sm90 at d = 128 with a
            # softcap and a window spills): the mma.sync kernel serves it.
            kv_spec = dispatch.select(key, dev.gpu, dev.smem_budget, verify=True,
                                      family=families.fallback_family("bwd_dkdv", dev.arch))
    if dq_mode is None:  # bwd.DQ_MODE is the mma.sync kernel's rule; the Hopper kernel adds into the accumulator
        dq_mode = bwd.dq_mode(d_tile) if kv_spec.kind == bwd.DKDV.kind else "atomic"
        if dq_mode == "separate" and forced is None:
            kv_spec = None  # bwd_dkdv_nodq, below
    kv_fam = families.family(kv_spec.kind) if kv_spec is not None else bwd.DKDV
    if kv_fam is bwd.DKDV and dq_mode == "atomic" and b * h * nq * d_tile >= 2**32:
        # bwd_dkdv addresses the fp32 dQ accumulator by 32-bit element offsets.
        if mods is not None:
            raise UnsupportedError(f"the backward of score_mod / mask_mod on {kv_spec.name} adds dQ at 32-bit offsets: "
                                   f"b * heads * nq * {d_tile} must stay below 2^32")
        dq_mode = "separate"
    separate = dq_mode == "separate"
    shapes.from_environment()
    if shapes.ACTIVE and not specs:  # flashgen.record: the key of the backward's main kernel, as tuned
        shapes.note(key.replace(kind="bwd_dkdv_nodq" if separate else "bwd_dkdv"), (b, h, hk, nq, nk, d))
    dq_acc = None if separate else torch.empty((b, h, nq, d_tile), dtype=torch.float32, device=q.device)
    det = kv_spec is not None and getattr(kv_spec, "det", False)
    # det: one turn counter per (batch, query head, query block of the kernel's), from zero (templates/bwd_sm90)
    dq_sem = torch.zeros(b * h * (nq_pad // kv_spec.block_m), dtype=torch.int32, device=q.device) if det else None
    scale = float(softmax_scale)
    slopes, alibi_sb, _ = variant_tensors(alibi_slopes, None)
    common = {**bwd.common_values(nq, nk, nq_pad, h, hk, d, scale),
              **kernel_variant.values(nq, nk, scale * (mods.score_in if mods is not None else 1.0), forward=False),
              "alibi": slopes.data_ptr() if slopes is not None else 0, "alibi_sb": alibi_sb}
    if mods is not None:  # a score_mod c f(k s): dS picks up f' in the kernel, the gradients c k here
        scale = common["scale"] = scale * mods.grad_factor

    launches, keep = [], []  # keep: the varlen work lists, alive until the launches are queued

    def kv_grid(spec):  # the dK/dV kernel's grid: key blocks x KV heads x batch, or the work list's bound
        if packed is not None:
            return bwd.varlen_grid(spec, nq, nk, packed[3], h, hk)
        return (-(-nk // spec.block_n), hk, b)

    pre = load(_select("bwd_preprocess", dev, dtype, d_tile, False, nq, specs), index)
    launches.append((pre, (nq_pad // pre.spec.block_m, h, b), pre.params(
        o=out.data_ptr(), dout=dout.data_ptr(), lse=lse.data_ptr(), dlse=dlse.data_ptr() if dlse is not None else 0,
        dsum=dsum.data_ptr(), lse2=lse2.data_ptr(), dq_acc=dq_acc.data_ptr() if dq_acc is not None else 0,
        **stride_values("o", so), **stride_values("dout", sdo), nq=nq, nq_pad=nq_pad, heads=h, d=d)))

    if kv_fam is not bwd.DKDV and not separate:  # bwd_sm90: Q, K, V, dO and dQ through tensor maps
        kv = load(kv_spec, index, accept_spills=mods is not None)  # (the least-spilling tile: mod_backward_spec)
        rot = det_rotation(-(-nk // kv.spec.block_n), -(-nq // kv.spec.block_m), dev.sms) if det else 1
        params = kv.params(lse2=lse2.data_ptr(), dsum=dsum.data_ptr(), dq_acc=dq_acc.data_ptr(),
                           dq_sem=dq_sem.data_ptr() if dq_sem is not None else 0, dq_rot=rot, dk=dk.data_ptr(),
                           dv=dv.data_ptr(), **stride_values("dk", sdk), **stride_values("dv", sdv), **common)
        if mods is not None:
            mods.fill(params)
        kv_fam.write_maps(params, kv.spec, (b, h, hk, nq, nk, d, d_tile), {
            "q": (q.data_ptr(), sq), "k": (k.data_ptr(), sk), "v": (v.data_ptr(), sv), "dout": (dout.data_ptr(), sdo),
            "dq_acc": (dq_acc.data_ptr(), (h * nq * d_tile, nq * d_tile, d_tile))})
        keep.append(_queue(launches, kv, kv_grid(kv.spec), params, packed, nk))
    else:
        if separate:
            kv_spec = mods.spec if mods is not None else _select("bwd_dkdv_nodq", dev, dtype, d_tile, causal, nq, specs,
                                                                  vkey)
        kv = load(kv_spec, index, accept_spills=mods is not None)
        params = kv.params(
            q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), dout=dout.data_ptr(), lse2=lse2.data_ptr(),
            dsum=dsum.data_ptr(), dq_acc=dq_acc.data_ptr() if dq_acc is not None else 0, dk=dk.data_ptr(),
            dv=dv.data_ptr(), **stride_values("q", sq), **stride_values("k", sk), **stride_values("v", sv),
            **stride_values("dout", sdo), **stride_values("dk", sdk), **stride_values("dv", sdv), **common)
        if mods is not None:
            mods.fill(params)
        keep.append(_queue(launches, kv, kv_grid(kv.spec), params, packed, nk))
    last_specs[index] = kv.spec

    if separate:
        dqk = load(mods.dq_spec if mods is not None else _select("bwd_dq", dev, dtype, d_tile, causal, nq, specs, vkey),
                   index, accept_spills=mods is not None)
        dq_grid = (bwd.varlen_grid(dqk.spec, nq, nk, packed[3], h, hk) if packed is not None
                   else (-(-nq // dqk.spec.block_m), h, b))
        params = dqk.params(
            q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), dout=dout.data_ptr(), lse2=lse2.data_ptr(),
            dsum=dsum.data_ptr(), dq=dq.data_ptr(), **stride_values("q", sq), **stride_values("k", sk),
            **stride_values("v", sv), **stride_values("dout", sdo), **stride_values("dq", sdq), **common)
        if mods is not None:
            mods.fill_dq(params)
        keep.append(_queue(launches, dqk, dq_grid, params, packed, nq))
    else:
        cv = load(_select("bwd_convert", dev, dtype, d_tile, False, nq, specs), index)
        launches.append((cv, (-(-nq // cv.spec.block_m), h, b), cv.params(
            dq_acc=dq_acc.data_ptr(), dq=dq.data_ptr(), **stride_values("dq", sdq), nq=nq, heads=h, d=d, scale=scale)))

    if out32 is not None:  # D from the fp32 output, between the preprocess (lse2, dQ's zeroing) and the rest
        launch_all(index, launches[:1])
        d32 = (dout if layout == "bhsd" else dout.transpose(1, 2)).float().mul_(out32).sum(-1)
        dsum[:, :, :nq] = d32 if dlse is None else d32.sub_(dlse)
        launch_all(index, launches[1:])
    else:
        launch_all(index, launches)
    if sinks is not None:
        # d sink = sum over rows of p_sink (dLSE - dO . O) = -sum p_sink D, p_sink = exp(sink - LSE).
        p_sink = torch.exp(sinks.float().view(1, h, 1) - lse)  # lse: (b, h, nq) in both layouts
        dsinks = -(p_sink * dsum[:, :, :nq]).sum(dim=(0, 2))
        return dq, dk, dv, dsinks.to(sinks.dtype)
    return dq, dk, dv


def _alert_nondeterministic(what: str) -> None:
    """torch's rule for an operation without a deterministic algorithm while torch.use_deterministic_algorithms
    is on: RuntimeError, or a warning with warn_only=True."""
    text = (f"{what} adds dQ in an order that varies between runs and has no deterministic form, but "
            "torch.use_deterministic_algorithms(True) is set")
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(text, stacklevel=3)
    else:
        raise RuntimeError(text)


def deterministic_sm90(key: ProblemKey, dev, tensors):
    """The deterministic dK/dV kernel for ``key`` where bwd_sm90 serves it: dispatch's bwd_sm90 pick with
    ``det`` on (dQ added by the TMA in a fixed order); None where the mma.sync kernels serve the key, or
    where the det twin's build is refused."""
    family = dkdv_family(key, tensors)
    if family not in (None, "bwd_sm90"):
        return None
    twin = dispatch.deterministic_twin(dispatch.select(key, dev.gpu, dev.smem_budget, verify=True, family=family),
                                      dev.smem_budget)
    return None if twin is None or _refused(twin) else twin


@functools.lru_cache(maxsize=256)
def _refused(spec) -> bool:
    """Whether this NVRTC's binary of ``spec`` is refused (spills): once per spec and process, not per call
    (the check reads the disk cache: about 1 ms)."""
    return bool(dispatch.resource_problems(spec))


def _dsinks_no_keys(dlse, sinks):
    """dsinks when there are no keys: every row's softmax is the sink alone (p_sink = 1, O = 0), so the
    gradient is the sum of dLSE (0 without one)."""
    if dlse is None:
        return torch.zeros_like(sinks)
    return dlse.float().sum(dim=(0, 2)).to(sinks.dtype)
