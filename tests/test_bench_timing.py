"""bench/timing.py's ``sampled``: the clock and power readings beside a timed window
(NVML through torch.cuda on the H200; here faked, and absent)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from nova.cli.bench import load_benchmark

load_benchmark("gpt2")  # puts the repository on sys.path, as `nova bench` does
import bench.timing as timing  # noqa: E402
from bench.timing import median_or_none, reason_shares, sampled  # noqa: E402


def test_the_window_runs_once_with_samples_taken_while_it_runs(monkeypatch):
    reads = []
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda: reads.append(time.perf_counter()) or 1755)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda: 612_000)  # mW
    ran = []

    def window():
        ran.append(time.perf_counter())
        time.sleep(0.05)
        ran.append(time.perf_counter())

    clocks, power = sampled(window, period_s=0.005)
    assert len(ran) == 2
    assert len(clocks) >= 3 and set(clocks) == {1755} and set(power) == {612.0}
    assert all(t <= ran[1] + 0.05 for t in reads)  # the thread stops with the window
    assert median_or_none(clocks) == 1755 and median_or_none([]) is None


def test_without_nvml_nothing_is_sampled_and_the_window_still_runs(monkeypatch):
    def no_nvml():
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "clock_rate", no_nvml)
    ran = []
    assert sampled(lambda: ran.append(1)) == ([], [])
    assert ran == [1]


def test_an_error_in_the_window_stops_the_sampler_and_propagates(monkeypatch):
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda: 1000)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda: 1000)

    def fails():
        raise RuntimeError("boom")

    before = threading.active_count()
    with pytest.raises(RuntimeError, match="boom"):
        sampled(fails)
    assert threading.active_count() == before  # the sampler thread has ended


def test_clock_event_reasons_are_sampled_into_the_list_given_and_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda: 1665)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda: 570_000)
    masks = iter([0x4, 0x4 | 0x80, 0x0] * 100)
    monkeypatch.setattr(timing, "_reasons_reader", lambda: lambda: next(masks))
    got: list[int] = []
    clocks, _ = sampled(lambda: time.sleep(0.03), period_s=0.005, reasons=got)
    assert len(got) == len(clocks) >= 3 and set(got) <= {0x4, 0x84, 0x0}
    shares = reason_shares([0x4, 0x84, 0x0, 0x4 | 0x1000])
    assert shares == {"sw_power_cap": 0.75, "hw_power_brake": 0.25, "0x1000": 0.25}
    assert reason_shares([]) == {}


def test_without_pynvml_no_reasons_are_read(monkeypatch):
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda: 1000)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda: 1000)
    monkeypatch.setattr(timing, "_reasons_reader", lambda: None)
    got: list[int] = []
    clocks, _ = sampled(lambda: time.sleep(0.02), reasons=got)
    assert clocks and got == []


def test_the_energy_over_the_window_is_the_counter_difference(monkeypatch):
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda: 1000)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda: 1000)
    counter = iter([5_000_000, 5_041_500])  # mJ: before and after the window
    monkeypatch.setattr(timing, "_energy_reader", lambda: lambda: next(counter))
    energy: dict = {}
    sampled(lambda: time.sleep(0.01), energy=energy)
    assert energy == {"joules": 41.5}
    monkeypatch.setattr(timing, "_energy_reader", lambda: None)
    sampled(lambda: None, energy=energy)
    assert energy == {"joules": None}
