"""bwd_sm90 smoke test: one small backward per case, each in its own process, max error per gradient.

    python3 bench/smoke_bwd90.py [--quick] [--jobs 3] [--case-timeout 60] [--compile-only]

The parent compiles every case's kernels first (NVRTC, in parallel, no GPU needed), then runs
each case in a subprocess (``--one ...``) with CUDA_LAUNCH_BLOCKING=1, a few at a time, so an
illegal address or a hang ends only its own case. Each case prints

    OK|FAIL <spec> b h hk nq nk d  dq err/tol  dk err/tol  dv err/tol  nan  ms

(err: max |flashgen - fp32 reference|, tol: 3x the same-dtype reference's + 1e-5, the GPU tests'
rule). A failing case adds what localizes the fault: the error per 64-key block of dK and dV
(block = one consumer warpgroup's keys; a layout fault of one warpgroup shows there), of dQ per
64-query block x 32-column panel (the staging / TMA reduce granularity), whether dQ of the
red.global variant (hint 1) agrees with this one's, and the P probe: nq = 64 queries with
dO = identity, so dV = P^T (keys x queries) is P itself -- wrong P means S^T = K Q^T or the
exp/LSE step, right P with wrong dK/dQ means the dS / RS / dQ GEMMs.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402

from flashgen import KernelSpec  # noqa: E402
from flashgen.reference import reference  # noqa: E402

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def spec(d, causal, hint=0, bn=128, st=None, dtype="bf16"):
    st = st or (3 if d == 64 else 2)
    return KernelSpec(kind="bwd_sm90", arch="sm_90a", dtype=dtype, head_dim=d, block_m=64, block_n=bn,
                      warps=4 * (bn // 64 + 1), stages=st, hint=hint, causal=causal)


def ref_grads(q, k, v, dout, causal, scale, dtype):
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    out = reference(*leaves, causal, scale, dtype)[0].to(dtype)
    out.backward(dout.to(dtype))
    return [t.grad.float() for t in leaves]


def run_bwd(s, q, k, v, dout, causal):
    import flashgen
    from flashgen.backward import attention_backward

    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = flashgen.attention(q, k, v, causal=causal, return_lse=True)
    t0 = time.time()
    grads = attention_backward(dout, q, k, v, out, lse, causal, scale, specs={"bwd_dkdv": s})
    torch.cuda.synchronize()
    return grads, (time.time() - t0) * 1e3


def _blocks(err, rows, cols):
    """Max of a 2-D error matrix per rows x cols block, as text (nan shown as nan)."""
    lines = []
    for r0 in range(0, err.shape[0], rows):
        cells = []
        for c0 in range(0, err.shape[1], cols):
            blk = err[r0:r0 + rows, c0:c0 + cols]
            cells.append("nan" if torch.isnan(blk).any() else f"{blk.max().item():.2g}")
        lines.append(f"      rows {r0:5d}+: " + " ".join(f"{c:>7s}" for c in cells))
    return "\n".join(lines)


def one(d, causal, hint, bn, st, dtype, b, h, hk, nq, nk):
    s = spec(d, causal, hint, bn, st, dtype)
    torch.manual_seed(0)
    mk = lambda hh, n: torch.randn(b, hh, n, d, device="cuda").to(DT[dtype])  # noqa: E731
    q, k, v, dout = mk(h, nq), mk(hk, nk), mk(hk, nk), mk(h, nq)
    scale = 1.0 / math.sqrt(d)
    grads, ms = run_bwd(s, q, k, v, dout, causal)
    ref = ref_grads(q, k, v, dout, causal, scale, torch.float32)
    low = ref_grads(q, k, v, dout, causal, scale, DT[dtype])
    ok, parts, errs = True, [], {}
    nan = 0
    for name, got, r, lo in zip(("dq", "dk", "dv"), grads, ref, low):
        got = got.float()
        nan += int(torch.isnan(got).sum())
        e = (got - r).abs()
        errs[name] = e
        err, tol = e.max().item(), 3 * (lo - r).abs().max().item() + 1e-5
        good = err <= tol and bool(torch.isfinite(got).all())
        ok &= good
        parts.append(f"{name} {err:.2e}/{tol:.2e}{'' if good else ' <-'}")
    print(f"{'OK  ' if ok else 'FAIL'} {s.name:50s} b{b} h{h} hk{hk} nq{nq} nk{nk} d{d}  " + "  ".join(parts)
          + f"  nan {nan}  {ms:.0f} ms", flush=True)
    if ok:
        return True
    print("    dK error per 64-key block (rows) x 64 columns, batch 0, KV head 0:\n"
          + _blocks(errs["dk"][0, 0], 64, 64), flush=True)
    print("    dV error per 64-key block x 64 columns, batch 0, KV head 0:\n" + _blocks(errs["dv"][0, 0], 64, 64),
          flush=True)
    print("    dQ error per 64-query block x 32-column panel, batch 0, head 0:\n"
          + _blocks(errs["dq"][0, 0], 64, 32), flush=True)
    try:
        other = spec(d, causal, 1 - hint, bn, st, dtype)
        g2, _ = run_bwd(other, q, k, v, dout, causal)
        print(f"    {other.name} (the other dQ write) on the same inputs: dq err vs ref "
              f"{(g2[0].float() - ref[0]).abs().max().item():.2e}, |dq - this dq| max "
              f"{(g2[0].float() - grads[0].float()).abs().max().item():.2e}; dk, dv equal: "
              f"{torch.equal(g2[1], grads[1])}, {torch.equal(g2[2], grads[2])}", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"    other dQ write failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    probe(d, causal, hint, bn, st, dtype)
    return False


def probe(d, causal, hint, bn, st, dtype, nk=200):
    """nq = 64 queries, dO = [I 0]: dV = P^T dO = P^T[:, :64], so dV holds P (keys x queries)."""
    s = spec(d, causal, hint, bn, st, dtype)
    torch.manual_seed(1)
    q = torch.randn(1, 1, 64, d, device="cuda").to(DT[dtype])
    k, v = (torch.randn(1, 1, nk, d, device="cuda").to(DT[dtype]) for _ in range(2))
    dout = torch.zeros(1, 1, 64, d, device="cuda")
    dout[0, 0, :, :64] = torch.eye(64, device="cuda")
    dout = dout.to(DT[dtype])
    grads, _ = run_bwd(s, q, k, v, dout, causal)
    scale = 1.0 / math.sqrt(d)
    sc = (q.float()[0, 0] @ k.float()[0, 0].T) * scale
    if causal:
        i = torch.arange(64, device="cuda")[:, None]
        j = torch.arange(nk, device="cuda")[None, :]
        sc = sc.masked_fill(j > i + (nk - 64), float("-inf"))
    p = torch.softmax(sc, -1)  # 64 x nk
    pt = grads[2].float()[0, 0, :, :64]  # nk x 64
    e = (pt - p.T).abs()
    print(f"    P probe (dV = P^T with dO = I): max |P - ref| {e.max().item():.2e} (|P| max {p.max().item():.2f}, "
          f"nan {int(torch.isnan(pt).sum())})", flush=True)
    if e.max().item() > 2e-2:
        print("    P error per 64-key x 16-query block:\n" + _blocks(e, 64, 16), flush=True)
        for name, alt in (("P of swizzled Q (chunk c^(r%8))", _swz(q.float()[0, 0])),):
            s2 = (alt @ k.float()[0, 0].T) * scale
            print(f"      P vs {name}: {(pt - torch.softmax(s2, -1).T).abs().max().item():.2e}", flush=True)


def _swz(x):
    n, dd = x.shape
    r = torch.arange(n, device=x.device).view(n, 1)
    col = torch.arange(dd, device=x.device).view(1, dd)
    src = (col // 64) * 64 + (((col % 64) // 8) ^ (r % 8)) * 8 + col % 8
    return torch.gather(x, -1, src)


def cases(quick=False):
    out = []
    for d in (64, 128):
        for causal in (False, True):
            out.append((d, causal, 0, 128, 0, "bf16", 1, 2, 2, 200, 333))
            if not quick:
                out.append((d, causal, 1, 128, 0, "bf16", 1, 2, 2, 200, 333))
                out.append((d, causal, 0, 128, 0, "fp16", 2, 8, 2, 1023, 1024))
    if not quick:
        out += [(64, c, 0, 64, 2, "bf16", 1, 4, 1, 113, 203) for c in (False, True)]
        out += [(128, c, 0, 128, 3, "bf16", 1, 4, 1, 113, 203) for c in (False, True)]
        out += [(128, True, 0, 128, 0, "bf16", 1, 2, 2, 1, 239), (128, True, 0, 128, 0, "bf16", 1, 2, 2, 239, 1)]
    return out


def _arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main():
    from multiprocessing.pool import ThreadPool

    from flashgen import dispatch
    from flashgen.codegen import build

    quick = "--quick" in sys.argv
    jobs = int(_arg("--jobs", "3"))
    per_case = int(_arg("--case-timeout", "60"))
    todo = cases(quick)
    t0 = time.time()
    need = {spec(c[0], c[1], c[2], c[3], c[4], c[5]) for c in todo}
    need |= {spec(c[0], c[1], 1 - c[2], c[3], c[4], c[5]) for c in todo}  # the diagnostic's other dQ write
    for c in todo:  # the forward (table or rule, as flashgen.attention picks it) and the row kernels
        d, causal, dtype, nq = c[0], c[1], c[5], c[9]
        for kind, n in (("fwd", nq), ("fwd", 64), ("bwd_preprocess", nq), ("bwd_convert", nq)):
            key = dispatch.ProblemKey(kind, "sm_90a", dtype, d, causal and kind == "fwd", dispatch.bucket_of(n))
            need.add(dispatch.select(key, "h200", 232448))

    def try_build(s):
        try:
            r = build(s).report
            return f"{s.name}: {'; '.join(r.problems())}" if r.problems() else ""
        except Exception as exc:  # noqa: BLE001
            return f"{s.name}: {type(exc).__name__}: {str(exc)[:300]}"

    with ThreadPool(12) as pool:
        errs = [e for e in pool.map(try_build, sorted(need, key=lambda s: s.name)) if e]
    print(f"compiled {len(need)} kernels in {time.time() - t0:.1f}s; problems: {errs or 'none'}", flush=True)
    if "--compile-only" in sys.argv:
        return 1 if errs else 0
    print("device:", torch.cuda.get_device_name(), torch.cuda.get_device_capability(), flush=True)
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    me = os.path.abspath(__file__)

    def child(c):
        args = ["--one", ",".join(str(int(x) if isinstance(x, bool) else x) for x in c)]
        try:
            r = subprocess.run([sys.executable, me, *args], env=env, capture_output=True, text=True, timeout=per_case)
            return r.returncode, r.stdout + r.stderr[-2000:]
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            return 124, out + f"TIMEOUT after {per_case}s (a hang: barrier parity / expect_tx bytes?) {c}\n"

    bad = 0
    with ThreadPool(jobs) as pool:
        for c, (rc, text) in zip(todo, pool.imap(child, todo)):
            print(text.rstrip(), flush=True)
            if rc:
                bad += 1
                print(f"    (case {c}: rc={rc})", flush=True)
    print(f"smoke_bwd90: {len(todo) - bad}/{len(todo)} ok in {time.time() - t0:.1f}s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    if "--one" in sys.argv:
        f = _arg("--one", "").split(",")
        d_, c_, h_, bn_, st_ = (int(x) for x in f[:5])
        b_, hh_, hk_, nq_, nk_ = (int(x) for x in f[6:])
        sys.exit(0 if one(d_, bool(c_), h_, bn_, st_ or None, f[5], b_, hh_, hk_, nq_, nk_) else 1)
    sys.exit(main())
