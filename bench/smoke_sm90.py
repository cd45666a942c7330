"""fwd_sm90 smoke test: one small case per head dim x causal x flag set, max error printed per case.

Two modes:

* ``--isolated`` (what bench/smoke_sm90_min.sh runs): the parent compiles the
  cases (NVRTC, no GPU needed), then runs every case in its own subprocess
  (``--one d,causal,flags,bm``) with CUDA_LAUNCH_BLOCKING=1, a few at a time, so
  an illegal address ends only its own case. A failing case prints a small
  diagnostic: error per 64-row / 64-column block, the raw S = Q K^T of the first
  tile (the kernel's debug dump, params.dbg_s) against torch, and how close O
  and S come to references whose Q, K or V rows have the 128-byte swizzle's
  16-byte chunks permuted (a TMA / wgmma-descriptor layout mismatch shows up as
  one of those matching). ``--flags plain,ov`` ``--dims 64,128`` ``--bms 64``
  ``--jobs 3`` pick the cases; a flag set is any families.sm90_flag_set name
  (``ws_pp_kv_lz_e1_s3``; a name with ``m<k>`` sets its own block_m), and cases
  that are not valid or do not fit an H200 are left out.
* default (bench/device_sm90.sh): every case in this process, in order; a
  sticky CUDA error ends it (the line before names the culprit).
"""
from __future__ import annotations

import math
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402

import flashgen  # noqa: E402
from flashgen import dispatch, gpus, tma  # noqa: E402
from flashgen.families import SM90_FLAG_BASES, sm90_flag_set, sm90_named_spec  # noqa: E402
from flashgen.reference import reference  # noqa: E402

DEV = "cuda"  # the diagnostics' CPU check swaps it
FLAGS = SM90_FLAG_BASES  # the base names (any families.sm90_flag_set name works)


def spec(d, causal, flags, bm=128, dtype="bf16"):
    """The case's spec: flag set ``flags`` at d's tile; ``bm`` unless the name sets block_m."""
    own_bm = "block_m" in sm90_flag_set(flags)
    return sm90_named_spec(dispatch.sm90_head_dim_tile(d), causal, flags, dtype, **({} if own_bm else {"block_m": bm}))


def runnable(d, causal, flags, bm=128):
    """A valid spec that fits an H200 (ping-pong needs 2-3 consumers, 3 stages do not fit d=256, ...)."""
    try:
        return not spec(d, causal, flags, bm).check(gpus.get("h200"))
    except ValueError:
        return False


def case(d, causal, flags, bm=128, nq=200, nk=333):
    s = spec(d, causal, flags, bm)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, d, device=DEV, dtype=torch.bfloat16) for n in (nq, nk, nk))
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


def _swz(x):
    """x [..., n, d] with each row's 16-byte chunks permuted as the 128-byte swizzle does (chunk c of
    row r read from chunk c ^ (r % 8), per 64-column panel): the layout-mismatch hypothesis."""
    n, d = x.shape[-2], x.shape[-1]
    r = torch.arange(n, device=x.device).view(n, 1)
    col = torch.arange(d, device=x.device).view(1, d)
    src = (col // 64) * 64 + (((col % 64) // 8) ^ (r % 8)) * 8 + col % 8
    return torch.gather(x, -1, src.expand(*x.shape[:-2], n, d).contiguous() if x.dim() > 2 else src)


def _blocks(err, rows=64, cols=64):
    """Max of a [n, d] error matrix per rows x cols block, as text (nan shown as nan)."""
    out = []
    for r0 in range(0, err.shape[0], rows):
        cells = []
        for c0 in range(0, err.shape[1], cols):
            blk = err[r0:r0 + rows, c0:c0 + cols]
            cells.append("nan" if torch.isnan(blk).any() else f"{blk.max().item():.2g}")
        out.append(f"    rows {r0:4d}+: " + " ".join(f"{c:>7s}" for c in cells))
    return "\n".join(out)


def _launch_debug(q, k, v, causal, s):
    """One launch with the S debug dump on: (out, lse, S of key block 0 of query block 0, b=0, h=0)."""
    from flashgen import api

    plan = api._plan(q, k, v, causal, None, "bhsd", True, s)
    out = torch.empty_like(q)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
    dbg = torch.full((s.block_m, s.block_n), float("nan"), dtype=torch.float32, device=q.device)
    params = plan.tma(q.data_ptr(), k.data_ptr(), v.data_ptr())  # a fresh block with the maps filled in
    params.o, params.lse, params.dbg_s = out.data_ptr(), lse.data_ptr(), dbg.data_ptr()
    plan.launch(params)
    torch.cuda.synchronize()
    return out, lse, dbg


def one(d, causal, flags, bm, nq=200, nk=333):
    """One case with diagnostics (run in its own process by --isolated). True when it passes."""
    s = spec(d, causal, flags, bm)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, d, device=DEV, dtype=torch.bfloat16) for n in (nq, nk, nk))
    scale = 1 / math.sqrt(d)
    out, lse = flashgen.attention(q, k, v, causal=causal, spec=s, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = reference(q, k, v, causal, scale, torch.float32)
    low, _ = reference(q, k, v, causal, scale, torch.bfloat16)
    err = (out.float() - ref).abs()
    tol = 2 * (low - ref).abs().max().item() + 1e-5
    fin = ~torch.isinf(ref_lse)
    lse_err = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    ok = err.max().item() <= tol and torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    print(f"{'OK  ' if ok else 'FAIL'} {s.name:62s} nq={nq} nk={nk} max_err={err.max().item():.3e} tol={tol:.3e} "
          f"lse_err={lse_err:.2e} nan={int(torch.isnan(out).sum())}/{out.numel()}", flush=True)
    # The S dump, always (cheap): the first tile's Q K^T against torch.
    _, _, dbg = _launch_debug(q, k, v, causal, s)
    bm_, bn_ = s.block_m, s.block_n
    qt = torch.zeros(bm_, d, device=DEV)
    kt = torch.zeros(bn_, d, device=DEV)
    qt[:min(bm_, nq)] = q[0, 0, :bm_].float()
    kt[:min(bn_, nk)] = k[0, 0, :bn_].float()
    s_ref = qt @ kt.T
    s_err = (dbg - s_ref).abs()
    s_ok = bool(s_err.max().item() <= 1e-2 * max(1.0, s_ref.abs().max().item()))
    print(f"     S(tile 0) vs Q K^T: max_err={s_err.max().item():.3e} (|S| max {s_ref.abs().max().item():.2f}, "
          f"nan={int(torch.isnan(dbg).sum())}) -> {'ok' if s_ok else 'WRONG'}", flush=True)
    if ok:
        return True
    print("     O error per 64-row x 64-col block (batch 0, head 0):\n" + _blocks(err[0, 0]), flush=True)
    print("     O error per 64-row block, head 1: " +
          " ".join(f"{err[0, 1, r:r + 64].max().item():.2g}" for r in range(0, nq, 64)), flush=True)
    if not s_ok:
        print("     S error per 64-row x 64-col block:\n" + _blocks(s_err), flush=True)
        for name, (a, bb) in {"Q swizzled": (_swz(qt), kt), "K swizzled": (qt, _swz(kt)),
                              "both swizzled": (_swz(qt), _swz(kt)),
                              "Q rows 8-row-group reversed": (qt.view(-1, 8, d).flip(1).reshape(bm_, d), kt)}.items():
            e = (dbg - a @ bb.T).abs().max().item()
            print(f"       S vs {name:28s}: max_err={e:.3e}", flush=True)
    for name, (qq, kk, vv) in {"Q swizzled": (_swz(q), k, v), "K swizzled": (q, _swz(k), v),
                               "V swizzled": (q, k, _swz(v)), "K and V swizzled": (q, _swz(k), _swz(v))}.items():
        alt, _ = reference(qq, kk, vv, causal, scale, torch.float32)
        print(f"       O vs ref with {name:18s}: max_err={(out.float() - alt).abs().max().item():.3e}", flush=True)
    return False


def encoders():
    """Both tensor-map encoders on one tensor: equal bytes?"""
    print("device:", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(), flush=True)
    print("tensor-map encoder:", tma.backend().name, flush=True)
    x = torch.zeros(2, 3, 100, 64, device=DEV, dtype=torch.bfloat16)
    dims, strides = tma.tensor_dims(64, 100, 3, 2, (64, 6400, 19200))
    a = tma._CtypesBackend().encode(x.data_ptr(), 9, tuple(dims), tuple(strides), (64, 128, 1, 1))
    try:
        b = tma._BindingsBackend().encode(x.data_ptr(), 9, tuple(dims), tuple(strides), (64, 128, 1, 1))
        print("ctypes and cuda.bindings tensor maps equal:", a == b, flush=True)
        if a != b:
            print("  ctypes  :", a.hex(), "\n  bindings:", b.hex(), flush=True)
    except Exception as exc:  # noqa: BLE001
        print("cuda.bindings encoder unavailable:", type(exc).__name__, exc, flush=True)


def _arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def isolated():
    import subprocess
    import time
    from multiprocessing.pool import ThreadPool

    from flashgen.codegen import build

    flags = _arg("--flags", "plain").split(",")
    dims = [int(x) for x in _arg("--dims", "64,128,256").split(",")]
    bms = [int(x) for x in _arg("--bms", "64,128").split(",")]
    jobs = int(_arg("--jobs", "3"))
    per_case = int(_arg("--case-timeout", "40"))
    cases = list({spec(d, c, f, bm).name: (d, c, f, bm) for f in flags for bm in bms for d in dims
                  for c in (False, True) if runnable(d, c, f, bm)}.values())  # one case per kernel
    t0 = time.time()
    with ThreadPool(12) as pool:  # compile first, in parallel (NVRTC releases the GIL); children hit the disk cache
        errs = pool.map(lambda a: _try_build(build, spec(*a)), cases)
    print(f"compiled {len(cases)} kernels in {time.time() - t0:.1f}s; failures: {[e for e in errs if e] or 'none'}",
          flush=True)
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    me = os.path.abspath(__file__)

    def child(args):
        try:
            r = subprocess.run([sys.executable, me, *args], env=env, capture_output=True, text=True,
                               timeout=per_case)
            return r.returncode, r.stdout + r.stderr[-1500:]
        except subprocess.TimeoutExpired as exc:
            return 124, (exc.stdout or b"").decode(errors="replace") + f"TIMEOUT after {per_case}s (hang?)\n"

    runs = [["--encoders"]] + [["--one", f"{d},{int(c)},{f},{bm}"] for d, c, f, bm in cases]
    with ThreadPool(jobs) as pool:
        results = pool.imap(child, runs)
        bad = 0
        for args, (rc, text) in zip(runs, results):
            print(f"== {' '.join(args)} (rc={rc})", flush=True)
            print(text.rstrip(), flush=True)
            bad += rc != 0 and args[0] == "--one"
    print(f"smoke (isolated): {len(cases) - bad}/{len(cases)} ok in {time.time() - t0:.1f}s", flush=True)
    return 1 if bad else 0


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
    x = torch.zeros(2, 3, 100, 64, device=DEV, dtype=torch.bfloat16)
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
    if "--one" in sys.argv:
        d_, c_, f_, bm_ = _arg("--one", "").split(",")
        sys.exit(0 if one(int(d_), bool(int(c_)), f_, int(bm_)) else 1)
    if "--encoders" in sys.argv:
        encoders()
        sys.exit(0)
    sys.exit(isolated() if "--isolated" in sys.argv else main())
