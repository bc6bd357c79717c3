"""The configurator's rules fitted to the GPT-2 step's matmuls on the H200
(bench/results/matmul_gpt2.json; docs/configurator.md, "6c" and "tf32 operands"):
each test names the shape, the config chosen and why the rule fires or does not."""

from __future__ import annotations

import math

import pytest

from nova.schedule import configurator as cf
from nova.schedule.configurator import configure_matmul, plan_matmul

BF16 = ("bfloat16", "bfloat16", "bfloat16", "bf16")
TF32 = ("float32", "float32", "float32", "tf32-rn")


def _tile(c):
    return (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, c.split_k)


@pytest.mark.parametrize("M,N,K,layouts", [
    (32768, 2304, 768, ("row", "col")),  # qkv forward
    (32768, 768, 768, ("row", "col")),  # attention out
    (32768, 3072, 768, ("row", "row")),  # MLP down's input gradient
    (2048, 50304, 768, ("row", "col")),  # the LM head's logits chunk
])  # fmt: skip
def test_bf16_short_k_goes_persistent_not_two_blocks(M, N, K, layouts, monkeypatch):
    """K = 768 with >= 2 S tiles: a persistent kernel, so 6c's halving to two 128x128 blocks
    per SM does not fire. Storing C: the warp-specialized kernel (rule 8b), 128x256x64 with 4
    warps in each computing group, the ring 4 deep beside the store's conversion (measured,
    runs/matmul_ws_49aaf89.json: 0.95-0.97x cuBLAS). With an epilogue, or rule 8b off: the
    flattened loop of rule 8, 128x256x64 w8 s4, C's staging half tile beside the ring
    (runs/matmul_variants_3f4314c.json: 0.94-1.14x cuBLAS; the 128x128 tiles 5-15% behind)."""
    p = plan_matmul(M, N, K, 1, *BF16, *layouts, device="H200")
    assert _tile(p.config) == (128, 256, 64, 4, 4, 1) and p.config.persistent
    assert p.config.instruction == "wgmma+tma+ws" and p.blocks_per_sm == 1
    assert p.smem_bytes == 4 * (128 + 256) * 64 * 2 + 128 * 256 // 2
    monkeypatch.setitem(cf.WS_TILES, "plain", None)
    p = plan_matmul(M, N, K, 1, *BF16, *layouts, device="H200")
    assert _tile(p.config) == (128, 256, 64, 8, 4, 1) and p.config.persistent
    assert p.blocks_per_sm == 1 and p.config.instruction == "wgmma+tma"
    assert p.smem_bytes == 4 * (128 + 256) * 64 * 2 + 128 * 128 * 2


@pytest.mark.parametrize("epilogue", [False, True], ids=["plain", "epilogue"])
def test_warp_specialization_takes_its_tile_and_at_most_four_stages(epilogue):
    """Rule 8b on the GPT-2 step's c_fc shape: 128x256, 4 warps a computing group, one program
    an SM, the ring capped at WS_MAX_STAGES = 4 (5 wrote NaNs into each program's first tile on
    the H200), with an epilogue (its layout conversion beside the ring) as without."""
    c = plan_matmul(32768, 3072, 768, 1, *BF16, "row", "col", device="H200", epilogue=epilogue).config
    assert c.instruction.split("+")[-1] == "ws" and c.persistent
    assert (c.block_m, c.block_n, c.num_warps, c.num_stages) == (128, 256, 4, 4)


@pytest.mark.parametrize("case", ["f32 out", "batched", "split", "tf32", "column sums"])
def test_warp_specialization_only_where_it_was_measured_to_run(case):
    """Rule 8b's bounds: an unsplit 2-D matmul on 16-bit operands with a 16-bit C and >= 2 S
    tiles. An f32 C keeps the flattened loop (its layout conversion leaves a 2-deep ring), a
    batch or a split-K weight gradient their kernels; an epilogue with column sums too (Triton
    3.6's partitioner failed on the tile's row reduction on the H200)."""
    args = {"f32 out": ((32768, 3072, 768, 1, "bfloat16", "bfloat16", "float32", "bf16", "row", "col"), {}),
            "batched": ((1024, 3072, 768, 32, *BF16, "row", "col"), {}),
            "split": ((768, 3072, 32768, 1, *BF16, "col", "row"), {}),
            "tf32": ((32768, 3072, 768, 1, *TF32, "row", "col"), {}),
            "column sums": ((32768, 3072, 768, 1, *BF16, "row", "row"), {"epilogue": True, "epilogue_sums": True})}[case]
    c = plan_matmul(*args[0], device="H200", **args[1]).config
    assert "ws" not in c.instruction.split("+")
    assert c.num_warps == 8 or c.block_m * c.block_n <= 128 * 128


@pytest.mark.parametrize("K", [768, 2304, 3072])
@pytest.mark.parametrize("device", ["H100", "H200"])
def test_few_wide_tiles_take_the_half_warp_specialized_tile(K, device, monkeypatch):
    """Rule 8b's half tile (WS_HALF_TILE): GPT-2's 768-wide outputs at batch 8 (M = 8192) are
    192 tiles of 128x256, under 2 S; at 128x128 they are 384, every program looping over 2-3
    of them in the partitioned loop (measured on an H100, 4e0b99b: 8192x768x768 419 -> 460
    TFLOP/s, 8192x768x2304 565 -> 611). An epilogue keeps its kernel; without the rule, the
    one-program-a-tile grid. (Rule 8f's wave tail, off here, takes K >= 2304 on from this:
    test_configurator_wave_tail.py.)"""
    monkeypatch.setattr(cf, "WAVE_TAIL", False)
    c = plan_matmul(8192, 768, K, 1, *BF16, "row", "row", device=device).config
    assert "ws" in c.instruction.split("+") and c.persistent
    assert (c.block_m, c.block_n, c.num_warps, c.num_stages, c.split_k) == (128, 128, 4, 4, 1)
    e = plan_matmul(8192, 768, K, 1, *BF16, "row", "row", device=device, epilogue=True).config
    assert "ws" not in e.instruction.split("+")
    monkeypatch.setattr(cf, "WS_HALF_TILE", False)
    c = plan_matmul(8192, 768, K, 1, *BF16, "row", "row", device=device).config
    assert "ws" not in c.instruction.split("+") and not c.persistent


@pytest.mark.parametrize("device", ["H100", "H200"])
def test_warp_specialized_tiles_stay_within_c(device):
    """Rule 8b's tile is no wider than C (C's width rounded up to a power of two): a
    50304 x 61 output took 128x256, four times its MMA work in padding; 113 to 128 columns
    take the 128x128 tile, fewer than 128 step 8's kernel, and rule 8f's warp-specialized
    head keeps to the same bound (found by a 120,000-shape sweep of test_any_shape_is_legal's
    checks; GPT-2's shapes, at least 768 wide, keep their configs)."""
    for M, N, K, want in ((50304, 61, 4096, None), (50304, 128, 3072, 128), (50304, 113, 1846, 128),
                          (43, 50304, 4096, None), (8192, 768, 3072, 256)):
        c = configure_matmul(M, N, K, 1, *BF16, "row", "row", device=device)
        assert c.block_n <= max(16, 1 << (N - 1).bit_length()) and c.block_m <= max(16, 1 << (M - 1).bit_length())
        ws = "ws" in c.instruction.split("+")
        assert (c.block_n if ws else None) == want, (M, N, K, c)


def test_short_k_without_enough_tiles_still_takes_two_blocks():
    """6c still fires where the persistent loop is not taken (fewer than 2 S tiles of
    128x256): a 4096 x 2048 x 768 bf16 matmul has 128 of them. With an epilogue: storing C
    alone, 8b's half tile (512 tiles of 128x128) takes the partitioned loop instead."""
    p = plan_matmul(4096, 2048, 768, 1, *BF16, "row", "col", device="H200", epilogue=True)
    assert not p.config.persistent
    assert _tile(p.config)[:2] == (128, 128) and p.blocks_per_sm == 2
    p = plan_matmul(4096, 2048, 768, 1, *BF16, "row", "col", device="H200")
    assert p.config.persistent and "ws" in p.config.instruction.split("+") and _tile(p.config)[:2] == (128, 128)


@pytest.mark.parametrize("M,N,K", [(32768, 768, 3072), (32768, 768, 2304), (50304, 768, 2048)])
def test_bf16_long_k_keeps_one_big_tile(M, N, K):
    """K >= 2048: the edges are 0.20-0.30 of the K loop, below EDGE_RATIO: one 128x256
    block per SM, its ring full (the searched bests are 128x256 / 256x128 at s3-s4)."""
    p = plan_matmul(M, N, K, 1, *BF16, "row", "row", device="H200")
    assert (p.config.block_m, p.config.block_n, p.blocks_per_sm) == (128, 256, 1)
    assert p.config.num_stages == 4


def test_edge_ratio_separates_the_measured_regimes():
    """The threshold sits between the measured cases: bf16 K = 768 (0.79, two blocks
    won) above it; tf32 K = 768 staged (0.49) and bf16 K = 2048 (0.30) below it."""
    S, bw = 132, 4.24e12

    def ratio(bm, bn, k, bk, elt, out, stages, peak):
        edge = (bm * bn * out + (stages - 1) * (bm + bn) * bk * elt) / (bw / S)
        return edge / (2 * bm * bn * k / (peak / S))

    assert ratio(128, 256, 768, 64, 2, 2, 4, 790e12) > cf.EDGE_RATIO
    assert ratio(128, 256, 768, 32, 4, 4, 4, 372e12) < cf.EDGE_RATIO
    assert ratio(128, 256, 2048, 64, 2, 2, 4, 790e12) < cf.EDGE_RATIO


@pytest.mark.parametrize("M,N,K,layouts,stage_a", [
    (32768, 768, 768, ("row", "col"), False),  # forward: K-major W^T, staged anyway (rounding)
    (32768, 768, 3072, ("row", "row"), False),  # input gradient: N-major W
    (50304, 768, 2048, ("col", "row"), False),  # LM head dw: A col, rounded in registers
    (2048, 50304, 768, ("row", "col"), True),  # logits: A (6 MB) costs less to stage than to round
])  # fmt: skip
def test_tf32_stages_b_whatever_its_layout_and_fills_the_ring(M, N, K, layouts, stage_a):
    """tf32-rn rounds an unstaged B in the kernel, a shared -> registers -> shared trip
    whatever its layout (K-major: TF32_ROUND_B_PENALTY, 0.5 T_mma; N-major: 1.2):
    B (a weight, a few MB) is staged. A is staged only where its copy costs less than
    rounding it in registers (0.2 T_mma), also when it is col. Staged operands go
    straight from TMA to wgmma, so the ring is filled: 128x256x32 s4; with both staged
    and >= 2 S tiles, the persistent loop (rule 8d), its ring 3 deep beside C's half tile."""
    c = configure_matmul(M, N, K, 1, *TF32, *layouts, device="H200")
    assert _tile(c)[:5] == ((128, 256, 32, 8, 3) if stage_a else (128, 256, 32, 8, 4))
    assert c.persistent == stage_a
    assert "stage_b" in c.instruction and ("stage_a" in c.instruction) == stage_a


def test_rule_9a_stages_both_tf32_operands_when_on(monkeypatch):
    """Rule 9a (``TF32_SHARED_OPERANDS``, off since the settled register-A kernels measured
    faster and race-free): on, every tf32 kernel on Hopper reads both operands from shared
    memory, whatever rule 2b priced; the tile and split stay rule 2b's."""
    for M, N, K, layouts in [(32768, 768, 768, ("row", "col")), (50304, 768, 2048, ("col", "row")),
                             (384, 1536, 8192, ("col", "row"))]:
        off = configure_matmul(M, N, K, 1, *TF32, *layouts, device="H100")
        monkeypatch.setattr(cf, "TF32_SHARED_OPERANDS", True)
        on = configure_matmul(M, N, K, 1, *TF32, *layouts, device="H100")
        monkeypatch.undo()
        assert "stage_a" not in off.instruction and on.instruction == "wgmma+tma+stage_a+stage_b"
        assert _tile(on) == _tile(off)


@pytest.mark.parametrize("M,N,K,tile", [(4096, 50304, 768, (128, 256, 32, 8, 3, 1)),
                                        (4096, 50304, 384, (128, 256, 32, 8, 3, 1))])
def test_tf32_both_operands_staged_run_persistent(M, N, K, tile):
    """Rule 8d on the LM head's logits (4096-row chunks, GPT-2's and the 46M MLP's widths):
    both operands K-major in shared memory, so the persistent loop overlaps a tile's store
    with the next one's loads (H200, both prerounded: 1.014 ms against 1.224 at K = 768,
    0.647 against 0.697 at K = 384; runs/tf32_variants_lm_head_tiles_2db2bbf.json). Not with
    an epilogue (PERSISTENT_EPILOGUES), nor where B alone is staged (A through registers)."""
    p = plan_matmul(M, N, K, 1, *TF32, "row", "col", device="H200")
    assert _tile(p.config) == tile and p.config.persistent
    assert p.smem_bytes == 3 * (128 + 256) * 32 * 4 + 128 * 128 * 4
    assert not plan_matmul(M, N, K, 1, *TF32, "row", "col", device="H200", epilogue=True).config.persistent
    assert not plan_matmul(50304, 768, 4096, 1, *TF32, "col", "row", device="H200").config.persistent  # dw


def test_tf32_long_k_weight_gradients_still_split():
    """The step-5 split is unchanged by the new rules (the run's Nova configs with it beat
    every searched config): 3072x768x32768 at 128x256 splits K, B staged. Rule 4c (A
    through registers weighs more at narrower tiles: tau grows by 1.2 here) took the
    split from 9 to 11; 72 tiles x 9 or 11 both run as stream-K, whose shares do not
    depend on the count."""
    c = configure_matmul(3072, 768, 32768, 1, *TF32, "col", "row", device="H200")
    assert (c.block_m, c.block_n, c.split_k) == (128, 256, 11) and "stage_b" in c.instruction
    from nova.codegen.triton import matmul as mm
    from nova.schedule.devices import DEVICES

    sms = DEVICES["H200"].sm_count
    assert all(mm.stream_k_applies(3072, 768, s, c, sms, f32=True) for s in (9, 11))  # stream-K either way


def test_a_prerounded_k_major_operand_counts_as_staged_and_a_deep_ring_split_runs_persistent():
    """The LM head's dh (d and the weight both stored rounded, both K-major: ``prerounded``)
    is the staged path without copies, so rule 8d applies to it. The 46M MLP's (N = 384):
    128x128x32 split 4, whose fp32 tile beside the ring leaves 5 stages: persistent, s5
    (0.404 ms against 0.614 one program a work item, bit for bit;
    runs/tf32_variants_lm_head_splits_bb200c1.json). GPT-2's (N = 768): 128x256, 2 stages
    would fit beside its fp32 tile (< PERSISTENT_SPLIT_STAGES): one program a work item.
    Without ``prerounded`` the 46M's dh keeps A rounded in registers and its old kernel."""
    p = plan_matmul(4096, 384, 50304, 1, *TF32, "row", "col", device="H200", prerounded=("a", "b"))
    assert _tile(p.config) == (128, 128, 32, 8, 5, 4) and p.config.persistent
    assert p.config.instruction == "wgmma+tma+stage_a+stage_b"
    assert p.smem_bytes == 5 * (128 + 128) * 32 * 4 + 128 * 128 * 4
    g = plan_matmul(4096, 768, 50304, 1, *TF32, "row", "col", device="H200", prerounded=("a", "b")).config
    assert (g.block_m, g.block_n, g.split_k) == (128, 256, 4) and not g.persistent
    old = plan_matmul(4096, 384, 50304, 1, *TF32, "row", "col", device="H200").config
    assert old.instruction == "wgmma+tma+stage_b" and not old.persistent and old.num_stages == 3
    # an operand prerounded but not K-major is not staged for free (the launcher would copy it)
    m = plan_matmul(50304, 384, 4096, 1, *TF32, "col", "row", device="H200", prerounded=("a",)).config
    assert not m.persistent and "stage_a" not in m.instruction


@pytest.mark.parametrize("M,N,K,layouts", [
    (50304, 384, 4096, ("col", "row")),  # the 46M MLP's LM head weight gradient
    (8192, 384, 1536, ("row", "col")),  # its MLP down projection
])  # fmt: skip
def test_padding_past_an_eighth_takes_the_next_smaller_tile(M, N, K, layouts, monkeypatch):
    """Rule 4b: N = 384 on 256-wide tiles computes 512 columns (1.33x the work), so the
    128x128 rung (no padding) is taken: 50304x384x4096 tf32 measured 0.605 ms at 128x128x32
    against 0.76 at 128x256x32, cuBLAS 0.645 (runs/tf32_variants_lm_head_dw_c2b6e8c.json).
    With the rule off (PAD_WASTE past any padding) the tile is the old 128x256."""
    c = configure_matmul(M, N, K, 1, *TF32, *layouts, device="H200")
    assert (c.block_m, c.block_n, c.block_k, c.split_k) == (128, 128, 32, 1)
    monkeypatch.setattr(cf, "PAD_WASTE", 1.0)
    c = configure_matmul(M, N, K, 1, *TF32, *layouts, device="H200")
    assert (c.block_m, c.block_n) == (128, 256)


def test_padding_within_an_eighth_keeps_the_big_tile():
    """GPT-2's vocabulary, 50304 = 196.5 x 256: the logits' 256-wide tiles pad 0.25% of the
    work, under PAD_WASTE, so rule 4b leaves the 128x256 tile of the LM head alone."""
    c = configure_matmul(2048, 50304, 768, 1, *BF16, "row", "col", device="H200")
    assert (c.block_m, c.block_n) == (128, 256)


def test_a_compute_bound_tile_that_a_split_fills_the_machine_with_is_not_halved(monkeypatch):
    """Step 4 keeps 128x256 on GPT-2's 768x768x32768 weight gradient: 18 tiles split 7 ways
    (126 work items) beat, in step 5's own model, the halved 128x128 tile unsplit; measured
    0.059 ms against the halved-then-split 64x128 split 7, 0.076 (cuBLAS 0.064;
    runs/split_variants_bf16_b32_edf14a3.json). With the rule off the old halving comes back.
    A memory-bound shape (the grid's 128x8192x8192) still halves to its unsplit 64x128, and a
    short K (2048x768x2048) to its unsplit 128x128: there the halved tile is faster in the model."""
    c = configure_matmul(768, 768, 32768, 1, *BF16, "col", "row", device="H200")
    assert (c.block_m, c.block_n, c.split_k) == (128, 256, 7)
    m = configure_matmul(128, 8192, 8192, 1, *BF16, "row", "row", device="H200")
    assert (m.block_m, m.block_n, m.split_k) == (64, 128, 1)
    s = configure_matmul(2048, 768, 2048, 1, *BF16, "row", "row", device="H200")
    assert (s.block_m, s.block_n, s.split_k) == (128, 128, 1)
    monkeypatch.setattr(cf, "SPLIT_BEFORE_HALVING", False)
    c = configure_matmul(768, 768, 32768, 1, *BF16, "col", "row", device="H200")
    assert (c.block_m, c.block_n, c.split_k) == (64, 128, 7)


def test_tf32_stages_b_of_a_weight_gradient_with_both_operands_k_outermost(monkeypatch):
    """A weight gradient (A = X^T M-major, B = dY N-major) left unstaged puts both tiles
    through registers: ~3.5 T_mma extra (TF32_REGISTER_BOTH_PENALTY, measured on an H100:
    the 46M MLP's 384x1536x8192 0.143 ms unstaged against 0.076 with B staged at
    128x256x32 sk7, the copy included). On the H100 (3.01 TB/s, 379 TFLOP/s) B's copy,
    35 us, is more than 1.2 T_mma (31 us) but less than 3.5: staged, and that kernel is
    the one measured best. A K-major A beside the same N-major B keeps the 1.2. Unstaged,
    the N-major B takes its register path's tiles (128x64), A and B rounded in registers."""
    c = configure_matmul(384, 1536, 8192, 1, *TF32, "col", "row", device="H100")
    assert _tile(c) == (128, 256, 32, 8, 4, 7) and c.instruction == "wgmma+tma+stage_b"
    monkeypatch.setattr(cf, "TF32_REGISTER_BOTH_PENALTY", cf.TF32_REGISTER_B_PENALTY)
    u = configure_matmul(384, 1536, 8192, 1, *TF32, "col", "row", device="H100")
    assert (u.block_m, u.block_n) == (128, 64) and u.split_k > 1 and "stage" not in u.instruction
    monkeypatch.undo()
    # A K-major (row), B N-major: the one-operand penalty decides (B's copy 35 us > 1.2 T_mma)
    r = configure_matmul(384, 1536, 8192, 1, *TF32, "row", "row", device="H100")
    assert (r.block_m, r.block_n) == (128, 64) and r.split_k > 1 and "stage" not in r.instruction


@pytest.mark.parametrize("tiles", [67, 80, 96, 110, 131])
@pytest.mark.parametrize("k_steps", [8, 64, 512, 1572])
@pytest.mark.parametrize("c_over_tau", [1e-4, 3e-3, 0.05, 0.4])
def test_the_one_wave_split_scan_stops_early_on_the_same_split_as_a_full_scan(tiles, k_steps, c_over_tau):
    """Step 5's one-wave split: the scan that stops once a split's partials alone cost the
    best time found (``least_time_split``) returns what ``min`` over every split returns."""
    S, tau = 132, 1e-4
    c = c_over_tau * tau

    def model_time(s):
        return math.ceil(tiles * s / S) * tau / s + (c * s + cf.LAUNCH_SECONDS if s > 1 else 0.0)

    most = k_steps // 2
    assert cf.least_time_split(model_time, c, most) == min(range(2, most + 1), key=model_time)


def test_persistent_staged_epilogues_reach_only_the_staged_tf32_path(monkeypatch):
    """``PERSISTENT_STAGED_EPILOGUES`` (off as shipped) puts rule 8d's persistent loop under
    the staged tf32 path's epilogue kernels (GPT-2 tf32 b16's c_fc forward, A prerounded),
    with the same BLOCK_K and split (the same sums); nothing else changes (a bf16 epilogue
    kernel keeps its warp-specialized one, rule 8b; a tf32 one with A in registers its grid)."""
    fc = (16384, 3072, 768, 1, *TF32, "row", "col", False, "H200", True)
    others = [(16384, 3072, 768, 1, *BF16, "row", "col", False, "H200", True),
              (16384, 768, 768, 1, *TF32, "row", "col", False, "H200", True)]
    off = configure_matmul(*fc, prerounded=("a",))
    before = [configure_matmul(*o) for o in others]
    assert not off.persistent
    monkeypatch.setattr(cf, "PERSISTENT_STAGED_EPILOGUES", True)
    on = configure_matmul(*fc, prerounded=("a",))
    assert on.persistent and on.instruction == "wgmma+tma+stage_a+stage_b"
    assert (on.block_k, on.split_k) == (off.block_k, off.split_k)
    assert [configure_matmul(*o) for o in others] == before


@pytest.mark.parametrize("M,N,K,tiles_off", [
    (16384, 3072, 768, (128, 128, 3)),   # GPT-2 tf32 b16's c_fc forward: 6c's two blocks an SM
    (16384, 768, 3072, (128, 256, 4)),   # its MLP down projection with the residual
    (8192, 1536, 384, (128, 128, 3)),    # the 46M MLP's up projection with GELU
])  # fmt: skip
def test_tf32_retile_epilogues_takes_128x128_persistent_only_with_both_switches(M, N, K, tiles_off, monkeypatch):
    """``TF32_RETILE_EPILOGUES`` (off as shipped): with ``PERSISTENT_STAGED_EPILOGUES`` a staged tf32
    epilogue launch takes rule 8e's 128x128 tile in 8d's persistent loop, its ring as deep as fits
    beside C's half tile (5 stages), whatever its waves' fill; the same BLOCK_K and split. Alone,
    or with the switches off, the launch keeps its grid; PERSISTENT_STAGED_EPILOGUES alone gives
    the 128x256 persistent tile measured slower in the steps."""
    args = (M, N, K, 1, *TF32, "row", "col", False, "H100", True)
    off = configure_matmul(*args, prerounded=("a", "b"))
    assert ((off.block_m, off.block_n, off.num_stages), off.persistent) == (tiles_off, False)
    monkeypatch.setattr(cf, "TF32_RETILE_EPILOGUES", True)
    assert configure_matmul(*args, prerounded=("a", "b")) == off
    monkeypatch.setattr(cf, "PERSISTENT_STAGED_EPILOGUES", True)
    on = configure_matmul(*args, prerounded=("a", "b"))
    assert (on.block_m, on.block_n, on.num_stages, on.persistent) == (128, 128, 5, True)
    assert (on.block_k, on.split_k, on.instruction) == (off.block_k, off.split_k, "wgmma+tma+stage_a+stage_b")
    monkeypatch.setattr(cf, "TF32_RETILE_EPILOGUES", False)
    alone = configure_matmul(*args, prerounded=("a", "b"))
    assert (alone.block_m, alone.block_n, alone.persistent) == (128, 256, True)


@pytest.mark.parametrize("M,N,K", [(16384, 2304, 768), (8192, 1536, 384)])
def test_the_staged_tf32_path_takes_warp_specialization_only_when_asked(M, N, K, monkeypatch):
    """Rule 8b on the staged tf32 path (WS_TF32, off): both operands rounded and K-major (here
    prerounded, read in place), C in fp32, no epilogue, at least 2 S tiles of WS_TF32_TILE: the
    partitioned loop at 128x128 with 4 warps a computing group, its ring beside the fp32 tile
    (BM BN x 4 bytes), the staging tokens kept. Off: step 8d's flattened loop."""
    args = (M, N, K, 1, *TF32, "row", "col")
    off = plan_matmul(*args, device="H100", prerounded=("a", "b")).config
    assert "ws" not in off.instruction.split("+")
    monkeypatch.setattr(cf, "WS_TF32", True)
    p = plan_matmul(*args, device="H100", prerounded=("a", "b"))
    c = p.config
    assert c.instruction == "wgmma+tma+stage_a+stage_b+ws" and c.persistent
    assert (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, c.split_k) == (128, 128, 32, 4, 4, 1)
    assert p.smem_bytes == 4 * (128 + 128) * 32 * 4 + 128 * 128 * 4
    e = plan_matmul(*args, device="H100", prerounded=("a", "b"), epilogue=True).config
    assert "ws" not in e.instruction.split("+")


@pytest.mark.parametrize("M,N,K,fill,retiled", [
    (8192, 768, 768, 192 / 264, True),  # attention out at batch 8: 1.45 waves of 128x256
    (8192, 768, 3072, 192 / 264, True),  # MLP down
    (8192, 2304, 768, 576 / 660, True),  # qkv: 4.36 waves, 0.87 full
    (8192, 3072, 768, 768 / 792, False),  # c_fc: 0.97 full, 128x256 stays (125.5 against 138.1 us)
    (8192, 1536, 384, 384 / 396, False),  # the 46M MLP's up projection: full waves
])  # fmt: skip
def test_staged_tf32_part_full_waves_retile_to_128x128_persistent(M, N, K, fill, retiled, monkeypatch):
    """Rule 8e on the H100 (its 132 SMs; measured there, runs/matmul_wide_h100_82788fb.json):
    both tf32 operands prerounded and K-major, unsplit, a 128x256 grid filling less than 0.9 of
    its waves runs 128x128 in rule 8d's persistent loop; at TF32_RETILE_WAVE_FILL = 0 it keeps
    what the steps before it chose (never a persistent 128x128)."""
    c = configure_matmul(M, N, K, 1, *TF32, "row", "col", device="H100", prerounded=("a", "b"))
    tiles = math.ceil(M / 128) * math.ceil(N / 256)
    assert tiles / (math.ceil(tiles / 132) * 132) == pytest.approx(fill)
    assert ((c.block_m, c.block_n, c.persistent, c.split_k) == (128, 128, True, 1)) == retiled
    if retiled:
        assert c.instruction == "wgmma+tma+stage_a+stage_b" and c.num_stages == 5
    monkeypatch.setattr(cf, "TF32_RETILE_WAVE_FILL", 0.0)
    c = configure_matmul(M, N, K, 1, *TF32, "row", "col", device="H100", prerounded=("a", "b"))
    assert not (c.block_m == c.block_n == 128 and c.persistent)


def test_staged_tf32_retile_is_from_128x256_only():
    """8e takes 128x256 -> 128x128 only: the 46M MLP's 8192x384x1536 (192 tiles of 128x128, 0.73
    full) keeps 6c's two blocks an SM, not a 64x128 persistent grid nobody measured."""
    c = configure_matmul(8192, 384, 1536, 1, *TF32, "row", "col", device="H100", prerounded=("a", "b"))
    assert (c.block_m, c.block_n, c.persistent) == (128, 128, False)


@pytest.mark.parametrize("device", ["H100", "H200"])
def test_step_4_weighs_the_halved_tile_at_its_own_split(device, monkeypatch):
    """Rule 4d: GPT-2 bf16 batch 8's 768x768x8192 weight gradient halves to 128x128 split 3
    (108 work items, 21.9 us in the H100's model) rather than keeping 128x256 split 7 (126 items,
    26.0 us): measured on an H100 22.3 against 25.3 us (runs/matmul_tail_h100_d218078.json).
    It stops at 128x128: the next halving, 64x128, is weighed unsplit (64-row tiles ran 30.8
    us). Batch 32's K = 32768 keeps 128x256 split 7, where the model puts 128x128 split 3 3.7%
    behind. A halved tile that step 4 would halve again is weighed unsplit: 1024x1024x32768
    keeps 128x256 (at 128x128 split 2 it would go on to 64x128 unsplit, the model's best for
    want of a rate term). Tiles under HALVED_SPLIT_MIN_TILE are weighed unsplit (640x512x16384
    would take 128x256 split 13 if 64-row tiles were weighed at their split). With the rule off
    the old choice comes back."""
    c = configure_matmul(768, 768, 8192, 1, *BF16, "col", "row", device=device)
    assert (c.block_m, c.block_n, c.block_k, c.split_k, c.persistent) == (128, 128, 64, 3, False)
    assert not c.tail_at
    b32 = configure_matmul(768, 768, 32768, 1, *BF16, "col", "row", device=device)
    assert (b32.block_m, b32.block_n, b32.split_k) == (128, 256, 7)
    big = configure_matmul(1024, 1024, 32768, 1, *BF16, "col", "row", device=device)
    assert (big.block_m, big.block_n, big.split_k) == (128, 256, 4)
    g = configure_matmul(640, 512, 16384, 1, *BF16, "col", "row", device=device)
    assert (g.block_m, g.block_n, g.split_k) == (128, 128, 6)
    monkeypatch.setattr(cf, "HALVED_SPLIT_MIN_TILE", 64)
    g64 = configure_matmul(640, 512, 16384, 1, *BF16, "col", "row", device=device)
    assert (g64.block_m, g64.block_n) == (128, 256)
    monkeypatch.undo()
    monkeypatch.setattr(cf, "HALVED_OWN_SPLIT", False)
    off = configure_matmul(768, 768, 8192, 1, *BF16, "col", "row", device=device)
    assert (off.block_m, off.block_n, off.split_k) == (128, 256, 7)
