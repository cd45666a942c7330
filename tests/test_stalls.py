"""The ``stalls`` bench suite without a GPU: its options, the ncu command it builds, the digest of ncu's raw CSV,
and a whole run against a stand-in ``ncu`` (a script that prints a CSV, or fails)."""
from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from flashgen.bench import stalls
from cli_util import run_main

FP8 = "fwd_sm90_d128_m128_n128_w12_s2_ws_pp_fp8_full_bf16_sm90a"
BF16 = "fwd_sm90_d128_m128_n128_w12_s3_ws_ov_causal_bf16_sm90a"
BWD = "bwd_sm90_d128_m64_n128_w12_s2_causal_bf16_sm90a"

# ncu --csv --page raw: a header of metric names, a row of units, one row per profiled launch.
CSV = "\n".join([
    "==PROF== Connected to process 4242",
    '"ID","Process ID","Kernel Name","gpu__time_duration.sum","smsp__issue_active.avg.pct_of_peak_sustained_active",'
    '"sm__throughput.avg.pct_of_peak_sustained_elapsed","sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_'
    'sustained_active","sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",'
    '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","launch__grid_size"',
    '"","","","usecond","%","%","%","%","inst","inst",""',
    f'"0","4242","{FP8}","1,421.50","31.2","44.0","38.5","61.0","2.75","0.40","1024"',
    "==PROF== Disconnected from process 4242",
])


def test_digest_reads_the_raw_page():
    got = stalls.digest(CSV)
    assert got == {"duration": 1421.5, "issue_pct": 31.2, "sm_pct": 44.0, "pipe_tensor_op_gmma": 38.5,
                   "pipe_xu": 61.0, "stall_barrier": 2.75, "stall_long_scoreboard": 0.4}
    ns = CSV.replace('"usecond"', '"nsecond"')
    assert stalls.digest(ns)["duration"] == pytest.approx(1.4215)
    with pytest.raises(ValueError, match="no ncu CSV"):
        stalls.digest("==PROF== No kernels were profiled.")


# ncu --page source --csv --print-source sass: the kernel's name, a header, one row per SASS instruction
# (a trimmed column set in ncu's order; the digest reads columns by name). A loop of four instructions run
# 1000 times (MUFU and the GEMM wait heaviest), a prologue run 10 times.
SOURCE_HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
                 '"# Samples","Instructions Executed","stall_barrier","stall_long_sb","stall_wait",'
                 '"stall_barrier (Not Issued)","stall_long_sb (Not Issued)","stall_wait (Not Issued)"')
SOURCE = "\n".join([
    f'"Kernel Name","{FP8}",',
    SOURCE_HEADER,
    '"0x10","      LDC R1, c[0x0][0x28]","5","5","5","10","0","0","5","0","0","5"',
    '"0x20","      SHF.L.U32 R4, R4, 0x1f, RZ","3","3","3","10","0","0","3","0","0","3"',
    '"0x30","      WARPGROUP.DEPBAR.LE gsb0, 0x0","300","299","300","1,000","290","0","10","289","0","10"',
    '"0x40","      MUFU.EX2 R45, R45","400","380","400","1,000","0","0","380","0","0","370"',
    '"0x50","      MUFU.EX2 R48, R48","200","190","200","1,000","0","0","190","0","0","180"',
    '"0x60","  @!P0  BRA 0x7fa7237f1430","100","99","100","1,000","0","95","5","0","95","4"',
])


def test_source_digest_finds_the_loop_and_its_costs():
    got = stalls.source_digest(SOURCE)
    assert got["samples"] == 1008
    loop, prologue = got["groups"]
    assert (loop["instructions"], loop["executions"], loop["share"]) == (4, 1000, 99.2)
    assert [(o["op"], o["count"], o["share"], o["reason"]) for o in loop["ops"]] == [
        ("MUFU", 2, 60.0, "wait"), ("WARPGROUP", 1, 30.0, "barrier"), ("BRA", 1, 10.0, "long_sb")]
    assert (prologue["instructions"], prologue["executions"]) == (2, 10)
    lines = stalls.source_lines(FP8, got)
    assert lines[0] == f"{FP8}: 4 instructions x 1000 executions, 99.2 % of the samples: MUFU x2 60.0 % (wait), " \
                       "WARPGROUP x1 30.0 % (barrier), BRA x1 10.0 % (long_sb)"
    with pytest.raises(ValueError, match="no per-instruction table"):
        stalls.source_digest("==PROF== nothing")


def test_ncu_command_profiles_one_launch_of_the_named_kernel(tmp_path):
    args = type("A", (), {"kernels": FP8, "shape": "1,16,4096,128", "skip": 3, "sections": "WarpStateStats",
                          "ncu": "/opt/ncu", "top": 5})()
    settings = stalls.parse(args)
    cmd = stalls.ncu_command(settings, settings["specs"][0])
    assert cmd[:2] == ["/opt/ncu", "--clock-control"] and "none" in cmd
    assert cmd[cmd.index("-k") + 1] == f"regex:^{FP8}$"
    assert cmd[cmd.index("--launch-skip") + 1] == "3" and cmd[cmd.index("--launch-count") + 1] == "1"
    assert cmd[cmd.index("--section") + 1] == "WarpStateStats"
    assert cmd[-6:] == [sys.executable, "-m", "flashgen.bench.stalls", FP8, "1,16,4096,128", "4"]  # skip + 1
    # --source: the same launch again, saved as a report with the per-instruction sampling, read back as CSV
    src = stalls.ncu_command(settings, settings["specs"][0], report=tmp_path / FP8)
    assert src[src.index("-o") + 1] == str(tmp_path / FP8) and "--csv" not in src
    assert [src[i + 1] for i, w in enumerate(src) if w == "--section"] == ["SourceCounters", "WarpStateStats"]
    assert src[src.index("--launch-skip") + 1] == "3" and src[-6:] == cmd[-6:]
    page = stalls.source_command(settings, tmp_path / f"{FP8}.ncu-rep")
    assert page[:3] == ["/opt/ncu", "-i", str(tmp_path / f"{FP8}.ncu-rep")] and "source" in page


MOD = "fwd_sm90_d128_m128_n128_w12_s3_ws_ov_mod7576215852385_full_bf16_sm90a"  # the causal mask_mod's kernel


def test_a_mod_kernel_runs_with_its_case_functions():
    """--mods CASE: a mod kernel named in --kernels is called with the functions of that flashgen bench mods
    case, built at --shape; the child gets the case after the kernel's launch arguments."""
    pytest.importorskip("torch")
    from flashgen.bench.mods import case_token

    args = type("A", (), {"kernels": f"{MOD},{BF16}", "shape": "2,16,8192,128", "skip": 2, "sections": "WarpStateStats",
                          "ncu": "ncu", "top": 5, "mods": "causal"})()
    settings = stalls.parse(args)
    mod, plain = settings["specs"]
    assert mod.mod == case_token("causal", 2, 16, 8192)
    assert stalls.ncu_command(settings, mod)[-4:] == [MOD, "2,16,8192,128", "3", "causal"]
    assert stalls.ncu_command(settings, plain)[-3:] == [BF16, "2,16,8192,128", "3"]


@pytest.mark.parametrize("argv,text", [
    (["--kernels", MOD], "a kernel with user mods; --mods CASE"),
    (["--kernels", MOD, "--mods", "alibi"], "are not --mods alibi's"),
    (["--kernels", MOD, "--mods", "nonsense"], "--mods 'nonsense': one of causal"),
])
def test_mod_kernels_need_their_case(capsys, tmp_path, argv, text):
    pytest.importorskip("torch")
    code, _, err = run_main(capsys, "bench", "stalls", "--out", str(tmp_path), *argv)
    assert code == 2 and text in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv,text", [
    (["--kernels", ""], "name at least one kernel"),
    (["--kernels", "fwd_sm90_nonsense"], "--kernels 'fwd_sm90_nonsense'"),
    (["--kernels", "decode_split_d128_m16_n128_w4_s2_ld2_causal_bf16_sm90a"], "profiles the forward"),
    (["--kernels", BF16, "--shape", "1,2,3"], "b,h,n,d"),
    (["--kernels", BF16, "--shape", "1,2,128,256"], "head-dim tile 128 < d = 256"),
    (["--kernels", "fwd_sm90_d128_m128_n128_w12_s3_ws_ov_vl_causal_bf16_sm90a"], "packed rows need their own inputs"),
    (["--kernels", "bwd_sm90_d128_m64_n128_w12_s2_cap_causal_bf16_sm90a"], "profiled plain"),
    (["--kernels", BF16, "--skip", "-1"], "--skip"),
    (["--kernels", BF16, "--sections", "Warp;rm -rf"], "--sections"),
])
def test_bad_options_are_one_line(capsys, tmp_path, argv, text):
    code, _, err = run_main(capsys, "bench", "stalls", "--out", str(tmp_path), *argv)
    assert code == 2 and text in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _fake_ncu(tmp_path, body: str) -> str:
    path = tmp_path / "ncu"
    path.write_text(f"#!{sys.executable}\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_a_run_against_a_stand_in_ncu(capsys, tmp_path):
    """The suite runs ncu once per kernel, keeps each CSV, and tabulates the digest; a kernel ncu fails on is
    a row with the error, the others stand."""
    script = ("import sys\n"
              f"csv = {CSV!r}\n"
              "name = sys.argv[sys.argv.index('-k') + 1]\n"
              f"if {BF16!r} in name:\n    sys.stderr.write('==ERROR== profiling failed\\n'); sys.exit(1)\n"
              "print(csv)")
    ncu = _fake_ncu(tmp_path, script)
    out = tmp_path / "out"
    code, stdout, err = run_main(capsys, "bench", "stalls", "--out", str(out), "--no-plot", "--ncu", ncu,
                                 "--kernels", f"{FP8},{BF16}", "--top", "1")
    assert code == 0, err
    result = json.loads((out / "stalls.json").read_text())
    fp8, bf16 = result["rows"]
    assert fp8["results"]["duration"]["value"] == 1421.5 and fp8["results"]["stall_barrier"]["value"] == 2.75
    assert "stall_long_scoreboard" not in result["impls"]  # --top 1: the largest reason only
    assert "ncu exited 1" in bf16["error"] and "profiling failed" in bf16["error"]
    assert (out / "stalls" / f"{FP8}.csv").read_text().startswith("==PROF==")
    assert FP8 in stdout and "1421.50" in stdout


def test_source_against_a_stand_in_ncu(capsys, tmp_path):
    """--source: a second profile per kernel writes a report; its source page is kept as a CSV and digested
    into the row and the notes; the report itself is removed. A kernel whose source page fails keeps its
    raw figures and says why."""
    script = ("import sys, pathlib\n"
              f"csv, source = {CSV!r}, {SOURCE!r}\n"
              "if '-i' in sys.argv:\n"
              "    rep = sys.argv[sys.argv.index('-i') + 1]\n"
              f"    if {BF16!r} in rep:\n        sys.stderr.write('==ERROR== cannot read\\n'); sys.exit(1)\n"
              "    print(source); sys.exit(0)\n"
              "if '-o' in sys.argv:\n"
              "    pathlib.Path(sys.argv[sys.argv.index('-o') + 1] + '.ncu-rep').write_text('report')\n"
              "    sys.exit(0)\n"
              "print(csv)")
    ncu = _fake_ncu(tmp_path, script)
    out = tmp_path / "out"
    code, stdout, err = run_main(capsys, "bench", "stalls", "--out", str(out), "--no-plot", "--ncu", ncu,
                                 "--kernels", f"{FP8},{BF16}", "--source")
    assert code == 0, err
    fp8, bf16 = json.loads((out / "stalls.json").read_text())["rows"]
    assert fp8["source"]["groups"][0]["ops"][0] == {"op": "MUFU", "count": 2, "share": 60.0, "reason": "wait"}
    assert (out / "stalls" / f"{FP8}.source.csv").read_text().startswith('"Kernel Name"')
    assert not (out / "stalls" / f"{FP8}.ncu-rep").exists()
    assert "source" not in bf16 and "ncu -i exited 1" in bf16["source_error"]
    assert bf16["results"]["duration"]["value"] == 1421.5  # the raw figures stand
    assert "MUFU x2 60.0 % (wait)" in stdout and "no per-instruction view" in stdout


def test_a_backward_kernel_is_taken():
    """The dK/dV kernels (bwd_sm90, bwd_dkdv) are profiled too: the same ncu command, the child runs the
    backward with the kernel forced."""
    args = type("A", (), {"kernels": BWD, "shape": "1,16,4096,128", "skip": 2, "sections": "WarpStateStats",
                          "ncu": "/opt/ncu", "top": 5})()
    settings = stalls.parse(args)
    cmd = stalls.ncu_command(settings, settings["specs"][0])
    assert cmd[cmd.index("-k") + 1] == f"regex:^{BWD}$" and cmd[-3:] == [BWD, "1,16,4096,128", "3"]


def test_a_variant_kernel_is_called_with_its_options():
    """The profiled child calls a kernel with a window, softcap, ALiBi or sinks with the tuner's values of
    them (variants.tuning_kwargs, shared with the tuner's trials); a plain or FP8-only kernel with none."""
    from flashgen import variants
    from flashgen.spec import KernelSpec

    cap = KernelSpec.from_name("fwd_sm90_d128_m128_n128_w12_s3_ws_ov_cap_alibi_causal_bf16_sm90a")
    kw = variants.tuning_kwargs(variants.spec_key(cap), cap.causal, 8192, 16, "cpu")
    assert kw["softcap"] == variants.TUNING_SOFTCAP and tuple(kw["alibi_slopes"].shape) == (16,)
    assert set(kw) == {"softcap", "alibi_slopes"}
    win = variants.tuning_kwargs("win_sink", False, 8192, 4, "cpu")
    assert win["window"] == (2048, 2048) and tuple(win["sinks"].shape) == (4,)  # a quarter of N, both sides
    assert variants.tuning_kwargs(variants.spec_key(KernelSpec.from_name(FP8)), False, 8192, 16, "cpu") == {}


def test_a_missing_ncu_is_one_line(capsys, tmp_path):
    code, _, err = run_main(capsys, "bench", "stalls", "--out", str(tmp_path), "--kernels", FP8,
                            "--ncu", str(tmp_path / "no-such-ncu"))
    assert code == 2 and "not found" in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "stalls")  # refused before anything ran


@pytest.mark.gpu
def test_the_suite_on_the_gpu_host(capsys, tmp_path):
    """With a CUDA device and ncu: a bf16 and an FP8 forward and a dK/dV kernel profiled, each with a duration,
    stall reasons and its main loop's opcodes."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    import shutil

    if shutil.which("ncu") is None:
        pytest.skip("no ncu on PATH")
    out = tmp_path / "out"
    code, _, err = run_main(capsys, "bench", "stalls", "--out", str(out), "--no-plot", "--kernels", f"{FP8},{BF16},{BWD}",
                            "--shape", "1,8,2048,128", "--source")
    assert code == 0, err
    rows = json.loads((out / "stalls.json").read_text())["rows"]
    assert [r["kernel"] for r in rows] == [FP8, BF16, BWD]
    for r in rows:
        assert "error" not in r, r.get("error")
        assert r["results"]["duration"]["value"] > 0
        assert any(k.startswith("stall_") and "value" in v for k, v in r["results"].items())
        assert "source_error" not in r, r.get("source_error")
        loop = r["source"]["groups"][0]  # the main loop: its wgmma or the softmax's exp2s among its heaviest
        assert loop["executions"] > 1 and loop["share"] > 20
        assert {"MUFU", "HGMMA", "QGMMA"} & {o["op"] for o in loop["ops"]}
