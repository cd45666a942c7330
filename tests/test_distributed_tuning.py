"""Distributed tuning on a shared storage -- a real PostgreSQL server, and a journal file: four
``flashgen tune --model`` workers on one study set, and a fifth killed inside a trial and restarted.

Every candidate must be evaluated exactly once over all workers, none lost (the killed worker's
trial is failed once its heartbeat stops, and its candidate runs again elsewhere), and every
worker's table must name the same winners as a single-process run. The server comes from
``TEST_POSTGRES_URL`` (a SQLAlchemy URL of a database the test may create databases from;
``.ci/run`` starts one from the OS packages); each run gets a fresh database, dropped afterwards.
Without that variable only the journal case runs.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from flashgen import tables

SERVER = os.environ.get("TEST_POSTGRES_URL")

ARGS = ["tune", "--gpu", "a100", "--kind", "bwd_dq", "--d", "64", "--causal", "false", "--seqlens", "512,2048",
        "--model", "--trials", "400", "--jobs", "2", "--quiet"]

# A worker that hangs in its third trial (after writing its marker file), beating all the while.
HANGING = """
import sys, time
from flashgen.tuner import objective
real, calls = objective.ModelObjective.__call__, []
def call(self, key, spec):
    calls.append(spec)
    if len(calls) == 3:
        open(sys.argv[1], "w").write(spec.name)
        time.sleep(3600)
    return real(self, key, spec)
objective.ModelObjective.__call__ = call
from flashgen.cli import main
sys.exit(main(sys.argv[2:]))
"""
WORKER = "import sys; from flashgen.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.fixture(params=["postgresql", "journal"])
def shared(request, tmp_path):
    """(URL for --storage, a storage object to read the studies back) of a fresh shared storage."""
    from flashgen.tuner import study

    if request.param == "journal":
        url = f"journal:{tmp_path / 'studies.journal'}"
        yield url, study.open_storage(url)
        return
    if not SERVER:
        pytest.skip("TEST_POSTGRES_URL is not set: no PostgreSQL server (.ci/run starts one)")
    import psycopg
    from sqlalchemy.engine import make_url

    server = make_url(SERVER)
    name = f"flashgen_{uuid.uuid4().hex[:12]}"
    conninfo = {k: v for k, v in dict(host=server.host, port=server.port, user=server.username,
                                      password=server.password, dbname=server.database or "postgres").items()
                if v is not None}
    with psycopg.connect(**conninfo, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = server.set(drivername="postgresql+psycopg", database=name).render_as_string(hide_password=False)
    yield url, study.open_storage(url)
    with psycopg.connect(**conninfo, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def kernel_home(tmp_path_factory):
    """One FLASHGEN_HOME for both storages' runs: the model objective compiles each candidate for its
    register count, and the second run finds them in this home's binary cache."""
    return tmp_path_factory.mktemp("tuning_home")


def _winners(path):
    return {k: e["spec"].name for k, e in tables.load(path, gpu="a100").entries.items()}


def _spawn(code, args):
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_four_workers_and_a_killed_one_evaluate_every_candidate_once(tmp_path, shared, kernel_home, monkeypatch):
    import optuna

    from flashgen.spec import KernelSpec
    from flashgen.tuner import study

    # The reference, in one process (it also fills the shared kernel cache the workers then hit).
    from flashgen.cli import main

    monkeypatch.setenv("FLASHGEN_HOME", str(kernel_home))  # the workers inherit it

    assert main(ARGS + ["--out", str(tmp_path / "single.yaml"), "--report", str(tmp_path / "single.json")]) == 0
    single = json.loads((tmp_path / "single.json").read_text())["keys"]
    expected = _winners(tmp_path / "single.yaml")
    assert len(expected) == 2

    url, storage = shared
    shared = ["--storage", url, "--stale-after", "2"]
    marker = tmp_path / "hung"
    victim = _spawn(HANGING, [str(marker), *ARGS, *shared, "--out", str(tmp_path / "victim.yaml")])
    t0 = time.monotonic()
    while not marker.exists():
        assert victim.poll() is None, victim.communicate()[0]
        assert time.monotonic() - t0 < 120, "the hanging worker never reached its third trial"
        time.sleep(0.1)
    workers = [_spawn(WORKER, [*ARGS, *shared, "--out", str(tmp_path / f"w{i}.yaml"),
                               "--report", str(tmp_path / f"w{i}.json")]) for i in range(4)]
    time.sleep(1.0)
    assert victim.poll() is None  # still inside its trial, beating: nobody may take that candidate yet
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    restarted = _spawn(WORKER, [*ARGS, *shared, "--out", str(tmp_path / "restarted.yaml")])
    for p in [*workers, restarted]:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out

    victim_name = f":{victim.pid}"
    for n, key_row in enumerate(single):
        trials = optuna.load_study(study_name=key_row["key"], storage=storage).get_trials(deepcopy=False)
        results = [t for t in trials if study.evaluated(t)]
        names = [KernelSpec(**t.user_attrs["spec"]).name for t in results]
        assert len(names) == len(set(names)) == key_row["candidates"]  # each candidate once, none lost
        assert {KernelSpec(**t.user_attrs["spec"]).name: t.value for t in results
                if t.value is not None} == {r["spec"]: r["ms"] for r in key_row["trial_log"]
                                            if r["ms"] is not None}
        stale = [t for t in trials if t.state == optuna.trial.TrialState.FAIL and "spec" not in t.user_attrs
                 and not t.user_attrs.get("idle") and t.user_attrs.get("duplicate_of") is None]
        retried = sorted(t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs)
        if n == 0:  # the key the victim hung in: its trial failed once, its candidate queued once
            assert [t.number for t in stale] == retried and len(stale) == 1
            (holder,) = [t for t in results if KernelSpec(**t.user_attrs["spec"]).name == marker.read_text()]
            assert not holder.user_attrs["worker"].endswith(victim_name)
            assert any(t.user_attrs["worker"].endswith(victim_name) for t in results)  # it did work before
        else:
            assert stale == [] and retried == []
    for name in [f"w{i}.yaml" for i in range(4)] + ["restarted.yaml"]:
        assert _winners(tmp_path / name) == expected, name
    assert not (tmp_path / "victim.yaml").exists()
