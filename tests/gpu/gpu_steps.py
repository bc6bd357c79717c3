"""Shared pieces of the GPU step tests: the small models and the optimizers.

Why tf32 compares parameters under SGD and the loss under AdamW: AdamW's first step
moves every element by about lr * sign(g) (m / sqrt(v) = g / |g|), whatever |g| is.
A gradient element smaller than tf32's rounding noise (~1e-3 of the larger terms
it is summed from) therefore gets its update's sign from that noise, and two correct
tf32 executions that round or sum in a different order differ there by 2 lr. Measured
on the H200: Triton-vs-cuBLAS put 1.3e-3..4.4e-3 norm-relative differences into the
weights at step 0 that way, and cuBLAS-vs-cuBLAS (the reference executor against
eager PyTorch, both tf32) also exceeded 5e-4 on the SDPA model. SGD is linear in g, so its parameters show the kernels'
own error; under AdamW the loss (which those few flipped elements barely move) is
compared at the tf32 tolerance and the parameters at a bound that catches a wrong
kernel but not sign noise. SGD's lr (0.02, momentum 0.9) keeps 50 steps short of
the chaotic regime in which any two tf32 trajectories drift apart: at lr 0.05 the
attention models' c_proj weights reached 5.0e-4..5.2e-4 by steps 20-39 (H200)."""

from __future__ import annotations

import torch

from nova.models import GPT, MLPLM, MLPLMConfig, gpt_tiny

TOL = {"fp32": 1e-4, "tf32": 5e-4, "bf16": 2e-2}
ADAMW_TF32_PARAM_BOUND = 2e-2  # sign noise of near-zero gradients, see above


def make_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return MLPLM(MLPLMConfig(vocab_size=256, block_size=32, n_layer=2, n_embd=64, hidden=128))
    return GPT(gpt_tiny(attention=kind, bias=False))


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.02, momentum=0.9, weight_decay=0.1, foreach=False)
    raise ValueError(name)


def param_tolerance(precision: str, optimizer: str) -> float:
    return ADAMW_TF32_PARAM_BOUND if (precision, optimizer) == ("tf32", "adamw") else TOL[precision]


def step_errors(loss, ref_loss, mine: torch.nn.Module, ref: torch.nn.Module) -> dict[str, float]:
    """Relative error of the loss and norm-relative error of every parameter."""
    errs = {"loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())}
    for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
        errs[name] = ((p - q).norm() / q.norm()).item()
    return errs
