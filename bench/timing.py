"""Device time of a launch, shared by ``nova bench matmul`` (bench/matmul.py's GpuTimer)
and the experiment scripts (scripts/attention_variants.py, scripts/lm_head_parts.py): ``fn`` captured ``launches`` times into one CUDA graph,
replayed ``repeats`` times between CUDA events after one warm-up replay; the median
replay over ``launches`` is the time of one launch without the host's launch cost."""

from __future__ import annotations

import statistics

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
