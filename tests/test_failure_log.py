"""conftest's ``--failure-log FILE``: a failure's report is in FILE as soon as the test ends, before pytest's
own end-of-run report (which a device step's time limit can cut off)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_a_failure_is_logged_before_the_run_ends(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import os, signal\n"
        "def test_passes():\n    assert True\n"
        "def test_fails():\n    assert 1 + 1 == 3, 'arithmetic'\n"
        "def test_stops_the_run():\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    log = tmp_path / "failures.txt"
    path = [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), f"--failure-log={log}", str(tmp_path / "test_sample.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == -9, run.stdout + run.stderr  # killed: pytest printed no failure report
    assert "arithmetic" not in run.stdout
    text = log.read_text()
    assert text.count("==== ") == 1 and "test_sample.py::test_fails (call)" in text and "arithmetic" in text
