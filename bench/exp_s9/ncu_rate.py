"""Session 9: one decode_split tile at 16 CTAs (b16/hq4/hk1/L64k: HBM never limits, each CTA at its own
rate), for ncu's warp-state and source sections: where does a block iteration's ~1 us go?

    ncu --section WarpStateStats --section SourceCounters -k regex:decode_split --launch-skip 2 \
        --launch-count 1 python3 bench/exp_s9/ncu_rate.py [STAGES]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flashgen  # noqa: E402
from flashgen.api import _Device  # noqa: E402
from bench_decode import make_inputs  # noqa: E402
from sweep_decode import spec_of  # noqa: E402

st = int(sys.argv[1]) if len(sys.argv) > 1 else 3
spec = spec_of(128, 4, st, 2, _Device.of(0).arch)
b, hq, hk, L = 16, 4, 1, 65536
_, (q,), (k,), (v,) = make_inputs(b, hq, hk, L)  # (b, hk, L, d) K/V: the bench's cache layout, d = 128
lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
for _ in range(3):
    flashgen.decode(q, k.transpose(1, 2), v.transpose(1, 2), lens, check_values=False, spec=spec, num_splits=1)
torch.cuda.synchronize()
