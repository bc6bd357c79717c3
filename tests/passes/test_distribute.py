"""distribute: gradient buckets in the order the backward finishes them, each
collective right after its last gradient, the guard's counts summed over the ranks,
zero1's update on shards; the ops verify, print and parse back, and the later
stages (fuse included) leave them alone. IR only: no process group is needed."""

from __future__ import annotations

import pytest
import torch
from xdsl.utils.exceptions import VerifyException

from nova import pipeline
from nova.errors import UnsupportedError
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import arg_slots, parse_module, print_module, returned, step_func
from nova.ir.types import numel, shape_of
from nova.models import MLPLM, MLPLMConfig
from nova.transforms.distribute import LINKS, collective_seconds, distribute, plan_buckets


def _compiled_to(stage: str, skip_nonfinite: bool = True, optimizer: str = "adamw", n_embd: int = 12):
    torch.manual_seed(0)
    model = MLPLM(MLPLMConfig(vocab_size=37, block_size=8, n_layer=2, n_embd=n_embd, hidden=20))
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))  # fmt: skip
    x = torch.randint(0, 37, (3, 8))
    c = pipeline.Compilation(model, (x, x), opt, "fp32", torch.float32)
    c.skip_nonfinite = skip_nonfinite
    for name, fn in pipeline.STAGES:
        if name == "distribute":
            break
        fn(c)
    assert stage == "guard"
    return c


def _ops(c, cls):
    return [op for op in step_func(c.module).body.block.ops if isinstance(op, cls)]


def test_ddp_buckets_follow_the_backward_and_sit_right_after_their_last_gradient():
    c = _compiled_to("guard")
    block = step_func(c.module).body.block
    grads = dict(c.grads)
    plan = distribute(c.module, "ddp", 2, grads, c.spec, bucket_bytes=700)
    c.module.verify()
    pos = {op: i for i, op in enumerate(block.ops)}
    reduces = _ops(c, nv.AllReduceOp)
    buckets = [op for op in reduces if op.props()["average"]]
    assert len(buckets) == len(plan.buckets) > 2
    sizes = [b.nbytes for b in plan.buckets]
    assert len(set(sizes)) > 1 and max(len(b.names) for b in plan.buckets) > 1  # uneven boundaries
    covered = []
    for op, b in zip(buckets, plan.buckets, strict=True):
        # one flat operand: the cat of the bucket's gradients flattened, in the bucket's order
        (flat,) = op.operands
        assert shape_of(flat.type) == (sum(numel(shape_of(grads[n].type)) for n in b.names),)
        pieces = list(flat.owner.operands) if isinstance(flat.owner, nv.CatOp) else [flat]
        local = [p.owner.operands[0] if isinstance(p.owner, nv.ReshapeOp) else p for p in pieces]
        assert [grads[n] for n in b.names] == local
        last = max((v.owner for v in local), key=pos.__getitem__)
        between = [o for o in block.ops if pos[last] < pos[o] < pos[op]]
        assert all(isinstance(o, (nv.ReshapeOp, nv.CatOp)) for o in between), \
            "a bucket's all-reduce is issued right after its last gradient (its flattening between)"
        assert b.nbytes <= 700 or len(b.names) == 1
        for v, p in zip(local, pieces, strict=True):
            reader = p.owner if p is not v else (flat.owner if flat is not v else op)
            assert [u.operation for u in v.uses] == [reader], "only the bucket's flattening reads the local gradient"
        # the averaged gradients: each a slice of the all-reduce's result, in the bucket's order, reshaped back
        (reduced,) = op.results
        views = [u.operation for u in reduced.uses]
        at = 0
        for n in b.names:
            size = numel(shape_of(grads[n].type))
            if len(b.names) > 1:
                (sl,) = [o for o in views if isinstance(o, nv.SliceOp) and o.props()["start"] == at]
                assert sl.props()["end"] == at + size
            at += size
        covered += b.names
    assert sorted(covered) == sorted(grads)
    # in the order the backward finishes them: the bucket ops' positions increase
    assert [pos[op] for op in buckets] == sorted(pos[op] for op in buckets)
    # the guard's counts are summed over the ranks before anything reads them
    (status,) = [op for op in reduces if not op.props()["average"]]
    counts = {n: v for role, n, v in returned(step_func(c.module)) if role == "status"}
    assert set(counts.values()) == set(status.results)
    for v in status.operands:
        assert [u.operation for u in v.uses] == [status]


def test_zero1_updates_shards_and_gathers_the_parameters():
    c = _compiled_to("guard")
    fn = step_func(c.module)
    params = {s.name: s.type for s in arg_slots(fn) if s.role == "param"}
    plan = distribute(c.module, "zero1", 2, dict(c.grads), c.spec, bucket_bytes=700)
    c.module.verify()
    assert len(_ops(c, nv.ReduceScatterOp)) == len(_ops(c, nv.AllGatherOp)) == len(plan.buckets)
    for s in arg_slots(fn):
        if s.role == "state":
            pname, key = s.name.split("::")
            want = () if key == "step" else (-(-numel(shape_of(params[pname])) // 2),)
            assert shape_of(s.type) == want, (s.name, s.type)
    gathered = {r for op in _ops(c, nv.AllGatherOp) for r in op.results}
    for role, name, v in returned(fn):
        if role == "param":
            whole = v if v in gathered else v.owner.operands[0]  # a 1-D parameter needs no reshape
            assert whole in gathered and shape_of(v.type) == shape_of(params[name])
    # every reduce-scatter precedes every update op that reads its shards; gathers come last
    assert len(_ops(c, nv.LocalShardOp)) == len(params)


@pytest.mark.parametrize("mode", ["ddp", "zero1"])
def test_round_trip_and_the_later_stages_leave_collectives_alone(mode):
    c = _compiled_to("guard", optimizer="sgd")
    distribute(c.module, mode, 2, dict(c.grads), c.spec, bucket_bytes=500)
    text = print_module(c.module)
    assert print_module(parse_module(text)) == text
    before = [(op.name, op.props()) for op in step_func(c.module).body.block.ops if isinstance(op, nv.COLLECTIVE_OPS)]
    started = False
    for name, stage in pipeline.STAGES:
        if started and name != "configure":
            stage(c)
        started = started or name == "distribute"
    c.module.verify()
    after = [(op.name, op.props()) for op in step_func(c.module).body.block.ops if isinstance(op, nv.COLLECTIVE_OPS)]
    assert after == before  # same collectives, same order, none inside a nova.fused group
    for op in step_func(c.module).body.block.ops:
        if isinstance(op, nv.FusedOp):
            assert not any(isinstance(o, nv.COLLECTIVE_OPS) for o in op.inner_ops())


def test_collective_verifiers():
    from xdsl.dialects.builtin import f32, i64

    from nova.ir.module import Slot, new_step
    from nova.ir.types import tensor

    module, fn = new_step([Slot("param", "w", tensor([5, 3], f32)), Slot("batch", "i", tensor([2], i64))])
    b = OpBuilder(fn.body.block)
    w, i = fn.body.block.args
    (shard,) = b.create(nv.ReduceScatterOp, [w], {"world_size": 2, "bucket": 0, "average": True}).results
    assert shape_of(shard.type) == (8,)  # 15 elements over 2 ranks
    (whole,) = b.create(nv.AllGatherOp, [shard], {"world_size": 2, "bucket": 1, "numels": (15,)}).results
    assert shape_of(whole.type) == (15,)
    with pytest.raises(VerifyException, match="a shard of 15 elements over 3 ranks"):
        b.create(nv.AllGatherOp, [shard], {"world_size": 3, "bucket": 1, "numels": (15,)})
    with pytest.raises(VerifyException, match="different element types"):
        b.create(nv.AllReduceOp, [w, i], {"world_size": 2, "bucket": 0, "average": False})
    with pytest.raises(VerifyException, match="average needs floating-point"):
        b.create(nv.AllReduceOp, [i], {"world_size": 2, "bucket": 0, "average": True})
    with pytest.raises(VerifyException, match="world_size must be >= 1"):
        b.create(nv.LocalShardOp, [w], {"world_size": 0})


def test_the_link_model_picks_the_cap_with_the_least_exposed_time():
    c = _compiled_to("guard")
    fn = step_func(c.module)
    link = LINKS["nccl-nvlink-h200"]
    chosen, _ = plan_buckets(fn, dict(c.grads), "ddp", 2, link, None)
    assert chosen.chosen == "model"
    for cap in (2**16, 2**20, 2**30):
        other, _ = plan_buckets(fn, dict(c.grads), "ddp", 2, link, cap)
        assert chosen.exposed_s <= other.exposed_s + 1e-15
    # the model itself: latency + 2 (W-1)/W bytes / bandwidth for a ring all-reduce
    assert collective_seconds(link, 10**9, 2, "all_reduce") == pytest.approx(link.latency + 1e9 / link.bus_bandwidth)
    assert collective_seconds(link, 10**9, 4, "reduce_scatter") == pytest.approx(link.latency + 0.75e9 / link.bus_bandwidth)
    lines = chosen.report()
    assert lines[0].startswith("data parallel: ddp over 2 ranks") and any("bucket 0:" in x for x in lines)


def test_errors():
    c = _compiled_to("guard")
    with pytest.raises(ValueError, match="mode must be"):
        distribute(c.module, "fsdp", 2, dict(c.grads), c.spec)
    distribute(c.module, "ddp", 2, dict(c.grads), c.spec)
    with pytest.raises(ValueError, match="distributed already"):
        distribute(c.module, "ddp", 2, dict(c.grads), c.spec)


class _BatchNormed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))

    def forward(self, x):
        return self.model(x).square().mean()


def test_a_forward_writing_buffers_is_refused():
    """Batch norm's running statistics, written by every rank from its own batch, would drift
    apart across the ranks: refused with what to do instead (eval mode, LayerNorm)."""
    torch.manual_seed(0)
    model = _BatchNormed()
    c = pipeline.Compilation(model, (torch.randn(5, 4),), torch.optim.SGD(model.parameters(), lr=0.1), "fp32",
                             torch.float32)  # fmt: skip
    for name, fn in pipeline.STAGES:
        if name == "distribute":
            break
        fn(c)
    with pytest.raises(UnsupportedError, match=r"writes buffers \['model.1.running_mean'"):
        distribute(c.module, "ddp", 2, dict(c.grads), c.spec)


@pytest.mark.parametrize("n_embd", [12, 13])
def test_ddp_gradients_are_written_into_their_bucket(n_embd):
    """The memory plan places each gradient of a ddp bucket in its window of the
    bucket's flat cat (dense, the window viewed as the gradient's shape), so the cat
    launches nothing; a bucket where a window would start off a 16-byte boundary
    (width 13: a LayerNorm weight's 52 bytes before the bias) keeps its cat as a copy."""
    from nova.transforms.plan_memory import DENSE_WINDOW_ALIGN

    c = _compiled_to("guard", optimizer="sgd", n_embd=n_embd)
    distribute(c.module, "ddp", 2, dict(c.grads), c.spec, bucket_bytes=700)
    started = False
    for name, stage in pipeline.STAGES:
        if started:
            stage(c)
        started = started or name == "distribute"
    place = c.memory.placements
    cats = [op for op in _ops(c, nv.CatOp) if any(isinstance(u.operation, nv.AllReduceOp) for u in op.results[0].uses)]
    assert cats
    assembled = 0
    for cat in cats:
        starts, at = [], 0
        for x in cat.operands:
            starts.append(at * 4)
            at += shape_of(x.type)[0]
        aligned = all(s % DENSE_WINDOW_ALIGN == 0 for s in starts)
        assert place[cat.results[0]].assembled == aligned, (starts, place[cat.results[0]])
        if aligned:
            assembled += 1
            for x, s in zip(cat.operands, starts, strict=True):
                r = x.owner.operands[0] if isinstance(x.owner, nv.ReshapeOp) else x
                p = place[r]
                assert (p.kind, p.root, p.perm) == ("window", cat.results[0], None)
                assert p.window == (0, s // 4, s // 4 + shape_of(x.type)[0])
    if n_embd == 12:
        assert assembled == len(cats)
    else:
        assert assembled < len(cats), "a bucket whose cat stays a copy"
