"""GPU tier for user mods (flashgen/mods): the printed device functions, run by a small kernel over a
grid of (b, h, q, kv) with negative and out-of-range indices, give what ``Graph.evaluate`` gives on the
CPU from the same inputs: bit for bit where only rounded + - * and integer arithmetic are involved, within
the hardware approximations' error where a division or a float function is (tanh.approx: 2^-11)."""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)"),
]

from flashgen import mods  # noqa: E402
from flashgen.codegen.render import header  # noqa: E402

B, H, Q, K = 2, 3, 67, 301
Q0, K0 = -20, -30  # the first query's and key's index: negative ones reach // and % and the clamping

# What the kernels put before the printed functions: the shared helpers and fg_mod_args with its
# loads and approximations (templates/common/mod_args.cuh).
PRELUDE = header("common/common.cuh") + header("common/mod_args.cuh")
KERNEL = r"""
extern "C" __global__ void run(float* out, const float* score, const fg_mod_args* args) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= %(total)d) return;
  const int kv = i %% %(K)d, q = (i / %(K)d) %% %(Q)d, h = (i / (%(K)d * %(Q)d)) %% %(H)d, b = i / (%(K)d * %(Q)d * %(H)d);
  const fg_mod_args& a = *args;
  // (a score_mod's factors k, c are folded out of fg_score_mod: the kernels apply them, and so does this)
  out[i] = fg_mask_mod(b, h, q + %(Q0)d, kv + %(K0)d, a)
               ? %(C)s * fg_score_mod(score[i] * %(K_IN)s, b, h, q + %(Q0)d, kv + %(K0)d, a)
               : __int_as_float(0x7fc00001);
}
"""


def run_pair(p: mods.ModPair, score):
    """Each grid point's fg_score_mod where fg_mask_mod holds, a marked NaN where it does not."""
    cupy = pytest.importorskip("cupy")
    total = B * H * Q * K
    k_in, c_out = p.factors
    source = PRELUDE + p.cuda() + KERNEL % dict(total=total, B=B, H=H, Q=Q, K=K, Q0=Q0, K0=K0,
                                                K_IN=f"{k_in!r}f", C=f"{c_out!r}f")
    kernel = cupy.RawModule(code=source, options=("--std=c++17",)).get_function("run")
    caps = p.captures
    blob = struct.pack("<4Q", *[t.data_ptr() for t in caps], *[0] * (4 - len(caps)))
    blob += struct.pack("<16q", *[s for t in caps for s in (*t.stride(), *[0] * (4 - t.dim()))],
                        *[0] * 4 * (4 - len(caps)))
    blob += struct.pack("<16i", *[n for t in caps for n in (*t.shape, *[0] * (4 - t.dim()))], *[0] * 4 * (4 - len(caps)))
    args = torch.frombuffer(bytearray(blob), dtype=torch.uint8).cuda()
    out = torch.empty(B, H, Q, K, device="cuda")
    pointers = tuple(np.uint64(t.data_ptr()) for t in (out, score, args))
    kernel(((total + 255) // 256,), (256,), pointers)
    torch.cuda.synchronize()
    return out


def expected(p: mods.ModPair, score):
    """The evaluator's values on the CPU (the fp32 reference's), NaN where the mask hides the key."""
    grid = (torch.arange(B, dtype=torch.int32).view(B, 1, 1, 1), torch.arange(H, dtype=torch.int32).view(1, H, 1, 1),
            torch.arange(Q, dtype=torch.int32).view(1, 1, Q, 1) + Q0,
            torch.arange(K, dtype=torch.int32).view(1, 1, 1, K) + K0)
    s = p.score.evaluate(score, *grid) if p.score else score
    keep = p.mask.evaluate(None, *grid) if p.mask else torch.ones_like(score, dtype=torch.bool)
    return torch.where(keep, s, math.nan), keep


def cuda_tensors():
    g = torch.Generator(device="cuda").manual_seed(0)
    bias = torch.randn(H, 2 * K, device="cuda", generator=g)
    return {
        "slopes": torch.rand(H, device="cuda", generator=g),
        "bias_t": bias.t().contiguous().t(),  # strided: the element strides come from the tensor
        "half": (torch.randn(H, Q, device="cuda", generator=g) * 100).half(),
        "bf16": torch.randn(Q, K, device="cuda", generator=g).bfloat16(),
        "wide": torch.randint(-2 ** 40, 2 ** 40, (B, H), device="cuda", generator=g),
        "doc": torch.repeat_interleave(torch.arange(9, device="cuda", dtype=torch.int32), 40)[:K],
        "blocks": torch.rand(2, 2, 3, 3, device="cuda", generator=g) < 0.5,
        "lens": torch.randint(-40, 300, (B,), device="cuda", dtype=torch.int32, generator=g),
        "flags": torch.rand(H, device="cuda", generator=g) < 0.5,
    }


def pairs():
    t = cuda_tensors()
    S = mods.trace_score_mod
    M = mods.trace_mask_mod
    exact = [
        (S(lambda s, b, h, q, kv: s - t["slopes"][h] * abs(q - kv)), M(lambda b, h, q, kv: t["doc"][q] == t["doc"][kv])),
        (S(lambda s, b, h, q, kv: s + t["bias_t"][h, q - kv + K]),
         M(lambda b, h, q, kv: t["blocks"][b, h, q // 128, kv // 128])),
        (S(lambda s, b, h, q, kv: s + (q - kv) // 7 + (q - kv) % 5 + (q // (kv - 3)) * 100 + q % (9 - kv)
           + s // 0.75 + s % -0.5), M(lambda b, h, q, kv: (q >= kv) | (kv < 9))),
        (S(lambda s, b, h, q, kv: (s * 1e10).int().float() + torch.where(q > kv, torch.minimum(q, kv), kv).float()
           + torch.maximum(s, s * -2.0)), M(lambda b, h, q, kv: ~((q - kv) % 3 == 0) & (q - kv <= 40))),
        # a mask whose reads are per head (made once per head: Graph.cuda_hoisted) beside its per-score compares
        (None, M(lambda b, h, q, kv: (q + t["lens"][0] >= kv) | ((kv <= t["lens"][b] - h * 7) & t["flags"][h]))),
    ]
    # (/ and the float functions print as the hardware's approximations: mods/graph.py)
    approx = [
        (S(lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0)), M(lambda b, h, q, kv: q >= kv)),  # folded: k, c
        (S(lambda s, b, h, q, kv: s * t["half"][h, q] + t["bf16"][q, kv] + t["wide"][b, h].float() * 1e-9
           - torch.clamp(s, -1.0, 0.5) / (kv * kv + 1)), None),
        (S(lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0) + torch.exp(s) + torch.log(abs(s) + 1.0)
           + torch.sqrt(abs(s)) + torch.sigmoid(s) + s.exp2() + torch.rsqrt(abs(s) + 1.0) + torch.log2(abs(s) + 2)),
         None),
    ]
    return [(mods.pair(s, m), True) for s, m in exact] + [(mods.pair(s, m), False) for s, m in approx]


def test_printed_mods_match_the_evaluator():
    score = torch.randint(-40, 40, (B, H, Q, K), device="cuda").float() / 4 + 0.125
    for i, (p, exact) in enumerate(pairs()):
        got = run_pair(p, score).cpu()
        want, keep = expected(p, score.cpu())
        assert torch.equal(torch.isnan(got), ~keep | torch.isnan(want)), f"pair {i}: the mask differs"
        if exact:
            assert torch.equal(got[keep], want[keep]), f"pair {i}: {(got - want)[keep].abs().max()}"
        else:
            torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-5, equal_nan=True, msg=f"pair {i}")  # tanh.approx: 2^-11
