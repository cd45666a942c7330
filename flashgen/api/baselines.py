"""Plans and launches of ``flashgen.attention(..., algorithm="v1" | "standard")``.

``attention`` checks the inputs and then hands the checked sizes here; the plan
returned is cached per call signature like the forward's, and its
``run`` allocates the per-call buffers and launches on torch's current stream:

- ``standard``: an S/P buffer of batch x heads x nq x ld elements (ld = nk
  rounded up to 8), refused with ``UnsupportedError`` before any launch when it
  does not fit in the device's free memory; then S = scale QK^T, the softmax in
  place (with the LSE), O = PV.
- ``v1``: fp32 partial O (batch x heads x nq x head-dim tile), (m, l) pairs and
  zeroed ordering counters; one launch (templates/fwd_v1/fwd_v1.cuh).
"""
from __future__ import annotations

import math

import torch

from .. import dispatch
from ..codegen import load
from ..errors import UnsupportedError
from ..families import fwd_v1, standard
from ..families.base import forward_values
from ..problem import ProblemKey, bucket_of, head_dim_tile
from .checks import check_forced_spec
from .device import current_stream

KINDS = {"standard": standard.KINDS, "v1": (fwd_v1.KIND,)}


def _select(kind, dev, dtype, d, causal, nq):
    key = ProblemKey(kind, dev.arch, dtype, head_dim_tile(d), causal, bucket_of(nq))
    return dispatch.select(key, dev.gpu, dev.smem_budget, verify=True)


def _specs(algorithm, spec, dev, dtype, d, causal, nq):
    kinds = KINDS[algorithm]
    if spec is None:
        return [_select(kind, dev, dtype, d, causal, nq) for kind in kinds]
    forced = list(spec) if algorithm == "standard" and isinstance(spec, (tuple, list)) else [spec]
    if len(forced) != len(kinds):
        raise ValueError(f"algorithm={algorithm!r} takes spec= as {'a tuple of ' if len(kinds) > 1 else ''}"
                         f"{len(kinds)} KernelSpec{'s' if len(kinds) > 1 else ''} ({', '.join(kinds)})")
    for s, kind in zip(forced, kinds):
        check_forced_spec(s, {"kind": kind, "dtype": dtype, "causal": causal, "arch": dev.arch}, d, dev.smem_budget)
    return forced


class _Launch:
    """One kernel, its grid and its parameter block with the per-call pointers left to fill."""

    def __init__(self, kern, grid, **values):
        self.kern, self.grid = kern, grid
        template = kern.params(**values)
        self._struct, self._bytes = type(template), bytes(template)

    def __call__(self, stream, **pointers):
        params = self._struct.from_buffer_copy(self._bytes)
        for name, value in pointers.items():
            setattr(params, name, value)
        self.kern.launch(self.grid, params, stream)


class BaselinePlan:
    """A checked call of ``algorithm`` for one signature; ``run(q, k, v, return_lse)`` does the work."""

    def __init__(self, algorithm, dev, dims, lse_shape, launches, buffers):
        self.algorithm, self.dev, self.dims, self.lse_shape = algorithm, dev, dims, lse_shape
        self.launches, self.buffers = launches, buffers

    def _stream(self):
        return current_stream(self.dev.index)

    def run(self, q, k, v, return_lse):
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device) if return_lse else None
        if not self.launches:  # no keys: every row sees nothing
            out.zero_()
            if lse is not None:
                lse.fill_(-math.inf)
            return (out, lse) if return_lse else out
        with torch.cuda.device(self.dev.index):
            bufs = self._allocate(q.device)
            stream = self._stream()
            ptrs = {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "o": out.data_ptr(),
                    "lse": lse.data_ptr() if lse is not None else 0,
                    **{name: t.data_ptr() for name, t in bufs.items()}}
            for launch in self.launches:
                launch(stream, **{n: p for n, p in ptrs.items() if hasattr(launch._struct, n)})
        return (out, lse) if return_lse else out

    def _allocate(self, device):
        out = {}
        for name, (numel, dtype, zero) in self.buffers.items():
            if name == "s":
                _check_fits(numel * torch.empty((), dtype=dtype).element_size(), self.dims, self.dev.index)
            try:
                out[name] = (torch.zeros if zero else torch.empty)(max(numel, 1), dtype=dtype, device=device)
            except torch.OutOfMemoryError:
                raise UnsupportedError(f"{self.algorithm} attention: could not allocate its {name} buffer of "
                                       f"{numel} {dtype} elements for {self.dims}") from None
        return out


def _check_fits(nbytes, dims, index):
    """UnsupportedError when the N x N buffer cannot fit in the device's free memory (plus what torch's
    allocator holds unused)."""
    free, _ = torch.cuda.mem_get_info(index)
    avail = free + torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
    if nbytes > avail:
        b, h, nq, nk = dims
        raise UnsupportedError(f"standard attention needs its S/P buffer of {b} x {h} x {nq} x {nk} "
                               f"({nbytes / 2**30:.2f} GiB), more than the {avail / 2**30:.2f} GiB free on "
                               f"cuda:{index}; use algorithm='v2' (no N x N buffer)")


def plan(algorithm, spec, causal, dev, dtype, dims, strides, o_strides, scale):
    """Build the plan of ``algorithm`` ("v1" or "standard") for checked sizes (see ``attention``)."""
    b, h, hk, nq, nk, d = dims
    specs = _specs(algorithm, spec, dev, dtype, d, causal, nq)
    common = forward_values(dims, strides, o_strides, scale)
    scale_log2 = common.pop("scale_log2")
    launches, buffers = [], {}
    if nk > 0:
        kerns = [load(s, dev.index) for s in specs]
        if algorithm == "v1":
            (s,) = specs
            n_qb, n_kb = -(-nq // s.block_m), -(-nk // s.block_n)
            launches.append(_Launch(kerns[0], (n_kb, h, b), **common, scale_log2=scale_log2))
            buffers = {"acc": (b * h * nq * s.head_dim if n_kb > 1 else 0, torch.float32, False),
                       "ml": (b * h * nq * 2 if n_kb > 1 else 0, torch.float32, False),
                       "sync": (b * h * (1 + n_qb), torch.int32, True)}
        else:
            qk, sm, pv = specs
            ld = -(-nk // 8) * 8
            grids = (((-(-nq // qk.block_m)) * (-(-nk // qk.block_n)), h, b), (-(-nq // sm.block_m), h, b),
                     (-(-nq // pv.block_m), h, b))
            launches = [_Launch(kern, grid, **common, s_ld=ld) for kern, grid in zip(kerns, grids)]
            buffers = {"s": (b * h * nq * ld, torch.float16 if dtype == "fp16" else torch.bfloat16, False)}
            if grids[0][0] >= 2**31:
                raise UnsupportedError(f"standard attention: {grids[0][0]} tiles exceed the grid limit")
    return BaselinePlan(algorithm, dev, (b, h, nq, nk), (b, h, nq), launches, buffers)
