"""Data parallelism at run time: the process group, the collectives, the state.

``nova.compile(..., data_parallel="ddp" | "zero1")`` (or a ``DataParallel`` for
the bucket size) reads the ranks from torch.distributed's default process group
(``init_process_group`` before compiling; torchrun sets ``LOCAL_RANK``, whose
device the model must be on). At compile time every rank checks that the model
is the same everywhere (the parameters' names, shapes, dtypes and
``requires_grad``, through one ``all_gather_object``) and, as
DistributedDataParallel's constructor does, takes rank 0's parameter and buffer
values (a broadcast), so the ranks start bit-identical.

The collective ops of the distribute stage (``nova.transforms.distribute``) run
here, on the default group: gloo on CPUs, NCCL on GPUs, both executors (the
reference executor op by op; the executable as launches). A bucket is the
concatenation of its operands, flattened, in operand order:

  all_reduce      flat = cat(x.flatten()) [* 1/W]; all_reduce(SUM); split back
  reduce_scatter  each operand zero-padded to W * k and viewed [W, k]; the views
                  side by side [W, K] (K = sum k); [* 1/W]; row r goes to rank r
  all_gather      the shards cat [K]; all_gather -> [W, K]; each operand's
                  columns, flattened, the padding dropped
  local_shard     row ``rank`` of the padded [W, k] view

so a rank's shard of a parameter is its own contiguous slice of the flattened,
padded parameter, and its optimizer state (``optimizer.state[p]["exp_avg"]``
and the like) is that slice only, 1-D: ``full_optimizer_state`` gathers it into
PyTorch's layout, ``load_full_optimizer_state`` takes such a state dict back.

The factor 1/W multiplies each gradient in its own dtype before the sum, as the
reducer of DistributedDataParallel does by default in torch 2.11-2.13
(``Reducer::mark_variable_ready_dense``: ``at::mul_out(bucket_view, grad,
wrapped_scalar_tensor(1. / div_factor_))`` when no comm hook is registered),
so a 2-rank sum is bit-identical to DDP's (a sum of two is commutative); with
more ranks the order of gloo's / NCCL's own sum decides the last bit, as it
does for DDP.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

MODES = ("ddp", "zero1")


@dataclass(frozen=True)
class DataParallel:
    """How a step is spread over the ranks. ``bucket_bytes``: None lets the link
    model choose (``nova.transforms.distribute.choose_bucket_bytes``), an int fixes
    the bucket cap (tests, experiments)."""

    mode: str = "ddp"
    world_size: int = 0  # filled from the process group by ``configure``
    bucket_bytes: int | None = None
    link: str | None = None  # a key of nova.transforms.distribute.LINKS; None: by the device


class DistributedError(RuntimeError):
    """A data-parallel setup that cannot run (the message says what and where)."""


def _dist():
    import torch.distributed as dist

    return dist


def configure(data_parallel, model: torch.nn.Module) -> DataParallel | None:
    """The ``data_parallel`` option as a checked ``DataParallel`` (None: one process)."""
    if data_parallel is None:
        return None
    if isinstance(data_parallel, str):
        data_parallel = DataParallel(data_parallel)
    if not isinstance(data_parallel, DataParallel):
        raise TypeError(f"data_parallel must be None, one of {MODES} or a nova DataParallel, "
                        f"got {type(data_parallel).__name__}")  # fmt: skip
    if data_parallel.mode not in MODES:
        raise ValueError(f"data_parallel must be one of {MODES}, got {data_parallel.mode!r}")
    if data_parallel.bucket_bytes is not None and data_parallel.bucket_bytes <= 0:
        raise ValueError(f"DataParallel.bucket_bytes must be positive, got {data_parallel.bucket_bytes}")
    dist = _dist()
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError(
            f"data_parallel={data_parallel.mode!r} needs torch.distributed's default process group: call "
            "torch.distributed.init_process_group('nccl' or 'gloo') in every rank before nova.compile "
            "(torchrun sets RANK, WORLD_SIZE and LOCAL_RANK)")  # fmt: skip
    world = dist.get_world_size()
    _check_device(model)
    _check_same_model(model, world)
    _sync_from_rank0(model)
    return DataParallel(data_parallel.mode, world, data_parallel.bucket_bytes, data_parallel.link)


def _check_device(model: torch.nn.Module) -> None:
    device = next(model.parameters()).device
    local = os.environ.get("LOCAL_RANK")
    if device.type == "cuda" and local is not None and device.index is not None and device.index != int(local):
        raise DistributedError(f"rank {_dist().get_rank()} has LOCAL_RANK={local} but its model is on {device}: "
                               f"move it to cuda:{local} (torch.cuda.set_device(int(os.environ['LOCAL_RANK'])))")  # fmt: skip
    backend = _dist().get_backend()
    if device.type == "cuda" and backend == "gloo":
        raise DistributedError("the model is on CUDA but the process group is gloo: use init_process_group('nccl')")
    if device.type == "cpu" and backend == "nccl":
        raise DistributedError("the model is on the CPU but the process group is NCCL: use init_process_group('gloo')")


def signature(model: torch.nn.Module) -> list[tuple]:
    """What must agree across ranks: every parameter's and buffer's name, shape,
    dtype (and requires_grad), in registration order."""
    sig = [("param", n, tuple(p.shape), str(p.dtype), p.requires_grad)
           for n, p in model.named_parameters(remove_duplicate=False)]  # fmt: skip
    sig += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers(remove_duplicate=False)]
    return sig


def _check_same_model(model: torch.nn.Module, world: int) -> None:
    dist = _dist()
    mine = signature(model)
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    for r, theirs in enumerate(every):
        if theirs == mine:
            continue
        diff = next((f"{a} on rank {dist.get_rank()} vs {b} on rank {r}" for a, b in zip(mine, theirs) if a != b),
                    f"{len(mine)} parameters and buffers on rank {dist.get_rank()} vs {len(theirs)} on rank {r}")
        raise DistributedError(f"the model differs across ranks (every rank must compile the same model): {diff}")


def _sync_from_rank0(model: torch.nn.Module) -> None:
    """DistributedDataParallel's ``_sync_module_states``: rank 0's values everywhere."""
    dist = _dist()
    with torch.no_grad():
        seen = set()
        for t in [*model.parameters(), *model.buffers()]:
            if id(t) in seen:
                continue
            seen.add(id(t))
            dist.broadcast(t.data, src=0)


def rank() -> int:
    return _dist().get_rank()


def _world(op) -> int:
    dist = _dist()
    want = op.props()["world_size"]
    if not dist.is_initialized():
        raise DistributedError(f"{op.name}: the step was compiled for {want} ranks, but no process group is "
                               "initialised in this process")  # fmt: skip
    got = dist.get_world_size()
    if got != want:
        raise DistributedError(f"{op.name}: the step was compiled for {want} ranks, the process group has {got}")
    return want


# --- the collectives ---------------------------------------------------------
def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _scale(flat: torch.Tensor, w: int) -> torch.Tensor:
    # DDP: mul_out(bucket_view, grad, wrapped_scalar_tensor(1. / div_factor)): the double
    # 1/W becomes a scalar of the gradient's dtype's compute type (torch's wrapped-scalar rule)
    return flat.mul_(1.0 / w)


def _padded_rows(x: torch.Tensor, w: int) -> torch.Tensor:
    """``x`` flattened, zero-padded to W * k, as [W, k] (a view where no pad is needed)."""
    n = x.numel()
    k = _ceil_div(n, w)
    flat = x.reshape(-1)
    if k * w != n:
        flat = torch.cat([flat, flat.new_zeros(k * w - n)])
    return flat.view(w, k)


def _issue(op, xs: list[torch.Tensor], outs: list[torch.Tensor] | None = None):
    """Starts ``op``'s communication (async: gloo's thread, NCCL's stream, which
    waits for the current stream first) and returns ``(work, finish)``:
    ``finish(outs)`` (after ``work.wait()``) writes or returns the results. The
    operands are read here, into a new flat buffer (or, for the all-reduce of one
    dense operand with its result's buffer given in ``outs``, into that buffer, where
    the sum then happens in place), so they are free once this returns."""
    from nova.ir import dialect as nv

    dist, w = _dist(), _world(op)
    if isinstance(op, nv.LocalShardOp):
        row = _padded_rows(xs[0], w)[rank()]
        return None, lambda outs: _put([row], outs)
    props = op.props()
    if isinstance(op, nv.AllReduceOp) and outs is not None and len(xs) == 1 and outs[0].is_contiguous():
        # ddp's flat bucket (nova.transforms.distribute): the scaled copy is the one pass
        # over it, as DDP's copy into its bucket (mul_out(bucket_view, grad, 1/W))
        buf = outs[0]
        if props["average"]:
            torch.mul(xs[0], 1.0 / w, out=buf)
        else:
            buf.copy_(xs[0])
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, async_op=True)
        return work, lambda outs: outs
    if isinstance(op, nv.AllReduceOp):
        flat = torch.cat([x.reshape(-1) for x in xs])
        if props["average"]:
            _scale(flat, w)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)
        return work, lambda outs: _split(flat, xs, outs)
    if isinstance(op, nv.ReduceScatterOp):
        rows = torch.cat([_padded_rows(x, w) for x in xs], dim=1)  # [W, K]: row r is rank r's shard of every operand
        if props["average"]:
            _scale(rows, w)
        mine = rows.new_empty(rows.shape[1])
        if dist.get_backend() == "gloo":  # gloo has the list form only
            work = dist.reduce_scatter(mine, list(rows.unbind(0)), op=dist.ReduceOp.SUM, async_op=True)
        else:
            work = dist.reduce_scatter_tensor(mine, rows.reshape(-1), op=dist.ReduceOp.SUM, async_op=True)
        ks = [_ceil_div(x.numel(), w) for x in xs]
        return work, lambda outs: _split(mine, [mine.new_empty(k) for k in ks], outs)
    if isinstance(op, nv.AllGatherOp):
        mine = torch.cat([x.reshape(-1) for x in xs])
        every = mine.new_empty(w * mine.numel())
        work = _all_gather(dist)(every, mine, async_op=True)

        def finish(outs):
            rows, at, whole = every.view(w, mine.numel()), 0, []
            for x, n in zip(xs, props["numels"], strict=True):
                whole.append(rows[:, at:at + x.numel()].reshape(-1)[:n])
                at += x.numel()
            return _put(whole, outs)

        return work, finish
    raise NotImplementedError(f"nova.runtime.distributed has no implementation of {op.name}")


def _all_gather(dist):
    """torch.distributed's all-gather into one tensor: ``all_gather_single`` where it exists
    (torch 2.13 deprecates the older name), else ``all_gather_into_tensor`` (the same call)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _put(values: list[torch.Tensor], outs) -> list[torch.Tensor]:
    if outs is None:
        return [v.clone() for v in values]
    for o, v in zip(outs, values, strict=True):
        # the memory plan may place a result in the tensor of another shape it becomes
        # (zero1's gathered [n] in its parameter, in place): same elements, dense
        (o if o.shape == v.shape else o.view(v.shape)).copy_(v)
    return outs


def _split(flat: torch.Tensor, like: list[torch.Tensor], outs) -> list[torch.Tensor]:
    parts, at = [], 0
    for x in like:
        parts.append(flat[at:at + x.numel()].view(x.shape))
        at += x.numel()
    return parts if outs is None else _put(parts, outs)


def run(op, xs: list[torch.Tensor], outs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Runs one collective op of the IR to completion (``outs``: write into these)."""
    work, finish = _issue(op, xs, outs)
    if work is not None:
        work.wait()
    return finish(outs)


class Deferred:
    """The executable's form of a collective whose every reader is a later launch:
    ``issue(xs, outs)`` starts it and returns at once (the backward's next kernels
    run meanwhile: on a GPU, NCCL's own stream; on a CPU, gloo's thread), and the
    first launch that reads a result calls ``finish()`` first (on a GPU
    ``work.wait()`` is a wait of the current stream on NCCL's, no host block, then
    the unpacking copies). Under CUDA graph capture the same calls are recorded
    once, and the replay repeats them on the device."""

    def __init__(self, op):
        self.op = op
        self.pending = None  # (work, finish, outs) of the issued, unfinished collective

    def issue(self, xs: list[torch.Tensor], outs: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.pending is not None:
            raise AssertionError(f"{self.op.name} (bucket {self.op.props().get('bucket')}) issued again before its "
                                 "results were read")  # fmt: skip
        work, finish = _issue(self.op, xs, outs)
        self.pending = (work, finish, outs)
        return outs

    def finish(self) -> None:
        if self.pending is None:
            return
        work, finish, outs = self.pending
        self.pending = None
        if work is not None:
            work.wait()
        finish(outs)


def wire(steps, fn) -> None:
    """Turns the Triton program's collective steps into launches: a collective
    whose results are read (directly or through views) only by later launches is
    ``Deferred`` (issued at its place, finished before its first reader); one whose
    results the step returns (the guard's counts, zero1's gathered parameters:
    the executable copies those out after the list) completes where it stands."""
    from nova.ir import dialect as nv

    ret = fn.body.block.last_op
    first_reader: dict = {}
    view_of: dict = {}  # a view step's output -> the collective whose result it views
    owner: dict = {}
    for i, st in enumerate(steps):
        if isinstance(st.op, nv.COLLECTIVE_OPS):
            for r in st.outputs:
                owner[r] = st.op
            continue
        sources = {owner.get(v) or view_of.get(v) for v in st.inputs} - {None}
        if st.is_view:
            if sources:
                view_of[st.outputs[0]] = sources.pop()
            continue
        for src in sources:
            first_reader.setdefault(src, i)
    returned = {owner.get(v) or view_of.get(v) for v in ret.operands} - {None}
    deferred: dict = {}
    for st in steps:
        if isinstance(st.op, nv.COLLECTIVE_OPS):
            if st.op in first_reader and st.op not in returned:
                d = deferred[st.op] = Deferred(st.op)
                st.run = d.issue
            else:
                st.run = (lambda op: lambda xs, outs=None: run(op, xs, outs))(st.op)
    for src, i in first_reader.items():
        if src in deferred:
            steps[i].run = _after_finish(deferred[src].finish, steps[i].run)


def _after_finish(finish, run):
    def launch(*args, **kwargs):
        finish()
        return run(*args, **kwargs)

    return launch


# --- the loss and the optimizer state ----------------------------------------
def fresh_state(p: torch.Tensor, slot_type) -> torch.Tensor:
    """A new state entry of the step's argument type: ``zeros_like(p)``, or under
    zero1 this rank's 1-D shard of zeros."""
    from nova.ir.types import elem_of, shape_of, to_torch_dtype

    shape = shape_of(slot_type)
    if shape == tuple(p.shape):
        return torch.zeros_like(p)
    return torch.zeros(shape, dtype=to_torch_dtype(elem_of(slot_type)), device=p.device)


def report(c) -> list[str]:
    """explain()'s data-parallel lines (the distribute stage's plan), if any."""
    plan = getattr(c, "distributed", None)
    return plan.report() if plan is not None else []


def global_loss(loss: torch.Tensor) -> torch.Tensor:
    """The mean of every rank's loss (each rank passes its own; all must call it)."""
    dist = _dist()
    total = loss.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total / dist.get_world_size()


def _sharded_entries(optimizer: torch.optim.Optimizer, dp: DataParallel):
    """(param, key, shard) of every zero1-sharded state tensor: 1-D, of
    ceil(numel / W) elements, where the parameter has more than one element
    or is not 1-D already (``step`` stays whole on every rank)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, v in optimizer.state.get(p, {}).items():
                if key == "step" or not isinstance(v, torch.Tensor):
                    continue
                if tuple(v.shape) == tuple(p.shape) and not (v.dim() == 1 and v.numel() == _ceil_div(p.numel(), dp.world_size)):
                    raise DistributedError(f"optimizer state {key!r} of a parameter of shape {tuple(p.shape)} is whole, "
                                           "not this rank's shard: load a full state with load_full_optimizer_state")  # fmt: skip
                yield p, key, v


def full_optimizer_state(optimizer: torch.optim.Optimizer, dp: DataParallel | None) -> dict:
    """``optimizer.state_dict()`` in PyTorch's own layout: under zero1 every rank's
    shard gathered (a collective: every rank must call it); otherwise as it is."""
    sd = optimizer.state_dict()
    if dp is None or dp.mode != "zero1":
        return sd
    dist, w = _dist(), dp.world_size
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    full = {i: dict(entry) for i, entry in sd["state"].items()}
    for p, key, v in _sharded_entries(optimizer, dp):
        every = v.new_empty(w * v.numel())
        _all_gather(dist)(every, v.contiguous())
        full[index[id(p)]][key] = every[:p.numel()].view(p.shape).clone()
    return {"state": full, "param_groups": sd["param_groups"]}


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, dp: DataParallel | None, state_dict: dict) -> None:
    """``optimizer.load_state_dict`` of a state in PyTorch's layout (one from
    ``full_optimizer_state``, or from an eager run); under zero1 each rank then
    keeps its own shard of every state tensor the shape of its parameter."""
    optimizer.load_state_dict(state_dict)
    if dp is None or dp.mode != "zero1":
        return
    r, w = rank(), dp.world_size
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = optimizer.state.get(p, {})
            for key, v in list(entry.items()):
                if key != "step" and isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape):
                    entry[key] = _padded_rows(v.detach(), w)[r].clone()


__all__ = ["DataParallel", "DistributedError", "MODES", "configure", "full_optimizer_state", "global_loss",
           "load_full_optimizer_state", "run", "signature"]  # fmt: skip
