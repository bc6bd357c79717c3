"""The launch contract of the elementwise, reduction, scan, embedding and matmul
kernels (``nova.codegen.triton.lowering``), through the Triton interpreter:

* ``launch(inputs, outs)`` writes its results into ``outs`` (views at a nonzero
  offset into a larger buffer, as the step's arena hands them out) and returns
  those very tensors, bit for bit what ``launch(inputs)`` returns, without
  touching a byte around them;
* the same-index elementwise ops may write over one of their own inputs;
* ``Kernel.scratch_bytes`` (``matmul.scratch_bytes`` for the matmul) bounds what a
  launch allocates besides its results."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from nova.codegen.triton import elementwise as ew
from nova.codegen.triton import embedding, reduce, scan  # noqa: F401  (they register their lowerings)
from nova.codegen.triton import matmul as mm
from nova.codegen.triton.lowering import lowering_for
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step
from nova.ir.types import from_torch_dtype, tensor
from nova.schedule.config import LoweringConfig
from nova.transforms.plan_memory import SAME_INDEX

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inf/nan warnings inside the interpreter

F32, F64, BF16, I64, BOOL = torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool
SENTINEL = 0xA5
OFFSET = 80  # bytes before the result: a nonzero storage offset, 16-byte aligned (TMA reads it)
SMALL = LoweringConfig(kind="elementwise", block=16, num_warps=1)  # several programs on small tensors
SPLIT = LoweringConfig(kind="reduction", block=8, split_k=3, num_warps=1)  # a two-pass reduction


def build(cls, ins, props=None, hint=None):
    """One ``cls`` op over fresh arguments of (shape, dtype) ``ins``."""
    slots = [Slot("batch", f"x{i}", tensor(s, from_torch_dtype(d))) for i, (s, d) in enumerate(ins)]
    _, fn = new_step(slots)
    result = None if hint is None else tensor(hint[0], from_torch_dtype(hint[1]))
    return OpBuilder(fn.body.block).create(cls, list(fn.body.block.args), props, result)


def rand(shape, dtype=F32, seed=0, low=0.5):
    g = torch.Generator().manual_seed(seed)
    return (low + torch.rand(shape, generator=g, dtype=F64)).to(dtype)


def lowered(cls, xs, props=None, hint=None, cfg=SMALL):
    """(kernel, inputs) of one op over the tensors ``xs``."""
    op = build(cls, [(tuple(x.shape), x.dtype) for x in xs], props, hint)
    return lowering_for(op)(op, cfg), xs


@dataclass
class Matmul:
    """``mm.matmul`` behind the launch signature (it is not a lowering's Kernel)."""

    cfg: LoweringConfig
    precision: str = "ieee"

    def launch(self, xs, outs=None):
        return [mm.matmul(*xs, cfg=self.cfg, precision=self.precision, out=ew.only_out(outs))]


def mm_cfg(split_k=1, instruction="fma"):
    return LoweringConfig(kind="matmul", block_m=16, block_n=16, block_k=16, split_k=split_k, num_warps=4,
                          num_stages=2, instruction=instruction)  # fmt: skip


def transposed(shape, dtype=F32, seed=0):
    return rand((*shape[:-2], shape[-1], shape[-2]), dtype, seed).transpose(-1, -2)


def embedding_backward(dtype):
    g = rand((3, 5, 6), dtype, seed=3)
    ids = torch.tensor([[0, 3, 3, 8, 2], [9, -1, 4, 4, 1], [3, 7, 0, 0, 2]])  # repeats, out of range
    return lowered(nv.EmbeddingBackwardOp, [g, ids], {"num_embeddings": 9, "padding_idx": 4}, cfg=None)


CASES = {
    "add-broadcast": lambda: lowered(nv.AddOp, [transposed((4, 9)), rand((9,), seed=1)]),
    "exp": lambda: lowered(nv.ExpOp, [rand((5, 7), BF16)]),
    "lt-bool": lambda: lowered(nv.LtOp, [rand((6, 5)), rand((5,), seed=2)]),
    "where": lambda: lowered(nv.WhereOp, [rand((3, 1)) > 1.0, rand((3, 8), I64), rand((8,), I64, seed=4)]),
    "gelu-tanh": lambda: lowered(nv.GeluOp, [rand((4, 9), F64)], {"approximate": "tanh"}),
    "cast": lambda: lowered(nv.CastOp, [transposed((5, 6), F64)], hint=((5, 6), BF16)),
    "full": lambda: lowered(nv.FullOp, [], {"value": 1.5}, hint=((3, 11), F32)),
    "arange": lambda: lowered(nv.ArangeOp, [], {"start": 3, "step": -2}, hint=((37,), I64)),
    "dropout-mask": lambda: lowered(nv.DropoutMaskOp, [torch.tensor(7)], {"p": 0.3, "salt": 5}, hint=((5, 9), F32)),
    "broadcast-to": lambda: lowered(nv.BroadcastToOp, [rand((3, 1, 4))], hint=((2, 3, 5, 4), F32)),
    "transpose": lambda: lowered(nv.TransposeOp, [rand((2, 3, 4), BF16)], {"perm": (2, 0, 1)}),
    "slice": lambda: lowered(nv.SliceOp, [rand((4, 7, 5))], {"dim": 1, "start": 1, "end": 7, "step": 2}),
    "reshape": lambda: lowered(nv.ReshapeOp, [transposed((2, 3, 4), F64)], hint=((4, 6), F64)),
    "pad": lambda: lowered(nv.PadOp, [rand((3, 4, 2))], {"dim": 1, "start": 2, "step": 1, "size": 9}),
    "copy-bool": lambda: (ew.copy_kernel((4, 6), BOOL), [(rand((6, 4)) > 1.0).t()]),
    "reduce-sum": lambda: lowered(nv.ReduceSumOp, [rand((6, 5, 7))], {"dims": (0, 2), "keepdim": True}, cfg=None),
    "reduce-max-split": lambda: lowered(nv.ReduceMaxOp, [rand((600, 5), BF16)], {"dims": (0,), "keepdim": False},
                                        cfg=SPLIT),  # fmt: skip
    "reduce-no-dims": lambda: lowered(nv.ReduceSumOp, [rand((3, 4))], {"dims": (), "keepdim": False}, cfg=None),
    "cumsum": lambda: lowered(nv.CumsumOp, [transposed((5, 9))], {"dim": 1, "reverse": True}, cfg=None),
    "cumsum-scalar": lambda: lowered(nv.CumsumOp, [torch.tensor(2.5)], {"dim": 0, "reverse": False}, cfg=None),
    "embedding-bool": lambda: lowered(nv.EmbeddingOp, [rand((7, 3)) > 1.0, torch.tensor([[3, 0, 6], [1, 1, 2]])],
                                      cfg=None),  # fmt: skip
    "embedding-f32": lambda: lowered(nv.EmbeddingOp, [transposed((11, 5)), torch.tensor([4, 10, 0, 4])], cfg=None),
    "embedding-backward-f32": lambda: embedding_backward(F32),
    "embedding-backward-bf16": lambda: embedding_backward(BF16),
    "embedding-backward-f64": lambda: embedding_backward(F64),
    "matmul": lambda: (Matmul(mm_cfg()), [rand((17, 20)), transposed((20, 33))]),
    "matmul-batched-split-k": lambda: (Matmul(mm_cfg(split_k=3)), [rand((2, 9, 40)), rand((2, 40, 18))]),
    "matmul-staged-tf32": lambda: (Matmul(mm_cfg(instruction="fma+stage_a+stage_b"), "tf32-rn"),
                                   [transposed((18, 24)), rand((24, 16))]),  # fmt: skip
    "matmul-empty-k-bias": lambda: (Matmul(mm_cfg()), [rand((4, 0)), rand((0, 5)), rand((5,), BF16)]),
}


def arena(results):
    """One sentinel-filled byte buffer and, inside it, a contiguous view per result
    (each at a nonzero offset, with sentinel bytes between and after them)."""
    sizes = [r.numel() * r.element_size() for r in results]
    buf = torch.full((OFFSET * (len(results) + 1) + sum(sizes),), SENTINEL, dtype=torch.uint8)
    views, at = [], OFFSET
    for r, size in zip(results, sizes):
        flat = buf[at : at + size]
        views.append(flat.view(r.dtype).view(r.shape))
        at += size + OFFSET
    return buf, views


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("case", list(CASES))
def test_launch_writes_into_the_given_outs(case):
    kernel, xs = CASES[case]()
    expected = kernel.launch(xs)
    buf, outs = arena(expected)
    assert all(o.storage_offset() > 0 for o in outs)
    written = buf.clone()
    got = kernel.launch(xs, outs)
    assert len(got) == len(outs) and all(g is o for g, o in zip(got, outs))
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype and torch.equal(bits(g), bits(e))
    inside = torch.zeros_like(buf, dtype=torch.bool)
    for o in outs:
        start = o.storage_offset() * o.element_size()
        inside[start : start + o.numel() * o.element_size()] = True
    assert torch.all(buf[~inside] == SENTINEL), "bytes outside the outs were written"
    assert torch.equal(buf[~inside], written[~inside])


def test_outs_of_the_wrong_layout_are_refused():
    kernel, xs = CASES["exp"]()
    with pytest.raises(ValueError, match="out is"):
        kernel.launch(xs, [torch.empty((7, 5), dtype=BF16).t()])
    with pytest.raises(ValueError, match="out is"):
        kernel.launch(xs, [torch.empty((5, 7), dtype=F32)])


# --------------------------------------------------------------------------- in place

_UNARY_INPUT = {nv.LogOp: 0.5, nv.SqrtOp: 0.5, nv.RsqrtOp: 0.5}  # positive inputs for these; others signed


def same_index_inputs(cls):
    """(inputs, props) of one same-index op: every operand [5, 9] (several programs at block 16)."""
    signed = rand((5, 9), seed=11, low=-0.75)
    if cls is nv.WhereOp:
        return [rand((5, 9), seed=12) > 1.0, signed, rand((5, 9), seed=13)], None
    if cls in (nv.GeluOp, nv.GeluBackwardOp):
        xs = [signed * 3] if cls is nv.GeluOp else [rand((5, 9), seed=14), signed * 3]
        return xs, {"approximate": "none"}
    if cls in (nv.AddOp, nv.SubOp, nv.MulOp, nv.DivOp, nv.MaximumOp, nv.PowOp):
        return [rand((5, 9), seed=15), signed if cls is not nv.PowOp else rand((5, 9), seed=16)], None
    return [rand((5, 9), seed=17, low=_UNARY_INPUT.get(cls, -0.75))], None


@pytest.mark.parametrize("cls", SAME_INDEX, ids=lambda c: c.name)
def test_same_index_ops_update_an_input_in_place(cls):
    """out is inputs[k] itself (a parameter updated in place): the same bits as a
    fresh result, for every input of the result's dtype."""
    xs, props = same_index_inputs(cls)
    kernel, _ = lowered(cls, xs, props)
    (expected,) = kernel.launch(xs)
    for k, x in enumerate(xs):
        if x.dtype != expected.dtype:
            continue  # where's condition
        ins = [t.clone() for t in xs]
        (got,) = kernel.launch(ins, [ins[k]])
        assert got is ins[k] and torch.equal(bits(got), bits(expected)), k


def test_in_place_over_a_broadcast_operand():
    """a += b with b broadcast: only a is overwritten, b is read again by every row."""
    a, b = rand((6, 7), seed=18), rand((7,), seed=19)
    kernel, _ = lowered(nv.AddOp, [a, b])
    expected = a + b
    (got,) = kernel.launch([a, b], [a])
    assert got is a and torch.equal(a, expected)


# --------------------------------------------------------------------------- scratch


class Allocations:
    """Bytes allocated through torch.empty / torch.zeros while installed."""

    def __init__(self, monkeypatch):
        self.bytes = 0
        for name in ("empty", "zeros"):
            monkeypatch.setattr(torch, name, self._counting(getattr(torch, name)))

    def _counting(self, make):
        def counted(*args, **kwargs):
            t = make(*args, **kwargs)
            self.bytes += t.numel() * t.element_size()
            return t

        return counted


@pytest.mark.parametrize("case", ["reduce-max-split", "reduce-sum", "embedding-backward-bf16", "embedding-backward-f32",
                                  "cumsum", "add-broadcast"])  # fmt: skip
def test_scratch_bytes_bounds_what_a_launch_allocates(case, monkeypatch):
    kernel, xs = CASES[case]()
    _, outs = arena(kernel.launch(xs))
    counted = Allocations(monkeypatch)
    kernel.launch(xs, outs)
    assert counted.bytes <= kernel.scratch_bytes
    if case in ("reduce-max-split", "embedding-backward-bf16", "embedding-backward-f32"):
        assert counted.bytes > 0  # a workspace / the sorted ids and their permutation: the bound is not vacuous


@pytest.mark.parametrize("case", ["matmul", "matmul-batched-split-k", "matmul-staged-tf32"])
def test_matmul_scratch_bytes_bounds_what_a_launch_allocates(case, monkeypatch):
    kernel, (a, b) = CASES[case]()
    (c,) = kernel.launch([a, b])
    _, outs = arena([c])
    batch = c.shape[0] if c.dim() == 3 else 1
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    bound = mm.scratch_bytes(M, N, K, batch, a.dtype, b.dtype, c.dtype, kernel.cfg)
    counted = Allocations(monkeypatch)
    kernel.launch([a, b], outs)
    assert counted.bytes <= bound
    assert (counted.bytes > 0) == (case != "matmul")


def test_matmul_scratch_bytes_without_a_config_covers_the_configurators_choices():
    """cfg=None: the bound holds whatever config the launch is given (here: the
    split-K and staged configs the configurator picks for a long K)."""
    M, N, K = 64, 96, 65536
    bound = mm.scratch_bytes(M, N, K, 1, F32, F32, F32, None)
    for precision in mm.PRECISIONS:
        for lb in ("row", "col"):
            cfg = mm.configure(M, N, K, 1, F32, F32, precision, "row", lb, False, mm.device_spec(torch.device("cpu")))
            assert mm.scratch_bytes(M, N, K, 1, F32, F32, F32, cfg) <= bound
    assert mm.scratch_bytes(M, N, 0, 1, F32, F32, F32, None) == 0
