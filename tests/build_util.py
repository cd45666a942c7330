"""Helpers the compile-tier tests share: build many specs at once, and read a kernel's SASS."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import pytest

from flashgen.bench.sass import disassemble, disassemblers
from flashgen.codegen import build, render
from flashgen.testing import ENVIRONMENT


class CompileSession:
    """The compile tier's binaries, shared by every module of a run: each spec is compiled once per run
    (tests/test_compile.py, test_sm90.py and test_bwd_sm90.py ask for overlapping sets) by ``build`` in
    worker processes, one per CPU, into one private FLASHGEN_HOME.

    ``start(specs)`` hands the specs of the run's compile-tier tests to the workers when the run begins
    (conftest does it, and runs the tier's tests last), so the compiles go on, at a low CPU priority,
    while the other tests run. ``build_all(specs)`` returns a mapping that waits for a spec's build when
    it is looked up (a ``-k`` selection builds only what its tests look up), with a progress line every
    tenth of the way while a test waits."""

    def __init__(self, home, write_line=None, workers: int | None = None):
        self.home = Path(home)
        self.write_line = write_line or (lambda text: None)
        self.workers = workers or max(2, cpus())
        self._futures: dict = {}  # spec -> Future of its build, in the order handed to the workers
        self._done = 0  # builds finished (counted by the futures' callbacks)
        self._pool = None
        self._t0 = 0.0
        self._shown = None  # tenths of the way shown, None before the first lookup

    def start(self, specs) -> None:
        """Hand the builds of ``specs`` (each once) to the workers, starting them if they are not running."""
        todo = [s for s in dict.fromkeys(specs) if s not in self._futures]
        if not todo:
            return
        if self._pool is None:
            self._t0 = time.monotonic()
            context = multiprocessing.get_context("spawn")  # no copy of this process's torch or threads
            self._pool = ProcessPoolExecutor(self.workers, mp_context=context, initializer=_worker_start,
                                             initargs=(str(self.home),))
            self.write_line(f"compile tier: {len(todo)} kernels to compile, in the background ({self.workers} "
                            "worker processes) while the other tests run")
        for spec in todo:
            self._futures[spec] = future = self._pool.submit(_worker_build, spec)
            future.add_done_callback(self._count)

    def _count(self, future) -> None:
        self._done += 1

    def build_all(self, specs) -> "Compiled":
        """{spec: Binary or the exception its build raised} for ``specs``: a lookup waits for that spec's
        build (handed to the workers then, if ``start`` did not), iterating builds them all. Each test
        reports its own."""
        return Compiled(self, specs)

    def result(self, spec):
        """The Binary of ``spec`` or the exception its build raised, waiting for it."""
        self.start([spec])
        future = self._futures[spec]
        self._progress()
        while not future.done():
            try:
                future.result(timeout=5)
            except FutureTimeout:
                self._progress()
            except Exception:  # noqa: BLE001 -- a worker that died: the future carries it
                break
        self._progress()
        exc = future.exception()
        return exc if exc is not None else future.result()

    def close(self) -> None:
        """Drop the builds not started and stop the workers (the running builds finish first)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _progress(self) -> None:
        """A line when the tier's tests begin, then each tenth of the way (written by the test that waits,
        so never in the middle of another test's output)."""
        total, done = len(self._futures), min(self._done, len(self._futures))
        tenths = done * 10 // max(1, total)
        if self._shown is None:
            self.write_line(f"compile tier: {done}/{total} compiled when its tests began, "
                            f"{time.monotonic() - self._t0:.0f} s after the workers started")
            self._shown = tenths
        elif tenths > self._shown:
            self._shown = tenths
            self.write_line(f"compile tier: {done}/{total} compiled, {time.monotonic() - self._t0:.0f} s after "
                            "the workers started")


class Compiled(Mapping):
    """The read-only {spec: Binary or exception} of ``CompileSession.build_all``: a lookup waits for
    that spec's build; ``in`` builds nothing."""

    def __init__(self, session: CompileSession, specs):
        self._session = session
        self._specs = list(dict.fromkeys(specs))
        self._known = set(self._specs)

    def __getitem__(self, spec):
        if spec not in self._known:
            raise KeyError(spec)
        return self._session.result(spec)

    def __contains__(self, spec):
        return spec in self._known

    def __iter__(self):
        self._session.start(self._specs)  # whoever walks them all gets them built in parallel
        return iter(self._specs)

    def __len__(self):
        return len(self._specs)


def cpus() -> int:
    """The CPUs this process may run on (a container's share, where the machine has more)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# The workers of CompileSession: separate processes, each with its own environment (the tests change
# FLASHGEN_HOME and other settings of this process while the compiles go on) and a low CPU priority, so
# that the tests running meanwhile are not slowed by them.
_WORKER_NICE = 19


def _worker_start(home: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the run, which stops the workers (close)
    for var in ENVIRONMENT:
        os.environ.pop(var, None)
    os.environ["FLASHGEN_HOME"] = home
    try:
        os.nice(_WORKER_NICE)
    except (AttributeError, OSError):  # no nice here: the builds still run
        pass


def _worker_build(spec):
    """``build(spec)``, or the exception it raised (sent back as a RuntimeError with its text where it
    cannot be pickled)."""
    try:
        return build(spec)
    except Exception as exc:  # noqa: BLE001 -- reported per spec by the tests
        try:
            pickle.loads(pickle.dumps(exc))
            return exc
        except Exception:  # noqa: BLE001
            return RuntimeError(f"{type(exc).__name__}: {exc}")


def clean_binary(compiled: dict, spec):
    """The spec's Binary from ``CompileSession.build_all``, after the checks every compile-tier test makes: it built (its
    exception re-raised), an ELF cubin, no spills or stack frame, no problem in the ptxas report."""
    binary = compiled[spec]
    if isinstance(binary, Exception):
        raise binary
    r = binary.report
    assert binary.cubin[:4] == b"\x7fELF"
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, binary.log
    assert r.problems() == [], binary.log
    return binary


def ptx_of(spec) -> str:
    """NVRTC's PTX of ``spec`` (compute_<arch>: no ptxas run, a fraction of a cubin's compile time), for checks
    of which instructions a template's compile-time switches leave in a kernel."""
    from cupy_backends.cuda.libs import nvrtc

    arch = spec.arch.replace("sm_", "compute_")
    prog = nvrtc.createProgram(render(spec), f"{spec.name}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", "--std=c++17"])
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def _sass(tool, cubin_path) -> str:
    """The SASS ``tool`` reads from the cubin at ``cubin_path`` ("" where it reads none)."""
    return disassemble(Path(cubin_path).read_bytes(), [tool])[0]


def sass_of(spec, cubin: bytes, tmp_path):
    """(SASS of ``spec``, nvcc's ptxas log or None). Tries the disassemblers on NVRTC's cubin, then on a
    local nvcc's build of the same source (its -Xptxas -v log is returned for the caller's checks);
    skips the test when no tool here can produce SASS."""
    tools = disassemblers()
    if not tools:
        pytest.skip("no cuobjdump/nvdisasm found")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    sass = next((s for s in (_sass(t, str(path)) for t in tools) if s), "")
    if sass:
        return sass, None
    nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc", "/usr/local/cuda-13.0/bin/nvcc")
                                         if os.path.exists(p)), None)
    if nvcc is None:
        pytest.skip("the disassemblers here cannot read NVRTC's cubin and there is no nvcc")
    src = tmp_path / "k.cu"
    src.write_text(render(spec))
    out = subprocess.run([nvcc, "-cubin", "-arch=sm_90a", "-std=c++17", "-Xptxas", "-v", "-o",
                          str(tmp_path / "n.cubin"), str(src)], capture_output=True, text=True, timeout=300)
    if out.returncode:
        pytest.skip(f"nvcc could not build the check cubin: {out.stderr[-300:]}")
    sass = next((s for s in (_sass(t, str(tmp_path / "n.cubin")) for t in tools) if s), "")
    if not sass:
        pytest.skip("no disassembler here reads sm_90a cubins")
    return sass, out.stderr


def r2ur_before_hgmma(spec, cubin: bytes, tmp_path) -> tuple[int, int]:
    """(R2UR in the four instructions before each wgmma, summed; wgmma count) in NVRTC's cubin of
    ``spec`` (HGMMA for 16-bit operands, QGMMA for FP8): an R2UR there moves a per-thread value into a
    wgmma operand (a descriptor the compiler did not know warp-uniform). Skips the test when no
    disassembler here reads the cubin."""
    path = tmp_path / f"{spec.name}.cubin"
    path.write_bytes(cubin)
    sass = next((t for t in (_sass(tool, str(path)) for tool in disassemblers()) if t), "")
    if not sass:
        pytest.skip("no disassembler here reads NVRTC's cubin")
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
    at = [i for i, ln in enumerate(lines) if re.search(r"\b[HQ]GMMA\.", ln)]
    return sum(1 for i in at for ln in lines[max(0, i - 4):i] if re.search(r"\bR2UR\b", ln)), len(at)
