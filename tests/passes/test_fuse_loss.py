"""fuse_loss: cross_entropy(matmul(h, transpose(w)) [+ bias]) -> linear_cross_entropy.

IR in, IR out: the cases the pattern must leave alone come first, then the
ones it fuses, each also run (before and after the pass, forward and the
backward autodiff appends) on the reference executor in float64."""

from __future__ import annotations

import pytest
import torch
from xdsl.dialects.builtin import bf16, f32, f64, i64

from nova.autodiff import append_backward
from nova.backends.reference import run_function
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step, parse_module, print_module, returned, set_results
from nova.ir.types import tensor
from nova.transforms.fuse_loss import fuse_loss

B, T, D, V = 2, 3, 4, 5
N = B * T


def _program(*, elem=f64, bias=None, reduction="mean", other_use=False, between=None, cast=False,
             transposed=True, tied=False, smoothing=0.0):
    """capture's IR of ``F.cross_entropy(lm_head(x).view(-1, V), y.view(-1))``: x [B, T, D]
    reshaped to rows, a matmul with the transposed head weight, views, the loss.
    ``bias``: "3d" (capture's linear adds it to the [B, T, V] result) or "2d";
    ``between``: an op inserted between the head and the loss; ``tied``: the input is
    the embedding of ids through the head weight."""
    slots = [Slot("param", "w", tensor([V, D] if transposed else [D, V], elem))]
    slots += [Slot("batch", "ids", tensor([B, T], i64))] if tied else [Slot("param", "x", tensor([B, T, D], elem))]
    if bias:
        slots.append(Slot("param", "b", tensor([V], f32 if cast and bias == "f32" else elem)))
    slots.append(Slot("batch", "y", tensor([B, T], i64)))
    module, fn = new_step(slots)
    b = OpBuilder(fn.body.block)
    args = dict(zip([s.name for s in slots], fn.body.block.args))
    w = args["w"]
    x = b.one(nv.EmbeddingOp, [w, args["ids"]], {"padding_idx": -1}) if tied else args["x"]
    wt = b.transpose(w, [1, 0]) if transposed else w
    z = b.reshape(b.matmul(b.reshape(x, [N, D]), wt), [B, T, V])
    if bias and bias != "f32":
        z = b.add(z, args["b"]) if bias == "3d" else b.reshape(b.add(b.reshape(z, [N, V]), args["b"]), [B, T, V])
    if cast:
        z = b.cast(z, f32)
        if bias == "f32":
            z = b.add(z, args["b"])
    if between == "scale":
        z = b.scale(z, 0.5)
    elif between == "add_full":
        z = b.add(z, b.full(1.0, [B, T, V], elem))
    elif between == "narrow":
        z = b.cast(z, bf16)
    logits = b.reshape(z, [N, V])
    props = {"ignore_index": -100, "reduction": reduction, "label_smoothing": smoothing}
    loss = b.one(nv.CrossEntropyOp, [logits, b.reshape(args["y"], [N])], props)
    if reduction == "none":
        loss = b.reduce_sum(loss, [0])
    if other_use:  # the logits are read again: they must exist
        loss = b.add(loss, b.reduce_sum(logits, [0, 1]))
    set_results(fn, [("loss", "loss", loss)])
    module.verify()
    return module, fn, slots


def _ops(module) -> list[str]:
    text = print_module(module)
    return [name for name in ('"nova.matmul"', '"nova.cross_entropy"', '"nova.linear_cross_entropy"', '"nova.transpose"')
            if name in text]


@pytest.mark.parametrize("kw", [
    dict(reduction="none"),  # one loss per row: stays unfused
    dict(other_use=True),  # the logits are read by something else
    dict(between="scale"),  # a temperature between head and loss
    dict(between="add_full"),  # an add that is not a bias over the vocabulary
    dict(elem=f32, between="narrow"),  # a narrowing cast
], ids=["reduction-none", "logits-used-twice", "scaled-logits", "full-add", "narrowing-cast"])
def test_no_match_leaves_the_ir_unchanged(kw):
    module, _, _ = _program(**kw)
    before = print_module(module)
    fuse_loss(module)
    module.verify()
    assert print_module(module) == before


def _values(slots, gen):
    out = []
    for s in slots:
        shape = tuple(s.type.get_shape())
        if s.name == "y":
            y = torch.randint(0, V, shape, generator=gen)
            y[1, 2] = -100  # one ignored position
            out.append(y)
        elif s.name == "ids":
            out.append(torch.randint(0, V, shape, generator=gen))
        else:
            out.append(torch.randn(shape, generator=gen, dtype=torch.float64))
    return out


def _run(module, fn, values):
    append_backward(module)
    module.verify()
    return dict(zip([f"{r}:{n}" for r, n, _ in returned(fn)], run_function(fn, values)))


@pytest.mark.parametrize("kw", [
    dict(),  # nova.models.GPT (bias-free head)
    dict(bias="3d", reduction="sum"),  # nn.Linear with a bias on [B, T, D]
    dict(bias="2d", smoothing=0.1),
    dict(transposed=False),  # a [D, V] weight: the fused op reads its transpose
    dict(tied=True),  # the head weight is the embedding table: both gradients add up
], ids=["gpt", "bias-3d-sum", "bias-2d-smoothing", "untransposed-weight", "tied-embedding"])
def test_head_and_loss_fuse(kw):
    ref_module, ref_fn, slots = _program(**kw)
    module, fn, _ = _program(**kw)
    fuse_loss(module, chunk=4)  # 6 rows: a full chunk and a partial one
    module.verify()
    text = print_module(module)
    assert _ops(module) == ['"nova.linear_cross_entropy"'] + (['"nova.transpose"'] if not kw.get("transposed", True) else [])
    assert "chunk = 4" in text
    assert print_module(parse_module(text)) == text
    values = _values(slots, torch.Generator().manual_seed(0))
    want, got = _run(ref_module, ref_fn, values), _run(module, fn, values)
    assert "linear_cross_entropy_backward" in print_module(module)
    assert got.keys() == want.keys() and len(got) == 3 + bool(kw.get("bias")) - bool(kw.get("tied"))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-13, msg=k)


@pytest.mark.parametrize("bias", [None, "3d", "f32"])
def test_widened_16bit_logits_fuse_with_an_f32_loss(bias):
    """transformers' ``logits.float()`` of a bf16 model: the loss (and its statistics)
    are f32, the logits' gradient is rounded to the head's type as the cast's VJP does."""
    module, fn, slots = _program(elem=bf16, cast=True, bias=bias)
    fuse_loss(module)
    module.verify()
    (op,) = [o for o in fn.body.block.ops if isinstance(o, nv.LinearCrossEntropyOp)]
    assert str(op.results[0].type) == "tensor<f32>"
    assert len(op.operands) == 3 + bool(bias)
    assert _ops(module) == ['"nova.linear_cross_entropy"']
