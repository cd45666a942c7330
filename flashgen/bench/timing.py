"""Timing and run metadata shared by the suites (needs torch and a CUDA device)."""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess


def time_ms(fn, budget_s: float = 0.3, min_reps: int = 3, max_reps: int = 30, warmup: int = 2) -> dict:
    """Median milliseconds of ``fn()`` by CUDA events after ``warmup`` calls.

    The repeat count adapts to the call's length: as many as fit in ``budget_s``
    (at least ``min_reps``, at most ``max_reps``), so slow implementations cost
    a few calls instead of thirty. Returns {"ms", "reps"}.
    """
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    first = max(start.elapsed_time(end), 1e-3)
    reps = int(min(max_reps, max(min_reps, budget_s * 1e3 / first)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return {"ms": statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), "reps": reps}


def host_us(fn, calls: int = 100, rounds: int = 20) -> float:
    """Per-call host time of ``fn`` in µs: bursts of ``calls`` launches without synchronizing
    (well under the launch queue's depth, so the host is what is measured), best of ``rounds``."""
    import time

    import torch

    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / calls * 1e6


def write_json(path, result) -> None:
    """Write a benchmark's result as indented JSON, making the folder first (no-op without a path)."""
    if not path:
        return
    import json

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)


def commit() -> str:
    """The flashgen commit: ``FLASHGEN_COMMIT`` (the device copy has no .git), else git, else 'unknown'."""
    value = os.environ.get("FLASHGEN_COMMIT")
    if value:
        return value
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL,
                                       cwd=os.path.dirname(__file__)).strip()
    except Exception:  # noqa: BLE001 -- any failure: no commit to report
        return "unknown"


def meta() -> dict:
    import torch

    import flashgen

    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit(), "flashgen": flashgen.__version__, "torch": torch.__version__,
            "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import cupy

        from ..codegen.compiler import nvrtc_version

        info.update(cupy=cupy.__version__, nvrtc=list(nvrtc_version()))
    except Exception:  # noqa: BLE001 -- metadata only
        pass
    return info
