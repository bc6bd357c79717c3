"""The warp-specialized persistent matmul (``ws`` in a config's instruction, configurator
rule 8b) through the interpreter: its source, its result against the unpartitioned kernel
of the same tile and against float64, every operand layout, ragged edges, a bias, and each
case that runs another kernel instead (logged, the same result). The H200 runs the same
checks compiled: tests/gpu/test_matmul_ws_gpu.py."""

import dataclasses
import logging

import pytest
import torch

import nova.log
from nova.codegen.triton import matmul as mm
from nova.codegen.triton.elementwise import Operand
from nova.schedule.config import LoweringConfig

WS = LoweringConfig(kind="matmul", block_m=64, block_n=64, block_k=32, group_m=2, persistent=True, num_warps=4,
                    num_stages=3, instruction="wgmma+tma+ws")
PLAIN = dataclasses.replace(WS, num_warps=8, instruction="wgmma+tma")


def _operands(M, N, K, la, lb, device, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(M * 7 + N * 3 + K)
    a = torch.randn(M, K, generator=g).to(dtype).to(device)
    b = torch.randn(K, N, generator=g).to(dtype).to(device)
    if la == "col":
        a = a.t().contiguous().t()
    if lb == "col":
        b = b.t().contiguous().t()
    return a, b


def _ran_ws(record: dict) -> bool:
    # (record's keys are the kernels' files, and "tf32_stage" where the staging copy ran)
    return any("warp-specialized" in open(p).read(400) for p in record if p != "tf32_stage")


@pytest.mark.parametrize("M,N,K", [(256, 192, 96), (200, 136, 72)], ids=["even", "ragged"])
@pytest.mark.parametrize("la,lb", [("row", "col"), ("row", "row"), ("col", "row"), ("col", "col")])
def test_ws_kernel_is_the_unpartitioned_kernel_and_float64(M, N, K, la, lb, device):
    a, b = _operands(M, N, K, la, lb, device)
    rec: dict = {}
    got = mm.matmul(a, b, cfg=WS, out_dtype=torch.float32, record=rec, num_programs=3)
    assert _ran_ws(rec)
    src = open(next(p for p in rec if "warp-specialized" in open(p).read(400))).read()
    assert "warp_specialize=True" in src and "tl.make_tensor_descriptor" in src
    want = mm.matmul(a, b, cfg=PLAIN, out_dtype=torch.float32, num_programs=3)
    assert torch.equal(got, want)
    ref = a.double() @ b.double()
    assert (got.double() - ref).abs().max().item() < 1e-4 * ref.abs().max().item()


def test_ws_kernel_with_a_bias_and_a_bf16_result(device):
    a, b = _operands(256, 128, 64, "row", "col", device)
    bias = torch.randn(128).to(torch.bfloat16).to(device)
    rec: dict = {}
    got = mm.matmul(a, b, bias, cfg=WS, record=rec)
    assert _ran_ws(rec) and got.dtype == torch.bfloat16
    assert torch.equal(got, mm.matmul(a, b, bias, cfg=PLAIN))


@pytest.mark.parametrize("pre", [("a", "b"), ()], ids=["prerounded", "staged"])
@pytest.mark.parametrize("M,N,K", [(256, 192, 96), (200, 136, 72)], ids=["even", "ragged"])
def test_a_tf32_ws_kernel_reads_both_operands_rounded(M, N, K, pre, device):
    """fp32 operands under tf32-rn, both rounded before the kernel (prerounded and read in
    place, or staged) and K-major: the partitioned loop runs a plain tf32 dot (configurator
    rule 8b's WS_TF32), bit for bit the unpartitioned staged kernel of the same tile."""
    a, b = _operands(M, N, K, "row", "col", device, torch.float32)
    if pre:
        a, b = mm.round_to_tf32(a), mm.round_to_tf32(b)
    staged = dataclasses.replace(WS, instruction="wgmma+tma+stage_a+stage_b+ws")
    rec: dict = {}
    got = mm.matmul(a, b, cfg=staged, precision="tf32-rn", prerounded=pre, record=rec, num_programs=3)
    assert _ran_ws(rec)
    want = mm.matmul(a, b, cfg=dataclasses.replace(PLAIN, instruction="wgmma+tma+stage_a+stage_b"),
                     precision="tf32-rn", prerounded=pre, num_programs=3)
    assert torch.equal(got, want)
    ref = mm.round_to_tf32(a).double() @ mm.round_to_tf32(b).double()
    assert (got.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("case", ["batched", "float32", "unaligned"])
def test_where_the_ws_kernel_cannot_run_another_kernel_does_and_says_so(case, device, caplog, monkeypatch):
    monkeypatch.setattr(nova.log, "_SEEN", set())  # (once per process: whatever ran before)
    if case == "batched":
        a = torch.randn(2, 128, 64).to(torch.bfloat16).to(device)
        b = torch.randn(2, 64, 128).to(torch.bfloat16).to(device)
    elif case == "float32":
        a, b = _operands(128, 128, 64, "row", "row", device, torch.float32)
    elif case == "unaligned":  # a row of 36 bf16 is 72 bytes: no TMA descriptor
        a, b = _operands(128, 36, 64, "row", "row", device)
    else:
        a, b = _operands(128, 36, 64, "row", "row", device)
    cfg = WS
    rec: dict = {}
    with caplog.at_level(logging.INFO, logger="nova"):
        got = mm.matmul(a, b, cfg=cfg, out_dtype=torch.float32, precision="tf32" if case == "float32" else None,
                        record=rec)
    assert not _ran_ws(rec)
    assert "warp-specialized kernel does not run here" in caplog.text
    ref = a.double() @ b.double()
    assert (got.double() - ref).abs().max().item() < 2e-2 * ref.abs().max().item()


def test_an_epilogue_with_column_sums_runs_the_unpartitioned_kernel_and_says_so(device, caplog, monkeypatch):
    """Triton 3.6's partitioner fails on a tile's row reduction inside the partitioned loop
    (the H200 build: "NVGPUWarpSpecialization"), so a ws config asked for an epilogue with
    column sums runs the persistent kernel instead, logged: the same values."""
    monkeypatch.setattr(nova.log, "_SEEN", set())
    a, b = _operands(256, 128, 64, "row", "col", device)
    ep = mm.Epilogue(shape=(256, 128), operands=(), body="y = e_tile * 2.0", stores=(("y", "f32", torch.bfloat16),),
                     out_shapes=((256, 128),), sums=(mm.ColumnSum("y", "f32", torch.float32, 1),))
    rec: dict = {}
    with caplog.at_level(logging.INFO, logger="nova"):
        got = mm.matmul_epilogue(a, b, ep, [], torch.bfloat16, cfg=WS, record=rec)
    want = mm.matmul_epilogue(a, b, ep, [], torch.bfloat16, cfg=PLAIN)
    assert not _ran_ws(rec) and "column sums in the epilogue" in caplog.text
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(got[1].double(), 2.0 * (a.double() @ b.double()).sum(0), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("M,N,K,split", [(256, 192, 384, 3), (200, 136, 200, 3), (128, 64, 96, 2)],
                         ids=["even", "ragged", "short"])
@pytest.mark.parametrize("la,lb", [("row", "col"), ("col", "row"), ("row", "row")])
def test_a_split_ws_kernel_is_the_unpartitioned_split_kernel(M, N, K, split, la, lb, device):
    """Split-K in the partitioned loop: every split the same number of whole K steps from
    its first K, the last split's steps past K reading zero boxes, the fp32 partials summed
    by the same reduction: bit for bit the unpartitioned persistent split kernel (a weight
    gradient's layouts too: A M-major, B N-major), with a bias and with an epilogue."""
    a, b = _operands(M, N, K, la, lb, device)
    ws, plain = (dataclasses.replace(c, split_k=split) for c in (WS, PLAIN))
    assert mm.split_k_plan(K, ws)[1] > 1
    rec: dict = {}
    got = mm.matmul(a, b, cfg=ws, out_dtype=torch.bfloat16, record=rec, num_programs=3)
    assert _ran_ws(rec)
    src = open(next(p for p in rec if "warp-specialized" in open(p).read(400))).read()
    assert "k_tiles = K_SPLIT // BLOCK_K" in src and "k0 = pid_s * K_SPLIT" in src
    assert torch.equal(got, mm.matmul(a, b, cfg=plain, out_dtype=torch.bfloat16, num_programs=3))
    ref = a.double() @ b.double()
    assert (got.double() - ref).abs().max().item() < 2e-2 * ref.abs().max().item()
    bias = torch.randn(N).to(torch.bfloat16).to(device)
    assert torch.equal(mm.matmul(a, b, bias, cfg=ws, num_programs=3), mm.matmul(a, b, bias, cfg=plain, num_programs=3))
    ep = mm.Epilogue(shape=(M, N), operands=(), body="y = e_tile * 0.5", stores=(("y", "f32", torch.bfloat16),),
                     out_shapes=((M, N),))
    (e_got,) = mm.matmul_epilogue(a, b, ep, [], torch.bfloat16, cfg=ws, num_programs=3)
    (e_want,) = mm.matmul_epilogue(a, b, ep, [], torch.bfloat16, cfg=plain, num_programs=3)
    assert torch.equal(e_got, e_want)


def test_an_epilogue_runs_partitioned_and_matches_the_unpartitioned_kernel(device):
    a, b = _operands(256 + 40, 256 + 24, 64 * 3 + 8, "row", "col", device)
    bias = torch.randn(256 + 24, device=device)
    ep = mm.Epilogue(shape=(256 + 40, 256 + 24), operands=(Operand((256 + 24,), torch.float32, load="raw"),),
                     body="y = e_tile + ex0\nz = y * tl.sigmoid(y)",
                     stores=(("y", "f32", torch.float32), ("z", "f32", torch.bfloat16)),
                     out_shapes=((256 + 40, 256 + 24), (256 + 40, 256 + 24)))
    rec: dict = {}
    got = mm.matmul_epilogue(a, b, ep, [bias], torch.bfloat16, cfg=WS, record=rec)
    want = mm.matmul_epilogue(a, b, ep, [bias], torch.bfloat16, cfg=PLAIN)
    assert _ran_ws(rec)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_an_epilogue_runs_the_unpartitioned_kernel_while_ws_epilogues_are_off(device, caplog, monkeypatch):
    monkeypatch.setattr(nova.log, "_SEEN", set())
    monkeypatch.setattr(mm, "WS_EPILOGUES", False)
    a, b = _operands(256, 128, 64, "row", "col", device)
    ep = mm.Epilogue(shape=(256, 128), operands=(), body="y = e_tile * 2.0", stores=(("y", "f32", torch.float32),),
                     out_shapes=((256, 128),))
    rec: dict = {}
    with caplog.at_level(logging.INFO, logger="nova"):
        (got,) = mm.matmul_epilogue(a, b, ep, [], torch.bfloat16, cfg=WS, record=rec)
    assert not _ran_ws(rec) and "WS_EPILOGUES off" in caplog.text
    assert torch.equal(got, 2.0 * mm.matmul(a, b, cfg=PLAIN, out_dtype=torch.float32))


def test_scratch_bytes_counts_the_device_descriptors():
    plain = mm.scratch_bytes(256, 192, 96, 1, torch.bfloat16, torch.bfloat16, torch.bfloat16, PLAIN)
    ws = mm.scratch_bytes(256, 192, 96, 1, torch.bfloat16, torch.bfloat16, torch.bfloat16, WS)
    assert ws - plain == 4 * 3 * mm.WS_SCRATCH_PER_PROGRAM  # a program a tile at most: 4 x 3 tiles
