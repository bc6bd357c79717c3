"""One check for the capture tests: a model trains some steps like eager PyTorch."""

from __future__ import annotations

import copy

import torch

import nova

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-4, atol=1e-5)}


def assert_trains_like_eager(eager: torch.nn.Module, batches, backend: str, tol: dict | None = None,
                             optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)) -> None:  # fmt: skip
    """Trains ``eager`` and its copy compiled by Nova side by side on ``batches`` (tuples of
    tensors): after every step the loss, every parameter and every buffer must agree
    (``tol``: by default by the parameters' dtype, float64 near bit-exact)."""
    ours = copy.deepcopy(eager)
    opt_e = optimizer(eager.parameters())
    step = nova.compile(ours, optimizer(ours.parameters()), backend=backend)
    tol = tol or TOL[next(eager.parameters()).dtype]
    for batch in batches:
        opt_e.zero_grad()
        want = eager(*batch)
        want.backward()
        opt_e.step()
        torch.testing.assert_close(step(*batch), want.detach(), **tol)
        for (name, a), b in zip(ours.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a.detach(), b.detach(), **tol, msg=lambda m, n=name: f"{n}: {m}")
        for (name, a), b in zip(ours.named_buffers(), eager.buffers(), strict=True):
            torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"{n}: {m}")
