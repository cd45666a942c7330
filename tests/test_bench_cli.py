"""`flashgen bench` and `flashgen explain` without a GPU: plots from a stored result, the table, the
suite registry, argument errors; and `algorithm=` validation in flashgen.attention."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashgen.bench import SUITES, Suite, register, report, suites

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
    (["explain", "--gpu", "h200", "--d", "100", "--seqlen", "4096"], "multiples of 8"),
    (["explain", "--gpu", "h200", "--d", "64", "--seqlen", "0"], "positive"),
])
def test_cli_errors_are_clean(capsys, argv, message):
    """Bad values exit 2 with a one-line 'flashgen: error: ...' and no traceback, before touching a GPU."""
    code, _, err = run_main(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err


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
    """fwd is registered; another suite registers the same way; a name is taken once."""
    assert "fwd" in suites()
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
