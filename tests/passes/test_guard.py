"""guard: device-side counts of bad ids (and non-finite values), the gate on every
param/state result, the status results, the sticky guard::failed / guard::skipped
memory; plan_memory still updates in place."""

from __future__ import annotations

import pytest
import torch
from xdsl.dialects.builtin import f32, i64

from nova import pipeline
from nova.autodiff import append_backward
from nova.backends.reference import run_function
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, arg_slots, new_step, parse_module, print_module, result_slots, return_op, set_results
from nova.ir.types import tensor
from nova.models import GPT, gpt_tiny
from nova.transforms.guard import describe_bad_ids, guard
from nova.transforms.optimizer import GroupSpec, OptimizerSpec, append_optimizer
from nova.transforms.plan_memory import plan_memory

V, D, N, C = 10, 4, 6, 5


def _lm(ce_ignore: int = -100):
    """ids -> embedding [V, D] -> head [D, C] -> cross_entropy(target): loss, grads."""
    module, fn = new_step([
        Slot("param", "emb", tensor([V, D], f32)), Slot("param", "head", tensor([D, C], f32)),
        Slot("batch", "ids", tensor([N], i64)), Slot("batch", "target", tensor([N], i64)),
    ])  # fmt: skip
    b = OpBuilder(fn.body.block)
    emb, head, ids, target = fn.body.block.args
    h = b.one(nv.EmbeddingOp, [emb, ids], {"padding_idx": 0})
    logits = b.matmul(h, head)
    props = {"ignore_index": ce_ignore, "reduction": "mean", "label_smoothing": 0.0}
    set_results(fn, [("loss", "loss", b.one(nv.CrossEntropyOp, [logits, target], props))])
    append_backward(module)
    return module, fn


def _with_sgd(module, fn):
    grads = {n: v for s, v in zip(result_slots(fn), return_op(fn).operands) if s.role == "grad" for n in [s.name]}
    append_optimizer(module, OptimizerSpec((GroupSpec("sgd", ("emb", "head"), momentum=True),)))
    return grads


def _ops(fn, cls):
    return [op for op in fn.body.block.ops if isinstance(op, cls)]


def _args(fn, ids, target):
    g = torch.Generator().manual_seed(0)
    out = []
    for s in arg_slots(fn):
        if s.role == "param" or s.name.endswith("momentum_buffer"):
            out.append(torch.randn(tuple(s.type.get_shape()), generator=g))
        elif s.role == "guard":
            out.append(torch.tensor(0))
        elif s.name == "ids":
            out.append(ids)
        elif s.name == "target":
            out.append(target)
        elif s.name.endswith("momentum_buffer_fresh"):
            out.append(torch.tensor(0.0, dtype=torch.float64))
        else:  # lr, momentum, dampening, weight_decay
            out.append(torch.tensor(0.1, dtype=torch.float64))
    return out


GOOD_IDS, GOOD_TARGET = torch.tensor([0, 1, 9, 3, 0, 5]), torch.tensor([0, 4, -100, 2, 1, 3])


def test_counts_gate_and_status_results():
    module, fn = _lm()
    grads = _with_sgd(module, fn)
    unguarded = module.clone()
    guard(module, grads=grads)
    module.verify()
    text = print_module(module)
    assert print_module(parse_module(text)) == text
    emb_check, ce_check = _ops(fn, nv.CountOutOfRangeOp)
    assert emb_check.operands[0] is fn.body.block.args[2] and emb_check.props() == {"low": 0, "high": V, "ignore": None}
    assert ce_check.operands[0] is fn.body.block.args[3] and ce_check.props() == {"low": 0, "high": C, "ignore": -100}
    assert emb_check.attributes["nova.checked"].data == "nova.embedding"
    assert _ops(fn, nv.CountNonfiniteOp) == []  # only with skip_nonfinite
    slots = result_slots(fn)
    assert [(s.role, s.name) for s in slots] == [
        ("loss", "loss"), ("param", "emb"), ("state", "emb::momentum_buffer"), ("param", "head"),
        ("state", "head::momentum_buffer"), ("status", "bad_ids"), ("guard", "guard::failed"),
    ]  # fmt: skip
    args = {(s.role, s.name): a for s, a in zip(arg_slots(fn), fn.body.block.args)}
    for s, v in zip(slots, return_op(fn).operands):
        if s.role in ("param", "state"):  # where(ok, new, old)
            assert isinstance(v.owner, nv.WhereOp) and v.owner.operands[2] is args[(s.role, s.name)]
    # a good step computes what the unguarded step computes, bit for bit
    values = _args(fn, GOOD_IDS, GOOD_TARGET)
    got = run_function(fn, values)
    assert [s.role for s in arg_slots(fn)][-1:] == ["guard"]  # appended: the unguarded step takes the rest
    want = run_function(next(iter(unguarded.ops)), values[:-1])
    assert all(torch.equal(x, y) for x, y in zip(got, want)) and [t.item() for t in got[-2:]] == [0, 0]


@pytest.mark.parametrize("where", ["id", "target"])
def test_a_bad_id_makes_every_param_and_state_result_its_old_value(where):
    module, fn = _lm()
    guard(module, grads=_with_sgd(module, fn))
    ids, target = GOOD_IDS.clone(), GOOD_TARGET.clone()
    if where == "id":
        ids[2], ids[4] = V, -1  # padding_idx 0 is in range; these two are not
    else:
        target[1] = C  # -100 is ignored, C is out of range
    values = _args(fn, ids, target)
    outs = run_function(fn, values)  # memory-safe: no error inside the step
    bad, failed = (t.item() for t in outs[-2:])
    assert bad == failed == (2 if where == "id" else 1)
    by_name = {s.name: a for s, a in zip(arg_slots(fn), values)}
    for s, t in zip(result_slots(fn), outs):
        if s.role in ("param", "state"):
            assert torch.equal(t, by_name[s.name]), s.name
    (msg,) = describe_bad_ids(fn, values)
    if where == "id":
        assert msg.startswith(f"nova.embedding: index out of range [0, {V}) (min -1, max {V}; 2 id(s))")
    else:
        assert msg.startswith(f"nova.cross_entropy: 1 target id(s) out of range [0, {C}) (min 0, max {C}; ignore_index -100)")


def test_skip_nonfinite_counts_the_loss_and_every_gradient():
    module, fn = _lm()
    grads = _with_sgd(module, fn)
    guard(module, skip_nonfinite=True, grads=grads)
    module.verify()
    checked = [op.operands[0] for op in _ops(fn, nv.CountNonfiniteOp)]
    assert checked == [return_op(fn).operands[0], grads["emb"], grads["head"]]
    assert [s.name for s in result_slots(fn) if s.role == "status"] == ["bad_ids", "nonfinite"]
    values = _args(fn, GOOD_IDS, GOOD_TARGET)
    head = [s.name for s in arg_slots(fn)].index("head")
    values[head][0, 0] = float("inf")  # an inf weight: inf / NaN logits, loss and gradients
    outs = run_function(fn, values)
    bad, nonfinite, failed, skipped = (t.item() for t in outs[-4:])
    assert bad == 0 and nonfinite > 0 and failed == 0 and skipped == 1  # skipped, not failed
    by_name = {s.name: a for s, a in zip(arg_slots(fn), values)}
    for s, t in zip(result_slots(fn), outs):
        if s.role in ("param", "state"):
            assert torch.equal(t, by_name[s.name]), s.name


@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_an_unread_failure_gates_every_later_step(skip_nonfinite):
    """guard::failed is sticky: a step launched after a failed one (before the host
    read it) writes nothing either, with good ids; it is not counted as skipped."""
    module, fn = _lm()
    guard(module, skip_nonfinite=skip_nonfinite, grads=_with_sgd(module, fn))
    values = _args(fn, GOOD_IDS, GOOD_TARGET)
    names = [s.name for s in arg_slots(fn)]
    values[names.index("guard::failed")] = torch.tensor(3)
    if skip_nonfinite:
        values[names.index("guard::skipped")] = torch.tensor(5)
    outs = run_function(fn, values)
    got = {s.name: t for s, t in zip(result_slots(fn), outs)}
    assert got["bad_ids"].item() == 0 and got["guard::failed"].item() == 3
    assert ("guard::skipped" in got) == skip_nonfinite and (not skip_nonfinite or got["guard::skipped"].item() == 5)
    by_name = dict(zip(names, values))
    for s, t in zip(result_slots(fn), outs):
        if s.role in ("param", "state"):
            assert torch.equal(t, by_name[s.name]), s.name


def test_without_an_optimizer_only_status_results_are_added():
    module, fn = _lm()
    guard(module, skip_nonfinite=True)  # the grads are results here
    module.verify()
    assert [s.role for s in result_slots(fn)] == ["loss", "grad", "grad", "status", "status", "guard", "guard"]
    assert len(_ops(fn, nv.CountNonfiniteOp)) == 3
    params = {a for s, a in zip(arg_slots(fn), fn.body.block.args) if s.role == "param"}
    assert not [op for op in _ops(fn, nv.WhereOp) if params & set(op.operands)]  # nothing gated


def test_nothing_to_check_is_not_gated():
    module, fn = new_step([Slot("param", "w", tensor([3], f32))])
    b = OpBuilder(fn.body.block)
    w = fn.body.block.args[0]
    set_results(fn, [("loss", "loss", b.reduce_sum(b.mul(w, w), [0]))])
    append_backward(module)
    append_optimizer(module, OptimizerSpec((GroupSpec("sgd", ("w",)),)))
    n_ops = len(list(fn.body.block.ops))
    guard(module)
    module.verify()
    assert len(list(fn.body.block.ops)) == n_ops + 1  # the constant bad_ids = 0
    (status,) = [v for s, v in zip(result_slots(fn), return_op(fn).operands) if s.role == "status"]
    assert isinstance(status.owner, nv.FullOp)
    with pytest.raises(ValueError, match="guarded already"):
        guard(module)


def test_every_gated_update_is_still_planned_in_place():
    module, fn = _lm()
    guard(module, skip_nonfinite=True, grads=_with_sgd(module, fn))
    plan = plan_memory(module)
    assert [(ip.name, ip.how) for ip in plan.inplace] == [
        ("emb", "inplace"), ("emb::momentum_buffer", "inplace"), ("head", "inplace"), ("head::momentum_buffer", "inplace"),
        ("guard::failed", "inplace"), ("guard::skipped", "inplace"),  # (skip_nonfinite: both)
    ]  # fmt: skip
    # the gate is the op that writes each argument (where reads the old value at the same index)
    for ip in plan.inplace[:4]:
        assert plan.steps[ip.written_at - 1] == "nova.where"


@pytest.mark.parametrize("skip", [False, True])
def test_the_pipeline_guards_a_gpt_step_and_plans_it_in_place(skip):
    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_layer=1, block_size=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, 17))
    c = pipeline.Compilation(model, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous()), opt, "fp32", torch.float32)
    c.skip_nonfinite = skip
    pipeline.run(c)
    fn = c.captured.fn
    checked = {op.attributes["nova.checked"].data for op in _ops(fn, nv.CountOutOfRangeOp)}
    assert checked == {"nova.embedding", "nova.linear_cross_entropy"}
    n_params = sum(1 for s in arg_slots(fn) if s.role == "param")
    assert len(_ops(fn, nv.CountNonfiniteOp)) == (1 + n_params if skip else 0)
    assert [s.name for s in result_slots(fn) if s.role == "status"] == ["bad_ids", "nonfinite"][: 1 + skip]
    assert {ip.how for ip in c.memory.inplace} == {"inplace"}
    assert [s.name for s in result_slots(fn) if s.role == "guard"] == ["guard::failed", "guard::skipped"][: 1 + skip]
    assert len(c.memory.inplace) == sum(1 for s in result_slots(fn) if s.role in ("param", "state", "guard"))
