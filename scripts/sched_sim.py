"""How evenly a tile order spreads causal fwd_sm90 work over the SMs: a greedy list-scheduling model.

    python3 scripts/sched_sim.py

Each tile costs c0 + (its K/V blocks x block_n / 128), in units of one 128 x 128 block; the hardware (or
the persistent kernel's atomic counter) gives the next tile in order to the first free SM; a static walk
gives tile t to CTA t mod SMs. Printed: the makespan over the ideal (total work / SMs) for the old order
(one (batch, head) pair's m-blocks after another, longest first), L2 sections
(flashgen.families.fwd_sm90.tile_sections, half of a 60 MB L2 for causal tiles) handed out greedily, and
the same sections walked statically. The model knows nothing of memory: it predicts the balance, not the
speed (docs/perf/forward-hopper.md, "Tile order and L2 sections").
"""
from __future__ import annotations

import heapq
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from flashgen.families.fwd_sm90 import tile_sections  # noqa: E402


def greedy(costs, sms):
    free = [0.0] * sms
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def static(costs, sms):
    load = [0.0] * sms
    for t, c in enumerate(costs):
        load[t % sms] += c
    return max(load)


def section_order(pairs, m_blocks, sec, sec_big):
    """m-block of each tile in the kernel's order (tile_coords in fwd_sm90.cuh; causal: longest first)."""
    sizes = [sec + 1] * sec_big + [sec] * ((pairs - sec_big * (sec + 1)) // sec)
    out = []
    for size in sizes:
        for mb in reversed(range(m_blocks)):
            out += [mb] * size
    return out


def main():
    sms, c0, l2 = 132, 1.5, 60 << 20
    print(f"{'d':>4} {'tile':>8} {'N':>6} | {'old':>6} {'sections':>8} {'static':>7}   (makespan / ideal)")
    for d, bm, bn in ((64, 192, 128), (128, 128, 128), (128, 192, 80)):
        for n in (2048, 4096, 8192, 16384):
            pairs, m_blocks = (2048 // d) * (16384 // n), math.ceil(n / bm)

            def cost(mb):
                return c0 + min(math.ceil(n / bn), math.ceil((mb + 1) * bm / bn)) * bn / 128

            old = [cost(mb) for _ in range(pairs) for mb in reversed(range(m_blocks))]
            ideal = sum(old) / sms
            sec = tile_sections(pairs, 2 * n * d * 2, l2, causal=True)
            new = [cost(mb) for mb in section_order(pairs, m_blocks, *sec)]
            print(f"{d:4d} {bm:>4}x{bn:<3} {n:6d} | {greedy(old, sms) / ideal:6.3f} {greedy(new, sms) / ideal:8.3f} "
                  f"{static(new, sms) / ideal:7.3f}")


if __name__ == "__main__":
    main()
