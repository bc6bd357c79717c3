"""The executable on the CPU (kernels in Triton's interpreter): the launch list is
bound once into the arena, parameters and optimizer state are written in place,
rebinding follows replaced state tensors, and the steps equal the reference
executor's."""

from __future__ import annotations

import copy

import pytest
import torch

import nova
from nova.models import GPT, gpt_tiny


def _model():
    torch.manual_seed(0)
    return GPT(gpt_tiny(n_layer=1, n_embd=32, n_head=2, block_size=16, vocab_size=64))


def _batches(n, B=2, T=8):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 64, (B, T), generator=g), torch.randint(0, 64, (B, T), generator=g)) for _ in range(n)]


def _sgd_pair():
    """The model on the Triton backend and a copy on the reference executor, SGD with momentum each."""
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    return (model, opt, nova.compile(model, opt, backend="triton"), ref, opt_ref,
            nova.compile(ref, opt_ref, backend="reference"))  # fmt: skip


def test_parameters_and_state_are_written_in_place_and_the_list_is_bound_once():
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = nova.compile(model, opt, backend="triton")
    oracle = nova.compile(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), backend="reference")
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    batches = _batches(3)
    step(*batches[0])
    exe = step._last.executable
    launches = exe.launches
    assert not [la.name for la in launches if la.name.startswith("copy back")]
    state_ptrs = {(id(p), k): v.data_ptr() for p, s in opt.state.items() for k, v in s.items()}
    for x, y in batches[1:]:
        step(x, y)
    assert exe.launches is launches, "the launch list was bound again without a reason"
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    assert {(id(p), k): v.data_ptr() for p, s in opt.state.items() for k, v in s.items()} == state_ptrs
    for x, y in batches:
        oracle(x, y)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=n)
    assert step.mode == "launch list"


def test_a_replaced_state_is_bound_again():
    model, opt, step, ref, opt_ref, oracle = _sgd_pair()
    batches = _batches(3)
    step(*batches[0])
    oracle(*batches[0])
    exe = step._last.executable
    before = exe.launches
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new tensors, same values
    for x, y in batches[1:]:
        step(x, y)
        oracle(x, y)
    assert exe.launches is not before
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=n)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], opt_ref.state[q]["momentum_buffer"],
                                   rtol=1e-4, atol=1e-6)


def test_the_returned_loss_is_not_overwritten_by_the_next_step():
    model = _model()
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="triton")
    b = _batches(2)
    first = step(*b[0])
    kept = first.clone()
    step(*b[1])
    assert torch.equal(first, kept)


def test_a_non_contiguous_state_tensor_is_a_clear_error():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = nova.compile(model, opt, backend="triton")
    b = _batches(2)
    step(*b[0])
    p = model.transformer.h[0].mlp.c_fc.weight
    buf = opt.state[p]["momentum_buffer"]
    opt.state[p]["momentum_buffer"] = buf.t().contiguous().t()  # same values, transposed strides
    with pytest.raises(ValueError, match="not contiguous"):
        step(*b[1])


def test_explain_reports_the_plan_the_remat_choices_and_how_the_step_runs():
    model = _model()
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="triton")
    step(*_batches(1)[0])
    head = [line for line in step.explain().splitlines() if line.startswith("// ") and "=====" not in line]
    text = "\n".join(head)
    assert "predicted peak" in text and "largest launch scratch" in text
    assert "remat:" in text
    assert "runs as: launch list" in text


def test_alternating_batch_shapes_keep_one_arena_and_train_like_the_reference():
    model = _model()
    ref = copy.deepcopy(model)
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), backend="triton")
    oracle = nova.compile(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), backend="reference")
    short, long = _batches(2, T=4), _batches(2, T=8)
    for x, y in (short[0], long[0], short[1], long[1]):
        torch.testing.assert_close(step(x, y), oracle(x, y), rtol=1e-4, atol=1e-6)
    arenas = [p.executable.arena for p in step._programs.values()]
    assert step.num_programs == 2 and sum(a is not None for a in arenas) == 1
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=n)


def test_an_lr_scheduler_sees_a_stepped_optimizer(recwarn):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    step = nova.compile(model, opt, backend="triton")
    step(*_batches(1)[0])
    sched.step()
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
    assert opt.param_groups[0]["lr"] == 0.05


def test_a_learning_rate_changed_every_call_reaches_every_step():
    """Hyper-parameters go through a ring of host rows (executable.SCALAR_ROWS):
    more calls than rows, each with its own learning rate, equal the reference."""
    from nova.runtime.executable import SCALAR_ROWS

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    ref = copy.deepcopy(model)

    class Loss(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, y):
            return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    step = nova.compile(Loss(model), opt, backend="triton")
    oracle = nova.compile(Loss(ref), opt_ref, backend="reference")
    g = torch.Generator().manual_seed(5)
    for k in range(SCALAR_ROWS + 3):
        for o in (opt, opt_ref):
            o.param_groups[0]["lr"] = 0.01 * (k + 1)
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
        step(x, y)
        oracle(x, y)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_parameter_given_new_storage_with_data_is_bound_again():
    # p.data = ... keeps the Parameter object (its id, so the program key) and moves its storage:
    # the step must update the new storage, as eager's optimizer.step() would
    model, opt, step, ref, opt_ref, oracle = _sgd_pair()
    batches = _batches(5)
    for x, y in batches[:3]:  # the third call replays (the fast path)
        step(x, y)
        oracle(x, y)
    p, q = model.transformer.h[0].mlp.c_fc.weight, ref.transformer.h[0].mlp.c_fc.weight
    with torch.no_grad():
        p.data = p.data * 0.5  # new storage, new values
        q.data = q.data * 0.5
    before = p.detach().clone()
    for x, y in batches[3:]:
        step(x, y)
        oracle(x, y)
    assert not torch.equal(p, before), "the step did not update the parameter's new storage"
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=n)


def test_the_compile_ahead_walk_leaves_parameters_and_state_as_they_were():
    """``Executable.compile_ahead`` walks the launch list once before the first run (on
    CUDA, inside ``compile_ahead.ahead``: new kernels neither compile nor launch, kernels
    already compiled do launch, on whatever the arena holds). Here every launch runs for
    real in the interpreter, the worst case: the in-place updates must write views of
    the arena, not the parameters and the optimizer state, and the next step must be the
    step of a twin that never walked."""
    import contextlib

    model = _model()
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_twin = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    step, step_twin = nova.compile(model, opt, backend="triton"), nova.compile(twin, opt_twin, backend="triton")
    batches = _batches(2)
    for s in (step, step_twin):
        s(*batches[0])
    exe = step._last.executable
    assert exe.ahead == {}, "on the CPU the walk is off"
    updates = [la for la in exe.launches if la.caller_outs]
    assert updates and all(la.kernel for la in updates), "the optimizer's in-place updates are kernel launches"
    before = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    walked, _ = exe._walk(contextlib.nullcontext({"submitted": 0}))
    assert walked == sum(la.kernel for la in exe.launches)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)
    for p, s in zip(model.parameters(), state, strict=True):
        for k, v in s.items():
            assert torch.equal(opt.state[p][k], v), k
    loss, loss_twin = step(*batches[1]), step_twin(*batches[1])
    assert torch.equal(loss, loss_twin)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    # explain() reports a walk (on CUDA: the figures compile_ahead records)
    exe.ahead = {"launches": walked, "kernels": 7, "launchers": 5, "threads": 2, "seconds": 0.31}
    assert (f"kernels compiled before the first run: 7 (and 5 launchers) on 2 threads in 0.3 s ({walked} launches "
            "walked)") in step.explain()  # fmt: skip
