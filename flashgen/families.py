"""Kernel families: the per-kind rules a KernelSpec defers to.

A family says which field values its template supports, how much shared
memory a spec needs, which specs are implausible on a GPU, the extra template
variables, and the kernel's by-value parameter block. The parameter block is
declared once here, as (name, C type, ctypes type) rows: the template emits the
C struct from it and the launcher packs the same rows with ctypes, so the two
sides cannot drift.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

# Head-dim tiles the mma.sync templates support: 16-byte chunks per row must be
# a multiple of 4 for the shared-memory swizzle (see templates/tile.cuh).
MMA_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)

PTR = ctypes.c_void_p
I64 = ctypes.c_int64
I32 = ctypes.c_int32
F32 = ctypes.c_float


@dataclass(frozen=True)
class Family:
    kind: str
    template: str                       # entry template in flashgen/templates
    params: tuple                       # ((name, C declaration type, ctypes type), ...)
    head_dims: tuple = MMA_HEAD_DIMS
    block_ms: tuple = (16, 32, 48, 64, 96, 128, 192, 256)
    block_ns: tuple = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256)
    warps: tuple = (1, 2, 4, 8)
    stages: tuple = (2, 3, 4)
    refills: tuple = (0, 1, 2)
    max_acc_floats: int = 200           # fp32 accumulators per thread before spilling is likely
    _struct: list = field(default_factory=list, compare=False, repr=False)

    # -- spec rules ---------------------------------------------------------
    def validate(self, spec) -> None:
        for fname, allowed in (("head_dim", self.head_dims), ("block_m", self.block_ms),
                               ("block_n", self.block_ns), ("warps", self.warps), ("stages", self.stages),
                               ("refill", self.refills)):
            if getattr(spec, fname) not in allowed:
                raise ValueError(f"{self.kind}: {fname}={getattr(spec, fname)} not in {allowed}")
        if spec.block_m % (16 * spec.warps):
            raise ValueError(f"{self.kind}: block_m={spec.block_m} must split into 16-row slices "
                             f"over {spec.warps} warps")

    def smem_bytes(self, spec) -> int:
        elem = 2
        return elem * spec.head_dim * (spec.block_m + 2 * spec.stages * spec.block_n)

    def acc_floats(self, spec) -> int:
        """fp32 accumulators per thread: O (rows x head_dim) and S (rows x block_n)."""
        slices = spec.block_m // spec.warps // 16
        return slices * (spec.head_dim // 8 + spec.block_n // 8) * 4

    def extra_checks(self, spec, profile) -> list[str]:
        reasons = []
        if self.acc_floats(spec) > self.max_acc_floats:
            reasons.append(f"{self.acc_floats(spec)} fp32 accumulators per thread > {self.max_acc_floats}"
                           " (would spill)")
        return reasons

    def context(self, spec) -> dict:
        return {"params": [(n, c) for n, c, _ in self.params]}

    # -- launch -------------------------------------------------------------
    def param_struct(self):
        """The ctypes Structure matching the emitted C parameter struct."""
        if not self._struct:
            self._struct.append(type(f"{self.kind}_params", (ctypes.Structure,),
                                     {"_fields_": [(n, t) for n, _, t in self.params]}))
        return self._struct[0]


def _strides(*tensors):
    return tuple((f"{t}_s{ax}", "long long", I64) for t in tensors for ax in "bhs")


FWD_PARAMS = (
    ("q", "const elem_t*", PTR), ("k", "const elem_t*", PTR), ("v", "const elem_t*", PTR),
    ("o", "elem_t*", PTR), ("lse", "float*", PTR),
    *_strides("q", "k", "v", "o"),
    ("nq", "int", I32), ("nk", "int", I32), ("heads", "int", I32), ("group", "int", I32),
    ("d", "int", I32), ("scale", "float", F32), ("scale_log2", "float", F32),
)

FAMILIES: dict[str, Family] = {
    "fwd_v2": Family("fwd_v2", "fwd_v2.cu.j2", FWD_PARAMS),
}

# Baselines for study and comparison: standard attention's three passes and FlashAttention V1.
from .baseline_specs import BASELINE_FAMILIES  # noqa: E402  (it builds on Family, defined above)

FAMILIES.update(BASELINE_FAMILIES)


def family(kind: str) -> Family:
    if kind not in FAMILIES:
        raise ValueError(f"unknown kernel kind {kind!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[kind]
