"""The property tests find gradient bugs: realistic bugs injected into
``VJP_RULES`` one at a time (pytest's monkeypatch), each of which the
captured-programs property of test_autodiff_properties.py must catch with the
budget and the fixed examples it runs in CI (``derandomize=True``: the same
examples every run, so this is deterministic).

Each injected rule builds well-typed IR (it passes autodiff's type check and
the verifier) and is wrong only in its numbers, as a real slip in a rule
would be; the property must fail with ``GradientMismatch``, not crash.

Caught at (the example at which the captured-programs property first fails,
of its 200; "-": not within them), and whether the old property (hand-built
IR only, 11 kinds of op, 40 examples, here derandomized) catches it,
measured with ``python tests/numerics/test_autodiff_mutations.py``:

  add: broadcast sum dropped for kept size-1 dims             117   old: -
  sub: sign of the second operand's gradient flipped            5   old: caught
  div: sign of the denominator's gradient flipped               7   old: -
  maximum: ties give the whole gradient to both sides          29   old: caught
  pow: exponent gradient without log(base)                     47   old: -
  where: branches swapped                                       7   old: -
  sqrt: missing 1/2                                           162   old: -
  mul: x * x gives g * x, missing 2                            29   old: -
  abs: gradient passes at 0 (sign(0) taken as 1)               91   old: -
  relu: gradient passes at 0                                    -   old: -
  amax: ties each get the whole gradient                       11   old: -
  cumsum: reverse flag not flipped in the backward             68   old: -
  slice: step ignored in the backward                           -   old: -
  matmul: batch-broadcast gradient not summed                   -   old: caught
  gelu: approximate ignored in the backward                    89   old: caught
  layer_norm: bias gradient dropped                            91   old: caught
  attention: bias (attn_mask) gradient dropped                  -   old: -
  attention: scale ignored in the backward                    176   old: -
  embedding: padding row not zeroed                           149   old: -
  cross_entropy: label smoothing dropped in the backward      110   old: -
  cross_entropy: mean's 1/count dropped                       110   old: -

Old property: 5 of these 21 bugs; captured programs: 17 of 21 (the brief's
earlier count for the old test: 2 of 7). The four it misses within its
budget are listed in ``NOT_CAUGHT``; each has a small fixed program
(``FIXED``) that catches it, so the suite catches all 21. They need a rare
coincidence in a small random program (relu's input exactly 0 where its
gradient matters, a slice with step > 1 selecting 2+ elements, a 3-D weight
with a broadcast batch dim, an attention bias parameter whose dS is not
swamped), and the property's budget is kept to ~15 s.

The examples are fixed for a given hypothesis version; a new hypothesis can
draw others, and then a catch index moves (rerun the script and update the
table and ``NOT_CAUGHT``).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # the property module beside this one

import test_autodiff_properties as props  # noqa: E402
import torch  # noqa: E402

import nova  # noqa: E402
from nova.autodiff import VJP_RULES  # noqa: E402
from nova.autodiff import rules as R  # noqa: E402
from nova.ir import dialect as nv  # noqa: E402
from nova.ir.types import shape_of  # noqa: E402


def _shape(v):
    return shape_of(v.type)


def _sum_leading_only(b, c, shape):
    """sum_to that forgets the kept (size-1) broadcast dims: it sums the
    leading dims away but takes element 0 of the others."""
    shape = tuple(shape)
    lead = len(_shape(c)) - len(shape)
    if lead:
        c = b.reduce_sum(c, list(range(lead)), keepdim=False)
    for i, n in enumerate(shape):
        if n == 1 and _shape(c)[i] != 1:
            c = b.one(nv.SliceOp, [c], {"dim": i, "start": 0, "end": 1, "step": 1})
    return c


def _with_props(op_cls, orig, **changes):
    """The original rule, but the backward op it builds gets ``changes`` to
    its properties (the forward op's properties misread)."""

    def rule(b, op, cts):
        real = op.props
        op.props = lambda: {**real(), **changes}
        try:
            return orig(b, op, cts)
        finally:
            del op.props

    return rule


def add_broadcast_not_summed(b, op, cts):
    return [_sum_leading_only(b, cts[0], _shape(x)) for x in op.operands]


def sub_sign_flipped(b, op, cts):
    (g,) = cts
    return R._unbroadcast(b, op, [g, g])


def maximum_ties_not_halved(b, op, cts):
    (g,) = cts
    x, y = op.operands
    gx = b.where(b.one(nv.GeOp, [x, y]), g, R._zero(b, g))
    gy = b.where(b.one(nv.LeOp, [x, y]), g, R._zero(b, g))
    return R._unbroadcast(b, op, [gx, gy])


def pow_exponent_without_log(b, op, cts):
    (g,) = cts
    x, y = op.operands
    gx, _ = R._pow(b, op, cts)
    return [gx, b.sum_to(b.mul(g, op.results[0]), _shape(y))]


def where_branches_swapped(b, op, cts):
    none, gx, gy = R._where(b, op, cts)
    cond, x, y = op.operands
    if _shape(x) != _shape(y) or gx is None or gy is None:
        zero = R._zero(b, cts[0])
        return [None, b.sum_to(b.where(cond, zero, cts[0]), _shape(x)), b.sum_to(b.where(cond, cts[0], zero), _shape(y))]
    return [none, gy, gx]


def div_denominator_sign(b, op, cts):
    (g,) = cts
    x, y = op.operands
    return R._unbroadcast(b, op, [b.div(g, y), b.div(b.mul(g, op.results[0]), y)])


def sqrt_missing_half(b, op, cts):
    return [b.div(cts[0], op.results[0])]


def square_missing_two(b, op, cts):
    x, y = op.operands
    if x is y:
        return [b.mul(cts[0], x), None]
    return R._mul(b, op, cts)


def abs_gradient_at_zero(b, op, cts):
    x, g = op.operands[0], cts[0]
    return [b.where(b.one(nv.LtOp, [x, R._zero(b, x)]), b.neg(g), g)]


def relu_gradient_at_zero(b, op, cts):
    x = op.operands[0]
    return [b.where(b.one(nv.GeOp, [x, R._zero(b, x)]), cts[0], R._zero(b, x))]


def amax_ties_not_split(b, op, cts):
    x = op.operands[0]
    keep = R._keepdim_shape(op)
    is_max = b.one(nv.EqOp, [x, b.reshape(op.results[0], keep)])
    g = b.broadcast_to(b.reshape(cts[0], keep), _shape(x))
    return [b.where(is_max, g, R._zero(b, x))]


def cumsum_same_direction(b, op, cts):
    p = op.props()
    return [b.one(nv.CumsumOp, [cts[0]], {"dim": p["dim"], "reverse": p["reverse"]})]


def slice_step_ignored(b, op, cts):
    p = op.props()
    props = {"dim": p["dim"], "start": p["start"], "step": 1, "size": _shape(op.operands[0])[p["dim"]]}
    return [b.one(nv.PadOp, [cts[0]], props)]


def matmul_batch_not_summed(b, op, cts):
    (g,) = cts
    x, y = op.operands
    gx = b.matmul(g, b.swap_last(y))
    gy = b.matmul(b.swap_last(x), g)
    return [_sum_leading_only(b, gx, _shape(x)), _sum_leading_only(b, gy, _shape(y))]


def layer_norm_bias_gradient_dropped(b, op, cts):
    gx, gw, _ = R._layer_norm(b, op, cts)
    return [gx, gw, None]


def cross_entropy_mean_as_sum(b, op, cts):
    if op.props()["reduction"] != "mean":
        return R._cross_entropy(b, op, cts)
    return _with_props(nv.CrossEntropyOp, R._cross_entropy, reduction="sum")(b, op, cts)


def attention_bias_gradient_dropped(b, op, cts):
    return [*R._attention(b, op, cts)[:3], None][: len(op.operands)]


# name -> (op, the buggy rule)
MUTANTS = {
    "add: broadcast sum dropped for kept size-1 dims": (nv.AddOp, add_broadcast_not_summed),
    "sub: sign of the second operand's gradient flipped": (nv.SubOp, sub_sign_flipped),
    "div: sign of the denominator's gradient flipped": (nv.DivOp, div_denominator_sign),
    "maximum: ties give the whole gradient to both sides": (nv.MaximumOp, maximum_ties_not_halved),
    "pow: exponent gradient without log(base)": (nv.PowOp, pow_exponent_without_log),
    "where: branches swapped": (nv.WhereOp, where_branches_swapped),
    "sqrt: missing 1/2": (nv.SqrtOp, sqrt_missing_half),
    "mul: x * x gives g * x, missing 2": (nv.MulOp, square_missing_two),
    "abs: gradient passes at 0 (sign(0) taken as 1)": (nv.AbsOp, abs_gradient_at_zero),
    "relu: gradient passes at 0": (nv.ReluOp, relu_gradient_at_zero),
    "amax: ties each get the whole gradient": (nv.ReduceMaxOp, amax_ties_not_split),
    "cumsum: reverse flag not flipped in the backward": (nv.CumsumOp, cumsum_same_direction),
    "slice: step ignored in the backward": (nv.SliceOp, slice_step_ignored),
    "matmul: batch-broadcast gradient not summed": (nv.MatmulOp, matmul_batch_not_summed),
    "gelu: approximate ignored in the backward": (nv.GeluOp, _with_props(nv.GeluOp, R._gelu, approximate="none")),
    "layer_norm: bias gradient dropped": (nv.LayerNormOp, layer_norm_bias_gradient_dropped),
    "attention: bias (attn_mask) gradient dropped": (nv.AttentionOp, attention_bias_gradient_dropped),
    "attention: scale ignored in the backward": (nv.AttentionOp, _with_props(nv.AttentionOp, R._attention, scale=1.0)),
    "embedding: padding row not zeroed": (nv.EmbeddingOp, _with_props(nv.EmbeddingOp, R._embedding, padding_idx=-1)),
    "cross_entropy: label smoothing dropped in the backward": (
        nv.CrossEntropyOp, _with_props(nv.CrossEntropyOp, R._cross_entropy, label_smoothing=0.0)),
    "cross_entropy: mean's 1/count dropped": (nv.CrossEntropyOp, cross_entropy_mean_as_sum),
}  # fmt: skip


# not caught within the CI budget (see the table above); kept for the record
NOT_CAUGHT = {
    "relu: gradient passes at 0",
    "slice: step ignored in the backward",
    "matmul: batch-broadcast gradient not summed",
    "attention: bias (attn_mask) gradient dropped",
}
CAUGHT = [n for n in MUTANTS if n not in NOT_CAUGHT]


def test_mutants_replace_existing_rules():
    # a mutant of an op that has no rule (a typo'd class) would test nothing
    for name, (op, rule) in MUTANTS.items():
        assert op in VJP_RULES and VJP_RULES[op] is not rule, name
    assert NOT_CAUGHT <= set(MUTANTS) and len(CAUGHT) >= 7
    assert set(FIXED_FOR) == NOT_CAUGHT  # every bug the random programs miss has a fixed program


@pytest.mark.parametrize("name", CAUGHT)
def test_captured_property_catches_injected_bug(name, monkeypatch):
    op, rule = MUTANTS[name]
    monkeypatch.setitem(VJP_RULES, op, rule)
    with pytest.raises(props.GradientMismatch):
        props.test_captured_programs_match_torch_autograd()


# --- fixed programs for what random small programs rarely hit -----------------
#
# Each is a tiny torch module built to reach one corner the random programs
# reach by coincidence only; checked through the public path (nova.compile,
# SGD at lr 1 moves each parameter by -grad, float64) against torch.autograd.


class _Fixed(torch.nn.Module):
    def __init__(self, forward, *shapes, equal=False):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64)) for s in shapes)
        if equal:  # all parameters start equal (differences exactly 0)
            with torch.no_grad():
                for q in self.ps[1:]:
                    q.copy_(self.ps[0])
        self.fn = forward

    def forward(self, c):
        return self.fn(c, *self.ps)


FIXED = {
    # relu's input exactly 0 where the gradient matters: torch passes none there
    "relu at 0": lambda: _Fixed(lambda c, p, q: (torch.relu(p - q) * c).sum() + (p * q).sum(), (3, 4), (3, 4), equal=True),
    # slices with step > 1 selecting several elements
    "strided slices": lambda: _Fixed(lambda c, p: (p[:, ::2] * c[:, :2]).sum() + p[:, 1::3].square().sum(), (3, 4)),
    # a batched matmul whose batch dims broadcast
    "broadcast batch matmul": lambda: _Fixed(lambda c, p, q: (torch.matmul(p, q) * c.sum()).square().sum(), (2, 1, 3, 4), (3, 4, 2)),
    # an additive attention mask that depends on a parameter
    "attention bias parameter": lambda: _Fixed(
        lambda c, x, bias: torch.nn.functional.scaled_dot_product_attention(
            x, x * 0.5, x.flip(-1), attn_mask=bias * 3.0).mul(c.sum()).square().sum(), (1, 2, 4, 3), (1, 1, 4, 4)),
}  # fmt: skip
# the mutant each fixed program exists for
FIXED_FOR = {
    "relu: gradient passes at 0": "relu at 0",
    "slice: step ignored in the backward": "strided slices",
    "matmul: batch-broadcast gradient not summed": "broadcast batch matmul",
    "attention: bias (attn_mask) gradient dropped": "attention bias parameter",
}


def check_fixed(name: str) -> None:
    model = FIXED[name]()
    c = torch.linspace(-1.0, 1.5, 12, dtype=torch.float64).view(3, 4)
    model.zero_grad()
    loss = model(c)
    loss.backward()
    want = [(p - p.grad).detach() for p in model.parameters()]
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=1.0), backend="reference")
    step(c)
    for i, (p, w) in enumerate(zip(model.parameters(), want)):
        err = (p.detach() - w).abs().max().item()
        if not err <= 1e-9 * max(1.0, w.abs().max().item()):
            raise props.GradientMismatch(f"{name}: parameter {i} off by {err:.3g}")


@pytest.mark.parametrize("name", list(FIXED))
def test_fixed_programs_match_torch_autograd(name):
    check_fixed(name)


@pytest.mark.parametrize("mutant", list(FIXED_FOR))
def test_fixed_programs_catch_what_random_programs_miss(mutant, monkeypatch):
    op, rule = MUTANTS[mutant]
    monkeypatch.setitem(VJP_RULES, op, rule)
    with pytest.raises(props.GradientMismatch):
        check_fixed(FIXED_FOR[mutant])


def _first_failure(test) -> int | None:
    """The example at which ``test`` first fails, None if it passes."""
    start = props.EXAMPLES_RUN[0]
    try:
        test()
    except Exception:  # noqa: BLE001 - any failure counts for the report
        return props.EXAMPLES_RUN[0] - start - 1  # the failing example runs twice: found, then replayed
    return None


if __name__ == "__main__":  # the table in the docstring
    import logging

    logging.disable(logging.CRITICAL)
    mp = pytest.MonkeyPatch()
    old = new = 0
    for name, (op, rule) in MUTANTS.items():
        with mp.context() as m:
            m.setitem(VJP_RULES, op, rule)
            at = _first_failure(props.test_captured_programs_match_torch_autograd)
            try:
                props.test_random_programs_match_torch_autograd()
                old_caught = False
            except Exception:  # noqa: BLE001
                old_caught = True
        new += at is not None
        old += old_caught
        print(f"  {name:58s} {at if at is not None else '-':>4}   old: {'caught' if old_caught else '-'}")
    print(f"old property: {old} of {len(MUTANTS)}; captured programs: {new} of {len(MUTANTS)}")
