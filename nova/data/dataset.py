"""Training text as batches of next-token prediction pairs.

Everything is in memory: the built-in corpus is a few hundred KB and a
``--data`` file is expected to be of the same order for CPU-sized runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from nova.data.tokenizer import encode

BUILTIN_CORPUS = Path(__file__).with_name("corpus.txt")


class DataError(ValueError):
    """The training text cannot be used; the message says why and names the file."""


def load_text(path: str | Path | None = None) -> str:
    """The text of ``path``, or of the built-in corpus when ``path`` is None."""
    p = BUILTIN_CORPUS if path is None else Path(path)
    if not p.exists():
        raise DataError(f"data file not found: {p}")
    if not p.is_file():
        raise DataError(f"data path is not a file: {p}")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file is not UTF-8 text: {p} ({e})") from None


@dataclass
class TextDataset:
    """Token ids split into a leading train part and a trailing val part."""

    train: torch.Tensor
    val: torch.Tensor

    @classmethod
    def from_text(cls, text: str, block_size: int, val_fraction: float = 0.1) -> "TextDataset":
        ids = encode(text)
        n_val = int(len(ids) * val_fraction)
        train, val = ids[: len(ids) - n_val], ids[len(ids) - n_val :]
        # A batch row needs block_size + 1 tokens (inputs plus the shifted targets).
        for name, part in (("train", train), ("val", val)):
            if len(part) < block_size + 1:
                raise DataError(
                    f"{name} split has {len(part)} tokens, fewer than block_size + 1 = {block_size + 1}; "
                    "use a larger data file or a smaller --block-size"
                )
        return cls(train=train, val=val)

    def batch(
        self, split: str, batch_size: int, block_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: x (B, T) int64 and y = x shifted left by one."""
        data = self.train if split == "train" else self.val
        starts = torch.randint(0, len(data) - block_size, (batch_size,), generator=generator)
        offsets = torch.arange(block_size + 1)
        rows = data[starts[:, None] + offsets[None, :]]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def unigram_entropy(self) -> float:
        """Entropy (nats/token) of the train split's byte frequencies: what a model
        with no context at all would reach; a model that learns context goes below."""
        counts = torch.bincount(self.train, minlength=256).to(torch.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * p.log()).sum())


UNIFORM_LOSS = math.log(256)  # cross-entropy of a uniform guess over the byte vocabulary
