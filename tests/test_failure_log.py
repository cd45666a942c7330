"""conftest's ``--failure-log FILE``: a failure's report is in FILE as soon as the test ends, before pytest's
own end-of-run report (which a device step's time limit can cut off); ``--test-timeout S`` ends a run whose
test hangs and names the test there."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _run_sample(tmp_path, source: str, *options: str):
    """Run pytest with this suite's conftest over a module of ``source``; (the process, the failure log's text)."""
    (tmp_path / "test_sample.py").write_text(source)
    log = tmp_path / "failures.txt"
    path = [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), f"--failure-log={log}", *options,
                          str(tmp_path / "test_sample.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return run, log.read_text()


def test_a_failure_is_logged_before_the_run_ends(tmp_path):
    run, text = _run_sample(tmp_path, "import os, signal\n"
                                      "def test_passes():\n    assert True\n"
                                      "def test_fails():\n    assert 1 + 1 == 3, 'arithmetic'\n"
                                      "def test_stops_the_run():\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    assert run.returncode == -9, run.stdout + run.stderr  # killed: pytest printed no failure report
    assert "arithmetic" not in run.stdout
    assert text.count("==== ") == 1 and "test_sample.py::test_fails (call)" in text and "arithmetic" in text


def test_a_test_past_the_timeout_ends_the_run_and_is_named(tmp_path):
    """``--test-timeout``: a test that does not end in time (a hung kernel, here a sleep) ends the run, and its id
    and the stacks are the failure log's last entry; the tests that ended in time leave nothing there, a
    failure its report."""
    run, text = _run_sample(tmp_path, "import time\n"
                                      "def test_passes():\n    assert True\n"
                                      "def test_fails():\n    assert 1 + 1 == 3, 'arithmetic'\n"
                                      "def test_hangs():\n    time.sleep(60)\n"
                                      "def test_never_runs():\n    assert True\n", "--test-timeout=3")
    assert run.returncode != 0 and "never_runs" not in run.stdout, run.stdout + run.stderr
    entries = [e for e in text.split("==== ") if e]
    assert len(entries) == 2, entries
    assert entries[0].startswith("test_sample.py::test_fails (call)") and "arithmetic" in entries[0]
    assert entries[1].startswith("test_sample.py::test_hangs (running") and "test_hangs" in entries[1].split("\n", 1)[1]
    assert "never_runs" not in text
