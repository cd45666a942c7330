"""What dispatch and the tuned tables key on: ``ProblemKey``, sequence-length buckets, head-dim tiles.

A key names a *problem* (``kind``: "fwd" for the forward, "bwd_dkdv" for the
backward's dK/dV kernel with dQ by atomics, "decode_split", ...), never a
kernel family: several families may serve one problem (``flashgen.families``
says which), and the tables store problem keys only. ``head_dim`` is the key's
head-dim tile (``head_dim_tile``, or ``bwd_head_dim_tile`` for the backward's
kinds); each family maps it to its own tile.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import UnsupportedError

# Seqlen buckets the tuner measures at; any length maps to the nearest one at or above it.
BUCKETS = (512, 1024, 2048, 4096, 8192, 16384)

# Head-dim tiles of the keys (and of the mma.sync templates: 16-byte chunks per row must be a
# multiple of 4 for the shared-memory swizzle, templates/common/tile.cuh).
HEAD_DIM_TILES = (32, 64, 96, 128, 160, 192, 224, 256)


@dataclass(frozen=True)
class ProblemKey:
    """One problem: kind, compile target, dtype, head-dim tile, causal, bucket of the query length, and
    the variant: the name tokens of the variant options in use ("win", "cap", "alibi", "sink", in
    KernelSpec's field order, joined by "_"; "" for none), which the problem's specs carry too."""

    kind: str
    arch: str
    dtype: str
    head_dim: int
    causal: bool
    bucket: int
    variant: str = ""

    def replace(self, **changes) -> "ProblemKey":
        from dataclasses import replace

        return replace(self, **changes)


def bucket_of(seqlen: int) -> int:
    for b in BUCKETS:
        if seqlen <= b:
            return b
    return BUCKETS[-1]


def check_head_dim(d: int) -> None:
    """``UnsupportedError`` unless ``d`` is a multiple of 8 from 8 to 256: the kernels load rows in
    8-element (16-byte) chunks, so a d of 12 must not map to the 32 tile."""
    if type(d) is not int or d < 8 or d % 8 or d > 256:
        raise UnsupportedError(f"head dim {d} is not supported (supported: multiples of 8 up to 256)")


def smallest_tile(d: int, tiles) -> int:
    """The smallest of ``tiles`` that holds head dim ``d`` (checked by ``check_head_dim``)."""
    check_head_dim(d)
    for tile in tiles:
        if d <= tile:
            return tile
    raise UnsupportedError(f"head dim {d} is not supported (largest tile {max(tiles)})")


def head_dim_tile(d: int) -> int:
    """The key's head-dim tile for an input head dim (forward, decode and the study families)."""
    return smallest_tile(d, HEAD_DIM_TILES)


# Backward head-dim tiles taken by a larger one, per arch ("" any): 224 by 256 everywhere (no 224 tile in the
# backward: every warp split of a 224-wide head dim spills its dK/dV accumulators); on sm_90a 160 by 192, so
# that bwd_sm90 serves it (its split tile gives each of two warpgroups half the columns, 80 of 160, which no
# swizzle panel of 32 or 64 columns starts; a 96 / 64 split would cost what 192's 96 / 96 costs on dK and dV,
# the larger half setting the step). tests/test_bwd_cpu.py checks that every tile here is one bwd_sm90 has.
_BWD_TILE_UP_ANY = {224: 256}
BWD_TILE_UP = {"": _BWD_TILE_UP_ANY, "sm_90a": {**_BWD_TILE_UP_ANY, 160: 192}}


def bwd_head_dim_tile(d: int, arch: str) -> int:
    """The backward keys' head-dim tile on ``arch``: ``head_dim_tile``, raised where ``BWD_TILE_UP`` says
    (every backward kernel of the call, preprocess, dK/dV, convert and the dQ accumulator, runs at it)."""
    tile = head_dim_tile(d)
    return BWD_TILE_UP.get(arch, BWD_TILE_UP[""]).get(tile, tile)
