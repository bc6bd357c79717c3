"""Device time of a launch, shared by ``nova bench matmul`` (bench/matmul.py's GpuTimer)
and the experiment scripts (scripts/attention_variants.py, scripts/lm_head_parts.py): ``fn`` captured ``launches`` times into one CUDA graph,
replayed ``repeats`` times between CUDA events after one warm-up replay; the median
replay over ``launches`` is the time of one launch without the host's launch cost.
``time_events`` is the median of single launches between CUDA events (the host's launch
cost included where the device waits for it); ``sampled`` runs a timed window while a
thread reads the GPU's SM clock and power."""

from __future__ import annotations

import statistics
import threading
import time

import torch


def time_graph(fn, launches: int, repeats: int, stream=None) -> float:
    """ms per launch of ``fn`` (already run once, so that it is compiled); the graph is
    captured on ``stream`` (default: a side stream of torch's choosing)."""
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for _ in range(launches):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        ts.append((s, e))
    torch.cuda.synchronize()
    del g
    return statistics.median(s.elapsed_time(e) for s, e in ts) / launches


def time_events(fn, reps: int, warmup: int = 3) -> float:
    """Median ms of ``fn`` launched ``reps`` times, each between two CUDA events, after
    ``warmup`` untimed calls (the first compiles)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def sampled(fn, period_s: float = 0.005) -> tuple[list[int], list[float]]:
    """Runs ``fn`` (a timed window: launches, then a synchronize) while a thread
    samples the current device's SM clock (MHz) and power draw (W) every
    ``period_s`` through NVML (``torch.cuda.clock_rate`` / ``power_draw``). Returns
    the samples; empty lists where NVML is not installed or there is no GPU. A
    step's time set beside its clock says whether two runs ran at one speed."""
    clocks: list[int] = []
    power: list[float] = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            try:
                clocks.append(torch.cuda.clock_rate())
                power.append(torch.cuda.power_draw() / 1e3)
            except Exception:  # noqa: BLE001  (no NVML, no GPU: nothing sampled)
                return
            time.sleep(period_s)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return clocks, power


def median_or_none(xs: list) -> float | None:
    return statistics.median(xs) if xs else None
