"""Byte-level tokenizer: token id = byte value, so the vocabulary is 256.

It needs no training and no files, round-trips any text exactly, and makes
loss per token equal loss per byte (so bits per byte is loss / ln 2).
"""

from __future__ import annotations

import torch

VOCAB_SIZE = 256


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as an int64 tensor."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)


def decode(ids) -> str:
    """Inverse of ``encode``; byte sequences that are not valid UTF-8 become U+FFFD."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
