"""Where a GPT-2 step's wall time goes between kernels: ``python scripts/graph_gaps.py
[--batch 32] [--steps 3] [--out DIR]``. Runs Nova's step (CUDA graph replay, the
default) and torch.compile's under torch.profiler (CUDA activity: CUPTI traces the
kernels inside a graph), orders every kernel by its start, and reports per step the
kernels' busy time (the union of their intervals), the idle time between them and
the largest gaps with the kernels on either side. Nova runs twice, as its graph and as
its launch list (``cuda_graph=False``), and the kernels whose time differs most between
the two are listed (the kernel sums of scripts/kernel_profile.py are the list's; the
bench times the graph). The SM clock and the power are sampled while the timed steps
run. Writes graph_gaps_b<batch>.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kernel_profile import model_config, step_runner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import median_or_none, reason_shares, sampled, time_events  # noqa: E402


def _by_name(ev, steps: int) -> dict[str, float]:
    """Kernel time per step (ms) by kernel name."""
    out: dict[str, float] = {}
    for s, e, name in ev:
        out[name] = out.get(name, 0.0) + (e - s) / 1e3 / steps
    return out


def _timeline(run, steps: int) -> list[tuple[float, float, str]]:
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    ev = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
          if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(ev)


def _gaps(ev, steps: int, top: int) -> dict:
    span = ev[-1][1] - ev[0][0]
    busy, gaps, end = 0.0, [], ev[0][0]
    prev = "(start)"
    for s, e, name in ev:
        if s > end:
            gaps.append((s - end, prev, name))
        busy += max(0.0, e - max(s, end))
        if e > end:
            end, prev = e, name
    gaps.sort(reverse=True)
    small = sum(g for g, _, _ in gaps if g < 5)
    return {"span_ms_per_step": span / 1e3 / steps, "busy_ms_per_step": busy / 1e3 / steps,
            "idle_ms_per_step": sum(g for g, _, _ in gaps) / 1e3 / steps,
            "idle_in_gaps_under_5us_ms_per_step": small / 1e3 / steps, "gaps": len(gaps) / steps,
            "largest_gaps_us": [(round(g, 2), a[:90], b[:90]) for g, a, b in gaps[:top]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3, help="steps profiled")
    ap.add_argument("--timed", type=int, default=20, help="steps timed by events (and the clock sampled)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path, default=Path("."))
    opts = ap.parse_args()
    torch.manual_seed(0)
    cfg = model_config("124m")
    x = torch.randint(0, 50304, (opts.batch, 1024), device="cuda")
    y = torch.randint(0, 50304, (opts.batch, 1024), device="cuda")
    doc = {"batch": opts.batch, "device": torch.cuda.get_device_name(), "engines": {}}
    names = {}
    for engine, graph in (("nova", True), ("nova launch list", False), ("torch.compile", True)):
        model, opt, run = step_runner(engine.split()[0], cfg, "bf16", x, y, cuda_graph=graph)
        for _ in range(3):
            run()
        timed = []  # the median step between events, the clock sampled meanwhile
        masks: list[int] = []
        energy: dict = {}
        clocks, power = sampled(lambda: timed.append(time_events(run, opts.timed, warmup=0)), reasons=masks,
                                energy=energy)
        ev = _timeline(run, opts.steps)
        g = _gaps(ev, opts.steps, opts.top)
        g["event_ms_median"] = timed[0]
        g["sm_clock_mhz_median"], g["power_w_median"] = median_or_none(clocks), median_or_none(power)
        g["clock_event_reasons"] = reason_shares(masks)
        # (the window is the timed steps: time_events' own warm-up is 0)
        g["joules_per_step"] = energy["joules"] / opts.timed if energy.get("joules") is not None else None
        names[engine] = _by_name(ev, opts.steps)
        doc["engines"][engine] = g
        print(f"== {engine}: events {g['event_ms_median']:.2f} ms/step (SM clock {g['sm_clock_mhz_median']} MHz, "
              f"power {g['power_w_median']} W, medians over the timed window; {g['joules_per_step']} J a step; clock "
              f"held by {g['clock_event_reasons']}); profiled span {g['span_ms_per_step']:.2f}, "
              f"busy {g['busy_ms_per_step']:.2f}, idle {g['idle_ms_per_step']:.2f} ms/step in {g['gaps']:.0f} gaps "
              f"({g['idle_in_gaps_under_5us_ms_per_step']:.2f} ms in gaps under 5 us)")
        for gap, a, b in g["largest_gaps_us"]:
            print(f"  {gap:9.2f} us  {a}  ->  {b}")
        del model, opt, run
        torch.cuda.empty_cache()
    g, li = names["nova"], names["nova launch list"]
    diff = sorted(((g.get(k, 0.0) - li.get(k, 0.0), k) for k in set(g) | set(li)), key=lambda d: -abs(d[0]))
    doc["nova_graph_minus_list_ms"] = {k: round(d, 4) for d, k in diff[:opts.top]}
    print(f"== nova, graph minus launch list: kernels {sum(g.values()) - sum(li.values()):+.3f} ms/step")
    for d, k in diff[:15]:
        print(f"  {d:+8.3f} ms  graph {g.get(k, 0.0):8.3f}  list {li.get(k, 0.0):8.3f}  {k[:90]}")
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / f"graph_gaps_b{opts.batch}.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
