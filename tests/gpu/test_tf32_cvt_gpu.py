"""``matmul.TF32_RN_CVT``: the tf32 rounding as the ``cvt.rn.tf32.f32`` instruction gives the
bits of ``TF32_RN``'s integer arithmetic (``round_to_tf32`` on the host) on a Hopper GPU: random
values over the whole exponent range, exact ties to both sides, subnormals, the largest finite
values (which round to inf), infinities and the canonical NaN. Then the tf32 attention kernels
and a register-path tf32 matmul built with it give the bits of those built without it. The
CPU tests check the text (tests/kernels/test_matmul.py); the interpreter runs no inline assembly."""

import pytest
import torch

from nova.codegen.triton import matmul as mm
from nova.codegen.triton.source import load_kernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a Hopper GPU (cvt.rn.tf32.f32 is sm_90 and newer)")

_SRC = """
import triton
import triton.language as tl
{fn}

@triton.jit
def round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, tf32_rn(x), mask=offs < n)
"""


def _values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64)  # every exponent, both signs
    bits = torch.where(torch.rand(bits.shape, generator=g) < 0.5, bits, bits - 2**31)
    finite = bits[((bits & 0x7F800000) != 0x7F800000)]  # NaN payloads left out: see TF32_RN's comment
    tie = torch.arange(0, 4096, dtype=torch.int64) << 13 | 0x1000  # exactly half an ulp, kept bit even or odd
    special = torch.tensor([0, 1, 0x1000, 0x3000, 0x7FFFFF, 0x7F7FFFFF, 0x7F7FEFFF, 0x7F7FF000, 0x7F800000,
                            0x7FC00000], dtype=torch.int64)  # fmt: skip
    out = torch.cat([finite, tie, tie | 0x3F800000, special, special | -(2**31)])
    out = torch.where(out >= 2**31, out - 2**32, out)
    return out.to(torch.int32).view(torch.float32)


def _rounded(x: torch.Tensor, cvt: bool, monkeypatch) -> torch.Tensor:
    monkeypatch.setattr(mm, "TF32_RN_CVT", cvt)
    kernel, _ = load_kernel(_SRC.format(fn=mm.tf32_rn_fn()), "round_kernel")
    y = torch.empty_like(x)
    kernel[(triton_cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    return y


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_cvt_rounds_as_the_integer_arithmetic(monkeypatch):
    x = _values().cuda()
    want = mm.round_to_tf32(x.cpu())
    for cvt in (False, True):
        got = _rounded(x, cvt, monkeypatch).cpu()
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), cvt
        diff = got[~nan].view(torch.int32) != want[~nan].view(torch.int32)
        assert not bool(diff.any()), (cvt, x.cpu()[~nan][diff][:8], got[~nan][diff][:8], want[~nan][diff][:8])


def test_attention_and_a_register_path_matmul_are_the_same_bits(monkeypatch):
    from nova.codegen.triton import attention as A
    from nova.ir import dialect as nv
    from nova.ir.builder import OpBuilder
    from nova.ir.module import Slot, new_step
    from nova.ir.types import from_torch_dtype, tensor
    from nova.schedule.config import LoweringConfig

    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, do = (torch.randn(2, 4, 256, 64, device="cuda", generator=g) for _ in range(4))

    def build(op_cls, inputs):
        _, fn = new_step([Slot("batch", f"x{i}", tensor(t.shape, from_torch_dtype(t.dtype)))
                          for i, t in enumerate(inputs)])
        return OpBuilder(fn.body.block).create(op_cls, list(fn.body.block.args), {"causal": True, "scale": 0.125})

    a = torch.randn(4096, 1024, device="cuda", generator=g).t()  # M-major A (a weight gradient's): in registers
    b = torch.randn(4096, 512, device="cuda", generator=g)
    # unstaged (the configurator stages both operands of this shape on an H100: no rounding in the K loop then)
    register_a = LoweringConfig(kind="matmul", block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=3,
                                instruction="wgmma+tma")
    results = []
    for cvt in (False, True):
        monkeypatch.setattr(mm, "TF32_RN_CVT", cvt)
        o, lse = A.lower_attention(build(nv.AttentionOp, [q, k, v]), None, precision="tf32").launch([q, k, v])
        ins = [do, q, k, v, o, lse]
        grads = A.lower_attention_backward(build(nv.AttentionBackwardOp, ins), None, precision="tf32").launch(ins)
        used: dict[str, str] = {}
        c = mm.matmul(a, b, cfg=register_a, precision="tf32-rn", record=used)
        assert ("cvt.rn.tf32.f32" in "".join(used.values())) == cvt  # A was rounded in the K loop
        results.append([o, lse, *grads, c])
    for x, y in zip(*results, strict=True):
        assert torch.equal(x, y)
