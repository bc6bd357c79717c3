"""The lowering registry: one function per nova op that turns the op (with
its static shapes, properties and ``LoweringConfig``) into a ``Kernel``.

A lowering runs at compile time: it generates Triton source, loads it with
``source.load_kernel`` and returns a ``Kernel`` whose ``launch`` runs it. At
step time the Triton backend only calls ``launch``.

Contract of ``launch(inputs, outs=None) -> outputs``:
  * ``inputs`` are torch tensors on the GPU (or CPU under TRITON_INTERPRET=1),
    one per operand, with the operand's shape and dtype. They may be strided
    views (transposes, broadcasts with stride 0, slices with an offset): a
    lowering that needs another layout says so in ``Kernel.needs_contiguous``
    (operand indices) and the backend materializes those first.
  * ``outs``, when given, holds one tensor per result, contiguous, with the
    result's shape and dtype: usually a view into the executable's one arena
    (a nonzero storage offset inside a larger storage). The kernel writes its
    results into them and returns those same tensors. An output may be one of
    the inputs itself only for the same-index elementwise ops
    (``nova.transforms.plan_memory.SAME_INDEX``: element i is read before it
    is written) and a fused elementwise kernel over a dense input of the
    output's type (``nova/codegen/triton/fused.py``). Without ``outs`` the
    results are new tensors.
  * Scratch (split-K partials, per-program partial sums, a logits chunk) is
    allocated inside ``launch``; ``Kernel.scratch_bytes`` says how much at
    most, so the memory plan can predict the step's peak. A lowering with large
    scratch may instead register an ``arena_scratch`` rule: the memory plan then
    gives its launch that many bytes of the arena (live only during the launch,
    so they fit into a gap of the plan), passed as ``launch(..., scratch=)``, a
    uint8 tensor the launch carves with ``Scratch``; ``Kernel.arena_scratch_bytes``
    is that part of ``scratch_bytes``.
  * ``launch`` never waits for the device (no ``.item()``, ``.tolist()``, no
    host copy of a device value) and builds no host data per call: a step is
    captured as one CUDA graph. Inputs out of range (token ids, class ids)
    never read or write out of bounds: the kernel masks them, and the guard
    stage's check ops count them on the device (``nova.transforms.guard``).
A missing lowering is an error that names the op (``lowering_for``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from nova.ir.types import numel
from nova.schedule.config import LoweringConfig


@dataclass
class Kernel:
    name: str  # a readable name, e.g. "nova_layer_norm_fwd_512x768"
    source: str  # the generated Triton source (dumped by explain)
    launch: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
    needs_contiguous: tuple[int, ...] = ()
    config: LoweringConfig | None = None
    extra: dict = field(default_factory=dict)
    scratch_bytes: int = 0  # the most bytes one launch allocates besides its results
    arena_scratch_bytes: int = 0  # the part of it a planned ``scratch=`` buffer provides instead


SCRATCH_ALIGN = 256  # the arena's alignment (plan_memory.ALIGNMENT): carved tensors start aligned


class Scratch:
    """Carves a launch's scratch tensors out of one planned buffer, in order, each
    256-byte aligned; without a buffer (a direct launch) each is ``torch.empty``.
    ``Scratch.size`` of the same shapes gives the bytes the rule must plan."""

    def __init__(self, buf: torch.Tensor | None, device):
        self.buf, self.device, self.used = buf, device, 0

    @staticmethod
    def size(*parts: tuple[tuple[int, ...], torch.dtype]) -> int:
        total = 0
        for shape, dtype in parts:
            total = -(-total // SCRATCH_ALIGN) * SCRATCH_ALIGN + numel(shape) * dtype.itemsize
        return total

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.buf is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        start = -(-self.used // SCRATCH_ALIGN) * SCRATCH_ALIGN
        n = numel(shape) * dtype.itemsize
        if start + n > self.buf.numel():
            raise AssertionError(f"scratch of {self.buf.numel()} bytes is too small for {shape} {dtype} at {start}")
        self.used = start + n
        return self.buf[start:start + n].view(dtype).view(shape)


# op class -> fn(op) -> the bytes of arena scratch its launch takes (see the contract above)
ARENA_SCRATCH: dict[type, Callable] = {}


def arena_scratch(*op_classes):
    def register(fn):
        for c in op_classes:
            ARENA_SCRATCH[c] = fn
        return fn

    return register


Lowering = Callable[..., Kernel]  # (op, cfg: LoweringConfig | None) -> Kernel
LOWERINGS: dict[type, Lowering] = {}


def lowers(*op_classes):
    def register(fn):
        for c in op_classes:
            if c in LOWERINGS:
                raise ValueError(f"{c.name} already has a lowering")
            LOWERINGS[c] = fn
        return fn

    return register


class NoLoweringError(NotImplementedError):
    pass


def lowering_for(op) -> Lowering:
    fn = LOWERINGS.get(type(op))
    if fn is None:
        raise NoLoweringError(f"the Triton backend has no lowering for {op.name}")
    return fn
