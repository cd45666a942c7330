"""flashgen: FlashAttention kernels generated per problem, compiled with NVRTC, tuned per GPU."""
from __future__ import annotations

__version__ = "0.1.0"

from . import families  # noqa: E402,F401 -- registers every kernel kind with flashgen.spec
from .errors import CompileError, ConfigError, FlashgenError, UnsupportedError  # noqa: E402
from .spec import KernelSpec  # noqa: E402


def __getattr__(name):
    # The torch layer is imported when it is first used, so that `flashgen emit`, the spec and the
    # codegen modules work (and start quickly) without importing torch.
    if name in ("attention", "decode"):
        from . import api

        return getattr(api, name)
    raise AttributeError(name)


__all__ = ["attention", "decode", "KernelSpec", "FlashgenError", "UnsupportedError", "CompileError", "ConfigError",
           "__version__"]
