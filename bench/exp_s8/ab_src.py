"""Session 8: in-process A/B of decode_split *source* variants on issue 4's 12 cases, cuDNN in the same rounds.

    python3 bench/exp_s8/ab_src.py OUT.json [ROUNDS] [VARIANT=path/to/decode_split.cuh ...]

"head" is the working tree's template; every VARIANT=FILE is the same spec rendered with FILE's text in
place of decode_split.cuh. Variant files are an earlier commit's template, made here and carried to the
device (bench/exp_s8/variants/ is git-ignored; the device gets no .git):
    git show dcf335b:flashgen/templates/decode_split.cuh > bench/exp_s8/variants/base_decode_split.cuh
Session 8's calls used base = dcf335b, late_spin = 8fd4527, noprefetch = 7f72292. Each variant's kernel is compiled from its own source and swapped into a copy of
flashgen.decode's own plan for the case (same grid, splits, workspace), so every variant runs exactly
the call the default path makes. Before timing, each variant's output on a split case with appends,
paged and ragged, is checked against the fp32 reference (the 2x rule), and output and LSE must be
bitwise equal across repeats of a variant. Timing: bench_decode.interleaved
(inputs resident, order reversed every other round, medians of rounds).
"""
import copy
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
import torch  # noqa: E402

import flashgen  # noqa: E402
from bench_decode import interleaved, summary  # noqa: E402
from bench_fwd import meta  # noqa: E402
from flashgen import decode_api  # noqa: E402
from flashgen.codegen import launch  # noqa: E402
from flashgen.codegen.compiler import get_binary  # noqa: E402
from flashgen.codegen.render import render  # noqa: E402
from sweep_decode import CASES, Case, geomean  # noqa: E402

HEAD = (ROOT / "flashgen/templates/decode_split.cuh").read_text()


def variant_kernel(spec, text, idx=0):
    """spec's kernel compiled from the source with `text` as decode_split.cuh (loaded, not cached by spec)."""
    import cupy

    src = render(spec)
    assert HEAD in src
    binary, _ = get_binary(src.replace(HEAD, text), spec.arch, spec.name)
    assert not binary.report.problems(), binary.report.problems()
    with cupy.cuda.Device(idx):
        module = cupy.cuda.function.Module()
        module.load(binary.cubin)
        function = module.get_function(spec.name)
        if spec.smem_bytes() + binary.report.static_smem > 48 * 1024:
            from cupy_backends.cuda.api import driver
            driver.funcSetAttribute(function.ptr, 8, spec.smem_bytes())
    k = launch.Kernel(spec, binary, module, function, idx)
    print(f"  {spec.name}: regs {binary.report.registers}", flush=True)
    return k


def with_variant(fn, plans):
    """fn(i) with decode_api's one cached plan replaced by ``plans[name]`` per name."""
    (sig,) = list(decode_api._plans)
    return {name: (lambda i, p=p: (decode_api._plans.__setitem__(sig, p), fn(i))[1]) for name, p in plans.items()}


def check(variants):
    from test_gpu_decode import make_case, reference
    out, firsts = {}, {}
    for page, with_new, nq in ((64, True, 1), (None, False, 3), (None, True, 1)):
        case = make_case(3, nq, 3000, 128, 32, 8, page, with_new, torch.bfloat16)
        ref, _ = reference(case, 1 / math.sqrt(128))
        low, _ = reference(case, 1 / math.sqrt(128), torch.bfloat16)
        tol = 2 * (low - ref).abs().max().item() + 1e-5
        for ns in (None, 2, 7, 16):
            decode_api._plans.clear()
            kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
            args = (case["q"], kc, vc, case["cache_seqlens"], case["block_table"], case["k_new"], case["v_new"])
            flashgen.decode(*args, num_splits=ns)
            (sig,) = list(decode_api._plans)
            base_plan = decode_api._plans[sig]
            for name, text in variants.items():
                p = copy.copy(base_plan)
                p.kernel = variant_kernel(p.spec, text)
                decode_api._plans[sig] = p
                for rep in range(3):  # repeated: the counters must come back to zero
                    kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
                    o, lse = flashgen.decode(case["q"], kc, vc, case["cache_seqlens"], case["block_table"],
                                             case["k_new"], case["v_new"], num_splits=ns, return_lse=True)
                    err = (o.float() - ref).abs().max().item()
                    first = firsts.setdefault((name, page, with_new, nq, ns), (o, lse))  # every rep of a variant
                    same = torch.equal(first[0], o) and torch.equal(first[1], lse)
                    if not same:
                        print(f"NOT BITWISE {name} page={page} new={with_new} nq={nq} ns={ns} rep={rep}", flush=True)
                    ok = err <= tol and same
                    out.setdefault(name, []).append(ok)
                    if not ok:
                        print(f"FAIL {name} page={page} new={with_new} nq={nq} ns={ns} rep={rep}: {err:.3e} > {tol:.3e}",
                              flush=True)
    return {k: all(v) for k, v in out.items()}


def main(out, rounds="7", *vargs):
    variants = {"head": HEAD}
    for a in vargs:
        name, path = a.split("=", 1)
        variants[name] = (ROOT / path).read_text()
    checked = check(variants)
    print("checked:", checked, flush=True)
    result = {"meta": meta(), "rounds": int(rounds), "checked": checked, "cases": {}}
    for c in sorted((c for c in CASES if c[4] == "bhsd"), key=lambda c: c[0] * c[2] * c[3]):
        case = Case(*c, time_cudnn=False)
        fn, facts = case.fn(None, None)
        (sig,) = list(decode_api._plans)
        plan0 = decode_api._plans[sig]
        plans = {}
        for name, text in variants.items():
            p = copy.copy(plan0)
            p.kernel = variant_kernel(p.spec, text)
            plans[name] = p
        fns = with_variant(fn, plans)
        fns["cudnn"] = case.cudnn_run
        row = result["cases"][case.key] = {"kv_bytes": case.nbytes, **facts}
        for name, ts in interleaved(fns, case.copies, rounds=int(rounds)).items():
            row[name] = {"error": ts} if isinstance(ts, str) else summary(ts, case.nbytes)
        for name in variants:
            if "us" in row[name] and "us" in row["cudnn"]:
                row[name]["x_cudnn"] = row["cudnn"]["us"] / row[name]["us"]
        print(f"{case.key:<26} s{facts['splits']:<3} cudnn {row['cudnn'].get('tbps', float('nan')):.3f} | " +
              "  ".join(f"{n} {row[n].get('tbps', float('nan')):.3f} ({row[n].get('x_cudnn', float('nan')):.4f}x "
                        f"+-{row[n].get('spread_pct', float('nan')):.1f}%)" for n in variants), flush=True)
        decode_api._plans.clear()
        case.free()
        with open(out, "w") as fh:
            json.dump(result, fh, indent=1)
    for n in variants:
        xs = [r[n]["x_cudnn"] for r in result["cases"].values() if "x_cudnn" in r.get(n, {})]
        print(f"{n}: x cuDNN geomean {geomean(xs):.4f} min {min(xs):.4f}")
    names = list(variants)
    for n in names[1:]:
        rel = [r["head"]["us"] / r[n]["us"] for r in result["cases"].values() if "us" in r[n] and "us" in r["head"]]
        print(f"head vs {n}: time ratio per case (<1: head faster) " + " ".join(f"{x:.4f}" for x in rel))


if __name__ == "__main__":
    main(*sys.argv[1:])
