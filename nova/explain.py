"""What ``CompiledStep.explain()`` says about a compiled step, readably.

``summary`` is a few dozen ``//`` lines (MLIR comments, so they may head an .mlir
file): the program (model, batch, precision, device, how it runs), the stages with
the ops of ``@train_step`` after each (and the kernels, once configured), the
fusion groups, the kernels' predicted time by roofline bound and kind, the most
expensive kernels (predicted by ``nova.schedule.cost``, and measured beside it
after ``step.profile()``), the memory plan and the remat choices. ``run_stages``
compiles the step again keeping every stage's IR in the short form of
``nova.ir.pretty``; ``write_ir`` puts one file per stage in a directory and
``plot_roofline`` places every kernel on the device's roofline.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from xdsl.dialects.builtin import ModuleOp

from nova import pipeline
from nova.atomic import atomic_write
from nova.ir import dialect as nv
from nova.ir.module import step_func
from nova.ir.pretty import counts, pretty, short_path
from nova.schedule.cost import KernelCost, kernel_steps

STAGE_HEADER = "// ===== after stage: {} ====="
TOP = 10


@dataclass(frozen=True)
class StageStats:
    name: str
    ops: int  # ops of @train_step (a nova.fused group counted once)
    fused_ops: int  # ops inside nova.fused groups
    kernels: int | None  # ops that launch kernels, once configure has run (None before, or without a device)
    seconds: float
    top: list[tuple[str, int]]  # the most frequent ops


def run_stages(c: pipeline.Compilation) -> list[StageStats]:
    """Runs the pipeline on ``c`` keeping each stage's short-form IR in ``c.stages``;
    the op counts of every stage."""
    stats: list[tuple[str, dict, int, int | None]] = []
    configured = [False]

    def dump(name: str, module: ModuleOp) -> str:
        by_name = counts(module)
        fn = step_func(module)
        inner = sum(len(op.inner_ops()) for op in fn.body.block.ops if isinstance(op, nv.FusedOp))
        configured[0] = configured[0] or (name == "configure" and c.device is not None)
        placements = c.memory.placements if name == "plan_memory" and c.memory is not None else None
        kernels = len(kernel_steps(fn, placements)) if configured[0] else None
        stats.append((name, by_name, inner, kernels))
        return pretty(module)

    pipeline.run(c, dump=dump)
    return [StageStats(name, sum(by.values()), inner, k, c.times.get(name, 0.0),
                       sorted(by.items(), key=lambda kv: (-kv[1], kv[0]))[:4])
            for name, by, inner, k in stats]  # fmt: skip


def _us(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def _si(n: float, unit: str) -> str:
    for scale, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {p}{unit}"
    return f"{n:.0f} {unit}"


def stage_lines(stats: list[StageStats]) -> list[str]:
    lines = ["stages (ops in @train_step after each; kernels: the ops that launch one, once configured):"]
    width = max((len(s.name) for s in stats), default=0)
    for s in stats:
        kernels = f"{s.kernels:>6} kernels" if s.kernels is not None else " " * 14
        inner = f" (+{s.fused_ops} inside nova.fused)" if s.fused_ops else ""
        top = ", ".join(f"{n.removeprefix('nova.')} {k}" for n, k in s.top)
        lines.append(f"  {s.name:<{width}} {s.ops:>6} ops {kernels} {s.seconds:7.2f} s   {top}{inner}")
    return lines


def fusion_lines(module: ModuleOp, top: int = 3) -> list[str]:
    groups = [op for op in step_func(module).body.block.ops if isinstance(op, nv.FusedOp)]
    if not groups:
        return ["fusion groups: none (no nova.fused op in the final IR)"]
    kinds = Counter(op.props()["kind"] for op in groups)
    inside = sum(len(op.inner_ops()) for op in groups)
    lines = [f"fusion groups: {len(groups)} nova.fused ops holding {inside} ops ("
             + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) + f"); the {min(top, len(groups))} largest:"]
    for op in sorted(groups, key=lambda g: -len(g.inner_ops()))[:top]:
        names = [o.name.removeprefix("nova.") for o in op.inner_ops()]
        shape = "x".join(map(str, op.iteration_shape())) or "scalar"
        shown = " ".join(names[:12]) + (f" ... (+{len(names) - 12})" if len(names) > 12 else "")
        lines.append(f"  [{shape}] {len(names)} ops, {len(op.operands)} in, {len(op.results)} out: {shown}")
    return lines


def kernel_lines(kernels: list[KernelCost], device, measured: dict[int, float] | None, top: int = TOP) -> list[str]:
    """The cost model's totals and the ``top`` most expensive kernels."""
    if not kernels:
        return ["kernels: none"]
    total = sum(k.predicted_s for k in kernels)
    by_bound = Counter(k.bound for k in kernels)
    t_bound = {b: sum(k.predicted_s for k in kernels if k.bound == b) for b in by_bound}
    by_kind: dict[str, list[KernelCost]] = {}
    for k in kernels:
        by_kind.setdefault(k.kind, []).append(k)
    lines = [
        f"kernels on {device.name}: {len(kernels)} ({sum(k.launches for k in kernels)} launches), "
        f"{_si(sum(k.bytes for k in kernels), 'B')} moved, {_si(sum(k.flops for k in kernels), 'FLOP')}; "
        f"predicted {_us(total)} a step"
        + (f", measured {_us(sum(measured.values()))}" if measured else ""),
        "  by bound: " + ", ".join(f"{b} {by_bound[b]} ({_us(t_bound[b])})" for b in ("memory", "compute", "launch")
                                   if b in by_bound),
        "  by kind: " + ", ".join(f"{kind} {len(ks)} ({_us(sum(k.predicted_s for k in ks))})"
                                  for kind, ks in sorted(by_kind.items(), key=lambda kv: -sum(k.predicted_s for k in kv[1]))),
    ]  # fmt: skip
    key = (lambda k: -measured.get(k.index, 0.0)) if measured else (lambda k: -k.predicted_s)
    what = "measured" if measured else "predicted"
    lines.append(f"the {min(top, len(kernels))} most expensive kernels ({what}):")
    lines.append(f"  {'#':>5}  {'op':<34} {'bytes':>10} {'FLOPs':>11} {'FLOP/B':>7} {'bound':<8} {'predicted':>10}"
                 + (f" {'measured':>10} {'x':>5}" if measured else "") + "  schedule; result; loc")
    for k in sorted(kernels, key=key)[:top]:
        row = (f"  {k.index:>5}  {k.op.removeprefix('nova.')[:34]:<34} {_si(k.bytes, 'B'):>10} {_si(k.flops, ''):>11} "
               f"{k.intensity:7.1f} {k.bound:<8} {_us(k.predicted_s):>10}")
        if measured:
            m = measured.get(k.index)
            row += f" {_us(m):>10} {m / k.predicted_s:5.1f}" if m is not None else f" {'-':>10} {'':>5}"
        loc = f"; {short_path(k.loc)[:80]}" if k.loc else ""
        lines.append(f"{row}  {k.config}; {k.shape}{loc}")
    return lines


def summary(head: list[str], stats: list[StageStats], module: ModuleOp, kernels: list[KernelCost] | None, device,
            measured: dict[int, float] | None, memory: list[str], top: int = TOP) -> str:  # fmt: skip
    lines = [*head, *stage_lines(stats), *fusion_lines(module)]
    if kernels is None:
        lines.append("kernels: none: the reference backend runs each op with torch (compile with backend='triton' "
                     "for schedules, the cost model and measured kernel times)")  # fmt: skip
    else:
        lines += kernel_lines(kernels, device, measured, top)
        if measured is None:
            lines.append("measured: not yet (step.profile() on CUDA times every kernel; explain() then shows it)")
    lines += ["memory plan:", *(short_path(line) for line in memory)]
    return "".join(f"// {line}\n" for line in lines)


def stage_text(stages: dict[str, str]) -> str:
    """Every stage's IR after its header, in pipeline order."""
    return "\n".join(f"{STAGE_HEADER.format(name)}\n{text}" for name, text in stages.items())


def write_ir(stages: dict[str, str], out_dir: str | Path) -> list[Path]:
    """One file per stage, ``NN-stage.mlir`` in pipeline order (atomically written)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (name, text) in enumerate(stages.items()):
        path = out_dir / f"{i:02d}-{name}.mlir"
        atomic_write(path, lambda f, text=text: f.write(text.encode()), durable=False)
        paths.append(path)
    return paths


# the kinds, in the roofline's legend order, with their colours
_KIND_COLOURS = {"matmul": "C0", "attention": "C1", "lm_head": "C2", "fused": "C3", "elementwise": "C4",
                 "reduction": "C5", "gather": "C6", "check": "C7", "copy": "C8"}  # fmt: skip


def plot_roofline(kernels: list[KernelCost], device, path, measured: dict[int, float] | None = None) -> None:
    """A PNG placing every kernel: x its arithmetic intensity (FLOP/B), y its FLOP/s
    (predicted: hollow; measured: filled, when given) under the device's roofs
    (min(P, AI x BW) for each arithmetic path the kernels use). Kernels without
    FLOPs (casts, copies, gathers) have no place on a log axis: they sit on the
    floor row at the left, counted in the legend. Matplotlib's Agg canvas (no
    global backend is touched)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    flops = [k for k in kernels if k.flops > 0]
    ais = [k.intensity for k in flops] or [1.0]
    lo, hi = min(ais) / 4, max(max(ais) * 4, max(device.ridge(p) for p in {k.path for k in flops} or {"fp32"}) * 4)
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    for arith in sorted({k.path for k in flops} or {"fp32"}):
        peak = device.flops(arith)
        ax.plot(xs, [min(peak, x * device.mem_bandwidth) for x in xs], lw=1.2,
                label=f"roof: {arith} {peak / 1e12:.0f} TFLOP/s")
    rates = [k.flops / k.predicted_s for k in flops]
    if measured:
        rates += [k.flops / measured[k.index] for k in flops if measured.get(k.index)]
    floor = min(rates, default=1e9) / 10
    for kind, colour in _KIND_COLOURS.items():
        ks = [k for k in flops if k.kind == kind]
        zero = sum(1 for k in kernels if k.kind == kind and k.flops == 0)
        if not ks and not zero:
            continue
        size = [max(8.0, 400 * k.predicted_s / max(k.predicted_s for k in kernels)) for k in ks]
        label = (f"{kind} {len(ks)}" + (f" (+{zero} without FLOPs, on the floor)" if zero else "") if ks
                 else f"{kind}: {zero} without FLOPs, on the floor")
        ax.scatter([k.intensity for k in ks], [k.flops / k.predicted_s for k in ks], s=size, facecolors="none",
                   edgecolors=colour, lw=0.8, label=label + (" predicted" if ks else ""))
        m = [(k, measured[k.index]) for k in ks if measured.get(k.index)] if measured else []
        if m:
            ax.scatter([k.intensity for k, _ in m], [k.flops / t for k, t in m], s=12, color=colour,
                       label=f"{kind} measured")
        if zero:
            ax.scatter([lo * 1.2] * zero, [floor] * zero, marker="|", s=40, color=colour)
    ax.set_xlim(lo, hi)
    ax.set_ylim(floor / 2, max(device.flops(k.path) for k in flops) * 2 if flops else 1e15)
    ax.set_xlabel("arithmetic intensity (FLOP / byte moved)")
    ax.set_ylabel("FLOP/s (predicted: hollow" + (", measured: filled)" if measured else ")"))
    ax.set_title(f"Nova kernels on the {device.name} roofline ({len(kernels)} kernels, "
                 f"BW {device.mem_bandwidth / 1e12:.2f} TB/s)")  # fmt: skip
    ax.grid(True, which="major", lw=0.3)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(str(path))


__all__ = ["run_stages", "summary", "write_ir", "stage_text", "plot_roofline", "StageStats", "STAGE_HEADER"]
