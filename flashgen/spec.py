"""KernelSpec: the one description of a kernel variant.

The dataclass's field list is the single source of truth: each field carries
its metadata (its name token, which kernel kinds use it, what it means), and
everything else derives from it, once: the name (kernel symbol, emitted file
name, filter key) and its parser ``KernelSpec.from_name``, the YAML record
(``to_dict``/``from_dict``), the template context, the shared-memory need and
the feasibility check. A field that only some kinds use (``kinds`` in its
metadata) keeps its default everywhere else and is absent from those kinds'
names and records.

What a kind allows (tile sizes, flag combinations, shared memory) is its
family's business: families register themselves here (``register_family``)
when ``flashgen.families`` is imported, which ``import flashgen`` does, and
``validate``/``smem_bytes``/``check``/``context`` defer to the registered
family. This module imports nothing of the layers above it.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from .errors import ConfigError

DTYPES = ("fp16", "bf16")
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a")
DTYPE_BYTES = {"fp16": 2, "bf16": 2}


def _f(default, token: str = "", kinds: tuple = (), doc: str = "", optional: bool = False):
    """A KernelSpec field: ``token`` spells it in the name ("" for the name's fixed parts), ``kinds``
    the kernel kinds that use it (() for every kind); an ``optional`` one is left out of a record while
    it has its default (the variant switches: a tuned table's records predate them, and a plain
    kernel's record does not mention them)."""
    return dataclasses.field(default=default, metadata={"token": token, "kinds": kinds, "doc": doc,
                                                        "optional": optional})


_SM90 = ("fwd_sm90",)
# The kinds that serve the variants (templates/common/variant.cuh; decode_split: decode/decode_variant.cuh).
_VARIANTS = ("fwd_sm90", "fwd_v2", "bwd_sm90", "bwd_dkdv", "bwd_dkdv_nodq", "bwd_dq", "decode_split")
# The kinds that serve packed rows (cu_seqlens: templates/common/varlen.cuh).
_VARLEN = ("fwd_sm90", "fwd_v2", "bwd_sm90", "bwd_dkdv", "bwd_dkdv_nodq", "bwd_dq")


@dataclass(frozen=True)
class KernelSpec:
    """One kernel variant. Construct it with keywords and call ``validate()`` (``from_dict`` and
    ``from_name`` do)."""

    kind: str = _f("fwd_v2", doc="kernel kind (one per template entry point; its family registers it)")
    arch: str = _f("sm_90a", doc="compile target")
    dtype: str = _f("bf16", doc="element type of q, k, v and o")
    head_dim: int = _f(128, "d", doc="the kernel's head-dim tile (inputs with a smaller d are masked)")
    block_m: int = _f(128, "m", doc="query rows per CTA (per step in the dK/dV kernels)")
    block_n: int = _f(64, "n", doc="key/value rows per step (per CTA in the dK/dV kernels)")
    warps: int = _f(4, "w", doc="warps per CTA")
    stages: int = _f(2, "s", doc="shared-memory pipeline depth of the streamed operand")
    causal: bool = _f(False, doc="bottom-right aligned causal mask")
    refill: int = _f(0, "r", ("fwd_v2",),
                     "where the next K/V copy is issued: 0 before S = QK^T, 1 before the softmax, 2 before PV")
    warp_specialized: bool = _f(False, "ws", _SM90,
                                "a producer warpgroup issues the TMA loads (setmaxnreg moves its registers)")
    pingpong: bool = _f(False, "pp", _SM90,
                        "the consumer warpgroups take turns issuing their GEMMs (named barriers)")
    softmax_overlap: bool = _f(False, "ov", _SM90, "the softmax of block j+1 overlaps the PV GEMM of block j")
    fma_exp2: int = _f(0, "fx", _SM90,
                       "eighths of each thread's S columns whose exp2 runs on the FMA pipe instead of MUFU")
    early_k_release: bool = _f(False, "kr", _SM90,
                               "separate K and V empty barriers: K(j) is released as soon as S(j) is done")
    lean_softmax: bool = _f(False, "ls", _SM90,
                            "tree row max; O rescaled only when the row max grows by more than 2^8")
    persistent: bool = _f(False, "ps", _SM90,
                          "one CTA per SM walks the tiles; its loads run ahead across tiles")
    kv_load: int = _f(0, "ld", ("decode_split",), "how K/V reach shared memory (families.decode.KV_LOADS)")
    dq_write: int = _f(0, "dq", ("bwd_sm90",), "how dQ reaches its fp32 accumulator (families.bwd_sm90.DQ_WRITES)")
    dp_late: bool = _f(False, "dpl", ("bwd_sm90",), "dP^T's GEMM issued after P^T instead of while P^T is computed: "
                       "its accumulators are not live there (for user mods whose functions need the registers)",
                       True)
    dq_early: bool = _f(False, "dqe", ("bwd_sm90",), "dQ's GEMM issued between dV's and dK's, so that dQ's write "
                        "runs while dK's GEMM does (tile without the split only)", True)
    det: bool = _f(False, "det", ("bwd_sm90",), "deterministic dQ: the CTAs add to each query block's fp32 dQ in a "
                   "fixed order (a counter per block), so dQ has the same bits on every run", True)
    # The variants (flashgen.variants): compile-time switches; their values (the window's sides, the
    # softcap, the slopes and sinks) are launch parameters, so one kernel serves every window or cap.
    window: bool = _f(False, "win", _VARIANTS, "a sliding window: keys outside (left, right) of the diagonal "
                      "are hidden and key blocks wholly outside it are skipped", True)
    softcap: bool = _f(False, "cap", _VARIANTS, "scores become softcap * tanh(score / softcap) (Gemma 2)", True)
    alibi: bool = _f(False, "alibi", _VARIANTS, "ALiBi: -slope * |distance to the diagonal| joins each score",
                     True)
    sinks: bool = _f(False, "sink", _VARIANTS, "a learned logit per head joins every row's softmax denominator",
                     True)
    varlen: bool = _f(False, "vl", _VARLEN, "packed rows: sequences of their own lengths (cu_seqlens), tiles "
                      "from a device-built list (longest first)", True)
    page_rows: int = _f(0, "pg", _SM90, "paged K/V (a block table's pages; needs varlen): each K/V block arrives as "
                        "block_n / page_rows TMA boxes of page_rows rows, each from its page (0: contiguous)", True)
    kv_gather: bool = _f(False, "ga", _SM90, "paged K/V rows gathered by the producer warpgroup with cp.async (16 bytes "
                         "a thread, rows of a block sharing a block-table entry in runs of page_rows) instead of TMA "
                         "boxes: for pages shorter than the boxes that run well", True)
    mod: int = _f(0, "mod", ("fwd_sm90", "fwd_v2", "bwd_sm90", "bwd_dkdv", "bwd_dkdv_nodq", "bwd_dq", "decode_split"), "user mods (flashgen.mods): the 48-bit token of a traced score_mod / mask_mod pair, "
                  "whose graphs are printed into the kernel as device functions (0: none)", True)
    row_bounds: bool = _f(False, "rb", ("fwd_sm90", "fwd_v2", "bwd_sm90"), "a mask_mod's partial blocks masked by "
                          "each query row's first and last visible key (BlockMask.row_bounds, for masks whose rows "
                          "each see one run of keys) instead of calling the mask_mod per score", True)
    fp8: bool = _f(False, "fp8", ("fwd_sm90", "decode_split"), "float8 e4m3 operands with fp32 descale factors: q, k "
                   "and v in the forward, the KV cache in decode; dtype is the output's (and decode's query's)", True)
    bias_gemm: bool = _f(False, "bg", _SM90, "the column part of a linear bias (causal ALiBi without a window or a "
                         "softcap, a linear score_mod) added to S by one more k16 step of S = Q K^T's GEMM (bf16 "
                         "operands, constant columns in shared memory) instead of an FFMA per score (not with fp8)",
                         True)

    # -- identity ---------------------------------------------------------
    @property
    def name(self) -> str:
        """Readable, unique, a C identifier: ``{kind}_d{head_dim}_m{block_m}_n{block_n}_w{warps}_s{stages}``,
        then the kind's own fields that differ from their defaults (a flag as its token, a number as
        token and value, in field order: ``_ws_pp_fx1``), then ``_causal`` or ``_full``, the dtype and
        the arch without its underscore. ``from_name`` reads it back."""
        parts = [self.kind]
        for f in _FIELDS:
            token, kinds = f.metadata["token"], f.metadata["kinds"]
            if not token:
                continue
            value = getattr(self, f.name)
            if not kinds:
                parts.append(f"{token}{value}")
            elif self.kind in kinds and value != f.default:
                parts.append(token if value is True else f"{token}{int(value)}")
        parts += ["causal" if self.causal else "full", self.dtype, self.arch.replace("_", "")]
        return "_".join(parts)

    @classmethod
    def from_name(cls, name: str) -> "KernelSpec":
        """The validated spec whose ``name`` is ``name``; ``ValueError`` for any other string (an
        unknown token, a value the kind does not take, or a spelling that is not the canonical one)."""
        if not isinstance(name, str):
            raise TypeError(f"a kernel name is a str, got {type(name).__name__}")
        m = _NAME_RE.match(name)
        if m is None:
            raise ValueError(f"{name!r} is not a kernel name ({{kind}}_d.._m.._n.._w.._s.._[flags_]"
                             "causal|full_dtype_arch)")
        arch = m["arch"][:2] + "_" + m["arch"][2:]
        values: dict = {"kind": m["kind"], "arch": arch, "dtype": m["dtype"], "causal": m["mask"] == "causal",
                        "head_dim": int(m["d"])}
        for token in m["rest"].split("_"):
            t = _token(token)
            f = _BY_TOKEN.get(t["letters"]) if t else None
            if f is None:
                raise ValueError(f"{name!r}: unknown token {token!r}")
            if f.name in values:
                raise ValueError(f"{name!r}: {f.name} given twice")
            is_flag = f.type in ("bool", bool)
            if is_flag == bool(t["digits"]):
                raise ValueError(f"{name!r}: token {token!r} " + ("takes no number" if is_flag else "needs a number"))
            values[f.name] = True if is_flag else int(t["digits"])
        missing = [f.name for f in _FIELDS if f.metadata["token"] and not f.metadata["kinds"] and f.name not in values]
        if missing:
            raise ValueError(f"{name!r}: no token for {', '.join(missing)}")
        spec = cls(**values).validate()
        if spec.name != name:
            raise ValueError(f"{name!r} is not the canonical spelling of its spec ({spec.name})")
        return spec

    @property
    def family(self):
        """The registered family of this spec's kind (``ValueError`` for an unknown kind)."""
        return family_of(self.kind)

    # -- records ----------------------------------------------------------
    def to_dict(self) -> dict:
        """The YAML record: every field this kind uses (an optional one only where it is set), nothing else."""
        return {f.name: getattr(self, f.name) for f in fields_of(self.kind)
                if not (f.metadata["optional"] and getattr(self, f.name) == f.default)}

    @classmethod
    def from_dict(cls, record, where=None, complete: bool = False) -> "KernelSpec":
        """Build and validate a spec from a record (``to_dict``'s form): only fields its kind uses, every
        value checked (``complete``: every field it uses, no defaults, as a tuned table must say);
        ``ConfigError`` naming ``where`` on anything else."""
        if not isinstance(record, dict):
            raise ConfigError(where, f"a kernel spec must be a mapping, got {type(record).__name__}")
        unknown = set(record) - _NAMES
        if unknown:
            raise ConfigError(where, f"unknown spec field(s): {', '.join(sorted(map(str, unknown)))}")
        kind = record.get("kind")
        if type(kind) is not str:
            raise ConfigError(where, f"spec field kind must be str, got {kind!r}")
        try:
            family_of(kind)
        except ValueError as exc:
            raise ConfigError(where, str(exc)) from None
        used = {f.name for f in fields_of(kind)}
        foreign = sorted(set(record) - used)
        if foreign:
            raise ConfigError(where, f"spec field(s) {', '.join(foreign)} do not belong to {kind} specs")
        missing = sorted(used - set(record) - {f.name for f in fields_of(kind) if f.metadata["optional"]})
        if missing and complete:
            raise ConfigError(where, f"spec is missing field(s): {', '.join(missing)}")
        try:
            return cls(**record).validate()
        except (TypeError, ValueError) as exc:
            raise ConfigError(where, f"invalid kernel spec {record!r}: {exc}") from None

    def replace(self, **changes) -> "KernelSpec":
        return dataclasses.replace(self, **changes)

    def with_tokens(self, text: str) -> "KernelSpec":
        """This spec with the name tokens in ``text`` applied ("ws_pp_s3_m192": warp_specialized and
        pingpong on, 3 stages, block_m 192; "" changes nothing): the name's own grammar, for variants
        written by hand (benchmarks, tests). Not validated; ``ValueError`` for an unknown token."""
        changes = {}
        for token in filter(None, text.split("_")):
            t = _token(token)
            f = _BY_TOKEN.get(t["letters"]) if t else None
            if f is None or (f.type in ("bool", bool)) == bool(t["digits"]):
                raise ValueError(f"{text!r}: {token!r} is not a name token "
                                 f"(tokens: {', '.join(sorted(_BY_TOKEN))}; numbers after all but the flags)")
            changes[f.name] = True if f.type in ("bool", bool) else int(t["digits"])
        return dataclasses.replace(self, **changes)

    # -- checks -----------------------------------------------------------
    def validate(self) -> "KernelSpec":
        """Check types, enums and ranges of every field, so that nothing but known-good values can
        reach a template; the family checks its own rules. Returns self; ``ValueError``/``TypeError``."""
        for f in _FIELDS:
            value = getattr(self, f.name)
            want = _TYPES[f.type]
            # bool is a subclass of int: refuse it where an int is meant, and vice versa.
            if type(value) is not want:
                raise TypeError(f"spec field {f.name} must be {want.__name__}, got {value!r}")
        fam = family_of(self.kind)
        if self.arch not in ARCHS:
            raise ValueError(f"arch {self.arch!r} not in {ARCHS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {DTYPES}")
        for f in _FIELDS:
            kinds = f.metadata["kinds"]
            if kinds and self.kind not in kinds and getattr(self, f.name) != f.default:
                raise ValueError(f"{self.kind}: {f.name}={getattr(self, f.name)!r} is not a field of this kind "
                                 f"(only {', '.join(kinds)} take it)")
        fam.validate(self)
        return self

    def smem_bytes(self) -> int:
        """Dynamic shared memory one CTA needs, in bytes."""
        return self.family.smem_bytes(self)

    def smem_total(self) -> int:
        """Dynamic plus static shared memory (a kernel's mbarriers) one CTA needs: what the per-block limit
        bounds (a launch asks for at most the limit less the static bytes)."""
        return self.family.smem_bytes(self) + self.family.static_smem_bytes(self)

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
        smem = self.smem_total()
        if smem > profile.smem_per_block:
            reasons.append(f"shared memory {smem} B > {profile.name}'s {profile.smem_per_block} B per block")
        reasons += self.family.extra_checks(self, profile)
        return reasons

    def feasible(self, profile) -> bool:
        return not self.check(profile)

    def context(self) -> dict:
        """Template variables (validated values only)."""
        self.validate()
        ctx = {f.name: getattr(self, f.name) for f in fields_of(self.kind)}
        ctx.update(name=self.name, smem_bytes=self.smem_bytes(), elem_bytes=DTYPE_BYTES[self.dtype])
        ctx.update(self.family.context(self))
        return ctx


_FIELDS = dataclasses.fields(KernelSpec)
_NAMES = frozenset(f.name for f in _FIELDS)
_TYPES = {"int": int, "bool": bool, "str": str, int: int, bool: bool, str: str}
_BY_TOKEN = {f.metadata["token"]: f for f in _FIELDS if f.metadata["token"]}
assert len(_BY_TOKEN) == sum(1 for f in _FIELDS if f.metadata["token"]), "name tokens must be unique"
_NAME_RE = re.compile(r"^(?P<kind>[a-z][a-z0-9]*(?:_[a-z][a-z0-9]*)*?)_d(?P<d>\d+)_(?P<rest>[a-z0-9_]+?)"
                      r"_(?P<mask>causal|full)_(?P<dtype>[a-z0-9]+)_(?P<arch>sm\d+a?)$")
_TOKEN_RE = re.compile(r"^(?P<letters>[a-z]+)(?P<digits>\d*)$")


def _token(text: str):
    """A name token's parts: {"letters": field token, "digits": its number ("" for a flag)}; a flag token
    that ends in digits ("fp8") is matched whole. None when it is no token's spelling."""
    f = _BY_TOKEN.get(text)
    if f is not None and f.type in ("bool", bool):
        return {"letters": text, "digits": ""}
    return _TOKEN_RE.match(text)


def fields_of(kind: str) -> tuple:
    """The dataclass fields a spec of ``kind`` uses (the common ones and its own), in field order."""
    return tuple(f for f in _FIELDS if not f.metadata["kinds"] or kind in f.metadata["kinds"])


# -- the family registry ---------------------------------------------------------
# Families live above this module (flashgen.families) and register here on import; a spec finds its
# family by kind. The registry is the only thing this module knows of them.
_FAMILIES: dict = {}


def register_family(fam) -> None:
    """Make ``fam`` (an object with ``kind``, ``validate``, ``smem_bytes``, ``extra_checks``,
    ``context``) the family of specs of ``fam.kind``; a kind registers once."""
    if fam.kind in _FAMILIES and _FAMILIES[fam.kind] is not fam:
        raise ValueError(f"kind {fam.kind!r} is registered already")
    _FAMILIES[fam.kind] = fam


def family_of(kind: str):
    """The family registered for ``kind``; ``ValueError`` naming the known kinds otherwise."""
    fam = _FAMILIES.get(kind) if isinstance(kind, str) else None
    if fam is None:
        raise ValueError(f"kind {kind!r} not in {sorted(_FAMILIES)}")
    return fam


def registered_kinds() -> tuple:
    return tuple(_FAMILIES)
