"""A small LM whose loss is cross-entropy as real training code uses it, and a
runner that trains it with Nova and with eager PyTorch side by side; shared
by tests/numerics/test_loss_edge_cases.py (reference backend) and
tests/kernels/test_triton_step_interpreted.py (Triton backend)."""

from __future__ import annotations

import copy
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

import nova


class LM(nn.Module):
    def __init__(self, mode="mean", smoothing=0.0, weighted=False):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
        self.mode, self.smoothing = mode, smoothing
        # class weights (a buffer: it follows .to(dtype)), one 0 among them: a target class of weight 0
        self.register_buffer("weight", torch.linspace(0.0, 2.0, 16).roll(3) if weighted else None)

    def forward(self, ids, y):
        logits = self.head(torch.tanh(self.emb(ids))).flatten(0, 1)
        y = y.flatten()
        if self.mode == "none":  # per-token losses, masked and averaged by hand
            per = F.cross_entropy(logits, y, weight=self.weight, reduction="none", label_smoothing=self.smoothing)
            keep = (y != -100).to(per.dtype)
            return (per * keep).sum() / keep.sum().clamp(min=1.0)
        return F.cross_entropy(logits, y, weight=self.weight, ignore_index=-100, reduction=self.mode,
                               label_smoothing=self.smoothing)


def run_both(model, batches, backend, dtype):
    eager = model.to(dtype)
    ours = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    step = nova.compile(ours, torch.optim.AdamW(ours.parameters(), lr=1e-2), backend=backend)
    out = []
    for ids, y in batches:
        opt_e.zero_grad()
        le = eager(ids, y)
        le.backward()
        opt_e.step()
        out.append((step(ids, y).item(), le.item()))
    worst = max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(ours.parameters(), eager.parameters()))
    return out, worst


def loss_batches(all_ignored_at=1):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(3):
        ids, y = torch.randint(0, 16, (2, 5), generator=g), torch.randint(0, 16, (2, 5), generator=g)
        y[0, 0] = -100
        if i == all_ignored_at:
            y[:] = -100
        out.append((ids, y))
    return out


class SoftLM(LM):
    """Class-probability targets: given (a batch's soft labels, as mixup or a stored teacher's),
    or a second head's softmax not detached, so that the loss's gradient flows into the
    targets too."""

    def __init__(self, mode, smoothing, weighted, from_teacher):
        super().__init__(mode, smoothing, weighted)
        self.teacher = nn.Linear(8, 16) if from_teacher else None

    def forward(self, ids, p):
        h = torch.tanh(self.emb(ids)).flatten(0, 1)
        target = torch.softmax(self.teacher(h), dim=-1) if self.teacher is not None else p.flatten(0, 1)
        return F.cross_entropy(self.head(h), target, weight=self.weight, reduction=self.mode,
                               label_smoothing=self.smoothing)


def soft_batches(dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 16, (2, 5), generator=g),
             torch.softmax(3 * torch.randn(2, 5, 16, generator=g, dtype=torch.float64), -1).to(dtype))
            for _ in range(3)]
