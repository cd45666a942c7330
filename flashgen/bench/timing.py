"""Timing and run metadata shared by the suites.

- ``time_ms``: median of CUDA-event-timed calls (one measurement; ``ahead``: the calls queued behind a sleep
  kernel, so that their events time the GPU's work where the host's launch is the longer);
- ``graph_us``: µs per call of back-to-back calls replayed from a CUDA graph (the GPU's time for calls
  shorter than their host work, which ``time_ms``'s per-call events would count);
- ``rounds_order`` / ``interleaved`` / ``summary``: interleaved rounds -- every implementation of a cell
  timed once per round, the order reversed every other round, so a clock or thermal drift during the
  run touches all of them alike and shows as spread, not as a difference between them; a cell's value
  is the median over its rounds;
- ``host_us``: per-call host time (bursts of launches without a sync);
- ``prebuild``: compile the kernels a run needs in parallel before any timing;
- ``meta``: commit, GPU, versions.

``rounds_order`` and ``summary`` are pure (no torch); the rest imports torch when called.
"""
from __future__ import annotations

import datetime
import itertools
import platform
import statistics
import subprocess
import time
from multiprocessing.pool import ThreadPool
from pathlib import Path

from .. import settings
from ..codegen import build
from ..codegen.compiler import nvrtc_version
from ..errors import FlashgenError
from ..version import __version__
from .report import save


# ``time_ms(ahead=True)``: the sleep kernel's length, a multiple of the host time of the calls queued behind it,
# at most AHEAD_MAX_S, in clock cycles at AHEAD_HZ (above the SM clocks of the GPUs here: a slower clock only
# sleeps longer).
AHEAD_MARGIN, AHEAD_MAX_S, AHEAD_HZ = 2.0, 0.05, 2.0e9


def time_ms(fn, budget_s: float = 0.3, min_reps: int = 3, max_reps: int = 30, warmup: int = 2,
            ahead: bool = False) -> dict:
    """Median milliseconds of ``fn()`` by CUDA events after ``warmup`` calls.

    The repeat count adapts to the call's length: as many as fit in ``budget_s``
    (at least ``min_reps``, at most ``max_reps``), so slow implementations cost
    a few calls instead of thirty. Returns {"ms", "reps"}.

    ``ahead``: a sleep kernel holds the stream while the timed calls are queued behind it (``AHEAD_MARGIN``
    times their host time, measured on the probe call), so each call's events time its GPU work, as a CUDA
    graph's replay would run it, where its host work is the longer (a decode step, a short prefill: per-call
    events there time the host, which is the same for every tile and hides the kernels' differences). A
    ``fn`` that synchronises inside gets host-paced times, as without ``ahead``.
    """
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    first = max(start.elapsed_time(end), 1e-3)
    reps = int(min(max_reps, max(min_reps, budget_s * 1e3 / first)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    if ahead:
        torch.cuda._sleep(int(min(AHEAD_MAX_S, AHEAD_MARGIN * reps * host_s) * AHEAD_HZ))
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return {"ms": statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), "reps": reps}


def graph_us(fn, calls: int = 32, replays: int = 5) -> float:
    """Median µs per call of ``fn(i)`` for i = 0 .. calls - 1, captured once into a CUDA graph and replayed
    ``replays`` times (each replay timed by events, after one untimed): the calls run back to back on the
    GPU, with no host time between them. ``fn`` must be capturable (no host sync)."""
    import torch

    for i in range(min(calls, 3)):  # plans and kernels loaded outside the capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def rounds_order(impls, rounds: int) -> list[list]:
    """The order interleaved rounds time ``impls`` in: as given on even rounds, reversed on odd ones
    (none is always first or always last, where a warm clock or a cold L2 would favour it)."""
    names = list(impls)
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    return [list(names) if r % 2 == 0 else names[::-1] for r in range(rounds)]


class Skipped(Exception):
    """Raised by an implementation's maker when it does not apply to a cell (recorded as "skipped")."""


def error_text(exc: BaseException, limit: int = 240) -> str:
    """One line naming an exception (recorded in a cell instead of its time)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:limit]}"


def interleaved(fns: dict, rounds: int, measure) -> dict:
    """{name: [measure(fns[name]) per round] | error text}: ``rounds_order``'s rounds; an implementation
    that raises keeps its error and is not timed again (the others go on)."""
    times = {name: [] for name in fns}
    for order in rounds_order(fns, rounds):
        for name in order:
            if isinstance(times[name], str):
                continue
            try:
                times[name].append(measure(fns[name]))
            except Exception as exc:  # noqa: BLE001 -- a refusal or OOM is data, not a crash
                times[name] = error_text(exc)
                _recover()
    return times


def _recover() -> None:
    """After a failed call: wait for the device and give back the allocator's cache (an OOM leaves
    blocks behind); nothing to do without CUDA."""
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 -- a sticky CUDA error: the next call reports it
        pass


def summary(values, unit: str = "ms") -> dict:
    """Median, every round and the spread ((max - min) / median, %) of one implementation's rounds."""
    values = list(values)
    med = statistics.median(values)
    return {unit: med, f"rounds_{unit}": values,
            "spread_pct": (max(values) - min(values)) / med * 100 if med else 0.0}


def time_cell(makers: dict, rounds: int, measure, unit: str = "ms") -> dict:
    """{name: cell} of one cell: each maker of ``makers`` ({name: () -> callable}) is called, then its
    callable once (the plan, the compile and the load happen here, so a refusal is that cell's error
    rather than a round's), then every callable that got so far is timed in interleaved rounds by
    ``measure(callable) -> value``. A cell is ``summary``'s dict, {"error": text} or {"skipped": why}
    (a maker raising ``Skipped``), in the order of ``makers``."""
    cells, fns = {}, {}
    for name, make in makers.items():
        try:
            fn = make()
            fn()
            _sync()
            fns[name] = fn
        except Skipped as why:
            cells[name] = {"skipped": str(why)}
        except Exception as exc:  # noqa: BLE001 -- recorded per cell
            cells[name] = {"error": error_text(exc)}
            _recover()
    for name, values in interleaved(fns, rounds, measure).items():
        cells[name] = {"error": values} if isinstance(values, str) else summary(values, unit)
    return {name: cells[name] for name in makers}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_us(fn, calls: int = 3) -> dict:
    """Device time per call of each CUDA kernel ``fn`` runs (torch.profiler over ``calls`` calls after one
    warm-up), microseconds by kernel name, largest first: where a call's time goes, beside its timing."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if t > 0 and e.key not in out:
            out[e.key] = round(t / calls, 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def add_ratios(row: dict, metric: str, pairs) -> None:
    """``row["ratios"][label] = metric(num) / metric(den)`` for each (label, num, den) of ``pairs`` whose
    two cells both have the metric (a higher-is-better metric: TFLOP/s, TB/s, so above 1 means ``num``
    is faster)."""
    results = row["results"]
    for label, num, den in pairs:
        a, b = results.get(num, {}).get(metric), results.get(den, {}).get(metric)
        if a and b:
            row.setdefault("ratios", {})[label] = a / b


def rotating(fn, copies: int):
    """A no-argument callable running ``fn(i)`` with i = 0, 1, ... ``copies`` - 1, 0, ... (input copies in
    turn, so that L2 does not serve a small case's inputs from the previous call)."""
    calls = itertools.count()
    return lambda: fn(next(calls) % copies)


def host_us(fn, calls: int = 100, rounds: int = 20) -> float:
    """Per-call host time of ``fn`` in µs: bursts of ``calls`` launches without synchronizing
    (well under the launch queue's depth, so the host is what is measured), best of ``rounds``."""
    import torch

    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
    torch.cuda.synchronize()
    return best / calls * 1e6


def host_row(entry: str, call: str, fn, calls: int, rounds: int, warmup: int, **fields) -> dict:
    """A row of a host-time table: ``warmup`` untimed calls of ``fn``, then ``host_us``; the error text
    instead when a call raises."""
    try:
        for _ in range(max(1, warmup)):
            fn()
        cell = {"us": host_us(fn, calls, rounds)}
    except Exception as exc:  # noqa: BLE001 -- recorded, the run goes on
        cell = {"error": error_text(exc)}
    return {"entry": entry, "call": call, **fields, "results": {"host": cell}}


def require_cuda(suite: str) -> None:
    """FlashgenError (one line, exit 2) when there is no CUDA device: after the options were checked."""
    import torch

    if not torch.cuda.is_available():
        raise FlashgenError(f"flashgen bench {suite} needs a CUDA device (plots of a stored result do not: "
                            "--plot-from FILE)")


def prebuild(specs, progress, threads: int = 8) -> dict:
    """Compile ``specs`` in parallel (NVRTC releases the GIL; the disk cache makes a second run free)
    so no timed cell waits for a compile. Returns {spec name: error text} of those that failed: the
    cell that uses one records the same error when it loads it."""
    def one(spec):
        try:
            build(spec)
            return None
        except Exception as exc:  # noqa: BLE001
            return spec.name, error_text(exc)

    specs = sorted({s for s in specs if s is not None}, key=lambda s: s.name)
    if not specs:
        return {}
    t0 = time.time()
    with ThreadPool(max(1, min(threads, len(specs)))) as pool:
        failed = dict(x for x in pool.map(one, specs) if x)
    progress(f"compiled {len(specs)} kernels in {time.time() - t0:.1f} s" +
             (f" ({len(failed)} failed)" if failed else ""))
    return failed


def free() -> None:
    """Release what the last cell allocated (its inputs are gone) before the next one's."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def write_json(path, result) -> None:
    """Write a benchmark's result as indented JSON, making the folder first (no-op without a path)."""
    if path:
        save(result, path)


def commit() -> str:
    """The flashgen commit: ``FLASHGEN_COMMIT`` (``flashgen.settings``: a device copy has no .git),
    else git, else 'unknown'."""
    value = settings.commit()
    if value:
        return value
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL,
                                       cwd=Path(__file__).resolve().parent).strip()
    except Exception:  # noqa: BLE001 -- any failure: no commit to report
        return "unknown"


def meta() -> dict:
    """Date, commit, versions and (with a CUDA device) the GPU, its arch, SMs and L2."""
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit(), "flashgen": __version__, "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            from ..api.device import Device

            dev = Device.of(torch.cuda.current_device())
            info.update(gpu=torch.cuda.get_device_name(), arch=dev.arch, profile=dev.gpu, sms=dev.sms,
                        l2_bytes=dev.l2_bytes, smem_per_block=dev.smem_budget)
    except Exception:  # noqa: BLE001 -- metadata only
        pass
    try:
        import cupy

        info.update(cupy=cupy.__version__, nvrtc=list(nvrtc_version()))
    except Exception:  # noqa: BLE001 -- metadata only
        pass
    return info
