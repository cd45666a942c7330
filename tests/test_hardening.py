"""Nothing lost, nothing misleading (no GPU): tables under concurrent writers and hostile files, the
binary cache under bad metadata and unusable locations, input bounds and aliasing, and the command
line's one-line errors."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import warnings

import pytest
import torch
import yaml

import flashgen
from flashgen import ConfigError, KernelSpec, UnsupportedError, dispatch, gpus, tables
from flashgen.api.checks import check_attention_inputs, checked_scale
from flashgen.codegen import compiler
from flashgen.problem import BUCKETS, ProblemKey

from cli_util import run_main

H200 = gpus.get("h200")


def _entry(spec, ms, source="measured"):
    return {"spec": spec, "time_ms": ms, "tflops": 100.0, "source": source, "baseline": None, "speedup": None,
            "runners_up": [], "trials": 1, "candidates": 1, "failures": {}}


def _fwd_v2(key, **kw):
    fields = dict(kind="fwd_v2", arch=key.arch, dtype=key.dtype, head_dim=key.head_dim, causal=key.causal,
                  block_m=128, block_n=32, warps=4, stages=3)
    fields.update(kw)
    return KernelSpec(**fields).validate()


def _keys():
    """96 distinct forward keys of the H200 (what a d=32..256 tuning run of one dtype writes)."""
    return [ProblemKey("fwd", "sm_90a", dt, d, c, b) for dt in ("bf16", "fp16") for d in (32, 64, 96, 128)
            for c in (False, True) for b in BUCKETS[:6]][:96]


# One writer process's share of the keys, one read-merge-write per key (as each tuning run writes). A
# plain interpreter that imports flashgen's tables only (a spawned copy of this module would import torch
# first: seconds per process).
WRITER = """
import sys
from pathlib import Path
from flashgen import gpus, tables
from flashgen.problem import BUCKETS, ProblemKey
from flashgen.spec import KernelSpec
path, index, n = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
keys = [ProblemKey("fwd", "sm_90a", dt, d, c, b) for dt in ("bf16", "fp16") for d in (32, 64, 96, 128)
        for c in (False, True) for b in BUCKETS[:6]][:96]
for key in keys[index * n:(index + 1) * n]:
    t = tables.Table(meta=tables.make_meta(gpus.get("h200"), "measured"))
    spec = KernelSpec(kind="fwd_v2", arch=key.arch, dtype=key.dtype, head_dim=key.head_dim, causal=key.causal,
                      block_m=128, block_n=32, warps=4, stages=3).validate()
    t.entries[key] = {"spec": spec, "time_ms": 1.0 + index, "tflops": 100.0, "source": "measured",
                      "baseline": None, "speedup": None, "runners_up": [], "trials": 1, "candidates": 1,
                      "failures": {}}
    tables.update(path, t)
"""


def test_four_concurrent_writers_lose_no_entry(tmp_path):
    """Four processes merging 24 keys each into one table: all 96 entries survive (the merge runs under
    the folder's lock, each writer reading what the last one wrote)."""
    path = tmp_path / "configs" / "h200.yaml"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(i), "24"], stderr=subprocess.PIPE,
                              text=True) for i in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    table = tables.load(path, gpu="h200")
    assert set(table.entries) == set(_keys())
    assert {e["time_ms"] for e in table.entries.values()} == {1.0, 2.0, 3.0, 4.0}  # every writer's share
    assert not [p for p in path.parent.iterdir() if p.name != "h200.yaml"]  # no lock or temp file left


BOMB = """meta:
  format: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]
  gpu: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
  arch: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
  sms: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
  source: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
  date: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
  versions: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
  smem_per_block: [*g, *g, *g, *g, *g, *g, *g, *g, *g]
entries: []
"""


def test_alias_bomb_is_refused_at_once(tmp_path, flashgen_home):
    path = tmp_path / "h200.yaml"
    path.write_text(BOMB)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="aliases"):
        tables.load(path)
    # and as the user's table, from dispatch's first select
    user = flashgen_home / "configs" / "h200.yaml"
    user.parent.mkdir(parents=True)
    user.write_text(BOMB)
    dispatch.clear()
    with pytest.raises(ConfigError, match="aliases"):
        dispatch.select(ProblemKey("fwd", "sm_90a", "bf16", 128, False, 512), "h200", 232448)
    assert time.monotonic() - t0 < 5
    dispatch.clear()


@pytest.mark.parametrize("make,message", [
    (lambda p: p.mkdir(), "not a regular file"),
    (lambda p: os.mkfifo(p), "not a regular file"),
    (lambda p: os.symlink(p.parent / "nowhere.yaml", p), "not a regular file"),
    (lambda p: os.symlink("/dev/zero", p), "not a regular file"),
    (lambda p: p.write_bytes(b"meta: {}\nentries: []\n" + b"#" * tables.MAX_BYTES), "larger than"),
    (lambda p: p.write_bytes(b"\xff\xfe\x00meta"), "not UTF-8"),
])
def test_a_user_table_that_is_not_a_table_is_an_error(flashgen_home, make, message):
    """A user table that is a directory, a FIFO, a dangling link, /dev/zero, huge or not UTF-8 is a
    ConfigError naming the path, never skipped and never read without bound."""
    path = flashgen_home / "configs" / "h200.yaml"
    path.parent.mkdir(parents=True)
    make(path)
    dispatch.clear()
    with pytest.raises(ConfigError, match=message) as err:
        tables.tables("h200")
    assert str(path) in str(err.value)
    dispatch.clear()


def _doc(tmp_path):
    key = ProblemKey("fwd", "sm_90a", "bf16", 128, True, 4096)
    t = tables.Table(meta=tables.make_meta(H200, "measured"))
    t.entries[key] = _entry(_fwd_v2(key), 1.0)
    return yaml.safe_load(tables.dump(t))


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d["meta"].update(priority=1), "unknown meta field"),
    (lambda d: d["entries"][0].update(note="x"), "unknown entry field"),
    (lambda d: d["entries"][0]["key"].update(arch="sm_80"), "not the table's arch"),
])
def test_unknown_fields_and_foreign_keys_are_refused(tmp_path, mutate, message):
    doc = _doc(tmp_path)
    mutate(doc)
    path = tmp_path / "h200.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=message):
        tables.load(path, gpu="h200")


def test_model_ranked_entries_never_shadow_measured_ones(flashgen_home, monkeypatch):
    """A user table written by --model does not take a key from the shipped measured table; with
    FLASHGEN_PREFER_MODEL it does; a measured user entry always does."""
    key = next(k for k in tables.load(tables.shipped_path("h200"), gpu="h200").entries if k.kind == "fwd")
    shipped = tables.load(tables.shipped_path("h200"), gpu="h200").entries[key]["spec"]
    model = tables.Table(meta=tables.make_meta(H200, "model"))
    other = _fwd_v2(key) if shipped.kind != "fwd_v2" else _fwd_v2(key, block_n=64)
    model.entries[key] = _entry(other, 0.5, source="model")
    tables.save(model, tables.default_path("h200"))
    dispatch.clear()
    assert tables.lookup("h200", key) == shipped
    assert [o for o, _ in tables.ranked("h200", key)] == ["shipped", "user"]
    monkeypatch.setenv("FLASHGEN_PREFER_MODEL", "1")
    dispatch.clear()
    assert tables.lookup("h200", key) == other
    monkeypatch.delenv("FLASHGEN_PREFER_MODEL")
    measured = tables.Table(meta=tables.make_meta(H200, "measured"))
    measured.entries[key] = _entry(other, 0.5)
    tables.save(measured, tables.default_path("h200"))
    dispatch.clear()
    assert tables.lookup("h200", key) == other
    dispatch.clear()


def test_files_honour_the_umask(tmp_path):
    key = ProblemKey("fwd", "sm_90a", "bf16", 128, True, 4096)
    t = tables.Table(meta=tables.make_meta(H200, "measured"))
    t.entries[key] = _entry(_fwd_v2(key), 1.0)
    old = os.umask(0o002)
    try:
        path = tables.save(t, tmp_path / "h200.yaml")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o664


# ---------------------------------------------------------------- the tuner's command line


@pytest.mark.parametrize("extra,message", [
    (["--out", "{tmp}"], "is a directory"),
    (["--out", "{a100}"], "tuned for a100, not h200"),
    (["--out", "{a100}/t.yaml"], "cannot write there"),
    (["--smem", "99999999999"], "--smem 99999999999"),
    (["--seed", "-1"], "--seed"),
    (["--time-budget", "-5"], "--time-budget"),
    (["--stale-after", "0"], "--stale-after"),
    (["--stale-after", "inf"], "--stale-after"),
    (["--storage", "bogus://x"], "--storage 'bogus://x'"),
])
def test_tune_refuses_bad_options_before_any_work(capsys, tmp_path, extra, message):
    a100 = tmp_path / "a100.yaml"
    tables.save(tables.Table(meta=tables.make_meta(gpus.get("a100"), "model")), a100)
    extra = [x.format(tmp=tmp_path, a100=a100) for x in extra]
    t0 = time.monotonic()
    code, out, err = run_main(capsys, "tune", "--gpu", "h200", "--d", "64", "--model", "--seqlens", "512",
                              "--causal", "false", *extra)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert time.monotonic() - t0 < 30  # refused before the compile step (which takes minutes)


def test_tune_without_optuna_says_how_to_install_it(tmp_path):
    code = ("import sys; sys.modules['optuna'] = None\n"
            "from flashgen.cli import main\n"
            "sys.exit(main(['tune', '--gpu', 'a100', '--d', '64', '--model']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "FLASHGEN_HOME": str(tmp_path)})
    assert proc.returncode == 2 and "[tune]" in proc.stderr and "Traceback" not in proc.stderr


def test_journal_collect_skips_a_trial_another_worker_still_runs(tmp_path):
    """A RUNNING trial of another worker (its attributes set, no value yet) is no result: collect skips
    it instead of failing on its missing time."""
    optuna = pytest.importorskip("optuna")
    from flashgen.tuner import space, study

    key = ProblemKey("fwd", "sm_80", "bf16", 64, False, 512)
    specs = space.candidates(key, gpus.get("a100"))[:3]
    url = f"journal:{tmp_path / 'j.log'}"
    storage = study.open_storage(url)
    s = optuna.create_study(study_name=space.key_name(key), storage=storage, direction="minimize")
    done = s.ask()
    done.set_user_attr("spec", specs[0].to_dict())
    done.set_user_attr("status", "ok")
    s.tell(done, 1.0)
    running = s.ask()
    running.set_user_attr("spec", specs[1].to_dict())
    running.set_user_attr("status", "ok")  # recorded before its tell, which has not happened yet
    result = study.collect(key, url, specs)
    assert [t.spec for t in result.trials] == [specs[0]] and result.best.time_ms == 1.0


def test_independent_workers_on_one_study_take_distinct_seeds():
    from types import SimpleNamespace

    from flashgen.tuner import run

    shared = SimpleNamespace(storage="journal:x", workers=1, worker_only=False)
    private = SimpleNamespace(storage=None, workers=1, worker_only=False)
    assert run._seed_offset(private) == 0
    mine = run._seed_offset(shared)
    code = ("from types import SimpleNamespace as S; from flashgen.tuner import run; "
            "print(run._seed_offset(S(storage='journal:x', workers=1, worker_only=False)))")
    theirs = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout)
    assert mine != theirs


# ---------------------------------------------------------------- the binary cache


SPEC = KernelSpec(kind="fwd_v2", arch="sm_80", dtype="fp16", head_dim=64, block_m=64, block_n=64, warps=4,
                  stages=2).validate()


def _entry_folder(flashgen_home):
    from flashgen.codegen import render

    src = render(SPEC)
    return compiler.cache_dir(SPEC.name, compiler.cache_key(src, SPEC.arch)), src


@pytest.mark.parametrize("meta", ["[]", "null", "{", '{"key": 3}'])
def test_malformed_metadata_is_a_miss(flashgen_home, meta):
    folder, src = _entry_folder(flashgen_home)
    compiler.get_binary(src, SPEC.arch, SPEC.name)
    (folder / "meta.json").write_text(meta)
    binary, hit = compiler.get_binary(src, SPEC.arch, SPEC.name)
    assert not hit and binary.report.registers > 0
    assert compiler.get_binary(src, SPEC.arch, SPEC.name)[1]  # rewritten whole: a hit again


def test_an_edited_report_is_a_miss(flashgen_home):
    """The report is covered by the metadata's checksum: setting spill_stores to 0 by hand (hiding a
    spill from the resource check) makes the entry a miss, not a lie."""
    import json

    folder, src = _entry_folder(flashgen_home)
    compiler.get_binary(src, SPEC.arch, SPEC.name)
    meta = json.loads((folder / "meta.json").read_text())
    meta["report"]["registers"] = 1
    (folder / "meta.json").write_text(json.dumps(meta))
    assert not compiler.get_binary(src, SPEC.arch, SPEC.name)[1]


def test_no_lock_file_is_left_behind(flashgen_home):
    folder, src = _entry_folder(flashgen_home)
    compiler.get_binary(src, SPEC.arch, SPEC.name)
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]
    assert sorted(p.name for p in folder.iterdir()) == ["kernel.cu", "kernel.cubin", "meta.json"]


@pytest.mark.parametrize("how", ["file", "readonly"])
def test_an_unusable_cache_warns_and_compiles_in_memory(tmp_path, monkeypatch, how):
    home = tmp_path / "home"
    if how == "file":
        home.write_text("not a folder")
    else:
        (home / "kernels").mkdir(parents=True)
        os.chmod(home / "kernels", 0o500)
        if os.access(home / "kernels", os.W_OK):  # root ignores the mode
            pytest.skip("running as root: a read-only folder is still writable")
    monkeypatch.setenv("FLASHGEN_HOME", str(home))
    from flashgen.codegen import render

    with pytest.warns(UserWarning, match="cannot be used"):
        binary, hit = compiler.get_binary(render(SPEC), SPEC.arch, SPEC.name)
    assert not hit and binary.cubin[:4] == b"\x7fELF"


# ---------------------------------------------------------------- input bounds and aliasing


def _fake(*shape, dtype=torch.bfloat16, device="cuda"):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(*shape, dtype=dtype, device=device)


@pytest.mark.parametrize("scale", [1e300, 1e-46, 3.5e38, float("inf"), float("nan"), 0.0, -1.0])
def test_softmax_scale_is_checked_as_the_float32_the_kernel_gets(scale):
    with pytest.raises(ValueError, match="float32"):
        checked_scale(scale, 128)
    assert checked_scale(1e-30, 128) == 1e-30


def test_the_scale_check_is_exact_at_float32s_edges_and_traces_under_torch_compile():
    """The check agrees with numpy's float32 rounding at the edges (2^-150 ties to 0, 2^128 - 2^103 to inf;
    the log2 form's edge sits lower by log2(e)), and torch.compile traces it without a graph break (a model
    compiled with fullgraph calls the entry points, and ctypes' float conversion broke the graph there)."""
    import math

    import numpy as np

    log2e = math.log2(math.e)
    edges = [2.0 ** -150, 2.0 ** -149, (2.0 ** 128 - 2.0 ** 103) / log2e, 3.4e38 / log2e, 1e-45, 1e38]
    for x in edges + [math.nextafter(e, 0) for e in edges] + [math.nextafter(e, math.inf) for e in edges]:
        with np.errstate(over="ignore"):
            ok = all(0 < np.float32(y) < np.inf for y in (x, x * log2e))
        if ok:
            assert checked_scale(x, 64) == x
        else:
            with pytest.raises(ValueError, match="float32"):
                checked_scale(x, 64)

    @torch.compile(backend="eager", fullgraph=True)
    def scaled(t):
        return t * checked_scale(0.125, 64)

    assert torch.equal(scaled(torch.ones(3)), torch.full((3,), 0.125))


def test_lengths_past_int32_are_refused():
    """2^32 + 16 keys would reach the kernel as 16 keys: refused with the limit named."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q, k = _fake(1, 1, 16, 64), _fake(1, 1, 2**32 + 16, 64)
        with pytest.raises(UnsupportedError, match="seqlen_k is 4294967312, past the kernels' 32-bit limit"):
            check_attention_inputs(q, k, k, False, None, "bhsd")


def test_expanded_heads_are_mqa():
    """K/V expanded over their heads (stride 0) are one KV head for every query head: every family
    serves them as MQA (the TMA cannot step a stride of 0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = _fake(2, 8, 37, 64)
        k = _fake(2, 1, 50, 64).expand(2, 8, 50, 64)
        _, _, (hk, nk), sk, sv, _ = check_attention_inputs(q, k, k, True, None, "bhsd")
    assert (hk, nk) == (1, 50) and sk[1] == 0


def _decode_args(**over):
    b, nq, hq, hk, d, n = 2, 1, 8, 2, 128, 64
    args = dict(q=_fake(b, nq, hq, d), k_cache=_fake(b, n, hk, d), v_cache=_fake(b, n, hk, d),
                cache_seqlens=_fake(b, dtype=torch.int32), k_new=_fake(b, nq, hk, d), v_new=_fake(b, nq, hk, d))
    args.update(over)
    return args


@pytest.fixture
def decode_no_launch(monkeypatch):
    import flashgen.api.decoding as decoding
    from flashgen import testing

    class Kernel:
        class binary:
            class report:
                registers = 128

        def params(self, **values):
            return SPEC.family.param_struct()()

    monkeypatch.setattr(decoding, "load", lambda spec, index: Kernel())
    monkeypatch.setattr(dispatch, "select", lambda *a, **k: KernelSpec(
        kind="decode_split", arch="sm_90a", head_dim=128, block_m=16, block_n=128, warps=4, stages=2,
        causal=True))
    monkeypatch.setattr(decoding.Device, "of", classmethod(lambda cls, i: type(
        "D", (), {"arch": "sm_90a", "gpu": None, "smem_budget": 232448, "sms": 132, "smem_per_sm": 233472})()))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    testing.plans("decode").clear()
    yield
    testing.plans("decode").clear()


def test_decode_refuses_an_append_into_aliased_buffers(decode_no_launch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            _fake(1).data_ptr()
        except Exception:  # noqa: BLE001
            pytest.skip("fake tensors have no data_ptr in this torch")
        args = _decode_args()
        if len({t.data_ptr() for t in args.values()}) < len(args):
            pytest.skip("fake tensors share their data_ptr in this torch")
        cache = args["k_cache"]
        for over, message in (
                (dict(v_cache=cache), "k_cache and v_cache share memory"),
                (dict(k_new=cache[:, :1]), "share memory"),
                (dict(k_cache=_fake(1, 64, 2, 128).expand(2, 64, 2, 128),
                      v_cache=_fake(1, 64, 2, 128).expand(2, 64, 2, 128)), "expanded")):
            with pytest.raises(ValueError, match=message):
                flashgen.decode(**_decode_args(**{**args, **over}), check_values=False)


def test_decode_refuses_inputs_that_require_grad(decode_no_launch):
    """decode has no backward: a q that requires grad is refused, not given an output without grad_fn."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = _decode_args(k_new=None, v_new=None, cache_seqlens=None)
        args["q"] = args["q"].requires_grad_()
        with pytest.raises(UnsupportedError, match="no backward"):
            flashgen.decode(**args, check_values=False)
        with torch.no_grad():
            try:
                flashgen.decode(**args, check_values=False)
            except UnsupportedError:
                pytest.fail("under no_grad a q that requires grad is fine")
            except Exception:  # noqa: BLE001 -- the fake launch path ends somewhere past the checks
                pass


# ---------------------------------------------------------------- command-line errors


@pytest.mark.parametrize("argv,message", [
    (["explain", "--gpu", "h200", "--d", "128", "--seqlen", "4096", "--batch", "0"], "--batch must be a positive"),
    (["show", "--config", "{bad}"], "not UTF-8"),
])
def test_command_line_errors_are_one_line(capsys, tmp_path, argv, message):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe\x00")
    code, out, err = run_main(capsys, *[a.format(bad=bad) for a in argv])
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("kind", ["decode_split", "decode_combine", "bwd_preprocess", "bwd_convert", "standard_qk",
                                  "standard_softmax", "standard_pv", "fwd_v1", "bwd_dq", "bwd_sm90"])
def test_every_kind_emits(capsys, kind):
    code, out, err = run_main(capsys, "emit", "--d", "128", "--kind", kind, "--arch", "sm_90a")
    assert code == 0, err
    assert out.splitlines()[1].startswith(f"// spec: {kind}_d128_")


def test_show_without_a_gpu_lists_the_shipped_tables(capsys):
    code, out, err = run_main(capsys, "show")
    assert code == 0, err
    for gpu in tables.shipped_gpus():
        assert str(tables.shipped_path(gpu)) in out


def test_model_ranked_tables_carry_the_cost_models_check(tmp_path, capsys):
    """A model-ranked table's meta says how the cost model fared against measurement (tables.MODEL_CHECK,
    the H200's --validate-model figures); the shipped A100 table carries it and `show` prints it."""
    a100 = gpus.get("a100")
    path = tables.save(tables.Table(meta=tables.make_meta(a100, "model")), tmp_path / "a100.yaml")
    assert tables.load(path, gpu="a100").meta["model_check"] == tables.MODEL_CHECK
    assert "model_check" not in tables.make_meta(a100, "measured")
    shipped = tables.load(tables.shipped_path("a100"), gpu="a100")
    assert shipped.meta["source"] == "model" and shipped.meta["model_check"] == tables.MODEL_CHECK
    code, out, err = run_main(capsys, "show", "--gpu", "a100")
    assert code == 0, err
    assert f"{tables.MODEL_CHECK['geomean_regret']:.3f}x the measured best's time on average" in out


@pytest.mark.parametrize("change,message", [
    ({"source": "measured"}, "belongs to a model-ranked table"),
    ({"check": {"geomean_regret": 0.9}}, "must be a regret"),
    ({"check": {"worst_regret": 1.001}}, "worst regret below the mean"),
    ({"check": {"median_spearman": 1.5}}, r"in \[-1, 1\]"),
    ({"check": {"measured": "8"}}, "must be int"),
    ({"check": {"extra": 1}}, "must have exactly"),
    ({"drop": "command"}, "must have exactly"),
])
def test_a_bad_model_check_is_refused(tmp_path, change, message):
    meta = tables.make_meta(gpus.get("a100"), "model")
    meta["source"] = change.get("source", "model")
    meta["model_check"].update(change.get("check", {}))
    meta["model_check"].pop(change.get("drop", "-"), None)
    path = tmp_path / "a100.yaml"
    path.write_text(yaml.safe_dump({"meta": meta, "entries": []}))
    with pytest.raises(ConfigError, match=message):
        tables.load(path, gpu="a100")
