"""A memory plan rebuilt from stored offsets (the step cache's hit path).

``plan_memory`` spends most of its time placing buffers (best fit over every
interfering pair) and writing the plan into the IR. A cached step's IR already
carries the annotations, and its entry keeps the offsets (``stored_offsets``);
``plan_from_offsets`` recomputes everything else (storage kinds, layouts:
permuted buffers and cat windows, liveness, in-place updates: the cheap part) with ``plan_memory``'s own planner and checks
that the stored offsets are a valid plan of it before anything binds to them.
"""

from __future__ import annotations

import bisect
import dataclasses

from xdsl.dialects.builtin import ArrayAttr, DenseArrayBase, DictionaryAttr, IntegerAttr, ModuleOp
from xdsl.ir import Operation, SSAValue

from nova.ir import dialect as nv
from nova.ir.module import step_func
from nova.transforms.plan_memory import ALIGNMENT, Buffer, MemoryPlan, _Planner, assemble, layout_attr, planned_buffers


class StoredPlanError(ValueError):
    """Stored offsets that are not a valid plan of this IR (the reason in the message)."""


def _numbers(fn) -> dict[SSAValue, int]:
    """@train_step's arguments and then its ops' results, numbered in order."""
    block = fn.body.block
    number = {v: i for i, v in enumerate(block.args)}
    for op in block.ops:
        for r in op.results:
            number[r] = len(number)
    return number


def stored_offsets(module: ModuleOp, plan: MemoryPlan) -> list[list[int]]:
    """What ``plan_from_offsets`` needs to rebuild ``plan`` (of ``module``) without
    placing buffers again: ``[value number, size, offset]`` per buffer, in
    ``plan.buffers``' order (values numbered as ``_numbers`` does)."""
    number = _numbers(step_func(module))
    return [[number[b.value], b.size, b.offset] for b in plan.buffers]


def plan_from_offsets(module: ModuleOp, scratch: dict[Operation, int] | None, stored: list) -> MemoryPlan:
    """The plan ``plan_memory(module, scratch)`` gives (``module`` already annotated
    by it), with the offsets taken from ``stored`` (``stored_offsets``) instead of
    placed again. The stored offsets must make a valid plan of the recomputed
    buffers: the same buffers in the same order with the same sizes, aligned, and
    no two buffers live at the same time sharing a byte; and the IR's annotations
    must say the same (``nova.storage``, ``nova.offset``, ``nova.layout``, the
    module's ``nova.memory_plan``). Raises ``StoredPlanError``.

    The buffers and the assembly of the ``MemoryPlan`` are ``plan_memory``'s own
    (``planned_buffers``, ``assemble``), with ``assign_offsets`` and ``annotate``
    left out (tests/runtime/test_cache.py compares the two plans field by field)."""
    fn = step_func(module)
    p, inplace, bufs, scratch_steps = planned_buffers(fn, scratch)
    if not isinstance(stored, list) or len(stored) != len(bufs):
        raise StoredPlanError(f"{len(stored) if isinstance(stored, list) else 'no'} stored buffers, the IR has {len(bufs)}")
    number = _numbers(fn)
    offsets = []
    for i, (b, s) in enumerate(zip(bufs, stored, strict=True)):
        if not (isinstance(s, list) and len(s) == 3 and all(type(x) is int for x in s)):
            raise StoredPlanError(f"buffer {i} is not [value, size, offset]")
        if s[0] != number[b.value] or s[1] != b.size:
            raise StoredPlanError(f"buffer {i} ({b.what}) is value {number[b.value]} of {b.size} bytes in the IR, "
                                  f"value {s[0]} of {s[1]} bytes in the stored plan")  # fmt: skip
        if s[2] < 0 or s[2] % ALIGNMENT:
            raise StoredPlanError(f"buffer {i} ({b.what}) has offset {s[2]}, not a multiple of {ALIGNMENT}")
        offsets.append(s[2])
    bufs = [Buffer(b.value, o, b.size, b.start, b.end, b.what, b.loc) for b, o in zip(bufs, offsets, strict=True)]
    check_disjoint(bufs)
    plan = assemble(fn, p, inplace, bufs, scratch_steps)
    _check_annotations(module, p, plan)
    return plan


def check_disjoint(bufs: list[Buffer]) -> None:
    """No two buffers live at the same time (closed intervals) share a byte: a sweep
    over time keeping the live buffers sorted by offset, each new one checked
    against its neighbours (the live ones are disjoint, so that suffices)."""
    order = sorted(range(len(bufs)), key=lambda i: bufs[i].start)
    by_end = sorted(range(len(bufs)), key=lambda i: bufs[i].end)
    live: list[tuple[int, int]] = []  # (offset, index), sorted
    k = 0
    for i in order:
        b = bufs[i]
        while k < len(by_end) and bufs[by_end[k]].end < b.start:
            j = by_end[k]
            if bufs[j].size and bufs[j].start < b.start:  # started earlier, so inserted
                live.remove((bufs[j].offset, j))
            k += 1
        if not b.size:
            continue
        at = bisect.bisect_left(live, (b.offset, i))
        for n in (at - 1, at):
            if 0 <= n < len(live):
                o = bufs[live[n][1]]
                if b.offset < o.offset + o.size and o.offset < b.offset + b.size:
                    raise StoredPlanError(f"{b.what} (steps {b.start}-{b.end}, bytes {b.offset}+{b.size}) overlaps "
                                          f"{o.what} (steps {o.start}-{o.end}, bytes {o.offset}+{o.size})")  # fmt: skip
        live.insert(at, (b.offset, i))


def _check_annotations(module: ModuleOp, p: _Planner, plan: MemoryPlan) -> None:
    """The IR's ``nova.storage`` / ``nova.offset`` / ``nova.memory_plan`` are the
    ones ``plan_memory.annotate`` writes for ``plan``."""
    for op in p.block.ops:
        if not isinstance(op, nv.NovaOp):
            continue
        kinds = op.attributes.get("nova.storage")
        offs = op.attributes.get("nova.offset")
        want_kinds = [p.place[r].kind if r in p.place else "fused" for r in op.results]
        want_offs = [p.place[r].offset if r in p.place else -1 for r in op.results]
        if (not isinstance(kinds, ArrayAttr) or [getattr(k, "data", None) for k in kinds.data] != want_kinds
                or not isinstance(offs, DenseArrayBase) or list(offs.get_values()) != want_offs):  # fmt: skip
            raise StoredPlanError(f"{op.name}'s nova.storage / nova.offset disagree with the plan")
        if op.attributes.get("nova.layout") != layout_attr(p, op):  # permuted, windows, assembled cats
            raise StoredPlanError(f"{op.name}'s nova.layout disagrees with the plan")
    for a, d in zip(p.block.args, p.fn.arg_attrs.data, strict=True):
        q = p.place[a]
        off = d.data.get("nova.offset")
        if (getattr(d.data.get("nova.storage"), "data", None) != q.kind
                or (q.kind == "input" and (not isinstance(off, IntegerAttr) or off.value.data != q.offset))):  # fmt: skip
            raise StoredPlanError("an argument's nova.storage / nova.offset disagree with the plan")
    if p.fn.res_attrs is not None:
        got = [getattr(d.data.get("nova.storage"), "data", None) for d in p.fn.res_attrs.data]
        if got != p.result_storage:
            raise StoredPlanError("the results' nova.storage disagree with the plan")
    attr = module.attributes.get("nova.memory_plan")
    want = {"arena_bytes": plan.arena_bytes, "sum_bytes": plan.sum_bytes, "lower_bound_bytes": plan.lower_bound_bytes,
            "peak_bytes": plan.peak_bytes, "alignment": plan.alignment}  # fmt: skip
    got = ({k: v.value.data for k, v in attr.data.items() if isinstance(v, IntegerAttr)}
           if isinstance(attr, DictionaryAttr) else None)  # fmt: skip
    if got != want or len(attr.data) != len(want):
        raise StoredPlanError(f"the module's nova.memory_plan {got} is not the plan's {want}")


def differences(a: MemoryPlan, b: MemoryPlan) -> list[str]:
    """The fields in which two plans of the same module differ (empty: the same plan)."""
    out = []
    for f in dataclasses.fields(MemoryPlan):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "placements":
            x, y = [(v, _placement(q)) for v, q in x.items()], [(v, _placement(q)) for v, q in y.items()]
        if x != y:
            out.append(f.name)
    return out


def _placement(q) -> tuple:
    return (q.kind, q.offset, q.size, q.root, q.arg, q.perm, q.window, q.assembled)
