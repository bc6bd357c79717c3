"""Property: on random programs, Nova's gradients equal torch.autograd's.

Hypothesis draws small DAGs of 3-8 ops (elementwise with broadcasting,
matmul with batch broadcasting, softmax, log_softmax, layer_norm, gelu,
reshape, transpose, reduce_sum, slice) over float64 parameters that appear
as the program needs them. The loss is a random linear functional of the
values nobody else uses and of one more value, so every op is on the path to
the loss, and fan-out and accumulation are exercised.
torch.autograd differentiates the same forward program run by the reference
executor (whose torch operations define each op's meaning).
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from xdsl.dialects.builtin import f64
from xdsl.ir import SSAValue

from nova.autodiff import append_backward
from nova.backends.reference import run_function
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, add_arg, new_step, returned, set_results, step_func
from nova.ir.types import numel, shape_of, tensor

UNARY = [nv.NegOp, nv.TanhOp, nv.SigmoidOp, nv.ReluOp, nv.ExpOp]
BINARY = [nv.AddOp, nv.SubOp, nv.MulOp, nv.MaximumOp]
KINDS = ["unary", "gelu", "binary", "matmul", "softmax", "log_softmax", "layer_norm", "reshape", "transpose", "reduce_sum", "slice"]
dims = st.integers(1, 4)


class Program:
    """A step function under construction: fresh parameters are appended as arguments."""

    def __init__(self):
        self.module, self.fn = new_step([])
        self.b = OpBuilder(self.fn.body.block)
        self.args: list[Slot] = []

    def arg(self, role: str, shape) -> SSAValue:
        slot = Slot(role, f"{role}{len(self.args)}", tensor(shape, f64))
        self.args.append(slot)
        return add_arg(self.fn, slot)


def _shape(v: SSAValue) -> tuple[int, ...]:
    return shape_of(v.type)


def _broadcast_partner(draw, shape) -> tuple[int, ...]:
    """A shape that broadcasts with ``shape`` without changing the result's shape."""
    keep = draw(st.integers(0, len(shape)))  # drop leading dims
    return tuple(1 if draw(st.booleans()) else s for s in shape[len(shape) - keep :])


def _broadcasts(a, b) -> bool:
    try:
        torch.broadcast_shapes(a, b)
    except RuntimeError:
        return False
    return True


def _step(draw, p: Program, pool: list[SSAValue]) -> SSAValue:
    b = p.b
    kind = draw(st.sampled_from(KINDS))
    ranked = [v for v in pool if _shape(v)]
    x = draw(st.sampled_from(ranked or pool))
    rank = len(_shape(x))
    if kind == "gelu":
        return b.one(nv.GeluOp, [x], {"approximate": draw(st.sampled_from(["none", "tanh"]))})
    if kind == "binary":
        op = draw(st.sampled_from(BINARY))
        partners = [v for v in pool if _broadcasts(_shape(v), _shape(x))]
        if partners and draw(st.booleans()):
            y = draw(st.sampled_from(partners))
        else:
            y = p.arg("param", _broadcast_partner(draw, _shape(x)))
        return b.one(op, [x, y] if draw(st.booleans()) else [y, x])
    if kind == "matmul":
        mats = [v for v in pool if len(_shape(v)) >= 2]
        if mats and draw(st.booleans()):  # pool value on the left, weight on the right
            a = draw(st.sampled_from(mats))
            batch = _broadcast_partner(draw, _shape(a)[:-2]) if draw(st.booleans()) else ()
            return b.matmul(a, p.arg("param", (*batch, _shape(a)[-1], draw(dims))))
        if mats:  # fresh matrix on the left, possibly with its own batch dim
            rhs = draw(st.sampled_from(mats))
            batch = (draw(dims),) if len(_shape(rhs)) == 2 and draw(st.booleans()) else ()
            return b.matmul(p.arg("param", (*batch, draw(dims), _shape(rhs)[-2])), rhs)
        return b.matmul(b.reshape(x, (1, numel(_shape(x)))), p.arg("param", (numel(_shape(x)), draw(dims))))
    if kind in ("softmax", "log_softmax") and rank:
        op = nv.SoftmaxOp if kind == "softmax" else nv.LogSoftmaxOp
        return b.one(op, [x], {"dim": draw(st.integers(-rank, rank - 1))})
    if kind == "layer_norm" and rank:
        n = _shape(x)[-1]
        op = b.create(nv.LayerNormOp, [x, p.arg("param", (n,)), p.arg("param", (n,))], {"eps": 1e-5})
        return op.results[0]
    if kind == "reshape":
        s = _shape(x)
        choices = [(numel(s),), (1, numel(s))]
        if rank >= 2:
            choices.append((s[0] * s[1], *s[2:]))
        if rank:
            choices.append((*s[:-1], 1, s[-1]))
        return b.one(nv.ReshapeOp, [x], None, tensor(draw(st.sampled_from(choices)), f64))
    if kind == "transpose" and rank >= 2:
        perm = draw(st.permutations(range(rank)))
        return b.one(nv.TransposeOp, [x], {"perm": tuple(perm)})
    if kind == "reduce_sum" and rank:
        ds = draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
        return b.reduce_sum(x, sorted(ds), keepdim=draw(st.booleans()))
    if kind == "slice" and rank:
        d = draw(st.integers(0, rank - 1))
        size = _shape(x)[d]
        start = draw(st.integers(0, size - 1))
        end = draw(st.integers(start + 1, size))
        return b.one(nv.SliceOp, [x], {"dim": d, "start": start, "end": end, "step": draw(st.integers(1, 3))})
    return b.one(draw(st.sampled_from(UNARY)), [x])


@st.composite
def programs(draw):
    p = Program()
    pool = [p.arg("param", draw(st.lists(dims, min_size=1, max_size=3))) for _ in range(draw(st.integers(1, 2)))]
    for _ in range(draw(st.integers(3, 8))):
        pool.append(_step(draw, p, pool))
    # every unused value feeds the loss, so no drawn op is dead; one more value
    # that is also used elsewhere makes its cotangent a sum
    outs = [v for v in pool if not v.uses]
    extra = draw(st.sampled_from(pool))
    outs += [] if extra in outs else [extra]
    loss = None
    for v in outs:
        term = p.b.reduce_sum(p.b.mul(v, p.arg("batch", _shape(v))), range(len(_shape(v))))
        loss = term if loss is None else p.b.add(loss, term)
    set_results(p.fn, [("loss", "loss", loss)])
    return p, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs())
def test_random_programs_match_torch_autograd(program):
    p, seed = program
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(shape_of(s.type), generator=gen, dtype=torch.float64) for s in p.args]

    forward = p.module.clone()
    xs = [v.clone().requires_grad_(s.role == "param") for v, s in zip(values, p.args)]
    loss = run_function(step_func(forward), xs)[0]
    assume(torch.isfinite(loss).item())  # exp of exp of ... may overflow
    params = [(s.name, x) for s, x in zip(p.args, xs) if s.role == "param"]
    expected = torch.autograd.grad(loss, [x for _, x in params], allow_unused=True)

    append_backward(p.module)
    p.module.verify()
    outs = run_function(p.fn, values)
    got = {name: t for (role, name, _), t in zip(returned(p.fn), outs) if role == "grad"}
    torch.testing.assert_close(outs[0], loss.detach(), rtol=1e-12, atol=1e-12)
    for (name, _), e in zip(params, expected):
        if e is None:
            assert name not in got, f"{name} does not reach the loss but got a gradient"
            continue
        assert name in got, f"no gradient for {name}"
        assume(torch.isfinite(e).all().item())
        torch.testing.assert_close(got[name], e, rtol=1e-9, atol=1e-9 * max(1.0, e.abs().max().item()))
