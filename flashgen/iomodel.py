"""The I/O model of attention: FLOPs, HBM bytes and arithmetic intensity.

Pure Python, no GPU. Counts what flashgen's kernels request from global
memory with their tile sizes (every tile load and store, assuming no L2
reuse between CTAs), so that a measured time can be set against it:

- ``standard``: three passes. S = scale QK^T is written (tiles above the
  causal diagonal are skipped), the row softmax reads S once (the visible part
  of each row) and writes P in place over S (the whole padded row: masked
  entries become 0), the LSE per row, then O = PV reads P and V tiles.
- ``v1``: FlashAttention V1's loop order. A CTA per K/V block loads K_j, V_j
  once and walks the Q blocks; for each Q block it reads Q_i and, after the
  first K/V block, the partial O_i (fp32), m_i and l_i, and writes them back
  unless it is the last K/V block of that Q block, which writes the final O and
  LSE instead.
- ``v2``: FlashAttention V2's loop order. A CTA per Q block reads Q_i once,
  streams the K/V blocks it can see and writes O_i and the LSE once.

Sizes: ``b`` batch, ``h`` query heads (K/V are counted per query head: each
CTA loads them, GQA sharing is left to L2), ``nq``/``nk`` sequence lengths,
``d`` head dim, ``elem_bytes`` of q/k/v/o/S/P, 4 bytes for fp32 partials and
statistics. Causal masking is bottom-right aligned (query i sees keys
j <= i + nk - nq), as in ``flashgen.attention``.
"""
from __future__ import annotations

ALGORITHMS = ("standard", "v1", "v2")
ACC_BYTES = 4  # fp32: V1's partial O, m, l and every LSE


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_sizes(**sizes) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def flops(b: int, h: int, nq: int, nk: int, d: int, causal: bool = False) -> float:
    """Matmul FLOPs of the forward pass: 4·b·h·nq·nk·d (QK^T and PV), halved when causal.

    The halving is the convention of the FlashAttention papers' benchmarks
    (exact for nq = nk in the limit of long sequences).
    """
    f = 4.0 * b * h * nq * nk * d
    return f / 2 if causal else f


def intensity_qk(n: int, d: int, elem_bytes: int = 2, nk: int | None = None) -> float:
    """Arithmetic intensity of S = QK^T in standard attention, FLOPs per byte.

    FLOPs 2·n·nk·d over the bytes of reading Q (n×d) and K (nk×d) and writing
    S (n×nk), all in ``elem_bytes``: 2·N²d / (2·(2Nd + N²)) for fp16 and
    nq = nk = N. This reproduces the published FlashAttention table (A100:
    43, 60, 62 at d=64, N=256/2048/4096; 114, 120 at d=128; 205, 228 at d=256).
    """
    nk = n if nk is None else nk
    _check_sizes(n=n, d=d, nk=nk, elem_bytes=elem_bytes)
    moved = elem_bytes * (n * d + nk * d + n * nk)
    return 2.0 * n * nk * d / moved if moved else 0.0


def ridge_point(profile) -> float:
    """Peak FLOP/s over bandwidth (bytes/s) of a GPU profile: the intensity above which a kernel can be
    compute-bound."""
    return profile.peak_flops / profile.bandwidth


def paper_block_sizes(smem_bytes: int, d: int, elem_bytes: int = 2) -> tuple[int, int]:
    """(B_r, B_c) of FlashAttention's Algorithm 1: B_c = ceil(M / 4d), B_r = min(B_c, d).

    M is the on-chip memory counted in elements (``smem_bytes / elem_bytes``):
    the rule fits the Q, K, V and O blocks of B x d elements in it.
    """
    _check_sizes(smem_bytes=smem_bytes, d=d, elem_bytes=elem_bytes)
    if d == 0 or elem_bytes == 0:
        raise ValueError("d and elem_bytes must be positive")
    m = smem_bytes // elem_bytes
    bc = _ceil_div(m, 4 * d)
    return min(bc, d), bc


def visible_blocks(nq: int, nk: int, causal: bool, block_m: int, block_n: int) -> list[int]:
    """For each query block, how many key blocks hold at least one key some row of it sees."""
    nkb = _ceil_div(nk, block_n)
    out = []
    for i in range(_ceil_div(nq, block_m)):
        if causal:
            limit = i * block_m + block_m + nk - nq  # keys below this are seen by some row of the block
            out.append(0 if limit <= 0 else min(nkb, _ceil_div(limit, block_n)))
        else:
            out.append(nkb)
    return out


def _rows(i: int, n: int, block: int) -> int:
    return max(0, min(block, n - i * block))


def _key_cols(count: int, nk: int, block_n: int) -> int:
    """Keys in the first ``count`` key blocks."""
    return min(nk, count * block_n)


def hbm_traffic(algorithm: str, b: int, h: int, nq: int, nk: int, d: int, causal: bool, block_m: int,
                block_n: int, elem_bytes: int = 2) -> dict:
    """Bytes read and written by each part of ``algorithm`` (a dict; ``hbm_bytes`` is its total).

    ``block_m``/``block_n`` are the query and key tile sizes (for ``standard``,
    those of its QK^T and PV passes; for ``v1``, B_r and B_c).
    Raises ``ValueError`` for an unknown algorithm or bad sizes.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    _check_sizes(b=b, h=h, nq=nq, nk=nk, d=d, block_m=block_m, block_n=block_n, elem_bytes=elem_bytes)
    if not block_m or not block_n:
        raise ValueError("block_m and block_n must be positive")
    e, a = elem_bytes, ACC_BYTES
    vis = visible_blocks(nq, nk, causal, block_m, block_n)
    t: dict[str, int] = {}
    if algorithm == "standard":
        ld = _ceil_div(nk, 8) * 8  # S/P rows are padded to 16 bytes
        # pass 1: per visible (i, j) tile, read Q_i and K_j, write S_ij
        t["qk_read_q"] = sum(v * _rows(i, nq, block_m) * d * e for i, v in enumerate(vis))
        t["qk_read_k"] = sum(_key_cols(v, nk, block_n) * d * e for v in vis)
        t["qk_write_s"] = sum(_rows(i, nq, block_m) * min(ld, v * block_n) * e for i, v in enumerate(vis))
        # pass 2: read each row's visible keys, write the padded row of P and the LSE
        if causal:
            seen = sum(min(nk, max(0, i + nk - nq + 1)) for i in range(nq))
        else:
            seen = nq * nk
        t["softmax_read_s"] = seen * e
        t["softmax_write_p"] = nq * ld * e
        t["softmax_write_lse"] = nq * a
        # pass 3: per visible (i, j) tile, read P_ij and V_j; write O_i
        t["pv_read_p"] = t["qk_write_s"]
        t["pv_read_v"] = t["qk_read_k"]
        t["pv_write_o"] = nq * d * e
    elif algorithm == "v1":
        t["read_kv"] = 2 * nk * d * e
        q = acc_in = acc_out = final = 0
        for i, v in enumerate(vis):
            rows = _rows(i, nq, block_m)
            visits = max(v, 1)  # K/V block 0 visits every Q block, even a fully masked one
            q += visits * rows * d * e
            acc_in += (visits - 1) * rows * (d * a + 2 * a)   # partial O, m, l read back
            acc_out += (visits - 1) * rows * (d * a + 2 * a)  # and written by all but the last visit
            final += rows * (d * e + a)
        t["read_q"] = q
        t["read_partial_o_m_l"] = acc_in
        t["write_partial_o_m_l"] = acc_out
        t["write_o_lse"] = final
    else:  # v2
        t["read_q"] = nq * d * e
        t["read_kv"] = sum(2 * _key_cols(v, nk, block_n) * d * e for v in vis)
        t["write_o_lse"] = nq * (d * e + a)
    return {k: v * b * h for k, v in t.items()}


def hbm_bytes(algorithm: str, b: int, h: int, nq: int, nk: int, d: int, causal: bool, block_m: int,
              block_n: int, elem_bytes: int = 2) -> int:
    """Total bytes ``algorithm`` moves between HBM and the chip with these tiles (see ``hbm_traffic``)."""
    return sum(hbm_traffic(algorithm, b, h, nq, nk, d, causal, block_m, block_n, elem_bytes).values())


def roofline_time(flop: float, nbytes: float, profile) -> float:
    """Lower bound on the time, seconds: the larger of compute time at peak and transfer time at full
    bandwidth."""
    return max(flop / profile.peak_flops, nbytes / profile.bandwidth)


def hidden2048(n: int, d: int) -> tuple[int, int]:
    """(batch, heads) of the FlashAttention benchmark convention: hidden 2048, 16k tokens per batch."""
    if d <= 0 or n <= 0:
        raise ValueError(f"seqlen and head dim must be positive, got {n}, {d}")
    return max(1, 16384 // n), max(1, 2048 // d)


__all__ = ["ALGORITHMS", "flops", "intensity_qk", "ridge_point", "paper_block_sizes", "hbm_traffic", "hbm_bytes",
           "roofline_time", "hidden2048", "visible_blocks"]
