"""Tensor types of the nova dialect and their mapping to torch dtypes.

Nova values are builtin ``tensor<...>`` types with static shapes. Element types
are the ones a training step needs: bf16/f16/f32/f64 data, i64 token ids and
i1 masks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from xdsl.dialects.builtin import (
    BFloat16Type,
    Float16Type,
    Float32Type,
    Float64Type,
    IntegerType,
    TensorType,
    bf16,
    f16,
    f32,
    f64,
    i1,
    i64,
)
from xdsl.ir import Attribute

_TO_TORCH: list[tuple[Attribute, torch.dtype]] = [
    (f32, torch.float32),
    (f64, torch.float64),
    (bf16, torch.bfloat16),
    (f16, torch.float16),
    (i64, torch.int64),
    (i1, torch.bool),
]

FLOAT_TYPES = (Float16Type, BFloat16Type, Float32Type, Float64Type)


def to_torch_dtype(elem: Attribute) -> torch.dtype:
    for attr, dt in _TO_TORCH:
        if attr == elem:
            return dt
    raise TypeError(f"nova has no torch dtype for element type {elem}")


def from_torch_dtype(dt: torch.dtype) -> Attribute:
    for attr, d in _TO_TORCH:
        if d == dt:
            return attr
    raise TypeError(f"nova does not support tensors of dtype {dt}")


def tensor(shape: Sequence[int], elem: Attribute) -> TensorType:
    return TensorType(elem, [int(s) for s in shape])


def shape_of(t: Attribute) -> tuple[int, ...]:
    assert isinstance(t, TensorType), t
    return tuple(int(s) for s in t.get_shape())


def elem_of(t: Attribute) -> Attribute:
    assert isinstance(t, TensorType), t
    return t.get_element_type()


def is_float(t: Attribute) -> bool:
    e = elem_of(t) if isinstance(t, TensorType) else t
    return isinstance(e, FLOAT_TYPES)


def is_int(t: Attribute) -> bool:
    e = elem_of(t) if isinstance(t, TensorType) else t
    return isinstance(e, IntegerType)


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    """numpy/torch broadcasting; raises ValueError when shapes are incompatible."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        dims = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0}
        dims.discard(1)
        if len(dims) > 1:
            raise ValueError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)
