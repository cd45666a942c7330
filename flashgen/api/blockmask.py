"""Block masks in FlexAttention's style: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True: the key is
visible) written with torch ops, reduced to the key blocks each query block visits.

``create_block_mask`` evaluates ``mask_mod`` on broadcast index tensors, a chunk of query rows and keys
at a time so that a 32k x 32k mask never lives whole, and returns a ``BlockMask``. The kernel's tile is
chosen by dispatch after the mask exists, so ``BlockMask.for_tile(block_m, block_n)`` reduces the
element mask to that tile on request (cached per tile): per query block, how many key blocks are not
empty, which they are (ascending), and whether each is partial (some in-range pair masked out: the
kernel applies the mask there) or full (no masking needed). A mask that does not depend on ``b`` or
``h`` keeps size 1 in that dimension; the kernel reads it with stride 0.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from ..errors import UnsupportedError

INT32_MAX = 2**31 - 1  # the kernels index the block tables and key blocks with 32-bit ints
# The most mask elements one evaluation of mask_mod (and one block reduction) covers; its index
# arithmetic makes int64 temporaries of this many elements.
CHUNK_ELEMENTS = 64 * 2**20
# An element mask up to this many bytes (one per element) is kept after its first evaluation, so other
# tiles reduce it without calling mask_mod again; a larger one is evaluated again per tile.
DENSE_CACHE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class TileBlocks:
    """A block mask at one kernel tile of ``block_m`` queries by ``block_n`` keys.

    ``counts``: int32 (Bm, Hm, MB), the non-empty key blocks of each query block (MB = ceil(Q_LEN /
    block_m)). ``index``: int32 (Bm, Hm, MB, NB) (NB = ceil(KV_LEN / block_n)), those key blocks in
    ascending order as ``(kv_block << 1) | partial``, then -1 up to NB. Both contiguous, on the mask's
    device; Bm and Hm are 1 where the mask does not depend on the batch or head (read with stride 0).
    ``pairs``: the visible (query, key) pairs over the mask's B x H (None counting as 1), for FLOP counts.
    (``BlockMask.for_key_tile``: the same with the roles of query and key blocks swapped.)
    """
    block_m: int
    block_n: int
    counts: torch.Tensor
    index: torch.Tensor
    pairs: int

    @property
    def Bm(self) -> int:
        return self.counts.shape[0]

    @property
    def Hm(self) -> int:
        return self.counts.shape[1]


def _positive_int(name: str, value, limit: int = INT32_MAX) -> int:
    if type(value) is not int:
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not 1 <= value <= limit:
        raise ValueError(f"{name} must be in [1, {limit}], got {value!r}")
    return value


def _check_tile(block_m: int, block_n: int, q_len: int, kv_len: int, bm: int, hm: int):
    """UnsupportedError when the tile's tables or key block entries overflow the kernels' int32."""
    mb, nb = -(-q_len // block_m), -(-kv_len // block_n)
    if 2 * nb + 1 > INT32_MAX or mb * nb > INT32_MAX:
        raise UnsupportedError(f"a block mask of {mb} x {nb} blocks (tile {block_m} x {block_n}) passes the "
                               f"int32 limit ({INT32_MAX}) of the blocks per (batch, head) or of the "
                               f"(kv_block << 1) | partial entries")
    if bm * hm * mb * nb > INT32_MAX:
        raise UnsupportedError(f"a block index of {bm} x {hm} x {mb} x {nb} entries passes the int32 limit "
                               f"({INT32_MAX}) of the kernels' table indexing")


def _block_visible(chunk: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """Visible pairs per (block_m x block_n) block of a (Bm, Hm, rows, cols) bool chunk, int32; the chunk
    is padded with masked-out pairs to whole blocks (the caller knows each block's in-range pairs)."""
    b, h, r, c = chunk.shape
    mb, nb = -(-r // block_m), -(-c // block_n)
    if (mb * block_m, nb * block_n) != (r, c):
        padded = chunk.new_zeros(b, h, mb * block_m, nb * block_n)
        padded[..., :r, :c] = chunk
        chunk = padded
    return chunk.reshape(b, h, mb, block_m, nb, block_n).sum(dim=(3, 5), dtype=torch.int32)


class BlockMask:
    """An attention mask given by ``mask_mod`` over (B, H, Q_LEN, KV_LEN), reduced to key blocks per
    kernel tile on request. Built by ``create_block_mask``; immutable, and safe to share across calls,
    layers and threads (the per-tile cache is filled under a lock)."""

    def __init__(self, mask_mod, B, H, q_len: int, kv_len: int, device: torch.device, block_size, bm: int,
                 hm: int, chunk_elements: int):
        self._mod, self._b, self._h = mask_mod, B, H
        self._q, self._k, self._device, self._block = q_len, kv_len, device, block_size
        self._bm, self._hm, self._chunk = bm, hm, chunk_elements
        self._cache_dense = bm * hm * q_len * kv_len <= DENSE_CACHE_BYTES
        self._dense = None
        self._rows = None  # (row_bounds's answer,) once computed
        self._tiles = {}
        self._lock = threading.RLock()

    shape = property(lambda self: (self._b or 1, self._h or 1, self._q, self._k),
                     doc="(B, H, Q_LEN, KV_LEN), a broadcast (None) B or H given as 1.")
    mask_mod = property(lambda self: self._mod, doc="The function the mask was built from.")
    device = property(lambda self: self._device, doc="Where the mask is evaluated and its tables live.")
    BLOCK_SIZE = property(lambda self: self._block, doc="(query, key) block of ``sparsity`` and the repr.")
    Bm = property(lambda self: self._bm, doc="The stored batch size: B, or 1 when the mask ignores b.")
    Hm = property(lambda self: self._hm, doc="The stored head count: H, or 1 when the mask ignores h.")

    def _evaluate(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """mask_mod on queries [r0, r1) and keys [c0, c1), as a bool (Bm, Hm, rows, cols) view."""
        target = (self._bm, self._hm, r1 - r0, c1 - c0)
        return _call(self._mod, self._b, self._h, r0, r1, c0, c1, self._device, target).expand(target)

    def _chunks(self, block_m: int, block_n: int, dense=None):
        """(r0, c0, bool chunk) covering the mask in chunks of whole (block_m x block_n) blocks of at most
        chunk_elements each (or of one block when a block alone has more): slices of ``dense`` when
        given, else evaluations of mask_mod."""
        per_pair = self._bm * self._hm  # elements per (query, key) pair
        cols = self._k if per_pair * block_m * self._k <= self._chunk else \
            max(block_n, self._chunk // (per_pair * block_m) // block_n * block_n)
        rows = max(block_m, self._chunk // (per_pair * cols) // block_m * block_m)
        for r0 in range(0, self._q, rows):
            r1 = min(self._q, r0 + rows)
            for c0 in range(0, self._k, cols):
                c1 = min(self._k, c0 + cols)
                yield r0, c0, (dense[..., r0:r1, c0:c1] if dense is not None else self._evaluate(r0, r1, c0, c1))

    def _evaluate_dense(self) -> torch.Tensor:
        """The element mask from mask_mod, chunk by chunk."""
        out = torch.empty(self._bm, self._hm, self._q, self._k, dtype=torch.bool, device=self._device)
        for r0, c0, chunk in self._chunks(1, 1):
            out[..., r0:r0 + chunk.shape[2], c0:c0 + chunk.shape[3]] = chunk
        return out

    def _dense_cached(self):
        """The element mask when it is small enough to keep (evaluated on first use), else None."""
        with self._lock:
            if self._dense is None and self._cache_dense:
                self._dense = self._evaluate_dense()
            return self._dense

    def to_dense(self) -> torch.Tensor:
        """The element mask, bool (Bm, Hm, Q_LEN, KV_LEN), a new tensor (meant for tests: small sizes)."""
        dense = self._dense_cached()
        return dense.clone() if dense is not None else self._evaluate_dense()

    def for_tile(self, block_m: int, block_n: int) -> TileBlocks:
        """The mask at a kernel tile of ``block_m`` queries by ``block_n`` keys (computed once per tile).

        A block is empty when no in-range pair is visible, full when every in-range pair is, partial
        otherwise; rows past Q_LEN and keys past KV_LEN count as neither (the kernel masks the keys
        itself and writes no such rows). UnsupportedError when the tables pass int32 indexing."""
        return self._tile(block_m, block_n, False)

    def for_key_tile(self, block_m: int, block_n: int) -> TileBlocks:
        """The same blocks listed the other way, for the key-outer backward (``bwd_sm90``, ``bwd_dkdv``): per key block of
        ``block_n`` keys, the query blocks of ``block_m`` rows that see some of its keys. ``counts`` is
        (Bm, Hm, NB) and ``index`` (Bm, Hm, NB, MB), entries ``(q_block << 1) | partial``."""
        return self._tile(block_m, block_n, True)

    def _tile(self, block_m: int, block_n: int, by_key: bool) -> TileBlocks:
        block_m, block_n = _positive_int("block_m", block_m), _positive_int("block_n", block_n)
        _check_tile(block_m, block_n, self._q, self._k, self._bm, self._hm)
        with self._lock:
            tile = self._tiles.get((block_m, block_n, by_key))
            if tile is None:
                tile = self._tiles[(block_m, block_n, by_key)] = self._reduce(block_m, block_n, by_key)
            return tile

    def _reduce(self, block_m: int, block_n: int, by_key: bool) -> TileBlocks:
        """The tile's tables from its blocks' visible pair counts against their in-range pair counts."""
        mb, nb = -(-self._q // block_m), -(-self._k // block_n)
        visible = torch.empty(self._bm, self._hm, mb, nb, dtype=torch.int32, device=self._device)
        for r0, c0, chunk in self._chunks(block_m, block_n, self._dense_cached()):
            part = _block_visible(chunk, block_m, block_n)
            i, j = r0 // block_m, c0 // block_n
            visible[:, :, i:i + part.shape[2], j:j + part.shape[3]] = part
        dev = self._device
        rows = (self._q - torch.arange(mb, device=dev) * block_m).clamp(max=block_m)
        cols = (self._k - torch.arange(nb, device=dev) * block_n).clamp(max=block_n)
        in_range = (rows[:, None] * cols[None, :]).to(torch.int32)
        nonempty, partial = visible > 0, visible < in_range
        if by_key:  # lists along the query blocks
            nonempty, partial = nonempty.transpose(-1, -2), partial.transpose(-1, -2)
        listed = nonempty.shape[-1]
        entries = (torch.arange(listed, dtype=torch.int32, device=dev) << 1) | partial.to(torch.int32)
        # Entries grow with the block, so sorting puts the non-empty ones first, ascending.
        entries = torch.where(nonempty, entries, torch.full_like(entries, INT32_MAX)).sort(dim=-1).values
        index = torch.where(entries == INT32_MAX, torch.full_like(entries, -1), entries).contiguous()
        counts = nonempty.sum(dim=-1, dtype=torch.int32).contiguous()
        b, h = self.shape[:2]
        pairs = int(visible.sum(dtype=torch.int64).item()) * (b // self._bm) * (h // self._hm)
        return TileBlocks(block_m, block_n, counts, index, pairs)

    def row_bounds(self) -> torch.Tensor | None:
        """Each query row's visible keys as one run, where every row's are: int32 (Bm, Hm, Q_LEN, 2), row q's
        first and last visible key (lo, hi), lo > hi for a row that sees none; None where some row sees
        two runs (a random block-sparse mask). Computed once, from the mask at its creation, as the block
        lists are: a kernel with ``KernelSpec.row_bounds`` masks its partial blocks by these two numbers
        per row instead of calling mask_mod per score (a document mask's captured reads)."""
        with self._lock:
            if self._rows is None:
                self._rows = (self._row_runs(),)
            return self._rows[0]

    def _row_runs(self) -> torch.Tensor | None:
        shape = (self._bm, self._hm, self._q)
        lo = torch.full(shape, self._k, dtype=torch.int64, device=self._device)
        hi = torch.full(shape, -1, dtype=torch.int64, device=self._device)
        seen = torch.zeros(shape, dtype=torch.int64, device=self._device)
        for r0, c0, chunk in self._chunks(1, 1, self._dense_cached()):
            rows, cols = slice(r0, r0 + chunk.shape[2]), chunk.shape[3]
            hits = chunk.contiguous().view(torch.uint8)
            any_ = hits.amax(dim=-1).bool()
            first = torch.where(any_, hits.argmax(dim=-1) + c0, self._k)
            last = torch.where(any_, c0 + cols - 1 - hits.flip(-1).argmax(dim=-1), -1)
            lo[..., rows] = torch.minimum(lo[..., rows], first)
            hi[..., rows] = torch.maximum(hi[..., rows], last)
            seen[..., rows] += hits.sum(dim=-1, dtype=torch.int64)
        if not bool(((seen == 0) | (seen == hi - lo + 1)).all()):
            return None
        return torch.stack((lo, hi), dim=-1).to(torch.int32).contiguous()

    def sparsity(self) -> float:
        """The fraction of (query block, key block) pairs skipped at BLOCK_SIZE, in [0, 1]."""
        tile = self.for_tile(*self._block)
        return 1.0 - int(tile.counts.sum(dtype=torch.int64).item()) / tile.index.numel()

    def __repr__(self) -> str:
        b, h, q, k = self.shape
        return (f"BlockMask(shape=({b}, {h}, {q}, {k}), stored=({self._bm}, {self._hm}), "
                f"BLOCK_SIZE={self._block}, sparsity={self.sparsity():.2%}, device={self._device}, "
                f"mask_mod={getattr(self._mod, '__name__', type(self._mod).__name__)})")


def _call(mask_mod, B, H, r0: int, r1: int, c0: int, c1: int, dev: torch.device, target: tuple):
    """mask_mod's result on queries [r0, r1) and keys [c0, c1), checked to broadcast to ``target``."""
    idx = (torch.arange(B or 1, device=dev).view(-1, 1, 1, 1), torch.arange(H or 1, device=dev).view(1, -1, 1, 1),
           torch.arange(r0, r1, device=dev).view(1, 1, -1, 1), torch.arange(c0, c1, device=dev).view(1, 1, 1, -1))
    with torch.no_grad():
        out = mask_mod(*idx)
    _check_result(out, target, dev)
    return out


def _check_result(out, target: tuple, device: torch.device):
    """TypeError unless ``out`` is a bool tensor on ``device`` that broadcasts to ``target``."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"mask_mod must return a bool tensor, it returned {type(out).__name__} {out!r:.80}")
    what = f"a {out.dtype} tensor of shape {tuple(out.shape)} on {out.device}"
    if out.dtype != torch.bool:
        raise TypeError(f"mask_mod must return a bool tensor, it returned {what}")
    if out.device.type != device.type:
        raise TypeError(f"mask_mod must return a tensor on {device}, it returned {what}")
    # (by hand: torch.broadcast_shapes imports sympy on its first call, 2.3 s of a new process's first
    # mods call on the H200 host)
    ok = out.dim() <= 4 and all(n in (1, t) for n, t in zip(reversed(out.shape), reversed(target)))
    if not ok:
        raise TypeError(f"mask_mod must return a bool tensor broadcastable to (B, H, q, kv) = {target}, "
                        f"it returned {what}")


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cuda", BLOCK_SIZE=128, *,
                      chunk_elements: int | None = None) -> BlockMask:
    """A ``BlockMask`` of ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True: visible) over
    (B, H, Q_LEN, KV_LEN) (FlexAttention's call).

    ``mask_mod`` gets int64 index tensors of shapes (B, 1, 1, 1), (1, H, 1, 1), (1, 1, q, 1), (1, 1, 1, kv)
    on ``device`` (q and kv a chunk of the rows and keys) and must return a bool tensor that broadcasts
    to their shape; it may index captured tensors (``doc[q_idx] == doc[kv_idx]``). B or H None: the mask
    is the same for every batch or head (evaluated with size 1). Where the result does not depend on b
    or h, the mask is stored with size 1 there. ``device``: a CUDA device, or the CPU (tests, shapes).
    ``BLOCK_SIZE``: an int or (query, key) ints, the block of ``sparsity()``; the mask is reduced at it
    here, so errors of mask_mod surface now. ``chunk_elements``: the most elements per evaluation
    (default CHUNK_ELEMENTS)."""
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable, got {mask_mod!r}")
    for name, value in (("B", B), ("H", H)):
        if value is not None:
            _positive_int(name, value)
    q_len, kv_len = _positive_int("Q_LEN", Q_LEN, INT32_MAX), _positive_int("KV_LEN", KV_LEN, INT32_MAX)
    if isinstance(BLOCK_SIZE, (tuple, list)) and len(BLOCK_SIZE) == 2:
        block = (_positive_int("BLOCK_SIZE[0]", BLOCK_SIZE[0]), _positive_int("BLOCK_SIZE[1]", BLOCK_SIZE[1]))
    elif type(BLOCK_SIZE) is int:
        block = (_positive_int("BLOCK_SIZE", BLOCK_SIZE),) * 2
    else:
        raise ValueError(f"BLOCK_SIZE must be a positive int or (int, int), got {BLOCK_SIZE!r}")
    chunk = CHUNK_ELEMENTS if chunk_elements is None else _positive_int("chunk_elements", chunk_elements)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be a CUDA device or the CPU, got {device!r}") from e
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be a CUDA device or the CPU, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device is {device!r} but CUDA is not available")
    # Query 0 and key 0 tell whether the result depends on b and h: its broadcast size there.
    probe = _call(mask_mod, B, H, 0, 1, 0, 1, dev, (B or 1, H or 1, 1, 1))
    sizes = (1,) * (4 - probe.dim()) + tuple(probe.shape)
    mask = BlockMask(mask_mod, B, H, q_len, kv_len, dev, block, sizes[0], sizes[1], chunk)
    mask.for_tile(*block)
    return mask


def block_mask_from_dense(mask: torch.Tensor, BLOCK_SIZE=128) -> BlockMask:
    """A ``BlockMask`` of an element mask: bool (Q_LEN, KV_LEN) or (B or 1, H or 1, Q_LEN, KV_LEN), a size
    1 batch or head meaning the same for all; on the mask's device."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() not in (2, 4):
        raise TypeError(f"mask must be a bool tensor of 2 or 4 dims, got {mask!r:.80}")
    full = mask.view(1, 1, *mask.shape) if mask.dim() == 2 else mask
    b, h, q, k = full.shape

    def dense_mod(b_idx, h_idx, q_idx, kv_idx):
        return full[b_idx, h_idx, q_idx, kv_idx]

    return create_block_mask(dense_mod, b if b > 1 else None, h if h > 1 else None, q, k, mask.device, BLOCK_SIZE)
