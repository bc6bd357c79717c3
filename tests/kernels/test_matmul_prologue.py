"""A matmul's operand prologue (``matmul.Prologue``: A computed in registers from its tile
as loaded, with vectors along A's rows and along K), through the interpreter: the pointer
kernel, the descriptor (TMA) kernel one program a tile, split-K and persistent, 16-bit,
fp32 and rounded-tf32 operands, A K-contiguous and transposed, ragged edges (the vectors
and the tiles past M and K read zeros); against the product of the transformed A taken
in float64. The launches it refuses say why."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nova.codegen.triton import matmul as mm
from nova.schedule.config import LoweringConfig

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

BASE = LoweringConfig(kind="matmul", block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=2)
CONFIGS = {
    "pointers": BASE,
    "tma": dataclasses.replace(BASE, instruction="wgmma+tma"),
    "tma-split3": dataclasses.replace(BASE, instruction="wgmma+tma", split_k=3),
    "tma-persistent": dataclasses.replace(BASE, instruction="wgmma+tma", persistent=True),
    "pointers-split2": dataclasses.replace(BASE, split_k=2),
}
SCALE_SHIFT = mm.Prologue((("u", "m"), ("v", "k")), "a = (a.to(tl.float32) * u[:, None] + v[None, :]).to(A_TY)")


def _prologue(ty: str) -> mm.Prologue:
    return dataclasses.replace(SCALE_SHIFT, body=SCALE_SHIFT.body.replace("A_TY", ty))


@pytest.mark.parametrize("transposed", [False, True], ids=["a-row", "a-col"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_a_prologue_is_the_product_of_the_transformed_a(cfg, dtype, transposed, monkeypatch):
    monkeypatch.setattr(mm, "STREAM_K_SPLIT", True)  # (a prologue's launch never takes stream-K)
    gen = torch.Generator().manual_seed(3)
    M, K, N = 37, 70, 29  # ragged against 16: the last tiles and K step partial
    a = torch.randn(M, K, generator=gen).to(dtype)
    if transposed:
        a = a.t().contiguous().t()  # M contiguous
    b = torch.randn(K, N, generator=gen).to(dtype)
    u, v = torch.randn(M, generator=gen), torch.randn(K, generator=gen)
    ty = "tl.bfloat16" if dtype == torch.bfloat16 else "tl.float32"
    rec: dict = {}
    c = mm.matmul(a, b, cfg=CONFIGS[cfg], out_dtype=torch.float32, precision="ieee", num_programs=3,
                  prologue=(_prologue(ty), [u, v]), record=rec)  # fmt: skip
    a_t = (a.float() * u[:, None] + v[None, :]).to(dtype)
    want = a_t.double() @ b.double()
    torch.testing.assert_close(c.double(), want, rtol=1e-5, atol=1e-5)
    text = "".join(open(p).read() for p in rec)
    assert "A from a prologue: u by m, v by k" in text and "stream" not in text


def test_a_rounding_prologue_under_tf32_rn():
    """The body rounds A itself (``rounded``): the kernel does not round it again, and a
    staged config does not copy it (the copy would round the loaded values instead)."""
    gen = torch.Generator().manual_seed(4)
    M, K, N = 33, 48, 20
    a = torch.randn(K, M, generator=gen).t()  # M contiguous: a staged config would copy it
    b = torch.randn(K, N, generator=gen)
    u = torch.randn(M, generator=gen)
    pro = mm.Prologue((("u", "m"),), "a = tf32_rn(a * u[:, None])", rounded=True)
    cfg = dataclasses.replace(BASE, instruction="wgmma+tma+stage_a+stage_b")
    copies: list = []
    real = mm.stage_tf32
    try:
        mm.stage_tf32 = lambda src, dst, record=None: copies.append(tuple(src.shape)) or real(src, dst, record)
        c = mm.matmul(a, b, cfg=cfg, precision="tf32-rn", prologue=(pro, [u]))
    finally:
        mm.stage_tf32 = real
    want = mm.round_to_tf32(a * u[:, None]).double() @ mm.round_to_tf32(b).double()
    torch.testing.assert_close(c.double(), want, rtol=1e-5, atol=1e-5)
    assert copies == [(1, K, N)]  # B staged, A not


def test_launches_a_prologue_refuses():
    a, b = torch.randn(8, 16), torch.randn(16, 8)
    pro = mm.Prologue((("u", "m"),), "a = a * u[:, None]")
    with pytest.raises(ValueError, match="1-D of 8 elements"):
        mm.matmul(a, b, cfg=BASE, prologue=(pro, [torch.randn(16)]))
    with pytest.raises(ValueError, match="unit stride"):
        mm.matmul(a, b, cfg=BASE, prologue=(pro, [torch.randn(8, 2)[:, 0]]))
    with pytest.raises(ValueError, match="2-D operands and no bias"):
        mm.matmul(a, b, torch.randn(8), cfg=BASE, prologue=(pro, [torch.randn(8)]))
    with pytest.raises(ValueError, match="has 1 vectors, the launch gives 2"):
        mm.matmul(a, b, cfg=BASE, prologue=(pro, [torch.randn(8), torch.randn(8)]))
    with pytest.raises(ValueError, match="axes"):
        mm.matmul(a, b, cfg=BASE, prologue=(mm.Prologue((("u", "n"),), "a = a"), [torch.randn(8)]))
    with pytest.raises(ValueError, match="without warp specialization"):
        mm.matmul_source(dataclasses.replace(BASE, persistent=True), has_bias=False, precision="bf16",
                         in_dtype="bfloat16", out_dtype="bfloat16", tma=mm.TmaLayout("row", "col", ws=True),
                         prologue=pro)  # fmt: skip
