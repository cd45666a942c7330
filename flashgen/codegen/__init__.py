"""Code generation: render a spec, compile it with NVRTC, load it on the GPU.

- ``render(spec) -> str``: the exact source (``flashgen emit`` prints it);
- ``build(spec) -> Binary``: cubin + ptxas report, from the disk cache or NVRTC;
- ``load(spec, device) -> Kernel``: loaded and ready to launch (cached per process).

``compiler`` alone talks to NVRTC and owns the binary cache; ``launch`` alone loads
modules and launches (CuPy's driver calls).
"""
from __future__ import annotations

from .compiler import Binary, Report, build, compile_source, get_binary, parse_ptxas_log
from .launch import Kernel, load_kernel as load
from .render import render

__all__ = ["render", "build", "load", "Kernel", "Binary", "Report", "compile_source", "get_binary",
           "parse_ptxas_log"]
