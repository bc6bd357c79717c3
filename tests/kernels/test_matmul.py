"""The generated matmul kernel against float64 torch, through the Triton interpreter
on the CPU (the real compiler on a GPU). Shapes are tiny and ragged on purpose:
the interpreter runs every program in Python."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nova.codegen.triton import matmul as mm
from nova.codegen.triton.source import kernel_source, load_kernel
from nova.schedule.config import LoweringConfig

# the interpreter's range() over a 0-d array (triton's own code) warns under numpy >= 1.25
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def cfg(bm=16, bn=16, bk=16, group_m=1, split_k=1, persistent=False, warps=4, stages=2):
    return LoweringConfig(
        kind="matmul", block_m=bm, block_n=bn, block_k=bk, group_m=group_m, split_k=split_k,
        persistent=persistent, num_warps=warps, num_stages=stages,
    )


def rel_err(c: torch.Tensor, ref: torch.Tensor) -> float:
    return ((c.double() - ref).norm() / ref.norm()).item()


def reference(a, b, bias=None):
    ref = a.double() @ b.double()
    return ref if bias is None else ref + bias.double()


# (config, shape M x N x K): ragged everywhere, one aligned case for the mask-free path
FP32_CASES = [
    (cfg(group_m=2), (33, 17, 45)),
    (cfg(bn=32, group_m=3, split_k=3), (33, 17, 45)),  # split-K, last split ragged
    (cfg(bm=32, group_m=2, persistent=True), (40, 33, 20)),
    (cfg(bm=32, bn=32, bk=16, split_k=2), (64, 32, 64)),  # EVEN: no masks
]


@pytest.mark.parametrize("config,shape", FP32_CASES, ids=lambda x: str(x) if isinstance(x, tuple) else "")
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_ieee_2d(device, config, shape, with_bias):
    torch.manual_seed(0)
    M, N, K = shape
    a = torch.randn(M, K, device=device)
    b = torch.randn(K, N, device=device)
    bias = torch.randn(N, device=device) if with_bias else None
    c = mm.matmul(a, b, bias, cfg=config, precision="ieee", num_programs=3)
    assert c.shape == (M, N) and c.dtype == torch.float32
    assert rel_err(c, reference(a, b, bias)) < 1e-5


@pytest.mark.parametrize(
    "config", [cfg(group_m=2), cfg(group_m=2, split_k=2, persistent=True)], ids=["plain", "persistent-splitk"]
)
def test_batched_transposed_strides(device, config):
    """Transposed A and B are plain stride swaps (no copies); C is written through
    a transposed view too; a 2-D operand broadcasts over the batch."""
    torch.manual_seed(1)
    B, M, N, K = 3, 19, 21, 35
    a = torch.randn(B, K, M, device=device).transpose(1, 2)  # column-major A[b]
    b = torch.randn(B, N, K, device=device).transpose(1, 2)  # column-major B[b]
    bias = torch.randn(N, device=device)
    out = torch.empty(B, N, M, device=device).transpose(1, 2)
    c = mm.matmul(a, b, bias, cfg=config, precision="ieee", out=out, num_programs=4)
    assert c is out
    assert rel_err(c, reference(a, b, bias)) < 1e-5
    w = torch.randn(K, N, device=device)[:, ::1]
    c2 = mm.matmul(a, w, cfg=config, precision="ieee", num_programs=4)
    assert c2.shape == (B, M, N)
    assert rel_err(c2, reference(a, w)) < 1e-5


@pytest.mark.parametrize("config", [cfg(group_m=2), cfg(bm=32, split_k=2)], ids=["plain", "splitk"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_bf16_inputs(device, config, out_dtype):
    torch.manual_seed(2)
    a = torch.randn(2, 33, 45, device=device, dtype=torch.bfloat16)
    b = torch.randn(2, 45, 17, device=device, dtype=torch.bfloat16)
    bias = torch.randn(17, device=device, dtype=torch.bfloat16)
    c = mm.matmul(a, b, bias, cfg=config, out_dtype=out_dtype)
    assert c.dtype == out_dtype
    assert rel_err(c, reference(a, b, bias)) < 1e-2


@pytest.mark.parametrize(
    "config", [cfg(bn=32, group_m=2), cfg(split_k=3, persistent=True)], ids=["plain", "persistent-splitk"]
)
def test_tma_descriptors_any_layout(device, config):
    """The TMA variant: row- and column-major operands, batched and broadcast, ragged
    edges read as zeros by the descriptor; shapes with 16-byte aligned strides."""
    config = LoweringConfig.from_dict({**config.to_dict(), "instruction": "wgmma+tma"})
    torch.manual_seed(7)
    B, M, N, K = 2, 36, 24, 44  # fp32: every stride a multiple of 4 elements
    a = torch.randn(B, K, M, device=device).transpose(1, 2)
    b = torch.randn(N, K, device=device).t()
    bias = torch.randn(N, device=device)
    assert mm._tma_plan(config, a, b.unsqueeze(0))[0] == mm.TmaLayout("col", "col", True, False)
    c = mm.matmul(a, b, bias, cfg=config, precision="ieee", num_programs=3)
    assert rel_err(c, reference(a, b, bias)) < 1e-5
    # bf16: strides must be multiples of 8 elements
    a16 = torch.randn(M, 48, device=device, dtype=torch.bfloat16)
    b16 = torch.randn(48, N, device=device, dtype=torch.bfloat16)
    assert mm._tma_plan(config, a16[None], b16[None])[0] == mm.TmaLayout("row", "row", False, False)
    assert rel_err(mm.matmul(a16, b16, cfg=config, num_programs=3), reference(a16, b16)) < 1e-2
    # an expanded (stride-0) batch is one matrix for the descriptor too
    b_exp = torch.randn(K, N, device=device).expand(B, K, N)
    assert mm._tma_plan(config, a, b_exp)[0] == mm.TmaLayout("col", "row", True, False)
    assert rel_err(mm.matmul(a, b_exp, cfg=config, precision="ieee", num_programs=3), reference(a, b_exp)) < 1e-5
    # a stride TMA cannot address (33 * 4 bytes) falls back to the pointer kernel
    a_odd = torch.randn(K, 33, device=device).t()
    assert mm._tma_plan(config, a_odd[None], b.unsqueeze(0)) is None
    assert rel_err(mm.matmul(a_odd, b, cfg=config, precision="ieee", num_programs=3), reference(a_odd, b)) < 1e-5


@pytest.mark.parametrize("persistent", [False, True], ids=["tile-grid", "persistent"])
@pytest.mark.parametrize("layouts", [("row", "col"), ("row", "row"), ("col", "row")])
@pytest.mark.parametrize("batch", [1, 3])
def test_c_through_a_descriptor(device, persistent, layouts, batch):
    """The one-pass TMA kernel stores C through a descriptor in two column halves (the
    persistent one in its flattened loop, the tile's place recomputed for the store);
    ragged edges clipped by the descriptor; a C whose rows are not 16-byte aligned is
    stored through pointers instead."""
    config = LoweringConfig.from_dict({**cfg(bm=32, bn=32, group_m=2, persistent=persistent).to_dict(),
                                       "instruction": "wgmma+tma"})
    torch.manual_seed(3)
    M, N, K = 72, 40, 36  # ragged in M and N (f32 strides: multiples of 4 elements, for TMA)
    la, lb = layouts
    a = torch.randn((batch, M, K) if la == "row" else (batch, K, M), device=device)
    b = torch.randn((batch, K, N) if lb == "row" else (batch, N, K), device=device)
    a, b = (a if la == "row" else a.transpose(1, 2)), (b if lb == "row" else b.transpose(1, 2))
    if batch == 1:
        a, b = a[0], b[0]
    used: dict = {}
    c = mm.matmul(a, b, cfg=config, precision="ieee", num_programs=3, record=used)
    assert rel_err(c, reference(a, b)) < 1e-5
    (src,) = used.values()
    assert "c_desc.store" in src and ("flatten=True" in src) == persistent
    # C as a view with 41-element rows (164 bytes): no descriptor, the pointer store
    wide = torch.empty(*a.shape[:-1], N + 1, device=device)[..., :N]
    used.clear()
    mm.matmul(a, b, cfg=config, precision="ieee", num_programs=3, out=wide, record=used)
    assert rel_err(wide, reference(a, b)) < 1e-5
    (src,) = used.values()
    assert "c_desc" not in src and "tl.store(c_ptrs" in src


def test_fp32_with_reduced_precisions(device):
    """tf32 and bf16 rounding of fp32 operands (the interpreter computes tf32 exactly,
    so only the GPU shows tf32 error; bf16 rounding shows everywhere)."""
    torch.manual_seed(3)
    a = torch.randn(33, 45, device=device)
    b = torch.randn(45, 17, device=device)
    ref = reference(a, b)
    assert rel_err(mm.matmul(a, b, cfg=cfg(), precision="tf32"), ref) < 5e-3
    assert rel_err(mm.matmul(a, b, cfg=cfg(), precision="bf16"), ref) < 1e-2


def _tf32_reference(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even to 11 significant bits (tf32's 10 stored mantissa bits),
    computed independently of the template's bit trick: in float64 through
    frexp / round-half-even / ldexp. For fp32 normals only."""
    m, e = torch.frexp(x.double())  # x = m 2^e, 0.5 <= |m| < 1
    return torch.ldexp(torch.round(m * 2.0**11), e - 11).float()


def test_tf32_rn_rounding_is_bit_exact():
    torch.manual_seed(0)
    x = torch.randn(4096) * torch.logspace(-30, 30, 4096)
    ulp = 2.0**-10  # tf32 spacing in [1, 2)
    ties = torch.tensor([1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), -(1 + 3 * ulp / 2), 1 + ulp / 2 + 2.0**-23,
                         2 - ulp / 4, 2 - ulp / 2 + 2.0**-23, 3.0, 0.1, -0.1, 65504.0, 1e-30])  # fmt: skip
    x = torch.cat([x, ties])
    got = mm.round_to_tf32(x)
    assert torch.equal(got.view(torch.int32), _tf32_reference(x).view(torch.int32))
    assert torch.equal(got[-12:-8], torch.tensor([1.0, 1 + 2 * ulp, -1.0, -(1 + 2 * ulp)]))  # ties to even
    # kept bits only; specials survive; overflow rounds to inf like IEEE
    assert not (got.view(torch.int32) & 0x1FFF).any()
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4028235e38])
    out = mm.round_to_tf32(special)
    assert torch.equal(out[:4].view(torch.int32), special[:4].view(torch.int32))
    assert out[4].isnan() and out[5] == float("inf")


def test_tf32_rn_cvt_text_and_the_targets_without_it(monkeypatch):
    """``TF32_RN_CVT`` writes the rounding as ``cvt.rn.tf32.f32`` (one instruction, sm_90+) in
    the K loop's text and in ``tf32_rn``; off, the integer arithmetic. For a target without the
    instruction (the interpreter, which runs no inline assembly; a device before sm_90) it writes
    the integer arithmetic, whose bits the instruction's are checked against on the device
    (tests/gpu/test_tf32_cvt_gpu.py)."""
    from nova.codegen.triton import source

    integer = mm.tf32_rn_text("a")
    assert "0xFFFFE000" in integer and "cvt" not in mm.tf32_rn_fn()
    monkeypatch.setattr(mm, "TF32_RN_CVT", True)
    monkeypatch.setattr(source, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # an offline sm_90a build
    text = mm.tf32_rn_text("a")
    assert text.startswith("a = tl.inline_asm_elementwise(") and "cvt.rn.tf32.f32 $0, $1;" in text
    assert "0xFFFFE000" not in mm.tf32_rn_fn() and "def tf32_rn(x):" in mm.tf32_rn_fn()
    cast, _ = mm._dot_text("float32", "tf32-rn", ("b",))
    assert cast.count("cvt.rn.tf32.f32") == 1  # A only: B is prerounded
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    mm._sm90_or_newer.cache_clear()
    try:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))  # an A100
        assert mm.tf32_rn_text("a") == integer
        mm._sm90_or_newer.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
        assert mm.tf32_rn_text("a") == text
    finally:
        mm._sm90_or_newer.cache_clear()  # no patched device's answer left for a later test
    monkeypatch.setattr(source, "interpreting", lambda: True)
    assert mm.tf32_rn_text("a") == integer


def test_generated_kernels_are_cached_per_rounding_form(monkeypatch):
    """A process that turns ``TF32_RN_CVT`` on after a kernel was generated gets the other text,
    not the cached one (the cache is keyed by ``rn_cvt()``, which ``_run`` passes)."""
    from nova.codegen.triton import source

    monkeypatch.setattr(source, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(mm, "load_kernel", lambda src, name: (src, f"{name}.py"))  # the text, not a kernel
    c = LoweringConfig(kind="matmul", block_m=32, block_n=64, block_k=16, num_warps=4, num_stages=2)
    texts = []
    try:
        for on in (False, True):
            monkeypatch.setattr(mm, "TF32_RN_CVT", on)
            kern = mm.matmul_kernels(c, False, "tf32-rn", "float32", "float32", False, False, False, None, mm.rn_cvt())
            texts.append(kern.main)
    finally:
        mm.matmul_kernels.cache_clear()  # no stub's text left for a later test
    assert "cvt.rn.tf32.f32" not in texts[0] and "cvt.rn.tf32.f32" in texts[1]


def test_tf32_rn_kernel_rounds_operands_like_the_host(device):
    """precision="tf32-rn" rounds both operand tiles in the kernel (the TF32_RN text,
    the same arithmetic as round_to_tf32). The interpreter computes the tf32 dot in
    fp32, so its result must match fp32 math on host-rounded operands; and the error
    against float64 at K=1024 is cuBLAS-like, under 5e-4."""
    torch.manual_seed(5)
    a = torch.randn(32, 1024, device=device)
    b = torch.randn(1024, 48, device=device)
    ref = reference(a, b)
    for config in (cfg(bm=32, bn=16, bk=32), cfg(bm=16, bn=16, bk=32, split_k=2)):
        c = mm.matmul(a, b, cfg=config, precision="tf32-rn")
        expect = reference(mm.round_to_tf32(a), mm.round_to_tf32(b))
        # the products of rounded operands are exact; what is left is fp32 summation
        # (~sqrt(K) 2^-24 on the GPU), two orders below the tf32 rounding error
        assert rel_err(c, expect) < 1e-5
        err = rel_err(c, ref)
        assert 1e-5 < err < 5e-4, err  # rounding happened, and is round-to-nearest
    src = mm.matmul_source(cfg(), has_bias=False, precision="tf32-rn")
    assert "0xFFFFE000" in src and 'input_precision="tf32"' in src
    assert 'input_precision="tf32x3"' in mm.matmul_source(cfg(), has_bias=False, precision="tf32x3")


@pytest.mark.parametrize(
    "a_layout,b_layout,batch",
    [("row", "row", None), ("col", "col", None), ("col", "row", 3), ("row", "row", "broadcast")],
)
def test_tf32_staged_path_rounds_and_transposes(device, a_layout, b_layout, batch):
    """The staged tf32 path (instruction "+stage_a" / "+stage_b"): the named operands
    are copied into K-major buffers rounded to nearest tf32 by the staging kernel, the
    kernel rounds the rest; the result is the fp32 product of rounded operands for
    every layout, batched or broadcast, with a bias, on the TMA and pointer paths."""
    torch.manual_seed(6)
    M, N, K = 40, 24, 72
    lead = () if batch is None else (3,)

    def make(rows, cols, layout):
        t = torch.randn(*lead, cols, rows, device=device).transpose(-1, -2) if layout == "col" else torch.randn(
            *lead, rows, cols, device=device
        )
        return t

    a = make(M, K, a_layout)
    b = make(K, N, b_layout)
    if batch == "broadcast":
        a = torch.randn(3, M, K, device=device)
        b = torch.randn(K, N, device=device).expand(3, K, N)
    bias = torch.randn(N, device=device)
    expect = reference(mm.round_to_tf32(a), mm.round_to_tf32(b), bias)
    for instruction in ("wgmma+tma+stage_b", "wgmma+tma+stage_a+stage_b", "wgmma+stage_a+stage_b"):
        config = dataclasses.replace(cfg(bm=16, bn=16, bk=32), instruction=instruction)
        c = mm.matmul(a, b, bias=bias, cfg=config, precision="tf32-rn")
        assert rel_err(c, expect) < 1e-5, instruction
        assert 1e-5 < rel_err(c, reference(a, b, bias)) < 5e-4


def test_a_prerounded_operand_is_neither_staged_nor_rounded_again(device, monkeypatch):
    """``prerounded=("a",)``: a 2-D A the caller already rounded to tf32 (K contiguous,
    the staged layout) is read in place by a staged config, and the register path does
    not round it again: the same bits as rounding it in the matmul, one staging copy
    fewer."""
    torch.manual_seed(8)
    a = mm.round_to_tf32(torch.randn(40, 72, device=device))
    b = torch.randn(72, 24, device=device)
    staged_shapes = []
    real = mm.stage_tf32
    monkeypatch.setattr(mm, "stage_tf32", lambda src, dst, record=None: staged_shapes.append(tuple(src.shape)) or real(src, dst, record))
    for instruction in ("wgmma+tma+stage_a+stage_b", "wgmma+stage_a+stage_b", "mma"):
        config = dataclasses.replace(cfg(bm=16, bn=16, bk=32), instruction=instruction)
        staged_shapes.clear()
        want = mm.matmul(a, b, cfg=config, precision="tf32-rn")
        copies = len(staged_shapes)
        got = mm.matmul(a, b, cfg=config, precision="tf32-rn", prerounded=("a",))
        assert torch.equal(got, want), instruction
        assert len(staged_shapes) - copies == copies - (1 if "stage_a" in instruction else 0), instruction
    # an A the staged layout does not hold (K strided) is still staged; elsewhere the flag changes nothing
    staged_shapes.clear()
    config = dataclasses.replace(cfg(bm=16, bn=16, bk=32), instruction="wgmma+stage_a+stage_b")
    at = a.t().contiguous().t()
    assert torch.equal(mm.matmul(at, b, cfg=config, precision="tf32-rn", prerounded=("a",)),
                       mm.matmul(at, b, cfg=config, precision="tf32-rn"))
    assert len(staged_shapes) == 4
    assert torch.equal(mm.matmul(a, b, precision="ieee", prerounded=("a",)), mm.matmul(a, b, precision="ieee"))


def test_a_prerounded_b_in_the_staged_layout_is_read_in_place(device, monkeypatch):
    """``prerounded=("b",)``: a B the caller rounded to tf32 and holds K-major (the [K, N]
    view of a dense [N, K]: the staged layout) is not copied by a staged config, and
    the register path does not round it again: the same bits, one staging copy fewer;
    an N-major B is still staged."""
    torch.manual_seed(9)
    a = torch.randn(40, 72, device=device)
    bt = mm.round_to_tf32(torch.randn(24, 72, device=device))  # dense [N, K]
    b = bt.t()  # [K, N], K contiguous
    staged_shapes = []
    real = mm.stage_tf32
    monkeypatch.setattr(mm, "stage_tf32",
                        lambda src, dst, record=None: staged_shapes.append(tuple(src.shape)) or real(src, dst, record))
    for instruction in ("wgmma+tma+stage_a+stage_b", "wgmma+stage_b", "mma"):
        config = dataclasses.replace(cfg(bm=16, bn=16, bk=32), instruction=instruction)
        staged_shapes.clear()
        want = mm.matmul(a, b, cfg=config, precision="tf32-rn")
        copies = len(staged_shapes)
        got = mm.matmul(a, b, cfg=config, precision="tf32-rn", prerounded=("b",))
        assert torch.equal(got, want), instruction
        assert len(staged_shapes) - copies == copies - (1 if "stage_b" in instruction else 0), instruction
    staged_shapes.clear()
    config = dataclasses.replace(cfg(bm=16, bn=16, bk=32), instruction="wgmma+stage_b")
    bn = b.contiguous()  # N contiguous: not the staged layout
    assert torch.equal(mm.matmul(a, bn, cfg=config, precision="tf32-rn", prerounded=("b",)),
                       mm.matmul(a, bn, cfg=config, precision="tf32-rn"))
    assert len(staged_shapes) == 2


def test_tf32_stage_kernel_is_a_rounding_transpose(device):
    torch.manual_seed(7)
    src = torch.randn(2, 70, 130, device=device)
    dense = torch.empty(2, 130, 70, device=device)
    mm.stage_tf32(src, dense.transpose(1, 2))
    assert torch.equal(dense.transpose(1, 2).view(torch.int32), mm.round_to_tf32(src).view(torch.int32))
    staged = dataclasses.replace(cfg(), instruction="wgmma+tma+stage_b")
    with pytest.raises(ValueError, match="staged config"):
        mm.matmul(src.bfloat16(), src.bfloat16().transpose(1, 2), cfg=staged)
    with pytest.raises(ValueError, match="staged config"):
        mm.matmul(src, src.transpose(1, 2), cfg=staged, precision="tf32")


def test_int64_indexing_path(device, monkeypatch):
    """Tensors past 2**31 elements switch the kernel to int64 offsets; exercise that
    code path on a tiny shape by lowering the threshold."""
    monkeypatch.setattr(mm, "_INT32_MAX", 10)
    torch.manual_seed(4)
    a, b = torch.randn(20, 18, device=device), torch.randn(18, 9, device=device)
    c = mm.matmul(a, b, cfg=cfg(split_k=2), precision="ieee")
    assert rel_err(c, reference(a, b)) < 1e-5
    src = mm.matmul_source(cfg(), has_bias=False, precision="ieee", index_64=True)
    assert ".to(tl.int64)" in src


def test_tiny_and_empty(device):
    a, b = torch.randn(1, 1, device=device), torch.randn(1, 1, device=device)
    assert rel_err(mm.matmul(a, b, cfg=cfg(), precision="ieee"), reference(a, b)) < 1e-6
    bias = torch.randn(3, device=device)
    c = mm.matmul(torch.randn(2, 0, device=device), torch.randn(0, 3, device=device), bias, cfg=cfg())
    torch.testing.assert_close(c, bias.expand(2, 3))
    assert mm.matmul(torch.randn(0, 4, device=device), torch.randn(4, 3, device=device), cfg=cfg()).shape == (0, 3)


def test_out_beside_the_inputs_in_one_buffer(device):
    """Operands and result as disjoint views of one arena (one storage): allowed."""
    torch.manual_seed(7)
    arena = torch.randn(4 * 5 + 5 * 3 + 4 * 3, device=device)
    a, b = arena[:20].view(4, 5), arena[20:35].view(5, 3)
    expected = mm.matmul(a, b, cfg=cfg(), precision="ieee")
    out = arena[35:].view(4, 3)
    assert mm.matmul(a, b, cfg=cfg(), precision="ieee", out=out) is out
    assert torch.equal(out, expected)


def test_split_k_is_deterministic(device):
    torch.manual_seed(5)
    a, b = torch.randn(17, 64, device=device), torch.randn(64, 16, device=device)
    first = mm.matmul(a, b, cfg=cfg(split_k=4), precision="ieee")
    assert torch.equal(first, mm.matmul(a, b, cfg=cfg(split_k=4), precision="ieee"))


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda d: (torch.randn(4, 5, device=d), torch.randn(5, 3, device=d, dtype=torch.bfloat16)), "dtype mismatch"),
        (lambda d: (torch.ones(4, 5, device=d, dtype=torch.int32), torch.ones(5, 3, device=d, dtype=torch.int32)),
         "unsupported dtype"),
        (lambda d: (torch.randn(4, 5, device=d, dtype=torch.float64), torch.randn(5, 3, device=d, dtype=torch.float64)),
         "unsupported dtype"),
        (lambda d: (torch.randn(4, 5, device=d), torch.randn(6, 3, device=d)), "do not contract"),
        (lambda d: (torch.randn(2, 4, 5, device=d), torch.randn(3, 5, 3, device=d)), "batch sizes differ"),
        (lambda d: (torch.randn(5, device=d), torch.randn(5, 3, device=d)), "2-D or 3-D"),
    ],
)
def test_bad_inputs_raise(device, make, match):
    a, b = make(device)
    with pytest.raises(ValueError, match=match):
        mm.matmul(a, b, cfg=cfg())


def test_bad_arguments_raise(device):
    a, b = torch.randn(4, 5, device=device), torch.randn(5, 3, device=device)
    with pytest.raises(ValueError, match="bias"):
        mm.matmul(a, b, torch.randn(4, device=device), cfg=cfg())
    with pytest.raises(ValueError, match="precision"):
        mm.matmul(a, b, cfg=cfg(), precision="fp8")
    with pytest.raises(ValueError, match="out has shape"):
        mm.matmul(a, b, cfg=cfg(), out=torch.empty(3, 4, device=device))
    with pytest.raises(ValueError, match="out has dtype"):
        mm.matmul(a, b, cfg=cfg(), out=torch.empty(4, 3, device=device), out_dtype=torch.bfloat16)
    big = torch.randn(5, 5, device=device)
    with pytest.raises(ValueError, match="overlaps an input"):
        mm.matmul(big, big, cfg=cfg(), out=big)
    with pytest.raises(ValueError, match="overlaps an input"):
        mm.matmul(big[:4], big[:, :3], cfg=cfg(), out=big[1:5, :3])
    with pytest.raises(ValueError, match="power of two"):
        mm.matmul(a, b, cfg=cfg(bm=24))
    with pytest.raises(ValueError, match="config is for"):
        mm.matmul(a, b, cfg=LoweringConfig(kind="reduction", block=128))


def test_configurator_default(device):
    pytest.importorskip("nova.schedule.configurator")
    torch.manual_seed(6)
    a, b = torch.randn(33, 45, device=device), torch.randn(45, 17, device=device)
    assert rel_err(mm.matmul(a, b, precision="ieee"), reference(a, b)) < 1e-5


def test_load_kernel_is_content_addressed(tmp_path):
    src = mm.matmul_source(cfg(bm=64), has_bias=True, precision="tf32", batched=True)
    k1, p1 = load_kernel(src, "matmul_kernel", cache_dir=tmp_path)
    k2, p2 = load_kernel(src, "matmul_kernel", cache_dir=tmp_path)
    assert k1 is k2 and p1 == p2 and p1.parent == tmp_path
    assert p1.read_text() == src == kernel_source(k1)
    assert list(tmp_path.glob("*.tmp")) == []
    # warps, stages and the split count are launch options: they share one source
    assert mm.matmul_source(cfg(warps=8, stages=4), has_bias=False, precision="ieee") == mm.matmul_source(
        cfg(), has_bias=False, precision="ieee"
    )
    with pytest.raises(ValueError, match="defines no"):
        load_kernel(src, "no_such_kernel", cache_dir=tmp_path)


def test_fallbacks_are_logged_once(device, caplog):
    """A TMA config with an operand TMA cannot address (no contiguous dim) runs the
    pointer kernel, correctly, and says so once at INFO; a split K too short to split
    runs the one-pass kernel and says so."""
    torch.manual_seed(8)
    a = torch.randn(4, 40, 24, device=device)[:, ::2, ::2]  # [4, 20, 12], no unit stride
    b = torch.randn(12, 16, device=device)
    config = dataclasses.replace(cfg(), instruction="wgmma+tma")
    with caplog.at_level("INFO", logger="nova"):
        for _ in range(2):
            c = mm.matmul(a, b, cfg=config)
        assert rel_err(c, reference(a, b)) < 1e-6
        mm.matmul(b, b.t().contiguous(), cfg=cfg(split_k=4))
    tma = [r for r in caplog.records if "TMA descriptor" in r.getMessage()]
    assert len(tma) == 1 and "pointer-load kernel" in tma[0].getMessage()
    assert any("too short for split_k=4" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("split", [1, 3], ids=["unsplit", "split"])
def test_a_persistent_staged_tf32_kernel_is_the_tile_grid_kernel(device, split):
    """Rule 8d's kernels: both operands prerounded and K-major (the LM head's d and the
    hoisted weight), the staged config run as the persistent loop over its (split, tile)
    work items: bit for bit the one-program-a-work-item kernel (the same BLOCK_K and split,
    the same products in the same order), a ragged M, N and last split included."""
    torch.manual_seed(11)
    a = mm.round_to_tf32(torch.randn(70, 200, device=device))  # [M, K], K contiguous
    b = mm.round_to_tf32(torch.randn(40, 200, device=device)).t()  # [K, N], K contiguous
    grid = dataclasses.replace(cfg(bm=16, bn=16, bk=32, split_k=split, stages=3), instruction="wgmma+tma+stage_a+stage_b")
    pers = dataclasses.replace(grid, persistent=True)
    want = mm.matmul(a, b, cfg=grid, precision="tf32-rn", prerounded=("a", "b"))
    got = mm.matmul(a, b, cfg=pers, precision="tf32-rn", prerounded=("a", "b"), num_programs=5)
    assert torch.equal(got, want)
    assert rel_err(got, reference(a, b)) < 1e-6
