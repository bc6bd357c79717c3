"""nova.runtime.collector: the garbage collector paused over a compile's
allocation-heavy parts (capture, the step cache's decode), and restored."""

from __future__ import annotations

import gc

import pytest
import torch

from nova.capture.importer import capture
from nova.errors import CaptureError
from nova.runtime.collector import paused


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_paused_turns_the_collector_off_and_back_on(collector_on):
    with paused():
        assert not gc.isenabled()
        with paused():  # nested: still off after the inner one
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), paused():
        raise ValueError("inside")
    assert gc.isenabled()


def test_paused_leaves_a_disabled_collector_disabled(collector_on):
    gc.disable()
    with paused():
        pass
    assert not gc.isenabled()


class _Loss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        assert not gc.isenabled()  # traced with the collector paused
        return (self.w * x).sum()


class _Broken(torch.nn.Module):
    def forward(self, x):
        raise RuntimeError("no forward")


def test_capture_runs_with_the_collector_paused_and_restores_it(collector_on):
    cap = capture(_Loss(), (torch.ones(3),))
    assert "w" in cap.params and gc.isenabled()
    with pytest.raises(CaptureError):
        capture(_Broken(), (torch.ones(3),))
    assert gc.isenabled()
