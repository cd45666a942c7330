"""The torch layer: input checks, one plan cache per entry point, launches, autograd.

- ``attention`` (``api.entry``: the forward is ``api.forward``, the study
  algorithms ``api.baselines``), differentiable through
  ``api.autograd`` (custom ops under torch.compile) whose backward is ``api.backward``;
- ``attention_varlen`` (``api.packed``): packed rows (cu_seqlens), the forward ``api.forward``'s;
- ``decode`` (``api.decoding``): Flash-Decoding over a contiguous or paged KV cache;
- ``sdpa`` (``api.dropin``): torch's scaled_dot_product_attention signature, masks as user mods;
- ``create_block_mask`` / ``BlockMask`` (``api.blockmask``): a mask_mod's key blocks per query block, for
  ``attention``'s user mods (``api.modcall``);
- ``quantize_fp8`` (``api.fp8``): bf16/fp16 tensors as float8 e4m3 with descale factors, for the FP8 forward
  (``attention``'s q_descale, k_descale, v_descale) and decode over an FP8 cache.

(No submodule is named after a function this package exports, so ``flashgen.api.X`` is never
ambiguous.)

Every entry point checks its inputs and raises before anything is launched;
launches go to torch's current stream with raw pointers (CUDA-graph safe).
"""
from __future__ import annotations

from .entry import attention
from .backward import attention_backward
from .decoding import decode
from .packed import attention_varlen
from .blockmask import BlockMask, create_block_mask
from .dropin import sdpa
from .fp8 import quantize_fp8

__all__ = ["attention", "attention_backward", "attention_varlen", "decode", "sdpa", "create_block_mask", "BlockMask",
           "quantize_fp8"]
