"""The torch layer: ``flashgen.attention``.

Checks the inputs and raises before any launch, builds the problem key, asks
dispatch for a spec, and launches the compiled kernel on torch's current
stream with raw pointers and strides (no copies, CUDA-graph safe).
"""
from __future__ import annotations

import math
import numbers
import os

import torch

from . import dispatch, gpus
from .errors import UnsupportedError

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_LAYOUTS = ("bhsd", "bshd")
ALGORITHMS = ("v2", "v1", "standard")
_MAX_GRID_YZ = 65535


class _Device:
    """What dispatch needs to know of one CUDA device, looked up once."""

    _cache: dict = {}

    def __init__(self, index: int):
        major, minor = torch.cuda.get_device_capability(index)
        self.index = index
        self.arch = gpus.arch_of_capability(major, minor)
        profile = gpus.detect(index)
        self.gpu = profile.name if profile else None
        props = torch.cuda.get_device_properties(index)
        optin = getattr(props, "shared_memory_per_block_optin", 0)
        self.smem_budget = int(optin or (profile.smem_per_block if profile else
                                          gpus.ARCH_SMEM_PER_BLOCK.get(self.arch, 101376)))
        self.sms = int(props.multi_processor_count)  # fwd_sm90 persist: the grid
        self.smem_per_sm = int(getattr(props, "shared_memory_per_multiprocessor", 0) or 0) or self.smem_budget + 1024
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or 0) or 50 << 20  # the causal tile order's sections

    @classmethod
    def of(cls, index: int) -> "_Device":
        dev = cls._cache.get(index)
        if dev is None:
            dev = cls._cache[index] = cls(index)
        return dev


def _dims(t: torch.Tensor, layout: str):
    """(batch, heads, seqlen, d) and the matching element strides (batch, head, seq)."""
    s = t.stride()
    if layout == "bhsd":
        b, h, n, d = t.shape
        return (b, h, n, d), (s[0], s[1], s[2])
    b, n, h, d = t.shape
    return (b, h, n, d), (s[0], s[2], s[1])


def checked_scale(softmax_scale, d: int) -> float:
    """The softmax scale: ``1/sqrt(d)`` by default, else a finite positive real (shared with decode)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number, got {softmax_scale!r}")
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be finite and positive, got {softmax_scale!r}")
    return scale


def check_heads_and_dim(hq: int, hk: int, d: int, batch: int, grid_heads: int, kv_name: str,
                        heads_name: str) -> None:
    """GQA grouping, a supported head dim, and a grid that fits (shared with ``flashgen.decode``)."""
    if hk == 0 or hq % hk:
        raise ValueError(f"heads of q ({hq}) must be a multiple of heads of {kv_name} ({hk})")
    if d % 8 or not 8 <= d <= 256:
        raise UnsupportedError(f"head dim {d} is not supported: flashgen takes multiples of 8 from 8 to 256")
    if grid_heads > _MAX_GRID_YZ or batch > _MAX_GRID_YZ:
        raise UnsupportedError(f"batch ({batch}) and {heads_name} ({grid_heads}) must each be at most "
                               f"{_MAX_GRID_YZ}")


def _check_inputs(q, k, v, causal, softmax_scale, layout):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({layout}), got shape {tuple(t.shape)}")
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    (bq, hq, nq, d), sq = _dims(q, layout)
    (bk, hk, nk, dk), sk = _dims(k, layout)
    (bv, hv, nv, dv), sv = _dims(v, layout)
    if (bk, hk, nk, dk) != (bv, hv, nv, dv):
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if bq != bk:
        raise ValueError(f"q and k must have one batch size, got {bq} and {bk} ({layout})")
    if d != dk:
        raise ValueError(f"q and k must have one head dim, got {d} and {dk}")
    check_heads_and_dim(hq, hk, d, bq, hq, "k/v", "heads")
    for name, t, strides in (("q", q, sq), ("k", k, sk), ("v", v, sv)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
        if t.data_ptr() % 16 or any(x % 8 for x in strides):
            raise ValueError(f"{name} must be 16-byte aligned with strides that are multiples of 8 elements "
                             f"(16-byte loads), got strides {t.stride()} at address {t.data_ptr():#x}")
    return (bq, hq, nq, d), sq, (hk, nk), sk, sv, checked_scale(softmax_scale, d)


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, layout: str = "bhsd",
              return_lse: bool = False, spec=None, algorithm: str = "v2", deterministic: bool = False):
    """Scaled dot-product attention, softmax(scale * q k^T) v, by a generated kernel.

    q: (batch, heads, seqlen_q, d) for ``layout="bhsd"`` (torch's order) or
    (batch, seqlen_q, heads, d) for ``"bshd"``; k, v likewise with heads_kv
    dividing heads (GQA/MQA, no copies). fp16 or bf16 on one CUDA device; any
    strides with a contiguous last dimension (16-byte aligned). ``d`` any
    multiple of 8 up to 256. ``causal`` masks bottom-right aligned: query i sees
    keys j <= i + seqlen_k - seqlen_q; a row that sees no key gives 0 (LSE -inf).

    ``spec`` forces one KernelSpec instead of dispatch's pick (for the tuner
    and for study); it must match the problem (a forward family the GPU runs:
    ``fwd_v2``, or ``fwd_sm90`` on sm_90a; dtype, causal, arch, and a head-dim
    tile that covers d). Dispatch's pick, too, may be of either family (a tuned
    table's entry for the "fwd" key); the spec's family decides the launch.

    ``algorithm`` picks the kernel family: ``"v2"`` (FlashAttention-2, the
    default and the fast one), ``"v1"`` (FlashAttention V1's loop order: K/V
    blocks outside, O/m/l through HBM) or ``"standard"`` (three passes with S
    and P in HBM; ``UnsupportedError`` when that N x N buffer does not fit in
    free GPU memory). The last two are for study and comparison; with them,
    ``spec`` is a ``fwd_v1`` spec, or a tuple of the three ``standard_*`` specs.

    Returns the output in q's layout and dtype, and with ``return_lse`` also the
    log-sum-exp of the scaled scores, fp32 (batch, heads, seqlen_q).
    Raises TypeError/ValueError on bad inputs and UnsupportedError for requests
    outside what the kernels serve, always before launching anything.

    Differentiable: when q, k or v requires grad (or under torch.compile) the
    call goes through the ``flashgen::attn_fwd`` custom op, whose backward runs
    flashgen's backward kernels (``flashgen.autograd``). ``deterministic=True``
    makes dQ independent of the order of atomic adds (a separate query-outer
    dQ kernel, somewhat slower); dK and dV are deterministic either way.
    """
    if type(deterministic) is not bool:
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    if _is_compiling() or (torch.is_grad_enabled() and (getattr(q, "requires_grad", False) or
                                                         getattr(k, "requires_grad", False) or
                                                         getattr(v, "requires_grad", False))):
        if algorithm != "v2":
            if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
                raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
            raise UnsupportedError(f"algorithm={algorithm!r} is forward-only (for study); gradients need "
                                   "algorithm='v2'")
        from .autograd import attention_op

        return attention_op(q, k, v, causal, softmax_scale, layout, return_lse, deterministic, spec)
    return _forward(q, k, v, causal, softmax_scale, layout, return_lse, spec, algorithm)


def _forward(q, k, v, causal, softmax_scale, layout, return_lse, spec, algorithm="v2"):
    """The forward launch behind ``attention`` (no autograd)."""
    try:
        sig = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
               q.device, k.device, v.device, causal, softmax_scale, layout, return_lse, spec,
               type(causal), type(softmax_scale), type(return_lse), algorithm)  # 1 == True: the types keep checks honest
        plan = _plans.get(sig)
    except (AttributeError, TypeError):  # not tensors, or an unhashable argument: the full check says why
        sig = plan = None
    if plan is None:
        plan = _plan(q, k, v, causal, softmax_scale, layout, return_lse, spec, algorithm)
        if sig is not None:
            if len(_plans) > 4096:
                _plans.clear()
            _plans[sig] = plan
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        raise ValueError("q, k, v must be 16-byte aligned (16-byte loads), got addresses "
                         f"{q.data_ptr():#x}, {k.data_ptr():#x}, {v.data_ptr():#x}")
    if type(plan) is not _Plan:  # algorithm="v1"/"standard": several kernels and buffers (baseline_run)
        return plan.run(q, k, v, return_lse)
    out = q.new_empty(q.shape)  # contiguous, q's dtype and device (cheaper than torch.empty on the host)
    lse = q.new_empty(plan.lse_shape, dtype=torch.float32) if return_lse else None
    if plan.kernel is not None:
        if plan.tma is None:
            params = plan.params()
            params.q, params.k, params.v, params.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        else:  # fwd_sm90: q, k, v reach the kernel through TMA descriptors (cached per address triple)
            params = plan.tma(q.data_ptr(), k.data_ptr(), v.data_ptr())
            params.o = out.data_ptr()
        params.lse = lse.data_ptr() if lse is not None else 0
        plan.launch(params)
    return (out, lse) if return_lse else out


class _Plan:
    """Everything about a call that depends only on shapes, strides, dtypes and
    flags: checked once, then reused while those stay the same (the per-call
    path is a dict lookup, two allocations, five pointers and the launch)."""

    __slots__ = ("kernel", "grid", "device_index", "lse_shape", "_template", "_struct", "tma")

    def __init__(self, kernel, grid, device_index, lse_shape, template, tma=None):
        self.kernel, self.grid, self.device_index, self.lse_shape = kernel, grid, device_index, lse_shape
        self.tma = tma  # fwd_sm90: (q, k, v addresses) -> params with their tensor maps filled in
        self._template = bytes(template) if template is not None else None
        self._struct = type(template) if template is not None else None

    def params(self):
        return self._struct.from_buffer_copy(self._template)

    def launch(self, params) -> None:
        idx = self.device_index
        if idx == _current_device():
            self.kernel.launch(self.grid, params, _current_stream(idx))
        else:
            with torch.cuda.device(idx):
                self.kernel.launch(self.grid, params, _current_stream(idx))


# torch's private fast paths for the two per-call queries (the public ones cost
# microseconds each: they build Python Stream objects); public fallbacks.
if hasattr(torch._C, "_cuda_getCurrentRawStream") and hasattr(torch._C, "_cuda_getDevice"):
    _current_stream = torch._C._cuda_getCurrentRawStream
    _current_device = torch._C._cuda_getDevice
else:  # pragma: no cover
    def _current_stream(idx):
        return torch.cuda.current_stream(idx).cuda_stream

    _current_device = torch.cuda.current_device


_plans: dict = {}
_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing

_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


def _plan(q, k, v, causal, softmax_scale, layout, return_lse, spec, algorithm="v2"):
    from .codegen import load

    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    (b, h, nq, d), sq, (hk, nk), sk, sv, scale = _check_inputs(q, k, v, causal, softmax_scale, layout)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if not (nq and b and h):
        return _Plan(None, None, index, (b, h, nq), None)
    dev = _Device.of(index)
    if algorithm != "v2":
        from . import baseline_run

        o_strides = _dims(torch.empty(q.shape, device="meta"), layout)[1]
        return baseline_run.plan(algorithm, spec, causal, dev, _DTYPES[q.dtype], (b, h, hk, nq, nk, d),
                                 (sq, sk, sv), o_strides, scale)
    # One problem key for the forward; the spec (tuned table, default rule or spec=) may be of any
    # forward family the arch runs (dispatch.FORWARD_FAMILIES), and its family decides the launch.
    key = dispatch.ProblemKey("fwd", dev.arch, _DTYPES[q.dtype], dispatch.head_dim_tile(d), causal,
                              dispatch.bucket_of(nq))
    if spec is None:
        spec = dispatch.select(key, dev.gpu, dev.smem_budget, verify=True)
    else:
        _check_forced_spec(spec, key, d, dev)
    kern = load(spec, dev.index)
    # The output is allocated like q (same shape, contiguous): its strides in q's layout.
    o_strides = _dims(torch.empty(q.shape, device="meta"), layout)[1]
    if spec.kind == "fwd_sm90":
        return _plan_sm90(kern, spec, dev, (b, h, hk, nq, nk, d), (sq, sk, sv), o_strides, scale)
    template = kern.params(
        q_sb=sq[0], q_sh=sq[1], q_ss=sq[2], k_sb=sk[0], k_sh=sk[1], k_ss=sk[2],
        v_sb=sv[0], v_sh=sv[1], v_ss=sv[2], o_sb=o_strides[0], o_sh=o_strides[1], o_ss=o_strides[2],
        nq=nq, nk=nk, heads=h, group=h // hk, d=d, scale=scale, scale_log2=scale * math.log2(math.e),
    )
    grid = ((nq + spec.block_m - 1) // spec.block_m, h, b)
    return _Plan(kern, grid, dev.index, (b, h, nq), template)


def _plan_sm90(kern, spec, dev, shape, strides, o_strides, scale):
    """The plan of a fwd_sm90 launch: the per-call part is a parameter block with the three TMA
    descriptors of q, k, v filled in (built by the driver, flashgen.tma). The plan keeps the filled
    block per (q, k, v) address triple, so a call that reuses its buffers -- the caching allocator
    hands the same addresses back -- costs one dict lookup and one copy, as fwd_v2's plan does."""
    import ctypes

    from . import tma

    b, h, hk, nq, nk, d = shape
    sq, sk, sv = strides
    template = kern.params(o_sb=o_strides[0], o_sh=o_strides[1], o_ss=o_strides[2], nq=nq, nk=nk, heads=h,
                           group=h // hk, d=d, scale=scale, scale_log2=scale * math.log2(math.e))
    m_blocks = (nq + spec.block_m - 1) // spec.block_m
    tiles = m_blocks * h * b
    # The tiles the CTAs walk, and in what order (fwd_sm90.cuh, tile_coords).
    template.tiles, template.m_blocks = tiles, m_blocks
    kv_bytes = 2 * nk * spec.head_dim * 2 // (h // hk)  # K and V per query head (GQA: shared)
    forced = os.environ.get("FLASHGEN_TILE_SECTION")  # study: at most this many pairs per section (1: pair after pair)
    template.sec, template.sec_big = tile_sections(b * h, kv_bytes, dev.l2_bytes, int(forced) if forced else None,
                                                   causal=spec.causal)
    struct = type(template)
    off_q, off_k, off_v = struct.tm_q.offset, struct.tm_k.offset, struct.tm_v.offset
    # _dims gives element strides in (batch, head, seq) order; tensor_dims takes (seq, head, batch),
    # the map's own order (innermost first). Passing them unreordered made the map step rows by the
    # batch stride: garbage rows, NaN, and illegal addresses on the first H200 run.
    q_dims, q_str = tma.tensor_dims(d, nq, h, b, sq[::-1])
    if nk:
        k_dims, k_str = tma.tensor_dims(d, nk, hk, b, sk[::-1])
        v_dims, v_str = tma.tensor_dims(d, nk, hk, b, sv[::-1])
    box_q, box_kv = (64, 64, 1, 1), (64, spec.block_n, 1, 1)  # Q: one 64-row piece per consumer warpgroup
    dtype, encode, memmove = spec.dtype, tma.encode, ctypes.memmove

    def fill(params, q_ptr, k_ptr, v_ptr):
        base = ctypes.addressof(params)
        memmove(base + off_q, encode(q_ptr, dtype, q_dims, q_str, box_q), 128)
        if nk:
            memmove(base + off_k, encode(k_ptr, dtype, k_dims, k_str, box_kv), 128)
            memmove(base + off_v, encode(v_ptr, dtype, v_dims, v_str, box_kv), 128)
        else:  # no K/V block is ever loaded; a valid map keeps the prefetch harmless
            memmove(base + off_k, base + off_q, 128)
            memmove(base + off_v, base + off_q, 128)

    blank, filled = bytes(template), {}

    def params_for(q_ptr, k_ptr, v_ptr):
        blob = filled.get((q_ptr, k_ptr, v_ptr))
        if blob is None:
            params = struct.from_buffer_copy(blank)
            fill(params, q_ptr, k_ptr, v_ptr)
            blob = bytes(params)
            if len(filled) >= 64:  # addresses churn (fresh tensors every call): keep the cache small
                filled.clear()
            filled[(q_ptr, k_ptr, v_ptr)] = blob
        return struct.from_buffer_copy(blob)

    if spec.persist:  # and the stream's tile counters (zero between launches; the kernel leaves them so)
        cached, idx = params_for, dev.index

        def params_for(q_ptr, k_ptr, v_ptr):
            params = cached(q_ptr, k_ptr, v_ptr)
            params.sched = _tile_counters(idx)
            return params

        ctas = dev.sms * persist_ctas_per_sm(spec, kern.binary.report, dev.smem_per_sm)
        cap = os.environ.get("FLASHGEN_PERSIST_CTAS")  # tests and study: fewer CTAs, more tiles each
        grid = (min(tiles, ctas, int(cap) if cap else ctas), 1, 1)
    else:
        grid = (tiles, 1, 1)
    return _Plan(kern, grid, dev.index, (b, h, nq), template, tma=params_for)


def tile_sections(pairs: int, kv_bytes: int, l2_bytes: int, per: int | None = None,
                  causal: bool = False) -> tuple[int, int]:
    """The fwd_sm90 tile order's sections: (sec, sec_big) = ``pairs`` (batch, head) pairs split into as
    few even sections (sec_big of sec + 1 pairs, the rest of sec) as keep each at most ``per`` pairs; by
    default ``per`` is what keeps a section's K/V (``kv_bytes`` per pair) within a quarter of the L2
    (Hopper's L2 is two partitions, and data every SM reads may be held in both: half the L2, halved
    again for what else stays there; with half of it the persistent kernel at d = 128, N = 2k ran 6 %
    slower than pair after pair, bench/NOTES.md), causal within half of it: its tiles are unequal, and
    more pairs per section balance the SMs better (bench/sched_sim.py); measured on the H200 (session 5,
    7 interleaved rounds): causal +0.4 to +5.9 % at d = 128 (most at 8k), +0.4 to +0.8 % at d = 64,
    while non-causal with half read -1.7 to +1 %. Inside a section the kernel walks m-block by m-block
    over every pair (causal: longest rows first, so the short tiles fill the tail); the hardware hands
    tiles to SMs in that order. For causal tiles a greedy-schedule model (bench/sched_sim.py) puts the
    makespan 0.2-1.8 % over the ideal at hidden 2048, N 2k-16k with sections of half the L2, against
    3-7 % for one pair's m-blocks after another (bench/NOTES.md, session 4)."""
    if per is None:
        per = (l2_bytes // (2 if causal else 4)) // max(1, kv_bytes)
    sections = -(-pairs // max(1, per))
    return pairs // sections, pairs % sections


_counters: dict = {}


def _tile_counters(idx: int) -> int:
    """The address of two zeroed int32 tile counters for a persistent fwd_sm90 launch on the current stream
    of device ``idx``: one pair per stream (launches on one stream run one after another, and each leaves
    the pair zeroed), a fresh pair inside a CUDA graph capture (zeroed by the graph itself on replay)."""
    stream = _current_stream(idx)
    if _is_capturing():
        t = torch.zeros(2, dtype=torch.int32, device=torch.device("cuda", idx))
        return t.data_ptr()
    t = _counters.get((idx, stream))
    if t is None:
        if len(_counters) > 256:  # streams come and go
            _counters.clear()
        t = _counters[(idx, stream)] = torch.zeros(2, dtype=torch.int32, device=torch.device("cuda", idx))
    return t.data_ptr()


def persist_ctas_per_sm(spec, report, smem_per_sm: int) -> int:
    """CTAs of a persistent fwd_sm90 kernel one SM holds at once: by shared memory (dynamic + static +
    the 1 KB the driver reserves per block) and by registers (ptxas's count, allocated per warp in
    units of 8 per thread); at least 1. 1 for every tile measured so far (the launch bound is 1)."""
    threads = spec.warps * 32
    by_smem = smem_per_sm // (spec.smem_bytes() + report.static_smem + 1024)
    regs = (max(report.registers, 1) + 7) // 8 * 8
    by_regs = 65536 // (threads * regs)
    return max(1, min(by_smem, by_regs))


def _check_forced_spec(spec, key, d, dev) -> None:
    from .spec import KernelSpec

    if not isinstance(spec, KernelSpec):
        raise TypeError(f"spec must be a KernelSpec, got {type(spec).__name__}")
    serving = dispatch.families_for(key.kind, key.arch)
    if spec.kind in dispatch.FORWARD_FAMILIES[key.kind] and spec.kind not in serving:
        raise UnsupportedError(f"{spec.kind} does not run on {key.arch} (this device); the forward here runs "
                               f"{', '.join(serving)}: use such a spec or none")
    spec.validate()
    want = {"kind": serving, "dtype": key.dtype, "causal": key.causal, "arch": key.arch}
    wrong = {f: getattr(spec, f) for f in ("dtype", "causal", "arch") if getattr(spec, f) != want[f]}
    if spec.kind not in serving or wrong or spec.head_dim < d:
        raise ValueError(f"spec {spec.name} does not fit this problem ({want}, d={d})")
    if spec.smem_bytes() > dev.smem_budget:
        raise UnsupportedError(f"spec {spec.name} needs {spec.smem_bytes()} B of shared memory, over the "
                               f"device's {dev.smem_budget} B")
