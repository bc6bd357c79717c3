"""Cross-entropy as real training code uses it, against eager PyTorch: a batch
whose targets are all ignore_index (a batch of padding: eager's loss is NaN but
its gradients are 0, so the optimizer still steps), label smoothing, and
reduction="none" with the user's own masking, and class weights (built from plain ops, as
ATen computes them). The Triton backend's version of the first test is in
tests/kernels/test_triton_step_interpreted.py."""

from __future__ import annotations

import math

import pytest
import torch

from loss_cases import LM, SoftLM, loss_batches, run_both, soft_batches


def test_a_batch_of_padding_gives_nan_loss_and_leaves_training_intact():
    torch.manual_seed(0)
    losses, worst = run_both(LM(), loss_batches(), "reference", torch.float64)
    assert math.isnan(losses[1][0]) and math.isnan(losses[1][1])  # 0 / 0 on both sides
    for mine, theirs in (losses[0], losses[2]):
        assert abs(mine - theirs) <= 1e-12 * abs(theirs)  # finite: no NaN leaked into the parameters
    assert worst < 1e-9, worst


@pytest.mark.parametrize("mode,smoothing", [("mean", 0.1), ("sum", 0.2), ("none", 0.1), ("none", 0.0)])
def test_label_smoothing_and_per_token_losses_match_eager(mode, smoothing):
    torch.manual_seed(1)
    losses, worst = run_both(LM(mode, smoothing), loss_batches(all_ignored_at=-1), "reference", torch.float64)
    for mine, theirs in losses:
        assert abs(mine - theirs) <= 1e-12 * abs(theirs)
    assert worst < 1e-9, worst


@pytest.mark.parametrize("mode,smoothing", [("mean", 0.0), ("mean", 0.1), ("sum", 0.2), ("none", 0.1), ("none", 0.0)])
def test_class_weights_match_eager(mode, smoothing):
    """cross_entropy(weight=): "mean" divides by the targets' weights (a class of weight 0
    among them), ignore_index rows count nowhere, label smoothing weighs the row's sum too;
    the batch of padding gives 0 / 0 = NaN under "mean" on both sides and leaves the
    parameters finite."""
    torch.manual_seed(2)
    losses, worst = run_both(LM(mode, smoothing, weighted=True), loss_batches(), "reference", torch.float64)
    for mine, theirs in losses:
        assert (math.isnan(mine) and math.isnan(theirs)) or abs(mine - theirs) <= 1e-12 * abs(theirs)
    assert math.isnan(losses[1][1]) == (mode == "mean")
    assert worst < 1e-9, worst


def test_class_weights_of_another_dtype_are_refused():
    """Eager refuses a weight whose dtype is not the logits' (it is a buffer the model
    did not convert); Nova says so before anything runs."""
    import nova

    model = LM("mean", 0.0, weighted=True).to(torch.float64)
    model.weight = model.weight.float()
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="reference")
    ids, y = loss_batches()[0]
    with pytest.raises(nova.UnsupportedError, match="class weights tensor<16xf32> for logits tensor<10x16xf64>"):
        step(ids, y)


def test_class_weights_with_a_target_out_of_range_raise_and_keep_the_parameters():
    """A target id >= C (eager raises too): the gather's range check fails the step on
    the device, and the parameters and optimizer state are as before it."""
    import nova

    model = LM("mean", 0.0, weighted=True).to(torch.float64)
    before = [p.detach().clone() for p in model.parameters()]
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="reference")
    ids, y = loss_batches()[0]
    y = y.clone()
    y[1, 2] = 16
    with pytest.raises(IndexError, match="out of range"):
        step(ids, y)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("mode,smoothing,weighted,from_teacher",
                         [("mean", 0.0, False, False), ("mean", 0.1, True, False), ("sum", 0.2, False, False),
                          ("none", 0.0, True, False), ("mean", 0.1, False, True)])  # fmt: skip
def test_class_probability_targets_match_eager(mode, smoothing, weighted, from_teacher):
    """cross_entropy with [N, C] probabilities: "mean" divides by N whatever the weights,
    label smoothing mixes in eps / C; with the targets a second head's softmax, both heads train."""
    torch.manual_seed(4)
    model = SoftLM(mode, smoothing, weighted, from_teacher)
    losses, worst = run_both(_Summed(model) if mode == "none" else model, soft_batches(), "reference",
                             torch.float64)
    for mine, theirs in losses:
        assert abs(mine - theirs) <= 1e-12 * abs(theirs)
    assert worst < 1e-9, worst


class _Summed(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids, p):
        return (self.inner(ids, p) * torch.linspace(0.5, 1.5, 10, dtype=torch.float64)).sum()


def test_class_probability_targets_of_another_dtype_are_refused():
    import nova

    model = SoftLM("mean", 0.0, False, False).to(torch.float64)
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="reference")
    ids, p = soft_batches()[0]
    with pytest.raises(nova.UnsupportedError, match="class-probability targets tensor<10x16xf32> for logits"):
        step(ids, p.float())
