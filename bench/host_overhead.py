"""Per-call host time of the forward with a cached kernel, on this GPU's default path and with each
forward family forced, next to SDPA's flash backend (flashgen.bench.timing.host_us for all).

    python3 bench/host_overhead.py [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import flashgen  # noqa: E402
from flashgen import dispatch  # noqa: E402
from flashgen.api import _Device  # noqa: E402
from flashgen.bench import timing  # noqa: E402

from bench_fwd import host_overhead_us  # noqa: E402  (same folder: default path + SDPA flash)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = _Device.of(torch.cuda.current_device())
    q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    result = {"gpu": torch.cuda.get_device_name(), "default": host_overhead_us()}
    for fam in dispatch.families_for("fwd", dev.arch):
        key = dispatch.ProblemKey(fam, dev.arch, "bf16", 64, False, 512)
        spec = dispatch.select(key, dev.gpu, dev.smem_budget, verify=True)
        fn = lambda s=spec: flashgen.attention(q, q, q, spec=s)  # noqa: E731
        fn()
        result[fam] = {"spec": spec.name, "us": timing.host_us(fn)}
    timing.write_json(args.out, result)
    print(result)


if __name__ == "__main__":
    main()
