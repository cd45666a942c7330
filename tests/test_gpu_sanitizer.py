"""GPU tier: compute-sanitizer's four tools report nothing on the default kernel paths (tests/sanitize.py).

The tool runs are skipped without CUDA or without compute-sanitizer; the report parser's test is not. Runs the case matrix once per tool (several
minutes: racecheck instruments every shared-memory access).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from sanitize import TOOLS, find_sanitizer, parse_report  # noqa: E402


def test_parse_report_counts_errors_and_hazards():
    text = ("========= Invalid __shared__ read of size 16 bytes\n=========     in decode_split_d128_m16(...)\n"
            "========= RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)\n"
            "========= ERROR SUMMARY: 2 errors\n")
    rep = parse_report("racecheck", text)
    assert (rep["errors"], rep["hazards"], rep["summary_seen"]) == (4, 3, True)  # racecheck's 2 + the summary's 2
    assert rep["kernels"] == ["decode_split_d128_m16"]


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
@pytest.mark.skipif(find_sanitizer() is None, reason="compute-sanitizer not found")
@pytest.mark.parametrize("tool", TOOLS)
def test_sanitizer_reports_nothing(tool, tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(HERE / "sanitize.py"), "check", "--tools", tool, "--json", str(out)],
                          capture_output=True, text=True, timeout=1800, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    rep = json.loads(out.read_text())["tools"][tool]
    assert rep["errors"] == 0 and rep["hazards"] == 0 and rep["summary_seen"] and not rep["failed_cases"]
