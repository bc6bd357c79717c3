"""The MLP-only language model from the Nova paper.

No attention at all: each position sees only its own token and position
embedding, so the model learns a position-aware bigram-like predictor. It is
the smallest model whose step is dominated by matmul + LayerNorm + GELU
epilogues and the LM-head + cross-entropy, which is what makes it a clean
benchmark for those fusions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MLPLMConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_embd: int
    hidden: int | None = None  # None means 4 * n_embd

    def __post_init__(self) -> None:
        if self.hidden is None:
            self.hidden = 4 * self.n_embd


class MLPBlock(nn.Module):
    def __init__(self, config: MLPLMConfig):
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd)
        self.fc_in = nn.Linear(config.n_embd, config.hidden)
        self.gelu = nn.GELU()
        self.fc_out = nn.Linear(config.hidden, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(self.gelu(self.fc_in(self.ln(x))))


class MLPLM(nn.Module):
    def __init__(self, config: MLPLMConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList([MLPBlock(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Eager inference: logits of shape (B, T, vocab_size)."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy."""
        logits = self.logits(idx)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
