"""The launch contract (nova/codegen/triton/lowering.py) for the row-wise,
attention and fused LM-head kernels: given ``outs`` (views at nonzero offsets
into one uint8 buffer, as the executable's arena hands them out), a launch
writes into exactly those bytes, returns those tensors, and gives the same bits
as a launch that allocates its results; what it allocates itself is bounded by
``Kernel.scratch_bytes`` (exactly that where the kernel's scratch is its own)."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from test_linear_ce import D as LCE_D
from test_linear_ce import N as LCE_N
from test_linear_ce import V as LCE_V
from test_linear_ce import _ops as linear_ce_ops
from test_linear_ce import merged as linear_ce_merged
from test_rowwise import build, rand

from nova.backends.reference import IMPLS
from nova.codegen.triton import attention, linear_ce, rowwise
from nova.codegen.triton.lowering import lowering_for
from nova.ir import dialect as nv
from nova.schedule.config import LoweringConfig
from xdsl.dialects.builtin import bf16, f32

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

SENTINEL = 0xA5
GAP = 48  # sentinel bytes before, between and after the outputs (a multiple of every element size)


def arena_outs(kernel_results: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One sentinel-filled uint8 buffer and, inside it, one contiguous view per
    result (same shape and dtype), each after GAP bytes of sentinel."""
    sizes = [t.numel() * t.element_size() for t in kernel_results]
    arena = torch.full((GAP * (len(sizes) + 1) + sum(sizes),), SENTINEL, dtype=torch.uint8, device=kernel_results[0].device)
    outs, off = [], GAP
    for t, n in zip(kernel_results, sizes):
        outs.append(arena[off: off + n].view(t.dtype).view(t.shape))
        off += n + GAP
    return arena, outs


def untouched(arena: torch.Tensor, outs: list[torch.Tensor]) -> bool:
    """Whether every byte of ``arena`` outside ``outs`` still holds the sentinel."""
    covered = torch.zeros(arena.shape, dtype=torch.bool, device=arena.device)
    for o in outs:
        start = o.storage_offset() * o.element_size()
        covered[start: start + o.numel() * o.element_size()] = True
    return bool((arena[~covered] == SENTINEL).all())


class Allocations:
    """Bytes allocated through torch.empty / torch.zeros by code of one module."""

    def __init__(self, monkeypatch, module):
        self.bytes = 0
        for fn in ("empty", "zeros"):
            monkeypatch.setattr(torch, fn, self._counting(getattr(torch, fn), module.__name__))

    def _counting(self, alloc, module_name: str):
        def counted(*shape, dtype=None, **kw):
            t = alloc(*shape, dtype=dtype, **kw)
            if sys._getframe(1).f_globals.get("__name__") == module_name:
                self.bytes += t.numel() * t.element_size()
            return t

        return counted


def check_outs(monkeypatch, module, kernel, inputs, exact_scratch: bool = True) -> None:
    """(a) the same bits as ``outs=None``, (b) ``outs`` returned, (c) nothing else
    in the buffer written, and what the launch allocates within scratch_bytes."""
    want = kernel.launch(inputs)
    arena, outs = arena_outs(want)
    assert all(o.storage_offset() > 0 for o in outs)
    allocated = Allocations(monkeypatch, module)
    got = kernel.launch(inputs, outs)
    monkeypatch.undo()
    assert len(got) == len(outs) and all(g is o for g, o in zip(got, outs))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, i
        assert torch.equal(g.view(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), (kernel.name, i)
    assert untouched(arena, outs), kernel.name
    if exact_scratch:
        assert allocated.bytes == kernel.scratch_bytes, (kernel.name, allocated.bytes, kernel.scratch_bytes)
    else:
        assert allocated.bytes <= kernel.scratch_bytes, (kernel.name, allocated.bytes, kernel.scratch_bytes)


PATHS = pytest.mark.parametrize("limit", [16384, 4], ids=["registers", "loop"])


@PATHS
def test_softmax_family(device, monkeypatch, limit):
    gen = torch.Generator().manual_seed(0)
    x = rand(3, 7, 5, device=device, gen=gen)
    for op_cls, ins in [(nv.SoftmaxOp, [x]), (nv.LogSoftmaxOp, [x]),
                        (nv.SoftmaxBackwardOp, [x, x.flip(0)]), (nv.LogSoftmaxBackwardOp, [x, x.flip(0)])]:
        op = build(op_cls, ins, {"dim": 1})
        check_outs(monkeypatch, rowwise, lowering_for(op)(op, None, max_row_block=limit), ins)


@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_layer_norm_and_backward(device, monkeypatch, limit, dtype):
    gen = torch.Generator().manual_seed(1)
    x = rand(3, 7, 13, dtype=dtype, device=device, gen=gen)
    w, b = rand(13, dtype=dtype, device=device, gen=gen), rand(13, dtype=dtype, device=device, gen=gen)
    op = build(nv.LayerNormOp, [x, w, b], {"eps": 1e-5})
    check_outs(monkeypatch, rowwise, lowering_for(op)(op, None, max_row_block=limit), [x, w, b])
    _, mean, rstd = IMPLS[nv.LayerNormOp](op, [x, w, b])
    g = rand(3, 7, 13, dtype=dtype, device=device, gen=gen)
    ins = [g, x, w, mean, rstd]
    op = build(nv.LayerNormBackwardOp, ins)
    kernel = lowering_for(op)(op, None, max_row_block=limit, partial_programs=4)
    check_outs(monkeypatch, rowwise, kernel, ins)
    # mean and rstd as strided views are read where they lie (no copy: the scratch stays exact)
    ms = [torch.empty(7, 3, dtype=dtype, device=device).t().copy_(t) for t in (mean, rstd)]
    assert not ms[0].is_contiguous()
    check_outs(monkeypatch, rowwise, kernel, [g, x, w, *ms])


@PATHS
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_and_backward(device, monkeypatch, limit, reduction):
    gen = torch.Generator().manual_seed(2)
    logits = rand(9, 23, device=device, gen=gen) * 3
    target = torch.randint(0, 23, (9,), generator=gen).to(device)
    target[1::3] = -100
    target[0] = 23  # out of range: masked, and no host read of it
    props = {"ignore_index": -100, "reduction": reduction, "label_smoothing": 0.1}
    op = build(nv.CrossEntropyOp, [logits, target], props)
    check_outs(monkeypatch, rowwise, lowering_for(op)(op, None, max_row_block=limit), [logits, target])
    grad = rand(9, device=device, gen=gen) if reduction == "none" else torch.tensor(1.7, device=device)
    ins = [grad, logits, target]
    op = build(nv.CrossEntropyBackwardOp, ins, props)
    check_outs(monkeypatch, rowwise, lowering_for(op)(op, None, max_row_block=limit), ins)


@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
def test_attention_and_backward(device, monkeypatch, with_bias):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (rand(2, 2, t, 24, device=device, gen=gen) for t in (21, 37, 37))
    z = [rand(2, 1, 1, 37, device=device, gen=gen)] if with_bias else []
    small = LoweringConfig(kind="attention", block_m=16, block_n=16, num_warps=4, num_stages=1)
    props = {"causal": True, "scale": 0.25}
    op = build(nv.AttentionOp, [q, k, v, *z], props)
    check_outs(monkeypatch, attention, attention.lower_attention(op, small), [q, k, v, *z])
    out, lse = IMPLS[nv.AttentionOp](op, [q, k, v, *z])
    ins = [rand(*q.shape, device=device, gen=gen), q, k, v, out, lse, *z]
    op = build(nv.AttentionBackwardOp, ins, props)
    check_outs(monkeypatch, attention, attention.lower_attention_backward(op, small), ins)


LCE_CASES = [  # (id, head, bias, chunk): one chunk or several; an f32 bias beside a bf16 head keeps its own d
    ("f32-chunks", f32, None, 3),
    ("f32-bias-one-chunk", f32, f32, 16),
    ("bf16-f32-bias", bf16, f32, 3),
    ("bf16-bf16-bias", bf16, bf16, 2),
]


@pytest.mark.parametrize("case", LCE_CASES, ids=[c[0] for c in LCE_CASES])
def test_linear_cross_entropy_its_backward_and_with_grad(device, monkeypatch, case):
    _, elem, bias_elem, chunk = case
    n, d, vocab = LCE_N, LCE_D, LCE_V  # the shapes test_linear_ce's ops are built with
    fwd, bwd = linear_ce_ops(elem, bias_elem, {"ignore_index": -100, "reduction": "mean", "chunk": chunk}, f32)
    dt = torch.bfloat16 if elem == bf16 else torch.float32
    gen = torch.Generator().manual_seed(4)
    h, w = torch.randn(n, d, generator=gen).to(dt), (torch.randn(vocab, d, generator=gen) * 0.5).to(dt)
    t = torch.randint(0, vocab, (n,), generator=gen)
    t[2] = -100
    bias = [torch.randn(vocab, generator=gen).to(torch.bfloat16 if bias_elem == bf16 else torch.float32)] if bias_elem else []
    xs = [x.to(device) for x in (h, w, t, *bias)]
    kernel = linear_ce.lower_linear_cross_entropy(fwd, None, max_block=16)
    check_outs(monkeypatch, linear_ce, kernel, xs, exact_scratch=False)
    kernel = linear_ce.lower_linear_cross_entropy_backward(bwd, None, max_block=16)
    check_outs(monkeypatch, linear_ce, kernel, [torch.tensor(1.3, device=device), *xs], exact_scratch=False)
    assert kernel.scratch_bytes >= math.prod((min(chunk, n), vocab)) * h.element_size()  # the logits buffer at least
    kernel = linear_ce.lower_linear_cross_entropy_with_grad(linear_ce_merged(fwd), None, max_block=16)
    check_outs(monkeypatch, linear_ce, kernel, [torch.tensor(1.3, device=device), *xs], exact_scratch=False)


def test_wrong_outs_are_refused(device):
    x = rand(4, 6, device=device)
    op = build(nv.SoftmaxOp, [x], {"dim": 1})
    kernel = lowering_for(op)(op, None)
    for bad in ([torch.empty(6, 4, device=device)], [torch.empty(4, 6, dtype=torch.float64, device=device)],
                [torch.empty(6, 4, device=device).t()], []):
        with pytest.raises(ValueError, match="output"):
            kernel.launch([x], bad)
