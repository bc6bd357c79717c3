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


class _Node:
    pass


def test_what_is_made_inside_moves_to_the_old_generation_and_its_garbage_is_still_collected(collector_on):
    import weakref

    with paused():
        kept = _Node()
        a, b = _Node(), _Node()
        a.b, b.a = b, a  # a cycle: garbage once the names are gone
        gone = weakref.ref(a)
        del a, b
    assert any(o is kept for o in gc.get_objects(generation=2))
    assert not any(o is kept for o in gc.get_objects(generation=0))
    assert gone() is not None  # not walked by a young collection: it waits for a full one
    gc.collect()
    assert gone() is None and gc.get_freeze_count() == 0


def test_objects_the_process_froze_stay_frozen(collector_on):
    frozen = _Node()
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        with paused():
            made = _Node()
        # nothing of ours frozen (the count never grows); it may fall: frozen objects another
        # thread lets go of while we wait leave the permanent generation (a CI run saw 2)
        assert gc.get_freeze_count() <= count
        listed = gc.get_objects()  # the generations, not the frozen objects: nothing unfrozen
        assert not any(o is frozen for o in listed) and any(o is made for o in listed)
    finally:
        gc.unfreeze()


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
