"""Split-K adding its splits up in the kernel, in its two forms: ``matmul.SERIAL_SPLIT``
(split s waits on its tile's lock for split s - 1, adds its partial to the running sum and
hands it on) and ``matmul.LAST_SPLIT_SUMS`` (each split stores its partial and counts itself
in; the last to arrive sums the partials in split order), through the interpreter: bit for
bit the two-pass form (partials, then the reduction kernel in split order), with no
reduction kernel, for 2-D and batched launches, a bias, ragged edges, a last split shorter
than the others, 16-bit and fp32 results, pointer and TMA configs; the locks and counts
start from zero at every launch. The H200 runs the step's weight-gradient shapes:
tests/gpu/test_matmul_split_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nova.codegen.triton import matmul as mm
from nova.schedule.config import LoweringConfig

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

PTR = LoweringConfig(kind="matmul", block_m=16, block_n=32, block_k=16, group_m=2, split_k=3, num_warps=4,
                     num_stages=2, instruction="mma")
TMA = dataclasses.replace(PTR, block_m=64, block_n=64, block_k=32, num_warps=8, instruction="wgmma+tma")


MODES = {"serial": ("SERIAL_SPLIT", "atomic_cas"), "last": ("LAST_SPLIT_SUMS", "atomic_add")}


def _run(a, b, bias, cfg, out_dtype, mode, monkeypatch, precision=None):
    """C from a launch with the in-kernel split form ``mode`` (None: the two-pass form)."""
    monkeypatch.setattr(mm, "SERIAL_SPLIT", mode == "serial")
    monkeypatch.setattr(mm, "LAST_SPLIT_SUMS", mode == "last")
    rec: dict = {}
    c = mm.matmul(a, b, bias, cfg=cfg, out_dtype=out_dtype, precision=precision, record=rec)
    (path,) = rec
    return c, open(path).read()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["ptr-f32-bias", "ptr-batched", "tma-bf16", "tma-bf16-bias-ragged"])
def test_in_kernel_split_sums_are_the_two_pass_split_bit_for_bit(case, mode, device, monkeypatch):
    g = torch.Generator().manual_seed(7)
    if case == "ptr-f32-bias":
        a, b = torch.randn(33, 45, generator=g), torch.randn(45, 37, generator=g)
        bias, cfg, out, prec = torch.randn(37, generator=g), PTR, torch.float32, "ieee"
    elif case == "ptr-batched":
        a, b = torch.randn(3, 20, 50, generator=g), torch.randn(3, 50, 24, generator=g)
        bias, cfg, out, prec = None, PTR, torch.float32, "ieee"
    else:
        ragged = case.endswith("ragged")
        M, N, K = (136, 72, 200) if ragged else (128, 128, 192)
        a = torch.randn(M, K, generator=g).to(torch.bfloat16)
        b = torch.randn(N, K, generator=g).to(torch.bfloat16).t()  # K contiguous: a weight's layout
        bias = torch.randn(N, generator=g) if "bias" in case else None
        cfg, out, prec = TMA, torch.bfloat16, None
    a, b = a.to(device), b.to(device)
    bias = bias.to(device) if bias is not None else None
    got, src = _run(a, b, bias, cfg, out, mode, monkeypatch, prec)
    want, two_pass = _run(a, b, bias, cfg, out, None, monkeypatch, prec)
    assert MODES[mode][1] in src and "matmul_kernel_reduce" not in src
    assert "matmul_kernel_reduce" in two_pass
    assert got.dtype == want.dtype and torch.equal(got, want)
    ref = a.double() @ b.double() + (bias.double() if bias is not None else 0)
    assert ((got.double() - ref).norm() / ref.norm()).item() < (1e-5 if out == torch.float32 else 1e-2)
    again, _ = _run(a, b, bias, cfg, out, mode, monkeypatch, prec)  # fresh locks / counts: the same again
    assert torch.equal(again, got)


@pytest.mark.parametrize("mode", MODES)
def test_an_epilogue_or_a_persistent_split_keeps_the_two_pass_form(mode, device, monkeypatch):
    a = torch.randn(40, 48).to(device)
    b = torch.randn(48, 24).to(device)
    persistent = dataclasses.replace(PTR, persistent=True)
    _, src = _run(a, b, None, persistent, torch.float32, mode, monkeypatch, "ieee")
    assert "matmul_kernel_reduce" in src and MODES[mode][1] not in src
    ep = mm.Epilogue(shape=(40, 24), operands=(), body="y = acc * 2.0", stores=(("y", "f32", torch.float32),),
                     out_shapes=((40, 24),))
    rec: dict = {}
    (got,) = mm.matmul_epilogue(a, b, ep, [], torch.float32, cfg=PTR, precision="ieee", record=rec)
    (path,) = rec
    assert "matmul_kernel_reduce" in open(path).read()
    assert torch.equal(got, 2.0 * mm.matmul(a, b, cfg=PTR, precision="ieee"))


def test_scratch_counts_what_each_split_form_allocates(monkeypatch):
    """The running sums and a lock a tile (serial), the partials and a count a tile (last),
    the partials (two-pass, and any split with an epilogue)."""
    def scratch(**kw):
        return mm.scratch_bytes(33, 37, 45, 2, torch.float32, torch.float32, torch.float32, PTR, **kw)

    S = mm.split_k_plan(45, PTR)[1]
    tiles = mm.cdiv(33, 16) * mm.cdiv(37, 32)
    partials, sums = S * 2 * 33 * 37 * 4, 2 * 33 * 37 * 4
    monkeypatch.setattr(mm, "SERIAL_SPLIT", False)
    monkeypatch.setattr(mm, "LAST_SPLIT_SUMS", False)
    assert S == 3 and scratch() == partials
    monkeypatch.setattr(mm, "SERIAL_SPLIT", True)
    assert scratch() == sums + 2 * tiles * 4 and scratch(epilogue=True) == partials
    monkeypatch.setattr(mm, "SERIAL_SPLIT", False)
    monkeypatch.setattr(mm, "LAST_SPLIT_SUMS", True)
    assert scratch() == partials + 2 * tiles * 4 and scratch(epilogue=True) == partials
