"""nova.cat's Triton kernel (``elementwise.lower_cat``) through the interpreter,
against the reference executor (torch.cat): uneven pieces, pieces read through
their strides (attention's [B, H, T, D] gradients as [B, T, H, D] views), a
stride-0 zero piece, signed zeros kept, and a launch into an arena view."""

from __future__ import annotations

import pytest
import torch

import nova.backends.triton  # noqa: F401  (registers every lowering)
from nova.backends.reference import IMPLS
from nova.codegen.triton.lowering import lowering_for
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step
from nova.ir.types import from_torch_dtype, tensor
from nova.schedule.config import LoweringConfig

SMALL = LoweringConfig(kind="elementwise", block=16, num_warps=1)  # many programs, a ragged last one


def _cat(xs, dim):
    _, fn = new_step([Slot("batch", f"x{i}", tensor(x.shape, from_torch_dtype(x.dtype))) for i, x in enumerate(xs)])
    return OpBuilder(fn.body.block).create(nv.CatOp, list(fn.body.block.args), {"dim": dim})


def _check(xs, dim, cfg=SMALL):
    op = _cat(xs, dim)
    kernel = lowering_for(op)(op, cfg)
    (out,) = kernel.launch(xs)
    (ref,) = IMPLS[nv.CatOp](op, xs)
    assert out.is_contiguous() and out.dtype == ref.dtype
    assert torch.equal(out, ref) and torch.equal(torch.signbit(out), torch.signbit(ref))  # -0.0 stays -0.0
    return kernel


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_uneven_pieces_along_each_dim(dim):
    g = torch.Generator().manual_seed(0)
    sizes = [3, 1, 5]
    xs = []
    for n in sizes:
        shape = [2, 3, 4]
        shape[dim] = n
        xs.append(torch.randn(shape, generator=g))
    xs[1].view(-1)[0] = -0.0
    _check(xs, dim)


def test_attention_gradients_read_in_place_through_their_strides():
    # the backward of q, k, v = qkv.split(C, 2) after the concat stage: the [B, H, T, D]
    # gradients as [B, T, H, D] views, concatenated along the heads (a dense [B, T, 3H, D])
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(2, 3, 5, 4, generator=g).to(torch.bfloat16) for _ in range(3)]
    grads[2][1, 2, 3, 0] = -0.0
    views = [d.transpose(1, 2) for d in grads]
    assert not views[0].is_contiguous()
    kernel = _check(views, 2)
    assert "nova_cat_2x5x9x4_d2_3_bf16" == kernel.name


def test_a_broadcast_zero_piece_is_read_with_stride_zero():
    x, y = torch.randn(3, 2), torch.randn(3, 4)
    gap = torch.zeros(()).expand(3, 5)
    _check([x, gap, y], 1)


def test_one_piece_and_a_block_larger_than_the_tensor():
    _check([torch.randn(4, 3)], 1, cfg=None)


def test_launch_writes_into_a_view_of_a_larger_buffer():
    xs = [torch.randn(4, 3), torch.randn(4, 2)]
    op = _cat(xs, 1)
    kernel = lowering_for(op)(op, SMALL)
    arena = torch.full((64,), 7.0)
    out = arena[8:28].view(4, 5)
    (got,) = kernel.launch(xs, [out])
    assert got is out and torch.equal(out, torch.cat(xs, 1))
    assert torch.all(arena[:8] == 7.0) and torch.all(arena[28:] == 7.0)


def sm90_cases():
    views = [torch.empty(2, 3, 5, 64, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]
    op = _cat(views, 2)
    xs = [torch.empty(4, 3), torch.zeros(()).expand(4, 5)]
    op2 = _cat(xs, 1)
    return [(lambda: lowering_for(op)(op, None), views), (lambda: lowering_for(op2)(op2, SMALL), xs)]


def test_kernels_build_for_sm90():
    """The generated text compiles to sm_90 cubins (no GPU needed)."""
    from test_rowwise import run_sm90_build

    out = run_sm90_build(__file__).split()
    assert "nova_cat_2x5x9x64_d2_3_bf16" in out and "nova_cat_4x8_d1_2_f32" in out


if __name__ == "__main__":
    from test_rowwise import build_for_sm90

    print(" ".join(build_for_sm90(sm90_cases())))
