"""loss_grad: nova.linear_cross_entropy + nova.linear_cross_entropy_backward ->
nova.linear_cross_entropy_with_grad.

IR in, IR out: the pairs the stage must leave alone first, then the ones it
merges, each run before and after the stage on the reference executor (bit for
bit); then whole steps through ``nova.compile(..., backend="reference")`` with and
without the stage, bit for bit over several AdamW steps (tied and untied heads, a
bias, label smoothing, ignored targets, bf16, skip_nonfinite, a memory budget), and
in float64 against eager PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from xdsl.dialects.builtin import f32, f64, i64

import nova
from nova import pipeline
from nova.backends.reference import run_function
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step, parse_module, print_module, set_results, step_func
from nova.ir.types import tensor
from nova.models import GPT, MLPLM, MLPLMConfig, gpt_tiny
from nova.transforms.loss_grad import loss_grad

N, D, V = 7, 4, 5
PROPS = {"ignore_index": -100, "reduction": "mean", "label_smoothing": 0.0, "chunk": 3}


def _pair(grad="seed", bias=False, elem=f64, bwd_props=None, bwd_target=False, second=None):
    """A step holding an L and a B over the same h, w, target (and bias). ``grad``:
    "seed" (a constant after L, as autodiff's), "arg" (a block argument), "before"
    (computed before L), "scaled" (the seed scaled after L: a scaled loss's backward),
    "loss" (computed from L's loss). ``bwd_props``: B's properties if other;
    ``bwd_target``: B reads another target; ``second``: another B (its grad kind)."""
    slots = [Slot("param", "h", tensor([N, D], elem)), Slot("param", "w", tensor([V, D], elem)),
             Slot("batch", "t", tensor([N], i64)), Slot("batch", "t2", tensor([N], i64)), Slot("batch", "g", tensor([], elem))]
    slots += [Slot("param", "b", tensor([V], elem))] if bias else []
    module, fn = new_step(slots)
    b = OpBuilder(fn.body.block)
    h, w, t, t2, g_arg, *bs = fn.body.block.args
    early = b.scale(b.full(2.0, (), elem), 0.25) if grad == "before" else None
    loss = b.one(nv.LinearCrossEntropyOp, [h, w, t, *bs], PROPS, tensor([], elem))
    results = [("loss", "loss", loss)]

    def backward(kind, props, target, tag):
        g = {"seed": lambda: b.full(1.0, (), elem), "arg": lambda: g_arg, "before": lambda: early,
             "scaled": lambda: b.scale(b.full(1.0, (), elem), 2.0), "loss": lambda: b.mul(loss, loss)}[kind]()
        bwd = b.create(nv.LinearCrossEntropyBackwardOp, [g, h, w, target, *bs], props)
        results.extend((("grad", f"{n}{tag}", r) for n, r in zip(("h", "w", "b"), bwd.results)))

    backward(grad, bwd_props or PROPS, t2 if bwd_target else t, "")
    if second:
        backward(second, PROPS, t, "'")
    set_results(fn, results)
    module.verify()
    return module, fn


def _args(fn, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for a in fn.body.block.args:
        if a.type.element_type == i64:
            t = torch.randint(0, V, (N,), generator=gen)
            t[1] = PROPS["ignore_index"]
            out.append(t)
        else:
            shape = a.type.get_shape()
            out.append(torch.randn(shape, generator=gen, dtype=torch.float64).to(
                torch.float32 if a.type.element_type == f32 else torch.float64) if shape else torch.tensor(1.3, dtype=torch.float64))
    return out


def _names(fn):
    return [op.name for op in fn.body.block.ops if "linear_cross" in op.name or op.name in ("nova.full", "nova.mul")]


def _bits(x):
    return x.reshape(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _same(xs, ys):
    assert len(xs) == len(ys)
    for i, (a, b) in enumerate(zip(xs, ys)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b)), i


def _check_merge(module, fn, merges=1):
    args = _args(fn)
    before = run_function(fn, args)
    assert loss_grad(module) == merges
    module.verify()
    text = print_module(module)
    assert print_module(parse_module(text)) == text
    _same(run_function(step_func(module), args), before)
    return text


# ----------------------------------------------------------------------------
# left alone


@pytest.mark.parametrize("grad", ["scaled", "loss"])
def test_a_grad_computed_after_the_loss_leaves_the_pair_alone(grad):
    module, fn = _pair(grad)
    text = print_module(module)
    assert loss_grad(module) == 0
    assert print_module(module) == text


@pytest.mark.parametrize("case", ["props", "target"])
def test_other_properties_or_operands_leave_the_pair_alone(case):
    kw = {"bwd_props": {**PROPS, "chunk": 2}} if case == "props" else {"bwd_target": True}
    module, fn = _pair(**kw)
    text = print_module(module)
    assert loss_grad(module) == 0
    assert print_module(module) == text


def test_a_forward_without_a_backward_is_left_alone():
    module, fn = new_step([Slot("batch", "h", tensor([N, D], f64)), Slot("batch", "w", tensor([V, D], f64)),
                           Slot("batch", "t", tensor([N], i64))])  # fmt: skip
    loss = OpBuilder(fn.body.block).one(nv.LinearCrossEntropyOp, list(fn.body.block.args), PROPS, tensor([], f64))
    set_results(fn, [("loss", "loss", loss)])
    assert loss_grad(module) == 0
    assert _names(fn) == ["nova.linear_cross_entropy"]


# ----------------------------------------------------------------------------
# merged


def test_the_seed_moves_before_the_loss_and_the_pair_becomes_one_op():
    module, fn = _pair("seed")
    assert _names(fn) == ["nova.linear_cross_entropy", "nova.full", "nova.linear_cross_entropy_backward"]
    _check_merge(module, fn)
    assert _names(fn) == ["nova.full", "nova.linear_cross_entropy_with_grad"]
    (op,) = [o for o in fn.body.block.ops if isinstance(o, nv.LinearCrossEntropyWithGradOp)]
    h, w, t = list(fn.body.block.args)[:3]
    assert list(op.operands)[1:] == [h, w, t] and op.props() == PROPS
    assert op.operands[0].owner is op.prev_op  # the constant, right before it
    # L's loss and B's gradients are the merged op's results, in that order
    assert list(fn.body.block.last_op.operands) == list(op.results)


@pytest.mark.parametrize("grad", ["arg", "before"])
def test_a_grad_that_exists_before_the_loss(grad):
    module, fn = _pair(grad)
    before = [o.name for o in fn.body.block.ops]
    _check_merge(module, fn)
    after = [o.name for o in fn.body.block.ops]
    # at L's position; nothing else moves
    i = before.index("nova.linear_cross_entropy")
    assert after[i] == "nova.linear_cross_entropy_with_grad"
    assert [n for n in after if "linear" not in n] == [n for n in before if "linear" not in n]


@pytest.mark.parametrize("elem", [f64, f32], ids=["f64", "f32"])
def test_with_a_bias(elem):
    module, fn = _pair("seed", bias=True, elem=elem)
    _check_merge(module, fn)
    (op,) = [o for o in fn.body.block.ops if isinstance(o, nv.LinearCrossEntropyWithGradOp)]
    assert len(op.operands) == 5 and len(op.results) == 4


def test_of_two_backwards_the_first_whose_grad_qualifies_is_merged():
    module, fn = _pair("scaled", second="seed")  # the scaled one comes first, but its grad is computed
    _check_merge(module, fn)
    ops = [o for o in fn.body.block.ops if "linear_cross" in o.name]
    assert [o.name for o in ops] == ["nova.linear_cross_entropy_with_grad", "nova.linear_cross_entropy_backward"]
    assert ops[1].operands[0].owner.name == "nova.mul"  # the scaled seed's backward stays


def test_the_guard_checks_the_merged_ops_targets_as_the_forwards():
    from nova.transforms.guard import checked_ids

    module, fn = _pair("seed")
    (fwd,) = [o for o in fn.body.block.ops if isinstance(o, nv.LinearCrossEntropyOp)]
    want = checked_ids(fwd)
    loss_grad(module)
    (op,) = [o for o in fn.body.block.ops if isinstance(o, nv.LinearCrossEntropyWithGradOp)]
    assert checked_ids(op) == want


def test_a_data_parallel_step_merges_and_reduces_the_merged_gradient():
    """distribute runs before: its all-reduce of the head's gradient reads the merged op."""
    from nova.transforms.distribute import distribute

    torch.manual_seed(0)
    model = MLPLM(MLPLMConfig(vocab_size=37, block_size=8, n_layer=1, n_embd=12, hidden=20))
    x = torch.randint(0, 37, (3, 8))
    c = pipeline.Compilation(model, (x, x), torch.optim.AdamW(model.parameters()), "bf16", torch.float32)
    names = [n for n, _ in pipeline.STAGES]
    for name, stage in pipeline.STAGES[: names.index("loss_grad") + 1]:
        if name == "distribute":
            distribute(c.module, "ddp", 2, dict(c.grads), c.spec, bucket_bytes=700)
        else:
            stage(c)
        c.module.verify()
    block = step_func(c.module).body.block
    (op,) = [o for o in block.ops if isinstance(o, nv.LinearCrossEntropyWithGradOp)]
    assert not [o for o in block.ops if isinstance(o, (nv.LinearCrossEntropyOp, nv.LinearCrossEntropyBackwardOp))]
    readers = {u.operation for r in op.results[1:] for u in r.uses}
    reduced = [o for o in block.ops if isinstance(o, nv.AllReduceOp) and o.props()["average"]]
    # the head's gradient (through precision's cast back to f32) reaches a bucket's all-reduce
    seen, todo = set(), list(readers)
    while todo:
        o = todo.pop()
        if o in seen:
            continue
        seen.add(o)
        todo += [u.operation for r in o.results for u in r.uses if not isinstance(o, nv.AllReduceOp)]
    assert seen & set(reduced)


# ----------------------------------------------------------------------------
# whole steps: with and without the stage, bit for bit


class BiasHead(nn.Module):
    """An untied head with a bias, label smoothing and ignored targets."""

    def __init__(self, vocab=29, d=16, smoothing=0.1):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.smoothing = smoothing

    def forward(self, x, y):
        logits = self.head(self.ln(self.emb(x)))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, label_smoothing=self.smoothing)


def _model(kind):
    torch.manual_seed(0)
    if kind == "gpt":  # tied: wte is the head's weight
        return GPT(gpt_tiny(n_layer=1, block_size=16)), 256
    if kind == "gpt3":  # three layers of 64 tokens: room for a budget between the default peak and the floor
        return GPT(gpt_tiny(n_layer=3, block_size=64)), 256
    if kind == "mlp":
        return MLPLM(MLPLMConfig(vocab_size=40, block_size=16, n_layer=1, n_embd=16, hidden=32)), 40
    return BiasHead(), 29


def _batches(vocab, n=3, seed=1, shape=(2, 16)):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, vocab, shape, generator=g)
        y = torch.randint(0, vocab, shape, generator=g)
        y[0, :3] = -1  # ignored
        yield x, y


def _train(model, vocab, monkeypatch, with_stage, dtype=torch.float32, shape=(2, 16), **kw):
    stages = [s for s in pipeline.STAGES if with_stage or s[0] != "loss_grad"]
    monkeypatch.setattr(pipeline, "STAGES", stages)
    model = copy.deepcopy(model).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = nova.compile(model, opt, backend="reference", **kw)
    losses = [step(x, y) for x, y in _batches(vocab, n=3 if shape == (2, 16) else 2, shape=shape)]
    c = step._last.compilation
    ops = {o.name for o in step_func(c.module).body.block.ops}
    if kw.get("memory_budget"):
        assert c.memory.peak_bytes <= kw["memory_budget"] and any(r.rule == "budget" for r in c.remat)
    monkeypatch.undo()
    return losses, [p.detach().clone() for p in model.parameters()], ops


CASES = [("gpt", {}), ("gpt", {"precision": "bf16", "skip_nonfinite": True}), ("mlp", {}),
         ("bias", {}), ("bias", {"precision": "bf16"})]  # fmt: skip


@pytest.mark.parametrize("kind,kw", CASES, ids=[f"{k}-{'-'.join(map(str, kw.values())) or 'fp32'}" for k, kw in CASES])
def test_a_step_is_bit_identical_with_and_without_the_stage(monkeypatch, kind, kw):
    model, vocab = _model(kind)
    losses, params, ops = _train(model, vocab, monkeypatch, True, **kw)
    want_losses, want_params, plain_ops = _train(model, vocab, monkeypatch, False, **kw)
    assert "nova.linear_cross_entropy_with_grad" in ops and "nova.linear_cross_entropy_backward" not in ops
    assert "nova.linear_cross_entropy_with_grad" not in plain_ops and "nova.linear_cross_entropy_backward" in plain_ops
    _same(losses, want_losses)
    _same(params, want_params)
    assert all(torch.isfinite(x) for x in losses)


def test_a_memory_budget_step_is_the_unbudgeted_one_bit_for_bit(monkeypatch):
    """remat (after this stage) under a budget just below the default peak: budget
    recomputes, and the same bits as the step without the stage and the budget."""
    model, vocab = _model("gpt3")
    shape = (8, 64)
    x, y = next(_batches(vocab, shape=shape))
    m = copy.deepcopy(model)
    default = pipeline.run(pipeline.Compilation(m, (x, y), torch.optim.AdamW(m.parameters()), "bf16", torch.float32))
    budget = default.memory.peak_bytes - 1
    losses, params, ops = _train(model, vocab, monkeypatch, True, shape=shape, precision="bf16", memory_budget=budget)
    want_losses, want_params, _ = _train(model, vocab, monkeypatch, False, shape=shape, precision="bf16")
    assert "nova.linear_cross_entropy_with_grad" in ops
    _same(losses, want_losses)
    _same(params, want_params)


@pytest.mark.parametrize("kind", ["gpt", "bias"])
def test_float64_against_eager(kind, monkeypatch):
    model, vocab = _model(kind)
    ref = copy.deepcopy(model).double()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    losses, params, ops = _train(model, vocab, monkeypatch, True, dtype=torch.float64)
    assert "nova.linear_cross_entropy_with_grad" in ops
    for (x, y), loss in zip(_batches(vocab), losses):
        opt_ref.zero_grad(set_to_none=True)
        want = ref(x, y)
        want.backward()
        opt_ref.step()
        torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-10, atol=0)
    for p, q in zip(params, ref.parameters()):
        torch.testing.assert_close(p, q.detach(), rtol=1e-10, atol=1e-12)
