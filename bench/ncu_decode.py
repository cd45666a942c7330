"""One flashgen decode call and one cuDNN SDPA call at b1/hk32/L32k (d=128, bf16), for ncu to profile.

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        python3 bench/ncu_decode.py
Each is called three times (the first compiles and warms up); profile with --launch-skip as needed.
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flashgen  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

b, hq, hk, L, d = 1, 32, 32, 32768, 128
q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(b, hk, L, d, device="cuda", dtype=torch.bfloat16)
v = torch.randn(b, hk, L, d, device="cuda", dtype=torch.bfloat16)
lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
for _ in range(3):
    flashgen.decode(q, k.transpose(1, 2), v.transpose(1, 2), lens, check_values=False)
torch.cuda.synchronize()
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    for _ in range(3):
        F.scaled_dot_product_attention(q.transpose(1, 2), k, v)
torch.cuda.synchronize()
