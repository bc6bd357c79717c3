"""optimizer: consumes grad results, adds hyper/state arguments, returns new params and state."""

import pytest
from xdsl.dialects.builtin import f32

from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, arg_slots, new_step, parse_module, print_module, result_slots, set_results
from nova.ir.types import tensor
from nova.transforms.optimizer import GroupSpec, OptimizerSpec, append_optimizer


def _with_grads():
    module, fn = new_step([Slot("param", "w", tensor([3], f32)), Slot("param", "unused", tensor([2], f32))])
    b = OpBuilder(fn.body.block)
    w = fn.body.block.args[0]
    set_results(fn, [("loss", "loss", b.reduce_sum(w, [0])), ("grad", "w", b.full(1.0, [3], f32))])
    return module, fn


@pytest.mark.parametrize(
    "group, state, hyper",
    [
        (GroupSpec("adamw", ("w", "unused")), ["w::step", "w::exp_avg", "w::exp_avg_sq"], 5),
        (GroupSpec("adam", ("w",), amsgrad=True), ["w::step", "w::exp_avg", "w::exp_avg_sq", "w::max_exp_avg_sq"], 5),
        (GroupSpec("sgd", ("w",), momentum=True, nesterov=True), ["w::momentum_buffer"], 5),
        (GroupSpec("sgd", ("w",)), [], 4),
    ],
)
def test_update_signature(group, state, hyper):
    module, fn = _with_grads()
    append_optimizer(module, OptimizerSpec((group,)))
    module.verify()
    args = arg_slots(fn)
    assert [s.name for s in args if s.role == "state"] == state
    assert len([s for s in args if s.role == "hyper"]) == hyper
    results = [(s.role, s.name) for s in result_slots(fn)]
    # the param without a gradient is skipped, as PyTorch skips grad None
    assert results == [("loss", "loss"), ("param", "w")] + [("state", n) for n in state]
    text = print_module(module)
    assert print_module(parse_module(text)) == text
    if group.kind != "sgd":
        assert '"nova.pow"' in text and "tensor<f64>" in text  # bias corrections in f64, like Python
