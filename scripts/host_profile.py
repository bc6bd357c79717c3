"""Where the host time of one compiled step call goes (CPU wall time, the batch
already on the device, the device idle before each call): GPT-2 124M bf16 on the
GPU, ``python scripts/host_profile.py [--batch 8] [--calls 20]``; prints the
median call time and a cProfile of the calls."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import nova
from nova.models import GPT, GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True)
    opts = ap.parse_args()
    _calibrate()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = nova.compile(model, opt, precision="bf16", cuda_graph=opts.graph)
    x = torch.randint(0, 50304, (opts.batch, 1024), device="cuda")
    y = torch.randint(0, 50304, (opts.batch, 1024), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        step(x, y)
    torch.cuda.synchronize()
    peak, predicted = torch.cuda.max_memory_allocated() / 2**30, step.memory_plan.peak_bytes / 2**30
    print(f"peak allocated {peak:.3f} GiB, the plan's predicted peak {predicted:.3f} GiB "
          f"({(predicted - peak) / peak:+.1%}; the model and AdamW's state included)")
    walls = []
    prof = cProfile.Profile()
    for _ in range(opts.calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prof.enable()
        step(x, y)
        prof.disable()
        walls.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    print(f"mode {step.mode}; host ms per call (under cProfile): median {statistics.median(walls):.3f}, "
          f"min {min(walls):.3f}")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    # the same calls without cProfile, with wall-clock timers around each phase
    phases = _timed_phases()
    walls = []
    for _ in range(opts.calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(x, y)
        walls.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    print(f"host ms per call (no profiler): median {statistics.median(walls):.3f}, min {min(walls):.3f}")
    for name, times in phases.items():
        if times:
            print(f"  {name:40s} median {statistics.median(times) * 1e6:8.1f} us  ({len(times)} calls)")


def _calibrate() -> None:
    """This host's speed at what a call does (C-level loops over objects, small torch
    calls on CPU tensors), to compare machines: the same lines on another host
    say how much of a difference in call time is the host's own."""
    import timeit

    objs = [torch.zeros(1) for _ in range(600)]
    ptr = torch.Tensor.data_ptr
    a, b = torch.zeros(4), torch.zeros(4)
    for what, fn, n in (("list(map(id, 600 tensors))", lambda: list(map(id, objs)), 2000),
                        ("list(map(data_ptr, 600 tensors))", lambda: list(map(ptr, objs)), 2000),
                        ("sum(range(10000))", lambda: sum(range(10000)), 2000),
                        ("cpu copy_ of 4 floats", lambda: b.copy_(a), 20000)):  # fmt: skip
        us = min(timeit.repeat(fn, number=n, repeat=3)) / n * 1e6
        print(f"calibration: {what:34s} {us:8.2f} us")


def _timed_phases() -> dict[str, list[float]]:
    """Wraps each phase of a call with a wall-clock timer (microseconds are
    what matters here: the wrappers add ~0.3 us each)."""
    from nova import api
    from nova.runtime import executable

    phases: dict[str, list[float]] = {}
    from nova.runtime.steady import Steady

    # the fast path (a call whose steady state holds: _replay) and the full one (_call)
    targets = [(api.CompiledStep, n) for n in ("_poll", "_replay", "_call", "_check_batch", "_program", "_bound_args",
                                                "_prepare_write_back", "_guard_row", "_queue")]  # fmt: skip
    targets += [(Steady, "holds"), (Steady, "hyper"), (api.CompiledStep, "_spec_key")]
    targets += [(executable.Executable, n) for n in ("launch", "bind", "_write_scalars")]
    targets += [(torch.cuda.CUDAGraph, "replay"), (torch.Tensor, "copy_"), (torch.Tensor, "clone"),
                (torch.cuda.Event, "record"), (torch.cuda.Event, "query"), (torch, "_foreach_copy_")]  # fmt: skip
    for cls, name in targets:
        fn = getattr(cls, name)
        times = phases.setdefault(f"{cls.__name__}.{name}", [])

        def wrapped(*a, _fn=fn, _times=times, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                _times.append(time.perf_counter() - t0)

        setattr(cls, name, wrapped)
    return phases


if __name__ == "__main__":
    main()
