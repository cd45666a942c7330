"""A cost model for ranking specs without a GPU (``flashgen tune --model``).

The estimate is built from what the spec and the ptxas report say, nothing fitted:

- **work per CTA**: the K/V blocks a query block visits (all of them, or, causal,
  those at or below the diagonal), each 4·B_r·B_c·d tensor FLOPs plus B_r·B_c
  exponentials and a few FP32 operations per score for the online softmax;
- **residency**: CTAs per SM from registers (ptxas report), shared memory and
  threads; the CTAs on one SM share its tensor and SFU throughput, and the
  per-iteration latency (barrier, copy wait) is hidden by the other resident
  CTAs and by deeper pipelines;
- **waves**: CTAs are placed in launch order (the causal kernel launches the
  longest query blocks first) onto the earliest free slot of SMs × residency,
  so causal imbalance and partial last waves count;
- **HBM bytes** as in the FlashAttention I/O analysis: Q read and O written
  once, K and V read once per query block (causal: the visible part), as a
  floor the compute time cannot go under.

mma.sync reaches only part of the tensor peak on Hopper (wgmma is the full rate),
so the tensor rate is scaled per arch, and for the wgmma family (fwd_sm90) by
FlashAttention-3's published fraction.
"""
from __future__ import annotations

import heapq
import math

from .. import iomodel
from ..iomodel import flops  # noqa: F401  (re-exported: the convention's FLOPs)
from ..spec import DTYPE_BYTES

# Fraction of the datasheet tensor rate mma.sync m16n8k16 sustains, per arch
# (Hopper's datasheet rate is wgmma's; FA2 measures ~45 % of it on an H100/H200).
MMA_FRACTION = {"sm_80": 0.75, "sm_86": 0.7, "sm_89": 0.7, "sm_90a": 0.5}
# Families that issue wgmma instead (sm_90a): the fraction of the datasheet rate FlashAttention-3
# reports with warp specialization (661 of 989 TFLOP/s at d = 128; arXiv 2407.08608), not fitted.
FAMILY_TENSOR_FRACTION = {"fwd_sm90": 0.67}
SFU_PER_CLK_PER_SM = 16        # MUFU.EX2 per clock per SM
FP32_PER_CLK_PER_SM = 128
SOFTMAX_FP32_OPS = 6           # scale/subtract, max, sum, convert ... per score
ITER_LATENCY_CLK = 900         # one K/V step's exposed latency (wait + barrier) with nothing to hide it
LAUNCH_S = 4e-6
CLOCK_HZ = {"sm_80": 1.41e9, "sm_86": 1.7e9, "sm_89": 2.5e9, "sm_90a": 1.98e9}


def residency(spec, registers: int, profile) -> int:
    """CTAs of ``spec`` one SM holds at once (registers, shared memory, threads)."""
    threads = spec.warps * 32
    regs = max(1, registers) * threads
    by_regs = profile.regs_per_sm // regs
    by_smem = profile.smem_per_sm // max(1, spec.smem_bytes() + 1024)
    by_threads = 2048 // threads
    return max(0, min(by_regs, by_smem, by_threads, 32))


def hbm_bytes(spec, b: int, h: int, nq: int, nk: int, d: int) -> float:
    """Bytes a fwd_v2 launch moves (the I/O analysis in ``flashgen.iomodel``, with the spec's tiles)."""
    return iomodel.hbm_bytes("v2", b, h, nq, nk, d, spec.causal, spec.block_m, spec.block_n, DTYPE_BYTES[spec.dtype])


def estimate(spec, shape, profile, registers: int) -> float:
    """Modelled seconds for one launch of ``spec`` on ``shape`` = (batch, heads, seqlen, d)."""
    b, h, n, d_in = shape
    res = residency(spec, registers, profile)
    if res == 0:
        return math.inf
    d = spec.head_dim
    clock = CLOCK_HZ.get(spec.arch, 1.5e9)
    fraction = FAMILY_TENSOR_FRACTION.get(spec.kind) or MMA_FRACTION.get(spec.arch, 0.6)
    tensor_per_clk = profile.peak_flops / profile.sms / clock * fraction
    # One K/V step of one CTA, in SM clocks if it had the SM alone.
    step_tensor = 4.0 * spec.block_m * spec.block_n * d / tensor_per_clk
    scores = spec.block_m * spec.block_n
    step_alu = scores / SFU_PER_CLK_PER_SM + scores * SOFTMAX_FP32_OPS / FP32_PER_CLK_PER_SM
    # A warp's tensor and SFU work overlap only across warps: with few warps per SM they add up.
    warps_per_sm = res * spec.warps
    overlap = min(1.0, warps_per_sm / 16)
    busy = max(step_tensor, step_alu) + (1 - overlap) * min(step_tensor, step_alu)
    # Exposed latency per step, hidden by other resident CTAs and by the pipeline depth.
    exposed = ITER_LATENCY_CLK / (res * (spec.stages - 1))
    epilogue = 2.0 * spec.block_m * d * DTYPE_BYTES[spec.dtype] / 64 + ITER_LATENCY_CLK  # O staging + stores

    m_blocks = math.ceil(n / spec.block_m)
    per_head = iomodel.visible_blocks(n, n, spec.causal, spec.block_m, spec.block_n)
    if spec.causal:
        per_head = per_head[::-1]  # launch order: the kernel runs the longest query blocks first
    # Each resident CTA gets 1/res of the SM's throughput while the SM is full; the
    # slot model below gives each of the SMs·res slots that share of the rate.
    cost = [(steps * (busy * res + exposed) + epilogue) for steps in per_head]
    slots = profile.sms * res
    total_ctas = m_blocks * b * h
    if total_ctas <= slots:  # one partial wave: the SMs are not full, each CTA runs at a larger share
        active = max(1, math.ceil(total_ctas / profile.sms))
        cost = [(steps * (busy * active + exposed) + epilogue) for steps in per_head]
        makespan = max(cost)
    else:
        free = [0.0] * slots
        heapq.heapify(free)
        for _ in range(b * h):
            for c in cost:
                t = heapq.heappop(free)
                heapq.heappush(free, t + c)
        makespan = max(free)
    compute_s = makespan / clock
    memory_s = hbm_bytes(spec, b, h, n, n, d) / profile.bandwidth
    return max(compute_s, memory_s) + LAUNCH_S
