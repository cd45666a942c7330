"""Input checks the torch layer's entry points share; each raises before anything is launched.

Mistakes raise ``TypeError``/``ValueError`` naming the argument and the value;
valid requests the kernels cannot serve raise ``UnsupportedError``.
"""
from __future__ import annotations

import math
import numbers

import torch

from ..errors import UnsupportedError
from ..families.decode import PAGE_SIZES  # keys per page of a paged K/V cache (flashgen.decode's too)
from ..spec import KernelSpec
from ..variants import Variant
from .fp8 import descale_shapes

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
LAYOUTS = ("bhsd", "bshd")
MAX_GRID_YZ = 65535
INT32_MAX = 2**31 - 1  # the kernels take sizes, tile counts and key indices as 32-bit ints


def dims(t: torch.Tensor, layout: str):
    """(batch, heads, seqlen, d) and the matching element strides (batch, head, seq)."""
    s = t.stride()
    if layout == "bhsd":
        b, h, n, d = t.shape
        return (b, h, n, d), (s[0], s[1], s[2])
    b, n, h, d = t.shape
    return (b, h, n, d), (s[0], s[2], s[1])


def contiguous_strides(shape, layout: str):
    """The (batch, head, seq) element strides of a contiguous tensor of ``shape`` in ``layout`` (how
    the outputs are allocated: like q)."""
    return dims(torch.empty(shape, device="meta"), layout)[1]


def checked_scale(softmax_scale, d: int) -> float:
    """The softmax scale: ``1/sqrt(d)`` by default, else a real that is finite and positive as the
    float32 the kernels get (1e300 would reach them as inf, 1e-46 as 0), and whose log2-based form
    (scale * log2(e), the exp2 argument's factor) is too."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number, got {softmax_scale!r}")
    scale = float(softmax_scale)
    if not (_f32_positive_finite(scale) and _f32_positive_finite(scale * math.log2(math.e))):
        raise ValueError(f"softmax_scale must be finite and positive as a float32, got {softmax_scale!r}")
    return scale


# A float64 rounds (to nearest, ties to even) to a finite positive float32 iff it lies strictly between
# half the smallest subnormal (2^-150, which ties to 0) and the largest float32 plus half its ulp
# (2^128 - 2^103, which ties to inf). Plain comparisons, so torch.compile traces them (ctypes' c_float, which
# this replaces, is a graph break).
_F32_LOW, _F32_HIGH = 2.0 ** -150, 2.0 ** 128 - 2.0 ** 103


def _f32_positive_finite(x: float) -> bool:
    return _F32_LOW < x < _F32_HIGH


def check_int32(what: str, value: int) -> None:
    """``UnsupportedError`` naming the limit when a size the kernels take as int32 is past it."""
    if value > INT32_MAX:
        raise UnsupportedError(f"{what} is {value}, past the kernels' 32-bit limit of {INT32_MAX}")


def extent_bytes(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to one past its last (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 1) + 1) * t.element_size()


def overlap(a: tuple, b: tuple) -> bool:
    """Whether two (address, extent) byte ranges share a byte."""
    return a[1] > 0 and b[1] > 0 and a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


def check_flag(name: str, value) -> None:
    """``TypeError`` unless ``value`` is a bool (1 and 0 are not)."""
    if type(value) is not bool:
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_heads_and_dim(hq: int, hk: int, d: int, batch: int, grid_heads: int, kv_name: str,
                        heads_name: str) -> None:
    """GQA grouping, a supported head dim, and a grid that fits."""
    if hk == 0 or hq % hk:
        raise ValueError(f"heads of q ({hq}) must be a multiple of heads of {kv_name} ({hk})")
    if d % 8 or not 8 <= d <= 256:
        raise UnsupportedError(f"head dim {d} is not supported: flashgen takes multiples of 8 from 8 to 256")
    if grid_heads > MAX_GRID_YZ or batch > MAX_GRID_YZ:
        raise UnsupportedError(f"batch ({batch}) and {heads_name} ({grid_heads}) must each be at most "
                               f"{MAX_GRID_YZ}")


def check_attention_inputs(q, k, v, causal, softmax_scale, layout, fp8: bool = False):
    """Everything ``flashgen.attention`` checks of its tensors: ((b, hq, nq, d), q strides, (hk, nk),
    k strides, v strides, scale). ``fp8``: q, k, v are float8 e4m3 (16-byte aligned: d and the strides
    multiples of 16 elements)."""
    dtypes = {torch.float8_e4m3fn: "e4m3"} if fp8 else DTYPES
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    check_flag("causal", causal)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({layout}), got shape {tuple(t.shape)}")
        if t.device.type not in ("cuda", "meta"):
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
        if t.dtype not in dtypes:
            if fp8:
                raise TypeError(f"{name} must be float8_e4m3fn (FP8 attention: q, k and v all FP8, with their "
                                f"descales), got {t.dtype}")
            hint = (": FP8 inputs take q_descale, k_descale and v_descale, and all three of q, k, v in FP8"
                    if t.dtype == torch.float8_e4m3fn else "")
            raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}{hint}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    (bq, hq, nq, d), sq = dims(q, layout)
    (bk, hk, nk, dk), sk = dims(k, layout)
    (bv, hv, nv, dv), sv = dims(v, layout)
    if (bk, hk, nk, dk) != (bv, hv, nv, dv):
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if bq != bk:
        raise ValueError(f"q and k must have one batch size, got {bq} and {bk} ({layout})")
    if d != dk:
        raise ValueError(f"q and k must have one head dim, got {d} and {dk}")
    if hk > 1 and sk[1] == 0 and sv[1] == 0:
        # K and V expanded over their heads (stride 0): one KV head serves every query head, which is
        # exactly MQA, whatever the shape says; the kernels then read it as such on every family.
        hk = 1
    check_heads_and_dim(hq, hk, d, bq, hq, "k/v", "heads")
    check_int32("seqlen_q", nq)
    check_int32("seqlen_k", nk)
    per16 = 16 if fp8 else 8  # elements in 16 bytes
    if fp8 and d % 16:
        raise UnsupportedError(f"FP8 attention takes head dims that are multiples of 16 (16-byte rows), got {d}")
    for name, t, strides in (("q", q, sq), ("k", k, sk), ("v", v, sv)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
        if t.data_ptr() % 16 or any(x % per16 for x in strides):
            raise ValueError(f"{name} must be 16-byte aligned with strides that are multiples of {per16} elements "
                             f"(16-byte loads), got strides {t.stride()} at address {t.data_ptr():#x}")
    return (bq, hq, nq, d), sq, (hk, nk), sk, sv, checked_scale(softmax_scale, d)


def check_forced_spec(spec, want: dict, d: int, smem_budget: int) -> None:
    """A ``spec=`` a caller forces must be a valid KernelSpec matching ``want`` (field -> value, or
    field -> tuple of allowed values), with a head-dim tile that covers ``d`` and shared memory within
    the device's budget."""
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"spec must be a KernelSpec, got {type(spec).__name__}")
    spec.validate()
    wrong = {f: getattr(spec, f) for f, v in want.items()
             if getattr(spec, f) not in (v if isinstance(v, tuple) else (v,))}
    if wrong or spec.head_dim < d:
        raise ValueError(f"spec {spec.name} does not fit this problem ({want}, d={d})")
    if spec.smem_total() > smem_budget:
        raise UnsupportedError(f"spec {spec.name} needs {spec.smem_total()} B of shared memory, over the "
                               f"device's {smem_budget} B")


def check_variant_inputs(q, causal, window, softcap, alibi_slopes, sinks, b: int, h: int, nq: int, nk: int):
    """The variant options of a call, checked: (``Variant``, slopes, sinks), the tensors as given (the
    launch takes fp32 contiguous copies where they are not: ``variant_tensors``). Slopes: fp32, (heads,)
    or (batch, heads); sinks: fp32 or q's dtype, (heads,); both on q's device."""
    if alibi_slopes is not None:
        _check_small("alibi_slopes", alibi_slopes, q, ((h,), (b, h)), (torch.float32,))
    if sinks is not None:
        _check_small("sinks", sinks, q, ((h,),), (torch.float32, q.dtype))
    variant = Variant.of(causal, window, softcap, alibi_slopes is not None, sinks is not None)
    if variant.windowed or variant.alibi:
        check_int32("seqlen_q + seqlen_k + 1 (a window's or ALiBi's key offsets)", nq + nk + 1)
    return variant, alibi_slopes, sinks


def _check_small(name: str, t, q, shapes, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device}), got {t.device}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(str(d).replace('torch.', '') for d in dict.fromkeys(dtypes))}, "
                        f"got {t.dtype}")
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(str(s) for s in shapes)}, got {tuple(t.shape)}")


def variant_tensors(alibi_slopes, sinks):
    """(slopes, slopes' batch stride, sinks) as the kernels read them: fp32 and contiguous (a copy only
    where they are not), the batch stride 0 for one slope per head; None for an absent one."""
    sb = 0
    if alibi_slopes is not None:
        if not alibi_slopes.is_contiguous():
            alibi_slopes = alibi_slopes.contiguous()
        sb = alibi_slopes.shape[1] if alibi_slopes.dim() == 2 else 0
    if sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()):
        sinks = sinks.float().contiguous()
    return alibi_slopes, sb, sinks


def check_packed_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                        seqused_k=None, block_table=None):
    """Everything ``attention_varlen`` checks of its arguments without reading device memory: packed q
    (total_q, heads, d), k and v (total_k, heads_kv, d); cu_seqlens int32 (seqs + 1,) and seqused_k int32
    (seqs,) contiguous on q's device; the max lengths ints >= 0. Returns ((seqs, hq, hk, total_q, total_k,
    d), the (batch, head, seq) strides of q, k, v (batch 0: one batch of packed rows), scale).

    Paged K/V (``block_table`` int32 (seqs, max_pages) on q's device, last dimension contiguous): k and v
    are caches (pages, page_size, heads_kv, d), page_size one of PAGE_SIZES; ``cu_seqlens_k`` may then be
    None where ``seqused_k`` gives the key counts. total_k is then the table's capacity (max_pages x
    page_size) and the k, v strides are (page, head, row)."""
    paged = block_table is not None
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        want = 4 if paged and name != "q" else 3
        if t.dim() != want:
            raise ValueError(f"{name} must be " + ("4-D (pages, page_size, heads_kv, d) with a block_table"
                             if want == 4 else "3-D (total_tokens, heads, d)") + f", got shape {tuple(t.shape)}")
    if paged:
        if k.shape != v.shape:
            raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        pages, page = k.shape[0], k.shape[1]
        if page not in PAGE_SIZES:
            raise ValueError(f"page size (k.shape[1]) must be one of {PAGE_SIZES}, got {page}")
        kv = [t.flatten(0, 1).unsqueeze(0) if t.is_contiguous() else t[:, 0].unsqueeze(0) for t in (k, v)]
    else:
        kv = [k.unsqueeze(0), v.unsqueeze(0)]
    # The 4-D checks on (1, total, heads, d) views: devices, dtypes, heads, alignment, strides, limits.
    (_, hq, total_q, d), sq, (hk, total_k), sk, sv, scale = check_attention_inputs(
        q.unsqueeze(0), kv[0], kv[1], causal, softmax_scale, "bshd")
    if paged:
        for name, t in (("k", k), ("v", v)):
            if any(x % 8 for x in t.stride()[:3]):
                raise ValueError(f"{name} must have strides that are multiples of 8 elements (16-byte loads), got "
                                 f"strides {t.stride()}")
        check_int32_tensor("cu_seqlens_q", cu_seqlens_q, q.device)
        check_block_table_layout(block_table, cu_seqlens_q.shape[0] - 1, "sequences", q.device)
        if cu_seqlens_k is None and seqused_k is None:
            raise ValueError("a paged call needs the key counts: cu_seqlens_k or seqused_k")
        total_k = block_table.shape[1] * page
        check_int32("the block table's keys (max_pages x page_size) + total_q", total_k + total_q)
        check_int32("pages x page_size", pages * page)
        sk, sv = ((t.stride(0), t.stride(2), t.stride(1)) for t in (k, v))
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("seqused_k", seqused_k)):
        if t is None and (name == "seqused_k" or (name == "cu_seqlens_k" and paged)):
            continue
        check_int32_tensor(name, t, q.device)
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}, strides "
                             f"{t.stride()}")
    seqs = cu_seqlens_q.shape[0] - 1
    if seqs < 0:
        raise ValueError("cu_seqlens_q must hold at least one entry (0 for no sequences)")
    if cu_seqlens_k is not None and cu_seqlens_k.shape[0] != seqs + 1:
        raise ValueError(f"cu_seqlens_k must have as many entries as cu_seqlens_q ({seqs + 1}), got "
                         f"{cu_seqlens_k.shape[0]}")
    if seqused_k is not None and seqused_k.shape[0] != seqs:
        raise ValueError(f"seqused_k must have one entry per sequence ({seqs}), got {seqused_k.shape[0]}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if seqs > MAX_GRID_YZ * 1024:
        raise UnsupportedError(f"{seqs} sequences are past the {MAX_GRID_YZ * 1024} the work list takes")
    strides = (0, sq[1], sq[2]), *((sk, sv) if paged else ((0, s[1], s[2]) for s in (sk, sv)))
    return (seqs, hq, hk, total_q, total_k, d), strides, scale


def check_tensor_of(name: str, t, dtype, device, where: str = "q's device", what: str = "") -> None:
    """TypeError unless ``t`` is a torch.Tensor (``what``: how the message names it) of ``dtype``, ValueError
    unless it is on ``device`` (``where``: how the message names that)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{what}, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {str(dtype).replace('torch.', '')}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {where} ({device}), got {t.device}")


def check_int32_tensor(name: str, t, device) -> None:
    """TypeError unless ``t`` is an int32 tensor, ValueError unless it is on ``device``."""
    check_tensor_of(name, t, torch.int32, device)


def check_descale(name: str, t, device, batch: int, heads: tuple) -> None:
    """``t`` is a descale factor tensor (api.fp8): fp32, on ``device``, of a ``descale_shapes`` shape. The
    values (finite, positive) are ``check_descale_values``'s: reading them syncs the device."""
    check_tensor_of(name, t, torch.float32, device, "the inputs' device", " (fp32 descale factors)")
    shapes = descale_shapes(batch, heads)
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(str(s) for s in shapes)}, got {tuple(t.shape)}")


def check_block_table_layout(block_table, rows: int, label: str, device) -> None:
    """A paged cache's block table (decode's, attention_varlen's): int32 (rows, max_pages) on ``device``,
    contiguous in its last dimension; ``label`` names what a row is (batch, sequences)."""
    check_int32_tensor("block_table", block_table, device)
    if block_table.dim() != 2 or block_table.shape[0] != rows:
        raise ValueError(f"block_table must be ({label}={rows}, max_pages), got shape {tuple(block_table.shape)}")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"block_table must be contiguous in its last dimension, got strides {block_table.stride()}")


def set_packed(params, cu_seqlens_q, cu_seqlens_k, seqused_k, work) -> None:
    """A varlen launch's sequence pointers and work list (``work``, an int32 tensor) in its parameter block
    (families.base.VARLEN_PARAMS; the sequence count is the plan's)."""
    params.cu_q = cu_seqlens_q.data_ptr()
    params.cu_k = cu_seqlens_k.data_ptr() if cu_seqlens_k is not None else 0
    params.used_k = seqused_k.data_ptr() if seqused_k is not None else 0
    params.vl_tiles = work.data_ptr()


def on_meta(t) -> bool:
    """Whether ``t`` is a meta tensor: the call then only checks its arguments and returns outputs of the
    right shapes (``device="meta"`` model tooling, FLOP counters), through the custom ops' fake kernels."""
    return isinstance(t, torch.Tensor) and t.is_meta


def check_attention_call(q, k, v, causal, softmax_scale, layout, return_lse, window, softcap, alibi_slopes, sinks,
                         fp8=None):
    """Every check of a ``flashgen.attention`` call's arguments (the forward's plan and the meta path):
    ``check_attention_inputs``'s facts and the ``Variant``. ``fp8``: (q_descale, k_descale, v_descale,
    out_dtype) of an FP8 call (``check_fp8_options``)."""
    (b, h, nq, d), sq, (hk, nk), sk, sv, scale = check_attention_inputs(q, k, v, causal, softmax_scale, layout,
                                                                        fp8 is not None)
    variant, _, _ = check_variant_inputs(q, causal, window, softcap, alibi_slopes, sinks, b, h, nq, nk)
    check_flag("return_lse", return_lse)
    if fp8 is not None:
        check_fp8_options(q.device, b, h, hk, *fp8)
        variant = variant.replace(fp8=True)
    return (b, h, nq, d), sq, (hk, nk), sk, sv, scale, variant


def check_fp8_options(device, b: int, h: int, hk: int, q_descale, k_descale, v_descale, out_dtype) -> None:
    """An FP8 call's descales (fp32 on ``device``: one factor, or (batch, heads) -- q's per query head or per
    KV head, k's and v's per KV head) and output dtype (bf16 or fp16)."""
    for name, t, heads in (("q_descale", q_descale, (h, hk)), ("k_descale", k_descale, (hk,)),
                           ("v_descale", v_descale, (hk,))):
        if t is None:
            raise ValueError(f"FP8 inputs need q_descale, k_descale and v_descale (fp32 factors: x = x8 * "
                             f"descale; flashgen.quantize_fp8 makes both); {name} is missing")
        check_descale(name, t, device, b, heads)
    if out_dtype not in DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float16 (FP8 attention's output), got {out_dtype}")


def check_packed_call(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, seqused_k, block_table, window,
                      softcap, alibi_slopes, sinks):
    """Every check of an ``attention_varlen`` call that reads no device memory (the packed plan and the meta
    path): ``check_packed_inputs``'s facts and the ``Variant`` (with the varlen switch)."""
    dims, strides, scale = check_packed_inputs(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, seqused_k,
                                               block_table)
    seqs, h, _, total_q, total_k, _ = dims
    variant, _, _ = check_variant_inputs(q, causal, window, softcap, alibi_slopes, sinks, seqs, h, total_q, total_k)
    return dims, strides, scale, variant.replace(varlen=True)

