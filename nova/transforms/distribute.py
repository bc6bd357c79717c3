"""The distribute stage: data parallelism as collective ops in @train_step.

Runs after the guard (``nova/pipeline.py``): it needs the backward's gradients
(``Compilation.grads``), the optimizer's update (which it re-targets at shards
for zero1) and the guard's counts (which it makes global). Nothing here is
discovered at run time: the compiler knows when each gradient is final, the
position of the op that defines it in the block (its last write; a tied
parameter's gradient is the sum of its uses, defined once).

Buckets. The gradients, ordered by that position, are cut greedily into buckets
of at most ``bucket_bytes`` (one element type each: a bucket is one flat
buffer); a gradient larger than the cap is a bucket of its own. Each bucket's
collective is placed right after the op that writes its last gradient, so it
runs while the rest of the backward does (the executable issues it and waits
for it only before its first reader). ``bucket_bytes`` comes from the link
model (``choose_bucket_bytes``; ``docs/configurator.md``, "Gradient buckets"),
or is given (``DataParallel.bucket_bytes``).

ddp: per bucket, ``nova.all_reduce(average)`` of one flat buffer, the ``nova.cat`` of
the bucket's gradients flattened (DDP's sum of grad * 1/W, see
``nova.runtime.distributed``); the optimizer, and the guard's non-finite check,
read the averaged gradients as reshaped slices of the result (views). The memory
plan writes each gradient straight into its window of the cat (``plan_memory``), so
the bucket costs one pass, the scaled copy into the all-reduce's buffer, as DDP's
copy into its bucket does. Every rank applies the same update.

zero1: ``nova.reduce_scatter(average)`` per bucket gives each rank its shard of
every gradient of the bucket (flattened, zero-padded to a multiple of W, one
contiguous slice per rank). The update of each parameter is rebuilt on shards
with the optimizer stage's own formulas (``optimizer._adam`` / ``_sgd``): the
parameter's shard (``nova.local_shard``), the gradient's shard, and state
arguments of the shard's type ``[ceil(n / W)]`` (``step`` stays 0-d and whole);
the new shards are gated by the guard's ``ok`` as the whole values were, and
one ``nova.all_gather`` per bucket, placed after the updates of that bucket's
parameters, makes the new parameters whole again on every rank. The padding is
zeros in gradient, parameter and state, so the update leaves it zero.

The guard (both modes): the ``bad_ids`` and ``nonfinite`` counts are summed over
the ranks (one ``nova.all_reduce`` of the two), before anything reads them: the
gate, the sticky ``guard::failed`` and the status results are then the same on
every rank, so a bad batch on one rank makes every rank skip that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue

from nova.errors import UnsupportedError
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, add_arg, arg_slots, return_op, returned, set_results, step_func
from nova.ir.types import elem_of, numel, shape_of, tensor, to_torch_dtype
from nova.transforms.guard import BAD_IDS, NONFINITE, STATUS

# --- the link model (docs/configurator.md, "Gradient buckets") ---------------


@dataclass(frozen=True)
class Link:
    """One collective of B bytes over W ranks takes ``latency + f(W) B / bus_bandwidth``
    (f = 2 (W-1)/W for a ring all-reduce, (W-1)/W for reduce-scatter and all-gather:
    NCCL's "bus bandwidth" convention, nccl-tests' PERFORMANCE.md)."""

    name: str
    latency: float  # seconds per collective
    bus_bandwidth: float  # bytes/s
    source: str


LINKS: dict[str, Link] = {
    # to be measured on the H200 pair (nccl-tests all_reduce_perf -b 8 -e 1G -f 2 -g 2): NVLink 4 on H100/H200
    # gives 900 GB/s bidirectional per GPU (NVIDIA datasheet), nccl-tests report ~360-480 GB/s of all-reduce bus
    # bandwidth on 2-8 H100s; the small-message latency of NCCL's ring/LL protocols is ~10-20 us
    "nccl-nvlink-h200": Link("nccl-nvlink-h200", 15e-6, 360e9, "datasheet + nccl-tests on H100; to be measured on the H200 pair"),
    # gloo over loopback TCP on one host: scripts/measure_link.py --gloo gave 190 us at 8 B with 2 ranks on the
    # 2-core development machine; ~2 GB/s is a rough guess of loopback TCP throughput
    # (not a target to optimise for: it sizes the CPU runs' buckets only)
    "gloo-loopback": Link("gloo-loopback", 200e-6, 2e9, "alpha measured once on the 2-core dev box, beta unmeasured"),
}

# bucket caps the model chooses among: powers of two from 64 KiB (below that the latency
# dominates any link above) to 1 GiB, plus "everything in one bucket"
CANDIDATE_CAPS = tuple(2**k for k in range(16, 31))


def link_for(device, backend: str | None, name: str | None) -> Link:
    if name is not None:
        if name not in LINKS:
            raise ValueError(f"unknown link {name!r}; known: {sorted(LINKS)}")
        return LINKS[name]
    return LINKS["gloo-loopback" if device is None or backend == "gloo" else "nccl-nvlink-h200"]


def collective_seconds(link: Link, nbytes: int, world: int, kind: str) -> float:
    factor = 2 * (world - 1) / world if kind == "all_reduce" else (world - 1) / world
    return link.latency + factor * nbytes / link.bus_bandwidth


@dataclass
class Bucket:
    index: int
    names: list[str]  # the parameters whose gradients it holds, in the order they finish
    nbytes: int
    dtype: str
    after: int = 0  # the block position of the op writing its last gradient
    after_op: str = ""  # that op's name
    ready_s: float = 0.0  # predicted: when its last gradient is written (from the step's start)
    start_s: float = 0.0  # when the link takes it (after the previous bucket)
    done_s: float = 0.0


@dataclass
class Plan:
    mode: str
    world_size: int
    link: Link
    bucket_bytes: int
    chosen: str  # "model" | "given"
    buckets: list[Bucket] = field(default_factory=list)
    backward_s: float = 0.0  # predicted: the op that writes the last gradient finishes
    exposed_s: float = 0.0  # predicted communication after that point
    unpriced: int = 0  # ops the cost model has no rule for, counted as one launch each

    def report(self) -> list[str]:
        """explain()'s lines."""
        total = sum(b.nbytes for b in self.buckets)
        comm = sum(b.done_s - b.start_s for b in self.buckets)
        hidden = max(0.0, comm - self.exposed_s)
        lines = [f"data parallel: {self.mode} over {self.world_size} ranks, {len(self.buckets)} gradient bucket(s), "
                 f"{total / 2**20:.2f} MiB; cap {self.bucket_bytes / 2**20:.2f} MiB ({self.chosen}); link "
                 f"{self.link.name}: {self.link.latency * 1e6:.0f} us + bytes / {self.link.bus_bandwidth / 1e9:.0f} GB/s "
                 f"({self.link.source})",
                 f"  predicted: backward {self.backward_s * 1e3:.3f} ms, communication {comm * 1e3:.3f} ms, of it "
                 f"hidden behind the backward {hidden * 1e3:.3f} ms, exposed {self.exposed_s * 1e3:.3f} ms"
                 + (f" ({self.unpriced} ops without a cost rule counted as one launch)" if self.unpriced else "")]  # fmt: skip
        for b in self.buckets:
            names = ", ".join(b.names[:4]) + (f", ... ({len(b.names)})" if len(b.names) > 4 else "")
            lines.append(f"  bucket {b.index}: {b.nbytes / 2**10:.1f} KiB {b.dtype}, {len(b.names)} grad(s) [{names}]; "
                         f"issued after op {b.after} ({b.after_op}) at {b.ready_s * 1e3:.3f} ms, runs "
                         f"{b.start_s * 1e3:.3f}-{b.done_s * 1e3:.3f} ms")  # fmt: skip
        return lines


def op_seconds(block, device, precision: str) -> tuple[dict[Operation, float], int]:
    """The predicted time of each op of the block, unfused (``nova.schedule.cost``
    on ``device``; the H200's numbers where the step has no GPU target: the
    reference executor's buckets are sized as if for it)."""
    from nova.schedule import configurator as cf
    from nova.schedule.cost import cost_of
    from nova.schedule.devices import DEVICES
    from nova.transforms.plan_memory import VIEW_OPS

    device = device or DEVICES["H200"]
    out, unpriced = {}, 0
    for op in block.ops:
        if isinstance(op, VIEW_OPS) or not isinstance(op, nv.NovaOp):
            out[op] = 0.0
            continue
        try:
            c = cost_of(op, op.operands, op.results, precision)
            out[op] = max(c.bytes / device.mem_bandwidth, c.flops / device.flops(c.path)) + c.launches * cf.LAUNCH_SECONDS
        except Exception:  # noqa: BLE001  (no rule, or a rule that needs the configure stage's schedule)
            out[op] = cf.LAUNCH_SECONDS
            unpriced += 1
    return out, unpriced


def _cut(order: list[tuple[str, SSAValue]], cap: int) -> list[list[tuple[str, SSAValue]]]:
    buckets: list[list] = []
    size = 0
    for name, g in order:
        nbytes = numel(shape_of(g.type)) * to_torch_dtype(elem_of(g.type)).itemsize
        same = buckets and elem_of(buckets[-1][-1][1].type) == elem_of(g.type)
        if not buckets or not same or size + nbytes > cap and size > 0:
            buckets.append([])
            size = 0
        buckets[-1].append((name, g))
        size += nbytes
    return buckets


def _simulate(plan: Plan, groups, pos: dict, finish: dict, kind: str) -> None:
    plan.buckets = []
    link_free = 0.0
    for i, group in enumerate(groups):
        last = max((g.owner for _, g in group), key=pos.__getitem__)
        nbytes = sum(numel(shape_of(g.type)) * to_torch_dtype(elem_of(g.type)).itemsize for _, g in group)
        b = Bucket(i, [n for n, _ in group], nbytes, str(to_torch_dtype(elem_of(group[0][1].type))).removeprefix("torch."),
                   pos[last], last.name, finish[last])  # fmt: skip
        b.start_s = max(link_free, b.ready_s)
        b.done_s = link_free = b.start_s + collective_seconds(plan.link, nbytes, plan.world_size, kind)
        plan.buckets.append(b)
    plan.exposed_s = max(0.0, link_free - plan.backward_s)


def plan_buckets(fn, grads: dict[str, SSAValue], mode: str, world: int, link: Link, cap: int | None,
                 device=None, precision: str = "fp32") -> tuple[Plan, list]:  # fmt: skip
    """The buckets, and the model's prediction: each bucket's collective starts when
    its last gradient is written and the link is free (one collective at a time),
    the backward ends when the last gradient is written; exposed = what runs after.
    ``cap`` None: the candidate cap with the least exposed time (the largest on a
    tie: fewer collectives, less latency on a real link that is busier than
    modelled)."""
    block = fn.body.block
    pos = {op: i for i, op in enumerate(block.ops)}
    seconds, unpriced = op_seconds(block, device, precision)
    finish, t = {}, 0.0
    for op in block.ops:
        t += seconds[op]
        finish[op] = t
    for name, g in grads.items():
        if not isinstance(g.owner, Operation):
            raise ValueError(f"distribute: the gradient of {name} is an argument of @train_step, not computed")
    order = sorted(grads.items(), key=lambda kv: pos[kv[1].owner])
    kind = "all_reduce" if mode == "ddp" else "reduce_scatter"
    backward = max((finish[g.owner] for _, g in order), default=0.0)
    total = sum(numel(shape_of(g.type)) * to_torch_dtype(elem_of(g.type)).itemsize for _, g in order)
    caps = [cap] if cap is not None else sorted({c for c in CANDIDATE_CAPS if c < total} | {max(total, 1)})
    best = None
    for c in caps:
        plan = Plan(mode, world, link, c, "given" if cap is not None else "model", backward_s=backward,
                    unpriced=unpriced)  # fmt: skip
        groups = _cut(order, c)
        _simulate(plan, groups, pos, finish, kind)
        if best is None or plan.exposed_s <= best[0].exposed_s * (1 + 1e-9):
            best = (plan, groups)
    return best


# --- the stage ----------------------------------------------------------------


def _after(block, op: Operation) -> Operation:
    nxt = op.next_op
    assert nxt is not None, "a gradient defined by the terminator"
    return nxt


def _replace_uses_except(v: SSAValue, new: SSAValue, keep: Operation) -> None:
    for use in list(v.uses):
        if use.operation is not keep:
            use.operation.operands[use.index] = new


def _flat_all_reduce(b: OpBuilder, grads: list[SSAValue], props: dict) -> None:
    """ddp's bucket as one flat buffer: the gradients flattened and concatenated (the
    memory plan places each in its window of the cat, so their producers write the
    bucket and the cat launches nothing), one all-reduce of it, and each averaged
    gradient a slice of the result, reshaped (views): the update and the guard read
    those. No copy into or out of a bucket but the all-reduce's own."""
    flats = [b.reshape(g, [numel(shape_of(g.type))]) for g in grads]
    flat = flats[0] if len(flats) == 1 else b.one(nv.CatOp, flats, {"dim": 0})
    op = b.create(nv.AllReduceOp, [flat], props)
    (reduced,) = op.results
    at = 0
    for g, f in zip(grads, flats, strict=True):
        n = numel(shape_of(g.type))
        piece = reduced if len(flats) == 1 else b.one(nv.SliceOp, [reduced], {"dim": 0, "start": at, "end": at + n, "step": 1})
        # the one reader of g to keep: its flattening reshape (g 1-D: the cat, or the all-reduce)
        keep = f.owner if f is not g else (flat.owner if len(flats) > 1 else op)
        _replace_uses_except(g, b.reshape(piece, shape_of(g.type)), keep)
        at += n


def _status_all_reduce(fn, world: int, index: int, pos_of) -> bool:
    """Sums the guard's counts over the ranks before anything reads them."""
    counts = [(n, v) for role, n, v in returned(fn) if role == STATUS and n in (BAD_IDS, NONFINITE)]
    live = [(n, v) for n, v in counts if not isinstance(v.owner, nv.FullOp)]
    if not live:
        return False  # nothing is checked (constant zero counts): no gate to agree on
    block = fn.body.block
    last = max((v.owner for _, v in live), key=pos_of)
    b = OpBuilder(block, before=_after(block, last))
    op = b.create(nv.AllReduceOp, [v for _, v in live], {"world_size": world, "bucket": index, "average": False})
    for (_, v), r in zip(live, op.results, strict=True):
        _replace_uses_except(v, r, op)
    return True


def distribute(module: ModuleOp, mode: str, world: int, grads: dict[str, SSAValue], spec=None,
               bucket_bytes: int | None = None, link: Link | None = None, device=None,
               precision: str = "fp32") -> Plan:  # fmt: skip
    """Inserts the collectives (see the module docstring); returns the bucket plan."""
    if mode not in ("ddp", "zero1"):
        raise ValueError(f"distribute: mode must be 'ddp' or 'zero1', got {mode!r}")
    fn = step_func(module)
    block = fn.body.block
    if any(isinstance(op, nv.COLLECTIVE_OPS) for op in block.ops):
        raise ValueError("@train_step is distributed already (it has collective ops)")
    if mode == "zero1" and spec is None:
        raise ValueError("distribute: zero1 shards the optimizer's update; the step has no optimizer")
    written = [name for role, name, _ in returned(fn) if role == "buffer"]
    if written:  # each rank's statistics of its own batch: the ranks' buffers would drift apart
        raise UnsupportedError([(f"data parallelism over a forward that writes buffers {written} (batch norm's "
                                 "running statistics: DDP broadcasts rank 0's each step, SyncBatchNorm syncs "
                                 "them; Nova does neither yet). Put the model in eval mode, or use LayerNorm or "
                                 "track_running_stats=False", "distribute")])  # fmt: skip
    link = link or LINKS["gloo-loopback"]
    plan, groups = plan_buckets(fn, grads, mode, world, link, bucket_bytes, device, precision)
    pos = {op: i for i, op in enumerate(block.ops)}
    shards: dict[str, SSAValue] = {}
    for bucket, group in zip(plan.buckets, groups, strict=True):
        last = max((g.owner for _, g in group), key=pos.__getitem__)
        b = OpBuilder(block, before=_after(block, last))
        props = {"world_size": world, "bucket": bucket.index, "average": True}
        if mode == "ddp":
            _flat_all_reduce(b, [g for _, g in group], props)
            continue
        op = b.create(nv.ReduceScatterOp, [g for _, g in group], props)
        for (name, _), r in zip(group, op.results, strict=True):
            shards[name] = r
    pos = {op: i for i, op in enumerate(block.ops)}
    _status_all_reduce(fn, world, len(plan.buckets), pos.__getitem__)
    if mode == "zero1":
        _shard_update(fn, spec, groups, shards, world, len(plan.buckets) + 1)
    return plan


def _shard_update(fn, spec, groups, shards: dict[str, SSAValue], world: int, first_index: int) -> None:
    """zero1: the update of every parameter on this rank's shard, gated, gathered."""
    from nova.transforms.optimizer import ADAM_HYPER, SGD_HYPER, _adam, _sgd, state_keys
    from nova.transforms.simplify import dce

    block = fn.body.block
    slots = arg_slots(fn)
    args = {(s.role, s.name): a for s, a in zip(slots, block.args, strict=True)}
    results = returned(fn)
    by_result = {(role, name): v for role, name, v in results}
    group_of = {p: (g, gs) for g, gs in enumerate(spec.groups) for p in gs.params}
    ok = _gate_condition(by_result, args)
    b = OpBuilder(block, before=return_op(fn))
    new_values: dict[tuple[str, str], SSAValue] = {}
    old_state: list[SSAValue] = []
    for bucket_i, group in enumerate(groups):
        gathered_in, numels, names = [], [], []
        for name, _ in group:
            if name not in group_of:
                raise ValueError(f"distribute (zero1): parameter {name} has a gradient but no optimizer group")
            g, gs = group_of[name]
            p = args[("param", name)]
            hyper = {k: args[("hyper", f"group{g}::{k}")] for k in (SGD_HYPER if gs.kind == "sgd" else ADAM_HYPER)}
            p_shard = b.one(nv.LocalShardOp, [p], {"world_size": world})
            state = {}
            for key in state_keys(gs):
                old = args[("state", f"{name}::{key}")]
                if key == "step":
                    state[key] = old
                else:
                    old_state.append(old)
                    state[key] = add_arg(fn, Slot("state", f"{name}::{key}", p_shard.type))
            if gs.kind == "sgd":
                fresh = args.get(("hyper", f"{name}::momentum_buffer_fresh"))
                new_p, new_state = _sgd(b, gs, hyper, p_shard, shards[name], state, fresh)
            else:
                new_p, new_state = _adam(b, gs, hyper, p_shard, shards[name], state)
            if ok is not None:
                new_p = b.where(ok, new_p, p_shard)
                new_state = {k: b.where(ok, v, state[k]) for k, v in new_state.items()}
            gathered_in.append(new_p)
            numels.append(numel(shape_of(p.type)))
            names.append(name)
            new_values.update({("state", f"{name}::{k}"): v for k, v in new_state.items()})
        op = b.create(nv.AllGatherOp, gathered_in, {"world_size": world, "bucket": first_index + bucket_i,
                                                    "numels": tuple(numels)})  # fmt: skip
        for name, whole in zip(names, op.results, strict=True):
            new_values[("param", name)] = b.reshape(whole, shape_of(args[("param", name)].type))
    missing = [k for k in new_values if k not in by_result]
    if missing:
        raise AssertionError(f"distribute (zero1): rebuilt values with no result to replace: {missing}")
    set_results(fn, [(role, name, new_values.get((role, name), v)) for role, name, v in results])
    dce(block)  # the whole-tensor update the optimizer stage built, and its gates
    for old in old_state:
        if old.uses:
            raise AssertionError(f"distribute (zero1): the whole state argument {old.type} is still read")
        _erase_arg(fn, old)


def _gate_condition(by_result: dict, args: dict) -> SSAValue | None:
    """The guard's ``ok`` (the condition of ``where(ok, new, old)`` on a param result)."""
    for (role, name), v in by_result.items():
        if role != "param":
            continue
        op = v.owner
        if isinstance(op, nv.WhereOp) and op.operands[2] is args.get(("param", name)):
            return op.operands[0]
        return None  # the first param result is not gated: the guard had nothing to check
    return None


def _erase_arg(fn, arg: SSAValue) -> None:
    from xdsl.dialects import func
    from xdsl.dialects.builtin import ArrayAttr

    block = fn.body.block
    i = arg.index
    block.erase_arg(arg)
    inputs = list(fn.function_type.inputs.data)
    del inputs[i]
    fn.function_type = func.FunctionType.from_lists(inputs, fn.function_type.outputs.data)
    attrs = list(fn.arg_attrs.data)
    del attrs[i]
    fn.arg_attrs = ArrayAttr(attrs)


def shard_type(t, world: int):
    return tensor([-(-numel(shape_of(t)) // world)], elem_of(t))


__all__ = ["LINKS", "Bucket", "Link", "Plan", "collective_seconds", "distribute", "link_for", "plan_buckets"]


def stage(c) -> None:
    """The pipeline's distribute stage: ``c.data_parallel`` (a
    ``nova.runtime.distributed.DataParallel``, or None: one process, nothing to do)."""
    dp = getattr(c, "data_parallel", None)
    c.distributed = None
    if dp is None:
        return
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    link = link_for(c.device, backend, dp.link)
    c.distributed = distribute(c.module, dp.mode, dp.world_size, c.grads or {}, c.spec, dp.bucket_bytes, link,
                               c.device, c.precision)  # fmt: skip


def _register_cost_rule() -> None:
    """The cost model's rule for the collective ops (``nova.schedule.cost.RULES``,
    registered beside this stage, which is what creates them): the local traffic
    of packing and unpacking a bucket; the link's time is this stage's model
    (``Plan.report``), not a kernel's."""
    from nova.schedule import cost

    @cost.rule(*nv.COLLECTIVE_OPS)
    def collective_cost(op, ins, outs, cfg, precision) -> cost.Cost:
        return cost.Cost("collective", cost.io_bytes(ins, outs), 0, "fp32")


_register_cost_rule()
