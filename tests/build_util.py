"""Helpers the compile-tier tests share: build many specs at once, and read a kernel's SASS."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from multiprocessing.pool import ThreadPool
from pathlib import Path

import pytest

from flashgen.codegen import build, render


class CompileSession:
    """The compile tier's binaries, shared by every module of a run: a spec is compiled once per run
    (tests/test_compile.py, test_sm90.py and test_bwd_sm90.py ask for overlapping sets) into one private
    FLASHGEN_HOME, as many at a time as there are CPUs (NVRTC releases the GIL, so threads use every
    core), with a progress line every tenth of the way (conftest's ``compile_session`` fixture)."""

    def __init__(self, home, write_line=None):
        self.home = home
        self.results: dict = {}  # spec -> Binary, or the exception its build raised
        self.write_line = write_line or (lambda text: None)

    def build_all(self, specs) -> dict:
        """{spec: Binary or the exception its build raised} for ``specs``; each test reports its own."""
        todo = [s for s in dict.fromkeys(specs) if s not in self.results]
        if todo:
            self._compile(todo)
        return {s: self.results[s] for s in specs}

    def _compile(self, todo) -> None:
        threads = max(2, os.cpu_count() or 2)
        done, step, t0 = 0, max(1, len(todo) // 10), time.monotonic()
        self.write_line(f"compile tier: {len(todo)} kernels to compile on {threads} threads")

        def one(spec):
            try:
                return spec, build(spec)
            except Exception as exc:  # noqa: BLE001 -- reported per spec by the tests
                return spec, exc

        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FLASHGEN_HOME", str(self.home))
            mp.delenv("FLASHGEN_NO_COMPILE", raising=False)
            with ThreadPool(threads) as pool:
                for spec, result in pool.imap_unordered(one, todo):
                    self.results[spec] = result
                    done += 1
                    if done % step == 0 or done == len(todo):
                        self.write_line(f"compile tier: {done}/{len(todo)} compiled, {time.monotonic() - t0:.0f} s")


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


def disassemblers() -> list:
    """cuobjdump / nvdisasm on PATH or from pip's nvidia-cuda wheels (optional tools)."""
    found = [shutil.which("cuobjdump"), shutil.which("nvdisasm")]
    pip_bin = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
        "site-packages" / "nvidia" / "cu13" / "bin"
    found += [str(pip_bin / "cuobjdump"), str(pip_bin / "nvdisasm")]
    return [f for f in found if f and os.path.exists(f)]


def _sass(tool, cubin_path) -> str:
    args = [tool, "--dump-sass", cubin_path] if tool.endswith("cuobjdump") else [tool, cubin_path]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    return out.stdout if out.returncode == 0 else ""


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
    """(R2UR in the four instructions before each HGMMA, summed; HGMMA count) in NVRTC's cubin of
    ``spec``: an R2UR there moves a per-thread value into a wgmma operand (a descriptor the compiler did
    not know warp-uniform). Skips the test when no disassembler here reads the cubin."""
    path = tmp_path / f"{spec.name}.cubin"
    path.write_bytes(cubin)
    sass = next((t for t in (_sass(tool, str(path)) for tool in disassemblers()) if t), "")
    if not sass:
        pytest.skip("no disassembler here reads NVRTC's cubin")
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
    at = [i for i, ln in enumerate(lines) if "HGMMA" in ln]
    return sum(1 for i in at for ln in lines[max(0, i - 4):i] if re.search(r"\bR2UR\b", ln)), len(at)
