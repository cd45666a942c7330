"""NVRTC compilation and the on-disk binary cache.

This module alone talks to NVRTC. ``compile_source`` turns source into a cubin
for any target without a GPU; ``get_binary`` adds the cache under
``$FLASHGEN_HOME/kernels/<spec name>-<key>/``, where the key hashes everything
that can change the binary (source, options, arch, NVRTC version, flashgen
version). Cache writes are atomic (temp file + ``os.replace``, modes from the umask) and
serialized by a lock on the entry's folder with a second look after the lock is
taken; malformed or edited metadata is a miss.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import files, settings
from ..errors import CompileError
from ..version import __version__
from .elf import whole_elf
from .render import render

BASE_OPTIONS = ("--std=c++17", "-Xptxas=-v")


@dataclass(frozen=True)
class Report:
    """What ptxas said about one kernel."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    static_smem: int
    warnings: tuple = ()

    def problems(self, max_registers: int = 255, spills: bool = True) -> list[str]:
        """Reasons to refuse this binary (spills, local memory, serialized wgmma...); ``spills=False``
        leaves out the spills and local memory (a caller that takes the least-spilling tile)."""
        out = []
        if self.registers <= 0:  # no resource report at all: nothing vouches for the binary
            out.append("no ptxas resource usage in the NVRTC log (cannot check registers and spills)")
        if spills and (self.spill_stores or self.spill_loads):
            out.append(f"spills: {self.spill_stores} B stored, {self.spill_loads} B loaded")
        if spills and self.stack_frame:
            out.append(f"stack frame of {self.stack_frame} B (local memory)")
        if self.registers > max_registers:
            out.append(f"{self.registers} registers > {max_registers}")
        out += [f"ptxas warning: {w}" for w in self.warnings]
        return out


@dataclass(frozen=True)
class Binary:
    name: str
    arch: str
    key: str
    cubin: bytes
    log: str
    report: Report


_NUM = r"(\d+)"


def parse_ptxas_log(log: str, name: str | None = None) -> Report:
    """Registers, spills, stack and static shared memory of ``name`` (or the only entry)."""
    section = log
    if name:
        # The whole name (a module may hold a second entry whose name extends it: a varlen spec's
        # _tiles), up to the next entry's report.
        start = log.find(f"Function properties for {name}\n")
        if start < 0:
            start = log.find(f"'{name}'")
        if start >= 0:
            end = log.find("Compiling entry function", start)
            section = log[start:end if end >= 0 else len(log)]
    def grab(pattern: str) -> int:
        m = re.search(pattern, section)
        return int(m.group(1)) if m else 0
    warnings = re.findall(r"ptxas warning\s*:\s*(.+)", log)
    # Hopper performance diagnostics come as "info" lines with a code: C7508
    # (setmaxnreg ignored), C7510-C7515 (wgmma serialized). Each is a problem.
    warnings += re.findall(r"ptxas info\s*:\s*(\(C75(?:0[89]|1\d)\).+)", log)
    warnings = tuple(sorted(set(warnings)))
    return Report(
        registers=grab(r"Used " + _NUM + r" registers"),
        spill_stores=grab(_NUM + r" bytes spill stores"),
        spill_loads=grab(_NUM + r" bytes spill loads"),
        stack_frame=grab(_NUM + r" bytes stack frame"),
        static_smem=grab(_NUM + r" bytes smem"),
        warnings=warnings,
    )


_version: tuple | None = None


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor), part of every cache key.

    Asking NVRTC loads its library (about half a second, the largest part of a new process's first
    call when its kernels are cached), so the answer is kept in ``$FLASHGEN_HOME/kernels/nvrtc.json``
    with the library's path, size, modification time and inode and what decides which library is found
    (the library path variables, the CUDA roots, the Python prefix); a later process that finds all
    of them unchanged takes the version from there, the way ccache identifies a compiler. Anything
    else (no such file, a changed library, another environment, a malformed record) asks NVRTC."""
    global _version
    if _version is None:
        _version = _stamped_version()
        if _version is None:
            from cupy_backends.cuda.libs import nvrtc

            _version = tuple(nvrtc.getVersion())
            _stamp_version(_version)
    return _version


def _library_stat(path: str) -> list | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _stamp_path() -> Path:
    return settings.home() / "kernels" / "nvrtc.json"


def _stamped_version() -> tuple | None:
    try:
        record = json.loads(files.read_regular(_stamp_path(), 1 << 16))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("environment") != settings.toolchain_environment():
        return None
    library, version = record.get("library"), record.get("version")
    if not isinstance(library, str) or _library_stat(library) != record.get("stat"):
        return None
    if not (isinstance(version, list) and len(version) == 2 and all(type(v) is int for v in version)):
        return None
    return tuple(version)


def _loaded_nvrtc() -> str | None:
    """The path of the NVRTC library this process has loaded (Linux: from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip() if line.count(" ") >= 5 else ""
                if re.search(r"/libnvrtc\.so[.0-9]*$", path) or re.search(r"/nvrtc64_[0-9_]*\.dll$", path):
                    return path
    except OSError:
        pass
    return None


def _stamp_version(version: tuple) -> None:
    library = _loaded_nvrtc()
    stat_ = _library_stat(library) if library else None
    if stat_ is None:
        return
    record = {"library": library, "stat": stat_, "version": list(version),
              "environment": settings.toolchain_environment()}
    try:
        _stamp_path().parent.mkdir(parents=True, exist_ok=True)
        files.atomic_write(_stamp_path(), json.dumps(record, indent=1).encode())
    except OSError:
        pass


def compile_options(arch: str) -> list[str]:
    return [f"--gpu-architecture={arch}", *BASE_OPTIONS]


# NVRTC 13.0 (the H200 image's) keeps compiled code in the CUDA compute cache and, on a hit, returns
# the cubin with an empty program log: no ptxas resource report to check for spills (seen on the H200,
# docs/perf/toolchain.md). flashgen keeps its own binary cache, so it never wants that one. Disabling
# the compute cache only helps when done before NVRTC is loaded (a program that imported torch first
# can be too late: a benchmark with a fresh FLASHGEN_HOME got empty logs for every kernel the GPU suite
# had compiled), so each compile also carries a macro of its own (``_nonce_option``): the compute cache
# never hits, and the cubin is byte-identical (an unused macro).
settings.disable_cuda_compute_cache()


def _nonce_option() -> str:
    return f"-DFLASHGEN_COMPILE_NONCE=0x{os.urandom(8).hex()}"


def compile_source(source: str, arch: str, name: str, source_path: str | None = None) -> Binary:
    """Compile ``source`` to a cubin for ``arch`` with NVRTC (no GPU needed).

    Raises ``CompileError`` with the NVRTC log when compilation fails, or when
    ``FLASHGEN_NO_COMPILE`` is set (for tests that must hit the cache).
    """
    if settings.no_compile():
        raise CompileError(f"{name}: compiling is disabled (FLASHGEN_NO_COMPILE is set)", source_path=source_path)
    from cupy_backends.cuda.libs import nvrtc

    options = [*compile_options(arch), _nonce_option()]  # the cache key leaves the nonce out
    prog = nvrtc.createProgram(source, f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            raise CompileError(f"NVRTC failed on {name} for {arch}: {exc}",
                               log=nvrtc.getProgramLog(prog), source_path=source_path) from None
        log = nvrtc.getProgramLog(prog)
        cubin = whole_elf(bytes(nvrtc.getCUBIN(prog)))
    finally:
        nvrtc.destroyProgram(prog)
    return Binary(name=name, arch=arch, key=cache_key(source, arch), cubin=cubin, log=log,
                  report=parse_ptxas_log(log, name))


def cache_key(source: str, arch: str) -> str:
    # "elf": binaries cached before whole_elf (one byte short) are compiled again.
    blob = json.dumps({"source": source, "options": compile_options(arch), "arch": arch,
                       "nvrtc": list(nvrtc_version()), "flashgen": __version__, "elf": "whole"}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


_REPORT_INTS = ("registers", "spill_stores", "spill_loads", "stack_frame", "static_smem")
_META_BYTES = 16 << 20  # a meta.json holds the ptxas log of one kernel: a few kilobytes


def _meta_digest(meta: dict) -> str:
    """The checksum a meta.json carries over everything a hit trusts (key, name, arch, the cubin's hash,
    the ptxas report and log): an edited report (say, spills set to 0) is a miss, not a hidden spill."""
    body = {k: meta.get(k) for k in ("key", "name", "arch", "cubin_sha256", "report", "log")}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _report_of(record) -> Report | None:
    """The Report of a meta.json's ``report`` record, or None when any field is missing or mistyped."""
    if not isinstance(record, dict) or set(record) != {*_REPORT_INTS, "warnings"}:
        return None
    if any(type(record[k]) is not int or record[k] < 0 for k in _REPORT_INTS):
        return None
    warns = record["warnings"]
    if not isinstance(warns, list) or any(type(w) is not str for w in warns):
        return None
    return Report(**{**record, "warnings": tuple(warns)})


def _read_cached(folder: Path, key: str) -> Binary | None:
    """The cached binary in ``folder`` if its metadata is well formed and its key, cubin checksum and
    metadata checksum match; None (a miss: the caller compiles) for anything else."""
    try:
        meta = json.loads(files.read_regular(folder / "meta.json", _META_BYTES))
        cubin = files.read_regular(folder / "kernel.cubin", 1 << 30)
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("key") != key or not isinstance(meta.get("log", ""), str):
        return None
    if meta.get("cubin_sha256") != hashlib.sha256(cubin).hexdigest() or meta.get("meta_sha256") != _meta_digest(meta):
        return None
    report = _report_of(meta.get("report"))
    if report is None or type(meta.get("name")) is not str or type(meta.get("arch")) is not str:
        return None
    return Binary(name=meta["name"], arch=meta["arch"], key=key, cubin=cubin, log=meta.get("log", ""), report=report)


def cache_dir(name: str, key: str) -> Path:
    return settings.home() / "kernels" / f"{name}-{key[:16]}"


_warned: set = set()


def _uncached(source: str, arch: str, name: str, folder: Path, exc: OSError) -> Binary:
    """Compile without the disk cache where its folder cannot be used, with one warning per folder."""
    root = folder.parent
    if root not in _warned:
        _warned.add(root)
        warnings.warn(f"flashgen: the kernel cache {root} cannot be used ({exc.strerror or exc}); compiling in "
                      "memory (set FLASHGEN_HOME to a writable folder to keep compiled kernels)", stacklevel=3)
    return compile_source(source, arch, name)


def get_binary(source: str, arch: str, name: str) -> tuple[Binary, bool]:
    """(binary, hit): the cached binary for this exact source and arch, compiling on a miss.

    A miss compiles under an exclusive lock on the entry's folder, looking again once the lock is held
    (another process may have finished meanwhile); the metadata is written last and marks the entry
    complete. A cache location that cannot be used (a file where a folder should be, no permission, a
    read-only mount, a loop of links) gives a warning and an in-memory compile, never a traceback."""
    key = cache_key(source, arch)
    folder = cache_dir(name, key)
    hit = _read_cached(folder, key)
    if hit is not None:
        return hit, True
    try:
        with files.locked(folder):
            hit = _read_cached(folder, key)
            if hit is not None:
                return hit, True
            files.atomic_write(folder / "kernel.cu", source.encode())
            binary = compile_source(source, arch, name, source_path=str(folder / "kernel.cu"))
            files.atomic_write(folder / "kernel.cubin", binary.cubin)
            meta = {"key": key, "name": name, "arch": arch, "cubin_sha256": hashlib.sha256(binary.cubin).hexdigest(),
                    "report": {**asdict(binary.report), "warnings": list(binary.report.warnings)}, "log": binary.log,
                    "flashgen": __version__, "nvrtc": list(nvrtc_version())}
            meta["meta_sha256"] = _meta_digest(meta)
            files.atomic_write(folder / "meta.json", json.dumps(meta, indent=1).encode())  # last: marks complete
    except OSError as exc:
        return _uncached(source, arch, name, folder, exc), False
    return binary, False


def build(spec) -> Binary:
    """Render and compile ``spec`` for ``spec.arch`` (disk-cached)."""
    binary, _ = get_binary(render(spec), spec.arch, spec.name)
    return binary
