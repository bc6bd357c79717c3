"""Nova's counter-based random numbers (used by dropout).

Dropout masks are not drawn from torch's generator: every backend must produce
the same bits, on any device, from nothing but integers. Element ``i`` of a
mask with seed ``s`` and per-op salt ``t`` keeps its value iff ``u >= p`` where

    x = (i * 0x9E3779B1 + t * 0x85EBCA77 + s * 0xC2B2AE3D) mod 2**32
    x = fmix32(x)                      (MurmurHash3's finalizer)
    u = (x >> 8) * 2**-24              (24 uniform bits in [0, 1))

and kept values are scaled by 1 / (1 - p), as torch.nn.functional.dropout does.
The seed is a runtime input of the step (Nova draws it from torch's default
generator once per step), and the salt is fixed per dropout op at capture time,
so masks differ between ops and between steps but replay identically.
Consequence: Nova's dropout has torch's distribution, not torch's bit stream.
"""

from __future__ import annotations

import math

import torch

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1
SALT_MUL = 0x85EBCA77
SEED_MUL = 0xC2B2AE3D


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    # int64 arithmetic, masked back to 32 bits after every multiply: no overflow.
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & M32
    x = x ^ (x >> 16)
    return x


def uniform(seed: int | torch.Tensor, salt: int, numel: int, device) -> torch.Tensor:
    """The 24-bit uniforms in [0, 1) as float64, one per element index."""
    seed_t = torch.as_tensor(seed, dtype=torch.int64, device=device) & M32
    i = torch.arange(numel, dtype=torch.int64, device=device)
    x = (i * GOLDEN) & M32
    # int64 products of two 32-bit numbers may wrap; their low 32 bits stay exact.
    x = (x + ((salt * SALT_MUL) & M32) + ((seed_t * SEED_MUL) & M32)) & M32
    x = _fmix32(x)
    return (x >> 8).to(torch.float64) * (2.0**-24)


def dropout_scale(seed, salt: int, shape, p: float, dtype, device) -> torch.Tensor:
    """The dropout multiplier: 0 where dropped, 1/(1-p) where kept."""
    numel = 1
    for s in shape:
        numel *= int(s)
    u = uniform(seed, salt, numel, device).reshape(tuple(shape))
    keep = u >= p
    return keep.to(dtype) * (1.0 / (1.0 - p))


def kept_value(p: float, dtype: torch.dtype) -> torch.Tensor:
    """The multiplier of a kept element, 1 / (1 - p) rounded to ``dtype`` exactly as
    ``dropout_scale`` rounds it (a tensor of ``dtype`` times a Python float): the
    generated kernels' constant."""
    return (torch.ones(1, dtype=dtype) * (1.0 / (1.0 - p)))[0]


def keep_threshold(p: float) -> int:
    """The hash's top 24 bits keep an element iff they are at least this:
    u >= p  <=>  (x >> 8) >= ceil(p * 2**24), exactly."""
    return math.ceil(p * 2**24)


def triton_hash(x: str, index: str, seed_term: str) -> str:
    """Triton source lines setting the uint32 variable ``x`` to this module's hash
    of the uint32 flat index ``index``, given ``seed_term`` = seed * SEED_MUL + salt *
    SALT_MUL (mod 2**32): the generated kernels' copy of ``uniform``'s arithmetic
    (``nova.dropout_mask``'s elementwise lowering, the attention kernels' dropout)."""
    return triton_mix(x, f"{index} * {GOLDEN} + {seed_term}")


def keep_bits(p: float) -> int | None:
    """``keep_threshold`` on the whole hash: (x >> 8) >= t  <=>  x >= t * 2**8 (uint32 x),
    exactly, one shift less an element; None where t * 2**8 is past uint32 (t = 2**24,
    p within 2**-24 of 1: nothing is kept)."""
    t = keep_threshold(p) << 8
    return t if t < 2**32 else None


def triton_mix(x: str, start: str) -> str:
    """``triton_hash``'s lines from its first value ``start`` = index * GOLDEN +
    seed_term (mod 2**32) on: a caller that adds up the index's parts multiplied
    already (a row's and a column's, the attention kernels' tiles) passes their sum."""
    return (f"{x} = {start}\n"
            f"{x} = {x} ^ ({x} >> 16)\n{x} = {x} * 0x85EBCA6B\n{x} = {x} ^ ({x} >> 13)\n"
            f"{x} = {x} * 0xC2B2AE35\n{x} = {x} ^ ({x} >> 16)")
