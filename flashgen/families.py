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
    flags: tuple = ()                   # the spec flags (spec.FLAG_FIELDS) the family takes
    hints: tuple = (0,)                 # KernelSpec.hint values (decode_split's load flavours; 0 elsewhere)
    archs: tuple = ("sm_80", "sm_86", "sm_89", "sm_90a")  # compile targets the family runs on (spec.ARCHS)
    # The knobs the tuner searches and the values it tries (a subset of the
    # supported values above: the sizes that can win, not every legal one).
    tune_space: tuple = (("block_m", (64, 128, 192)), ("block_n", (32, 48, 64, 96, 128)), ("warps", (4, 8)),
                         ("stages", (2, 3, 4)), ("refill", (0, 1, 2)))
    _struct: list = field(default_factory=list, compare=False, repr=False)

    # -- spec rules ---------------------------------------------------------
    def require(self, spec, rules) -> None:
        """``ValueError`` unless every (field, allowed values) rule holds for ``spec``."""
        for fname, allowed in rules:
            if getattr(spec, fname) not in allowed:
                raise ValueError(f"{self.kind}: {fname}={getattr(spec, fname)} not in {allowed}")

    def value_rules(self) -> tuple:
        """The (field, allowed values) rules every spec of this family meets."""
        return (("head_dim", self.head_dims), ("block_m", self.block_ms), ("block_n", self.block_ns),
                ("warps", self.warps), ("stages", self.stages), ("refill", self.refills))

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

    def threads(self, spec) -> int:
        """Threads per CTA."""
        return spec.warps * 32

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

# decode_split's K/V load flavours, KernelSpec.hint (see DecodeSplitFamily).
LOAD_HINTS = {0: "cp.async.cg", 1: "cp.async.cg + L2::256B prefetch", 2: "cp.async.cg + L2 evict_first",
              3: "cp.async.cg + L2 evict_first + L2::256B prefetch",
              4: "cp.async.bulk rows + per-warp mbarriers (sm_90a)",
              5: "cp.async.bulk rows + per-warp mbarriers + L2 evict_first (sm_90a)"}
# The bulk loader's hints (sm_90a only), each with the cp.async hint that stands in for it elsewhere.
BULK_HINTS = {4: 0, 5: 2}


def load_hint_for(arch: str, hint: int) -> int:
    """``hint`` where ``arch`` runs it, else its cp.async stand-in (a bulk hint off sm_90a)."""
    return BULK_HINTS[hint] if hint in BULK_HINTS and arch != "sm_90a" else hint

# Head-dim tiles of the decode families: inputs with a smaller d are rounded up
# to the next (chunks past d are zero-filled without reading memory).
DECODE_HEAD_DIMS = (32, 64, 128, 256)


@dataclass(frozen=True)
class DecodeSplitFamily(Family):
    """Flash-Decoding, one split of the keys (templates/decode_split.cuh).

    One CTA owns 16 packed query rows (the query heads of one KV head times the
    new tokens) and one split of one sequence's keys; its warps share those rows
    and each takes block_n / warps keys of every block_n-key block. Fixed
    fields: block_m = 16, causal = True (bottom-right aligned), refill = 0 (no
    refill point to choose: K and V of a block are always issued together, one
    ring stage ahead). ``hint`` picks the K/V load flavour: 0 plain
    ``cp.async.cg``, 1 with the ``.L2::256B`` prefetch hint, 2 with an
    evict_first L2 cache policy, 3 both (LOAD_HINTS); 4 and 5 (sm_90a only) the
    bulk loader: one ``cp.async.bulk`` per K/V row into rows padded by 16 bytes,
    per-warp mbarriers (5 with evict_first).
    """

    def validate(self, spec) -> None:
        self.require(spec, (*self.value_rules(), ("causal", (True,))))
        if spec.block_n % (16 * spec.warps):
            raise ValueError(f"{self.kind}: block_n={spec.block_n} must split into 16-key slices over "
                             f"{spec.warps} warps")
        # The K/V loader covers 32*warps / (head_dim/8) rows per pass; a pass must
        # stay inside one 16-row group (one page of a paged cache).
        step = 32 * spec.warps * 8 // spec.head_dim
        if (32 * spec.warps * 8) % spec.head_dim or step == 0 or 16 % step:
            raise ValueError(f"{self.kind}: {spec.warps} warps do not tile head_dim={spec.head_dim} rows "
                             "(rows per load pass must divide 16)")
        if spec.hint in BULK_HINTS and spec.arch != "sm_90a":
            raise ValueError(f"{self.kind}: hint={spec.hint} (cp.async.bulk) needs sm_90a, not {spec.arch}")

    def smem_bytes(self, spec) -> int:
        # Q tile (16 rows) + K and V rings; the cross-warp reduction reuses both. The bulk loader pads
        # each ring row by 16 bytes (its copies cannot swizzle) and adds 2 * stages * warps mbarriers.
        # templates/decode_split.cuh's decode_smem_bytes() is the same formula (static_assert).
        bulk = spec.hint in BULK_HINTS
        row = 2 * spec.head_dim + (16 if bulk else 0)
        return 2 * spec.head_dim * 16 + 2 * spec.stages * spec.block_n * row + (16 * spec.stages * spec.warps if bulk else 0)

    def acc_floats(self, spec) -> int:
        return (spec.head_dim // 8 + spec.block_n // spec.warps // 8) * 4

    def context(self, spec) -> dict:
        """Adds ``min_ctas``, the bulk loader's __launch_bounds__ minimum: the CTAs an sm_90a SM holds by
        shared memory (plus the driver's 1 KB each). Without it ptxas caps those kernels at 128 registers
        and the n128 tile spills; with it ptxas may use what that residency leaves. 0: no minimum given
        (the cp.async kernels keep their plain bounds)."""
        from .gpus import ARCH_SMEM_PER_BLOCK

        ctx = super().context(spec)
        per_sm = ARCH_SMEM_PER_BLOCK["sm_90a"] + 1024
        ctx["min_ctas"] = max(1, per_sm // (self.smem_bytes(spec) + 1024)) if spec.hint in BULK_HINTS else 0
        return ctx


@dataclass(frozen=True)
class DecodeCombineFamily(Family):
    """Merges the splits' partial outputs by their log-sum-exps (templates/decode_combine.cuh).

    Tunable: warps only. The tile fields it does not use are fixed (block_m =
    block_n = 16, stages = 2, refill = 0, hint = 0, causal = False) so one kernel has one name.
    """

    def validate(self, spec) -> None:
        self.require(spec, (("head_dim", self.head_dims), ("warps", self.warps), ("block_m", (16,)),
                            ("block_n", (16,)), ("stages", (2,)), ("refill", (0,)), ("causal", (False,))))
        if spec.head_dim // 4 > 32 * spec.warps:
            raise ValueError(f"{self.kind}: a row of head_dim={spec.head_dim} needs {spec.head_dim // 4} threads, "
                             f"more than {spec.warps} warps")

    def smem_bytes(self, spec) -> int:
        return 0

    def acc_floats(self, spec) -> int:
        return 4


DECODE_PARAMS = (
    ("q", "const elem_t*", PTR), ("k", "const elem_t*", PTR), ("v", "const elem_t*", PTR),
    ("knew", "const elem_t*", PTR), ("vnew", "const elem_t*", PTR),
    ("o", "elem_t*", PTR), ("lse", "float*", PTR), ("o_ws", "float*", PTR), ("lse_ws", "float*", PTR),
    ("seqlens", "const int*", PTR), ("block_table", "const int*", PTR),
    # The in-kernel merge's counters, two ints per (batch, KV head, m-block): a ticket and a count of
    # stored partials, zero between launches (the merging CTA resets its group's); null: the splits only
    # write the workspace (decode_combine merges).
    ("counters", "int*", PTR),
    # (batch or page, seq, head) strides; for a paged cache "_sb" is the page stride.
    *_strides("q", "k", "v", "knew", "vnew", "o"),
    ("bt_sb", "long long", I64), ("total_rows", "long long", I64),
    ("nq", "int", I32), ("heads_q", "int", I32), ("group", "int", I32), ("rows", "int", I32),
    ("d", "int", I32), ("seqlen_k", "int", I32), ("page_shift", "int", I32), ("num_splits", "int", I32),
    ("scale", "float", F32), ("scale_log2", "float", F32),
)

COMBINE_PARAMS = (
    ("o_ws", "const float*", PTR), ("lse_ws", "const float*", PTR), ("o", "elem_t*", PTR), ("lse", "float*", PTR),
    ("total_rows", "long long", I64), ("nq", "int", I32), ("heads_q", "int", I32), ("d", "int", I32),
    ("num_splits", "int", I32),
)

class TMAP(ctypes.Structure):
    """A CUtensorMap's 128 opaque bytes (built by flashgen.tma)."""

    _fields_ = [("v", ctypes.c_uint64 * 16)]


# The Hopper forward's parameter block: the three tensor maps first (each at a
# 64-byte-aligned offset, as the C struct's alignas(64) wants), then what the
# epilogue and the masks need. Q/K/V addresses and strides live in the maps.
SM90_PARAMS = (
    ("tm_q", "fg_tmap", TMAP), ("tm_k", "fg_tmap", TMAP), ("tm_v", "fg_tmap", TMAP),
    ("o", "elem_t*", PTR), ("lse", "float*", PTR),
    ("dbg_s", "float*", PTR),  # debug only (null in every normal call): S of the first K block, see fwd_sm90.cuh
    *_strides("o"),
    ("nq", "int", I32), ("nk", "int", I32), ("heads", "int", I32), ("group", "int", I32),
    ("d", "int", I32), ("scale", "float", F32), ("scale_log2", "float", F32),
    # The tile walk (fwd_sm90.cuh, tile_coords): persist's two tile counters (next tile, CTAs done; zero
    # between launches; null otherwise), the tile count (m-blocks x heads x batch), the m-blocks per
    # (batch, head), and the L2 sections of (batch, head) pairs: sec_big of sec + 1, then sections of sec
    # (api.tile_sections).
    ("sched", "int*", PTR), ("tiles", "int", I32), ("m_blocks", "int", I32), ("sec", "int", I32),
    ("sec_big", "int", I32),
)

SM90_HEAD_DIMS = (64, 128, 256)

# fwd_sm90's named flag sets (the benchmark's ablation, the smoke and the GPU tests share these names):
# a base for (warpspec, pingpong, overlap), then optional tokens, e.g. "ws_pp_kv_lz_e1_s3_m192".
SM90_FLAG_BASES = {"plain": (False, False, False), "ov": (False, False, True), "ws": (True, False, False),
                   "ws_pp": (True, True, False), "ws_ov": (True, False, True), "full": (True, True, True)}
SM90_FLAG_SWITCHES = {"kv": "sepkv", "lz": "lazy", "ps": "persist"}
SM90_FLAG_NUMBERS = {"e": "emu", "s": "stages", "m": "block_m", "n": "block_n"}
# The flag sets bench/bench_sm90.py's ablation times per head dim (hidden 2048, N = 8k, causal both) and
# tests/test_sm90.py compiles: the ladder measured so far, then each new flag alone and together
# (sepkv, lazy, emu 1/2/4), deeper rings, and at d = 64 the 192-row (three consumers) and 192-key tiles.
SM90_ABLATION = {
    64: ("plain", "ws", "ws_pp", "full", "ws_s3", "ws_pp_s3", "full_s3",
         "ws_kv", "ws_pp_kv", "full_kv", "ws_pp_kv_s3", "full_kv_s3", "ws_pp_kv_lz_s3",
         "ws_pp_kv_e1_s3", "ws_pp_kv_e2_s3", "ws_pp_kv_e4_s3", "ws_pp_kv_lz_e1_s3", "ws_pp_kv_lz_e2_s3",
         "full_kv_lz_e1_s3", "ws_kv_lz_e1_s3", "ws_pp_kv_lz_e1_s4",
         "ws_s3_m192", "ws_pp_kv_s3_m192", "ws_pp_kv_lz_e1_s3_m192", "full_kv_lz_e1_s3_m192",
         "ws_pp_kv_lz_e1_s3_n192"),
    128: ("plain", "ws", "ws_pp", "full", "ws_s3", "ws_pp_s3", "ws_ov_s3", "full_s3",
          "ws_kv", "ws_pp_kv", "full_kv", "ws_pp_kv_s3", "full_kv_s3", "ws_pp_kv_lz_s3",
          "ws_pp_kv_e1_s3", "ws_pp_kv_e2_s3", "ws_pp_kv_e4_s3", "ws_pp_kv_lz_e1_s3", "full_kv_lz_s3",
          "ws_kv_lz_s3"),
}


def sm90_flag_set(name: str) -> dict:
    """The KernelSpec fields a named fwd_sm90 flag set sets: warpspec, pingpong, overlap from the base
    (SM90_FLAG_BASES), then per token: ``kv`` sepkv, ``lz`` lazy, ``ps`` persist, ``e<k>`` emu=k, ``s<k>`` stages,
    ``m<k>`` block_m, ``n<k>`` block_n. ``ValueError`` for a name it cannot read."""
    parts = name.split("_")
    cut = 2 if "_".join(parts[:2]) in SM90_FLAG_BASES else 1
    if "_".join(parts[:cut]) not in SM90_FLAG_BASES:
        raise ValueError(f"fwd_sm90 flag set {name!r}: no base among {sorted(SM90_FLAG_BASES)}")
    out = dict(zip(("warpspec", "pingpong", "overlap"), SM90_FLAG_BASES["_".join(parts[:cut])]))
    for token in parts[cut:]:
        if token in SM90_FLAG_SWITCHES:
            out[SM90_FLAG_SWITCHES[token]] = True
        elif token[:1] in SM90_FLAG_NUMBERS and token[1:].isdigit():
            out[SM90_FLAG_NUMBERS[token[0]]] = int(token[1:])
        else:
            raise ValueError(f"fwd_sm90 flag set {name!r}: unknown token {token!r}")
    return out


def sm90_named_spec(head_dim: int, causal: bool, name: str = "ws", dtype: str = "bf16", **fields):
    """The fwd_sm90 spec of flag set ``name`` (``sm90_flag_set``) at head-dim tile ``head_dim``: block_m 128,
    block_n 128 (64 at d = 256) and 2 stages unless the name says otherwise, ``fields`` last; warps follow
    from block_m and warpspec. Validated."""
    from .spec import KernelSpec

    f = dict(block_m=128, block_n=64 if head_dim == 256 else 128, stages=2)
    f.update(sm90_flag_set(name))
    f.update(fields)
    f["warps"] = 4 * (f["block_m"] // 64 + int(f["warpspec"]))
    return KernelSpec(kind="fwd_sm90", arch="sm_90a", dtype=dtype, head_dim=head_dim, causal=causal, **f).validate()


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


@dataclass(frozen=True)
class Sm90Family(Family):
    """FlashAttention forward on Hopper: TMA, mbarriers, wgmma (templates/fwd_sm90.cuh), sm_90a only.

    block_m = 64 x consumer warpgroups; warps = 4 x (consumer warpgroups +
    a producer warpgroup when warpspec); refill is unused (0). Flags:
    warpspec, pingpong (needs warpspec and two or three consumers: they take turns), overlap,
    emu (EMUS: eighths of S's columns whose exp2 runs on the FMA pipe), sepkv (needs warpspec:
    separate K and V empty barriers), lazy (lean softmax), persist (needs warpspec: a persistent
    kernel, the grid sized to the SMs). The grid is 1-D over the tiles, walked in sections of (batch, head)
    pairs whose K/V fit in half the L2 (causal: longest rows first).
    """

    EMUS = (0, 1, 2, 4)

    def consumers(self, spec) -> int:
        return spec.block_m // 64

    def validate(self, spec) -> None:
        self.require(spec, (("head_dim", self.head_dims), ("block_m", self.block_ms),
                            ("block_n", self.block_ns), ("stages", self.stages), ("refill", (0,)),
                            ("arch", self.archs)))
        want = 4 * (self.consumers(spec) + int(spec.warpspec))
        if spec.warps != want:
            raise ValueError(f"{self.kind}: block_m={spec.block_m} with warpspec={spec.warpspec} means "
                             f"warps={want}, got {spec.warps}")
        if spec.pingpong and not (spec.warpspec and self.consumers(spec) >= 2):
            raise ValueError(f"{self.kind}: pingpong needs warpspec and two or three consumer warpgroups "
                             "(block_m=128 or 192)")
        if spec.emu not in self.EMUS:
            raise ValueError(f"{self.kind}: emu={spec.emu} not in {self.EMUS}")
        if spec.sepkv and not spec.warpspec:
            raise ValueError(f"{self.kind}: sepkv needs warpspec (the producer warpgroup waits on the K and V "
                             "barriers)")
        if spec.persist and not spec.warpspec:
            raise ValueError(f"{self.kind}: persist needs warpspec (the producer warpgroup runs ahead into the "
                             "next tile; without it the loads are issued in line by a consumer)")

    def complete(self, knobs: dict) -> dict:
        """warps follows from block_m and warpspec (4 per consumer warpgroup, 4 for the producer): not a knob."""
        out = dict(knobs)
        if "warps" not in out and "block_m" in out:
            out["warps"] = 4 * (out["block_m"] // 64 + int(out.get("warpspec", False)))
        return out

    def searched(self, spec) -> bool:
        """The softmax flags (emu, lazy) only with warpspec: without a producer warpgroup the kernel is the
        plain baseline, slower at every measured point (bench/NOTES.md); emu only at d = 64, the one head dim
        where the exp2s take as long as the GEMMs (at 128 and 256 they take half or less)."""
        return (spec.warpspec or not (spec.emu or spec.lazy)) and (spec.head_dim == 64 or not spec.emu)

    # Dynamic + static shared memory one sm_90a block may use (gpus.ARCH_SMEM_PER_BLOCK), and what the
    # mbarriers (static) may take of it.
    SMEM_LIMIT, STATIC_RESERVE = 232448, 256

    def q_pieces(self, spec) -> int:
        """Q pieces in shared memory (fwd_sm90.cuh, "Q pieces"): one per consumer warpgroup (64 rows each);
        a persistent kernel gets a ring of twice that where it fits (the next tile's Q loads during this
        tile), else one spare piece (the first warpgroup's next Q loads while the last finishes this
        tile), else none."""
        nwg = spec.block_m // 64
        if spec.persist:
            for pieces in (2 * nwg, nwg + 1):
                if self._smem(spec, pieces) + self.STATIC_RESERVE <= self.SMEM_LIMIT:
                    return pieces
        return nwg

    @staticmethod
    def _smem(spec, pieces) -> int:
        # Q pieces of 64 rows, K and V rings, and 1 KB to align the tiles to 1024 bytes (the
        # 128-byte swizzle's period); the mbarriers are static shared memory.
        return 2 * spec.head_dim * (pieces * 64 + 2 * spec.stages * spec.block_n) + 1024

    def smem_bytes(self, spec) -> int:
        return self._smem(spec, self.q_pieces(spec))

    def regs(self, spec) -> tuple[int, int]:
        """(producer, consumer) registers per thread after setmaxnreg (only with warpspec and >= 2 consumers).
        persist: the producer's tile loop (fetching tiles, the Q ring) spilled at 24 (NVRTC 13.5: 4-8 bytes),
        so it keeps 40 (two consumers, 232 each) or 32 (three, 160 each); 128 x 40 + 256 x 232 = 64512 and
        128 x 32 + 384 x 160 = 65536 registers."""
        if not spec.warpspec:
            return (0, 0)
        if spec.persist:
            return {2: (40, 232), 3: (32, 160)}.get(self.consumers(spec), (0, 0))
        return {2: (24, 240), 3: (24, 160)}.get(self.consumers(spec), (0, 0))

    def acc_floats(self, spec) -> int:
        """Per consumer thread: O (head_dim / 2), S (block_n / 2) and packed P (block_n / 4)."""
        return spec.head_dim // 2 + spec.block_n // 2 + spec.block_n // 4

    def extra_checks(self, spec, profile) -> list[str]:
        return hopper_checks(self, spec, profile, "addressing and softmax state")

    def context(self, spec) -> dict:
        producer, consumer = self.regs(spec)
        return {"params": [(n, c) for n, c, _ in self.params],
                "param_bytes": ctypes.sizeof(self.param_struct()),
                "producer_regs": producer or 24, "consumer_regs": consumer or 240,
                "q_pieces": self.q_pieces(spec)}

    def param_struct(self):
        """ctypes struct padded to the C struct's alignas(64) size (ctypes here has no _align_)."""
        if not self._struct:
            rows = self.params
            base = type(f"{self.kind}_params_base", (ctypes.Structure,), {"_fields_": [(n, t) for n, _, t in rows]})
            pad = -ctypes.sizeof(base) % 64
            fields = [(n, t) for n, _, t in rows] + ([("_pad", ctypes.c_ubyte * pad)] if pad else [])
            self._struct.append(type(f"{self.kind}_params", (ctypes.Structure,), {"_fields_": fields}))
        return self._struct[0]


FAMILIES: dict[str, Family] = {
    "fwd_v2": Family("fwd_v2", "fwd_v2.cu.j2", FWD_PARAMS),
    "decode_split": DecodeSplitFamily("decode_split", "decode_split.cu.j2", DECODE_PARAMS,
                                      head_dims=DECODE_HEAD_DIMS, block_ms=(16,),
                                      block_ns=(16, 32, 48, 64, 96, 128),
                                      stages=(2, 3, 4, 5, 6, 8, 10, 12), refills=(0,), hints=tuple(LOAD_HINTS)),
    "decode_combine": DecodeCombineFamily("decode_combine", "decode_combine.cu.j2", COMBINE_PARAMS,
                                          head_dims=DECODE_HEAD_DIMS),
    "fwd_sm90": Sm90Family("fwd_sm90", "fwd_sm90.cu.j2", SM90_PARAMS,
                           head_dims=SM90_HEAD_DIMS,
                           block_ms=(64, 128, 192), block_ns=(64, 80, 96, 112, 128, 144, 160, 176, 192),
                           warps=(4, 8, 12, 16), stages=(2, 3, 4), refills=(0,),
                           flags=("warpspec", "pingpong", "overlap", "emu", "sepkv", "lazy", "persist"),
                           archs=("sm_90a",),
                           # warps is implied by block_m and warpspec (Sm90Family.complete), not searched.
                           # emu 2 and 4 (a quarter / half of the exp2s on the FMA pipe) are not searched: both
                           # lost at every H200 ablation cell; emu 1 (-1/+2 % at d=64) and lazy (-7..+3 %) are
                           # mixed, so the tuner decides per key (bench/NOTES.md, "sm90x measured").
                           tune_space=(("block_m", (64, 128, 192)), ("block_n", (64, 80, 96, 112, 128, 160, 176, 192)),
                                       ("stages", (2, 3, 4)), ("warpspec", (False, True)), ("pingpong", (False, True)),
                                       ("overlap", (False, True)), ("sepkv", (False, True)), ("lazy", (False, True)),
                                       ("emu", (0, 1)), ("persist", (False, True)))),
                           # persist (the persistent kernel, dynamic tiles) won 2-5 % at N = 2k-4k and lost up
                           # to 10 % at 16k on the H200 (bench/NOTES.md, session 4): the tuner decides per key.
}

from .bwd_families import BWD_FAMILIES  # noqa: E402 -- needs Family, defined above

FAMILIES.update(BWD_FAMILIES)

# Baselines for study and comparison: standard attention's three passes and FlashAttention V1.
from .baseline_specs import BASELINE_FAMILIES  # noqa: E402  (it builds on Family, defined above)

FAMILIES.update(BASELINE_FAMILIES)


def family(kind: str) -> Family:
    if kind not in FAMILIES:
        raise ValueError(f"unknown kernel kind {kind!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[kind]
