"""What every kernel family shares: the ``Family`` base class and the parameter-block helpers.

A family says which field values its template supports, how much shared
memory a spec needs, which specs are implausible on a GPU, the extra template
variables, the kernel's by-value parameter block, its default rule (the tiles
dispatch takes without a tuned table) and its tuning space. The parameter
block is declared once, as (name, C type, ctypes type) rows: the template
emits the C struct from it and the launcher packs the same rows with ctypes,
so the two sides cannot drift.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field

from .. import mods
from ..errors import UnsupportedError
from ..problem import HEAD_DIM_TILES, ProblemKey, head_dim_tile
from ..settings import logger
from ..spec import DTYPES, KernelSpec, fields_of
from ..variants import key_flags

PTR = ctypes.c_void_p
I64 = ctypes.c_int64
I32 = ctypes.c_int32
F32 = ctypes.c_float


class TMAP(ctypes.Structure):
    """A CUtensorMap's 128 opaque bytes (built by flashgen.tma)."""

    _fields_ = [("v", ctypes.c_uint64 * 16)]


def strides(*tensors) -> tuple:
    """Parameter rows of the (batch, head, seq) element strides of each named tensor."""
    return tuple((f"{t}_s{ax}", "long long", I64) for t in tensors for ax in "bhs")


def stride_values(name: str, s) -> dict:
    """``{name_sb, name_sh, name_ss}`` from (batch, head, seq) strides: the values of ``strides(name)``."""
    return {f"{name}_sb": s[0], f"{name}_sh": s[1], f"{name}_ss": s[2]}


# The forward's parameter block (fwd_v2, fwd_v1 adds its buffers): pointers, (batch, head, seq) strides
# of q, k, v, o, the sizes, and the scale twice (natural and log2-based, for exp2).
FWD_PARAMS = (
    ("q", "const elem_t*", PTR), ("k", "const elem_t*", PTR), ("v", "const elem_t*", PTR),
    ("o", "elem_t*", PTR), ("lse", "float*", PTR),
    *strides("q", "k", "v", "o"),
    ("nq", "int", I32), ("nk", "int", I32), ("heads", "int", I32), ("group", "int", I32),
    ("d", "int", I32), ("scale", "float", F32), ("scale_log2", "float", F32),
)


# The variant interface's parameters (templates/common/variant.cuh), in the blocks of the families that
# implement it: the window's sides (a side no row reaches for an unbounded one), the softcap's factor
# before the tanh (a softcapped kernel's scale is the cap itself: Variant.values), the ALiBi slopes (fp32,
# batch stride 0 for one slope per head) and the sinks (fp32 per head). Unused fields of a plain kernel's
# block stay zero.
VARIANT_PARAMS = (
    ("win_left", "int", I32), ("win_right", "int", I32), ("cap_in", "float", F32),
    ("alibi", "const float*", PTR), ("alibi_sb", "int", I32), ("sinks", "const float*", PTR),
)

class MODARGS(ctypes.Structure):
    """templates/common/mod_args.cuh's fg_mod_args: up to four captured tensors of a user mod (address,
    element strides and sizes over four dimensions)."""

    _fields_ = [("t", ctypes.c_void_p * 4), ("s", (ctypes.c_int64 * 4) * 4), ("n", (ctypes.c_int32 * 4) * 4)]


# User mods (templates/common/mod.cuh): the captured tensors, then a block mask's per-query-block key-block
# counts and lists (int32; (batch, head) strides in query-block rows, 0 where the mask does not depend on
# them) and the list's row length. Zero for kernels without mods.
MOD_PARAMS = (
    ("mod", "fg_mod_args", MODARGS), ("bm_count", "const int*", PTR), ("bm_index", "const int*", PTR),
    ("bm_sb", "int", I32), ("bm_sh", "int", I32), ("bm_nb", "int", I32),
)

# A mask_mod's row bounds (KernelSpec.row_bounds; the forward families and bwd_sm90): int32 pairs (first, last
# visible key) per (batch, head, query row) of the block mask (BlockMask.row_bounds), their (batch, head)
# strides in rows (0 where the mask does not depend on them). Null and 0 otherwise.
MOD_ROWS_PARAMS = (("bm_rows", "const int*", PTR), ("bm_rsb", "int", I32), ("bm_rsh", "int", I32))


# FP8 inputs' descale factors (fwd_sm90's fp8): fp32 pointers and their (batch, head) strides, q's with the
# query heads per factor (api.fp8.descale_strides); null and 0 otherwise.
FP8_PARAMS = (
    ("qd", "const float*", PTR), ("kd", "const float*", PTR), ("vd", "const float*", PTR),
    ("qd_sb", "int", I32), ("qd_sh", "int", I32), ("qd_div", "int", I32), ("kd_sb", "int", I32),
    ("kd_sh", "int", I32), ("vd_sb", "int", I32), ("vd_sh", "int", I32),
)


# The forward families' extra output for a sink's backward: the normalised O in fp32, (b, heads, nq, d),
# written only by kernels with sinks and only when set (null otherwise).
FWD_O32_PARAMS = (("o32", "float*", PTR),)


# Packed rows (templates/common/varlen.cuh), in the forward families' blocks: the sequences' starts in q
# and k (int32, seqs + 1 each), the keys in use per sequence (null: cu_k's lengths), the device-built work
# list ([0] its pair count, then (sequence, block) pairs) and the sequence count. Null and 0 for
# rectangular calls.
VARLEN_PARAMS = (
    ("cu_q", "const int*", PTR), ("cu_k", "const int*", PTR), ("used_k", "const int*", PTR),
    ("vl_tiles", "int*", PTR), ("seqs", "int", I32),
)


def varlen_pairs(total: int, seqs: int, block: int) -> int:
    """A bound on a varlen work list's (sequence, block) pairs (common/varlen.cuh): each sequence has at
    most one partial block of ``block`` rows, so ceil(total / block) + seqs."""
    return -(-total // block) + seqs


def varlen_work(q_lens, k_lens, block_m: int, block_n: int, variant) -> list:
    """The host's mirror of the device-built work list (templates/common/varlen.cuh's fg_varlen_tiles):
    every (sequence, query block) pair of sequences with ``q_lens`` / ``k_lens`` rows, as (cost,
    sequence, block), most costly first; the cost is the key blocks the kernel visits for the block
    under ``variant`` (common/variant.cuh's block_first / block_end, with the launch's encoding of the
    window: ``Variant.values`` at the packed totals), clipped to the device's 2047. The device orders
    pairs of one cost as its atomics come; here by (sequence, block)."""
    vals = variant.values(sum(q_lens), sum(k_lens), 1.0)
    left, right, banded = vals["win_left"], vals["win_right"], variant.causal or variant.windowed
    out = []
    for s, (nq, nk) in enumerate(zip(q_lens, k_lens)):
        diag = nk - nq
        for m in range(-(-nq // block_m)):
            r0, r1 = m * block_m, min(m * block_m + block_m, nq) - 1
            first = max(0, r0 + diag - left) // block_n if variant.windowed else 0
            hi = min(nk, r1 + diag + right + 1) if banded else nk
            end = 0 if hi <= 0 else -(-hi // block_n)
            out.append((min(2047, max(0, end - first)), s, m))
    return sorted(out, key=lambda x: (-x[0], x[1], x[2]))


def varlen_list_ints(total: int, seqs: int, block: int) -> int:
    """int32 slots of a varlen work list: the count, a spare, two per pair of the bound."""
    return 2 + 2 * varlen_pairs(total, seqs, block)


def variant_context(spec) -> dict:
    """The template's ``variant_type``: the fg_variant instantiation of ``spec``'s causal and variant flags."""
    flags = (spec.causal, spec.window, spec.softcap, spec.alibi, spec.sinks) + ((True,) if spec.varlen else ())
    return {"variant_type": "fg_variant<" + ", ".join("true" if f else "false" for f in flags) + ">",
            "varlen": spec.varlen}


MOD_TOKEN_LIMIT = 1 << 48  # a spec's ``mod``: the first 12 hex digits of a mod pair's hash, as a number


def mod_context(spec, backward: bool = False, linear: bool = False) -> dict:
    """The template's user mods: ``mod_source``, the device functions printed from the pair of traced graphs
    the spec's ``mod`` token names (flashgen.mods; this process must have traced them), and the
    ``variant_type`` that calls them (common/mod.cuh); nothing for a spec without mods. ``backward``: the
    backward kernel's functions (``ModPair.cuda_backward``: the score_mod unfolded, with its derivative).
    ``linear`` (``Family.linear_mod``): the score_mod as a column-only bias (LINEAR). ``spec.row_bounds``:
    the mask by each row's bounds (ROWS; ValueError for a pair without a mask_mod)."""
    if not spec.mod:
        return {"mod_source": ""}
    pair = mods.of_number(spec.mod)
    rows = spec.row_bounds
    if rows and pair.mask is None:
        raise ValueError(f"{spec.name}: row_bounds masks by a mask_mod's row bounds; mod {spec.mod} has no mask_mod")
    flags = [pair.score is not None, pair.mask is not None] + ([pair.score_grad is not None] if backward else [])
    if linear:
        flags += [False, True, pair.linear.q_coef is not None]
    if rows:
        flags += [False] * (5 - len(flags)) + [True]
    return {"mod_source": pair.cuda_backward() if backward else pair.cuda(linear=linear),
            "variant_type": "fg_mod_variant<" + ", ".join("true" if f else "false" for f in flags) + ">"}


def mod_masked(spec) -> bool:
    """Whether the spec's user mods include a mask_mod: the kernels then walk a block mask's lists
    (V::SPARSE, common/mod.cuh), in the causal kernels' order (the longest query rows first)."""
    return bool(spec.mod) and mods.of_number(spec.mod).mask is not None


def check_mod(family, spec) -> None:
    """ValueError unless ``spec.mod`` is a mod token (or 0) and, when set, no built-in variant is on."""
    if not 0 <= spec.mod < MOD_TOKEN_LIMIT:
        raise ValueError(f"{family.kind}: mod={spec.mod} is not a mod token (0 <= mod < 2^48)")
    if spec.mod and (spec.causal or spec.window or spec.softcap or spec.alibi or spec.sinks or spec.varlen):
        raise ValueError(f"{family.kind}: mod={spec.mod} takes no built-in variant (causal, window, softcap, alibi, "
                         "sinks, varlen): a mod expresses its own mask and scores")
    if spec.row_bounds and not spec.mod:
        raise ValueError(f"{family.kind}: row_bounds masks by a mask_mod's row bounds: it needs mod")


def forward_values(dims, strides_bhs, o_strides, scale: float) -> dict:
    """The parameter values every forward kernel of q (b, h, nq, d), k/v (b, hk, nk, d) takes:
    strides of q, k, v, o and the sizes; ``dims`` = (b, h, hk, nq, nk, d)."""
    b, h, hk, nq, nk, d = dims
    sq, sk, sv = strides_bhs
    return {**stride_values("q", sq), **stride_values("k", sk), **stride_values("v", sv),
            **stride_values("o", o_strides), "nq": nq, "nk": nk, "heads": h, "group": h // hk, "d": d,
            "scale": scale, "scale_log2": scale * math.log2(math.e)}


def first_clean(candidates, check):
    """The first of ``candidates`` (a rule's fitting specs, in its order) that ``check`` (spec -> list
    of problems, e.g. dispatch.resource_problems) finds nothing wrong with; the last one unchecked
    (nothing is left to fall back to: the load reports its problems). ``check`` None: the first."""
    for i, spec in enumerate(candidates):
        if check is None or i == len(candidates) - 1:
            return spec
        problems = check(spec)
        if not problems:
            return spec
        logger().debug("dispatch: skipping %s (%s) for the next tile of the rule", spec.name, "; ".join(problems))
    raise UnsupportedError("the rule has no candidate")


@dataclass(frozen=True)
class Family:
    """One kernel kind's rules. ``problem`` is what it serves (its own kind unless several families
    serve one problem, e.g. "fwd"); ``template`` its entry template under flashgen/templates."""

    kind: str
    template: str                       # entry template, relative to flashgen/templates
    params: tuple                       # ((name, C declaration type, ctypes type), ...)
    problem: str = ""                   # the problem kind it serves ("" -> its own kind)
    head_dims: tuple = HEAD_DIM_TILES
    block_ms: tuple = (16, 32, 48, 64, 96, 128, 192, 256)
    block_ns: tuple = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256)
    warps: tuple = (1, 2, 4, 8)
    stages: tuple = (2, 3, 4)
    max_acc_floats: int = 200           # fp32 accumulators per thread before spilling is likely
    archs: tuple = ("sm_80", "sm_86", "sm_89", "sm_90a")  # compile targets the family runs on
    # The knobs the tuner searches and the values it tries (a subset of the supported values: the
    # sizes that can win, not every legal one); () for a kind that is not tuned.
    tune_space: tuple = ()
    # Why ``flashgen tune`` does not tune this family's problem ("" for a tuned one): shown by ``tune --from``
    # for a recorded key of it.
    untuned_reason: str = ""
    # What the cost model (tuner/cost.py) needs of the kernel: its GEMMs per step (2 in the forward: QK^T
    # and PV; the backward's 3-5), whether a CTA owns query rows (else key rows), and the fraction of the
    # datasheet tensor rate it is credited with (None: the arch's mma.sync fraction).
    gemms: int = 2
    query_outer: bool = True
    tensor_fraction: float | None = None
    # The default rule: per head-dim tile, tile tuples in order of preference (each family reads its
    # own tuple shape in ``rule``).
    tiles: dict = field(default_factory=dict, compare=False, repr=False)
    _struct: list = field(default_factory=list, compare=False, repr=False)
    # Whether the forward adds a score_mod that is a bias linear in kv (flashgen.mods.linear) to the raw
    # scores as a column-only term (common/mod.cuh's LINEAR), the way its causal ALiBi runs.
    linear_mods: bool = False

    @property
    def serves(self) -> str:
        """The problem kind this family serves."""
        return self.problem or self.kind

    def linear_mod(self, spec) -> bool:
        """Whether ``spec``'s kernel runs its score_mod in the linear form (``linear_mods`` and a pair that has
        it): the kernel's template flag and the launch's softmax units (``Variant.linear``) both follow it."""
        return bool(spec.mod) and self.linear_mods and mods.of_number(spec.mod).linear is not None

    # -- spec rules ---------------------------------------------------------
    def require(self, spec, rules) -> None:
        """``ValueError`` unless every (field, allowed values) rule holds for ``spec``."""
        for fname, allowed in rules:
            if getattr(spec, fname) not in allowed:
                raise ValueError(f"{self.kind}: {fname}={getattr(spec, fname)} not in {allowed}")

    def value_rules(self) -> tuple:
        """The (field, allowed values) rules every spec of this family meets."""
        return (("head_dim", self.head_dims), ("block_m", self.block_ms), ("block_n", self.block_ns),
                ("warps", self.warps), ("stages", self.stages), ("arch", self.archs))

    def validate(self, spec) -> None:
        self.require(spec, self.value_rules())
        if spec.block_m % (16 * spec.warps):
            raise ValueError(f"{self.kind}: block_m={spec.block_m} must split into 16-row slices "
                             f"over {spec.warps} warps")

    def complete(self, knobs: dict) -> dict:
        """A point of ``tune_space`` as KernelSpec fields: the knobs plus any field they imply (none here)."""
        return dict(knobs)

    def searched(self, spec) -> bool:
        """Whether the tuner tries this valid point of ``tune_space`` (all of them here)."""
        return True

    def smem_bytes(self, spec) -> int:
        return 2 * spec.head_dim * (spec.block_m + 2 * spec.stages * spec.block_n)

    def static_smem_bytes(self, spec) -> int:
        """Static shared memory of the kernel (its mbarriers), counted against the same per-block limit as
        the dynamic bytes; 0 where a family's is small enough to leave to the dynamic bytes' slack."""
        return 0

    def model_techniques(self, spec) -> tuple[float, float]:
        """What the spec's scheduling techniques change in the cost model's terms (tuner/cost.py):
        (factor on one K/V step's busy time, SM clocks of fixed latency added to every tile). A
        family without such techniques: (1.0, 0.0)."""
        return 1.0, 0.0

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

    def threads(self, spec) -> int:
        """Threads per CTA."""
        return spec.warps * 32

    # -- problems and tiles -------------------------------------------------
    def key_tile(self, d: int, arch: str) -> int:
        """The head-dim tile of the problem key for an input head dim ``d`` on ``arch`` (the families of one
        problem agree on it)."""
        return head_dim_tile(d)

    def tile(self, key: ProblemKey) -> int:
        """The head-dim tile this family's spec for ``key`` has (the key's own by default)."""
        return key.head_dim

    def runs_on(self, arch: str) -> bool:
        return arch in self.archs

    def default_for(self, key: ProblemKey) -> bool:
        """Whether the problem's default rule takes this family for ``key`` (families are asked in
        their registry order; the last one that runs on the arch is the fallback)."""
        return True

    def spec(self, key: ProblemKey, **fields) -> KernelSpec:
        """The spec of this kind for ``key`` with the given tile fields and the key's variant (not validated);
        ``UnsupportedError`` for a variant switch this kind does not take (an FP8 key off fwd_sm90)."""
        used = {f.name for f in fields_of(self.kind)}
        foreign = [name for name, on in key_flags(key.variant).items() if on and name not in used]
        if foreign:
            raise UnsupportedError(f"{self.kind} does not serve {', '.join(foreign)} (the key {key.variant!r} "
                                   f"on {key.arch})")
        return KernelSpec(kind=self.kind, arch=key.arch, dtype=key.dtype, head_dim=self.tile(key),
                          causal=key.causal, **fields).with_tokens(key.variant)

    def rule(self, key: ProblemKey, budget: int) -> list:
        """The default rule's specs for ``key`` that fit ``budget`` bytes of shared memory per block, in
        order of preference (dispatch takes the first its resource check does not refuse). Reads
        ``tiles[head-dim tile]`` as (block_m, block_n, warps, stages, causal, arch) rows, None meaning
        any causal / arch."""
        if not self.runs_on(key.arch):
            raise UnsupportedError(f"{self.kind} does not run on {key.arch} (it runs on {', '.join(self.archs)})")
        d = self.tile(key)
        if d not in self.tiles:
            raise UnsupportedError(f"{self.kind} has no head-dim tile {d} (its tiles: {sorted(self.tiles)})")
        out = []
        for row in self.tiles[d]:
            bm, bn, w, st, causal, arch = row
            if (causal is not None and causal != key.causal) or (arch is not None and arch != key.arch):
                continue
            self._fit(out, self.spec(key, block_m=bm, block_n=bn, warps=w, stages=st), budget)
        return self._fitting(out, key, budget)

    def _fit(self, out: list, spec: KernelSpec, budget: int) -> None:
        """Append ``spec`` (validated) to ``out`` when it fits ``budget`` and is not there yet."""
        if spec.validate().smem_total() <= budget and spec not in out:
            out.append(spec)

    def _fitting(self, out: list, key: ProblemKey, budget: int) -> list:
        if not out:
            raise UnsupportedError(f"no default {self.kind} tile fits {budget} B of shared memory for "
                                   f"d={self.tile(key)}")
        return out

    def rule_keys(self, arch: str) -> list:
        """Every key the default rule may be asked for on ``arch`` (for the compile tier): its tiles that are
        key tiles there (the backward's 160 is not one on sm_90a: problem.BWD_TILE_UP)."""
        if not self.runs_on(arch):
            return []
        return [ProblemKey(self.serves, arch, dt, d, c, 512) for d in self.key_tiles(arch) for dt in DTYPES
                for c in (False, True)]

    def key_tiles(self, arch: str) -> list:
        """The family's head-dim tiles (or head dims) that are a key's tile on ``arch``, in order."""
        return [d for d in (sorted(self.tiles) if self.tiles else self.head_dims) if self.key_tile(d, arch) == d]

    # -- launch -------------------------------------------------------------
    def needs_tile_counters(self, spec) -> bool:
        """Whether a launch takes the stream's two zeroed tile counters (a persistent kernel's ``sched``)."""
        return False

    def param_struct(self):
        """The ctypes Structure matching the emitted C parameter struct."""
        if not self._struct:
            self._struct.append(type(f"{self.kind}_params", (ctypes.Structure,),
                                     {"_fields_": [(n, t) for n, _, t in self.params]}))
        return self._struct[0]


def aligned_struct(fam: Family):
    """A family's ctypes struct padded to the C struct's alignas(64) size (ctypes here has no _align_):
    the Hopper families, whose blocks start with 64-byte-aligned tensor maps."""
    if not fam._struct:
        rows = fam.params
        base = type(f"{fam.kind}_params_base", (ctypes.Structure,), {"_fields_": [(n, t) for n, _, t in rows]})
        pad = -ctypes.sizeof(base) % 64
        fields = [(n, t) for n, _, t in rows] + ([("_pad", ctypes.c_ubyte * pad)] if pad else [])
        fam._struct.append(type(f"{fam.kind}_params", (ctypes.Structure,), {"_fields_": fields}))
    return fam._struct[0]


def hopper_checks(fam, spec, profile, reserved: str) -> list[str]:
    """The checks the Hopper families (fwd_sm90, bwd_sm90) share: sm_90a only, and the fp32 values a
    consumer thread keeps live (``fam.acc_floats``) within its registers after setmaxnreg
    (``fam.regs``; without warp specialization the launch's share) less 32 for ``reserved``."""
    reasons = []
    if profile.arch != "sm_90a":
        reasons.append(f"{fam.kind} needs sm_90a (wgmma, TMA), {profile.name} is {profile.arch}")
    budget = fam.regs(spec)[1] or min(255, 65536 // (spec.warps * 32) // 8 * 8)
    if fam.acc_floats(spec) > budget - 32:
        reasons.append(f"{fam.acc_floats(spec)} fp32 values per consumer thread > {budget - 32} "
                       f"({budget} registers less {reserved}; would spill)")
    return reasons
