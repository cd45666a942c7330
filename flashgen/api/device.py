"""What the torch layer needs to know of a CUDA device and of torch's current stream.

``Device.of(index)`` is looked up once per device: the compile target, the GPU
profile (for the tuned tables), the shared-memory budget per block, the SM
count, shared memory per SM and the L2 size. ``current_stream`` and
``current_device`` are torch's private fast paths (the public ones cost
microseconds each: they build Python Stream objects), with public fallbacks.
"""
from __future__ import annotations

import torch

from .. import gpus


class Device:
    """One CUDA device's facts, looked up once."""

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
        self.sms = int(props.multi_processor_count)
        self.smem_per_sm = int(getattr(props, "shared_memory_per_multiprocessor", 0) or 0) or self.smem_budget + 1024
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or 0) or 50 << 20

    @classmethod
    def of(cls, index: int) -> "Device":
        dev = cls._cache.get(index)
        if dev is None:
            dev = cls._cache[index] = cls(index)
        return dev


def index_of(t: torch.Tensor) -> int:
    """The CUDA device index of a CUDA tensor (the current device for a bare ``cuda``)."""
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


if hasattr(torch._C, "_cuda_getCurrentRawStream") and hasattr(torch._C, "_cuda_getDevice"):
    current_stream = torch._C._cuda_getCurrentRawStream
    current_device = torch._C._cuda_getDevice
else:  # pragma: no cover
    def current_stream(idx):
        return torch.cuda.current_stream(idx).cuda_stream

    current_device = torch.cuda.current_device

is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing
is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


def launch_all(index: int, launches) -> None:
    """Enqueue ``launches`` ((kernel, grid, params), ...) in order on device ``index``'s current stream."""
    if index == current_device():
        stream = current_stream(index)
        for kern, grid, params in launches:
            kern.launch(grid, params, stream)
    else:
        with torch.cuda.device(index):
            stream = current_stream(index)
            for kern, grid, params in launches:
                kern.launch(grid, params, stream)
