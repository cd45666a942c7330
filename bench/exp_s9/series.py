"""Session 9: b8/hk8/L128k's wide time distribution (session 8: flashgen's round medians 945-975 us,
cuDNN's 949-959). Two looks, one process:

A. Per-launch times: flashgen and cuDNN in alternating blocks of 20 launches, every launch between its
   own pair of CUDA events (back to back, nothing waits), the SM clock / power / temperature read with
   nvidia-smi after each block. Is flashgen's distribution bimodal, and do slow launches come in
   streaks (clock, power) or one by one (placement)?
B. Per-CTA stamps (the FLASHGEN_PROBE build, %globaltimer + %smid): each probed launch right behind a
   busy one; per launch its duration and the 4 SMs left idle (128 CTAs on 132 SMs); per SM its mean
   block-loop time. Does a launch's duration follow which SMs are idle, or which SM a CTA lands on?

    python3 bench/exp_s9/series.py OUT.json [blocks] [probed]
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import numpy as np  # noqa: E402
import torch  # noqa: E402

import flashgen  # noqa: E402
from bench_decode import kv_bytes, make_inputs, sdpa_runner  # noqa: E402
from bench_fwd import meta  # noqa: E402


def smi():
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        return [float(x) for x in r.stdout.strip().split(",")]
    except Exception:  # noqa: BLE001
        return None


def launches(fn, n):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in ev]


def q(xs, p):
    return float(np.percentile(xs, p))


def main(out, blocks="16", probed="40"):
    b, hq, hk, L = 8, 32, 8, 131072
    _, qs, ks, vs = make_inputs(b, hq, hk, L)
    nbytes = kv_bytes(b, hk, L)
    lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    kc, vc = ks[0].transpose(1, 2), vs[0].transpose(1, 2)

    def fg():
        return flashgen.decode(qs[0], kc, vc, lens, check_values=False)

    cudnn, _ = sdpa_runner("CUDNN_ATTENTION", qs, ks, vs, hq, hk)
    impls = {"flashgen": fg, "cudnn": lambda: cudnn(0)}
    for f in impls.values():
        launches(f, 5)
    res = {"meta": meta(), "case": [b, hq, hk, L], "kv_bytes": nbytes, "blocks": []}
    for i in range(int(blocks)):
        for name in (list(impls) if i % 2 == 0 else list(impls)[::-1]):
            ts = launches(impls[name], 20)
            res["blocks"].append({"impl": name, "us": ts, "smi": smi()})
    print("A. per-launch us (all blocks): p5 p25 p50 p75 p95 max; block medians min..max")
    for name in impls:
        xs = [t for blk in res["blocks"] if blk["impl"] == name for t in blk["us"][1:]]
        meds = [float(np.median(blk["us"][1:])) for blk in res["blocks"] if blk["impl"] == name]
        print(f"  {name:<9} " + " ".join(f"{q(xs, p):7.1f}" for p in (5, 25, 50, 75, 95, 100))
              + f" | {min(meds):.1f}..{max(meds):.1f}  blocks: " + " ".join(f"{m:.0f}" for m in meds))
    clk = [blk["smi"] for blk in res["blocks"] if blk["smi"]]
    if clk:
        a = np.array(clk)
        print("  nvidia-smi after blocks: sm MHz %d..%d, mem MHz %d..%d, W %.0f..%.0f, C %d..%d" % (
            a[:, 0].min(), a[:, 0].max(), a[:, 1].min(), a[:, 1].max(), a[:, 2].min(), a[:, 2].max(),
            a[:, 3].min(), a[:, 3].max()))
    with open(out, "w") as fh:
        json.dump(res, fh)

    # ---- B: the probe build ----
    import cupy

    import flashgen.codegen as codegen
    from flashgen import decode_api

    from flashgen.codegen import launch

    plain = codegen.render
    codegen.render = lambda spec: ("#define FLASHGEN_PROBE 1\n" + plain(spec)) if spec.kind == "decode_split" else plain(spec)
    decode_api._plans.clear()
    launch._loaded.clear()  # the shipped kernel is loaded already (part A): load the probe build instead
    fg()
    plan = next(p for p in reversed(list(decode_api._plans.values())) if p.kernel is not None)
    ptr = plan.kernel._module.get_global_var("fg_probe")
    n_cta = plan.grid[0] * plan.grid[1] * plan.grid[2]
    rows = []
    for _ in range(int(probed)):
        fg()
        fg()
        torch.cuda.synchronize()
        mem = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, 8192 * 8 * 8, plan.kernel), 0)
        raw = cupy.ndarray((8192 * 8,), dtype=cupy.uint64, memptr=mem).get().reshape(8192, 8)[:n_cta].astype(np.int64)
        t0 = raw[:, 0].min()
        end = max(raw[:, 4].max(), raw[:, 5].max(), raw[:, 6].max())
        rows.append({"dur_us": float(end - t0) / 1e3, "sm": raw[:, 7].tolist(),
                     "loop_us": ((raw[:, 3] - raw[:, 2]) / 1e3).tolist(),
                     "loop_end_us": ((raw[:, 3] - t0) / 1e3).tolist()})
    res["probe"] = {"spec": plan.spec.name, "splits": plan.splits, "ctas": n_cta, "launches": rows}
    with open(out, "w") as fh:
        json.dump(res, fh)
    dur = np.array([r["dur_us"] for r in rows])
    print(f"B. probed launches ({plan.spec.name}, S={plan.splits}, {n_cta} CTAs): duration p5 {q(dur, 5):.1f} "
          f"p50 {q(dur, 50):.1f} p95 {q(dur, 95):.1f} max {dur.max():.1f}")
    idle = [tuple(sorted(set(range(132)) - set(r["sm"]))) for r in rows]
    same_place = np.mean([rows[i]["sm"] == rows[0]["sm"] for i in range(len(rows))])
    print(f"  launches with CTA->SM placement equal to the first: {same_place:.2f}; distinct idle-SM sets: "
          f"{len(set(idle))}")
    for s in sorted(set(idle), key=lambda s: -idle.count(s))[:6]:
        ds = [r["dur_us"] for r, i in zip(rows, idle) if i == s]
        print(f"  idle {s}: {len(ds)} launches, duration median {np.median(ds):.1f} (min {min(ds):.1f} max {max(ds):.1f})")
    per_sm = {}
    for r in rows:
        for sm, lt in zip(r["sm"], r["loop_us"]):
            per_sm.setdefault(sm, []).append(lt)
    m = {sm: float(np.median(v)) for sm, v in per_sm.items()}
    srt = sorted(m, key=m.get)
    print("  per-SM median loop time: fastest " + " ".join(f"{s}:{m[s]:.0f}" for s in srt[:6]) +
          " | slowest " + " ".join(f"{s}:{m[s]:.0f}" for s in srt[-6:]))
    # slow launches: how late is the last loop end vs the median, and which SMs hold the last CTAs
    for r in sorted(rows, key=lambda r: r["dur_us"])[:: max(1, len(rows) // 6)]:
        le = np.array(r["loop_end_us"])
        last = np.argsort(le)[-3:]
        print(f"  dur {r['dur_us']:.1f}: loop ends p50 {np.median(le):.1f} max {le.max():.1f}; last CTAs on SMs "
              + ",".join(str(r["sm"][i]) for i in last))


if __name__ == "__main__":
    main(*sys.argv[1:])
