"""conftest's ``--shard K/N``: the selected tests split into N parts of whole files, every test in exactly one
part, the parts' sizes as even as whole files allow; a malformed value is a usage error."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import shard_of

TESTS = Path(__file__).resolve().parent


def test_parts_cover_every_file_once_and_balance():
    counts = {"a.py": 9, "b.py": 5, "c.py": 4, "d.py": 3, "e.py": 1, "f.py": 1}
    parts = [shard_of(counts, k, 3) for k in (1, 2, 3)]
    assert set().union(*parts) == set(counts) and sum(len(p) for p in parts) == len(counts)
    sizes = sorted(sum(counts[f] for f in p) for p in parts)
    assert sizes == [7, 7, 9], parts  # a.py alone, b.py + e.py + f.py, c.py + d.py
    assert shard_of(counts, 1, 1) == set(counts)
    assert shard_of({"x.py": 2}, 2, 2) == set()  # more parts than files: some are empty


def _collect(tmp_path, *options):
    for name, n in (("test_one.py", 4), ("test_two.py", 3), ("test_three.py", 3)):
        (tmp_path / name).write_text("".join(f"def test_{i}():\n    assert {i} == {i}\n" for i in range(n)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), *options, str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return run


def test_the_option_runs_one_part_of_whole_files(tmp_path):
    ran = []
    for k in (1, 2):
        run = _collect(tmp_path, f"--shard={k}/2", "-k", "not test_three or test_0 or test_1")
        assert run.returncode == 0, run.stdout + run.stderr
        ran.append(run.stdout.splitlines()[-1])
    # after -k (test_three.py keeps 2 of its 3): part 1 test_one.py's 4, part 2 test_two.py's 3 and those 2
    assert ran[0].startswith("4 passed") and ran[1].startswith("5 passed"), ran


def test_a_malformed_shard_is_a_usage_error(tmp_path):
    for bad in ("3/2", "0/2", "1", "a/b"):
        run = _collect(tmp_path, f"--shard={bad}")
        assert run.returncode == 4 and "--shard takes K/N" in run.stderr, (bad, run.stdout, run.stderr)
