"""The on-disk binary cache (flashgen.codegen.compiler.get_binary), no GPU.

Most tests use a tiny hand-written kernel so that a compile takes
milliseconds; the two-process test compiles a real spec. FLASHGEN_HOME is a
fresh temporary folder for each test (tests/conftest.py).
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os

import pytest

from flashgen import CompileError, KernelSpec
from flashgen.codegen import build, render
from flashgen.codegen.compiler import cache_dir, cache_key, get_binary

NAME = "tiny_axpy"
SOURCE = """\
extern "C" __global__ void tiny_axpy(float a, const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
"""
ARCH = "sm_80"


def _folder(source=SOURCE, arch=ARCH, name=NAME):
    return cache_dir(name, cache_key(source, arch))


def test_miss_then_hit(flashgen_home):
    """The first call compiles (hit=False) and fills the cache under FLASHGEN_HOME; the second returns
    hit=True with the same cubin, report and key."""
    first, hit1 = get_binary(SOURCE, ARCH, NAME)
    second, hit2 = get_binary(SOURCE, ARCH, NAME)
    assert (hit1, hit2) == (False, True)
    assert second.cubin == first.cubin and first.cubin[:4] == b"\x7fELF"
    assert second.report == first.report and first.report.registers > 0
    assert second.key == first.key == cache_key(SOURCE, ARCH)
    folder = _folder()
    assert folder.parent.parent == flashgen_home
    assert sorted(p.name for p in folder.iterdir()) == ["kernel.cu", "kernel.cubin", "meta.json"]
    assert (folder / "kernel.cu").read_text() == SOURCE


def test_hit_does_not_compile(monkeypatch):
    """A hit never calls NVRTC: with compile_source replaced by a failing stub, the hit still works."""
    compiled, _ = get_binary(SOURCE, ARCH, NAME)
    import flashgen.codegen.compiler as compiler

    def no_compile(*args, **kwargs):
        raise AssertionError("compile_source called on a cache hit")

    monkeypatch.setattr(compiler, "compile_source", no_compile)
    again, hit = get_binary(SOURCE, ARCH, NAME)
    assert hit and again.cubin == compiled.cubin


def test_changed_source_changes_the_key_and_compiles_again():
    """Any edit of the source (here one comment line) gives another key and folder, and compiles;
    the first entry stays a hit."""
    edited = SOURCE + "// edited template\n"
    a, _ = get_binary(SOURCE, ARCH, NAME)
    b, hit = get_binary(edited, ARCH, NAME)
    assert not hit
    assert a.key != b.key
    assert _folder(edited) != _folder(SOURCE) and (_folder(edited) / "meta.json").exists()
    assert get_binary(SOURCE, ARCH, NAME)[1] is True


def test_arch_is_part_of_the_key():
    """The same source for another arch is another entry with another cubin."""
    a, _ = get_binary(SOURCE, "sm_80", NAME)
    b, hit = get_binary(SOURCE, "sm_90a", NAME)
    assert not hit
    assert a.key != b.key and a.cubin != b.cubin


def test_tampered_cubin_is_not_used():
    """A cached cubin whose bytes no longer match the recorded checksum is recompiled and replaced."""
    good, _ = get_binary(SOURCE, ARCH, NAME)
    path = _folder() / "kernel.cubin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    again, hit = get_binary(SOURCE, ARCH, NAME)
    assert not hit
    assert again.cubin == good.cubin
    assert path.read_bytes() == good.cubin
    assert get_binary(SOURCE, ARCH, NAME)[1] is True


def test_truncated_cubin_is_not_used():
    """A half-written cubin (checksum mismatch) is never returned."""
    good, _ = get_binary(SOURCE, ARCH, NAME)
    path = _folder() / "kernel.cubin"
    path.write_bytes(good.cubin[:101])
    again, hit = get_binary(SOURCE, ARCH, NAME)
    assert not hit and again.cubin == good.cubin


def test_tampered_meta_key_is_not_used():
    """An entry whose meta.json records another key is treated as a miss and rewritten."""
    get_binary(SOURCE, ARCH, NAME)
    meta_path = _folder() / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["key"] = "0" * 64
    meta_path.write_text(json.dumps(meta))
    _, hit = get_binary(SOURCE, ARCH, NAME)
    assert not hit
    assert json.loads(meta_path.read_text())["key"] == cache_key(SOURCE, ARCH)


@pytest.mark.parametrize("damage", ["not json {", "", json.dumps({"key": "x"})])
def test_unreadable_meta_is_not_used(damage):
    """A corrupt or incomplete meta.json is a miss, never an exception."""
    get_binary(SOURCE, ARCH, NAME)
    (_folder() / "meta.json").write_text(damage)
    binary, hit = get_binary(SOURCE, ARCH, NAME)
    assert not hit and binary.cubin[:4] == b"\x7fELF"


def test_meta_records_checksum_and_versions():
    """meta.json records the key, the cubin's sha256, the report and the versions it was built with."""
    binary, _ = get_binary(SOURCE, ARCH, NAME)
    meta = json.loads((_folder() / "meta.json").read_text())
    assert meta["key"] == binary.key
    assert meta["cubin_sha256"] == hashlib.sha256(binary.cubin).hexdigest()
    assert meta["report"]["registers"] == binary.report.registers
    assert meta["arch"] == ARCH and meta["name"] == NAME
    assert meta["flashgen"] and len(meta["nvrtc"]) == 2


def test_no_compile_setting_makes_a_miss_raise_but_a_hit_work(monkeypatch):
    """With FLASHGEN_NO_COMPILE=1 a miss raises CompileError naming the setting; a hit still returns."""
    cached, _ = get_binary(SOURCE, ARCH, NAME)
    monkeypatch.setenv("FLASHGEN_NO_COMPILE", "1")
    again, hit = get_binary(SOURCE, ARCH, NAME)
    assert hit and again.cubin == cached.cubin
    with pytest.raises(CompileError, match="FLASHGEN_NO_COMPILE"):
        get_binary(SOURCE + "// never compiled\n", ARCH, NAME)


def test_compile_error_carries_log_and_source_path():
    """A source NVRTC rejects raises CompileError with the NVRTC log (line and message) and the path of
    the emitted source, which holds exactly that source; nothing is cached as complete."""
    bad = 'extern "C" __global__ void broken_k(int* p) {\n  p[0] = undeclared_name_17;\n}\n'
    with pytest.raises(CompileError) as info:
        get_binary(bad, ARCH, "broken_k")
    err = info.value
    assert "undeclared_name_17" in err.log and "error" in err.log
    assert err.source_path and os.path.exists(err.source_path)
    with open(err.source_path) as fh:
        assert fh.read() == bad
    assert err.source_path in str(err) and "undeclared_name_17" in str(err)
    assert not (_folder(bad, name="broken_k") / "meta.json").exists()


def test_build_of_a_spec_uses_its_name_and_rendered_source():
    """build(spec) caches the rendered source under a folder named after the spec, and hits afterwards."""
    spec = KernelSpec(arch="sm_80", dtype="fp16", head_dim=32, block_m=64, block_n=64, warps=4, stages=2)
    binary = build(spec)
    folder = cache_dir(spec.name, cache_key(render(spec), spec.arch))
    assert folder.name.startswith(spec.name + "-")
    assert (folder / "kernel.cu").read_text() == render(spec)
    assert get_binary(render(spec), spec.arch, spec.name) == (binary, True)


# -- two processes at once ----------------------------------------------------

CONCURRENT_SPEC = dict(kind="fwd_v2", arch="sm_80", dtype="bf16", head_dim=96, block_m=64, block_n=64, warps=4,
                       stages=2, causal=True)


def _compile_in_child(barrier, queue):
    """Child process: wait for the sibling, then compile the same spec through the cache."""
    try:
        spec = KernelSpec.from_dict(CONCURRENT_SPEC)
        source = render(spec)
        barrier.wait(timeout=60)
        binary, hit = get_binary(source, spec.arch, spec.name)
        queue.put(("ok", hit, hashlib.sha256(binary.cubin).hexdigest()))
    except BaseException as exc:  # report, do not hang the parent
        queue.put(("error", repr(exc), ""))


def test_two_processes_compiling_the_same_spec():
    """Two spawned processes building one spec at the same moment both succeed with the same cubin;
    exactly one compiles (the other finds the entry after taking the lock) and the cache ends with
    one complete entry and no temporary files."""
    spec = KernelSpec.from_dict(CONCURRENT_SPEC)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_compile_in_child, args=(barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(status == "ok" for status, _, _ in results), results
    assert sorted(hit for _, hit, _ in results) == [False, True]
    assert results[0][2] == results[1][2]

    kernels = cache_dir(spec.name, "0" * 16).parent
    entries = [p for p in kernels.iterdir() if p.is_dir()]
    assert len(entries) == 1
    folder = entries[0]
    assert folder == cache_dir(spec.name, cache_key(render(spec), spec.arch))
    assert sorted(p.name for p in folder.iterdir()) == ["kernel.cu", "kernel.cubin", "meta.json"]
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["cubin_sha256"] == results[0][2]
    # and this process sees it as a hit
    assert get_binary(render(spec), spec.arch, spec.name)[1] is True


def _nvrtc_library():
    """The libnvrtc CuPy loads (pip's nvidia-cuda-nvrtc wheel), or None."""
    import glob
    import sys

    for root in sys.path:
        for path in sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "lib", "libnvrtc.so*"))):
            return path
    return None


def test_cubin_is_nvrtcs_whole_elf():
    """compile_source returns the bytes NVRTC itself gives (nvrtcGetCUBINSize / nvrtcGetCUBIN through
    ctypes), not CuPy's getCUBIN result, which is one byte short (compiler.whole_elf)."""
    import ctypes

    from flashgen.codegen.compiler import compile_options, compile_source
    from flashgen.codegen.elf import whole_elf

    path = _nvrtc_library()
    if path is None:
        pytest.skip("no libnvrtc from the nvidia-cuda-nvrtc wheel on sys.path")
    source = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] = 2.f * x[threadIdx.x]; }'
    ours = compile_source(source, "sm_90a", "k").cubin
    lib = ctypes.CDLL(path)
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 0, None, None) == 0
    try:
        opts = [o.encode() for o in compile_options("sm_90a")]
        assert lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) == 0
        size = ctypes.c_size_t()
        assert lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) == 0
        buf = ctypes.create_string_buffer(size.value)
        assert lib.nvrtcGetCUBIN(prog, buf) == 0
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    assert ours == buf.raw and len(ours) == size.value
    assert whole_elf(buf.raw) == buf.raw  # a whole ELF is left as it is
    assert whole_elf(b"not an elf") == b"not an elf"
