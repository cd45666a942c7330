"""The cubin NVRTC made, whole (no package imports: bench/provenance.py loads this file on its own to hash
the cubins of older checkouts the same way)."""
from __future__ import annotations

import struct


def whole_elf(cubin: bytes) -> bytes:
    """The cubin as NVRTC made it. CuPy's ``nvrtc.getCUBIN`` (14.x) drops the buffer's last byte, as if it
    were the NUL that ends a PTX string: the ELF is one byte short (the driver loads it, nvdisasm calls it
    invalid). The ELF64 header says where its program- and section-header tables end, which is the end
    of the file NVRTC writes; the byte missing is the top byte of the last table entry's last field (an
    8-byte alignment or entry size), 0. A cubin of the right length (a CuPy without the bug) is
    returned as it is. tests/test_cache.py checks the result against NVRTC's own bytes."""
    if len(cubin) < 64 or cubin[:5] != b"\x7fELF\x02":
        return cubin
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return cubin + b"\0" if end == len(cubin) + 1 else cubin
