"""Issue 7, no silent wrong result: frozen parameters, replaced tensors, checked
optimizer state, an all-or-nothing write-back, a bounded program cache. Each case
matches eager PyTorch (float64, 1e-9) or raises a clear error."""

from __future__ import annotations

import copy
import logging
import signal
import threading

import pytest
import torch
import torch.nn as nn

import nova
import nova.api
from nova.config import Settings

TOL = 1e-9


pytestmark = pytest.mark.usefixtures("float64_default")


class Net(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, 1)
        self.register_buffer("scale", torch.full((d,), 0.5))

    def forward(self, x):
        return (self.b(torch.tanh(self.a(x * self.scale))) ** 2).mean()


def pair(opt_cls=torch.optim.AdamW, **kw):
    torch.manual_seed(0)
    m = Net()
    e = copy.deepcopy(m)
    kw = kw or {"lr": 0.05, "weight_decay": 0.1}
    return m, opt_cls(m.parameters(), **kw), e, opt_cls(e.parameters(), **kw)


def eager_step(model, opt, *batch):
    opt.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward()
    opt.step()
    return loss.detach()


def assert_same(m, om, e, oe):
    for (n, p), (_, q) in zip(m.named_parameters(), e.named_parameters(), strict=True):
        assert torch.allclose(p, q, rtol=TOL, atol=TOL), (n, (p - q).abs().max().item())
    sm, se = om.state_dict()["state"], oe.state_dict()["state"]
    assert sm.keys() == se.keys()
    for i in se:
        assert sm[i].keys() == se[i].keys(), i
        for k in se[i]:
            assert torch.allclose(sm[i][k].to(se[i][k].dtype), se[i][k], rtol=TOL, atol=TOL), (i, k)


def x(B=5, d=6):
    return torch.randn(B, d)


# --------------------------------------------------------------------------- frozen parameters


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_frozen_before_compile_is_left_alone(opt_cls):
    kw = {"lr": 0.05, "weight_decay": 0.1} if opt_cls is torch.optim.AdamW else {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}
    m, om, e, oe = pair(opt_cls, **kw)
    for model in (m, e):
        model.a.weight.requires_grad_(False)
    frozen = m.a.weight.detach().clone()
    step = nova.compile(m, om)
    for _ in range(3):
        b = x()
        assert torch.allclose(step(b), eager_step(e, oe, b), rtol=TOL, atol=TOL)
    assert torch.equal(m.a.weight, frozen)  # no weight decay either
    assert m.a.weight not in om.state  # no state, no step count
    assert_same(m, om, e, oe)


def test_freezing_and_unfreezing_after_compile_selects_another_program(caplog):
    m, om, e, oe = pair()
    step = nova.compile(m, om)
    caplog.set_level(logging.INFO, logger="nova")
    for phase in (True, False, True):
        for model in (m, e):
            model.b.weight.requires_grad_(phase)
        for _ in range(2):
            b = x()
            assert torch.allclose(step(b), eager_step(e, oe, b), rtol=TOL, atol=TOL)
        assert_same(m, om, e, oe)
    assert step.num_programs == 2  # unfreezing again reuses the first program
    assert "requires_grad changed: ['b.weight=False']" in caplog.text


def test_a_parameter_that_does_not_reach_the_loss_is_not_updated():
    class WithUnused(Net):
        def __init__(self):
            super().__init__()
            self.unused = nn.Parameter(torch.ones(3))

    torch.manual_seed(0)
    m = WithUnused()
    e = copy.deepcopy(m)
    om, oe = (torch.optim.AdamW(t.parameters(), lr=0.05, weight_decay=0.1) for t in (m, e))
    step = nova.compile(m, om)
    for _ in range(2):
        b = x()
        step(b)
        eager_step(e, oe, b)
    assert torch.equal(m.unused, torch.ones(3)) and m.unused not in om.state
    assert_same(m, om, e, oe)


def test_a_parameter_reaching_the_loss_only_through_detach_gets_no_gradient_from_it():
    class Detached(Net):
        def forward(self, x):
            return super().forward(x) + (self.a.weight.detach() ** 2).sum()

    torch.manual_seed(0)
    m = Detached()
    e = copy.deepcopy(m)
    om, oe = (torch.optim.SGD(t.parameters(), lr=0.1) for t in (m, e))
    b = x()
    nova.compile(m, om)(b)
    eager_step(e, oe, b)
    assert_same(m, om, e, oe)


# --------------------------------------------------------------------------- replaced tensors


def test_a_replaced_buffer_is_used():
    m, om, e, oe = pair()
    step = nova.compile(m, om)
    b = x()
    step(b), eager_step(e, oe, b)
    for model in (m, e):
        model.scale = torch.full((6,), 2.0)  # a new tensor object for the registered buffer
    b = x()
    assert torch.allclose(step(b), eager_step(e, oe, b), rtol=TOL, atol=TOL)
    assert_same(m, om, e, oe)
    assert step.num_programs == 2


def test_a_replaced_parameter_the_optimizer_also_holds_is_updated():
    m, om, e, oe = pair(torch.optim.SGD, lr=0.1, momentum=0.9)
    step = nova.compile(m, om)
    b = x()
    step(b), eager_step(e, oe, b)
    torch.manual_seed(1)
    w = torch.randn(1, 6)
    for model, opt in ((m, om), (e, oe)):
        old = model.b.weight
        model.b.weight = nn.Parameter(w.clone())
        group = opt.param_groups[0]["params"]
        group[next(i for i, p in enumerate(group) if p is old)] = model.b.weight
        opt.state.pop(old, None)
    for _ in range(2):
        b = x()
        assert torch.allclose(step(b), eager_step(e, oe, b), rtol=TOL, atol=TOL)
    assert_same(m, om, e, oe)


def test_a_replaced_parameter_the_optimizer_does_not_hold_is_a_clear_error(caplog):
    m, om, _, _ = pair()
    step = nova.compile(m, om)
    step(x())
    m.a.weight = nn.Parameter(torch.zeros(6, 6))
    caplog.set_level(logging.INFO, logger="nova")
    with pytest.raises(nova.CaptureError, match="not a parameter of the model"):
        step(x())
    assert "parameters replaced: ['a.weight']" in caplog.text
    assert torch.equal(m.a.weight, torch.zeros(6, 6))


def test_double_after_compile_recompiles():
    torch.set_default_dtype(torch.float32)
    m, om, e, oe = pair(torch.optim.SGD, lr=0.1)  # stateless: nothing kept in float32
    step = nova.compile(m, om)
    b = x()
    step(b), eager_step(e, oe, b)
    m.double(), e.double()
    e.load_state_dict(m.state_dict())  # the float32 step differs by float32 rounding; compare from here
    b = x().double()
    step._batch_sig = None  # the batch dtype follows the model here  # noqa: SLF001
    assert step(b).dtype == torch.float64
    eager_step(e, oe, b)
    assert_same(m, om, e, oe)


def test_double_with_float32_adam_state_is_a_clear_error():
    torch.set_default_dtype(torch.float32)
    m, om, _, _ = pair()
    step = nova.compile(m, om)
    step(x())
    m.double()
    step._batch_sig = None  # noqa: SLF001
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    with pytest.raises(nova.CaptureError, match=r"optimizer.state\['a.weight'\]\['exp_avg'\] is torch.float32"):
        step(x().double())
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())


# --------------------------------------------------------------------------- optimizer state checks


def _bad_state(om, m, key, value):
    om.state[m.a.weight][key] = value


@pytest.mark.parametrize("what", ["shape", "dtype", "device", "step"])
def test_bad_optimizer_state_is_named_before_anything_runs(what):
    m, om, _, _ = pair()
    step = nova.compile(m, om)
    step(x())
    bad = {
        "shape": ("exp_avg", torch.zeros(6)),  # broadcastable to [6, 6]: would be silently broadcast
        "dtype": ("exp_avg_sq", torch.zeros(6, 6, dtype=torch.float32)),
        "device": ("exp_avg", torch.zeros(6, 6, device="meta")),
        "step": ("step", torch.zeros(2)),
    }[what]
    _bad_state(om, m, *bad)
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    state = [(p, {k: v.clone() for k, v in st.items()}) for p, st in om.state.items() if p is not m.a.weight]
    with pytest.raises(nova.CaptureError, match=rf"optimizer.state\['a.weight'\]\['{bad[0]}'\]"):
        step(x())
    assert all(torch.equal(p, params[n]) for n, p in m.named_parameters())
    assert len(state) == 3
    for p, st in state:
        assert all(torch.equal(om.state[p][k], v) for k, v in st.items())


def test_sigint_during_the_write_back_is_deferred_until_it_is_complete(monkeypatch):
    assert threading.current_thread() is threading.main_thread()
    # Python's own handler, whatever this process inherited (a shell's background job starts
    # with SIGINT ignored, which the commit respects: then nothing would be raised)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_the_write_back(monkeypatch)
    finally:
        signal.signal(signal.SIGINT, inherited)


def _interrupt_the_write_back(monkeypatch):
    m, om, e, oe = pair()
    step = nova.compile(m, om)
    commit = nova.api._commit

    def interrupted(writes, state):
        commit(writes[:1], state)
        signal.raise_signal(signal.SIGINT)  # Python runs the handler at the next bytecode
        commit(writes[1:], state)

    monkeypatch.setattr(nova.api, "_commit", interrupted)
    b = x()
    with pytest.raises(KeyboardInterrupt):
        step(b)
    eager_step(e, oe, b)
    assert_same(m, om, e, oe)  # every parameter and state entry written, none half
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# --------------------------------------------------------------------------- the program cache


def test_program_cache_is_bounded_and_recompiles_are_logged(monkeypatch, caplog):
    monkeypatch.setattr(nova.api, "SETTINGS", Settings(program_cache_size=2))
    caplog.set_level(logging.INFO, logger="nova")
    m, om, e, oe = pair()
    step = nova.compile(m, om)
    for B in (3, 4, 5, 3, 5):
        b = x(B)
        assert torch.allclose(step(b), eager_step(e, oe, b), rtol=TOL, atol=TOL)
        assert step.num_programs <= 2
    assert_same(m, om, e, oe)
    assert "first call" in caplog.text
    assert "new batch shape [(4, 6)] (was [(3, 6)])" in caplog.text
    assert caplog.text.count("dropped the least recently used") == 2  # 5 evicts 3, 3 evicts 4; 5 is a hit
    assert caplog.text.count("compiling a program") == 4


def test_program_cache_size_setting_is_checked(monkeypatch):
    monkeypatch.setenv("NOVA_PROGRAM_CACHE_SIZE", "3")
    assert Settings.from_env().program_cache_size == 3
    monkeypatch.setenv("NOVA_PROGRAM_CACHE_SIZE", "0")
    with pytest.raises(ValueError, match="NOVA_PROGRAM_CACHE_SIZE"):
        Settings.from_env()
