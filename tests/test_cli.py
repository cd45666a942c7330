"""The ``flashgen`` command line, no GPU: version, help, emit, compile, and clean refusals."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flashgen import __version__, dispatch, gpus
from flashgen.codegen import render
from flashgen.problem import ProblemKey, bucket_of

from cli_util import run_main


def test_version(capsys):
    """--version prints 'flashgen <version>' and exits 0."""
    code, out, _ = run_main(capsys, "--version")
    assert code == 0
    assert out.strip() == f"flashgen {__version__}"


def test_help_lists_the_commands(capsys):
    """--help exits 0 and names both subcommands; each subcommand's help names its options."""
    code, out, _ = run_main(capsys, "--help")
    assert code == 0 and "emit" in out and "compile" in out
    code, out, _ = run_main(capsys, "compile", "--help")
    assert code == 0
    for opt in ("--d", "--causal", "--dtype", "--arch", "--gpu", "--block-m", "--json"):
        assert opt in out


def test_no_command_is_a_usage_error(capsys):
    """Without a subcommand: exit 2, one line that names the missing command and where the usage is."""
    code, _, err = run_main(capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("flashgen: error: ") and "command" in err and "flashgen -h" in err, err


def test_emit_prints_the_source_that_runs(capsys):
    """emit prints exactly render() of the spec dispatch picks, which names that spec in its header."""
    code, out, err = run_main(capsys, "emit", "--d", "72", "--causal", "--dtype", "fp16", "--arch", "sm_80",
                              "--seqlen", "999")
    assert code == 0 and err == ""
    key = ProblemKey("fwd", "sm_80", "fp16", 96, True, bucket_of(999))
    spec = dispatch.select(key, None, gpus.ARCH_SMEM_PER_BLOCK["sm_80"])
    assert out == render(spec)
    assert out.splitlines()[1] == f"// spec: {spec.name}"
    assert spec.name.startswith("fwd_v2_d96_") and spec.name.endswith("_causal_fp16_sm80")


@pytest.mark.parametrize("kind,entry", [("fwd", "fwd_sm90_"), ("bwd_dkdv", "bwd_sm90_"), ("bwd_dq", "bwd_dq_")])
def test_emit_varlen_prints_the_kernel_with_its_work_list_entry(capsys, kind, entry):
    """--varlen: the plain key's pick with the varlen switch, and its module's _tiles entry."""
    code, out, err = run_main(capsys, "emit", "--d", "128", "--causal", "--varlen", "--kind", kind)
    assert code == 0 and err == ""
    name = out.splitlines()[1].removeprefix("// spec: ")
    assert name.startswith(entry) and "_vl_" in name
    assert f"{name}_tiles(" in out


def test_emit_varlen_refused_for_decode(capsys):
    code, out, err = run_main(capsys, "emit", "--d", "128", "--varlen", "--kind", "decode_split")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "--varlen" in err


@pytest.mark.parametrize("page", [16, 256])
def test_emit_paged_prints_the_kernel_attention_varlen_runs(capsys, page):
    """--varlen --page-size: the varlen pick in its paged form (boxes of gcd(page, block_n) rows); a page
    size off the list, one without --varlen, and a family without paged K/V are one line, exit 2."""
    from flashgen.families import paged_spec
    from flashgen.spec import KernelSpec

    code, out, err = run_main(capsys, "emit", "--d", "128", "--causal", "--varlen", "--page-size", str(page))
    assert code == 0 and err == ""
    code, plain, _ = run_main(capsys, "emit", "--d", "128", "--causal", "--varlen")
    varlen = KernelSpec.from_name(plain.splitlines()[1].removeprefix("// spec: "))
    assert out.splitlines()[1] == f"// spec: {paged_spec(varlen, page).name}" and "_pg" in out.splitlines()[1]
    for bad in (["--varlen", "--page-size", "24"], ["--page-size", "16"], ["--varlen", "--page-size", "16",
                                                                            "--kind", "fwd_v2"]):
        code, out, err = run_main(capsys, "emit", "--d", "128", *bad)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_emit_with_overrides(capsys):
    """Tile overrides replace those fields of dispatch's pick, and land in the emitted spec's name."""
    code, out, _ = run_main(capsys, "emit", "--d", "40", "--arch", "sm_89", "--block-m", "48", "--block-n", "80",
                            "--warps", "1", "--stages", "3")
    assert code == 0
    key = ProblemKey("fwd", "sm_89", "bf16", 64, False, bucket_of(4096))
    want = dispatch.select(key, None, gpus.ARCH_SMEM_PER_BLOCK["sm_89"]).replace(block_m=48, block_n=80, warps=1,
                                                                                 stages=3)
    assert out.splitlines()[1] == f"// spec: {want.name}"
    assert "_d64_m48_n80_w1_s3_" in want.name


def test_emit_with_gpu_profile_uses_its_arch_and_budget(capsys):
    """--gpu l4 without --arch emits an sm_89 kernel whose shared memory fits the L4's 101376 B."""
    code, out, _ = run_main(capsys, "emit", "--d", "256", "--gpu", "l4")
    assert code == 0
    lines = out.splitlines()
    assert lines[1].startswith("// spec: fwd_v2_d256_") and lines[1].endswith("_full_bf16_sm89")
    smem = int(next(line for line in lines[:6] if "dynamic shared memory" in line).split()[-2])
    assert 0 < smem <= gpus.get("l4").smem_per_block


def test_emit_via_python_dash_m():
    """`python -m flashgen.cli emit` works as a program: exit 0, source naming the spec on stdout."""
    proc = subprocess.run([sys.executable, "-m", "flashgen.cli", "emit", "--d", "56", "--arch", "sm_90a"],
                          capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("// Generated by flashgen")
    # d=56 on sm_90a: the default family there is fwd_sm90 (64 tile pads by 1/7 <= 1/3)
    assert lines[1].startswith("// spec: fwd_sm90_d64_") and lines[1].endswith("_full_bf16_sm90a")


def test_compile_json_report(capsys, flashgen_home):
    """compile --json prints a JSON report of the spec: zero spills and stack, registers <= 255,
    shared memory within the arch budget, no problems; the binary lands in FLASHGEN_HOME."""
    code, out, _ = run_main(capsys, "compile", "--d", "64", "--arch", "sm_80", "--json")
    info = json.loads(out)
    assert code == 0
    assert info["spec"].startswith("fwd_v2_d64_") and info["arch"] == "sm_80"
    assert info["spill_stores"] == info["spill_loads"] == info["stack_frame"] == 0
    assert 0 < info["registers"] <= 255
    assert info["static_smem"] + info["dynamic_smem"] <= gpus.ARCH_SMEM_PER_BLOCK["sm_80"]
    assert info["cubin_bytes"] > 0 and info["problems"] == []
    assert any(p.name.startswith(info["spec"] + "-") for p in (flashgen_home / "kernels").iterdir())


def test_compile_text_report(capsys):
    """Without --json, compile prints one 'key value' line per field."""
    code, out, _ = run_main(capsys, "compile", "--d", "32", "--arch", "sm_80", "--dtype", "fp16")
    assert code == 0
    fields = dict(line.split(None, 1) for line in out.splitlines())
    assert fields["spill_stores"] == "0" and fields["problems"] == "[]"
    assert fields["spec"].endswith("_full_fp16_sm80")


@pytest.mark.parametrize("argv,message", [
    (["emit", "--d", "12"], "--d 12"),
    (["emit", "--d", "264"], "--d 264"),
    (["emit", "--d", "0"], "--d 0"),
    (["compile", "--d", "64", "--block-m", "7"], "block_m=7"),
    (["emit", "--d", "64", "--block-m", "0"], "block_m=0"),
    (["emit", "--d", "64", "--arch", "sm_80", "--warps", "3"], "warps=3"),
    (["emit", "--d", "64", "--warps", "3"], "warps=16, got 3"),  # sm_90a: fwd_sm90's warps follow block_m
    (["emit", "--d", "256", "--arch", "sm_89", "--block-m", "128", "--block-n", "128", "--warps", "8"],
     "over 101376 B"),
])
def test_bad_spec_arguments_fail_cleanly(capsys, argv, message):
    """Arguments that make no valid kernel exit 2 with 'flashgen: error: ...' naming the value, no traceback."""
    code, out, err = run_main(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.startswith("flashgen: error:") and message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv,message", [
    (["emit", "--d", "64", "--dtype", "fp32"], "invalid choice: 'fp32'"),
    (["emit", "--d", "64", "--arch", "sm_75"], "invalid choice: 'sm_75'"),
    (["emit", "--d", "64", "--kind", "../../x"], "invalid choice: '../../x'"),
    (["emit", "--d", "64", "--gpu", "b200"], "invalid choice: 'b200'"),
    (["emit", "--d", "sixty-four"], "invalid int value"),
    (["emit"], "--d"),
    (["show", "--gpu"], "expected one argument"),
    (["tune", "--gpu", "h200", "--d", "64", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["bench", "fwd", "--d"], "expected one argument"),
    (["no-such-command"], "invalid choice: 'no-such-command'"),
])
def test_bad_argument_values_are_usage_errors(capsys, argv, message):
    """What argparse refuses (choices, ints, required, unknown options) exits 2 with one line naming it and
    pointing at -h, not the usage block, and no traceback."""
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and " -h shows the usage" in err, err
    assert "usage:" not in err and "Traceback" not in err


def test_bad_argument_via_subprocess_has_no_traceback():
    """Run as a program, a bad head dim exits non-zero with one clear line on stderr and no traceback."""
    proc = subprocess.run([sys.executable, "-m", "flashgen.cli", "compile", "--d", "12", "--arch", "sm_80"],
                          capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "flashgen: error: --d 12: head dims are multiples of 8 from 8 to 256"]


@pytest.mark.parametrize("kind,prefix", [("fwd_v2", "fwd_v2_d64_"), ("bwd_sm90", "bwd_sm90_d64_"),
                                         ("bwd_dkdv", "bwd_sm90_d64_"), ("decode_split", "decode_split_d64_"),
                                         ("bwd_dq", "bwd_dq_d64_")])
def test_emit_by_kind(capsys, kind, prefix):
    """--kind takes a problem (the family dispatch picks for it) or a family (that family's rule)."""
    code, out, err = run_main(capsys, "emit", "--d", "64", "--arch", "sm_90a", "--kind", kind)
    assert code == 0, err
    assert out.splitlines()[1].startswith(f"// spec: {prefix}")


@pytest.mark.parametrize("args,want", [
    (("--kind", "bwd_dkdv", "--d", "128", "--causal"), "bwd_sm90_d128_m64_n128_w12_s2_dqe_det_causal_bf16_sm90a"),
    (("--kind", "bwd_sm90", "--d", "64"), "bwd_sm90_d64_m128_n128_w12_s2_dq4_dqe_det_full_bf16_sm90a"),
    (("--kind", "bwd_dkdv", "--d", "80"), "bwd_sm90_d96_m64_n128_w12_s2_dqe_det_full_bf16_sm90a"),
    (("--kind", "bwd_dkdv", "--d", "160"), "bwd_sm90_d192_m64_n64_w12_s2_dq4_det_full_bf16_sm90a"),
    (("--kind", "bwd_dq", "--d", "96"), "bwd_dq_d96_m64_n64_w8_s2_full_bf16_sm90a")])
def test_emit_deterministic(capsys, args, want):
    """--deterministic: the dK/dV kernel deterministic=True runs (bwd_sm90's det twin); the mma.sync pair's
    kernels are deterministic as they are."""
    code, out, err = run_main(capsys, "emit", "--arch", "sm_90a", "--deterministic", *args)
    assert code == 0, err
    assert out.splitlines()[1] == f"// spec: {want}"


@pytest.mark.parametrize("args,message", [
    (("--arch", "sm_90a", "--kind", "fwd", "--d", "64"), "--kind fwd: --deterministic is the backward's"),
    (("--arch", "sm_80", "--kind", "bwd_dkdv", "--d", "160"),
     "here (bwd_dkdv) deterministic=True computes dQ in bwd_dkdv_nodq and bwd_dq"),
    (("--arch", "sm_90a", "--kind", "bwd_dkdv", "--d", "64", "--varlen"),
     "here (bwd_sm90) deterministic=True computes dQ in")])
def test_emit_deterministic_refusals(capsys, args, message):
    code, out, err = run_main(capsys, "emit", "--deterministic", *args)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


MODS_FILE = '''
import torch
slopes = torch.rand(16)
doc = torch.zeros(4096, dtype=torch.int32)
def alibi(score, b, h, q_idx, kv_idx):
    return score - slopes[h] * (q_idx - kv_idx).abs()
def document(b, h, q_idx, kv_idx):
    return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
def unsupported(score, b, h, q_idx, kv_idx):
    return torch.sin(score)
def broken(b, h, q_idx, kv_idx):
    return q_idx if q_idx > kv_idx else kv_idx
'''


def test_emit_and_compile_with_mods(capsys, tmp_path, monkeypatch):
    """--score-mod/--mask-mod FILE.py:NAME: the kernel the call runs with those mods, their printed
    functions in it and no user name; compile builds it without spills."""
    pytest.importorskip("torch")
    monkeypatch.setenv("FLASHGEN_HOME", str(tmp_path / "home"))
    path = tmp_path / "my_mods.py"
    path.write_text(MODS_FILE)
    code, out, err = run_main(capsys, "emit", "--d", "128", "--gpu", "h200", "--causal",
                              "--score-mod", f"{path}:alibi", "--mask-mod", f"{path}:document")
    assert code == 0, err
    name = out.splitlines()[1].split()[-1]
    assert "_mod" in name and name.endswith("_full_bf16_sm90a")  # the mods' kernel is never causal itself
    assert "FG_DEVICE float fg_score_mod(" in out and "FG_DEVICE bool fg_mask_mod(" in out
    # (ALiBi under the document mask's q >= kv is a bias linear in kv: fwd_sm90's LINEAR form)
    assert "fg_mod_variant<true, true, false, true, true>" in out and "FG_DEVICE float fg_score_mod_kv(" in out
    assert "slopes" not in out and "document(" not in out
    code, out, err = run_main(capsys, "compile", "--d", "64", "--mask-mod", f"{path}:document", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["spill_stores"] == 0 and "_mod" in report["spec"]
    # --row-bounds: the kernel of a call whose rows each see one run of keys (no mask_mod per score)
    code, out, err = run_main(capsys, "compile", "--d", "64", "--mask-mod", f"{path}:document", "--row-bounds",
                              "--json")
    assert code == 0, err
    bounded = json.loads(out)
    assert bounded["spill_stores"] == 0 and bounded["spec"] == report["spec"].replace("_full_", "_rb_full_")
    # other GPUs (and --kind fwd_v2 on sm_90a): the mma.sync forward with the same functions
    code, out, err = run_main(capsys, "emit", "--d", "128", "--kind", "decode_split", "--score-mod", f"{path}:alibi",
                              "--mask-mod", f"{path}:document")
    assert code == 0, err
    name = out.splitlines()[1].split()[-1]
    assert name.startswith("decode_split_d128_") and "_mod" in name and "decode_mod_variant<true, true>>(p);" in out
    for extra, suffix in ((["--gpu", "a100"], "_full_bf16_sm80"), (["--arch", "sm_90a", "--kind", "fwd_v2"], "_sm90a")):
        code, out, err = run_main(capsys, "emit", "--d", "128", "--score-mod", f"{path}:alibi", *extra)
        assert code == 0, err
        name = out.splitlines()[1].split()[-1]
        assert name.startswith("fwd_v2_") and "_mod" in name and name.endswith(suffix), name
        assert "FG_DEVICE float fg_score_mod(" in out and "fg_mod_variant<true, false>" in out


@pytest.mark.parametrize("args,match", [
    (["--score-mod", "{path}:unsupported"], "torch.sin is not supported"),
    (["--mask-mod", "{path}:broken"], "control flow"),
    (["--score-mod", "{path}:missing"], "no function 'missing'"),
    (["--score-mod", "{dir}/none.py:alibi"], "no file"),
    (["--score-mod", "{path}"], "FILE.py:NAME"),
    (["--score-mod", "{path}:alibi", "--softcap", "5"], "take none of --softcap"),
    (["--score-mod", "{path}:alibi", "--kind", "bwd_dkdv"], "mods run in the forward"),
    (["--score-mod", "{path}:alibi", "--kind", "decode_split", "--window", "64,0"], "take none of --window"),
    (["--score-mod", "{path}:alibi", "--kind", "fwd_sm90", "--arch", "sm_80"], "fwd_sm90 on sm_90a"),
    (["--score-mod", "{path}:alibi", "--row-bounds"], "--row-bounds is for a forward with --mask-mod"),
    (["--row-bounds"], "--row-bounds is for a forward with --mask-mod"),
    (["--mask-mod", "{path}:document", "--kind", "decode_split", "--row-bounds"], "--row-bounds is for a forward"),
])
def test_mod_options_refused_in_one_line(capsys, tmp_path, args, match):
    pytest.importorskip("torch")
    path = tmp_path / "my_mods.py"
    path.write_text(MODS_FILE)
    argv = [a.format(path=path, dir=tmp_path) for a in args]
    code, out, err = run_main(capsys, "emit", "--d", "128", *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and match in err, err
