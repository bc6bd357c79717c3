"""The matmul epilogue's row statistics (``Epilogue.row_stats``: per row and column tile,
the maximum of a body value and the sum of exp(value - maximum), the LM head's
log-sum-exp partials) through the interpreter: the stored values bit for bit the plain
matmul's, the statistics against float64 from those values, ragged edges (the columns
past N left out, the rows past M not stored), a sliced epilogue, pointer and TMA loads,
the warp-specialized kernel; and the configs that cannot carry them refused."""

import dataclasses

import pytest
import torch

import nova.log
from nova.codegen.triton import matmul as mm
from nova.codegen.triton.linear_ce import stats_config
from nova.schedule.config import LoweringConfig

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def _cfg(bm, bn, instruction="mma", persistent=False, warps=4, split_k=1):
    return LoweringConfig(kind="matmul", block_m=bm, block_n=bn, block_k=32, group_m=2, split_k=split_k,
                          persistent=persistent, num_warps=warps, num_stages=2, instruction=instruction)  # fmt: skip


def _stats_epilogue(M, N, bn, dtype):
    rounding = f"e_tile.to({mm._TL_DTYPE[str(dtype).removeprefix('torch.')]}).to(tl.float32)"
    return mm.Epilogue(shape=(M, N), operands=(), body=f"e_z = {rounding}", stores=(("e_z", "f32", dtype),),
                       out_shapes=((M, N),), row_stats="e_z", row_stats_cols=bn)  # fmt: skip


def _expected(z: torch.Tensor, bn: int):
    """Per row and column tile of ``z``: (max, sum of exp(z - max)) in float64."""
    M, N = z.shape
    tiles = -(-N // bn)
    m = torch.empty(M, tiles, dtype=torch.float64)
    s = torch.empty(M, tiles, dtype=torch.float64)
    for t in range(tiles):
        part = z[:, t * bn:(t + 1) * bn].double()
        m[:, t] = part.max(dim=1).values
        s[:, t] = torch.exp(part - m[:, t:t + 1]).sum(dim=1)
    return m, s


@pytest.mark.parametrize("cfg", [
    _cfg(16, 32),
    _cfg(32, 64, warps=8),
    _cfg(16, 32, instruction="wgmma+tma"),
    _cfg(32, 32, instruction="wgmma+tma", persistent=True),
    _cfg(64, 64, instruction="wgmma+tma+ws", persistent=True),
], ids=["pointers", "8-warps", "tma", "persistent", "warp-specialized"])
@pytest.mark.parametrize("M,N,K", [(64, 128, 64), (50, 100, 40)], ids=["even", "ragged"])
def test_row_statistics_of_the_stored_logits(cfg, M, N, K, device):
    g = torch.Generator().manual_seed(M + N + K)
    a = (torch.randn(M, K, generator=g) * 2).to(torch.bfloat16).to(device)
    b = torch.randn(N, K, generator=g).to(torch.bfloat16).to(device).t()  # the LM head's w^T: column-major B
    ep = _stats_epilogue(M, N, cfg.block_n, torch.bfloat16)
    z, rm, rs = mm.matmul_epilogue(a, b, ep, [], torch.bfloat16, cfg=cfg, precision="bf16")
    plain = mm.matmul(a, b, cfg=dataclasses.replace(cfg, instruction=cfg.instruction.replace("+ws", "")),
                      precision="bf16")
    assert torch.equal(z, plain)  # the epilogue stores what the matmul stores
    tiles = -(-N // cfg.block_n)
    assert rm.shape == rs.shape == (M, tiles) and rm.dtype == rs.dtype == torch.float32
    m, s = _expected(z.cpu(), cfg.block_n)
    assert torch.equal(rm.cpu().double(), m)  # a maximum is one of the values
    torch.testing.assert_close(rs.cpu().double(), s, rtol=2e-6, atol=0)


def test_a_sliced_epilogue_carries_the_statistics_across_its_slices(device):
    """A tile over EPILOGUE_SLICE elements is worked through in column slices: the running
    maximum and sum go from slice to slice, the last slices past N masked."""
    cfg = _cfg(64, 256)
    M, N, K = 70, 300, 32
    ep = _stats_epilogue(M, N, 256, torch.bfloat16)
    assert mm.epilogue_slices(ep, 64, 256) == 2
    g = torch.Generator().manual_seed(3)
    a = torch.randn(M, K, generator=g).to(torch.bfloat16).to(device)
    b = torch.randn(K, N, generator=g).to(torch.bfloat16).to(device)
    source = mm.matmul_source(cfg, has_bias=False, precision="bf16", out_dtype="bfloat16", in_dtype="bfloat16",
                              epilogue=ep)
    assert "tl.split(e_split)" in source and source.count("e_rm = e_sm") == 4  # 2 slices, even and ragged forms
    z, rm, rs = mm.matmul_epilogue(a, b, ep, [], torch.bfloat16, cfg=cfg, precision="bf16")
    m, s = _expected(z.cpu(), 256)
    assert torch.equal(rm.cpu().double(), m)
    torch.testing.assert_close(rs.cpu().double(), s, rtol=2e-6, atol=0)


def test_row_statistics_refuse_a_split_or_another_tile_width(device):
    a = torch.randn(32, 512).to(torch.bfloat16).to(device)
    b = torch.randn(512, 64).to(torch.bfloat16).to(device)
    with pytest.raises(ValueError, match="row statistics"):
        mm.matmul_epilogue(a, b, _stats_epilogue(32, 64, 32, torch.bfloat16), [], torch.bfloat16,
                           cfg=_cfg(16, 32, split_k=2), precision="bf16")
    with pytest.raises(ValueError, match="row statistics"):
        mm.matmul_epilogue(a, b, _stats_epilogue(32, 64, 64, torch.bfloat16), [], torch.bfloat16,
                           cfg=_cfg(16, 32), precision="bf16")


def test_row_statistics_in_the_warp_specialized_kernel(device, monkeypatch):
    """Row statistics (reductions along the tile's rows) run partitioned, unlike column sums
    (Triton 3.6's partitioner fails on those): the warp-specialized kernel runs, nothing logged,
    the statistics of its stored logits. ``stats_config`` keeps a ws config with
    ``ROW_STATS_WS``, else gives the 8-warp persistent kernel (at most 3 stages), unsplit."""
    from nova.codegen.triton import linear_ce

    monkeypatch.setattr(nova.log, "_SEEN", set())
    cfg = _cfg(64, 64, instruction="wgmma+tma+ws", persistent=True)
    g = torch.Generator().manual_seed(5)
    a = torch.randn(128, 64, generator=g).to(torch.bfloat16).to(device)
    b = torch.randn(96, 64, generator=g).to(torch.bfloat16).to(device).t()
    rec: dict = {}
    z, rm, rs = mm.matmul_epilogue(a, b, _stats_epilogue(128, 96, 64, torch.bfloat16), [], torch.bfloat16, cfg=cfg,
                                   record=rec)  # fmt: skip
    assert any("warp-specialized" in open(p).read(400) for p in rec)
    m, s = _expected(z.cpu(), 64)
    assert torch.equal(rm.cpu().double(), m)
    torch.testing.assert_close(rs.cpu().double(), s, rtol=2e-6, atol=0)
    big = LoweringConfig(kind="matmul", block_m=128, block_n=256, block_k=64, group_m=16, split_k=2, persistent=True,
                         num_warps=4, num_stages=4, instruction="wgmma+tma+ws")  # fmt: skip
    assert stats_config(big) == dataclasses.replace(big, split_k=1)
    monkeypatch.setattr(linear_ce, "ROW_STATS_WS", False)
    got = stats_config(big)
    assert (got.block_m, got.block_n, got.split_k, got.num_warps, got.num_stages, got.instruction) == (
        128, 256, 1, 8, 3, "wgmma+tma")
    plain = dataclasses.replace(big, instruction="wgmma+tma", num_warps=8, num_stages=2)
    assert stats_config(plain) == dataclasses.replace(plain, split_k=1)
