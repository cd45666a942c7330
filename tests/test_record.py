"""Recording the problem keys a process dispatches (``flashgen.record``, ``FLASHGEN_RECORD``: the shapes
file of ``flashgen.shapes``) and tuning them (``flashgen tune --from``), on a CPU: the torch layer's calls are
stood in for by ``shapes.note`` (what each entry point calls), the GPU by a fake timer."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

from flashgen import gpus, shapes, tables
from flashgen.errors import ConfigError
from flashgen.problem import ProblemKey

FWD = ProblemKey("fwd", "sm_90a", "bf16", 128, True, 4096)
FWD64 = ProblemKey("fwd", "sm_90a", "bf16", 64, False, 1024)
BWD = ProblemKey("bwd_dkdv", "sm_90a", "bf16", 128, True, 4096)
DECODE = ProblemKey("decode_split", "sm_90a", "bf16", 128, True, 4096)
GQA = (2, 32, 8, 3001, 3001, 128)  # 32 query heads over 8 KV heads, an odd length in the 4096 bucket


def test_record_counts_calls_and_a_second_run_adds_to_the_file(tmp_path):
    path = tmp_path / "shapes.yaml"
    with shapes.record(path):
        for _ in range(3):
            shapes.note(FWD, GQA)
        shapes.note(FWD64, (1, 16, 16, 999, 999, 64))
    shapes.note(FWD, GQA)  # after the block: not counted
    assert shapes.load(path) == {(FWD, GQA): 3, (FWD64, (1, 16, 16, 999, 999, 64)): 1}
    with shapes.record(path) as recorder:
        shapes.note(FWD, GQA)
        shapes.note(DECODE, (8, 32, 8, 1, 4096, 128))
        assert recorder.counts == {(FWD, GQA): 1, (DECODE, (8, 32, 8, 1, 4096, 128)): 1}
    assert shapes.load(path) == {(FWD, GQA): 4, (FWD64, (1, 16, 16, 999, 999, 64)): 1,
                                 (DECODE, (8, 32, 8, 1, 4096, 128)): 1}
    assert not shapes.ACTIVE


def test_by_key_takes_each_keys_most_called_shape_and_sums_its_calls():
    other = (4, 32, 8, 2500, 2500, 128)
    picked = shapes.by_key({(FWD, GQA): 5, (FWD, other): 2, (BWD, GQA): 1})
    assert picked == {FWD: (GQA, 7), BWD: (GQA, 1)}


def _write_counts(args):
    path, n = args
    for _ in range(n):
        shapes.update(path, {(FWD, GQA): 1})


def test_concurrent_writers_lose_no_count(tmp_path):
    """Each writer merges under the folder's lock: 4 processes x 5 writes = 20 calls."""
    path = str(tmp_path / "shapes.yaml")
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(_write_counts, [(path, 5)] * 4)
    assert shapes.load(path) == {(FWD, GQA): 20}


@pytest.mark.parametrize("text,why", [
    ("meta: {format: 1, source: record}\nentries: {}\n", "entries must be a list"),
    ("meta: {format: 2, source: record}\nentries: []\n", "meta must be"),
    ("meta: {format: 1, source: record}\nentries:\n- key: {kind: fwd, arch: sm_90a, dtype: bf16, head_dim: 128, "
     "causal: true, bucket: 4000}\n  shape: {batch: 1, heads: 2, heads_kv: 2, seqlen_q: 5, seqlen_k: 5, "
     "head_dim: 128}\n  count: 1\n", "bucket"),
    ("meta: {format: 1, source: record}\nentries:\n- key: {kind: fwd, arch: sm_90a, dtype: bf16, head_dim: 128, "
     "causal: true, bucket: 4096}\n  shape: {batch: 1, heads: 3, heads_kv: 2, seqlen_q: 5, seqlen_k: 5, "
     "head_dim: 128}\n  count: 1\n", "multiple of heads_kv"),
    ("meta: {format: 1, source: record}\nentries:\n- key: {kind: fwd, arch: sm_90a, dtype: bf16, head_dim: 64, "
     "causal: true, bucket: 4096}\n  shape: {batch: 1, heads: 2, heads_kv: 2, seqlen_q: 5, seqlen_k: 5, "
     "head_dim: 128}\n  count: 1\n", "does not fit"),
    ("meta: {format: 1, source: record}\nentries:\n- key: {kind: fwd, arch: sm_90a, dtype: bf16, head_dim: 128, "
     "causal: true, bucket: 4096}\n  shape: {batch: 1, heads: 2, heads_kv: 2, seqlen_q: 5, seqlen_k: 5, "
     "head_dim: 128}\n  count: true\n", "count"),
    ("a: &x [1, 2]\nb: *x\n", "aliases"),
    ("meta: [unclosed\n", "not valid YAML"),
])
def test_a_bad_shapes_file_is_refused_with_its_reason(tmp_path, text, why):
    path = tmp_path / "shapes.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=why):
        shapes.load(path)
    with pytest.raises(ConfigError):  # and recording into it refuses before the run, not at its end
        with shapes.record(path):
            pass


def test_tune_from_a_bad_or_missing_shapes_file_is_one_line_and_exit_2(tmp_path, capsys):
    from flashgen.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("meta: {format: 1, source: record}\nentries: 3\n")
    for path in (bad, tmp_path / "missing.yaml", tmp_path):
        assert main(["tune", "--gpu", "h200", "--from", str(path), "--model", "--out", str(tmp_path / "t.yaml")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("flashgen: error:") and "Traceback" not in err
    assert main(["tune", "--gpu", "h200", "--from", str(bad), "--d", "64", "--model"]) == 2
    assert "--d do not apply" in capsys.readouterr().err
    only_decode = tmp_path / "decode.yaml"
    shapes.update(only_decode, {(DECODE, (8, 32, 8, 1, 4096, 128)): 3})
    assert main(["tune", "--gpu", "h200", "--from", str(only_decode), "--model"]) == 2
    assert "no key to tune" in capsys.readouterr().err
    assert main(["tune", "--gpu", "h200", "--model"]) == 2
    assert "--d is required" in capsys.readouterr().err


def test_tune_from_names_a_recorded_decode_key_and_why_even_with_quiet(tmp_path, capsys):
    """decode_split keys are not tunable (the tile and split count follow batch x KV heads per call, which a
    table key does not hold): --from says so in one line naming the key, also under --quiet (the H200 check
    ran --quiet and its record step reported 3 keys recorded, 2 tuned, with no word on the third)."""
    from flashgen.cli import main
    from flashgen.tuner import run

    recorded = tmp_path / "shapes.yaml"
    shapes.update(recorded, {(FWD, GQA): 2, (DECODE, (2, 32, 8, 1, 4096, 128)): 16})
    keys, _, skipped = run.recorded_keys(recorded, gpus.get("h200"))
    assert keys == [FWD] and len(skipped) == 1
    assert skipped[0].startswith("decode_split-sm_90a-bf16-d128-causal-n4096 (16 calls): decode_split is not tuned:")
    assert "batch x KV heads" in skipped[0]
    assert main(["tune", "--gpu", "h200", "--from", str(recorded), "--model", "--space", "block_m=128",
                 "block_n=128", "stages=3", "--out", str(tmp_path / "t.yaml"), "--quiet"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "decode_split" in line]
    assert lines == [f"flashgen tune --from: not tuned: {skipped[0]}"]


def test_the_environment_variable_records_the_process_and_writes_at_exit(tmp_path, flashgen_home):
    path = tmp_path / "env.yaml"
    code = ("from flashgen import shapes\nfrom flashgen.problem import ProblemKey\n"
            "shapes.from_environment(); shapes.from_environment()  # once per path\n"
            "k = ProblemKey('fwd', 'sm_90a', 'bf16', 128, True, 4096)\n"
            "for _ in range(7): shapes.note(k, (2, 32, 8, 3001, 3001, 128))\n")
    env = {"FLASHGEN_RECORD": str(path), "FLASHGEN_HOME": str(flashgen_home)}
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, **env})
    assert shapes.load(path) == {(FWD, GQA): 7}


def test_tune_from_times_each_key_at_its_recorded_shape_and_merges(tmp_path, monkeypatch, capsys):
    """The device command's path with a fake GPU: the recorded forward and backward keys are tuned at
    their recorded shapes (GQA, odd length), the decode key is listed as not tuned, and the winners are
    merged into the user's table beside the entry already there."""
    from flashgen.cli import main
    from flashgen.codegen import Report
    from flashgen.tuner import run, space
    from flashgen.tuner.objective import MeasuredObjective

    recorded = tmp_path / "shapes.yaml"
    shapes.update(recorded, {(FWD, GQA): 9, (FWD, (1, 32, 8, 2100, 2100, 128)): 2, (BWD, GQA): 3,
                             (DECODE, (8, 32, 8, 1, 4096, 128)): 40})
    clean = type("B", (), {"report": Report(registers=168, spill_stores=0, spill_loads=0, stack_frame=0,
                                            static_smem=0)})()
    seen = []

    def objective(profile):
        obj = MeasuredObjective(profile, build=lambda spec: clean, check=lambda spec: "", timer=timer)
        seen.append(obj)
        return obj

    def timer(key, spec):
        shape = space.measured_shape(key, seen[0].shapes)
        timed.append((key, spec, shape))
        return 1.0 + spec.block_n / 1000 + spec.warps / 100  # narrow tiles, few warps: fastest

    timed = []
    monkeypatch.setattr(run, "gpu_mode", lambda profile, want_model: ("measured", "NVIDIA H200 (fake)"))
    monkeypatch.setattr(run, "precompile", lambda specs, jobs, log=None: {})
    monkeypatch.setattr(run, "MeasuredObjective", objective)
    out = tmp_path / "h200.yaml"
    kept = ProblemKey("fwd", "sm_90a", "bf16", 64, True, 512)
    kept_spec = space.paper_baseline(kept, gpus.get("h200"))
    old = tables.Table(meta=tables.make_meta(gpus.get("h200"), "measured"))
    old.entries[kept] = {"spec": kept_spec, "time_ms": 1.0, "source": "measured"}
    tables.save(old, out)
    from flashgen import dispatch

    before = {key: dispatch.select(key, "h200", gpus.get("h200").smem_per_block) for key in (FWD, BWD)}
    assert main(["tune", "--gpu", "h200", "--from", str(recorded), "--trials", "12", "--out", str(out),
                 "--no-confirm"]) == 0
    err = capsys.readouterr().err
    assert "2 recorded keys to tune" in err and "decode_split-sm_90a-bf16-d128-causal-n4096 (40 calls)" in err
    assert {k for k, _, _ in timed} == {FWD, BWD}
    assert {s for _, _, s in timed} == {GQA}  # the most called shape, not the benchmark's
    for key, now in before.items():  # what ran before (the shipped table's pick) is measured too, and compared
        assert (key, now) in {(k, spec) for k, spec, _ in timed}
        assert f"the current {now.name}" in err
    table = tables.load(out, gpu="h200")
    assert set(table.entries) == {kept, FWD, BWD} and table.entries[kept]["spec"] == kept_spec
    assert table.entries[FWD]["source"] == "measured"
    flops = 4.0 * 2 * 32 * 3001 * 3001 * 128 / 2
    assert table.entries[FWD]["tflops"] == pytest.approx(flops / (table.entries[FWD]["time_ms"] * 1e-3) / 1e12)


# -- the cost model checked against (fake) measurements --------------------------------------------
def test_validate_model_reports_the_regret_of_the_models_pick(tmp_path, monkeypatch, capsys, flashgen_home):
    """A fake GPU whose time is the model's estimate except for one candidate per key, 20 % faster than
    modelled: that one is the measured best, the model's pick runs at its estimate, and the reported regret
    is exactly their ratio. The same seeded sample serves both buckets; the user's table is not written."""
    import json

    from flashgen.cli import main
    from flashgen.codegen import Report
    from flashgen.tuner import cost, run, space
    from flashgen.tuner.objective import MeasuredObjective, model_shape

    h200 = gpus.get("h200")
    clean = type("B", (), {"report": Report(registers=168, spill_stores=0, spill_loads=0, stack_frame=0,
                                            static_smem=0)})()
    timed = {}
    surprise = {}  # key -> the spec that runs faster than modelled

    def timer(key, spec):
        ms = cost.estimate(spec, model_shape(key), h200, 168) * 1e3
        surprise.setdefault(key, spec) if spec != space.candidates(key, h200)[0] else None
        timed.setdefault(key, set()).add(spec)
        return ms * (0.8 if surprise.get(key) == spec else 1.0)

    monkeypatch.setattr(run, "gpu_mode", lambda profile, want_model: ("measured", "NVIDIA H200 (fake)"))
    monkeypatch.setattr(run, "precompile", lambda specs, jobs, log=None: {})
    monkeypatch.setattr(run, "MeasuredObjective", lambda profile: MeasuredObjective(
        profile, build=lambda spec: clean, check=lambda spec: "", timer=timer))
    out = tmp_path / "validation"
    assert main(["tune", "--gpu", "h200", "--d", "128", "--seqlens", "1024,4096", "--causal", "true",
                 "--validate-model", "--trials", "9", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "validation.json").read_text())
    keys = [ProblemKey("fwd", "sm_90a", "bf16", 128, True, n) for n in (1024, 4096)]
    assert [r["key"] for r in doc["keys"]] == [space.key_name(k) for k in keys]
    assert timed[keys[0]] == timed[keys[1]] and len(timed[keys[0]]) == 9  # one sample for both buckets
    regrets = []
    for key, row in zip(keys, doc["keys"]):
        model = {s: cost.estimate(s, model_shape(key), h200, 168) * 1e3 for s in timed[key]}
        pick = min(model, key=model.get)
        best_ms = min(model[s] * (0.8 if s == surprise[key] else 1.0) for s in model)
        want = model[pick] * (0.8 if pick == surprise[key] else 1.0) / best_ms
        assert row["status"] == "ok" and row["model_pick"] == pick.name
        assert row["regret"] == pytest.approx(want)
        regrets.append(want)
    total = doc["summary"]
    assert total["worst_regret"] == pytest.approx(max(regrets))
    assert total["geomean_regret"] == pytest.approx((regrets[0] * regrets[1]) ** 0.5)
    assert "regret geometric mean" in printed
    assert set(tables.load(out / "table.yaml", gpu="h200").entries) == set(keys)
    assert not tables.default_path("h200").exists()


def test_validate_model_names_a_pick_that_fails_the_check():
    """A model pick that computes wrong results is a failed key, never a regret."""
    from flashgen.tuner import space, study, validation
    from flashgen.tuner.objective import Outcome  # noqa: F401 -- the statuses the rows carry

    cands = space.candidates(FWD, gpus.get("h200"))[:3]
    trials = [study.TrialRecord(0, cands[0], "ok", 2.0, info={"model_ms": 2.0}),
              study.TrialRecord(1, cands[1], "wrong", None, "max error 1e+00", info={"model_ms": 1.0}),
              study.TrialRecord(2, cands[2], "ok", 1.5, info={"model_ms": 3.0})]
    result = study.KeyResult(FWD, 3, cands[0], trials)
    row = validation.key_row(result, objective=None)
    assert row["status"] == "model pick wrong" and row["model_pick"] == cands[1].name and "regret" not in row
    assert validation.summary([row]) == {"keys": 1, "validated": 0, "failed": 1}


def test_validate_model_refuses_model_mode_and_a_table_as_out(tmp_path, capsys):
    from flashgen.cli import main

    assert main(["tune", "--gpu", "h200", "--d", "64", "--validate-model", "--model"]) == 2
    assert "not with --model" in capsys.readouterr().err
    table = tmp_path / "t.yaml"
    table.write_text("x: 1\n")
    assert main(["tune", "--gpu", "h200", "--d", "64", "--validate-model", "--out", str(table)]) == 2
    assert "a folder for the report" in capsys.readouterr().err
