"""``flashgen explain``: the I/O analysis of one attention problem on one GPU profile.

FLOPs; the arithmetic intensity of S = QK^T in standard attention against the
GPU's ridge point; the HBM bytes standard attention, FlashAttention V1 and V2
move with the tiles flashgen would use; the paper's block sizes under the
GPU's shared memory; and with ``--measure`` (a CUDA GPU) the measured time of
each family with its achieved bandwidth (modeled bytes / time) and FLOP/s.
"""
from __future__ import annotations

import json
import sys

from . import dispatch, families, gpus, iomodel
from .bench.timing import time_ms
from .errors import FlashgenError

# The problems of the published intensity table (FlashAttention analysis), (d, N).
PUBLISHED = ((64, 256), (64, 2048), (64, 4096), (128, 2048), (128, 4096), (256, 2048), (256, 4096))
# Per algorithm, the (problem, family) of each kernel it runs: the I/O model is of FlashAttention-2's
# algorithm with the mma.sync family's tiles, of V1's, and of standard attention's three passes.
_KERNELS = {"standard": tuple((k, None) for k in families.standard.KINDS), "v1": ((families.fwd_v1.KIND, None),),
            "v2": (("fwd", families.fwd_v2.FAMILY.kind),)}


def tiles(profile, d: int, causal: bool, seqlen: int, dtype: str = "bf16") -> dict:
    """The specs flashgen would run for each algorithm on ``profile`` ({algorithm: [KernelSpec, ...]})."""
    out = {}
    for algorithm, kernels in _KERNELS.items():
        out[algorithm] = [dispatch.select(families.problem_key(problem, profile.arch, dtype, d, causal, seqlen),
                                          profile.name, profile.smem_per_block, family=family)
                          for problem, family in kernels]
    return out


def _model_blocks(algorithm: str, specs) -> tuple[int, int]:
    if algorithm == "standard":
        qk = specs[0]
        return qk.block_m, qk.block_n
    return specs[0].block_m, specs[0].block_n


def analyse(gpu: str, d: int, seqlen: int, causal: bool = False, batch: int | None = None,
            heads: int | None = None, dtype: str = "bf16") -> dict:
    """The analysis as a dict (what ``flashgen explain --json`` prints). ValueError on bad sizes."""
    profile = gpus.get(gpu)
    for name, value in (("d", d), ("seqlen", seqlen)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"--{name} must be a positive integer, got {value!r}")
    if d % 8 or d > 256:
        raise ValueError(f"--d {d}: head dims are multiples of 8 up to 256")
    b0, h0 = iomodel.hidden2048(seqlen, d)
    for name, value in (("batch", batch), ("heads", heads)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"--{name} must be a positive integer, got {value!r}")
    b, h = batch or b0, heads or h0
    if b <= 0 or h <= 0:
        raise ValueError(f"--batch and --heads must be positive, got {b}, {h}")
    f = iomodel.flops(b, h, seqlen, seqlen, d, causal)
    ridge = iomodel.ridge_point(profile)
    intensity = iomodel.intensity_qk(seqlen, d)
    br, bc = iomodel.paper_block_sizes(profile.smem_per_block, d)
    specs = tiles(profile, d, causal, seqlen, dtype)
    algos = {}
    for algorithm in ("standard", "v1", "v2"):
        bm, bn = _model_blocks(algorithm, specs[algorithm])
        parts = iomodel.hbm_traffic(algorithm, b, h, seqlen, seqlen, d, causal, bm, bn)
        total = sum(parts.values())
        algos[algorithm] = {"specs": [s.name for s in specs[algorithm]], "block_m": bm, "block_n": bn,
                            "hbm_bytes": total, "parts": parts,
                            "roofline_ms": iomodel.roofline_time(f, total, profile) * 1e3,
                            "memory_ms": total / profile.bandwidth * 1e3}
    for a in algos.values():
        a["bytes_vs_v2"] = a["hbm_bytes"] / algos["v2"]["hbm_bytes"]
    return {"gpu": profile.name, "peak_flops": profile.peak_flops, "bandwidth": profile.bandwidth,
            "smem_per_block": profile.smem_per_block, "batch": b, "heads": h, "seqlen": seqlen, "d": d,
            "causal": causal, "dtype": dtype, "flops": f, "compute_ms": f / profile.peak_flops * 1e3,
            "ridge": ridge, "intensity_qk": intensity, "qk_bound": "memory" if intensity < ridge else "compute",
            "intensity_table": [{"d": dd, "seqlen": n, "intensity": iomodel.intensity_qk(n, dd)}
                                for dd, n in PUBLISHED],
            "paper_blocks": {"B_r": br, "B_c": bc, "M_elements": profile.smem_per_block // 2},
            "algorithms": algos}


def measure(info: dict, reps_budget: float = 0.5) -> dict:
    """Time each family on the CUDA device (inputs of the analysed sizes); adds ``measured`` per algorithm."""
    import torch

    from .api import attention

    if not torch.cuda.is_available():
        raise FlashgenError("--measure needs a CUDA device")
    found = gpus.detect()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[info["dtype"]]
    b, h, n, d = info["batch"], info["heads"], info["seqlen"], info["d"]
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
    info["measured_on"] = torch.cuda.get_device_name()
    if found is None or found.name != info["gpu"]:
        info["warning"] = f"measured on {info['measured_on']}, modeled for the {info['gpu']} profile"
    for algorithm, a in info["algorithms"].items():
        try:
            t = time_ms(lambda: attention(q, k, v, causal=info["causal"], algorithm=algorithm),
                        budget_s=reps_budget)
            a["measured"] = {"ms": t["ms"], "tflops": info["flops"] / t["ms"] / 1e9,
                             "achieved_tbps": a["hbm_bytes"] / t["ms"] / 1e9}
        except Exception as exc:  # noqa: BLE001 -- e.g. standard's N x N buffer refused
            a["measured"] = {"error": f"{type(exc).__name__}: {exc}"}
    ok = {k: a["measured"]["ms"] for k, a in info["algorithms"].items() if "ms" in a["measured"]}
    if "v2" in ok:
        for k, ms in ok.items():
            info["algorithms"][k]["measured"]["time_vs_v2"] = ms / ok["v2"]
    return info


def _gb(x: float) -> str:
    return f"{x / 1e9:9.2f} GB"


def format_text(info: dict) -> str:
    lines = []
    causal = "causal" if info["causal"] else "non-causal"
    lines.append(f"problem: batch {info['batch']} x heads {info['heads']} x seqlen {info['seqlen']} x d {info['d']}, "
                 f"{causal}, {info['dtype']}  (hidden-2048 convention unless --batch/--heads)")
    lines.append(f"FLOPs: {info['flops']:.4g} (4·B·H·N²·d{', halved for causal' if info['causal'] else ''}); "
                 f"at peak {info['compute_ms']:.3f} ms")
    lines.append(f"GPU profile {info['gpu']}: peak {info['peak_flops'] / 1e12:.0f} TFLOP/s, "
                 f"HBM {info['bandwidth'] / 1e12:.2f} TB/s, ridge point {info['ridge']:.0f} FLOPs/byte, "
                 f"shared memory per block M = {info['smem_per_block']} B")
    lines.append("")
    lines.append(f"standard attention, S = QKᵀ: intensity 2N²d / (2·(2Nd + N²)) = {info['intensity_qk']:.0f} "
                 f"FLOPs/byte vs ridge {info['ridge']:.0f} -> {info['qk_bound']}-bound")
    lines.append("  published problems: " + ", ".join(
        f"d={r['d']} N={r['seqlen']}: {r['intensity']:.0f}" for r in info["intensity_table"]))
    pb = info["paper_blocks"]
    lines.append(f"paper block sizes under M = {pb['M_elements']} elements: B_c = ⌈M/4d⌉ = {pb['B_c']}, "
                 f"B_r = min(B_c, d) = {pb['B_r']}")
    lines.append("")
    lines.append(f"{'algorithm':10s} {'tiles (block_m x block_n)':>26s} {'HBM bytes':>12s} {'x v2':>6s} "
                 f"{'bytes/BW':>9s} {'roofline':>9s}   kernels")
    for name, a in info["algorithms"].items():
        lines.append(f"{name:10s} {a['block_m']:>14d} x {a['block_n']:<9d} {_gb(a['hbm_bytes'])} "
                     f"{a['bytes_vs_v2']:6.2f} {a['memory_ms']:7.3f}ms {a['roofline_ms']:7.3f}ms   "
                     f"{', '.join(a['specs'])}")
    for name, a in info["algorithms"].items():
        lines.append(f"  {name}: " + ", ".join(f"{k} {v / 1e9:.3g} GB" for k, v in a["parts"].items()))
    if any("measured" in a for a in info["algorithms"].values()):
        lines.append("")
        lines.append(f"measured on {info.get('measured_on', '?')}:" + (f"  ({info['warning']})" if "warning" in info
                                                                        else ""))
        for name, a in info["algorithms"].items():
            m = a.get("measured", {})
            if "ms" in m:
                lines.append(f"  {name:10s} {m['ms']:9.3f} ms  {m['tflops']:7.1f} TFLOP/s  "
                             f"{m['achieved_tbps']:6.2f} TB/s of modeled bytes  time x v2 "
                             f"{m.get('time_vs_v2', float('nan')):.2f}")
            else:
                lines.append(f"  {name:10s} {m.get('error', 'not measured')}")
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("explain", help="I/O analysis of one problem: FLOPs, intensity vs ridge, HBM bytes of "
                                       "standard/V1/V2, paper block sizes; --measure times them on the GPU")
    p.add_argument("--gpu", required=True, choices=sorted(gpus.PROFILES), help="GPU profile")
    p.add_argument("--d", type=int, required=True, help="head dim")
    p.add_argument("--seqlen", type=int, required=True, help="sequence length (queries = keys)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--batch", type=int, help="batch (default 16384 / seqlen)")
    p.add_argument("--heads", type=int, help="heads (default 2048 / d)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--measure", action="store_true", help="time each family on this machine's CUDA GPU")
    p.add_argument("--json", action="store_true", help="print the analysis as JSON")
    p.set_defaults(func=cmd_explain)


def cmd_explain(args) -> int:
    try:
        info = analyse(args.gpu, args.d, args.seqlen, args.causal, args.batch, args.heads, args.dtype)
    except ValueError as exc:
        raise FlashgenError(str(exc)) from None
    if args.measure:
        info = measure(info)
    if args.json:
        json.dump(info, sys.stdout, indent=1)
        print()
    else:
        print(format_text(info))
    return 0
