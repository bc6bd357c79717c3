"""Steps from several threads: compilation is serialized process-wide, one step
is serialized per call, and a step's precision never reaches another thread
through torch's process-wide tf32 flags."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn as nn

import nova

TOL = 1e-9


pytestmark = pytest.mark.usefixtures("float64_default")


class Net(nn.Module):
    def __init__(self, d=8, depth=2):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return (self.head(x) ** 2).mean()


def eager_step(model, opt, x):
    opt.zero_grad(set_to_none=True)
    model(x).backward()
    opt.step()


def run_threads(fns):
    errors = []

    def wrap(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001  (re-raised below in the main thread)
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def assert_params_equal(a, b):
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.allclose(p, q, rtol=TOL, atol=TOL), (n, (p - q).abs().max().item())


def test_two_steps_compiling_at_once():
    torch.manual_seed(0)
    models = [Net(depth=2), Net(d=6, depth=3), Net(d=4, depth=1)]
    eager = [copy.deepcopy(m) for m in models]
    steps = [nova.compile(m, torch.optim.AdamW(m.parameters(), lr=0.01)) for m in models]
    batches = [[torch.randn(4, m.head.in_features) for _ in range(3)] for m in models]
    start = threading.Barrier(len(models))

    def work(i):
        def go():
            start.wait()
            for xb in batches[i]:
                steps[i](xb)

        return go

    run_threads([work(i) for i in range(len(models))])
    for m, e, bs in zip(models, eager, batches, strict=True):
        opt = torch.optim.AdamW(e.parameters(), lr=0.01)
        for xb in bs:
            eager_step(e, opt, xb)
        assert_params_equal(m, e)


def test_one_step_called_from_many_threads_loses_no_update():
    torch.manual_seed(0)
    m = Net()
    e = copy.deepcopy(m)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)
    step = nova.compile(m, opt)
    xb = torch.randn(4, 8)  # one batch: the result does not depend on the threads' order
    step(xb)  # compiled once before the race: the race is on running and writing back
    n_threads, calls = 4, 5
    start = threading.Barrier(n_threads)

    def go():
        start.wait()
        for _ in range(calls):
            step(xb)

    run_threads([go] * n_threads)
    eopt = torch.optim.AdamW(e.parameters(), lr=0.01, weight_decay=0.1)
    for _ in range(1 + n_threads * calls):
        eager_step(e, eopt, xb)
    assert all(float(opt.state[p]["step"]) == 1 + n_threads * calls for p in m.parameters())
    assert_params_equal(m, e)


def test_a_tf32_step_does_not_touch_the_global_tf32_flags():
    torch.manual_seed(0)
    m32, m = Net(), None
    m = copy.deepcopy(m32)
    fp32 = nova.compile(m32, torch.optim.SGD(m32.parameters(), lr=0.1))
    tf32 = nova.compile(m, torch.optim.SGD(m.parameters(), lr=0.1), precision="tf32")
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    seen = set()
    done = threading.Event()
    xb = torch.randn(4, 8)

    def tf32_steps():
        try:
            for _ in range(20):
                tf32(xb)
        finally:
            done.set()

    def watch():
        while not done.is_set():
            seen.add((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))

    run_threads([tf32_steps, watch])
    assert seen <= {flags}, f"another thread saw the tf32 flags flip: {seen}"
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == flags
    for _ in range(20):
        fp32(xb)
    assert_params_equal(m, m32)  # on the CPU tf32 is fp32: bit-for-bit the same steps
