"""Tuning on first use (``FLASHGEN_AUTOTUNE``, ``flashgen.autotune``) on a CPU: the torch layer's side
(``flashgen.api.autotune``: when a search may run) with a fake search, and the tuner's search
(``flashgen.tuner.autotune``) with a fake kernel, a fake timer and a fake clock."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

import flashgen  # noqa: E402 -- (registers the first-use search)
from flashgen import dispatch, gpus, tables  # noqa: E402
from flashgen.api import autotune as first_use  # noqa: E402
from flashgen.codegen import Report  # noqa: E402
from flashgen.errors import ConfigError  # noqa: E402
from flashgen.problem import ProblemKey  # noqa: E402
from flashgen.tuner import autotune, space  # noqa: E402
from flashgen.tuner.objective import MeasuredObjective  # noqa: E402

pytestmark = pytest.mark.shared_kernels

H200 = gpus.get("h200")
# A key the shipped H200 table has no entry for (head dim 96), at an odd GQA shape.
KEY = ProblemKey("fwd", "sm_90a", "bf16", 96, True, 2048)
SHAPE = (3, 24, 8, 1999, 1999, 88)
DEV = SimpleNamespace(gpu="h200", index=0)


@pytest.fixture
def fresh():
    """Autotune state and dispatch's caches as a new process has them; the package's search put back."""
    search = dispatch.first_use_search()
    first_use.clear()
    dispatch.clear()
    yield
    first_use.clear()
    dispatch.clear()
    dispatch.set_first_use_search(search)


def _default():
    return dispatch.select(KEY, "h200", H200.smem_per_block)


def _fake_search(calls, winner=None):
    def search(request):
        calls.append(request)
        return winner
    return search


def test_off_by_default_and_switched_by_the_variable_and_the_call(fresh, monkeypatch):
    calls = []
    dispatch.set_first_use_search(_fake_search(calls, _default()))
    assert first_use.tuned_spec(KEY, SHAPE, DEV, _default()) is None and not calls
    monkeypatch.setenv("FLASHGEN_AUTOTUNE", "1")
    assert first_use.enabled()
    flashgen.autotune(False)  # the call wins over the variable
    assert not first_use.enabled() and first_use.tuned_spec(KEY, SHAPE, DEV, _default()) is None and not calls
    flashgen.autotune(None)
    assert first_use.tuned_spec(KEY, SHAPE, DEV, _default()) == _default()
    assert len(calls) == 1 and calls[0].shape == SHAPE and calls[0].budget_s == 30.0
    with pytest.raises(TypeError):
        flashgen.autotune("yes")


@pytest.mark.parametrize("value", ["0", "-3", "inf", "soon"])
def test_a_bad_budget_is_a_config_error(fresh, monkeypatch, value):
    monkeypatch.setenv("FLASHGEN_AUTOTUNE_BUDGET", value)
    from flashgen import settings

    with pytest.raises(ConfigError, match="FLASHGEN_AUTOTUNE_BUDGET"):
        settings.autotune_budget()


def test_no_search_for_a_key_with_an_entry_an_unknown_gpu_or_while_tracing(fresh, monkeypatch):
    import torch

    calls = []
    dispatch.set_first_use_search(_fake_search(calls, _default()))
    flashgen.autotune(True)
    shipped = ProblemKey("fwd", "sm_90a", "bf16", 128, True, 4096)  # the shipped table has it
    assert tables.lookup("h200", shipped) is not None
    assert first_use.tuned_spec(shipped, (4, 16, 16, 4096, 4096, 128), DEV, _default()) is None
    assert first_use.tuned_spec(KEY, SHAPE, SimpleNamespace(gpu=None, index=0), _default()) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert first_use.tuned_spec(KEY, SHAPE, DEV, _default()) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert first_use.tuned_spec(KEY, SHAPE, DEV, _default()) is None
    assert not calls
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert first_use.tuned_spec(KEY, SHAPE, DEV, _default()) == _default()  # the next plain call tunes it


def test_the_search_leaves_the_callers_random_stream_alone(fresh):
    import torch

    flashgen.autotune(True)
    def search(request):  # draws random inputs, as the measured search does
        torch.randn(1000)
        return _default()

    dispatch.set_first_use_search(search)
    torch.manual_seed(7)
    assert first_use.tuned_spec(KEY, SHAPE, DEV, _default()) == _default()
    after_search = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after_search, torch.rand(3))


def test_a_search_inside_a_search_and_a_failed_search_fall_back_to_the_rule(fresh, monkeypatch, caplog):
    flashgen.autotune(True)
    inner = []

    def search(request):  # the search's own checks call attention: no second search starts there
        inner.append(first_use.tuned_spec(KEY.replace(bucket=512), SHAPE, DEV, _default()))
        raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED (fake)")

    dispatch.set_first_use_search(search)
    with caplog.at_level(logging.WARNING, logger="flashgen"):
        assert first_use.tuned_spec(KEY, SHAPE, DEV, _default()) is None
    assert inner == [None]
    assert "the search for" in caplog.text and "CUDA_ERROR_LAUNCH_FAILED" in caplog.text
    dispatch.set_first_use_search(_fake_search(inner))
    assert first_use.tuned_spec(KEY, SHAPE, DEV, _default()) is None and len(inner) == 1  # not searched again


# -- the tuner's search, with fakes -----------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _objective(clock, seconds_per_timing, times, wrong=()):
    clean = SimpleNamespace(report=Report(registers=168, spill_stores=0, spill_loads=0, stack_frame=0,
                                          static_smem=0))
    timed = []

    def timer(key, spec):
        clock.now += seconds_per_timing
        timed.append((key, spec, space.measured_shape(key, obj.shapes)))
        return times(spec)

    obj = MeasuredObjective(H200, build=lambda spec: clean,
                            check=lambda spec: "max error 1 > 0.01 (fake)" if spec in wrong else "", timer=timer)
    return obj, timed


def _request(budget=30.0):
    return first_use.FirstUse(KEY, SHAPE, "h200", 0, _default(), budget)


def test_the_search_stores_a_faster_passing_winner_that_dispatch_then_serves(fresh, caplog):
    default = _default()
    short = autotune.shortlist(KEY, SHAPE, H200, default)
    assert len(short) == autotune.TOP and default not in short
    fastest, wrong = short[-1], short[0]
    times = {default: 2.0, fastest: 1.5, wrong: 1.0}  # the fastest one computes wrong results
    clock = Clock()
    obj, timed = _objective(clock, 0.1, lambda s: times.get(s, 1.8), wrong={wrong})
    with caplog.at_level(logging.WARNING, logger="flashgen"):
        spec = autotune.search(_request(), objective=obj, clock=clock, compile_all=lambda specs, timeout: set(specs))
    assert spec == fastest
    assert {shape for _, _, shape in timed} == {SHAPE}  # timed at the call's shape
    entry = tables.load(tables.default_path("h200"), gpu="h200").entries[KEY]
    assert entry["spec"] == fastest and entry["source"] == "measured" and entry["failures"] == {"wrong": 1}
    assert entry["baseline"]["spec"] == default and entry["speedup"] == pytest.approx(2.0 / 1.5)
    assert "stored in" in caplog.text and "1.33x the default rule" in caplog.text
    dispatch.clear()  # a later process: dispatch reads the winner from the user's table
    assert dispatch.select(KEY, "h200", H200.smem_per_block) == fastest


def test_the_search_keeps_the_default_rule_when_nothing_beats_it(fresh):
    clock = Clock()
    obj, _ = _objective(clock, 0.1, lambda s: 1.0 if s == _default() else 1.3)
    spec = autotune.search(_request(), objective=obj, clock=clock, compile_all=lambda specs, timeout: set(specs))
    assert spec == _default()
    assert tables.lookup("h200", KEY) == _default()


def test_the_search_starts_no_candidate_that_would_end_past_its_budget(fresh):
    """Each evaluation takes 3 fake seconds: with a budget of 10 s the default rule and two candidates run
    (0-3, 3-6, 6-9 s); a third would end at 12 s, and the confirm rounds do not fit either."""
    clock = Clock()
    default = _default()
    obj, timed = _objective(clock, 3.0, lambda s: 1.0 + s.block_n / 1000)
    autotune.search(_request(budget=10.0), objective=obj, clock=clock, compile_all=lambda specs, timeout: set(specs))
    screened = [spec for _, spec, _ in timed]
    assert len(screened) == 3 and screened[0] == default and clock.now - 100.0 <= 10.0
    entry = tables.load(tables.default_path("h200"), gpu="h200").entries[KEY]
    assert entry["trials"] == 3 and entry["candidates"] == 1 + autotune.TOP


def test_candidates_not_compiled_within_the_budget_are_not_measured(fresh):
    clock = Clock()
    default = _default()
    short = autotune.shortlist(KEY, SHAPE, H200, default)
    obj, timed = _objective(clock, 0.1, lambda s: 1.0)
    autotune.search(_request(), objective=obj, clock=clock, compile_all=lambda specs, timeout: {short[2]})
    assert {spec for _, spec, _ in timed} == {default, short[2]}


def test_the_compile_step_returns_what_built_in_time(monkeypatch):
    import threading

    release = threading.Event()
    default = _default()
    fast, slow, broken = autotune.shortlist(KEY, SHAPE, H200, default)[:3]

    def build(spec):
        if spec == broken:
            raise RuntimeError("NVRTC failed (fake)")
        if spec == slow:
            release.wait(5)

    monkeypatch.setattr(autotune, "build", build)
    try:
        assert autotune.compile_in_time([fast, slow, broken], 0.3) == {fast}
    finally:
        release.set()
