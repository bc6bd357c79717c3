"""The fast path of a call (nova/runtime/steady.py): a call replays the last
program at once only when nothing its full path read has changed. Each change a
user can make between calls sends the next call down the full path, and the
steps still equal the reference executor's; plain calls take the fast path."""

from __future__ import annotations

import copy

import pytest
import torch

import nova
from nova import api
from nova.models import GPT, gpt_tiny


def _pair():
    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_layer=1, n_embd=32, n_head=2, block_size=16, vocab_size=64))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    return (model, opt, nova.compile(model, opt, backend="triton")), (ref, opt_ref, nova.compile(ref, opt_ref, backend="reference"))


def _batches(n, B=2, T=8):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 64, (B, T), generator=g), torch.randint(0, 64, (B, T), generator=g)) for _ in range(n)]


def _fc(model):
    return model.transformer.h[0].mlp.c_fc.weight


def _replace_state(model, opt):
    p = _fc(model)
    opt.state[p]["momentum_buffer"] = opt.state[p]["momentum_buffer"] * 0.5


def _swap_state_storage(model, opt):
    buf = opt.state[_fc(model)]["momentum_buffer"]
    buf.data = buf.data * 0.5


def _freeze(model, opt):
    _fc(model).requires_grad_(False)


def _new_lr(model, opt):
    opt.param_groups[0]["lr"] = 0.01


def _eval_a_submodule(model, opt):
    model.transformer.h[0].eval()


def _out_of_its_group(model, opt):
    p = _fc(model)
    group = opt.param_groups[0]["params"]
    del group[next(i for i, q in enumerate(group) if q is p)]  # eager's step no longer updates it


def _nesterov(model, opt):
    opt.param_groups[0]["nesterov"] = True


MUTATIONS = {"a state entry replaced": _replace_state, "a state tensor given new storage": _swap_state_storage,
             "a parameter frozen": _freeze, "a new learning rate": _new_lr,
             "one submodule in eval mode": _eval_a_submodule, "a parameter taken out of its group": _out_of_its_group,
             "nesterov turned on": _nesterov}  # fmt: skip


@pytest.mark.parametrize("name", MUTATIONS)
def test_a_change_between_calls_reaches_the_next_step(name, monkeypatch):
    (model, opt, step), (ref, opt_ref, oracle) = _pair()
    full = []
    call = api.CompiledStep._call
    monkeypatch.setattr(api.CompiledStep, "_call", lambda self, batch: full.append(self) or call(self, batch))
    batches = _batches(6)
    for x, y in batches[:3]:
        step(x, y)
        oracle(x, y)
    # (a compile anywhere registers modules, so the call after the oracle's first takes the full path)
    full.clear()
    step(*batches[3])
    oracle(*batches[3])
    assert step not in full, "a call with nothing changed should replay without the full path"
    MUTATIONS[name](model, opt)
    MUTATIONS[name](ref, opt_ref)
    for x, y in batches[4:]:
        step(x, y)
        oracle(x, y)
    if name != "a new learning rate":  # hyper-parameters are read on the fast path itself
        assert step in full, f"{name}: the call after the change did not take the full path"
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=n)
    for p, q in zip(model.parameters(), ref.parameters()):
        if "momentum_buffer" in opt_ref.state.get(q, {}):
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], opt_ref.state[q]["momentum_buffer"],
                                       rtol=1e-4, atol=1e-6)  # fmt: skip


def test_a_deleted_submodule_is_seen(monkeypatch):
    (model, opt, step), _ = _pair()
    b = _batches(3)
    step(*b[0])
    step(*b[1])
    assert step._steady is not None
    del model.transformer.h[0].mlp.c_proj.bias  # no registration hook runs for a deletion
    assert not step._steady.holds(step, b[2], api._registrations[0])


def test_one_submodule_in_eval_mode_selects_another_program(caplog):
    # a submodule's forward may read its own .training (dropout): the program key holds every module's flag
    (model, opt, step), _ = _pair()
    b = _batches(3)
    step(*b[0])
    step(*b[1])
    model.transformer.h[0].eval()
    with caplog.at_level("INFO", logger="nova.api"):
        step(*b[2])
    assert step.num_programs == 2
    assert "transformer.h.0 eval" in caplog.text
