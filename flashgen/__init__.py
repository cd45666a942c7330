"""flashgen: FlashAttention kernels generated per problem, compiled with NVRTC, tuned per GPU."""
from __future__ import annotations

from . import dispatch as _dispatch
from . import families  # noqa: F401 -- registers every kernel kind with flashgen.spec
from .errors import CompileError, ConfigError, FlashgenError, UnsupportedError
from .spec import KernelSpec
from .version import __version__


def _first_use_search(request):
    """The tuner's first-use search (imported when a first use asks for it: the tuner sits above dispatch
    and the torch layer, which find it through ``dispatch.first_use_search``)."""
    from .tuner import autotune as search

    return search.search(request)


_dispatch.set_first_use_search(_first_use_search)


def autotune(enabled: bool | None = True) -> None:
    """Tune on first use in this process: the first call of a forward key that no table has runs a short
    measured search on the GPU (the cost model's top few candidates and the default rule, checked and
    timed at the call's shape, within ``FLASHGEN_AUTOTUNE_BUDGET`` seconds) and stores the winner in the
    user's table. ``False`` turns it off; ``None`` leaves it to ``FLASHGEN_AUTOTUNE``."""
    from .api import autotune as first_use

    first_use.enable(enabled)


def __getattr__(name):
    # The torch layer is imported when it is first used, so that `flashgen emit`, the spec and the
    # codegen modules work (and start quickly) without importing torch.
    if name in ("attention", "attention_varlen", "decode", "sdpa", "create_block_mask", "BlockMask", "quantize_fp8"):
        from . import api

        return getattr(api, name)
    if name == "record":  # (the shapes file's module reads YAML: imported when first used)
        from .shapes import record

        return record
    raise AttributeError(name)


__all__ = ["attention", "attention_varlen", "decode", "sdpa", "create_block_mask", "BlockMask", "quantize_fp8", "record", "autotune", "KernelSpec", "FlashgenError", "UnsupportedError", "CompileError", "ConfigError",
           "__version__"]
