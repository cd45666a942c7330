"""Where does a memory-bound decode call's time go? (issue 4; needs the GPU)

    python3 bench/decode_probe.py stream  OUT.json   # a plain streaming read: fixed cost and rate by size
    python3 bench/decode_probe.py sweep   OUT.json   # flashgen and cuDNN decode by cache length
    python3 bench/decode_probe.py timeline OUT.json [MACRO]  # per-CTA %globaltimer stamps in the decode kernel
    python3 bench/decode_probe.py define MACRO CANDS OUT.json [ROUNDS]  # ab_decode, sources with #define MACRO

Timing is bench_decode's: CUDA events around each call, calls back to back. ``sweep`` fits
time = F + bytes / R over the lengths of one (batch, heads) shape, so F is the fixed cost per call
that the bandwidth column hides. ``timeline`` compiles the decode kernel with FLASHGEN_PROBE defined
(the stamps of decode_split.cuh; a different source, so a different cache entry) and reports, relative
to the first CTA's start: CTA starts, the seqlens load, the first K block, the end of the block loop,
the partial stores and the merge, as min / median / max over the CTAs.
"""
from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The kernel's FG_PROBE slots (templates/decode_split.cuh). Since session 8: "stored" and "ticket" are
# stamped by the CTAs that do not merge (partials stored; count released); the merger stamps "ticket"
# once the others' partials are in and its own is in shared memory, and "merged" at the end.
SLOTS = ("start", "seqlens", "first_k", "loop_end", "stored", "ticket", "merged")

_STREAM_SRC = r"""
extern "C" __global__ void stream_read(const uint4* __restrict__ p, long long n, uint4* out) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride), d = __ldcs(p + i + 3 * stride);
    acc.x ^= a.x ^ b.x ^ c.x ^ d.x; acc.y ^= a.y ^ b.y ^ c.y ^ d.y;
    acc.z ^= a.z ^ b.z ^ c.z ^ d.z; acc.w ^= a.w ^ b.w ^ c.w ^ d.w;
  }
  for (; i < n; i += stride) { uint4 a = __ldcs(p + i); acc.x ^= a.x; acc.y ^= a.y; acc.z ^= a.z; acc.w ^= a.w; }
  if ((acc.x & acc.y & acc.z & acc.w) == 0xffffffffu) out[0] = acc;  // never in practice; keeps the loads
}
// The same loads, but each CTA streams its own contiguous 1/gridDim of the buffer (as a decode CTA its
// split): as many concurrent sequential streams as CTAs, where stream_read sweeps one window together.
extern "C" __global__ void stream_read_chunked(const uint4* __restrict__ p, long long n, uint4* out) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  const long long per = n / gridDim.x, begin = per * blockIdx.x, end = begin + per;
  const long long stride = blockDim.x;
  long long i = begin + threadIdx.x;
  for (; i + 3 * stride < end; i += 4 * stride) {
    uint4 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride), d = __ldcs(p + i + 3 * stride);
    acc.x ^= a.x ^ b.x ^ c.x ^ d.x; acc.y ^= a.y ^ b.y ^ c.y ^ d.y;
    acc.z ^= a.z ^ b.z ^ c.z ^ d.z; acc.w ^= a.w ^ b.w ^ c.w ^ d.w;
  }
  for (; i < end; i += stride) { uint4 a = __ldcs(p + i); acc.x ^= a.x; acc.y ^= a.y; acc.z ^= a.z; acc.w ^= a.w; }
  if ((acc.x & acc.y & acc.z & acc.w) == 0xffffffffu) out[0] = acc;
}
"""


def fit(points):
    """(F µs, R TB/s) of time = F + bytes / R, least squares over (bytes, µs) points."""
    xs, ys = [b / 1e6 for b, _ in points], [t for _, t in points]  # MB, µs: slope in µs per MB
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, 1.0 / slope  # MB/µs = TB/s


def stream():
    import cupy
    import torch
    from flashgen.bench.timing import time_ms

    kerns = {name: cupy.RawKernel(_STREAM_SRC, name) for name in ("stream_read", "stream_read_chunked")}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    buf = torch.randn(8 * 2**30 // 2, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(4, dtype=torch.int32, device="cuda")
    rows = []
    for name, kern in kerns.items():
        for ctas_per_sm in (1, 2):
            pts = []
            for mb in (512, 2048, 8192):
                n = mb * 2**20 // 16
                grid = (sms * ctas_per_sm,)
                arr = cupy.ndarray((n * 4,), dtype=cupy.uint32, memptr=cupy.cuda.MemoryPointer(
                    cupy.cuda.UnownedMemory(buf.data_ptr(), n * 16, buf), 0))
                o = cupy.ndarray((4,), dtype=cupy.uint32, memptr=cupy.cuda.MemoryPointer(
                    cupy.cuda.UnownedMemory(out.data_ptr(), 16, out), 0))
                with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                    def call():
                        kern(grid, (512,), (arr, cupy.int64(n), o))
                    us = time_ms(call, min_reps=20, max_reps=20, warmup=3)["ms"] * 1e3
                pts.append((mb * 2**20, us))
                rows.append({"kernel": name, "ctas_per_sm": ctas_per_sm, "mb": mb, "us": us,
                             "tbps": mb * 2**20 / us / 1e6})
                print(json.dumps(rows[-1]), flush=True)
            f, r = fit(pts)
            rows.append({"kernel": name, "ctas_per_sm": ctas_per_sm, "fit_F_us": f, "fit_R_tbps": r})
            print(json.dumps(rows[-1]), flush=True)
    return rows


SWEEP = ((1, 32, 32, (16384, 32768, 65536, 131072)), (32, 32, 8, (4096, 8192, 16384, 32768)),
         (8, 32, 8, (16384, 32768, 65536)))


def sweep():
    import bench_decode

    rows, fits = [], []
    for b, hq, hk, lens in SWEEP:
        pts = {"flashgen": [], "sdpa_cudnn": []}
        for L in lens:
            row = bench_decode.bench_case(b, hq, hk, L, rounds=3)
            rows.append(row)
            for k in pts:
                if "us" in row.get(k, {}):
                    pts[k].append((row["kv_bytes"], row[k]["us"]))
        for k, p in pts.items():
            if len(p) >= 2:
                f, r = fit(p)
                fits.append({"batch": b, "heads_q": hq, "heads_kv": hk, "impl": k, "F_us": f, "R_tbps": r})
                print(json.dumps(fits[-1]), flush=True)
    return {"rows": rows, "fits": fits}


TIMELINE = ((1, 32, 32, 32768), (1, 32, 32, 131072), (1, 32, 8, 131072), (8, 32, 8, 32768), (32, 32, 8, 4096))


def timeline(macro=""):
    import cupy
    import numpy as np
    import torch

    import flashgen
    import flashgen.codegen as codegen
    from flashgen import decode_api
    from flashgen.bench.timing import time_ms

    plain = codegen.render

    def probe_render(spec):
        src = plain(spec)
        extra = "#define " + macro.replace("=", " ", 1) + "\n" if macro else ""
        return "#define FLASHGEN_PROBE 1\n" + extra + src if spec.kind == "decode_split" else src

    codegen.render = probe_render  # build() renders through the package attribute
    out = []
    for b, hq, hk, L in TIMELINE:
        q = torch.randn(b, 1, hq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hk, L, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(b, hk, L, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        lens = torch.full((b,), L, dtype=torch.int32, device="cuda")

        def call():
            return flashgen.decode(q, k, v, lens, check_values=False)

        call()
        plan = next(p for p in reversed(list(decode_api._plans.values())) if p.kernel is not None)
        us = time_ms(call, min_reps=20, max_reps=20, warmup=3)["ms"] * 1e3
        ptr = plan.kernel._module.get_global_var("fg_probe")  # an address (only the probe build has the symbol)
        n_cta = plan.grid[0] * plan.grid[1] * plan.grid[2]
        launches = []
        for _ in range(3):  # launches right behind a busy one (as in the timing loop), read one by one
            call()
            call()
            torch.cuda.synchronize()
            mem = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, 8192 * 8 * 8, plan.kernel), 0)
            raw = cupy.ndarray((8192 * 8,), dtype=cupy.uint64, memptr=mem).get().reshape(8192, 8)[:n_cta]
            launches.append(raw.astype(np.int64))
        row = {"batch": b, "heads_q": hq, "heads_kv": hk, "L": L, "splits": plan.splits, "ctas": n_cta,
               "spec": plan.spec.name, "event_us": us, "kv_bytes": 2 * b * L * hk * 128 * 2, "launches": []}
        ends = []
        for raw in launches:
            t0 = raw[:, 0].min()
            rel = (raw[:, :len(SLOTS)] - t0) / 1e3  # µs
            stats = {}
            for i, name in enumerate(SLOTS):
                have = raw[:, i] >= t0  # a slot this launch's CTA never reached keeps an older stamp (or 0)
                vals = rel[have, i]
                if len(vals):
                    stats[name] = {"min": round(float(vals.min()), 3), "med": round(float(np.median(vals)), 3),
                                   "max": round(float(vals.max()), 3), "n": int(len(vals))}
            ends.append(rel[:, 3] - rel[:, 2])  # block-loop time of each CTA
            row["launches"].append(stats)
        # Are the slow CTAs the same ones every launch, and is it the SM? (rank correlation of loop times)
        rk = [np.argsort(np.argsort(e)) for e in ends]
        row["loop_rank_corr_01"] = float(np.corrcoef(rk[0], rk[1])[0, 1])
        row["loop_rank_corr_12"] = float(np.corrcoef(rk[1], rk[2])[0, 1])
        sm = launches[-1][:, 7]
        row["same_sm_01"] = float(np.mean(launches[0][:, 7] == launches[1][:, 7]))
        loop = ends[-1]
        row["loop_us_by_cta"] = [round(float(x), 2) for x in loop]
        row["sm_by_cta"] = [int(x) for x in sm]
        out.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("loop_us_by_cta", "sm_by_cta")}), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    return out


def define(macro, cands, out, rounds="3"):
    """bench/ab_decode.py on ``cands`` with every decode_split source prefixed by ``#define MACRO``
    (``NAME`` or ``NAME=VALUE``; a different source, so its own cache entry): one process per variant
    of a template, compared through x cuDNN timed in the same rounds."""
    import ab_decode

    import flashgen.codegen as codegen

    line = "#define " + macro.replace("=", " ", 1) + "\n" if macro else ""
    plain = codegen.render
    codegen.render = lambda spec: line + plain(spec) if spec.kind == "decode_split" else plain(spec)
    ab_decode.main(["--cands", cands, "--rounds", rounds, "--out", out])


def main(argv):
    if argv[1] == "define":
        return define(*argv[2:])
    what, path = argv[1], argv[2] if len(argv) > 2 else None
    from flashgen.bench.timing import meta, write_json

    runs = {"stream": stream, "sweep": sweep, "timeline": lambda: timeline(*argv[3:4])}
    result = {"meta": meta(), what: runs[what]()}
    write_json(path, result)


if __name__ == "__main__":
    main(sys.argv)
