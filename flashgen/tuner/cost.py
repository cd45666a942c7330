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

Backward keys (``estimate_backward``, crude): the same residency and wave model
for the tuned kernel of one backward — a dK/dV CTA per key block walking the
query blocks it sees (five GEMMs per step, four without dQ, plus the dQ
atomics), or a dQ CTA per query block walking key blocks (three GEMMs) — and
the HBM bytes of the whole backward (Q, dO, LSE and D once per key block, K, V,
dK, dV once, the row kernels' reads and writes) as the floor. The other kernels
of that backward are counted by their bytes only, so it ranks the tuned
kernel's tiles and gives the backward's time only roughly.
"""
from __future__ import annotations

import heapq
import math

from .. import families, iomodel
from ..iomodel import flops  # noqa: F401  (re-exported: the convention's FLOPs)
from ..spec import DTYPE_BYTES

# Fraction of the datasheet tensor rate mma.sync m16n8k16 sustains, per arch
# (Hopper's datasheet rate is wgmma's; FA2 measures ~45 % of it on an H100/H200).
MMA_FRACTION = {"sm_80": 0.75, "sm_86": 0.7, "sm_89": 0.7, "sm_90a": 0.5}
# Families that issue wgmma instead (sm_90a) carry their own fraction (``Family.tensor_fraction``).
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


def _makespan(per_cta, busy, exposed, epilogue, res, profile, copies):
    """SM clocks until the last of ``copies`` x ``per_cta`` CTAs (each that many steps, in launch
    order) finishes on SMs x ``res`` slots, each slot getting 1/res of an SM while the SM is full."""
    cost = [(steps * (busy * res + exposed) + epilogue) for steps in per_cta]
    slots = profile.sms * res
    if len(per_cta) * copies <= slots:  # one partial wave: the SMs are not full, each CTA runs at a larger share
        active = max(1, math.ceil(len(per_cta) * copies / profile.sms))
        return max(steps * (busy * active + exposed) + epilogue for steps in per_cta)
    free = [0.0] * slots
    heapq.heapify(free)
    for _ in range(copies):
        for c in cost:
            t = heapq.heappop(free)
            heapq.heappush(free, t + c)
    return max(free)


def _busy(spec, res, step_tensor, step_alu):
    """SM clocks one step keeps the SM busy: a warp's tensor and SFU work overlap only across
    warps, so with few warps per SM they add up."""
    overlap = min(1.0, res * spec.warps / 16)
    return max(step_tensor, step_alu) + (1 - overlap) * min(step_tensor, step_alu)


def _tensor_per_clk(spec, profile) -> float:
    clock = CLOCK_HZ.get(spec.arch, 1.5e9)
    fraction = families.family(spec.kind).tensor_fraction or MMA_FRACTION.get(spec.arch, 0.6)
    return profile.peak_flops / profile.sms / clock * fraction


def estimate(spec, shape, profile, registers: int) -> float:
    """Modelled seconds for one launch of ``spec`` on ``shape`` = (batch, heads, seqlen, d)
    (for a backward kernel: of the whole backward it is tuned in, ``estimate_backward``)."""
    if families.family(spec.kind).gemms > 2:  # a backward kernel
        return estimate_backward(spec, shape, profile, registers)
    b, h, n, d_in = shape
    res = residency(spec, registers, profile)
    if res == 0:
        return math.inf
    d = spec.head_dim
    clock = CLOCK_HZ.get(spec.arch, 1.5e9)
    # One K/V step of one CTA, in SM clocks if it had the SM alone.
    step_tensor = 4.0 * spec.block_m * spec.block_n * d / _tensor_per_clk(spec, profile)
    scores = spec.block_m * spec.block_n
    step_alu = scores / SFU_PER_CLK_PER_SM + scores * SOFTMAX_FP32_OPS / FP32_PER_CLK_PER_SM
    # The family's scheduling techniques (ping-pong, overlap, persistence: ``Family.model_techniques``).
    step_factor, tile_clk = families.family(spec.kind).model_techniques(spec)
    busy = _busy(spec, res, step_tensor, step_alu) * step_factor
    # Exposed latency per step, hidden by other resident CTAs and by the pipeline depth.
    exposed = ITER_LATENCY_CLK / (res * (spec.stages - 1))
    epilogue = 2.0 * spec.block_m * d * DTYPE_BYTES[spec.dtype] / 64 + ITER_LATENCY_CLK + tile_clk  # O staging + stores

    per_head = iomodel.visible_blocks(n, n, spec.causal, spec.block_m, spec.block_n)
    if spec.causal:
        per_head = per_head[::-1]  # launch order: the kernel runs the longest query blocks first
    compute_s = _makespan(per_head, busy, exposed, epilogue, res, profile, b * h) / clock
    memory_s = hbm_bytes(spec, b, h, n, n, d) / profile.bandwidth
    return max(compute_s, memory_s) + LAUNCH_S


# Backward: FP32 operations per score (exp of S - LSE, dS = P (dP - D), conversions) and the
# clocks per fp32 element of dQ added by red.global.add (vectorised pairs), per SM.
BWD_FP32_OPS = 8
DQ_RED_CLK_PER_ELEM = 1 / 16
BWD_ROW_LAUNCHES = 2  # preprocess and convert (or the second big kernel), each a launch


def estimate_backward(spec, shape, profile, registers: int) -> float:
    """Modelled seconds of one backward in which ``spec`` is the tuned kernel (crude: see above)."""
    b, h, n, _ = shape
    res = residency(spec, registers, profile)
    if res == 0:
        return math.inf
    d, eb = spec.head_dim, DTYPE_BYTES[spec.dtype]
    clock = CLOCK_HZ.get(spec.arch, 1.5e9)
    fam = families.family(spec.kind)
    dq_kernel = fam.query_outer
    # The CTA's own rows (outer) and the rows it walks per step (inner).
    outer, inner = (spec.block_m, spec.block_n) if dq_kernel else (spec.block_n, spec.block_m)
    gemms = fam.gemms
    step_tensor = 2.0 * gemms * outer * inner * d / _tensor_per_clk(spec, profile)
    scores = outer * inner
    step_alu = scores / SFU_PER_CLK_PER_SM + scores * BWD_FP32_OPS / FP32_PER_CLK_PER_SM
    if gemms == 5:  # dQ += dS K by atomics: inner x d fp32 elements per step
        step_alu += inner * d * DQ_RED_CLK_PER_ELEM
    busy = _busy(spec, res, step_tensor, step_alu)
    exposed = ITER_LATENCY_CLK / (res * (spec.stages - 1))
    epilogue = (1 if dq_kernel else 2) * outer * d * eb / 64 + ITER_LATENCY_CLK  # dQ, or dK and dV
    if dq_kernel:
        per_cta = iomodel.visible_blocks(n, n, spec.causal, outer, inner)[::-1 if spec.causal else 1]
    else:  # a key block is seen by the query blocks at or below it (bottom-right causal, nq = nk)
        blocks = math.ceil(n / inner)
        per_cta = [blocks - (j * outer // inner if spec.causal else 0) for j in range(math.ceil(n / outer))]
    compute_s = _makespan(per_cta, busy, exposed, epilogue, res, profile, b * h) / clock
    # Bytes: the streamed operands once per outer block (their visible part), the resident ones,
    # the outputs, and the row kernels (O, dO read; LSE, D and the fp32 dQ accumulator).
    visible = sum(per_cta) / max(1, len(per_cta) * math.ceil(n / inner))
    streamed = 2 * n * d * eb * len(per_cta) * visible + 2 * n * 4 * len(per_cta) * visible
    resident = 2 * n * d * eb * 2
    rows = 3 * n * d * eb + 2 * n * 4 + (2 * n * d * 4 if gemms == 5 else 0)
    memory_s = b * h * (streamed + resident + rows) / profile.bandwidth
    return max(compute_s, memory_s) + (1 + BWD_ROW_LAUNCHES) * LAUNCH_S
