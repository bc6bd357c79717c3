"""The fused LM head + loss lowering (nova/codegen/triton/linear_ce.py) against the
reference executor's chunked implementation: forward and backward, several
chunks with a partial last one, a row loop over the vocabulary in several column
blocks, ignore_index, label smoothing, bias, a batch of padding, bf16."""

from __future__ import annotations

import pytest
import torch
from xdsl.dialects.builtin import bf16, f32, i64

from nova.backends.reference import IMPLS
from nova.codegen.triton.linear_ce import lower_linear_cross_entropy, lower_linear_cross_entropy_backward
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step
from nova.ir.types import tensor

N, D, V = 7, 16, 37


def _ops(elem, bias_elem, props, loss_elem):
    slots = [Slot("batch", "g", tensor([], loss_elem)), Slot("param", "h", tensor([N, D], elem)),
             Slot("param", "w", tensor([V, D], elem)), Slot("batch", "t", tensor([N], i64))]
    if bias_elem is not None:
        slots.append(Slot("param", "b", tensor([V], bias_elem)))
    _, fn = new_step(slots)
    b = OpBuilder(fn.body.block)
    g, *xs = fn.body.block.args
    fwd = b.create(nv.LinearCrossEntropyOp, xs, props, tensor([], loss_elem))
    bwd = b.create(nv.LinearCrossEntropyBackwardOp, [g, *xs], props)
    return fwd, bwd


CASES = [  # (id, head dtype, bias dtype, props, targets)
    ("mean", f32, None, {"reduction": "mean"}, None),
    ("sum-bias-smoothing", f32, f32, {"reduction": "sum", "label_smoothing": 0.1}, None),
    ("mean-ignore-class3", f32, f32, {"reduction": "mean", "ignore_index": 3}, None),
    ("all-ignored", f32, f32, {"reduction": "mean"}, torch.full((N,), -100)),
    ("bf16", bf16, None, {"reduction": "mean"}, None),
    ("bf16-f32-bias", bf16, f32, {"reduction": "mean", "label_smoothing": 0.1}, None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_linear_cross_entropy_matches_reference(device, case):
    _, elem, bias_elem, props, targets = case
    props = {"ignore_index": -100, "chunk": 3, **props}
    fwd, bwd = _ops(elem, bias_elem, props, f32)
    dt = torch.bfloat16 if elem == bf16 else torch.float32
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=gen).to(dt)
    w = (torch.randn(V, D, generator=gen) * 0.5).to(dt)
    t = torch.randint(0, V, (N,), generator=gen) if targets is None else targets
    if targets is None:
        t[2] = props["ignore_index"]
    bias = [torch.randn(V, generator=gen)] if bias_elem is not None else []
    g = torch.tensor(1.7)
    xs = [h, w, t, *bias]
    want = IMPLS[nv.LinearCrossEntropyOp](fwd, xs)[0]
    want_grads = IMPLS[nv.LinearCrossEntropyBackwardOp](bwd, [g, *xs])
    dev = [x.to(device) for x in xs]
    got = lower_linear_cross_entropy(fwd, None, max_block=16).launch(dev)[0]  # V = 37: three column blocks
    got_grads = lower_linear_cross_entropy_backward(bwd, None, max_block=16).launch([g.to(device), *dev])
    tol = dict(rtol=2e-2, atol=2e-2) if dt == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.cpu(), want, equal_nan=True, **tol)
    if targets is not None:
        assert torch.isnan(got).item()
    assert len(got_grads) == len(want_grads) == 2 + len(bias)
    for name, a, b in zip(("dh", "dw", "dbias"), got_grads, want_grads):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.cpu(), b, msg=name, **tol)
        if targets is not None:
            assert not a.any(), name  # a batch of padding: gradients 0


def test_out_of_range_targets_are_masked(device):
    """Ids past either end of the vocabulary (some far enough to fault if read)
    raise nothing in the launch and address no memory; as in the reference, the
    loss is NaN and the gradients finite (a bad row: the plain softmax)."""
    props = {"ignore_index": -100, "reduction": "mean", "chunk": 3}
    fwd, bwd = _ops(f32, f32, props, f32)
    gen = torch.Generator().manual_seed(1)
    h, w, bias = torch.randn(N, D, generator=gen), torch.randn(V, D, generator=gen), torch.randn(V, generator=gen)
    t = torch.randint(0, V, (N,), generator=gen)
    t[[1, 3, 4, 6]] = torch.tensor([V, -1, 2**40, -(2**40)])
    g = torch.tensor(1.3)
    xs = [h, w, t, bias]
    dev = [x.to(device) for x in xs]
    (loss,) = lower_linear_cross_entropy(fwd, None, max_block=16).launch(dev)
    assert torch.isnan(loss).item()
    got = lower_linear_cross_entropy_backward(bwd, None, max_block=16).launch([g.to(device), *dev])
    want = IMPLS[nv.LinearCrossEntropyBackwardOp](bwd, [g, *xs])
    for name, a, b in zip(("dh", "dw", "dbias"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.cpu(), b, msg=name, rtol=1e-5, atol=1e-6)
