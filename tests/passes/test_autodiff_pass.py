"""The autodiff pass, IR in and IR out: which backward ops appear, which
results the step returns afterwards, round trips and errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from xdsl.dialects.builtin import f32, f64, i64

from nova.autodiff import VJP_RULES, AutodiffPass, append_backward
from nova.backends.reference import run_function
from nova.errors import AutodiffError
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, context, new_step, parse_module, print_module, returned, set_results, step_func
from nova.ir.types import tensor


def T(*shape, e=f64):
    return tensor(shape, e)


def _step(slots):
    module, fn = new_step(slots)
    return module, fn, OpBuilder(fn.body.block), fn.body.block.args


def _result_names(fn):
    return [(role, name) for role, name, _ in returned(fn)]


def _autograd(module, args, params: dict[str, int]):
    """torch.autograd through the reference executor's forward ops (run before the pass)."""
    xs = [a.clone().requires_grad_(i in params.values()) for i, a in enumerate(args)]
    (loss, *_) = run_function(step_func(module), xs)
    grads = torch.autograd.grad(loss, [xs[i] for i in params.values()], allow_unused=True)
    return {n: g for n, g in zip(params, grads) if g is not None}


def _mlp(loc: str | None = None):
    """x @ w1 + b1 -> layer_norm -> gelu -> @ w2 -> cross_entropy, plus an unused parameter."""
    N, C, H, V = 4, 6, 8, 5
    module, fn, b, (x, tgt, w1, b1, lw, lb, w2, unused) = _step([
        Slot("batch", "x", T(N, C)), Slot("batch", "target", T(N, e=i64)),
        Slot("param", "w1", T(C, H)), Slot("param", "b1", T(H)),
        Slot("param", "ln.weight", T(H)), Slot("param", "ln.bias", T(H)),
        Slot("param", "w2", T(H, V)), Slot("param", "unused", T(3)),
    ])  # fmt: skip
    b.location = loc
    h = b.add(b.matmul(x, w1), b1)
    h = b.create(nv.LayerNormOp, [h, lw, lb], {"eps": 1e-5}).results[0]
    h = b.one(nv.GeluOp, [h], {"approximate": "tanh"})
    loss = b.one(nv.CrossEntropyOp, [b.matmul(h, w2), tgt], {"ignore_index": -100, "reduction": "mean"})
    set_results(fn, [("loss", "loss", loss)])
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(N, C, generator=g, dtype=torch.float64), torch.tensor([0, 4, -100, 2]),
            *(torch.randn(s, generator=g, dtype=torch.float64) for s in [(C, H), (H,), (H,), (H,), (H, V), (3,)])]  # fmt: skip
    params = {n: i for i, n in enumerate(["x", "target", "w1", "b1", "ln.weight", "ln.bias", "w2", "unused"]) if i >= 2}
    return module, fn, args, params


def test_mlp_backward_ops_results_and_numerics():
    module, fn, args, params = _mlp()
    expected = _autograd(module.clone(), args, params)
    append_backward(module)
    module.verify()
    text = print_module(module)
    for name in ["nova.cross_entropy_backward", "nova.gelu_backward", "nova.layer_norm_backward", "nova.transpose"]:
        assert f'"{name}"' in text, name
    # the bias was broadcast over rows: its gradient is summed back
    assert text.count('"nova.reduce_sum"') >= 1
    # the loss, then one gradient per parameter in argument order; "unused" gets none
    assert _result_names(fn) == [("loss", "loss")] + [("grad", n) for n in ["w1", "b1", "ln.weight", "ln.bias", "w2"]]
    outs = run_function(fn, args)
    for (role, name, _), t in zip(returned(fn)[1:], outs[1:]):
        torch.testing.assert_close(t, expected[name], rtol=1e-10, atol=1e-12)
    assert set(expected) == {"w1", "b1", "ln.weight", "ln.bias", "w2"}


def test_printed_ir_round_trips_and_verifies():
    module, fn, args, _ = _mlp(loc="model.py:7")
    AutodiffPass().apply(context(), module)
    text = print_module(module)
    again = parse_module(text)
    again.verify()
    assert print_module(again) == text
    outs = run_function(step_func(again), args)
    for a, b in zip(outs, run_function(fn, args)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_backward_ops_carry_the_forward_location():
    module, fn, _, _ = _mlp(loc="model.py:7")
    append_backward(module)
    bwd = [op for op in fn.body.block.ops if op.name.endswith("_backward")]
    assert bwd and all(op.attributes["nova.loc"].data == "model.py:7" for op in bwd)


def test_missing_rule_names_the_op_and_its_location(monkeypatch):
    module, fn, b, (x, w) = _step([Slot("batch", "x", T(2, 3)), Slot("param", "w", T(3, 3))])
    b.location = "model.py:42"
    h = b.one(nv.TanhOp, [b.matmul(x, w)])
    b.location = None
    set_results(fn, [("loss", "loss", b.reduce_sum(h, (0, 1)))])
    monkeypatch.delitem(VJP_RULES, nv.TanhOp)
    with pytest.raises(AutodiffError, match=r"no VJP rule for nova\.tanh at model\.py:42"):
        append_backward(module)


def test_missing_rule_off_the_gradient_path_is_fine(monkeypatch):
    # ops that only touch batch data are never differentiated, so need no rule
    module, fn, b, (x, w) = _step([Slot("batch", "x", T(2, 3)), Slot("param", "w", T(3, 3))])
    xt = b.one(nv.TanhOp, [x])
    set_results(fn, [("loss", "loss", b.reduce_sum(b.matmul(xt, w), (0, 1)))])
    monkeypatch.delitem(VJP_RULES, nv.TanhOp)
    append_backward(module)
    module.verify()
    assert _result_names(fn) == [("loss", "loss"), ("grad", "w")]
    assert '"nova.tanh"' in print_module(module)


def test_unused_and_comparison_only_params_get_no_gradient():
    module, fn, b, (x, w, unused, gate) = _step([
        Slot("batch", "x", T(2, 3)), Slot("param", "w", T(3)),
        Slot("param", "unused", T(3)), Slot("param", "gate", T(3)),
    ])  # fmt: skip
    # gate only decides where: like torch, comparisons carry no gradient
    h = b.where(b.one(nv.GtOp, [gate, b.scalar(0.0, gate)]), b.mul(x, w), x)
    set_results(fn, [("loss", "loss", b.reduce_sum(h, (0, 1)))])
    append_backward(module)
    module.verify()
    assert _result_names(fn) == [("loss", "loss"), ("grad", "w")]


def test_loss_independent_of_params_gives_no_gradients():
    module, fn, b, (x, w) = _step([Slot("batch", "x", T(2, 3)), Slot("param", "w", T(3))])
    set_results(fn, [("loss", "loss", b.reduce_sum(x, (0, 1)))])
    append_backward(module)
    module.verify()
    assert _result_names(fn) == [("loss", "loss")]
    assert [op.name for op in fn.body.block.ops] == ["nova.reduce_sum", "func.return"]


def test_tied_embedding_accumulates_both_uses():
    V, D, N = 7, 4, 5
    module, fn, b, (ids, tgt, emb) = _step([
        Slot("batch", "ids", T(N, e=i64)), Slot("batch", "target", T(N, e=i64)), Slot("param", "wte", T(V, D)),
    ])  # fmt: skip
    h = b.one(nv.EmbeddingOp, [emb, ids])  # [N, D]
    logits = b.matmul(h, b.transpose(emb, (1, 0)))  # the head reuses the embedding table
    loss = b.one(nv.CrossEntropyOp, [logits, tgt], {"ignore_index": -100, "reduction": "sum"})
    set_results(fn, [("loss", "loss", loss)])
    append_backward(module)
    module.verify()
    assert _result_names(fn) == [("loss", "loss"), ("grad", "wte")]
    grad = returned(fn)[1][2]
    # the gradient is the sum of the two contributions
    assert grad.owner.name == "nova.add"
    producers = {o.owner.name for o in grad.owner.operands}
    assert producers == {"nova.embedding_backward", "nova.transpose"}

    ids_v = torch.tensor([1, 3, 1, 6, 1])  # repeated ids accumulate too
    tgt_v = torch.tensor([2, 0, 5, 5, 1])
    w = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    ref = F.cross_entropy(F.embedding(ids_v, w) @ w.T, tgt_v, reduction="sum")
    (expected,) = torch.autograd.grad(ref, [w])
    loss_v, g = run_function(fn, [ids_v, tgt_v, w.detach()])
    torch.testing.assert_close(loss_v, ref.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(g, expected, rtol=1e-10, atol=1e-12)


def test_value_used_twice_accumulates_with_add():
    module, fn, b, (w,) = _step([Slot("param", "w", T(3))])
    # w feeds two different ops (mul(w, w) alone is a square, whose rule returns one cotangent)
    set_results(fn, [("loss", "loss", b.reduce_sum(b.mul(w, b.one(nv.ExpOp, [w])), (0,)))])
    append_backward(module)
    text = print_module(module)
    assert '"nova.add"' in text
    wv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    torch.testing.assert_close(run_function(fn, [wv])[1], torch.exp(wv) * (1 + wv))


def test_attention_block_backward():
    # a causal self-attention block: layer_norm, qkv projection, heads via
    # slice/reshape/transpose, attention, output projection, residual
    B, Tt, C, Hh = 2, 4, 6, 2
    D = C // Hh
    module, fn, b, (x, wqkv, wo, lw, lb) = _step([
        Slot("batch", "x", T(B, Tt, C)), Slot("param", "wqkv", T(C, 3 * C)), Slot("param", "wo", T(C, C)),
        Slot("param", "ln.w", T(C)), Slot("param", "ln.b", T(C)),
    ])  # fmt: skip
    h = b.create(nv.LayerNormOp, [x, lw, lb], {"eps": 1e-5}).results[0]
    qkv = b.matmul(h, wqkv)  # [B, T, 3C] with a 2-D weight: batch broadcast

    def head(i):
        s = b.one(nv.SliceOp, [qkv], {"dim": 2, "start": i * C, "end": (i + 1) * C, "step": 1})
        return b.transpose(b.reshape(s, (B, Tt, Hh, D)), (0, 2, 1, 3))

    att = b.create(nv.AttentionOp, [head(0), head(1), head(2)], {"causal": True, "scale": D**-0.5}).results[0]
    y = b.reshape(b.transpose(att, (0, 2, 1, 3)), (B, Tt, C))
    out = b.add(x, b.matmul(y, wo))
    set_results(fn, [("loss", "loss", b.reduce_sum(b.mul(out, out), (0, 1, 2)))])
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(s, generator=g, dtype=torch.float64) for s in [(B, Tt, C), (C, 3 * C), (C, C), (C,), (C,)]]
    params = {"wqkv": 1, "wo": 2, "ln.w": 3, "ln.b": 4}
    expected = _autograd(module.clone(), args, params)
    append_backward(module)
    module.verify()
    text = print_module(module)
    for name in ["nova.attention_backward", "nova.pad", "nova.layer_norm_backward"]:
        assert f'"{name}"' in text, name
    outs = run_function(fn, args)
    for (_, name, _), t in zip(returned(fn)[1:], outs[1:]):
        torch.testing.assert_close(t, expected[name], rtol=1e-10, atol=1e-12)
    # the three slices of qkv accumulate into one gradient
    assert text.count('"nova.pad"') == 3


@pytest.mark.parametrize(
    "loss_type,match",
    [(T(3), "0-d float"), (T(e=i64), "0-d float")],
)
def test_loss_must_be_a_0d_float(loss_type, match):
    module, fn, b, (x,) = _step([Slot("param", "x", loss_type)])
    set_results(fn, [("loss", "loss", x)])
    with pytest.raises(AutodiffError, match=match):
        append_backward(module)


def test_exactly_one_loss_and_only_once():
    module, fn, b, (x,) = _step([Slot("param", "x", T())])
    set_results(fn, [])
    with pytest.raises(AutodiffError, match="exactly one result with role 'loss'"):
        append_backward(module)
    set_results(fn, [("loss", "loss", b.mul(x, x))])
    append_backward(module)
    with pytest.raises(AutodiffError, match="already returns gradients"):
        append_backward(module)


def test_f32_step_seeds_an_f32_cotangent():
    module, fn, b, (w,) = _step([Slot("param", "w", T(3, e=f32))])
    set_results(fn, [("loss", "loss", b.reduce_sum(b.one(nv.ExpOp, [w]), (0,)))])
    append_backward(module)
    module.verify()
    (_, _, grad) = returned(fn)[1]
    assert grad.type == T(3, e=f32)
    wv = torch.tensor([0.5, -1.0, 2.0])
    torch.testing.assert_close(run_function(fn, [wv])[1], wv.exp())
