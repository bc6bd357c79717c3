"""Device time of a launch, shared by ``nova bench matmul`` (bench/matmul.py's GpuTimer)
and the experiment scripts (scripts/attention_variants.py, scripts/lm_head_parts.py): ``fn`` captured ``launches`` times into one CUDA graph,
replayed ``repeats`` times between CUDA events after one warm-up replay; the median
replay over ``launches`` is the time of one launch without the host's launch cost.
``time_events`` is the median of single launches between CUDA events (the host's launch
cost included where the device waits for it); ``sampled`` runs a timed window while a
thread reads the GPU's SM clock and power; ``write_rows`` writes an experiment script's rows
with the device, the versions and the commit."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path

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


# NVML's clock event reasons (nvmlClocksEventReasons, the bits of
# nvmlDeviceGetCurrentClocksEventReasons): why the SM clock is below its maximum
CLOCK_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                 0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
                 0x100: "display_clocks"}


def _nvml(name: str, *fallbacks: str):
    """pynvml's ``name`` (or the first of ``fallbacks`` this pynvml has) bound to the current
    device's handle and called once to check it works, or None where pynvml is not
    installed, has no device or no such query."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        get = next(getattr(pynvml, n) for n in (name, *fallbacks) if hasattr(pynvml, n))
        get(handle)
        return lambda: get(handle)
    except Exception:  # noqa: BLE001  (no NVML, no GPU: nothing to read)
        return None


def _reasons_reader():
    """A function giving the current device's clock event reasons (a bit mask), or None."""
    return _nvml("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")


def _energy_reader():
    """A function giving the current device's energy counter (mJ since the driver loaded), or None."""
    return _nvml("nvmlDeviceGetTotalEnergyConsumption")


def reason_shares(masks: list[int]) -> dict[str, float]:
    """The share of the samples each clock event reason was active in (``CLOCK_REASONS``;
    bits it does not name as ``0x..``), reasons never seen left out."""
    shares: dict[str, float] = {}
    for bit in sorted({1 << i for m in masks for i in range(64) if m >> i & 1}):
        name = CLOCK_REASONS.get(bit, hex(bit))
        shares[name] = sum(1 for m in masks if m & bit) / len(masks)
    return shares


def sampled(fn, period_s: float = 0.005, reasons: list | None = None,
            energy: dict | None = None) -> tuple[list[int], list[float]]:
    """Runs ``fn`` (a timed window: launches, then a synchronize) while a thread
    samples the current device's SM clock (MHz) and power draw (W) every
    ``period_s`` through NVML (``torch.cuda.clock_rate`` / ``power_draw``), and, into
    ``reasons`` when given, the clock event reasons (``CLOCK_REASONS``' bit masks:
    why the clock is below its maximum), and into ``energy`` when given its ``"joules"``:
    the device's energy counter over the window (None where it cannot be read). Returns
    the samples; empty lists where NVML is not installed or there is no GPU. A step's
    time set beside its clock says whether two runs ran at one speed, the reasons why
    they did not, and under a power cap the energy a step takes is what sets the clock."""
    clocks: list[int] = []
    power: list[float] = []
    done = threading.Event()
    read_reasons = _reasons_reader() if reasons is not None else None

    def poll():
        while not done.is_set():
            try:
                clocks.append(torch.cuda.clock_rate())
                power.append(torch.cuda.power_draw() / 1e3)
                if read_reasons is not None:
                    reasons.append(read_reasons())
            except Exception:  # noqa: BLE001  (no NVML, no GPU: nothing sampled)
                return
            time.sleep(period_s)

    read_energy = _energy_reader() if energy is not None else None
    start = read_energy() if read_energy is not None else None
    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    if energy is not None:
        energy["joules"] = (read_energy() - start) / 1e3 if start is not None else None
    return clocks, power


def median_or_none(xs: list) -> float | None:
    return statistics.median(xs) if xs else None


def write_rows(out_dir, name: str, rows: list) -> Path:
    """``out_dir``/``name``_<commit>.json: ``rows`` with the device, torch's and Triton's
    versions and the commit (``NOVA_COMMIT``: the device machine has no git)."""
    import triton

    commit = os.environ.get("NOVA_COMMIT", "unknown")[:7]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit, "rows": rows}
    path = Path(out_dir) / f"{name}_{commit}.json"
    path.write_text(json.dumps(meta, indent=1))
    print("wrote", path)
    return path
