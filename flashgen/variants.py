"""The masks and score changes real models use, defined once (the kernels' block ranges, the reference,
the benchmarks' FLOP counts and the docs take them from here).

Query ``i`` of ``sq`` and key ``j`` of ``sk`` are ``o = j - (i + sk - sq)`` apart (bottom-right
alignment, as for ``causal``):

- **window** ``(left, right)``: key j is visible from query i iff ``-left <= o <= right``; ``-1``
  leaves that side unbounded. ``causal=True`` is ``right = 0`` (with or without a window: a causal
  call's right side is 0, FlashAttention's ``window_size`` convention).
- **softcap** ``c > 0``: the scaled score ``s = scale * q.k`` becomes ``c * tanh(s / c)`` (Gemma 2).
- **ALiBi** slope ``m`` (per head, or per batch and head): ``-m * |o|`` is added to the score, after the
  softcap (FlashAttention's order).
- **sinks** (one logit per head): ``exp(sink)`` joins every row's softmax denominator and brings no
  value (gpt-oss); the LSE includes it.

A row that sees no key gives 0; its LSE is -inf, or the sink's logit with sinks.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .errors import UnsupportedError

UNBOUNDED = -1
# The variant options' name tokens (KernelSpec's window, softcap, alibi and sinks fields), in field order:
# a problem key's ``variant`` is those in use joined by "_".
KEY_TOKENS = (("window", "win"), ("softcap", "cap"), ("alibi", "alibi"), ("sinks", "sink"), ("varlen", "vl"),
              ("fp8", "fp8"))


MOD_KEY_LIMIT = 1 << 48  # a mod key's number: KernelSpec.mod's range (families.base.MOD_TOKEN_LIMIT)


def mod_key(token: int) -> str:
    """The problem-key variant of user mods (flashgen.mods) whose pair's number is ``token``: "mod<token>",
    the kernel name's own spelling of KernelSpec.mod (a mod call's tuned entry is keyed by its pair's hash)."""
    if type(token) is not int or not 0 < token < MOD_KEY_LIMIT:
        raise ValueError(f"a mod token is an int in (0, 2^48), got {token!r}")
    return f"mod{token}"


def mod_of(text: str) -> int:
    """The mod token of a problem key's variant ("mod<token>"), 0 for every other variant."""
    if isinstance(text, str) and text.startswith("mod") and text[3:].isdigit() and text[3:4] != "0" \
            and int(text[3:]) < MOD_KEY_LIMIT:
        return int(text[3:])
    return 0


def is_key_variant(text) -> bool:
    """Whether ``text`` is a problem key's variant: "" or tokens of KEY_TOKENS in their order, once each, or
    one user mods' "mod<token>" alone (``mod_key``: a mod takes no built-in variant)."""
    if text == "" or mod_of(text):
        return True
    tokens = [t for _, t in KEY_TOKENS]
    parts = text.split("_") if isinstance(text, str) else [None]
    return all(p in tokens for p in parts) and [tokens.index(p) for p in parts] == sorted(
        set(tokens.index(p) for p in parts))


def window_of(causal: bool, window=None) -> tuple[int, int]:
    """The ``(left, right)`` window of a call: ``window`` (None: unbounded both sides) with a causal
    call's right side set to 0. ``ValueError`` for anything but two ints >= -1."""
    if window is None:
        left, right = UNBOUNDED, UNBOUNDED
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(f"window must be (left, right), got {window!r}")
        left, right = window
        for name, v in (("left", left), ("right", right)):
            if type(v) is not int or v < UNBOUNDED:
                raise ValueError(f"window {name} must be an int >= -1 (-1: unbounded), got {v!r}")
    return left, (0 if causal else right)


def is_banded(left: int, right: int) -> bool:
    """Whether a window hides anything on either side (a plain call is ``(-1, -1)``)."""
    return left != UNBOUNDED or right != UNBOUNDED


def visible(i: int, j: int, sq: int, sk: int, left: int, right: int) -> bool:
    """Whether key ``j`` is visible from query ``i`` (both in range) under the window."""
    o = j - (i + sk - sq)
    return (left == UNBOUNDED or o >= -left) and (right == UNBOUNDED or o <= right)


def key_range(i0: int, i1: int, sq: int, sk: int, left: int, right: int) -> tuple[int, int]:
    """The keys ``[lo, hi)`` that any query of rows ``[i0, i1)`` sees (``lo >= hi``: none); rows past
    ``sq`` count as rows (the kernels' padded rows), keys are clipped to ``[0, sk)``."""
    if i1 <= i0:
        return 0, 0
    shift = sk - sq
    lo = 0 if left == UNBOUNDED else max(0, i0 + shift - left)
    hi = sk if right == UNBOUNDED else min(sk, i1 - 1 + shift + right + 1)
    return lo, max(lo, hi)


def block_range(m0: int, bm: int, bn: int, sq: int, sk: int, left: int, right: int) -> tuple[int, int]:
    """Key blocks ``[first, end)`` (of ``bn`` keys) that query block ``[m0, m0 + bm)`` must visit: every
    block holding a key some of its rows see, and none other."""
    lo, hi = key_range(m0, min(m0 + bm, sq), sq, sk, left, right)
    if lo >= hi:
        return 0, 0
    return lo // bn, (hi + bn - 1) // bn


def block_needs_mask(m0: int, bm: int, n0: int, bn: int, sq: int, sk: int, left: int, right: int) -> bool:
    """Whether key block ``[n0, n0 + bn)`` of query block ``[m0, m0 + bm)`` has a (query, key) pair the
    window hides or a key past ``sk`` (a boundary block); an interior block runs without masking."""
    i0, i1 = m0, min(m0 + bm, sq)
    if n0 + bn > sk:
        return True
    shift = sk - sq
    if left != UNBOUNDED and n0 < (i1 - 1) + shift - left:  # the last row's first visible key
        return True
    if right != UNBOUNDED and n0 + bn - 1 > i0 + shift + right:  # the first row's last visible key
        return True
    return False


def visible_pairs(sq: int, sk: int, left: int, right: int) -> int:
    """How many (query, key) pairs the window lets through: what the benchmarks count FLOPs on."""
    total = 0
    for i in range(sq):
        lo, hi = key_range(i, i + 1, sq, sk, left, right)
        total += max(0, hi - lo)
    return total


def check_softcap(softcap) -> float:
    """``softcap`` as a float: 0 (off) or a finite positive number; ``ValueError`` otherwise."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise ValueError(f"softcap must be a number (0: off), got {softcap!r}")
    value = float(softcap)
    if value != 0.0 and not (value > 0 and math.isfinite(value)):
        raise ValueError(f"softcap must be 0 (off) or a finite positive number, got {softcap!r}")
    # The kernels get it (and it times log2 e, their exp2's factor) as a float32.
    if value and not FLOAT32_TINY <= value <= FLOAT32_MAX / math.log2(math.e):
        raise UnsupportedError(f"softcap {softcap!r} is outside float32's normal range")
    return value


FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38


@dataclass(frozen=True)
class Variant:
    """One call's variant options as the kernels take them: the causal flag and window sides after
    ``window_of`` (a non-causal window whose right side is 0 is the causal kernel's mask, and is served by
    it), the softcap (0: off), and whether ALiBi slopes and sinks come with the call (their values are
    tensors, passed per launch). ``flags`` are the spec fields it sets, ``values`` the launch parameters
    of templates/common/variant.cuh."""

    causal: bool = False
    left: int = UNBOUNDED
    right: int = UNBOUNDED
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    varlen: bool = False
    scored: bool = False  # a user score_mod (flashgen.mods): it takes the scaled score, the softmax runs on its result
    score_factor: float = 1.0  # (scored) c of a score_mod c * f(...) whose f the kernel prints (mods.Graph.factors)
    linear: bool = False  # (scored) f is a bias linear in kv, added to the raw scores (mods.linear): raw softmax units
    fp8: bool = False  # float8 e4m3 operands with descale factors (the forward's q, k, v; decode's cache)

    @classmethod
    def of(cls, causal: bool, window=None, softcap=0.0, alibi: bool = False, sinks: bool = False,
           varlen: bool = False, fp8: bool = False) -> "Variant":
        left, right = window_of(causal, window)
        return cls(causal or right == 0, left, 0 if right == 0 else right, check_softcap(softcap), alibi, sinks,
                   varlen, fp8=fp8)

    @property
    def windowed(self) -> bool:
        """Whether a window hides keys the causal mask (or no mask) would show."""
        return self.left != UNBOUNDED or (not self.causal and self.right != UNBOUNDED)

    @property
    def plain(self) -> bool:
        """No mask but causal's and no score change (packed rows may still be: ``varlen``)."""
        return not (self.windowed or self.softcap or self.alibi or self.sinks)

    def flags(self) -> dict:
        """The KernelSpec fields of this variant (``causal`` among them)."""
        return {"causal": self.causal, "window": self.windowed, "softcap": self.softcap > 0,
                "alibi": self.alibi, "sinks": self.sinks, "varlen": self.varlen, "fp8": self.fp8}

    def key(self) -> str:
        """The problem key's ``variant``: the tokens of the spec fields this variant sets."""
        flags = self.flags()
        return "_".join(t for f, t in KEY_TOKENS if flags[f])

    def names(self) -> list[str]:
        """The options in use, as the API spells them (for error messages)."""
        return [n for n, on in (("window", self.windowed), ("softcap", self.softcap > 0),
                                ("alibi_slopes", self.alibi), ("sinks", self.sinks)) if on]

    def values(self, nq: int, nk: int, scale: float, forward: bool = True) -> dict:
        """The launch parameters of templates/common/variant.cuh: the window's sides (an unbounded one
        as a bound no row reaches: left nk, right nq; both clipped there, so that no index sum leaves
        int32 while nq + nk does not) and, with a softcap c, the factor ``scale / c`` before the tanh
        and c in place of the softmax's scale (``scale_log2``, and for the ``forward`` its LSE's
        ``scale``: the kernel's scores are then tanh values, and c times one is the capped score; the
        backward keeps the softmax's scale for the gradients)."""
        left = nk if self.left == UNBOUNDED else min(self.left, nk)
        right = 0 if self.causal else (nq if self.right == UNBOUNDED else min(self.right, nq))
        out = {"win_left": left, "win_right": right, "cap_in": 0.0}
        if self.scored:  # the kernel scales the raw score for the mod (cap_in); the softmax runs on c f
            units = scale if self.linear else 1.0  # linear: the scores stay raw, the bias comes over the scale
            out.update(cap_in=scale, scale_log2=self.score_factor * units * math.log2(math.e))
            if forward:
                out["scale"] = self.score_factor * units
        if self.softcap:
            out.update(cap_in=scale / self.softcap, scale_log2=self.softcap * math.log2(math.e))
            if forward:
                out["scale"] = self.softcap
        return out

    def replace(self, **changes) -> "Variant":
        return dataclasses.replace(self, **changes)

    def backward(self) -> "Variant":
        """The variant of the backward's kernels: the sinks are the torch layer's (their gradient comes
        from the LSE and D, and the LSE already holds them)."""
        return Variant(self.causal, self.left, self.right, self.softcap, self.alibi, False, self.varlen)

    def pairs(self, sq: int, sk: int) -> int:
        """The (query, key) pairs this variant's mask lets through (the FLOP count's)."""
        return visible_pairs(sq, sk, self.left, 0 if self.causal else self.right)


PLAIN = Variant()

# What a tuning run (and the tuner's check) measures a variant key at: a key holds the variant's switches,
# not its values. The window: 4096 keys back (Mistral's, gpt-oss's), a quarter of the length where that
# is shorter (so that the window bites at every bucket), as far ahead without causal; the softcap: 50
# (Gemma 2's attention cap).
TUNING_WINDOW = 4096
TUNING_SOFTCAP = 50.0


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's geometric slopes for ``heads`` heads, 2^(-8 (i + 1) / heads) (the paper's; what the tuner and
    the benchmarks measure ALiBi with)."""
    return [2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)]


def spec_key(spec) -> str:
    """The problem-key variant of a spec's switches (KEY_TOKENS); "" for a kind without them."""
    return "_".join(t for f, t in KEY_TOKENS if getattr(spec, f, False))


VARIANT_OFF = {f: False for f, _ in KEY_TOKENS}  # the spec fields with every switch off


def key_flags(text: str) -> dict:
    """The spec fields a problem key's ``variant`` sets (``is_key_variant`` text)."""
    tokens = text.split("_") if text else []
    return {f: t in tokens for f, t in KEY_TOKENS}


def tuning_variant(key_variant: str, causal: bool, seqlen: int) -> Variant:
    """The variant a tuning run measures ``key_variant`` at, for sequences of ``seqlen``."""
    flags = key_flags(key_variant)
    window = None
    if flags["window"]:
        side = max(1, min(TUNING_WINDOW, seqlen // 4))
        window = (side, 0 if causal else side)
    return Variant.of(causal, window, TUNING_SOFTCAP if flags["softcap"] else 0.0, flags["alibi"], flags["sinks"],
                      flags["varlen"], flags["fp8"])


def tuning_kwargs(key_variant: str, causal: bool, n: int, heads: int, device) -> dict:
    """``flashgen.attention``'s variant keywords for a measurement of ``key_variant`` (the tuner's trials,
    the stalls bench's profiled call): the window and softcap of ``tuning_variant``, geometric ALiBi
    slopes, random sinks; {} for the plain variant."""
    if not key_variant:
        return {}
    import torch

    v = tuning_variant(key_variant, causal, n)
    kw: dict = {}
    if v.windowed:
        kw["window"] = (v.left, v.right)
    if v.softcap:
        kw["softcap"] = v.softcap
    if v.alibi:
        kw["alibi_slopes"] = torch.tensor(alibi_slopes(heads), device=device)
    if v.sinks:
        kw["sinks"] = torch.randn(heads, device=device, dtype=torch.float32)
    return kw
