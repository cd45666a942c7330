"""GPU profiles: what the tuner and the feasibility check need to know of a chip.

``smem_per_block`` is the opt-in maximum of dynamic shared memory one block may
ask for (``cudaDevAttrMaxSharedMemoryPerBlockOptin``), i.e. the SM's shared
memory less the 1 KB the driver reserves per block. Rates are dense tensor-core
fp16/bf16 with fp32 accumulation, from the vendors' datasheets; bandwidth is
the HBM/GDDR datasheet figure. They feed the cost model, not correctness.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import settings
from .errors import UnsupportedError


@dataclass(frozen=True)
class GPUProfile:
    name: str              # short key: "h200"
    device_name: str       # what torch.cuda.get_device_name() reports (prefix match)
    arch: str              # compile target of the mma.sync family
    sms: int
    smem_per_block: int    # bytes, opt-in maximum per block (driver reserve excluded)
    smem_per_sm: int       # bytes
    bandwidth: float       # bytes / s
    peak_flops: float      # dense fp16/bf16 tensor FLOP/s
    regs_per_sm: int = 65536


PROFILES: dict[str, GPUProfile] = {
    p.name: p
    for p in (
        # A100-SXM4-40GB: 164 KB smem per SM, 163 KB (166912 B) opt-in per block.
        GPUProfile("a100", "NVIDIA A100", "sm_80", 108, 166912, 167936, 1.555e12, 312e12),
        # H100 SXM: 228 KB per SM, 227 KB (232448 B) opt-in per block.
        GPUProfile("h100", "NVIDIA H100", "sm_90a", 132, 232448, 233472, 3.35e12, 989e12),
        GPUProfile("h200", "NVIDIA H200", "sm_90a", 132, 232448, 233472, 4.8e12, 989e12),
        # L4 (Ada, sm_89): 100 KB per SM, 99 KB (101376 B) opt-in per block.
        GPUProfile("l4", "NVIDIA L4", "sm_89", 58, 101376, 102400, 0.3e12, 121e12),
        GPUProfile("rtx4090", "NVIDIA GeForce RTX 4090", "sm_89", 128, 101376, 102400, 1.008e12, 165e12),
    )
}


# Opt-in shared memory per block by arch, for offline work where no profile is named.
ARCH_SMEM_PER_BLOCK = {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90a": 232448}


def with_smem(profile: GPUProfile, smem: int | None) -> GPUProfile:
    """``profile`` with another shared-memory budget per block (``--smem``: simulate a smaller GPU)."""
    if smem is None:
        return profile
    if type(smem) is not int or smem <= 0:
        raise ValueError(f"shared-memory budget must be a positive number of bytes, got {smem!r}")
    return dataclasses.replace(profile, smem_per_block=smem)


def get(name: str) -> GPUProfile:
    """The profile called ``name`` (case-insensitive); ``UnsupportedError`` if unknown."""
    key = str(name).strip().lower()
    if key not in PROFILES:
        raise UnsupportedError(f"unknown GPU profile {name!r}; known: {', '.join(sorted(PROFILES))}")
    return PROFILES[key]


def arch_of_capability(major: int, minor: int) -> str:
    """Compile target for a compute capability (sm_90 gets the 'a' features)."""
    if major < 8:
        raise UnsupportedError(f"compute capability {major}.{minor} is not supported (need 8.0 or newer)")
    return f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


def detect(device_index: int | None = None) -> GPUProfile | None:
    """The profile of the CUDA device in use, or None when it is not one we know.

    ``FLASHGEN_GPU`` overrides detection.
    """
    forced = settings.gpu_override()
    if forced:
        return get(forced)
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device_index)
    # Longest device_name first so "NVIDIA H200" never matches a shorter prefix.
    for prof in sorted(PROFILES.values(), key=lambda p: -len(p.device_name)):
        if name.startswith(prof.device_name):
            return prof
    return None
