"""Session 9: does a one-wave decode grid gain from using all 132 SMs instead of 128?

Equal work per CTA (32 MB of K/V each), only the CTA count changes: if the 128-CTA grids of the
"some"/"few" cases (b8/hk8 S=2, b1/hk32 S=4, b1/hk8 S=16) are limited per SM, the TB/s grows with
the CTA count up to 132; if HBM alone limits them, it stays flat. Tiles forced (s3 and s2), cuDNN
at the same shapes in the same interleaved rounds.

    python3 bench/exp_s9/ctas.py OUT.json [rounds]
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_decode import interleaved, summary  # noqa: E402
from bench_fwd import meta  # noqa: E402
from sweep_decode import Case, spec_of  # noqa: E402

from flashgen.api import _Device  # noqa: E402

# (b, hq, hk, L, splits): CTAs = b * hk * splits, 32 MB of K/V each
CASES = [(b, 16, 4, 65536, 1) for b in (30, 32, 33)] + [(b, 8, 2, 131072, 2) for b in (30, 32, 33)] + \
        [(b, 16, 4, 65536, 1) for b in (64, 66)]
# "rate": few CTAs, so HBM never limits: each tile's own per-CTA rate (what the last CTAs of a call run at)
RATE_CASES = [(b, 4, 1, 65536, 1) for b in (8, 16, 32, 64)]


def main():
    out, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 7
    rate = sys.argv[3] if len(sys.argv) > 3 else ""
    arch = _Device.of(0).arch
    tiles = {"s3": spec_of(128, 4, 3, 2, arch), "s2": spec_of(128, 4, 2, 2, arch)}
    if rate == "rate":
        tiles.update(w8s2=spec_of(128, 8, 2, 2, arch), n64s3=spec_of(64, 4, 3, 2, arch), n64s4=spec_of(64, 4, 4, 2, arch),
                     n64s6=spec_of(64, 4, 6, 2, arch))
    elif rate == "loaders":  # the per-CTA rate by K/V loader: cp.async without / with the L2 policy, bulk rows
        tiles.update(s2h0=spec_of(128, 4, 2, 0, arch), s2h5=spec_of(128, 4, 2, 5, arch), s3h5=spec_of(128, 4, 3, 5, arch))
    res = {"meta": meta(), "rounds": rounds, "cases": {}}
    for b, hq, hk, L, S in (RATE_CASES if rate else CASES):
        case = Case(b, hq, hk, L, "bhsd", time_cudnn=False)
        fns = {n: case.fn(s, S)[0] for n, s in tiles.items()}
        fns["cudnn"] = case.cudnn_run
        row = res["cases"][case.key + f"_S{S}"] = {"ctas": b * hk * S, "kv_bytes": case.nbytes}
        for n, ts in interleaved(fns, case.copies, rounds=rounds).items():
            row[n] = {"error": ts} if isinstance(ts, str) else summary(ts, case.nbytes)
        print(f"{case.key}_S{S:<3} ctas {b * hk * S:4d} " + "  ".join(
            f"{n} {row[n].get('tbps', 0):.3f} TB/s {1e3 * row[n].get('tbps', 0) / (b * hk * S):5.1f} GB/s/CTA"
            f" (+-{row[n].get('spread_pct', 0):.1f}%)"
            for n in fns), flush=True)
        case.free()
        with open(out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
