"""Measured time of every launch of an executable step, beside the cost model's prediction.

``measure(exe, kernels, clock)`` runs the executable's bound launch list
(``Executable.launches``, as the last step call bound it: its batch, its
hyper-parameters and seed) ``repeat`` times with a pair of events around each
launch, and puts every parameter, optimizer-state and guard tensor back as it
was before (they are copied to the host first): measuring changes nothing the
step wrote. The executable's own path (its graph replay, its list) is not touched.

The host must not be what is measured. A Triton launch costs the host 20-40 us,
more than many small kernels take on the device, so events recorded as the host
goes would time the host. ``EventTimer`` therefore enqueues the list in windows
of ``WINDOW`` launches, each behind a device-side wait (``torch.cuda._sleep``)
longer than the host takes to enqueue the window: the device then runs the window
back to back and each pair of events brackets one kernel's device time. The host's
time is not the same for every launch (a fused optimizer update with hundreds of
arguments costs the host far more than a matmul), so the timer checks every window:
where the host took more than ``HOST_SHARE_MAX`` of the window's hold, the device
may have caught up and waited inside some pair of events, and that pass is thrown
away and the whole list timed again, each window's hold now ``HOLD_FACTOR`` times
what the host took for it last time; after ``MAX_PASSES`` passes it is a
``MeasureError``, never a number. (Before 2026-12-05 the hold was twice the previous
window's host time: on an H100 at 4c64f5c the c_fc and c_proj weights' AdamW updates
were timed 1.436 and 1.314 ms, the Adam step counters' 64-scalar update 0.52 ms,
against 0.32, 0.32 and 0.010 ms at 1c57010, with the kernels unchanged in between:
the host's launch time, not the device's.) ``gap_s`` reports the device time
between a launch's end event and the next one's start (near zero when the host
stayed ahead).

The device side is a ``Clock`` (events, a device wait, a synchronize): ``CudaClock``
on CUDA; tests inject a clock of their own, so this code runs in CI without a GPU.
Without CUDA and without an injected clock there is nothing to measure with, and
``measure`` says so (``MeasureError``), never a number.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from nova.errors import NovaError
from nova.schedule.configurator import LAUNCH_SECONDS
from nova.schedule.cost import KernelCost
from nova.transforms.plan_memory import UPDATED_ROLES

WINDOW = 128  # launches per window: 2 events each, well inside CUDA's queue of pending work per stream
FIRST_HOST_GUESS_S = 100e-6  # host seconds per launch assumed for a window not timed yet (Triton: 20-40 us)
MIN_HOLD_S = 1e-3
HOLD_FACTOR = 2.0  # a window's hold: this many times the host's time for it last pass
# a window is trusted when the host enqueued it within this share of its hold: the device
# wait's length comes from a cycle rate measured once (CudaClock._rate), and the hold is
# enqueued a little before the host's clock starts, so the margin covers both
HOST_SHARE_MAX = 0.8
MAX_PASSES = 4  # passes over the list before the timer gives up (each one learns every window's host time)


class MeasureError(NovaError, RuntimeError):
    """Measuring kernel times needs what this step does not have (the message says what)."""


class Event(Protocol):
    def record(self) -> None: ...


class Clock(Protocol):
    """The device side of the timer. ``asynchronous``: the events run on a device behind
    the host (CUDA), so the host must keep ahead of it; False where the host itself runs
    the calls and records the events as it goes (a test's host clock under Triton's
    interpreter), where there is nothing to keep ahead of."""

    asynchronous: bool

    def event(self) -> Event: ...

    def elapsed_s(self, start: Event, end: Event) -> float: ...

    def hold(self, seconds: float) -> None:
        """Makes the device wait ``seconds`` before the work enqueued after it."""

    def synchronize(self) -> None: ...


class CudaClock:
    """CUDA events on the current stream; the device wait is ``torch.cuda._sleep``,
    whose cycles per second are measured once with two events."""

    asynchronous = True

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._cycles_per_s: float | None = None

    def event(self):
        return torch.cuda.Event(enable_timing=True)

    def elapsed_s(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3

    def _rate(self) -> float:
        if self._cycles_per_s is None:
            cycles = 10_000_000
            a, b = self.event(), self.event()
            a.record()
            torch.cuda._sleep(cycles)
            b.record()
            b.synchronize()
            self._cycles_per_s = cycles / max(self.elapsed_s(a, b), 1e-6)
        return self._cycles_per_s

    def hold(self, seconds: float) -> None:
        torch.cuda._sleep(int(seconds * self._rate()))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class EventTimer:
    """``time(calls)``: each call's device seconds (see the module docstring). ``host_clock``
    is the host's clock in seconds (tests inject one)."""

    def __init__(self, clock: Clock, window: int = WINDOW, host_clock: Callable[[], float] = time.perf_counter):
        self.clock, self.window, self.host_clock = clock, window, host_clock
        self.host_s: dict[int, float] = {}  # window's first call -> the host's seconds to enqueue it, last pass
        self.passes = 0  # passes run, over every ``time`` call

    def time(self, calls: Sequence[Callable[[], None]]) -> tuple[list[float], float]:
        """Each call's device seconds, and the device seconds spent between calls."""
        for _ in range(MAX_PASSES):
            times, gap, behind = self._pass(calls)
            if not behind:
                return times, gap
        w0, host, hold = behind[0]
        raise MeasureError(f"the host could not keep ahead of the device: after {MAX_PASSES} passes the window of "
                           f"launches from {w0} still took the host {host * 1e3:.2f} ms to enqueue against a device "
                           f"wait of {hold * 1e3:.2f} ms; the device would have waited for the host inside the "
                           f"launches' events, so no time is reported")  # fmt: skip

    def _pass(self, calls: Sequence[Callable[[], None]]) -> tuple[list[float], float, list[tuple[int, float, float]]]:
        """One pass over ``calls``; its times, gap, and the windows the host fell behind on."""
        self.passes += 1
        times: list[float] = []
        gap = 0.0
        behind = []
        for w0 in range(0, len(calls), self.window):
            window = calls[w0:w0 + self.window]
            events = [(self.clock.event(), self.clock.event()) for _ in window]
            hold = max(MIN_HOLD_S, HOLD_FACTOR * self.host_s.get(w0, FIRST_HOST_GUESS_S * len(window)))
            self.clock.hold(hold)
            t0 = self.host_clock()
            for (start, end), call in zip(events, window):
                start.record()
                call()
                end.record()
            host = self.host_s[w0] = self.host_clock() - t0
            if self.clock.asynchronous and host > HOST_SHARE_MAX * hold:
                behind.append((w0, host, hold))
            self.clock.synchronize()
            times.extend(self.clock.elapsed_s(s, e) for s, e in events)
            gap += sum(self.clock.elapsed_s(events[i][1], events[i + 1][0]) for i in range(len(events) - 1))
        return times, gap, behind


@dataclass(frozen=True)
class Measured:
    """A profile of one program: its kernels (the cost model's, in launch order) with
    the median measured seconds of each over ``repeat`` runs of the launch list."""

    kernels: list[KernelCost]
    measured_s: list[float]
    gap_s: float  # device time between launches, per run (median)
    repeat: int
    device: str

    @property
    def total_s(self) -> float:
        return sum(self.measured_s)

    def by_index(self) -> dict[int, float]:
        return {k.index: t for k, t in zip(self.kernels, self.measured_s)}


def launch_kernels(exe, kernels: list[KernelCost], bandwidth: float) -> list[KernelCost]:
    """The cost entry of every launch of ``exe.launches``, in order: the step's kernels
    (``kernels``, from ``nova.schedule.cost.kernel_costs`` of the same IR and plan),
    then the copies the executable appends ("copy back"/"copy out": one read and one
    write of the tensor at ``bandwidth`` bytes/s). Checked launch by launch: a list that does not line up with
    the IR is an error, not a table of wrong names."""
    launches = exe.launches
    out = []
    for i, launch in enumerate(launches):
        if i < len(kernels):
            if launch.name != kernels[i].op:
                raise MeasureError(f"launch {i} is {launch.name}, the cost model's kernel {i} is {kernels[i].op}: "
                                   "the launch list and the IR do not line up")  # fmt: skip
            out.append(kernels[i])
            continue
        if not launch.name.startswith("copy "):
            raise MeasureError(f"launch {i} ({launch.name}) has no kernel in the IR ({len(kernels)} kernels)")
        t = launch.ins[0]
        n = 2 * t.numel() * t.element_size()
        out.append(KernelCost(index=i, op=launch.name, kind="copy", shape=f"{list(t.shape)} {t.dtype}", loc=None,
                              config="-", bytes=n, flops=0, path="fp32", launches=1,
                              memory_s=n / bandwidth, compute_s=0.0, launch_s=LAUNCH_SECONDS))  # fmt: skip
    if len(out) < len(kernels):
        raise MeasureError(f"the launch list has {len(launches)} launches for {len(kernels)} kernels")
    return out


def _snapshot(exe) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(bound tensor, host copy) of every argument the step writes."""
    seen, out = set(), []
    for s, t in zip(exe.slots, exe.arguments):
        if s.role in UPDATED_ROLES and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out.append((t, t.detach().to("cpu", copy=True)))
    return out


def measure(exe, kernels: list[KernelCost], bandwidth: float, clock: Clock | None = None,
            repeat: int = 3) -> Measured:  # fmt: skip
    """See the module docstring. ``exe``: a bound ``Executable`` (the step ran at least
    once); ``kernels``: its IR's ``kernel_costs``; ``bandwidth``: the device's bytes/s
    (for the copies the executable adds); ``clock``: None for CUDA events on its device."""
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    if clock is None:
        if exe.device.type != "cuda":
            raise MeasureError(f"measuring kernel times needs CUDA (events on the device); this step runs on "
                               f"{exe.device}, where Triton's interpreter runs the kernels: nothing was measured")
        clock = CudaClock(exe.device)
    if not exe.launches:
        raise MeasureError("the executable has no bound launch list: call the step once first")
    entries = launch_kernels(exe, kernels, bandwidth)
    saved = _snapshot(exe)
    timer = EventTimer(clock)
    runs, gaps = [], []
    try:
        clock.synchronize()
        for _ in range(repeat):
            t, g = timer.time(exe.launches)
            runs.append(t)
            gaps.append(g)
    finally:
        clock.synchronize()
        with torch.no_grad():
            for t, host in saved:
                t.copy_(host)
        clock.synchronize()
    med = [statistics.median(r[i] for r in runs) for i in range(len(entries))]
    return Measured(entries, med, statistics.median(gaps), repeat, str(exe.device))


__all__ = ["measure", "Measured", "EventTimer", "CudaClock", "Clock", "MeasureError", "launch_kernels", "WINDOW",
           "HOLD_FACTOR", "HOST_SHARE_MAX", "MAX_PASSES"]
