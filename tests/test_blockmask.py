"""flashgen.api.blockmask on the CPU: block tables at the kernels' tiles against a brute-force reduction of
the element mask, odd sizes and edge blocks, b/h broadcasting, chunked evaluation, pair counts, the per-tile
cache and the input checks."""
from __future__ import annotations

import math
import threading

import pytest
import torch

from flashgen.api import blockmask
from flashgen.api.blockmask import BlockMask, TileBlocks, block_mask_from_dense, create_block_mask
from flashgen.errors import UnsupportedError

B, H = 2, 3
SIZES = [(113, 203), (1, 239), (239, 1), (799, 3), (1023, 1023)]
TILES = [(64, 80), (128, 128), (192, 176)]


def causal(b, h, q, kv):
    return q >= kv


def sliding_window(b, h, q, kv):
    return (q >= kv) & (q - kv <= 100)


def prefix_lm(b, h, q, kv):
    return (kv < 40) | (q >= kv)


def document_mod(q_len, kv_len):
    """Per-batch documents of random lengths (a mask that depends on b)."""
    gen = torch.Generator().manual_seed(q_len * 7919 + kv_len)
    doc = torch.randint(0, 4, (B, max(q_len, kv_len)), generator=gen).sort(dim=-1).values

    def document(b, h, q, kv):
        return doc[b, q] == doc[b, kv]
    return document


def block_sparse_mod(q_len, kv_len, size=48):
    """A random pattern of size x size blocks per head (a mask that depends on h)."""
    gen = torch.Generator().manual_seed(q_len * 31 + kv_len)
    blocks = torch.rand(H, math.ceil(q_len / size), math.ceil(kv_len / size), generator=gen) < 0.4

    def block_sparse(b, h, q, kv):
        return blocks[h, q // size, kv // size]
    return block_sparse


MODS = {"causal": lambda q, k: causal, "window": lambda q, k: sliding_window, "prefix": lambda q, k: prefix_lm,
        "document": document_mod, "block_sparse": block_sparse_mod}


def dense_of(mod, q_len, kv_len, b=B, h=H):
    """The element mask by one broadcast evaluation, (b or 1, h or 1, Q, K) (B and H expanded)."""
    idx = (torch.arange(b).view(-1, 1, 1, 1), torch.arange(h).view(1, -1, 1, 1),
           torch.arange(q_len).view(1, 1, -1, 1), torch.arange(kv_len).view(1, 1, 1, -1))
    return mod(*idx).expand(b, h, q_len, kv_len)


def reference_tile(dense: torch.Tensor, bm: int, bn: int):
    """counts and index by looking at every block of a (Bm, Hm, Q, K) mask."""
    nb_, nh, q_len, kv_len = dense.shape
    mb, nb = math.ceil(q_len / bm), math.ceil(kv_len / bn)
    counts = torch.zeros(nb_, nh, mb, dtype=torch.int32)
    index = torch.full((nb_, nh, mb, nb), -1, dtype=torch.int32)
    for b in range(nb_):
        for h in range(nh):
            for i in range(mb):
                row = dense[b, h, i * bm:(i + 1) * bm]
                entries = [2 * j + (0 if row[:, j * bn:(j + 1) * bn].all() else 1)
                           for j in range(nb) if row[:, j * bn:(j + 1) * bn].any()]
                counts[b, h, i] = len(entries)
                index[b, h, i, :len(entries)] = torch.tensor(entries, dtype=torch.int32)
    return counts, index


def check_tile(tile: TileBlocks, dense: torch.Tensor, bm: int, bn: int):
    counts, index = reference_tile(dense, bm, bn)
    assert (tile.block_m, tile.block_n) == (bm, bn)
    assert tile.counts.dtype == tile.index.dtype == torch.int32
    assert tile.counts.is_contiguous() and tile.index.is_contiguous()
    assert torch.equal(tile.counts, counts)
    assert torch.equal(tile.index, index)


@pytest.mark.parametrize("name", list(MODS))
@pytest.mark.parametrize("q_len,kv_len", SIZES)
def test_tiles_match_a_brute_force_reduction(name, q_len, kv_len):
    mod = MODS[name](q_len, kv_len)
    mask = create_block_mask(mod, B, H, q_len, kv_len, device="cpu")
    dense = dense_of(mod, q_len, kv_len)[:mask.Bm, :mask.Hm]
    assert torch.equal(mask.to_dense(), dense)
    for bm, bn in TILES:
        tile = mask.for_tile(bm, bn)
        check_tile(tile, dense, bm, bn)
        assert tile.pairs == int(dense_of(mod, q_len, kv_len).sum())


@pytest.mark.parametrize("name", list(MODS))
@pytest.mark.parametrize("q_len,kv_len", SIZES)
def test_key_tiles_list_the_query_blocks_of_each_key_block(name, q_len, kv_len):
    """for_key_tile (the key-outer backward's lists) is the brute-force reduction of the transposed mask."""
    mod = MODS[name](q_len, kv_len)
    mask = create_block_mask(mod, B, H, q_len, kv_len, device="cpu")
    dense = dense_of(mod, q_len, kv_len)[:mask.Bm, :mask.Hm]
    for bm, bn in TILES:
        tile = mask.for_key_tile(bm, bn)
        counts, index = reference_tile(dense.transpose(-1, -2), bn, bm)
        assert (tile.block_m, tile.block_n) == (bm, bn)
        assert torch.equal(tile.counts, counts) and torch.equal(tile.index, index)
        assert tile.pairs == mask.for_tile(bm, bn).pairs
        assert mask.for_key_tile(bm, bn) is tile and mask.for_tile(bm, bn) is not tile


@pytest.mark.parametrize("name,expect", [("causal", (1, 1)), ("document", (B, 1)), ("block_sparse", (1, H))])
def test_a_mask_is_stored_with_the_batch_and_heads_it_depends_on(name, expect):
    mask = create_block_mask(MODS[name](100, 100), B, H, 100, 100, device="cpu")
    tile = mask.for_tile(64, 64)
    assert (mask.Bm, mask.Hm) == (tile.Bm, tile.Hm) == expect
    assert tile.counts.shape == (*expect, 2) and tile.index.shape == (*expect, 2, 2)
    assert mask.to_dense().shape == (*expect, 100, 100)
    assert mask.shape == (B, H, 100, 100)


def test_both_batch_and_head_dependence_and_broadcast_arguments():
    def mod(b, h, q, kv):
        return (q + b >= kv) & (kv % (h + 1) == 0)
    mask = create_block_mask(mod, B, H, 90, 70, device="cpu")
    assert (mask.Bm, mask.Hm) == (B, H)
    check_tile(mask.for_tile(64, 16), dense_of(mod, 90, 70), 64, 16)
    none = create_block_mask(mod, None, None, 90, 70, device="cpu")
    assert (none.Bm, none.Hm) == (1, 1) and none.shape == (1, 1, 90, 70)
    assert torch.equal(none.to_dense(), dense_of(mod, 90, 70, 1, 1))
    assert none.for_tile(64, 16).pairs == int(dense_of(mod, 90, 70, 1, 1).sum())
    assert mask.for_tile(64, 16).pairs == int(dense_of(mod, 90, 70).sum())


def test_pairs_count_the_requested_batch_and_heads():
    mask = create_block_mask(causal, 4, 5, 10, 10, device="cpu")
    assert (mask.Bm, mask.Hm) == (1, 1)
    assert mask.for_tile(64, 64).pairs == 4 * 5 * 55
    assert create_block_mask(causal, None, 5, 10, 10, device="cpu").for_tile(64, 64).pairs == 5 * 55


def test_edge_blocks_count_only_their_in_range_part():
    full = create_block_mask(lambda b, h, q, kv: kv >= 0, 1, 1, 113, 203, device="cpu")
    for bm, bn in TILES:
        tile = full.for_tile(bm, bn)
        nb = math.ceil(203 / bn)
        assert (tile.counts == nb).all()
        assert torch.equal(tile.index[0, 0, 0], torch.arange(nb, dtype=torch.int32) * 2)  # all full
    cut = create_block_mask(lambda b, h, q, kv: kv < 200, 1, 1, 113, 203, device="cpu").for_tile(64, 64)
    assert cut.index[0, 0, 0].tolist() == [0, 2, 4, 7]  # keys 192..202: 200..202 hidden
    square = create_block_mask(causal, 1, 1, 100, 100, device="cpu").for_tile(64, 64)
    assert square.index[0, 0].tolist() == [[1, -1], [0, 3]]


def test_an_empty_mask_visits_nothing():
    mask = create_block_mask(lambda b, h, q, kv: kv < 0, 1, 2, 70, 130, device="cpu")
    tile = mask.for_tile(64, 64)
    assert (tile.counts == 0).all() and (tile.index == -1).all() and tile.pairs == 0
    assert mask.sparsity() == 1.0


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("chunk", [100, 5000, 40000])
def test_chunked_evaluation_gives_the_same_tables(monkeypatch, cache, chunk):
    if not cache:
        monkeypatch.setattr(blockmask, "DENSE_CACHE_BYTES", 0)
    mod = document_mod(239, 203)
    seen = []

    def recorded(b, h, q, kv):
        out = mod(b, h, q, kv)
        seen.append(out.numel())  # (B, 1, q, kv): the mask depends on b only
        return out
    whole = create_block_mask(mod, B, H, 239, 203, device="cpu")
    parts = create_block_mask(recorded, B, H, 239, 203, device="cpu", BLOCK_SIZE=64, chunk_elements=chunk)
    assert len(seen) > 2
    for bm, bn in TILES:
        seen.clear()
        a, b = whole.for_tile(bm, bn), parts.for_tile(bm, bn)
        assert torch.equal(a.counts, b.counts) and torch.equal(a.index, b.index) and a.pairs == b.pairs
        # an evaluation covers at most the chunk, or one block of every stored batch and head
        assert all(n <= max(chunk, B * bm * bn) for n in seen)
        assert bool(seen) != cache  # a kept element mask is reduced without calling mask_mod
    assert torch.equal(whole.to_dense(), parts.to_dense())


def test_tiles_are_cached_and_small_masks_evaluated_once(monkeypatch):
    calls = []

    def counted(b, h, q, kv):
        calls.append(1)
        return q >= kv
    mask = create_block_mask(counted, 1, 1, 300, 300, device="cpu")
    before = len(calls)
    tile = mask.for_tile(64, 80)
    assert mask.for_tile(64, 80) is tile
    mask.for_tile(192, 176)
    assert len(calls) == before  # the element mask was kept
    monkeypatch.setattr(blockmask, "DENSE_CACHE_BYTES", 0)
    large = create_block_mask(counted, 1, 1, 300, 300, device="cpu")
    before = len(calls)
    tile = large.for_tile(64, 80)
    assert len(calls) > before and large.for_tile(64, 80) is tile


def test_concurrent_requests_share_one_tile():
    mask = create_block_mask(sliding_window, 1, 1, 500, 500, device="cpu")
    out = []
    threads = [threading.Thread(target=lambda: out.append(mask.for_tile(128, 96))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 8 and all(t is out[0] for t in out)


def test_properties_sparsity_and_repr():
    mask = create_block_mask(causal, None, 2, 256, 256, device="cpu", BLOCK_SIZE=(128, 64))
    assert mask.mask_mod is causal and mask.BLOCK_SIZE == (128, 64) and mask.device == torch.device("cpu")
    assert mask.shape == (1, 2, 256, 256)
    # query block 0 sees key blocks 0, 1 of 4, block 1 sees all 4: 6 of 8 visited
    assert mask.sparsity() == pytest.approx(0.25)
    text = repr(mask)
    assert text.startswith("BlockMask(shape=(1, 2, 256, 256)") and "causal" in text and "25.00%" in text
    assert isinstance(mask, BlockMask)


def test_block_mask_from_dense():
    gen = torch.Generator().manual_seed(3)
    dense = torch.rand(1, H, 150, 97, generator=gen) < 0.3
    mask = block_mask_from_dense(dense, BLOCK_SIZE=64)
    assert (mask.Bm, mask.Hm) == (1, H) and torch.equal(mask.to_dense(), dense)
    check_tile(mask.for_tile(128, 48), dense, 128, 48)
    flat = block_mask_from_dense(dense[0, 1])
    assert (flat.Bm, flat.Hm) == (1, 1) and torch.equal(flat.to_dense()[0, 0], dense[0, 1])
    with pytest.raises(TypeError, match="bool tensor"):
        block_mask_from_dense(dense.int())


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(mask_mod=None), TypeError, "mask_mod must be callable"),
    (dict(B=0), ValueError, "B must be"),
    (dict(B=1.5), TypeError, "B must be an int"),
    (dict(B=True), TypeError, "B must be an int"),
    (dict(H=-1), ValueError, "H must be"),
    (dict(Q_LEN=0), ValueError, "Q_LEN must be"),
    (dict(Q_LEN=2**31), ValueError, "Q_LEN must be"),
    (dict(KV_LEN="5"), TypeError, "KV_LEN must be an int"),
    (dict(BLOCK_SIZE=0), ValueError, "BLOCK_SIZE must be"),
    (dict(BLOCK_SIZE=(64,)), ValueError, "BLOCK_SIZE must be"),
    (dict(BLOCK_SIZE=(64, 0)), ValueError, r"BLOCK_SIZE\[1\] must be"),
    (dict(BLOCK_SIZE="128"), ValueError, "BLOCK_SIZE must be"),
    (dict(device="meta"), ValueError, "device must be a CUDA device or the CPU"),
    (dict(device="not a device"), ValueError, "device must be"),
    (dict(chunk_elements=0), ValueError, "chunk_elements must be"),
    (dict(mask_mod=lambda b, h, q, kv: True), TypeError, "it returned bool True"),
    (dict(mask_mod=lambda b, h, q, kv: q - kv), TypeError, "it returned a torch.int64 tensor"),
    (dict(mask_mod=lambda b, h, q, kv: torch.ones(5, 5, dtype=torch.bool)), TypeError, r"broadcastable.*\(5, 5\)"),
    (dict(mask_mod=lambda b, h, q, kv: torch.ones(1, 1, 1, 1, 1, dtype=torch.bool)), TypeError, "broadcastable"),
])
def test_bad_arguments_are_refused(kwargs, error, match):
    args = dict(mask_mod=causal, B=1, H=1, Q_LEN=64, KV_LEN=64, device="cpu")
    args.update(kwargs)
    with pytest.raises(error, match=match):
        create_block_mask(**args)


def test_cuda_device_without_cuda_is_refused():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="CUDA is not available"):
        create_block_mask(causal, 1, 1, 64, 64)


def test_bad_tiles_are_refused():
    mask = create_block_mask(causal, 1, 1, 64, 64, device="cpu")
    with pytest.raises(ValueError, match="block_m"):
        mask.for_tile(0, 64)
    with pytest.raises(TypeError, match="block_n"):
        mask.for_tile(64, 64.0)


def test_int32_limits_are_refused_before_evaluation():
    with pytest.raises(UnsupportedError, match="int32 limit .* of the blocks per"):
        create_block_mask(causal, 1, 1, 2**31 - 1, 2**31 - 1, device="cpu", BLOCK_SIZE=16)

    def both(b, h, q, kv):
        return (b >= 0) & (h >= 0) & (q >= kv)
    with pytest.raises(UnsupportedError, match="int32 limit"):
        create_block_mask(both, 1024, 1024, 2**16, 2**16, device="cpu", BLOCK_SIZE=64)


def reference_rows(dense: torch.Tensor):
    """Each row's (first, last) visible key by looking at it, None where some row sees two runs; rows that see
    nothing compared apart (any lo > hi is right there)."""
    nb_, nh, q_len, kv_len = dense.shape
    out = torch.zeros(nb_, nh, q_len, 2, dtype=torch.int32)
    for b in range(nb_):
        for h in range(nh):
            for i in range(q_len):
                cols = dense[b, h, i].nonzero().flatten().tolist()
                if cols and cols[-1] - cols[0] + 1 != len(cols):
                    return None
                out[b, h, i] = torch.tensor([cols[0], cols[-1]] if cols else [1, 0])
    return out


def check_rows(rows, dense):
    want = reference_rows(dense)
    if want is None:
        assert rows is None
        return
    assert rows.dtype == torch.int32 and rows.is_contiguous() and rows.shape == want.shape
    empty = ~dense.any(dim=-1)
    assert (rows[..., 0] > rows[..., 1])[empty].all()
    assert torch.equal(rows[~empty], want[~empty])


@pytest.mark.parametrize("name", list(MODS))
@pytest.mark.parametrize("q_len,kv_len", SIZES)
def test_row_bounds_match_each_rows_visible_run(name, q_len, kv_len):
    """Every mask of MODS but the block-sparse one has one run of keys per row (the document mask per batch);
    the block-sparse one has rows of two runs (None), and so does a strided mask."""
    mod = MODS[name](q_len, kv_len)
    mask = create_block_mask(mod, B, H, q_len, kv_len, device="cpu")
    rows = mask.row_bounds()
    check_rows(rows, dense_of(mod, q_len, kv_len)[:mask.Bm, :mask.Hm])
    if name != "block_sparse":
        assert rows is not None and rows.shape == (mask.Bm, mask.Hm, q_len, 2)
    assert mask.row_bounds() is rows  # computed once


def test_row_bounds_refuse_two_runs_and_keep_empty_rows():
    strided = create_block_mask(lambda b, h, q, kv: kv % 2 == 0, None, None, 20, 30, device="cpu")
    assert strided.row_bounds() is None
    late = create_block_mask(lambda b, h, q, kv: (q >= 5) & (kv <= q) & (kv >= q - 3), None, None, 12, 9,
                             device="cpu")
    rows = late.row_bounds()
    assert (rows[0, 0, :5, 0] > rows[0, 0, :5, 1]).all()  # rows 0-4 see nothing
    assert rows[0, 0, 5:].tolist() == [[2, 5], [3, 6], [4, 7], [5, 8], [6, 8], [7, 8], [8, 8]]


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("chunk", [100, 5000])
def test_row_bounds_from_chunks_match_the_whole(monkeypatch, cache, chunk):
    """Runs that cross the column chunks' edges join up (min of the firsts, max of the lasts, counts summed)."""
    if not cache:
        monkeypatch.setattr(blockmask, "DENSE_CACHE_BYTES", 0)
    mod = document_mod(239, 203)
    whole = create_block_mask(mod, B, H, 239, 203, device="cpu")
    parts = create_block_mask(mod, B, H, 239, 203, device="cpu", BLOCK_SIZE=64, chunk_elements=chunk)
    assert torch.equal(whole.row_bounds(), parts.row_bounds())
    check_rows(parts.row_bounds(), dense_of(mod, 239, 203)[:B, :1])
    two_runs = block_sparse_mod(239, 203)
    assert create_block_mask(two_runs, B, H, 239, 203, device="cpu", chunk_elements=chunk).row_bounds() is None
