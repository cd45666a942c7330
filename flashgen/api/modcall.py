"""``flashgen.attention`` with user mods: ``score_mod``, ``mask_mod`` and ``block_mask`` (FlexAttention's).

The mods are traced once into expression graphs (``flashgen.mods``); the pair's token joins the spec
(``KernelSpec.mod``), whose kernel prints the graphs as device functions (templates/common/mod.cuh).
A mask comes with a block mask (``flashgen.api.blockmask``), made at the kernel's tile: the kernel
visits only the key blocks it lists and calls the mask only on the partial ones (where every query row sees
one run of keys, the forward masks those by each row's bounds instead: ``has_row_bounds``). The forward runs on
``fwd_sm90`` (sm_90a) or ``fwd_v2`` (every other GPU: ``dispatch.mod_family``), the backward on
``bwd_sm90`` (sm_90a, head-dim tiles 32 to 128, 192 and 256) or the mma.sync ``bwd_dkdv`` (every other
GPU, and head-dim tile 160; deterministic: the mma.sync pair ``bwd_dkdv_nodq`` + ``bwd_dq``): the
score_mod's derivative (``mods.derivative``) multiplies dS, the block mask is listed per key block
(``BlockMask.for_key_tile``; the dQ kernel's per query block, ``for_tile``). Captured tensors that require
grad get theirs from ``api.capturegrad`` (torch, a block of rows at a time).
"""
from __future__ import annotations

import ctypes
import threading

import torch

from .. import dispatch, families, mods
from ..codegen import load
from ..codegen.launch import ensure_context
from ..errors import UnsupportedError
from ..settings import logger
from ..problem import ProblemKey, bucket_of, bwd_head_dim_tile, head_dim_tile
from ..variants import Variant
from .backward import attention_backward
from .capturegrad import capture_grads
from .blockmask import BlockMask, create_block_mask
from .checks import DTYPES, check_attention_call, check_forced_spec, check_int32, contiguous_strides
from .device import Device, index_of
from .forward import Plan, tile_counters
from .plans import PlanCache

_plans = PlanCache("attention with mods")
# The block-mask sparsity (fraction of 128 x 128 blocks skipped) from which a call takes the causal key's
# tuned tile: a causal mask skips about half.
CAUSAL_LIKE = 0.3
# Block masks made for calls that pass a mask_mod without one, per (function, sizes, device): the
# newest few (a model's layers share one).
_made: dict = {}
_made_lock = threading.Lock()


def mod_forward(q, k, v, softmax_scale, layout, return_lse, spec, score_mod, mask_mod, block_mask):
    """The forward of ``attention(q, k, v, score_mod=..., mask_mod=..., block_mask=...)`` where q, k and v
    need no gradient: without autograd, unless a captured tensor requires grad (then ``mod_attention``)."""
    plan = _planned(q, k, v, softmax_scale, layout, return_lse, spec, score_mod, mask_mod, block_mask)
    if torch.is_grad_enabled() and any(t.requires_grad for t in plan.pair.captures):
        return mod_attention(q, k, v, softmax_scale, layout, return_lse, spec, score_mod, mask_mod, block_mask)
    out, lse = _launch(plan, q, k, v, return_lse)
    return (out, lse) if return_lse else out


def mod_attention(q, k, v, softmax_scale, layout, return_lse, spec, score_mod, mask_mod, block_mask,
                  deterministic: bool = False):
    """The same with gradients: q, k and v (``bwd_sm90`` or ``bwd_dkdv`` with the mods) and the captured
    tensors that require grad (``api.capturegrad``, with torch). The backward's kernel is chosen before the
    forward's launch, so what it cannot serve is refused then. ``deterministic`` (or
    ``torch.use_deterministic_algorithms(True)`` when the backward runs): dQ from the mma.sync pair, summed in a
    fixed order."""
    plan = _planned(q, k, v, softmax_scale, layout, True, spec, score_mod, mask_mod, block_mask)
    if plan.base.kernel is not None and (q.requires_grad or k.requires_grad or v.requires_grad):
        backward_of(plan, q, deterministic)  # (captures alone need no backward kernel)
    wanted = []  # the captures that require grad, each once (they join the function's inputs)
    for t in plan.pair.captures:
        if t.requires_grad and not any(t is w for w in wanted):
            wanted.append(t)
    out, lse = _ModAttention.apply(q, k, v, plan, layout, deterministic, *wanted)
    return (out, lse) if return_lse else out


class _ModAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, layout, deterministic, *wanted):
        out, lse = _launch(plan, q, k, v, True)
        ctx.save_for_backward(q, k, v, out, lse, *wanted)
        ctx.plan, ctx.layout, ctx.deterministic = plan, layout, deterministic
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *wanted = ctx.saved_tensors
        plan = ctx.plan
        if plan.base.kernel is None or (dout is None and dlse is None):
            return ((torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None, None)
                    + tuple(torch.zeros_like(t) for t in wanted))
        if dout is None:
            dout = torch.zeros_like(out)
        dq = dk = dv = None
        if any(ctx.needs_input_grad[:3]):
            det = ctx.deterministic or torch.are_deterministic_algorithms_enabled()
            dq, dk, dv = attention_backward(dout, q, k, v, out, lse, False, plan.scale, ctx.layout, deterministic=det,
                                            dlse=dlse, mods=backward_of(plan, q, det))
        extra = capture_grads(plan.pair, wanted, q, k, v, out, lse, dout, dlse, plan.scale, ctx.layout) if wanted \
            else []
        return (dq, dk, dv, None, None, None) + tuple(extra)


def _planned(q, k, v, softmax_scale, layout, return_lse, spec, score_mod, mask_mod, block_mask):
    """The call's plan: from the plan cache while the mods still trace to its graphs, else made."""
    try:
        sig = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
               q.device, k.device, v.device, softmax_scale, type(softmax_scale), layout, return_lse,
               type(return_lse), spec, score_mod, mask_mod, block_mask)
        plan = _plans.get(sig)
    except (AttributeError, TypeError):
        sig = plan = None
    if plan is not None and not plan.current():  # a captured tensor was rebound: trace again
        plan = None
    if plan is None:
        plan = _plan(q, k, v, softmax_scale, layout, return_lse, spec, score_mod, mask_mod, block_mask)
        if sig is not None:
            _plans.put(sig, plan)
    return plan


def _launch(plan, q, k, v, return_lse):
    """(out, lse or None) of the plan's forward on these tensors."""
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        raise ValueError("q, k, v must be 16-byte aligned (16-byte loads), got addresses "
                         f"{q.data_ptr():#x}, {k.data_ptr():#x}, {v.data_ptr():#x}")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty(plan.base.lse_shape, dtype=torch.float32) if return_lse else None
    if plan.base.kernel is not None:
        ensure_context(plan.base.device_index)  # (a thread's first CUDA call: none may be current)
        params = plan.base.params_for(q.data_ptr(), k.data_ptr(), v.data_ptr())
        params.o = out.data_ptr()
        params.lse = lse.data_ptr() if lse is not None else 0
        fill_mods(params, plan.offset, plan.blob)
        if plan.base.counters:
            params.sched = tile_counters(plan.base.device_index)
        plan.base.launch(params)
    return out, lse


def fill_mods(params, offset: int, blob: bytes) -> None:
    """Copy a packed range of mod fields (``pack_mod_fields``) into a launch's parameter block."""
    ctypes.memmove(ctypes.addressof(params) + offset, blob, len(blob))


class _ModPlan:
    """A checked call with mods: the forward's plan (``base``) and what each launch adds to its parameter
    block, packed once (``blob`` at ``offset``): the captured tensors' addresses, strides and sizes and
    the block mask's lists at the kernel's tile and, for a ``row_bounds`` kernel, its row bounds (all kept
    alive here; ``current`` guards that the captures are still the traced ones)."""

    __slots__ = ("base", "pair", "captures", "tiles", "rows", "functions", "offset", "blob", "block_mask", "scale",
                 "backward")

    def __init__(self, base, pair, tiles, functions, struct=None, block_mask=None, scale=None, rows=None):
        self.base, self.pair, self.tiles, self.rows, self.functions = base, pair, tiles, rows, functions
        self.block_mask, self.scale, self.backward = block_mask, scale, {}  # deterministic -> ModBackward
        self.captures = tuple(pair.captures)
        self.offset, self.blob = 0, b""
        if struct is not None:
            self.offset, self.blob = pack_mod_fields(struct, self.captures, tiles, rows)

    def current(self) -> bool:
        return still_traced(self.pair, self.functions)


def still_traced(pair, functions) -> bool:
    """Whether the mod ``functions`` (score_mod, mask_mod) still trace to ``pair``'s graphs: the tracer's cache
    answers from a fingerprint of what each function reads (a captured global rebound to another tensor, a
    changed constant: a new graph, and a new plan)."""
    score_fn, mask_fn = functions
    return ((score_fn is None or mods.trace_score_mod(score_fn) is pair.score)
            and (mask_fn is None or mods.trace_mask_mod(mask_fn) is pair.mask))



def pack_mod_fields(struct, captures, tiles, rows=None) -> tuple[int, bytes]:
    """(offset, bytes) of a parameter block's mod fields (families.base.MOD_PARAMS, contiguous from ``mod``
    to ``bm_nb``, then MOD_ROWS_PARAMS to ``bm_rsh`` in the forward families' and bwd_sm90's blocks) for these
    captures, block lists and row bounds (``BlockMask.row_bounds``; None: null)."""
    scratch = struct()
    args = scratch.mod
    for slot, t in enumerate(captures):
        args.t[slot] = t.data_ptr()
        sizes, strides = list(t.shape) + [1] * (4 - t.dim()), list(t.stride()) + [0] * (4 - t.dim())
        for axis in range(4):
            args.s[slot][axis], args.n[slot][axis] = strides[axis], sizes[axis]
    if tiles is not None:
        scratch.bm_count, scratch.bm_index = tiles.counts.data_ptr(), tiles.index.data_ptr()
        scratch.bm_sb, scratch.bm_sh, scratch.bm_nb = block_strides(tiles) + (tiles.index.shape[-1],)
    last = struct.bm_rsh if hasattr(struct, "bm_rsh") else struct.bm_nb
    if rows is not None:
        if last is struct.bm_nb:
            raise ValueError(f"{struct.__name__} has no row bounds fields")
        bm, hm, nq, _ = rows.shape
        scratch.bm_rows = rows.data_ptr()
        scratch.bm_rsb, scratch.bm_rsh = (hm * nq if bm > 1 else 0), (nq if hm > 1 else 0)
    start, end = struct.mod.offset, last.offset + ctypes.sizeof(ctypes.c_int32)
    return start, bytes(scratch)[start:end]


def mod_meta(q, k, v, softmax_scale, layout, return_lse, score_mod, mask_mod, block_mask):
    """The call on meta tensors (``device="meta"`` model tooling, FLOP counters): every check of the
    arguments, the mods traced (captured tensors may sit on any device here), and outputs of the right
    shapes (no kernel, no block mask made, no autograd: a forward's shapes)."""
    (b, h, nq, _), *_ = _checked(q, k, v, softmax_scale, layout, return_lse, score_mod, mask_mod, block_mask,
                                 allow_cpu=True)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return (out, q.new_empty((b, h, nq), dtype=torch.float32)) if return_lse else out


def _checked(q, k, v, softmax_scale, layout, return_lse, score_mod, mask_mod, block_mask, allow_cpu=False):
    """The call's checks and traces: (dims (b, h, nq, d), strides of q, (hk, nk), strides of k, of v, the
    softmax scale, the mask_mod (the block mask's where one is given), the traced pair)."""
    (b, h, nq, d), sq, (hk, nk), sk, sv, scale, _ = check_attention_call(
        q, k, v, False, softmax_scale, layout, return_lse, None, 0.0, None, None)
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a flashgen BlockMask (flashgen.create_block_mask), got "
                        f"{type(block_mask).__name__}")
    check_mod_functions(score_mod, mask_mod)
    if block_mask is not None:
        if mask_mod is not None and mask_mod is not block_mask.mask_mod:
            raise ValueError("mask_mod and block_mask.mask_mod differ: pass one of them (the block mask "
                             "carries its mask_mod)")
        mask_mod = block_mask.mask_mod
        check_block_mask_shape(block_mask, b, h, nq, nk)
    pair = traced_pair(q, score_mod, mask_mod, allow_cpu)
    return (b, h, nq, d), sq, (hk, nk), sk, sv, scale, mask_mod, pair


def check_mod_functions(score_mod, mask_mod) -> None:
    """TypeError unless each given mod is a function."""
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be a function (score, b, h, q_idx, kv_idx) -> score, got {score_mod!r}")
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(f"mask_mod must be a function (b, h, q_idx, kv_idx) -> bool, got {mask_mod!r}")


def traced_pair(q, score_mod, mask_mod, allow_cpu: bool = False):
    """The traced pair of a call's mods (``flashgen.mods``; ``ModError`` for what the tracer refuses);
    ValueError for a captured tensor off q's device (``allow_cpu``: the meta path, which launches nothing)."""
    found = mods.trace_pair(score_mod, mask_mod, allow_cpu=allow_cpu)
    for t in found.captures:
        if t.device != q.device and not allow_cpu:
            raise ValueError(f"a mod captures a tensor on {t.device}; q is on {q.device}: captured tensors must be "
                             "on q's device")
    return found


def _plan(q, k, v, softmax_scale, layout, return_lse, spec, score_mod, mask_mod, block_mask):
    (b, h, nq, d), sq, (hk, nk), sk, sv, scale, mask_mod, pair = _checked(
        q, k, v, softmax_scale, layout, return_lse, score_mod, mask_mod, block_mask)
    score_graph, mask_graph = pair.score, pair.mask
    index = index_of(q)
    functions = (score_mod, mask_mod)
    if not (nq and b and h):
        return _ModPlan(Plan(None, None, index, (b, h, nq)), pair, None, functions)
    dev = Device.of(index)
    mods.register(pair)
    if mask_graph is not None and block_mask is None:
        block_mask = _made_for(mask_mod, b, h, nq, nk, q.device)
    k_in, c_out = pair.factors  # a score_mod c f(k score): k joins the scale, c the softmax's (Graph.factors)
    if not 2.0 ** -126 <= abs(scale * k_in) < 2.0 ** 127:
        raise UnsupportedError(f"score_mod's constant factor {k_in!r} on the score times the softmax scale {scale!r} "
                               "leaves float32's normal range")
    if spec is None:
        # A block mask that skips much of the square (causal, windows, documents) takes the causal key's tile.
        spec = mod_spec(DTYPES[q.dtype], d, nq, dev, pair, causal_like=causal_like(block_mask),
                        row_bounds=has_row_bounds(block_mask))
    else:
        key = ProblemKey("fwd", dev.arch, DTYPES[q.dtype], head_dim_tile(d), False, bucket_of(nq), "")
        if getattr(spec, "kind", None) not in dispatch.MOD_FAMILIES:
            raise UnsupportedError(f"score_mod / mask_mod run on {' or '.join(dispatch.MOD_FAMILIES)} specs, got "
                                   f"{getattr(spec, 'name', spec)!r}")
        check_forced_spec(spec, {"kind": dispatch.MOD_FAMILIES, "dtype": key.dtype, "arch": dev.arch, "causal": False,
                                 "mod": mods.token_number(pair)}, d, dev.smem_budget)
    rows = _row_bounds(spec, block_mask)
    kern = load(spec, dev.index)
    fam = families.family(spec.kind)
    dims = (b, h, hk, nq, nk, d)
    o_strides = contiguous_strides(q.shape, layout)  # the output is allocated like q
    grid, params_for = fam.launch(kern, dims, (sq, sk, sv), o_strides, scale * k_in, dev,
                                  Variant(scored=score_graph is not None, score_factor=c_out,
                                          linear=fam.linear_mod(spec)))
    base = Plan(kern, grid, dev.index, (b, h, nq), params_for, fam.needs_tile_counters(spec))
    tiles = None
    if mask_graph is not None:
        tiles = block_mask.for_tile(spec.block_m, spec.block_n)
        check_int32("the block mask's rows", tiles.counts.numel())
    return _ModPlan(base, pair, tiles, functions, fam.param_struct(), block_mask, scale, rows)


def _row_bounds(spec, block_mask):
    """A ``row_bounds`` kernel's row bounds (``BlockMask.row_bounds``), None for any other kernel;
    UnsupportedError where the call has no mask_mod or one of its rows sees two runs of keys."""
    if not spec.row_bounds:
        return None
    if block_mask is None:
        raise UnsupportedError(f"{spec.name} masks by each query row's bounds: the call needs a mask_mod")
    rows = block_mask.row_bounds()
    if rows is None:
        raise UnsupportedError(f"{spec.name} masks by each query row's bounds: this mask has a row that sees more "
                               "than one run of keys")
    check_int32("the block mask's row bounds", rows.numel())
    return rows


def block_strides(tiles) -> tuple[int, int]:
    """A block mask table's (batch, head) strides in rows of its lists (``TileBlocks``, either direction):
    0 where the mask does not depend on the batch or the head."""
    rows = tiles.counts.shape[-1]
    return (tiles.counts.shape[1] * rows if tiles.counts.shape[0] > 1 else 0,
            rows if tiles.counts.shape[1] > 1 else 0)


class ModBackward:
    """What the backward of a call with mods gives ``attention_backward``: the dK/dV kernel's ``spec``
    (``bwd_sm90``, or the mma.sync ``bwd_dkdv`` where that has no tile, with the pair's token:
    ``dispatch.mod_backward_spec``; ``deterministic``: the mma.sync pair, ``bwd_dkdv_nodq`` and ``dq_spec``,
    ``bwd_dq``: ``dispatch.mod_backward_pair``), its ``variant`` (the score_mod folded as the forward's:
    ``score_in`` = k joins the scale before f, c the softmax's units), the gradients' factor ``grad_factor``
    = c k (dS picks up f' in the kernel) and each kernel's mod fields (captures, the block mask listed per
    key block for the dK/dV kernel, ``BlockMask.for_key_tile``, and per query block for the dQ kernel,
    ``for_tile``), packed once."""

    def __init__(self, plan: "_ModPlan", q, deterministic: bool = False):
        dev = Device.of(index_of(q))
        pair = plan.pair
        d = q.shape[-1]
        key = ProblemKey("bwd_dkdv", dev.arch, DTYPES[q.dtype], bwd_head_dim_tile(d, dev.arch), False,
                         bucket_of(plan.base.lse_shape[-1]), "")
        token = mods.token_number(pair)
        self.deterministic = deterministic
        self.dq_spec = None
        if deterministic:
            self.spec, self.dq_spec = dispatch.mod_backward_pair(key, dev.smem_budget, token, verify=True)
        else:
            rows = dispatch.mod_backward_row_bounds(pair) and has_row_bounds(plan.block_mask)
            self.spec = dispatch.mod_backward_spec(key, dev.smem_budget, token, verify=True, row_bounds=rows)
        # Spills only where no tile builds clean (dispatch.mod_backward_spec): taken, and said once (the
        # load still refuses any other problem).
        problems = dispatch.resource_problems(self.spec)
        if problems:
            logger().info("mods %s: the backward kernel %s spills (%s): no %s tile holds this mod's functions "
                          "in registers; it runs anyway", pair.token, self.spec.name, "; ".join(problems),
                          self.spec.kind)
        k_in, c_out = pair.factors
        self.score_in, self.grad_factor = k_in, k_in * c_out
        self.variant = Variant(scored=pair.score is not None, score_factor=c_out)
        captures = tuple(pair.captures)
        self.tiles, self.offset, self.blob = self._fields(plan, self.spec, captures, by_key=True)
        if self.dq_spec is not None:
            self.dq_tiles, self.dq_offset, self.dq_blob = self._fields(plan, self.dq_spec, captures, by_key=False)

    @staticmethod
    def _fields(plan, spec, captures, by_key: bool):
        """(the block lists at ``spec``'s tile, kept alive with the captures while the plan lives, and the packed
        mod fields of its parameter block, with the row bounds for a ``row_bounds`` kernel: the block mask's,
        which it keeps)."""
        tiles = None
        if plan.pair.mask is not None:
            tiles = (plan.block_mask.for_key_tile if by_key else plan.block_mask.for_tile)(spec.block_m, spec.block_n)
            check_int32("the block mask's rows", tiles.counts.numel())
        rows = _row_bounds(spec, plan.block_mask)
        return (tiles, *pack_mod_fields(families.family(spec.kind).param_struct(), captures, tiles, rows))

    def fill(self, params) -> None:
        fill_mods(params, self.offset, self.blob)

    def fill_dq(self, params) -> None:
        """The dQ kernel's (``deterministic``)."""
        fill_mods(params, self.dq_offset, self.dq_blob)


def backward_of(plan: "_ModPlan", q, deterministic: bool = False) -> ModBackward:
    """The plan's backward part (``deterministic``: its deterministic one), made on first use (the plan
    cache keeps it)."""
    found = plan.backward.get(deterministic)
    if found is None:
        found = plan.backward[deterministic] = ModBackward(plan, q, deterministic)
    return found


def mod_spec(dtype: str, d: int, nq: int, dev, pair, verify: bool = True, causal_like: bool = False,
             family: str | None = None, row_bounds: bool | str = False):
    """The kernel of a call with mods on this device (``dispatch.mod_spec``; ``causal_like``: a block mask
    that skips much of the square takes the causal key's tile; ``family``: fwd_sm90 or fwd_v2, by default
    ``dispatch.mod_family``'s; ``row_bounds``: a block mask whose rows each see one run of keys)."""
    key = ProblemKey("fwd", dev.arch, dtype, head_dim_tile(d), causal_like, bucket_of(nq), "")
    return dispatch.mod_spec(key, dev.gpu, dev.smem_budget, mods.token_number(pair), verify, family, row_bounds)


def causal_like(block_mask) -> bool:
    """Whether a block mask skips much of the square (causal, windows, documents): its call takes the causal
    key's tile."""
    return block_mask is not None and block_mask.sparsity() >= CAUSAL_LIKE


def has_row_bounds(block_mask) -> bool:
    """Whether every query row of a block mask sees one run of keys (causal, windows, documents, prefix-LM;
    ``BlockMask.row_bounds``): its call's kernel masks the partial blocks by each row's first and last
    visible key instead of calling the mask_mod per score (``KernelSpec.row_bounds``)."""
    return block_mask is not None and block_mask.row_bounds() is not None


def call_spec(q, score_mod, block_mask, family: str | None = None, row_bounds: bool | str | None = None):
    """The forward kernel ``flashgen.attention(q, ..., score_mod=score_mod, block_mask=block_mask)`` runs (q in
    the bhsd layout; ``family``: fwd_sm90 or fwd_v2 instead of ``dispatch.mod_family``'s; ``row_bounds``: the
    pick with or without them instead of the call's ``has_row_bounds``, "first": with them on the first tile
    where they build clean), the pair traced and registered: for benchmarks and tests that force a variant of it."""
    pair = mods.trace_pair(score_mod, block_mask.mask_mod if block_mask is not None else None)
    mods.register(pair)
    rows = has_row_bounds(block_mask) if row_bounds is None else row_bounds
    return mod_spec(DTYPES[q.dtype], q.shape[-1], q.shape[-2], Device.of(index_of(q)), pair,
                    causal_like=causal_like(block_mask), family=family, row_bounds=rows)


def check_block_mask_shape(block_mask, b: int, h: int, nq: int, nk: int) -> None:
    """``ValueError`` unless the block mask was made for this call's sizes (batch and heads may be 1: broadcast)."""
    mb, mh, mq, mk = block_mask.shape
    if (mq, mk) != (nq, nk) or mb not in (1, b) or mh not in (1, h):
        raise ValueError(f"block_mask was made for (B, H, Q_LEN, KV_LEN) = {block_mask.shape}; this call is "
                         f"({b}, {h}, {nq}, {nk}) (B and H may be 1 or None there: broadcast)")


def _made_for(mask_mod, b, h, nq, nk, device):
    key = (mask_mod, b, h, nq, nk, device)
    with _made_lock:
        found = _made.get(key)
    if found is None:
        found = create_block_mask(mask_mod, b, h, nq, nk, device=device)
        with _made_lock:
            if len(_made) >= 8:
                _made.pop(next(iter(_made)))
            _made[key] = found
    return found
