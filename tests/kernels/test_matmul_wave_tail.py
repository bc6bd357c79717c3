"""Configurator rule 8f's wave tail through the interpreter: a config with ``tail_at`` runs
C's head (rows or columns before ``tail_at``) at its own tile and the rest as a second
launch at ``configurator.tail_config`` (split along K where it says so). Each part is bit
for bit what its config gives on the whole product, the bias follows the columns, every
case a tail cannot take is refused, and the memory plan's bound counts both launches.
The H100 runs the same compiled: tests/gpu/test_matmul_tail_gpu.py."""

import dataclasses

import pytest
import torch

from nova.codegen.triton import matmul as mm
from nova.schedule import configurator as cf
from nova.schedule.config import LoweringConfig

HEAD_WS = LoweringConfig(kind="matmul", block_m=64, block_n=64, block_k=32, group_m=2, persistent=True, num_warps=4,
                         num_stages=3, instruction="wgmma+tma+ws")
HEAD_SPLIT = LoweringConfig(kind="matmul", block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=2,
                            instruction="wgmma+tma")


@pytest.fixture(autouse=True)
def small_tail(monkeypatch):
    monkeypatch.setattr(cf, "TAIL_TILE", (32, 32, 4, 2))  # the interpreter's sizes; the rule's own is 128x128


def _operands(M, N, K, la, lb, device):
    g = torch.Generator().manual_seed(M * 7 + N * 3 + K)
    a = torch.randn(M, K, generator=g).to(torch.bfloat16)
    b = torch.randn(K, N, generator=g).to(torch.bfloat16)
    a = a.t().contiguous().t() if la == "col" else a
    b = b.t().contiguous().t() if lb == "col" else b
    return a.to(device), b.to(device)


CASES = [  # (head config, axis, tail_at, tail split, M, N, K)
    (HEAD_WS, "m", 128, 1, 200, 136, 72),  # ragged rows and columns
    (HEAD_SPLIT, "m", 64, 3, 160, 96, 192),
    (HEAD_SPLIT, "n", 64, 2, 96, 160, 128),
]


@pytest.mark.parametrize("head,axis,at,split,M,N,K", CASES, ids=["ws-m", "split-m", "split-n"])
@pytest.mark.parametrize("la,lb", [("row", "col"), ("col", "row")])
def test_each_part_is_its_configs_product(head, axis, at, split, M, N, K, la, lb, device):
    a, b = _operands(M, N, K, la, lb, device)
    cfg = dataclasses.replace(head, tail_at=at, tail_axis=axis, tail_split=split)
    rec: dict = {}
    got = mm.matmul(a, b, cfg=cfg, record=rec)
    assert len([p for p in rec if p != "tf32_stage"]) >= 2  # the head's kernel and the tail's
    whole_head = mm.matmul(a, b, cfg=head)
    whole_tail = mm.matmul(a, b, cfg=cf.tail_config(cfg, K))
    part = (slice(None, at), slice(None)) if axis == "m" else (slice(None), slice(None, at))
    rest = (slice(at, None), slice(None)) if axis == "m" else (slice(None), slice(at, None))
    assert torch.equal(got[part], whole_head[part]) and torch.equal(got[rest], whole_tail[rest])
    ref = a.double() @ b.double()
    assert (got.double() - ref).abs().max().item() < 1e-2 * ref.abs().max().item()


def test_the_bias_follows_the_columns(device):
    a, b = _operands(96, 160, 128, "row", "row", device)
    bias = torch.randn(160).to(torch.bfloat16).to(device)
    cfg = dataclasses.replace(HEAD_SPLIT, tail_at=64, tail_axis="n", tail_split=2)
    got = mm.matmul(a, b, bias, cfg=cfg, out_dtype=torch.float32)
    ref = a.double() @ b.double() + bias.double()
    assert (got.double() - ref).abs().max().item() < 1e-4 * ref.abs().max().item()


def test_into_a_given_out(device):
    a, b = _operands(160, 96, 192, "row", "row", device)
    out = torch.full((160, 96), float("nan"), dtype=torch.bfloat16, device=device)
    cfg = dataclasses.replace(HEAD_SPLIT, tail_at=64, tail_axis="m", tail_split=3)
    assert mm.matmul(a, b, cfg=cfg, out=out) is out
    assert not out.isnan().any()


@pytest.mark.parametrize("at,axis", [(48, "m"), (0, "x"), (160, "m"), (96, "n")])
def test_a_tail_off_the_blocks_or_past_c_is_refused(at, axis, device):
    a, b = _operands(160, 96, 64, "row", "row", device)
    cfg = dataclasses.replace(HEAD_SPLIT, tail_at=at, tail_axis=axis)
    if at == 0:  # no tail: tail_axis is not read
        mm.matmul(a, b, cfg=cfg)
        return
    with pytest.raises(ValueError, match="tail_at="):
        mm.matmul(a, b, cfg=cfg)


def test_a_tail_with_an_epilogue_or_a_batch_is_refused(device):
    from nova.codegen.triton.elementwise import Operand

    a, b = _operands(160, 96, 64, "row", "row", device)
    cfg = dataclasses.replace(HEAD_SPLIT, tail_at=64, tail_axis="m", tail_split=2)
    with pytest.raises(ValueError, match="plain 2-D launch"):
        mm.matmul(a.unsqueeze(0).expand(2, -1, -1), b, cfg=cfg)
    ep = mm.Epilogue(shape=(160, 96), operands=(Operand((160, 96), torch.float32, load="raw"),),
                     body="e_y = ex0 + e_tile", stores=(("e_y", "f32", torch.float32),), out_shapes=((160, 96),))
    with pytest.raises(ValueError, match="plain 2-D launch"):
        mm.matmul_epilogue(a, b, ep, [torch.zeros(160, 96, device=device)], torch.bfloat16, cfg=cfg)


def test_the_memory_bound_counts_both_launches():
    cfg = dataclasses.replace(HEAD_SPLIT, tail_at=64, tail_axis="m", tail_split=3)
    got = mm.scratch_bytes(160, 96, 192, 1, torch.bfloat16, torch.bfloat16, torch.bfloat16, cfg)
    head = mm.scratch_bytes(64, 96, 192, 1, torch.bfloat16, torch.bfloat16, torch.bfloat16, cf.head_config(cfg))
    tail = mm.scratch_bytes(96, 96, 192, 1, torch.bfloat16, torch.bfloat16, torch.bfloat16, cf.tail_config(cfg, 192))
    assert head == 0 and got == tail >= 3 * 96 * 96 * 4
