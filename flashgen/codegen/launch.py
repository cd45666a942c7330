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


def _cu():
    """libcuda through ctypes, for the calls made once per kernel (loading it). CuPy's driver module
    imports all of cupy on its first call (about 0.2 s of a new process's first result); launches still
    go through it (``Kernel.launch``: a compiled call, cheaper per launch than ctypes)."""
    global _libcuda
    if _libcuda is None:
        c = ctypes
        lib = c.CDLL("libcuda.so.1")
        for name, args in (("cuCtxGetCurrent", [c.POINTER(c.c_void_p)]), ("cuCtxGetDevice", [c.POINTER(c.c_int)]),
                           ("cuDevicePrimaryCtxRetain", [c.POINTER(c.c_void_p), c.c_int]),
                           ("cuCtxPushCurrent", [c.c_void_p]), ("cuCtxSetCurrent", [c.c_void_p]),
                           ("cuCtxPopCurrent", [c.POINTER(c.c_void_p)]),
                           ("cuModuleLoadData", [c.POINTER(c.c_void_p), c.c_char_p]),
                           ("cuModuleGetFunction", [c.POINTER(c.c_void_p), c.c_void_p, c.c_char_p]),
                           ("cuFuncSetAttribute", [c.c_void_p, c.c_int, c.c_int]), ("cuModuleUnload", [c.c_void_p]),
                           ("cuGetErrorString", [c.c_int, c.POINTER(c.c_char_p)])):
            # The push and pop are the _v2 entry points (cuda.h's #defines): the unversioned ones are CUDA
            # 3.x's, whose push refuses a context current in another thread (CUDA_ERROR_INVALID_CONTEXT), as
            # torch's primary context is when a kernel is first loaded in the autograd engine's thread.
            fn = getattr(lib, name + "_v2" if name in ("cuCtxPushCurrent", "cuCtxPopCurrent") else name)
            fn.argtypes, fn.restype = args, c.c_int
            setattr(lib, name, fn)
        _libcuda = lib
    return _libcuda


_libcuda = None


def _check(code: int, what: str) -> None:
    if code:
        msg = ctypes.c_char_p()
        _cu().cuGetErrorString(code, ctypes.byref(msg))
        raise CompileError(f"{what} failed: CUDA error {code} ({(msg.value or b'?').decode()})")


class _Module:
    """A loaded CUDA module, unloaded when the last kernel holding it goes."""

    def __init__(self, handle: int):
        self.handle = handle

    def __del__(self):
        try:
            _cu().cuModuleUnload(self.handle)
        except Exception:  # noqa: BLE001 -- at interpreter exit the driver may be gone first
            pass


def _load_module(cubin: bytes, name: str, smem: int, static_smem: int, device_index: int) -> tuple:
    """(module, function handle) of kernel ``name`` in ``cubin``, loaded into device ``device_index``'s
    primary context (torch's): the current context when it is that one, else pushed for the load."""
    cu, c = _cu(), ctypes
    ctx, dev = c.c_void_p(), c.c_int(-1)
    _check(cu.cuCtxGetCurrent(c.byref(ctx)), "cuCtxGetCurrent")
    if ctx.value:
        _check(cu.cuCtxGetDevice(c.byref(dev)), "cuCtxGetDevice")
    pushed = not ctx.value or dev.value != device_index
    if pushed:
        _check(cu.cuCtxPushCurrent(_primary(device_index)), "cuCtxPushCurrent")
    try:
        handle, function = c.c_void_p(), c.c_void_p()
        _check(cu.cuModuleLoadData(c.byref(handle), cubin), f"loading {name}")
        module = _Module(handle.value)
        _check(cu.cuModuleGetFunction(c.byref(function), module.handle, name.encode()), f"finding {name}")
        if smem + static_smem > 48 * 1024:  # the 48 KB default covers static and dynamic shared memory together
            _check(cu.cuFuncSetAttribute(function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                         smem), f"{name}: dynamic shared memory")
    finally:
        if pushed:
            _check(cu.cuCtxPopCurrent(c.byref(c.c_void_p())), "cuCtxPopCurrent")
    return module, function.value


def _entry(module: _Module, name: str, device_index: int) -> int:
    """The function handle of entry ``name`` of a loaded module (in device ``device_index``'s context)."""
    cu, c = _cu(), ctypes
    pushed = False
    ctx = c.c_void_p()
    _check(cu.cuCtxGetCurrent(c.byref(ctx)), "cuCtxGetCurrent")
    if ctx.value != _primary(device_index):
        _check(cu.cuCtxPushCurrent(_primary(device_index)), "cuCtxPushCurrent")
        pushed = True
    try:
        function = c.c_void_p()
        _check(cu.cuModuleGetFunction(c.byref(function), module.handle, name.encode()), f"finding {name}")
    finally:
        if pushed:
            _check(cu.cuCtxPopCurrent(c.byref(c.c_void_p())), "cuCtxPopCurrent")
    return function.value


_primaries: dict = {}
_threads = threading.local()


def ensure_context(device_index: int) -> None:
    """Make device ``device_index``'s primary context (torch's) current in this thread if none is: a thread
    that has made no CUDA runtime call yet has none (the autograd engine's, when flashgen's backward is the
    first thing it runs), and the driver calls of a launch (tensor maps, the launch itself) then fail with
    CUDA_ERROR_INVALID_CONTEXT. Checked once per thread and device."""
    seen = getattr(_threads, "devices", None)
    if seen is None:
        seen = _threads.devices = set()
    if device_index in seen:
        return
    ctx = ctypes.c_void_p()
    _check(_cu().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        _check(_cu().cuCtxSetCurrent(_primary(device_index)), "cuCtxSetCurrent")
    seen.add(device_index)


def _primary(device_index: int) -> int:
    """Device ``device_index``'s primary context (torch's), retained once for the process and never
    released: a module lives in the context it was loaded into, and releasing the last reference (a load
    before torch had touched the device) destroyed that context with the module in it, so the first
    launch after torch's own initialisation failed with CUDA_ERROR_INVALID_HANDLE."""
    primary = _primaries.get(device_index)
    if primary is None:
        handle = ctypes.c_void_p()
        _check(_cu().cuDevicePrimaryCtxRetain(ctypes.byref(handle), device_index), "cuDevicePrimaryCtxRetain")
        primary = _primaries[device_index] = handle.value
    return primary


class Kernel:
    """One loaded kernel: its spec, binary and CUDA function handle."""

    def __init__(self, spec, binary, module, function, device_index: int):
        self.spec = spec
        self.binary = binary
        self.smem = spec.smem_bytes()
        self.threads = spec.warps * 32
        self._module = module  # keeps the module (and so the function) alive
        self._fptr = function
        self._struct = spec.family.param_struct()
        self.device_index = device_index
        from cupy_backends.cuda.api import driver

        self._launch_kernel = driver.launchKernel  # bound once: an import per launch costs ~0.5 us
        self._entries: dict = {}


    def params(self, **values):
        return self._struct(**values)

    def launch_entry(self, suffix: str, threads: int, params, stream: int) -> None:
        """Enqueue the module's second entry ``{name}{suffix}`` (one CTA of ``threads``, static shared
        memory only) on ``stream`` with the kernel's own parameter block: a varlen spec's ``_tiles``, the
        work-list builder (templates/common/varlen.cuh)."""
        fptr = self._entries.get(suffix)
        if fptr is None:
            fptr = self._entries[suffix] = _entry(self._module, self.spec.name + suffix, self.device_index)
        argv = _ARGV(ctypes.addressof(params))
        self._launch_kernel(fptr, 1, 1, 1, threads, 1, 1, 0, stream, ctypes.addressof(argv), 0)

    def launch(self, grid: tuple[int, int, int], params, stream: int) -> None:
        """Enqueue on ``stream`` (a raw CUstream handle); params is the family's ctypes struct."""
        argv = _ARGV(ctypes.addressof(params))
        self._launch_kernel(self._fptr, grid[0], grid[1], grid[2], self.threads, 1, 1, self.smem, stream,
                            ctypes.addressof(argv), 0)

    def launch_after(self, suffix: str, threads: int, grid: tuple[int, int, int], params, stream: int) -> None:
        """``launch_entry(suffix, threads, params, stream)`` then ``launch(grid, params, stream)``, from one
        argument array (the driver copies the parameter block at each enqueue, so both may share it)."""
        fptr = self._entries.get(suffix)
        if fptr is None:
            fptr = self._entries[suffix] = _entry(self._module, self.spec.name + suffix, self.device_index)
        argv = _ARGV(ctypes.addressof(params))
        args = ctypes.addressof(argv)
        launch = self._launch_kernel
        launch(fptr, 1, 1, 1, threads, 1, 1, 0, stream, args, 0)
        launch(self._fptr, grid[0], grid[1], grid[2], self.threads, 1, 1, self.smem, stream, args, 0)


def load_kernel(spec, device_index: int, accept_spills: bool = False) -> Kernel:
    """The kernel of ``spec`` on CUDA device ``device_index``, compiled or loaded once per process.
    A binary with resource problems is refused, except spills and local memory where ``accept_spills``
    (a caller that has no clean tile to take: ``dispatch.mod_backward_spec``)."""
    key = (spec, device_index)
    kern = _loaded.get(key)
    if kern is not None:
        return kern
    with _lock:
        kern = _loaded.get(key)
        if kern is not None:
            return kern
        binary = build(spec)
        problems = binary.report.problems(spills=not accept_spills)
        if problems and not settings.allow_spills():  # study only: time a spilling tile
            raise CompileError(f"{spec.name}: refused by its resource report: {'; '.join(problems)}", log=binary.log)
        module, function = _load_module(binary.cubin, spec.name, spec.smem_bytes(), binary.report.static_smem,
                                        device_index)
        kern = Kernel(spec, binary, module, function, device_index)
        _loaded[key] = kern
        return kern
