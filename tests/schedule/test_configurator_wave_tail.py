"""Configurator rule 8f, the wave tail (docs/configurator.md, 9f): which of GPT-2's bf16
matmuls run as a head and a tail, where C is cut, and which keep one launch. Measured on an
H100 (scripts/matmul_tail.py, bench/results/runs/matmul_tail_h100_d218078.json); the H200
has the same 132 SMs, so the same cuts."""

from __future__ import annotations

import math

import pytest

from nova.schedule import configurator as cf
from nova.schedule.config import LoweringConfig
from nova.schedule.configurator import configure_matmul, plan_matmul, tail_config

BF16 = ("bfloat16", "bfloat16", "bfloat16", "bf16")


def _cut(c: LoweringConfig):
    return (c.tail_at, c.tail_axis, c.tail_split)


@pytest.mark.parametrize("device", ["H100", "H200"])
@pytest.mark.parametrize("M,N,K,layouts,head,cut", [
    # 768-wide outputs at batch 8: 192 tiles of 128x256 (1.45 waves): one wave of 44 row blocks
    # warp-specialized at 128x256, the last 2560 rows (120 tiles of 128x128) one launch after
    (8192, 768, 3072, ("row", "col"), (128, 256, 4, 4), (5632, "m", 1)),
    (8192, 768, 3072, ("row", "row"), (128, 256, 4, 4), (5632, "m", 1)),
    (8192, 768, 2304, ("row", "row"), (128, 256, 4, 4), (5632, "m", 1)),
    # weight gradients, A = dY^T: 144 tiles of 128x128; 132 unsplit, the other 12 split 11 ways
    (3072, 768, 8192, ("col", "row"), (128, 128, 8, 5), (2816, "m", 11)),
    (768, 3072, 8192, ("col", "row"), (128, 128, 8, 5), (2816, "n", 11)),  # cut along N: 6 row blocks
])  # fmt: skip
def test_gpt2_batch8_shapes_take_a_tail(M, N, K, layouts, head, cut, device):
    p = plan_matmul(M, N, K, 1, *BF16, *layouts, device=device)
    c = p.config
    assert _cut(c) == cut and (c.block_m, c.block_n, c.num_warps, c.num_stages) == head and c.split_k == 1
    assert ("ws" in c.instruction.split("+")) == (head[1] == 256) and c.persistent == (head[1] == 256)
    t = tail_config(c, K)
    assert (t.block_m, t.block_n, t.num_warps, t.num_stages, t.split_k, t.persistent) == (128, 128, 8, 5, cut[2], False)
    # the head's tiles are whole waves of the 132 SMs; the tail's (tile, split) items at most one
    rows, cols = (cut[0], N) if cut[1] == "m" else (M, cut[0])
    head_tiles = math.ceil(rows / c.block_m) * math.ceil(cols / c.block_n)
    rest = (M - rows) * N if cut[1] == "m" else M * (N - cols)
    tail_items = rest // (128 * 128) * cut[2] if rest % (128 * 128) == 0 else None
    assert head_tiles % 132 == 0 and tail_items is not None and tail_items <= 132
    assert p.tiles == head_tiles + rest // (128 * 128)


@pytest.mark.parametrize("M,N,K,layouts,why", [
    (8192, 768, 768, ("row", "col"), "one 12-step tile a program in the head: lost 20.9 -> 23.7 us"),
    (768, 768, 8192, ("col", "row"), "36 tiles of 128x128: no whole wave to head with"),
    (768, 2304, 8192, ("col", "row"), "108 tiles, one wave unsplit already"),
    (8192, 3072, 768, ("row", "row"), "768 tiles of 128x256: five whole waves, past TAIL_MAX_WAVES"),
    (4096, 768, 50304, ("row", "row"), "the LM head's dh: 60 tail tiles, split 2 < TAIL_MIN_SPLIT"),
    (32768, 768, 3072, ("row", "row"), "batch 32: 768 tiles of 128x256, past TAIL_MAX_WAVES"),
    (3072, 768, 32768, ("col", "row"), "batch 32's weight gradient: 512 K-steps, lost 1% to stream-K"),
    (768, 3072, 32768, ("col", "row"), "... and its transpose: lost 1.6%"),
])  # fmt: skip
def test_shapes_that_keep_one_launch(M, N, K, layouts, why):
    assert _cut(configure_matmul(M, N, K, 1, *BF16, *layouts, device="H100")) == (0, "", 1), why


def test_only_a_plain_16_bit_launch_takes_a_tail(monkeypatch):
    """An epilogue, a batch, fp32 operands (tf32) and an fp32 C keep their one launch; so does
    everything with the rule off."""
    args = (3072, 768, 8192)
    assert configure_matmul(*args, 1, *BF16, "col", "row", device="H100").tail_at
    assert not configure_matmul(*args, 1, *BF16, "col", "row", device="H100", epilogue=True).tail_at
    assert not configure_matmul(*args, 2, *BF16, "col", "row", device="H100").tail_at
    assert not configure_matmul(*args, 1, "bfloat16", "bfloat16", "float32", "bf16", "col", "row",
                                device="H100").tail_at
    assert not configure_matmul(*args, 1, "float32", "float32", "float32", "tf32-rn", "col", "row",
                                device="H100").tail_at
    monkeypatch.setattr(cf, "WAVE_TAIL", False)
    c = configure_matmul(*args, 1, *BF16, "col", "row", device="H100")
    assert not c.tail_at and c.split_k > 1  # step 5's split, as before the rule


@pytest.mark.parametrize("device", ["H100", "H200"])
def test_no_tail_whose_ring_does_not_fit(device):
    """8833x513x3969 bf16 takes BLOCK_K 128; the warp-specialized head fits at 2 stages, but the
    tail's 128x128 ring at tail_config's 5 stages is 320 KiB: no tail then (found by
    test_configurator.py's test_any_shape_is_legal). Every tail the rule does cut fits."""
    from nova.schedule.devices import DEVICES

    dev = DEVICES[device]
    p = plan_matmul(8833, 513, 3969, 1, *BF16, "row", "row", device=device)
    assert p.config.block_k == 128 and not p.config.tail_at
    assert p.smem_bytes + cf.STATIC_SMEM + cf.BARRIER_SMEM <= dev.smem_per_block
    for M, N, K in ((8192, 768, 3072), (8192, 768, 2304), (8833, 513, 2048)):
        c = configure_matmul(M, N, K, 1, *BF16, "row", "row", device=device)
        if c.tail_at:
            t = tail_config(c, K)
            assert t.num_stages * (t.block_m + t.block_n) * 2 * t.block_k <= dev.smem_per_block


def test_the_ir_of_a_config_without_a_tail_is_unchanged():
    c = configure_matmul(8192, 768, 768, 1, *BF16, "row", "col", device="H100")
    assert not any(k.startswith("tail") for k in c.to_dict())
    t = configure_matmul(3072, 768, 8192, 1, *BF16, "col", "row", device="H100")
    d = t.to_dict()
    assert (d["tail_at"], d["tail_axis"], d["tail_split"]) == (2816, "m", 11)
    assert LoweringConfig.from_dict(d) == t and LoweringConfig.from_dict(c.to_dict()) == c


def test_launches_with_a_prologue_are_configured_without_a_tail():
    """The fused LM head's chunk launches take operand prologues, which a cut launch refuses:
    its configs (linear_ce.Configs, and the configure stage's for the op) ask for none, as
    does the launcher configuring an epilogue's or a prologue's launch itself."""
    import torch

    from nova.codegen.triton import linear_ce
    from nova.codegen.triton import matmul as mm

    a = torch.empty(8192, 3072, dtype=torch.bfloat16, device="meta").t()  # [3072, 8192], a dY^T
    b = torch.empty(8192, 768, dtype=torch.bfloat16, device="meta")
    assert mm.configure(3072, 768, 8192, 1, torch.bfloat16, torch.bfloat16, "bf16", "col", "row", False,
                        mm.device_spec(a.device)).tail_at  # the shape is one the rule cuts
    assert not mm.configure(3072, 768, 8192, 1, torch.bfloat16, torch.bfloat16, "bf16", "col", "row", False,
                            mm.device_spec(a.device), tail=False).tail_at
    assert not linear_ce.Configs("bf16")(a, b, torch.bfloat16).tail_at
