"""flashgen: FlashAttention kernels generated per problem, compiled with NVRTC, tuned per GPU."""
from __future__ import annotations

from . import families  # noqa: F401 -- registers every kernel kind with flashgen.spec
from .errors import CompileError, ConfigError, FlashgenError, UnsupportedError
from .spec import KernelSpec
from .version import __version__


def __getattr__(name):
    # The torch layer is imported when it is first used, so that `flashgen emit`, the spec and the
    # codegen modules work (and start quickly) without importing torch.
    if name in ("attention", "attention_varlen", "decode"):
        from . import api

        return getattr(api, name)
    if name == "record":  # (the shapes file's module reads YAML: imported when first used)
        from .shapes import record

        return record
    raise AttributeError(name)


__all__ = ["attention", "attention_varlen", "decode", "record", "KernelSpec", "FlashgenError", "UnsupportedError", "CompileError", "ConfigError",
           "__version__"]
