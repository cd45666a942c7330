"""TMA tensor maps (``CUtensorMap``) for the Hopper family, built by the driver.

``encode(ptr, dtype, dims, strides, box)`` returns the 128 opaque bytes of a
tiled tensor map with the swizzle of the box's row (128 bytes: 128-byte swizzle; a 64-byte row,
FP8 at head dim 64: 64-byte swizzle) and zero fill out of bounds, made by the
driver's ``cuTensorMapEncodeTiled``: through ``ctypes`` on ``libcuda.so`` (no
dependency; the path the first H200 runs exercised), else through
``cuda.bindings`` (pip ``cuda-bindings``) when libcuda cannot be opened by name.
``FLASHGEN_TMA=ctypes`` or ``=bindings`` forces one (the GPU tests check that both give
the same bytes). The bytes are never composed by hand.

Maps depend on the tensor's address, so they are cached per (address, dtype,
dims, strides, box): a call that reuses its buffers (the caching allocator
hands the same addresses back) costs one dict lookup.
"""
from __future__ import annotations

import ctypes
import threading

from . import settings
from .errors import UnsupportedError

# CUtensorMapDataType, CUtensorMapSwizzle and friends (cuda.h).
# (e4m3 travels as bytes: the TMA only moves it.)
DTYPE_CODES = {"fp16": 6, "fp32": 7, "bf16": 9, "e4m3": 0}
DTYPE_BYTES = {"fp16": 2, "fp32": 4, "bf16": 2, "e4m3": 1}
# CUtensorMapSwizzle by the bytes of the box's innermost row: the span the swizzle permutes.
SWIZZLES = {32: 1, 64: 2, 128: 3}
_INTERLEAVE_NONE = 0
_L2_PROMOTION_128B = 2
_OOB_FILL_ZERO = 0

_cache: dict = {}
_lock = threading.Lock()
_backend = None


class _CtypesBackend:
    name = "ctypes"

    def __init__(self):
        lib = None
        for cand in ("libcuda.so.1", "libcuda.so"):
            try:
                lib = ctypes.CDLL(cand)
                break
            except OSError:
                continue
        if lib is None:
            raise UnsupportedError("TMA descriptors need the CUDA driver (libcuda.so), which was not found")
        fn = lib.cuTensorMapEncodeTiled
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                       ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self._fn = fn

    def encode(self, ptr, dtype_code, dims, strides, box, swizzle):
        rank = len(dims)
        out = (ctypes.c_uint64 * 16)()
        err = self._fn(ctypes.addressof(out), dtype_code, rank, ctypes.c_void_p(ptr),
                       (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * (rank - 1))(*strides),
                       (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)),
                       _INTERLEAVE_NONE, swizzle, _L2_PROMOTION_128B, _OOB_FILL_ZERO)
        if err:
            raise UnsupportedError(f"cuTensorMapEncodeTiled failed (CUresult {err}) for dims {dims}, byte strides "
                                   f"{strides}, box {box} at {ptr:#x}")
        return bytes(out)


class _BindingsBackend:
    name = "cuda.bindings"

    def __init__(self):
        from cuda.bindings import driver  # noqa: F401 -- ImportError: not installed

        self._drv = driver

    def encode(self, ptr, dtype_code, dims, strides, box, swizzle):
        drv = self._drv
        rank = len(dims)
        u32, u64 = drv.cuuint32_t, drv.cuuint64_t  # the lists take these wrappers, not Python ints
        err, tmap = drv.cuTensorMapEncodeTiled(
            drv.CUtensorMapDataType(dtype_code), u32(rank), ptr, [u64(x) for x in dims], [u64(x) for x in strides],
            [u32(x) for x in box], [u32(1) for _ in range(rank)],
            drv.CUtensorMapInterleave(_INTERLEAVE_NONE), drv.CUtensorMapSwizzle(swizzle),
            drv.CUtensorMapL2promotion(_L2_PROMOTION_128B), drv.CUtensorMapFloatOOBfill(_OOB_FILL_ZERO))
        if int(err):
            raise UnsupportedError(f"cuTensorMapEncodeTiled failed ({err}) for dims {dims}, byte strides "
                                   f"{strides}, box {box} at {ptr:#x}")
        return ctypes.string_at(tmap.getPtr(), 128)


def backend():
    """The encoder in use (``ctypes`` on libcuda, else ``cuda.bindings``; ``FLASHGEN_TMA`` forces one)."""
    global _backend
    if _backend is None:
        want = settings.tma_backend()
        if want == "bindings":
            try:
                _backend = _BindingsBackend()
            except ImportError:
                raise UnsupportedError("FLASHGEN_TMA=bindings but cuda.bindings does not import "
                                       "(pip install cuda-bindings)") from None
        else:
            try:
                _backend = _CtypesBackend()
            except UnsupportedError:
                if want == "ctypes":
                    raise
                try:
                    _backend = _BindingsBackend()
                except ImportError:
                    raise UnsupportedError("TMA descriptors need the CUDA driver (libcuda.so), which was "
                                           "not found") from None
    return _backend


def encode(ptr: int, dtype: str, dims, strides, box) -> bytes:
    """128 bytes of a tiled tensor map: ``dims`` innermost first (elements), ``strides`` the byte
    strides of dims 1.. (multiples of 16), ``box`` the copy box (elements; its row of 32, 64 or 128 bytes
    sets the swizzle). Cached."""
    key = (ptr, dtype, tuple(dims), tuple(strides), tuple(box))
    hit = _cache.get(key)
    if hit is not None:
        return hit
    global _backend
    row = box[0] * DTYPE_BYTES[dtype]
    if row not in SWIZZLES:
        raise UnsupportedError(f"a TMA box row of {row} bytes has no swizzle (32, 64 or 128 bytes)")
    swizzle = SWIZZLES[row]
    enc = backend()
    try:
        data = enc.encode(ptr, DTYPE_CODES[dtype], tuple(dims), tuple(strides), tuple(box), swizzle)
    except (AttributeError, TypeError, ValueError):
        if enc.name == "ctypes" or settings.tma_backend() == "bindings":
            raise
        # A cuda.bindings whose API differs from the one written against: use the driver directly.
        _backend = _CtypesBackend()
        data = _backend.encode(ptr, DTYPE_CODES[dtype], tuple(dims), tuple(strides), tuple(box), swizzle)
    with _lock:
        if len(_cache) > 8192:
            _cache.clear()
        _cache[key] = data
    return data


def tensor_dims(d: int, n: int, heads: int, batch: int, strides_elems, elem_bytes: int = 2):
    """(dims, byte strides) of a (batch, heads, seq, d) view as a 4-D map (d, seq, head, batch).

    ``strides_elems`` is (seq, head, batch) in elements -- the map's order, innermost first, and
    the reverse of the (batch, head, seq) order the torch layer's strides come in.

    Lengths of 0 become 1 (a map cannot be empty; the kernel reads nothing
    there). A dimension of length 1 is never stepped, so its stride is replaced
    by a packed one (the driver wants multiples of 16 B; torch may report any
    stride for such a dimension).
    """
    s_seq, s_head, s_batch = strides_elems
    dims = [d, max(n, 1), max(heads, 1), max(batch, 1)]
    raw = [s_seq * elem_bytes, s_head * elem_bytes, s_batch * elem_bytes]
    out = []
    prev_extent = d * elem_bytes
    for size, stride in zip(dims[1:], raw):
        if size == 1:
            stride = -(-prev_extent // 16) * 16
        if stride <= 0 or stride % 16 or stride >= 1 << 40:
            raise UnsupportedError(f"the TMA needs positive byte strides that are multiples of 16, got "
                                   f"{raw} for dims {dims}")
        out.append(stride)
        prev_extent = stride * size
    return dims, out
