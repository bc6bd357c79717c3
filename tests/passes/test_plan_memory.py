"""plan_memory: IR in, IR out. Liveness, arena offsets, views, in-place updates.

Every plan is checked by things that do not share its code: a pairwise overlap
check, a replay of the Triton backend's own launch order over the offsets the
IR records (byte ownership at 256-B granularity), and an arena executor that
runs the step with the reference executor's ops on one poisoned byte arena at
the planned offsets (any clobbered live buffer changes the results)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from xdsl.dialects.builtin import bf16, f32

from nova import pipeline
from nova.backends.reference import run_function, run_ops
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, arg_slots, new_step, parse_module, print_module, result_slots, return_op, set_results
from nova.ir.types import elem_of, numel, shape_of, tensor, to_torch_dtype
from nova.models import GPT, gpt_tiny
from nova.transforms import plan_memory as pm

from step_inputs import step_args

ALIGN = 256


def _step(*slots):
    module, fn = new_step(list(slots))
    return module, fn, OpBuilder(fn.body.block)


def _bytes(v) -> int:
    return numel(shape_of(v.type)) * to_torch_dtype(elem_of(v.type)).itemsize


def _aligned(v) -> int:
    return -(-_bytes(v) // ALIGN) * ALIGN


def _storage(v) -> tuple[str, int]:
    """(kind, offset) of a value, read from the IR attributes only."""
    if isinstance(v.owner, nv.NovaOp):
        op = v.owner
        return op.attributes["nova.storage"].data[v.index].data, op.attributes["nova.offset"].get_values()[v.index]
    d = v.owner.parent_op().arg_attrs.data[v.index].data
    return d["nova.storage"].data, d["nova.offset"].value.data if "nova.offset" in d else -1


def _layout(v) -> str:
    """A result's ``nova.layout`` text ("" when dense in its own storage), from the IR."""
    a = v.owner.attributes.get("nova.layout") if isinstance(v.owner, nv.NovaOp) else None
    return a.data[v.index].data if a is not None else ""


def _perm_of(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.rsplit("perm ", 1)[1].split(","))


def _cat_of(v):
    """The nova.cat whose window a value is: its only reader, through transposes."""
    while not isinstance(v.owner, nv.CatOp):
        (use,) = v.uses
        v = use.operation.results[0]
    return v


def _laid_out(v, held: torch.Tensor) -> torch.Tensor:
    """``v`` from the tensor its layout says holds it: its buffer (dense, or
    ``v.permute(perm)`` densely), or its cat's buffer (a window of it)."""
    text = _layout(v)
    if text.startswith("window"):
        dim, window = text.split()[2], text.split()[3]
        start, end = (int(x) for x in window.strip("[]").split(":"))
        held = held.view(shape_of(_cat_of(v).type))
        return held.narrow(int(dim), start, end - start).permute(pm.inverse(_perm_of(text)))
    if text.startswith("perm"):
        perm = _perm_of(text)
        return held.view([shape_of(v.type)[d] for d in perm]).permute(pm.inverse(perm))
    return held.view(shape_of(v.type))


def _root(v):
    while _storage(v)[0] in ("view", "window"):
        v = v.owner.operands[0] if _storage(v)[0] == "view" else _cat_of(v)
    return v


def _result_storage(fn) -> list[str]:
    return [d.data["nova.storage"].data for d in fn.res_attrs.data]


def check_no_overlap(plan: pm.MemoryPlan) -> None:
    """Every pair of arena buffers live at the same time is disjoint in bytes."""
    for b in plan.buffers:
        assert b.offset % ALIGN == 0 and b.size % ALIGN == 0 and b.size >= _bytes(b.value)
        assert b.offset + b.size <= plan.arena_bytes
    for a, b in itertools.combinations(plan.buffers, 2):
        if a.start <= b.end and b.start <= a.end:
            assert a.offset + a.size <= b.offset or b.offset + b.size <= a.offset, (a, b)
    assert plan.lower_bound_bytes <= plan.arena_bytes <= plan.sum_bytes


def run_in_arena(fn, plan: pm.MemoryPlan, args: list[torch.Tensor], arena: bool = True):
    """The step run op by op with the reference executor, every arena value stored at
    its planned offset in one arena of 0xFF bytes (NaN for floats), in-place values
    written into the argument tensors. Returns (results, arguments after the step).
    ``arena=False`` stores each value in a fresh tensor instead: the same layouts
    (contiguous, as the backend's kernels write), so the results must be bitwise equal."""
    block = fn.body.block
    memory = torch.full((max(plan.arena_bytes, 1),), 0xFF, dtype=torch.uint8)
    args = [a.clone() for a in args]

    fresh = {}  # arena=False: each cat's own tensor, which its windows are views of

    def region(v):
        kind, off = _storage(v)
        dt = to_torch_dtype(elem_of(v.type))
        if kind == "window":
            return _laid_out(v, region(_cat_of(v)))
        if not arena:
            if v not in fresh:
                fresh[v] = _laid_out(v, torch.empty(numel(shape_of(v.type)), dtype=dt))
            return fresh[v]
        return _laid_out(v, memory[off:off + _bytes(v)].view(dt))

    by_name = {s.name: a for s, a in zip(arg_slots(fn), args, strict=True)}
    into: dict = {}  # in-place value -> the argument tensor it is written into
    for s, v, how in zip(result_slots(fn), return_op(fn).operands, _result_storage(fn), strict=True):
        if how == "inplace":
            r = v
            while isinstance(r.owner, nv.ReshapeOp) and _storage(r)[0] == "view":
                r = r.owner.operands[0]
            into[r] = by_name[s.name]
    env = {}
    for a, t in zip(block.args, args, strict=True):
        if _storage(a)[0] == "input":
            env[a] = region(a)
            env[a].copy_(t)
        else:
            env[a] = t
    for st in pm.launch_order(fn):
        for op in [st.op]:
            if arena and _layout(op.results[0]) == "assembled from windows":
                env[op.results[0]] = region(op.results[0])  # launches nothing: its windows hold the pieces
                continue
            run_ops([op], env, torch.device("cpu"))
            for r in op.results:
                kind = _storage(r)[0]
                if kind in ("arena", "window"):
                    dst = region(r)
                    dst.copy_(env[r])
                    env[r] = dst
                elif kind == "inplace":
                    into[r].copy_(env[r])
                    env[r] = into[r]
                elif kind == "view":
                    # a view must read its source's bytes, not a copy of them
                    assert env[r].untyped_storage().data_ptr() == env[r.owner.operands[0]].untyped_storage().data_ptr()
    return [env[v].clone() for v in return_op(fn).operands], args


def replay_backend_schedule(fn) -> None:
    """Replays the Triton backend's own launch order (its VIEW_OPS, its view
    function on meta tensors, one launch per other op) over the offsets in the
    IR: each read must find the bytes of its value still there."""
    tr = pytest.importorskip("nova.backends.triton")
    plan_bytes = fn.parent_op().attributes["nova.memory_plan"].data["arena_bytes"].value.data
    owner = [None] * (plan_bytes // ALIGN + 1)
    external: dict = {}  # argument -> the value its storage holds now
    into: dict = {}
    args = {s.name: a for s, a in zip(arg_slots(fn), fn.body.block.args, strict=True)}
    for s, v, how in zip(result_slots(fn), return_op(fn).operands, _result_storage(fn), strict=True):
        if how == "inplace":
            into[_root(v)] = args[s.name]

    def chunks(v):
        _, off = _storage(v)
        return range(off // ALIGN, (off + _aligned(v)) // ALIGN)

    started = set()  # the cats one of whose windows has been written

    def write(v):
        kind = _storage(v)[0]
        if kind == "window":  # into its cat's buffer, which holds the earlier windows' bytes still
            cat = _cat_of(v)
            if cat in started:
                assert all(owner[c] is cat for c in chunks(cat)), f"the earlier windows of {cat.owner} were overwritten"
            started.add(cat)
            for c in chunks(cat):
                owner[c] = cat
        elif kind in ("arena", "input"):
            for c in chunks(v):
                owner[c] = v
        elif kind == "inplace":
            external[into[v]] = v

    def read(v, at):
        r = _root(v)
        kind = _storage(r)[0]
        if kind in ("arena", "input"):
            assert all(owner[c] is r for c in chunks(r)), f"{at}: the bytes of {r.owner} were overwritten"
        elif kind == "external":
            assert external.get(r, r) is r, f"{at}: reads {arg_slots(fn)[r.index].name} after its in-place update"
        elif kind == "inplace":
            assert external.get(into[r]) is r

    for a in fn.body.block.args:
        write(a)
    layouts = {}
    for op in fn.body.block.ops:
        if op is return_op(fn):
            continue
        if isinstance(op, tr.VIEW_OPS):
            copied = []
            src = layouts.get(op.operands[0], torch.empty(shape_of(op.operands[0].type), device="meta"))
            layouts[op.results[0]] = tr._view(op, lambda t: copied.append(1) or t.contiguous())([src])[0]
            assert _storage(op.results[0])[0] == ("arena" if copied else "view"), op
            if copied:
                read(op.operands[0], op)
                write(op.results[0])
            continue
        inputs, outputs = list(op.operands), list(op.results)
        if _layout(op.results[0]) == "assembled from windows":  # launches nothing: its windows hold the pieces
            assert op.results[0] in started and all(_root(v) is op.results[0] for v in inputs)
            for v in inputs:
                read(v, op)
            continue
        for v in inputs:
            read(v, op)
        # what this kernel writes must not be what it reads (unless an elementwise in-place update)
        written = {c for r in outputs if _storage(r)[0] == "arena" for c in chunks(r)}
        for v in inputs:
            if _storage(_root(v))[0] in ("arena", "input"):
                assert not written & set(chunks(_root(v))), f"{op}: writes over its own operand"
        for r in outputs:
            if _storage(r)[0] == "inplace":
                readers = [v for v in inputs if _root(v) is into[r]]
                assert all(v is into[r] and v.type == r.type for v in readers), f"{op}: writes over a read operand"
                assert not readers or op.name in ("nova.add", "nova.sub", "nova.mul", "nova.div", "nova.where", "nova.fused")
        for r in outputs:
            write(r)
            if _layout(r):
                layouts[r] = _laid_out(r, torch.empty(numel(shape_of(_root(r).type)), device="meta"))
    for v in return_op(fn).operands:
        read(v, "return")


def _check(module, args) -> pm.MemoryPlan:
    fn = module.ops.first
    reference = run_function(fn, [a.clone() for a in args])
    plan = pm.plan_memory(module)
    before, _ = run_in_arena(fn, plan, args, arena=False)
    for x, y in zip(reference, before, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    module.verify()
    text = print_module(module)
    assert print_module(parse_module(text)) == text
    check_no_overlap(plan)
    replay_backend_schedule(fn)
    outs, after = run_in_arena(fn, plan, args)
    for x, y in zip(before, outs, strict=True):
        assert torch.equal(x, y)
    return plan


# ---------------------------------------------------------------------------
# hand-built IR


def test_a_dead_buffer_is_reused_and_arena_is_the_live_set():
    module, fn, b = _step(Slot("batch", "x", tensor([64, 64], f32)))
    x = fn.body.block.args[0]
    a = b.one(nv.ExpOp, [x])
    c = b.one(nv.ExpOp, [a])
    d = b.one(nv.ExpOp, [c])  # a is dead once c is written: d takes its bytes
    set_results(fn, [("loss", "loss", b.reduce_sum(d, [0, 1]))])
    plan = _check(module, [torch.randn(64, 64)])
    size = 64 * 64 * 4
    offsets = {b_.what: b_.offset for b_ in plan.buffers}
    assert _storage(d)[1] == _storage(a)[1] and _storage(c)[1] != _storage(a)[1]
    # x (an input slot) dies at the first exp, so three 16 KiB buffers are never live at once
    assert plan.arena_bytes == plan.lower_bound_bytes == 2 * size
    assert plan.sum_bytes == 4 * size  # x, a, c, d (the loss is an output, outside the arena)
    assert _result_storage(fn) == ["output"] and "nova.exp" in offsets
    assert plan.external["outputs"] == 512 and plan.external["inputs"] == size


def test_random_programs_never_overlap_live_buffers():
    rnd = random.Random(0)
    for _ in range(12):
        module, fn, b = _step(Slot("batch", "x", tensor([8, 16], f32)), Slot("param", "w", tensor([16, 16], f32)))
        vals = list(fn.body.block.args)
        for _ in range(rnd.randint(5, 30)):
            k = rnd.random()
            x, y = rnd.choice(vals), rnd.choice(vals)
            if k < 0.3 and shape_of(x.type) == shape_of(y.type):
                vals.append(b.add(x, y))
            elif k < 0.5 and shape_of(x.type)[-1] == 16:
                vals.append(b.matmul(x, vals[1]))
            elif k < 0.6:
                vals.append(b.transpose(x, [1, 0]))  # a view
            elif k < 0.7 and shape_of(x.type) == (8, 16):
                vals.append(b.reshape(b.transpose(x, [1, 0]), [8, 16]))  # not a view: a copy
            else:
                vals.append(b.one(nv.TanhOp, [x]))
        loss = b.full(0.0, (), f32)
        for v in rnd.sample(vals, 3):
            loss = b.add(loss, b.reduce_sum(v, [0, 1]))
        set_results(fn, [("loss", "loss", loss)])
        _check(module, [torch.randn(8, 16), torch.randn(16, 16)])


def _sgd(read_after: bool, matmul: bool = False):
    module, fn, b = _step(Slot("param", "w", tensor([16, 16], f32)), Slot("batch", "x", tensor([16, 16], f32)))
    w, x = fn.body.block.args
    loss = b.reduce_sum(b.mul(b.matmul(x, w), x), [0, 1])
    new_w = b.matmul(w, x) if matmul else b.sub(w, b.scale(x, 0.1))  # the matmul reads all of w for each element
    if read_after:
        loss = b.add(loss, b.reduce_sum(b.matmul(x, b.transpose(w, [1, 0])), [0, 1]))  # old w through a view
    set_results(fn, [("loss", "loss", loss), ("param", "w", new_w)])
    return module, fn, new_w


def test_a_param_update_is_in_place_when_nothing_reads_the_old_value_after():
    module, fn, new_w = _sgd(read_after=False)
    plan = _check(module, [torch.randn(16, 16), torch.randn(16, 16)])
    assert _result_storage(fn) == ["output", "inplace"] and _storage(new_w)[0] == "inplace"
    (ip,) = plan.inplace
    assert (ip.role, ip.name, ip.how, ip.reason) == ("param", "w", "inplace", None)
    assert all(b.value is not new_w for b in plan.buffers)  # no arena bytes for the new value
    # the sub reads w at the very element it writes: legal at the writing step itself
    assert ip.written_at == plan.steps.index("nova.sub") + 1
    w0, x0 = torch.randn(16, 16), torch.randn(16, 16)
    _, after = run_in_arena(fn, plan, [w0, x0])
    torch.testing.assert_close(after[0], w0 - x0 * 0.1, rtol=0, atol=1e-6)


@pytest.mark.parametrize("matmul", [False, True])
def test_an_update_before_a_later_read_of_the_old_value_is_copied_back(matmul):
    module, fn, new_w = _sgd(read_after=not matmul, matmul=matmul)
    plan = _check(module, [torch.randn(16, 16), torch.randn(16, 16)])
    assert _result_storage(fn)[1] == "copy" and _storage(new_w)[0] == "arena"
    (ip,) = plan.inplace
    assert ip.how == "copy" and "the old value is still read after the new one is written" in ip.reason
    assert "nova.matmul (step" in ip.reason  # the op that reads the old value (through a view without matmul)
    # the copy's source lives in the arena until the return, where it is copied into w
    (buf,) = [b for b in plan.buffers if b.value is new_w]
    assert buf.end == len(plan.steps) + 1


def test_views_share_their_source_and_extend_its_life():
    module, fn, b = _step(Slot("batch", "x", tensor([8, 32], f32)))
    x = fn.body.block.args[0]
    y = b.one(nv.ExpOp, [x])
    t = b.transpose(y, [1, 0])  # view
    s = b.one(nv.SliceOp, [y], {"dim": 1, "start": 0, "end": 32, "step": 2})  # view
    r = b.reshape(y, [256])  # contiguous source: a view
    rt = b.reshape(t, [256])  # transposed source: the backend copies
    bc = b.broadcast_to(b.reshape(y, [1, 8, 32]), [4, 8, 32])  # views of a view
    z = b.one(nv.TanhOp, [y])
    total = b.add(b.reduce_sum(z, [0, 1]), b.reduce_sum(t, [0, 1]))
    total = b.add(total, b.add(b.reduce_sum(s, [0, 1]), b.reduce_sum(r, [0])))
    total = b.add(total, b.add(b.reduce_sum(rt, [0]), b.reduce_sum(bc, [0, 1, 2])))
    set_results(fn, [("loss", "loss", total)])
    plan = _check(module, [torch.randn(8, 32)])
    assert [_storage(v)[0] for v in (t, s, r, bc)] == ["view"] * 4 and _storage(rt)[0] == "arena"
    (yb,) = [b_ for b_ in plan.buffers if b_.value is y]
    steps = pm.launch_order(fn)
    last_reader = list(bc.uses)[0].operation  # the last op of the step to read y's bytes, through two views
    assert yb.end == [st.op for st in steps].index(last_reader) + 1
    assert _root(bc) is y and _root(s) is y


def test_offsets_are_aligned_and_tiny_values_take_one_granule():
    module, fn, b = _step(Slot("batch", "x", tensor([3], f32)), Slot("hyper", "lr", tensor([], f32)))
    x, lr = fn.body.block.args
    y = b.mul(x, b.broadcast_to(lr, [3]))
    z = b.add(y, b.full(1.0, (), f32))  # 0-d full: a constant, no arena bytes
    set_results(fn, [("loss", "loss", b.reduce_sum(b.mul(z, y), [0]))])
    plan = _check(module, [torch.randn(3), torch.tensor(0.5)])
    assert {b_.size for b_ in plan.buffers} == {ALIGN}
    assert all(b_.offset % ALIGN == 0 for b_ in plan.buffers)
    assert _storage(lr)[0] == "input" and _storage(z.owner.operands[1])[0] == "const"
    assert plan.external["constants"] == 512


def test_a_matmul_with_its_epilogue_is_one_kernel_as_in_the_backend():
    """After the fuse stage a matmul's bias add is inside its nova.fused group: one
    step of the launch order writes the add's result; the matmul's own result has
    no buffer (it lives in registers)."""
    from nova.transforms.fuse import fuse

    # f32: a bf16 matmul's widening cast (and the chain after it) would be the sum's prologue instead
    module, fn, b = _step(Slot("batch", "x", tensor([4, 8], f32)), Slot("param", "w", tensor([8, 16], f32)),
                          Slot("param", "bias", tensor([16], f32)))
    x, w, bias = fn.body.block.args
    y = b.add(b.matmul(x, w), bias)
    set_results(fn, [("loss", "loss", b.reduce_sum(b.mul(y, y), [0, 1]))])
    (group,) = [op for op in fuse(module) if op.contraction() is not None]
    plan = _check(module, [torch.randn(4, 8), torch.randn(8, 16), torch.randn(16)])
    assert [st.op for st in pm.launch_order(fn)][0] is group and _storage(group.results[0])[0] == "arena"
    assert plan.steps == ["nova.fused", "nova.reduce_sum"]  # y * y joined too: one buffer, the group's result
    assert [b_.value for b_ in plan.buffers if b_.what.startswith("nova.fused")] == [group.results[0]]


@pytest.mark.parametrize("over", ["epilogue operand", "matmul operand"])
def test_an_epilogue_writes_over_its_own_operand_only_element_for_element(over):
    """p - x @ w as a param's update: written in place over p, which the epilogue
    reads at the tile's elements; a param that is the matmul's own operand (every
    tile of its rows reads it) is never written over while the matmul runs."""
    from nova.transforms.fuse import fuse

    module, fn, b = _step(Slot("param", "p", tensor([8, 8], bf16)), Slot("param", "w", tensor([8, 8], bf16)))
    p, w = fn.body.block.args
    new = b.sub(p, b.matmul(p if over == "matmul operand" else w, w))
    set_results(fn, [("param", "p", new)])
    (group,) = fuse(module)
    assert group.contraction() is not None
    plan = _check(module, [torch.randn(8, 8).bfloat16(), torch.randn(8, 8).bfloat16()])
    (ip,) = plan.inplace
    assert ip.how == ("inplace" if over == "epilogue operand" else "copy")


# ---------------------------------------------------------------------------
# real steps


@pytest.fixture(scope="module", params=["fp32", "bf16", "grads-only"])
def gpt_step(request):
    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_layer=1, block_size=16))
    opt = None if request.param == "grads-only" else torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, 17))
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    precision = "fp32" if request.param == "grads-only" else request.param
    c = pipeline.run(pipeline.Compilation(model, batch, opt, precision, torch.float32))
    return request.param, c




def test_the_plan_of_a_gpt_step(gpt_step):
    kind, c = gpt_step
    from nova.ir.module import step_func

    fn = step_func(c.module)
    plan = c.memory
    assert plan is not None and plan.placements
    check_no_overlap(plan)
    replay_backend_schedule(fn)
    args = step_args(c)
    before, _ = run_in_arena(fn, plan, args, arena=False)
    outs, after = run_in_arena(fn, plan, args)
    for x, y in zip(before, outs, strict=True):
        assert torch.equal(x, y)
    for s, a in zip(arg_slots(fn), after, strict=True):  # every in-place argument holds its new value
        ks = [k for k, r in enumerate(result_slots(fn)) if (r.role, r.name) == (s.role, s.name)]
        if ks:
            assert torch.equal(a, before[ks[0]]) and s.role in ("param", "state", "guard")
    recorded = c.module.attributes["nova.memory_plan"].data
    assert recorded["arena_bytes"].value.data == plan.arena_bytes and recorded["peak_bytes"].value.data == plan.peak_bytes
    # the reuse is real: the arena is well below the sum of sizes and close to the live-set bound
    # (the fuse stage's groups, matmul epilogues among them, leave few short-lived buffers to
    # reuse: the fp32 step's arena is 0.54 of the sum, at the bound itself)
    assert plan.arena_bytes < 0.6 * plan.sum_bytes and plan.arena_bytes <= 1.2 * plan.lower_bound_bytes
    params = sum(-(-_bytes(a) // 512) * 512 for a, s in zip(fn.body.block.args, arg_slots(fn)) if s.role == "param")
    assert plan.external["params"] == params
    if kind == "grads-only":
        assert plan.external["outputs"] >= params
        for r, v, how in zip(result_slots(fn), return_op(fn).operands, _result_storage(fn), strict=True):
            if r.role == "guard":
                continue  # the guard's memory of failures: updated in place (test_guard)
            # a weight's gradient is a transpose of a matmul: the runtime copies it out
            # at the return, so its source stays in the arena until then
            assert how == ("copy" if _storage(v)[0] == "view" else "output")
            if how == "copy":
                (src,) = [b for b in plan.buffers if b.value is _root(v)]
                assert src.end == len(plan.steps) + 1
    else:
        hows = {ip.how for ip in plan.inplace}
        assert hows == {"inplace"}, [ip for ip in plan.inplace if ip.how != "inplace"]
        assert plan.peak_bytes >= plan.arena_bytes + params + plan.external["state"]
    if kind == "bf16":  # the weights' bf16 copies are buffers like any other
        casts = [b for b in plan.buffers if b.what == "nova.cast" and "bf16" in str(b.value.type)
                 and not isinstance(b.value.owner.operands[0].owner, nv.NovaOp)]
        assert casts


def test_the_plan_is_small_work():
    # GPT-2 124M's step has ~5k ops; a plan over 20k random intervals stays well under a second
    import time

    rnd = random.Random(1)
    n = 20000
    starts = [rnd.randrange(n) for _ in range(n)]
    ends = [s + min(rnd.expovariate(1 / 30), n) for s in starts]
    sizes = [ALIGN * rnd.randint(1, 64) for _ in range(n)]
    ends = [int(e) for e in ends]
    t = time.perf_counter()
    offs = pm.assign_offsets(sizes, starts, ends)
    assert time.perf_counter() - t < 5
    # a sweep over time: each interval is disjoint from every interval live when it starts
    active: list[int] = []
    for i in sorted(range(n), key=lambda i: starts[i]):
        active = [j for j in active if ends[j] >= starts[i]]
        for j in active:
            assert offs[i] + sizes[i] <= offs[j] or offs[j] + sizes[j] <= offs[i]
        active.append(i)


def test_the_predicted_peak_is_the_arena_and_what_lives_outside_it():
    module, fn, _ = _sgd(read_after=False)
    plan = pm.plan_memory(module)
    # w (1 KiB, updated in place) and the caller's x (1 KiB) outside; the loss (4 B) a
    # 512 B block of its own; the 0-d constant 0.1 in the constant pool; the arena
    assert plan.external == {"params": 1024, "state": 0, "buffers": 0, "inputs": 1024, "outputs": 512,
                             "constants": 512}
    assert plan.peak_bytes == -(-plan.arena_bytes // 512) * 512 + 1024 + 1024 + 512 + 512


def test_explain_shows_the_plan_and_draws_the_timeline(tmp_path):
    import matplotlib.image

    import nova

    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_layer=1, block_size=8))
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ids = torch.randint(0, 256, (2, 9))
    step(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    text = step.explain(plots=tmp_path / "p")
    plan = step._last.compilation.memory
    assert f"// predicted peak {pm.gib(plan.peak_bytes)} = arena {pm.gib(plan.arena_bytes)}" in text
    assert f"// largest live set at step {plan.peak_time} of {len(plan.steps)}: {plan.peak_what} " in text
    biggest = max(plan.buffers, key=lambda b: b.size)
    assert f"offset {biggest.offset:>12}  steps {biggest.start}-{biggest.end}" in text
    png = tmp_path / "p" / "memory_timeline.png"
    img = matplotlib.image.imread(str(png))
    assert png.stat().st_size > 10_000 and img.shape[:2] == (450, 1000) and img[..., :3].std() > 0.05


def test_planned_scratch_is_a_buffer_live_only_during_its_launch():
    module, fn, b = _step(Slot("batch", "x", tensor([64, 64], f32)))
    x = fn.body.block.args[0]
    a = b.one(nv.ExpOp, [x])
    c = b.one(nv.ExpOp, [a])
    d = b.one(nv.ExpOp, [c])
    set_results(fn, [("loss", "loss", b.reduce_sum(d, [0, 1]))])
    without = pm.plan_memory(module.clone())
    op_c = c.owner
    plan = pm.plan_memory(module, {op_c: 1000})
    off, size = plan.scratch_at[op_c]
    assert size == 1024  # aligned
    t = plan.steps.index("nova.exp", 1) + 1  # c's launch
    live = [bf for bf in plan.buffers if bf.start <= t <= bf.end and not bf.what.endswith("scratch")]
    for bf in live:  # never overlaps what is live while it is
        assert off + size <= bf.offset or bf.offset + bf.size <= off, bf.what
    assert plan.arena_bytes == without.arena_bytes + 1024  # here the launch's live set is the largest
    assert plan.lower_bound_bytes == without.lower_bound_bytes + 1024
