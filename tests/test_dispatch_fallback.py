"""The default rule's spill fallback (families.default_spec / dispatch.select with verify=True), on CPU.

A tile the device's NVRTC compiles spill-free may spill under another NVRTC
(docs/perf/toolchain.md, the register cliff): dispatch then takes the rule's
next tile. These tests replace the compiler with a fake, so nothing is compiled.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from flashgen import dispatch, families, gpus
from flashgen.codegen.compiler import Report
from flashgen.errors import CompileError
from flashgen.problem import ProblemKey
from flashgen.spec import KernelSpec

H200_SMEM = gpus.ARCH_SMEM_PER_BLOCK["sm_90a"]
KEY = ProblemKey("fwd", "sm_90a", "bf16", 128, False, 2048)
FAMILY = "fwd_v2"  # the forward restricted to fwd_v2: a rule of several tiles


@pytest.fixture(autouse=True)
def fresh_select():
    dispatch.clear()
    yield
    dispatch.clear()


def _candidates(key, family=FAMILY):
    """The rule's fitting tiles for ``key`` (of ``family``'s rule), in order (what the fallback walks)."""
    seen = []
    refuse_all = lambda spec: seen.append(spec) or ["refused"]  # noqa: E731
    last = families.default_spec(key, H200_SMEM, check=refuse_all, family=family)
    return seen + [last]


def test_without_check_the_first_fitting_tile_wins():
    cands = _candidates(KEY)
    assert len(cands) >= 2
    assert cands == families.family(FAMILY).rule(KEY, H200_SMEM)  # the walk is the rule's order
    assert families.default_spec(KEY, H200_SMEM, family=FAMILY) == cands[0]
    assert families.default_spec(KEY, H200_SMEM, check=lambda s: [], family=FAMILY) == cands[0]


def test_a_refused_tile_is_skipped_with_a_debug_log(caplog):
    cands = _candidates(KEY)
    first = cands[0]
    with caplog.at_level(logging.DEBUG, logger="flashgen"):
        got = families.default_spec(KEY, H200_SMEM, family=FAMILY,
                                    check=lambda s: ["spills: 8 B stored, 8 B loaded"] if s == first else [])
    assert got == cands[1]
    assert first.name in caplog.text and "spills" in caplog.text


def test_the_last_tile_is_returned_unchecked():
    cands = _candidates(KEY)
    checked = []
    got = families.default_spec(KEY, H200_SMEM, check=lambda s: checked.append(s) or ["refused"], family=FAMILY)
    assert got == cands[-1]
    assert checked == cands[:-1]  # the last is never checked: load() reports its problems


@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_v1_baseline_falls_back_to_a_smaller_tile(d):
    """fwd_v1's rule keeps the paper's tile first and every other fitting tile after it (the H200 image's
    NVRTC spills m128 n128 w8 at d = 128): a refused first tile gives the next, still in budget."""
    key = ProblemKey("fwd_v1", "sm_90a", "bf16", d, False, 2048)
    rule = families.family("fwd_v1").rule(key, H200_SMEM)
    assert len(rule) >= 2 and len(set(rule)) == len(rule)
    assert all(s.smem_bytes() <= H200_SMEM for s in rule)
    got = families.default_spec(key, H200_SMEM, check=lambda s: ["spills: 16 B stored"] if s == rule[0] else [])
    assert got == rule[1] and got != rule[0]


def test_single_tile_rules_are_never_compiled():
    key = ProblemKey("bwd_preprocess", "sm_90a", "bf16", 128, False, 2048)
    calls = []
    families.default_spec(key, H200_SMEM, check=lambda s: calls.append(s) or ["x"])
    assert calls == []


def test_select_verify_falls_back_once_per_process(monkeypatch):
    cands = _candidates(KEY)
    calls = []

    def fake(spec):
        calls.append(spec)
        return ["spills: 4 B stored, 4 B loaded"] if spec == cands[0] else []

    monkeypatch.setattr(dispatch, "resource_problems", fake)
    assert dispatch.select(KEY, None, H200_SMEM, verify=True, family=FAMILY) == cands[1]
    assert dispatch.select(KEY, None, H200_SMEM, verify=True, family=FAMILY) == cands[1]
    assert calls == cands[:2]  # cached: the second select compiles nothing
    assert dispatch.select(KEY, None, H200_SMEM, family=FAMILY) == cands[0]  # without verify: the rule as written


# The problem's default family there (bwd_sm90, two tiles at d=64), and the mma.sync kernel's rule.
@pytest.mark.parametrize("family,d", [(None, 64), ("bwd_dkdv", 128)])
def test_select_verify_applies_to_the_backward_rule(monkeypatch, family, d):
    key = ProblemKey("bwd_dkdv", "sm_90a", "bf16", d, True, 2048)
    cands = _candidates(key, family)
    assert {s.kind for s in cands} == {family or families.default_family(key)}
    if len(cands) < 2:
        pytest.skip("this rule has a single tile")
    monkeypatch.setattr(dispatch, "resource_problems", lambda s: ["stack frame of 8 B"] if s == cands[0] else [])
    assert dispatch.select(key, None, H200_SMEM, verify=True, family=family) == cands[1]


def _fake_build(report=None, exc=None):
    def build(spec):
        if exc is not None:
            raise exc
        return SimpleNamespace(report=report)
    return build


def test_resource_problems_reads_the_ptxas_report(monkeypatch):
    spec = families.default_spec(KEY, H200_SMEM, family=FAMILY)
    # dispatch compiles through the codegen build it imported (flashgen.codegen.build)
    spilling = Report(registers=255, spill_stores=20, spill_loads=20, stack_frame=24, static_smem=0)
    monkeypatch.setattr(dispatch, "build", _fake_build(spilling))
    problems = dispatch.resource_problems(spec)
    assert any("spills" in p for p in problems) and any("stack" in p for p in problems)
    clean = Report(registers=240, spill_stores=0, spill_loads=0, stack_frame=0, static_smem=0)
    monkeypatch.setattr(dispatch, "build", _fake_build(clean))
    assert dispatch.resource_problems(spec) == []
    # A build that fails outright is not a reason to fall back (load() reports it).
    monkeypatch.setattr(dispatch, "build", _fake_build(exc=CompileError("nvrtc failed")))
    assert dispatch.resource_problems(spec) == []


def test_a_tuned_entry_that_spills_here_falls_back_to_the_rule(monkeypatch, caplog):
    """A table tuned under another NVRTC may hold a tile this toolchain spills (seen on the H200 with
    the shipped d=128 causal entry): with verify, the default rule serves instead of a refused load;
    without verify, the table's entry is returned as written."""
    from flashgen import tables

    key = ProblemKey("fwd", "sm_90a", "bf16", 128, True, 4096)
    tuned = KernelSpec(kind="fwd_v2", arch="sm_90a", dtype="bf16", head_dim=128, block_m=128,
                       block_n=64, warps=4, stages=2, refill=2, causal=True)
    rule = families.default_spec(key, H200_SMEM)
    assert rule != tuned
    monkeypatch.setattr(tables, "lookup_entry", lambda gpu, k: ("user", {"spec": tuned}) if k == key else None)
    monkeypatch.setattr(dispatch, "resource_problems", lambda s: ["spills: 32 B stored"] if s == tuned else [])
    with caplog.at_level(logging.WARNING, logger="flashgen"):
        assert dispatch.select(key, "h200", H200_SMEM, verify=True) == rule
    assert tuned.name in caplog.text and "spills" in caplog.text
    assert dispatch.select(key, "h200", H200_SMEM) == tuned
    monkeypatch.setattr(dispatch, "resource_problems", lambda s: [])
    dispatch.clear()
    assert dispatch.select(key, "h200", H200_SMEM, verify=True) == tuned  # a clean entry is used as tuned


def _entry(spec, baseline, runners=(), speedup=None):
    entry = {"spec": spec, "baseline": {"spec": baseline, "time_ms": 1.0},
             "runners_up": [{"spec": r, "time_ms": 1.1} for r in runners]}
    if speedup is not None:
        entry["speedup"] = speedup
    return entry


def test_an_entry_that_only_confirmed_an_old_rule_gives_way_to_the_rule(monkeypatch):
    """A backward key's entry whose winner was its baseline (the default rule of its day) serves until the
    rule moves; then the rule serves, for the key and for its variants (which take the plain key's tile),
    unless the entry recorded the new pick as beaten. So does an entry that beat its baseline inside the
    tuner's noise (dispatch.CONFIRMED_WITHIN). An entry that beat its baseline beyond it stays, or that does not
    say by how much, and so does a forward key's, whose baseline is the paper rule."""
    from flashgen import tables

    key = ProblemKey("bwd_dkdv", "sm_90a", "bf16", 64, False, 8192)
    rule = families.default_spec(key, H200_SMEM)
    old = rule.replace(block_m=64, stages=3, dq_write=0).validate()  # the rule before the 128-query step
    assert old != rule
    entries = {key: _entry(old, old)}
    monkeypatch.setattr(tables, "lookup_entry", lambda gpu, k: ("shipped", entries[k]) if k in entries else None)
    assert dispatch.superseded_by(key, entries[key], H200_SMEM) == rule
    assert dispatch.select(key, "h200", H200_SMEM) == rule
    win = key.replace(variant="win")
    assert dispatch.select(win, "h200", H200_SMEM) == families.default_spec(win, H200_SMEM)
    near = _entry(old, old.replace(stages=2), speedup=1.004)
    assert dispatch.superseded_by(key, near, H200_SMEM) == rule
    for entry in (_entry(rule, rule), _entry(old, old, runners=[rule]), _entry(old, old.replace(stages=2)),
                  _entry(old, old.replace(stages=2), speedup=dispatch.CONFIRMED_WITHIN),
                  _entry(old, old.replace(stages=2), runners=[rule], speedup=1.004), _entry(old, rule, speedup=1.004)):
        entries[key] = entry
        dispatch.clear()
        assert dispatch.superseded_by(key, entry, H200_SMEM) is None
        assert dispatch.select(key, "h200", H200_SMEM) == entry["spec"]
    fwd = ProblemKey("fwd", "sm_90a", "bf16", 128, False, 2048)
    paper = KernelSpec(kind="fwd_v2", arch="sm_90a", dtype="bf16", head_dim=128, block_m=128, block_n=64, warps=4,
                       stages=2, refill=2)
    assert families.default_spec(fwd, H200_SMEM) != paper
    assert dispatch.superseded_by(fwd, _entry(paper, paper), H200_SMEM) is None


def test_backward_key_kinds_are_the_tuners():
    from flashgen import tables
    from flashgen.tuner import space

    assert tables.BACKWARD_KEY_KINDS == tuple(space.BWD_KEY_MODES)
    assert space.baseline_label(ProblemKey("bwd_dq", "sm_80", "bf16", 64, False, 2048)) == "default-rule"
    assert space.baseline_label(ProblemKey("fwd", "sm_90a", "bf16", 64, False, 2048, "fp8")) == "default-rule"
    assert space.baseline_label(ProblemKey("fwd", "sm_90a", "bf16", 64, False, 2048)) == "paper-rule"


def test_a_variant_does_not_ride_on_a_tuned_128_query_tile(monkeypatch):
    """128 queries a step serves plain backward keys only (bwd_sm90 refuses it with a variant or mods): a
    variant key whose plain key has a tuned 128-query entry takes the default rule's tile instead."""
    from flashgen import tables

    key = ProblemKey("bwd_dkdv", "sm_90a", "bf16", 64, True, 4096)
    wide = families.default_spec(key, H200_SMEM)
    assert wide.block_m == 128
    monkeypatch.setattr(tables, "lookup_entry", lambda gpu, k: ("user", {"spec": wide}) if k == key else None)
    assert dispatch.select(key, "h200", H200_SMEM) == wide
    for variant in ("win", "cap", "alibi", "sink", "vl"):
        with pytest.raises(ValueError, match="plain keys only"):
            wide.with_tokens(variant).validate()
        vkey = key.replace(variant=variant)
        picked = dispatch.select(vkey, "h200", H200_SMEM)
        assert picked == families.default_spec(vkey, H200_SMEM) and picked.block_m == 64, picked.name
