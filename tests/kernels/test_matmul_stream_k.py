"""Split-K as stream-K (``matmul.STREAM_K_SPLIT``), through the interpreter: every
K-step of every tile added exactly once (integer-valued operands: the exact product,
bit for bit), whatever the number of programs (shares ending inside a tile, shares
spanning several tiles, more programs than tiles), ragged edges, a bias, 16-bit and
fp32 operands, the same bits on every launch; only 2-D split configs with descriptor
operands and no epilogue take it; its scratch is counted."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nova.codegen.triton import matmul as mm
from nova.schedule.config import LoweringConfig

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

TMA = LoweringConfig(kind="matmul", block_m=64, block_n=64, block_k=32, group_m=2, split_k=3, num_warps=8,
                     num_stages=2, instruction="wgmma+tma")


def _ints(*shape, gen, dtype):
    return torch.randint(-3, 4, shape, generator=gen).to(dtype)


def _run(a, b, bias, cfg, out_dtype, stream, monkeypatch, programs=None, precision=None, lockstep=True):
    monkeypatch.setattr(mm, "STREAM_K_SPLIT", stream)
    monkeypatch.setattr(mm, "STREAM_K_LOCKSTEP", lockstep)
    monkeypatch.setattr(mm, "STREAM_K_F32", True)  # fp32 operands too (as shipped; the switch's own test is below)
    rec: dict = {}
    c = mm.matmul(a, b, bias, cfg=cfg, out_dtype=out_dtype, precision=precision, num_programs=programs, record=rec)
    return c, "".join(open(p).read() for p in rec if p != "tf32_stage")  # (the staging's record, no file)


@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "contiguous"])
@pytest.mark.parametrize("programs", [1, 3, 7, 11], ids=lambda p: f"{p}prog")
@pytest.mark.parametrize("case", ["bf16", "bf16-bias-ragged", "f32-ieee", "f32-tf32", "f32-tf32-rn-staged"])
def test_stream_k_adds_every_k_step_of_every_tile_once(case, programs, lockstep, device, monkeypatch):
    """Integer operands (exact in every dtype and every order of the sums): C is the exact
    product. 136 x 136 is 3 x 3 tiles of 64 (ragged), K 200 is 7 K-steps of 32: 63
    iterations over 1, 3, 7 or 11 programs; tf32 products too (small integers are exact in
    tf32), the operands staged rounded as the tf32 step's weight gradients are (11: more programs than tiles, fewer than the split
    grid's 27, or 12 unragged, which is then more than one wave of them), in either form of
    the shares."""
    g = torch.Generator().manual_seed(3)
    ragged = "ragged" in case
    M, N, K = (136, 136, 200) if ragged else (128, 128, 192)
    dtype = torch.float32 if case.startswith("f32") else torch.bfloat16
    a = _ints(M, K, gen=g, dtype=dtype)
    b = _ints(N, K, gen=g, dtype=dtype).t()  # K contiguous: a weight's layout
    bias = _ints(N, gen=g, dtype=torch.float32) if "bias" in case else None
    a, b = a.to(device), b.to(device)
    bias = bias.to(device) if bias is not None else None
    prec = {"f32-ieee": "ieee", "f32-tf32": "tf32", "f32-tf32-rn-staged": "tf32-rn"}.get(case)
    cfg = dataclasses.replace(TMA, instruction="wgmma+tma+stage_a+stage_b") if "staged" in case else TMA
    got, src = _run(a, b, bias, cfg, torch.float32, True, monkeypatch, programs, prec, lockstep)
    assert "matmul_streamk_fixup" in src and "matmul_kernel_reduce" not in src
    want = a.double() @ b.double() + (bias.double() if bias is not None else 0)
    assert torch.equal(got.double(), want)
    again, _ = _run(a, b, bias, cfg, torch.float32, True, monkeypatch, programs, prec, lockstep)
    assert torch.equal(again, got)


def test_stream_k_rounds_as_the_split_kernel_does_within_fp32(device, monkeypatch):
    """Random bf16 operands, bf16 C: within bf16 rounding of the two-pass split's C (the
    sums' chunks differ: not bit for bit), and of the exact product."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(130, 256, generator=g).to(torch.bfloat16).to(device)
    b = torch.randn(96, 256, generator=g).to(torch.bfloat16).t().to(device)
    got, _ = _run(a, b, None, TMA, torch.bfloat16, True, monkeypatch, 5)
    split, src = _run(a, b, None, TMA, torch.bfloat16, False, monkeypatch)
    assert "matmul_kernel_reduce" in src
    ref = a.double() @ b.double()
    for c in (got, split):
        assert ((c.double() - ref).norm() / ref.norm()).item() < 4e-3
    assert ((got.double() - split.double()).abs() <= 2 ** -7 * split.double().abs() + 1e-6).all()


def _covered(shares, tiles, k_steps):
    seen = torch.zeros(tiles, k_steps, dtype=torch.int64)
    for share in shares:
        for t, lo, hi in share:
            assert 0 <= t < tiles and 0 <= lo < hi <= k_steps
            seen[t, lo:hi] += 1
    return seen


@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "contiguous"])
def test_shares_cover_every_iteration_once_and_balance(lockstep):
    """Every (tile, K-step) in exactly one segment, and no share more than a few K-steps
    past tiles x K-steps / programs (the wave-free load stream-K is for), at the step's
    weight-gradient tilings and at small, ragged ones."""
    for tiles, k_steps, programs in [(72, 512, 132), (18, 512, 132), (54, 512, 132), (24, 48, 132), (9, 7, 3),
                                     (9, 7, 40), (200, 16, 132), (1, 2, 132), (133, 5, 132), (5, 1000, 7)]:
        shares = mm.streamk_shares(tiles, k_steps, programs, lockstep)
        assert len(shares) == programs
        assert bool((_covered(shares, tiles, k_steps) == 1).all()), (tiles, k_steps, programs)
        work = [sum(hi - lo for _, lo, hi in share) for share in shares]
        assert max(work) <= -(-tiles * k_steps // programs) + 3, (tiles, k_steps, programs, max(work))


def test_lockstep_shares_walk_in_bands():
    """The H200's 768x3072x32768 weight gradient at 128x256x64: 72 tiles of 512 K-steps on
    132 SMs. 72 programs take K-steps 0..280 of every tile, the same range (the split's
    first wave's L2 reuse); 60 take 280..512 of tiles 0..59, then the last 12 tiles' 280..512
    in 5 bands of 12 programs. 192 partial tiles, where 7 splits write 504. The fix-up adds
    each tile's in K order."""
    shares = mm.streamk_shares(72, 512, 132)
    assert [s for s in shares[:72]] == [[(t, 0, 280)] for t in range(72)]
    assert [s[0] for s in shares[72:]] == [(t, 280, 512) for t in range(60)]
    bands = sorted({(lo, hi) for s in shares[72:] for _, lo, hi in s[1:]})
    assert len(bands) == 5 and bands[0][0] == 280 and bands[-1][1] == 512
    assert all(len(s) == 2 and s[1][0] >= 60 for s in shares[72:])
    seg_off, segs, fix_off, fix_slot = mm.streamk_tables(72, 512, 132)
    assert seg_off[-1] == len(segs) // 3 == len(fix_slot) == 192 and fix_off[-1] == 192
    for t in range(72):
        los = [segs[3 * s + 1] for s in fix_slot[fix_off[t]:fix_off[t + 1]]]
        assert los == sorted(los) and los[0] == 0 and all(segs[3 * s] == t for s in fix_slot[fix_off[t]:fix_off[t + 1]])
    assert len({s[0][1] for s in shares}) == 2
    contiguous = mm.streamk_shares(72, 512, 132, lockstep=False)  # the first form: 11 starting K-steps
    assert len({s[0][1] for s in contiguous}) == 11


def test_only_2d_descriptor_splits_without_an_epilogue_take_it(device, monkeypatch):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(40, 96, generator=g).to(device)
    b = torch.randn(96, 24, generator=g).to(device)
    ptr = dataclasses.replace(TMA, block_m=16, block_n=32, block_k=16, instruction="mma")
    got, src = _run(a, b, None, ptr, torch.float32, True, monkeypatch, precision="ieee")  # pointer operands
    assert "matmul_streamk" not in src and "matmul_kernel_reduce" in src
    a3 = torch.randn(2, 64, 96, generator=g).to(torch.bfloat16).to(device)
    b3 = torch.randn(2, 96, 64, generator=g).to(torch.bfloat16).to(device)
    _, src = _run(a3, b3, None, TMA, torch.float32, True, monkeypatch)  # batched
    assert "matmul_streamk" not in src
    ep = mm.Epilogue(shape=(64, 64), operands=(), body="y = acc * 2.0", stores=(("y", "f32", torch.float32),),
                     out_shapes=((64, 64),))
    monkeypatch.setattr(mm, "STREAM_K_SPLIT", True)
    rec: dict = {}
    (y,) = mm.matmul_epilogue(a3[0], b3[0], ep, [], torch.float32, cfg=TMA, record=rec)
    assert not any("matmul_streamk" in open(p).read() for p in rec)
    assert torch.allclose(y, 2.0 * (a3[0].float() @ b3[0].float()), rtol=1e-3, atol=1e-3)


def test_scratch_counts_the_partial_tiles(monkeypatch):
    """(programs x segments) fp32 tiles on the stand-in device's SMs, or the split's
    [S, M, N] partials where those are more (operands that take no descriptor at launch
    run the split kernel)."""
    monkeypatch.setattr(mm, "STREAM_K_SPLIT", False)
    split = mm.scratch_bytes(768, 3072, 32768, 1, torch.bfloat16, torch.bfloat16, torch.bfloat16, TMA)
    monkeypatch.setattr(mm, "STREAM_K_SPLIT", True)
    stream = mm.scratch_bytes(768, 3072, 32768, 1, torch.bfloat16, torch.bfloat16, torch.bfloat16, TMA)
    programs, segments = mm.streamk_plan(768, 3072, 32768, TMA, mm.device_spec(torch.device("cpu")).num_sms)
    assert split == 3 * 768 * 3072 * 4 and programs == 132
    assert stream == max(segments * 64 * 64 * 4, split)
    big = dataclasses.replace(TMA, block_m=128, block_n=256, split_k=7)  # the H200's 768x3072 weight gradient
    assert mm.streamk_plan(768, 3072, 32768, big, 132) == (132, 192)
    assert 192 * 128 * 256 * 4 < 7 * 768 * 3072 * 4
    assert mm.scratch_bytes(768, 3072, 32768, 1, torch.bfloat16, torch.bfloat16, torch.bfloat16, big) == 7 * 768 * 3072 * 4
    assert mm.streamk_plan(64, 64, 64, TMA, 132) == (2, 2)  # one tile of 2 K-steps: two programs
    # a split grid of one wave keeps the split (768x768 at 128x256: 18 tiles x 7 splits on 132 SMs)
    assert mm.stream_k_applies(768, 3072, 7, big, 132, False) and not mm.stream_k_applies(768, 768, 7, big, 132, False)
    # fp32 operands (the tf32 step's) with STREAM_K_F32 (on as shipped since the H100 run at 1b29c22)
    assert mm.STREAM_K_F32 and mm.stream_k_applies(768, 3072, 7, big, 132, True)
    monkeypatch.setattr(mm, "STREAM_K_F32", False)
    assert not mm.stream_k_applies(768, 3072, 7, big, 132, True)
    assert mm.stream_k_applies(768, 3072, 7, big, 132, False)
    assert mm.scratch_bytes(768, 768, 32768, 1, torch.bfloat16, torch.bfloat16, torch.bfloat16, big) == 7 * 768 * 768 * 4


def _build_sm90() -> None:
    """Compile both kernels for sm_90a (Triton's ptxas, no GPU) at the step's weight-gradient
    config (128x256x64, 8 warps, 4 stages; A column-major, B row-major) and print, per kernel:
    name, registers, spill bytes, shared memory, whether the dot is a wgmma."""
    import contextlib
    import io
    import os
    import re
    import tempfile

    import triton

    cache = tempfile.TemporaryDirectory(prefix="streamk_sm90_")
    os.environ["TRITON_CACHE_DIR"] = cache.name  # a cached kernel prints no ptxas log: compile afresh
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nova.codegen.triton.source import load_kernel

    cfg = LoweringConfig(kind="matmul", block_m=128, block_n=256, block_k=64, group_m=4, split_k=7, num_warps=8,
                         num_stages=4, instruction="wgmma+tma")
    src = mm.streamk_source(cfg, mm.TmaLayout(a="col", b="row"), has_bias=False, precision="bf16",
                            in_dtype="bfloat16", out_dtype="bfloat16")
    ints = {"M": "i32", "N": "i32", "K": "i32"}
    for name, sig, opts in [
        ("matmul_streamk", {"a_desc": "tensordesc<bf16[64, 128]>", "b_desc": "tensordesc<bf16[64, 256]>",
                            "ws_ptr": "*fp32", "seg_off_ptr": "*i32", "segs_ptr": "*i32", **ints},
         dict(num_warps=8, num_stages=4)),
        ("matmul_streamk_fixup", {"ws_ptr": "*fp32", "fix_off_ptr": "*i32", "fix_slot_ptr": "*i32", "c_ptr": "*bf16",
                                  **ints, "stride_cm": "i32", "stride_cn": "i32"},
         dict(num_warps=4)),
    ]:
        fn, _ = load_kernel(src, name)
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a.endswith("_ptr")}
        log = io.StringIO()
        triton.knobs.nvidia.dump_ptxas_log = True
        try:
            with contextlib.redirect_stdout(log):
                k = triton.compile(ASTSource(fn, sig, {}, attrs), target=GPUTarget("cuda", 90, 32), options=opts)
        finally:
            triton.knobs.nvidia.dump_ptxas_log = False
        regs = re.findall(r"Used (\d+) registers", log.getvalue())
        spills = re.findall(r"(\d+) bytes spill stores", log.getvalue())
        print("BUILT", name, regs[0], spills[0] if spills else 0, k.metadata.shared,
              "warp_group_dot" in k.asm["ttgir"])
    cache.cleanup()


def test_kernels_build_for_sm90():
    """The main kernel's K loop (inside the share's walk over tiles) is still a wgmma loop
    with its operand ring pipelined (4 stages of 48 KB in shared memory), no spills; the
    fix-up spills nothing either. Offline sm_90a, in a process without the interpreter."""
    from test_rowwise import run_sm90_build

    out = [ln.split()[1:] for ln in run_sm90_build(__file__).splitlines() if ln.startswith("BUILT")]
    main, fixup = out
    assert main[0] == "matmul_streamk" and main[2] == "0" and main[4] == "True"
    assert int(main[3]) >= 4 * (128 + 256) * 64 * 2 and int(main[1]) <= 255
    assert fixup[0] == "matmul_streamk_fixup" and fixup[2] == "0"


if __name__ == "__main__":
    _build_sm90()
