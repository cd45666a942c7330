"""Load compiled kernels on the GPU and launch them on torch's current stream."""
from __future__ import annotations

import ctypes
import threading

from .. import settings
from ..errors import CompileError
from .compiler import build

_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

_ARGV = ctypes.c_void_p * 1  # the kernel's one argument: the address of its parameter struct
_loaded: dict = {}
_lock = threading.Lock()


class Kernel:
    """One loaded kernel: its spec, binary and CUDA function handle."""

    def __init__(self, spec, binary, module, function, device_index: int):
        self.spec = spec
        self.binary = binary
        self.smem = spec.smem_bytes()
        self.threads = spec.warps * 32
        self._module = module  # keeps the module (and so the function) alive
        self._function = function
        self._fptr = function.ptr
        self._struct = spec.family.param_struct()
        self.device_index = device_index
        from cupy_backends.cuda.api import driver

        self._launch_kernel = driver.launchKernel  # bound once: an import per launch costs ~0.5 us


    def params(self, **values):
        return self._struct(**values)

    def launch(self, grid: tuple[int, int, int], params, stream: int) -> None:
        """Enqueue on ``stream`` (a raw CUstream handle); params is the family's ctypes struct."""
        argv = _ARGV(ctypes.addressof(params))
        self._launch_kernel(self._fptr, grid[0], grid[1], grid[2], self.threads, 1, 1, self.smem, stream,
                            ctypes.addressof(argv), 0)


def load_kernel(spec, device_index: int) -> Kernel:
    """The kernel of ``spec`` on CUDA device ``device_index``, compiled or loaded once per process."""
    key = (spec, device_index)
    kern = _loaded.get(key)
    if kern is not None:
        return kern
    with _lock:
        kern = _loaded.get(key)
        if kern is not None:
            return kern
        binary = build(spec)
        problems = binary.report.problems()
        if problems and not settings.allow_spills():  # study only: time a spilling tile
            raise CompileError(f"{spec.name}: refused by its resource report: {'; '.join(problems)}", log=binary.log)
        import cupy
        from cupy_backends.cuda.api import driver

        with cupy.cuda.Device(device_index):
            module = cupy.cuda.function.Module()
            module.load(binary.cubin)
            function = module.get_function(spec.name)
            smem = spec.smem_bytes()
            # The 48 KB default covers static and dynamic shared memory together.
            if smem + binary.report.static_smem > 48 * 1024:
                driver.funcSetAttribute(function.ptr, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        kern = Kernel(spec, binary, module, function, device_index)
        _loaded[key] = kern
        return kern
