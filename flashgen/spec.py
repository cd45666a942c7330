"""KernelSpec: the one description of a kernel variant.

Everything else derives from it, once: the name (kernel symbol, file name,
filter key), the template context, the YAML record, the shared-memory need
and the feasibility check. The field list lives in this dataclass alone;
``to_dict``/``from_dict`` and ``name`` walk it with ``dataclasses.fields``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import ConfigError

DTYPES = ("fp16", "bf16")
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a")
DTYPE_BYTES = {"fp16": 2, "bf16": 2}
# Fields added after tuned tables were first written: a record may omit them (their default is the old behaviour).
LATER_FIELDS = ("warpspec", "pingpong", "overlap", "hint", "emu", "sepkv", "lazy", "persist")
# Fields a family must list in ``Family.flags`` before a spec of it may set them (to True, or nonzero).
FLAG_FIELDS = ("warpspec", "pingpong", "overlap", "emu", "sepkv", "lazy", "persist")


@dataclass(frozen=True)
class KernelSpec:
    """One kernel variant. Construct it and call ``validate()`` (``from_dict`` does)."""

    kind: str = "fwd_v2"      # kernel family, see flashgen.families.FAMILIES
    arch: str = "sm_90a"      # compile target
    dtype: str = "bf16"       # element type of q, k, v, o
    head_dim: int = 128       # the kernel's head-dim tile (inputs with d <= head_dim are masked)
    block_m: int = 128        # query rows per CTA
    block_n: int = 64         # key/value rows per step
    warps: int = 4            # warps per CTA (split-Q: each owns block_m/warps query rows)
    stages: int = 2           # K/V shared-memory pipeline depth
    refill: int = 0           # where the next K/V copy is issued: 0 before S=QK^T, 1 before softmax, 2 before PV
    causal: bool = False
    # Hopper family (fwd_sm90) only; every other kind keeps them False, so
    # their names and records are unchanged.
    warpspec: bool = False    # a producer warpgroup issues the TMA loads (setmaxnreg moves its registers)
    pingpong: bool = False    # the consumer warpgroups (2 or 3) take turns issuing their GEMMs (named barriers)
    overlap: bool = False     # softmax of block j+1 overlaps the P V GEMM of block j
    emu: int = 0              # exp2 of emu/8 of each thread's S columns on the FMA pipe, not MUFU (0, 1, 2, 4)
    sepkv: bool = False       # separate K and V empty barriers: K(j) is released once S(j) is done
    lazy: bool = False        # lean softmax: tree row max; O rescaled only when the max grows by > 2^8 (FA4)
    persist: bool = False     # persistent kernel: one CTA per SM walks the tiles; loads run ahead across tiles
    # Decode families (decode_split: the K/V global-load flavour, families.LOAD_HINTS) and bwd_sm90
    # (how dQ reaches its accumulator, bwd_families.DQ_WRITES); every other kind keeps 0, and only
    # these kinds name it (``_h{hint}`` where the others have ``_r{refill}``: they have no refill
    # point, their refill is fixed at 0).
    hint: int = 0

    # -- identity ---------------------------------------------------------
    @property
    def name(self) -> str:
        """Readable, unique: ``fwd_v2_d128_m128_n64_w4_s2_r0_causal_bf16_sm90a``.

        fwd_sm90 names its flags instead of the refill slot it does not have:
        ``fwd_sm90_d128_m128_n128_w12_s2_ws1_pp1_ov1_causal_bf16_sm90a``, and the later ones only when
        set (``..._ov1_e2_kv1_lz1_ps1_causal...``: emu=2, sepkv, lazy, persist); the decode kinds name
        their load hint instead: ``decode_split_d128_m16_n128_w4_s2_h0_causal_bf16_sm90a``.
        """
        if self.kind == "fwd_sm90":
            return (
                f"{self.kind}_d{self.head_dim}_m{self.block_m}_n{self.block_n}_w{self.warps}_s{self.stages}"
                f"_ws{int(self.warpspec)}_pp{int(self.pingpong)}_ov{int(self.overlap)}"
                + (f"_e{self.emu}" if self.emu else "") + ("_kv1" if self.sepkv else "")
                + ("_lz1" if self.lazy else "") + ("_ps1" if self.persist else "")
                + f"_{'causal' if self.causal else 'full'}_{self.dtype}_{self.arch.replace('_', '')}"
            )
        return (
            f"{self.kind}_d{self.head_dim}_m{self.block_m}_n{self.block_n}_w{self.warps}_s{self.stages}"
            + (f"_h{self.hint}" if self.kind.startswith("decode_") or self.kind == "bwd_sm90" else f"_r{self.refill}")
            + f"_{'causal' if self.causal else 'full'}_{self.dtype}_{self.arch.replace('_', '')}"
        )

    @property
    def family(self):
        from .families import family

        return family(self.kind)

    # -- records ----------------------------------------------------------
    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, record, where=None) -> "KernelSpec":
        """Build and validate a spec from a YAML record; ``ConfigError`` on any bad value."""
        if not isinstance(record, dict):
            raise ConfigError(where, f"a kernel spec must be a mapping, got {type(record).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(record) - names
        if unknown:
            raise ConfigError(where, f"unknown spec field(s): {', '.join(sorted(map(str, unknown)))}")
        try:
            spec = cls(**record)
            spec.validate()
        except (TypeError, ValueError) as exc:
            raise ConfigError(where, f"invalid kernel spec {record!r}: {exc}") from None
        return spec

    def replace(self, **changes) -> "KernelSpec":
        return dataclasses.replace(self, **changes)

    # -- checks -----------------------------------------------------------
    def validate(self) -> "KernelSpec":
        """Check types, enums and ranges of every field, so that nothing but
        known-good values can reach a template. Raises ``ValueError``/``TypeError``."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            want = bool if f.type in ("bool", bool) else int if f.type in ("int", int) else str
            # bool is a subclass of int: refuse it where an int is meant, and vice versa.
            if type(value) is not want:
                raise TypeError(f"spec field {f.name} must be {want.__name__}, got {value!r}")
        from .families import FAMILIES

        if self.kind not in FAMILIES:
            raise ValueError(f"kind {self.kind!r} not in {sorted(FAMILIES)}")
        if self.arch not in ARCHS:
            raise ValueError(f"arch {self.arch!r} not in {ARCHS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {DTYPES}")
        fam = self.family
        for flag in FLAG_FIELDS:
            if getattr(self, flag) and flag not in fam.flags:
                raise ValueError(f"{self.kind}: {flag}={getattr(self, flag)} is not supported "
                                 f"(only {fam.flags or 'no flags'})")
        if self.hint not in fam.hints:
            raise ValueError(f"{self.kind}: hint={self.hint} not in {fam.hints}")
        fam.validate(self)
        return self

    def smem_bytes(self) -> int:
        """Dynamic shared memory one CTA needs, in bytes."""
        return self.family.smem_bytes(self)

    def check(self, profile) -> list[str]:
        """Reasons this spec cannot run on ``profile`` (empty list: feasible).

        The same rule the enumerator, the tuner, dispatch and the emitted
        ``static_assert`` use.
        """
        try:
            self.validate()
        except (TypeError, ValueError) as exc:
            return [str(exc)]
        reasons = []
        smem = self.smem_bytes()
        if smem > profile.smem_per_block:
            reasons.append(f"shared memory {smem} B > {profile.name}'s {profile.smem_per_block} B per block")
        reasons += self.family.extra_checks(self, profile)
        return reasons

    def feasible(self, profile) -> bool:
        return not self.check(profile)

    def context(self) -> dict:
        """Template variables (validated values only)."""
        self.validate()
        ctx = self.to_dict()
        ctx.update(name=self.name, smem_bytes=self.smem_bytes(), elem_bytes=DTYPE_BYTES[self.dtype])
        ctx.update(self.family.context(self))
        return ctx
