"""flashgen: FlashAttention kernels generated per problem, compiled with NVRTC, tuned per GPU."""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import CompileError, ConfigError, FlashgenError, UnsupportedError  # noqa: E402
from .spec import KernelSpec  # noqa: E402


def __getattr__(name):
    # torch is imported only when the torch layer is used, so that `flashgen emit`
    # and the spec/codegen modules work without importing it.
    if name == "attention":
        from .api import attention

        return attention
    if name == "decode":
        from .decode_api import decode

        return decode
    raise AttributeError(name)


__all__ = ["attention", "decode", "KernelSpec", "FlashgenError", "UnsupportedError", "CompileError", "ConfigError",
           "__version__"]
