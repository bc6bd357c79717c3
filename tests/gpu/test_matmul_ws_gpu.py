"""The warp-specialized persistent matmul (configurator rule 8b, matmul.py's docstring) on
the H200: every operand layout, even and ragged shapes, C and an epilogue, against the same
tile in the kernel without partitioning (step 8's persistent TMA kernel) and torch."""

import dataclasses

import pytest
import torch

from nova.codegen.triton import matmul as mm
from nova.schedule.config import LoweringConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a Hopper GPU")

WS = LoweringConfig(kind="matmul", block_m=128, block_n=256, block_k=64, group_m=8, persistent=True, num_warps=4,
                    num_stages=4, instruction="wgmma+tma+ws")


def _operands(M, N, K, la, lb, g):
    a = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(K, N, device="cuda", generator=g).to(torch.bfloat16)
    if la == "col":
        a = a.t().contiguous().t()
    if lb == "col":
        b = b.t().contiguous().t()
    return a, b


@pytest.mark.parametrize("M,N,K", [(8192, 3072, 768), (8192 + 72, 3072 - 56, 768 + 40)], ids=["even", "ragged"])
@pytest.mark.parametrize("la,lb", [("row", "col"), ("row", "row"), ("col", "row"), ("col", "col")])
@pytest.mark.parametrize("block_n", [256, 128], ids=["128x256", "128x128"])  # 128x128: rule 8b's half tile
def test_ws_matmul_is_the_unpartitioned_kernel(M, N, K, la, lb, block_n):
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = _operands(M, N, K, la, lb, g)
    ws = dataclasses.replace(WS, block_n=block_n)
    rec: dict = {}
    got = mm.matmul(a, b, cfg=ws, record=rec)
    assert any("warp-specialized" in open(p).read(300) for p in rec), "the warp-specialized kernel did not run"
    plain = mm.matmul(a, b, cfg=dataclasses.replace(ws, num_warps=8, instruction="wgmma+tma"))
    ref = (a.double() @ b.double()).to(torch.bfloat16)
    torch.cuda.synchronize()
    assert (got.double() - ref.double()).abs().max().item() <= 2 ** -7 * ref.double().abs().max().item()
    assert torch.equal(got, plain), (got.double() - plain.double()).abs().max().item()


@pytest.mark.parametrize("tile,stages", [((128, 256), 2), ((128, 128), 4)], ids=["128x256", "128x128"])
@pytest.mark.parametrize("M,N,K,split", [(768, 3072, 32768, 7), (768 + 40, 2304 - 24, 32768 - 200, 6)],
                         ids=["even", "ragged"])
def test_split_ws_matmul_is_the_unpartitioned_split_kernel(M, N, K, split, tile, stages):
    """A weight gradient's split-K (A = dY^T M-major, B N-major) in the partitioned loop:
    bit for bit the persistent split kernel without partitioning (configurator rule 8c)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    a, b = _operands(M, N, K, "col", "row", g)
    ws = dataclasses.replace(WS, block_m=tile[0], block_n=tile[1], num_stages=stages, split_k=split)
    rec: dict = {}
    got = mm.matmul(a, b, cfg=ws, record=rec)
    assert any("warp-specialized" in open(p).read(300) for p in rec), "the warp-specialized kernel did not run"
    plain = mm.matmul(a, b, cfg=dataclasses.replace(ws, num_warps=8, instruction="wgmma+tma"))
    ref = (a.double() @ b.double()).to(torch.bfloat16)
    torch.cuda.synchronize()
    assert (got.double() - ref.double()).abs().max().item() <= 2 ** -7 * ref.double().abs().max().item()
    assert torch.equal(got, plain), (got.double() - plain.double()).abs().max().item()


@pytest.mark.parametrize("pre", [("a", "b"), ()], ids=["prerounded", "staged"])
@pytest.mark.parametrize("M,N,K", [(16384, 2304, 768), (8192 + 72, 1536 - 56, 384 + 40)], ids=["even", "ragged"])
def test_tf32_ws_matmul_is_the_unpartitioned_staged_kernel(M, N, K, pre):
    """The staged tf32 path in the partitioned loop (configurator rule 8b's WS_TF32): fp32
    operands rounded before the kernel (prerounded, or staged), both K-major, C in fp32: bit for
    bit the unpartitioned staged kernel of the same tile, within tf32 of float64."""
    g = torch.Generator(device="cuda").manual_seed(2)
    a = torch.randn(M, K, device="cuda", generator=g)
    b = torch.randn(N, K, device="cuda", generator=g).t()
    if pre:
        a, b = mm.round_to_tf32(a), mm.round_to_tf32(b)
    ws = LoweringConfig(kind="matmul", block_m=128, block_n=128, block_k=32, group_m=16, persistent=True,
                        num_warps=4, num_stages=4, instruction="wgmma+tma+stage_a+stage_b+ws")
    rec: dict = {}
    got = mm.matmul(a, b, cfg=ws, precision="tf32-rn", prerounded=pre, record=rec)
    assert any("warp-specialized" in open(p).read(300) for p in rec if p != "tf32_stage"), "the WS kernel did not run"
    plain = mm.matmul(a, b, cfg=dataclasses.replace(ws, num_warps=8, num_stages=3, instruction="wgmma+tma+stage_a+stage_b"),
                      precision="tf32-rn", prerounded=pre)
    ref = mm.round_to_tf32(a).double() @ mm.round_to_tf32(b).double()
    torch.cuda.synchronize()
    assert (got.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert torch.equal(got, plain), (got.double() - plain.double()).abs().max().item()
