"""Code generation: render a spec, compile it with NVRTC, load it on the GPU.

- ``render(spec) -> str``: the exact source (``flashgen emit`` prints it);
- ``build(spec) -> Binary``: cubin + ptxas report, from the disk cache or NVRTC;
- ``load(spec, device) -> Kernel``: loaded and ready to launch (cached per process).
"""
from __future__ import annotations

from .compiler import Binary, Report, compile_source, get_binary, parse_ptxas_log
from .render import render


def build(spec) -> Binary:
    """Render and compile ``spec`` for ``spec.arch`` (disk-cached)."""
    binary, _ = get_binary(render(spec), spec.arch, spec.name)
    return binary


def load(spec, device_index: int):
    from .launch import load_kernel

    return load_kernel(spec, device_index)


__all__ = ["render", "build", "load", "Binary", "Report", "compile_source", "get_binary", "parse_ptxas_log"]
