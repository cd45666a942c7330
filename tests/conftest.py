"""Shared fixtures for the whole suite.

Every test gets its own, empty ``FLASHGEN_HOME`` so that no test reads or
writes the user's kernel cache or tuning results, and no test depends on
another's cache entries. Every other ``FLASHGEN_*`` setting (``flashgen.testing.ENVIRONMENT``,
the list ``flashgen.settings`` reads) is cleared so the caller's environment cannot change
what a test sees.

The compile tier (the tests that use ``compile_session``: tests/test_compile.py, test_sm90.py,
test_bwd_sm90.py) runs last; its kernels compile in worker processes from the run's first test on, while
the other tests run (``build_util.CompileSession``).

Options: ``--update-golden`` rewrites the golden sources of tests/test_render.py instead of comparing
them (after an intended template change); ``--no-precompile`` makes the GPU test modules skip their
parallel precompile step; ``--failure-log FILE`` appends each failure's report to FILE as it happens;
``--test-timeout S`` ends the run when one test's call takes longer than S seconds (a hung kernel),
naming it in the failure log; ``--compile-tier-home DIR`` keeps the compile tier's binaries in DIR across
runs (a kernel whose source, options or compiler changed compiles again); ``--shard K/N`` runs the K-th of
N parts of the selected tests, whole files each (the GPU suite takes about 1900 s on an H100, more than
one device call: ``scripts/device.sh "tests tests/ --shard 1/5"`` and so on). Nothing GPU-specific is
registered here: GPU tests (tests/test_gpu_*.py) mark themselves with ``pytest.mark.gpu`` and skip
themselves without CUDA.
"""
from __future__ import annotations

import collections
import itertools
import os
import re

import pytest

from flashgen.testing import ENVIRONMENT


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/ instead of comparing")
    parser.addoption("--no-precompile", action="store_true", help="GPU tests: skip the parallel precompile step")
    parser.addoption("--failure-log", metavar="FILE", default=None,
                     help="append each failure's report to FILE as it happens (a run stopped by a time limit "
                          "keeps what failed before the stop; pytest prints its reports only at the end)")
    parser.addoption("--test-timeout", metavar="SECONDS", type=float, default=None,
                     help="end the run when one test's call takes longer (a kernel that hangs the GPU leaves nothing to "
                          "go on with); with --failure-log the test's id and the Python stacks are that log's "
                          "last entry, so a time-limited device call learns which test hung and keeps its "
                          "remaining time")
    parser.addoption("--shard", metavar="K/N", default=None,
                     help="run the K-th of N parts of the selected tests (1 <= K <= N), whole test files each, "
                          "the files spread over the parts by their selected tests' count: a suite longer than "
                          "one time-limited call runs as N calls")
    parser.addoption("--compile-tier-home", metavar="DIR", default=None,
                     help="the compile tier's FLASHGEN_HOME, kept across runs (default: a new one per run); "
                          "its binary cache is keyed by source, options, arch and versions, so only changed "
                          "kernels compile again")


def pytest_runtest_logreport(report):
    """``--failure-log FILE``: each failed phase's report appended to FILE at once."""
    path = _failure_log[0]
    if path and report.failed:
        _take_back(path, _running_mark(report.nodeid))  # (--test-timeout's line: the report names the test)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n\n")


_failure_log: list = [None]
_test_timeout: list = [None]


def pytest_configure(config):
    _failure_log[0] = config.getoption("--failure-log")
    _test_timeout[0] = config.getoption("--test-timeout")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """``--test-timeout S``: a watchdog over each test's call (not its setup, where a GPU module's precompile
    step may take minutes for all of its tests); past S seconds the process
    dumps every thread's stack and exits (faulthandler: no Python code runs in a thread stuck in a CUDA
    call). With ``--failure-log`` the test's id is written there beforehand (taken back when it ends in
    time) and the stacks follow it; without, the stacks go to stderr (captured unless ``-s``)."""
    timeout = _test_timeout[0]
    if not timeout:
        yield
        return
    import faulthandler
    import sys

    path, mark = _failure_log[0], _running_mark(item.nodeid)
    log = None
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(mark)
        log = open(path, "a", encoding="utf-8")  # noqa: SIM115 -- the watchdog writes the stacks here
    faulthandler.dump_traceback_later(timeout, exit=True, file=log or sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        if log is not None:
            log.close()
            _take_back(path, mark)


def _running_mark(nodeid: str) -> str:
    return f"==== {nodeid} (running: ended by --test-timeout if stacks follow)\n"


def _take_back(path: str, mark: str) -> None:
    """Remove ``mark`` (the running test's line) from the end of the failure log, if it is there."""
    tail = mark.encode()
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        f.seek(0, 2)
        size = f.tell()
        if size >= len(tail):
            f.seek(size - len(tail))
            if f.read() == tail:
                f.truncate(size - len(tail))


@pytest.fixture
def update_golden(request) -> bool:
    return request.config.getoption("--update-golden")


def _uses_compile_tier(item) -> bool:
    return "compile_session" in getattr(item, "fixturenames", ())


def shard_of(counts: dict, shard: int, shards: int) -> set:
    """The files of part ``shard`` (1-based) of ``shards``: ``counts`` (file -> selected tests) dealt out
    largest first, each to the part with the fewest tests so far (ties: the lower part, then file name)."""
    load = [0] * shards
    mine = set()
    for name in sorted(counts, key=lambda f: (-counts[f], f)):
        part = min(range(shards), key=lambda i: (load[i], i))
        load[part] += counts[name]
        if part == shard - 1:
            mine.add(name)
    return mine


def _parse_shard(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", text or "")
    if not m or not 1 <= int(m[1]) <= int(m[2]):
        raise pytest.UsageError(f"--shard takes K/N with 1 <= K <= N, got {text!r}")
    return int(m[1]), int(m[2])


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``--shard K/N``: only the K-th part's files of the tests selected so far (after ``-m`` and ``-k``).
    The compile tier's tests (those that use ``compile_session``) run after all the others, which run
    while the tier's kernels compile in the background (``_compile_tier``)."""
    if config.getoption("--shard"):
        shard, shards = _parse_shard(config.getoption("--shard"))
        files = [item.nodeid.split("::")[0] for item in items]
        mine = shard_of(collections.Counter(files), shard, shards)
        kept = [item for item, f in zip(items, files) if f in mine]
        if len(kept) < len(items):
            config.hook.pytest_deselected(items=[item for item, f in zip(items, files) if f not in mine])
            items[:] = kept
    tier = [item for item in items if _uses_compile_tier(item)]
    if tier:
        items[:] = [item for item in items if not _uses_compile_tier(item)] + tier


def _tier_specs(session) -> list:
    """The specs the selected compile-tier tests are parametrized over, each once, in their order."""
    specs = {}
    for item in session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if _uses_compile_tier(item) and "spec" in params:
            specs[params["spec"]] = None
    return list(specs)


@pytest.fixture(scope="session", autouse=True)
def _compile_tier(request, tmp_path_factory):
    """The run's ``build_util.CompileSession``, set up with the run's first test: the kernels of the
    selected compile-tier tests start compiling at once, in worker processes, and the workers stop when
    the run ends."""
    from build_util import CompileSession

    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def write(text):  # past the output capture, which holds a fixture's prints until its test ends
        if reporter is None:
            return
        if capture is None:
            reporter.write("\n" + text + "\n")
            return
        with capture.global_and_fixture_disabled():  # on a line of its own, not after a row's dots
            reporter.write("\n" + text + "\n")

    home = request.config.getoption("--compile-tier-home") or tmp_path_factory.mktemp("compile_tier")
    session = CompileSession(home, write)
    session.start(_tier_specs(request.session))
    yield session
    session.close()


@pytest.fixture(scope="session")
def compile_session(_compile_tier):
    """The compile tier's shared binaries (``build_util.CompileSession``): each spec compiled once per run,
    in the background from the run's start, with progress lines on the terminal while a test waits."""
    return _compile_tier


@pytest.fixture(scope="session")
def gpu_kernel_cache(tmp_path_factory):
    """One binary cache for every GPU test of the run, and for the tests marked ``shared_kernels`` (the
    cache is content-addressed and locked, so sharing it changes no result; it saves recompiling each
    kernel in every test). Tests of the cache itself keep a private one."""
    return tmp_path_factory.mktemp("gpu_kernels")


@pytest.fixture(scope="session")
def _homes(tmp_path_factory):
    """The folder of every test's FLASHGEN_HOME (one each, made only when the test writes there)."""
    return tmp_path_factory.mktemp("homes")


_home_numbers = itertools.count()


@pytest.fixture(autouse=True)
def flashgen_home(request, _homes, monkeypatch):
    """A private, empty FLASHGEN_HOME for one test (its tuned tables are its own); the ``kernels/`` of a
    GPU test or of one marked ``shared_kernels`` is the run's shared binary cache. Returns the home's
    path, a new one under the run's ``homes/`` folder that flashgen creates when it first writes there
    (not a tmp_path: most tests need no folder, and pytest looks through every earlier test's folder
    to number a new one)."""
    home = _homes / f"{re.sub(r'[^A-Za-z0-9_]', '_', request.node.name)[:30]}_{next(_home_numbers)}"
    for var in ENVIRONMENT:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLASHGEN_HOME", str(home))
    if request.node.get_closest_marker("gpu") is not None or request.node.get_closest_marker("shared_kernels"):
        home.mkdir(parents=True, exist_ok=True)
        (home / "kernels").symlink_to(request.getfixturevalue("gpu_kernel_cache"), target_is_directory=True)
    return home


@pytest.fixture()
def no_launch(monkeypatch):
    """Fail the test if flashgen.decode gets past validation to spec selection or kernel loading."""
    from flashgen import dispatch, testing
    from flashgen.api import decoding

    def reached(*args, **kwargs):
        raise AssertionError("validation let the call through to dispatch/launch")

    monkeypatch.setattr(dispatch, "select", reached)
    monkeypatch.setattr(decoding, "load", reached)
    testing.plans("decode").clear()  # no plan of an earlier call stands in for the checks
