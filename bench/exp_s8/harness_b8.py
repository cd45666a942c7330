"""Session 8: why is b8/hk8/L128k 1.005-1.008x cuDNN in ab_decode but 0.995x in bench_decode?
Same process, same inputs: time flashgen and cuDNN interleaved (bench_decode.interleaved) with and
without SDPA flash in the rounds, twice each, alternating.

    python3 bench/exp_s8/harness_b8.py OUT.json [ROUNDS]
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import torch  # noqa: E402

import flashgen  # noqa: E402
from bench_decode import interleaved, make_inputs, sdpa_runner, summary, kv_bytes  # noqa: E402
from bench_fwd import meta  # noqa: E402


def main(out, rounds="7"):
    b, hq, hk, L = 8, 32, 8, 131072
    copies, qs, ks, vs = make_inputs(b, hq, hk, L)
    nbytes = kv_bytes(b, hk, L)
    lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    kc = [k.transpose(1, 2) for k in ks]
    vc = [v.transpose(1, 2) for v in vs]

    def fg(i):
        return flashgen.decode(qs[i], kc[i], vc[i], lens, check_values=False)

    fg(0)
    flash, _ = sdpa_runner("FLASH_ATTENTION", qs, ks, vs, hq, hk)
    cudnn, _ = sdpa_runner("CUDNN_ATTENTION", qs, ks, vs, hq, hk)
    res = {"meta": meta(), "runs": []}
    for rep in range(2):
        for name, fns in (("with_flash", {"flashgen": fg, "sdpa_flash": flash, "sdpa_cudnn": cudnn}),
                          ("without_flash", {"flashgen": fg, "sdpa_cudnn": cudnn})):
            t = interleaved(fns, copies, rounds=int(rounds))
            row = {"set": name, "rep": rep, **{k: summary(v, nbytes) for k, v in t.items()}}
            row["x_cudnn"] = row["sdpa_cudnn"]["us"] / row["flashgen"]["us"]
            res["runs"].append(row)
            print(f"{name:<14} rep {rep}: flashgen {row['flashgen']['us']:.1f} us (+-{row['flashgen']['spread_pct']:.2f}%)"
                  f"  cudnn {row['sdpa_cudnn']['us']:.1f} (+-{row['sdpa_cudnn']['spread_pct']:.2f}%)  x cudnn {row['x_cudnn']:.4f}",
                  flush=True)
            with open(out, "w") as fh:
                json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
