"""fwd_sm90 smoke test: one small case per head dim x causal x flag set, max error printed per case.

Run in a subprocess with CUDA_LAUNCH_BLOCKING=1 (and under compute-sanitizer
with --quick) so that the first crash names its kernel. Each case is
independent: an exception is printed and the next case runs (a sticky CUDA
error ends the process; the line before it names the culprit).
"""
from __future__ import annotations

import math
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402

import flashgen  # noqa: E402
from flashgen import KernelSpec, dispatch, tma  # noqa: E402
from flashgen.reference import reference  # noqa: E402

FLAGS = {"plain": (False, False, False), "ov": (False, False, True), "ws": (True, False, False),
         "ws_pp": (True, True, False), "ws_ov": (True, False, True), "full": (True, True, True)}


def spec(d, causal, flags, bm=128, dtype="bf16"):
    ws, pp, ov = FLAGS[flags]
    tile = dispatch.sm90_head_dim_tile(d)
    return KernelSpec(kind="fwd_sm90", arch="sm_90a", dtype=dtype, head_dim=tile, block_m=bm,
                      block_n={64: 128, 128: 128, 256: 64}[tile], warps=4 * (bm // 64 + ws), stages=2,
                      warpspec=ws, pingpong=pp, overlap=ov, causal=causal)


def case(d, causal, flags, bm=128, nq=200, nk=333):
    s = spec(d, causal, flags, bm)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, d, device="cuda", dtype=torch.bfloat16) for n in (nq, nk, nk))
    out, lse = flashgen.attention(q, k, v, causal=causal, spec=s, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = reference(q, k, v, causal, 1 / math.sqrt(d), torch.float32)
    low, _ = reference(q, k, v, causal, 1 / math.sqrt(d), torch.bfloat16)
    err = (out.float() - ref).abs().max().item()
    tol = 2 * (low - ref).abs().max().item() + 1e-5
    fin = ~torch.isinf(ref_lse)
    lse_err = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    ok = err <= tol and torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    print(f"{'OK  ' if ok else 'FAIL'} {s.name:62s} nq={nq} nk={nk} max_err={err:.3e} tol={tol:.3e} "
          f"lse_err={lse_err:.2e} nan={int(torch.isnan(out).sum())}", flush=True)
    return ok


def _try_build(build, s):
    try:
        build(s)
        return ""
    except Exception as exc:  # noqa: BLE001
        return f"{s.name}: {str(exc)[:300]}"


def main():
    quick = "--quick" in sys.argv
    print("device:", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(), flush=True)
    try:
        import cuda.bindings  # noqa: F401
        print("cuda.bindings importable: yes", flush=True)
    except ImportError as exc:
        print("cuda.bindings importable: no", exc, flush=True)
    print("tensor-map encoder:", tma.backend().name, flush=True)
    # Both encoders, when both exist, must give the same bytes.
    x = torch.zeros(2, 3, 100, 64, device="cuda", dtype=torch.bfloat16)
    dims, strides = tma.tensor_dims(64, 100, 3, 2, (64, 6400, 19200))
    a = tma._CtypesBackend().encode(x.data_ptr(), 9, tuple(dims), tuple(strides), (64, 128, 1, 1))
    try:
        b = tma._BindingsBackend().encode(x.data_ptr(), 9, tuple(dims), tuple(strides), (64, 128, 1, 1))
        print("ctypes and cuda.bindings tensor maps equal:", a == b, flush=True)
    except Exception as exc:  # noqa: BLE001
        print("cuda.bindings encoder unavailable:", type(exc).__name__, exc, flush=True)
    cases = [(d, c, f, 128) for f in (["plain", "full"] if quick else list(FLAGS)) for d in (64, 128, 256)
             for c in (False, True)]
    if quick:
        cases = [(64, False, "plain", 64), (64, True, "plain", 128), (128, True, "full", 128)]
    else:
        cases = [(d, c, "plain", 64) for d in (64, 128) for c in (False, True)] + cases
    from multiprocessing.pool import ThreadPool

    from flashgen.codegen import build

    t0 = __import__("time").time()
    with ThreadPool(12) as pool:  # compile everything first, in parallel (NVRTC releases the GIL)
        errs = pool.map(lambda a: _try_build(build, spec(a[0], a[1], a[2], a[3])), cases)
    print(f"compiled {len(cases)} kernels in {__import__('time').time() - t0:.1f}s; failures: "
          f"{[e for e in errs if e] or 'none'}", flush=True)
    bad = 0
    for d, c, f, bm in cases:
        print(f"running d={d} causal={c} flags={f} bm={bm} ...", flush=True)
        try:
            bad += not case(d, c, f, bm)
        except Exception:  # noqa: BLE001
            bad += 1
            print(f"ERROR d={d} causal={c} flags={f} bm={bm}:", flush=True)
            traceback.print_exc()
            if "CUDA" in traceback.format_exc() or "illegal" in traceback.format_exc():
                print("(a CUDA error is sticky: stopping here)", flush=True)
                break
    print(f"smoke: {len(cases) - bad}/{len(cases)} ok", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
