"""`flashgen bench` and `flashgen explain` without a GPU: plots from a stored result, the table, the
suite registry, every suite's argument errors and result format, the interleaved-rounds order, the
sass suite on kernels compiled offline; and `algorithm=` validation in flashgen.attention. The
suites' GPU paths run at tiny sizes under ``pytest -m gpu`` (skipped without CUDA)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashgen.bench import BUILT_IN, SUITES, Suite, register, report, suites, timing
from flashgen.bench import ab, ablation, bwd, decode, fwd, sass

from cli_util import run_main

SAMPLE = Path(__file__).parent / "data" / "bench_fwd_sample.json"


def test_plot_from_stored_json(tmp_path, capsys):
    """`flashgen bench --plot-from FILE --out DIR` writes DIR/fwd.png with one panel per (head_dim, causal)."""
    pytest.importorskip("matplotlib")
    code, out, err = run_main(capsys, "bench", "--plot-from", str(SAMPLE), "--out", str(tmp_path))
    assert code == 0, err
    png = tmp_path / "fwd.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "4 panels" in out


def test_plot_returns_one_axis_per_configuration(tmp_path):
    """report.plot draws exactly one axis per distinct panel key, titled by it, skipping errors and skips."""
    pytest.importorskip("matplotlib")
    result = report.load(SAMPLE)
    info = report.plot(result, tmp_path, name="x")
    assert info["axes"] == 4 == len(report.panels(result))
    assert info["panels"] == ["head_dim=64, causal=False", "head_dim=64, causal=True",
                              "head_dim=128, causal=False", "head_dim=128, causal=True"]
    assert Path(info["path"]).name == "x.png"
    one = {**result, "rows": [r for r in result["rows"] if r["head_dim"] == 64 and not r["causal"]]}
    assert report.plot(one, tmp_path, name="one")["axes"] == 1


def test_table_marks_errors_and_skips():
    text = report.table(report.load(SAMPLE))
    assert "skip" in text and "err" in text and "UnsupportedError" in text
    assert text.splitlines()[0].split()[:3] == ["head_dim", "causal", "seqlen"]


def test_save_and_load_round_trip(tmp_path):
    result = report.load(SAMPLE)
    path = report.save(result, tmp_path / "sub" / "r.json")
    assert report.load(path) == result


def test_load_refuses_a_non_result(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a bench result"):
        report.load(bad)


@pytest.mark.parametrize("argv,message", [
    (["bench"], "name a suite"),
    (["bench", "--plot-from", "/nonexistent/r.json"], "cannot read"),
    (["bench", "fwd", "--impls", "flashgen_v3"], "unknown"),
    (["bench", "fwd", "--d", "12"], "multiples of 8"),
    (["bench", "fwd", "--seqlens", "512,abc"], "integers"),
    (["bench", "fwd", "--seqlens", "0"], "positive"),
    (["bench", "fwd", "--rounds", "0"], "--rounds must be a positive integer"),
    (["bench", "fwd", "--budget", "-1"], "--budget must be positive"),
    (["bench", "fwd", "--memory-seqlens", "x"], "integers"),
    (["bench", "bwd", "--impls", "flashgen,flashgen_bwd_x"], "unknown flashgen_bwd_x"),
    (["bench", "bwd", "--d", "300"], "multiples of 8"),
    (["bench", "bwd", "--rounds", "-2"], "--rounds"),
    (["bench", "bwd", "--dkdv", "bwd_sm90_d128_bogus"], "--dkdv bwd_sm90_d128_bogus"),
    (["bench", "bwd", "--dkdv", "fwd_v2_d128_m128_n64_w4_s2_full_bf16_sm90a"], "not a bf16 dK/dV kernel"),
    (["bench", "bwd", "--dkdv", "bwd_sm90_d128_m64_n128_w12_s2_dq2_full_fp16_sm90a"], "not a bf16 dK/dV kernel"),
    (["bench", "decode", "--cases", "1,32,8"], "is not b,hq,hk,L"),
    (["bench", "decode", "--cases", "1,32,7,4096"], "must divide"),
    (["bench", "decode", "--cases", "1,32,8,0"], "positive"),
    (["bench", "decode", "--page-sizes", "48"], "pages of"),
    (["bench", "decode", "--paged-cases", "1,32,8,1000"], "multiple of every page size"),
    (["bench", "decode", "--splits", "2000"], "at most"),
    (["bench", "decode", "--reps", "0"], "--reps"),
    (["bench", "decode", "--d", "100"], "multiples of 8"),
    (["bench", "decode", "--impls", "flex"], "unknown flex"),
    (["bench", "decode", "--fp8-cases", "1,32,7,4096"], "must divide"),
    (["bench", "decode", "--fp8-cases", "1,32,8"], "is not b,hq,hk,L"),
    (["bench", "decode", "--fp8-tiles", "128/4/2"], "is not block_n/warps/stages/kv_load"),
    (["bench", "decode", "--fp8-tiles", "128/4/x/2"], "is not block_n/warps/stages/kv_load"),
    (["bench", "decode", "--fp8-tiles", "64/4/2/2"], "--fp8-tiles 64/4/2/2: decode_split: the epilogue's"),
    (["bench", "decode", "--fp8-tiles", "128/4/2/4"], "does not load an FP8 cache"),
    (["bench", "decode", "--d", "64", "--fp8-tiles", "128/4/4/0"], "rows per load pass"),
    (["bench", "decode", "--cases", "none", "--fp8-cases", "none"], "--cases: give at least one shape"),
    (["bench", "decode", "--fp8-splits", "0"], "--fp8-splits takes positive integers"),
    (["bench", "decode", "--fp8-splits", "2000"], "--fp8-splits: at most"),
    (["bench", "ablation", "--d", "96"], "this suite has head dims 64, 128"),
    (["bench", "ablation", "--variants", "ws_zz"], "not a name token"),
    (["bench", "ablation", "--variants", "pp"], "pingpong needs warp_specialized"),
    (["bench", "ablation", "--variants", ","], "--variants"),
    (["bench", "ablation", "--seqlens", "8k"], "integers"),
    (["bench", "ab"], "--cands"),
    (["bench", "ab", "--cands", "default,nosuchkernel"], "not a kernel name"),
    (["bench", "ab", "--cands", "decode_split_d128_m16_n128_w4_s2_ld2_causal_bf16_sm90a"], "--problem fwd takes"),
    (["bench", "ab", "--cands", "default@4"], "is for --problem decode"),
    (["bench", "ab", "--problem", "decode", "--cands", "default@x"], "after '@'"),
    (["bench", "ab", "--cands", "fwd_sm90_d128_m128_n128_w12_s3_ws_ov_full_bf16_sm90a", "--dtype", "fp16"],
     "a bf16 kernel"),
    (["bench", "ab", "--cands", "default", "--shapes", "1,2,3"], "is not b,h,n,d[,causal]"),
    (["bench", "ab", "--cands", "default", "--shapes", "1,2,128,64,2"], "causal is 0 or 1"),
    (["bench", "ab", "--cands", "default,default"], "without repeats"),
    (["bench", "ab", "--problem", "decode", "--cands", "default", "--shapes", "1,6,4,4096"], "must divide"),
    (["bench", "host", "--entries", "attn"], "unknown attn"),
    (["bench", "host", "--calls", "0"], "--calls"),
    (["bench", "host", "--warmup", "-1"], "negative"),
    (["bench", "startup", "--runs", "0"], "--runs"),
    (["bench", "startup", "--shape", "1,2,3"], "--shape"),
    (["bench", "startup", "--shape", "1,2,128,100"], "multiple of 8"),
    (["bench", "startup", "--max-warm", "-1"], "--max-warm"),
    (["bench", "startup", "--package", "/nonexistent"], "no flashgen package"),
    (["bench", "sass", "--archs", "sm_70"], "unknown sm_70"),
    (["bench", "sass", "--kernels", "nope"], "not a kernel name"),
    (["bench", "sass", "--strict"], "needs --compare"),
    (["bench", "sass", "--compare", "/nonexistent/dir"], "cannot read an earlier sass result"),
    (["bench", "sass", "--no-tables", "--filter", "no_such_kernel_*"], "no kernel to compile"),
    (["bench", "variants", "--cases", "nope"], "unknown nope"),
    (["bench", "variants", "--cands", "fwd_sm90_nope"], "is not a kernel name"),
    (["bench", "variants", "--rounds", "0"], "--rounds"),
    (["bench", "variants", "--cases", "decode", "--decode-reps", "0"], "--decode-reps"),
    (["bench", "variants", "--cases", "decode", "--decode-batches", "16,0"], "--decode-batches"),
    (["bench", "variants", "--cases", "decode", "--decode-batches", "x"], "--decode-batches"),
    (["bench", "mods", "--impls", "flashgen,rows"], "unknown rows"),
    (["bench", "models", "--heads", "30"], "must divide --hidden"),
    (["bench", "models", "--hidden", "4096", "--heads", "8", "--kv-heads", "8"], "head dim"),
    (["bench", "models", "--rounds", "0"], "--rounds"),
    (["bench", "models", "--docs", "9", "--train-seqlen", "8"], "--docs"),
    (["bench", "models", "--impls", "flex"], "unknown flex"),
    (["explain", "--gpu", "h200", "--d", "100", "--seqlen", "4096"], "multiples of 8"),
    (["explain", "--gpu", "h200", "--d", "64", "--seqlen", "0"], "positive"),
])
def test_cli_errors_are_clean(capsys, argv, message):
    """Bad values exit 2 with a one-line 'flashgen: error: ...' and no traceback, before touching a GPU."""
    code, _, err = run_main(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("flashgen: error: "), err


@pytest.mark.parametrize("argv", [
    ["bench", "fwd", "--d", "64", "--seqlens", "256"],
    ["bench", "bwd", "--d", "64", "--seqlens", "256", "--mode", "both"],
    ["bench", "decode", "--cases", "1,8,8,1024", "--paged-cases", "none", "--split-cases", "none"],
    ["bench", "decode", "--cases", "none", "--fp8-cases", "1,32,8,131072", "--fp8-tiles", "64/4/3/2,128/4/3/2",
     "--fp8-splits", "16,32", "--paged-cases", "none", "--split-cases", "none", "--no-host"],
    ["bench", "ablation", "--d", "64", "--variants", "plain,ws"],
    ["bench", "ab", "--cands", "default", "--shapes", "1,2,128,64"],
    ["bench", "host"],
    ["bench", "host", "--entries", "training"],
    ["bench", "startup", "--runs", "1"],
    ["bench", "variants", "--cases", "window,sinks"],
    ["bench", "variants", "--cases", "decode", "--decode-batches", "16,32"],
    ["bench", "models", "--layers", "2", "--cases", "prefill"],
    ["bench", "mods", "--cases", "document", "--impls", "flashgen,flashgen_mask_mod,builtin"],
])
def test_good_options_without_a_gpu(capsys, argv):
    """Valid options get as far as the device check: one line, exit 2, no traceback."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the suite would run")
    code, _, err = run_main(capsys, *argv)
    assert code == 2 and "needs a CUDA device" in err and "Traceback" not in err, err


def test_plot_from_and_suite_together_is_refused(capsys):
    code, _, err = run_main(capsys, "bench", "--plot-from", str(SAMPLE), "fwd")
    assert code == 2 and "not both" in err


@pytest.mark.parametrize("argv", [["explain", "--gpu", "h999", "--d", "64", "--seqlen", "8"],
                                  ["bench", "nosuchsuite"]])
def test_argparse_choices(capsys, argv):
    code, _, err = run_main(capsys, *argv)
    assert code == 2 and "invalid choice" in err


def test_explain_prints_the_analysis(capsys):
    code, out, _ = run_main(capsys, "explain", "--gpu", "a100", "--d", "128", "--seqlen", "4096")
    assert code == 0
    assert "intensity" in out and "= 120 FLOPs/byte vs ridge 201" in out and "fwd_v1_d128" in out
    code, out, _ = run_main(capsys, "explain", "--gpu", "h200", "--d", "64", "--seqlen", "1024", "--causal",
                            "--json")
    info = json.loads(out)
    assert info["causal"] is True and info["algorithms"]["standard"]["hbm_bytes"] > 0


def test_suite_registry():
    """Every built-in suite is registered (and none imports torch's GPU side to do so); another suite
    registers the same way; a name is taken once."""
    assert set(BUILT_IN) <= set(suites())
    assert all(suites()[name].name == name for name in BUILT_IN)
    extra = Suite("unit_test_suite", "a suite registered by a test", lambda p: None, lambda a, progress: {})
    try:
        register(extra)
        assert suites()["unit_test_suite"] is extra
        with pytest.raises(ValueError, match="already registered"):
            register(extra)
    finally:
        SUITES.pop("unit_test_suite", None)


# ---------------------------------------------------------------- algorithm=


@pytest.mark.parametrize("algorithm", ["v3", "V2", "", None, 2, ["v1"]])
def test_algorithm_is_validated(monkeypatch, algorithm):
    """An unknown algorithm is a ValueError listing the choices, before any dispatch or launch."""
    import torch

    import flashgen
    import flashgen.codegen
    import flashgen.dispatch

    def reached(*args, **kwargs):
        raise AssertionError("validation let the call through")

    monkeypatch.setattr(flashgen.dispatch, "select", reached)
    monkeypatch.setattr(flashgen.codegen, "load", reached)
    q = torch.randn(1, 2, 16, 64).to(torch.float16)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        flashgen.attention(q, q, q, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ["v1", "standard"])
def test_baseline_algorithms_check_inputs_like_v2(algorithm):
    """The study algorithms go through the same input checks (a CPU tensor is refused by name)."""
    import torch

    import flashgen

    q = torch.randn(1, 2, 16, 64).to(torch.float16)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        flashgen.attention(q, q, q, algorithm=algorithm)


# ---------------------------------------------------------------- interleaved rounds


def test_rounds_order_reverses_every_other_round():
    """Each round times every implementation once; odd rounds go backwards, so none is always first."""
    order = timing.rounds_order(["a", "b", "c"], 4)
    assert order == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"], ["c", "b", "a"]]
    assert timing.rounds_order({"x": 1, "y": 2}, 1) == [["x", "y"]]
    assert all(sorted(r) == ["a", "b", "c"] for r in timing.rounds_order("abc", 7))
    with pytest.raises(ValueError, match="at least 1"):
        timing.rounds_order(["a"], 0)


def test_interleaved_times_in_rounds_order_and_keeps_errors():
    """interleaved calls measure in rounds_order's order; an implementation that raises keeps its error
    text and is not called again, the others go on to the last round."""
    seen = []

    def measure(fn):
        return fn()

    def ok(name, value):
        def fn():
            seen.append(name)
            return value
        return fn

    def broken():
        seen.append("bad")
        raise RuntimeError("out of memory\nsecond line")

    times = timing.interleaved({"a": ok("a", 1.0), "bad": broken, "b": ok("b", 2.0)}, 3, measure)
    assert seen == ["a", "bad", "b", "b", "a", "a", "b"]
    assert times["a"] == [1.0, 1.0, 1.0] and times["b"] == [2.0, 2.0, 2.0]
    assert times["bad"] == "RuntimeError: out of memory"


class _FakeCuda:
    """torch.cuda for time_ms without a GPU: a stream as a list of operations; a call (``fn``) takes ``host_s`` of
    the host's time and ``gpu_ms`` of the stream's; an event reads the stream's clock when the stream reaches it,
    which a sleep kernel (its cycles at timing.AHEAD_HZ) holds back while the host queues behind it."""

    def __init__(self, host_s, gpu_ms, clock):
        self.host_s, self.gpu_ms, self.clock, self.ops = host_s, gpu_ms, clock, []
        cuda = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                cuda.ops.append(("event", self))

            def elapsed_time(self, other):
                return other.at - self.at
        self.Event = Event

    def call(self):
        self.clock.now += self.host_s
        self.ops.append(("kernel", self.gpu_ms))

    def _sleep(self, cycles):
        self.ops.append(("sleep", cycles / timing.AHEAD_HZ * 1e3))

    def synchronize(self):
        """Run the stream: it starts when the host first queued work (ms on the host's clock)."""
        gpu = self.clock.now * 1e3 - sum(self.host_s * 1e3 for op in self.ops if op[0] == "kernel")
        host = gpu
        for kind, arg in self.ops:
            if kind == "kernel":
                host += self.host_s * 1e3  # the launch reaches the stream only when the host has made it
                gpu = max(gpu, host) + arg
            elif kind == "sleep":
                gpu = max(gpu, host) + arg
            else:
                arg.at = max(gpu, host)
        self.ops = []


@pytest.mark.parametrize("ahead,expect_ms", [(False, 0.030), (True, 0.004)])
def test_time_ms_ahead_times_the_gpu_of_host_bound_calls(monkeypatch, ahead, expect_ms):
    """A call whose launch takes 30 us of host time and 4 us of the GPU's: per-call events time the host; with
    ``ahead`` a sleep kernel (twice the queued calls' host time) holds the stream while they queue, and each
    call's events then time its 4 us."""
    import sys
    import types

    clock = types.SimpleNamespace(now=100.0)
    cuda = _FakeCuda(30e-6, 0.004, clock)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock.now)
    out = timing.time_ms(cuda.call, budget_s=0.3, max_reps=30, ahead=ahead)
    assert out["reps"] == 30 and out["ms"] == pytest.approx(expect_ms, rel=1e-6)


def test_summary_median_and_spread():
    s = timing.summary([2.0, 1.0, 4.0], unit="us")
    assert s == {"us": 2.0, "rounds_us": [2.0, 1.0, 4.0], "spread_pct": 150.0}
    assert timing.summary([3.0])["spread_pct"] == 0.0


def test_add_ratios_only_where_both_cells_have_the_metric():
    row = {"results": {"fg": {"tflops": 300.0}, "cudnn": {"tflops": 200.0}, "flash": {"error": "x"}}}
    timing.add_ratios(row, "tflops", [("x_cudnn", "fg", "cudnn"), ("x_flash", "fg", "flash"),
                                      ("x_none", "fg", "missing")])
    assert row["ratios"] == {"x_cudnn": 1.5}


def test_rotating_cycles_over_copies():
    calls = []
    fn = timing.rotating(calls.append, 3)
    for _ in range(7):
        fn()
    assert calls == [0, 1, 2, 0, 1, 2, 0]


def test_shapes_option():
    from flashgen.bench import options

    assert options.shapes("1,2,3,4;5,6,7,8,1", "shapes", ("b", "h", "n", "d"), optional=(("causal", 0),)) == \
        [(1, 2, 3, 4, 0), (5, 6, 7, 8, 1)]
    with pytest.raises(ValueError, match="sizes must be positive"):
        options.shapes("1,0,3,4", "shapes", ("b", "h", "n", "d"))
    with pytest.raises(ValueError, match=r"takes shapes"):
        options.shapes(" ; ", "shapes", ("b",))


# ---------------------------------------------------------------- each suite's result format


def _timed(ms, flops=None, **extra):
    cell = {"ms": ms, "rounds_ms": [ms, ms * 1.01], "spread_pct": 1.0, **extra}
    if flops:
        cell["tflops"] = flops / ms / 1e9
    return cell


def _fwd_result():
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for n in (1024, 4096):
                f = 4.0 * 16 * 32 * n * n * d / (2 if causal else 1)
                row = {"head_dim": d, "causal": causal, "seqlen": n, "flops": f,
                       "results": {"flashgen": _timed(1.0, f), "sdpa_flash": _timed(1.5, f),
                                   "sdpa_cudnn": _timed(0.8, f), "sdpa_math": {"skipped": "slow"},
                                   "flex": {"error": "RuntimeError: no"}}}
                timing.add_ratios(row, "tflops", [("x_flash", "flashgen", "sdpa_flash"),
                                                  ("x_cudnn", "flashgen", "sdpa_cudnn")])
                rows.append(row)
    settings = {"dtype": "bf16", "rounds": 5, "impls": ["flashgen", "sdpa_flash", "sdpa_cudnn", "sdpa_math", "flex"]}
    return fwd._result(settings, {"gpu": "test"}, rows, "flashgen")


def _bwd_result():
    rows = []
    for mode in ("fwd+bwd", "bwd"):
        for n in (1024, 2048):
            row = {"head_dim": 64, "causal": False, "mode": mode, "seqlen": n,
                   "results": {"flashgen": _timed(2.0, 3.5e12), "flashgen_det": _timed(3.0, 3.5e12),
                               "sdpa_flash": _timed(2.5, 3.5e12), "sdpa_cudnn": _timed(1.9, 3.5e12)}}
            timing.add_ratios(row, "tflops", bwd.RATIOS)
            rows.append(row)
    settings = {"dtype": "bf16", "rounds": 3, "impls": ["flashgen", "flashgen_det", "sdpa_flash", "sdpa_cudnn"]}
    return bwd._result(settings, {}, rows)


def _decode_result():
    rows = []
    for L in (4096, 32768):
        row = {"batch": 1, "heads_q": 32, "heads_kv": 8, "L": L,
               "results": {"flashgen": {"us": 10.0, "tbps": 3.456, "splits": 16, "spec": "decode_split_x"},
                           "sdpa_flash": {"us": 12.0, "tbps": 2.9, "gqa": "enable_gqa"},
                           "sdpa_cudnn": {"us": 11.0, "tbps": 3.2, "gqa": "enable_gqa"}}}
        timing.add_ratios(row, "tbps", [("x_flash", "flashgen", "sdpa_flash"), ("x_cudnn", "flashgen", "sdpa_cudnn")])
        rows.append(row)
    settings = {"dtype": "bf16", "d": 128, "rounds": 7, "reps": 20, "impls": list(decode.IMPLS)}
    result = decode._result(settings, {}, rows)
    result["sections"] = {
        "paged": {"metric": "tbps", "precision": 2, "x": "L", "panels": ["batch"], "impls": ["contiguous", "page64"],
                  "ratios": ["page64/contig"],
                  "rows": [{"batch": 8, "L": 32768, "ratios": {"page64/contig": 0.987},
                            "results": {"contiguous": {"tbps": 4.4}, "page64": {"tbps": 4.34}}}]},
        "host": {"metric": "us", "x": "call", "panels": ["entry"], "impls": ["host"], "fields": ["spec"],
                 "rows": [{"entry": "decode", "call": "split", "spec": "decode_split_x",
                           "results": {"host": {"us": 14.2}}}]}}
    return result


def _ablation_result():
    rows = []
    for causal in (False, True):
        for name in ("plain", "ws", "ws_pp_s3", "default"):
            row = {"head_dim": 64, "causal": causal, "seqlen": 8192, "variant": name, "spec": f"fwd_sm90_{name}",
                   "results": {"flashgen": _timed(1.0 if name != "plain" else 1.4, 5e11),
                               "sdpa_cudnn": _timed(1.1, 5e11)}}
            timing.add_ratios(row, "tflops", [("x_cudnn", "flashgen", "sdpa_cudnn")])
            rows.append(row)
    return ablation._result({"dtype": "bf16", "rounds": 3}, {}, rows, ["d=64 causal=False N=8192: ..."])


def _ab_result():
    settings = {"problem": "decode", "dtype": "bf16", "rounds": 7,
                "cands": {"default": {"text": "default"},
                          "c1": {"text": "decode_split_d128_m16_n64_w4_s3_causal_bf16_sm90a@slots"}}}
    rows = []
    for b, regime in ((1, "few"), (32, "many")):
        row = {"batch": b, "heads_q": 32, "heads_kv": 8, "L": 32768, "regime": regime,
               "results": {"default": {"tbps": 4.1}, "c1": {"tbps": 4.0}, "sdpa_cudnn": {"tbps": 4.05}}}
        timing.add_ratios(row, "tbps", [("default/cudnn", "default", "sdpa_cudnn"), ("c1/cudnn", "c1", "sdpa_cudnn")])
        rows.append(row)
    return ab._result(settings, {}, rows, ["default", "c1"], {"c1": "ok"})


def _host_result():
    rows = [{"entry": "attention", "call": "default", "spec": "fwd_sm90_x", "results": {"host": {"us": 16.9}}},
            {"entry": "attention", "call": "sdpa_flash", "spec": "", "results": {"host": {"us": 41.0}}},
            {"entry": "decode", "call": "split", "spec": "decode_split_x", "results": {"host": {"us": 17.0}}},
            {"entry": "decode parts", "call": "setup", "spec": "", "results": {"host": {"error": "AttributeError: x"}}}]
    return {"suite": "host", "meta": {}, "metric": "us", "precision": 2, "x": "call", "panels": ["entry"],
            "fields": ["spec"], "impls": ["host"], "rows": rows, "convention": "host"}


def _startup_result():
    rows = [{"cache": c, "phase": p, "results": {"first": {"s": v, "runs": [v]}}}
            for c, p, v in (("warm", "total", 0.22), ("warm", "part: build", 0.05), ("cold", "total", 1.44))]
    return {"suite": "startup", "meta": {}, "metric": "s", "precision": 3, "x": "phase", "panels": ["cache"],
            "impls": ["first"], "rows": rows, "convention": "startup"}


def _variants_result():
    rows = []
    for case, plain in (("window", 599.0), ("softcap_causal", 726.0), ("sinks", 714.0)):
        row = {"case": case, "head_dim": 128, "seqlen": 8192, "results": {
            "flashgen": _timed(1.0, 6.0e11), "flashgen_plain": _timed(1.0, plain * 1e9),
            "flex": {"skipped": "no sinks"} if case == "sinks" else _timed(2.0, 6.0e11)}}
        row["ratios"] = {"x_plain": 600.0 / plain, **({} if case == "sinks" else {"x_flex": 2.0})}
        rows.append(row)
    from flashgen.bench import variants

    def cell(us, tbps):
        return {"us": us, "rounds_us": [us, us * 1.01], "spread_pct": 1.0, "tbps": tbps, "splits": 11}

    decode = []
    for batch, plain in ((1, 4.1), (4, 4.4)):
        row = {"batch": batch, "L": 131072, "results": {"plain": cell(125.0, plain), "window": cell(5.2, 3.2),
                                                        "sinks": cell(126.0, 4.0),
                                                        "softcap": {"error": "RuntimeError: no softcap"},
                                                        "alibi": cell(126.0, 4.0), "alibi_mod": cell(127.0, 3.9)}}
        row["ratios"] = {"window_x_plain": 3.2 / plain, "sinks_x_plain": 4.0 / plain, "alibi_x_plain": 4.0 / plain,
                         "alibi_mod_x_plain": 3.9 / plain, "alibi_mod_x_builtin": 3.9 / 4.0}
        decode.append(row)
    return {"suite": "variants", "meta": {}, "metric": "tflops", "x": "case", "panels": ["head_dim"],
            "impls": ["flashgen", "flashgen_plain", "flex"], "ratios": ["x_plain", "x_flex"], "rows": rows,
            "convention": "variants", "sections": {"decode": variants.decode_section(decode, {"d": 128, "rounds": 5})}}


def _models_result():
    from flashgen.bench import models

    rows = []
    for case, tokens in (("prefill", 32768), ("train_packed", 16384), ("train_causal", 16384)):
        row = {"model": "llama 1.10B", "case": case, "tokens": tokens, "attn_flashgen": "20%", "attn_sdpa": "30%",
               "results": {"flashgen": {"ms": 100.0, "tok_s": tokens * 10.0}, "sdpa": {"ms": 120.0, "tok_s": tokens * 8.3},
                           "no_attention": {"ms": 80.0, "tok_s": tokens * 12.5}}}
        timing.add_ratios(row, "tok_s", [("x_sdpa", "flashgen", "sdpa")])
        rows.append(row)
    settings = {"impls": list(models.IMPLS), "rounds": 3, "batch": 8, "seqlen": 4096, "train_rows": 2,
                "train_seqlen": 8192, "docs": 4}
    return models._result(settings, {}, rows, ["prefill: flashgen vs sdpa last logits max |diff| 0.01"], 1_100_000_000)


SYNTHETIC = {"models": _models_result, "fwd": _fwd_result, "bwd": _bwd_result, "decode": _decode_result, "ablation": _ablation_result,
             "ab": _ab_result, "host": _host_result, "startup": _startup_result, "variants": _variants_result}


@pytest.mark.parametrize("suite", sorted(SYNTHETIC))
def test_each_suite_result_prints_saves_and_plots(suite, tmp_path, capsys):
    """A result of each timed suite's format: the table has its panels, x, columns and ratios; it survives
    save/load; `flashgen bench --plot-from` draws one axis per panel."""
    result = SYNTHETIC[suite]()
    assert result["suite"] == suite
    text = report.table(result)
    head = text.splitlines()[0].split()
    assert head[:len(result["panels"]) + 1] == [*result["panels"], result["x"]]
    for column in [*result["impls"], *result.get("ratios", [])]:
        assert column in head
    path = report.save(result, tmp_path / f"{suite}.json")
    assert report.load(path) == json.loads(json.dumps(result))
    pytest.importorskip("matplotlib")
    code, out, err = run_main(capsys, "bench", "--plot-from", str(path), "--out", str(tmp_path))
    assert code == 0, err
    assert (tmp_path / f"{suite}.png").read_bytes()[:4] == b"\x89PNG"
    assert f"({len(report.panels(result))} panels" in out


def test_fwd_table_shows_ratios_skips_and_errors():
    text = report.table(_fwd_result())
    line = text.splitlines()[2].split()
    # flashgen 1.0 ms against flash 1.5 ms and cuDNN 0.8 ms: x_flash 1.500, x_cudnn 0.800
    assert line[-2:] == ["1.500", "0.800"] and "skip" in line and "err" in line
    assert "x_flash / x_cudnn: flashgen over SDPA flash / cuDNN" in text and "RuntimeError: no" in text


def test_decode_table_has_sections_and_notes():
    text = report.table(_decode_result())
    assert "[paged]" in text and "[host]" in text and "0.987" in text and "decode_split_x" in text
    assert "x_cudnn over 2 cases: min 1.080" in text and "flashgen splits: b1/hk8/L4096: 16" in text
    assert "3.46" in text  # TB/s with two decimals


def test_variants_table_has_the_decode_section():
    """The variants suite's decode section: TB/s per variant (two decimals) per batch, each variant's ratio
    to the plain decode, its errors."""
    text = report.table(_variants_result())
    section = text[text.index("[decode]"):].splitlines()
    head = section[1].split()
    assert head[:2] == ["L", "batch"]
    assert head[2:9] == ["plain", "window", "sinks", "softcap", "alibi", "softcap_mod", "alibi_mod"]
    assert head[9:] == ["window_x_plain", "sinks_x_plain", "softcap_x_plain", "alibi_x_plain", "softcap_mod_x_plain",
                        "alibi_mod_x_plain", "softcap_mod_x_builtin", "alibi_mod_x_builtin"]
    first = section[3].split()
    assert first[:5] == ["131072", "1", "4.10", "3.20", "4.00"] and first[5] == "err" and first[6] == "4.00"
    assert "0.780" in first and "0.975" in first and "RuntimeError: no softcap" in text


def test_categorical_plot_has_one_tick_per_variant(tmp_path):
    """Names on x (the ablation's variants) give one tick each, in order, on every panel."""
    pytest.importorskip("matplotlib")
    result = _ablation_result()
    info = report.plot(result, tmp_path)
    assert info["axes"] == 2
    assert info["panels"] == ["head_dim=64, causal=False, seqlen=8192", "head_dim=64, causal=True, seqlen=8192"]


def test_ab_notes_group_by_regime():
    text = report.table(_ab_result())
    assert "c1 = decode_split_d128_m16_n64_w4_s3_causal_bf16_sm90a@slots (check: ok)" in text
    assert "few" in text and "many" in text and "all   (2 shapes)" in text


def test_result_without_numbers_is_not_plotted(tmp_path, capsys):
    """A result with "plot": false (sass) or no numeric cell: report.plot says why; --plot-from exits 2."""
    result = {"suite": "sass", "metric": "count", "x": "kernel", "panels": ["kind"], "impls": ["regs"], "plot": False,
              "rows": [{"kind": "fwd_v2", "kernel": "k", "results": {"regs": {"count": 96}}}]}
    assert "has no plot" in report.plottable(result)
    with pytest.raises(ValueError, match="has no plot"):
        report.plot(result, tmp_path)
    empty = {**result, "plot": True, "rows": [{"kind": "x", "kernel": "k", "results": {"regs": {"error": "e"}}}]}
    assert "no count values" in report.plottable(empty)
    assert "96" in report.table(result)
    path = report.save(result, tmp_path / "sass.json")
    code, _, err = run_main(capsys, "bench", "--plot-from", str(path), "--out", str(tmp_path))
    assert code == 2 and "has no plot" in err


# ---------------------------------------------------------------- sass, offline


SASS_SNIPPET = """
        Function : fwd_sm90_example
        /*0000*/                   LDC R1, c[0x0][0x28] ;                     /* 0x00000a00ff017b82 */
        /*0330*/                   @UP2 UIADD3 UR5, UR5, 0x1, URZ ;
        /*0690*/              @!P1 IMAD.IADD R0, R0, 0x1, -R5 ;
        /*1060*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT ;
        /*10d0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], R24 ;
        /*1100*/               @PT STL [R1], R2 ;
        /*0000*/ 	.byte	0xff, 0xff
"""


def test_sass_counts_opcodes_without_modifiers_or_predicates():
    counts = sass.sass_counts(SASS_SNIPPET)
    assert counts == {"HGMMA": 2, "IMAD": 1, "LDC": 1, "STL": 1, "UIADD3": 1, "total": 6}


def test_sass_kernel_list_covers_rules_and_tables():
    """Without compiling: the rules' specs of both archs and the shipped tables' (winners, baselines,
    runners-up), each once, with where it comes from."""
    from flashgen import families, gpus, tables

    found = sass.kernel_sources(("sm_80", "sm_90a"))
    names = {s.name for s in found}
    rule = families.rule_specs("sm_90a", gpus.ARCH_SMEM_PER_BLOCK["sm_90a"])
    assert {s.name for s in rule} <= names
    gpu = tables.shipped_gpus()[0]
    entry = next(iter(tables.load(tables.shipped_path(gpu), gpu=gpu).entries.values()))
    assert entry["spec"].name in names and f"table {gpu}" in found[entry["spec"]]
    assert {s.arch for s in found} == {"sm_80", "sm_90a"}
    assert all(s.arch == "sm_80" for s in sass.kernel_sources(("sm_80",)))


def test_sass_suite_compiles_offline_and_compares(tmp_path, capsys):
    """`bench sass --kernels` compiles with NVRTC (no GPU), records the ptxas report and the cubin's
    hash; --compare against its own output says "same"; a changed hash or report is reported, and
    --strict turns a change into exit status 1."""
    names = ["fwd_v2_d64_m64_n64_w4_s2_full_fp16_sm80", "decode_split_d64_m16_n64_w4_s4_causal_bf16_sm80"]
    first = tmp_path / "first"
    code, out, err = run_main(capsys, "bench", "sass", "--kernels", ",".join(names), "--out", str(first))
    assert code == 0, err
    result = report.load(first / "sass.json")
    rows = {r["kernel"]: r for r in result["rows"]}
    assert set(rows) == set(names)
    for r in rows.values():
        assert r["report"]["registers"] > 0 and len(r["sha256"]) == 64 and r["results"]["regs"]["count"] > 0
        assert r["report"]["problems"] == []
    assert "regs" in out and names[0] in out and "no plot" in err
    if result["disassembler"]:  # a cuobjdump / nvdisasm here: the mma.sync kernels' SASS has HMMA
        assert rows[names[0]]["sass"]["HMMA"] > 0 and "HMMA" in result["impls"]

    code, out, err = run_main(capsys, "bench", "sass", "--kernels", ",".join(names), "--out", str(tmp_path / "again"),
                              "--compare", str(first), "--strict")
    assert code == 0, err
    again = report.load(tmp_path / "again" / "sass.json")
    assert {r["compare"] for r in again["rows"]} == {"same"} and again["compare"]["same"] == 2

    edited = json.loads((first / "sass.json").read_text())
    edited["rows"][0]["sha256"] = "0" * 64
    edited["rows"][1]["sha256"] = "0" * 64
    edited["rows"][1]["report"]["registers"] += 8
    edited["rows"].append({**edited["rows"][0], "kernel": "fwd_v2_gone_kernel"})
    old = tmp_path / "old.json"
    old.write_text(json.dumps(edited))
    code, out, err = run_main(capsys, "bench", "sass", "--kernels", ",".join(names), "--out", str(tmp_path / "third"),
                              "--compare", str(old), "--strict")
    assert code == 1, err
    third = {r["kernel"]: r["compare"] for r in report.load(tmp_path / "third" / "sass.json")["rows"]}
    assert third[edited["rows"][0]["kernel"]] == "different (report same)"
    assert third[edited["rows"][1]["kernel"]].startswith("different (report differs: registers")
    assert "gone since then (1): fwd_v2_gone_kernel" in out


# ---------------------------------------------------------------- on a GPU, tiny sizes


def _gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch


GPU_RUNS = {
    "fwd": ["--d", "64", "--seqlens", "256", "--causal", "yes", "--rounds", "2", "--budget", "0.01",
            "--impls", "flashgen,flashgen_fwd_v2,sdpa_flash,sdpa_cudnn", "--memory-seqlens", "4096"],
    "bwd": ["--d", "64", "--seqlens", "256", "--causal", "no", "--rounds", "2", "--budget", "0.01", "--mode", "both",
            "--impls", "flashgen,flashgen_det,flashgen_bwd_dkdv,sdpa_flash"],
    "decode": ["--cases", "1,8,8,1024;2,8,2,2048", "--rounds", "2", "--reps", "3", "--paged-cases", "1,8,2,2048",
               "--split-cases", "1,8,2,2048", "--splits", "1,4"],
    "ab": ["--cands", "default", "--shapes", "1,2,256,64,1", "--rounds", "2", "--budget", "0.01"],
    "host": ["--calls", "5", "--rounds", "2", "--warmup", "5"],
    "startup": ["--runs", "1", "--shape", "1,2,128,64"],
    "models": ["--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--intermediate", "512",
               "--vocab", "1000", "--batch", "2", "--seqlen", "256", "--train-rows", "1", "--train-seqlen", "512",
               "--rounds", "1", "--budget", "0.01"],
}


@pytest.mark.gpu
@pytest.mark.parametrize("suite", sorted(GPU_RUNS))
def test_suite_runs_on_the_gpu(suite, tmp_path, capsys):
    """Each timed suite end to end at tiny sizes: exit 0, JSON in the shared format with numbers in it."""
    _gpu()
    code, out, err = run_main(capsys, "bench", suite, "--out", str(tmp_path), "--no-plot", *GPU_RUNS[suite])
    assert code == 0, err
    result = report.load(tmp_path / f"{suite}.json")
    values = [c.get(result["metric"]) for r in result["rows"] for c in r["results"].values()]
    assert any(isinstance(v, float) and v > 0 for v in values), result["rows"]
    assert not (tmp_path / f"{suite}.partial.json").exists()


@pytest.mark.gpu
def test_ablation_runs_on_hopper(tmp_path, capsys):
    torch = _gpu()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fwd_sm90 needs sm_90a")
    code, out, err = run_main(capsys, "bench", "ablation", "--out", str(tmp_path), "--no-plot", "--d", "64",
                              "--seqlens", "512", "--causal", "no", "--variants", "plain,ws", "--rounds", "2",
                              "--budget", "0.01")
    assert code == 0, err
    result = report.load(tmp_path / "ablation.json")
    assert [r["variant"] for r in result["rows"]] == ["plain", "ws", "default"]
    assert all("x_cudnn" in r.get("ratios", {}) for r in result["rows"])


def test_ab_split_words():
    """A decode candidate's '@' word: a count as given, 'h' the heuristic (None), c<N> about N CTAs over
    the batch x KV heads x m-blocks groups (b2 x hk8 x one m-block: 16 groups)."""
    assert ab.parse_candidate("default@c256", "decode", "bf16") == (None, "c256")
    assert ab._splits_for("c256", None, 2, 32, 8, None) == 16
    assert ab._splits_for("c4", None, 2, 32, 8, None) == 1
    assert ab._splits_for("12", None, 2, 32, 8, None) == 12
    assert ab._splits_for("h", None, 2, 32, 8, None) is None and ab._splits_for(None, None, 2, 32, 8, None) is None


def test_bwd_dkdv_columns():
    """--dkdv: each named dK/dV kernel is a 'dkdv:NAME' column after --impls, prebuilt with the cells'
    kernels; in a cell of another head-dim tile or causal flag it is skipped with the reason."""
    from types import SimpleNamespace

    names = "bwd_sm90_d128_m64_n128_w12_s2_dq2_causal_bf16_sm90a,bwd_sm90_d256_m64_n64_w12_s2_dq1_full_bf16_sm90a"
    args = SimpleNamespace(impls="flashgen,sdpa_cudnn", dtype="bf16", rounds=2, budget=0.1, d="128,256",
                           seqlens="2048", causal="both", mode="fwd+bwd", no_fwd_split=False, kernels=False,
                           dkdv=names + "," + names.split(",")[0])
    settings = bwd.parse(args)
    assert settings["impls"] == ["flashgen", "sdpa_cudnn"] + [f"dkdv:{n}" for n in names.split(",")]

    class Dev:
        arch, gpu, smem_budget = "sm_90a", "h200", 232448

    built = bwd.prebuild_specs(settings, Dev())
    assert {s.name for s in built} >= set(names.split(","))
    torch = pytest.importorskip("torch")
    tensors = tuple(torch.empty(1, 16, 2048, 128, device="meta") for _ in range(4))
    makers, forwards = bwd._makers(settings, Dev(), "fwd+bwd", tensors, 128, False, 2048)
    assert set(makers) == set(settings["impls"]) and set(forwards) == {"flashgen", "sdpa_cudnn"}
    with pytest.raises(timing.Skipped, match="not this cell's kernel"):
        makers["dkdv:" + names.split(",")[0]]()  # causal kernel, non-causal cell



def test_mods_cases_take_a_block_mask_per_batch_where_the_mask_reads_b():
    """The mods suite's cases: each traces on the CPU; a case whose mask_mod reads b (prefix-LM, one prefix length
    per batch) is marked per_batch, so that its block masks (flashgen's and FlexAttention's) are made per batch, and
    no other is; the prefix-LM mask shows each batch's prefix and the causal part."""
    import torch

    from flashgen import mods
    from flashgen.bench import mods as suite

    for case in suite.CASES:
        score_mod, mask_mod, _, _ = suite.case_mods(suite.Case(case.name, 64, 2, 2, 2, case.per_batch), "cpu")
        graph = mods.trace_mask_mod(mask_mod, allow_cpu=True)
        assert case.per_batch == ("b" in graph.uses), case
    _, prefix_lm, _, _ = suite.case_mods(suite.Case("prefix", 8192, 2, 2, 2, True), "cpu")
    b, q, kv = (torch.arange(2).view(2, 1, 1), torch.arange(8192).view(1, -1, 1), torch.arange(8192).view(1, 1, -1))
    got = mods.trace_mask_mod(prefix_lm, allow_cpu=True).evaluate(None, b, 0, q, kv)
    want = (kv <= torch.tensor(suite.PREFIXES).view(2, 1, 1)) | (q >= kv)
    assert torch.equal(got, want)
