"""The tuner on a CPU: search space, studies with a fake kernel and a fake timer, the
cost model, buckets, the YAML tables (``flashgen.tables``: round trip, merge, refusals), what the
tuner adds to them (``flashgen.tuner.store``) and dispatch order."""
from __future__ import annotations

import copy
import math
import multiprocessing
import os

import pytest
import yaml

from flashgen import dispatch, families, gpus, tables
from flashgen.errors import ConfigError, UnsupportedError
from flashgen.problem import BUCKETS, ProblemKey, bucket_of, bwd_head_dim_tile
from flashgen.spec import KernelSpec
from flashgen.tuner import cost, space, store, study
from flashgen.tuner.objective import MeasuredObjective, ModelObjective, Outcome

pytestmark = pytest.mark.shared_kernels  # the tuner compiles candidates; the cache is not under test here

pytest.importorskip("optuna")

H200 = gpus.get("h200")
KEY = ProblemKey("fwd", "sm_90a", "bf16", 128, True, 4096)


# -- search space -----------------------------------------------------------
@pytest.mark.parametrize("gpu", ["a100", "h200", "l4"])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_candidates_are_feasible_and_unique(gpu, d):
    """Every candidate validates, fits the budget and the accumulator limit; none repeats."""
    prof = gpus.get(gpu)
    key = ProblemKey("fwd", prof.arch, "bf16", d, False, 2048)
    cands = space.candidates(key, prof)
    assert len(cands) == len(set(cands)) >= 1
    for s in cands:
        assert s.check(prof) == []
        assert s.smem_bytes() <= prof.smem_per_block
        assert (s.arch, s.dtype, s.causal) == (prof.arch, "bf16", False)
        if s.kind == "fwd_v2":
            assert s.block_m % (16 * s.warps) == 0 and s.head_dim == d
        else:  # fwd_sm90, on sm_90a only, at its own head-dim tile
            assert (s.kind, prof.arch, s.head_dim) == ("fwd_sm90", "sm_90a", families.family("fwd_sm90").tile(key))
            assert s.head_dim == {32: 64, 64: 64, 128: 128, 256: 256}[d]
    assert {s.kind for s in cands} == ({"fwd_v2", "fwd_sm90"} if prof.arch == "sm_90a" else {"fwd_v2"})


def test_smaller_budget_shrinks_the_space():
    """--smem simulates a smaller GPU: fewer candidates, all within the smaller budget."""
    full = space.candidates(KEY, H200)
    small_prof = gpus.with_smem(H200, 64 * 1024)
    small = space.candidates(KEY, small_prof)
    assert 0 < len(small) < len(full)
    assert all(s.smem_bytes() <= 64 * 1024 for s in small)
    with pytest.raises(ValueError):
        gpus.with_smem(H200, -1)


@pytest.mark.parametrize("gpu,d,expect", [
    # M = smem // 2 elements; B_c = ceil(M / 4d), B_r = min(B_c, d), rounded, then shrunk to fit.
    ("h200", 64, (64, 256)),     # M=116224: B_c=454 -> 256 (largest tile), B_r=64; fits with 4 warps
    ("h200", 128, (128, 192)),   # B_c=227 -> 256 does not fit (smem), 192 does; 8 warps keep the accumulators
    ("a100", 128, (128, 128)),   # M=83456: B_c=163 -> 160 over budget -> 128
])
def test_paper_baseline(gpu, d, expect):
    prof = gpus.get(gpu)
    key = ProblemKey("fwd", prof.arch, "bf16", d, False, 4096)
    base = space.paper_baseline(key, prof)
    assert (base.block_m, base.block_n) == expect
    assert base.check(prof) == []
    assert space.candidates(key, prof)[0] == base  # the baseline is the first trial


def test_problem_shape_follows_the_convention():
    assert space.problem_shape(KEY) == (4, 16, 4096, 128)
    assert space.problem_shape(ProblemKey("fwd", "sm_90a", "bf16", 64, False, 16384)) == (1, 32, 16384, 64)


@pytest.mark.parametrize("n,bucket", [(1, 512), (512, 512), (513, 1024), (3000, 4096), (16384, 16384),
                                      (100000, 16384)])
def test_bucket_mapping(n, bucket):
    assert bucket_of(n) == bucket
    assert bucket in BUCKETS


# -- studies with a fake kernel and a fake timer -------------------------------
def fake_time(key, spec):
    """A deterministic 'kernel time' with one best point (128x64, 3 stages, refill 1)."""
    return 1.0 + abs(spec.block_n - 64) / 100 + abs(spec.stages - 3) / 10 + abs(spec.refill - 1) * 0.01 \
        + (spec.block_m != 128) * 0.2 + (spec.warps != 4) * 0.05


class FakeBuild:
    """Stands in for NVRTC: a report with spills for 96-wide tiles, a compile error for 192-wide ones."""

    def __init__(self):
        self.calls = 0

    def __call__(self, spec):
        from flashgen.codegen import Report
        from flashgen.errors import CompileError

        self.calls += 1
        if spec.block_n == 192:
            raise CompileError("NVRTC failed (fake)")
        spills = 8 if spec.block_n == 96 else 0

        class B:
            report = Report(registers=200, spill_stores=spills, spill_loads=spills, stack_frame=0, static_smem=0)
        return B()


def fake_objective(wrong=lambda s: False, launch_fails=lambda s: False):
    def check(spec):
        return "max error 1e+00 > 1e-02 (fake)" if wrong(spec) else ""

    def timer(key, spec):
        if launch_fails(spec):
            raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED (fake)")
        return fake_time(key, spec)

    return MeasuredObjective(H200, build=FakeBuild(), check=check, timer=timer)


def test_exhaustive_study_records_every_failure_kind_and_finds_the_best():
    cands = space.candidates(KEY, H200)
    obj = fake_objective(wrong=lambda s: s.block_n == 32 and s.stages == 2,
                         launch_fails=lambda s: s.block_m == 64 and s.block_n == 128)
    st = study.run_study(KEY, obj, cands, n_trials=len(cands))
    res = study.collect(KEY, st, cands)
    assert res.mode == "exhaustive"
    assert [t.spec for t in res.trials] == cands  # each candidate exactly once, in order, baseline first
    fails = res.failures()
    assert fails["constraint"] > 0 and fails["compile_error"] > 0 and fails["wrong"] > 0
    assert fails["launch_error"] > 0
    for t in res.trials:
        if t.status != "ok":
            assert t.time_ms is None and t.reason
        if t.spec.block_n == 96:
            assert t.status == "constraint" and "spills" in t.reason
    best = res.best
    assert best.status == "ok"
    assert best.time_ms == min(fake_time(KEY, s) for s in cands
                               if s.block_n not in (96, 192) and not (s.block_n == 32 and s.stages == 2)
                               and not (s.block_m == 64 and s.block_n == 128))
    assert (best.spec.block_m, best.spec.block_n, best.spec.stages, best.spec.refill) == (128, 64, 3, 1)
    assert all(t.status == "ok" for t in res.runners_up())
    # a wrong kernel is never a winner, even when it would be fastest
    assert all(t.status != "wrong" for t in res.ok())


def test_wrong_fast_kernel_never_wins():
    """The fake timer's fastest fwd_v2 tile gives wrong results: it is evaluated and never the winner."""
    wrong = lambda s: (s.block_m, s.block_n, s.stages, s.refill, s.warps) == (128, 64, 3, 1, 4)  # noqa: E731
    cands = [s for s in space.candidates(KEY, H200) if s.kind == "fwd_v2"]
    assert min(cands, key=lambda s: fake_time(KEY, s)) == next(s for s in cands if wrong(s))
    obj = fake_objective(wrong=wrong)
    res = study.collect(KEY, study.run_study(KEY, obj, cands, n_trials=len(cands)), cands)
    assert res.best.spec != KernelSpec(kind="fwd_v2", arch="sm_90a", dtype="bf16", head_dim=128, block_m=128,
                                       block_n=64, warps=4, stages=3, refill=1, causal=True)
    assert res.failures()["wrong"] == 1


def test_objective_exceptions_do_not_stop_the_run():
    cands = space.candidates(KEY, H200)[:6]

    def explode(key, spec):
        if spec == cands[2]:
            raise ZeroDivisionError("boom")
        return Outcome("ok", 1.0 + cands.index(spec))

    res = study.collect(KEY, study.run_study(KEY, explode, cands, n_trials=10), cands)
    assert len(res.trials) == 6
    assert res.trials[2].status == "launch_error" and "boom" in res.trials[2].reason
    assert res.best.spec == cands[0]


def test_tpe_study_is_seeded_and_bounded():
    """More candidates than trials: TPE; the baseline runs first; the count of evaluated
    trials is the budget; the same seed gives the same trials."""
    cands = space.candidates(KEY, H200)
    runs = []
    for _ in range(2):
        obj = fake_objective()
        res = study.collect(KEY, study.run_study(KEY, obj, cands, n_trials=15, seed=3), cands)
        runs.append([(t.spec, t.status) for t in res.trials])
        assert res.mode == "tpe"
        assert res.trials[0].spec == cands[0]
        evaluated = [t for t in res.trials if not (t.status == "constraint" and "statically" in t.reason)]
        assert len(evaluated) == 15
        assert len({t.spec for t in res.trials}) == len(res.trials)  # duplicates are not re-evaluated
    assert runs[0] == runs[1]


def test_time_budget_stops_a_key():
    cands = space.candidates(KEY, H200)
    clock = {"n": 0}

    def slow(key, spec):
        import time
        time.sleep(0.05)
        clock["n"] += 1
        return Outcome("ok", 1.0)

    study.run_study(KEY, slow, cands, n_trials=1000, time_budget=0.2)
    assert 1 <= clock["n"] < len(cands)


def test_outcome_validation():
    with pytest.raises(ValueError):
        Outcome("fine", 1.0)
    with pytest.raises(ValueError):
        Outcome("ok", float("nan"))
    with pytest.raises(ValueError):
        Outcome("ok", None)


def test_rank_agreement():
    from flashgen.tuner.study import KeyResult, TrialRecord

    cands = space.candidates(KEY, H200)[:5]
    recs = [TrialRecord(i, s, "ok", float(i + 1), info={"model_ms": float(i + 1)}) for i, s in enumerate(cands)]
    agree = study.rank_agreement(KeyResult(KEY, 5, cands[0], recs))
    assert agree["spearman"] == pytest.approx(1.0) and agree["model_pick_slowdown"] == 1.0
    recs = [TrialRecord(i, s, "ok", float(i + 1), info={"model_ms": float(10 - i)}) for i, s in enumerate(cands)]
    agree = study.rank_agreement(KeyResult(KEY, 5, cands[0], recs))
    assert agree["spearman"] == pytest.approx(-1.0) and agree["model_pick_slowdown"] == 5.0


# -- cost model ----------------------------------------------------------------
def test_cost_model_basics():
    spec = KernelSpec(kind="fwd_v2", arch="sm_90a", dtype="bf16", head_dim=128, block_m=128, block_n=64, warps=4,
                      stages=2, refill=0, causal=False)
    shape = (4, 16, 4096, 128)
    t = cost.estimate(spec, shape, H200, registers=255)
    flops = cost.flops(*shape[:3], shape[2], 128, False)
    assert 0 < flops / t < H200.peak_flops  # never faster than the datasheet
    causal = cost.estimate(spec.replace(causal=True), shape, H200, registers=255)
    assert 0.4 * t < causal < 0.75 * t  # about half the work, plus imbalance
    assert cost.estimate(spec, (8, 16, 4096, 128), H200, 255) == pytest.approx(2 * t, rel=0.1)
    # I/O: Q and O once, K and V once per query block: 2*N*d*(1 + N/B_r) elements per head
    assert cost.hbm_bytes(spec, 1, 1, 256, 256, 128) == 2 * 128 * (2 * 256 + 2 * 256 * 2) + 4 * 256  # + LSE
    assert cost.residency(spec, 255, H200) == 2  # 2 x 32k registers, 2 x 97 KB shared memory
    assert cost.residency(spec.replace(block_n=32, stages=2), 128, H200) == 3
    assert math.isinf(cost.estimate(spec, shape, H200, registers=10_000))


def test_cost_model_sees_the_sm90_flags():
    """The fwd_sm90 flags in the model (Sm90Family.model_techniques), on the H200 facts it was built from
    (docs/perf/tuner.md, "The flags in the cost model")."""
    def est(tokens, d=64, causal=True, n=4096):
        spec = families.fwd_sm90.variant(d, causal, tokens)
        shape = (16384 // n, 2048 // d, n, d)
        return cost.estimate(spec, shape, H200, registers=65536 // (spec.warps * 32) // 8 * 8)

    # Ping-pong / overlap pay with a spare stage (3 stages, or 2 with separate K/V barriers), and the
    # overlap with 2 stages and no early release starves the producer (N = 8k ablation, d 64 and 128).
    for d in (64, 128):
        assert est("ws_pp_s3", d, n=8192) < est("ws_s3", d, n=8192)
        assert est("ws_ov_s3", d, n=8192) < est("ws_s3", d, n=8192)
        assert est("ws_pp_ov_kr", d, n=8192) < est("ws", d, n=8192) < est("ws_pp_ov", d, n=8192)
    # The persistent kernel: ahead on short tiles (d = 64 causal 2k, +10 % measured), behind on long
    # ones (1-5 % behind its twin at 8k-16k).
    assert est("ws_pp_ov_ps_s3_m192", 64, True, 2048) < est("ws_pp_ov_s3_m192", 64, True, 2048)
    for n in (8192, 16384):
        for d in (64, 128):
            assert est("ws_ov_ps_s3_m192" if d == 64 else "ws_ov_ps_s3_m192_n80", d, False, n) > \
                est("ws_ov_s3_m192" if d == 64 else "ws_ov_s3_m192_n80", d, False, n)
    # The two keys the flag-blind model missed on the H200 (tune --validate-model, 16 candidates each):
    # it tied the measured best with a twin without persistence (d64 causal 1k: 1.20x regret) and put a
    # tile without ping-pong / overlap first (d64 causal 4k: 1.15x).
    assert est("ws_pp_ov_fx1_kr_ps_s3", 64, True, 1024) < est("ws_pp_ov_ls_s3", 64, True, 1024)
    assert est("ws_pp_ov_fx1_ps_s4_n176", 64, True, 4096) < est("ws_kr_s4_n192", 64, True, 4096)
    # Families without the flags are unchanged.
    assert families.family("fwd_v2").model_techniques(
        KernelSpec(kind="fwd_v2", arch="sm_90a", dtype="bf16", head_dim=64, block_m=128, block_n=64, warps=4,
                   stages=2, refill=0, causal=False)) == (1.0, 0.0)


# -- store -----------------------------------------------------------------------
def _table(gpu="h200", entries=None, source="measured"):
    prof = gpus.get(gpu)
    t = tables.Table(meta=tables.make_meta(prof, source))
    for key, spec, ms in entries or []:
        t.entries[key] = {"spec": spec, "time_ms": ms, "tflops": 100.0, "source": source,
                          "baseline": {"spec": space.paper_baseline(key, prof), "time_ms": ms * 1.5},
                          "speedup": 1.5, "runners_up": [], "trials": 3, "candidates": 9,
                          "failures": {"constraint": 1}}
    return t


def _spec_for(key, **kw):
    base = dict(kind="fwd_v2" if key.kind == "fwd" else key.kind, arch=key.arch, dtype=key.dtype,
                head_dim=key.head_dim, causal=key.causal,
                block_m=128, block_n=32, warps=4, stages=3, refill=0)
    base.update(kw)
    return KernelSpec(**base)


def test_yaml_round_trip(tmp_path):
    key2 = ProblemKey("fwd", "sm_90a", "fp16", 64, False, 512)
    t = _table(entries=[(KEY, _spec_for(KEY), 1.25), (key2, _spec_for(key2, block_n=64), 0.5)])
    path = tables.save(t, tmp_path / "h200.yaml")
    back = tables.load(path, gpu="h200")
    assert back.meta == t.meta
    assert back.entries.keys() == t.entries.keys()
    for k in t.entries:
        assert back.entries[k]["spec"] == t.entries[k]["spec"]
        assert back.entries[k]["time_ms"] == t.entries[k]["time_ms"]
        assert back.entries[k]["baseline"]["spec"] == t.entries[k]["baseline"]["spec"]
    assert yaml.safe_load(path.read_text())["meta"]["source"] == "measured"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


def test_merge_keeps_untouched_keys(tmp_path):
    key2 = ProblemKey("fwd", "sm_90a", "bf16", 64, False, 512)
    old = _table(entries=[(KEY, _spec_for(KEY), 2.0), (key2, _spec_for(key2), 1.0)])
    new = _table(entries=[(KEY, _spec_for(KEY, block_n=64, stages=2), 1.0)])
    merged = tables.merge(old, new)
    assert merged.entries[KEY]["spec"].block_n == 64
    assert merged.entries[key2]["spec"] == _spec_for(key2)
    with pytest.raises(ConfigError):
        tables.merge(_table(gpu="a100"), new)


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data):  # the documents below share sub-dicts; tables never carry aliases
        return True


def _write(tmp_path, doc, name="h200.yaml"):
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else yaml.dump(doc, Dumper=_NoAliases))
    return p


def _good_doc():
    return yaml.safe_load(tables.dump(_table(entries=[(KEY, _spec_for(KEY), 1.0)])))


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(meta="x"), "meta must be a mapping"),
    (lambda d: d["meta"].pop("gpu"), "meta is missing gpu"),
    (lambda d: d["meta"].update(gpu="tpu9"), "not a known GPU"),
    (lambda d: d["meta"].update(format=99), "format"),
    (lambda d: d["meta"].update(source="guess"), "source"),
    (lambda d: d.update(entries={}), "entries must be a list"),
    (lambda d: d["entries"][0].pop("spec"), "missing spec"),
    (lambda d: d["entries"][0]["spec"].pop("stages"), "missing field"),
    (lambda d: d["entries"][0]["spec"].update(block_m=100), "block_m"),
    (lambda d: d["entries"][0]["spec"].update(head_dim="128; system()"), "head_dim"),
    (lambda d: d["entries"][0]["spec"].update(causal=1), "causal"),
    (lambda d: d["entries"][0]["spec"].update(evil="x"), "unknown spec field"),
    (lambda d: d["entries"][0]["spec"].update(dtype="fp16"), "does not match its key"),
    (lambda d: d["entries"][0]["spec"].update(block_n=256, stages=4), "not feasible"),
    (lambda d: d["entries"][0]["key"].update(bucket=3000), "bucket"),
    (lambda d: d["entries"][0]["key"].update(causal="yes"), "key.causal"),
    (lambda d: d["entries"][0].update(time_ms=-1), "time_ms"),
    (lambda d: d["entries"][0].update(time_ms=float("nan")), "time_ms"),
    (lambda d: d["entries"].append(copy.deepcopy(d["entries"][0])), "repeats the key"),
    (lambda d: d["entries"][0].update(failures={"wrong": -2}), "failures"),
])
def test_hand_broken_files_are_refused_with_path_and_reason(tmp_path, mutate, message):
    doc = _good_doc()
    mutate(doc)
    path = _write(tmp_path, doc)
    with pytest.raises(ConfigError) as err:
        tables.load(path, gpu="h200")
    assert str(path) in str(err.value) and message in str(err.value)


@pytest.mark.parametrize("text", ["", "meta: [1, 2\n", "!!python/object/apply:os.system ['true']\n", "[1, 2]\n",
                                  "\x00\x01binary"])
def test_corrupt_files_are_refused(tmp_path, text):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        tables.load(path)
    assert str(path) in str(err.value)


def test_foreign_gpu_file_is_refused(tmp_path):
    path = tables.save(_table(gpu="a100"), tmp_path / "h200.yaml")
    with pytest.raises(ConfigError, match="tuned for a100, not h200") as err:
        tables.load(path, gpu="h200")
    assert str(path) in str(err.value)
    tables.load(path, gpu="a100")  # the right GPU reads it


def test_version_difference_is_a_warning(tmp_path):
    doc = _good_doc()
    doc["meta"]["versions"]["flashgen"] = "0.0.1"
    with pytest.warns(UserWarning, match="re-tune"):
        tables.load(_write(tmp_path, doc), gpu="h200")


# -- dispatch order: user -> shipped -> default ------------------------------------
@pytest.fixture
def shipped_dir(tmp_path, monkeypatch):
    folder = tmp_path / "shipped"
    folder.mkdir()
    monkeypatch.setattr(tables, "shipped_path", lambda gpu: folder / f"{gpu}.yaml")
    dispatch.clear()
    yield folder
    dispatch.clear()


def test_dispatch_order(shipped_dir):
    key_a = KEY
    key_b = ProblemKey("fwd", "sm_90a", "bf16", 64, False, 1024)
    key_c = ProblemKey("fwd", "sm_90a", "fp16", 64, True, 2048)
    default_c = families.default_spec(key_c, H200.smem_per_block)
    shipped_a, shipped_b = _spec_for(key_a, block_n=64, stages=2, refill=1), _spec_for(key_b, stages=2)
    user_a = _spec_for(key_a, block_m=64, block_n=64, stages=2)
    tables.save(_table(entries=[(key_a, shipped_a, 1.0), (key_b, shipped_b, 1.0)]), shipped_dir / "h200.yaml")
    dispatch.clear()
    assert dispatch.select(key_a, "h200", H200.smem_per_block) == shipped_a
    assert dispatch.select(key_c, "h200", H200.smem_per_block) == default_c
    tables.save(_table(entries=[(key_a, user_a, 0.9)]), tables.default_path("h200"))
    dispatch.clear()
    assert dispatch.select(key_a, "h200", H200.smem_per_block) == user_a          # user first
    assert dispatch.select(key_b, "h200", H200.smem_per_block) == shipped_b       # then shipped
    assert dispatch.select(key_c, "h200", H200.smem_per_block) == default_c       # then the default rule
    assert tables.lookup_entry("h200", key_b)[0] == "shipped"
    assert dispatch.select(key_a, None, H200.smem_per_block) == families.default_spec(key_a, H200.smem_per_block)


def test_dispatch_never_silently_skips_a_broken_user_table(shipped_dir):
    tables.save(_table(entries=[(KEY, _spec_for(KEY), 1.0)]), shipped_dir / "h200.yaml")
    path = tables.default_path("h200")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("meta: {gpu: h200\n")
    dispatch.clear()
    with pytest.raises(ConfigError, match=str(path)):
        dispatch.select(KEY, "h200", H200.smem_per_block)


def test_dispatch_import_does_not_need_optuna():
    import subprocess
    import sys

    code = ("import sys; sys.modules['optuna'] = None\n"
            "import flashgen, flashgen.dispatch, flashgen.tables, flashgen.tuner.store\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


# -- two processes, one journal-file study ----------------------------------------------
SMALL_KEY = ProblemKey("fwd", "sm_80", "bf16", 64, True, 1024)


def _worker(args):
    storage_url, index, n_trials, start = args
    prof = gpus.get("a100")
    cands = space.candidates(SMALL_KEY, prof)[:n_trials]
    obj = ModelObjective(prof)
    # Both workers begin together: a spawned process's start-up (importing torch) takes seconds on a busy
    # machine, in which the other could take every trial of the model objective (milliseconds each).
    start.wait(timeout=120)
    study.run_study(SMALL_KEY, obj, cands, n_trials=n_trials, storage=storage_url, worker=f"w{index}",
                    worker_index=index)
    return index


def test_two_processes_share_one_study(tmp_path):
    """Two processes on one journal file, model objective: both contribute, no trial lost or
    repeated, and the winner equals a single-process run's."""
    n = 16
    prof = gpus.get("a100")
    cands = space.candidates(SMALL_KEY, prof)[:n]
    from flashgen.tuner.run import precompile

    precompile(cands, jobs=2)  # warm the kernel cache so the two workers race on trials, not on NVRTC
    url = f"journal:{tmp_path / 'studies.journal'}"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(2) as pool:
        start = manager.Barrier(2)
        assert sorted(pool.map(_worker, [(url, 0, n, start), (url, 1, n, start)])) == [0, 1]
    shared = study.collect(SMALL_KEY, url, cands)
    assert sorted(t.spec.name for t in shared.trials) == sorted(s.name for s in cands)  # each exactly once
    assert set(shared.workers()) == {"w0", "w1"} and min(shared.workers().values()) >= 1
    single = study.collect(SMALL_KEY, study.run_study(SMALL_KEY, ModelObjective(prof), cands, n_trials=n), cands)
    assert shared.best.spec == single.best.spec and shared.best.time_ms == single.best.time_ms


# -- the command line, model mode (what CI runs for the a100) ---------------------------
def test_tune_a100_model_mode_writes_a_valid_yaml(tmp_path, capsys):
    from flashgen.cli import main

    out = tmp_path / "a100.yaml"
    report = tmp_path / "report.json"
    # The documented command, every bucket, with a small trial budget per key (TPE, seeded) so CI stays quick.
    code = main(["tune", "--gpu", "a100", "--d", "64,128", "--trials", "3", "--model",
                 "--out", str(out), "--report", str(report), "--quiet"])
    assert code == 0
    table = tables.load(out, gpu="a100")
    assert table.meta["source"] == "model" and table.meta["gpu"] == "a100"
    assert len(table.entries) == 2 * 2 * len(BUCKETS)  # d 64, 128 x causal both x every bucket
    for key, entry in table.entries.items():
        assert entry["spec"].arch == "sm_80" and entry["spec"].check(gpus.get("a100")) == []
        assert entry["time_ms"] <= entry["baseline"]["time_ms"]  # the baseline is a trial
    printed = capsys.readouterr().out
    assert "median gain over the paper-rule baseline" in printed
    code = main(["show", "--config", str(out)])
    assert code == 0 and "fwd-sm_80-bf16-d128-causal-n16384" in capsys.readouterr().out


def _with_options(base, argv):
    """``base`` with each (option, value) pair of ``argv`` replacing the same option's value, else added."""
    base = list(base)
    for i in range(0, len(argv), 2):
        if argv[i] in base:
            base[base.index(argv[i]) + 1] = argv[i + 1]
        else:
            base += argv[i:i + 2]
    return base


def test_tune_refuses_bad_arguments(capsys):
    from flashgen.cli import main

    for argv, msg in ((["--d", "12"], "multiples of 8"), (["--dtype", "fp32"], "--dtype"),
                      (["--seqlens", "3000"], "buckets"), (["--causal", "maybe"], "--causal"),
                      (["--smem", "0"], "--smem"), (["--trials", "0"], "--trials")):
        assert main(_with_options(["tune", "--gpu", "a100", "--d", "64", "--model", "--quiet"], argv)) == 2
        assert msg in capsys.readouterr().err


def test_measured_tuning_refuses_another_gpu(monkeypatch):
    import torch

    from flashgen.errors import FlashgenError
    from flashgen.tuner.run import gpu_mode

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(FlashgenError, match="--model"):
        gpu_mode(H200, want_model=False)
    assert gpu_mode(gpus.get("a100"), want_model=False)[0] == "measured"
    assert gpu_mode(H200, want_model=True)[0] == "model"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FlashgenError, match="no CUDA GPU.*--model"):  # no silent fall back to the cost model
        gpu_mode(H200, want_model=False)


def test_show_without_tables(capsys, shipped_dir):
    from flashgen.cli import main

    assert main(["show", "--gpu", "l4"]) == 0
    assert "default rule" in capsys.readouterr().out
    os.environ.pop("FLASHGEN_GPU", None)


def test_show_marks_an_entry_the_rule_has_moved_past(capsys, shipped_dir):
    """A shipped backward entry that was its own baseline (the default rule of its day) is listed as 'rule'
    with the pick that serves now; dispatch takes that pick (dispatch.superseded_by)."""
    from flashgen.cli import main

    key = ProblemKey("bwd_dkdv", "sm_90a", "bf16", 64, False, 4096)
    rule = families.default_spec(key, H200.smem_per_block)
    old = rule.replace(block_m=64, stages=3, dq_write=0).validate()
    table = _table(entries=[(key, old, 1.0)])
    table.entries[key].update(baseline={"spec": old, "time_ms": 1.0}, speedup=1.0)
    tables.save(table, shipped_dir / "h200.yaml")
    dispatch.clear()
    assert main(["show", "--gpu", "h200"]) == 0
    line, note = [x for x in capsys.readouterr().out.splitlines() if old.name in x or rule.name in x]
    assert line.split()[-1] == "rule" and rule.name in note
    assert dispatch.select(key, "h200", H200.smem_per_block) == rule
    os.environ.pop("FLASHGEN_GPU", None)


# -- one forward key, two families (fwd_v2 everywhere, fwd_sm90 on sm_90a) ---------------
def _sm90(key, bm=128, bn=128, st=2, ws=True, pp=False, ov=False):
    return space.make_spec(key, "fwd_sm90", block_m=bm, block_n=bn, stages=st, warp_specialized=ws, pingpong=pp,
                           softmax_overlap=ov).validate()


def fake_time_two(key, spec):
    """fwd_sm90 with warp specialization alone is fastest; fwd_v2 as in fake_time."""
    if spec.kind == "fwd_sm90":
        return 0.5 + abs(spec.block_n - 128) / 1000 + 0.1 * (spec.pingpong + spec.softmax_overlap
                                                             + (not spec.warp_specialized))
    return fake_time(key, spec)


def test_forward_key_families_and_default():
    """The "fwd" problem's families in preference order (fwd_sm90 first where it runs, fwd_v2 the
    fallback); a family's name is no problem kind (it restricts a pick through ``family=``)."""
    assert families.PROBLEMS["fwd"] == ("fwd_sm90", "fwd_v2")
    assert families.serving("fwd", "sm_90a") == ("fwd_sm90", "fwd_v2")
    assert families.serving("fwd", "sm_80") == ("fwd_v2",)
    assert families.fallback_family("fwd", "sm_90a") == families.fallback_family("fwd", "sm_80") == "fwd_v2"
    assert not families.family("fwd_sm90").runs_on("sm_80") and families.serving("fwd_sm90", "sm_90a") == ()
    with pytest.raises(UnsupportedError, match="fwd_sm90 does not serve fwd on sm_80"):
        dispatch.select(ProblemKey("fwd", "sm_80", "bf16", 128, True, 4096), "a100",
                        gpus.get("a100").smem_per_block, family="fwd_sm90")
    assert families.serving("bwd_dkdv", "sm_80") == ("bwd_dkdv",)  # bwd_sm90 serves it on sm_90a only
    assert "fwd" in families.problems() and not {"fwd_v2", "fwd_sm90"} & set(families.problems())
    # the default rule: fwd_sm90's on sm_90a (measured faster on every tuned key), fwd_v2's elsewhere
    for arch, budget, fam in (("sm_90a", H200.smem_per_block, "fwd_sm90"),
                              ("sm_80", gpus.get("a100").smem_per_block, "fwd_v2")):
        key = ProblemKey("fwd", arch, "bf16", 128, True, 4096)
        assert families.default_family(key) == fam
        assert families.default_spec(key, budget) == families.default_spec(key, budget, family=fam)
        assert families.default_spec(key, budget).kind == fam
    # restricted to fwd_sm90, a d=96 problem runs fwd_sm90's 128 tile
    assert families.default_spec(ProblemKey("fwd", "sm_90a", "bf16", 96, False, 512), H200.smem_per_block,
                                 family="fwd_sm90").head_dim == 128


def test_table_serves_a_fwd_sm90_entry_on_sm90a(shipped_dir):
    key = ProblemKey("fwd", "sm_90a", "bf16", 96, True, 4096)   # d = 96: fwd_sm90 runs its 128 tile
    sm90 = _sm90(key)
    assert sm90.head_dim == 128
    other = ProblemKey("fwd", "sm_90a", "bf16", 64, False, 1024)
    v2 = _spec_for(other, block_n=64, stages=2)
    path = tables.save(_table(entries=[(key, sm90, 0.5), (other, v2, 1.0)]), shipped_dir / "h200.yaml")
    back = tables.load(path, gpu="h200")
    assert back.entries[key]["spec"] == sm90 and back.entries[other]["spec"] == v2
    assert "kind: fwd," in path.read_text() and "key: {kind: fwd_v2" not in path.read_text()
    dispatch.clear()
    assert dispatch.select(key, "h200", H200.smem_per_block) == sm90
    assert dispatch.select(other, "h200", H200.smem_per_block) == v2
    # restricted to one family: the entry when it is of that family, else that family's default rule
    assert dispatch.select(key, "h200", H200.smem_per_block, family="fwd_v2") == families.default_spec(
        key, H200.smem_per_block, family="fwd_v2")
    assert dispatch.select(key, "h200", H200.smem_per_block, family="fwd_sm90") == sm90
    assert dispatch.select(other, "h200", H200.smem_per_block, family="fwd_v2") == v2


def test_fwd_sm90_entry_is_refused_on_sm80(tmp_path):
    """A table for an sm_80 GPU cannot hold a fwd_sm90 spec: a ConfigError saying why."""
    a100 = gpus.get("a100")
    key = ProblemKey("fwd", "sm_80", "bf16", 128, False, 2048)
    doc = yaml.safe_load(tables.dump(_table(gpu="a100", entries=[(key, _spec_for(key, block_n=64, stages=2), 1.0)])))
    sm90 = _sm90(ProblemKey("fwd", "sm_90a", "bf16", 128, False, 2048))
    for record, message in ((sm90.to_dict(), "fwd_sm90 kernel, which does not serve fwd on sm_80"),
                            (sm90.replace(arch="sm_80").to_dict(), r"fwd_sm90: arch=sm_80 not in \('sm_90a',\)")):
        doc["entries"][0]["spec"] = record
        path = _write(tmp_path, doc, "a100.yaml")
        with pytest.raises(ConfigError, match=message) as err:
            tables.load(path, gpu="a100")
        assert str(path) in str(err.value)
    with pytest.raises(UnsupportedError, match="sm_90a"):
        families.default_spec(key, a100.smem_per_block, family="fwd_sm90")


# Formats 1 and 2 wrote every field for every kind, fwd_sm90's flags by their former names, and one
# ``hint`` field for what is now decode_split's kv_load and bwd_sm90's dq_write.
_FORMAT2_NAMES = {"warp_specialized": "warpspec", "softmax_overlap": "overlap", "fma_exp2": "emu",
                  "early_k_release": "sepkv", "lean_softmax": "lazy", "persistent": "persist"}


def _format2_record(spec):
    """``spec`` as a format-1/2 table spelled its record."""
    import dataclasses

    record = {_FORMAT2_NAMES.get(f.name, f.name): getattr(spec, f.name) for f in dataclasses.fields(KernelSpec)
              if f.name not in ("kv_load", "dq_write")}
    record["hint"] = spec.kv_load or spec.dq_write
    return record


def _format2_doc(table, fmt=2):
    """The YAML document of ``table`` as format ``fmt`` (1 or 2) wrote it."""
    doc = yaml.safe_load(tables.dump(table))
    doc["meta"]["format"] = fmt
    by_name = {s.name: s for e in table.entries.values()
               for s in [e["spec"], e["baseline"]["spec"], *(r["spec"] for r in e["runners_up"])]}

    def old(record):
        return _format2_record(by_name[KernelSpec.from_dict(record).name])

    for e in doc["entries"]:
        e["spec"] = old(e["spec"])
        e["baseline"]["spec"] = old(e["baseline"]["spec"])
        e["runners_up"] = [{**r, "spec": old(r["spec"])} for r in e["runners_up"]]
    return doc


def test_format1_table_is_migrated_on_read_with_a_warning(tmp_path):
    key = ProblemKey("fwd", "sm_90a", "bf16", 128, True, 4096)
    other = ProblemKey("fwd", "sm_90a", "bf16", 64, False, 512)
    doc = _format2_doc(_table(entries=[(key, _spec_for(key), 1.0), (other, _spec_for(other), 2.0)]), fmt=1)
    for e in doc["entries"]:
        e["key"]["kind"] = "fwd_v2"
    # a format-1 user table could also hold a --kind fwd_sm90 entry of the same problem: the faster one stays
    sm90 = _sm90(key)
    first = next(e for e in doc["entries"] if e["key"]["head_dim"] == 128)
    doc["entries"].append({**first, "key": {**first["key"], "kind": "fwd_sm90"},
                           "spec": _format2_record(sm90), "time_ms": 0.5, "runners_up": [], "baseline": None})
    path = _write(tmp_path, doc)
    assert "warpspec: true" in path.read_text() and "hint: 0" in path.read_text()
    with pytest.warns(UserWarning, match=f"format 1 read as format {tables.FORMAT}"):
        table = tables.load(path, gpu="h200")
    assert set(table.entries) == {key, other} and table.meta["format"] == tables.FORMAT
    assert table.entries[key]["spec"] == sm90 and table.entries[other]["time_ms"] == 2.0
    tables.migrate(path)
    text = path.read_text()
    assert f"format: {tables.FORMAT}" in text and "kind: fwd_v2, arch" not in text.split("spec:")[0]
    assert "warpspec" not in text and "hint" not in text and "warp_specialized: true" in text
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = tables.load(path, gpu="h200")
    assert again.entries.keys() == table.entries.keys()
    assert all(again.entries[k]["spec"] == table.entries[k]["spec"] for k in again.entries)


def test_format2_table_with_a_family_key_is_refused(tmp_path):
    """Since format 2 a forward key names the problem ("fwd"): a format-2 file keyed by a family is refused
    saying so, the same file keyed "fwd" is migrated, and a current-format file with a family key is refused."""
    key2 = ProblemKey("fwd", "sm_90a", "bf16", 64, False, 512)
    sm90 = _sm90(KEY)
    table = _table(entries=[(KEY, _spec_for(KEY), 1.0), (key2, _spec_for(key2), 2.0)])
    table.entries[KEY] = {**table.entries[KEY], "spec": sm90}
    doc = _format2_doc(table)
    with pytest.warns(UserWarning, match=f"format 2 read as format {tables.FORMAT}"):
        back = tables.load(_write(tmp_path, doc), gpu="h200")
    assert back.entries[KEY]["spec"] == sm90 and back.entries[key2]["spec"] == _spec_for(key2)
    doc["entries"][0]["key"]["kind"] = "fwd_v2"
    with pytest.raises(ConfigError, match="is a kernel family; since table format 2"):
        tables.load(_write(tmp_path, doc), gpu="h200")
    doc = _good_doc()
    doc["entries"][0]["key"]["kind"] = "fwd_v2"
    with pytest.raises(ConfigError, match="unknown kind"):
        tables.load(_write(tmp_path, doc), gpu="h200")


def test_shipped_tables_are_format_3_with_fwd_keys():
    for gpu in ("h200", "a100"):
        table = tables.load(tables.shipped_path(gpu), gpu=gpu)
        # forward keys, and the backward's tuned kernels (flashgen tune --kind bwd), each served by its own kind
        assert table.meta["format"] == tables.FORMAT == 3 and "fwd" in {k.kind for k in table.entries}
        assert {k.kind for k in table.entries} <= {"fwd", *space.BWD_KEY_MODES}
        assert all(e["spec"].kind in families.serving(k.kind, k.arch) and e["spec"].kind.startswith("bwd_")
                   for k, e in table.entries.items() if k.kind != "fwd")
        kinds = {(k.dtype, e["spec"].kind) for k, e in table.entries.items() if k.kind == "fwd"}
        # a100: cost model, fwd_v2 only; h200: bf16 and fp16 tuned over both families (fwd_sm90 won
        # every key)
        assert kinds == ({("fp16", "fwd_v2"), ("bf16", "fwd_v2")} if gpu == "a100"
                         else {("fp16", "fwd_sm90"), ("bf16", "fwd_sm90")})


def test_exhaustive_study_over_two_families_picks_fwd_sm90():
    key = ProblemKey("fwd", "sm_90a", "bf16", 128, False, 4096)
    cands = space.candidates(key, H200)
    small = [cands[0]] + [s for s in cands if s.kind == "fwd_v2"][1:6] + [s for s in cands if s.kind == "fwd_sm90"][:6]
    small.append(_sm90(key))
    obj = MeasuredObjective(H200, build=FakeBuild(), check=lambda s: "", timer=fake_time_two)
    res = study.collect(key, study.run_study(key, obj, small, n_trials=len(small)), small)
    assert res.mode == "exhaustive" and [t.spec for t in res.trials] == small
    assert res.best.spec == _sm90(key)
    entry = store.entry_from_result(res, "measured")
    assert entry["spec"].kind == "fwd_sm90" and entry["baseline"]["spec"].kind == "fwd_v2"


def test_tpe_study_over_two_families():
    """TPE over a family choice plus each family's knobs: seeded, bounded, both families tried,
    and the fake objective's fwd_sm90 optimum region is found."""
    key = ProblemKey("fwd", "sm_90a", "bf16", 128, False, 4096)
    cands = space.candidates(key, H200)
    choices = space.knob_choices(key, cands)
    assert list(choices) == ["fwd_v2", "fwd_sm90"] and "warps" not in choices["fwd_sm90"]
    runs = []
    for _ in range(2):
        obj = MeasuredObjective(H200, build=FakeBuild(), check=lambda s: "", timer=fake_time_two)
        res = study.collect(key, study.run_study(key, obj, cands, n_trials=30, seed=5), cands)
        assert res.mode == "tpe" and res.trials[0].spec == cands[0]
        evaluated = [t for t in res.trials if not (t.status == "constraint" and "statically" in t.reason)]
        assert len(evaluated) == 30
        assert {t.spec.kind for t in evaluated} == {"fwd_v2", "fwd_sm90"}
        assert all(t.spec in set(cands) for t in evaluated)
        assert res.best.spec.kind == "fwd_sm90"
        runs.append([(t.spec, t.status) for t in res.trials])
    assert runs[0] == runs[1]


def test_tune_kind_scope():
    from types import SimpleNamespace

    from flashgen.errors import FlashgenError
    from flashgen.tuner.run import parse_scope

    def args(**kw):
        base = dict(gpu="h200", smem=None, kind="fwd", d="128", dtype="bf16", causal="both", seqlens="2048",
                    trials=10, workers=1, jobs=1, seed=0, time_budget=None, stale_after=120.0, worker_only=True,
                    out=None)
        base.update(kw)
        return SimpleNamespace(**base)

    prof, keys, only = parse_scope(args())
    assert only is None and {k.kind for k in keys} == {"fwd"}
    assert space.families(keys[0], only) == ("fwd_sm90", "fwd_v2")  # the problem's preference order
    prof, keys, only = parse_scope(args(kind="fwd_v2"))
    assert only == ("fwd_v2",) and {k.kind for k in keys} == {"fwd"}
    assert {s.kind for s in space.candidates(keys[0], prof, only)} == {"fwd_v2"}
    prof, keys, only = parse_scope(args(gpu="a100"))
    assert space.families(keys[0], only) == ("fwd_v2",)
    with pytest.raises(FlashgenError, match="no kernel family serves it on a100"):
        parse_scope(args(gpu="a100", kind="fwd_sm90"))
    with pytest.raises(FlashgenError, match="known kinds"):
        parse_scope(args(kind="fwd_v3"))


def test_confirm_step_undoes_a_lucky_screening_time():
    """Screening times once; a candidate that was lucky then (fast first call) loses the interleaved
    re-timing of the finalists, and the truly fastest wins. The screening time is kept in info."""
    cands = space.candidates(KEY, H200)
    true_best = next(s for s in cands if (s.block_m, s.block_n, s.stages, s.refill, s.warps) == (128, 64, 3, 1, 4))
    lucky = next(s for s in cands if (s.block_m, s.block_n, s.stages, s.refill, s.warps) == (128, 32, 2, 0, 4))
    calls: dict = {}

    def timer(key, spec):
        calls[spec] = calls.get(spec, 0) + 1
        if spec == lucky and calls[spec] == 1:
            return 0.5  # one fast outlier at screening
        return fake_time(key, spec)

    from flashgen.codegen import Report

    class Clean:  # every candidate compiles clean, the baseline (a 192-wide tile) too
        report = Report(registers=200, spill_stores=0, spill_loads=0, stack_frame=0, static_smem=0)

    obj = MeasuredObjective(H200, build=lambda spec: Clean(), check=lambda s: "", timer=timer)
    res = study.collect(KEY, study.run_study(KEY, obj, cands, n_trials=len(cands)), cands)
    assert res.baseline_trial.status == "ok"
    assert res.best.spec == lucky  # screening alone picks the outlier
    res = study.confirm_finalists(res, obj)
    assert res.best.spec == true_best
    lucky_rec = next(t for t in res.trials if t.spec == lucky)
    assert lucky_rec.info["screen_ms"] == 0.5 and lucky_rec.time_ms == fake_time(KEY, lucky)
    assert res.baseline_trial.info.get("screen_ms") is not None  # the baseline is re-timed too


# -- the backward's keys (flashgen tune --kind bwd) -------------------------------------------
BWD_KEY = ProblemKey("bwd_dkdv", "sm_90a", "bf16", 128, True, 4096)


@pytest.mark.parametrize("gpu", ["a100", "h200", "l4"])
@pytest.mark.parametrize("kind", ["bwd_dkdv", "bwd_dkdv_nodq", "bwd_dq"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_bwd_candidates_validate_and_fit(gpu, kind, d):
    """Every backward candidate is a spec of the key's kind that validates, fits the shared memory and
    the accumulator limit; the baseline (first) is dispatch's default rule; the sweep's sizes are in."""
    prof = gpus.get(gpu)
    key = ProblemKey(kind, prof.arch, "bf16", d, False, 2048)
    if (gpu, d) == ("l4", 256) and kind != "bwd_dq":  # K, V, a Q/dO ring of 32 rows: 102400 B > 101376
        with pytest.raises(ValueError, match="no spec of"):
            space.candidates(key, prof)
        return
    cands = space.candidates(key, prof)
    assert len(cands) == len(set(cands)) >= (1 if (gpu, d) == ("l4", 256) else 2)
    try:
        rule = families.default_spec(key, prof.smem_per_block)
    except UnsupportedError:  # no default tile fits (bwd_dkdv d=128 on an L4): the first candidate stands in
        rule = None
    assert space.baseline(key, prof) == rule and cands[0] == (rule or cands[0])
    assert {s.kind for s in cands} <= set(families.serving(kind, prof.arch))
    for s in cands:
        assert s.validate() is s and s.check(prof) == []
        assert s.smem_bytes() <= prof.smem_per_block
        assert (s.arch, s.dtype, s.causal, s.refill) == (prof.arch, "bf16", False, 0)
        if s.kind == kind:  # the mma.sync backward family (another serving family has its own tile rules)
            assert s.head_dim == d and s.warps in (4, 8) and s.stages in (2, 3)
    if (gpu, d) == ("h200", 128):  # the hand sweep's (bench/sweep_bwd.py) winners and FA2's tile
        sizes = {(s.block_m, s.block_n, s.warps) for s in cands}
        assert {(32, 128, 8), (128, 64, 8), (64, 64, 8), (64, 128, 8)} <= sizes
    bigger = [s for s in space.candidates(key, gpus.with_smem(prof, 10**6))]
    assert len(bigger) >= len(cands)  # the budget is what cuts the space


def test_bwd_problem_keys_follow_the_dq_mode():
    """--kind bwd: per head dim the main kernel of dispatch's dQ mode, on the backward's tile
    (224 runs on 256, and on sm_90a 160 on 192): the mma.sync kernel's mode (separate at 96 and 160) where it
    is the default, the dK/dV kernel with dQ where bwd_sm90 serves; a key kind by name: that kind."""
    assert families.bwd.dq_mode(96) == "separate" and families.bwd.dq_mode(128) == "atomic"
    keys = space.problem_keys("bwd", "sm_90a", ["bf16"], [64, 96, 128, 160, 224], [True], [2048])
    got = {(k.kind, k.head_dim) for k in keys}
    assert got == {("bwd_dkdv", 64), ("bwd_dkdv", 96), ("bwd_dkdv", 128), ("bwd_dkdv", 192), ("bwd_dkdv", 256)}
    keys = space.problem_keys("bwd", "sm_80", ["bf16"], [64, 96, 160], [True], [2048])
    assert {(k.kind, k.head_dim) for k in keys} == {("bwd_dkdv", 64), ("bwd_dkdv_nodq", 96), ("bwd_dkdv_nodq", 160)}
    keys = space.problem_keys("bwd_dq", "sm_80", ["fp16"], [56], [False, True], [512, 1024])
    assert {(k.kind, k.head_dim, k.dtype) for k in keys} == {("bwd_dq", 64, "fp16")} and len(keys) == 4
    assert all(space.is_backward(k) for k in space.BWD_KEY_MODES) and not space.is_backward("fwd")
    # the tables' list of backward key kinds (which keys record the default rule as their baseline) is the tuner's
    assert set(tables.BACKWARD_KEY_KINDS) == set(space.BWD_KEY_MODES)
    assert space.problem_shape(BWD_KEY) == (4, 16, 4096, 128)  # hidden 2048, 16k tokens, as the forward
    assert space.key_flops(BWD_KEY) == 2.5 * space.key_flops(ProblemKey("fwd", *list(vars(BWD_KEY).values())[1:]))


def test_bwd_tune_scope_and_argument_errors(capsys):
    from types import SimpleNamespace

    from flashgen.cli import main
    from flashgen.errors import FlashgenError
    from flashgen.tuner.run import parse_scope

    def args(**kw):
        base = dict(gpu="h200", smem=None, kind="bwd", d="64,128", dtype="bf16", causal="both",
                    seqlens="2048,16384", trials=10, workers=1, jobs=1, seed=0, time_budget=None, stale_after=120.0,
                    worker_only=True, out=None)
        base.update(kw)
        return SimpleNamespace(**base)

    prof, keys, only = parse_scope(args())
    assert only is None and len(keys) == 2 * 2 * 2 and {k.kind for k in keys} == {"bwd_dkdv"}
    prof, keys, only = parse_scope(args(kind="bwd_dkdv_nodq", gpu="a100"))
    assert {(k.kind, k.arch) for k in keys} == {("bwd_dkdv_nodq", "sm_80")}
    for kind in ("bwd_preprocess", "bwd_convert", "decode_split", "standard_qk"):  # not tuned: their rules serve
        with pytest.raises(FlashgenError, match="known kinds"):
            parse_scope(args(kind=kind))
    for argv, msg in ((["--kind", "bwd_convert"], "known kinds"), (["--kind", "bwd", "--d", "12"], "multiples of 8"),
                      (["--kind", "bwd", "--seqlens", "3000"], "buckets"),
                      (["--kind", "bwd_dq", "--causal", "sometimes"], "--causal"),
                      (["--kind", "bwd", "--trials", "0"], "--trials")):
        assert main(_with_options(["tune", "--gpu", "h200", "--d", "64", "--model", "--quiet"], argv)) == 2
        assert msg in capsys.readouterr().err


def fake_bwd_time(key, spec):
    """One best backward tile (64 x 128, 8 warps, 2 stages); fewer warps and 32-wide tiles slower."""
    return 2.0 + abs(spec.block_n - 128) / 200 + abs(spec.block_m - 64) / 300 + (spec.warps != 8) * 0.3 \
        + (spec.stages - 2) * 0.01


def test_exhaustive_bwd_study_picks_the_fastest():
    """A backward key through the forward's study, confirm and store code: every candidate once, the
    ptxas refusals recorded, the fastest that passes wins, the entry's TFLOP/s count the backward."""
    from flashgen.codegen import Report
    from flashgen.errors import CompileError

    def build(spec):  # 128 keys with 3 stages spill; 32 x 32 tiles fail to compile
        if spec.block_m == spec.block_n == 32:
            raise CompileError("NVRTC failed (fake)")
        spills = 40 if spec.block_n == 128 and spec.stages == 3 else 0
        return type("B", (), {"report": Report(registers=240, spill_stores=spills, spill_loads=spills,
                                                stack_frame=spills, static_smem=0)})()

    cands = space.candidates(BWD_KEY, H200)
    obj = MeasuredObjective(H200, build=build, check=lambda s: "wrong (fake)" if s.block_m == 128 else "",
                            timer=fake_bwd_time)
    assert len(cands) <= 100  # exhaustive at the default --trials
    res = study.collect(BWD_KEY, study.run_study(BWD_KEY, obj, cands, n_trials=100), cands)
    res = study.confirm_finalists(res, obj)
    assert res.mode == "exhaustive" and [t.spec for t in res.trials] == cands
    status = {t.spec: t.status for t in res.trials}
    for s in cands:
        if s.block_m == s.block_n == 32:
            assert status[s] == "compile_error"
        elif s.block_n == 128 and s.stages == 3:
            assert status[s] == "constraint"
        elif s.block_m == 128:
            assert status[s] == "wrong"
        else:
            assert status[s] == "ok"
    assert min(res.failures().get(k, 0) for k in ("compile_error", "constraint", "wrong")) > 0
    passing = [s for s in cands if status[s] == "ok"]
    best = min(passing, key=lambda s: fake_bwd_time(BWD_KEY, s))
    assert res.best.spec == best and (best.block_m, best.block_n, best.warps, best.stages) == (64, 128, 8, 2)
    assert all(t.info["model_ms"] > 0 for t in res.trials if t.status in ("ok", "wrong"))
    entry = store.entry_from_result(res, "measured")
    assert entry["spec"] == best and entry["baseline"]["spec"] == families.default_spec(BWD_KEY, H200.smem_per_block)
    assert entry["tflops"] == pytest.approx(2.5 * cost.flops(4, 16, 4096, 4096, 128, True) / (res.best.time_ms * 1e9))


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, dout, q, k, v, out, lse, causal, scale, **kw):
        import torch

        self.calls.append(dict(shape=tuple(q.shape), dout=tuple(dout.shape), causal=causal, scale=scale, **kw))
        return tuple(torch.empty_like(t) for t in (q, k, v))


def test_bwd_objective_times_the_whole_backward_with_the_spec_forced(monkeypatch):
    """The measured objective's backward timer: one attention_backward per call at the key's shape, in
    the key kind's dQ mode, with the spec forced for that kind only (dispatch serves the rest)."""
    import torch

    import flashgen.api
    from flashgen.tuner import objective

    rec = _Recorder()
    monkeypatch.setattr(flashgen.api, "attention_backward", rec)
    monkeypatch.setattr(flashgen.api, "attention", lambda q, k, v, causal, return_lse: (
        torch.empty_like(q), torch.empty(q.shape[:3], device=q.device)))
    monkeypatch.setattr(objective, "median_ms", lambda fn: (fn(), 3.5)[1])
    obj = MeasuredObjective(H200, build=FakeBuild())
    obj.device = "meta"  # no memory, no GPU: only the calls are looked at
    for kind, mode in (("bwd_dkdv", "atomic"), ("bwd_dkdv_nodq", "separate"), ("bwd_dq", "separate")):
        key = ProblemKey(kind, "sm_90a", "bf16", 128, True, 4096)
        spec = families.default_spec(key, H200.smem_per_block)
        assert obj.timer(key, spec) == 3.5
        call = rec.calls[-1]
        assert call["shape"] == call["dout"] == (4, 16, 4096, 128) and call["causal"] is True
        assert call["dq_mode"] == mode and call["specs"] == {kind: spec} and call["scale"] == 128 ** -0.5


def test_bwd_objective_check_uses_the_gradient_rule(monkeypatch):
    """The backward check on a CPU stand-in: reference gradients pass, a wrong dK fails with its
    error, and every call forces the spec (odd sizes, GQA, a masked head-dim tail)."""
    import torch

    import flashgen.api
    from flashgen.reference import reference

    spec = families.default_spec(ProblemKey("bwd_dkdv", "sm_80", "bf16", 64, True, 512),
                                 gpus.get("a100").smem_per_block)
    seen = []

    def exact(dout, q, k, v, out, lse, causal, scale, dq_mode, specs, bad=None):
        seen.append((q.shape, k.shape, dq_mode, specs))
        leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
        reference(*leaves, causal, scale)[0].backward(dout.float())
        grads = [t.grad.to(q.dtype) for t in leaves]
        if bad is not None:
            grads[bad] = grads[bad] + 1.0
        return grads

    monkeypatch.setattr(flashgen.api, "attention", lambda q, k, v, causal, return_lse: (None, None))
    obj = MeasuredObjective(gpus.get("a100"), build=FakeBuild())
    obj.device = "cpu"
    monkeypatch.setattr(flashgen.api, "attention_backward", exact)
    assert obj.check(spec) == ""
    assert {s[2] for s in seen} == {"atomic"} and all(s[3] == {"bwd_dkdv": spec} for s in seen)
    assert seen[0][0] == (2, 4, 203, 56) and seen[0][1] == (2, 2, 317, 56)
    monkeypatch.setattr(flashgen.api, "attention_backward", lambda *a, **kw: exact(*a, **kw, bad=1))
    assert obj.check(spec).startswith("dk: max error")


def test_bwd_cost_model():
    """Crude but sane: finite, under the datasheet rate, causal cheaper, dQ atomics cost, no-fit is inf."""
    shape = space.problem_shape(BWD_KEY)
    spec = families.default_spec(BWD_KEY, H200.smem_per_block, family="bwd_dkdv")  # the mma.sync kernel
    t = cost.estimate(spec, shape, H200, registers=240)
    assert 0 < space.key_flops(BWD_KEY) / t < H200.peak_flops
    full = cost.estimate(spec.replace(causal=False), shape, H200, registers=240)
    assert 0.4 * full < t < 0.8 * full
    nodq = cost.estimate(spec.replace(kind="bwd_dkdv_nodq"), shape, H200, registers=240)
    assert nodq < t
    assert math.isinf(cost.estimate(spec, shape, H200, registers=10_000))
    for kind in space.BWD_KEY_MODES:  # every candidate of every backward kind gets a finite estimate
        key = ProblemKey(kind, "sm_90a", "bf16", 64, False, 16384)
        for s in space.candidates(key, H200):
            assert 0 < cost.estimate(s, space.problem_shape(key), H200, 128) < math.inf


def _bwd_table(entries):
    t = tables.Table(meta=tables.make_meta(H200, "measured"))
    for key, spec, ms in entries:
        t.entries[key] = {"spec": spec, "time_ms": ms, "tflops": 150.0, "source": "measured",
                          "baseline": {"spec": space.baseline(key, H200), "time_ms": ms * 1.1}, "speedup": 1.1,
                          "runners_up": [{"spec": space.baseline(key, H200), "time_ms": ms * 1.1}], "trials": 20,
                          "candidates": 23, "failures": {"constraint": 3}}
    return t


def _bwd_spec(key, bm, bn, w=8, st=2):
    return space.make_spec(key, key.kind, block_m=bm, block_n=bn, warps=w, stages=st).validate()


def test_bwd_entries_round_trip_and_dispatch_reads_them(shipped_dir, capsys, monkeypatch):
    """bwd keys in a table of the current format: written, read back equal, listed by `flashgen show`, picked by
    dispatch (the launch path's select too), beside a forward entry; other keys keep the default rule."""
    from flashgen.cli import main

    dkdv = BWD_KEY
    dq = ProblemKey("bwd_dq", "sm_90a", "bf16", 64, False, 16384)
    fwd_key = ProblemKey("fwd", "sm_90a", "bf16", 64, False, 1024)
    s_dkdv, s_dq = _bwd_spec(dkdv, 64, 128), _bwd_spec(dq, 128, 32, w=4, st=3)
    assert s_dkdv != families.default_spec(dkdv, H200.smem_per_block)
    table = _bwd_table([(dkdv, s_dkdv, 6.0), (dq, s_dq, 20.0)])
    table.entries[fwd_key] = _table(entries=[(fwd_key, _spec_for(fwd_key, block_n=64, stages=2), 1.0)]).entries[fwd_key]
    path = tables.save(table, shipped_dir / "h200.yaml")
    back = tables.load(path, gpu="h200")
    assert back.meta["format"] == tables.FORMAT and set(back.entries) == {dkdv, dq, fwd_key}
    for key in (dkdv, dq):
        assert back.entries[key]["spec"] == table.entries[key]["spec"]
        assert back.entries[key]["baseline"]["spec"] == space.baseline(key, H200)
        assert back.entries[key]["runners_up"][0]["spec"] == space.baseline(key, H200)
    assert tables.dump(back) == tables.dump(table)
    assert "kind: bwd_dkdv, arch" in path.read_text()
    dispatch.clear()
    assert dispatch.select(dkdv, "h200", H200.smem_per_block) == s_dkdv
    assert dispatch.select(dq, "h200", H200.smem_per_block) == s_dq
    other = ProblemKey("bwd_dkdv", "sm_90a", "bf16", 128, True, 2048)  # another bucket: the default rule
    assert dispatch.select(other, "h200", H200.smem_per_block) == families.default_spec(other, H200.smem_per_block)
    # the launch path's lookup (flashgen.api.backward: the key of the input head dim and query length,
    # bwd_head_dim_tile and bucket_of; the dK/dV family the call needs; a verified select)
    pytest.importorskip("torch")
    from flashgen.api.backward import dkdv_family

    launch_key = families.problem_key("bwd_dkdv", "sm_90a", "bf16", 120, True, 4000)
    assert launch_key == ProblemKey("bwd_dkdv", "sm_90a", "bf16", bwd_head_dim_tile(120, "sm_90a"), True,
                                    bucket_of(4000))
    monkeypatch.setattr(dispatch, "resource_problems", lambda s: [])
    dispatch.clear()
    assert dispatch.select(launch_key, "h200", H200.smem_per_block, verify=True,
                           family=dkdv_family(launch_key)) == s_dkdv
    dispatch.clear()
    assert main(["show", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "bwd_dkdv-sm_90a-bf16-d128-causal-n4096" in out and s_dkdv.name in out
    assert "bwd_dq-sm_90a-bf16-d64-full-n16384" in out and s_dq.name in out


def test_bwd_entry_of_another_kernel_is_refused(tmp_path):
    """A bwd_dkdv key holding a bwd_dq spec (or one for another head-dim tile) is a ConfigError."""
    doc = yaml.safe_load(tables.dump(_bwd_table([(BWD_KEY, _bwd_spec(BWD_KEY, 64, 64), 6.0)])))
    wrong = _bwd_spec(ProblemKey("bwd_dq", *list(vars(BWD_KEY).values())[1:]), 64, 64)
    for record, message in ((wrong.to_dict(), "bwd_dq kernel, which does not serve bwd_dkdv"),
                            ({**doc["entries"][0]["spec"], "head_dim": 64}, "does not match its key")):
        bad = yaml.safe_load(yaml.safe_dump(doc))
        bad["entries"][0]["spec"] = record
        with pytest.raises(ConfigError, match=message):
            tables.load(_write(tmp_path, bad), gpu="h200")


def test_a_tuned_bwd_entry_that_spills_here_falls_back_to_the_rule(shipped_dir, monkeypatch):
    """verify=True (the launch path): a tuned bwd entry this NVRTC refuses gives way to the default
    rule, checked the same way; a clean one is used as tuned."""
    tuned = _bwd_spec(BWD_KEY, 64, 128)
    tables.save(_bwd_table([(BWD_KEY, tuned, 6.0)]), shipped_dir / "h200.yaml")
    dispatch.clear()
    rule = families.default_spec(BWD_KEY, H200.smem_per_block)
    monkeypatch.setattr(dispatch, "resource_problems", lambda s: ["spills: 16 B stored"] if s == tuned else [])
    dispatch.clear()
    assert dispatch.select(BWD_KEY, "h200", H200.smem_per_block, verify=True) == rule
    assert dispatch.select(BWD_KEY, "h200", H200.smem_per_block) == tuned
    monkeypatch.setattr(dispatch, "resource_problems", lambda s: [])
    dispatch.clear()
    assert dispatch.select(BWD_KEY, "h200", H200.smem_per_block, verify=True) == tuned


def test_tune_bwd_model_mode_writes_bwd_entries(tmp_path, capsys):
    """`flashgen tune --kind bwd --model` end to end without a GPU: compiles, ranks by the cost model,
    writes bwd_dkdv entries beside what the file had, and `show` lists them."""
    from flashgen.cli import main

    out = tmp_path / "a100.yaml"
    fwd_key = ProblemKey("fwd", "sm_80", "bf16", 64, False, 1024)
    tables.save(_table(gpu="a100", source="model", entries=[(fwd_key, _spec_for(fwd_key, block_n=64, stages=2), 1.0)]),
               out)
    code = main(["tune", "--gpu", "a100", "--kind", "bwd", "--d", "64", "--seqlens", "2048", "--causal", "true",
                 "--trials", "3", "--model", "--out", str(out), "--quiet", "--jobs", "1"])
    assert code == 0
    table = tables.load(out, gpu="a100")
    key = ProblemKey("bwd_dkdv", "sm_80", "bf16", 64, True, 2048)
    assert set(table.entries) == {fwd_key, key}
    entry = table.entries[key]
    assert entry["source"] == "model" and entry["spec"].kind == "bwd_dkdv"
    assert entry["baseline"]["spec"] == families.default_spec(key, gpus.get("a100").smem_per_block)
    assert entry["time_ms"] <= entry["baseline"]["time_ms"] and entry["trials"] >= 3  # (+ refusals)
    assert "median gain over the default-rule baseline" in capsys.readouterr().out
    assert main(["show", "--config", str(out)]) == 0
    assert "bwd_dkdv-sm_80-bf16-d64-causal-n2048" in capsys.readouterr().out


def test_tune_bwd_measured_flow_with_fakes(tmp_path, monkeypatch, capsys):
    """The device command's path (measured mode) with a fake GPU: the estimate is logged before
    measuring, every candidate of each key runs once (exhaustive), the confirm step re-times the
    finalists, and the fastest passing spec of each key is written, the forward entries kept."""
    from flashgen.cli import main
    from flashgen.codegen import Report
    from flashgen.tuner import run

    clean = type("B", (), {"report": Report(registers=200, spill_stores=0, spill_loads=0, stack_frame=0,
                                            static_smem=0)})()
    timed = []

    def timer(key, spec):
        timed.append((key, spec))
        return fake_bwd_time(key, spec) * key.bucket / 2048

    monkeypatch.setattr(run, "gpu_mode", lambda profile, want_model: ("measured", "NVIDIA H200 (fake)"))
    monkeypatch.setattr(run, "precompile", lambda specs, jobs, log=None: {})
    monkeypatch.setattr(run, "MeasuredObjective", lambda profile: MeasuredObjective(
        profile, build=lambda spec: clean, check=lambda spec: "", timer=timer))
    out = tmp_path / "h200.yaml"
    fwd_key = ProblemKey("fwd", "sm_90a", "bf16", 64, False, 1024)
    tables.save(_table(entries=[(fwd_key, _spec_for(fwd_key, block_n=64, stages=2), 1.0)]), out)
    code = main(["tune", "--gpu", "h200", "--kind", "bwd", "--d", "64,128", "--seqlens", "2048,16384",
                 "--causal", "true", "--out", str(out), "--report", str(tmp_path / "r.json")])
    assert code == 0
    err = capsys.readouterr().err
    assert "tuning 4 keys (bwd_dkdv)" in err and "estimate: ~" in err
    assert err.index("estimate: ~") < err.index("[1/4]")
    table = tables.load(out, gpu="h200")
    keys = [ProblemKey("bwd_dkdv", "sm_90a", "bf16", d, True, n) for d in (64, 128) for n in (2048, 16384)]
    assert set(table.entries) == {fwd_key, *keys}
    for key in keys:
        cands = space.candidates(key, H200)
        assert sum(1 for k, _ in timed if k == key) == len(cands) + 3 * 4  # every candidate + confirm rounds
        entry = table.entries[key]
        assert entry["spec"] == min(cands, key=lambda s: fake_bwd_time(key, s)) and entry["candidates"] == len(cands)
        assert entry["source"] == "measured" and entry["speedup"] >= 1.0
    assert table.meta["source"] == "measured"


def test_without_refused_swaps_in_the_fastest_clean_runner_up():
    """Shipping a device table (bench/ship_table.py): a winner this NVRTC refuses gives way to its
    fastest clean runner-up with that one's time; with no clean runner-up the entry is dropped."""
    k1, k2 = BWD_KEY, ProblemKey("bwd_dkdv", "sm_90a", "bf16", 64, False, 8192)
    w1, r1a, r1b = _bwd_spec(k1, 64, 128), _bwd_spec(k1, 32, 128), _bwd_spec(k1, 128, 64)
    w2 = _bwd_spec(k2, 64, 128)
    t = _bwd_table([(k1, w1, 5.0), (k2, w2, 9.0)])
    t.entries[k1]["runners_up"] = [{"spec": r1b, "time_ms": 5.2}, {"spec": r1a, "time_ms": 5.1}]
    t.entries[k2]["runners_up"] = [{"spec": _bwd_spec(k2, 64, 64), "time_ms": 9.5}]
    refused = {w1, r1a, w2, _bwd_spec(k2, 64, 64)}
    out, changes = store.without_refused(t, lambda s: ["spills: 8 B stored"] if s in refused else [])
    assert set(out.entries) == {k1} and len(changes) == 2
    e = out.entries[k1]
    assert e["spec"] == r1b and e["time_ms"] == 5.2 and e["runners_up"] == []
    assert e["speedup"] == pytest.approx(5.5 / 5.2) and e["tflops"] == pytest.approx(150.0 * 5.0 / 5.2)
    assert "dropped" in changes[1] and w2.name in changes[1] and r1b.name in changes[0]
    same, none = store.without_refused(t, lambda s: [])
    assert none == [] and same.entries == t.entries


def test_with_preferred_promotes_the_best_ranked_recorded_runner_up():
    """bench/ship_table.py --ab: each key goes to the first of the A/B's ranking that is its winner (kept)
    or a recorded runner-up (promoted with its recorded time; the old winner joins the runners-up); a
    ranking with neither leaves the entry alone."""
    k1, k2 = BWD_KEY, ProblemKey("bwd_dkdv", "sm_90a", "bf16", 64, False, 8192)
    w1, r1a, r1b = _bwd_spec(k1, 64, 128), _bwd_spec(k1, 32, 128), _bwd_spec(k1, 128, 64)
    w2, other = _bwd_spec(k2, 64, 128), _bwd_spec(k2, 64, 64)
    t = _bwd_table([(k1, w1, 5.0), (k2, w2, 9.0)])
    t.entries[k1]["runners_up"] = [{"spec": r1b, "time_ms": 5.2}, {"spec": r1a, "time_ms": 5.1}]
    unknown = "bwd_sm90_not_a_recorded_spec"
    out, changes = store.with_preferred(t, {k1: [unknown, r1b.name, w1.name], k2: [other.name, unknown]})
    e = out.entries[k1]
    assert e["spec"] == r1b and e["time_ms"] == 5.2 and e["speedup"] == pytest.approx(5.5 / 5.2)
    assert [r["spec"] for r in e["runners_up"]] == [w1, r1a]  # by time: 5.0, 5.1
    assert out.entries[k2] == t.entries[k2] and t.entries[k1]["spec"] == w1  # the input is not changed
    assert len(changes) == 2 and r1b.name in changes[0] and "no preferred spec recorded" in changes[1]
    kept, lines = store.with_preferred(t, {k1: [w1.name, r1b.name]})
    assert kept.entries[k1] == t.entries[k1] and "kept" in lines[0]


def test_space_restrict_narrows_candidates_and_rejects_bad_values():
    """--space KNOB=V1,V2 keeps only the candidates whose knob takes one of the values (the baseline stays
    first); an unknown knob or a value outside the family's tune space is a clear error."""
    prof = gpus.get("h200")
    key = ProblemKey("fwd", "sm_90a", "bf16", 128, True, 8192)
    kinds = space.families(key, None)
    full = space.candidates(key, prof)
    r = space.parse_restrict(["early_k_release=false", "block_n=64,128", "persistent=true"], kinds)
    assert r == {"early_k_release": {False}, "block_n": {64, 128}, "persistent": {True}}
    narrow = space.candidates(key, prof, None, r)
    assert narrow[0] == full[0] and 1 < len(narrow) < len(full)
    sm90 = [s for s in narrow[1:] if s.kind == "fwd_sm90"]
    assert sm90 and all(s.block_n in (64, 128) and not s.early_k_release and s.persistent for s in sm90)
    assert set(narrow) <= set(full)
    for bad in (["nosuch=1"], ["block_n=72"], ["early_k_release"], ["persistent=maybe"], ["sepkv=false"]):
        with pytest.raises(ValueError, match="--space"):
            space.parse_restrict(bad, kinds)


def test_tune_two_workers_model_mode_one_study(tmp_path):
    """`tune --workers 2` (model mode, no GPU): worker 0 runs in this process beside one spawned copy, on
    one journal study: every candidate exactly once, the table written. (Which worker takes how many trials
    is a race here -- the spawned copy starts seconds late on fast model trials; test_two_processes_share_
    one_study starts both alike and checks both contribute.)"""
    import json

    from flashgen.cli import main

    out, report = tmp_path / "a100.yaml", tmp_path / "report.json"
    argv = ["tune", "--gpu", "a100", "--d", "64", "--causal", "false", "--seqlens", "512,1024", "--model",
            "--space", "block_m=64,128", "block_n=32,64", "stages=2", "--trials", "400",
            "--storage", f"journal:{tmp_path / 'j.log'}", "--out", str(out), "--report", str(report), "--quiet"]
    assert main(argv + ["--workers", "2"]) == 0
    keys = json.loads(report.read_text())["keys"]
    assert 1 <= len({t["worker"] for k in keys for t in k["trial_log"]}) <= 2
    for k in keys:
        names = [t["spec"] for t in k["trial_log"]]
        assert len(names) == len(set(names)) == k["candidates"]
    assert len(tables.load(out, gpu="a100").entries) == 2


def test_run_workers_spawns_the_others_and_runs_worker_0_here(monkeypatch):
    """_start_workers(n=3, measured): two gated copies with --worker-index 1 and 2, each seeing the matching
    device of this process's CUDA_VISIBLE_DEVICES; _run_workers opens their gates, runs worker 0 in this
    process (labelled with its GPU), and fails after all have finished if a copy failed."""
    from flashgen.errors import FlashgenError
    from flashgen.tuner import run

    started, ran, events = [], [], []

    class FakeProc:
        def __init__(self, cmd, env, stdin):
            started.append((cmd, env["CUDA_VISIBLE_DEVICES"]))
            self.code = 0 if len(started) == 1 else 3
            self.stdin = type("Pipe", (), {"close": lambda _: events.append("gate")})()

        def wait(self):
            events.append("wait")
            return self.code

    monkeypatch.setattr(run.subprocess, "Popen", FakeProc)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    procs = run._start_workers(["--gpu", "h200"], 3, "measured", "journal:/x")
    assert [(c[c.index("--worker-index") + 1], dev, "--gate" in c) for c, dev in started] == [
        ("1", "6", True), ("2", "7", True)]
    assert events == []  # held at the gate until the compile step is done

    def work(label):
        events.append("work")
        ran.append(label)

    with pytest.raises(FlashgenError, match=r"exited with \[0, 3\]"):
        run._run_workers(procs, 3, "measured", lambda m: None, work)
    assert events == ["gate", "gate", "work", "wait", "wait"]
    assert len(ran) == 1 and ran[0].endswith(":gpu4")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert run._visible_devices(2) == ["0", "1"]


def test_gated_workers_are_killed_when_the_compile_step_fails(monkeypatch, tmp_path):
    """If this process fails before opening the gate (here: the compile step), the started copies are
    killed, never released to run trials."""
    from flashgen.cli import main
    from flashgen.tuner import run

    killed = []

    class FakeProc:
        def __init__(self, cmd, env, stdin):
            self.stdin = None

        def kill(self):
            killed.append(True)

    def broken(*a, **k):
        raise RuntimeError("compile step failed")

    monkeypatch.setattr(run.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(run, "precompile", broken)
    code = main(["tune", "--gpu", "a100", "--d", "64", "--causal", "false", "--seqlens", "512", "--model",
                 "--workers", "2", "--storage", f"journal:{tmp_path / 'j.log'}", "--out", str(tmp_path / "t.yaml")])
    assert code == 2  # one line on stderr, no traceback (the CLI's rule), and the gated copies killed
    assert killed == [True]
