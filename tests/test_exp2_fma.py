"""exp2 on the FMA pipe (templates/common/exp2_fma.cuh, fwd_sm90's ``fma_exp2``): the polynomial's error bound, CPU only.

The coefficients are read from the header (the one place they are written). ``derive`` recomputes
them: 2^f ~ 1 + f (c1 + f (c2 + f c3)) on [0, 1), minimax in relative error with p(0) = 1, by the
Remez exchange (numpy only). ``exp2_fma`` restates the device function in numpy, each operation
rounded to fp32 as the GPU does (an FMA through fp64, where the product is exact and only the sum
rounds; a rare double rounding there is below 1 fp32 ulp, far under the bound checked).

Computed here: minimax relative error 8.559e-5 (exact arithmetic); 8.565e-5 with the coefficients
rounded to fp32 and evaluated in fp32, over [0, 1) and over x in [-126, 8]. P is rounded to bf16 (half-ulp
1.95e-3) or fp16 (4.9e-4) after this, so the polynomial adds ~1/20 of the rounding that P already has.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

HEADER = Path(__file__).resolve().parent.parent / "flashgen" / "templates" / "common" / "exp2_fma.cuh"
BOUND = 8.6e-5  # max relative error of the fp32 evaluation (8.565e-5; the exact minimax value is 8.559e-5)


def coefficients() -> tuple[float, float, float]:
    text = HEADER.read_text()
    found = dict(re.findall(r"#define FG_EXP2_(C[123]) (0x[0-9a-fA-F.]+p[-+]?\d+)f", text))
    assert sorted(found) == ["C1", "C2", "C3"], found
    return tuple(float.fromhex(found[c]) for c in ("C1", "C2", "C3"))


def derive(iterations: int = 30):
    """(c1, c2, c3, max relative error): the minimax fit, by Remez on the weighted form
    rel(f) = f (q(f) - g(f)) / 2^f with q(f) = c1 + c2 f + c3 f^2 and g(f) = (2^f - 1) / f."""
    grid = np.linspace(1e-9, 1.0, 200_001)
    g = np.expm1(grid * np.log(2.0)) / grid
    w = grid / np.exp2(grid)
    ref = np.array([0.05, 0.35, 0.75, 1.0])
    for _ in range(iterations):
        gr = np.expm1(ref * np.log(2.0)) / ref
        wr = ref / np.exp2(ref)
        # q(x_i) - g(x_i) = (-1)^i E / w(x_i): linear in (c1, c2, c3, E)
        a = np.stack([np.ones(4), ref, ref ** 2, -((-1.0) ** np.arange(4)) / wr], 1)
        c1, c2, c3, _ = np.linalg.solve(a, gr)
        err = w * (c1 + c2 * grid + c3 * grid ** 2 - g)
        # new reference: the extremum of each run of one sign (the last point is always an extremum)
        sign = np.sign(err)
        runs = np.split(np.arange(len(grid)), np.flatnonzero(np.diff(sign)) + 1)
        ext = [r[np.argmax(np.abs(err[r]))] for r in runs]
        if len(ext) >= 4:
            ext = ext[-4:] if len(ext) == 4 else sorted(ext, key=lambda i: -abs(err[i]))[:4]
            ref = np.sort(grid[ext])
    return c1, c2, c3, float(np.abs(err).max())


def _f32(x):
    return np.asarray(x, dtype=np.float32)


def _fma32(a, b, c):
    return (_f32(a).astype(np.float64) * _f32(b).astype(np.float64) + _f32(c).astype(np.float64)).astype(np.float32)


def poly32(f, c):
    """p(f) as the device evaluates it: three FFMAs (Horner), fp32."""
    c1, c2, c3 = (np.float32(v) for v in c)
    return _fma32(_fma32(_fma32(c3, f, c2), f, c1), f, np.float32(1.0))


def exp2_fma(x, c):
    """The device function exp2_fma, step by step in fp32/int32."""
    x = np.maximum(_f32(x), np.float32(-127.0))                      # fmaxf(x, -127)
    n = np.floor(x.astype(np.float64))                               # add.rm.f32 t, x, 1.5*2^23: t = 1.5*2^23 + n
    t_bits = (0x4B400000 + n.astype(np.int64)).astype(np.int64)       # exact: t in [2^23, 2^24), ulp 1
    t = t_bits.astype(np.uint32).view(np.float32)
    f = (x - (t - np.float32(12582912.0))).astype(np.float32)        # two exact FADDs
    p = poly32(f, c)
    bits = (p.view(np.uint32).astype(np.int64) + ((t_bits << 23) & 0xFFFFFFFF)) & 0xFFFFFFFF
    return bits.astype(np.uint32).view(np.float32)


def test_header_coefficients_are_the_minimax_fit():
    c1, c2, c3, e = derive()
    assert 8.55e-5 < e < 8.57e-5, e
    assert coefficients() == tuple(float(np.float32(v)) for v in (c1, c2, c3))  # the fit, rounded to fp32


def test_polynomial_error_bound_on_unit_interval():
    c = coefficients()
    f = np.concatenate([np.linspace(0, 1, 1 << 20, endpoint=False, dtype=np.float32),
                        np.nextafter(np.float32(1), np.float32(0), dtype=np.float32)[None]])
    rel = np.abs(poly32(f, c).astype(np.float64) / np.exp2(f.astype(np.float64)) - 1)
    assert rel.max() <= BOUND, rel.max()
    assert poly32(np.float32(0), c) == np.float32(1.0)  # p(0) = 1 exactly: 2^n exact at integers


def test_exp2_fma_relative_error_over_the_softmax_range():
    c = coefficients()
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-126, 8, 1 << 20, dtype=np.float32),
                        -rng.exponential(3.0, 1 << 18).astype(np.float32),
                        -np.abs(rng.standard_normal(1 << 16).astype(np.float32)) * 1e-3])
    y = exp2_fma(x, c).astype(np.float64)
    rel = np.abs(y / np.exp2(x.astype(np.float64)) - 1)
    assert np.isfinite(y).all() and rel.max() <= BOUND, rel.max()


def test_masked_scores_give_exact_zero_and_no_nan():
    c = coefficients()
    x = np.array([-np.inf, -3.4e38, -1e30, -1e6, -200.0, -128.0, -127.5, -127.0], dtype=np.float32)
    y = exp2_fma(x, c)
    assert (y.view(np.uint32) == 0).all(), y  # +0, bit for bit
    tiny = exp2_fma(np.array([-126.9, -126.5, -126.01], dtype=np.float32), c)
    assert np.isfinite(tiny).all() and (tiny.astype(np.float64) >= 0).all()
    assert (tiny.astype(np.float64) < 2.0 ** -126).all()


def test_integers_are_exact():
    c = coefficients()
    k = np.arange(-126, 9, dtype=np.float32)
    assert (exp2_fma(k, c).astype(np.float64) == np.exp2(k.astype(np.float64))).all()


def _bf16(x):
    """Round fp32 to bf16 (nearest even), returned as fp32."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("seed", [0, 1])
def test_attention_error_with_every_exp2_emulated(seed):
    """The worst case (every column on the FMA pipe): O = P V / l with P rounded to bf16 errs no more
    than with exact exp2s (within noise): the polynomial is small beside P's rounding."""
    c = coefficients()
    rng = np.random.default_rng(seed)
    n, d = 333, 64
    q, k, v = (rng.standard_normal((n, d)).astype(np.float32) for _ in range(3))
    s = (q @ k.T).astype(np.float32) * np.float32(np.log2(np.e) / np.sqrt(d))
    x = s - s.max(1, keepdims=True)
    exact = np.exp2(x.astype(np.float64))
    ref = (exact @ v) / exact.sum(1, keepdims=True)

    def out(p):
        return (_bf16(p).astype(np.float64) @ v) / p.astype(np.float64).sum(1, keepdims=True)

    err_mufu = np.abs(out(exact.astype(np.float32)) - ref).max()
    err_emu = np.abs(out(exp2_fma(x, c)) - ref).max()
    assert err_emu <= 1.25 * err_mufu + 1e-6, (err_emu, err_mufu)
