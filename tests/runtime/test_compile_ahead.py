"""nova.runtime.compile_ahead on the CPU: the pool's size from NOVA_COMPILE_THREADS.
The walk itself: tests/runtime/test_executable.py (every launch run for real in the
interpreter) and tests/gpu/test_executable_gpu.py (kernels compiled on threads)."""

from __future__ import annotations

import os

import pytest

from nova.runtime.compile_ahead import threads


def test_threads_default_to_the_cpus_at_most_16(monkeypatch):
    monkeypatch.delenv("NOVA_COMPILE_THREADS", raising=False)
    assert threads() == max(1, min(16, len(os.sched_getaffinity(0))))


def test_threads_follow_the_variable_and_refuse_what_is_not_a_positive_integer(monkeypatch):
    monkeypatch.setenv("NOVA_COMPILE_THREADS", "3")
    assert threads() == 3
    for bad in ("0", "-2", "four", ""):
        monkeypatch.setenv("NOVA_COMPILE_THREADS", bad)
        with pytest.raises(ValueError, match="NOVA_COMPILE_THREADS must be a positive integer"):
            threads()
